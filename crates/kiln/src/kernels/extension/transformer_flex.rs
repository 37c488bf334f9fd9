//! The transformer ops on `flex` (the bodies [`super::KilnKernels`]'s `Flex` impl delegates
//! to): LayerNorm, GELU and softmax over the tensors' host values (attention's are in
//! `attention_flex`). Callers route f32 only (`kernels::transformer` checks); operands are
//! read as a contiguous view, or a copy of a strided one.

use kiln_kernels::activation::{gelu_backward, gelu_of, relu_backward, relu_of};
use kiln_kernels::layer_norm::{layer_norm_backward, layer_norm_train};
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

/// The forward without autodiff: the training form's output (one pass; its row statistics,
/// two values per row, are dropped).
pub(super) fn layer_norm(
    x: FloatTensor<Flex>,
    gamma: FloatTensor<Flex>,
    beta: FloatTensor<Flex>,
    epsilon: f64,
) -> FloatTensor<Flex> {
    layer_norm_train_forward(x, gamma, beta, epsilon).0
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
    flex_dims(gelu_of(&values(&x)), &dims)
}

pub(super) fn relu(x: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let (dims, _) = rows_of(&x);
    let _op = tracing::trace_span!("kiln.relu", shape = ?dims).entered();
    flex_dims(relu_of(&values(&x)), &dims)
}

pub(super) fn relu_grad(
    output: FloatTensor<Flex>,
    output_grad: FloatTensor<Flex>,
) -> FloatTensor<Flex> {
    let (dims, _) = rows_of(&output);
    let _op = tracing::trace_span!("kiln.relu.grad", shape = ?dims).entered();
    flex_dims(
        relu_backward(&values(&output), &values(&output_grad)),
        &dims,
    )
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
