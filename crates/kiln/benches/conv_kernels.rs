//! The f32 inference convolution kernels side by side on the same packed operands: the
//! `gemm`-crate path (patch gather + GEMM) against the implicit-GEMM kernel on AVX-512 and
//! AVX2 (each where this CPU has it), per shape, in G multiply-adds/s (BENCHMARKS.md run 29).
//!
//!     cargo bench -p kiln --bench conv_kernels -- 2     # threads (default 1)

use std::time::Instant;

use kiln::kernels::conv::{ConvShape, conv2d_nhwc_forward, pack_weight_for_nhwc};
use kiln::kernels::implicit::{ConvWeights, F32Kernel, conv2d_nhwc};

/// Best of 5 repeats of `iters` calls, in ms per call, after 3 warm-up calls.
fn time(mut f: impl FnMut(), iters: usize) -> f64 {
    for _ in 0..3 {
        f();
    }
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() * 1e3 / iters as f64
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    // `cargo bench` passes `--bench`; the first number is the thread count.
    let threads = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool");
    let kernels: Vec<F32Kernel> = [F32Kernel::Avx512, F32Kernel::Avx2]
        .into_iter()
        .filter(|k| *k as u8 >= F32Kernel::detect() as u8)
        .collect();
    // (name, batch, cin, side, cout, kernel, stride, padding)
    let cases = [
        ("W3 conv1 b1", 1, 1, 28, 32, 3, 1, 0),
        ("W3 conv2 b1", 1, 32, 26, 64, 3, 1, 0),
        ("W3 conv2 b64", 64, 32, 26, 64, 3, 1, 0),
        ("R18 3x3 64 56² b1", 1, 64, 56, 64, 3, 1, 1),
        ("R18 3x3/2 64→128 b1", 1, 64, 56, 128, 3, 2, 1),
        ("R18 3x3 512 7² b1", 1, 512, 7, 512, 3, 1, 1),
        ("W5 3x3 64 32² b8", 8, 64, 32, 64, 3, 1, 1),
    ];
    println!("{threads} thread(s); G multiply-adds/s (ms per call)");
    pool.install(|| {
        for (name, batch, cin, side, cout, k, stride, pad) in cases {
            let s = ConvShape {
                batch,
                cin,
                h: side,
                w: side,
                cout,
                kh: k,
                kw: k,
                stride: [stride, stride],
                padding: [(pad, pad); 2],
                dilation: [1, 1],
            };
            let x: Vec<f32> = (0..s.input_len()).map(|i| (i % 7) as f32 * 0.1).collect();
            let w: Vec<f32> = (0..s.weight_len()).map(|i| (i % 5) as f32 * 0.01).collect();
            let bias = vec![0.1f32; cout];
            let mut out = vec![0f32; s.output_len()];
            let macs = (s.output_len() * cin * k * k) as f64;
            let iters = ((2e8 / macs) as usize).clamp(1, 2000);
            let rate = |ms: f64| format!("{:6.1} ({ms:.4})", macs / ms / 1e6);
            let plain = pack_weight_for_nhwc([cout, cin, k, k], &w);
            let gemm = time(
                || conv2d_nhwc_forward(&s, &x, &plain, Some(&bias), true, &mut out),
                iters,
            );
            let mut line = format!("{name:22} gemm {}", rate(gemm));
            for kernel in &kernels {
                let packed = ConvWeights::pack_for(*kernel, [cout, cin, k, k], &w, Some(&bias));
                let ms = time(|| conv2d_nhwc(&s, &x, &packed, true, &mut out), iters);
                line += &format!(" | {} {} {:.2}x", kernel.name(), rate(ms), gemm / ms);
            }
            println!("{line}");
        }
    });
}
