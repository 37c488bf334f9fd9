//! Video from the command line (the `video` feature): `kiln data make-video` writes a clip and
//! its ground truth; `kiln bench --mode stream --video --onnx` runs a per-frame ONNX model on
//! it with each technique, and a bad file is an error naming it.
//!
//! `cargo test -p kiln-cli --features video --test video_cli`

use std::path::PathBuf;
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_LOG", "error")
        // The peer needs PyAV, which CI does not install: its row then says why it did not run.
        .env("KILN_PYTHON", "/nonexistent/python")
        .output()
        .expect("run kiln")
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn work() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-video-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_made_video_is_benchmarked_with_an_onnx_model_and_each_technique() {
    let d = work();
    let clip = d.join("clip.mp4");
    let o = kiln(&[
        "data",
        "make-video",
        clip.to_str().unwrap(),
        "--scene",
        "cut",
        "--size",
        "320x192",
        "--seconds",
        "1.5",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let truth: serde_json::Value =
        serde_json::from_slice(&std::fs::read(clip.with_extension("json")).unwrap()).unwrap();
    assert_eq!(truth["truth"]["boxes"].as_array().unwrap().len(), 45);
    assert_eq!(truth["truth"]["cuts"], serde_json::json!([0, 22]));

    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/onnx/seghead.onnx"
    );
    // The queue and the gate from the config file's [stream] keys.
    let cfg = d.join("kiln.toml");
    std::fs::write(
        &cfg,
        "[stream]\nqueue_frames = 4\ngate_threshold = 0.02\non_overload = \"block\"\n",
    )
    .unwrap();
    let svg = d.join("curve.svg");
    let o = kiln(&[
        "bench",
        "--mode",
        "stream",
        "--video",
        clip.to_str().unwrap(),
        "--onnx",
        model,
        "--threads",
        "1",
        "--json",
        "--repeats",
        "2",
        "--config",
        cfg.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    // A fixed-size model: the techniques that need crops are not offered.
    assert_eq!(names, ["decode", "full", "temporal", "peer"], "{rows:?}");
    for r in &rows[..3] {
        assert_eq!(r["frames"], 45, "{r}");
        let fps = r["fps"].as_f64().unwrap();
        assert!(fps > 0.0);
        assert_eq!(r["info"]["codec"], "h264");
        // The median of two runs lies in their range.
        assert_eq!(r["repeats"], 2);
        let (lo, hi) = (
            r["fps_range"][0].as_f64().unwrap(),
            r["fps_range"][1].as_f64().unwrap(),
        );
        assert!(lo <= fps && fps <= hi, "{r}");
    }
    let curve = std::fs::read_to_string(&svg).unwrap();
    assert!(
        curve.starts_with("<svg") && curve.contains("temporal"),
        "{curve}"
    );
    let agreement = rows[2]["agreement"]["score"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&agreement));
    // The clip's ground truth (the .json make-video wrote) scores the model's runs, the full
    // model's too; the decode row has no results to score.
    assert!(rows[0]["truth"].is_null(), "{}", rows[0]);
    for r in &rows[1..3] {
        let t = r["truth"]["score"].as_f64().unwrap_or(-1.0);
        assert!((0.0..=1.0).contains(&t), "{r}");
        assert_eq!(r["truth"]["frames"], 45, "{r}");
    }
    assert!(
        rows[3]["error"].as_str().unwrap().contains("KILN_PYTHON"),
        "{}",
        rows[3]
    );
}

#[test]
fn a_bad_stream_key_in_the_config_is_an_error_naming_it() {
    let d = work();
    let cfg = d.join("bad.toml");
    std::fs::write(&cfg, "[stream]\non_overload = \"drop-newest\"\n").unwrap();
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/onnx/seghead.onnx"
    );
    let o = kiln(&[
        "bench",
        "--mode",
        "stream",
        "--video",
        "any.mp4",
        "--onnx",
        model,
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("stream.on_overload") && t.contains("drop-oldest"),
        "{t}"
    );
    assert!(!t.contains("panicked"), "{t}");
}

#[test]
fn a_file_that_is_not_a_video_is_an_error_naming_it() {
    let d = work();
    let bad = d.join("holiday.mp4");
    std::fs::write(&bad, b"not a video at all").unwrap();
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/onnx/seghead.onnx"
    );
    let o = kiln(&[
        "bench",
        "--mode",
        "stream",
        "--video",
        bad.to_str().unwrap(),
        "--onnx",
        model,
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("holiday.mp4") && t.contains("not a video"),
        "{t}"
    );
    assert!(!t.contains("panicked"), "{t}");
}
