//! The depthwise convolution's kernels side by side on the mobile families' shapes: the
//! portable loop (`multiversion!`, auto-vectorized for the CPU's best instruction set) against
//! the interior strips of AVX-512 and AVX2 intrinsics (each where this CPU has it), in
//! G multiply-adds/s (ms per call), best of 5 (BENCHMARKS.md run 35).
//!
//!     cargo bench -p kiln-kernels --bench depthwise -- 2       # threads (default 1)
//!     cargo bench -p kiln-kernels --bench depthwise -- 2 8     # at batch 8

mod support;

use support::time;

use kiln_kernels::base::isa::F32Kernel;
use kiln_kernels::base::window::Window2d;
use kiln_kernels::depthwise::{DepthwiseWeights, depthwise_conv2d_on};

fn main() {
    let (threads, pool) = support::pool_from_args();
    let batch = support::number_arg(1).unwrap_or(1);
    // (name, channels, side, kernel, stride): EfficientNet-B0's and MobileNet v2's layers,
    // then ConvNeXt's; names on the command line select cases (`-- 2 7x7`).
    let cases = [
        ("32ch 112² 3x3", 32, 112, 3, 1),
        ("96ch 112² 3x3/2", 96, 112, 3, 2),
        ("144ch 56² 3x3", 144, 56, 3, 1),
        ("144ch 56² 5x5/2", 144, 56, 5, 2),
        ("240ch 28² 5x5", 240, 28, 5, 1),
        ("480ch 14² 3x3", 480, 14, 3, 1),
        ("672ch 14² 5x5", 672, 14, 5, 1),
        ("1152ch 7² 5x5", 1152, 7, 5, 1),
        // ConvNeXt-tiny's 7×7 layers, one per stage.
        ("96ch 56² 7x7", 96, 56, 7, 1),
        ("192ch 28² 7x7", 192, 28, 7, 1),
        ("384ch 14² 7x7", 384, 14, 7, 1),
        ("768ch 7² 7x7", 768, 7, 7, 1),
    ];
    println!("{threads} thread(s), batch {batch}; G multiply-adds/s (ms per call)");
    let mut totals = vec![0.0; F32Kernel::all_supported().len()];
    pool.install(|| {
        for (name, c, side, k, stride) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let pad = k / 2;
            let win = Window2d {
                dims: [batch, side, side, c],
                kernel: [k, k],
                stride: [stride, stride],
                dilation: [1, 1],
                pads: [(pad, pad); 2],
                ceil_mode: false,
            };
            let x: Vec<f32> = (0..batch * side * side * c)
                .map(|i| (i % 7) as f32 * 0.1)
                .collect();
            let w: Vec<f32> = (0..c * k * k).map(|i| (i % 5) as f32 * 0.01).collect();
            let packed = DepthwiseWeights::pack(c, [k, k], &w, None);
            let [_, oh, ow, _] = win.out_dims();
            let macs = (batch * oh * ow * c * k * k) as f64;
            let iters = ((5e7 / macs) as usize).clamp(1, 2000);
            let mut line = format!("{name:18}");
            for (i, kernel) in F32Kernel::all_supported().into_iter().enumerate() {
                let ms = time(
                    || {
                        std::hint::black_box(depthwise_conv2d_on(kernel, &x, &win, &packed, None));
                    },
                    iters,
                );
                totals[i] += ms;
                line += &format!(" | {} {:6.1} ({ms:.4})", kernel.name(), macs / ms / 1e6);
            }
            println!("{line}");
        }
    });
    let names: Vec<_> = F32Kernel::all_supported()
        .iter()
        .zip(&totals)
        .map(|(k, t)| format!("{} {t:.3}", k.name()))
        .collect();
    println!("all shapes, ms: {}", names.join(" | "));
}
