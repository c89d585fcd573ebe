//! The concurrency protocol of an overlap scheduler, built from kvpool's types and
//! written once for std and for loom (an example crate: copy it).
//!
//! Three kinds of threads share one [`RadixCache`]:
//!
//! * **router threads** look up where a prompt's prefix is cached and may [`Pin`] it: a
//!   pin locks the prefix so it cannot be evicted before the request arrives, and is
//!   handed to the scheduler (a pin is `Send`, `'static`), which turns it into the
//!   request's own lease ([`admit`]) or gives it back ([`Pin::release`]);
//! * the **scheduler thread** admits requests ([`admit`]: match and lock the prefix, take
//!   a request row, allocate the rest, evicting if short) and allocates decode slots;
//! * the **output thread** finishes requests ([`finish`]: cache them and free their
//!   leftovers) or frees whole batches ([`free_batches`]) while the scheduler allocates
//!   the next batch.
//!
//! `tests/models.rs` model-checks this protocol under `RUSTFLAGS="--cfg loom"`: kvpool's
//! atomics are loom's then, and so are this crate's (through [`sync`]).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use kvpool::radix::{CacheError, Lease, RadixCache, RawLease};
use kvpool::{AllocError, KvAllocator, OutOfMemory, ReqRow, RowError};

/// This crate's concurrency primitives: std's, or loom's under `--cfg loom` (tokio's
/// facade pattern). Everything concurrent in the crate names these, never `std::sync`.
pub mod sync {
    #[cfg(loom)]
    pub use loom::sync::{atomic, mpsc, Arc};
    #[cfg(loom)]
    pub use loom::thread;
    #[cfg(not(loom))]
    pub use std::sync::{atomic, mpsc, Arc};
    #[cfg(not(loom))]
    pub use std::thread;
}

/// A router's lock on a cached prefix, held for a request on its way to the scheduler.
///
/// While a pin lives, the prefix's slots are neither evicted nor freed, so they cannot be
/// handed to another request. It must end in [`release`](Pin::release) or [`admit`];
/// dropping it keeps the prefix locked (kvpool's detached lease), which shows up in the
/// cache's `protected_size()`.
#[derive(Debug)]
#[must_use = "a pin keeps its prefix locked until released or admitted"]
pub struct Pin {
    lease: RawLease,
    slots: Vec<u32>,
}

impl Pin {
    /// Look up `key`'s cached prefix and lock it (one step: no eviction can come between).
    pub fn take<A: KvAllocator>(cache: &RadixCache<A>, namespace: u64, key: &[u32]) -> Pin {
        let mut slots = vec![0u32; key.len()];
        let lease = cache.match_and_lock(namespace, key, &mut slots);
        slots.truncate(lease.len());
        Pin { lease: lease.detach(), slots }
    }

    /// The pinned prefix's KV slots (empty on a miss).
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Unlock the prefix (the request went elsewhere).
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] if the pin belongs to another cache.
    pub fn release<A: KvAllocator>(self, cache: &RadixCache<A>) -> Result<(), CacheError> {
        cache.release(self.lease)
    }
}

/// A request the scheduler is running: its tokens so far, its row (token position ->
/// KV slot), and the lease on the prefix it found cached.
#[derive(Debug)]
pub struct Running<'c, A: KvAllocator> {
    /// Tokens whose KV is in the row.
    pub tokens: Vec<u32>,
    /// The request's row.
    pub row: ReqRow,
    /// The lock on the cached prefix (`lease.len()` tokens).
    pub lease: Lease<'c, A>,
    /// The KV slots of `tokens`: the cached prefix's, then the freshly allocated ones.
    pub slots: Vec<u32>,
}

/// Why [`admit`] refused a request (nothing is left allocated or locked).
#[derive(Debug)]
pub enum AdmitError {
    /// Not enough KV slots, even after evicting.
    Alloc(AllocError),
    /// No free request row.
    NoRow(OutOfMemory),
    /// The prompt is longer than a row.
    Row(RowError),
}

/// Admit a request for `prompt`: lock its cached prefix (the router's `pin` if there is
/// one, else a fresh match), take a row, allocate slots for the rest (evicting unlocked
/// prefixes if short) and record them in the row.
///
/// # Errors
///
/// [`AdmitError`]; the lock is released and the row freed again.
pub fn admit<'c, A: KvAllocator>(
    cache: &'c RadixCache<A>,
    namespace: u64,
    prompt: &[u32],
    pin: Option<Pin>,
) -> Result<Running<'c, A>, AdmitError> {
    let (lease, mut slots) = match pin {
        Some(pin) => match cache.attach(pin.lease) {
            Ok(lease) => (lease, pin.slots),
            Err(raw) => panic!("a pin of another cache: {raw:?}"),
        },
        None => {
            let mut slots = vec![0u32; prompt.len()];
            let lease = cache.match_and_lock(namespace, prompt, &mut slots);
            slots.truncate(lease.len());
            (lease, slots)
        }
    };
    let hit = lease.len();
    let mut row = cache.req_pool().alloc().map_err(AdmitError::NoRow)?;
    slots.resize(prompt.len(), 0);
    let last = if hit > 0 { slots[hit - 1] } else { 0 };
    if let Err(e) = cache.alloc_extend(&[hit as u32], &[prompt.len() as u32], &[last], &mut slots[hit..]) {
        let _ = cache.req_pool().free(row); // ours: cannot fail
        return Err(AdmitError::Alloc(e)); // `lease` drops here: unlocked
    }
    if let Err(e) = cache.req_pool().write(&mut row, 0, &slots) {
        let _ = cache.allocator().free(&slots[hit..]);
        let _ = cache.req_pool().free(row);
        return Err(AdmitError::Row(e));
    }
    Ok(Running { tokens: prompt.to_vec(), row, lease, slots })
}

/// A finished request on its way from the scheduler to the output thread (`'static`
/// and `Send`: the lease travels detached).
#[derive(Debug)]
pub struct Finished {
    /// Tokens whose KV is in the row.
    pub tokens: Vec<u32>,
    /// The request's row.
    pub row: ReqRow,
    /// Its lease, detached.
    pub lease: RawLease,
}

impl<A: KvAllocator> Running<'_, A> {
    /// Hand the request to the output thread.
    pub fn into_finished(self) -> Finished {
        Finished { tokens: self.tokens, row: self.row, lease: self.lease.detach() }
    }
}

/// The output thread: cache a finished request (its whole pages enter the tree, the
/// slots the tree already had and the unaligned tail are freed, the lease and the row
/// are released). Returns the prefix length the tree already held.
///
/// # Errors
///
/// [`CacheError`]; the request's row and lease are released anyway.
pub fn finish<A: KvAllocator>(cache: &RadixCache<A>, namespace: u64, done: Finished) -> Result<usize, CacheError> {
    let lease = match cache.attach(done.lease) {
        Ok(lease) => lease,
        Err(_) => return Err(CacheError::StaleMatch),
    };
    cache.cache_finished_req(namespace, &done.tokens, done.row, lease, 0).map_err(|u| {
        let error = u.error.clone();
        let _ = cache.req_pool().free(u.row);
        error
    })
}

/// What the scheduler sends the output thread of [`free_batches`].
#[derive(Debug)]
pub enum ToOutput {
    /// A batch whose forward pass is done: read its outputs, free its slots.
    Batch(Vec<u32>),
    /// No more batches. (An explicit message, not a hang-up: it makes the shutdown order
    /// part of the protocol, and loom's channel does not model a hang-up — its `recv`
    /// blocks forever once every sender is gone.)
    Stop,
}

/// The output thread of an overlap loop without a cache: for every batch that arrives,
/// call `before_free` on it (where the batch's outputs are read), then free it; until
/// [`ToOutput::Stop`] (or a hang-up). Returns the slots freed.
///
/// # Panics
///
/// If a free fails: a slot was freed twice or never allocated (a scheduler bug).
pub fn free_batches<A: KvAllocator>(
    alloc: &A,
    batches: sync::mpsc::Receiver<ToOutput>,
    mut before_free: impl FnMut(&[u32]),
) -> usize {
    let mut freed = 0;
    while let Ok(ToOutput::Batch(batch)) = batches.recv() {
        before_free(&batch);
        alloc.free(&batch).unwrap_or_else(|e| panic!("freeing {batch:?}: {e}"));
        freed += batch.len();
    }
    freed
}
