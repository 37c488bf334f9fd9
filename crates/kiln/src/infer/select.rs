//! Measured keep/drop: which layers int8 quantization and Winograd make faster on this CPU,
//! and whether a pass that can lose (int8, Winograd, f16, bf16) makes the whole model faster
//! at the batches asked.
//!
//! Int8 is not a win everywhere. On an AVX2-only Zen 2 the integer multiplies issue on one
//! pipe, no more products per cycle than f32's two FMA pipes, and int8 adds a quantization
//! pass and an epilogue, while f32 3×3 convolutions run as Winograd: W2's convolutions are
//! slower in int8 there while its first linear layer at batch 1 (bound by reading its
//! weights) is 3× faster (BENCHMARKS.md run 52). So the choice is measured, on the user's
//! machine, with the user's model, the forms taking turns (see [`Probe::models_ms`]):
//!
//! The same holds for Winograd: the kernels take a 3×3 stride-1 layer by a static rule
//! (enough channels and tiles, few wasted multiply-adds), set on one machine; on another
//! CPU, or at another batch, the implicit GEMM may win. Both are measured the same way:
//!
//! 1. **Per layer**: every layer's time in the graph without the pass (for int8 plus the
//!    ReLU the int8 layer would absorb) against its time in the graph with the pass on every
//!    layer ([`Executor::node_times`]), at each batch asked for; a layer leaves what it runs
//!    without `kiln optimize` (f32; Winograd where the kernels' rule takes it) only where the
//!    other form is faster at every batch.
//! 2. **Per model**: the base — the model as it runs without `kiln optimize` — the per-layer
//!    choice and the other extreme each run whole; the one with the smallest geometric-mean
//!    time ratio to the base among those faster than it at every batch wins, the base when
//!    none is — so the result is never slower than the model was on the CPU it was measured
//!    on (up to the timing's noise).

use std::collections::BTreeSet;

use burn::tensor::{Device, Tensor};
use serde::Serialize;

use super::exec::Executor;
use super::graph::Graph;
use super::passes::{int8_candidate, quantize_int8_layers};
use crate::error::Result;
use crate::observe::timing::{measure, median};

/// A pass `kiln optimize` measures layer by layer and then as a whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerPass {
    /// Int8 quantization of linear layers and ungrouped convolutions.
    Int8,
    /// Winograd F(2×2, 3×3) for the 3×3 stride-1 convolutions the kernels' rule gives it
    /// ([`kiln_kernels::winograd`]): a static threshold, which this pass checks by timing.
    Winograd,
}

impl LayerPass {
    /// Name in reports and `--passes`.
    pub fn name(self) -> &'static str {
        match self {
            LayerPass::Int8 => "int8",
            LayerPass::Winograd => "winograd",
        }
    }

    /// Whether the kernels apply the pass without `kiln optimize` (Winograd): the model with
    /// it everywhere is then the base the other forms must beat.
    fn on_by_default(self) -> bool {
        self == LayerPass::Winograd
    }

    /// The layers the pass could change on `graph`, in graph order: int8's candidates, or
    /// the convolutions that run as Winograd at the probe's batches.
    fn layers(self, graph: &Graph, probe: &Probe) -> Result<Vec<String>> {
        match self {
            LayerPass::Int8 => Ok(graph
                .nodes
                .iter()
                .filter(|n| int8_candidate(n))
                .map(|n| n.name.clone())
                .collect()),
            LayerPass::Winograd => {
                let mut open = graph.clone();
                open.direct_convs.clear();
                let exec = probe.executor(&open)?;
                for images in probe.images {
                    exec.forward(images.clone())?;
                }
                Ok(exec.winograd_layers())
            }
        }
    }

    /// Applies the pass to the `only` layers of `layers` (every one when `None`), returning
    /// the changes made.
    fn apply(
        self,
        graph: &mut Graph,
        layers: &[String],
        only: Option<&BTreeSet<String>>,
    ) -> Result<Vec<String>> {
        match self {
            LayerPass::Int8 => quantize_int8_layers(graph, only),
            LayerPass::Winograd => {
                let mut changes = Vec::new();
                for name in layers {
                    let winograd = only.is_none_or(|o| o.contains(name));
                    if winograd {
                        graph.direct_convs.remove(name);
                    } else {
                        graph.direct_convs.insert(name.clone());
                        changes.push(format!("{name}: implicit GEMM (Winograd measured slower)"));
                    }
                }
                Ok(changes)
            }
        }
    }
}

/// What measuring found for one layer the pass could change.
#[derive(Debug, Clone, Serialize)]
pub struct LayerTiming {
    /// The layer's node name.
    pub name: String,
    /// `Conv` or `Gemm`.
    pub kind: &'static str,
    /// Its time without the pass, ms, per batch (for int8: with the ReLU int8 would fuse).
    pub without_ms: Vec<f64>,
    /// Its time with the pass, ms, per batch.
    pub with_ms: Vec<f64>,
    /// Whether the layer keeps the pass: int8 where it measured faster at every batch,
    /// Winograd (the kernels' default) unless the implicit GEMM measured faster at every one.
    pub keeps: bool,
}

/// One whole-model candidate's median forward time.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateTiming {
    /// `without <pass>`, `<pass> per layer (k of n)` or `<pass> all (n)`.
    pub label: String,
    /// Median ms per forward, per batch.
    pub ms: Vec<f64>,
    /// Layers it applies the pass to.
    pub layers: Vec<String>,
}

/// The measured decision for a pass on a graph.
#[derive(Debug, Clone, Serialize)]
pub struct PassChoice {
    /// The pass.
    pub pass: LayerPass,
    /// Per layer it could change, in graph order.
    pub layers: Vec<LayerTiming>,
    /// The whole-model candidates, the base first: the model without int8, or with Winograd
    /// wherever the kernels' rule takes it.
    pub candidates: Vec<CandidateTiming>,
    /// Index into `candidates` of the one kept.
    pub chosen: usize,
    /// Why, in a sentence.
    pub reason: String,
    /// Every layer the pass could change (what [`PassChoice::apply`] sets one way or the
    /// other).
    #[serde(skip)]
    considered: Vec<String>,
}

impl PassChoice {
    /// The layers the kept candidate applies the pass to (empty: none).
    pub fn applied(&self) -> &[String] {
        &self.candidates[self.chosen].layers
    }

    /// Whether the kept candidate applies the pass anywhere.
    pub fn kept(&self) -> bool {
        !self.applied().is_empty()
    }

    /// Applies the kept candidate to `graph` (the graph the choice was measured on).
    pub fn apply(&self, graph: &mut Graph) -> Result<Vec<String>> {
        let only: BTreeSet<String> = self.applied().iter().cloned().collect();
        let mut changes = self.pass.apply(graph, &self.considered, Some(&only))?;
        let verdict = if self.kept() { "kept" } else { "dropped" };
        changes.push(format!("{} {verdict}: {}", self.pass.name(), self.reason));
        Ok(changes)
    }
}

/// How a measurement is taken: `images[i]` is a batch of `batches[i]` samples.
pub struct Probe<'a> {
    /// Where the graphs run.
    pub device: &'a Device,
    /// Whether they run on Kiln's kernels.
    pub kiln_kernels: bool,
    /// One input batch per batch size measured.
    pub images: &'a [Tensor<4>],
    /// Timed forwards per turn (see [`Probe::models_ms`]).
    pub steps: usize,
}

impl Probe<'_> {
    fn batches(&self) -> Vec<usize> {
        self.images.iter().map(|t| t.dims()[0]).collect()
    }

    fn executor(&self, graph: &Graph) -> Result<Executor> {
        self.executor_with(graph, self.kiln_kernels)
    }

    fn executor_with(&self, graph: &Graph, kiln_kernels: bool) -> Result<Executor> {
        let mut exec = Executor::new(graph.clone(), self.device)?;
        exec.set_kiln_kernels(kiln_kernels);
        Ok(exec)
    }

    /// Median ms per forward of each graph at each batch (`[graph][batch]`). The graphs
    /// take turns, one short timing each per round, and each one's figure is the median of
    /// its rounds: on a shared machine whose speed drifts by tens of percent within seconds,
    /// graphs timed one after the other would be compared across different conditions.
    pub fn models_ms(&self, graphs: &[&Graph]) -> Result<Vec<Vec<f64>>> {
        let forms: Vec<(&Graph, bool)> = graphs.iter().map(|&g| (g, self.kiln_kernels)).collect();
        self.forms_ms(&forms)
    }

    /// [`Probe::models_ms`] of graphs each run with Kiln's kernels on or off.
    fn forms_ms(&self, forms: &[(&Graph, bool)]) -> Result<Vec<Vec<f64>>> {
        let execs = forms
            .iter()
            .map(|&(g, kernels)| self.executor_with(g, kernels))
            .collect::<Result<Vec<_>>>()?;
        let mut samples = vec![vec![Vec::new(); self.images.len()]; forms.len()];
        for round in 0..=ROUNDS {
            for (exec, per_batch) in execs.iter().zip(&mut samples) {
                for (images, out) in self.images.iter().zip(per_batch.iter_mut()) {
                    let mut failure = None;
                    let timing = measure(
                        || {
                            if let Err(e) = exec.forward(images.clone()).map(|y| y.into_data()) {
                                failure = Some(e);
                            }
                        },
                        1,
                        self.steps.max(1),
                        1,
                    );
                    if let Some(e) = failure {
                        return Err(e);
                    }
                    // Round 0 warms every graph up.
                    if round > 0 {
                        out.push(timing.median_ms);
                    }
                }
            }
        }
        Ok(samples
            .into_iter()
            .map(|per_batch| per_batch.into_iter().map(median).collect())
            .collect())
    }

    /// Per node of each graph, median ms at each batch (`[graph][node][batch]`), the graphs
    /// taking turns as in [`Probe::models_ms`].
    fn nodes_ms(&self, graphs: &[&Graph]) -> Result<Vec<Vec<Vec<f64>>>> {
        let execs = graphs
            .iter()
            .map(|g| self.executor(g))
            .collect::<Result<Vec<_>>>()?;
        // [graph][batch][node] → samples
        let mut samples: Vec<Vec<Vec<Vec<f64>>>> = graphs
            .iter()
            .map(|g| vec![vec![Vec::new(); g.nodes.len()]; self.images.len()])
            .collect();
        for _ in 0..ROUNDS {
            for (exec, per_batch) in execs.iter().zip(&mut samples) {
                for (images, nodes) in self.images.iter().zip(per_batch.iter_mut()) {
                    let times = exec.node_times(images.clone(), self.steps.max(1))?;
                    for (s, t) in nodes.iter_mut().zip(times) {
                        s.push(t);
                    }
                }
            }
        }
        Ok(samples
            .into_iter()
            .map(|per_batch| {
                let nodes = per_batch.first().map_or(0, Vec::len);
                (0..nodes)
                    .map(|n| per_batch.iter().map(|b| median(b[n].clone())).collect())
                    .collect()
            })
            .collect())
    }
}

/// Rounds of turn-taking per measurement.
const ROUNDS: usize = 5;

/// Whether `ms` is faster than `base` at every batch.
fn faster_everywhere(ms: &[f64], base: &[f64]) -> bool {
    ms.iter().zip(base).all(|(a, b)| a < b)
}

/// Geometric mean of `ms[i] / base[i]`: a form's time relative to the base over the
/// batches measured.
pub fn mean_ratio(ms: &[f64], base: &[f64]) -> f64 {
    let logs: f64 = ms.iter().zip(base).map(|(a, b)| (a / b).ln()).sum();
    (logs / ms.len().max(1) as f64).exp()
}

/// The rule both `kiln optimize` roads keep a form by: `times[f][batch]` for each form, the
/// base (the model without the pass) first; the index of the form faster than the base at
/// every batch with the smallest [`mean_ratio`], `None` when no form is faster everywhere.
pub fn fastest_form(times: &[Vec<f64>]) -> Option<usize> {
    let base = times.first()?;
    (1..times.len())
        .filter(|&i| faster_everywhere(&times[i], base))
        .min_by(|&a, &b| mean_ratio(&times[a], base).total_cmp(&mean_ratio(&times[b], base)))
}

/// The form kept among `forms` (label, median ms per batch of `batches`; the base first) by
/// [`fastest_form`] — `None`: the base — and why, in a sentence naming every form's times.
/// Both `kiln optimize` roads word their decisions through it.
pub fn pick_form(forms: &[(&str, &[f64])], batches: &[usize]) -> (Option<usize>, String) {
    let show = |ms: &[f64]| {
        batches
            .iter()
            .zip(ms)
            .map(|(b, m)| format!("b{b} {m:.3} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let times: Vec<Vec<f64>> = forms.iter().map(|(_, ms)| ms.to_vec()).collect();
    let Some(&(base, base_ms)) = forms.first() else {
        return (None, "no form was measured".into());
    };
    let chosen = fastest_form(&times);
    let reason = match chosen {
        Some(i) => format!(
            "{} measured {:.2}× the time of {base} ({} vs {})",
            forms[i].0,
            mean_ratio(forms[i].1, base_ms),
            show(forms[i].1),
            show(base_ms)
        ),
        None => format!(
            "no other form measured faster than {base} at every batch ({}; {})",
            show(base_ms),
            forms[1..]
                .iter()
                .map(|(label, ms)| format!("{label} {}", show(ms)))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    (chosen, reason)
}

/// Measures where int8 pays on `graph` (already stripped and folded) and returns the choice;
/// `graph` itself is not changed (see [`PassChoice::apply`]).
pub fn choose_int8(graph: &Graph, probe: &Probe) -> Result<PassChoice> {
    choose_layers(LayerPass::Int8, graph, probe)
}

/// Measures, layer by layer and as a whole model, whether the convolutions the kernels run
/// as Winograd are faster that way than on the implicit GEMM on this machine; `graph` is not
/// changed (see [`PassChoice::apply`], which keeps the slower ones in
/// [`Graph::direct_convs`]).
pub fn choose_winograd(graph: &Graph, probe: &Probe) -> Result<PassChoice> {
    choose_layers(LayerPass::Winograd, graph, probe)
}

/// The measured choice for `pass` on `graph` (the rule in this module's header).
fn choose_layers(pass: LayerPass, graph: &Graph, probe: &Probe) -> Result<PassChoice> {
    let batches = probe.batches();
    let names = pass.layers(graph, probe)?;
    let name = pass.name();
    if names.is_empty() {
        return Ok(PassChoice {
            pass,
            layers: Vec::new(),
            candidates: vec![CandidateTiming {
                label: format!("without {name}"),
                ms: Vec::new(),
                layers: Vec::new(),
            }],
            chosen: 0,
            reason: match pass {
                LayerPass::Int8 => "no linear layer or ungrouped convolution to quantize",
                LayerPass::Winograd => "no convolution runs as Winograd at these batches",
            }
            .into(),
            considered: Vec::new(),
        });
    }
    let form = |only: &[String]| -> Result<Graph> {
        let mut g = graph.clone();
        let only: BTreeSet<String> = only.iter().cloned().collect();
        pass.apply(&mut g, &names, Some(&only))?;
        Ok(g)
    };
    let (none, all) = (form(&[])?, form(&names)?);
    let layers = layer_timings(&none, &all, &names, probe, pass.on_by_default())?;
    let keep: Vec<String> = layers
        .iter()
        .filter(|l| l.keeps)
        .map(|l| l.name.clone())
        .collect();
    // The base first: what the model runs without `kiln optimize` (f32 for int8; Winograd
    // wherever the kernels' rule takes it).
    let none_form = (format!("without {name}"), none, Vec::new());
    let all_form = (format!("{name} all ({})", names.len()), all, names.clone());
    let mut forms = if pass.on_by_default() {
        vec![all_form, none_form]
    } else {
        vec![none_form, all_form]
    };
    if !keep.is_empty() && keep.len() < names.len() {
        let label = format!("{name} per layer ({} of {})", keep.len(), names.len());
        forms.insert(1, (label, form(&keep)?, keep));
    }
    let times = probe.models_ms(&forms.iter().map(|f| &f.1).collect::<Vec<_>>())?;
    let candidates: Vec<CandidateTiming> = forms
        .into_iter()
        .zip(times)
        .map(|((label, _, layers), ms)| CandidateTiming { label, ms, layers })
        .collect();
    let forms: Vec<(&str, &[f64])> = candidates
        .iter()
        .map(|c| (c.label.as_str(), c.ms.as_slice()))
        .collect();
    let (chosen, reason) = pick_form(&forms, &batches);
    let chosen = chosen.unwrap_or(0);
    Ok(PassChoice {
        pass,
        layers,
        candidates,
        chosen,
        reason,
        considered: names,
    })
}

/// Each of the `names` layers' time in the graph without the pass (plus, for int8, the ReLU
/// the pass fuses into it: a node of `without` that `with` no longer has, reading the
/// layer's output) and in the graph with the pass on every one of them; whether the layer
/// keeps the pass (`on_by_default`: unless it is slower at every batch; else only where it
/// is faster at every batch).
fn layer_timings(
    without: &Graph,
    with: &Graph,
    names: &[String],
    probe: &Probe,
    on_by_default: bool,
) -> Result<Vec<LayerTiming>> {
    let mut nodes = probe.nodes_ms(&[without, with])?;
    let with_nodes = nodes.pop().unwrap_or_default();
    let without_nodes = nodes.pop().unwrap_or_default();
    let kept: BTreeSet<&str> = with.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut layers = Vec::new();
    for (i, node) in without.nodes.iter().enumerate() {
        if !names.contains(&node.name) {
            continue;
        }
        let Some(j) = with.nodes.iter().position(|n| n.name == node.name) else {
            continue;
        };
        let mut without_ms = without_nodes[i].clone();
        for (k, reader) in without.nodes.iter().enumerate() {
            if reader.inputs.contains(&node.output) && !kept.contains(reader.name.as_str()) {
                for (t, extra) in without_ms.iter_mut().zip(&without_nodes[k]) {
                    *t += extra;
                }
            }
        }
        let with_ms = with_nodes[j].clone();
        layers.push(LayerTiming {
            name: node.name.clone(),
            kind: node.op.kind(),
            // The layer leaves its default only where the other form is faster at every batch.
            keeps: if on_by_default {
                !faster_everywhere(&without_ms, &with_ms)
            } else {
                faster_everywhere(&with_ms, &without_ms)
            },
            without_ms,
            with_ms,
        });
    }
    Ok(layers)
}

/// Whole-model keep/drop for a pass that rewrites the graph as a whole (f16, bf16): the
/// rewritten graph's times and whether it is faster than `before` at every batch.
pub fn pass_pays(
    before: &Graph,
    after: &Graph,
    probe: &Probe,
) -> Result<(Vec<f64>, Vec<f64>, bool)> {
    let mut times = probe.models_ms(&[before, after])?;
    let a = times.pop().unwrap_or_default();
    let b = times.pop().unwrap_or_default();
    let pays = faster_everywhere(&a, &b);
    Ok((b, a, pays))
}

/// The two forms the channels-last pass compares, the base first.
pub const KERNEL_FORMS: [&str; 2] = ["Kiln's kernels (channels-last)", "Burn's NCHW ops"];

/// Whole-model keep/drop of Kiln's CPU kernels — image layers channels-last on the implicit
/// GEMM, Winograd and depthwise kernels, linear layers and attention on Kiln's — against
/// Burn's own ops on NCHW tensors ([`KERNEL_FORMS`]), for `graph` at the probe's batches:
/// whether the kernels stay, and why ([`pick_form`]). The kernels are the default; Burn's
/// ops replace them only where they are faster at every batch.
pub fn kernels_pay(graph: &Graph, probe: &Probe) -> Result<(bool, String)> {
    let times = probe.forms_ms(&[(graph, true), (graph, false)])?;
    let forms: Vec<(&str, &[f64])> = KERNEL_FORMS
        .iter()
        .zip(&times)
        .map(|(label, ms)| (*label, ms.as_slice()))
        .collect();
    let (chosen, reason) = pick_form(&forms, &probe.batches());
    Ok((chosen.is_none(), reason))
}
