//! W2 (training) and W3 (inference): the small convolutional network.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};
use crate::precision as amp;

/// W2: conv3x3(1→32)+ReLU, conv3x3(32→64)+ReLU, maxpool2, fc(9216→128)+ReLU, fc(128→10).
#[derive(Module, Debug)]
pub struct Cnn {
    pub(crate) conv1: Conv2d,
    pub(crate) conv2: Conv2d,
    pub(crate) pool: MaxPool2d,
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
}

impl Cnn {
    /// A freshly initialized W2.
    pub fn new(device: &Device) -> Self {
        Cnn {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(64 * 12 * 12, 128).init(device),
            fc2: LinearConfig::new(128, NUM_CLASSES).init(device),
        }
    }
}

impl Classifier for Cnn {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = relu(amp::conv2d(&self.conv1, images));
        let x = relu(amp::conv2d(&self.conv2, x));
        let x: Tensor<2> = crate::kernels::max_pool2d_layer(&self.pool, x).flatten(1, 3);
        let x = relu(amp::linear(&self.fc1, x));
        amp::linear(&self.fc2, x)
    }
}
