//! The dual allocator of hybrid sliding-window models: [`SwaAllocator`], SGLang's
//! `SWATokenToKVPoolAllocator`, lock-free.
//!
//! Models that interleave full-attention and sliding-window layers (Gemma 2/3, gpt-oss,
//! Mistral's SWA variants) keep two KV pools: the full layers' pool grows with the
//! sequence, the window layers' pool needs only the last `window` tokens of each
//! request. A token gets a slot in both: its **full slot** is what the caller, the
//! request rows and the prefix cache see; its **window slot** is found through the
//! *mapping*. Pages map to pages: full page `P` with window page `W` maps slot
//! `P*ps + k` to `W*ps + k`; the mapping is read one entry per full slot
//! ([`SwaWindow::slot_of`], [`SwaWindow::copy_mapping`]: `(full pages + 1) * page_size`
//! entries, 0 for a full slot without a window slot: free, or its window part
//! released), and kept as one `u32` per full page and one bit per full page saying that
//! the page has its window page.
//!
//! * [`alloc`](KvAllocator::alloc), [`alloc_extend`](KvAllocator::alloc_extend) and
//!   [`alloc_decode`](KvAllocator::alloc_decode) take fresh pages from both pools or
//!   from neither, under concurrency too (the second reservation failing gives the first
//!   back before the error returns), with the paged semantics of [`PagedAllocator`];
//! * [`free`](KvAllocator::free) frees both parts;
//!   [`free_swa`](SwaAllocator::free_swa) frees only the window part of pages that fell
//!   out of a request's window, and clears their mapping;
//! * [`available_size`](KvAllocator::available_size) is the smaller of the two pools'.
//!
//! A page's window part is released by whoever clears its bit, one read-modify-write
//! per 64 pages of a run: a window page is freed exactly once even when two threads free
//! the same full page at once (a caller's double free), and the full pool then refuses
//! one of them, as it always does. (As with any allocator, a double free that races
//! with the page being freed and handed out again cannot be told from a free by the
//! new owner.) Window pages are freed a run of consecutive pages at a time.
//!
//! # Examples
//!
//! ```
//! use kvpool::alloc::SwaAllocator;
//! use kvpool::KvAllocator;
//!
//! // 64 tokens for the full layers, 16 for the window layers, pages of 4.
//! let alloc = SwaAllocator::new(64, 16, 4)?;
//! let mut a = [0u32; 8];
//! alloc.alloc(&mut a)?;                     // two pages from each pool
//! assert_eq!(a, [4, 5, 6, 7, 8, 9, 10, 11]); // the full slots
//! assert_eq!(alloc.window_slot(a[5]), Some(9)); // window page 2, offset 1
//! assert_eq!(alloc.available_size(), 8);      // min(56, 8)
//!
//! // The first page fell out of the request's window: release its window part only.
//! assert_eq!(alloc.free_swa(&a[..4])?, 4);
//! assert_eq!(alloc.window_slot(a[0]), None);
//! assert_eq!(alloc.window_available_size(), 12);
//!
//! alloc.free(&a)?;                          // the rest of both pools
//! assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (64, 16));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt;

use super::expand::{self, BatchPlan};
use super::{plan_decode, plan_extend, KvAllocator, KvFreeGroup, PagedAllocator};
use crate::error::{AllocError, ConfigError, FreeError, InvalidInput, InvariantViolation, OutOfMemory, Unit};
use crate::slots::bit_words;
use crate::slots::{FreeGroup, Reservation};
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A full pool and a smaller sliding-window pool that allocate together, and the
/// mapping between them (described in the module docs of `src/alloc/swa.rs`).
pub struct SwaAllocator {
    full: PagedAllocator,
    window: SwaWindow,
}

/// The window half of an [`SwaAllocator`]: its pool and the full-to-window mapping.
pub struct SwaWindow {
    pages: PagedAllocator,
    /// For each full page: its window page, meaningful while its `held` bit is set.
    map: Box<[AtomicU32]>,
    /// Bit `p`: full page `p` has its window page (`map[p]`). Set by the page's owner
    /// after writing `map[p]` (Release); cleared by whoever releases the window page
    /// (AcqRel), which then reads `map[p]`.
    held: Box<[AtomicU64]>,
}

impl SwaAllocator {
    /// A full pool of `full_size` tokens and a window pool of `window_size` tokens, both
    /// in pages of `page_size` (a remainder is unused, as in SGLang). The mapping takes
    /// 4 bytes per full slot.
    ///
    /// # Errors
    ///
    /// As [`PagedAllocator::new`] for either pool; [`ConfigError::Zero`] when a pool
    /// has no whole page; [`ConfigError::TooLargeForMemory`] for the mapping.
    pub fn new(full_size: usize, window_size: usize, page_size: u32) -> Result<Self, ConfigError> {
        let full = PagedAllocator::new(full_size, page_size)?;
        // Claimed in parts of one reservation: a pool that never parks blocks.
        let pages = PagedAllocator::without_parking(window_size, page_size)?;
        if full.num_pages() == 0 {
            return Err(ConfigError::Zero("the full pool's pages"));
        }
        if pages.num_pages() == 0 {
            return Err(ConfigError::Zero("the sliding-window pool's pages"));
        }
        let entries = full.num_pages() as usize + 1;
        let map = crate::arena::try_vec_with(entries, "the full-to-window mapping", |_| AtomicU32::new(0))?;
        let held = crate::arena::try_vec_with(entries.div_ceil(64), "the window-page bits", |_| AtomicU64::new(0))?;
        let window = SwaWindow { pages, map: map.into_boxed_slice(), held: held.into_boxed_slice() };
        Ok(SwaAllocator { full, window })
    }

    /// The window half: its pool's sizes and the mapping.
    pub fn window(&self) -> &SwaWindow {
        &self.window
    }

    /// Free tokens in the full pool.
    pub fn full_available_size(&self) -> usize {
        self.full.available_size()
    }

    /// Free tokens in the window pool (SGLang's `swa_available_size`).
    pub fn window_available_size(&self) -> usize {
        self.window.available_size()
    }

    /// Token capacity of the window pool.
    pub fn window_size(&self) -> usize {
        self.window.size()
    }

    /// The window slot of full slot `slot` (SGLang's `translate_loc_from_full_to_swa`),
    /// `None` when it has none.
    pub fn window_slot(&self, slot: u32) -> Option<u32> {
        self.window.slot_of(slot)
    }

    /// The window slots of `full` into `out` (0 where a slot has none).
    ///
    /// # Errors
    ///
    /// [`InvalidInput::LengthMismatch`] when the lengths differ.
    pub fn translate(&self, full: &[u32], out: &mut [u32]) -> Result<(), InvalidInput> {
        if full.len() != out.len() {
            return Err(InvalidInput::LengthMismatch { what: "out", got: out.len(), expected: full.len() });
        }
        for (o, &s) in out.iter_mut().zip(full) {
            *o = self.window.slot_of(s).unwrap_or(0);
        }
        Ok(())
    }

    /// Free the window part of the pages `slots` lie in (SGLang's `free_swa`): tokens
    /// that fell out of their request's sliding window. Their full slots stay allocated
    /// (the full layers still attend to them); their mapping is cleared. Pages whose
    /// window part is gone already are skipped. Returns the window tokens freed.
    ///
    /// Name only slots the caller owns: the window part of a page a prefix cache holds
    /// is the cache's (an [`SwaRadixCache`](crate::radix::SwaRadixCache) request frees
    /// its window through [`release_window`](crate::radix::Request::release_window),
    /// which checks that).
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first slot whose full page is out of range or not
    /// allocated; nothing is freed then.
    pub fn free_swa(&self, slots: &[u32]) -> Result<usize, FreeError> {
        self.check_allocated(slots)?;
        let mut wgroup = self.window.group();
        self.window.release_slots(slots, &mut wgroup);
        Ok(wgroup.end() * self.full.page_size as usize)
    }

    /// Every full page of `slots` is in range and allocated, or the error the full pool
    /// would give (nothing changes either way).
    fn check_allocated(&self, slots: &[u32]) -> Result<(), FreeError> {
        if slots.iter().all(|&s| self.full.is_allocated(s)) {
            return Ok(());
        }
        let bad = slots.iter().copied().find(|&s| !self.full.is_allocated(s)).unwrap_or(0);
        let e = if bad < self.full.page_size || self.full.page_of(bad) > self.full.num_pages() {
            crate::error::FreeErrorKind::OutOfRange {
                first: self.full.page_size,
                last: ((self.full.num_pages() as u64 + 1) * self.full.page_size as u64 - 1) as u32,
            }
        } else {
            crate::error::FreeErrorKind::NotAllocated
        };
        Err(FreeError { index: bad, kind: e, rest_freed: false })
    }

    fn window_oom(&self, refused: OutOfMemory) -> AllocError {
        let ps = self.full.page_size as usize;
        AllocError::OutOfMemory(OutOfMemory {
            requested: refused.requested * ps,
            available: refused.available * ps,
            evictable: None,
            unit: Unit::WindowTokens,
        })
    }

    /// Reserve `n` pages in both pools, or in neither. The window pool does not park
    /// blocks, so its reservation is all in its words, and the window pages are
    /// claimed in parts of it (`claim_both`, `map_window`).
    fn reserve_both(&self, n: usize) -> Result<Reservation, AllocError> {
        if n == 0 {
            return Ok(Reservation::words(0));
        }
        let full = self.full.pages.reserve(n, Unit::Pages).map_err(|e| self.full.oom(e))?;
        match self.window.pages.pages.reserve(n, Unit::Pages) {
            Ok(window) => {
                debug_assert_eq!(window, Reservation::words(n), "the window pool parks no blocks");
                Ok(full)
            }
            Err(e) => {
                // Give the full reservation back before the error is seen: a failed
                // call holds nothing of either pool.
                self.full.pages.unreserve(full);
                Err(self.window_oom(e))
            }
        }
    }

    /// Claim the reserved pages: full pages into `out[..n]`, each mapped to a fresh
    /// window page.
    fn claim_both(&self, full: Reservation, out: &mut [u32]) {
        self.full.pages.claim(full, out);
        self.map_to_window(out);
    }

    /// Map each of the claimed full pages `out` (reserved in the window pool too), in
    /// order, to a fresh window page.
    fn map_to_window(&self, out: &[u32]) {
        let map = &self.window.map;
        let mut k = 0;
        // The window pages straight into the mapping, a claimed word at a time.
        self.window.pages.pages.claim_with(Reservation::words(out.len()), |w, mut take| {
            while take != 0 {
                let page = (w * 64) as u32 + take.trailing_zeros() + 1;
                take &= take - 1;
                map[out[k] as usize].store(page, Ordering::Relaxed);
                k += 1;
            }
        });
        self.window.publish(out.iter().copied());
    }

    /// Reserve the batch's new pages in both pools, claim the full pages and write the
    /// batch's slots straight from the claim (as `PagedAllocator` does), then map each
    /// claimed full page, in claim order, to a fresh window page. `breaks(p)` hears
    /// every position `p` where a request's slots stop being consecutive.
    fn claim_and_fill<R>(
        &self,
        plan: BatchPlan,
        out: &mut [u32],
        req: R,
        batch: usize,
        breaks: impl FnMut(usize),
    ) -> Result<(), AllocError>
    where
        R: Fn(usize) -> (u32, u32, u32),
    {
        let full = self.reserve_both(plan.new_pages)?;
        // The full stretches, in claim order, mapped to window pages `STAGE` at a time.
        let mut stage = [(0u32, 0u32); STAGE];
        let mut staged = 0;
        self.full.place_claimed(full, out, req, batch, breaks, |page, count| {
            if staged == STAGE {
                self.map_window(&stage);
                staged = 0;
            }
            stage[staged] = (page, count as u32);
            staged += 1;
        });
        self.map_window(&stage[..staged]);
        crate::debug_check(self);
        Ok(())
    }

    /// Map the full pages of `stretches`, in order, to fresh (reserved) window pages,
    /// claimed in one call: an ascending store per page into the mapping, and the
    /// held bits one read-modify-write per 64 pages.
    fn map_window(&self, stretches: &[(u32, u32)]) {
        let n: u32 = stretches.iter().map(|s| s.1).sum();
        let map = &self.window.map;
        let (mut s, mut used) = (0, 0u32);
        // A part of the window's reservation, which is all in its words.
        self.window.pages.pages.claim_stretches(Reservation::words(n as usize), |mut window, count| {
            let mut count = count as u32;
            while count > 0 {
                let (full, len) = stretches[s];
                let take = (len - used).min(count);
                let at = (full + used) as usize;
                for (e, w) in map[at..at + take as usize].iter().zip(window..) {
                    e.store(w, Ordering::Relaxed);
                }
                (used, window, count) = (used + take, window + take, count - take);
                if used == len {
                    (s, used) = (s + 1, 0);
                }
            }
        });
        for &(full, len) in stretches {
            self.window.publish_run(full, len);
        }
    }

    fn reserve_and_expand<R>(&self, plan: BatchPlan, out: &mut [u32], req: R, batch: usize) -> Result<(), AllocError>
    where
        R: Fn(usize) -> (u32, u32, u32),
    {
        let full = self.reserve_both(plan.new_pages)?;
        self.claim_both(full, &mut out[..plan.new_pages]);
        expand::expand_in_place(self.full.page_size, batch, req, plan.new_pages, out);
        crate::debug_check(self);
        Ok(())
    }
}

/// Full-page stretches [`SwaAllocator`]'s extends gather before mapping them to window
/// pages with one claim (2 KiB of stack): a request of more stretches than this gets
/// its window pages in several claims.
const STAGE: usize = 256;

impl SwaWindow {
    /// Token capacity of the window pool.
    pub fn size(&self) -> usize {
        KvAllocator::size(&self.pages)
    }

    /// Free tokens in the window pool.
    pub(crate) fn available_size(&self) -> usize {
        self.pages.available_size()
    }

    /// Entries of the mapping: one per full slot, page 0 included.
    pub(crate) fn mapping_len(&self) -> usize {
        self.map.len() * self.pages.page_size as usize
    }

    /// The window page of full page `page`, if it has one (a snapshot under
    /// concurrency).
    #[inline]
    fn page_of(&self, page: u32) -> Option<u32> {
        let (w, bit) = (page as usize / 64, page as usize % 64);
        // Acquire: pairs with the Release that set the bit after `map[page]` was written.
        let held = self.held.get(w)?.load(Ordering::Acquire) >> bit & 1 != 0;
        held.then(|| self.map[page as usize].load(Ordering::Relaxed))
    }

    /// The window slot of full slot `slot`, `None` when it has none (or is out of
    /// range).
    #[inline]
    pub(crate) fn slot_of(&self, slot: u32) -> Option<u32> {
        let ps = self.pages.page_size;
        self.page_of(slot / ps).map(|w| w * ps + slot % ps)
    }

    /// Copy the mapping entries `first..first + out.len()` into `out` (for uploading
    /// the mapping to a device, a range at a time).
    ///
    /// # Errors
    ///
    /// [`InvalidInput::OutOfBounds`] when the range passes the end of the mapping.
    pub fn copy_mapping(&self, first: usize, out: &mut [u32]) -> Result<(), InvalidInput> {
        let len = self.mapping_len();
        if first.checked_add(out.len()).filter(|&e| e <= len).is_none() {
            let end = first.saturating_add(out.len());
            return Err(InvalidInput::OutOfBounds { what: "the full-to-window mapping", end, len });
        }
        let ps = self.pages.page_size as usize;
        let mut at = 0;
        while at < out.len() {
            let slot = first + at;
            let (page, k) = (slot / ps, slot % ps);
            let n = (ps - k).min(out.len() - at);
            let base = self.page_of(page as u32).map_or(0, |w| w as usize * ps + k);
            for (i, o) in out[at..at + n].iter_mut().enumerate() {
                *o = if base == 0 { 0 } else { (base + i) as u32 };
            }
            at += n;
        }
        Ok(())
    }

    /// Whether full page `page` has its window part.
    #[inline]
    pub(crate) fn is_mapped(&self, page: u32) -> bool {
        self.page_of(page).is_some()
    }

    /// Whether every full page of `first..first + pages` has its window part (one load
    /// per 64 pages).
    pub(crate) fn all_mapped(&self, first: u32, pages: u32) -> bool {
        bit_words(first as usize, pages as usize)
            .all(|(w, m)| self.held.get(w).is_some_and(|h| h.load(Ordering::Acquire) & m == m))
    }

    /// Whether no full page of `first..first + pages` has its window part.
    pub(crate) fn none_mapped(&self, first: u32, pages: u32) -> bool {
        bit_words(first as usize, pages as usize)
            .all(|(w, m)| self.held.get(w).map_or(true, |h| h.load(Ordering::Acquire) & m == 0))
    }

    fn group(&self) -> FreeGroup<'_> {
        self.pages.pages.free_group()
    }

    /// [`publish`](Self::publish) the full pages `first..first + count`.
    fn publish_run(&self, first: u32, count: u32) {
        for (w, mask) in bit_words(first as usize, count as usize) {
            self.held[w].fetch_or(mask, Ordering::Release);
        }
    }

    /// Set the bits of full pages `pages` (their `map` entries written), one
    /// read-modify-write per stretch of pages in one bitmap word.
    fn publish(&self, pages: impl Iterator<Item = u32>) {
        for (w, mask) in words_of_pages(pages) {
            self.held[w].fetch_or(mask, Ordering::Release);
        }
    }

    /// Take the window pages of the full pages of bitmap `words` (and masks): clear
    /// their bits, one read-modify-write per word (none where every bit is clear
    /// already), and pass the window pages this call took to `took`, in runs of
    /// consecutive pages (first, count).
    fn take_words(&self, words: impl Iterator<Item = (usize, u64)>, mut took: impl FnMut(u32, u32)) {
        for (w, mask) in words {
            let Some(word) = self.held.get(w) else { continue };
            let live = word.load(Ordering::Relaxed) & mask;
            if live == 0 {
                continue;
            }
            // AcqRel: exactly one caller clears a set bit (and so frees the window page);
            // the owner's `map` store happens-before it.
            let mut got = word.fetch_and(!live, Ordering::AcqRel) & live;
            while got != 0 {
                // A stretch of consecutive bits at a time.
                let (lo, n) = (got.trailing_zeros() as usize, (got >> got.trailing_zeros()).trailing_ones() as usize);
                got &= !((u64::MAX >> (64 - n)) << lo);
                let base = w * 64 + lo;
                let first = self.map[base].load(Ordering::Relaxed);
                // Pages allocated together map to consecutive window pages: a whole run
                // in one call when they do.
                let mut diff = 0u32;
                for (k, e) in self.map[base..base + n].iter().enumerate() {
                    diff |= e.load(Ordering::Relaxed) ^ first.wrapping_add(k as u32);
                }
                if diff == 0 {
                    took(first, n as u32);
                } else {
                    for e in &self.map[base..base + n] {
                        took(e.load(Ordering::Relaxed), 1);
                    }
                }
            }
        }
    }

    /// Release the window part of full pages `first..first + pages` into `wgroup`;
    /// returns the window pages freed.
    pub(crate) fn release_pages(&self, first: u32, pages: u32, wgroup: &mut FreeGroup<'_>) -> usize {
        self.release_words(bit_words(first as usize, pages as usize), wgroup)
    }

    /// Release the window part of the full pages `pages` (repeats allowed) into
    /// `wgroup`; returns the window pages freed.
    fn release_page_iter(&self, pages: impl Iterator<Item = u32>, wgroup: &mut FreeGroup<'_>) -> usize {
        self.release_words(words_of_pages(pages), wgroup)
    }

    /// Release the window part of the full pages of bitmap `words` (and masks) into
    /// `wgroup`, a run of consecutive window pages at a time; returns the window pages
    /// freed.
    fn release_words(&self, words: impl Iterator<Item = (usize, u64)>, wgroup: &mut FreeGroup<'_>) -> usize {
        let mut runs = WindowRuns::new();
        let mut n = 0;
        self.take_words(words, |w, len| {
            runs.push(w, len, wgroup);
            n += len as usize;
        });
        runs.flush(wgroup);
        n
    }

    /// Release the window part of the full pages `slots` lie in into `wgroup`, a page
    /// once however many of its slots are named; returns the window pages freed. The
    /// caller has checked that every slot's page is allocated.
    pub(crate) fn release_slots(&self, slots: &[u32], wgroup: &mut FreeGroup<'_>) -> usize {
        // The window pool's page size is the full pool's: its `page_of` is theirs.
        self.release_page_iter(slots.iter().map(|&s| self.pages.page_of(s)), wgroup)
    }

    /// Release the window part of full pages `first..first + pages` at once; returns
    /// the window tokens freed.
    pub(crate) fn release_now(&self, first: u32, pages: u32) -> usize {
        let mut g = self.group();
        self.release_pages(first, pages, &mut g);
        g.end() * self.pages.page_size as usize
    }

    /// Move full page `from`'s window page to full page `to`, which has none (a prefix
    /// cache reviving a page of its own with a request's window KV of the same tokens).
    /// Returns whether `from` had one.
    pub(crate) fn move_page(&self, from: u32, to: u32) -> bool {
        debug_assert!(!self.is_mapped(to), "the receiving page has a window part already");
        let mut moved = None;
        self.take_words(words_of_pages(core::iter::once(from)), |w, _| moved = Some(w));
        let Some(w) = moved else { return false };
        self.map[to as usize].store(w, Ordering::Relaxed);
        self.publish(core::iter::once(to));
        true
    }
}

/// The bitmap words of `pages` with the mask of their pages in each, a word per stretch
/// of pages that fall in one word (repeats merge).
fn words_of_pages(pages: impl Iterator<Item = u32>) -> impl Iterator<Item = (usize, u64)> {
    let mut pages = pages.peekable();
    core::iter::from_fn(move || {
        let p = pages.next()?;
        let w = p as usize / 64;
        let mut mask = 1u64 << (p % 64);
        while let Some(q) = pages.next_if(|&q| q as usize / 64 == w) {
            mask |= 1 << (q % 64);
        }
        Some((w, mask))
    })
}

/// Window pages waiting to be freed into a group: the current run of consecutive
/// pages, freed with one check and one read-modify-write per 64 pages.
struct WindowRuns {
    first: u32,
    len: u32,
}

impl WindowRuns {
    fn new() -> Self {
        WindowRuns { first: 0, len: 0 }
    }

    fn push(&mut self, w: u32, len: u32, group: &mut FreeGroup<'_>) {
        if self.len > 0 && self.first.checked_add(self.len) == Some(w) {
            self.len += len;
        } else {
            self.flush(group);
            (self.first, self.len) = (w, len);
        }
    }

    fn flush(&mut self, group: &mut FreeGroup<'_>) {
        if self.len > 0 {
            let r = group.free_range(self.first, self.len);
            // A window page is freed only by the caller whose bit clear took it.
            debug_assert!(r.is_ok(), "a mapped window page failed to free: {r:?}");
            self.len = 0;
        }
    }
}

/// The window half of a [`KvFreeGroup`] over an [`SwaAllocator`].
pub(crate) struct WindowFrees<'a> {
    pub(crate) window: &'a SwaWindow,
    pub(crate) group: FreeGroup<'a>,
}

impl KvAllocator for SwaAllocator {
    fn page_size(&self) -> u32 {
        self.full.page_size
    }
    /// The full pool's capacity (what request rows and a prefix cache address).
    fn size(&self) -> usize {
        self.full.size()
    }
    /// The smaller of the two pools' free tokens.
    fn available_size(&self) -> usize {
        self.full.available_size().min(self.window.available_size())
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        let ps = self.full.page_size as usize;
        if out.len() % ps != 0 {
            return Err(InvalidInput::NotPageAligned { count: out.len(), page_size: ps as u32 }.into());
        }
        let n = out.len() / ps;
        self.reserve_and_expand(BatchPlan { new_pages: n, new_tokens: out.len() }, out, |_| (0, 0, 0), 0)?;
        if ps > 1 {
            // The batch had no requests to expand: pages to slots, backwards.
            for p in (0..n).rev() {
                let base = out[p] * ps as u32;
                for k in (0..ps).rev() {
                    out[p * ps + k] = base + k as u32;
                }
            }
        }
        Ok(())
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        let plan = plan_extend(self.full.page_size, prefix_lens, seq_lens)?;
        self.full.check_batch(plan, seq_lens.len(), last_locs, out, |i| (prefix_lens[i], seq_lens[i]))?;
        self.claim_and_fill(plan, out, |i| (prefix_lens[i], seq_lens[i], last_locs[i]), seq_lens.len(), |_| {})
    }
    fn alloc_extend_runs(
        &self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
        out: &mut [u32],
        breaks: &mut dyn FnMut(usize),
    ) -> Result<bool, AllocError> {
        let plan = plan_extend(self.full.page_size, &[prefix_len], &[seq_len])?;
        self.full.check_batch(plan, 1, &[last_loc], out, |_| (prefix_len, seq_len))?;
        self.claim_and_fill(plan, out, |_| (prefix_len, seq_len, last_loc), 1, breaks).map(|()| true)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        let plan = plan_decode(self.full.page_size, seq_lens)?;
        self.full.check_batch(plan, seq_lens.len(), last_locs, out, |i| (seq_lens[i] - 1, seq_lens[i]))?;
        if self.full.page_size == 1 {
            // As `PagedAllocator::alloc_decode`: each request's run goes on where it can.
            let full = self.reserve_both(out.len())?;
            self.full.pages.claim_following(full, out, |i| last_locs[i]);
            self.map_to_window(out);
            crate::debug_check(self);
            return Ok(());
        }
        self.reserve_and_expand(plan, out, |i| (seq_lens[i] - 1, seq_lens[i], last_locs[i]), seq_lens.len())
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        let mut group = self.free_group();
        let r = group.free(slots);
        group.end();
        r
    }
    fn free_group(&self) -> KvFreeGroup<'_> {
        let mut g = self.full.free_group();
        g.window = Some(WindowFrees { window: &self.window, group: self.window.group() });
        g
    }
    #[inline]
    fn is_allocated(&self, slot: u32) -> bool {
        self.full.is_allocated(slot)
    }
    fn pages_allocated(&self, first_page: u32, pages: u32) -> bool {
        self.full.pages.all_allocated(first_page, pages)
    }
    fn as_swa(&self) -> Option<&SwaAllocator> {
        Some(self)
    }
    fn clear(&mut self) {
        self.full.clear();
        self.window.pages.clear();
        for e in self.window.map.iter() {
            e.store(0, Ordering::Relaxed);
        }
        for e in self.window.held.iter() {
            e.store(0, Ordering::Relaxed);
        }
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.full.check_invariants()?;
        self.window.pages.check_invariants()?;
        let bad = |m: String| Err(InvariantViolation(format!("swa allocator: {m}")));
        let wpages = self.window.pages.num_pages() as usize;
        let mut used = vec![false; wpages + 1];
        let mut mapped = 0usize;
        let pages = self.window.map.len();
        for (w, word) in self.window.held.iter().enumerate() {
            let bits = word.load(Ordering::Acquire);
            // Bits of pages 1..pages only (page 0 is nobody's).
            let valid = pages.saturating_sub(w * 64).min(64);
            let mut allowed = if valid == 64 { u64::MAX } else { (1u64 << valid) - 1 };
            if w == 0 {
                allowed &= !1;
            }
            if bits & !allowed != 0 {
                return bad(format!("bitmap word {w} marks pages that do not exist: {bits:#x}"));
            }
        }
        for p in 1..pages {
            let Some(wp) = self.window.page_of(p as u32) else { continue };
            if !self.full.pages.is_allocated(p as u32) {
                return bad(format!("full page {p} is free but maps to window page {wp}"));
            }
            let wp = wp as usize;
            if wp == 0 || wp > wpages {
                return bad(format!("full page {p} maps to window page {wp}, out of range"));
            }
            if !self.window.pages.pages.is_allocated(wp as u32) {
                return bad(format!("full page {p} maps to window page {wp}, which is free"));
            }
            if core::mem::replace(&mut used[wp], true) {
                return bad(format!("window page {wp} is mapped from two full pages"));
            }
            mapped += 1;
        }
        // Allocated window pages by their bits, not `num_pages - available`: a window
        // page freed inside a still-open free group is free (its mapping is gone) but not
        // yet counted as available.
        let held = (1..=wpages as u32).filter(|&w| self.window.pages.pages.is_allocated(w)).count();
        if mapped != held {
            return bad(format!("{held} window pages are allocated but {mapped} are mapped"));
        }
        Ok(())
    }
}

impl crate::CheckInvariants for SwaAllocator {
    fn check(&self) -> Result<(), InvariantViolation> {
        KvAllocator::check_invariants(self)
    }
}

impl fmt::Debug for SwaAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwaAllocator")
            .field("page_size", &self.full.page_size)
            .field("full_pages", &self.full.num_pages())
            .field("window_pages", &self.window.pages.num_pages())
            .field("full_available", &self.full_available_size())
            .field("window_available", &self.window_available_size())
            .finish()
    }
}

impl fmt::Debug for SwaWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwaWindow")
            .field("page_size", &self.pages.page_size)
            .field("pages", &self.pages.num_pages())
            .field("available", &self.available_size())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::FreeErrorKind;

    fn check(a: &SwaAllocator) {
        KvAllocator::check_invariants(a).unwrap();
    }

    #[test]
    fn window_pages_freed_in_whole_blocks_come_back_at_page_size_1() {
        // The window pool is claimed in parts of one reservation: whole blocks freed
        // into it must not be parked (a reservation with blocks in it cannot be cut
        // into parts; in a release build the parts' claims looped forever).
        let a = SwaAllocator::new(4096, 2048, 1).unwrap();
        let mut all = vec![0u32; 2048];
        a.alloc(&mut all).unwrap();
        a.free(&all).unwrap();
        let (mut x, mut y) = (vec![0u32; 1500], vec![0u32; 548]);
        a.alloc(&mut x).unwrap();
        a.alloc(&mut y).unwrap();
        assert_eq!((a.full_available_size(), a.window_available_size()), (2048, 0));
        check(&a);
        a.free(&x).unwrap();
        a.free(&y).unwrap();
        assert_eq!((a.full_available_size(), a.window_available_size()), (4096, 2048));
        check(&a);
    }

    #[test]
    fn alloc_takes_both_or_neither() {
        // Window pool short: nothing is taken from the full pool.
        let a = SwaAllocator::new(64, 8, 4).unwrap();
        let mut out = [0u32; 12];
        let e = a.alloc(&mut out).unwrap_err();
        match e {
            AllocError::OutOfMemory(oom) => {
                assert_eq!((oom.requested, oom.available, oom.unit), (12, 8, Unit::WindowTokens))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((a.full_available_size(), a.window_available_size()), (64, 8));
        check(&a);
        // Full pool short: nothing is taken from the window pool.
        let a = SwaAllocator::new(8, 64, 4).unwrap();
        let e = a.alloc(&mut out).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory(OutOfMemory { unit: Unit::Tokens, .. })));
        assert_eq!((a.full_available_size(), a.window_available_size()), (8, 64));
        check(&a);
    }

    #[test]
    fn mapping_follows_pages_and_is_cleared_on_free() {
        let a = SwaAllocator::new(32, 16, 2).unwrap();
        let mut out = [0u32; 6];
        a.alloc(&mut out).unwrap();
        assert_eq!(out, [2, 3, 4, 5, 6, 7]);
        let mut w = [0u32; 6];
        a.translate(&out, &mut w).unwrap();
        assert_eq!(w, [2, 3, 4, 5, 6, 7]);
        check(&a);
        a.free(&out[2..4]).unwrap();
        assert_eq!(a.window_slot(4), None);
        assert_eq!(a.window_slot(5), None);
        assert_eq!((a.full_available_size(), a.window_available_size()), (28, 12));
        check(&a);
        // The freed pages come back mapped again.
        let mut again = [0u32; 2];
        a.alloc(&mut again).unwrap();
        assert_eq!(again, [4, 5]);
        assert_eq!(a.window_slot(5), Some(5));
        check(&a);
    }

    #[test]
    fn free_swa_releases_the_window_part_only() {
        let a = SwaAllocator::new(32, 16, 4).unwrap();
        let mut out = [0u32; 12];
        a.alloc(&mut out).unwrap();
        assert_eq!(a.free_swa(&out[..8]).unwrap(), 8);
        assert_eq!((a.full_available_size(), a.window_available_size()), (20, 12));
        // Again: nothing left to release there.
        assert_eq!(a.free_swa(&out[..8]).unwrap(), 0);
        check(&a);
        // The full free then releases the full pages (and the rest of the window).
        a.free(&out).unwrap();
        assert_eq!((a.full_available_size(), a.window_available_size()), (32, 16));
        check(&a);
    }

    #[test]
    fn bad_frees_change_nothing() {
        let a = SwaAllocator::new(32, 16, 4).unwrap();
        let mut out = [0u32; 8];
        a.alloc(&mut out).unwrap();
        let e = a.free_swa(&[out[0], 20]).unwrap_err();
        assert_eq!((e.index, e.kind), (20, FreeErrorKind::NotAllocated));
        let e = a.free_swa(&[out[0], 400]).unwrap_err();
        assert!(matches!(e.kind, FreeErrorKind::OutOfRange { .. }));
        let e = a.free(&[out[0], 20]).unwrap_err();
        assert_eq!(e.kind, FreeErrorKind::NotAllocated);
        assert_eq!(a.window_slot(out[0]), Some(out[0]));
        assert_eq!((a.full_available_size(), a.window_available_size()), (24, 8));
        check(&a);
        a.free(&out).unwrap();
        let e = a.free(&out).unwrap_err();
        assert_eq!(e.kind, FreeErrorKind::NotAllocated);
        check(&a);
    }

    #[test]
    fn extend_and_decode_map_only_new_pages() {
        let a = SwaAllocator::new(256, 64, 4).unwrap();
        let mut first = [0u32; 8];
        a.alloc(&mut first).unwrap(); // pages 1, 2
        let mut out = [0u32; 9];
        a.alloc_extend(&[1, 3], &[6, 7], &[4, 10], &mut out).unwrap();
        // DESIGN.md's vector: the partial pages continue, pages 3 and 4 are new.
        assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
        assert_eq!(a.window_slot(12), Some(12));
        assert_eq!(a.window_slot(18), Some(18));
        assert_eq!(a.window_available_size(), 64 - 16);
        let mut d = [0u32; 2];
        a.alloc_decode(&[7, 8], &[13, 18], &mut d).unwrap();
        assert_eq!(d, [14, 19]);
        assert_eq!(a.window_available_size(), 64 - 16);
        let mut d = [0u32; 1];
        a.alloc_decode(&[9], &[19], &mut d).unwrap();
        assert_eq!((d[0], a.window_slot(20)), (20, Some(20)));
        assert_eq!(a.window_available_size(), 64 - 20);
        check(&a);
        // Window short for the decode's new page: nothing changes.
        let b = SwaAllocator::new(64, 4, 4).unwrap();
        let mut one = [0u32; 4];
        b.alloc(&mut one).unwrap();
        let mut d = [0u32; 1];
        let e = b.alloc_decode(&[5], &[7], &mut d).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory(OutOfMemory { unit: Unit::WindowTokens, .. })));
        assert_eq!(b.full_available_size(), 60);
        // A decode that continues its page needs no window page.
        b.alloc_decode(&[4], &[6], &mut d).unwrap();
        assert_eq!(d, [7]);
        check(&b);
    }

    #[test]
    fn token_pools() {
        let a = SwaAllocator::new(100, 10, 1).unwrap();
        let mut out = [0u32; 10];
        a.alloc(&mut out).unwrap();
        assert_eq!(a.available_size(), 0);
        assert!(a.alloc(&mut [0u32; 1]).is_err());
        a.free_swa(&out[..3]).unwrap();
        assert_eq!(a.available_size(), 3);
        let mut more = [0u32; 3];
        a.alloc(&mut more).unwrap();
        assert_eq!(more, [11, 12, 13]);
        assert_eq!(a.window_slot(11), Some(1));
        check(&a);
        let mut group = a.free_group();
        group.free(&out).unwrap();
        group.free_pages(11, 3).unwrap();
        assert_eq!(group.end(), 13);
        assert_eq!((a.full_available_size(), a.window_available_size()), (100, 10));
        check(&a);
    }

    #[test]
    fn config_errors() {
        assert!(matches!(SwaAllocator::new(64, 3, 4), Err(ConfigError::Zero(_))));
        assert!(matches!(SwaAllocator::new(64, 16, 0), Err(ConfigError::ZeroPageSize)));
        assert!(SwaAllocator::new(1 << 33, 16, 1).is_err());
        // `size / page_size + 1` is checked too (it overflowed, a panic, at page size 1)
        let too_large = ConfigError::TooLarge { size: u64::MAX, page_size: 1 };
        assert_eq!(SwaAllocator::new(usize::MAX, 16, 1).unwrap_err(), too_large);
        assert_eq!(SwaAllocator::new(16, usize::MAX, 1).unwrap_err(), too_large);
    }

    /// At page size 1 a slot named twice is freed once in both pools, with no error
    /// (as two slots of one page at a larger page size); it used to free both pools'
    /// parts and then report an error.
    #[test]
    fn free_merges_a_repeated_slot_in_both_pools() {
        for ps in [1u32, 4] {
            let a = SwaAllocator::new(16 * ps as usize, 8 * ps as usize, ps).unwrap();
            let mut s = vec![0u32; 2 * ps as usize];
            a.alloc(&mut s).unwrap();
            let (full, window) = (a.full_available_size(), a.window_available_size());
            KvAllocator::free(&a, &[s[0], s[0]]).unwrap();
            let freed = ps as usize;
            assert_eq!((a.full_available_size(), a.window_available_size()), (full + freed, window + freed));
            assert_eq!(a.window_slot(s[0]), None);
            assert!(a.window_slot(s[ps as usize]).is_some());
            check(&a);
        }
    }

    /// A refused free changes neither pool: the window part is released only after the
    /// full pool has validated the whole batch (repeats included).
    #[test]
    fn refused_free_releases_no_window_page() {
        for ps in [1u32, 4] {
            let a = SwaAllocator::new(16 * ps as usize, 8 * ps as usize, ps).unwrap();
            let mut s = vec![0u32; 2 * ps as usize];
            a.alloc(&mut s).unwrap();
            let before = (a.full_available_size(), a.window_available_size());
            let mapped = a.window_slot(s[0]);
            assert!(mapped.is_some());
            let unallocated = 10 * ps;
            for batch in [vec![s[0], s[0], unallocated], vec![s[0], unallocated, s[0]], vec![s[0], 0]] {
                let e = KvAllocator::free(&a, &batch).unwrap_err();
                assert!(!e.rest_freed, "{e:?}");
                let mut g = a.free_group();
                assert!(g.free(&batch).is_err());
                assert_eq!(g.end(), 0);
                assert_eq!((a.full_available_size(), a.window_available_size()), before, "{batch:?}");
                assert_eq!(a.window_slot(s[0]), mapped, "the window part stays mapped");
            }
            check(&a);
        }
    }

    /// Two requests continuing one partial page are refused by the dual allocator too
    /// (it shares the full pool's batch check).
    #[test]
    fn same_partial_page_twice_is_refused() {
        let a = SwaAllocator::new(64, 32, 4).unwrap();
        let mut page = [0u32; 4];
        a.alloc(&mut page).unwrap();
        let before = (a.full_available_size(), a.window_available_size());
        let mut out = [0u32; 2];
        let want = AllocError::Invalid(InvalidInput::SamePartialPage { earlier: 0, request: 1, last_loc: 4 });
        assert_eq!(a.alloc_extend(&[1, 1], &[2, 2], &[4, 4], &mut out), Err(want.clone()));
        assert_eq!(a.alloc_decode(&[2, 2], &[4, 4], &mut out), Err(want));
        assert_eq!((a.full_available_size(), a.window_available_size()), before);
        check(&a);
    }

    #[test]
    fn copy_mapping_is_bounded() {
        let a = SwaAllocator::new(16, 8, 4).unwrap();
        let mut out = [0u32; 4];
        a.alloc(&mut out).unwrap();
        let mut m = [9u32; 8];
        a.window().copy_mapping(0, &mut m).unwrap();
        assert_eq!(m, [0, 0, 0, 0, 4, 5, 6, 7]);
        assert_eq!(a.window().mapping_len(), 20);
        assert!(a.window().copy_mapping(16, &mut m).is_err());
        assert!(a.window().copy_mapping(usize::MAX, &mut m).is_err());
    }
}
