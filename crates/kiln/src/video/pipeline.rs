//! Decoding runs ahead of inference on its own thread: it opens the file, decodes and converts
//! each frame, and hands it over through a bounded [`frame_queue`] whose policy says what
//! happens when the model falls behind (`DecodeOptions::on_overload`, `--on-overload`).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use ffmpeg_next::frame;

use super::convert::{Converter, Preprocess};
use super::reader::{VideoInfo, VideoReader};
use crate::error::{KilnError, Result};
use crate::stream::{Frame, FrameReceiver, OverloadPolicy, Thumb, frame_queue};

/// One decoded frame, ready for the model.
#[derive(Debug, Clone)]
pub struct PreparedFrame {
    /// Its index in the file (presentation order, from 0).
    pub index: u64,
    /// The model's input.
    pub input: Frame,
    /// Its thumbnail, for the gates.
    pub thumb: Thumb,
    /// Seconds the decoder spent on it.
    pub decode_s: f64,
    /// Seconds converting it (colour, resize, normalize, thumbnail).
    pub convert_s: f64,
    /// When it was ready (for latency from decode to result).
    pub ready: Instant,
}

/// How the decoder thread runs.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOptions {
    /// Frames the decoder may run ahead of the model.
    pub queue_frames: usize,
    /// What a full queue does with a new frame.
    pub on_overload: OverloadPolicy,
    /// FFmpeg decoder threads (0 = FFmpeg's choice).
    pub decoder_threads: usize,
    /// Stop after this many frames (`None` = the whole file).
    pub max_frames: Option<u64>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            queue_frames: 8,
            on_overload: OverloadPolicy::Block,
            decoder_threads: 1,
            max_frames: None,
        }
    }
}

/// What the decoder thread reports when it is done.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeSummary {
    /// Frames decoded.
    pub decoded: u64,
    /// Seconds spent decoding, in all.
    pub decode_s: f64,
    /// Seconds spent converting, in all.
    pub convert_s: f64,
    /// Frame-size changes met mid-stream (each rescaled to the same input).
    pub size_changes: u64,
    /// Why the stream ended early or which packets were damaged, if any.
    pub damage: Option<String>,
}

/// A running decoder: its frames, and its summary once the frames run out.
pub struct DecodedVideo {
    /// What the file holds.
    pub info: VideoInfo,
    frames: FrameReceiver<PreparedFrame>,
    worker: Option<JoinHandle<Result<DecodeSummary>>>,
}

impl DecodedVideo {
    /// Opens `path` and starts decoding it into `spec`'s input on a thread of its own; the
    /// file's errors (missing, not a video, no decoder for its codec) come back here.
    pub fn start(path: &Path, spec: Preprocess, options: DecodeOptions) -> Result<Self> {
        let (tx, rx) = frame_queue(options.queue_frames, options.on_overload);
        let (info_tx, info_rx) = mpsc::channel::<Result<VideoInfo>>();
        let path: PathBuf = path.to_path_buf();
        let worker = std::thread::Builder::new()
            .name("kiln-video-decode".into())
            .spawn(move || -> Result<DecodeSummary> {
                let opened = VideoReader::open(&path, options.decoder_threads)
                    .and_then(|r| Converter::new(spec).map(|c| (r, c)));
                let (mut reader, mut converter) = match opened {
                    Ok(v) => v,
                    Err(e) => {
                        let message = e.to_string();
                        let _ = info_tx.send(Err(e));
                        return Err(KilnError::Stream(message));
                    }
                };
                let _ = info_tx.send(Ok(reader.info().clone()));
                let mut summary = DecodeSummary::default();
                let mut decoded = frame::Video::empty();
                let mut index = 0u64;
                loop {
                    if options.max_frames.is_some_and(|m| index >= m) {
                        break;
                    }
                    let t = Instant::now();
                    if !reader.next_frame(&mut decoded)? {
                        break;
                    }
                    let decode_s = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let (input, thumb) = converter.convert(&decoded)?;
                    let convert_s = t.elapsed().as_secs_f64();
                    summary.decode_s += decode_s;
                    summary.convert_s += convert_s;
                    let prepared = PreparedFrame {
                        index,
                        input,
                        thumb,
                        decode_s,
                        convert_s,
                        ready: Instant::now(),
                    };
                    index += 1;
                    if !tx.push(prepared) {
                        break;
                    }
                }
                summary.decoded = reader.decoded();
                summary.size_changes = converter.size_changes();
                summary.damage = reader.damage();
                if let Some(d) = &summary.damage {
                    tracing::warn!(file = %path.display(), "{d}");
                }
                Ok(summary)
            })
            .map_err(|e| KilnError::Stream(format!("cannot start the decoder thread: {e}")))?;
        let info = match info_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = worker.join();
                return Err(e);
            }
            Err(_) => {
                let outcome = worker.join();
                return Err(KilnError::Stream(format!(
                    "the decoder thread stopped before opening the file: {}",
                    match outcome {
                        Ok(Err(e)) => e.to_string(),
                        _ => "it panicked".into(),
                    }
                )));
            }
        };
        Ok(DecodedVideo {
            info,
            frames: rx,
            worker: Some(worker),
        })
    }

    /// The next frame; `None` when the stream ended (then call [`DecodedVideo::finish`]).
    pub fn next(&self) -> Option<PreparedFrame> {
        self.frames.pop()
    }

    /// Frames dropped by the overload policy so far.
    pub fn dropped(&self) -> u64 {
        self.frames.dropped()
    }

    /// Waits for the decoder thread and returns its summary, or the error that stopped it
    /// (a decoding error before any frame, a conversion failure).
    pub fn finish(mut self) -> Result<DecodeSummary> {
        let worker = self.worker.take();
        // Dropping the receiver tells a producer still running to stop.
        drop(self.frames);
        let summary = match worker.map(JoinHandle::join) {
            Some(Ok(r)) => r?,
            Some(Err(_)) => return Err(KilnError::Stream("the decoder thread panicked".into())),
            None => DecodeSummary::default(),
        };
        Ok(summary)
    }
}
