//! The f32 training convolution kernels (NCHW: forward, input gradient, weight gradient) on
//! W5's shapes (ResNet-18 at 32×32, batch 64) and U1's (a MobileNet-style network's stem and
//! pointwise 1×1 layers), per shape and summed over each network, in G multiply-adds/s.
//!
//!     cargo bench -p kiln-kernels --bench train_conv -- 2     # threads (default 1)
//!     cargo bench -p kiln-kernels --bench train_conv -- 2 U1  # U1's shapes only

mod support;

use support::time;

use kiln_kernels::conv::{conv2d_forward, conv2d_input_grad, conv2d_weight_grad};

fn main() {
    let (threads, pool) = support::pool_from_args();
    // (name, cin, side, cout, kernel, stride, padding, occurrences in W5)
    let w5 = [
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
    // U1's dense layers: the stem and the pointwise layers after each depthwise one.
    let u1 = [
        ("U1 stem 3→32 32²", 3, 32, 32, 3, 1, 1, 1),
        ("U1 1x1 32→64 32²", 32, 32, 64, 1, 1, 0, 1),
        ("U1 1x1 64→128 16²", 64, 16, 128, 1, 1, 0, 1),
        ("U1 1x1 128 16²", 128, 16, 128, 1, 1, 0, 1),
        ("U1 1x1 128→256 8²", 128, 8, 256, 1, 1, 0, 1),
        ("U1 1x1 256 8²", 256, 8, 256, 1, 1, 0, 2),
    ];
    for (network, cases) in [("W5", &w5[..]), ("U1", &u1[..])] {
        network_table(network, cases, threads, &pool);
    }
}

/// (name, cin, side, cout, kernel, stride, padding, occurrences in the network)
type Case = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// One network's table: each shape's row and the network's total (shapes weighted by their
/// occurrences).
fn network_table(network: &str, cases: &[Case], threads: usize, pool: &rayon::ThreadPool) {
    let batch = 64;
    if !cases.iter().any(|c| support::name_selected(c.0)) {
        return;
    }
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}   (batch {batch}, {threads} threads)",
        "shape", "fwd ms", "G/s", "dx ms", "G/s", "dw ms", "G/s"
    );
    let mut totals = [0.0f64; 3];
    let mut total_macs = 0.0;
    for &(name, cin, side, cout, k, stride, pad, count) in cases {
        // Words after the thread count keep only the shapes whose name contains one.
        if !support::name_selected(name) {
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
    if total_macs == 0.0 {
        return;
    }
    println!(
        "{:<16}{}   all: {:.1} ms",
        format!("{network} (weighted)"),
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
