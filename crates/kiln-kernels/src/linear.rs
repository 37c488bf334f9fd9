//! f32 fully connected layer on the host: `y = x · W + b` and its gradients, each one GEMM
//! that reads the transposed operand through strides.
//!
//! Why: profiling W2 training after the convolution kernel landed (BENCHMARKS.md run 13) put
//! Burn flex's `copy_2d_tiled` at 9% of the step: its matmul copies a transposed operand
//! into a contiguous buffer before multiplying (fc1's 9216 × 128 weight for `dx = g · Wᵀ`, the
//! 64 × 9216 activation for `dW = xᵀ · g`). The GEMM here takes any strides, so nothing is
//! copied.

use std::mem::MaybeUninit;

use crate::base::buffers::{assume_init, filled};
use crate::base::gemm::{matmul, matmul_fresh, matmul_fresh_split_sum};
use crate::base::threads::pool_threads;

/// Shape of one linear layer: `rows` inputs of `inputs` features to `outputs` features; the
/// weight is `[inputs, outputs]` (Burn's row layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows of `x` (batch × any leading dimensions).
    pub rows: usize,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

/// `y` `[rows, outputs]` = `x` `[rows, inputs]` · `weight` `[inputs, outputs]` + `bias`, into
/// a new vector: the bias copied into each row and the product accumulated onto it, or
/// without a bias the product written straight into memory no zero fill touched first.
pub fn linear_forward(
    s: &LinearShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    assert_eq!(x.len(), s.rows * s.inputs, "linear input length");
    assert_eq!(weight.len(), s.inputs * s.outputs, "linear weight length");
    let dims = (s.rows, s.outputs, s.inputs);
    let (x, w) = ((x, (s.inputs, 1)), (weight, (s.outputs, 1)));
    filled(s.rows * s.outputs, |y| match bias {
        Some(b) if !y.is_empty() => {
            assert_eq!(b.len(), s.outputs, "linear bias length");
            for row in y.chunks_exact_mut(s.outputs) {
                for (v, &b) in row.iter_mut().zip(b) {
                    *v = MaybeUninit::new(b);
                }
            }
            // SAFETY: every row was just written with the bias.
            let y = unsafe { assume_init(y) };
            matmul(dims, y, true, x.0, x.1, w.0, w.1, pool_threads());
        }
        _ => matmul_fresh(dims, y, x, w, pool_threads()),
    })
}

/// `dx` `[rows, inputs]` = `grad` `[rows, outputs]` · `weightᵀ`, into a new vector.
pub fn linear_input_grad(s: &LinearShape, grad: &[f32], weight: &[f32]) -> Vec<f32> {
    assert_eq!(grad.len(), s.rows * s.outputs, "linear gradient length");
    assert_eq!(weight.len(), s.inputs * s.outputs, "linear weight length");
    filled(s.rows * s.inputs, |dx| {
        matmul_fresh(
            (s.rows, s.inputs, s.outputs),
            dx,
            (grad, (s.outputs, 1)),
            (weight, (1, s.outputs)),
            pool_threads(),
        )
    })
}

/// `dweight` `[inputs, outputs]` = `xᵀ` · `grad`, summed over the rows, into a new vector.
pub fn linear_weight_grad(s: &LinearShape, x: &[f32], grad: &[f32]) -> Vec<f32> {
    assert_eq!(x.len(), s.rows * s.inputs, "linear input length");
    assert_eq!(grad.len(), s.rows * s.outputs, "linear gradient length");
    filled(s.inputs * s.outputs, |dw| {
        matmul_fresh_split_sum(
            (s.inputs, s.outputs, s.rows),
            dw,
            (x, (1, s.inputs)),
            (grad, (s.outputs, 1)),
            pool_threads(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// On a 3-thread pool, so the weight gradient of the long shape (600 rows over a
    /// 300 × 450 output, more values than one summing chunk) is summed in three parts.
    #[test]
    fn forward_and_gradients_match_an_f64_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build();
        pool.expect("a thread pool").install(check_against_f64);
    }

    fn check_against_f64() {
        for s in [
            LinearShape {
                rows: 600,
                inputs: 300,
                outputs: 450,
            },
            LinearShape {
                rows: 7,
                inputs: 13,
                outputs: 5,
            },
            LinearShape {
                rows: 64,
                inputs: 300,
                outputs: 128,
            },
            // No rows: empty outputs, a zero weight gradient.
            LinearShape {
                rows: 0,
                inputs: 3,
                outputs: 2,
            },
        ] {
            let (x, w, b, g) = (
                values(s.rows * s.inputs, 1),
                values(s.inputs * s.outputs, 2),
                values(s.outputs, 3),
                values(s.rows * s.outputs, 4),
            );
            let y = linear_forward(&s, &x, &w, Some(&b));
            let dx = linear_input_grad(&s, &g, &w);
            let dw = linear_weight_grad(&s, &x, &g);
            let unbiased = linear_forward(&s, &x, &w, None);
            for ((u, y), b) in unbiased.iter().zip(&y).zip(b.iter().cycle()) {
                assert!(
                    (u + b - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{s:?}: without bias"
                );
            }

            let (mut want_y, mut want_dx, mut want_dw) = (
                vec![0f64; y.len()],
                vec![0f64; dx.len()],
                vec![0f64; dw.len()],
            );
            for r in 0..s.rows {
                for o in 0..s.outputs {
                    let mut acc = b[o] as f64;
                    for i in 0..s.inputs {
                        let (xi, wi) = (x[r * s.inputs + i] as f64, w[i * s.outputs + o] as f64);
                        let gv = g[r * s.outputs + o] as f64;
                        acc += xi * wi;
                        want_dx[r * s.inputs + i] += gv * wi;
                        want_dw[i * s.outputs + o] += gv * xi;
                    }
                    want_y[r * s.outputs + o] = acc;
                }
            }
            for (name, got, want) in [
                ("y", &y, &want_y),
                ("dx", &dx, &want_dx),
                ("dw", &dw, &want_dw),
            ] {
                let scale = want.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
                let err = got
                    .iter()
                    .zip(want.iter())
                    .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()))
                    / scale;
                assert!(err <= 1e-5, "{s:?} {name}: relative error {err:e}");
            }
        }
    }
}
