//! [`VecTrieReplayCache`]: the TGI-style [`VecTrieCache`] behind a mutex, with request
//! rows, as the replay drivers need it.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::baseline::vec_trie::{VecTrieCache, VecTrieNode};
use crate::error::{AllocError, FreeError, InvariantViolation};
use crate::req_to_token::{ReqRow, ReqToTokenPool};

use super::{ReplayCache, ReplayError};

/// [`VecTrieCache`] (trie, leaf LRU and `Vec` free list of pages) behind a [`Mutex`],
/// with its request rows: the second baseline the replay compares kvpool against.
///
/// Every call takes the mutex. The trie works in pages: a match's pages are expanded
/// into slots (`page * page_size + k`), and a finished request's row is read back as
/// the first slot of each whole page. Router look-ups use the read-only
/// [`VecTrieCache::peek_prefix`]. Eviction trims leaves, freeing exactly the pages
/// asked for, so hit counts may differ slightly from the SGLang-style caches.
///
/// # Examples
///
/// ```
/// use kvpool::replay::{ReplayCache, VecTrieReplayCache};
///
/// let cache = VecTrieReplayCache::new(64, 4, 1, 32)?;
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
/// let (hit, lease) = cache.match_and_lock(0, &tokens, &mut slots);
/// assert_eq!((hit, &slots[..8]), (8, &[4, 5, 6, 7, 8, 9, 10, 11][..]));
/// cache.unlock(lease);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct VecTrieReplayCache {
    inner: Mutex<Inner>,
    req_pool: ReqToTokenPool,
    page_size: u32,
    capacity: usize,
}

#[derive(Debug)]
struct Inner {
    trie: VecTrieCache,
    /// Scratch: the pages of a match, or of a finished request.
    pages: Vec<u32>,
}

/// The lease of a [`VecTrieReplayCache`] match: the locked node.
#[derive(Debug)]
#[must_use = "a lease keeps its prefix locked until it is given back"]
pub struct VecTrieLease {
    node: VecTrieNode,
    /// Tokens matched (and locked): the request's cached prefix.
    len: usize,
}

impl VecTrieReplayCache {
    /// A cache of `capacity_tokens` in pages of `page_size`, with `rows` request rows
    /// of `max_context_len` slots.
    ///
    /// # Errors
    ///
    /// [`ConfigError`](crate::ConfigError) from the cache or the row pool.
    pub fn new(
        capacity_tokens: usize,
        page_size: u32,
        rows: u32,
        max_context_len: usize,
    ) -> Result<Self, crate::ConfigError> {
        let trie = VecTrieCache::new(capacity_tokens, page_size)?;
        let req_pool = ReqToTokenPool::new(rows, max_context_len)?;
        let capacity = trie.num_pages() as usize * page_size as usize;
        Ok(VecTrieReplayCache { inner: Mutex::new(Inner { trie, pages: Vec::new() }), req_pool, page_size, capacity })
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // The trie is left consistent between calls; a panic elsewhere already failed
        // the replay.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Write the slots of `pages` into `out`.
    fn expand(&self, pages: &[u32], out: &mut [u32]) {
        let ps = self.page_size as usize;
        for (chunk, &p) in out.chunks_exact_mut(ps).zip(pages) {
            for (k, s) in chunk.iter_mut().enumerate() {
                *s = p * self.page_size + k as u32;
            }
        }
    }
}

impl ReplayCache for VecTrieReplayCache {
    type Lease<'a>
        = VecTrieLease
    where
        Self: 'a;

    fn name(&self) -> &'static str {
        "vectrie"
    }
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn capacity_tokens(&self) -> usize {
        self.capacity
    }
    fn available_tokens(&self) -> usize {
        self.inner().trie.available_pages() * self.page_size as usize
    }
    fn evictable_tokens(&self) -> usize {
        self.inner().trie.evictable_tokens()
    }
    fn cached_tokens(&self) -> usize {
        self.inner().trie.cached_tokens()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        &self.req_pool
    }
    fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> (usize, VecTrieLease) {
        let mut g = self.inner();
        let Inner { trie, pages } = &mut *g;
        pages.clear();
        let m = trie.match_prefix(namespace, key, pages);
        // A handle fresh from a match is live: locking it cannot fail. Should it, the
        // request goes on without a cached prefix.
        if trie.lock(m.node).is_err() {
            return (0, VecTrieLease { node: VecTrieNode::EMPTY, len: 0 });
        }
        self.expand(pages, &mut out[..m.len]);
        (m.len, VecTrieLease { node: m.node, len: m.len })
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        let mut g = self.inner();
        let Inner { trie, pages } = &mut *g;
        pages.clear();
        let len = trie.peek_prefix(namespace, key, pages);
        self.expand(pages, &mut out[..len]);
        len
    }
    fn evict(&self, num_tokens: usize) -> usize {
        let ps = self.page_size as usize;
        self.inner().trie.evict(num_tokens.div_ceil(ps)) * ps
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        self.inner().trie.alloc_extend(prefix_lens, seq_lens, last_locs, out)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.inner().trie.alloc_decode(seq_lens, last_locs, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.inner().trie.free_slots(slots)
    }
    fn unlock(&self, lease: VecTrieLease) {
        // The lease's node is locked, so it cannot have been evicted: this cannot fail.
        let _ = self.inner().trie.unlock(lease.node);
    }
    fn cache_finished_req(
        &self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: VecTrieLease,
    ) -> Result<usize, ReplayError> {
        let ps = self.page_size;
        let kv = self.req_pool.read(&row, 0..token_ids.len()).map_err(|e| ReplayError::internal("read row", e))?;
        let aligned = token_ids.len() / ps as usize * ps as usize;
        let mut g = self.inner();
        let Inner { trie, pages } = &mut *g;
        pages.clear();
        for &first in kv[..aligned].iter().step_by(ps as usize) {
            if first % ps != 0 {
                return Err(ReplayError::internal("cache_finished_req", format!("slot {first} does not start a page")));
            }
            pages.push(first / ps);
        }
        let prefix = trie
            .finish(namespace, &token_ids[..aligned], pages, lease.len, lease.node)
            .map_err(|e| ReplayError::internal("cache_finished_req", e))?;
        trie.free_slots(&kv[aligned..]).map_err(|e| ReplayError::internal("free the unaligned tail", e))?;
        drop(g);
        self.req_pool.free(row).map_err(|e| ReplayError::internal("free row", e))?;
        Ok(prefix)
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner().trie.check_invariants()
    }
}
