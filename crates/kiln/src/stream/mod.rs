//! Real-time inference on streams of frames: four techniques that trade a little work per frame
//! for frames per second at equal accuracy, as composable pieces around any classifier
//! (an [`InferenceSession`], a Burn model, or another technique).
//!
//! | piece | what it skips | module |
//! |---|---|---|
//! | [`FrameGate`] (temporal coherence) | a frame that differs little from the last computed one reuses its result | [`gate`] |
//! | [`RegionTracker`] + [`crop_batch`] (regions of interest) | regions that did not change; the rest run as one batch, results mapped back to frame coordinates | [`roi`] |
//! | [`EarlyExit`] over a [`MultiExit`] model | the deep layers of a sample an early head is confident about | [`early_exit`] |
//! | [`MultiScale`] | the full-resolution model where a coarse one at lower resolution is confident | [`multiscale`] |
//! | [`Cascade`] | the model, where cheaper stages (lower resolution, or an early-exit prefix exported on its own) are confident | `cascade` |
//!
//! [`StreamProcessor`] composes them per stream (a video, or one sequence of `kiln serve`'s
//! sequence extension) and says which path each frame and region took; [`video`] generates the
//! seeded synthetic stream that `kiln bench --mode stream` measures them on. `docs/stream.md`
//! says when each pays.
//!
//! Beyond classifiers, [`FrameStream`] runs the same ideas around any [`FrameModel`]
//! (segmentation masks, enhanced images, boxes) on decoded video (`crate::video`, the `video`
//! feature): gates on a [`Thumb`]nail, regions of interest as crops pasted back,
//! multi-scale where the coarse pass is confident; [`Agreement`] scores each against the full
//! model on every frame, and [`frame_queue`] bounds the decoder's lead.

pub mod agreement;
mod cascade;
pub mod early_exit;
pub mod frame_stream;
pub mod gate;
mod measure;
pub mod multiscale;
pub mod per_frame;
mod processor;
pub mod queue;
pub mod roi;
pub mod settings;
pub mod video;

use burn::tensor::{Int, Tensor, TensorData};
use serde::Serialize;

use crate::classifier::Classifier;
use crate::error::{KilnError, Result};
use crate::infer::InferenceSession;

pub use agreement::Agreement;
pub use cascade::{Cascade, OnnxClassifier, Stage};
pub use early_exit::{EarlyExit, FullDepth, MultiExit};
pub use frame_stream::{FrameStep, FrameStream, RegionConfig, ScaleConfig, Thumb, VideoTechniques};
pub use gate::{FrameGate, GateConfig, GateDecision, mean_abs_diff};
pub use measure::{StreamRun, WARMUP_FRAMES, run_stream};
pub use multiscale::{Downscaled, MultiScale, downscale};
pub use per_frame::{Detection, FrameModel, FrameResult, OnnxFrameModel, OutputKind};
pub use processor::{FrameOutcome, FramePath, RegionResult, StreamConfig, StreamProcessor};
pub use queue::{FrameReceiver, FrameSender, OverloadPolicy, frame_queue};
pub use roi::{RegionTracker, Roi, crop_batch, crop_resize};
pub use settings::StreamSettings;
pub use video::{StreamLike, SyntheticVideo, VideoSpec};

/// One frame: `[channels, height, width]` f32 values, already normalized as the model expects.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub(crate) shape: [usize; 3],
    pub(crate) pixels: Vec<f32>,
}

impl Frame {
    /// A frame of `shape` from `pixels` (row-major `[C, H, W]`); an error when the counts
    /// disagree or a side is zero.
    pub fn new(shape: [usize; 3], pixels: Vec<f32>) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected == 0 || pixels.len() != expected {
            return Err(KilnError::Stream(format!(
                "a frame of shape {shape:?} needs {expected} values, got {}",
                pixels.len()
            )));
        }
        Ok(Frame { shape, pixels })
    }

    /// `[channels, height, width]`.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// The values, row-major `[C, H, W]`.
    pub fn pixels(&self) -> &[f32] {
        &self.pixels
    }
}

/// Which path produced a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// The classifier's one and only path.
    Full,
    /// Exit `k` of a multi-exit model (the last exit is the full depth).
    Exit(usize),
    /// The coarse, low-resolution model of a multi-scale runner.
    Coarse,
    /// The full-resolution model of a multi-scale runner (the coarse one was not confident).
    Fine,
}

impl Route {
    /// A short stable name for tables and metrics (`full`, `exit0`, `coarse`, `fine`).
    pub fn name(self) -> String {
        match self {
            Route::Full => "full".into(),
            Route::Exit(k) => format!("exit{k}"),
            Route::Coarse => "coarse".into(),
            Route::Fine => "fine".into(),
        }
    }
}

/// A top-1 classification: the class, its softmax probability, and the path that made it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// The arg-max class.
    pub class: usize,
    /// Its softmax probability in (0, 1].
    pub confidence: f32,
    /// Which path produced it.
    pub route: Route,
}

/// Softmax top-1 of each row of `logits` `[B, K]`, tagged with `route`.
pub fn top1(logits: Tensor<2>, route: Route) -> Result<Vec<Prediction>> {
    let [_, classes] = logits.dims();
    let values = logits
        .into_data()
        .try_into_vec_as::<f32>()
        .map_err(|e| KilnError::Stream(format!("reading logits: {e:?}")))?;
    Ok(top1_rows(&values, classes, route))
}

/// Softmax top-1 of each `classes`-long row of row-major `logits` (a host buffer, e.g. a
/// server backend's output), tagged with `route`; no rows when `classes` is 0.
pub fn top1_rows(logits: &[f32], classes: usize, route: Route) -> Vec<Prediction> {
    if classes == 0 {
        return Vec::new();
    }
    logits
        .chunks_exact(classes)
        .map(|row| {
            let (class, max) =
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                        if v > best.1 { (i, v) } else { best }
                    });
            // Softmax probability of the arg-max, stable for any logit scale.
            let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
            Prediction {
                class,
                confidence: 1.0 / sum,
                route,
            }
        })
        .collect()
}

/// A model that classifies a batch of images `[B, C, H, W]`: what every technique wraps and
/// what the techniques are themselves, so they compose (an early-exit model under a
/// multi-scale runner under a region batcher).
pub trait FrameClassifier {
    /// The `[C, H, W]` of one input.
    fn input_shape(&self) -> [usize; 3];

    /// One prediction per image, in order.
    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>>;
}

impl FrameClassifier for InferenceSession {
    fn input_shape(&self) -> [usize; 3] {
        self.graph().input_shape
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        top1(self.forward(images)?, Route::Full)
    }
}

/// A Burn [`Classifier`] (a zoo model, or the user's own) as a [`FrameClassifier`], with the
/// input shape it was built for.
#[derive(Debug)]
pub struct BurnClassifier<M> {
    model: M,
    input_shape: [usize; 3],
}

impl<M: Classifier> BurnClassifier<M> {
    /// Wraps `model`, whose inputs are `[C, H, W]` = `input_shape`. A model straight from
    /// training lives on the autodiff device, where every forward records a graph that no
    /// backward frees; the wrapper keeps its inference copy ([`Module::valid`]).
    pub fn new(model: M, input_shape: [usize; 3]) -> Self {
        BurnClassifier {
            model: model.valid(),
            input_shape,
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &M {
        &self.model
    }
}

impl<M: Classifier> FrameClassifier for BurnClassifier<M> {
    fn input_shape(&self) -> [usize; 3] {
        self.input_shape
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.input_shape)?;
        top1(self.model.forward(images), Route::Full)
    }
}

/// The rows `rows` of `x` (in that order); `x` itself when they are all of its rows in order,
/// so a batch that carries on whole is not copied.
pub(crate) fn select_rows(x: Tensor<4>, rows: &[usize]) -> Tensor<4> {
    if rows.len() == x.dims()[0] && rows.iter().enumerate().all(|(i, &r)| i == r) {
        return x;
    }
    let index: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [rows.len()]), &x.device());
    x.select(0, index)
}

/// The answers of a technique that routes rows to several paths, all present; an internal
/// error naming `what` and the row otherwise.
pub(crate) fn all_answered(out: Vec<Option<Prediction>>, what: &str) -> Result<Vec<Prediction>> {
    out.into_iter()
        .enumerate()
        .map(|(i, p)| {
            p.ok_or_else(|| KilnError::Stream(format!("{what}: sample {i} got no answer")))
        })
        .collect()
}

/// An error unless `images` is `[B, C, H, W]` with `[C, H, W]` = `expected`.
pub(crate) fn check_batch_shape(images: &Tensor<4>, expected: [usize; 3]) -> Result<()> {
    let [_, c, h, w] = images.dims();
    if [c, h, w] != expected {
        return Err(KilnError::Stream(format!(
            "images are [{c}, {h}, {w}] but the model expects {expected:?}"
        )));
    }
    Ok(())
}
