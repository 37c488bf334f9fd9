//! The f32 inference convolution kernels side by side on the same packed operands: the
//! `gemm`-crate path (patch gather + GEMM) against the implicit-GEMM kernel on AVX-512 and
//! AVX2 (each where this CPU has it), per shape, in G multiply-adds/s (BENCHMARKS.md run 29).
//!
//!     cargo bench -p kiln-kernels --bench conv_kernels -- 2       # threads (default 1)
//!     cargo bench -p kiln-kernels --bench conv_kernels -- 2 8     # ResNet-18's shapes at batch 8
//!     cargo bench -p kiln-kernels --bench conv_kernels -- 2 "R18 3x3"   # only shapes named so
//!
//! The SIMD columns run 3×3 stride-1 shapes as Winograd F(2×2, 3×3) where it applies (their
//! G/s count the direct convolution's multiply-adds, so they can pass the CPU's peak);
//! `KILN_WINOGRAD=off` measures the implicit GEMM alone.

mod support;

// The CLI's allocator, so outputs allocated per call (as in a model) cost what they do there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use support::time;

use kiln_kernels::activation::Activation;
use kiln_kernels::base::isa::F32Kernel;
use kiln_kernels::implicit::{ConvWeights, conv2d_nhwc, conv2d_nhwc_fused_new};
use kiln_kernels::patches::{conv2d_nhwc_forward, pack_weight_for_nhwc};

fn main() {
    let (threads, pool) = support::pool_from_args();
    // ResNet-18's shapes run at this batch (the second number; default 1).
    let rb = support::number_arg(1).unwrap_or(1);
    let kernels: Vec<F32Kernel> = [F32Kernel::Avx512, F32Kernel::Avx2]
        .into_iter()
        .filter(|k| *k as u8 >= F32Kernel::detect() as u8)
        .collect();
    // (name, batch, cin, side, cout, kernel, stride, padding)
    let cases = [
        ("W3 conv1 b1", 1, 1, 28, 32, 3, 1, 0),
        ("W3 conv2 b1", 1, 32, 26, 64, 3, 1, 0),
        ("W3 conv2 b64", 64, 32, 26, 64, 3, 1, 0),
        ("R18 3x3 64 56²", rb, 64, 56, 64, 3, 1, 1),
        ("R18 3x3/2 64→128", rb, 64, 56, 128, 3, 2, 1),
        ("R18 3x3 512 7²", rb, 512, 7, 512, 3, 1, 1),
        ("W5 3x3 64 32² b8", 8, 64, 32, 64, 3, 1, 1),
        // ResNet-18 at 224², batch `rb`: every convolution shape once (the table's last line
        // sums them weighted by how often each occurs).
        ("R18 conv1 7x7/2", rb, 3, 224, 64, 7, 2, 3),
        ("R18 3x3 128 28²", rb, 128, 28, 128, 3, 1, 1),
        ("R18 1x1/2 64→128", rb, 64, 56, 128, 1, 2, 0),
        ("R18 3x3/2 128→256", rb, 128, 28, 256, 3, 2, 1),
        ("R18 3x3 256 14²", rb, 256, 14, 256, 3, 1, 1),
        ("R18 1x1/2 128→256", rb, 128, 28, 256, 1, 2, 0),
        ("R18 3x3/2 256→512", rb, 256, 14, 512, 3, 2, 1),
        ("R18 1x1/2 256→512", rb, 256, 14, 512, 1, 2, 0),
        // ResNet-50's bottleneck 1×1 layers of stage 1 (short K: 64 in, or 64 out).
        ("R50 1x1 64→256 56²", rb, 64, 56, 256, 1, 1, 0),
        ("R50 1x1 256→64 56²", rb, 256, 56, 64, 1, 1, 0),
        // The mobile families' wide early layers (EfficientNet-B0, MobileNet v2), where Kiln
        // trailed ONNX Runtime most per layer (BENCHMARKS run 35).
        ("EffNet stem 3x3/2 3→32", rb, 3, 224, 32, 3, 2, 1),
        ("MNv3 stem 3x3/2 3→16", rb, 3, 224, 16, 3, 2, 1),
        ("EffNet 1x1 32→16 112²", rb, 32, 112, 16, 1, 1, 0),
        ("EffNet 1x1 16→96 112²", rb, 16, 112, 96, 1, 1, 0),
        ("MNv2 1x1 144→24 56²", rb, 144, 56, 24, 1, 1, 0),
        ("MNv2 1x1 24→144 56²", rb, 24, 56, 144, 1, 1, 0),
        // SqueezeNet 1.1's stem and its fire modules' narrow squeeze layers at 55².
        ("SQ stem 3x3/2 3→64", rb, 3, 224, 64, 3, 2, 0),
        ("SQ 1x1 128→16 55²", rb, 128, 55, 16, 1, 1, 0),
        ("SQ 3x3 16→64 55²", rb, 16, 55, 64, 3, 1, 1),
        // Linear layers at batch 1 (a 1×1 convolution over one pixel): W3's fc1 reads a
        // 4.7 MB weight for 1.2 M multiply-adds, so memory bandwidth is what it measures.
        ("W3 fc1 b1", 1, 9216, 1, 128, 1, 1, 0),
        ("R18 fc b1", 1, 512, 1, 1000, 1, 1, 0),
        // ConvNeXt-tiny's MLP linear layers at batch 1 (rows = pixels), one per stage and
        // direction; BERT-base's at 128 tokens.
        ("CNX fc 96→384 ×3136", 3136, 96, 1, 384, 1, 1, 0),
        ("CNX fc 384→96 ×3136", 3136, 384, 1, 96, 1, 1, 0),
        ("CNX fc 384→1536 ×196", 196, 384, 1, 1536, 1, 1, 0),
        ("CNX fc 1536→384 ×196", 196, 1536, 1, 384, 1, 1, 0),
        ("CNX fc 768→3072 ×49", 49, 768, 1, 3072, 1, 1, 0),
        ("BERT fc 768→768 ×128", 128, 768, 1, 768, 1, 1, 0),
        ("BERT fc 768→3072 ×128", 128, 768, 1, 3072, 1, 1, 0),
    ];
    // How often each shape occurs in ResNet-18 (by name; others 0).
    let resnet18_count = |name: &str| match name {
        "R18 3x3 64 56²" => 4.0,
        "R18 3x3 128 28²" | "R18 3x3 256 14²" | "R18 3x3 512 7²" => 3.0,
        n if n.starts_with("R18") => 1.0,
        _ => 0.0,
    };
    // ms: the `gemm` path, then each SIMD kernel.
    let mut resnet18_ms = [0.0; 3];
    println!(
        "{threads} thread(s), ResNet-18 shapes at batch {rb}; G multiply-adds/s (ms per call)"
    );
    pool.install(|| {
        for (name, batch, cin, side, cout, k, stride, pad) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let s = support::square_conv(batch, cin, side, cout, k, stride, pad);
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
            resnet18_ms[0] += gemm * resnet18_count(name);
            for (i, kernel) in kernels.iter().enumerate() {
                let packed = ConvWeights::pack_for(*kernel, [cout, cin, k, k], &w, Some(&bias));
                let ms = time(|| conv2d_nhwc(&s, &x, &packed, true, &mut out), iters);
                line += &format!(" | {} {} {:.2}x", kernel.name(), rate(ms), gemm / ms);
                resnet18_ms[1 + i] += ms * resnet18_count(name);
            }
            println!("{line}");
            if name == "R50 1x1 64→256 56²" {
                // As in the model: the block's residual added and ReLU in the store, into a
                // fresh output per call.
                let packed = ConvWeights::pack([cout, cin, k, k], &w, Some(&bias));
                let res: Vec<f32> = (0..s.output_len()).map(|i| (i % 3) as f32).collect();
                let ms = time(
                    || {
                        std::hint::black_box(conv2d_nhwc_fused_new(
                            &s,
                            &x,
                            &packed,
                            Some(&res),
                            Some(Activation::Relu),
                        ));
                    },
                    iters,
                );
                println!(
                    "{:22} {} {}",
                    "  + residual, ReLU",
                    packed.kernel().name(),
                    rate(ms)
                );
            }
        }
    });
    let mut total = format!("ResNet-18 b{rb} convs, ms: gemm {:.2}", resnet18_ms[0]);
    for (i, kernel) in kernels.iter().enumerate() {
        total += &format!(" | {} {:.2}", kernel.name(), resnet18_ms[1 + i]);
    }
    println!("{total}");
}
