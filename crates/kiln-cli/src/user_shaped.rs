//! The user-shaped benchmark models (`kiln bench --workload U1|U2`): written with `kiln::nn`
//! and Burn the way a user writes a model in their own crate — not the zoo's hand-lowered
//! forms — so the benchmark measures what a user gets. Their PyTorch twins are in
//! `bench/peers/torch_user_models.py` (same layers, shapes, initial-weight-independent
//! timing, Adam, cross-entropy).
//!
//! - **U1**, a MobileNet-style depthwise-separable CNN on 3×32×32: a 3×3 stem, then blocks of
//!   a depthwise 3×3 (or 5×5) convolution and a pointwise 1×1 convolution, each followed by
//!   BatchNorm and ReLU (two blocks at stride 2), global average pooling
//!   (`kiln::nn::global_avg_pool`), a linear head. Each
//!   BatchNorm + ReLU is `kiln::nn::BatchNorm::forward_relu`, as `docs/own-model.md` tells a
//!   user to write it: the ReLU fused into the normalization's passes (a separate
//!   `relu(bn.forward(x))` cost U1 ~18% of its step in two extra passes each way,
//!   BENCHMARKS.md run 57); the PyTorch twin runs them as separate eager ops.
//! - **U2**, a small pre-LN transformer encoder over 64 tokens of 32 features (the sample's
//!   rows): a linear embedding plus a learned position table, 4 blocks of
//!   `x + attn(LN(x))`, `x + ffn(LN(x))` (4 heads, d 128, GELU feed-forward 512), a final
//!   LayerNorm, mean over tokens, a linear head. Its attention is `kiln::nn::qkv_attention`
//!   over the packed `Linear(d, 3d)` projection: the split into heads, attention and merge a
//!   ViT-style block writes, as one call.

use burn::module::{Module, Param};
use burn::nn::PaddingConfig2d;
use burn::tensor::{Device, Tensor};
use kiln::burn;
use kiln::nn::{
    BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, gelu, global_avg_pool, qkv_attention,
};
use kiln::zoo::Classifier;

/// Classes of both models' heads.
const CLASSES: usize = 10;

/// A convolution + BatchNorm + ReLU, as users write them.
#[derive(Module, Debug)]
pub struct ConvBnRelu {
    conv: Conv2d,
    bn: BatchNorm,
}

impl ConvBnRelu {
    fn new(
        [cin, cout]: [usize; 2],
        kernel: usize,
        stride: usize,
        groups: usize,
        device: &Device,
    ) -> Self {
        ConvBnRelu {
            conv: Conv2dConfig::new([cin, cout], [kernel, kernel])
                .with_stride([stride, stride])
                .with_padding(PaddingConfig2d::Explicit(
                    kernel / 2,
                    kernel / 2,
                    kernel / 2,
                    kernel / 2,
                ))
                .with_groups(groups)
                .with_bias(false)
                .init(device),
            bn: BatchNormConfig::new(cout).init(device),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.bn.forward_relu(self.conv.forward(x))
    }
}

/// A depthwise convolution (one filter per channel) then a pointwise 1×1 one.
#[derive(Module, Debug)]
pub struct Separable {
    depthwise: ConvBnRelu,
    pointwise: ConvBnRelu,
}

/// U1: a MobileNet-style depthwise-separable CNN.
#[derive(Module, Debug)]
pub struct MobileNetish {
    stem: ConvBnRelu,
    blocks: Vec<Separable>,
    head: Linear,
}

/// (channels in, channels out, depthwise kernel, stride) of U1's blocks.
const U1_BLOCKS: [(usize, usize, usize, usize); 6] = [
    (32, 64, 3, 1),
    (64, 128, 3, 2),
    (128, 128, 3, 1),
    (128, 256, 3, 2),
    (256, 256, 5, 1),
    (256, 256, 3, 1),
];

impl MobileNetish {
    /// A fresh U1 for 3-channel images.
    pub fn new(device: &Device) -> Self {
        MobileNetish {
            stem: ConvBnRelu::new([3, 32], 3, 1, 1, device),
            blocks: U1_BLOCKS
                .iter()
                .map(|&(cin, cout, k, s)| Separable {
                    depthwise: ConvBnRelu::new([cin, cin], k, s, cin, device),
                    pointwise: ConvBnRelu::new([cin, cout], 1, 1, 1, device),
                })
                .collect(),
            head: LinearConfig::new(256, CLASSES).init(device),
        }
    }
}

impl Classifier for MobileNetish {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = self.stem.forward(images);
        for block in &self.blocks {
            x = block.pointwise.forward(block.depthwise.forward(x));
        }
        // Global average pooling, as `x.mean(dim=(2, 3))` in PyTorch.
        self.head.forward(global_avg_pool(x))
    }

    fn check_input(&self, [c, _, _]: [usize; 3]) -> Result<(), String> {
        if c == 3 {
            Ok(())
        } else {
            Err(format!("U1 takes 3-channel images, got {c}"))
        }
    }
}

/// U2's tokens, features per token and width.
const TOKENS: usize = 64;
const FEATURES: usize = 32;
const D_MODEL: usize = 128;
const HEADS: usize = 4;

/// One pre-LN encoder block, written out as users write a ViT block.
#[derive(Module, Debug)]
pub struct PreLnBlock {
    norm_attn: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm_ff: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
}

impl PreLnBlock {
    fn new(device: &Device) -> Self {
        PreLnBlock {
            norm_attn: LayerNormConfig::new(D_MODEL).init(device),
            qkv: LinearConfig::new(D_MODEL, 3 * D_MODEL).init(device),
            proj: LinearConfig::new(D_MODEL, D_MODEL).init(device),
            norm_ff: LayerNormConfig::new(D_MODEL).init(device),
            ff_in: LinearConfig::new(D_MODEL, 4 * D_MODEL).init(device),
            ff_out: LinearConfig::new(4 * D_MODEL, D_MODEL).init(device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let qkv = self.qkv.forward(self.norm_attn.forward(x.clone()));
        let context = qkv_attention(qkv, HEADS, None, None, Default::default());
        let x = x + self.proj.forward(context);
        let h = gelu(self.ff_in.forward(self.norm_ff.forward(x.clone())));
        x + self.ff_out.forward(h)
    }
}

/// U2: a small pre-LN transformer encoder classifier.
#[derive(Module, Debug)]
pub struct PreLnEncoder {
    embed: Linear,
    pos: Param<Tensor<3>>,
    blocks: Vec<PreLnBlock>,
    norm: LayerNorm,
    head: Linear,
}

impl PreLnEncoder {
    /// A fresh U2 for `[1, 64, 32]` samples.
    pub fn new(device: &Device) -> Self {
        PreLnEncoder {
            embed: LinearConfig::new(FEATURES, D_MODEL).init(device),
            pos: Param::from_tensor(Tensor::zeros([1, TOKENS, D_MODEL], device)),
            blocks: (0..4).map(|_| PreLnBlock::new(device)).collect(),
            norm: LayerNormConfig::new(D_MODEL).init(device),
            head: LinearConfig::new(D_MODEL, CLASSES).init(device),
        }
    }
}

impl Classifier for PreLnEncoder {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let [b, _, _, _] = images.dims();
        let tokens: Tensor<3> = images.reshape([b, TOKENS, FEATURES]);
        let mut x = self.embed.forward(tokens) + self.pos.val();
        for block in &self.blocks {
            x = block.forward(x);
        }
        let pooled: Tensor<2> = self.norm.forward(x).mean_dim(1).reshape([b, D_MODEL]);
        self.head.forward(pooled)
    }

    fn check_input(&self, shape: [usize; 3]) -> Result<(), String> {
        if shape == [1, TOKENS, FEATURES] {
            Ok(())
        } else {
            Err(format!(
                "U2 takes [1, {TOKENS}, {FEATURES}] samples, got {shape:?}"
            ))
        }
    }
}

/// A user-shaped workload: its id, sample shape, batch and model constructor.
pub struct UserWorkload {
    /// `U1` or `U2`.
    pub id: &'static str,
    /// What it is, for tables.
    pub name: &'static str,
    /// Sample shape `[C, H, W]`.
    pub shape: [usize; 3],
    /// Training batch.
    pub batch: usize,
    /// Default timed steps per repeat.
    pub steps: usize,
}

/// U1 and U2.
pub const USER_WORKLOADS: [UserWorkload; 2] = [
    UserWorkload {
        id: "U1",
        name: "mobilenet-style depthwise-separable CNN",
        shape: [3, 32, 32],
        batch: 64,
        steps: 5,
    },
    UserWorkload {
        id: "U2",
        name: "pre-LN transformer encoder",
        shape: [1, TOKENS, FEATURES],
        batch: 64,
        steps: 10,
    },
];
