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

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ops::Range;

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// Shape of one convolution: `[batch, cin, h, w]` input, `[cout, cin, kh, kw]` weight, no groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub cout: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (rows, columns).
    pub stride: [usize; 2],
    /// Padding before and after, per spatial dimension: `[(top, bottom), (left, right)]`.
    pub padding: [(usize, usize); 2],
    /// Dilation (rows, columns).
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// Output height.
    pub fn out_h(&self) -> usize {
        out_len(
            self.h,
            self.kh,
            self.stride[0],
            self.padding[0],
            self.dilation[0],
        )
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        out_len(
            self.w,
            self.kw,
            self.stride[1],
            self.padding[1],
            self.dilation[1],
        )
    }

    /// Rows of the unfolded matrix: `cin · kh · kw`.
    fn k(&self) -> usize {
        self.cin * self.kh * self.kw
    }

    /// Output pixels per channel: `oh · ow`.
    fn pixels(&self) -> usize {
        self.out_h() * self.out_w()
    }

    fn image_len(&self) -> usize {
        self.cin * self.h * self.w
    }

    /// Elements of the weight.
    pub fn weight_len(&self) -> usize {
        self.cout * self.k()
    }

    /// Elements of the output.
    pub fn output_len(&self) -> usize {
        self.batch * self.cout * self.pixels()
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.batch * self.image_len()
    }

    /// A 1×1 kernel with stride 1 and no padding reads the image as its own unfolded matrix.
    fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == [1, 1] && self.padding == [(0, 0), (0, 0)]
    }

    /// At stride 1 the input gradient is itself a forward convolution: of `dout` by the
    /// weight with its taps flipped and its channel axes swapped ([`flip_transposed`]),
    /// padded by `dilation·(k−1) − pad` on each side. This is that convolution's shape, or
    /// `None` where it does not apply (a stride, padding wider than the kernel's reach, a
    /// kernel that reads padding only, or fewer than [`FLIPPED_MIN_CIN`] input channels).
    ///
    /// Why: as `dcols = Wᵀ · dout` the GEMM's inner dimension is `cout` (64 in ResNet's
    /// first stage) and writes a `cin·kh·kw`-row matrix that `col2im` then scatter-adds back;
    /// as a forward the inner dimension is `cout·kh·kw` and the registers accumulate the
    /// whole sum. W5's 512-channel 4×4 layer (batch 64, 2 threads, 3 alternated runs): 30–39
    /// ms the first way, 21–26 ms as a forward; the 128- and 256-channel layers 5–10% faster,
    /// the 64-channel layer within noise (BENCHMARKS.md run 38).
    fn input_grad_as_forward(&self) -> Option<ConvShape> {
        if self.stride != [1, 1] || self.cin < FLIPPED_MIN_CIN {
            return None;
        }
        let flipped = |dim: usize| -> Option<(usize, usize)> {
            let (reach, (lo, hi)) = (
                self.dilation[dim] * ([self.kh, self.kw][dim] - 1),
                self.padding[dim],
            );
            let len = [self.h, self.w][dim];
            (lo <= reach && hi <= reach && len + lo + hi > reach).then(|| (reach - lo, reach - hi))
        };
        Some(ConvShape {
            cin: self.cout,
            h: self.out_h(),
            w: self.out_w(),
            cout: self.cin,
            padding: [flipped(0)?, flipped(1)?],
            ..*self
        })
    }
}

/// Input channels below which the input gradient stays `dcols = Wᵀ · dout`: they are the
/// forward form's output rows, and a GEMM with few rows wastes its register tile — W5's stem
/// (3 → 64 channels) took 1.3 ms the first way and 7.2 as a forward.
const FLIPPED_MIN_CIN: usize = 16;

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
    super::filled(weight.len(), |flipped| {
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

/// Output length of one spatial dimension.
pub(super) fn out_len(
    len: usize,
    k: usize,
    stride: usize,
    pad: (usize, usize),
    dilation: usize,
) -> usize {
    let span = dilation * (k - 1) + 1;
    (len + pad.0 + pad.1).saturating_sub(span) / stride + 1
}

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

/// Row-major `dst[m×n] (+)= lhs · rhs`, with `lhs` element `(i, j)` at `lhs[i·lrs + j·lcs]` and
/// `rhs` element `(i, j)` at `rhs[i·rrs + j·rcs]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    dims: (usize, usize, usize),
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    threads: usize,
) {
    assert!(dst.len() >= dims.0 * dims.1, "matmul destination too small");
    // SAFETY: `dst` holds m × n initialized values (so reading them to accumulate is fine) and
    // is a unique borrow.
    unsafe {
        gemm_raw(
            dims,
            dst.as_mut_ptr(),
            accumulate,
            (lhs, lhs_strides),
            (rhs, rhs_strides),
            threads,
        )
    }
}

/// [`matmul`] without accumulating into a destination that need not be initialized: the GEMM
/// writes every one of its `m × n` values without reading them.
pub(super) fn matmul_fresh(
    dims: (usize, usize, usize),
    dst: &mut [MaybeUninit<f32>],
    lhs: (&[f32], (usize, usize)),
    rhs: (&[f32], (usize, usize)),
    threads: usize,
) {
    let (m, n, k) = dims;
    assert!(dst.len() >= m * n, "matmul destination too small");
    if k == 0 {
        // An empty sum: zeros (the GEMM would not need to touch `dst` at all).
        dst[..m * n].fill(MaybeUninit::new(0.0));
        return;
    }
    // SAFETY: `dst` holds m × n values and is a unique borrow; without `accumulate` the GEMM
    // only writes them.
    unsafe { gemm_raw(dims, dst.as_mut_ptr().cast(), false, lhs, rhs, threads) }
}

/// The GEMM behind [`matmul`] and [`matmul_fresh`].
///
/// # Safety
/// `dst` is valid for writes of `m × n` values (and reads, initialized, with `accumulate`) and
/// aliases neither operand.
unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    accumulate: bool,
    (lhs, (lrs, lcs)): (&[f32], (usize, usize)),
    (rhs, (rrs, rcs)): (&[f32], (usize, usize)),
    threads: usize,
) {
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lrs + (k - 1) * lcs);
    assert!(k == 0 || n == 0 || rhs.len() > (k - 1) * rrs + (n - 1) * rcs);
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above keep every index the GEMM reads inside the operands, and the
    // caller vouches for `dst`.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Threads to use: rayon's pool size.
pub(super) fn pool_threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Scratch buffers of one thread: the unfolded images and a group's output (gradient)
/// gathered into one matrix.
#[derive(Default)]
struct Scratch {
    cols: Vec<f32>,
    staged: Vec<f32>,
}

thread_local! {
    /// This thread's scratch, kept between calls (a few MB: W5's largest unfolded group is
    /// 2.4 MB), so a call neither allocates nor zero-fills its buffers again (every value a
    /// call reads it has written). No step-time change on W5 was measurable (BENCHMARKS.md
    /// run 32); the page zeroing seen in `perf` was the working set's first touch.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's [`SCRATCH`], or with fresh buffers when it is already in use
/// (a nested call: a GEMM's worker thread that picked up another convolution).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut Scratch::default()),
    })
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

/// Runs `run` on each group's (input, output) pair with scratch buffers: one group per
/// parallel task (scratch per thread) when `parallel`, else in order with one scratch (each
/// GEMM then uses every thread).
fn per_group<'a, O: Send>(
    pairs: impl Iterator<Item = (&'a [f32], O)>,
    parallel: bool,
    run: impl Fn(&mut Scratch, (&'a [f32], O)) + Send + Sync,
) {
    if parallel {
        pairs
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(|pair| with_scratch(|scratch| run(scratch, pair)));
    } else {
        with_scratch(|scratch| pairs.for_each(|pair| run(scratch, pair)));
    }
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

/// Checks a forward's operand lengths: `(k, pixels)`, or `None` when there is nothing to
/// compute.
fn check_forward(s: &ConvShape, x: &[f32], weight: &[f32], out: usize) -> Option<(usize, usize)> {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(out, s.output_len(), "conv2d output length");
    let (k, p) = (s.k(), s.pixels());
    (s.cout * p != 0 && s.batch != 0).then_some((k, p))
}

/// Forward convolution: `out` `[batch, cout, oh, ow]` from `x` `[batch, cin, h, w]`, `weight`
/// `[cout, cin, kh, kw]` and an optional `bias` `[cout]`.
pub fn conv2d_forward(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    forward_into(s, x, weight, bias, super::as_uninit(out));
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
    super::filled(s.output_len(), |out| forward_into(s, x, weight, bias, out))
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
    if super::winograd::applies_nchw(s) {
        super::winograd::conv2d_nchw(s, x, weight, bias, out);
    } else if super::direct::applies(s) {
        super::direct::conv2d_direct(s, x, weight, bias, out);
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
            add_bias(unsafe { super::assume_init(out) }, bias, n);
        } else {
            scratch.staged.resize(s.cout * n, 0.0);
            product(super::as_uninit(&mut scratch.staged));
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

/// A convolution's weight `[cout, cin, kh, kw]` reordered for [`conv2d_nhwc_forward`]:
/// `[kh·kw·cin, cout]`, row `(ky, kx, c)`, so each output pixel is one row of patches times
/// this matrix.
pub fn pack_weight_for_nhwc([cout, cin, kh, kw]: [usize; 4], weight: &[f32]) -> Vec<f32> {
    assert_eq!(weight.len(), cout * cin * kh * kw, "conv2d weight length");
    let mut packed = vec![0f32; weight.len()];
    for o in 0..cout {
        for c in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    let from = ((o * cin + c) * kh + ky) * kw + kx;
                    let to = ((ky * kw + kx) * cin + c) * cout + o;
                    packed[to] = weight[from];
                }
            }
        }
    }
    packed
}

/// Gathers output pixels `rows` of one channels-last image `[h, w, cin]` into `patches`
/// `[rows.len(), kh·kw·cin]` (zeros where the kernel reads padding): each kernel tap copies a
/// run of `cin` contiguous values.
fn nhwc_patches(s: &ConvShape, image: &[f32], rows: Range<usize>, patches: &mut [f32]) {
    let (ow, cin, k) = (s.out_w(), s.cin, s.k());
    for (pixel, row) in rows.zip(patches.chunks_exact_mut(k)) {
        let (oy, ox) = (pixel / ow, pixel % ow);
        for ky in 0..s.kh {
            let iy = (oy * s.stride[0] + ky * s.dilation[0]) as isize - s.padding[0].0 as isize;
            for kx in 0..s.kw {
                let ix = (ox * s.stride[1] + kx * s.dilation[1]) as isize - s.padding[1].0 as isize;
                let dst = &mut row[(ky * s.kw + kx) * cin..][..cin];
                if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                    dst.fill(0.0);
                } else {
                    let at = (iy as usize * s.w + ix as usize) * cin;
                    dst.copy_from_slice(&image[at..at + cin]);
                }
            }
        }
    }
}

/// Multiply-adds per image above which one image's channels-last convolution is split over
/// the threads by output pixels (each task gathers and multiplies its own rows; one fork-join
/// per image instead of the GEMM's own synchronization). W3's conv2 (10.6 M) is split; its
/// conv1 (0.2 M) is not.
const SPLIT_MACS: usize = 2 << 20;

/// What one channels-last convolution computes: the operands of [`conv2d_nhwc_forward`].
struct NhwcOperands<'a> {
    s: &'a ConvShape,
    packed: &'a [f32],
    bias: Option<&'a [f32]>,
    relu: bool,
}

impl NhwcOperands<'_> {
    /// Output pixels `rows` of one image into `out` `[rows.len(), cout]`, on this thread.
    fn rows(&self, image: &[f32], rows: Range<usize>, out: &mut [f32], patches: &mut Vec<f32>) {
        let (s, k, n) = (self.s, self.s.k(), rows.len());
        let accumulate = match self.bias {
            Some(b) => {
                for px in out.chunks_exact_mut(s.cout) {
                    px.copy_from_slice(b);
                }
                true
            }
            None => false,
        };
        let lhs: &[f32] = if s.is_pointwise() {
            &image[rows.start * k..rows.end * k]
        } else {
            patches.resize(n * k, 0.0);
            nhwc_patches(s, image, rows, patches);
            patches
        };
        matmul(
            (n, s.cout, k),
            out,
            accumulate,
            lhs,
            (k, 1),
            self.packed,
            (s.cout, 1),
            1,
        );
        if self.relu {
            for v in out.iter_mut() {
                *v = v.max(0.0);
            }
        }
    }
}

/// Forward convolution for inference in channels-last layout: `out` `[batch, oh, ow, cout]`
/// from `x` `[batch, h, w, cin]` and `packed` ([`pack_weight_for_nhwc`]), the bias as the
/// GEMM's initial value and, with `relu`, ReLU applied to each block of output right after its
/// GEMM, while it is still in cache (one pass fewer over memory than a separate op).
///
/// Why channels-last: the GEMM's output rows are pixels, so it is written in the layout the
/// next convolution, pooling and int8 layers read without a transpose, the patch gather
/// copies whole channel runs instead of single values (a 1×1 convolution reads the image as
/// is), and an image splits over the threads by output pixels, each task gathering only its
/// own rows.
pub fn conv2d_nhwc_forward(
    s: &ConvShape,
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    relu: bool,
    out: &mut [f32],
) {
    let Some((k, p)) = check_forward(s, x, packed, out.len()) else {
        return;
    };
    let ops = NhwcOperands {
        s,
        packed,
        bias,
        relu,
    };
    let image_out = s.cout * p;
    let threads = pool_threads();
    let images = x
        .chunks_exact(s.image_len())
        .zip(out.chunks_exact_mut(image_out));
    // Enough images for every thread, or a small one: each image whole, on one thread.
    if s.batch >= threads || image_out * k < SPLIT_MACS {
        per_group(images, s.batch >= threads, |scratch, (image, out)| {
            ops.rows(image, 0..p, out, &mut scratch.cols)
        });
        return;
    }
    let per_task = p.div_ceil(threads);
    for (image, out) in images {
        out.par_chunks_mut(per_task * s.cout)
            .enumerate()
            .for_each_init(Vec::new, |patches, (t, out)| {
                let start = t * per_task;
                ops.rows(image, start..start + out.len() / s.cout, out, patches)
            });
    }
}

/// Gradient of the input: `dx` `[batch, cin, h, w]` from the output gradient `dout`
/// `[batch, cout, oh, ow]` and `weight`.
pub fn conv2d_input_grad(s: &ConvShape, dout: &[f32], weight: &[f32], dx: &mut [f32]) {
    input_grad_into(s, dout, weight, super::as_uninit(dx));
}

/// [`conv2d_input_grad`] into a new vector, not zero-filled first where the gradient is a
/// flipped forward convolution (see [`conv2d_forward_new`]; the unfold path adds into a
/// zeroed `dx`).
pub fn conv2d_input_grad_new(s: &ConvShape, dout: &[f32], weight: &[f32]) -> Vec<f32> {
    super::filled(s.input_len(), |dx| input_grad_into(s, dout, weight, dx))
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
    input_grad_unfolded(s, dout, weight, unsafe { super::assume_init(dx) });
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
    if super::winograd::applies_weight_grad(s) {
        super::winograd::weight_grad_nchw(s, x, dout, dweight);
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
mod tests {
    use super::*;
    use crate::kernels::testing::{relative_error, values};

    /// Direct f64 convolution: the reference every kernel result is checked against.
    /// Calls `f(output index, input index, weight index)` for every kernel tap that reads
    /// inside the image: the direct convolution both references are built from.
    fn for_each_tap(s: &ConvShape, mut f: impl FnMut(usize, usize, usize)) {
        let (oh, ow) = (s.out_h(), s.out_w());
        for n in 0..s.batch {
            for co in 0..s.cout {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let oi = ((n * s.cout + co) * oh + oy) * ow + ox;
                        for c in 0..s.cin {
                            for ki in 0..s.kh {
                                for kj in 0..s.kw {
                                    let iy = (oy * s.stride[0] + ki * s.dilation[0]) as isize
                                        - s.padding[0].0 as isize;
                                    let ix = (ox * s.stride[1] + kj * s.dilation[1]) as isize
                                        - s.padding[1].0 as isize;
                                    if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize
                                    {
                                        continue;
                                    }
                                    let xi =
                                        ((n * s.cin + c) * s.h + iy as usize) * s.w + ix as usize;
                                    f(oi, xi, ((co * s.cin + c) * s.kh + ki) * s.kw + kj);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Direct f64 convolution: the reference every kernel result is checked against.
    fn reference_forward(s: &ConvShape, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
        let p = s.out_h() * s.out_w();
        let mut out: Vec<f64> = (0..s.output_len())
            .map(|oi| b.map_or(0.0, |b| b[(oi / p) % s.cout] as f64))
            .collect();
        for_each_tap(s, |oi, xi, wi| out[oi] += x[xi] as f64 * w[wi] as f64);
        out
    }

    /// f64 gradients of `Σ out · g` with respect to x and w, by the same direct loops.
    fn reference_grads(s: &ConvShape, x: &[f32], w: &[f32], g: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let mut dx = vec![0f64; s.input_len()];
        let mut dw = vec![0f64; s.weight_len()];
        for_each_tap(s, |oi, xi, wi| {
            dx[xi] += g[oi] as f64 * w[wi] as f64;
            dw[wi] += g[oi] as f64 * x[xi] as f64;
        });
        (dx, dw)
    }

    fn shapes() -> Vec<ConvShape> {
        let base = ConvShape {
            batch: 3,
            cin: 4,
            h: 9,
            w: 8,
            cout: 5,
            kh: 3,
            kw: 3,
            stride: [1, 1],
            padding: [(0, 0), (0, 0)],
            dilation: [1, 1],
        };
        vec![
            base,
            // W3's conv2 at batch 1 (multi-threaded GEMM path).
            ConvShape {
                batch: 1,
                cin: 32,
                h: 26,
                w: 26,
                cout: 64,
                ..base
            },
            // ResNet's padded, strided 3×3 and its 1×1 shortcut.
            ConvShape {
                stride: [2, 2],
                padding: [(1, 1), (1, 1)],
                ..base
            },
            ConvShape {
                kh: 1,
                kw: 1,
                ..base
            },
            ConvShape {
                kh: 1,
                kw: 1,
                stride: [2, 2],
                ..base
            },
            // Asymmetric padding, dilation, non-square everything.
            ConvShape {
                kh: 2,
                kw: 3,
                stride: [1, 2],
                padding: [(0, 1), (2, 0)],
                dilation: [2, 1],
                ..base
            },
            // `same` padding at stride 1 (the contiguous unfold), also dilated and with a
            // kernel taller than the image.
            ConvShape {
                padding: [(1, 1), (1, 1)],
                ..base
            },
            ConvShape {
                kh: 3,
                kw: 5,
                padding: [(4, 0), (4, 4)],
                dilation: [2, 2],
                ..base
            },
            ConvShape {
                h: 2,
                w: 3,
                kh: 5,
                kw: 3,
                padding: [(2, 2), (1, 1)],
                ..base
            },
            // A kernel wider than the padded input leaves whole rows of padding only.
            ConvShape {
                h: 3,
                w: 2,
                kh: 3,
                kw: 3,
                padding: [(2, 2), (2, 2)],
                ..base
            },
        ]
    }

    /// The seeded input, weight and bias of shape `i` of [`shapes`].
    fn operands(s: &ConvShape, i: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let i = i as u64;
        let x = values(s.input_len(), 1 + i);
        let w = values(s.weight_len(), 100 + i);
        (x, w, values(s.cout, 200 + i))
    }

    /// `[batch, c, h, w]` values as `[batch, h, w, c]`.
    fn to_nhwc(x: &[f32], [b, c, h, w]: [usize; 4]) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        for n in 0..b {
            for ch in 0..c {
                for p in 0..h * w {
                    y[(n * h * w + p) * c + ch] = x[(n * c + ch) * h * w + p];
                }
            }
        }
        y
    }

    #[test]
    fn channels_last_forward_with_fused_relu_matches_an_f64_reference() {
        for (i, s) in shapes().into_iter().enumerate() {
            let (x, w, b) = operands(&s, i);
            let x_nhwc = to_nhwc(&x, [s.batch, s.cin, s.h, s.w]);
            let packed = pack_weight_for_nhwc([s.cout, s.cin, s.kh, s.kw], &w);
            let dims = [s.batch, s.cout, s.out_h(), s.out_w()];
            for (bias, relu) in [(Some(&b[..]), false), (None, false), (Some(&b[..]), true)] {
                let mut out = vec![f32::NAN; s.output_len()];
                conv2d_nhwc_forward(&s, &x_nhwc, &packed, bias, relu, &mut out);
                let want: Vec<f64> = reference_forward(&s, &x, &w, bias)
                    .into_iter()
                    .map(|v| if relu { v.max(0.0) } else { v })
                    .collect();
                let want_f32: Vec<f32> = want.iter().map(|v| *v as f32).collect();
                let want_nhwc: Vec<f64> =
                    to_nhwc(&want_f32, dims).iter().map(|v| *v as f64).collect();
                let err = relative_error(&out, &want_nhwc);
                assert!(
                    err <= 1e-5,
                    "shape {i} {s:?} bias {} relu {relu}: error {err:e}",
                    bias.is_some()
                );
            }
        }
    }

    #[test]
    fn forward_and_gradients_match_an_f64_reference() {
        for (i, s) in shapes().into_iter().enumerate() {
            let (x, w, b) = operands(&s, i);
            let g = values(s.output_len(), 300 + i as u64);

            let mut out = vec![f32::NAN; s.output_len()];
            conv2d_forward(&s, &x, &w, Some(&b), &mut out);
            let want = reference_forward(&s, &x, &w, Some(&b));
            let err = relative_error(&out, &want);
            assert!(err <= 1e-5, "shape {i} {s:?}: forward error {err:e}");
            // Into a fresh, unfilled vector: the same values, every one written.
            let fresh = conv2d_forward_new(&s, &x, &w, Some(&b));
            assert_eq!(fresh, out, "shape {i}: forward into a new vector");

            conv2d_forward(&s, &x, &w, None, &mut out);
            let want = reference_forward(&s, &x, &w, None);
            let err = relative_error(&out, &want);
            assert!(err <= 1e-5, "shape {i}: forward without bias error {err:e}");

            let (want_dx, want_dw) = reference_grads(&s, &x, &w, &g);
            let mut dx = vec![f32::NAN; s.input_len()];
            conv2d_input_grad(&s, &g, &w, &mut dx);
            let err = relative_error(&dx, &want_dx);
            assert!(err <= 1e-5, "shape {i}: input-gradient error {err:e}");
            let fresh = conv2d_input_grad_new(&s, &g, &w);
            assert_eq!(fresh, dx, "shape {i}: input gradient into a new vector");
            let mut dw = vec![f32::NAN; s.weight_len()];
            conv2d_weight_grad(&s, &x, &g, &mut dw);
            let err = relative_error(&dw, &want_dw);
            assert!(err <= 1e-5, "shape {i}: weight-gradient error {err:e}");
        }
    }

    /// The GEMM forward on every shape, also those the direct kernel takes on this CPU (so
    /// the path AVX2 CPUs run for them stays tested on an AVX-512 machine).
    #[test]
    fn the_gemm_forward_matches_an_f64_reference_on_every_shape() {
        for (i, s) in shapes().into_iter().enumerate() {
            let (x, w, b) = operands(&s, i);
            let mut out = vec![f32::NAN; s.output_len()];
            let dims = check_forward(&s, &x, &w, out.len()).expect("a nonempty shape");
            forward_gemm(
                &s,
                (&x, &w, Some(&b)),
                dims,
                super::super::as_uninit(&mut out),
            );
            let err = relative_error(&out, &reference_forward(&s, &x, &w, Some(&b)));
            assert!(err <= 1e-5, "shape {i} {s:?}: GEMM forward error {err:e}");
        }
    }

    #[test]
    fn input_gradient_as_a_flipped_forward_matches_an_f64_reference() {
        let mut flipped = 0;
        let mut cases = shapes();
        // Padding wider than a 1×1 kernel's reach: rows of the output read padding only.
        cases.push(ConvShape {
            kh: 1,
            kw: 1,
            padding: [(1, 1), (1, 0)],
            ..cases[0]
        });
        for (i, s) in cases.into_iter().enumerate() {
            let s = ConvShape {
                cin: FLIPPED_MIN_CIN,
                ..s
            };
            flipped += usize::from(s.input_grad_as_forward().is_some());
            let x = values(s.input_len(), 1 + i as u64);
            let w = values(s.weight_len(), 100 + i as u64);
            let g = values(s.output_len(), 300 + i as u64);
            let (want_dx, _) = reference_grads(&s, &x, &w, &g);
            let mut dx = vec![f32::NAN; s.input_len()];
            conv2d_input_grad(&s, &g, &w, &mut dx);
            let err = relative_error(&dx, &want_dx);
            assert!(err <= 1e-5, "shape {i} {s:?}: input-gradient error {err:e}");
            assert_eq!(
                conv2d_input_grad_new(&s, &g, &w),
                dx,
                "shape {i}: into a new vector"
            );
        }
        // Every stride-1 shape but the one whose padding is wider than the kernel's reach.
        assert_eq!(flipped, 7, "shapes taking the flipped forward");
    }

    /// A late ResNet stage: 4×4 images (grouped several per GEMM) and a weight large enough
    /// for the weight gradient to be split by input channels.
    fn late_stage() -> ConvShape {
        ConvShape {
            batch: 5,
            cin: 64,
            h: 4,
            w: 4,
            cout: 512,
            padding: [(1, 1), (1, 1)],
            ..shapes()[0]
        }
    }

    #[test]
    fn grouped_images_and_channel_split_match_an_f64_reference_on_any_thread_count() {
        // A 3×3 layer (its parts are stored transposed, `k > cout`) and a 1×1 layer with as
        // many outputs as inputs (stored as they are): both placed over several blocks of
        // output channels.
        let pointwise = ConvShape {
            cin: 512,
            kh: 1,
            kw: 1,
            padding: [(0, 0), (0, 0)],
            ..late_stage()
        };
        for s in [late_stage(), pointwise] {
            channel_split_matches_an_f64_reference(&s);
        }
    }

    fn channel_split_matches_an_f64_reference(s: &ConvShape) {
        let s = *s;
        assert!(
            s.weight_len() >= SPLIT_WEIGHT && s.cout > PLACE_ROWS,
            "the shape must take the channel split and place several blocks"
        );
        let x = values(s.input_len(), 7);
        let w = values(s.weight_len(), 8);
        let g = values(s.output_len(), 9);
        let want_out = reference_forward(&s, &x, &w, None);
        let (want_dx, want_dw) = reference_grads(&s, &x, &w, &g);
        let mut weight_grads = Vec::new();
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            assert!(
                group_len(&s, threads) > 1,
                "{threads} threads: images must be grouped"
            );
            let (out, dx, dw) = pool.install(|| {
                let mut out = vec![f32::NAN; s.output_len()];
                conv2d_forward(&s, &x, &w, None, &mut out);
                let mut dx = vec![f32::NAN; s.input_len()];
                conv2d_input_grad(&s, &g, &w, &mut dx);
                let mut dw = vec![f32::NAN; s.weight_len()];
                conv2d_weight_grad(&s, &x, &g, &mut dw);
                (out, dx, dw)
            });
            for (what, got, want) in [("forward", &out, &want_out), ("dx", &dx, &want_dx)] {
                let err = relative_error(got, want);
                assert!(err <= 1e-5, "{threads} threads: {what} error {err:e}");
            }
            let err = relative_error(&dw, &want_dw);
            assert!(
                err <= 1e-5,
                "{threads} threads: weight-gradient error {err:e}"
            );
            weight_grads.push(dw);
        }
        // Split by channels, every weight element is summed in the same order whatever the
        // thread count.
        assert!(weight_grads[1] == weight_grads[2], "2 vs 3 threads differ");
    }

    #[test]
    fn valid_range_keeps_reads_inside_the_row() {
        for w in 1..7 {
            for stride in 1..4 {
                for offset in -4isize..4 {
                    let ow = 6;
                    let (lo, hi) = valid_range(ow, stride, offset, w);
                    for ox in 0..ow {
                        let ix = (ox * stride) as isize + offset;
                        let inside = ix >= 0 && ix < w as isize;
                        assert_eq!(
                            inside,
                            (lo..hi).contains(&ox),
                            "w {w} s {stride} o {offset}"
                        );
                    }
                }
            }
        }
    }
}
