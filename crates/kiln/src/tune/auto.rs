//! The auto-optimizer: short measured trials over the plan space that matters on this
//! machine — Kiln's CPU kernels, precision, micro-batch (with accumulation keeping the
//! effective batch), activation checkpointing, loader workers — keeping what measurably wins.
//!
//! Strategy: coordinate descent from the f32 baseline, one dimension at a time, pruning with
//! what the trials taught:
//! 0. **kernels** (CPU only) — Burn's own ops instead of Kiln's kernels (`kiln::kernels`),
//!    kept only where they measurably win on this machine.
//! 1. **precision** — bf16 first; where bf16 loses to f32 the device has no fast
//!    low-precision path and f16 is skipped (on this CPU both are emulated). A low-precision
//!    candidate must also pass a numerics check against the f32 baseline on the same
//!    steps (mean loss within 5% + 0.02).
//! 2. **micro-batch** — halve while it speeds up by more than the noise margin (accumulation
//!    doubles, so the optimization is unchanged: the effective batch is the user's).
//! 3. **activation checkpointing** — kept only if it is not slower (it trades compute for
//!    memory; the batch search is the tool when memory is the limit).
//! 4. **loader workers** — tried only when the baseline waited for data at all.
//!
//! A change is kept only when it beats the current best by [`MIN_GAIN`]: smaller differences
//! are this machine's noise, and a "win" inside the noise is a coin flip that costs trials.
//! An apparent win must also win a back-to-back re-measurement against the current best.

use std::time::Instant;

use burn::tensor::Device;
use serde::Serialize;

use crate::KilnConfig;
use crate::data::{BatchSource, Dataset};
use crate::error::Result;
use crate::observe::MemorySink;
use crate::precision::Precision;
use crate::train::{TrainOptions, TrainStep, Trainer};
use crate::zoo::ModelKind;

/// Relative speed-up a change must show to be kept.
pub const MIN_GAIN: f64 = 0.03;

/// Untimed steps at the start of each trial.
const WARMUP_STEPS: u64 = 2;

/// One point of the plan space.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidate {
    /// Precision policy.
    pub precision: Precision,
    /// Micro-batch size.
    pub micro_batch: usize,
    /// Accumulation steps (micro-batch × this = the effective batch).
    pub grad_accum_steps: usize,
    /// Activation checkpointing.
    pub checkpointing: bool,
    /// Loader worker threads.
    pub workers: usize,
    /// Kiln's CPU kernels (false = Burn's own ops).
    pub kiln_kernels: bool,
}

/// What a trial measured.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// The candidate.
    pub candidate: Candidate,
    /// Median samples/s over the timed steps.
    pub samples_per_s: f64,
    /// Mean training loss over the timed steps.
    pub mean_loss: f64,
    /// Mean data-wait share of step time.
    pub data_share: f64,
    /// Wall seconds the trial took (model build and warm-up included).
    pub seconds: f64,
}

/// One entry of the tuner's log.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The trial.
    pub measured: Measured,
    /// Whether it became the new best.
    pub kept: bool,
    /// Why.
    pub reason: String,
}

/// The tuner's result.
#[derive(Debug, Clone, Serialize)]
pub struct TuneReport {
    /// The winner.
    pub best: Measured,
    /// The f32 baseline it started from.
    pub baseline: Measured,
    /// Every trial and decision, in order.
    pub decisions: Vec<Decision>,
    /// Dimensions not explored, and why.
    pub skipped: Vec<String>,
    /// Wall seconds of all trials.
    pub seconds: f64,
    /// On a GPU: the A/B of CubeCL's autotune levels (`device.autotune`), when it ran.
    pub autotune: Option<AutotuneAb>,
}

/// The A/B of CubeCL's autotune levels on a GPU: each level's samples/s from its own
/// process (the level is fixed once per process), and the level kept.
#[derive(Debug, Clone, Serialize)]
pub struct AutotuneAb {
    /// `(level, samples/s)` per level tried, CubeCL's default (`balanced`) first.
    pub measured: Vec<(String, f64)>,
    /// The level kept (written as `device.autotune`).
    pub kept: String,
    /// Why, in words.
    pub reason: String,
}

impl AutotuneAb {
    /// Keeps the fastest level only where it beats the default (the first measured) by
    /// [`MIN_GAIN`]: a smaller lead is noise, and the default costs the least tuning time.
    pub fn choose(measured: Vec<(String, f64)>) -> Option<AutotuneAb> {
        let (default, base) = measured.first().cloned()?;
        let (best, speed) = measured
            .iter()
            .cloned()
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        let (kept, reason) = if best != default && speed > base * (1.0 + MIN_GAIN) {
            (
                best.clone(),
                format!(
                    "autotune {best}: {speed:.0} samples/s vs {base:.0} at {default} ({:+.1}%)",
                    100.0 * (speed / base - 1.0)
                ),
            )
        } else {
            (
                default.clone(),
                format!(
                    "autotune {default} kept: no level beat it by {:.0}% ({})",
                    MIN_GAIN * 100.0,
                    measured
                        .iter()
                        .map(|(l, v)| format!("{l} {v:.0}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        };
        Some(AutotuneAb {
            measured,
            kept,
            reason,
        })
    }
}

/// Runs `steps` timed training steps of the zoo `model` on `data` with a candidate, on
/// `device` (the plan's: a GPU where the run has one).
pub fn run_trial(
    model: ModelKind,
    data: &dyn Dataset,
    base: &TrainOptions,
    candidate: &Candidate,
    steps: u64,
    device: &Device,
) -> Result<Measured> {
    measure(base, candidate, steps, |options, sink| {
        Trainer::new(options, device.clone(), sink)
            .fit(model.name(), |d| model.init(d), data, None)
            .map(drop)
    })
}

/// Runs `steps` timed training steps of the model `init` builds (any [`TrainStep`] model) on
/// `data` (any [`BatchSource`]) with a candidate: the trial of [`search_source`].
pub fn run_trial_source<B: Send, M: TrainStep<B> + 'static>(
    name: &str,
    init: &dyn Fn(&Device) -> M,
    data: &dyn BatchSource<Batch = B>,
    base: &TrainOptions,
    candidate: &Candidate,
    steps: u64,
) -> Result<Measured> {
    measure(base, candidate, steps, |options, sink| {
        Trainer::new(options, Device::flex(), sink)
            .fit_source(name, init, data, None)
            .map(drop)
    })
}

/// The auto-optimizer on the caller's own model and data (CPU): the library form of `kiln
/// tune auto`. `base` carries everything the tuner does not vary (optimizer, learning rate,
/// clipping, ...); `effective_batch` is kept by every candidate.
pub fn search_source<B: Send, M: TrainStep<B> + 'static>(
    name: &str,
    init: &dyn Fn(&Device) -> M,
    data: &dyn BatchSource<Batch = B>,
    base: &TrainOptions,
    effective_batch: usize,
    steps: u64,
    time_budget: Option<std::time::Duration>,
) -> Result<TuneReport> {
    let cores = crate::plan::Hardware::probe().cores;
    auto_tune(effective_batch, cores, false, time_budget, |c| {
        run_trial_source(name, init, data, base, c, steps)
    })
}

/// Times one candidate: `fit` trains with the candidate's options into the sink; the timed
/// steps are those after [`WARMUP_STEPS`].
fn measure(
    base: &TrainOptions,
    candidate: &Candidate,
    steps: u64,
    fit: impl FnOnce(TrainOptions, &mut MemorySink) -> Result<()>,
) -> Result<Measured> {
    let start = Instant::now();
    let options = TrainOptions {
        precision: candidate.precision,
        batch_size: candidate.micro_batch,
        grad_accum_steps: candidate.grad_accum_steps,
        activation_checkpointing: candidate.checkpointing,
        workers: Some(candidate.workers),
        kiln_kernels: candidate.kiln_kernels,
        max_steps: Some(WARMUP_STEPS + steps.max(1)),
        epochs: 1000,
        eval_every_epochs: 0,
        checkpoint_dir: None,
        checkpoint_every_steps: None,
        scaler: crate::precision::ScalerOptions::default(),
        // Each step read at its end: between sync points a step's time is the host's and an
        // asynchronous device runs behind it, so per-step rates need a sync per step. The
        // read costs every candidate alike.
        sync_every: 1,
        ..base.clone()
    };
    let mut sink = MemorySink::default();
    fit(options, &mut sink)?;
    let timed: Vec<(f64, f64, f64, usize)> = sink
        .steps()
        .filter(|s| s.step > WARMUP_STEPS)
        .map(|s| (s.step_ms, s.data_ms, s.loss as f64, s.samples))
        .collect();
    let mut rates: Vec<f64> = timed
        .iter()
        .map(|t| t.3 as f64 / (t.0 / 1e3).max(1e-9))
        .collect();
    rates.sort_by(f64::total_cmp);
    let n = timed.len().max(1) as f64;
    Ok(Measured {
        candidate: *candidate,
        samples_per_s: rates.get(rates.len() / 2).copied().unwrap_or(0.0),
        mean_loss: timed.iter().map(|t| t.2).sum::<f64>() / n,
        data_share: timed.iter().map(|t| t.1 / t.0.max(1e-9)).sum::<f64>() / n,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Whether a low-precision trial's loss agrees with the f32 baseline's on the same steps.
fn numerics_ok(m: &Measured, baseline: &Measured) -> bool {
    m.mean_loss.is_finite()
        && (m.mean_loss - baseline.mean_loss).abs() <= 0.05 * baseline.mean_loss.abs() + 0.02
}

/// Logs a trial and keeps it as the new best when it wins by more than [`MIN_GAIN`] — twice:
/// an apparent win is re-measured back to back with the current best (one more trial each)
/// and kept only if the candidate also wins that second round and the sum of both. Short
/// trials on a shared machine are noisy; confirming only the apparent wins costs few trials.
fn consider(
    decisions: &mut Vec<Decision>,
    best: &mut Measured,
    m: Measured,
    why: &str,
    trial: &mut dyn FnMut(&Candidate) -> Result<Measured>,
) -> Result<bool> {
    let gain = m.samples_per_s / best.samples_per_s.max(1e-9) - 1.0;
    let mut kept = gain > MIN_GAIN;
    let mut confirm = String::new();
    if kept {
        let again_best = trial(&best.candidate)?;
        let again = trial(&m.candidate)?;
        let total_best = best.samples_per_s + again_best.samples_per_s;
        let total = m.samples_per_s + again.samples_per_s;
        let confirmed = total / total_best.max(1e-9) - 1.0;
        // Both: the second round alone must not contradict the first.
        kept = confirmed > MIN_GAIN && again.samples_per_s > again_best.samples_per_s;
        // The best's figure is never rewritten (re-measurements only decide): it can then
        // only rise, so the winner is never reported below the baseline it started from.
        confirm = format!(
            "; re-measured back to back: {:.0} vs {:.0} ({:+.1}% over both rounds)",
            again.samples_per_s,
            again_best.samples_per_s,
            100.0 * confirmed
        );
    }
    let reason = format!(
        "{why}: {:.0} samples/s, {:+.1}% vs best{confirm}{}",
        m.samples_per_s,
        100.0 * gain,
        if kept {
            " — kept"
        } else if gain > MIN_GAIN {
            " — not confirmed"
        } else {
            " — within noise or slower"
        }
    );
    if kept {
        *best = m.clone();
    }
    decisions.push(Decision {
        measured: m,
        kept,
        reason,
    });
    Ok(kept)
}

/// The auto-optimizer; see the module documentation. `trial` measures a candidate; `cores`
/// bounds the worker counts tried; `gpu` says whether low precision can be fast.
pub fn auto_tune(
    effective_batch: usize,
    cores: usize,
    gpu: bool,
    time_budget: Option<std::time::Duration>,
    mut trial: impl FnMut(&Candidate) -> Result<Measured>,
) -> Result<TuneReport> {
    let start = Instant::now();
    // Checked before each dimension and each trial of a loop: the budget bounds the search,
    // the trial in flight always finishes.
    let out_of_time = || time_budget.is_some_and(|b| start.elapsed() >= b);
    let base_candidate = Candidate {
        precision: Precision::F32,
        micro_batch: effective_batch,
        grad_accum_steps: 1,
        checkpointing: false,
        workers: 0,
        kiln_kernels: true,
    };
    let baseline = trial(&base_candidate)?;
    let mut best = baseline.clone();
    let mut decisions = vec![Decision {
        measured: baseline.clone(),
        kept: true,
        reason: "f32 baseline".into(),
    }];
    let mut skipped = Vec::new();
    let mut dimensions_left = true;
    // 0. Kiln's kernels vs Burn's own ops (they exist for the CPU only).
    if gpu {
        skipped.push("Kiln's kernels: CPU only, the GPU runs Burn's ops".into());
    } else if !out_of_time() {
        let m = trial(&Candidate {
            kiln_kernels: false,
            ..best.candidate
        })?;
        let why = "Burn's own ops (Kiln's kernels off)";
        consider(&mut decisions, &mut best, m, why, &mut trial)?;
    }
    // 1. Precision.
    if out_of_time() {
        dimensions_left = false;
    }
    if dimensions_left {
        let bf16 = trial(&Candidate {
            precision: Precision::Bf16,
            ..best.candidate
        })?;
        let bf16_ratio = bf16.samples_per_s / baseline.samples_per_s.max(1e-9);
        if numerics_ok(&bf16, &baseline) {
            consider(&mut decisions, &mut best, bf16, "bf16", &mut trial)?;
        } else {
            decisions.push(Decision {
                reason: format!(
                    "bf16: mean loss {:.4} vs f32 {:.4} — fails the numerics check",
                    bf16.mean_loss, baseline.mean_loss
                ),
                measured: bf16,
                kept: false,
            });
        }
        if bf16_ratio < 1.0 && !gpu {
            skipped.push(format!(
                "f16: bf16 ran at {bf16_ratio:.2}x f32 — no fast low-precision path on this device"
            ));
        } else {
            let f16 = trial(&Candidate {
                precision: Precision::F16,
                ..best.candidate
            })?;
            if numerics_ok(&f16, &baseline) {
                consider(&mut decisions, &mut best, f16, "f16", &mut trial)?;
            } else {
                decisions.push(Decision {
                    reason: "f16: fails the numerics check".into(),
                    measured: f16,
                    kept: false,
                });
            }
        }
    }

    // 2. Micro-batch (effective batch kept).
    let mut micro = best.candidate.micro_batch;
    while micro >= 2 && micro.is_multiple_of(2) {
        if out_of_time() {
            dimensions_left = false;
            break;
        }
        let c = Candidate {
            micro_batch: micro / 2,
            grad_accum_steps: best.candidate.grad_accum_steps * 2,
            ..best.candidate
        };
        let m = trial(&c)?;
        let why = format!("micro-batch {} x {}", c.micro_batch, c.grad_accum_steps);
        if !consider(&mut decisions, &mut best, m, &why, &mut trial)? {
            break;
        }
        micro /= 2;
    }

    // 3. Activation checkpointing.
    if dimensions_left && !out_of_time() {
        let m = trial(&Candidate {
            checkpointing: true,
            ..best.candidate
        })?;
        consider(
            &mut decisions,
            &mut best,
            m,
            "activation checkpointing",
            &mut trial,
        )?;
    } else {
        dimensions_left = false;
    }

    // 4. Loader workers, only where the baseline waited for data.
    if !dimensions_left {
        skipped.push(format!(
            "the rest of the search: the time budget ({:.0} s) is spent",
            time_budget.map_or(0.0, |b| b.as_secs_f64())
        ));
    } else if best.data_share >= 0.02 {
        for workers in 1..=cores.max(1) {
            if out_of_time() {
                break;
            }
            let m = trial(&Candidate {
                workers,
                ..best.candidate
            })?;
            let why = format!("{workers} loader worker(s)");
            if !consider(&mut decisions, &mut best, m, &why, &mut trial)? {
                break;
            }
        }
    } else {
        skipped.push(format!(
            "loader workers: data wait is {:.1}% of the step — workers cannot help",
            100.0 * best.data_share
        ));
    }
    Ok(TuneReport {
        best,
        baseline,
        decisions,
        skipped,
        seconds: start.elapsed().as_secs_f64(),
        autotune: None,
    })
}

/// The exhaustive grid over the same space (for measuring the tuner against it).
pub fn grid_candidates(effective_batch: usize, cores: usize) -> Vec<Candidate> {
    let mut out = Vec::new();
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        for div in [1usize, 2, 4] {
            if !effective_batch.is_multiple_of(div) {
                continue;
            }
            for checkpointing in [false, true] {
                for workers in [0, cores.max(1)] {
                    for kiln_kernels in [true, false] {
                        out.push(Candidate {
                            precision,
                            micro_batch: effective_batch / div,
                            grad_accum_steps: div,
                            checkpointing,
                            workers,
                            kiln_kernels,
                        });
                    }
                }
            }
        }
    }
    out
}

/// The winner as a `kiln.toml` the user can commit, with the reasons as comments: the
/// user's own config (`base`: its level and every value from their file and flags) with the
/// tuned keys set, written through the config's schema ([`KilnConfig::to_toml_string`]).
pub fn to_toml(base: &KilnConfig, model: ModelKind, report: &TuneReport) -> Result<String> {
    let c = &report.best.candidate;
    let mut config = base.clone();
    // The trials ran at this level: write it even where it was the default.
    config.set_level(base.level);
    let tuned = [
        ("train.model", toml::Value::String(model.name().into())),
        (
            "train.batch_size",
            toml::Value::Integer(c.micro_batch as i64),
        ),
        (
            "train.grad_accum_steps",
            toml::Value::Integer(c.grad_accum_steps as i64),
        ),
        (
            "train.activation_checkpointing",
            toml::Value::Boolean(c.checkpointing),
        ),
        (
            "precision.policy",
            toml::Value::String(c.precision.name().into()),
        ),
        ("data.workers", toml::Value::Integer(c.workers as i64)),
        ("device.kiln_kernels", toml::Value::Boolean(c.kiln_kernels)),
    ];
    for (key, value) in tuned {
        config.set_value(key, value)?;
    }
    if let Some(ab) = &report.autotune {
        config.set_value("device.autotune", toml::Value::String(ab.kept.clone()))?;
    }
    let mut text = format!(
        "# Written by `kiln tune auto` for {} ({}): {:.0} samples/s vs {:.0} for the f32 \
         baseline ({:+.1}%).\n",
        model.name(),
        model.workload(),
        report.best.samples_per_s,
        report.baseline.samples_per_s,
        100.0 * (report.best.samples_per_s / report.baseline.samples_per_s.max(1e-9) - 1.0)
    );
    if let Some(file) = &base.file {
        text.push_str(&format!(
            "# Starts from {} (its settings kept, the tuned ones replaced).\n",
            file.display()
        ));
    }
    for d in &report.decisions {
        text.push_str(&format!("#   {}\n", d.reason));
    }
    for s in &report.skipped {
        text.push_str(&format!("#   skipped {s}\n"));
    }
    if let Some(ab) = &report.autotune {
        text.push_str(&format!("#   {}\n", ab.reason));
    }
    text.push_str(&config.to_toml_string()?);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic machine: f32 100 samples/s, bf16 90, halving the micro-batch once
    /// gives 110, twice 95; checkpointing 100; Burn's ops instead of Kiln's kernels half the
    /// speed; no data wait.
    fn fake(c: &Candidate) -> Measured {
        let mut sps = match c.precision {
            Precision::F32 => 100.0,
            Precision::Bf16 => 90.0,
            Precision::F16 => 50.0,
        };
        sps *= match c.grad_accum_steps {
            1 => 1.0,
            2 => 1.1,
            _ => 0.95,
        };
        if !c.kiln_kernels {
            sps *= 0.5;
        }
        Measured {
            candidate: *c,
            samples_per_s: sps,
            mean_loss: 2.0,
            data_share: 0.0,
            seconds: 0.0,
        }
    }

    #[test]
    fn keeps_confirmed_wins_and_prunes_with_what_it_learned() {
        let r = auto_tune(128, 2, false, None, |c| Ok(fake(c))).unwrap();
        assert_eq!(r.best.candidate.micro_batch, 64);
        assert_eq!(r.best.candidate.grad_accum_steps, 2);
        assert_eq!(r.best.candidate.precision, Precision::F32);
        assert!(!r.best.candidate.checkpointing);
        assert!(r.best.candidate.kiln_kernels, "Burn's ops are slower here");
        assert!(
            r.decisions
                .iter()
                .any(|d| !d.kept && d.reason.starts_with("Burn's own ops")),
            "the kernels were measured against Burn's ops"
        );
        assert!(
            r.skipped.iter().any(|s| s.starts_with("f16")),
            "{:?}",
            r.skipped
        );
        assert!(r.skipped.iter().any(|s| s.starts_with("loader workers")));
        assert!(
            r.decisions
                .iter()
                .any(|d| d.kept && d.reason.contains("re-measured")),
            "a kept change is confirmed"
        );
    }

    #[test]
    fn a_fluke_win_is_not_confirmed_and_bad_numerics_are_refused() {
        // Checkpointing measures +50% once, then like the baseline: not kept.
        let mut ckpt_calls = 0;
        let r = auto_tune(64, 2, false, None, |c| {
            let mut m = fake(c);
            m.samples_per_s = if c.grad_accum_steps > 1 { 80.0 } else { 100.0 };
            if c.checkpointing {
                ckpt_calls += 1;
                m.samples_per_s = if ckpt_calls == 1 { 150.0 } else { 99.0 };
            }
            if c.precision == Precision::Bf16 {
                m.samples_per_s = 200.0;
                m.mean_loss = 3.0;
            }
            Ok(m)
        })
        .unwrap();
        assert!(!r.best.candidate.checkpointing, "{:?}", r.decisions);
        assert_eq!(
            r.best.candidate.precision,
            Precision::F32,
            "bf16 fails numerics"
        );
        assert!(
            r.decisions
                .iter()
                .any(|d| d.reason.contains("not confirmed"))
        );
        assert!(r.decisions.iter().any(|d| d.reason.contains("numerics")));
    }

    #[test]
    fn a_trial_trains_with_its_candidates_settings_and_touches_no_global_switch() {
        let candidate = Candidate {
            precision: Precision::Bf16,
            micro_batch: 16,
            grad_accum_steps: 4,
            checkpointing: true,
            workers: 3,
            kiln_kernels: false,
        };
        let mut seen = None;
        let _ = measure(&TrainOptions::default(), &candidate, 2, |options, _| {
            seen = Some(options);
            Ok(())
        });
        let o = seen.expect("the trial ran");
        assert_eq!(
            (o.precision, o.batch_size, o.grad_accum_steps),
            (Precision::Bf16, 16, 4)
        );
        assert!(o.activation_checkpointing && !o.kiln_kernels);
        assert_eq!(o.workers, Some(3));
        // The switch travels in the options; this thread's setting is untouched.
        assert!(crate::kernels::enabled());
    }

    #[test]
    fn burns_ops_are_kept_where_they_win_and_written_to_the_config() {
        let r = auto_tune(64, 2, false, None, |c| {
            let mut m = fake(c);
            if !c.kiln_kernels {
                m.samples_per_s *= 3.0; // undo the fake's 0.5 and win by 1.5x
            }
            Ok(m)
        })
        .unwrap();
        assert!(!r.best.candidate.kiln_kernels, "{:?}", r.decisions);
        let toml = to_toml(&KilnConfig::default(), ModelKind::Cnn, &r).unwrap();
        assert!(toml.contains("[device]\nkiln_kernels = false"), "{toml}");
        let on_gpu = auto_tune(64, 2, true, None, |c| Ok(fake(c))).unwrap();
        assert!(on_gpu.best.candidate.kiln_kernels);
        assert!(
            on_gpu
                .skipped
                .iter()
                .any(|s| s.starts_with("Kiln's kernels"))
        );
    }

    #[test]
    fn an_autotune_level_is_kept_only_when_it_beats_the_default_and_is_written() {
        let ab = |v: &[(&str, f64)]| {
            AutotuneAb::choose(v.iter().map(|(l, s)| (l.to_string(), *s)).collect()).unwrap()
        };
        let win = ab(&[("balanced", 100.0), ("minimal", 90.0), ("extensive", 110.0)]);
        assert_eq!(win.kept, "extensive");
        assert!(win.reason.contains("+10.0%"), "{}", win.reason);
        // Inside the margin: the default stays (it also costs the least tuning time).
        let noise = ab(&[("balanced", 100.0), ("minimal", 102.0), ("extensive", 99.0)]);
        assert_eq!(noise.kept, "balanced");
        assert!(noise.reason.contains("minimal 102"), "{}", noise.reason);
        assert!(AutotuneAb::choose(Vec::new()).is_none());
        let mut r = auto_tune(64, 2, true, None, |c| Ok(fake(c))).unwrap();
        r.autotune = Some(win);
        let toml = to_toml(&KilnConfig::default(), ModelKind::Cnn, &r).unwrap();
        assert!(toml.contains("autotune = \"extensive\""), "{toml}");
        assert!(toml.contains("#   autotune extensive: 110"), "{toml}");
        // The written file resolves: the key and value are the schema's.
        let config = KilnConfig::from_toml_str(&toml, "kiln.toml").unwrap();
        assert_eq!(
            config.user_value("device.autotune").map(|(v, _)| v.clone()),
            Some(toml::Value::String("extensive".into()))
        );
    }
}
