//! The thread-pool rules every kernel follows: the pool's size, and the work below which a
//! call stays on the calling thread (handing work to rayon's pool and waiting for it costs
//! tens of microseconds).

/// Values below which a memory-bound kernel runs on the calling thread, and the size of its
/// parallel chunks: waking a pool thread costs about what one thread takes for this many
/// (measured on MobileNet v3 small at batch 1, where 32 Ki-value chunks left 15% of the
/// time in the scheduler).
pub const PARALLEL_MIN: usize = 1 << 17;

/// Multiply-adds of one convolution call below which it runs on the calling thread: handing
/// work to the pool and waiting for it costs more than a second thread saves. Low, because
/// a pool worker left idle between calls falls asleep and the next split pays its wake-up:
/// measured at two threads, batch 1, 2 Mi → 32 Ki (with the depthwise threshold, medians of
/// 5 alternated runs, BENCHMARKS run 34): MobileNet v3 small 3.00 → 2.47 ms, ShuffleNet v2
/// 4.31 → 3.75, EfficientNet-B0 9.23 → 8.77, ResNet-18 18.3 → 17.9; W3 unchanged.
pub const SPLIT_MACS: usize = 1 << 15;

/// Threads to use: rayon's pool size.
pub fn pool_threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// A raw output pointer shared by tasks that write disjoint parts of one buffer (the
/// implicit GEMM's rectangles of rows × panels, Winograd's blocks of tiles, the int8
/// epilogues' elements).
#[derive(Clone, Copy)]
pub struct SharedOut<T = f32>(pub *mut T);

impl<T> SharedOut<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not its field).
    pub fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the tasks holding a copy write disjoint ranges of the buffer, which outlives them
// (each user's contract).
unsafe impl<T> Send for SharedOut<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedOut<T> {}

thread_local! {
    // Calls on this thread that split over the pool: the executor reads it to learn whether
    // a forward has parallel work worth moving onto the pool.
    static SPLITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts a call on this thread that splits over the pool (see [`split_calls`]).
pub fn note_split() {
    SPLITS.with(|n| n.set(n.get() + 1));
}

/// Convolution and linear calls made on this thread that split over the pool so far.
pub fn split_calls() -> usize {
    SPLITS.with(std::cell::Cell::get)
}
