//! The executor's host paths: operations whose operands are read back to the host and run
//! on Kiln's slice kernels (channels-last convolutions, max pooling, the int8 GEMM and
//! convolution), with the layout arithmetic between NCHW tensors and channels-last rows.

use super::*;

/// The value on the host with its dims.
pub(super) fn host(v: Value) -> (Vec<f32>, Vec<usize>) {
    match v {
        Value::Host(data, dims) => (data, dims),
        Value::Image(t) => {
            let dims = t.dims().to_vec();
            (host_values(t), dims)
        }
        Value::Flat(t) => {
            let dims = t.dims().to_vec();
            (host_values(t), dims)
        }
        Value::Seq(t) => {
            let dims = t.dims().to_vec();
            (host_values(t), dims)
        }
        Value::Nhwc {
            data, dims, flat, ..
        } => {
            let [b, h, w, c] = dims;
            let nchw = nhwc_to_nchw(&data, dims);
            if flat {
                (nchw, vec![b, c * h * w])
            } else {
                (nchw, vec![b, c, h, w])
            }
        }
    }
}

/// Max pooling without padding on host values `[B, C, H, W]` (Kiln's pooling kernel).
pub(super) fn host_max_pool(
    x: &[f32],
    dims: &[usize],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> (Vec<f32>, Vec<usize>) {
    let s = PoolShape::nchw([dims[0], dims[1], dims[2], dims[3]], kernel, stride);
    let mut y = vec![0f32; s.planes * s.out_h() * s.out_w()];
    max_pool2d_forward(&s, x, &mut y, None);
    (y, vec![dims[0], dims[1], s.out_h(), s.out_w()])
}

/// `x [m × k] → [m × n]`: quantize x per batch (over `range` when known), integer matmul,
/// dequantize, add the bias.
pub(super) fn quantized_matmul(
    x: &[f32],
    range: Option<(f32, f32)>,
    k: usize,
    weight: &PackedWeights,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    let quant = ActivationQuant::for_range(range.unwrap_or_else(|| range_of(x)));
    let a = QuantizedActivations::new(x, k, quant, weight.kernel());
    matmul_dequantized(
        &a,
        weight,
        bias,
        relu.then_some(kiln_kernels::activation::Activation::Relu),
    )
    .0
}

/// For each position of a flattened channels-last `[h, w, c]` image, the position the same
/// value has in the model's NCHW-flatten order (channel, y, x): the order a weight written
/// for NCHW inputs needs to read channels-last ones.
pub(super) fn channels_last_order([h, w, c]: [usize; 3]) -> impl Iterator<Item = usize> {
    let plane = h * w;
    (0..plane).flat_map(move |p| (0..c).map(move |ch| ch * plane + p))
}

/// A linear weight `[C·H·W, out]` (rows in NCHW-flatten order) with its rows reordered to
/// channels-last `(h, w, c)` order, packed for Kiln's host kernel with its bias.
pub(super) fn nhwc_rows(
    weight: &Tensor<2>,
    bias: Option<&Tensor<1>>,
    hwc: [usize; 3],
) -> ConvWeights {
    let [inputs, outputs] = weight.dims();
    let values = host_values(weight.clone());
    let mut rows = Vec::with_capacity(values.len());
    for from in channels_last_order(hwc) {
        rows.extend_from_slice(&values[from * outputs..][..outputs]);
    }
    let bias = bias.map(|b| host_values(b.clone()));
    ConvWeights::linear(inputs, outputs, &rows, bias.as_deref())
}

/// The int8 linear weights with their columns reordered from the model's flatten order
/// (channel, y, x) to channels-last (y, x, channel) for an input of `[h, w, c]` images.
pub(super) fn nhwc_columns(w: &QuantWeight, hwc: [usize; 3]) -> PackedWeights {
    let order: Vec<usize> = channels_last_order(hwc).collect();
    let mut values = vec![0i8; w.values.len()];
    for (src, dst) in w
        .values
        .chunks_exact(w.cols)
        .zip(values.chunks_exact_mut(w.cols))
    {
        for (d, &from) in dst.iter_mut().zip(&order) {
            *d = src[from];
        }
    }
    let reordered = QuantWeight {
        values,
        ..w.clone()
    };
    PackedWeights::new(&reordered, Int8Kernel::detect())
}

/// The weights `cell` holds for channels-last inputs of `[h, w, c]` images, made by `make` on
/// first use. A different image size than the first call's cannot happen for a model with a
/// fixed input; the weights are made afresh for it rather than misread.
pub(super) fn for_image<'a, T: Clone>(
    cell: &'a std::sync::OnceLock<([usize; 3], T)>,
    hwc: [usize; 3],
    make: impl Fn([usize; 3]) -> T,
) -> std::borrow::Cow<'a, T> {
    let (made_for, made) = cell.get_or_init(|| (hwc, make(hwc)));
    if *made_for == hwc {
        std::borrow::Cow::Borrowed(made)
    } else {
        std::borrow::Cow::Owned(make(hwc))
    }
}

/// An int8 convolution's input: `[B, C, H, W]` images stored in `layout`, with their range
/// when known.
pub(super) struct ConvInput<'a> {
    pub(super) values: &'a [f32],
    pub(super) dims: [usize; 4],
    pub(super) layout: ImageLayout,
    pub(super) range: Option<(f32, f32)>,
}

/// Int8 convolution as an implicit GEMM: the input (`[B, C, H, W]` images stored in `layout`)
/// is quantized once into a padded NHWC u8 image and the kernel reads each output pixel's taps
/// from it in place (no patch matrix); the result is dequantized straight into a channels-last
/// [`Value::Nhwc`] `[B, H', W', C']` (the GEMM's own row order) with its measured range.
pub(super) fn quantized_conv(
    x: ConvInput,
    weight: &PackedWeights,
    bias: Option<&[f32]>,
    g: &ConvGeometry,
    relu: bool,
) -> std::result::Result<Value, String> {
    let dims = x.dims;
    if g.groups != 1 {
        return Err("grouped int8 convolution is not supported".into());
    }
    let [b, _, h, w] = dims;
    let [kh, kw] = g.kernel;
    let [top, left, bottom, right] = g.pads;
    if h + top + bottom < g.dilation[0] * (kh - 1) + 1
        || w + left + right < g.dilation[1] * (kw - 1) + 1
    {
        return Err(format!("input {h}×{w} is smaller than the kernel"));
    }
    let quant = ActivationQuant::for_range(x.range.unwrap_or_else(|| range_of(x.values)));
    let (a, ho, wo) =
        QuantizedActivations::for_conv(x.values, dims, x.layout, g, quant, weight.kernel());
    if a.cols != weight.cols {
        return Err(format!(
            "input has {} channels per tap group, the weights {}",
            a.cols, weight.cols
        ));
    }
    let (data, range) = matmul_dequantized(
        &a,
        weight,
        bias,
        relu.then_some(kiln_kernels::activation::Activation::Relu),
    );
    Ok(Value::Nhwc {
        data,
        dims: [b, ho, wo, weight.rows],
        flat: false,
        range: Some(range),
    })
}
