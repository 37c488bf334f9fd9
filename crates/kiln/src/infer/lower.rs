//! Lowering: a trained zoo model → an inference [`Graph`] with its weights on the host.

use burn::nn::activation::Activation;
use burn::nn::attention::MultiHeadAttention;
use burn::nn::conv::Conv2d;
use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::tensor::Tensor;

use super::graph::{ConvGeometry, Graph, Op, ValueId, Weight};
use crate::error::{KilnError, Result};
use crate::zoo::{Cnn, EncoderClassifier, Mlp, ResNet, ZooModel};

/// Lowers a zoo model for samples of shape `[C, H, W]`.
pub fn lower(model: &ZooModel, name: &str, input_shape: [usize; 3]) -> Result<Graph> {
    let mut b = Builder {
        graph: Graph::new(name, input_shape),
        shape: input_shape,
    };
    match model {
        ZooModel::Mlp(m) => lower_mlp(m, &mut b),
        ZooModel::Cnn(m) => lower_cnn(m, &mut b),
        ZooModel::ResNet(m) => lower_resnet(m, &mut b),
        ZooModel::Transformer(m) => lower_transformer(m, &mut b)?,
    }
    Ok(b.graph)
}

/// Builds the graph while tracking the per-sample shape `[C, H, W]` of the current value
/// (needed to resolve `Same` padding and flatten sizes).
struct Builder {
    graph: Graph,
    shape: [usize; 3],
}

fn values<const D: usize>(t: Tensor<D>) -> Weight {
    let shape = t.dims().to_vec();
    let values = t.into_data().try_into_vec_as::<f32>().unwrap_or_default();
    Weight::new(shape, values)
}

impl Builder {
    fn conv(&mut self, name: &str, conv: &Conv2d, x: ValueId) -> ValueId {
        let weight = values(conv.weight.val());
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
            bias: conv.bias.as_ref().map(|b| values(b.val())),
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

    fn linear(&mut self, name: &str, linear: &Linear, x: ValueId) -> ValueId {
        let weight = values(linear.weight.val());
        self.shape = [weight.shape[1], 1, 1];
        let op = Op::Linear {
            weight,
            bias: linear.bias.as_ref().map(|b| values(b.val())),
        };
        self.graph.push(name, op, vec![x])
    }

    fn layer_norm(&mut self, name: &str, norm: &LayerNorm, x: ValueId) -> ValueId {
        let gamma = values(norm.gamma.val()).values;
        let op = Op::LayerNorm {
            beta: norm.beta.as_ref().map(|b| values(b.val()).values),
            // Burn keeps a LayerNorm's epsilon private; the encoder builds its norms with
            // LayerNormConfig's default, which is therefore the model's.
            eps: LayerNormConfig::new(gamma.len()).epsilon,
            gamma,
        };
        self.graph.push(name, op, vec![x])
    }

    fn batch_norm(&mut self, name: &str, bn: &crate::nn::BatchNorm, x: ValueId) -> ValueId {
        let op = Op::BatchNorm {
            gamma: values(bn.gamma.val()).values,
            beta: values(bn.beta.val()).values,
            mean: values(bn.running_mean.value()).values,
            var: values(bn.running_var.value()).values,
            eps: bn.epsilon,
        };
        self.graph.push(name, op, vec![x])
    }

    fn op(&mut self, name: &str, op: Op, inputs: Vec<ValueId>) -> ValueId {
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

fn lower_mlp(m: &Mlp, b: &mut Builder) {
    let x = b.op("flatten", Op::Flatten, vec![Graph::INPUT]);
    let x = b.linear("fc1", &m.fc1, x);
    let x = b.op("fc1.relu", Op::Relu, vec![x]);
    let x = b.linear("fc2", &m.fc2, x);
    let x = b.op("fc2.relu", Op::Relu, vec![x]);
    b.linear("fc3", &m.fc3, x);
}

fn lower_cnn(m: &Cnn, b: &mut Builder) {
    let x = b.conv("conv1", &m.conv1, Graph::INPUT);
    let x = b.op("conv1.relu", Op::Relu, vec![x]);
    let x = b.conv("conv2", &m.conv2, x);
    let x = b.op("conv2.relu", Op::Relu, vec![x]);
    let pool = Op::MaxPool2d {
        kernel: m.pool.kernel_size,
        stride: m.pool.stride,
    };
    let x = b.op("pool", pool, vec![x]);
    let x = b.op("flatten", Op::Flatten, vec![x]);
    let x = b.linear("fc1", &m.fc1, x);
    let x = b.op("fc1.relu", Op::Relu, vec![x]);
    b.linear("fc2", &m.fc2, x);
}

fn lower_resnet(m: &ResNet, b: &mut Builder) {
    let x = b.conv("stem", &m.stem, Graph::INPUT);
    let x = b.batch_norm("stem_bn", &m.stem_bn, x);
    let mut x = b.op("stem.relu", Op::Relu, vec![x]);
    for (i, block) in m.blocks.iter().enumerate() {
        let p = format!("blocks.{i}");
        let input = x;
        let input_shape = b.shape;
        let y = b.conv(&format!("{p}.conv1"), &block.conv1, input);
        let y = b.batch_norm(&format!("{p}.bn1"), &block.bn1, y);
        let y = b.op(&format!("{p}.relu1"), Op::Relu, vec![y]);
        let y = b.conv(&format!("{p}.conv2"), &block.conv2, y);
        let y = b.batch_norm(&format!("{p}.bn2"), &block.bn2, y);
        let out_shape = b.shape;
        let skip = match &block.shortcut {
            Some(s) => {
                b.shape = input_shape;
                let s_out = b.conv(&format!("{p}.shortcut.conv"), &s.conv, input);
                b.batch_norm(&format!("{p}.shortcut.bn"), &s.bn, s_out)
            }
            None => input,
        };
        b.shape = out_shape;
        let sum = b.op(&format!("{p}.add"), Op::Add, vec![y, skip]);
        x = b.op(&format!("{p}.relu2"), Op::Relu, vec![sum]);
    }
    let x = b.op("pool", Op::GlobalAvgPool, vec![x]);
    let x = b.op("flatten", Op::Flatten, vec![x]);
    b.linear("head", &m.head, x);
}

/// W4: tokens → embedding + positions → encoder layers → mean over tokens → head, the same
/// sequence of Burn ops as the zoo forward ([`crate::zoo::EncoderClassifier`]).
fn lower_transformer(m: &EncoderClassifier, b: &mut Builder) -> Result<()> {
    let features = m.embed.weight.dims()[0];
    let [c, h, w] = b.shape;
    if features == 0 || !(c * h * w).is_multiple_of(features) {
        return Err(KilnError::Shape(format!(
            "the transformer reads {features}-feature tokens; a [{c}, {h}, {w}] image does not \
             split into them"
        )));
    }
    let tokens = c * h * w / features;
    let x = b.op(
        "tokens",
        Op::Reshape {
            shape: vec![tokens, features],
        },
        vec![Graph::INPUT],
    );
    let x = b.linear("embed", &m.embed, x);
    let mut x = b.op(
        "pos",
        Op::AddConstant {
            value: values(m.pos.val()),
        },
        vec![x],
    );
    for (i, layer) in m.encoder.layers.iter().enumerate() {
        let p = format!("encoder.layers.{i}");
        if !matches!(layer.pwff.activation, Activation::Relu(_)) {
            return Err(KilnError::Unsupported {
                pass: "lower".into(),
                layer: format!("{p}.pwff.activation"),
                fix: "the inference graph has ReLU feed-forward layers only (W4's)".into(),
            });
        }
        x = encoder_layer(b, &p, layer, x);
    }
    let x = b.op("pool", Op::TokenMean, vec![x]);
    b.linear("head", &m.head, x);
    Ok(())
}

/// One encoder layer (post-norm or pre-norm, as Burn's `TransformerEncoderLayer`).
fn encoder_layer(b: &mut Builder, p: &str, layer: &TransformerEncoderLayer, x: ValueId) -> ValueId {
    let ff = |b: &mut Builder, x: ValueId| {
        let pwff = &layer.pwff;
        let h = b.linear(&format!("{p}.pwff.linear_inner"), &pwff.linear_inner, x);
        let h = b.op(&format!("{p}.pwff.activation"), Op::Relu, vec![h]);
        b.linear(&format!("{p}.pwff.linear_outer"), &pwff.linear_outer, h)
    };
    if layer.norm_first {
        let n = b.layer_norm(&format!("{p}.norm_2"), &layer.norm_2, x);
        let a = self_attention(b, &format!("{p}.mha"), &layer.mha, n);
        let x = b.op(&format!("{p}.add_1"), Op::Add, vec![x, a]);
        let n = b.layer_norm(&format!("{p}.norm_1"), &layer.norm_1, x);
        let f = ff(b, n);
        b.op(&format!("{p}.add_2"), Op::Add, vec![x, f])
    } else {
        let a = self_attention(b, &format!("{p}.mha"), &layer.mha, x);
        let x = b.op(&format!("{p}.add_1"), Op::Add, vec![x, a]);
        let x = b.layer_norm(&format!("{p}.norm_1"), &layer.norm_1, x);
        let f = ff(b, x);
        let x = b.op(&format!("{p}.add_2"), Op::Add, vec![x, f]);
        b.layer_norm(&format!("{p}.norm_2"), &layer.norm_2, x)
    }
}

/// Self-attention: the q, k, v projections, the attention core, the output projection.
fn self_attention(b: &mut Builder, p: &str, mha: &MultiHeadAttention, x: ValueId) -> ValueId {
    let q = b.linear(&format!("{p}.query"), &mha.query, x);
    let k = b.linear(&format!("{p}.key"), &mha.key, x);
    let v = b.linear(&format!("{p}.value"), &mha.value, x);
    let op = Op::Attention {
        heads: mha.n_heads,
        head_dim: mha.d_k,
    };
    let a = b.op(&format!("{p}.attention"), op, vec![q, k, v]);
    b.linear(&format!("{p}.output"), &mha.output, a)
}
