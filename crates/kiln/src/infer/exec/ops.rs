//! One function per prepared operation; [`run`] dispatches to them. A new (fused) operation
//! gets a [`Prepared`] variant, a function here and one line in [`run`].
//!
//! Half-precision ops take their input cast down and give their result back in f32, so every
//! other op sees f32 (the autocast policy of mixed-precision training).

use burn::nn::pool::MaxPool2d;
use burn::tensor::module::adaptive_avg_pool2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, FloatDType, Tensor};
use kiln_kernels::implicit::ConvWeights;
use rayon::prelude::*;

use super::{
    ConvInput, NhwcConv, Prepared, Value, add_broadcast, attention, check_features, flat,
    for_image, host, host_max_pool, host_tensor, image, nhwc_columns, nhwc_rows, quantized_conv,
    quantized_matmul, seq, to_compute, to_f32, value_dims,
};
use crate::infer::graph::{ConvGeometry, QuantWeight};
use kiln_kernels::base::layout::nchw_to_nhwc;
use kiln_kernels::int8::{ImageLayout, PackedWeights};
use kiln_kernels::pool::{PoolShape, max_pool2d_nhwc};

/// An operation's result, or what was wrong with its inputs.
pub(super) type OpResult = std::result::Result<Value, String>;

/// Runs `op` on `inputs` (the first is the main operand).
pub(super) fn run(
    op: &Prepared,
    mut inputs: Vec<Value>,
    device: &Device,
    compute: Option<FloatDType>,
) -> OpResult {
    // One span per node (TRACE: free unless a profiler listens); the profile's table groups
    // them by operator.
    let _node = tracing::trace_span!("infer.node", op = op.name()).entered();
    let x = inputs.remove(0);
    match op {
        Prepared::Conv {
            weight,
            bias,
            options,
            nhwc,
            relu,
            pool,
        } => {
            match nhwc {
                // The fused pool always follows a fused ReLU (`fuse_relu_pool`).
                Some(host) if crate::kernels::serves(device) => {
                    conv_nhwc(x, host, *relu, pool.is_some())
                }
                _ => {
                    let y = conv(x, weight, bias, options, device, compute, *relu)?;
                    match pool {
                        Some(pool) => max_pool(y, pool, device),
                        None => Ok(y),
                    }
                }
            }
        }
        Prepared::Linear {
            weight,
            bias,
            nhwc,
            relu,
        } => linear(x, weight, bias, nhwc, *relu, device, compute),
        Prepared::Affine { scale, shift, host } => affine(x, [scale, shift], host, device),
        Prepared::Relu => Ok(relu(x)),
        Prepared::MaxPool(pool) => max_pool(x, pool, device),
        Prepared::Reshape(shape) => reshape(x, shape, device),
        Prepared::AddConstant(constant) => add_broadcast(x, constant.clone(), device),
        Prepared::LayerNorm { gamma, beta, eps } => layer_norm(x, gamma, beta, *eps, device),
        Prepared::Attention { heads, head_dim } => {
            multi_head_attention(x, inputs, [*heads, *head_dim], device, compute)
        }
        Prepared::TokenMean => token_mean(x, device),
        Prepared::GlobalAvgPool => Ok(Value::Image(adaptive_avg_pool2d(image(x, device)?, [1, 1]))),
        Prepared::Flatten => Ok(flatten(x)),
        Prepared::Add => add(x, inputs, device),
        Prepared::Identity => Ok(x),
        Prepared::QLinear {
            weight,
            source,
            nhwc,
            bias,
            relu,
        } => qlinear(
            x,
            QLinearWeights {
                weight,
                source,
                nhwc,
            },
            bias,
            *relu,
        ),
        Prepared::QConv {
            weight,
            bias,
            geometry,
            relu,
        } => qconv(x, weight, bias, geometry, *relu),
    }
}

/// f32 (or half-precision) convolution through Kiln's kernel entry point (Burn's op on other
/// devices), then the fused ReLU if any.
fn conv(
    x: Value,
    weight: &Tensor<4>,
    bias: &Option<Tensor<1>>,
    options: &ConvOptions<2>,
    device: &Device,
    compute: Option<FloatDType>,
    relu: bool,
) -> OpResult {
    let y = to_f32(crate::kernels::conv2d(
        to_compute(image(x, device)?, compute),
        weight.clone(),
        bias.clone(),
        options.clone(),
    ));
    Ok(Value::Image(if relu {
        burn::tensor::activation::relu(y)
    } else {
        y
    }))
}

/// f32 convolution on the host in channels-last layout (Kiln's kernel, ReLU fused, and with
/// `relu_pool2` ReLU and a 2×2 / stride 2 max pool in the same pass): the result stays
/// channels-last for the next convolution, pooling or int8 layer.
fn conv_nhwc(x: Value, conv: &NhwcConv, relu: bool, relu_pool2: bool) -> OpResult {
    let (data, [b, h, w, c]) = match x {
        Value::Nhwc {
            data,
            dims,
            flat: false,
            ..
        } => (data, dims),
        other => {
            let (values, dims) = host(other);
            let [b, c, h, w]: [usize; 4] = dims
                .try_into()
                .map_err(|d| format!("expects an image, got {d:?}"))?;
            (nchw_to_nhwc(&values, [b, c, h, w]), [b, h, w, c])
        }
    };
    let s = conv.shape([b, c, h, w]);
    if c != s.cin {
        return Err(format!("expects {} input channels, got {c}", s.cin));
    }
    let (out, dims) = if relu_pool2 {
        let _op = tracing::trace_span!("kiln.conv2d_nhwc_relu_pool2", input = ?[b, h, w, c], cout = s.cout)
            .entered();
        let out = kiln_kernels::implicit::conv2d_nhwc_relu_pool2_new(&s, &data, &conv.weights);
        (out, [b, s.out_h() / 2, s.out_w() / 2, s.cout])
    } else {
        let _op = tracing::trace_span!("kiln.conv2d_nhwc", input = ?[b, h, w, c], cout = s.cout)
            .entered();
        let out = kiln_kernels::implicit::conv2d_nhwc_new(&s, &data, &conv.weights, relu);
        (out, [b, s.out_h(), s.out_w(), s.cout])
    };
    Ok(Value::Nhwc {
        data: out,
        dims,
        flat: false,
        range: None,
    })
}

/// A linear layer over flat features, or per token of a sequence, with ReLU when `relu`. A
/// flattened channels-last image is read through the weight's rows reordered once (`nhwc`)
/// instead of transposing every input, by Kiln's host kernel (bias and ReLU in registers).
fn linear(
    x: Value,
    weight: &Tensor<2>,
    bias: &Option<Tensor<1>>,
    nhwc: &std::sync::OnceLock<([usize; 3], ConvWeights)>,
    relu: bool,
    device: &Device,
    compute: Option<FloatDType>,
) -> OpResult {
    match x {
        Value::Nhwc {
            data,
            dims: [b, h, w, c],
            flat: true,
            ..
        } if compute.is_none() && weight.dims()[0] == h * w * c => {
            let packed = for_image(nhwc, [h, w, c], |hwc| nhwc_rows(weight, bias.as_ref(), hwc));
            let outputs = weight.dims()[1];
            let mut out = vec![0f32; b * outputs];
            let _op =
                tracing::trace_span!("kiln.linear_nhwc", rows = b, inputs = h * w * c, outputs)
                    .entered();
            kiln_kernels::implicit::linear_rows(b, &data, &packed, relu, &mut out);
            Ok(Value::Flat(host_tensor(out, [b, outputs], device)))
        }
        x => match linear_rows(x, weight, bias, device, compute)? {
            Value::Flat(y) if relu => Ok(Value::Flat(burn::tensor::activation::relu(y))),
            Value::Seq(y) if relu => Ok(Value::Seq(burn::tensor::activation::relu(y))),
            y => Ok(y),
        },
    }
}

/// [`linear`] on anything but a flattened channels-last image.
fn linear_rows(
    x: Value,
    weight: &Tensor<2>,
    bias: &Option<Tensor<1>>,
    device: &Device,
    compute: Option<FloatDType>,
) -> OpResult {
    if value_dims(&x).len() == 3 {
        // Per token: the sequence's rows are one batch of vectors.
        check_features(&value_dims(&x), weight)?;
        let t = seq(x, device)?;
        let [b, n, d] = t.dims();
        let y = to_f32(crate::kernels::linear(
            to_compute(t.reshape([b * n, d]), compute),
            weight.clone(),
            bias.clone(),
        ));
        let out = y.dims()[1];
        Ok(Value::Seq(y.reshape([b, n, out])))
    } else {
        let rows = flat(x, device)?;
        check_features(&rows.dims(), weight)?;
        Ok(Value::Flat(to_f32(crate::kernels::linear(
            to_compute(rows, compute),
            weight.clone(),
            bias.clone(),
        ))))
    }
}

/// Inference BatchNorm: `x · scale + shift` per channel; in place on channels-last values.
fn affine(
    x: Value,
    [scale, shift]: [&Tensor<1>; 2],
    host: &(Vec<f32>, Vec<f32>),
    device: &Device,
) -> OpResult {
    let [c] = scale.dims();
    Ok(match x {
        Value::Nhwc {
            mut data,
            dims,
            flat: false,
            ..
        } if dims[3] == c => {
            let (scale, shift) = host;
            data.par_chunks_mut(c * 256).for_each(|pixels| {
                for px in pixels.chunks_exact_mut(c) {
                    for ((v, s), t) in px.iter_mut().zip(scale).zip(shift) {
                        *v = *v * s + t;
                    }
                }
            });
            Value::Nhwc {
                data,
                dims,
                flat: false,
                range: None,
            }
        }
        Value::Flat(t) => {
            Value::Flat(t * scale.clone().reshape([1, c]) + shift.clone().reshape([1, c]))
        }
        other => Value::Image(
            image(other, device)? * scale.clone().reshape([1, c, 1, 1])
                + shift.clone().reshape([1, c, 1, 1]),
        ),
    })
}

/// ReLU in place on host values, through Burn on device tensors.
fn relu(x: Value) -> Value {
    match x {
        Value::Image(t) => Value::Image(burn::tensor::activation::relu(t)),
        Value::Flat(t) => Value::Flat(burn::tensor::activation::relu(t)),
        Value::Seq(t) => Value::Seq(burn::tensor::activation::relu(t)),
        Value::Host(mut data, dims) => {
            data.par_iter_mut().for_each(|v| *v = v.max(0.0));
            Value::Host(data, dims)
        }
        Value::Nhwc {
            mut data,
            dims,
            flat,
            range,
        } => {
            data.par_iter_mut().for_each(|v| *v = v.max(0.0));
            Value::Nhwc {
                data,
                dims,
                flat,
                // ReLU maps the range's low end to 0 and keeps its high end.
                range: range.map(|(_, hi)| (0.0, hi)),
            }
        }
    }
}

/// Max pooling: channels-last on the host after int8 layers, Kiln's kernel otherwise.
fn max_pool(x: Value, pool: &MaxPool2d, device: &Device) -> OpResult {
    Ok(match x {
        Value::Nhwc {
            data,
            dims: [b, h, w, c],
            flat: false,
            range,
        } => {
            let s = PoolShape::nchw([b, 1, h, w], pool.kernel_size, pool.stride);
            let y = max_pool2d_nhwc(&s, c, &data);
            // The pooled values' max is the input's when the windows cover every input
            // pixel; their min (clamped to 0) is unchanged when the input's is 0 (ReLU
            // outputs). Otherwise the range is measured afresh.
            let covers = h >= s.kh
                && w >= s.kw
                && (h - s.kh).is_multiple_of(s.stride[0])
                && (w - s.kw).is_multiple_of(s.stride[1]);
            let range = range.filter(|(lo, _)| covers && *lo == 0.0);
            Value::Nhwc {
                data: y,
                dims: [b, s.out_h(), s.out_w(), c],
                flat: false,
                range,
            }
        }
        Value::Host(data, dims) if dims.len() == 4 => {
            let (y, out) = host_max_pool(&data, &dims, pool.kernel_size, pool.stride);
            Value::Host(y, out)
        }
        other => Value::Image(crate::kernels::max_pool2d_layer(
            pool,
            image(other, device)?,
        )),
    })
}

/// Each sample's features as `shape` (1 to 3 dims).
fn reshape(x: Value, shape: &[usize], device: &Device) -> OpResult {
    let b = value_dims(&x).first().copied().unwrap_or(1);
    let rows = flat(x, device)?;
    let features = rows.dims()[1];
    if shape.iter().product::<usize>() != features {
        return Err(format!(
            "cannot reshape {features} features per sample to {shape:?}"
        ));
    }
    Ok(match shape[..] {
        [f] => Value::Flat(rows.reshape([b, f])),
        [t, d] => Value::Seq(rows.reshape([b, t, d])),
        [c, h, w] => Value::Image(rows.reshape([b, c, h, w])),
        _ => return Err(format!("reshape to {shape:?} per sample: 1 to 3 dims only")),
    })
}

/// Layer normalization over the last dimension.
fn layer_norm(
    x: Value,
    gamma: &Tensor<1>,
    beta: &Option<Tensor<1>>,
    eps: f64,
    device: &Device,
) -> OpResult {
    use burn::tensor::module::layer_norm;
    let features = value_dims(&x).last().copied().unwrap_or(0);
    if features != gamma.dims()[0] {
        return Err(format!(
            "normalizes {} features, the value has {features}",
            gamma.dims()[0]
        ));
    }
    Ok(match x {
        Value::Flat(t) => Value::Flat(layer_norm(t, gamma.clone(), beta.clone(), eps)),
        other => Value::Seq(layer_norm(
            seq(other, device)?,
            gamma.clone(),
            beta.clone(),
            eps,
        )),
    })
}

/// Multi-head attention of `q` over the next two inputs (`k`, `v`); `[heads, head_dim]`.
fn multi_head_attention(
    q: Value,
    rest: Vec<Value>,
    [heads, head_dim]: [usize; 2],
    device: &Device,
    compute: Option<FloatDType>,
) -> OpResult {
    let mut rest = rest.into_iter();
    let (Some(k), Some(v)) = (rest.next(), rest.next()) else {
        return Err("attention needs three inputs (q, k, v)".into());
    };
    Ok(Value::Seq(attention(
        seq(q, device)?,
        seq(k, device)?,
        seq(v, device)?,
        heads,
        head_dim,
        compute,
    )?))
}

/// The mean over a sequence's tokens.
fn token_mean(x: Value, device: &Device) -> OpResult {
    let t = seq(x, device)?;
    let [b, _, d] = t.dims();
    Ok(Value::Flat(t.mean_dim(1).reshape([b, d])))
}

/// Each sample as one feature vector (a view where the layout allows).
fn flatten(x: Value) -> Value {
    match x {
        Value::Image(t) => Value::Flat(t.flatten(1, 3)),
        Value::Host(data, dims) => {
            let b = dims.first().copied().unwrap_or(1);
            let f = data.len() / b.max(1);
            Value::Host(data, vec![b, f])
        }
        flat @ Value::Flat(_) => flat,
        Value::Seq(t) => Value::Flat(t.flatten(1, 2)),
        Value::Nhwc {
            data, dims, range, ..
        } => Value::Nhwc {
            data,
            dims,
            flat: true,
            range,
        },
    }
}

/// The element-wise sum of two values (a residual connection).
fn add(x: Value, mut rest: Vec<Value>, device: &Device) -> OpResult {
    let y = rest.pop().ok_or("Add needs two inputs")?;
    Ok(match (x, y) {
        // Two channels-last results of int8 layers (a residual block): added in place on
        // the host.
        (
            Value::Nhwc {
                mut data,
                dims,
                flat,
                ..
            },
            Value::Nhwc {
                data: other,
                dims: other_dims,
                flat: other_flat,
                ..
            },
        ) if (dims, flat) == (other_dims, other_flat) => {
            data.par_iter_mut()
                .zip(other.par_iter())
                .for_each(|(a, b)| *a += b);
            Value::Nhwc {
                data,
                dims,
                flat,
                range: None,
            }
        }
        (Value::Flat(a), y) => Value::Flat(a + flat(y, device)?),
        (a, y) if value_dims(&a).len() == 3 => Value::Seq(seq(a, device)? + seq(y, device)?),
        (a, y) => Value::Image(image(a, device)? + image(y, device)?),
    })
}

/// A quantized linear layer's weights: packed as imported, the source, and (once) re-packed
/// for channels-last inputs.
struct QLinearWeights<'a> {
    weight: &'a PackedWeights,
    source: &'a QuantWeight,
    nhwc: &'a std::sync::OnceLock<([usize; 3], PackedWeights)>,
}

/// An int8 linear layer (dynamic activation quantization, ReLU in the epilogue if fused).
fn qlinear(x: Value, weights: QLinearWeights<'_>, bias: &Option<Vec<f32>>, relu: bool) -> OpResult {
    let QLinearWeights {
        weight,
        source,
        nhwc,
    } = weights;
    if let Value::Nhwc {
        data, dims, range, ..
    } = &x
    {
        let [b, h, w, c] = *dims;
        let k = h * w * c;
        if k != weight.cols {
            return Err(format!("expects {} features, got {k}", weight.cols));
        }
        let packed = for_image(nhwc, [h, w, c], |hwc| nhwc_columns(source, hwc));
        let y = quantized_matmul(data, *range, k, &packed, bias.as_deref(), relu);
        return Ok(Value::Host(y, vec![b, weight.rows]));
    }
    let (values, dims) = host(x);
    // A sequence `[B, T, D]` is B·T rows of D features; anything else is flattened per
    // sample.
    let (k, out_dims) = match dims[..] {
        [b, t, d] => (d, vec![b, t, weight.rows]),
        _ => {
            let b = dims.first().copied().unwrap_or(1);
            (values.len() / b.max(1), vec![b, weight.rows])
        }
    };
    if k != weight.cols {
        return Err(format!("expects {} features, got {k}", weight.cols));
    }
    let y = quantized_matmul(&values, None, k, weight, bias.as_deref(), relu);
    Ok(Value::Host(y, out_dims))
}

/// An int8 convolution (channels-last output, ReLU in the epilogue if fused).
fn qconv(
    x: Value,
    weight: &PackedWeights,
    bias: &Option<Vec<f32>>,
    geometry: &ConvGeometry,
    relu: bool,
) -> OpResult {
    let (values, dims, layout, range) = match x {
        Value::Nhwc {
            data,
            dims: [b, h, w, c],
            flat: false,
            range,
        } => (data, [b, c, h, w], ImageLayout::Nhwc, range),
        other => {
            let (values, dims) = host(other);
            let dims: [usize; 4] = dims
                .try_into()
                .map_err(|d| format!("expects an image, got {d:?}"))?;
            (values, dims, ImageLayout::Nchw, None)
        }
    };
    let input = ConvInput {
        values: &values,
        dims,
        layout,
        range,
    };
    quantized_conv(input, weight, bias.as_deref(), geometry, relu)
}
