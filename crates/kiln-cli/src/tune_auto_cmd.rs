//! `kiln tune auto`: the auto-optimizer on this machine, writing the winning plan as a
//! `kiln.toml`; with `--grid`, also the exhaustive grid over the same space, to measure how
//! close the tuner gets and at what share of the grid's time.

use std::time::Instant;

use anyhow::{Context, Result};
use kiln::data::{Dataset, SyntheticDataset};
use kiln::datasets::{Split, bundled};
use kiln::plan::autotune;
use kiln::train::TrainOptions;
use kiln::tune::auto::{AutotuneAb, Measured, auto_tune, grid_candidates, run_trial, to_toml};

use crate::TuneAutoArgs;
use crate::bench_cmd::Case;

pub fn run(args: TuneAutoArgs) -> Result<()> {
    // One road: the same config, level and flags as `kiln train` resolve the plan the
    // trials start from, and the written file keeps them.
    let config = args.config.to_config()?;
    let plan = kiln::plan::resolve(&config, &kiln::plan::Hardware::probe())?;
    plan.apply_runtime_for_training();
    let model = plan.model;
    let threads = plan.threads;
    let (default_batch, shape) = model.bench_shape();
    let user_set = |key: &str| config.user_value(key).is_some();
    let batch = args.batch.unwrap_or(
        if user_set("train.batch_size") || user_set("train.grad_accum_steps") {
            plan.train.batch_size * plan.train.grad_accum_steps
        } else {
            default_batch
        },
    );
    let data: Box<dyn Dataset> = if shape == [1, 28, 28] {
        Box::new(bundled(Split::Train)?)
    } else {
        Box::new(SyntheticDataset::new(batch * 16, shape, 10, 7))
    };
    let base: TrainOptions = plan.train.clone();
    let device = plan.backend.device();
    let steps = args.steps;
    let mut trial = |c: &kiln::tune::auto::Candidate| {
        if !args.json {
            eprintln!(
                "kiln tune auto: {} micro-batch {} x {}, checkpointing {}, {} worker(s) ...",
                c.precision.name(),
                c.micro_batch,
                c.grad_accum_steps,
                c.checkpointing,
                c.workers
            );
        }
        run_trial(model, &*data, &base, c, steps, &device)
    };
    let budget = match &args.time_budget {
        Some(t) => Some(parse_duration(t)?),
        None => None,
    };
    // On a GPU low precision can win and Kiln's CPU kernels do not apply; CubeCL's autotune
    // level is A/B'd there, each level in its own process.
    let gpu = plan.backend == kiln::plan::Backend::Cuda;
    let autotune = if gpu {
        autotune_ab(model, batch, threads, args.json)?
    } else {
        None
    };
    let mut report = auto_tune(batch, threads, gpu, budget, &mut trial)?;
    if !gpu {
        report
            .skipped
            .push("autotune level: Burn's autotune runs on CubeCL backends (cuda) only".into());
    }
    report.autotune = autotune;
    let toml = to_toml(&config, model, &report)?;
    kiln::fsutil::write_atomic(&args.out, toml.as_bytes())?;
    // The trials, next to the plan, for `kiln report`.
    let json_path = args.out.with_file_name("tune.json");
    kiln::fsutil::write_atomic(
        &json_path,
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;

    let grid = if args.grid {
        let start = Instant::now();
        let mut results: Vec<Measured> = Vec::new();
        for c in grid_candidates(batch, threads) {
            results.push(trial(&c)?);
        }
        let grid_secs = start.elapsed().as_secs_f64();
        let best = results
            .iter()
            .max_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s))
            .cloned();
        // The grid's maximum over many short trials is biased upward by noise: re-measure
        // the two winners back to back, alternating, and compare medians.
        let mut confirm = None;
        if let Some(g) = &best {
            let (mut t, mut gr) = (Vec::new(), Vec::new());
            for _ in 0..3 {
                t.push(trial(&report.best.candidate)?.samples_per_s);
                gr.push(trial(&g.candidate)?.samples_per_s);
            }
            t.sort_by(f64::total_cmp);
            gr.sort_by(f64::total_cmp);
            confirm = Some((t[1], gr[1]));
        }
        Some((best, results.len(), grid_secs, confirm))
    } else {
        None
    };
    if args.json {
        let grid_json = grid.as_ref().map(|(best, n, secs, confirm)| {
            serde_json::json!({
                "best": best, "trials": n, "seconds": secs,
                "confirm_samples_per_s": confirm.map(|(t, g)| serde_json::json!({"tuner": t, "grid": g})),
            })
        });
        println!(
            "{}",
            serde_json::json!({"report": report, "grid": grid_json, "toml": args.out})
        );
        return Ok(());
    }
    for d in &report.decisions {
        println!("{}", d.reason);
    }
    for s in &report.skipped {
        println!("skipped {s}");
    }
    if let Some(ab) = &report.autotune {
        println!("{}", ab.reason);
    }
    println!(
        "best: {:.0} samples/s ({:+.1}% vs f32 baseline) in {} trials, {:.1} s; plan written to {}",
        report.best.samples_per_s,
        100.0 * (report.best.samples_per_s / report.baseline.samples_per_s.max(1e-9) - 1.0),
        report.decisions.len(),
        report.seconds,
        args.out.display()
    );
    if let Some((Some(best), n, secs, confirm)) = grid {
        println!(
            "grid: best {:.0} samples/s ({:?}) in {n} trials, {secs:.1} s; the tuner took {:.1}% \
             of the grid's time",
            best.samples_per_s,
            best.candidate,
            100.0 * report.seconds / secs.max(1e-9)
        );
        if let Some((t, g)) = confirm {
            println!(
                "re-measured back to back (median of 3 each): tuner's plan {t:.0}, grid's plan \
                 {g:.0} samples/s: the tuner reached {:.1}% of the grid's best",
                100.0 * t / g.max(1e-9)
            );
        }
    }
    Ok(())
}

/// On a GPU: CubeCL's autotune levels A/B'd on this model's f32 training step, each level in
/// its own `kiln bench` process (CubeCL fixes the level once per process), CubeCL's default
/// first; the fastest is kept where it wins by the tuner's margin.
fn autotune_ab(
    model: kiln::zoo::ModelKind,
    batch: usize,
    threads: usize,
    quiet: bool,
) -> Result<Option<AutotuneAb>> {
    let exe = std::env::current_exe().context("locating the kiln binary")?;
    let mut measured = Vec::new();
    for level in [autotune::CUBECL_DEFAULT, "minimal", "extensive"] {
        if !quiet {
            eprintln!("kiln tune auto: autotune {level} (its own process) ...");
        }
        let case = Case {
            workload: model.workload(),
            mode: "precision",
            case: "f32",
            threads,
            batch: Some(batch),
            steps: None,
        };
        let result = case
            .run(&exe, &[(autotune::ENV, Some(level))])
            .with_context(|| format!("the autotune trial at {level}"))?;
        measured.push((level.to_string(), result.samples_per_s));
    }
    Ok(AutotuneAb::choose(measured))
}

/// Parses `90s`, `5m`, `1h` or a number of seconds.
fn parse_duration(text: &str) -> Result<std::time::Duration> {
    let t = text.trim();
    let (num, scale) = match t.chars().last() {
        Some('s') => (&t[..t.len() - 1], 1.0),
        Some('m') => (&t[..t.len() - 1], 60.0),
        Some('h') => (&t[..t.len() - 1], 3600.0),
        _ => (t, 1.0),
    };
    let value: f64 = num
        .trim()
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .ok_or_else(|| {
            anyhow::anyhow!("--time-budget {text:?}: expected a duration such as 90s, 5m or 1h")
        })?;
    Ok(std::time::Duration::from_secs_f64(value * scale))
}
