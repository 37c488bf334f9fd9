//! The transformer's training kernels on the user-shaped encoder's (U2) and W4's shapes, in
//! ms per call: attention forward (probabilities kept) and backward, the packed form (Q, K,
//! V read inside one `[batch, tokens, 3·heads·d]` projection, the gradient written back in
//! that layout) beside the dense one, with GFLOP/s of the GEMMs; LayerNorm's training
//! forward and backward and GELU's forward and gradient with GB/s of the bytes each pass must
//! move. `KILN_F32_KERNEL=avx2` times the AVX2 paths of the element-wise kernels on an
//! AVX-512 machine (the GEMM crate picks its own instruction set).
//!
//!     cargo bench -p kiln-kernels --bench transformer -- 2 [U2|W4|ViT]   # threads (default 1)

mod support;

use support::time;

use kiln_kernels::activation::{gelu_backward, gelu_of};
use kiln_kernels::attention::{
    AttentionShape, GradLayout, Layout, ScoreOptions, Strided, attention_backward,
    attention_forward,
};
use kiln_kernels::layer_norm::{layer_norm_backward, layer_norm_train};

fn values(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i + seed) * 7919) % 1013) as f32 * 0.002 - 1.0)
        .collect()
}

fn main() {
    let (threads, pool) = support::pool_from_args();
    // (name, batch, tokens, heads, head dim, feed-forward width)
    let cases = [
        ("U2 b64 t64 h4 d32", 64, 64, 4, 32, 512),
        ("W4 b64 t28 h4 d32", 64, 28, 4, 32, 512),
        ("ViT-S b8 t197 h6 d64", 8, 197, 6, 64, 1536),
    ];
    println!("{threads} thread(s); ms per call");
    pool.install(|| {
        for (name, batch, tokens, heads, dk, ff) in cases {
            if !support::name_selected(name) {
                continue;
            }
            let s = AttentionShape {
                batch,
                heads,
                queries: tokens,
                keys: tokens,
                head_dim: dk,
                value_dim: dk,
            };
            let d = heads * dk;
            let packed = values(batch * tokens * 3 * d, 1);
            let d_ctx = values(batch * tokens * d, 2);
            let part = |p: usize| Strided {
                values: &packed[p * d..],
                strides: [tokens * 3 * d, dk, 3 * d, 1],
            };
            let options = ScoreOptions {
                scale: 1.0 / (dk as f32).sqrt(),
                mask: None,
                causal: false,
                bias: None,
            };
            let parts = (part(0), part(1), part(2));
            let dense: Vec<Vec<f32>> = (0..3).map(|p| values(batch * tokens * d, 3 + p)).collect();
            let dims = [batch, heads, tokens, dk];
            let dense_parts = (
                Strided::dense(&dense[0][..], dims),
                Strided::dense(&dense[1][..], dims),
                Strided::dense(&dense[2][..], dims),
            );
            let d_heads = Strided {
                values: &d_ctx[..],
                strides: [tokens * d, dk, d, 1],
            };
            let flops = 2.0 * (s.pairs() * tokens * tokens * 2 * dk) as f64;
            let probs = attention_forward(&s, parts, &options, true, Layout::Tokens).probs;
            let iters = 20;
            let fwd = time(
                || {
                    std::hint::black_box(attention_forward(&s, parts, &options, true, Layout::Tokens));
                },
                iters,
            );
            let bwd = time(
                || {
                    std::hint::black_box(attention_backward(
                        &s,
                        parts,
                        &probs,
                        d_heads,
                        options.scale,
                        false,
                        GradLayout::Packed,
                    ));
                },
                iters,
            );
            let dense_fwd = time(
                || {
                    std::hint::black_box(attention_forward(&s, dense_parts, &options, true, Layout::Heads));
                },
                iters,
            );
            let gf = |ms: f64, f: f64| f / ms / 1e6;
            println!(
                "{name:22} attention packed fwd {fwd:7.3} ({:5.1} GFLOP/s)  bwd {bwd:7.3} ({:5.1} GFLOP/s)  dense fwd {dense_fwd:7.3}",
                gf(fwd, flops),
                gf(bwd, 2.0 * flops),
            );
            let rows = batch * tokens;
            let x = values(rows * d, 7);
            let gamma = values(d, 8);
            let beta = values(d, 9);
            let dy = values(rows * d, 10);
            let (_, stats) = layer_norm_train(&x, &gamma, Some(&beta), 1e-5);
            let ln_fwd = time(
                || {
                    std::hint::black_box(layer_norm_train(&x, &gamma, Some(&beta), 1e-5));
                },
                iters,
            );
            let ln_bwd = time(
                || {
                    std::hint::black_box(layer_norm_backward(&x, &stats, &gamma, &dy));
                },
                iters,
            );
            let h = values(rows * ff, 11);
            let dh = values(rows * ff, 12);
            let gelu_fwd = time(
                || {
                    std::hint::black_box(gelu_of(&h));
                },
                iters,
            );
            let gelu_bwd = time(
                || {
                    std::hint::black_box(gelu_backward(&h, &dh));
                },
                iters,
            );
            let gbs = |ms: f64, floats: usize| (floats * 4) as f64 / ms / 1e6;
            println!(
                "{:22} layer norm fwd {ln_fwd:7.3} ({:5.1} GB/s)  bwd {ln_bwd:7.3} ({:5.1} GB/s)  GELU fwd {gelu_fwd:7.3} ({:5.1} GB/s)  grad {gelu_bwd:7.3} ({:5.1} GB/s)",
                "",
                gbs(ln_fwd, 2 * rows * d),
                gbs(ln_bwd, 3 * rows * d),
                gbs(gelu_fwd, 2 * rows * ff),
                gbs(gelu_bwd, 3 * rows * ff),
            );
        }
    });
}
