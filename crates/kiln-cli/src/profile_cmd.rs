//! `kiln profile`: N training steps under the profiler layer → `trace.json` (Chrome Trace
//! Event Format: ui.perfetto.dev, chrome://tracing), a table of phases by time and memory, and
//! optionally the profiler's overhead measured against the same steps without it. With
//! `--onnx`, the same for inference runs of an ONNX file, one row per operator kind.

use anyhow::{Context, Result};
use kiln::Trainer;
use kiln::datasets::{self, Split};
use kiln::observe::{MemorySink, Profiler, phase_table, render_table};
use kiln::tune::{RunContext, StepSplit, diagnose};
use tracing_subscriber::layer::SubscriberExt;

use crate::ProfileArgs;
use crate::onnx_bench::{input_shapes, make_inputs};

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
        .steps()
        .filter(|s| s.step > WARMUP_STEPS)
        .map(|s| s.step_ms)
        .collect();
    Ok(times.iter().sum::<f64>() / times.len().max(1) as f64)
}

pub fn run(args: ProfileArgs) -> Result<()> {
    let plan = args.config.resolve()?;
    plan.apply_runtime_for_training();
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
    let table = phase_table(&spans);
    let verdict = StepSplit::from_phases(&table).map(|split| {
        diagnose(
            &split,
            &RunContext {
                workers: plan.train.workers.unwrap_or(0),
                cores: plan.hardware.cores,
                batch_size: plan.train.batch_size,
                gpu: plan.backend != kiln::plan::Backend::Flex,
            },
        )
    });
    let suffix = verdict
        .as_ref()
        .map(|v| format!("\nverdict: {}\nnext: {}\n", v.summary, v.action));
    kiln::fsutil::write_atomic(
        &args.out.join("verdict.json"),
        serde_json::to_string_pretty(&verdict)?.as_bytes(),
    )?;
    let json = serde_json::json!({"phases": table, "verdict": verdict});
    publish(
        &args.out,
        &spans,
        suffix.as_deref(),
        args.json.then_some(json),
    )?;
    if args.overhead {
        report_overhead(&plan, args.steps, &spans)?;
    }
    Ok(())
}

/// The profiler's cost two ways: end to end (the same steps with and without the layer,
/// alternated 4 times so drift hits both; the median of the pairwise ratios) and bottom-up
/// (the measured cost of one recorded span times the spans per step, which is far below the
/// machine's run-to-run noise and so the figure to trust when the two disagree).
fn report_overhead(
    plan: &kiln::plan::Plan,
    steps: u64,
    spans: &[kiln::observe::SpanRecord],
) -> Result<()> {
    let mut ratios = Vec::new();
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let a = run_steps(plan, steps, None)?;
        let b = run_steps(plan, steps, Some(&Profiler::new()))?;
        off.push(a);
        on.push(b);
        ratios.push(b / a);
    }
    ratios.sort_by(f64::total_cmp);
    let median = (ratios[1] + ratios[2]) / 2.0;
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "end to end: ms/step without [{}], with [{}]; median ratio {:+.2}%",
        fmt(&off),
        fmt(&on),
        100.0 * (median - 1.0)
    );
    // Bottom-up: N empty spans with the layer installed vs without.
    const N: u32 = 20_000;
    let empty = || {
        let t = std::time::Instant::now();
        for i in 0..N {
            let _s = tracing::info_span!("probe", i).entered();
        }
        t.elapsed().as_secs_f64() * 1e6 / N as f64
    };
    let without = empty();
    let profiler = Profiler::new();
    let with = tracing::subscriber::with_default(
        tracing_subscriber::registry().with(profiler.layer()),
        empty,
    );
    let per_span = (with - without).max(0.0);
    let n_steps = spans.iter().filter(|s| s.name == "step").count().max(1);
    let spans_per_step = spans.len() as f64 / n_steps as f64;
    let step_us = off.iter().sum::<f64>() / off.len() as f64 * 1e3;
    println!(
        "bottom up: {per_span:.2} us per recorded span x {spans_per_step:.1} spans per step = \
         {:.1} us per {:.1} ms step = {:.3}%",
        per_span * spans_per_step,
        step_us / 1e3,
        100.0 * per_span * spans_per_step / step_us
    );
    // Profiler off: what every run pays for the spans left in the code. Kernel and node
    // spans are TRACE, which no subscriber of a normal run wants, so each costs its
    // callsite's cached interest check; measured with fields like a kernel span's.
    let disabled = {
        let t = std::time::Instant::now();
        for i in 0..N {
            let _s =
                tracing::trace_span!("kiln.conv2d", input = ?[i as usize, 1, 28, 28], flops = i)
                    .entered();
        }
        t.elapsed().as_secs_f64() * 1e9 / N as f64
    };
    println!(
        "profiler off: {disabled:.1} ns per span x {spans_per_step:.1} spans per step = \
         {:.2} us per {:.1} ms step = {:.5}%",
        disabled * spans_per_step / 1e3,
        step_us / 1e3,
        100.0 * disabled * spans_per_step / 1e3 / step_us
    );
    Ok(())
}

/// What `kiln profile --onnx` profiles.
pub struct OnnxProfile {
    /// The model file.
    pub path: std::path::PathBuf,
    /// Where it runs.
    pub device: kiln::burn::tensor::Device,
    /// Whether Kiln's kernels serve it (`device.kiln_kernels`).
    pub kiln_kernels: bool,
    /// Batch size of every input.
    pub batch: usize,
    /// Sizes of non-batch dynamic axes, per input.
    pub input_dims: std::collections::BTreeMap<String, Vec<usize>>,
    /// Passes applied after loading (`kiln optimize`'s), in order.
    pub passes: Vec<kiln::onnx::OnnxPass>,
    /// Profiled runs (after the untraced warm-up ones).
    pub runs: u64,
    /// Output directory.
    pub out: std::path::PathBuf,
    /// The table as JSON.
    pub json: bool,
}

/// Profiles `runs` inference runs of an ONNX model: every node is a span (`onnx.node` with
/// its operator), each run an `onnx.run` root, so the table gives time per operator kind
/// and its share of the run.
pub fn run_onnx(p: &OnnxProfile) -> Result<()> {
    let mut model = kiln::onnx::OnnxModel::load(&p.path, &p.device)
        .with_context(|| format!("loading {}", p.path.display()))?
        .with_kiln_kernels(p.kiln_kernels);
    for &pass in &p.passes {
        model.apply(pass)?;
    }
    let shapes = input_shapes(model.inputs(), p.batch, &p.input_dims)?;
    let inputs = make_inputs(model.inputs(), &shapes, &p.device)?;
    std::fs::create_dir_all(&p.out).with_context(|| format!("creating {}", p.out.display()))?;
    let run = || -> Result<()> {
        for out in model.run(inputs.clone())? {
            out.data()?;
        }
        Ok(())
    };
    for _ in 0..WARMUP_STEPS {
        run()?;
    }
    eprintln!(
        "kiln profile: {} at batch {}, {} runs after {WARMUP_STEPS} warm-up",
        model.name(),
        p.batch,
        p.runs
    );
    let profiler = Profiler::new();
    // On a pool thread, where a model's run hops to anyway: the subscriber is the thread's,
    // so it must be installed where the nodes run. The other workers spin meanwhile, as they
    // do through a run that hops (a run started on a pool thread does not hop, and the
    // profile would otherwise time every split's wake-up of a sleeping worker).
    let mut result = Ok(());
    rayon::scope(|_| {
        let subscriber = tracing_subscriber::registry().with(profiler.layer());
        result = tracing::subscriber::with_default(subscriber, || {
            kiln_kernels::base::spin::with_spinning_workers(|| {
                (0..p.runs).try_for_each(|i| {
                    let _run = tracing::info_span!("onnx.run", run = i).entered();
                    run()
                })
            })
        });
    });
    result?;
    let spans = profiler.spans();
    let json = serde_json::json!({ "phases": phase_table(&spans) });
    publish(&p.out, &spans, None, p.json.then_some(json))
}

/// Writes a profile's outputs into `out` — `trace.json`, `phases.txt` (the table, then
/// `suffix`), `phases.json` — and prints the table and where the trace is, or `json`
/// when given.
fn publish(
    out: &std::path::Path,
    spans: &[kiln::observe::SpanRecord],
    suffix: Option<&str>,
    json: Option<serde_json::Value>,
) -> Result<()> {
    let trace_path = out.join("trace.json");
    let trace = kiln::observe::profile::chrome_trace(spans);
    kiln::fsutil::write_atomic(&trace_path, serde_json::to_string(&trace)?.as_bytes())?;
    let table = phase_table(spans);
    let text = render_table(&table) + suffix.unwrap_or("");
    kiln::fsutil::write_atomic(&out.join("phases.txt"), text.as_bytes())?;
    kiln::fsutil::write_atomic(
        &out.join("phases.json"),
        serde_json::to_string_pretty(&table)?.as_bytes(),
    )?;
    match json {
        Some(json) => println!("{}", serde_json::to_string(&json)?),
        None => {
            print!("{text}");
            println!(
                "\ntrace: {} ({} spans; open in https://ui.perfetto.dev or chrome://tracing)",
                trace_path.display(),
                spans.len()
            );
        }
    }
    Ok(())
}
