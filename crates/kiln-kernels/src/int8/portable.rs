//! The portable kernel: plain loops over the AVX2 packing (i16 operands, 8 channels per
//! block), computing the same integers as the SIMD kernels.

use super::{PackedWeights, QuantizedActivations};

/// One rectangle of the product, as [`super::rectangle`] describes.
///
/// # Safety
/// As [`super::rectangle`].
pub(super) unsafe fn rectangle(
    a: &QuantizedActivations,
    w: &PackedWeights,
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    out: *mut i32,
    n_pad: usize,
) {
    let (g, l) = (2, 8);
    let (i0, b0) = (rows.start, blocks.start);
    for i in rows {
        let base = a.bases[i];
        for b in blocks.clone() {
            let mut acc = [0i32; 8];
            for (q, off) in a.k_offsets.iter().enumerate() {
                let x = &a.wide[base + off..][..g];
                let wq = &w.wide[(b * w.groups + q) * l * g..][..l * g];
                for (lane, acc) in acc.iter_mut().enumerate() {
                    for e in 0..g {
                        *acc += x[e] as i32 * wq[lane * g + e] as i32;
                    }
                }
            }
            for (lane, v) in acc.iter().enumerate() {
                // SAFETY: inside this task's rectangle (caller's contract).
                unsafe { *out.add((i - i0) * n_pad + (b - b0) * l + lane) = *v };
            }
        }
    }
}
