//! Convolution and pooling at ranks other than 2-D: 1-D (audio, sequences) and 3-D (video,
//! volumes).
//!
//! A 1-D layer runs as the 2-D one with a height of 1, so it gets everything the 2-D path
//! has (Kiln's GEMM kernels, Burn's pooling with ceil mode). A 3-D convolution is Burn's
//! `conv3d` / `conv_transpose3d`; 3-D pooling, which Burn lacks, runs on the host over
//! flat buffers (one pass per output element, every ONNX option).

use burn::tensor::Tensor;
use burn::tensor::module::{conv_transpose3d, conv3d};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use onnx_ir::node::padding::{AutoPad, PaddingConfig1d, PaddingConfig2d, PaddingConfig3d};

use super::super::OnnxError;
use super::super::value::{Value, ValueKind};
use super::index::{Elems, Host};
use super::nn::{self, Window};

/// A 1-D window as the 2-D [`Window`] of height 1.
pub fn window_1d(
    kernel: usize,
    stride: usize,
    dilation: usize,
    padding: &PaddingConfig1d,
    auto_pad: &AutoPad,
) -> Window {
    let (left, right) = match padding {
        PaddingConfig1d::Valid => (0, 0),
        PaddingConfig1d::Explicit(l, r) => (*l, *r),
    };
    Window {
        kernel: [1, kernel],
        stride: [1, stride],
        dilation: [1, dilation],
        padding: PaddingConfig2d::Explicit(0, left, 0, right),
        auto_pad: auto_pad.clone(),
    }
}

/// `[N, C, L]` as `[N, C, 1, L]`.
fn lift(x: Value, what: &str) -> Result<Value, OnnxError> {
    let d = x.dims();
    if d.len() != 3 {
        return Err(OnnxError::Shape(format!(
            "{what} takes [N, C, L] inputs; got {d:?}"
        )));
    }
    x.reshape(&[d[0], d[1], 1, d[2]])
}

/// `[N, C, 1, L]` back to `[N, C, L]`.
fn lower(y: Value) -> Result<Value, OnnxError> {
    let d = y.dims();
    y.reshape(&[d[0], d[1], d[3]])
}

/// 1-D convolution (groups, dilation, asymmetric or `auto_pad` padding).
pub fn conv1d(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    w: &Window,
    groups: usize,
) -> Result<Value, OnnxError> {
    let y = nn::conv2d(
        lift(x, "Conv")?,
        lift(weight, "Conv weight")?,
        bias,
        w,
        groups,
    )?;
    lower(y)
}

/// 1-D transposed convolution.
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose1d(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    stride: usize,
    padding: usize,
    padding_out: usize,
    dilation: usize,
    groups: usize,
) -> Result<Value, OnnxError> {
    let y = nn::conv_transpose2d_op(
        lift(x, "ConvTranspose")?,
        lift(weight, "ConvTranspose weight")?,
        bias,
        [1, stride],
        [0, padding],
        [0, padding_out],
        [1, dilation],
        groups,
    )?;
    lower(y)
}

/// 1-D max pooling.
pub fn max_pool1d(x: Value, w: &Window, ceil_mode: bool) -> Result<Value, OnnxError> {
    lower(nn::max_pool(lift(x, "MaxPool")?, w, ceil_mode)?)
}

/// 1-D average pooling.
pub fn avg_pool1d(
    x: Value,
    w: &Window,
    ceil_mode: bool,
    count_include_pad: bool,
) -> Result<Value, OnnxError> {
    lower(nn::avg_pool(
        lift(x, "AveragePool")?,
        w,
        ceil_mode,
        count_include_pad,
    )?)
}

/// A 3-D window: kernel, stride, dilation and padding per axis.
#[derive(Debug, Clone)]
pub struct Window3d {
    /// Kernel extent per axis.
    pub kernel: [usize; 3],
    /// Stride per axis.
    pub stride: [usize; 3],
    /// Dilation per axis.
    pub dilation: [usize; 3],
    /// Explicit padding.
    pub padding: PaddingConfig3d,
    /// `auto_pad`, which overrides `padding` when set.
    pub auto_pad: AutoPad,
}

impl Window3d {
    /// `(begin, end)` padding per spatial axis for an input of `spatial` size.
    pub fn pads(&self, spatial: [usize; 3]) -> [(usize, usize); 3] {
        let mut out = [(0, 0); 3];
        match self.auto_pad {
            AutoPad::SameUpper | AutoPad::SameLower => {
                for i in 0..3 {
                    let want = spatial[i].div_ceil(self.stride[i]);
                    let span = (self.kernel[i] - 1) * self.dilation[i] + 1;
                    let total =
                        ((want.max(1) - 1) * self.stride[i] + span).saturating_sub(spatial[i]);
                    let (small, big) = (total / 2, total - total / 2);
                    out[i] = if self.auto_pad == AutoPad::SameUpper {
                        (small, big)
                    } else {
                        (big, small)
                    };
                }
            }
            AutoPad::Valid => {}
            AutoPad::NotSet => {
                if let PaddingConfig3d::Explicit(f, t, l, b, bo, r) = self.padding {
                    out = [(f, b), (t, bo), (l, r)];
                }
            }
        }
        out
    }
}

fn volume(x: Value, what: &str) -> Result<Tensor<5>, OnnxError> {
    if x.rank() != 5 {
        return Err(OnnxError::Shape(format!(
            "{what} takes [N, C, D, H, W] inputs; got {:?}",
            x.dims()
        )));
    }
    Ok(x.to_kind(ValueKind::Float)?.f::<5>())
}

fn spatial3(x: &Tensor<5>) -> [usize; 3] {
    let [_, _, d, h, w] = x.dims();
    [d, h, w]
}

fn bias_of(bias: Option<Value>) -> Result<Option<Tensor<1>>, OnnxError> {
    bias.map(|b| b.to_kind(ValueKind::Float).map(|b| b.f::<1>()))
        .transpose()
}

/// 3-D convolution.
pub fn conv3d_op(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    w: &Window3d,
    groups: usize,
) -> Result<Value, OnnxError> {
    let x = volume(x, "Conv")?;
    let weight = volume(weight, "Conv weight")?;
    let [_, c, ..] = x.dims();
    let [_, per_group, ..] = weight.dims();
    if per_group * groups != c {
        return Err(OnnxError::Shape(format!(
            "Conv weight {:?} with {groups} group(s) expects {} input channels; the input has {c}",
            weight.dims(),
            per_group * groups
        )));
    }
    let options = ConvOptions {
        stride: w.stride,
        padding: w.pads(spatial3(&x)),
        dilation: w.dilation,
        groups,
    };
    Ok(Value::float(conv3d(x, weight, bias_of(bias)?, options)))
}

/// 3-D transposed convolution.
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose3d_op(
    x: Value,
    weight: Value,
    bias: Option<Value>,
    stride: [usize; 3],
    padding: [usize; 3],
    padding_out: [usize; 3],
    dilation: [usize; 3],
    groups: usize,
) -> Result<Value, OnnxError> {
    let x = volume(x, "ConvTranspose")?;
    let weight = volume(weight, "ConvTranspose weight")?;
    let options = ConvTransposeOptions {
        stride,
        padding,
        padding_out,
        dilation,
        groups,
    };
    Ok(Value::float(conv_transpose3d(
        x,
        weight,
        bias_of(bias)?,
        options,
    )))
}

/// Output extent of a pooling axis (ONNX's formula; in ceil mode a window that would start
/// in the end padding is dropped, as PyTorch and ONNX Runtime do).
fn pooled_extent(
    input: usize,
    pads: (usize, usize),
    kernel: usize,
    stride: usize,
    dilation: usize,
    ceil: bool,
) -> usize {
    let span = dilation * (kernel - 1) + 1;
    let room = (input + pads.0 + pads.1).saturating_sub(span);
    let mut out = if ceil {
        room.div_ceil(stride) + 1
    } else {
        room / stride + 1
    };
    if ceil && (out - 1) * stride >= input + pads.0 {
        out -= 1;
    }
    out
}

/// How a pool combines its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The largest value.
    Max,
    /// The mean, with or without the padded positions counted.
    Average {
        /// Whether padding counts in the divisor.
        count_include_pad: bool,
    },
}

/// 3-D max or average pooling (pads, dilation, ceil mode) on the host.
pub fn pool3d(x: Value, w: &Window3d, ceil_mode: bool, kind: PoolKind) -> Result<Value, OnnxError> {
    let device = x.device();
    let dims = x.dims();
    if dims.len() != 5 {
        return Err(OnnxError::Shape(format!(
            "3-D pooling takes [N, C, D, H, W] inputs; got {dims:?}"
        )));
    }
    let input = [dims[2], dims[3], dims[4]];
    let pads = w.pads(input);
    let out: [usize; 3] = std::array::from_fn(|i| {
        pooled_extent(
            input[i],
            pads[i],
            w.kernel[i],
            w.stride[i],
            w.dilation[i],
            ceil_mode,
        )
    });
    let Host { elems, .. } = Host::read(&x.to_kind(ValueKind::Float)?)?;
    let Elems::F(src) = elems else {
        unreachable!("converted to float above")
    };
    let planes = dims[0] * dims[1];
    let (plane_in, plane_out) = (
        input.iter().product::<usize>(),
        out.iter().product::<usize>(),
    );
    let mut dst = vec![0f32; planes * plane_out];
    // Per axis, the in-range input positions each output position's window reads, and
    // the window's extent within the padded input (the divisor with padding counted).
    let taps: Vec<Vec<(Vec<usize>, usize)>> = (0..3)
        .map(|a| {
            (0..out[a])
                .map(|o| {
                    let start = (o * w.stride[a]) as i64 - pads[a].0 as i64;
                    let padded_end = (input[a] + pads[a].1) as i64;
                    let mut inside = Vec::new();
                    let mut counted = 0;
                    for k in 0..w.kernel[a] {
                        let p = start + (k * w.dilation[a]) as i64;
                        if p < padded_end {
                            counted += 1;
                        }
                        if p >= 0 && (p as usize) < input[a] {
                            inside.push(p as usize);
                        }
                    }
                    (inside, counted)
                })
                .collect()
        })
        .collect();
    for p in 0..planes {
        let plane = &src[p * plane_in..][..plane_in];
        let mut at = p * plane_out;
        for (td, cd) in &taps[0] {
            for (th, ch) in &taps[1] {
                for (tw, cw) in &taps[2] {
                    let mut best = f32::NEG_INFINITY;
                    let mut sum = 0f32;
                    for &d in td {
                        for &h in th {
                            let row = &plane[(d * input[1] + h) * input[2]..];
                            for &x in tw {
                                let v = row[x];
                                best = best.max(v);
                                sum += v;
                            }
                        }
                    }
                    dst[at] = match kind {
                        PoolKind::Max => best,
                        PoolKind::Average { count_include_pad } => {
                            let n = if count_include_pad {
                                cd * ch * cw
                            } else {
                                td.len() * th.len() * tw.len()
                            };
                            sum / n.max(1) as f32
                        }
                    };
                    at += 1;
                }
            }
        }
    }
    Host {
        dims: vec![dims[0], dims[1], out[0], out[1], out[2]],
        elems: Elems::F(dst),
    }
    .upload(&device)
}
