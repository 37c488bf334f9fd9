//! The training-step contract: how one batch of the user's data becomes a loss.
//!
//! It follows burn-train's `TrainStep` / `ValidStep` idea in the small: the model says what a
//! step is, for any batch type and any loss, and returns a [`StepOutput`]; the trainer owns
//! everything around it (accumulation, scaling, clipping, the guard, checkpoints, events).
//! Outputs and targets are optional and only read by evaluation metrics, so a training step
//! costs no extra device→host reads.

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLossConfig, MseLoss, Reduction};
use burn::tensor::{Int, Tensor};

use crate::classifier::Classifier;
use crate::data::Batch;

/// What a model does with one batch `B`. Implement it on your Burn module and hand the module
/// to [`super::Trainer::fit_source`]; every training feature of Kiln applies unchanged.
///
/// ```
/// use burn::module::Module;
/// use burn::tensor::{Int, Tensor};
/// use kiln::nn::Linear;
/// use kiln::train::{StepOutput, TrainStep};
///
/// #[derive(Module, Debug)]
/// struct MyModel {
///     head: Linear,
/// }
///
/// #[derive(Clone, Debug)]
/// struct MyBatch {
///     inputs: Tensor<2>,
///     targets: Tensor<1, Int>,
/// }
///
/// impl TrainStep<MyBatch> for MyModel {
///     fn step(&self, batch: MyBatch) -> StepOutput {
///         let logits = self.head.forward(batch.inputs);
///         StepOutput::classification(logits, batch.targets)
///     }
/// }
/// ```
pub trait TrainStep<B>: Module {
    /// The forward pass and loss of one training batch. The loss must be a scalar (shape
    /// `[1]`, e.g. a `.mean()`); it is differentiated under autodiff.
    fn step(&self, batch: B) -> StepOutput;

    /// The forward pass and loss of one evaluation batch (inference mode, no autodiff).
    /// Defaults to [`TrainStep::step`]; override it when evaluation differs (no dropout
    /// sampling, another output).
    fn valid_step(&self, batch: B) -> StepOutput {
        self.step(batch)
    }

    /// Checks that `batch` fits the model before the first step; the error says what does
    /// not (e.g. "images are [3, 32, 32] but the model expects [1, 28, 28]"). A batch that
    /// passes here but still makes Burn panic in the first step is reported as an error too.
    fn check_batch(&self, batch: &B) -> std::result::Result<(), String> {
        let _ = batch;
        Ok(())
    }
}

/// What a step produced: the loss, and optionally predictions and targets for metrics.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The scalar loss (shape `[1]`).
    pub loss: Tensor<1>,
    /// Predictions `[B, K]` (class logits, or regression outputs), for metrics.
    pub output: Option<Tensor<2>>,
    /// What the predictions are compared with, for metrics.
    pub targets: Option<Targets>,
}

/// The targets of a batch, as metrics read them.
#[derive(Debug, Clone)]
pub enum Targets {
    /// Class indices `[B]` (accuracy compares them with the arg-max of the output).
    Classes(Tensor<1, Int>),
    /// Real values `[B, K]`, the output's shape (mean squared error compares them).
    Values(Tensor<2>),
}

impl StepOutput {
    /// A loss alone (no metric beyond the loss itself).
    pub fn new(loss: Tensor<1>) -> Self {
        StepOutput {
            loss,
            output: None,
            targets: None,
        }
    }

    /// Cross-entropy of `logits` `[B, K]` against class `labels` `[B]`, with accuracy
    /// available as a metric. The loss runs in f32 (autocast's linear layers return f32).
    pub fn classification(logits: Tensor<2>, labels: Tensor<1, Int>) -> Self {
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), labels.clone());
        StepOutput {
            loss,
            output: Some(logits),
            targets: Some(Targets::Classes(labels)),
        }
    }

    /// Mean squared error of `predictions` against `targets` (both `[B, K]`), with MSE
    /// available as a metric.
    pub fn regression(predictions: Tensor<2>, targets: Tensor<2>) -> Self {
        let loss = MseLoss::new().forward(predictions.clone(), targets.clone(), Reduction::Mean);
        StepOutput {
            loss,
            output: Some(predictions),
            targets: Some(Targets::Values(targets)),
        }
    }

    /// Attaches predictions and class targets to a custom loss (accuracy becomes available).
    pub fn with_classes(mut self, logits: Tensor<2>, labels: Tensor<1, Int>) -> Self {
        self.output = Some(logits);
        self.targets = Some(Targets::Classes(labels));
        self
    }

    /// Attaches predictions and real-valued targets to a custom loss (MSE becomes available).
    pub fn with_values(mut self, predictions: Tensor<2>, targets: Tensor<2>) -> Self {
        self.output = Some(predictions);
        self.targets = Some(Targets::Values(targets));
        self
    }
}

/// Every classifier (the zoo's and a user's) trains through the same contract a user's
/// own `TrainStep` does: images in,
/// logits out, cross-entropy against the labels.
impl<M: Classifier> TrainStep<Batch> for M {
    fn step(&self, batch: Batch) -> StepOutput {
        StepOutput::classification(self.forward(batch.images), batch.labels)
    }

    fn check_batch(&self, batch: &Batch) -> std::result::Result<(), String> {
        let [_, c, h, w] = batch.images.dims();
        self.check_input([c, h, w])
    }
}
