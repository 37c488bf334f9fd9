//! Real video files (the `video` feature): test clips encoded here with H.264, H.265 and VP9
//! decode to every frame; the techniques around a per-frame model agree with the full model;
//! the decoder's queue drops by policy; bad files are errors naming them, or their frames up
//! to the damage.
//!
//! `cargo test -p kiln --features video --test video`

use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln::onnx::OnnxModel;
use kiln::stream::Frame;
use kiln::stream::{
    FrameModel, FrameResult, GateConfig, OnnxFrameModel, OutputKind, OverloadPolicy, RegionConfig,
    VideoTechniques,
};
use kiln::video::{
    ClipSpec, Codec, DecodeOptions, Fit, Preprocess, Scene, Scoring, VideoReader, run_video,
    write_clip,
};

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-video-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn clip(name: &str, spec: &ClipSpec) -> PathBuf {
    let p = dir().join(name);
    if !p.exists() {
        // Tests run in parallel and share clips: write aside, then rename into place, so no
        // test reads a clip another is still writing.
        let ext = p.extension().unwrap().to_string_lossy().into_owned();
        let tmp = dir().join(
            format!("{name}.{:?}.{ext}", std::thread::current().id()).replace(['(', ')'], ""),
        );
        write_clip(&tmp, spec).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }
    p
}

fn small(scene: Scene, frames: usize) -> ClipSpec {
    ClipSpec {
        frames,
        ..ClipSpec::new(scene, 320, 192, 1.0)
    }
}

fn count_frames(path: &Path) -> (u64, Option<String>) {
    let mut r = VideoReader::open(path, 1).unwrap();
    let mut f = ffmpeg_frame();
    while r.next_frame(&mut f).unwrap() {}
    (r.decoded(), r.damage())
}

fn ffmpeg_frame() -> kiln::video::reader::Frame {
    kiln::video::reader::Frame::empty()
}

/// A per-frame "segmenter" that marks pixels brighter than the background: exact, so any
/// difference between a technique's result and the full run is the technique's.
struct Bright;

impl FrameModel for Bright {
    fn kind(&self) -> OutputKind {
        OutputKind::Mask
    }
    fn channels(&self) -> usize {
        3
    }
    fn fixed_size(&self) -> Option<(usize, usize)> {
        None
    }
    fn run(&self, frames: &[&Frame], confidence: bool) -> kiln::Result<Vec<FrameResult>> {
        Ok(frames
            .iter()
            .map(|f| {
                let [_, h, w] = f.shape();
                let red = &f.pixels()[..h * w];
                FrameResult::Mask {
                    height: h,
                    width: w,
                    labels: red.iter().map(|&v| u16::from(v > 1.2)).collect(),
                    confidence: if confidence {
                        vec![1.0; h * w]
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect())
    }
}

#[test]
fn clips_in_three_codecs_decode_to_every_frame() {
    for (name, codec) in [
        ("a.mp4", Codec::H264),
        ("a.mkv", Codec::H265),
        ("a.webm", Codec::Vp9),
    ] {
        let spec = ClipSpec {
            codec,
            ..small(Scene::Static, 24)
        };
        let p = clip(name, &spec);
        let r = VideoReader::open(&p, 1).unwrap();
        let info = r.info().clone();
        assert_eq!((info.width, info.height), (320, 192), "{name}");
        let (decoded, damage) = count_frames(&p);
        assert_eq!(decoded, 24, "{name} ({})", info.codec);
        assert_eq!(damage, None, "{name}");
    }
}

#[test]
fn the_converted_input_shows_the_objects_where_the_generator_put_them() {
    let spec = small(Scene::Static, 10);
    let p = dir().join("truth.mp4");
    let truth = write_clip(&p, &spec).unwrap();
    let pre = Preprocess::imagenet(320, 192);
    let (run, results) = run_video(
        &p,
        &pre,
        &DecodeOptions::default(),
        Some(&LumaMean),
        &VideoTechniques::default(),
        Scoring::default(),
        true,
    )
    .unwrap();
    assert_eq!(run.frames, 10);
    // Objects are bright (luma ≥ 180) on a darker background (≤ 150): the mean luma inside
    // each true box is well above the frame's.
    for (r, boxes) in results.iter().zip(&truth.boxes) {
        let FrameResult::Image { values, shape } = r else {
            panic!()
        };
        let w = shape[2];
        let frame_mean: f32 = values.iter().sum::<f32>() / values.len() as f32;
        for b in boxes {
            let (x0, y0, x1, y1) = (
                b[0] as usize + 2,
                b[1] as usize + 2,
                b[2] as usize - 2,
                b[3] as usize - 2,
            );
            let mut s = 0.0;
            for y in y0..y1 {
                s += values[y * w + x0..y * w + x1].iter().sum::<f32>();
            }
            let inside = s / ((x1 - x0) * (y1 - y0)) as f32;
            assert!(
                inside > frame_mean + 0.1 && inside > 0.65,
                "box {b:?}: {inside} vs {frame_mean}"
            );
        }
    }
}

/// Luma of the model input in 0..1 (undoing ImageNet normalization), as an image result.
struct LumaMean;

impl FrameModel for LumaMean {
    fn kind(&self) -> OutputKind {
        OutputKind::Image
    }
    fn channels(&self) -> usize {
        3
    }
    fn fixed_size(&self) -> Option<(usize, usize)> {
        None
    }
    fn run(&self, frames: &[&Frame], _: bool) -> kiln::Result<Vec<FrameResult>> {
        let (mean, std) = ([0.485f32, 0.456, 0.406], [0.229f32, 0.224, 0.225]);
        Ok(frames
            .iter()
            .map(|f| {
                let [_, h, w] = f.shape();
                let n = h * w;
                let p = f.pixels();
                let values = (0..n)
                    .map(|i| {
                        let c = |k: usize| p[k * n + i] * std[k] + mean[k];
                        0.299 * c(0) + 0.587 * c(1) + 0.114 * c(2)
                    })
                    .collect();
                FrameResult::Image {
                    shape: [1, h, w],
                    values,
                }
            })
            .collect())
    }
}

/// A mask of the bright pixels (luma above the background's brightest): the generator's
/// objects, as a perfect segmenter of its clips sees them.
struct BrightLuma;

impl FrameModel for BrightLuma {
    fn kind(&self) -> OutputKind {
        OutputKind::Mask
    }
    fn channels(&self) -> usize {
        3
    }
    fn fixed_size(&self) -> Option<(usize, usize)> {
        None
    }
    fn run(&self, frames: &[&Frame], confidence: bool) -> kiln::Result<Vec<FrameResult>> {
        Ok(LumaMean
            .run(frames, confidence)?
            .into_iter()
            .map(|r| match r {
                FrameResult::Image { shape, values } => FrameResult::Mask {
                    height: shape[1],
                    width: shape[2],
                    labels: values.iter().map(|&v| u16::from(v > 0.67)).collect(),
                    confidence: Vec::new(),
                },
                other => other,
            })
            .collect())
    }
}

/// A segmenter that sees nothing: background everywhere.
struct Blind;

impl FrameModel for Blind {
    fn kind(&self) -> OutputKind {
        OutputKind::Mask
    }
    fn channels(&self) -> usize {
        3
    }
    fn fixed_size(&self) -> Option<(usize, usize)> {
        None
    }
    fn run(&self, frames: &[&Frame], _: bool) -> kiln::Result<Vec<FrameResult>> {
        Ok(frames
            .iter()
            .map(|f| {
                let [_, h, w] = f.shape();
                FrameResult::Mask {
                    height: h,
                    width: w,
                    labels: vec![0; h * w],
                    confidence: Vec::new(),
                }
            })
            .collect())
    }
}

/// The generator's boxes become true masks of the model input, stretched or letterboxed as
/// the frames are: a segmenter that finds the bright objects scores a mean IoU near 1
/// against them, and one that paints everything background scores far lower.
#[test]
fn a_clip_scores_each_run_against_its_ground_truth() {
    let spec = small(Scene::Static, 12);
    let p = dir().join("scored.mp4");
    let truth = write_clip(&p, &spec).unwrap();
    for fit in [Fit::Stretch, Fit::Letterbox] {
        let mut pre = Preprocess::imagenet(256, 256);
        pre.fit = fit;
        let masks = truth.masks(spec.width, spec.height, &pre);
        assert_eq!(masks.len(), 12);
        let scored = Scoring {
            reference: None,
            truth: Some(&masks),
        };
        let (run, _) = run_video(
            &p,
            &pre,
            &DecodeOptions::default(),
            Some(&BrightLuma),
            &VideoTechniques::default(),
            scored,
            false,
        )
        .unwrap();
        let t = run.truth.unwrap();
        assert_eq!(t.frames, 12);
        // Not 1: an object's chroma can pull a few of its pixels below the threshold.
        assert!(t.score > 0.85, "{fit:?}: {t:?}");
        assert!(run.agreement.is_none());
        // A segmenter that finds nothing scores only the background's IoU, halved.
        let (blind, _) = run_video(
            &p,
            &pre,
            &DecodeOptions::default(),
            Some(&Blind),
            &VideoTechniques::default(),
            scored,
            false,
        )
        .unwrap();
        let b = blind.truth.unwrap();
        assert!(b.score < 0.55, "{fit:?}: {b:?}");
        // The masks hold the boxes' area, scaled into the input.
        let (_, _, pw, ph) = pre.placement(spec.width, spec.height);
        let scale = (pw * ph) as f32 / (spec.width * spec.height) as f32;
        if let FrameResult::Mask { labels, .. } = &masks[0] {
            let ones = labels.iter().filter(|&&l| l == 1).count() as f32;
            let area: f32 = truth.boxes[0]
                .iter()
                .map(|b| (b[2] - b[0]) * (b[3] - b[1]) * scale)
                .sum();
            assert!((ones - area).abs() < 0.1 * area, "{ones} vs {area}");
        }
    }
}

#[test]
fn temporal_coherence_and_regions_agree_with_the_full_model_and_run_less() {
    let p = clip("static.mp4", &small(Scene::Static, 60));
    let pre = Preprocess::imagenet(320, 192);
    let opts = DecodeOptions::default();
    let (full, reference) = run_video(
        &p,
        &pre,
        &opts,
        Some(&Bright),
        &VideoTechniques::default(),
        Scoring::default(),
        true,
    )
    .unwrap();
    assert_eq!(full.frames, 60);
    assert_eq!(full.paths.get("full"), Some(&60));
    let roi = VideoTechniques {
        frame_gate: None,
        regions: Some(RegionConfig {
            threshold: 0.03,
            ..RegionConfig::default()
        }),
        multiscale: None,
    };
    let (run, _) = run_video(
        &p,
        &pre,
        &opts,
        Some(&Bright),
        &roi,
        Scoring::reference(&reference),
        false,
    )
    .unwrap();
    let a = run.agreement.unwrap();
    assert!(
        run.paths.get("partial").copied().unwrap_or(0) > 30,
        "{:?}",
        run.paths
    );
    assert!(
        run.pixel_share < 0.6,
        "ran {:.0}% of the pixels",
        100.0 * run.pixel_share
    );
    // Moving objects leave regions that changed; the model ran on them, so the masks agree.
    assert!(a.score > 0.97 && a.pixel_agreement > 0.995, "{a:?}");
}

#[test]
fn an_onnx_model_runs_per_frame_with_the_gate_on() {
    let model_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/seghead.onnx");
    let device = kiln::burn::tensor::Device::default();
    let model = OnnxFrameModel::new(OnnxModel::load(&model_path, &device).unwrap(), None).unwrap();
    assert_eq!(model.kind(), OutputKind::Mask);
    let (h, w) = model.fixed_size().unwrap();
    let p = clip("static.mp4", &small(Scene::Static, 60));
    let pre = Preprocess::imagenet(w, h);
    let opts = DecodeOptions::default();
    let (full, reference) = run_video(
        &p,
        &pre,
        &opts,
        Some(&model),
        &VideoTechniques::default(),
        Scoring::default(),
        true,
    )
    .unwrap();
    assert_eq!(reference.len(), 60);
    assert!(full.fps > 0.0 && full.p99_ms >= full.p50_ms);
    let gate = VideoTechniques {
        frame_gate: Some(GateConfig {
            threshold: 0.01,
            max_reuse_age: 5,
        }),
        ..VideoTechniques::default()
    };
    let (run, _) = run_video(
        &p,
        &pre,
        &opts,
        Some(&model),
        &gate,
        Scoring::reference(&reference),
        false,
    )
    .unwrap();
    assert_eq!(run.frames, 60);
    assert!(run.agreement.unwrap().frames == 60);
    // Techniques that need crops are refused for a fixed-size model, naming why.
    let roi = VideoTechniques {
        regions: Some(RegionConfig::default()),
        ..VideoTechniques::default()
    };
    let err = run_video(
        &p,
        &pre,
        &opts,
        Some(&model),
        &roi,
        Scoring::default(),
        false,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("dynamic height and width"),
        "{err}"
    );
}

/// A model that takes its time, to overload the queue.
struct Slow;

impl FrameModel for Slow {
    fn kind(&self) -> OutputKind {
        OutputKind::Mask
    }
    fn channels(&self) -> usize {
        3
    }
    fn fixed_size(&self) -> Option<(usize, usize)> {
        None
    }
    fn run(&self, frames: &[&Frame], c: bool) -> kiln::Result<Vec<FrameResult>> {
        std::thread::sleep(Duration::from_millis(15));
        Bright.run(frames, c)
    }
}

#[test]
fn an_overloaded_stream_drops_the_oldest_frames_and_counts_them() {
    let p = clip("static.mp4", &small(Scene::Static, 60));
    let pre = Preprocess::imagenet(320, 192);
    let opts = DecodeOptions {
        queue_frames: 2,
        on_overload: OverloadPolicy::DropOldest,
        ..DecodeOptions::default()
    };
    let (run, _) = run_video(
        &p,
        &pre,
        &opts,
        Some(&Slow),
        &VideoTechniques::default(),
        Scoring::default(),
        false,
    )
    .unwrap();
    assert!(run.dropped > 0, "{run:?}");
    assert_eq!(run.frames + run.dropped, 60);
    let block = DecodeOptions {
        queue_frames: 2,
        ..DecodeOptions::default()
    };
    let (run, _) = run_video(
        &p,
        &pre,
        &block,
        Some(&Slow),
        &VideoTechniques::default(),
        Scoring::default(),
        false,
    )
    .unwrap();
    assert_eq!((run.frames, run.dropped), (60, 0));
}

#[test]
fn bad_files_are_errors_naming_the_file_or_their_frames_up_to_the_damage() {
    let d = dir();
    // Missing, and not a video.
    let err = VideoReader::open(&d.join("missing.mp4"), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("missing.mp4") && err.contains("no such file"),
        "{err}"
    );
    let text = d.join("notes.mp4");
    std::fs::write(&text, "these are not frames\n".repeat(50)).unwrap();
    let err = VideoReader::open(&text, 1).err().unwrap().to_string();
    assert!(
        err.contains("notes.mp4") && err.contains("not a video"),
        "{err}"
    );
    // Truncated: the frames before the cut come out, and the damage is reported.
    let whole = clip("static.mp4", &small(Scene::Static, 60));
    let bytes = std::fs::read(&whole).unwrap();
    let cut = d.join("cut.mp4");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (decoded, damage) = count_frames(&cut);
    assert!(decoded > 0 && decoded < 60, "{decoded}");
    assert!(damage.unwrap().contains("truncated"));
    // Only the header survives: an error, not an empty stream.
    let stub = d.join("stub.mp4");
    std::fs::write(&stub, &bytes[..bytes.len().min(2000)]).unwrap();
    let mut f = ffmpeg_frame();
    let outcome = VideoReader::open(&stub, 1).and_then(|mut r| r.next_frame(&mut f));
    let err = outcome
        .expect_err("a header-only file has no frame")
        .to_string();
    assert!(err.contains("stub.mp4"), "{err}");
    // An unsupported codec: the sample entry's fourcc renamed to one no decoder knows.
    let mut renamed = bytes.clone();
    let stsd = renamed
        .windows(4)
        .position(|w| w == b"stsd")
        .expect("a sample table");
    let at = stsd
        + renamed[stsd..]
            .windows(4)
            .position(|w| w == b"avc1")
            .expect("an avc1 entry");
    renamed[at..at + 4].copy_from_slice(b"zzzz");
    let odd = d.join("odd.mp4");
    std::fs::write(&odd, &renamed).unwrap();
    let err = VideoReader::open(&odd, 1).err().unwrap().to_string();
    assert!(
        err.contains("odd.mp4") && err.contains("unsupported codec"),
        "{err}"
    );
}

#[test]
fn a_frame_size_change_mid_stream_is_rescaled_to_the_same_input() {
    let d = dir();
    let a = d.join("part_a.h264");
    let b = d.join("part_b.h264");
    write_clip(&a, &small(Scene::Static, 12)).unwrap();
    write_clip(
        &b,
        &ClipSpec {
            frames: 12,
            ..ClipSpec::new(Scene::Pan, 256, 144, 1.0)
        },
    )
    .unwrap();
    let both = d.join("both.h264");
    let mut bytes = std::fs::read(&a).unwrap();
    bytes.extend(std::fs::read(&b).unwrap());
    std::fs::write(&both, bytes).unwrap();
    let pre = Preprocess::imagenet(160, 96);
    let (run, _) = run_video(
        &both,
        &pre,
        &DecodeOptions::default(),
        Some(&Bright),
        &VideoTechniques::default(),
        Scoring::default(),
        false,
    )
    .unwrap();
    assert_eq!(run.frames, 24);
    assert_eq!(run.size_changes, 1);
}
