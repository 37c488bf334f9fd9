//! f32 2-D convolution on the host as one GEMM per image, for the forward pass and both
//! gradients: `out = W · cols`, `dcols = Wᵀ · dout` (scattered back to `dx`), and
//! `dW = Σ dout · colsᵀ`, where `cols` is the image unfolded into a `[cin·kh·kw, oh·ow]` matrix.
//!
//! Why not Burn's own convolution: profiling W2/W3 on `flex` (BENCHMARKS.md, runs 2 and 13)
//! showed its GEMM micro-kernel at under a third of the time and the rest in NHWC transposes,
//! zero-fills and a transposed convolution for the input gradient. Here each image's
//! unfolded matrix (W2/W3's conv2: 288 × 576 floats, 650 KB) is built in a per-thread buffer that
//! stays in L2, the output is written in NCHW straight from the GEMM (no transpose), and the
//! bias is the GEMM's initial value. Images are spread over the threads; a single image uses a
//! multi-threaded GEMM instead.

use std::mem::MaybeUninit;
use std::ops::Range;

use rayon::prelude::*;

use crate::base::gemm::{matmul, matmul_fresh};
use crate::base::scratch::{Scratch, per_group, with_scratch};
use crate::base::shape::{ConvShape, check_forward};
use crate::base::threads::pool_threads;

/// The weight `[cout, cin, kh, kw]` as `[cin, cout, kh, kw]` with each kernel turned by 180°:
/// the weight of [`ConvShape::input_grad_as_forward`]'s convolution.
///
/// Each input channel's block `[cout, kh, kw]` is one task over the pool and written once
/// without a zero fill first. Why: this runs once per input gradient, and W5's 512-channel
/// layer (9.4 MB) took 5.4 ms on the calling thread alone while the pool waited — the input
/// gradient was 29 ms against its forward twin's 24 (`train_conv` bench).
fn flip_transposed(s: &ConvShape, weight: &[f32]) -> Vec<f32> {
    let taps = s.kh * s.kw;
    let block = s.cout * taps;
    let flip_channel = |c: usize, dst: &mut [MaybeUninit<f32>]| {
        for (o, dst) in dst.chunks_exact_mut(taps).enumerate() {
            let kernel = &weight[(o * s.cin + c) * taps..][..taps];
            for (d, &v) in dst.iter_mut().rev().zip(kernel) {
                d.write(v);
            }
        }
    };
    crate::base::buffers::filled(weight.len(), |flipped| {
        if block == 0 {
            return;
        }
        if weight.len() >= PARALLEL_FLIP {
            flipped
                .par_chunks_exact_mut(block)
                .enumerate()
                .for_each(|(c, dst)| flip_channel(c, dst));
        } else {
            for (c, dst) in flipped.chunks_exact_mut(block).enumerate() {
                flip_channel(c, dst);
            }
        }
    })
}

/// Weight elements from which [`flip_transposed`] runs over the pool: below it (W5's
/// 64-channel layer, 37 K elements) the hand-off costs more than the copy.
const PARALLEL_FLIP: usize = 64 << 10;

/// Unfolds one image `[cin, h, w]` into `cols` `[cin·kh·kw, oh·ow]` (zeros where the kernel
/// reads padding), row `r` at `cols[r·ld..]`: `ld` is `oh·ow` for one image alone and `g·oh·ow`
/// when `cols` holds a group of `g` images side by side (this one's columns start at `cols`).
fn im2col(s: &ConvShape, image: &[f32], cols: &mut [f32], ld: usize) {
    let (oh, ow) = (s.out_h(), s.out_w());
    let p = oh * ow;
    let mut row = 0;
    for c in 0..s.cin {
        let plane = &image[c * s.h * s.w..(c + 1) * s.h * s.w];
        for ki in 0..s.kh {
            for kj in 0..s.kw {
                let dst = &mut cols[row * ld..row * ld + p];
                let di = (ki * s.dilation[0]) as isize - s.padding[0].0 as isize;
                let dj = (kj * s.dilation[1]) as isize - s.padding[1].0 as isize;
                // Output columns whose input column lies inside the image: [lo, hi).
                let (lo, hi) = valid_range(ow, s.stride[1], dj, s.w);
                if s.stride == [1, 1] && ow == s.w {
                    let tap = SameTap::new((s.h, s.w), oh, (di, dj));
                    dst[..tap.y0 * ow].fill(0.0);
                    dst[tap.y1 * ow..].fill(0.0);
                    dst[tap.start..tap.end].copy_from_slice(&plane[tap.source()]);
                    // What the copy took from the neighbouring rows is padding.
                    zero_edges(&mut dst[tap.y0 * ow..tap.y1 * ow], ow, (lo, hi));
                    row += 1;
                    continue;
                }
                for oy in 0..oh {
                    let out = &mut dst[oy * ow..(oy + 1) * ow];
                    let iy = (oy * s.stride[0]) as isize + di;
                    if iy < 0 || iy >= s.h as isize || lo >= hi {
                        out.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy as usize * s.w..(iy as usize + 1) * s.w];
                    out[..lo].fill(0.0);
                    out[hi..].fill(0.0);
                    let x0 = (lo * s.stride[1]) as isize + dj;
                    if s.stride[1] == 1 {
                        out[lo..hi].copy_from_slice(&src[x0 as usize..x0 as usize + hi - lo]);
                    } else {
                        for (k, o) in out[lo..hi].iter_mut().enumerate() {
                            *o = src[x0 as usize + k * s.stride[1]];
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Where one kernel tap reads in a stride-1 convolution whose output is as wide as its input
/// (`same` padding): output `oy·w + ox` reads plane `(oy + di)·w + ox + dj`, the same offset
/// `shift` for every value. Output rows `[y0, y1)` read inside the image; over them output
/// `[start, end)` maps to the plane contiguously (clipped at both ends), and the columns
/// outside `[lo, hi)` of those rows fall on the neighbouring row, not on the image.
///
/// Why: [`im2col`] and [`col2im`] then move one contiguous run per tap instead of one image
/// row (4 to 32 floats for ResNet's 3×3 layers) at a time — the row-by-row unfold was 5.5% of
/// W5's training step and the fold 3.3%.
struct SameTap {
    y0: usize,
    y1: usize,
    start: usize,
    end: usize,
    shift: isize,
}

impl SameTap {
    fn new((h, w): (usize, usize), oh: usize, (di, dj): (isize, isize)) -> Self {
        let y0 = (-di).clamp(0, oh as isize) as usize;
        let y1 = (h as isize - di).clamp(y0 as isize, oh as isize) as usize;
        let shift = di * w as isize + dj;
        let (first, last) = ((y0 * w) as isize, (y1 * w) as isize);
        let start = (-shift).clamp(first, last);
        let end = ((h * w) as isize - shift).clamp(start, last);
        let (start, end) = (start as usize, end as usize);
        SameTap {
            y0,
            y1,
            start,
            end,
            shift,
        }
    }

    /// The plane range `[start, end)` reads (empty when the tap reads no value of the image).
    fn source(&self) -> Range<usize> {
        if self.start == self.end {
            return 0..0;
        }
        (self.start as isize + self.shift) as usize..(self.end as isize + self.shift) as usize
    }
}

/// Zeroes columns `[0, lo)` and `[hi, w)` of the `w`-wide rows of `rows`.
fn zero_edges(rows: &mut [f32], w: usize, (lo, hi): (usize, usize)) {
    for row in rows.chunks_exact_mut(w) {
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
    }
}

/// Adds the unfolded gradient `dcols` `[cin·kh·kw, oh·ow]` (row `r` at `dcols[r·ld..]`, as in
/// [`im2col`]) back into the image gradient `[cin, h, w]` (the transpose of [`im2col`]); `dx`
/// must start zeroed. `dcols` is scratch: its values that fall on padding may be zeroed.
fn col2im(s: &ConvShape, dcols: &mut [f32], dx: &mut [f32], ld: usize) {
    let (oh, ow) = (s.out_h(), s.out_w());
    let p = oh * ow;
    let mut row = 0;
    for c in 0..s.cin {
        let plane = &mut dx[c * s.h * s.w..(c + 1) * s.h * s.w];
        for ki in 0..s.kh {
            for kj in 0..s.kw {
                let src = &mut dcols[row * ld..row * ld + p];
                let di = (ki * s.dilation[0]) as isize - s.padding[0].0 as isize;
                let dj = (kj * s.dilation[1]) as isize - s.padding[1].0 as isize;
                let (lo, hi) = valid_range(ow, s.stride[1], dj, s.w);
                if s.stride == [1, 1] && ow == s.w {
                    // Gradients that fall on padding become zeros, so one contiguous add
                    // (adding 0.0 leaves a value as it is) covers the tap.
                    let tap = SameTap::new((s.h, s.w), oh, (di, dj));
                    zero_edges(&mut src[tap.y0 * ow..tap.y1 * ow], ow, (lo, hi));
                    for (d, v) in plane[tap.source()].iter_mut().zip(&src[tap.start..tap.end]) {
                        *d += v;
                    }
                    row += 1;
                    continue;
                }
                for oy in 0..oh {
                    let iy = (oy * s.stride[0]) as isize + di;
                    if iy < 0 || iy >= s.h as isize || lo >= hi {
                        continue;
                    }
                    let dst = &mut plane[iy as usize * s.w..(iy as usize + 1) * s.w];
                    let g = &src[oy * ow..(oy + 1) * ow];
                    let x0 = ((lo * s.stride[1]) as isize + dj) as usize;
                    if s.stride[1] == 1 {
                        for (d, v) in dst[x0..x0 + hi - lo].iter_mut().zip(&g[lo..hi]) {
                            *d += v;
                        }
                    } else {
                        for (k, v) in g[lo..hi].iter().enumerate() {
                            dst[x0 + k * s.stride[1]] += v;
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Output columns `[lo, hi)` whose input column `ox·stride + offset` lies in `[0, w)`.
fn valid_range(ow: usize, stride: usize, offset: isize, w: usize) -> (usize, usize) {
    let lo = if offset >= 0 {
        0
    } else {
        ((-offset) as usize).div_ceil(stride)
    };
    let last = w as isize - 1 - offset; // largest ox·stride allowed
    let hi = if last < 0 {
        0
    } else {
        (last as usize / stride + 1).min(ow)
    };
    (lo.min(hi), hi)
}

/// Output pixels one GEMM should have at least: images are grouped side by side in one GEMM
/// until their pixels reach this. Why: ResNet's last stages have 8×8 and 4×4 images, and a GEMM
/// per 4×4 image packs the whole weight (512 × 4608 floats) to multiply it by 16 columns —
/// W5's stage-4 input gradient ran at 74 G multiply-adds/s per image, the weight gradient
/// (which also re-reads a 9 MB accumulator per image) at 66.
const GROUP_PIXELS: usize = 128;

/// Images per GEMM: enough for [`GROUP_PIXELS`], but never so many that some thread is left
/// without a group.
fn group_len(s: &ConvShape, threads: usize) -> usize {
    GROUP_PIXELS
        .div_ceil(s.pixels().max(1))
        .min(s.batch.div_ceil(threads))
        .max(1)
}

/// Unfolds a group of images `[g, cin, h, w]` side by side into `cols` `[k, g·p]`.
fn im2col_group(s: &ConvShape, images: &[f32], cols: &mut Vec<f32>) {
    let p = s.pixels();
    let g = images.len() / s.image_len();
    cols.resize(s.k() * g * p, 0.0);
    for (i, image) in images.chunks_exact(s.image_len()).enumerate() {
        im2col(s, image, &mut cols[i * p..], g * p);
    }
}

/// Gathers a group's per-image matrices `[g, rows, p]` into one `[rows, g·p]` (image `i`'s
/// columns at `i·p`), the layout a GEMM over the whole group reads and writes.
fn interleave(grouped: &[f32], rows: usize, p: usize, out: &mut Vec<f32>) {
    let g = grouped.len() / (rows * p);
    out.resize(rows * g * p, 0.0);
    for (i, image) in grouped.chunks_exact(rows * p).enumerate() {
        for (r, src) in image.chunks_exact(p).enumerate() {
            out[(r * g + i) * p..][..p].copy_from_slice(src);
        }
    }
}

/// The inverse of [`interleave`]: `[rows, g·p]` back to `[g, rows, p]`.
fn deinterleave(matrix: &[f32], rows: usize, p: usize, grouped: &mut [MaybeUninit<f32>]) {
    let g = grouped.len() / (rows * p);
    for (i, image) in grouped.chunks_exact_mut(rows * p).enumerate() {
        for (r, dst) in image.chunks_exact_mut(p).enumerate() {
            dst.write_copy_of_slice(&matrix[(r * g + i) * p..][..p]);
        }
    }
}

/// Multiply-adds per image below which [`conv2d_forward`] runs one image's GEMM on the calling
/// thread: handing a GEMM of this size to the pool and waiting costs more than the second
/// thread saves. Measured on W3 at batch 1 with the channels-last kernel while it still used
/// this rule (conv2: 10.6 M multiply-adds, 2 threads, dev-2c-epyc): the whole forward 0.53 ms
/// with a two-thread GEMM, 0.43 ms with one. The NCHW kernel's GEMM pays the same hand-off;
/// its own batch-1 figure was not measured separately.
const SEQUENTIAL_MACS: usize = 16 << 20;

/// Forward convolution: `out` `[batch, cout, oh, ow]` from `x` `[batch, cin, h, w]`, `weight`
/// `[cout, cin, kh, kw]` and an optional `bias` `[cout]`.
pub fn conv2d_forward(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    forward_into(s, x, weight, bias, crate::base::buffers::as_uninit(out));
}

/// [`conv2d_forward`] into a new vector that is not zero-filled first (the GEMM writes every
/// value once; the zero fill of a fresh 16 MB output is a pass over memory of its own — for
/// BatchNorm's outputs the fill cost as much as the kernel, BENCHMARKS.md run 39).
pub fn conv2d_forward_new(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    crate::base::buffers::filled(s.output_len(), |out| forward_into(s, x, weight, bias, out))
}

/// The forward's body: writes every value of `out`.
fn forward_into(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    let Some((k, p)) = check_forward(s, x, weight, out.len()) else {
        return;
    };
    if crate::winograd::applies_nchw(s) {
        crate::winograd::conv2d_nchw(s, x, weight, bias, out);
    } else if crate::direct::applies(s) {
        crate::direct::conv2d_direct(s, x, weight, bias, out);
    } else {
        forward_gemm(s, (x, weight, bias), (k, p), out);
    }
}

/// The forward as one GEMM per image or group of images over their unfolded patches (every
/// shape; [`forward_into`] takes Winograd or the direct kernel instead where they apply).
fn forward_gemm(
    s: &ConvShape,
    (x, weight, bias): (&[f32], &[f32], Option<&[f32]>),
    (k, p): (usize, usize),
    out: &mut [MaybeUninit<f32>],
) {
    let image_out = s.cout * p;
    let threads = pool_threads();
    // One group of images per task when there are enough images to keep every thread busy;
    // otherwise each image's GEMM is itself split over the threads, unless it is small.
    let gemm_threads = if s.batch >= threads || image_out * k < SEQUENTIAL_MACS {
        1
    } else {
        threads
    };
    let group = group_len(s, threads);
    let run = |scratch: &mut Scratch, (images, out): (&[f32], &mut [MaybeUninit<f32>])| {
        let n = images.len() / s.image_len() * p;
        let cols: &[f32] = if s.is_pointwise() && n == p {
            images
        } else {
            im2col_group(s, images, &mut scratch.cols);
            &scratch.cols
        };
        let product = |dst: &mut [MaybeUninit<f32>]| {
            let lhs = (weight, (k, 1));
            matmul_fresh((s.cout, n, k), dst, lhs, (cols, (n, 1)), gemm_threads);
        };
        // One image is written in place; a group's GEMM writes `[cout, g·p]`, scattered after.
        // The bias is added after the product (one addition either way: the same values).
        if n == p {
            product(out);
            // SAFETY: the GEMM wrote all of `out` (m × n = cout × p values).
            add_bias(unsafe { crate::base::buffers::assume_init(out) }, bias, n);
        } else {
            scratch.staged.resize(s.cout * n, 0.0);
            product(crate::base::buffers::as_uninit(&mut scratch.staged));
            add_bias(&mut scratch.staged, bias, n);
            deinterleave(&scratch.staged, s.cout, p, out);
        }
    };
    let pairs = x
        .chunks(group * s.image_len())
        .zip(out.chunks_mut(group * image_out));
    per_group(pairs, gemm_threads == 1, run);
}

/// Adds `bias[o]` to row `o` (of `n` values) of `rows`.
fn add_bias(rows: &mut [f32], bias: Option<&[f32]>, n: usize) {
    if let Some(b) = bias {
        for (row, &v) in rows.chunks_exact_mut(n).zip(b) {
            row.iter_mut().for_each(|x| *x += v);
        }
    }
}

/// Gradient of the input: `dx` `[batch, cin, h, w]` from the output gradient `dout`
/// `[batch, cout, oh, ow]` and `weight`.
pub fn conv2d_input_grad(s: &ConvShape, dout: &[f32], weight: &[f32], dx: &mut [f32]) {
    input_grad_into(s, dout, weight, crate::base::buffers::as_uninit(dx));
}

/// [`conv2d_input_grad`] into a new vector, not zero-filled first where the gradient is a
/// flipped forward convolution (see [`conv2d_forward_new`]; the unfold path adds into a
/// zeroed `dx`).
pub fn conv2d_input_grad_new(s: &ConvShape, dout: &[f32], weight: &[f32]) -> Vec<f32> {
    crate::base::buffers::filled(s.input_len(), |dx| input_grad_into(s, dout, weight, dx))
}

/// The input gradient's body: writes every value of `dx`.
fn input_grad_into(s: &ConvShape, dout: &[f32], weight: &[f32], dx: &mut [MaybeUninit<f32>]) {
    assert_eq!(dout.len(), s.output_len(), "conv2d output-gradient length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(dx.len(), s.input_len(), "conv2d input-gradient length");
    if s.image_len() == 0 || s.batch == 0 {
        return;
    }
    if let Some(t) = s.input_grad_as_forward() {
        forward_into(&t, dout, &flip_transposed(s, weight), None, dx);
        return;
    }
    // The unfold path adds into `dx`: it starts from zeros.
    dx.fill(MaybeUninit::new(0.0));
    // SAFETY: every value was just written.
    input_grad_unfolded(s, dout, weight, unsafe {
        crate::base::buffers::assume_init(dx)
    });
}

/// The input gradient as `dcols = Wᵀ · dout` folded back into `dx` (initialized).
fn input_grad_unfolded(s: &ConvShape, dout: &[f32], weight: &[f32], dx: &mut [f32]) {
    let (k, p) = (s.k(), s.pixels());
    let image_out = s.cout * p;
    let threads = pool_threads();
    let gemm_threads = if s.batch >= threads { 1 } else { threads };
    let group = group_len(s, threads);
    let run = |scratch: &mut Scratch, (grads, dx): (&[f32], &mut [f32])| {
        let n = grads.len() / image_out * p;
        if s.is_pointwise() && n == p {
            // dx = Wᵀ · dout directly.
            matmul(
                (k, p, s.cout),
                dx,
                false,
                weight,
                (1, k),
                grads,
                (p, 1),
                gemm_threads,
            );
            return;
        }
        let grads: &[f32] = if n == p {
            grads
        } else {
            interleave(grads, s.cout, p, &mut scratch.staged);
            &scratch.staged
        };
        // dcols (k × g·p) = Wᵀ · dout, folded back into each image.
        scratch.cols.resize(k * n, 0.0);
        matmul(
            (k, n, s.cout),
            &mut scratch.cols,
            false,
            weight,
            (1, k),
            grads,
            (n, 1),
            gemm_threads,
        );
        dx.fill(0.0);
        for (i, dx) in dx.chunks_exact_mut(s.image_len()).enumerate() {
            col2im(s, &mut scratch.cols[i * p..], dx, n);
        }
    };
    let pairs = dout
        .chunks(group * image_out)
        .zip(dx.chunks_mut(group * s.image_len()));
    per_group(pairs, gemm_threads == 1, run);
}

/// Gradient of the weight: `dweight` `[cout, cin, kh, kw]` from `x` and `dout`, summed over the
/// batch.
///
/// A large weight (≥ 256 K elements) with enough input channels is split over the
/// threads by input channels, each thread summing its rows over the whole batch (no per-thread
/// copies of the weight to add up, and the result does not depend on the thread count);
/// otherwise the threads split the images, each summing its share into its own buffer, added
/// at the end in a fixed order.
pub fn conv2d_weight_grad(s: &ConvShape, x: &[f32], dout: &[f32], dweight: &mut [f32]) {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(dout.len(), s.output_len(), "conv2d output-gradient length");
    assert_eq!(
        dweight.len(),
        s.weight_len(),
        "conv2d weight-gradient length"
    );
    if s.batch == 0 || s.cout * s.pixels() == 0 {
        dweight.fill(0.0);
        return;
    }
    if crate::winograd::applies_weight_grad(s) {
        crate::winograd::weight_grad_nchw(s, x, dout, dweight);
        return;
    }
    let threads = pool_threads();
    if s.weight_len() >= SPLIT_WEIGHT && s.cin >= 4 * threads {
        // Every thread sums over the whole batch, so the grouping need not leave groups for
        // other threads, and the same for any thread count keeps the sums' order fixed.
        let group = group_len(s, 1);
        let ranges: Vec<Range<usize>> = (0..threads)
            .map(|t| t * s.cin / threads..(t + 1) * s.cin / threads)
            .collect();
        let parts: Vec<WeightGradPart> = ranges
            .into_par_iter()
            .map(|channels| weight_grad_part(s, x, dout, channels, 0..s.batch, group))
            .collect();
        // Placed over the pool in blocks of output channels (each part fills its columns of
        // every row): the transposed parts of W5's 512-channel layer are 9.4 MB that the
        // calling thread alone took ~2 ms to place while the pool waited.
        let rows_per_task = PLACE_ROWS.min(s.cout);
        dweight
            .par_chunks_mut(rows_per_task * s.k())
            .enumerate()
            .for_each(|(b, rows)| {
                for part in &parts {
                    part.place(s, b * rows_per_task, rows);
                }
            });
        return;
    }
    let group = group_len(s, threads);
    let share = s.batch.div_ceil(threads.min(s.batch));
    let shares: Vec<Range<usize>> = (0..s.batch)
        .step_by(share)
        .map(|n| n..(n + share).min(s.batch))
        .collect();
    let mut parts: Vec<WeightGradPart> = shares
        .into_par_iter()
        .map(|images| weight_grad_part(s, x, dout, 0..s.cin, images, group))
        .collect();
    let Some((first, rest)) = parts.split_first_mut() else {
        return;
    };
    for part in rest.iter() {
        for (d, v) in first.sum.iter_mut().zip(&part.sum) {
            *d += v;
        }
    }
    first.place(s, 0, dweight);
}

/// Output channels per task when [`conv2d_weight_grad`] places its parts over the pool.
const PLACE_ROWS: usize = 32;

/// Weight elements from which [`conv2d_weight_grad`] splits the work by input channels rather
/// than by images: below it, a copy of the weight per thread is cheap to add up, and each
/// thread's GEMM keeps all the weight's rows (576 for W5's 64-channel 3×3 layer, a multiple of
/// the micro-kernel's 64; half of them would waste a third of the last tile). Measured on W5
/// (batch 64, 2 threads): 64-channel layer 30 ms by images, 36 by channels; 512-channel layer
/// (2.4 M elements) 35 ms by images with its 9 MB per-thread sums.
const SPLIT_WEIGHT: usize = 256 << 10;

/// One thread's share of a weight gradient: the rows `rows` (input channels × taps) of `dW`,
/// summed over some images, stored `[cout, rows]` or, when `transposed`, `[rows, cout]`.
struct WeightGradPart {
    rows: Range<usize>,
    transposed: bool,
    sum: Vec<f32>,
}

impl WeightGradPart {
    /// Writes these rows into `dweight`: whole rows `[cout, cin·kh·kw]` of the weight
    /// gradient, starting at output channel `first`.
    fn place(&self, s: &ConvShape, first: usize, dweight: &mut [f32]) {
        let (k, width) = (s.k(), self.rows.len());
        if !self.transposed {
            for (dst, src) in dweight
                .chunks_exact_mut(k)
                .zip(self.sum.chunks_exact(width).skip(first))
            {
                dst[self.rows.clone()].copy_from_slice(src);
            }
            return;
        }
        // `[rows, cout]` → `[cout, rows]` in blocks of 16 rows: each output channel's 16
        // values are one contiguous store, and the 16 source rows stay in cache across the
        // channels (a plain column walk took 4.5% of W5's last-stage weight gradient).
        const BLOCK: usize = 16;
        for r0 in (0..width).step_by(BLOCK) {
            let rows = BLOCK.min(width - r0);
            for (o, dst) in dweight.chunks_exact_mut(k).enumerate() {
                let dst = &mut dst[self.rows.start + r0..][..rows];
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = self.sum[(r0 + r) * s.cout + first + o];
                }
            }
        }
    }
}

/// The weight gradient of input `channels` summed over `images`, on this thread, `group`
/// images per GEMM.
///
/// The product runs in whichever orientation puts the larger side first: `dWᵀ = cols · doutᵀ`
/// when `channels·kh·kw > cout`. Why: the `gemm` crate's speed depends on it — W5's 3×3
/// 64-channel layer (576 rows, cout = 64) took 77 ms as `dout · colsᵀ` and 31 ms as
/// `cols · doutᵀ`, while the 3-channel stem (27 rows) is 2.4× faster the other way.
fn weight_grad_part(
    s: &ConvShape,
    x: &[f32],
    dout: &[f32],
    channels: Range<usize>,
    images: Range<usize>,
    group: usize,
) -> WeightGradPart {
    let sub = ConvShape {
        cin: channels.len(),
        ..*s
    };
    let (k, p, plane) = (sub.k(), s.pixels(), s.h * s.w);
    let image_out = s.cout * p;
    let transposed = k > s.cout;
    let mut sum = vec![0.0f32; k * s.cout];
    with_scratch(|scratch| {
        for start in images.clone().step_by(group) {
            let g = group.min(images.end - start);
            let n = g * p;
            // This image's input channels `channels`: one contiguous run of planes.
            let image =
                |i: usize| &x[((start + i) * s.cin + channels.start) * plane..][..sub.image_len()];
            let cols: &[f32] = if sub.is_pointwise() && g == 1 {
                image(0)
            } else {
                scratch.cols.resize(k * n, 0.0);
                for i in 0..g {
                    im2col(&sub, image(i), &mut scratch.cols[i * p..], n);
                }
                &scratch.cols
            };
            let grads = &dout[start * image_out..(start + g) * image_out];
            let grads: &[f32] = if g == 1 {
                grads
            } else {
                interleave(grads, s.cout, p, &mut scratch.staged);
                &scratch.staged
            };
            let accumulate = start > images.start;
            if transposed {
                // dWᵀ (k × cout) += cols (k × n) · doutᵀ (n × cout).
                let dims = (k, s.cout, n);
                matmul(dims, &mut sum, accumulate, cols, (n, 1), grads, (1, n), 1);
            } else {
                // dW (cout × k) += dout (cout × n) · colsᵀ (n × k).
                let dims = (s.cout, k, n);
                matmul(dims, &mut sum, accumulate, grads, (n, 1), cols, (1, n), 1);
            }
        }
    });
    let taps = s.kh * s.kw;
    WeightGradPart {
        rows: channels.start * taps..channels.end * taps,
        transposed,
        sum,
    }
}

#[cfg(test)]
mod tests;
