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
//! - AVX2: i16 operands, `vpmaddwd` (2 products per lane, 16 per instruction, exact);
//! - portable loops otherwise. All three compute the same integers (tested).

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::activation::{Activation, activate_slice};

use serde::{Deserialize, Serialize};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod blocks;
mod portable;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vnni;

mod i8_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[i8], s: S) -> Result<S::Ok, S::Error> {
        let bytes: Vec<u8> = v.iter().map(|x| *x as u8).collect();
        s.serialize_bytes(&bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i8>, D::Error> {
        let bytes = serde_bytes::ByteBuf::deserialize(d)?;
        Ok(bytes.iter().map(|b| *b as i8).collect())
    }
}

/// Per-output-channel symmetric int8 weights of a quantized layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantWeight {
    /// Output channels (rows of `values`).
    pub rows: usize,
    /// Inputs per output channel (`in` for a linear, `in/groups · kh · kw` for a conv).
    pub cols: usize,
    /// Row-major int8 values, `rows × cols`: output channel-major, so each row is the dot
    /// product's weight vector.
    #[serde(with = "i8_bytes")]
    pub values: Vec<i8>,
    /// Dequantization scale of each output channel: `w ≈ values · scale`.
    pub scales: Vec<f32>,
}

/// 2-D convolution geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvGeometry {
    /// Stride (h, w).
    pub stride: [usize; 2],
    /// Padding (top, left, bottom, right), ONNX's order.
    pub pads: [usize; 4],
    /// Dilation (h, w).
    pub dilation: [usize; 2],
    /// Groups.
    pub groups: usize,
    /// Kernel size (h, w).
    pub kernel: [usize; 2],
}

/// Bytes past a convolution's image that a padded K-group may read (< one group; generous).
const K_SLACK: usize = 64;
/// How a batch of images is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageLayout {
    /// `[batch, channels, h, w]` (Burn's and the model's layout).
    Nchw,
    /// `[batch, h, w, channels]` (channels-last: what the int8 GEMM produces).
    Nhwc,
}

/// Largest weight magnitude (symmetric: −127..=127).
const QMAX: f32 = 127.0;

/// Rounds to the nearest integer (ties to even) with two adds: exact for |x| < 2²², and,
/// unlike `f32::round`, no libm call, so the quantization loops vectorize.
#[inline]
fn round(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³
    (x + MAGIC) - MAGIC
}

/// Quantizes a row-major `rows × cols` f32 matrix per row (per output channel).
pub fn quantize_rows(values: &[f32], rows: usize, cols: usize) -> QuantWeight {
    let mut q = Vec::with_capacity(rows * cols);
    let mut scales = Vec::with_capacity(rows);
    for row in values.chunks_exact(cols.max(1)).take(rows) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if max > 0.0 { max / QMAX } else { 1.0 };
        scales.push(scale);
        q.extend(
            row.iter()
                .map(|v| round(v / scale).clamp(-QMAX, QMAX) as i8),
        );
    }
    QuantWeight {
        rows,
        cols,
        values: q,
        scales,
    }
}

/// Which integer kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AMX `tdpbusd` tiles for plain matrices (linear layers), AVX-512 VNNI for the rest (the
    /// same weight packing).
    Amx,
    /// AVX-512 VNNI `vpdpbusd`.
    Vnni512,
    /// AVX2 `vpmaddwd` on i16 operands.
    Avx2,
    /// Portable loops (over the AVX2 packing).
    Scalar,
}

impl Kernel {
    /// The kernel int8 layers use (decided once): the best this CPU supports, or the one
    /// named by the `KILN_INT8_KERNEL` environment variable (`amx`, `avx512-vnni`, `avx2`, `scalar`)
    /// when the CPU supports it — so the AVX2 path can be measured on a VNNI machine.
    pub fn detect() -> Kernel {
        static KERNEL: OnceLock<Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            super::kernel_from_env(
                "KILN_INT8_KERNEL",
                &[Kernel::Amx, Kernel::Vnni512, Kernel::Avx2, Kernel::Scalar],
                Kernel::best_supported(),
                Kernel::name,
            )
        })
    }

    /// The best kernel this CPU supports.
    fn best_supported() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if amx::available() {
                return Kernel::Amx;
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Kernel::Vnni512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx",
            Kernel::Vnni512 => "avx512-vnni",
            Kernel::Avx2 => "avx2",
            Kernel::Scalar => "scalar",
        }
    }

    /// Multiply-adds below which [`gemm_with`] runs its tasks on the calling thread: about
    /// 50 µs of this kernel's work. Waking the pool's workers and waiting for them costs
    /// tens of microseconds; W3 at batch 1 ran 0.19 → 0.12 ms on one thread with VNNI.
    fn sequential_macs(self) -> usize {
        match self {
            // ~220 G multiply-adds/s per core: W3's batch-1 conv2 (10.6 M) stays on one thread.
            Kernel::Amx | Kernel::Vnni512 => 12 << 20,
            // A quarter of the products per instruction.
            Kernel::Avx2 | Kernel::Scalar => 3 << 20,
        }
    }

    /// K values one lane multiplies per instruction (4 u8 for VNNI and AMX, 2 i16 otherwise).
    fn group(self) -> usize {
        if self.packs_bytes() { 4 } else { 2 }
    }

    /// Output channels per vector register (16 i32 lanes, or 8).
    fn lanes(self) -> usize {
        if self.packs_bytes() { 16 } else { 8 }
    }

    /// Whether operands are packed as bytes (u8 activations, i8 weights: VNNI's and AMX's
    /// layout) rather than widened to i16.
    fn packs_bytes(self) -> bool {
        matches!(self, Kernel::Amx | Kernel::Vnni512)
    }

    /// K-groups a weight panel is padded to a multiple of: a whole AMX tile's 16.
    fn group_multiple(self) -> usize {
        if self == Kernel::Amx { 16 } else { 1 }
    }
}

/// Quantized weights packed for a kernel: channel blocks of `lanes`, and within a block, for
/// each K-group, the group's values of every channel side by side
/// (`[n / lanes][k / group][lanes][group]`, zero-padded).
#[derive(Debug, Clone)]
pub struct PackedWeights {
    /// Output channels.
    pub rows: usize,
    /// Inputs per channel (before padding).
    pub cols: usize,
    /// Per-channel dequantization scales.
    pub scales: Vec<f32>,
    /// `Σ_k q_w` per channel, for the zero-point correction.
    pub row_sums: Vec<i32>,
    kernel: Kernel,
    groups: usize,
    blocks: usize,
    bytes: Vec<u8>,
    wide: Vec<i16>,
}

impl PackedWeights {
    /// Packs `w` for `kernel`.
    pub fn new(w: &QuantWeight, kernel: Kernel) -> Self {
        let (g, l) = (kernel.group(), kernel.lanes());
        let groups = w
            .cols
            .div_ceil(g)
            .max(1)
            .next_multiple_of(kernel.group_multiple());
        let blocks = w.rows.div_ceil(l).max(1);
        let index = |j: usize, k: usize| ((j / l) * groups + k / g) * l * g + (j % l) * g + k % g;
        let len = blocks * groups * l * g;
        let (mut bytes, mut wide) = (Vec::new(), Vec::new());
        if kernel.packs_bytes() {
            bytes = vec![0u8; len];
        } else {
            wide = vec![0i16; len];
        }
        for j in 0..w.rows {
            for k in 0..w.cols {
                let v = w.values[j * w.cols + k];
                if kernel.packs_bytes() {
                    bytes[index(j, k)] = v as u8; // i8 bit pattern
                } else {
                    wide[index(j, k)] = v as i16;
                }
            }
        }
        PackedWeights {
            rows: w.rows,
            cols: w.cols,
            scales: w.scales.clone(),
            row_sums: w
                .values
                .chunks_exact(w.cols.max(1))
                .take(w.rows)
                .map(|r| r.iter().map(|v| *v as i32).sum())
                .collect(),
            kernel,
            groups,
            blocks,
            bytes,
            wide,
        }
    }

    /// The kernel these weights are packed for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }
}

/// Values scanned per task when finding an activation's range (and below which one thread
/// scans them all).
const PARALLEL_SCAN: usize = 1 << 15;

/// `(min(x, 0), max(x, 0))`, NaNs ignored, with AVX2's packed min/max where the CPU has it:
/// the scan runs on every row the int8 GEMM writes, and the portable loop compiles to SSE2
/// compare-and-blend sequences at several times the cost (it was a quarter of W3's int8 time).
fn min_max(x: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { avx2::min_max(x) };
    }
    min_max_portable(x)
}

/// [`min_max`] without SIMD intrinsics (comparisons, not `f32::min`, so a NaN never wins).
fn min_max_portable(x: &[f32]) -> (f32, f32) {
    x.iter().fold((0f32, 0f32), |(lo, hi), v| {
        (if *v < lo { *v } else { lo }, if *v > hi { *v } else { hi })
    })
}

/// `(min(x, 0), max(x, 0))` of activations, NaNs ignored: the range dynamic quantization
/// covers.
pub fn range_of(x: &[f32]) -> (f32, f32) {
    // Small inputs (batch 1) are scanned on this thread: a rayon dispatch costs more.
    if x.len() < PARALLEL_SCAN {
        min_max(x)
    } else {
        x.par_chunks(PARALLEL_SCAN)
            .map(min_max)
            .reduce(|| (0.0, 0.0), widest)
    }
}

/// The union of two `(lo, hi)` ranges.
fn widest(a: (f32, f32), b: (f32, f32)) -> (f32, f32) {
    (a.0.min(b.0), a.1.max(b.1))
}

/// Per-batch activation quantization parameters: `x ≈ (q − zero_point) · scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationQuant {
    /// Step size.
    pub scale: f32,
    /// The quantized value of 0.0 (so padding is exact).
    pub zero_point: u8,
}

impl ActivationQuant {
    /// Parameters covering `[min(x, 0), max(x, 0)]` with 256 levels.
    pub fn for_values(x: &[f32]) -> Self {
        Self::for_range(range_of(x))
    }

    /// Parameters covering `(lo, hi)` = `(min(x, 0), max(x, 0))` with 256 levels, for values
    /// whose range is already known (see [`matmul_dequantized`]).
    pub fn for_range((lo, hi): (f32, f32)) -> Self {
        let (lo, hi) = (lo.min(0.0), hi.max(0.0));
        let range = hi - lo;
        if !(range > 0.0 && range.is_finite()) {
            return ActivationQuant {
                scale: 1.0,
                zero_point: 0,
            };
        }
        let scale = range / 255.0;
        let zero_point = round(-lo / scale).clamp(0.0, 255.0) as u8;
        ActivationQuant { scale, zero_point }
    }

    /// Quantizes one value.
    #[inline]
    pub fn quantize(&self, v: f32) -> u8 {
        self.quantizer()(v)
    }

    /// A fast quantizing closure: multiply by the precomputed inverse scale, clamp (NaN goes
    /// to 0: `max` drops it), and read the rounded integer out of the mantissa after adding
    /// 1.5·2²³ — no division, no libm call and no saturating float→int conversion, so loops
    /// over it vectorize.
    #[inline]
    pub fn quantizer(&self) -> impl Fn(f32) -> u8 + Copy {
        let inv = 1.0 / self.scale;
        let zp = self.zero_point as f32;
        move |v: f32| {
            // Not `clamp`: clamp keeps NaN, and NaN must not reach the bit trick.
            #[allow(clippy::manual_clamp)]
            let y = (v * inv + zp).max(0.0).min(255.0);
            ((y + 12_582_912.0).to_bits() & 0xFF) as u8
        }
    }
}

/// Quantized activations as the left operand of [`gemm()`]: `rows` rows of `cols` values.
///
/// A row need not be contiguous: row `i`'s K-group `q` starts at element
/// `bases[i] + k_offsets[q]`. A plain matrix has `bases[i] = i·stride`, `k_offsets[q] = q·g`;
/// a convolution's rows are output pixels over a padded NHWC image, and its K-groups are the
/// kernel taps' channel groups — an implicit GEMM, with no patch matrix materialized.
#[derive(Debug, Clone)]
pub struct QuantizedActivations {
    /// Rows.
    pub rows: usize,
    /// Values per row (K, including any channel padding).
    pub cols: usize,
    /// Quantization parameters.
    pub quant: ActivationQuant,
    kernel: Kernel,
    bases: Vec<usize>,
    k_offsets: Vec<usize>,
    bytes: Vec<u8>,
    wide: Vec<i16>,
    /// For the AMX kernel, the row stride of a plain matrix whose rows and K are padded for
    /// whole tiles (see `amx`); `None` for operands it cannot read (a convolution's).
    amx_stride: Option<usize>,
}

impl QuantizedActivations {
    /// Quantizes row-major `x` (`cols` per row) for `kernel`: rows padded to the kernel's
    /// K-group (and for AMX to whole tiles) with the zero point, i.e. 0.0.
    ///
    /// Rows go over the pool in tasks of at least [`PARALLEL_SCAN`] values (one task per row
    /// was a thousand tasks for BERT-base at batch 8), each row quantized by a vectorized loop
    /// and its padding written beside it, with no zero-point fill of the whole matrix first.
    pub fn new(x: &[f32], cols: usize, quant: ActivationQuant, kernel: Kernel) -> Self {
        let rows = x.len() / cols.max(1);
        let g = kernel.group();
        let stride = cols
            .div_ceil(g)
            .max(1)
            .next_multiple_of(kernel.group_multiple())
            * g;
        // AMX loads 16 rows at a time: the rows past the last are zero-point padding.
        let padded_rows = if kernel == Kernel::Amx {
            rows.next_multiple_of(16)
        } else {
            rows
        };
        let total = padded_rows * stride;
        let (inv, zp) = (1.0 / quant.scale, quant.zero_point);
        let mut bytes: Vec<u8> = Vec::with_capacity(total);
        let out = &mut bytes.spare_capacity_mut()[..total];
        let (body, tail) = out.split_at_mut(rows * stride);
        let rows_per_task = (PARALLEL_SCAN / stride).max(1);
        let task = |(t, chunk): (usize, &mut [MaybeUninit<u8>])| {
            for (i, row) in chunk.chunks_mut(stride).enumerate() {
                let r = t * rows_per_task + i;
                let (values, pad) = row.split_at_mut(cols);
                quantize_into(&x[r * cols..(r + 1) * cols], values, inv, zp);
                pad.fill(MaybeUninit::new(zp));
            }
        };
        if rows <= rows_per_task {
            task((0, body));
        } else {
            body.par_chunks_mut(rows_per_task * stride)
                .enumerate()
                .for_each(task);
        }
        tail.fill(MaybeUninit::new(zp));
        // SAFETY: every row's values and padding and every padding row were written above.
        unsafe { bytes.set_len(total) };
        let mut op = Self::assemble(
            rows,
            cols,
            quant,
            kernel,
            (0..rows).map(|i| i * stride).collect(),
            (0..stride / g).map(|q| q * g).collect(),
            bytes,
        );
        if kernel == Kernel::Amx {
            op.amx_stride = Some(stride);
        }
        op
    }

    /// The implicit-GEMM operand of a convolution over `x` (`[b, ci, h, w]` images stored as
    /// `stored`): the input is quantized once into a zero-point-padded NHWC image (channels
    /// padded to the K-group); row `(n, oy, ox)` is an output pixel, K runs over (ky, kx,
    /// channel). Returns the operand and the output size (ho, wo). Pack the weights with
    /// [`pack_conv_weights`].
    pub fn for_conv(
        x: &[f32],
        [b, ci, h, w]: [usize; 4],
        stored: ImageLayout,
        geometry: &ConvGeometry,
        quant: ActivationQuant,
        kernel: Kernel,
    ) -> (Self, usize, usize) {
        let g = kernel.group();
        let layout = ConvLayout::new(ci, geometry, kernel);
        // Row runs read kw·ci contiguous bytes, so channels need no padding; per-tap runs
        // read ci, padded to the group.
        let cp = if layout.row_runs {
            ci
        } else {
            layout.run_padded
        };
        let [kh, kw] = geometry.kernel;
        let [top, left, bottom, right] = geometry.pads;
        let [sh, sw] = geometry.stride;
        let [dh, dw] = geometry.dilation;
        let (hp, wp) = (h + top + bottom, w + left + right);
        let ho = (hp - dh * (kh - 1) - 1) / sh + 1;
        let wo = (wp - dw * (kw - 1) - 1) / sw + 1;
        let q = quant.quantizer();
        // A run's padding may read up to g − 1 bytes past the image: slack at the end keeps
        // those reads in bounds (their weights are zero).
        let image = b * hp * wp * cp;
        let mut bytes = vec![quant.zero_point; image + K_SLACK];
        let fill_row = |(row, out): (usize, &mut [u8])| {
            let (n, yp) = (row / hp, row % hp);
            if yp < top || yp >= top + h {
                return;
            }
            let y = yp - top;
            match stored {
                ImageLayout::Nchw => {
                    for c in 0..ci {
                        let src = &x[((n * ci + c) * h + y) * w..][..w];
                        for (xx, v) in src.iter().enumerate() {
                            out[(xx + left) * cp + c] = q(*v);
                        }
                    }
                }
                // Channels-last input: the row is already in the operand's order, one
                // contiguous quantizing pass when the channels need no padding.
                ImageLayout::Nhwc => {
                    let src = &x[(n * h + y) * w * ci..][..w * ci];
                    if cp == ci {
                        for (o, v) in out[left * ci..][..w * ci].iter_mut().zip(src) {
                            *o = q(*v);
                        }
                    } else {
                        for (xx, px) in src.chunks_exact(ci).enumerate() {
                            for (o, v) in out[(xx + left) * cp..][..ci].iter_mut().zip(px) {
                                *o = q(*v);
                            }
                        }
                    }
                }
            }
        };
        // Small images (batch 1) are quantized on this thread: a rayon dispatch costs more.
        if image < PARALLEL_SCAN {
            bytes[..image]
                .chunks_mut(wp * cp)
                .enumerate()
                .for_each(fill_row);
        } else {
            bytes[..image]
                .par_chunks_mut(wp * cp)
                .enumerate()
                .for_each(fill_row);
        }
        let plane = ho * wo;
        let bases = (0..b * plane)
            .map(|i| {
                let (n, p) = (i / plane, i % plane);
                let (oy, ox) = (p / wo, p % wo);
                ((n * hp + oy * sh) * wp + ox * sw) * cp
            })
            .collect();
        let mut k_offsets = Vec::with_capacity(layout.cols() / g);
        for r in 0..layout.runs {
            let start = if layout.row_runs {
                r * dh * wp * cp
            } else {
                let (ky, kx) = (r / kw, r % kw);
                (ky * dh * wp + kx * dw) * cp
            };
            for t in 0..layout.run_padded / g {
                k_offsets.push(start + t * g);
            }
        }
        let op = Self::assemble(
            b * plane,
            layout.cols(),
            quant,
            kernel,
            bases,
            k_offsets,
            bytes,
        );
        (op, ho, wo)
    }

    fn assemble(
        rows: usize,
        cols: usize,
        quant: ActivationQuant,
        kernel: Kernel,
        bases: Vec<usize>,
        k_offsets: Vec<usize>,
        mut bytes: Vec<u8>,
    ) -> Self {
        let wide = if kernel.packs_bytes() {
            Vec::new()
        } else {
            let wide: Vec<i16> = bytes.par_iter().map(|v| *v as i16).collect();
            bytes = Vec::new();
            wide
        };
        QuantizedActivations {
            rows,
            cols,
            quant,
            kernel,
            bases,
            k_offsets,
            bytes,
            wide,
            amx_stride: None,
        }
    }
}

multiversion! {
    /// `dst[i] = quantize(src[i])` with [`ActivationQuant::quantizer`]'s arithmetic (the same
    /// bits), vectorized for the instruction set the CPU has.
    fn quantize_into(src: &[f32], dst: &mut [MaybeUninit<u8>], inv: f32, zero_point: u8) {
        let zp = zero_point as f32;
        for (o, v) in dst.iter_mut().zip(src) {
            // Not `clamp`: clamp keeps NaN, and NaN must not reach the bit trick.
            #[allow(clippy::manual_clamp)]
            let y = (v * inv + zp).max(0.0).min(255.0);
            *o = MaybeUninit::new(((y + 12_582_912.0).to_bits() & 0xFF) as u8);
        }
    }
}

/// How a convolution's K is laid out over the NHWC image.
///
/// With unit horizontal dilation, one kernel row's `kw` taps of all channels are `kw·ci`
/// contiguous bytes of the NHWC image, so K is `kh` runs of `kw·ci` values, each padded to the
/// K-group (`run_padded`): a 1-channel 3×3 conv has K = 3 × 4 = 12, not 9 taps × 4. Otherwise
/// each tap is its own run of `ci` values padded to the group.
#[derive(Debug, Clone, Copy)]
struct ConvLayout {
    /// Runs per output pixel (kh, or kh·kw per tap).
    runs: usize,
    /// Values per run after padding to the K-group.
    run_padded: usize,
    /// Whether runs span whole kernel rows.
    row_runs: bool,
}

impl ConvLayout {
    fn new(ci: usize, geometry: &ConvGeometry, kernel: Kernel) -> Self {
        let g = kernel.group();
        let [kh, kw] = geometry.kernel;
        let row_runs = geometry.dilation[1] == 1;
        let (runs, run) = if row_runs {
            (kh, kw * ci)
        } else {
            (kh * kw, ci)
        };
        ConvLayout {
            runs,
            run_padded: run.div_ceil(g) * g,
            row_runs,
        }
    }

    fn cols(&self) -> usize {
        self.runs * self.run_padded
    }
}

/// Packs conv weights `[co][ci][kh][kw]` for [`QuantizedActivations::for_conv`]: K reordered
/// to the NHWC runs of `ConvLayout` (zeros in the padding, so over-read bytes contribute 0).
pub fn pack_conv_weights(
    w: &QuantWeight,
    ci: usize,
    geometry: &ConvGeometry,
    kernel: Kernel,
) -> PackedWeights {
    let [kh, kw] = geometry.kernel;
    let layout = ConvLayout::new(ci, geometry, kernel);
    let cols = layout.cols();
    let mut values = vec![0i8; w.rows * cols];
    for co in 0..w.rows {
        for c in 0..ci {
            for ky in 0..kh {
                for kx in 0..kw {
                    let k = if layout.row_runs {
                        ky * layout.run_padded + kx * ci + c
                    } else {
                        (ky * kw + kx) * layout.run_padded + c
                    };
                    values[co * cols + k] = w.values[((co * ci + c) * kh + ky) * kw + kx];
                }
            }
        }
    }
    let reordered = QuantWeight {
        rows: w.rows,
        cols,
        values,
        scales: w.scales.clone(),
    };
    PackedWeights::new(&reordered, kernel)
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
        super::nhwc::arith_in_place(
            row,
            &r[i * stride..][..cols],
            super::nhwc::Arith::Add,
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

/// A raw output pointer shared by the tasks of [`gemm_with`]'s epilogues, each writing its
/// own disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut<T>(*mut T);
// SAFETY: tasks write disjoint elements (see the callers).
unsafe impl<T> Sync for SharedOut<T> {}
unsafe impl<T> Send for SharedOut<T> {}

impl<T> SharedOut<T> {
    fn get(self) -> *mut T {
        self.0
    }
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
        Kernel::Amx if amx::available() && amx::takes(a, w) => unsafe {
            amx::rectangle(a, w, rows, blocks, out, n_pad)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX CPUs have AVX-512 VNNI (checked with AMX), and the packing is the same.
        Kernel::Amx => unsafe { vnni::rectangle(a, w, rows, blocks, out, n_pad) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: VNNI packing is only produced when `Kernel::detect` found the features.
        Kernel::Vnni512 => unsafe { vnni::rectangle(a, w, rows, blocks, out, n_pad) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2.
        Kernel::Avx2 => unsafe { avx2::rectangle(a, w, rows, blocks, out, n_pad) },
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
