//! W1: MLP 784-512-256-10 with ReLU.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};
use crate::precision as amp;

/// W1: a three-layer perceptron on flattened 28×28 images.
#[derive(Module, Debug)]
pub struct Mlp {
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
    pub(crate) fc3: Linear,
}

impl Mlp {
    /// A freshly initialized W1.
    pub fn new(device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(784, 512).init(device),
            fc2: LinearConfig::new(512, 256).init(device),
            fc3: LinearConfig::new(256, NUM_CLASSES).init(device),
        }
    }
}

impl Classifier for Mlp {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x: Tensor<2> = images.flatten(1, 3);
        let x = relu(amp::linear(&self.fc1, x));
        let x = relu(amp::linear(&self.fc2, x));
        amp::linear(&self.fc3, x)
    }
}
