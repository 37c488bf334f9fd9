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

/// Defines the strip kernel of one instruction set: `$lanes`-channel blocks (the last one
/// masked) × [`STRIP`], 4 and 1 pixels.
#[cfg(target_arch = "x86_64")]
macro_rules! strip_kernel {
    ($name:ident, $block:ident, $features:literal, $lanes:literal, $mask:ty,
     $make_mask:ident, $load:ident, $store:ident, $fma:ident, $set1:ident, $min:ident,
     $max:ident) => {
        /// # Safety
        /// The CPU has the instruction set; [`Strip::reads_fit`] holds; `out` is valid for
        /// `pixels × channels` writes.
        #[target_feature(enable = $features)]
        unsafe fn $name(s: &Strip, out: *mut f32) {
            let c = s.channels;
            let mut p0 = 0;
            while p0 < s.pixels {
                let left = s.pixels - p0;
                let mut c0 = 0;
                while c0 < c {
                    let mask: $mask = $make_mask((c - c0).min($lanes));
                    // SAFETY: the caller's contract for pixels p0.. and channels c0.. (masked).
                    unsafe {
                        if left >= STRIP {
                            $block::<STRIP>(s, p0, c0, mask, out);
                        } else if left >= 4 {
                            $block::<4>(s, p0, c0, mask, out);
                        } else {
                            $block::<1>(s, p0, c0, mask, out);
                        }
                    }
                    c0 += $lanes;
                }
                p0 += if left >= STRIP {
                    STRIP
                } else if left >= 4 {
                    4
                } else {
                    1
                };
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
    };
}

#[cfg(target_arch = "x86_64")]
strip_kernel!(
    strip_avx512,
    block_avx512,
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
