//! What the examples share: a run that stops halfway, writes a checkpoint, and resumes from it
//! in a second trainer (as a preempted job would), plus a seeded number generator for the
//! synthetic data.

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

/// A small seeded generator (SplitMix64) so the synthetic data is the same on every machine.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}
