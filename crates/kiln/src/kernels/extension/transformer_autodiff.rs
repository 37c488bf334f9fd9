//! The transformer ops under autodiff (the bodies [`super::KilnKernels`]'s `Autodiff` impl
//! delegates to): each tracked forward runs the inner backend's training form, keeps what
//! its backward reads (LayerNorm's row statistics, GELU's input, the softmax's output,
//! attention's probabilities), and registers a backward step that calls the kernels'
//! gradients. Untracked calls run the plain forward.

use super::*;

type Ad<B, C> = Autodiff<B, C>;

/// Backward of LayerNorm: parents x, gamma, beta.
#[derive(Debug)]
struct LayerNormBackward;

impl<B: Backend + KilnKernels> Backward<B, 3> for LayerNormBackward {
    /// Checkpointed x and gamma, the rows' statistics.
    type State = (NodeId, NodeId, B::FloatTensorPrimitive);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, gamma_state, stats) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let gamma = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(gamma_state);
        let (dx, dgamma, dbeta) = B::kiln_layer_norm_backward(x, stats, gamma, grad);
        for (node, g) in [(node_x, dx), (node_gamma, dgamma), (node_beta, dbeta)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

pub(super) fn layer_norm<B: Backend + KilnKernels, C: CheckpointStrategy>(
    x: FloatTensor<Ad<B, C>>,
    gamma: FloatTensor<Ad<B, C>>,
    beta: FloatTensor<Ad<B, C>>,
    epsilon: f64,
) -> FloatTensor<Ad<B, C>> {
    match LayerNormBackward
        .prepare::<C>([x.node(), gamma.node(), beta.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let (x_state, gamma_state) = (prep.checkpoint(&x), prep.checkpoint(&gamma));
            let (out, stats) = B::kiln_layer_norm_train(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                epsilon,
            );
            prep.finish((x_state, gamma_state, stats), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::kiln_layer_norm(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            epsilon,
        )),
    }
}

/// Backward of an element-wise op whose gradient reads one saved tensor (GELU: its input;
/// softmax: its output) and the output's gradient.
#[derive(Debug)]
struct SavedUnaryBackward<B: Backend> {
    grad: fn(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
}

impl<B: Backend + KilnKernels> Backward<B, 1> for SavedUnaryBackward<B> {
    /// The saved tensor.
    type State = B::FloatTensorPrimitive;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, (self.grad)(ops.state, grad));
        }
    }
}

/// Runs `forward` on `x`'s inner tensor; when tracked, saves `save(input, output)` for
/// `grad`. Why not checkpoint the input: the softmax's backward reads its output, which no
/// checkpoint holds, and keeping the one tensor each needs is what Burn's own ops do.
fn saved_unary<B: Backend + KilnKernels, C: CheckpointStrategy>(
    x: FloatTensor<Ad<B, C>>,
    forward: fn(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
    save_output: bool,
    grad: fn(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> FloatTensor<Ad<B, C>> {
    let prep: OpsKind<_, _, _, _, 1> = SavedUnaryBackward::<B> { grad }
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful();
    match prep {
        OpsKind::Tracked(prep) => {
            let input = x.into_primitive();
            let out = forward(input.clone());
            let saved = if save_output { out.clone() } else { input };
            prep.finish(saved, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.into_primitive())),
    }
}

pub(super) fn gelu<B: Backend + KilnKernels, C: CheckpointStrategy>(
    x: FloatTensor<Ad<B, C>>,
) -> FloatTensor<Ad<B, C>> {
    saved_unary::<B, C>(x, B::kiln_gelu, false, B::kiln_gelu_backward)
}

/// ReLU keeping its output (the gradient's mask), not its input: the input is then free to
/// go when nothing else holds it.
pub(super) fn relu<B: Backend + KilnKernels, C: CheckpointStrategy>(
    x: FloatTensor<Ad<B, C>>,
) -> FloatTensor<Ad<B, C>> {
    saved_unary::<B, C>(x, B::kiln_relu, true, B::kiln_relu_backward)
}

pub(super) fn softmax<B: Backend + KilnKernels, C: CheckpointStrategy>(
    x: FloatTensor<Ad<B, C>>,
) -> FloatTensor<Ad<B, C>> {
    saved_unary::<B, C>(x, B::kiln_softmax, true, B::kiln_softmax_backward)
}

/// Backward of attention: parents query, key, value and bias.
#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + KilnKernels> Backward<B, 4> for AttentionBackward {
    /// Checkpointed query, key and value, the probabilities, the scale.
    type State = (NodeId, NodeId, NodeId, B::FloatTensorPrimitive, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q_state, k_state, v_state, probs, scale) = ops.state;
        let q = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(q_state);
        let k = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(k_state);
        let v = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(v_state);
        // The bias's gradient only where the bias is a tracked parent (not the stand-in).
        let (dq, dk, dv, dbias) =
            B::kiln_attention_backward(q, k, v, probs, grad, scale, node_bias.is_some());
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
        if let (Some(node), Some(g)) = (node_bias, dbias) {
            grads.register::<B>(node.id, g);
        }
    }
}

/// What an attention call computes besides its operands: the mask, the scale, causality.
pub(super) struct AttentionCall<B: Backend> {
    pub mask: B::FloatTensorPrimitive,
    pub scale: f64,
    pub causal: bool,
}

pub(super) fn attention<B: Backend + KilnKernels, C: CheckpointStrategy>(
    [query, key, value, bias]: [FloatTensor<Ad<B, C>>; 4],
    AttentionCall {
        mask,
        scale,
        causal,
    }: AttentionCall<B>,
) -> FloatTensor<Ad<B, C>> {
    let parents = [query.node(), key.node(), value.node(), bias.node()];
    match AttentionBackward
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (
                prep.checkpoint(&query),
                prep.checkpoint(&key),
                prep.checkpoint(&value),
            );
            let (out, probs) = B::kiln_attention_train(
                query.into_primitive(),
                key.into_primitive(),
                value.into_primitive(),
                mask,
                bias.into_primitive(),
                scale,
                causal,
            );
            prep.finish((state.0, state.1, state.2, probs, scale), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::kiln_attention(
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
            mask,
            bias.into_primitive(),
            scale,
            causal,
        )),
    }
}

/// Backward of the packed attention: parents the projection and the bias.
#[derive(Debug)]
struct QkvAttentionBackward;

impl<B: Backend + KilnKernels> Backward<B, 2> for QkvAttentionBackward {
    /// Checkpointed projection, the probabilities, heads and scale.
    type State = (NodeId, B::FloatTensorPrimitive, usize, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_qkv, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (qkv_state, probs, heads, scale) = ops.state;
        let qkv = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(qkv_state);
        let (dqkv, dbias) =
            B::kiln_qkv_attention_backward(qkv, probs, grad, heads, scale, node_bias.is_some());
        if let Some(node) = node_qkv {
            grads.register::<B>(node.id, dqkv);
        }
        if let (Some(node), Some(g)) = (node_bias, dbias) {
            grads.register::<B>(node.id, g);
        }
    }
}

pub(super) fn qkv_attention<B: Backend + KilnKernels, C: CheckpointStrategy>(
    [qkv, bias]: [FloatTensor<Ad<B, C>>; 2],
    heads: usize,
    AttentionCall {
        mask,
        scale,
        causal,
    }: AttentionCall<B>,
) -> FloatTensor<Ad<B, C>> {
    match QkvAttentionBackward
        .prepare::<C>([qkv.node(), bias.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let qkv_state = prep.checkpoint(&qkv);
            let (out, probs) = B::kiln_qkv_attention_train(
                qkv.into_primitive(),
                mask,
                bias.into_primitive(),
                heads,
                scale,
                causal,
            );
            prep.finish((qkv_state, probs, heads, scale), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::kiln_qkv_attention(
            qkv.into_primitive(),
            mask,
            bias.into_primitive(),
            heads,
            scale,
            causal,
        )),
    }
}
