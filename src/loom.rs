//! Model-checking your own code with kvpool's types inside (only under
//! `RUSTFLAGS="--cfg loom"`).
//!
//! Built with `--cfg loom`, every atomic in kvpool is a [loom](https://docs.rs/loom)
//! atomic, so a loom model of *your* scheduler explores the interleavings of kvpool's
//! operations together with your own. This module is the loom crate kvpool was built
//! with (`pub use loom::*`), plus [`run_model`]:
//!
//! * **One loom.** kvpool depends on loom [`VERSION`] (`loom = "0.7"`). Cargo unifies
//!   that with your own `loom = "0.7"` dependency into one crate; a different major
//!   version (`loom = "0.5"`) would be a second loom whose models do not see kvpool's
//!   atomics (kvpool's operations then panic with loom's "cannot access Loom execution
//!   state from outside a Loom model"). Write `use kvpool::loom;` and there is only one;
//!   or keep your own dependency and pass its `model::Builder` to [`run_model`], whose
//!   signature names kvpool's loom: with another version, that call does not compile
//!   (rustc: "expected `kvpool::loom::model::Builder`, found `loom::model::Builder`",
//!   "note: there are multiple different versions of crate `loom` in the dependency
//!   graph").
//! * **No state outside the model.** kvpool keeps no loom object in a static or a
//!   thread-local, so each execution starts from what the model builds. Its only statics
//!   are two std counters (the identities of caches and request-row pools, compared only
//!   for equality) and, outside loom, the per-thread shard number; under loom the shard
//!   number is the loom thread's number, the same in every execution. Heuristic scan
//!   positions inside a pool are std atomics too, part of the structure the model builds.
//! * **Small structures.** Under loom a `SlotPool` has 2 shards and magazines of 2
//!   entries; build pools of a handful of slots (`TokenAllocator::new(4)`,
//!   `PagedAllocator::new(8, 2)`, `ReqToTokenPool::new(2, 8)`, a `RadixCache` over
//!   them): every constructor works at those sizes, and the models of
//!   `examples/loom-scheduler/` finish in seconds.
//! * **At least two executions.** Loom does not reorder a load in one thread before a
//!   later store in another (tokio-rs/loom#392): a model whose reader runs first in
//!   loom's first schedule can explore exactly one execution and pass without checking
//!   anything. [`run_model`] counts the executions and fails on one.
//!
//! A crate built with `--cfg loom` must run kvpool only inside a loom model: keep your
//! ordinary tests behind `#[cfg(not(loom))]`.

pub use ::loom::*;

/// The loom version kvpool is built against (its `Cargo.toml` says `loom = "0.7"`); your
/// crate's loom dependency must be semver-compatible with it.
pub const VERSION: &str = "0.7";

/// Run `f` as a loom model with `builder` (`loom::model::Builder::new()` reads
/// `LOOM_MAX_PREEMPTIONS` and the other `LOOM_*` variables), print how many executions
/// loom explored to stderr, and return that count.
///
/// # Panics
///
/// When `f` panics in some execution (loom reports the schedule), and when loom explored
/// only one execution: the model's threads never interleaved (see the
/// [module docs](self)), so it proved nothing.
///
/// # Examples
///
/// ```ignore
/// // (only under RUSTFLAGS="--cfg loom")
/// use kvpool::loom::{self, sync::Arc, thread};
/// use kvpool::{KvAllocator, TokenAllocator};
///
/// let executions = loom::run_model("two threads allocate", loom::model::Builder::new(), || {
///     let alloc = Arc::new(TokenAllocator::new(2).unwrap());
///     let other = Arc::clone(&alloc);
///     let t = thread::spawn(move || {
///         let mut one = [0u32];
///         other.alloc(&mut one).map(|()| one[0])
///     });
///     let mut one = [0u32];
///     let mine = alloc.alloc(&mut one).map(|()| one[0]);
///     let theirs = t.join().unwrap();
///     assert_ne!(mine.unwrap(), theirs.unwrap()); // never the same slot twice
/// });
/// assert!(executions > 1);
/// ```
pub fn run_model<F>(name: &str, builder: ::loom::model::Builder, f: F) -> usize
where
    F: Fn() + Sync + Send + 'static,
{
    // std atomics, deliberately outside the model: loom runs its executions one after
    // another on this thread, so the counter counts across them and costs no search.
    use std::sync::atomic::{AtomicUsize, Ordering};
    let executions = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&executions);
    builder.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        f();
    });
    let n = executions.load(Ordering::Relaxed);
    eprintln!("loom model {name}: {n} executions");
    assert!(n > 1, "loom explored only {n} execution of {name}: its threads never interleaved (tokio-rs/loom#392)");
    n
}
