//! Optimization levels: named bundles of settings, as in the seed's `PerformanceConfig`.

use std::fmt;
use std::str::FromStr;

use crate::error::KilnError;

/// An optimization level. Each is a documented bundle of defaults (see [`super::schema`]):
///
/// - `basic`: plain training; every technique off. The baseline others are measured against.
/// - `advanced`: the stable recipe most users want: linear warm-up then cosine decay of the
///   learning rate and gradient clipping by global norm 1.0.
/// - `ultra`: `advanced` plus activation checkpointing (recompute memory-bound activations in
///   the backward pass), trading some compute for lower peak memory so larger batches fit.
/// - `custom`: only what the file and flags say; unspecified keys keep the neutral built-in
///   defaults (the same as `basic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Level {
    /// Plain training, techniques off.
    Basic,
    /// Warm-up + cosine schedule, global-norm clipping.
    #[default]
    Advanced,
    /// `advanced` + activation checkpointing.
    Ultra,
    /// Only what the user states.
    Custom,
}

impl Level {
    /// All levels, in order.
    pub const ALL: [Level; 4] = [Level::Basic, Level::Advanced, Level::Ultra, Level::Custom];

    /// The level's name as written in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Level::Basic => "basic",
            Level::Advanced => "advanced",
            Level::Ultra => "ultra",
            Level::Custom => "custom",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Level {
    type Err = KilnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Level::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| KilnError::InvalidValue {
                key: "level".into(),
                value: format!("{s:?}"),
                expected: "one of basic, advanced, ultra, custom".into(),
            })
    }
}
