//! [`VecTrieReplayCache`]: the TGI-style [`VecTrieCache`] behind a mutex, with request
//! rows, as the replay drivers need it.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::baseline::vec_trie::{VecTrieCache, VecTrieNode};
use crate::error::{AllocError, InvariantViolation};
use crate::req_to_token::ReqToTokenPool;

use super::cache::Rows;
use super::{BaselineRequest, ReplayCache, ReplayError};

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
/// use kvpool::replay::{ReplayCache, ReplayRequest, VecTrieReplayCache};
///
/// let cache = VecTrieReplayCache::new(64, 4, 1, 32)?;
/// let tokens: Vec<u32> = (100..110).collect();
/// let mut req = cache.admit(0, &tokens)?;
/// assert_eq!(req.cached_len(), 0);
/// cache.extend(&mut req, 10)?;
/// // Finishing caches the 8 page-aligned tokens and frees the 2-token tail.
/// cache.finish(req, &tokens)?;
/// assert_eq!(cache.cached_tokens(), 8);
/// assert_eq!(cache.available_tokens(), 64 - 8);
/// // The cached pages, expanded into slots.
/// let mut slots = [0u32; 10];
/// assert_eq!(cache.peek_prefix(0, &tokens, &mut slots), 8);
/// assert_eq!(&slots[..8], &[4, 5, 6, 7, 8, 9, 10, 11]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct VecTrieReplayCache {
    inner: Mutex<Inner>,
    rows: Rows,
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
        let inner = Mutex::new(Inner { trie, pages: Vec::new() });
        Ok(VecTrieReplayCache { inner, rows: Rows::new(req_pool), page_size, capacity })
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // The trie is left consistent between calls; a panic elsewhere already failed
        // the replay.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Cache a finished request's `token_ids` whose slots are `kv` under `lease`: the
    /// trie takes the whole pages (read back as each page's first slot), the unaligned
    /// tail is freed. Returns how many leading tokens were cached already.
    fn cache(&self, namespace: u64, token_ids: &[u32], kv: &[u32], lease: VecTrieLease) -> Result<usize, ReplayError> {
        let ps = self.page_size;
        let aligned = token_ids.len() / ps as usize * ps as usize;
        let mut g = self.inner();
        let Inner { trie, pages } = &mut *g;
        pages.clear();
        if ps == 1 {
            pages.extend_from_slice(&kv[..aligned]);
        } else {
            for &first in kv[..aligned].iter().step_by(ps as usize) {
                let page = trie.page_of(first);
                if page * ps != first {
                    let e = format!("slot {first} does not start a page");
                    return Err(ReplayError::internal("finish", e));
                }
                pages.push(page);
            }
        }
        let prefix = trie
            .finish(namespace, &token_ids[..aligned], pages, lease.len, lease.node)
            .map_err(|e| ReplayError::internal("finish", e))?;
        trie.free_slots(&kv[aligned..]).map_err(|e| ReplayError::internal("free the unaligned tail", e))?;
        Ok(prefix)
    }

    /// Write the slots of `pages` into `out`.
    fn expand(&self, pages: &[u32], out: &mut [u32]) {
        let ps = self.page_size as usize;
        if ps == 1 {
            out.copy_from_slice(pages);
            return;
        }
        for (chunk, &p) in out.chunks_exact_mut(ps).zip(pages) {
            for (k, s) in chunk.iter_mut().enumerate() {
                *s = p * self.page_size + k as u32;
            }
        }
    }
}

impl ReplayCache for VecTrieReplayCache {
    type Request = BaselineRequest<VecTrieLease>;

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
        self.rows.pool()
    }
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError> {
        self.rows.admit(namespace, prompt, |key, out| {
            let mut g = self.inner();
            let Inner { trie, pages } = &mut *g;
            pages.clear();
            let m = trie.match_prefix(namespace, key, pages);
            // A handle fresh from a match is live: locking it cannot fail. Should it,
            // the request goes on without a cached prefix.
            if trie.lock(m.node).is_err() {
                return (0, VecTrieLease { node: VecTrieNode::EMPTY, len: 0 });
            }
            self.expand(pages, &mut out[..m.len]);
            (m.len, VecTrieLease { node: m.node, len: m.len })
        })
    }
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError> {
        self.rows.extend(req, n, |p, s, l, out| self.inner().trie.alloc_extend(p, s, l, out))
    }
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        self.rows.decode(batch, out, |s, l, out| self.inner().trie.alloc_decode(s, l, out))
    }
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        self.rows.finish(
            req,
            kv_tokens,
            |namespace, tokens, kv, lease| self.cache(namespace, tokens, kv, lease),
            |req| self.abort(req),
        )
    }
    fn abort(&self, req: Self::Request) {
        let lease = self.rows.release(req, |own| self.inner().trie.free_slots(own));
        // The lease's node is locked, so it cannot have been evicted: this cannot fail.
        let _ = self.inner().trie.unlock(lease.node);
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
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner().trie.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::radix::EvictionPolicy;
    use crate::replay::{run_overlap, run_sequential, Mode, ReferenceCache, ReplayConfig, Trace};

    /// 60 requests over shared two-block prefixes, prompt lengths not page-aligned.
    fn trace() -> Trace {
        let mut text = String::new();
        for i in 0..60u32 {
            text += &format!(
                "{{\"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}, {}, {}]}}\n",
                1100 + 37 * (i % 7),
                2 + i % 21,
                i % 3,
                10 + i % 5,
                100 + i
            );
        }
        Trace::from_jsonl_str(&text, "test").unwrap()
    }

    fn config(capacity: usize, page_size: u32, mode: Mode) -> ReplayConfig {
        ReplayConfig { capacity_tokens: capacity, page_size, mode, max_running: 4, routers: 1, ..Default::default() }
    }

    #[test]
    fn without_eviction_hits_equal_the_reference() {
        let trace = trace();
        for ps in [1, 16] {
            let c = config(1 << 20, ps, Mode::Sequential);
            let v = VecTrieReplayCache::new(c.capacity_tokens, ps, 1, trace.max_kv_len()).unwrap();
            let r = ReferenceCache::new(c.capacity_tokens, ps, EvictionPolicy::Lru, 1, trace.max_kv_len()).unwrap();
            let (v, r) =
                (run_sequential(&v, &trace, &c, &|_| {}).unwrap(), run_sequential(&r, &trace, &c, &|_| {}).unwrap());
            assert!(r.hit_tokens > 0);
            assert_eq!(
                (v.hit_tokens, v.final_cached_tokens, v.evicted_tokens),
                (r.hit_tokens, r.final_cached_tokens, 0)
            );
            assert_eq!(v.cache, "vectrie");
        }
    }

    #[test]
    fn eviction_trims_and_accounts_exactly() {
        let trace = trace();
        for ps in [1, 16] {
            // Three requests' worth of tokens: eviction on most requests.
            let c = config(4096, ps, Mode::Sequential);
            let v = VecTrieReplayCache::new(c.capacity_tokens, ps, 1, trace.max_kv_len()).unwrap();
            // finish_report checks slots in use == cached, and added == cached + evicted.
            let rep = run_sequential(&v, &trace, &c, &|_| {}).unwrap();
            assert!(rep.evicted_tokens > 0 && rep.hit_tokens > 0, "{rep:?}");
            assert_eq!(rep.rejected, 0);
        }
    }

    #[test]
    fn overlap_replay_stays_consistent() {
        let trace = trace();
        let c = config(8192, 16, Mode::Overlap);
        let v = VecTrieReplayCache::new(c.capacity_tokens, 16, c.rows() as u32, trace.max_kv_len()).unwrap();
        let rep = run_overlap(&v, &trace, &c, &|_| {}).unwrap();
        assert_eq!(rep.requests, 60);
        assert!(rep.invariants_ok);
    }

    #[test]
    fn a_row_of_bad_slots_is_an_error_not_a_panic() {
        // Two rows: a refused finish does not give its row back (the replay stops).
        let cache = VecTrieReplayCache::new(64, 4, 2, 16).unwrap();
        let tokens: Vec<u32> = (0..8).collect();
        // Slots that do not start a page, then pages nobody allocated.
        for bad in [[5, 6, 7, 8, 9, 10, 11, 12], [4, 5, 6, 7, 8, 9, 10, 11]] {
            let mut req = cache.admit(0, &tokens).unwrap();
            cache.req_pool().write(&mut req.row, 0, &bad).unwrap();
            req.len = 8;
            assert!(matches!(cache.finish(req, &tokens), Err(ReplayError::Internal(_))));
        }
        assert_eq!((cache.cached_tokens(), cache.available_tokens()), (0, 64));
        cache.check_invariants().unwrap();
    }
}
