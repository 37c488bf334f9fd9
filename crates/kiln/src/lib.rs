//! # Kiln
//!
//! A performance optimization system for deep-learning training and inference on the
//! [Burn](https://burn.dev) tensor engine. Kiln takes a model and its data, resolves the
//! user's intent (an optimization level, a config file, flags) into a concrete [`plan::Plan`],
//! and runs it with every decision measured and reported.
//!
//! ## Your own Burn model
//!
//! The entry points for a Burn user:
//! - [`train::TrainStep`]: implement it on your module to say how one batch becomes a loss
//!   ([`train::StepOutput::classification`], [`train::StepOutput::regression`], or any scalar
//!   loss of your own with [`train::StepOutput::new`]).
//! - [`data::BurnBatches`]: your Burn `Dataset` + `Batcher` (`burn::data`) as Kiln's loader
//!   input (worker threads, bounded prefetch, seeded shuffling, every sample once per epoch);
//!   or implement [`data::BatchSource`] yourself.
//! - [`train::Trainer::fit_source`] with [`train::TrainOptions`] (or a resolved
//!   [`plan::Plan`]'s `train`): accumulation, clipping, bf16/f16 mixed precision with loss
//!   scaling, the stability guard, checkpoints and exact resume, OOM-adaptive micro-batching,
//!   events, evaluation with pluggable [`train::Metric`]s.
//! - [`nn`]: drop-in `Linear`, `Conv2d`, `MaxPool2d`, `BatchNorm` with Burn's configs and records, so the
//!   model gets Kiln's CPU kernels and the autocast policy by changing one `use` line.
//! - [`tune::batch::search_source`] and [`tune::auto::search_source`]: the batch-size
//!   search and the measured plan search on your model and data.
//!
//! ```
//! use burn::data::{dataloader::batcher::Batcher, dataset::InMemDataset};
//! use burn::module::Module;
//! use burn::tensor::{Device, Tensor, TensorData};
//! use kiln::data::BurnBatches;
//! use kiln::nn::{Linear, LinearConfig};
//! use kiln::train::{StepOutput, TrainOptions, TrainStep, Trainer};
//!
//! #[derive(Module, Debug)]
//! struct Line {
//!     fit: Linear,
//! }
//!
//! impl TrainStep<(Tensor<2>, Tensor<2>)> for Line {
//!     fn step(&self, (x, y): (Tensor<2>, Tensor<2>)) -> StepOutput {
//!         StepOutput::regression(self.fit.forward(x), y)
//!     }
//! }
//!
//! /// Items are x; the target is 3x + 1.
//! struct Points;
//! impl Batcher<f32, (Tensor<2>, Tensor<2>)> for Points {
//!     fn batch(&self, xs: Vec<f32>, device: &Device) -> (Tensor<2>, Tensor<2>) {
//!         let x = Tensor::<2>::from_data(TensorData::new(xs.clone(), [xs.len(), 1]), device);
//!         (x.clone(), x.mul_scalar(3.0).add_scalar(1.0))
//!     }
//! }
//!
//! let xs: Vec<f32> = (0..256).map(|i| i as f32 / 128.0 - 1.0).collect();
//! let data = BurnBatches::new(InMemDataset::new(xs), Points);
//! let options = TrainOptions { epochs: 20, batch_size: 16, lr: 0.1, ..TrainOptions::default() };
//! let line = |d: &Device| Line { fit: LinearConfig::new(1, 1).init(d) };
//! let mut sink = kiln::observe::NullSink;
//! let run = Trainer::new(options, Device::flex(), &mut sink)
//!     .fit_source("line", line, &data, Some(&data))?;
//! assert!(run.summary.test_metrics["mse"] < 1e-3, "{:?}", run.summary.test_metrics);
//! # Ok::<(), kiln::KilnError>(())
//! ```
//!
//! `crates/kiln/examples/` has three complete ones (a CNN with a custom loss, a regression on
//! tabular data, a transformer on token ids).
//!
//! ## Map of the crate
//!
//! (See `DESIGN.md` at the repository root and `docs/` for the architecture.)
//! - [`config`]: [`KilnConfig`], the TOML schema, levels and validation.
//! - [`plan`]: resolution of a config + hardware probe into a [`plan::Plan`].
//! - [`precision`]: mixed precision — the bf16/f16 policy, autocast ops, dynamic loss scaling.
//! - [`train`]: the training contract, the [`train::Trainer`] and its run loop, accumulation,
//!   clipping, schedules, checkpoints, metrics.
//! - [`data`]: batch sources (Kiln's datasets, Burn's `Dataset` + `Batcher`), the loader.
//! - [`distributed`]: data parallelism — the collective interface, ranks as threads, ranks
//!   on GPUs through Burn's device collective, MPI (feature `mpi`);
//!   [`train::Trainer::with_collective`] trains one model over the ranks.
//! - [`nn`]: drop-in layers over Kiln's kernels and autocast.
//! - [`datasets`]: the bundled MNIST subset and the IDX loader.
//! - [`zoo`]: the reference workloads W1–W5 (users of the training contract).
//! - [`observe`]: run events, sinks and memory readings.
//! - [`infer`]: inference graphs, passes (BN folding, int8), the executor and ONNX export.
//! - [`guard`]: the numerical-stability guard.
//! - [`kernels`]: Kiln's CPU kernels (f32 convolution) as a Burn backend extension.
//! - [`tune`]: batch-size search, the plan search, bottleneck detection.
//! - [`fsutil`]: atomic file writes.
#![deny(missing_docs)]

pub mod check;
pub mod classifier;
pub mod config;
pub mod data;
pub mod datasets;
pub mod distributed;
pub mod error;
pub mod fsutil;
pub mod fuzz;
pub mod guard;
pub mod infer;
pub mod kernels;
pub mod names;
pub mod nn;
pub mod observe;
pub mod onnx;
pub mod plan;
pub mod precision;
pub mod report;
pub mod stream;
pub mod train;
pub mod tune;
#[cfg(feature = "video")]
pub mod video;
pub mod zoo;

pub use burn;
pub use config::KilnConfig;
pub use error::{KilnError, Result};
pub use train::Trainer;
