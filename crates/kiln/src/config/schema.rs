//! The one declaration of every config key: type, allowed values, documentation and the
//! default at each level. Validation, `kiln plan` and the docs all read this table.

use super::Level;
use crate::error::KilnError;

/// A setting's type and allowed values.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// An integer in `[min, max]`.
    Int {
        /// Smallest allowed value.
        min: i64,
        /// Largest allowed value.
        max: i64,
    },
    /// A float in `[min, max]` (an integer literal is accepted too).
    Float {
        /// Smallest allowed value.
        min: f64,
        /// Largest allowed value.
        max: f64,
    },
    /// `true` or `false`.
    Bool,
    /// One of a fixed set of strings.
    Enum(&'static [&'static str]),
    /// Free text (paths).
    Text,
    /// An integer in `[min, max]` or the string `"auto"` (measured at run time).
    IntOrAuto {
        /// Smallest allowed value.
        min: i64,
        /// Largest allowed value.
        max: i64,
    },
}

/// A default value in the static table.
#[derive(Debug, Clone, Copy)]
pub enum Dflt {
    /// Integer default.
    I(i64),
    /// Float default.
    F(f64),
    /// Boolean default.
    B(bool),
    /// String default.
    S(&'static str),
}

impl Dflt {
    /// The default as a TOML value.
    pub fn to_value(self) -> toml::Value {
        match self {
            Dflt::I(v) => toml::Value::Integer(v),
            Dflt::F(v) => toml::Value::Float(v),
            Dflt::B(v) => toml::Value::Boolean(v),
            Dflt::S(v) => toml::Value::String(v.to_string()),
        }
    }
}

/// One config key.
#[derive(Debug)]
pub struct SettingSpec {
    /// Dotted key, e.g. `train.lr`.
    pub key: &'static str,
    /// Type and allowed values.
    pub kind: Kind,
    /// The neutral default (used by `basic` and `custom`).
    pub default: Dflt,
    /// Level-specific defaults that differ from the neutral one.
    pub levels: &'static [(Level, Dflt)],
    /// One line for `kiln plan` and the docs.
    pub doc: &'static str,
}

use Dflt::{B, F, I, S};

/// Every key Kiln accepts (besides the top-level `level`).
pub static SETTINGS: &[SettingSpec] = &[
    SettingSpec {
        key: "train.model",
        kind: Kind::Enum(&["mlp", "cnn", "transformer", "resnet"]),
        default: S("cnn"),
        levels: &[],
        doc: "zoo model: mlp (W1), cnn (W2), transformer (W4), resnet (W5)",
    },
    SettingSpec {
        key: "train.epochs",
        kind: Kind::Int {
            min: 1,
            max: 100_000,
        },
        default: I(3),
        levels: &[],
        doc: "passes over the training set",
    },
    SettingSpec {
        key: "train.batch_size",
        kind: Kind::Int {
            min: 1,
            max: 1 << 20,
        },
        default: I(64),
        levels: &[],
        doc: "micro-batch size (samples per forward/backward)",
    },
    SettingSpec {
        key: "train.grad_accum_steps",
        kind: Kind::Int {
            min: 1,
            max: 65_536,
        },
        default: I(1),
        levels: &[],
        doc: "micro-batches per optimizer step (effective batch = batch_size x this)",
    },
    SettingSpec {
        key: "train.optimizer",
        kind: Kind::Enum(crate::train::OptimizerKind::NAMES),
        default: S("adam"),
        levels: &[],
        doc: "optimizer: adam, adamw (decoupled weight decay) or sgd (with momentum)",
    },
    SettingSpec {
        key: "train.lr",
        kind: Kind::Float {
            min: 1e-12,
            max: 10.0,
        },
        default: F(1e-3),
        levels: &[],
        doc: "peak learning rate",
    },
    SettingSpec {
        key: "train.weight_decay",
        kind: Kind::Float { min: 0.0, max: 1.0 },
        default: F(0.0),
        levels: &[],
        doc: "weight decay (decoupled for adamw, L2 for adam/sgd)",
    },
    SettingSpec {
        key: "train.momentum",
        kind: Kind::Float {
            min: 0.0,
            max: 0.999_999,
        },
        default: F(0.9),
        levels: &[],
        doc: "SGD momentum (sgd only)",
    },
    SettingSpec {
        key: "train.schedule",
        kind: Kind::Enum(crate::train::Schedule::NAMES),
        default: S("constant"),
        levels: &[(Level::Advanced, S("cosine")), (Level::Ultra, S("cosine"))],
        doc: "learning-rate schedule after warm-up: constant or cosine decay to min_lr_ratio x lr",
    },
    SettingSpec {
        key: "train.warmup_steps",
        kind: Kind::Int {
            min: 0,
            max: 10_000_000,
        },
        default: I(0),
        levels: &[(Level::Advanced, I(50)), (Level::Ultra, I(50))],
        doc: "optimizer steps of linear learning-rate warm-up",
    },
    SettingSpec {
        key: "train.min_lr_ratio",
        kind: Kind::Float { min: 0.0, max: 1.0 },
        default: F(0.05),
        levels: &[],
        doc: "cosine schedule floor as a fraction of lr",
    },
    SettingSpec {
        key: "train.grad_clip_norm",
        kind: Kind::Float { min: 0.0, max: 1e9 },
        default: F(0.0),
        levels: &[(Level::Advanced, F(1.0)), (Level::Ultra, F(1.0))],
        doc: "clip gradients by global L2 norm over all parameters (0 = off), like torch's clip_grad_norm_",
    },
    SettingSpec {
        key: "train.activation_checkpointing",
        kind: Kind::Bool,
        default: B(false),
        levels: &[(Level::Ultra, B(true))],
        doc: "recompute memory-bound activations in backward (Burn's balanced checkpointing)",
    },
    SettingSpec {
        key: "train.seed",
        kind: Kind::Int {
            min: 0,
            max: i64::MAX,
        },
        default: I(42),
        levels: &[],
        doc: "seed for initialization and data order (same seed = same run)",
    },
    SettingSpec {
        key: "train.max_steps",
        kind: Kind::Int {
            min: 0,
            max: i64::MAX,
        },
        default: I(0),
        levels: &[],
        doc: "stop after this many optimizer steps (0 = no limit); the schedule still spans all epochs, so the run can be resumed",
    },
    SettingSpec {
        key: "train.sync_every",
        kind: Kind::Int {
            min: 0,
            max: 1_000_000,
        },
        default: I(0),
        levels: &[],
        doc: "optimizer steps between the loop's reads of losses, guard verdicts and norms from the device (0 = auto: every step on the CPU, 25 on a GPU); the trajectory is the same at any value",
    },
    SettingSpec {
        key: "train.eval_every_epochs",
        kind: Kind::Int {
            min: 0,
            max: 100_000,
        },
        default: I(1),
        levels: &[],
        doc: "evaluate on the test split every N epochs (0 = only at the end)",
    },
    SettingSpec {
        key: "train.checkpoint_dir",
        kind: Kind::Text,
        default: S(""),
        levels: &[],
        doc: "directory for atomic checkpoints (empty = no checkpoints)",
    },
    SettingSpec {
        key: "train.checkpoint_every_steps",
        kind: Kind::Int {
            min: 0,
            max: i64::MAX,
        },
        default: I(0),
        levels: &[],
        doc: "also checkpoint every N optimizer steps (0 = at each epoch end only)",
    },
    SettingSpec {
        key: "train.data_parallel",
        kind: Kind::Enum(&["auto", "off", "gpus"]),
        default: S("auto"),
        levels: &[],
        doc: "data parallelism: auto = when launched as one of N ranks (mpirun -n N, or kiln \
              train --processes N; the mpi build), train one model over them, batch_size per \
              rank, gradients all-reduced once per step; gpus = one rank per CUDA device \
              inside this process, gradients all-reduced on the devices (the cuda build); \
              off = refuse a multi-rank launch",
    },
    SettingSpec {
        key: "train.keep_checkpoints",
        kind: Kind::Int {
            min: 0,
            max: 1 << 20,
        },
        default: I(crate::train::DEFAULT_KEEP_CHECKPOINTS as i64),
        levels: &[],
        doc: "checkpoints kept in train.checkpoint_dir: older ones are deleted once a newer one \
              is on disk (0 = keep all)",
    },
    SettingSpec {
        key: "train.collective_timeout_s",
        kind: Kind::Int {
            min: 0,
            max: 1 << 30,
        },
        default: I(1800),
        levels: &[],
        doc: "data parallelism: stop when a collective call waits longer than this many \
              seconds for the other ranks (a rank that hangs rather than dies: a stuck file \
              system, a deadlock); MPI aborts the job, GPU ranks in one process stop with an \
              error; 0 = wait forever. Must exceed what rank 0 does alone between two calls \
              (evaluation, checkpoints); 1800 is PyTorch's default process-group timeout",
    },
    SettingSpec {
        key: "precision.policy",
        kind: Kind::Enum(crate::precision::Precision::NAMES),
        default: S("f32"),
        levels: &[],
        doc: "numeric precision: f32, or bf16/f16 mixed precision (matmul/conv in low precision, f32 master weights, reductions, norms and loss)",
    },
    SettingSpec {
        key: "precision.loss_scaling",
        kind: Kind::Enum(crate::precision::ScalingMode::NAMES),
        default: S("auto"),
        levels: &[],
        doc: "loss scaling: auto = dynamic for f16, off for f32/bf16; dynamic = GradScaler semantics",
    },
    SettingSpec {
        key: "precision.init_scale",
        kind: Kind::Float {
            min: 1.0,
            max: 16_777_216.0,
        },
        default: F(65_536.0),
        levels: &[],
        doc: "initial loss scale of dynamic scaling (torch: 2^16)",
    },
    SettingSpec {
        key: "precision.growth_interval",
        kind: Kind::Int {
            min: 1,
            max: 1_000_000,
        },
        default: I(2_000),
        levels: &[],
        doc: "clean steps before the loss scale doubles (it halves on every overflow)",
    },
    SettingSpec {
        key: "guard.policy",
        kind: Kind::Enum(crate::guard::GuardPolicy::NAMES),
        default: S("abort"),
        levels: &[(Level::Advanced, S("skip")), (Level::Ultra, S("rollback"))],
        doc: "on non-finite loss/gradients/parameters: skip the step, roll back to the last good snapshot, or abort",
    },
    SettingSpec {
        key: "guard.max_consecutive",
        kind: Kind::Int {
            min: 1,
            max: 1_000_000,
        },
        default: I(10),
        levels: &[],
        doc: "abort after this many non-finite steps in a row",
    },
    SettingSpec {
        key: "guard.check_params",
        kind: Kind::Bool,
        default: B(false),
        levels: &[(Level::Advanced, B(true)), (Level::Ultra, B(true))],
        doc: "also check parameters after each update (one fused pass)",
    },
    SettingSpec {
        key: "guard.snapshot_every",
        kind: Kind::Int {
            min: 1,
            max: i64::MAX,
        },
        default: I(50),
        levels: &[],
        doc: "optimizer steps between in-memory snapshots used by rollback",
    },
    SettingSpec {
        key: "device.backend",
        kind: Kind::Enum(&["auto", "flex", "cuda"]),
        default: S("auto"),
        levels: &[],
        doc: "tensor backend: flex (embedded CPU), cuda (needs the cuda feature), auto = probe",
    },
    SettingSpec {
        key: "device.autotune",
        kind: Kind::Enum(&["default", "minimal", "balanced", "extensive", "full"]),
        default: S("default"),
        levels: &[],
        doc: "how many kernel variants Burn's autotune times per shape on cuda (CubeCL's \
              level, minimal .. full; default = CubeCL's own: balanced, or \
              CUBECL_AUTOTUNE_LEVEL); `kiln tune auto` A/Bs them on a GPU; no effect on flex",
    },
    SettingSpec {
        key: "device.kernel_cache",
        kind: Kind::Text,
        default: S("auto"),
        levels: &[],
        doc: "where CubeCL keeps compiled kernels and autotune results between runs on cuda, so a second process does not compile again: auto = the user cache directory (XDG_CACHE_HOME or ~/.cache)/kiln/cubecl; off = CubeCL's own default (under the build's target directory, compiled kernels not kept); or a directory; no effect on flex",
    },
    SettingSpec {
        key: "device.threads",
        kind: Kind::Int { min: 0, max: 4096 },
        default: I(0),
        levels: &[],
        doc: "CPU worker threads for the flex backend (0 = one per core, probed)",
    },
    SettingSpec {
        key: "device.memory_budget_mib",
        kind: Kind::Int {
            min: 0,
            max: 1 << 30,
        },
        default: I(0),
        levels: &[],
        doc: "memory a run may use, in MiB (0 = the device's: the GPU's on cuda, else the \
              cgroup limit or physical memory; --memory-budget 2GiB): the auto watermark \
              takes 85% of it, kiln tune batch searches under it",
    },
    SettingSpec {
        key: "infer.passes",
        kind: Kind::Text,
        default: S("strip,fold"),
        levels: &[
            (Level::Advanced, S("strip,fold,winograd,int8,channels-last")),
            (Level::Ultra, S("strip,fold,winograd,int8,channels-last")),
        ],
        doc: "inference passes `kiln optimize` applies, in order: strip, fold, winograd, int8, \
              f16 or bf16, channels-last (basic: the exact rewrites only; winograd, int8 and \
              channels-last — Kiln's kernels vs Burn's NCHW ops — are kept where they measure \
              faster; int8 costs <= 0.5 points of top-1)",
    },
    SettingSpec {
        key: "device.kiln_kernels",
        kind: Kind::Bool,
        default: B(true),
        levels: &[],
        doc: "Kiln's CPU kernels (f32 convolution forward and gradients as one GEMM per image) \
              in place of Burn's flex ops; false = Burn's own",
    },
    SettingSpec {
        key: "data.dir",
        kind: Kind::Text,
        default: S(""),
        levels: &[],
        doc: "the data: a directory of train/test .safetensors or *-images.npy + \
              *-labels.npy (memory-mapped) or MNIST-format IDX files; or image files: \
              imagefolder:DIR (DIR/<class>/*.jpg, or DIR/train + DIR/val), \
              manifest:FILE.csv|.jsonl, shards:'train-{000..099}.tar' (WebDataset), \
              packed:DIR (kiln data pack); empty = the bundled 5k MNIST subset",
    },
    SettingSpec {
        key: "data.image_size",
        kind: Kind::Int { min: 8, max: 4096 },
        default: I(224),
        levels: &[],
        doc: "side of the square model input image files are cropped and resized to \
              (training: RandomResizedCrop; evaluation: resize to size*256/224, center crop)",
    },
    SettingSpec {
        key: "data.on_bad_sample",
        kind: Kind::Enum(crate::data::vision::BadSamplePolicy::NAMES),
        default: S("error"),
        levels: &[],
        doc: "an image file that cannot be read or decoded: error (stop, naming the file and \
              why) or skip (leave it out of its batch, reported per epoch and in the summary)",
    },
    SettingSpec {
        key: "data.max_image_pixels",
        kind: Kind::Int {
            min: 1,
            max: 1 << 40,
        },
        default: I(178_956_970),
        levels: &[],
        doc: "image files whose header claims more pixels are refused before decoding \
              (decompression bombs; Pillow's limit)",
    },
    SettingSpec {
        key: "data.shuffle",
        kind: Kind::Bool,
        default: B(true),
        levels: &[],
        doc: "shuffle the training set each epoch (seeded by train.seed and the epoch)",
    },
    SettingSpec {
        key: "data.last_batch",
        kind: Kind::Enum(&["auto", "keep", "drop", "pad"]),
        default: S("auto"),
        levels: &[],
        doc: "the epoch's last, short batch: keep it, drop it, or pad it with the epoch's first samples so every batch has one shape (a GPU compiles kernels per shape); auto = keep on the CPU, pad on a GPU",
    },
    SettingSpec {
        key: "data.workers",
        kind: Kind::IntOrAuto { min: 0, max: 256 },
        default: I(0),
        levels: &[(Level::Advanced, S("auto")), (Level::Ultra, S("auto"))],
        doc: "loader worker threads (0 = load on the training thread; auto = measure a few \
              steps per count and take the fewest that keep data wait under 5% of step time)",
    },
    SettingSpec {
        key: "data.prefetch_factor",
        kind: Kind::Int { min: 1, max: 64 },
        default: I(2),
        levels: &[],
        doc: "batches each worker may prepare ahead of the trainer (bounds loader memory)",
    },
    SettingSpec {
        key: "train.oom_adaptive",
        kind: Kind::Bool,
        default: B(false),
        levels: &[(Level::Advanced, B(true)), (Level::Ultra, B(true))],
        doc: "on a memory watermark crossing, halve the micro-batch and double accumulation \
              (effective batch unchanged) instead of running out of memory",
    },
    SettingSpec {
        key: "observe.memory_watermark_mib",
        kind: Kind::IntOrAuto {
            min: 0,
            max: 1 << 30,
        },
        default: S("auto"),
        levels: &[],
        doc: "emit a memory_watermark event (and, with train.oom_adaptive, halve the \
              micro-batch) when memory in use reaches this many MiB (0 = off; auto = 85% of \
              device.memory_budget_mib, else of the device's memory: on cuda the GPU's, read \
              from its memory pool; on the CPU the cgroup limit or physical memory)",
    },
    SettingSpec {
        key: "data.augment",
        kind: Kind::Enum(&["none", "crop", "crop-flip", "affine"]),
        default: S("none"),
        levels: &[],
        doc: "per-sample augmentation in the workers, seeded by (seed, epoch, index): none, \
              crop (random crop with padding), crop-flip (+ horizontal flip), affine (±10°, \
              ±8% shift, 0.9–1.1 scale)",
    },
    SettingSpec {
        key: "stream.on_overload",
        kind: Kind::Enum(crate::stream::OverloadPolicy::NAMES),
        default: S("block"),
        levels: &[],
        doc: "what a full decode queue does with a new frame of a video: block (the decoder \
              waits, every frame runs: files) or drop-oldest (the model gets the newest \
              frame, drops counted: live cameras)",
    },
    SettingSpec {
        key: "stream.queue_frames",
        kind: Kind::Int { min: 1, max: 1024 },
        default: I(8),
        levels: &[],
        doc: "decoded frames the decoder may run ahead of the model (bounds the queue's memory)",
    },
    SettingSpec {
        key: "stream.gate_threshold",
        kind: Kind::Float { min: 0.0, max: 1.0 },
        default: F(0.01),
        levels: &[],
        doc: "temporal coherence: a frame is reused when no 16-pixel tile of its thumbnail \
              changed by more than this mean absolute luma difference (0..1) since the model \
              last ran",
    },
    SettingSpec {
        key: "stream.region_threshold",
        kind: Kind::Float { min: 0.0, max: 1.0 },
        default: F(0.01),
        levels: &[],
        doc: "regions of interest: a tile whose mean absolute luma difference is above this \
              runs again (each group of changed tiles is its own crop)",
    },
    SettingSpec {
        key: "stream.region_margin",
        kind: Kind::Int { min: 1, max: 4096 },
        default: I(48),
        levels: &[],
        doc: "context around a changed region, in input pixels (its inner half is pasted \
              back with the region; crops align to 32 pixels, a stride-32 backbone's grid)",
    },
    SettingSpec {
        key: "stream.region_max_age",
        kind: Kind::Int {
            min: 0,
            max: 100_000,
        },
        default: I(60),
        levels: &[],
        doc: "frames a region's (or the whole frame's) result may be reused before it runs \
              again",
    },
];

impl SettingSpec {
    /// The default for a level, and whether it is level-specific.
    pub fn default_for(&self, level: Level) -> (toml::Value, bool) {
        match self.levels.iter().find(|(l, _)| *l == level) {
            Some((_, d)) => (d.to_value(), true),
            None => (self.default.to_value(), false),
        }
    }

    /// A human description of what is allowed.
    pub fn expected(&self) -> String {
        match self.kind {
            Kind::Int { min, max } => format!("an integer in [{min}, {max}]"),
            Kind::Float { min, max } => format!("a number in [{min}, {max}]"),
            Kind::Bool => "true or false".into(),
            Kind::Enum(opts) => format!("one of {}", opts.join(", ")),
            Kind::Text => "a string".into(),
            Kind::IntOrAuto { min, max } => format!("\"auto\" or an integer in [{min}, {max}]"),
        }
    }

    /// Checks a TOML value against this key's kind, normalizing ints to floats for floats.
    pub fn validate(&self, value: &toml::Value) -> Result<toml::Value, KilnError> {
        let bad = || KilnError::InvalidValue {
            key: self.key.into(),
            value: value.to_string(),
            expected: self.expected(),
        };
        match (self.kind, value) {
            (Kind::Int { min, max }, toml::Value::Integer(v)) if (min..=max).contains(v) => {
                Ok(value.clone())
            }
            (Kind::Float { min, max }, toml::Value::Float(v))
                if v.is_finite() && *v >= min && *v <= max =>
            {
                Ok(value.clone())
            }
            (Kind::Float { min, max }, toml::Value::Integer(v))
                if (*v as f64) >= min && (*v as f64) <= max =>
            {
                Ok(toml::Value::Float(*v as f64))
            }
            (Kind::Bool, toml::Value::Boolean(_)) | (Kind::Text, toml::Value::String(_)) => {
                Ok(value.clone())
            }
            (Kind::Enum(opts), toml::Value::String(s)) if opts.contains(&s.as_str()) => {
                Ok(value.clone())
            }
            (Kind::IntOrAuto { min, max }, toml::Value::Integer(v)) if (min..=max).contains(v) => {
                Ok(value.clone())
            }
            (Kind::IntOrAuto { .. }, toml::Value::String(s)) if s == "auto" => Ok(value.clone()),
            _ => Err(bad()),
        }
    }

    /// Parses a command-line string into a value of this key's kind, then validates it.
    pub fn parse_flag(&self, raw: &str) -> Result<toml::Value, KilnError> {
        let bad = || KilnError::InvalidValue {
            key: self.key.into(),
            value: format!("{raw:?}"),
            expected: self.expected(),
        };
        let value = match self.kind {
            Kind::Int { .. } => toml::Value::Integer(raw.trim().parse().map_err(|_| bad())?),
            Kind::Float { .. } => toml::Value::Float(raw.trim().parse().map_err(|_| bad())?),
            Kind::Bool => toml::Value::Boolean(raw.trim().parse().map_err(|_| bad())?),
            Kind::Enum(_) | Kind::Text => toml::Value::String(raw.to_string()),
            Kind::IntOrAuto { .. } if raw.trim() == "auto" => toml::Value::String("auto".into()),
            Kind::IntOrAuto { .. } => toml::Value::Integer(raw.trim().parse().map_err(|_| bad())?),
        };
        self.validate(&value)
    }
}

/// Looks a key up in [`SETTINGS`].
pub fn find(key: &str) -> Option<&'static SettingSpec> {
    SETTINGS.iter().find(|s| s.key == key)
}

/// The error for an unknown key, with the closest known key as a hint.
pub fn unknown_key(key: &str) -> KilnError {
    let best = SETTINGS
        .iter()
        .map(|s| s.key)
        .chain(std::iter::once("level"))
        .map(|k| (edit_distance(key, k), k))
        .min();
    let hint = match best {
        Some((d, k)) if d <= 3 || k.ends_with(key.rsplit('.').next().unwrap_or(key)) => {
            format!(" (did you mean `{k}`? `kiln plan` lists every key)")
        }
        _ => " (`kiln plan` lists every key)".into(),
    };
    KilnError::UnknownKey {
        key: key.into(),
        hint,
    }
}

/// Levenshtein distance, for "did you mean" hints.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
