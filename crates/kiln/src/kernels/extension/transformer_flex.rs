//! The transformer ops on `flex` (the bodies [`super::KilnKernels`]'s `Flex` impl delegates
//! to): LayerNorm, GELU, softmax and attention over the tensors' host values. Callers route
//! f32 only (`kernels::transformer` checks); operands are read where they lie, through their
//! strides where the kernel takes strides (attention), else as a contiguous view or copy.

use kiln_kernels::activation::{gelu_backward, gelu_in_place};
use kiln_kernels::attention::{
    AttentionShape, ScoreOptions, Strided, attention_backward, attention_forward,
};
use kiln_kernels::layer_norm::{layer_norm_backward, layer_norm_rows, layer_norm_train};
use kiln_kernels::softmax::{softmax_grad_in_place, softmax_rows};

use super::*;

/// `x`'s dims and its last axis's length (1 for a scalar).
fn rows_of(x: &FloatTensor<Flex>) -> (Vec<usize>, usize) {
    let dims = x.shape().to_vec();
    let last = dims.last().copied().unwrap_or(1);
    (dims, last)
}

fn flex_dims(values: Vec<f32>, dims: &[usize]) -> FloatTensor<Flex> {
    <FloatTensor<Flex>>::from_data(TensorData::new(values, dims.to_vec()))
}

pub(super) fn layer_norm(
    x: FloatTensor<Flex>,
    gamma: FloatTensor<Flex>,
    beta: FloatTensor<Flex>,
    epsilon: f64,
) -> FloatTensor<Flex> {
    let (dims, _) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.layer_norm", shape = ?dims).entered();
    let mut y = values(&x).into_owned();
    layer_norm_rows(
        &mut y,
        &values(&gamma),
        Some(&values(&beta)),
        epsilon as f32,
    );
    flex_dims(y, &dims)
}

pub(super) fn layer_norm_train_forward(
    x: FloatTensor<Flex>,
    gamma: FloatTensor<Flex>,
    beta: FloatTensor<Flex>,
    epsilon: f64,
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    let (dims, last) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.layer_norm.train", shape = ?dims).entered();
    let (y, stats) = layer_norm_train(
        &values(&x),
        &values(&gamma),
        Some(&values(&beta)),
        epsilon as f32,
    );
    let rows = dims.iter().product::<usize>() / last.max(1);
    (flex_dims(y, &dims), flex_tensor(stats, [2, rows]))
}

pub(super) fn layer_norm_grads(
    x: FloatTensor<Flex>,
    stats: FloatTensor<Flex>,
    gamma: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
) -> (FloatTensor<Flex>, FloatTensor<Flex>, FloatTensor<Flex>) {
    let (dims, last) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.layer_norm.grad", shape = ?dims).entered();
    let (dx, dgamma, dbeta) = layer_norm_backward(
        &values(&x),
        &values(&stats),
        &values(&gamma),
        &values(&output_grad),
    );
    (
        flex_dims(dx, &dims),
        flex_tensor(dgamma, [last]),
        flex_tensor(dbeta, [last]),
    )
}

pub(super) fn gelu(x: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let (dims, _) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.gelu", shape = ?dims).entered();
    let mut y = values(&x).into_owned();
    gelu_in_place(&mut y);
    flex_dims(y, &dims)
}

pub(super) fn gelu_grad(x: FloatTensor<Flex>, output_grad: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let (dims, _) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.gelu.grad", shape = ?dims).entered();
    flex_dims(gelu_backward(&values(&x), &values(&output_grad)), &dims)
}

pub(super) fn softmax(x: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let (dims, last) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.softmax", shape = ?dims).entered();
    flex_dims(softmax_rows(&values(&x), last.max(1)), &dims)
}

pub(super) fn softmax_grad(
    output: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
) -> FloatTensor<Flex> {
    let (dims, last) = rows_of(&output);
    let _op = tracing::trace_span!("kiln.softmax.grad", shape = ?dims).entered();
    let mut dx = values(&output_grad).into_owned();
    softmax_grad_in_place(&mut dx, &values(&output), last.max(1));
    flex_dims(dx, &dims)
}

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
fn strided_of<'a, T>(storage: &'a [T], t: &FloatTensor<Flex>, dims: [usize; 4]) -> Strided<'a, T> {
    let (layout, own) = (t.layout(), t.shape());
    let strides = std::array::from_fn(|i| {
        if own[i] == 1 && dims[i] != 1 {
            0
        } else {
            layout.strides()[i].max(0) as usize
        }
    });
    Strided {
        values: storage.get(layout.start_offset()..).unwrap_or(&[]),
        strides,
    }
}

/// The operands' shape, and each operand readable through its strides.
struct AttentionOperands {
    shape: AttentionShape,
    query: FloatTensor<Flex>,
    key: FloatTensor<Flex>,
    value: FloatTensor<Flex>,
}

impl AttentionOperands {
    fn new(query: FloatTensor<Flex>, key: FloatTensor<Flex>, value: FloatTensor<Flex>) -> Self {
        let (q, k, v) = (query.shape(), key.shape(), value.shape());
        AttentionOperands {
            shape: AttentionShape {
                batch: q[0],
                heads: q[1],
                queries: q[2],
                keys: k[2],
                head_dim: q[3],
                value_dim: v[3],
            },
            query: forward_strided(query),
            key: forward_strided(key),
            value: forward_strided(value),
        }
    }

    fn dims(&self, positions: usize, features: usize) -> [usize; 4] {
        [self.shape.batch, self.shape.heads, positions, features]
    }

    /// Calls `f` with the query, key and value as strided operands.
    fn with<R>(
        &self,
        f: impl FnOnce(Strided<'_, f32>, Strided<'_, f32>, Strided<'_, f32>) -> R,
    ) -> R {
        let s = &self.shape;
        f(
            strided_of(
                self.query.storage::<f32>(),
                &self.query,
                self.dims(s.queries, s.head_dim),
            ),
            strided_of(
                self.key.storage::<f32>(),
                &self.key,
                self.dims(s.keys, s.head_dim),
            ),
            strided_of(
                self.value.storage::<f32>(),
                &self.value,
                self.dims(s.keys, s.value_dim),
            ),
        )
    }
}

pub(super) fn attention(
    query: FloatTensor<Flex>,
    key: FloatTensor<Flex>,
    value: FloatTensor<Flex>,
    mask: FloatTensor<Flex>,
    bias: FloatTensor<Flex>,
    (scale, causal, keep_probs): (f64, bool, bool),
) -> (FloatTensor<Flex>, Option<FloatTensor<Flex>>) {
    let ops = AttentionOperands::new(query, key, value);
    let s = ops.shape;
    let _op = tracing::trace_span!(
        "kiln.attention",
        batch = s.batch,
        heads = s.heads,
        queries = s.queries,
        keys = s.keys,
        flops = 2 * (s.pairs() * s.queries * s.keys * (s.head_dim + s.value_dim)) as u64
    )
    .entered();
    let scores = ops.dims(s.queries, s.keys);
    let (mask, bias) = (present(mask), present(bias));
    let out = ops.with(|q, k, v| {
        let options = ScoreOptions {
            scale: scale as f32,
            mask: mask
                .as_ref()
                .map(|m| strided_of(m.storage::<f32>(), m, scores)),
            causal,
            bias: bias
                .as_ref()
                .map(|b| strided_of(b.storage::<f32>(), b, scores)),
        };
        attention_forward(&s, q, k, v, &options, keep_probs)
    });
    let context = flex_tensor(out.context, ops.dims(s.queries, s.value_dim));
    let probs = keep_probs.then(|| flex_tensor(out.probs, scores));
    (context, probs)
}

#[allow(clippy::type_complexity)]
pub(super) fn attention_grads(
    query: FloatTensor<Flex>,
    key: FloatTensor<Flex>,
    value: FloatTensor<Flex>,
    probs: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
    scale: f64,
    bias_grad: bool,
) -> (
    FloatTensor<Flex>,
    FloatTensor<Flex>,
    FloatTensor<Flex>,
    Option<FloatTensor<Flex>>,
) {
    let ops = AttentionOperands::new(query, key, value);
    let s = ops.shape;
    let _op = tracing::trace_span!(
        "kiln.attention.grad",
        batch = s.batch,
        heads = s.heads,
        queries = s.queries,
        keys = s.keys
    )
    .entered();
    let output_grad = forward_strided(output_grad);
    let probs = values(&probs);
    let grads = ops.with(|q, k, v| {
        let d_out = strided_of(
            output_grad.storage::<f32>(),
            &output_grad,
            ops.dims(s.queries, s.value_dim),
        );
        attention_backward(&s, q, k, v, &probs, d_out, scale as f32, bias_grad)
    });
    (
        flex_tensor(grads.query, ops.dims(s.queries, s.head_dim)),
        flex_tensor(grads.key, ops.dims(s.keys, s.head_dim)),
        flex_tensor(grads.value, ops.dims(s.keys, s.value_dim)),
        grads
            .bias
            .map(|g| flex_tensor(g, ops.dims(s.queries, s.keys))),
    )
}
