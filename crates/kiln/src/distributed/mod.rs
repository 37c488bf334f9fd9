//! Data-parallel training: one model replica per process (or per thread), each on its own
//! shard of every epoch, gradients averaged by an all-reduce once per optimizer step.
//!
//! Kiln keeps a small collective interface ([`Collective`]: all-reduce sum/max, broadcast,
//! barrier) and plugs engines into it:
//! - [`SingleProcess`]: a world of one (every call a no-op), what a plain run uses;
//! - [`ThreadGroup`]: ranks as threads of one process, for tests and for trying data
//!   parallelism without a launcher;
//! - [`DeviceGroup`]: ranks as threads, one accelerator each, the gradients all-reduced on
//!   the devices by Burn's own collective (`DistributedContext`, NCCL on CUDA);
//! - `MpiCollective` (cargo feature `mpi`, module `mpi`): MPI through the `mpi` crate (rsmpi)
//!   on the system's MPI library (Debian's Open MPI), launched as HPC users do
//!   (`mpirun -n 4 kiln train ...`), across processes and machines.
//!
//! The trainer ([`crate::train::Trainer::with_collective`]) does the rest: it broadcasts rank
//! 0's initial parameters, shards each epoch's batches ([`crate::data::Shard`]), reduces the
//! gradients in flattened buckets in parameter order ([`grads`]) after the step's last
//! micro-batch (accumulation runs without a reduction per micro-batch, like DDP's `no_sync`),
//! and reduces the loss and sample counts with them, so the guard, the loss scaler and
//! clipping see the same numbers on every rank and take the same decisions.
//! `docs/distributed.md` explains the choices.

pub mod batch_norm;
mod devices;
pub mod grads;
#[cfg(feature = "mpi")]
pub mod mpi;
mod params;
mod thread_group;

pub use devices::{DeviceGroup, cuda_devices};
pub use grads::{GradReducer, ReduceStats, broadcast_params, check_replicas, check_same_settings};
pub use params::flatten_params;
pub use thread_group::ThreadGroup;

use crate::error::Result;
use burn::tensor::Device;

/// How values from all ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
}

/// The collective operations data parallelism needs. Every rank must make the same calls in
/// the same order with buffers of the same length; a call returns when every rank has made
/// it, with the same result on every rank.
pub trait Collective: Send + Sync {
    /// This process's (or thread's) rank, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank by the element-wise reduction over all ranks.
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
    /// As [`Collective::all_reduce_f32`], in f64 (loss sums, counts, timings).
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()>;
    /// Replaces `buf` on every rank by rank `root`'s.
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// The engine, for logs and the plan (`"single"`, `"threads"`, `"devices"`, `"mpi"`).
    fn engine(&self) -> &'static str;

    /// This rank cannot go on (its run failed with `why`): releases the other ranks, which
    /// would otherwise wait for it at their next call forever. [`ThreadGroup`] breaks the
    /// group, so their calls return [`crate::KilnError::PeerLost`] carrying `why`; MPI prints
    /// `why` and aborts the job (`MPI_Abort`, the only way MPI offers to stop ranks blocked
    /// in a collective), so under MPI this does not return. The trainer calls it when a
    /// multi-rank run fails; a program that fails outside the trainer should call it too.
    fn abandon(&self, why: &str) {
        let _ = why;
    }

    /// The devices, in rank order, of an engine that all-reduces gradients where they live
    /// (Burn's collective on accelerators, [`DeviceGroup`]); `None` (the default): gradients
    /// are reduced as host buffers through [`Collective::all_reduce_f32`].
    fn device_group(&self) -> Option<&[Device]> {
        None
    }

    /// Every rank's `mine` (the same length on every rank), by rank: `size · mine.len()`
    /// values from one all-reduce, each rank filling its own slot of zeros (a value summed
    /// with zeros is exact, so the sum is the gather).
    fn all_gather_f64(&self, mine: &[f64]) -> Result<Vec<f64>> {
        let n = mine.len();
        let mut all = vec![0.0; n * self.size()];
        all[n * self.rank()..][..n].copy_from_slice(mine);
        self.all_reduce_f64(&mut all, ReduceOp::Sum)?;
        Ok(all)
    }
}

/// The error for a broadcast from a rank the world does not have (every engine checks it
/// before calling into its transport).
fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(crate::error::KilnError::Collective(format!(
            "broadcast from rank {root} in a world of {size}"
        )));
    }
    Ok(())
}

/// A world of one: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_f32(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_reduce_f64(&self, _buf: &mut [f64], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn broadcast_f32(&self, _buf: &mut [f32], _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn engine(&self) -> &'static str {
        "single"
    }
}

/// How many ranks of this launch share this machine, read from what Open MPI
/// (`OMPI_COMM_WORLD_LOCAL_SIZE`) and MPICH (`MPI_LOCALNRANKS`) set; 1 when not launched by
/// one. The plan divides the machine's cores and memory between them.
pub fn launcher_local_ranks() -> usize {
    if launcher_world().is_none() {
        return 1;
    }
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| env_usize(v))
        .unwrap_or(1)
        .max(1)
}

/// An environment variable's value as a count, if it is set to one.
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.parse().ok()
}

/// The rank and world size an MPI launcher gave this process, read from the environment
/// variables that Open MPI (`OMPI_COMM_WORLD_RANK`/`_SIZE`), MPICH and Intel MPI
/// (`PMI_RANK`/`PMI_SIZE`) set; `None` when not launched by one (or a world of one).
pub fn launcher_world() -> Option<(usize, usize)> {
    let (rank, size) = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ]
    .iter()
    .find_map(|(r, s)| Some((env_usize(r)?, env_usize(s)?)))?;
    (size > 1 && rank < size).then_some((rank, size))
}
