//! Temporal coherence: a frame that differs little from the last *computed* frame reuses that
//! frame's result.
//!
//! The reference is the last frame the model ran on, not the previous frame: comparing with
//! the previous frame would let a slow drift (a digit creeping one pixel every few frames) pass
//! the gate forever, each step below the threshold. A maximum reuse age bounds how stale a
//! result may get even on a static scene (lighting drift, a change below the threshold).

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};

/// When a frame (or region) counts as unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateConfig {
    /// Mean absolute difference per value (in the frame's normalized units) at or below which
    /// the content counts as unchanged.
    pub threshold: f32,
    /// Consecutive reuses allowed before the model must run again (0 = never reuse).
    pub max_reuse_age: u32,
}

impl GateConfig {
    /// An error naming the field when a value cannot work.
    pub fn validate(&self) -> Result<()> {
        if !(self.threshold.is_finite() && self.threshold >= 0.0) {
            return Err(KilnError::Stream(format!(
                "gate threshold must be a finite value >= 0, got {}",
                self.threshold
            )));
        }
        Ok(())
    }
}

/// What the gate decided for one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum GateDecision {
    /// Run the model (first frame, changed content, or the reuse age reached).
    Compute,
    /// Reuse the last result.
    Reuse,
}

/// The per-stream frame-difference gate.
#[derive(Debug, Clone)]
pub struct FrameGate {
    config: GateConfig,
    reference: Option<Vec<f32>>,
    age: u32,
}

impl FrameGate {
    /// A gate that has seen no frame yet.
    pub fn new(config: GateConfig) -> Result<Self> {
        config.validate()?;
        Ok(FrameGate {
            config,
            reference: None,
            age: 0,
        })
    }

    /// Decides for `values` (a frame or a region, always of the same length for one gate);
    /// on [`GateDecision::Compute`] the values become the new reference.
    pub fn check(&mut self, values: &[f32]) -> GateDecision {
        let reuse = match &self.reference {
            Some(r) if r.len() == values.len() => {
                self.age < self.config.max_reuse_age
                    && mean_abs_diff(r, values) <= self.config.threshold
            }
            _ => false,
        };
        if reuse {
            self.age += 1;
            GateDecision::Reuse
        } else {
            self.reset_to(values);
            GateDecision::Compute
        }
    }

    /// Makes `values` the reference, as if the model had just run on them.
    pub fn reset_to(&mut self, values: &[f32]) {
        match &mut self.reference {
            Some(r) if r.len() == values.len() => r.copy_from_slice(values),
            r => *r = Some(values.to_vec()),
        }
        self.age = 0;
    }

    /// Frames reused since the last computed one.
    pub fn age(&self) -> u32 {
        self.age
    }
}

/// Mean absolute difference of two equally long slices (0 for empty ones).
pub fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    if a.is_empty() {
        return 0.0;
    }
    // f64 accumulation: a 1080p frame has 2M values and the threshold is small.
    let sum: f64 = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).sum();
    (sum / a.len() as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(threshold: f32, age: u32) -> FrameGate {
        FrameGate::new(GateConfig {
            threshold,
            max_reuse_age: age,
        })
        .unwrap()
    }

    #[test]
    fn first_frame_computes_then_unchanged_frames_reuse_until_the_age_limit() {
        let mut g = gate(0.1, 2);
        let f = vec![0.5f32; 16];
        assert_eq!(g.check(&f), GateDecision::Compute);
        assert_eq!(g.check(&f), GateDecision::Reuse);
        assert_eq!(g.check(&f), GateDecision::Reuse);
        assert_eq!(g.age(), 2);
        assert_eq!(g.check(&f), GateDecision::Compute, "age limit reached");
        assert_eq!(g.age(), 0);
    }

    #[test]
    fn a_slow_drift_is_caught_because_the_reference_is_the_last_computed_frame() {
        let mut g = gate(0.1, 100);
        let mut f = vec![0.0f32; 8];
        assert_eq!(g.check(&f), GateDecision::Compute);
        let mut decisions = Vec::new();
        for _ in 0..5 {
            // Each step is 0.04 from the previous frame: below the threshold.
            f.iter_mut().for_each(|v| *v += 0.04);
            decisions.push(g.check(&f));
        }
        // 0.04, 0.08 reuse; 0.12 from the reference computes; then 0.04, 0.08 again.
        use GateDecision::*;
        assert_eq!(decisions, vec![Reuse, Reuse, Compute, Reuse, Reuse]);
    }

    #[test]
    fn a_zero_age_never_reuses_and_bad_thresholds_are_refused() {
        let mut g = gate(1.0, 0);
        let f = vec![1.0f32; 4];
        assert_eq!(g.check(&f), GateDecision::Compute);
        assert_eq!(g.check(&f), GateDecision::Compute);
        for bad in [f32::NAN, -0.1, f32::INFINITY] {
            let err = FrameGate::new(GateConfig {
                threshold: bad,
                max_reuse_age: 1,
            })
            .unwrap_err();
            assert!(err.to_string().contains("threshold"), "{err}");
        }
    }

    #[test]
    fn mean_abs_diff_is_the_mean_of_absolute_differences() {
        assert_eq!(mean_abs_diff(&[1.0, -1.0], &[0.0, 1.0]), 1.5);
        assert_eq!(mean_abs_diff(&[], &[]), 0.0);
    }
}
