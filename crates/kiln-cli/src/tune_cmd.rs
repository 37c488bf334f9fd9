//! `kiln tune batch`: the largest batch that fits a memory budget (and the fastest one), each
//! trial a few real training steps in its own child process — its peak RSS is its own, and an
//! out-of-memory death is a failed trial, never a crash of the search.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::tensor::Device;
use kiln::Trainer;
use kiln::burn;
use kiln::data::SyntheticDataset;
use kiln::observe::{MemorySink, memory};
use kiln::train::TrainOptions;
use kiln::tune::{SearchMode, SearchOptions, TrialOutcome, search};
use kiln::zoo::ModelKind;

use crate::TuneBatchArgs;

/// Untimed steps before the timed ones in a trial.
const WARMUP: u64 = 2;

pub fn run(args: TuneBatchArgs) -> Result<()> {
    // One road: the trials train with the plan `kiln train` would resolve from the same
    // config and flags; only the batch size varies.
    let plan = args.config.resolve()?;
    plan.apply_runtime_for_training();
    let (model, threads) = (plan.model, plan.threads);
    if let Some(batch) = args.trial {
        return trial(model, &plan.train, batch, args.steps, plan.backend.device());
    }
    // The budget: --memory-budget / device.memory_budget_mib, else the device's memory (the
    // GPU's on cuda, where a trial reports its device pool's peak).
    let (budget, _) = plan
        .memory_limit()
        .context("this system does not report its memory size: pass --memory-budget (e.g. 8GiB)")?;
    let options = SearchOptions {
        budget,
        margin: args.margin,
        mode: SearchMode::from_name(&args.mode)?,
        start: args.start,
        max_batch: args.max_batch,
    };
    let exe = std::env::current_exe().context("locating the kiln binary")?;
    let result = search(&options, |batch| {
        if !args.json {
            eprintln!("kiln tune batch: trying batch {batch} ...");
        }
        run_child(&exe, batch)
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
        return Ok(());
    }
    println!(
        "memory budget {} (limit {} after a {:.0}% margin), model {} ({}), {threads} threads",
        memory::human_bytes(options.budget),
        memory::human_bytes(result.limit),
        options.margin * 100.0,
        model.name(),
        model.workload()
    );
    println!(
        "{:>7}  {:>10}  {:>12}  verdict",
        "batch", "peak RSS", "samples/s"
    );
    for t in &result.trials {
        println!(
            "{:>7}  {:>10}  {:>12}  {}",
            t.batch,
            t.outcome.peak_bytes.map_or("-".into(), memory::human_bytes),
            t.outcome
                .samples_per_s
                .map_or("-".into(), |s| format!("{s:.0}")),
            t.reason
        );
    }
    println!(
        "largest safe batch: {}; fastest: {} ({:.0} samples/s)",
        result.largest_safe, result.fastest, result.fastest_samples_per_s
    );
    Ok(())
}

/// Runs one trial in a child process: this same command line (so the same config, level
/// and flags) plus `--trial BATCH`.
fn run_child(exe: &std::path::Path, batch: usize) -> TrialOutcome {
    let failed = |error: String| TrialOutcome {
        peak_bytes: None,
        samples_per_s: None,
        error: Some(error),
    };
    let out = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .args(["--trial", &batch.to_string()])
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => return failed(format!("cannot start the trial: {e}")),
    };
    if !out.status.success() {
        let tail: String = String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .take(2)
            .collect::<Vec<_>>()
            .join(" / ");
        let why = match out.status.signal() {
            Some(9) => "killed by SIGKILL (the kernel's out-of-memory killer?)".to_string(),
            Some(6) => "aborted (allocation failure: out of memory?)".to_string(),
            Some(sig) => format!("killed by signal {sig}"),
            None => format!("exit status {}", out.status.code().unwrap_or(-1)),
        };
        return failed(format!("{why}: {tail}"));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    match serde_json::from_str::<serde_json::Value>(line.trim()) {
        Ok(v) => TrialOutcome {
            peak_bytes: v["peak_bytes"].as_u64(),
            samples_per_s: v["samples_per_s"].as_f64(),
            error: None,
        },
        Err(e) => failed(format!("unreadable trial output {line:?}: {e}")),
    }
}

/// Child side: `steps` timed training steps at `batch` with the plan's options on `device`,
/// on synthetic data of the model's shape; prints one JSON line with the peak memory (on a
/// GPU what its pool reserved, which keeps the run's largest need; else the peak RSS) and
/// the throughput.
fn trial(
    model: ModelKind,
    base: &TrainOptions,
    batch: usize,
    steps: u64,
    device: Device,
) -> Result<()> {
    let (_, shape) = model.bench_shape();
    let total = WARMUP + steps.max(1);
    let data = SyntheticDataset::new(batch * total as usize, shape, 10, 7);
    let mut sink = MemorySink::default();
    Trainer::new(
        TrainOptions {
            batch_size: batch,
            grad_accum_steps: 1,
            max_steps: Some(total),
            epochs: 1000,
            eval_every_epochs: 0,
            workers: Some(0),
            checkpoint_dir: None,
            checkpoint_every_steps: None,
            // The trial measures what this batch needs: adapting it would hide the answer.
            memory_watermark: None,
            oom_adaptive: false,
            ..base.clone()
        },
        device.clone(),
        &mut sink,
    )
    .fit(model.name(), |d| model.init(d), &data, None)?;
    let timed: Vec<f64> = sink
        .steps()
        .filter(|s| s.step > WARMUP)
        .map(|s| s.step_ms)
        .collect();
    if timed.is_empty() {
        bail!("the trial ran no timed steps");
    }
    let ms = timed.iter().sum::<f64>() / timed.len() as f64;
    println!(
        "{}",
        serde_json::json!({
            "batch": batch,
            "peak_bytes": memory::device_reserved_bytes(&device).or_else(memory::peak_rss_bytes),
            "samples_per_s": batch as f64 / (ms / 1e3),
        })
    );
    Ok(())
}
