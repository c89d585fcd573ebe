//! A counting global allocator shared by the no-allocation tests: `mod alloc_common;`
//! installs it as the test binary's global allocator.
//!
//! Only allocations made by the current thread while its flag is on are counted, so
//! the test harness's own threads (output capture, other tests) do not interfere.
#![allow(dead_code)] // each test file uses a part

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The counting global allocator (installed by this module).
pub struct Counting;

thread_local! {
    // `const` initialisers: no lazy initialisation, no destructor, so touching these
    // from inside the allocator never allocates or recurses.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: during thread teardown the slots may be gone; then we are not counting.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// counting touches only `const`-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded from our caller, who upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: `ptr` came from this allocator (hence from `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (hence from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Heap allocations `f` makes on this thread.
pub fn allocations<R>(f: impl FnOnce() -> R) -> (usize, R) {
    COUNT.with(|c| c.set(0));
    COUNTING.with(|on| on.set(true));
    let r = f();
    COUNTING.with(|on| on.set(false));
    (COUNT.with(|c| c.get()), r)
}

#[track_caller]
pub fn assert_no_alloc<R>(what: &str, f: impl FnOnce() -> R) -> R {
    let (n, r) = allocations(f);
    assert_eq!(n, 0, "{what} made {n} heap allocation(s)");
    r
}
