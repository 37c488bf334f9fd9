//! Kiln's kernels as a Burn backend extension: implemented for `Flex` with the kernels of
//! [`super::conv`], [`super::linear`] and [`super::pool`], and for `Autodiff<B>` with backward passes that call the
//! same kernels, so training on the CPU runs forward and gradients through them.

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

use super::adam::{AdamConfigScalars, adam_update};
use super::conv::{ConvShape, conv2d_forward_new, conv2d_input_grad_new, conv2d_weight_grad};
use super::linear::{LinearShape, linear_forward, linear_input_grad, linear_weight_grad};
use super::norm::{
    NormParams, NormShape, batch_norm_backward_new, batch_norm_forward_new, batch_norm_stats,
};
use super::pool::{PoolShape, max_pool2d_backward, max_pool2d_forward};

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
        || options.groups != 1
        || xs.num_dims() != 4
        || ws.num_dims() != 4
        || xs[1] != ws[1]
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

impl KilnKernels for Flex {
    fn kiln_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) = conv_shape(&x, &weight, &options).filter(|_| bias.dtype() == DType::F32)
        else {
            return Flex::conv2d(x, weight, Some(bias), options);
        };
        let out = conv2d_forward_new(&s, &values(&x), &values(&weight), Some(&values(&bias)));
        flex_tensor(out, [s.batch, s.cout, s.out_h(), s.out_w()])
    }

    fn kiln_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) =
            conv_shape(&x, &weight, &options).filter(|_| output_grad.dtype() == DType::F32)
        else {
            return Flex::conv2d_x_backward(x, weight, output_grad, options);
        };
        let _op = tracing::trace_span!(
            "kiln.conv2d.grad_input",
            batch = s.batch,
            cin = s.cin,
            cout = s.cout
        )
        .entered();
        let dx = conv2d_input_grad_new(&s, &values(&output_grad), &values(&weight));
        flex_tensor(dx, [s.batch, s.cin, s.h, s.w])
    }

    fn kiln_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) =
            conv_shape(&x, &weight, &options).filter(|_| output_grad.dtype() == DType::F32)
        else {
            return Flex::conv2d_weight_backward(x, weight, output_grad, options);
        };
        let _op = tracing::trace_span!(
            "kiln.conv2d.grad_weight",
            batch = s.batch,
            cin = s.cin,
            cout = s.cout
        )
        .entered();
        let mut dw = vec![0f32; s.weight_len()];
        conv2d_weight_grad(&s, &values(&x), &values(&output_grad), &mut dw);
        flex_tensor(dw, [s.cout, s.cin, s.kh, s.kw])
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let shapes = f32_matrices(&x, &weight, (1, 0)).filter(|_| bias.dtype() == DType::F32);
        let Some(([rows, inputs], [_, outputs])) = shapes else {
            return linear_by_ops::forward::<Flex>(x, weight, bias);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let mut y = vec![0f32; s.rows * s.outputs];
        linear_forward(
            &s,
            &values(&x),
            &values(&weight),
            Some(&values(&bias)),
            &mut y,
        );
        flex_tensor(y, [s.rows, s.outputs])
    }

    fn kiln_linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let Some(([inputs, outputs], [rows, _])) = f32_matrices(&weight, &output_grad, (1, 1))
        else {
            return linear_by_ops::x_backward::<Flex>(weight, output_grad);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let _op =
            tracing::trace_span!("kiln.linear.grad_input", s.rows, s.inputs, s.outputs).entered();
        let mut dx = vec![0f32; s.rows * s.inputs];
        linear_input_grad(&s, &values(&output_grad), &values(&weight), &mut dx);
        flex_tensor(dx, [s.rows, s.inputs])
    }

    fn kiln_linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let Some(([rows, inputs], [_, outputs])) = f32_matrices(&x, &output_grad, (0, 0)) else {
            return linear_by_ops::weight_backward::<Flex>(x, output_grad);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let _op =
            tracing::trace_span!("kiln.linear.grad_weight", s.rows, s.inputs, s.outputs).entered();
        let mut dw = vec![0f32; s.inputs * s.outputs];
        linear_weight_grad(&s, &values(&x), &values(&output_grad), &mut dw);
        flex_tensor(dw, [s.inputs, s.outputs])
    }

    fn kiln_max_pool2d(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        let Some(s) = pool_shape(&x, kernel, stride) else {
            return Flex::max_pool2d(x, kernel, stride, [0, 0], [1, 1], false);
        };
        let dims = x.shape();
        let mut out = vec![0f32; s.planes * s.out_h() * s.out_w()];
        max_pool2d_forward(&s, &values(&x), &mut out, None);
        flex_tensor(out, [dims[0], dims[1], s.out_h(), s.out_w()])
    }

    fn kiln_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        let Some(s) = pool_shape(&x, kernel, stride) else {
            let r = Flex::max_pool2d_with_indices(
                x,
                kernel,
                stride,
                [0, 0],
                [1, 1],
                false,
                IntDType::I64,
            );
            return (r.output, r.indices);
        };
        let dims = x.shape();
        let shape = [dims[0], dims[1], s.out_h(), s.out_w()];
        let mut out = vec![0f32; s.planes * s.out_h() * s.out_w()];
        let mut indices = vec![0i64; out.len()];
        max_pool2d_forward(&s, &values(&x), &mut out, Some(&mut indices));
        let indices = <IntTensor<Flex>>::from_data(TensorData::new(indices, shape));
        (flex_tensor(out, shape), indices)
    }

    fn kiln_max_pool2d_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        let s = pool_shape(&x, kernel, stride)
            .filter(|_| output_grad.dtype() == DType::F32 && indices.dtype() == DType::I64);
        let Some(s) = s else {
            return Flex::max_pool2d_with_indices_backward(
                x,
                kernel,
                stride,
                [0, 0],
                [1, 1],
                false,
                output_grad,
                indices,
            )
            .x_grad;
        };
        let _op = tracing::trace_span!("kiln.max_pool2d.grad_input", planes = s.planes).entered();
        let dims = x.shape();
        let idx = indices.to_contiguous();
        let idx = idx.as_slice::<i64>().unwrap_or(&[]);
        let mut dx = vec![0f32; s.planes * s.h * s.w];
        max_pool2d_backward(&s, &values(&output_grad), idx, &mut dx);
        flex_tensor(dx, [dims[0], dims[1], s.h, s.w])
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
        let _op =
            tracing::trace_span!("kiln.adam", elements = param.shape().num_elements()).entered();
        // The step's scalars are this kernel's inputs on its own device (flex runs on the
        // host): reading them is the kernel reading its operands, not a device sync.
        let first = |t: &FloatTensor<Self>| values(t).first().copied().unwrap_or(f32::NAN);
        if first(&apply) == 0.0 {
            // A skipped step: parameter and moments stay as they were.
            return (param, moment_1, moment_2);
        }
        let step = AdamConfigScalars::from_array(config).step(first(&time) as i32);
        let grad = values(&grad);
        // Clipping's coefficient; exactly 1 when the norm is under the threshold.
        let grad = match first(&factor) {
            1.0 => grad,
            f => std::borrow::Cow::Owned(grad.iter().map(|g| g * f).collect()),
        };
        // In place: the optimizer hands over tensors it alone holds, so `storage_mut` writes
        // into their buffers (it copies one that is shared: the first step's zero moments).
        let [mut p, mut m, mut v] = [param, moment_1, moment_2].map(dense);
        adam_update(
            &step,
            p.storage_mut::<f32>(),
            &grad,
            [m.storage_mut::<f32>(), v.storage_mut::<f32>()],
        );
        (p, m, v)
    }

    // The BatchNorm kernels take f32 NCHW only; `kernels::batch_norm` routes nothing else
    // here, so another input is a caller's bug, reported as such.
    fn kiln_batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let s = norm_shape(&x).expect("kiln_batch_norm_stats takes f32 NCHW input");
        let _op =
            tracing::trace_span!("kiln.batch_norm.stats", s.batch, s.channels, s.plane).entered();
        let (mean, var) = batch_norm_stats(&s, &values(&x));
        flex_tensor([mean, var].concat(), [2, s.channels])
    }

    fn kiln_batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        let s = norm_shape(&x).expect("kiln_batch_norm takes f32 NCHW input");
        let out = with_norm_params(&gamma, &beta, &stats, epsilon, relu, |p| {
            batch_norm_forward_new(&s, &values(&x), p)
        });
        let d = x.shape();
        flex_tensor(out, [d[0], d[1], d[2], d[3]])
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
        let s = norm_shape(&x).expect("kiln_batch_norm_backward takes f32 NCHW input");
        let _op =
            tracing::trace_span!("kiln.batch_norm.grad", s.batch, s.channels, s.plane).entered();
        let (dx, dgamma, dbeta) = with_norm_params(&gamma, &beta, &stats, epsilon, relu, |p| {
            batch_norm_backward_new(&s, &values(&x), p, &values(&output_grad))
        });
        let d = x.shape();
        (
            flex_tensor(dx, [d[0], d[1], d[2], d[3]]),
            flex_tensor(dgamma, [s.channels]),
            flex_tensor(dbeta, [s.channels]),
        )
    }
}

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
