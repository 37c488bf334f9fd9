//! The int8 pass: linear layers and convolutions with constant weights quantized per
//! output channel (activations per call), the ReLU after them fused into the integer
//! kernel's epilogue.

use super::*;

/// An int8 linear layer with its packed weights.
#[derive(Debug)]
pub struct QLinear {
    pub(super) weight: PackedWeights,
    pub(super) bias: Option<Vec<f32>>,
    /// The activation fused into the layer, run in the integer kernel's epilogue.
    pub(super) act: Option<Activation>,
    /// The input's quantization grid when the model fixes it (a QDQ model's scale and zero
    /// point); `None`: measured per call.
    pub(super) input_quant: Option<ActivationQuant>,
}

/// An int8 convolution with its packed weights.
#[derive(Debug)]
pub struct QConv {
    pub(super) weight: PackedWeights,
    pub(super) bias: Option<Vec<f32>>,
    pub(super) geometry: ConvGeometry,
    pub(super) relu: bool,
    /// As [`QLinear`]'s: the model's grid for the input, or `None` to measure it per call.
    pub(super) input_quant: Option<ActivationQuant>,
}

impl QLinear {
    /// `x · W + b` over the last axis of `x`, through the integer kernel; plus `residual`
    /// in the epilogue when it is an f32 value of the output's shape and the layer has no
    /// activation of its own (it is taken then; otherwise left for the caller to add).
    pub(in crate::onnx) fn run(
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
    pub(in crate::onnx) fn output_dims(&self, dims: &[usize]) -> Result<Vec<usize>, OnnxError> {
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
    pub(in crate::onnx) fn takes_residual(&self) -> bool {
        self.act.is_none()
    }

    /// Whether value `r` can go into the epilogue as the residual of an output shaped `dims`.
    pub(in crate::onnx) fn takes_residual_value(&self, r: &Value, dims: &[usize]) -> bool {
        self.takes_residual() && r.kind() == ValueKind::Float && r.dims() == dims
    }

    /// The layer over host rows `x` (whole rows of the input features, checked by
    /// [`QLinear::output_dims`]) whose range is `range` when known (else scanned), plus
    /// `residual` (the output's layout) in the epilogue; with the output's range.
    pub(in crate::onnx) fn product(
        &self,
        x: &[f32],
        range: Option<(f32, f32)>,
        residual: Option<&[f32]>,
    ) -> (Vec<f32>, (f32, f32)) {
        let k = self.weight.cols;
        let quant = self
            .input_quant
            .unwrap_or_else(|| ActivationQuant::for_range(range.unwrap_or_else(|| range_of(x))));
        let a = QuantizedActivations::new(x, k, quant, self.weight.kernel());
        let bias = self.bias.as_deref();
        matmul_dequantized_residual(&a, &self.weight, bias, residual, self.act)
    }
}

impl QConv {
    /// The convolution of NCHW `x`, through the integer implicit GEMM (its NHWC result
    /// transposed back to NCHW).
    pub(in crate::onnx) fn run(&self, ins: Inputs) -> Result<Vec<Value>, OnnxError> {
        let x = first(ins)?;
        let dims: [usize; 4] = x.dims().try_into().map_err(|d| {
            OnnxError::Shape(format!("int8 convolution takes [N, C, H, W]; got {d:?}"))
        })?;
        let host = x.to_f32s()?;
        let (y, [b, ho, wo, co]) = self.convolve(&host, dims, ImageLayout::Nchw)?;
        let nhwc = host_value(y, &[b, ho, wo, co], &x.device())?;
        Ok(vec![crate::onnx::ops::shape::transpose(
            nhwc,
            &[0, 3, 1, 2],
        )?])
    }

    /// The convolution of a channels-last image `x` `[b, h, w, c]`: `[b, ho, wo, cout]`,
    /// channels-last too (the integer GEMM's natural output).
    pub(in crate::onnx) fn run_nhwc(
        &self,
        x: &[f32],
        [b, h, w, c]: [usize; 4],
    ) -> Result<(Vec<f32>, [usize; 4]), OnnxError> {
        self.convolve(x, [b, c, h, w], ImageLayout::Nhwc)
    }

    /// `x` (`[b, c, h, w]` images stored as `layout`) through the integer implicit GEMM,
    /// with its output dimensions `[b, ho, wo, cout]`.
    pub(in crate::onnx) fn convolve(
        &self,
        host: &[f32],
        dims: [usize; 4],
        layout: ImageLayout,
    ) -> Result<(Vec<f32>, [usize; 4]), OnnxError> {
        let [b, _, h, w] = dims;
        let g = &self.geometry;
        let [top, left, bottom, right] = g.pads;
        let pads = [(top, bottom), (left, right)];
        crate::onnx::host::kernel_fits([h, w], pads, g.kernel, g.dilation)?;
        let quant = self
            .input_quant
            .unwrap_or_else(|| ActivationQuant::for_range(range_of(host)));
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

/// The geometry of a Conv the integer implicit GEMM takes: one group, explicit or valid
/// padding (`None` for grouped or auto-padded convolutions).
pub(super) fn int8_conv_geometry(c: &onnx_ir::node::conv2d::Conv2dConfig) -> Option<ConvGeometry> {
    if c.groups != 1 || !matches!(c.auto_pad, AutoPad::NotSet | AutoPad::Valid) {
        return None;
    }
    let pads = match (&c.auto_pad, &c.padding) {
        (AutoPad::Valid, _) | (_, PaddingConfig2d::Valid) => [0; 4],
        (_, PaddingConfig2d::Explicit(top, left, bottom, right)) => [*top, *left, *bottom, *right],
    };
    Some(ConvGeometry {
        stride: c.stride,
        pads,
        dilation: c.dilation,
        groups: 1,
        kernel: c.kernel_size,
    })
}

impl OnnxModel {
    pub(in crate::onnx) fn quantize_int8(
        &mut self,
        only: Option<&BTreeSet<String>>,
    ) -> Result<Vec<String>, OnnxError> {
        let kernel = Int8Kernel::detect();
        let (mut linear, mut conv, mut relu, mut kept) = (0, 0, 0, 0);
        for at in 0..self.steps.len() {
            if only.is_some_and(|names| !names.contains(&self.steps[at].name)) {
                continue;
            }
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
                    | StepOp::ConcatConvs(_)
                    | StepOp::QuantizeDequantize(_) => {
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
    pub(in crate::onnx) fn fusable_relu(&self, at: usize) -> Option<usize> {
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
    pub(in crate::onnx) fn int8_linear(
        &mut self,
        at: usize,
        out_major: bool,
        kernel: Int8Kernel,
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
        self.replace(
            at,
            StepOp::QLinear(QLinear {
                weight,
                bias,
                act,
                input_quant: None,
            }),
        );
        Ok(Some(true))
    }

    /// Replaces Conv step `at` by an int8 convolution (constant weight, one group, explicit
    /// padding). `Some(false)` when replaced.
    pub(in crate::onnx) fn int8_conv(
        &mut self,
        at: usize,
        kernel: Int8Kernel,
    ) -> Result<Option<bool>, OnnxError> {
        let step = &self.steps[at];
        let Some(Node::Conv2d(n)) = step.op.node() else {
            return Ok(None);
        };
        let Some(geometry) = int8_conv_geometry(&n.config) else {
            return Ok(None);
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
                input_quant: None,
            }),
        );
        Ok(Some(false))
    }
}
