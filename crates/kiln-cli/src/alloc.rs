//! The process allocator: mimalloc by default, the system allocator with
//! `KILN_ALLOCATOR=system`.
//!
//! Why: tensor work allocates and frees multi-megabyte buffers every step. glibc's malloc
//! returns them to the OS and page-faults them back in (~15% of W1/W3 step time under
//! `perf`: `clear_page_erms`, `exc_page_fault`); mimalloc keeps them mapped, at the cost of
//! a higher resident set. BENCHMARKS.md has the A/B. The switch exists so `kiln bench` can
//! time plain Burn the way a Burn program runs by default, and so users can opt out.
//!
//! mimalloc's own default still returns ("purges") freed pages to the OS 10 ms after they
//! fall free; a training step frees and re-allocates its multi-MB activations every 60+ ms,
//! so each step page-faulted them all back in (`clear_page_erms` 11% of W2's step under
//! `perf`). Kiln turns purging off (W2 step 87 → 63 ms, BENCHMARKS.md run 14); the
//! environment variable `MIMALLOC_PURGE_DELAY` still overrides it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

const UNDECIDED: u8 = 0;
const MIMALLOC: u8 = 1;
const SYSTEM: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// Dispatches every allocation to the allocator chosen once, at the first allocation.
pub struct KilnAllocator;

fn choice() -> u8 {
    let c = CHOICE.load(Ordering::Relaxed);
    if c != UNDECIDED {
        return c;
    }
    // getenv does not allocate, so it is safe to call from inside the allocator. The first
    // allocation happens on the main thread before any other thread exists, so the choice
    // is made once and never changes; memory is always freed by the allocator that made it.
    // SAFETY: the argument is a valid NUL-terminated string; the result is only read.
    let system = unsafe {
        let v = libc::getenv(c"KILN_ALLOCATOR".as_ptr());
        !v.is_null() && std::ffi::CStr::from_ptr(v).to_bytes() == b"system"
    };
    let c = if system { SYSTEM } else { MIMALLOC };
    if c == MIMALLOC {
        keep_freed_pages();
    }
    CHOICE.store(c, Ordering::Relaxed);
    c
}

/// `mi_option_purge_delay` in mimalloc.h (v2 and v3 alike; the Rust bindings do not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Turns mimalloc's purging of freed pages off, unless the user set `MIMALLOC_PURGE_DELAY`.
fn keep_freed_pages() {
    set_purge_delay(-1);
}

/// Sets mimalloc's purge delay to `ms` (-1: never), unless the user set
/// `MIMALLOC_PURGE_DELAY`, whose value then stands.
fn set_purge_delay(ms: std::ffi::c_long) {
    // SAFETY: getenv reads a NUL-terminated name and does not allocate; mi_option_set stores
    // a value in mimalloc's static option table (no allocation either), valid at any time.
    unsafe {
        if libc::getenv(c"MIMALLOC_PURGE_DELAY".as_ptr()).is_null() {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, ms);
        }
    }
}

/// How long a freed page stays mapped in `kiln serve` before mimalloc returns it, in ms.
///
/// Why not "never", as for training: a server swaps models in and out (reloads, unloads), and
/// with purging off every reload's peak — old and new weights side by side — stayed resident
/// for the rest of the process's life (ResNet-18 graph: 293 → 589 MiB over three reloads).
/// Why not short: a 1 s delay returned it too but cost ~12% of steady throughput (medians
/// 258 vs 295 requests/s; batch buffers of sizes used less than once a second were unmapped
/// and faulted back). At 5 s the steady rate is within this machine's noise of purging off
/// (medians 254 vs 263) and the plateau after each reload's drain is the first version's
/// (246–261 MiB vs 253–259). BENCHMARKS.md run 49.
const SERVING_PURGE_DELAY_MS: std::ffi::c_long = 5000;

/// Sets mimalloc's purge delay for a long-running server (see [`SERVING_PURGE_DELAY_MS`]),
/// unless the user set `MIMALLOC_PURGE_DELAY`.
pub fn purge_for_serving() {
    if choice() == MIMALLOC {
        set_purge_delay(SERVING_PURGE_DELAY_MS);
    }
}

/// Hands memory the process has freed back to the OS, once: what `kiln serve` calls on a
/// retiring version's own thread once the version is gone. With the system allocator that is
/// glibc's `malloc_trim`, without which glibc keeps freed arena memory (ResNet-18 graph: the
/// plateau after a reload 169–185 MiB with it, BENCHMARKS.md run 49). With mimalloc there is
/// nothing to do here: a `mi_collect` on this thread returned nothing measurable (the old
/// weights' pages belong to other threads' heaps); the purge delay returns them.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    if choice() == SYSTEM {
        // SAFETY: malloc_trim only walks glibc's own arenas; valid at any time.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Which allocator this process uses.
pub fn name() -> &'static str {
    if choice() == SYSTEM {
        "system"
    } else {
        "mimalloc"
    }
}

// SAFETY: every method forwards to one of two sound allocators, always the same one for the
// life of the process (see `choice`).
unsafe impl GlobalAlloc for KilnAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            if choice() == SYSTEM {
                System.alloc(layout)
            } else {
                mimalloc::MiMalloc.alloc(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            if choice() == SYSTEM {
                System.dealloc(ptr, layout)
            } else {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            if choice() == SYSTEM {
                System.alloc_zeroed(layout)
            } else {
                mimalloc::MiMalloc.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            if choice() == SYSTEM {
                System.realloc(ptr, layout, new_size)
            } else {
                mimalloc::MiMalloc.realloc(ptr, layout, new_size)
            }
        }
    }
}
