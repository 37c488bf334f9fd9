//! The pieces of a training step that keep it on the device: the [`context`] an optimizer
//! step reads its verdict and gradient factor from, and the one [`host_read`] choke point.

pub mod context;
pub mod host_read;

use burn::tensor::Device;

/// Steps between sync points when `train.sync_every` is 0 (auto) on an asynchronous device:
/// long enough that reads are off the critical path, short enough that the log keeps up and
/// an abort comes within a second or two of its step.
pub const GPU_SYNC_EVERY: usize = 25;

/// `train.sync_every` resolved for `device`: `configured` when set, else every step on the
/// CPU (`flex` computes each operation before returning, so a read costs a copy of a few
/// floats and the log is live) and [`GPU_SYNC_EVERY`] elsewhere.
pub fn resolve_sync_every(configured: usize, device: &Device) -> usize {
    match configured {
        0 if crate::kernels::is_flex(device) => 1,
        0 => GPU_SYNC_EVERY,
        n => n,
    }
}
