//! `kiln`: train, plan, bench, optimize, profile, tune, report and serve.

mod alloc;
mod bench_cmd;
mod data_bench;
mod optimize_cmd;
mod profile_cmd;
mod progress;
mod serve_cmd;
mod train_cmd;
mod tune_auto_cmd;
mod tune_cmd;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use kiln::KilnConfig;
use kiln::config::Level;
use kiln::plan::{Hardware, Plan};

#[global_allocator]
static ALLOCATOR: alloc::KilnAllocator = alloc::KilnAllocator;

const EXAMPLES: &str = "\
Examples:
  kiln train --model cnn --epochs 3          train W2 on the bundled MNIST subset
  kiln train --level basic --json            plain training, JSON-lines events on stdout
  kiln train --config kiln.toml --set train.lr=0.01
  kiln train --checkpoint-dir runs/cnn --max-steps 100
  kiln train --checkpoint-dir runs/cnn --resume latest
  kiln train --data ~/mnist --model mlp      full MNIST / Fashion-MNIST IDX files
  kiln plan --level ultra                    show every setting and where it came from
  kiln optimize --model cnn --checkpoint runs/cnn --passes fold,int8 --out opt/cnn
  kiln bench --workload W2                   plain Burn vs Kiln's levels, same protocol as the peers
  kiln profile --model cnn --steps 20        Perfetto trace + phase table (profile/trace.json)
  kiln train --tensorboard runs/tb           also write TensorBoard event files
  kiln bench --mode data                     the data loader vs PyTorch's DataLoader
  kiln tune batch --model cnn --memory-budget 2GiB   largest and fastest batch under a budget
  kiln tune auto --model cnn --out runs/cnn/kiln.toml  measured plan search, writes kiln.toml
  kiln train --run-dir runs/cnn && kiln report runs/cnn   HTML report with plots
  kiln serve --models opt                    KServe v2 server (HTTP :8000, gRPC :8001) over opt/*/config.toml
  bench/compare.sh                           Kiln and the PyTorch / ONNX Runtime peers side by side";

/// Kiln: a performance optimization system for deep-learning training and inference.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a zoo model (default: W2 CNN on the bundled MNIST subset, CPU).
    #[command(after_help = EXAMPLES)]
    Train(TrainArgs),
    /// Print the resolved plan: every setting, its value and where it came from.
    #[command(after_help = EXAMPLES)]
    Plan(PlanArgs),
    /// Benchmark plain Burn vs Kiln's plan at each level on the standard workloads.
    #[command(after_help = EXAMPLES)]
    Bench(BenchArgs),
    /// Optimize a trained checkpoint for inference (strip, BN folding, int8) and report each
    /// pass: latency, throughput, size, accuracy; writes model.kgraph (+ model.onnx).
    #[command(after_help = EXAMPLES)]
    Optimize(OptimizeArgs),
    /// Profile N training steps: a Chrome/Perfetto trace (trace.json), a table of phases by
    /// time and memory, and (with --overhead) the profiler's own cost.
    #[command(after_help = EXAMPLES)]
    Profile(ProfileArgs),
    /// Tune settings by measurement on this machine.
    #[command(subcommand)]
    Tune(TuneCommand),
    /// Render a run directory (kiln train --run-dir) as one self-contained HTML report.
    #[command(after_help = EXAMPLES)]
    Report(ReportArgs),
    /// Serve a model repository over the KServe v2 protocol (HTTP + gRPC) with dynamic
    /// batching; Triton's clients (tritonclient, perf_analyzer) work unmodified.
    #[command(after_help = EXAMPLES)]
    Serve(serve_cmd::ServeArgs),
}

#[derive(Args, Debug)]
struct ReportArgs {
    /// The run directory (events.jsonl; optional tune.json and verdict.json).
    run_dir: PathBuf,
    /// Where to write the HTML (default RUN_DIR/report.html).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum TuneCommand {
    /// The largest batch that fits a memory budget, and the fastest one: power-of-two growth
    /// then binary search, each trial a few real training steps in a child process.
    Batch(TuneBatchArgs),
    /// The auto-optimizer: short measured trials over precision, micro-batch (effective batch
    /// kept), activation checkpointing and loader workers; writes the winner as a kiln.toml.
    Auto(TuneAutoArgs),
}

#[derive(Args, Debug)]
struct TuneAutoArgs {
    /// Zoo model: mlp (W1), cnn (W2), transformer (W4), resnet (W5).
    #[arg(long, default_value = "cnn")]
    model: String,
    /// Effective batch to keep (default: the workload's standard batch).
    #[arg(long)]
    batch: Option<usize>,
    /// Timed steps per trial (after 2 warm-up steps).
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Where to write the winning plan.
    #[arg(long, default_value = "kiln.tuned.toml")]
    out: PathBuf,
    /// Also run the exhaustive grid over the same space and compare.
    #[arg(long)]
    grid: bool,
    /// Stop exploring once this much time is spent (e.g. 90s, 5m); the trial in flight ends.
    #[arg(long)]
    time_budget: Option<String>,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct TuneBatchArgs {
    /// Zoo model: mlp (W1), cnn (W2), transformer (W4), resnet (W5).
    #[arg(long, default_value = "cnn")]
    model: String,
    /// Memory budget (host RSS on CPU), e.g. 8GiB, 512MiB.
    #[arg(long, default_value = "8GiB")]
    memory_budget: String,
    /// Candidate generation: power (double, then binary search) or binsearch.
    #[arg(long, default_value = "power")]
    mode: String,
    /// Safety margin: a trial fits under budget x (1 - margin).
    #[arg(long, default_value_t = 0.1)]
    margin: f64,
    /// First batch of the power-of-two growth.
    #[arg(long, default_value_t = 8)]
    start: usize,
    /// Largest batch considered.
    #[arg(long, default_value_t = 4096)]
    max_batch: usize,
    /// Timed training steps per trial (after 2 warm-up steps).
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Precision policy of the trials: f32, bf16, f16.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The result as JSON.
    #[arg(long)]
    json: bool,
    /// Internal: run one trial at this batch and print its measurements.
    #[arg(long, hide = true)]
    trial: Option<usize>,
}

#[derive(Args, Debug)]
struct ProfileArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Optimizer steps to profile (after 3 untraced warm-up steps).
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Output directory: trace.json, phases.txt, phases.json.
    #[arg(long, default_value = "profile")]
    out: PathBuf,
    /// Also measure the profiler's overhead: the same steps with and without it, twice each.
    #[arg(long)]
    overhead: bool,
    /// Print the table as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct OptimizeArgs {
    /// Zoo model: mlp (W1), cnn (W2/W3), transformer (W4), resnet (W5).
    #[arg(long)]
    model: String,
    /// A checkpoint file, or a checkpoint directory (its newest checkpoint is used).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Passes to apply in order, comma-separated: strip, fold, int8, and f16 or bf16
    /// (half-precision weights for GPU inference; emulated, slow, on a CPU). Default: the
    /// plan's `infer.passes` (advanced: strip,fold,int8; basic: strip,fold).
    #[arg(long)]
    passes: Option<String>,
    /// Optimization level whose `infer.passes` to use when --passes is not given.
    #[arg(long)]
    level: Option<String>,
    /// TOML config file whose `infer.passes` (and level) to use when --passes is not given.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Output directory (model.kgraph, model.onnx when exportable, summary.md, summary.json).
    #[arg(long)]
    out: PathBuf,
    /// Directory with MNIST-format IDX files for the accuracy column (default: bundled).
    #[arg(long)]
    data: Option<PathBuf>,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed forwards per repeat (3 repeats after 5 warm-up).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// W1..W5 or all.
    #[arg(long, default_value = "all")]
    workload: String,
    /// train, infer, precision (f32 vs bf16 vs f16), or data (the loader alone for 0..2x
    /// threads workers vs PyTorch's DataLoader, and data wait in W2 training). Default: infer
    /// for W3, train otherwise.
    #[arg(long, value_parser = ["train", "infer", "precision", "data"])]
    mode: Option<String>,
    /// Batch size (default: the workload's standard batch; W3 measures 1 and 64).
    #[arg(long)]
    batch: Option<usize>,
    /// Timed steps per repeat (3 repeats after 5 warm-up steps); with --mode data, epochs per
    /// repeat (default 4).
    #[arg(long)]
    steps: Option<usize>,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    /// Internal: measure one case in this process (`burn`, `kiln-basic`, ...).
    #[arg(long, hide = true)]
    case: Option<String>,
}

/// Flags that shape the configuration; each maps onto a config key.
#[derive(Args, Debug, Clone)]
struct ConfigArgs {
    /// TOML config file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Optimization level: basic, advanced, ultra or custom.
    #[arg(long)]
    level: Option<String>,
    /// Zoo model: mlp (W1), cnn (W2), transformer (W4), resnet (W5).
    #[arg(long)]
    model: Option<String>,
    /// Epochs.
    #[arg(long)]
    epochs: Option<String>,
    /// Micro-batch size.
    #[arg(long)]
    batch_size: Option<String>,
    /// Micro-batches per optimizer step.
    #[arg(long)]
    accum: Option<String>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<String>,
    /// Optimizer: adam, adamw, sgd.
    #[arg(long)]
    optimizer: Option<String>,
    /// Global-norm gradient clipping threshold (0 = off).
    #[arg(long)]
    clip: Option<String>,
    /// Seed.
    #[arg(long)]
    seed: Option<String>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    max_steps: Option<String>,
    /// Data directory: train/test .safetensors, *-images.npy/*-labels.npy (memory-mapped), or
    /// MNIST-format IDX files (default: the bundled subset).
    #[arg(long, value_name = "DIR")]
    data: Option<String>,
    /// Directory for checkpoints.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<String>,
    /// Precision policy: f32, bf16 or f16 (mixed precision with f32 master weights).
    #[arg(long)]
    precision: Option<String>,
    /// Data-loader worker threads, or `auto` (measured: the fewest that keep data wait < 5%).
    #[arg(long)]
    workers: Option<String>,
    /// Augmentation in the loader workers: none, crop, crop-flip, affine.
    #[arg(long)]
    augment: Option<String>,
    /// Backend: auto, flex, cuda.
    #[arg(long)]
    device: Option<String>,
    /// CPU threads (0 = one per core).
    #[arg(long)]
    threads: Option<String>,
    /// Any config key, e.g. --set train.warmup_steps=100 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(Args, Debug)]
struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Continue from a checkpoint file, or `latest` in --checkpoint-dir.
    #[arg(long, value_name = "PATH|latest")]
    resume: Option<String>,
    /// JSON-lines events on stdout instead of a progress bar.
    #[arg(long)]
    json: bool,
    /// Also write TensorBoard event files (scalars + the plan as text) into this directory.
    #[arg(long, value_name = "DIR")]
    tensorboard: Option<PathBuf>,
    /// Record the run's events in DIR/events.jsonl for `kiln report DIR`.
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct PlanArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

impl ConfigArgs {
    /// Builds the config: file, then level flag, then key flags, then `--set` pairs.
    fn to_config(&self) -> Result<KilnConfig> {
        let mut config = match &self.config {
            Some(path) => KilnConfig::load(path)?,
            None => KilnConfig::default(),
        };
        if let Some(level) = &self.level {
            config.set_level(level.parse::<Level>()?);
        }
        let flags = [
            ("train.model", &self.model),
            ("train.epochs", &self.epochs),
            ("train.batch_size", &self.batch_size),
            ("train.grad_accum_steps", &self.accum),
            ("train.lr", &self.lr),
            ("train.optimizer", &self.optimizer),
            ("train.grad_clip_norm", &self.clip),
            ("train.seed", &self.seed),
            ("train.max_steps", &self.max_steps),
            ("data.dir", &self.data),
            ("train.checkpoint_dir", &self.checkpoint_dir),
            ("precision.policy", &self.precision),
            ("data.workers", &self.workers),
            ("data.augment", &self.augment),
            ("device.backend", &self.device),
            ("device.threads", &self.threads),
        ];
        for (key, value) in flags {
            if let Some(v) = value {
                let v = if key == "train.model" {
                    // Accept workload ids (W2) as well as names.
                    kiln::zoo::ModelKind::from_name(v)?.name().to_string()
                } else {
                    v.clone()
                };
                config.set(key, &v)?;
            }
        }
        for pair in &self.set {
            config.set_pair(pair)?;
        }
        Ok(config)
    }

    fn resolve(&self) -> Result<Plan> {
        Ok(kiln::plan::resolve(&self.to_config()?, &Hardware::probe())?)
    }
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Train(args) => train_cmd::run(args),
        Command::Plan(args) => plan(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Optimize(args) => optimize_cmd::run(args),
        Command::Profile(args) => profile_cmd::run(args),
        Command::Tune(TuneCommand::Batch(args)) => tune_cmd::run(args),
        Command::Tune(TuneCommand::Auto(args)) => tune_auto_cmd::run(args),
        Command::Report(args) => kiln::report::write_report(&args.run_dir, args.out.as_deref())
            .map(|p| println!("report: {}", p.display()))
            .map_err(Into::into),
        Command::Serve(args) => serve_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}

fn plan(args: PlanArgs) -> Result<()> {
    let plan = args.config.resolve()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan.to_json())?);
    } else {
        print!("{plan}");
    }
    Ok(())
}
