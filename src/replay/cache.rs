//! [`ReplayCache`]: what the replay drivers need from a prefix cache, so one loop can
//! drive kvpool's concurrent [`RadixCache`](crate::radix) and the simple
//! [`ReferenceRadixCache`] alike and their results can be compared.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::baseline::{RefNodeId, ReferenceRadixCache};
use crate::error::{AllocError, FreeError, InvariantViolation, RowError};
use crate::radix::{EvictionPolicy, Lease, RadixCache};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::KvAllocator;

use super::ReplayError;

/// A prefix cache with its KV allocator and request rows, as the replay drives it.
///
/// Every method takes `&self`: the overlap driver calls them from a scheduler thread,
/// an output thread and router threads at once. A [`Lease`](Self::Lease) is the lock a
/// matched prefix holds against eviction; it moves from the scheduler to the output
/// thread with its request.
///
/// # Examples
///
/// Driving the reference cache by hand, as the sequential loop does:
///
/// ```
/// use kvpool::replay::{ReferenceCache, ReplayCache};
/// use kvpool::radix::EvictionPolicy;
///
/// let cache = ReferenceCache::new(64, 4, EvictionPolicy::Lru, 1, 32)?;
/// let tokens: Vec<u32> = (100..110).collect();
/// let mut slots = vec![0u32; 10];
/// let (hit, lease) = cache.match_and_lock(0, &tokens, &mut slots);
/// assert_eq!(hit, 0);
/// let mut row = cache.req_pool().alloc()?;
/// cache.alloc_extend(&[0], &[10], &[0], &mut slots)?;
/// cache.req_pool().write(&mut row, 0, &slots)?;
/// // Finishing caches the 8 page-aligned tokens and frees the 2-token tail.
/// cache.cache_finished_req(0, &tokens, row, lease)?;
/// assert_eq!(cache.cached_tokens(), 8);
/// assert_eq!(cache.available_tokens(), 64 - 8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait ReplayCache: Sync {
    /// A locked match: the prefix stays cached until the lease is given back through
    /// [`unlock`](Self::unlock) or [`cache_finished_req`](Self::cache_finished_req).
    type Lease<'a>: Send
    where
        Self: 'a;

    /// A short name for reports (`kvpool`, `reference`).
    fn name(&self) -> &'static str;
    /// Tokens per page.
    fn page_size(&self) -> u32;
    /// Token capacity of the KV pool.
    fn capacity_tokens(&self) -> usize;
    /// Free KV tokens now.
    fn available_tokens(&self) -> usize;
    /// Cached tokens that eviction could free now.
    fn evictable_tokens(&self) -> usize;
    /// Tokens in the cache.
    fn cached_tokens(&self) -> usize;
    /// The request rows.
    fn req_pool(&self) -> &ReqToTokenPool;
    /// Match `key`'s longest cached page-aligned prefix, write its slots into
    /// `out[..hit]` and lock it; returns `hit` and the lease.
    fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> (usize, Self::Lease<'_>);
    /// [`match_and_lock`](Self::match_and_lock) writing the matched slots straight into
    /// positions `0..hit` of `row` (the key cut to the row's length; see
    /// [`RadixCache::match_and_lock_row`]). Every cache gets the copy-free match;
    /// kvpool's also skips comparing those positions with the tree when the request is
    /// cached.
    ///
    /// # Errors
    ///
    /// [`RowError`] for another pool's row; nothing is matched then.
    fn match_and_lock_row(
        &self,
        namespace: u64,
        key: &[u32],
        row: &mut ReqRow,
    ) -> Result<(usize, Self::Lease<'_>), RowError> {
        let n = key.len().min(self.req_pool().max_context_len());
        let out = self.req_pool().read_mut(row, 0..n)?;
        Ok(self.match_and_lock(namespace, &key[..n], out))
    }
    /// Match without locking (a router's look-up); returns the hit length.
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize;
    /// [`peek_prefix`](Self::peek_prefix), telling the cache the prefix is wanted by
    /// the `position`-th admission from now (kvpool's
    /// [`RadixCache::hint_prefix`]); caches without hints just look up.
    fn hint_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32], position: u32) -> usize {
        let _ = position;
        self.peek_prefix(namespace, key, out)
    }
    /// Evict at least `num_tokens` unlocked tokens if there are that many; returns the
    /// tokens freed.
    fn evict(&self, num_tokens: usize) -> usize;
    /// The allocator's `alloc_extend` (see [`KvAllocator::alloc_extend`]).
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing changes on error.
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError>;
    /// [`alloc_extend`](Self::alloc_extend) for one request, straight into its row:
    /// positions `prefix_len..seq_len` of `row` get the new slots, and `last_loc` is the
    /// row's slot at `prefix_len - 1` (see [`RadixCache::alloc_extend_row`]). Every
    /// cache gets the same copy-free fill; kvpool's also skips re-reading the
    /// expansion's pages slot by slot when the request is cached.
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing is allocated on error.
    fn alloc_extend_row(&self, row: &mut ReqRow, prefix_len: usize, seq_len: usize) -> Result<(), AllocError> {
        self.req_pool().fill_extension(row, prefix_len, seq_len, |prefix, seq, last_loc, out, _| {
            self.alloc_extend(&[prefix], &[seq], &[last_loc], out).map(|()| false)
        })
    }
    /// The allocator's `alloc_decode` (see [`KvAllocator::alloc_decode`]).
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing changes on error.
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError>;
    /// Free KV slots the caller holds.
    ///
    /// # Errors
    ///
    /// [`FreeError`] for a slot that is not allocated.
    fn free(&self, slots: &[u32]) -> Result<(), FreeError>;
    /// Give a lease back without caching anything (a rejected or retracted request).
    fn unlock(&self, lease: Self::Lease<'_>);
    /// Finish a request: `token_ids` are its KV tokens and the row holds their slots.
    /// Caches the page-aligned part, frees duplicates and the unaligned tail, gives
    /// the lease and the row back. Returns how many leading tokens were already cached.
    ///
    /// # Errors
    ///
    /// [`ReplayError::Internal`] when the cache refuses (a bug in the cache or driver).
    fn cache_finished_req<'a>(
        &'a self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Self::Lease<'a>,
    ) -> Result<usize, ReplayError>;
    /// The cache's own consistency check (exact when nothing is in flight).
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] describing the first inconsistency.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;
    /// Tokens that entered and left the cache outside the driver's calls: loaded back
    /// from a lower tier, and evicted by the cache itself to make room for such loads.
    /// `(0, 0)` for a single-tier cache. The end-of-run accounting counts them.
    #[doc(hidden)]
    fn tier_flows(&self) -> (u64, u64) {
        (0, 0)
    }
    /// A lower tier's tokens held and the tokens loaded back from it so far, for the
    /// timeline. `(0, 0)` for a single-tier cache.
    #[doc(hidden)]
    fn tier_occupancy(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// [`ReferenceRadixCache`] behind a [`Mutex`]: the straightforward way to share a
/// single-threaded tree, and the baseline the replay compares kvpool against.
///
/// Every call takes the mutex (uncontended in sequential mode). Router look-ups go
/// through the reference's `match_prefix`, which, like SGLang's, may split a node and
/// refreshes recency (kvpool's [`RadixCache::peek_prefix`] does neither).
#[derive(Debug)]
pub struct ReferenceCache<A: KvAllocator = crate::PagedAllocator> {
    tree: Mutex<ReferenceRadixCache<A>>,
    req_pool: ReqToTokenPool,
    page_size: u32,
    capacity: usize,
}

/// The lease of a [`ReferenceCache`] match: the locked node.
#[derive(Debug)]
#[must_use = "a lease keeps its prefix locked until it is given back"]
pub struct RefLease {
    node: RefNodeId,
    /// Tokens matched (and locked): SGLang's `cache_protected_len`.
    len: usize,
}

impl ReferenceCache<crate::PagedAllocator> {
    /// A reference cache over a fresh [`PagedAllocator`](crate::PagedAllocator) of
    /// `capacity_tokens` in pages of `page_size`, with `rows` request rows of
    /// `max_context_len` slots.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::{ReferenceCache, ReplayCache};
    /// let cache = ReferenceCache::new(1024, 16, kvpool::radix::EvictionPolicy::Lru, 2, 100)?;
    /// assert_eq!((cache.capacity_tokens(), cache.page_size()), (1024, 16));
    /// # Ok::<(), kvpool::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError`](crate::ConfigError) from the allocator or the row pool
    /// (including [`TooLargeForMemory`](crate::ConfigError::TooLargeForMemory)).
    pub fn new(
        capacity_tokens: usize,
        page_size: u32,
        policy: EvictionPolicy,
        rows: u32,
        max_context_len: usize,
    ) -> Result<Self, crate::ConfigError> {
        let alloc = crate::PagedAllocator::new(capacity_tokens, page_size)?;
        let req_pool = ReqToTokenPool::new(rows, max_context_len)?;
        ReferenceCache::with_allocator(alloc, req_pool, policy)
    }
}

impl<A: KvAllocator> ReferenceCache<A> {
    /// A reference cache over `alloc` and `req_pool`.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::{ReferenceCache, ReplayCache};
    /// use kvpool::{ReqToTokenPool, TokenAllocator};
    /// let cache = ReferenceCache::with_allocator(
    ///     TokenAllocator::new(100)?,
    ///     ReqToTokenPool::new(1, 10)?,
    ///     kvpool::radix::EvictionPolicy::Fifo,
    /// )?;
    /// assert_eq!(cache.available_tokens(), 100);
    /// # Ok::<(), kvpool::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`](crate::ConfigError::ZeroPageSize) if the
    /// allocator's page size is 0 (see [`ReferenceRadixCache::new`]).
    pub fn with_allocator(
        alloc: A,
        req_pool: ReqToTokenPool,
        policy: EvictionPolicy,
    ) -> Result<Self, crate::ConfigError> {
        let page_size = alloc.page_size();
        let capacity = alloc.size();
        let tree = Mutex::new(ReferenceRadixCache::new(alloc, policy)?);
        Ok(ReferenceCache { tree, req_pool, page_size, capacity })
    }

    fn tree(&self) -> MutexGuard<'_, ReferenceRadixCache<A>> {
        // A panic while holding the lock would already have failed the replay; the
        // tree itself is only ever left consistent between calls.
        self.tree.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<A: KvAllocator> ReplayCache for ReferenceCache<A> {
    type Lease<'a>
        = RefLease
    where
        Self: 'a;

    fn name(&self) -> &'static str {
        "reference"
    }
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn capacity_tokens(&self) -> usize {
        self.capacity
    }
    fn available_tokens(&self) -> usize {
        self.tree().allocator().available_size()
    }
    fn evictable_tokens(&self) -> usize {
        self.tree().evictable_size()
    }
    fn cached_tokens(&self) -> usize {
        let t = self.tree();
        t.evictable_size() + t.protected_size()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        &self.req_pool
    }
    fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> (usize, RefLease) {
        let mut t = self.tree();
        let (slots, node) = t.match_prefix(namespace, key);
        t.inc_lock_ref(node);
        out[..slots.len()].copy_from_slice(&slots);
        (slots.len(), RefLease { node, len: slots.len() })
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        // The reference has no read-only look-up: this refreshes recency (and may
        // split), as SGLang's `match_prefix` does.
        let (slots, _) = self.tree().match_prefix(namespace, key);
        out[..slots.len()].copy_from_slice(&slots);
        slots.len()
    }
    fn evict(&self, num_tokens: usize) -> usize {
        self.tree().evict(num_tokens)
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        self.tree().allocator().alloc_extend(prefix_lens, seq_lens, last_locs, out)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.tree().allocator().alloc_decode(seq_lens, last_locs, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.tree().allocator().free(slots)
    }
    fn unlock(&self, lease: RefLease) {
        self.tree().dec_lock_ref(lease.node);
    }
    fn cache_finished_req(
        &self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: RefLease,
    ) -> Result<usize, ReplayError> {
        let kv = self.req_pool.read(&row, 0..token_ids.len()).map_err(|e| ReplayError::internal("read row", e))?;
        let mut t = self.tree();
        let prefix = t.cache_finished_req(namespace, token_ids, kv, lease.len, lease.node, 0);
        drop(t);
        self.req_pool.free(row).map_err(|e| ReplayError::internal("free row", e))?;
        Ok(prefix)
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let t = self.tree();
        t.allocator().check_invariants()?;
        let total = t.total_size();
        if t.evictable_size() + t.protected_size() != total {
            return Err(InvariantViolation(format!(
                "reference cache: evictable {} + protected {} != total {total}",
                t.evictable_size(),
                t.protected_size()
            )));
        }
        Ok(())
    }
}

/// kvpool's concurrent [`RadixCache`]: lookups are lock-free, changes go through its
/// writer latch, allocation through the lock-free allocator.
impl<A: KvAllocator> ReplayCache for RadixCache<A> {
    type Lease<'a>
        = Lease<'a, A>
    where
        Self: 'a;

    fn name(&self) -> &'static str {
        "kvpool"
    }
    fn page_size(&self) -> u32 {
        RadixCache::page_size(self) as u32
    }
    fn capacity_tokens(&self) -> usize {
        self.allocator().size()
    }
    fn available_tokens(&self) -> usize {
        self.allocator().available_size()
    }
    fn evictable_tokens(&self) -> usize {
        self.evictable_size()
    }
    fn cached_tokens(&self) -> usize {
        self.total_size()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        RadixCache::req_pool(self)
    }
    fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> (usize, Lease<'_, A>) {
        let lease = RadixCache::match_and_lock(self, namespace, key, out);
        (lease.len(), lease)
    }
    fn match_and_lock_row(
        &self,
        namespace: u64,
        key: &[u32],
        row: &mut ReqRow,
    ) -> Result<(usize, Lease<'_, A>), RowError> {
        let lease = RadixCache::match_and_lock_row(self, namespace, key, row)?;
        Ok((lease.len(), lease))
    }
    fn alloc_extend_row(&self, row: &mut ReqRow, prefix_len: usize, seq_len: usize) -> Result<(), AllocError> {
        // As `alloc_extend` below (the plain allocator, no uncounted eviction), through
        // the call that reports the runs, so the finish need not search the row for them.
        self.req_pool().fill_extension(row, prefix_len, seq_len, |prefix, seq, last_loc, out, breaks| {
            self.raw_allocator().alloc_extend_runs(prefix, seq, last_loc, out, breaks)
        })
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        RadixCache::peek_prefix(self, namespace, key, out)
    }
    fn hint_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32], position: u32) -> usize {
        RadixCache::hint_prefix(self, namespace, key, out, position)
    }
    fn evict(&self, num_tokens: usize) -> usize {
        RadixCache::evict(self, num_tokens)
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        // The drivers evict explicitly (and count it) before allocating: use the plain
        // allocator, as the reference does, so no eviction happens uncounted.
        self.allocator().alloc_extend(prefix_lens, seq_lens, last_locs, out)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.allocator().alloc_decode(seq_lens, last_locs, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.allocator().free(slots)
    }
    fn unlock(&self, lease: Lease<'_, A>) {
        drop(lease);
    }
    fn cache_finished_req<'a>(
        &'a self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Lease<'a, A>,
    ) -> Result<usize, ReplayError> {
        RadixCache::<A>::cache_finished_req(self, namespace, token_ids, row, lease, 0)
            .map_err(|u| ReplayError::internal("cache_finished_req", u))
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        RadixCache::check_invariants(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ConfigError;
    use crate::TokenAllocator;

    #[test]
    fn zero_page_size_allocator_is_a_config_error() {
        let alloc = crate::alloc::Geometry(TokenAllocator::new(64).unwrap(), 0, 64);
        let rows = ReqToTokenPool::new(1, 8).unwrap();
        let e = ReferenceCache::with_allocator(alloc, rows, EvictionPolicy::Lru).unwrap_err();
        assert_eq!(e, ConfigError::ZeroPageSize);
    }
}
