//! What the examples share: a run that stops halfway, writes a checkpoint, and resumes from it
//! in a second trainer (as a preempted job would), its one-line report and convergence check,
//! and the seeded generator for the synthetic data.

use std::path::PathBuf;

use burn::tensor::Device;
use kiln::data::BatchSource;
use kiln::observe::MemorySink;
use kiln::train::{TrainOptions, TrainOutcome, TrainStep, Trainer, latest_checkpoint};

/// A finished run and the loss of every step, across the interruption.
pub struct Trained<M> {
    /// Mean training loss of every optimizer step, in order.
    pub losses: Vec<f32>,
    /// The resumed run's outcome (trained model, summary with the evaluation metrics).
    pub outcome: TrainOutcome<M>,
}

impl<M> Trained<M> {
    /// Mean loss of the first and of the last `k` steps.
    pub fn loss_drop(&self, k: usize) -> (f32, f32) {
        let k = k.min(self.losses.len()).max(1);
        let mean = |s: &[f32]| s.iter().sum::<f32>() / s.len() as f32;
        (
            mean(&self.losses[..k]),
            mean(&self.losses[self.losses.len() - k..]),
        )
    }

    /// The example's report: the loss over the first and last 5 steps and a held-out metric.
    pub fn summary(&self, metric: &str) -> String {
        let (first, last) = self.loss_drop(5);
        format!(
            "loss {first:.4} -> {last:.4}, held-out {metric} {:.4}",
            self.metric(metric)
        )
    }

    /// Asserts that the mean loss of the last 5 steps is below `ratio` × that of the first 5.
    pub fn assert_loss_fell(&self, ratio: f32) {
        let (first, last) = self.loss_drop(5);
        assert!(last < ratio * first, "loss {first} -> {last} did not fall");
    }

    /// An evaluation metric of the final model, by name.
    pub fn metric(&self, name: &str) -> f64 {
        self.outcome
            .summary
            .test_metrics
            .get(name)
            .copied()
            .unwrap_or(f64::NAN)
    }
}

/// Trains `init`'s model on `train` with `options`: first up to half the steps (leaving a
/// checkpoint), then a new trainer resumes from the latest checkpoint and finishes, evaluating
/// on `valid`.
pub fn train_with_resume<B: Send, M: TrainStep<B> + 'static>(
    name: &str,
    options: TrainOptions,
    init: impl Fn(&Device) -> M,
    train: &dyn BatchSource<Batch = B>,
    valid: &dyn BatchSource<Batch = B>,
) -> kiln::Result<Trained<M>> {
    let dir = scratch_dir(name);
    let options = TrainOptions {
        checkpoint_dir: Some(dir.clone()),
        ..options
    };
    let steps_per_epoch = train
        .len()
        .div_ceil(options.batch_size)
        .div_ceil(options.grad_accum_steps);
    let half = (options.epochs * steps_per_epoch / 2) as u64;

    let mut first = MemorySink::default();
    let stopped = TrainOptions {
        max_steps: Some(half),
        ..options.clone()
    };
    Trainer::new(stopped, Device::flex(), &mut first).fit_source(name, &init, train, None)?;

    let checkpoint = latest_checkpoint(&dir)?.ok_or_else(|| {
        kiln::KilnError::Inconsistent(format!("no checkpoint in {}", dir.display()))
    })?;
    let mut second = MemorySink::default();
    let outcome = Trainer::new(options, Device::flex(), &mut second)
        .resume_from(checkpoint)
        .fit_source(name, &init, train, Some(valid))?;
    let _ = std::fs::remove_dir_all(&dir);
    let losses = first
        .steps()
        .chain(second.steps())
        .map(|s| s.loss)
        .collect();
    Ok(Trained { losses, outcome })
}

/// A fresh directory for one run's checkpoints.
fn scratch_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "kiln-example-{name}-{}-{nanos}",
        std::process::id()
    ))
}

/// The seeded generator the synthetic data is drawn from.
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::SeedableRng::seed_from_u64(seed)
}
