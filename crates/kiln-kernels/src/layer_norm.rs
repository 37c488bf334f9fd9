//! f32 LayerNorm over the last axis on the host: for inference each row's mean and variance
//! and the normalized, scaled and shifted row, in one task per block of rows; for training
//! the same forward keeping each row's mean and 1/σ ([`layer_norm_train`]), and the
//! backward's three gradients in one pass over the rows ([`layer_norm_backward`]).
//!
//! Why a kernel: on Burn's operators a LayerNorm is seven passes over memory (mean,
//! subtract, square, mean, add, square root and divide, then scale and shift), each with a
//! fresh tensor; ConvNeXt has one per block, BERT and ViT two per layer.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::buffers::filled;
use crate::norm::lane_sums;

/// Values from which rows are normalized in parallel blocks.
const PARALLEL_MIN: usize = 1 << 15;

/// Normalizes each row of `gamma.len()` values of `x` in place: `(x − mean) / √(var + ε) · γ
/// + β` (no shift without `beta`), the variance biased (over the row's length), as ONNX's
/// LayerNormalization and `torch.nn.LayerNorm`.
///
/// # Panics
/// When `x` is not whole rows or `beta`'s length differs from `gamma`'s.
pub fn layer_norm_rows(x: &mut [f32], gamma: &[f32], beta: Option<&[f32]>, epsilon: f32) {
    let n = gamma.len();
    if n == 0 || x.is_empty() {
        return;
    }
    assert_eq!(x.len() % n, 0, "layer norm input is not whole rows of {n}");
    if let Some(b) = beta {
        assert_eq!(b.len(), n, "layer norm shift length");
    }
    let block = n * (PARALLEL_MIN / n).max(1);
    let run = |rows: &mut [f32]| normalize_rows(rows, gamma, beta.unwrap_or(&[]), epsilon);
    if x.len() < PARALLEL_MIN {
        run(x);
    } else {
        x.par_chunks_mut(block).for_each(run);
    }
}

multiversion! {
    /// [`layer_norm_rows`] on this thread (`beta` empty for none). A first mean, then the
    /// sums of the deviations from it and of their squares (the row is in cache for the
    /// second pass): the deviations' mean corrects the first mean's rounding, and the
    /// variance comes from deviations rather than from E[x²] − E[x]², which in f32 loses
    /// every digit when the mean is large against the spread.
    fn normalize_rows(x: &mut [f32], gamma: &[f32], beta: &[f32], epsilon: f32) {
        let n = gamma.len();
        for row in x.chunks_exact_mut(n) {
            let (mean, inv) = row_stats(row, epsilon);
            if beta.is_empty() {
                for (v, g) in row.iter_mut().zip(gamma) {
                    *v = (*v - mean) * inv * g;
                }
            } else {
                for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
                    *v = (*v - mean) * inv * g + b;
                }
            }
        }
    }
}

/// A row's mean and `1/√(var + ε)` (biased variance): a first mean, then the sums of the
/// deviations from it and of their squares (the row is in cache for the second pass); the
/// deviations' mean corrects the first mean's rounding, and the variance comes from
/// deviations rather than from E[x²] − E[x]², which in f32 loses every digit when the mean
/// is large against the spread.
#[inline(always)]
fn row_stats(row: &[f32], epsilon: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let (sum, _) = lane_sums(row, row, |v, _| (v, 0.0));
    let first = sum / n;
    let (dev, sq) = lane_sums(row, row, |v, _| (v - first, (v - first) * (v - first)));
    let shift = dev / n;
    let var = (sq / n - shift * shift).max(0.0);
    (first + shift, 1.0 / (var + epsilon).sqrt())
}

/// `(Σ g, Σ g·x̂)` over a row, `g = dy·γ` and `x̂ = (x − mean)·inv`, in 16 independent lanes
/// (as [`lane_sums`], for three slices).
#[inline(always)]
fn gradient_sums(x: &[f32], dy: &[f32], gamma: &[f32], mean: f32, inv: f32) -> (f32, f32) {
    const LANES: usize = 16;
    let (mut a, mut b) = ([0f32; LANES], [0f32; LANES]);
    let blocks = x.len() / LANES * LANES;
    for ((xs, ds), gs) in x[..blocks]
        .chunks_exact(LANES)
        .zip(dy[..blocks].chunks_exact(LANES))
        .zip(gamma[..blocks].chunks_exact(LANES))
    {
        for i in 0..LANES {
            let g = ds[i] * gs[i];
            a[i] += g;
            b[i] += g * (xs[i] - mean) * inv;
        }
    }
    let (mut sa, mut sb) = (a.iter().sum::<f32>(), b.iter().sum::<f32>());
    for ((v, d), g) in x[blocks..].iter().zip(&dy[blocks..]).zip(&gamma[blocks..]) {
        sa += d * g;
        sb += d * g * (v - mean) * inv;
    }
    (sa, sb)
}

/// Blocks read together (`x` and `dy`, or the means and 1/σ, in the backward), and a block
/// of rows read beside one written (the forward).
type InRows<'a> = (&'a [f32], &'a [f32]);
type OutRows<'a> = (&'a [f32], &'a mut [MaybeUninit<f32>]);

/// Rows of `n` values per parallel task: whole rows, about [`PARALLEL_MIN`] values.
fn task_rows(n: usize) -> usize {
    (PARALLEL_MIN / n).max(1)
}

/// Training LayerNorm over each row of `gamma.len()` values of `x`: the output `(x − mean)
/// / √(var + ε) · γ + β` (no shift without `beta`) and each row's statistics, `[mean of
/// every row …, 1/σ of every row …]` (what [`layer_norm_backward`] reads).
///
/// # Panics
/// When `gamma` is empty, `x` is not whole rows, or `beta`'s length differs from `gamma`'s.
pub fn layer_norm_train(
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>) {
    let n = gamma.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "layer norm input is not whole rows of {n}"
    );
    if let Some(b) = beta {
        assert_eq!(b.len(), n, "layer norm shift length");
    }
    let rows = x.len() / n;
    let per_task = task_rows(n);
    let mut stats = vec![0f32; 2 * rows];
    let (means, invs) = stats.split_at_mut(rows);
    let beta = beta.unwrap_or(&[]);
    let y = filled(x.len(), |y| {
        let task = |((x, y), (m, i)): (OutRows, (&mut [f32], &mut [f32]))| {
            normalize_train(x, y, m, i, gamma, beta, epsilon)
        };
        let block = per_task * n;
        if x.len() < PARALLEL_MIN {
            let stats = means.chunks_mut(per_task).zip(invs.chunks_mut(per_task));
            x.chunks(block)
                .zip(y.chunks_mut(block))
                .zip(stats)
                .for_each(task);
        } else {
            let stats = means
                .par_chunks_mut(per_task)
                .zip(invs.par_chunks_mut(per_task));
            x.par_chunks(block)
                .zip(y.par_chunks_mut(block))
                .zip(stats)
                .for_each(task);
        }
    });
    (y, stats)
}

multiversion! {
    /// [`layer_norm_train`] over a block of rows on this thread (`beta` empty for none).
    fn normalize_train(
        x: &[f32],
        y: &mut [MaybeUninit<f32>],
        means: &mut [f32],
        invs: &mut [f32],
        gamma: &[f32],
        beta: &[f32],
        epsilon: f32,
    ) {
        let n = gamma.len();
        let rows = x.chunks_exact(n).zip(y.chunks_exact_mut(n));
        for ((x, y), (m, i)) in rows.zip(means.iter_mut().zip(invs.iter_mut())) {
            let (mean, inv) = row_stats(x, epsilon);
            (*m, *i) = (mean, inv);
            if beta.is_empty() {
                for ((o, v), g) in y.iter_mut().zip(x).zip(gamma) {
                    *o = MaybeUninit::new((v - mean) * inv * g);
                }
            } else {
                for (((o, v), g), b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                    *o = MaybeUninit::new((v - mean) * inv * g + b);
                }
            }
        }
    }
}

/// The gradients of [`layer_norm_train`] from its input `x`, its `stats` and the output's
/// gradient `dy`: `(dx, dγ, dβ)`. With `x̂ = (x − mean)/σ` and `g = dy · γ`, each row's `dx =
/// (g − mean(g) − x̂ · mean(g · x̂)) / σ`; `dγ = Σ dy · x̂` and `dβ = Σ dy` over the rows.
/// One pass: each task sums its rows' parts of dγ and dβ, and the tasks' sums are added.
///
/// # Panics
/// When the lengths disagree (`x` and `dy` whole rows of `gamma.len()`, `stats` two per row).
pub fn layer_norm_backward(
    x: &[f32],
    stats: &[f32],
    gamma: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = gamma.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "layer norm input is not whole rows of {n}"
    );
    assert_eq!(dy.len(), x.len(), "layer norm gradient length");
    let rows = x.len() / n;
    assert_eq!(stats.len(), 2 * rows, "layer norm statistics length");
    let (means, invs) = stats.split_at(rows);
    let per_task = task_rows(n);
    let mut sums = vec![0f32; 2 * n];
    let dx = filled(x.len(), |dx| {
        let task = |((rows, dx), (m, i)): ((InRows, &mut [MaybeUninit<f32>]), InRows)| {
            let (x, dy) = rows;
            // [dγ part | dβ part] of this block of rows.
            let mut part = vec![0f32; 2 * n];
            backward_rows(x, dy, dx, m, i, gamma, &mut part);
            part
        };
        let block = per_task * n;
        // The blocks' sums in block order, then added in that order: the same bits on every
        // run whatever thread computed which block (a resumed run reproduces its gradients).
        let blocks: Vec<Vec<f32>> = if x.len() < PARALLEL_MIN {
            let stats = means.chunks(per_task).zip(invs.chunks(per_task));
            let rows = x.chunks(block).zip(dy.chunks(block));
            rows.zip(dx.chunks_mut(block))
                .zip(stats)
                .map(task)
                .collect()
        } else {
            let stats = means.par_chunks(per_task).zip(invs.par_chunks(per_task));
            let rows = x.par_chunks(block).zip(dy.par_chunks(block));
            rows.zip(dx.par_chunks_mut(block))
                .zip(stats)
                .map(task)
                .collect()
        };
        sums = vec![0f32; 2 * n];
        for block in blocks {
            sums.iter_mut().zip(&block).for_each(|(a, b)| *a += b);
        }
    });
    let dbeta = sums.split_off(n);
    (dx, sums, dbeta)
}

multiversion! {
    /// [`layer_norm_backward`] over a block of rows on this thread, adding their dγ and dβ
    /// to `part` (`[dγ | dβ]`).
    fn backward_rows(
        x: &[f32],
        dy: &[f32],
        dx: &mut [MaybeUninit<f32>],
        means: &[f32],
        invs: &[f32],
        gamma: &[f32],
        part: &mut [f32],
    ) {
        let n = gamma.len();
        let (dgamma, dbeta) = part.split_at_mut(n);
        let rows = x.chunks_exact(n).zip(dy.chunks_exact(n)).zip(dx.chunks_exact_mut(n));
        for (((x, dy), dx), (&mean, &inv)) in rows.zip(means.iter().zip(invs)) {
            let (sum_g, sum_gx) = gradient_sums(x, dy, gamma, mean, inv);
            let (a, b) = (sum_g / n as f32, sum_gx / n as f32);
            for (((o, v), d), (g, (dg, db))) in dx
                .iter_mut()
                .zip(x)
                .zip(dy)
                .zip(gamma.iter().zip(dgamma.iter_mut().zip(dbeta.iter_mut())))
            {
                let xhat = (v - mean) * inv;
                *o = MaybeUninit::new((d * g - a - xhat * b) * inv);
                *dg += d * xhat;
                *db += d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::{relative_error, values};

    /// The f64 reference: mean, biased variance, normalize, scale, shift.
    fn reference(x: &[f32], gamma: &[f32], beta: Option<&[f32]>, epsilon: f64) -> Vec<f64> {
        let n = gamma.len();
        x.chunks_exact(n)
            .flat_map(|row| {
                let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
                let var = row
                    .iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
                    / n as f64;
                let inv = 1.0 / (var + epsilon).sqrt();
                row.iter()
                    .enumerate()
                    .map(move |(i, &v)| {
                        let b = beta.map_or(0.0, |b| f64::from(b[i]));
                        (f64::from(v) - mean) * inv * f64::from(gamma[i]) + b
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Rows of BERT's and ConvNeXt's widths, a row with a remainder past the 16 lanes, a
    /// large offset (the mean dominates the spread), with and without a shift, serial and
    /// in parallel blocks: within 1e-5 of the f64 reference.
    #[test]
    fn rows_match_the_f64_reference() {
        for (rows, n, offset, shifted) in [
            (3, 768, 0.0, true),
            (49, 96, 0.0, false),
            (5, 37, 100.0, true),
            (400, 384, 3.0, true),
        ] {
            let mut x: Vec<f32> = values(rows * n, 1).iter().map(|v| v + offset).collect();
            let gamma = values(n, 2);
            let beta = values(n, 3);
            let beta = shifted.then_some(&beta[..]);
            let want = reference(&x, &gamma, beta, 1e-5);
            layer_norm_rows(&mut x, &gamma, beta, 1e-5);
            let err = relative_error(&x, &want);
            assert!(err < 1e-5, "{rows}×{n} offset {offset}: {err:e}");
        }
    }
}

#[cfg(test)]
mod train_tests {
    use super::*;
    use crate::base::testing::{relative_error, values};

    /// f64 reference of the forward's output and the three gradients for `Σ y·dy`.
    #[allow(clippy::type_complexity)]
    fn reference(
        x: &[f32],
        gamma: &[f32],
        beta: Option<&[f32]>,
        dy: &[f32],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let n = gamma.len();
        let (mut y, mut dx) = (Vec::new(), Vec::new());
        let (mut dg, mut db) = (vec![0f64; n], vec![0f64; n]);
        for (row, drow) in x.chunks_exact(n).zip(dy.chunks_exact(n)) {
            let row: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
            let mean = row.iter().sum::<f64>() / n as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * inv).collect();
            let g: Vec<f64> = (0..n)
                .map(|i| f64::from(drow[i]) * f64::from(gamma[i]))
                .collect();
            let a = g.iter().sum::<f64>() / n as f64;
            let b = g.iter().zip(&xhat).map(|(g, h)| g * h).sum::<f64>() / n as f64;
            for i in 0..n {
                let shift = beta.map_or(0.0, |b| f64::from(b[i]));
                y.push(xhat[i] * f64::from(gamma[i]) + shift);
                dx.push((g[i] - a - xhat[i] * b) * inv);
                dg[i] += f64::from(drow[i]) * xhat[i];
                db[i] += f64::from(drow[i]);
            }
        }
        (y, dx, dg, db)
    }

    /// The training forward and every gradient within 1e-5 of the f64 reference: rows of a
    /// transformer's width, an odd width (a partial block of lanes), a large offset, with
    /// and without a shift, on this thread and over the pool; the statistics are each row's
    /// mean and 1/σ, and the backward gives the same bits on every call.
    #[test]
    fn training_forward_and_gradients_match_the_f64_reference() {
        for (rows, n, offset, shifted) in [
            (3, 128, 0.0, true),
            (7, 37, 50.0, false),
            (1000, 128, 1.0, true),
            (300, 203, -3.0, true),
        ] {
            let x: Vec<f32> = values(rows * n, 1)
                .iter()
                .map(|v| v * 2.0 + offset)
                .collect();
            let gamma: Vec<f32> = values(n, 2).iter().map(|v| v + 1.0).collect();
            let beta = values(n, 3);
            let beta = shifted.then_some(&beta[..]);
            let dy = values(rows * n, 4);
            let (want_y, want_dx, want_dg, want_db) = reference(&x, &gamma, beta, &dy, 1e-5);
            let (y, stats) = layer_norm_train(&x, &gamma, beta, 1e-5);
            assert!(relative_error(&y, &want_y) < 1e-5, "{rows}×{n} y");
            assert_eq!(stats.len(), 2 * rows);
            let mean0 = x[..n].iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
            assert!((f64::from(stats[0]) - mean0).abs() < 1e-5 * (1.0 + mean0.abs()));
            let (dx, dg, db) = layer_norm_backward(&x, &stats, &gamma, &dy);
            for (name, got, want) in [
                ("dx", &dx, &want_dx),
                ("dγ", &dg, &want_dg),
                ("dβ", &db, &want_db),
            ] {
                let err = relative_error(got, want);
                assert!(err < 1e-5, "{rows}×{n} offset {offset}: {name} {err:e}");
            }
            let again = layer_norm_backward(&x, &stats, &gamma, &dy);
            assert_eq!((dx, dg, db), again, "the same bits on every call");
        }
    }

    /// Rows that are constant (variance 0) normalize to β and pass only ε's share of the
    /// gradient: finite everywhere.
    #[test]
    fn constant_rows_stay_finite() {
        let (n, rows) = (16, 4);
        let x = vec![3.0f32; n * rows];
        let gamma = vec![1.0f32; n];
        let beta = vec![0.5f32; n];
        let (y, stats) = layer_norm_train(&x, &gamma, Some(&beta), 1e-5);
        assert!(y.iter().all(|&v| (v - 0.5).abs() < 1e-6), "{y:?}");
        let dy = values(n * rows, 9);
        let (dx, dg, db) = layer_norm_backward(&x, &stats, &gamma, &dy);
        assert!(dx.iter().chain(&dg).chain(&db).all(|v| v.is_finite()));
    }
}
