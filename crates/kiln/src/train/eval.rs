//! Evaluation of a classifier on a labelled dataset.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::Device;

use crate::data::{Dataset, collate};
use crate::error::Result;
use crate::zoo::Classifier;

/// Accuracy and loss on a dataset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// Share of samples whose arg-max logit is the label, in [0, 1].
    pub accuracy: f64,
    /// Mean cross-entropy.
    pub loss: f32,
    /// Samples evaluated.
    pub samples: usize,
}

/// Evaluates `model` (in inference mode, on a device without autodiff) on all of `data`.
pub fn evaluate<M: Classifier>(
    model: &M,
    data: &dyn Dataset,
    batch_size: usize,
    device: &Device,
) -> Result<Evaluation> {
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let order: Vec<usize> = (0..data.len()).collect();
    let (mut correct, mut loss_sum) = (0i64, 0f64);
    for chunk in order.chunks(batch_size.max(1)) {
        let batch = collate(data, chunk, device)?;
        let logits = model.forward(batch.images);
        let loss: f32 = loss_fn
            .forward(logits.clone(), batch.labels.clone())
            .into_scalar();
        loss_sum += loss as f64 * batch.len as f64;
        let predicted = logits.argmax(1).reshape([batch.len]);
        let hits: i64 = predicted.equal(batch.labels).int().sum().into_scalar();
        correct += hits;
    }
    let n = data.len().max(1);
    Ok(Evaluation {
        accuracy: correct as f64 / n as f64,
        loss: (loss_sum / n as f64) as f32,
        samples: data.len(),
    })
}
