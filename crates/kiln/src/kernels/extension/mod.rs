//! Kiln's kernels as a Burn backend extension: implemented for `Flex` with the kernels of
//! [`kiln_kernels::conv`], [`kiln_kernels::linear`], [`kiln_kernels::pool`] and the
//! transformer's ([`kiln_kernels::layer_norm`], [`kiln_kernels::attention`], GELU, softmax),
//! and for `Autodiff<B>` with backward passes that call the same kernels, so training on the
//! CPU runs forward and gradients through them. `transformer_flex`, `attention_flex` and
//! `transformer_autodiff` hold the transformer ops' bodies (the trait impls delegate).

mod attention_flex;
mod autodiff;
mod flex;
mod transformer_autodiff;
mod transformer_flex;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, IntDType, TensorData};

use kiln_kernels::adam::{AdamConfigScalars, adam_update};
use kiln_kernels::base::shape::ConvShape;
use kiln_kernels::conv::{conv2d_forward_new, conv2d_input_grad_new, conv2d_weight_grad};
use kiln_kernels::linear::{LinearShape, linear_forward, linear_input_grad, linear_weight_grad};
use kiln_kernels::norm::{
    NormParams, NormShape, batch_norm_backward_new, batch_norm_forward_new, batch_norm_stats,
};
use kiln_kernels::pool::{
    PoolShape, global_avg_pool_nchw, global_avg_pool_nchw_backward, max_pool2d_backward,
    max_pool2d_forward,
};

/// The ops Kiln supplies. Inputs are NCHW f32; convolutions without groups, pooling without
/// padding or dilation (callers route everything else to Burn).
#[backend_extension(Flex, Autodiff)]
pub trait KilnKernels: Backend {
    /// Forward convolution plus bias.
    fn kiln_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;

    /// Gradient of the input (`x` is needed for its shape only).
    fn kiln_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;

    /// Gradient of the weight, summed over the batch.
    fn kiln_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;

    /// `x · weight + bias` for `x` `[rows, inputs]` and `weight` `[inputs, outputs]`.
    fn kiln_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Gradient of the linear layer's input: `output_grad · weightᵀ`.
    fn kiln_linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Gradient of the linear layer's weight: `xᵀ · output_grad`.
    fn kiln_linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Max pooling (differentiable under autodiff).
    fn kiln_max_pool2d(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self>;

    /// Max pooling and the arg-max of each window (flat index into its input plane).
    fn kiln_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>);

    /// Gradient of the pooling's input from the output gradient and the forward's indices.
    fn kiln_max_pool2d_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self>;

    /// Global average pooling, `[B, C, H, W]` → `[B, C]` (differentiable under autodiff).
    fn kiln_global_avg_pool2d(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Gradient of the global average pool's input (`dims`: the input's) from the output's.
    fn kiln_global_avg_pool2d_backward(
        output_grad: FloatTensor<Self>,
        dims: [usize; 4],
    ) -> FloatTensor<Self>;

    /// One Adam update of `param` from its gradient and moments, with the step's device
    /// scalars (`time`: this step's number if applied, `apply`: 1 or 0, `factor`: the
    /// gradient's multiplier) and the run's constants (`config`: an [`AdamConfigScalars`] as
    /// an array): the new parameter and moments, unchanged when `apply` is 0. Not
    /// differentiated: optimizers run on the inner tensors.
    #[allow(clippy::too_many_arguments)]
    fn kiln_adam(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        time: FloatTensor<Self>,
        apply: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        config: [f32; 5],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Per-channel batch mean and biased variance of NCHW `x` as `[2, C]` (not
    /// differentiated: [`KilnKernels::kiln_batch_norm`]'s backward accounts for them).
    fn kiln_batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Training-mode BatchNorm of NCHW `x` with its batch statistics `stats` (`[2, C]`),
    /// followed by ReLU when `relu`; differentiable in `x`, `gamma` and `beta`.
    fn kiln_batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self>;

    /// Gradients of [`KilnKernels::kiln_batch_norm`]: `(dx, dgamma, dbeta)`.
    fn kiln_batch_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// LayerNorm over the last axis of f32 `x` (`gamma`, `beta` `[d]`): differentiable in
    /// all three (under autodiff the forward keeps each row's statistics).
    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// [`KilnKernels::kiln_layer_norm`]'s training forward: the output and each row's `[mean
    /// …, 1/σ …]` as `[2, rows]` (not differentiated).
    fn kiln_layer_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of [`KilnKernels::kiln_layer_norm`]: `(dx, dgamma, dbeta)`.
    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Exact GELU of f32 `x` (differentiable).
    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Gradient of [`KilnKernels::kiln_gelu`] at `x`.
    fn kiln_gelu_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// ReLU of f32 `x` (differentiable).
    fn kiln_relu(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Gradient of [`KilnKernels::kiln_relu`] from its output.
    fn kiln_relu_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Softmax of f32 `x` over its last axis (differentiable).
    fn kiln_softmax(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Gradient of [`KilnKernels::kiln_softmax`] from its output.
    fn kiln_softmax_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Scaled dot-product attention of f32 `[batch, heads, positions, features]` operands:
    /// `softmax(mask(Q·Kᵀ·scale) + bias) · V` (Burn's order and its NaN-safe softmax),
    /// differentiable in the query, key, value and bias. The mask is a float tensor, nonzero
    /// where a score is masked, and the bias is added to the scores, each broadcast to
    /// `[batch, heads, queries, keys]`; a single 0 stands for none. (Why not optional
    /// tensors, boolean for the mask: the extension's dispatch glue routes neither.)
    fn kiln_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self>;

    /// [`KilnKernels::kiln_attention`]'s training forward: the context and the softmax's
    /// probabilities `[batch, heads, queries, keys]` (not differentiated).
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_train(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of [`KilnKernels::kiln_attention`]: query, key, value, and the bias's when
    /// `bias_grad`.
    #[allow(clippy::too_many_arguments)]
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
    );

    /// Self-attention of a packed f32 QKV projection `[batch, tokens, 3·heads·head_dim]`
    /// (each token's queries, keys and values side by side) with the heads merged back:
    /// `[batch, tokens, heads·head_dim]`; mask, bias, scale and causality as
    /// [`KilnKernels::kiln_attention`]. Differentiable in the projection and the bias.
    fn kiln_qkv_attention(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self>;

    /// [`KilnKernels::kiln_qkv_attention`]'s training forward: the context and the
    /// probabilities (not differentiated).
    fn kiln_qkv_attention_train(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of [`KilnKernels::kiln_qkv_attention`]: the projection's (in its packed
    /// layout) and the bias's when `bias_grad`.
    fn kiln_qkv_attention_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        bias_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>);
}

/// The BatchNorm kernels' layout of `x`, or `None` when they do not apply (not f32, not 4-D).
fn norm_shape(x: &FloatTensor<Flex>) -> Option<NormShape> {
    let d = x.shape();
    (x.dtype() == DType::F32 && d.num_dims() == 4).then(|| NormShape {
        batch: d[0],
        channels: d[1],
        plane: d[2] * d[3],
    })
}

/// Calls `f` with the kernels' view of γ, β, the `[2, C]` statistics (mean row, variance
/// row), ε and the fused ReLU.
fn with_norm_params<R>(
    gamma: &FloatTensor<Flex>,
    beta: &FloatTensor<Flex>,
    stats: &FloatTensor<Flex>,
    eps: f64,
    relu: bool,
    f: impl FnOnce(&NormParams) -> R,
) -> R {
    let (gamma, beta, stats) = (values(gamma), values(beta), values(stats));
    let (mean, var) = stats.split_at(stats.len() / 2);
    f(&NormParams {
        gamma: &gamma,
        beta: &beta,
        mean,
        var,
        eps,
        relu,
    })
}

/// The kernel's shape for `x` and `weight`, or `None` when the kernel does not apply (not
/// f32, grouped, or not 4-D) and Burn's own op must run.
fn conv_shape(
    x: &FloatTensor<Flex>,
    weight: &FloatTensor<Flex>,
    options: &ConvOptions<2>,
) -> Option<ConvShape> {
    let (xs, ws) = (x.shape(), weight.shape());
    if x.dtype() != DType::F32
        || weight.dtype() != DType::F32
        || xs.num_dims() != 4
        || ws.num_dims() != 4
        || !(xs[1] == ws[1] && options.groups == 1 || is_depthwise(xs[1], ws[0], ws[1], options))
    {
        return None;
    }
    // A kernel wider than the padded input has no output position: Burn's op reports that.
    let fits = |len: usize, k: usize, axis: usize| {
        let (before, after) = options.padding[axis];
        len + before + after > options.dilation[axis] * (k - 1)
    };
    if ws[2] == 0 || ws[3] == 0 || !fits(xs[2], ws[2], 0) || !fits(xs[3], ws[3], 1) {
        return None;
    }
    Some(ConvShape {
        batch: xs[0],
        cin: xs[1],
        h: xs[2],
        w: xs[3],
        cout: ws[0],
        kh: ws[2],
        kw: ws[3],
        stride: options.stride,
        padding: options.padding,
        dilation: options.dilation,
    })
}

/// Whether a convolution of `channels` inputs by a weight `[out, per_group, ..]` is
/// depthwise — one filter per channel (`groups = channels = out`, `per_group = 1`) — which
/// `kiln_kernels::depthwise::planar` computes (other grouped convolutions stay Burn's).
pub(crate) fn is_depthwise(
    channels: usize,
    out: usize,
    per_group: usize,
    options: &ConvOptions<2>,
) -> bool {
    options.groups > 1 && options.groups == channels && out == channels && per_group == 1
}

/// The kernel's shape for pooling `x`, or `None` when it does not apply (not f32 or not 4-D).
fn pool_shape(x: &FloatTensor<Flex>, kernel: [usize; 2], stride: [usize; 2]) -> Option<PoolShape> {
    let dims = x.shape();
    if x.dtype() != DType::F32 || dims.num_dims() != 4 {
        return None;
    }
    Some(PoolShape::nchw(
        [dims[0], dims[1], dims[2], dims[3]],
        kernel,
        stride,
    ))
}

/// Global average pooling by Burn's ops (a reshape and a mean): for what the kernel does not
/// take (another dtype) and second derivatives.
fn global_avg_pool_by_ops<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let d = x.shape();
    let (b, c, plane) = (d[0], d[1], d[2] * d[3]);
    let mean = B::float_mean_dim(B::float_reshape(x, [b, c, plane].into()), 2);
    B::float_reshape(mean, [b, c].into())
}

/// The gradient of [`global_avg_pool_by_ops`]: the output gradient spread over each plane.
fn global_avg_pool_backward_by_ops<B: Backend>(
    output_grad: FloatTensor<B>,
    [b, c, h, w]: [usize; 4],
) -> FloatTensor<B> {
    let spread = B::float_expand(
        B::float_reshape(output_grad, [b, c, 1].into()),
        [b, c, h * w].into(),
    );
    let scaled = B::float_div_scalar(spread, burn::tensor::Scalar::from((h * w) as f64));
    B::float_reshape(scaled, [b, c, h, w].into())
}

/// The dims of two f32 matrices whose dims `a[i]` and `b[j]` agree (`(i, j)` = `shared`), or
/// `None` when the linear kernels do not apply (another dtype, not 2-D, or sizes differ).
fn f32_matrices(
    a: &FloatTensor<Flex>,
    b: &FloatTensor<Flex>,
    (i, j): (usize, usize),
) -> Option<([usize; 2], [usize; 2])> {
    let (ash, bsh) = (a.shape(), b.shape());
    let ok = a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && ash.num_dims() == 2
        && bsh.num_dims() == 2
        && ash[i] == bsh[j];
    ok.then(|| ([ash[0], ash[1]], [bsh[0], bsh[1]]))
}

/// The linear layer and its gradients from a backend's own float ops: the fallback where the
/// kernel does not apply, and the differentiable form second derivatives need.
mod linear_by_ops {
    use super::*;

    pub fn forward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let outputs = bias.shape()[0];
        let bias = B::float_reshape(bias, [1, outputs].into());
        B::float_add(B::float_matmul(x, weight), bias)
    }

    pub fn x_backward<B: Backend>(weight: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
        B::float_matmul(grad, B::float_transpose(weight))
    }

    pub fn weight_backward<B: Backend>(x: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
        B::float_matmul(B::float_transpose(x), grad)
    }
}

/// The tensor's f32 values in row-major order (a view when it is already contiguous).
fn values(t: &FloatTensor<Flex>) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) => std::borrow::Cow::Borrowed(v),
        None => {
            std::borrow::Cow::Owned(t.to_contiguous().as_slice::<f32>().unwrap_or(&[]).to_vec())
        }
    }
}

/// `t` with its values as the whole of its buffer, in order (a copy only when it is a view).
fn dense(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let n = t.shape().num_elements();
    let whole = t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == n * 4;
    if whole { t } else { t.to_contiguous() }
}

fn flex_tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> FloatTensor<Flex> {
    <FloatTensor<Flex>>::from_data(TensorData::new(values, shape))
}
