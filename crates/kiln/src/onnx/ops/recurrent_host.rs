//! One direction of an LSTM / GRU / RNN layer on host f32 values: per time step one GEMM of
//! the hidden state against the recurrent weights (the input projections of every step were
//! made before, in one GEMM) and the cell's gates in one pass over the batch.
//!
//! Why: on Burn's operators each step is a dozen tensor ops (narrows, three sigmoids, two
//! tanh, products and sums), each a dispatch and an allocation; on the corpus's small
//! sequence models that per-op cost was most of the time (0.14–0.4× ONNX Runtime,
//! BENCHMARKS.md run 55). The arithmetic is ONNX's definition, as the Burn path's.

use kiln_kernels::activation::sigmoid_in_place;
use kiln_kernels::base::gemm::{matmul, matmul_to};
use kiln_kernels::base::threads::{SPLIT_MACS, pool_threads};

use super::recurrent::{Cell, RnnActivation};

/// A direction's operands: `xw` `[steps, batch, gates·hidden]` (input projections with the
/// biases folded in as the caller's Burn path folds them), `rt` the recurrent weights
/// transposed to `[hidden, gates·hidden]`, `lbr_bias` R's bias for a linear-before-reset GRU.
pub struct Operands<'a> {
    /// The cell.
    pub cell: Cell,
    /// Cell clip threshold.
    pub clip: Option<f32>,
    /// Hidden size.
    pub hidden: usize,
    /// Batch size.
    pub batch: usize,
    /// Whether the steps run last to first.
    pub reverse: bool,
    /// Input projections, `[steps, batch, gates·hidden]`.
    pub xw: &'a [f32],
    /// Recurrent weights, `[hidden, gates·hidden]`.
    pub rt: &'a [f32],
    /// R's bias (`gates·hidden`) for a GRU with `linear_before_reset`.
    pub lbr_bias: Option<&'a [f32]>,
}

/// The outputs of one direction: every step's hidden state in time order (`[steps, batch,
/// hidden]`), the last hidden state and the last cell state (`[batch, hidden]`).
pub struct Outputs {
    /// Every step's hidden state.
    pub ys: Vec<f32>,
    /// The hidden state after the last step.
    pub hidden: Vec<f32>,
    /// The cell state after the last step (zeros but for an LSTM).
    pub cell: Vec<f32>,
}

/// Each value's logistic sigmoid (Kiln's vectorized kernel).
fn sigmoid(values: &mut [f32]) {
    sigmoid_in_place(values);
}

/// Each value's tanh as `2·σ(2x) − 1` on the vectorized sigmoid (absolute error ~1e-7): the
/// scalar `f32::tanh` and `exp` per gate value were most of a small LSTM's time.
fn tanh(values: &mut [f32]) {
    values.iter_mut().for_each(|v| *v *= 2.0);
    sigmoid_in_place(values);
    values.iter_mut().for_each(|v| *v = 2.0 * *v - 1.0);
}

/// `out[b, k] = z[b, hidden + k] · other[b, k]`: the second gate of each row of `z` (LSTM's
/// output gate, GRU's reset gate) times a `[batch, hidden]` operand (`z` in rows of `gh`).
fn second_gate_times(out: &mut [f32], z: &[f32], other: &[f32], h: usize, gh: usize) {
    for ((o, zb), x) in out
        .chunks_exact_mut(h)
        .zip(z.chunks_exact(gh))
        .zip(other.chunks_exact(h))
    {
        for k in 0..h {
            o[k] = zb[h + k] * x[k];
        }
    }
}

/// Runs the recurrence from `h0` and `c0` (`[batch, hidden]`).
pub fn run(d: &Operands<'_>, mut hidden: Vec<f32>, mut cell: Vec<f32>) -> Outputs {
    let (h, batch) = (d.hidden, d.batch);
    let gh = d.cell.gates() * h;
    let steps = d.xw.len() / (batch * gh).max(1);
    let clip = |v: f32| d.clip.map_or(v, |c| v.clamp(-c, c));
    // A step's GEMM is batch × hidden × gates·hidden multiply-adds: the pool only pays above
    // the kernels' split threshold.
    let threads = if batch * h * gh >= SPLIT_MACS {
        pool_threads()
    } else {
        1
    };
    // z[:, from..from + n] += lhs · rt[:, from..from + n] (z and rt in rows of gh, lhs
    // [batch, hidden]).
    let recur = |z: &mut [f32], lhs: &[f32], from: usize, n: usize| {
        assert!(from + n <= gh && z.len() == batch * gh && lhs.len() == batch * h);
        // SAFETY: rows 0..batch of n values at stride gh from `from` lie inside `z` (the
        // assert), which is a unique borrow aliasing neither operand.
        unsafe {
            matmul_to(
                (batch, n, h),
                z.as_mut_ptr().add(from),
                gh,
                true,
                (lhs, (h, 1)),
                (&d.rt[from..], (gh, 1)),
                1.0,
                threads,
            )
        }
    };
    let mut ys = vec![0f32; steps * batch * h];
    let mut z = vec![0f32; batch * gh];
    let mut gated = vec![0f32; batch * h];
    for s in 0..steps {
        let t = if d.reverse { steps - 1 - s } else { s };
        z.copy_from_slice(&d.xw[t * batch * gh..(t + 1) * batch * gh]);
        match d.cell {
            Cell::Lstm { coupled } => {
                recur(&mut z, &hidden, 0, gh);
                z.iter_mut().for_each(|v| *v = clip(*v));
                // ONNX's gate order: input, output, forget, cell.
                for zb in z.chunks_exact_mut(gh) {
                    sigmoid(&mut zb[..3 * h]);
                    tanh(&mut zb[3 * h..]);
                }
                for ((zb, cb), hb) in z
                    .chunks_exact(gh)
                    .zip(cell.chunks_exact_mut(h))
                    .zip(gated.chunks_exact_mut(h))
                {
                    for k in 0..h {
                        let i = zb[k];
                        let f = if coupled { 1.0 - i } else { zb[2 * h + k] };
                        cb[k] = f * cb[k] + i * zb[3 * h + k];
                        hb[k] = cb[k];
                    }
                }
                // hidden = o ⊙ tanh(cell), `gated` holding the cell's tanh.
                tanh(&mut gated);
                second_gate_times(&mut hidden, &z, &gated, h, gh);
            }
            Cell::Gru {
                linear_before_reset,
            } => {
                // Update and reset gates (ONNX's order: z, r, then the candidate h).
                recur(&mut z, &hidden, 0, 2 * h);
                let lbr_bias = d.lbr_bias.filter(|_| linear_before_reset);
                for zb in z.chunks_exact_mut(gh) {
                    for (k, v) in zb[..2 * h].iter_mut().enumerate() {
                        *v = clip(*v + lbr_bias.map_or(0.0, |rb| rb[k]));
                    }
                    sigmoid(&mut zb[..2 * h]);
                }
                if linear_before_reset {
                    // r ⊙ (hidden · R_h + R's bias).
                    matmul(
                        (batch, h, h),
                        &mut gated,
                        false,
                        &hidden,
                        (h, 1),
                        &d.rt[2 * h..],
                        (gh, 1),
                        threads,
                    );
                    for (zb, lin) in z.chunks_exact_mut(gh).zip(gated.chunks_exact(h)) {
                        for k in 0..h {
                            let rb = lbr_bias.map_or(0.0, |rb| rb[2 * h + k]);
                            zb[2 * h + k] += zb[h + k] * (lin[k] + rb);
                        }
                    }
                } else {
                    // (r ⊙ hidden) · R_h.
                    second_gate_times(&mut gated, &z, &hidden, h, gh);
                    recur(&mut z, &gated, 2 * h, h);
                }
                for zb in z.chunks_exact_mut(gh) {
                    zb[2 * h..].iter_mut().for_each(|v| *v = clip(*v));
                    tanh(&mut zb[2 * h..]);
                }
                for (zb, hb) in z.chunks_exact(gh).zip(hidden.chunks_exact_mut(h)) {
                    for k in 0..h {
                        let u = zb[k];
                        hb[k] = (1.0 - u) * zb[2 * h + k] + u * hb[k];
                    }
                }
            }
            Cell::Rnn(act) => {
                recur(&mut z, &hidden, 0, gh);
                z.iter_mut().for_each(|v| *v = clip(*v));
                match act {
                    RnnActivation::Tanh => tanh(&mut z),
                    RnnActivation::Relu => z.iter_mut().for_each(|v| *v = v.max(0.0)),
                    RnnActivation::Sigmoid => sigmoid(&mut z),
                }
                hidden.copy_from_slice(&z);
            }
        }
        ys[t * batch * h..(t + 1) * batch * h].copy_from_slice(&hidden);
    }
    Outputs { ys, hidden, cell }
}
