//! Channels-last (NHWC) image kernels for inference on the host: depthwise convolution (its
//! interior strips in [`super::depthwise_strip`]), pooling with padding and ceil mode, global
//! average pooling, per-channel and element-wise arithmetic, and the layout transposes
//! (activations are in [`super::activation`]).
//!
//! Why channels-last: Kiln's implicit-GEMM convolution ([`super::implicit`]) reads and writes
//! NHWC, so an imported model whose image layers all run here keeps its activations NHWC from
//! the first convolution to the global pool, with no transpose per layer (ONNX Runtime keeps
//! its NCHWc blocked layout for the same reason). Every kernel's inner loop runs along the
//! channels, contiguous in this layout, so it vectorizes; each is compiled once more for
//! AVX-512 and for AVX2 + FMA (the kernels' `multiversion!`), picked by
//! [`super::implicit::F32Kernel::detect`] (`KILN_F32_KERNEL`).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::activation::{Activation, activate_slice};
use super::depthwise_strip::{self, SlideRow, Strip};
use super::implicit::F32Kernel;

/// Values below which a memory-bound kernel runs on the calling thread, and the size of its
/// parallel chunks: waking a pool thread costs about what one thread takes for this many
/// (measured on MobileNet v3 small at batch 1, where 32 Ki-value chunks left 15% of the
/// time in the scheduler).
pub(super) const PARALLEL_MIN: usize = 1 << 17;

/// Multiply-adds below which a depthwise convolution stays on the calling thread: the dense
/// convolution's threshold ([`super::implicit::SPLIT_MACS`], which says why it is low).
const DEPTHWISE_PARALLEL_MACS: usize = super::implicit::SPLIT_MACS;

/// `[batch, channels, h, w]` values to channels-last `[batch, h, w, channels]`.
pub fn nchw_to_nhwc(x: &[f32], [b, c, h, w]: [usize; 4]) -> Vec<f32> {
    transpose_images(x, b, [c, h * w])
}

/// Channels-last `[batch, h, w, channels]` values to `[batch, channels, h, w]`.
pub fn nhwc_to_nchw(x: &[f32], [b, h, w, c]: [usize; 4]) -> Vec<f32> {
    transpose_images(x, b, [h * w, c])
}

/// [`nhwc_to_nchw`] into `y` (as long as `x`; every value written).
pub(crate) fn nhwc_to_nchw_into(x: &[f32], [b, h, w, c]: [usize; 4], y: &mut [MaybeUninit<f32>]) {
    assert_eq!(x.len(), b * h * w * c, "transpose input length");
    assert_eq!(y.len(), x.len(), "transpose output length");
    transpose_into(x, [h * w, c], y);
}

/// Side of the square blocks the transpose moves: 16 × 16 values read and written stay in
/// L1 (a plain column walk misses a cache line per value on large images).
const TRANSPOSE_BLOCK: usize = 16;

/// Transposes each of the `b` row-major `[rows, cols]` matrices in `x`.
///
/// The output is written once, not zero-filled first (a serial pass as long as the transpose
/// itself on a batch's input images: BENCHMARKS.md run 40).
fn transpose_images(x: &[f32], b: usize, [rows, cols]: [usize; 2]) -> Vec<f32> {
    assert_eq!(x.len(), b * rows * cols, "transpose input length");
    super::filled(x.len(), |y| transpose_into(x, [rows, cols], y))
}

/// [`transpose_images`] into `y` (`x.len()` values, every one written).
fn transpose_into(x: &[f32], [rows, cols]: [usize; 2], y: &mut [MaybeUninit<f32>]) {
    let plane = rows * cols;
    if plane == 0 || rows == 1 || cols == 1 {
        y.write_copy_of_slice(x);
        return;
    }
    match rows {
        2 => return few_rows::<2>(x, y, cols),
        3 => return few_rows::<3>(x, y, cols),
        4 => return few_rows::<4>(x, y, cols),
        _ => {}
    }
    // Task: one image's band of TRANSPOSE_BLOCK source columns = a contiguous run of
    // output rows, walked in square blocks.
    #[cfg(target_arch = "x86_64")]
    let simd = F32Kernel::detect() != F32Kernel::Portable;
    let band = |src: &[f32], (k, out): (usize, &mut [MaybeUninit<f32>])| {
        let c0 = k * TRANSPOSE_BLOCK;
        let c1 = (c0 + TRANSPOSE_BLOCK).min(cols);
        for r0 in (0..rows).step_by(TRANSPOSE_BLOCK) {
            #[cfg(target_arch = "x86_64")]
            if simd && c1 - c0 == TRANSPOSE_BLOCK && r0 + TRANSPOSE_BLOCK <= rows {
                for (dr, dc) in [(0, 0), (0, 8), (8, 0), (8, 8)] {
                    let from = src[(r0 + dr) * cols + c0 + dc..].as_ptr();
                    let to = out[dc * rows + r0 + dr..].as_mut_ptr().cast::<f32>();
                    // SAFETY: AVX2 + FMA (a SIMD kernel was detected); the 8×8 block's rows
                    // lie inside `src` (`r0 + 16 ≤ rows`, `c0 + 16 ≤ cols`) and its
                    // transposed rows inside the band (`out` holds 16 output rows of `rows`).
                    unsafe { transpose8x8(from, cols, to, rows) };
                }
                continue;
            }
            for r in r0..(r0 + TRANSPOSE_BLOCK).min(rows) {
                for (j, &v) in src[r * cols..][c0..c1].iter().enumerate() {
                    out[j * rows + r] = MaybeUninit::new(v);
                }
            }
        }
    };
    let band_len = rows * TRANSPOSE_BLOCK;
    let image = |(out, src): (&mut [MaybeUninit<f32>], &[f32])| {
        if plane < PARALLEL_MIN {
            out.chunks_mut(band_len)
                .enumerate()
                .for_each(|t| band(src, t));
        } else {
            out.par_chunks_mut(band_len)
                .enumerate()
                .for_each(|t| band(src, t));
        }
    };
    // Many small images (a batch's feature maps before a Flatten) split by image.
    if plane < PARALLEL_MIN && x.len() >= PARALLEL_MIN {
        y.par_chunks_mut(plane)
            .zip(x.par_chunks(plane))
            .for_each(image);
    } else {
        y.chunks_mut(plane).zip(x.chunks(plane)).for_each(image);
    }
}

/// The 8×8 block at `src` (rows `src_stride` apart) transposed to `dst` (rows `dst_stride`
/// apart) in AVX registers: the scalar walk moved ~3.4 GB/s, and the Winograd training
/// convolution turns every layer's input and output with it (BENCHMARKS.md run 47).
///
/// # Safety
/// The CPU has AVX2; `src` is valid for 8 reads at each of its 8 rows, `dst` for 8 writes at
/// each of its 8 rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8x8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    let r: [__m256; 8] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * src_stride)) });
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // Pairs of rows interleaved; now groups of four columns.
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    for i in 0..4 {
        // SAFETY: the caller's contract.
        unsafe {
            _mm256_storeu_ps(
                dst.add(i * dst_stride),
                _mm256_permute2f128_ps::<0x20>(u[i], u[i + 4]),
            );
            _mm256_storeu_ps(
                dst.add((i + 4) * dst_stride),
                _mm256_permute2f128_ps::<0x31>(u[i], u[i + 4]),
            );
        }
    }
}

/// [`transpose_images`] of `[R, cols]` matrices (an RGB input to channels-last): each output
/// pixel gathers its `R` values from `R` sequential streams. The square blocks' bands would
/// be 16 pixels of `R` values each: at `R = 3` the stem's input cost 182 µs for 150 K values
/// (profiled on EfficientNet-B0 at batch 1), several times a memory pass.
fn few_rows<const R: usize>(x: &[f32], y: &mut [MaybeUninit<f32>], cols: usize) {
    /// Output pixels per task.
    const PIXELS: usize = 1 << 13;
    let plane = R * cols;
    let task = |src: &[f32], (t, out): (usize, &mut [MaybeUninit<f32>])| {
        let p0 = t * PIXELS;
        if R == 3 {
            let n = out.len() / 3;
            let row = |r: usize| &src[r * cols + p0..][..n];
            return interleave3(row(0), row(1), row(2), out);
        }
        for (i, px) in out.chunks_exact_mut(R).enumerate() {
            for (r, v) in px.iter_mut().enumerate() {
                *v = MaybeUninit::new(src[r * cols + p0 + i]);
            }
        }
    };
    for (out, src) in y.chunks_mut(plane).zip(x.chunks(plane)) {
        if plane < PARALLEL_MIN {
            out.chunks_mut(R * PIXELS)
                .enumerate()
                .for_each(|t| task(src, t));
        } else {
            out.par_chunks_mut(R * PIXELS)
                .enumerate()
                .for_each(|t| task(src, t));
        }
    }
}

multiversion! {
    /// `out[3i + r] = [a, b, c][r][i]` for each pixel `i < out.len() / 3`: three channel rows
    /// interleaved into pixels (a row of an RGB image to channels-last). Written so LLVM
    /// vectorizes it per instruction set: a value-by-value strided store (`step_by`) took
    /// 228 ns per 224-pixel row, this 36 (AVX-512), 50 (AVX2), 65 (baseline).
    pub(crate) fn interleave3(a: &[f32], b: &[f32], c: &[f32], out: &mut [MaybeUninit<f32>]) {
        let n = out.len() / 3;
        let (a, b, c, out) = (&a[..n], &b[..n], &c[..n], &mut out[..3 * n]);
        for i in 0..n {
            out[3 * i] = MaybeUninit::new(a[i]);
            out[3 * i + 1] = MaybeUninit::new(b[i]);
            out[3 * i + 2] = MaybeUninit::new(c[i]);
        }
    }
}

/// An element-wise arithmetic operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arith {
    /// `a + b`.
    Add,
    /// `a − b`.
    Sub,
    /// `a · b`.
    Mul,
    /// `a / b`.
    Div,
}

impl Arith {
    #[inline(always)]
    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Arith::Add => a + b,
            Arith::Sub => a - b,
            Arith::Mul => a * b,
            Arith::Div => a / b,
        }
    }
}

/// `a = op(a, b)` element by element (same length), then `relu` when asked.
pub fn arith_in_place(a: &mut [f32], b: &[f32], op: Arith, relu: bool) {
    assert_eq!(a.len(), b.len(), "element-wise operands differ in length");
    if a.len() < PARALLEL_MIN {
        arith_slice(a, b, op, relu);
    } else {
        a.par_chunks_mut(PARALLEL_MIN)
            .zip(b.par_chunks(PARALLEL_MIN))
            .for_each(|(a, b)| arith_slice(a, b, op, relu));
    }
}

multiversion! {
    fn arith_slice(a: &mut [f32], b: &[f32], op: Arith, relu: bool) {
        for (x, &y) in a.iter_mut().zip(b) {
            let v = op.apply(*x, y);
            *x = if relu { v.max(0.0) } else { v };
        }
    }
}

/// `x = op(x, v)` per channel: `x` holds groups of `pixels` pixels of `channels` values, and
/// group `g` uses row `g mod rows` of `v` (`[rows, channels]`: one row for a per-channel
/// constant over a batch, one per image for a squeeze-excitation gate `[n, c]` over
/// `[n, h, w, c]`). With `swap`, `x = op(v, x)`.
pub fn arith_channels_in_place(
    x: &mut [f32],
    v: &[f32],
    [pixels, channels]: [usize; 2],
    op: Arith,
    swap: bool,
) {
    let group = pixels * channels;
    if group == 0 {
        return;
    }
    assert_eq!(x.len() % group, 0, "per-channel operand: image length");
    assert!(
        !v.is_empty() && v.len().is_multiple_of(channels),
        "per-channel operand: {} values for {channels} channels",
        v.len()
    );
    let rows = v.len() / channels;
    let run = |(g, xs): (usize, &mut [f32])| {
        let row = &v[(g % rows) * channels..][..channels];
        arith_pixels(xs, row, op, swap);
    };
    if x.len() < PARALLEL_MIN {
        x.chunks_mut(group).enumerate().for_each(run);
    } else {
        x.par_chunks_mut(group).enumerate().for_each(run);
    }
}

multiversion! {
    fn arith_pixels(xs: &mut [f32], row: &[f32], op: Arith, swap: bool) {
        for px in xs.chunks_exact_mut(row.len()) {
            for (x, &y) in px.iter_mut().zip(row) {
                *x = if swap { op.apply(y, *x) } else { op.apply(*x, y) };
            }
        }
    }
}

/// `x = x · scale + shift` per channel over channels-last pixels (an inference BatchNorm),
/// then clamped to `bounds` when given (a ReLU or ReLU6 fused after it: one pass, not two).
pub fn scale_shift_in_place(x: &mut [f32], scale: &[f32], shift: &[f32], bounds: Option<[f32; 2]>) {
    let chunk = scale_shift_chunk(x.len(), scale, shift);
    if chunk == 0 {
        return;
    }
    if x.len() < PARALLEL_MIN {
        scale_shift_pixels(x, scale, shift, bounds);
    } else {
        x.par_chunks_mut(chunk)
            .for_each(|xs| scale_shift_pixels(xs, scale, shift, bounds));
    }
}

/// [`scale_shift_in_place`] into a new vector, `x` left as it is: for an input another layer
/// still reads (DenseNet's BatchNorm reads a Concat's output that the next Concat reads too),
/// where a copy and then a pass over the copy went twice over memory. Each chunk is copied
/// and transformed while it is in cache.
pub fn scale_shift_new(
    x: &[f32],
    scale: &[f32],
    shift: &[f32],
    bounds: Option<[f32; 2]>,
) -> Vec<f32> {
    let chunk = scale_shift_chunk(x.len(), scale, shift);
    if chunk == 0 {
        return x.to_vec();
    }
    super::filled(x.len(), |out| {
        let run = |(dst, src): (&mut [MaybeUninit<f32>], &[f32])| {
            // Every value of the chunk is written, then transformed in place.
            let dst = dst.write_copy_of_slice(src);
            scale_shift_pixels(dst, scale, shift, bounds);
        };
        if x.len() < PARALLEL_MIN {
            out.chunks_mut(chunk).zip(x.chunks(chunk)).for_each(run);
        } else {
            out.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk))
                .for_each(run);
        }
    })
}

/// Values per task of a per-channel scale and shift over `len` values (whole pixels, so each
/// chunk starts at channel 0); 0 when there are no channels.
fn scale_shift_chunk(len: usize, scale: &[f32], shift: &[f32]) -> usize {
    let c = scale.len();
    assert_eq!(shift.len(), c, "scale and shift lengths differ");
    if c == 0 {
        return 0;
    }
    assert_eq!(len % c, 0, "scale_shift: image length");
    (PARALLEL_MIN / c).max(1) * c
}

multiversion! {
    fn scale_shift_pixels(xs: &mut [f32], scale: &[f32], shift: &[f32], bounds: Option<[f32; 2]>) {
        match bounds {
            // Unbounded: no clamp at all, so a NaN stays a NaN.
            None => {
                for px in xs.chunks_exact_mut(scale.len()) {
                    for ((x, &a), &b) in px.iter_mut().zip(scale).zip(shift) {
                        *x = *x * a + b;
                    }
                }
            }
            // `max` first, as the convolutions' clamp: a NaN becomes the lower bound.
            Some([lo, hi]) => {
                for px in xs.chunks_exact_mut(scale.len()) {
                    for ((x, &a), &b) in px.iter_mut().zip(scale).zip(shift) {
                        *x = (*x * a + b).max(lo).min(hi);
                    }
                }
            }
        }
    }
}

/// The geometry of a pooling or depthwise window over a channels-last image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window2d {
    /// `[batch, h, w, channels]` of the input.
    pub dims: [usize; 4],
    /// Kernel height and width.
    pub kernel: [usize; 2],
    /// Stride (rows, columns).
    pub stride: [usize; 2],
    /// Dilation (rows, columns).
    pub dilation: [usize; 2],
    /// `[(top, bottom), (left, right)]`.
    pub pads: [(usize, usize); 2],
    /// Output size rounded up (ONNX `ceil_mode`): a last window may start in the bottom or
    /// right padding's shadow, but never past the input and its begin padding.
    pub ceil_mode: bool,
}

impl Window2d {
    fn out_len(&self, axis: usize) -> usize {
        let input = self.dims[1 + axis];
        let (begin, end) = self.pads[axis];
        let span = (self.kernel[axis] - 1) * self.dilation[axis] + 1;
        let padded = input + begin + end;
        if padded < span {
            return 0;
        }
        let steps = padded - span;
        let stride = self.stride[axis];
        let mut out = if self.ceil_mode {
            steps.div_ceil(stride) + 1
        } else {
            steps / stride + 1
        };
        // ONNX and PyTorch: the last window must start inside the input or its begin pad.
        if self.ceil_mode && (out - 1) * stride >= input + begin {
            out -= 1;
        }
        out
    }

    /// `[batch, oh, ow, channels]` of the output.
    pub fn out_dims(&self) -> [usize; 4] {
        [self.dims[0], self.out_len(0), self.out_len(1), self.dims[3]]
    }

    /// The kernel taps of output index `o` on `axis` that land inside the input, and the
    /// input index of the first: taps `k0..k1` read input `i0 + (k − k0)·dilation`.
    #[inline(always)]
    pub(crate) fn valid_taps(&self, axis: usize, o: usize) -> (usize, usize, usize) {
        let input = self.dims[1 + axis] as isize;
        let (start, begin) = ((o * self.stride[axis]) as isize, self.pads[axis].0 as isize);
        let d = self.dilation[axis] as isize;
        let first = start - begin;
        // The first tap k with first + k·d ≥ 0, and one past the last with first + k·d < input.
        let k0 = if first >= 0 { 0 } else { (-first + d - 1) / d };
        let k1 = if first >= input {
            0
        } else {
            ((input - first + d - 1) / d).min(self.kernel[axis] as isize)
        };
        let k0 = k0.min(k1);
        (k0 as usize, k1 as usize, (first + k0 * d).max(0) as usize)
    }

    /// For average pooling with the padding counted: window cells inside the padded input
    /// (ONNX: a ceil-mode window's part past the end padding does not count).
    fn padded_cells(&self, axis: usize, o: usize) -> usize {
        let (input, (begin, end)) = (self.dims[1 + axis], self.pads[axis]);
        let start = o * self.stride[axis];
        let stop =
            (start + (self.kernel[axis] - 1) * self.dilation[axis] + 1).min(input + begin + end);
        (stop - start).div_ceil(self.dilation[axis])
    }
}

/// What a pooling window computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The maximum (padding never wins; a NaN does).
    Max,
    /// The mean over the valid cells, or with `count_include_pad` over the padded window.
    Average {
        /// Divide by the window's cells inside the padded input, not only the valid ones.
        count_include_pad: bool,
    },
}

/// Max or average pooling of a channels-last image.
pub fn pool2d(x: &[f32], win: &Window2d, kind: PoolKind) -> Vec<f32> {
    let [b, h, w, c] = win.dims;
    assert_eq!(x.len(), b * h * w * c, "pool2d input length");
    let [_, oh, ow, _] = win.out_dims();
    let len = b * oh * ow * c;
    if len == 0 {
        return Vec::new();
    }
    // Every output row is written whole (each pixel starts from its fill value), so the
    // output is not zero-filled first: a serial pass over 6.4 MB after ResNet's stem at
    // batch 8 (BENCHMARKS.md run 40).
    super::filled(len, |out| {
        let row = |(r, o_row): (usize, &mut [MaybeUninit<f32>])| pool_row(x, win, kind, r, o_row);
        if out.len() < PARALLEL_MIN {
            out.chunks_exact_mut(ow * c).enumerate().for_each(row);
        } else {
            out.par_chunks_exact_mut(ow * c).enumerate().for_each(row);
        }
    })
}

multiversion! {
    /// Output row `r` (image `r / oh`, row `r mod oh`) of [`pool2d`]. Each pixel's window
    /// taps are listed once; each block of 16 channels then runs over all of them with its
    /// running maximum (or sum) in registers and is stored once: the former loop read,
    /// compared and stored the whole pixel at every tap (three memory operations per value
    /// and tap instead of one).
    fn pool_row(
        x: &[f32],
        win: &Window2d,
        kind: PoolKind,
        r: usize,
        o_row: &mut [MaybeUninit<f32>],
    ) {
        let [_, h, w, c] = win.dims;
        let oh = win.out_len(0);
        let (n, oy) = (r / oh, r % oh);
        let (ky0, ky1, iy0) = win.valid_taps(0, oy);
        let mut taps = [0usize; MAX_POOL_TAPS];
        for (ox, o) in o_row.chunks_exact_mut(c).enumerate() {
            let (kx0, kx1, ix0) = win.valid_taps(1, ox);
            let cells = (ky1 - ky0) * (kx1 - kx0);
            if cells > MAX_POOL_TAPS {
                pool_pixel_plain(x, win, kind, [n, oy, ox], o);
                continue;
            }
            let mut t = 0;
            for ky in 0..ky1 - ky0 {
                let iy = iy0 + ky * win.dilation[0];
                for kx in 0..kx1 - kx0 {
                    let ix = ix0 + kx * win.dilation[1];
                    taps[t] = ((n * h + iy) * w + ix) * c;
                    t += 1;
                }
            }
            let taps = &taps[..cells];
            let mut c0 = 0;
            match kind {
                PoolKind::Max => {
                    while c0 + 16 <= c {
                        pool_block::<16, true>(x, taps, c0, 1.0, &mut o[c0..c0 + 16]);
                        c0 += 16;
                    }
                    while c0 < c {
                        pool_block::<1, true>(x, taps, c0, 1.0, &mut o[c0..c0 + 1]);
                        c0 += 1;
                    }
                }
                PoolKind::Average { count_include_pad } => {
                    let count = if count_include_pad {
                        win.padded_cells(0, oy) * win.padded_cells(1, ox)
                    } else {
                        cells
                    };
                    let scale = 1.0 / count.max(1) as f32;
                    while c0 + 16 <= c {
                        pool_block::<16, false>(x, taps, c0, scale, &mut o[c0..c0 + 16]);
                        c0 += 16;
                    }
                    while c0 < c {
                        pool_block::<1, false>(x, taps, c0, scale, &mut o[c0..c0 + 1]);
                        c0 += 1;
                    }
                }
            }
        }
    }
}

/// Window cells a pooled pixel lists its taps for (a 7×7 window; larger ones, rare, take
/// [`pool_pixel_plain`]).
const MAX_POOL_TAPS: usize = 49;

/// Channels `c0..c0 + N` of one pooled pixel from the inputs at `taps` (pixel offsets):
/// the maximum (`MAX`; padding never wins, a NaN does) or the sum times `scale` (the mean),
/// held in registers across the taps and stored once. Inlined into the multiversioned row.
#[inline(always)]
fn pool_block<const N: usize, const MAX: bool>(
    x: &[f32],
    taps: &[usize],
    c0: usize,
    scale: f32,
    o: &mut [MaybeUninit<f32>],
) {
    let mut acc = [if MAX { f32::NEG_INFINITY } else { 0.0 }; N];
    for &t in taps {
        let px = &x[t + c0..][..N];
        for (a, &v) in acc.iter_mut().zip(px) {
            *a = if !MAX {
                *a + v
            } else if v.is_nan() || v > *a {
                v
            } else {
                *a
            };
        }
    }
    for (o, a) in o.iter_mut().zip(acc) {
        *o = MaybeUninit::new(if MAX { a } else { a * scale });
    }
}

/// One pooled pixel of a window with more than [`MAX_POOL_TAPS`] cells, tap by tap.
fn pool_pixel_plain(
    x: &[f32],
    win: &Window2d,
    kind: PoolKind,
    [n, oy, ox]: [usize; 3],
    o: &mut [MaybeUninit<f32>],
) {
    let [_, h, w, c] = win.dims;
    let (ky0, ky1, iy0) = win.valid_taps(0, oy);
    let (kx0, kx1, ix0) = win.valid_taps(1, ox);
    let mut acc = vec![
        if kind == PoolKind::Max {
            f32::NEG_INFINITY
        } else {
            0.0
        };
        c
    ];
    for ky in 0..ky1 - ky0 {
        let iy = iy0 + ky * win.dilation[0];
        for kx in 0..kx1 - kx0 {
            let ix = ix0 + kx * win.dilation[1];
            let px = &x[((n * h + iy) * w + ix) * c..][..c];
            for (a, &v) in acc.iter_mut().zip(px) {
                *a = match kind {
                    PoolKind::Max if v.is_nan() || v > *a => v,
                    PoolKind::Max => *a,
                    PoolKind::Average { .. } => *a + v,
                };
            }
        }
    }
    let scale = match kind {
        PoolKind::Max => 1.0,
        PoolKind::Average {
            count_include_pad: true,
        } => 1.0 / (win.padded_cells(0, oy) * win.padded_cells(1, ox)).max(1) as f32,
        PoolKind::Average { .. } => 1.0 / ((ky1 - ky0) * (kx1 - kx0)).max(1) as f32,
    };
    for (o, a) in o.iter_mut().zip(acc) {
        *o = MaybeUninit::new(a * scale);
    }
}

/// The mean of each image's pixels per channel: `[batch, channels]` from `[batch, h, w,
/// channels]`.
///
/// A large image is summed in parallel over fixed runs of [`MEAN_CHUNK`] values (whole
/// pixels), the partial sums then added in order: the same result on any thread count. On
/// one thread, EfficientNet-B0's squeeze-and-excitation means cost as much as ONNX Runtime's
/// two (BENCHMARKS.md run 40).
pub fn global_average(x: &[f32], [b, h, w, c]: [usize; 4]) -> Vec<f32> {
    assert_eq!(x.len(), b * h * w * c, "global_average input length");
    let mut out = vec![0f32; b * c];
    let plane = h * w * c;
    if c == 0 || plane == 0 {
        return out;
    }
    let chunk = (MEAN_CHUNK / c).max(1) * c;
    for (n, o) in out.chunks_exact_mut(c).enumerate() {
        let image = &x[n * plane..][..plane];
        if plane < PARALLEL_MIN {
            sum_pixels(image, o);
        } else {
            let partial: Vec<Vec<f32>> = image
                .par_chunks(chunk)
                .map(|part| {
                    let mut sums = vec![0f32; c];
                    sum_pixels(part, &mut sums);
                    sums
                })
                .collect();
            for sums in partial {
                o.iter_mut().zip(&sums).for_each(|(o, s)| *o += s);
            }
        }
        let scale = 1.0 / (h * w) as f32;
        o.iter_mut().for_each(|v| *v *= scale);
    }
    out
}

/// Values per parallel task of [`global_average`].
const MEAN_CHUNK: usize = 1 << 15;

multiversion! {
    /// `o += ` the sum of the pixels (rows of `o.len()` values) in `image`.
    fn sum_pixels(image: &[f32], o: &mut [f32]) {
        let c = o.len();
        for px in image.chunks_exact(c) {
            for (o, &v) in o.iter_mut().zip(px) {
                *o += v;
            }
        }
    }
}

/// A depthwise convolution's weight `[channels, 1, kh, kw]` packed tap-major
/// (`[kh·kw][channels]`), with its bias.
#[derive(Debug, Clone)]
pub struct DepthwiseWeights {
    channels: usize,
    kernel: [usize; 2],
    taps: Vec<f32>,
    bias: Vec<f32>,
}

impl DepthwiseWeights {
    /// Packs `weight` `[channels, 1, kh, kw]` and `bias` `[channels]` (zeros without one).
    pub fn pack(channels: usize, kernel: [usize; 2], weight: &[f32], bias: Option<&[f32]>) -> Self {
        let taps_per = kernel[0] * kernel[1];
        assert_eq!(weight.len(), channels * taps_per, "depthwise weight length");
        let mut taps = vec![0f32; weight.len()];
        for ch in 0..channels {
            for t in 0..taps_per {
                taps[t * channels + ch] = weight[ch * taps_per + t];
            }
        }
        let bias = bias.map_or_else(|| vec![0.0; channels], <[f32]>::to_vec);
        assert_eq!(bias.len(), channels, "depthwise bias length");
        DepthwiseWeights {
            channels,
            kernel,
            taps,
            bias,
        }
    }

    /// Channels (input = output).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Kernel height and width.
    pub fn kernel(&self) -> [usize; 2] {
        self.kernel
    }
}

/// Depthwise convolution (one filter per channel) of a channels-last image, bias added and
/// `act` applied: `[batch, oh, ow, channels]`. A ReLU or Clip is applied in the registers
/// before the store; another activation (SiLU, HardSwish, ...) to each output row right
/// after it is computed, while the row is in L1, so no activation is a pass over memory.
pub fn depthwise_conv2d(
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    depthwise_conv2d_on(F32Kernel::detect(), x, win, w, act)
}

/// [`depthwise_conv2d`] with the interior strips of `kernel`'s instruction set (the portable
/// kernel: none, the multiversioned loop throughout), for tests and benchmarks that compare
/// them on one CPU.
///
/// # Panics
/// When the CPU lacks `kernel` ([`F32Kernel::supported`]).
pub fn depthwise_conv2d_on(
    kernel: F32Kernel,
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    let [b, h, wd, c] = win.dims;
    assert_eq!(
        c, w.channels,
        "depthwise weights packed for another channel count"
    );
    assert_eq!(
        win.kernel, w.kernel,
        "depthwise weights packed for another kernel"
    );
    assert_eq!(x.len(), b * h * wd * c, "depthwise input length");
    let [_, oh, ow, _] = win.out_dims();
    let len = b * oh * ow * c;
    if len == 0 {
        return Vec::new();
    }
    let (clamp, after) = Activation::split(act);
    let row = |r: usize, o_row: &mut [f32]| {
        depthwise_row(kernel, x, win, w, clamp, r, o_row);
        if let Some(act) = after {
            activate_slice(o_row, act);
        }
    };
    let work = len * win.kernel[0] * win.kernel[1];
    super::rows_from_zero(len, ow * c, work >= DEPTHWISE_PARALLEL_MACS, row)
}

/// Output row `r` of the depthwise convolution over `win` (as [`depthwise_conv2d`] computes
/// it: bias, taps, `act`) into `o_row`, on the calling thread: for a caller that makes the
/// input rows itself, band by band ([`super::expand_depthwise`]).
pub(crate) fn depthwise_output_row(
    kernel: F32Kernel,
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
    r: usize,
    o_row: &mut [f32],
) {
    let (clamp, after) = Activation::split(act);
    // The row accumulates into its values.
    o_row.fill(0.0);
    depthwise_row(kernel, x, win, w, clamp, r, o_row);
    if let Some(act) = after {
        activate_slice(o_row, act);
    }
}

multiversion! {
    /// Output row `r` (image `r / oh`, row `r mod oh`) of [`depthwise_conv2d`].
    fn depthwise_row(
        kernel: F32Kernel,
        x: &[f32],
        win: &Window2d,
        w: &DepthwiseWeights,
        clamp: Option<[f32; 2]>,
        r: usize,
        o_row: &mut [f32],
    ) {
        let [_, h, wd, c] = win.dims;
        let (oh, kw) = (win.out_len(0), win.kernel[1]);
        let (n, oy) = (r / oh, r % oh);
        let (ky0, ky1, iy0) = win.valid_taps(0, oy);
        let out_w = o_row.len() / c;
        // At stride 1 on x86 the whole row in sliding windows, its border included.
        if win.stride[1] == 1 && win.dilation[1] == 1 && ky1 - ky0 <= MAX_TAPS {
            let mut rows = [(0usize, 0usize); MAX_TAPS];
            for (i, ky) in (ky0..ky1).enumerate() {
                let iy = iy0 + (ky - ky0) * win.dilation[0];
                rows[i] = ((n * h + iy) * wd * c, ky * kw * c);
            }
            let slide = SlideRow {
                x,
                rows: &rows[..ky1 - ky0],
                first_col: -(win.pads[1].0 as isize),
                width: wd,
                kw,
                weights: &w.taps,
                bias: &w.bias,
                channels: c,
                pixels: out_w,
                clamp,
            };
            if depthwise_strip::run_row(kernel, &slide, o_row) {
                return;
            }
        }
        // The row's taps for a pixel whose window lies inside the image's width, as offsets
        // from the window's first input pixel: built once per row, not per pixel (at 32
        // channels the per-pixel build cost as much as the multiply-adds).
        let mut inner = [(0usize, 0usize); MAX_TAPS];
        let inner_count = (ky1 - ky0) * kw;
        if inner_count <= MAX_TAPS {
            let mut t = 0;
            for ky in ky0..ky1 {
                for kx in 0..kw {
                    let dy = (ky - ky0) * win.dilation[0];
                    inner[t] = ((dy * wd + kx * win.dilation[1]) * c, (ky * kw + kx) * c);
                    t += 1;
                }
            }
        }
        let row = DepthwiseRow {
            x,
            w,
            win,
            clamp,
            // Clamped in the registers before the store (no clamp: the whole line).
            bounds: clamp.unwrap_or([f32::NEG_INFINITY, f32::INFINITY]),
            inner: &inner[..inner_count.min(MAX_TAPS)],
            all_inner: inner_count <= MAX_TAPS,
            n,
            oy,
            rows: (ky0, ky1, iy0),
            row_base: (n * h + iy0) * wd,
        };
        // The interior on x86: strips in registers of intrinsics; the border pixels here.
        let (lo, hi) = row.interior_range(out_w);
        if hi > lo {
            let strip = Strip {
                x,
                first: (row.row_base + win.valid_taps(1, lo).2) * c,
                step: win.stride[1] * c,
                taps: row.inner,
                weights: &w.taps,
                bias: &w.bias,
                channels: c,
                pixels: hi - lo,
                clamp,
            };
            if depthwise_strip::run(kernel, &strip, &mut o_row[lo * c..hi * c]) {
                for ox in (0..lo).chain(hi..out_w) {
                    row.pixel(ox, &mut o_row[ox * c..(ox + 1) * c]);
                }
                return;
            }
        }
        if c >= DEPTHWISE_BLOCK {
            for (ox, o) in o_row.chunks_exact_mut(c).enumerate() {
                row.pixel(ox, o);
            }
            return;
        }
        let mut ox = 0;
        while ox < out_w {
            if ox + QUAD <= out_w && row.interior(ox) && row.interior(ox + QUAD - 1) {
                let first = (row.row_base + win.valid_taps(1, ox).2) * c;
                let quad = &mut o_row[ox * c..(ox + QUAD) * c];
                depthwise_quad(x, w, first, win.stride[1] * c, row.inner, row.bounds, quad);
                ox += QUAD;
            } else {
                row.pixel(ox, &mut o_row[ox * c..(ox + 1) * c]);
                ox += 1;
            }
        }
    }
}

/// One output row of [`depthwise_conv2d`] and what its pixels share. Methods, not closures:
/// a closure inside the multiversioned row does not inherit its instruction set (measured:
/// twice the time at 64+ channels).
struct DepthwiseRow<'a> {
    x: &'a [f32],
    w: &'a DepthwiseWeights,
    win: &'a Window2d,
    clamp: Option<[f32; 2]>,
    bounds: [f32; 2],
    /// Taps of a pixel whose window lies inside the image's width, from its first input.
    inner: &'a [(usize, usize)],
    /// Whether `inner` holds every such tap (not past [`MAX_TAPS`]).
    all_inner: bool,
    n: usize,
    oy: usize,
    /// The kernel rows inside the image and the first one's input row.
    rows: (usize, usize, usize),
    /// The first input row's offset in pixels.
    row_base: usize,
}

impl DepthwiseRow<'_> {
    /// Whether output pixel `ox`'s window lies inside the image's width.
    #[inline(always)]
    fn interior(&self, ox: usize) -> bool {
        let (kx0, kx1, _) = self.win.valid_taps(1, ox);
        kx0 == 0 && kx1 == self.win.kernel[1] && self.all_inner
    }

    /// The output pixels `lo..hi` whose windows lie inside the image's width (contiguous:
    /// only the first and last few pixels of a row reach into the padding).
    fn interior_range(&self, out_w: usize) -> (usize, usize) {
        let lo = (0..out_w).find(|&ox| self.interior(ox)).unwrap_or(out_w);
        let hi = (lo..out_w)
            .rev()
            .find(|&ox| self.interior(ox))
            .map_or(lo, |ox| ox + 1);
        (lo, hi)
    }

    /// Output pixel `ox` alone.
    #[inline(always)]
    fn pixel(&self, ox: usize, o: &mut [f32]) {
        let (win, c, kw) = (self.win, self.win.dims[3], self.win.kernel[1]);
        let [_, h, wd, _] = win.dims;
        let (kx0, kx1, ix0) = win.valid_taps(1, ox);
        if kx0 == 0 && kx1 == kw && self.all_inner {
            let base = (self.row_base + ix0) * c;
            return depthwise_pixel(self.x, self.w, base, self.inner, self.bounds, o);
        }
        // A pixel on the left or right border: the taps inside the image.
        let (ky0, ky1, iy0) = self.rows;
        let mut taps = [(0usize, 0usize); MAX_TAPS];
        let mut count = 0;
        for ky in ky0..ky1 {
            let iy = iy0 + (ky - ky0) * win.dilation[0];
            for kx in kx0..kx1 {
                let ix = ix0 + (kx - kx0) * win.dilation[1];
                if count < MAX_TAPS {
                    taps[count] = (((self.n * h + iy) * wd + ix) * c, (ky * kw + kx) * c);
                }
                count += 1;
            }
        }
        if count > MAX_TAPS {
            depthwise_pixel_plain(self.x, self.w, win, (self.n, self.oy, ox), o);
            if let Some([lo, hi]) = self.clamp {
                o.iter_mut().for_each(|v| *v = v.max(lo).min(hi));
            }
        } else {
            depthwise_pixel(self.x, self.w, 0, &taps[..count], self.bounds, o);
        }
    }
}

/// Kernel taps the blocked depthwise loop holds offsets for (7×7, ConvNeXt's, is the
/// largest in the exported families); larger kernels take the plain loop.
const MAX_TAPS: usize = 49;

/// Channels per register block of the depthwise loop: 64 floats are four AVX-512 or eight
/// AVX2 registers of accumulators, kept across all taps (the plain loop reloaded and stored
/// the output at every tap: three loads and a store per multiply-add).
const DEPTHWISE_BLOCK: usize = 64;

/// One output pixel `o` of a depthwise convolution from its `taps` (input offset from
/// `base`, weight offset), clamped to `bounds`: blocks of 64 channels, then of 16, then of 8,
/// then one by one, each block's accumulators held across all taps. Inlined into the
/// multiversioned row.
#[inline(always)]
fn depthwise_pixel(
    x: &[f32],
    w: &DepthwiseWeights,
    base: usize,
    taps: &[(usize, usize)],
    bounds: [f32; 2],
    o: &mut [f32],
) {
    let c = o.len();
    let x = &x[base..];
    let mut c0 = 0;
    while c0 + DEPTHWISE_BLOCK <= c {
        depthwise_block::<DEPTHWISE_BLOCK>(x, w, taps, bounds, o, c0);
        c0 += DEPTHWISE_BLOCK;
    }
    while c0 + 16 <= c {
        depthwise_block::<16>(x, w, taps, bounds, o, c0);
        c0 += 16;
    }
    // MobileNet v3's 72, 88 and 120 channels end in 8: one AVX2 register, not 8 scalars.
    if c0 + 8 <= c {
        depthwise_block::<8>(x, w, taps, bounds, o, c0);
        c0 += 8;
    }
    while c0 < c {
        depthwise_block::<1>(x, w, taps, bounds, o, c0);
        c0 += 1;
    }
}

/// Output pixels the interior loop computes together when there are fewer channels than one
/// [`DEPTHWISE_BLOCK`]: each weight vector loaded once for four pixels (MobileNet v2's
/// 32-channel 112² layer 362 → 324–344 µs; with more channels the 64-wide blocks were
/// faster: 144 channels at 56² 170 → 232 µs in quads).
const QUAD: usize = 4;

/// [`QUAD`] adjacent interior output pixels (`out`, `QUAD · c` values) whose windows start
/// at input offset `first` and `step` apart, from the row's `taps`, clamped to `bounds`:
/// blocks of 16 channels, then of 8, then one by one (four pixels' accumulators of 16 fit
/// the registers of AVX2 as of AVX-512).
#[inline(always)]
fn depthwise_quad(
    x: &[f32],
    w: &DepthwiseWeights,
    first: usize,
    step: usize,
    taps: &[(usize, usize)],
    bounds: [f32; 2],
    out: &mut [f32],
) {
    let c = out.len() / QUAD;
    let bases: [usize; QUAD] = std::array::from_fn(|p| first + p * step);
    let mut c0 = 0;
    while c0 + 16 <= c {
        depthwise_quad_block::<16>(x, w, bases, taps, bounds, out, c0);
        c0 += 16;
    }
    if c0 + 8 <= c {
        depthwise_quad_block::<8>(x, w, bases, taps, bounds, out, c0);
        c0 += 8;
    }
    while c0 < c {
        depthwise_quad_block::<1>(x, w, bases, taps, bounds, out, c0);
        c0 += 1;
    }
}

/// Channels `c0..c0 + B` of [`depthwise_quad`].
#[inline(always)]
fn depthwise_quad_block<const B: usize>(
    x: &[f32],
    w: &DepthwiseWeights,
    bases: [usize; QUAD],
    taps: &[(usize, usize)],
    [lo, hi]: [f32; 2],
    out: &mut [f32],
    c0: usize,
) {
    let c = out.len() / QUAD;
    let mut acc = [[0f32; B]; QUAD];
    for a in &mut acc {
        a.copy_from_slice(&w.bias[c0..c0 + B]);
    }
    for &(xo, wo) in taps {
        let k = &w.taps[wo + c0..][..B];
        for (a, &base) in acc.iter_mut().zip(&bases) {
            let px = &x[base + xo + c0..][..B];
            for i in 0..B {
                a[i] += px[i] * k[i];
            }
        }
    }
    for (p, a) in acc.iter_mut().enumerate() {
        for v in a.iter_mut() {
            *v = v.max(lo).min(hi);
        }
        out[p * c + c0..][..B].copy_from_slice(a);
    }
}

/// Channels `c0..c0 + B` of [`depthwise_pixel`].
#[inline(always)]
fn depthwise_block<const B: usize>(
    x: &[f32],
    w: &DepthwiseWeights,
    taps: &[(usize, usize)],
    [lo, hi]: [f32; 2],
    o: &mut [f32],
    c0: usize,
) {
    let mut acc = [0f32; B];
    acc.copy_from_slice(&w.bias[c0..c0 + B]);
    for &(xo, wo) in taps {
        let px = &x[xo + c0..][..B];
        let k = &w.taps[wo + c0..][..B];
        for i in 0..B {
            acc[i] += px[i] * k[i];
        }
    }
    for v in &mut acc {
        *v = v.max(lo).min(hi);
    }
    o[c0..c0 + B].copy_from_slice(&acc);
}

/// [`depthwise_pixel`] for kernels with more than [`MAX_TAPS`] taps: output pixel `(n, oy,
/// ox)` accumulated in place, tap by tap.
#[inline(always)]
fn depthwise_pixel_plain(
    x: &[f32],
    w: &DepthwiseWeights,
    win: &Window2d,
    (n, oy, ox): (usize, usize, usize),
    o: &mut [f32],
) {
    let [_, h, wd, c] = win.dims;
    let kw = win.kernel[1];
    let (ky0, ky1, iy0) = win.valid_taps(0, oy);
    let (kx0, kx1, ix0) = win.valid_taps(1, ox);
    o.copy_from_slice(&w.bias);
    for ky in ky0..ky1 {
        let iy = iy0 + (ky - ky0) * win.dilation[0];
        for kx in kx0..kx1 {
            let ix = ix0 + (kx - kx0) * win.dilation[1];
            let px = &x[((n * h + iy) * wd + ix) * c..][..c];
            let tap = &w.taps[(ky * kw + kx) * c..][..c];
            for ((o, &v), &k) in o.iter_mut().zip(px).zip(tap) {
                *o += v * k;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::activation::{Activation, activate};
    use crate::kernels::testing::{relative_error, values};

    fn window(dims: [usize; 4], k: usize, s: usize, p: (usize, usize), ceil: bool) -> Window2d {
        Window2d {
            dims,
            kernel: [k, k],
            stride: [s, s],
            dilation: [1, 1],
            pads: [p, p],
            ceil_mode: ceil,
        }
    }

    /// Direct f64 loops over NCHW, the reference every kernel here is checked against.
    fn reference_pool(x: &[f32], win: &Window2d, kind: PoolKind) -> Vec<f64> {
        let [b, h, w, c] = win.dims;
        let [_, oh, ow, _] = win.out_dims();
        let mut out = vec![0f64; b * oh * ow * c];
        for n in 0..b {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ch in 0..c {
                        let (mut acc, mut cells) = (
                            if kind == PoolKind::Max {
                                f64::NEG_INFINITY
                            } else {
                                0.0
                            },
                            0,
                        );
                        for ky in 0..win.kernel[0] {
                            for kx in 0..win.kernel[1] {
                                let iy =
                                    (oy * win.stride[0] + ky) as isize - win.pads[0].0 as isize;
                                let ix =
                                    (ox * win.stride[1] + kx) as isize - win.pads[1].0 as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let v =
                                    x[((n * h + iy as usize) * w + ix as usize) * c + ch] as f64;
                                cells += 1;
                                acc = if kind == PoolKind::Max {
                                    acc.max(v)
                                } else {
                                    acc + v
                                };
                            }
                        }
                        if let PoolKind::Average { count_include_pad } = kind {
                            let count = if count_include_pad {
                                let span = |o: usize, a: usize| {
                                    let start = o * win.stride[a];
                                    let end = (start + win.kernel[a])
                                        .min(win.dims[1 + a] + win.pads[a].0 + win.pads[a].1);
                                    end - start
                                };
                                span(oy, 0) * span(ox, 1)
                            } else {
                                cells
                            };
                            acc /= count as f64;
                        }
                        out[((n * oh + oy) * ow + ox) * c + ch] = acc;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_nan_wins_the_max_pool_of_every_window_it_is_in() {
        // 17 channels: a block of 16 and one alone; the NaN in channel 16, then channel 3.
        for ch in [16, 3] {
            let dims = [1, 5, 5, 17];
            let mut x = values(dims.iter().product(), 4);
            let at = (2 * 5 + 1) * 17 + ch; // pixel (2, 1)
            x[at] = f32::NAN;
            let win = window(dims, 3, 1, (1, 1), false);
            let got = pool2d(&x, &win, PoolKind::Max);
            for (i, v) in got.iter().enumerate() {
                let (p, c) = (i / 17, i % 17);
                let (oy, ox) = (p / 5, p % 5);
                let covers = c == ch && oy.abs_diff(2) <= 1 && ox.abs_diff(1) <= 1;
                assert_eq!(v.is_nan(), covers, "pixel ({oy}, {ox}) channel {c}");
            }
        }
    }

    #[test]
    fn pooling_matches_a_direct_loop_with_pads_and_ceil_mode() {
        for (dims, k, s, p, ceil) in [
            ([1, 112, 112, 64], 3, 2, (1, 1), false), // ResNet's stem pool
            ([2, 13, 13, 24], 3, 2, (0, 0), true),    // SqueezeNet's ceil-mode pool
            ([1, 7, 9, 5], 2, 2, (0, 0), true),
            ([3, 8, 8, 17], 3, 1, (1, 1), false),
            // 81 cells: more than a pixel lists taps for (the tap-by-tap path).
            ([1, 12, 12, 20], 9, 3, (2, 2), true),
        ] {
            let win = window(dims, k, s, p, ceil);
            let x = values(dims.iter().product(), 3);
            for kind in [
                PoolKind::Max,
                PoolKind::Average {
                    count_include_pad: false,
                },
                PoolKind::Average {
                    count_include_pad: true,
                },
            ] {
                let got = pool2d(&x, &win, kind);
                let want = reference_pool(&x, &win, kind);
                assert!(
                    relative_error(&got, &want) < 1e-6,
                    "{dims:?} k{k} s{s} {kind:?}"
                );
            }
        }
    }

    #[test]
    fn depthwise_matches_a_direct_loop() {
        for (dims, k, s, p) in [
            ([1, 28, 28, 144], 3, 1, (1, 1)),
            ([2, 15, 15, 40], 5, 2, (2, 2)),
            ([1, 9, 9, 7], 3, 2, (1, 1)),
            ([1, 10, 10, 93], 3, 1, (1, 1)), // every block: 64 + 16 + 8 + 5 single channels
            ([2, 13, 13, 27], 3, 1, (1, 1)), // quads of 16 + 8 + 3 channels, and single pixels
            ([1, 14, 14, 200], 7, 1, (3, 3)), // ConvNeXt's 7×7: 3 blocks + 8 channels
            ([1, 12, 12, 70], 9, 1, (4, 4)), // past MAX_TAPS: the plain loop
            ([1, 30, 30, 11], 3, 1, (1, 1)), // strips of 8, 4 and 1 pixels under one mask
            // Sliding-window strips (stride 1): 5×5 over 2 strips of 8 and a 4; 7×7 with
            // strips of 8, 4 and single pixels, 2 images, a masked last channel block.
            ([1, 24, 24, 24], 5, 1, (2, 2)),
            ([2, 21, 21, 17], 7, 1, (3, 3)),
        ] {
            let win = window(dims, k, s, p, false);
            let c = dims[3];
            let x = values(dims.iter().product(), 5);
            let wt = values(c * k * k, 6);
            let bias = values(c, 7);
            let packed = DepthwiseWeights::pack(c, [k, k], &wt, Some(&bias));
            // In registers (ReLU, Clip) and per row after it (SiLU, HardSwish).
            for act in [
                None,
                Some(Activation::Relu),
                Some(Activation::Clip(-0.5, 0.5)),
                Some(Activation::Silu),
                Some(Activation::HardSwish),
            ] {
                let got = depthwise_conv2d(&x, &win, &packed, act);
                let [b, h, w, _] = dims;
                let [_, oh, ow, _] = win.out_dims();
                let mut want = vec![0f64; got.len()];
                for n in 0..b {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            for ch in 0..c {
                                let mut acc = bias[ch] as f64;
                                for ky in 0..k {
                                    for kx in 0..k {
                                        let iy = (oy * s + ky) as isize - p.0 as isize;
                                        let ix = (ox * s + kx) as isize - p.0 as isize;
                                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize
                                        {
                                            continue;
                                        }
                                        acc += x[((n * h + iy as usize) * w + ix as usize) * c + ch]
                                            as f64
                                            * wt[(ch * k + ky) * k + kx] as f64;
                                    }
                                }
                                want[((n * oh + oy) * ow + ox) * c + ch] =
                                    act.map_or(acc, |a| a.reference(acc));
                            }
                        }
                    }
                }
                assert!(relative_error(&got, &want) < 1e-5, "{dims:?} k{k} {act:?}");
                // Each instruction set's interior strips, and the portable loop alone.
                for kernel in F32Kernel::all_supported() {
                    let got = depthwise_conv2d_on(kernel, &x, &win, &packed, act);
                    assert!(
                        relative_error(&got, &want) < 1e-5,
                        "{} {dims:?} k{k} {act:?}",
                        kernel.name()
                    );
                }
            }
        }
    }

    #[test]
    fn transposes_invert_each_other_and_match_the_definition() {
        for dims in [
            [2, 3, 5, 7],
            [1, 64, 56, 56],
            // Whole 16×16 blocks (in 8×8 registers) beside partial ones on both axes.
            [2, 40, 9, 7],
            [2, 24, 33, 3],
            [3, 17, 4, 1],
            [1, 1, 3, 3],
            // Few channels (an RGB or a 2- or 4-channel input): the gathering path, parallel
            // at 224² with a partial last task.
            [1, 3, 224, 224],
            [2, 4, 9, 11],
            [3, 2, 1, 5],
        ] {
            let [b, c, h, w] = dims;
            let x = values(b * c * h * w, 1);
            let nhwc = nchw_to_nhwc(&x, dims);
            for n in 0..b {
                for ch in 0..c {
                    for p in 0..h * w {
                        assert_eq!(nhwc[(n * h * w + p) * c + ch], x[(n * c + ch) * h * w + p]);
                    }
                }
            }
            assert_eq!(nhwc_to_nchw(&nhwc, [b, h, w, c]), x);
        }
    }

    #[test]
    fn activations_and_arithmetic_match_their_definitions() {
        let x = values(40_000, 2);
        for act in [
            Activation::Relu,
            Activation::Clip(0.0, 6.0),
            Activation::HardSigmoid(0.2, 0.5),
            Activation::HardSwish,
            Activation::Sigmoid,
            Activation::Silu,
            Activation::Gelu,
        ] {
            let mut got = x.clone();
            activate(&mut got, act);
            let want: Vec<f64> = x.iter().map(|&v| act.reference(v as f64)).collect();
            assert!(relative_error(&got, &want) < 1e-6, "{act:?}");
        }
        let y = values(40_000, 3);
        for op in [Arith::Add, Arith::Sub, Arith::Mul, Arith::Div] {
            let mut got = x.clone();
            arith_in_place(&mut got, &y, op, true);
            let want: Vec<f64> = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| {
                    let (a, b) = (a as f64, b as f64);
                    match op {
                        Arith::Add => a + b,
                        Arith::Sub => a - b,
                        Arith::Mul => a * b,
                        Arith::Div => a / b,
                    }
                    .max(0.0)
                })
                .collect();
            assert!(relative_error(&got, &want) < 1e-6, "{op:?}");
        }
        // A gate per (image, channel) over 2 images of 10×10 pixels × 200 channels.
        let gate = values(2 * 200, 4);
        let mut got = x.clone();
        arith_channels_in_place(&mut got, &gate, [100, 200], Arith::Mul, false);
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * gate[(i / 20_000) * 200 + i % 200] as f64)
            .collect();
        assert!(relative_error(&got, &want) < 1e-6);
    }

    #[test]
    fn scale_shift_is_per_channel() {
        let (c, pixels) = (37, 1000);
        let x = values(c * pixels, 9);
        let (a, b) = (values(c, 10), values(c, 11));
        let mut got = x.clone();
        scale_shift_in_place(&mut got, &a, &b, None);
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * a[i % c] as f64 + b[i % c] as f64)
            .collect();
        assert!(relative_error(&got, &want) < 1e-6);
        // Into a new vector: the same values, the input untouched.
        assert_eq!(scale_shift_new(&x, &a, &b, None), got);
    }

    #[test]
    fn scale_shift_with_a_fused_clamp_matches_the_two_passes_in_place_or_new() {
        // Above PARALLEL_MIN values, so the chunked parallel paths run too.
        for (c, pixels) in [(37, 100), (64, 4096)] {
            let x = values(c * pixels, 12);
            let (a, b) = (values(c, 13), values(c, 14));
            for bounds in [[0.0, f32::INFINITY], [0.0, 6.0]] {
                let mut want = x.clone();
                scale_shift_in_place(&mut want, &a, &b, None);
                want.iter_mut()
                    .for_each(|v| *v = v.clamp(bounds[0], bounds[1]));
                let mut got = x.clone();
                scale_shift_in_place(&mut got, &a, &b, Some(bounds));
                assert_eq!(got, want, "in place, {c} channels, {bounds:?}");
                let new = scale_shift_new(&x, &a, &b, Some(bounds));
                assert_eq!(new, want, "new, {c} channels, {bounds:?}");
            }
        }
    }

    #[test]
    fn global_average_is_the_mean_per_channel() {
        // A small image (summed on the calling thread) and a large one (in parallel parts).
        for [b, h, w, c] in [[2, 7, 7, 12], [2, 56, 56, 48]] {
            let x = values(b * h * w * c, 8);
            let got = global_average(&x, [b, h, w, c]);
            let want: Vec<f64> = (0..b * c)
                .map(|i| {
                    let (n, ch) = (i / c, i % c);
                    (0..h * w)
                        .map(|p| x[(n * h * w + p) * c + ch] as f64)
                        .sum::<f64>()
                        / (h * w) as f64
                })
                .collect();
            assert!(relative_error(&got, &want) < 1e-5, "{h}×{w}×{c}");
            // The parts are fixed, not per thread: one thread gives the same bits.
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_eq!(one.install(|| global_average(&x, [b, h, w, c])), got);
        }
    }
}
