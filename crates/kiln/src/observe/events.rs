//! The events a training run emits.

use serde::{Deserialize, Serialize};

/// What went non-finite (stability guard).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trouble {
    /// The loss value.
    Loss,
    /// One or more gradients.
    Gradients,
    /// One or more parameters after the update.
    Parameters,
}

/// What the guard did about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardAction {
    /// The optimizer step was not applied.
    Skipped,
    /// Model and optimizer were restored to the snapshot taken at `restored_step`.
    RolledBack,
    /// The run stopped.
    Aborted,
    /// Only gradients overflowed while loss scaling was on: the step was skipped and the
    /// scale halved (f16's normal operation; the guard steps in once the scale is below 1).
    ScaleBackoff,
}

/// One guard event, as reported to the event sink and in the run summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuardEvent {
    /// Optimizer step (1-based) the event concerns.
    pub step: u64,
    /// What went non-finite (stability guard).
    pub trouble: Trouble,
    /// Names (module paths) of the non-finite tensors; empty for the loss.
    pub tensors: Vec<String>,
    /// The loss value seen (may be NaN/Inf).
    pub loss: f32,
    /// Loss scale in force at the time.
    pub loss_scale: f32,
    /// What the guard did.
    pub action: GuardAction,
    /// For rollbacks: the step of the snapshot restored.
    pub restored_step: Option<u64>,
}

/// One optimizer step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepEvent {
    /// Global optimizer step (1-based).
    pub step: u64,
    /// Epoch (0-based).
    pub epoch: usize,
    /// Mean training loss over the step's samples.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient L2 norm before clipping (when clipping is on).
    pub grad_norm: Option<f32>,
    /// Samples in this step (all micro-batches).
    pub samples: usize,
    /// Wall time of the step, milliseconds.
    pub step_ms: f64,
    /// Of which: waiting for data (batch assembly and upload), milliseconds.
    pub data_ms: f64,
    /// Of which: forward, backward and optimizer, milliseconds.
    pub compute_ms: f64,
    /// Throughput of this step.
    pub samples_per_s: f64,
    /// Peak resident set size of the process so far, bytes.
    pub peak_rss_bytes: Option<u64>,
    /// The stability guard skipped this step's update (non-finite loss or gradients).
    #[serde(default)]
    pub skipped: bool,
    /// The loss scale the step ran with, when loss scaling is on.
    #[serde(default)]
    pub loss_scale: Option<f32>,
    /// Under data parallelism: each rank's forward + backward milliseconds, by rank (a
    /// straggler shows as one large entry). `samples` and `loss` are then over all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_compute_ms: Option<Vec<f64>>,
    /// Under data parallelism: milliseconds this rank spent reducing the step's gradients
    /// (host copies, the all-reduce and waiting for the slowest rank), part of `compute_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_ms: Option<f64>,
}

/// The micro-batch was halved after a memory watermark crossing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BatchAdaptedEvent {
    /// Global optimizer step after which it changed.
    pub step: u64,
    /// The new micro-batch size.
    pub micro_batch: usize,
    /// The new number of accumulation steps.
    pub grad_accum_steps: usize,
    /// Their product: unchanged by the adaptation.
    pub effective_batch: usize,
}

/// Resident memory crossed the configured watermark.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WatermarkEvent {
    /// Global optimizer step after which it was seen.
    pub step: u64,
    /// Memory in use, bytes ([`crate::observe::memory::in_use_reading`]: the step's heap
    /// peak where the heap is counted, resident memory otherwise).
    pub in_use_bytes: u64,
    /// The watermark, bytes.
    pub threshold_bytes: u64,
}

/// The end of an epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochSummary {
    /// Epoch (0-based).
    pub epoch: usize,
    /// Mean training loss over the epoch.
    pub train_loss: f32,
    /// Test accuracy in [0, 1], if evaluated this epoch.
    pub test_accuracy: Option<f64>,
    /// Mean test loss, if evaluated.
    pub test_loss: Option<f32>,
    /// Every evaluation metric by name (`loss`, `accuracy`, `mse`, the caller's own), if
    /// evaluated this epoch.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub test_metrics: std::collections::BTreeMap<String, f64>,
    /// Wall time of the epoch, seconds.
    pub seconds: f64,
}

/// The end of a run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunSummary {
    /// Model name.
    pub model: String,
    /// Optimizer steps taken in total (including those before a resume).
    pub steps: u64,
    /// Epochs completed.
    pub epochs: usize,
    /// Final test accuracy in [0, 1], if evaluated.
    pub test_accuracy: Option<f64>,
    /// Every final evaluation metric by name, if evaluated.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub test_metrics: std::collections::BTreeMap<String, f64>,
    /// Final mean training loss (last epoch).
    pub train_loss: f32,
    /// Training throughput of this process, samples per second of step time.
    pub samples_per_s: f64,
    /// Share of step time spent waiting for data, in [0, 1].
    pub data_wait_share: f64,
    /// Wall time of this process's training, seconds.
    pub wall_seconds: f64,
    /// Peak resident set size, bytes.
    pub peak_rss_bytes: Option<u64>,
    /// The last checkpoint written, if any.
    pub last_checkpoint: Option<String>,
    /// Every stability-guard event of this process, in order.
    pub guard_events: Vec<GuardEvent>,
    /// Milliseconds of this process's first step: on a GPU, with its kernel compilation (a
    /// cold kernel cache) or without (a warm one). `None` when no step ran.
    #[serde(default)]
    pub first_step_ms: Option<f64>,
    /// Samples left out of their batches over the whole run (`data.on_bad_sample =
    /// "skip"`), counted once per epoch that met them.
    #[serde(default)]
    pub skipped_samples: u64,
}

/// Everything a run reports.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The run starts; `plan` is the resolved plan as JSON when one exists.
    RunStarted {
        /// Model name.
        model: String,
        /// Training samples.
        train_samples: usize,
        /// Optimizer steps the run will take in total.
        total_steps: u64,
        /// Step the run starts at (non-zero after a resume).
        start_step: u64,
        /// The resolved plan.
        plan: Option<serde_json::Value>,
    },
    /// An optimizer step finished.
    Step(StepEvent),
    /// An epoch finished.
    EpochEnd(EpochSummary),
    /// The stability guard saw a non-finite value and acted.
    Guard(GuardEvent),
    /// A checkpoint was written atomically.
    Checkpoint {
        /// Global step it captures.
        step: u64,
        /// Where.
        path: String,
        /// Size in bytes.
        bytes: u64,
    },
    /// Resident memory crossed the watermark (`observe.memory_watermark_mib`); the tuner's
    /// OOM-adaptive batching listens for it.
    MemoryWatermark(WatermarkEvent),
    /// OOM-adaptive batching changed the micro-batch (effective batch kept).
    BatchAdapted(BatchAdaptedEvent),
    /// Samples that could not be read or decoded were left out of their batches
    /// (`data.on_bad_sample = "skip"`); reported at the end of the epoch that met them.
    SamplesSkipped {
        /// The epoch.
        epoch: usize,
        /// Each sample left out, in the order the loader met them.
        samples: Vec<SkippedSample>,
    },
    /// The run finished.
    RunFinished(RunSummary),
}

/// A sample the loader left out of its batch because it could not be produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedSample {
    /// Its index in the dataset.
    pub index: usize,
    /// Its file (or shard member) name.
    pub name: String,
    /// Why: the decoder's or the file system's words.
    pub reason: String,
}
