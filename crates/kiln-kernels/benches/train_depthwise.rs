//! The depthwise training kernels (`depthwise::planar`, NCHW: forward, input gradient, weight
//! gradient) on U1's layers and MobileNet v2's at batch 64, per shape and summed, in
//! G multiply-adds/s (ms per call, best of 5).
//!
//!     cargo bench -p kiln-kernels --bench train_depthwise -- 2        # threads (default 1)
//!     cargo bench -p kiln-kernels --bench train_depthwise -- 2 U1     # U1's shapes only
//!
//! Run it with `MIMALLOC_PURGE_DELAY=-1`, as `kiln` runs (each call's fresh output is then
//! a reused mapping, not pages faulted in).

mod support;

use support::time;

use kiln_kernels::depthwise::planar;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let (threads, pool) = support::pool_from_args();
    let batch = 64;
    // (name, channels, side, kernel, stride): U1's six depthwise layers (3×32×32 inputs),
    // then MobileNet v2's at 96×96 (a small-image training resolution).
    let cases = [
        ("U1 32ch 32² 3x3", 32, 32, 3, 1),
        ("U1 64ch 32² 3x3/2", 64, 32, 3, 2),
        ("U1 128ch 16² 3x3", 128, 16, 3, 1),
        ("U1 128ch 16² 3x3/2", 128, 16, 3, 2),
        ("U1 256ch 8² 5x5", 256, 8, 5, 1),
        ("U1 256ch 8² 3x3", 256, 8, 3, 1),
        ("v2 96ch 48² 3x3/2", 96, 48, 3, 2),
        ("v2 144ch 24² 3x3", 144, 24, 3, 1),
        ("v2 192ch 12² 3x3", 192, 12, 3, 1),
        ("v2 576ch 6² 3x3", 576, 6, 3, 1),
        ("v2 960ch 3² 3x3", 960, 3, 3, 1),
    ];
    println!(
        "{:<20} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7}   (batch {batch}, {threads} threads)",
        "shape", "fwd ms", "G/s", "dx ms", "G/s", "dw ms", "G/s"
    );
    let mut totals = [0.0f64; 3];
    for (name, c, side, k, stride) in cases {
        if !support::name_selected(name) {
            continue;
        }
        let s = support::square_conv(batch, c, side, c, k, stride, k / 2);
        let x: Vec<f32> = (0..s.batch * c * side * side)
            .map(|i| (i % 17) as f32 * 0.1 - 0.8)
            .collect();
        let w: Vec<f32> = (0..c * k * k)
            .map(|i| (i % 13) as f32 * 0.01 - 0.06)
            .collect();
        let g: Vec<f32> = (0..s.batch * c * s.out_h() * s.out_w())
            .map(|i| (i % 7) as f32 * 0.1 - 0.3)
            .collect();
        let macs = g.len() as f64 * (k * k) as f64;
        let iters = ((2e8 / macs) as usize).clamp(1, 200);
        let ms = pool.install(|| {
            [
                time(
                    || {
                        std::hint::black_box(planar::forward(&s, &x, &w, None));
                    },
                    iters,
                ),
                time(
                    || {
                        std::hint::black_box(planar::input_grad(&s, &g, &w));
                    },
                    iters,
                ),
                time(
                    || {
                        std::hint::black_box(planar::weight_grad(&s, &x, &g));
                    },
                    iters,
                ),
            ]
        });
        let mut line = format!("{name:<20}");
        for (t, m) in totals.iter_mut().zip(ms) {
            *t += m;
            line += &format!(" {m:>9.3} {:>7.1}", macs / m / 1e6);
        }
        println!("{line}");
    }
    println!(
        "total ms: forward {:.3}, input gradient {:.3}, weight gradient {:.3}, all {:.3}",
        totals[0],
        totals[1],
        totals[2],
        totals.iter().sum::<f64>()
    );
}
