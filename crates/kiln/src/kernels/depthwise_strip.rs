//! The depthwise convolution's interior on x86: strips of output pixels along a row whose
//! windows lie inside the image's width, in registers of intrinsics with fused multiply-adds.
//!
//! Why: the portable loop of [`super::nhwc::depthwise_conv2d`] (compiled per instruction set
//! by `multiversion!`) loaded the weight and the input for every multiply-add and multiplied
//! and added separately (Rust does not contract `a * b + c`): under `perf`, EfficientNet-B0's
//! depthwise layers ran at 12–17 G multiply-adds/s on two threads, ONNX Runtime's at 40. Here
//! each tap's weight vector is loaded once for [`STRIP`] pixels, whose accumulators stay in
//! registers across all taps, and each step is one `vfmadd` with the input as its memory
//! operand: about one load per multiply-add.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::implicit::F32Kernel;

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
    /// Taps per kernel row when `taps` lists whole rows of adjacent kernel columns (dilation
    /// 1: `kw`), 0 otherwise.
    pub row_len: usize,
    /// Channels per pixel.
    pub channels: usize,
    /// Output pixels in the strip.
    pub pixels: usize,
    /// Bounds applied before the store (ReLU, Clip).
    pub clamp: Option<[f32; 2]>,
}

impl Strip<'_> {
    /// The kernel width of the sliding-window blocks ([`SLIDE_WIDTHS`]) when they fit this
    /// strip: stride 1, and taps that are whole kernel rows of adjacent columns (each row's
    /// input and weight offsets `c` apart), checked here once per strip.
    fn sliding(&self) -> Option<usize> {
        let (kw, c) = (self.row_len, self.channels);
        if c == 0 || !SLIDE_WIDTHS.contains(&kw) || self.step != c {
            return None;
        }
        let rows_fit = self.taps.len().is_multiple_of(kw)
            && self.taps.chunks_exact(kw).all(|row| {
                let (x0, w0) = row[0];
                row.iter()
                    .enumerate()
                    .all(|(kx, &(xo, wo))| xo == x0 + kx * c && wo == w0 + kx * c)
            });
        rows_fit.then_some(kw)
    }

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
    assert!(
        kernel.supported(),
        "the {} kernel on a CPU without it",
        kernel.name()
    );
    #[cfg(target_arch = "x86_64")]
    {
        match kernel {
            // SAFETY: the CPU has AVX-512 (with AVX2 and FMA, which `supported` checks);
            // `reads_fit` bounds every read, `out` every write.
            F32Kernel::Avx512 => unsafe { strip_avx512(strip, out.as_mut_ptr()) },
            // SAFETY: as above, for AVX2 and FMA.
            F32Kernel::Avx2 => unsafe { strip_avx2(strip, out.as_mut_ptr()) },
            F32Kernel::Portable => return false,
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = out;
        false
    }
}

/// Kernel widths the sliding-window blocks are instantiated for (the exported families'
/// depthwise layers: 3×3, 5×5 and 7×7). Stride 1 only: at stride 2 they measured slower than
/// the tap-by-tap blocks (a 5×5 at 56², 144 channels: 24 → 14 G multiply-adds/s on one
/// thread), each input pixel feeding half as many outputs.
const SLIDE_WIDTHS: [usize; 3] = [3, 5, 7];

/// Runs `$slide::<$p, KW>` for the strip's kernel width (one of [`SLIDE_WIDTHS`], which
/// [`Strip::sliding`] returned).
#[cfg(target_arch = "x86_64")]
macro_rules! slide_for {
    ($slide:ident, $p:expr, $kw:expr, $($args:expr),*) => {
        match $kw {
            3 => $slide::<$p, 3>($($args),*),
            5 => $slide::<$p, 5>($($args),*),
            7 => $slide::<$p, 7>($($args),*),
            other => unreachable!("no sliding block {other} wide"),
        }
    };
}

/// Defines the strip kernel of one instruction set: `$lanes`-channel blocks (the last one
/// masked) × [`STRIP`], 4 and 1 pixels. With the sliding-window blocks, each channel block
/// runs across the whole strip before the next, so its weights and the input halo it shares
/// with the next pixels stay in L1 (channel blocks innermost re-read both from L2 every 8
/// pixels); the tap-by-tap blocks keep pixels outermost, which measured better at stride 2.
#[cfg(target_arch = "x86_64")]
macro_rules! strip_kernel {
    ($name:ident, $block:ident, $slide:ident, $features:literal, $lanes:literal, $mask:ty,
     $make_mask:ident, $load:ident, $store:ident, $fma:ident, $set1:ident, $min:ident,
     $max:ident) => {
        /// # Safety
        /// The CPU has the instruction set; [`Strip::reads_fit`] holds; `out` is valid for
        /// `pixels × channels` writes.
        #[target_feature(enable = $features)]
        unsafe fn $name(s: &Strip, out: *mut f32) {
            let c = s.channels;
            let blocks = c.div_ceil($lanes);
            let mask = |b: usize| -> $mask { $make_mask((c - b * $lanes).min($lanes)) };
            // Pixels per block call: a full strip, then 4, then 1.
            let width = |left: usize| {
                if left >= STRIP {
                    STRIP
                } else if left >= 4 {
                    4
                } else {
                    1
                }
            };
            if let Some(kw) = s.sliding() {
                for b in 0..blocks {
                    let mut p0 = 0;
                    while p0 < s.pixels {
                        let (at, m) = (b * $lanes, mask(b));
                        // SAFETY: the caller's contract for these pixels and channels (masked).
                        unsafe {
                            match width(s.pixels - p0) {
                                STRIP => slide_for!($slide, STRIP, kw, s, p0, at, m, out),
                                4 => slide_for!($slide, 4, kw, s, p0, at, m, out),
                                _ => $block::<1>(s, p0, at, m, out),
                            }
                        }
                        p0 += width(s.pixels - p0);
                    }
                }
                return;
            }
            let mut p0 = 0;
            while p0 < s.pixels {
                for b in 0..blocks {
                    let (at, m) = (b * $lanes, mask(b));
                    // SAFETY: as above.
                    unsafe {
                        match width(s.pixels - p0) {
                            STRIP => $block::<STRIP>(s, p0, at, m, out),
                            4 => $block::<4>(s, p0, at, m, out),
                            _ => $block::<1>(s, p0, at, m, out),
                        }
                    }
                }
                p0 += width(s.pixels - p0);
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
        /// Measured on one thread (best of 6 alternated runs): ConvNeXt's 7×7 at 56², 96
        /// channels, 30.5 → 40.1 G multiply-adds/s; EfficientNet's 5×5 at 28², 240 channels,
        /// 28.5 → 39.2.
        ///
        /// # Safety
        /// As the strip kernel's, for these pixels and channels; the taps are whole kernel
        /// rows ([`Strip::sliding`]).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $slide<const P: usize, const KW: usize>(
            s: &Strip,
            p0: usize,
            c0: usize,
            mask: $mask,
            out: *mut f32,
        ) {
            let (x, w, c) = (s.x.as_ptr(), s.weights.as_ptr(), s.channels);
            // SAFETY (every load and store below): the same offsets as the taps' (each row's
            // tap kx reads `kx·c` past the row's first), which `reads_fit` bounds; the mask
            // keeps channel reads and writes below `channels`.
            let bias = unsafe { $load(s.bias.as_ptr().add(c0), mask) };
            let mut acc = [bias; P];
            let base = s.first + p0 * s.step + c0;
            for row in s.taps.chunks_exact(KW) {
                let (xo, wo) = row[0];
                let wv: [_; KW] =
                    std::array::from_fn(|kx| unsafe { $load(w.add(wo + kx * c + c0), mask) });
                // One pointer stepped pixel by pixel: offsets `j·c` precomputed for every j
                // took more general registers than there are (spilled to the stack).
                let mut xp = unsafe { x.add(base + xo) };
                // Input pixel j of the row feeds output p = j − kx through tap kx (the
                // conditions are constants once the loops unroll).
                for j in 0..P - 1 + KW {
                    let xv = unsafe { $load(xp, mask) };
                    xp = xp.wrapping_add(c);
                    for (kx, wk) in wv.iter().enumerate() {
                        if j >= kx && j - kx < P {
                            acc[j - kx] = $fma(xv, *wk, acc[j - kx]);
                        }
                    }
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
