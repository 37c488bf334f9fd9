//! `kiln bench --mode stream --video FILE --onnx MODEL`: a per-frame model on a real video
//! file, each technique on and off, in one run beside the usual Python loop (PyAV decoding +
//! ONNX Runtime on every frame, `bench/peers/video_peer.py`): decode, preprocess, inference
//! and end-to-end frames per second, per-frame latency p50 / p99, the share of pixels the
//! model ran on, and agreement with the full model on every frame (mean IoU for masks, top-1
//! agreement for classes, box F1 for detections). A clip made by `kiln data make-video` is
//! also scored against its ground truth (the `.json` beside it): each configuration's mean
//! IoU with the true object masks, the full model's among them, so an accuracy loss is the
//! drop from the full model's accuracy.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use kiln::onnx::OnnxModel;
use kiln::stream::FrameResult;
use kiln::stream::{
    FrameModel, OnnxFrameModel, OutputKind, ScaleConfig, StreamSettings, VideoTechniques,
};
use kiln::video::{ClipTruth, DecodeOptions, Fit, Preprocess, Scoring, VideoRun, run_video};
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
    pub max_frames: Option<u64>,
    pub json: bool,
    /// The queue and the techniques' settings (`stream.*`: config file, then flags).
    pub settings: StreamSettings,
    /// Runs of each configuration (and of the peer); the median run is reported with the
    /// range.
    pub repeats: usize,
    /// Where to write the speed / agreement curve of a threshold sweep.
    pub svg: Option<&'a Path>,
}

#[derive(Serialize)]
struct Row<'a> {
    #[serde(flatten)]
    run: &'a VideoRun,
    threads: usize,
    /// Runs measured; `run` is the one with the median end-to-end fps.
    repeats: usize,
    /// Lowest and highest end-to-end fps over the runs.
    fps_range: [f64; 2],
    vs_peer: Option<f64>,
}

/// One configuration's runs: the median one and the range of end-to-end fps.
struct Measured {
    run: VideoRun,
    fps_range: [f64; 2],
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
    /// Lowest and highest fps over the peer's runs (filled here, not by the script).
    #[serde(default)]
    fps_range: [f64; 2],
}

/// Runs `once` `repeats` times and keeps the run with the median end-to-end fps.
fn measure(repeats: usize, mut once: impl FnMut() -> kiln::Result<VideoRun>) -> Result<Measured> {
    let mut all = (0..repeats.max(1))
        .map(|_| once())
        .collect::<kiln::Result<Vec<_>>>()?;
    all.sort_by(|a, b| a.fps.total_cmp(&b.fps));
    let fps_range = [all[0].fps, all[all.len() - 1].fps];
    let run = all.swap_remove(all.len() / 2);
    Ok(Measured { run, fps_range })
}

/// The configurations measured: each technique alone, then mixed, at the settings'
/// thresholds (`stream.*`). Defaults (BENCHMARKS.md runs 56 and 57): 16-pixel tiles (4
/// thumbnail pixels) at 0.01 mean absolute luma difference (0..1), each group of changed
/// tiles its own crop with a 32-pixel context aligned to a stride-32 backbone; the frame gate
/// reuses a frame only when no tile changed by more than 0.01. Run 56's frame gate was a mean
/// over the whole thumbnail: a still camera's small moving objects barely move it, and
/// reused frames lost 2.1 points of mean IoU.
fn configurations(model: &dyn FrameModel, settings: &StreamSettings) -> Vec<VideoTechniques> {
    let gate = settings.frame_gate();
    let regions = settings.regions();
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
    if supports_regions(model) {
        out.push(VideoTechniques {
            regions: Some(regions),
            ..VideoTechniques::default()
        });
        out.push(settings.techniques());
    }
    if model.fixed_size().is_none()
        && matches!(model.kind(), OutputKind::Mask | OutputKind::Classes)
    {
        out.push(VideoTechniques {
            multiscale: Some(scale),
            ..VideoTechniques::default()
        });
    }
    out
}

fn supports_regions(model: &dyn FrameModel) -> bool {
    model.fixed_size().is_none() && !matches!(model.kind(), OutputKind::Classes)
}

/// The thresholds of the `--svg` sweep (gate and regions together).
const SWEEP: [f32; 6] = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08];

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
        on_overload: b.settings.on_overload,
        queue_frames: b.settings.queue_frames,
        max_frames: b.max_frames,
        ..DecodeOptions::default()
    };
    eprintln!(
        "kiln bench: {} on {} at {width}×{height} ({} output), {} threads, {} runs each",
        b.model.display(),
        b.video.display(),
        model.kind().name(),
        b.threads,
        b.repeats
    );
    let truth = clip_truth(b.video, &spec)?;
    if truth.is_some() {
        eprintln!(
            "kiln bench: scoring against the clip's ground truth ({})",
            b.video.with_extension("json").display()
        );
    }
    let truth = truth.as_deref();
    let repeats = b.repeats.max(1);
    let mut runs: Vec<Measured> = Vec::new();
    let decode = measure(repeats, || {
        run_video(
            b.video,
            &spec,
            &options,
            None,
            &VideoTechniques::default(),
            Scoring::default(),
            false,
        )
        .map(|(run, _)| run)
    })?;
    runs.push(decode);
    // The reference: the full model on every frame (its first run keeps the results).
    eprintln!("kiln bench: full ...");
    let full = VideoTechniques::default();
    let scored = Scoring {
        reference: None,
        truth,
    };
    let (first, reference) =
        run_video(b.video, &spec, &options, Some(&model), &full, scored, true)?;
    let mut first = Some(first);
    let full_runs = measure(repeats, || match first.take() {
        Some(run) => Ok(run),
        None => run_video(b.video, &spec, &options, Some(&model), &full, scored, false)
            .map(|(run, _)| run),
    })?;
    runs.push(full_runs);
    let with_reference = |t: &VideoTechniques| -> Result<Measured> {
        eprintln!("kiln bench: {} ...", t.name());
        measure(repeats, || {
            run_video(
                b.video,
                &spec,
                &options,
                Some(&model),
                t,
                Scoring {
                    reference: Some(&reference),
                    truth,
                },
                false,
            )
            .map(|(run, _)| run)
        })
    };
    for t in configurations(&model, &b.settings).iter().skip(1) {
        runs.push(with_reference(t)?);
    }
    eprintln!("kiln bench: peer (PyAV + ONNX Runtime) ...");
    let peer = run_peer(b, width, height, repeats);
    let peer_fps = peer.as_ref().ok().map(|p| p.fps);
    // The curve: the gate and the regions together over thresholds, one run each.
    let mut sweep = Vec::new();
    if b.svg.is_some() && supports_regions(&model) {
        for threshold in SWEEP {
            let settings = StreamSettings {
                gate_threshold: threshold,
                region_threshold: threshold,
                ..b.settings
            };
            let t = settings.techniques();
            eprintln!("kiln bench: sweep {} at {threshold} ...", t.name());
            let (run, _) = run_video(
                b.video,
                &spec,
                &options,
                Some(&model),
                &t,
                Scoring {
                    reference: Some(&reference),
                    truth,
                },
                false,
            )?;
            sweep.push((threshold, run));
        }
    }
    if let Some(path) = b.svg {
        write_svg(path, &runs, &sweep, peer_fps)?;
        eprintln!("kiln bench: wrote {}", path.display());
    }
    if b.json {
        for m in &runs {
            let row = Row {
                run: &m.run,
                threads: b.threads,
                repeats,
                fps_range: m.fps_range,
                vs_peer: peer_fps.map(|p| m.run.fps / p),
            };
            println!("{}", serde_json::to_string(&row)?);
        }
        for (threshold, run) in &sweep {
            println!(
                "{}",
                serde_json::json!({
                    "sweep": threshold,
                    "name": run.name,
                    "fps": run.fps,
                    "vs_peer": peer_fps.map(|p| run.fps / p),
                    "agreement": run.agreement,
                    "truth": run.truth,
                    "pixel_share": run.pixel_share,
                })
            );
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
    let info = &runs[0].run.info;
    println!(
        "{}: {} {}×{} {:.2} fps, {} frames; model input {width}×{height} ({})",
        info.path.display(),
        info.codec,
        info.width,
        info.height,
        info.fps,
        runs[0].run.frames,
        b.fit.name()
    );
    println!(
        "{:<22} {:>7} {:>9} {:>13} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8}",
        "configuration",
        "frames",
        "e2e fps",
        "range",
        "decode",
        "preproc",
        "infer",
        "p50 ms",
        "p99 ms",
        "pixels",
        "agree",
        "pix agr",
        "truth",
        "vs peer"
    );
    for m in &runs {
        let r = &m.run;
        let (agree, pix) = r
            .agreement
            .map(|a| {
                (
                    format!("{:.4}", a.score),
                    format!("{:.4}", a.pixel_agreement),
                )
            })
            .unwrap_or(("-".into(), "-".into()));
        let truth = r.truth.map_or("-".into(), |t| format!("{:.4}", t.score));
        println!(
            "{:<22} {:>7} {:>9.1} {:>13} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>6.0}% {:>8} {:>8} {:>8} {:>8}",
            r.name,
            r.frames,
            r.fps,
            format!("{:.1}-{:.1}", m.fps_range[0], m.fps_range[1]),
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
            truth,
            peer_fps
                .map(|p| format!("{:.2}x", r.fps / p))
                .unwrap_or("-".into()),
        );
    }
    match peer {
        Ok(p) => println!(
            "{:<22} {:>7} {:>9.1} {:>13} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2}",
            "peer: PyAV + ORT",
            p.frames,
            p.fps,
            format!("{:.1}-{:.1}", p.fps_range[0], p.fps_range[1]),
            p.decode_fps,
            p.preprocess_fps,
            p.inference_fps,
            p.p50_ms,
            p.p99_ms
        ),
        Err(e) => println!("peer: not run ({e})"),
    }
    for (threshold, r) in &sweep {
        println!(
            "sweep {threshold:<6} {:<14} {:>9.1} fps {:>8} agree {:.4} truth {:.4} pixels {:.0}%",
            r.name,
            r.fps,
            peer_fps
                .map(|p| format!("{:.2}x", r.fps / p))
                .unwrap_or("-".into()),
            r.agreement.map_or(f64::NAN, |a| a.score),
            r.truth.map_or(f64::NAN, |a| a.score),
            100.0 * r.pixel_share,
        );
    }
    println!(
        "e2e = median of the runs' frames / wall time (decode thread and model overlapping), range = \
         lowest-highest run; decode / preproc / infer = \
         frames / seconds in that stage; p50 / p99 = model stage per frame; pixels = share of input \
         pixels the model ran on at full resolution; agree = mean IoU (masks), top-1 (classes) or \
         box F1 against the full model on every frame; truth = mean IoU against the clip's \
         ground truth (a clip from kiln data make-video); vs peer = e2e fps / the peer's"
    );
    Ok(())
}

/// The ground truth of a clip `kiln data make-video` wrote (its `.json` beside it) as masks
/// of `spec`'s input; `None` for any other video. A sidecar that is there but unreadable is
/// an error naming it.
fn clip_truth(video: &Path, spec: &Preprocess) -> Result<Option<Vec<FrameResult>>> {
    #[derive(serde::Deserialize)]
    struct Sidecar {
        spec: Size,
        truth: ClipTruth,
    }
    #[derive(serde::Deserialize)]
    struct Size {
        width: usize,
        height: usize,
    }
    let path = video.with_extension("json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let sidecar: Sidecar = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not the ground truth kiln data make-video writes beside a clip",
            path.display()
        )
    })?;
    Ok(Some(sidecar.truth.masks(
        sidecar.spec.width,
        sidecar.spec.height,
        spec,
    )))
}

/// The peer `repeats` times: the run with the median fps, and the range.
fn run_peer(b: &VideoBench, width: usize, height: usize, repeats: usize) -> Result<Peer> {
    let mut all = (0..repeats.max(1))
        .map(|_| run_peer_once(b, width, height))
        .collect::<Result<Vec<_>>>()?;
    all.sort_by(|a, b| a.fps.total_cmp(&b.fps));
    let range = [all[0].fps, all[all.len() - 1].fps];
    let mut peer = all.swap_remove(all.len() / 2);
    peer.fps_range = range;
    Ok(peer)
}

fn run_peer_once(b: &VideoBench, width: usize, height: usize) -> Result<Peer> {
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

/// Agreement (mean IoU, top-1 or box F1, in %) against speed (end-to-end fps ÷ the peer's,
/// or ÷ the full model's when the peer did not run): the sweep as a line, each measured
/// configuration as a point.
fn write_svg(
    path: &Path,
    runs: &[Measured],
    sweep: &[(f32, VideoRun)],
    peer_fps: Option<f64>,
) -> Result<()> {
    let full_fps = runs
        .iter()
        .find(|m| m.run.name == "full")
        .map(|m| m.run.fps);
    let base = peer_fps.or(full_fps).unwrap_or(1.0);
    let point = |r: &VideoRun| (r.fps / base, r.agreement.map_or(100.0, |a| a.score * 100.0));
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    if !sweep.is_empty() {
        let first = sweep.first().map_or(0.0, |s| s.0);
        let last = sweep.last().map_or(0.0, |s| s.0);
        series.push((
            format!("{} over thresholds {first}-{last}", sweep[0].1.name),
            sweep.iter().map(|(_, r)| point(r)).collect(),
        ));
    }
    for m in runs.iter().filter(|m| m.run.name != "decode") {
        series.push((m.run.name.clone(), vec![point(&m.run)]));
    }
    if peer_fps.is_some() {
        series.push(("peer: PyAV + ONNX Runtime".into(), vec![(1.0, 100.0)]));
    }
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    let x_label = if peer_fps.is_some() {
        "end-to-end fps / the peer's (x)"
    } else {
        "end-to-end fps / the full model's (x)"
    };
    let svg = kiln::report::svg::line_chart(
        "Video: agreement with the full model vs speed",
        x_label,
        "agreement with the full model (%)",
        &named,
    );
    kiln::fsutil::write_atomic(path, svg.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The peer's script, carried in the binary so the bench runs from anywhere.
const PEER_SCRIPT: &str = include_str!("../../../bench/peers/video_peer.py");

/// Writes the peer's script to a temporary file.
fn peer_script() -> Result<PathBuf> {
    let path = std::env::temp_dir().join(format!("kiln-video-peer-{}.py", std::process::id()));
    std::fs::write(&path, PEER_SCRIPT).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
