//! Keeping rayon's other workers awake through an inference run, and a moment after it.
//!
//! A model at batch 1 is a chain of small parallel operations (MobileNet v2: 52 convolutions,
//! most under 0.1 ms). Between two of them rayon's idle workers go to sleep, and the next
//! operation's split waits for a wake-up; on a virtual machine a sleeping vCPU takes tens of
//! microseconds to come back. Measured per node under `kiln profile` (MobileNet v2, batch 1,
//! BENCHMARKS.md run 35): two threads were no faster than one, the 14² depthwise layers
//! 1.6× slower, while ONNX Runtime, whose intra-op threads spin between operations by
//! default, ran 1.75× faster on two. [`with_spinning_workers`] does what ONNX Runtime does:
//! for the length of a run the other workers busy-wait, taking any work that appears.
//!
//! ONNX Runtime's threads also keep spinning for a while after a run ends, so the next run
//! of a serving or benchmark loop finds them awake. Here every worker lingers [`LINGER`]
//! after a run the same way: a run that follows within it starts on a spinning worker (it
//! takes the injected run at once) and its first split finds the others spinning too.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long the workers keep spinning after a run. Long enough to bridge the gap between
/// two runs of a loop (the caller's wake-up and its handling of the outputs, tens of µs on a
/// virtual machine), short enough that an idle process stops burning its cores at once.
pub const LINGER: Duration = Duration::from_micros(500);

/// End of the current linger, in [`nanos_since_epoch`]'s time.
static LINGER_UNTIL: AtomicU64 = AtomicU64::new(0);

/// Lingering jobs spawned and not yet returned, process-wide: with several pools, a run
/// tops up only what no other pool's lingerers already hold (fewer lingerers, never a
/// wrong result).
static LINGERING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread is inside a run or a run's spinner: a lingering job it pops must return at
    /// once (lingering there would hold up the run until the linger ends).
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `run` on this rayon worker while every other worker of its pool spins, executing the
/// jobs `run`'s parallel operations hand out, until `run` returns; then every worker keeps
/// spinning for [`LINGER`]. Off the pool, or in a pool of one thread, `run` runs alone.
pub fn with_spinning_workers<R>(run: impl FnOnce() -> R) -> R {
    let (Some(home), threads) = (rayon::current_thread_index(), rayon::current_num_threads())
    else {
        return run();
    };
    if threads < 2 {
        // No other worker to spin, but this one lingers: the next run, injected from outside
        // the pool, then starts without waking a sleeping thread.
        let out = busy(run);
        linger_after_run(threads);
        return out;
    }
    let done = AtomicBool::new(false);
    let out = rayon::in_place_scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| spin(&done, home));
        }
        let out = busy(run);
        done.store(true, Ordering::Release);
        out
    });
    linger_after_run(threads);
    out
}

/// Where a model's runs execute: on a pool worker with the others spinning
/// ([`with_spinning_workers`]), or on the calling thread.
///
/// Called from outside the pool, every parallel op hands its work to the pool and sleeps
/// until it is done (a futex wake-up per op); moving the whole run onto a worker once makes
/// each op's parallel work a plain fork-join. The move itself costs a round trip, so a small
/// run (few nodes, small batch) hops only if its work splits over the pool at all, which
/// its first run tells (Kiln's convolution and linear kernels count their splits: the GEMM,
/// grouped, direct, implicit and Winograd paths; a one-task split runs in place and counts
/// nothing).
#[derive(Debug, Default)]
pub struct RunPlacement {
    /// Whether a small run split any op: known after the first one.
    small_splits: OnceLock<bool>,
}

/// Graphs with at least this many nodes run on the pool at any batch: their many small ops
/// each have parallel parts (W4: 45 nodes; a small ResNet's batch-1 time was mostly
/// cross-thread wake-ups before it hopped).
pub(crate) const HOP_MIN_NODES: usize = 16;

/// Batches from this size on run on the pool whatever the graph's size: their work splits,
/// and what a small first run learned does not hold for them.
pub(crate) const HOP_MIN_BATCH: usize = 8;

impl RunPlacement {
    /// Runs `run` — a graph of `nodes` nodes at `batch` (`None`: no batch axis) — where it is
    /// fastest: in place on a pool thread; on the pool for a large graph or batch, or a small
    /// one that splits; else on this thread.
    pub fn run<R: Send>(
        &self,
        nodes: usize,
        batch: Option<usize>,
        run: impl FnOnce() -> R + Send,
    ) -> R {
        if rayon::current_thread_index().is_some() {
            return run();
        }
        let small = nodes < HOP_MIN_NODES && batch.is_none_or(|b| b < HOP_MIN_BATCH);
        if small {
            match self.small_splits.get() {
                Some(true) => {}
                Some(false) => return run(),
                None => {
                    let before = crate::base::threads::split_calls();
                    let out = run();
                    let _ = self
                        .small_splits
                        .set(crate::base::threads::split_calls() > before);
                    return out;
                }
            }
        }
        rayon::scope(|_| with_spinning_workers(run))
    }
}

/// Runs `f` with this thread marked busy (restoring the mark after: runs nest in lingers).
fn busy<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            BUSY.with(|b| b.set(self.0));
        }
    }
    let _restore = Restore(BUSY.with(|b| b.replace(true)));
    f()
}

/// Busy-waits for `done`, running whatever work rayon finds meanwhile. A spinner the running
/// thread pops itself (while it waits inside the run for a stolen half) returns at once:
/// spinning there would wait for the run it interrupts.
fn spin(done: &AtomicBool, home: usize) {
    if rayon::current_thread_index() == Some(home) {
        return;
    }
    busy(|| {
        while !done.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::hint::spin_loop();
            }
        }
    });
}

/// Moves the linger's end to [`LINGER`] from now and tops the lingering jobs up to one per
/// worker.
fn linger_after_run(threads: usize) {
    let until = nanos_since_epoch() + LINGER.as_nanos() as u64;
    LINGER_UNTIL.fetch_max(until, Ordering::AcqRel);
    while LINGERING
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < threads).then_some(n + 1)
        })
        .is_ok()
    {
        rayon::spawn(linger);
    }
}

/// One worker's linger: spins, running any work that appears (the next run among it), until
/// the linger's end passes. Returns at once on a thread that is inside a run.
fn linger() {
    struct Count;
    impl Drop for Count {
        fn drop(&mut self) {
            LINGERING.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _count = Count;
    if BUSY.with(Cell::get) {
        return;
    }
    while nanos_since_epoch() < LINGER_UNTIL.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
}

/// Nanoseconds since the first call in this process (a monotonic clock).
fn nanos_since_epoch() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// The run's parallel work is done and its result returned, on pools of one to four
    /// threads, with nested splits (the waits where the running thread pops its own spinner),
    /// and off the pool.
    #[test]
    fn runs_return_their_result_on_every_pool_size() {
        let work = || -> u64 {
            (0..64u64)
                .map(|i| (0..1000u64).into_par_iter().map(|j| i * j).sum::<u64>())
                .sum()
        };
        let want: u64 = (0..64u64).map(|i| i * 999 * 1000 / 2).sum();
        for threads in 1..=4 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for _ in 0..20 {
                assert_eq!(pool.install(|| with_spinning_workers(work)), want);
            }
        }
        assert_eq!(with_spinning_workers(work), want);
    }
}
