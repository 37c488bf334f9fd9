//! Demuxing and decoding a video file with FFmpeg's libraries (libavformat, libavcodec): any
//! container and codec the system's FFmpeg has (MP4, MKV, WebM, MPEG-TS; H.264, H.265, VP9,
//! AV1, ...). Frames come out in the decoder's own pixel format (YUV, usually);
//! [`super::convert`] turns them into the model's input.

use std::path::{Path, PathBuf};

use ffmpeg::{codec, decoder, format, frame, media};
use ffmpeg_next as ffmpeg;
use serde::Serialize;

use crate::error::{KilnError, Result};

/// A decoded frame in the decoder's pixel format (FFmpeg's `AVFrame`), reused across calls.
pub type Frame = frame::Video;

/// What a video file holds, read when it is opened.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VideoInfo {
    /// The file.
    pub path: PathBuf,
    /// The container (`mov,mp4,m4a,3gp,3g2,mj2`, `matroska,webm`, ...).
    pub container: String,
    /// The codec (`h264`, `hevc`, `vp9`, `av1`, ...).
    pub codec: String,
    /// Coded width of the first frames.
    pub width: u32,
    /// Coded height of the first frames.
    pub height: u32,
    /// Frames per second as the container states it (0 when unknown).
    pub fps: f64,
    /// Frames the container says it holds (`None` when it does not say).
    pub frames: Option<u64>,
}

/// An error about `path`: the file, and what is wrong with it.
pub(crate) fn video_error(path: &Path, problem: impl Into<String>) -> KilnError {
    KilnError::Video {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Initializes FFmpeg once, quietly (its own log would print to stderr for every damaged
/// packet; Kiln reports damage itself).
pub(crate) fn init() -> Result<()> {
    static INIT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        ffmpeg::init().map_err(|e| e.to_string())?;
        ffmpeg::util::log::set_level(ffmpeg::util::log::Level::Fatal);
        Ok(())
    })
    .clone()
    .map_err(|e| KilnError::Stream(format!("FFmpeg failed to initialize: {e}")))
}

/// A video file being decoded, frame by frame, in presentation order.
pub struct VideoReader {
    info: VideoInfo,
    input: format::context::Input,
    stream: usize,
    decoder: decoder::Video,
    /// End of input reached and the decoder told so.
    flushed: bool,
    done: bool,
    decoded: u64,
    /// Packets the decoder refused (damaged data), skipped.
    bad_packets: u64,
    /// Why the stream ended early, if it did (a read error, damaged data).
    damage: Option<String>,
}

impl VideoReader {
    /// Opens `path` and its best video stream, decoding on `threads` threads (0 = FFmpeg's
    /// choice). Errors name the file and the reason: missing or unreadable, not a video, no
    /// video stream, a codec this FFmpeg cannot decode.
    pub fn open(path: &Path, threads: usize) -> Result<Self> {
        init()?;
        if !path.exists() {
            return Err(video_error(path, "no such file"));
        }
        let input = format::input(path).map_err(|e| {
            video_error(
                path,
                format!(
                    "not a video FFmpeg can read ({e}); give an MP4, MKV, WebM or MPEG-TS file"
                ),
            )
        })?;
        let container = input.format().name().to_string();
        let stream = input.streams().best(media::Type::Video).ok_or_else(|| {
            video_error(path, format!("the {container} file has no video stream"))
        })?;
        let index = stream.index();
        let params = stream.parameters();
        let id = params.id();
        if id == codec::Id::None {
            return Err(video_error(
                path,
                "its video stream's codec is unknown to FFmpeg (unsupported codec)",
            ));
        }
        if decoder::find(id).is_none() {
            return Err(video_error(
                path,
                format!(
                    "this FFmpeg build has no decoder for its {id:?} video (unsupported codec); \
                     install an FFmpeg with it, or transcode the file to H.264"
                ),
            ));
        }
        let mut ctx = codec::context::Context::from_parameters(params)
            .map_err(|e| video_error(path, format!("reading the codec parameters: {e}")))?;
        let mut threading = codec::threading::Config::count(threads);
        threading.kind = codec::threading::Type::Frame;
        ctx.set_threading(threading);
        let decoder = ctx
            .decoder()
            .video()
            .map_err(|e| video_error(path, format!("opening the {id:?} decoder: {e}")))?;
        let rate = stream.avg_frame_rate();
        let fps = if rate.denominator() != 0 {
            f64::from(rate.numerator()) / f64::from(rate.denominator())
        } else {
            0.0
        };
        let frames = u64::try_from(stream.frames()).ok().filter(|&n| n > 0);
        let codec = decoder
            .codec()
            .map(|c| c.name().to_string())
            .unwrap_or_else(|| format!("{id:?}").to_lowercase());
        let info = VideoInfo {
            path: path.to_path_buf(),
            container,
            codec,
            width: decoder.width(),
            height: decoder.height(),
            fps,
            frames,
        };
        if info.width == 0 || info.height == 0 {
            return Err(video_error(path, "its video stream states no frame size"));
        }
        Ok(VideoReader {
            info,
            input,
            stream: index,
            decoder,
            flushed: false,
            done: false,
            decoded: 0,
            bad_packets: 0,
            damage: None,
        })
    }

    /// What the file holds.
    pub fn info(&self) -> &VideoInfo {
        &self.info
    }

    /// Frames decoded so far.
    pub fn decoded(&self) -> u64 {
        self.decoded
    }

    /// Why the stream ended before its stated end, or which of its packets were damaged;
    /// `None` for a clean file.
    pub fn damage(&self) -> Option<String> {
        let short = match self.info.frames {
            Some(n) if self.done && self.decoded < n => Some(format!(
                "truncated: {} of the {n} frames the container states could be decoded",
                self.decoded
            )),
            _ => None,
        };
        let bad =
            (self.bad_packets > 0).then(|| format!("{} damaged packets skipped", self.bad_packets));
        let parts: Vec<String> = [self.damage.clone(), short, bad]
            .into_iter()
            .flatten()
            .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// Decodes the next frame into `frame`; `false` at the end of the stream. A read error
    /// or damaged data after some frames ends the stream there (frames up to the damage are
    /// kept; [`VideoReader::damage`] says why); before any frame it is an error.
    pub fn next_frame(&mut self, frame: &mut frame::Video) -> Result<bool> {
        loop {
            if self.done {
                return Ok(false);
            }
            match self.decoder.receive_frame(frame) {
                Ok(()) => {
                    self.decoded += 1;
                    return Ok(true);
                }
                Err(ffmpeg::Error::Eof) => {
                    self.done = true;
                    return self.end_check();
                }
                Err(ffmpeg::Error::Other { errno }) if errno == ffmpeg::util::error::EAGAIN => {}
                Err(e) => {
                    self.damage = Some(format!("decoding stopped at frame {}: {e}", self.decoded));
                    self.done = true;
                    return self.end_check();
                }
            }
            if self.flushed {
                // The decoder has been told the input ended; it said "again" with nothing
                // queued, which only a broken decoder does.
                self.done = true;
                return self.end_check();
            }
            self.feed()?;
        }
    }

    /// Sends the next packet of the video stream to the decoder (or the end of input).
    fn feed(&mut self) -> Result<()> {
        let mut packet = ffmpeg::Packet::empty();
        loop {
            match packet.read(&mut self.input) {
                Ok(()) if packet.stream() == self.stream => {
                    if self.decoder.send_packet(&packet).is_err() {
                        // Damaged data: skip the packet, as players do.
                        self.bad_packets += 1;
                        continue;
                    }
                    return Ok(());
                }
                Ok(()) => continue,
                Err(ffmpeg::Error::Eof) => break,
                Err(e) => {
                    self.damage =
                        Some(format!("reading stopped after frame {}: {e}", self.decoded));
                    break;
                }
            }
        }
        self.flushed = true;
        // Errors here mean the decoder was already flushed; receive_frame says Eof next.
        let _ = self.decoder.send_eof();
        Ok(())
    }

    fn end_check(&self) -> Result<bool> {
        if self.decoded == 0 {
            return Err(video_error(
                &self.info.path,
                format!(
                    "no frame could be decoded from its {} stream{}",
                    self.info.codec,
                    self.damage().map(|d| format!(" ({d})")).unwrap_or_default()
                ),
            ));
        }
        Ok(false)
    }
}
