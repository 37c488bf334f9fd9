//! Rewrites of an imported model, each reported: BatchNorm folded into the convolution before
//! it, and int8 dynamic quantization of linear layers and convolutions with constant weights
//! onto Kiln's integer kernels (a following ReLU fused into their epilogue).
//!
//! The int8 scheme is the one Kiln's own graphs use (`crate::kernels::int8`): weights per
//! output channel, symmetric i8; activations per call, asymmetric u8 over their measured range.

use burn::tensor::TensorData;
use onnx_ir::Node;
use onnx_ir::node::padding::{AutoPad, PaddingConfig2d};
use serde::Serialize;

use super::ops::Inputs;
use super::value::{Value, ValueKind};
use super::{OnnxError, OnnxModel, StepOp};
use crate::infer::ConvGeometry;
use crate::kernels::activation::Activation;
use crate::kernels::int8::{
    ActivationQuant, ImageLayout, Kernel, PackedWeights, QuantizedActivations, matmul_dequantized,
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
    /// Int8 dynamic quantization of Linear, Gemm, MatMul-by-a-constant and ungrouped Conv;
    /// a ReLU that is the only reader of such a layer runs in its epilogue.
    Int8,
}

impl OnnxPass {
    /// Parses `fold,int8`; an unknown name is an error listing the known ones.
    pub fn parse_list(list: &str) -> Result<Vec<OnnxPass>, OnnxError> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "fold" => Ok(OnnxPass::Fold),
                "int8" => Ok(OnnxPass::Int8),
                other => Err(OnnxError::Unsupported(format!(
                    "pass `{other}` on an ONNX model; the passes are fold and int8"
                ))),
            })
            .collect()
    }

    /// The pass's name as `parse_list` takes it.
    pub fn name(self) -> &'static str {
        match self {
            OnnxPass::Fold => "fold",
            OnnxPass::Int8 => "int8",
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

/// An int8 linear layer with its packed weights.
#[derive(Debug)]
pub struct QLinear {
    weight: PackedWeights,
    bias: Option<Vec<f32>>,
    /// The activation fused into the layer, run in the integer kernel's epilogue.
    act: Option<Activation>,
}

/// An int8 convolution with its packed weights.
#[derive(Debug)]
pub struct QConv {
    weight: PackedWeights,
    bias: Option<Vec<f32>>,
    geometry: ConvGeometry,
    relu: bool,
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

/// `x · scale + shift` with `scale`/`shift` `[1, C, 1, 1]` and `x` `[N, C, ...]`.
pub(super) fn affine(ins: Inputs, scale: &Value, shift: &Value) -> Result<Vec<Value>, OnnxError> {
    use super::ops::math::{Binary, binary};
    let x = first(ins)?;
    let rank = x.rank();
    let c = x.dims().get(1).copied().unwrap_or(1);
    let mut dims = vec![1; rank.max(2)];
    dims[1] = c;
    let (scale, shift) = (scale.clone().reshape(&dims)?, shift.clone().reshape(&dims)?);
    Ok(vec![binary(
        Binary::Add,
        binary(Binary::Mul, x, scale)?,
        shift,
    )?])
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

impl QLinear {
    /// `x · W + b` over the last axis of `x`, through the integer kernel; plus `residual`
    /// in the epilogue when it is an f32 value of the output's shape and the layer has no
    /// activation of its own (it is taken then; otherwise left for the caller to add).
    pub(super) fn run(
        &self,
        ins: Inputs,
        residual: &mut Option<Value>,
    ) -> Result<Vec<Value>, OnnxError> {
        let x = first(ins)?;
        let dims = self.output_dims(&x.dims())?;
        // The input (and the residual) are read in place where the backend allows (a copy
        // of it first was a pass over every linear layer's input).
        let y = match residual.take_if(|r| self.takes_residual_value(r, &dims)) {
            Some(r) => {
                r.with_f32s(|r| x.with_f32s(|host| self.product(host, None, Some(r)).0))??
            }
            None => x.with_f32s(|host| self.product(host, None, None).0)?,
        };
        Ok(vec![host_value(y, &dims, &x.device())?])
    }

    /// The output's dimensions for an input shaped `dims` (features along the last axis),
    /// or why the input does not fit.
    pub(super) fn output_dims(&self, dims: &[usize]) -> Result<Vec<usize>, OnnxError> {
        let k = *dims.last().unwrap_or(&1);
        if k != self.weight.cols {
            return Err(OnnxError::Shape(format!(
                "int8 linear layer expects {} features, got {:?}",
                self.weight.cols, dims
            )));
        }
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = self.weight.rows;
        }
        Ok(out)
    }

    /// Whether a residual can go into the epilogue: the layer has no activation of its own
    /// (the residual is added before the step's fused one).
    pub(super) fn takes_residual(&self) -> bool {
        self.act.is_none()
    }

    /// Whether value `r` can go into the epilogue as the residual of an output shaped `dims`.
    pub(super) fn takes_residual_value(&self, r: &Value, dims: &[usize]) -> bool {
        self.takes_residual() && r.kind() == ValueKind::Float && r.dims() == dims
    }

    /// The layer over host rows `x` (whole rows of the input features, checked by
    /// [`QLinear::output_dims`]) whose range is `range` when known (else scanned), plus
    /// `residual` (the output's layout) in the epilogue; with the output's range.
    pub(super) fn product(
        &self,
        x: &[f32],
        range: Option<(f32, f32)>,
        residual: Option<&[f32]>,
    ) -> (Vec<f32>, (f32, f32)) {
        let k = self.weight.cols;
        let quant = ActivationQuant::for_range(range.unwrap_or_else(|| range_of(x)));
        let a = QuantizedActivations::new(x, k, quant, self.weight.kernel());
        let bias = self.bias.as_deref();
        matmul_dequantized_residual(&a, &self.weight, bias, residual, self.act)
    }
}

impl QConv {
    /// The convolution of NCHW `x`, through the integer implicit GEMM (its NHWC result
    /// transposed back to NCHW).
    pub(super) fn run(&self, ins: Inputs) -> Result<Vec<Value>, OnnxError> {
        let x = first(ins)?;
        let dims: [usize; 4] = x.dims().try_into().map_err(|d| {
            OnnxError::Shape(format!("int8 convolution takes [N, C, H, W]; got {d:?}"))
        })?;
        let host = x.to_f32s()?;
        let (y, [b, ho, wo, co]) = self.convolve(&host, dims, ImageLayout::Nchw)?;
        let nhwc = host_value(y, &[b, ho, wo, co], &x.device())?;
        Ok(vec![super::ops::shape::transpose(nhwc, &[0, 3, 1, 2])?])
    }

    /// The convolution of a channels-last image `x` `[b, h, w, c]`: `[b, ho, wo, cout]`,
    /// channels-last too (the integer GEMM's natural output).
    pub(super) fn run_nhwc(
        &self,
        x: &[f32],
        [b, h, w, c]: [usize; 4],
    ) -> Result<(Vec<f32>, [usize; 4]), OnnxError> {
        self.convolve(x, [b, c, h, w], ImageLayout::Nhwc)
    }

    /// `x` (`[b, c, h, w]` images stored as `layout`) through the integer implicit GEMM,
    /// with its output dimensions `[b, ho, wo, cout]`.
    fn convolve(
        &self,
        host: &[f32],
        dims: [usize; 4],
        layout: ImageLayout,
    ) -> Result<(Vec<f32>, [usize; 4]), OnnxError> {
        let [b, _, h, w] = dims;
        let g = &self.geometry;
        let [top, left, bottom, right] = g.pads;
        let pads = [(top, bottom), (left, right)];
        super::host::kernel_fits([h, w], pads, g.kernel, g.dilation)?;
        let quant = ActivationQuant::for_range(range_of(host));
        let (a, ho, wo) =
            QuantizedActivations::for_conv(host, dims, layout, g, quant, self.weight.kernel());
        if a.cols != self.weight.cols {
            return Err(OnnxError::Shape(format!(
                "int8 convolution: the input's {} channels do not fit the weights",
                dims[1]
            )));
        }
        let relu = self.relu.then_some(Activation::Relu);
        let (y, _) = matmul_dequantized(&a, &self.weight, self.bias.as_deref(), relu);
        Ok((y, [b, ho, wo, self.weight.rows]))
    }
}

impl OnnxModel {
    /// Applies `pass` and reports what it changed.
    pub fn apply(&mut self, pass: OnnxPass) -> Result<OnnxPassReport, OnnxError> {
        let nodes_before = self.steps.len();
        // The passes rewrite single layers: fused pairs are taken apart first (and fused
        // again below where both layers still fit).
        self.unfuse_expand_depthwises();
        self.unfuse_concat_convs();
        let mut changes = match pass {
            OnnxPass::Fold => self.fold_batch_norm()?,
            OnnxPass::Int8 => self.quantize_int8()?,
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
                | StepOp::ConcatConvs(_) => 0,
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

    /// Folds each activation that alone reads a Conv's, a BatchNorm's or a linear layer's
    /// (Linear, Gemm, MatMul) output into that layer, and each ReLU that alone reads an
    /// Add's: ReLU, Clip with constant bounds (ReLU6), SiLU and GELU (fused from their
    /// exported nodes first), HardSwish, Sigmoid and HardSigmoid. On the host path the
    /// convolution and the linear layer apply it in their store, the BatchNorm
    /// and the addition in their pass (DenseNet's pre-activation BatchNorm + ReLU: one pass
    /// over the image, not two); elsewhere it runs right after the operator. Returns how many
    /// were fused.
    pub(super) fn fuse_activations(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some(act) = self.steps[at].activation_op() else {
                at += 1;
                continue;
            };
            let layer = self.steps[at]
                .inputs
                .first()
                .copied()
                .flatten()
                .and_then(|x| {
                    let layer = self.sole_producer(x)?;
                    let step = &self.steps[layer];
                    let kind_fits = match step.op.node() {
                        Some(
                            Node::Conv2d(_)
                            | Node::BatchNormalization(_)
                            | Node::Linear(_)
                            | Node::Gemm(_)
                            | Node::MatMul(_),
                        ) => true,
                        Some(Node::Add(_)) => act == Activation::Relu,
                        _ => matches!(step.op, StepOp::Affine { .. }),
                    };
                    let fusable = kind_fits && step.plain_single();
                    fusable.then_some(layer)
                });
            let Some(layer) = layer else {
                at += 1;
                continue;
            };
            self.absorb(at, layer, |step| match act {
                Activation::Relu => step.relu = true,
                other => step.activation = Some(other),
            });
            fused += 1;
        }
        fused
    }

    /// Folds each 2×2, stride-2 max pool (no padding, floor mode) that alone reads a
    /// convolution with a fused ReLU into that convolution: on the host path the pooled
    /// maximum is what the register tile stores, so the convolution's full output never
    /// reaches memory (W3 / LeNet / VGG-style blocks). Returns how many were fused.
    pub(super) fn fuse_relu_pools(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let conv = match self.steps[at].op.node() {
                Some(node @ Node::MaxPool2d(n))
                    if !n.config.ceil_mode && super::ops::nn::is_plain_2x2(node) =>
                {
                    self.steps[at]
                        .inputs
                        .first()
                        .copied()
                        .flatten()
                        .and_then(|x| self.sole_producer(x))
                        .filter(|&c| {
                            let c = &self.steps[c];
                            matches!(c.op.node(), Some(Node::Conv2d(_)))
                                && c.relu
                                && c.activation.is_none()
                                && c.residual.is_none()
                                && !c.pool
                                && c.outputs.len() == 1
                        })
                }
                _ => None,
            };
            let Some(conv) = conv else {
                at += 1;
                continue;
            };
            self.absorb(at, conv, |step| step.pool = true);
            fused += 1;
        }
        fused
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

    /// Folds each residual `Add` of a convolution's output and an earlier value into that
    /// convolution (added, and a fused ReLU applied, in its store on the host path; right
    /// after the operator elsewhere). The convolution must be the Add's only reader of its
    /// output and come after the other operand's producer (ResNet's downsample convolution
    /// is exported after the block's second one: the sum goes into whichever runs last).
    /// Returns how many were fused.
    pub(super) fn fuse_residuals(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let step = &self.steps[at];
            let operands = match (step.op.node(), step.inputs.as_slice()) {
                (Some(Node::Add(_)), &[Some(a), Some(b)]) if step.outputs.len() == 1 => [a, b],
                _ => {
                    at += 1;
                    continue;
                }
            };
            let conv_for = |i: usize| -> Option<usize> {
                let (mine, other) = (operands[i], operands[1 - i]);
                let conv = self.sole_producer(mine)?;
                let c = &self.steps[conv];
                let fusable = matches!(c.op.node(), Some(Node::Conv2d(_) | Node::Linear(_)))
                    && c.plain_single()
                    && mine != other
                    && self.producer(other).is_none_or(|p| p < conv);
                fusable.then_some(conv)
            };
            let Some((conv, skip)) = [0, 1]
                .into_iter()
                .filter_map(|i| conv_for(i).map(|c| (c, operands[1 - i])))
                .max_by_key(|&(c, _)| c)
            else {
                at += 1;
                continue;
            };
            let relu = self.steps[at].relu;
            self.uses[skip] += 1;
            // The Add's name is "Add", or "Add+Relu" with its ReLU fused.
            self.absorb(at, conv, |c| {
                // Conv inputs: x, weight, bias (absent: None), then the residual.
                c.inputs.resize(3, None);
                c.inputs.push(Some(skip));
                c.residual = Some(3);
                c.relu = relu;
            });
            fused += 1;
        }
        fused
    }

    /// Fuses `Mul(x, Sigmoid(x))` (either operand order; the Sigmoid read by nothing else)
    /// into one SiLU step: one pass over the values, where the exported pair made a copy
    /// (the sigmoid's input is still read by the product), a sigmoid pass and a product pass.
    /// Returns how many were fused.
    pub(super) fn fuse_silus(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let step = &self.steps[at];
            let operands = match (step.op.node(), step.inputs.as_slice()) {
                (Some(Node::Mul(_)), &[Some(a), Some(b)]) => [a, b],
                _ => {
                    at += 1;
                    continue;
                }
            };
            // (the sigmoid step, x)
            let gate = (0..2).find_map(|i| {
                let (x, s) = (operands[1 - i], operands[i]);
                let p = self.sole_producer(s)?;
                let step = &self.steps[p];
                let is_gate = matches!(step.op.node(), Some(Node::Sigmoid(_)))
                    && step.inputs.first() == Some(&Some(x))
                    && x != s;
                is_gate.then_some((p, x, s))
            });
            let Some((sigmoid, x, s)) = gate else {
                at += 1;
                continue;
            };
            let step = &mut self.steps[at];
            step.inputs = vec![Some(x)];
            step.op = StepOp::Activation(Activation::Silu);
            step.op_name = "Silu".into();
            self.uses[s] -= 1;
            self.remove_step(sigmoid);
            fused += 1;
            // The sigmoid ran before the product: the product moved one step back.
        }
        fused
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

    fn fold_batch_norm(&mut self) -> Result<Vec<String>, OnnxError> {
        let (mut folded, mut affine) = (0, 0);
        let mut at = 0;
        while at < self.steps.len() {
            if let Some(conv) = self.foldable(at) {
                self.fold_into(conv, at)?;
                // An activation fused after the BatchNorm now follows the convolution (which
                // had none: `foldable` takes only a plain output).
                let bn = &self.steps[at];
                let (relu, activation) = (bn.relu, bn.activation);
                let fused = bn.op_name.split_once('+').map(|(_, rest)| rest.to_string());
                let conv_step = &mut self.steps[conv];
                conv_step.relu = relu;
                conv_step.activation = activation;
                if let Some(fused) = fused {
                    conv_step.op_name.push('+');
                    conv_step.op_name.push_str(&fused);
                }
                self.remove_step(at);
                folded += 1;
                continue;
            }
            if self.make_affine(at)? {
                affine += 1;
            }
            at += 1;
        }
        Ok(vec![format!(
            "folded {folded} BatchNormalization into the Conv before it; {affine} other(s) \
             precomputed as x·scale + shift"
        )])
    }

    /// Replaces BatchNormalization step `at` (constant parameters) by its precomputed
    /// per-channel affine map. `true` when replaced.
    fn make_affine(&mut self, at: usize) -> Result<bool, OnnxError> {
        let Some(Node::BatchNormalization(n)) = self.steps[at].op.node() else {
            return Ok(false);
        };
        let eps = super::ops::batch_norm_epsilon(n);
        let params: Option<Vec<Vec<f32>>> = (1..5)
            .map(|i| {
                self.constant_f32s(self.steps[at].inputs.get(i).copied().flatten())
                    .map(|(v, _)| v)
            })
            .collect();
        let Some([scale, beta, mean, var]) = params.and_then(|p| <[Vec<f32>; 4]>::try_from(p).ok())
        else {
            return Ok(false);
        };
        let a: Vec<f32> = scale
            .iter()
            .zip(&var)
            .map(|(s, v)| (*s as f64 / (*v as f64 + eps).sqrt()) as f32)
            .collect();
        let b: Vec<f32> = (0..a.len()).map(|c| beta[c] - mean[c] * a[c]).collect();
        // `[1, C, 1, 1]`: broadcasts over NCHW images; lower ranks are lifted at run time.
        let dims = [1, a.len(), 1, 1];
        let (scale, shift) = (
            host_value(a, &dims, &self.device)?,
            host_value(b, &dims, &self.device)?,
        );
        let step = &mut self.steps[at];
        for s in step.inputs.drain(1..).flatten() {
            self.uses[s] = self.uses[s].saturating_sub(1);
        }
        step.op = StepOp::Affine { scale, shift };
        step.op_name = "Affine".into();
        Ok(true)
    }

    /// The convolution step that BatchNormalization step `at` can fold into.
    fn foldable(&self, at: usize) -> Option<usize> {
        let step = &self.steps[at];
        let Some(Node::BatchNormalization(_)) = step.op.node() else {
            return None;
        };
        let x = (*step.inputs.first()?)?;
        let params_constant = step.inputs[1..]
            .iter()
            .take(4)
            .all(|s| s.is_some_and(|s| self.constants[s].is_some()));
        let conv = self.sole_producer(x)?;
        let conv_step = &self.steps[conv];
        let weight_constant = matches!(conv_step.op.node(), Some(Node::Conv2d(_)))
            && conv_step
                .inputs
                .get(1)
                .copied()
                .flatten()
                .is_some_and(|s| self.constants[s].is_some())
            && conv_step
                .inputs
                .get(2)
                .copied()
                .flatten()
                .is_none_or(|s| self.constants[s].is_some());
        // A convolution with a ReLU fused in no longer writes what the BatchNorm reads.
        (params_constant && weight_constant && conv_step.plain_output()).then_some(conv)
    }

    /// Folds BatchNormalization step `bn` into convolution step `conv`: `W' = W·a`,
    /// `b' = (b − mean)·a + beta` with `a = scale / √(var + ε)` per output channel.
    fn fold_into(&mut self, conv: usize, bn: usize) -> Result<(), OnnxError> {
        let eps = match self.steps[bn].op.node() {
            Some(Node::BatchNormalization(n)) => super::ops::batch_norm_epsilon(n),
            _ => return Err(OnnxError::Graph("fold: not a BatchNormalization".into())),
        };
        let param = |i: usize| {
            self.constant_f32s(self.steps[bn].inputs.get(i).copied().flatten())
                .map(|(v, _)| v)
                .ok_or_else(|| {
                    OnnxError::Graph("fold: a BatchNorm parameter is not constant".into())
                })
        };
        let (scale, beta, mean, var) = (param(1)?, param(2)?, param(3)?, param(4)?);
        let (weight, wdims) = self
            .constant_f32s(self.steps[conv].inputs[1])
            .ok_or_else(|| OnnxError::Graph("fold: the Conv weight is not constant".into()))?;
        let co = wdims[0];
        if [scale.len(), beta.len(), mean.len(), var.len()] != [co; 4] {
            return Err(OnnxError::Shape(format!(
                "fold: BatchNorm over {} channels after a Conv with {co}",
                scale.len()
            )));
        }
        let bias = self
            .constant_f32s(self.steps[conv].inputs.get(2).copied().flatten())
            .map(|(b, _)| b)
            .unwrap_or_else(|| vec![0.0; co]);
        let a: Vec<f32> = (0..co)
            .map(|c| (scale[c] as f64 / (var[c] as f64 + eps).sqrt()) as f32)
            .collect();
        let per = weight.len() / co.max(1);
        let new_weight: Vec<f32> = weight
            .iter()
            .enumerate()
            .map(|(i, w)| w * a[i / per])
            .collect();
        let new_bias: Vec<f32> = (0..co)
            .map(|c| (bias[c] - mean[c]) * a[c] + beta[c])
            .collect();
        let w_slot = self.add_constant(new_weight, &wdims)?;
        let b_slot = self.add_constant(new_bias, &[co])?;
        self.rewire(conv, 1, w_slot);
        self.rewire(conv, 2, b_slot);
        // The convolution now writes what the BatchNorm wrote.
        let out = self.steps[bn].outputs[0];
        self.steps[conv].outputs[0] = out;
        Ok(())
    }

    fn quantize_int8(&mut self) -> Result<Vec<String>, OnnxError> {
        let kernel = Kernel::detect();
        let (mut linear, mut conv, mut relu, mut kept) = (0, 0, 0, 0);
        for at in 0..self.steps.len() {
            let replaced = match self.steps[at].op.node() {
                Some(Node::Linear(n)) => self.int8_linear(at, n.config.transpose_weight, kernel)?,
                Some(Node::MatMul(_)) => self.int8_linear(at, false, kernel)?,
                Some(Node::Gemm(n))
                    if n.config.alpha == 1.0
                        && n.config.trans_a == 0
                        && (n.config.beta == 1.0 || self.steps[at].inputs.len() < 3) =>
                {
                    self.int8_linear(at, n.config.trans_b != 0, kernel)?
                }
                Some(Node::Conv2d(_)) => self.int8_conv(at, kernel)?,
                _ => continue,
            };
            match replaced {
                Some(true) => linear += 1,
                Some(false) => conv += 1,
                None => kept += 1,
            }
        }
        // ReLUs that alone read an int8 layer run in its epilogue.
        let mut at = 0;
        while at < self.steps.len() {
            if let Some(layer) = self.fusable_relu(at) {
                let out = self.steps[at].outputs[0];
                match &mut self.steps[layer].op {
                    StepOp::QLinear(q) => q.act = Some(Activation::Relu),
                    StepOp::QConv(q) => q.relu = true,
                    StepOp::Onnx(_)
                    | StepOp::Affine { .. }
                    | StepOp::Activation(_)
                    | StepOp::ChannelShuffle(_)
                    | StepOp::ScaledSoftmax(_)
                    | StepOp::ExpandDepthwise(_)
                    | StepOp::ConcatConvs(_) => {
                        unreachable!("fusable_relu returns int8 layers")
                    }
                }
                self.steps[layer].outputs[0] = out;
                self.remove_step(at);
                relu += 1;
                continue;
            }
            at += 1;
        }
        let mut changes = vec![format!(
            "int8: {linear} linear layer(s), {conv} convolution(s); {relu} ReLU(s) fused"
        )];
        if kept > 0 {
            changes.push(format!(
                "{kept} layer(s) stay f32 (grouped or auto-padded convolutions, non-constant weights)"
            ));
        }
        Ok(changes)
    }

    /// The int8 layer a ReLU at `at` can fuse into.
    fn fusable_relu(&self, at: usize) -> Option<usize> {
        let step = &self.steps[at];
        let Some(Node::Relu(_)) = step.op.node() else {
            return None;
        };
        let x = (*step.inputs.first()?)?;
        let layer = self.sole_producer(x)?;
        // A linear layer with another activation in its epilogue already takes no ReLU, and
        // one with a fused residual adds it after the epilogue's ReLU would run.
        let int8 = matches!(
            self.steps[layer].op,
            StepOp::QLinear(QLinear { act: None, .. }) | StepOp::QConv(_)
        );
        (int8 && self.steps[layer].plain_output()).then_some(layer)
    }

    /// Replaces step `at` by an int8 linear layer when its weight (input 1) is a constant
    /// 2-D matrix (`[out, in]` when `out_major`, else `[in, out]`) and its bias (input 2)
    /// absent or constant. `Some(true)` when replaced.
    fn int8_linear(
        &mut self,
        at: usize,
        out_major: bool,
        kernel: Kernel,
    ) -> Result<Option<bool>, OnnxError> {
        let step = &self.steps[at];
        let Some((w, dims)) = self.constant_f32s(step.inputs.get(1).copied().flatten()) else {
            return Ok(None);
        };
        let bias_slot = step.inputs.get(2).copied().flatten();
        let bias = match bias_slot {
            Some(s) => match self.constant_f32s(Some(s)) {
                Some((b, _)) => Some(b),
                None => return Ok(None),
            },
            None => None,
        };
        if dims.len() != 2 {
            return Ok(None);
        }
        let (out, inp) = if out_major {
            (dims[0], dims[1])
        } else {
            (dims[1], dims[0])
        };
        if bias.as_ref().is_some_and(|b| b.len() != out) {
            return Ok(None);
        }
        let rows: Vec<f32> = if out_major {
            w
        } else {
            let mut t = vec![0f32; w.len()];
            for i in 0..inp {
                for o in 0..out {
                    t[o * inp + i] = w[i * out + o];
                }
            }
            t
        };
        let weight = PackedWeights::new(&quantize_rows(&rows, out, inp), kernel);
        // The activation fused into the linear step at load moves into the int8 epilogue
        // (a ReLU as for a convolution, a GELU on each rectangle as it is written); with a
        // residual fused too it stays on the step, after the sum.
        let step = &mut self.steps[at];
        let act = if step.residual.is_none() {
            let act = step.fused_activation();
            (step.relu, step.activation) = (false, None);
            act
        } else {
            None
        };
        self.replace(at, StepOp::QLinear(QLinear { weight, bias, act }));
        Ok(Some(true))
    }

    /// Replaces Conv step `at` by an int8 convolution (constant weight, one group, explicit
    /// padding). `Some(false)` when replaced.
    fn int8_conv(&mut self, at: usize, kernel: Kernel) -> Result<Option<bool>, OnnxError> {
        let step = &self.steps[at];
        let Some(Node::Conv2d(n)) = step.op.node() else {
            return Ok(None);
        };
        let c = &n.config;
        if c.groups != 1 || !matches!(c.auto_pad, AutoPad::NotSet | AutoPad::Valid) {
            return Ok(None);
        }
        let pads = match c.padding {
            PaddingConfig2d::Valid => [0; 4],
            PaddingConfig2d::Explicit(top, left, bottom, right) => [top, left, bottom, right],
        };
        let geometry = ConvGeometry {
            stride: c.stride,
            pads: if c.auto_pad == AutoPad::Valid {
                [0; 4]
            } else {
                pads
            },
            dilation: c.dilation,
            groups: 1,
            kernel: c.kernel_size,
        };
        let Some((w, dims)) = self.constant_f32s(step.inputs.get(1).copied().flatten()) else {
            return Ok(None);
        };
        let bias = match step.inputs.get(2).copied().flatten() {
            Some(s) => match self.constant_f32s(Some(s)) {
                Some((b, _)) => Some(b),
                None => return Ok(None),
            },
            None => None,
        };
        let [co, ci, kh, kw]: [usize; 4] = match dims.try_into() {
            Ok(d) => d,
            Err(_) => return Ok(None),
        };
        let q = quantize_rows(&w, co, ci * kh * kw);
        let weight = pack_conv_weights(&q, ci, &geometry, kernel);
        // A ReLU already fused into the Conv step moves into the int8 epilogue, unless a
        // residual must be added before it.
        let relu = self.steps[at].residual.is_none() && std::mem::take(&mut self.steps[at].relu);
        self.replace(
            at,
            StepOp::QConv(QConv {
                weight,
                bias,
                geometry,
                relu,
            }),
        );
        Ok(Some(false))
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
            StepOp::Onnx(ref n) => n.node_type().to_string(),
        };
        step.op = op;
    }
}
