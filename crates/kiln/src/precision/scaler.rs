//! Dynamic loss scaling with torch.amp `GradScaler` semantics.
//!
//! The loss is multiplied by `scale` before backward so small f16 gradients do not flush to
//! zero; gradients are divided by it once, before clipping. A step whose gradients are not
//! finite is skipped and the scale backs off; after `growth_interval` clean steps in a row
//! the scale grows.

use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// What [`LossScaler::update`] did to the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleChange {
    /// Unchanged.
    Kept,
    /// Multiplied by the growth factor after a run of clean steps.
    Grew,
    /// Multiplied by the back-off factor after an overflow.
    BackedOff,
}

/// The scaler's persistent state (saved in checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// Current scale.
    pub scale: f32,
    /// Clean steps since the last change.
    pub good_steps: u32,
}

/// A dynamic (or disabled) loss scaler.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    enabled: bool,
    state: ScalerState,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
}

impl LossScaler {
    /// torch's defaults: initial scale 2^16, ×2 after 2,000 clean steps, ×0.5 on overflow.
    pub fn dynamic() -> Self {
        LossScaler {
            enabled: true,
            state: ScalerState {
                scale: 65_536.0,
                good_steps: 0,
            },
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2_000,
        }
    }

    /// No scaling (f32, bf16): scale stays 1.
    pub fn disabled() -> Self {
        LossScaler {
            enabled: false,
            state: ScalerState {
                scale: 1.0,
                good_steps: 0,
            },
            ..Self::dynamic()
        }
    }

    /// Overrides the initial scale (a positive, finite number).
    pub fn with_init_scale(mut self, scale: f32) -> Self {
        if scale.is_finite() && scale > 0.0 {
            self.state.scale = scale;
        }
        self
    }

    /// Overrides the growth interval (tests, short runs).
    pub fn with_growth_interval(mut self, steps: u32) -> Self {
        self.growth_interval = steps.max(1);
        self
    }

    /// Whether scaling is active.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The factor the loss is multiplied by.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The factor gradients are multiplied by to undo the scaling.
    pub fn inverse_scale(&self) -> f64 {
        1.0 / self.state.scale as f64
    }

    /// Records the outcome of a step: `found_nonfinite` = some gradient was Inf or NaN.
    pub fn update(&mut self, found_nonfinite: bool) -> ScaleChange {
        if !self.enabled {
            return ScaleChange::Kept;
        }
        if found_nonfinite {
            self.state.scale *= self.backoff_factor;
            self.state.good_steps = 0;
            return ScaleChange::BackedOff;
        }
        self.state.good_steps += 1;
        if self.state.good_steps >= self.growth_interval {
            self.state.good_steps = 0;
            let grown = self.state.scale * self.growth_factor;
            // Never grow into infinity: that would make every later step overflow.
            if grown.is_finite() {
                self.state.scale = grown;
                return ScaleChange::Grew;
            }
        }
        ScaleChange::Kept
    }

    /// The state to checkpoint.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Restores a checkpointed state.
    pub fn restore(&mut self, state: ScalerState) {
        self.state = state;
    }
}

/// The scaler's state as device tensors, updated from each step's device-side verdict
/// without a read (the training loop's host [`LossScaler`] is brought level at its sync
/// points by replaying the same verdicts: the arithmetic is exact, halving and doubling).
#[derive(Clone)]
pub struct DeviceScaler {
    /// The scale in force, `[1]`.
    pub scale: Tensor<1>,
    /// Clean steps in a row, `[1]` (f32: exact to 2²⁴, far above any growth interval).
    pub good_steps: Tensor<1>,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
}

impl LossScaler {
    /// This scaler's state on `device`; `None` when scaling is off.
    pub fn to_device(&self, device: &Device) -> Option<DeviceScaler> {
        self.enabled.then(|| DeviceScaler {
            scale: Tensor::full([1], self.state.scale, device),
            good_steps: Tensor::full([1], self.state.good_steps as f32, device),
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
        })
    }
}

impl DeviceScaler {
    /// [`LossScaler::update`] on the device: `apply` is 1 for a clean step, 0 for one whose
    /// loss or gradients were not finite.
    pub fn update(&mut self, apply: &Tensor<1>) {
        let bad = apply.clone().equal_elem(0.0);
        let good = self.good_steps.clone().add_scalar(1.0);
        let due = good.clone().greater_equal_elem(self.growth_interval as f32);
        let grown = self.scale.clone().mul_scalar(self.growth_factor);
        // Never grow into infinity (as the host scaler).
        let grow = due.clone().bool_and(grown.clone().is_finite());
        let backed_off = self.scale.clone().mul_scalar(self.backoff_factor);
        self.scale = self
            .scale
            .clone()
            .mask_where(grow, grown)
            .mask_where(bad.clone(), backed_off);
        self.good_steps = good.mask_fill(due, 0.0).mask_fill(bad, 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_at_two_to_the_sixteen_and_backs_off_on_overflow() {
        let mut s = LossScaler::dynamic();
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!(s.update(true), ScaleChange::BackedOff);
        assert_eq!(s.scale(), 32_768.0);
        assert_eq!(s.update(true), ScaleChange::BackedOff);
        assert_eq!(s.scale(), 16_384.0);
        assert_eq!(s.inverse_scale(), 1.0 / 16_384.0);
    }

    #[test]
    fn grows_after_exactly_the_interval_of_clean_steps() {
        let mut s = LossScaler::dynamic();
        for _ in 0..1_999 {
            assert_eq!(s.update(false), ScaleChange::Kept);
        }
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!(s.update(false), ScaleChange::Grew);
        assert_eq!(s.scale(), 131_072.0);
        assert_eq!(s.state().good_steps, 0);
    }

    #[test]
    fn an_overflow_resets_the_clean_run() {
        let mut s = LossScaler::dynamic().with_growth_interval(3);
        s.update(false);
        s.update(false);
        s.update(true); // forced overflow two steps before growth
        assert_eq!(s.scale(), 32_768.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 32_768.0);
        assert_eq!(s.update(false), ScaleChange::Grew);
        assert_eq!(s.scale(), 65_536.0);
    }

    #[test]
    fn never_grows_to_infinity() {
        let mut s = LossScaler::dynamic().with_growth_interval(1);
        for _ in 0..200 {
            s.update(false);
        }
        assert!(s.scale().is_finite());
    }

    #[test]
    fn disabled_scaler_keeps_scale_one() {
        let mut s = LossScaler::disabled();
        assert!(!s.enabled());
        assert_eq!(s.update(true), ScaleChange::Kept);
        assert_eq!(s.scale(), 1.0);
    }

    #[test]
    fn state_round_trips() {
        let mut s = LossScaler::dynamic().with_growth_interval(2);
        s.update(true);
        s.update(false);
        let saved = s.state();
        let mut t = LossScaler::dynamic();
        t.restore(saved);
        assert_eq!(t.scale(), 32_768.0);
        assert_eq!(t.state().good_steps, 1);
    }

    #[test]
    fn the_device_scaler_follows_the_host_scaler_step_for_step() {
        let device = Device::flex();
        let mut host = LossScaler::dynamic().with_growth_interval(3);
        let mut dev = host.to_device(&device).expect("scaling on");
        // Clean runs long enough to grow, overflows that reset them, growth to the f32 limit.
        let mut verdicts = vec![true, true, true, false, true, true, false, false, true];
        verdicts.extend([true; 400]);
        for (i, clean) in verdicts.into_iter().enumerate() {
            host.update(!clean);
            dev.update(&Tensor::full([1], if clean { 1.0 } else { 0.0 }, &device));
            let scale: f32 = dev.scale.clone().into_scalar();
            let good: f32 = dev.good_steps.clone().into_scalar();
            assert_eq!(scale, host.scale(), "step {i}");
            assert_eq!(good as u32, host.state().good_steps, "step {i}");
        }
        assert!(host.scale().is_finite());
    }
}
