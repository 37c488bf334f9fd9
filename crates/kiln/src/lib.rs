//! # Kiln
//!
//! A performance optimization system for deep-learning training and inference on the
//! [Burn](https://burn.dev) tensor engine. Kiln takes a model and its data, resolves the
//! user's intent (an optimization level, a config file, flags) into a concrete [`plan::Plan`],
//! and runs it with every decision measured and reported.
//!
//! Map of the crate (see `DESIGN.md` at the repository root for the architecture):
//! - [`config`]: [`KilnConfig`], the TOML schema, levels and validation.
//! - [`plan`]: resolution of a config + hardware probe into a [`plan::Plan`].
//! - [`precision`]: mixed precision — the bf16/f16 policy, autocast ops, dynamic loss scaling.
//! - [`train`]: the [`train::Trainer`] step loop, accumulation, clipping, schedules, checkpoints.
//! - [`data`]: the [`data::Dataset`] trait, batching and shuffling.
//! - [`datasets`]: the bundled MNIST subset and the IDX loader.
//! - [`zoo`]: the reference workloads W1–W5.
//! - [`observe`]: run events, sinks and memory readings.
//! - [`infer`]: inference graphs, passes (BN folding, int8), the executor and ONNX export.
//! - [`guard`]: the numerical-stability guard.
//! - [`kernels`]: Kiln's CPU kernels (f32 convolution) as a Burn backend extension.
//! - [`fsutil`]: atomic file writes.

pub mod config;
pub mod data;
pub mod datasets;
pub mod error;
pub mod fsutil;
pub mod guard;
pub mod infer;
pub mod kernels;
pub mod observe;
pub mod plan;
pub mod precision;
pub mod report;
pub mod train;
pub mod tune;
pub mod zoo;

pub use burn;
pub use config::KilnConfig;
pub use error::{KilnError, Result};
pub use train::Trainer;
