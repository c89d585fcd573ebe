//! The Mamba variant of the radix core: [`MambaRadixCache`], SGLang's
//! `MambaRadixCache` for hybrid models (a few full-attention layers with paged KV, the
//! rest linear-attention / SSM layers whose state is one fixed-size block per request).
//!
//! A node carries its KV pages (the core) and optionally a **state slot**: the Mamba
//! state after the node's last token, a checkpoint a later request may resume from
//! (copy-on-write: the request forks its own copy). A node without one is a
//! **tombstone**: its KV stays usable by the attention layers, but a request cannot
//! resume the recurrent layers there. So:
//!
//! * a match walks as far as the KV matches but returns only the prefix up to the
//!   deepest node holding a state ([`RadixCache::match_prefix`] and a request's
//!   [admission](RadixCache::admit) on a Mamba cache; the state is the request's
//!   [`resume_state`](super::Request::resume_state)); only that path's recency is
//!   refreshed;
//! * a split gives the upper half no state (a state is valid only at the end of its
//!   node's tokens);
//! * locking locks the KV of the whole path (as the plain cache) and the state of the
//!   lease's end node only (its *state lock*);
//! * [`evict`](RadixCache::evict) removes unlocked leaves with their state, and then
//!   any parent left a childless tombstone (a leaf is never a tombstone);
//!   [`evict_mamba`](RadixCache::evict_mamba) frees states of unlocked nodes in LRU
//!   order: an internal node becomes a tombstone, a leaf is removed whole.
//!
//! The states themselves live in a pool the cache frees them into ([`StatePool`]:
//! kvpool's `MambaPool`, or a [`SlotPool`]); the tree records which node holds
//! which slot, so a slot handed to the tree twice, or one the caller does not hold, is
//! refused with [`CacheError::StateNotOwned`].
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::radix::{MambaRadixCache, RadixConfig};
//! use kvpool::{ReqToTokenPool, SlotPool, TokenAllocator};
//!
//! let cache = Arc::new(MambaRadixCache::with_states(
//!     TokenAllocator::new(64)?,
//!     ReqToTokenPool::new(4, 64)?,
//!     SlotPool::without_magazines(8), // 8 state slots
//!     RadixConfig::default(),
//! )?);
//! // A request computes 8 tokens and saves its state after them.
//! let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
//! let mut req = cache.admit(0, &tokens)?;
//! let saved = req.save_state(8)?; // the model copies its running state there
//! req.extend(8)?;
//! assert!(req.finish(&tokens)?.state_kept);
//!
//! // Same start, then different: the KV of 4 tokens matches, but no state lies there.
//! let other = cache.admit(0, &[1, 2, 3, 4, 9, 9, 9, 9])?;
//! assert_eq!((other.kv_hit(), other.cached_len()), (4, 0));
//! drop(other);
//! // The whole prompt again: the state after token 8 can be resumed from.
//! let again = cache.admit(0, &tokens)?;
//! assert_eq!((again.cached_len(), again.resume_state()), (8, Some(saved)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt::{self, Write as _};
use std::sync::Arc;

use super::heap::{self, Heap, Slot};
use super::variant::Variant;
use super::writer::Writer;
use super::LatchHeld;
#[cfg(test)]
use super::Unfinished;
use super::{CacheError, EvictionPolicy, Lease, Meta, RadixCache, RadixConfig, NIL, ROOT};
use crate::alloc::KvAllocator;
use crate::error::{AllocError, ConfigError, FreeError, FreeErrorKind, OutOfMemory, Unit};
use crate::mamba::{MambaPool, MambaSlot};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::slots::SlotPool;
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Where a [`MambaRadixCache`] keeps the states it holds: slot numbers `1..=capacity`
/// handed out and taken back (lock-free, like every kvpool pool).
///
/// Implemented for [`SlotPool`] (numbers only: an engine whose states live on the GPU),
/// [`MambaPool`] (with the state bytes), and an [`Arc`] of a [`MambaPool`] (shared with
/// the engine's model runner); sealed, so no other type can implement it.
///
/// # Who frees a state
///
/// A state the tree took (from a request's [`finish`](super::Request::finish) or
/// [`checkpoint`](super::Request::checkpoint)) is freed by the tree alone, when it
/// evicts it; a request's own states go back when it ends. The cache's callers see its
/// pool through [`states`](RadixCache::states), which frees nothing; a [`MambaPool`]
/// marks the cache's states in its own state words, so its [`free`](MambaPool::free)
/// refuses them ([`FreeErrorKind::Cached`]), through any `Arc` of it. That is why a
/// [`SlotPool`], which keeps no such marks, is taken only by value: no other handle to
/// it can exist.
///
/// # One cache per pool
///
/// The cache records which of its nodes holds which state, so a state handed to it
/// twice is refused; but a second cache would not see the first one's records and
/// could adopt a state the first holds. So a pool shared through an [`Arc`] serves one
/// live cache at a time: building a second
/// cache over it is refused with [`ConfigError::Unsupported`] until the first is
/// dropped, which gives the states it held back to the pool.
///
/// ```
/// use std::sync::Arc;
/// use kvpool::mamba::{MambaConfig, MambaPool, StateDtype, StateShape};
/// use kvpool::radix::{MambaRadixCache, RadixConfig};
/// use kvpool::{ConfigError, FreeErrorKind, ReqToTokenPool, TokenAllocator};
///
/// let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// let states = Arc::new(MambaPool::new(4, cfg)?);
/// let mk = || MambaRadixCache::with_states(
///     TokenAllocator::new(64).unwrap(), ReqToTokenPool::new(2, 64).unwrap(),
///     Arc::clone(&states), RadixConfig::default());
/// let first = Arc::new(mk()?);
/// assert!(matches!(mk(), Err(ConfigError::Unsupported { .. })));
/// let mut req = first.admit(0, &[1, 2, 3, 4])?;
/// let state = req.save_state(4)?;
/// req.extend(4)?;
/// req.finish(&[1, 2, 3, 4])?;
/// // The tree's state: refused through the pool's own `Arc` as well.
/// assert_eq!(states.free(&[state]).unwrap_err().kind, FreeErrorKind::Cached);
/// drop(first);
/// assert_eq!(states.available(), 4); // given back with the cache
/// let _second = mk()?; // the pool is free for another cache again
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait StatePool: sealed::SharedPool + Send + Sync + 'static {
    /// The highest slot number.
    fn capacity(&self) -> u32;
    /// Free slots now.
    fn available(&self) -> usize;
    /// Hand out one slot.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] when none is free.
    fn alloc_one(&self) -> Result<u32, OutOfMemory>;
    /// Take slots back.
    ///
    /// # Errors
    ///
    /// [`FreeError`] for a slot that is out of range or not handed out.
    fn free(&self, slots: &[u32]) -> Result<(), FreeError>;
    /// Whether `slot` is handed out.
    fn is_allocated(&self, slot: u32) -> bool;
}

mod sealed {
    use crate::error::{FreeError, OutOfMemory};
    use crate::mamba::MambaSlot;

    /// The private half of [`StatePool`](super::StatePool).
    pub trait SharedPool {
        /// The address of the pool other values of this type may share (an `Arc`'s
        /// pointee), or `None` for a pool this value owns alone.
        fn shared_at(&self) -> Option<usize>;
        /// The tree takes state `slot` from its caller: from now on only the tree frees
        /// it. `false` (nothing changed) when `slot` is not a state the caller holds.
        fn hold(&self, slot: u32) -> bool;
        /// Undo [`hold`](Self::hold) (a refused insert gives the state back).
        fn release(&self, slot: u32);
        /// Free a state the tree holds (at once, or when its last reader is done).
        fn free_held(&self, slot: u32) -> Result<(), FreeError>;
        /// The pool's own invariants.
        fn check_pool(&self) -> Result<(), crate::error::InvariantViolation>;
        /// A running state for a request: its number, and for a pool with the state
        /// bytes the handle through which the request alone reads and writes it.
        fn alloc_running(&self) -> Result<(u32, Option<MambaSlot>), OutOfMemory>;
        /// Fork cached state `src` into a request's running state (a pool with the
        /// bytes copies them; with numbers only, the engine copies).
        fn fork_into(&self, src: u32, running: Option<&mut MambaSlot>);
        /// A state for a request to cache with: with the bytes, a copy of its running
        /// state now (`prev`, a state saved before, is freed then); with numbers only,
        /// `prev` kept or a fresh number (the engine copies).
        fn save_running(&self, running: Option<&MambaSlot>, prev: Option<u32>) -> Result<u32, OutOfMemory>;
        /// Give a request's running state back.
        fn free_running(&self, slot: u32, handle: Option<MambaSlot>) -> Result<(), FreeError>;
        /// The tree takes a state a request saved ([`save_running`](Self::save_running)):
        /// `false`, nothing changed, when `slot` is not one.
        fn hold_saved(&self, slot: u32) -> bool;
        /// Free a state a request saved and did not hand to the tree.
        fn free_saved(&self, slot: u32) -> Result<(), FreeError>;
    }
}

/// A [`SlotPool`] only the cache reaches (it is not shared: see [`StatePool`]), so
/// the tree's states are kept from its callers by the cache's view
/// ([`CacheStates`]) alone.
impl sealed::SharedPool for SlotPool {
    fn shared_at(&self) -> Option<usize> {
        None
    }
    fn hold(&self, slot: u32) -> bool {
        self.is_allocated(slot)
    }
    fn release(&self, _slot: u32) {}
    fn free_held(&self, slot: u32) -> Result<(), FreeError> {
        self.free(&[slot])
    }
    fn check_pool(&self) -> Result<(), crate::error::InvariantViolation> {
        self.check_invariants()
    }
    fn alloc_running(&self) -> Result<(u32, Option<MambaSlot>), OutOfMemory> {
        Ok((self.alloc_one()?, None))
    }
    fn fork_into(&self, _src: u32, _running: Option<&mut MambaSlot>) {}
    fn save_running(&self, _running: Option<&MambaSlot>, prev: Option<u32>) -> Result<u32, OutOfMemory> {
        prev.map_or_else(|| self.alloc_one(), Ok)
    }
    fn free_running(&self, slot: u32, _handle: Option<MambaSlot>) -> Result<(), FreeError> {
        self.free(&[slot])
    }
    fn hold_saved(&self, slot: u32) -> bool {
        self.is_allocated(slot)
    }
    fn free_saved(&self, slot: u32) -> Result<(), FreeError> {
        self.free(&[slot])
    }
}

/// A [`MambaPool`] marks the states a tree holds in their state words, so its own
/// [`free`](MambaPool::free) refuses them whoever calls it (also through an `Arc`).
impl sealed::SharedPool for MambaPool {
    fn shared_at(&self) -> Option<usize> {
        None
    }
    fn hold(&self, slot: u32) -> bool {
        self.hold_for_tree(slot)
    }
    fn release(&self, slot: u32) {
        self.release_from_tree(slot);
    }
    fn free_held(&self, slot: u32) -> Result<(), FreeError> {
        self.free_tree_held(slot)
    }
    fn check_pool(&self) -> Result<(), crate::error::InvariantViolation> {
        self.check_invariants()
    }
    fn alloc_running(&self) -> Result<(u32, Option<MambaSlot>), OutOfMemory> {
        let handle = self.alloc()?;
        Ok((handle.index(), Some(handle)))
    }
    fn fork_into(&self, src: u32, running: Option<&mut MambaSlot>) {
        if let Some(dst) = running {
            // `src` is the state at the end of the request's locked prefix: the lock
            // keeps it cached, and the copy pins it.
            let r = self.copy_from(&[src], &mut [dst]);
            debug_assert!(r.is_ok(), "the fork of a locked state failed: {r:?}");
        }
    }
    fn save_running(&self, running: Option<&MambaSlot>, prev: Option<u32>) -> Result<u32, OutOfMemory> {
        let mut copy = self.alloc()?;
        if let Some(src) = running {
            let r = self.copy_slot(src, &mut copy);
            debug_assert!(r.is_ok(), "a copy between two held states of the pool failed: {r:?}");
        }
        // Cached by number and marked as a cache's: frozen from now on, as a state the
        // tree may take must be, and refused to anyone freeing it by number. (`copy` is
        // this pool's own handle, so this cannot refuse it.)
        let slot = match self.cache_for_tree(copy) {
            Ok(slot) => slot,
            Err(refused) => {
                let _ = self.free_slot(refused.slot);
                return Err(OutOfMemory { requested: 1, available: 0, evictable: None, unit: Unit::MambaSlots });
            }
        };
        if let Some(prev) = prev {
            let r = self.free_tree_held(prev);
            debug_assert!(r.is_ok(), "a request's saved state failed to free: {r:?}");
        }
        Ok(slot)
    }
    fn hold_saved(&self, slot: u32) -> bool {
        self.is_tree_held(slot)
    }
    fn free_saved(&self, slot: u32) -> Result<(), FreeError> {
        self.free_tree_held(slot)
    }
    fn free_running(&self, slot: u32, handle: Option<MambaSlot>) -> Result<(), FreeError> {
        let not_held = FreeError { index: slot, kind: FreeErrorKind::NotAllocated, rest_freed: false };
        self.free_slot(handle.ok_or(not_held)?).map_err(|_| not_held)
    }
}

/// The pool behind the `Arc`, shared (only `Arc<MambaPool>` is a [`StatePool`]).
impl<P: sealed::SharedPool> sealed::SharedPool for Arc<P> {
    fn shared_at(&self) -> Option<usize> {
        Some(Arc::as_ptr(self) as *const () as usize)
    }
    fn hold(&self, slot: u32) -> bool {
        (**self).hold(slot)
    }
    fn release(&self, slot: u32) {
        (**self).release(slot);
    }
    fn free_held(&self, slot: u32) -> Result<(), FreeError> {
        (**self).free_held(slot)
    }
    fn check_pool(&self) -> Result<(), crate::error::InvariantViolation> {
        (**self).check_pool()
    }
    fn alloc_running(&self) -> Result<(u32, Option<MambaSlot>), OutOfMemory> {
        (**self).alloc_running()
    }
    fn fork_into(&self, src: u32, running: Option<&mut MambaSlot>) {
        (**self).fork_into(src, running);
    }
    fn save_running(&self, running: Option<&MambaSlot>, prev: Option<u32>) -> Result<u32, OutOfMemory> {
        (**self).save_running(running, prev)
    }
    fn free_running(&self, slot: u32, handle: Option<MambaSlot>) -> Result<(), FreeError> {
        (**self).free_running(slot, handle)
    }
    fn hold_saved(&self, slot: u32) -> bool {
        (**self).hold_saved(slot)
    }
    fn free_saved(&self, slot: u32) -> Result<(), FreeError> {
        (**self).free_saved(slot)
    }
}

/// The shared state pools (by address) a live cache holds: at most one cache per pool
/// ("One cache per pool" on [`StatePool`]). Only touched when a cache is built or
/// dropped, never on a request path. A plain `std` mutex, also under loom: this is
/// setup bookkeeping, not part of any modelled protocol.
static CLAIMED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// A cache's claim on its shared state pool, released when the cache is dropped.
#[derive(Debug)]
struct PoolClaim(Option<usize>);

impl PoolClaim {
    fn take(pool: &impl StatePool) -> Result<Self, ConfigError> {
        let Some(at) = pool.shared_at() else { return Ok(PoolClaim(None)) };
        // A poisoned lock only means a panic elsewhere while it was held; the list is
        // still consistent (each change is one push or one swap_remove).
        let mut claimed = CLAIMED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if claimed.contains(&at) {
            return Err(ConfigError::Unsupported {
                what: "a Mamba state pool another live MambaRadixCache holds",
                with: "a second cache (a state must have one owner)",
            });
        }
        claimed
            .try_reserve(1)
            .map_err(|_| ConfigError::TooLargeForMemory { what: "the state pool claims", bytes: 8 })?;
        claimed.push(at);
        Ok(PoolClaim(Some(at)))
    }
}

impl Drop for PoolClaim {
    fn drop(&mut self) {
        let Some(at) = self.0 else { return };
        let mut claimed = CLAIMED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = claimed.iter().position(|&c| c == at) {
            claimed.swap_remove(i);
        }
    }
}

impl StatePool for SlotPool {
    fn capacity(&self) -> u32 {
        SlotPool::capacity(self)
    }
    fn available(&self) -> usize {
        SlotPool::available(self)
    }
    fn alloc_one(&self) -> Result<u32, OutOfMemory> {
        SlotPool::alloc_one(self)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        SlotPool::free(self, slots)
    }
    fn is_allocated(&self, slot: u32) -> bool {
        SlotPool::is_allocated(self, slot)
    }
}

/// A [`MambaPool`] shared with the engine, which reads and writes the state bytes of
/// the slots its requests hold ([`Request::state`](super::Request::state)).
impl StatePool for Arc<MambaPool> {
    fn capacity(&self) -> u32 {
        (**self).capacity()
    }
    fn available(&self) -> usize {
        StatePool::available(&**self)
    }
    fn alloc_one(&self) -> Result<u32, OutOfMemory> {
        (**self).alloc_one()
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        MambaPool::free(self, slots)
    }
    fn is_allocated(&self, slot: u32) -> bool {
        StatePool::is_allocated(&**self, slot)
    }
}

/// Where a hybrid model can checkpoint its recurrent state (SGLang's
/// `FLA_CHUNK_SIZE` and `mamba_track_interval`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Prefill checkpoints lie at multiples of this (64: the linear-attention kernels'
    /// chunk). A whole number of pages.
    pub chunk_size: usize,
    /// Decode checkpoints every this many tokens (256). A whole number of chunks.
    pub track_interval: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { chunk_size: 64, track_interval: 256 }
    }
}

impl CheckpointConfig {
    /// The checkpoint a request whose prompt matched `kv_len` tokens of KV but only
    /// `prefix_len` tokens up to a cached state should save during prefill: the last
    /// chunk boundary of the KV match (SGLang's `mamba_branching_seqlen`), so that the
    /// next request on this branch can resume there. `None` when the KV match ended at
    /// the state (no branching) or before the first chunk.
    pub fn branching_len(&self, kv_len: usize, prefix_len: usize) -> Option<usize> {
        let aligned = kv_len / self.chunk_size * self.chunk_size;
        (kv_len > prefix_len && aligned > 0).then_some(aligned)
    }

    /// The last checkpoint at or before `len` tokens of prefill (a chunk boundary).
    pub fn prefill_checkpoint(&self, len: usize) -> usize {
        len / self.chunk_size * self.chunk_size
    }

    /// Whether a sequence of `seq_len` tokens ends on a decode checkpoint.
    pub fn is_decode_checkpoint(&self, seq_len: usize) -> bool {
        seq_len > 0 && seq_len % self.track_interval == 0
    }

    fn validate(&self, page_size: usize) -> Result<(), ConfigError> {
        if self.chunk_size == 0 {
            return Err(ConfigError::Zero("the Mamba chunk size"));
        }
        if self.chunk_size % page_size != 0 {
            let (value, unit) = (self.chunk_size, page_size);
            return Err(ConfigError::NotAMultiple { what: "the Mamba chunk size", value, of: "the page size", unit });
        }
        if self.track_interval == 0 || self.track_interval % self.chunk_size != 0 {
            let (value, unit) = (self.track_interval, self.chunk_size);
            return Err(ConfigError::NotAMultiple {
                what: "the Mamba track interval",
                value,
                of: "the chunk size",
                unit,
            });
        }
        Ok(())
    }
}

/// The Mamba variant (see the [module docs](self)): nodes carry an optional state slot
/// of pool `P`.
#[derive(Debug)]
pub struct Mamba<P: StatePool> {
    /// First, so that it is released before `pool` (an `Arc` keeping the claimed
    /// address alive) is dropped.
    _claim: PoolClaim,
    pool: P,
    config: CheckpointConfig,
    /// One bit per state slot: set while the tree holds the slot. Written by the
    /// writer; read without the latch by [`CacheStates::free`], which refuses them.
    held: Box<[AtomicU64]>,

    evictable: AtomicUsize,
    protected: AtomicUsize,
}

impl<P: StatePool> Mamba<P> {
    #[inline]
    fn bit(slot: u32) -> (usize, u64) {
        ((slot / 64) as usize, 1u64 << (slot % 64))
    }

    fn is_held(&self, slot: u32) -> bool {
        let (w, b) = Self::bit(slot);
        self.held.get(w).is_some_and(|x| x.load(Ordering::Acquire) & b != 0)
    }

    /// Set (`true`) or clear `state`'s bit in `held`.
    fn mark(&self, state: u32, held: bool) {
        let (w, b) = Self::bit(state);
        if held {
            self.held[w].fetch_or(b, Ordering::Release);
        } else {
            self.held[w].fetch_and(!b, Ordering::Release);
        }
    }

    /// The tree takes `state` from its caller (the writer, with the tree's own record
    /// of it checked). `false`, nothing changed, when it is not the caller's to give.
    #[cfg(test)]
    fn take(&self, state: u32) -> bool {
        let taken = self.pool.hold(state);
        if taken {
            self.mark(state, true);
        }
        taken
    }

    /// The tree takes the state a request saved: as [`take`](Self::take), but the
    /// pool already counts it as the cache's.
    fn take_saved(&self, state: u32) -> bool {
        let taken = self.pool.hold_saved(state);
        if taken {
            self.mark(state, true);
        }
        taken
    }

    /// Undo [`take_saved`](Self::take_saved): the request's again.
    fn give_back_saved(&self, state: u32) {
        self.mark(state, false);
    }

    /// Undo [`take`](Self::take).
    #[cfg(test)]
    fn give_back(&self, state: u32) {
        self.mark(state, false);
        self.pool.release(state);
    }

    /// Free a state the tree took.
    fn free_state(&self, state: u32) -> Result<(), FreeError> {
        self.mark(state, false);
        self.pool.free_held(state)
    }
}

/// A dropped cache gives its states back to the pool (which may outlive it, shared
/// with hybrid rows).
impl<P: StatePool> Drop for Mamba<P> {
    fn drop(&mut self) {
        for (i, word) in self.held.iter().enumerate() {
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let slot = (i * 64) as u32 + bits.trailing_zeros();
                let r = self.pool.free_held(slot);
                debug_assert!(r.is_ok(), "a state the tree held failed to free: {r:?}");
                bits &= bits - 1;
            }
        }
    }
}

/// A [`MambaRadixCache`]'s state pool as its callers see it
/// ([`states`](RadixCache::states)): its sizes and which slots the tree holds. States
/// are taken and given back by [`Request`](super::Request)s and the tree's eviction.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use kvpool::radix::{MambaRadixCache, RadixConfig};
/// use kvpool::{ReqToTokenPool, SlotPool, TokenAllocator};
///
/// let cache = Arc::new(MambaRadixCache::with_states(
///     TokenAllocator::new(64)?, ReqToTokenPool::new(2, 64)?,
///     SlotPool::without_magazines(4), RadixConfig::default())?);
/// let mut req = cache.admit(0, &[1, 2, 3, 4])?;  // takes a running state
/// let state = req.save_state(4)?;                // and one to cache
/// assert_eq!(cache.states().available(), 2);
/// req.extend(4)?;
/// req.finish(&[1, 2, 3, 4])?;                    // the running state goes back
/// assert!(cache.states().is_held(state));        // the tree's now
/// assert_eq!(cache.states().available(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CacheStates<'c, P: StatePool> {
    v: &'c Mamba<P>,
}

impl<P: StatePool> CacheStates<'_, P> {
    /// The highest slot number.
    pub fn capacity(&self) -> u32 {
        self.v.pool.capacity()
    }

    /// Free slots now.
    pub fn available(&self) -> usize {
        self.v.pool.available()
    }

    /// Whether `slot` is handed out (to a caller or to the tree).
    pub fn is_allocated(&self, slot: u32) -> bool {
        self.v.pool.is_allocated(slot)
    }

    /// Whether the tree holds `slot` (it frees it itself, when it evicts it).
    pub fn is_held(&self, slot: u32) -> bool {
        self.v.is_held(slot)
    }

    /// Check the pool's own bookkeeping (O(capacity); exact at quiescence).
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`](crate::error::InvariantViolation) on a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), crate::error::InvariantViolation> {
        self.v.pool.check_pool()
    }

    /// Give back states the caller holds, all or nothing.
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first offending slot, nothing freed:
    /// [`FreeErrorKind::Cached`] for a state the tree holds, and the pool's errors
    /// (out of range, not allocated, named twice).
    #[cfg(test)]
    pub(crate) fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        if let Some(&s) = slots.iter().find(|&&s| self.v.is_held(s)) {
            return Err(FreeError { index: s, kind: FreeErrorKind::Cached, rest_freed: false });
        }
        self.v.pool.free(slots)
    }
}

/// The pool itself, for its state bytes (a [`MambaPool`] refuses to free the states a
/// tree holds by itself).
impl<'c> CacheStates<'c, MambaPool> {
    /// The Mamba pool.
    pub fn pool(&self) -> &'c MambaPool {
        &self.v.pool
    }
}

/// The pool itself, for its state bytes (as for an owned [`MambaPool`]).
impl<'c> CacheStates<'c, Arc<MambaPool>> {
    /// The Mamba pool.
    pub fn pool(&self) -> &'c Arc<MambaPool> {
        &self.v.pool
    }
}

impl<P: StatePool> fmt::Debug for CacheStates<'_, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheStates").field("capacity", &self.capacity()).field("available", &self.available()).finish()
    }
}

/// A radix cache whose nodes also carry Mamba states (see the [module docs](self)).
pub type MambaRadixCache<A, P = SlotPool> = RadixCache<A, Mamba<P>>;

/// A node's state: its slot (`NIL`: a tombstone), its state lock count, and its place
/// in the state order.
#[derive(Clone, Copy, Debug)]
pub struct MambaNode {
    state: u32,
    lock: u32,
    pos: u32,
}

impl Default for MambaNode {
    fn default() -> Self {
        MambaNode { state: NIL, lock: 0, pos: NIL }
    }
}

/// The state order (SGLang's `mamba_lru_list`): nodes holding an unlocked state, least
/// recently used first, internal nodes included.
struct States;

impl Slot<MambaNode> for States {
    #[inline]
    fn pos(m: &Meta<MambaNode>) -> u32 {
        m.ext.pos
    }
    #[inline]
    fn set_pos(m: &mut Meta<MambaNode>, pos: u32) {
        m.ext.pos = pos;
    }
    #[inline]
    fn key(_: EvictionPolicy, m: &Meta<MambaNode>) -> (i64, u64) {
        (0, m.last_access)
    }
}

/// The variant's writer-only state.
#[derive(Debug)]
pub struct MambaState {
    order: Vec<u32>,
    /// For each state slot: the node holding it, or `NIL`.
    owner: Box<[u32]>,
}

impl<P: StatePool> super::variant::sealed::Sealed for Mamba<P> {}

fn states<'w, A: KvAllocator, P: StatePool>(w: &'w mut Writer<'_, A, Mamba<P>>) -> Heap<'w, MambaNode, States> {
    Heap::new(&mut w.s.ext.order, &mut w.s.meta, w.c.policy)
}

// The hooks take the core's crate-private lease types: the trait is sealed and its hooks hidden.
#[allow(private_interfaces)]
impl<P: StatePool> Variant for Mamba<P> {
    type Node = MambaNode;
    type State = MambaState;
    type Walk = ();
    const TOUCH_WHILE_WALKING: bool = false;
    type Request = MambaRequest;
    type Finished = StateInsert;

    /// The longest prefix that ends at a cached state, locked; and the request's
    /// running state (evicting the least recently used unlocked state when none is
    /// free).
    fn admit_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        prompt: &[u32],
        row: &mut ReqRow,
    ) -> Result<(super::RawLease, MambaRequest), AllocError> {
        let m = c.match_and_lock_checkpoint_row(namespace, prompt, row).map_err(AllocError::Row)?;
        // On error the lease unlocks as it drops.
        let (running, mut handle) = c.with_state_room(|| c.variant.pool.alloc_running())?;
        if let Some(src) = m.state {
            c.variant.pool.fork_into(src, handle.as_mut());
        }
        let req = MambaRequest {
            running: Some(running),
            handle,
            resume: m.state,
            kv_len: m.kv_len,
            branching_len: m.branching_len,
            saved: None,
        };
        Ok((m.lease.detach(), req))
    }

    fn finish_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, Self>,
        priority: i64,
        req: &mut MambaRequest,
    ) -> Result<StateInsert, CacheError> {
        let Some((at, state)) = req.saved else {
            // No state saved past the prefix it resumed from: nothing to cache. Its own
            // KV goes back, and its lock.
            let own = rows.read(row, lease.len()..tokens.len())?;
            c.alloc.free(own).map_err(CacheError::Free)?;
            c.release_key(lease.key)?;
            return Ok(StateInsert { cached: lease.len(), state_kept: false });
        };
        if at > tokens.len() {
            return Err(CacheError::SavedState { at: Some(at), up_to: tokens.len() });
        }
        let taken = core::cell::Cell::new(false);
        let r = c
            .finish(
                rows,
                namespace,
                tokens,
                row,
                lease,
                priority,
                at,
                |w| RadixCache::take_saved_into(w, state, &taken),
                |w, ins| RadixCache::adopt_state(w, ins.end, state),
            )
            .map(|(cached, state_kept)| StateInsert { cached, state_kept });
        match r {
            Ok(done) => {
                req.saved = None; // the tree's now
                Ok(done)
            }
            Err(e) => {
                c.untake_saved(state, &taken);
                Err(e)
            }
        }
    }

    fn checkpoint_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Self>,
        priority: i64,
        req: &mut MambaRequest,
    ) -> Result<(), CacheError> {
        let state = match req.saved {
            Some((at, state)) if at == tokens.len() => state,
            saved => return Err(CacheError::SavedState { at: saved.map(|(at, _)| at), up_to: tokens.len() }),
        };
        let taken = core::cell::Cell::new(false);
        let r = c.unfinished_with(
            &c.req_pool,
            namespace,
            tokens,
            row,
            lease,
            priority,
            tokens.len(),
            |w| RadixCache::take_saved_into(w, state, &taken),
            |w, ins| RadixCache::adopt_state(w, ins.end, state),
        );
        match r {
            Ok(_) => {
                req.saved = None;
                Ok(())
            }
            Err(e) => {
                c.untake_saved(state, &taken);
                Err(e)
            }
        }
    }

    fn release_request(&self, req: &mut MambaRequest) {
        if let Some(s) = req.running.take() {
            let freed = self.pool.free_running(s, req.handle.take());
            debug_assert!(freed.is_ok(), "a request's running state failed to free: {freed:?}");
        }
        if let Some((_, s)) = req.saved.take() {
            let freed = self.pool.free_saved(s);
            debug_assert!(freed.is_ok(), "a request's saved state failed to free: {freed:?}");
        }
    }

    fn new_state(&self, nodes: usize) -> Result<MambaState, ConfigError> {
        let slots = self.pool.capacity() as usize + 1;
        Ok(MambaState {
            order: crate::arena::try_with_capacity(nodes, "mamba state order")?,
            owner: crate::arena::try_vec_with(slots, "mamba state owners", |_| NIL)?.into_boxed_slice(),
        })
    }

    #[inline]
    fn match_end(node: &MambaNode) -> bool {
        node.state != NIL
    }

    #[inline]
    fn is_tombstone(node: &MambaNode) -> bool {
        node.state == NIL
    }

    #[inline]
    fn split_payload(_lower: &mut MambaNode) -> MambaNode {
        // A state is valid only after the node's last token: the upper half has none.
        MambaNode::default()
    }

    fn split<A: KvAllocator>(w: &mut Writer<'_, A, Self>, _old: u32, _upper: u32, lower: u32) {
        let e = w.s.meta[lower as usize].ext;
        if e.pos != NIL {
            w.s.ext.order[e.pos as usize] = lower;
        }
        if e.state != NIL {
            w.s.ext.owner[e.state as usize] = lower;
        }
        // The lower half is more recent than the new upper half (SGLang re-times the
        // child after inserting its new parent).
        w.touch(lower);
    }

    fn removing<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        let e = w.s.meta[id as usize].ext;
        if e.state == NIL {
            return;
        }
        states(w).remove(id);
        w.s.ext.owner[e.state as usize] = NIL;
        w.s.meta[id as usize].ext.state = NIL;
        let count = if e.lock == 0 { &w.c.variant.evictable } else { &w.c.variant.protected };
        count.latch_sub(1);
        let r = w.c.variant.free_state(e.state);
        debug_assert!(r.is_ok(), "a state held by the tree failed to free: {r:?}");
    }

    fn lock_end<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) -> u64 {
        let e = w.s.meta[id as usize].ext;
        if e.state == NIL {
            return 0;
        }
        let v = &w.c.variant;
        if e.lock == 0 {
            v.evictable.latch_sub(1);
            v.protected.latch_add(1);
            states(w).remove(id);
        }
        w.s.meta[id as usize].ext.lock += 1;
        0
    }

    fn unlock_end<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32, _aux: u64) {
        let e = w.s.meta[id as usize].ext;
        if e.state == NIL {
            return;
        }
        let v = &w.c.variant;
        debug_assert!(e.lock > 0, "a state lock released twice");
        w.s.meta[id as usize].ext.lock -= 1;
        if e.lock == 1 {
            v.evictable.latch_add(1);
            v.protected.latch_sub(1);
            states(w).push(id);
        }
    }

    #[inline]
    fn touched<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        states(w).update(id);
    }

    fn reset<A: KvAllocator>(w: &mut Writer<'_, A, Self>) {
        w.s.ext.order.clear();
        w.s.ext.owner.iter_mut().for_each(|o| *o = NIL);
        w.c.variant.evictable.store(0, Ordering::Release);
        w.c.variant.protected.store(0, Ordering::Release);
    }

    fn check<A: KvAllocator>(w: &Writer<'_, A, Self>) -> Result<(), String> {
        let (mut evictable, mut protected, mut listed) = (0usize, 0usize, 0usize);
        for (id, m) in w.s.meta.iter().enumerate().skip(1) {
            if !m.alive {
                continue;
            }
            let e = m.ext;
            if e.state == NIL {
                if m.children == 0 {
                    return Err(format!("node {id} is a tombstone leaf"));
                }
                if e.lock != 0 || e.pos != NIL {
                    return Err(format!("tombstone {id} has a state lock or an order place"));
                }
                continue;
            }
            if e.state == 0 || e.state as usize >= w.s.ext.owner.len() || w.s.ext.owner[e.state as usize] != id as u32 {
                return Err(format!("node {id} holds state {} that is not recorded as its own", e.state));
            }
            if !w.c.variant.pool.is_allocated(e.state) {
                return Err(format!("state {} of node {id} is free in the pool", e.state));
            }
            if !w.c.variant.is_held(e.state) {
                return Err(format!("state {} of node {id} is not marked as the tree's", e.state));
            }
            if e.lock > m.lock_ref {
                return Err(format!("node {id} has more state locks than KV locks"));
            }
            if e.lock == 0 {
                evictable += 1;
                listed += 1;
                if e.pos == NIL {
                    return Err(format!("unlocked state of node {id} is not in the state order"));
                }
            } else {
                protected += 1;
                if e.pos != NIL {
                    return Err(format!("locked state of node {id} is in the state order"));
                }
            }
        }
        for (slot, &o) in w.s.ext.owner.iter().enumerate() {
            if o != NIL && (o as usize >= w.s.meta.len() || w.s.meta[o as usize].ext.state != slot as u32) {
                return Err(format!("state {slot} is recorded for node {o}, which does not hold it"));
            }
            if o == NIL && w.c.variant.is_held(slot as u32) {
                return Err(format!("state {slot} is marked as the tree's, but no node holds it"));
            }
        }
        if listed != w.s.ext.order.len() {
            return Err(format!("state order holds {}, {listed} unlocked states", w.s.ext.order.len()));
        }
        let sizes = (w.c.variant.evictable.load(Ordering::Relaxed), w.c.variant.protected.load(Ordering::Relaxed));
        if sizes != (evictable, protected) {
            return Err(format!("state sizes {sizes:?}, nodes add up to {:?}", (evictable, protected)));
        }
        heap::check::<_, States>(&w.s.ext.order, &w.s.meta, w.c.policy)
    }

    fn describe(node: &MambaNode, out: &mut String) {
        if node.state == NIL {
            out.push_str(" tombstone");
        } else {
            let _ = write!(out, " state={}", node.state);
            if node.lock != 0 {
                let _ = write!(out, " state_locks={}", node.lock);
            }
        }
    }
}

/// What a [`Request`](super::Request) of a [`MambaRadixCache`] holds besides its KV:
/// its running state, and the state it saved for caching (see
/// [`Request::save_state`](super::Request::save_state)).
#[derive(Debug, Default)]
pub struct MambaRequest {
    running: Option<u32>,
    /// The running state's handle, with a pool that holds the state bytes.
    handle: Option<crate::mamba::MambaSlot>,
    resume: Option<u32>,
    kv_len: usize,
    branching_len: Option<usize>,
    saved: Option<(usize, u32)>,
}

impl<A: KvAllocator, P: StatePool> super::Request<A, Mamba<P>> {
    /// The request's own running state slot, taken at admission. Over a [`MambaPool`]
    /// the admission forked the [`resume_state`](Self::resume_state) into it already
    /// (SGLang's copy-on-write fork), and the request reads and writes its bytes
    /// through the pool, passing itself as the holder (`pool.component_mut(&mut req,
    /// ..)`: see [`HeldState`](crate::mamba::HeldState)). Over a [`SlotPool`] the
    /// states live with the engine, which forks the resume state into this slot itself.
    pub fn state(&self) -> u32 {
        self.ext_ref().running.unwrap_or(0)
    }

    /// The cached state the request resumes from, after its
    /// [`cached_len`](Self::cached_len) tokens (`None` when nothing matched): the lock
    /// keeps it until the request ends.
    pub fn resume_state(&self) -> Option<u32> {
        self.ext_ref().resume
    }

    /// How far the KV matched at admission (`>= cached_len()`: the request resumes
    /// only where a state is cached, and recomputes the rest).
    pub fn kv_hit(&self) -> usize {
        self.ext_ref().kv_len
    }

    /// Where the request should save a state during prefill so that the next request
    /// on its branch can resume further ([`CheckpointConfig::branching_len`]).
    pub fn branching_len(&self) -> Option<usize> {
        self.ext_ref().branching_len
    }

    /// Save the request's state after token `at` (a whole number of pages) for caching,
    /// and return the slot it is saved in. The finish caches the request's tokens up to
    /// `at` with it; a [`checkpoint`](Self::checkpoint) of exactly `at` tokens caches
    /// them with it and keeps running. A slot is taken (evicting the least recently
    /// used unlocked state when none is free).
    ///
    /// * Over a [`MambaPool`] the running state is copied into a fresh slot at the call,
    ///   so call it when the computation has reached `at`; the copy is frozen (cached by
    ///   number). Saving again saves a new copy and frees the previous one.
    /// * Over a [`SlotPool`] the engine copies its running state into the returned slot
    ///   when the computation reaches `at`. Saving again moves the position and keeps
    ///   the slot.
    ///
    /// # Errors
    ///
    /// [`AllocError::Invalid`] for a position that is not a whole number of pages;
    /// [`AllocError::OutOfMemory`] when no state can be had. Nothing changes then.
    pub fn save_state(&mut self, at: usize) -> Result<u32, AllocError> {
        let ps = self.cache().page_size();
        if at % ps != 0 {
            return Err(crate::error::InvalidInput::NotPageAligned { count: at, page_size: ps as u32 }.into());
        }
        let (cache, ext) = self.cache_and_ext();
        let prev = ext.saved.map(|(_, s)| s);
        let slot = cache.with_state_room(|| cache.variant.pool.save_running(ext.handle.as_ref(), prev))?;
        ext.saved = Some((at, slot));
        Ok(slot)
    }
}

/// A request's running state, for a [`MambaPool`]'s byte accessors
/// ([`component`](MambaPool::component), [`component_mut`](MambaPool::component_mut),
/// [`copy_from`](MambaPool::copy_from), ...): the request holds it alone, so `&req`
/// reads it and `&mut req` writes it. With a [`SlotPool`] (numbers only) those
/// accessors answer [`MambaError::NoStateBytes`](crate::mamba::MambaError::NoStateBytes).
impl<A: KvAllocator, P: StatePool> crate::mamba::HeldState for super::Request<A, Mamba<P>> {}

impl<A: KvAllocator, P: StatePool> crate::mamba::Holder for super::Request<A, Mamba<P>> {
    fn held(&self) -> Result<&crate::mamba::MambaSlot, crate::mamba::MambaError> {
        self.ext_ref().handle.as_ref().ok_or(crate::mamba::MambaError::NoStateBytes)
    }
}

/// What became of the state a request finished with on a [`MambaRadixCache`]
/// ([`Request::finish`](super::Request::finish)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateInsert {
    /// Leading tokens that were cached already (the request's own KV for them was a
    /// duplicate, and was freed).
    pub cached: usize,
    /// Whether the tree kept the state (the node where the key ends had none). When it
    /// did not (a state was there already, or nothing was cached), the cache freed it
    /// back to the pool: either way the request no longer holds it.
    pub state_kept: bool,
}

/// A Mamba match and lock's result.
#[derive(Debug)]
pub(crate) struct MambaMatch<'c, A: KvAllocator, P: StatePool> {
    /// The lock on the path to the deepest node holding a state; `lease.len()` tokens
    /// can be resumed (KV and state).
    pub lease: Lease<'c, A, Mamba<P>>,
    /// That node's state (`None` for an empty lease): fork it into the request's slot.
    pub state: Option<u32>,
    /// How far the KV matched (`>= lease.len()`; the slots are in `out` up to here, but
    /// only `lease.len()` of them are locked).
    pub kv_len: usize,
    /// Where the request should checkpoint during prefill so that the next request on
    /// this branch can resume further ([`CheckpointConfig::branching_len`]).
    pub branching_len: Option<usize>,
}

impl<A: KvAllocator, P: StatePool> RadixCache<A, Mamba<P>> {
    /// A Mamba-aware cache over `alloc` (KV pages), `req_pool` (request rows) and
    /// `states` (the state slots it holds and frees), with `CheckpointConfig::default()`.
    ///
    /// # Errors
    ///
    /// As [`RadixCache::new`]; also [`ConfigError::TooLargeForMemory`] for the state
    /// bookkeeping (4 bytes per state slot), [`ConfigError::NotAMultiple`] for a
    /// page size that does not divide the default chunk (64), and
    /// [`ConfigError::Unsupported`] when `states` is a pool shared through an `Arc`
    /// that another live cache holds (see [`StatePool`]).
    pub fn with_states(alloc: A, req_pool: ReqToTokenPool, states: P, config: RadixConfig) -> Result<Self, ConfigError>
    where
        A: crate::alloc::OwnedAllocator,
    {
        Self::with_checkpoints(alloc, req_pool, states, config, CheckpointConfig::default())
    }

    /// [`with_states`](Self::with_states) with checkpoint positions of `mamba`.
    ///
    /// # Errors
    ///
    /// As [`with_states`](Self::with_states); [`ConfigError::Zero`] or
    /// [`ConfigError::NotAMultiple`] when the chunk is not a positive whole number of
    /// pages or the track interval not a whole number of chunks;
    /// [`ConfigError::Unsupported`] when `states` is a pool shared through an `Arc`
    /// that another live cache holds (see [`StatePool`]).
    pub fn with_checkpoints(
        alloc: A,
        req_pool: ReqToTokenPool,
        states: P,
        config: RadixConfig,
        mamba: CheckpointConfig,
    ) -> Result<Self, ConfigError>
    where
        A: crate::alloc::OwnedAllocator,
    {
        if alloc.page_size() == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        mamba.validate(alloc.page_size() as usize)?;
        let claim = PoolClaim::take(&states)?;
        let words = (states.capacity() as usize + 1).div_ceil(64);
        let held = crate::arena::try_vec_with(words, "mamba held-state marks", |_| AtomicU64::new(0))?;
        let variant = Mamba {
            _claim: claim,
            pool: states,
            config: mamba,
            held: held.into_boxed_slice(),
            evictable: AtomicUsize::new(0),
            protected: AtomicUsize::new(0),
        };
        Self::with_variant(alloc, req_pool, config, variant)
    }

    /// Where checkpoints lie.
    pub fn checkpoint_config(&self) -> CheckpointConfig {
        self.variant.config
    }

    /// SGLang's `match_prefix` for hybrid models, locked: the longest prefix of `key`
    /// (cut to whole pages and to `out.len()`) that ends at a cached state, locked with
    /// that state; also how far the KV matched and where to checkpoint (see
    /// [`MambaMatch`]). Refreshes the recency of the returned path only, the root
    /// oldest; splits a node the KV match ends inside (the upper half has no state).
    pub(crate) fn match_and_lock_checkpoint(
        &self,
        namespace: u64,
        key: &[u32],
        out: &mut [u32],
    ) -> MambaMatch<'_, A, P> {
        let key = self.aligned(key, out.len());
        let (key, state, kv_len) = self.write(|w| {
            let (m, best, kv_len, _) = w.match_path(namespace, key, out);
            let key = w.lease_of(&m);
            let s = w.s.meta[best as usize].ext.state;
            (key, (best != ROOT && s != NIL).then_some(s), kv_len)
        });
        crate::debug_check(self);
        let lease = Lease { cache: self, key };
        let branching_len = self.variant.config.branching_len(kv_len, key.len);
        MambaMatch { lease, state, kv_len, branching_len }
    }

    /// [`match_and_lock_checkpoint`](Self::match_and_lock_checkpoint) into request row
    /// `row` (from position 0; the key is cut to the row's length): the row remembers
    /// that its first `lease.len()` slots came from this lease, so the finish need not
    /// compare them with the tree again. The KV matched past the lease (`kv_len`) is
    /// written to the row too; a request that resumes from the state allocates over it.
    ///
    /// # Errors
    ///
    /// [`RowError::ForeignRow`](crate::error::RowError::ForeignRow) if the row is another
    /// pool's; nothing is matched or locked then.
    pub(crate) fn match_and_lock_checkpoint_row(
        &self,
        namespace: u64,
        key: &[u32],
        row: &mut ReqRow,
    ) -> Result<MambaMatch<'_, A, P>, crate::error::RowError> {
        self.match_into_row(key, row, |key, out| self.match_and_lock_checkpoint(namespace, key, out), |m| m.lease.key)
    }

    /// The state pool, as the cache's callers see it: sizes, and which slots the tree
    /// holds.
    pub fn states(&self) -> CacheStates<'_, P> {
        CacheStates { v: &self.variant }
    }

    /// States held by unlocked nodes (SGLang's `mamba_evictable_size`).
    pub fn mamba_evictable_size(&self) -> usize {
        self.variant.evictable.load(Ordering::Acquire)
    }

    /// States held by nodes a lease ends at (`mamba_protected_size`).
    pub fn mamba_protected_size(&self) -> usize {
        self.variant.protected.load(Ordering::Acquire)
    }

    /// The state slot a lease ends at: the checkpoint its request resumes from (fork it
    /// into the request's own slot; the lease keeps it from being freed). `None` for an
    /// empty lease or one from another cache.
    #[cfg(test)]
    pub(crate) fn lease_state(&self, lease: &Lease<'_, A, Mamba<P>>) -> Option<u32> {
        if lease.key.cache_id != self.id || lease.key.last_page == 0 {
            return None;
        }
        self.write(|w| {
            if !w.is_node_end(lease.key.last_page, lease.key.epoch) {
                return None;
            }
            let s = w.node_of(lease.key.last_page).ext.state;
            (s != NIL).then_some(s)
        })
    }

    /// A state slot from the pool, freeing the least recently used unlocked state first
    /// when none is free (SGLang's `_alloc_mamba_slot`).
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when the pool is empty and every state is locked.
    #[cfg(test)]
    pub(crate) fn alloc_state(&self) -> Result<u32, AllocError> {
        self.with_state_room(|| self.variant.pool.alloc_one())
    }

    /// Run `take` (which takes one state slot, nothing on error); when the pool is
    /// empty, evict the least recently used unlocked state and run it once more.
    pub(crate) fn with_state_room<T>(&self, take: impl Fn() -> Result<T, OutOfMemory>) -> Result<T, AllocError> {
        if let Ok(t) = take() {
            return Ok(t);
        }
        self.evict_mamba(1);
        take().map_err(|mut oom| {
            oom.evictable = Some(self.mamba_evictable_size());
            oom.unit = Unit::Indices;
            AllocError::OutOfMemory(oom)
        })
    }

    /// Free at least `num` states of unlocked nodes, least recently used first (SGLang's
    /// `evict_mamba`): an internal node becomes a tombstone (its KV stays), a leaf is
    /// removed with its KV (and any parent left a childless tombstone with it). Returns
    /// the states freed.
    pub fn evict_mamba(&self, num: usize) -> usize {
        if num == 0 {
            return 0;
        }
        let r = self.write(|w| {
            let mut freed = 0usize;
            let mut group = w.c.alloc.free_group();
            while freed < num {
                let Some(x) = states(w).peek() else { break };
                let m = w.s.meta[x as usize];
                if m.children == 0 {
                    debug_assert!(m.lock_ref == 0, "a leaf with an unlocked state has no lease");
                    w.remove_evictable_leaf(x, &mut group);
                } else {
                    // An internal node keeps its KV: it becomes a tombstone.
                    <Mamba<P> as Variant>::removing(w, x);
                }
                freed += 1;
            }
            group.end();
            freed
        });
        crate::debug_check(self);
        r
    }

    /// Check that `state` is the caller's to give (not the tree's already, allocated)
    /// and take it: from here the caller can no longer free it. A refused request gives
    /// it back ([`Mamba::give_back`]).
    #[cfg(test)]
    fn take_state(w: &Writer<'_, A, Mamba<P>>, state: u32) -> Result<(), CacheError> {
        let free_of_tree = state != 0 && (state as usize) < w.s.ext.owner.len() && w.s.ext.owner[state as usize] == NIL;
        if free_of_tree && w.c.variant.take(state) {
            Ok(())
        } else {
            Err(CacheError::StateNotOwned { state })
        }
    }

    /// Give the state taken by `take_state` to node `end` if it has none; otherwise
    /// free it. Returns whether it was kept.
    fn adopt_state(w: &mut Writer<'_, A, Mamba<P>>, end: u32, state: u32) -> bool {
        if end == ROOT || w.s.meta[end as usize].ext.state != NIL {
            let r = w.c.variant.free_state(state);
            debug_assert!(r.is_ok(), "a checked state failed to free: {r:?}");
            return false;
        }
        w.s.meta[end as usize].ext = MambaNode { state, lock: 0, pos: NIL };
        w.s.ext.owner[state as usize] = end;
        w.c.variant.evictable.latch_add(1);
        w.touch(end);
        states(w).push(end);
        true
    }

    /// A request helper's `check` that takes `state` and notes it in `taken`, so that
    /// [`untake`](Self::untake) gives it back if the request is refused later.
    #[cfg(test)]
    fn take_into(w: &Writer<'_, A, Mamba<P>>, state: u32, taken: &core::cell::Cell<bool>) -> Result<(), CacheError> {
        Self::take_state(w, state)?;
        taken.set(true);
        Ok(())
    }

    #[cfg(test)]
    fn untake(&self, state: u32, taken: &core::cell::Cell<bool>) {
        if taken.get() {
            self.variant.give_back(state);
        }
    }

    /// [`take_into`](Self::take_into) for the state a request saved.
    fn take_saved_into(
        w: &Writer<'_, A, Mamba<P>>,
        state: u32,
        taken: &core::cell::Cell<bool>,
    ) -> Result<(), CacheError> {
        let free_of_tree = state != 0 && (state as usize) < w.s.ext.owner.len() && w.s.ext.owner[state as usize] == NIL;
        if !(free_of_tree && w.c.variant.take_saved(state)) {
            return Err(CacheError::StateNotOwned { state });
        }
        taken.set(true);
        Ok(())
    }

    /// [`untake`](Self::untake) for the state a request saved.
    fn untake_saved(&self, state: u32, taken: &core::cell::Cell<bool>) {
        if taken.get() {
            self.variant.give_back_saved(state);
        }
    }

    /// Insert `key -> slots` with the state after the key's last token (SGLang's
    /// `insert` with a `mamba_value`). The tree takes `state`: it keeps it when the node
    /// the key ends at has none (a new leaf, or a tombstone), and frees it otherwise.
    ///
    /// # Errors
    ///
    /// As the plain [`insert`](RadixCache::insert), and
    /// [`CacheError::StateNotOwned`] when `state` is not a slot the caller holds (free,
    /// out of range, or held by the tree already). Nothing changes on error.
    #[cfg(test)]
    pub(crate) fn insert(
        &self,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        state: u32,
    ) -> Result<StateInsert, CacheError> {
        let r = self.write(|w| {
            Self::take_state(w, state)?;
            match w.insert(namespace, key, slots, 0) {
                Ok((cached, end)) => Ok(StateInsert { cached, state_kept: Self::adopt_state(w, end, state) }),
                Err(e) => {
                    w.c.variant.give_back(state);
                    Err(e)
                }
            }
        });
        crate::debug_check(self);
        r
    }

    /// SGLang's `cache_finished_req` for hybrid models: as the plain cache's
    /// [`cache_finished_req`](RadixCache::cache_finished_req), with `state` the request's
    /// state after the page-aligned part of `token_ids` (its checkpoint there), which
    /// the tree takes (see [`insert`](Self::insert)).
    ///
    /// # Errors
    ///
    /// [`Unfinished`] hands the row and lease back with the reason (the state stays the
    /// caller's); nothing changed.
    #[cfg(test)]
    pub(crate) fn cache_finished_req<'c>(
        &'c self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Lease<'c, A, Mamba<P>>,
        state: u32,
    ) -> Result<StateInsert, Unfinished<'c, A, Mamba<P>>> {
        let taken = core::cell::Cell::new(false);
        self.finish_with(
            namespace,
            token_ids,
            row,
            lease,
            0,
            usize::MAX,
            |w| Self::take_into(w, state, &taken),
            |w, ins| Self::adopt_state(w, ins.end, state),
        )
        .map(|(cached, state_kept)| StateInsert { cached, state_kept })
        .inspect_err(|_| self.untake(state, &taken))
    }

    /// SGLang's `cache_unfinished_req` for hybrid models (chunked prefill): as the plain
    /// cache's [`cache_unfinished_req`](RadixCache::cache_unfinished_req), with `state` a
    /// copy of the request's state after the page-aligned part of `token_ids` (SGLang
    /// donates a fresh copy; the request keeps computing in its own slot), which the
    /// tree takes. The lease then ends at the node holding the checkpoint.
    ///
    /// # Errors
    ///
    /// [`CacheError`]; nothing changed (the state stays the caller's).
    #[cfg(test)]
    pub(crate) fn cache_unfinished_req(
        &self,
        namespace: u64,
        token_ids: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Mamba<P>>,
        state: u32,
    ) -> Result<bool, CacheError> {
        let taken = core::cell::Cell::new(false);
        self.unfinished_with(
            &self.req_pool,
            namespace,
            token_ids,
            row,
            lease,
            0,
            usize::MAX,
            |w| Self::take_into(w, state, &taken),
            |w, ins| Self::adopt_state(w, ins.end, state),
        )
        .inspect_err(|_| self.untake(state, &taken))
    }
}

/// kvpool's [`MambaPool`](crate::mamba::MambaPool) as the tree's state pool: the tree
/// holds *cached* states by number; a request's running state is held through a
/// handle, and the states it saves are cached copies. `alloc_one` hands out a zeroed
/// state already cached, `free` takes cached states back, and `is_allocated` counts
/// held and cached states.
impl StatePool for crate::mamba::MambaPool {
    fn capacity(&self) -> u32 {
        self.size() as u32
    }
    fn available(&self) -> usize {
        crate::mamba::MambaPool::available(self)
    }
    fn alloc_one(&self) -> Result<u32, OutOfMemory> {
        self.alloc_cached()
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        crate::mamba::MambaPool::free(self, slots)
    }
    fn is_allocated(&self, slot: u32) -> bool {
        crate::mamba::MambaPool::is_allocated(self, slot)
    }
}
