//! Where a sample's pixels come from: the crop box of torchvision v2's `RandomResizedCrop`,
//! `Resize` + `CenterCrop` and plain `Resize`, in the displayed image's coordinates.
//!
//! The box is planned from the header's size alone, before decoding, so the decoder can be
//! told how small it may decode (JPEG's scaled IDCT) and the resize reads only the box.

use crate::data::SampleRng;

/// A crop box in pixels (fractional: a box planned on a full-size image, mapped to a
/// reduced decode).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CropBox {
    /// Left edge.
    pub left: f64,
    /// Top edge.
    pub top: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

impl CropBox {
    /// The same box on an image decoded at 1/`scale`.
    pub fn scaled(self, scale: usize) -> CropBox {
        let s = scale as f64;
        CropBox {
            left: self.left / s,
            top: self.top / s,
            width: self.width / s,
            height: self.height / s,
        }
    }
}

/// How the output's pixels are chosen from the image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CropMode {
    /// torchvision v2 `RandomResizedCrop(size, scale, ratio)`: a random box of `scale` of
    /// the area and `ratio` (w/h, sampled log-uniformly) up to 10 tries, else the central
    /// box of the nearest allowed ratio; resized to the output size.
    RandomResized {
        /// Area range, as shares of the image (torchvision: 0.08..1.0).
        scale: (f64, f64),
        /// Aspect range w/h (torchvision: 3/4..4/3).
        ratio: (f64, f64),
    },
    /// torchvision v2 `Resize(shorter)` then `CenterCrop(size)`: the evaluation transform
    /// (ImageNet: 256 then 224).
    ResizeCenterCrop {
        /// What the shorter side is resized to before the crop.
        shorter: usize,
    },
    /// The whole image resized to the output size (aspect not kept).
    Resize,
}

impl CropMode {
    /// torchvision's defaults for `RandomResizedCrop`.
    pub const RANDOM_RESIZED: CropMode = CropMode::RandomResized {
        scale: (0.08, 1.0),
        ratio: (3.0 / 4.0, 4.0 / 3.0),
    };

    /// The box for an image of `width × height` and an output of `out_w × out_h`; random
    /// modes draw from `rng`.
    pub fn plan(
        &self,
        width: usize,
        height: usize,
        (out_w, out_h): (usize, usize),
        rng: &mut SampleRng,
    ) -> CropBox {
        let (w, h) = (width as f64, height as f64);
        match *self {
            CropMode::RandomResized { scale, ratio } => random_resized(w, h, scale, ratio, rng),
            CropMode::ResizeCenterCrop { shorter } => {
                // torchvision's `_compute_resized_output_size`: the shorter side becomes
                // `shorter`, the longer `int(shorter * long / short)`.
                let (rw, rh) = if width <= height {
                    (shorter, (shorter as f64 * h / w) as usize)
                } else {
                    ((shorter as f64 * w / h) as usize, shorter)
                };
                let (sx, sy) = (w / rw as f64, h / rh as f64);
                // CenterCrop: `int(round((size_in - size_out) / 2))`, Python's round (half to
                // even); a crop larger than the resized image is padded by torchvision, here
                // clamped to the image.
                let left = ((rw as f64 - out_w as f64) / 2.0)
                    .round_ties_even()
                    .max(0.0);
                let top = ((rh as f64 - out_h as f64) / 2.0)
                    .round_ties_even()
                    .max(0.0);
                CropBox {
                    left: left * sx,
                    top: top * sy,
                    width: (out_w.min(rw) as f64) * sx,
                    height: (out_h.min(rh) as f64) * sy,
                }
            }
            CropMode::Resize => CropBox {
                left: 0.0,
                top: 0.0,
                width: w,
                height: h,
            },
        }
    }

    /// A stable description (cache keys, the plan).
    pub fn describe(&self) -> String {
        match self {
            CropMode::RandomResized { scale, ratio } => format!(
                "random_resized_crop(scale={:?},ratio=({:.4},{:.4}))",
                scale, ratio.0, ratio.1
            ),
            CropMode::ResizeCenterCrop { shorter } => {
                format!("resize({shorter})+center_crop")
            }
            CropMode::Resize => "resize".into(),
        }
    }
}

/// torchvision v2 `RandomResizedCrop.make_params`, step for step.
fn random_resized(
    w: f64,
    h: f64,
    (s_lo, s_hi): (f64, f64),
    (r_lo, r_hi): (f64, f64),
    rng: &mut SampleRng,
) -> CropBox {
    let area = w * h;
    let (log_lo, log_hi) = (r_lo.ln(), r_hi.ln());
    for _ in 0..10 {
        let target = area * (s_lo + (s_hi - s_lo) * rng.uniform() as f64);
        let aspect = (log_lo + (log_hi - log_lo) * rng.uniform() as f64).exp();
        let cw = (target * aspect).sqrt().round_ties_even();
        let ch = (target / aspect).sqrt().round_ties_even();
        if cw > 0.0 && cw <= w && ch > 0.0 && ch <= h {
            let top = rng.below_or_eq((h - ch) as usize) as f64;
            let left = rng.below_or_eq((w - cw) as usize) as f64;
            return CropBox {
                left,
                top,
                width: cw,
                height: ch,
            };
        }
    }
    // Fallback: the central box of the nearest allowed ratio.
    let in_ratio = w / h;
    let (cw, ch) = if in_ratio < r_lo {
        (w, (w / r_lo).round_ties_even())
    } else if in_ratio > r_hi {
        ((h * r_hi).round_ties_even(), h)
    } else {
        (w, h)
    };
    CropBox {
        left: ((w - cw) / 2.0).floor(),
        top: ((h - ch) / 2.0).floor(),
        width: cw,
        height: ch,
    }
}

/// The largest of `scales` at which the box still has at least the output's pixels on both
/// axes: decoding smaller would lose detail the output keeps.
pub fn decode_scale(scales: &[usize], crop: &CropBox, (out_w, out_h): (usize, usize)) -> usize {
    scales
        .iter()
        .copied()
        .filter(|&k| {
            crop.width / k as f64 >= out_w as f64 && crop.height / k as f64 >= out_h as f64
        })
        .max()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_resized_boxes_stay_inside_and_follow_the_ranges() {
        let mode = CropMode::RANDOM_RESIZED;
        let (w, h) = (500usize, 375usize);
        let mut areas = Vec::new();
        for i in 0..2000 {
            let b = mode.plan(w, h, (224, 224), &mut SampleRng::new(1, 0, i));
            assert!(b.left >= 0.0 && b.top >= 0.0);
            assert!(b.left + b.width <= w as f64 && b.top + b.height <= h as f64);
            let ratio = b.width / b.height;
            assert!(
                (0.74..=1.36).contains(&ratio) || b.width == w as f64,
                "{b:?}"
            );
            areas.push(b.width * b.height / (w * h) as f64);
        }
        let mean = areas.iter().sum::<f64>() / areas.len() as f64;
        // Uniform area in [0.08, 1] has mean 0.54; the rejected tries pull it down a little.
        assert!((0.40..0.56).contains(&mean), "mean area share {mean}");
    }

    #[test]
    fn center_crop_matches_torchvision_arithmetic() {
        // 500×375 → Resize(256) → 341×256 → CenterCrop(224): left round(58.5) = 58 (Python
        // rounds half to even), top 16.
        let b = CropMode::ResizeCenterCrop { shorter: 256 }.plan(
            500,
            375,
            (224, 224),
            &mut SampleRng::new(0, 0, 0),
        );
        let sx = 500.0 / 341.0;
        assert!((b.left - 58.0 * sx).abs() < 1e-9, "{b:?}");
        assert!((b.width - 224.0 * sx).abs() < 1e-9);
        assert!((b.top - 16.0 * 375.0 / 256.0).abs() < 1e-9);
    }

    #[test]
    fn decode_scale_keeps_the_output_resolution() {
        let crop = |w: f64, h: f64| CropBox {
            left: 0.0,
            top: 0.0,
            width: w,
            height: h,
        };
        let scales = [1, 2, 4, 8];
        assert_eq!(decode_scale(&scales, &crop(500.0, 375.0), (224, 224)), 1);
        assert_eq!(decode_scale(&scales, &crop(4000.0, 3000.0), (224, 224)), 8);
        assert_eq!(decode_scale(&scales, &crop(1000.0, 900.0), (224, 224)), 4);
        assert_eq!(decode_scale(&[1], &crop(4000.0, 3000.0), (224, 224)), 1);
    }
}
