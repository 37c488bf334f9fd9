//! f32 fully connected layer on the host: `y = x · W + b` and its gradients, each one GEMM
//! that reads the transposed operand through strides.
//!
//! Why: profiling W2 training after the convolution kernel landed (BENCHMARKS.md run 13) put
//! Burn flex's `copy_2d_tiled` at 9% of the step: its matmul copies a transposed operand
//! into a contiguous buffer before multiplying (fc1's 9216 × 128 weight for `dx = g · Wᵀ`, the
//! 64 × 9216 activation for `dW = xᵀ · g`). The GEMM here takes any strides, so nothing is
//! copied.

use crate::base::gemm::matmul;
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

/// `y` `[rows, outputs]` = `x` `[rows, inputs]` · `weight` `[inputs, outputs]` + `bias`.
pub fn linear_forward(
    s: &LinearShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    assert_eq!(x.len(), s.rows * s.inputs, "linear input length");
    assert_eq!(weight.len(), s.inputs * s.outputs, "linear weight length");
    assert_eq!(y.len(), s.rows * s.outputs, "linear output length");
    if y.is_empty() {
        return;
    }
    if let Some(b) = bias {
        assert_eq!(b.len(), s.outputs, "linear bias length");
        for row in y.chunks_exact_mut(s.outputs) {
            row.copy_from_slice(b);
        }
    }
    matmul(
        (s.rows, s.outputs, s.inputs),
        y,
        bias.is_some(),
        x,
        (s.inputs, 1),
        weight,
        (s.outputs, 1),
        pool_threads(),
    );
}

/// `dx` `[rows, inputs]` = `grad` `[rows, outputs]` · `weightᵀ`.
pub fn linear_input_grad(s: &LinearShape, grad: &[f32], weight: &[f32], dx: &mut [f32]) {
    assert_eq!(grad.len(), s.rows * s.outputs, "linear gradient length");
    assert_eq!(weight.len(), s.inputs * s.outputs, "linear weight length");
    assert_eq!(dx.len(), s.rows * s.inputs, "linear input-gradient length");
    if dx.is_empty() {
        return;
    }
    matmul(
        (s.rows, s.inputs, s.outputs),
        dx,
        false,
        grad,
        (s.outputs, 1),
        weight,
        (1, s.outputs),
        pool_threads(),
    );
}

/// `dweight` `[inputs, outputs]` = `xᵀ` · `grad`, summed over the rows.
pub fn linear_weight_grad(s: &LinearShape, x: &[f32], grad: &[f32], dweight: &mut [f32]) {
    assert_eq!(x.len(), s.rows * s.inputs, "linear input length");
    assert_eq!(grad.len(), s.rows * s.outputs, "linear gradient length");
    assert_eq!(
        dweight.len(),
        s.inputs * s.outputs,
        "linear weight-gradient length"
    );
    if s.rows == 0 {
        dweight.fill(0.0);
        return;
    }
    matmul(
        (s.inputs, s.outputs, s.rows),
        dweight,
        false,
        x,
        (1, s.inputs),
        grad,
        (s.outputs, 1),
        pool_threads(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn forward_and_gradients_match_an_f64_reference() {
        for s in [
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
        ] {
            let (x, w, b, g) = (
                values(s.rows * s.inputs, 1),
                values(s.inputs * s.outputs, 2),
                values(s.outputs, 3),
                values(s.rows * s.outputs, 4),
            );
            let mut y = vec![f32::NAN; s.rows * s.outputs];
            linear_forward(&s, &x, &w, Some(&b), &mut y);
            let mut dx = vec![f32::NAN; x.len()];
            linear_input_grad(&s, &g, &w, &mut dx);
            let mut dw = vec![f32::NAN; w.len()];
            linear_weight_grad(&s, &x, &g, &mut dw);

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
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
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
