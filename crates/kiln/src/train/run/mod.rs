//! One training run's state and its loop, split by phase: a [`Run`] holds everything that
//! changes during the run (position, scaler, guard, snapshot, micro-batch, counters) and its
//! small step methods live in files of their own:
//! - `accumulate.rs`: the micro-batches of one optimizer step → accumulated gradients;
//! - `update.rs`: on the device: unscale, the guard's verdict, clipping, the optimizer step
//!   (applied or skipped by a select), the loss scale;
//! - `after_step.rs`: position, the queued step event, the memory watermark and batch
//!   halving;
//! - `sync.rs`: the sync points, where the queued steps are read in one transfer and the
//!   host catches up (events, the guard's policy and rollback, the host's scaler);
//! - `epoch_end.rs`: evaluation, the epoch summary and checkpoints.
//!
//! The model and optimizer are threaded through by value (Burn's optimizer step consumes the
//! model and returns the updated one).

mod accumulate;
mod after_step;
mod epoch_end;
mod reduce;
mod sync;
mod update;

use std::path::PathBuf;
use std::time::Instant;

use burn::optim::ModuleOptimizer;
use burn::tensor::Device;

use super::contract::TrainStep;
use super::restore::Snapshot;
use super::{Evaluation, Trainer};
use crate::data::{BatchSource, DataLoader, Shard};
use crate::error::{KilnError, Result};
use crate::guard::Guard;
use crate::observe::{EpochSummary, Event, RunSummary, Watermark, memory};
use crate::precision::{DeviceScaler, LossScaler};

/// Where the loop stands.
#[derive(Debug, Default, Clone)]
pub(super) struct Position {
    pub epoch: usize,
    pub step_in_epoch: usize,
    pub global_step: u64,
    pub epoch_loss_sum: f64,
    pub epoch_samples: u64,
}

impl Position {
    /// Mean training loss over the epoch's clean steps so far.
    pub fn epoch_mean_loss(&self) -> f32 {
        (self.epoch_loss_sum / self.epoch_samples.max(1) as f64) as f32
    }
}

/// Time and samples of this process's steps.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Totals {
    pub step_seconds: f64,
    pub data_seconds: f64,
    pub samples: u64,
}

/// How an epoch ended.
enum EpochFlow {
    /// Every step ran.
    Completed,
    /// `max_steps` was reached inside it.
    Stopped,
}

/// Everything one run changes as it goes; see the module documentation.
pub(super) struct Run<'t, 's, 'd, B, M> {
    /// The trainer: its options, sink and evaluation settings.
    pub trainer: &'t mut Trainer<'s>,
    pub model_name: String,
    pub valid: Option<&'d dyn BatchSource<Batch = B>>,
    /// Training samples.
    pub n: usize,
    pub steps_per_epoch: usize,
    /// Steps of the planned epochs (the schedule's horizon).
    pub planned: u64,
    /// Steps this run stops at (`max_steps` or `planned`).
    pub total_steps: u64,
    pub pos: Position,
    /// The host's copy of the loss scaler, level with the device's at each sync point.
    pub scaler: LossScaler,
    /// The loss scaler on the device (`None` without scaling): the step scales by it and
    /// updates it without a read.
    pub device_scaler: Option<DeviceScaler>,
    /// Steps whose device values are not read yet.
    pub pending: Vec<sync::PendingStep>,
    /// Steps between sync points (`train.sync_every`, resolved).
    pub sync_every: usize,
    /// Module paths of the model's parameters, in the order of the gradient probes.
    pub param_paths: Vec<String>,
    pub guard: Guard,
    pub snapshot: Option<Snapshot<M>>,
    /// The micro-batch and accumulation the loop runs with: OOM-adaptive batching halves the
    /// one and doubles the other, keeping the effective batch.
    pub micro_batch: usize,
    pub accum_steps: usize,
    pub watermark: Option<Watermark>,
    pub totals: Totals,
    /// This process's first step, ms (kernel compilation included on a GPU).
    pub first_step_ms: Option<f64>,
    pub epochs_done: Vec<EpochSummary>,
    pub last_checkpoint: Option<PathBuf>,
    pub last_eval: Option<Evaluation>,
    pub last_train_loss: f32,
    /// Samples the loader left out as unreadable, over the run.
    pub skipped_samples: u64,
    /// Under data parallelism, the model's BatchNorm layers, checked to have synchronized
    /// their statistics after this rank's first micro-batch (then emptied).
    pub batch_norms: Vec<crate::distributed::batch_norm::BatchNormLayer>,
}

impl<'t, 's, 'd, B: Send, M: TrainStep<B> + 'static> Run<'t, 's, 'd, B, M> {
    /// The device models train on.
    pub fn device(&self) -> Device {
        self.trainer.training_device()
    }

    /// This rank's share of each batch.
    fn shard(&self) -> Shard {
        let c = &self.trainer.collective;
        Shard {
            rank: c.rank(),
            world: c.size(),
        }
    }

    /// Every remaining epoch, fed by `loader`; returns the trained model and optimizer.
    pub fn train_epochs(
        &mut self,
        loader: &mut DataLoader<'_, B>,
        mut model: M,
        mut optim: ModuleOptimizer,
    ) -> Result<(M, ModuleOptimizer)> {
        for epoch in self.pos.epoch..self.trainer.options.epochs {
            let epoch_start = Instant::now();
            let flow;
            (model, optim, flow) = self.epoch(loader, epoch, model, optim)?;
            // The epoch's last steps: read before its summary, evaluation and checkpoint.
            (model, optim) = self.sync(model, optim)?;
            let skipped = loader.take_skipped();
            if !skipped.is_empty() {
                self.skipped_samples += skipped.len() as u64;
                self.trainer.emit(&Event::SamplesSkipped {
                    epoch,
                    samples: skipped,
                });
            }
            if let EpochFlow::Stopped = flow {
                // Stopped early by max_steps: leave a checkpoint to continue from.
                self.last_train_loss = self.pos.epoch_mean_loss();
                self.last_checkpoint = self.checkpoint(&model, &optim)?;
                break;
            }
            self.end_epoch(&model, &optim, epoch, epoch_start)?;
        }
        Ok((model, optim))
    }

    /// The steps of `epoch` from the current position. `pos` is at the start of this epoch
    /// or, after a resume, inside it. An OOM-adaptive halving restarts the epoch's batches at
    /// the same sample position with the new micro-batch size.
    fn epoch(
        &mut self,
        loader: &mut DataLoader<'_, B>,
        epoch: usize,
        mut model: M,
        mut optim: ModuleOptimizer,
    ) -> Result<(M, ModuleOptimizer, EpochFlow)> {
        let shard = self.shard();
        loop {
            // Micro-batches are global: each rank loads its part of each (see `Shard`).
            // The epoch's positions: its samples, less a dropped or plus a padded last batch.
            let n = self
                .trainer
                .options
                .last_batch
                .epoch_len(self.n, self.micro_batch * shard.world);
            let micro_per_epoch = shard.global_batches(n, self.micro_batch);
            loader.set_batch_size(self.micro_batch);
            loader.set_shard(shard);
            let mut batches = loader.epoch(epoch, self.pos.step_in_epoch * self.accum_steps);
            let mut adapted = false;
            for s in self.pos.step_in_epoch..self.steps_per_epoch {
                if self.pos.global_step >= self.total_steps {
                    return Ok((model, optim, EpochFlow::Stopped));
                }
                let (micro, accum) = (self.micro_batch, self.accum_steps);
                let micros = s * accum..((s + 1) * accum).min(micro_per_epoch);
                // This rank's samples per micro-batch, and the step's samples on all ranks.
                let sizes: Vec<usize> = micros
                    .clone()
                    .map(|m| shard.range(n, micro, m).len())
                    .collect();
                let step_samples: usize = micros
                    .map(|m| Shard::WHOLE.range(n, micro * shard.world, m).len())
                    .sum();
                let t0 = Instant::now();
                // Spans around every phase: free without a subscriber, the profiler's trace
                // and table with one (`kiln profile`).
                let step_span =
                    tracing::info_span!("step", step = self.pos.global_step + 1).entered();
                let mut acc = self.accumulate(&model, &mut batches, &sizes, step_samples)?;
                self.reduce(&model, &mut acc)?;
                let (record, lr);
                (model, optim, record, lr) = self.guard_and_step(model, optim, &mut acc)?;
                (model, optim, adapted) =
                    self.after_step(model, optim, epoch, s, &acc, (record, lr), t0)?;
                drop(step_span);
                if adapted {
                    break;
                }
            }
            // Release the epoch's prefetch window before evaluating.
            drop(batches);
            if !adapted {
                return Ok((model, optim, EpochFlow::Completed));
            }
        }
    }

    /// The run summary (also emitted), after a final evaluation if none ran yet.
    pub fn finish(&mut self, model: &M, wall: Instant) -> Result<RunSummary> {
        if self.last_eval.is_none()
            && let Some(valid) = self.valid
        {
            self.last_eval = Some(self.trainer.evaluate_on(model, valid)?);
        }
        let t = self.totals;
        let summary = RunSummary {
            model: self.model_name.clone(),
            steps: self.pos.global_step,
            epochs: self.pos.epoch.min(self.trainer.options.epochs),
            test_accuracy: self.last_eval.as_ref().and_then(|e| e.accuracy),
            test_metrics: self
                .last_eval
                .as_ref()
                .map(|e| e.metrics.clone())
                .unwrap_or_default(),
            train_loss: self.last_train_loss,
            samples_per_s: t.samples as f64 / t.step_seconds.max(1e-9),
            data_wait_share: t.data_seconds / t.step_seconds.max(1e-9),
            wall_seconds: wall.elapsed().as_secs_f64(),
            peak_rss_bytes: memory::peak_rss_bytes(),
            last_checkpoint: self
                .last_checkpoint
                .as_ref()
                .map(|p| p.display().to_string()),
            guard_events: self.guard.events.clone(),
            first_step_ms: self.first_step_ms,
            skipped_samples: self.skipped_samples,
        };
        self.trainer.emit(&Event::RunFinished(summary.clone()));
        Ok(summary)
    }
}

/// The error for a loss that is not a scalar.
pub(super) fn loss_not_scalar(dims: &[usize]) -> KilnError {
    KilnError::Shape(format!(
        "the training step returned a loss of shape {dims:?}, not a scalar; reduce it (e.g. \
         `.mean()`) so that it has shape [1]"
    ))
}
