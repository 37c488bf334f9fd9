//! Per-sample image transforms that run in the loader's workers: normalize, random crop with
//! padding, horizontal flip and a light random affine (rotation, translation, scale).
//!
//! Every random choice comes from a [`SampleRng`] seeded by `(seed, epoch, index)`, so a
//! sample is augmented the same way whichever worker handles it and whenever it runs: worker
//! count and timing never change a run. Padding replicates the edge pixels (torchvision's
//! `padding_mode="edge"`), which keeps the background of an already-normalized image without
//! knowing the normalization.

use std::cell::RefCell;

use crate::error::{KilnError, Result};

use super::synthetic::mix;

/// A small deterministic random stream for one sample (SplitMix64).
#[derive(Debug, Clone)]
pub struct SampleRng {
    state: u64,
}

impl SampleRng {
    /// The stream for sample `index` in `epoch` of a run seeded with `seed`.
    pub fn new(seed: u64, epoch: usize, index: usize) -> Self {
        let key = seed
            ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        SampleRng { state: mix(key) }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.uniform()
    }

    /// Uniform integer in `0..=max`.
    pub fn below_or_eq(&mut self, max: usize) -> usize {
        (self.next_u64() % (max as u64 + 1)) as usize
    }
}

/// One per-sample transform. `sample` is `[C, H, W]` row-major with `shape`; the transform
/// rewrites it in place and must keep the shape (batches are collated into one tensor).
pub trait Transform: Send + Sync {
    /// Applies the transform.
    fn apply(&self, sample: &mut [f32], shape: [usize; 3], rng: &mut SampleRng);

    /// A stable description (parameters included): part of cache keys and the plan.
    fn describe(&self) -> String;
}

/// Per-channel `(x - mean) / std`.
#[derive(Debug, Clone)]
pub struct Normalize {
    mean: Vec<f32>,
    std: Vec<f32>,
}

impl Normalize {
    /// Per-channel statistics; a single value applies to every channel.
    pub fn new(mean: Vec<f32>, std: Vec<f32>) -> Result<Self> {
        if mean.is_empty() || mean.len() != std.len() {
            return Err(KilnError::Inconsistent(format!(
                "Normalize needs as many means as standard deviations (got {} and {})",
                mean.len(),
                std.len()
            )));
        }
        if let Some(s) = std.iter().find(|s| !(**s > 0.0 && s.is_finite())) {
            return Err(KilnError::Inconsistent(format!(
                "Normalize: standard deviation {s} must be positive and finite"
            )));
        }
        Ok(Normalize { mean, std })
    }
}

impl Transform for Normalize {
    fn apply(&self, sample: &mut [f32], [c, h, w]: [usize; 3], _: &mut SampleRng) {
        for ch in 0..c {
            let (m, s) = if self.mean.len() == 1 {
                (self.mean[0], self.std[0])
            } else {
                (
                    self.mean[ch % self.mean.len()],
                    self.std[ch % self.std.len()],
                )
            };
            let inv = 1.0 / s;
            for v in &mut sample[ch * h * w..(ch + 1) * h * w] {
                *v = (*v - m) * inv;
            }
        }
    }

    fn describe(&self) -> String {
        format!("normalize(mean={:?},std={:?})", self.mean, self.std)
    }
}

thread_local! {
    /// One scratch plane per worker thread: transforms that move pixels read from a copy, and
    /// allocating it per sample would cost more than the transform.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f(copy_of_plane, plane)` for each channel plane with a reused scratch copy.
fn per_plane(sample: &mut [f32], [c, h, w]: [usize; 3], mut f: impl FnMut(&[f32], &mut [f32])) {
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        scratch.resize(h * w, 0.0);
        for ch in 0..c {
            let plane = &mut sample[ch * h * w..(ch + 1) * h * w];
            scratch.copy_from_slice(plane);
            f(&scratch, plane);
        }
    });
}

/// Random crop of the original size from the image padded by `padding` on every side (the
/// CIFAR/MNIST "shift" augmentation), edge-replicated.
#[derive(Debug, Clone, Copy)]
pub struct RandomCrop {
    padding: usize,
}

impl RandomCrop {
    /// A crop with `padding` pixels of slack on each side.
    pub fn new(padding: usize) -> Self {
        RandomCrop { padding }
    }
}

impl Transform for RandomCrop {
    fn apply(&self, sample: &mut [f32], shape: [usize; 3], rng: &mut SampleRng) {
        let p = self.padding as isize;
        // Offsets of the crop window in padded coordinates, shifted back to the original:
        // the same shift for every channel.
        let dy = rng.below_or_eq(2 * self.padding) as isize - p;
        let dx = rng.below_or_eq(2 * self.padding) as isize - p;
        if dx == 0 && dy == 0 {
            return;
        }
        let [_, h, w] = shape;
        per_plane(sample, shape, |src, dst| {
            for y in 0..h {
                let sy = (y as isize + dy).clamp(0, h as isize - 1) as usize;
                for x in 0..w {
                    let sx = (x as isize + dx).clamp(0, w as isize - 1) as usize;
                    dst[y * w + x] = src[sy * w + sx];
                }
            }
        });
    }

    fn describe(&self) -> String {
        format!("random_crop(padding={})", self.padding)
    }
}

/// Mirror left↔right with probability `p`.
#[derive(Debug, Clone, Copy)]
pub struct RandomHorizontalFlip {
    p: f32,
}

impl RandomHorizontalFlip {
    /// A flip taken with probability `p`.
    pub fn new(p: f32) -> Self {
        RandomHorizontalFlip {
            p: p.clamp(0.0, 1.0),
        }
    }
}

impl Transform for RandomHorizontalFlip {
    fn apply(&self, sample: &mut [f32], [c, h, w]: [usize; 3], rng: &mut SampleRng) {
        if rng.uniform() >= self.p {
            return;
        }
        for row in sample[..c * h * w].chunks_exact_mut(w) {
            row.reverse();
        }
    }

    fn describe(&self) -> String {
        format!("random_hflip(p={})", self.p)
    }
}

/// A light random affine: rotation within ±`degrees`, translation within ±`translate` of the
/// size, isotropic scale in `[scale.0, scale.1]`; bilinear sampling, edge-replicated.
#[derive(Debug, Clone, Copy)]
pub struct RandomAffine {
    degrees: f32,
    translate: f32,
    scale: (f32, f32),
}

impl RandomAffine {
    /// A random affine with the given ranges.
    pub fn new(degrees: f32, translate: f32, scale: (f32, f32)) -> Result<Self> {
        if !(degrees >= 0.0
            && (0.0..0.5).contains(&translate)
            && scale.0 > 0.0
            && scale.0 <= scale.1)
        {
            return Err(KilnError::Inconsistent(format!(
                "RandomAffine needs degrees >= 0, translate in [0, 0.5), 0 < scale.0 <= scale.1 \
                 (got {degrees}, {translate}, {scale:?})"
            )));
        }
        Ok(RandomAffine {
            degrees,
            translate,
            scale,
        })
    }
}

impl Transform for RandomAffine {
    fn apply(&self, sample: &mut [f32], shape: [usize; 3], rng: &mut SampleRng) {
        let [_, h, w] = shape;
        let angle = rng.range(-self.degrees, self.degrees).to_radians();
        let tx = rng.range(-self.translate, self.translate) * w as f32;
        let ty = rng.range(-self.translate, self.translate) * h as f32;
        let s = rng.range(self.scale.0, self.scale.1);
        // Inverse mapping: for each output pixel, where it comes from in the input.
        let (sin, cos) = angle.sin_cos();
        let (cx, cy) = ((w as f32 - 1.0) / 2.0, (h as f32 - 1.0) / 2.0);
        per_plane(sample, shape, |src, dst| {
            let at = |x: isize, y: isize| {
                src[y.clamp(0, h as isize - 1) as usize * w + x.clamp(0, w as isize - 1) as usize]
            };
            for y in 0..h {
                for x in 0..w {
                    let (ox, oy) = (x as f32 - cx - tx, y as f32 - cy - ty);
                    let sx = (cos * ox + sin * oy) / s + cx;
                    let sy = (-sin * ox + cos * oy) / s + cy;
                    let (x0, y0) = (sx.floor(), sy.floor());
                    let (fx, fy) = (sx - x0, sy - y0);
                    let (x0, y0) = (x0 as isize, y0 as isize);
                    let top = at(x0, y0) * (1.0 - fx) + at(x0 + 1, y0) * fx;
                    let bottom = at(x0, y0 + 1) * (1.0 - fx) + at(x0 + 1, y0 + 1) * fx;
                    dst[y * w + x] = top * (1.0 - fy) + bottom * fy;
                }
            }
        });
    }

    fn describe(&self) -> String {
        format!(
            "random_affine(degrees={},translate={},scale={:?})",
            self.degrees, self.translate, self.scale
        )
    }
}

/// Transforms applied in order.
#[derive(Default)]
pub struct Compose {
    steps: Vec<Box<dyn Transform>>,
}

impl Compose {
    /// An empty pipeline.
    pub fn new() -> Self {
        Compose::default()
    }

    /// Appends a transform.
    pub fn then(mut self, t: impl Transform + 'static) -> Self {
        self.steps.push(Box::new(t));
        self
    }

    /// Whether the pipeline does nothing.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

impl Transform for Compose {
    fn apply(&self, sample: &mut [f32], shape: [usize; 3], rng: &mut SampleRng) {
        for t in &self.steps {
            t.apply(sample, shape, rng);
        }
    }

    fn describe(&self) -> String {
        let parts: Vec<String> = self.steps.iter().map(|t| t.describe()).collect();
        format!("[{}]", parts.join(","))
    }
}

/// The augmentation presets `data.augment` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Augment {
    /// No augmentation.
    #[default]
    None,
    /// Random crop with padding (2 px for ≤ 28 px images, 4 px above).
    Crop,
    /// Random crop with padding, then a horizontal flip with p = 0.5 (natural images; not
    /// digits, whose meaning a mirror can change).
    CropFlip,
    /// A light random affine: ±10°, ±8% translation, scale 0.9–1.1.
    Affine,
}

impl Augment {
    /// The preset for a `data.augment` value.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(Augment::None),
            "crop" => Ok(Augment::Crop),
            "crop-flip" => Ok(Augment::CropFlip),
            "affine" => Ok(Augment::Affine),
            other => Err(KilnError::InvalidValue {
                key: "data.augment".into(),
                value: format!("\"{other}\""),
                expected: "one of \"none\", \"crop\", \"crop-flip\", \"affine\"".into(),
            }),
        }
    }

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Augment::None => "none",
            Augment::Crop => "crop",
            Augment::CropFlip => "crop-flip",
            Augment::Affine => "affine",
        }
    }

    /// The transform pipeline for images of `shape`, or `None` for no augmentation.
    pub fn build(self, [_, h, w]: [usize; 3]) -> Option<Compose> {
        let padding = if h.max(w) <= 28 { 2 } else { 4 };
        match self {
            Augment::None => None,
            Augment::Crop => Some(Compose::new().then(RandomCrop::new(padding))),
            Augment::CropFlip => Some(
                Compose::new()
                    .then(RandomCrop::new(padding))
                    .then(RandomHorizontalFlip::new(0.5)),
            ),
            Augment::Affine => RandomAffine::new(10.0, 0.08, (0.9, 1.1))
                .ok()
                .map(|a| Compose::new().then(a)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(c: usize, h: usize, w: usize) -> Vec<f32> {
        (0..c * h * w).map(|i| i as f32).collect()
    }

    #[test]
    fn same_seed_epoch_index_gives_the_same_augmentation() {
        let t = Augment::Affine.build([1, 8, 8]).expect("affine");
        let (mut a, mut b) = (ramp(1, 8, 8), ramp(1, 8, 8));
        t.apply(&mut a, [1, 8, 8], &mut SampleRng::new(7, 2, 5));
        t.apply(&mut b, [1, 8, 8], &mut SampleRng::new(7, 2, 5));
        assert_eq!(a, b);
        let mut c = ramp(1, 8, 8);
        t.apply(&mut c, [1, 8, 8], &mut SampleRng::new(7, 3, 5));
        assert_ne!(a, c, "another epoch must draw another transform");
    }

    #[test]
    fn crop_is_a_shift_with_edge_replication() {
        let shape = [2, 5, 6];
        let src = ramp(2, 5, 6);
        // Find a seed whose draw is a real shift, then check every pixel against the formula.
        for seed in 0..50 {
            let mut rng = SampleRng::new(seed, 0, 0);
            let p = 2usize;
            let dy = rng.below_or_eq(2 * p) as isize - p as isize;
            let dx = rng.below_or_eq(2 * p) as isize - p as isize;
            let mut out = src.clone();
            RandomCrop::new(p).apply(&mut out, shape, &mut SampleRng::new(seed, 0, 0));
            for ch in 0..2 {
                for y in 0..5isize {
                    for x in 0..6isize {
                        let sy = (y + dy).clamp(0, 4) as usize;
                        let sx = (x + dx).clamp(0, 5) as usize;
                        assert_eq!(
                            out[ch * 30 + y as usize * 6 + x as usize],
                            src[ch * 30 + sy * 6 + sx]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn flip_mirrors_rows_and_identity_affine_keeps_the_image() {
        let mut x = ramp(1, 2, 3);
        RandomHorizontalFlip::new(1.0).apply(&mut x, [1, 2, 3], &mut SampleRng::new(0, 0, 0));
        assert_eq!(x, vec![2.0, 1.0, 0.0, 5.0, 4.0, 3.0]);
        let mut y = ramp(3, 7, 9);
        let id = RandomAffine::new(0.0, 0.0, (1.0, 1.0)).expect("valid");
        id.apply(&mut y, [3, 7, 9], &mut SampleRng::new(1, 1, 1));
        for (a, b) in y.iter().zip(ramp(3, 7, 9)) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn normalize_per_channel_and_bad_parameters_are_refused() {
        let n = Normalize::new(vec![1.0, 2.0], vec![2.0, 4.0]).expect("valid");
        let mut x = vec![3.0, 3.0, 6.0, 6.0];
        n.apply(&mut x, [2, 1, 2], &mut SampleRng::new(0, 0, 0));
        assert_eq!(x, vec![1.0, 1.0, 1.0, 1.0]);
        assert!(Normalize::new(vec![0.0], vec![0.0]).is_err());
        assert!(Normalize::new(vec![0.0, 1.0], vec![1.0]).is_err());
        assert!(RandomAffine::new(5.0, 0.7, (1.0, 1.0)).is_err());
        assert!(Augment::from_name("mixup").is_err());
    }
}
