//! A regression model on tabular data with MSE, trained by Kiln.
//!
//! Eight features, one real-valued target, an MLP written with `kiln::nn::Linear` (Burn's
//! `LinearConfig` and record). f16 mixed precision with dynamic loss scaling, accumulation,
//! clipping, and a stop-and-resume from a checkpoint halfway.
//! `cargo run --release -p kiln --example tabular_regression`

#[allow(dead_code)] // each example uses part of the shared helpers
mod common;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use kiln::data::BurnBatches;
use kiln::nn::{Linear, LinearConfig};
use kiln::precision::Precision;
use kiln::train::{StepOutput, TrainOptions, TrainStep};
use rand::Rng;

const FEATURES: usize = 8;

/// A three-layer perceptron.
#[derive(Module, Debug)]
pub struct Regressor {
    hidden1: Linear,
    hidden2: Linear,
    out: Linear,
}

impl Regressor {
    /// A fresh model.
    pub fn new(device: &Device) -> Self {
        Regressor {
            hidden1: LinearConfig::new(FEATURES, 64).init(device),
            hidden2: LinearConfig::new(64, 64).init(device),
            out: LinearConfig::new(64, 1).init(device),
        }
    }

    /// Predictions `[B, 1]` of rows `[B, FEATURES]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = relu(self.hidden1.forward(x));
        let x = relu(self.hidden2.forward(x));
        self.out.forward(x)
    }
}

/// A batch of rows and targets.
#[derive(Debug, Clone)]
pub struct Rows {
    features: Tensor<2>,
    targets: Tensor<2>,
}

impl TrainStep<Rows> for Regressor {
    fn step(&self, batch: Rows) -> StepOutput {
        StepOutput::regression(self.forward(batch.features), batch.targets)
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    features: [f32; FEATURES],
    target: f32,
}

#[derive(Debug, Clone)]
struct RowBatcher;

impl Batcher<Row, Rows> for RowBatcher {
    fn batch(&self, items: Vec<Row>, device: &Device) -> Rows {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|r| r.features).collect();
        let targets: Vec<f32> = items.iter().map(|r| r.target).collect();
        Rows {
            features: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, 1]), device),
        }
    }
}

/// A nonlinear target of uniform features, with noise (σ ≈ 0.03).
fn table(n: usize, seed: u64) -> Vec<Row> {
    let mut rng = common::rng(seed);
    (0..n)
        .map(|_| {
            let mut f = [0f32; FEATURES];
            for v in &mut f {
                *v = 2.0 * rng.random::<f32>() - 1.0;
            }
            let noise = 0.1 * (rng.random::<f32>() - 0.5);
            let target =
                (2.0 * f[0]).sin() + f[1] * f[2] + 0.5 * f[3] * f[3] - f[4] + 0.3 * f[5] + noise;
            Row {
                features: f,
                target,
            }
        })
        .collect()
}

/// The variance of the targets: the MSE of always predicting their mean.
fn variance(rows: &[Row]) -> f64 {
    let n = rows.len() as f64;
    let mean = rows.iter().map(|r| r.target as f64).sum::<f64>() / n;
    rows.iter()
        .map(|r| (r.target as f64 - mean).powi(2))
        .sum::<f64>()
        / n
}

/// Trains the regressor; returns the run and the held-out targets' variance.
fn run() -> kiln::Result<(common::Trained<Regressor>, f64)> {
    let held_out = table(512, 2);
    let baseline = variance(&held_out);
    let train = BurnBatches::new(InMemDataset::new(table(2048, 1)), RowBatcher);
    let valid = BurnBatches::new(InMemDataset::new(held_out), RowBatcher);
    let options = TrainOptions {
        epochs: 8,
        batch_size: 32,
        grad_accum_steps: 2,
        grad_clip_norm: Some(1.0),
        lr: 3e-3,
        precision: Precision::F16,
        ..TrainOptions::default()
    };
    let trained = common::train_with_resume(
        "tabular-regression",
        options,
        Regressor::new,
        &train,
        &valid,
    )?;
    Ok((trained, baseline))
}

#[cfg_attr(test, allow(dead_code))]
fn main() -> kiln::Result<()> {
    let (trained, baseline) = run()?;
    let summary = trained.summary("mse");
    println!("{summary} (predicting the mean: {baseline:.4})");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn trains_resumes_and_beats_the_mean() {
        let (trained, baseline) = super::run().expect("the example trains");
        trained.assert_loss_fell(0.5);
        let mse = trained.metric("mse");
        assert!(
            mse < 0.2 * baseline,
            "held-out MSE {mse} vs {baseline} for predicting the mean"
        );
    }
}
