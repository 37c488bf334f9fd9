//! Retiring a model version that was replaced or unloaded: it stops getting new requests the
//! moment the repository's table no longer names it, finishes every request that already
//! reached it, and only then stops its threads and frees its weights.
//!
//! Why a reference count and not a queue check: a request handler takes the runtime from the
//! table and holds it while it reads the body, decodes, queues and waits for the answer. A
//! handler that took it just before the switch has not queued anything yet, so an empty queue
//! does not mean it is done; the runtime's own threads and such handlers are exactly the
//! holders of its `Arc`. Once only the threads (and this retirer) hold it, nobody can send it
//! work any more, and its shutdown answers whatever is still queued.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::pipeline::ModelRuntime;

/// How often a retiring version checks whether its last request has left.
const POLL: Duration = Duration::from_millis(5);

/// The background threads draining retired versions.
#[derive(Debug)]
pub struct Retirer {
    draining: Mutex<Vec<JoinHandle<()>>>,
    /// Longest a version waits for requests that hold it before it stops anyway (its queued
    /// requests are still answered; a handler that had not queued yet gets 503).
    timeout: Duration,
    /// Hands freed memory back to the OS once a version is gone.
    release: Option<fn()>,
}

impl Retirer {
    /// A retirer that waits at most `timeout` for a version's requests and calls `release`
    /// once a version's memory is freed.
    pub fn new(timeout: Duration, release: Option<fn()>) -> Self {
        Retirer {
            draining: Mutex::new(Vec::new()),
            timeout,
            release,
        }
    }

    /// Drains and stops `runtime` on a thread of its own (no longer reachable from the table).
    pub fn retire(&self, runtime: Arc<ModelRuntime>) {
        let (timeout, release) = (self.timeout, self.release);
        let name = format!("{}-v{}-retire", runtime.name, runtime.version);
        let moved = Arc::clone(&runtime);
        let mut draining = self.draining.lock().unwrap_or_else(|e| e.into_inner());
        draining.retain(|t| !t.is_finished());
        match std::thread::Builder::new().name(name).spawn(move || {
            drain(moved, timeout);
            if let Some(release) = release {
                release();
            }
        }) {
            Ok(handle) => draining.push(handle),
            // No thread to drain on: stop it here (queued requests are still answered) rather
            // than leave its threads waiting on queues nobody closes.
            Err(e) => {
                tracing::error!(error = %e, "cannot start a thread to retire a model; stopping it now");
                runtime.shutdown();
            }
        }
    }

    /// Waits until every retired version has stopped.
    pub fn wait(&self) {
        let draining =
            std::mem::take(&mut *self.draining.lock().unwrap_or_else(|e| e.into_inner()));
        for t in draining {
            let _ = t.join();
        }
    }

    /// Versions still draining.
    pub fn pending(&self) -> usize {
        let mut draining = self.draining.lock().unwrap_or_else(|e| e.into_inner());
        draining.retain(|t| !t.is_finished());
        draining.len()
    }
}

/// Waits for `runtime`'s last outside holder to let go (or `timeout`), then shuts it down;
/// its memory is freed when this returns (the retirer's clone is the last).
fn drain(runtime: Arc<ModelRuntime>, timeout: Duration) {
    let started = Instant::now();
    let internal = 1 + runtime.thread_count();
    while Arc::strong_count(&runtime) > internal && started.elapsed() < timeout {
        std::thread::sleep(POLL);
    }
    let held = Arc::strong_count(&runtime).saturating_sub(internal);
    if held > 0 {
        tracing::warn!(
            model = %runtime.name,
            version = runtime.version,
            requests = held,
            "retiring after the drain timeout with requests still holding the old version"
        );
    }
    runtime.shutdown();
    tracing::info!(
        model = %runtime.name,
        version = runtime.version,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "old version drained and stopped"
    );
}
