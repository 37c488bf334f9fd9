//! An in-memory dataset of 8-bit images with integer labels (MNIST and the like).

use std::path::Path;

use super::Dataset;
use super::mmap::{ElementType, write_npy};
use crate::error::{KilnError, Result};

/// 8-bit images held in memory, normalized to `(x/255 - mean) / std` on read.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    pixels: Vec<u8>,
    labels: Vec<u8>,
    shape: [usize; 3],
    mean: f32,
    std: f32,
}

/// MNIST's per-pixel mean and standard deviation (of x/255), the usual normalization.
pub const MNIST_MEAN_STD: (f32, f32) = (0.1307, 0.3081);

impl ImageDataset {
    /// Builds a dataset, checking that pixel and label counts agree.
    pub fn new(pixels: Vec<u8>, labels: Vec<u8>, shape: [usize; 3]) -> Result<Self> {
        let item: usize = shape.iter().product();
        if item == 0 || pixels.len() != labels.len() * item {
            return Err(KilnError::Shape(format!(
                "{} labels need {} pixels of shape {shape:?}, got {}",
                labels.len(),
                labels.len() * item,
                pixels.len()
            )));
        }
        let (mean, std) = MNIST_MEAN_STD;
        Ok(ImageDataset {
            pixels,
            labels,
            shape,
            mean,
            std,
        })
    }

    /// The first `n` samples (for short runs and tests).
    pub fn take(mut self, n: usize) -> Self {
        let n = n.min(self.labels.len());
        let item: usize = self.shape.iter().product();
        self.pixels.truncate(n * item);
        self.labels.truncate(n);
        self
    }

    /// The stored bytes: pixels (sample after sample, `[C, H, W]` each) and labels.
    pub fn raw(&self) -> (&[u8], &[u8]) {
        (&self.pixels, &self.labels)
    }

    /// Writes the dataset as memory-mappable `.npy` files: u8 images `[N, C, H, W]` and i64
    /// labels `[N]` (what [`super::MappedImages::open_npy`] reads).
    pub fn write_npy(&self, images: &Path, labels: &Path) -> Result<()> {
        let [c, h, w] = self.shape;
        let n = self.labels.len();
        write_npy(images, ElementType::U8, &[n, c, h, w], &self.pixels)?;
        let label_bytes: Vec<u8> = self
            .labels
            .iter()
            .flat_map(|&l| (l as i64).to_le_bytes())
            .collect();
        write_npy(labels, ElementType::I64, &[n], &label_bytes)
    }

    /// The label of sample `index`.
    pub fn label(&self, index: usize) -> usize {
        self.labels[index] as usize
    }
}

impl Dataset for ImageDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn item_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let item = out.len();
        let src = &self.pixels[index * item..(index + 1) * item];
        let scale = 1.0 / (255.0 * self.std);
        let shift = self.mean / self.std;
        for (o, &p) in out.iter_mut().zip(src) {
            *o = p as f32 * scale - shift;
        }
        Ok(self.labels[index] as usize)
    }
}
