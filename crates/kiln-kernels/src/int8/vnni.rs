//! The AVX-512 VNNI kernel: `vpdpbusd`, 4 u8×i8 products per i32 lane, 64 per instruction.
use std::arch::x86_64::*;

use super::blocks::{run_block, walk_blocks};
use super::{PackedWeights, QuantizedActivations};

/// `R` rows × `C` channel blocks of 16: R·C accumulators, C weight registers, one
/// broadcast; per K-group of 4, R·C `vpdpbusd`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block<const R: usize, const C: usize>(
    a: *const u8,
    bases: &[usize],
    k_offsets: &[usize],
    w: *const u8,
    groups: usize,
    out: *mut i32,
    n_pad: usize,
) {
    let mut acc = [[_mm512_setzero_si512(); C]; R];
    let rows: [*const u8; R] = std::array::from_fn(|r| a.wrapping_add(bases[r]));
    for (q, &off) in k_offsets.iter().enumerate() {
        let mut wv = [_mm512_setzero_si512(); C];
        for (c, v) in wv.iter_mut().enumerate() {
            // SAFETY: block c of this chunk holds `groups` × 64 bytes.
            *v = unsafe { _mm512_loadu_si512(w.add((c * groups + q) * 64) as *const __m512i) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: bases + k_offsets address the operand's own K-groups (4 bytes each).
            let quad = unsafe { (rows[r].add(off) as *const i32).read_unaligned() };
            let av = _mm512_set1_epi32(quad);
            for (acc, v) in acc_r.iter_mut().zip(&wv) {
                *acc = _mm512_dpbusd_epi32(*acc, av, *v);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (c, v) in acc_r.iter().enumerate() {
            // SAFETY: the caller's rectangle covers these 16 outputs.
            unsafe { _mm512_storeu_si512(out.add(r * n_pad + c * 16) as *mut __m512i, *v) };
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
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
    walk_blocks(rows, blocks, 6, |i, b, r, two| {
        let (wp, bs) = (w.bytes[b * g * 64..].as_ptr(), &a.bases[i..]);
        // SAFETY: rows i.. and blocks b.. are inside the packed operands and this task's
        // rectangle of `out`; the CPU features were detected before packing for VNNI.
        unsafe {
            let o = out.add((i - i0) * n_pad + (b - b0) * 16);
            run_block!(block, r, two, (ap, bs, ks, wp, g, o, n_pad), [1 2 3 4 5 6])
        }
    });
}
