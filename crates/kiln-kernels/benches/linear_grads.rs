//! The linear layer's weight gradient (`xᵀ · grad`, summed over every row of the batch) on
//! the transformers' shapes: the gemm crate splitting the output between threads
//! (`matmul_fresh`) beside the sum split into one part per thread (`matmul_fresh_split_sum`,
//! what `linear_weight_grad` runs), in ms per call and GFLOP/s, best of 5; W4's forward
//! shapes too, where the split must leave the gemm crate's own (BENCHMARKS.md run 58).
//!
//!     cargo bench -p kiln-kernels --bench linear_grads -- 2 [W4]   # threads (default 1)

mod support;

use std::mem::MaybeUninit;

use support::time;

use kiln_kernels::base::gemm::{matmul_fresh, matmul_fresh_split_sum};

/// `(name, rows, inputs, outputs, weight gradient?)`: a weight gradient is `[inputs,
/// outputs]` summed over `rows`; a forward is `[rows, outputs]` summed over `inputs`.
type Case = (&'static str, usize, usize, usize, bool);

fn main() {
    let (threads, pool) = support::pool_from_args();
    let cases: [Case; 7] = [
        ("W4 dW qkv 1792 rows 128->384", 1792, 128, 384, true),
        ("W4 dW ff1 1792 rows 128->512", 1792, 128, 512, true),
        ("W4 dW ff2 1792 rows 512->128", 1792, 512, 128, true),
        ("W4 dW out 1792 rows 128->128", 1792, 128, 128, true),
        ("U2 dW ff1 4096 rows 128->512", 4096, 128, 512, true),
        ("W4 fwd ff1 1792 rows 128->512", 1792, 128, 512, false),
        ("W4 fwd ff2 1792 rows 512->128", 1792, 512, 128, false),
    ];
    println!("{threads} thread(s); ms per call (GFLOP/s): gemm crate's split | sum split");
    pool.install(|| {
        for (name, rows, inputs, outputs, weight_grad) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let x: Vec<f32> = (0..rows * inputs).map(|i| (i % 7) as f32 * 0.1).collect();
            let other_len = if weight_grad {
                rows * outputs
            } else {
                inputs * outputs
            };
            let other: Vec<f32> = (0..other_len).map(|i| (i % 5) as f32 * 0.1).collect();
            // A weight gradient reads x transposed; a forward reads it as it lies.
            let (dims, lhs) = if weight_grad {
                ((inputs, outputs, rows), (&x[..], (1, inputs)))
            } else {
                ((rows, outputs, inputs), (&x[..], (inputs, 1)))
            };
            let rhs = (&other[..], (outputs, 1));
            let mut dst = vec![MaybeUninit::new(0f32); dims.0 * dims.1];
            let plain = time(|| matmul_fresh(dims, &mut dst, lhs, rhs, threads), 50);
            let split = time(
                || matmul_fresh_split_sum(dims, &mut dst, lhs, rhs, threads),
                50,
            );
            let gflops = |ms: f64| 2.0 * (dims.0 * dims.1 * dims.2) as f64 / ms / 1e6;
            println!(
                "{name:30} {plain:6.3} ({:5.1}) | {split:6.3} ({:5.1})",
                gflops(plain),
                gflops(split)
            );
        }
    });
}
