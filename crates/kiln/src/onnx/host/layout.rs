//! Host operators that move an image's channels or relabel its layout without arithmetic:
//! channel concatenation, split and slice, ShuffleNet's channel shuffle, `Shape`, `Flatten`,
//! and the NCHW↔NHWC transposes that only relabel host data.
//!
//! Why here: each of these, left to the value path, converts a channels-last image back to
//! NCHW and the next convolution converts it again (ShuffleNet v2 paid four such round trips
//! per block, one of them for a `Shape`).

use std::mem::MaybeUninit;

use burn::tensor::Device;
use onnx_ir::node::slice::{SliceConfig, SliceInput};
use rayon::prelude::*;

use super::super::ops::shape::{axis_index, reshaped_dims, shape_of, slice_range};
use super::super::shuffle::{ChannelShuffle, ShapeSpec};
use super::{Image, OnnxError, Rows, Slot, ValueKind, take};

/// `Flatten` of a host image at `axis`: host rows `[∏ dims[..axis], ∏ dims[axis..]]` of its
/// NCHW values (transposed once on the host; the value path converted the image to a
/// tensor, reshaped it, and the linear layer after it copied the values back out: 0.55 ms
/// of W3's 8 ms at batch 64).
pub(super) fn flatten(
    ins: &mut [Option<Slot>],
    axis: usize,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Slot::Image(image)) = take(ins, 0) else {
        return None;
    };
    let [n, h, w, c] = image.dims;
    let nchw = [n, c, h, w];
    let axis = axis.min(nchw.len());
    let outer = nchw[..axis].iter().product();
    let inner = nchw[axis..].iter().product();
    Some(Ok(vec![Slot::Rows(Rows::new(
        image.into_nchw(),
        vec![outer, inner],
    ))]))
}

/// `Shape` of a host image (its NCHW dimensions) or of host rows, read without converting
/// them.
pub(super) fn shape(
    ins: &[Option<Slot>],
    start: usize,
    end: usize,
    device: &Device,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let dims = match ins.first()?.as_ref()? {
        Slot::Image(image) => {
            let [n, h, w, c] = image.dims;
            vec![n, c, h, w]
        }
        Slot::Rows(rows) => rows.dims.clone(),
        Slot::Value(_) => return None,
    };
    Some(Ok(vec![Slot::Value(shape_of(&dims, start, end, device))]))
}

/// The integers a step reads at run time from its input `i` (a shape or slice bound).
fn runtime_ints(ins: &[Option<Slot>], i: usize) -> Option<Vec<i64>> {
    match ins.get(i)? {
        Some(Slot::Value(v)) => v.to_i64s().ok(),
        _ => None,
    }
}

/// `Slice` of a host image that cuts only its channels, with step 1 (ShuffleNet's `chunk`
/// of a block's input): the channel range of every pixel. Any other slice is left to values.
pub(super) fn slice_channels(
    ins: &mut [Option<Slot>],
    config: &SliceConfig,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Some(Slot::Image(image))) = ins.first() else {
        return None;
    };
    let read = |s: &SliceInput| match s {
        SliceInput::Static(v) => Some(v.clone()),
        SliceInput::Runtime(r) => runtime_ints(ins, r.input_index),
    };
    let (starts, ends) = (read(&config.starts)?, read(&config.ends)?);
    let axes = match &config.axes {
        Some(axes) => read(axes)?,
        None => (0..starts.len() as i64).collect(),
    };
    let steps = match &config.steps {
        Some(steps) => read(steps)?,
        None => vec![1; starts.len()],
    };
    let [n, h, w, c] = image.dims;
    let nchw = [n, c, h, w];
    let mut channels = 0..c;
    for (i, (&start, &end)) in starts.iter().zip(&ends).enumerate() {
        let axis = axis_index(*axes.get(i)?, 4).ok()?;
        if steps.get(i) != Some(&1) {
            return None;
        }
        let range = slice_range(start, end, nchw[axis]);
        if axis == 1 {
            channels = range;
        } else if range != (0..nchw[axis]) {
            return None;
        }
    }
    if channels == (0..c) {
        return Some(Ok(vec![take(ins, 0)?]));
    }
    let mut out = Vec::with_capacity(n * h * w * channels.len());
    for px in image.data.chunks_exact(c.max(1)) {
        out.extend_from_slice(&px[channels.clone()]);
    }
    let dims = [n, h, w, channels.len()];
    Some(Ok(vec![Slot::Image(Image::new(out, dims))]))
}

/// A channel shuffle of a host image ([`ChannelShuffle`]): each pixel's `g × c/g` channel
/// matrix transposed. Left to values unless the reshapes are the shuffle's exactly
/// (`[n, g, c/g, h, w]` and back to `[n, c, h, w]`).
pub(in super::super) fn channel_shuffle(
    shuffle: &ChannelShuffle,
    ins: &mut [Option<Slot>],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Some(Slot::Image(image))) = ins.first() else {
        return None;
    };
    let [n, h, w, c] = image.dims;
    let spec = |s: &ShapeSpec| match s {
        ShapeSpec::Fixed(v) => Some(v.clone()),
        ShapeSpec::Input(i) => runtime_ints(ins, *i),
    };
    let grouped = reshaped_dims(&[n, c, h, w], &spec(&shuffle.into)?).ok()?;
    let [gn, groups, per, gh, gw] = grouped[..] else {
        return None;
    };
    let back = reshaped_dims(&[n, per, groups, h, w], &spec(&shuffle.back)?).ok()?;
    if [gn, gh, gw] != [n, h, w] || back != [n, c, h, w] || c == 0 {
        return None;
    }
    let Some(Slot::Image(image)) = take(ins, 0) else {
        return None;
    };
    let mut out = vec![0.0; image.data.len()];
    for (src, dst) in image.data.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        if groups == 2 {
            // ShuffleNet's case, an interleave of the two halves (vectorized as such).
            let (a, b) = src.split_at(per);
            for ((pair, &x), &y) in dst.chunks_exact_mut(2).zip(a).zip(b) {
                pair[0] = x;
                pair[1] = y;
            }
            continue;
        }
        for (g, group) in src.chunks_exact(per).enumerate() {
            for (j, &v) in group.iter().enumerate() {
                dst[j * groups + g] = v;
            }
        }
    }
    Some(Ok(vec![Slot::Image(Image::new(out, image.dims))]))
}

/// A transpose between NCHW and NHWC that only relabels an image: `[0, 2, 3, 1]` of an
/// image is its data as `[n, h, w, c]` host rows (shared, not copied), and `[0, 3, 1, 2]` of
/// `[n, h, w, c]` rows or a value is an image of that data (ConvNeXt permutes to
/// channels-last around each block's LayerNorm and linear layers, and back).
pub(super) fn relayout(
    ins: &mut [Option<Slot>],
    perm: &[i64],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let to_image = match (ins.first()?.as_ref()?, perm) {
        (Slot::Image(_), [0, 2, 3, 1]) => false,
        (Slot::Rows(r), [0, 3, 1, 2]) if r.dims.len() == 4 => true,
        (Slot::Value(v), [0, 3, 1, 2]) if v.rank() == 4 && v.kind() == ValueKind::Float => true,
        _ => return None,
    };
    let x = take(ins, 0)?;
    let run = || -> Result<Vec<Slot>, OnnxError> {
        Ok(vec![match x {
            // The data as they are, shared: no copy either way.
            Slot::Image(image) if !to_image => Slot::Rows(Rows {
                data: image.data,
                dims: image.dims.to_vec(),
                range: None,
            }),
            Slot::Rows(rows) if to_image => {
                let dims: [usize; 4] = rows
                    .dims
                    .clone()
                    .try_into()
                    .map_err(|d| OnnxError::Shape(format!("expected rank 4, got {d:?}")))?;
                Slot::Image(Image {
                    data: rows.data,
                    dims,
                })
            }
            Slot::Value(v) if to_image => {
                let dims: [usize; 4] = v
                    .dims()
                    .try_into()
                    .map_err(|d| OnnxError::Shape(format!("expected rank 4, got {d:?}")))?;
                Slot::Image(Image::new(v.to_f32s()?, dims))
            }
            _ => return Err(OnnxError::Graph("relayout of an unexpected slot".into())),
        }])
    };
    Some(run())
}

/// An image split along its channels into parts of `sizes` channels (ShuffleNet's
/// branches).
pub(super) fn split_channels(
    ins: &mut [Option<Slot>],
    sizes: &[usize],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Some(Slot::Image(image))) = ins.first() else {
        return None;
    };
    let [n, h, w, c] = image.dims;
    if sizes.iter().sum::<usize>() != c {
        return Some(Err(OnnxError::Shape(format!(
            "split sizes {sizes:?} do not add up to the {c} channels"
        ))));
    }
    let mut parts: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&s| Vec::with_capacity(n * h * w * s))
        .collect();
    for px in image.data.chunks_exact(c.max(1)) {
        let mut at = 0;
        for (part, &size) in parts.iter_mut().zip(sizes) {
            part.extend_from_slice(&px[at..at + size]);
            at += size;
        }
    }
    ins[0] = None;
    Some(Ok(parts
        .into_iter()
        .zip(sizes)
        .map(|(data, &size)| Slot::Image(Image::new(data, [n, h, w, size])))
        .collect()))
}

/// Output values from which a channel concatenation splits over the pool.
const CONCAT_PARALLEL_MIN: usize = 1 << 16;

/// Channel concatenation of images of one size (DenseNet, SqueezeNet's fire modules).
pub(super) fn concat_channels(ins: &mut [Option<Slot>]) -> Option<Result<Vec<Slot>, OnnxError>> {
    let images: Vec<&Image> = ins
        .iter()
        .map(|s| match s {
            Some(Slot::Image(i)) => Some(i),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let [n, h, w, _] = images.first()?.dims;
    if images.iter().any(|i| i.dims[..3] != [n, h, w]) {
        return None;
    }
    let c: usize = images.iter().map(|i| i.dims[3]).sum();
    let pixels = n * h * w;
    if c == 0 || pixels == 0 {
        return Some(Ok(vec![Slot::Image(Image::new(Vec::new(), [n, h, w, c]))]));
    }
    // Pixels `first..` of the output: each pixel's channels from each input in turn.
    let copy = |first: usize, out: &mut [MaybeUninit<f32>]| {
        for (i, px) in out.chunks_exact_mut(c).enumerate() {
            let mut at = 0;
            for image in &images {
                let ci = image.dims[3];
                px[at..at + ci].write_copy_of_slice(&image.data[(first + i) * ci..][..ci]);
                at += ci;
            }
        }
    };
    // Split by pixels over the pool when large: DenseNet concatenates every earlier feature
    // map at each layer, 10% of its run on one thread (BENCHMARKS.md run 40).
    let out = kiln_kernels::base::buffers::filled(pixels * c, |out| {
        if out.len() < CONCAT_PARALLEL_MIN {
            copy(0, out);
        } else {
            let per_task = pixels.div_ceil(kiln_kernels::base::threads::pool_threads() * 8);
            out.par_chunks_mut(per_task * c)
                .enumerate()
                .for_each(|(t, out)| copy(t * per_task, out));
        }
    });
    Some(Ok(vec![Slot::Image(Image::new(out, [n, h, w, c]))]))
}
