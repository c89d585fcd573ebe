//! The loom facade: the only module that names `std::sync::atomic` or `loom`.
//!
//! Normal builds re-export std's atomics and threads. Under `RUSTFLAGS="--cfg loom"`
//! the same names come from [`loom`](https://docs.rs/loom), so the model checker
//! explores every interleaving of kvpool's atomics — and of the atomics in a user's
//! own scheduler, when they model-check their code with our types.
//!
//! Under `RUSTFLAGS="--cfg loom --cfg shuttle"` they come from
//! [`shuttle`](https://docs.rs/shuttle) instead, for randomized schedules of scenarios
//! too large for loom (`tests/shuttle_*.rs`, `scripts/shuttle.sh`).
//!
//! Code elsewhere in the crate writes `crate::sync::atomic::AtomicU64` and never
//! `std::sync::atomic::AtomicU64`; a grep for `std::sync::atomic` outside this file
//! should find nothing.
//!
//! # The cfgs
//!
//! * `cfg(loom)` means *a model-checked build*: kvpool's atomics are a checker's, the
//!   crate skips its plain-memory fast paths (which read atomics as plain integers, and
//!   a checker's atomics do not have an integer's layout), shrinks shard counts, and
//!   leaves out the trace-replay tool.
//! * `cfg(shuttle)` picks *which* checker: shuttle instead of loom. It is only valid
//!   together with `cfg(loom)`, so every `cfg(not(loom))` fast path stays off under
//!   shuttle too; a build with `--cfg shuttle` alone stops with a compile error.

#[cfg(all(shuttle, not(loom)))]
compile_error!(
    "`--cfg shuttle` needs `--cfg loom` as well (loom marks a model-checked build, shuttle picks the checker): \
     run scripts/shuttle.sh, or RUSTFLAGS=\"--cfg loom --cfg shuttle\""
);

#[cfg(not(loom))]
mod imp {
    pub(crate) mod atomic {
        #[allow(unused_imports)]
        pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
    }
    #[allow(unused_imports)]
    pub(crate) use std::sync::Arc;

    /// Spin-loop hint (loom: a yield to the scheduler instead).
    #[inline]
    pub(crate) fn spin_loop() {
        std::hint::spin_loop();
    }
}

#[cfg(all(loom, not(shuttle)))]
mod imp {
    pub(crate) mod atomic {
        #[allow(unused_imports)]
        pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
    }
    #[allow(unused_imports)]
    pub(crate) use loom::sync::Arc;

    /// Under loom a spinning thread must yield, or the model never terminates.
    #[inline]
    pub(crate) fn spin_loop() {
        loom::thread::yield_now();
    }
}

/// Shuttle: every atomic access is a scheduling point (shuttle models them all as
/// `SeqCst`; loom is the tool for weak orderings, shuttle for size).
#[cfg(all(loom, shuttle))]
mod imp {
    pub(crate) mod atomic {
        #[allow(unused_imports)]
        pub(crate) use shuttle::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
    }
    #[allow(unused_imports)]
    pub(crate) use shuttle::sync::Arc;

    /// A spinning thread yields, which tells shuttle's schedulers to run someone else
    /// (a spin without a yield could be scheduled forever).
    #[inline]
    pub(crate) fn spin_loop() {
        shuttle::thread::yield_now();
    }
}

#[allow(unused_imports)]
pub(crate) use imp::*;

/// An `UnsafeCell` with tokio's closure API, so loom can check every access under
/// `--cfg loom` (it tracks concurrent `with`/`with_mut` and reports data races).
/// Shuttle has no such cell: under shuttle it is the plain one.
#[cfg(any(not(loom), shuttle))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

#[cfg(any(not(loom), shuttle))]
#[allow(dead_code)]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(t: T) -> Self {
        UnsafeCell(core::cell::UnsafeCell::new(t))
    }
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(all(loom, not(shuttle)))]
pub(crate) use loom::cell::UnsafeCell;

/// A small number that tells the calling thread apart from the others (threads that
/// ask first get 0, 1, 2, ...), for spreading threads over shards of a counter and
/// over regions of a bitmap. Costs one thread-local read; never allocates.
#[cfg(not(loom))]
#[inline]
pub(crate) fn thread_slot() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU32, Ordering};
    /// The next slot to hand out.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::thread_local! {
        // Const-initialised and without a destructor: no allocation, no registration.
        static SLOT: Cell<u32> = const { Cell::new(u32::MAX) };
    }
    SLOT.try_with(|slot| {
        let mut v = slot.get();
        if v == u32::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed) & (u32::MAX >> 1);
            slot.set(v);
        }
        v as usize
    })
    .unwrap_or(0)
}

/// Under loom: the number of the loom thread (0 for the model's main thread, then in
/// spawn order), the same in every execution of a model, so the model stays
/// deterministic. Loom shows that number only through `Debug` (`ThreadId(3)`); the
/// digits are read straight out of the formatter.
#[cfg(all(loom, not(shuttle)))]
pub(crate) fn thread_slot() -> usize {
    use std::fmt::Write;
    struct Digits(usize);
    impl Write for Digits {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            for b in s.bytes().filter(u8::is_ascii_digit) {
                self.0 = self.0.wrapping_mul(10).wrapping_add((b - b'0') as usize);
            }
            Ok(())
        }
    }
    let mut digits = Digits(0);
    let _ = write!(digits, "{:?}", loom::thread::current().id());
    digits.0
}

/// Under shuttle: the shuttle task number (0 for the test's main thread, then in spawn
/// order), the same in every schedule of a test. All shuttle threads share one OS
/// thread, so the std version's thread-local would give them all the same slot.
#[cfg(all(loom, shuttle))]
pub(crate) fn thread_slot() -> usize {
    usize::from(shuttle::thread::current().id())
}

/// Atomics for heuristics only — state that decides where a scan starts, never whether
/// an operation is correct. They stay std's under loom too: the model checker then
/// spends no search on them, and since loom runs its threads one at a time their values
/// are still a deterministic function of the schedule it explores.
pub(crate) mod untracked {
    #[allow(unused_imports)]
    pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// Exponential backoff for contended compare-and-swap loops (crossbeam's shape):
/// spin `2^step` hints for a few steps, then stop growing. Under loom every step is a
/// yield so the checker can schedule the other threads.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    step: u32,
}

impl Backoff {
    const SPIN_LIMIT: u32 = 6;

    #[inline]
    pub(crate) fn new() -> Self {
        Backoff { step: 0 }
    }

    /// Back off after a failed compare-and-swap.
    #[inline]
    pub(crate) fn spin(&mut self) {
        #[cfg(loom)]
        {
            spin_loop();
        }
        #[cfg(not(loom))]
        {
            for _ in 0..(1u32 << self.step.min(Self::SPIN_LIMIT)) {
                spin_loop();
            }
        }
        if self.step <= Self::SPIN_LIMIT {
            self.step += 1;
        }
    }
}
