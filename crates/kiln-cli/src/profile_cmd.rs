//! `kiln profile`: N training steps under the profiler layer → `trace.json` (Chrome Trace
//! Event Format: ui.perfetto.dev, chrome://tracing), a table of phases by time and memory, and
//! optionally the profiler's overhead measured against the same steps without it.

use anyhow::{Context, Result};
use kiln::Trainer;
use kiln::datasets::{self, Split};
use kiln::observe::{Event, MemorySink, Profiler, phase_table, render_table};
use tracing_subscriber::layer::SubscriberExt;

use crate::ProfileArgs;

/// Untraced steps before the profiled ones: thread start-up and allocator warm-up would
/// otherwise dominate a short profile.
const WARMUP_STEPS: u64 = 3;

/// Trains `steps` steps after the warm-up; returns the mean step time of the profiled ones.
fn run_steps(plan: &kiln::plan::Plan, steps: u64, profiler: Option<&Profiler>) -> Result<f64> {
    let train = match &plan.data_dir {
        Some(dir) => datasets::open_dir(dir)?.0,
        None => Box::new(datasets::bundled(Split::Train)?),
    };
    let mut options = plan.train.clone();
    options.max_steps = Some(WARMUP_STEPS + steps);
    options.eval_every_epochs = 0;
    options.checkpoint_dir = None;
    options.checkpoint_every_steps = None;
    // A fixed worker count: the auto probe would add its own spans and minutes to a profile.
    options.workers = Some(options.workers.unwrap_or(0));
    let mut sink = MemorySink::default();
    let model = plan.model;
    let fit = |sink: &mut MemorySink| {
        Trainer::new(options.clone(), plan.backend.device(), sink)
            .fit(model.name(), |d| model.init(d), &*train, None)
            .map(|_| ())
    };
    match profiler {
        Some(p) => {
            let subscriber = tracing_subscriber::registry().with(p.layer());
            tracing::subscriber::with_default(subscriber, || fit(&mut sink))?;
        }
        None => fit(&mut sink)?,
    }
    let times: Vec<f64> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) if s.step > WARMUP_STEPS => Some(s.step_ms),
            _ => None,
        })
        .collect();
    Ok(times.iter().sum::<f64>() / times.len().max(1) as f64)
}

pub fn run(args: ProfileArgs) -> Result<()> {
    let plan = args.config.resolve()?;
    plan.apply_runtime();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let profiler = Profiler::new();
    eprintln!(
        "kiln profile: {} ({}), {} steps after {WARMUP_STEPS} warm-up, batch {}",
        plan.model.name(),
        plan.model.workload(),
        args.steps,
        plan.train.batch_size
    );
    run_steps(&plan, args.steps, Some(&profiler))?;
    // Drop the warm-up steps (and everything inside them) from the trace and the table.
    let spans: Vec<_> = {
        let all = profiler.spans();
        let first = all
            .iter()
            .filter(|s| {
                s.name == "step"
                    && s.fields.iter().any(|(k, v)| {
                        k == "step" && v.parse::<u64>().is_ok_and(|n| n > WARMUP_STEPS)
                    })
            })
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        all.into_iter().filter(|s| s.start_us >= first).collect()
    };
    let trace_path = args.out.join("trace.json");
    let trace = kiln::observe::profile::chrome_trace(&spans);
    kiln::fsutil::write_atomic(&trace_path, serde_json::to_string(&trace)?.as_bytes())?;
    let table = phase_table(&spans);
    let text = render_table(&table);
    kiln::fsutil::write_atomic(&args.out.join("phases.txt"), text.as_bytes())?;
    kiln::fsutil::write_atomic(
        &args.out.join("phases.json"),
        serde_json::to_string_pretty(&table)?.as_bytes(),
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&table)?);
    } else {
        print!("{text}");
        println!(
            "\ntrace: {} ({} spans; open in https://ui.perfetto.dev or chrome://tracing)",
            trace_path.display(),
            spans.len()
        );
    }
    if args.overhead {
        // Alternate off/on twice: the machine's drift hits both equally.
        let mut off = Vec::new();
        let mut on = Vec::new();
        for _ in 0..2 {
            off.push(run_steps(&plan, args.steps, None)?);
            on.push(run_steps(&plan, args.steps, Some(&Profiler::new()))?);
        }
        let (off_ms, on_ms) = (
            off.iter().sum::<f64>() / off.len() as f64,
            on.iter().sum::<f64>() / on.len() as f64,
        );
        println!(
            "profiler overhead: {:.2} ms/step without, {:.2} ms/step with ({:+.2}%; runs off {:?}, on {:?})",
            off_ms,
            on_ms,
            100.0 * (on_ms / off_ms - 1.0),
            off.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>(),
            on.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>()
        );
    }
    Ok(())
}
