//! Named timers for users' own code: `timed("name", || work())` records the duration under
//! `name` (and opens a `tracing` span of the same name, so the profiler's trace shows it);
//! [`timer_stats`] reports count, mean, p50, p95 and total per name.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Instant;

use serde::Serialize;

fn registry() -> &'static Mutex<HashMap<String, Vec<f64>>> {
    static TIMERS: OnceLock<Mutex<HashMap<String, Vec<f64>>>> = OnceLock::new();
    TIMERS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Runs `f`, records how long it took under `name`, and returns its result.
pub fn timed<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let span = tracing::info_span!("timed", name);
    let _entered = span.enter();
    let t = Instant::now();
    let out = f();
    record(name, t.elapsed().as_secs_f64() * 1e3);
    out
}

/// Records a duration measured elsewhere, in milliseconds.
pub fn record(name: &str, ms: f64) {
    let mut timers = registry().lock().unwrap_or_else(PoisonError::into_inner);
    timers.entry(name.to_string()).or_default().push(ms);
}

/// Statistics of one named timer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimerStats {
    /// The name given to [`timed`].
    pub name: String,
    /// Calls recorded.
    pub count: usize,
    /// Sum of all durations, ms.
    pub total_ms: f64,
    /// Mean, ms.
    pub mean_ms: f64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 95th percentile (nearest rank), ms.
    pub p95_ms: f64,
    /// Slowest call, ms.
    pub max_ms: f64,
}

/// Statistics of every timer, sorted by total time (descending).
pub fn timer_stats() -> Vec<TimerStats> {
    let timers = registry().lock().unwrap_or_else(PoisonError::into_inner);
    let mut out: Vec<TimerStats> = timers
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(name, v)| {
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            let total: f64 = s.iter().sum();
            // Nearest-rank percentiles: an observed value, never an interpolation.
            let rank = |q: f64| s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
            TimerStats {
                name: name.clone(),
                count: s.len(),
                total_ms: total,
                mean_ms: total / s.len() as f64,
                p50_ms: rank(0.5),
                p95_ms: rank(0.95),
                max_ms: s[s.len() - 1],
            }
        })
        .collect();
    out.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    out
}

/// The statistics of one timer, if it ran.
pub fn timer(name: &str) -> Option<TimerStats> {
    timer_stats().into_iter().find(|t| t.name == name)
}

/// Forgets every recorded duration.
pub fn reset_timers() {
    registry()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_use_nearest_rank_percentiles() {
        for ms in 1..=20 {
            record("unit-test-timer", ms as f64);
        }
        let t = timer("unit-test-timer").expect("recorded");
        assert_eq!(t.count, 20);
        assert_eq!(t.total_ms, 210.0);
        assert_eq!(t.mean_ms, 10.5);
        assert_eq!(t.p50_ms, 10.0);
        assert_eq!(t.p95_ms, 19.0);
        assert_eq!(t.max_ms, 20.0);
        let v = timed("unit-test-timed", || 41 + 1);
        assert_eq!(v, 42);
        assert_eq!(timer("unit-test-timed").map(|t| t.count), Some(1));
    }
}
