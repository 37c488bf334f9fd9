//! What the loader turns sample indices into batches with: any item and batch type.
//!
//! The loader owns order, prefetch, workers and failure handling; a [`BatchSource`] only says
//! how a list of indices becomes one batch on a device. Two sources come with Kiln:
//! - [`ImageBatches`]: Kiln's own labelled image [`Dataset`]s (MNIST, `.npy`, safetensors,
//!   the disk cache) with an optional seeded per-sample [`Transform`], giving a [`Batch`];
//! - [`BurnBatches`]: any Burn `Dataset<I>` with a Burn `Batcher<I, O>` (`burn::data`), the way
//!   a Burn user already feeds burn-train, giving the user's own batch type `O`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::Device;

use super::transform::{SampleRng, Transform};
use super::{Batch, Dataset, check_index, collate_with};
use crate::error::{KilnError, Result};
use crate::observe::SkippedSample;

/// Where a batch sits in the run: what seeded per-sample work (augmentation) depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchContext {
    /// The epoch the batch belongs to.
    pub epoch: usize,
    /// The run's seed.
    pub seed: u64,
}

/// Builds batches from sample indices; shared by the loader's worker threads (`Send + Sync`,
/// `batch` takes `&self` and may run concurrently).
pub trait BatchSource: Send + Sync {
    /// What one batch is (tensors on the device, usually).
    type Batch: Send;

    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batch of the samples at `indices` (each `< len()`), on `device`. A sample that
    /// cannot be produced is an error naming its index, not a panic (the loader turns a panic
    /// into an error too).
    fn batch(&self, indices: &[usize], ctx: BatchContext, device: &Device) -> Result<Self::Batch>;

    /// The order of `epoch`'s samples when the source has its own (see
    /// [`Dataset::epoch_order`]); `None`: the loader's seeded permutation.
    fn epoch_order(&self, seed: u64, epoch: usize) -> Option<Vec<usize>> {
        let _ = (seed, epoch);
        None
    }

    /// Samples left out of their batches since the last call (unreadable files under a skip
    /// policy), drained; the trainer reports them at each epoch's end.
    fn take_skipped(&self) -> Vec<SkippedSample> {
        Vec::new()
    }
}

/// Kiln's labelled image datasets as a [`BatchSource`] of [`Batch`]es, with an optional
/// per-sample transform seeded by `(seed, epoch, index)`.
#[derive(Clone, Copy)]
pub struct ImageBatches<'d> {
    dataset: &'d dyn Dataset,
    transform: Option<&'d dyn Transform>,
}

impl<'d> ImageBatches<'d> {
    /// Batches of `dataset` as it is.
    pub fn new(dataset: &'d dyn Dataset) -> Self {
        ImageBatches {
            dataset,
            transform: None,
        }
    }

    /// Applies `transform` to every sample (in the loader's workers).
    pub fn with_transform(mut self, transform: Option<&'d dyn Transform>) -> Self {
        self.transform = transform;
        self
    }
}

impl BatchSource for ImageBatches<'_> {
    type Batch = Batch;

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn batch(&self, indices: &[usize], ctx: BatchContext, device: &Device) -> Result<Batch> {
        let shape = self.dataset.item_shape();
        let sample = |i: usize, slot: &mut [f32]| -> Result<Option<usize>> {
            let run = catch_unwind(AssertUnwindSafe(|| {
                let mut rng = SampleRng::new(ctx.seed, ctx.epoch, i);
                let label = self.dataset.fill_sample(i, &mut rng, slot)?;
                if let (Some(t), Some(_)) = (self.transform, label) {
                    t.apply(slot, shape, &mut rng);
                }
                Ok(label)
            }));
            match run {
                Ok(Ok(label)) => Ok(label),
                Ok(Err(e @ KilnError::DataItem { .. })) => Err(e),
                Ok(Err(e)) => Err(KilnError::DataItem {
                    index: i,
                    problem: e.to_string(),
                }),
                Err(payload) => Err(KilnError::DataItem {
                    index: i,
                    problem: format!("the dataset panicked: {}", panic_text(&*payload)),
                }),
            }
        };
        collate_with(self.dataset, indices, device, sample)
    }

    fn epoch_order(&self, seed: u64, epoch: usize) -> Option<Vec<usize>> {
        self.dataset.epoch_order(seed, epoch)
    }

    fn take_skipped(&self) -> Vec<SkippedSample> {
        self.dataset.take_skipped()
    }
}

/// A Burn `Dataset<I>` and `Batcher<I, O>` as a [`BatchSource`] of the user's batch type `O`:
/// the data a Burn user already has goes through Kiln's loader (workers, bounded prefetch,
/// seeded shuffling, every sample exactly once per epoch) unchanged.
pub struct BurnBatches<I, O> {
    dataset: Box<dyn burn::data::dataset::Dataset<I>>,
    batcher: Box<dyn Batcher<I, O>>,
}

impl<I, O> BurnBatches<I, O> {
    /// Batches of `dataset` made by `batcher`.
    pub fn new(
        dataset: impl burn::data::dataset::Dataset<I> + 'static,
        batcher: impl Batcher<I, O> + 'static,
    ) -> Self {
        BurnBatches {
            dataset: Box::new(dataset),
            batcher: Box::new(batcher),
        }
    }
}

impl<I, O: Send> BatchSource for BurnBatches<I, O> {
    type Batch = O;

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn batch(&self, indices: &[usize], _ctx: BatchContext, device: &Device) -> Result<O> {
        let mut items = Vec::with_capacity(indices.len());
        for &index in indices {
            check_index(index, self.dataset.len())?;
            let item = self.dataset.get(index).map_err(|e| KilnError::DataItem {
                index,
                problem: e.to_string(),
            })?;
            items.push(item);
        }
        // Burn's batchers panic on bad items (their contract has no error); the loader turns
        // a panic into an error naming the batch.
        Ok(self.batcher.batch(items, device))
    }
}

/// The text of a panic payload.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}
