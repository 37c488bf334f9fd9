//! The profiler: a `tracing` layer that records every span (name, fields, thread, start,
//! duration, resident memory at entry and exit) and turns the record into a Chrome/Perfetto
//! trace (Trace Event Format, "complete" events) and a torch.profiler-style table.
//!
//! The trainer wraps each phase of a step in a span (`step` › `data_wait`, `forward`,
//! `backward`, `sync`, `unscale`, `guard_check`, `clip`, `optimizer`, …), so installing this
//! layer is all profiling takes; with no subscriber interested, a span costs one cached
//! callsite check. Resident memory is read from `/proc/self/statm` with one `pread` on an open
//! file (about a microsecond), so the layer can afford it at every span boundary.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::Serialize;
use tracing::Subscriber;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

use super::memory::Statm;

/// One finished span.
#[derive(Debug, Clone, Serialize)]
pub struct SpanRecord {
    /// The span's name (`forward`, `optimizer`, …).
    pub name: &'static str,
    /// Fields recorded when the span was created (`step = 3`).
    pub fields: Vec<(String, String)>,
    /// Small per-process thread number (1 = the first thread that entered a span).
    pub thread: u64,
    /// Nesting depth on its thread (0 = outermost).
    pub depth: usize,
    /// Start, microseconds since the profiler was created.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
    /// Resident memory at entry, bytes (None where `/proc` is missing).
    pub rss_start: Option<u64>,
    /// Resident memory at exit, bytes.
    pub rss_end: Option<u64>,
}

impl SpanRecord {
    /// What the trace and the table call the span: a [`crate::observe::timed`] call by its
    /// name, an executor node (a span with an `op` field, e.g. `onnx.node` with `op = Conv`)
    /// by its span name and operator, every other span by its name.
    pub fn label(&self) -> String {
        let field = |key: &str| self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        match (self.name, field("op"), field("name")) {
            ("timed", _, Some(name)) => name.clone(),
            (span, Some(op), _) => format!("{span} {op}"),
            (span, _, _) => span.to_string(),
        }
    }
}

struct Recorder {
    origin: Instant,
    spans: Mutex<Vec<SpanRecord>>,
    statm: Statm,
}

impl Recorder {
    fn now_us(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * 1e6
    }

    fn rss(&self) -> Option<u64> {
        self.statm.resident_bytes()
    }
}

/// Per-span state between enter and exit, kept in the span's extensions.
struct Open {
    fields: Vec<(String, String)>,
    start_us: f64,
    rss_start: Option<u64>,
    depth: usize,
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }
}

/// The `tracing` layer; see the module documentation. Create with [`Profiler::new`].
pub struct ProfileLayer {
    recorder: Arc<Recorder>,
}

impl<S> Layer<S> for ProfileLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields(Vec::new());
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open {
                fields: fields.0,
                start_us: 0.0,
                rss_start: None,
                depth: 0,
            });
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let depth = DEPTH.with(|d| {
            let v = d.get();
            d.set(v + 1);
            v
        });
        if let Some(span) = ctx.span(id)
            && let Some(open) = span.extensions_mut().get_mut::<Open>()
        {
            open.depth = depth;
            open.rss_start = self.recorder.rss();
            // Taken last, so the memory read is not charged to the span.
            open.start_us = self.recorder.now_us();
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        // Taken first, for the same reason.
        let end_us = self.recorder.now_us();
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        let Some(span) = ctx.span(id) else { return };
        let ext = span.extensions();
        let Some(open) = ext.get::<Open>() else {
            return;
        };
        let record = SpanRecord {
            name: span.name(),
            fields: open.fields.clone(),
            thread: THREAD.with(|t| *t),
            depth: open.depth,
            start_us: open.start_us,
            dur_us: (end_us - open.start_us).max(0.0),
            rss_start: open.rss_start,
            rss_end: self.recorder.rss(),
        };
        drop(ext);
        self.recorder
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(record);
    }
}

/// A profiling session: hands out the layer and reads back what it recorded.
#[derive(Clone)]
pub struct Profiler {
    recorder: Arc<Recorder>,
}

impl Default for Profiler {
    fn default() -> Self {
        Self::new()
    }
}

impl Profiler {
    /// A profiler whose clock starts now.
    pub fn new() -> Self {
        Profiler {
            recorder: Arc::new(Recorder {
                origin: Instant::now(),
                spans: Mutex::new(Vec::new()),
                statm: Statm::open(),
            }),
        }
    }

    /// The layer to install (e.g. `tracing_subscriber::registry().with(profiler.layer())`).
    pub fn layer(&self) -> ProfileLayer {
        ProfileLayer {
            recorder: self.recorder.clone(),
        }
    }

    /// Every span finished so far, in the order they ended.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.recorder
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The trace in Chrome's Trace Event Format (loads in ui.perfetto.dev and chrome://tracing).
    pub fn chrome_trace(&self) -> serde_json::Value {
        chrome_trace(&self.spans())
    }

    /// Writes [`Profiler::chrome_trace`] to `path` atomically.
    pub fn write_chrome_trace(&self, path: &Path) -> crate::error::Result<()> {
        let text = serde_json::to_vec(&self.chrome_trace())
            .map_err(|e| crate::error::KilnError::io(path, std::io::Error::other(e.to_string())))?;
        crate::fsutil::write_atomic(path, &text)
    }
}

/// Builds a Trace Event Format document: one "X" (complete) event per span, plus thread-name
/// metadata.
pub fn chrome_trace(spans: &[SpanRecord]) -> serde_json::Value {
    let mut events: Vec<serde_json::Value> = Vec::with_capacity(spans.len() + 4);
    let mut threads: Vec<u64> = spans.iter().map(|s| s.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    for t in threads {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": t,
            "args": {"name": if t == 1 { "trainer".to_string() } else { format!("thread {t}") }},
        }));
    }
    let mut sorted: Vec<&SpanRecord> = spans.iter().collect();
    // Viewers expect begin order; outer spans first when two start together.
    sorted.sort_by(|a, b| {
        a.start_us
            .total_cmp(&b.start_us)
            .then(a.depth.cmp(&b.depth))
    });
    for s in sorted {
        let mut args = serde_json::Map::new();
        for (k, v) in &s.fields {
            args.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
        if let (Some(a), Some(b)) = (s.rss_start, s.rss_end) {
            args.insert("rss_mib".into(), serde_json::json!(b as f64 / 1048576.0));
            args.insert(
                "rss_delta_kib".into(),
                serde_json::json!((b as i64 - a as i64) / 1024),
            );
        }
        // `timed("name", ..)` spans show under the user's name, nodes under their operator.
        let name = s.label();
        events.push(serde_json::json!({
            "name": name, "cat": "kiln", "ph": "X", "pid": 1, "tid": s.thread,
            "ts": s.start_us, "dur": s.dur_us, "args": args,
        }));
    }
    // A memory track: resident memory at the end of every outermost span, as counter events
    // (Perfetto and chrome://tracing draw them as a graph above the thread).
    let mut roots: Vec<&SpanRecord> = spans.iter().filter(|s| s.depth == 0).collect();
    roots.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    for s in roots {
        if let Some(rss) = s.rss_end {
            events.push(serde_json::json!({
                "name": "resident memory", "ph": "C", "pid": 1, "tid": s.thread,
                "ts": s.start_us + s.dur_us, "args": {"rss_mib": rss as f64 / 1048576.0},
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Aggregated statistics of one span name (or executor operator).
#[derive(Debug, Clone, Serialize)]
pub struct PhaseStats {
    /// Span name ([`SpanRecord::label`]).
    pub name: String,
    /// Times it ran.
    pub count: usize,
    /// Total milliseconds.
    pub total_ms: f64,
    /// Mean milliseconds.
    pub mean_ms: f64,
    /// Median milliseconds.
    pub p50_ms: f64,
    /// 95th percentile milliseconds.
    pub p95_ms: f64,
    /// Share of the profiled wall time (outermost spans' extent).
    pub share: f64,
    /// Largest growth of resident memory across one run of the span, bytes.
    pub max_rss_growth: i64,
    /// Highest resident memory seen at its exit, bytes.
    pub peak_rss: u64,
}

/// Groups spans by [`SpanRecord::label`], sorted by total time (descending).
pub fn phase_table(spans: &[SpanRecord]) -> Vec<PhaseStats> {
    let wall_us = {
        let roots = spans.iter().filter(|s| s.depth == 0);
        let start = roots
            .clone()
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        let end = roots.map(|s| s.start_us + s.dur_us).fold(0.0, f64::max);
        (end - start).max(1e-9)
    };
    let mut groups: BTreeMap<String, Vec<&SpanRecord>> = BTreeMap::new();
    for s in spans {
        groups.entry(s.label()).or_default().push(s);
    }
    let mut table: Vec<PhaseStats> = groups
        .into_iter()
        .map(|(name, runs)| {
            let mut ms: Vec<f64> = runs.iter().map(|s| s.dur_us / 1e3).collect();
            ms.sort_by(f64::total_cmp);
            let total: f64 = ms.iter().sum();
            let pick = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
            PhaseStats {
                name,
                count: runs.len(),
                total_ms: total,
                mean_ms: total / runs.len() as f64,
                p50_ms: pick(0.5),
                p95_ms: pick(0.95),
                share: total * 1e3 / wall_us,
                max_rss_growth: runs
                    .iter()
                    .filter_map(|s| Some(s.rss_end? as i64 - s.rss_start? as i64))
                    .max()
                    .unwrap_or(0),
                peak_rss: runs.iter().filter_map(|s| s.rss_end).max().unwrap_or(0),
            }
        })
        .collect();
    table.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    table
}

/// Renders the table for people: by total time, then the top phases by memory growth.
pub fn render_table(table: &[PhaseStats]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    // Op spans (`kiln.conv2d.grad_weight`) are longer than phase names.
    let w = table
        .iter()
        .map(|p| p.name.len())
        .max()
        .unwrap_or(0)
        .max(14);
    let _ = writeln!(
        out,
        "{:<w$} {:>6} {:>11} {:>9} {:>9} {:>9} {:>7} {:>12} {:>10}",
        "phase",
        "count",
        "total ms",
        "mean ms",
        "p50 ms",
        "p95 ms",
        "share",
        "max RSS +",
        "peak RSS"
    );
    for p in table {
        let _ = writeln!(
            out,
            "{:<w$} {:>6} {:>11.2} {:>9.3} {:>9.3} {:>9.3} {:>6.1}% {:>12} {:>10}",
            p.name,
            p.count,
            p.total_ms,
            p.mean_ms,
            p.p50_ms,
            p.p95_ms,
            100.0 * p.share,
            super::memory::human_bytes(p.max_rss_growth.max(0) as u64),
            super::memory::human_bytes(p.peak_rss)
        );
    }
    let mut by_memory: Vec<&PhaseStats> = table.iter().filter(|p| p.max_rss_growth > 0).collect();
    by_memory.sort_by_key(|p| std::cmp::Reverse(p.max_rss_growth));
    if !by_memory.is_empty() {
        let _ = writeln!(
            out,
            "\nby memory (largest RSS growth within one run of the phase):"
        );
        for p in by_memory.iter().take(5) {
            let _ = writeln!(
                out,
                "  {:<w$} +{}",
                p.name,
                super::memory::human_bytes(p.max_rss_growth as u64)
            );
        }
    }
    out
}
