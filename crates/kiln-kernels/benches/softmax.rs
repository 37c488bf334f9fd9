//! The attention softmax (`kernels::softmax`) on the transformers' shapes, in ns per value
//! (ms per call), best of 5: ViT-B/16's 12 heads × 197 rows of 197 scores and BERT-base's
//! 12 × 128 rows of 128 (BENCHMARKS.md run 42).
//!
//!     cargo bench -p kiln-kernels --bench softmax -- 2         # threads (default 1)

mod support;

use support::time;

use kiln_kernels::softmax::softmax_rows;

fn main() {
    let (threads, pool) = support::pool_from_args();
    let cases = [
        ("ViT-B/16 12x197x197", 12 * 197, 197),
        ("BERT 12x128x128", 12 * 128, 128),
    ];
    println!("{threads} thread(s); ns per value (ms per call)");
    pool.install(|| {
        for (name, rows, row) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let x: Vec<f32> = (0..rows * row)
                .map(|i| ((i * 7919) % 1013) as f32 * 0.013 - 6.0)
                .collect();
            let ms = time(
                || {
                    std::hint::black_box(softmax_rows(std::hint::black_box(&x), row));
                },
                200,
            );
            let per_value = ms * 1e6 / (rows * row) as f64;
            println!("{name:22} {per_value:6.3} ns ({ms:.3} ms)");
        }
    });
}
