//! torchvision v2 `ColorJitter` on float images in `[0, 1]` (HWC): brightness, contrast,
//! saturation and hue, each with a factor drawn from its range, applied in a random order.

use crate::data::SampleRng;

/// `ColorJitter(brightness, contrast, saturation, hue)`: a value `v` means a factor drawn
/// from `[max(0, 1 - v), 1 + v]` (hue: a shift from `[-v, v]`, `v ≤ 0.5`); 0 turns one off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColorJitter {
    /// Brightness spread.
    pub brightness: f32,
    /// Contrast spread.
    pub contrast: f32,
    /// Saturation spread.
    pub saturation: f32,
    /// Hue spread (fraction of the colour circle).
    pub hue: f32,
}

/// One sample's draws: the order and the factors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JitterDraw {
    order: [usize; 4],
    factors: [Option<f32>; 4],
}

/// ITU-R 601 luma, torchvision's `rgb_to_grayscale`.
fn gray(p: &[f32]) -> f32 {
    0.2989 * p[0] + 0.587 * p[1] + 0.114 * p[2]
}

impl ColorJitter {
    /// A stable description.
    pub fn describe(&self) -> String {
        format!(
            "color_jitter({},{},{},{})",
            self.brightness, self.contrast, self.saturation, self.hue
        )
    }

    /// Draws this sample's order and factors (`ColorJitter.make_params`).
    pub fn sample(&self, rng: &mut SampleRng) -> JitterDraw {
        let mut order = [0, 1, 2, 3];
        // Fisher–Yates, as torch.randperm.
        for i in (1..4).rev() {
            order.swap(i, rng.below_or_eq(i));
        }
        let mut factor = |v: f32| (v > 0.0).then(|| rng.range((1.0 - v).max(0.0), 1.0 + v));
        let b = factor(self.brightness);
        let c = factor(self.contrast);
        let s = factor(self.saturation);
        let h = (self.hue > 0.0).then(|| rng.range(-self.hue, self.hue));
        JitterDraw {
            order,
            factors: [b, c, s, h],
        }
    }
}

impl JitterDraw {
    /// Applies the draw to `img` (HWC, values in `[0, 1]`).
    pub fn apply(&self, img: &mut [f32]) {
        for &op in &self.order {
            let Some(f) = self.factors[op] else { continue };
            match op {
                0 => img.iter_mut().for_each(|v| *v = (*v * f).clamp(0.0, 1.0)),
                1 => {
                    let n = (img.len() / 3).max(1) as f32;
                    let mean = img.chunks_exact(3).map(gray).sum::<f32>() / n;
                    img.iter_mut()
                        .for_each(|v| *v = (f * *v + (1.0 - f) * mean).clamp(0.0, 1.0));
                }
                2 => img.chunks_exact_mut(3).for_each(|p| {
                    let g = gray(p);
                    p.iter_mut()
                        .for_each(|v| *v = (f * *v + (1.0 - f) * g).clamp(0.0, 1.0));
                }),
                _ => img.chunks_exact_mut(3).for_each(|p| shift_hue(p, f)),
            }
        }
    }
}

/// torchvision's `_rgb_to_hsv`, hue shift, `_hsv_to_rgb` for one pixel.
fn shift_hue(p: &mut [f32], shift: f32) {
    let (r, g, b) = (p[0], p[1], p[2]);
    let max = r.max(g).max(b);
    let min = r.min(g).min(b);
    let chroma = max - min;
    let v = max;
    let s = if max > 0.0 { chroma / max } else { 0.0 };
    let mut h = if chroma == 0.0 {
        0.0
    } else if max == r {
        ((g - b) / chroma).rem_euclid(6.0)
    } else if max == g {
        (b - r) / chroma + 2.0
    } else {
        (r - g) / chroma + 4.0
    } / 6.0;
    h = (h + shift).rem_euclid(1.0);
    let i = (h * 6.0).floor();
    let f = h * 6.0 - i;
    let (pp, q, t) = (v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f)));
    let (r, g, b) = match i as i32 % 6 {
        0 => (v, t, pp),
        1 => (q, v, pp),
        2 => (pp, v, t),
        3 => (pp, q, v),
        4 => (t, pp, v),
        _ => (v, pp, q),
    };
    p[0] = r.clamp(0.0, 1.0);
    p[1] = g.clamp(0.0, 1.0);
    p[2] = b.clamp(0.0, 1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(op: usize, f: f32) -> JitterDraw {
        let mut factors = [None; 4];
        factors[op] = Some(f);
        JitterDraw {
            order: [0, 1, 2, 3],
            factors,
        }
    }

    #[test]
    fn each_adjustment_matches_torchvision_formulas() {
        let px = [0.2f32, 0.5, 0.9, 0.6, 0.1, 0.3];
        let mut b = px;
        draw(0, 1.5).apply(&mut b);
        assert!((b[1] - 0.75).abs() < 1e-6 && b[2] == 1.0);
        let mut s = px;
        draw(2, 0.0).apply(&mut s);
        let g0 = 0.2989 * 0.2 + 0.587 * 0.5 + 0.114 * 0.9;
        assert!(s[..3].iter().all(|v| (v - g0).abs() < 1e-6));
        let mut c = px;
        draw(1, 0.0).apply(&mut c);
        let g1 = 0.2989 * 0.6 + 0.587 * 0.1 + 0.114 * 0.3;
        assert!(c.iter().all(|v| (v - (g0 + g1) / 2.0).abs() < 1e-6));
        // A full turn of hue is the identity; a third of a turn maps red to green.
        let mut h = px;
        draw(3, 0.0).apply(&mut h);
        assert!(h.iter().zip(&px).all(|(a, b)| (a - b).abs() < 1e-6));
        let mut red = [1.0f32, 0.0, 0.0];
        shift_hue(&mut red, 1.0 / 3.0);
        assert!((red[1] - 1.0).abs() < 1e-5 && red[0] < 1e-5, "{red:?}");
    }

    #[test]
    fn draws_stay_in_range_and_permute() {
        let j = ColorJitter {
            brightness: 0.4,
            contrast: 0.4,
            saturation: 0.4,
            hue: 0.1,
        };
        for i in 0..200 {
            let d = j.sample(&mut SampleRng::new(3, 0, i));
            let mut o = d.order;
            o.sort();
            assert_eq!(o, [0, 1, 2, 3]);
            for f in d.factors[..3].iter().flatten() {
                assert!((0.6..=1.4).contains(f));
            }
            assert!(d.factors[3].is_some_and(|h| (-0.1..=0.1).contains(&h)));
        }
    }
}
