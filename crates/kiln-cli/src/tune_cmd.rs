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
use kiln::precision::Precision;
use kiln::train::TrainOptions;
use kiln::tune::{SearchMode, SearchOptions, TrialOutcome, parse_size, search};
use kiln::zoo::ModelKind;

use crate::TuneBatchArgs;

/// Untimed steps before the timed ones in a trial.
const WARMUP: u64 = 2;

pub fn run(args: TuneBatchArgs) -> Result<()> {
    let model = ModelKind::from_name(&args.model)?;
    let precision = Precision::from_name(&args.precision).with_context(|| {
        format!(
            "unknown precision `{}`: expected f32, bf16 or f16",
            args.precision
        )
    })?;
    let threads = if args.threads == 0 {
        kiln::plan::Hardware::probe().cores
    } else {
        args.threads
    };
    if let Some(batch) = args.trial {
        kiln::plan::set_cpu_threads(threads);
        return trial(model, precision, batch, args.steps);
    }
    let options = SearchOptions {
        budget: parse_size(&args.memory_budget)?,
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
        run_child(&exe, &args, batch, threads)
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

fn run_child(
    exe: &std::path::Path,
    args: &TuneBatchArgs,
    batch: usize,
    threads: usize,
) -> TrialOutcome {
    let failed = |error: String| TrialOutcome {
        peak_bytes: None,
        samples_per_s: None,
        error: Some(error),
    };
    let out = Command::new(exe)
        .args(["tune", "batch", "--model", &args.model])
        .args(["--precision", &args.precision])
        .args(["--steps", &args.steps.to_string()])
        .args(["--threads", &threads.to_string()])
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

/// Child side: `steps` timed training steps at `batch` on synthetic data of the model's shape;
/// prints one JSON line with the peak RSS and the throughput.
fn trial(model: ModelKind, precision: Precision, batch: usize, steps: u64) -> Result<()> {
    let (_, shape) = model.bench_shape();
    let total = WARMUP + steps.max(1);
    let data = SyntheticDataset::new(batch * total as usize, shape, 10, 7);
    let mut sink = MemorySink::default();
    Trainer::new(
        TrainOptions {
            batch_size: batch,
            max_steps: Some(total),
            eval_every_epochs: 0,
            workers: Some(0),
            precision,
            scaler: kiln::precision::ScalerOptions::default(),
            ..TrainOptions::default()
        },
        Device::flex(),
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
            "peak_bytes": memory::peak_rss_bytes(),
            "samples_per_s": batch as f64 / (ms / 1e3),
        })
    );
    Ok(())
}
