//! A synthetic but realistic video stream to measure the real-time techniques on: MNIST digits
//! in a grid of slots over a static textured background, each digit resting or drifting by a
//! pixel per frame, digits replaced now and then, sensor noise on every frame, and scene cuts
//! (new background, new digits everywhere). Seeded and generated in code from a labelled
//! digit set (the bundled MNIST test split, unseen in training), so every run sees the same
//! frames and the ground truth of every slot in every frame is known.
//!
//! Why slots: a camera over lanes, shelves or seats watches fixed regions where objects come,
//! sit and go; the region layout is known, and most regions are unchanged most of the time,
//! which is exactly what temporal coherence and regions of interest exploit.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::Frame;
use super::roi::Roi;
use crate::data::{ImageDataset, MNIST_MEAN_STD};
use crate::error::{KilnError, Result};

/// The shape of a synthetic stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VideoSpec {
    /// Frames to generate.
    pub frames: usize,
    /// Slots per column and per row (`[rows, cols]`); each slot is one digit's side.
    pub grid: [usize; 2],
    /// Seed of everything random.
    pub seed: u64,
    /// Shortest and longest scene, in frames.
    pub scene_frames: [usize; 2],
    /// Mean frames between two replacements of one slot's digit (0 = only at scene cuts).
    pub swap_every: usize,
    /// Largest offset of a digit from its slot's centre, in pixels.
    pub max_shift: usize,
    /// Shortest and longest resting phase of a digit, in frames.
    pub rest_frames: [usize; 2],
    /// Shortest and longest moving phase (one pixel per frame), in frames.
    pub move_frames: [usize; 2],
    /// Standard deviation of the per-frame sensor noise, in pixel intensity (0..1).
    pub noise: f32,
    /// Brightest value of the background texture, in pixel intensity (0..1).
    pub background: f32,
}

impl Default for VideoSpec {
    /// 1,200 frames of a 2×2 grid (56×56 pixels), scenes of 60–150 frames.
    fn default() -> Self {
        VideoSpec {
            frames: 1200,
            grid: [2, 2],
            seed: 7,
            scene_frames: [60, 150],
            swap_every: 120,
            max_shift: 2,
            rest_frames: [8, 40],
            move_frames: [2, 6],
            noise: 0.01,
            background: 0.08,
        }
    }
}

/// A generated stream with its ground truth.
#[derive(Debug, Clone)]
pub struct SyntheticVideo {
    /// The frames, normalized as MNIST is for the zoo's models.
    pub frames: Vec<Frame>,
    /// The true digit of each slot in each frame (`labels[frame][slot]`).
    pub labels: Vec<Vec<usize>>,
    /// The frames that start a new scene (frame 0 included).
    pub scene_cuts: Vec<usize>,
    /// The slots as regions, in the order of `labels[frame]`.
    pub regions: Vec<Roi>,
}

/// One slot's digit and its motion.
struct Slot {
    digit: usize,
    offset: [i64; 2],
    velocity: [i64; 2],
    phase_left: usize,
}

impl SyntheticVideo {
    /// Generates the stream of `spec` from `digits` (single-channel square images, e.g. the
    /// bundled MNIST test split).
    pub fn generate(digits: &ImageDataset, spec: &VideoSpec) -> Result<Self> {
        use crate::data::Dataset;
        let [c, side, side_w] = digits.item_shape();
        if c != 1 || side != side_w || digits.is_empty() {
            return Err(KilnError::Stream(format!(
                "the digit set must hold single-channel square images, got {} of {:?}",
                digits.len(),
                digits.item_shape()
            )));
        }
        let bad = |what: &str| Err(KilnError::Stream(format!("video spec: {what}")));
        if spec.grid.contains(&0) {
            return bad("the grid needs at least one row and one column");
        }
        if spec.scene_frames[0] == 0 || spec.scene_frames[0] > spec.scene_frames[1] {
            return bad("scene_frames must be [shortest >= 1, longest >= shortest]");
        }
        if spec.rest_frames[0] == 0
            || spec.rest_frames[0] > spec.rest_frames[1]
            || spec.move_frames[0] == 0
            || spec.move_frames[0] > spec.move_frames[1]
        {
            return bad("rest_frames and move_frames must be [shortest >= 1, longest >= shortest]");
        }
        if !(spec.noise >= 0.0 && spec.background >= 0.0 && spec.background <= 1.0) {
            return bad("noise must be >= 0 and background in [0, 1]");
        }
        let (pixels, labels) = digits.raw();
        let [rows, cols] = spec.grid;
        let (h, w) = (rows * side, cols * side);
        let regions = Roi::grid(h, w, side, side);
        let mut rng = StdRng::seed_from_u64(spec.seed);
        let mut out = SyntheticVideo {
            frames: Vec::with_capacity(spec.frames),
            labels: Vec::with_capacity(spec.frames),
            scene_cuts: Vec::new(),
            regions: regions.clone(),
        };
        let mut background = vec![0.0f32; h * w];
        let mut slots: Vec<Slot> = Vec::new();
        let mut scene_left = 0;
        let max = spec.max_shift as i64;
        let mut raw = vec![0.0f32; h * w];
        for f in 0..spec.frames {
            if scene_left == 0 {
                out.scene_cuts.push(f);
                scene_left = rng.random_range(spec.scene_frames[0]..=spec.scene_frames[1]);
                paint_background(&mut background, h, w, spec.background, &mut rng);
                slots = regions
                    .iter()
                    .map(|_| Slot {
                        digit: rng.random_range(0..labels.len()),
                        offset: [0, 0],
                        velocity: [0, 0],
                        phase_left: rng.random_range(spec.rest_frames[0]..=spec.rest_frames[1]),
                    })
                    .collect();
            }
            scene_left -= 1;
            for slot in &mut slots {
                advance(slot, spec, max, labels.len(), &mut rng);
            }
            raw.copy_from_slice(&background);
            for (slot, roi) in slots.iter().zip(&regions) {
                let digit = &pixels[slot.digit * side * side..(slot.digit + 1) * side * side];
                for y in 0..side as i64 {
                    let sy = y - slot.offset[1];
                    if !(0..side as i64).contains(&sy) {
                        continue;
                    }
                    for x in 0..side as i64 {
                        let sx = x - slot.offset[0];
                        if !(0..side as i64).contains(&sx) {
                            continue;
                        }
                        let v = f32::from(digit[(sy as usize) * side + sx as usize]) / 255.0;
                        let at = (roi.y + y as usize) * w + roi.x + x as usize;
                        raw[at] = raw[at].max(v);
                    }
                }
            }
            let values: Vec<f32> = raw
                .iter()
                .map(|&v| sensor(v, spec.noise, &mut rng))
                .collect();
            out.frames.push(Frame::new([1, h, w], values)?);
            out.labels
                .push(slots.iter().map(|s| usize::from(labels[s.digit])).collect());
        }
        Ok(out)
    }
}

/// One frame of a slot's life: a digit swap with probability `1 / swap_every`, else the
/// current rest or move phase goes on (a move shifts the digit by one pixel, bouncing inside
/// `±max`), and a finished phase starts the other kind.
fn advance(slot: &mut Slot, spec: &VideoSpec, max: i64, digits: usize, rng: &mut StdRng) {
    if spec.swap_every > 0 && rng.random_range(0..spec.swap_every) == 0 {
        slot.digit = rng.random_range(0..digits);
        slot.offset = [0, 0];
    }
    if slot.phase_left == 0 {
        if slot.velocity == [0, 0] {
            slot.phase_left = rng.random_range(spec.move_frames[0]..=spec.move_frames[1]);
            while slot.velocity == [0, 0] {
                slot.velocity = [rng.random_range(-1..=1), rng.random_range(-1..=1)];
            }
        } else {
            slot.phase_left = rng.random_range(spec.rest_frames[0]..=spec.rest_frames[1]);
            slot.velocity = [0, 0];
        }
    }
    slot.phase_left -= 1;
    for axis in 0..2 {
        let next = slot.offset[axis] + slot.velocity[axis];
        if next.abs() > max {
            slot.velocity[axis] = -slot.velocity[axis];
        }
        slot.offset[axis] = (slot.offset[axis] + slot.velocity[axis]).clamp(-max, max);
    }
}

/// A smooth texture: a product of two sinusoids of random frequency and phase, scaled to
/// `[0, peak]`.
fn paint_background(out: &mut [f32], h: usize, w: usize, peak: f32, rng: &mut StdRng) {
    let fx: f32 = rng.random_range(0.05..0.3);
    let fy: f32 = rng.random_range(0.05..0.3);
    let (px, py): (f32, f32) = (rng.random_range(0.0..6.3), rng.random_range(0.0..6.3));
    for y in 0..h {
        for x in 0..w {
            let v = (fx * x as f32 + px).sin() * (fy * y as f32 + py).cos();
            out[y * w + x] = peak * 0.5 * (1.0 + v);
        }
    }
}

/// A labelled digit set seen as the stream sees its digits: each sample composited over a
/// background texture of the stream's kind with sensor noise (both seeded by the sample's
/// index, so an epoch is reproducible). Models trained on it know the stream's domain, as a
/// user's models are trained on their own camera's frames.
pub struct StreamLike<D> {
    inner: D,
    spec: VideoSpec,
}

impl<D: crate::data::Dataset> StreamLike<D> {
    /// `inner` (normalized as MNIST) composited as frames of `spec` are.
    pub fn new(inner: D, spec: &VideoSpec) -> Self {
        StreamLike {
            inner,
            spec: spec.clone(),
        }
    }
}

impl<D: crate::data::Dataset> crate::data::Dataset for StreamLike<D> {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn item_shape(&self) -> [usize; 3] {
        self.inner.item_shape()
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let label = self.inner.fill(index, out)?;
        let [_, h, w] = self.inner.item_shape();
        let mut rng =
            StdRng::seed_from_u64(self.spec.seed ^ (index as u64).wrapping_mul(0x9e37_79b9));
        let mut background = vec![0.0f32; h * w];
        paint_background(&mut background, h, w, self.spec.background, &mut rng);
        let (mean, std) = MNIST_MEAN_STD;
        for (v, b) in out.iter_mut().zip(background.iter().cycle()) {
            // Back to pixel intensity, over the background, then as the camera records it.
            *v = sensor((*v * std + mean).max(*b), self.spec.noise, &mut rng);
        }
        Ok(label)
    }
}

/// A pixel intensity `raw` (0..1) as the stream records it: sensor noise of standard deviation
/// `noise`, clamped to the valid range, normalized as MNIST is for the zoo's models.
fn sensor(raw: f32, noise: f32, rng: &mut StdRng) -> f32 {
    let (mean, std) = MNIST_MEAN_STD;
    let noisy = (raw + noise * gaussian(rng)).clamp(0.0, 1.0);
    (noisy - mean) / std
}

/// A standard normal draw (Box–Muller).
fn gaussian(rng: &mut StdRng) -> f32 {
    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
    let u2: f32 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datasets::{Split, bundled};

    fn small() -> VideoSpec {
        VideoSpec {
            frames: 200,
            ..VideoSpec::default()
        }
    }

    #[test]
    fn the_stream_is_seeded_shaped_and_labelled() {
        let digits = bundled(Split::Test).unwrap();
        let a = SyntheticVideo::generate(&digits, &small()).unwrap();
        let b = SyntheticVideo::generate(&digits, &small()).unwrap();
        assert_eq!(a.frames, b.frames, "same seed, same frames");
        assert_eq!(a.frames.len(), 200);
        assert_eq!(a.frames[0].shape(), [1, 56, 56]);
        assert_eq!(a.regions.len(), 4);
        assert!(
            a.labels
                .iter()
                .all(|l| l.len() == 4 && l.iter().all(|&d| d < 10))
        );
        assert_eq!(a.scene_cuts[0], 0);
        assert!(
            a.scene_cuts.len() >= 2,
            "200 frames hold at least two scenes"
        );
        let c = SyntheticVideo::generate(&digits, &VideoSpec { seed: 8, ..small() }).unwrap();
        assert_ne!(a.frames, c.frames, "another seed, other frames");
    }

    #[test]
    fn most_consecutive_slots_are_nearly_unchanged_and_cuts_change_everything() {
        let digits = bundled(Split::Test).unwrap();
        let v = SyntheticVideo::generate(&digits, &small()).unwrap();
        let (mut quiet, mut total) = (0, 0);
        for f in 1..v.frames.len() {
            for roi in &v.regions {
                let a = super::super::crop_resize(&v.frames[f - 1], *roi, 28, 28).unwrap();
                let b = super::super::crop_resize(&v.frames[f], *roi, 28, 28).unwrap();
                let d = super::super::mean_abs_diff(&a, &b);
                total += 1;
                // Noise alone is ~0.037 in normalized units; a one-pixel move is far above.
                if d < 0.06 {
                    quiet += 1;
                }
            }
        }
        let share = quiet as f64 / total as f64;
        assert!((0.5..0.95).contains(&share), "unchanged slot share {share}");
        let cut = v.scene_cuts[1];
        let d = super::super::mean_abs_diff(v.frames[cut - 1].pixels(), v.frames[cut].pixels());
        assert!(d > 0.1, "a scene cut changes the frame: {d}");
    }

    #[test]
    fn bad_specs_and_digit_sets_are_refused_by_name() {
        let digits = bundled(Split::Test).unwrap();
        let bad = VideoSpec {
            grid: [0, 2],
            ..small()
        };
        let err = SyntheticVideo::generate(&digits, &bad).unwrap_err();
        assert!(err.to_string().contains("grid"), "{err}");
        let bad = VideoSpec {
            scene_frames: [10, 5],
            ..small()
        };
        assert!(SyntheticVideo::generate(&digits, &bad).is_err());
    }
}
