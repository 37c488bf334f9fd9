//! Atomic, checksummed checkpoints: model weights, optimizer state and loop position.
//!
//! File layout: `KILNCKP1`, then three length-prefixed sections (JSON state, model record,
//! optimizer record; lengths are little-endian u64), then the SHA-256 of everything before
//! it. Writes go to a temporary file in the same directory, are fsynced, then renamed over
//! the target, so a crash leaves either the old checkpoint or the new one, never a torn one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{KilnError, Result};

const MAGIC: &[u8; 8] = b"KILNCKP1";
const DIGEST_LEN: usize = 32;

/// Where the loop stood when the checkpoint was taken (always at an optimizer-step
/// boundary), and what it had measured so far.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointState {
    /// Zoo model name.
    pub model: String,
    /// Epoch to continue in (0-based).
    pub epoch: usize,
    /// Index of the next optimizer step within that epoch.
    pub step_in_epoch: usize,
    /// Optimizer steps taken so far.
    pub global_step: u64,
    /// The trajectory-shaping settings, to refuse a resume that would not continue this run.
    pub fingerprint: Vec<(String, String)>,
    /// Running sum of the epoch's training loss × samples, so the epoch mean is exact.
    pub epoch_loss_sum: f64,
    /// Samples seen so far in the current epoch.
    pub epoch_samples: u64,
    /// Loss-scaler state (absent in checkpoints of unscaled runs).
    #[serde(default)]
    pub scaler: Option<crate::precision::ScalerState>,
}

/// A checkpoint in memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Loop position.
    pub state: CheckpointState,
    /// Burn module record bytes.
    pub model: Vec<u8>,
    /// Burn optimizer record bytes.
    pub optimizer: Vec<u8>,
}

impl Checkpoint {
    /// Serializes the checkpoint with its trailing digest.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let header = serde_json::to_vec(&self.state).map_err(|e| KilnError::Record {
            what: "checkpoint state",
            message: e.to_string(),
        })?;
        let mut out = Vec::with_capacity(
            MAGIC.len() + 24 + header.len() + self.model.len() + self.optimizer.len() + DIGEST_LEN,
        );
        out.extend_from_slice(MAGIC);
        for section in [&header[..], &self.model[..], &self.optimizer[..]] {
            out.extend_from_slice(&(section.len() as u64).to_le_bytes());
            out.extend_from_slice(section);
        }
        let digest = Sha256::digest(&out);
        out.extend_from_slice(&digest);
        Ok(out)
    }

    /// Parses and verifies bytes written by [`Checkpoint::to_bytes`].
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |problem: &str| KilnError::BadCheckpoint {
            path: path.to_path_buf(),
            problem: problem.to_string(),
        };
        if bytes.len() < MAGIC.len() + DIGEST_LEN || &bytes[..MAGIC.len()] != MAGIC {
            return Err(bad(
                "not a Kiln checkpoint (wrong magic bytes); pass a file written by `kiln train --checkpoint-dir`",
            ));
        }
        let (body, digest) = bytes.split_at(bytes.len() - DIGEST_LEN);
        if Sha256::digest(body).as_slice() != digest {
            return Err(bad(
                "checksum mismatch: the file is truncated or corrupt; resume from an earlier checkpoint",
            ));
        }
        let mut rest = &body[MAGIC.len()..];
        let mut sections = Vec::with_capacity(3);
        for _ in 0..3 {
            if rest.len() < 8 {
                return Err(bad("section header missing"));
            }
            let (len, tail) = rest.split_at(8);
            let len = u64::from_le_bytes(len.try_into().map_err(|_| bad("bad length"))?) as usize;
            if tail.len() < len {
                return Err(bad("section longer than the file"));
            }
            let (section, tail) = tail.split_at(len);
            sections.push(section);
            rest = tail;
        }
        let state: CheckpointState = serde_json::from_slice(sections[0])
            .map_err(|e| bad(&format!("unreadable state section: {e}")))?;
        Ok(Checkpoint {
            state,
            model: sections[1].to_vec(),
            optimizer: sections[2].to_vec(),
        })
    }

    /// Writes the checkpoint atomically (temp file + fsync + rename); returns its size.
    pub fn save(&self, path: &Path) -> Result<u64> {
        let bytes = self.to_bytes()?;
        crate::fsutil::write_atomic(path, &bytes)?;
        Ok(bytes.len() as u64)
    }

    /// Reads and verifies a checkpoint.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
        Self::from_bytes(&bytes, path)
    }

    /// The file name for a checkpoint at `step`.
    pub fn file_name(step: u64) -> String {
        format!("step-{step:08}.kiln")
    }
}

/// The checkpoints in `dir` (files named `step-NNNNNNNN.kiln`), oldest first.
pub fn checkpoints_in(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(KilnError::io(dir, e)),
    };
    let mut found: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let step = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("step-"))
                .and_then(|n| n.strip_suffix(".kiln"))
                .and_then(|n| n.parse::<u64>().ok())?;
            Some((step, entry.path()))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// The newest checkpoint in `dir` (highest step), if any.
pub fn latest_checkpoint(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(checkpoints_in(dir)?.pop().map(|(_, p)| p))
}

/// Deletes all but the newest `keep` checkpoints in `dir` (`keep` 0: none deleted) and
/// returns the paths it deleted. Called only after the newest is on disk, so a crash at any
/// point leaves at least the checkpoints it meant to keep. A file that cannot be deleted is
/// logged and skipped: retention must never fail a run.
pub fn prune_checkpoints(dir: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let all = checkpoints_in(dir)?;
    let surplus = all.len().saturating_sub(keep);
    let mut deleted = Vec::new();
    for (_, path) in all.into_iter().take(surplus) {
        match std::fs::remove_file(&path) {
            Ok(()) => deleted.push(path),
            Err(e) => tracing::warn!("could not delete old checkpoint {}: {e}", path.display()),
        }
    }
    Ok(deleted)
}
