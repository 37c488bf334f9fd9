//! The zoo's models described to inference ([`Lower`]): each model's layers in the order of
//! its forward, so the lowered graph computes what the model does (checked by
//! `tests/inference.rs`).

use burn::nn::activation::Activation;
use burn::nn::transformer::TransformerEncoderLayer;
use burn::tensor::Tensor;

use super::{Cnn, EncoderClassifier, Mlp, ResNet, ZooModel};
use crate::error::{KilnError, Result};
use crate::infer::{Graph, GraphBuilder, Lower, Op, ValueId, weight_of};

impl Lower for ZooModel {
    fn lower_into(&self, b: &mut GraphBuilder) -> Result<()> {
        match self {
            ZooModel::Mlp(m) => lower_mlp(m, b),
            ZooModel::Cnn(m) => lower_cnn(m, b),
            ZooModel::ResNet(m) => lower_resnet(m, b),
            ZooModel::Transformer(m) => lower_transformer(m, b)?,
        }
        Ok(())
    }
}

/// A Kiln BatchNorm's `[gamma, beta, running mean, running variance]`.
fn bn_tensors(bn: &crate::nn::BatchNorm) -> [Tensor<1>; 4] {
    [
        bn.gamma.val(),
        bn.beta.val(),
        bn.running_mean.value(),
        bn.running_var.value(),
    ]
}

fn lower_mlp(m: &Mlp, b: &mut GraphBuilder) {
    let x = b.op("flatten", Op::Flatten, vec![Graph::INPUT]);
    let x = b.linear("fc1", &m.fc1, x);
    let x = b.op("fc1.relu", Op::Relu, vec![x]);
    let x = b.linear("fc2", &m.fc2, x);
    let x = b.op("fc2.relu", Op::Relu, vec![x]);
    b.linear("fc3", &m.fc3, x);
}

fn lower_cnn(m: &Cnn, b: &mut GraphBuilder) {
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

fn lower_resnet(m: &ResNet, b: &mut GraphBuilder) {
    let x = b.conv("stem", &m.stem, Graph::INPUT);
    let x = b.batch_norm("stem_bn", bn_tensors(&m.stem_bn), m.stem_bn.epsilon, x);
    let mut x = b.op("stem.relu", Op::Relu, vec![x]);
    for (i, block) in m.blocks.iter().enumerate() {
        let p = format!("blocks.{i}");
        let input = x;
        let input_shape = b.shape();
        let y = b.conv(&format!("{p}.conv1"), &block.conv1, input);
        let y = b.batch_norm(
            &format!("{p}.bn1"),
            bn_tensors(&block.bn1),
            block.bn1.epsilon,
            y,
        );
        let y = b.op(&format!("{p}.relu1"), Op::Relu, vec![y]);
        let y = b.conv(&format!("{p}.conv2"), &block.conv2, y);
        let y = b.batch_norm(
            &format!("{p}.bn2"),
            bn_tensors(&block.bn2),
            block.bn2.epsilon,
            y,
        );
        let out_shape = b.shape();
        let skip = match &block.shortcut {
            Some(s) => {
                b.set_shape(input_shape);
                let s_out = b.conv(&format!("{p}.shortcut.conv"), &s.conv, input);
                b.batch_norm(
                    &format!("{p}.shortcut.bn"),
                    bn_tensors(&s.bn),
                    s.bn.epsilon,
                    s_out,
                )
            }
            None => input,
        };
        b.set_shape(out_shape);
        let sum = b.op(&format!("{p}.add"), Op::Add, vec![y, skip]);
        x = b.op(&format!("{p}.relu2"), Op::Relu, vec![sum]);
    }
    let x = b.op("pool", Op::GlobalAvgPool, vec![x]);
    let x = b.op("flatten", Op::Flatten, vec![x]);
    b.linear("head", &m.head, x);
}

/// W4: tokens → embedding + positions → encoder layers → mean over tokens → head, the same
/// sequence of Burn ops as the zoo forward ([`crate::zoo::EncoderClassifier`]).
fn lower_transformer(m: &EncoderClassifier, b: &mut GraphBuilder) -> Result<()> {
    let features = m.embed.weight.dims()[0];
    let [c, h, w] = b.shape();
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
            value: weight_of(m.pos.val()),
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
fn encoder_layer(
    b: &mut GraphBuilder,
    p: &str,
    layer: &TransformerEncoderLayer,
    x: ValueId,
) -> ValueId {
    let ff = |b: &mut GraphBuilder, x: ValueId| {
        let pwff = &layer.pwff;
        let h = b.linear(&format!("{p}.pwff.linear_inner"), &pwff.linear_inner, x);
        let h = b.op(&format!("{p}.pwff.activation"), Op::Relu, vec![h]);
        b.linear(&format!("{p}.pwff.linear_outer"), &pwff.linear_outer, h)
    };
    if layer.norm_first {
        let n = b.layer_norm(&format!("{p}.norm_2"), &layer.norm_2, x);
        let a = b.self_attention(&format!("{p}.mha"), &layer.mha, n);
        let x = b.op(&format!("{p}.add_1"), Op::Add, vec![x, a]);
        let n = b.layer_norm(&format!("{p}.norm_1"), &layer.norm_1, x);
        let f = ff(b, n);
        b.op(&format!("{p}.add_2"), Op::Add, vec![x, f])
    } else {
        let a = b.self_attention(&format!("{p}.mha"), &layer.mha, x);
        let x = b.op(&format!("{p}.add_1"), Op::Add, vec![x, a]);
        let x = b.layer_norm(&format!("{p}.norm_1"), &layer.norm_1, x);
        let f = ff(b, x);
        let x = b.op(&format!("{p}.add_2"), Op::Add, vec![x, f]);
        b.layer_norm(&format!("{p}.norm_2"), &layer.norm_2, x)
    }
}
