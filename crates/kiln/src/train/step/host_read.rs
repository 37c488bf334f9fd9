//! The one place the training loop reads device values back to the host.
//!
//! Why one place: on an asynchronous device (CUDA) every read waits for all the work queued
//! before it, so a read per step keeps the host from running ahead of the device and exposes
//! every kernel launch. The loop keeps each step's loss, guard verdict, gradient norm and loss
//! scale on the device and reads them here, in one transfer, at its sync points (every
//! `train.sync_every` steps, and before evaluations, checkpoints and the end of an epoch).
//! The count lets a test hold the loop to that: zero reads between sync points.

use std::cell::Cell;

use burn::tensor::Tensor;

thread_local! {
    /// Reads made by the training loop on this thread (the trainer runs the loop on the
    /// thread that called it, so concurrent runs in other threads do not mix their counts).
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Reads `values` to the host as f32, counting the read.
pub fn read_to_host(values: Tensor<1>) -> Vec<f32> {
    READS.with(|r| r.set(r.get() + 1));
    let _s = tracing::info_span!("sync").entered();
    values
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

/// Device-to-host reads the training loop made on this thread so far.
pub fn host_reads() -> u64 {
    READS.with(Cell::get)
}
