//! Kiln's convolution as a Burn backend extension: implemented for `Flex` with the kernels of
//! [`super::conv`], and for `Autodiff<B>` with a backward pass that calls the same kernels, so
//! training on the CPU runs forward and both gradients through them.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, TensorData};

use super::conv::{ConvShape, conv2d_forward, conv2d_input_grad, conv2d_weight_grad};

/// The convolution ops Kiln supplies. Inputs are NCHW; `options.groups` must be 1 (callers
/// route grouped convolutions to Burn).
#[backend_extension(Flex, Autodiff)]
pub trait KilnConv: Backend {
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

/// The tensor's f32 values in row-major order (a view when it is already contiguous).
fn values(t: &FloatTensor<Flex>) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) => std::borrow::Cow::Borrowed(v),
        None => {
            std::borrow::Cow::Owned(t.to_contiguous().as_slice::<f32>().unwrap_or(&[]).to_vec())
        }
    }
}

fn flex_tensor(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Flex> {
    <FloatTensor<Flex>>::from_data(TensorData::new(values, shape))
}

impl KilnConv for Flex {
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
        let mut out = vec![0f32; s.output_len()];
        conv2d_forward(
            &s,
            &values(&x),
            &values(&weight),
            Some(&values(&bias)),
            &mut out,
        );
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
        let mut dx = vec![0f32; s.input_len()];
        conv2d_input_grad(&s, &values(&output_grad), &values(&weight), &mut dx);
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
        let mut dw = vec![0f32; s.weight_len()];
        conv2d_weight_grad(&s, &values(&x), &values(&output_grad), &mut dw);
        flex_tensor(dw, [s.cout, s.cin, s.kh, s.kw])
    }
}

/// Backward of [`KilnConv::kiln_conv2d`]: parents x, weight, bias.
#[derive(Debug)]
struct KilnConv2dWithBias;

/// Registers the gradients of x and weight (for the parents that want one).
fn register_conv_grads<B: Backend + KilnConv>(
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

impl<B: Backend + KilnConv> Backward<B, 3> for KilnConv2dWithBias {
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

impl<B: Backend + KilnConv, C: CheckpointStrategy> KilnConv for Autodiff<B, C> {
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
}
