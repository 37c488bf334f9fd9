//! Image files from the command line: `kiln train --data imagefolder:` / `packed:` with the
//! zoo's ResNet, `data.on_bad_sample = skip` in the run's events, `kiln data pack`, and
//! `kiln bench --mode data --data`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_LOG", "error")
        // No peers: the benchmark's own cases only (the peers are timed by hand).
        .env("PEERS_VENV", "/nonexistent")
        .env("PILLOW_SIMD_VENV", "/nonexistent")
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

/// `root/class_<c>/img_<i>.jpg`: each class a colour, noise per file.
fn make_folder(root: &Path, classes: usize, per_class: usize) {
    for c in 0..classes {
        let dir = root.join(format!("class_{c}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..per_class {
            let tint = [[210u32, 50, 40], [40, 80, 220]][c % 2];
            let mut s = (c * 977 + i * 131 + 7) as u32;
            let img = image::RgbImage::from_fn(40, 30, |x, y| {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let n = (s >> 24) % 30;
                image::Rgb(std::array::from_fn(|k| {
                    (tint[k] * 3 / 4 + x + y + n).min(255) as u8
                }))
            });
            img.save(dir.join(format!("img_{i:03}.jpg"))).unwrap();
        }
    }
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-cli-images-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn events(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn resnet_trains_on_an_image_folder_and_on_its_pack() {
    let dir = tempdir("train");
    let src = dir.join("src");
    make_folder(&src, 2, 10);
    let folder = format!("imagefolder:{}", src.display());
    let common = [
        "--model",
        "resnet",
        "--epochs",
        "1",
        "--batch-size",
        "6",
        "--level",
        "basic",
        "--json",
        "--set",
        "data.image_size=16",
    ];
    let o = kiln(&[&["train", "--data", &folder][..], &common[..]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let ev = events(&o);
    assert_eq!(
        ev[0]["train_samples"], 18,
        "10 per class, every 10th held out"
    );
    let done = ev.last().unwrap();
    assert_eq!(done["event"], "run_finished");
    assert!(done["test_accuracy"].is_number(), "{done}");
    assert_eq!(done["skipped_samples"], 0);

    let packed = dir.join("packed");
    let o = kiln(&[
        "data",
        "pack",
        &folder,
        packed.to_str().unwrap(),
        "--shorter",
        "24",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("packed 20 images (0 skipped)"),
        "{}",
        text(&o)
    );
    let spec = format!("packed:{}", packed.display());
    let o = kiln(&[&["train", "--data", &spec][..], &common[..]].concat());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(events(&o)[0]["train_samples"], 18);

    // The other zoo models are defined on MNIST's shape: a clear refusal.
    let o = kiln(&[
        "train", "--data", &folder, "--model", "cnn", "--epochs", "1",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("--model resnet"), "{}", text(&o));
}

#[test]
fn a_corrupt_file_stops_training_or_is_skipped_and_reported() {
    let dir = tempdir("skip");
    make_folder(&dir, 2, 6);
    std::fs::write(
        dir.join("class_1/broken.jpg"),
        b"\xFF\xD8\xFF\xE0 not really",
    )
    .unwrap();
    let folder = format!("imagefolder:{}", dir.display());
    let base = [
        "train",
        "--data",
        &folder,
        "--model",
        "resnet",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--level",
        "basic",
        "--json",
        "--set",
        "data.image_size=16",
    ];
    let o = kiln(&base);
    assert_eq!(o.status.code(), Some(2));
    let t = text(&o);
    assert!(
        t.contains("broken.jpg") && t.contains("on_bad_sample"),
        "{t}"
    );

    let o = kiln(&[&base[..], &["--set", "data.on_bad_sample=skip"][..]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let ev = events(&o);
    let skipped: Vec<&serde_json::Value> = ev
        .iter()
        .filter(|e| e["event"] == "samples_skipped")
        .collect();
    // broken.jpg sorts first in class_1 and stays in the training split: once per epoch.
    assert_eq!(skipped.len(), 2, "{ev:?}");
    assert!(
        skipped[0]["samples"][0]["name"]
            .as_str()
            .unwrap()
            .ends_with("broken.jpg")
    );
    assert_eq!(ev.last().unwrap()["skipped_samples"], 2);
}

#[test]
fn the_image_loader_benchmark_reports_each_worker_count() {
    let dir = tempdir("bench");
    make_folder(&dir, 2, 40);
    let spec = format!("imagefolder:{}", dir.display());
    let o = kiln(&[
        "bench",
        "--mode",
        "data",
        "--data",
        &spec,
        "--threads",
        "2",
        "--images",
        "64",
        "--image-size",
        "32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = events(&o);
    let workers: Vec<u64> = lines
        .iter()
        .map(|l| l["workers"].as_u64().unwrap())
        .collect();
    assert_eq!(workers, [0, 1, 2]);
    for l in &lines {
        assert!(l["system"].as_str().unwrap().starts_with("kiln"));
        assert!(l["images_per_s"].as_f64().unwrap() > 0.0);
        assert!(l["peak_rss_bytes"].as_u64().unwrap() > 0);
    }
    let o = kiln(&["bench", "--mode", "data", "--data", "/not/a/spec"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("imagefolder:DIR"), "{}", text(&o));
}
