//! `kiln optimize --onnx`'s measured int8 (docs/inference.md, "Kept only where it measures
//! faster"): each layer's step time without and with int8, then the whole model in its f32,
//! per-layer and all-int8 forms, at batch 1 and 8, the forms taking turns so they see the
//! same machine; the kept form is never slower than the model without int8.

use std::collections::BTreeSet;

use anyhow::Result;
use kiln::infer::{fastest_form, mean_ratio};
use kiln::observe::timing::median;
use kiln::onnx::{OnnxModel, OnnxPass, Value};
use serde::Serialize;

/// Rounds of turn-taking per measurement.
const ROUNDS: usize = 5;

/// One model's per-step timings at one batch: (step name, one time per round).
type StepSamples = Vec<(String, Vec<f64>)>;

/// One layer's times, ms at batch 1 and 8.
#[derive(Debug, Serialize)]
pub(crate) struct LayerTiming {
    name: String,
    /// Without int8: the layer's step and the steps int8 fuses into it (its ReLU).
    f32_ms: Vec<f64>,
    int8_ms: Vec<f64>,
    int8_faster: bool,
}

/// One whole-model form.
#[derive(Debug, Serialize)]
pub(crate) struct Candidate {
    label: String,
    /// Median ms at batch 1 and 8.
    ms: Vec<f64>,
    /// The layers it runs in int8.
    int8_layers: Vec<String>,
}

/// What measuring decided.
#[derive(Debug, Serialize)]
pub(crate) struct Decision {
    pub(crate) pass: &'static str,
    pub(crate) kept: bool,
    pub(crate) reason: String,
    layers: Vec<LayerTiming>,
    candidates: Vec<Candidate>,
    /// Index into `candidates` of the form kept (0: the model without int8).
    chosen: usize,
}

/// The outcome: the model to keep (`None`: stay without int8), the layers to name in the
/// serving config when only some are int8, and the decision for the summary.
pub(crate) struct Choice {
    pub(crate) model: Option<OnnxModel>,
    pub(crate) only: Option<Vec<String>>,
    pub(crate) changes: Vec<String>,
    pub(crate) decision: Decision,
}

/// Measures int8 on `base` (the model with `kept` applied; `load` reads the file again for
/// each int8 form). `Choice::model` is the int8 form kept, `None` when `base` stays.
pub(crate) fn choose(
    load: &dyn Fn() -> Result<OnnxModel>,
    kept: &[OnnxPass],
    base: &OnnxModel,
    inputs: [&[Value]; 2],
    steps: usize,
) -> Result<Choice> {
    let steps = steps.clamp(1, 10);
    let with_passes = |only: Option<&BTreeSet<String>>| -> Result<(OnnxModel, Vec<String>)> {
        let mut m = load()?;
        for &p in kept {
            m.apply(p)?;
        }
        let report = m.apply_to(OnnxPass::Int8, only)?;
        Ok((m, report.changes))
    };
    let (all, all_changes) = with_passes(None)?;
    let names = all.int8_layers();
    if names.is_empty() {
        let decision = Decision {
            pass: "int8",
            kept: false,
            reason: "no layer the int8 kernels take (constant-weight Linear, Gemm, MatMul, \
                     ungrouped Conv)"
                .into(),
            layers: Vec::new(),
            candidates: Vec::new(),
            chosen: 0,
        };
        return Ok(Choice {
            model: None,
            only: None,
            changes: vec![format!("int8 dropped: {}", decision.reason)],
            decision,
        });
    }
    let layers = layer_timings(base, &all, &names, inputs, steps)?;
    let faster: Vec<String> = layers
        .iter()
        .filter(|l| l.int8_faster)
        .map(|l| l.name.clone())
        .collect();
    // The int8 forms; `base` is measured beside them as form 0.
    let mut forms: Vec<(String, OnnxModel, Vec<String>, Vec<String>)> = Vec::new();
    if !faster.is_empty() && faster.len() < names.len() {
        let only: BTreeSet<String> = faster.iter().cloned().collect();
        let (some, changes) = with_passes(Some(&only))?;
        let label = format!("int8 per layer ({} of {})", faster.len(), names.len());
        forms.push((label, some, faster, changes));
    }
    forms.push((
        format!("int8 all ({})", names.len()),
        all,
        names.clone(),
        all_changes,
    ));
    let models: Vec<&OnnxModel> = std::iter::once(base)
        .chain(forms.iter().map(|f| &f.1))
        .collect();
    let times = models_ms(&models, inputs, steps)?;
    let base_ms = &times[0];
    let best = fastest_form(&times);
    let label = |i: usize| forms[i - 1].0.as_str();
    let show = |ms: &[f64]| format!("b1 {:.3} ms, b8 {:.3} ms", ms[0], ms[1]);
    let reason = match best {
        Some(i) => format!(
            "{} measured {:.2}× the time without int8 ({} vs {})",
            label(i),
            mean_ratio(&times[i], base_ms),
            show(&times[i]),
            show(base_ms)
        ),
        None => format!(
            "no int8 form measured faster at batch 1 and 8 (without int8 {}; {})",
            show(base_ms),
            (1..times.len())
                .map(|i| format!("{} {}", label(i), show(&times[i])))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    let candidates: Vec<Candidate> = std::iter::once(("without int8", &Vec::new()))
        .chain(forms.iter().map(|f| (f.0.as_str(), &f.2)))
        .zip(&times)
        .map(|((label, layers), ms)| Candidate {
            label: label.to_string(),
            ms: ms.clone(),
            int8_layers: layers.clone(),
        })
        .collect();
    let decision = Decision {
        pass: "int8",
        kept: best.is_some(),
        reason: reason.clone(),
        layers,
        candidates,
        chosen: best.unwrap_or(0),
    };
    Ok(match best {
        Some(i) => {
            let (_, model, layers, mut changes) = forms.swap_remove(i - 1);
            changes.push(format!("int8 kept: {reason}"));
            Choice {
                model: Some(model),
                only: (layers.len() < names.len()).then_some(layers),
                changes,
                decision,
            }
        }
        None => Choice {
            model: None,
            only: None,
            changes: vec![format!("int8 dropped: {reason}")],
            decision,
        },
    })
}

/// Each int8 layer's step time in `all` against, in `base`, its step plus the steps after
/// it that `all` no longer has (what int8 fused into it), at both batches.
fn layer_timings(
    base: &OnnxModel,
    all: &OnnxModel,
    names: &[String],
    inputs: [&[Value]; 2],
    steps: usize,
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
        let (mut f32_ms, mut int8_ms) = (Vec::new(), Vec::new());
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
            f32_ms.push(before[i].1 + fused);
            int8_ms.push(
                after
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(f64::INFINITY, |(_, t)| *t),
            );
        }
        let int8_faster = f32_ms.len() == 2 && int8_ms.iter().zip(&f32_ms).all(|(a, b)| a < b);
        layers.push(LayerTiming {
            name: name.clone(),
            f32_ms,
            int8_ms,
            int8_faster,
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
