//! Choosing the loader's worker count by measurement.
//!
//! The right count depends on how expensive a sample is to produce *and* how fast the model
//! consumes batches on this machine — and on a small CPU the workers compete with the compute
//! threads, so "more" is not free. So each candidate is tried for real: a few steps of the
//! caller's own step function fed by a loader with that many workers, timing how long the
//! step waited for data. The smallest count that keeps the wait under the target share of step
//! time wins; if none does, the one with the least wait.

use std::time::Instant;

use burn::tensor::Device;
use serde::Serialize;

use super::loader::{DataLoader, LoaderOptions};
use super::source::BatchSource;
use crate::error::Result;

/// The data-wait share of step time a worker count must stay under to be chosen.
pub const TARGET_WAIT_SHARE: f64 = 0.05;

/// One measured candidate.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerTrial {
    /// Worker threads.
    pub workers: usize,
    /// Steps timed (after one warm-up step).
    pub steps: usize,
    /// Mean wall time per step, data wait included, in ms.
    pub step_ms: f64,
    /// Mean time per step blocked waiting for data, in ms.
    pub wait_ms: f64,
    /// `wait_ms / step_ms`.
    pub wait_share: f64,
}

/// The outcome of [`choose_workers`].
#[derive(Debug, Clone, Serialize)]
pub struct WorkerChoice {
    /// The chosen worker count.
    pub workers: usize,
    /// Every candidate measured, in order.
    pub trials: Vec<WorkerTrial>,
    /// One sentence: why this count.
    pub reason: String,
}

/// Measures worker counts `0..=max_workers` (stopping at the first that meets
/// [`TARGET_WAIT_SHARE`]) with `steps` timed calls of `step` each, and picks one.
pub fn choose_workers<T: Send>(
    source: &dyn BatchSource<Batch = T>,
    device: &Device,
    base: &LoaderOptions,
    max_workers: usize,
    steps: usize,
    step: &mut dyn FnMut(T) -> Result<()>,
) -> Result<WorkerChoice> {
    let steps = steps.max(1);
    let mut trials = Vec::new();
    for workers in 0..=max_workers {
        let options = LoaderOptions {
            workers,
            ..base.clone()
        };
        let trial = DataLoader::run_source(source, device, options, |loader| {
            let mut wait = 0f64;
            let mut measured = 0usize;
            let mut start = Instant::now();
            let mut epoch = 0;
            // Warm-up step (thread start, first fill of the prefetch window) is not timed.
            let mut warm = false;
            while measured < steps {
                let mut batches = loader.epoch(epoch, 0);
                loop {
                    let t = Instant::now();
                    let Some(batch) = batches.next() else { break };
                    let waited = t.elapsed().as_secs_f64();
                    step(batch?)?;
                    if !warm {
                        warm = true;
                        start = Instant::now();
                        continue;
                    }
                    wait += waited;
                    measured += 1;
                    if measured == steps {
                        break;
                    }
                }
                epoch += 1;
            }
            let total = start.elapsed().as_secs_f64();
            Ok::<_, crate::error::KilnError>(WorkerTrial {
                workers,
                steps: measured,
                step_ms: total * 1e3 / measured as f64,
                wait_ms: wait * 1e3 / measured as f64,
                wait_share: if total > 0.0 { wait / total } else { 0.0 },
            })
        })??;
        tracing::debug!(?trial, "worker trial");
        let good = trial.wait_share < TARGET_WAIT_SHARE;
        trials.push(trial);
        if good {
            break;
        }
    }
    let chosen = trials
        .iter()
        .find(|t| t.wait_share < TARGET_WAIT_SHARE)
        .or_else(|| {
            trials
                .iter()
                .min_by(|a, b| a.wait_share.total_cmp(&b.wait_share))
        })
        .cloned();
    let Some(chosen) = chosen else {
        return Ok(WorkerChoice {
            workers: 0,
            trials,
            reason: "nothing measured".into(),
        });
    };
    let reason = if chosen.wait_share < TARGET_WAIT_SHARE {
        format!(
            "{} worker(s): data wait {:.1}% of a {:.1} ms step (target < {:.0}%), the fewest \
             that meet it",
            chosen.workers,
            chosen.wait_share * 100.0,
            chosen.step_ms,
            TARGET_WAIT_SHARE * 100.0
        )
    } else {
        format!(
            "{} worker(s): least data wait measured ({:.1}% of a {:.1} ms step); no count up to \
             {max_workers} met the {:.0}% target — the data side is the bottleneck (cache the \
             preprocessing or simplify the transform)",
            chosen.workers,
            chosen.wait_share * 100.0,
            chosen.step_ms,
            TARGET_WAIT_SHARE * 100.0
        )
    };
    Ok(WorkerChoice {
        workers: chosen.workers,
        trials,
        reason,
    })
}
