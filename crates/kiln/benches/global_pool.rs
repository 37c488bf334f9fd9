//! Why a CNN head's global average pooling has a Kiln kernel: forward plus input gradient of
//! `x.mean(dim=(2, 3))` through Burn's ops and through `kiln::nn::global_avg_pool`, side by
//! side in turns on the `flex` device with autodiff, on head shapes of U1, MobileNet v2 and
//! ResNet-18 (BENCHMARKS.md run 61 quotes a run).
//!
//!     cargo bench -p kiln --bench global_pool [-- ROUNDS]
//!
//! Each round times both paths once per shape (15 forwards+backwards, median); the report
//! is the median and range over the rounds.

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use kiln::burn;

/// ms of one forward and backward of `pool` on `x`, median of 15 after 3 warm-ups.
fn time(pool: &dyn Fn(Tensor<4>) -> Tensor<2>, x: &Tensor<4>, g: &Tensor<2>) -> f64 {
    let mut ms = Vec::new();
    for i in 0..18 {
        let x = x.clone().detach().require_grad();
        let start = Instant::now();
        let y = pool(x.clone());
        let grads = (y * g.clone()).sum().backward();
        // `flex` runs eagerly: the gradient is computed once it is taken (no copy out).
        let dx = x.grad(&grads).expect("input gradient");
        drop(dx);
        if i >= 3 {
            ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    median(ms)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let device = Device::flex().autodiff();
    let burn_pool = |x: Tensor<4>| -> Tensor<2> {
        let [b, c, _, _] = x.dims();
        x.flatten::<3>(2, 3).mean_dim(2).reshape([b, c])
    };
    println!("| shape | Burn ms | Kiln ms | Burn ÷ Kiln |\n|---|---:|---:|---:|");
    for (name, dims) in [
        ("U1 64×256×8×8", [64, 256, 8, 8]),
        ("MobileNet v2 32×1280×7×7", [32, 1280, 7, 7]),
        ("ResNet-18 32×512×7×7", [32, 512, 7, 7]),
    ] {
        let x = Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let g = Tensor::<2>::random([dims[0], dims[1]], Distribution::Normal(0.0, 1.0), &device);
        let (mut burn_ms, mut kiln_ms) = (Vec::new(), Vec::new());
        for _ in 0..rounds.max(1) {
            burn_ms.push(time(&burn_pool, &x, &g));
            kiln_ms.push(time(&kiln::nn::global_avg_pool, &x, &g));
        }
        let range = |v: &[f64]| {
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
            format!("{:.3} ({lo:.3}–{hi:.3})", median(v.to_vec()))
        };
        println!(
            "| {name} | {} | {} | {:.2}× |",
            range(&burn_ms),
            range(&kiln_ms),
            median(burn_ms.clone()) / median(kiln_ms.clone())
        );
    }
}
