//! Datasets, transforms and the loader that feeds the trainer.
//!
//! A [`BatchSource`] turns a list of sample indices into one batch of any type: Kiln's image
//! [`Dataset`]s through [`ImageBatches`] (a `Dataset` writes one sample into a caller's buffer,
//! [`collate`] makes the tensors), or any Burn `Dataset` + `Batcher` through [`BurnBatches`].
//! [`epoch_order`] gives the seeded sample order of an epoch. The [`DataLoader`] runs that work on persistent worker threads ahead of the consumer, bounded
//! by `prefetch_factor × workers` batches, and hands batches out in exactly the order a single
//! thread would produce them. Order and augmentation depend only on (seed, epoch, index),
//! never on timing or the worker count, so runs are reproducible and a resumed run sees exactly
//! the batches an uninterrupted one would.
//!
//! Beyond in-memory data: [`NpyDataset`] and [`SafetensorsDataset`] read memory-mapped files
//! without loading them, and [`CachedDataset`] keeps preprocessed samples in a size-bounded,
//! checksummed disk cache ([`DiskCache`]).

mod cache;
mod image;
mod last_batch;
mod loader;
mod mmap;
mod shard;
mod source;
mod synthetic;
mod transform;
pub mod vision;
mod workers;

pub use cache::{CacheStats, CachedDataset, DiskCache};
pub use image::{ImageDataset, MNIST_MEAN_STD};
pub use last_batch::LastBatch;
pub use loader::{DataLoader, EpochBatches, LoaderOptions, LoaderStats};
pub use mmap::{
    DEFAULT_RELEASE_EVERY, ElementType, MappedImages, MmapArray, NpyDataset, PixelScaling,
    SafetensorsDataset, write_npy,
};
pub use shard::Shard;
pub(crate) use source::panic_text;
pub use source::{BatchContext, BatchSource, BurnBatches, ImageBatches};
pub use synthetic::SyntheticDataset;
pub use transform::{
    Augment, Compose, Normalize, RandomAffine, RandomCrop, RandomHorizontalFlip, SampleRng,
    Transform,
};
pub use workers::{TARGET_WAIT_SHARE, WorkerChoice, WorkerTrial, choose_workers};

use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::error::{KilnError, Result};
use crate::observe::SkippedSample;

/// A finite, indexable set of labelled samples. Implementations are shared by the loader's
/// worker threads, hence `Send + Sync`; `fill` takes `&self` and may be called concurrently.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample, `[channels, height, width]`.
    fn item_shape(&self) -> [usize; 3];

    /// Writes sample `index` (already normalized) into `out` (length = product of
    /// [`Dataset::item_shape`]) and returns its class label. An item that cannot be produced
    /// (unreadable file, corrupt record) is an error naming the index, not a panic.
    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize>;

    /// [`Dataset::fill`] for the loader: `rng` is the sample's stream, seeded by
    /// `(seed, epoch, index)`, for datasets whose sampling is itself random (a random crop
    /// planned on the file before decoding). `Ok(None)`: the sample could not be produced
    /// and the dataset's policy leaves it out of its batch (recorded for
    /// [`Dataset::take_skipped`]).
    fn fill_sample(
        &self,
        index: usize,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<Option<usize>> {
        let _ = rng;
        self.fill(index, out).map(Some)
    }

    /// The order of `epoch`'s samples when the dataset has its own (sharded archives, read
    /// shard by shard through a shuffle buffer); `None`: the loader's seeded permutation.
    fn epoch_order(&self, seed: u64, epoch: usize) -> Option<Vec<usize>> {
        let _ = (seed, epoch);
        None
    }

    /// The samples left out since the last call (see [`Dataset::fill_sample`]), drained.
    fn take_skipped(&self) -> Vec<SkippedSample> {
        Vec::new()
    }
}

/// A borrowed dataset is a dataset, so adaptors that own their inner dataset (a cache, a
/// downscaled view) also take one the caller keeps.
impl<D: Dataset + ?Sized> Dataset for &D {
    fn len(&self) -> usize {
        (**self).len()
    }

    fn item_shape(&self) -> [usize; 3] {
        (**self).item_shape()
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        (**self).fill(index, out)
    }

    fn fill_sample(
        &self,
        index: usize,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<Option<usize>> {
        (**self).fill_sample(index, rng, out)
    }

    fn epoch_order(&self, seed: u64, epoch: usize) -> Option<Vec<usize>> {
        (**self).epoch_order(seed, epoch)
    }

    fn take_skipped(&self) -> Vec<SkippedSample> {
        (**self).take_skipped()
    }
}

/// A batch on a device.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Images `[B, C, H, W]`.
    pub images: Tensor<4>,
    /// Class labels `[B]`.
    pub labels: Tensor<1, Int>,
    /// Number of samples.
    pub len: usize,
}

/// Gathers the samples at `indices` into one batch on `device`.
pub fn collate(dataset: &dyn Dataset, indices: &[usize], device: &Device) -> Result<Batch> {
    collate_with(dataset, indices, device, |i, slot| {
        dataset.fill(i, slot).map(Some)
    })
}

/// Gathers the samples at `indices`, producing each with `sample(index, slot)` (the loader's
/// hook: fill, augment, catch panics; `None` leaves the sample out), and uploads the batch.
pub(crate) fn collate_with(
    dataset: &dyn Dataset,
    indices: &[usize],
    device: &Device,
    mut sample: impl FnMut(usize, &mut [f32]) -> Result<Option<usize>>,
) -> Result<Batch> {
    let [c, h, w] = dataset.item_shape();
    let item = c * h * w;
    let mut pixels = vec![0f32; indices.len() * item];
    let mut labels = Vec::with_capacity(indices.len());
    for &i in indices {
        check_index(i, dataset.len())?;
        let n = labels.len();
        // A left-out sample's slot is taken by the next one: the batch stays dense.
        if let Some(label) = sample(i, &mut pixels[n * item..(n + 1) * item])? {
            labels.push(label as i64);
        }
    }
    let n = labels.len();
    if n == 0 && !indices.is_empty() {
        return Err(KilnError::DataItem {
            index: indices[0],
            problem: format!(
                "every sample of this batch ({} from index {}) was left out as unreadable; \
                 check the data (the skipped files are in the run's events)",
                indices.len(),
                indices[0]
            ),
        });
    }
    pixels.truncate(n * item);
    // `from_data` takes the vector: on the CPU backend the batch is not copied again, on CUDA
    // this is the host→device upload, done on the thread that collated (a loader worker), so
    // it overlaps the consumer's compute.
    Ok(Batch {
        images: Tensor::from_data(TensorData::new(pixels, [n, c, h, w]), device),
        labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        len: n,
    })
}

/// An error naming `index` if it is past the end of a dataset of `len` samples.
pub(crate) fn check_index(index: usize, len: usize) -> Result<()> {
    if index >= len {
        return Err(KilnError::DataItem {
            index,
            problem: format!("index out of range (dataset has {len} samples)"),
        });
    }
    Ok(())
}

/// The sample order of one epoch: a permutation seeded by `(seed, epoch)`, or `0..n`.
pub fn epoch_order(n: usize, seed: u64, epoch: usize, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        // Mix the epoch into the seed so every epoch differs but is reproducible on its own.
        let mixed = seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(mixed));
    }
    order
}
