//! Lowering: a trained zoo model → an inference [`Graph`] with its weights on the host.

use burn::nn::conv::Conv2d;
use burn::nn::{BatchNorm, Linear};
use burn::tensor::Tensor;

use super::graph::{ConvGeometry, Graph, Op, ValueId, Weight};
use crate::error::{KilnError, Result};
use crate::zoo::{Cnn, Mlp, ResNet, ZooModel};

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
        ZooModel::Transformer(_) => {
            return Err(KilnError::Unsupported {
                pass: "lower".into(),
                layer: "encoder.layers.*.mha (MultiHeadAttention)".into(),
                fix: "the inference graph covers mlp (W1), cnn (W2/W3) and resnet (W5); run \
                      the transformer with `kiln train`'s evaluation path instead"
                    .into(),
            });
        }
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

    fn batch_norm(&mut self, name: &str, bn: &BatchNorm, x: ValueId) -> ValueId {
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
