//! Pooling on channels-last images for inference: max and average pooling with padding,
//! dilation and ceil mode, and the global average pool. Inner loops run along the channels
//! (contiguous in this layout) and are compiled per instruction set (`multiversion!`).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::threads::PARALLEL_MIN;
use crate::base::window::Window2d;

/// What a pooling window computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The maximum (padding never wins; a NaN does).
    Max,
    /// The mean over the valid cells, or with `count_include_pad` over the padded window.
    Average {
        /// Divide by the window's cells inside the padded input, not only the valid ones.
        count_include_pad: bool,
    },
}

/// Max or average pooling of a channels-last image.
pub fn pool2d(x: &[f32], win: &Window2d, kind: PoolKind) -> Vec<f32> {
    let [b, h, w, c] = win.dims;
    assert_eq!(x.len(), b * h * w * c, "pool2d input length");
    let [_, oh, ow, _] = win.out_dims();
    let len = b * oh * ow * c;
    if len == 0 {
        return Vec::new();
    }
    // Every output row is written whole (each pixel starts from its fill value), so the
    // output is not zero-filled first: a serial pass over 6.4 MB after ResNet's stem at
    // batch 8 (BENCHMARKS.md run 40).
    crate::base::buffers::filled(len, |out| {
        let row = |(r, o_row): (usize, &mut [MaybeUninit<f32>])| pool_row(x, win, kind, r, o_row);
        if out.len() < PARALLEL_MIN {
            out.chunks_exact_mut(ow * c).enumerate().for_each(row);
        } else {
            out.par_chunks_exact_mut(ow * c).enumerate().for_each(row);
        }
    })
}

multiversion! {
    /// Output row `r` (image `r / oh`, row `r mod oh`) of [`pool2d`]. Each pixel's window
    /// taps are listed once; each block of 16 channels then runs over all of them with its
    /// running maximum (or sum) in registers and is stored once: the former loop read,
    /// compared and stored the whole pixel at every tap (three memory operations per value
    /// and tap instead of one).
    fn pool_row(
        x: &[f32],
        win: &Window2d,
        kind: PoolKind,
        r: usize,
        o_row: &mut [MaybeUninit<f32>],
    ) {
        let [_, h, w, c] = win.dims;
        let oh = win.out_len(0);
        let (n, oy) = (r / oh, r % oh);
        let (ky0, ky1, iy0) = win.valid_taps(0, oy);
        let mut taps = [0usize; MAX_POOL_TAPS];
        for (ox, o) in o_row.chunks_exact_mut(c).enumerate() {
            let (kx0, kx1, ix0) = win.valid_taps(1, ox);
            let cells = (ky1 - ky0) * (kx1 - kx0);
            if cells > MAX_POOL_TAPS {
                pool_pixel_plain(x, win, kind, [n, oy, ox], o);
                continue;
            }
            let mut t = 0;
            for ky in 0..ky1 - ky0 {
                let iy = iy0 + ky * win.dilation[0];
                for kx in 0..kx1 - kx0 {
                    let ix = ix0 + kx * win.dilation[1];
                    taps[t] = ((n * h + iy) * w + ix) * c;
                    t += 1;
                }
            }
            let taps = &taps[..cells];
            let mut c0 = 0;
            match kind {
                PoolKind::Max => {
                    while c0 + 16 <= c {
                        pool_block::<16, true>(x, taps, c0, 1.0, &mut o[c0..c0 + 16]);
                        c0 += 16;
                    }
                    while c0 < c {
                        pool_block::<1, true>(x, taps, c0, 1.0, &mut o[c0..c0 + 1]);
                        c0 += 1;
                    }
                }
                PoolKind::Average { count_include_pad } => {
                    let count = if count_include_pad {
                        win.padded_cells(0, oy) * win.padded_cells(1, ox)
                    } else {
                        cells
                    };
                    let scale = 1.0 / count.max(1) as f32;
                    while c0 + 16 <= c {
                        pool_block::<16, false>(x, taps, c0, scale, &mut o[c0..c0 + 16]);
                        c0 += 16;
                    }
                    while c0 < c {
                        pool_block::<1, false>(x, taps, c0, scale, &mut o[c0..c0 + 1]);
                        c0 += 1;
                    }
                }
            }
        }
    }
}

/// Window cells a pooled pixel lists its taps for (a 7×7 window; larger ones, rare, take
/// [`pool_pixel_plain`]).
const MAX_POOL_TAPS: usize = 49;

/// Channels `c0..c0 + N` of one pooled pixel from the inputs at `taps` (pixel offsets):
/// the maximum (`MAX`; padding never wins, a NaN does) or the sum times `scale` (the mean),
/// held in registers across the taps and stored once. Inlined into the multiversioned row.
#[inline(always)]
fn pool_block<const N: usize, const MAX: bool>(
    x: &[f32],
    taps: &[usize],
    c0: usize,
    scale: f32,
    o: &mut [MaybeUninit<f32>],
) {
    let mut acc = [if MAX { f32::NEG_INFINITY } else { 0.0 }; N];
    for &t in taps {
        let px = &x[t + c0..][..N];
        for (a, &v) in acc.iter_mut().zip(px) {
            *a = if !MAX {
                *a + v
            } else if v.is_nan() || v > *a {
                v
            } else {
                *a
            };
        }
    }
    for (o, a) in o.iter_mut().zip(acc) {
        *o = MaybeUninit::new(if MAX { a } else { a * scale });
    }
}

/// One pooled pixel of a window with more than [`MAX_POOL_TAPS`] cells, tap by tap.
fn pool_pixel_plain(
    x: &[f32],
    win: &Window2d,
    kind: PoolKind,
    [n, oy, ox]: [usize; 3],
    o: &mut [MaybeUninit<f32>],
) {
    let [_, h, w, c] = win.dims;
    let (ky0, ky1, iy0) = win.valid_taps(0, oy);
    let (kx0, kx1, ix0) = win.valid_taps(1, ox);
    let mut acc = vec![
        if kind == PoolKind::Max {
            f32::NEG_INFINITY
        } else {
            0.0
        };
        c
    ];
    for ky in 0..ky1 - ky0 {
        let iy = iy0 + ky * win.dilation[0];
        for kx in 0..kx1 - kx0 {
            let ix = ix0 + kx * win.dilation[1];
            let px = &x[((n * h + iy) * w + ix) * c..][..c];
            for (a, &v) in acc.iter_mut().zip(px) {
                *a = match kind {
                    PoolKind::Max if v.is_nan() || v > *a => v,
                    PoolKind::Max => *a,
                    PoolKind::Average { .. } => *a + v,
                };
            }
        }
    }
    let scale = match kind {
        PoolKind::Max => 1.0,
        PoolKind::Average {
            count_include_pad: true,
        } => 1.0 / (win.padded_cells(0, oy) * win.padded_cells(1, ox)).max(1) as f32,
        PoolKind::Average { .. } => 1.0 / ((ky1 - ky0) * (kx1 - kx0)).max(1) as f32,
    };
    for (o, a) in o.iter_mut().zip(acc) {
        *o = MaybeUninit::new(a * scale);
    }
}

/// The mean of each image's pixels per channel: `[batch, channels]` from `[batch, h, w,
/// channels]`.
///
/// A large image is summed in parallel over fixed runs of [`MEAN_CHUNK`] values (whole
/// pixels), the partial sums then added in order: the same result on any thread count. On
/// one thread, EfficientNet-B0's squeeze-and-excitation means cost as much as ONNX Runtime's
/// two (BENCHMARKS.md run 40).
pub fn global_average(x: &[f32], [b, h, w, c]: [usize; 4]) -> Vec<f32> {
    assert_eq!(x.len(), b * h * w * c, "global_average input length");
    let mut out = vec![0f32; b * c];
    let plane = h * w * c;
    if c == 0 || plane == 0 {
        return out;
    }
    let chunk = (MEAN_CHUNK / c).max(1) * c;
    for (n, o) in out.chunks_exact_mut(c).enumerate() {
        let image = &x[n * plane..][..plane];
        if plane < PARALLEL_MIN {
            sum_pixels(image, o);
        } else {
            let partial: Vec<Vec<f32>> = image
                .par_chunks(chunk)
                .map(|part| {
                    let mut sums = vec![0f32; c];
                    sum_pixels(part, &mut sums);
                    sums
                })
                .collect();
            for sums in partial {
                o.iter_mut().zip(&sums).for_each(|(o, s)| *o += s);
            }
        }
        let scale = 1.0 / (h * w) as f32;
        o.iter_mut().for_each(|v| *v *= scale);
    }
    out
}

/// Values per parallel task of [`global_average`].
const MEAN_CHUNK: usize = 1 << 15;

multiversion! {
    /// `o += ` the sum of the pixels (rows of `o.len()` values) in `image`.
    fn sum_pixels(image: &[f32], o: &mut [f32]) {
        let c = o.len();
        for px in image.chunks_exact(c) {
            for (o, &v) in o.iter_mut().zip(px) {
                *o += v;
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::{relative_error, values, window};

    /// Direct f64 loops over NCHW, the reference every kernel here is checked against.
    fn reference_pool(x: &[f32], win: &Window2d, kind: PoolKind) -> Vec<f64> {
        let [b, h, w, c] = win.dims;
        let [_, oh, ow, _] = win.out_dims();
        let mut out = vec![0f64; b * oh * ow * c];
        for n in 0..b {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ch in 0..c {
                        let (mut acc, mut cells) = (
                            if kind == PoolKind::Max {
                                f64::NEG_INFINITY
                            } else {
                                0.0
                            },
                            0,
                        );
                        for ky in 0..win.kernel[0] {
                            for kx in 0..win.kernel[1] {
                                let iy =
                                    (oy * win.stride[0] + ky) as isize - win.pads[0].0 as isize;
                                let ix =
                                    (ox * win.stride[1] + kx) as isize - win.pads[1].0 as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let v =
                                    x[((n * h + iy as usize) * w + ix as usize) * c + ch] as f64;
                                cells += 1;
                                acc = if kind == PoolKind::Max {
                                    acc.max(v)
                                } else {
                                    acc + v
                                };
                            }
                        }
                        if let PoolKind::Average { count_include_pad } = kind {
                            let count = if count_include_pad {
                                let span = |o: usize, a: usize| {
                                    let start = o * win.stride[a];
                                    let end = (start + win.kernel[a])
                                        .min(win.dims[1 + a] + win.pads[a].0 + win.pads[a].1);
                                    end - start
                                };
                                span(oy, 0) * span(ox, 1)
                            } else {
                                cells
                            };
                            acc /= count as f64;
                        }
                        out[((n * oh + oy) * ow + ox) * c + ch] = acc;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_nan_wins_the_max_pool_of_every_window_it_is_in() {
        // 17 channels: a block of 16 and one alone; the NaN in channel 16, then channel 3.
        for ch in [16, 3] {
            let dims = [1, 5, 5, 17];
            let mut x = values(dims.iter().product(), 4);
            let at = (2 * 5 + 1) * 17 + ch; // pixel (2, 1)
            x[at] = f32::NAN;
            let win = window(dims, 3, 1, (1, 1), false);
            let got = pool2d(&x, &win, PoolKind::Max);
            for (i, v) in got.iter().enumerate() {
                let (p, c) = (i / 17, i % 17);
                let (oy, ox) = (p / 5, p % 5);
                let covers = c == ch && oy.abs_diff(2) <= 1 && ox.abs_diff(1) <= 1;
                assert_eq!(v.is_nan(), covers, "pixel ({oy}, {ox}) channel {c}");
            }
        }
    }

    #[test]
    fn pooling_matches_a_direct_loop_with_pads_and_ceil_mode() {
        for (dims, k, s, p, ceil) in [
            ([1, 112, 112, 64], 3, 2, (1, 1), false), // ResNet's stem pool
            ([2, 13, 13, 24], 3, 2, (0, 0), true),    // SqueezeNet's ceil-mode pool
            ([1, 7, 9, 5], 2, 2, (0, 0), true),
            ([3, 8, 8, 17], 3, 1, (1, 1), false),
            // 81 cells: more than a pixel lists taps for (the tap-by-tap path).
            ([1, 12, 12, 20], 9, 3, (2, 2), true),
        ] {
            let win = window(dims, k, s, p, ceil);
            let x = values(dims.iter().product(), 3);
            for kind in [
                PoolKind::Max,
                PoolKind::Average {
                    count_include_pad: false,
                },
                PoolKind::Average {
                    count_include_pad: true,
                },
            ] {
                let got = pool2d(&x, &win, kind);
                let want = reference_pool(&x, &win, kind);
                assert!(
                    relative_error(&got, &want) < 1e-6,
                    "{dims:?} k{k} s{s} {kind:?}"
                );
            }
        }
    }

    #[test]
    fn global_average_is_the_mean_per_channel() {
        // A small image (summed on the calling thread) and a large one (in parallel parts).
        for [b, h, w, c] in [[2, 7, 7, 12], [2, 56, 56, 48]] {
            let x = values(b * h * w * c, 8);
            let got = global_average(&x, [b, h, w, c]);
            let want: Vec<f64> = (0..b * c)
                .map(|i| {
                    let (n, ch) = (i / c, i % c);
                    (0..h * w)
                        .map(|p| x[(n * h * w + p) * c + ch] as f64)
                        .sum::<f64>()
                        / (h * w) as f64
                })
                .collect();
            assert!(relative_error(&got, &want) < 1e-5, "{h}×{w}×{c}");
            // The parts are fixed, not per thread: one thread gives the same bits.
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_eq!(one.install(|| global_average(&x, [b, h, w, c])), got);
        }
    }
}
