//! Early exit: a network with intermediate classifier heads stops, per sample, at the first
//! head whose confidence reaches that head's threshold.
//!
//! The model side is the [`MultiExit`] contract: stage `k` maps the features of stage `k - 1`
//! (the images for `k = 0`) to new features and head `k`'s logits. [`EarlyExit`] runs stage 0
//! on the whole batch, keeps the samples whose head is confident, and carries only the others
//! to the next stage (a row gather), so a batch of mostly easy frames pays for the deep layers
//! of its hard ones alone. The zoo's [`crate::zoo::MultiExitCnn`] is W2 with an early head; any
//! Burn model implements the contract by splitting its forward at the heads.

use burn::tensor::Tensor;

use super::{
    FrameClassifier, Prediction, Route, all_answered, check_batch_shape, select_rows, top1,
};
use crate::error::{KilnError, Result};

/// A network with classifier heads after some of its stages.
pub trait MultiExit {
    /// The `[C, H, W]` of one input.
    fn input_shape(&self) -> [usize; 3];

    /// How many exits (stages with a head); the last is the full network.
    fn num_exits(&self) -> usize;

    /// Runs stage `k` on `x` (the images for `k = 0`, else stage `k - 1`'s features) and
    /// returns its features and its head's logits `[B, classes]`.
    fn stage(&self, k: usize, x: Tensor<4>) -> (Tensor<4>, Tensor<2>);

    /// The last exit's logits with every stage run and no early head: the plain network an
    /// early exit is measured against. The default runs [`MultiExit::stage`] throughout (its
    /// early heads included); override it to skip them.
    fn forward_full(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images;
        let mut logits = None;
        for k in 0..self.num_exits() {
            let (features, l) = self.stage(k, x);
            x = features;
            logits = Some(l);
        }
        logits.expect("a multi-exit model has at least one exit")
    }
}

/// A [`MultiExit`] model run to its last exit on every sample ([`MultiExit::forward_full`]):
/// the baseline of an early exit, and the model's plain use.
#[derive(Debug)]
pub struct FullDepth<M>(pub M);

impl<M: MultiExit> FrameClassifier for FullDepth<M> {
    fn input_shape(&self) -> [usize; 3] {
        self.0.input_shape()
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.0.input_shape())?;
        if self.0.num_exits() == 0 {
            return Err(KilnError::Stream("the model has no exit".into()));
        }
        top1(self.0.forward_full(images), Route::Full)
    }
}

/// Runs a [`MultiExit`] model, stopping each sample at its first confident head. Give it the
/// model's inference copy (`model.valid()` of a trained Burn module): on the autodiff device
/// every forward records a graph that nothing frees.
#[derive(Debug)]
pub struct EarlyExit<M> {
    model: M,
    thresholds: Vec<f32>,
}

impl<M: MultiExit> EarlyExit<M> {
    /// `thresholds[k]` is the softmax confidence at which exit `k` stops a sample, one per
    /// exit before the last (the last always answers). An error when the count is wrong or a
    /// threshold is outside [0, 1]. Higher thresholds trade speed for agreement with the full
    /// network; 1.0 stops only samples whose f32 softmax rounds to certainty.
    pub fn new(model: M, thresholds: Vec<f32>) -> Result<Self> {
        let exits = model.num_exits();
        if exits == 0 || thresholds.len() + 1 != exits {
            return Err(KilnError::Stream(format!(
                "a model with {exits} exits needs {} early-exit thresholds, got {}",
                exits.saturating_sub(1),
                thresholds.len()
            )));
        }
        if let Some(t) = thresholds.iter().find(|t| !(0.0..=1.0).contains(*t)) {
            return Err(KilnError::Stream(format!(
                "early-exit threshold {t} is outside [0, 1]; it is a softmax confidence"
            )));
        }
        Ok(EarlyExit { model, thresholds })
    }

    /// The wrapped model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The thresholds, one per exit before the last.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
    }
}

impl<M: MultiExit> FrameClassifier for EarlyExit<M> {
    fn input_shape(&self) -> [usize; 3] {
        self.model.input_shape()
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.model.input_shape())?;
        let batch = images.dims()[0];
        let mut out: Vec<Option<Prediction>> = vec![None; batch];
        // `alive[i]` is the original index of row i of `x`.
        let mut alive: Vec<usize> = (0..batch).collect();
        let mut x = images;
        let last = self.model.num_exits() - 1;
        for k in 0..=last {
            if alive.is_empty() {
                break;
            }
            let (features, logits) = {
                let _span =
                    tracing::trace_span!("stream.exit", exit = k, rows = alive.len()).entered();
                self.model.stage(k, x)
            };
            let preds = top1(logits, Route::Exit(k))?;
            let mut carry = Vec::new();
            for (row, p) in preds.into_iter().enumerate() {
                if k == last || p.confidence >= self.thresholds[k] {
                    out[alive[row]] = Some(p);
                } else {
                    carry.push(row);
                }
            }
            if carry.is_empty() {
                break;
            }
            x = select_rows(features, &carry);
            alive = carry.iter().map(|&r| alive[r]).collect();
        }
        all_answered(out, "early exit")
    }
}
