//! The AVX2 + FMA kernel: 6 output pixels × 16 output channels of accumulators (12 of the 16
//! registers), two weight registers and one broadcast per K step.
use std::arch::x86_64::*;

use super::avx2_dims::{COLS, ROWS};
use crate::activation::{Activation, activate8};

use super::{PREFETCH_STEPS, Tile, prefetch_tile_outputs, tile_rows, walk_tiles};

/// Lanes per register.
const LANES: usize = 8;
const BLOCKS: usize = COLS / LANES;

/// All rows of `bases` for one panel, in the tiles [`walk_tiles`] picks.
///
/// # Safety
/// The CPU supports AVX2 and FMA; every `base + run + j` (`j < run_len`) indexes
/// `tile.image`; `tile.panel` holds `k × COLS` values; `out` is valid for row `i` at
/// `i·out_stride + c`, `c < tile.cols`, for every row of `bases`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(tile: &Tile, bases: &[usize], out: *mut f32) {
    let masks: [__m256i; BLOCKS] = std::array::from_fn(|b| {
        let valid = tile.cols.saturating_sub(b * LANES).min(LANES) as i32;
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)
    });
    if tile.pool {
        // Windows of 4 rows: a 6-row tile would split them, so one window per tile (8 of
        // the 16 registers accumulate).
        for (i, window) in bases.chunks_exact(4).enumerate() {
            let out = out.wrapping_add(i * tile.out_stride);
            // SAFETY: the caller's contract, for this window's rows.
            unsafe {
                block::<4>(
                    tile,
                    window.try_into().unwrap(),
                    (out, std::ptr::null()),
                    &masks,
                )
            };
        }
        return;
    }
    walk_tiles(bases.len(), ROWS, 1, |i, rows| {
        let out = out.wrapping_add(i * tile.out_stride);
        let res = tile.residual_at(i);
        // SAFETY: the caller's contract, for the tile's rows.
        unsafe { tile_rows!(block, tile, bases, i, rows, (out, res), &masks, [1 2 3 4 5 6]) }
    });
}

// The tile sizes listed above go up to the full tile.
const _: () = assert!(ROWS == 6);

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const R: usize>(
    tile: &Tile,
    bases: &[usize; R],
    (out, res): (*mut f32, *const f32),
    masks: &[__m256i; BLOCKS],
) {
    let (image, panel) = (tile.image.as_ptr(), tile.panel.as_ptr());
    // Pooled tiles store a quarter of their rows.
    let stored = if tile.pool { R / 4 } else { R };
    prefetch_tile_outputs(out, res, stored, tile.out_stride, BLOCKS / 2);
    let mut acc = [[_mm256_setzero_ps(); BLOCKS]; R];
    for b in 0..BLOCKS {
        // SAFETY: the bias holds COLS values.
        let v = unsafe { _mm256_loadu_ps(tile.bias.as_ptr().add(b * LANES)) };
        for row in acc.iter_mut() {
            row[b] = v;
        }
    }
    let mut w = panel;
    for &run in tile.runs {
        let starts: [*const f32; R] = std::array::from_fn(|r| image.wrapping_add(bases[r] + run));
        for j in 0..tile.run_len {
            // SAFETY: the panel holds k × COLS values and this is K step (run, j).
            let wv: [__m256; BLOCKS] =
                std::array::from_fn(|b| unsafe { _mm256_loadu_ps(w.add(b * LANES)) });
            // Each cache line (16 values) of the step PREFETCH_STEPS ahead.
            for line in (0..COLS).step_by(16) {
                let ahead = w.wrapping_add(PREFETCH_STEPS * COLS + line);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: base + run + j is inside the image (the caller's contract).
                let a = _mm256_set1_ps(unsafe { *starts[r].add(j) });
                for (acc, wv) in row.iter_mut().zip(&wv) {
                    *acc = _mm256_fmadd_ps(a, *wv, *acc);
                }
            }
            w = w.wrapping_add(COLS);
        }
    }
    let zero = _mm256_setzero_ps();
    if tile.pool {
        // Each 4 rows are one 2×2 window: store the maximum of their ReLU outputs (pooling
        // comes with ReLU). Starting from 0 is the ReLU; `max(v, m)` returns `m` for a NaN
        // `v`, so a NaN counts as 0, as the unfused ReLU makes it.
        for (g, window) in acc.chunks_exact(4).enumerate() {
            for b in 0..BLOCKS {
                let v = window.iter().fold(zero, |m, row| _mm256_max_ps(row[b], m));
                // SAFETY: masked to this panel's valid columns of pooled row g.
                unsafe {
                    _mm256_maskstore_ps(out.add(g * tile.out_stride + b * LANES), masks[b], v)
                };
            }
        }
        return;
    }
    for (r, row) in acc.iter().enumerate() {
        for (b, v) in row.iter().enumerate() {
            let at = r * tile.out_stride + b * LANES;
            let v = if res.is_null() {
                *v
            } else {
                // SAFETY: the residual has the output's layout; masked to the valid columns.
                _mm256_add_ps(*v, unsafe { _mm256_maskload_ps(res.add(at), masks[b]) })
            };
            let v = match tile.clamp {
                Some([lo, hi]) => {
                    _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi))
                }
                None => v,
            };
            // SAFETY: masked to this panel's valid columns of row r.
            unsafe { _mm256_maskstore_ps(out.add(at), masks[b], v) };
        }
    }
    if let Some(act) = tile.after {
        // SAFETY: the rows just stored.
        unsafe { activate_stored(out, R, tile.out_stride, masks, act) };
    }
}

/// `act` of the `rows` rows just stored at `out` (`stride` apart, the panel's valid columns),
/// read back from L1. Not inlined: its constants stay out of the register tile's loop.
///
/// # Safety
/// `out` is valid for reads and writes of each row's masked columns.
#[inline(never)]
#[target_feature(enable = "avx2,fma")]
unsafe fn activate_stored(
    out: *mut f32,
    rows: usize,
    stride: usize,
    masks: &[__m256i; BLOCKS],
    act: Activation,
) {
    for r in 0..rows {
        for (b, &mask) in masks.iter().enumerate() {
            let p = out.wrapping_add(r * stride + b * LANES);
            // SAFETY: the caller's contract; masked to the valid columns.
            unsafe {
                let v = activate8(_mm256_maskload_ps(p, mask), act);
                _mm256_maskstore_ps(p, mask, v);
            }
        }
    }
}
