//! A scratch directory under the temp dir that a benchmark writes its files into, removed
//! when it goes out of scope — on every way out, errors included (`kiln bench --onnx` once
//! returned early on a missing Python and left the model's inputs behind).

use std::ops::Deref;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// `kiln-{name}-{pid}` under the temp dir; removed on drop.
pub struct WorkDir(PathBuf);

impl WorkDir {
    /// Creates the directory (and its parents).
    pub fn create(name: &str) -> Result<WorkDir> {
        let dir = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(WorkDir(dir))
    }
}

impl Deref for WorkDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        // Best effort: a leftover scratch directory is not worth failing the run over.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
