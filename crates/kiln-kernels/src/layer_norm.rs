//! f32 LayerNorm over the last axis for inference on the host: each row's mean and variance
//! and the normalized, scaled and shifted row, in one task per block of rows.
//!
//! Why a kernel: on Burn's operators a LayerNorm is seven passes over memory (mean,
//! subtract, square, mean, add, square root and divide, then scale and shift), each with a
//! fresh tensor; ConvNeXt has one per block, BERT and ViT two per layer.

use rayon::prelude::*;

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
            let (sum, _) = lane_sums(row, row, |v, _| (v, 0.0));
            let first = sum / n as f32;
            let (dev, sq) = lane_sums(row, row, |v, _| (v - first, (v - first) * (v - first)));
            let shift = dev / n as f32;
            let mean = first + shift;
            let var = (sq / n as f32 - shift * shift).max(0.0);
            let inv = 1.0 / (var + epsilon).sqrt();
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
