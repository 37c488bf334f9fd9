//! The f32 BatchNorm training kernels (statistics, normalization with fused ReLU, backward)
//! on W5's shapes (ResNet-18 at 32×32, batch 64), per shape and summed over the network, in
//! ms and GB/s of the bytes each pass must move (the kernels are memory-bound). The
//! `+zeroed` column adds a zero-filled output buffer (what the backend extension allocated
//! until run 39), `new` the forward into a fresh vector that is not filled first (what it
//! does now).
//! With `cold`, each call reads a different one of 24 copies of the activation (403 MB at
//! the largest shape, past the L3), as a training step reads an activation written long
//! before.
//!
//!     cargo bench -p kiln-kernels --bench train_norm -- 2 [cold]     # threads (default 1)

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};

use support::time;

use kiln_kernels::norm::{
    NormParams, NormShape, batch_norm_backward, batch_norm_forward, batch_norm_forward_new,
    batch_norm_stats,
};

fn main() {
    let (threads, pool) = support::pool_from_args();
    let cold = std::env::args().any(|a| a == "cold");
    // (channels, plane, occurrences in W5: the stem and its stage's 4, then 4 + a shortcut's)
    let cases = [(64, 1024, 5), (128, 256, 5), (256, 64, 5), (512, 16, 5)];
    println!(
        "{:<12} {:>8} {:>7} {:>8} {:>7} {:>8} {:>8} {:>8} {:>7}   (batch 64, {threads} threads{})",
        "shape",
        "stats ms",
        "GB/s",
        "fwd ms",
        "GB/s",
        "+zeroed",
        "new",
        "bwd ms",
        "GB/s",
        if cold { ", cold" } else { "" }
    );
    let mut totals = [0f64; 5];
    for (channels, plane, count) in cases {
        let s = NormShape {
            batch: 64,
            channels,
            plane,
        };
        let copies = if cold { 24 } else { 1 };
        let inputs: Vec<Vec<f32>> = (0..copies)
            .map(|k| {
                (0..s.len())
                    .map(|i| ((i + k) % 29) as f32 * 0.1 - 1.3)
                    .collect()
            })
            .collect();
        let calls = AtomicUsize::new(0);
        let next_x = || &inputs[calls.fetch_add(1, Ordering::Relaxed) % copies][..];
        let x = &inputs[0];
        let dy: Vec<f32> = (0..s.len()).map(|i| (i % 13) as f32 * 0.05 - 0.3).collect();
        let (gamma, beta) = (vec![1.1f32; channels], vec![0.1f32; channels]);
        let mut out = vec![0f32; s.len()];
        let mut dx = vec![0f32; s.len()];
        let ms = pool.install(|| {
            let (mean, var) = batch_norm_stats(&s, x);
            let p = NormParams {
                gamma: &gamma,
                beta: &beta,
                mean: &mean,
                var: &var,
                eps: 1e-5,
                relu: true,
            };
            [
                time(|| drop(batch_norm_stats(&s, next_x())), 5),
                time(|| batch_norm_forward(&s, next_x(), &p, &mut out), 5),
                time(
                    || {
                        let mut fresh = vec![0f32; s.len()];
                        batch_norm_forward(&s, next_x(), &p, &mut fresh);
                        std::hint::black_box(&fresh);
                    },
                    5,
                ),
                time(
                    || {
                        drop(std::hint::black_box(batch_norm_forward_new(
                            &s,
                            next_x(),
                            &p,
                        )))
                    },
                    5,
                ),
                time(
                    || drop(batch_norm_backward(&s, next_x(), &p, &dy, &mut dx)),
                    5,
                ),
            ]
        });
        // Bytes each pass must move: stats reads x; forward reads x, writes y; backward reads
        // x and dy twice and writes dx.
        let mb = (s.len() * 4) as f64 / 1e6;
        let rate = |passes: f64, ms: f64| passes * mb / ms;
        println!(
            "{:<12} {:>8.2} {:>7.1} {:>8.2} {:>7.1} {:>8.2} {:>8.2} {:>8.2} {:>7.1}",
            format!("{channels}×{plane}"),
            ms[0],
            rate(1.0, ms[0]),
            ms[1],
            rate(2.0, ms[1]),
            ms[2],
            ms[3],
            ms[4],
            rate(5.0, ms[4]),
        );
        for (t, m) in totals.iter_mut().zip(ms) {
            *t += m * count as f64;
        }
    }
    println!(
        "W5 (weighted) {:>7.2} {:>16.2} {:>8.2} {:>8.2} {:>8.2}   per step: stats + fwd + bwd = {:.1} ms",
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        totals[4],
        totals[0] + totals[1] + totals[4]
    );
}
