//! Reports a person can read: one self-contained HTML file per run directory — the plan and
//! where each value came from, loss/throughput/memory curves, evaluation per epoch, the
//! tuner's trials, and the bottleneck verdict. Charts are inline SVG generated here; no
//! network, no JavaScript library.
//!
//! A run directory holds `events.jsonl` (written by `kiln train --run-dir DIR`) and,
//! optionally, `tune.json` (`kiln tune auto --out DIR/kiln.toml`) and `verdict.json`
//! (`kiln profile --out DIR`).

pub mod svg;

use std::path::{Path, PathBuf};

use crate::error::{KilnError, Result};
use crate::observe::{EpochSummary, Event, RunSummary, StepEvent};
use crate::tune::bottleneck::{RunContext, StepSplit, diagnose};

/// What a run directory holds.
#[derive(Debug, Clone, Default)]
pub struct RunData {
    /// The resolved plan from the run's start event.
    pub plan: Option<serde_json::Value>,
    /// Model name.
    pub model: String,
    /// Every step.
    pub steps: Vec<StepEvent>,
    /// Every epoch end.
    pub epochs: Vec<EpochSummary>,
    /// The run summary, if the run finished.
    pub summary: Option<RunSummary>,
    /// Other notable events (guard, watermark, batch adaptation), as one line each.
    pub notes: Vec<String>,
    /// The auto-optimizer's report, if present.
    pub tune: Option<serde_json::Value>,
    /// A profiler verdict, if present.
    pub verdict: Option<serde_json::Value>,
}

/// Reads a run directory.
pub fn load_run(dir: &Path) -> Result<RunData> {
    let events_path = dir.join("events.jsonl");
    let text = std::fs::read_to_string(&events_path).map_err(|e| KilnError::BadData {
        path: events_path.clone(),
        problem: format!(
            "cannot read it ({e}); a run directory is written by `kiln train --run-dir DIR`"
        ),
    })?;
    let mut run = RunData::default();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let event: Event = serde_json::from_str(line).map_err(|e| KilnError::BadData {
            path: events_path.clone(),
            problem: format!("line {}: not a Kiln event ({e})", i + 1),
        })?;
        match event {
            Event::RunStarted { model, plan, .. } => {
                run.model = model;
                run.plan = plan;
            }
            Event::Step(s) => run.steps.push(s),
            Event::EpochEnd(e) => run.epochs.push(e),
            Event::RunFinished(s) => run.summary = Some(s),
            Event::Guard(g) => run.notes.push(format!(
                "step {}: non-finite {:?}, guard {:?}",
                g.step, g.trouble, g.action
            )),
            Event::MemoryWatermark(m) => run.notes.push(format!(
                "step {}: memory in use {} crossed the watermark {}",
                m.step,
                crate::observe::memory::human_bytes(m.in_use_bytes),
                crate::observe::memory::human_bytes(m.threshold_bytes)
            )),
            Event::BatchAdapted(b) => run.notes.push(format!(
                "step {}: micro-batch halved to {} x {} accumulation (effective {})",
                b.step, b.micro_batch, b.grad_accum_steps, b.effective_batch
            )),
            Event::SamplesSkipped { epoch, samples } => run.notes.push(format!(
                "epoch {epoch}: {} unreadable samples left out (first: {})",
                samples.len(),
                samples
                    .first()
                    .map_or(String::new(), |s| format!("{}: {}", s.name, s.reason))
            )),
            Event::Checkpoint { .. } => {}
        }
    }
    let optional = |name: &str| -> Result<Option<serde_json::Value>> {
        let path = dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(t) => serde_json::from_str(&t)
                .map(Some)
                .map_err(|e| KilnError::BadData {
                    path,
                    problem: format!("not valid JSON ({e})"),
                }),
            Err(_) => Ok(None),
        }
    };
    run.tune = optional("tune.json")?;
    run.verdict = optional("verdict.json")?;
    Ok(run)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The bottleneck verdict: the profiler's when present, else from the steps' data/compute
/// split.
fn verdict_html(run: &RunData) -> String {
    if let Some(v) = &run.verdict {
        return format!(
            "<p><b>{}</b></p><p>Next: {}</p><p class=\"muted\">from the profiler (verdict.json)</p>",
            esc(v["summary"].as_str().unwrap_or("")),
            esc(v["action"].as_str().unwrap_or(""))
        );
    }
    if run.steps.is_empty() {
        return "<p>No steps recorded.</p>".into();
    }
    let total: f64 = run.steps.iter().map(|s| s.step_ms).sum();
    let data: f64 = run.steps.iter().map(|s| s.data_ms).sum();
    let data_share = data / total.max(1e-9);
    let split = StepSplit {
        step_ms: total / run.steps.len() as f64,
        data: data_share,
        transfer: 0.0,
        compute: 1.0 - data_share,
        optimizer: 0.0,
        overhead: 0.0,
    };
    let setting = |key: &str| {
        run.plan
            .as_ref()
            .and_then(|p| p.pointer(&format!("/settings/{key}/value")).cloned())
    };
    let ctx = RunContext {
        workers: setting("data.workers")
            .and_then(|v| v.as_u64())
            .unwrap_or(0) as usize,
        cores: run
            .plan
            .as_ref()
            .and_then(|p| p.pointer("/hardware/cores"))
            .and_then(|v| v.as_u64())
            .unwrap_or(1) as usize,
        batch_size: setting("train.batch_size")
            .and_then(|v| v.as_u64())
            .unwrap_or(64) as usize,
        gpu: setting("device.backend").is_some_and(|v| v == "cuda"),
    };
    let v = diagnose(&split, &ctx);
    format!(
        "<p><b>{}</b></p><p>Next: {}</p><p class=\"muted\">from the step timings (data wait vs \
         the rest); `kiln profile` splits compute further</p>",
        esc(&v.summary),
        esc(&v.action)
    )
}

fn plan_html(plan: &serde_json::Value) -> String {
    let mut html = format!(
        "<p>level <b>{}</b> ({})</p><table><tr><th>setting</th><th>value</th><th>source</th></tr>",
        esc(plan["level"].as_str().unwrap_or("?")),
        esc(plan["level_source"].as_str().unwrap_or(""))
    );
    if let Some(settings) = plan["settings"].as_object() {
        for (k, s) in settings {
            html.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(k),
                esc(&s["value"].to_string()),
                esc(s["source"].as_str().unwrap_or(""))
            ));
        }
    }
    html.push_str("</table>");
    html
}

fn tune_html(tune: &serde_json::Value) -> String {
    let Some(decisions) = tune["decisions"].as_array() else {
        return "<p>tune.json holds no decisions.</p>".into();
    };
    let mut rows = String::from(
        "<table><tr><th>#</th><th>precision</th><th>micro-batch</th><th>accum</th><th>checkpointing</th><th>workers</th><th>samples/s</th><th>kept</th><th>why</th></tr>",
    );
    let mut bars = Vec::new();
    for (i, d) in decisions.iter().enumerate() {
        let m = &d["measured"];
        let c = &m["candidate"];
        let sps = m["samples_per_s"].as_f64().unwrap_or(0.0);
        rows.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{}</td><td>{}</td></tr>",
            i + 1,
            esc(&c["precision"].to_string()),
            c["micro_batch"],
            c["grad_accum_steps"],
            c["checkpointing"],
            c["workers"],
            sps,
            if d["kept"] == true { "yes" } else { "" },
            esc(d["reason"].as_str().unwrap_or(""))
        ));
        bars.push((
            format!(
                "{} {} {}x{}{}",
                i + 1,
                c["precision"].as_str().unwrap_or("?"),
                c["micro_batch"],
                c["grad_accum_steps"],
                if c["checkpointing"] == true {
                    " ckpt"
                } else {
                    ""
                }
            ),
            sps,
            d["kept"] == true,
        ));
    }
    rows.push_str("</table>");
    let skipped: String = tune["skipped"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|x| format!("<li>skipped {}</li>", esc(x.as_str().unwrap_or(""))))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{}{rows}<ul>{skipped}</ul>",
        svg::bar_chart("Auto-optimizer trials", "samples/s (green: kept)", &bars)
    )
}

/// Renders the report.
pub fn render_html(run: &RunData) -> String {
    let xy = |f: &dyn Fn(&StepEvent) -> Option<f64>| step_series(run, f);
    let loss = svg::line_chart(
        "Training loss",
        "step",
        "loss",
        &[("train loss", xy(&|s| Some(s.loss as f64)))],
    );
    let throughput = svg::line_chart(
        "Throughput",
        "step",
        "samples/s",
        &[("samples/s", xy(&|s| Some(s.samples_per_s)))],
    );
    let memory = svg::line_chart(
        "Memory over time",
        "step",
        "MiB",
        &[(
            "peak resident memory",
            xy(&|s| s.peak_rss_bytes.map(|b| b as f64 / 1048576.0)),
        )],
    );
    let parallel = ranks_chart(run);
    let eval_points: Vec<(f64, f64)> = run
        .epochs
        .iter()
        .filter_map(|e| Some(((e.epoch + 1) as f64, e.test_accuracy? * 100.0)))
        .collect();
    let accuracy = svg::line_chart(
        "Held-out accuracy",
        "epoch",
        "%",
        &[("test accuracy", eval_points)],
    );
    let summary = match &run.summary {
        Some(s) => format!(
            "<p>{} steps, {} epochs, test accuracy {}, {:.0} samples/s, data wait {:.1}%, wall \
             {:.1} s, peak RSS {}</p>",
            s.steps,
            s.epochs,
            s.test_accuracy
                .map_or("n/a".into(), |a| format!("{:.2}%", a * 100.0)),
            s.samples_per_s,
            s.data_wait_share * 100.0,
            s.wall_seconds,
            s.peak_rss_bytes
                .map_or("n/a".into(), crate::observe::memory::human_bytes)
        ),
        None => "<p>The run did not finish (no run_finished event).</p>".into(),
    };
    let notes: String = run
        .notes
        .iter()
        .map(|n| format!("<li>{}</li>", esc(n)))
        .collect();
    let plan = run
        .plan
        .as_ref()
        .map_or("<p>No plan recorded.</p>".into(), plan_html);
    let tune = run.tune.as_ref().map_or(
        "<p>No tuner trials in this run directory (`kiln tune auto --out DIR/kiln.toml`).</p>"
            .into(),
        tune_html,
    );
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Kiln report: {model}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }}
h1 {{ font-size: 1.6em; }} h2 {{ border-bottom: 1px solid #ddd; padding-bottom: .2em; }}
table {{ border-collapse: collapse; font-size: .9em; }} td, th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: left; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 1em; }} .muted {{ color: #777; font-size: .9em; }}
</style></head>
<body>
<h1>Kiln report: {model}</h1>
{summary}
<h2>Bottleneck</h2>
{verdict}
<h2>Curves</h2>
<div class="charts">{loss}{throughput}{memory}{accuracy}{parallel}</div>
<h2>Events</h2>
<ul>{notes}</ul>
<h2>Tuner</h2>
{tune}
<h2>Plan</h2>
{plan}
<script>
// Self-check for headless tests: count the charts that rendered with a non-empty box.
document.body.dataset.plots = Array.from(document.querySelectorAll('svg.chart'))
  .filter(s => s.getBoundingClientRect().width > 0 && s.querySelector('.series')).length;
</script>
</body></html>
"#,
        model = esc(&run.model),
        verdict = verdict_html(run),
    )
}

/// `(step, f(step))` for the steps where `f` has a value.
fn step_series(run: &RunData, f: impl Fn(&StepEvent) -> Option<f64>) -> Vec<(f64, f64)> {
    run.steps
        .iter()
        .filter_map(|s| Some((s.step as f64, f(s)?)))
        .collect()
}

/// For a data-parallel run (steps with `rank_compute_ms`): each rank's forward + backward
/// time per step and rank 0's reduction time, where a straggler or a costly all-reduce shows;
/// empty for a run of one process.
fn ranks_chart(run: &RunData) -> String {
    let ranks = run
        .steps
        .iter()
        .filter_map(|s| s.rank_compute_ms.as_ref().map(Vec::len))
        .max()
        .unwrap_or(0);
    if ranks == 0 {
        return String::new();
    }
    let mut series: Vec<(String, Vec<(f64, f64)>)> = (0..ranks)
        .map(|r| {
            (
                format!("rank {r} forward+backward"),
                step_series(run, |s| s.rank_compute_ms.as_ref()?.get(r).copied()),
            )
        })
        .collect();
    series.push((
        "all-reduce (rank 0)".into(),
        step_series(run, |s| s.reduce_ms),
    ));
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    svg::line_chart("Data-parallel ranks", "step", "ms", &named)
}

/// Renders `dir`'s run into `out` (default `dir/report.html`), atomically; returns the path.
pub fn write_report(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    let run = load_run(dir)?;
    let path = out.map_or_else(|| dir.join("report.html"), Path::to_path_buf);
    crate::fsutil::write_atomic(&path, render_html(&run).as_bytes())?;
    Ok(path)
}
