//! ONNX `Einsum` as permutes, reshapes and batched matrix products.
//!
//! Operands are contracted left to right. For a pair, every label is a batch label (in both
//! and still needed), a contracted label (in both, needed by nothing after), or belongs to
//! one side; labels no later operand or the output needs are summed out first. The pair
//! becomes one `[batch, rows, k] × [batch, k, cols]` product, the same GEMM a written-out
//! attention would run. Ellipses are expanded to labels of their own; a label repeated
//! within one operand (a diagonal) is refused with a clear error.

use super::super::OnnxError;
use super::super::value::{Value, ValueKind, with_rank};
use super::shape;

/// One operand's labels, ellipsis expanded.
type Labels = Vec<char>;

/// Labels for the axes an ellipsis stands for (outside ASCII, so never a user's label).
fn ellipsis_label(i: usize) -> char {
    char::from_u32(0x2460 + i as u32).unwrap_or('?')
}

fn expand(term: &str, rank: usize, ellipsis_rank: &mut Option<usize>) -> Result<Labels, OnnxError> {
    let named = term
        .replace("...", "")
        .chars()
        .filter(|c| !c.is_whitespace())
        .count();
    if !term.contains("...") {
        return Ok(term.chars().filter(|c| !c.is_whitespace()).collect());
    }
    let e = rank.checked_sub(named).ok_or_else(|| {
        OnnxError::Shape(format!(
            "Einsum term `{term}` for an operand of rank {rank}"
        ))
    })?;
    *ellipsis_rank = Some(ellipsis_rank.map_or(e, |r| r.max(e)));
    let (before, after) = term.split_once("...").unwrap_or((term, ""));
    let mut out: Labels = before.chars().filter(|c| !c.is_whitespace()).collect();
    // Right-aligned, as numpy broadcasts an ellipsis.
    let total = ellipsis_rank.unwrap_or(e);
    out.extend((total - e..total).map(ellipsis_label));
    out.extend(after.chars().filter(|c| !c.is_whitespace()));
    Ok(out)
}

/// Parses `equation` for operands of the given ranks: each operand's labels and the
/// output's.
fn parse(equation: &str, ranks: &[usize]) -> Result<(Vec<Labels>, Labels), OnnxError> {
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (equation, None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ranks.len() {
        return Err(OnnxError::Shape(format!(
            "Einsum `{equation}` names {} operands; the node has {}",
            terms.len(),
            ranks.len()
        )));
    }
    let mut ellipsis = None;
    let inputs = terms
        .iter()
        .zip(ranks)
        .map(|(t, &r)| expand(t, r, &mut ellipsis))
        .collect::<Result<Vec<_>, _>>()?;
    for (labels, &r) in inputs.iter().zip(ranks) {
        if labels.len() != r {
            return Err(OnnxError::Shape(format!(
                "Einsum `{equation}`: a term of {} labels for an operand of rank {r}",
                labels.len()
            )));
        }
        let mut seen = labels.clone();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(OnnxError::Unsupported(format!(
                "Einsum `{equation}`: a label repeated within one operand (a diagonal)"
            )));
        }
    }
    let output = match rhs {
        Some(r) => {
            let mut e = ellipsis;
            let rank = r.replace("...", "").trim().chars().count() + e.unwrap_or(0);
            expand(r.trim(), rank, &mut e)?
        }
        None => {
            // Implicit form: ellipsis labels first, then labels seen once, alphabetically.
            let mut counts = std::collections::BTreeMap::new();
            for l in inputs.iter().flatten() {
                *counts.entry(*l).or_insert(0) += 1;
            }
            let mut out: Labels = (0..ellipsis.unwrap_or(0)).map(ellipsis_label).collect();
            let once: Labels = counts
                .iter()
                .filter(|(l, n)| **n == 1 && !out.contains(l))
                .map(|(l, _)| *l)
                .collect();
            out.extend(once);
            out
        }
    };
    Ok((inputs, output))
}

/// Sums out the axes of `v` whose labels `keep` does not hold.
fn sum_out(v: Value, labels: &Labels, keep: &[char]) -> Result<(Value, Labels), OnnxError> {
    let drop: Vec<usize> = labels
        .iter()
        .enumerate()
        .filter(|(_, l)| !keep.contains(l))
        .map(|(i, _)| i)
        .collect();
    if drop.is_empty() {
        return Ok((v, labels.clone()));
    }
    let kept: Labels = labels
        .iter()
        .filter(|l| keep.contains(l))
        .copied()
        .collect();
    let mut dims = v.dims();
    let rank = v.rank();
    let summed = with_rank!(rank, D => {
        let t = drop.iter().fold(v.f::<D>(), |t, &a| t.sum_dim(a));
        Value::float(t)
    });
    for &a in drop.iter().rev() {
        dims.remove(a);
    }
    let out = if dims.is_empty() {
        summed.reshape(&[1])?.with_scalar(true)
    } else {
        summed.reshape(&dims)?
    };
    Ok((out, kept))
}

fn permuted(v: Value, from: &Labels, to: &Labels) -> Result<Value, OnnxError> {
    if from == to {
        return Ok(v);
    }
    let perm: Vec<i64> = to
        .iter()
        .map(|l| from.iter().position(|m| m == l).unwrap_or(0) as i64)
        .collect();
    shape::transpose(v, &perm)
}

/// Contracts two operands to the labels `want` (those a later operand or the output needs).
fn contract(
    a: (Value, Labels),
    b: (Value, Labels),
    want: &[char],
) -> Result<(Value, Labels), OnnxError> {
    let (a, la) = sum_out(a.0, &a.1, &[b.1.as_slice(), want].concat())?;
    let (b, lb) = sum_out(b.0, &b.1, &[la.as_slice(), want].concat())?;
    let batch: Labels = la
        .iter()
        .filter(|l| lb.contains(l) && want.contains(l))
        .copied()
        .collect();
    let inner: Labels = la
        .iter()
        .filter(|l| lb.contains(l) && !want.contains(l))
        .copied()
        .collect();
    let left: Labels = la.iter().filter(|l| !lb.contains(l)).copied().collect();
    let right: Labels = lb.iter().filter(|l| !la.contains(l)).copied().collect();
    let size = |v: &Value, labels: &Labels, of: &Labels| -> Vec<usize> {
        let d = if v.is_scalar() { vec![] } else { v.dims() };
        of.iter()
            .map(|l| labels.iter().position(|m| m == l).map_or(1, |i| d[i]))
            .collect()
    };
    let (bd, ld, kd) = (
        size(&a, &la, &batch),
        size(&a, &la, &left),
        size(&a, &la, &inner),
    );
    let (bdb, rd, kdb) = (
        size(&b, &lb, &batch),
        size(&b, &lb, &right),
        size(&b, &lb, &inner),
    );
    if kd != kdb {
        return Err(OnnxError::Shape(format!(
            "Einsum: contracted axes of sizes {kd:?} and {kdb:?}"
        )));
    }
    let a_to: Labels = [batch.as_slice(), &left, &inner].concat();
    let b_to: Labels = [batch.as_slice(), &inner, &right].concat();
    let p = |d: &[usize]| d.iter().product::<usize>();
    let nb = p(&bd).max(p(&bdb));
    let a3 = permuted(a, &la, &a_to)?.reshape(&[p(&bd), p(&ld), p(&kd)])?;
    let b3 = permuted(b, &lb, &b_to)?.reshape(&[p(&bdb), p(&kd), p(&rd)])?;
    // A size-1 batch on one side broadcasts.
    let a3 = shape::expand_to(a3, &[nb, p(&ld), p(&kd)])?;
    let b3 = shape::expand_to(b3, &[nb, p(&kd), p(&rd)])?;
    let y = Value::float(a3.f::<3>().matmul(b3.f::<3>()));
    let batch_dims: Vec<usize> = bd.iter().zip(&bdb).map(|(x, y)| *x.max(y)).collect();
    let dims: Vec<usize> = [batch_dims.as_slice(), &ld, &rd].concat();
    let labels: Labels = [batch.as_slice(), &left, &right].concat();
    let y = if dims.is_empty() {
        y.reshape(&[1])?.with_scalar(true)
    } else {
        y.reshape(&dims)?
    };
    Ok((y, labels))
}

/// Evaluates `equation` on `operands`.
pub fn einsum(equation: &str, operands: Vec<Value>) -> Result<Value, OnnxError> {
    let ranks: Vec<usize> = operands.iter().map(|v| v.onnx_dims().len()).collect();
    let (labels, output) = parse(equation, &ranks)?;
    let mut items: Vec<(Value, Labels)> = operands
        .into_iter()
        .map(|v| v.to_kind(ValueKind::Float))
        .zip(labels)
        .map(|(v, l)| v.map(|v| (v, l)))
        .collect::<Result<_, _>>()?;
    if items.is_empty() {
        return Err(OnnxError::Graph("Einsum without operands".into()));
    }
    let mut acc = items.remove(0);
    while !items.is_empty() {
        let next = items.remove(0);
        let later: Labels = items
            .iter()
            .flat_map(|(_, l)| l.iter().copied())
            .chain(output.iter().copied())
            .collect();
        acc = contract(acc, next, &later)?;
    }
    let (v, labels) = sum_out(acc.0, &acc.1, &output)?;
    if output.is_empty() {
        return Ok(v);
    }
    permuted(v, &labels, &output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn value(v: Vec<f32>, dims: &[usize]) -> Value {
        Value::from_data(TensorData::new(v, dims.to_vec()), &Device::default()).unwrap()
    }

    /// A naive einsum over every index assignment, for two operands.
    fn reference(eq: &str, a: (&[f32], &[usize]), b: (&[f32], &[usize])) -> (Vec<f32>, Vec<usize>) {
        let (lhs, out) = eq.split_once("->").unwrap();
        let (ta, tb) = lhs.split_once(',').unwrap();
        let mut sizes = std::collections::BTreeMap::new();
        for (t, d) in [(ta, a.1), (tb, b.1)] {
            for (c, &n) in t.chars().zip(d) {
                sizes.insert(c, n);
            }
        }
        let all: Vec<char> = sizes.keys().copied().collect();
        let odims: Vec<usize> = out.chars().map(|c| sizes[&c]).collect();
        let mut result = vec![0f32; odims.iter().product::<usize>().max(1)];
        let total: usize = all.iter().map(|c| sizes[c]).product();
        let at = |t: &str, dims: &[usize], assign: &std::collections::BTreeMap<char, usize>| {
            t.chars().zip(dims).fold(0, |o, (c, &n)| o * n + assign[&c])
        };
        for flat in 0..total {
            let mut rest = flat;
            let mut assign = std::collections::BTreeMap::new();
            for c in all.iter().rev() {
                assign.insert(*c, rest % sizes[c]);
                rest /= sizes[c];
            }
            let o = at(out, &odims, &assign);
            result[o] += a.0[at(ta, a.1, &assign)] * b.0[at(tb, b.1, &assign)];
        }
        (result, odims)
    }

    #[test]
    fn two_operand_equations_match_a_naive_sum() {
        let cases: &[(&str, &[usize], &[usize])] = &[
            ("bihd,bjhd->bhij", &[2, 3, 2, 4], &[2, 5, 2, 4]),
            ("bhij,bjhd->bihd", &[2, 2, 3, 5], &[2, 5, 2, 4]),
            ("btd,de->bte", &[2, 3, 4], &[4, 6]),
            ("ij,jk->ki", &[3, 4], &[4, 2]),
            ("i,j->ij", &[3], &[4]),
            ("bij,bjk->b", &[2, 3, 4], &[2, 4, 5]),
            ("ij,ij->", &[3, 4], &[3, 4]),
        ];
        for (eq, da, db) in cases {
            let na: usize = da.iter().product();
            let nb: usize = db.iter().product();
            let a: Vec<f32> = (0..na).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1).collect();
            let b: Vec<f32> = (0..nb).map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.1).collect();
            let (want, dims) = reference(eq, (&a, da), (&b, db));
            let got = einsum(eq, vec![value(a.clone(), da), value(b.clone(), db)]).unwrap();
            assert_eq!(got.onnx_dims(), dims, "{eq}");
            let got = got.to_f32s().unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "{eq}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn ellipsis_implicit_output_and_a_transpose() {
        let a = value((0..24).map(|v| v as f32).collect(), &[2, 3, 4]);
        let t = einsum("...ij->...ji", vec![a.clone()]).unwrap();
        assert_eq!(t.dims(), vec![2, 4, 3]);
        let implicit = einsum(
            "ij,jk",
            vec![
                value(vec![1., 2., 3., 4.], &[2, 2]),
                value(vec![1., 0., 0., 1.], &[2, 2]),
            ],
        )
        .unwrap();
        assert_eq!(implicit.to_f32s().unwrap(), vec![1., 2., 3., 4.]);
        let err = einsum("ii->i", vec![value(vec![0.; 4], &[2, 2])]).unwrap_err();
        assert!(err.to_string().contains("diagonal"), "{err}");
    }
}
