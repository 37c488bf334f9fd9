//! Measured keep/drop: which layers int8 quantization makes faster on this CPU, and whether
//! a pass that can lose (int8, f16, bf16) makes the whole model faster at the batches asked.
//!
//! Int8 is not a win everywhere. On an AVX2-only Zen 2 the integer multiplies issue on one
//! pipe, no more products per cycle than f32's two FMA pipes, and int8 adds a quantization
//! pass and an epilogue, while f32 3×3 convolutions run as Winograd: W2's convolutions are
//! slower in int8 there while its first linear layer at batch 1 (bound by reading its
//! weights) is 3× faster (BENCHMARKS.md run 52). So the choice is measured, on the user's
//! machine, with the user's model, the forms taking turns (see [`Probe::models_ms`]):
//!
//! 1. **Per layer**: every candidate layer's time in the all-f32 graph (plus the ReLU the int8
//!    layer would absorb) against its time in the all-int8 graph ([`Executor::node_times`]),
//!    at each batch asked for; a layer is quantized only where int8 is faster at every one.
//! 2. **Per model**: the f32 graph, the per-layer choice and the all-int8 graph each run
//!    whole; the one with the smallest geometric-mean time ratio to f32 among those faster
//!    than f32 at every batch wins, f32 when none is — so the result is never slower than
//!    the f32 model on the CPU it was measured on (up to the timing's noise).

use std::collections::BTreeSet;

use burn::tensor::{Device, Tensor};
use serde::Serialize;

use super::exec::Executor;
use super::graph::Graph;
use super::passes::{int8_candidate, quantize_int8_layers};
use crate::error::Result;
use crate::observe::timing::{measure, median};

/// What measuring found for one layer int8 could quantize.
#[derive(Debug, Clone, Serialize)]
pub struct LayerTiming {
    /// The layer's node name.
    pub name: String,
    /// `Conv2d` or `Linear`.
    pub kind: &'static str,
    /// Its f32 time (with the ReLU int8 would fuse), ms, per batch.
    pub f32_ms: Vec<f64>,
    /// Its int8 time, ms, per batch.
    pub int8_ms: Vec<f64>,
    /// Whether int8 measured faster at every batch.
    pub int8_faster: bool,
}

/// One whole-model candidate's median forward time.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateTiming {
    /// `f32`, `int8 per layer (k of n)` or `int8 all`.
    pub label: String,
    /// Median ms per forward, per batch.
    pub ms: Vec<f64>,
    /// Layers it quantizes.
    pub quantized: Vec<String>,
}

/// The measured int8 decision for a graph.
#[derive(Debug, Clone, Serialize)]
pub struct Int8Choice {
    /// Per candidate layer, in graph order.
    pub layers: Vec<LayerTiming>,
    /// The whole-model candidates (f32 first).
    pub candidates: Vec<CandidateTiming>,
    /// Index into `candidates` of the one kept.
    pub chosen: usize,
    /// Why, in a sentence.
    pub reason: String,
}

impl Int8Choice {
    /// The layers the kept candidate quantizes (empty: the model stays f32).
    pub fn quantized(&self) -> &[String] {
        &self.candidates[self.chosen].quantized
    }

    /// Applies the kept candidate to `graph` (the graph the choice was measured on).
    pub fn apply(&self, graph: &mut Graph) -> Result<Vec<String>> {
        if self.quantized().is_empty() {
            return Ok(vec![format!("int8 dropped: {}", self.reason)]);
        }
        let only: BTreeSet<String> = self.quantized().iter().cloned().collect();
        let mut changes = quantize_int8_layers(graph, Some(&only))?;
        changes.push(format!("int8 kept: {}", self.reason));
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
        let mut exec = Executor::new(graph.clone(), self.device)?;
        exec.set_kiln_kernels(self.kiln_kernels);
        Ok(exec)
    }

    /// Median ms per forward of each graph at each batch (`[graph][batch]`). The graphs
    /// take turns, one short timing each per round, and each one's figure is the median of
    /// its rounds: on a shared machine whose speed drifts by tens of percent within seconds,
    /// graphs timed one after the other would be compared across different conditions.
    pub fn models_ms(&self, graphs: &[&Graph]) -> Result<Vec<Vec<f64>>> {
        let execs = graphs
            .iter()
            .map(|g| self.executor(g))
            .collect::<Result<Vec<_>>>()?;
        let mut samples = vec![vec![Vec::new(); self.images.len()]; graphs.len()];
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

/// Measures where int8 pays on `graph` (already stripped and folded) and returns the choice;
/// `graph` itself is not changed (see [`Int8Choice::apply`]).
pub fn choose_int8(graph: &Graph, probe: &Probe) -> Result<Int8Choice> {
    let batches = probe.batches();
    let names: Vec<String> = graph
        .nodes
        .iter()
        .filter(|n| int8_candidate(n))
        .map(|n| n.name.clone())
        .collect();
    if names.is_empty() {
        return Ok(Int8Choice {
            layers: Vec::new(),
            candidates: vec![CandidateTiming {
                label: "f32".into(),
                ms: Vec::new(),
                quantized: Vec::new(),
            }],
            chosen: 0,
            reason: "no linear layer or ungrouped convolution to quantize".into(),
        });
    }
    let mut all = graph.clone();
    quantize_int8_layers(&mut all, None)?;
    let layers = layer_timings(graph, &all, probe)?;
    let faster: Vec<String> = layers
        .iter()
        .filter(|l| l.int8_faster)
        .map(|l| l.name.clone())
        .collect();
    let mut forms = vec![("f32".to_string(), graph.clone(), Vec::new())];
    if !faster.is_empty() && faster.len() < names.len() {
        let mut some = graph.clone();
        let only: BTreeSet<String> = faster.iter().cloned().collect();
        quantize_int8_layers(&mut some, Some(&only))?;
        let label = format!("int8 per layer ({} of {})", faster.len(), names.len());
        forms.push((label, some, faster));
    }
    forms.push((format!("int8 all ({})", names.len()), all, names));
    let times = probe.models_ms(&forms.iter().map(|f| &f.1).collect::<Vec<_>>())?;
    let candidates: Vec<CandidateTiming> = forms
        .into_iter()
        .zip(times)
        .map(|((label, _, quantized), ms)| CandidateTiming {
            label,
            ms,
            quantized,
        })
        .collect();
    let f32_ms = candidates[0].ms.clone();
    let times: Vec<Vec<f64>> = candidates.iter().map(|c| c.ms.clone()).collect();
    let best = fastest_form(&times).map(|i| (i, &candidates[i]));
    let show = |ms: &[f64]| {
        batches
            .iter()
            .zip(ms)
            .map(|(b, m)| format!("b{b} {m:.3} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (chosen, reason) = match best {
        Some((i, c)) => (
            i,
            format!(
                "{} measured {:.2}× the f32 model's time ({} vs f32 {})",
                c.label,
                mean_ratio(&c.ms, &f32_ms),
                show(&c.ms),
                show(&f32_ms)
            ),
        ),
        None => (
            0,
            format!(
                "no int8 form measured faster than f32 at every batch (f32 {}; {})",
                show(&f32_ms),
                candidates[1..]
                    .iter()
                    .map(|c| format!("{} {}", c.label, show(&c.ms)))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ),
    };
    Ok(Int8Choice {
        layers,
        candidates,
        chosen,
        reason,
    })
}

/// Each candidate layer's time in the f32 graph (with the ReLU the int8 pass would fuse into
/// it: a node of the f32 graph the int8 graph no longer has, reading the layer's output) and
/// in the all-int8 graph.
fn layer_timings(f32_graph: &Graph, int8_graph: &Graph, probe: &Probe) -> Result<Vec<LayerTiming>> {
    let mut nodes = probe.nodes_ms(&[f32_graph, int8_graph])?;
    let int8_nodes = nodes.pop().unwrap_or_default();
    let f32_nodes = nodes.pop().unwrap_or_default();
    let kept: BTreeSet<&str> = int8_graph.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut layers = Vec::new();
    for (i, node) in f32_graph.nodes.iter().enumerate() {
        if !int8_candidate(node) {
            continue;
        }
        let Some(j) = int8_graph.nodes.iter().position(|n| n.name == node.name) else {
            continue;
        };
        let mut f32_ms = f32_nodes[i].clone();
        for (k, reader) in f32_graph.nodes.iter().enumerate() {
            if reader.inputs.contains(&node.output) && !kept.contains(reader.name.as_str()) {
                for (t, extra) in f32_ms.iter_mut().zip(&f32_nodes[k]) {
                    *t += extra;
                }
            }
        }
        let int8_ms = int8_nodes[j].clone();
        layers.push(LayerTiming {
            name: node.name.clone(),
            kind: node.op.kind(),
            int8_faster: faster_everywhere(&int8_ms, &f32_ms),
            f32_ms,
            int8_ms,
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
