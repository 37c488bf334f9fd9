//! f32 2-D max pooling on the host (no padding, no dilation), forward with arg-max indices and
//! the backward scatter.
//!
//! Why: profiling W2 training after the convolution kernel landed (BENCHMARKS.md run 13) put
//! Burn flex's `max_pool3d_with_indices` at 12% of the step for a 2×2 pool. Here each plane is
//! one contiguous pass; planes are spread over the threads.
//!
//! [`channels_last`]: inference pooling on NHWC images (max and average with padding,
//! dilation and ceil mode, the global average), re-exported here; [`global`]: training's
//! global average pooling of NCHW planes and its gradient.

pub mod channels_last;
pub mod global;

pub use channels_last::{PoolKind, global_average, pool2d};
pub use global::{global_avg_pool_nchw, global_avg_pool_nchw_backward};

use rayon::prelude::*;

/// Shape of one pooling: `planes` (= batch · channels) planes of `h × w`, a `kh × kw` window
/// moved by `stride`, no padding, floor rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Batch × channels.
    pub planes: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Window height.
    pub kh: usize,
    /// Window width.
    pub kw: usize,
    /// Stride (rows, columns).
    pub stride: [usize; 2],
}

impl PoolShape {
    /// The shape for pooling an NCHW input of `dims` (`[batch, channels, h, w]`).
    pub fn nchw(dims: [usize; 4], kernel: [usize; 2], stride: [usize; 2]) -> Self {
        Self {
            planes: dims[0] * dims[1],
            h: dims[2],
            w: dims[3],
            kh: kernel[0],
            kw: kernel[1],
            stride,
        }
    }

    /// Output height.
    pub fn out_h(&self) -> usize {
        if self.h < self.kh {
            0
        } else {
            (self.h - self.kh) / self.stride[0] + 1
        }
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        if self.w < self.kw {
            0
        } else {
            (self.w - self.kw) / self.stride[1] + 1
        }
    }

    fn plane_in(&self) -> usize {
        self.h * self.w
    }

    fn plane_out(&self) -> usize {
        self.out_h() * self.out_w()
    }
}

/// Planes handled by one parallel task: enough work (≥ 16K outputs) to amortize the task.
fn planes_per_task(s: &PoolShape) -> usize {
    (16384 / s.plane_out().max(1)).clamp(1, s.planes.max(1))
}

/// `max(a, b)`, NaN if either is NaN.
#[inline]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a > b { a } else { b }
}

/// Max over each window of `x` `[planes, h, w]` into `out` `[planes, oh, ow]`; when `indices`
/// is given, also the arg-max as a flat index into its input plane (`iy · w + ix`, the
/// convention Burn and PyTorch use). A NaN in a window wins, so it propagates as in Burn.
pub fn max_pool2d_forward(s: &PoolShape, x: &[f32], out: &mut [f32], indices: Option<&mut [i64]>) {
    assert_eq!(x.len(), s.planes * s.plane_in(), "max_pool2d input length");
    assert_eq!(
        out.len(),
        s.planes * s.plane_out(),
        "max_pool2d output length"
    );
    let (pin, pout) = (s.plane_in(), s.plane_out());
    if pout == 0 {
        return;
    }
    let chunk = planes_per_task(s);
    let pool_plane = |plane: &[f32], out: &mut [f32], mut idx: Option<&mut [i64]>| {
        let (oh, ow) = (s.out_h(), s.out_w());
        if idx.is_none() && (s.kh, s.kw, s.stride) == (2, 2, [2, 2]) {
            // The common 2×2/2 pool without indices: two input rows per output row, pairs
            // along x, branch-free so it vectorizes.
            for (oy, o_row) in out.chunks_exact_mut(ow).enumerate() {
                let r0 = &plane[2 * oy * s.w..][..2 * ow];
                let r1 = &plane[(2 * oy + 1) * s.w..][..2 * ow];
                for ((o, a), b) in o_row
                    .iter_mut()
                    .zip(r0.chunks_exact(2))
                    .zip(r1.chunks_exact(2))
                {
                    *o = nan_max(nan_max(a[0], a[1]), nan_max(b[0], b[1]));
                }
            }
            return;
        }
        for oy in 0..oh {
            for ox in 0..ow {
                let (y0, x0) = (oy * s.stride[0], ox * s.stride[1]);
                let mut best = f32::NEG_INFINITY;
                let mut at = y0 * s.w + x0;
                for ky in 0..s.kh {
                    let row = (y0 + ky) * s.w + x0;
                    for (kx, &v) in plane[row..row + s.kw].iter().enumerate() {
                        if v > best || v.is_nan() && !best.is_nan() {
                            best = v;
                            at = row + kx;
                        }
                    }
                }
                out[oy * ow + ox] = best;
                if let Some(idx) = idx.as_deref_mut() {
                    idx[oy * ow + ox] = at as i64;
                }
            }
        }
    };
    match indices {
        Some(indices) => {
            assert_eq!(indices.len(), out.len(), "max_pool2d indices length");
            x.par_chunks(pin * chunk)
                .zip(out.par_chunks_mut(pout * chunk))
                .zip(indices.par_chunks_mut(pout * chunk))
                .for_each(|((x, out), idx)| {
                    for ((plane, o), i) in x
                        .chunks_exact(pin)
                        .zip(out.chunks_exact_mut(pout))
                        .zip(idx.chunks_exact_mut(pout))
                    {
                        pool_plane(plane, o, Some(i));
                    }
                });
        }
        None => x
            .par_chunks(pin * chunk)
            .zip(out.par_chunks_mut(pout * chunk))
            .for_each(|(x, out)| {
                for (plane, o) in x.chunks_exact(pin).zip(out.chunks_exact_mut(pout)) {
                    pool_plane(plane, o, None);
                }
            }),
    }
}

/// Max pooling of a channels-last image: `x` `[batch, h, w, channels]` into `[batch, oh, ow,
/// channels]` (`s.planes` is the batch here). Each output pixel is the element-wise max of its
/// window's pixels, a contiguous run of `channels` values each, so the inner loop is a vector
/// max along the channels. A NaN in a window wins, as in [`max_pool2d_forward`].
///
/// Why: Kiln's int8 inference keeps activations channels-last between its layers (the GEMM's
/// natural output), and pooling them there avoids two transposes.
pub fn max_pool2d_nhwc(s: &PoolShape, channels: usize, x: &[f32]) -> Vec<f32> {
    let (oh, ow) = (s.out_h(), s.out_w());
    assert_eq!(
        x.len(),
        s.planes * s.plane_in() * channels,
        "max_pool2d_nhwc input length"
    );
    let row_out = ow * channels;
    let mut out = vec![0f32; s.planes * oh * row_out];
    if out.is_empty() {
        return out;
    }
    let pool_row = |(r, o_row): (usize, &mut [f32])| {
        let (n, oy) = (r / oh, r % oh);
        for (ox, o) in o_row.chunks_exact_mut(channels).enumerate() {
            let (y0, x0) = (oy * s.stride[0], ox * s.stride[1]);
            o.fill(f32::NEG_INFINITY);
            for ky in 0..s.kh {
                let at = ((n * s.h + y0 + ky) * s.w + x0) * channels;
                for tap in x[at..at + s.kw * channels].chunks_exact(channels) {
                    for (o, v) in o.iter_mut().zip(tap) {
                        *o = nan_max(*v, *o);
                    }
                }
            }
        }
    };
    // Small outputs (batch 1) are pooled on this thread: a rayon dispatch costs more.
    if out.len() < 1 << 14 {
        out.chunks_exact_mut(row_out).enumerate().for_each(pool_row);
    } else {
        out.par_chunks_exact_mut(row_out)
            .enumerate()
            .for_each(pool_row);
    }
    out
}

/// Gradient of the input: each output gradient added at its window's arg-max.
pub fn max_pool2d_backward(s: &PoolShape, grad: &[f32], indices: &[i64], dx: &mut [f32]) {
    assert_eq!(
        grad.len(),
        s.planes * s.plane_out(),
        "max_pool2d gradient length"
    );
    assert_eq!(indices.len(), grad.len(), "max_pool2d indices length");
    assert_eq!(
        dx.len(),
        s.planes * s.plane_in(),
        "max_pool2d input-gradient length"
    );
    let (pin, pout) = (s.plane_in(), s.plane_out());
    if pin == 0 || pout == 0 {
        dx.fill(0.0);
        return;
    }
    let chunk = planes_per_task(s);
    dx.par_chunks_mut(pin * chunk)
        .zip(grad.par_chunks(pout * chunk))
        .zip(indices.par_chunks(pout * chunk))
        .for_each(|((dx, g), idx)| {
            dx.fill(0.0);
            for ((plane, g), idx) in dx
                .chunks_exact_mut(pin)
                .zip(g.chunks_exact(pout))
                .zip(idx.chunks_exact(pout))
            {
                for (&v, &i) in g.iter().zip(idx) {
                    // Indices come from the forward pass over the same shape; a corrupt one
                    // would be a bug, and `get_mut` keeps it from writing out of bounds.
                    if let Some(d) = plane.get_mut(i as usize) {
                        *d += v;
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_and_backward_match_a_direct_loop() {
        for (h, w, kh, kw, stride) in [
            (6, 6, 2, 2, [2, 2]),
            (7, 5, 3, 2, [2, 1]),
            (4, 4, 3, 3, [1, 1]),
            (5, 8, 2, 3, [3, 2]),
        ] {
            let s = PoolShape {
                planes: 5,
                h,
                w,
                kh,
                kw,
                stride,
            };
            let x: Vec<f32> = (0..s.planes * h * w)
                .map(|i| ((i * 7919) % 113) as f32 - 56.0)
                .collect();
            let (oh, ow) = (s.out_h(), s.out_w());
            let mut out = vec![0f32; s.planes * oh * ow];
            let mut idx = vec![0i64; out.len()];
            max_pool2d_forward(&s, &x, &mut out, Some(&mut idx));
            let g: Vec<f32> = (0..out.len()).map(|i| i as f32 * 0.5 + 1.0).collect();
            let mut dx = vec![f32::NAN; x.len()];
            max_pool2d_backward(&s, &g, &idx, &mut dx);

            let mut want_dx = vec![0f32; x.len()];
            for p in 0..s.planes {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut best = (f32::NEG_INFINITY, 0);
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let at = (oy * stride[0] + ky) * w + ox * stride[1] + kx;
                                if x[p * h * w + at] > best.0 {
                                    best = (x[p * h * w + at], at);
                                }
                            }
                        }
                        let o = p * oh * ow + oy * ow + ox;
                        assert_eq!(out[o], best.0);
                        assert_eq!(idx[o], best.1 as i64);
                        want_dx[p * h * w + best.1] += g[o];
                    }
                }
            }
            assert_eq!(dx, want_dx, "{s:?}");
            let mut plain = vec![0f32; out.len()];
            max_pool2d_forward(&s, &x, &mut plain, None);
            assert_eq!(plain, out);
        }
    }

    #[test]
    fn nan_in_a_window_propagates() {
        let s = PoolShape {
            planes: 1,
            h: 2,
            w: 4,
            kh: 2,
            kw: 2,
            stride: [2, 2],
        };
        let x = [1.0, f32::NAN, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut out = [0f32; 2];
        max_pool2d_forward(&s, &x, &mut out, None);
        assert!(out[0].is_nan());
        assert_eq!(out[1], 8.0);
    }

    /// Channels-last pooling is the NCHW kernel's result transposed: overlapping 3×3/2
    /// windows, the 2×2/2 case, a floor-rounded edge, and a NaN that wins its windows.
    #[test]
    fn channels_last_pooling_matches_the_nchw_kernel() {
        for (kernel, stride) in [([2, 2], [2, 2]), ([3, 3], [2, 2]), ([2, 3], [1, 2])] {
            let (b, c, h, w) = (2, 5, 7, 9);
            let mut x: Vec<f32> = (0..b * c * h * w)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                .collect();
            x[c * h * w + 2 * h * w + 3 * w + 4] = f32::NAN;
            let s = PoolShape::nchw([b, c, h, w], kernel, stride);
            let mut want = vec![0f32; b * c * s.out_h() * s.out_w()];
            max_pool2d_forward(&s, &x, &mut want, None);
            let to_nhwc = |v: &[f32], hh: usize, ww: usize| {
                let mut out = vec![0f32; v.len()];
                for n in 0..b {
                    for ch in 0..c {
                        for p in 0..hh * ww {
                            out[(n * hh * ww + p) * c + ch] = v[(n * c + ch) * hh * ww + p];
                        }
                    }
                }
                out
            };
            let got = max_pool2d_nhwc(
                &PoolShape::nchw([b, 1, h, w], kernel, stride),
                c,
                &to_nhwc(&x, h, w),
            );
            let want = to_nhwc(&want, s.out_h(), s.out_w());
            assert_eq!(got.len(), want.len());
            assert!(want.iter().any(|v| v.is_nan()));
            for (g, e) in got.iter().zip(&want) {
                assert!(g == e || g.is_nan() && e.is_nan(), "{kernel:?}: {g} vs {e}");
            }
        }
    }
}
