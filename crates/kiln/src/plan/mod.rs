//! Resolution of a [`KilnConfig`] and a hardware probe into a concrete, inspectable [`Plan`]:
//! every setting with its value and where that value came from. `kiln plan` prints it.

pub mod autotune;
mod hardware;
mod parallel;

use std::fmt;
use std::path::PathBuf;

pub use hardware::{Backend, Hardware};
pub use parallel::{DataParallel, MPI_COMPILED};

use crate::config::schema::{self, SETTINGS};
use crate::config::{ConfigName, KilnConfig, Level, Origin};
use crate::data::{Augment, LastBatch};
use crate::error::{KilnError, Result};
use crate::guard::{GuardOptions, GuardPolicy};
use crate::precision::{Precision, ScalerOptions, ScalingMode};
use crate::train::{OptimizerKind, Schedule, TrainOptions};
use crate::zoo::ModelKind;

/// Where a resolved value came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// Kiln's neutral built-in default.
    Default,
    /// The optimization level's bundle.
    Level(Level),
    /// The config file.
    File(PathBuf),
    /// A command-line flag.
    Flag,
    /// Measured on this machine; the text says what was probed.
    Probe(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Level(l) => write!(f, "level {l}"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Flag => f.write_str("flag"),
            Source::Probe(what) => write!(f, "probe: {what}"),
        }
    }
}

/// One resolved setting.
#[derive(Debug, Clone)]
pub struct ResolvedSetting {
    /// Dotted key.
    pub key: &'static str,
    /// Final value.
    pub value: toml::Value,
    /// Where it came from.
    pub source: Source,
    /// What it does.
    pub doc: &'static str,
}

/// The concrete settings a run uses, with provenance.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The level the plan was resolved at.
    pub level: Level,
    /// Where the level came from.
    pub level_source: Source,
    /// Every setting in schema order.
    pub settings: Vec<ResolvedSetting>,
    /// The model to train.
    pub model: ModelKind,
    /// Training-loop options.
    pub train: TrainOptions,
    /// The backend to run on.
    pub backend: Backend,
    /// Threads for the CPU backend.
    pub threads: usize,
    /// The memory a run may use, in bytes (`device.memory_budget_mib`; `None` = the machine's).
    pub memory_budget: Option<u64>,
    /// The data (`data.dir`: a directory, or an image source `imagefolder:DIR`, ...), or
    /// `None` for the bundled subset.
    pub data_dir: Option<PathBuf>,
    /// How image files are read (`data.image_size`, `data.on_bad_sample`,
    /// `data.max_image_pixels`).
    pub images: crate::datasets::ImageOptions,
    /// The inference passes (`infer.passes`), in order.
    pub infer_passes: Vec<crate::infer::Pass>,
    /// The hardware the plan was resolved against.
    pub hardware: Hardware,
    /// Whether Burn's own operation fusion and autotune run on the plan's backend, and why.
    pub graph_compilation: GraphCompilation,
    /// The data-parallel world this run joins (`train.data_parallel` and the launcher).
    pub data_parallel: DataParallel,
    /// How long a rank waits at one collective call before the job is aborted
    /// (`train.collective_timeout_s`; `None` = forever).
    pub collective_timeout: Option<std::time::Duration>,
    /// Video streams' queue and techniques (`stream.*`).
    pub stream: crate::stream::StreamSettings,
}

/// Burn's own graph-level optimizations on a backend: operation fusion (`burn-fusion`,
/// which records ops lazily and compiles fused kernels) and kernel autotune. Both are CubeCL
/// features, compiled into Kiln's `cuda` build; `flex` runs every op eagerly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphCompilation {
    /// Burn's operation fusion is on.
    pub fusion: bool,
    /// Burn's kernel autotune is on.
    pub autotune: bool,
    /// Why, in words.
    pub why: String,
}

impl GraphCompilation {
    /// What `backend` gets in this build.
    pub fn for_backend(backend: Backend) -> Self {
        match backend {
            Backend::Flex => GraphCompilation {
                fusion: false,
                autotune: false,
                why: "flex runs every op eagerly; Burn's fusion and autotune are CubeCL \
                      features, compiled into the cuda build. On the CPU, Kiln's own kernels \
                      take their place: docs/kernels.md"
                    .into(),
            },
            // The cuda build; a build without CUDA describes what that build would run (its
            // plan refuses cuda anyway); only `cuda-eager` alone leaves fusion out.
            Backend::Cuda if cfg!(feature = "cuda") || !cfg!(feature = "cuda-eager") => {
                GraphCompilation {
                    fusion: true,
                    autotune: true,
                    why: "compiled into the cuda build (burn/fusion, burn/autotune): ops are \
                          recorded and fused into generated kernels; kernel variants are \
                          timed once per shape and the fastest cached (CUBECL_AUTOTUNE_LEVEL \
                          sets how many)"
                        .into(),
                }
            }
            Backend::Cuda => GraphCompilation {
                fusion: false,
                autotune: true,
                why: "the cuda-eager build: Burn's autotune without its fusion (each op its \
                      own kernel), the baseline of the fusion A/B in BENCHMARKS.md"
                    .into(),
            },
        }
    }
}

impl Plan {
    /// The memory this run may use, in bytes, and what that figure is: `--memory-budget`
    /// (`device.memory_budget_mib`) when given, else the device's memory (the GPU's on
    /// `cuda`; on the CPU the cgroup limit or physical memory; `None` where the system does
    /// not report it).
    pub fn memory_limit(&self) -> Option<(u64, &'static str)> {
        memory_limit(self.memory_budget, &self.hardware, self.backend)
    }

    /// The resolved value of a key.
    pub fn get(&self, key: &str) -> Option<&ResolvedSetting> {
        self.settings.iter().find(|s| s.key == key)
    }

    /// The plan as JSON (for `kiln plan --json` and run events).
    pub fn to_json(&self) -> serde_json::Value {
        let settings: serde_json::Map<String, serde_json::Value> = self
            .settings
            .iter()
            .map(|s| {
                (
                    s.key.to_string(),
                    serde_json::json!({"value": toml_to_json(&s.value), "source": s.source.to_string()}),
                )
            })
            .collect();
        serde_json::json!({
            "level": self.level.name(),
            "level_source": self.level_source.to_string(),
            "settings": settings,
            "hardware": {"cores": self.hardware.cores, "cuda_compiled": self.hardware.cuda_compiled},
            "graph_compilation": {
                "fusion": self.graph_compilation.fusion,
                "autotune": self.graph_compilation.autotune,
                "why": self.graph_compilation.why,
            },
            "data_parallel": {
                "rank": self.data_parallel.world.map(|w| w.0),
                "ranks": self.data_parallel.world.map_or(1, |w| w.1),
                "gpus": self.data_parallel.gpus,
                "mpi_compiled": MPI_COMPILED,
                "why": self.data_parallel.why,
            },
        })
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "level: {} ({})", self.level, self.level_source)?;
        let kw = self.settings.iter().map(|s| s.key.len()).max().unwrap_or(0);
        let vw = self
            .settings
            .iter()
            .map(|s| s.value.to_string().len())
            .max()
            .unwrap_or(0);
        let sw = self
            .settings
            .iter()
            .map(|s| s.source.to_string().len())
            .max()
            .unwrap_or(0);
        writeln!(
            f,
            "{:kw$}  {:vw$}  {:sw$}  what",
            "setting", "value", "source"
        )?;
        for s in &self.settings {
            writeln!(
                f,
                "{:kw$}  {:vw$}  {:sw$}  {}",
                s.key,
                s.value.to_string(),
                s.source.to_string(),
                s.doc
            )?;
        }
        let on = |b: bool| if b { "on" } else { "off" };
        writeln!(
            f,
            "burn fusion: {}, autotune: {} on {}. {}",
            on(self.graph_compilation.fusion),
            on(self.graph_compilation.autotune),
            self.backend.name(),
            self.graph_compilation.why
        )?;
        writeln!(f, "data parallel: {}", self.data_parallel.why)?;
        writeln!(f, "{}", measured_passes_rule(&self.infer_passes))
    }
}

/// How `kiln optimize` treats the plan's inference passes on this machine: the passes that
/// can make a model slower are kept only where they measure faster.
pub fn measured_passes_rule(passes: &[crate::infer::Pass]) -> String {
    let names: Vec<&str> = passes.iter().map(|p| p.name()).collect();
    let kernel = kiln_kernels::base::isa::Int8Kernel::detect();
    let can_lose: Vec<&str> = passes
        .iter()
        .filter(|p| p.can_lose())
        .map(|p| p.name())
        .collect();
    let rule = if can_lose.is_empty() {
        "each only removes work and is applied as is".to_string()
    } else {
        format!(
            "kiln optimize keeps {} only where the model measures faster than without it on \
             this machine, at batch 1 and at --batch (int8 and winograd layer by layer: a \
             layer stays f32, or on the implicit GEMM, where that form timed faster; \
             channels-last: Kiln's kernels unless Burn's NCHW ops time faster), and within \
             --max-accuracy-drop; --keep-all applies them unmeasured",
            can_lose.join(", ")
        )
    };
    format!(
        "inference passes: {} — {rule}. Int8 kernel on this CPU: {}{}",
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(",")
        },
        kernel.name(),
        if kernel.max_activation() < 255 {
            " (7-bit activations)"
        } else {
            ""
        }
    )
}

/// Resolves a config against the probed hardware.
pub fn resolve(config: &KilnConfig, hardware: &Hardware) -> Result<Plan> {
    let level = config.level;
    let mut settings = Vec::with_capacity(SETTINGS.len());
    for spec in SETTINGS {
        let (value, source) = match config.user_value(spec.key) {
            Some((v, Origin::Flag)) => (v.clone(), Source::Flag),
            Some((v, Origin::File(p))) => (v.clone(), Source::File(p)),
            None => {
                let (v, level_specific) = spec.default_for(level);
                let source = if level_specific {
                    Source::Level(level)
                } else {
                    Source::Default
                };
                (v, source)
            }
        };
        settings.push(ResolvedSetting {
            key: spec.key,
            value,
            source,
            doc: spec.doc,
        });
    }
    probe_autos(&mut settings, hardware)?;
    build(config, settings, hardware)
}

/// Replaces `auto`/`0` settings with probed values and records the probe as their source.
fn probe_autos(settings: &mut [ResolvedSetting], hardware: &Hardware) -> Result<()> {
    // The backend first: the watermark and the budget are the memory of the device it runs.
    let backend = hardware.backend_named(
        settings
            .iter()
            .find(|s| s.key == "device.backend")
            .and_then(|s| s.value.as_str())
            .unwrap_or("auto"),
    );
    let budget = memory_budget(settings, hardware, backend)?;
    // Ranks of a data-parallel launch on this machine share its cores and memory.
    let local_ranks = crate::distributed::launcher_local_ranks();
    for s in settings.iter_mut() {
        match (s.key, &s.value) {
            ("device.backend", toml::Value::String(v)) if v == "auto" => {
                s.value = toml::Value::String(backend.name().into());
                s.source = Source::Probe(hardware.backend_reason());
            }
            ("observe.memory_watermark_mib", toml::Value::String(v)) if v == "auto" => {
                let (mib, why) = auto_watermark_mib(budget, hardware, backend, local_ranks);
                s.value = toml::Value::Integer(mib);
                s.source = Source::Probe(why);
            }
            ("data.last_batch", toml::Value::String(v)) if v == "auto" => {
                let (policy, why) = match backend {
                    Backend::Cuda => (
                        "pad",
                        "a GPU compiles kernels per shape: one shape per epoch",
                    ),
                    Backend::Flex => ("keep", "the CPU compiles nothing per shape"),
                };
                s.value = toml::Value::String(policy.into());
                s.source = Source::Probe(why.into());
            }
            ("device.kernel_cache", toml::Value::String(v)) if v == "auto" => {
                if let Some(dir) = autotune::user_kernel_cache() {
                    s.value = toml::Value::String(dir.display().to_string());
                    s.source = Source::Probe("the user cache directory".into());
                }
            }
            ("device.threads", toml::Value::Integer(0)) => {
                let (threads, why) = threads_per_rank(hardware.cores, local_ranks);
                s.value = toml::Value::Integer(threads as i64);
                s.source = Source::Probe(why);
            }
            _ => {}
        }
    }
    Ok(())
}

/// `device.threads = 0` (one per core): the machine's cores, divided between the ranks of a
/// data-parallel launch that share the machine (each rank runs its own thread pool; N ranks
/// of all cores each would oversubscribe the CPU N times).
fn threads_per_rank(cores: usize, local_ranks: usize) -> (usize, String) {
    if local_ranks > 1 {
        (
            (cores / local_ranks).max(1),
            format!("{cores} CPU cores shared by {local_ranks} ranks on this machine"),
        )
    } else {
        (cores, format!("{cores} CPU cores"))
    }
}

/// Share of the memory limit at which `auto` puts the watermark: high enough that a run
/// which fits never adapts, low enough to leave the allocator and the OS room to act before
/// the OOM killer does.
const AUTO_WATERMARK_SHARE: f64 = 0.85;

/// `device.memory_budget_mib` in bytes (`None` = 0, the device's memory); a budget above
/// what the device has (the GPU on `cuda`, else the host) is refused, naming both.
fn memory_budget(
    settings: &[ResolvedSetting],
    hardware: &Hardware,
    backend: Backend,
) -> Result<Option<u64>> {
    let mib = settings
        .iter()
        .find(|s| s.key == "device.memory_budget_mib")
        .and_then(|s| s.value.as_integer())
        .unwrap_or(0);
    if mib <= 0 {
        return Ok(None);
    }
    let bytes = (mib as u64) << 20;
    if let Some((have, what)) = hardware.memory_for(backend)
        && bytes > have
    {
        return Err(KilnError::Inconsistent(format!(
            "device.memory_budget_mib = {mib} ({}) is more than this machine's {} {what}; \
             lower it, or set 0 to use the machine's memory",
            crate::observe::memory::human_bytes(bytes),
            crate::observe::memory::human_bytes(have)
        )));
    }
    Ok(Some(bytes))
}

/// The memory a run may use, in bytes, and what that figure is: the budget when one is set,
/// else the memory of the device `backend` runs on (`None` where the system does not report
/// it).
fn memory_limit(
    budget: Option<u64>,
    hardware: &Hardware,
    backend: Backend,
) -> Option<(u64, &'static str)> {
    budget
        .map(|b| (b, "memory budget (device.memory_budget_mib)"))
        .or(hardware.memory_for(backend))
}

/// The `auto` watermark in MiB and the probe's description: a share of the memory budget
/// when one is set, else of the device's memory (the GPU's on `cuda`; 0 = off where the
/// system does not report it).
fn auto_watermark_mib(
    budget: Option<u64>,
    hardware: &Hardware,
    backend: Backend,
    local_ranks: usize,
) -> (i64, String) {
    match memory_limit(budget, hardware, backend) {
        Some((bytes, what)) => {
            let share = AUTO_WATERMARK_SHARE / local_ranks.max(1) as f64;
            let mib = (bytes as f64 * share / 1048576.0) as i64;
            let ranks = if local_ranks > 1 {
                format!(", shared by {local_ranks} ranks on this machine")
            } else {
                String::new()
            };
            (
                mib.max(1),
                format!(
                    "{:.0}% of {} {}{ranks}",
                    share * 100.0,
                    crate::observe::memory::human_bytes(bytes),
                    what
                ),
            )
        }
        None => (0, "memory size unknown on this system: off".into()),
    }
}

fn build(config: &KilnConfig, settings: Vec<ResolvedSetting>, hw: &Hardware) -> Result<Plan> {
    let get = |key: &str| -> &toml::Value {
        // Every key read here is declared in SETTINGS, so it is present.
        &settings
            .iter()
            .find(|s| s.key == key)
            .unwrap_or_else(|| panic!("schema has no key {key}"))
            .value
    };
    let int = |key: &str| get(key).as_integer().unwrap_or_default();
    let float = |key: &str| get(key).as_float().unwrap_or_default();
    let text = |key: &str| get(key).as_str().unwrap_or_default().to_string();
    let flag = |key: &str| get(key).as_bool().unwrap_or_default();

    let backend = Backend::from_name(&text("device.backend"));
    hw.ensure_runs(backend, "device.backend = \"cuda\"")?;
    let optimizer = named::<OptimizerKind>("train.optimizer", &text)?;
    let schedule = named::<Schedule>("train.schedule", &text)?;
    let dir = |key: &str| Some(text(key)).filter(|t| !t.is_empty()).map(PathBuf::from);
    let train = TrainOptions {
        epochs: int("train.epochs") as usize,
        batch_size: int("train.batch_size") as usize,
        grad_accum_steps: int("train.grad_accum_steps") as usize,
        optimizer,
        lr: float("train.lr"),
        weight_decay: float("train.weight_decay"),
        momentum: float("train.momentum"),
        schedule,
        warmup_steps: int("train.warmup_steps") as u64,
        min_lr_ratio: float("train.min_lr_ratio"),
        grad_clip_norm: Some(float("train.grad_clip_norm")).filter(|c| *c > 0.0),
        activation_checkpointing: flag("train.activation_checkpointing"),
        seed: int("train.seed") as u64,
        max_steps: Some(int("train.max_steps") as u64).filter(|s| *s > 0),
        eval_every_epochs: int("train.eval_every_epochs") as usize,
        checkpoint_dir: dir("train.checkpoint_dir"),
        checkpoint_every_steps: Some(int("train.checkpoint_every_steps") as u64).filter(|s| *s > 0),
        keep_checkpoints: int("train.keep_checkpoints") as usize,
        shuffle: flag("data.shuffle"),
        last_batch: named::<LastBatch>("data.last_batch", &text)?,
        workers: get("data.workers").as_integer().map(|w| w as usize),
        prefetch_factor: int("data.prefetch_factor") as usize,
        augment: Augment::from_name(&text("data.augment"))?,
        memory_watermark: Some(int("observe.memory_watermark_mib") as u64)
            .filter(|m| *m > 0)
            .map(|m| m << 20),
        oom_adaptive: flag("train.oom_adaptive"),
        precision: named::<Precision>("precision.policy", &text)?,
        scaler: ScalerOptions {
            mode: named::<ScalingMode>("precision.loss_scaling", &text)?,
            init_scale: float("precision.init_scale") as f32,
            growth_interval: int("precision.growth_interval") as u32,
        },
        guard: GuardOptions {
            policy: named::<GuardPolicy>("guard.policy", &text)?,
            max_consecutive: int("guard.max_consecutive") as u32,
            check_params: flag("guard.check_params"),
            snapshot_every: int("guard.snapshot_every") as u64,
        },
        kiln_kernels: flag("device.kiln_kernels"),
        sync_every: int("train.sync_every") as usize,
    };
    if train.checkpoint_every_steps.is_some() && train.checkpoint_dir.is_none() {
        return Err(KilnError::Inconsistent(
            "train.checkpoint_every_steps is set but train.checkpoint_dir is empty; set \
             train.checkpoint_dir (or --checkpoint-dir) to where checkpoints should go"
                .into(),
        ));
    }
    let model = ModelKind::from_name(&text("train.model"))?;
    // The pass parser names the bad entry and the valid ones; the plan names the key.
    let infer_passes =
        crate::infer::Pass::parse_list(&text("infer.passes")).map_err(|e| match e {
            KilnError::InvalidValue {
                value, expected, ..
            } => KilnError::InvalidValue {
                key: "infer.passes".into(),
                value,
                expected,
            },
            other => other,
        })?;
    let level_source = match &config.level_origin {
        Some(Origin::Flag) => Source::Flag,
        Some(Origin::File(p)) => Source::File(p.clone()),
        None => Source::Default,
    };
    Ok(Plan {
        level: config.level,
        level_source,
        model,
        train,
        backend,
        threads: int("device.threads") as usize,
        memory_budget: memory_budget(&settings, hw, backend)?,
        data_dir: dir("data.dir"),
        images: crate::datasets::ImageOptions {
            size: int("data.image_size") as usize,
            on_bad_sample: named("data.on_bad_sample", &text)?,
            max_pixels: int("data.max_image_pixels") as u64,
        },
        infer_passes,
        hardware: hw.clone(),
        graph_compilation: GraphCompilation::for_backend(backend),
        data_parallel: DataParallel::resolve(
            &text("train.data_parallel"),
            int("train.batch_size") as usize,
            (backend == Backend::Cuda).then_some(hw.gpu_count),
        )?,
        collective_timeout: Some(int("train.collective_timeout_s") as u64)
            .filter(|s| *s > 0)
            .map(std::time::Duration::from_secs),
        stream: crate::stream::StreamSettings {
            on_overload: named("stream.on_overload", &text)?,
            queue_frames: int("stream.queue_frames") as usize,
            gate_threshold: float("stream.gate_threshold") as f32,
            region_threshold: float("stream.region_threshold") as f32,
            region_margin: int("stream.region_margin") as usize,
            region_max_age: int("stream.region_max_age") as u32,
        },
        settings,
    })
}

/// Converts a TOML scalar to JSON for machine output.
fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    match v {
        toml::Value::String(s) => serde_json::Value::String(s.clone()),
        toml::Value::Integer(i) => serde_json::json!(i),
        toml::Value::Float(f) => serde_json::json!(f),
        toml::Value::Boolean(b) => serde_json::Value::Bool(*b),
        other => serde_json::Value::String(other.to_string()),
    }
}

/// A named setting's value as its type. The schema validated the name against the same
/// `NAMES` the type parses, so this fails only if the two were ever split again — and then
/// with an error naming the key, never a silent default.
fn named<T: ConfigName>(key: &str, text: &impl Fn(&str) -> String) -> Result<T> {
    let value = text(key);
    T::from_name(&value).ok_or_else(|| KilnError::InvalidValue {
        key: key.into(),
        value: format!("{value:?}"),
        expected: format!("one of {}", T::NAMES.join(", ")),
    })
}

/// Every key Kiln accepts, for help texts.
pub fn known_keys() -> impl Iterator<Item = &'static str> {
    schema::SETTINGS.iter().map(|s| s.key)
}

impl Plan {
    /// Applies the plan's process-wide runtime settings: the CPU thread count and, on cuda,
    /// CubeCL's autotune level (`device.autotune`) and kernel cache (`device.kernel_cache`).
    /// Call once, before any tensor work; later calls keep the first values. (The kernel switch
    /// is not process-wide: it travels in [`TrainOptions::kiln_kernels`] and in each
    /// inference session.)
    pub fn apply_runtime(&self) {
        set_cpu_threads(self.threads);
        self.apply_device_runtime();
    }

    /// [`Plan::apply_runtime`] for a process whose calling thread then drives the training
    /// loop: the CPU pool takes the calling thread as one of its workers
    /// ([`set_cpu_threads_with_caller`]; why: each operation's split is then a fork-join, not
    /// a hand-off and a wake-up).
    pub fn apply_runtime_for_training(&self) {
        set_cpu_threads_with_caller(self.threads);
        self.apply_device_runtime();
    }

    /// The device's part of the runtime settings (CubeCL's autotune level and cache on cuda).
    fn apply_device_runtime(&self) {
        if self.backend == Backend::Cuda {
            let text = |key: &str| {
                self.get(key)
                    .and_then(|s| s.value.as_str())
                    .unwrap_or("default")
                    .to_string()
            };
            let (level, cache) = (text("device.autotune"), text("device.kernel_cache"));
            if !autotune::configure(&level, &cache) {
                tracing::warn!(
                    "device.autotune = {level:?}, device.kernel_cache = {cache:?} not applied: \
                     CubeCL's configuration was already read"
                );
            }
        }
    }
}

/// Sizes the CPU backend's (rayon's global) thread pool. Only the first call in a process
/// takes effect, so call it before any tensor work.
pub fn set_cpu_threads(threads: usize) {
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
    {
        tracing::debug!("thread pool already configured: {e}");
    }
}

/// Sizes the CPU backend's pool to `threads` with the calling thread as one of them (rayon's
/// worker 0), for a process whose calling thread drives the tensor work for its whole life —
/// a training loop, a benchmark — as Kiln's `train`, `tune` and training `bench` commands
/// do. Only the first pool set up in a process takes effect (false when one already was).
///
/// Why: a training step is hundreds of operations, most split over the pool. From a thread
/// outside the pool each split is injected into the pool's queue and the caller sleeps until
/// a worker finishes it — a futex wake-up and a context switch per operation, most of the
/// step's time outside the kernels on 2 cores. With the caller a worker, a split is a plain
/// fork-join: the caller runs half, the other worker steals the rest (U2 145 → 123 ms, W4
/// 34 → 29 ms per step on the AVX-512 Xeon, BENCHMARKS.md run 57). Not for a thread that
/// blocks elsewhere while other threads use the pool (a server's accept loop): work they
/// hand the pool would find one worker fewer.
pub fn set_cpu_threads_with_caller(threads: usize) -> bool {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .use_current_thread()
        .build_global()
    {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("thread pool already configured: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_one_machine_share_its_cores_and_memory() {
        assert_eq!(threads_per_rank(16, 1).0, 16);
        let (threads, why) = threads_per_rank(16, 4);
        assert_eq!(threads, 4);
        assert!(why.contains("shared by 4 ranks"), "{why}");
        assert_eq!(threads_per_rank(2, 4).0, 1, "at least one thread each");
        let hw = Hardware {
            memory: Some((8 << 30, "physical memory")),
            ..Hardware::probe()
        };
        let (one, _) = auto_watermark_mib(None, &hw, Backend::Flex, 1);
        let (quarter, why) = auto_watermark_mib(None, &hw, Backend::Flex, 4);
        assert_eq!(one, (8192.0 * 0.85) as i64);
        assert!((quarter - one / 4).abs() <= 1, "{quarter} vs {one}");
        assert!(why.contains("shared by 4 ranks"), "{why}");
    }
}
