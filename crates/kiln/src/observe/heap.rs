//! Heap bytes in use, counted at the allocator.
//!
//! Why: the memory watermark must see memory fall when the trainer halves its micro-batch.
//! Resident memory (RSS) cannot show that under an allocator that keeps freed pages mapped
//! (the `kiln` binary's mimalloc does, for speed: BENCHMARKS run 14), so a watermark on RSS
//! fired once and never saw the effect of its own adaptation. [`CountingAlloc`] wraps any
//! global allocator and counts the bytes live in it and their peak; a binary (or a test)
//! that installs it gives the watermark a reading that falls when tensors are freed,
//! whatever the allocator keeps. Without it, readings fall back to RSS.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);
static COUNTING_THREADS: AtomicBool = AtomicBool::new(false);

thread_local! {
    // Bytes this thread allocated minus those it freed, and that figure's peak: what one
    // call on this thread held, apart from other threads (tests run side by side). Signed:
    // a thread may free what another allocated. Const-initialized without a destructor, so
    // the allocator may touch them at any time without allocating or registering anything.
    static THREAD_LIVE: Cell<i64> = const { Cell::new(0) };
    static THREAD_PEAK: Cell<i64> = const { Cell::new(0) };
}

/// A global allocator that forwards to `A` and counts the bytes live in it.
///
/// ```
/// #[global_allocator]
/// static ALLOC: kiln::observe::heap::CountingAlloc<std::alloc::System> =
///     kiln::observe::heap::CountingAlloc::new(std::alloc::System);
///
/// fn main() {
///     let buffer = vec![0u8; 1 << 20];
///     assert!(kiln::observe::heap::live_bytes().unwrap() >= buffer.len() as u64);
/// }
/// ```
///
/// The cost is two relaxed atomic operations per allocation and one per free.
/// [`CountingAlloc::per_thread`] also counts each thread's own bytes, for
/// [`thread_peak_during`] (the fuzz tests' heap limits), at two thread-local updates more
/// per allocation and one per free; the `kiln` binary does not need it and does not pay it.
pub struct CountingAlloc<A, const PER_THREAD: bool = false>(A);

impl<A> CountingAlloc<A> {
    /// Wraps `inner`, counting the whole process.
    pub const fn new(inner: A) -> Self {
        CountingAlloc(inner)
    }
}

impl<A> CountingAlloc<A, true> {
    /// Wraps `inner`, counting the whole process and each thread.
    pub const fn per_thread(inner: A) -> Self {
        CountingAlloc(inner)
    }
}

fn added<const PER_THREAD: bool>(bytes: usize) {
    let now = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    // A load first: the peak moves rarely, and fetch_max would write the line every time.
    if now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
    if !COUNTING.load(Ordering::Relaxed) {
        COUNTING.store(true, Ordering::Relaxed);
    }
    if !PER_THREAD {
        return;
    }
    if !COUNTING_THREADS.load(Ordering::Relaxed) {
        COUNTING_THREADS.store(true, Ordering::Relaxed);
    }
    let _ = THREAD_LIVE.try_with(|live| {
        let now = live.get() + bytes as i64;
        live.set(now);
        let _ = THREAD_PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn removed<const PER_THREAD: bool>(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Ordering::Relaxed);
    if PER_THREAD {
        let _ = THREAD_LIVE.try_with(|live| live.set(live.get() - bytes as i64));
    }
}

// SAFETY: every method forwards to `A` with the caller's arguments and only adds counting,
// which never touches the memory itself.
unsafe impl<A: GlobalAlloc, const PER_THREAD: bool> GlobalAlloc for CountingAlloc<A, PER_THREAD> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { self.0.alloc(layout) };
        if !ptr.is_null() {
            added::<PER_THREAD>(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.dealloc(ptr, layout) };
        removed::<PER_THREAD>(layout.size());
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { self.0.alloc_zeroed(layout) };
        if !ptr.is_null() {
            added::<PER_THREAD>(layout.size());
        }
        ptr
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let new = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            removed::<PER_THREAD>(layout.size());
            added::<PER_THREAD>(new_size);
        }
        new
    }
}

/// Bytes live in the counted heap, or `None` when no [`CountingAlloc`] is installed.
pub fn live_bytes() -> Option<u64> {
    COUNTING
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed))
}

/// The most bytes live at once since the last call (or since the start), and starts a new
/// window at what is live now; `None` when no [`CountingAlloc`] is installed.
pub fn take_peak_bytes() -> Option<u64> {
    if !COUNTING.load(Ordering::Relaxed) {
        return None;
    }
    let live = LIVE.load(Ordering::Relaxed);
    Some(PEAK.swap(live, Ordering::Relaxed).max(live))
}

/// Runs `f` and returns its result with the most heap it held at once on this thread, in
/// bytes above what the thread held when it started (`None` unless a
/// [`CountingAlloc::per_thread`] is installed). Allocations `f` leaves to other threads (a
/// thread pool) are not counted.
pub fn thread_peak_during<R>(f: impl FnOnce() -> R) -> (R, Option<u64>) {
    let start = THREAD_LIVE.with(Cell::get);
    THREAD_PEAK.with(|peak| peak.set(start));
    let result = f();
    let peak = THREAD_PEAK.with(Cell::get);
    let grown = COUNTING_THREADS
        .load(Ordering::Relaxed)
        .then(|| peak.saturating_sub(start).max(0) as u64);
    (result, grown)
}

/// Whether each thread's heap is counted (a [`CountingAlloc::per_thread`] is installed and
/// has allocated): [`thread_peak_during`] then measures.
pub fn threads_counted() -> bool {
    COUNTING_THREADS.load(Ordering::Relaxed)
}
