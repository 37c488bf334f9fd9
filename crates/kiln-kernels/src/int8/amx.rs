//! The AMX kernel (Intel Sapphire Rapids and later): `tdpbusd` multiplies a 16 × 64 u8 tile
//! by a 64 × 16 i8 tile into 16 × 16 i32 accumulators, 16 384 multiply-adds per instruction
//! (VNNI's `vpdpbusd` does 64). ONNX Runtime's int8 GEMM uses these units where the CPU has
//! them, and so must Kiln's to keep pace on transformers' linear layers (BERT-base's
//! feed-forward products ran at ~500 G multiply-adds/s on VNNI, ORT's at ~780 on AMX,
//! BENCHMARKS.md run 43).
//!
//! The weights' VNNI packing is already AMX's B layout: for 16 output channels, each K-group
//! of 4 is 64 bytes (16 channels × 4 values), so 16 K-groups are one 16-row B tile, rows 64
//! bytes apart. The activations must be a plain matrix (rows evenly strided, K contiguous and
//! padded to 64 bytes, rows padded to a multiple of 16: see `QuantizedActivations::new`);
//! a convolution's implicit operand is not, and runs the VNNI kernel on the same packing.
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are inline assembly with the
//! tile registers named in it: tmm0–3 accumulate a 32 × 32 block (two row tiles × two channel
//! tiles), tmm4–5 hold the row tiles and tmm6–7 the channel tiles. Nothing else in the program
//! touches tile registers.
use std::arch::asm;

use super::blocks::walk_blocks;
use super::{PackedWeights, QuantizedActivations};

/// Rows of an A tile (and of an accumulator tile).
pub(super) const TILE_ROWS: usize = 16;
/// Bytes of K per tile step: 64 u8 values (16 K-groups of 4).
pub(super) const TILE_K: usize = 64;

/// The tile configuration `ldtilecfg` reads: palette 1, every tile 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn all_full() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for t in 0..8 {
            // colsb (bytes per row) at 16 + 2t, rows at 48 + t.
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(TILE_K as u16).to_le_bytes());
            c[48 + t] = TILE_ROWS as u8;
        }
        TileConfig(c)
    }
}

/// Whether `a` is a matrix AMX can read with its operands' padding (see the module docs).
pub(super) fn takes(a: &QuantizedActivations, w: &PackedWeights) -> bool {
    a.amx_stride.is_some() && w.groups.is_multiple_of(TILE_K / 4)
}

/// As the VNNI kernel's `rectangle`: rows × channel blocks of the product into `out`
/// (`n_pad` i32s per row), in 32 × 32 blocks of four accumulator tiles.
///
/// # Safety
/// The CPU has AMX-INT8 and the OS granted it ([`available`]); [`takes`] holds; `out` holds
/// `rows.len() × n_pad` i32s that nothing else writes meanwhile.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rectangle(
    a: &QuantizedActivations,
    w: &PackedWeights,
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    out: *mut i32,
    n_pad: usize,
) {
    let Some(a_stride) = a.amx_stride else {
        unreachable!("`takes` was checked");
    };
    let config = TileConfig::all_full();
    // SAFETY: a valid palette-1 configuration; AMX is available (the caller's contract).
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack)) };
    let steps = w.groups / (TILE_K / 4);
    let panel = w.groups * 64;
    let mut scratch = [0i32; 2 * TILE_ROWS * 32];
    // Blocks of up to two row tiles × two channel tiles, as the VNNI kernel walks its
    // register blocks.
    walk_blocks(
        rows.clone(),
        blocks.clone(),
        2 * TILE_ROWS,
        |i, b, r, two| {
            let row_tiles = if r > TILE_ROWS { 2 } else { 1 };
            let a_ptr = a.bytes.as_ptr().wrapping_add(a.bases[i]);
            let w_ptr = w.bytes.as_ptr().wrapping_add(b * panel);
            let at = out.wrapping_add((i - rows.start) * n_pad + (b - blocks.start) * 16);
            // A partial block (the rectangle's last rows) is stored into `scratch` and its valid
            // rows copied: the tiles always hold 16 rows.
            let full = r == row_tiles * TILE_ROWS;
            let (dst, dst_stride) = if full {
                (at, n_pad)
            } else {
                (scratch.as_mut_ptr(), 32)
            };
            let args = (a_ptr, a_stride, w_ptr, panel, steps, dst, dst_stride);
            // SAFETY: the operands' padding keeps every tile load inside them (`takes`); `dst`
            // holds row_tiles × 16 rows of `dst_stride` i32s.
            unsafe {
                match (row_tiles, two) {
                    (2, true) => block::<2, 2>(args),
                    (2, false) => block::<2, 1>(args),
                    (_, true) => block::<1, 2>(args),
                    (_, false) => block::<1, 1>(args),
                }
            }
            if !full {
                let cols = if two { 32 } else { 16 };
                for row in 0..r {
                    // SAFETY: row < r rows of the rectangle; `cols` ≤ n_pad − (b − start)·16.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            scratch.as_ptr().add(row * 32),
                            at.add(row * n_pad),
                            cols,
                        )
                    };
                }
            }
        },
    );
    // SAFETY: releases this thread's tile state (context switches then skip its 8 KB).
    unsafe { asm!("tilerelease", options(nostack)) };
}

/// `R` row tiles × `C` channel tiles: zero the accumulators, one `tdpbusd` per pair per 64
/// K values, store. Tile registers: accumulators tmm0 (r0 c0), tmm1 (r0 c1), tmm2 (r1 c0),
/// tmm3 (r1 c1); rows tmm4, tmm5; channels tmm6, tmm7.
///
/// # Safety
/// Tiles configured 16 × 64; `a` readable for `R·16` rows of `steps·64` bytes `a_stride`
/// apart; `w` for `C` panels of `steps·1024` bytes `panel` apart; `out` writable for `R·16`
/// rows of `C·16` i32s `out_stride` apart.
#[inline(always)]
unsafe fn block<const R: usize, const C: usize>(
    (a, a_stride, w, panel, steps, out, out_stride): (
        *const u8,
        usize,
        *const u8,
        usize,
        usize,
        *mut i32,
        usize,
    ),
) {
    let a1 = a.wrapping_add(TILE_ROWS * a_stride);
    let w1 = w.wrapping_add(panel);
    // SAFETY (every block below): the caller's contract.
    unsafe {
        asm!("tilezero tmm0", options(nostack, nomem));
        if C == 2 {
            asm!("tilezero tmm1", options(nostack, nomem));
        }
        if R == 2 {
            asm!("tilezero tmm2", options(nostack, nomem));
            if C == 2 {
                asm!("tilezero tmm3", options(nostack, nomem));
            }
        }
        for s in 0..steps {
            let (ka, kw) = (s * TILE_K, s * TILE_K * TILE_ROWS);
            asm!(
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm6, [{w} + {sw}*1]",
                "tdpbusd tmm0, tmm4, tmm6",
                a = in(reg) a.add(ka),
                sa = in(reg) a_stride,
                w = in(reg) w.add(kw),
                sw = in(reg) 64usize,
                options(nostack, readonly),
            );
            if C == 2 {
                asm!(
                    "tileloadd tmm7, [{w} + {sw}*1]",
                    "tdpbusd tmm1, tmm4, tmm7",
                    w = in(reg) w1.add(kw),
                    sw = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            if R == 2 {
                asm!(
                    "tileloadd tmm5, [{a} + {sa}*1]",
                    "tdpbusd tmm2, tmm5, tmm6",
                    a = in(reg) a1.add(ka),
                    sa = in(reg) a_stride,
                    options(nostack, readonly),
                );
                if C == 2 {
                    asm!("tdpbusd tmm3, tmm5, tmm7", options(nostack, nomem));
                }
            }
        }
        let so = out_stride * 4;
        let out1 = out.add(TILE_ROWS * out_stride);
        asm!("tilestored [{o} + {s}*1], tmm0", o = in(reg) out, s = in(reg) so, options(nostack));
        if C == 2 {
            asm!("tilestored [{o} + {s}*1], tmm1", o = in(reg) out.add(16), s = in(reg) so, options(nostack));
        }
        if R == 2 {
            asm!("tilestored [{o} + {s}*1], tmm2", o = in(reg) out1, s = in(reg) so, options(nostack));
            if C == 2 {
                asm!("tilestored [{o} + {s}*1], tmm3", o = in(reg) out1.add(16), s = in(reg) so, options(nostack));
            }
        }
    }
}
