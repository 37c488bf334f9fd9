//! The f32 training convolution kernels (NCHW: forward, input gradient, weight gradient) on
//! W5's shapes (ResNet-18 at 32×32, batch 64), per shape and summed over the network, in
//! G multiply-adds/s.
//!
//!     cargo bench -p kiln-kernels --bench train_conv -- 2     # threads (default 1)

mod support;

use support::time;

use kiln_kernels::conv::{conv2d_forward, conv2d_input_grad, conv2d_weight_grad};

fn main() {
    let (threads, pool) = support::pool_from_args();
    let batch = 64;
    // (name, cin, side, cout, kernel, stride, padding, occurrences in W5)
    let cases = [
        ("stem 3→64 32²", 3, 32, 64, 3, 1, 1, 1),
        ("3x3 64 32²", 64, 32, 64, 3, 1, 1, 4),
        ("3x3/2 64→128", 64, 32, 128, 3, 2, 1, 1),
        ("1x1/2 64→128", 64, 32, 128, 1, 2, 0, 1),
        ("3x3 128 16²", 128, 16, 128, 3, 1, 1, 3),
        ("3x3/2 128→256", 128, 16, 256, 3, 2, 1, 1),
        ("1x1/2 128→256", 128, 16, 256, 1, 2, 0, 1),
        ("3x3 256 8²", 256, 8, 256, 3, 1, 1, 3),
        ("3x3/2 256→512", 256, 8, 512, 3, 2, 1, 1),
        ("1x1/2 256→512", 256, 8, 512, 1, 2, 0, 1),
        ("3x3 512 4²", 512, 4, 512, 3, 1, 1, 3),
    ];
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}   (batch {batch}, {threads} threads)",
        "shape", "fwd ms", "G/s", "dx ms", "G/s", "dw ms", "G/s"
    );
    // An optional word after the thread count keeps only the shapes whose name contains it.
    let only = std::env::args()
        .skip(1)
        .rfind(|a| !a.starts_with("--") && a.parse::<usize>().is_err());
    let mut totals = [0.0f64; 3];
    let mut total_macs = 0.0;
    for (name, cin, side, cout, k, stride, pad, count) in cases {
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let s = support::square_conv(batch, cin, side, cout, k, stride, pad);
        let x: Vec<f32> = (0..s.input_len())
            .map(|i| (i % 17) as f32 * 0.1 - 0.8)
            .collect();
        let w: Vec<f32> = (0..s.weight_len())
            .map(|i| (i % 13) as f32 * 0.01 - 0.06)
            .collect();
        let g: Vec<f32> = (0..s.output_len())
            .map(|i| (i % 7) as f32 * 0.1 - 0.3)
            .collect();
        let mut out = vec![0f32; s.output_len()];
        let mut dx = vec![0f32; s.input_len()];
        let mut dw = vec![0f32; s.weight_len()];
        let macs = s.output_len() as f64 * (cin * k * k) as f64;
        let ms = pool.install(|| {
            [
                time(|| conv2d_forward(&s, &x, &w, None, &mut out), 1),
                time(|| conv2d_input_grad(&s, &g, &w, &mut dx), 1),
                time(|| conv2d_weight_grad(&s, &x, &g, &mut dw), 1),
            ]
        });
        println!("{name:<16}{}", columns(ms, macs));
        for (t, m) in totals.iter_mut().zip(ms) {
            *t += m * count as f64;
        }
        total_macs += macs * count as f64;
    }
    println!(
        "{:<16}{}   all: {:.1} ms",
        "W5 (weighted)",
        columns(totals, total_macs),
        totals.iter().sum::<f64>()
    );
}

/// Each operation's ms and G multiply-adds/s, as table columns.
fn columns(ms: [f64; 3], macs: f64) -> String {
    ms.iter()
        .map(|&m| format!(" {m:>9.2} {:>9.1}", macs / m / 1e6))
        .collect()
}
