//! `kiln bench`: plain Burn vs Kiln's plan at each level (or each precision policy, with
//! `--mode precision`), same shapes and protocol as the
//! peers (`../shared/peers/workloads.py`): 5 warm-up steps, 3 repeats of N timed steps,
//! median. Each case runs in its own child process so its peak RSS is its own.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Int, Tensor};
use kiln::burn;
use kiln::config::Level;
use kiln::data::SyntheticDataset;
use kiln::infer::{InferenceSession, Pass};
use kiln::observe::timing::{Timing, measure, summarize};
use kiln::observe::{MemorySink, memory};
use kiln::plan::{Backend, Hardware, resolve};
use kiln::precision::{Precision, autocast};
use kiln::train::TrainStep;
use kiln::zoo::{Classifier, ModelKind};
use kiln::{KilnConfig, Trainer};
use serde::{Deserialize, Serialize};

use crate::BenchArgs;
use crate::user_shaped::{MobileNetish, PreLnEncoder, USER_WORKLOADS, UserWorkload};

const WARMUP: usize = 5;
const REPEATS: usize = 3;
/// Distinct pre-generated batches cycled through, as the peers do.
const BATCHES: usize = 8;

/// One measured case.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaseResult {
    pub workload: String,
    pub mode: String,
    pub case: String,
    pub batch: usize,
    pub threads: usize,
    pub steps: usize,
    pub ms_per_step: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub spread: f64,
    pub samples_per_s: f64,
    pub peak_rss_bytes: Option<u64>,
    /// The process allocator the case ran with (plain Burn: the system's).
    pub allocator: String,
}

/// A workload id and what it runs.
#[derive(Debug, Clone, Copy)]
struct Workload {
    id: &'static str,
    model: ModelKind,
    infer: bool,
}

const WORKLOADS: [Workload; 5] = [
    Workload {
        id: "W1",
        model: ModelKind::Mlp,
        infer: false,
    },
    Workload {
        id: "W2",
        model: ModelKind::Cnn,
        infer: false,
    },
    Workload {
        id: "W3",
        model: ModelKind::Cnn,
        infer: true,
    },
    Workload {
        id: "W4",
        model: ModelKind::Transformer,
        infer: false,
    },
    Workload {
        id: "W5",
        model: ModelKind::ResNet,
        infer: false,
    },
];

/// Cases measured per mode: plain Burn and Kiln's levels for training, plus `kiln-basic-system`
/// (Kiln's kernels on the system allocator, so one run splits Kiln's gain over plain Burn into
/// the kernels' part and the allocator's part). For inference, plain
/// Burn's forward vs Kiln's inference session on the CPU: `kiln` (the lowered f32 graph;
/// `kiln-system` the same on the system allocator),
/// `kiln-fold` (+ strip and BatchNorm folding), `kiln-int8` (+ int8 dynamic quantization of
/// every layer), `kiln-optimized` (what `kiln optimize` keeps: int8 only on the layers where
/// it measured faster on this machine, at batch 1 and 64);
/// where a GPU is present (the `cuda` feature and a driver) also the folded graph on it in
/// f32, f16 and bf16 (`gpu-f32`, `gpu-f16`, `gpu-bf16`). Those three run on the CPU when
/// asked for by name without a GPU (f16/bf16 are then emulated: numerics, not speed).
///
/// `precision` mode measures the same step (training at level basic; inference for W3) in
/// each precision policy; its reference case is `f32`.
fn cases(mode: &str) -> Vec<&'static str> {
    match mode {
        "train" => vec![
            "burn",
            "kiln-basic-system",
            "kiln-basic",
            "kiln-advanced",
            "kiln-ultra",
        ],
        "precision" => vec!["f32", "bf16", "f16"],
        _ => {
            let mut cases = vec![
                "burn",
                "kiln-system",
                "kiln",
                "kiln-fold",
                "kiln-int8",
                "kiln-optimized",
            ];
            if Hardware::probe().best_backend() == Backend::Cuda {
                cases.extend(["gpu-f32", "gpu-f16", "gpu-bf16"]);
            }
            cases
        }
    }
}

fn default_steps(model: ModelKind, mode: &str) -> usize {
    match (model, mode) {
        (_, "infer") => 50,
        (ModelKind::Mlp, _) => 50,
        (ModelKind::Cnn | ModelKind::Transformer, _) => 20,
        (ModelKind::ResNet, _) => 3,
    }
}

/// The CPU pool of a child measuring one case: Kiln's training cases drive their steps from
/// this thread as `kiln train` does (the thread joins the pool,
/// [`kiln::plan::set_cpu_threads_with_caller`]); plain Burn's baseline and inference get
/// the pool a Burn program gets (the caller outside it).
fn cpu_pool_for(mode: &str, case: &str, threads: usize) {
    // Precision cases (f32, bf16, f16) are Kiln's trainer at the basic level.
    let kiln_training = (mode == "train" && case.starts_with("kiln")) || mode == "precision";
    if kiln_training {
        kiln::plan::set_cpu_threads_with_caller(threads);
    } else {
        kiln::plan::set_cpu_threads(threads);
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.data.is_some() && args.mode.as_deref() != Some("data") {
        anyhow::bail!("--data belongs to --mode data (the loader benchmark)");
    }
    let threads = if args.threads == 0 {
        Hardware::probe().cores
    } else {
        args.threads
    };
    if let (Some("data"), Some(spec)) = (args.mode.as_deref(), args.data.as_deref()) {
        kiln::plan::set_cpu_threads(threads);
        crate::image_bench::check_spec(spec)?;
        if let Some(w) = args.case.as_deref().and_then(|c| c.strip_prefix("kiln:")) {
            let rate =
                crate::image_bench::kiln_case(spec, w.parse()?, args.images, args.image_size)?;
            println!("{}", serde_json::to_string(&rate)?);
            return Ok(());
        }
        return crate::image_bench::run(&crate::image_bench::ImageBench {
            spec,
            peer_root: args.peer_root.clone(),
            threads,
            images: args.images,
            size: args.image_size,
            json: args.json,
        });
    }
    if args.mode.as_deref() == Some("data") {
        kiln::plan::set_cpu_threads(threads);
        return crate::data_bench::run(threads, args.steps, args.json);
    }
    if let Some(video) = &args.video {
        if args.mode.as_deref() != Some("stream") {
            anyhow::bail!("--video belongs to --mode stream");
        }
        kiln::plan::set_cpu_threads(threads);
        return video_bench(&args, video, threads);
    }
    if args.mode.as_deref() == Some("stream") {
        kiln::plan::set_cpu_threads(threads);
        return crate::stream_bench::run(&crate::stream_bench::StreamBench {
            threads,
            frames: args.frames,
            epochs: args.epochs,
            json: args.json,
            svg: args.svg.as_deref(),
        });
    }
    if let Some(case) = &args.case {
        // Child mode: measure one case and print one JSON line.
        if let Some(user) = find_user(&args.workload) {
            cpu_pool_for("train", case, threads);
            let result = measure_user_case(user, case, args.batch, args.steps, threads)?;
            println!("{}", serde_json::to_string(&result)?);
            return Ok(());
        }
        let workload = find(&args.workload)?;
        let mode = args.mode.clone().unwrap_or_else(|| default_mode(workload));
        cpu_pool_for(&mode, case, threads);
        let result = measure_case(workload, &mode, case, args.batch, args.steps, threads)?;
        println!("{}", serde_json::to_string(&result)?);
        return Ok(());
    }
    let all = args.workload.eq_ignore_ascii_case("all");
    let user_selected: Vec<&UserWorkload> = if all {
        USER_WORKLOADS.iter().collect()
    } else {
        find_user(&args.workload).into_iter().collect()
    };
    let selected: Vec<Workload> = if all {
        WORKLOADS.to_vec()
    } else if user_selected.is_empty() {
        vec![find(&args.workload)?]
    } else {
        Vec::new()
    };
    if args.mode.as_deref().is_some_and(|m| m != "train") && !user_selected.is_empty() && !all {
        bail!("U1 and U2 are training workloads: drop --mode or use --mode train");
    }
    let exe = std::env::current_exe().context("locating the kiln binary")?;
    let mut results = Vec::new();
    let user_runs = user_selected
        .iter()
        .filter(|_| args.mode.as_deref().is_none_or(|m| m == "train"));
    for u in user_runs {
        for case in cases("train") {
            let system = case == "burn" || case.ends_with("-system");
            let allocator = ("KILN_ALLOCATOR", system.then_some("system"));
            if !args.json {
                eprintln!("kiln bench: {} ({}) train {case} ...", u.id, u.name);
            }
            let child = Case {
                workload: u.id,
                mode: "train",
                case,
                threads,
                batch: args.batch,
                steps: args.steps,
            };
            let r = child.run(&exe, &[allocator])?;
            if args.json {
                println!("{}", serde_json::to_string(&r)?);
            }
            results.push(r);
        }
    }
    for w in selected {
        let modes: Vec<String> = match &args.mode {
            Some(m) => vec![m.clone()],
            None => vec![default_mode(w)],
        };
        for mode in modes {
            let batches: Vec<Option<usize>> = match (args.batch, w.infer) {
                (Some(b), _) => vec![Some(b)],
                (None, true) => vec![Some(1), Some(64)],
                (None, false) => vec![None],
            };
            for batch in batches {
                for case in cases(&mode) {
                    // Plain Burn runs as a Burn program does by default: system allocator
                    // (and so does the case that isolates the kernels' gain).
                    let system = case == "burn" || case.ends_with("-system");
                    let allocator = ("KILN_ALLOCATOR", system.then_some("system"));
                    if !args.json {
                        eprintln!("kiln bench: {} {mode} {case} ...", w.id);
                    }
                    let child = Case {
                        workload: w.id,
                        mode: &mode,
                        case,
                        threads,
                        batch,
                        steps: args.steps,
                    };
                    let r = child.run(&exe, &[allocator])?;
                    if args.json {
                        println!("{}", serde_json::to_string(&r)?);
                    }
                    results.push(r);
                }
            }
        }
    }
    if !args.json {
        print_table(&results);
    }
    Ok(())
}

/// One bench case to measure in a child process of this binary (`kiln bench --case`): each
/// case gets a fresh process (its own allocator, thread pool and, on a GPU, CubeCL's
/// once-per-process configuration).
pub(crate) struct Case<'a> {
    /// W1..W5.
    pub workload: &'a str,
    /// train, infer or precision.
    pub mode: &'a str,
    /// The case name (`burn`, `kiln-basic`, `f32`, ...).
    pub case: &'a str,
    /// CPU threads.
    pub threads: usize,
    /// Batch size (the workload's standard one when `None`).
    pub batch: Option<usize>,
    /// Timed steps per repeat (the mode's default when `None`).
    pub steps: Option<usize>,
}

impl Case<'_> {
    /// Runs the case as `exe bench ... --case` with each `env` variable set (or removed where
    /// its value is `None`) and parses the child's JSON line.
    pub(crate) fn run(&self, exe: &Path, env: &[(&str, Option<&str>)]) -> Result<CaseResult> {
        let (workload, mode, case) = (self.workload, self.mode, self.case);
        let mut cmd = Command::new(exe);
        for (name, value) in env {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
        cmd.args([
            "bench",
            "--workload",
            workload,
            "--mode",
            mode,
            "--case",
            case,
        ]);
        cmd.args(["--threads", &self.threads.to_string()]);
        if let Some(b) = self.batch {
            cmd.args(["--batch", &b.to_string()]);
        }
        if let Some(s) = self.steps {
            cmd.args(["--steps", &s.to_string()]);
        }
        let out = cmd.output().context("running a bench case")?;
        if !out.status.success() {
            bail!(
                "bench case {workload} {mode} {case} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let line = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(line.trim()).with_context(|| format!("parsing bench output {line:?}"))
    }
}

fn default_mode(w: Workload) -> String {
    if w.infer { "infer" } else { "train" }.to_string()
}

fn find(id: &str) -> Result<Workload> {
    WORKLOADS
        .iter()
        .copied()
        .find(|w| w.id.eq_ignore_ascii_case(id))
        .with_context(|| {
            format!("unknown workload `{id}`: expected W1, W2, W3, W4, W5, U1, U2 or all")
        })
}

/// The user-shaped workload `id` names (U1, U2), if any.
fn find_user(id: &str) -> Option<&'static UserWorkload> {
    USER_WORKLOADS
        .iter()
        .find(|u| u.id.eq_ignore_ascii_case(id))
}

/// A user-shaped model's training case: `burn` (plain Burn's loop, Burn's ops) or a Kiln
/// level (`kiln-basic`, …; `-system` only changes the allocator, which the parent chose).
fn time_user<M: Classifier + 'static>(
    id: &str,
    init: fn(&Device) -> M,
    case: &str,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    match case {
        "burn" => {
            let _burn_ops = kiln::kernels::Scope::enter(false);
            Ok(plain_train(init, batch, shape, steps))
        }
        level if level.starts_with("kiln-") => {
            let level: Level = level
                .trim_start_matches("kiln-")
                .trim_end_matches("-system")
                .parse()?;
            trainer_train(id, init, level, Precision::F32, batch, shape, steps)
        }
        _ => bail!("unknown bench case `{case}` for {id}"),
    }
}

/// One training case of a user-shaped workload: plain Burn's loop or Kiln's trainer at a
/// level, on the model as the user wrote it.
fn measure_user_case(
    u: &UserWorkload,
    case: &str,
    batch: Option<usize>,
    steps: Option<usize>,
    threads: usize,
) -> Result<CaseResult> {
    let (batch, steps, shape) = (batch.unwrap_or(u.batch), steps.unwrap_or(u.steps), u.shape);
    let timing = match u.id {
        "U1" => time_user(u.id, MobileNetish::new, case, batch, shape, steps)?,
        _ => time_user(u.id, PreLnEncoder::new, case, batch, shape, steps)?,
    };
    Ok(case_result(
        u.id, "train", case, batch, threads, steps, &timing,
    ))
}

fn measure_case(
    w: Workload,
    mode: &str,
    case: &str,
    batch: Option<usize>,
    steps: Option<usize>,
    threads: usize,
) -> Result<CaseResult> {
    let (default_batch, shape) = w.model.bench_shape();
    let batch = batch.unwrap_or(default_batch);
    let steps = steps.unwrap_or_else(|| default_steps(w.model, mode));
    let timing = match (mode, case) {
        // The baseline is Burn as a Burn user runs it: Burn's own ops, not Kiln's kernels
        // (switched off for this thread while the case runs; plain Burn never hops threads).
        ("train", "burn") => {
            let _burn_ops = kiln::kernels::Scope::enter(false);
            plain_burn_train(w.model, batch, shape, steps)
        }
        ("infer", "burn") => {
            let _burn_ops = kiln::kernels::Scope::enter(false);
            plain_burn_infer(w.model, batch, shape, steps)
        }
        ("infer", "kiln" | "kiln-system") => session_infer(w.model, &[], batch, shape, steps)?,
        ("infer", "kiln-fold") => {
            session_infer(w.model, &[Pass::Strip, Pass::Fold], batch, shape, steps)?
        }
        ("infer", "kiln-int8") => session_infer(w.model, &Pass::ALL, batch, shape, steps)?,
        ("infer", "kiln-optimized") => optimized_infer(w.model, batch, shape, steps)?,
        ("infer", gpu) if gpu.starts_with("gpu-") => {
            let half = match gpu {
                "gpu-f32" => None,
                "gpu-f16" => Some(Pass::F16),
                "gpu-bf16" => Some(Pass::Bf16),
                _ => bail!("unknown bench case `{case}`: gpu-f32, gpu-f16 or gpu-bf16"),
            };
            let passes: Vec<Pass> = [Pass::Strip, Pass::Fold].into_iter().chain(half).collect();
            let device = Hardware::probe().best_backend().device();
            session_infer_on(w.model, &passes, batch, shape, steps, device)?
        }
        ("train", level) if level.starts_with("kiln-") => {
            // `-system` only changes the allocator, which the parent process chose.
            let level = level
                .trim_start_matches("kiln-")
                .trim_end_matches("-system");
            let level: Level = level.parse()?;
            kiln_train(w.model, level, Precision::F32, batch, shape, steps)?
        }
        ("precision", name) => {
            let precision = Precision::from_name(name)
                .with_context(|| format!("unknown precision `{name}`"))?;
            if w.infer {
                let _scope = autocast(precision);
                plain_burn_infer(w.model, batch, shape, steps)
            } else {
                kiln_train(w.model, Level::Basic, precision, batch, shape, steps)?
            }
        }
        _ => bail!("unknown bench case `{case}` for mode `{mode}`"),
    };
    Ok(case_result(
        w.id, mode, case, batch, threads, steps, &timing,
    ))
}

/// A case's JSON row.
fn case_result(
    workload: &str,
    mode: &str,
    case: &str,
    batch: usize,
    threads: usize,
    steps: usize,
    timing: &Timing,
) -> CaseResult {
    CaseResult {
        workload: workload.to_string(),
        mode: mode.to_string(),
        case: case.to_string(),
        batch,
        threads,
        steps,
        ms_per_step: timing.median_ms,
        min_ms: timing.min_ms,
        max_ms: timing.max_ms,
        spread: timing.spread,
        samples_per_s: batch as f64 / (timing.median_ms / 1e3),
        peak_rss_bytes: memory::peak_rss_bytes(),
        allocator: crate::alloc::name().to_string(),
    }
}

fn random_batches(
    device: &Device,
    batch: usize,
    shape: [usize; 3],
) -> Vec<(Tensor<4>, Tensor<1, Int>)> {
    device.seed(1);
    (0..BATCHES)
        .map(|_| {
            let x = Tensor::random(
                [batch, shape[0], shape[1], shape[2]],
                Distribution::Normal(0.0, 1.0),
                device,
            );
            let y = Tensor::<1, Int>::random([batch], Distribution::Uniform(0.0, 10.0), device);
            (x, y)
        })
        .collect()
}

/// The loop a Burn user writes from the book: Burn's default Adam, no Kiln.
fn plain_burn_train(model: ModelKind, batch: usize, shape: [usize; 3], steps: usize) -> Timing {
    plain_train(
        |d| model.init_for_channels(shape[0], d),
        batch,
        shape,
        steps,
    )
}

/// [`plain_burn_train`] for any model (a user-shaped one).
fn plain_train<M: Classifier>(
    init: impl FnOnce(&Device) -> M,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Timing {
    let device = Device::flex().autodiff();
    device.seed(0);
    let mut net = init(&device);
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let data = random_batches(&device, batch, shape);
    let mut i = 0;
    measure(
        || {
            let (x, y) = data[i % BATCHES].clone();
            i += 1;
            let loss = loss_fn.forward(net.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &net);
            net = optim.step(1e-3, net.clone(), grads);
            // Force completion like the peers' sync(): read one value back.
            let _ = device.sync();
        },
        WARMUP,
        steps,
        REPEATS,
    )
}

fn plain_burn_infer(model: ModelKind, batch: usize, shape: [usize; 3], steps: usize) -> Timing {
    let device = Device::flex();
    device.seed(0);
    let net = model.init_for_channels(shape[0], &device).valid();
    let data = random_batches(&device, batch, shape);
    let mut i = 0;
    measure(
        || {
            let (x, _) = data[i % BATCHES].clone();
            i += 1;
            let y = net.forward(x);
            let _ = y.into_data();
        },
        WARMUP,
        steps,
        REPEATS,
    )
}

/// Kiln's inference session (the model lowered to a graph, `passes` applied).
fn session_infer(
    model: ModelKind,
    passes: &[Pass],
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    session_infer_on(model, passes, batch, shape, steps, Device::flex())
}

/// [`session_infer`] on `device`.
fn session_infer_on(
    model: ModelKind,
    passes: &[Pass],
    batch: usize,
    shape: [usize; 3],
    steps: usize,
    device: Device,
) -> Result<Timing> {
    device.seed(0);
    let net = model.init_for_channels(shape[0], &device);
    let session = InferenceSession::new(&net, model.name(), shape, passes, &device)?;
    time_session(&session, batch, shape, steps, &device)
}

/// `kiln optimize`'s result as a user deploys it: strip and fold, then int8 where it measured
/// faster than f32 on this machine at batch 1 and 64 (layer by layer); one model for every
/// batch timed.
fn optimized_infer(
    model: ModelKind,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    let device = Device::flex();
    device.seed(0);
    let net = model.init_for_channels(shape[0], &device);
    let mut graph = kiln::infer::lower(&net, model.name(), shape)?;
    kiln::infer::run_passes(&mut graph, &[Pass::Strip, Pass::Fold])?;
    let images: Vec<Tensor<4>> = [1, 64]
        .into_iter()
        .map(|b| random_batches(&device, b, shape).swap_remove(0).0)
        .collect();
    let probe = kiln::infer::Probe {
        device: &device,
        kiln_kernels: true,
        images: &images,
        steps: 5,
    };
    let choice = kiln::infer::choose_int8(&graph, &probe)?;
    choice.apply(&mut graph)?;
    tracing::info!(
        "{}: int8 on {} of {} layers: {}",
        model.name(),
        choice.applied().len(),
        choice.layers.len(),
        choice.reason
    );
    let session = InferenceSession::from_graph(graph, &device)?;
    time_session(&session, batch, shape, steps, &device)
}

/// Median forward time of `session` on random batches of `batch`.
fn time_session(
    session: &InferenceSession,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
    device: &Device,
) -> Result<Timing> {
    let data = random_batches(device, batch, shape);
    let mut i = 0;
    let mut failure = None;
    let timing = measure(
        || {
            let (x, _) = data[i % BATCHES].clone();
            i += 1;
            match session.forward(x) {
                Ok(y) => {
                    let _ = y.into_data();
                }
                Err(e) => failure = Some(e),
            }
        },
        WARMUP,
        steps,
        REPEATS,
    );
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(timing),
    }
}

/// Kiln's trainer with the plan resolved at `level` in `precision`, on synthetic data of the
/// same shape.
fn kiln_train(
    model: ModelKind,
    level: Level,
    precision: Precision,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    let plan = bench_plan(Some(model.name()), level, precision, batch)?;
    trainer_timing(
        &plan,
        model.name(),
        |d| model.init_for_channels(shape[0], d),
        batch,
        shape,
        steps,
    )
}

/// Kiln's trainer at `level` in `precision` on any model (a user-shaped one).
fn trainer_train<M: TrainStep<kiln::data::Batch> + 'static>(
    name: &str,
    init: impl FnOnce(&Device) -> M,
    level: Level,
    precision: Precision,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    let plan = bench_plan(None, level, precision, batch)?;
    trainer_timing(&plan, name, init, batch, shape, steps)
}

/// The plan a training case runs under: `level`, `precision`, `batch` and, for a zoo model,
/// its name (`train.model`).
fn bench_plan(
    zoo_model: Option<&str>,
    level: Level,
    precision: Precision,
    batch: usize,
) -> Result<kiln::plan::Plan> {
    let mut config = KilnConfig::default();
    config.set_level(level);
    if let Some(name) = zoo_model {
        config.set("train.model", name)?;
    }
    config.set("train.batch_size", &batch.to_string())?;
    config.set("precision.policy", precision.name())?;
    Ok(resolve(&config, &Hardware::probe())?)
}

/// Median step time of the trainer under `plan` on synthetic data of `shape`.
fn trainer_timing<M: TrainStep<kiln::data::Batch> + 'static>(
    plan: &kiln::plan::Plan,
    name: &str,
    init: impl FnOnce(&Device) -> M,
    batch: usize,
    shape: [usize; 3],
    steps: usize,
) -> Result<Timing> {
    // A sync point ends each timed repeat (and the warm-up): between sync points a step's
    // time is the host's, and an asynchronous device (CUDA) runs behind it, so only a
    // repeat that ends by waiting for the device measures the device.
    let steps = steps.max(1);
    let warmup = WARMUP.div_ceil(steps) * steps;
    let total = warmup + steps * REPEATS;
    let mut options = plan.train.clone();
    options.sync_every = steps;
    options.epochs = 1;
    options.max_steps = Some(total as u64);
    options.eval_every_epochs = 0;
    options.checkpoint_dir = None;
    let data = SyntheticDataset::new(total * batch * options.grad_accum_steps, shape, 10, 1);
    let mut sink = MemorySink::default();
    Trainer::new(options, plan.backend.device(), &mut sink).fit(name, init, &data, None)?;
    let durations: Vec<f64> = sink.steps().map(|s| s.step_ms).skip(warmup).collect();
    summarize(&durations, steps, REPEATS).context("too few steps were measured")
}

fn print_table(results: &[CaseResult]) {
    println!(
        "{:<4} {:<9} {:>5} {:<14} {:>10} {:>7} {:>11} {:>10} {:>9}",
        "wl", "mode", "batch", "case", "ms/step", "spread", "samples/s", "peak RSS", "vs ref"
    );
    for r in results {
        // The reference is each mode's first case: plain Burn, or f32 in precision mode.
        let reference = cases(&r.mode)[0];
        let base = results
            .iter()
            .find(|b| {
                b.workload == r.workload
                    && b.mode == r.mode
                    && b.batch == r.batch
                    && b.case == reference
            })
            .map(|b| b.ms_per_step / r.ms_per_step);
        println!(
            "{:<4} {:<9} {:>5} {:<14} {:>10.2} {:>6.1}% {:>11.1} {:>10} {:>9}",
            r.workload,
            r.mode,
            r.batch,
            r.case,
            r.ms_per_step,
            r.spread * 100.0,
            r.samples_per_s,
            r.peak_rss_bytes.map_or("n/a".into(), memory::human_bytes),
            base.map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
}

/// `--mode stream --video FILE --onnx MODEL` (the `video` feature).
#[cfg(feature = "video")]
fn video_bench(args: &BenchArgs, video: &std::path::Path, threads: usize) -> Result<()> {
    use kiln::stream::OutputKind;
    let model = args
        .onnx
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("--video needs --onnx MODEL, the per-frame model"))?;
    let size = args
        .input_size
        .split_once(['x', 'X'])
        .and_then(|(w, h)| Some((w.trim().parse().ok()?, h.trim().parse().ok()?)))
        .filter(|&(w, h): &(usize, usize)| w > 0 && h > 0)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--input-size {:?}: expected WIDTHxHEIGHT, e.g. 512x288",
                args.input_size
            )
        })?;
    // The `[stream]` keys: the file's, then the flags' (validated by the schema, so a bad
    // value names its key and what is allowed).
    let mut config = match &args.config {
        Some(path) => kiln::config::KilnConfig::load(path)?,
        None => kiln::config::KilnConfig::default(),
    };
    let flags = [
        ("stream.on_overload", &args.on_overload),
        ("stream.gate_threshold", &args.gate_threshold),
        ("stream.region_threshold", &args.region_threshold),
        ("stream.region_margin", &args.region_margin),
        ("stream.region_max_age", &args.region_max_age),
    ];
    for (key, value) in flags {
        if let Some(v) = value {
            config.set(key, v)?;
        }
    }
    let plan = kiln::plan::resolve(&config, &kiln::plan::Hardware::probe())?;
    crate::video_bench::run(&crate::video_bench::VideoBench {
        video,
        model,
        threads,
        size,
        fit: kiln::video::Fit::from_name(&args.fit).unwrap_or(kiln::video::Fit::Stretch),
        output: args.output.as_deref().and_then(OutputKind::from_name),
        max_frames: args.max_frames,
        json: args.json,
        settings: plan.stream,
        repeats: args.repeats,
        svg: args.svg.as_deref(),
    })
}

/// Without the `video` feature: say how to get it.
#[cfg(not(feature = "video"))]
fn video_bench(_: &BenchArgs, _: &std::path::Path, _: usize) -> Result<()> {
    anyhow::bail!(
        "--video needs the `video` feature (FFmpeg's libraries): apt install libavcodec-dev \
         libavformat-dev libswscale-dev libavutil-dev pkg-config libclang-dev, then cargo build \
         --release -p kiln-cli --features video"
    )
}
