//! The process allocator: mimalloc by default, the system allocator with
//! `KILN_ALLOCATOR=system`.
//!
//! Why: tensor work allocates and frees multi-megabyte buffers every step. glibc's malloc
//! returns them to the OS and page-faults them back in (~15% of W1/W3 step time under
//! `perf`: `clear_page_erms`, `exc_page_fault`); mimalloc keeps them mapped, at the cost of
//! a higher resident set. BENCHMARKS.md has the A/B. The switch exists so `kiln bench` can
//! time plain Burn the way a Burn program runs by default, and so users can opt out.

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
    CHOICE.store(c, Ordering::Relaxed);
    c
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
