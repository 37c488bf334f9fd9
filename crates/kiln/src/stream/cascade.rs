//! A cascade of classifiers: cheaper stages answer the samples they are sure of, the last
//! (the model itself) answers the rest. Its two uses:
//! - **multi-scale** with any number of resolutions: a stage whose input is `1/f` of the
//!   model's per side gets the images downscaled by `f` ([`super::downscale`]);
//! - **early exit as separate models**: a stage with the model's input is the network's
//!   prefix up to an early head, exported on its own (an ONNX file or a Kiln graph). It
//!   recomputes that prefix when the sample goes on (W2's first convolution: ~2% of the full
//!   network), which is what a server that loads whole models can do; [`super::EarlyExit`]
//!   shares the prefix when the model is a Burn module.
//!
//! [`super::MultiScale`] is the two-stage special case with typed parts.

use burn::tensor::Tensor;

use super::multiscale::{downscale, scale_factor};
use super::{FrameClassifier, Prediction, Route, all_answered, check_batch_shape, select_rows};
use crate::error::{KilnError, Result};

/// A stage of a cascade: a classifier and the softmax confidence at which its answer stands.
pub struct Stage {
    /// The classifier (its input the model's, or smaller by one integer factor per side).
    pub model: Box<dyn FrameClassifier + Send>,
    /// Answers at or above this confidence stand, in [0, 1].
    pub threshold: f32,
}

/// Stages, then the model; predictions carry [`Route::Exit`] with the index of the stage that
/// answered (the model is `Exit(stages.len())`).
pub struct Cascade {
    stages: Vec<(Stage, usize)>,
    last: Box<dyn FrameClassifier + Send>,
}

impl std::fmt::Debug for Cascade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cascade")
            .field("stages", &self.stages.len())
            .field("input", &self.last.input_shape())
            .finish()
    }
}

impl Cascade {
    /// A cascade of `stages` before `last`; an error naming the stage when its input does not
    /// fit the model's (other channels, or not one integer factor smaller) or its threshold
    /// is outside [0, 1].
    pub fn new(stages: Vec<Stage>, last: Box<dyn FrameClassifier + Send>) -> Result<Self> {
        let input = last.input_shape();
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(k, s)| {
                if !(0.0..=1.0).contains(&s.threshold) {
                    return Err(KilnError::Stream(format!(
                        "cascade stage {k}: threshold {} is outside [0, 1]; it is a softmax confidence",
                        s.threshold
                    )));
                }
                let factor = scale_factor(input, s.model.input_shape())
                    .map_err(|e| KilnError::Stream(format!("cascade stage {k}: {e}")))?;
                Ok((s, factor))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Cascade { stages, last })
    }

    /// Stages before the model.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Whether the cascade is the model alone.
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }
}

impl FrameClassifier for Cascade {
    fn input_shape(&self) -> [usize; 3] {
        self.last.input_shape()
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.last.input_shape())?;
        let batch = images.dims()[0];
        let mut out: Vec<Option<Prediction>> = vec![None; batch];
        let mut alive: Vec<usize> = (0..batch).collect();
        let mut x = images;
        for (k, (stage, factor)) in self.stages.iter().enumerate() {
            if alive.is_empty() {
                break;
            }
            let answers = stage.model.classify(downscale(x.clone(), *factor)?)?;
            let mut carry = Vec::new();
            for (row, mut p) in answers.into_iter().enumerate() {
                if p.confidence >= stage.threshold {
                    p.route = Route::Exit(k);
                    out[alive[row]] = Some(p);
                } else {
                    carry.push(row);
                }
            }
            if !carry.is_empty() {
                x = select_rows(x, &carry);
            }
            alive = carry.iter().map(|&r| alive[r]).collect();
        }
        if !alive.is_empty() {
            for (i, mut p) in alive.iter().zip(self.last.classify(x)?) {
                p.route = Route::Exit(self.stages.len());
                out[*i] = Some(p);
            }
        }
        all_answered(out, "cascade")
    }
}

/// An imported ONNX classifier (one float image input `[B, C, H, W]` with static C, H, W;
/// logits as its first output) as a [`FrameClassifier`].
pub struct OnnxClassifier {
    model: crate::onnx::OnnxModel,
    input_shape: [usize; 3],
}

impl std::fmt::Debug for OnnxClassifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxClassifier")
            .field("model", &self.model.name())
            .field("input_shape", &self.input_shape)
            .finish()
    }
}

impl OnnxClassifier {
    /// Wraps `model`; an error saying what differs when it is not a single-image classifier.
    pub fn new(model: crate::onnx::OnnxModel) -> Result<Self> {
        let shape = match model.inputs() {
            [one] if one.kind == crate::onnx::ValueKind::Float && one.dims.len() == 4 => {
                match (one.dims[1], one.dims[2], one.dims[3]) {
                    (Some(c), Some(h), Some(w)) => Some([c, h, w]),
                    _ => None,
                }
            }
            _ => None,
        };
        let input_shape = shape.ok_or_else(|| {
            KilnError::Stream(format!(
                "ONNX model `{}` is not a single-image classifier: it needs one float input \
                 [B, C, H, W] with fixed C, H, W",
                model.name()
            ))
        })?;
        Ok(OnnxClassifier { model, input_shape })
    }
}

impl FrameClassifier for OnnxClassifier {
    fn input_shape(&self) -> [usize; 3] {
        self.input_shape
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.input_shape)?;
        let outputs = self.model.run(vec![crate::onnx::Value::float(images)])?;
        let logits = outputs.into_iter().next().ok_or_else(|| {
            KilnError::Stream(format!("ONNX model `{}` has no output", self.model.name()))
        })?;
        let dims = logits.dims();
        let rows = dims.first().copied().unwrap_or(0);
        let logits: Tensor<2> = logits
            .reshape(&[rows, dims.iter().skip(1).product()])
            .map_err(KilnError::from)?
            .f();
        super::top1(logits, Route::Full)
    }
}
