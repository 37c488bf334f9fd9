//! Keeping rayon's other workers awake through an inference run.
//!
//! A model at batch 1 is a chain of small parallel operations (MobileNet v2: 52 convolutions,
//! most under 0.1 ms). Between two of them rayon's idle workers go to sleep, and the next
//! operation's split waits for a wake-up; on a virtual machine a sleeping vCPU takes tens of
//! microseconds to come back. Measured per node under `kiln profile` (MobileNet v2, batch 1,
//! BENCHMARKS.md run 35): two threads were no faster than one, the 14² depthwise layers
//! 1.6× slower, while ONNX Runtime, whose intra-op threads spin between operations by
//! default, ran 1.75× faster on two. [`with_spinning_workers`] does what ONNX Runtime does:
//! for the length of a run the other workers busy-wait, taking any work that appears.

use std::sync::atomic::{AtomicBool, Ordering};

/// Runs `run` on this rayon worker while every other worker of its pool spins, executing the
/// jobs `run`'s parallel operations hand out, until `run` returns. Off the pool, or in a
/// pool of one thread, `run` runs alone.
pub fn with_spinning_workers<R>(run: impl FnOnce() -> R) -> R {
    let (Some(home), threads) = (rayon::current_thread_index(), rayon::current_num_threads())
    else {
        return run();
    };
    if threads < 2 {
        return run();
    }
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| spin(&done, home));
        }
        let out = run();
        done.store(true, Ordering::Release);
        out
    })
}

/// Busy-waits for `done`, running whatever work rayon finds meanwhile. A spinner the running
/// thread pops itself (while it waits inside the run for a stolen half) returns at once:
/// spinning there would wait for the run it interrupts.
fn spin(done: &AtomicBool, home: usize) {
    if rayon::current_thread_index() == Some(home) {
        return;
    }
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
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
