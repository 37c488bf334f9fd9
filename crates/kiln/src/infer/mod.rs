//! Inference: a trained model lowered to a graph (any model that implements [`Lower`]: the
//! zoo's do), rewritten by passes (strip train-only layers, fold BatchNorm, int8 dynamic
//! quantization), run on a device, exported to ONNX.
//!
//! ```text
//! impl Lower ──lower──▶ Graph ──passes──▶ Graph ──▶ Executor (Burn f32 ops + int8 kernel)
//!                                            └────▶ ONNX file
//! ```
//!
//! Inference imports neither the trainer, the zoo nor Kiln's `nn` layers: models describe
//! themselves through [`Lower`], and the reference forward takes any [`Classifier`].

mod exec;
mod graph;

mod lower;
pub mod onnx_export;
mod passes;
mod select;
mod store;

use burn::tensor::{Device, Tensor};
use serde::Serialize;

pub use exec::Executor;
pub use graph::{ConvGeometry, Graph, Node, Op, QuantWeight, ValueId, Weight};
pub use lower::{GraphBuilder, Lower, lower, weight_of};
pub use passes::{
    Pass, PassReport, fold_batch_norm, fold_into_outer_channels, int8_candidate, quantize_int8,
    quantize_int8_layers, run_passes, strip_train_only, to_half_precision,
};
pub use select::{
    CandidateTiming, KERNEL_FORMS, LayerPass, LayerTiming, PassChoice, Probe, choose_int8,
    choose_winograd, fastest_form, kernels_pay, mean_ratio, pass_pays, pick_form,
};
pub use store::{graph_to_bytes, load_graph, save_graph};

use crate::classifier::Classifier;
use crate::data::{Dataset, collate};
use crate::error::{KilnError, Result};

/// A model ready for inference: its graph after the passes, on a device.
#[derive(Debug)]
pub struct InferenceSession {
    executor: Executor,
    reports: Vec<PassReport>,
}

impl InferenceSession {
    /// Lowers `model` (samples `[C, H, W]`), applies `passes` in order and prepares the result
    /// on `device`.
    pub fn new(
        model: &dyn Lower,
        name: &str,
        input_shape: [usize; 3],
        passes: &[Pass],
        device: &Device,
    ) -> Result<Self> {
        let mut graph = lower(model, name, input_shape)?;
        let reports = run_passes(&mut graph, passes)?;
        Ok(InferenceSession {
            executor: Executor::new(graph, device)?,
            reports,
        })
    }

    /// Runs an already-optimized graph (e.g. from [`load_graph`]) on `device`.
    pub fn from_graph(graph: Graph, device: &Device) -> Result<Self> {
        Ok(InferenceSession {
            executor: Executor::new(graph, device)?,
            reports: Vec::new(),
        })
    }

    /// The session with Kiln's kernels switched on or off for its forwards (on by default;
    /// the plan's `device.kiln_kernels`).
    pub fn with_kiln_kernels(mut self, enabled: bool) -> Self {
        self.executor.set_kiln_kernels(enabled);
        self
    }

    /// Whether the session's forwards use Kiln's kernels.
    pub fn kiln_kernels(&self) -> bool {
        self.executor.kiln_kernels()
    }

    /// What each pass changed.
    pub fn reports(&self) -> &[PassReport] {
        &self.reports
    }

    /// The graph that runs.
    pub fn graph(&self) -> &Graph {
        self.executor.graph()
    }

    /// The device the session runs on.
    pub fn device(&self) -> &Device {
        self.executor.device()
    }

    /// Logits `[B, classes]` for images `[B, C, H, W]` on the session's device.
    pub fn forward(&self, images: Tensor<4>) -> Result<Tensor<2>> {
        self.executor.forward(images)
    }

    /// Top-1 accuracy and logits over `data`, in batches of `batch`.
    pub fn evaluate(&self, data: &dyn Dataset, batch: usize) -> Result<Predictions> {
        self.evaluate_with(data, batch, None)
    }

    /// [`InferenceSession::evaluate`] with OOM-adaptive batching: when memory in use
    /// ([`crate::observe::memory::in_use_reading`]) reaches `watermark` bytes after a batch,
    /// the following batches are half as large, again after each batch still above (the
    /// results do not depend on the batch size); each change is reported in
    /// [`Predictions::batch_changes`] and logged.
    pub fn evaluate_with(
        &self,
        data: &dyn Dataset,
        batch: usize,
        watermark: Option<u64>,
    ) -> Result<Predictions> {
        let order: Vec<usize> = (0..data.len()).collect();
        let mut logits = Vec::new();
        let mut correct = 0usize;
        let mut mark = watermark.map(crate::observe::Watermark::new);
        let mut batch_changes = Vec::new();
        let mut size = batch.max(1);
        let mut at = 0;
        while at < order.len() {
            let chunk = &order[at..(at + size).min(order.len())];
            at += chunk.len();
            let b = collate(data, chunk, self.executor.device())?;
            let out = self.forward(b.images)?;
            let values = out
                .into_data()
                .try_into_vec_as::<f32>()
                .map_err(|e| KilnError::Inference(format!("reading logits: {e:?}")))?;
            let labels = b
                .labels
                .into_data()
                .try_into_vec_as::<i64>()
                .map_err(|e| KilnError::Inference(format!("reading labels: {e:?}")))?;
            let classes = values.len() / chunk.len();
            for (row, label) in values.chunks_exact(classes).zip(&labels) {
                let arg = row
                    .iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (i, v)| {
                        if *v > best.1 { (i, *v) } else { best }
                    })
                    .0;
                correct += usize::from(arg as i64 == *label);
            }
            logits.extend(values);
            if let Some(m) = mark.as_mut()
                && let Some(in_use) = crate::observe::memory::in_use_reading()
                && m.check(in_use)
                && size >= 2
            {
                size /= 2;
                // As in training: a reading still above after the next batch halves again.
                m.rearm();
                tracing::warn!(
                    "inference: memory in use {} reached the watermark {}; batch halved to {size}",
                    crate::observe::memory::human_bytes(in_use),
                    crate::observe::memory::human_bytes(m.threshold())
                );
                batch_changes.push(BatchChange {
                    after_samples: at,
                    batch: size,
                });
            }
        }
        Ok(Predictions {
            accuracy: correct as f64 / data.len().max(1) as f64,
            logits,
            batch_changes,
        })
    }
}

/// Logits and accuracy of a session over a dataset.
#[derive(Debug, Clone)]
pub struct Predictions {
    /// Top-1 accuracy in [0, 1].
    pub accuracy: f64,
    /// All logits, row-major `[samples, classes]`.
    pub logits: Vec<f32>,
    /// OOM-adaptive batch changes, in order.
    pub batch_changes: Vec<BatchChange>,
}

/// One OOM-adaptive change of the inference batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchChange {
    /// Samples done when the change was made.
    pub after_samples: usize,
    /// The new batch size.
    pub batch: usize,
}

/// How far one set of logits is from a reference.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct LogitDelta {
    /// Largest absolute difference.
    pub max_abs: f32,
    /// Mean absolute difference.
    pub mean_abs: f32,
    /// Largest absolute difference relative to the reference's largest magnitude.
    pub max_rel: f32,
}

impl LogitDelta {
    /// Compares `ours` with `reference` (same length).
    pub fn between(ours: &[f32], reference: &[f32]) -> Self {
        let n = ours.len().min(reference.len()).max(1);
        let (mut max_abs, mut sum) = (0f32, 0f64);
        for (a, b) in ours.iter().zip(reference) {
            let d = (a - b).abs();
            max_abs = max_abs.max(d);
            sum += d as f64;
        }
        let scale = reference
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(1e-12);
        LogitDelta {
            max_abs,
            mean_abs: (sum / n as f64) as f32,
            max_rel: max_abs / scale,
        }
    }
}

/// The model's own forward pass, as the reference the passes are checked against.
pub fn reference_logits(
    model: &impl Classifier,
    data: &dyn Dataset,
    batch: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    let order: Vec<usize> = (0..data.len()).collect();
    let mut out = Vec::new();
    for chunk in order.chunks(batch.max(1)) {
        let b = collate(data, chunk, device)?;
        let logits = model.forward(b.images);
        out.extend(
            logits
                .into_data()
                .try_into_vec_as::<f32>()
                .map_err(|e| KilnError::Inference(format!("reading logits: {e:?}")))?,
        );
    }
    Ok(out)
}
