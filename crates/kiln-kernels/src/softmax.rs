//! Softmax along the last axis for inference on the CPU: per row one pass for the maximum,
//! one that stores and sums `e^(x − max)` and one for the scale, each vectorized (the
//! exponential is [`crate::activation`]'s branch-free one, the reductions run in 16 lanes, a
//! row's last partial block is padded to a whole one), rows in parallel, read in place.
//!
//! Why: Burn's softmax is built from tensor operations (max, subtract, exp — a scalar libm
//! call per value —, sum, divide), each a pass over a new tensor: ViT-B/16's attention
//! softmax (12 heads × 197² scores per layer) took 7% of a batch-1 run, BERT-base's 5%
//! (BENCHMARKS.md run 41).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::activation::exp;

/// Values per parallel task (whole rows of them).
const CHUNK: usize = 1 << 14;

/// Lanes of the reductions' partial results (one AVX-512 register).
pub(crate) const LANES: usize = 16;

/// `op` across the [`LANES`] partial results of a row's reduction, as a tree of halves: four
/// steps LLVM does on whole registers, where folding them one by one was a serial chain of
/// sixteen scalar operations per reduction (two reductions of a 28-key row: the hottest
/// instructions of W4's attention softmax under `perf`).
#[inline(always)]
pub(crate) fn across(mut acc: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] = op(acc[i], acc[i + width]);
        }
        width /= 2;
    }
    acc[0]
}

/// The softmax of each `row`-long row of `x`, into a new vector.
///
/// # Panics
/// When `row` is 0 or does not divide `x`'s length.
pub fn softmax_rows(x: &[f32], row: usize) -> Vec<f32> {
    // Each task reads its rows where they are and writes their exponentials straight into
    // the output (a copy of the rows first was 27% of the kernel's time under `perf`).
    over_rows(x, row, |_, src, dst| softmax_into(src, dst, row))
}

/// `compute(first_row, rows, out)` over `x`'s `row`-long rows into a new vector of its
/// length: on this thread when small, else in tasks of whole rows over the pool.
///
/// # Panics
/// When `row` is 0 or does not divide `x`'s length.
fn over_rows(
    x: &[f32],
    row: usize,
    compute: impl Fn(usize, &[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    assert!(
        row > 0 && x.len().is_multiple_of(row),
        "softmax rows of {row} over {} values",
        x.len()
    );
    let task = (CHUNK / row).max(1) * row;
    crate::base::buffers::filled(x.len(), |out| {
        if x.len() <= CHUNK {
            compute(0, x, out);
        } else {
            x.par_chunks(task)
                .zip(out.par_chunks_mut(task))
                .enumerate()
                .for_each(|(t, (src, dst))| compute(t * (task / row), src, dst));
        }
    })
}

multiversion! {
    /// The softmax of each `row`-long row of `src` into `dst` (as long), on the calling
    /// thread: the maximum, then `e^(x − max)` stored and summed in one pass, then the scale.
    fn softmax_into(src: &[f32], dst: &mut [MaybeUninit<f32>], row: usize) {
        for (x, y) in src.chunks_exact(row).zip(dst.chunks_exact_mut(row)) {
            let max = lanes(x, f32::NEG_INFINITY, f32::max);
            let mut sums = [0.0f32; LANES];
            let mut xs = x.chunks_exact(LANES);
            let mut ys = y.chunks_exact_mut(LANES);
            for (xb, yb) in (&mut xs).zip(&mut ys) {
                for ((s, &v), out) in sums.iter_mut().zip(xb).zip(yb) {
                    let e = exp(v - max);
                    *out = MaybeUninit::new(e);
                    *s += e;
                }
            }
            // The last partial block as a whole one, padded with values whose exponential
            // is 0: a scalar tail (5 of ViT's 197 scores per row) cost a quarter of the time.
            let rest = xs.remainder();
            let mut block = [f32::NEG_INFINITY; LANES];
            block[..rest.len()].copy_from_slice(rest);
            for (s, v) in sums.iter_mut().zip(block.iter_mut()) {
                *v = exp(*v - max);
                *s += *v;
            }
            for (out, &e) in ys.into_remainder().iter_mut().zip(&block) {
                *out = MaybeUninit::new(e);
            }
            let scale = 1.0 / across(sums, |a, b| a + b);
            // SAFETY: every value of the row was written just above.
            for v in unsafe { crate::base::buffers::assume_init(y) } {
                *v *= scale;
            }
        }
    }
}

/// An additive mask broadcast over the rows of a softmax's input: an attention mask
/// (`[batch, 1, 1, keys]` against `[batch, heads, queries, keys]` scores, or any shape that
/// broadcasts to them with the same last axis).
#[derive(Debug, Clone)]
pub struct RowMask<'a> {
    values: &'a [f32],
    /// The scores' dimensions before the last, and the mask's element stride along each
    /// (0 where the mask has 1 and broadcasts).
    outer: Vec<(usize, usize)>,
}

impl<'a> RowMask<'a> {
    /// The mask `values` shaped `mask_dims` against scores shaped `score_dims`, when it
    /// broadcasts to them and has their last axis (a mask that broadcasts along the last axis
    /// too is a per-row constant, which a softmax ignores: callers take the general path).
    pub fn new(values: &'a [f32], mask_dims: &[usize], score_dims: &[usize]) -> Option<Self> {
        let rank = score_dims.len();
        if rank == 0
            || mask_dims.len() > rank
            || mask_dims.iter().product::<usize>() != values.len()
        {
            return None;
        }
        let mut dims = vec![1; rank - mask_dims.len()];
        dims.extend_from_slice(mask_dims);
        if dims[rank - 1] != score_dims[rank - 1] {
            return None;
        }
        let mut outer = Vec::with_capacity(rank - 1);
        let mut stride = dims[rank - 1];
        for axis in (0..rank - 1).rev() {
            let (m, n) = (dims[axis], score_dims[axis]);
            if m != 1 && m != n {
                return None;
            }
            outer.push((n, if m == 1 { 0 } else { stride }));
            stride *= m;
        }
        outer.reverse();
        Some(RowMask { values, outer })
    }

    /// The mask's values for the scores' row `r` (rows counted over every axis but the last).
    fn row(&self, mut r: usize, len: usize) -> &[f32] {
        let mut offset = 0;
        for &(n, stride) in self.outer.iter().rev() {
            offset += (r % n) * stride;
            r /= n;
        }
        &self.values[offset..offset + len]
    }
}

/// The softmax of `x · scale + mask` over each `row`-long row of `x`, into a new vector:
/// an attention's `Softmax(Add(Div(scores, √d), mask))` in one step instead of a division
/// pass and an addition pass over the scores first (BERT-base at batch 1: 1.3 ms of a 27 ms
/// int8 run, BENCHMARKS.md run 43). `scale` multiplies, so a divisor `d` passed as `1 / d`
/// is exact when `d` is a power of two (√64 = 8 in BERT-base) and within an ulp otherwise.
///
/// # Panics
/// When `row` is 0 or does not divide `x`'s length, or the mask's rows are not `row` long.
pub fn softmax_rows_scaled(x: &[f32], row: usize, scale: f32, mask: Option<&RowMask>) -> Vec<f32> {
    over_rows(x, row, |first, src, dst| {
        // Each row's affine values go through one row of scratch (in L1) into the plain
        // softmax kernel.
        let mut z = vec![0f32; row];
        for (r, (x, y)) in src
            .chunks_exact(row)
            .zip(dst.chunks_exact_mut(row))
            .enumerate()
        {
            affine_into(x, scale, mask.map(|m| m.row(first + r, row)), &mut z);
            softmax_into(&z, y, row);
        }
    })
}

multiversion! {
    /// `out = x · scale + mask` (the mask's row when given).
    fn affine_into(x: &[f32], scale: f32, mask: Option<&[f32]>, out: &mut [f32]) {
        match mask {
            Some(m) => {
                for ((o, v), m) in out.iter_mut().zip(x).zip(m) {
                    *o = v * scale + m;
                }
            }
            None => {
                for (o, v) in out.iter_mut().zip(x) {
                    *o = v * scale;
                }
            }
        }
    }
}

/// The softmax's input gradient from its output `probs` and the output's gradient, row by
/// row in place over the latter: `d ← p ⊙ (d − Σ d ⊙ p)` (one pass per row where Burn's
/// autodiff takes a product, a sum, a subtraction and a product, each a new tensor).
///
/// # Panics
/// When `row` is 0 or the lengths differ or are not whole rows.
pub fn softmax_grad_in_place(grad: &mut [f32], probs: &[f32], row: usize) {
    assert!(
        row > 0 && grad.len() == probs.len() && probs.len().is_multiple_of(row),
        "softmax gradient: {} values against {} probabilities in rows of {row}",
        grad.len(),
        probs.len()
    );
    if grad.len() <= CHUNK {
        grad_rows(grad, probs, row);
    } else {
        let task = (CHUNK / row).max(1) * row;
        grad.par_chunks_mut(task)
            .zip(probs.par_chunks(task))
            .for_each(|(g, p)| grad_rows(g, p, row));
    }
}

multiversion! {
    /// [`softmax_grad_in_place`] on this thread.
    fn grad_rows(grad: &mut [f32], probs: &[f32], row: usize) {
        for (d, p) in grad.chunks_exact_mut(row).zip(probs.chunks_exact(row)) {
            let mut sums = [0f32; LANES];
            let mut blocks = d.chunks_exact(LANES).zip(p.chunks_exact(LANES));
            for (db, pb) in &mut blocks {
                for ((s, d), p) in sums.iter_mut().zip(db).zip(pb) {
                    *s += d * p;
                }
            }
            let full = row / LANES * LANES;
            let tail: f32 = d[full..].iter().zip(&p[full..]).map(|(d, p)| d * p).sum();
            let dot = across(sums, |a, b| a + b) + tail;
            for (d, p) in d.iter_mut().zip(p) {
                *d = p * (*d - dot);
            }
        }
    }
}

/// `values` folded by `op` from `init` in [`LANES`] partial results, then across them (a
/// loop LLVM vectorizes; one running value would be a serial chain).
#[inline(always)]
fn lanes(values: &[f32], init: f32, op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; LANES];
    let mut blocks = values.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(block) {
            *a = op(*a, v);
        }
    }
    let tail = blocks.remainder().iter().fold(init, |a, &v| op(a, v));
    op(across(acc, &op), tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gradient against f64 `p ⊙ (d − Σ d ⊙ p)`: rows with a partial block of lanes,
    /// on this thread and over the pool, within 1e-6 of the largest value.
    #[test]
    fn gradient_matches_f64() {
        for (rows, row) in [(3, 37), (400, 197)] {
            let x: Vec<f32> = (0..rows * row)
                .map(|i| ((i * 37) % 101) as f32 * 0.07 - 3.0)
                .collect();
            let probs = softmax_rows(&x, row);
            let d: Vec<f32> = (0..rows * row)
                .map(|i| ((i * 13) % 17) as f32 * 0.1 - 0.8)
                .collect();
            let mut got = d.clone();
            softmax_grad_in_place(&mut got, &probs, row);
            let mut worst = 0f64;
            for ((g, dr), pr) in got.chunks(row).zip(d.chunks(row)).zip(probs.chunks(row)) {
                let dot: f64 = dr
                    .iter()
                    .zip(pr)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                for ((g, d), p) in g.iter().zip(dr).zip(pr) {
                    let want = f64::from(*p) * (f64::from(*d) - dot);
                    worst = worst.max((f64::from(*g) - want).abs());
                }
            }
            assert!(worst < 1e-6, "{rows}×{row}: {worst:e}");
        }
    }

    /// Against the f64 definition: relative error below 1e-6 per value, on rows of odd
    /// length (a partial last block of lanes), large magnitudes (the maximum subtracted
    /// first), attention-mask values (`f32::MIN`: exactly 0 to within 1e-37), few rows (on
    /// the calling thread) and enough to split over the pool, with the same bits either way.
    #[test]
    fn matches_f64_softmax() {
        let row = 197;
        let rows = 200;
        let mut x: Vec<f32> = (0..row * rows)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.013 - 6.0)
            .collect();
        x[5] = 80.0;
        x[row + 3] = -1000.0;
        x[2 * row..3 * row].iter_mut().for_each(|v| *v += 1e4);
        x[3 * row + 10..3 * row + 100].fill(f32::MIN);
        // On the calling thread (4 rows) and over the pool (all of them).
        let mut got = softmax_rows(&x[..4 * row], row);
        assert_eq!(got, softmax_rows(&x, row)[..4 * row]);
        got = softmax_rows(&x, row);
        for (xs, ys) in x.chunks(row).zip(got.chunks(row)) {
            let max = xs.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let sum: f64 = xs.iter().map(|&v| (v as f64 - max).exp()).sum();
            for (&v, &y) in xs.iter().zip(ys) {
                let want = (v as f64 - max).exp() / sum;
                let err = (y as f64 - want).abs();
                assert!(
                    err <= 1e-6 * want + 1e-37,
                    "softmax({v}) = {y}, want {want}"
                );
            }
            let total: f64 = ys.iter().map(|&y| y as f64).sum();
            assert!((total - 1.0).abs() < 1e-5, "row sums to {total}");
        }
    }

    /// `softmax(x · scale + mask)` against the f64 definition for masks that broadcast in
    /// each way an attention's do (`[b, 1, 1, k]`, `[b, 1, q, k]`, `[k]`) and none, on scores
    /// large enough to split over the pool (each task's rows find their own mask rows); masks
    /// that do not broadcast, or broadcast along the last axis, are refused.
    #[test]
    fn scaled_masked_softmax_matches_f64() {
        let dims = [2usize, 3, 50, 120];
        let (rows, k) = (dims[..3].iter().product::<usize>(), dims[3]);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.05 - 25.0)
            .collect();
        let scale = 0.125;
        let masks: [Option<Vec<usize>>; 4] = [
            None,
            Some(vec![2, 1, 1, k]),
            Some(vec![2, 1, 50, k]),
            Some(vec![k]),
        ];
        for mask_dims in masks {
            let values: Vec<f32> = mask_dims.as_ref().map_or(vec![], |d| {
                (0..d.iter().product::<usize>())
                    .map(|i| {
                        if (i * 31) % 7 == 0 {
                            -10_000.0
                        } else {
                            (i % 5) as f32 * 0.1
                        }
                    })
                    .collect()
            });
            let mask = mask_dims
                .as_ref()
                .map(|d| RowMask::new(&values, d, &dims).expect("broadcasts"));
            let got = softmax_rows_scaled(&x, k, scale, mask.as_ref());
            let mask_at = |r: usize, j: usize| -> f64 {
                let Some(d) = &mask_dims else { return 0.0 };
                let (b, q) = (r / (3 * 50), r % 50);
                let row = match d.len() {
                    1 => 0,
                    _ if d[2] == 1 => b,
                    _ => b * 50 + q,
                };
                values[row * k + j] as f64
            };
            for r in 0..rows {
                let z: Vec<f64> = (0..k)
                    .map(|j| x[r * k + j] as f64 * scale as f64 + mask_at(r, j))
                    .collect();
                let max = z.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
                let sum: f64 = z.iter().map(|v| (v - max).exp()).sum();
                for j in 0..k {
                    let want = (z[j] - max).exp() / sum;
                    let y = got[r * k + j] as f64;
                    assert!(
                        (y - want).abs() <= 1e-6 * want + 1e-30,
                        "{mask_dims:?} row {r} col {j}: {y}, want {want}"
                    );
                }
            }
        }
        let values = vec![0.0; 2 * 3 * k];
        assert!(
            RowMask::new(&values[..4 * k], &[2, 2, 1, k], &dims).is_none(),
            "2 vs 3 heads"
        );
        assert!(
            RowMask::new(&values[..6], &[2, 3, 1, 1], &dims).is_none(),
            "a per-row mask"
        );
        assert!(
            RowMask::new(&values, &[1, 2, 3, 1, k], &dims).is_none(),
            "rank 5 vs 4"
        );
    }
}
