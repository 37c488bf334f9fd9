//! The reference workloads: the same models are used by tests, benchmarks, the tuner and the
//! server, so every part of Kiln is exercised on the same real networks.
//!
//! | id | name          | model                                                        |
//! |----|---------------|--------------------------------------------------------------|
//! | W1 | `mlp`         | MLP 784-512-256-10, ReLU                                     |
//! | W2 | `cnn`         | conv3x3(1→32), conv3x3(32→64), maxpool2, fc 9216→128→10      |
//! | W3 | `cnn` (infer) | W2's forward pass only                                       |
//! | W4 | `transformer` | 28 row-tokens → d_model 128, 4 heads, ff 512, 2 layers       |
//! | W5 | `resnet`      | ResNet-18 (BasicBlock \[2,2,2,2\], 64-128-256-512, BatchNorm)  |
//!
//! For real-time inference ([`crate::stream`]): [`MultiExitCnn`] (W2 with an early exit
//! head) and [`CoarseCnn`] (the half-resolution model of a multi-scale cascade).

mod cnn;
mod lower;
mod mlp;
mod multi_exit;
mod resnet;
mod transformer;

use std::path::Path;

use burn::module::Module;
use burn::store::ModuleRecord;
use burn::tensor::{Bytes, Device, Tensor};

pub use crate::classifier::Classifier;
pub use cnn::Cnn;
pub use mlp::Mlp;
pub use multi_exit::{
    CoarseCnn, EXIT_LOSS_WEIGHTS, MultiExitCnn, StreamModels, train_stream_models,
};
pub use resnet::{ResNet, ResNetConfig};
pub use transformer::EncoderClassifier;

use crate::error::{KilnError, Result};
use crate::train::Checkpoint;

/// Number of classes every zoo classifier predicts.
pub const NUM_CLASSES: usize = 10;

/// Which zoo model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// W1.
    Mlp,
    /// W2 / W3.
    Cnn,
    /// W4.
    Transformer,
    /// W5.
    ResNet,
}

impl ModelKind {
    /// Every zoo model.
    pub const ALL: [ModelKind; 4] = [
        ModelKind::Mlp,
        ModelKind::Cnn,
        ModelKind::Transformer,
        ModelKind::ResNet,
    ];

    /// Stable name used by the CLI, configs and benches.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Transformer => "transformer",
            ModelKind::ResNet => "resnet",
        }
    }

    /// The workload id (W1, W2, W4, W5).
    pub fn workload(self) -> &'static str {
        match self {
            ModelKind::Mlp => "W1",
            ModelKind::Cnn => "W2",
            ModelKind::Transformer => "W4",
            ModelKind::ResNet => "W5",
        }
    }

    /// Parses a name (`cnn`) or workload id (`W2`, `w2`, `W3` = cnn).
    pub fn from_name(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        match lower.as_str() {
            "mlp" | "w1" => Ok(ModelKind::Mlp),
            "cnn" | "w2" | "w3" => Ok(ModelKind::Cnn),
            "transformer" | "w4" => Ok(ModelKind::Transformer),
            "resnet" | "w5" => Ok(ModelKind::ResNet),
            _ => Err(KilnError::UnknownModel(name.to_string())),
        }
    }

    /// A freshly initialized model for single-channel 28×28 images (the MNIST shape).
    pub fn init(self, device: &Device) -> ZooModel {
        self.init_for_channels(1, device)
    }

    /// A freshly initialized model whose input has `channels` channels. Only the ResNet is
    /// channel-generic (W5 benchmarks use 3×32×32); the others are defined on MNIST's shape.
    pub fn init_for_channels(self, channels: usize, device: &Device) -> ZooModel {
        match self {
            ModelKind::Mlp => ZooModel::Mlp(Mlp::new(device)),
            ModelKind::Cnn => ZooModel::Cnn(Cnn::new(device)),
            ModelKind::Transformer => ZooModel::Transformer(EncoderClassifier::new(device)),
            ModelKind::ResNet => ZooModel::ResNet(ResNetConfig::resnet18(channels).init(device)),
        }
    }

    /// The standard benchmark shape of the workload: training batch and `[C, H, W]`, as in
    /// the peers' `workloads.py`.
    pub fn bench_shape(self) -> (usize, [usize; 3]) {
        match self {
            ModelKind::Mlp => (128, [1, 28, 28]),
            ModelKind::Cnn | ModelKind::Transformer => (64, [1, 28, 28]),
            ModelKind::ResNet => (64, [3, 32, 32]),
        }
    }
}

/// Any zoo model, so code that picks a model at run time stays non-generic.
#[derive(Module, Debug)]
pub enum ZooModel {
    /// W1.
    Mlp(Mlp),
    /// W2.
    Cnn(Cnn),
    /// W4.
    Transformer(EncoderClassifier),
    /// W5.
    ResNet(ResNet),
}

impl Classifier for ZooModel {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            ZooModel::Mlp(m) => m.forward(images),
            ZooModel::Cnn(m) => m.forward(images),
            ZooModel::Transformer(m) => m.forward(images),
            ZooModel::ResNet(m) => m.forward(images),
        }
    }

    fn check_input(&self, shape: [usize; 3]) -> std::result::Result<(), String> {
        let expected = match self {
            // The ResNet is fully convolutional with global pooling: any size >= 4×4.
            ZooModel::ResNet(m) => {
                let c = m.in_channels();
                if shape[0] == c && shape[1] >= 4 && shape[2] >= 4 {
                    return Ok(());
                }
                format!("[{c}, H, W] with H, W >= 4")
            }
            _ if shape == [1, 28, 28] => return Ok(()),
            _ => "[1, 28, 28] (MNIST-shaped images)".to_string(),
        };
        Err(format!(
            "samples have shape {shape:?} but this model expects {expected}"
        ))
    }
}

/// Loads a trained zoo model of `kind` (input channels `channels`) from a Kiln checkpoint.
/// A checkpoint of another model, or weights that do not fit, are errors that say which.
pub fn load_model(
    kind: ModelKind,
    channels: usize,
    checkpoint: &Path,
    device: &Device,
) -> Result<ZooModel> {
    let ckpt = Checkpoint::load(checkpoint)?;
    let bad = |problem: String| KilnError::BadCheckpoint {
        path: checkpoint.to_path_buf(),
        problem,
    };
    if ckpt.state.model != kind.name() {
        return Err(bad(format!(
            "it holds model `{}`, not `{}`; pass --model {}",
            ckpt.state.model,
            kind.name(),
            ckpt.state.model
        )));
    }
    let model = kind.init_for_channels(channels, device);
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(ckpt.model))
        .map_err(|e| bad(format!("unreadable model weights: {e}")))?;
    model.try_load_record(record).map_err(|e| {
        bad(format!(
            "its weights do not fit `{}` with {channels} input channel(s): {e}",
            kind.name()
        ))
    })
}
