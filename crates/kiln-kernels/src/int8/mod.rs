//! Int8 dynamic quantization and an integer matrix multiply with i32 accumulation.
//!
//! - Weights: per-output-channel symmetric int8, `w ≈ q_w · s_c`, `q_w ∈ [−127, 127]`.
//! - Activations: per-batch asymmetric uint8, `x ≈ (q_x − z) · s_x`, `q_x ∈ [0, 255]`, computed
//!   on every call (dynamic quantization, as ONNX Runtime's and torch's dynamic modes). The
//!   zero point `z` makes ReLU outputs (all ≥ 0) use all 256 levels.
//! - Product: `Σ_k q_x·q_w` in i32 (exact), then
//!   `y = s_x · s_c · (acc − z · Σ_k q_w) + bias`: the zero-point term is one precomputed row
//!   sum per output channel.
//!
//! Kernels, picked at run time (`is_x86_feature_detected!`), all in the register-blocked
//! "broadcast" form of production int8 GEMMs (FBGEMM, oneDNN): weights are packed so that one
//! vector register holds the next few K values of 16 (or 8) consecutive output channels; an
//! activation's K-group is broadcast to every lane; one multiply-add instruction then advances
//! 16 (or 8) outputs at once, and no horizontal sums are needed — that matters for the short
//! K of small convolutions (W3's first layer has K = 9).
//! - AVX-512 VNNI: `vpdpbusd`, 4 u8×i8 products per lane added into i32, 64 per instruction,
//!   without the i16 saturation of AVX2's `vpmaddubsw`;
//! - AVX2: `vpmaddubsw` (u8 × i8, 2 products summed per i16 lane, 32 per instruction) then
//!   `vpmaddwd` by ones into i32 lanes — ONNX Runtime's (MLAS) and FBGEMM's AVX2 form, on the
//!   same byte operands as VNNI (half the memory traffic of widening both to i16, which is
//!   what bounds a batch-1 linear layer). An i16 pair sum of u8 × i8 can overflow
//!   (2 · 255 · 127 > 32767) and `vpmaddubsw` saturates, so this kernel's activations are
//!   quantized to 7 bits (0..=127, FBGEMM's `reduce_range`): 2 · 127 · 127 fits, every
//!   product is exact, and the weights stay the 8-bit ones every kernel reads;
//! - portable loops over i16 operands otherwise. All compute the exact integers of the
//!   quantized operands they are given (tested).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::activation::{Activation, activate_slice};
use crate::base::isa::Int8Kernel;

use serde::{Deserialize, Serialize};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod blocks;
mod pack;
mod portable;
mod quantize;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vnni;

use crate::base::threads::SharedOut;
pub use pack::*;
pub use quantize::*;

impl Int8Kernel {
    /// Multiply-adds below which [`gemm_with`] runs its tasks on the calling thread: about
    /// 50 µs of this kernel's work. Waking the pool's workers and waiting for them costs
    /// tens of microseconds; W3 at batch 1 ran 0.19 → 0.12 ms on one thread with VNNI.
    fn sequential_macs(self) -> usize {
        match self {
            // ~220 G multiply-adds/s per core: W3's batch-1 conv2 (10.6 M) stays on one thread.
            Int8Kernel::Amx | Int8Kernel::Vnni512 => 12 << 20,
            // A quarter of the products per instruction.
            Int8Kernel::Avx2 | Int8Kernel::Scalar => 3 << 20,
        }
    }

    /// K values one lane multiplies per step (4 bytes for VNNI, AMX and AVX2, 2 i16 for the
    /// portable loops).
    fn group(self) -> usize {
        if self.packs_bytes() { 4 } else { 2 }
    }

    /// Output channels per vector register (16 i32 lanes of a zmm, or 8 of a ymm).
    fn lanes(self) -> usize {
        if matches!(self, Int8Kernel::Amx | Int8Kernel::Vnni512) {
            16
        } else {
            8
        }
    }

    /// Whether operands are packed as bytes (u8 activations, i8 weights) rather than
    /// widened to i16 (the portable loops).
    fn packs_bytes(self) -> bool {
        !matches!(self, Int8Kernel::Scalar)
    }

    /// The largest quantized activation this kernel multiplies exactly: 127 for AVX2, whose
    /// `vpmaddubsw` saturates an i16 pair sum above 32767 (see the module documentation).
    pub fn max_activation(self) -> u8 {
        if self == Int8Kernel::Avx2 { 127 } else { 255 }
    }

    /// K-groups a weight panel is padded to a multiple of: a whole AMX tile's 16.
    fn group_multiple(self) -> usize {
        if self == Int8Kernel::Amx { 16 } else { 1 }
    }
}

multiversion! {
    /// `dst[i] = quantize(src[i])` with [`ActivationQuant::quantizer`]'s arithmetic (the same
    /// bits), vectorized for the instruction set the CPU has.
    fn quantize_into(src: &[f32], dst: &mut [MaybeUninit<u8>], inv: f32, zero_point: u8, top: f32) {
        let zp = zero_point as f32;
        for (o, v) in dst.iter_mut().zip(src) {
            // Rounded before the zero point is added, as ONNX's QuantizeLinear defines it:
            // adding it first drops low bits, and a value just below a half then rounds up.
            let r = (v * inv + 12_582_912.0) - 12_582_912.0;
            // Not `clamp`: clamp keeps NaN, and NaN must not reach the bit trick.
            #[allow(clippy::manual_clamp)]
            let y = (r + zp).max(0.0).min(top);
            *o = MaybeUninit::new(((y + 12_582_912.0).to_bits() & 0xFF) as u8);
        }
    }
}

/// Raw accumulators `acc[i·n + j] = Σ_k q_x[i][k] · q_w[j][k]` (before the zero-point
/// correction), row-major.
pub fn gemm(a: &QuantizedActivations, w: &PackedWeights) -> Vec<i32> {
    let n = w.rows;
    let mut out = vec![0i32; a.rows * n];
    let ptr = SharedOut(out.as_mut_ptr());
    gemm_with(a, w, |rows, chans, tile, stride| {
        for (r, i) in rows.enumerate() {
            for (c, j) in chans.clone().enumerate() {
                // SAFETY: tasks cover disjoint (row, channel) rectangles of `out`.
                unsafe { *ptr.get().add(i * n + j) = tile[r * stride + c] };
            }
        }
    });
    out
}

/// The integer product in parallel over rectangles of 64 rows × 4 channel blocks; each
/// rectangle is computed into a small task-local tile (L1/L2-resident) and handed to
/// `epilogue(rows, channels, tile, tile_stride)` at once — so the caller can dequantize,
/// apply ReLU and write its final layout without an m × n accumulator buffer.
pub fn gemm_with(
    a: &QuantizedActivations,
    w: &PackedWeights,
    epilogue: impl Fn(std::ops::Range<usize>, std::ops::Range<usize>, &[i32], usize) + Sync,
) {
    assert_eq!(a.cols, w.cols, "inner dimensions differ");
    assert_eq!(a.kernel, w.kernel, "operands packed for different kernels");
    let (m, n) = (a.rows, w.rows);
    if m == 0 || n == 0 {
        return;
    }
    let lanes = w.kernel.lanes();
    let block_chunk = 4;
    // One task per channel chunk takes every row when they fit L2 and the chunks alone keep
    // the pool busy (ViT's 197 rows no longer end in a 5-row chunk).
    let chunks = w.blocks.div_ceil(block_chunk);
    let all_rows = m * a.cols <= ROWS_IN_L2 && chunks >= 4 * rayon::current_num_threads();
    let row_chunk = if all_rows { m } else { 64 };
    let tasks: Vec<(usize, usize)> = (0..m.div_ceil(row_chunk))
        .flat_map(|ri| (0..chunks).map(move |bi| (ri, bi)))
        .collect();
    let task = |&(ri, bi): &(usize, usize)| {
        let rows = ri * row_chunk..((ri + 1) * row_chunk).min(m);
        let blocks = bi * block_chunk..((bi + 1) * block_chunk).min(w.blocks);
        let stride = blocks.len() * lanes;
        let mut tile = vec![0i32; rows.len() * stride];
        // SAFETY: the tile holds rows.len() × stride i32s and is this task's own.
        unsafe {
            rectangle(
                a,
                w,
                rows.clone(),
                blocks.clone(),
                tile.as_mut_ptr(),
                stride,
            )
        };
        let chans = blocks.start * lanes..(blocks.end * lanes).min(n);
        epilogue(rows, chans, &tile, stride);
    };
    // A small product (batch-1 layers: tens of microseconds of work) runs on this thread:
    // waking the pool's workers costs about as much as the product itself.
    if m * n * a.cols < w.kernel.sequential_macs() {
        tasks.iter().for_each(task);
    } else {
        tasks.par_iter().for_each(task);
    }
}

/// Operand bytes (rows × K) up to which one task may take every row of its channel blocks.
const ROWS_IN_L2: usize = 512 << 10;

/// Dequantizes `x`'s product with `w` straight into row-major f32 `[m × n]`:
/// `y = s_x·s_j·(acc − z·Σq_w[j]) + b[j]`, then `act(y)` when given. For a convolution's
/// operand (rows are output pixels) this is the channels-last (NHWC) output.
///
/// A ReLU is the epilogue's floor; another activation (a transformer's GELU) runs on each
/// rectangle right after it is written, while it is in cache, instead of as a pass over the
/// whole output after (BERT-base int8 at batch 1: 6 ms of a 50 ms run as a separate GELU,
/// BENCHMARKS.md run 42).
///
/// Also returns the result's [`range_of`], taken from each row while it is still in cache:
/// the next int8 layer quantizes with it instead of re-reading megabytes of activations.
pub fn matmul_dequantized(
    a: &QuantizedActivations,
    w: &PackedWeights,
    bias: Option<&[f32]>,
    act: Option<Activation>,
) -> (Vec<f32>, (f32, f32)) {
    matmul_dequantized_residual(a, w, bias, None, act)
}

/// [`matmul_dequantized`] plus `residual` (row-major `[m × n]`, the output's layout) added
/// to each rectangle right after it is dequantized, before `act`: a transformer's
/// `Add(x, Linear(·))` in the epilogue, while the rectangle is in cache, instead of a pass
/// over the whole output after (BENCHMARKS.md run 43).
///
/// # Panics
/// When `residual` does not hold `m × n` values.
pub fn matmul_dequantized_residual(
    a: &QuantizedActivations,
    w: &PackedWeights,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    act: Option<Activation>,
) -> (Vec<f32>, (f32, f32)) {
    let n = w.rows;
    if let Some(r) = residual {
        assert_eq!(
            r.len(),
            a.rows * n,
            "the residual is not the output's shape"
        );
    }
    let (scale, offset) = affine(a, w, bias);
    // The ReLU is the store's floor only when nothing is added before it.
    let (floor, after) = match (act, residual) {
        (Some(Activation::Relu), None) => (0.0, None),
        (other, _) => (f32::NEG_INFINITY, other),
    };
    let len = a.rows * n;
    // Not zero-filled first: every element is written below, and zeroing megabytes of
    // output was a pass of its own (a fifth of the memset time in W3's int8 profile).
    let mut y: Vec<f32> = Vec::with_capacity(len);
    let ptr = SharedOut(y.spare_capacity_mut().as_mut_ptr());
    let range = std::sync::Mutex::new((0f32, 0f32));
    gemm_with(a, w, |rows, chans, tile, stride| {
        let columns = Columns {
            scale: &scale[chans.clone()],
            offset: &offset[chans.clone()],
            floor,
        };
        // SAFETY: tasks cover disjoint (row, channel) rectangles of `y`'s capacity, so these
        // rows × columns of it are this task's alone.
        let local = unsafe {
            let out = ptr.get().add(rows.start * n + chans.start) as *mut f32;
            let range = dequantize_rect(tile, stride, rows.len(), &columns, out, n);
            if let Some(r) = residual {
                add_rect(
                    out,
                    &r[rows.start * n + chans.start..],
                    rows.len(),
                    chans.len(),
                    n,
                );
            }
            match (after, residual) {
                (None, None) => range,
                (None, Some(_)) => range_rect(out, rows.len(), chans.len(), n),
                (Some(act), _) => activate_rect(out, rows.len(), chans.len(), n, act),
            }
        };
        let mut range = range.lock().unwrap_or_else(|e| e.into_inner());
        *range = widest(*range, local);
    });
    // SAFETY: `gemm_with` hands every (row, channel) of the m × n result to exactly one
    // epilogue call, and each writes all of its rectangle: all `len` elements are set.
    unsafe { y.set_len(len) };
    let range = range.into_inner().unwrap_or_else(|e| e.into_inner());
    (y, range)
}

/// Adds `rows` rows of `cols` values of `r` (`stride` apart) to those at `out`.
///
/// # Safety
/// As [`activate_rect`]; `r` holds the rows.
unsafe fn add_rect(out: *mut f32, r: &[f32], rows: usize, cols: usize, stride: usize) {
    for i in 0..rows {
        // SAFETY: row i of the caller's rectangle.
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(i * stride), cols) };
        crate::channelwise::arith_in_place(
            row,
            &r[i * stride..][..cols],
            crate::channelwise::Arith::Add,
            false,
        );
    }
}

/// The range of `rows` rows of `cols` values at `out` (`stride` apart).
///
/// # Safety
/// As [`activate_rect`] (read only).
unsafe fn range_rect(out: *const f32, rows: usize, cols: usize, stride: usize) -> (f32, f32) {
    (0..rows).fold((0.0, 0.0), |range, i| {
        // SAFETY: row i of the caller's rectangle.
        let row = unsafe { std::slice::from_raw_parts(out.add(i * stride), cols) };
        widest(range, min_max(row))
    })
}

/// `act` of `rows` rows of `cols` values at `out` (`stride` apart), and their range.
///
/// # Safety
/// `out` must be valid for reads and writes of those rows, initialized, and accessed by
/// nothing else meanwhile.
unsafe fn activate_rect(
    out: *mut f32,
    rows: usize,
    cols: usize,
    stride: usize,
    act: Activation,
) -> (f32, f32) {
    (0..rows).fold((0.0, 0.0), |range, r| {
        // SAFETY: row r of the caller's rectangle.
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * stride), cols) };
        activate_slice(row, act);
        widest(range, min_max(row))
    })
}

/// Per-column constants of the dequantizing epilogue: `y = max(acc · scale + offset, floor)`.
struct Columns<'a> {
    scale: &'a [f32],
    offset: &'a [f32],
    floor: f32,
}

/// Dequantizes `rows` rows of `acc` (row stride `acc_stride`, `columns.scale.len()` values
/// each) into `out` (row stride `out_stride`) and returns the [`range_of`] what it wrote —
/// measured here, while the values are in registers, so the next int8 layer never scans its
/// input again.
///
/// # Safety
/// `out` must be valid for writes of `rows` rows of `columns.scale.len()` f32s, `out_stride`
/// apart, that nothing else accesses meanwhile; `acc` must hold the rows.
unsafe fn dequantize_rect(
    acc: &[i32],
    acc_stride: usize,
    rows: usize,
    columns: &Columns,
    out: *mut f32,
    out_stride: usize,
) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected; the rest is the caller's contract.
        return unsafe { avx2::dequantize_rect(acc, acc_stride, rows, columns, out, out_stride) };
    }
    let (cols, mut range) = (columns.scale.len(), (0f32, 0f32));
    for r in 0..rows {
        // SAFETY: row r of the caller's rectangle.
        let row = unsafe {
            dequantize_row_from(
                &acc[r * acc_stride..][..cols],
                columns,
                0,
                out.add(r * out_stride),
            )
        };
        range = widest(range, row);
    }
    range
}

/// The portable epilogue for one row from column `from` on (all of it, or the AVX2 loop's
/// tail): writes `dst[j]` for `j ≥ from` and returns their range.
///
/// # Safety
/// `dst` must be valid for writes of `row.len()` f32s.
unsafe fn dequantize_row_from(
    row: &[i32],
    columns: &Columns,
    from: usize,
    dst: *mut f32,
) -> (f32, f32) {
    let mut range = (0f32, 0f32);
    let tail = row[from..]
        .iter()
        .zip(&columns.scale[from..])
        .zip(&columns.offset[from..]);
    for (j, ((t, s), o)) in (from..row.len()).zip(tail) {
        let v = *t as f32 * s + o;
        // A comparison, not `f32::max`: a NaN (from a non-finite scale) gives the floor, as
        // `vmaxps` does in the AVX2 version.
        let v = if v > columns.floor { v } else { columns.floor };
        // SAFETY: j < row.len() (the caller's contract).
        unsafe { dst.add(j).write(v) };
        range = widest(range, (v, v));
    }
    range
}

/// Computes one rectangle of the product with the kernel the operands are packed for, into
/// `out` indexed relative to the rectangle: `(i − rows.start)·n_pad + (b − blocks.start)·lanes`.
///
/// # Safety
/// `out` must hold `rows.len() × n_pad` i32s (`n_pad ≥ blocks.len()·lanes`) that nothing else
/// writes meanwhile.
unsafe fn rectangle(
    a: &QuantizedActivations,
    w: &PackedWeights,
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    out: *mut i32,
    n_pad: usize,
) {
    match w.kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` checked the CPU and the OS's grant (once; a cached flag), so
        // operands packed for AMX by hand on another CPU take the VNNI path below instead.
        Int8Kernel::Amx if crate::base::isa::amx_available() && amx::takes(a, w) => unsafe {
            amx::rectangle(a, w, rows, blocks, out, n_pad)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX CPUs have AVX-512 VNNI (checked with AMX), and the packing is the same.
        Int8Kernel::Amx => unsafe { vnni::rectangle(a, w, rows, blocks, out, n_pad) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: VNNI packing is only produced when `Int8Kernel::detect` found the features.
        Int8Kernel::Vnni512 => unsafe { vnni::rectangle(a, w, rows, blocks, out, n_pad) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2.
        Int8Kernel::Avx2 => unsafe { avx2::rectangle(a, w, rows, blocks, out, n_pad) },
        _ => {
            // SAFETY: the caller's contract, unchanged.
            unsafe { portable::rectangle(a, w, rows, blocks, out, n_pad) }
        }
    }
}

/// Per channel, `y = acc · scale + offset` folds the activation scale, the weight scale, the
/// zero-point correction and the bias.
fn affine(
    a: &QuantizedActivations,
    w: &PackedWeights,
    bias: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let z = a.quant.zero_point as i32;
    let scale: Vec<f32> = w.scales.iter().map(|s| s * a.quant.scale).collect();
    let offset = w
        .row_sums
        .iter()
        .zip(&scale)
        .enumerate()
        .map(|(j, (s, sc))| bias.map_or(0.0, |b| b[j]) - (z * s) as f32 * sc)
        .collect();
    (scale, offset)
}
