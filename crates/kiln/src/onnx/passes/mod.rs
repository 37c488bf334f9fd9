//! Rewrites of an imported model, each reported: BatchNorm folded into the convolution before
//! it, and int8 dynamic quantization of linear layers and convolutions with constant weights
//! onto Kiln's integer kernels (a following ReLU fused into their epilogue).
//!
//! The int8 scheme is the one Kiln's own graphs use (`kiln_kernels::int8`): weights per
//! output channel, symmetric i8; activations per call, asymmetric u8 over their measured range.

mod fold;
mod fuse;
mod int8;
mod static_int8;

pub(in crate::onnx) use fold::affine;
pub(in crate::onnx) use int8::{QConv, QLinear};

use std::collections::BTreeSet;

use burn::tensor::TensorData;
use onnx_ir::Node;
use onnx_ir::node::padding::{AutoPad, PaddingConfig2d};
use serde::Serialize;

use super::ops::Inputs;
use super::value::{Value, ValueKind};
use super::{OnnxError, OnnxModel, StepOp};
use crate::infer::ConvGeometry;
use kiln_kernels::activation::Activation;
use kiln_kernels::base::isa::Int8Kernel;
use kiln_kernels::int8::{
    ActivationQuant, ImageLayout, PackedWeights, QuantizedActivations, matmul_dequantized,
    matmul_dequantized_residual, pack_conv_weights, quantize_rows, range_of,
};

/// A pass over an imported model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnnxPass {
    /// Fold each BatchNormalization into the convolution it reads (when nothing else reads
    /// the convolution's output and every parameter is a constant); one that follows
    /// something else becomes a precomputed per-channel `x · scale + shift`.
    Fold,
    /// Winograd F(2×2, 3×3) for the 3×3 stride-1 convolutions the kernels' rule takes (the
    /// default without this pass); limited to some layers (`only`), every other convolution
    /// stays on the implicit GEMM — what `kiln optimize --onnx` keeps where Winograd timed
    /// slower.
    Winograd,
    /// Int8 dynamic quantization of Linear, Gemm, MatMul-by-a-constant and ungrouped Conv;
    /// a ReLU that is the only reader of such a layer runs in its epilogue.
    Int8,
    /// Image layers channels-last on Kiln's CPU kernels (the default; no rewrite):
    /// `kiln optimize --onnx` times them against Burn's ops on NCHW tensors and writes
    /// `kiln_kernels = false` into the serving config where Burn's are faster.
    ChannelsLast,
}

impl OnnxPass {
    /// Parses `fold,winograd,int8`; an unknown name is an error listing the known ones.
    pub fn parse_list(list: &str) -> Result<Vec<OnnxPass>, OnnxError> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "fold" => Ok(OnnxPass::Fold),
                "winograd" => Ok(OnnxPass::Winograd),
                "int8" => Ok(OnnxPass::Int8),
                "channels-last" => Ok(OnnxPass::ChannelsLast),
                other => Err(OnnxError::Unsupported(format!(
                    "pass `{other}` on an ONNX model; the passes are fold, winograd, int8 and \
                     channels-last"
                ))),
            })
            .collect()
    }

    /// The pass's name as `parse_list` takes it.
    pub fn name(self) -> &'static str {
        match self {
            OnnxPass::Fold => "fold",
            OnnxPass::Winograd => "winograd",
            OnnxPass::Int8 => "int8",
            OnnxPass::ChannelsLast => "channels-last",
        }
    }
}

/// What one pass changed.
#[derive(Debug, Clone, Serialize)]
pub struct OnnxPassReport {
    /// The pass.
    pub pass: OnnxPass,
    /// Nodes before and after.
    pub nodes_before: usize,
    /// Nodes after the pass.
    pub nodes_after: usize,
    /// One line per kind of change (`folded 20 BatchNormalization into Conv`).
    pub changes: Vec<String>,
}

fn first(ins: Inputs) -> Result<Value, OnnxError> {
    ins.first()
        .cloned()
        .flatten()
        .ok_or_else(|| OnnxError::Graph("an int8 layer has no input".into()))
}

fn host_value(
    values: Vec<f32>,
    dims: &[usize],
    device: &burn::tensor::Device,
) -> Result<Value, OnnxError> {
    Value::from_data(TensorData::new(values, dims.to_vec()), device)
}

/// A fused activation step on values.
pub(super) fn activation(ins: Inputs, act: Activation) -> Result<Vec<Value>, OnnxError> {
    Ok(vec![activate(act, first(ins)?)?])
}

/// `act(x)` on values (a step's fused activation where the host kernels did not run it).
pub(super) fn activate(act: Activation, x: Value) -> Result<Value, OnnxError> {
    use super::ops::math::{Binary, Unary, binary, unary};
    let op = match act {
        Activation::Relu => Unary::Relu,
        Activation::Clip(lo, hi) => Unary::Clip(Some(lo), Some(hi)),
        Activation::Sigmoid => Unary::Sigmoid,
        Activation::HardSigmoid(a, b) => Unary::HardSigmoid(a, b),
        Activation::HardSwish => Unary::HardSwish,
        Activation::Gelu => Unary::Gelu,
        Activation::Silu => return binary(Binary::Mul, x.clone(), unary(Unary::Sigmoid, x)?),
    };
    unary(op, x)
}

impl OnnxModel {
    /// Applies `pass` and reports what it changed.
    pub fn apply(&mut self, pass: OnnxPass) -> Result<OnnxPassReport, OnnxError> {
        self.apply_to(pass, None)
    }

    /// [`OnnxModel::apply`] with the int8 or Winograd pass limited to the layers (node names)
    /// in `only` — the layers `kiln optimize --onnx` measured faster that way; the fold pass
    /// ignores it.
    pub fn apply_to(
        &mut self,
        pass: OnnxPass,
        only: Option<&BTreeSet<String>>,
    ) -> Result<OnnxPassReport, OnnxError> {
        let nodes_before = self.steps.len();
        // The passes rewrite single layers: fused pairs are taken apart first (and fused
        // again below where both layers still fit).
        self.unfuse_expand_depthwises();
        self.unfuse_concat_convs();
        let mut changes = match pass {
            OnnxPass::Fold => self.fold_batch_norm()?,
            OnnxPass::Winograd => self.allow_winograd(only),
            OnnxPass::Int8 => self.quantize_int8(only)?,
            // A choice of kernels, made where the model is loaded (`with_kiln_kernels`).
            OnnxPass::ChannelsLast => Vec::new(),
        };
        // Weights packed by earlier runs may be stale now (a fold rewires a convolution to
        // new constants): every layer packs again on its next run.
        for step in &mut self.steps {
            step.packed = Default::default();
        }
        // The steps changed: the shape arithmetic is found again.
        self.shape_cache.reset();
        // A fold can put an activation right after a convolution.
        let fused = self.fuse_activations();
        if fused > 0 {
            changes.push(format!(
                "{fused} activation(s) fused into the layer before them"
            ));
        }
        self.fuse_concat_convs();
        self.fuse_expand_depthwises();
        // Constants nothing reads any more (folded or packed weights) are dropped.
        for (slot, constant) in self.constants.iter_mut().enumerate() {
            if self.uses[slot] == 0 && !self.output_slots.contains(&slot) {
                *constant = None;
            }
        }
        Ok(OnnxPassReport {
            pass,
            nodes_before,
            nodes_after: self.steps.len(),
            changes,
        })
    }

    /// Lets the 3×3 convolutions in `only` (every one when `None`) run as Winograd and keeps
    /// the others on the implicit GEMM; one line per convolution kept off it.
    fn allow_winograd(&mut self, only: Option<&BTreeSet<String>>) -> Vec<String> {
        let mut changes = Vec::new();
        for step in &mut self.steps {
            // Only a 3×3, stride-1, ungrouped convolution can run as Winograd.
            let Some(Node::Conv2d(n)) = step.op.node() else {
                continue;
            };
            let c = &n.config;
            if c.kernel_size != [3, 3]
                || c.stride != [1, 1]
                || c.dilation != [1, 1]
                || c.groups != 1
            {
                continue;
            }
            step.winograd = only.is_none_or(|o| o.contains(&step.name));
            if !step.winograd {
                changes.push(format!(
                    "{}: implicit GEMM (Winograd measured slower)",
                    step.name
                ));
            }
        }
        changes
    }

    /// Bytes of the constants the model holds (int8 weights at one byte per element plus
    /// their scales; what is loaded per instance).
    pub fn weight_bytes(&self) -> usize {
        let constants: usize = self
            .constants
            .iter()
            .map(|c| c.as_ref().map_or(0, |v| v.len() * 4))
            .sum();
        let packed: usize = self
            .steps
            .iter()
            .map(|s| match &s.op {
                StepOp::QLinear(q) => q.weight.rows * (q.weight.cols + 4),
                StepOp::QConv(q) => q.weight.rows * (q.weight.cols + 4),
                StepOp::Affine { scale, shift } => (scale.len() + shift.len()) * 4,
                StepOp::Onnx(_)
                | StepOp::Activation(_)
                | StepOp::ChannelShuffle(_)
                | StepOp::ScaledSoftmax(_)
                | StepOp::ExpandDepthwise(_)
                | StepOp::ConcatConvs(_)
                | StepOp::QuantizeDequantize(_) => 0,
            })
            .sum();
        constants + packed
    }

    /// The constant in `slot` as host floats, when it is one.
    pub(super) fn constant_f32s(&self, slot: Option<usize>) -> Option<(Vec<f32>, Vec<usize>)> {
        let value = self.constants.get(slot?)?.as_ref()?;
        Some((value.to_f32s().ok()?, value.dims()))
    }

    /// A new constant slot holding `values` with `dims`.
    fn add_constant(&mut self, values: Vec<f32>, dims: &[usize]) -> Result<usize, OnnxError> {
        let value = host_value(values, dims, &self.device)?;
        self.constants.push(Some(value));
        self.uses.push(0);
        Ok(self.constants.len() - 1)
    }

    /// Moves one-output step `at`, the sole reader of step `into`'s output, into `into`:
    /// `mark` records on `into` what it now computes, `into` takes `at`'s output and name, and
    /// `at` is removed.
    fn absorb(&mut self, at: usize, into: usize, mark: impl FnOnce(&mut super::Step)) {
        let (out, name) = (self.steps[at].outputs[0], self.steps[at].op_name.clone());
        let step = &mut self.steps[into];
        mark(step);
        step.op_name.push('+');
        step.op_name.push_str(&name);
        step.outputs[0] = out;
        self.remove_step(at);
    }

    /// The step that writes `slot`, when the one reader asking is its only one (`slot` read
    /// once and not a graph output): what every fusion needs before folding that reader into
    /// the step.
    pub(super) fn sole_producer(&self, slot: usize) -> Option<usize> {
        if self.uses[slot] != 1 || self.output_slots.contains(&slot) {
            return None;
        }
        self.producer(slot)
    }

    /// The step that writes `slot`, if one does.
    fn producer(&self, slot: usize) -> Option<usize> {
        self.steps.iter().position(|s| s.outputs.contains(&slot))
    }

    /// Removes step `at`, whose reads are given back (its inputs are read once less).
    pub(super) fn remove_step(&mut self, at: usize) {
        let step = self.steps.remove(at);
        for &s in step.inputs.iter().flatten() {
            self.uses[s] = self.uses[s].saturating_sub(1);
        }
    }

    /// Replaces step `at`'s inputs by `inputs`: the new reads are counted before the old
    /// ones are given back, so a slot read by both never drops to 0 in between.
    pub(super) fn set_inputs(&mut self, at: usize, inputs: Vec<Option<usize>>) {
        for &s in inputs.iter().flatten() {
            self.uses[s] += 1;
        }
        let old = std::mem::replace(&mut self.steps[at].inputs, inputs);
        for s in old.into_iter().flatten() {
            self.uses[s] = self.uses[s].saturating_sub(1);
        }
    }

    /// Points input `index` of step `at` at `slot` (pushing the input when it is new).
    fn rewire(&mut self, at: usize, index: usize, slot: usize) {
        let inputs = &mut self.steps[at].inputs;
        if inputs.len() <= index {
            inputs.resize(index + 1, None);
        }
        if let Some(old) = inputs[index].replace(slot) {
            self.uses[old] = self.uses[old].saturating_sub(1);
        }
        self.uses[slot] += 1;
    }

    /// Puts `op` in step `at`, which now reads only its first input.
    /// A fused residual input stays, as input 1.
    fn replace(&mut self, at: usize, op: StepOp) {
        let step = &mut self.steps[at];
        let residual = step
            .residual
            .and_then(|i| step.inputs.get(i).copied().flatten());
        for s in step.inputs.drain(1..).flatten() {
            self.uses[s] = self.uses[s].saturating_sub(1);
        }
        if let Some(r) = residual {
            step.inputs.push(Some(r));
            self.uses[r] += 1;
            step.residual = Some(1);
        }
        step.op_name = match op {
            StepOp::QLinear(_) => "QLinear".into(),
            StepOp::QConv(_) => "QConv".into(),
            StepOp::Affine { .. } => "Affine".into(),
            StepOp::Activation(act) => format!("{act:?}"),
            StepOp::ChannelShuffle(_) => "ChannelShuffle".into(),
            StepOp::ScaledSoftmax(_) => "ScaledSoftmax".into(),
            StepOp::ExpandDepthwise(_) => "ExpandDepthwise".into(),
            StepOp::ConcatConvs(_) => "ConcatConvs".into(),
            StepOp::QuantizeDequantize(_) => "QuantizeDequantize".into(),
            StepOp::Onnx(ref n) => n.node_type().to_string(),
        };
        step.op = op;
    }
}
