//! Opening a training/test pair from a directory in any format Kiln reads: memory-mapped
//! `.npy` or safetensors files, or MNIST-format IDX files.

use std::path::Path;

use super::mnist::{Split, load_dir};
use crate::data::{Dataset, MappedImages};
use crate::error::{KilnError, Result};

/// Samples used to estimate the normalization of a mapped dataset: enough for the mean and
/// standard deviation to settle, few enough to read in milliseconds.
const STATS_SAMPLES: usize = 2000;

/// A train/test pair of datasets.
pub type DatasetPair = (Box<dyn Dataset>, Box<dyn Dataset>);

/// Opens the training and test splits in `dir`, by what the directory holds (first match):
///
/// 1. `train.safetensors` + `test.safetensors`, each with tensors `images` (`[N,H,W]` or
///    `[N,C,H,W]`, u8 or f32) and `labels` (`[N]`, integer) — memory-mapped;
/// 2. `train-images.npy`, `train-labels.npy`, `test-images.npy`, `test-labels.npy` —
///    memory-mapped;
/// 3. MNIST-format IDX files (see [`load_dir`]) — loaded into memory.
///
/// Mapped data is normalized with the mean and standard deviation of (up to 2,000 samples of)
/// the training split, applied to both splits.
pub fn open_dir(dir: &Path) -> Result<DatasetPair> {
    let mapped = if dir.join("train.safetensors").is_file() {
        let open = |name: &str| {
            MappedImages::open_safetensors(
                dir.join(format!("{name}.safetensors")),
                "images",
                "labels",
            )
        };
        Some((open("train")?, open("test")?))
    } else if dir.join("train-images.npy").is_file() {
        let open = |name: &str| {
            MappedImages::open_npy(
                dir.join(format!("{name}-images.npy")),
                dir.join(format!("{name}-labels.npy")),
            )
        };
        Some((open("train")?, open("test")?))
    } else {
        None
    };
    let Some((train, test)) = mapped else {
        return Ok((
            Box::new(load_dir(dir, Split::Train)?),
            Box::new(load_dir(dir, Split::Test)?),
        ));
    };
    if train.item_shape() != test.item_shape() {
        return Err(KilnError::BadData {
            path: dir.to_path_buf(),
            problem: format!(
                "train samples are {:?} but test samples are {:?}; both splits need one shape",
                train.item_shape(),
                test.item_shape()
            ),
        });
    }
    let (mean, std) = pixel_stats(&train)?;
    tracing::info!(
        mean,
        std,
        "normalizing {} with training-split statistics",
        dir.display()
    );
    Ok((
        Box::new(train.with_scaling(mean, std)),
        Box::new(test.with_scaling(mean, std)),
    ))
}

/// What `data.dir` names, opened: an image source (`imagefolder:`, `manifest:`, `shards:`,
/// `packed:`; then also its class names) or a directory of arrays ([`open_dir`]).
pub fn open_data(
    value: &Path,
    images: &super::ImageOptions,
) -> Result<(DatasetPair, Option<Vec<String>>)> {
    match value.to_str().and_then(super::ImageSpec::parse) {
        Some(spec) => {
            let (pair, classes) = super::open_images(&spec, images)?;
            Ok((pair, Some(classes)))
        }
        None => Ok((open_dir(value)?, None)),
    }
}

/// Mean and standard deviation of the (scaled, unnormalized) values of the first samples.
fn pixel_stats(data: &MappedImages) -> Result<(f32, f32)> {
    let [c, h, w] = data.item_shape();
    let mut buf = vec![0f32; c * h * w];
    let (mut sum, mut sum_sq, mut count) = (0f64, 0f64, 0usize);
    for i in 0..data.len().min(STATS_SAMPLES) {
        data.fill(i, &mut buf)?;
        for &v in &buf {
            sum += v as f64;
            sum_sq += (v as f64) * (v as f64);
        }
        count += buf.len();
    }
    if count == 0 {
        return Ok((0.0, 1.0));
    }
    let mean = sum / count as f64;
    let var = (sum_sq / count as f64 - mean * mean).max(0.0);
    // A constant dataset would divide by zero: leave it unscaled.
    let std = if var > 1e-12 { var.sqrt() } else { 1.0 };
    Ok((mean as f32, std as f32))
}
