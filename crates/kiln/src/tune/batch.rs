//! Batch-size search under a memory budget.
//!
//! Power-of-two growth finds the first size that does not fit, then a binary search narrows
//! the gap; or a plain binary search over `[1, max]`. Each trial is a few real training steps
//! (run by the caller — `kiln tune batch` runs each in a child process so its peak memory is
//! its own and an out-of-memory death is just a failed trial). A trial fits when it finished
//! and its peak stayed under the budget minus a safety margin: Lightning's finder picks sizes
//! that fit barely and fail later, so the margin is not optional (default 10%).
//!
//! Besides the largest safe batch, the search reports the batch with the best measured
//! throughput among those that fit — often smaller than the largest.

use burn::tensor::Device;
use serde::Serialize;

use crate::data::BatchSource;
use crate::error::{KilnError, Result};
use crate::observe::{MemorySink, memory};
use crate::train::{TrainOptions, TrainStep, Trainer};

/// How candidates are generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SearchMode {
    /// Double from `start` until a trial fails, then binary-search the gap.
    Power,
    /// Binary search over `[1, max_batch]`.
    Binsearch,
}

impl SearchMode {
    /// Parses `power` or `binsearch`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "power" => Ok(SearchMode::Power),
            "binsearch" => Ok(SearchMode::Binsearch),
            other => Err(KilnError::InvalidValue {
                key: "--mode".into(),
                value: format!("\"{other}\""),
                expected: "power or binsearch".into(),
            }),
        }
    }
}

/// Search settings.
#[derive(Debug, Clone, Serialize)]
pub struct SearchOptions {
    /// Memory budget in bytes, compared with the trial's peak memory: host resident memory on
    /// the CPU, what the device's memory pool reserved on a GPU (`kiln tune batch`'s trials).
    pub budget: u64,
    /// Safety margin: a trial fits under `budget × (1 − margin)`.
    pub margin: f64,
    /// Candidate generation.
    pub mode: SearchMode,
    /// First batch of the power-of-two growth.
    pub start: usize,
    /// Largest batch considered.
    pub max_batch: usize,
}

impl SearchOptions {
    /// The usable part of the budget.
    pub fn limit(&self) -> u64 {
        (self.budget as f64 * (1.0 - self.margin.clamp(0.0, 0.9))) as u64
    }
}

/// What one trial measured.
#[derive(Debug, Clone, Serialize)]
pub struct TrialOutcome {
    /// Peak memory of the trial, bytes (None when it died before reporting).
    pub peak_bytes: Option<u64>,
    /// Training throughput, when it finished.
    pub samples_per_s: Option<f64>,
    /// Why it failed (crash, out of memory), when it did.
    pub error: Option<String>,
}

/// One trial in the search's order, with the verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    /// Batch size tried.
    pub batch: usize,
    /// What it measured.
    pub outcome: TrialOutcome,
    /// Whether it fit under the limit.
    pub fits: bool,
    /// One phrase: why it does or does not fit.
    pub reason: String,
}

/// The search's result.
#[derive(Debug, Clone, Serialize)]
pub struct SearchResult {
    /// Largest batch that fit.
    pub largest_safe: usize,
    /// The fitting batch with the best samples/s.
    pub fastest: usize,
    /// Its throughput.
    pub fastest_samples_per_s: f64,
    /// Budget, margin, limit.
    pub options: SearchOptions,
    /// Usable bytes (budget minus margin).
    pub limit: u64,
    /// Every trial in order.
    pub trials: Vec<Trial>,
}

/// Runs the search, calling `trial(batch)` for each candidate.
pub fn search(
    options: &SearchOptions,
    mut trial: impl FnMut(usize) -> TrialOutcome,
) -> Result<SearchResult> {
    if options.budget == 0 || options.max_batch == 0 {
        return Err(KilnError::Inconsistent(
            "the memory budget and the largest batch must be positive".into(),
        ));
    }
    let limit = options.limit();
    let mut trials: Vec<Trial> = Vec::new();
    let mut run = |batch: usize, trials: &mut Vec<Trial>| -> bool {
        if let Some(t) = trials.iter().find(|t| t.batch == batch) {
            return t.fits;
        }
        let outcome = trial(batch);
        let (fits, reason) = match (&outcome.error, outcome.peak_bytes) {
            (Some(e), _) => (false, format!("failed: {e}")),
            (None, Some(peak)) if peak <= limit => (true, "fits".to_string()),
            (None, Some(peak)) => (
                false,
                format!("peak {} over the limit {}", mib(peak), mib(limit)),
            ),
            (None, None) => (false, "no memory reading".to_string()),
        };
        tracing::info!(batch, fits, %reason, "batch trial");
        trials.push(Trial {
            batch,
            outcome,
            fits,
            reason,
        });
        fits
    };
    // (largest known fit, smallest known failure)
    let (mut lo, mut hi) = (0usize, options.max_batch + 1);
    match options.mode {
        SearchMode::Power => {
            let mut b = options.start.clamp(1, options.max_batch);
            loop {
                if run(b, &mut trials) {
                    lo = b;
                    if b >= options.max_batch {
                        break;
                    }
                    b = (b * 2).min(options.max_batch);
                } else {
                    hi = b;
                    break;
                }
            }
            if lo == 0 {
                // Even the start does not fit: search below it.
                hi = hi.min(options.start.max(1));
            }
        }
        SearchMode::Binsearch => {}
    }
    // Binary search on (lo, hi) down to a gap of 1/16 of lo (or 1): finer steps buy little
    // and every trial costs real steps.
    while hi - lo > (lo / 16).max(1) {
        let mid = lo + (hi - lo) / 2;
        if run(mid, &mut trials) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        let smallest = trials.iter().min_by_key(|t| t.batch);
        return Err(KilnError::Inconsistent(format!(
            "no batch size fits the memory budget of {} ({} after the {:.0}% safety margin): \
             batch {} {}; raise --memory-budget or use a smaller model",
            mib(options.budget),
            mib(limit),
            options.margin * 100.0,
            smallest.map_or(1, |t| t.batch),
            smallest.map_or(String::new(), |t| t.reason.clone())
        )));
    }
    let fastest = trials
        .iter()
        .filter(|t| t.fits)
        .filter_map(|t| Some((t.batch, t.outcome.samples_per_s?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((lo, 0.0));
    Ok(SearchResult {
        largest_safe: lo,
        fastest: fastest.0,
        fastest_samples_per_s: fastest.1,
        options: options.clone(),
        limit,
        trials,
    })
}

/// The batch-size search on the caller's own model and data, in this process: the library
/// form of `kiln tune batch`. Each trial trains `steps` steps at one batch size (options from
/// `base`) and reads the process's peak resident memory, reset before the trial.
///
/// In one process a trial's peak includes what the allocator kept from earlier trials, so a
/// reading can only be too high: the search errs toward a smaller batch, never toward one
/// that does not fit. `kiln tune batch` runs each trial in a child process for exact
/// readings; a panic in a trial (an allocation failure, say) is a failed trial here too.
pub fn search_source<B: Send, M: TrainStep<B> + 'static>(
    options: &SearchOptions,
    name: &str,
    init: &dyn Fn(&Device) -> M,
    data: &dyn BatchSource<Batch = B>,
    base: &TrainOptions,
    steps: u64,
) -> Result<SearchResult> {
    if !memory::reset_peak_rss() {
        return Err(KilnError::Inconsistent(
            "this system cannot reset the peak memory reading (/proc/self/clear_refs), so \
             in-process batch trials cannot be measured; use `kiln tune batch`"
                .into(),
        ));
    }
    search(options, |batch| {
        memory::reset_peak_rss();
        let trial_options = TrainOptions {
            batch_size: batch,
            grad_accum_steps: 1,
            max_steps: Some(steps.max(1) + 1),
            epochs: 1000,
            eval_every_epochs: 0,
            workers: Some(0),
            checkpoint_dir: None,
            checkpoint_every_steps: None,
            ..base.clone()
        };
        let mut sink = MemorySink::default();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Trainer::new(trial_options, Device::flex(), &mut sink)
                .fit_source(name, init, data, None)
                .map(drop)
        }));
        let error = match run {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(p) => Some(format!("panicked: {}", crate::data::panic_text(&*p))),
        };
        // The first step warms up; the rest are timed.
        let timed: Vec<f64> = sink.steps().skip(1).map(|s| s.step_ms).collect();
        let samples_per_s = (!timed.is_empty() && error.is_none()).then(|| {
            batch as f64 / (timed.iter().sum::<f64>() / timed.len() as f64 / 1e3).max(1e-9)
        });
        TrialOutcome {
            peak_bytes: memory::peak_rss_bytes(),
            samples_per_s,
            error,
        }
    })
}

fn mib(bytes: u64) -> String {
    crate::observe::memory::human_bytes(bytes)
}

/// Parses a size like `8GiB`, `300MiB`, `512MB`, `2G` or a plain number of bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| KilnError::InvalidValue {
        key: "--memory-budget".into(),
        value: format!("\"{text}\""),
        expected: "a size such as 8GiB, 512MiB or 2000000000".into(),
    })?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1048576.0,
        "mb" => 1e6,
        "g" | "gib" => 1073741824.0,
        "gb" => 1e9,
        "t" | "tib" => 1099511627776.0,
        "tb" => 1e12,
        _ => {
            return Err(KilnError::InvalidValue {
                key: "--memory-budget".into(),
                value: format!("\"{text}\""),
                expected: "a size with unit B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)".into(),
            });
        }
    };
    Ok((value * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory grows linearly with the batch; throughput peaks at 256.
    fn fake(batch: usize) -> TrialOutcome {
        let peak = 100 * 1048576 + batch as u64 * 1048576;
        if peak > 1500 * 1048576 {
            return TrialOutcome {
                peak_bytes: None,
                samples_per_s: None,
                error: Some("killed (out of memory)".into()),
            };
        }
        let sps = 1000.0 - (batch as f64 - 256.0).abs();
        TrialOutcome {
            peak_bytes: Some(peak),
            samples_per_s: Some(sps),
            error: None,
        }
    }

    fn opts(mode: SearchMode, budget_mib: u64) -> SearchOptions {
        SearchOptions {
            budget: budget_mib * 1048576,
            margin: 0.1,
            mode,
            start: 8,
            max_batch: 4096,
        }
    }

    #[test]
    fn power_then_binary_search_finds_the_largest_safe_batch() {
        // Limit = 900 MiB → batch ≤ 800.
        let r = search(&opts(SearchMode::Power, 1000), fake).unwrap();
        assert!(
            r.largest_safe <= 800 && r.largest_safe > 800 - 800 / 16,
            "{r:?}"
        );
        assert_eq!(r.fastest, 256, "throughput peaks below the largest batch");
        let tried: Vec<usize> = r.trials.iter().map(|t| t.batch).collect();
        assert_eq!(&tried[..8], &[8, 16, 32, 64, 128, 256, 512, 1024]);
        // Every fitting trial is under the limit, every failing one over it or dead.
        for t in &r.trials {
            assert_eq!(t.fits, t.outcome.peak_bytes.is_some_and(|p| p <= r.limit));
        }
        let b = search(&opts(SearchMode::Binsearch, 1000), fake).unwrap();
        assert!(b.largest_safe <= 800 && b.largest_safe > 750, "{b:?}");
    }

    #[test]
    fn crashes_are_failed_trials_and_an_impossible_budget_is_a_clear_error() {
        // A huge budget: the fake dies (OOM) above 1400 — a failed trial, not a crash.
        let r = search(&opts(SearchMode::Power, 100_000), fake).unwrap();
        assert!(r.largest_safe <= 1400 && r.largest_safe >= 1400 - 1400 / 16);
        assert!(r.trials.iter().any(|t| t.reason.contains("out of memory")));
        let err = search(&opts(SearchMode::Power, 50), fake)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no batch size fits") && err.contains("raise --memory-budget"),
            "{err}"
        );
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("300 MiB").unwrap(), 300 << 20);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }
}
