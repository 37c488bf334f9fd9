//! Putting a run back: resuming from a checkpoint and rolling back to an in-memory snapshot.

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;

use super::run::Position;
use super::{Checkpoint, TrainOptions};
use crate::error::{KilnError, Result};
use crate::precision::ScalerState;

/// A known-good model and optimizer state to roll back to.
pub(super) struct Snapshot<M> {
    pub model: M,
    pub optimizer: Vec<u8>,
    pub step: u64,
}

impl<M: Module> Snapshot<M> {
    /// Copies the model and serializes the optimizer state at `step`.
    pub fn take(model: &M, optim: &ModuleOptimizer, step: u64) -> Result<Self> {
        let optimizer = optim.into_bytes().map_err(|e| KilnError::Record {
            what: "optimizer snapshot",
            message: e.to_string(),
        })?;
        Ok(Snapshot {
            model: model.clone(),
            optimizer: optimizer.to_vec(),
            step,
        })
    }

    /// The snapshot's model and a fresh optimizer (built by `fresh`) holding its state.
    pub fn restore(&self, fresh: ModuleOptimizer) -> Result<(M, ModuleOptimizer)> {
        let optim = fresh
            .from_bytes(Bytes::from_bytes_vec(self.optimizer.clone()))
            .map_err(|e| KilnError::Record {
                what: "optimizer snapshot",
                message: e.to_string(),
            })?;
        Ok((self.model.clone(), optim))
    }
}

/// The trajectory settings as stored in checkpoints, with the data-parallel world size (it
/// sets the global batch). Checkpoints written before it was recorded lack it and are
/// accepted, as one process's.
pub(super) fn fingerprint(options: &TrainOptions, ranks: usize) -> Vec<(String, String)> {
    let mut f: Vec<(String, String)> = options
        .trajectory_fingerprint()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    f.push(("data_parallel.ranks".into(), ranks.to_string()));
    f
}

/// What a checkpoint gives back to continue from.
pub(super) struct Restored<M> {
    pub model: M,
    pub optim: ModuleOptimizer,
    pub position: Position,
    pub scaler: Option<ScalerState>,
}

/// Loads a checkpoint into a fresh model and optimizer, refusing one from another model or
/// another run's settings.
pub(super) fn restore<M: Module>(
    path: &std::path::Path,
    model: M,
    optim: ModuleOptimizer,
    model_name: &str,
    opts: &TrainOptions,
    ranks: usize,
) -> Result<Restored<M>> {
    let ckpt = Checkpoint::load(path)?;
    let bad = |problem: String| KilnError::BadCheckpoint {
        path: path.to_path_buf(),
        problem,
    };
    if ckpt.state.model != model_name {
        return Err(bad(format!(
            "it holds model `{}`, not `{model_name}`; pass --model {} (or the model name it \
             was trained under)",
            ckpt.state.model, ckpt.state.model
        )));
    }
    let ours = fingerprint(opts, ranks);
    let diffs: Vec<String> = ckpt
        .state
        .fingerprint
        .iter()
        .filter(|(k, v)| ours.iter().any(|(k2, v2)| k2 == k && v2 != v))
        .map(|(k, v)| {
            let now = ours.iter().find(|(k2, _)| k2 == k).map(|(_, v)| v.as_str());
            format!("{k} was {v}, now {}", now.unwrap_or("?"))
        })
        .collect();
    if !diffs.is_empty() {
        return Err(bad(format!(
            "it was written with other settings ({}); resume with the same settings or start a new run",
            diffs.join("; ")
        )));
    }
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(ckpt.model))
        .map_err(|e| bad(format!("unreadable model weights: {e}")))?;
    let model = model
        .try_load_record(record)
        .map_err(|e| bad(format!("weights do not fit model `{model_name}`: {e}")))?;
    let optim = optim
        .from_bytes(Bytes::from_bytes_vec(ckpt.optimizer))
        .map_err(|e| bad(format!("unreadable optimizer state: {e}")))?;
    Ok(Restored {
        model,
        optim,
        position: Position {
            epoch: ckpt.state.epoch,
            step_in_epoch: ckpt.state.step_in_epoch,
            global_step: ckpt.state.global_step,
            epoch_loss_sum: ckpt.state.epoch_loss_sum,
            epoch_samples: ckpt.state.epoch_samples,
        },
        scaler: ckpt.state.scaler,
    })
}
