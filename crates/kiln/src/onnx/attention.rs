//! An attention's score normalization as one step: the exported
//! `Softmax(Add(Div(scores, d), mask))` (BERT-style encoders: scores over √head_dim, plus the
//! additive attention mask), or `Softmax(Div(scores, d))`, fused at load.
//!
//! Why: the division and the addition are each a pass over the widest tensor of the layer
//! (`[batch, heads, tokens, tokens]`) and a new temporary; on the host the fused step computes
//! `scores · (1/d) + mask` while it takes each row's maximum, inside the softmax kernel
//! ([`kiln_kernels::softmax::softmax_rows_scaled`]). Elsewhere (another backend, a divisor
//! that is not one value, a mask that does not broadcast along the rows) it runs the three
//! operators as exported.

use onnx_ir::Node;

use super::ops::Inputs;
use super::ops::math::{Binary, binary, softmax};
use super::value::{Value, ValueKind};
use super::{OnnxError, OnnxModel, StepOp};
use kiln_kernels::softmax::{RowMask, softmax_rows_scaled};

/// The fused step: inputs `[scores, divisor]` or `[scores, divisor, mask]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ScaledSoftmax {
    /// The softmax's axis.
    pub axis: usize,
}

impl ScaledSoftmax {
    /// `softmax(scores / d + mask)` over the axis.
    pub(super) fn run(&self, ins: Inputs) -> Result<Vec<Value>, OnnxError> {
        let input = |i: usize| -> Result<Value, OnnxError> {
            ins.get(i)
                .cloned()
                .flatten()
                .ok_or_else(|| OnnxError::Graph("a fused attention softmax lacks an input".into()))
        };
        let (scores, divisor) = (input(0)?.to_kind(ValueKind::Float)?, input(1)?);
        let mask = ins.get(2).cloned().flatten();
        if let Some(y) = self.on_host(&scores, &divisor, mask.as_ref())? {
            return Ok(vec![y]);
        }
        let mut z = binary(Binary::Div, scores, divisor)?;
        if let Some(mask) = mask {
            z = binary(Binary::Add, z, mask)?;
        }
        Ok(vec![softmax(z, self.axis, false)?])
    }

    /// The host kernel's result, when it takes these values: Kiln's kernels serve the
    /// device, the axis is the last, the divisor one float, the mask (if any) an f32 value
    /// that broadcasts along the rows.
    fn on_host(
        &self,
        scores: &Value,
        divisor: &Value,
        mask: Option<&Value>,
    ) -> Result<Option<Value>, OnnxError> {
        let dims = scores.dims();
        let row = dims.last().copied().unwrap_or(0);
        if self.axis + 1 != dims.len()
            || row == 0
            || !crate::kernels::serves(&scores.device())
            || divisor.len() != 1
            || divisor.kind() != ValueKind::Float
            || mask.is_some_and(|m| m.kind() != ValueKind::Float)
        {
            return Ok(None);
        }
        let scale = 1.0 / divisor.to_f32s()?[0];
        let mask_values = mask.map(Value::to_f32s).transpose()?;
        let mask_dims = mask.map(Value::dims);
        let row_mask = match (&mask_values, &mask_dims) {
            (Some(values), Some(mask_dims)) => match RowMask::new(values, mask_dims, &dims) {
                Some(m) => Some(m),
                None => return Ok(None),
            },
            _ => None,
        };
        let _op =
            tracing::trace_span!("kiln.softmax", shape = ?dims, fused = "scale+mask").entered();
        let Some(y) =
            scores.with_f32_view(|v| softmax_rows_scaled(v, row, scale, row_mask.as_ref()))
        else {
            return Ok(None);
        };
        let y = Value::from_data(burn::tensor::TensorData::new(y, dims), &scores.device())?;
        Ok(Some(y.with_scalar(scores.is_scalar())))
    }
}

impl OnnxModel {
    /// Fuses each `Softmax(Add(Div(scores, d), mask))` and `Softmax(Div(scores, d))` whose
    /// intermediate values have no other reader into one [`ScaledSoftmax`] step. Returns how
    /// many were fused.
    pub(super) fn fuse_scaled_softmaxes(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some((axis, inputs, inner)) = self.scaled_softmax_at(at) else {
                at += 1;
                continue;
            };
            self.set_inputs(at, inputs);
            let step = &mut self.steps[at];
            step.op = StepOp::ScaledSoftmax(ScaledSoftmax { axis });
            step.op_name = "ScaledSoftmax".into();
            // Later steps first, so the earlier indices stay valid; both come before `at`.
            let mut inner = inner;
            inner.sort_unstable();
            for &s in inner.iter().rev() {
                self.remove_step(s);
            }
            at -= inner.len();
            at += 1;
            fused += 1;
        }
        fused
    }

    /// When step `at` is a Softmax of a sole `Div` (optionally through a sole `Add` of a
    /// mask): its axis, the fused step's inputs and the steps it replaces.
    fn scaled_softmax_at(&self, at: usize) -> Option<(usize, Vec<Option<usize>>, Vec<usize>)> {
        let step = &self.steps[at];
        let Some(Node::Softmax(node)) = step.op.node() else {
            return None;
        };
        if !step.plain_single() {
            return None;
        }
        let axis = node.config.axis;
        let input = step.inputs.first().copied().flatten()?;
        let producer = self.sole_producer(input)?;
        let two = |s: usize| match self.steps[s].inputs[..] {
            [Some(a), Some(b)] if self.steps[s].plain_single() => Some((a, b)),
            _ => None,
        };
        let is_div = |s: usize| matches!(self.steps[s].op.node(), Some(Node::Div(_)));
        if is_div(producer) {
            let (scores, d) = two(producer)?;
            return Some((axis, vec![Some(scores), Some(d)], vec![producer]));
        }
        if !matches!(self.steps[producer].op.node(), Some(Node::Add(_))) {
            return None;
        }
        let (a, b) = two(producer)?;
        // The Add's operand the Div wrote; the other is the mask.
        let (div, mask) = [(a, b), (b, a)]
            .into_iter()
            .find_map(|(x, m)| self.sole_producer(x).filter(|&s| is_div(s)).map(|s| (s, m)))?;
        let (scores, d) = two(div)?;
        Some((
            axis,
            vec![Some(scores), Some(d), Some(mask)],
            vec![div, producer],
        ))
    }
}
