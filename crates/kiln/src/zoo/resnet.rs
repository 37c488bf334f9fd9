//! W5: a ResNet-18-style network with BatchNorm (3×3 stem, no max-pool, as the peer). Its
//! BatchNorm layers are Kiln's drop-in ([`crate::nn::BatchNorm`]: Burn's record, Kiln's
//! training kernels, the following ReLU fused where there is one).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};
use crate::nn::{BatchNorm, BatchNormConfig};
use crate::precision as amp;

/// Shape of a ResNet: input channels and the width of each of the four stages.
#[derive(Debug, Clone, Copy)]
pub struct ResNetConfig {
    /// Image channels (1 for MNIST, 3 for the W5 benchmark's 3×32×32 inputs).
    pub in_channels: usize,
    /// Channels of the four stages (ResNet-18: 64, 128, 256, 512).
    pub widths: [usize; 4],
}

impl ResNetConfig {
    /// ResNet-18 widths.
    pub fn resnet18(in_channels: usize) -> Self {
        ResNetConfig {
            in_channels,
            widths: [64, 128, 256, 512],
        }
    }

    /// Builds the network.
    pub fn init(&self, device: &Device) -> ResNet {
        let stem_width = self.widths[0];
        let mut blocks = Vec::new();
        let mut cin = stem_width;
        for (stage, &cout) in self.widths.iter().enumerate() {
            let stride = if stage == 0 { 1 } else { 2 };
            blocks.push(BasicBlock::new(cin, cout, stride, device));
            blocks.push(BasicBlock::new(cout, cout, 1, device));
            cin = cout;
        }
        ResNet {
            stem: conv3x3(self.in_channels, stem_width, 1, device),
            stem_bn: BatchNormConfig::new(stem_width).init(device),
            blocks,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(cin, NUM_CLASSES).init(device),
        }
    }
}

fn conv3x3(cin: usize, cout: usize, stride: usize, device: &Device) -> Conv2d {
    Conv2dConfig::new([cin, cout], [3, 3])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .with_bias(false)
        .init(device)
}

/// The projection shortcut of a block that changes shape.
#[derive(Module, Debug)]
pub struct Shortcut {
    pub(crate) conv: Conv2d,
    pub(crate) bn: BatchNorm,
}

/// ResNet BasicBlock: two 3×3 convs with BatchNorm and a residual connection.
#[derive(Module, Debug)]
pub struct BasicBlock {
    pub(crate) conv1: Conv2d,
    pub(crate) bn1: BatchNorm,
    pub(crate) conv2: Conv2d,
    pub(crate) bn2: BatchNorm,
    pub(crate) shortcut: Option<Shortcut>,
}

impl BasicBlock {
    fn new(cin: usize, cout: usize, stride: usize, device: &Device) -> Self {
        let shortcut = (stride != 1 || cin != cout).then(|| Shortcut {
            conv: Conv2dConfig::new([cin, cout], [1, 1])
                .with_stride([stride, stride])
                .with_bias(false)
                .init(device),
            bn: BatchNormConfig::new(cout).init(device),
        });
        BasicBlock {
            conv1: conv3x3(cin, cout, stride, device),
            bn1: BatchNormConfig::new(cout).init(device),
            conv2: conv3x3(cout, cout, 1, device),
            bn2: BatchNormConfig::new(cout).init(device),
            shortcut,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let y = self.bn1.forward_relu(amp::conv2d(&self.conv1, x.clone()));
        let y = self.bn2.forward(amp::conv2d(&self.conv2, y));
        let skip = match &self.shortcut {
            Some(s) => s.bn.forward(amp::conv2d(&s.conv, x)),
            None => x,
        };
        relu(y + skip)
    }
}

/// W5: ResNet-18-style classifier.
#[derive(Module, Debug)]
pub struct ResNet {
    pub(crate) stem: Conv2d,
    pub(crate) stem_bn: BatchNorm,
    pub(crate) blocks: Vec<BasicBlock>,
    pub(crate) pool: AdaptiveAvgPool2d,
    pub(crate) head: Linear,
}

impl ResNet {
    /// Input channels, read from the stem convolution's weight `[out, in, k, k]`.
    pub fn in_channels(&self) -> usize {
        self.stem.weight.dims()[1]
    }
}

impl Classifier for ResNet {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = self.stem_bn.forward_relu(amp::conv2d(&self.stem, images));
        for block in &self.blocks {
            x = block.forward(x);
        }
        let x: Tensor<2> = self.pool.forward(x).flatten(1, 3);
        amp::linear(&self.head, x)
    }
}
