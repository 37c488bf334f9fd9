//! The model repository: every model the server knows, its numbered versions, and which of
//! them serve — loaded at start, and (by the model control mode) reloaded, loaded and
//! unloaded while the server runs, without dropping a request.
//!
//! A change never edits a serving version in place. A load builds the new version beside the
//! old one (weights, instances, warm-up), switches the table to it in one write, and hands
//! the old one to [`retire`], which lets the requests that already hold it finish before its
//! threads stop and its memory is freed. A version that fails to load leaves the serving one
//! in place; the index and the log say why.

mod disk;
mod poll;
mod retire;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub use disk::check_name;

use crate::config::InstanceKind;
use crate::error::{Result, ServeError};
use crate::pipeline::{ModelRuntime, Stages};
use disk::Fingerprint;
use retire::Retirer;

/// How the repository changes while the server runs: Triton's `--model-control-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelControlMode {
    /// Every model is loaded at start and never changes; load and unload requests are
    /// refused.
    #[default]
    None,
    /// Every model is loaded at start, and the repository is re-read every poll interval:
    /// new models and versions load, changed ones reload, removed ones unload. Load and
    /// unload requests are refused (the directory is the control).
    Poll,
    /// Only the models named at start load; clients load, reload and unload models with the
    /// repository extension's requests.
    Explicit,
}

impl ModelControlMode {
    /// Parses `none`, `poll` or `explicit`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text {
            "none" => Ok(ModelControlMode::None),
            "poll" => Ok(ModelControlMode::Poll),
            "explicit" => Ok(ModelControlMode::Explicit),
            other => Err(format!(
                "model control mode {other:?} is not one of none, poll, explicit"
            )),
        }
    }

    /// The mode's name as `--model-control-mode` takes it.
    pub fn name(self) -> &'static str {
        match self {
            ModelControlMode::None => "none",
            ModelControlMode::Poll => "poll",
            ModelControlMode::Explicit => "explicit",
        }
    }
}

/// How a repository loads and changes its models.
#[derive(Debug, Clone)]
pub struct RepositoryOptions {
    /// Where each model's decoding and encoding run.
    pub stages: Stages,
    /// Where models whose config says `KIND_AUTO` (or nothing) run (`kiln serve --device`).
    pub default_kind: InstanceKind,
    /// How the repository changes while serving.
    pub mode: ModelControlMode,
    /// Explicit mode: the models loaded at start (`*` = all of them); others wait for a
    /// load request. Ignored by the other modes, which load everything.
    pub startup_models: Vec<String>,
    /// Longest a replaced or unloaded version waits for its in-flight requests.
    pub drain_timeout: Duration,
    /// Called after a retired version's memory is freed, to hand freed pages back to the OS.
    /// The process's allocator decides whether and how (the `kiln` binary's mimalloc keeps
    /// freed pages mapped for training speed, so without this a server's resident memory
    /// would keep every reload's peak); `None` leaves it to the allocator.
    pub release_memory: Option<fn()>,
}

impl Default for RepositoryOptions {
    fn default() -> Self {
        RepositoryOptions {
            stages: Stages::default(),
            default_kind: InstanceKind::Auto,
            mode: ModelControlMode::None,
            startup_models: Vec::new(),
            drain_timeout: Duration::from_secs(60),
            release_memory: None,
        }
    }
}

/// The reason an explicit-mode model that nobody loaded is listed with.
const NOT_LOADED: &str = "not loaded (explicit model control: POST /v2/repository/models/M/load)";
/// The reason of a model a client unloaded.
const UNLOADED: &str = "unloaded";

/// One version of a model in the table.
#[derive(Debug, Clone)]
struct Version {
    /// `Some`: serving.
    runtime: Option<Arc<ModelRuntime>>,
    /// Why it does not serve; or, beside a runtime, why that runtime is an older load.
    reason: String,
    /// Its files as of the last load attempt (a poll reloads only what changed).
    fingerprint: Fingerprint,
}

/// A model in the table.
#[derive(Debug, Clone, Default)]
struct Model {
    /// Its versions that serve or failed to, by number.
    versions: BTreeMap<u64, Version>,
    /// Why the model as a whole has no version (not loaded, unloaded, no readable config).
    reason: String,
}

impl Model {
    fn unavailable(reason: &str) -> Self {
        Model {
            versions: BTreeMap::new(),
            reason: reason.to_string(),
        }
    }

    /// The highest-numbered serving version (what a request without a version gets).
    fn default_runtime(&self) -> Option<&Arc<ModelRuntime>> {
        self.versions
            .values()
            .rev()
            .find_map(|v| v.runtime.as_ref())
    }

    fn runtimes(&self) -> impl Iterator<Item = &Arc<ModelRuntime>> {
        self.versions.values().filter_map(|v| v.runtime.as_ref())
    }
}

/// One row of the repository index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    /// Model name.
    pub name: String,
    /// Version number; empty for a model with no version (not loaded, unloaded, bad config).
    pub version: String,
    /// `READY` or `UNAVAILABLE`.
    pub state: &'static str,
    /// Why it is unavailable, or why a ready version is an older load; empty otherwise.
    pub reason: String,
}

/// Versions whose load failed, each with why (an older load of it may still serve).
type Failures = Vec<(u64, String)>;

/// Every model the server knows, by name.
#[derive(Debug)]
pub struct Repository {
    /// The directory models are read from; `None` for a repository with nothing on disk.
    root: Option<PathBuf>,
    options: RepositoryOptions,
    table: RwLock<BTreeMap<String, Model>>,
    /// Serializes loads, unloads and polls: each reads the table, loads without holding it,
    /// and writes it back, so two at once would race on the same model.
    control: Mutex<()>,
    retirer: Retirer,
    warnings: Vec<String>,
    poller: Mutex<Option<poll::Poller>>,
}

impl Default for Repository {
    fn default() -> Self {
        Repository {
            root: None,
            options: RepositoryOptions::default(),
            table: RwLock::new(BTreeMap::new()),
            control: Mutex::new(()),
            retirer: Retirer::new(RepositoryOptions::default().drain_timeout, None),
            warnings: Vec::new(),
            poller: Mutex::new(None),
        }
    }
}

impl Repository {
    /// Loads every model directory under `dir` (hidden ones skipped). A model whose config
    /// or weights are bad is kept unavailable with the reason; the others serve. Only an
    /// unreadable `dir` is an error.
    pub fn load(dir: &Path, stages: Stages) -> Result<Self> {
        Self::load_on(dir, stages, InstanceKind::Auto)
    }

    /// [`Repository::load`], with the models whose config says `KIND_AUTO` (or nothing) run
    /// as `default` (`kiln serve --device`).
    pub fn load_on(dir: &Path, stages: Stages, default: InstanceKind) -> Result<Self> {
        Self::open(
            dir,
            RepositoryOptions {
                stages,
                default_kind: default,
                ..RepositoryOptions::default()
            },
        )
    }

    /// Opens the repository at `dir` and loads what `options.mode` says to load at start.
    /// Problems with the repository as a whole (empty, or a model's own directory) are
    /// [`Repository::warnings`]; only an unreadable `dir` is an error. Poll mode's polling
    /// starts with [`Repository::start_polling`].
    pub fn open(dir: &Path, options: RepositoryOptions) -> Result<Self> {
        let names = disk::list_models(dir).map_err(|e| ServeError::Config {
            path: dir.display().to_string(),
            message: format!("cannot read the model repository ({e}); pass an existing directory"),
        })?;
        let warnings = disk::startup_warnings(dir, &names);
        for w in &warnings {
            tracing::warn!("{w}");
        }
        let explicit = options.mode == ModelControlMode::Explicit;
        let everything = options.startup_models.iter().any(|m| m == "*");
        let unknown = options.startup_models.iter().find(|m| !names.contains(m));
        if explicit
            && !everything
            && let Some(missing) = unknown
        {
            return Err(ServeError::Config {
                path: dir.display().to_string(),
                message: format!(
                    "--load-model {missing}: no such model directory in the repository (models: {})",
                    names.join(", ")
                ),
            });
        }
        let repository = Repository {
            root: Some(dir.to_path_buf()),
            retirer: Retirer::new(options.drain_timeout, options.release_memory),
            options,
            warnings,
            ..Repository::default()
        };
        for name in &names {
            let load = !explicit || everything || repository.options.startup_models.contains(name);
            if load {
                let _ = repository.load_model(name);
            } else {
                repository.set(name, Model::unavailable(NOT_LOADED));
            }
        }
        Ok(repository)
    }

    /// Repository-wide problems found at start (logged too).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    fn set(&self, name: &str, model: Model) {
        self.table
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), model);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Model>> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a model of this name is known (serving or not).
    pub fn contains(&self, name: &str) -> bool {
        self.read().contains_key(name)
    }

    /// The running model `name` (its highest serving version), or why it cannot serve.
    pub fn runtime(&self, name: &str) -> Result<Arc<ModelRuntime>> {
        self.runtime_version(name, "")
    }

    /// The running version `version` of model `name` (empty: the highest serving one), or
    /// why it cannot serve.
    pub fn runtime_version(&self, name: &str, version: &str) -> Result<Arc<ModelRuntime>> {
        let table = self.read();
        let model = table
            .get(name)
            .ok_or_else(|| ServeError::ModelNotFound(name.to_string()))?;
        let not_ready = |reason: String| ServeError::ModelNotReady {
            model: name.to_string(),
            reason,
        };
        if version.is_empty() {
            return model.default_runtime().cloned().ok_or_else(|| {
                not_ready(if model.reason.is_empty() {
                    reasons(model)
                } else {
                    model.reason.clone()
                })
            });
        }
        let served = || {
            let list: Vec<String> = model.versions.keys().map(u64::to_string).collect();
            if list.is_empty() {
                "none".to_string()
            } else {
                list.join(", ")
            }
        };
        let entry = version
            .parse::<u64>()
            .ok()
            .and_then(|v| model.versions.get(&v))
            .ok_or_else(|| {
                ServeError::ModelNotFound(format!(
                    "{name} (version {version}; versions: {})",
                    served()
                ))
            })?;
        entry
            .runtime
            .clone()
            .ok_or_else(|| not_ready(format!("version {version}: {}", entry.reason)))
    }

    /// The serving version numbers of model `name`, ascending.
    pub fn ready_versions(&self, name: &str) -> Vec<u64> {
        self.read()
            .get(name)
            .map(|m| m.runtimes().map(|rt| rt.version).collect())
            .unwrap_or_default()
    }

    /// All running model versions.
    pub fn ready_runtimes(&self) -> Vec<Arc<ModelRuntime>> {
        self.read()
            .values()
            .flat_map(|m| m.runtimes().cloned())
            .collect()
    }

    /// Ready when at least one model serves (a broken model does not take the others down);
    /// in explicit mode the server is ready without models, as Triton's is: clients load
    /// them.
    pub fn is_ready(&self) -> bool {
        self.options.mode == ModelControlMode::Explicit
            || self.read().values().any(|m| m.default_runtime().is_some())
    }

    /// Every model version with its state and reason; a model with no version is one row
    /// with an empty version.
    pub fn index(&self) -> Vec<IndexEntry> {
        let mut rows = Vec::new();
        for (name, model) in self.read().iter() {
            if model.versions.is_empty() {
                rows.push(IndexEntry {
                    name: name.clone(),
                    version: String::new(),
                    state: "UNAVAILABLE",
                    reason: model.reason.clone(),
                });
            }
            for (number, v) in &model.versions {
                rows.push(IndexEntry {
                    name: name.clone(),
                    version: number.to_string(),
                    state: if v.runtime.is_some() {
                        "READY"
                    } else {
                        "UNAVAILABLE"
                    },
                    reason: v.reason.clone(),
                });
            }
        }
        rows
    }

    /// Models or versions that failed to load (not those merely not loaded or unloaded):
    /// what `--exit-on-error` refuses to start with.
    pub fn failures(&self) -> Vec<IndexEntry> {
        self.index()
            .into_iter()
            .filter(|r| r.state != "READY" && r.reason != NOT_LOADED && r.reason != UNLOADED)
            .collect()
    }

    /// Loads model `name` from disk, or reloads it: versions the policy selects that are new
    /// or whose files changed load beside what serves, unchanged ready versions are kept,
    /// versions the policy no longer selects retire. A failed version leaves what served
    /// before in place. Refused in `none` and `poll` mode (the client's load request);
    /// [`Repository::poll`] is the poller's road.
    pub fn request_load(&self, name: &str) -> Result<()> {
        self.check_control("load")?;
        check_name(name).map_err(ServeError::InvalidRequest)?;
        let failed = self.load_model(name)?;
        if !failed.is_empty() {
            let mut why: Vec<String> = failed
                .iter()
                .map(|(v, e)| format!("version {v}: {e}"))
                .collect();
            let serving = self.ready_versions(name);
            why.push(if serving.is_empty() {
                "no version serves".to_string()
            } else {
                format!("still serving version(s) {serving:?}")
            });
            return Err(ServeError::Load {
                model: name.to_string(),
                message: why.join("; "),
            });
        }
        Ok(())
    }

    /// Takes every version of model `name` out of service (each drains its requests first)
    /// and lists the model as unloaded. Refused in `none` and `poll` mode.
    pub fn request_unload(&self, name: &str) -> Result<Vec<u64>> {
        self.check_control("unload")?;
        let _control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        if !self.contains(name) {
            return Err(ServeError::ModelNotFound(name.to_string()));
        }
        let retired = self.take_out(name, Some(Model::unavailable(UNLOADED)));
        tracing::info!(model = name, versions = ?retired, "unloaded");
        Ok(retired)
    }

    /// Takes model `name` out of the table (leaving `replacement` listed in its place, if
    /// any) and retires every version that served; their numbers. The caller holds the
    /// control lock.
    fn take_out(&self, name: &str, replacement: Option<Model>) -> Vec<u64> {
        let old = {
            let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
            match replacement {
                Some(model) => table.insert(name.to_string(), model),
                None => table.remove(name),
            }
        };
        let runtimes: Vec<&Arc<ModelRuntime>> = old.iter().flat_map(Model::runtimes).collect();
        for rt in &runtimes {
            self.retirer.retire(Arc::clone(rt));
        }
        runtimes.iter().map(|rt| rt.version).collect()
    }

    fn check_control(&self, what: &str) -> Result<()> {
        match self.options.mode {
            ModelControlMode::Explicit => Ok(()),
            ModelControlMode::Poll => Err(ServeError::ControlRefused(format!(
                "explicit model {what} is not allowed in poll mode: the repository directory \
                 is the control (start kiln serve with --model-control-mode explicit)"
            ))),
            ModelControlMode::None => Err(ServeError::ControlRefused(format!(
                "model {what} is not allowed: model control is off (start kiln serve with \
                 --model-control-mode explicit)"
            ))),
        }
    }

    /// Re-reads the whole repository once: models new on disk load, changed ones reload
    /// (only what changed), models gone from disk unload. What poll mode runs every interval.
    pub fn poll(&self) {
        let Some(root) = &self.root else { return };
        let names = match disk::list_models(root) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(repository = %root.display(), error = %e, "cannot read the model repository; keeping what serves");
                return;
            }
        };
        let known: Vec<String> = self.read().keys().cloned().collect();
        for gone in known.iter().filter(|k| !names.contains(k)) {
            let _control = self.control.lock().unwrap_or_else(|e| e.into_inner());
            self.take_out(gone, None);
            tracing::info!(model = %gone, "model directory removed: unloaded");
        }
        for name in &names {
            let _ = self.sync(name, false);
        }
    }

    /// [`Repository::sync`] that retries failed versions (a load, not a poll).
    fn load_model(&self, name: &str) -> Result<Failures> {
        self.sync(name, true)
    }

    /// Brings model `name` in line with the disk (see [`Repository::request_load`]);
    /// `retry_failed` also reloads unchanged versions that failed before.
    fn sync(&self, name: &str, retry_failed: bool) -> Result<Failures> {
        let root = self.root.as_ref().ok_or_else(|| {
            ServeError::ControlRefused("this repository has no directory to load from".into())
        })?;
        let _control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let known = self.read().get(name).cloned();
        if known.is_none() && !root.join(name).is_dir() {
            // Not a model of this repository: nothing to list it under.
            return Err(ServeError::ModelNotFound(format!(
                "{name} (no directory {} in the repository)",
                root.join(name).display()
            )));
        }
        let current = known.unwrap_or_default();
        let on_disk = match disk::read_model(root, name) {
            Ok(m) => m,
            Err(reason) => return Err(self.model_failed(name, current, reason)),
        };
        let mut failed = Failures::new();
        let mut next = Model::default();
        for v in on_disk.versions {
            let old = current.versions.get(&v.number);
            let unchanged = old.is_some_and(|o| o.fingerprint == v.fingerprint);
            if unchanged
                && let Some(o) = old
                && (o.runtime.is_some() || !retry_failed)
            {
                next.versions.insert(v.number, o.clone());
                continue;
            }
            let version = on_disk.versioned.then_some(v.number);
            let loaded = v.config.map_err(|e| e.to_string()).and_then(|mut config| {
                config.kind = config.kind.or(self.options.default_kind);
                ModelRuntime::start_version(name, version, config, self.options.stages)
                    .map_err(|e| e.to_string())
            });
            let entry = match loaded {
                Ok(rt) => {
                    tracing::info!(
                        model = name,
                        version = v.number,
                        max_batch_size = rt.config.max_batch_size,
                        instances = rt.config.instances,
                        dynamic_batching = rt.config.dynamic_batching.is_some(),
                        "model ready"
                    );
                    Version {
                        runtime: Some(rt),
                        reason: String::new(),
                        fingerprint: v.fingerprint,
                    }
                }
                Err(e) => {
                    tracing::error!(model = name, version = v.number, reason = %e, "model not loaded");
                    failed.push((v.number, e.clone()));
                    // A reload that failed keeps the load that served.
                    let runtime = old.and_then(|o| o.runtime.clone());
                    let reason = if runtime.is_some() {
                        format!("serving the previous load; reloading failed: {e}")
                    } else {
                        e
                    };
                    Version {
                        runtime,
                        reason,
                        fingerprint: v.fingerprint,
                    }
                }
            };
            next.versions.insert(v.number, entry);
        }
        if next.default_runtime().is_none() {
            // Nothing the policy selects serves (a broken new version, say): what served
            // before keeps serving, so a bad upload never takes a model down.
            for (number, old) in &current.versions {
                if old.runtime.is_some() && !next.versions.contains_key(number) {
                    let mut kept = old.clone();
                    kept.reason = "kept serving: no version the policy selects loaded".into();
                    next.versions.insert(*number, kept);
                }
            }
        }
        if next.versions.is_empty() {
            next.reason = "no version directory the version policy selects".into();
        }
        self.swap(name, &current, next);
        Ok(failed)
    }

    /// A model whose directory or config cannot be read: what served keeps serving.
    fn model_failed(&self, name: &str, current: Model, reason: String) -> ServeError {
        // A poll meets the same broken config every interval: say it once.
        let known = current.reason == reason
            || current
                .versions
                .values()
                .any(|v| v.reason.ends_with(&reason));
        if !known {
            tracing::error!(model = name, %reason, "model not loaded");
        }
        let mut next = current;
        if next.default_runtime().is_some() {
            for v in next.versions.values_mut() {
                v.reason = format!("serving the previous load; reloading failed: {reason}");
            }
        } else {
            next = Model::unavailable(&reason);
        }
        self.set(name, next);
        ServeError::Load {
            model: name.to_string(),
            message: reason,
        }
    }

    /// Writes `next` for model `name` and retires the runtimes of `current` it no longer
    /// holds.
    fn swap(&self, name: &str, current: &Model, next: Model) {
        let still: Vec<*const ModelRuntime> = next.runtimes().map(Arc::as_ptr).collect();
        self.set(name, next);
        for rt in current.runtimes() {
            if !still.contains(&Arc::as_ptr(rt)) {
                self.retirer.retire(Arc::clone(rt));
            }
        }
    }

    /// Starts re-reading the repository every `every` (poll mode), on a thread of its own
    /// that stops with [`Repository::shutdown`] or when the repository is dropped.
    pub fn start_polling(self: &Arc<Self>, every: Duration) -> Result<()> {
        let poller = poll::Poller::start(Arc::downgrade(self), every)?;
        *self.poller.lock().unwrap_or_else(|e| e.into_inner()) = Some(poller);
        Ok(())
    }

    /// Versions replaced or unloaded that are still finishing their requests.
    pub fn draining(&self) -> usize {
        self.retirer.pending()
    }

    /// Stops polling, drains and stops every model's pipeline, and waits for versions that
    /// were retiring.
    pub fn shutdown(&self) {
        if let Some(p) = self.poller.lock().unwrap_or_else(|e| e.into_inner()).take() {
            p.stop();
        }
        let _control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        for rt in self.ready_runtimes() {
            rt.shutdown();
        }
        self.retirer.wait();
    }
}

/// The reasons of a model's versions, for a request that found none serving.
fn reasons(model: &Model) -> String {
    let list: Vec<String> = model
        .versions
        .iter()
        .map(|(n, v)| format!("version {n}: {}", v.reason))
        .collect();
    if list.is_empty() {
        "no version loaded".into()
    } else {
        list.join("; ")
    }
}
