//! A deterministic synthetic dataset of any shape, for benchmarks and tuning trials where
//! only the shapes matter (the peers time on random tensors too).

use super::Dataset;

/// `len` samples of `shape` with pseudo-random, roughly unit-variance values and labels in
/// `0..classes`, computed from `(seed, index)` on demand: no memory held, same values every
/// time.
#[derive(Debug, Clone)]
pub struct SyntheticDataset {
    len: usize,
    shape: [usize; 3],
    classes: usize,
    seed: u64,
}

impl SyntheticDataset {
    /// A synthetic dataset.
    pub fn new(len: usize, shape: [usize; 3], classes: usize, seed: u64) -> Self {
        SyntheticDataset {
            len,
            shape,
            classes: classes.max(1),
            seed,
        }
    }
}

/// SplitMix64: a tiny, high-quality mixer; enough for benchmark inputs.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dataset for SyntheticDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn item_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> crate::error::Result<usize> {
        let base = mix(self.seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        for (i, o) in out.iter_mut().enumerate() {
            // Uniform in [-sqrt(3), sqrt(3)): zero mean, unit variance.
            let u = (mix(base.wrapping_add(i as u64)) >> 40) as f32 / (1u64 << 24) as f32;
            *o = (u * 2.0 - 1.0) * 1.732_050_8;
        }
        Ok((mix(base) % self.classes as u64) as usize)
    }
}
