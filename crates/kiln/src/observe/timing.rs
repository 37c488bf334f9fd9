//! The timing protocol shared by `kiln bench` and the peers' scripts (`workloads.py`):
//! warm-up calls, then `repeats` runs of `steps` calls; report the median time per call and
//! the spread across repeats.

use serde::{Deserialize, Serialize};

/// Result of a timed measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Median milliseconds per call across repeats.
    pub median_ms: f64,
    /// Fastest repeat's milliseconds per call.
    pub min_ms: f64,
    /// Slowest repeat's milliseconds per call.
    pub max_ms: f64,
    /// (max − min) / median: how much the repeats disagree.
    pub spread: f64,
}

/// Groups per-call durations (already past warm-up) into `repeats` runs of `steps` calls.
/// Returns `None` when there are fewer than `repeats × steps` durations.
pub fn summarize(durations_ms: &[f64], steps: usize, repeats: usize) -> Option<Timing> {
    if steps == 0 || repeats == 0 || durations_ms.len() < steps * repeats {
        return None;
    }
    let mut per_call: Vec<f64> = durations_ms
        .chunks_exact(steps)
        .take(repeats)
        .map(|c| c.iter().sum::<f64>() / steps as f64)
        .collect();
    per_call.sort_by(f64::total_cmp);
    let median_ms = median_sorted(&per_call);
    let (min_ms, max_ms) = (per_call[0], per_call[per_call.len() - 1]);
    Some(Timing {
        median_ms,
        min_ms,
        max_ms,
        spread: (max_ms - min_ms) / median_ms.max(1e-12),
    })
}

/// Times `f`: `warmup` untimed calls, then `repeats × steps` timed calls.
pub fn measure(mut f: impl FnMut(), warmup: usize, steps: usize, repeats: usize) -> Timing {
    for _ in 0..warmup {
        f();
    }
    let mut durations = Vec::with_capacity(steps * repeats);
    for _ in 0..steps * repeats {
        let t = std::time::Instant::now();
        f();
        durations.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // `durations` has exactly steps × repeats entries, so summarize cannot return None.
    summarize(&durations, steps.max(1), repeats.max(1)).unwrap_or(Timing {
        median_ms: f64::NAN,
        min_ms: f64::NAN,
        max_ms: f64::NAN,
        spread: f64::NAN,
    })
}

/// The median of `values` (NaN when empty): what turn-taking measurements report per form
/// (`infer::choose_int8`, per-node and per-step times).
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    median_sorted(&values)
}

fn median_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_into_repeats_and_takes_the_median() {
        // Three repeats of two steps: means 1.5, 10, 3.5.
        let t = summarize(&[1.0, 2.0, 10.0, 10.0, 3.0, 4.0], 2, 3).unwrap();
        assert_eq!(t.median_ms, 3.5);
        assert_eq!((t.min_ms, t.max_ms), (1.5, 10.0));
        assert!((t.spread - 8.5 / 3.5).abs() < 1e-12);
        assert!(summarize(&[1.0; 5], 2, 3).is_none());
    }

    #[test]
    fn measure_calls_warmup_plus_timed() {
        let mut calls = 0;
        let t = measure(|| calls += 1, 5, 4, 3);
        assert_eq!(calls, 17);
        assert!(t.median_ms >= 0.0);
    }
}
