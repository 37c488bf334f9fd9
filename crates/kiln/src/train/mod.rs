//! The training loop for any Burn model: the [`TrainStep`] contract (how a batch becomes a
//! loss), the [`Trainer`] (accumulation, global-norm clipping, mixed precision and loss
//! scaling, the stability guard, schedules, evaluation with pluggable [`Metric`]s, atomic
//! checkpoints and exact resume, OOM-adaptive micro-batching). Nothing here knows the zoo: the
//! zoo's models are users of this contract like any other.

mod checkpoint;
mod clip;
mod contract;
mod eval;
mod metrics;
mod optimizer;
mod restore;
mod run;
mod schedule;
pub mod step;
mod trainer;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crate::distributed::flatten_params;
pub use checkpoint::{
    Checkpoint, CheckpointState, checkpoints_in, latest_checkpoint, prune_checkpoints,
};
pub use clip::{clip_global_norm, global_norm, scale_grads, scale_grads_by};
pub use contract::{StepOutput, Targets, TrainStep};
pub use eval::{Evaluation, evaluate, evaluate_source};
pub use metrics::{Accuracy, LossMetric, Metric, Mse, default_metrics};
pub use optimizer::build_optimizer;
pub use schedule::learning_rate;
pub use step::host_read::host_reads;
pub use trainer::{TrainOutcome, Trainer, backend_rng_guard, seeded_init};

use crate::data::{Augment, LastBatch, LoaderOptions};
use crate::guard::GuardOptions;
use crate::precision::{Precision, ScalerOptions};

/// How many checkpoints a run keeps by default: the newest, and two before it in case the
/// newest holds a diverged model (a W2 checkpoint is 14 MB; every one kept filled disks).
pub const DEFAULT_KEEP_CHECKPOINTS: usize = 3;

/// Which optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// Adam (L2 weight decay when `weight_decay > 0`).
    Adam,
    /// AdamW (decoupled weight decay).
    AdamW,
    /// SGD with momentum.
    Sgd,
}

crate::names::config_names!(OptimizerKind { Adam => "adam", AdamW => "adamw", Sgd => "sgd" });

/// Learning-rate schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// Constant at the peak rate.
    Constant,
    /// Cosine decay from the peak rate to `min_lr_ratio × lr` at the last step.
    Cosine,
}

crate::names::config_names!(Schedule { Constant => "constant", Cosine => "cosine" });

/// Everything the training loop needs to know; usually built by [`crate::plan::resolve`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    /// Passes over the training set.
    pub epochs: usize,
    /// Micro-batch size.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum_steps: usize,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// SGD momentum.
    pub momentum: f64,
    /// Schedule after warm-up.
    pub schedule: Schedule,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Cosine floor as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Global-norm clipping threshold.
    pub grad_clip_norm: Option<f64>,
    /// Burn's balanced activation checkpointing.
    pub activation_checkpointing: bool,
    /// Seed for initialization and data order.
    pub seed: u64,
    /// Stop after this many optimizer steps.
    pub max_steps: Option<u64>,
    /// Evaluate every N epochs (0 = at the end only).
    pub eval_every_epochs: usize,
    /// Where checkpoints go.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps besides each epoch end.
    pub checkpoint_every_steps: Option<u64>,
    /// Checkpoints kept in `checkpoint_dir`: after each new one is written and verified on
    /// disk, all but the newest N are deleted (0 = keep every one).
    pub keep_checkpoints: usize,
    /// Shuffle the training set each epoch.
    pub shuffle: bool,
    /// The epoch's last, short batch: kept, dropped or padded to the batch's shape
    /// (`data.last_batch`; auto resolves to keep on the CPU, pad on a GPU).
    #[serde(default)]
    pub last_batch: LastBatch,
    /// Loader worker threads; `None` measures a few steps per count at the start of the run
    /// and takes the fewest that keep data wait under 5% of step time.
    pub workers: Option<usize>,
    /// Batches each loader worker may prepare ahead of the trainer.
    pub prefetch_factor: usize,
    /// Per-sample augmentation, run in the loader workers.
    pub augment: Augment,
    /// Emit [`crate::observe::Event::MemoryWatermark`] when resident memory reaches this many
    /// bytes.
    pub memory_watermark: Option<u64>,
    /// On a watermark crossing, halve the micro-batch and double accumulation (same effective
    /// batch) instead of risking an out-of-memory abort.
    pub oom_adaptive: bool,
    /// Numeric precision of the step.
    pub precision: Precision,
    /// Loss scaling.
    pub scaler: ScalerOptions,
    /// Numerical-stability guard.
    pub guard: GuardOptions,
    /// Steps between the loop's sync points, where it reads the queued steps' losses, guard
    /// verdicts and norms back in one transfer (`train.sync_every`; 0 = auto: every step on
    /// the CPU, [`step::GPU_SYNC_EVERY`] on a GPU). Evaluations, checkpoints and epoch ends
    /// are sync points too.
    #[serde(default)]
    pub sync_every: usize,
    /// Whether the step uses Kiln's kernels on the CPU (`device.kiln_kernels`; off = Burn's own
    /// ops). The trainer switches them for its thread only ([`crate::kernels::Scope`]).
    #[serde(default = "kiln_kernels_default")]
    pub kiln_kernels: bool,
}

/// Kiln's kernels are on unless a plan says otherwise (and in options saved before the
/// setting existed).
fn kiln_kernels_default() -> bool {
    true
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            epochs: 1,
            batch_size: 64,
            grad_accum_steps: 1,
            optimizer: OptimizerKind::Adam,
            lr: 1e-3,
            weight_decay: 0.0,
            momentum: 0.9,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            min_lr_ratio: 0.05,
            grad_clip_norm: None,
            activation_checkpointing: false,
            seed: 42,
            max_steps: None,
            eval_every_epochs: 1,
            checkpoint_dir: None,
            checkpoint_every_steps: None,
            keep_checkpoints: DEFAULT_KEEP_CHECKPOINTS,
            shuffle: true,
            last_batch: LastBatch::Keep,
            workers: Some(0),
            prefetch_factor: 2,
            augment: Augment::None,
            memory_watermark: None,
            oom_adaptive: false,
            precision: Precision::F32,
            scaler: ScalerOptions::default(),
            guard: GuardOptions::default(),
            sync_every: 0,
            kiln_kernels: true,
        }
    }
}

impl TrainOptions {
    /// The data loader settings of a run with `workers` loader threads (the last, short
    /// batch as [`TrainOptions::last_batch`] says).
    pub fn loader_options(&self, workers: usize) -> LoaderOptions {
        LoaderOptions {
            batch_size: self.batch_size,
            workers,
            prefetch_factor: self.prefetch_factor,
            shuffle: self.shuffle,
            drop_last: self.last_batch == LastBatch::Drop,
            pad_last: self.last_batch == LastBatch::Pad,
            seed: self.seed,
        }
    }

    /// The settings that shape the trajectory: a resume with different values would not
    /// continue the same run, so [`Trainer`] refuses it.
    pub fn trajectory_fingerprint(&self) -> Vec<(&'static str, String)> {
        vec![
            ("train.epochs", self.epochs.to_string()),
            ("train.batch_size", self.batch_size.to_string()),
            ("train.grad_accum_steps", self.grad_accum_steps.to_string()),
            ("train.optimizer", format!("{:?}", self.optimizer)),
            ("train.lr", self.lr.to_string()),
            ("train.weight_decay", self.weight_decay.to_string()),
            ("train.momentum", self.momentum.to_string()),
            ("train.schedule", format!("{:?}", self.schedule)),
            ("train.warmup_steps", self.warmup_steps.to_string()),
            ("train.min_lr_ratio", self.min_lr_ratio.to_string()),
            ("train.grad_clip_norm", format!("{:?}", self.grad_clip_norm)),
            ("train.seed", self.seed.to_string()),
            ("data.shuffle", self.shuffle.to_string()),
            ("data.last_batch", self.last_batch.name().to_string()),
            ("data.augment", self.augment.name().to_string()),
            ("precision.policy", self.precision.name().to_string()),
            ("precision.loss_scaling", format!("{:?}", self.scaler.mode)),
        ]
    }
}
