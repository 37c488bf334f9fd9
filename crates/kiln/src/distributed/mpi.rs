//! MPI as the collective engine (cargo feature `mpi`): the `mpi` crate (rsmpi) over the
//! system's MPI library (Debian's Open MPI: `apt install libopenmpi-dev openmpi-bin`).
//! Launch with `mpirun -n N kiln train ...`: every process is one rank of `MPI_COMM_WORLD`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, Scope};
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
    /// How long one call may wait for the other ranks before the job is aborted.
    timeout: Option<Duration>,
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
            timeout: None,
        })
    }

    /// Aborts the job when a call waits longer than `timeout` for the other ranks (a rank
    /// that hangs rather than dies, which MPI's launcher cannot see); `None`: wait forever.
    /// With a timeout the calls are MPI's non-blocking collectives, polled until done.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> MpiCollective {
        self.timeout = timeout;
        self
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
        let inner = self.world();
        let Some(timeout) = self.timeout else {
            inner.world.all_reduce_into(&send[..], buf, op);
            return;
        };
        mpi::request::scope(|scope| {
            let request = inner
                .world
                .immediate_all_reduce_into(scope, &send[..], buf, op);
            self.finish(&inner.world, request, timeout, "all-reduce");
        });
    }

    /// Polls `request` until it completes; past `timeout`, prints why and aborts the job (a
    /// pending request cannot be abandoned, and the other ranks are stuck with it).
    fn finish<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        world: &SimpleCommunicator,
        mut request: Request<'a, D, S>,
        timeout: Duration,
        what: &str,
    ) {
        let started = Instant::now();
        loop {
            request = match request.test() {
                Ok(_) => return,
                Err(pending) => pending,
            };
            if started.elapsed() > timeout {
                eprintln!(
                    "kiln: rank {} of {}: an MPI {what} waited {timeout:?} for the other ranks \
                     (train.collective_timeout_s): a rank hangs (a stuck file system, a \
                     deadlock) or is far slower than the others\nkiln: aborting the MPI job \
                     so that no rank waits forever; raise the timeout if the work between two \
                     calls is legitimately that long",
                    self.rank, self.size
                );
                world.abort(1);
            }
            // Blocking MPI calls poll too (Open MPI's default); yielding lets a rank that
            // shares this core compute.
            std::thread::yield_now();
        }
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
        let root = inner.world.process_at_rank(root as i32);
        let Some(timeout) = self.timeout else {
            root.broadcast_into(buf);
            return Ok(());
        };
        mpi::request::scope(|scope| {
            let request = root.immediate_broadcast_into(scope, buf);
            self.finish(&inner.world, request, timeout, "broadcast");
        });
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        let inner = self.world();
        match self.timeout {
            None => inner.world.barrier(),
            Some(timeout) => {
                let request = inner.world.immediate_barrier();
                self.finish(&inner.world, request, timeout, "barrier");
            }
        }
        Ok(())
    }
    fn engine(&self) -> &'static str {
        "mpi"
    }
    fn abandon(&self, why: &str) {
        if self.size < 2 {
            return;
        }
        // Printed here because the abort ends this process before its caller could, and in
        // one write: `eprintln!` writes its pieces apart, and mpirun, forwarding this rank's
        // stderr, printed its abort banner between "kiln: rank " and the rest.
        let message = format!(
            "kiln: rank {} of {} failed: {why}\nkiln: aborting the MPI job so that the other \
             ranks stop instead of waiting for this one\n",
            self.rank, self.size
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), message.as_bytes());
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
