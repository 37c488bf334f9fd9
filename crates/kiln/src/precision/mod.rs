//! Precision policy: the seam in the training step where mixed precision plugs in.
//!
//! Today only `f32` is implemented; bf16/f16 with f32 master weights and dynamic loss
//! scaling are tracked by issue #2. The trainer calls [`Precision::scale_loss`] and
//! [`Precision::unscale_factor`] at the points where a loss scaler acts, so that work can
//! land without restructuring the step.

mod scaler;

use serde::{Deserialize, Serialize};

pub use scaler::{LossScaler, ScaleChange, ScalerState};

/// The numeric precision of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Precision {
    /// Full single precision everywhere.
    #[default]
    F32,
}

impl Precision {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
        }
    }

    /// The loss scaler this precision uses by default (f32: none).
    pub fn default_scaler(self) -> LossScaler {
        match self {
            Precision::F32 => LossScaler::disabled(),
        }
    }
}
