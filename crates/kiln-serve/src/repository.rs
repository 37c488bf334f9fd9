//! The model repository: one directory per model, each loaded or held back with its reason.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::config::{InstanceKind, ModelConfig};
use crate::error::{Result, ServeError};
use crate::pipeline::{ModelRuntime, Stages};

/// A model's state in the repository.
#[derive(Debug)]
pub enum Entry {
    /// Loaded and serving.
    Ready(Arc<ModelRuntime>),
    /// Not loaded; the reason is logged and reported by the ready and index endpoints.
    Unavailable(String),
}

/// One row of the repository index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    /// Model name.
    pub name: String,
    /// `READY` or `UNAVAILABLE`.
    pub state: &'static str,
    /// Why it is unavailable; empty when ready.
    pub reason: String,
}

/// Every model the server knows, by name.
#[derive(Debug, Default)]
pub struct Repository {
    models: BTreeMap<String, Entry>,
}

impl Repository {
    /// Loads every model directory under `dir` (hidden ones skipped). A model whose config
    /// or weights are bad is kept as [`Entry::Unavailable`] with the reason; the others
    /// serve. Only an unreadable `dir` is an error.
    pub fn load(dir: &Path, stages: Stages) -> Result<Self> {
        Self::load_on(dir, stages, InstanceKind::Auto)
    }

    /// [`Repository::load`], with the models whose config says `KIND_AUTO` (or nothing) run
    /// as `default` (`kiln serve --device`).
    pub fn load_on(dir: &Path, stages: Stages, default: InstanceKind) -> Result<Self> {
        let listing = std::fs::read_dir(dir).map_err(|e| ServeError::Config {
            path: dir.display().to_string(),
            message: format!("cannot read the model repository ({e}); pass an existing directory"),
        })?;
        let mut dirs: Vec<_> = listing
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .filter(|p| {
                !p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        dirs.sort();
        let mut repo = Repository::default();
        for path in dirs {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let entry = ModelConfig::load(&path).and_then(|mut config| {
                config.kind = config.kind.or(default);
                ModelRuntime::start(&name, config, stages)
            });
            repo.insert(&name, entry);
        }
        Ok(repo)
    }

    /// Adds a model from a load result (a failure is kept, with its reason).
    pub fn insert(&mut self, name: &str, loaded: Result<Arc<ModelRuntime>>) {
        let entry = match loaded {
            Ok(rt) => {
                tracing::info!(
                    model = name,
                    max_batch_size = rt.config.max_batch_size,
                    instances = rt.config.instances,
                    dynamic_batching = rt.config.dynamic_batching.is_some(),
                    "model ready"
                );
                Entry::Ready(rt)
            }
            Err(e) => {
                tracing::error!(model = name, reason = %e, "model not loaded");
                Entry::Unavailable(e.to_string())
            }
        };
        self.models.insert(name.to_string(), entry);
    }

    /// The entry for `name`, or `ModelNotFound`.
    pub fn entry(&self, name: &str) -> Result<&Entry> {
        self.models
            .get(name)
            .ok_or_else(|| ServeError::ModelNotFound(name.to_string()))
    }

    /// The running model `name`, or why it cannot serve.
    pub fn runtime(&self, name: &str) -> Result<Arc<ModelRuntime>> {
        match self.entry(name)? {
            Entry::Ready(rt) => Ok(Arc::clone(rt)),
            Entry::Unavailable(reason) => Err(ServeError::ModelNotReady {
                model: name.to_string(),
                reason: reason.clone(),
            }),
        }
    }

    /// All running models.
    pub fn ready_runtimes(&self) -> Vec<Arc<ModelRuntime>> {
        self.models
            .values()
            .filter_map(|e| match e {
                Entry::Ready(rt) => Some(Arc::clone(rt)),
                Entry::Unavailable(_) => None,
            })
            .collect()
    }

    /// Ready when at least one model serves (a broken model does not take the others down).
    pub fn is_ready(&self) -> bool {
        !self.ready_runtimes().is_empty()
    }

    /// Every model with its state and reason.
    pub fn index(&self) -> Vec<IndexEntry> {
        self.models
            .iter()
            .map(|(name, e)| match e {
                Entry::Ready(_) => IndexEntry {
                    name: name.clone(),
                    state: "READY",
                    reason: String::new(),
                },
                Entry::Unavailable(reason) => IndexEntry {
                    name: name.clone(),
                    state: "UNAVAILABLE",
                    reason: reason.clone(),
                },
            })
            .collect()
    }

    /// Drains and stops every model's pipeline.
    pub fn shutdown(&self) {
        for rt in self.ready_runtimes() {
            rt.shutdown();
        }
    }
}
