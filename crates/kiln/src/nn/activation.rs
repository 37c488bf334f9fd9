//! Burn's activation layer (`burn::nn::activation::Activation`, the field a
//! `TransformerEncoder`'s feed-forward or a user's config-chosen block carries) through
//! Kiln's kernels where it has them.

use burn::nn::activation::Activation;
use burn::tensor::Tensor;

use crate::kernels::transformer::{gelu, relu};

/// `layer.forward(x)`, with ReLU and exact GELU on Kiln's kernels ([`relu`], [`gelu`]:
/// forward and backward, f32 on `flex`) and every other activation on Burn's own layer.
/// Why: a Burn model that picks its activation by config calls Burn's ReLU and GELU through
/// this enum, and those cost a transformer's feed-forward two extra passes each way over its
/// widest tensor (W4: BENCHMARKS.md run 58).
pub fn activation<const D: usize>(layer: &Activation, x: Tensor<D>) -> Tensor<D> {
    match layer {
        Activation::Relu(_) => relu(x),
        Activation::Gelu(g) if !g.approximate => gelu(x),
        other => other.forward(x),
    }
}
