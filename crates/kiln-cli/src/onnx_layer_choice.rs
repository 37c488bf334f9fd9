//! `kiln optimize --onnx`'s measured int8 and Winograd (docs/inference.md, "Kept only where
//! it measures faster"): each layer's step time without and with the pass, then the whole
//! model without it, per layer and with it everywhere, at batch 1 and 8, the forms taking
//! turns so they see the same machine; the kept form is never slower than the model without
//! the pass.

use std::collections::BTreeSet;

use anyhow::Result;
use kiln::infer::{KERNEL_FORMS, pick_form};
use kiln::observe::timing::median;
use kiln::onnx::{OnnxModel, OnnxPass, Value};
use serde::Serialize;

/// Rounds of turn-taking per measurement.
const ROUNDS: usize = 5;

/// The batches every form is timed at (the inputs' order).
const BATCHES: [usize; 2] = [1, 8];

/// One model's per-step timings at one batch: (step name, one time per round).
type StepSamples = Vec<(String, Vec<f64>)>;

/// A whole-model form: label, model (`None`: the base model itself), the layers it applies
/// the pass to, and the changes applying it made.
type Form = (String, Option<OnnxModel>, Vec<String>, Vec<String>);

/// A pass applied so far, with the layers it is limited to (`None`: all).
pub(crate) type KeptPass = (OnnxPass, Option<Vec<String>>);

/// One layer's times, ms at batch 1 and 8.
#[derive(Debug, Serialize)]
pub(crate) struct LayerTiming {
    name: String,
    /// Without the pass: the layer's step and, for int8, the steps it fuses (its ReLU).
    without_ms: Vec<f64>,
    with_ms: Vec<f64>,
    /// Whether the layer keeps the pass: int8 where it measured faster at both batches,
    /// Winograd (the kernels' default) unless the implicit GEMM measured faster at both.
    keeps: bool,
}

/// One whole-model form.
#[derive(Debug, Serialize)]
pub(crate) struct Candidate {
    label: String,
    /// Median ms at batch 1 and 8.
    ms: Vec<f64>,
    /// The layers it applies the pass to.
    layers: Vec<String>,
}

/// What measuring decided.
#[derive(Debug, Serialize)]
pub(crate) struct Decision {
    pub(crate) pass: &'static str,
    pub(crate) kept: bool,
    pub(crate) reason: String,
    layers: Vec<LayerTiming>,
    candidates: Vec<Candidate>,
    /// Index into `candidates` of the form kept (0: the model without the pass).
    chosen: usize,
}

impl Decision {
    /// A measured pass with nothing measured: Kiln's kernels are off in the plan.
    pub(crate) fn plan_off(pass: OnnxPass) -> Decision {
        Decision {
            pass: pass.name(),
            kept: false,
            reason: "Kiln's kernels are off in the plan (device.kiln_kernels = false)".into(),
            layers: Vec::new(),
            candidates: Vec::new(),
            chosen: 0,
        }
    }
}

/// The outcome: the model to keep (`None`: the model stays as it was), the pass as it is to
/// be applied at load (`None`: not at all), and the decision for the summary.
pub(crate) struct Choice {
    pub(crate) model: Option<OnnxModel>,
    pub(crate) applied: Option<KeptPass>,
    pub(crate) changes: Vec<String>,
    pub(crate) decision: Decision,
}

/// Measures `pass` (int8 or winograd) on `base` (the model with `kept` applied; `load` reads
/// the file again for each form).
pub(crate) fn choose(
    pass: OnnxPass,
    load: &dyn Fn() -> Result<OnnxModel>,
    kept: &[KeptPass],
    base: &OnnxModel,
    inputs: [&[Value]; 2],
    steps: usize,
) -> Result<Choice> {
    let steps = steps.clamp(1, 10);
    let with_pass = |only: Option<&BTreeSet<String>>| -> Result<(OnnxModel, Vec<String>)> {
        let mut m = rebuild(load, kept)?;
        let report = m.apply_to(pass, only)?;
        Ok((m, report.changes))
    };
    let name = pass.name();
    let without_label = format!("without {name}");
    let (names, all, all_changes) = match pass {
        OnnxPass::Winograd => {
            // The convolutions that run as Winograd at these batches (the kernels' rule).
            for x in inputs {
                base.run(x.to_vec())?;
            }
            let (all, changes) = with_pass(None)?;
            (base.winograd_layers(), all, changes)
        }
        _ => {
            let (all, changes) = with_pass(None)?;
            (all.int8_layers(), all, changes)
        }
    };
    if names.is_empty() {
        let reason = match pass {
            OnnxPass::Winograd => "no convolution runs as Winograd at batch 1 and 8",
            _ => {
                "no layer the int8 kernels take (constant-weight Linear, Gemm, MatMul, \
                 ungrouped Conv)"
            }
        };
        let decision = Decision {
            pass: name,
            kept: false,
            reason: reason.into(),
            layers: Vec::new(),
            candidates: Vec::new(),
            chosen: 0,
        };
        return Ok(Choice {
            model: None,
            applied: None,
            changes: vec![format!("{name} dropped: {reason}")],
            decision,
        });
    }
    // The model without the pass: `base` for int8; for Winograd every convolution on the
    // implicit GEMM. The base the other forms must beat is what runs without `kiln
    // optimize`: no int8; Winograd wherever the kernels' rule takes it.
    let on_by_default = pass == OnnxPass::Winograd;
    let without = match pass {
        OnnxPass::Winograd => Some(with_pass(Some(&BTreeSet::new()))?),
        _ => None,
    };
    let (without_model, without_changes) = match without {
        Some((m, changes)) => (Some(m), changes),
        None => (None, Vec::new()),
    };
    let timings = layer_timings(
        without_model.as_ref().unwrap_or(base),
        &all,
        &names,
        inputs,
        steps,
        on_by_default,
    )?;
    let keep: Vec<String> = timings
        .iter()
        .filter(|l| l.keeps)
        .map(|l| l.name.clone())
        .collect();
    let mut forms: Vec<Form> = vec![
        (without_label, without_model, Vec::new(), without_changes),
        (
            format!("{name} all ({})", names.len()),
            Some(all),
            names.clone(),
            all_changes,
        ),
    ];
    if on_by_default {
        forms.swap(0, 1);
    }
    if !keep.is_empty() && keep.len() < names.len() {
        let only: BTreeSet<String> = keep.iter().cloned().collect();
        let (some, changes) = with_pass(Some(&only))?;
        let label = format!("{name} per layer ({} of {})", keep.len(), names.len());
        forms.insert(1, (label, Some(some), keep, changes));
    }
    let models: Vec<&OnnxModel> = forms.iter().map(|f| f.1.as_ref().unwrap_or(base)).collect();
    let times = models_ms(&models, inputs, steps)?;
    let labelled: Vec<(&str, &[f64])> = forms
        .iter()
        .zip(&times)
        .map(|(f, ms)| (f.0.as_str(), ms.as_slice()))
        .collect();
    let (chosen, reason) = pick_form(&labelled, &BATCHES);
    let candidates: Vec<Candidate> = forms
        .iter()
        .zip(&times)
        .map(|(f, ms)| Candidate {
            label: f.0.clone(),
            ms: ms.clone(),
            layers: f.2.clone(),
        })
        .collect();
    let chosen = chosen.unwrap_or(0);
    let (_, model, layers, mut changes) = forms.swap_remove(chosen);
    let pays = !layers.is_empty();
    changes.push(format!(
        "{name} {}: {reason}",
        if pays { "kept" } else { "dropped" }
    ));
    if on_by_default {
        // Only the convolutions Winograd ran on are worth naming.
        changes.retain(|c| !c.ends_with("(Winograd measured slower)"));
        changes.splice(
            0..0,
            names
                .iter()
                .filter(|n| !layers.contains(n))
                .map(|n| format!("{n}: implicit GEMM (Winograd measured slower)")),
        );
    }
    let decision = Decision {
        pass: name,
        kept: pays,
        reason,
        layers: timings,
        candidates,
        chosen,
    };
    // The pass as it is applied at load: limited to its layers when not all of them (none:
    // Winograd off everywhere; int8 not applied at all).
    let applied = match (pays, on_by_default) {
        (false, false) => None,
        _ => Some((pass, (layers.len() < names.len()).then_some(layers))),
    };
    Ok(Choice {
        model,
        applied,
        changes,
        decision,
    })
}

/// The model file read again (`load`) with the `kept` passes applied, each to its layers.
fn rebuild(load: &dyn Fn() -> Result<OnnxModel>, kept: &[KeptPass]) -> Result<OnnxModel> {
    let mut m = load()?;
    for (p, layers) in kept {
        let set: Option<BTreeSet<String>> = layers.as_ref().map(|l| l.iter().cloned().collect());
        m.apply_to(*p, set.as_ref())?;
    }
    Ok(m)
}

/// Measures `base` (the model with `kept` applied, on Kiln's kernels: image layers
/// channels-last) against the same model on Burn's ops on NCHW tensors, at batch 1 and 8 in
/// turns. The kernels stay unless Burn's ops are faster at both; the model returned is the
/// Burn-ops form when they lost (`None`: `base` stays).
pub(crate) fn choose_kernels(
    load: &dyn Fn() -> Result<OnnxModel>,
    kept: &[KeptPass],
    base: &OnnxModel,
    inputs: [&[Value]; 2],
    steps: usize,
) -> Result<(Option<OnnxModel>, Decision)> {
    let burn = rebuild(load, kept)?.with_kiln_kernels(false);
    let times = models_ms(&[base, &burn], inputs, steps.clamp(1, 10))?;
    let labelled: Vec<(&str, &[f64])> = KERNEL_FORMS
        .iter()
        .zip(&times)
        .map(|(label, ms)| (*label, ms.as_slice()))
        .collect();
    let (chosen, reason) = pick_form(&labelled, &BATCHES);
    let stay = chosen.is_none();
    let candidates = labelled
        .iter()
        .map(|(label, ms)| Candidate {
            label: label.to_string(),
            ms: ms.to_vec(),
            layers: Vec::new(),
        })
        .collect();
    let decision = Decision {
        pass: OnnxPass::ChannelsLast.name(),
        kept: stay,
        reason,
        layers: Vec::new(),
        candidates,
        chosen: usize::from(!stay),
    };
    Ok(((!stay).then_some(burn), decision))
}

/// Each layer's step time in `all` (the pass on every layer) against, in `base`, its step
/// plus the steps after it that `all` no longer has (what int8 fused into it), at both
/// batches.
fn layer_timings(
    base: &OnnxModel,
    all: &OnnxModel,
    names: &[String],
    inputs: [&[Value]; 2],
    steps: usize,
    on_by_default: bool,
) -> Result<Vec<LayerTiming>> {
    // [model][batch] → per step (name, samples)
    let mut samples: Vec<[StepSamples; 2]> = vec![Default::default(), Default::default()];
    for _ in 0..ROUNDS {
        for (m, model) in [base, all].into_iter().enumerate() {
            for (b, x) in inputs.into_iter().enumerate() {
                let times = model.step_times(x, steps)?;
                let slot = &mut samples[m][b];
                if slot.is_empty() {
                    *slot = times.iter().map(|(n, _)| (n.clone(), Vec::new())).collect();
                }
                for ((_, s), (_, t)) in slot.iter_mut().zip(times) {
                    s.push(t);
                }
            }
        }
    }
    let medians = |v: &[(String, Vec<f64>)]| -> Vec<(String, f64)> {
        v.iter()
            .map(|(n, s)| (n.clone(), median(s.clone())))
            .collect()
    };
    let surviving: BTreeSet<&str> = samples[1][0].iter().map(|(n, _)| n.as_str()).collect();
    let mut layers = Vec::new();
    for name in names {
        let (mut without_ms, mut with_ms) = (Vec::new(), Vec::new());
        for (before, after) in samples[0].iter().zip(&samples[1]) {
            let (before, after) = (medians(before), medians(after));
            let Some(i) = before.iter().position(|(n, _)| n == name) else {
                continue;
            };
            let fused: f64 = before[i + 1..]
                .iter()
                .take_while(|(n, _)| !surviving.contains(n.as_str()))
                .map(|(_, t)| t)
                .sum();
            without_ms.push(before[i].1 + fused);
            with_ms.push(
                after
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(f64::INFINITY, |(_, t)| *t),
            );
        }
        let everywhere = |a: &[f64], b: &[f64]| a.len() == 2 && a.iter().zip(b).all(|(x, y)| x < y);
        // The layer leaves its default only where the other form is faster at both batches.
        let keeps = if on_by_default {
            !everywhere(&without_ms, &with_ms)
        } else {
            everywhere(&with_ms, &without_ms)
        };
        layers.push(LayerTiming {
            name: name.clone(),
            without_ms,
            with_ms,
            keeps,
        });
    }
    Ok(layers)
}

/// Median ms of each model at both batches (`[model][batch]`), the models taking turns for
/// [`ROUNDS`] rounds of `steps` runs each.
fn models_ms(models: &[&OnnxModel], inputs: [&[Value]; 2], steps: usize) -> Result<Vec<Vec<f64>>> {
    let mut samples = vec![vec![Vec::new(); 2]; models.len()];
    for round in 0..=ROUNDS {
        for (m, model) in models.iter().enumerate() {
            for (b, x) in inputs.into_iter().enumerate() {
                let t = time_turn(model, x, steps)?;
                // Round 0 warms every form up.
                if round > 0 {
                    samples[m][b].push(t);
                }
            }
        }
    }
    Ok(samples
        .into_iter()
        .map(|per_batch| per_batch.into_iter().map(median).collect())
        .collect())
}

/// Median ms of `steps` runs of `model` on `inputs` after one warm-up run.
fn time_turn(model: &OnnxModel, inputs: &[Value], steps: usize) -> Result<f64> {
    Ok(crate::onnx_bench::time_runs(model, inputs, 1, steps, 1)?.median_ms)
}
