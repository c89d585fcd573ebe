//! # kvpool
//!
//! Lock-free, fixed-capacity KV-cache memory management for LLM inference engines —
//! the memory system of SGLang's `mem_cache` package, re-built in Rust:
//!
//! * [`SlotPool`] — the one primitive: a lock-free arena of `u32` indices;
//! * [`TokenAllocator`] and [`PagedAllocator`] — KV slot allocators with SGLang's slot
//!   and page numbering, `alloc_extend` / `alloc_decode`, free groups;
//! * [`ReqToTokenPool`] — request rows mapping token positions to KV slots;
//! * [`radix::RadixCache`] — the prefix cache (and its Mamba, sliding-window and
//!   host-tier trees), which a scheduler drives through one handle per request,
//!   [`radix::Request`]: admit, extend, decode, checkpoint, finish, abort;
//! * [`mamba`] — hybrid models: [`MambaPool`] (state slots), [`HybridReqToTokenPool`]
//!   (rows that own a state) and [`HybridLayerMap`].
//!
//! Every operation takes `&self`, never blocks, and never touches the heap after
//! construction: an overlap scheduler can allocate batch N+1 on one thread while
//! another thread frees the slots of batch N.
//!
//! ```
//! use kvpool::{KvAllocator, PagedAllocator};
//! use std::sync::Arc;
//!
//! let alloc = Arc::new(PagedAllocator::new(1 << 16, 16)?);
//! let mut prefill = vec![0u32; 100];
//! alloc.alloc_extend(&[0], &[100], &[0], &mut prefill)?;   // 7 pages
//!
//! let freer = {
//!     let alloc = Arc::clone(&alloc);
//!     std::thread::spawn(move || alloc.free(&prefill))
//! };
//! let mut decode = [0u32; 1];
//! alloc.alloc_decode(&[1], &[0], &mut decode)?;            // meanwhile
//! freer.join().unwrap()?;
//! assert_eq!(alloc.available_size(), (1 << 16) - 16);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Model-checking your own code
//!
//! Built with `RUSTFLAGS="--cfg loom"`, kvpool's atomics are loom's, so a scheduler
//! that uses kvpool types can be model-checked with loom as it is. The module
//! `kvpool::loom` (present only in such a build) is the loom kvpool was built with
//! (0.7) plus `run_model`, which counts the executions a model explored;
//! `examples/loom-scheduler/` in the repository is a crate that model-checks a
//! scheduler protocol this way.
//!
//! ## Fuzzing your own code
//!
//! With feature `models`, `kvpool::models` has kvpool's `Arbitrary` operation
//! sequences and sequential reference models; `models::run_allocator_observed` drives
//! your own [`KvAllocator`] wrapper with them and checks it against the model
//! (`examples/fuzz-scheduler/` is a cargo-fuzz target doing that).
//!
//! ## Features
//!
//! * `models` (alias `testing`) — `kvpool::models`: op sequences and
//!   sequential models for fuzzing and model tests.
//! * `debug-invariants` — run `check_invariants()` after every mutating operation
//!   and panic on a violation (SGLang's `SGLANG_DEBUG_MEMORY_POOL`). O(capacity) per
//!   operation and exact only single-threaded: for tests and debugging.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, missing_debug_implementations)]

pub(crate) mod sync;

pub mod alloc;
mod arena;
pub mod baseline;
pub mod error;
mod iota;
pub mod kv;
#[cfg(all(loom, not(shuttle)))]
pub mod loom;
pub mod mamba;
#[cfg(feature = "models")]
pub mod models;
pub mod radix;
#[cfg(all(feature = "replay", not(loom)))]
pub mod replay;
pub mod req_to_token;
pub mod slots;
#[cfg(not(loom))]
pub mod store;
/// The old name of [`models`] (feature `testing`, now an alias of feature `models`).
#[cfg(feature = "models")]
pub use models as testing;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use alloc::{KvAllocator, KvFreeGroup, OwnedAllocator, PagedAllocator, TokenAllocator};
pub use error::{
    AllocError, ConfigError, FreeError, FreeErrorKind, InvalidInput, InvariantViolation, OutOfMemory, RowError,
    SlotsError, Unit,
};
pub use mamba::{HybridLayerMap, HybridReqToTokenPool, HybridRow, MambaConfig, MambaPool, MambaSlot};
pub use req_to_token::{ReqRow, ReqToTokenPool, RowFreeError};
pub use slots::{FreeGroup, SlotCache, SlotPool, Slots};

/// Structures that can check their own consistency.
pub(crate) trait CheckInvariants {
    #[cfg_attr(not(feature = "debug-invariants"), allow(dead_code))]
    fn check(&self) -> Result<(), InvariantViolation>;
}

impl CheckInvariants for SlotPool {
    fn check(&self) -> Result<(), InvariantViolation> {
        self.check_invariants()
    }
}

impl CheckInvariants for PagedAllocator {
    fn check(&self) -> Result<(), InvariantViolation> {
        KvAllocator::check_invariants(self)
    }
}

/// With feature `debug-invariants`, check after a mutating operation.
#[inline]
#[allow(unused_variables)]
pub(crate) fn debug_check<T: CheckInvariants>(t: &T) {
    #[cfg(feature = "debug-invariants")]
    if let Err(e) = t.check() {
        panic!("kvpool debug-invariants: {e}");
    }
}

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
