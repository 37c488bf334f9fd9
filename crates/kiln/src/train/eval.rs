//! Evaluation of a model on a held-out split, through its [`TrainStep::valid_step`].

use std::collections::BTreeMap;

use burn::tensor::Device;

use super::contract::TrainStep;
use super::metrics::{Metric, default_metrics};
use crate::data::{BatchContext, BatchSource, Dataset, ImageBatches};
use crate::error::Result;

/// Every metric of an evaluation pass, and the two that most reports show.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Share of samples whose arg-max output is the class target, when the model reports
    /// class targets.
    pub accuracy: Option<f64>,
    /// Mean loss per sample.
    pub loss: f32,
    /// Every metric by name.
    pub metrics: BTreeMap<String, f64>,
    /// Samples evaluated.
    pub samples: usize,
}

/// Evaluates `model` (call it on a model in inference mode, on a device without autodiff) on
/// every sample of `data` in order, with the given `metrics` (none: [`default_metrics`]); the
/// mean loss is always reported.
pub fn evaluate_source<B: Send, M: TrainStep<B>>(
    model: &M,
    data: &dyn BatchSource<Batch = B>,
    batch_size: usize,
    device: &Device,
    metrics: &mut [Box<dyn Metric>],
) -> Result<Evaluation> {
    let mut defaults;
    let metrics = if metrics.is_empty() {
        defaults = default_metrics();
        &mut defaults[..]
    } else {
        metrics
    };
    let mut loss = crate::train::metrics::LossMetric::default();
    for m in metrics.iter_mut() {
        m.reset();
    }
    let order: Vec<usize> = (0..data.len()).collect();
    // The context is fixed: evaluation never augments.
    let ctx = BatchContext { epoch: 0, seed: 0 };
    for chunk in order.chunks(batch_size.max(1)) {
        let batch = data.batch(chunk, ctx, device)?;
        let output = model.valid_step(batch);
        loss.update(&output, chunk.len());
        for m in metrics.iter_mut() {
            m.update(&output, chunk.len());
        }
    }
    let mut named: BTreeMap<String, f64> = metrics
        .iter()
        .filter_map(|m| m.value().map(|v| (m.name(), v)))
        .collect();
    if let Some(v) = loss.value() {
        named.entry("loss".into()).or_insert(v);
    }
    Ok(Evaluation {
        accuracy: named.get("accuracy").copied(),
        loss: loss.value().unwrap_or(f64::NAN) as f32,
        metrics: named,
        samples: data.len(),
    })
}

/// Evaluates `model` on Kiln's labelled image `data` with the default metrics.
pub fn evaluate<M: TrainStep<crate::data::Batch>>(
    model: &M,
    data: &dyn Dataset,
    batch_size: usize,
    device: &Device,
) -> Result<Evaluation> {
    evaluate_source(model, &ImageBatches::new(data), batch_size, device, &mut [])
}
