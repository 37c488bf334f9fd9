//! `kiln bench --mode data --data imagefolder:DIR` (or `shards:`, `manifest:`, `packed:`):
//! images/s of decode + RandomResizedCrop(224) + flip + Normalize through Kiln's loader at 0,
//! 1 and 2 workers, with peak RSS, beside — in the same run, the cases taking turns — the
//! PyTorch DataLoader with torchvision v2 on PIL, the same on `torchvision.io.decode_jpeg`,
//! and DALI's CPU pipeline where it imports (`bench/peers/torch_image_loader.py`).
//!
//! Every case runs in its own process, so each peak RSS is that case's alone. Protocol: a
//! warm-up pass over 256 images (workers start, page cache), then 3 repeats of `--images`
//! images (default 1024), median and range of images/s.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::Device;
use kiln::burn;
use kiln::data::{DataLoader, Dataset, LoaderOptions};
use kiln::datasets::{ImageOptions, ImageSpec, open_images};
use serde::{Deserialize, Serialize};

const BATCH: usize = 64;
const WARMUP: usize = 256;
const REPEATS: usize = 3;

/// One case's measurement.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rate {
    /// What ran.
    pub system: String,
    /// Loader workers.
    pub workers: usize,
    /// Median images/s over the repeats.
    pub images_per_s: f64,
    /// Slowest repeat.
    pub min: f64,
    /// Fastest repeat.
    pub max: f64,
    /// Peak resident memory of the case's process (and its workers), bytes.
    pub peak_rss_bytes: Option<u64>,
}

/// What the image benchmark runs on.
pub struct ImageBench<'a> {
    /// The source (`imagefolder:DIR`, ...).
    pub spec: &'a str,
    /// Where the peers read (an image folder); default: the source's folder.
    pub peer_root: Option<PathBuf>,
    /// CPU threads (workers go up to this).
    pub threads: usize,
    /// Images per timed repeat.
    pub images: usize,
    /// Output size.
    pub size: usize,
    /// JSON lines instead of a table.
    pub json: bool,
}

fn training_source(spec: &str, size: usize) -> Result<Box<dyn Dataset>> {
    let parsed = ImageSpec::parse(spec).with_context(|| {
        format!("--data {spec}: expected imagefolder:, shards:, manifest: or packed:")
    })?;
    let opts = ImageOptions {
        size,
        ..ImageOptions::default()
    };
    let ((train, _test), _) = open_images(&parsed, &opts)?;
    Ok(train)
}

/// One Kiln case in this process: the loader with `workers` workers.
pub fn kiln_case(spec: &str, workers: usize, images: usize, size: usize) -> Result<Rate> {
    let data = training_source(spec, size)?;
    let options = LoaderOptions {
        batch_size: BATCH,
        workers,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 7,
    };
    let per_epoch = data.len().div_ceil(BATCH);
    let want = images.div_ceil(BATCH);
    if per_epoch == 0 {
        bail!("{spec}: no images");
    }
    let device = Device::flex();
    let rates = DataLoader::run(
        &*data,
        None,
        &device,
        options,
        |loader| -> Result<Vec<f64>> {
            // Batches `count` from `epoch` on, crossing epochs as needed.
            let mut epoch = 0usize;
            let mut take = |count: usize| -> Result<usize> {
                let mut got = 0;
                while got < count {
                    for batch in loader.epoch(epoch, 0).take(count - got) {
                        batch?;
                        got += 1;
                    }
                    epoch += 1;
                }
                Ok(got)
            };
            take(WARMUP.div_ceil(BATCH).min(per_epoch))?;
            let mut rates = Vec::with_capacity(REPEATS);
            for _ in 0..REPEATS {
                let t = Instant::now();
                let batches = take(want)?;
                rates.push((batches * BATCH) as f64 / t.elapsed().as_secs_f64());
            }
            Ok(rates)
        },
    )??;
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(Rate {
        system: format!("kiln ({})", spec.split(':').next().unwrap_or("")),
        workers,
        images_per_s: sorted[sorted.len() / 2],
        min: sorted[0],
        max: sorted[sorted.len() - 1],
        peak_rss_bytes: kiln::observe::memory::peak_rss_bytes(),
    })
}

/// The peers' Python: `$var`'s venv, else `~/.cache/<default>`, if it can import `imports`
/// (`"torch, PIL"`).
pub fn venv_python(var: &str, default: &str, imports: &str) -> Option<PathBuf> {
    let venv = std::env::var_os(var).map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join(default))
    })?;
    let py = venv.join("bin/python");
    let ok = Command::new(&py)
        .args(["-c", &format!("import {imports}")])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

fn peer_script() -> PathBuf {
    let here = PathBuf::from("bench/peers/torch_image_loader.py");
    if here.exists() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers/torch_image_loader.py")
}

/// The folder the peers read: the `--peer-root`, or the source's own training folder.
fn peer_root(bench: &ImageBench<'_>) -> Option<PathBuf> {
    if let Some(p) = &bench.peer_root {
        return Some(p.clone());
    }
    match ImageSpec::parse(bench.spec)? {
        ImageSpec::Folder(dir) => {
            let train = dir.join("train");
            Some(if train.is_dir() { train } else { dir })
        }
        _ => None,
    }
}

fn run_json<T: for<'de> Deserialize<'de>>(cmd: &mut Command) -> Result<T> {
    let out = cmd.output().context("starting a benchmark case")?;
    if !out.status.success() {
        bail!(
            "a benchmark case failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("a benchmark case printed no result")?;
    Ok(serde_json::from_str(line)?)
}

#[derive(Deserialize)]
struct PeerLine {
    system: Option<String>,
    workers: usize,
    images_per_s: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    peak_rss_bytes: Option<u64>,
    error: Option<String>,
}

/// Runs the benchmark (see the module docs) and prints the table.
pub fn run(bench: &ImageBench<'_>) -> Result<()> {
    let exe = std::env::current_exe()?;
    let imports = "torch, torchvision, PIL";
    let python = venv_python("PEERS_VENV", "kiln-peers", imports);
    // pillow-simd replaces Pillow, so it lives in a venv of its own (docs/data.md).
    let simd = venv_python("PILLOW_SIMD_VENV", "kiln-peers-simd", imports);
    let root = peer_root(bench);
    let mut results: Vec<Rate> = Vec::new();
    let workers: Vec<usize> = (0..=bench.threads.min(2)).collect();
    for &w in &workers {
        let kiln: Rate = run_json(Command::new(&exe).args([
            "bench",
            "--mode",
            "data",
            "--data",
            bench.spec,
            "--threads",
            &bench.threads.to_string(),
            "--images",
            &bench.images.to_string(),
            "--image-size",
            &bench.size.to_string(),
            "--case",
            &format!("kiln:{w}"),
        ]))?;
        results.push(kiln);
        let (Some(py), Some(root)) = (&python, &root) else {
            continue;
        };
        let mut peers = vec![(py, "pil"), (py, "decode_jpeg"), (py, "dali")];
        if let Some(simd) = &simd {
            peers.push((simd, "pil"));
        }
        for (py, variant) in peers {
            let line: PeerLine = run_json(
                Command::new(py)
                    .arg(peer_script())
                    .args(["--root", &root.display().to_string(), "--variant", variant])
                    .args(["--workers", &w.to_string(), "--threads"])
                    .arg(bench.threads.to_string())
                    .args(["--images", &bench.images.to_string(), "--size"])
                    .arg(bench.size.to_string())
                    .env("OMP_NUM_THREADS", bench.threads.to_string()),
            )?;
            match (line.images_per_s, line.error) {
                (Some(rate), _) => results.push(Rate {
                    system: line.system.unwrap_or_else(|| variant.into()),
                    workers: line.workers,
                    images_per_s: rate,
                    min: line.min.unwrap_or(rate),
                    max: line.max.unwrap_or(rate),
                    peak_rss_bytes: line.peak_rss_bytes,
                }),
                (None, Some(e)) => tracing::warn!("peer {variant}: not measured ({e})"),
                (None, None) => {}
            }
        }
    }
    if python.is_none() {
        eprintln!(
            "kiln: no peer venv with torch + torchvision ($PEERS_VENV, or ~/.cache/kiln-peers): \
             Kiln's figures only"
        );
    }
    if bench.json {
        for r in &results {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    print_table(bench, &results);
    Ok(())
}

fn print_table(bench: &ImageBench<'_>, results: &[Rate]) {
    println!(
        "image loader: {} — decode + RandomResizedCrop({s}) + flip + Normalize, batch {BATCH}, \
         {} threads; median (range) of {REPEATS} × {} images",
        bench.spec,
        bench.threads,
        bench.images,
        s = bench.size
    );
    println!(
        "{:<52} {:>7} {:>10} {:>19} {:>10} {:>11}",
        "system", "workers", "images/s", "range", "peak RSS", "kiln ÷ this"
    );
    for r in results {
        let kiln = results
            .iter()
            .find(|k| k.workers == r.workers && k.system.starts_with("kiln"))
            .map(|k| k.images_per_s);
        println!(
            "{:<52} {:>7} {:>10.0} {:>8.0} – {:>8.0} {:>10} {:>11}",
            r.system,
            r.workers,
            r.images_per_s,
            r.min,
            r.max,
            r.peak_rss_bytes
                .map_or("n/a".into(), kiln::observe::memory::human_bytes),
            kiln.map_or("".into(), |k| format!("{:.2}×", k / r.images_per_s))
        );
    }
}

/// `--data` as given, checked to name an image source (for a clear error before any case).
pub fn check_spec(spec: &str) -> Result<()> {
    if ImageSpec::parse(spec).is_none() {
        bail!(
            "--data {spec}: --mode data reads image files from imagefolder:DIR, shards:PATTERN, \
             manifest:FILE or packed:DIR"
        );
    }
    Ok(())
}
