//! Int8 dynamic quantization and an integer matrix multiply with i32 accumulation.
//!
//! Weights: per-output-channel symmetric int8 (`w ≈ q · s_c`, q ∈ [−127, 127]).
//! Activations: per-batch symmetric int8 with one scale (`x ≈ q · s_x`), computed on each call
//! (dynamic quantization, as torch's `quantize_dynamic` and ONNX Runtime's dynamic mode).
//! Product: `Σ q_x · q_w` in i32, exact; the result is dequantized with `s_x · s_c`.
//!
//! The kernel widens int8 to i16 once (weights at session build, activations when they are
//! quantized) and multiplies with AVX2's `vpmaddwd` — 16 multiply-adds of i16 pairs into i32
//! per instruction, twice the lanes of an f32 FMA, and no saturation (the 8-bit alternative
//! `vpmaddubsw` saturates at i16 and would need 7-bit weights). Without AVX2 a portable loop
//! computes the same integers.

use rayon::prelude::*;

use super::graph::QuantWeight;

/// Largest quantized magnitude (symmetric: −127..=127, so negation never overflows).
const QMAX: f32 = 127.0;
/// The kernel consumes K in chunks of this many i16 (one 256-bit register).
pub const K_ALIGN: usize = 16;

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
                .map(|v| (v / scale).round().clamp(-QMAX, QMAX) as i8),
        );
    }
    QuantWeight {
        rows,
        cols,
        values: q,
        scales,
    }
}

/// Rounds `k` up to the kernel's chunk size.
pub fn padded(k: usize) -> usize {
    k.div_ceil(K_ALIGN) * K_ALIGN
}

/// A matrix widened to i16, each row zero-padded to [`padded`] columns.
#[derive(Debug, Clone)]
pub struct I16Matrix {
    /// Rows.
    pub rows: usize,
    /// Columns before padding.
    pub cols: usize,
    /// `rows × padded(cols)` values.
    pub data: Vec<i16>,
}

impl I16Matrix {
    /// Widens quantized weights for the kernel.
    pub fn from_weights(w: &QuantWeight) -> Self {
        let kp = padded(w.cols);
        let mut data = vec![0i16; w.rows * kp];
        for (dst, src) in data.chunks_exact_mut(kp).zip(w.values.chunks_exact(w.cols)) {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *s as i16;
            }
        }
        I16Matrix {
            rows: w.rows,
            cols: w.cols,
            data,
        }
    }

    /// Row stride in elements.
    pub fn stride(&self) -> usize {
        padded(self.cols)
    }
}

/// The scale that maps `max |x|` to 127 (1 for an all-zero tensor).
pub fn activation_scale(x: &[f32]) -> f32 {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max > 0.0 && max.is_finite() {
        max / QMAX
    } else {
        1.0
    }
}

/// Quantizes `x` (row-major, `cols` per row) with `scale` into a padded i16 matrix.
pub fn quantize_activations(x: &[f32], cols: usize, scale: f32) -> I16Matrix {
    let rows = x.len() / cols.max(1);
    let kp = padded(cols);
    let inv = 1.0 / scale;
    let mut data = vec![0i16; rows * kp];
    data.par_chunks_mut(kp)
        .zip(x.par_chunks(cols.max(1)))
        .for_each(|(dst, src)| {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = (s * inv).round().clamp(-QMAX, QMAX) as i16;
            }
        });
    I16Matrix { rows, cols, data }
}

/// `out[i·n + j] = Σ_k a[i][k] · b[j][k]` in i32 (both operands row-major over K, i.e.
/// `A · Bᵀ`). Parallel over whichever side is larger, so each thread streams the smaller
/// operand from cache.
pub fn gemm_abt(a: &I16Matrix, b: &I16Matrix) -> Vec<i32> {
    assert_eq!(a.cols, b.cols, "inner dimensions differ");
    let (m, n, kp) = (a.rows, b.rows, a.stride());
    let mut out = vec![0i32; m * n];
    if m == 0 || n == 0 {
        return out;
    }
    let threads = rayon::current_num_threads().max(1);
    if m >= n {
        // Blocks of A rows; every block sees all of B.
        let block = (m.div_ceil(threads * 4)).clamp(2, 64);
        out.par_chunks_mut(block * n)
            .enumerate()
            .for_each(|(bi, chunk)| {
                let i0 = bi * block;
                let rows = chunk.len() / n;
                tile(
                    &a.data[i0 * kp..(i0 + rows) * kp],
                    &b.data,
                    rows,
                    n,
                    kp,
                    chunk,
                    n,
                    1,
                );
            });
    } else {
        // Blocks of B rows, computed transposed (each block's rows of Cᵀ are contiguous).
        let block = (n.div_ceil(threads * 4)).clamp(4, 64);
        let mut out_t = vec![0i32; n * m];
        out_t
            .par_chunks_mut(block * m)
            .enumerate()
            .for_each(|(bj, chunk)| {
                let j0 = bj * block;
                let cols = chunk.len() / m;
                // Cᵀ[j][i] = Σ b[j]·a[i]: the same kernel with the operands swapped.
                tile(
                    &b.data[j0 * kp..(j0 + cols) * kp],
                    &a.data,
                    cols,
                    m,
                    kp,
                    chunk,
                    m,
                    1,
                );
            });
        for j in 0..n {
            for i in 0..m {
                out[i * n + j] = out_t[j * m + i];
            }
        }
    }
    out
}

/// Computes `rows × n` dot products of `a` rows with `b` rows into `out` (row stride
/// `out_stride`, column step `out_step`).
#[allow(clippy::too_many_arguments)]
fn tile(
    a: &[i16],
    b: &[i16],
    rows: usize,
    n: usize,
    kp: usize,
    out: &mut [i32],
    out_stride: usize,
    out_step: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked above); slices are sized rows·kp and n·kp with
            // kp a multiple of 16, which is all the kernel reads.
            unsafe { avx2::tile(a, b, rows, n, kp, out, out_stride, out_step) };
            return;
        }
    }
    for i in 0..rows {
        for j in 0..n {
            out[i * out_stride + j * out_step] = dot_scalar(&a[i * kp..][..kp], &b[j * kp..][..kp]);
        }
    }
}

fn dot_scalar(a: &[i16], b: &[i16]) -> i32 {
    a.iter().zip(b).map(|(x, y)| *x as i32 * *y as i32).sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Horizontal sum of eight i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(v: __m256i) -> i32 {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256(v, 1);
        let s = _mm_add_epi32(lo, hi);
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(p: *const i16) -> __m256i {
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }

    /// 2 rows of A × 4 rows of B per step: 8 accumulators + 6 operands fit the 16 registers.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tile(
        a: &[i16],
        b: &[i16],
        rows: usize,
        n: usize,
        kp: usize,
        out: &mut [i32],
        out_stride: usize,
        out_step: usize,
    ) {
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        let mut j = 0;
        while j + 4 <= n {
            let mut i = 0;
            while i + 2 <= rows {
                let mut acc = [_mm256_setzero_si256(); 8];
                let mut k = 0;
                while k < kp {
                    unsafe {
                        let a0 = load(ap.add(i * kp + k));
                        let a1 = load(ap.add((i + 1) * kp + k));
                        for c in 0..4 {
                            let bv = load(bp.add((j + c) * kp + k));
                            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(a0, bv));
                            acc[4 + c] = _mm256_add_epi32(acc[4 + c], _mm256_madd_epi16(a1, bv));
                        }
                    }
                    k += 16;
                }
                for c in 0..4 {
                    unsafe {
                        out[i * out_stride + (j + c) * out_step] = hsum(acc[c]);
                        out[(i + 1) * out_stride + (j + c) * out_step] = hsum(acc[4 + c]);
                    }
                }
                i += 2;
            }
            while i < rows {
                for c in 0..4 {
                    out[i * out_stride + (j + c) * out_step] =
                        unsafe { dot(ap.add(i * kp), bp.add((j + c) * kp), kp) };
                }
                i += 1;
            }
            j += 4;
        }
        while j < n {
            for i in 0..rows {
                out[i * out_stride + j * out_step] =
                    unsafe { dot(ap.add(i * kp), bp.add(j * kp), kp) };
            }
            j += 1;
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn dot(a: *const i16, b: *const i16, kp: usize) -> i32 {
        let mut acc = _mm256_setzero_si256();
        let mut k = 0;
        while k < kp {
            unsafe {
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(load(a.add(k)), load(b.add(k))));
            }
            k += 16;
        }
        unsafe { hsum(acc) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn integer_gemm_is_exact_for_every_shape_and_split() {
        let mut seed = 7;
        // Odd sizes exercise every remainder path; m<n and m>n both partitionings.
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 17),
            (64, 10, 100),
            (7, 130, 33),
            (130, 6, 48),
        ] {
            let av: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let bv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
            let a = quantize_activations(&av, k, activation_scale(&av));
            let b = I16Matrix::from_weights(&quantize_rows(&bv, n, k));
            let got = gemm_abt(&a, &b);
            for i in 0..m {
                for j in 0..n {
                    let want = dot_scalar(
                        &a.data[i * a.stride()..][..k],
                        &b.data[j * b.stride()..][..k],
                    );
                    assert_eq!(got[i * n + j], want, "({m},{n},{k}) at ({i},{j})");
                }
            }
        }
    }

    #[test]
    fn quantization_round_trips_within_half_a_step() {
        let w = [0.5f32, -1.0, 0.25, 0.0, 2.0, -2.0];
        let q = quantize_rows(&w, 2, 3);
        assert_eq!(q.values[1], -127);
        assert_eq!(q.values[4], 127);
        for r in 0..2 {
            for c in 0..3 {
                let back = q.values[r * 3 + c] as f32 * q.scales[r];
                assert!((back - w[r * 3 + c]).abs() <= q.scales[r] / 2.0 + 1e-7);
            }
        }
        // An all-zero row gets scale 1, not a division by zero.
        let z = quantize_rows(&[0.0; 4], 1, 4);
        assert_eq!(z.scales, vec![1.0]);
        assert!(z.values.iter().all(|v| *v == 0));
    }
}
