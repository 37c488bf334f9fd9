//! How close a technique's results are to the full model's on every frame: top-1 agreement
//! for classes, mean IoU and pixel agreement for masks, F1 of matched boxes (IoU ≥ 0.5, same
//! class) for detections, mean absolute difference for images.

use serde::Serialize;

use super::per_frame::FrameResult;

/// Accumulated agreement over the frames of a run.
#[derive(Debug, Clone, Default)]
pub struct Agreement {
    frames: usize,
    class_hits: usize,
    /// `confusion[(reference, ours)]` pixel counts, for mean IoU.
    confusion: std::collections::HashMap<(u16, u16), u64>,
    pixels: u64,
    pixel_hits: u64,
    box_matched: usize,
    box_ours: usize,
    box_reference: usize,
    abs_diff: f64,
    values: u64,
    mismatched: usize,
}

/// The figures of an [`Agreement`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AgreementSummary {
    /// Frames compared.
    pub frames: usize,
    /// The headline figure in [0, 1]: top-1 agreement, mean IoU, box F1, or 1 − mean abs
    /// difference for images.
    pub score: f64,
    /// Share of pixels with the reference's class (masks), else equal to `score`.
    pub pixel_agreement: f64,
    /// Frames whose results could not be compared (another kind or size).
    pub mismatched: usize,
}

impl Agreement {
    /// Adds one frame: `ours` against the full model's `reference`.
    pub fn add(&mut self, ours: &FrameResult, reference: &FrameResult) {
        self.frames += 1;
        match (ours, reference) {
            (FrameResult::Class(a), FrameResult::Class(b)) => {
                self.class_hits += usize::from(a.class == b.class);
            }
            (FrameResult::Mask { labels: a, .. }, FrameResult::Mask { labels: b, .. })
                if a.len() == b.len() =>
            {
                for (&x, &y) in a.iter().zip(b) {
                    *self.confusion.entry((y, x)).or_default() += 1;
                    self.pixel_hits += u64::from(x == y);
                }
                self.pixels += a.len() as u64;
            }
            (FrameResult::Boxes(a), FrameResult::Boxes(b)) => {
                let mut used = vec![false; b.len()];
                for d in a {
                    let best = b
                        .iter()
                        .enumerate()
                        .filter(|(i, r)| !used[*i] && r.class == d.class && d.iou(r) >= 0.5)
                        .max_by(|x, y| d.iou(x.1).total_cmp(&d.iou(y.1)));
                    if let Some((i, _)) = best {
                        used[i] = true;
                        self.box_matched += 1;
                    }
                }
                self.box_ours += a.len();
                self.box_reference += b.len();
            }
            (FrameResult::Image { values: a, .. }, FrameResult::Image { values: b, .. })
                if a.len() == b.len() =>
            {
                self.abs_diff += a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| f64::from((x - y).abs()))
                    .sum::<f64>();
                self.values += a.len() as u64;
            }
            _ => self.mismatched += 1,
        }
    }

    /// The figures so far.
    pub fn summary(&self) -> AgreementSummary {
        let frames = self.frames.max(1) as f64;
        let score = if self.pixels > 0 {
            self.mean_iou()
        } else if self.box_ours + self.box_reference > 0 {
            2.0 * self.box_matched as f64 / (self.box_ours + self.box_reference) as f64
        } else if self.values > 0 {
            1.0 - self.abs_diff / self.values as f64
        } else if self.class_hits > 0 || self.mismatched < self.frames {
            self.class_hits as f64 / frames
        } else {
            0.0
        };
        let pixel_agreement = if self.pixels > 0 {
            self.pixel_hits as f64 / self.pixels as f64
        } else {
            score
        };
        AgreementSummary {
            frames: self.frames,
            score,
            pixel_agreement,
            mismatched: self.mismatched,
        }
    }

    /// Mean over classes present in either result of intersection / union.
    fn mean_iou(&self) -> f64 {
        let mut classes: Vec<u16> = self.confusion.keys().flat_map(|&(a, b)| [a, b]).collect();
        classes.sort_unstable();
        classes.dedup();
        let (mut sum, mut n) = (0.0, 0usize);
        for &c in &classes {
            let (mut inter, mut union) = (0u64, 0u64);
            for (&(r, o), &count) in &self.confusion {
                if r == c && o == c {
                    inter += count;
                }
                if r == c || o == c {
                    union += count;
                }
            }
            if union > 0 {
                sum += inter as f64 / union as f64;
                n += 1;
            }
        }
        if n == 0 { 1.0 } else { sum / n as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(labels: Vec<u16>) -> FrameResult {
        FrameResult::Mask {
            height: 1,
            width: labels.len(),
            labels,
            confidence: Vec::new(),
        }
    }

    #[test]
    fn mean_iou_averages_over_the_classes_present() {
        let mut a = Agreement::default();
        a.add(&mask(vec![0, 0, 1, 1]), &mask(vec![0, 0, 1, 1]));
        assert_eq!(a.summary().score, 1.0);
        let mut b = Agreement::default();
        // Class 0: inter 1, union 2; class 1: inter 2, union 3.
        b.add(&mask(vec![0, 1, 1, 1]), &mask(vec![0, 0, 1, 1]));
        let s = b.summary();
        assert!((s.score - (0.5 + 2.0 / 3.0) / 2.0).abs() < 1e-9, "{s:?}");
        assert_eq!(s.pixel_agreement, 0.75);
    }

    #[test]
    fn results_of_another_kind_count_as_mismatched() {
        let mut a = Agreement::default();
        a.add(&mask(vec![0]), &FrameResult::Boxes(Vec::new()));
        assert_eq!(a.summary().mismatched, 1);
    }
}
