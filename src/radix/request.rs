//! [`Request`]: everything a request holds in a prefix cache, and its lifecycle.
//!
//! A request handle owns its request row, its lock on the prefix it matched, the slots
//! allocated into the row and their count. Every step of its life goes through it, and
//! reads only what it recorded:
//!
//! | step | call | what it does |
//! |---|---|---|
//! | admit | [`RadixCache::admit`] | takes a row, matches the prompt's longest cached prefix into it and locks that prefix |
//! | extend | [`Request::extend`] | allocates the next `n` tokens (a prefill chunk), evicting the shortfall |
//! | decode | [`RadixCache::decode`] | one slot for every request of a batch, each continuing its own last slot |
//! | checkpoint | [`Request::checkpoint`] | caches what is computed so far and keeps running |
//! | finish | [`Request::finish`] | caches the request's whole pages, frees the rest, gives the row and the lock back |
//! | abort | [`Request::abort`], or dropping the handle | gives everything back, caches nothing |
//!
//! So the mistakes a scheduler could make with the lower-level calls cannot be made:
//!
//! * the finish takes exactly the tokens whose KV the row holds ([`Request::len`] of
//!   them): one more or one less is [`CacheError::TokenCount`], with nothing changed, so
//!   no slot is leaked and no cell another request left in the row is claimed;
//! * a decode continues the request's own last slot, never one the caller names, and a
//!   finished request is gone (the finish consumes it), so nothing can decode into
//!   a page that went to another request;
//! * a failed finish hands the request back whole ([`Refused`]), `'static` and an
//!   [`Error`](std::error::Error), so `?` works: a request dropped with the error is
//!   aborted, not leaked;
//! * a request handle dropped without finish or abort is aborted: its slots, its lock
//!   and its row go back (the handle holds an [`Arc`] of the cache for that).
//!
//! The cache counts the tokens its live requests hold, so
//! [`check_invariants`](RadixCache::check_invariants) also checks the accounting (free,
//! cached and held by live requests add up to the capacity). Slots taken from the
//! allocator and never given back are a violation there.
//!
//! # Examples
//!
//! A request admitted, prefilled, decoded and finished; a second one reuses its
//! prompt:
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::radix::{RadixCache, RadixConfig};
//! use kvpool::{PagedAllocator, ReqToTokenPool};
//!
//! let cache = Arc::new(RadixCache::new(PagedAllocator::new(1024, 4)?, ReqToTokenPool::new(8, 64)?, RadixConfig::default())?);
//! let prompt: Vec<u32> = (100..110).collect();
//!
//! let mut req = cache.admit(0, &prompt)?;           // nothing cached yet
//! assert_eq!(req.cached_len(), 0);
//! req.extend(prompt.len() - req.len())?;            // prefill
//! let mut step = [0u32; 1];
//! cache.decode(&mut [&mut req], &mut step)?;        // the first output token's KV
//! assert_eq!(req.len(), 11);
//!
//! // The KV tokens: the prompt and the outputs but the last.
//! let kv_tokens: Vec<u32> = prompt.iter().copied().chain([7]).collect();
//! req.finish(&kv_tokens)?;                          // 8 tokens cached, the tail freed
//! assert_eq!(cache.total_size(), 8);
//!
//! let again = cache.admit(0, &prompt)?;
//! assert_eq!(again.cached_len(), 8);
//! drop(again);                                      // aborted: the lock is released
//! cache.check_invariants()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A finish with one token too few is refused, and the request comes back:
//!
//! ```
//! # use std::sync::Arc;
//! # use kvpool::radix::{CacheError, RadixCache, RadixConfig};
//! # use kvpool::{PagedAllocator, ReqToTokenPool};
//! # let cache = Arc::new(RadixCache::new(PagedAllocator::new(1024, 4)?, ReqToTokenPool::new(8, 64)?, RadixConfig::default())?);
//! let tokens: Vec<u32> = (0..9).collect();
//! let mut req = cache.admit(0, &tokens)?;
//! req.extend(9)?;
//! let refused = req.finish(&tokens[..8]).unwrap_err();
//! assert_eq!(refused.error, CacheError::TokenCount { tokens: 8, held: 9 });
//! refused.request.finish(&tokens)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A finished request cannot be used again:
//!
//! ```compile_fail
//! # use std::sync::Arc;
//! # use kvpool::radix::{RadixCache, RadixConfig};
//! # use kvpool::{PagedAllocator, ReqToTokenPool};
//! # let cache = Arc::new(RadixCache::new(PagedAllocator::new(1024, 4).unwrap(), ReqToTokenPool::new(8, 64).unwrap(), RadixConfig::default()).unwrap());
//! let mut req = cache.admit(0, &[1, 2, 3, 4]).unwrap();
//! req.extend(4).unwrap();
//! req.finish(&[1, 2, 3, 4]).unwrap();
//! cache.decode(&mut [&mut req], &mut [0]).unwrap(); // error[E0382]: borrow of moved value
//! ```

use core::fmt;
use core::mem::ManuallyDrop;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::{CacheError, CacheKey, Lease, LeaseKey, Plain, RadixCache, Variant};
use crate::alloc::KvAllocator;
use crate::error::{AllocError, InvalidInput, RowError};
use crate::req_to_token::ReqRow;

/// A request admitted to a [`RadixCache`]: its row, its lock on the matched prefix, the
/// slots allocated into the row (see the [module docs](self)).
///
/// Positions `0..cached_len()` of its row hold the cache's slots for the locked prefix,
/// positions `cached_len()..len()` the slots the request allocated: the pages that
/// cover them are the request's own until it finishes or aborts.
///
/// Dropping a request aborts it: its own slots, its lock and its row go back, and
/// nothing is cached.
#[must_use = "dropping a request aborts it: its KV is freed and nothing is cached"]
pub struct Request<A: KvAllocator, V: Variant = Plain> {
    cache: Arc<RadixCache<A, V>>,
    /// `None` once finished or aborted.
    row: Option<ReqRow>,
    lease: LeaseKey,
    namespace: u64,
    /// With a bigram key: the prompt's first token (the namespace holds it; the tree's
    /// key is the tokens after it).
    bigram: Option<u32>,
    /// Row positions written: the cache's up to the lease, the request's after.
    written: usize,
    /// The row's slot at `written - 1` (0 for an empty row): the slot a decode step
    /// continues.
    last: u32,
    /// Tokens of the prompt it was admitted with.
    prompt_len: usize,
    priority: i64,
    /// What the variant's request holds besides (the Mamba tree: its states).
    ext: V::Request,
}

/// A request the cache refused to finish, handed back whole with the reason; nothing
/// changed. Dropping it aborts the request.
pub struct Refused<A: KvAllocator, V: Variant = Plain> {
    /// Why.
    pub error: CacheError,
    /// The request, as it was.
    pub request: Request<A, V>,
}

impl<A: KvAllocator, V: Variant> fmt::Debug for Refused<A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused").field("error", &self.error).field("request", &self.request).finish()
    }
}

impl<A: KvAllocator, V: Variant> fmt::Display for Refused<A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the request was not finished: {}", self.error)
    }
}

impl<A: KvAllocator, V: Variant> std::error::Error for Refused<A, V> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The reason alone (the request is dropped, which aborts it).
impl<A: KvAllocator, V: Variant> From<Refused<A, V>> for CacheError {
    fn from(r: Refused<A, V>) -> Self {
        r.error.clone()
    }
}

impl<A: KvAllocator, V: Variant> fmt::Debug for Request<A, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("row", &self.row.as_ref().map(ReqRow::index))
            .field("namespace", &self.namespace)
            .field("cached_len", &self.lease.len)
            .field("len", &self.written)
            .finish()
    }
}

impl<A: KvAllocator, V: Variant> AsMut<Request<A, V>> for Request<A, V> {
    fn as_mut(&mut self) -> &mut Self {
        self
    }
}

impl<A: KvAllocator, V: Variant> Request<A, V> {
    /// Tokens whose KV slots the row holds: the cached prefix and everything allocated
    /// since. A finish takes exactly this many tokens.
    pub fn len(&self) -> usize {
        self.written
    }

    /// Whether the row holds no slot yet.
    pub fn is_empty(&self) -> bool {
        self.written == 0
    }

    /// Tokens of the locked prefix: matched at admission (SGLang's
    /// `cache_protected_len`), or cached by the last [`checkpoint`](Self::checkpoint).
    pub fn cached_len(&self) -> usize {
        self.lease.len
    }

    /// Tokens of the prompt the request was admitted with.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// The request's row number (SGLang's `req_pool_idx`), for the kernels that read
    /// the row table.
    pub fn row_index(&self) -> usize {
        self.row().index()
    }

    /// The slots of the request's tokens, `len()` of them.
    pub fn slots(&self) -> &[u32] {
        self.cache.req_pool.read(self.row(), 0..self.written).unwrap_or(&[])
    }

    /// The tree namespace the request is cached under (see [`CacheKey::tree_key`]).
    pub fn namespace(&self) -> u64 {
        self.namespace
    }

    /// The cache the request was admitted to.
    pub fn cache(&self) -> &Arc<RadixCache<A, V>> {
        &self.cache
    }

    /// The priority its pages get when it is cached ([`EvictionPolicy::Priority`]);
    /// 0 unless set.
    ///
    /// [`EvictionPolicy::Priority`]: super::EvictionPolicy::Priority
    pub fn set_priority(&mut self, priority: i64) {
        self.priority = priority;
    }

    fn row(&self) -> &ReqRow {
        // Only `finish` and `abort` take the row, and both consume the request.
        self.row.as_ref().expect("a live request holds its row")
    }

    /// Tokens of KV capacity the request holds: the pages from the end of its lock to
    /// the end of its last page.
    fn held(&self) -> usize {
        self.written.next_multiple_of(self.cache.ps) - self.lease.len
    }

    /// Allocate the KV of the request's next `n` tokens (a prefill chunk) into its row,
    /// evicting the shortfall first. The first continues the request's last page.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when even eviction leaves too little room;
    /// [`AllocError::Row`] when the row has no room for `n` more tokens. Nothing
    /// changes then.
    pub fn extend(&mut self, n: usize) -> Result<(), AllocError> {
        let (from, cache) = (self.written, &*self.cache);
        let to = from.checked_add(n).filter(|&to| to <= cache.req_pool.max_context_len()).ok_or(AllocError::Row(
            RowError::OutOfBounds {
                row: self.row().index() as u32,
                start: from,
                len: n,
                max_context_len: cache.req_pool.max_context_len(),
            },
        ))?;
        if n == 0 {
            return Ok(());
        }
        let before = self.held();
        cache.extend_row(self.row.as_mut().expect("a live request holds its row"), from, to)?;
        self.written = to;
        self.last = self.slots()[to - 1];
        cache.held.fetch_add(self.held() - before, Relaxed);
        Ok(())
    }

    /// Give everything back and cache nothing: the request's own slots, its lock, its
    /// row. The same as dropping it.
    pub fn abort(mut self) {
        self.give_back();
    }

    fn give_back(&mut self) {
        let Some(row) = self.row.take() else { return };
        let c = &*self.cache;
        let held = self.held();
        if let Ok(own) = c.req_pool.read(&row, self.lease.len..self.written) {
            // The pages covering these positions are the request's alone.
            let freed = c.alloc.free(own);
            debug_assert!(freed.is_ok(), "a request's own slots failed to free: {freed:?}");
        }
        let released = c.release_key(self.lease);
        debug_assert!(released.is_ok(), "a request's lease failed to release: {released:?}");
        let freed = c.req_pool.free(row);
        debug_assert!(freed.is_ok(), "a request's row failed to free");
        c.variant.release_request(&mut self.ext);
        c.held.fetch_sub(held, Relaxed);
    }

    /// Finish the request (SGLang's `cache_finished_req`): `tokens` are the tokens whose
    /// KV the row holds, [`len`](Self::len) of them (the prompt and the outputs but
    /// the last, whose KV was never computed). Caches their whole pages (the Mamba
    /// tree: up to the state saved with [`save_state`](Self::save_state); the SWA
    /// tree: up to where the window KV was released), frees the slots the tree already
    /// had beyond the lock (duplicates) and the rest of the request's KV, releases the
    /// lock, the row and whatever else the request holds. Returns how many leading
    /// tokens were cached before (for the Mamba tree, also whether the tree kept the
    /// state).
    ///
    /// # Errors
    ///
    /// [`Refused`] hands the request back with the reason, nothing changed:
    /// [`CacheError::TokenCount`] when `tokens.len()` is not `len()`;
    /// [`CacheError::RowMismatch`] when the locked prefix's tokens are not the ones the
    /// request was admitted with; with a bigram key, [`CacheError::Invalid`] when the
    /// request holds no token past its lock (position `i` is cached with token `i + 1`:
    /// a bigram request finishes with at least `cached_len() + 1` tokens, which any
    /// request that computed its prompt has).
    #[allow(clippy::result_large_err)] // the request itself comes back: no allocation on error
    pub fn finish(mut self, tokens: &[u32]) -> Result<V::Finished, Refused<A, V>> {
        if tokens.len() != self.written {
            let error = CacheError::TokenCount { tokens: tokens.len(), held: self.written };
            return Err(Refused { error, request: self });
        }
        let tree_tokens = match self.tree_tokens(tokens) {
            Ok(t) => t,
            Err(error) => return Err(Refused { error, request: self }),
        };
        if V::SPLITS_AT_PROMPT && self.cache.split_at_prompt {
            // The prompt's whole pages first, as their own node, when the finish would
            // add them and more.
            let ps = self.cache.ps;
            let prompt = self.prompt_len.min(tokens.len()) / ps * ps;
            if prompt > self.lease.len && prompt < tokens.len() / ps * ps {
                if let Err(error) = self.checkpoint(&tokens[..prompt]) {
                    return Err(Refused { error, request: self });
                }
            }
        }
        let (ns, priority) = (self.namespace, self.priority);
        let cache = Arc::clone(&self.cache);
        // Never dropped (that would release the lock): the finish releases it.
        let lease = ManuallyDrop::new(Lease { cache: &*cache, key: self.lease });
        let mut ext = core::mem::take(&mut self.ext);
        let r = V::finish_request(&cache, &cache.req_pool, ns, tree_tokens, self.row(), &lease, priority, &mut ext);
        self.ext = ext;
        match r {
            Ok(r) => {
                if tree_tokens.len() < tokens.len() {
                    // A bigram key caches one position fewer than the row holds: the last
                    // position's page is still the request's when it starts one.
                    let last = tokens.len() - 1;
                    if last % cache.ps == 0 && last >= self.lease.len {
                        let freed = cache.alloc.free(&self.slots()[last..]);
                        debug_assert!(freed.is_ok(), "a request's last page failed to free: {freed:?}");
                    }
                }
                let held = self.held();
                let row = self.row.take().expect("a live request holds its row");
                // The row is this pool's: freeing it cannot fail.
                let freed = cache.req_pool.free(row);
                debug_assert!(freed.is_ok(), "a request's row failed to free");
                cache.variant.release_request(&mut self.ext);
                cache.held.fetch_sub(held, Relaxed);
                Ok(r)
            }
            Err(error) => Err(Refused { error, request: self }),
        }
    }

    /// Cache the request's KV up to `tokens.len()` and keep running (SGLang's
    /// `checkpoint(req, up_to)`, formerly `cache_unfinished_req`): the whole pages of
    /// `tokens` enter the tree, the request's lock moves to their end
    /// ([`cached_len`](Self::cached_len)), its row gets the tree's slots for them, and
    /// its duplicates are freed. The rest stays the request's.
    ///
    /// # Errors
    ///
    /// [`CacheError::TokenCount`] when `tokens` is longer than [`len`](Self::len),
    /// [`CacheError::RowMismatch`] as for [`finish`](Self::finish). Nothing changes
    /// then, nor when `tokens` reach no further than the lock already does.
    pub fn checkpoint(&mut self, tokens: &[u32]) -> Result<(), CacheError> {
        if tokens.len() > self.written {
            return Err(CacheError::TokenCount { tokens: tokens.len(), held: self.written });
        }
        let tokens = self.tree_tokens(tokens)?;
        if tokens.len() <= self.lease.len {
            return Ok(()); // nothing past the lock to cache
        }
        let before = self.held();
        let (ns, priority) = (self.namespace, self.priority);
        let cache = Arc::clone(&self.cache);
        let mut lease = ManuallyDrop::new(Lease { cache: &*cache, key: self.lease });
        let row = self.row.as_mut().expect("a live request holds its row");
        V::checkpoint_request(&cache, ns, tokens, row, &mut lease, priority, &mut self.ext)?;
        self.lease = lease.key;
        // The cached prefix now holds the tree's slots: the last may be one of them.
        self.last = self.written.checked_sub(1).map_or(0, |p| self.slots()[p]);
        cache.held.fetch_sub(before - self.held(), Relaxed);
        Ok(())
    }

    /// The tree's key for the request's `tokens` (with a bigram key, the tokens after
    /// the first, which must be the one it was admitted with).
    fn tree_tokens<'t>(&self, tokens: &'t [u32]) -> Result<&'t [u32], CacheError> {
        let Some(first) = self.bigram else { return Ok(tokens) };
        match tokens.split_first() {
            Some((&t, rest)) if t == first => Ok(rest),
            None => Ok(tokens),
            Some(_) => {
                let slot = self.slots().first().copied().unwrap_or(0);
                Err(CacheError::RowMismatch { index: 0, slot })
            }
        }
    }

    /// What the variant's request holds (the Mamba tree: its states).
    pub(super) fn ext_ref(&self) -> &V::Request {
        &self.ext
    }

    /// The cache and what the variant's request holds, together.
    pub(super) fn cache_and_ext(&mut self) -> (&RadixCache<A, V>, &mut V::Request) {
        (&self.cache, &mut self.ext)
    }

    /// The request's row and lock, for a variant's own request calls.
    pub(super) fn row_and_lease(&self) -> (&ReqRow, LeaseKey) {
        (self.row(), self.lease)
    }
}

impl<A: KvAllocator> Request<A, super::Hi> {
    /// What the admission found on the host tier: the host continuation the prompt
    /// matched past the device prefix, and how much of it was loaded back (the last
    /// `loaded` of the [`cached_len`](Self::cached_len) tokens, whose device slots a
    /// [`Load`](super::TransferKind::Load) transfer fills: wait for it before reading
    /// them).
    pub fn host_hit(&self) -> super::HostHit {
        self.ext
    }
}

impl<A: KvAllocator, V: Variant> Drop for Request<A, V> {
    fn drop(&mut self) {
        self.give_back();
    }
}

impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    /// Admit a request (see [`Request`]): take a row, match `prompt`'s longest cached
    /// page-aligned prefix in `namespace` into it and lock that prefix against
    /// eviction (the Mamba tree: the longest that ends at a cached state, and the
    /// request takes a running state; the host tier: loading back what the host holds
    /// after the device prefix). The request's [`len`](Request::len) and
    /// [`cached_len`](Request::cached_len) are the matched tokens; allocate the rest of
    /// the prompt with [`extend`](Request::extend).
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] when no request row (the Mamba tree: no state) is
    /// free; [`AllocError::Row`] when `prompt` is longer than a row. Nothing changes
    /// then.
    pub fn admit(self: &Arc<Self>, key: impl Into<CacheKey>, prompt: &[u32]) -> Result<Request<A, V>, AllocError> {
        let key = key.into();
        let (namespace, tree_prompt) = key.tree_key(prompt);
        let bigram = if key.bigram { Some(prompt.first().copied().unwrap_or(0)) } else { None };
        let max = self.req_pool.max_context_len();
        if prompt.len() > max {
            let (start, len, max_context_len) = (0, prompt.len(), max);
            return Err(AllocError::Row(RowError::OutOfBounds { row: u32::MAX, start, len, max_context_len }));
        }
        let mut row = self.req_pool.alloc()?;
        let (lease, ext) = match V::admit_request(self, namespace, tree_prompt, &mut row) {
            Ok(admitted) => admitted,
            Err(e) => {
                let _ = self.req_pool.free(row);
                return Err(e);
            }
        };
        let lease = lease.0;
        let written = lease.len;
        let prompt_len = prompt.len();
        let mut req = Request {
            cache: Arc::clone(self),
            row: Some(row),
            lease,
            namespace,
            bigram,
            written,
            last: 0,
            prompt_len,
            priority: 0,
            ext,
        };
        req.last = written.checked_sub(1).map_or(0, |p| req.slots()[p]);
        Ok(req)
    }

    /// Allocate one KV slot for every request of a decode batch, evicting the
    /// shortfall first: `out[i]` gets request `i`'s slot for its token at position
    /// `len()`, which continues its last page, and the request's row gets it too
    /// (its `len()` grows by one). The batch may be requests, `&mut` requests, or
    /// anything that lends one ([`AsMut`]).
    ///
    /// # Errors
    ///
    /// [`AllocError::Invalid`] when `out` and the batch differ in length;
    /// [`AllocError::Row`] for a request of another cache, or one whose row is full;
    /// [`AllocError::OutOfMemory`] when even eviction leaves too little room. Nothing
    /// changes then.
    pub fn decode<R: AsMut<Request<A, V>>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        if out.len() != batch.len() {
            let (what, end, len) = ("decode output slots", out.len(), batch.len());
            return Err(InvalidInput::LengthMismatch { what, got: end, expected: len }.into());
        }
        if let [one] = batch {
            return self.decode_one(one.as_mut(), &mut out[0]);
        }
        let max = self.req_pool.max_context_len();
        let mut need = 0usize;
        for r in batch.iter_mut() {
            let r = r.as_mut();
            self.check_decode(r, max)?;
            need += usize::from(r.written % self.ps == 0) * self.ps;
        }
        const CHUNK: usize = 64;
        if batch.len() > CHUNK {
            // Room for the whole batch at once (each chunk also makes room for itself).
            self.make_room(need);
        }
        let (mut seq_lens, mut last_locs) = ([0u32; CHUNK], [0u32; CHUNK]);
        let mut done = 0;
        while done < batch.len() {
            let n = (batch.len() - done).min(CHUNK);
            let mut chunk_need = 0usize;
            for (i, r) in batch[done..done + n].iter_mut().enumerate() {
                let r = r.as_mut();
                seq_lens[i] = r.written as u32 + 1;
                last_locs[i] = r.last;
                chunk_need += usize::from(r.written % self.ps == 0) * self.ps;
            }
            if let Err(e) = self.decode_slots(&seq_lens[..n], &last_locs[..n], &mut out[done..done + n], chunk_need) {
                // Give back the new pages of the chunks before; the slots that continued
                // a request's page stay in that page, which stays the request's.
                let mut group = self.alloc.free_group();
                for (r, &slot) in batch[..done].iter_mut().zip(&out[..done]) {
                    if r.as_mut().written % self.ps == 0 {
                        let freed = group.free(&[slot]);
                        debug_assert!(freed.is_ok(), "a decode slot failed to free: {freed:?}");
                    }
                }
                return Err(e);
            }
            done += n;
        }
        for (r, &slot) in batch.iter_mut().zip(out.iter()) {
            let r = r.as_mut();
            let at = r.written;
            let wrote = self.req_pool.write(r.row.as_mut().expect("a live request holds its row"), at, &[slot]);
            debug_assert!(wrote.is_ok(), "a checked decode position failed to write: {wrote:?}");
            r.written += 1;
            r.last = slot;
            if at % self.ps == 0 {
                self.held.fetch_add(self.ps, Relaxed);
            }
        }
        Ok(())
    }

    /// A request of this cache with room for one more token in its row.
    #[inline]
    fn check_decode(&self, r: &Request<A, V>, max: usize) -> Result<(), AllocError> {
        let row = r.row().index() as u32;
        if !core::ptr::eq(Arc::as_ptr(&r.cache), self) {
            return Err(AllocError::Row(RowError::ForeignRow { row }));
        }
        if r.written >= max {
            return Err(AllocError::Row(RowError::OutOfBounds { row, start: r.written, len: 1, max_context_len: max }));
        }
        Ok(())
    }

    /// [`decode`](Self::decode) of a batch of one.
    #[inline]
    fn decode_one(&self, r: &mut Request<A, V>, out: &mut u32) -> Result<(), AllocError> {
        self.check_decode(r, self.req_pool.max_context_len())?;
        let at = r.written;
        if at % self.ps != 0 {
            // Inside the request's own last page (a cached prefix is whole pages, so a
            // request whose last token continues a page wrote that page itself): the
            // next slot of the page, as the allocator's decode would place it, with
            // nothing to allocate.
            *out = r.last + 1;
        } else {
            self.decode_slots(&[at as u32 + 1], &[r.last], core::slice::from_mut(out), self.ps)?;
        }
        let wrote = self.req_pool.write(r.row.as_mut().expect("a live request holds its row"), at, &[*out]);
        debug_assert!(wrote.is_ok(), "a checked decode position failed to write: {wrote:?}");
        r.written += 1;
        r.last = *out;
        if at % self.ps == 0 {
            self.held.fetch_add(self.ps, Relaxed);
        }
        Ok(())
    }
}
