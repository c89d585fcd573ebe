//! What distinguishes the tree variants: the one radix core (matching, splitting,
//! publication to lock-free readers, leases, the writer latch, the arenas, events and
//! the eviction of whole leaves) calls these hooks at fixed points, and a variant
//! supplies its node payload, its lock rules, its extra orders and its extra passes.
//!
//! | variant | node payload | locks | passes | orders |
//! |---|---|---|---|---|
//! | [`Plain`] (`RadixCache`) | KV slots (in the core) | one | `evict` | evictable leaves |
//! | [`Mamba`](super::Mamba) (`MambaRadixCache`) | + an optional state slot | + a state lock on the lease's end node | `evict`, then `evict_mamba` (tombstones internal nodes) | + unlocked state holders |
//! | [`Swa`](super::Swa) (`SwaRadixCache`) | + whether the window KV is kept (a tombstone when not) | + a window lock on the last `window` tokens of the lease | `evict`, then `evict_swa` (tombstones internal nodes) | + unlocked window holders |
//!
//! The trait is sealed: the hooks see the core's internals, and the core's invariants
//! (a leaf is never a tombstone, every page has one owner) depend on them.

use core::fmt;

use super::writer::Writer;
use super::{CacheError, Lease, RadixCache, RawLease};
use crate::alloc::KvAllocator;
use crate::error::{AllocError, ConfigError, RowError};
use crate::req_to_token::{ReqRow, ReqToTokenPool};

pub(crate) mod sealed {
    /// Only kvpool's variants implement [`Variant`](super::Variant).
    pub trait Sealed {}
}

/// A kind of radix tree: what a node carries besides its KV pages (see the
/// module docs of `src/radix/variant.rs`). Sealed: its hooks see the core's internals, and the core's
/// invariants depend on them.
#[allow(private_interfaces)] // the hidden hooks take the core's crate-private lease types
pub trait Variant: sealed::Sealed + Sized + Send + Sync + 'static {
    /// What a node carries besides its pages (writer-only).
    #[doc(hidden)]
    type Node: Copy + Default + fmt::Debug + Send + Sync;
    /// The variant's writer-only state (its extra orders).
    #[doc(hidden)]
    type State: Send;
    /// What a match carries down the path to decide where it may end.
    #[doc(hidden)]
    type Walk: Copy + Default;
    /// Whether the core updates recency node by node as a match walks down (SGLang's
    /// `RadixCache`), or the variant refreshes only the returned path afterwards
    /// ([`touch_path`](Writer::touch_path), SGLang's `MambaRadixCache`).
    #[doc(hidden)]
    const TOUCH_WHILE_WALKING: bool = true;

    /// Pages of the variant's own past the allocator's, in the tree's page space (the
    /// host tier's pages): nodes may hold them as their pages, and the core sizes its
    /// arenas for them. The core never frees them (the variant does, in
    /// [`removing`](Self::removing) and its own passes).
    #[inline(always)]
    #[doc(hidden)]
    fn extra_pages(&self) -> usize {
        0
    }

    /// Whether a node carrying `node` is *resident*: its pages are the allocator's (KV
    /// a request can use). The core's sizes, resident child counts, eviction order and
    /// locks cover resident nodes only; a non-resident node (the host tier's host-only
    /// node) has only non-resident nodes below it, and the variant keeps it.
    #[inline(always)]
    #[doc(hidden)]
    fn resident(_node: &Self::Node) -> bool {
        true
    }

    /// Evict the unlocked resident leaf `x`, out of the eviction order already, for a
    /// shortfall of `need` tokens, freeing its pages into `group`; returns the tokens
    /// freed. The core removes it ([`Writer::evict_leaf`]); the host tier may keep it
    /// on host instead.
    #[inline(always)]
    #[doc(hidden)]
    fn evict_leaf<A: KvAllocator>(
        w: &mut Writer<'_, A, Self>,
        x: u32,
        need: usize,
        group: &mut crate::alloc::KvFreeGroup<'_>,
    ) -> usize {
        w.evict_leaf(x, need, group)
    }

    /// Insert `key -> slots` for a request helper, after the checks: the first
    /// `cached` tokens are resident in the tree (the request's slots there are
    /// duplicates), the other pages are claimed. Returns the node the key ends at.
    #[inline(always)]
    #[doc(hidden)]
    fn apply_insert<A: KvAllocator>(
        w: &mut Writer<'_, A, Self>,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
        cached: usize,
    ) -> u32 {
        w.apply_insert(namespace, key, slots, priority, cached)
    }

    /// The variant's state for a tree of `nodes` node records.
    #[doc(hidden)]
    fn new_state(&self, nodes: usize) -> Result<Self::State, ConfigError>;

    /// Whether a request's finish may first cache its prompt alone
    /// ([`RadixConfig::split_at_prompt`](super::RadixConfig)): its checkpoint caches
    /// exactly the tokens it is given.
    #[doc(hidden)]
    const SPLITS_AT_PROMPT: bool = false;

    /// What a [`Request`](super::Request) of this tree holds besides its row, its lock
    /// and its KV (the Mamba tree: its state slots).
    #[doc(hidden)]
    type Request: Default + fmt::Debug + Send + Sync;

    /// What a request's [`finish`](super::Request::finish) reports: the tokens that were
    /// cached already (and for the Mamba tree, what became of its state).
    type Finished: fmt::Debug;

    /// Admit a request: match `prompt` into `row` and lock it; what else the request
    /// takes. Undo everything on error.
    #[doc(hidden)]
    fn admit_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        prompt: &[u32],
        row: &mut ReqRow,
    ) -> Result<(RawLease, Self::Request), AllocError> {
        let lease = c.match_and_lock_row(namespace, prompt, row).map_err(|e: RowError| AllocError::Row(e))?;
        Ok((lease.detach(), Self::Request::default()))
    }

    /// Finish a request whose checks passed (its token count is its row's): cache it,
    /// free its duplicates and the rest of its KV, release its lock. Nothing changes on
    /// error.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn finish_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, Self>,
        priority: i64,
        req: &mut Self::Request,
    ) -> Result<Self::Finished, CacheError>;

    /// Cache a running request's `tokens` (at most its row's), move its lock to their
    /// end. Nothing changes on error.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn checkpoint_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Self>,
        priority: i64,
        req: &mut Self::Request,
    ) -> Result<(), CacheError>;

    /// Device tokens the variant holds allocated outside the tree and outside any
    /// request (the host tier: the pages a reset left to transfers still copying), for
    /// the accounting of `check_invariants`.
    #[doc(hidden)]
    fn held_apart<A: KvAllocator>(_w: &Writer<'_, A, Self>) -> usize {
        0
    }

    /// Give back what a finished or aborted request still holds besides its KV.
    #[doc(hidden)]
    fn release_request(&self, _req: &mut Self::Request) {}

    /// Whether a match may end at a node carrying `node` (the prefix up to there is
    /// usable). The match returns the deepest such node on the matched path.
    #[inline(always)]
    #[doc(hidden)]
    fn match_end(_node: &Self::Node) -> bool {
        true
    }

    /// A match entered a node carrying `node` and matched `tokens` of it: whether the
    /// match may end after them (the match returns the deepest such place).
    #[inline(always)]
    #[doc(hidden)]
    fn walk_step(&self, _walk: &mut Self::Walk, node: &Self::Node, _tokens: usize) -> bool {
        Self::match_end(node)
    }

    /// [`walk_step`](Self::walk_step) for a lock-free reader, which sees only the
    /// node's published mark (see [`Writer::set_mark`]).
    #[inline(always)]
    #[doc(hidden)]
    fn peek_step(&self, _walk: &mut Self::Walk, _mark: u32, _tokens: usize) -> bool {
        true
    }

    /// Whether a lease may still be taken at node `id` (for
    /// [`RadixCache::lock`] of an earlier match).
    #[inline(always)]
    #[doc(hidden)]
    fn lockable<A: KvAllocator>(w: &Writer<'_, A, Self>, id: u32) -> bool {
        Self::match_end(&w.s.meta[id as usize].ext)
    }

    /// Make room for `need` tokens before an allocation (the core evicts the shortfall
    /// of [`KvAllocator::available_size`]). Nothing is evicted for a shortfall larger
    /// than what is evictable: that allocation fails either way, and it must not take
    /// the cache with it (a failed call changes nothing).
    #[doc(hidden)]
    fn make_room<A: KvAllocator>(c: &RadixCache<A, Self>, need: usize) {
        let avail = c.alloc.available_size();
        if avail < need && need - avail <= c.evictable_size() {
            c.evict(need - avail);
        }
    }

    /// Whether a node carrying `node` must not be a leaf: when eviction leaves it
    /// childless and unlocked, the core removes it too.
    #[inline(always)]
    #[doc(hidden)]
    fn is_tombstone(_node: &Self::Node) -> bool {
        false
    }

    /// The payload of the upper half when a node carrying `lower` is split (the lower
    /// half keeps `lower`, which the hook may change).
    #[inline(always)]
    #[doc(hidden)]
    fn split_payload(lower: &mut Self::Node) -> Self::Node {
        *lower
    }

    /// Node `old` was replaced by `upper -> lower`; the metadata of both is set (the
    /// lower half carries `old`'s, with its payload), `old`'s is not cleared yet.
    #[inline(always)]
    #[doc(hidden)]
    fn split<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _old: u32, _upper: u32, _lower: u32) {}

    /// Node `id` leaves the tree (evicted or reset): release its payload. Its pages
    /// are freed by the core afterwards.
    #[inline(always)]
    #[doc(hidden)]
    fn removing<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32) {}

    /// A lease ending at node `id` is being taken (before the core's lock counts along
    /// the path change). Returns a datum the lease keeps for [`unlock_end`](Self::unlock_end).
    #[inline(always)]
    #[doc(hidden)]
    fn lock_end<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32) -> u64 {
        0
    }

    /// A lease ending at node `id`, taken with datum `aux`, is being released.
    #[inline(always)]
    #[doc(hidden)]
    fn unlock_end<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32, _aux: u64) {}

    /// Node `id`'s recency or frequency changed (its core order is updated already).
    #[inline(always)]
    #[doc(hidden)]
    fn touched<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32) {}

    /// The tree is about to be cleared: the device pages of its nodes that must stay
    /// allocated past the reset (a copy the caller started may still touch them), as a
    /// bit per allocator page (bit `p`, page `p`); empty for none. Those pages are the
    /// variant's to free afterwards.
    #[inline(always)]
    #[doc(hidden)]
    fn kept_at_reset<A: KvAllocator>(_w: &Writer<'_, A, Self>) -> Vec<u64> {
        Vec::new()
    }

    /// The tree was cleared (every node's payload went through [`removing`](Self::removing)).
    #[inline(always)]
    #[doc(hidden)]
    fn reset<A: KvAllocator>(_w: &mut Writer<'_, A, Self>) {}

    /// Check the variant's invariants (the core's hold already).
    #[doc(hidden)]
    fn check<A: KvAllocator>(_w: &Writer<'_, A, Self>) -> Result<(), String> {
        Ok(())
    }

    /// A short description of a node's payload for `pretty_print` (empty: nothing).
    #[doc(hidden)]
    fn describe(_node: &Self::Node, _out: &mut String) {}
}

/// The plain prefix cache: nodes carry KV slots only ([`RadixCache`](super::RadixCache)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plain;

impl sealed::Sealed for Plain {}

// The hooks take the core's crate-private lease types: the trait is sealed and its hooks hidden.
#[allow(private_interfaces)]
impl Variant for Plain {
    type Node = ();
    type State = ();
    type Walk = ();
    const SPLITS_AT_PROMPT: bool = true;
    type Request = ();
    type Finished = usize;

    fn new_state(&self, _nodes: usize) -> Result<(), ConfigError> {
        Ok(())
    }

    fn finish_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, Self>,
        priority: i64,
        _req: &mut (),
    ) -> Result<usize, CacheError> {
        c.finish_kv(rows, namespace, tokens, row, lease, priority)
    }

    fn checkpoint_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Self>,
        priority: i64,
        _req: &mut (),
    ) -> Result<(), CacheError> {
        c.checkpoint_kv(namespace, tokens, row, lease, priority)
    }
}
