//! Evaluation metrics over a held-out split, pluggable: anything that folds [`StepOutput`]s
//! into a number implements [`Metric`]. Loss, accuracy and mean squared error come with Kiln.

use super::contract::{StepOutput, Targets};

/// A number computed over the batches of one evaluation pass.
pub trait Metric: Send {
    /// The name it is reported under (`accuracy`, `mse`, ...).
    fn name(&self) -> String;

    /// Starts a new pass.
    fn reset(&mut self);

    /// Folds in one batch of `samples` samples. Reads the device (evaluation only).
    fn update(&mut self, output: &StepOutput, samples: usize);

    /// The value over the batches seen since [`Metric::reset`]; `None` if it never applied
    /// (e.g. accuracy on a regression output).
    fn value(&self) -> Option<f64>;
}

/// The metrics used when the caller names none: accuracy (reported where the step gives
/// class targets) and MSE (where it gives real-valued ones). The loss is always reported.
pub fn default_metrics() -> Vec<Box<dyn Metric>> {
    vec![Box::new(Accuracy::default()), Box::new(Mse::default())]
}

/// Mean loss per sample (each batch's loss weighted by its size).
#[derive(Debug, Default, Clone)]
pub struct LossMetric {
    sum: f64,
    samples: usize,
}

impl Metric for LossMetric {
    fn name(&self) -> String {
        "loss".into()
    }

    fn reset(&mut self) {
        *self = Self::default();
    }

    fn update(&mut self, output: &StepOutput, samples: usize) {
        let loss: f32 = output.loss.clone().into_scalar();
        self.sum += loss as f64 * samples as f64;
        self.samples += samples;
    }

    fn value(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.sum / self.samples as f64)
    }
}

/// Share of samples whose arg-max output is the class target, in [0, 1].
#[derive(Debug, Default, Clone)]
pub struct Accuracy {
    correct: i64,
    samples: usize,
}

impl Metric for Accuracy {
    fn name(&self) -> String {
        "accuracy".into()
    }

    fn reset(&mut self) {
        *self = Self::default();
    }

    fn update(&mut self, output: &StepOutput, _samples: usize) {
        let (Some(logits), Some(Targets::Classes(labels))) = (&output.output, &output.targets)
        else {
            return;
        };
        let [n, _] = logits.dims();
        let predicted = logits.clone().argmax(1).reshape([n]);
        let hits: i64 = predicted.equal(labels.clone()).int().sum().into_scalar();
        self.correct += hits;
        self.samples += n;
    }

    fn value(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.correct as f64 / self.samples as f64)
    }
}

/// Mean squared error between a real-valued output and its targets, over every element.
#[derive(Debug, Default, Clone)]
pub struct Mse {
    sum: f64,
    elements: usize,
}

impl Metric for Mse {
    fn name(&self) -> String {
        "mse".into()
    }

    fn reset(&mut self) {
        *self = Self::default();
    }

    fn update(&mut self, output: &StepOutput, _samples: usize) {
        let (Some(pred), Some(Targets::Values(target))) = (&output.output, &output.targets) else {
            return;
        };
        let [n, k] = pred.dims();
        let sum: f32 = (pred.clone() - target.clone()).square().sum().into_scalar();
        self.sum += sum as f64;
        self.elements += n * k;
    }

    fn value(&self) -> Option<f64> {
        (self.elements > 0).then(|| self.sum / self.elements as f64)
    }
}
