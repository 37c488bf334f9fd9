//! MPI as the collective engine (cargo feature `mpi`): the `mpi` crate (rsmpi) over the
//! system's MPI library (Debian's Open MPI: `apt install libopenmpi-dev openmpi-bin`).
//! Launch with `mpirun -n N kiln train ...`: every process is one rank of `MPI_COMM_WORLD`.

use std::sync::Mutex;

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Equivalence, Root};

use super::{Collective, ReduceOp, check_root};
use crate::error::{KilnError, Result};

/// `MPI_COMM_WORLD` as a [`Collective`]. MPI is initialized with `MPI_THREAD_SERIALIZED` and
/// every call holds a lock, so any one thread may call at a time (the trainer calls from
/// its own thread; the loader's workers never do). Dropping it finalizes MPI, once per
/// process: create it once, at the start of `main`.
pub struct MpiCollective {
    /// The world and the universe that owns MPI's lifetime, behind the lock.
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
}

struct Inner {
    world: SimpleCommunicator,
    // Dropped last: finalizes MPI.
    _universe: Universe,
}

// SAFETY: MPI handles are plain integers or pointers owned by the MPI library; with
// MPI_THREAD_SERIALIZED the library allows calls from any thread as long as no two run at
// once, which the mutex guarantees.
unsafe impl Send for Inner {}

impl MpiCollective {
    /// Initializes MPI (once per process) and joins `MPI_COMM_WORLD`.
    pub fn init() -> Result<MpiCollective> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                KilnError::Collective(
                    "MPI was already initialized in this process: create one MpiCollective at \
                     the start of main"
                        .into(),
                )
            })?;
        if threading < Threading::Serialized {
            return Err(KilnError::Collective(format!(
                "this MPI library offers thread level {threading:?}; Kiln needs Serialized \
                 (the trainer is not always the main thread). Use an MPI built with thread \
                 support (Debian's Open MPI has it)"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(MpiCollective {
            inner: Mutex::new(Inner {
                world,
                _universe: universe,
            }),
            rank,
            size,
        })
    }

    fn world(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl MpiCollective {
    /// `MPI_Allreduce` of `buf` in place (MPI's send and receive buffers must differ, so the
    /// values are sent from a copy).
    fn all_reduce<T: Equivalence + Clone>(&self, buf: &mut [T], reduce: ReduceOp) {
        let op = match reduce {
            ReduceOp::Sum => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
        };
        let send = buf.to_vec();
        self.world().world.all_reduce_into(&send[..], buf, op);
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_f32(&self, buf: &mut [f32], reduce: ReduceOp) -> Result<()> {
        self.all_reduce(buf, reduce);
        Ok(())
    }
    fn all_reduce_f64(&self, buf: &mut [f64], reduce: ReduceOp) -> Result<()> {
        self.all_reduce(buf, reduce);
        Ok(())
    }
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(root, self.size)?;
        let inner = self.world();
        inner.world.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.world().world.barrier();
        Ok(())
    }
    fn engine(&self) -> &'static str {
        "mpi"
    }
    fn abandon(&self, why: &str) {
        if self.size < 2 {
            return;
        }
        // Printed here because the abort ends this process before its caller could.
        eprintln!(
            "kiln: rank {} of {} failed: {why}\nkiln: aborting the MPI job so that the other \
             ranks stop instead of waiting for this one",
            self.rank, self.size
        );
        self.world().world.abort(1)
    }
}

impl Drop for MpiCollective {
    /// A rank that panics would otherwise finalize MPI while the others wait for it in a
    /// collective (and `MPI_Finalize` itself waits for them): abort the job instead.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abandon("panicked");
        }
    }
}
