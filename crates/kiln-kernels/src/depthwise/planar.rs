//! Depthwise convolution for training, on NCHW images (what Burn's autodiff hands a layer):
//! the forward and both gradients, one (image, channel) plane per task.
//!
//! Why its own kernel: a depthwise layer (`groups = channels`, one `kh × kw` filter per
//! channel) has no reduction over channels, so the GEMM forms of a dense convolution degrade
//! to thousands of tiny products — Burn's grouped convolution runs one per group. Here every
//! tap is one multiply-add over a row of the plane (contiguous for stride 1, so it
//! vectorizes), and the row range each tap covers is computed once, so padding costs no
//! branches in the inner loop. Shapes are [`ConvShape`]s with `cin = cout = channels`.

use rayon::prelude::*;

use crate::base::shape::ConvShape;

/// Output positions `o` along one axis whose input `o·stride + tap − pad` lies in
/// `[0, len)`: the range a tap at offset `tap` (kernel index × dilation) covers.
fn covered(out_len: usize, stride: usize, tap: usize, pad: usize, len: usize) -> (usize, usize) {
    let lo = if pad > tap {
        (pad - tap).div_ceil(stride)
    } else {
        0
    };
    // The largest o with o·stride + tap − pad ≤ len − 1.
    let hi = if len + pad > tap {
        ((len - 1 + pad - tap) / stride + 1).min(out_len)
    } else {
        0
    };
    (lo, hi.max(lo))
}

/// Whether `s` describes a depthwise convolution these kernels take (one filter per
/// channel: the caller passes a weight `[channels, 1, kh, kw]`).
pub fn fits(s: &ConvShape) -> bool {
    s.cin == s.cout && s.cin > 0 && s.kh > 0 && s.kw > 0 && s.out_h() > 0 && s.out_w() > 0
}

/// One tap's reach over one output row: tap `t` (`ky·kw + kx`) of output row `oy` reads input
/// row `iy`, output columns `cols` from input column `first` on, `stride[1]` apart.
struct TapRow {
    t: usize,
    oy: usize,
    iy: usize,
    cols: std::ops::Range<usize>,
    first: usize,
}

/// Calls `f` for every (tap, output row) pair that reads inside the image, taps in order
/// and rows in order within a tap: the index arithmetic all three kernels share, so padding
/// is settled here once per row and never inside their inner loops.
fn for_each_tap_row(s: &ConvShape, mut f: impl FnMut(TapRow)) {
    let (oh, ow) = (s.out_h(), s.out_w());
    for ky in 0..s.kh {
        let dy = ky * s.dilation[0];
        let (oy0, oy1) = covered(oh, s.stride[0], dy, s.padding[0].0, s.h);
        for kx in 0..s.kw {
            let dx = kx * s.dilation[1];
            let (ox0, ox1) = covered(ow, s.stride[1], dx, s.padding[1].0, s.w);
            if ox0 == ox1 {
                // The tap falls on the padding for every output column.
                continue;
            }
            for oy in oy0..oy1 {
                f(TapRow {
                    t: ky * s.kw + kx,
                    oy,
                    iy: oy * s.stride[0] + dy - s.padding[0].0,
                    cols: ox0..ox1,
                    first: ox0 * s.stride[1] + dx - s.padding[1].0,
                });
            }
        }
    }
}

/// `y[n][c] = bias[c] + x[n][c] ⋆ w[c]`: `x` `[batch, channels, h, w]`, `w`
/// `[channels, 1, kh, kw]`, result `[batch, channels, out_h, out_w]`.
pub fn forward(s: &ConvShape, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let (oh, ow, taps, sw) = (s.out_h(), s.out_w(), s.kh * s.kw, s.stride[1]);
    let mut y = vec![0f32; s.batch * s.cout * oh * ow];
    y.par_chunks_mut(oh * ow)
        .enumerate()
        .for_each(|(plane, out)| {
            let c = plane % s.cout;
            out.fill(bias.map_or(0.0, |b| b[c]));
            let input = &x[plane * s.h * s.w..][..s.h * s.w];
            let filter = &w[c * taps..][..taps];
            for_each_tap_row(s, |r| {
                let tap = filter[r.t];
                let row = &input[r.iy * s.w + r.first..(r.iy + 1) * s.w];
                let dst = &mut out[r.oy * ow..][r.cols];
                // Stride 1 apart: contiguous, so the loop vectorizes.
                if sw == 1 {
                    for (o, v) in dst.iter_mut().zip(row) {
                        *o += tap * v;
                    }
                } else {
                    for (o, v) in dst.iter_mut().zip(row.iter().step_by(sw)) {
                        *o += tap * v;
                    }
                }
            });
        });
    y
}

/// The gradient of [`forward`] with respect to `x`, from the output's gradient `dy`.
pub fn input_grad(s: &ConvShape, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let (oh, ow, taps, sw) = (s.out_h(), s.out_w(), s.kh * s.kw, s.stride[1]);
    let mut dx = vec![0f32; s.batch * s.cin * s.h * s.w];
    dx.par_chunks_mut(s.h * s.w)
        .enumerate()
        .for_each(|(plane, grad)| {
            let c = plane % s.cin;
            let upstream = &dy[plane * oh * ow..][..oh * ow];
            let filter = &w[c * taps..][..taps];
            for_each_tap_row(s, |r| {
                let tap = filter[r.t];
                let src = &upstream[r.oy * ow..][r.cols];
                let row = &mut grad[r.iy * s.w + r.first..(r.iy + 1) * s.w];
                if sw == 1 {
                    for (g, v) in row.iter_mut().zip(src) {
                        *g += tap * v;
                    }
                } else {
                    for (g, v) in row.iter_mut().step_by(sw).zip(src) {
                        *g += tap * v;
                    }
                }
            });
        });
    dx
}

/// The gradient of [`forward`] with respect to `w` (`[channels, 1, kh, kw]`), from `x` and
/// the output's gradient `dy`: per channel, each tap's correlation of the two over the batch.
pub fn weight_grad(s: &ConvShape, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (oh, ow, taps, sw) = (s.out_h(), s.out_w(), s.kh * s.kw, s.stride[1]);
    let mut dw = vec![0f32; s.cout * taps];
    dw.par_chunks_mut(taps).enumerate().for_each(|(c, grad)| {
        for n in 0..s.batch {
            let plane = n * s.cin + c;
            let input = &x[plane * s.h * s.w..][..s.h * s.w];
            let upstream = &dy[plane * oh * ow..][..oh * ow];
            for_each_tap_row(s, |r| {
                let src = &upstream[r.oy * ow..][r.cols];
                let row = &input[r.iy * s.w + r.first..(r.iy + 1) * s.w];
                grad[r.t] += if sw == 1 {
                    src.iter().zip(row).map(|(a, b)| a * b).sum::<f32>()
                } else {
                    src.iter()
                        .zip(row.iter().step_by(sw))
                        .map(|(a, b)| a * b)
                        .sum::<f32>()
                };
            });
        }
    });
    dw
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Input position of output `o`, tap `k` along one axis, if inside.
    fn at(o: usize, k: usize, stride: usize, dil: usize, pad: usize, len: usize) -> Option<usize> {
        (o * stride + k * dil).checked_sub(pad).filter(|&i| i < len)
    }

    /// The forward and both gradients in f64, by definition, for `dy` given.
    fn reference(
        s: &ConvShape,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (oh, ow) = (s.out_h(), s.out_w());
        let mut y = vec![0f64; s.batch * s.cout * oh * ow];
        let mut dx = vec![0f64; x.len()];
        let mut dw = vec![0f64; w.len()];
        for n in 0..s.batch {
            for c in 0..s.cin {
                let plane = n * s.cin + c;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let o = (plane * oh + oy) * ow + ox;
                        for ky in 0..s.kh {
                            for kx in 0..s.kw {
                                let iy =
                                    at(oy, ky, s.stride[0], s.dilation[0], s.padding[0].0, s.h);
                                let ix =
                                    at(ox, kx, s.stride[1], s.dilation[1], s.padding[1].0, s.w);
                                let (Some(iy), Some(ix)) = (iy, ix) else {
                                    continue;
                                };
                                let i = (plane * s.h + iy) * s.w + ix;
                                let t = (c * s.kh + ky) * s.kw + kx;
                                y[o] += w[t] as f64 * x[i] as f64;
                                dx[i] += w[t] as f64 * dy[o] as f64;
                                dw[t] += x[i] as f64 * dy[o] as f64;
                            }
                        }
                    }
                }
            }
        }
        (y, dx, dw)
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
        let err = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
        assert!(
            err / scale <= 1e-5,
            "{what}: relative error {:.2e}",
            err / scale
        );
    }

    /// Forward, input gradient and weight gradient against an f64 reference: 3×3 and 5×5,
    /// strides 1 and 2, asymmetric padding, dilation, odd sizes.
    #[test]
    fn depthwise_forward_and_gradients_match_an_f64_reference() {
        let mut seed = 3;
        for (k, stride, pad, dil, h, w) in [
            (3, 1, (1, 1), 1, 9, 8),
            (3, 2, (1, 1), 1, 9, 10),
            (5, 1, (2, 2), 1, 7, 11),
            (5, 2, (2, 1), 1, 12, 9),
            (3, 1, (0, 2), 2, 8, 8),
            (1, 1, (0, 0), 1, 4, 5),
        ] {
            let s = ConvShape {
                batch: 3,
                cin: 5,
                h,
                w,
                cout: 5,
                kh: k,
                kw: k,
                stride: [stride, stride],
                padding: [pad, (pad.1, pad.0)],
                dilation: [dil, dil],
            };
            assert!(fits(&s));
            let x: Vec<f32> = (0..s.batch * s.cin * h * w)
                .map(|_| lcg(&mut seed))
                .collect();
            let wt: Vec<f32> = (0..s.cin * k * k).map(|_| lcg(&mut seed)).collect();
            let bias: Vec<f32> = (0..s.cin).map(|_| lcg(&mut seed)).collect();
            let dy: Vec<f32> = (0..s.batch * s.cout * s.out_h() * s.out_w())
                .map(|_| lcg(&mut seed))
                .collect();
            let (y, dx, dw) = reference(&s, &x, &wt, &dy);
            let plane = s.out_h() * s.out_w();
            let with_bias: Vec<f64> = y
                .iter()
                .enumerate()
                .map(|(i, v)| v + bias[(i / plane) % s.cout] as f64)
                .collect();
            let case = format!("k{k} s{stride} p{pad:?} d{dil} {h}×{w}");
            close(
                &forward(&s, &x, &wt, Some(&bias)),
                &with_bias,
                &format!("{case} forward"),
            );
            close(
                &forward(&s, &x, &wt, None),
                &y,
                &format!("{case} forward, no bias"),
            );
            close(
                &input_grad(&s, &dy, &wt),
                &dx,
                &format!("{case} input gradient"),
            );
            close(
                &weight_grad(&s, &x, &dy),
                &dw,
                &format!("{case} weight gradient"),
            );
        }
    }
}
