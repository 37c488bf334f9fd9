//! An int8 linear layer (`kernels::int8`, dynamic activation quantization) on BERT-base's and
//! ViT-B/16's shapes, phase by phase, in ms per call (best of 5): the range scan, the
//! quantization of the input, the integer product with its dequantizing epilogue (and GELU
//! where the model fuses one), and the three together as a layer runs them — so the
//! kernel's share of a layer is visible (BENCHMARKS.md run 43). "product" reuses one
//! weight matrix (cache-resident); "cold layer" rotates over ~96 MB of copies, as a model's
//! run reads its weights from memory.
//!
//!     cargo bench -p kiln-kernels --bench int8_linear -- 2         # threads (default 1)

mod support;

use support::time;

use kiln_kernels::activation::Activation;
use kiln_kernels::base::isa::Int8Kernel;
use kiln_kernels::int8::{
    ActivationQuant, PackedWeights, QuantizedActivations, matmul_dequantized, quantize_rows,
    range_of,
};

fn main() {
    let (threads, pool) = support::pool_from_args();
    // (name, rows, in, out, fused activation)
    let cases = [
        ("BERT qkv 128x768x768", 128, 768, 768, None),
        (
            "BERT ffn1 128x768x3072 gelu",
            128,
            768,
            3072,
            Some(Activation::Gelu),
        ),
        ("BERT ffn2 128x3072x768", 128, 3072, 768, None),
        ("BERT ffn1 128x768x3072", 128, 768, 3072, None),
        (
            "ViT ffn1 197x768x3072 gelu",
            197,
            768,
            3072,
            Some(Activation::Gelu),
        ),
    ];
    let kernel = Int8Kernel::detect();
    println!(
        "{threads} thread(s), {} kernel; ms per call (G multiply-adds/s)",
        kernel.name()
    );
    println!(
        "{:30} {:>8} {:>8} {:>16} {:>16}",
        "layer", "range", "quant", "product", "cold layer"
    );
    pool.install(|| {
        for (name, rows, k, n, act) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 7919) % 1013) as f32 * 0.004 - 2.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 104_729) % 2039) as f32 * 0.001 - 1.0)
                .collect();
            let packed = PackedWeights::new(&quantize_rows(&w, n, k), kernel);
            // A model's weights come from memory on every run (BERT-base's int8 layers are
            // 85 MB): the layer runs also rotate over copies of about that size, so the
            // weights are not cache-resident.
            let copies: Vec<PackedWeights> =
                (0..(96 << 20) / (n * k)).map(|_| packed.clone()).collect();
            let mut next = 0;
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
            let quant = ActivationQuant::for_range(range_of(&x));
            let a = QuantizedActivations::new(&x, k, quant, kernel);
            let iters = 50;
            let range = time(|| _ = std::hint::black_box(range_of(&x)), iters);
            let quantize = time(
                || {
                    drop(std::hint::black_box(QuantizedActivations::new(
                        &x, k, quant, kernel,
                    )))
                },
                iters,
            );
            let product = time(
                || {
                    drop(std::hint::black_box(matmul_dequantized(
                        &a,
                        &packed,
                        Some(&bias),
                        act,
                    )))
                },
                iters,
            );
            let layer = time(
                || {
                    next = (next + 1) % copies.len();
                    let quant = ActivationQuant::for_range(range_of(&x));
                    let a = QuantizedActivations::new(&x, k, quant, kernel);
                    drop(std::hint::black_box(matmul_dequantized(
                        &a,
                        &copies[next],
                        Some(&bias),
                        act,
                    )))
                },
                iters,
            );
            let gmacs = |ms: f64| (rows * k * n) as f64 / ms / 1e6;
            println!(
                "{name:30} {range:8.3} {quantize:8.3} {product:8.3} ({:5.0}) {layer:8.3} ({:5.0})",
                gmacs(product),
                gmacs(layer)
            );
        }
    });
}
