//! The depthwise convolution on x86: strips of output pixels along a row, in registers of
//! intrinsics with fused multiply-adds. At stride 1 a whole row, its border pixels included,
//! runs as sliding windows ([`SlideRow`]); otherwise the pixels whose windows lie inside the
//! image's width run tap by tap ([`Strip`]) and the caller computes the border.
//!
//! Why: the portable loop of [`crate::nhwc::depthwise_conv2d`] (compiled per instruction set
//! by `multiversion!`) loaded the weight and the input for every multiply-add and multiplied
//! and added separately (Rust does not contract `a * b + c`): under `perf`, EfficientNet-B0's
//! depthwise layers ran at 12–17 G multiply-adds/s on two threads, ONNX Runtime's at 40. Here
//! each tap's weight vector is loaded once for [`STRIP`] pixels, whose accumulators stay in
//! registers across all taps, and each step is one `vfmadd` with the input as its memory
//! operand: about one load per multiply-add.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::base::isa::F32Kernel;

/// Output pixels per strip: eight accumulators hide the FMA latency (4 cycles) with room to
/// spare, and leave registers for the weight even on AVX2's sixteen.
pub(super) const STRIP: usize = 8;

/// One row's interior for the strip kernels: every pointer offset is in floats.
pub(super) struct Strip<'a> {
    /// The input image (channels-last).
    pub x: &'a [f32],
    /// Offset of the first pixel's window start (its first tap's input pixel, channel 0).
    pub first: usize,
    /// Offset between consecutive pixels' window starts (stride × channels).
    pub step: usize,
    /// (input offset from a window start, weight offset) of every tap.
    pub taps: &'a [(usize, usize)],
    /// Tap-major weights `[kh·kw, channels]` and the bias `[channels]`.
    pub weights: &'a [f32],
    pub bias: &'a [f32],
    /// Channels per pixel.
    pub channels: usize,
    /// Output pixels in the strip.
    pub pixels: usize,
    /// Bounds applied before the store (ReLU, Clip).
    pub clamp: Option<[f32; 2]>,
}

impl Strip<'_> {
    /// Whether every read stays inside the input and the weights (checked once per row, so
    /// the kernels may read without bounds checks).
    fn reads_fit(&self) -> bool {
        let c = self.channels;
        let last_window = self.first + (self.pixels.max(1) - 1) * self.step;
        let max_in = self.taps.iter().map(|t| t.0).max().unwrap_or(0);
        let max_w = self.taps.iter().map(|t| t.1).max().unwrap_or(0);
        self.pixels == 0
            || (last_window + max_in + c <= self.x.len()
                && max_w + c <= self.weights.len()
                && self.bias.len() >= c)
    }
}

/// Computes `strip` into `out` (`pixels × channels` values) with `kernel`'s instruction set;
/// `false` (nothing written) for the portable kernel: the caller's loop runs.
///
/// # Panics
/// When `kernel` is one this CPU lacks ([`F32Kernel::supported`] says which it has).
pub(super) fn run(kernel: F32Kernel, strip: &Strip, out: &mut [f32]) -> bool {
    assert!(
        strip.reads_fit(),
        "depthwise strip reads outside its operands"
    );
    assert_eq!(
        out.len(),
        strip.pixels * strip.channels,
        "depthwise strip output"
    );
    #[cfg(target_arch = "x86_64")]
    return dispatch(kernel, strip, out, strip_avx512, strip_avx2);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kernel, out);
        false
    }
}

/// Runs `avx512` or `avx2` on `operands` as `kernel` says; `false` (nothing written) for the
/// portable kernel. The caller checked that the operands' reads stay inside them and that
/// `out` holds the output.
///
/// # Panics
/// When `kernel` is one this CPU lacks ([`F32Kernel::supported`] says which it has).
#[cfg(target_arch = "x86_64")]
fn dispatch<S>(
    kernel: F32Kernel,
    operands: &S,
    out: &mut [f32],
    avx512: unsafe fn(&S, *mut f32),
    avx2: unsafe fn(&S, *mut f32),
) -> bool {
    assert!(
        kernel.supported(),
        "the {} kernel on a CPU without it",
        kernel.name()
    );
    match kernel {
        // SAFETY: the CPU has AVX-512 (with AVX2 and FMA, which `supported` checks); the
        // caller bounds every read and `out` every write.
        F32Kernel::Avx512 => unsafe { avx512(operands, out.as_mut_ptr()) },
        // SAFETY: as above, for AVX2 and FMA.
        F32Kernel::Avx2 => unsafe { avx2(operands, out.as_mut_ptr()) },
        F32Kernel::Portable => return false,
    }
    true
}

/// One output row for the sliding-window blocks: stride 1, dilation 1 along the row, a
/// kernel [`SLIDE_WIDTHS`] wide. Every pixel of the row, the border ones included: a
/// window's columns outside the image are skipped (they would multiply padding zeros), so
/// the border needs no slower loop of its own (at 7² under a 7×7 kernel, six of seven pixels
/// are border pixels). Offsets are in floats.
pub(super) struct SlideRow<'a> {
    /// The input image (channels-last).
    pub x: &'a [f32],
    /// Per kernel row inside the image: the offset of its input row's column 0 and of its
    /// weights' first tap (`kx = 0`).
    pub rows: &'a [(usize, usize)],
    /// The input column of pixel 0's first tap (negative with left padding).
    pub first_col: isize,
    /// Columns of the image.
    pub width: usize,
    /// Kernel width.
    pub kw: usize,
    /// Tap-major weights `[kh·kw, channels]` and the bias `[channels]`.
    pub weights: &'a [f32],
    pub bias: &'a [f32],
    /// Channels per pixel.
    pub channels: usize,
    /// Output pixels in the row.
    pub pixels: usize,
    /// Bounds applied before the store (ReLU, Clip).
    pub clamp: Option<[f32; 2]>,
}

impl SlideRow<'_> {
    /// Whether every read stays inside the input and the weights: each row's columns
    /// `0..width`, each weight row's `kw` taps (the kernels read no other column).
    fn reads_fit(&self) -> bool {
        let c = self.channels;
        self.rows.iter().all(|&(xo, wo)| {
            xo + self.width * c <= self.x.len() && wo + self.kw * c <= self.weights.len()
        }) && self.bias.len() >= c
    }
}

/// Computes `row` into `out` (`pixels × channels` values) with `kernel`'s instruction set;
/// `false` (nothing written) for the portable kernel or a kernel width without a sliding
/// block: the caller's loop runs.
///
/// # Panics
/// When `kernel` is one this CPU lacks ([`F32Kernel::supported`] says which it has).
pub(super) fn run_row(kernel: F32Kernel, row: &SlideRow, out: &mut [f32]) -> bool {
    if !SLIDE_WIDTHS.contains(&row.kw) {
        return false;
    }
    assert!(row.reads_fit(), "depthwise row reads outside its operands");
    assert_eq!(out.len(), row.pixels * row.channels, "depthwise row output");
    // `reads_fit` bounds every read: the kernels read only columns inside the image.
    #[cfg(target_arch = "x86_64")]
    return dispatch(kernel, row, out, row_avx512, row_avx2);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kernel, out);
        false
    }
}

/// Kernel widths the sliding-window blocks are instantiated for (the exported families'
/// depthwise layers: 3×3, 5×5 and 7×7). Stride 1 only: at stride 2 they measured slower than
/// the tap-by-tap blocks (a 5×5 at 56², 144 channels: 24 → 14 G multiply-adds/s on one
/// thread), each input pixel feeding half as many outputs.
const SLIDE_WIDTHS: [usize; 3] = [3, 5, 7];

/// Pixels the next block call takes: a full strip, then 4, then 1.
fn strip_width(left: usize) -> usize {
    if left >= STRIP {
        STRIP
    } else if left >= 4 {
        4
    } else {
        1
    }
}

/// Runs `$slide::<$p, KW, EDGE>` for the row's kernel width (one of [`SLIDE_WIDTHS`], which
/// [`run_row`] checked) and whether the strip's windows reach past the image's width.
#[cfg(target_arch = "x86_64")]
macro_rules! slide_for {
    ($slide:ident, $p:expr, $kw:expr, $edge:expr, $($args:expr),*) => {
        match ($kw, $edge) {
            (3, false) => $slide::<$p, 3, false>($($args),*),
            (5, false) => $slide::<$p, 5, false>($($args),*),
            (7, false) => $slide::<$p, 7, false>($($args),*),
            (3, true) => $slide::<$p, 3, true>($($args),*),
            (5, true) => $slide::<$p, 5, true>($($args),*),
            (7, true) => $slide::<$p, 7, true>($($args),*),
            (other, _) => unreachable!("no sliding block {other} wide"),
        }
    };
}

/// Defines the strip kernels of one instruction set: `$lanes`-channel blocks (the last one
/// masked) × [`STRIP`], 4 and 1 pixels. The tap-by-tap strip keeps pixels outermost; the
/// sliding row runs each channel block across the whole row before the next, so the block's
/// weights and the input halo it shares with the next pixels stay in L1 (channel blocks
/// innermost re-read both from L2 every 8 pixels).
#[cfg(target_arch = "x86_64")]
macro_rules! strip_kernel {
    ($name:ident, $row:ident, $block:ident, $slide:ident, $features:literal, $lanes:literal,
     $mask:ty, $make_mask:ident, $load:ident, $store:ident, $fma:ident, $set1:ident,
     $min:ident, $max:ident) => {
        /// # Safety
        /// The CPU has the instruction set; [`Strip::reads_fit`] holds; `out` is valid for
        /// `pixels × channels` writes.
        #[target_feature(enable = $features)]
        unsafe fn $name(s: &Strip, out: *mut f32) {
            let c = s.channels;
            let mut p0 = 0;
            while p0 < s.pixels {
                let mut c0 = 0;
                while c0 < c {
                    let mask: $mask = $make_mask((c - c0).min($lanes));
                    // SAFETY: the caller's contract for pixels p0.. and channels c0.. (masked).
                    unsafe {
                        match strip_width(s.pixels - p0) {
                            STRIP => $block::<STRIP>(s, p0, c0, mask, out),
                            4 => $block::<4>(s, p0, c0, mask, out),
                            _ => $block::<1>(s, p0, c0, mask, out),
                        }
                    }
                    c0 += $lanes;
                }
                p0 += strip_width(s.pixels - p0);
            }
        }

        /// # Safety
        /// The CPU has the instruction set; [`SlideRow::reads_fit`] holds and the kernel width
        /// is one of [`SLIDE_WIDTHS`]; `out` is valid for `pixels × channels` writes.
        #[target_feature(enable = $features)]
        unsafe fn $row(s: &SlideRow, out: *mut f32) {
            let c = s.channels;
            let mut c0 = 0;
            while c0 < c {
                let mask: $mask = $make_mask((c - c0).min($lanes));
                let mut p0 = 0;
                while p0 < s.pixels {
                    let p = strip_width(s.pixels - p0);
                    // The strip's windows read input columns col..col + p − 1 + kw.
                    let col = s.first_col + p0 as isize;
                    let edge = col < 0 || col + (p - 1 + s.kw) as isize > s.width as isize;
                    // SAFETY: the caller's contract for pixels p0.. and channels c0.. (masked).
                    unsafe {
                        match p {
                            STRIP => slide_for!($slide, STRIP, s.kw, edge, s, p0, c0, mask, out),
                            4 => slide_for!($slide, 4, s.kw, edge, s, p0, c0, mask, out),
                            _ => slide_for!($slide, 1, s.kw, edge, s, p0, c0, mask, out),
                        }
                    }
                    p0 += p;
                }
                c0 += $lanes;
            }
        }

        /// Pixels `p0..p0 + P`, channels `c0..` under `mask`.
        ///
        /// # Safety
        /// As the strip kernel's, for these pixels and channels.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $block<const P: usize>(
            s: &Strip,
            p0: usize,
            c0: usize,
            mask: $mask,
            out: *mut f32,
        ) {
            let (x, w) = (s.x.as_ptr(), s.weights.as_ptr());
            // SAFETY (every load and store below): `reads_fit` bounds the offsets; the mask
            // keeps channel reads and writes below `channels`.
            let bias = unsafe { $load(s.bias.as_ptr().add(c0), mask) };
            let mut acc = [bias; P];
            let base = s.first + p0 * s.step + c0;
            for &(xo, wo) in s.taps {
                let wv = unsafe { $load(w.add(wo + c0), mask) };
                for (p, a) in acc.iter_mut().enumerate() {
                    let xv = unsafe { $load(x.add(base + p * s.step + xo), mask) };
                    *a = $fma(xv, wv, *a);
                }
            }
            if let Some([lo, hi]) = s.clamp {
                let (lo, hi) = ($set1(lo), $set1(hi));
                for a in &mut acc {
                    *a = $min($max(*a, lo), hi);
                }
            }
            for (p, a) in acc.iter().enumerate() {
                unsafe { $store(out.add((p0 + p) * s.channels + c0), mask, *a) };
            }
        }

        /// Pixels `p0..p0 + P`, channels `c0..` under `mask`, for a kernel `KW` wide at
        /// stride 1 (dilation 1): per kernel row, its `KW` weights are loaded into registers
        /// once and each input pixel of the row once, then multiplied into every accumulator
        /// whose window covers it: `2·KW + P − 1` loads per `P·KW` multiply-adds (7×7, 8
        /// pixels: 21 per 56) where the tap-by-tap block loads the input for every one (63).
        /// With `EDGE` (a strip whose windows reach past the image's width), input columns
        /// outside the image are skipped; without, every column is read unchecked (a
        /// comparison per input pixel cost 3×3 layers ~2%). Measured on one thread (best of 6
        /// alternated runs): ConvNeXt's 7×7 at 56², 96 channels, 30.5 → 40.1 G
        /// multiply-adds/s; EfficientNet's 5×5 at 28², 240 channels, 28.5 → 39.2.
        ///
        /// # Safety
        /// As the row kernel's, for these pixels and channels.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $slide<const P: usize, const KW: usize, const EDGE: bool>(
            s: &SlideRow,
            p0: usize,
            c0: usize,
            mask: $mask,
            out: *mut f32,
        ) {
            let (x, w, c) = (s.x.as_ptr(), s.weights.as_ptr(), s.channels);
            // SAFETY (every load and store below): `reads_fit` bounds each row's columns
            // `0..width` and each weight row's `KW` taps, and only those are read; the mask
            // keeps channel reads and writes below `channels`.
            let bias = unsafe { $load(s.bias.as_ptr().add(c0), mask) };
            let mut acc = [bias; P];
            // The input columns of the strip's first window start and the window pixels
            // `j_lo..j_hi` inside the image.
            let col0 = s.first_col + p0 as isize;
            let j_lo = (-col0).max(0) as usize;
            let j_hi = (s.width as isize - col0).max(0) as usize;
            for &(xo, wo) in s.rows {
                let wv: [_; KW] =
                    std::array::from_fn(|kx| unsafe { $load(w.add(wo + kx * c + c0), mask) });
                // One pointer stepped pixel by pixel (offsets `j·c` precomputed for every j
                // took more general registers than there are); out of the image it is only
                // stepped, never read.
                let mut xp = x.wrapping_add(xo + c0).wrapping_offset(col0 * c as isize);
                // Input pixel j of the window feeds output p = j − kx through tap kx (the
                // conditions on j and kx are constants once the loops unroll).
                for j in 0..P - 1 + KW {
                    if !EDGE || (j >= j_lo && j < j_hi) {
                        let xv = unsafe { $load(xp, mask) };
                        for (kx, wk) in wv.iter().enumerate() {
                            if j >= kx && j - kx < P {
                                acc[j - kx] = $fma(xv, *wk, acc[j - kx]);
                            }
                        }
                    }
                    xp = xp.wrapping_add(c);
                }
            }
            if let Some([lo, hi]) = s.clamp {
                let (lo, hi) = ($set1(lo), $set1(hi));
                for a in &mut acc {
                    *a = $min($max(*a, lo), hi);
                }
            }
            for (p, a) in acc.iter().enumerate() {
                unsafe { $store(out.add((p0 + p) * s.channels + c0), mask, *a) };
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
strip_kernel!(
    strip_avx512,
    row_avx512,
    block_avx512,
    slide_avx512,
    "avx512f,avx2,fma",
    16,
    __mmask16,
    mask16,
    load16,
    store16,
    _mm512_fmadd_ps,
    _mm512_set1_ps,
    _mm512_min_ps,
    _mm512_max_ps
);

#[cfg(target_arch = "x86_64")]
strip_kernel!(
    strip_avx2,
    row_avx2,
    block_avx2,
    slide_avx2,
    "avx2,fma",
    8,
    __m256i,
    mask8,
    load8,
    store8,
    _mm256_fmadd_ps,
    _mm256_set1_ps,
    _mm256_min_ps,
    _mm256_max_ps
);

// The masked memory operations of each instruction set (functions, not closures: a closure
// does not inherit its caller's target features).

/// The first `n` (≤ 16) lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn mask16(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// # Safety
/// `p` is valid for reads of the lanes of `m`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16(p: *const f32, m: __mmask16) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe { _mm512_maskz_loadu_ps(m, p) }
}

/// # Safety
/// `p` is valid for writes of the lanes of `m`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store16(p: *mut f32, m: __mmask16, v: __m512) {
    // SAFETY: the caller's contract.
    unsafe { _mm512_mask_storeu_ps(p, m, v) }
}

/// The first `n` (≤ 8) lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn mask8(n: usize) -> __m256i {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes)
}

/// # Safety
/// `p` is valid for reads of the lanes of `m`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load8(p: *const f32, m: __m256i) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { _mm256_maskload_ps(p, m) }
}

/// # Safety
/// `p` is valid for writes of the lanes of `m`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store8(p: *mut f32, m: __m256i, v: __m256) {
    // SAFETY: the caller's contract.
    unsafe { _mm256_maskstore_ps(p, m, v) }
}
