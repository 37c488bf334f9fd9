//! Real video files as frames for any per-frame model (the `video` cargo feature, over the
//! system's FFmpeg libraries: `apt install libavcodec-dev libavformat-dev libswscale-dev
//! libavutil-dev pkg-config libclang-dev`).
//!
//! | piece | job | module |
//! |---|---|---|
//! | [`VideoReader`] | demux and decode any container / codec FFmpeg has; damage reported, never a panic | [`reader`] |
//! | [`Converter`] | YUV → RGB and resize / letterbox in one swscale pass, then normalize + thumbnail | [`convert`] |
//! | [`DecodedVideo`] | decoding on its own thread, a bounded queue with an overload policy | [`pipeline`] |
//! | [`run_video`] | a model and its techniques over a file: fps per stage, latency, agreement | here |
//! | [`write_clip`] | deterministic test videos with their ground truth | [`synth`] |
//!
//! Why FFmpeg: users' files are H.264, H.265, VP9 and AV1 in MP4, MKV and WebM; only FFmpeg's
//! libraries decode all of them, fast (SIMD, frame threads), and every distribution ships them.
//! No pure-Rust decoder covers H.265, and binding one codec per format would leave users'
//! files behind. Behind a feature, because it is a system library: the default build needs
//! nothing but Rust.

pub mod convert;
pub mod pipeline;
pub mod reader;
pub mod synth;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

pub use convert::{Converter, Fit, Preprocess};
pub use pipeline::{DecodeOptions, DecodeSummary, DecodedVideo, PreparedFrame};
pub use reader::{VideoInfo, VideoReader};
pub use synth::{ClipSpec, ClipTruth, Codec, Scene, write_clip};

use crate::error::Result;
use crate::stream::agreement::AgreementSummary;
use crate::stream::{Agreement, FrameModel, FramePath, FrameResult, FrameStream, VideoTechniques};

/// One configuration's run over a video file.
#[derive(Debug, Clone, Serialize)]
pub struct VideoRun {
    /// What ran (`decode`, `full`, `temporal`, `roi`, ...).
    pub name: String,
    /// The file's codec and size.
    pub info: VideoInfo,
    /// Frames that reached the model (or, for `decode`, were decoded and converted).
    pub frames: u64,
    /// Frames the overload policy dropped.
    pub dropped: u64,
    /// Frames per second of the decoder alone (decode seconds on its thread).
    pub decode_fps: f64,
    /// Frames per second of conversion alone (colour, resize, normalize, thumbnail).
    pub preprocess_fps: f64,
    /// Frames per second of the model stage alone (gates and model calls).
    pub inference_fps: f64,
    /// Frames per second end to end (wall clock, decode thread and model overlapping).
    pub fps: f64,
    /// Median time of the model stage per frame, ms.
    pub p50_ms: f64,
    /// 99th percentile of the model stage per frame, ms.
    pub p99_ms: f64,
    /// 99th percentile from a frame being ready (decoded and converted) to its result, ms:
    /// the model stage plus the wait in the queue.
    pub ready_p99_ms: f64,
    /// Frames per path: `full`, `partial`, `reused`.
    pub paths: BTreeMap<String, u64>,
    /// Share of input pixels the model ran on at full resolution, over all frames.
    pub pixel_share: f64,
    /// Agreement with the reference (the full model on every frame), when given.
    pub agreement: Option<AgreementSummary>,
    /// Accuracy against the ground truth (a generated clip's object masks), when given: the
    /// task's own score, which the full model has too (its own run's `truth`).
    pub truth: Option<AgreementSummary>,
    /// Frame-size changes met mid-stream.
    pub size_changes: u64,
    /// Damage met (truncation, damaged packets), if any.
    pub damage: Option<String>,
}

/// What a run's results are scored against, per frame index.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scoring<'a> {
    /// The full model's results (from an earlier run with `keep` set): agreement.
    pub reference: Option<&'a [FrameResult]>,
    /// The true results (a generated clip's [`ClipTruth::masks`]): accuracy.
    pub truth: Option<&'a [FrameResult]>,
}

impl<'a> Scoring<'a> {
    /// Agreement with the full model's `reference` only.
    pub fn reference(reference: &'a [FrameResult]) -> Self {
        Scoring {
            reference: Some(reference),
            truth: None,
        }
    }
}

/// Runs `model` with `techniques` over every frame of the video in `path`, decoded into
/// `spec`'s input on its own thread under `options`, scoring each result against `scoring`'s
/// references (agreement with the full model, accuracy against the truth).
/// With `model` `None`, only decodes and converts (the `decode` row). Returns the run and,
/// when `keep` is set, every frame's result.
pub fn run_video(
    path: &Path,
    spec: &Preprocess,
    options: &DecodeOptions,
    model: Option<&dyn FrameModel>,
    techniques: &VideoTechniques,
    scoring: Scoring<'_>,
    keep: bool,
) -> Result<(VideoRun, Vec<FrameResult>)> {
    let mut stream = model
        .map(|m| FrameStream::new(techniques.clone(), m))
        .transpose()?;
    let video = DecodedVideo::start(path, spec.clone(), options.clone())?;
    let info = video.info.clone();
    let mut kept = Vec::new();
    let mut stage = Vec::new();
    let mut ready = Vec::new();
    let mut paths = BTreeMap::new();
    let mut agreement = Agreement::default();
    let mut accuracy = Agreement::default();
    let (mut frames, mut ran_pixels, mut all_pixels) = (0u64, 0f64, 0f64);
    let started = Instant::now();
    while let Some(f) = video.next() {
        frames += 1;
        let (Some(model), Some(stream)) = (model, stream.as_mut()) else {
            continue;
        };
        let t = Instant::now();
        let step = stream.process(&f.input, &f.thumb, model)?;
        stage.push(t.elapsed().as_secs_f64() * 1e3);
        ready.push(f.ready.elapsed().as_secs_f64() * 1e3);
        let [_, h, w] = f.input.shape();
        all_pixels += (h * w) as f64;
        ran_pixels += step.pixels_run as f64;
        let path = match step.path {
            FramePath::Full => "full",
            FramePath::Partial => "partial",
            FramePath::Reused => "reused",
        };
        *paths.entry(path.to_string()).or_insert(0) += 1;
        let at = f.index as usize;
        if let Some(reference) = scoring.reference.and_then(|r| r.get(at)) {
            agreement.add(&step.result, reference);
        }
        if let Some(truth) = scoring.truth.and_then(|t| t.get(at)) {
            accuracy.add(&step.result, truth);
        }
        if keep {
            // Index by frame: a dropped frame leaves its slot to the next kept one's result.
            while kept.len() < f.index as usize {
                kept.push(step.result.clone());
            }
            kept.push(step.result);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let dropped = video.dropped();
    let summary = video.finish()?;
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v.get(((v.len().saturating_sub(1)) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let stage_s: f64 = stage.iter().sum::<f64>() / 1e3;
    let per_s = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let run = VideoRun {
        name: if model.is_some() {
            techniques.name()
        } else {
            "decode".into()
        },
        info,
        frames,
        dropped,
        decode_fps: per_s(summary.decoded, summary.decode_s),
        preprocess_fps: per_s(summary.decoded, summary.convert_s),
        inference_fps: per_s(frames, stage_s),
        fps: per_s(frames, seconds),
        p50_ms: pct(&mut stage, 0.5),
        p99_ms: pct(&mut stage, 0.99),
        ready_p99_ms: pct(&mut ready, 0.99),
        paths,
        pixel_share: if all_pixels > 0.0 {
            ran_pixels / all_pixels
        } else {
            0.0
        },
        agreement: scoring.reference.map(|_| agreement.summary()),
        truth: scoring.truth.map(|_| accuracy.summary()),
        size_changes: summary.size_changes,
        damage: summary.damage,
    };
    Ok((run, kept))
}
