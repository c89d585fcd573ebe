//! The concurrency protocol of an overlap scheduler, built from kvpool's types and
//! written once for std and for loom (an example crate: copy it).
//!
//! Every request is a [`Running`]: a [`kvpool::radix::Request`] (its request row, its
//! lock on the cached prefix it matched, the KV slots it allocated) and the tokens whose
//! KV its row holds. It is `Send` and `'static`, so it moves between threads, and
//! dropping it anywhere gives everything back. Three kinds of threads share one
//! [`RadixCache`]:
//!
//! * **router threads** look up how much of a prompt is cached (`peek_prefix`,
//!   lock-free) and may admit the request themselves ([`Running::admit`]: a row and a
//!   lock on the cached prefix, so that the prefix cannot be evicted before the request
//!   reaches the scheduler), then hand it to the scheduler;
//! * the **scheduler thread** admits the other requests, allocates their prompts
//!   ([`Running::prefill`], evicting unlocked prefixes if short) and one decode slot per
//!   request per step ([`decode`]);
//! * the **output thread** finishes requests ([`Running::finish`]: cache their whole
//!   pages, free the rest, give the lock and the row back) or frees whole batches
//!   ([`free_batches`]) while the scheduler allocates the next batch.
//!
//! `tests/models.rs` model-checks this protocol under `RUSTFLAGS="--cfg loom"`: kvpool's
//! atomics are loom's then, and so are this crate's (through [`sync`]).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use kvpool::radix::{RadixCache, Refused, Request};
use kvpool::{AllocError, KvAllocator};

/// This crate's concurrency primitives: std's, or loom's under `--cfg loom` (tokio's
/// facade pattern). Everything concurrent in the crate names these, never `std::sync`.
///
/// One exception: the cache itself is shared through a `std::sync::Arc` in both builds,
/// since [`RadixCache::admit`] takes one and every [`Request`] keeps one (the atomics
/// inside the cache are loom's under loom all the same).
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

/// A request: its [`Request`] handle and its tokens (the prompt, then the input token
/// of every decode step).
///
/// Positions `0..cached_len()` of its row hold the cache's slots for the locked prefix,
/// the rest the request's own. While it lives, none of them is evicted, freed or handed
/// to another request. It ends in [`finish`](Running::finish) or
/// [`abort`](Running::abort); dropping it aborts it.
#[derive(Debug)]
#[must_use = "dropping a request aborts it: its KV is freed and nothing is cached"]
pub struct Running<A: KvAllocator> {
    request: Request<A>,
    tokens: Vec<u32>,
}

impl<A: KvAllocator> Running<A> {
    /// Admit a request for `prompt` (on a router or the scheduler): take a request row,
    /// match the prompt's longest cached prefix into it and lock that prefix (one step:
    /// no eviction can come between). Nothing is allocated yet:
    /// [`prefill`](Self::prefill) does that.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when no request row is free, [`AllocError::Row`] when
    /// the prompt is longer than a row. Nothing is held then.
    pub fn admit(cache: &std::sync::Arc<RadixCache<A>>, namespace: u64, prompt: &[u32]) -> Result<Self, AllocError> {
        Ok(Running { request: cache.admit(namespace, prompt)?, tokens: prompt.to_vec() })
    }

    /// Tokens of the prompt found cached at admission (locked by the request).
    pub fn cached_len(&self) -> usize {
        self.request.cached_len()
    }

    /// The KV slots the request's row holds: the cached prefix's, then its own.
    pub fn slots(&self) -> &[u32] {
        self.request.slots()
    }

    /// The prompt and the decode steps' input tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether the row holds the KV slots of every token: the prompt is allocated.
    pub fn is_prefilled(&self) -> bool {
        self.request.len() == self.tokens.len()
    }

    /// Allocate the KV slots of the rest of the prompt into the request's row, evicting
    /// unlocked prefixes if short.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when even eviction leaves too little room (the
    /// request still holds what it held; try again once others finish). Nothing changes.
    pub fn prefill(&mut self) -> Result<(), AllocError> {
        self.request.extend(self.tokens.len() - self.request.len())
    }

    /// Finish the request (on the output thread): cache the whole pages of the tokens
    /// whose KV its row holds, free the rest, give the lock and the row back. Returns
    /// how many leading tokens the cache held already.
    ///
    /// # Errors
    ///
    /// [`Refused`]: the request comes back whole, nothing changed.
    #[allow(clippy::result_large_err)] // the request itself comes back
    pub fn finish(self) -> Result<usize, Refused<A>> {
        let computed = self.request.len();
        self.request.finish(&self.tokens[..computed])
    }

    /// Give everything back and cache nothing (the same as dropping the request).
    pub fn abort(self) {
        self.request.abort();
    }
}

/// A batch of [`Running`] requests is a batch for [`RadixCache::decode`].
impl<A: KvAllocator> AsMut<Request<A>> for Running<A> {
    fn as_mut(&mut self) -> &mut Request<A> {
        &mut self.request
    }
}

/// One decode step of a batch: `out[i]` gets the KV slot of `inputs[i]`, the token
/// request `i` feeds the model this step (its last output), evicting unlocked prefixes if
/// short.
///
/// # Errors
///
/// As [`RadixCache::decode`]; nothing changes then.
///
/// # Panics
///
/// When `inputs` and the batch differ in length or a request of the batch is not
/// prefilled (a scheduler bug), before anything is allocated.
pub fn decode<A: KvAllocator>(
    cache: &RadixCache<A>,
    batch: &mut [Running<A>],
    inputs: &[u32],
    out: &mut [u32],
) -> Result<(), AllocError> {
    assert_eq!(inputs.len(), batch.len(), "one input token per request");
    assert!(batch.iter().all(Running::is_prefilled), "a request decodes after its prefill");
    cache.decode(batch, out)?;
    for (r, &token) in batch.iter_mut().zip(inputs) {
        r.tokens.push(token);
    }
    Ok(())
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
