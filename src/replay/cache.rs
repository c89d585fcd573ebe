//! [`ReplayCache`]: the request lifecycle the replay drivers run through a prefix cache,
//! so one loop can drive kvpool's concurrent [`RadixCache`](crate::radix) and the
//! simple [`ReferenceRadixCache`] alike and their results can be compared.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::baseline::{RefNodeId, ReferenceRadixCache};
use crate::error::{AllocError, FreeError, InvalidInput, InvariantViolation, RowError};
use crate::radix::{EvictionPolicy, RadixCache, Request, Variant};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::KvAllocator;

use super::ReplayError;

/// What a request admitted to a [`ReplayCache`] holds: its row, its lock on the prefix
/// it matched, and the KV slots written into the row.
///
/// kvpool's caches admit a [`Request`]; the baselines a [`BaselineRequest`]. A decode
/// batch is anything that lends requests ([`AsMut`]): the requests themselves, `&mut`
/// requests, or a driver's own records holding one.
pub trait ReplayRequest: Send + AsMut<Self> {
    /// Tokens whose KV slots the request's row holds: the cached prefix and everything
    /// allocated since. A finish takes exactly this many tokens.
    fn len(&self) -> usize;
    /// Whether the row holds no slot yet.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens of the prefix the request locked at admission (its hit).
    fn cached_len(&self) -> usize;
}

/// kvpool's request handle, on any of its trees.
impl<A: KvAllocator, V: Variant> ReplayRequest for Request<A, V> {
    fn len(&self) -> usize {
        Request::len(self)
    }
    fn cached_len(&self) -> usize {
        Request::cached_len(self)
    }
}

/// A prefix cache with its KV allocator and request rows, driven as an inference
/// engine's scheduler drives it: requests are admitted (a row, the longest cached
/// prefix of the prompt, locked), extended by their prefill, decoded a slot at a time
/// in batches, and finished (their KV cached) or aborted (everything given back).
///
/// Every method takes `&self`: the overlap driver calls them from a scheduler thread,
/// an output thread and router threads at once. A [`Request`](Self::Request) moves
/// from the scheduler to the output thread when its KV is complete.
///
/// The drivers evict the shortfall of every allocation themselves, and count it, before
/// they allocate ([`evict`](Self::evict)): an allocation then finds the room it needs.
///
/// # Examples
///
/// Driving the reference cache by hand, as the sequential loop does:
///
/// ```
/// use kvpool::replay::{ReferenceCache, ReplayCache, ReplayRequest};
/// use kvpool::radix::EvictionPolicy;
///
/// let cache = ReferenceCache::new(64, 4, EvictionPolicy::Lru, 1, 32)?;
/// let prompt: Vec<u32> = (100..109).collect();
/// let mut req = cache.admit(0, &prompt)?;
/// assert_eq!(req.cached_len(), 0);
/// cache.extend(&mut req, prompt.len())?;      // the prefill
/// let mut slot = [0u32];
/// cache.decode(&mut [&mut req], &mut slot)?;  // the first output token's KV
/// assert_eq!(req.len(), 10);
/// // Finishing caches the 8 page-aligned tokens and frees the 2-token tail.
/// let kv_tokens: Vec<u32> = prompt.iter().copied().chain([7]).collect();
/// assert_eq!(cache.finish(req, &kv_tokens)?, 0);
/// assert_eq!(cache.cached_tokens(), 8);
/// assert_eq!(cache.available_tokens(), 64 - 8);
///
/// let again = cache.admit(0, &prompt)?;
/// assert_eq!(again.cached_len(), 8);
/// cache.abort(again);                          // the lock and the row go back
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait ReplayCache: Sync {
    /// A request admitted to this cache.
    type Request: ReplayRequest;

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
    /// Admit a request: take a row, match `prompt`'s longest cached page-aligned prefix
    /// in `namespace` into it and lock that prefix (a two-tier cache also loads its host
    /// continuation back). The request's [`len`](ReplayRequest::len) and
    /// [`cached_len`](ReplayRequest::cached_len) are the matched tokens.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when no row (the Mamba tree: no state) is free;
    /// [`AllocError::Row`] when `prompt` is longer than a row. Nothing changes then.
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError>;
    /// Allocate the KV of the request's next `n` tokens (a prefill) into its row,
    /// continuing its last page.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when the pool has too little room;
    /// [`AllocError::Row`] when the row has no room for `n` more tokens. Nothing
    /// changes then.
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError>;
    /// One KV slot for every request of a decode batch: `out[i]` gets request `i`'s
    /// slot for its token at position `len()`, continuing its last page, and its row
    /// gets it too.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when the pool has too little room;
    /// [`AllocError::Invalid`] when `out` and the batch differ in length;
    /// [`AllocError::Row`] for a full row. Nothing changes then.
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError>;
    /// Finish a request: `kv_tokens` are the tokens whose KV its row holds
    /// ([`len`](ReplayRequest::len) of them). Caches the page-aligned part, frees
    /// duplicates and the rest, gives the lock and the row back. Returns how many
    /// leading tokens were already cached.
    ///
    /// # Errors
    ///
    /// [`ReplayError::Internal`] when the cache refuses (a bug in the cache or the
    /// driver); the request is aborted then.
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError>;
    /// Give everything the request holds back and cache nothing (a rejected or
    /// retracted request).
    fn abort(&self, req: Self::Request);
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

/// A request admitted to one of the baseline caches ([`ReferenceCache`],
/// [`VecTrieReplayCache`](super::VecTrieReplayCache)): its row, its lease on the
/// matched prefix (`L`), and how many positions of the row hold its slots.
///
/// It is given back through the cache that admitted it
/// ([`finish`](ReplayCache::finish) or [`abort`](ReplayCache::abort)); dropped
/// otherwise, its row, slots and lock stay taken.
#[derive(Debug)]
#[must_use = "a request holds its row, its slots and its lock until it is finished or aborted"]
pub struct BaselineRequest<L> {
    pub(super) row: ReqRow,
    namespace: u64,
    lease: L,
    /// Tokens matched and locked at admission.
    cached: usize,
    /// Row positions written.
    pub(super) len: usize,
}

impl<L: Send> ReplayRequest for BaselineRequest<L> {
    fn len(&self) -> usize {
        self.len
    }
    fn cached_len(&self) -> usize {
        self.cached
    }
}

impl<L> AsMut<BaselineRequest<L>> for BaselineRequest<L> {
    fn as_mut(&mut self) -> &mut Self {
        self
    }
}

/// The request rows of a baseline cache and the request steps the baselines share:
/// the row is filled by the baseline's own allocator calls.
#[derive(Debug)]
pub(crate) struct Rows {
    pool: ReqToTokenPool,
    /// A decode batch's sequence lengths and last slots, reused from call to call.
    batch: Mutex<(Vec<u32>, Vec<u32>)>,
}

impl Rows {
    pub(crate) fn new(pool: ReqToTokenPool) -> Rows {
        Rows { pool, batch: Mutex::new((Vec::new(), Vec::new())) }
    }

    pub(crate) fn pool(&self) -> &ReqToTokenPool {
        &self.pool
    }

    /// Take a row and run `lock_match(prompt, out)`, `out` the row's first
    /// `prompt.len()` positions, which returns the hit and its lease.
    pub(crate) fn admit<L>(
        &self,
        namespace: u64,
        prompt: &[u32],
        lock_match: impl FnOnce(&[u32], &mut [u32]) -> (usize, L),
    ) -> Result<BaselineRequest<L>, AllocError> {
        let max_context_len = self.pool.max_context_len();
        if prompt.len() > max_context_len {
            let (row, start, len) = (u32::MAX, 0, prompt.len());
            return Err(AllocError::Row(RowError::OutOfBounds { row, start, len, max_context_len }));
        }
        let mut row = self.pool.alloc()?;
        let out = match self.pool.read_mut(&mut row, 0..prompt.len()) {
            Ok(out) => out,
            Err(e) => {
                let _ = self.pool.free(row);
                return Err(e.into());
            }
        };
        let (hit, lease) = lock_match(prompt, out);
        Ok(BaselineRequest { row, namespace, lease, cached: hit, len: hit })
    }

    /// Positions `len..len + n` of the request's row from `alloc_extend(prefix_lens,
    /// seq_lens, last_locs, out)` for the one request.
    pub(crate) fn extend<L>(
        &self,
        req: &mut BaselineRequest<L>,
        n: usize,
        alloc_extend: impl FnOnce(&[u32], &[u32], &[u32], &mut [u32]) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        let (from, max_context_len) = (req.len, self.pool.max_context_len());
        let Some(to) = from.checked_add(n).filter(|&to| to <= max_context_len) else {
            let row = req.row.index() as u32;
            return Err(AllocError::Row(RowError::OutOfBounds { row, start: from, len: n, max_context_len }));
        };
        if n == 0 {
            return Ok(());
        }
        self.pool.fill_extension(&mut req.row, from, to, |prefix, seq, last_loc, out, _| {
            alloc_extend(&[prefix], &[seq], &[last_loc], out).map(|()| false)
        })?;
        req.len = to;
        Ok(())
    }

    /// One slot for every request of `batch` from `alloc_decode(seq_lens, last_locs,
    /// out)`, written into their rows.
    pub(crate) fn decode<L, R: AsMut<BaselineRequest<L>>>(
        &self,
        batch: &mut [R],
        out: &mut [u32],
        alloc_decode: impl FnOnce(&[u32], &[u32], &mut [u32]) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        if out.len() != batch.len() {
            let (what, got, expected) = ("decode output slots", out.len(), batch.len());
            return Err(InvalidInput::LengthMismatch { what, got, expected }.into());
        }
        let max_context_len = self.pool.max_context_len();
        let mut guard = self.batch.lock().unwrap_or_else(PoisonError::into_inner);
        let (seq_lens, last_locs) = &mut *guard;
        seq_lens.clear();
        last_locs.clear();
        for r in batch.iter_mut() {
            let r = r.as_mut();
            if r.len >= max_context_len || r.len >= u32::MAX as usize {
                let (row, start) = (r.row.index() as u32, r.len);
                return Err(AllocError::Row(RowError::OutOfBounds { row, start, len: 1, max_context_len }));
            }
            seq_lens.push(r.len as u32 + 1);
            last_locs.push(match r.len.checked_sub(1) {
                Some(p) => self.pool.read(&r.row, p..r.len)?[0],
                None => 0,
            });
        }
        alloc_decode(seq_lens, last_locs, out)?;
        drop(guard);
        for (r, &slot) in batch.iter_mut().zip(out.iter()) {
            let r = r.as_mut();
            let wrote = self.pool.write(&mut r.row, r.len, &[slot]);
            debug_assert!(wrote.is_ok(), "a checked decode position failed to write: {wrote:?}");
            r.len += 1;
        }
        Ok(())
    }

    /// Free the request's own slots (past its lease) with `free`, and its row; returns
    /// the lease, for the caller to unlock.
    pub(crate) fn release<L>(&self, req: BaselineRequest<L>, free: impl FnOnce(&[u32]) -> Result<(), FreeError>) -> L {
        let BaselineRequest { row, lease, cached, len, .. } = req;
        if len > cached {
            if let Ok(own) = self.pool.read(&row, cached..len) {
                let freed = free(own);
                debug_assert!(freed.is_ok(), "a request's own slots failed to free: {freed:?}");
            }
        }
        let freed = self.pool.free(row);
        debug_assert!(freed.is_ok(), "a request's row failed to free");
        lease
    }

    /// The finish of a request whose KV tokens are `kv_tokens`: checks their count,
    /// runs `cache(namespace, kv_tokens, kv_slots, lease)` (which caches them and frees
    /// the rest of the slots), then frees the row. A request with another count is
    /// aborted with `abort`.
    pub(crate) fn finish<L>(
        &self,
        req: BaselineRequest<L>,
        kv_tokens: &[u32],
        cache: impl FnOnce(u64, &[u32], &[u32], L) -> Result<usize, ReplayError>,
        abort: impl FnOnce(BaselineRequest<L>),
    ) -> Result<usize, ReplayError> {
        if kv_tokens.len() != req.len {
            let e = format!("{} tokens for a request holding {}", kv_tokens.len(), req.len);
            abort(req);
            return Err(ReplayError::internal("finish", e));
        }
        let BaselineRequest { row, namespace, lease, len, .. } = req;
        let kv = self.pool.read(&row, 0..len).map_err(|e| ReplayError::internal("read row", e))?;
        let prefix = cache(namespace, kv_tokens, kv, lease)?;
        self.pool.free(row).map_err(|e| ReplayError::internal("free row", e))?;
        Ok(prefix)
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
    rows: Rows,
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
        Ok(ReferenceCache { tree, rows: Rows::new(req_pool), page_size, capacity })
    }

    fn tree(&self) -> MutexGuard<'_, ReferenceRadixCache<A>> {
        // A panic while holding the lock would already have failed the replay; the
        // tree itself is only ever left consistent between calls.
        self.tree.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<A: KvAllocator> ReplayCache for ReferenceCache<A> {
    type Request = BaselineRequest<RefLease>;

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
        self.rows.pool()
    }
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError> {
        self.rows.admit(namespace, prompt, |key, out| {
            let mut t = self.tree();
            let (slots, node) = t.match_prefix(namespace, key);
            t.inc_lock_ref(node);
            out[..slots.len()].copy_from_slice(&slots);
            (slots.len(), RefLease { node, len: slots.len() })
        })
    }
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError> {
        self.rows.extend(req, n, |p, s, l, out| self.tree().allocator().alloc_extend(p, s, l, out))
    }
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        self.rows.decode(batch, out, |s, l, out| self.tree().allocator().alloc_decode(s, l, out))
    }
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        let cache = |namespace, tokens: &[u32], kv: &[u32], lease: RefLease| {
            Ok(self.tree().cache_finished_req(namespace, tokens, kv, lease.len, lease.node, 0))
        };
        self.rows.finish(req, kv_tokens, cache, |req| self.abort(req))
    }
    fn abort(&self, req: Self::Request) {
        let lease = self.rows.release(req, |own| self.tree().allocator().free(own));
        self.tree().dec_lock_ref(lease.node);
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

/// kvpool's concurrent [`RadixCache`], driven through its [`Request`] handles (which
/// need the cache in an [`Arc`]): lookups are lock-free, changes go through its writer
/// latch, allocation through the lock-free allocator.
impl<A: KvAllocator> ReplayCache for Arc<RadixCache<A>> {
    type Request = Request<A>;

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
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Request<A>, AllocError> {
        RadixCache::admit(self, namespace, prompt)
    }
    fn extend(&self, req: &mut Request<A>, n: usize) -> Result<(), AllocError> {
        req.extend(n)
    }
    fn decode<R: AsMut<Request<A>>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        RadixCache::decode(self, batch, out)
    }
    fn finish(&self, req: Request<A>, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        req.finish(kv_tokens).map_err(|refused| ReplayError::internal("finish", refused))
    }
    fn abort(&self, req: Request<A>) {
        req.abort();
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

    /// A baseline request refused at its finish (a token count that is not its own)
    /// is aborted: nothing stays taken.
    #[test]
    fn a_refused_finish_gives_everything_back() {
        let cache = ReferenceCache::new(64, 4, EvictionPolicy::Lru, 1, 16).unwrap();
        let tokens: Vec<u32> = (0..9).collect();
        let mut req = cache.admit(0, &tokens).unwrap();
        cache.extend(&mut req, 9).unwrap();
        assert!(matches!(cache.finish(req, &tokens[..8]), Err(ReplayError::Internal(_))));
        assert_eq!((cache.available_tokens(), cache.req_pool().available_size()), (64, 1));
        cache.check_invariants().unwrap();
    }
}
