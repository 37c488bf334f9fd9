//! Test videos made here: deterministic scenes encoded with the system FFmpeg's encoders
//! (libx264, libx265, libvpx-vp9), with their ground truth known from the generator. A static
//! textured background with sensor noise on every frame and a few moving objects (a fixed
//! camera), a camera pan (the background moves), and a scene cut (new background and objects
//! half-way). Each object's box in every frame is returned.

use std::path::Path;

use ffmpeg::{Dictionary, Packet, Rational, codec, encoder, format, frame};
use ffmpeg_next as ffmpeg;
use serde::{Deserialize, Serialize};

use super::convert::Preprocess;
use super::reader::{init, video_error};
use crate::error::Result;
use crate::names::config_names;
use crate::stream::FrameResult;

/// What the camera sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scene {
    /// A fixed camera: static background, sensor noise, moving objects.
    Static,
    /// The camera pans: the background moves left by a few pixels per frame.
    Pan,
    /// A fixed camera with a cut to another scene half-way.
    Cut,
}

config_names!(Scene {
    Static => "static",
    Pan => "pan",
    Cut => "cut",
});

/// The codec a test video is encoded with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Codec {
    /// H.264 (libx264).
    H264,
    /// H.265 (libx265).
    H265,
    /// VP9 (libvpx-vp9).
    Vp9,
}

config_names!(Codec {
    H264 => "h264",
    H265 => "h265",
    Vp9 => "vp9",
});

/// A test video to generate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipSpec {
    /// The scene.
    pub scene: Scene,
    /// Width in pixels (even).
    pub width: usize,
    /// Height in pixels (even).
    pub height: usize,
    /// Frames.
    pub frames: usize,
    /// Frames per second.
    pub fps: u32,
    /// Moving objects.
    pub objects: usize,
    /// Seed of everything random.
    pub seed: u64,
    /// The codec.
    pub codec: Codec,
    /// Standard deviation of the sensor noise, in luma levels.
    pub noise: f32,
}

impl ClipSpec {
    /// A `scene` at `width × height`, `seconds` long at 30 frames/s, H.264, 3 objects.
    pub fn new(scene: Scene, width: usize, height: usize, seconds: f32) -> Self {
        ClipSpec {
            scene,
            width,
            height,
            frames: (seconds * 30.0).round().max(1.0) as usize,
            fps: 30,
            objects: 3,
            seed: 7,
            codec: Codec::H264,
            noise: 2.0,
        }
    }
}

/// The generator's ground truth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipTruth {
    /// Each object's box `[x1, y1, x2, y2]` in frame pixels, per frame.
    pub boxes: Vec<Vec<[f32; 4]>>,
    /// Frames that start a new scene (0 included).
    pub cuts: Vec<usize>,
}

impl ClipTruth {
    /// Each frame's true mask in the model input that `spec` makes of `frame_w × frame_h`
    /// frames: class 1 on the pixels whose centre lies inside an object's box, 0 elsewhere
    /// (the letterbox padding included) — the background / object classes that
    /// `tools/export_video_models.py` trains a segmenter on.
    pub fn masks(&self, frame_w: usize, frame_h: usize, spec: &Preprocess) -> Vec<FrameResult> {
        let (px, py, pw, ph) = spec.placement(frame_w.max(1), frame_h.max(1));
        let (sx, sy) = (
            frame_w as f32 / pw.max(1) as f32,
            frame_h as f32 / ph.max(1) as f32,
        );
        self.boxes
            .iter()
            .map(|boxes| {
                let mut labels = vec![0u16; spec.width * spec.height];
                for b in boxes {
                    // Input pixel i's centre sits at frame x = (i + 0.5 - px) · sx.
                    let span = |lo: f32, hi: f32, at: usize, scale: f32, len: usize| {
                        let first = (lo / scale + at as f32 - 0.5).ceil().max(0.0) as usize;
                        let end = (hi / scale + at as f32 - 0.5).ceil().max(0.0) as usize;
                        first.min(len)..end.min(len)
                    };
                    let xs = span(b[0], b[2], px, sx, (px + pw).min(spec.width));
                    for y in span(b[1], b[3], py, sy, (py + ph).min(spec.height)) {
                        labels[y * spec.width + xs.start..y * spec.width + xs.end].fill(1);
                    }
                }
                FrameResult::Mask {
                    height: spec.height,
                    width: spec.width,
                    labels,
                    confidence: Vec::new(),
                }
            })
            .collect()
    }
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

struct Object {
    x: f32,
    y: f32,
    vx: f32,
    vy: f32,
    w: usize,
    h: usize,
    yuv: [u8; 3],
}

/// One scene's background (luma and chroma planes, `pad` columns wider for a pan) and objects.
struct Setting {
    luma: Vec<u8>,
    u: u8,
    v: u8,
    stride: usize,
    objects: Vec<Object>,
}

fn setting(spec: &ClipSpec, rng: &mut Rng, pad: usize) -> Setting {
    let (w, h) = (spec.width + pad, spec.height);
    let (fx, fy, phase) = (
        40.0 + 80.0 * rng.unit(),
        30.0 + 60.0 * rng.unit(),
        std::f32::consts::TAU * rng.unit(),
    );
    let base = 70.0 + 40.0 * rng.unit();
    let mut luma = vec![0u8; w * h];
    for y in 0..h {
        for x in 0..w {
            let (xf, yf) = (x as f32, y as f32);
            let t = (xf / fx + phase).sin() * (yf / fy).cos() + 0.5 * ((xf + yf) / 23.0).sin();
            luma[y * w + x] = (base + 35.0 * t).clamp(16.0, 235.0) as u8;
        }
    }
    let side = spec.width.min(spec.height) as f32;
    let objects = (0..spec.objects)
        .map(|_| {
            let ow = ((0.08 + 0.1 * rng.unit()) * side) as usize + 4;
            let oh = ((0.08 + 0.1 * rng.unit()) * side) as usize + 4;
            let speed = side / 180.0;
            Object {
                x: rng.unit() * (spec.width - ow) as f32,
                y: rng.unit() * (spec.height - oh) as f32,
                vx: speed * (rng.unit() * 2.0 - 1.0),
                vy: speed * (rng.unit() * 2.0 - 1.0),
                w: ow,
                h: oh,
                yuv: [
                    (180.0 + 50.0 * rng.unit()) as u8,
                    (40.0 + 170.0 * rng.unit()) as u8,
                    (40.0 + 170.0 * rng.unit()) as u8,
                ],
            }
        })
        .collect();
    Setting {
        luma,
        u: (112.0 + 32.0 * rng.unit()) as u8,
        v: (112.0 + 32.0 * rng.unit()) as u8,
        stride: w,
        objects,
    }
}

/// Writes `spec`'s video to `path` (the container follows the extension: `.mp4`, `.mkv`,
/// `.webm`, `.ts`, `.h264`) and returns its ground truth.
pub fn write_clip(path: &Path, spec: &ClipSpec) -> Result<ClipTruth> {
    init()?;
    let err = |what: &str, e: ffmpeg::Error| video_error(path, format!("{what}: {e}"));
    if spec.width < 16 || spec.height < 16 || spec.width % 2 == 1 || spec.height % 2 == 1 {
        return Err(video_error(
            path,
            "test videos need even sides of at least 16 pixels",
        ));
    }
    let mut octx = format::output(path).map_err(|e| err("creating the file", e))?;
    let (name, options): (&str, &[(&str, &str)]) = match spec.codec {
        Codec::H264 => ("libx264", &[("preset", "veryfast"), ("crf", "23")]),
        Codec::H265 => (
            "libx265",
            &[
                ("preset", "ultrafast"),
                ("crf", "28"),
                ("x265-params", "log-level=error"),
            ],
        ),
        Codec::Vp9 => (
            "libvpx-vp9",
            &[
                ("deadline", "realtime"),
                ("cpu-used", "8"),
                ("crf", "35"),
                ("b", "0"),
            ],
        ),
    };
    let codec = encoder::find_by_name(name)
        .ok_or_else(|| video_error(path, format!("this FFmpeg has no {name} encoder")))?;
    let global_header = octx.format().flags().contains(format::Flags::GLOBAL_HEADER);
    let mut ost = octx
        .add_stream(codec)
        .map_err(|e| err("adding the stream", e))?;
    let mut enc = codec::context::Context::new_with_codec(codec)
        .encoder()
        .video()
        .map_err(|e| err("creating the encoder", e))?;
    let time_base = Rational(1, spec.fps as i32);
    enc.set_width(spec.width as u32);
    enc.set_height(spec.height as u32);
    enc.set_format(format::Pixel::YUV420P);
    enc.set_time_base(time_base);
    enc.set_frame_rate(Some(Rational(spec.fps as i32, 1)));
    enc.set_gop(60);
    if global_header {
        enc.set_flags(codec::Flags::GLOBAL_HEADER);
    }
    let mut dict = Dictionary::new();
    for (k, v) in options {
        dict.set(k, v);
    }
    let mut enc = enc
        .open_with(dict)
        .map_err(|e| err("opening the encoder", e))?;
    ost.set_parameters(&enc);
    ost.set_time_base(time_base);
    let mut mux = Dictionary::new();
    mux.set("movflags", "+faststart");
    octx.write_header_with(mux)
        .map_err(|e| err("writing the header", e))?;
    let ost_time_base = octx.stream(0).map(|s| s.time_base()).unwrap_or(time_base);

    let mut rng = Rng(spec.seed);
    let pan = if spec.scene == Scene::Pan { 4usize } else { 0 };
    let pad = pan * spec.frames;
    let mut scene = setting(spec, &mut rng, pad);
    let mut truth = ClipTruth {
        boxes: Vec::with_capacity(spec.frames),
        cuts: vec![0],
    };
    let mut yuv = frame::Video::new(
        format::Pixel::YUV420P,
        spec.width as u32,
        spec.height as u32,
    );
    let mut packet = Packet::empty();
    let (w, h) = (spec.width, spec.height);
    for i in 0..spec.frames {
        if spec.scene == Scene::Cut && i == spec.frames / 2 && i > 0 {
            scene = setting(spec, &mut rng, pad);
            truth.cuts.push(i);
        }
        let offset = pan * i;
        // Luma: background (shifted for a pan), objects, then sensor noise.
        {
            let stride = yuv.stride(0);
            let plane = yuv.data_mut(0);
            for y in 0..h {
                let src = &scene.luma[y * scene.stride + offset..y * scene.stride + offset + w];
                plane[y * stride..y * stride + w].copy_from_slice(src);
            }
            for o in &scene.objects {
                let (x0, y0) = (o.x as usize, o.y as usize);
                for y in y0..(y0 + o.h).min(h) {
                    plane[y * stride + x0..y * stride + (x0 + o.w).min(w)].fill(o.yuv[0]);
                }
            }
            if spec.noise > 0.0 {
                for y in 0..h {
                    for p in &mut plane[y * stride..y * stride + w] {
                        // A sum of two uniforms: roughly Gaussian, cheap.
                        let r = rng.next();
                        let n = ((r & 0xff) as f32 + ((r >> 8) & 0xff) as f32 - 255.0) / 255.0;
                        *p = (f32::from(*p) + n * spec.noise * 1.7).clamp(0.0, 255.0) as u8;
                    }
                }
            }
        }
        for (c, fill) in [(1usize, scene.u), (2, scene.v)] {
            let stride = yuv.stride(c);
            let plane = yuv.data_mut(c);
            for y in 0..h / 2 {
                plane[y * stride..y * stride + w / 2].fill(fill);
            }
            for o in &scene.objects {
                let (x0, y0) = (o.x as usize / 2, o.y as usize / 2);
                for y in y0..(y0 + o.h / 2).min(h / 2) {
                    plane[y * stride + x0..y * stride + (x0 + o.w / 2).min(w / 2)].fill(o.yuv[c]);
                }
            }
        }
        truth.boxes.push(
            scene
                .objects
                .iter()
                .map(|o| {
                    let (x0, y0) = (o.x.floor(), o.y.floor());
                    [
                        x0,
                        y0,
                        (x0 + o.w as f32).min(w as f32),
                        (y0 + o.h as f32).min(h as f32),
                    ]
                })
                .collect(),
        );
        for o in &mut scene.objects {
            o.x += o.vx;
            o.y += o.vy;
            if o.x < 0.0 || o.x + o.w as f32 > w as f32 {
                o.vx = -o.vx;
                o.x = o.x.clamp(0.0, (w - o.w) as f32);
            }
            if o.y < 0.0 || o.y + o.h as f32 > h as f32 {
                o.vy = -o.vy;
                o.y = o.y.clamp(0.0, (h - o.h) as f32);
            }
        }
        yuv.set_pts(Some(i as i64));
        enc.send_frame(&yuv).map_err(|e| err("encoding", e))?;
        drain(&mut enc, &mut packet, &mut octx, time_base, ost_time_base)
            .map_err(|e| err("writing", e))?;
    }
    enc.send_eof().map_err(|e| err("flushing the encoder", e))?;
    drain(&mut enc, &mut packet, &mut octx, time_base, ost_time_base)
        .map_err(|e| err("writing", e))?;
    octx.write_trailer()
        .map_err(|e| err("writing the trailer", e))?;
    Ok(truth)
}

fn drain(
    enc: &mut encoder::Video,
    packet: &mut Packet,
    octx: &mut format::context::Output,
    from: Rational,
    to: Rational,
) -> std::result::Result<(), ffmpeg::Error> {
    while enc.receive_packet(packet).is_ok() {
        packet.set_stream(0);
        // One frame long: without a duration the MP4 muxer's edit list cuts the last frame.
        packet.set_duration(1);
        packet.rescale_ts(from, to);
        packet.write_interleaved(octx)?;
    }
    Ok(())
}
