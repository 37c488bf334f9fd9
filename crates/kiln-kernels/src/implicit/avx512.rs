//! The AVX-512 kernel: 12 output pixels × 32 output channels of accumulators (24 of the 32
//! registers), two weight registers and one broadcast per K step; for a panel with at most 16
//! valid columns, 24 pixels × 16 channels.
use std::arch::x86_64::*;

use super::avx512_dims::{COLS, ROWS};
use crate::activation::{Activation, activate16};

use super::{PREFETCH_STEPS, Tile, prefetch_tile_outputs, row_group, tile_rows, walk_tiles};

/// Lanes per register.
const LANES: usize = 16;
const BLOCKS: usize = COLS / LANES;

/// Rows of the narrow tile (one register of columns): the same 24 accumulators.
const NARROW_ROWS: usize = 24;

/// All rows of `bases` for one panel, in the tiles [`walk_tiles`] picks.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2 and FMA; every `base + run + j` (`j < run_len`) indexes `tile.image`;
/// `tile.panel` holds `k × COLS` values; `out` is valid for row `i` at `i·out_stride + c`,
/// `c < tile.cols`, for every row of `bases`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn rows(tile: &Tile, bases: &[usize], out: *mut f32) {
    let masks: [__mmask16; BLOCKS] = std::array::from_fn(|b| {
        let valid = tile.cols.saturating_sub(b * LANES).min(LANES);
        ((1u32 << valid) - 1) as __mmask16
    });
    let group = row_group(tile.pool);
    // A panel with 16 valid columns or fewer (a layer 16 wide, or the last panel of 24, 40,
    // 80 or 144): the full tile would multiply-add the panel's zero half.
    if tile.cols <= LANES {
        let mask = [masks[0]];
        walk_tiles(bases.len(), NARROW_ROWS, group, |i, rows| {
            let out = out.wrapping_add(i / group * tile.out_stride);
            let res = tile.residual_at(i / group);
            // SAFETY: the caller's contract, for the tile's rows.
            unsafe {
                tile_rows!(narrow, tile, bases, i, rows, (out, res), &mask,
                    [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24])
            }
        });
        return;
    }
    // Pooled rows come in windows of 4, which a tile never splits (ROWS is a multiple of 4).
    walk_tiles(bases.len(), ROWS, group, |i, rows| {
        let out = out.wrapping_add(i / group * tile.out_stride);
        let res = tile.residual_at(i / group);
        // SAFETY: the caller's contract, for the tile's rows.
        unsafe {
            tile_rows!(wide, tile, bases, i, rows, (out, res), &masks, [1 2 3 4 5 6 7 8 9 10 11 12])
        }
    });
}

// The tile sizes listed above go up to the full tiles (multiples of 4: pooled rows).
const _: () = assert!(ROWS == 12 && NARROW_ROWS == 24);

/// [`block`] over the panel's two registers of columns.
///
/// # Safety
/// As [`block`]'s.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn wide<const R: usize>(
    tile: &Tile,
    bases: &[usize; R],
    dest: (*mut f32, *const f32),
    masks: &[__mmask16; BLOCKS],
) {
    // SAFETY: the caller's contract.
    unsafe { block::<R, BLOCKS>(tile, bases, dest, masks) }
}

/// [`block`] over the panel's first register of columns (the rest are zeros).
///
/// # Safety
/// As [`block`]'s.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn narrow<const R: usize>(
    tile: &Tile,
    bases: &[usize; R],
    dest: (*mut f32, *const f32),
    masks: &[__mmask16; 1],
) {
    // SAFETY: the caller's contract.
    unsafe { block::<R, 1>(tile, bases, dest, masks) }
}

/// `R` rows × `B` registers of columns (of the panel's [`COLS`]).
///
/// # Safety
/// As [`rows`]'s, for these rows; `masks` are the panel's valid columns per register.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block<const R: usize, const B: usize>(
    tile: &Tile,
    bases: &[usize; R],
    (out, res): (*mut f32, *const f32),
    masks: &[__mmask16; B],
) {
    let (image, panel) = (tile.image.as_ptr(), tile.panel.as_ptr());
    // Pooled tiles store a quarter of their rows.
    let stored = if tile.pool { R / 4 } else { R };
    prefetch_tile_outputs(out, res, stored, tile.out_stride, B);
    let mut acc = [[_mm512_setzero_ps(); B]; R];
    for b in 0..B {
        // SAFETY: the bias holds COLS values.
        let v = unsafe { _mm512_loadu_ps(tile.bias.as_ptr().add(b * LANES)) };
        for row in acc.iter_mut() {
            row[b] = v;
        }
    }
    let mut w = panel;
    for &run in tile.runs {
        let starts: [*const f32; R] = std::array::from_fn(|r| image.wrapping_add(bases[r] + run));
        for j in 0..tile.run_len {
            // SAFETY: the panel holds k × COLS values and this is K step (run, j).
            let wv: [__m512; B] =
                std::array::from_fn(|b| unsafe { _mm512_loadu_ps(w.add(b * LANES)) });
            // One cache line per register of columns, PREFETCH_STEPS ahead.
            for b in 0..B {
                let ahead = w.wrapping_add(PREFETCH_STEPS * COLS + b * LANES);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: base + run + j is inside the image (the caller's contract).
                let a = _mm512_set1_ps(unsafe { *starts[r].add(j) });
                for (acc, wv) in row.iter_mut().zip(&wv) {
                    *acc = _mm512_fmadd_ps(a, *wv, *acc);
                }
            }
            w = w.wrapping_add(COLS);
        }
    }
    let zero = _mm512_setzero_ps();
    if tile.pool {
        // Each 4 rows are one 2×2 window: store the maximum of their ReLU outputs (pooling
        // comes with ReLU). Starting from 0 is the ReLU; `max(v, m)` returns `m` for a NaN
        // `v`, so a NaN counts as 0, as the unfused ReLU makes it.
        for (g, window) in acc.chunks_exact(4).enumerate() {
            for b in 0..B {
                let v = window.iter().fold(zero, |m, row| _mm512_max_ps(row[b], m));
                // SAFETY: masked to this panel's valid columns of pooled row g.
                unsafe {
                    _mm512_mask_storeu_ps(out.add(g * tile.out_stride + b * LANES), masks[b], v)
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
                _mm512_add_ps(*v, unsafe { _mm512_maskz_loadu_ps(masks[b], res.add(at)) })
            };
            let v = match tile.clamp {
                Some([lo, hi]) => {
                    _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi))
                }
                None => v,
            };
            // SAFETY: masked to this panel's valid columns of row r.
            unsafe { _mm512_mask_storeu_ps(out.add(at), masks[b], v) };
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
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn activate_stored(
    out: *mut f32,
    rows: usize,
    stride: usize,
    masks: &[__mmask16],
    act: Activation,
) {
    for r in 0..rows {
        for (b, &mask) in masks.iter().enumerate() {
            let p = out.wrapping_add(r * stride + b * LANES);
            // SAFETY: the caller's contract; masked to the valid columns.
            unsafe {
                let v = activate16(_mm512_maskz_loadu_ps(mask, p), act);
                _mm512_mask_storeu_ps(p, mask, v);
            }
        }
    }
}
