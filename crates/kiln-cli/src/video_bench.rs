//! `kiln bench --mode stream --video FILE --onnx MODEL`: a per-frame model on a real video
//! file, each technique on and off, in one run beside the usual Python loop (PyAV decoding +
//! ONNX Runtime on every frame, `bench/peers/video_peer.py`): decode, preprocess, inference
//! and end-to-end frames per second, per-frame latency p50 / p99, the share of pixels the
//! model ran on, and agreement with the full model on every frame (mean IoU for masks, top-1
//! agreement for classes, box F1 for detections).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use kiln::onnx::OnnxModel;
use kiln::stream::{
    FrameModel, FrameResult, GateConfig, OnnxFrameModel, OutputKind, OverloadPolicy, RegionConfig,
    ScaleConfig, VideoTechniques,
};
use kiln::video::{DecodeOptions, Fit, Preprocess, VideoRun, run_video};
use serde::Serialize;

/// What to measure.
pub struct VideoBench<'a> {
    pub video: &'a Path,
    pub model: &'a Path,
    pub threads: usize,
    /// Model input `(width, height)`.
    pub size: (usize, usize),
    pub fit: Fit,
    pub output: Option<OutputKind>,
    pub on_overload: OverloadPolicy,
    pub max_frames: Option<u64>,
    pub json: bool,
    /// Overrides of the technique settings (the defaults below otherwise).
    pub gate_threshold: Option<f32>,
    pub region_threshold: Option<f32>,
    pub region_margin: Option<usize>,
    pub region_max_age: Option<u32>,
}

#[derive(Serialize)]
struct Row<'a> {
    #[serde(flatten)]
    run: &'a VideoRun,
    threads: usize,
    vs_peer: Option<f64>,
}

/// The peer's figures (one JSON line of `video_peer.py`).
#[derive(Debug, Clone, serde::Deserialize, Serialize)]
struct Peer {
    frames: u64,
    fps: f64,
    decode_fps: f64,
    preprocess_fps: f64,
    inference_fps: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// The configurations measured: each technique alone, then mixed. Settings (BENCHMARKS.md run
/// 56 measured the first tries): the frame gate at 0.0015 mean absolute luma difference (in
/// 0..1) of the whole thumbnail, which a still camera's encoded noise stays under; at 0.004 it
/// also let small moving objects through, 6 points of mean IoU lost. Regions are 16-pixel
/// tiles (4 thumbnail pixels) at 0.01 with a 32-pixel context, aligned to a stride-32
/// backbone; at 0.03 an object creeping a pixel a frame lagged, 2.4 points lost.
fn configurations(model: &dyn FrameModel, b: &VideoBench) -> Vec<VideoTechniques> {
    let gate = GateConfig {
        threshold: b.gate_threshold.unwrap_or(0.0015),
        max_reuse_age: 30,
    };
    let defaults = RegionConfig::default();
    let margin = b.region_margin.unwrap_or(defaults.margin).max(1);
    let regions = RegionConfig {
        threshold: b.region_threshold.unwrap_or(0.01),
        margin,
        align: margin,
        max_reuse_age: b.region_max_age.unwrap_or(defaults.max_reuse_age),
        ..defaults
    };
    let scale = ScaleConfig {
        factor: 2,
        confidence: 0.9,
    };
    let mut out = vec![
        VideoTechniques::default(),
        VideoTechniques {
            frame_gate: Some(gate),
            ..VideoTechniques::default()
        },
    ];
    let any_size = model.fixed_size().is_none();
    if any_size && !matches!(model.kind(), OutputKind::Classes) {
        out.push(VideoTechniques {
            regions: Some(regions),
            ..VideoTechniques::default()
        });
        out.push(VideoTechniques {
            frame_gate: Some(gate),
            regions: Some(regions),
            multiscale: None,
        });
    }
    if any_size && matches!(model.kind(), OutputKind::Mask | OutputKind::Classes) {
        out.push(VideoTechniques {
            multiscale: Some(scale),
            ..VideoTechniques::default()
        });
    }
    out
}

pub fn run(b: &VideoBench) -> Result<()> {
    let device = kiln::burn::tensor::Device::default();
    let onnx = OnnxModel::load(b.model, &device)
        .with_context(|| format!("loading {}", b.model.display()))?;
    let model = OnnxFrameModel::new(onnx, b.output)?;
    let (width, height) = match model.fixed_size() {
        Some((h, w)) => (w, h),
        None => b.size,
    };
    let mut spec = Preprocess::imagenet(width, height);
    spec.fit = b.fit;
    let options = DecodeOptions {
        on_overload: b.on_overload,
        max_frames: b.max_frames,
        ..DecodeOptions::default()
    };
    eprintln!(
        "kiln bench: {} on {} at {width}×{height} ({} output), {} threads",
        b.model.display(),
        b.video.display(),
        model.kind().name(),
        b.threads
    );
    let mut runs = Vec::new();
    let (decode, _) = run_video(
        b.video,
        &spec,
        &options,
        None,
        &VideoTechniques::default(),
        None,
        false,
    )?;
    runs.push(decode);
    let mut reference: Vec<FrameResult> = Vec::new();
    for (i, t) in configurations(&model, b).into_iter().enumerate() {
        eprintln!("kiln bench: {} ...", t.name());
        let (run, kept) = if i == 0 {
            run_video(b.video, &spec, &options, Some(&model), &t, None, true)?
        } else {
            run_video(
                b.video,
                &spec,
                &options,
                Some(&model),
                &t,
                Some(&reference),
                false,
            )?
        };
        if i == 0 {
            reference = kept;
        }
        runs.push(run);
    }
    eprintln!("kiln bench: peer (PyAV + ONNX Runtime) ...");
    let peer = run_peer(b, width, height);
    let peer_fps = peer.as_ref().ok().map(|p| p.fps);
    if b.json {
        for run in &runs {
            let row = Row {
                run,
                threads: b.threads,
                vs_peer: peer_fps.map(|p| run.fps / p),
            };
            println!("{}", serde_json::to_string(&row)?);
        }
        match &peer {
            Ok(p) => println!("{}", serde_json::json!({"name": "peer", "peer": p})),
            Err(e) => println!(
                "{}",
                serde_json::json!({"name": "peer", "error": e.to_string()})
            ),
        }
        return Ok(());
    }
    let info = &runs[0].info;
    println!(
        "{}: {} {}×{} {:.2} fps, {} frames; model input {width}×{height} ({})",
        info.path.display(),
        info.codec,
        info.width,
        info.height,
        info.fps,
        runs[0].frames,
        b.fit.name()
    );
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8}",
        "configuration",
        "frames",
        "e2e fps",
        "decode",
        "preproc",
        "infer",
        "p50 ms",
        "p99 ms",
        "pixels",
        "agree",
        "pix agr",
        "vs peer"
    );
    for r in &runs {
        let (agree, pix) = r
            .agreement
            .map(|a| {
                (
                    format!("{:.4}", a.score),
                    format!("{:.4}", a.pixel_agreement),
                )
            })
            .unwrap_or(("-".into(), "-".into()));
        println!(
            "{:<22} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>6.0}% {:>8} {:>8} {:>8}",
            r.name,
            r.frames,
            r.fps,
            r.decode_fps,
            r.preprocess_fps,
            if r.name == "decode" {
                0.0
            } else {
                r.inference_fps
            },
            r.p50_ms,
            r.p99_ms,
            100.0 * r.pixel_share,
            agree,
            pix,
            peer_fps
                .map(|p| format!("{:.2}x", r.fps / p))
                .unwrap_or("-".into()),
        );
    }
    match peer {
        Ok(p) => println!(
            "{:<22} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2}",
            "peer: PyAV + ORT",
            p.frames,
            p.fps,
            p.decode_fps,
            p.preprocess_fps,
            p.inference_fps,
            p.p50_ms,
            p.p99_ms
        ),
        Err(e) => println!("peer: not run ({e})"),
    }
    println!(
        "e2e = frames / wall time (decode thread and model overlapping); decode / preproc / infer = \
         frames / seconds in that stage; p50 / p99 = model stage per frame; pixels = share of input \
         pixels the model ran on at full resolution; agree = mean IoU (masks), top-1 (classes) or \
         box F1 against the full model on every frame; vs peer = e2e fps / the peer's"
    );
    Ok(())
}

fn run_peer(b: &VideoBench, width: usize, height: usize) -> Result<Peer> {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = peer_script()?;
    let mut cmd = Command::new(&python);
    cmd.arg(&script)
        .arg(b.video)
        .arg(b.model)
        .args([
            "--width",
            &width.to_string(),
            "--height",
            &height.to_string(),
        ])
        .args(["--threads", &b.threads.to_string()]);
    if let Some(n) = b.max_frames {
        cmd.args(["--frames", &n.to_string()]);
    }
    let out = cmd.output().with_context(|| {
        format!("running {python} (set KILN_PYTHON to a Python with av and onnxruntime)")
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!(
            "the peer failed ({}); pip install av onnxruntime numpy, or set KILN_PYTHON",
            err.lines().last().unwrap_or("no output")
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let last = line.lines().last().unwrap_or_default();
    serde_json::from_str(last).with_context(|| format!("reading the peer's output {last:?}"))
}

/// The peer's script, carried in the binary so the bench runs from anywhere.
const PEER_SCRIPT: &str = include_str!("../../../bench/peers/video_peer.py");

/// Writes the peer's script to a temporary file.
fn peer_script() -> Result<PathBuf> {
    let path = std::env::temp_dir().join(format!("kiln-video-peer-{}.py", std::process::id()));
    std::fs::write(&path, PEER_SCRIPT).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
