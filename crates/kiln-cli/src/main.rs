//! `kiln`: train, plan, bench, optimize, profile, tune, report and serve.

mod alloc;
mod bench_cmd;
mod check_cmd;
mod data_bench;
mod data_cmd;
mod image_bench;
mod launch;
mod onnx_bench;
mod onnx_layer_choice;
mod onnx_optimize;
mod optimize_cmd;
mod profile_cmd;
mod progress;
mod serve_cmd;
mod stream_bench;
mod train_cmd;
mod tune_auto_cmd;
mod tune_cmd;
mod user_shaped;
#[cfg(feature = "video")]
mod video_bench;
mod work_dir;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use kiln::KilnConfig;
use kiln::config::Level;
use kiln::plan::{Hardware, Plan};

/// Counted, so the memory watermark reads heap bytes in use (which fall when a halved
/// micro-batch frees its activations) rather than RSS, which mimalloc's retained pages keep
/// high (`kiln::observe::heap`).
#[global_allocator]
static ALLOCATOR: kiln::observe::heap::CountingAlloc<alloc::KilnAllocator> =
    kiln::observe::heap::CountingAlloc::new(alloc::KilnAllocator);

const EXAMPLES: &str = "\
Examples:
  kiln train --model cnn --epochs 3          train W2 on the bundled MNIST subset
  kiln plan --level ultra                    show every setting and where it came from
  kiln bench --workload W2                   plain Burn vs Kiln's levels, same protocol as the peers
  kiln bench --onnx model.onnx               your ONNX file: Kiln vs ONNX Runtime
  kiln optimize --onnx model.onnx --out opt/model   fold + int8, measured per stage
  kiln profile --model cnn --steps 20        Perfetto trace + phase table
  kiln tune auto --model cnn --out kiln.toml measured plan search
  kiln report runs/cnn                       HTML report of a run directory
  kiln serve --models opt                    KServe v2 server (HTTP :8000, gRPC :8001)
Each command's --help shows its own examples.";

const TRAIN_EXAMPLES: &str = "\
Examples:
  kiln train --model cnn --epochs 3          train W2 on the bundled MNIST subset
  kiln train --level basic --json            plain training, JSON-lines events on stdout
  kiln train --config kiln.toml --set train.lr=0.01
  kiln train --checkpoint-dir runs/cnn --max-steps 100
  kiln train --checkpoint-dir runs/cnn --resume latest
  kiln train --data ~/mnist --model mlp      full MNIST / Fashion-MNIST IDX files
  kiln train --model resnet --data imagefolder:~/imagenet --set data.image_size=128
                                             JPEG/PNG/WebP files (DIR/<class>/*.jpg or DIR/{train,val})
  kiln train --model resnet --data shards:'train-{000..099}.tar'   WebDataset shards
  kiln train --tensorboard runs/tb           also write TensorBoard event files
  kiln train --run-dir runs/cnn              events + plots for `kiln report runs/cnn`
  kiln train --model mlp --processes 2       data parallel over 2 processes (mpi build)
  mpirun -n 4 kiln train --model mlp         the same, launched by MPI (any hosts)
Your own Burn model: see README.md, \"Use Kiln from your own Burn code\".";

const PLAN_EXAMPLES: &str = "\
Examples:
  kiln plan --level ultra                    every setting and where it came from
  kiln plan --config kiln.toml --json        the resolved plan of a config file, as JSON";

const BENCH_EXAMPLES: &str = "\
Examples:
  kiln bench --workload W2                   plain Burn vs Kiln's levels, same protocol as the peers
  kiln bench --workload W3 --mode infer --batch 64
  kiln bench --mode data                     the data loader vs PyTorch's DataLoader
  kiln bench --onnx model.onnx               your ONNX file: Kiln vs ONNX Runtime, batch 1 and 8
  kiln bench --onnx model.onnx --int8        both int8 (Kiln's passes vs onnxruntime quantize_dynamic)
  kiln bench --onnx bert.onnx --batch 8 --input-dims input_ids=128 --input-dims attention_mask=128
  bench/compare.sh                           Kiln and the PyTorch / ONNX Runtime peers side by side";

const OPTIMIZE_EXAMPLES: &str = "\
Examples:
  kiln optimize --model cnn --checkpoint runs/cnn --passes fold,int8 --out opt/cnn
  kiln optimize --model cnn --checkpoint runs/cnn --level advanced --out opt/cnn
  kiln optimize --model cnn --checkpoint runs/cnn --passes strip,fold,f16 --device cuda \
      --out opt/cnn-f16                                          half weights, on the GPU
  kiln optimize --onnx resnet18.onnx --out opt/resnet18          fold + int8, per-stage table
  kiln optimize --onnx bert.onnx --passes int8 --input-dims input_ids=128 \
      --input-dims attention_mask=128 --out opt/bert
  kiln serve --models opt                    then serve what it wrote";

const PROFILE_EXAMPLES: &str = "\
Examples:
  kiln profile --model cnn --steps 20        Perfetto trace + phase table (profile/trace.json)
  kiln profile --model cnn --overhead        also measure the profiler's own cost
  kiln profile --onnx model.onnx --batch-size 8 --threads 2
                                             an ONNX model's inference: time per operator
  kiln profile --onnx model.onnx --passes fold,int8
                                             the same after kiln optimize's passes";

const REPORT_EXAMPLES: &str = "\
Examples:
  kiln train --run-dir runs/cnn && kiln report runs/cnn   HTML report with plots
  kiln report runs/cnn --out report.html";

const CHECK_EXAMPLES: &str = "\
Examples:
  kiln check gpu            CUDA against the CPU: matmul, W2 inference, a skipped optimizer step,
                            W1 training (f32, bf16), the step's device reads, the memory reading
  kiln check cpu --json     Kiln's CPU kernels against Burn's ops, one JSON line per check";

const SERVE_EXAMPLES: &str = "\
Examples:
  kiln serve --models opt                    KServe v2 (HTTP :8000, gRPC :8001) over opt/*/config.toml
  kiln serve --models repo --http-port 0 --no-grpc
  kiln serve --models opt --device cpu       models with kind = \"KIND_AUTO\" (or none) on the CPU
  kiln serve --models opt --model-control-mode poll --repository-poll-secs 5
                                             new, changed, removed models load, reload, unload
  kiln serve --models opt --model-control-mode explicit --load-model w3
                                             then: curl -X POST localhost:8000/v2/repository/models/w3/load
  kiln serve --models opt --exit-on-error    refuse to start when any model fails to load
A model directory holds config.toml, e.g. for an exported ONNX file:
  backend = \"onnx\"
  file = \"model.onnx\"
  input_dims = { input_ids = [128] }         # non-batch dynamic axes, if the file has any
  max_batch_size = 16
  [dynamic_batching]
  max_queue_delay_microseconds = 500
Clients: tritonclient (HTTP/gRPC), perf_analyzer -m NAME -u localhost:8000 -i http.";

const DATA_EXAMPLES: &str = "\
Examples:
  kiln data pack imagefolder:~/imagenet runs/packed          raw RGB, shorter side 256
  kiln data pack imagefolder:~/imagenet runs/packed --format jpeg --quality 90
  kiln train --model resnet --data packed:runs/packed        later epochs skip the decode";

const TUNE_EXAMPLES: &str = "\
Examples:
  kiln tune batch --model cnn --memory-budget 2GiB   largest and fastest batch under a budget
  kiln tune auto --model cnn --out runs/cnn/kiln.toml  measured plan search, writes kiln.toml";

const TUNE_BATCH_EXAMPLES: &str = "\
Examples:
  kiln tune batch --model cnn --memory-budget 2GiB   largest and fastest batch under 2 GiB
  kiln tune batch --model resnet --precision bf16 --memory-budget 8GiB --max-batch 512
  kiln tune batch --config kiln.toml --mode binsearch --json   the search as JSON";

const TUNE_AUTO_EXAMPLES: &str = "\
Examples:
  kiln tune auto --model cnn --out runs/cnn/kiln.toml   measured plan search, writes kiln.toml
  kiln tune auto --model cnn --batch 128 --time-budget 5m   keep an effective batch of 128
  kiln tune auto --config kiln.toml --grid --json        every combination, results as JSON
  kiln train --config runs/cnn/kiln.toml                 then train with the winning plan";

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
    #[command(after_help = TRAIN_EXAMPLES)]
    Train(TrainArgs),
    /// Print the resolved plan: every setting, its value and where it came from.
    #[command(after_help = PLAN_EXAMPLES)]
    Plan(PlanArgs),
    /// Benchmark plain Burn vs Kiln's plan at each level on the standard workloads, or an
    /// ONNX file (--onnx) against ONNX Runtime.
    #[command(after_help = BENCH_EXAMPLES)]
    Bench(BenchArgs),
    /// Optimize a trained checkpoint for inference (strip, BN folding, int8) and report each
    /// pass: latency, throughput, size, accuracy; writes model.kgraph (+ model.onnx).
    #[command(after_help = OPTIMIZE_EXAMPLES)]
    Optimize(OptimizeArgs),
    /// Profile N training steps (or, with --onnx, N inference runs of an ONNX file): a
    /// Chrome/Perfetto trace (trace.json), a table of phases and operators by time and
    /// memory, and (with --overhead) the profiler's own cost.
    #[command(after_help = PROFILE_EXAMPLES)]
    Profile(ProfileArgs),
    /// Tune settings by measurement on this machine.
    #[command(subcommand, after_help = TUNE_EXAMPLES)]
    Tune(TuneCommand),
    /// Render a run directory (kiln train --run-dir) as one self-contained HTML report.
    #[command(after_help = REPORT_EXAMPLES)]
    Report(ReportArgs),
    /// Serve a model repository over the KServe v2 protocol (HTTP + gRPC) with dynamic
    /// batching; Triton's clients (tritonclient, perf_analyzer) work unmodified.
    #[command(after_help = SERVE_EXAMPLES)]
    Serve(serve_cmd::ServeArgs),
    /// Work on image datasets: `pack` writes the preprocessed cache (decoded and resized
    /// once, read by offset later).
    #[command(subcommand, after_help = DATA_EXAMPLES)]
    Data(data_cmd::DataCommand),
    /// Check that a device computes what the CPU computes and trains as Kiln means it to
    /// (gpu: CUDA against the CPU; cpu: Kiln's kernels against Burn's ops). Fails when a
    /// check does.
    #[command(after_help = CHECK_EXAMPLES)]
    Check(check_cmd::CheckArgs),
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
    #[command(after_help = TUNE_BATCH_EXAMPLES)]
    Batch(Box<TuneBatchArgs>),
    /// The auto-optimizer: short measured trials over precision, micro-batch (effective batch
    /// kept), activation checkpointing and loader workers; writes the winner as a kiln.toml.
    #[command(after_help = TUNE_AUTO_EXAMPLES)]
    Auto(Box<TuneAutoArgs>),
}

#[derive(Args, Debug)]
struct TuneAutoArgs {
    /// The configuration the trials start from and the written plan keeps (`--config
    /// kiln.toml`, `--level`, `--model`, `--lr`, `--threads`, ... as for `kiln train`).
    #[command(flatten)]
    config: ConfigArgs,
    /// Effective batch to keep (default: the config's batch_size × grad_accum_steps when
    /// it sets them, else the workload's standard batch).
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
    /// The report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct TuneBatchArgs {
    /// The configuration each trial trains with (`--config kiln.toml`, `--level`, `--model`,
    /// `--precision`, `--threads`, `--set ...` as for `kiln train`); the batch size is what
    /// the search varies.
    #[command(flatten)]
    config: ConfigArgs,
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
    #[arg(long, conflicts_with = "onnx")]
    overhead: bool,
    /// An ONNX file to profile instead of training: `--steps` inference runs at batch
    /// `--batch-size` (default 1) on `--threads`, one row per operator kind in the table.
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    onnx: Option<PathBuf>,
    /// With --onnx: sizes of an input's dynamic axes besides the batch, `NAME=D1,D2`.
    #[arg(long, value_name = "NAME=DIMS")]
    input_dims: Vec<String>,
    /// With --onnx: passes applied before profiling, comma-separated (fold, winograd, int8,
    /// channels-last), so the profile is of the model `kiln optimize` serves. Default: none.
    #[arg(long, requires = "onnx")]
    passes: Option<String>,
    /// Print the table as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct OptimizeArgs {
    /// The configuration the model is optimized under, as for `kiln train`: `--model` (zoo
    /// model: mlp, cnn, transformer, resnet), `--config kiln.toml` and `--level` (whose
    /// `infer.passes` apply when --passes is not given, and whose `device.kiln_kernels`
    /// the sessions use), `--device` (auto: cuda when this kiln is built with it and a
    /// driver loads, else the CPU; flex; cuda), `--threads`, `--data` (the test split for the
    /// accuracy column; default: bundled), `--set KEY=VALUE`.
    #[command(flatten)]
    config: ConfigArgs,
    /// A checkpoint file, or a checkpoint directory (its newest checkpoint is used).
    #[arg(long, required_unless_present = "onnx")]
    checkpoint: Option<PathBuf>,
    /// An ONNX file to optimize instead of a zoo checkpoint (passes: fold, winograd, int8,
    /// channels-last; default all four); writes a servable model directory.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "checkpoint", "data"])]
    onnx: Option<PathBuf>,
    /// With --onnx: sizes of an input's dynamic axes besides the batch, `NAME=D1,D2`.
    #[arg(long, value_name = "NAME=DIMS")]
    input_dims: Vec<String>,
    /// Passes to apply in order, comma-separated: strip, fold, winograd, int8, f16 or bf16
    /// (half-precision weights for GPU inference; emulated, slow, on a CPU), channels-last
    /// (Kiln's kernels vs Burn's NCHW ops). Default: the plan's `infer.passes` (advanced:
    /// strip,fold,winograd,int8,channels-last; basic: strip,fold).
    #[arg(long)]
    passes: Option<String>,
    /// Output directory (model.kgraph, model.onnx when exportable, summary.md, summary.json).
    #[arg(long)]
    out: PathBuf,
    /// Timed forwards per repeat (3 repeats after 5 warm-up).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// The batch the model will serve at: a pass that can make it slower (int8, f16, bf16)
    /// is kept only where it measures faster at batch 1 and at this batch, on this machine
    /// (int8 layer by layer).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Largest accuracy drop, in points of top-1 on the test split, a pass may cost; one
    /// that costs more is dropped.
    #[arg(long, default_value_t = 1.0)]
    max_accuracy_drop: f64,
    /// Apply every pass as asked, without measuring whether it pays.
    #[arg(long)]
    keep_all: bool,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// W1..W5, U1 (a MobileNet-style depthwise-separable CNN) or U2 (a pre-LN transformer
    /// encoder) — the user-shaped models, written with `kiln::nn` as a user would — or all.
    #[arg(long, default_value = "all")]
    workload: String,
    /// train, infer, precision (f32 vs bf16 vs f16), data (the loader alone for 0..2x
    /// threads workers vs PyTorch's DataLoader, and data wait in W2 training), or stream (the
    /// real-time techniques on the synthetic video vs the full model on every frame; trains
    /// its models first). Default: infer for W3, train otherwise.
    #[arg(long, value_parser = ["train", "infer", "precision", "data", "stream"])]
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
    /// An ONNX file to time against ONNX Runtime (same shapes and threads, one run) instead
    /// of the workloads; batch 1 and 8 unless --batch is given.
    #[arg(long, value_name = "FILE")]
    onnx: Option<PathBuf>,
    /// With --onnx: sizes of an input's dynamic axes besides the batch, `NAME=D1,D2`
    /// (repeat per input).
    #[arg(long, value_name = "NAME=DIMS")]
    input_dims: Vec<String>,
    /// With --onnx: int8 on both sides (Kiln's fold + int8 passes, onnxruntime's
    /// quantize_dynamic); max diff is then between the two int8 models.
    #[arg(long, requires = "onnx")]
    int8: bool,
    /// With --onnx: where Kiln runs the model, auto, flex or cuda (ONNX Runtime stays on the
    /// CPU; the max diff then compares the GPU's outputs with it).
    #[arg(long, requires = "onnx", value_parser = ["auto", "flex", "cuda"], default_value = "flex")]
    device: String,
    /// With --mode stream: frames of the synthetic video (default 1200).
    #[arg(long, default_value_t = 1200)]
    frames: usize,
    /// With --mode stream: training epochs of its models (default 3).
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// With --mode stream: also write the accuracy-vs-speed-up curve of the threshold sweeps
    /// as an SVG file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// With --mode data: image files to load instead of the MNIST arrays —
    /// imagefolder:DIR, shards:PATTERN, manifest:FILE or packed:DIR — timed beside the
    /// PyTorch DataLoader (PIL, decode_jpeg) and DALI's CPU pipeline.
    #[arg(long, value_name = "SPEC")]
    data: Option<String>,
    /// With --mode data --data: the image folder the peers read (default: the source's own
    /// folder; set it when --data is a pack or shards made from a folder).
    #[arg(long, value_name = "DIR")]
    peer_root: Option<PathBuf>,
    /// With --mode data --data: images per timed repeat (default 1024).
    #[arg(long, default_value_t = 1024)]
    images: usize,
    /// With --mode data --data: the output side (RandomResizedCrop size).
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// With --mode stream: a video file (MP4, MKV, WebM, ...) to run --onnx MODEL on, each
    /// technique on and off, beside PyAV + ONNX Runtime (needs the `video` feature).
    #[arg(long, value_name = "FILE", requires = "onnx")]
    video: Option<PathBuf>,
    /// With --video: the model input `WIDTHxHEIGHT` for a model with dynamic height and
    /// width (a fixed-size model takes its own).
    #[arg(long, default_value = "512x288")]
    input_size: String,
    /// With --video: stretch or letterbox frames to the input.
    #[arg(long, default_value = "stretch", value_parser = ["stretch", "letterbox"])]
    fit: String,
    /// With --video: how the model's first output is read: classes, mask, image or boxes
    /// (default: guessed from its shape).
    #[arg(long, value_parser = ["classes", "mask", "image", "boxes"])]
    output: Option<String>,
    /// With --video: what a full decode queue does, block or drop-oldest (default: the
    /// config's `stream.on_overload`, block).
    #[arg(long, value_parser = ["block", "drop-oldest"])]
    on_overload: Option<String>,
    /// With --video: a config file whose `[stream]` keys (on_overload, queue_frames,
    /// gate_threshold, region_threshold, region_margin, region_max_age) set the queue and the
    /// techniques; the flags override it.
    #[arg(long, value_name = "FILE", requires = "video")]
    config: Option<PathBuf>,
    /// With --video: runs of each configuration and of the peer; the median run is shown
    /// with the range.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// With --video: stop after this many frames.
    #[arg(long)]
    max_frames: Option<u64>,
    /// With --video: the frame gate's threshold, the largest mean absolute luma difference
    /// (0..1) of any 16-pixel tile (`stream.gate_threshold`, default 0.01).
    #[arg(long)]
    gate_threshold: Option<String>,
    /// With --video: a region tile's threshold (`stream.region_threshold`, default 0.01).
    #[arg(long)]
    region_threshold: Option<String>,
    /// With --video: context around a changed region, in input pixels
    /// (`stream.region_margin`, default 48; crops align to 32).
    #[arg(long)]
    region_margin: Option<String>,
    /// With --video: frames a result may be reused for (`stream.region_max_age`, default
    /// 60).
    #[arg(long)]
    region_max_age: Option<String>,
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
    /// Memory the run may use, e.g. 8GiB, 512MiB (`device.memory_budget_mib`; default: the
    /// cgroup limit or physical memory). The auto watermark takes 85% of it.
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<String>,
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
    /// Train one model over N processes on this machine (data parallel: `--batch-size` per
    /// process, gradients all-reduced over MPI; the mpi build and Open MPI's mpirun). Across
    /// machines, launch with `mpirun -n N --host ... kiln train ...` instead.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    processes: Option<u16>,
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
        if let Some(size) = &self.memory_budget {
            let mib = kiln::tune::parse_size(size)?.div_ceil(1 << 20);
            config.set("device.memory_budget_mib", &mib.to_string())?;
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
                // onnx-ir warns about its own internal lookups ("should only happen when
                // peeking") dozens of times per transformer; its errors still show.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,onnx_ir=error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Train(args) => train_cmd::run(args),
        Command::Plan(args) => plan(args),
        Command::Bench(args) if args.onnx.is_some() && args.video.is_none() => run_onnx_bench(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Optimize(args) if args.onnx.is_some() => run_onnx_optimize(args),
        Command::Optimize(args) => optimize_cmd::run(args),
        Command::Profile(args) if args.onnx.is_some() => run_onnx_profile(args),
        Command::Profile(args) => profile_cmd::run(args),
        Command::Tune(TuneCommand::Batch(args)) => tune_cmd::run(*args),
        Command::Tune(TuneCommand::Auto(args)) => tune_auto_cmd::run(*args),
        Command::Report(args) => kiln::report::write_report(&args.run_dir, args.out.as_deref())
            .map(|p| println!("report: {}", p.display()))
            .map_err(Into::into),
        Command::Serve(args) => serve_cmd::run(args),
        Command::Check(args) => check_cmd::run(args),
        Command::Data(cmd) => data_cmd::run(cmd),
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

/// `--input-dims NAME=D1,D2` flags as a map.
fn parse_input_dims(
    specs: &[String],
) -> anyhow::Result<std::collections::BTreeMap<String, Vec<usize>>> {
    let mut input_dims = std::collections::BTreeMap::new();
    for spec in specs {
        let (name, dims) = spec.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("--input-dims `{spec}` must be NAME=D1,D2 (e.g. input_ids=128)")
        })?;
        let dims = dims
            .split(',')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("--input-dims `{spec}`: {e}"))?;
        input_dims.insert(name.to_string(), dims);
    }
    Ok(input_dims)
}

/// `kiln optimize --onnx`: the ONNX passes, measured stage by stage ([`onnx_optimize`]).
fn run_onnx_optimize(args: OptimizeArgs) -> anyhow::Result<()> {
    let passes = kiln::onnx::OnnxPass::parse_list(
        args.passes
            .as_deref()
            .unwrap_or("fold,winograd,int8,channels-last"),
    )?;
    let plan = optimize_cmd::resolve_plan(&args)?;
    onnx_optimize::run(&onnx_optimize::OnnxOptimize {
        device: plan.backend.device(),
        kiln_kernels: plan.train.kiln_kernels,
        path: args.onnx.clone().unwrap_or_default(),
        passes,
        out: args.out.clone(),
        input_dims: parse_input_dims(&args.input_dims)?,
        steps: args.steps,
        json: args.json,
        keep_all: args.keep_all,
    })
}

/// `kiln profile --onnx`: the plan's threads, device and kernel switch, then
/// [`profile_cmd::run_onnx`].
fn run_onnx_profile(args: ProfileArgs) -> anyhow::Result<()> {
    let plan = args.config.resolve()?;
    plan.apply_runtime();
    let batch = match &args.config.batch_size {
        Some(b) => b
            .parse::<usize>()
            .map_err(|e| anyhow::anyhow!("--batch-size `{b}`: {e}"))?,
        None => 1,
    };
    profile_cmd::run_onnx(&profile_cmd::OnnxProfile {
        path: args.onnx.clone().unwrap_or_default(),
        device: plan.backend.device(),
        kiln_kernels: plan.train.kiln_kernels,
        batch,
        input_dims: parse_input_dims(&args.input_dims)?,
        passes: kiln::onnx::OnnxPass::parse_list(args.passes.as_deref().unwrap_or(""))?,
        runs: args.steps,
        out: args.out.clone(),
        json: args.json,
    })
}

/// `kiln bench --onnx`: parses the ONNX-specific flags and runs [`onnx_bench`].
fn run_onnx_bench(args: BenchArgs) -> anyhow::Result<()> {
    let input_dims = parse_input_dims(&args.input_dims)?;
    let threads = if args.threads == 0 {
        Hardware::probe().cores
    } else {
        args.threads
    };
    let hw = Hardware::probe();
    let backend = hw.backend_named(&args.device);
    hw.ensure_runs(backend, "--device cuda")?;
    onnx_bench::run(&onnx_bench::OnnxBench {
        path: args.onnx.clone().unwrap_or_default(),
        device: backend.device(),
        batches: args.batch.map_or_else(|| vec![1, 8], |b| vec![b]),
        threads,
        steps: args.steps.unwrap_or(50),
        input_dims,
        json: args.json,
        int8: args.int8,
    })
}
