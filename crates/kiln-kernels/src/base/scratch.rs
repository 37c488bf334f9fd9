//! Per-thread scratch buffers kept between kernel calls, and the loop that runs a call's
//! groups of images over the pool with them.

use std::cell::RefCell;

use rayon::prelude::*;

/// Scratch buffers of one thread: the unfolded images and a group's output (gradient)
/// gathered into one matrix.
#[derive(Default)]
pub struct Scratch {
    /// Unfolded images (a patch matrix).
    pub cols: Vec<f32>,
    /// A group's output (or gradient) gathered into one matrix.
    pub staged: Vec<f32>,
}

thread_local! {
    /// This thread's scratch, kept between calls (a few MB: W5's largest unfolded group is
    /// 2.4 MB), so a call neither allocates nor zero-fills its buffers again (every value a
    /// call reads it has written). No step-time change on W5 was measurable (BENCHMARKS.md
    /// run 32); the page zeroing seen in `perf` was the working set's first touch.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's [`SCRATCH`], or with fresh buffers when it is already in use
/// (a nested call: a GEMM's worker thread that picked up another convolution).
pub fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Runs `run` on each group's (input, output) pair with scratch buffers: one group per
/// parallel task (scratch per thread) when `parallel`, else in order with one scratch (each
/// GEMM then uses every thread).
pub fn per_group<'a, O: Send>(
    pairs: impl Iterator<Item = (&'a [f32], O)>,
    parallel: bool,
    run: impl Fn(&mut Scratch, (&'a [f32], O)) + Send + Sync,
) {
    if parallel {
        let pairs: Vec<_> = pairs.collect();
        if pairs.len() < 2 {
            // One group: on this thread (from outside the pool a one-task split is a
            // round trip through it for nothing).
            with_scratch(|scratch| pairs.into_iter().for_each(|pair| run(scratch, pair)));
            return;
        }
        crate::base::threads::note_split();
        pairs
            .into_par_iter()
            .for_each(|pair| with_scratch(|scratch| run(scratch, pair)));
    } else {
        with_scratch(|scratch| pairs.for_each(|pair| run(scratch, pair)));
    }
}
