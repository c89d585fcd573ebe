//! [`RadixCache`]: a fixed-capacity, concurrent radix prefix cache with eviction.
//!
//! It reproduces SGLang's `RadixCache` — page-aligned matching, splits on partial
//! matches, insert returning the cached prefix length, lock counts along a path with
//! exact `evictable_size` / `protected_size`, leaf eviction by policy, the request
//! helpers — and adds what SGLang's Python tree cannot: no allocation after
//! construction, and lookups from any number of threads that never block.
//!
//! An engine drives the cache through [`Request`]s (see [its module](request)): one
//! handle per request that owns its row, its lock on the matched prefix and the slots
//! allocated for it. Routers look prefixes up with [`peek_prefix`](RadixCache::peek_prefix).
//!
//! # Layout: everything is keyed by pages
//!
//! The tree stores no per-node vectors. A cached page `p` holds slots
//! `p*ps .. (p+1)*ps`; the tree keeps
//!
//! * the **tokens**: the token whose KV is in slot `s`, at index `s` of an arena sized
//!   by the pool (two tokens per 64-bit atomic word, see below);
//! * **runs**: the pages of a node, in key order, are cut into runs of consecutive page
//!   numbers (what a lowest-first allocator hands out: on the bundled trace a run is
//!   ~4,100 pages long at page size 1 and ~255 at page size 16). Only the last page of
//!   a run has a cell: the link to the next run, its first page and its length in one
//!   64-bit word (`links[p]`; the node record holds the first run's length). Pages
//!   inside a run carry no bookkeeping at all, and a walk over a node's runs makes one
//!   dependent load per run (an evicted leaf of a fragmented pool is hundreds of short
//!   runs, and eviction walks it);
//! * a **node record**: `(first page, page count)`, the pages left in the run that
//!   starts at its first page, the namespace, and the *last page of its parent* (page
//!   0, never handed out, stands for the root).
//!
//! So the token work of an operation runs a run at a time: a match compares a run's
//! tokens with the key in one vectorized pass (the latch holder) and writes its slots as one
//! ascending fill; an insert copies a run's tokens with one atomic store per two tokens;
//! claiming a run's pages for the tree checks and sets one word of the in-tree bitmap
//! and one of the allocator's bitmap per 64 pages; eviction frees a run with one
//! read-modify-write per 64 pages. Nothing is done per token beyond copying it, and
//! nothing per page beyond hashing it when KV events are on. The layout never
//! fragments: token storage is indexed by slot, so whatever pages the allocator hands
//! out have their token cells already, and a short run (a fragmented pool) costs only
//! more run records, never a failed allocation.
//!
//! A node's children are
//! found in a hash table keyed by **(parent's last page, namespace, tokens of the
//! child's first page)**: chained buckets of fixed size, linked through the records.
//! A tree over `N` pages has at most `N + 1` nodes (every node but the root owns a page),
//! so every arena is sized once, at construction, from the allocator's page count, and
//! reserved fallibly (a configuration too large for the machine is a
//! [`ConfigError::TooLargeForMemory`](crate::ConfigError)). Arenas are committed
//! eagerly: construction writes every cell (all but the eviction heap's spare room), so
//! page faults are paid there, not on the hot paths. On Linux, arenas of 4 MiB and more
//! are advised as transparent huge pages first (`MADV_HUGEPAGE`): resident either way,
//! they then take far fewer page faults to build and far fewer TLB misses on the hot
//! paths when the cache is large (BENCHMARKS, issue 8, sixteenth round).
//!
//! Splitting never rewrites runs: the upper half keeps the record's first page and run,
//! the lower half starts inside a run or at the next one, and its record states how many
//! pages of that run are left. A reader of a record being split reads at most that many
//! pages and validates the record's `gen` afterwards (below).
//!
//! A request's row is checked before its pages are claimed: whole pages, each page's
//! slots in order. The positions its [`extend`](Request::extend) and decode steps
//! filled are whole pages in order by construction (the [`ReqRow`] handle remembers
//! them, and any write from below their end makes it forget): there only each page's
//! first slot is read.
//!
//! The leased prefix is compared with the tree's slots the same way: the admission
//! wrote it into the row for the very lock the request finishes with, so the row holds
//! the tree's slots by construction: the lock keeps the path from eviction, splits
//! never move a slot, and the lock names the path's last node incarnation (page and
//! epoch). The row handle remembers that incarnation until a write goes over the
//! prefix.
//!
//! ## Why lookups stay correct with tokens written by runs
//!
//! A lock-free lookup can be reading a record that is being evicted while its pages are
//! recycled and overwritten by an insert. Every cell it reads is an atomic (tokens as
//! 64-bit words, links as 64-bit words), so there is no data race, only
//! possibly stale or mixed values; every length is clamped to the record's page count and
//! every page bounds-checked, so garbage ends the walk early instead of leaving the
//! arenas. The writer stores a node's tokens and links (after one `Release` fence) before
//! publishing the record with a `Release` store, and retires a record (odd `gen`,
//! `SeqCst`) before freeing any of its pages; the reader loads the record's `gen`, reads
//! tokens and links, issues an `Acquire` fence and re-loads `gen`. A reader that saw any
//! token written by a later insert therefore sees the retirement and retries: stale data
//! is never returned. Only the latch holder writes tokens, so it reads them as plain
//! memory (one vectorized compare per run), and it alone read-modify-writes the word a
//! run boundary shares with a neighbouring slot.
//!
//! Keying children by the parent's *last page* is what makes splits cheap and atomic:
//! splitting node `C = (f, n)` after `m` pages creates `U = (f, m)` and `C' = (p_m, n-m)`;
//! `C'` ends on the same page as `C`, so `C`'s children need no change. `C'` is published
//! under `(p_(m-1), ns, tokens of p_m)` — reachable only through `U` — and then one store
//! replaces `C` by `U` in `C`'s bucket chain. A reader sees either the old `C` (its pages and
//! children unchanged) or the new `U -> C'`; never a half-made split.
//!
//! Leases (locks held by requests) name their node by its last page too, which splits
//! never change, so a lease stays valid across any number of splits.
//!
//! # Concurrency
//!
//! * **Lookups** ([`peek_prefix`](RadixCache::peek_prefix)) are lock-free and never wait
//!   for anything. They read only atomics and validate optimistically:
//!   - each record has a generation (`gen`: even while published, odd once retired); a
//!     reader reads `gen`, the record and its pages' tokens, then re-reads `gen` after an
//!     `Acquire` fence: a change means the record was split or evicted meanwhile, and
//!     the lookup restarts from the root;
//!   - each bucket has a removal version; a lookup that finds no child in a bucket
//!     re-reads the version, so a miss caused by a concurrent unlink is retried;
//!   - a child is found under its parent's *last page*, and a page carries no
//!     generation: once the parent was evicted, its last page may end another node with
//!     other tokens, whose child has the key's next tokens. So after a child validates,
//!     the reader re-loads its parent's `gen` (one load per level). Unchanged, the
//!     parent was live from before the child's first `gen` load until after its second:
//!     at every instant between, both were live, and the child (keyed by the page only
//!     its parent ends) hung below that parent. The path read is then one path of the
//!     tree, each link seen at an instant when both its ends were live;
//!   - at the end the deepest matched record is validated once more. While it is live,
//!     its parent cannot be evicted (only leaves are), nor that one's, up to the root;
//!     splits move no slot. So every slot returned is still in the tree at the final
//!     check, and none was freed while the lookup ran. The retire `gen` bump is `SeqCst`
//!     and comes before any free, and the checks load `gen` with `SeqCst`: a lookup
//!     whose final check still sees the old `gen` is ordered before the eviction;
//!   - writers store tokens and page links with `Release` *before* publishing a record
//!     (`Release` on the bucket head); readers load the head with `Acquire`.
//!
//!   A lookup restarts only when a node on its own path was split or evicted, or its
//!   bucket lost a node, during the lookup: every restart is another thread's progress.
//!
//! * **Changes** — [`match_prefix`](RadixCache::match_prefix) (which updates recency and
//!   may split), [`evict`](RadixCache::evict), and every step of a [`Request`] that
//!   touches the tree (admission, checkpoint, finish, abort) — are applied one at a time under a writer latch (one
//!   atomic flag, taken with backoff). Critical sections are bounded (O(key length) or
//!   O(evicted pages)), allocate nothing, and make no system calls. Lookups never touch the
//!   latch, so routers keep reading at full speed while the scheduler writes. The latch
//!   is the one place kvpool serializes; SGLang serializes the same operations behind
//!   Python's GIL and the scheduler loop.
//!
//! * **Match and lock** happen in one critical section (a request's
//!   [admission](RadixCache::admit)), so no eviction can slip between them: eviction
//!   runs under the same latch and only takes leaves whose lock count is 0. A lock
//!   names its path's last node by page and that page's epoch, so a reused page is
//!   never mistaken for the node it once ended.
//!
//! # Variants: one core
//!
//! SGLang has four tree classes that copy each other (`RadixCache`, `MambaRadixCache`,
//! `SWARadixCache`, `HiRadixCache`). Here there is one core — everything above:
//! matching, splitting, publication to lock-free readers, leases, the writer latch,
//! the arenas, events, whole-leaf eviction — generic over a [`Variant`], which supplies
//! what a node carries besides its KV pages, its lock rules, its extra orders and its
//! extra eviction passes, through hooks the core calls at fixed points (a split, a
//! removal, a lock of a lease's end node, a touch, a reset, the invariant check; which
//! nodes a match may end at, which nodes must never be leaves):
//!
//! * [`RadixCache<A>`](RadixCache) is `RadixCache<A, Plain>`: nodes carry KV slots only,
//!   every hook is empty and inlined away;
//! * [`MambaRadixCache<A, P>`](MambaRadixCache) is `RadixCache<A, Mamba<P>>`: nodes
//!   may carry a Mamba state slot (none: a *tombstone*, an internal node whose KV stays
//!   usable), see [`Mamba`].
//!
//! Methods common to all variants (lookups, match and lock, leases, eviction,
//! allocation, checks) are defined once on `RadixCache<A, V>`; inserts and the request
//! helpers take what the variant carries, so each variant has its own.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::radix::{RadixCache, RadixConfig};
//! use kvpool::{ReqToTokenPool, TokenAllocator};
//!
//! let cache = Arc::new(RadixCache::new(TokenAllocator::new(64)?, ReqToTokenPool::new(4, 32)?, RadixConfig::default())?);
//! // A request computes tokens [1, 2, 3] and finishes: the tree keeps their KV.
//! let mut req = cache.admit(0, &[1, 2, 3])?;
//! req.extend(3)?;
//! let slots = req.slots().to_vec();
//! req.finish(&[1, 2, 3])?;
//! assert_eq!((cache.total_size(), cache.evictable_size()), (3, 3));
//!
//! // A later request with the same start reuses them, locked while it runs.
//! let hit = cache.admit(0, &[1, 2, 9, 9])?;
//! assert_eq!((hit.cached_len(), &hit.slots()[..2]), (2, &slots[..2]));
//! assert_eq!(cache.protected_size(), 2);
//! drop(hit); // aborted: unlocks
//! assert_eq!(cache.evict(3), 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod alloc_view;
mod events;
mod heap;
pub mod hi;
mod hints;
mod key;
pub mod mamba;
mod partial;
mod policy;
pub mod request;
pub mod swa;
mod tokens;
mod variant;

pub use alloc_view::CacheAllocator;
pub use events::{namespace_seed, page_hash, BlockHash, EventQueue, KvEvent};
pub use hi::{
    Hi, HiCounters, HiMatch, HiRadixCache, HostHit, HostTier, Transfer, TransferError, TransferKind, WritePolicy,
    DEFAULT_LOAD_BACK_THRESHOLD,
};
pub use key::CacheKey;
pub use mamba::{CacheStates, CheckpointConfig, Mamba, MambaRadixCache, MambaRequest, StateInsert, StatePool};
pub use policy::{EvictionPolicy, UnknownPolicy};
pub use request::{Refused, Request};
pub use swa::{Swa, SwaInsert, SwaRadixCache};

pub use variant::{Plain, Variant};

use writer::Writer;

use core::fmt;
use core::hash::Hasher;

use crossbeam_utils::CachePadded;
use rustc_hash::FxHasher;

use crate::alloc::KvAllocator;
use crate::error::{AllocError, ConfigError, FreeError, InvalidInput, InvariantViolation, RowError};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Backoff, UnsafeCell};

const NIL: u32 = u32::MAX;
const ROOT: u32 = 0;

/// Configuration of a [`RadixCache`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RadixConfig {
    /// Eviction order (LRU by default).
    pub policy: EvictionPolicy,
    /// Capacity of the KV event queue; `None` (the default) turns events off.
    pub event_capacity: Option<usize>,
    /// Cache a finished [`Request`]'s prompt and its outputs as two nodes, split at
    /// the prompt's last whole page, so that eviction takes the outputs before the
    /// prompt (SGLang's behaviour since 0.5.23). Off by default: a finished request is
    /// one leaf, as in SGLang's earlier releases. The plain tree and the host tier.
    pub split_at_prompt: bool,
}

/// Why a cache operation was refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheError {
    /// The arguments can never succeed.
    Invalid(InvalidInput),
    /// A slot to insert lies in a page the tree already holds, or that is not allocated.
    SlotNotOwned {
        /// The slot.
        slot: u32,
    },
    /// A request row was out of bounds.
    Row(RowError),
    /// Freeing duplicate or tail slots failed (they were not allocated).
    Free(FreeError),
    /// The lease or match belongs to another cache, or its node no longer exists.
    StaleMatch,
    /// A request row disagrees with the cache: a slot the lease protects is not the
    /// tree's slot for that token, or a slot the request would free (a duplicate or the
    /// unaligned tail) is held by the tree or lies in a page being cached.
    RowMismatch {
        /// Index of the offending token in the request.
        index: usize,
        /// The row's slot there.
        slot: u32,
    },
    /// A Mamba state slot handed to the tree is not the caller's: out of range, free in
    /// the state pool, or held by the tree already.
    StateNotOwned {
        /// The slot.
        state: u32,
    },
    /// Hybrid request rows (or a state handle) of another Mamba pool than the cache's.
    ForeignRows,
    /// [`reset`](RadixCache::reset) while locks are held: their requests are still
    /// using the slots the tree would free.
    Leased {
        /// Leases outstanding.
        leases: usize,
    },
    /// A request's finish or checkpoint named another number of tokens than its row
    /// holds ([`Request::len`]): all of them for a finish, at most that many for a
    /// checkpoint.
    TokenCount {
        /// Tokens given.
        tokens: usize,
        /// Tokens whose KV the request's row holds.
        held: usize,
    },
    /// A Mamba request caches tokens only with a state saved after the last of them
    /// ([`Request::save_state`]): a checkpoint needs one saved at exactly its length, a
    /// finish one saved at or before its end.
    SavedState {
        /// Where the request's saved state lies (`None`: none saved).
        at: Option<usize>,
        /// Tokens the request was to cache.
        up_to: usize,
    },
}

impl fmt::Display for CacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CacheError::Invalid(e) => write!(f, "invalid cache request: {e}"),
            CacheError::SlotNotOwned { slot } => {
                write!(f, "slot {slot} cannot be inserted: its page is already cached or not allocated to the caller")
            }
            CacheError::Row(e) => e.fmt(f),
            CacheError::Free(e) => e.fmt(f),
            CacheError::StaleMatch => {
                f.write_str("the matched node was evicted, or the lease belongs to another cache")
            }
            CacheError::ForeignRows => {
                f.write_str("the hybrid request rows or the state belong to another Mamba pool than the cache's")
            }
            CacheError::Leased { leases } => {
                write!(f, "the cache cannot be reset: {leases} leases are outstanding, their requests use its slots")
            }
            CacheError::StateNotOwned { state } => write!(
                f,
                "state slot {state} cannot be handed to the cache: it is out of range, free, or held by the cache already"
            ),
            CacheError::SavedState { at: Some(at), up_to } => {
                write!(f, "the request's state is saved after token {at}: it cannot cache {up_to} tokens with it")
            }
            CacheError::SavedState { at: None, up_to } => {
                write!(f, "the request has no state saved to cache {up_to} tokens with")
            }
            CacheError::TokenCount { tokens, held } => write!(
                f,
                "{tokens} tokens given for a request whose row holds the KV of {held}: a finish takes exactly \
                 those, a checkpoint at most those"
            ),
            CacheError::RowMismatch { index, slot } => write!(
                f,
                "request row slot {slot} at token {index} does not belong to the request: it is the cache's, \
                 or not the cached slot the lease protects"
            ),
        }
    }
}

impl std::error::Error for CacheError {}

impl From<InvalidInput> for CacheError {
    fn from(e: InvalidInput) -> Self {
        CacheError::Invalid(e)
    }
}

impl From<RowError> for CacheError {
    fn from(e: RowError) -> Self {
        CacheError::Row(e)
    }
}

/// The result of [`RadixCache::match_prefix`]: how many tokens matched and which node
/// the match ended at. Not a lock: a request that uses the slots is
/// [admitted](RadixCache::admit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchResult {
    len: usize,
    last_page: u32,
    epoch: u32,
    cache_id: u64,
}

impl MatchResult {
    /// Matched tokens (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing matched.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What names a locked path: its last node (by the node's last page, which splits never
/// change, and that page's epoch, which rules out a reused page) and the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseKey {
    last_page: u32,
    epoch: u32,
    len: usize,
    /// The variant's datum (the SWA tree: the tokens under the window lock).
    aux: u64,
    cache_id: u64,
}

/// A lock on a matched path: the nodes from the match's last node up to the root are
/// protected from eviction while the lease lives. Dropping it unlocks.
#[must_use = "dropping a lease unlocks its path at once"]
pub(crate) struct Lease<'c, A: KvAllocator, V: Variant = Plain> {
    cache: &'c RadixCache<A, V>,
    key: LeaseKey,
}

/// A lease without its borrow of the cache (see [`Lease::detach`]): what a
/// [`Request`] holds. Neither `Copy` nor `Clone`: every lock is released exactly once.
#[derive(Debug)]
#[must_use = "a detached lease keeps its path locked until released"]
pub(crate) struct RawLease(LeaseKey);

impl<'c, A: KvAllocator, V: Variant> Lease<'c, A, V> {
    /// Tokens covered by the lease (SGLang's `cache_protected_len`).
    pub(crate) fn len(&self) -> usize {
        self.key.len
    }
    /// Whether the lease covers nothing.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.key.len == 0
    }
    /// Keep the lock but drop the borrow (for storing it in a `'static` structure).
    pub(crate) fn detach(self) -> RawLease {
        let key = self.key;
        core::mem::forget(self);
        RawLease(key)
    }
}

impl<A: KvAllocator, V: Variant> Drop for Lease<'_, A, V> {
    fn drop(&mut self) {
        // A lease made by this cache for a live node cannot fail to unlock.
        let _ = self.cache.release_key(self.key);
    }
}

impl<A: KvAllocator, V: Variant> fmt::Debug for Lease<'_, A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease").field("len", &self.key.len).field("last_page", &self.key.last_page).finish()
    }
}

/// A request that could not be finished, handed back with the reason (nothing changed).
#[cfg(test)]
pub(crate) struct Unfinished<'c, A: KvAllocator, V: Variant = Plain> {
    /// Why.
    pub error: CacheError,
    /// The request's row, still held.
    pub row: ReqRow,
    /// The request's lease, still held.
    pub lease: Lease<'c, A, V>,
}

#[cfg(test)]
impl<A: KvAllocator, V: Variant> fmt::Debug for Unfinished<'_, A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unfinished").field("error", &self.error).finish()
    }
}

#[cfg(test)]
impl<A: KvAllocator, V: Variant> fmt::Display for Unfinished<'_, A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

/// The reader-visible part of a node.
struct Record {
    /// Even: published (live) or never used; odd: retired. Bumped with `SeqCst`.
    gen: AtomicU64,
    /// `first_page << 32 | page_count`.
    span: AtomicU64,
    /// Pages of the run that starts at `first_page`, from there (see "runs" in the
    /// module docs); may exceed `page_count` (a split's upper half).
    first_run: AtomicU32,
    parent_page: AtomicU32,
    namespace: AtomicU64,
    key_hash: AtomicU64,
    hash_next: AtomicU32,
    /// The variant's reader-visible mark (the SWA tree: 1 for a tombstone).
    mark: AtomicU32,
}

/// The writer-only part of a node.
#[derive(Clone, Copy, Debug, Default)]
struct Meta<N = ()> {
    lock_ref: u32,
    children: u32,
    heap_pos: u32,
    last_page: u32,
    last_access: u64,
    created: u64,
    hit_count: u64,
    priority: i64,
    alive: bool,
    /// [`EvictionPolicy::Hinted`]: the greedy-dual score (see `hints`).
    score: u64,
    /// [`EvictionPolicy::Hinted`]: the admission this node is wanted by (0: none).
    want: u64,
    /// [`EvictionPolicy::Reuse`]: the node's reuse class, its conversation depth (see
    /// `hints`).
    depth: u8,
    /// The variant's payload.
    ext: N,
}

/// Everything only the latch holder touches.
struct Inner<V: Variant> {
    meta: Box<[Meta<V::Node>]>,
    free_ids: Vec<u32>,
    heap: Vec<u32>,
    /// For a page that ends a node: that node.
    page_owner: Box<[u32]>,
    /// Bumped each time a page becomes the end of a node (rules out ABA on leases).
    page_epoch: Box<[u32]>,
    /// Page hashes, when events are on.
    digests: Box<[BlockHash]>,
    clock: u64,
    /// The variant's orders.
    ext: V::State,
    /// [`EvictionPolicy::Hinted`]: protections by expiry (see `hints`).
    hint_expiry: hints::Expiry,
    /// The runs of consecutive pages of the row the current change checked.
    row_runs: writer::RowRuns,
    /// Leases that lock a node (a match of at least a page), live or detached.
    leases: usize,
}

/// A fixed-capacity, concurrent radix prefix cache (see the [module docs](self)).
pub struct RadixCache<A: KvAllocator, V: Variant = Plain> {
    alloc: A,
    variant: V,
    req_pool: ReqToTokenPool,
    policy: EvictionPolicy,
    /// [`RadixConfig::split_at_prompt`].
    split_at_prompt: bool,
    ps: usize,
    /// `log2(ps)` when the page size is a power of two.
    shift: Option<u32>,
    /// The allocator's pages (`1..=num_pages`).
    num_pages: u32,
    /// Pages of the tree's page space: the allocator's, then the variant's own
    /// ([`Variant::extra_pages`]: the host tier's pages) up to here.
    tree_pages: u32,
    records: Box<[Record]>,
    slot_token: tokens::Tokens,
    /// For the last page of a run: the node chain's next run, as its first page (low
    /// 32 bits) and its length in pages (high 32 bits); 0 ends the chain. One cell per
    /// run, read with one load: a walk's only dependent load per run.
    links: Box<[AtomicU64]>,
    /// Which pages the tree holds (one bit each). Written only under the latch; read
    /// there, and without it by the allocation paths, which refuse to continue a page
    /// the tree holds ([`CacheAllocator`]). Those reads are a check of the
    /// caller's input, not part of any protocol: plain `std` atomics (never loom's, so
    /// loom models do not branch on them), relaxed.
    in_tree: Box<[std::sync::atomic::AtomicU64]>,
    /// `removal_version << 32 | head record`.
    buckets: Box<[AtomicU64]>,
    bucket_mask: usize,
    latch: CachePadded<AtomicBool>,
    inner: UnsafeCell<Inner<V>>,
    evictable: AtomicUsize,
    protected: AtomicUsize,
    total: AtomicUsize,
    /// Tokens of KV capacity held by live [`Request`]s (their own pages). Plain `std`
    /// atomics: an account for `check_invariants`, not part of any protocol.
    held: std::sync::atomic::AtomicUsize,
    /// Set once a unit test allocated slots outside any request (the allocator view,
    /// the cache's own allocation calls): the accounting check cannot tell the test's
    /// slots from a leak, and is skipped from then on.
    #[cfg(test)]
    raw_used: std::sync::atomic::AtomicBool,
    events: Option<EventQueue>,
    id: u64,
    /// Router hints, the admission clock and the eviction options of issue 13.
    hints: hints::Hints,
}

/// A boxed arena of `n` cells, reserved fallibly (see `crate::arena`).
fn boxed<T>(what: &'static str, n: usize, f: impl FnMut(usize) -> T) -> Result<Box<[T]>, ConfigError> {
    Ok(crate::arena::try_vec_with(n, what, f)?.into_boxed_slice())
}

// SAFETY: `inner` is only reached while holding the latch (`write`), which gives
// mutual exclusion with Acquire/Release; everything else is atomic or immutable.
unsafe impl<A: KvAllocator, V: Variant> Sync for RadixCache<A, V> {}
// SAFETY: the cache owns all its data; nothing is tied to a thread.
unsafe impl<A: KvAllocator, V: Variant> Send for RadixCache<A, V> {}

enum Lookup {
    Found { id: u32, gen: u64 },
    Miss { bucket: usize, word: u64 },
    Conflict,
}

/// What a lock-free walk found ([`RadixCache::peek_walk`]).
pub(crate) struct Peeked {
    /// Tokens matched (the SWA tree: the full KV, which the window rule may end
    /// earlier; the replay reports it).
    pub(crate) len: usize,
    /// Tokens up to the deepest place the variant lets a match end
    /// ([`Variant::peek_step`]): `len` for the plain tree.
    best: usize,
    /// The deepest matched record and the `gen` it was validated in (none for an
    /// empty match).
    deepest: Option<(u32, u64)>,
}

/// Index of the first position where `a` and `b` differ (the shorter length if one is
/// a prefix of the other). Blocks of 64 are compared with one branch-free pass each (it
/// vectorizes), so a long equal stretch costs what a `memcmp` of it costs, and only the
/// block holding the difference is scanned element by element.
///
/// `a` is the tree's side: each block first asks for the lines of `a`
/// [`PREFETCH_AHEAD`] tokens further on. A cached run is one stretch of memory (16 KiB
/// on average at page size 16 on the bundled trace) that the hardware prefetchers pick
/// up only after a few misses and lose at every 4 KiB page; with everything cached
/// (150 M tokens) those tokens come from DRAM, and the hint keeps about 4 KiB of
/// them in flight (BENCHMARKS, issue 8, sixteenth round). `b`, the caller's key, is
/// usually cached already.
#[cfg_attr(loom, allow(dead_code))]
fn first_diff(a: &[u32], b: &[u32]) -> usize {
    const BLOCK: usize = 64;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + BLOCK <= n {
        // The block's four cache lines, `PREFETCH_AHEAD` tokens on, within `a`.
        for line in (i + PREFETCH_AHEAD..n.min(i + PREFETCH_AHEAD + BLOCK)).step_by(16) {
            prefetch(&a[line]);
        }
        let mut diff = 0u32;
        for (x, y) in a[i..i + BLOCK].iter().zip(&b[i..i + BLOCK]) {
            diff |= x ^ y;
        }
        if diff != 0 {
            break;
        }
        i += BLOCK;
    }
    i + a[i..].iter().zip(&b[i..]).position(|(x, y)| x != y).unwrap_or(n - i)
}

/// How far ahead of its comparison [`first_diff`] asks for the tree's tokens: 1,024
/// tokens (4 KiB). Measured on the 150 M configuration of `cache_ops` (local, three
/// sets of rounds) from 256 to 8,192 tokens: 256 gained least, 1,024 and 2,048 the
/// most or as much as any, 8,192 less again (BENCHMARKS, issue 8, sixteenth round).
const PREFETCH_AHEAD: usize = 1024;

/// Ask for the cache line holding `x` (a hint: no effect on the program's results).
#[inline(always)]
fn prefetch<T>(x: &T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 target; a
    // prefetch neither reads nor writes memory as far as the program can tell, never
    // faults, and the address is a live reference besides.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>((x as *const T).cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = x;
}

/// Counters and generations that only the latch holder writes (the sizes, a record's
/// `gen` when it is published) change with a load and a store instead of a
/// read-modify-write. Readers see the old value or the new one either way; the store
/// keeps the `Release` of the RMW it replaces. What it saves is the locked
/// instruction, which on x86 waits for every earlier load and store to complete: the
/// insert of a new leaf stalled there on the store of its bucket's cold line
/// (BENCHMARKS, issue 8, sixteenth round).
pub(crate) trait LatchHeld {
    type Value;
    /// Add `d` (wrapping); the latch holder only.
    fn latch_add(&self, d: Self::Value);
    /// Subtract `d` (wrapping); the latch holder only.
    fn latch_sub(&self, d: Self::Value);
}

macro_rules! latch_held {
    ($atomic:ty, $value:ty) => {
        impl LatchHeld for $atomic {
            type Value = $value;
            #[inline]
            fn latch_add(&self, d: $value) {
                self.store(self.load(Ordering::Relaxed).wrapping_add(d), Ordering::Release);
            }
            #[inline]
            fn latch_sub(&self, d: $value) {
                self.store(self.load(Ordering::Relaxed).wrapping_sub(d), Ordering::Release);
            }
        }
    };
}
latch_held!(AtomicUsize, usize);
latch_held!(AtomicU64, u64);

fn span_of(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

/// A run link's (next run's first page, its length in pages); `(0, 0)` ends a chain.
pub(super) fn link_of(v: u64) -> (u32, u32) {
    (v as u32, (v >> 32) as u32)
}

/// The link to a run of `len` pages from `first`.
pub(super) fn link_to(first: u32, len: u32) -> u64 {
    u64::from(len) << 32 | u64::from(first)
}

fn cache_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

struct LatchGuard<'a>(&'a AtomicBool);

impl Drop for LatchGuard<'_> {
    fn drop(&mut self) {
        // Release: the critical section's writes happen-before the next holder's.
        self.0.store(false, Ordering::Release);
    }
}

impl<A: KvAllocator> RadixCache<A> {
    /// A cache over `alloc` (whose pages it caches) and `req_pool` (whose rows the
    /// request helpers read and free).
    ///
    /// Allocates every arena now: about 150 bytes per page (node record and metadata,
    /// hash buckets, page links) plus 4 bytes per slot, and 32 bytes more per page with
    /// events on. With page size 16 that is about 14 bytes per cached token.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] for an allocator whose page size is 0,
    /// [`ConfigError::TooLarge`] when slot numbers would not fit in a `u32`, and
    /// [`ConfigError::TooLargeForMemory`] (naming the arena and its bytes) when an arena
    /// cannot be reserved. Nothing is left allocated then.
    pub fn new(alloc: A, req_pool: ReqToTokenPool, config: RadixConfig) -> Result<Self, crate::ConfigError>
    where
        A: crate::alloc::OwnedAllocator,
    {
        Self::with_variant(alloc, req_pool, config, Plain)
    }
}

impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    /// The core constructor: a tree of variant `variant` (see [`new`](RadixCache::new)).
    fn with_variant(
        alloc: A,
        req_pool: ReqToTokenPool,
        config: RadixConfig,
        variant: V,
    ) -> Result<Self, crate::ConfigError> {
        let ps = alloc.page_size() as usize;
        if ps == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        let num_pages = alloc.size() / ps;
        // Slot numbers are u32: the last page's slots must fit (the variant's pages
        // come after the allocator's, in the same numbering).
        let too_large = ConfigError::TooLarge { size: alloc.size() as u64, page_size: ps as u32 };
        let tree_pages = num_pages.checked_add(variant.extra_pages()).ok_or(too_large.clone())?;
        let nslots = tree_pages.checked_add(1).and_then(|p| p.checked_mul(ps)).ok_or(too_large.clone())?;
        if nslots > u32::MAX as usize + 1 || tree_pages >= NIL as usize - 3 {
            return Err(too_large);
        }
        let (num_pages, tree_pages) = (num_pages as u32, tree_pages as u32);
        let nrec = tree_pages as usize + 3;
        let nbuckets = (nrec * 2).next_power_of_two();
        let pages = tree_pages as usize + 1;
        // The arenas are written as they are built: check first that all of them fit
        // together, so that a system that grants each reservation on its own (memory
        // overcommit) gives an error here rather than killing the process half-way.
        let per_record = size_of::<Record>() + size_of::<Meta<V::Node>>() + 2 * size_of::<u32>();
        let per_page = 4 * size_of::<u32>() + if config.event_capacity.is_some() { size_of::<BlockHash>() } else { 0 };
        let total = crate::arena::bytes_of::<u8>(nrec)
            .saturating_mul(per_record as u64)
            .saturating_add(crate::arena::bytes_of::<u64>(nbuckets))
            .saturating_add(crate::arena::bytes_of::<u8>(pages).saturating_mul(per_page as u64))
            .saturating_add(crate::arena::bytes_of::<u32>(nslots));
        crate::arena::probe(total, "the radix cache's arenas")?;
        let records = boxed("radix node records", nrec, |i| Record {
            gen: AtomicU64::new(if i == ROOT as usize { 0 } else { 1 }),
            span: AtomicU64::new(0),
            first_run: AtomicU32::new(0),
            parent_page: AtomicU32::new(0),
            namespace: AtomicU64::new(0),
            key_hash: AtomicU64::new(0),
            hash_next: AtomicU32::new(NIL),
            mark: AtomicU32::new(0),
        })?;
        let meta = boxed("radix node metadata", nrec, |_| Meta::default())?;
        let events = config.event_capacity.map(EventQueue::try_new).transpose()?;
        let inner = Inner {
            meta,
            free_ids: crate::arena::try_with_capacity(nrec, "radix free node list")?,
            heap: crate::arena::try_with_capacity(nrec, "radix eviction heap")?,
            page_owner: boxed("radix page owners", pages, |_| NIL)?,
            page_epoch: boxed("radix page epochs", pages, |_| 0u32)?,
            digests: if events.is_some() { boxed("radix page digests", pages, |_| [0u8; 32])? } else { Box::new([]) },
            clock: 0,
            ext: variant.new_state(nrec)?,
            hint_expiry: hints::Expiry::new(nrec)?,
            row_runs: writer::RowRuns::default(),
            leases: 0,
        };
        let cache = RadixCache {
            alloc,
            variant,
            req_pool,
            policy: config.policy,
            split_at_prompt: config.split_at_prompt,
            ps,
            shift: ps.is_power_of_two().then(|| ps.trailing_zeros()),
            num_pages,
            tree_pages,
            records,
            slot_token: tokens::Tokens::new(nslots)?,
            links: boxed("radix run links", pages, |_| AtomicU64::new(0))?,
            in_tree: boxed("radix page bitmap", pages.div_ceil(64), |_| std::sync::atomic::AtomicU64::new(0))?,
            buckets: boxed("radix hash buckets", nbuckets, |_| AtomicU64::new(NIL as u64))?,
            bucket_mask: nbuckets - 1,
            latch: CachePadded::new(AtomicBool::new(false)),
            inner: UnsafeCell::new(inner),
            evictable: AtomicUsize::new(0),
            protected: AtomicUsize::new(0),
            total: AtomicUsize::new(0),
            held: std::sync::atomic::AtomicUsize::new(0),
            #[cfg(test)]
            raw_used: std::sync::atomic::AtomicBool::new(false),
            events,
            id: cache_id(),
            hints: hints::Hints::new(nrec)?,
        };
        cache.write(|w| w.init());
        Ok(cache)
    }

    /// The KV allocator, as callers may use it: a free of a page the tree holds is
    /// refused ([`CacheAllocator`]).
    pub fn allocator(&self) -> CacheAllocator<'_, A> {
        let view = CacheAllocator::new(&self.alloc, &self.in_tree);
        #[cfg(test)]
        let view = view.noting_raw(&self.raw_used);
        view
    }

    /// The request rows.
    pub fn req_pool(&self) -> &ReqToTokenPool {
        &self.req_pool
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.ps
    }

    /// The eviction policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// The event queue, when events are on.
    pub fn events(&self) -> Option<&EventQueue> {
        self.events.as_ref()
    }

    /// Tokens cached in unlocked nodes (a snapshot under concurrency).
    pub fn evictable_size(&self) -> usize {
        self.evictable.load(Ordering::Acquire)
    }

    /// Tokens cached in locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected.load(Ordering::Acquire)
    }

    /// Tokens cached.
    pub fn total_size(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    fn write<R>(&self, f: impl FnOnce(&mut Writer<'_, A, V>) -> R) -> R {
        let mut backoff = Backoff::new();
        // Acquire: the previous holder's writes (Release on unlock) are visible.
        while self.latch.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            backoff.spin();
        }
        let _guard = LatchGuard(&self.latch);
        self.inner.with_mut(|p| {
            // SAFETY: we hold the latch, so no other reference to `inner` exists.
            let s = unsafe { &mut *p };
            // The runs a previous change recorded describe memory that may have changed
            // since.
            s.row_runs.clear();
            f(&mut Writer { c: self, s })
        })
    }

    /// The page a slot lies in (a shift when the page size is a power of two).
    #[inline]
    fn page_of(&self, slot: u32) -> u32 {
        match self.shift {
            Some(s) => slot >> s,
            None => slot / self.ps as u32,
        }
    }

    /// A slot's position in its page.
    #[inline]
    fn page_offset(&self, slot: u32) -> u32 {
        match self.shift {
            Some(s) => slot & ((1 << s) - 1),
            None => slot % self.ps as u32,
        }
    }

    fn aligned<'k>(&self, key: &'k [u32], out_len: usize) -> &'k [u32] {
        let n = key.len().min(out_len);
        &key[..n / self.ps * self.ps]
    }

    // ---- reader-side helpers: atomics only ----

    fn key_hash(&self, parent_page: u32, namespace: u64, page_tokens: &[u32]) -> u64 {
        self.key_hash_iter(parent_page, namespace, page_tokens.iter().copied())
    }

    fn key_hash_iter(&self, parent_page: u32, namespace: u64, tokens: impl Iterator<Item = u32>) -> u64 {
        let mut h = FxHasher::default();
        h.write_u32(parent_page);
        h.write_u64(namespace);
        for t in tokens {
            h.write_u32(t);
        }
        // FxHash's low bits are weak: mix before taking the bucket from them.
        let x = h.finish();
        (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
    }

    /// Compare a cached page's tokens with `key_page`. `LOCKED`: the caller holds the
    /// latch, so no token can be written meanwhile and the tokens may be read as plain
    /// memory (one vectorized compare instead of an atomic load per token).
    fn page_eq_in<const LOCKED: bool>(&self, page: u32, key_page: &[u32]) -> bool {
        if page == 0 || page > self.tree_pages {
            return false;
        }
        let base = page as usize * self.ps;
        #[cfg(not(loom))]
        if LOCKED {
            // SAFETY: the caller holds the latch, and only its holder writes tokens.
            return unsafe { self.slot_token.plain(base, self.ps) } == key_page;
        }
        self.slot_token.first_diff_atomic(base, key_page) == key_page.len()
    }

    fn find_child(&self, parent_page: u32, namespace: u64, key_page: &[u32]) -> Lookup {
        self.find_child_in::<false>(parent_page, namespace, key_page)
    }

    /// Start loading the bucket that [`find_child_in`](Self::find_child_in) will read
    /// for this child, so that its cache miss overlaps the work before that look-up
    /// (the comparison of the node above). A hint only: it reads nothing.
    #[inline]
    fn prefetch_child(&self, parent_page: u32, namespace: u64, key_page: &[u32]) {
        // Only where the hint does something: the hash is not free.
        #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
        self.prefetch_bucket(self.key_hash(parent_page, namespace, key_page));
        #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
        let _ = (parent_page, namespace, key_page);
    }

    /// Start loading the bucket of key hash `h` (a hint).
    #[inline]
    fn prefetch_bucket(&self, h: u64) {
        if let Some(word) = self.buckets.get(h as usize & self.bucket_mask) {
            prefetch(word);
        }
    }

    fn find_child_in<const LOCKED: bool>(&self, parent_page: u32, namespace: u64, key_page: &[u32]) -> Lookup {
        let h = self.key_hash(parent_page, namespace, key_page);
        let bucket = h as usize & self.bucket_mask;
        // Acquire: pairs with the Release that published the head record.
        let word = self.buckets[bucket].load(Ordering::Acquire);
        let mut id = word as u32;
        let mut steps = 0usize;
        while id != NIL {
            if id as usize >= self.records.len() || steps > self.records.len() {
                return Lookup::Conflict;
            }
            let r = &self.records[id as usize];
            let gen = r.gen.load(Ordering::Acquire);
            if gen & 1 == 0
                && r.key_hash.load(Ordering::Relaxed) == h
                && r.parent_page.load(Ordering::Relaxed) == parent_page
                && r.namespace.load(Ordering::Relaxed) == namespace
                && self.page_eq_in::<LOCKED>(span_of(r.span.load(Ordering::Relaxed)).0, key_page)
            {
                return Lookup::Found { id, gen };
            }
            id = r.hash_next.load(Ordering::Acquire);
            steps += 1;
        }
        Lookup::Miss { bucket, word }
    }

    /// Match `key` (whole pages) against record `id`'s pages, writing slots to `out`.
    /// Returns (pages matched, last matched page, pages in the node).
    fn match_in_node<const LOCKED: bool>(&self, id: u32, key: &[u32], out: &mut [u32]) -> (usize, u32, usize) {
        let ps = self.ps;
        self.walk_node::<LOCKED>(id, key, |at, page, pages| {
            // An ascending fill: a run's slots are consecutive.
            crate::iota::fill_ascending(&mut out[at * ps..(at + pages) * ps], page * ps as u32);
        })
    }

    /// [`match_in_node`](Self::match_in_node) without writing slots (latch held).
    fn count_in_node(&self, id: u32, key: &[u32]) -> (usize, u32, usize) {
        self.walk_node::<true>(id, key, |_, _, _| {})
    }

    /// How many leading whole pages of `key` equal the tokens cached in the `pages`
    /// consecutive pages from `page`. `LOCKED`: the caller holds the latch, so no token
    /// can be written meanwhile and the tokens may be read as plain memory (one
    /// vectorized pass, [`first_diff`], instead of an atomic load per token pair).
    fn run_matches<const LOCKED: bool>(&self, page: u32, pages: usize, key: &[u32]) -> usize {
        let ps = self.ps;
        let base = page as usize * ps;
        let key = &key[..pages * ps];
        #[cfg(not(loom))]
        if LOCKED {
            // SAFETY: the caller holds the latch, and only its holder writes tokens.
            let tokens = unsafe { self.slot_token.plain(base, pages * ps) };
            return first_diff(tokens, key) / ps;
        }
        self.slot_token.first_diff_atomic(base, key) / ps
    }

    /// Walk record `id`'s runs against `key` (whole pages), calling `f(at, page, pages)`
    /// for each stretch of `pages` matched pages starting at `page`, `at` pages into the
    /// key. Returns (pages matched, last matched page, pages in the node).
    ///
    /// Readers (`LOCKED == false`) may be reading a record that is being split or
    /// evicted: every length is clamped and every page bounds-checked, so garbage ends
    /// the walk early; the caller's `gen` validation then discards the result.
    fn walk_node<const LOCKED: bool>(
        &self,
        id: u32,
        key: &[u32],
        mut f: impl FnMut(usize, u32, usize),
    ) -> (usize, u32, usize) {
        let r = &self.records[id as usize];
        let (first, n) = span_of(r.span.load(Ordering::Relaxed));
        let (ps, n) = (self.ps, n as usize);
        let key_pages = key.len() / ps;
        let (mut page, mut in_run) = (first, r.first_run.load(Ordering::Relaxed) as usize);
        let (mut m, mut last) = (0usize, 0u32);
        while m < n && m < key_pages {
            let len = in_run.min(n - m).min(key_pages - m);
            if len == 0 || page == 0 || page as usize + len - 1 > self.tree_pages as usize {
                break;
            }
            let k = self.run_matches::<LOCKED>(page, len, &key[m * ps..]);
            if k > 0 {
                f(m, page, k);
                last = page + k as u32 - 1;
            }
            m += k;
            if k < len || m == n || m == key_pages {
                break;
            }
            let (next, next_len) = link_of(self.links[(page as usize) + len - 1].load(Ordering::Acquire));
            (page, in_run) = (next, next_len as usize);
        }
        (m, last, n)
    }

    /// Longest cached prefix of `key` in `namespace`, read-only: no recency update, no
    /// split, never blocks, never takes the latch. Writes the matched slots to
    /// `out[..len]` and returns `len` (whole pages; the key is cut to `out.len()`).
    ///
    /// For routers and admission estimates. The slots are valid when it returns but not
    /// protected afterwards: a request that uses them is [admitted](Self::admit), which
    /// matches again and locks.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use kvpool::radix::{RadixCache, RadixConfig};
    /// # use kvpool::{ReqToTokenPool, TokenAllocator};
    /// let cache = Arc::new(RadixCache::new(TokenAllocator::new(8)?, ReqToTokenPool::new(1, 8)?, RadixConfig::default())?);
    /// let mut req = cache.admit(7, &[5, 6])?;
    /// req.extend(2)?;
    /// req.finish(&[5, 6])?;
    /// let mut out = [0u32; 3];
    /// assert_eq!(cache.peek_prefix(7, &[5, 6, 1], &mut out), 2);
    /// assert_eq!(cache.peek_prefix(8, &[5, 6, 1], &mut out), 0); // other namespace
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        self.peek_walk(namespace, key, out).best
    }

    /// The lock-free walk behind [`peek_prefix`](Self::peek_prefix) and the router
    /// hints (see "Concurrency" in the module docs for the protocol and its argument).
    /// Every node on the returned path is validated while its child is found, and the
    /// deepest one once more at the end.
    pub(crate) fn peek_walk(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> Peeked {
        let key = self.aligned(key, out.len());
        let ps = self.ps;
        let mut backoff = Backoff::new();
        'retry: loop {
            let (mut pos, mut cur, mut best) = (0usize, 0u32, 0usize);
            let mut walk = V::Walk::default();
            let mut deepest: Option<(u32, u64)> = None;
            while pos < key.len() {
                match self.find_child(cur, namespace, &key[pos..pos + ps]) {
                    Lookup::Conflict => {
                        backoff.spin();
                        continue 'retry;
                    }
                    Lookup::Miss { bucket, word } => {
                        fence(Ordering::Acquire);
                        if self.buckets[bucket].load(Ordering::Relaxed) >> 32 != word >> 32 {
                            backoff.spin();
                            continue 'retry;
                        }
                        break;
                    }
                    Lookup::Found { id, gen } => {
                        let (m, last, n) = self.match_in_node::<false>(id, &key[pos..], &mut out[pos..]);
                        let mark = self.records[id as usize].mark.load(Ordering::Acquire);
                        fence(Ordering::Acquire);
                        if self.records[id as usize].gen.load(Ordering::SeqCst) != gen || m == 0 {
                            backoff.spin();
                            continue 'retry;
                        }
                        // The child was found under its parent's last page, which carries
                        // no generation: the parent must still be the incarnation read
                        // above, or the page may end another node by now and this child
                        // hang below that one.
                        if let Some((parent, parent_gen)) = deepest {
                            if self.records[parent as usize].gen.load(Ordering::SeqCst) != parent_gen {
                                backoff.spin();
                                continue 'retry;
                            }
                        }
                        deepest = Some((id, gen));
                        pos += m * ps;
                        if self.variant.peek_step(&mut walk, mark, m * ps) {
                            best = pos;
                        }
                        if m < n {
                            break;
                        }
                        cur = last;
                    }
                }
            }
            if let Some((id, gen)) = deepest {
                fence(Ordering::Acquire);
                if self.records[id as usize].gen.load(Ordering::SeqCst) != gen {
                    backoff.spin();
                    continue 'retry;
                }
            }
            return Peeked { len: pos, best, deepest };
        }
    }

    /// SGLang's `match_prefix`: the longest cached prefix of `key` (cut to whole pages and
    /// to `out.len()`), its slots written to `out[..len]`. Updates recency and hit counts
    /// along the path and splits the last node when the match ends inside it. Does not
    /// lock: a request that uses the slots is [admitted](Self::admit).
    pub fn match_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> MatchResult {
        let key = self.aligned(key, out.len());
        let r = self.write(|w| w.match_path(namespace, key, out).0);
        crate::debug_check(self);
        r
    }

    /// Match and lock in one step, so no eviction can come between (the crux of using
    /// a prefix cache from several threads). The lease protects the matched path until
    /// dropped; `lease.len()` tokens of `out` hold the matched slots.
    pub(crate) fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> Lease<'_, A, V> {
        self.hints.admit();
        let key = self.aligned(key, out.len());
        let key = self.write(|w| {
            if self.policy.uses_hints() {
                self.hints.admitted_tokens(key.len());
            }
            let (m, ..) = w.match_path(namespace, key, out);
            w.lease_of(&m)
        });
        crate::debug_check(self);
        Lease { cache: self, key }
    }

    /// [`match_and_lock`](Self::match_and_lock) writing the matched slots straight into
    /// the request's row (positions `0..lease.len()`; the key is cut to the row's
    /// length). The row remembers that those positions are the cache's own slots for
    /// the lease's path until something writes over them, so the finish need not
    /// compare them with the tree again.
    ///
    /// # Errors
    ///
    /// [`RowError::ForeignRow`] if the row is another pool's; nothing is matched or
    /// locked then.
    pub(crate) fn match_and_lock_row(
        &self,
        namespace: u64,
        key: &[u32],
        row: &mut ReqRow,
    ) -> Result<Lease<'_, A, V>, RowError> {
        self.match_into_row(key, row, |key, out| self.match_and_lock(namespace, key, out), |lease| lease.key)
    }

    /// Run `lock_match(key, out)` into `row` from position 0 (the key cut to the row's
    /// length), then mark the row's first slots, up to the lease (`lease_of`), as this
    /// cache's own: the finish then takes them without comparing them with the tree.
    fn match_into_row<T>(
        &self,
        key: &[u32],
        row: &mut ReqRow,
        lock_match: impl FnOnce(&[u32], &mut [u32]) -> T,
        lease_of: impl FnOnce(&T) -> LeaseKey,
    ) -> Result<T, RowError> {
        let n = key.len().min(self.req_pool.max_context_len());
        let matched = lock_match(&key[..n], self.req_pool.read_mut(row, 0..n)?);
        let k = lease_of(&matched);
        ReqToTokenPool::set_matched(row, k.len, k.last_page, k.epoch);
        Ok(matched)
    }

    /// Lock the path of an earlier [`match_prefix`](Self::match_prefix).
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] if the matched node was evicted since, or the match
    /// came from another cache. Nothing changes then.
    #[cfg(test)]
    pub(crate) fn lock(&self, m: &MatchResult) -> Result<Lease<'_, A, V>, CacheError> {
        if m.cache_id != self.id {
            return Err(CacheError::StaleMatch);
        }
        let key = self.write(|w| {
            if m.last_page != 0
                && (!w.is_node_end(m.last_page, m.epoch) || !V::lockable(w, w.s.page_owner[m.last_page as usize]))
            {
                return Err(CacheError::StaleMatch);
            }
            Ok(w.lease_of(m))
        })?;
        Ok(Lease { cache: self, key })
    }

    /// Unlock a detached lease. It is consumed, so it can be released only once.
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] if it belongs to another cache, or its node is gone
    /// (the cache was [`reset`](Self::reset) since); nothing changes then.
    #[cfg(test)]
    pub(crate) fn release(&self, lease: RawLease) -> Result<(), CacheError> {
        self.release_key(lease.0)
    }

    /// Turn a detached lease of this cache back into a [`Lease`] (for
    /// [`cache_finished_req`](Self::cache_finished_req), or to unlock on drop).
    ///
    /// # Errors
    ///
    /// Hands the lease back if it belongs to another cache.
    #[cfg(test)]
    pub(crate) fn attach(&self, lease: RawLease) -> Result<Lease<'_, A, V>, RawLease> {
        if lease.0.cache_id != self.id {
            return Err(lease);
        }
        Ok(Lease { cache: self, key: lease.0 })
    }

    fn release_key(&self, lease: LeaseKey) -> Result<(), CacheError> {
        if lease.cache_id != self.id {
            return Err(CacheError::StaleMatch);
        }
        if lease.last_page == 0 {
            return Ok(());
        }
        let r = self.write(|w| {
            if !w.is_node_end(lease.last_page, lease.epoch) || w.node_of(lease.last_page).lock_ref == 0 {
                return Err(CacheError::StaleMatch);
            }
            w.unlock_lease(&lease);
            Ok(())
        });
        crate::debug_check(self);
        r
    }

    /// Evict unlocked leaves in policy order until at least `num_tokens` tokens were
    /// freed, or nothing evictable is left. Returns the tokens freed (whole leaves go, so
    /// it may be more than asked).
    pub fn evict(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            return 0;
        }
        let r = self.write(|w| w.evict(num_tokens));
        crate::debug_check(self);
        r
    }

    fn make_room(&self, need: usize) {
        // Most decode steps continue a page: nothing to make room for, and the free
        // count (a sum over the allocator's shards) is not read.
        if need > 0 {
            V::make_room(self, need);
        }
    }

    fn with_evictable(&self, e: AllocError) -> AllocError {
        match e {
            AllocError::OutOfMemory(mut oom) => {
                oom.evictable = Some(self.evictable_size());
                AllocError::OutOfMemory(oom)
            }
            other => other,
        }
    }

    /// Allocate `out.len()` slots (whole pages), evicting the shortfall first.
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::alloc`]; an out-of-memory error also states the evictable tokens.
    #[cfg(test)]
    pub(crate) fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        alloc_view::mark_raw(&self.raw_used);
        // Validate before evicting: a call that cannot succeed changes nothing.
        let ps = self.ps;
        if out.len() % ps != 0 {
            return Err(InvalidInput::NotPageAligned { count: out.len(), page_size: ps as u32 }.into());
        }
        self.make_room(out.len());
        self.alloc.alloc(out).map_err(|e| self.with_evictable(e))
    }

    /// [`KvAllocator::alloc_extend`], evicting the shortfall first.
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::alloc_extend`]; an out-of-memory error also states the evictable
    /// tokens left.
    #[cfg(test)]
    pub(crate) fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        self.room_to_extend(prefix_lens, seq_lens, last_locs, out.len())?;
        alloc_view::mark_raw(&self.raw_used);
        self.alloc.alloc_extend(prefix_lens, seq_lens, last_locs, out).map_err(|e| self.with_evictable(e))
    }

    /// Check an extend batch's shape and evict its shortfall.
    fn room_to_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
    ) -> Result<(), InvalidInput> {
        let plan = crate::alloc::plan_extend(self.alloc.page_size(), prefix_lens, seq_lens)?;
        let req = |i: usize| (prefix_lens[i], seq_lens[i]);
        crate::alloc::check_batch_shape(&self.alloc, seq_lens.len(), last_locs, out_len, plan.new_tokens, req)?;
        self.allocator().check_continued_pages(last_locs, req)?;
        self.make_room(plan.new_pages * self.ps);
        Ok(())
    }

    /// [`alloc_extend`](Self::alloc_extend) for one request, writing the new slots
    /// straight into its row: positions `prefix_len..seq_len` of `row` get the
    /// expansion, and the prefix's last slot (`last_loc`) is read from the row itself,
    /// so it cannot disagree with it. This is SGLang's `alloc_extend` followed by its
    /// `write_req_to_token_pool`, without the copy in between.
    ///
    /// The row remembers what the allocator wrote until something writes over it, so
    /// [`cache_finished_req`](Self::cache_finished_req) and
    /// [`cache_unfinished_req`](Self::cache_unfinished_req) check those positions'
    /// page shape by their pages' first slots only (at page size 16, a sixteenth of
    /// the reads). With kvpool's allocators it also remembers where the slots stop
    /// being consecutive, as the claim found it ([`KvAllocator::alloc_extend_runs`];
    /// up to 16 such breaks per row, the rest is read): there the finish reads only
    /// each run's first slot, at any page size. Every other position of the row is
    /// checked slot by slot as before; any [`ReqToTokenPool::write`] or
    /// [`read_mut`](ReqToTokenPool::read_mut) from a position below the expansion's end
    /// makes the row forget it.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::radix::{RadixCache, RadixConfig};
    /// use kvpool::{PagedAllocator, ReqToTokenPool};
    ///
    /// let cache = RadixCache::new(PagedAllocator::new(256, 4)?, ReqToTokenPool::new(2, 64)?, RadixConfig::default())?;
    /// let tokens: Vec<u32> = (100..110).collect();
    /// let mut row = cache.req_pool().alloc()?;
    /// let lease = cache.match_and_lock(0, &tokens, &mut [0; 10]);
    /// let hit = lease.len();
    /// assert_eq!(hit, 0);
    /// cache.alloc_extend_row(&mut row, hit, tokens.len())?; // pages 1, 2 and 3
    /// assert_eq!(cache.req_pool().read(&row, 0..10)?, &[4, 5, 6, 7, 8, 9, 10, 11, 12, 13]);
    /// assert_eq!(cache.cache_finished_req(0, &tokens, row, lease, 0).map_err(|e| e.error)?, 0);
    /// assert_eq!(cache.total_size(), 8); // two whole pages; the tail was freed
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend), and [`AllocError::Row`] if
    /// `prefix_len..seq_len` is past the row's end or the row is another pool's.
    /// Nothing is allocated on error.
    #[cfg(test)]
    pub(crate) fn alloc_extend_row(
        &self,
        row: &mut ReqRow,
        prefix_len: usize,
        seq_len: usize,
    ) -> Result<(), AllocError> {
        alloc_view::mark_raw(&self.raw_used);
        self.extend_row(row, prefix_len, seq_len)
    }

    /// [`alloc_extend_row`](Self::alloc_extend_row) for a [`Request`], which accounts
    /// for what it allocates.
    fn extend_row(&self, row: &mut ReqRow, prefix_len: usize, seq_len: usize) -> Result<(), AllocError> {
        self.req_pool.fill_extension(row, prefix_len, seq_len, |prefix, seq, last_loc, out, breaks| {
            self.room_to_extend(&[prefix], &[seq], &[last_loc], out.len())?;
            self.alloc.alloc_extend_runs(prefix, seq, last_loc, out, breaks).map_err(|e| self.with_evictable(e))
        })
    }

    /// [`KvAllocator::alloc_decode`], evicting the shortfall first.
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend).
    #[cfg(test)]
    pub(crate) fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        alloc_view::mark_raw(&self.raw_used);
        let need = self.alloc.decode_need(seq_lens)?;
        let req = |i: usize| (seq_lens[i] - 1, seq_lens[i]);
        crate::alloc::check_batch_shape(&self.alloc, seq_lens.len(), last_locs, out.len(), seq_lens.len(), req)?;
        self.allocator().check_continued_pages(last_locs, req)?;
        self.decode_slots(seq_lens, last_locs, out, need)
    }

    /// The decode slots of live [`Request`]s (`seq_lens[i] - 1` tokens written, ending
    /// at `last_locs[i]`, their own when it continues a page), `need` the tokens of
    /// the pages they start: their shape holds by construction, so no batch check is
    /// repeated here (the allocator checks what it reads).
    ///
    /// The slots are asked for first and room made only when the allocator is short
    /// (an allocation that fails changes nothing), so a step with free pages reads no
    /// free count; what is evicted is what making room first would evict.
    pub(crate) fn decode_slots(
        &self,
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
        need: usize,
    ) -> Result<(), AllocError> {
        match self.alloc.alloc_decode(seq_lens, last_locs, out) {
            Err(AllocError::OutOfMemory(_)) => {
                self.make_room(need);
                self.alloc.alloc_decode(seq_lens, last_locs, out).map_err(|e| self.with_evictable(e))
            }
            r => r,
        }
    }

    /// The page-aligned length of a request's tokens and the length its lease protects,
    /// after checking the lease is this cache's and covers no more than those tokens.
    fn request_lengths(&self, token_ids: &[u32], lease: &Lease<'_, A, V>) -> Result<(usize, usize), CacheError> {
        if lease.key.cache_id != self.id || !core::ptr::eq(lease.cache, self) {
            return Err(CacheError::StaleMatch);
        }
        let aligned = token_ids.len() / self.ps * self.ps;
        let protected = lease.len();
        if protected > aligned {
            let (prefix_len, seq_len) = (protected as u32, aligned as u32);
            return Err(InvalidInput::PrefixLongerThanSeq { request: 0, prefix_len, seq_len }.into());
        }
        Ok((aligned, protected))
    }

    /// Drop the whole tree: cached slots go back to the allocator, sizes go to 0, an
    /// `AllBlocksCleared` event is sent. A host tier's transfers taken and not completed
    /// keep the pages their copies touch until they complete (see
    /// [the host tier's module docs](hi)).
    ///
    /// As SGLang's `flush_cache`, only between requests. It takes `&mut self`: a cache
    /// shared with requests through an [`Arc`](std::sync::Arc) is reset through
    /// [`Arc::get_mut`](std::sync::Arc::get_mut), which succeeds only once no
    /// [`Request`] is alive.
    ///
    /// # Errors
    ///
    /// [`CacheError::Leased`] while a lock is held (a kvpool bug once no request is
    /// alive); nothing changes then.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvpool::radix::{RadixCache, RadixConfig};
    /// use kvpool::{PagedAllocator, ReqToTokenPool};
    ///
    /// let mut cache = Arc::new(RadixCache::new(PagedAllocator::new(16, 1)?, ReqToTokenPool::new(2, 16)?, RadixConfig::default())?);
    /// let mut req = cache.admit(0, &[1, 2, 3, 4])?;
    /// req.extend(4)?;
    /// assert!(Arc::get_mut(&mut cache).is_none()); // the request holds the cache
    /// req.finish(&[1, 2, 3, 4])?;
    /// Arc::get_mut(&mut cache).expect("no request is alive").reset()?;
    /// assert_eq!((cache.total_size(), cache.allocator().available_size()), (0, 16));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reset(&mut self) -> Result<(), CacheError> {
        self.write(|w| match w.s.leases {
            0 => {
                w.reset();
                Ok(())
            }
            leases => Err(CacheError::Leased { leases }),
        })
    }

    /// A readable dump of the tree: one line per node, indented by depth, with its
    /// length, first tokens and lock count; then the totals.
    pub fn pretty_print(&self) -> String {
        self.write(|w| w.pretty())
    }

    /// Check every invariant in O(capacity): sizes add up, every cached page is owned by
    /// exactly one node and allocated, bucket chains hold exactly the live nodes, lock
    /// counts are monotone towards the root, the eviction heap holds exactly the
    /// evictable leaves in heap order; and the accounting: free + cached + held by live
    /// [`Request`]s = capacity, so KV taken and never given back is a violation. Exact
    /// at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] naming the broken invariant (a kvpool bug).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let apart = self.write(|w| w.check().map(|()| V::held_apart(w)))?;
        #[cfg(test)]
        if self.raw_used.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let held = self.held.load(std::sync::atomic::Ordering::Relaxed);
        // The full KV pool's free tokens (an SWA allocator's `available_size` is the
        // smaller of its two pools').
        let free = self.alloc.as_swa().map_or_else(|| self.alloc.available_size(), |s| s.full_available_size());
        let (cached, size) = (self.total_size(), self.alloc.size());
        if free + cached + held + apart != size {
            return Err(InvariantViolation(format!(
                "KV accounting: {free} free + {cached} cached + {held} held by live requests + {apart} held by \
                 transfers a reset left != {size} capacity \
                 (slots taken from the allocator and not given back, or given back twice)"
            )));
        }
        Ok(())
    }

    /// Every cached path from the root to a leaf as (namespace, tokens, slots), sorted:
    /// a canonical view for comparing trees whatever their node layout. O(cached tokens)
    /// and allocating: for tests and debugging.
    pub fn leaf_paths(&self) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
        self.write(|w| w.leaf_paths())
    }

    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.write(|w| w.s.meta.iter().skip(1).filter(|m| m.alive).count())
    }
}

/// The plain cache's inserts and request helpers (other variants carry more per node:
/// their inserts take it).
impl<A: KvAllocator> RadixCache<A> {
    /// Insert `key -> slots` (whole pages); returns how many leading tokens were already
    /// cached. The caller's slots for those are duplicates it must free (the request
    /// helpers do that); the tree takes ownership of the rest. `priority` raises the
    /// priority of every node on the path (for [`EvictionPolicy::Priority`]).
    ///
    /// # Errors
    ///
    /// [`CacheError::Invalid`] if the lengths differ or are not whole pages, or a page's
    /// slots are not that page's slots in order; [`CacheError::SlotNotOwned`] if a new
    /// page is already in the tree or not allocated. Nothing changes on error.
    #[cfg(test)]
    pub(crate) fn insert(
        &self,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
    ) -> Result<usize, CacheError> {
        let r = self.write(|w| w.insert(namespace, key, slots, priority).map(|(cached, _)| cached));
        crate::debug_check(self);
        r
    }

    /// SGLang's `cache_finished_req`. `token_ids` are the request's tokens that have KV
    /// (prompt plus outputs, minus the last generated token); the row holds their slots.
    /// Inserts the page-aligned part, frees the slots the tree already had beyond the
    /// lease (duplicates) and the unaligned tail, unlocks, and frees the row. Returns the
    /// prefix length the insert found.
    ///
    /// # Errors
    ///
    /// [`Unfinished`] hands the row and lease back with the reason; nothing changed.
    #[cfg(test)]
    pub(crate) fn cache_finished_req<'c>(
        &'c self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Lease<'c, A>,
        priority: i64,
    ) -> Result<usize, Unfinished<'c, A>> {
        self.finish_with(namespace, token_ids, row, lease, priority, usize::MAX, |_| Ok(()), |_, _| ()).map(|(n, ())| n)
    }

    /// SGLang's `cache_unfinished_req` (chunked prefill): inserts the page-aligned part of
    /// `token_ids`, frees the duplicates, re-matches, rewrites the row with the tree's
    /// slots, and moves the lease to the new last node. The unaligned tail stays with the
    /// request. Afterwards `lease.len()` is the new protected length.
    ///
    /// # Errors
    ///
    /// [`CacheError`]; nothing changed.
    #[cfg(test)]
    pub(crate) fn cache_unfinished_req(
        &self,
        namespace: u64,
        token_ids: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A>,
        priority: i64,
    ) -> Result<(), CacheError> {
        self.unfinished_with(
            &self.req_pool,
            namespace,
            token_ids,
            row,
            lease,
            priority,
            usize::MAX,
            |_| Ok(()),
            |_, _| (),
        )
    }
}

/// What a request helper's insert did, for the variant's part (`then`).
pub(crate) struct Inserted<'k> {
    /// The node the inserted key ends at (`ROOT` for an empty key).
    pub end: u32,
    pub namespace: u64,
    /// The inserted tokens (whole pages).
    pub key: &'k [u32],
    /// The request's slots for them.
    pub kv: &'k [u32],
    /// Tokens the request's lease covered (the tree's own slots in `kv`).
    pub protected: usize,
    /// Tokens the tree held before the insert (`kv[protected..cached]` are the
    /// request's duplicates, freed after `then`).
    pub cached: usize,
}

/// The request helpers' core, shared by the variants: `check` validates the variant's
/// part before anything changes, `then` applies it once the key is inserted. `limit`
/// caps the tokens inserted (whole pages, at least the lease; `usize::MAX`: all the
/// page-aligned ones); the rest is the request's tail.
impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    #[allow(clippy::too_many_arguments)]
    #[cfg(test)]
    fn finish_with<'c, R>(
        &'c self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Lease<'c, A, V>,
        priority: i64,
        limit: usize,
        check: impl FnOnce(&Writer<'_, A, V>) -> Result<(), CacheError>,
        then: impl FnOnce(&mut Writer<'_, A, V>, &Inserted<'_>) -> R,
    ) -> Result<(usize, R), Unfinished<'c, A, V>> {
        match self.finish(&self.req_pool, namespace, token_ids, &row, &lease, priority, limit, check, then) {
            Ok(r) => {
                core::mem::forget(lease); // its lock was released by `finish`
                                          // The row is ours: freeing it cannot fail.
                let _ = self.req_pool.free(row);
                Ok(r)
            }
            Err(error) => Err(Unfinished { error, row, lease }),
        }
    }

    /// The page-aligned length to insert, capped by `limit` (never below the lease).
    fn insert_len(&self, aligned: usize, protected: usize, limit: usize) -> usize {
        aligned.min(limit.max(protected) / self.ps * self.ps)
    }

    /// The finish of a tree whose nodes carry nothing a request hands over (the plain
    /// tree, the host tier): cache `tokens`, return the tokens that were cached already.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish_kv(
        &self,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, V>,
        priority: i64,
    ) -> Result<usize, CacheError> {
        self.finish(rows, namespace, tokens, row, lease, priority, usize::MAX, |_| Ok(()), |_, _| ()).map(|(n, ())| n)
    }

    /// The checkpoint of a tree whose nodes carry nothing a request hands over.
    pub(crate) fn checkpoint_kv(
        &self,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, V>,
        priority: i64,
    ) -> Result<(), CacheError> {
        self.unfinished_with(&self.req_pool, namespace, tokens, row, lease, priority, usize::MAX, |_| Ok(()), |_, _| ())
    }

    #[allow(clippy::too_many_arguments)]
    /// Cache a finished request whose row is in `rows` (the cache's own request rows,
    /// or a hybrid pool's).
    pub(crate) fn finish<R>(
        &self,
        rows: &ReqToTokenPool,
        namespace: u64,
        token_ids: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, V>,
        priority: i64,
        limit: usize,
        check: impl FnOnce(&Writer<'_, A, V>) -> Result<(), CacheError>,
        then: impl FnOnce(&mut Writer<'_, A, V>, &Inserted<'_>) -> R,
    ) -> Result<(usize, R), CacheError> {
        let (aligned, protected) = self.request_lengths(token_ids, lease)?;
        let aligned = self.insert_len(aligned, protected, limit);
        let vouched = vouched_prefix(row, &lease.key);
        let kv = rows.read(row, 0..token_ids.len())?;
        // The row's page shape needs no latch (see `check_row_shape`): checked first,
        // reported where `prepare_request` reports it.
        let shape = self.check_row_shape(&kv[..aligned], protected.min(aligned), &rows.expansion(row));
        let r = self.write(|w| {
            // Everything is checked (the variant's part, the leased prefix against the
            // tree, the pages to insert, the duplicates and the tail to free) before
            // anything changes.
            check(w)?;
            let key = &token_ids[..aligned];
            let p = w.prepare_request(namespace, key, kv, lease.key, true, shape, vouched)?;
            let end = V::apply_insert(w, namespace, key, &kv[..aligned], priority, p.cached);
            let ins = Inserted { end, namespace, key, kv: &kv[..aligned], protected: p.protected, cached: p.cached };
            let r = then(w, &ins);
            let mut group = self.alloc.free_group();
            let freed = group.free(&kv[p.protected..p.cached]).and_then(|()| group.free(&kv[aligned..]));
            debug_assert!(freed.is_ok(), "checked request slots failed to free: {freed:?}");
            drop(group);
            w.unlock_lease(&lease.key);
            Ok((p.cached, r))
        });
        crate::debug_check(self);
        r
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn unfinished_with<R>(
        &self,
        rows: &ReqToTokenPool,
        namespace: u64,
        token_ids: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, V>,
        priority: i64,
        limit: usize,
        check: impl FnOnce(&Writer<'_, A, V>) -> Result<(), CacheError>,
        then: impl FnOnce(&mut Writer<'_, A, V>, &Inserted<'_>) -> R,
    ) -> Result<R, CacheError> {
        let (aligned, protected) = self.request_lengths(token_ids, lease)?;
        let aligned = self.insert_len(aligned, protected, limit);
        // What the allocator wrote, noted before `read_mut` forgets it (the change below
        // writes the tree's slots over the cached prefix).
        let expanded = rows.expansion(row);
        let vouched = vouched_prefix(row, &lease.key);
        let kv = rows.read_mut(row, 0..token_ids.len())?;
        // As in `finish`: the row's shape before the latch.
        let shape = self.check_row_shape(&kv[..aligned], protected.min(aligned), &expanded);
        let (key, r) = self.write(|w| {
            check(w)?;
            let key = &token_ids[..aligned];
            let p = w.prepare_request(namespace, key, kv, lease.key, true, shape, vouched)?;
            let end = V::apply_insert(w, namespace, key, &kv[..aligned], priority, p.cached);
            let ins = Inserted { end, namespace, key, kv: &kv[..aligned], protected: p.protected, cached: p.cached };
            let r = then(w, &ins);
            let freed = self.alloc.free(&kv[p.protected..p.cached]);
            debug_assert!(freed.is_ok(), "checked duplicate slots failed to free: {freed:?}");
            // The row is rewritten below: the runs recorded for it no longer hold.
            w.s.row_runs.clear();
            // The request holds the KV of everything it inserted: its lease moves to the
            // node the whole key ends at (where the KV match ends), and its row gets the
            // tree's slots.
            let (.., at) = w.match_path(namespace, key, &mut kv[..aligned]);
            debug_assert_eq!(at.len, aligned, "an inserted key matches whole");
            let new = w.lease_of(&at);
            w.unlock_lease(&lease.key);
            Ok::<_, CacheError>((new, r))
        })?;
        lease.key = key;
        // The row's prefix now holds the tree's slots for the moved lease.
        ReqToTokenPool::set_matched(row, key.len, key.last_page, key.epoch);
        crate::debug_check(self);
        Ok(r)
    }
}

/// How much of `row`'s prefix the cache wrote itself for the path `lease` locks (0 if
/// none): there the row holds the tree's slots by construction. The lease keeps that
/// path from being evicted and splits never move a slot, so those positions need no
/// comparison with the tree.
fn vouched_prefix(row: &ReqRow, lease: &LeaseKey) -> usize {
    let (len, last_page, epoch) = ReqToTokenPool::matched(row);
    if len == lease.len && last_page == lease.last_page && epoch == lease.epoch {
        len
    } else {
        0
    }
}

impl<A: KvAllocator, V: Variant> crate::CheckInvariants for RadixCache<A, V> {
    /// The structure only: the accounting is exact only between whole request steps,
    /// and a step checks from inside.
    fn check(&self) -> Result<(), InvariantViolation> {
        self.write(|w| w.check())
    }
}

impl<A: KvAllocator, V: Variant> fmt::Debug for RadixCache<A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RadixCache")
            .field("page_size", &self.ps)
            .field("policy", &self.policy)
            .field("total", &self.total_size())
            .field("evictable", &self.evictable_size())
            .field("protected", &self.protected_size())
            .finish()
    }
}

mod writer;

#[cfg(all(test, not(loom)))]
mod tests;
#[cfg(all(test, not(loom)))]
mod tests_mamba;
