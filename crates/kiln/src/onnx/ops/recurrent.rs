//! Recurrent layers: ONNX `LSTM`, `GRU` and `RNN` (forward, reverse, bidirectional; initial
//! states; batch-first layout; cell clipping; LSTM's coupled input-forget gate).
//!
//! Each direction projects every time step's input at once (one GEMM over
//! `[steps · batch, input]`), then runs one GEMM per time step over the batch for the
//! recurrence, with the gates' element-wise arithmetic on the `[batch, gates · hidden]`
//! result.

use burn::tensor::{DType, Tensor, TensorData, activation};

use super::super::OnnxError;
use super::super::value::{Value, ValueKind};
use super::recurrent_host;

/// Which recurrent cell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cell {
    /// LSTM (gates i, o, f, c); `coupled`: the forget gate is `1 - input gate`.
    Lstm {
        /// ONNX `input_forget`.
        coupled: bool,
    },
    /// GRU (gates z, r, h); `linear_before_reset` as ONNX defines it.
    Gru {
        /// ONNX `linear_before_reset` (PyTorch exports 1).
        linear_before_reset: bool,
    },
    /// An Elman RNN with the given activation.
    Rnn(RnnActivation),
}

/// The activation of a plain RNN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RnnActivation {
    /// tanh (the default, and PyTorch's `nonlinearity="tanh"`).
    Tanh,
    /// ReLU (PyTorch's `nonlinearity="relu"`).
    Relu,
    /// Sigmoid.
    Sigmoid,
}

impl Cell {
    /// Gates per step: 4 (LSTM), 3 (GRU), 1 (RNN).
    pub(super) fn gates(self) -> usize {
        match self {
            Cell::Lstm { .. } => 4,
            Cell::Gru { .. } => 3,
            Cell::Rnn(_) => 1,
        }
    }
}

/// Direction(s) a layer runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// First step to last.
    Forward,
    /// Last step to first.
    Reverse,
    /// Both, outputs stacked forward then reverse.
    Bidirectional,
}

/// A recurrent node's inputs and settings.
#[derive(Debug)]
pub struct Recurrent {
    /// The cell.
    pub cell: Cell,
    /// Direction(s).
    pub direction: Direction,
    /// Hidden size.
    pub hidden: usize,
    /// `layout = 1`: X and Y batch-first.
    pub batch_first: bool,
    /// Cell clip threshold.
    pub clip: Option<f32>,
}

/// A tensor's values on the host, in its logical (row-major) order.
fn host_f32<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, OnnxError> {
    t.into_data()
        .try_into_vec::<f32>()
        .map_err(|e| OnnxError::Unsupported(format!("recurrent layer values: {e:?}")))
}

fn float(v: Value) -> Result<Value, OnnxError> {
    v.to_kind(ValueKind::Float)
}

/// Runs the layer: `x`, `w`, `r`, optional bias, initial hidden and (LSTM) cell state.
/// Returns `[Y, Y_h]` (and `Y_c` for LSTM).
#[allow(clippy::too_many_arguments)]
pub fn run(
    spec: &Recurrent,
    x: Value,
    w: Value,
    r: Value,
    bias: Option<Value>,
    initial_h: Option<Value>,
    initial_c: Option<Value>,
) -> Result<Vec<Value>, OnnxError> {
    let xd = x.dims();
    if xd.len() != 3 {
        return Err(OnnxError::Shape(format!(
            "a recurrent layer takes a rank-3 input; got {xd:?}"
        )));
    }
    let h = spec.hidden;
    let g = spec.cell.gates();
    let dirs = if spec.direction == Direction::Bidirectional {
        2
    } else {
        1
    };
    // [steps, batch, input]
    let mut x = float(x)?.f::<3>();
    if spec.batch_first {
        x = x.swap_dims(0, 1);
    }
    let [steps, batch, input] = x.dims();
    let w = float(w)?.f::<3>();
    let r = float(r)?.f::<3>();
    if w.dims() != [dirs, g * h, input] || r.dims() != [dirs, g * h, h] {
        return Err(OnnxError::Shape(format!(
            "recurrent weights W {:?} / R {:?} for {dirs} direction(s), {g} gate(s) of hidden \
             size {h} and input size {input}",
            w.dims(),
            r.dims()
        )));
    }
    let device = x.device();
    let bias = bias.map(|b| float(b).map(|b| b.f::<2>())).transpose()?;
    let state = |v: Option<Value>| -> Result<Tensor<3>, OnnxError> {
        match v {
            Some(v) => {
                let t = float(v)?.f::<3>();
                let t = if spec.batch_first {
                    t.swap_dims(0, 1)
                } else {
                    t
                };
                if t.dims() != [dirs, batch, h] {
                    return Err(OnnxError::Shape(format!(
                        "a recurrent initial state of {:?}; expected {:?}",
                        t.dims(),
                        [dirs, batch, h]
                    )));
                }
                Ok(t)
            }
            None => Ok(Tensor::zeros([dirs, batch, h], &device)),
        }
    };
    let (h0, c0) = (state(initial_h)?, state(initial_c)?);
    // Kiln's host loop on the CPU in f32 (recurrent_host.rs); Burn's operators elsewhere.
    let host = crate::kernels::serves(&device) && x.dtype() == DType::F32;
    let flat = x.reshape([steps * batch, input]);
    let mut ys = Vec::with_capacity(dirs);
    let mut hs = Vec::with_capacity(dirs);
    let mut cs = Vec::with_capacity(dirs);
    for d in 0..dirs {
        let reverse = spec.direction == Direction::Reverse || d == 1;
        let wd = w.clone().narrow(0, d, 1).reshape([g * h, input]);
        let rd = r.clone().narrow(0, d, 1).reshape([g * h, h]).transpose();
        // Input projections of every step: [steps, batch, g·h], with W's bias (and, for
        // the gates that add it, R's).
        let mut xw = flat.clone().matmul(wd.transpose());
        let (wb, rb) = match &bias {
            Some(b) => {
                let bd = b.clone().narrow(0, d, 1).reshape([2 * g * h]);
                (
                    Some(bd.clone().narrow(0, 0, g * h)),
                    Some(bd.narrow(0, g * h, g * h)),
                )
            }
            None => (None, None),
        };
        if let Some(wb) = &wb {
            xw = xw + wb.clone().unsqueeze::<2>();
        }
        let gru_lbr = matches!(
            spec.cell,
            Cell::Gru {
                linear_before_reset: true
            }
        );
        // Every cell but a linear-before-reset GRU adds R's bias outside the recurrence.
        if let (Some(rb), false) = (&rb, gru_lbr) {
            xw = xw + rb.clone().unsqueeze::<2>();
        }
        let xw = xw.reshape([steps, batch, g * h]);
        let mut hidden = h0.clone().narrow(0, d, 1).reshape([batch, h]);
        let mut cell = c0.clone().narrow(0, d, 1).reshape([batch, h]);
        if host {
            let lbr_bias = match (&rb, gru_lbr) {
                (Some(rb), true) => Some(host_f32(rb.clone())?),
                _ => None,
            };
            let (xw, rt) = (host_f32(xw)?, host_f32(rd)?);
            let operands = recurrent_host::Operands {
                cell: spec.cell,
                clip: spec.clip,
                hidden: h,
                batch,
                reverse,
                xw: &xw,
                rt: &rt,
                lbr_bias: lbr_bias.as_deref(),
            };
            let out = recurrent_host::run(&operands, host_f32(hidden)?, host_f32(cell)?);
            let state =
                |v: Vec<f32>| Tensor::<2>::from_data(TensorData::new(v, [batch, h]), &device);
            ys.push(Tensor::<3>::from_data(
                TensorData::new(out.ys, [steps, batch, h]),
                &device,
            ));
            hs.push(state(out.hidden));
            cs.push(state(out.cell));
            continue;
        }
        let mut outs: Vec<Tensor<2>> = Vec::with_capacity(steps);
        let clip = |t: Tensor<2>| match spec.clip {
            Some(c) => t.clamp(-c, c),
            None => t,
        };
        let gate = |t: &Tensor<2>, i: usize| t.clone().narrow(1, i * h, h);
        for s in 0..steps {
            let t = if reverse { steps - 1 - s } else { s };
            let xt = xw.clone().narrow(0, t, 1).reshape([batch, g * h]);
            match spec.cell {
                Cell::Lstm { coupled } => {
                    let z = clip(xt + hidden.clone().matmul(rd.clone()));
                    let i = activation::sigmoid(gate(&z, 0));
                    let o = activation::sigmoid(gate(&z, 1));
                    let f = if coupled {
                        i.clone().neg() + 1.0
                    } else {
                        activation::sigmoid(gate(&z, 2))
                    };
                    let c = gate(&z, 3).tanh();
                    cell = f * cell + i * c;
                    hidden = o * cell.clone().tanh();
                }
                Cell::Gru {
                    linear_before_reset,
                } => {
                    let rz = rd.clone().narrow(1, 0, 2 * h);
                    let rh = rd.clone().narrow(1, 2 * h, h);
                    let mut zr = xt.clone().narrow(1, 0, 2 * h) + hidden.clone().matmul(rz);
                    if let (Some(rb), true) = (&rb, linear_before_reset) {
                        zr = zr + rb.clone().narrow(0, 0, 2 * h).unsqueeze::<2>();
                    }
                    let zr = activation::sigmoid(clip(zr));
                    let (zg, rg) = (gate(&zr, 0), gate(&zr, 1));
                    let xh = xt.narrow(1, 2 * h, h);
                    let hh = if linear_before_reset {
                        let mut lin = hidden.clone().matmul(rh);
                        if let Some(rb) = &rb {
                            lin = lin + rb.clone().narrow(0, 2 * h, h).unsqueeze::<2>();
                        }
                        xh + rg * lin
                    } else {
                        xh + (rg * hidden.clone()).matmul(rh)
                    };
                    let cand = clip(hh).tanh();
                    hidden = (zg.clone().neg() + 1.0) * cand + zg * hidden;
                }
                Cell::Rnn(act) => {
                    let z = clip(xt + hidden.clone().matmul(rd.clone()));
                    hidden = match act {
                        RnnActivation::Tanh => z.tanh(),
                        RnnActivation::Relu => activation::relu(z),
                        RnnActivation::Sigmoid => activation::sigmoid(z),
                    };
                }
            }
            outs.push(hidden.clone());
        }
        if reverse {
            outs.reverse();
        }
        // [steps, batch, h]
        let y = if outs.is_empty() {
            Tensor::zeros([0, batch, h], &device)
        } else {
            Tensor::stack::<3>(outs, 0)
        };
        ys.push(y);
        hs.push(hidden);
        cs.push(cell);
    }
    // Y: [steps, dirs, batch, h]; Y_h / Y_c: [dirs, batch, h] (batch-first: [batch, steps,
    // dirs, h] and [batch, dirs, h]).
    let y = Tensor::stack::<4>(ys, 1);
    let yh = Tensor::stack::<3>(hs, 0);
    let yc = Tensor::stack::<3>(cs, 0);
    let (y, yh, yc) = if spec.batch_first {
        (
            y.permute([2, 0, 1, 3]),
            yh.swap_dims(0, 1),
            yc.swap_dims(0, 1),
        )
    } else {
        (y, yh, yc)
    };
    let mut out = vec![Value::float(y), Value::float(yh)];
    if matches!(spec.cell, Cell::Lstm { .. }) {
        out.push(Value::float(yc));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    fn random<const D: usize>(dims: [usize; D], device: &Device) -> Value {
        Value::float(Tensor::<D>::random(
            dims,
            Distribution::Normal(0.0, 0.6),
            device,
        ))
    }

    /// Kiln's host loop (recurrent_host.rs) against the layer on Burn's operators, for every
    /// cell and variant: LSTM plain and coupled, GRU with and without linear_before_reset,
    /// RNN's three activations, clip, each direction, biases and initial states, batch-first.
    #[test]
    fn the_host_loop_matches_burns_operators_for_every_cell() {
        let device = Device::flex();
        let (steps, batch, input, hidden) = (5, 3, 4, 6);
        let cells = [
            Cell::Lstm { coupled: false },
            Cell::Lstm { coupled: true },
            Cell::Gru {
                linear_before_reset: false,
            },
            Cell::Gru {
                linear_before_reset: true,
            },
            Cell::Rnn(RnnActivation::Tanh),
            Cell::Rnn(RnnActivation::Relu),
            Cell::Rnn(RnnActivation::Sigmoid),
        ];
        let directions = [
            Direction::Forward,
            Direction::Reverse,
            Direction::Bidirectional,
        ];
        for cell in cells {
            for direction in directions {
                for (clip, batch_first) in [(None, false), (Some(0.7), true)] {
                    let spec = Recurrent {
                        cell,
                        direction,
                        hidden,
                        batch_first,
                        clip,
                    };
                    let dirs = if direction == Direction::Bidirectional {
                        2
                    } else {
                        1
                    };
                    let g = cell.gates() * hidden;
                    let x_dims = if batch_first {
                        [batch, steps, input]
                    } else {
                        [steps, batch, input]
                    };
                    let state_dims = if batch_first {
                        [batch, dirs, hidden]
                    } else {
                        [dirs, batch, hidden]
                    };
                    let operands = (
                        random(x_dims, &device),
                        random([dirs, g, input], &device),
                        random([dirs, g, hidden], &device),
                        random([dirs, 2 * g], &device),
                        random(state_dims, &device),
                        random(state_dims, &device),
                    );
                    let run_with = |kernels: bool| {
                        let _scope = crate::kernels::Scope::enter(kernels);
                        let (x, w, r, b, h0, c0) = operands.clone();
                        let c0 = matches!(cell, Cell::Lstm { .. }).then_some(c0);
                        run(&spec, x, w, r, Some(b), Some(h0), c0).expect("the layer runs")
                    };
                    let (host, burn) = (run_with(true), run_with(false));
                    assert_eq!(host.len(), burn.len());
                    for (i, (a, b)) in host.into_iter().zip(burn).enumerate() {
                        assert_eq!(a.dims(), b.dims(), "{spec:?} output {i}");
                        let (a, b) = (a.to_f32s().expect("f32"), b.to_f32s().expect("f32"));
                        let err = a
                            .iter()
                            .zip(&b)
                            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        assert!(err < 1e-5, "{spec:?} output {i}: {err:e}");
                    }
                }
            }
        }
    }
}
