//! Attention on `flex` (the bodies [`super::KilnKernels`]'s `Flex` impl delegates to): the
//! `[batch, heads, positions, features]` form of Burn's attention and the packed form over
//! one QKV projection `[batch, tokens, 3·heads·head_dim]`. The kernel reads every operand
//! through its strides (a view a model cut out of a wider tensor is not copied) and writes
//! the context, and in the packed form the projection's gradient, in the layout the model
//! reads next: in Burn's form the context is a `[batch, heads, tokens, d]` view of
//! token-ordered memory, so the `swap_dims(1, 2).reshape([b, t, heads·d])` every
//! transformer applies next is free, and each gradient comes back in its operand's own
//! memory order (the backward of the split that made the operand is then free too).

use burn::backend::flex::Layout as FlexLayout;
use kiln_kernels::attention::{
    AttentionGrads, AttentionOutput, AttentionShape, GradLayout, Layout, ScoreOptions, Strided,
    attention_backward, attention_forward,
};

use super::*;

/// `None` for the "none" stand-in, a single 0 (a single nonzero value is a real operand: a
/// mask that hides everything, a bias the softmax cancels); else `t` readable through
/// non-negative strides.
fn present(t: FloatTensor<Flex>) -> Option<FloatTensor<Flex>> {
    let none = t.shape().num_elements() == 1 && values(&t).first() == Some(&0.0);
    (!none).then(|| forward_strided(t))
}

/// `t` as a tensor whose strides are all non-negative (a copy only for a flipped view).
fn forward_strided(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    if t.layout().strides().iter().all(|&s| s >= 0) {
        t
    } else {
        t.to_contiguous()
    }
}

/// A rank-4 tensor's values from its first element and its strides; a stride of 0 where
/// the tensor has 1 and `dims` more (broadcast).
fn strided_of<'a>(t: &'a FloatTensor<Flex>, dims: [usize; 4]) -> Strided<'a, f32> {
    let (layout, own) = (t.layout(), t.shape());
    let strides = std::array::from_fn(|i| {
        if own[i] == 1 && dims[i] != 1 {
            0
        } else {
            layout.strides()[i].max(0) as usize
        }
    });
    Strided {
        values: t
            .storage::<f32>()
            .get(layout.start_offset()..)
            .unwrap_or(&[]),
        strides,
    }
}

/// Part `part` (0 = queries, 1 = keys, 2 = values) of a packed `[batch, tokens, 3·heads·d]`
/// projection as a `[batch, heads, tokens, d]` operand.
fn packed_part(qkv: &FloatTensor<Flex>, heads: usize, part: usize) -> Strided<'_, f32> {
    let (layout, dims) = (qkv.layout(), qkv.shape());
    let s = layout.strides();
    let (s0, s1, s2) = (
        s[0].max(0) as usize,
        s[1].max(0) as usize,
        s[2].max(0) as usize,
    );
    let d = dims[2] / (3 * heads).max(1);
    let start = layout.start_offset() + part * heads * d * s2;
    Strided {
        values: qkv.storage::<f32>().get(start..).unwrap_or(&[]),
        strides: [s0, d * s2, s1, s2],
    }
}

/// A `[batch, tokens, heads·d]` tensor (the context's gradient) as `[batch, heads, tokens, d]`.
fn merged_heads(t: &FloatTensor<Flex>, heads: usize) -> Strided<'_, f32> {
    let (layout, dims) = (t.layout(), t.shape());
    let s = layout.strides();
    let (s0, s1, s2) = (
        s[0].max(0) as usize,
        s[1].max(0) as usize,
        s[2].max(0) as usize,
    );
    let d = dims[2] / heads.max(1);
    Strided {
        values: t
            .storage::<f32>()
            .get(layout.start_offset()..)
            .unwrap_or(&[]),
        strides: [s0, d * s2, s1, s2],
    }
}

/// The scores' options from the mask and bias tensors (either possibly the stand-in).
fn with_scores<R>(
    dims: [usize; 4],
    (mask, bias): (FloatTensor<Flex>, FloatTensor<Flex>),
    (scale, causal): (f64, bool),
    f: impl FnOnce(&ScoreOptions<'_>) -> R,
) -> R {
    let (mask, bias) = (present(mask), present(bias));
    f(&ScoreOptions {
        scale: scale as f32,
        mask: mask.as_ref().map(|m| strided_of(m, dims)),
        causal,
        bias: bias.as_ref().map(|b| strided_of(b, dims)),
    })
}

fn span(s: &AttentionShape, name: &'static str) -> tracing::span::EnteredSpan {
    tracing::trace_span!(
        "kiln.attention",
        op = name,
        batch = s.batch,
        heads = s.heads,
        queries = s.queries,
        keys = s.keys,
        flops = 2 * (s.pairs() * s.queries * s.keys * (s.head_dim + s.value_dim)) as u64
    )
    .entered()
}

/// Burn's form: `[batch, heads, positions, features]` operands, the context in the same form.
pub(super) fn attention(
    [query, key, value]: [FloatTensor<Flex>; 3],
    extras: (FloatTensor<Flex>, FloatTensor<Flex>),
    (scale, causal, keep_probs): (f64, bool, bool),
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    let [query, key, value] = [query, key, value].map(forward_strided);
    let s = shape_of(&query, &key, &value);
    let _op = span(&s, "forward");
    let dims = |t, d| [s.batch, s.heads, t, d];
    let out: AttentionOutput = with_scores(dims(s.queries, s.keys), extras, (scale, causal), |o| {
        let operands = (
            strided_of(&query, dims(s.queries, s.head_dim)),
            strided_of(&key, dims(s.keys, s.head_dim)),
            strided_of(&value, dims(s.keys, s.value_dim)),
        );
        attention_forward(&s, operands, o, keep_probs, Layout::Tokens)
    });
    let (context, probs) = outputs(out, &s, [s.batch, s.queries, s.heads, s.value_dim]);
    (heads_view(context, Layout::Tokens), probs)
}

/// Whether a `[batch, heads, positions, d]` operand lies in token order in memory (a head's
/// rows further apart than a token's heads: the view `reshape([b, t, h, d]).swap_dims(1, 2)`
/// makes of a projection's output).
fn order_of(t: &FloatTensor<Flex>) -> Layout {
    let strides = t.layout().strides();
    if t.shape()[1] > 1 && t.shape()[2] > 1 && strides[1] < strides[2] {
        Layout::Tokens
    } else {
        Layout::Heads
    }
}

/// A result the kernel wrote in `layout` as the `[batch, heads, positions, d]` tensor it
/// is: `t` as written when in head order; when in token order (`t` is `[batch, positions,
/// heads, d]`), a view with the heads axis first over the same memory.
fn heads_view(t: FloatTensor<Flex>, layout: Layout) -> FloatTensor<Flex> {
    if layout == Layout::Heads {
        return t;
    }
    let [b, p, h, d] = t.shape().dims::<4>();
    let strides = [p * h * d, d, h * d, 1].map(|s| s as isize).to_vec();
    t.with_layout(FlexLayout::new([b, h, p, d].into(), strides, 0))
}

/// The `[batch, heads, positions, d]` dims of a result as the kernel writes it in `layout`.
fn written_dims([b, h, p, d]: [usize; 4], layout: Layout) -> [usize; 4] {
    match layout {
        Layout::Heads => [b, h, p, d],
        Layout::Tokens => [b, p, h, d],
    }
}

/// The context (in `dims`) and the probabilities (empty when not kept) as tensors.
fn outputs<const D: usize>(
    out: AttentionOutput,
    s: &AttentionShape,
    dims: [usize; D],
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    let kept = !out.probs.is_empty();
    let probs = [s.batch, s.heads, s.queries, s.keys].map(|d| if kept { d } else { 0 });
    (
        flex_tensor(out.context, dims),
        flex_tensor(out.probs, probs),
    )
}

fn shape_of(q: &FloatTensor<Flex>, k: &FloatTensor<Flex>, v: &FloatTensor<Flex>) -> AttentionShape {
    let (q, k, v) = (q.shape(), k.shape(), v.shape());
    AttentionShape {
        batch: q[0],
        heads: q[1],
        queries: q[2],
        keys: k[2],
        head_dim: q[3],
        value_dim: v[3],
    }
}

/// The gradients of Burn's form.
pub(super) fn attention_grads(
    [query, key, value]: [FloatTensor<Flex>; 3],
    probs: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
    (scale, bias_grad): (f64, bool),
) -> (
    FloatTensor<Flex>,
    FloatTensor<Flex>,
    FloatTensor<Flex>,
    Option<FloatTensor<Flex>>,
) {
    let [query, key, value, output_grad] = [query, key, value, output_grad].map(forward_strided);
    let s = shape_of(&query, &key, &value);
    let _op = span(&s, "backward");
    let dims = |t, d| [s.batch, s.heads, t, d];
    let orders = [order_of(&query), order_of(&key), order_of(&value)];
    let grads = attention_backward(
        &s,
        (
            strided_of(&query, dims(s.queries, s.head_dim)),
            strided_of(&key, dims(s.keys, s.head_dim)),
            strided_of(&value, dims(s.keys, s.value_dim)),
        ),
        &values(&probs),
        strided_of(&output_grad, dims(s.queries, s.value_dim)),
        scale as f32,
        bias_grad,
        GradLayout::Separate(orders),
    );
    let AttentionGrads {
        query,
        key,
        value,
        bias,
    } = grads;
    let grad = |values: Vec<f32>, dims: [usize; 4], order: Layout| {
        heads_view(flex_tensor(values, written_dims(dims, order)), order)
    };
    (
        grad(query, dims(s.queries, s.head_dim), orders[0]),
        grad(key, dims(s.keys, s.head_dim), orders[1]),
        grad(value, dims(s.keys, s.value_dim), orders[2]),
        bias.map(|g| flex_tensor(g, dims(s.queries, s.keys))),
    )
}

/// The packed projection's shape: `[batch, tokens, 3·heads·d]`.
fn packed_shape(qkv: &FloatTensor<Flex>, heads: usize) -> AttentionShape {
    let dims = qkv.shape();
    let d = dims[2] / (3 * heads).max(1);
    AttentionShape {
        batch: dims[0],
        heads,
        queries: dims[1],
        keys: dims[1],
        head_dim: d,
        value_dim: d,
    }
}

/// The packed form: self-attention of a `[batch, tokens, 3·heads·d]` projection, the context
/// `[batch, tokens, heads·d]`.
pub(super) fn qkv_attention(
    qkv: FloatTensor<Flex>,
    extras: (FloatTensor<Flex>, FloatTensor<Flex>),
    heads: usize,
    (scale, causal, keep_probs): (f64, bool, bool),
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    let qkv = forward_strided(qkv);
    let s = packed_shape(&qkv, heads);
    let _op = span(&s, "packed forward");
    let scores = [s.batch, s.heads, s.queries, s.keys];
    let out = with_scores(scores, extras, (scale, causal), |o| {
        let parts = (
            packed_part(&qkv, heads, 0),
            packed_part(&qkv, heads, 1),
            packed_part(&qkv, heads, 2),
        );
        attention_forward(&s, parts, o, keep_probs, Layout::Tokens)
    });
    outputs(out, &s, [s.batch, s.queries, s.heads * s.value_dim])
}

/// The packed form's gradients: the projection's `[batch, tokens, 3·heads·d]`, and the
/// bias's when asked for.
pub(super) fn qkv_attention_grads(
    qkv: FloatTensor<Flex>,
    probs: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
    heads: usize,
    (scale, bias_grad): (f64, bool),
) -> (FloatTensor<Flex>, Option<FloatTensor<Flex>>) {
    let [qkv, output_grad] = [qkv, output_grad].map(forward_strided);
    let s = packed_shape(&qkv, heads);
    let _op = span(&s, "packed backward");
    let grads = attention_backward(
        &s,
        (
            packed_part(&qkv, heads, 0),
            packed_part(&qkv, heads, 1),
            packed_part(&qkv, heads, 2),
        ),
        &values(&probs),
        merged_heads(&output_grad, heads),
        scale as f32,
        bias_grad,
        GradLayout::Packed,
    );
    let dims = qkv.shape();
    (
        flex_tensor(grads.query, [dims[0], dims[1], dims[2]]),
        grads
            .bias
            .map(|g| flex_tensor(g, [s.batch, s.heads, s.queries, s.keys])),
    )
}
