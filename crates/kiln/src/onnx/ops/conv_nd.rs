//! Convolution and pooling at ranks other than 2-D: 1-D (audio, sequences) and 3-D (video,
//! volumes).
//!
//! A 1-D layer runs as the 2-D one with a height of 1, so it gets everything the 2-D path
//! has (Kiln's GEMM kernels, Burn's pooling with ceil mode). A 3-D convolution on the CPU
//! runs as one 2-D convolution on Kiln's kernels, the depth taps each output depth reads
//! stacked as channels ([`conv3d_as_2d`]); elsewhere it is Burn's `conv3d`, and a transposed
//! one Burn's `conv_transpose3d`. 3-D pooling, which Burn lacks, runs on the host over flat
//! buffers (one pass per output element, every ONNX option).

use burn::tensor::module::{conv_transpose3d, conv3d};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use burn::tensor::{Tensor, TensorData};
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
    let bias = bias_of(bias)?;
    if crate::kernels::serves(&x.device()) {
        return conv3d_as_2d(x, weight, bias, &options).map(Value::float);
    }
    Ok(Value::float(conv3d(x, weight, bias, options)))
}

/// A 3-D convolution as one 2-D convolution over `N × D_out` images: for each output depth,
/// the `KD` input depth slices its window reads (zeros in the depth padding) are stacked as
/// channels, group by group, and the weight `[O, C/g, KD, KH, KW]` becomes `[O, KD·C/g, KH,
/// KW]` to match. Burn's `conv3d` on `flex` is a direct loop; this puts the work on Kiln's
/// GEMM kernels (BENCHMARKS.md run 62: the corpus's video models 1.5–2.5× faster), at the
/// cost of one copy of the input per depth tap.
fn conv3d_as_2d(
    x: Tensor<5>,
    weight: Tensor<5>,
    bias: Option<Tensor<1>>,
    options: &ConvOptions<3>,
) -> Result<Tensor<5>, OnnxError> {
    let device = x.device();
    let [n, c, d, h, w] = x.dims();
    let [o, cg, kd, kh, kw] = weight.dims();
    let g = options.groups.max(1);
    let (sd, dd, (pd, pd_end)) = (
        options.stride[0].max(1),
        options.dilation[0].max(1),
        options.padding[0],
    );
    let span = dd * (kd - 1) + 1;
    let Some(room) = (d + pd + pd_end).checked_sub(span) else {
        return Err(OnnxError::Shape(format!(
            "Conv's depth window of {span} is larger than the padded depth {}",
            d + pd + pd_end
        )));
    };
    let d_out = room / sd + 1;
    let read = |t: TensorData| -> Result<Vec<f32>, OnnxError> {
        t.convert::<f32>()
            .try_into_vec()
            .map_err(|e| OnnxError::Shape(format!("reading a tensor to the host: {e:?}")))
    };
    let src = read(x.into_data())?;
    let plane = h * w;
    // Stacked input: [N, D_out, g, KD, C/g, H, W]; a tap in the depth padding stays zero.
    let mut stacked = vec![0f32; n * d_out * g * kd * cg * plane];
    let mut at = 0;
    for b in 0..n {
        for od in 0..d_out {
            for j in 0..g {
                for i in 0..kd {
                    let id = (od * sd + i * dd).checked_sub(pd).filter(|&id| id < d);
                    for ci in 0..cg {
                        if let Some(id) = id {
                            let from = ((b * c + j * cg + ci) * d + id) * plane;
                            stacked[at..at + plane].copy_from_slice(&src[from..from + plane]);
                        }
                        at += plane;
                    }
                }
            }
        }
    }
    // Weight: [O, C/g, KD, KH, KW] → [O, KD, C/g, KH, KW].
    let taps = weight.swap_dims(1, 2).reshape([o, kd * cg, kh, kw]);
    let images = Tensor::<4>::from_data(
        TensorData::new(stacked, [n * d_out, g * kd * cg, h, w]),
        &device,
    );
    let y = crate::kernels::conv2d(
        images,
        taps,
        bias,
        ConvOptions {
            stride: [options.stride[1], options.stride[2]],
            padding: [options.padding[1], options.padding[2]],
            dilation: [options.dilation[1], options.dilation[2]],
            groups: g,
        },
    );
    let [_, _, ho, wo] = y.dims();
    Ok(y.reshape([n, d_out, o, ho * wo])
        .swap_dims(1, 2)
        .reshape([n, o, d_out, ho, wo]))
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

/// 3-D max or average pooling (pads, dilation, ceil mode): a window one frame deep as the
/// 2-D pool over every frame, any other on the host.
pub fn pool3d(x: Value, w: &Window3d, ceil_mode: bool, kind: PoolKind) -> Result<Value, OnnxError> {
    let dims = x.dims();
    if dims.len() == 5 {
        let pads = w.pads([dims[2], dims[3], dims[4]]);
        // The 2-D average pool takes neither dilation nor ONNX's ceil mode (load rewrites
        // the 2-D ones); those stay on the host.
        let plain_average = !ceil_mode && w.dilation[1..] == [1, 1];
        let one_frame = w.kernel[0] == 1 && w.stride[0] == 1 && pads[0] == (0, 0);
        if one_frame && (kind == PoolKind::Max || plain_average) {
            // A window one frame deep (R(2+1)D's and I3D's spatial pools): the 2-D pool over
            // every frame at once, on the 2-D path's kernels.
            let [n, c, d, h, wd] = [dims[0], dims[1], dims[2], dims[3], dims[4]];
            let frames = Window {
                kernel: [w.kernel[1], w.kernel[2]],
                stride: [w.stride[1], w.stride[2]],
                dilation: [w.dilation[1], w.dilation[2]],
                padding: PaddingConfig2d::Explicit(pads[1].0, pads[2].0, pads[1].1, pads[2].1),
                auto_pad: AutoPad::NotSet,
            };
            let planes = x.reshape(&[n, c * d, h, wd])?;
            let y = match kind {
                PoolKind::Max => nn::max_pool(planes, &frames, ceil_mode)?,
                PoolKind::Average { count_include_pad } => {
                    nn::avg_pool(planes, &frames, ceil_mode, count_include_pad)?
                }
            };
            let yd = y.dims();
            return y.reshape(&[n, c, d, yd[2], yd[3]]);
        }
    }
    pool3d_on_host(x, w, ceil_mode, kind)
}

/// 3-D max or average pooling (pads, dilation, ceil mode) on the host, one pass per output
/// element.
fn pool3d_on_host(
    x: Value,
    w: &Window3d,
    ceil_mode: bool,
    kind: PoolKind,
) -> Result<Value, OnnxError> {
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

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor};
    use onnx_ir::node::padding::{AutoPad, PaddingConfig3d};

    use super::*;

    fn close(a: &Tensor<5>, b: &Tensor<5>) -> f32 {
        let a: Vec<f32> = a.to_data().try_to_vec::<f32>().unwrap();
        let b: Vec<f32> = b.to_data().try_to_vec::<f32>().unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    }

    /// A direct 3-D convolution in f64: the reference (Burn's `conv3d` refuses asymmetric
    /// padding).
    fn reference(x: &Tensor<5>, w: &Tensor<5>, b: &Tensor<1>, o: &ConvOptions<3>) -> Vec<f32> {
        let xv: Vec<f32> = x.to_data().try_to_vec::<f32>().unwrap();
        let wv: Vec<f32> = w.to_data().try_to_vec::<f32>().unwrap();
        let bv: Vec<f32> = b.to_data().try_to_vec::<f32>().unwrap();
        let [n, c, d, h, wd] = x.dims();
        let [oc, cg, kd, kh, kw] = w.dims();
        let ins = [d, h, wd];
        let k = [kd, kh, kw];
        let out: [usize; 3] = std::array::from_fn(|a| {
            (ins[a] + o.padding[a].0 + o.padding[a].1 - o.dilation[a] * (k[a] - 1) - 1)
                / o.stride[a]
                + 1
        });
        let per_group_out = oc / o.groups;
        let mut y = Vec::new();
        for b_ in 0..n {
            for (f, &bias) in bv.iter().enumerate().take(oc) {
                let g = f / per_group_out;
                for od in 0..out[0] {
                    for oh in 0..out[1] {
                        for ow in 0..out[2] {
                            let mut acc = f64::from(bias);
                            for ci in 0..cg {
                                for (i, j, l) in (0..kd).flat_map(|i| {
                                    (0..kh).flat_map(move |j| (0..kw).map(move |l| (i, j, l)))
                                }) {
                                    let at = |a: usize, pos: usize, tap: usize| {
                                        (pos * o.stride[a] + tap * o.dilation[a])
                                            .checked_sub(o.padding[a].0)
                                            .filter(|&p| p < ins[a])
                                    };
                                    let (Some(zd), Some(zh), Some(zw)) =
                                        (at(0, od, i), at(1, oh, j), at(2, ow, l))
                                    else {
                                        continue;
                                    };
                                    let xi = (((b_ * c + g * cg + ci) * d + zd) * h + zh) * wd + zw;
                                    let wi = (((f * cg + ci) * kd + i) * kh + j) * kw + l;
                                    acc += f64::from(xv[xi]) * f64::from(wv[wi]);
                                }
                            }
                            y.push(acc as f32);
                        }
                    }
                }
            }
        }
        y
    }

    /// The depth-stacked 2-D convolution matches a direct one over groups, strides,
    /// dilations and asymmetric padding on every axis, a depth window in the padding among
    /// them.
    #[test]
    fn conv3d_as_2d_matches_a_direct_convolution() {
        let device = Device::default();
        // (input [N, C, D, H, W], out channels, kernel, groups, stride, dilation, pads)
        type Case = (
            [usize; 5],
            usize,
            [usize; 3],
            usize,
            [usize; 3],
            [usize; 3],
            [(usize, usize); 3],
        );
        let cases: [Case; 4] = [
            (
                [2, 3, 4, 9, 9],
                8,
                [3, 3, 3],
                1,
                [1, 1, 1],
                [1, 1, 1],
                [(1, 1); 3],
            ),
            (
                [1, 4, 7, 8, 6],
                6,
                [3, 1, 1],
                2,
                [2, 1, 1],
                [2, 1, 1],
                [(2, 1), (0, 0), (0, 0)],
            ),
            (
                [2, 8, 5, 7, 7],
                4,
                [1, 3, 3],
                1,
                [1, 2, 2],
                [1, 1, 2],
                [(0, 0), (1, 0), (2, 1)],
            ),
            (
                [1, 2, 3, 5, 5],
                2,
                [2, 2, 2],
                2,
                [1, 1, 1],
                [1, 1, 1],
                [(0, 1), (1, 1), (0, 0)],
            ),
        ];
        for (input, out, kernel, groups, stride, dilation, padding) in cases {
            let x = Tensor::<5>::random(input, Distribution::Normal(0.0, 1.0), &device);
            let w = Tensor::<5>::random(
                [out, input[1] / groups, kernel[0], kernel[1], kernel[2]],
                Distribution::Normal(0.0, 1.0),
                &device,
            );
            let b = Tensor::<1>::random([out], Distribution::Normal(0.0, 1.0), &device);
            let options = ConvOptions {
                stride,
                padding,
                dilation,
                groups,
            };
            let want = reference(&x, &w, &b, &options);
            let got: Vec<f32> = conv3d_as_2d(x, w, Some(b), &options)
                .unwrap()
                .to_data()
                .try_to_vec::<f32>()
                .unwrap();
            assert_eq!(got.len(), want.len(), "{input:?} {kernel:?}");
            let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            assert!(err < 1e-5, "{input:?} {kernel:?}: {err:e}");
        }
    }

    /// A pool one frame deep on the 2-D path gives what the host loop gives.
    #[test]
    fn pools_one_frame_deep_match_the_host_loop() {
        let device = Device::default();
        let x = Tensor::<5>::random([2, 3, 4, 9, 8], Distribution::Normal(0.0, 1.0), &device);
        for (kind, ceil_mode, pads) in [
            (PoolKind::Max, false, (0, 0)),
            (PoolKind::Max, true, (1, 1)),
            (
                PoolKind::Average {
                    count_include_pad: false,
                },
                false,
                (1, 0),
            ),
            (
                PoolKind::Average {
                    count_include_pad: true,
                },
                false,
                (1, 1),
            ),
        ] {
            let w = Window3d {
                kernel: [1, 3, 3],
                stride: [1, 2, 2],
                dilation: [1, 1, 1],
                padding: PaddingConfig3d::Explicit(0, pads.0, pads.0, 0, pads.1, pads.1),
                auto_pad: AutoPad::NotSet,
            };
            let fast = pool3d(Value::float(x.clone()), &w, ceil_mode, kind).unwrap();
            let host = pool3d_on_host(Value::float(x.clone()), &w, ceil_mode, kind).unwrap();
            assert_eq!(fast.dims(), host.dims(), "{kind:?} {ceil_mode}");
            let err = close(&fast.f::<5>(), &host.f::<5>());
            assert!(err < 1e-6, "{kind:?} {ceil_mode}: {err:e}");
        }
    }
}
