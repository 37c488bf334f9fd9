//! Quantized models as users bring them (QDQ: `QuantizeLinear` / `DequantizeLinear` around
//! each layer, as ONNX Runtime's `quantize_static` and PyTorch's quantizers write them), run
//! on Kiln's integer kernels with the model's own scales.
//!
//! A Conv, MatMul or Gemm whose input is `DQ(Q(x, s, z))` and whose weight is `DQ` of a
//! constant int8 tensor (symmetric: zero point 0, per tensor or per output channel) becomes
//! one int8 step that reads `x` itself and quantizes it with `(s, z)` — what the `Q` node
//! computes — then multiplies the model's own int8 weights, accumulating in int32 and
//! dequantizing with `s · w_scale` plus the bias in its epilogue: the integer arithmetic
//! ONNX Runtime's QLinearConv does. The Q/DQ pair is dropped when nothing else reads it.
//! What remains `DequantizeLinear` of a constant (a depthwise layer's weight, a bias) is
//! folded into an f32 constant at load, so every other kernel sees plain weights.

use super::*;
use crate::onnx::ops;
use kiln_kernels::int8::QuantWeight;
use onnx_ir::DType;

/// A `Q` node's parameters: per-tensor scale and zero point, the integer range.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Grid {
    scale: f32,
    zero: i64,
    lo: i64,
    hi: i64,
}

impl Grid {
    /// The grid as Kiln's activation quantizer takes it: unsigned, the zero point shifted by
    /// the range's low end (int8's −128..=127 is uint8's 0..=255 less 128: the same grid).
    fn activation_quant(self) -> Option<ActivationQuant> {
        let (zero, top) = (self.zero - self.lo, self.hi - self.lo);
        (top == 255 && (0..=255).contains(&zero) && self.scale > 0.0 && self.scale.is_finite())
            .then_some(ActivationQuant {
                scale: self.scale,
                zero_point: zero as u8,
                max_level: 255,
            })
    }
}

/// A constant's integers and the per-channel scales of its `DequantizeLinear`.
struct ConstantQuant {
    values: Vec<i64>,
    dims: Vec<usize>,
    scales: Vec<f32>,
    zeros: Vec<i64>,
    axis: i64,
}

impl OnnxModel {
    /// Puts every QDQ Conv / MatMul / Gemm with constant int8 weights on the integer kernels,
    /// then folds the remaining dequantized constants; returns the change lines (empty for a
    /// float model).
    pub(in crate::onnx) fn lower_qdq(&mut self) -> Result<Vec<String>, OnnxError> {
        let kernel = Int8Kernel::detect();
        let (mut convs, mut linears, mut kept) = (0, 0, 0);
        for at in 0..self.steps.len() {
            let result = match self.steps[at].op.node() {
                Some(Node::Conv2d(_)) => self.static_conv(at, kernel)?.map(|()| true),
                Some(Node::MatMul(_)) => self.static_linear(at, false, None, kernel)?,
                // onnx-ir's name for a Gemm it recognized as a linear layer.
                Some(Node::Linear(n)) => {
                    let out_major = n.config.transpose_weight;
                    self.static_linear(at, out_major, Some(2), kernel)?
                }
                Some(Node::Gemm(n))
                    if n.config.alpha == 1.0
                        && n.config.trans_a == 0
                        && (n.config.beta == 1.0 || self.steps[at].inputs.len() < 3) =>
                {
                    let trans_b = n.config.trans_b != 0;
                    self.static_linear(at, trans_b, Some(2), kernel)?
                }
                _ => continue,
            };
            match result {
                Some(true) if matches!(self.steps[at].op, StepOp::QConv(_)) => convs += 1,
                Some(_) => linears += 1,
                None if self.quantized_input(at).is_some() => kept += 1,
                None => {}
            }
        }
        let pairs = self.fuse_quantize_dequantize();
        let removed = self.remove_dead_quantize_steps();
        let folded = self.fold_constant_dequantizes()?;
        let mut changes = Vec::new();
        if convs + linears > 0 {
            changes.push(format!(
                "static int8: {convs} convolution(s), {linears} linear layer(s) on the integer \
                 kernels with the model's scales; {removed} Q/DQ node(s) absorbed"
            ));
        }
        if pairs > 0 {
            changes.push(format!(
                "{pairs} Q/DQ pair(s) fused into one f32 rounding step each"
            ));
        }
        if kept > 0 {
            changes.push(format!(
                "{kept} quantized layer(s) run as dequantize + f32 (grouped or auto-padded \
                 convolutions, asymmetric or non-constant weights)"
            ));
        }
        if folded > 0 {
            changes.push(format!("{folded} dequantized constant(s) folded to f32"));
        }
        Ok(changes)
    }

    /// The producing step of `slot` when it is an ONNX operator.
    fn producer_node(&self, slot: usize) -> Option<(usize, &Node)> {
        let at = self.producer(slot)?;
        Some((at, self.steps[at].op.node()?))
    }

    /// For a layer at `at` whose input 0 is `DQ(Q(x))` with one per-tensor grid: `x`'s slot
    /// and the grid.
    fn quantized_input(&self, at: usize) -> Option<(usize, Grid)> {
        let dq_out = self.steps[at].inputs.first().copied().flatten()?;
        self.qdq_pair(dq_out).map(|(_, _, x, grid)| (x, grid))
    }

    /// When `dq_out` is written by `DQ(Q(x))` of one per-tensor grid (equal parameters on
    /// both nodes): the Q and DQ steps, `x`'s slot and the grid.
    fn qdq_pair(&self, dq_out: usize) -> Option<(usize, usize, usize, Grid)> {
        let (dq_at, Node::DequantizeLinear(_)) = self.producer_node(dq_out)? else {
            return None;
        };
        let dq = &self.steps[dq_at];
        let q_out = dq.inputs.first().copied().flatten()?;
        let (q_at, Node::QuantizeLinear(qn)) = self.producer_node(q_out)? else {
            return None;
        };
        let q = &self.steps[q_at];
        let (lo, hi) = ops::quant::quant_range(qn.outputs[0].ty.elem_type()).ok()?;
        if !matches!(qn.outputs[0].ty.elem_type(), DType::U8 | DType::I8) {
            return None;
        }
        let param = |step: &crate::onnx::Step, i: usize| -> Option<Value> {
            match step.inputs.get(i).copied().flatten() {
                Some(s) => self.constants[s].clone(),
                None => None,
            }
        };
        let scalar_f = |v: Option<Value>| -> Option<f32> {
            let v = v?.to_f32s().ok()?;
            (v.len() == 1).then(|| v[0])
        };
        let scalar_i = |v: Option<Value>, absent: bool| -> Option<i64> {
            match v {
                None if absent => Some(0),
                None => None,
                Some(v) => {
                    let v = v.to_i64s().ok()?;
                    (v.len() == 1).then(|| v[0])
                }
            }
        };
        let (qs, ds) = (scalar_f(param(q, 1))?, scalar_f(param(dq, 1))?);
        let q_absent = q.inputs.get(2).copied().flatten().is_none();
        let d_absent = dq.inputs.get(2).copied().flatten().is_none();
        let (qz, dz) = (
            scalar_i(param(q, 2), q_absent)?,
            scalar_i(param(dq, 2), d_absent)?,
        );
        if qs != ds || qz != dz {
            return None;
        }
        let x = q.inputs.first().copied().flatten()?;
        // Q reads floats: a value the int8 step can quantize itself.
        if self.constants[x].is_some() {
            return None;
        }
        Some((
            q_at,
            dq_at,
            x,
            Grid {
                scale: qs,
                zero: qz,
                lo,
                hi,
            },
        ))
    }

    /// Every Q → DQ pair whose int8 tensor only the DQ reads becomes one f32 step (the
    /// Q/DQ chains the integer layers did not absorb: around residual sums, depthwise
    /// layers, pooling). Returns how many.
    fn fuse_quantize_dequantize(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let pair = match self.steps[at].op.node() {
                Some(Node::DequantizeLinear(_)) => self.steps[at]
                    .outputs
                    .first()
                    .and_then(|&out| self.qdq_pair(out)),
                _ => None,
            };
            let Some((q_at, dq_at, x, grid)) = pair else {
                at += 1;
                continue;
            };
            let q_out = self.steps[q_at].outputs[0];
            if self.uses[q_out] != 1 || self.output_slots.contains(&q_out) {
                at += 1;
                continue;
            }
            let op = ops::quant::QuantizeDequantize {
                scale: grid.scale,
                zero: grid.zero as f32,
                lo: grid.lo as f32,
                hi: grid.hi as f32,
            };
            self.replace(dq_at, StepOp::QuantizeDequantize(op));
            self.rewire(dq_at, 0, x);
            // The Q step now has no reader; it is removed with the other dead ones.
            fused += 1;
            at += 1;
        }
        fused
    }

    /// The constant integers behind `slot` when it is `DequantizeLinear` of constants.
    fn dequantized_constant(&self, slot: usize) -> Option<ConstantQuant> {
        let (at, Node::DequantizeLinear(n)) = self.producer_node(slot)? else {
            return None;
        };
        let step = &self.steps[at];
        let get = |i: usize| -> Option<&Value> {
            self.constants[step.inputs.get(i).copied().flatten()?].as_ref()
        };
        let q = get(0)?;
        let scales = get(1)?.to_f32s().ok()?;
        let zeros = match step.inputs.get(2).copied().flatten() {
            Some(_) => get(2)?.to_i64s().ok()?,
            None => vec![0; scales.len()],
        };
        Some(ConstantQuant {
            values: q.to_i64s().ok()?,
            dims: q.onnx_dims(),
            scales,
            zeros,
            axis: n.config.axis.unwrap_or(1),
        })
    }

    /// A bias input: absent, a float constant, or a dequantized constant (int32, as the
    /// quantizers write it), as floats of length `n`. `Err(())` when it is none of those.
    fn static_bias(&self, slot: Option<usize>, n: usize) -> Result<Option<Vec<f32>>, ()> {
        let Some(slot) = slot else {
            return Ok(None);
        };
        let values = if let Some((b, _)) = self.constant_f32s(Some(slot)) {
            b
        } else {
            let c = self.dequantized_constant(slot).ok_or(())?;
            let per = |i: usize| if c.scales.len() == 1 { 0 } else { i };
            c.values
                .iter()
                .enumerate()
                .map(|(i, &q)| (q - c.zeros[per(i)]) as f32 * c.scales[per(i)])
                .collect()
        };
        (values.len() == n).then_some(Some(values)).ok_or(())
    }

    /// What a layer at `at` needs to run in static int8: its input's slot before the Q/DQ
    /// pair, that pair's grid, and the constant int8 weight (input 1).
    fn static_operands(&self, at: usize) -> Option<(usize, ActivationQuant, ConstantQuant)> {
        let (x, grid) = self.quantized_input(at)?;
        let quant = grid.activation_quant()?;
        let w = self.steps[at].inputs.get(1).copied().flatten()?;
        Some((x, quant, self.dequantized_constant(w)?))
    }

    /// Conv step `at` onto the integer implicit GEMM with the model's grid and weights.
    fn static_conv(&mut self, at: usize, kernel: Int8Kernel) -> Result<Option<()>, OnnxError> {
        let Some(Node::Conv2d(n)) = self.steps[at].op.node() else {
            return Ok(None);
        };
        let Some(geometry) = super::int8::int8_conv_geometry(&n.config) else {
            return Ok(None);
        };
        let Some((x, quant, w)) = self.static_operands(at) else {
            return Ok(None);
        };
        let step = &self.steps[at];
        let [co, ci, kh, kw]: [usize; 4] = match w.dims.as_slice().try_into() {
            Ok(d) => d,
            Err(_) => return Ok(None),
        };
        let Some(weight) = symmetric_rows(&w, co, ci * kh * kw, 0) else {
            return Ok(None);
        };
        let Ok(bias) = self.static_bias(step.inputs.get(2).copied().flatten(), co) else {
            return Ok(None);
        };
        let weight = pack_conv_weights(&weight, ci, &geometry, kernel);
        self.replace(
            at,
            StepOp::QConv(QConv {
                weight,
                bias,
                geometry,
                relu: false,
                input_quant: Some(quant),
            }),
        );
        self.rewire(at, 0, x);
        Ok(Some(()))
    }

    /// MatMul / Gemm step `at` (weight input 1, `[out, in]` when `out_major`, else
    /// `[in, out]`; bias input `bias_input` for a Gemm) onto the integer GEMM.
    fn static_linear(
        &mut self,
        at: usize,
        out_major: bool,
        bias_input: Option<usize>,
        kernel: Int8Kernel,
    ) -> Result<Option<bool>, OnnxError> {
        if self.steps[at].residual.is_some() {
            return Ok(None);
        }
        let Some((x, quant, w)) = self.static_operands(at) else {
            return Ok(None);
        };
        let step = &self.steps[at];
        let [d0, d1]: [usize; 2] = match w.dims.as_slice().try_into() {
            Ok(d) => d,
            Err(_) => return Ok(None),
        };
        let (out, inp) = if out_major { (d0, d1) } else { (d1, d0) };
        // The output channel's axis in the stored matrix.
        let out_axis = if out_major { 0 } else { 1 };
        let rows = if out_major {
            w.values.clone()
        } else {
            let mut t = vec![0i64; w.values.len()];
            for i in 0..inp {
                for o in 0..out {
                    t[o * inp + i] = w.values[i * out + o];
                }
            }
            t
        };
        let w = ConstantQuant { values: rows, ..w };
        let Some(weight) = symmetric_rows(&w, out, inp, out_axis) else {
            return Ok(None);
        };
        let bias_slot = bias_input.and_then(|i| step.inputs.get(i).copied().flatten());
        let Ok(bias) = self.static_bias(bias_slot, out) else {
            return Ok(None);
        };
        let weight = PackedWeights::new(&weight, kernel);
        self.replace(
            at,
            StepOp::QLinear(QLinear {
                weight,
                bias,
                act: None,
                input_quant: Some(quant),
            }),
        );
        self.rewire(at, 0, x);
        Ok(Some(false))
    }

    /// Removes Q and DQ steps nothing reads any more (the int8 steps read their inputs);
    /// returns how many.
    fn remove_dead_quantize_steps(&mut self) -> usize {
        let mut removed = 0;
        loop {
            let dead = self.steps.iter().position(|s| {
                matches!(
                    s.op.node(),
                    Some(Node::QuantizeLinear(_) | Node::DequantizeLinear(_))
                ) && s
                    .outputs
                    .iter()
                    .all(|&o| self.uses[o] == 0 && !self.output_slots.contains(&o))
            });
            let Some(at) = dead else {
                return removed;
            };
            self.remove_step(at);
            removed += 1;
        }
    }

    /// Every `DequantizeLinear` of constants computed once: its output becomes a constant
    /// and the step goes. Returns how many.
    fn fold_constant_dequantizes(&mut self) -> Result<usize, OnnxError> {
        let mut folded = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let step = &self.steps[at];
            let all_constant = step
                .inputs
                .iter()
                .all(|s| s.is_none_or(|s| self.constants[s].is_some()));
            if let (Some(node @ Node::DequantizeLinear(_)), true) = (step.op.node(), all_constant) {
                let ins: Vec<Option<Value>> = step
                    .inputs
                    .iter()
                    .map(|s| s.and_then(|s| self.constants[s].clone()))
                    .collect();
                let out = step.outputs[0];
                let value = ops::run(node, &ins, &self.device)?.into_iter().next();
                self.constants[out] = value;
                self.remove_step(at);
                folded += 1;
                continue;
            }
            at += 1;
        }
        Ok(folded)
    }
}

/// A constant's integers as symmetric int8 rows (`rows × cols`, the output channel along
/// `out_axis` of the stored tensor, already laid out row-major by channel), when they are
/// int8 with zero points 0 and one scale per tensor or per output channel.
fn symmetric_rows(
    w: &ConstantQuant,
    rows: usize,
    cols: usize,
    out_axis: usize,
) -> Option<QuantWeight> {
    if w.zeros.iter().any(|&z| z != 0) || w.values.len() != rows * cols {
        return None;
    }
    let rank = w.dims.len() as i64;
    let axis = if w.axis < 0 { w.axis + rank } else { w.axis };
    let scales = match w.scales.len() {
        1 => vec![w.scales[0]; rows],
        n if n == rows && axis == out_axis as i64 => w.scales.clone(),
        _ => return None,
    };
    let values = w
        .values
        .iter()
        .map(|&v| i8::try_from(v).ok())
        .collect::<Option<Vec<i8>>>()?;
    Some(QuantWeight {
        rows,
        cols,
        values,
        scales,
    })
}
