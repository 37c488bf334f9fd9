//! The end of an epoch (evaluation, the epoch summary, a checkpoint) and checkpoints.

use std::path::PathBuf;
use std::time::Instant;

use burn::optim::ModuleOptimizer;

use super::{Position, Run};
use crate::distributed::check_replicas;
use crate::error::{KilnError, Result};
use crate::observe::{EpochSummary, Event};
use crate::train::contract::TrainStep;
use crate::train::restore::fingerprint;
use crate::train::{Checkpoint, CheckpointState, prune_checkpoints};

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Evaluates when due, reports the epoch and checkpoints at the next epoch's start.
    pub(super) fn end_epoch(
        &mut self,
        model: &M,
        optim: &ModuleOptimizer,
        epoch: usize,
        started: Instant,
    ) -> Result<()> {
        self.last_train_loss = self.pos.epoch_mean_loss();
        let is_last = epoch + 1 == self.trainer.options.epochs;
        let every = self.trainer.options.eval_every_epochs;
        let due = every > 0 && (epoch + 1).is_multiple_of(every);
        let eval = match self.valid {
            Some(v) if due || is_last => Some(self.trainer.evaluate_on(model, v)?),
            _ => None,
        };
        let summary = EpochSummary {
            epoch,
            train_loss: self.last_train_loss,
            test_accuracy: eval.as_ref().and_then(|e| e.accuracy),
            test_loss: eval.as_ref().map(|e| e.loss),
            test_metrics: eval.as_ref().map(|e| e.metrics.clone()).unwrap_or_default(),
            seconds: started.elapsed().as_secs_f64(),
        };
        if eval.is_some() {
            self.last_eval = eval;
        }
        self.trainer.emit(&Event::EpochEnd(summary.clone()));
        // A cheap guard against silent divergence of the replicas (one small all-reduce).
        publish_running_states(model);
        check_replicas(model, &*self.trainer.collective)?;
        self.epochs_done.push(summary);
        self.pos = Position {
            epoch: epoch + 1,
            step_in_epoch: 0,
            global_step: self.pos.global_step,
            epoch_loss_sum: 0.0,
            epoch_samples: 0,
        };
        let written = self.checkpoint(model, optim)?;
        self.last_checkpoint = written.or(self.last_checkpoint.take());
        Ok(())
    }

    /// Writes a checkpoint at the current position if a checkpoint directory is configured
    /// (atomically: temp file, fsync, rename; checksummed).
    pub(super) fn checkpoint(
        &mut self,
        model: &M,
        optim: &ModuleOptimizer,
    ) -> Result<Option<PathBuf>> {
        let Some(dir) = self.trainer.options.checkpoint_dir.clone() else {
            return Ok(None);
        };
        if self.trainer.rank() != 0 {
            // Rank 0 writes for everyone: the replicas are equal (checked at epoch ends).
            return Ok(None);
        }
        publish_running_states(model);
        let pos = &self.pos;
        let _s = tracing::info_span!("checkpoint", step = pos.global_step).entered();
        let record_err = |what| {
            move |e: burn::store::RecordError| KilnError::Record {
                what,
                message: e.to_string(),
            }
        };
        let model_bytes = model
            .clone()
            .into_record()
            .into_bytes()
            .map_err(record_err("model weights"))?;
        let optim_bytes = optim.into_bytes().map_err(record_err("optimizer state"))?;
        let ckpt = Checkpoint {
            state: CheckpointState {
                model: self.model_name.clone(),
                epoch: pos.epoch,
                step_in_epoch: pos.step_in_epoch,
                global_step: pos.global_step,
                fingerprint: fingerprint(&self.trainer.options, self.trainer.collective.size()),
                epoch_loss_sum: pos.epoch_loss_sum,
                epoch_samples: pos.epoch_samples,
                scaler: self.scaler.enabled().then(|| self.scaler.state()),
            },
            model: model_bytes.to_vec(),
            optimizer: optim_bytes.to_vec(),
        };
        let path = dir.join(Checkpoint::file_name(pos.global_step));
        let bytes = ckpt.save(&path)?;
        self.trainer.emit(&Event::Checkpoint {
            step: pos.global_step,
            path: path.display().to_string(),
            bytes,
        });
        // Only now that the new one is on disk (fsynced and renamed into place).
        let deleted = prune_checkpoints(&dir, self.trainer.options.keep_checkpoints)?;
        if !deleted.is_empty() {
            tracing::debug!(
                count = deleted.len(),
                "older checkpoints deleted (train.keep_checkpoints)"
            );
        }
        Ok(Some(path))
    }
}

/// Makes the latest update of every running state (BatchNorm's running statistics) visible to
/// visitors and records. Burn's `RunningState` keeps a thread's last update aside until it is
/// synced, which `valid()` does (evaluation calls it, and only rank 0 evaluates): without
/// this the replicas would compare — and a checkpoint would hold — values one update apart.
fn publish_running_states<M: burn::module::Module>(model: &M) {
    let _ = model.valid();
}
