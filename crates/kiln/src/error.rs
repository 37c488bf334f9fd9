//! The library's error type: every variant names the problem and, where there is one, the fix.

use std::path::{Path, PathBuf};

/// Result alias used throughout Kiln.
pub type Result<T, E = KilnError> = std::result::Result<T, E>;

/// Everything that can go wrong in Kiln, with enough context to act on.
#[derive(Debug, thiserror::Error)]
pub enum KilnError {
    /// A configuration key that Kiln does not know.
    #[error("unknown config key `{key}`{hint}")]
    UnknownKey {
        /// The key as written (dotted path).
        key: String,
        /// A "did you mean" suggestion, or empty.
        hint: String,
    },
    /// A configuration value of the wrong type or outside its allowed range.
    #[error("invalid value {value} for `{key}`: expected {expected}")]
    InvalidValue {
        /// The key (dotted path).
        key: String,
        /// The offending value as written.
        value: String,
        /// What is allowed.
        expected: String,
    },
    /// A configuration that is valid key by key but contradicts itself.
    #[error("inconsistent configuration: {0}")]
    Inconsistent(String),
    /// The TOML text itself does not parse.
    #[error("cannot parse config {path}: {message}")]
    ConfigSyntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A data file is missing, truncated, corrupt or of the wrong format.
    #[error("bad data file {path}: {problem}")]
    BadData {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A checkpoint that cannot be used.
    #[error("bad checkpoint {path}: {problem}")]
    BadCheckpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A model name that the zoo does not have.
    #[error(
        "unknown model `{0}`: expected one of mlp (W1), cnn (W2), transformer (W4), resnet (W5)"
    )]
    UnknownModel(String),
    /// A shape mismatch between data and model.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The numbers went non-finite during training.
    #[error(
        "training diverged at step {step}: {detail}; lower the learning rate, enable gradient \
         clipping (train.grad_clip_norm), or let the guard skip bad steps (guard.policy = \"skip\")"
    )]
    Diverged {
        /// Global optimizer step.
        step: u64,
        /// The loss value that was seen.
        loss: f32,
        /// What went non-finite, where, and what the guard did before stopping.
        detail: String,
    },
    /// An I/O error with the path it concerns (and, when the disk is full, which one).
    #[error("I/O error on {path}: {source}{}", disk_full_hint(path, source))]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A model holds a layer a pass (lowering, folding, quantization, export) cannot handle.
    #[error("{pass}: unsupported layer {layer}; {fix}")]
    Unsupported {
        /// The pass that refused.
        pass: String,
        /// The layer (module path and kind).
        layer: String,
        /// What the user can do.
        fix: String,
    },
    /// One sample of a dataset could not be produced (the dataset returned an error or its
    /// code panicked); the loader stops the epoch and reports which sample.
    #[error("data item {index}: {problem}")]
    DataItem {
        /// The sample index in the dataset.
        index: usize,
        /// What went wrong.
        problem: String,
    },
    /// The data loader itself failed (a worker thread died, the loader was misconfigured).
    #[error("data loader: {0}")]
    Loader(String),
    /// A disk-cache operation failed in a way that cannot be recovered by recomputing.
    #[error("disk cache {path}: {problem}")]
    Cache {
        /// The cache directory or entry.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A video file that cannot be opened or decoded: the file, and what is wrong with it.
    #[error("video {path}: {problem}")]
    Video {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A real-time stream problem (frame shape, region, gate or threshold setting).
    #[error("stream: {0}")]
    Stream(String),
    /// A data-parallel collective (all-reduce, broadcast) failed, or the ranks disagree.
    #[error("data parallel: {0}")]
    Collective(String),
    /// Another rank of a data-parallel group stopped (failed, panicked, or hung past the
    /// group's timeout), so this one cannot go on: the other rank's own error is the cause.
    #[error("data parallel: {0}; this rank stops too")]
    PeerLost(String),
    /// An inference graph or session could not be built or run.
    #[error("inference: {0}")]
    Inference(String),
    /// An ONNX model could not be loaded or run: the importer's own error (`onnx::OnnxError`),
    /// boxed so this type, the lowest of the library, names no module above it (the importer
    /// provides the `From`).
    #[error("ONNX model: {0}")]
    Onnx(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A Burn record (weights or optimizer state) that could not be (de)serialized.
    #[error("cannot (de)serialize {what}: {message}")]
    Record {
        /// What was being handled.
        what: &'static str,
        /// Burn's message.
        message: String,
    },
}

impl KilnError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// When `error` says the disk is full (or the quota is spent), a clause naming the file system
/// that holds `path` — its mount point and type, read from `/proc/self/mounts` — and the fix;
/// otherwise empty. "No space left on device" alone does not say *which* device: a checkpoint
/// directory on its own mount, a tmpfs `/tmp` or a container's overlay each need another fix.
pub fn disk_full_hint(path: &Path, error: &std::io::Error) -> String {
    // ENOSPC and EDQUOT on Linux; the kinds cover the other platforms.
    let full = matches!(
        error.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    ) || matches!(error.raw_os_error(), Some(28 | 122));
    if !full {
        return String::new();
    }
    let place = match mount_of(path) {
        Some((mount, fs_type)) => format!("the {fs_type} file system mounted at {mount}"),
        None => format!(
            "the disk holding {}",
            path.parent().unwrap_or(path).display()
        ),
    };
    format!("; {place} is full: free space there or write to another disk")
}

/// The mount point and file system type that hold `path` (the longest mount point that is a
/// prefix of its nearest existing ancestor, resolved).
fn mount_of(path: &Path) -> Option<(String, String)> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let existing = path.ancestors().find(|p| p.exists())?;
    let resolved = existing.canonicalize().ok()?;
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_device, mount, fs_type) = (fields.next()?, fields.next()?, fields.next()?);
            // /proc/self/mounts escapes spaces and the like as octal (\040).
            let mount = mount.replace("\\040", " ").replace("\\011", "\t");
            resolved
                .starts_with(&mount)
                .then(|| (mount, fs_type.to_string()))
        })
        .max_by_key(|(mount, _)| mount.len())
}
