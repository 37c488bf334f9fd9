//! [`qkv_attention`]: self-attention over one packed QKV projection, the form ViT-style
//! blocks write (`Linear(d, 3d)`, split into heads, attention, heads merged back), as one
//! operation.

use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Tensor};

/// Self-attention of a packed projection `qkv` `[batch, tokens, 3·heads·head_dim]` — each
/// token's queries, then keys, then values, head by head, as a `Linear(d, 3·d)` writes them
/// and `qkv.reshape([b, t, 3, heads, head_dim])` reads them — with the heads merged back:
/// `[batch, tokens, heads·head_dim]`, ready for the output projection. The same values as
/// splitting the projection, [`attention`](crate::nn::attention) and merging:
///
/// ```text
/// let parts = qkv.reshape([b, t, 3, heads, dk]).permute([2, 0, 3, 1, 4]);
/// let part = |i| parts.clone().narrow(0, i, 1).reshape([b, heads, t, dk]);
/// attention(part(0), part(1), part(2), mask, bias, options).swap_dims(1, 2).reshape([b, t, heads * dk])
/// ```
///
/// but on the CPU in f32 one kernel reads the projection in place, writes the context in
/// token order and, under autodiff, the projection's gradient in its packed layout: no
/// split, no merge copy, and none of the zero-filled full-size gradients the split's
/// backward makes per part (BENCHMARKS.md run 57). Elsewhere the composition above runs
/// (with [`attention`](crate::nn::attention)'s autocast policy). `mask` and `bias` broadcast
/// to `[batch, heads, tokens, tokens]` as in Burn's attention.
///
/// # Panics
/// When the projection's width is not a multiple of `3 · heads` (as Burn's reshape would).
pub fn qkv_attention(
    qkv: Tensor<3>,
    heads: usize,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Tensor<3> {
    let [b, t, width] = qkv.dims();
    assert!(
        heads > 0 && width % (3 * heads) == 0,
        "qkv_attention: a packed projection of width {width} does not split into 3 × {heads} heads"
    );
    let fallback = (mask.clone(), bias.clone(), qkv.clone());
    if let Some(out) = crate::kernels::transformer::qkv_attention(qkv, heads, mask, bias, &options)
    {
        return out;
    }
    let (mask, bias, qkv) = fallback;
    let dk = width / (3 * heads);
    let parts = qkv.reshape([b, t, 3, heads, dk]).permute([2, 0, 3, 1, 4]);
    let part = |i: usize| -> Tensor<4> { parts.clone().narrow(0, i, 1).reshape([b, heads, t, dk]) };
    crate::precision::attention(part(0), part(1), part(2), mask, bias, options)
        .swap_dims(1, 2)
        .reshape([b, t, heads * dk])
}
