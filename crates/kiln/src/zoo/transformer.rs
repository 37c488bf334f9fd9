//! W4: a Transformer encoder classifier that reads the 28 image rows as 28 tokens.

use burn::module::{Module, Param};
use burn::nn::LayerNorm;
use burn::nn::attention::MultiHeadAttention;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderLayer,
};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};
use crate::precision as amp;

const TOKENS: usize = 28;
const FEATURES: usize = 28;
const D_MODEL: usize = 128;
/// The encoder's LayerNorm ε (Burn's default, stated: Burn's layer keeps it private and
/// `encoder_layer` normalizes through Kiln's kernel with it).
const LAYER_NORM_EPS: f64 = 1e-5;

/// W4: embed(28→128) + learned positions, 2 post-norm encoder layers (4 heads, ff 512, ReLU,
/// no dropout, as the PyTorch peer), mean-pool over tokens, linear head.
///
/// The parameters are Burn's [`TransformerEncoder`]; the forward pass is Kiln's
/// (`encoder_layer`) because Burn's calls its `Linear`s and matmuls directly, where
/// mixed precision needs the autocast ops.
#[derive(Module, Debug)]
pub struct EncoderClassifier {
    pub(crate) embed: Linear,
    pub(crate) pos: Param<Tensor<3>>,
    pub(crate) encoder: TransformerEncoder,
    pub(crate) head: Linear,
}

impl EncoderClassifier {
    /// A freshly initialized W4.
    pub fn new(device: &Device) -> Self {
        EncoderClassifier {
            embed: LinearConfig::new(FEATURES, D_MODEL).init(device),
            pos: Param::from_tensor(Tensor::zeros([1, TOKENS, D_MODEL], device)),
            encoder: TransformerEncoderConfig::new(D_MODEL, 512, 4, 2)
                .with_dropout(0.0)
                .with_activation(burn::nn::activation::ActivationConfig::Relu)
                .with_layer_norm_eps(LAYER_NORM_EPS)
                .init(device),
            head: LinearConfig::new(D_MODEL, NUM_CLASSES).init(device),
        }
    }

    /// The encoder stack through Burn's own forward (the reference [`Classifier::forward`] is
    /// tested against).
    pub fn forward_with_burn_encoder(&self, images: Tensor<4>) -> Tensor<2> {
        use burn::nn::transformer::TransformerEncoderInput;
        let [batch, _, _, _] = images.dims();
        let tokens: Tensor<3> = images.reshape([batch, TOKENS, FEATURES]);
        let h = self.embed.forward(tokens) + self.pos.val();
        let h = self.encoder.forward(TransformerEncoderInput::new(h));
        let pooled: Tensor<2> = h.mean_dim(1).reshape([batch, D_MODEL]);
        self.head.forward(pooled)
    }
}

impl Classifier for EncoderClassifier {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let [batch, _, _, _] = images.dims();
        let tokens: Tensor<3> = images.reshape([batch, TOKENS, FEATURES]);
        let mut h = amp::linear(&self.embed, tokens) + self.pos.val();
        for layer in &self.encoder.layers {
            h = encoder_layer(layer, h);
        }
        let pooled: Tensor<2> = h.mean_dim(1).reshape([batch, D_MODEL]);
        amp::linear(&self.head, pooled)
    }
}

/// One encoder layer, as Burn's `TransformerEncoderLayer::forward` without masks and with
/// dropout 0 (W4 uses neither), through the autocast ops and Kiln's LayerNorm and attention
/// kernels. LayerNorm, softmax and the residual adds stay f32.
fn encoder_layer(layer: &TransformerEncoderLayer, x: Tensor<3>) -> Tensor<3> {
    if layer.norm_first {
        let attn = self_attention(&layer.mha, norm(&layer.norm_2, x.clone()));
        let x = x + attn;
        let ff = feed_forward(&layer.pwff, norm(&layer.norm_1, x.clone()));
        x + ff
    } else {
        let x = norm(&layer.norm_1, x.clone() + self_attention(&layer.mha, x));
        let ff = feed_forward(&layer.pwff, x.clone());
        norm(&layer.norm_2, x + ff)
    }
}

/// Burn's LayerNorm `layer` through Kiln's kernel (the encoder's ε).
fn norm(layer: &LayerNorm, x: Tensor<3>) -> Tensor<3> {
    crate::kernels::transformer::layer_norm(
        x,
        layer.gamma.val(),
        layer.beta.as_ref().map(|b| b.val()),
        LAYER_NORM_EPS,
    )
}

/// Multi-head self-attention: the query, key and value projections as one packed
/// `Linear(d, 3d)` in the compute precision, then [`crate::nn::qkv_attention`] (Kiln's f32
/// kernel on the CPU, reading the packed projection in place; elsewhere the split and
/// [`amp::attention`]'s policy). Why packed: one GEMM of width 3d instead of three of width
/// d reads `x` once, and the backward's input gradient is one GEMM over the packed gradient
/// instead of three and two adds (W4 on the Xeon: BENCHMARKS.md run 57).
fn self_attention(mha: &MultiHeadAttention, x: Tensor<3>) -> Tensor<3> {
    let parts = [&mha.query, &mha.key, &mha.value];
    let weight = Tensor::cat(parts.iter().map(|l| l.weight.val()).collect(), 1);
    // Burn's attention layers carry biases; a part without one packs zeros in its place.
    let bias = parts.iter().any(|l| l.bias.is_some()).then(|| {
        let zeros = || Tensor::zeros([mha.d_k * mha.n_heads], &weight.device());
        let each = parts
            .iter()
            .map(|l| l.bias.as_ref().map_or_else(zeros, |b| b.val()));
        Tensor::cat(each.collect(), 0)
    });
    let qkv = amp::linear_weights(x, weight, bias);
    let context = crate::nn::qkv_attention(qkv, mha.n_heads, None, None, Default::default());
    amp::linear(&mha.output, context)
}

/// Position-wise feed-forward: two autocast linears around the activation (Kiln's ReLU /
/// GELU kernels where the layer's activation is one of them).
fn feed_forward(ff: &PositionWiseFeedForward, x: Tensor<3>) -> Tensor<3> {
    let h = crate::nn::activation(&ff.activation, amp::linear(&ff.linear_inner, x));
    amp::linear(&ff.linear_outer, h)
}
