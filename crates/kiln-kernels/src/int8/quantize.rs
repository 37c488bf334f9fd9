//! Quantization: weights per output channel (symmetric, i8), activations per call
//! (asymmetric u8, or i16 for the AVX2 kernel), laid out for the instruction set that reads
//! them, with a convolution's implicit operand over a channels-last image.

use super::*;

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

/// Largest weight magnitude (symmetric: −127..=127).
pub(super) const QMAX: f32 = 127.0;

/// Rounds to the nearest integer (ties to even) with two adds: exact for |x| < 2²², and,
/// unlike `f32::round`, no libm call, so the quantization loops vectorize.
#[inline]
pub(super) fn round(x: f32) -> f32 {
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

/// Values scanned per task when finding an activation's range (and below which one thread
/// scans them all).
pub(super) const PARALLEL_SCAN: usize = 1 << 15;

/// `(min(x, 0), max(x, 0))`, NaNs ignored, with AVX2's packed min/max where the CPU has it:
/// the scan runs on every row the int8 GEMM writes, and the portable loop compiles to SSE2
/// compare-and-blend sequences at several times the cost (it was a quarter of W3's int8 time).
pub(super) fn min_max(x: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { avx2::min_max(x) };
    }
    min_max_portable(x)
}

/// [`min_max`] without SIMD intrinsics (comparisons, not `f32::min`, so a NaN never wins).
pub(super) fn min_max_portable(x: &[f32]) -> (f32, f32) {
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
pub(super) fn widest(a: (f32, f32), b: (f32, f32)) -> (f32, f32) {
    (a.0.min(b.0), a.1.max(b.1))
}

/// Per-batch activation quantization parameters: `x ≈ (q − zero_point) · scale`,
/// `q ∈ [0, max_level]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationQuant {
    /// Step size.
    pub scale: f32,
    /// The quantized value of 0.0 (so padding is exact).
    pub zero_point: u8,
    /// The largest quantized value: 255, or 127 for a kernel that multiplies 7-bit
    /// activations (see [`Int8Kernel::max_activation`]).
    pub max_level: u8,
}

impl ActivationQuant {
    /// Parameters covering `[min(x, 0), max(x, 0)]` with 256 levels.
    pub fn for_values(x: &[f32]) -> Self {
        Self::for_range(range_of(x))
    }

    /// Parameters covering `(lo, hi)` = `(min(x, 0), max(x, 0))` with 256 levels, for values
    /// whose range is already known (see [`matmul_dequantized`]).
    pub fn for_range(range: (f32, f32)) -> Self {
        Self::for_range_levels(range, 255)
    }

    /// [`ActivationQuant::for_range`] with `max_level + 1` levels.
    pub fn for_range_levels((lo, hi): (f32, f32), max_level: u8) -> Self {
        let (lo, hi) = (lo.min(0.0), hi.max(0.0));
        let range = hi - lo;
        let max_level = max_level.max(1);
        if !(range > 0.0 && range.is_finite()) {
            return ActivationQuant {
                scale: 1.0,
                zero_point: 0,
                max_level,
            };
        }
        let top = max_level as f32;
        let scale = range / top;
        let zero_point = round(-lo / scale).clamp(0.0, top) as u8;
        ActivationQuant {
            scale,
            zero_point,
            max_level,
        }
    }

    /// These parameters as `kernel` multiplies them: the same range over the kernel's
    /// levels (AVX2's 128), unchanged for a kernel that takes all 256.
    pub fn for_kernel(self, kernel: Int8Kernel) -> Self {
        let top = kernel.max_activation();
        if self.max_level <= top {
            return self;
        }
        let lo = -(self.zero_point as f32) * self.scale;
        let hi = lo + self.max_level as f32 * self.scale;
        Self::for_range_levels((lo, hi), top)
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
        let top = self.max_level as f32;
        move |v: f32| {
            // Rounded before the zero point is added (ONNX's QuantizeLinear): adding it
            // first drops low bits, and a value just below a half would round up.
            let r = round(v * inv);
            // Not `clamp`: clamp keeps NaN, and NaN must not reach the bit trick.
            #[allow(clippy::manual_clamp)]
            let y = (r + zp).max(0.0).min(top);
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
    pub(super) kernel: Int8Kernel,
    pub(super) bases: Vec<usize>,
    pub(super) k_offsets: Vec<usize>,
    pub(super) bytes: Vec<u8>,
    pub(super) wide: Vec<i16>,
    /// For the AMX kernel, the row stride of a plain matrix whose rows and K are padded for
    /// whole tiles (see `amx`); `None` for operands it cannot read (a convolution's).
    pub(super) amx_stride: Option<usize>,
}

impl QuantizedActivations {
    /// Quantizes row-major `x` (`cols` per row) for `kernel`: rows padded to the kernel's
    /// K-group (and for AMX to whole tiles) with the zero point, i.e. 0.0.
    ///
    /// Rows go over the pool in tasks of at least [`PARALLEL_SCAN`] values (one task per row
    /// was a thousand tasks for BERT-base at batch 8), each row quantized by a vectorized loop
    /// and its padding written beside it, with no zero-point fill of the whole matrix first.
    pub fn new(x: &[f32], cols: usize, quant: ActivationQuant, kernel: Int8Kernel) -> Self {
        let quant = quant.for_kernel(kernel);
        let rows = x.len() / cols.max(1);
        let g = kernel.group();
        let stride = cols
            .div_ceil(g)
            .max(1)
            .next_multiple_of(kernel.group_multiple())
            * g;
        // AMX loads 16 rows at a time: the rows past the last are zero-point padding.
        let padded_rows = if kernel == Int8Kernel::Amx {
            rows.next_multiple_of(16)
        } else {
            rows
        };
        let total = padded_rows * stride;
        let (inv, zp, top) = (1.0 / quant.scale, quant.zero_point, quant.max_level as f32);
        let mut bytes: Vec<u8> = Vec::with_capacity(total);
        let out = &mut bytes.spare_capacity_mut()[..total];
        let (body, tail) = out.split_at_mut(rows * stride);
        let rows_per_task = (PARALLEL_SCAN / stride).max(1);
        let task = |(t, chunk): (usize, &mut [MaybeUninit<u8>])| {
            for (i, row) in chunk.chunks_mut(stride).enumerate() {
                let r = t * rows_per_task + i;
                let (values, pad) = row.split_at_mut(cols);
                quantize_into(&x[r * cols..(r + 1) * cols], values, inv, zp, top);
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
        if kernel == Int8Kernel::Amx {
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
        kernel: Int8Kernel,
    ) -> (Self, usize, usize) {
        let quant = quant.for_kernel(kernel);
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

    pub(super) fn assemble(
        rows: usize,
        cols: usize,
        quant: ActivationQuant,
        kernel: Int8Kernel,
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
