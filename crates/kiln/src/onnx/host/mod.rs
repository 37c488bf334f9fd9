//! Channels-last execution of an imported model's image layers on the host.
//!
//! When Kiln's CPU kernels serve the model's device, a convolution with constant weights
//! runs on [`crate::kernels::implicit`] (dense and grouped) or [`crate::kernels::nhwc`]
//! (depthwise) with its weights packed once, on first use, and its output stays a
//! channels-last host [`Image`] for the layers after it: activations, BatchNorm, element-wise
//! arithmetic (residual adds, squeeze-excitation gates), pooling, channel concatenation and
//! split and the next convolution all run on images too; linear layers by a constant run on
//! the implicit GEMM with their weight packed once. Any other operator receives its inputs converted back to NCHW
//! [`Value`]s, so every graph runs, and a graph made of these layers transposes only at its
//! entry and after its global pool (a 1×1 image, whose NCHW and NHWC layouts coincide).
//!
//! Why: per-node Burn calls on NCHW tensors paid an im2col copy, a zero fill and a separate
//! pass for bias, activation and pooling per layer (BENCHMARKS run 20: ResNet-18 at 0.31×
//! ONNX Runtime, 44% of its time in the GEMM and the rest around it; run 31: after).

mod layout;

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use burn::tensor::{Device, Tensor, TensorData};
use onnx_ir::Node;
use onnx_ir::node::reduce::ReduceAxes;

use super::OnnxError;
use super::ops::nn::Window;
use super::ops::node_window;
use super::value::{Value, ValueKind};
use crate::infer::batch_norm_affine;
use crate::kernels::activation::{Activation, activate, erf_in_place};
use crate::kernels::conv::ConvShape;
use crate::kernels::expand_depthwise::ExpandDepthwise;
use crate::kernels::implicit::{
    ConvWeights, conv2d_nhwc_fused_from_nchw_new, conv2d_nhwc_fused_new, conv2d_nhwc_fused_onto,
    conv2d_nhwc_into_channels, conv2d_nhwc_relu_pool2_new, linear_rows_residual_new,
    linear_rows_residual_onto,
};
use crate::kernels::layer_norm::layer_norm_rows;
use crate::kernels::nhwc::{
    Arith, DepthwiseWeights, PoolKind, Window2d, arith_channels_in_place, arith_in_place,
    depthwise_conv2d, global_average, nchw_to_nhwc, nhwc_to_nchw, pool2d, scale_shift_in_place,
    scale_shift_new,
};
pub(super) use layout::channel_shuffle;
use layout::{concat_channels, relayout, split_channels};

/// A float image `[n, h, w, c]` on the host, channels-last. Shared (`Arc`) so a value read
/// by two layers (a residual block's input) is not copied; its last reader takes it and may
/// write in place.
#[derive(Debug, Clone)]
pub(super) struct Image {
    data: Arc<Vec<f32>>,
    dims: [usize; 4],
}

impl Image {
    fn new(data: Vec<f32>, dims: [usize; 4]) -> Self {
        Image {
            data: Arc::new(data),
            dims,
        }
    }

    /// An NCHW float value as an image.
    fn from_value(v: Value) -> Result<Image, OnnxError> {
        let dims = v.dims();
        // A graph's input image is converted straight out of the backend's buffer: one pass
        // instead of a copy out and a transpose of the copy.
        if let Some(image) = v.with_f32_view(|x| Image::from_nchw(Cow::Borrowed(x), dims.clone())) {
            return image;
        }
        Image::from_nchw(Cow::Owned(v.to_kind(ValueKind::Float)?.to_f32s()?), dims)
    }

    /// NCHW float values of `dims` as an image (owned values are kept as they are where
    /// both layouts coincide; borrowed ones are copied once either way).
    fn from_nchw(values: Cow<'_, [f32]>, dims: Vec<usize>) -> Result<Image, OnnxError> {
        let [n, c, h, w]: [usize; 4] = dims.try_into().map_err(|d| {
            OnnxError::Shape(format!("an image layer takes [N, C, H, W]; got {d:?}"))
        })?;
        // With one pixel (or one channel) both layouts hold the same sequence.
        let data = if h * w == 1 || c == 1 {
            values.into_owned()
        } else {
            nchw_to_nhwc(&values, [n, c, h, w])
        };
        Ok(Image::new(data, [n, h, w, c]))
    }

    /// The image as an NCHW value on `device`.
    fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        let [n, h, w, c] = self.dims;
        Ok(Value::float(Tensor::<4>::from_data(
            TensorData::new(self.into_nchw(), [n, c, h, w]),
            device,
        )))
    }

    /// The values in NCHW order (transposed, except where both layouts coincide).
    fn into_nchw(self) -> Vec<f32> {
        let [_, h, w, c] = self.dims;
        if h * w == 1 || c == 1 {
            self.into_vec()
        } else {
            nhwc_to_nchw(&self.data, self.dims)
        }
    }

    /// The values, copied only when another reader still holds them.
    fn into_vec(self) -> Vec<f32> {
        owned_or_shared(self.data, |owned| owned, <[f32]>::to_vec)
    }
}

/// A float value of any rank on the host in ONNX's own row-major layout: what a linear layer
/// or LayerNorm on the host leaves, and what the transpose `[0, 2, 3, 1]` makes of an image
/// (its data as they are). The host layers after it (linear layers, LayerNorm, element-wise
/// arithmetic and activations, the transpose back to an image) read it without converting:
/// ConvNeXt's blocks and transformers' MLPs are such chains, and each Burn tensor between
/// two host layers cost two copies (BENCHMARKS.md run 33).
#[derive(Debug, Clone)]
pub(super) struct Rows {
    data: Arc<Vec<f32>>,
    dims: Vec<usize>,
    /// `(min(x, 0), max(x, 0))` of the values when the step that wrote them measured it (an
    /// int8 layer's epilogue): the next int8 layer quantizes with it instead of scanning.
    range: Option<(f32, f32)>,
}

impl Rows {
    fn new(data: Vec<f32>, dims: Vec<usize>) -> Self {
        Rows {
            data: Arc::new(data),
            dims,
            range: None,
        }
    }

    /// The length of the last axis (the one linear layers and LayerNorm work along).
    fn last(&self) -> usize {
        self.dims.last().copied().unwrap_or(1)
    }

    /// The values, copied only when another reader still holds them.
    fn into_vec(self) -> Vec<f32> {
        owned_or_shared(self.data, |owned| owned, <[f32]>::to_vec)
    }

    /// `f` over the values (in place when this was their last reader), as rows of the same
    /// shape.
    fn apply(self, f: impl FnOnce(&mut [f32])) -> Rows {
        let dims = self.dims.clone();
        let mut data = self.into_vec();
        f(&mut data);
        Rows::new(data, dims)
    }

    /// The value on `device`.
    fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        let dims = self.dims.clone();
        Value::from_data(TensorData::new(self.into_vec(), dims), device)
    }

    /// Input `i` of a host step as rows: host rows as they are, a float value copied out.
    fn from_slot(ins: &mut [Option<Slot>], i: usize) -> Option<Result<Rows, OnnxError>> {
        match take(ins, i)? {
            Slot::Rows(rows) => Some(Ok(rows)),
            Slot::Value(v) => Some(v.to_f32s().map(|data| Rows::new(data, v.dims()))),
            Slot::Image(_) => None,
        }
    }
}

/// A value between steps: an ONNX value, or an image a host layer left channels-last.
#[derive(Debug, Clone)]
// Values are the common case and the slots few (one per graph value): boxing them would cost
// an allocation per value per run for no saving that matters.
#[allow(clippy::large_enum_variant)]
pub(super) enum Slot {
    /// A tensor on the model's device, in ONNX layout.
    Value(Value),
    /// A host image, channels-last.
    Image(Image),
    /// A host value in ONNX layout.
    Rows(Rows),
}

impl Slot {
    /// The slot as an ONNX value (an image transposed back to NCHW).
    pub(super) fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        match self {
            Slot::Value(v) => Ok(v),
            Slot::Image(image) => image.into_value(device),
            Slot::Rows(rows) => rows.into_value(device),
        }
    }

    fn into_image(self) -> Result<Image, OnnxError> {
        match self {
            Slot::Image(image) => Ok(image),
            Slot::Value(v) => Image::from_value(v),
            Slot::Rows(rows) => {
                let dims = rows.dims.clone();
                Image::from_nchw(Cow::Owned(rows.into_vec()), dims)
            }
        }
    }

    /// Whether the slot is a float tensor whose last axis has `len` values (a host row
    /// layer's input).
    fn has_rows_of(&self, len: usize) -> bool {
        match self {
            Slot::Rows(r) => r.dims.len() >= 2 && r.last() == len,
            Slot::Value(v) => {
                v.kind() == ValueKind::Float && v.rank() >= 2 && v.dims().last() == Some(&len)
            }
            Slot::Image(_) => false,
        }
    }
}

/// A layer's weights packed for the host kernels, made on the step's first run.
#[derive(Debug)]
pub(super) enum Packed {
    /// A convolution.
    Conv(PackedConv),
    /// A linear layer (`Linear`, `Gemm`, `MatMul` by a constant): a 1×1 convolution over
    /// the rows of its input, its weight packed once instead of transposed and packed per
    /// call.
    Linear(ConvWeights),
    /// An inference BatchNormalization with constant parameters: `x · scale + shift`.
    Affine { scale: Vec<f32>, shift: Vec<f32> },
    /// A LayerNormalization over the last axis with constant scale (and shift).
    LayerNorm {
        gamma: Vec<f32>,
        beta: Option<Vec<f32>>,
    },
}

/// A convolution's packed weights.
#[derive(Debug)]
pub(super) enum PackedConv {
    /// One group: the implicit GEMM.
    Dense(ConvWeights),
    /// One filter per channel.
    Depthwise(DepthwiseWeights),
}

/// Per step: the packed layer, once known (`None` inside: the step stays on the ONNX path,
/// e.g. a grouped convolution or a computed weight).
pub(super) type PackCache = OnceLock<Option<Packed>>;

/// What a step needs to run on the host.
pub(super) struct HostStep<'a> {
    pub node: &'a Node,
    /// Whether input `i` is a model constant (a weight).
    pub constant: &'a dyn Fn(usize) -> bool,
    pub cache: &'a PackCache,
    pub outputs: usize,
    /// A ReLU fused into the step (read by an Add).
    pub relu: bool,
    /// What was fused after a Conv ([`super::Step::fused_activation`]).
    pub act: Option<Activation>,
    /// A residual fused into a Conv: the input index of the value added before the ReLU.
    pub residual: Option<usize>,
    /// A 2×2, stride-2 max pool fused after a Conv's ReLU.
    pub pool: bool,
    pub device: &'a Device,
}

/// Runs `step` on the host when it can: `None` means "not here" (the caller converts the
/// inputs to values and runs the ONNX operator); the inputs are untouched then.
pub(super) fn run(
    step: &HostStep,
    ins: &mut [Option<Slot>],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let is_image = |i: usize| matches!(ins.get(i), Some(Some(Slot::Image(_))));
    let image_in = is_image(0);
    let rows_in = matches!(ins.first(), Some(Some(Slot::Rows(_))));
    if (image_in || rows_in)
        && let Some(act) = super::ops::activation_of(step.node)
    {
        return unary(ins, act);
    }
    match step.node {
        Node::Conv2d(n) => {
            let window = node_window(step.node).ok()?;
            let Some(Packed::Conv(packed)) = step
                .cache
                .get_or_init(|| pack_conv(step, ins, n.config.groups).map(Packed::Conv))
            else {
                return None;
            };
            let residual = step.residual.and_then(|i| take(ins, i));
            let x = take(ins, 0)?;
            let out = conv(
                x,
                packed,
                &window,
                (step.act, residual),
                step.pool,
                step.device,
            );
            Some(out)
        }
        Node::Erf(_) if rows_in => {
            let Some(Slot::Rows(rows)) = take(ins, 0) else {
                return None;
            };
            Some(Ok(vec![Slot::Rows(rows.apply(erf_in_place))]))
        }
        Node::LayerNormalization(n) => layer_norm(step, ins, n.config.axis, n.config.epsilon),
        Node::Identity(_) | Node::Dropout(_) if (image_in || rows_in) && step.outputs == 1 => {
            Some(Ok(vec![take(ins, 0)?]))
        }
        Node::Add(_) => binary(ins, Arith::Add, step.relu),
        Node::Sub(_) => binary(ins, Arith::Sub, false),
        Node::Mul(_) => binary(ins, Arith::Mul, false),
        Node::Div(_) => binary(ins, Arith::Div, false),
        Node::MaxPool2d(n) if image_in => {
            let c = &n.config;
            let window = node_window(step.node).ok()?;
            pool(ins, &window, c.ceil_mode, PoolKind::Max)
        }
        Node::AveragePool2d(n) if image_in => {
            let c = &n.config;
            let window = node_window(step.node).ok()?;
            let kind = PoolKind::Average {
                count_include_pad: c.count_include_pad,
            };
            pool(ins, &window, c.ceil_mode, kind)
        }
        Node::GlobalAveragePool(_) if image_in => spatial_mean(ins, true),
        // ShuffleNet's and RegNet's `x.mean([2, 3])`.
        Node::ReduceMean(n) if image_in && n.config.axes == ReduceAxes::Static(vec![2, 3]) => {
            spatial_mean(ins, n.config.keepdims)
        }
        Node::Concat(n) if n.config.axis == 1 => concat_channels(ins),
        Node::Transpose(n) => relayout(ins, &n.config.perm),
        Node::Flatten(n) if image_in => layout::flatten(ins, n.config.axis),
        Node::Shape(n) => layout::shape(ins, n.config.start, n.config.end, step.device),
        Node::Slice(n) if image_in => layout::slice_channels(ins, &n.config),
        Node::Split(n) if image_in && n.config.axis == 1 => {
            let Some(Some(Slot::Image(image))) = ins.first() else {
                return None;
            };
            let sizes = super::ops::static_split_sizes(n, image.dims[3])?;
            split_channels(ins, &sizes)
        }
        Node::BatchNormalization(n) if image_in => {
            let epsilon = super::ops::batch_norm_epsilon(n);
            let Some(Packed::Affine { scale, shift }) = step
                .cache
                .get_or_init(|| pack_batch_norm(step, ins, epsilon))
            else {
                return None;
            };
            affine(ins, scale, shift, step.act)
        }
        Node::Linear(n) => linear(step, ins, n.config.transpose_weight, true),
        Node::Gemm(n) => {
            let c = &n.config;
            let plain = c.alpha == 1.0 && c.trans_a == 0 && (c.beta == 1.0 || ins.len() < 3);
            if !plain {
                return None;
            }
            linear(step, ins, c.trans_b != 0, true)
        }
        Node::MatMul(_) => linear(step, ins, false, false),
        _ => None,
    }
}

/// A 1×1 convolution `pw` and the depthwise convolution `dw` that alone reads its output
/// (fused at load, `fuse_expand_depthwises`), in one pass over bands of rows
/// ([`crate::kernels::expand_depthwise`]): the expanded image never reaches memory. `split`:
/// how many of `ins` are `pw`'s (the rest are `dw`'s after its first). `None` (inputs
/// untouched) where that kernel does not take them: the caller runs the two layers apart.
pub(super) fn expand_depthwise(
    pw: &HostStep,
    dw: &HostStep,
    ins: &mut [Option<Slot>],
    split: usize,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Some(Slot::Image(x))) = ins.first() else {
        return None;
    };
    let (Node::Conv2d(pn), Node::Conv2d(dn)) = (pw.node, dw.node) else {
        return None;
    };
    let Some(Packed::Conv(PackedConv::Dense(pointwise))) = pw
        .cache
        .get_or_init(|| pack_conv(pw, &ins[..split], pn.config.groups).map(Packed::Conv))
    else {
        return None;
    };
    let Some(Packed::Conv(PackedConv::Depthwise(depthwise))) = dw.cache.get_or_init(|| {
        // The depthwise layer's inputs as it numbers them: its first (the 1×1's output)
        // is not a constant and packing does not read it.
        let ins: Vec<Option<Slot>> = std::iter::once(None)
            .chain(ins[split..].iter().cloned())
            .collect();
        pack_conv(dw, &ins, dn.config.groups).map(Packed::Conv)
    }) else {
        return None;
    };
    let [expanded, cin, ..] = pointwise.dims();
    let window = node_window(dw.node).ok()?;
    if x.dims[3] != cin || depthwise.channels() != expanded {
        return None;
    }
    let [n, h, w, _] = x.dims;
    let (win, out_dims) = match conv_window(
        [n, h, w, expanded],
        (expanded, depthwise.kernel(), expanded),
        &window,
    ) {
        Ok(fit) => fit,
        Err(e) => return Some(Err(e)),
    };
    let _op = tracing::trace_span!("kiln.expand_depthwise", input = ?x.dims, expanded).entered();
    let layers = ExpandDepthwise {
        pointwise,
        pointwise_act: pw.act,
        depthwise,
        depthwise_act: dw.act,
    };
    let out = crate::kernels::expand_depthwise::expand_depthwise(&x.data, &win, &layers)?;
    // The input's last reader is done with it.
    take(ins, 0);
    Some(Ok(vec![Slot::Image(Image::new(out, out_dims))]))
}

/// Convolutions `layers` (their inputs `counts[i]` of `ins` each, in turn) and the channel
/// Concat of their outputs (fused at load, `fuse_concat_convs`): each writes its channels of
/// the concatenated image in place, so the Concat copies nothing. `None` (inputs untouched)
/// where that path does not take them: the caller runs the layers and the Concat.
pub(super) fn concat_convs(
    layers: &[HostStep],
    counts: &[usize],
    ins: &mut [Option<Slot>],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let mut plans = Vec::with_capacity(layers.len());
    // Where each layer's image input is in `ins`, taken once all have run.
    let mut inputs = Vec::with_capacity(layers.len());
    let (mut first, mut channels, mut pixels) = (0, 0, None);
    for (layer, &count) in layers.iter().zip(counts) {
        let Some(Some(Slot::Image(x))) = ins.get(first) else {
            return None;
        };
        let Node::Conv2d(n) = layer.node else {
            return None;
        };
        let window = node_window(layer.node).ok()?;
        let mine = &ins[first..first + count];
        let Some(Packed::Conv(PackedConv::Dense(weights))) = layer
            .cache
            .get_or_init(|| pack_conv(layer, mine, n.config.groups).map(Packed::Conv))
        else {
            return None;
        };
        // A shape error is the layer's own to report, run apart.
        let (win, [n, oh, ow, cout]) = conv_window(x.dims, dense_io(weights), &window).ok()?;
        if weights.kernel().panel_width().is_none() || pixels.is_some_and(|p| p != [n, oh, ow]) {
            return None;
        }
        pixels = Some([n, oh, ow]);
        plans.push((&x.data[..], dense_shape(&win, cout), weights, layer.act));
        inputs.push(first);
        channels += cout;
        first += count;
    }
    let [n, oh, ow] = pixels?;
    let _op = tracing::trace_span!("kiln.concat_convs", output = ?[n, oh, ow, channels]).entered();
    let out = crate::kernels::filled(n * oh * ow * channels, |out| {
        let mut offset = 0;
        for (x, shape, weights, act) in &plans {
            // Every layer's kernel was checked above: each writes its channels.
            conv2d_nhwc_into_channels(shape, x, weights, *act, (out, channels, offset));
            offset += shape.cout;
        }
    });
    drop(plans);
    for at in inputs {
        take(ins, at);
    }
    Some(Ok(vec![Slot::Image(Image::new(
        out,
        [n, oh, ow, channels],
    ))]))
}

/// An int8 convolution (the int8 pass's) of an image, its output left channels-last;
/// then the fused residual (input `residual`) and activation, which the pass leaves outside the
/// integer epilogue when there is a residual.
pub(super) fn int8_conv(
    q: &super::passes::QConv,
    ins: &mut [Option<Slot>],
    (residual, act): (Option<usize>, Option<Activation>),
    device: &Device,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let x = take(ins, 0)?;
    let residual = residual.and_then(|i| take(ins, i));
    let run = || -> Result<Vec<Slot>, OnnxError> {
        // An NCHW input (the graph's) is made channels-last once; the layers after stay so.
        let x = x.into_image()?;
        let _op = tracing::trace_span!("kiln.qconv_nhwc", input = ?x.dims).entered();
        let (y, dims) = q.run_nhwc(&x.data, x.dims)?;
        let y = Image::new(y, dims);
        match residual {
            Some(r) => add_residual(y, r, act, device),
            None => match act {
                Some(act) => Ok(vec![activate_slot(Slot::Image(y), act)?]),
                None => Ok(vec![Slot::Image(y)]),
            },
        }
    };
    Some(run())
}

/// An int8 linear layer (the int8 pass's) over host rows, its output host rows too, with a
/// fused residual of the output's shape in the integer epilogue: a transformer's
/// `QLinear → LayerNorm → QLinear` chain stays on the host, no conversion to values and back
/// between (each was a copy of the activations). Another input (a value, read in place by
/// the value path) or an activation fused after the layer: `None`.
pub(super) fn int8_linear(
    q: &super::passes::QLinear,
    ins: &mut [Option<Slot>],
    (residual, act): (Option<usize>, Option<Activation>),
    device: &Device,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    if act.is_some() || !matches!(ins.first(), Some(Some(Slot::Rows(_)))) {
        return None;
    }
    let Some(Slot::Rows(x)) = take(ins, 0) else {
        return None;
    };
    let residual = residual.and_then(|i| take(ins, i));
    let run = || -> Result<Vec<Slot>, OnnxError> {
        let dims = q.output_dims(&x.dims)?;
        let _op = tracing::trace_span!("kiln.qlinear_rows", input = ?x.dims).entered();
        let (y, range) = match residual {
            None => q.product(&x.data, x.range, None),
            Some(Slot::Rows(r)) if q.takes_residual() && r.dims == dims => {
                q.product(&x.data, x.range, Some(&r.data))
            }
            Some(Slot::Value(v)) if q.takes_residual_value(&v, &dims) => {
                v.with_f32s(|r| q.product(&x.data, x.range, Some(r)))?
            }
            Some(other) => {
                let (y, _) = q.product(&x.data, x.range, None);
                return add_after(Slot::Rows(Rows::new(y, dims)), other, None, device);
            }
        };
        let mut rows = Rows::new(y, dims);
        rows.range = Some(range);
        Ok(vec![Slot::Rows(rows)])
    };
    Some(run())
}

/// A BatchNorm's `x · scale + shift` from its constant parameters (inputs 1 to 4).
fn pack_batch_norm(step: &HostStep, ins: &[Option<Slot>], epsilon: f64) -> Option<Packed> {
    if !(1..5).all(step.constant) {
        return None;
    }
    let params: Vec<Vec<f32>> = (1..5)
        .map(|i| float_constant(ins, i).map(|(v, _)| v))
        .collect::<Option<_>>()?;
    let [gamma, beta, mean, var] = <[Vec<f32>; 4]>::try_from(params).ok()?;
    if [&beta, &mean, &var].iter().any(|p| p.len() != gamma.len()) {
        return None;
    }
    let (scale, shift) = batch_norm_affine(&gamma, &beta, &mean, &var, epsilon);
    Some(Packed::Affine { scale, shift })
}

/// `act(x · scale + shift)` per channel on an image input (a BatchNorm, or the fold pass's
/// precomputed one, and the activation fused after it); `None` when the input is not an
/// image of `scale.len()` channels. A clamp (ReLU, ReLU6) is applied in the same pass; an
/// input another layer still reads is left as it is, the result written beside it.
pub(super) fn affine(
    ins: &mut [Option<Slot>],
    scale: &[f32],
    shift: &[f32],
    act: Option<Activation>,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    match ins.first()? {
        Some(Slot::Image(image)) if image.dims[3] == scale.len() => {}
        _ => return None,
    }
    let Some(Slot::Image(image)) = take(ins, 0) else {
        return None;
    };
    let dims = image.dims;
    let (clamp, after) = Activation::split(act);
    let mut data = owned_or_shared(
        image.data,
        |mut data| {
            scale_shift_in_place(&mut data, scale, shift, clamp);
            data
        },
        |x| scale_shift_new(x, scale, shift, clamp),
    );
    if let Some(act) = after {
        activate(&mut data, act);
    }
    Some(Ok(vec![Slot::Image(Image::new(data, dims))]))
}

/// LayerNormalization over the last axis of a float input (rows or a value of rank ≥ 2)
/// with constant scale and shift, on the host: the result stays host rows.
fn layer_norm(
    step: &HostStep,
    ins: &mut [Option<Slot>],
    axis: i64,
    epsilon: f64,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Packed::LayerNorm { gamma, beta }) = step.cache.get_or_init(|| {
        if !(step.constant)(1) {
            return None;
        }
        let gamma = float_constant(ins, 1)?.0;
        let beta = optional_constant(step, ins, 2, gamma.len())?;
        Some(Packed::LayerNorm { gamma, beta })
    }) else {
        return None;
    };
    let x = ins.first()?.as_ref()?;
    let rank = match x {
        Slot::Rows(r) => r.dims.len(),
        Slot::Value(v) => v.rank(),
        Slot::Image(_) => return None,
    };
    let last_axis = axis == -1 || usize::try_from(axis).is_ok_and(|a| a + 1 == rank);
    if !last_axis || !x.has_rows_of(gamma.len()) {
        return None;
    }
    let rows = match Rows::from_slot(ins, 0)? {
        Ok(rows) => rows,
        Err(e) => return Some(Err(e)),
    };
    let _op = tracing::trace_span!("kiln.layer_norm", dims = ?rows.dims).entered();
    let normed = rows.apply(|x| layer_norm_rows(x, gamma, beta.as_deref(), epsilon as f32));
    Some(Ok(vec![Slot::Rows(normed)]))
}

/// A linear layer whose weight (input 1; `[out, in]` when `out_major`, else `[in, out]`)
/// and bias (input 2, with `biased`) are constants, over the last axis of its input.
fn linear(
    step: &HostStep,
    ins: &mut [Option<Slot>],
    out_major: bool,
    biased: bool,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Packed::Linear(weights)) = step
        .cache
        .get_or_init(|| pack_linear(step, ins, out_major, biased))
    else {
        return None;
    };
    let [outputs, inputs, ..] = weights.dims();
    if !ins.first()?.as_ref()?.has_rows_of(inputs) {
        return None;
    }
    let x = match Rows::from_slot(ins, 0)? {
        Ok(x) => x,
        Err(e) => return Some(Err(e)),
    };
    let rows = x.data.len() / inputs.max(1);
    let mut dims = x.dims;
    if let Some(last) = dims.last_mut() {
        *last = outputs;
    }
    // A residual of the output's shape goes into the kernel's store (a transformer's
    // `Add(x, Linear(·))`); another (a broadcast operand) is added after, and the activation
    // waits for it.
    let (in_store, after) = match step.residual.and_then(|i| take(ins, i)) {
        None => (None, None),
        Some(Slot::Rows(r)) if r.dims == dims => (Some(r.data), None),
        Some(Slot::Value(v)) if v.kind() == ValueKind::Float && v.dims() == dims => {
            match v.to_f32s() {
                Ok(data) => (Some(Arc::new(data)), None),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(other) => (None, Some(other)),
    };
    let act_now = step.act.filter(|_| after.is_none());
    let _op = tracing::trace_span!("kiln.linear_rows", rows, inputs, outputs).entered();
    let apart = |r: Option<&[f32]>| linear_rows_residual_new(rows, &x.data, weights, r, act_now);
    let out = match in_store {
        // The residual's last reader writes the sum over its buffer.
        Some(r) => owned_or_shared(
            r,
            |r| linear_rows_residual_onto(rows, &x.data, weights, r, act_now),
            |r| apart(Some(r)),
        ),
        None => apart(None),
    };
    let out = Slot::Rows(Rows::new(out, dims));
    Some(match after {
        None => Ok(vec![out]),
        Some(r) => add_after(out, r, step.act, step.device),
    })
}

/// `y + r` on values (numpy broadcasting), then `act`: a linear layer's fused residual that
/// does not have the layer's output shape.
fn add_after(
    y: Slot,
    r: Slot,
    act: Option<Activation>,
    device: &Device,
) -> Result<Vec<Slot>, OnnxError> {
    let sum = super::ops::math::binary(
        super::ops::math::Binary::Add,
        y.into_value(device)?,
        r.into_value(device)?,
    )?;
    let sum = match act {
        None => sum,
        Some(act) => super::passes::activate(act, sum)?,
    };
    Ok(vec![Slot::Value(sum)])
}

fn pack_linear(
    step: &HostStep,
    ins: &[Option<Slot>],
    out_major: bool,
    biased: bool,
) -> Option<Packed> {
    if !(step.constant)(1) {
        return None;
    }
    let (weight, dims) = float_constant(ins, 1)?;
    let [a, b]: [usize; 2] = dims.try_into().ok()?;
    let (outputs, inputs) = if out_major { (a, b) } else { (b, a) };
    let bias = if biased {
        optional_constant(step, ins, 2, outputs)?
    } else {
        None
    };
    // `[in, out]` rows, the layout `ConvWeights::linear` takes.
    let rows = if out_major {
        let mut t = vec![0f32; weight.len()];
        for o in 0..outputs {
            for i in 0..inputs {
                t[i * outputs + o] = weight[o * inputs + i];
            }
        }
        t
    } else {
        weight
    };
    Some(Packed::Linear(ConvWeights::linear(
        inputs,
        outputs,
        &rows,
        bias.as_deref(),
    )))
}

/// Input `i` as host floats with its dimensions, when it is a float value.
fn float_constant(ins: &[Option<Slot>], i: usize) -> Option<(Vec<f32>, Vec<usize>)> {
    match ins.get(i)? {
        Some(Slot::Value(v)) if v.kind() == ValueKind::Float => Some((v.to_f32s().ok()?, v.dims())),
        _ => None,
    }
}

/// Optional constant input `i` of a step (a bias, a shift) of `len` values: `Some(None)`
/// when the step has none, `Some(Some(values))` for a constant of that length, `None` (the
/// step stays off the host) when it is computed or of another length.
fn optional_constant(
    step: &HostStep,
    ins: &[Option<Slot>],
    i: usize,
    len: usize,
) -> Option<Option<Vec<f32>>> {
    if !ins.get(i).is_some_and(Option::is_some) {
        return Some(None);
    }
    if !(step.constant)(i) {
        return None;
    }
    let values = float_constant(ins, i)?.0;
    (values.len() == len).then_some(Some(values))
}

/// `owned(values)` when the caller holds the buffer's only reference (the step is the
/// value's last reader: the executor moves a value to it), else `shared` reading the values
/// where they are: what no other step will read is written in place.
fn owned_or_shared<R>(
    data: Arc<Vec<f32>>,
    owned: impl FnOnce(Vec<f32>) -> R,
    shared: impl FnOnce(&[f32]) -> R,
) -> R {
    match Arc::try_unwrap(data) {
        Ok(data) => owned(data),
        Err(data) => shared(&data),
    }
}

/// Takes input `i` (the caller's slots are rebuilt per run, so taking is free).
fn take(ins: &mut [Option<Slot>], i: usize) -> Option<Slot> {
    ins.get_mut(i).and_then(Option::take)
}

/// Packs the weights of Conv step `step` when they are constants and the grouping is one the
/// host kernels run (one group, depthwise with one filter per channel, or groups the
/// implicit GEMM's panels hold).
fn pack_conv(step: &HostStep, ins: &[Option<Slot>], groups: usize) -> Option<PackedConv> {
    if !(step.constant)(1) {
        return None;
    }
    let (weight, dims) = float_constant(ins, 1)?;
    let [cout, per_group, kh, kw]: [usize; 4] = dims.try_into().ok()?;
    let bias = optional_constant(step, ins, 2, cout)?;
    if groups == 1 {
        return Some(PackedConv::Dense(ConvWeights::pack(
            [cout, per_group, kh, kw],
            &weight,
            bias.as_deref(),
        )));
    }
    if per_group == 1 && groups == cout {
        return Some(PackedConv::Depthwise(DepthwiseWeights::pack(
            cout,
            [kh, kw],
            &weight,
            bias.as_deref(),
        )));
    }
    ConvWeights::pack_grouped([cout, per_group, kh, kw], groups, &weight, bias.as_deref())
        .map(PackedConv::Dense)
}

/// The convolution of `x` (an image, or an NCHW value converted once), plus `residual`
/// when given (in the kernel's store when it has the output's shape), then `act`.
fn conv(
    x: Slot,
    packed: &PackedConv,
    window: &Window,
    (act, residual): (Option<Activation>, Option<Slot>),
    pool: bool,
    device: &Device,
) -> Result<Vec<Slot>, OnnxError> {
    let x = match (x, packed) {
        (Slot::Value(v), PackedConv::Dense(weights))
            if residual.is_none() && !pool && reads_as_planes(&v, weights) =>
        {
            return conv_planes(v, weights, window, act);
        }
        (x, _) => x,
    };
    let image = x.into_image()?;
    let (win, out_dims) = conv_window(image.dims, packed.io(image.dims[3]), window)?;
    let [n, oh, ow, cout] = out_dims;
    // A residual of the output's shape goes into the store; another (a broadcast operand) is
    // added after, and the ReLU waits for it.
    let (in_store, after) = match residual {
        None => (None, None),
        Some(Slot::Image(r)) if r.dims == out_dims => (Some(r), None),
        Some(Slot::Value(v)) if v.kind() == ValueKind::Float && v.dims() == [n, cout, oh, ow] => {
            (Some(Image::from_value(v)?), None)
        }
        Some(other) => (None, Some(other)),
    };
    // With a residual added after the store, the activation waits for it.
    let act_now = act.filter(|_| after.is_none());
    let out = match packed {
        PackedConv::Dense(weights) => {
            let s = dense_shape(&win, cout);
            let _op = tracing::trace_span!("kiln.conv2d_nhwc", input = ?image.dims, cout).entered();
            if pool && in_store.is_none() && act_now == Some(Activation::Relu) {
                // The pooled maximum is what the kernel stores (`fuse_relu_pools`).
                let out = conv2d_nhwc_relu_pool2_new(&s, &image.data, weights);
                let pooled = Image::new(out, [n, oh / 2, ow / 2, cout]);
                return Ok(vec![Slot::Image(pooled)]);
            }
            let apart =
                |r: Option<&[f32]>| conv2d_nhwc_fused_new(&s, &image.data, weights, r, act_now);
            match in_store {
                // The residual's last reader writes the sum over its buffer.
                Some(r) => owned_or_shared(
                    r.data,
                    |r| conv2d_nhwc_fused_onto(&s, &image.data, weights, r, act_now),
                    |r| apart(Some(r)),
                ),
                None => apart(None),
            }
        }
        PackedConv::Depthwise(weights) => {
            let _op = tracing::trace_span!("kiln.depthwise_nhwc", input = ?image.dims).entered();
            match &in_store {
                None => depthwise_conv2d(&image.data, &win, weights, act_now),
                Some(r) => {
                    let mut out = depthwise_conv2d(&image.data, &win, weights, None);
                    arith_in_place(&mut out, &r.data, Arith::Add, false);
                    if let Some(act) = act_now {
                        activate(&mut out, act);
                    }
                    out
                }
            }
        }
    };
    let out = Image::new(out, out_dims);
    let outs = match after {
        Some(r) => add_residual(out, r, act, device),
        None => Ok(vec![Slot::Image(out)]),
    };
    if pool {
        outs.and_then(max_pool_2x2)
    } else {
        outs
    }
}

/// The 2×2, stride-2 max pool fused into a convolution at load, over its first output,
/// where its kernel did not pool in its store (a depthwise or int8 convolution).
pub(super) fn max_pool_2x2(mut outs: Vec<Slot>) -> Result<Vec<Slot>, OnnxError> {
    if outs.is_empty() {
        return Ok(outs);
    }
    let image = outs.remove(0).into_image()?;
    let win = Window2d {
        dims: image.dims,
        kernel: [2, 2],
        stride: [2, 2],
        dilation: [1, 1],
        pads: [(0, 0); 2],
        ceil_mode: false,
    };
    let pooled = pool2d(&image.data, &win, PoolKind::Max);
    outs.insert(0, Slot::Image(Image::new(pooled, win.out_dims())));
    Ok(outs)
}

/// `out + r`, then `act`, for a residual that was not summed in a kernel's
/// store: an image or NCHW value of `out`'s shape, a per-channel operand, or (numpy
/// broadcasting) anything else on values.
fn add_residual(
    out: Image,
    r: Slot,
    act: Option<Activation>,
    device: &Device,
) -> Result<Vec<Slot>, OnnxError> {
    let [n, h, w, c] = out.dims;
    let r = match r {
        Slot::Value(v) if v.kind() == ValueKind::Float && v.dims() == [n, c, h, w] => {
            Slot::Image(Image::from_value(v)?)
        }
        other => other,
    };
    let mut operands = [Some(Slot::Image(out)), Some(r)];
    let sum = match binary(&mut operands, Arith::Add, false) {
        Some(sum) => sum?,
        None => {
            // `binary` leaves operands it cannot take: numpy broadcasting on values.
            let [Some(y), Some(r)] = operands else {
                return Err(OnnxError::Graph("a residual operand went missing".into()));
            };
            vec![Slot::Value(super::ops::math::binary(
                super::ops::math::Binary::Add,
                y.into_value(device)?,
                r.into_value(device)?,
            )?)]
        }
    };
    match act {
        None => Ok(sum),
        Some(act) => sum
            .into_iter()
            .map(|slot| activate_slot(slot, act))
            .collect(),
    }
}

/// `act` of `slot`, in place for an image or rows.
fn activate_slot(slot: Slot, act: Activation) -> Result<Slot, OnnxError> {
    match slot {
        Slot::Image(image) => Ok(activated(image, act)),
        Slot::Rows(rows) => Ok(activated_rows(rows, act)),
        Slot::Value(v) => Ok(Slot::Value(super::passes::activate(act, v)?)),
    }
}

/// `act` of an image or of rows (an activation node, or a step fused at load: SiLU, GELU);
/// `None` for a value, which the ONNX operator takes.
pub(super) fn unary(
    ins: &mut [Option<Slot>],
    act: Activation,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    // A value stays in its slot for the ONNX operator.
    if let Slot::Value(_) = ins.first()?.as_ref()? {
        return None;
    }
    match take(ins, 0)? {
        Slot::Image(image) => Some(Ok(vec![activated(image, act)])),
        Slot::Rows(rows) => Some(Ok(vec![activated_rows(rows, act)])),
        Slot::Value(_) => None,
    }
}

/// `act` of every value of `rows` (in place when this was their last reader).
fn activated_rows(rows: Rows, act: Activation) -> Slot {
    Slot::Rows(rows.apply(|x| activate(x, act)))
}

/// `act` of every value of `image` (in place when this was its last reader).
fn activated(image: Image, act: Activation) -> Slot {
    let dims = image.dims;
    let mut data = image.into_vec();
    activate(&mut data, act);
    Slot::Image(Image::new(data, dims))
}

/// An operand of a per-channel operation: `[rows, channels]` values.
fn per_channel(slot: &Slot, image: [usize; 4]) -> Option<Vec<f32>> {
    let [n, _, _, c] = image;
    match slot {
        // A squeeze-excitation gate left channels-last: `[n or 1, 1, 1, c]`.
        Slot::Image(g) => {
            let [gn, gh, gw, gc] = g.dims;
            (gh * gw == 1 && gc == c && (gn == n || gn == 1)).then(|| (*g.data).clone())
        }
        // A constant or gate in ONNX layout: `[c, 1, 1]`, `[1 or n, c, 1, 1]`, or a scalar.
        Slot::Value(v) if v.kind() == ValueKind::Float => {
            let dims = v.dims();
            if v.len() == 1 {
                return Some(vec![v.to_f32s().ok()?[0]; c]);
            }
            let fits = match dims.as_slice() {
                [vc, 1, 1] => *vc == c,
                [vn, vc, 1, 1] => *vc == c && (*vn == n || *vn == 1),
                _ => false,
            };
            fits.then(|| v.to_f32s().ok()).flatten()
        }
        Slot::Value(_) | Slot::Rows(_) => None,
    }
}

/// Element-wise arithmetic with an image operand: two images of one size, or an image and
/// a per-channel operand (a constant, a scalar or a squeeze-excitation gate) on either side.
fn binary(ins: &mut [Option<Slot>], op: Arith, relu: bool) -> Option<Result<Vec<Slot>, OnnxError>> {
    let (a, b) = (ins.first()?.as_ref()?, ins.get(1)?.as_ref()?);
    if matches!(a, Slot::Rows(_)) || matches!(b, Slot::Rows(_)) {
        return binary_rows(ins, op, relu);
    }
    let row_for = |x: &Slot, v: &Slot| match x {
        Slot::Image(x) => per_channel(v, x.dims),
        Slot::Value(_) | Slot::Rows(_) => None,
    };
    // (which input is the full image, the other as per-channel rows, whether it comes first)
    let (x_at, rows, swap) = match (a, b) {
        (Slot::Image(a), Slot::Image(b)) if a.dims == b.dims => (0, None, false),
        _ => match row_for(a, b) {
            Some(rows) => (0, Some(rows), false),
            None => (1, Some(row_for(b, a)?), true),
        },
    };
    let other = take(ins, 1 - x_at)?;
    let Some(Slot::Image(x)) = take(ins, x_at) else {
        return None;
    };
    let dims = x.dims;
    let mut data = x.into_vec();
    match (rows, other) {
        (Some(rows), _) => {
            let [_, h, w, c] = dims;
            arith_channels_in_place(&mut data, &rows, [h * w, c], op, swap);
            if relu {
                activate(&mut data, Activation::Relu);
            }
        }
        (None, Slot::Image(o)) => arith_in_place(&mut data, &o.data, op, relu),
        (None, Slot::Value(_) | Slot::Rows(_)) => return None,
    }
    Some(Ok(vec![Slot::Image(Image::new(data, dims))]))
}

/// Element-wise arithmetic with a host-rows operand: two operands of one shape (rows, or
/// rows and a float value), or rows and an operand along their last axis (a bias, a layer
/// scale, a scalar) on either side; `None` for any other broadcast.
fn binary_rows(
    ins: &mut [Option<Slot>],
    op: Arith,
    relu: bool,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let (a, b) = (ins.first()?.as_ref()?, ins.get(1)?.as_ref()?);
    // (which input is the rows, whether the other is the same shape, whether it comes first)
    let (x_at, same, swap) = match (a, b) {
        (Slot::Rows(x), other) if same_shape(other, &x.dims) => (0, true, false),
        (other, Slot::Rows(x)) if same_shape(other, &x.dims) => (1, true, true),
        (Slot::Rows(x), other) if along_last(other, x.last()) => (0, false, false),
        (other, Slot::Rows(x)) if along_last(other, x.last()) => (1, false, true),
        _ => return None,
    };
    let other = float_values(take(ins, 1 - x_at)?)?;
    let Some(Slot::Rows(x)) = take(ins, x_at) else {
        return None;
    };
    let dims = x.dims.clone();
    let c = x.last();
    let mut data = x.into_vec();
    let other = match other {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    if same {
        if swap && matches!(op, Arith::Sub | Arith::Div) {
            // `other ∘ rows`: not commutative, so into the other operand's buffer.
            let mut out = other;
            arith_in_place(&mut out, &data, op, relu);
            data = out;
        } else {
            arith_in_place(&mut data, &other, op, relu);
        }
    } else {
        let row = if other.len() == 1 {
            vec![other[0]; c]
        } else {
            other
        };
        arith_channels_in_place(&mut data, &row, [1, c], op, swap);
        if relu {
            activate(&mut data, Activation::Relu);
        }
    }
    Some(Ok(vec![Slot::Rows(Rows::new(data, dims))]))
}

/// Whether `slot` is a float operand of exactly `dims`.
fn same_shape(slot: &Slot, dims: &[usize]) -> bool {
    match slot {
        Slot::Rows(r) => r.dims == dims,
        Slot::Value(v) => v.kind() == ValueKind::Float && v.dims() == dims,
        Slot::Image(_) => false,
    }
}

/// Whether `slot` is a float operand that broadcasts along the last axis of `c` values: a
/// scalar, or ones but for a last axis of `c` (`[c]`, `[1, 1, c]`).
fn along_last(slot: &Slot, c: usize) -> bool {
    let dims = match slot {
        Slot::Rows(r) => r.dims.clone(),
        Slot::Value(v) if v.kind() == ValueKind::Float => v.dims(),
        _ => return false,
    };
    let len: usize = dims.iter().product();
    len == 1 || (dims.last() == Some(&c) && len == c)
}

/// A float operand's values (copied out of a value, shared rows cloned).
fn float_values(slot: Slot) -> Option<Result<Vec<f32>, OnnxError>> {
    match slot {
        Slot::Rows(r) => Some(Ok(r.into_vec())),
        Slot::Value(v) => Some(v.to_f32s()),
        Slot::Image(_) => None,
    }
}

impl PackedConv {
    /// Input channels, kernel size and output channels (of an input of `c` channels).
    fn io(&self, c: usize) -> (usize, [usize; 2], usize) {
        match self {
            PackedConv::Dense(weights) => dense_io(weights),
            PackedConv::Depthwise(weights) => (weights.channels(), weights.kernel(), c),
        }
    }
}

/// [`PackedConv::io`] of a dense convolution.
fn dense_io(weights: &ConvWeights) -> (usize, [usize; 2], usize) {
    let [cout, _, kh, kw] = weights.dims();
    (weights.input_channels(), [kh, kw], cout)
}

/// The window of a convolution (`io` from [`PackedConv::io`]) over an image of dimensions
/// `[n, h, w, c]`, and the output's dimensions; an error when the channels or the size do
/// not fit the kernel.
fn conv_window(
    [n, h, w, c]: [usize; 4],
    (cin, kernel, cout): (usize, [usize; 2], usize),
    window: &Window,
) -> Result<(Window2d, [usize; 4]), OnnxError> {
    let pads = window.pads([h, w]);
    if c != cin {
        return Err(OnnxError::Shape(format!(
            "Conv expects {cin} input channels; the input has {c}"
        )));
    }
    kernel_fits([h, w], pads, kernel, window.dilation)?;
    let win = Window2d {
        dims: [n, h, w, c],
        kernel,
        stride: window.stride,
        dilation: window.dilation,
        pads,
        ceil_mode: false,
    };
    let [_, oh, ow, _] = win.out_dims();
    Ok((win, [n, oh, ow, cout]))
}

/// The dense convolution of `cout` outputs over `win`.
fn dense_shape(win: &Window2d, cout: usize) -> ConvShape {
    let [batch, h, w, cin] = win.dims;
    ConvShape {
        batch,
        cin,
        h,
        w,
        cout,
        kh: win.kernel[0],
        kw: win.kernel[1],
        stride: win.stride,
        padding: win.pads,
        dilation: win.dilation,
    }
}

/// Input channels up to which a dense convolution reads an NCHW value as it is (see
/// [`conv2d_nhwc_fused_from_nchw_new`]): an RGB or RGBA image, whose pixels gather from
/// that many planes at once. Wider NCHW values go through the blocked transpose.
const PLANE_CHANNELS: usize = 4;

/// Whether `v` is an NCHW float image of few channels that a dense convolution of `weights`
/// reads without a transpose first (a graph's input into its stem).
fn reads_as_planes(v: &Value, weights: &ConvWeights) -> bool {
    let dims = v.dims();
    v.kind() == ValueKind::Float
        && dims.len() == 4
        && dims[1] == weights.input_channels()
        && dims[1] <= PLANE_CHANNELS
        && dims[2] * dims[3] > 1
}

/// The dense convolution (then `act`) of an NCHW image `v`, read in place where the backend
/// allows: the kernel transposes it while padding ([`reads_as_planes`]).
fn conv_planes(
    v: Value,
    weights: &ConvWeights,
    window: &Window,
    act: Option<Activation>,
) -> Result<Vec<Slot>, OnnxError> {
    let Ok([n, c, h, w]) = <[usize; 4]>::try_from(v.dims()) else {
        return Err(OnnxError::Shape(format!(
            "an image layer takes [N, C, H, W]; got {:?}",
            v.dims()
        )));
    };
    let (win, out_dims) = conv_window([n, h, w, c], dense_io(weights), window)?;
    let s = dense_shape(&win, out_dims[3]);
    let _op =
        tracing::trace_span!("kiln.conv2d_nhwc", input = ?[n, c, h, w], layout = "nchw").entered();
    let out = v.with_f32s(|x| conv2d_nhwc_fused_from_nchw_new(&s, x, weights, act))?;
    Ok(vec![Slot::Image(Image::new(out, out_dims))])
}

/// Refuses a convolution whose (dilated) kernel is larger than its padded `[h, w]` input:
/// it would have no output.
pub(super) fn kernel_fits(
    [h, w]: [usize; 2],
    pads: [(usize, usize); 2],
    kernel: [usize; 2],
    dilation: [usize; 2],
) -> Result<(), OnnxError> {
    for (axis, len) in [h, w].into_iter().enumerate() {
        let span = (kernel[axis].max(1) - 1) * dilation[axis] + 1;
        let padded = len + pads[axis].0 + pads[axis].1;
        if padded < span {
            return Err(OnnxError::Shape(format!(
                "Conv input {h}×{w} (padded {padded} on axis {axis}) is smaller than its \
                 {kernel:?} kernel (dilation {dilation:?})"
            )));
        }
    }
    Ok(())
}

fn pool(
    ins: &mut [Option<Slot>],
    window: &Window,
    ceil_mode: bool,
    kind: PoolKind,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Slot::Image(image)) = take(ins, 0) else {
        return None;
    };
    let [_, h, w, _] = image.dims;
    let win = Window2d {
        dims: image.dims,
        kernel: window.kernel,
        stride: window.stride,
        dilation: window.dilation,
        pads: window.pads([h, w]),
        ceil_mode,
    };
    let [_, oh, ow, _] = win.out_dims();
    if oh * ow == 0 {
        return Some(Err(OnnxError::Shape(format!(
            "pooling a {h}×{w} input with a {:?} window leaves no output",
            window.kernel
        ))));
    }
    let out = pool2d(&image.data, &win, kind);
    Some(Ok(vec![Slot::Image(Image::new(out, win.out_dims()))]))
}

/// The mean over an image's height and width: `[n, c, 1, 1]` (an image, whose NCHW and
/// NHWC sequences coincide) or, without `keepdims`, `[n, c]` rows of the same data.
fn spatial_mean(ins: &mut [Option<Slot>], keepdims: bool) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Slot::Image(image)) = take(ins, 0) else {
        return None;
    };
    let [n, _, _, c] = image.dims;
    let means = global_average(&image.data, image.dims);
    Some(Ok(vec![if keepdims {
        Slot::Image(Image::new(means, [n, 1, 1, c]))
    } else {
        Slot::Rows(Rows::new(means, vec![n, c]))
    }]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A convolution that is its residual's last reader writes the sum over the residual's
    /// buffer; one whose residual another step still reads (a shared buffer) leaves that
    /// residual as it was. Both give the sum a direct loop gives.
    #[test]
    fn a_convolution_writes_over_its_residual_only_when_it_reads_it_last() {
        use onnx_ir::node::padding::{AutoPad, PaddingConfig2d};
        let device = Device::default();
        let (n, h, w, cin, cout) = (2, 5, 4, 8, 40);
        let value = |i: usize, seed: usize| ((i * 37 + seed * 11) % 23) as f32 / 23.0 - 0.5;
        let x: Vec<f32> = (0..n * h * w * cin).map(|i| value(i, 1)).collect();
        let weight: Vec<f32> = (0..cout * cin).map(|i| value(i, 2)).collect();
        let bias: Vec<f32> = (0..cout).map(|i| value(i, 3)).collect();
        let residual: Vec<f32> = (0..n * h * w * cout).map(|i| value(i, 4)).collect();
        let want: Vec<f32> = (0..residual.len())
            .map(|i| {
                let (px, o) = (i / cout, i % cout);
                let dot: f32 = (0..cin)
                    .map(|c| x[px * cin + c] * weight[o * cin + c])
                    .sum();
                (dot + bias[o] + residual[i]).max(0.0)
            })
            .collect();
        let packed = PackedConv::Dense(ConvWeights::pack([cout, cin, 1, 1], &weight, Some(&bias)));
        let window = Window {
            kernel: [1, 1],
            stride: [1, 1],
            dilation: [1, 1],
            padding: PaddingConfig2d::Valid,
            auto_pad: AutoPad::NotSet,
        };
        let image = |data: Vec<f32>, c: usize| Image::new(data, [n, h, w, c]);
        let run = |r: Image| {
            let outs = conv(
                Slot::Image(image(x.clone(), cin)),
                &packed,
                &window,
                (Some(Activation::Relu), Some(Slot::Image(r))),
                false,
                &device,
            )
            .unwrap();
            outs.into_iter().next().unwrap().into_image().unwrap()
        };
        let close = |got: &[f32]| got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-5);
        // Read later too: the step's copy is shared, so the sum takes a new buffer.
        let shared = image(residual.clone(), cout);
        let kept = Arc::clone(&shared.data);
        let out = run(shared);
        assert!(close(&out.data), "sum beside a shared residual");
        assert_eq!(&kept[..], &residual[..], "a shared residual was written");
        assert!(!Arc::ptr_eq(&out.data, &kept));
        // Its last reader: the sum lands in the residual's own buffer.
        let last = image(residual.clone(), cout);
        let buffer = last.data.as_ptr();
        let out = run(last);
        assert!(close(&out.data), "sum over the residual");
        assert_eq!(
            out.data.as_ptr(),
            buffer,
            "the residual's buffer was not reused"
        );
    }

    #[test]
    fn a_kernel_larger_than_its_padded_input_is_refused_with_the_sizes() {
        let none = [(0, 0); 2];
        let err = kernel_fits([2, 5], none, [3, 3], [1, 1]).expect_err("3×3 on 2 rows");
        let text = err.to_string();
        assert!(text.contains("2×5") && text.contains("axis 0"), "{text}");
        // Padding makes it fit; dilation makes the span larger again.
        assert!(kernel_fits([2, 5], [(1, 0), (0, 0)], [3, 3], [1, 1]).is_ok());
        assert!(kernel_fits([4, 4], none, [3, 3], [2, 2]).is_err());
        assert!(kernel_fits([5, 5], none, [3, 3], [2, 2]).is_ok());
    }

    #[test]
    fn an_input_image_is_the_same_read_in_place_or_from_a_strided_view() {
        let device = Device::default();
        let (n, c, h, w) = (2, 3, 4, 5);
        let nchw: Vec<f32> = (0..n * c * h * w).map(|i| i as f32).collect();
        let mut nhwc = vec![0f32; nchw.len()];
        for (i, v) in nchw.iter().enumerate() {
            let (b, ch, y, x) = (i / (c * h * w), i / (h * w) % c, i / w % h, i % w);
            nhwc[((b * h + y) * w + x) * c + ch] = *v;
        }
        let dense = Tensor::<4>::from_data(TensorData::new(nchw.clone(), [n, c, h, w]), &device);
        let image = Image::from_value(Value::float(dense.clone())).unwrap();
        assert_eq!((image.dims, &image.data[..]), ([n, h, w, c], &nhwc[..]));
        // The same values as a strided view (NHWC storage permuted to NCHW).
        let stored = dense.permute([0, 2, 3, 1]);
        let stored = Tensor::<4>::from_data(stored.into_data(), &device);
        let view = Image::from_value(Value::float(stored.permute([0, 3, 1, 2]))).unwrap();
        assert_eq!((view.dims, &view.data[..]), ([n, h, w, c], &nhwc[..]));
    }

    fn value(data: &[f32], dims: &[usize]) -> Slot {
        let data = TensorData::new(data.to_vec(), dims.to_vec());
        Slot::Value(Value::from_data(data, &Device::default()).unwrap())
    }

    fn rows(data: &[f32], dims: &[usize]) -> Slot {
        Slot::Rows(Rows::new(data.to_vec(), dims.to_vec()))
    }

    /// Runs `binary_rows` on `(a, b)`: the result's values and dims.
    fn run_rows(a: Slot, b: Slot, op: Arith, relu: bool) -> Option<(Vec<f32>, Vec<usize>)> {
        let mut ins = [Some(a), Some(b)];
        match binary_rows(&mut ins, op, relu)?.unwrap().pop() {
            Some(Slot::Rows(r)) => Some((r.data.to_vec(), r.dims)),
            other => panic!("host rows expected, got {other:?}"),
        }
    }

    /// Host-rows arithmetic keeps the operand order of `Sub` and `Div` on either side, for
    /// same-shape operands and for operands along the last axis (a bias `[c]`, a scalar),
    /// applies the fused ReLU, and leaves other broadcasts to the ONNX operator with the
    /// inputs in place.
    #[test]
    fn arithmetic_on_host_rows_keeps_operand_order() {
        let x = [1.0, -2.0, 3.0, 4.0, -5.0, 6.0];
        let y = [0.5, 0.25, 2.0, -1.0, 4.0, 8.0];
        let dims = [2, 3];
        let (got, d) = run_rows(value(&y, &dims), rows(&x, &dims), Arith::Sub, false).unwrap();
        assert_eq!(d, dims);
        assert_eq!(
            got,
            y.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<_>>()
        );
        let (got, _) = run_rows(rows(&x, &dims), rows(&y, &dims), Arith::Add, true).unwrap();
        assert_eq!(
            got,
            x.iter()
                .zip(&y)
                .map(|(a, b)| (a + b).max(0.0))
                .collect::<Vec<_>>()
        );
        let bias = [10.0, 20.0, 40.0];
        let (got, _) = run_rows(value(&bias, &[3]), rows(&x, &dims), Arith::Div, false).unwrap();
        let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| bias[i % 3] / v).collect();
        assert_eq!(got, want);
        let (got, _) = run_rows(rows(&x, &dims), value(&[2.0], &[1]), Arith::Sub, false).unwrap();
        assert_eq!(got, x.iter().map(|v| v - 2.0).collect::<Vec<_>>());
        // A column operand `[2, 1]` broadcasts along the first axis: not a host case.
        let mut ins = [Some(rows(&x, &dims)), Some(value(&[1.0, 2.0], &[2, 1]))];
        assert!(binary_rows(&mut ins, Arith::Mul, false).is_none());
        assert!(
            ins.iter().all(Option::is_some),
            "inputs taken by a refused case"
        );
    }
}
