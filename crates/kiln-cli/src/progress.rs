//! The people-facing event sink, a live monitor: on a terminal a progress bar with loss,
//! throughput, data-wait share and memory; otherwise (pipes, CI logs) the same figures as a
//! plain line every 10% of the run, plus one line per epoch.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use kiln::observe::{Event, EventSink, memory};

/// Renders run events as a progress bar (TTY) or one line per epoch (pipes, CI logs).
pub struct ProgressSink {
    bar: Option<ProgressBar>,
    tty: bool,
    data_ms: f64,
    step_ms: f64,
    total_steps: u64,
}

impl ProgressSink {
    pub fn new() -> Self {
        ProgressSink {
            bar: None,
            tty: std::io::stderr().is_terminal(),
            data_ms: 0.0,
            step_ms: 0.0,
            total_steps: 0,
        }
    }

    fn line(&self, text: String) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => eprintln!("{text}"),
        }
    }
}

impl EventSink for ProgressSink {
    fn emit(&mut self, event: &Event) {
        if let Event::RunStarted {
            plan: Some(plan), ..
        } = event
        {
            report_worker_choice(plan);
        }
        if let Event::RunStarted { total_steps, .. } = event {
            self.total_steps = *total_steps;
        }
        match event {
            Event::RunStarted {
                total_steps,
                start_step,
                ..
            } if self.tty => {
                let bar = ProgressBar::new(*total_steps);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                bar.set_position(*start_step);
                // Until the first step reports (on a GPU it compiles its kernels first, or
                // finds them in device.kernel_cache): the elapsed time keeps moving.
                bar.set_message("first step…");
                bar.enable_steady_tick(std::time::Duration::from_millis(250));
                self.bar = Some(bar);
            }
            Event::Step(s) => {
                self.data_ms += s.data_ms;
                self.step_ms += s.step_ms;
                let status = format!(
                    "loss {:.4} | {:.0} samples/s | data wait {:.1}% | RSS {}",
                    s.loss,
                    s.samples_per_s,
                    100.0 * self.data_ms / self.step_ms.max(1e-9),
                    s.peak_rss_bytes.map_or("n/a".into(), memory::human_bytes)
                );
                if let Some(bar) = &self.bar {
                    bar.set_position(s.step);
                    bar.set_message(status);
                } else if !self.tty {
                    let every = (self.total_steps / 10).max(1);
                    if s.step.is_multiple_of(every) || s.step == self.total_steps {
                        eprintln!("step {}/{}: {status}", s.step, self.total_steps);
                    }
                }
            }
            Event::EpochEnd(e) => self.line(format!(
                "epoch {}: train loss {:.4}{} ({:.1}s)",
                e.epoch + 1,
                e.train_loss,
                e.test_accuracy.map_or(String::new(), |a| format!(
                    ", test accuracy {:.2}%, test loss {:.4}",
                    a * 100.0,
                    e.test_loss.unwrap_or(f32::NAN)
                )),
                e.seconds
            )),
            Event::Checkpoint { path, .. } => {
                tracing::info!("checkpoint written: {path}");
            }
            Event::RunFinished(_) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
            _ => {}
        }
    }
}

/// Prints the measured `data.workers = auto` choice (the trainer writes it into the plan).
fn report_worker_choice(plan: &serde_json::Value) {
    let Some(trials) = plan.get("data_workers_trials").and_then(|t| t.as_array()) else {
        return;
    };
    let source = plan
        .pointer("/settings/data.workers/source")
        .and_then(|s| s.as_str())
        .unwrap_or("");
    eprintln!(
        "kiln: data.workers = auto -> {}",
        source.trim_start_matches("probe: ")
    );
    for t in trials {
        eprintln!(
            "  {} worker(s): step {:.1} ms, data wait {:.2} ms ({:.1}%)",
            t["workers"],
            t["step_ms"].as_f64().unwrap_or(f64::NAN),
            t["wait_ms"].as_f64().unwrap_or(f64::NAN),
            100.0 * t["wait_share"].as_f64().unwrap_or(f64::NAN)
        );
    }
}
