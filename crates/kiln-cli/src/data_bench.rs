//! `kiln bench --mode data`: the data loader alone for worker counts 0..=2×threads, the data
//! wait share of real W2 training per worker count, and — in the same run, on the same file
//! with the same transform — PyTorch's DataLoader (`bench/peers/torch_dataloader.py`).
//!
//! The data is the bundled MNIST training subset written as memory-mapped `.npy` files; the
//! transform is the CIFAR-style pipeline both sides implement identically: x/255, normalize,
//! random crop with 2 px edge padding, horizontal flip (p = 0.5). Protocol: one warm-up epoch
//! (worker start, page cache), then 3 repeats of `epochs` epochs, median samples/s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::Device;
use kiln::burn;
use kiln::data::{
    Augment, DataLoader, Dataset, LoaderOptions, MNIST_MEAN_STD, MappedImages, Transform,
};
use kiln::datasets::{Split, bundled};
use kiln::observe::MemorySink;
use kiln::train::TrainOptions;
use kiln::zoo::ModelKind;
use serde::Serialize;

use crate::work_dir::WorkDir;

const REPEATS: usize = 3;
const BATCH: usize = 64;

/// One measurement of the loader alone.
#[derive(Debug, Clone, Serialize)]
struct LoaderResult {
    mode: &'static str,
    system: String,
    transform: &'static str,
    workers: usize,
    batch: usize,
    threads: usize,
    samples_per_s: f64,
    min: f64,
    max: f64,
}

/// The data-wait share of W2 training steps with a worker count.
#[derive(Debug, Clone, Serialize)]
struct TrainWait {
    mode: &'static str,
    workers: usize,
    steps: usize,
    step_ms: f64,
    data_ms: f64,
    wait_share: f64,
}

/// Writes the bundled training subset as `images.npy` (u8 `[N,1,28,28]`) and `labels.npy`.
fn write_dataset(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let (x, y) = (dir.join("images.npy"), dir.join("labels.npy"));
    bundled(Split::Train)?.write_npy(&x, &y)?;
    Ok((x, y))
}

fn loader_rate(
    data: &dyn Dataset,
    transform: &dyn Transform,
    workers: usize,
    epochs: usize,
) -> Result<(f64, f64, f64)> {
    let options = LoaderOptions {
        batch_size: BATCH,
        workers,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 7,
    };
    let device = Device::flex();
    let rates = DataLoader::run(data, Some(transform), &device, options, |loader| {
        let mut run = |first: usize, epochs: usize| -> Result<f64> {
            let t = Instant::now();
            let mut n = 0usize;
            for e in first..first + epochs {
                for b in loader.epoch(e, 0) {
                    n += b?.len;
                }
            }
            Ok(n as f64 / t.elapsed().as_secs_f64())
        };
        run(0, 1)?;
        let mut rates = Vec::new();
        for r in 0..REPEATS {
            rates.push(run(1 + r * epochs, epochs)?);
        }
        Ok::<_, anyhow::Error>(rates)
    })??;
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    Ok((sorted[REPEATS / 2], sorted[0], sorted[REPEATS - 1]))
}

fn train_wait(data: &dyn Dataset, workers: usize, steps: usize) -> Result<TrainWait> {
    let mut sink = MemorySink::default();
    kiln::Trainer::new(
        TrainOptions {
            batch_size: BATCH,
            max_steps: Some(steps as u64 + 3),
            eval_every_epochs: 0,
            workers: Some(workers),
            augment: Augment::CropFlip,
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit("cnn", |d| ModelKind::Cnn.init(d), data, None)?;
    // The first steps pay for thread start and allocator warm-up: skip them, as the peers do.
    let timed: Vec<(f64, f64)> = sink
        .steps()
        .map(|s| (s.step_ms, s.data_ms))
        .skip(3)
        .collect();
    let step_ms = timed.iter().map(|t| t.0).sum::<f64>() / timed.len().max(1) as f64;
    let data_ms = timed.iter().map(|t| t.1).sum::<f64>() / timed.len().max(1) as f64;
    Ok(TrainWait {
        mode: "train-wait",
        workers,
        steps: timed.len(),
        step_ms,
        data_ms,
        wait_share: data_ms / step_ms.max(1e-9),
    })
}

fn peer_python() -> Option<PathBuf> {
    crate::image_bench::venv_python("PEERS_VENV", "kiln-peers", "torch, numpy")
}

fn peer_script() -> PathBuf {
    // The script ships in the repository; `kiln` run from its root (or via cargo) finds it.
    let here = PathBuf::from("bench/peers/torch_dataloader.py");
    if here.exists() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers/torch_dataloader.py")
}

/// Runs the data benchmark; prints a table (or JSON lines with `json`).
pub fn run(threads: usize, epochs: Option<usize>, json: bool) -> Result<()> {
    let epochs = epochs.unwrap_or(4).max(1);
    let dir = WorkDir::create("bench-data")?;
    let (images, labels) = write_dataset(&dir)?;
    let (mean, std) = MNIST_MEAN_STD;
    let data = MappedImages::open_npy(&images, &labels)?.with_scaling(mean, std);
    let mut kiln_rows = Vec::new();
    let mut peer_rows: Vec<LoaderResult> = Vec::new();
    // Probed once: the peer is optional and its absence is said once.
    let py = peer_python();
    if py.is_none() {
        eprintln!(
            "kiln bench data: PyTorch not found (set PEERS_VENV, or run ../shared/peers/setup.sh \
             for a venv at ~/.cache/kiln-peers); reporting Kiln's numbers only"
        );
    }
    for (name, augment) in [
        ("crop-flip", Augment::CropFlip),
        ("affine", Augment::Affine),
    ] {
        let transform = augment
            .build(data.item_shape())
            .context("building the transform")?;
        kiln_rows.extend(kiln_loader(&data, &transform, name, threads, epochs, json)?);
        if let Some(py) = &py {
            peer_rows.extend(peer_loader(
                py, &images, &labels, name, threads, epochs, json,
            )?);
        }
    }
    let mut waits = Vec::new();
    for workers in 0..=threads {
        if !json {
            eprintln!("kiln bench data: W2 training, {workers} worker(s) ...");
        }
        let w = train_wait(&data, workers, 20)?;
        if json {
            println!("{}", serde_json::to_string(&w)?);
        }
        waits.push(w);
    }
    if !json {
        print_tables(&kiln_rows, &peer_rows, &waits, threads, epochs);
    }
    Ok(())
}

fn kiln_loader(
    data: &dyn Dataset,
    transform: &dyn Transform,
    name: &'static str,
    threads: usize,
    epochs: usize,
    json: bool,
) -> Result<Vec<LoaderResult>> {
    let mut rows = Vec::new();
    for workers in 0..=2 * threads {
        if !json {
            eprintln!("kiln bench data: kiln loader, {name}, {workers} worker(s) ...");
        }
        let (median, min, max) = loader_rate(data, transform, workers, epochs)?;
        let r = LoaderResult {
            mode: "loader",
            system: "kiln".into(),
            transform: name,
            workers,
            batch: BATCH,
            threads,
            samples_per_s: median,
            min,
            max,
        };
        if json {
            println!("{}", serde_json::to_string(&r)?);
        }
        rows.push(r);
    }
    Ok(rows)
}

fn peer_loader(
    py: &Path,
    images: &Path,
    labels: &Path,
    name: &'static str,
    threads: usize,
    epochs: usize,
    json: bool,
) -> Result<Vec<LoaderResult>> {
    let max_workers = 2 * threads;
    if !json {
        eprintln!("kiln bench data: PyTorch DataLoader, {name}, 0..={max_workers} worker(s) ...");
    }
    let list: Vec<String> = (0..=max_workers).map(|w| w.to_string()).collect();
    let out = Command::new(py)
        .arg(peer_script())
        .args(["--images", &images.to_string_lossy()])
        .args(["--labels", &labels.to_string_lossy()])
        .args(["--workers", &list.join(",")])
        .args(["--batch", &BATCH.to_string()])
        .args(["--epochs", &epochs.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--transform", name])
        .output()
        .context("running the PyTorch DataLoader peer")?;
    if !out.status.success() {
        eprintln!(
            "kiln bench data: the PyTorch peer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("parsing peer output {line:?}"))?;
        let r = LoaderResult {
            mode: "loader",
            system: format!("pytorch {}", v["torch"].as_str().unwrap_or("?")),
            transform: name,
            workers: v["workers"].as_u64().unwrap_or(0) as usize,
            batch: BATCH,
            threads,
            samples_per_s: v["samples_per_s"].as_f64().unwrap_or(f64::NAN),
            min: v["min"].as_f64().unwrap_or(f64::NAN),
            max: v["max"].as_f64().unwrap_or(f64::NAN),
        };
        if json {
            println!("{}", serde_json::to_string(&r)?);
        }
        rows.push(r);
    }
    Ok(rows)
}

fn print_tables(
    kiln_rows: &[LoaderResult],
    peer_rows: &[LoaderResult],
    waits: &[TrainWait],
    threads: usize,
    epochs: usize,
) {
    println!(
        "loader alone: MNIST 5k as mmap .npy + normalize, batch {BATCH}, {threads} threads, \
             median of {REPEATS} x {epochs} epochs"
    );
    println!(
        "{:>9}  {:>7}  {:>14}  {:>16}  {:>7}",
        "transform", "workers", "kiln samples/s", "pytorch samples/s", "ratio"
    );
    for k in kiln_rows {
        let peer = peer_rows
            .iter()
            .find(|p| p.workers == k.workers && p.transform == k.transform);
        println!(
            "{:>9}  {:>7}  {:>14.0}  {:>16}  {:>7}",
            k.transform,
            k.workers,
            k.samples_per_s,
            peer.map_or("-".into(), |p| format!("{:.0}", p.samples_per_s)),
            peer.map_or("-".into(), |p| format!(
                "{:.2}x",
                k.samples_per_s / p.samples_per_s
            ))
        );
    }
    println!("\nW2 training (batch {BATCH}, crop-flip in the loader): data wait per step");
    println!(
        "{:>7}  {:>8}  {:>8}  {:>10}",
        "workers", "step ms", "data ms", "wait share"
    );
    for w in waits {
        println!(
            "{:>7}  {:>8.1}  {:>8.3}  {:>9.2}%",
            w.workers,
            w.step_ms,
            w.data_ms,
            100.0 * w.wait_share
        );
    }
}
