//! The AVX2 kernel: u8 × i8 bytes through `vpmaddubsw` (pairs summed into i16) and
//! `vpmaddwd` by ones (pairs of those into i32), 32 products per pair of instructions, on
//! the VNNI kernel's byte operands with 8 channels per register; and the AVX2 epilogue and
//! range scan.
//!
//! Exact because the activations are 7-bit here (`Int8Kernel::max_activation`): an i16
//! lane sums two products of at most 127 · 127, below `vpmaddubsw`'s saturation.
use std::arch::x86_64::*;

use super::blocks::{run_block, walk_blocks};
use super::{
    Columns, PackedWeights, QuantizedActivations, dequantize_row_from, min_max_portable, widest,
};

/// `R` rows × `C` channel blocks of 8 (≤ 4 × 2: 8 accumulators + 2 weights + the broadcast,
/// the ones and a product of the 16 ymm registers); per K-group of 4 bytes, R·C
/// `vpmaddubsw` + `vpmaddwd` + add.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block<const R: usize, const C: usize>(
    a: *const u8,
    bases: &[usize],
    k_offsets: &[usize],
    w: *const u8,
    groups: usize,
    out: *mut i32,
    n_pad: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_si256(); C]; R];
    let rows: [*const u8; R] = std::array::from_fn(|r| a.wrapping_add(bases[r]));
    for (q, &off) in k_offsets.iter().enumerate() {
        let mut wv = [_mm256_setzero_si256(); C];
        for (c, v) in wv.iter_mut().enumerate() {
            // SAFETY: block c holds `groups` × 32 bytes (8 channels × 4).
            *v = unsafe { _mm256_loadu_si256(w.add((c * groups + q) * 32) as *const __m256i) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: bases + k_offsets address the operand's own K-groups (4 bytes each).
            let quad = unsafe { (rows[r].add(off) as *const i32).read_unaligned() };
            let av = _mm256_set1_epi32(quad);
            for (acc, v) in acc_r.iter_mut().zip(&wv) {
                let pairs = _mm256_maddubs_epi16(av, *v);
                *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (c, v) in acc_r.iter().enumerate() {
            // SAFETY: the caller's rectangle covers these 8 outputs.
            unsafe { _mm256_storeu_si256(out.add(r * n_pad + c * 8) as *mut __m256i, *v) };
        }
    }
}

#[target_feature(enable = "avx2")]
pub(super) unsafe fn rectangle(
    a: &QuantizedActivations,
    w: &PackedWeights,
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    out: *mut i32,
    n_pad: usize,
) {
    let g = w.groups;
    let (i0, b0) = (rows.start, blocks.start);
    let (ap, ks) = (a.bytes.as_ptr(), &a.k_offsets[..]);
    walk_blocks(rows, blocks, 4, |i, b, r, two| {
        let (wp, bs) = (w.bytes[b * g * 32..].as_ptr(), &a.bases[i..]);
        // SAFETY: as in the VNNI kernel, for AVX2 (detected before packing for it).
        unsafe {
            let o = out.add((i - i0) * n_pad + (b - b0) * 8);
            run_block!(block, r, two, (ap, bs, ks, wp, g, o, n_pad), [1 2 3 4])
        }
    });
}

/// [`super::min_max`] over 8-lane registers. `vminps(x, acc)` returns `acc` when `x` is NaN, so NaNs
/// are skipped exactly as in the portable loop.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn min_max(x: &[f32]) -> (f32, f32) {
    use std::arch::x86_64::*;
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in chunks {
        // SAFETY: `c` holds 8 f32s.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        lo = _mm256_min_ps(v, lo);
        hi = _mm256_max_ps(v, hi);
    }
    widest(min_max_portable(tail), lanes_range(lo, hi))
}

/// The range held in two 8-lane registers of running minima and maxima.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes_range(lo: std::arch::x86_64::__m256, hi: std::arch::x86_64::__m256) -> (f32, f32) {
    use std::arch::x86_64::_mm256_storeu_ps;
    let (mut l, mut h) = ([0f32; 8], [0f32; 8]);
    // SAFETY: each array holds 8 f32s.
    unsafe {
        _mm256_storeu_ps(l.as_mut_ptr(), lo);
        _mm256_storeu_ps(h.as_mut_ptr(), hi);
    }
    (min_max_portable(&l).0, min_max_portable(&h).1)
}

/// [`super::dequantize_rect`] eight columns at a time (multiply then add, not FMA, so the values are
/// bit-identical to the portable loop's).
///
/// # Safety
/// As [`super::dequantize_rect`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn dequantize_rect(
    acc: &[i32],
    acc_stride: usize,
    rows: usize,
    columns: &Columns,
    out: *mut f32,
    out_stride: usize,
) -> (f32, f32) {
    use std::arch::x86_64::*;
    let cols = columns.scale.len();
    let full = cols / 8 * 8;
    let floor = _mm256_set1_ps(columns.floor);
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut range = (0f32, 0f32);
    for r in 0..rows {
        let row = &acc[r * acc_stride..][..cols];
        // SAFETY: inside the caller's rectangle.
        let dst = unsafe { out.add(r * out_stride) };
        for j in (0..full).step_by(8) {
            // SAFETY: j + 8 ≤ cols for the accumulator row, the constants and the output.
            unsafe {
                let a = _mm256_cvtepi32_ps(_mm256_loadu_si256(row.as_ptr().add(j) as *const _));
                let s = _mm256_loadu_ps(columns.scale.as_ptr().add(j));
                let o = _mm256_loadu_ps(columns.offset.as_ptr().add(j));
                let v = _mm256_max_ps(_mm256_add_ps(_mm256_mul_ps(a, s), o), floor);
                _mm256_storeu_ps(dst.add(j), v);
                lo = _mm256_min_ps(v, lo);
                hi = _mm256_max_ps(v, hi);
            }
        }
        // SAFETY: the row's columns from `full` on, inside the caller's rectangle.
        range = widest(range, unsafe {
            dequantize_row_from(row, columns, full, dst)
        });
    }
    widest(range, lanes_range(lo, hi))
}
