//! Per-model configuration: `<repository>/<model>/config.toml`.
//!
//! ```toml
//! backend = "zoo"                 # zoo | graph | onnx | identity
//! model = "cnn"                   # zoo: which zoo model
//! checkpoint = "step-1000.kiln"   # zoo: a Kiln checkpoint, relative to this directory
//! passes = "strip,fold,int8"      # zoo: inference passes applied at load
//! input_shape = [1, 28, 28]       # zoo: per-sample [C, H, W] (default: MNIST's)
//! # backend = "onnx": file = "model.onnx"; input_dims = { input_ids = [128] } fixes the
//! # non-batch dynamic axes of an input (the server batches fixed-shape samples);
//! # int8_layers = ["/fc1/Gemm"] limits passes' int8 to those nodes (kiln optimize --onnx
//! # writes it when only some layers measured faster in int8); winograd_layers = [...] the
//! # same for the winograd pass (the other 3×3 convolutions stay on the implicit GEMM)
//! max_batch_size = 64
//! instances = 2                   # model copies running batches in parallel
//! kind = "KIND_AUTO"              # where they run (Triton's instance kinds): KIND_CPU,
//!                                 # KIND_GPU (a kiln built with --features cuda), or
//!                                 # KIND_AUTO (`kiln serve --device`, default: GPU if any)
//! max_queue_size = 1024           # requests waiting; more are rejected (429 / RESOURCE_EXHAUSTED)
//! timeout_microseconds = 0        # a request still queued after this is rejected; 0 = none
//!
//! [dynamic_batching]              # absent: every request runs on its own
//! max_queue_delay_microseconds = 200
//! preferred_batch_size = [32, 64]
//!
//! [sequence_batching]             # a stateful stream model (KServe sequence extension):
//! frame_dims = [1, 56, 56]        # requests carry one frame [C, H, W] and sequence_id,
//!                                 # sequence_start / sequence_end parameters
//! regions = [[0, 0, 28, 28], [28, 0, 28, 28]]   # [x, y, w, h] each; absent = whole frame
//! frame_gate = { threshold = 0.05, max_reuse_age = 30 }   # temporal coherence
//! region_gate = { threshold = 0.08, max_reuse_age = 30 }  # run only changed regions
//! max_sequence_idle_microseconds = 60000000               # idle sequences are dropped
//! max_active_sequences = 1024     # a start beyond it: 429 / RESOURCE_EXHAUSTED
//! cascade = [{ graph = "exit0.kgraph", threshold = 0.9 }]  # cheaper stages first (early
//!                                 # exit prefix, or a coarse model at 1/f resolution; graph
//!                                 # or file = "x.onnx"); the model answers the rest
//! # A per-frame ONNX model (backend = "onnx", dynamic height and width for tiles) instead:
//! # output = "mask"               # mask | image | boxes: what its first output is
//! # tiles = { threshold = 0.05, margin = 32 }   # run only changed tiles' groups as crops
//! # frame_gate = { threshold = 0.05, max_reuse_age = 30 }  # reuse when no tile changed
//! # thumb_block = 4; max_detections = 100  # gate resolution; rows of the boxes output
//!
//! version_policy = { latest = 1 } # numbered version directories (M/1, M/2) served: the
//!                                 # latest N (default 1), "all", or { specific = [1, 3] }
//!
//! [warmup]                        # run on every instance before the model is marked ready
//! batch_size = 8                  # rows per warm-up execution (≤ max_batch_size)
//! count = 2                       # executions per instance
//! data = "zero"                   # zero | random (seeded values in [0, 1))
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Result, ServeError};

/// Where a model's weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendConfig {
    /// A zoo model with a Kiln checkpoint, optimized at load by inference passes.
    Zoo {
        /// Zoo model name (`cnn`, `mlp`, `resnet`, or a workload id).
        model: String,
        /// Checkpoint file (absolute, resolved against the model directory).
        checkpoint: PathBuf,
        /// Pass list as `kiln optimize` takes it (`strip,fold,int8`); empty = none.
        passes: String,
        /// Per-sample input `[C, H, W]` the checkpoint was trained on.
        input_shape: [usize; 3],
    },
    /// An inference graph saved by `kiln optimize` (`model.kgraph`).
    Graph {
        /// Graph file (absolute, resolved against the model directory).
        path: PathBuf,
    },
    /// An ONNX file from any exporter, loaded through `kiln::onnx` (onnx-ir).
    Onnx {
        /// ONNX file (absolute, resolved against the model directory).
        path: PathBuf,
        /// Pass list (`fold,int8`); empty = none.
        passes: String,
        /// Per-sample dims (batch left out) for inputs whose ONNX shape has dynamic axes
        /// besides the batch (`input_ids = [128]`): the server batches fixed-shape samples.
        input_dims: BTreeMap<String, Vec<usize>>,
        /// With the `int8` pass: the layers (node names) it quantizes, when not all — what
        /// `kiln optimize --onnx` measured faster in int8 on its machine.
        int8_layers: Option<Vec<String>>,
        /// With the `winograd` pass: the 3×3 convolutions that run as Winograd, when not all
        /// — what `kiln optimize --onnx` measured faster that way on its machine.
        winograd_layers: Option<Vec<String>>,
    },
    /// Returns its input unchanged (Triton's identity backend): measures the server itself.
    Identity {
        /// Per-sample shape.
        dims: Vec<usize>,
        /// `FP32` or `INT64`.
        datatype: String,
        /// Simulated compute time per batch.
        execute_delay: Duration,
    },
}

/// Where a model's instances run: Triton's `instance_group` kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InstanceKind {
    /// The server's default (`kiln serve --device`; itself auto: a GPU when this kiln is
    /// built with CUDA and a driver loads, else the CPU).
    #[default]
    Auto,
    /// The CPU (Burn's `flex` backend).
    Cpu,
    /// The first CUDA device.
    Gpu,
}

impl InstanceKind {
    /// Triton's name (`KIND_CPU`).
    pub fn name(self) -> &'static str {
        match self {
            InstanceKind::Auto => "KIND_AUTO",
            InstanceKind::Cpu => "KIND_CPU",
            InstanceKind::Gpu => "KIND_GPU",
        }
    }

    /// Parses Triton's names and the `--device` words (auto, cpu/flex, gpu/cuda).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text {
            "KIND_AUTO" | "auto" => Ok(InstanceKind::Auto),
            "KIND_CPU" | "cpu" | "flex" => Ok(InstanceKind::Cpu),
            "KIND_GPU" | "gpu" | "cuda" => Ok(InstanceKind::Gpu),
            other => Err(format!(
                "kind = {other:?} is not an instance kind; use KIND_CPU, KIND_GPU or KIND_AUTO"
            )),
        }
    }

    /// This kind, or `default` when it is `Auto`.
    pub fn or(self, default: InstanceKind) -> InstanceKind {
        if self == InstanceKind::Auto {
            default
        } else {
            self
        }
    }
}

/// Dynamic batching: Triton's `dynamic_batching` block.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicBatching {
    /// How long the oldest request may wait for a fuller batch.
    pub max_queue_delay: Duration,
    /// Batch sizes that run at once without waiting for more (ascending).
    pub preferred_batch_sizes: Vec<usize>,
}

/// Which numbered versions of a model are served: Triton's `version_policy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionPolicy {
    /// The `n` highest-numbered versions on disk (Triton's default is the latest 1).
    Latest(usize),
    /// Every version on disk.
    All,
    /// Exactly these versions (those on disk).
    Specific(Vec<u64>),
}

impl Default for VersionPolicy {
    fn default() -> Self {
        VersionPolicy::Latest(1)
    }
}

impl VersionPolicy {
    /// The versions this policy serves out of `on_disk` (ascending in, ascending out).
    pub fn select(&self, on_disk: &[u64]) -> Vec<u64> {
        match self {
            VersionPolicy::Latest(n) => on_disk[on_disk.len().saturating_sub(*n)..].to_vec(),
            VersionPolicy::All => on_disk.to_vec(),
            VersionPolicy::Specific(wanted) => on_disk
                .iter()
                .copied()
                .filter(|v| wanted.contains(v))
                .collect(),
        }
    }

    /// Parses the TOML value of `version_policy`.
    fn parse(value: &toml::Value) -> std::result::Result<Self, String> {
        const FIX: &str = "use version_policy = { latest = N }, \"all\" or { specific = [1, 3] }";
        match value {
            toml::Value::String(s) if s == "all" => Ok(VersionPolicy::All),
            toml::Value::Table(t) if t.len() == 1 => {
                let (key, v) = t.iter().next().ok_or(FIX)?;
                match (key.as_str(), v) {
                    ("latest", toml::Value::Integer(n)) if *n >= 1 => {
                        Ok(VersionPolicy::Latest(*n as usize))
                    }
                    ("specific", toml::Value::Array(list)) if !list.is_empty() => list
                        .iter()
                        .map(|v| match v {
                            toml::Value::Integer(n) if *n >= 1 => Ok(*n as u64),
                            other => Err(format!(
                                "version_policy.specific: {other} is not a version number (1, 2, …)"
                            )),
                        })
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map(VersionPolicy::Specific),
                    _ => Err(format!("version_policy {value} is not a policy; {FIX}")),
                }
            }
            other => Err(format!("version_policy {other} is not a policy; {FIX}")),
        }
    }
}

/// Warm-up run on every instance before the model is marked ready (Triton's
/// `model_warmup`), so that the first client request does not pay for first-call work
/// (kernel selection, weight transforms, allocator growth).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warmup {
    /// Rows per warm-up execution.
    pub batch_size: usize,
    /// Executions per instance.
    pub count: usize,
    /// Seeded values in [0, 1) (INT64 inputs: 0..10) instead of zeros.
    pub random: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWarmup {
    #[serde(default = "one")]
    batch_size: usize,
    #[serde(default = "one")]
    count: usize,
    data: Option<String>,
}

impl RawWarmup {
    fn validate(self, max_batch_size: usize) -> std::result::Result<Warmup, String> {
        if self.batch_size == 0 || self.batch_size > max_batch_size {
            return Err(format!(
                "warmup.batch_size {} must be 1..=max_batch_size ({max_batch_size})",
                self.batch_size
            ));
        }
        if self.count == 0 || self.count > 1000 {
            return Err(format!("warmup.count {} must be 1..=1000", self.count));
        }
        let random = match self.data.as_deref() {
            None | Some("zero") => false,
            Some("random") => true,
            Some(other) => {
                return Err(format!(
                    "warmup.data {other:?} is not a data kind; use \"zero\" or \"random\""
                ));
            }
        };
        Ok(Warmup {
            batch_size: self.batch_size,
            count: self.count,
            random,
        })
    }
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// What runs.
    pub backend: BackendConfig,
    /// Largest batch one execution takes (requests are concatenated up to it).
    pub max_batch_size: usize,
    /// Model copies executing batches in parallel.
    pub instances: usize,
    /// Where the copies run.
    pub kind: InstanceKind,
    /// Requests waiting for execution before new ones are rejected.
    pub max_queue_size: usize,
    /// Queue time after which a request is rejected instead of run.
    pub timeout: Option<Duration>,
    /// `None`: each request runs alone, as it arrived.
    pub dynamic_batching: Option<DynamicBatching>,
    /// Whether the model runs on Kiln's CPU kernels (`kiln_kernels`, default true; false =
    /// Burn's own ops, as `device.kiln_kernels = false` does for training).
    pub kiln_kernels: bool,
    /// `Some`: a stateful stream model (`[sequence_batching]`).
    pub sequence: Option<SequenceConfig>,
    /// Which numbered versions are served (models laid out as `M/1`, `M/2`, …).
    pub version_policy: VersionPolicy,
    /// `Some`: executions run on every instance before the model is ready.
    pub warmup: Option<Warmup>,
}

/// A stream model's settings: Triton's `sequence_batching` block with Kiln's real-time
/// techniques ([`kiln::stream`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceConfig {
    /// One frame `[C, H, W]`, what each request carries.
    pub frame_dims: [usize; 3],
    /// Regions, gates.
    pub stream: kiln::stream::StreamConfig,
    /// A sequence without a request for this long is dropped (its next request is refused).
    pub max_idle: Duration,
    /// Cheaper classifiers tried before the model, in order.
    pub cascade: Vec<CascadeStage>,
    /// Sequences a model holds at once; a start beyond it is refused (429 /
    /// RESOURCE_EXHAUSTED) so that clients cannot grow the server's memory without bound.
    pub max_active: usize,
    /// `Some`: a per-frame model (an ONNX segmenter, enhancer or detector) instead of a
    /// classifier over fixed regions.
    pub per_frame: Option<PerFrameConfig>,
}

/// A per-frame stream model's settings (`output = "mask" | "image" | "boxes"` in
/// `[sequence_batching]`): each sequence is a [`kiln::stream::FrameStream`].
#[derive(Debug, Clone, PartialEq)]
pub struct PerFrameConfig {
    /// How the model's first output is read.
    pub kind: kiln::stream::OutputKind,
    /// Temporal coherence (`frame_gate`) and changed-tile regions (`tiles`).
    pub techniques: kiln::stream::VideoTechniques,
    /// Frame pixels per thumbnail pixel (`thumb_block`, default 4).
    pub thumb_block: usize,
    /// Rows of the `boxes` output (`max_detections`, default 100): detections beyond it
    /// are dropped lowest score first, unused rows are zeros.
    pub max_detections: usize,
}

/// Default `max_active_sequences`: each sequence holds a copy of its last frame per gate, so
/// a bound keeps memory known (1,024 sequences of 224×224×3 frames with both gates: ~1.2 GB).
const DEFAULT_MAX_ACTIVE_SEQUENCES: usize = 1024;

/// One stage of a stream model's cascade ([`kiln::stream::Cascade`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CascadeStage {
    /// A Kiln graph (`graph = ...`) or an ONNX file (`file = ...`), resolved against the
    /// model directory.
    pub source: StageSource,
    /// Its answers at or above this softmax confidence stand.
    pub threshold: f32,
}

/// Where a cascade stage's model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum StageSource {
    /// A `.kgraph` written by `kiln optimize`.
    Graph(PathBuf),
    /// An ONNX file.
    Onnx(PathBuf),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    graph: Option<PathBuf>,
    file: Option<PathBuf>,
    threshold: f32,
}

/// Triton's default idle time of a sequence: 1 s is its default; streams of frames at a few
/// frames per second would lose their state, so Kiln keeps them for a minute.
const DEFAULT_SEQUENCE_IDLE_US: u64 = 60_000_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSequence {
    frame_dims: [usize; 3],
    regions: Option<Vec<[usize; 4]>>,
    frame_gate: Option<kiln::stream::GateConfig>,
    region_gate: Option<kiln::stream::GateConfig>,
    max_sequence_idle_microseconds: Option<u64>,
    #[serde(default)]
    cascade: Vec<RawStage>,
    max_active_sequences: Option<usize>,
    output: Option<String>,
    tiles: Option<kiln::stream::RegionConfig>,
    thumb_block: Option<usize>,
    max_detections: Option<usize>,
}

impl RawSequence {
    fn validate(self, dir: &Path) -> std::result::Result<SequenceConfig, String> {
        let cascade = self
            .cascade
            .into_iter()
            .enumerate()
            .map(|(k, st)| {
                let source = match (st.graph, st.file) {
                    (Some(g), None) => StageSource::Graph(dir.join(g)),
                    (None, Some(f)) => StageSource::Onnx(dir.join(f)),
                    _ => {
                        return Err(format!(
                            "sequence_batching.cascade[{k}] needs exactly one of `graph` (a .kgraph) or `file` (an .onnx)"
                        ));
                    }
                };
                if !(0.0..=1.0).contains(&st.threshold) {
                    return Err(format!(
                        "sequence_batching.cascade[{k}].threshold {} must be in [0, 1] (a softmax confidence)",
                        st.threshold
                    ));
                }
                Ok(CascadeStage {
                    source,
                    threshold: st.threshold,
                })
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        let frame_dims = self.frame_dims;
        if frame_dims.contains(&0) {
            return Err(format!(
                "sequence_batching.frame_dims {frame_dims:?} must be positive"
            ));
        }
        let regions = self.regions.map(|list| {
            list.into_iter()
                .map(|[x, y, w, h]| kiln::stream::Roi::new(x, y, w, h))
                .collect::<Vec<_>>()
        });
        if let Some(list) = &regions {
            if list.is_empty() {
                return Err(
                    "sequence_batching.regions is empty; list [x, y, w, h] regions or leave it out for the whole frame"
                        .into(),
                );
            }
            for r in list {
                r.check_inside(frame_dims)
                    .map_err(|e| format!("sequence_batching.regions: {e}"))?;
            }
        }
        for (key, gate) in [
            ("frame_gate", &self.frame_gate),
            ("region_gate", &self.region_gate),
        ] {
            if let Some(g) = gate {
                g.validate()
                    .map_err(|e| format!("sequence_batching.{key}: {e}"))?;
            }
        }
        let idle = self
            .max_sequence_idle_microseconds
            .unwrap_or(DEFAULT_SEQUENCE_IDLE_US);
        if idle == 0 {
            return Err(
                "sequence_batching.max_sequence_idle_microseconds must be at least 1".into(),
            );
        }
        let max_active = self
            .max_active_sequences
            .unwrap_or(DEFAULT_MAX_ACTIVE_SEQUENCES);
        if max_active == 0 {
            return Err("sequence_batching.max_active_sequences must be at least 1".into());
        }
        let per_frame = match self.output.as_deref() {
            None | Some("classes") => {
                for (key, set) in [
                    ("tiles", self.tiles.is_some()),
                    ("thumb_block", self.thumb_block.is_some()),
                    ("max_detections", self.max_detections.is_some()),
                ] {
                    if set {
                        return Err(format!(
                            "sequence_batching.{key} belongs to a per-frame model: set output = \"mask\", \"image\" or \"boxes\", or remove it"
                        ));
                    }
                }
                None
            }
            Some(name) => {
                let kind = kiln::stream::OutputKind::from_name(name)
                    .filter(|k| !matches!(k, kiln::stream::OutputKind::Classes))
                    .ok_or_else(|| {
                        format!(
                            "sequence_batching.output {name:?} is not one of classes, mask, image, boxes"
                        )
                    })?;
                if regions.is_some() || self.region_gate.is_some() || !cascade.is_empty() {
                    return Err(
                        "sequence_batching: regions, region_gate and cascade are for classifiers; a per-frame model (output = ...) finds its regions itself: use tiles = { threshold = ..., margin = ... }"
                            .into(),
                    );
                }
                let thumb_block = self.thumb_block.unwrap_or(4);
                let max_detections = self.max_detections.unwrap_or(100);
                if thumb_block == 0 || max_detections == 0 {
                    return Err(
                        "sequence_batching.thumb_block and max_detections must be at least 1"
                            .into(),
                    );
                }
                let techniques = kiln::stream::VideoTechniques {
                    frame_gate: self.frame_gate,
                    regions: self.tiles,
                    multiscale: None,
                };
                techniques
                    .check_for(kind, None)
                    .map_err(|e| format!("sequence_batching: {e}"))?;
                Some(PerFrameConfig {
                    kind,
                    techniques,
                    thumb_block,
                    max_detections,
                })
            }
        };
        Ok(SequenceConfig {
            per_frame,
            frame_dims,
            stream: kiln::stream::StreamConfig {
                frame_gate: self.frame_gate,
                regions,
                region_gate: self.region_gate,
            },
            max_idle: Duration::from_micros(idle),
            cascade,
            max_active,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    backend: String,
    model: Option<String>,
    checkpoint: Option<PathBuf>,
    passes: Option<String>,
    input_shape: Option<[usize; 3]>,
    graph: Option<PathBuf>,
    file: Option<PathBuf>,
    dims: Option<Vec<usize>>,
    input_dims: Option<BTreeMap<String, Vec<usize>>>,
    int8_layers: Option<Vec<String>>,
    winograd_layers: Option<Vec<String>>,
    datatype: Option<String>,
    execute_delay_microseconds: Option<u64>,
    kiln_kernels: Option<bool>,
    #[serde(default = "default_max_batch")]
    max_batch_size: usize,
    #[serde(default = "one")]
    instances: usize,
    kind: Option<String>,
    #[serde(default = "default_queue")]
    max_queue_size: usize,
    #[serde(default)]
    timeout_microseconds: u64,
    dynamic_batching: Option<RawBatching>,
    sequence_batching: Option<RawSequence>,
    version_policy: Option<toml::Value>,
    warmup: Option<RawWarmup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBatching {
    #[serde(default)]
    max_queue_delay_microseconds: u64,
    #[serde(default)]
    preferred_batch_size: Vec<usize>,
}

fn default_max_batch() -> usize {
    64
}
fn one() -> usize {
    1
}
fn default_queue() -> usize {
    1024
}

impl ModelConfig {
    /// Reads and validates `dir/config.toml`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.toml");
        let text = std::fs::read_to_string(&path).map_err(|e| ServeError::Config {
            path: path.display().to_string(),
            message: format!("cannot read it ({e}); every model directory needs a config.toml"),
        })?;
        Self::parse(&text, dir).map_err(|message| ServeError::Config {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses a configuration whose relative paths resolve against `dir`.
    pub fn parse(text: &str, dir: &Path) -> std::result::Result<Self, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.message().to_string())?;
        let need = |v: Option<String>, key: &str| {
            v.ok_or_else(|| format!("backend `{}` needs `{key}`", raw.backend))
        };
        let backend = match raw.backend.as_str() {
            "zoo" => BackendConfig::Zoo {
                model: need(raw.model.clone(), "model")?,
                checkpoint: dir.join(
                    raw.checkpoint
                        .clone()
                        .ok_or("backend `zoo` needs `checkpoint` (a Kiln checkpoint file)")?,
                ),
                passes: raw.passes.clone().unwrap_or_default(),
                input_shape: raw.input_shape.unwrap_or([1, 28, 28]),
            },
            "graph" => BackendConfig::Graph {
                path: dir.join(
                    raw.graph
                        .clone()
                        .ok_or("backend `graph` needs `graph` (a model.kgraph file)")?,
                ),
            },
            "onnx" => BackendConfig::Onnx {
                path: dir.join(
                    raw.file
                        .clone()
                        .ok_or("backend `onnx` needs `file` (an .onnx model)")?,
                ),
                passes: raw.passes.clone().unwrap_or_default(),
                input_dims: raw.input_dims.clone().unwrap_or_default(),
                int8_layers: raw.int8_layers.clone(),
                winograd_layers: raw.winograd_layers.clone(),
            },
            "identity" => {
                let datatype = raw.datatype.clone().unwrap_or_else(|| "FP32".into());
                if datatype != "FP32" && datatype != "INT64" {
                    return Err(format!(
                        "identity datatype `{datatype}` is not supported; use FP32 or INT64"
                    ));
                }
                let dims = raw.dims.clone().ok_or("backend `identity` needs `dims`")?;
                if dims.is_empty() || dims.contains(&0) {
                    return Err(format!(
                        "identity dims {dims:?} must be non-empty and positive"
                    ));
                }
                BackendConfig::Identity {
                    dims,
                    datatype,
                    execute_delay: Duration::from_micros(
                        raw.execute_delay_microseconds.unwrap_or(0),
                    ),
                }
            }
            other => {
                return Err(format!(
                    "unknown backend `{other}`; use zoo, graph, onnx or identity"
                ));
            }
        };
        let set = [
            ("model", raw.model.is_some()),
            ("checkpoint", raw.checkpoint.is_some()),
            ("passes", raw.passes.is_some()),
            ("input_shape", raw.input_shape.is_some()),
            ("graph", raw.graph.is_some()),
            ("file", raw.file.is_some()),
            ("dims", raw.dims.is_some()),
            ("input_dims", raw.input_dims.is_some()),
            ("int8_layers", raw.int8_layers.is_some()),
            ("winograd_layers", raw.winograd_layers.is_some()),
            ("datatype", raw.datatype.is_some()),
            (
                "execute_delay_microseconds",
                raw.execute_delay_microseconds.is_some(),
            ),
            ("kiln_kernels", raw.kiln_kernels.is_some()),
        ];
        let allowed: &[&str] = match &backend {
            BackendConfig::Zoo { .. } => &[
                "model",
                "checkpoint",
                "passes",
                "input_shape",
                "kiln_kernels",
            ],
            BackendConfig::Graph { .. } => &["graph", "kiln_kernels"],
            BackendConfig::Onnx { .. } => &[
                "file",
                "passes",
                "input_dims",
                "int8_layers",
                "winograd_layers",
                "kiln_kernels",
            ],
            BackendConfig::Identity { .. } => &["dims", "datatype", "execute_delay_microseconds"],
        };
        let stray: Vec<&str> = set
            .iter()
            .filter(|(key, is_set)| *is_set && !allowed.contains(key))
            .map(|(key, _)| *key)
            .collect();
        if !stray.is_empty() {
            return Err(format!(
                "key(s) {} do not apply to backend `{}`; remove them",
                stray.join(", "),
                raw.backend
            ));
        }
        if raw.max_batch_size == 0 {
            return Err("max_batch_size must be at least 1".into());
        }
        if raw.instances == 0 || raw.instances > 64 {
            return Err(format!("instances = {} must be 1..=64", raw.instances));
        }
        if raw.max_queue_size == 0 {
            return Err("max_queue_size must be at least 1".into());
        }
        let dynamic_batching = match raw.dynamic_batching {
            None => None,
            Some(b) => {
                let mut preferred = b.preferred_batch_size;
                preferred.sort_unstable();
                preferred.dedup();
                if let Some(bad) = preferred
                    .iter()
                    .find(|&&p| p == 0 || p > raw.max_batch_size)
                {
                    return Err(format!(
                        "preferred_batch_size {bad} must be 1..=max_batch_size ({})",
                        raw.max_batch_size
                    ));
                }
                Some(DynamicBatching {
                    max_queue_delay: Duration::from_micros(b.max_queue_delay_microseconds),
                    preferred_batch_sizes: preferred,
                })
            }
        };
        let kind = match &raw.kind {
            Some(text) => InstanceKind::parse(text)?,
            None => InstanceKind::Auto,
        };
        let sequence = match raw.sequence_batching {
            None => None,
            Some(_) if matches!(backend, BackendConfig::Identity { .. }) => {
                return Err(
                    "sequence_batching needs a classifier backend (zoo, graph or onnx), not identity"
                        .into(),
                );
            }
            Some(seq) => Some(seq.validate(dir)?),
        };
        let version_policy = match &raw.version_policy {
            Some(v) => VersionPolicy::parse(v)?,
            None => VersionPolicy::default(),
        };
        let warmup = match raw.warmup {
            None => None,
            // A stream model's executions carry sequence state: a warm-up would have to start
            // and end sequences of its own, which no client could tell from theirs.
            Some(_) if sequence.is_some() => {
                return Err(
                    "warmup is not supported for stream models ([sequence_batching]); remove [warmup]"
                        .into(),
                );
            }
            Some(w) => Some(w.validate(raw.max_batch_size)?),
        };
        Ok(ModelConfig {
            backend,
            max_batch_size: raw.max_batch_size,
            instances: raw.instances,
            kind,
            max_queue_size: raw.max_queue_size,
            timeout: (raw.timeout_microseconds > 0)
                .then(|| Duration::from_micros(raw.timeout_microseconds)),
            dynamic_batching,
            kiln_kernels: raw.kiln_kernels.unwrap_or(true),
            sequence,
            version_policy,
            warmup,
        })
    }
}

#[cfg(test)]
mod tests;
