//! Datasets and batching: the seam the data pipeline (issue #3) builds on.
//!
//! A [`Dataset`] knows how to write one sample into a caller's buffer; [`epoch_order`] gives
//! the seeded sample order of an epoch; [`collate`] turns a list of indices into device
//! tensors. Order depends only on (seed, epoch), never on timing, so runs are reproducible
//! and a resumed run sees exactly the batches an uninterrupted one would.

mod image;
mod synthetic;

pub use image::ImageDataset;
pub use synthetic::SyntheticDataset;

use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;

/// A finite, indexable set of labelled samples.
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
    /// [`Dataset::item_shape`]) and returns its class label.
    fn fill(&self, index: usize, out: &mut [f32]) -> usize;
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
pub fn collate(dataset: &dyn Dataset, indices: &[usize], device: &Device) -> Batch {
    let [c, h, w] = dataset.item_shape();
    let item = c * h * w;
    let mut pixels = vec![0f32; indices.len() * item];
    let mut labels = Vec::with_capacity(indices.len());
    for (slot, &i) in pixels.chunks_exact_mut(item).zip(indices) {
        labels.push(dataset.fill(i, slot) as i64);
    }
    let n = indices.len();
    Batch {
        images: Tensor::from_data(TensorData::new(pixels, [n, c, h, w]), device),
        labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        len: n,
    }
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
