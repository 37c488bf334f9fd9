//! Your own CNN on 3×32×32 images with your own loss, trained by Kiln.
//!
//! The model is ordinary Burn code; the only Kiln-specific lines are the `kiln::nn` import
//! (drop-in layers: Kiln's CPU kernels and the bf16/f16 autocast policy), the `TrainStep`
//! impl, and the `Trainer` call. The data is a Burn `InMemDataset` + `Batcher`. The run uses
//! accumulation, clipping, bf16 mixed precision, and stops halfway to resume from its
//! checkpoint. `cargo run --release -p kiln --example custom_cnn`

#[allow(dead_code)] // each example uses part of the shared helpers
mod common;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln::data::BurnBatches;
use kiln::nn::{Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d, MaxPool2dConfig};
use kiln::precision::Precision;
use kiln::train::{StepOutput, TrainOptions, TrainStep};
use rand::Rng;

const CLASSES: usize = 4;
const SIDE: usize = 32;

/// A small CNN, written as any Burn model is.
#[derive(Module, Debug)]
pub struct SmallCnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    head: Linear,
}

impl SmallCnn {
    /// A fresh model.
    pub fn new(device: &Device) -> Self {
        let same = PaddingConfig2d::Same;
        SmallCnn {
            conv1: Conv2dConfig::new([3, 8], [3, 3])
                .with_padding(same.clone())
                .init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3])
                .with_padding(same)
                .init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            head: LinearConfig::new(16 * 8 * 8, CLASSES).init(device),
        }
    }

    /// Logits `[B, CLASSES]` of images `[B, 3, 32, 32]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self.pool.forward(relu(self.conv2.forward(x)));
        self.head.forward(x.flatten(1, 3))
    }
}

/// A batch of images and labels.
#[derive(Debug, Clone)]
pub struct ImageBatch {
    images: Tensor<4>,
    labels: Tensor<1, Int>,
}

/// The custom loss: cross-entropy against label-smoothed targets (ε = 0.1).
fn smoothed_cross_entropy(logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
    let eps = 0.1;
    let targets = labels
        .one_hot(CLASSES)
        .float()
        .mul_scalar(1.0 - eps)
        .add_scalar(eps / CLASSES as f64);
    (targets * log_softmax(logits, 1)).sum_dim(1).mean().neg()
}

impl TrainStep<ImageBatch> for SmallCnn {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let logits = self.forward(batch.images);
        StepOutput::new(smoothed_cross_entropy(logits.clone(), batch.labels.clone()))
            .with_classes(logits, batch.labels)
    }
}

/// One sample.
#[derive(Debug, Clone)]
pub struct Item {
    pixels: Vec<f32>,
    label: usize,
}

/// Stacks items into an [`ImageBatch`] on the device.
#[derive(Debug, Clone)]
struct ImageBatcher;

impl Batcher<Item, ImageBatch> for ImageBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> ImageBatch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        ImageBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, 3, SIDE, SIDE]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Synthetic colour images: stripes whose orientation is the class (horizontal, vertical,
/// diagonal, anti-diagonal) with a random phase, period, colour and pixel noise.
fn stripes(n: usize, seed: u64) -> Vec<Item> {
    let mut rng = common::rng(seed);
    (0..n)
        .map(|_| {
            let label = rng.random_range(0..CLASSES);
            let period = 4.0 + 4.0 * rng.random::<f32>();
            let phase = rng.random::<f32>() * period;
            let colour = [
                rng.random::<f32>(),
                rng.random::<f32>(),
                rng.random::<f32>(),
            ];
            let mut pixels = vec![0f32; 3 * SIDE * SIDE];
            for y in 0..SIDE {
                for x in 0..SIDE {
                    let t = match label {
                        0 => y as f32,
                        1 => x as f32,
                        2 => (x + y) as f32 * 0.7,
                        _ => (x as f32 - y as f32) * 0.7,
                    };
                    let on = ((t + phase) / period).fract() < 0.5;
                    for (c, level) in colour.iter().enumerate() {
                        let noise = rng.random::<f32>() - 0.5;
                        pixels[(c * SIDE + y) * SIDE + x] = if on { *level } else { 0.0 } + noise;
                    }
                }
            }
            Item { pixels, label }
        })
        .collect()
}

/// Trains the CNN and returns the run.
fn run() -> kiln::Result<common::Trained<SmallCnn>> {
    let train = BurnBatches::new(InMemDataset::new(stripes(768, 1)), ImageBatcher);
    let valid = BurnBatches::new(InMemDataset::new(stripes(256, 2)), ImageBatcher);
    let options = TrainOptions {
        epochs: 3,
        batch_size: 16,
        grad_accum_steps: 2,
        grad_clip_norm: Some(1.0),
        lr: 3e-3,
        precision: Precision::Bf16,
        ..TrainOptions::default()
    };
    common::train_with_resume("custom-cnn", options, SmallCnn::new, &train, &valid)
}

#[cfg_attr(test, allow(dead_code))]
fn main() -> kiln::Result<()> {
    println!("{} (chance 0.25)", run()?.summary("accuracy"));
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn trains_resumes_and_beats_chance() {
        let trained = super::run().expect("the example trains");
        trained.assert_loss_fell(0.6);
        let accuracy = trained.metric("accuracy");
        assert!(accuracy > 0.7, "held-out accuracy {accuracy} (chance 0.25)");
    }
}
