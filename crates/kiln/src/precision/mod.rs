//! Mixed precision: the precision policy of a training step, autocast for the ops that run in
//! low precision, and dynamic loss scaling.
//!
//! With `bf16` or `f16` the parameters, their gradients and the optimizer state stay f32
//! (master weights); the forward and backward of matmuls and convolutions run in the low
//! precision through [`autocast`]; everything else runs in f32 (see the per-op table there).
//! `f16` has a narrow exponent range, so small gradients flush to zero unless the loss is
//! scaled: it uses a dynamic [`LossScaler`] by default; `bf16` has f32's range and does not.

mod autocast;
mod scaler;

use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

pub(crate) use autocast::padding_pair;
pub use autocast::{
    AutocastScope, ConvGeometry, attention, autocast, compute_dtype, conv2d, conv2d_weights,
    linear, linear_weights, matmul,
};
pub use scaler::{DeviceScaler, LossScaler, ScaleChange, ScalerState};

/// The numeric precision of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Precision {
    /// Full single precision everywhere.
    #[default]
    F32,
    /// bfloat16 matmuls/convolutions (8-bit exponent like f32, 8-bit mantissa).
    Bf16,
    /// IEEE half matmuls/convolutions (5-bit exponent, 11-bit mantissa) with loss scaling.
    F16,
}

crate::names::config_names!(Precision { F32 => "f32", Bf16 => "bf16", F16 => "f16" });

impl Precision {
    /// Every policy.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// The dtype the autocast ops compute in (`None` = f32, the plain ops).
    pub fn compute_dtype(self) -> Option<FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(FloatDType::BF16),
            Precision::F16 => Some(FloatDType::F16),
        }
    }

    /// The loss scaler this precision uses by default: dynamic for f16, none otherwise.
    pub fn default_scaler(self) -> LossScaler {
        match self {
            Precision::F16 => LossScaler::dynamic(),
            Precision::F32 | Precision::Bf16 => LossScaler::disabled(),
        }
    }
}

/// Whether the loss is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ScalingMode {
    /// The precision's default: dynamic for f16, off for f32 and bf16.
    #[default]
    Auto,
    /// Dynamic scaling (GradScaler semantics) whatever the precision.
    Dynamic,
    /// No scaling.
    Off,
}

crate::names::config_names!(ScalingMode { Auto => "auto", Dynamic => "dynamic", Off => "off" });

/// Loss-scaling settings of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerOptions {
    /// Whether to scale.
    pub mode: ScalingMode,
    /// Initial scale (torch: 2^16).
    pub init_scale: f32,
    /// Clean steps before the scale doubles (torch: 2,000).
    pub growth_interval: u32,
}

impl Default for ScalerOptions {
    fn default() -> Self {
        ScalerOptions {
            mode: ScalingMode::Auto,
            init_scale: 65_536.0,
            growth_interval: 2_000,
        }
    }
}

impl ScalerOptions {
    /// The scaler a run in `precision` starts with.
    pub fn build(&self, precision: Precision) -> LossScaler {
        let scaler = match self.mode {
            ScalingMode::Auto => precision.default_scaler(),
            ScalingMode::Dynamic => LossScaler::dynamic(),
            ScalingMode::Off => LossScaler::disabled(),
        };
        if scaler.enabled() {
            scaler
                .with_init_scale(self.init_scale)
                .with_growth_interval(self.growth_interval)
        } else {
            scaler
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_scales_by_default_and_bf16_does_not() {
        let auto = ScalerOptions::default();
        assert!(auto.build(Precision::F16).enabled());
        assert!(!auto.build(Precision::Bf16).enabled());
        assert!(!auto.build(Precision::F32).enabled());
        let forced = ScalerOptions {
            mode: ScalingMode::Dynamic,
            init_scale: 1024.0,
            growth_interval: 7,
        };
        let s = forced.build(Precision::Bf16);
        assert!(s.enabled());
        assert_eq!(s.scale(), 1024.0);
        let off = ScalerOptions {
            mode: ScalingMode::Off,
            ..auto
        };
        assert!(!off.build(Precision::F16).enabled());
    }

    #[test]
    fn names_round_trip() {
        for p in Precision::ALL {
            assert_eq!(Precision::from_name(p.name()), Some(p));
        }
        assert_eq!(Precision::from_name("fp8"), None);
    }
}
