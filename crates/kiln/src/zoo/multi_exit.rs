//! The real-time variants of W2 for [`crate::stream`]: W2 with an early exit head
//! ([`MultiExitCnn`]), and a small CNN for half-resolution inputs ([`CoarseCnn`], the coarse
//! model of a multi-scale cascade), both written as a user would write them, on
//! [`crate::nn`]'s drop-in layers; [`train_stream_models`] trains them for the stream
//! benchmark and tests.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{Classifier, NUM_CLASSES};
use crate::data::{Augment, Batch, Dataset};
use crate::error::Result;
use crate::nn::{Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d, MaxPool2dConfig};
use crate::observe::NullSink;
use crate::stream::{Downscaled, MultiExit, StreamLike, VideoSpec};
use crate::train::{StepOutput, TrainOptions, TrainStep, Trainer};

/// How much each exit's loss counts in training: the early head a little less than the final
/// one, so the shared first convolution serves the deep path first.
pub const EXIT_LOSS_WEIGHTS: [f32; 2] = [0.5, 1.0];

/// W2 with an early exit after its first convolution.
///
/// ```text
/// exit 0: conv3x3(1→32)+ReLU ─┬─ maxpool4 → fc(1152→10)                      (~0.2 MMAC)
/// exit 1:                     └─ conv3x3(32→64)+ReLU, maxpool2, fc 9216→128→10 (W2, ~12 MMAC)
/// ```
/// Trained on the weighted sum of both heads' cross-entropies ([`EXIT_LOSS_WEIGHTS`]); its
/// [`MultiExit::forward_full`] is the full path alone, W2's cost.
#[derive(Module, Debug)]
pub struct MultiExitCnn {
    conv1: Conv2d,
    early_pool: MaxPool2d,
    early_fc: Linear,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
}

impl MultiExitCnn {
    /// A freshly initialized model for `[1, 28, 28]` images.
    pub fn new(device: &Device) -> Self {
        MultiExitCnn {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(device),
            early_pool: MaxPool2dConfig::new([4, 4]).init(),
            early_fc: LinearConfig::new(32 * 6 * 6, NUM_CLASSES).init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(64 * 12 * 12, 128).init(device),
            fc2: LinearConfig::new(128, NUM_CLASSES).init(device),
        }
    }

    fn trunk(&self, images: Tensor<4>) -> Tensor<4> {
        relu(self.conv1.forward(images))
    }

    fn early_head(&self, features: Tensor<4>) -> Tensor<2> {
        self.early_fc
            .forward(self.early_pool.forward(features).flatten(1, 3))
    }

    fn deep(&self, features: Tensor<4>) -> Tensor<2> {
        let x = relu(self.conv2.forward(features));
        let x: Tensor<2> = self.pool.forward(x).flatten(1, 3);
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

impl MultiExit for MultiExitCnn {
    fn input_shape(&self) -> [usize; 3] {
        [1, 28, 28]
    }

    fn num_exits(&self) -> usize {
        2
    }

    fn stage(&self, k: usize, x: Tensor<4>) -> (Tensor<4>, Tensor<2>) {
        if k == 0 {
            let features = self.trunk(x);
            let logits = self.early_head(features.clone());
            (features, logits)
        } else {
            // The last stage's features are not used by anyone: hand back its input.
            let logits = self.deep(x.clone());
            (x, logits)
        }
    }

    fn forward_full(&self, images: Tensor<4>) -> Tensor<2> {
        self.deep(self.trunk(images))
    }
}

impl TrainStep<Batch> for MultiExitCnn {
    fn step(&self, batch: Batch) -> StepOutput {
        let features = self.trunk(batch.images);
        let early = self.early_head(features.clone());
        let last = self.deep(features);
        let ce = CrossEntropyLossConfig::new().init(&last.device());
        let loss = ce
            .forward(early, batch.labels.clone())
            .mul_scalar(EXIT_LOSS_WEIGHTS[0])
            + ce.forward(last.clone(), batch.labels.clone())
                .mul_scalar(EXIT_LOSS_WEIGHTS[1]);
        // Accuracy and the reported logits are the final exit's (the full network).
        StepOutput::new(loss).with_classes(last, batch.labels)
    }

    fn check_batch(&self, batch: &Batch) -> std::result::Result<(), String> {
        let [_, c, h, w] = batch.images.dims();
        check_shape([c, h, w], [1, 28, 28])
    }
}

/// A small CNN on `[1, 14, 14]` images (MNIST at half resolution): conv3x3(1→16)+ReLU,
/// maxpool2, fc(576→10); ~26 kMAC, a 1/450 of W2.
#[derive(Module, Debug)]
pub struct CoarseCnn {
    conv: Conv2d,
    pool: MaxPool2d,
    fc: Linear,
}

impl CoarseCnn {
    /// A freshly initialized model.
    pub fn new(device: &Device) -> Self {
        CoarseCnn {
            conv: Conv2dConfig::new([1, 16], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc: LinearConfig::new(16 * 6 * 6, NUM_CLASSES).init(device),
        }
    }
}

impl Classifier for CoarseCnn {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv.forward(images)));
        self.fc.forward(x.flatten(1, 3))
    }

    fn check_input(&self, shape: [usize; 3]) -> std::result::Result<(), String> {
        check_shape(shape, [1, 14, 14])
    }
}

fn check_shape(shape: [usize; 3], expected: [usize; 3]) -> std::result::Result<(), String> {
    if shape == expected {
        Ok(())
    } else {
        Err(format!(
            "samples have shape {shape:?} but this model expects {expected:?}"
        ))
    }
}

/// The zoo's stream models, trained, on the inference device (no autodiff).
#[derive(Debug)]
pub struct StreamModels {
    /// W2 with an early exit.
    pub multi_exit: MultiExitCnn,
    /// The half-resolution coarse model.
    pub coarse: CoarseCnn,
    /// Test accuracy of the multi-exit model's last exit.
    pub multi_exit_accuracy: f64,
    /// Test accuracy of the coarse model (on the test split at half resolution).
    pub coarse_accuracy: f64,
}

/// Trains [`MultiExitCnn`] (random crops, so digits that drift by two pixels stay known) and
/// [`CoarseCnn`] on `train` (its half-resolution view), evaluating both on `test`; both sets
/// seen as the stream of `spec` shows digits ([`StreamLike`]: its background and noise).
pub fn train_stream_models(
    train: &dyn Dataset,
    test: &dyn Dataset,
    spec: &VideoSpec,
    epochs: usize,
    device: &Device,
) -> Result<StreamModels> {
    let seed = spec.seed;
    // Other backgrounds than the video's own frames: the training seed is not the video's.
    let train_spec = VideoSpec {
        seed: spec.seed.wrapping_add(1),
        ..spec.clone()
    };
    let (train, test) = (
        StreamLike::new(train, &train_spec),
        StreamLike::new(test, &train_spec),
    );
    let (train, test): (&dyn Dataset, &dyn Dataset) = (&train, &test);
    let mut sink = NullSink;
    let options = TrainOptions {
        epochs,
        seed,
        augment: Augment::Crop,
        eval_every_epochs: epochs,
        ..TrainOptions::default()
    };
    let full = Trainer::new(options.clone(), device.clone(), &mut sink).fit(
        "multi-exit-cnn",
        MultiExitCnn::new,
        train,
        Some(test),
    )?;
    let (small_train, small_test) = (Downscaled::new(train, 2)?, Downscaled::new(test, 2)?);
    // A 2 px crop at half resolution would be a 4 px shift at full: the coarse model trains on
    // the centred digits and the multi-scale runner sends what it is unsure of to the full one.
    let coarse_options = TrainOptions {
        augment: Augment::None,
        epochs: epochs * 2,
        eval_every_epochs: epochs * 2,
        ..options
    };
    let coarse = Trainer::new(coarse_options, device.clone(), &mut sink).fit(
        "coarse-cnn",
        CoarseCnn::new,
        &small_train,
        Some(&small_test),
    )?;
    Ok(StreamModels {
        multi_exit_accuracy: full.summary.test_accuracy.unwrap_or(0.0),
        coarse_accuracy: coarse.summary.test_accuracy.unwrap_or(0.0),
        // Off the autodiff device: a forward there records a graph that no backward frees
        // (2.5 MB a frame on the video).
        multi_exit: full.model.valid(),
        coarse: coarse.model.valid(),
    })
}
