//! Learning-rate schedules as pure functions of the step, so a resumed run needs no
//! scheduler state to continue exactly.

use super::{Schedule, TrainOptions};

/// The learning rate for optimizer step `step` (0-based) of `total_steps`.
///
/// Linear warm-up from `lr / warmup_steps` to `lr` over the first `warmup_steps` steps, then
/// constant, or cosine decay to `min_lr_ratio × lr` at the final step.
pub fn learning_rate(options: &TrainOptions, step: u64, total_steps: u64) -> f64 {
    let peak = options.lr;
    if step < options.warmup_steps {
        return peak * (step + 1) as f64 / options.warmup_steps as f64;
    }
    match options.schedule {
        Schedule::Constant => peak,
        Schedule::Cosine => {
            let floor = peak * options.min_lr_ratio;
            let span = total_steps.saturating_sub(options.warmup_steps).max(1);
            let progress = ((step - options.warmup_steps) as f64 / span as f64).min(1.0);
            floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}
