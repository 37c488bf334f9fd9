//! One stream's state and the per-frame pipeline: frame gate → changed regions → one batch
//! through the classifier (plain, early-exit or multi-scale) → results in frame coordinates.

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::gate::{FrameGate, GateConfig, GateDecision};
use super::roi::{RegionTracker, Roi, crop_batch};
use super::{Frame, FrameClassifier, Prediction};
use crate::error::{KilnError, Result};

/// Which techniques a stream uses around its classifier (the classifier itself brings early
/// exit or multi-scale).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamConfig {
    /// Temporal coherence: reuse every result when the whole frame is unchanged.
    pub frame_gate: Option<GateConfig>,
    /// The regions classified in each frame, in frame coordinates; `None` = the whole frame.
    pub regions: Option<Vec<Roi>>,
    /// Regions of interest: run only the regions whose content changed (each gated like a
    /// frame); `None` = every region every computed frame.
    pub region_gate: Option<GateConfig>,
}

/// How much of a frame the model ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FramePath {
    /// No model call: every result reused.
    Reused,
    /// Some regions ran, the others reused their results.
    Partial,
    /// Every region ran.
    Full,
}

/// One region's result in a frame.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RegionResult {
    /// Where in the frame.
    pub roi: Roi,
    /// Its classification (computed on this frame or reused).
    pub prediction: Prediction,
    /// Whether the model ran on this region in this frame.
    pub fresh: bool,
}

/// What processing one frame produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FrameOutcome {
    /// One result per region, in layout order.
    pub regions: Vec<RegionResult>,
    /// How much of the frame ran.
    pub path: FramePath,
}

/// The state of one stream (a video, a sequence of `kiln serve`): its gates and last results.
/// The classifier is passed per frame, so many streams share one model.
#[derive(Debug, Clone)]
pub struct StreamProcessor {
    shape: [usize; 3],
    regions: Vec<Roi>,
    frame_gate: Option<FrameGate>,
    tracker: Option<RegionTracker>,
    last: Vec<Option<Prediction>>,
    /// Frames since each region's result was computed.
    since: Vec<u32>,
    /// The most frames a region's result may be reused for: the region gate's age, else the
    /// frame gate's. The gates count only the frames they see, and the region gates see no
    /// frame the frame gate reused, so this bound is kept here across both.
    max_age: Option<u32>,
    device: Device,
}

impl StreamProcessor {
    /// A stream of frames of `shape` (`[C, H, W]`) whose model runs on `device`; an error
    /// when a region lies outside the frame or a gate setting cannot work.
    pub fn new(shape: [usize; 3], config: &StreamConfig, device: &Device) -> Result<Self> {
        let regions = config
            .regions
            .clone()
            .unwrap_or_else(|| vec![Roi::whole(shape)]);
        if regions.is_empty() {
            return Err(KilnError::Stream(
                "the region list is empty; give at least one region or none for the whole frame"
                    .into(),
            ));
        }
        for r in &regions {
            r.check_inside(shape)?;
        }
        let frame_gate = config.frame_gate.map(FrameGate::new).transpose()?;
        let tracker = config
            .region_gate
            .map(|g| RegionTracker::new(regions.clone(), shape, g))
            .transpose()?;
        let max_age = config
            .region_gate
            .or(config.frame_gate)
            .map(|g| g.max_reuse_age);
        Ok(StreamProcessor {
            shape,
            last: vec![None; regions.len()],
            since: vec![0; regions.len()],
            max_age,
            regions,
            frame_gate,
            tracker,
            device: device.clone(),
        })
    }

    /// The frame shape this stream takes.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// Processes the next frame with `model`. A frame of another shape is an error that
    /// leaves the stream's state as it was; when the model fails, the regions it was to run
    /// lose their results, so the next frame runs them rather than reuse a stale one.
    pub fn process(&mut self, frame: &Frame, model: &dyn FrameClassifier) -> Result<FrameOutcome> {
        let run = self.begin(frame)?;
        let predictions = if run.is_empty() {
            Ok(Vec::new())
        } else {
            let _span = tracing::trace_span!("stream.model", regions = run.len()).entered();
            let rois: Vec<Roi> = run.iter().map(|&i| self.regions[i]).collect();
            crop_batch(frame, &rois, model.input_shape(), &self.device)
                .and_then(|batch| model.classify(batch))
        };
        match predictions {
            Ok(p) => self.finish(&run, p),
            Err(e) => {
                self.forget(&run);
                Err(e)
            }
        }
    }

    /// The first half of [`StreamProcessor::process`], for callers that batch the regions of
    /// many streams into one model call (`kiln serve`): checks the frame, runs the gates, and
    /// returns the indices of the regions the model must run on (empty = reuse everything).
    /// Follow it with [`StreamProcessor::finish`], or [`StreamProcessor::forget`] when the
    /// model fails.
    pub fn begin(&mut self, frame: &Frame) -> Result<Vec<usize>> {
        if frame.shape() != self.shape {
            return Err(KilnError::Stream(format!(
                "frame is {:?} but this stream's frames are {:?}",
                frame.shape(),
                self.shape
            )));
        }
        let first = self.last.iter().any(Option::is_none);
        for s in &mut self.since {
            *s = s.saturating_add(1);
        }
        // Regions whose result reached its age bound run whatever the gates say.
        let stale: Vec<usize> = match self.max_age {
            Some(max) => (0..self.since.len())
                .filter(|&i| self.since[i] > max)
                .collect(),
            None => Vec::new(),
        };
        let reuse_frame = match &mut self.frame_gate {
            Some(g) => g.check(frame.pixels()) == GateDecision::Reuse && !first,
            None => false,
        };
        let mut run: Vec<usize> = if reuse_frame {
            Vec::new()
        } else {
            match &mut self.tracker {
                Some(t) => t.changed(frame)?,
                None => (0..self.regions.len()).collect(),
            }
        };
        // A region without a result yet runs whatever its gate says, as does a stale one.
        for (i, p) in self.last.iter().enumerate() {
            if (p.is_none() || stale.contains(&i)) && !run.contains(&i) {
                run.push(i);
            }
        }
        run.sort_unstable();
        Ok(run)
    }

    /// The regions of the stream's layout.
    pub fn regions(&self) -> &[Roi] {
        &self.regions
    }

    /// Completes a frame begun with [`StreamProcessor::begin`]: `predictions` are the model's
    /// answers for the regions `run`, in order.
    pub fn finish(&mut self, run: &[usize], predictions: Vec<Prediction>) -> Result<FrameOutcome> {
        if predictions.len() != run.len() {
            self.forget(run);
            return Err(KilnError::Stream(format!(
                "the classifier returned {} predictions for {} regions",
                predictions.len(),
                run.len()
            )));
        }
        for (&i, p) in run.iter().zip(predictions) {
            if let Some(slot) = self.last.get_mut(i) {
                *slot = Some(p);
                self.since[i] = 0;
            }
        }
        let regions = self
            .regions
            .iter()
            .zip(&self.last)
            .enumerate()
            .map(|(i, (roi, p))| {
                let prediction = p.ok_or_else(|| {
                    KilnError::Stream(format!("region {i} has no result after its first frame"))
                })?;
                Ok(RegionResult {
                    roi: *roi,
                    prediction,
                    fresh: run.contains(&i),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let path = match run.len() {
            0 => FramePath::Reused,
            n if n == self.regions.len() => FramePath::Full,
            _ => FramePath::Partial,
        };
        Ok(FrameOutcome { regions, path })
    }

    /// Drops the results of the regions `run` after a failed model call: the gates already
    /// took the frame as their reference, so forgetting makes the next frame run them instead
    /// of reusing a result of an older frame.
    pub fn forget(&mut self, run: &[usize]) {
        for &i in run {
            if let Some(slot) = self.last.get_mut(i) {
                *slot = None;
            }
        }
    }
}
