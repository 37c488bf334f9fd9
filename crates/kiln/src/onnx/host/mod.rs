//! Channels-last execution of an imported model's image layers on the host.
//!
//! When Kiln's CPU kernels serve the model's device, a convolution with constant weights
//! runs on [`kiln_kernels::implicit`] (dense and grouped) or [`kiln_kernels::depthwise`]
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

mod convolution;
mod elementwise;
mod layout;
mod slot;

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use burn::tensor::{Device, Tensor, TensorData};
use onnx_ir::Node;
use onnx_ir::node::reduce::ReduceAxes;

use super::OnnxError;
use super::ops::nn::Window;
use super::ops::node_window;
use super::value::{Value, ValueKind};
pub(super) use convolution::*;
pub(super) use elementwise::*;
use kiln_kernels::activation::{Activation, activate, erf_in_place};
use kiln_kernels::base::layout::{nchw_to_nhwc, nhwc_to_nchw};
use kiln_kernels::base::shape::ConvShape;
use kiln_kernels::base::window::Window2d;
use kiln_kernels::channelwise::{
    Arith, arith_channels_in_place, arith_in_place, scale_shift_in_place, scale_shift_new,
};
use kiln_kernels::depthwise::{DepthwiseWeights, depthwise_conv2d};
use kiln_kernels::expand_depthwise::ExpandDepthwise;
use kiln_kernels::implicit::{
    ConvWeights, conv2d_nhwc_fused_from_nchw_new, conv2d_nhwc_fused_new, conv2d_nhwc_fused_onto,
    conv2d_nhwc_into_channels, conv2d_nhwc_relu_pool2_new, linear_rows_residual_new,
    linear_rows_residual_onto,
};
use kiln_kernels::layer_norm::layer_norm_rows;
use kiln_kernels::norm::batch_norm_affine;
use kiln_kernels::pool::{PoolKind, global_average, pool2d};
pub(super) use layout::channel_shuffle;
use layout::{concat_channels, relayout, split_channels};
pub(super) use slot::*;

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
    /// Whether the convolution may run as Winograd ([`super::Step`]'s `winograd`).
    pub winograd: bool,
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
