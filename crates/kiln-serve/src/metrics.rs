//! Per-model counters and histograms, rendered in the Prometheus text format at `/metrics`
//! and as KServe statistics.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A cumulative histogram with fixed upper bounds (Prometheus `le` buckets).
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Buckets with these upper bounds (ascending); `+Inf` is implied.
    pub fn new(bounds: Vec<f64>) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            bounds,
            counts,
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records `value` (the sum is kept in millionths so it stays an atomic integer).
    pub fn observe(&self, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value * 1e6).round() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Sum of the observed values.
    pub fn sum(&self) -> f64 {
        self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Per-bucket (non-cumulative) counts; the last is the `+Inf` overflow.
    pub fn bucket_counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum());
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count());
    }
}

/// Failure reasons counted separately (see `ServeError::metric_reason`; `cancelled`: the
/// client went away before its answer, the request's work was dropped).
pub const FAILURE_REASONS: [&str; 7] = [
    "invalid",
    "not_ready",
    "queue_full",
    "timeout",
    "shutdown",
    "internal",
    "cancelled",
];

/// Everything `/metrics` reports for one model.
#[derive(Debug)]
pub struct ModelMetrics {
    /// Requests accepted and not yet answered.
    pub inflight: AtomicU64,
    /// Requests answered with outputs.
    pub success: AtomicU64,
    /// Requests answered with an error, by [`FAILURE_REASONS`] index.
    pub failure: [AtomicU64; FAILURE_REASONS.len()],
    /// Samples inferred (a request of batch 8 counts 8).
    pub inference_count: AtomicU64,
    /// Model executions (batches run).
    pub execution_count: AtomicU64,
    /// Total time requests waited in the batch queue.
    pub queue_ns: AtomicU64,
    /// Total time executing batches.
    pub compute_ns: AtomicU64,
    /// Total time decoding and validating requests (preprocess stage).
    pub pre_ns: AtomicU64,
    /// Total time splitting, postprocessing and encoding responses (postprocess stage).
    pub post_ns: AtomicU64,
    /// When the last batch ran, in milliseconds since the Unix epoch.
    pub last_inference_ms: AtomicU64,
    /// Batch sizes executed.
    pub batch_size: Histogram,
    /// Seconds each request spent queued.
    pub queue_seconds: Histogram,
    /// Seconds from arrival to response, per request.
    pub request_seconds: Histogram,
    /// A stream model's region results: `[computed, reused]`.
    pub stream_regions: [AtomicU64; 2],
}

impl ModelMetrics {
    /// Metrics for a model whose batches hold at most `max_batch_size` samples.
    pub fn new(max_batch_size: usize) -> Self {
        let mut sizes = vec![];
        let mut b = 1usize;
        while b < max_batch_size {
            sizes.push(b as f64);
            b *= 2;
        }
        sizes.push(max_batch_size as f64);
        let latency = vec![
            5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
        ];
        ModelMetrics {
            inflight: AtomicU64::new(0),
            success: AtomicU64::new(0),
            failure: std::array::from_fn(|_| AtomicU64::new(0)),
            inference_count: AtomicU64::new(0),
            execution_count: AtomicU64::new(0),
            queue_ns: AtomicU64::new(0),
            compute_ns: AtomicU64::new(0),
            pre_ns: AtomicU64::new(0),
            post_ns: AtomicU64::new(0),
            last_inference_ms: AtomicU64::new(0),
            batch_size: Histogram::new(sizes),
            queue_seconds: Histogram::new(latency.clone()),
            request_seconds: Histogram::new(latency),
            stream_regions: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// Counts a failed request under `reason`.
    pub fn fail(&self, reason: &str) {
        let i = FAILURE_REASONS
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(FAILURE_REASONS.len() - 1);
        self.failure[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Failed requests counted under `reason`.
    pub fn failures(&self, reason: &str) -> u64 {
        FAILURE_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.failure[i].load(Ordering::Relaxed))
    }

    /// Records one executed batch.
    pub fn record_batch(&self, samples: usize, compute: Duration) {
        self.execution_count.fetch_add(1, Ordering::Relaxed);
        self.inference_count
            .fetch_add(samples as u64, Ordering::Relaxed);
        self.compute_ns
            .fetch_add(compute.as_nanos() as u64, Ordering::Relaxed);
        self.batch_size.observe(samples as f64);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_inference_ms
            .store(now.as_millis() as u64, Ordering::Relaxed);
    }

    /// Adds `spent` to a stage's total (`pre_ns` or `post_ns`).
    pub fn add_time(total: &AtomicU64, spent: Duration) {
        total.fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Records one request's queue wait.
    pub fn record_queue(&self, waited: Duration) {
        self.queue_ns
            .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
        self.queue_seconds.observe(waited.as_secs_f64());
    }

    /// Appends this model's series to a Prometheus exposition, each with `labels` (already
    /// escaped: `model="w3"` or `model="w3",version="2"`).
    pub fn render(&self, out: &mut String, labels: &str) {
        let l = labels;
        let count = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        let secs = |a: &AtomicU64| (a.load(Ordering::Relaxed) as f64 / 1e9).to_string();
        let series = [
            ("kiln_inflight_requests", count(&self.inflight)),
            ("kiln_request_success_total", count(&self.success)),
            ("kiln_inference_count_total", count(&self.inference_count)),
            ("kiln_execution_count_total", count(&self.execution_count)),
            ("kiln_queue_seconds_total", secs(&self.queue_ns)),
            ("kiln_compute_seconds_total", secs(&self.compute_ns)),
            ("kiln_preprocess_seconds_total", secs(&self.pre_ns)),
            ("kiln_postprocess_seconds_total", secs(&self.post_ns)),
        ];
        for (name, value) in series {
            let _ = writeln!(out, "{name}{{{l}}} {value}");
        }
        for (reason, c) in FAILURE_REASONS.iter().zip(&self.failure) {
            let _ = writeln!(
                out,
                "kiln_request_failure_total{{{l},reason=\"{reason}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        for (path, c) in ["computed", "reused"].iter().zip(&self.stream_regions) {
            let _ = writeln!(
                out,
                "kiln_stream_regions_total{{{l},path=\"{path}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        self.batch_size.render(out, "kiln_batch_size", l);
        self.queue_seconds
            .render(out, "kiln_queue_duration_seconds", l);
        self.request_seconds
            .render(out, "kiln_request_duration_seconds", l);
    }
}

/// The `# HELP` / `# TYPE` preamble for every series [`ModelMetrics::render`] writes.
pub fn preamble() -> String {
    let mut out = String::new();
    for (name, kind, help) in [
        (
            "kiln_inflight_requests",
            "gauge",
            "Inference requests accepted and not yet answered.",
        ),
        (
            "kiln_request_success_total",
            "counter",
            "Inference requests answered with outputs.",
        ),
        (
            "kiln_request_failure_total",
            "counter",
            "Inference requests answered with an error, by reason.",
        ),
        ("kiln_inference_count_total", "counter", "Samples inferred."),
        (
            "kiln_execution_count_total",
            "counter",
            "Model executions (batches).",
        ),
        (
            "kiln_queue_seconds_total",
            "counter",
            "Time requests waited in the batch queue.",
        ),
        (
            "kiln_compute_seconds_total",
            "counter",
            "Time spent executing batches.",
        ),
        (
            "kiln_preprocess_seconds_total",
            "counter",
            "Time spent decoding and validating requests.",
        ),
        (
            "kiln_postprocess_seconds_total",
            "counter",
            "Time spent splitting and encoding responses.",
        ),
        (
            "kiln_stream_regions_total",
            "counter",
            "Region results of stream models: computed by the model or reused (unchanged).",
        ),
        (
            "kiln_stream_sequences_active",
            "gauge",
            "Sequences a stream model holds (started, not ended or idled out).",
        ),
        (
            "kiln_batch_size",
            "histogram",
            "Samples per executed batch.",
        ),
        (
            "kiln_queue_duration_seconds",
            "histogram",
            "Queue wait per request.",
        ),
        (
            "kiln_request_duration_seconds",
            "histogram",
            "Arrival to response per request.",
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_in_the_exposition() {
        let m = ModelMetrics::new(8);
        for b in [1, 3, 8, 8] {
            m.record_batch(b, Duration::from_millis(1));
        }
        assert_eq!(m.batch_size.bucket_counts(), vec![1, 0, 1, 2, 0]);
        let mut text = String::new();
        m.render(&mut text, "model=\"w3\"");
        assert!(
            text.contains("kiln_batch_size_bucket{model=\"w3\",le=\"4\"} 2"),
            "{text}"
        );
        assert!(text.contains("kiln_batch_size_bucket{model=\"w3\",le=\"+Inf\"} 4"));
        assert!(text.contains("kiln_inference_count_total{model=\"w3\"} 20"));
        assert!(text.contains("kiln_execution_count_total{model=\"w3\"} 4"));
    }
}
