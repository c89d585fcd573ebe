//! [`CacheAllocator`]: a prefix cache's KV allocator as its callers see it.
//!
//! A cache frees the pages it holds itself (eviction, duplicates, tails). A caller
//! frees only what it owns: fresh slots it did not insert, the duplicates an insert
//! reports, an aborted request's slots. A free that names a page the tree holds would
//! leave the page cached and free at once, so the next allocation hands it to a
//! request while lookups still return it. The view refuses such a free with a typed
//! error and frees nothing; everything else is the allocator's own method.
//!
//! The check reads the tree's page bitmap without the writer latch: it catches a free
//! that comes after the insert that cached the page (the mistake a caller can make
//! alone). A free racing with an insert of the same page means two callers each
//! believe they own it, which no check of one call can settle.

#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::alloc::{KvAllocator, SwaAllocator, SwaWindow};
#[cfg(test)]
use crate::error::{AllocError, FreeError, FreeErrorKind};
use crate::error::{InvalidInput, InvariantViolation};

/// A read-only view of a prefix cache's KV allocator (see
/// [`RadixCache::allocator`](super::RadixCache::allocator)): its sizes and slot states.
/// Slots are allocated and freed by [`Request`](super::Request)s, which account for
/// them; the cache owns its allocator exclusively.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use kvpool::radix::{RadixCache, RadixConfig};
/// use kvpool::{ReqToTokenPool, TokenAllocator};
///
/// let cache = Arc::new(RadixCache::new(TokenAllocator::new(64)?, ReqToTokenPool::new(2, 64)?, RadixConfig::default())?);
/// let mut req = cache.admit(0, &[1, 2, 3, 4])?;
/// req.extend(4)?;
/// let slots = req.slots().to_vec();
/// assert_eq!(cache.allocator().available_size(), 60);
/// req.finish(&[1, 2, 3, 4])?; // the tree's now
/// assert!(slots.iter().all(|&s| cache.allocator().is_allocated(s)));
/// assert_eq!(cache.allocator().available_size() + cache.total_size(), 64);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CacheAllocator<'a, A> {
    alloc: &'a A,
    in_tree: &'a [AtomicU64],
    /// The cache's flag set when a unit test allocates through the view (the accounting
    /// check then skips).
    #[cfg(test)]
    raw: Option<&'a AtomicBool>,
    ps: u32,
}

impl<A> Clone for CacheAllocator<'_, A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A> Copy for CacheAllocator<'_, A> {}

impl<'a, A: KvAllocator> CacheAllocator<'a, A> {
    pub(super) fn new(alloc: &'a A, in_tree: &'a [AtomicU64]) -> Self {
        CacheAllocator {
            alloc,
            in_tree,
            #[cfg(test)]
            raw: None,
            ps: alloc.page_size().max(1),
        }
    }

    /// The view a unit test allocates through, noting it in `raw`.
    #[cfg(test)]
    pub(super) fn noting_raw(self, raw: &'a AtomicBool) -> Self {
        CacheAllocator { raw: Some(raw), ..self }
    }

    /// Note that the caller holds slots no request accounts for.
    #[cfg(test)]
    fn mark_raw(&self) {
        if let Some(raw) = self.raw {
            mark_raw(raw);
        }
    }

    /// Whether the tree holds `page` (a snapshot).
    fn cached(&self, page: u32) -> bool {
        page_bit(self.in_tree, page)
    }

    /// Refuse a batch in which a request would continue a page the tree holds: its
    /// prefix ends inside that page (`last_loc` is there) and it grows, so part 1 of the
    /// expansion would hand out the page's next slots, which are the tree's. A request
    /// continues only a page of its own (a match is page-aligned; a chunk or a decode
    /// step continues the request's own last page). Malformed batches pass: the
    /// allocator's own checks report them.
    pub(super) fn check_continued_pages(
        &self,
        last_locs: &[u32],
        req: impl Fn(usize) -> (u32, u32),
    ) -> Result<(), InvalidInput> {
        if self.ps <= 1 {
            return Ok(());
        }
        for (request, &last_loc) in last_locs.iter().enumerate() {
            let (prefix, seq) = req(request);
            if prefix % self.ps != 0 && seq > prefix && self.cached(last_loc / self.ps) {
                return Err(InvalidInput::LastLocCached { request, last_loc });
            }
        }
        Ok(())
    }

    /// The first slot of `slots` in a page the tree holds, as the error a free gives.
    #[cfg(test)]
    fn refuse_cached(&self, slots: &[u32]) -> Result<(), FreeError> {
        let mut last = u32::MAX;
        for &slot in slots {
            let page = slot / self.ps;
            if page != last && page != 0 && self.cached(page) {
                return Err(FreeError { index: slot, kind: FreeErrorKind::Cached, rest_freed: false });
            }
            last = page;
        }
        Ok(())
    }

    /// [`KvAllocator::page_size`].
    pub fn page_size(&self) -> u32 {
        self.alloc.page_size()
    }

    /// [`KvAllocator::size`].
    pub fn size(&self) -> usize {
        self.alloc.size()
    }

    /// [`KvAllocator::available_size`].
    pub fn available_size(&self) -> usize {
        self.alloc.available_size()
    }

    /// [`KvAllocator::is_allocated`] (true for a page the tree holds as well).
    pub fn is_allocated(&self, slot: u32) -> bool {
        self.alloc.is_allocated(slot)
    }

    /// [`KvAllocator::alloc`]: no eviction (the cache's own
    /// [`alloc`](super::RadixCache::alloc) evicts the shortfall first).
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::alloc`].
    #[cfg(test)]
    pub(crate) fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        self.mark_raw();
        self.alloc.alloc(out)
    }

    /// [`KvAllocator::alloc_extend`], refusing a request that would continue a page the
    /// tree holds; no eviction (the cache's own
    /// [`alloc_extend`](super::RadixCache::alloc_extend) evicts the shortfall first).
    ///
    /// # Errors
    ///
    /// [`InvalidInput::LastLocCached`], else as [`KvAllocator::alloc_extend`]; nothing
    /// is allocated on error.
    #[cfg(test)]
    pub(crate) fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        let n = prefix_lens.len().min(seq_lens.len()).min(last_locs.len());
        self.check_continued_pages(&last_locs[..n], |i| (prefix_lens[i], seq_lens[i]))?;
        self.mark_raw();
        self.alloc.alloc_extend(prefix_lens, seq_lens, last_locs, out)
    }

    /// [`KvAllocator::alloc_decode`], refusing a request that would continue a page the
    /// tree holds; no eviction (see [`alloc_extend`](Self::alloc_extend)).
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend).
    #[cfg(test)]
    pub(crate) fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        let n = seq_lens.len().min(last_locs.len());
        self.check_continued_pages(&last_locs[..n], |i| (seq_lens[i].saturating_sub(1), seq_lens[i]))?;
        self.mark_raw();
        self.alloc.alloc_decode(seq_lens, last_locs, out)
    }

    /// [`KvAllocator::extend_need`].
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::extend_need`].
    pub fn extend_need(&self, prefix_lens: &[u32], seq_lens: &[u32]) -> Result<usize, InvalidInput> {
        self.alloc.extend_need(prefix_lens, seq_lens)
    }

    /// [`KvAllocator::decode_need`].
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::decode_need`].
    pub fn decode_need(&self, seq_lens: &[u32]) -> Result<usize, InvalidInput> {
        self.alloc.decode_need(seq_lens)
    }

    /// [`KvAllocator::free`], refusing a page the tree holds.
    ///
    /// # Errors
    ///
    /// [`FreeErrorKind::Cached`] for the first slot in a page the tree holds, else as
    /// [`KvAllocator::free`]; nothing is freed on error.
    #[cfg(test)]
    pub(crate) fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.refuse_cached(slots)?;
        self.alloc.free(slots)
    }

    /// [`KvAllocator::check_invariants`].
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::check_invariants`].
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.alloc.check_invariants()
    }
}

impl CacheAllocator<'_, SwaAllocator> {
    /// [`SwaAllocator::window`].
    pub fn window(&self) -> &SwaWindow {
        self.alloc.window()
    }

    /// [`SwaAllocator::full_available_size`].
    pub fn full_available_size(&self) -> usize {
        self.alloc.full_available_size()
    }

    /// [`SwaAllocator::window_available_size`].
    pub fn window_available_size(&self) -> usize {
        self.alloc.window_available_size()
    }

    /// [`SwaAllocator::window_size`].
    pub fn window_size(&self) -> usize {
        self.alloc.window_size()
    }

    /// [`SwaAllocator::window_slot`].
    pub fn window_slot(&self, slot: u32) -> Option<u32> {
        self.alloc.window_slot(slot)
    }

    /// [`SwaAllocator::translate`].
    ///
    /// # Errors
    ///
    /// As [`SwaAllocator::translate`].
    pub fn translate(&self, full: &[u32], out: &mut [u32]) -> Result<(), InvalidInput> {
        self.alloc.translate(full, out)
    }

    /// [`SwaAllocator::free_swa`], refusing a page the tree holds (its window KV is the
    /// tree's: a request releases its own through
    /// [`release_window`](super::SwaRadixCache::release_window)).
    ///
    /// # Errors
    ///
    /// [`FreeErrorKind::Cached`] for the first slot in a page the tree holds, else as
    /// [`SwaAllocator::free_swa`]; nothing is freed on error.
    #[cfg(test)]
    pub(crate) fn free_swa(&self, slots: &[u32]) -> Result<usize, FreeError> {
        self.refuse_cached(slots)?;
        self.alloc.free_swa(slots)
    }
}

/// Whether bit `page` of the in-tree bitmap `bits` is set (false past its end).
#[inline]
pub(super) fn page_bit(bits: &[AtomicU64], page: u32) -> bool {
    bits.get(page as usize / 64).is_some_and(|w| w.load(Relaxed) & (1 << (page % 64)) != 0)
}

impl<A> core::fmt::Debug for CacheAllocator<'_, A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CacheAllocator").field("page_size", &self.ps).finish_non_exhaustive()
    }
}

/// Note that slots were allocated outside any request (a load first: the flag is set
/// once and read rarely, so its line stays shared).
#[cfg(test)]
pub(super) fn mark_raw(raw: &AtomicBool) {
    if !raw.load(Relaxed) {
        raw.store(true, Relaxed);
    }
}
