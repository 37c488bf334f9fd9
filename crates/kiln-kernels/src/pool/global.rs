//! Global average pooling of NCHW images in training: each channel plane's mean, and its
//! gradient, each plane filled with its output gradient over the plane's size.
//!
//! Why: a CNN's head (`x.mean(dim=(2, 3))`, `AdaptiveAvgPool2d(1)`) on Burn's ops runs the
//! mean as a reduction over a reshaped view, and its gradient as a broadcast of `[B, C, 1]`
//! over the flattened planes, a division and the reshapes. Here each is one pass over
//! memory: forward plus gradient 0.65 → 0.45 ms for U1's 64×256×8×8 and 1.27 → 0.75 ms for
//! MobileNet v2's 32×1280×7×7 head on two threads (`cargo bench -p kiln --bench
//! global_pool`, BENCHMARKS.md run 61) — small beside a step, and what is left is the
//! gradient's fresh 4–8 MB being written.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::buffers::filled;
use crate::base::threads::PARALLEL_MIN;

/// Planes per parallel task: whole planes, about [`PARALLEL_MIN`] values a task.
fn planes_per_task(plane: usize) -> usize {
    (PARALLEL_MIN / plane.max(1)).max(1)
}

/// The mean of each contiguous plane of `plane` values of `x` (`x.len()` a multiple of it):
/// `[B, C, H, W]` → `[B, C]` with `plane = H·W`.
///
/// # Panics
/// When `plane` is 0 or does not divide `x.len()`.
pub fn global_avg_pool_nchw(x: &[f32], plane: usize) -> Vec<f32> {
    assert!(
        plane > 0 && x.len().is_multiple_of(plane),
        "global average pool: {} values are not whole planes of {plane}",
        x.len()
    );
    let planes = x.len() / plane;
    let scale = 1.0 / plane as f32;
    let mean = |src: &[f32], dst: &mut [MaybeUninit<f32>]| {
        for (p, o) in src.chunks_exact(plane).zip(dst.iter_mut()) {
            *o = MaybeUninit::new(plane_sum(p) * scale);
        }
    };
    filled(planes, |out| {
        if x.len() <= PARALLEL_MIN {
            mean(x, out);
        } else {
            let per = planes_per_task(plane);
            x.par_chunks(per * plane)
                .zip(out.par_chunks_mut(per))
                .for_each(|(src, dst)| mean(src, dst));
        }
    })
}

/// The gradient of [`global_avg_pool_nchw`]: plane `i` of the result is `dy[i] / plane`
/// everywhere.
pub fn global_avg_pool_nchw_backward(dy: &[f32], plane: usize) -> Vec<f32> {
    let scale = 1.0 / plane as f32;
    let fill = |src: &[f32], dst: &mut [MaybeUninit<f32>]| {
        for (g, p) in src.iter().zip(dst.chunks_exact_mut(plane)) {
            p.fill(MaybeUninit::new(g * scale));
        }
    };
    let len = dy.len() * plane;
    filled(len, |out| {
        if len <= PARALLEL_MIN || plane == 0 {
            fill(dy, out);
        } else {
            let per = planes_per_task(plane);
            dy.par_chunks(per)
                .zip(out.par_chunks_mut(per * plane))
                .for_each(|(src, dst)| fill(src, dst));
        }
    })
}

/// A plane's sum over eight partial sums (the compiler keeps them in one register and
/// vectorizes; a single running sum is a chain of dependent adds).
fn plane_sum(p: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = p.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forward and gradient against f64 sums, for planes that fill registers, leave tails,
    /// are a single value, and enough of them to split over threads.
    #[test]
    fn pooling_and_its_gradient_match_f64() {
        for (planes, plane) in [(6, 64), (5, 49), (3, 1), (4096, 49), (40, 8192)] {
            let x: Vec<f32> = (0..planes * plane)
                .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
                .collect();
            let y = global_avg_pool_nchw(&x, plane);
            assert_eq!(y.len(), planes);
            for (p, got) in x.chunks(plane).zip(&y) {
                let want = p.iter().map(|&v| f64::from(v)).sum::<f64>() / plane as f64;
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{planes}×{plane}: {got} vs {want}"
                );
            }
            let dy: Vec<f32> = (0..planes).map(|i| i as f32 * 0.25 - 3.0).collect();
            let dx = global_avg_pool_nchw_backward(&dy, plane);
            assert_eq!(dx.len(), planes * plane);
            for (g, p) in dy.iter().zip(dx.chunks(plane)) {
                let want = f64::from(*g) / plane as f64;
                assert!(
                    p.iter()
                        .all(|&v| (f64::from(v) - want).abs() <= 1e-7 * want.abs().max(1.0))
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "not whole planes")]
    fn a_partial_plane_is_refused() {
        global_avg_pool_nchw(&[1.0; 10], 4);
    }
}
