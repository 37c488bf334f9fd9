//! W4: a Transformer encoder classifier that reads the 28 image rows as 28 tokens.

use burn::module::{Module, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};

const TOKENS: usize = 28;
const FEATURES: usize = 28;
const D_MODEL: usize = 128;

/// W4: embed(28→128) + learned positions, 2 post-norm encoder layers (4 heads, ff 512, ReLU,
/// no dropout, as the PyTorch peer), mean-pool over tokens, linear head.
#[derive(Module, Debug)]
pub struct EncoderClassifier {
    embed: Linear,
    pos: Param<Tensor<3>>,
    encoder: TransformerEncoder,
    head: Linear,
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
                .init(device),
            head: LinearConfig::new(D_MODEL, NUM_CLASSES).init(device),
        }
    }
}

impl Classifier for EncoderClassifier {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let [batch, _, _, _] = images.dims();
        let tokens: Tensor<3> = images.reshape([batch, TOKENS, FEATURES]);
        let h = self.embed.forward(tokens) + self.pos.val();
        let h = self.encoder.forward(TransformerEncoderInput::new(h));
        let pooled: Tensor<2> = h.mean_dim(1).reshape([batch, D_MODEL]);
        self.head.forward(pooled)
    }
}
