//! Lowering: a trained model → an inference [`Graph`] with its weights on the host.
//!
//! The contract is [`Lower`]: a model describes itself to a [`GraphBuilder`] layer by layer
//! (Burn's `Conv2d`, `Linear`, `LayerNorm`, a BatchNorm's tensors, and graph operations).
//! Inference knows no model family: the zoo implements `Lower` for its models
//! (`zoo/lower.rs`), and a user's model can too.

use burn::nn::attention::MultiHeadAttention;
use burn::nn::conv::Conv2d;
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::tensor::Tensor;

use super::graph::{ConvGeometry, Graph, Op, ValueId, Weight};
use crate::error::Result;

/// A model that can describe itself as an inference graph.
pub trait Lower {
    /// Adds the model's layers to `b`, starting from [`Graph::INPUT`]; the last value added
    /// is the output. An error names a layer the graph cannot express.
    fn lower_into(&self, b: &mut GraphBuilder) -> Result<()>;
}

/// Lowers `model` for samples of shape `[C, H, W]`.
pub fn lower(model: &dyn Lower, name: &str, input_shape: [usize; 3]) -> Result<Graph> {
    let mut b = GraphBuilder {
        graph: Graph::new(name, input_shape),
        shape: input_shape,
    };
    model.lower_into(&mut b)?;
    Ok(b.graph)
}

/// Builds the graph while tracking the per-sample shape `[C, H, W]` of the current value
/// (needed to resolve `Same` padding and flatten sizes).
pub struct GraphBuilder {
    graph: Graph,
    shape: [usize; 3],
}

/// A tensor's values as a graph weight (its shape kept).
pub fn weight_of<const D: usize>(t: Tensor<D>) -> Weight {
    let shape = t.dims().to_vec();
    let values = t.into_data().try_into_vec_as::<f32>().unwrap_or_default();
    Weight::new(shape, values)
}

impl GraphBuilder {
    /// The per-sample shape `[C, H, W]` of the value added last.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// Sets the per-sample shape the next layer reads (a branch that starts from an earlier
    /// value, such as a residual block's shortcut).
    pub fn set_shape(&mut self, shape: [usize; 3]) {
        self.shape = shape;
    }

    /// A Burn convolution reading `x`.
    pub fn conv(&mut self, name: &str, conv: &Conv2d, x: ValueId) -> ValueId {
        let weight = weight_of(conv.weight.val());
        let [co, _, kh, kw] = [
            weight.shape[0],
            weight.shape[1],
            weight.shape[2],
            weight.shape[3],
        ];
        let [_, h, w] = self.shape;
        let pair = |axis: usize, size: usize| {
            crate::precision::padding_pair(
                &conv.padding,
                axis,
                size,
                conv.kernel_size[axis],
                conv.stride[axis],
            )
        };
        let ((top, bottom), (left, right)) = (pair(0, h), pair(1, w));
        let out = |size: usize, pad: usize, k: usize, axis: usize| {
            (size + pad - conv.dilation[axis] * (k - 1) - 1) / conv.stride[axis] + 1
        };
        self.shape = [co, out(h, top + bottom, kh, 0), out(w, left + right, kw, 1)];
        let op = Op::Conv2d {
            weight,
            bias: conv.bias.as_ref().map(|b| weight_of(b.val())),
            geometry: ConvGeometry {
                stride: conv.stride,
                pads: [top, left, bottom, right],
                dilation: conv.dilation,
                groups: conv.groups,
                kernel: [kh, kw],
            },
        };
        self.graph.push(name, op, vec![x])
    }

    /// A Burn linear layer reading `x`.
    pub fn linear(&mut self, name: &str, linear: &Linear, x: ValueId) -> ValueId {
        let weight = weight_of(linear.weight.val());
        self.shape = [weight.shape[1], 1, 1];
        let op = Op::Linear {
            weight,
            bias: linear.bias.as_ref().map(|b| weight_of(b.val())),
        };
        self.graph.push(name, op, vec![x])
    }

    /// A Burn LayerNorm reading `x`.
    pub fn layer_norm(&mut self, name: &str, norm: &LayerNorm, x: ValueId) -> ValueId {
        let gamma = weight_of(norm.gamma.val()).values;
        let op = Op::LayerNorm {
            beta: norm.beta.as_ref().map(|b| weight_of(b.val()).values),
            // Burn keeps a LayerNorm's epsilon private; the encoder builds its norms with
            // LayerNormConfig's default, which is therefore the model's.
            eps: LayerNormConfig::new(gamma.len()).epsilon,
            gamma,
        };
        self.graph.push(name, op, vec![x])
    }

    /// An inference-mode BatchNorm reading `x`: `[gamma, beta, running mean, running
    /// variance]` per channel and its epsilon.
    pub fn batch_norm(
        &mut self,
        name: &str,
        [gamma, beta, mean, var]: [Tensor<1>; 4],
        eps: f64,
        x: ValueId,
    ) -> ValueId {
        let op = Op::BatchNorm {
            gamma: weight_of(gamma).values,
            beta: weight_of(beta).values,
            mean: weight_of(mean).values,
            var: weight_of(var).values,
            eps,
        };
        self.graph.push(name, op, vec![x])
    }

    /// Self-attention over `x`: Burn's q, k, v projections, the attention core, the output
    /// projection.
    pub fn self_attention(&mut self, p: &str, mha: &MultiHeadAttention, x: ValueId) -> ValueId {
        let q = self.linear(&format!("{p}.query"), &mha.query, x);
        let k = self.linear(&format!("{p}.key"), &mha.key, x);
        let v = self.linear(&format!("{p}.value"), &mha.value, x);
        let op = Op::Attention {
            heads: mha.n_heads,
            head_dim: mha.d_k,
        };
        let a = self.op(&format!("{p}.attention"), op, vec![q, k, v]);
        self.linear(&format!("{p}.output"), &mha.output, a)
    }

    /// A graph operation on `inputs` (the shape follows flattening and pooling).
    pub fn op(&mut self, name: &str, op: Op, inputs: Vec<ValueId>) -> ValueId {
        match &op {
            Op::Flatten => self.shape = [self.shape.iter().product(), 1, 1],
            Op::GlobalAvgPool => self.shape = [self.shape[0], 1, 1],
            Op::MaxPool2d { kernel, stride } => {
                self.shape = [
                    self.shape[0],
                    (self.shape[1] - kernel[0]) / stride[0] + 1,
                    (self.shape[2] - kernel[1]) / stride[1] + 1,
                ]
            }
            _ => {}
        }
        self.graph.push(name, op, inputs)
    }
}
