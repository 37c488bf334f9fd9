//! Softmax along the last axis for inference on the CPU: per row one pass for the maximum,
//! one that stores and sums `e^(x − max)` and one for the scale, each vectorized (the
//! exponential is [`super::activation`]'s branch-free one, the reductions run in 16 lanes, a
//! row's last partial block is padded to a whole one), rows in parallel, read in place.
//!
//! Why: Burn's softmax is built from tensor operations (max, subtract, exp — a scalar libm
//! call per value —, sum, divide), each a pass over a new tensor: ViT-B/16's attention
//! softmax (12 heads × 197² scores per layer) took 7% of a batch-1 run, BERT-base's 5%
//! (BENCHMARKS.md run 41).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::activation::exp;

/// Values per parallel task (whole rows of them).
const CHUNK: usize = 1 << 14;

/// Lanes of the reductions' partial results (one AVX-512 register).
const LANES: usize = 16;

/// The softmax of each `row`-long row of `x`, into a new vector.
///
/// # Panics
/// When `row` is 0 or does not divide `x`'s length.
pub fn softmax_rows(x: &[f32], row: usize) -> Vec<f32> {
    assert!(
        row > 0 && x.len().is_multiple_of(row),
        "softmax rows of {row} over {} values",
        x.len()
    );
    // Each task reads its rows where they are and writes their exponentials straight into
    // the output (a copy of the rows first was 27% of the kernel's time under `perf`).
    let task = (CHUNK / row).max(1) * row;
    let compute = |(src, dst): (&[f32], &mut [MaybeUninit<f32>])| softmax_into(src, dst, row);
    super::filled(x.len(), |out| {
        if x.len() <= CHUNK {
            compute((x, out));
        } else {
            x.par_chunks(task)
                .zip(out.par_chunks_mut(task))
                .for_each(compute);
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
            let scale = 1.0 / sums.iter().sum::<f32>();
            // SAFETY: every value of the row was written just above.
            for v in unsafe { super::assume_init(y) } {
                *v *= scale;
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
    acc.iter().fold(tail, |a, &v| op(a, v))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
