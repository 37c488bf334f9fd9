//! The kernels under autodiff: each forward records a backward step (convolution with
//! bias, BatchNorm, max pool, linear) whose gradients are Kiln's kernels too, checkpointed
//! like Burn's own operations.

use super::*;

/// Backward of [`KilnKernels::kiln_conv2d`]: parents x, weight, bias.
#[derive(Debug)]
struct KilnConv2dWithBias;

/// Registers the gradients of x and weight (for the parents that want one).
fn register_conv_grads<B: Backend + KilnKernels>(
    grads: &mut Gradients,
    (node_x, node_weight): (Option<NodeId>, Option<NodeId>),
    (x, weight, grad): (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
    ),
    options: ConvOptions<2>,
) {
    if let Some(id) = node_x {
        let dx =
            B::kiln_conv2d_x_backward(x.clone(), weight.clone(), grad.clone(), options.clone());
        grads.register::<B>(id, dx);
    }
    if let Some(id) = node_weight {
        let dw = B::kiln_conv2d_weight_backward(x, weight, grad, options);
        grads.register::<B>(id, dw);
    }
}

impl<B: Backend + KilnKernels> Backward<B, 3> for KilnConv2dWithBias {
    type State = (NodeId, NodeId, NodeId, ConvOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state, bias_state, options) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let weight = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(weight_state);
        let bias = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(bias_state);
        if let Some(node) = node_bias {
            grads.register::<B>(
                node.id,
                B::conv2d_bias_backward(x.clone(), bias, grad.clone()),
            );
        }
        register_conv_grads::<B>(
            grads,
            (node_x.map(|n| n.id), node_weight.map(|n| n.id)),
            (x, weight, grad),
            options,
        );
    }
}

impl<B: Backend + KilnKernels, C: CheckpointStrategy> KilnKernels for Autodiff<B, C> {
    fn kiln_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        // Same recording as Burn's own conv2d (checkpointed inputs, compute-bound), with
        // Kiln's kernels in the forward and backward calls.
        match KilnConv2dWithBias
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&x),
                    prep.checkpoint(&weight),
                    prep.checkpoint(&bias),
                    options.clone(),
                );
                let out = B::kiln_conv2d(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                    options,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_conv2d(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                options,
            )),
        }
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match KilnLinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&x), prep.checkpoint(&weight));
                let out = B::kiln_linear(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_linear(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }

    fn kiln_linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear_by_ops::x_backward::<Self>(weight, output_grad)
    }

    fn kiln_linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear_by_ops::weight_backward::<Self>(x, output_grad)
    }

    fn kiln_max_pool2d(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        match KilnMaxPool2dBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let (out, indices) =
                    B::kiln_max_pool2d_with_indices(x.into_primitive(), kernel, stride);
                prep.finish((x_state, indices, kernel, stride), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::kiln_max_pool2d(x.into_primitive(), kernel, stride))
            }
        }
    }

    fn kiln_global_avg_pool2d(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let d = x.shape();
        let dims = [d[0], d[1], d[2], d[3]];
        match KilnGlobalAvgPoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish(dims, B::kiln_global_avg_pool2d(x.into_primitive()))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_global_avg_pool2d(x.into_primitive())),
        }
    }

    // Second derivatives are not Kiln's business: these fall back to Burn's differentiable ops.
    fn kiln_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        <Self as ModuleOps<Self>>::conv2d_x_backward(x, weight, output_grad, options)
    }

    fn kiln_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        <Self as ModuleOps<Self>>::conv2d_weight_backward(x, weight, output_grad, options)
    }

    fn kiln_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        let r = <Self as ModuleOps<Self>>::max_pool2d_with_indices(
            x,
            kernel,
            stride,
            [0, 0],
            [1, 1],
            false,
            IntDType::I64,
        );
        (r.output, r.indices)
    }

    fn kiln_global_avg_pool2d_backward(
        output_grad: FloatTensor<Self>,
        dims: [usize; 4],
    ) -> FloatTensor<Self> {
        global_avg_pool_backward_by_ops::<Self>(output_grad, dims)
    }

    fn kiln_max_pool2d_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        <Self as ModuleOps<Self>>::max_pool2d_with_indices_backward(
            x,
            kernel,
            stride,
            [0, 0],
            [1, 1],
            false,
            output_grad,
            indices,
        )
        .x_grad
    }

    fn kiln_adam(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        time: FloatTensor<Self>,
        apply: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        config: [f32; 5],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m, v) = B::kiln_adam(
            param.into_primitive(),
            grad.into_primitive(),
            moment_1.into_primitive(),
            moment_2.into_primitive(),
            time.into_primitive(),
            apply.into_primitive(),
            factor.into_primitive(),
            config,
        );
        (
            <FloatTensor<Self>>::new(p),
            <FloatTensor<Self>>::new(m),
            <FloatTensor<Self>>::new(v),
        )
    }

    fn kiln_batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self> {
        // Constants of the graph: the normalization's backward differentiates through them.
        <FloatTensor<Self>>::new(B::kiln_batch_norm_stats(x.into_primitive()))
    }

    fn kiln_batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        let stats = stats.into_primitive();
        match KilnBatchNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&x),
                    prep.checkpoint(&gamma),
                    prep.checkpoint(&beta),
                    stats.clone(),
                    epsilon,
                    relu,
                );
                let out = B::kiln_batch_norm(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    stats,
                    epsilon,
                    relu,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_batch_norm(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                stats,
                epsilon,
                relu,
            )),
        }
    }

    fn kiln_batch_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives of BatchNorm are not differentiated: the gradients come back as
        // constants.
        let (dx, dg, db) = B::kiln_batch_norm_backward(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            stats.into_primitive(),
            epsilon,
            relu,
            output_grad.into_primitive(),
        );
        (
            <FloatTensor<Self>>::new(dx),
            <FloatTensor<Self>>::new(dg),
            <FloatTensor<Self>>::new(db),
        )
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        transformer_autodiff::layer_norm::<B, C>(x, gamma, beta, epsilon)
    }

    // The training forms and the gradients below run on the inner tensors: second
    // derivatives of these ops are not differentiated (the results come back as constants).
    fn kiln_layer_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (y, stats) = B::kiln_layer_norm_train(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            epsilon,
        );
        (<FloatTensor<Self>>::new(y), <FloatTensor<Self>>::new(stats))
    }

    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dg, db) = B::kiln_layer_norm_backward(
            x.into_primitive(),
            stats.into_primitive(),
            gamma.into_primitive(),
            output_grad.into_primitive(),
        );
        (
            <FloatTensor<Self>>::new(dx),
            <FloatTensor<Self>>::new(dg),
            <FloatTensor<Self>>::new(db),
        )
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_autodiff::gelu::<B, C>(x)
    }

    fn kiln_gelu_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <FloatTensor<Self>>::new(B::kiln_gelu_backward(
            x.into_primitive(),
            output_grad.into_primitive(),
        ))
    }

    fn kiln_relu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_autodiff::relu::<B, C>(x)
    }

    fn kiln_relu_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <FloatTensor<Self>>::new(B::kiln_relu_backward(
            output.into_primitive(),
            output_grad.into_primitive(),
        ))
    }

    fn kiln_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_autodiff::softmax::<B, C>(x)
    }

    fn kiln_softmax_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <FloatTensor<Self>>::new(B::kiln_softmax_backward(
            output.into_primitive(),
            output_grad.into_primitive(),
        ))
    }

    fn kiln_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        let call = transformer_autodiff::AttentionCall {
            mask: mask.into_primitive(),
            scale,
            causal,
        };
        transformer_autodiff::attention::<B, C>([query, key, value, bias], call)
    }

    fn kiln_attention_train(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (context, probs) = B::kiln_attention_train(
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
            mask.into_primitive(),
            bias.into_primitive(),
            scale,
            causal,
        );
        (
            <FloatTensor<Self>>::new(context),
            <FloatTensor<Self>>::new(probs),
        )
    }

    fn kiln_attention_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        scale: f64,
        bias_grad: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (dq, dk, dv, db) = B::kiln_attention_backward(
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
            probs.into_primitive(),
            output_grad.into_primitive(),
            scale,
            bias_grad,
        );
        (
            <FloatTensor<Self>>::new(dq),
            <FloatTensor<Self>>::new(dk),
            <FloatTensor<Self>>::new(dv),
            db.map(<FloatTensor<Self>>::new),
        )
    }

    fn kiln_qkv_attention(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        let call = transformer_autodiff::AttentionCall {
            mask: mask.into_primitive(),
            scale,
            causal,
        };
        transformer_autodiff::qkv_attention::<B, C>([qkv, bias], heads, call)
    }

    fn kiln_qkv_attention_train(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (context, probs) = B::kiln_qkv_attention_train(
            qkv.into_primitive(),
            mask.into_primitive(),
            bias.into_primitive(),
            heads,
            scale,
            causal,
        );
        (
            <FloatTensor<Self>>::new(context),
            <FloatTensor<Self>>::new(probs),
        )
    }

    fn kiln_qkv_attention_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        bias_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (dqkv, dbias) = B::kiln_qkv_attention_backward(
            qkv.into_primitive(),
            probs.into_primitive(),
            output_grad.into_primitive(),
            heads,
            scale,
            bias_grad,
        );
        (
            <FloatTensor<Self>>::new(dqkv),
            dbias.map(<FloatTensor<Self>>::new),
        )
    }
}

/// Backward of [`KilnKernels::kiln_batch_norm`]: parents x, gamma, beta.
#[derive(Debug)]
struct KilnBatchNormBackward;

impl<B: Backend + KilnKernels> Backward<B, 3> for KilnBatchNormBackward {
    /// Checkpointed x, gamma and beta, the batch statistics, epsilon, and the fused ReLU.
    type State = (NodeId, NodeId, NodeId, B::FloatTensorPrimitive, f64, bool);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, gamma_state, beta_state, stats, epsilon, relu) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let gamma = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(gamma_state);
        let beta = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(beta_state);
        let (dx, dgamma, dbeta) =
            B::kiln_batch_norm_backward(x, gamma, beta, stats, epsilon, relu, grad);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, dgamma);
        }
        if let Some(node) = node_beta {
            grads.register::<B>(node.id, dbeta);
        }
    }
}

/// Backward of [`KilnKernels::kiln_max_pool2d`]: the gradient goes to each window's arg-max.
#[derive(Debug)]
struct KilnMaxPool2dBackward;

impl<B: Backend + KilnKernels> Backward<B, 1> for KilnMaxPool2dBackward {
    /// Checkpointed input (for its shape), the forward's indices, kernel and stride.
    type State = (NodeId, B::IntTensorPrimitive, [usize; 2], [usize; 2]);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, indices, kernel, stride) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        if let Some(node) = node_x {
            let dx = B::kiln_max_pool2d_backward(x, grad, indices, kernel, stride);
            grads.register::<B>(node.id, dx);
        }
    }
}

/// Backward of [`KilnKernels::kiln_global_avg_pool2d`]: each plane gets its output gradient
/// over the plane's size.
#[derive(Debug)]
struct KilnGlobalAvgPoolBackward;

impl<B: Backend + KilnKernels> Backward<B, 1> for KilnGlobalAvgPoolBackward {
    /// The input's dims.
    type State = [usize; 4];

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            let dx = B::kiln_global_avg_pool2d_backward(grad, ops.state);
            grads.register::<B>(node.id, dx);
        }
    }
}

/// Backward of [`KilnKernels::kiln_linear`]: parents x, weight, bias.
#[derive(Debug)]
struct KilnLinearBackward;

impl<B: Backend + KilnKernels> Backward<B, 3> for KilnLinearBackward {
    /// Checkpointed x and weight.
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let weight = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(weight_state);
        if let Some(node) = node_bias {
            let outputs = grad.shape()[1];
            let db = B::float_reshape(B::float_sum_dim(grad.clone(), 0), [outputs].into());
            grads.register::<B>(node.id, db);
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::kiln_linear_x_backward(weight, grad.clone()));
        }
        if let Some(node) = node_weight {
            grads.register::<B>(node.id, B::kiln_linear_weight_backward(x, grad));
        }
    }
}
