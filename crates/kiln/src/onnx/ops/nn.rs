//! Network operators: convolutions, pooling, normalization, matrix products, resizing,
//! attention and reductions. Convolutions and linear layers go through [`crate::kernels`]
//! (Kiln's GEMM kernels on the CPU, Burn's elsewhere).

use burn::tensor::module::{
    adaptive_avg_pool2d, avg_pool2d, conv_transpose2d, interpolate, max_pool2d,
};
use burn::tensor::ops::{
    AvgPoolOptions, ConvOptions, ConvTransposeOptions, InterpolateMode, InterpolateOptions,
    MaxPoolOptions,
};
use burn::tensor::{Tensor, activation};
use onnx_ir::node::padding::{AutoPad, PaddingConfig2d};

use super::super::OnnxError;
use super::super::value::{Value, ValueKind, with_rank};
use crate::kernels;

/// Spatial geometry shared by convolution and pooling.
#[derive(Debug, Clone)]
pub struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    pub padding: PaddingConfig2d,
    pub auto_pad: AutoPad,
}

impl Window {
    /// `(begin, end)` padding per spatial axis for an input of `spatial` size.
    pub fn pads(&self, spatial: [usize; 2]) -> [(usize, usize); 2] {
        match self.auto_pad {
            AutoPad::SameUpper | AutoPad::SameLower => {
                let mut out = [(0, 0); 2];
                for i in 0..2 {
                    let want = spatial[i].div_ceil(self.stride[i]);
                    let span = (self.kernel[i] - 1) * self.dilation[i] + 1;
                    let total = ((want - 1) * self.stride[i] + span).saturating_sub(spatial[i]);
                    let (small, big) = (total / 2, total - total / 2);
                    out[i] = if self.auto_pad == AutoPad::SameUpper {
                        (small, big)
                    } else {
                        (big, small)
                    };
                }
                out
            }
            AutoPad::Valid => [(0, 0); 2],
            AutoPad::NotSet => match self.padding {
                PaddingConfig2d::Valid => [(0, 0); 2],
                PaddingConfig2d::Explicit(top, left, bottom, right) => {
                    [(top, bottom), (left, right)]
                }
            },
        }
    }
}

fn image(x: Value, what: &str) -> Result<Tensor<4>, OnnxError> {
    if x.rank() != 4 {
        return Err(OnnxError::Shape(format!(
            "{what} takes [N, C, H, W] inputs; got {:?}",
            x.dims()
        )));
    }
    Ok(x.to_kind(ValueKind::Float)?.f::<4>())
}

fn spatial(x: &Tensor<4>) -> [usize; 2] {
    let [_, _, h, w] = x.dims();
    [h, w]
}

/// 2-D convolution with groups, dilation, asymmetric or `auto_pad` padding.
pub fn conv2d(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    w: &Window,
    groups: usize,
) -> Result<Value, OnnxError> {
    let x = image(x, "Conv")?;
    let weight = image(weight, "Conv weight")?;
    let [_, c, _, _] = x.dims();
    let [_, per_group, _, _] = weight.dims();
    if per_group * groups != c {
        return Err(OnnxError::Shape(format!(
            "Conv weight {:?} with {groups} group(s) expects {} input channels; the input has {c}",
            weight.dims(),
            per_group * groups
        )));
    }
    let bias = bias
        .map(|b| b.to_kind(ValueKind::Float).map(|b| b.f::<1>()))
        .transpose()?;
    let pads = w.pads(spatial(&x));
    let options = ConvOptions {
        stride: w.stride,
        padding: pads,
        dilation: w.dilation,
        groups,
    };
    Ok(Value::float(kernels::conv2d(x, weight, bias, options)))
}

/// 2-D transposed convolution.
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose2d_op(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    stride: [usize; 2],
    padding: [usize; 2],
    padding_out: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Result<Value, OnnxError> {
    let x = image(x, "ConvTranspose")?;
    let weight = image(weight, "ConvTranspose weight")?;
    let bias = bias
        .map(|b| b.to_kind(ValueKind::Float).map(|b| b.f::<1>()))
        .transpose()?;
    let options = ConvTransposeOptions {
        stride,
        padding,
        padding_out,
        dilation,
        groups,
    };
    Ok(Value::float(conv_transpose2d(x, weight, bias, options)))
}

/// Max pooling (pads, dilation, ceil mode); the plain case through Kiln's kernel.
pub fn max_pool(x: Value, w: &Window, ceil_mode: bool) -> Result<Value, OnnxError> {
    let x = image(x, "MaxPool")?;
    let pads = w.pads(spatial(&x));
    if pads == [(0, 0); 2] && w.dilation == [1, 1] && !ceil_mode {
        return Ok(Value::float(kernels::max_pool2d(x, w.kernel, w.stride)));
    }
    let options = MaxPoolOptions {
        kernel_size: w.kernel,
        stride: w.stride,
        padding: pads,
        dilation: w.dilation,
        ceil_mode,
    };
    Ok(Value::float(max_pool2d(x, options)))
}

/// Whether `node`'s window is 2×2 with stride 2, no dilation and no padding: the pool a
/// convolution with a ReLU takes into its store at load.
pub fn is_plain_2x2(node: &onnx_ir::Node) -> bool {
    let Ok(w) = super::node_window(node) else {
        return false;
    };
    w.kernel == [2, 2]
        && w.stride == [2, 2]
        && w.dilation == [1, 1]
        && !matches!(w.auto_pad, AutoPad::SameUpper | AutoPad::SameLower)
        && w.pads([64, 64]) == [(0, 0); 2]
}

/// The 2×2, stride-2 max pool fused into a convolution at load ([`is_plain_2x2`]), on
/// values (where the step did not run on the host's kernels).
pub fn max_pool_2x2(x: Value) -> Result<Value, OnnxError> {
    let x = image(x, "MaxPool")?;
    Ok(Value::float(kernels::max_pool2d(x, [2, 2], [2, 2])))
}

/// Average pooling (pads, ceil mode, with or without the padding counted).
pub fn avg_pool(
    x: Value,
    w: &Window,
    ceil_mode: bool,
    count_include_pad: bool,
) -> Result<Value, OnnxError> {
    let x = image(x, "AveragePool")?;
    if w.dilation != [1, 1] {
        return Err(OnnxError::Unsupported("AveragePool with dilation".into()));
    }
    let options = AvgPoolOptions {
        kernel_size: w.kernel,
        stride: w.stride,
        padding: w.pads(spatial(&x)),
        count_include_pad,
        ceil_mode,
    };
    Ok(Value::float(avg_pool2d(x, options)))
}

/// `GlobalAveragePool` / `GlobalMaxPool` over every axis after the second.
pub fn global_pool(x: Value, max: bool) -> Result<Value, OnnxError> {
    let x = x.to_kind(ValueKind::Float)?;
    if x.rank() == 4 && !max {
        return Ok(Value::float(adaptive_avg_pool2d(x.f::<4>(), [1, 1])));
    }
    let rank = x.rank();
    if rank < 3 {
        return Err(OnnxError::Shape(format!(
            "global pooling takes [N, C, ...] inputs; got {:?}",
            x.dims()
        )));
    }
    let spatial: Vec<usize> = (2..rank).collect();
    Ok(with_rank!(rank, D => {
        let t = spatial.iter().fold(x.f::<D>(), |t, &d| if max { t.max_dim(d) } else { t.mean_dim(d) });
        Value::float(t)
    }))
}

/// Inference BatchNormalization over axis 1.
pub fn batch_norm(
    x: Value,
    scale: Value,
    bias: Value,
    mean: Value,
    var: Value,
    epsilon: f64,
) -> Result<Value, OnnxError> {
    let rank = x.rank();
    let c = x.dims().get(1).copied().unwrap_or(1);
    let mut bdims = vec![1; rank];
    if rank > 1 {
        bdims[1] = c;
    }
    let f = |v: Value| -> Result<Value, OnnxError> { v.to_kind(ValueKind::Float)?.reshape(&bdims) };
    let (scale, bias, mean, var) = (f(scale)?, f(bias)?, f(mean)?, f(var)?);
    let x = x.to_kind(ValueKind::Float)?;
    Ok(with_rank!(rank, D => {
        let a = scale.f::<D>() / (var.f::<D>() + epsilon).sqrt();
        let b = bias.f::<D>() - mean.f::<D>() * a.clone();
        Value::float(x.f::<D>() * a + b)
    }))
}

/// LayerNormalization over the axes from `axis` on.
pub fn layer_norm(
    x: Value,
    gamma: Value,
    beta: Option<Value>,
    axis: i64,
    epsilon: f64,
) -> Result<Value, OnnxError> {
    let dims = x.dims();
    let axis = super::shape::axis_index(axis, dims.len())?;
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis..].iter().product();
    let x2 = x
        .to_kind(ValueKind::Float)?
        .reshape(&[outer, inner])?
        .f::<2>();
    let mean = x2.clone().mean_dim(1);
    let centered = x2 - mean;
    let var = centered.clone().powf_scalar(2.0).mean_dim(1);
    let normed = centered / (var + epsilon).sqrt();
    let gamma = gamma
        .to_kind(ValueKind::Float)?
        .reshape(&[1, inner])?
        .f::<2>();
    let mut y = normed * gamma;
    if let Some(beta) = beta {
        y = y + beta
            .to_kind(ValueKind::Float)?
            .reshape(&[1, inner])?
            .f::<2>();
    }
    Value::float(y).reshape(&dims)
}

/// ONNX `MatMul` (numpy semantics: 1-D operands promoted, batch dimensions broadcast).
pub fn matmul(a: Value, b: Value) -> Result<Value, OnnxError> {
    let (a, b) = (a.to_kind(ValueKind::Float)?, b.to_kind(ValueKind::Float)?);
    let (a_vec, b_vec) = (a.rank() == 1, b.rank() == 1);
    let a = if a_vec { a.lift_to_rank(2)? } else { a };
    let b = if b_vec {
        let n = b.len();
        b.reshape(&[n, 1])?
    } else {
        b
    };
    // A constant-free 2-D right operand on a higher-rank left one is a linear layer: one
    // GEMM over the flattened rows instead of a broadcast batched product.
    let rank = a.rank().max(b.rank());
    let out = if b.rank() == 2 && a.rank() >= 2 {
        let w = b.f::<2>();
        with_rank!(a.rank(), D => Value::float(kernels::linear(a.f::<D>(), w, None)))
    } else {
        let (a, b) = (a.lift_to_rank(rank)?, b.lift_to_rank(rank)?);
        with_rank!(rank, D => Value::float(a.f::<D>().matmul(b.f::<D>())))
    };
    let mut dims = out.dims();
    if b_vec {
        dims.pop();
    }
    if a_vec {
        let last = dims.pop();
        dims.pop();
        dims.extend(last);
    }
    out.reshape(&dims)
}

/// A linear layer `x · weight + bias` with `weight` `[in, out]`.
pub fn linear(x: Value, weight: Value, bias: Option<Value>) -> Result<Value, OnnxError> {
    let x = x.to_kind(ValueKind::Float)?;
    let weight = weight.to_kind(ValueKind::Float)?;
    if weight.rank() != 2 || x.dims().last() != weight.dims().first() {
        return Err(OnnxError::Shape(format!(
            "linear layer: input {:?} does not fit weight {:?}",
            x.dims(),
            weight.dims()
        )));
    }
    let bias = bias
        .map(|b| b.to_kind(ValueKind::Float).map(|b| b.f::<1>()))
        .transpose()?;
    let w = weight.f::<2>();
    Ok(with_rank!(x.rank(), D => Value::float(kernels::linear(x.f::<D>(), w, bias))))
}

/// `Gemm`: `alpha · A' · B' + beta · C`, with `'` the optional transposes.
pub fn gemm(
    a: Value,
    b: Value,
    c: Option<Value>,
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
) -> Result<Value, OnnxError> {
    let a = a.to_kind(ValueKind::Float)?.f::<2>();
    let b = b.to_kind(ValueKind::Float)?.f::<2>();
    let a = if trans_a { a.transpose() } else { a };
    let b = if trans_b { b.transpose() } else { b };
    let mut y = kernels::linear(a, b, None);
    if alpha != 1.0 {
        y = y * alpha;
    }
    let y = Value::float(y);
    match c {
        Some(c) if beta != 0.0 => {
            let c = if beta == 1.0 {
                c
            } else {
                super::math::binary(
                    super::math::Binary::Mul,
                    c,
                    Value::float(Tensor::<1>::from_floats([beta], &y.device())),
                )?
            };
            super::math::binary(super::math::Binary::Add, y, c)
        }
        _ => Ok(y),
    }
}

/// How `Resize` maps output pixels to input pixels, reduced to Burn's interpolation modes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResizeKind {
    /// PyTorch's `nearest` (asymmetric coordinates, floor).
    Nearest,
    /// `nearest-exact` (half-pixel coordinates, round half up).
    NearestExact,
    /// Bilinear; `true` = corners aligned.
    Bilinear(bool),
    /// Bicubic (a = -0.75); `true` = corners aligned.
    Bicubic(bool),
}

/// `Resize` of the two spatial axes of `[N, C, H, W]` to `size`.
pub fn resize(x: Value, size: [usize; 2], kind: ResizeKind) -> Result<Value, OnnxError> {
    let x = image(x, "Resize")?;
    if spatial(&x) == size {
        return Ok(Value::float(x));
    }
    let (mode, align) = match kind {
        ResizeKind::Nearest => (InterpolateMode::Nearest, false),
        ResizeKind::NearestExact => (InterpolateMode::NearestExact, false),
        ResizeKind::Bilinear(a) => (InterpolateMode::Bilinear, a),
        ResizeKind::Bicubic(a) => (InterpolateMode::Bicubic, a),
    };
    let mut options = InterpolateOptions::new(mode);
    options.align_corners = align;
    options.output_size = Some(size);
    Ok(Value::float(interpolate(x, options)))
}

/// Scaled dot-product attention over `[B, H, S, D]` queries, keys and values, with an
/// optional additive (float) or keep (bool) mask and a causal mask.
pub fn attention(
    q: Value,
    k: Value,
    v: Value,
    mask: Option<Value>,
    scale: Option<f64>,
    causal: bool,
) -> Result<Value, OnnxError> {
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(OnnxError::Unsupported(
            "Attention on inputs other than [batch, heads, seq, dim]".into(),
        ));
    }
    let q = q.to_kind(ValueKind::Float)?.f::<4>();
    let k = k.to_kind(ValueKind::Float)?.f::<4>();
    let v = v.to_kind(ValueKind::Float)?.f::<4>();
    let [_, _, sq, d] = q.dims();
    let sk = k.dims()[2];
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt()) as f32;
    let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
    if let Some(mask) = mask {
        let mask = mask.lift_to_rank(4)?;
        scores = match mask.kind() {
            ValueKind::Bool => {
                let keep = super::shape::expand_to(mask, &scores.dims())?.b::<4>();
                scores.mask_fill(keep.bool_not(), f32::NEG_INFINITY)
            }
            _ => {
                let add = super::shape::expand_to(mask.to_kind(ValueKind::Float)?, &scores.dims())?;
                scores + add.f::<4>()
            }
        };
    }
    if causal {
        let device = scores.device();
        let rows = Tensor::<1, burn::tensor::Int>::arange(0..sq as i64, &device).reshape([sq, 1]);
        let cols = Tensor::<1, burn::tensor::Int>::arange(0..sk as i64, &device).reshape([1, sk]);
        let future = cols.greater(rows.add_scalar((sk as i64) - (sq as i64)));
        let future = future.reshape([1, 1, sq, sk]).expand(scores.dims());
        scores = scores.mask_fill(future, f32::NEG_INFINITY);
    }
    Ok(Value::float(activation::softmax(scores, 3).matmul(v)))
}

/// A reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    SumSquare,
    L2,
}

/// Reduces `x` over `axes` (every axis when empty, unless `noop_empty`).
pub fn reduce(
    op: Reduce,
    x: Value,
    axes: &[usize],
    keepdims: bool,
    noop_empty: bool,
) -> Result<Value, OnnxError> {
    if axes.is_empty() && noop_empty {
        return Ok(x);
    }
    let dims = x.onnx_dims();
    let axes: Vec<usize> = if axes.is_empty() {
        (0..dims.len()).collect()
    } else {
        axes.to_vec()
    };
    let kind = if x.kind() == ValueKind::Bool {
        ValueKind::Int
    } else {
        x.kind()
    };
    let x = x.to_kind(kind)?;
    let rank = x.rank();
    let reduced = with_rank!(rank, D => match kind {
        ValueKind::Float => {
            let mut t = x.f::<D>();
            if matches!(op, Reduce::SumSquare | Reduce::L2) {
                t = t.clone() * t;
            }
            for &a in &axes {
                t = match op {
                    Reduce::Sum | Reduce::SumSquare | Reduce::L2 => t.sum_dim(a),
                    Reduce::Mean => t.mean_dim(a),
                    Reduce::Max => t.max_dim(a),
                    Reduce::Min => t.min_dim(a),
                    Reduce::Prod => t.prod_dim(a),
                };
            }
            if op == Reduce::L2 { t = t.sqrt(); }
            Value::float(t)
        }
        _ => {
            let mut t = x.i::<D>();
            if matches!(op, Reduce::SumSquare | Reduce::L2) {
                t = t.clone() * t;
            }
            for &a in &axes {
                t = match op {
                    Reduce::Sum | Reduce::SumSquare | Reduce::L2 => t.sum_dim(a),
                    // Integer mean truncates, as ONNX Runtime's does.
                    Reduce::Mean => t.clone().sum_dim(a).div_scalar(dims.get(a).copied().unwrap_or(1) as i64),
                    Reduce::Max => t.max_dim(a),
                    Reduce::Min => t.min_dim(a),
                    Reduce::Prod => t.prod_dim(a),
                };
            }
            Value::int(t)
        }
    });
    if keepdims {
        return Ok(reduced);
    }
    let out: Vec<usize> = (0..dims.len())
        .filter(|i| !axes.contains(i))
        .map(|i| dims[i])
        .collect();
    reduced.reshape(&out)
}

/// `ArgMax` / `ArgMin` along `axis`.
pub fn arg_extreme(x: Value, axis: usize, keepdims: bool, max: bool) -> Result<Value, OnnxError> {
    let dims = x.onnx_dims();
    let x = x.to_kind(ValueKind::Float)?;
    let idx = with_rank!(x.rank(), D => {
        let t = x.f::<D>();
        Value::int(if max { t.argmax(axis) } else { t.argmin(axis) })
    });
    if keepdims {
        return Ok(idx);
    }
    let out: Vec<usize> = dims
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != axis)
        .map(|(_, &d)| d)
        .collect();
    idx.reshape(&out)
}
