//! Benchmark: a user's W2 written with the drop-in `kiln::nn` layers and fed by a Burn
//! `Dataset` + `Batcher` (`common/user_w2.rs`) against the zoo's W2 on Kiln's own dataset, and
//! the same user model with Burn's own layers (before the one-line change), in one process,
//! alternating rounds, same batch, same threads. All three train through Kiln's trainer.
//!
//! `cargo run --release -p kiln --example w2_side_by_side [-- ROUNDS STEPS]`
//! Prints ms/step (median of the timed steps of each round, median over rounds) and the
//! ratio user ÷ zoo; BENCHMARKS.md records the figures.

#[path = "common/user_w2.rs"]
mod user_w2;

use burn::data::dataset::InMemDataset;
use burn::tensor::Device;
use kiln::data::{BatchSource, BurnBatches, ImageBatches};
use kiln::datasets::{Split, bundled};
use kiln::observe::MemorySink;
use kiln::train::{TrainOptions, TrainStep, Trainer};
use kiln::zoo::ModelKind;

/// Untimed steps at the start of each run (the bench protocol of `kiln bench`).
const WARMUP: u64 = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Trains `init`'s model on `source` with `options`; the median time of its timed steps.
fn step_ms<B: Send, M: TrainStep<B> + 'static>(
    options: &TrainOptions,
    name: &str,
    init: impl FnOnce(&Device) -> M,
    source: &dyn BatchSource<Batch = B>,
) -> kiln::Result<f64> {
    let mut sink = MemorySink::default();
    Trainer::new(options.clone(), Device::flex(), &mut sink)
        .fit_source(name, init, source, None)?;
    let timed = sink.steps().filter(|s| s.step > WARMUP).map(|s| s.step_ms);
    Ok(median(timed.collect()))
}

fn main() -> kiln::Result<()> {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let steps: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let threads = kiln::plan::Hardware::probe().cores;
    kiln::plan::set_cpu_threads(threads);
    let data = bundled(Split::Train)?;
    let images = ImageBatches::new(&data);
    let source = BurnBatches::new(
        InMemDataset::new(user_w2::digits(&data)),
        user_w2::DigitBatcher,
    );
    let options = TrainOptions {
        batch_size: 64,
        max_steps: Some(WARMUP + steps),
        workers: Some(0),
        eval_every_epochs: 0,
        ..TrainOptions::default()
    };
    let (mut zoo, mut user, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // The zoo's path: `Trainer::fit` is `fit_source` over Kiln's image batches.
        zoo.push(step_ms(
            &options,
            "cnn",
            |d| ModelKind::Cnn.init(d),
            &images,
        )?);
        user.push(step_ms(
            &options,
            "user-cnn",
            user_w2::UserCnn::new,
            &source,
        )?);
        plain.push(step_ms(
            &options,
            "burn-cnn",
            user_w2::BurnCnn::new,
            &source,
        )?);
        println!(
            "round {round}: zoo W2 {:.1} ms/step, user W2 with kiln::nn {:.1}, with burn::nn {:.1}",
            zoo[round], user[round], plain[round]
        );
    }
    let (z, u, p) = (median(zoo), median(user), median(plain));
    println!(
        "median over {rounds} rounds of {steps} steps, batch 64, {threads} threads: zoo {z:.1} ms, \
         user (kiln::nn) {u:.1} ms, user (burn::nn) {p:.1} ms; user kiln::nn / zoo {:.3}, \
         burn::nn / kiln::nn {:.2}x",
        u / z,
        p / u
    );
    Ok(())
}
