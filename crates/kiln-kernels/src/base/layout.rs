//! Layout transposes between NCHW and channels-last (NHWC) images, and the interleave that
//! turns an RGB row into pixels. The output is written once (never zero-filled first), in
//! L1-sized blocks, over the pool above [`PARALLEL_MIN`] values.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::buffers::filled;
use super::isa::F32Kernel;
use super::threads::PARALLEL_MIN;

/// `[batch, channels, h, w]` values to channels-last `[batch, h, w, channels]`.
pub fn nchw_to_nhwc(x: &[f32], [b, c, h, w]: [usize; 4]) -> Vec<f32> {
    transpose_images(x, b, [c, h * w])
}

/// Channels-last `[batch, h, w, channels]` values to `[batch, channels, h, w]`.
pub fn nhwc_to_nchw(x: &[f32], [b, h, w, c]: [usize; 4]) -> Vec<f32> {
    transpose_images(x, b, [h * w, c])
}

/// [`nhwc_to_nchw`] into `y` (as long as `x`; every value written).
pub(crate) fn nhwc_to_nchw_into(x: &[f32], [b, h, w, c]: [usize; 4], y: &mut [MaybeUninit<f32>]) {
    assert_eq!(x.len(), b * h * w * c, "transpose input length");
    assert_eq!(y.len(), x.len(), "transpose output length");
    transpose_into(x, [h * w, c], y);
}

/// Side of the square blocks the transpose moves: 16 × 16 values read and written stay in
/// L1 (a plain column walk misses a cache line per value on large images).
const TRANSPOSE_BLOCK: usize = 16;

/// Transposes each of the `b` row-major `[rows, cols]` matrices in `x`.
///
/// The output is written once, not zero-filled first (a serial pass as long as the transpose
/// itself on a batch's input images: BENCHMARKS.md run 40).
fn transpose_images(x: &[f32], b: usize, [rows, cols]: [usize; 2]) -> Vec<f32> {
    assert_eq!(x.len(), b * rows * cols, "transpose input length");
    filled(x.len(), |y| transpose_into(x, [rows, cols], y))
}

/// [`transpose_images`] into `y` (`x.len()` values, every one written).
fn transpose_into(x: &[f32], [rows, cols]: [usize; 2], y: &mut [MaybeUninit<f32>]) {
    let plane = rows * cols;
    if plane == 0 || rows == 1 || cols == 1 {
        y.write_copy_of_slice(x);
        return;
    }
    match rows {
        2 => return few_rows::<2>(x, y, cols),
        3 => return few_rows::<3>(x, y, cols),
        4 => return few_rows::<4>(x, y, cols),
        _ => {}
    }
    // Task: one image's band of TRANSPOSE_BLOCK source columns = a contiguous run of
    // output rows, walked in square blocks.
    #[cfg(target_arch = "x86_64")]
    let simd = F32Kernel::detect() != F32Kernel::Portable;
    let band = |src: &[f32], (k, out): (usize, &mut [MaybeUninit<f32>])| {
        let c0 = k * TRANSPOSE_BLOCK;
        let c1 = (c0 + TRANSPOSE_BLOCK).min(cols);
        for r0 in (0..rows).step_by(TRANSPOSE_BLOCK) {
            #[cfg(target_arch = "x86_64")]
            if simd && c1 - c0 == TRANSPOSE_BLOCK && r0 + TRANSPOSE_BLOCK <= rows {
                for (dr, dc) in [(0, 0), (0, 8), (8, 0), (8, 8)] {
                    let from = src[(r0 + dr) * cols + c0 + dc..].as_ptr();
                    let to = out[dc * rows + r0 + dr..].as_mut_ptr().cast::<f32>();
                    // SAFETY: AVX2 + FMA (a SIMD kernel was detected); the 8×8 block's rows
                    // lie inside `src` (`r0 + 16 ≤ rows`, `c0 + 16 ≤ cols`) and its
                    // transposed rows inside the band (`out` holds 16 output rows of `rows`).
                    unsafe { transpose8x8(from, cols, to, rows) };
                }
                continue;
            }
            for r in r0..(r0 + TRANSPOSE_BLOCK).min(rows) {
                for (j, &v) in src[r * cols..][c0..c1].iter().enumerate() {
                    out[j * rows + r] = MaybeUninit::new(v);
                }
            }
        }
    };
    let band_len = rows * TRANSPOSE_BLOCK;
    let image = |(out, src): (&mut [MaybeUninit<f32>], &[f32])| {
        if plane < PARALLEL_MIN {
            out.chunks_mut(band_len)
                .enumerate()
                .for_each(|t| band(src, t));
        } else {
            out.par_chunks_mut(band_len)
                .enumerate()
                .for_each(|t| band(src, t));
        }
    };
    // Many small images (a batch's feature maps before a Flatten) split by image.
    if plane < PARALLEL_MIN && x.len() >= PARALLEL_MIN {
        y.par_chunks_mut(plane)
            .zip(x.par_chunks(plane))
            .for_each(image);
    } else {
        y.chunks_mut(plane).zip(x.chunks(plane)).for_each(image);
    }
}

/// The 8×8 block at `src` (rows `src_stride` apart) transposed to `dst` (rows `dst_stride`
/// apart) in AVX registers: the scalar walk moved ~3.4 GB/s, and the Winograd training
/// convolution turns every layer's input and output with it (BENCHMARKS.md run 47).
///
/// # Safety
/// The CPU has AVX2; `src` is valid for 8 reads at each of its 8 rows, `dst` for 8 writes at
/// each of its 8 rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8x8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    let r: [__m256; 8] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * src_stride)) });
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // Pairs of rows interleaved; now groups of four columns.
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    for i in 0..4 {
        // SAFETY: the caller's contract.
        unsafe {
            _mm256_storeu_ps(
                dst.add(i * dst_stride),
                _mm256_permute2f128_ps::<0x20>(u[i], u[i + 4]),
            );
            _mm256_storeu_ps(
                dst.add((i + 4) * dst_stride),
                _mm256_permute2f128_ps::<0x31>(u[i], u[i + 4]),
            );
        }
    }
}

/// [`transpose_images`] of `[R, cols]` matrices (an RGB input to channels-last): each output
/// pixel gathers its `R` values from `R` sequential streams. The square blocks' bands would
/// be 16 pixels of `R` values each: at `R = 3` the stem's input cost 182 µs for 150 K values
/// (profiled on EfficientNet-B0 at batch 1), several times a memory pass.
fn few_rows<const R: usize>(x: &[f32], y: &mut [MaybeUninit<f32>], cols: usize) {
    /// Output pixels per task.
    const PIXELS: usize = 1 << 13;
    let plane = R * cols;
    let task = |src: &[f32], (t, out): (usize, &mut [MaybeUninit<f32>])| {
        let p0 = t * PIXELS;
        if R == 3 {
            let n = out.len() / 3;
            let row = |r: usize| &src[r * cols + p0..][..n];
            return interleave3(row(0), row(1), row(2), out);
        }
        for (i, px) in out.chunks_exact_mut(R).enumerate() {
            for (r, v) in px.iter_mut().enumerate() {
                *v = MaybeUninit::new(src[r * cols + p0 + i]);
            }
        }
    };
    for (out, src) in y.chunks_mut(plane).zip(x.chunks(plane)) {
        if plane < PARALLEL_MIN {
            out.chunks_mut(R * PIXELS)
                .enumerate()
                .for_each(|t| task(src, t));
        } else {
            out.par_chunks_mut(R * PIXELS)
                .enumerate()
                .for_each(|t| task(src, t));
        }
    }
}

multiversion! {
    /// `out[3i + r] = [a, b, c][r][i]` for each pixel `i < out.len() / 3`: three channel rows
    /// interleaved into pixels (a row of an RGB image to channels-last). Written so LLVM
    /// vectorizes it per instruction set: a value-by-value strided store (`step_by`) took
    /// 228 ns per 224-pixel row, this 36 (AVX-512), 50 (AVX2), 65 (baseline).
    pub(crate) fn interleave3(a: &[f32], b: &[f32], c: &[f32], out: &mut [MaybeUninit<f32>]) {
        let n = out.len() / 3;
        let (a, b, c, out) = (&a[..n], &b[..n], &c[..n], &mut out[..3 * n]);
        for i in 0..n {
            out[3 * i] = MaybeUninit::new(a[i]);
            out[3 * i + 1] = MaybeUninit::new(b[i]);
            out[3 * i + 2] = MaybeUninit::new(c[i]);
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::values;

    #[test]
    fn transposes_invert_each_other_and_match_the_definition() {
        for dims in [
            [2, 3, 5, 7],
            [1, 64, 56, 56],
            // Whole 16×16 blocks (in 8×8 registers) beside partial ones on both axes.
            [2, 40, 9, 7],
            [2, 24, 33, 3],
            [3, 17, 4, 1],
            [1, 1, 3, 3],
            // Few channels (an RGB or a 2- or 4-channel input): the gathering path, parallel
            // at 224² with a partial last task.
            [1, 3, 224, 224],
            [2, 4, 9, 11],
            [3, 2, 1, 5],
        ] {
            let [b, c, h, w] = dims;
            let x = values(b * c * h * w, 1);
            let nhwc = nchw_to_nhwc(&x, dims);
            for n in 0..b {
                for ch in 0..c {
                    for p in 0..h * w {
                        assert_eq!(nhwc[(n * h * w + p) * c + ch], x[(n * c + ch) * h * w + p]);
                    }
                }
            }
            assert_eq!(nhwc_to_nchw(&nhwc, [b, h, w, c]), x);
        }
    }
}
