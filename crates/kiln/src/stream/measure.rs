//! Measuring a stream configuration on a labelled video: frames per second, latency
//! percentiles, the share of frames and predictions that took each path, and accuracy against
//! the ground truth and against a reference run (the full model on every region of every
//! frame). `kiln bench --mode stream` and the tests use it, with the zoo's stream models
//! ([`crate::zoo::train_stream_models`]).

use std::collections::BTreeMap;
use std::time::Instant;

use burn::tensor::Device;
use serde::Serialize;

use super::FrameClassifier;
use super::processor::{FramePath, StreamConfig, StreamProcessor};
use super::video::SyntheticVideo;
use crate::error::{KilnError, Result};

/// Frames processed before timing starts (on a separate stream state): first-call costs
/// (allocations, kernel set-up) are not a stream's steady state.
pub const WARMUP_FRAMES: usize = 20;

/// One configuration's run over a video.
#[derive(Debug, Clone, Serialize)]
pub struct StreamRun {
    /// What ran (`full`, `temporal`, `roi`, `early-exit`, ...).
    pub name: String,
    /// Frames processed.
    pub frames: usize,
    /// Frames per second over the whole video.
    pub fps: f64,
    /// Median per-frame latency, ms.
    pub p50_ms: f64,
    /// 99th-percentile per-frame latency, ms.
    pub p99_ms: f64,
    /// Share of (frame, region) predictions equal to the true digit.
    pub accuracy: f64,
    /// Share of (frame, region) predictions equal to the reference run's, when one is given.
    pub agreement: Option<f64>,
    /// Frames per [`FramePath`] (`reused`, `partial`, `full`).
    pub frame_paths: BTreeMap<String, usize>,
    /// Fresh region predictions per route (`full`, `exit0`, `exit1`, `coarse`, `fine`) and
    /// `reused` for the region results carried over from an earlier frame.
    pub region_paths: BTreeMap<String, usize>,
    /// The predicted class of each region in each frame (not serialized).
    #[serde(skip)]
    pub predictions: Vec<Vec<usize>>,
}

impl StreamRun {
    /// The share of region results, in [0, 1], that took `path` (a route name such as `exit0`,
    /// or `reused`).
    pub fn region_share(&self, path: &str) -> f64 {
        let total: usize = self.region_paths.values().sum();
        *self.region_paths.get(path).unwrap_or(&0) as f64 / total.max(1) as f64
    }

    /// The region paths as percentages, for a table: `exit0 47%, exit1 53%`.
    pub fn region_summary(&self) -> String {
        self.region_paths
            .keys()
            .map(|k| format!("{k} {:.0}%", 100.0 * self.region_share(k)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Runs `model` under `config` over every frame of `video` and measures it; `reference`
/// holds the predictions to compare with (a [`StreamRun::predictions`] of the full model).
pub fn run_stream(
    name: &str,
    video: &SyntheticVideo,
    config: &StreamConfig,
    model: &dyn FrameClassifier,
    device: &Device,
    reference: Option<&[Vec<usize>]>,
) -> Result<StreamRun> {
    let shape = video
        .frames
        .first()
        .map(|f| f.shape())
        .ok_or_else(|| KilnError::Stream("the video has no frames".into()))?;
    let mut warm = StreamProcessor::new(shape, config, device)?;
    for frame in video.frames.iter().take(WARMUP_FRAMES) {
        warm.process(frame, model)?;
    }
    let mut stream = StreamProcessor::new(shape, config, device)?;
    let mut latencies = Vec::with_capacity(video.frames.len());
    let mut predictions = Vec::with_capacity(video.frames.len());
    let mut frame_paths = BTreeMap::new();
    let mut region_paths = BTreeMap::new();
    let started = Instant::now();
    for frame in &video.frames {
        let t = Instant::now();
        let outcome = stream.process(frame, model)?;
        latencies.push(t.elapsed().as_secs_f64() * 1e3);
        let path = match outcome.path {
            FramePath::Reused => "reused",
            FramePath::Partial => "partial",
            FramePath::Full => "full",
        };
        *frame_paths.entry(path.to_string()).or_insert(0) += 1;
        for r in &outcome.regions {
            let key = if r.fresh {
                r.prediction.route.name()
            } else {
                "reused".to_string()
            };
            *region_paths.entry(key).or_insert(0) += 1;
        }
        predictions.push(
            outcome
                .regions
                .iter()
                .map(|r| r.prediction.class)
                .collect::<Vec<_>>(),
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let pct = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    let share = |truth: &[Vec<usize>]| {
        let (mut hit, mut total) = (0usize, 0usize);
        for (p, t) in predictions.iter().zip(truth) {
            for (a, b) in p.iter().zip(t) {
                hit += usize::from(a == b);
                total += 1;
            }
        }
        hit as f64 / total.max(1) as f64
    };
    Ok(StreamRun {
        name: name.to_string(),
        frames: video.frames.len(),
        fps: video.frames.len() as f64 / seconds.max(1e-9),
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        accuracy: share(&video.labels),
        agreement: reference.map(share),
        frame_paths,
        region_paths,
        predictions,
    })
}
