//! What happens to a sample whose file cannot be read or decoded: `data.on_bad_sample`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::observe::SkippedSample;

/// What a bad sample (unreadable, corrupt, truncated, not an image, over the pixel limit)
/// does to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadSamplePolicy {
    /// The run stops with an error naming the file and the reason (the default: a user finds
    /// out about damaged data at once).
    #[default]
    Error,
    /// The sample is left out of its batch, counted in the epoch's events and the run
    /// summary; every other sample is seen as before.
    Skip,
}

crate::names::config_names!(BadSamplePolicy { Error => "error", Skip => "skip" });

/// The samples left out so far, shared by the loader's workers.
#[derive(Debug, Default)]
pub struct SkipLog {
    pending: Mutex<Vec<SkippedSample>>,
    total: AtomicU64,
}

impl SkipLog {
    /// Records one left-out sample.
    pub fn record(&self, sample: SkippedSample) {
        self.total.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            index = sample.index,
            "skipping {}: {}",
            sample.name,
            sample.reason
        );
        // Every one is kept until the epoch's end drains them: a few hundred bytes each.
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.push(sample);
    }

    /// The samples recorded since the last call, in index order.
    pub fn take(&self) -> Vec<SkippedSample> {
        let mut taken =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        taken.sort_by_key(|s| s.index);
        taken
    }

    /// Samples left out since the log was made.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}
