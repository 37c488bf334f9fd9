//! Tuning: measurements turned into decisions. So far: bottleneck detection from the step's
//! phase split ([`bottleneck`]). Batch-size search and the auto-optimizer build on it.

pub mod bottleneck;

pub use bottleneck::{Bottleneck, RunContext, StepSplit, Verdict, diagnose};
