//! KV slot allocators: [`TokenAllocator`] (page size 1) and [`PagedAllocator`].
//!
//! Both sit on one [`SlotPool`] of *pages* (a token is a page of one slot) and follow
//! SGLang's numbering: with page size `ps` and `size` tokens there are `size / ps`
//! pages numbered from 1; page `p` holds slots `p*ps .. (p+1)*ps`, so slots
//! `0..ps` (page 0) are never handed out and a KV buffer needs `size + ps` rows.
//!
//! A batch allocation runs in three steps:
//!
//! 1. **plan** — count the new pages the batch needs ([`plan_extend`],
//!    [`plan_decode`]), validating it;
//! 2. **reserve** — take that many pages from the pool, all or nothing, lock-free;
//! 3. **expand** — turn the pages into per-token slots ([`expand_extend`],
//!    [`expand_decode`]): the pure function the GPU kernels are checked against.
//!
//! The host allocators fuse the claim with step 3: the bitmap hands out stretches of
//! consecutive pages, and each stretch is written straight into the caller's output
//! buffer as one ascending run of slots, equal to what `expand_extend` makes of the
//! claimed pages (a decode batch claims its pages into the buffer and expands them in
//! place). Either way a batch allocation touches no memory but the pool's bitmap and
//! the caller's buffer.

mod expand;
mod swa;

pub use expand::{expand_decode, expand_extend, new_pages, plan_decode, plan_extend, BatchPlan};
pub use swa::{SwaAllocator, SwaWindow};

use crate::error::{
    AllocError, ConfigError, FreeError, FreeErrorKind, InvalidInput, InvariantViolation, OutOfMemory, Unit,
};
use crate::slots::{FreeGroup, Reservation, SlotPool};
use core::mem::MaybeUninit;

mod owned {
    /// Only kvpool's allocators are [`OwnedAllocator`](super::OwnedAllocator)s.
    pub trait Sealed {}
}

/// The KV allocators a prefix cache can be built over: kvpool's own
/// ([`PagedAllocator`], [`TokenAllocator`], [`SwaAllocator`]). The cache takes one by
/// value, and none of them can be cloned or shared, so the cache is its allocator's
/// only user: nothing can free the tree's pages behind its back. Sealed: a wrapper
/// implementing [`KvAllocator`] (for fuzzing it with `kvpool::models`) may share what
/// it wraps, so it cannot back a cache:
///
/// ```compile_fail
/// use std::sync::Arc;
/// use kvpool::radix::{RadixCache, RadixConfig};
/// use kvpool::{AllocError, FreeError, InvariantViolation, KvAllocator, KvFreeGroup, PagedAllocator, ReqToTokenPool};
///
/// struct Shared(Arc<PagedAllocator>);
/// impl KvAllocator for Shared {
///     fn page_size(&self) -> u32 { self.0.page_size() }
///     fn size(&self) -> usize { KvAllocator::size(&*self.0) }
///     fn available_size(&self) -> usize { self.0.available_size() }
///     fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> { self.0.alloc(out) }
///     fn alloc_extend(&self, p: &[u32], s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
///         self.0.alloc_extend(p, s, l, out)
///     }
///     fn alloc_decode(&self, s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
///         self.0.alloc_decode(s, l, out)
///     }
///     fn free(&self, slots: &[u32]) -> Result<(), FreeError> { self.0.free(slots) }
///     fn free_group(&self) -> KvFreeGroup<'_> { self.0.free_group() }
///     fn is_allocated(&self, slot: u32) -> bool { self.0.is_allocated(slot) }
///     fn clear(&mut self) {}
///     fn check_invariants(&self) -> Result<(), InvariantViolation> { self.0.check_invariants() }
/// }
///
/// let pool = Arc::new(PagedAllocator::new(64, 4).unwrap());
/// // error[E0277]: the trait bound `Shared: OwnedAllocator` is not satisfied
/// let cache = RadixCache::new(Shared(Arc::clone(&pool)), ReqToTokenPool::new(1, 8).unwrap(), RadixConfig::default());
/// ```
pub trait OwnedAllocator: KvAllocator + owned::Sealed {}

impl owned::Sealed for PagedAllocator {}
impl OwnedAllocator for PagedAllocator {}
impl owned::Sealed for TokenAllocator {}
impl OwnedAllocator for TokenAllocator {}
impl owned::Sealed for SwaAllocator {}
impl OwnedAllocator for SwaAllocator {}

/// What the prefix cache (and a scheduler) needs from a KV allocator; implemented by
/// [`TokenAllocator`] and [`PagedAllocator`].
///
/// All methods take `&self` and are lock-free; see [`PagedAllocator`] for the exact
/// semantics, which both share (a token allocator is a paged one with `page_size 1`).
pub trait KvAllocator: Send + Sync {
    /// Tokens per page (1 for a token allocator).
    fn page_size(&self) -> u32;
    /// Token capacity: `pages * page_size`.
    fn size(&self) -> usize;
    /// Free tokens now (`free pages * page_size`).
    fn available_size(&self) -> usize;
    /// Allocate `out.len()` slots (a whole number of pages) into `out`.
    ///
    /// # Errors
    ///
    /// [`AllocError`]: out of memory, or `out.len()` is not a multiple of the page size.
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError>;
    /// Allocate the slots of an extend (prefill) batch; see [`PagedAllocator::alloc_extend`].
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
    /// [`alloc_extend`](Self::alloc_extend) for one request, also reporting where the
    /// slots it writes stop being consecutive: `breaks(p)` for every position `p >= 1`
    /// of `out`, ascending, with `out[p] != out[p - 1] + 1`. Returns whether it reported
    /// them; what was reported counts only on success.
    ///
    /// A prefix cache uses the report to cut a request's slots into runs without
    /// reading them back ([`Request::extend`](crate::radix::Request::extend)).
    /// The default reports nothing and returns `false`; kvpool's allocators report
    /// one call per run, found while claiming (see [`PagedAllocator::alloc_extend_runs`]).
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend); nothing changes on error.
    fn alloc_extend_runs(
        &self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
        out: &mut [u32],
        breaks: &mut dyn FnMut(usize),
    ) -> Result<bool, AllocError> {
        let _ = breaks;
        self.alloc_extend(&[prefix_len], &[seq_len], &[last_loc], out).map(|()| false)
    }
    /// Allocate one slot per request of a decode batch; see [`PagedAllocator::alloc_decode`].
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing changes on error.
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError>;
    /// Free token slots: the distinct pages they lie in (a slot or page named twice is
    /// freed once, at every page size; see [`PagedAllocator::free`]).
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming a slot that is out of range or not allocated; nothing is
    /// freed then.
    fn free(&self, slots: &[u32]) -> Result<(), FreeError>;
    /// Open a free group whose frees are published together when it ends.
    fn free_group(&self) -> KvFreeGroup<'_>;
    /// Whether `slot`'s page is allocated now.
    fn is_allocated(&self, slot: u32) -> bool;
    /// Whether every page of `first_page..first_page + pages` is allocated now (`true`
    /// for no pages). The default asks [`is_allocated`](Self::is_allocated) page by
    /// page; kvpool's allocators answer a bitmap word (64 pages) at a time.
    fn pages_allocated(&self, first_page: u32, pages: u32) -> bool {
        let ps = self.page_size();
        (0..pages).all(|k| {
            first_page.checked_add(k).and_then(|p| p.checked_mul(ps)).is_some_and(|slot| self.is_allocated(slot))
        })
    }
    /// Tokens needed to allocate this extend batch (new pages times page size).
    ///
    /// # Errors
    ///
    /// [`InvalidInput`] for a malformed batch.
    fn extend_need(&self, prefix_lens: &[u32], seq_lens: &[u32]) -> Result<usize, InvalidInput> {
        Ok(plan_extend(self.page_size(), prefix_lens, seq_lens)?.new_pages * self.page_size() as usize)
    }
    /// Tokens needed to allocate this decode batch.
    ///
    /// # Errors
    ///
    /// [`InvalidInput`] for a malformed batch.
    fn decode_need(&self, seq_lens: &[u32]) -> Result<usize, InvalidInput> {
        Ok(plan_decode(self.page_size(), seq_lens)?.new_pages * self.page_size() as usize)
    }
    /// This allocator as a dual allocator ([`SwaAllocator`]); `None` for every other.
    /// The sliding-window prefix cache reaches its window pool through this.
    #[doc(hidden)]
    fn as_swa(&self) -> Option<&SwaAllocator> {
        None
    }
    /// Free everything (exclusive access, so no operation is in flight).
    fn clear(&mut self);
    /// Check internal consistency in O(capacity); exact at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] on a kvpool bug.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;
}

/// Check an extend or decode batch against `alloc` without changing anything: the
/// `last_locs` and output lengths, and every `last_loc` that part 1 of the expansion will
/// read (one that continues a page must sit at the matching position of an allocated
/// page, and no two requests may continue the same page: both would be handed its next
/// slots). `req(i)` gives request `i`'s `(prefix_len, seq_len)`; `new_tokens` is the
/// output length the batch needs. Callers that evict before allocating (the prefix
/// cache) run this first, so a malformed batch evicts nothing.
///
/// One pass over the requests reads each `(prefix, seq, last_loc)` once: it checks the
/// `last_loc` and puts the page it continues into a hash table on the stack, where a
/// repeat shows (see [`scan_hashed`]). The errors are those of two passes: a bad
/// `last_loc` anywhere in the batch first, else the first request continuing a page an
/// earlier one continues.
///
/// # Errors
///
/// [`InvalidInput`] naming the first problem.
pub(crate) fn check_batch_shape<A, F>(
    alloc: &A,
    batch: usize,
    last_locs: &[u32],
    out_len: usize,
    new_tokens: usize,
    req: F,
) -> Result<(), InvalidInput>
where
    A: KvAllocator + ?Sized,
    F: Fn(usize) -> (u32, u32),
{
    if last_locs.len() != batch {
        return Err(InvalidInput::LengthMismatch { what: "last_locs", got: last_locs.len(), expected: batch });
    }
    if out_len != new_tokens {
        return Err(InvalidInput::OutputLength { got: out_len, expected: new_tokens });
    }
    let ps = alloc.page_size();
    if ps <= 1 {
        return Ok(());
    }
    // Powers of two (the common case) get a pass of their own, with masks and shifts
    // for `% ps` and `/ ps` (no division, no test per request).
    if ps.is_power_of_two() {
        scan(Requests::<_, _, true>::new(alloc, ps, last_locs, req))
    } else {
        scan(Requests::<_, _, false>::new(alloc, ps, last_locs, req))
    }
}

/// [`check_batch_shape`]'s `last_loc` checks, page size >= 2.
#[inline(always)]
fn scan<A, F, const POW2: bool>(batch: Requests<'_, A, F, POW2>) -> Result<(), InvalidInput>
where
    A: KvAllocator + ?Sized,
    F: Fn(usize) -> (u32, u32),
{
    let last_locs = batch.last_locs;
    let scan = if last_locs.len() < 2 {
        match last_locs.len() {
            1 if batch.page_at(0) == BAD_LAST_LOC => Scan::BadLastLoc(0),
            _ => Scan::Clean,
        }
    } else {
        scan_hashed(&batch)
    };
    match scan {
        Scan::Clean => Ok(()),
        Scan::BadLastLoc(request) => Err(InvalidInput::BadLastLoc { request, last_loc: last_locs[request] }),
        Scan::Repeat(request) => {
            // Every last_loc is good then: `page` reads them unchecked.
            let page = batch.page(request);
            let earlier = (0..request).find(|&i| batch.page(i) == page).unwrap_or(0);
            Err(InvalidInput::SamePartialPage { earlier, request, last_loc: last_locs[request] })
        }
    }
}

/// A batch as the shape check reads it: [`page_at`](Self::page_at) reads a request's
/// `(prefix, seq, last_loc)` once, checking the `last_loc` part 1 will read and giving
/// the page it continues. `POW2`: the page size is a power of two.
struct Requests<'a, A: ?Sized, F, const POW2: bool> {
    alloc: &'a A,
    last_locs: &'a [u32],
    req: F,
    ps: u32,
    /// `ps - 1` and `log2(ps)`, used when `POW2` (no division).
    mask: u32,
    shift: u32,
}

impl<'a, A: KvAllocator + ?Sized, F: Fn(usize) -> (u32, u32), const POW2: bool> Requests<'a, A, F, POW2> {
    fn new(alloc: &'a A, ps: u32, last_locs: &'a [u32], req: F) -> Self {
        Requests { alloc, last_locs, req, ps, mask: ps - 1, shift: ps.trailing_zeros() }
    }

    fn len(&self) -> usize {
        self.last_locs.len()
    }

    #[inline(always)]
    fn rem(&self, x: u32) -> u32 {
        if POW2 {
            x & self.mask
        } else {
            x % self.ps
        }
    }

    /// Whether request `i` continues a page: its prefix ends inside one and it grows
    /// (part 1 reads its `last_loc` then, and only then).
    #[inline(always)]
    fn continues(&self, i: usize) -> Option<u32> {
        let (prefix, seq) = (self.req)(i);
        (self.rem(prefix) != 0 && seq > prefix).then_some(prefix)
    }

    #[inline(always)]
    fn page_of(&self, last_loc: u32) -> u32 {
        if POW2 {
            last_loc >> self.shift
        } else {
            last_loc / self.ps
        }
    }

    /// The page request `i` continues, after checking its `last_loc` (an allocated slot
    /// at the matching position): `NO_PAGE` if it continues none, `BAD_LAST_LOC` for a
    /// bad `last_loc`. With page size >= 2 a page is at most `u32::MAX / 2`, below both.
    #[inline(always)]
    fn page_at(&self, i: usize) -> u32 {
        let Some(prefix) = self.continues(i) else { return NO_PAGE };
        let last_loc = self.last_locs[i];
        if !self.good_last_loc(prefix, last_loc) {
            return BAD_LAST_LOC;
        }
        self.page_of(last_loc)
    }

    /// Whether `last_loc` can end a prefix of `prefix` tokens: an allocated slot at the
    /// matching position of its page.
    #[inline(always)]
    fn good_last_loc(&self, prefix: u32, last_loc: u32) -> bool {
        self.rem(last_loc) == self.rem(prefix - 1) && self.alloc.is_allocated(last_loc)
    }

    /// [`page_at`](Self::page_at) for a request whose `last_loc` was checked already.
    #[inline(always)]
    fn page(&self, i: usize) -> u32 {
        match self.continues(i) {
            Some(_) => self.page_of(self.last_locs[i]),
            None => NO_PAGE,
        }
    }
}

/// No page: what `page_at` gives for a request that continues none.
const NO_PAGE: u32 = u32::MAX;

/// What `page_at` gives for a request whose `last_loc` is bad.
const BAD_LAST_LOC: u32 = u32::MAX - 1;

/// Entries of the largest [`PageTable`] (16 KiB, on the stack); a batch with more than
/// half as many continued pages is checked in chunks of that many.
const LARGE_TABLE: usize = 4096;

/// What a batch's scan found first: a bad `last_loc` anywhere wins over a repeat.
enum Scan {
    Clean,
    BadLastLoc(usize),
    /// The first request whose page an earlier request continues.
    Repeat(usize),
}

/// Entries of the smallest [`PageTable`] (batches of up to 16 requests).
const SMALL_TABLE: usize = 32;

/// A set of pages: an open-addressing hash table (`page + 1`, 0 for empty; linear
/// probing) of a power-of-two number of entries, on the caller's stack. Its size follows
/// the batch, and only the entries it uses are zeroed (the previous check zeroed a
/// fixed 16 KiB table for every batch of more than 128 requests).
struct PageTable<'t> {
    slots: &'t mut [u32],
    /// `32 - log2(slots.len())`: Fibonacci hashing keeps the product's top bits.
    shift: u32,
}

impl<'t> PageTable<'t> {
    /// A table of `len` entries (a power of two, at most `LARGE_TABLE`) at the start of
    /// `storage`; only those entries are zeroed.
    fn new(storage: &'t mut MaybeUninit<[u32; LARGE_TABLE]>, len: usize) -> Self {
        let len = len.min(LARGE_TABLE);
        debug_assert!(len.is_power_of_two());
        let first = storage.as_mut_ptr().cast::<u32>();
        // SAFETY: `first` points to `LARGE_TABLE >= len` entries of `storage`, which
        // the slice borrows exclusively for `'t`; its `len` entries are initialised
        // (zeroed) before the slice is made of them, and the rest is never read.
        let slots = unsafe {
            first.write_bytes(0, len);
            core::slice::from_raw_parts_mut(first, len)
        };
        PageTable { slots, shift: 32 - len.trailing_zeros() }
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    fn clear(&mut self) {
        self.slots.fill(0);
    }

    /// Fibonacci hashing: pages of one batch are often close together.
    #[inline(always)]
    fn home(&self, page: u32) -> usize {
        (page.wrapping_mul(0x9E37_79B9) >> self.shift) as usize
    }

    /// Insert `page`; `false` if it is there already.
    #[inline(always)]
    fn insert(&mut self, page: u32) -> bool {
        let (key, mut at, mask) = (page + 1, self.home(page), self.slots.len() - 1);
        loop {
            match self.slots[at] {
                0 => {
                    self.slots[at] = key;
                    return true;
                }
                e if e == key => return false,
                _ => at = (at + 1) & mask,
            }
        }
    }

    /// Whether `page` is in the table.
    #[inline(always)]
    fn contains(&self, page: u32) -> bool {
        let (key, mut at, mask) = (page + 1, self.home(page), self.slots.len() - 1);
        loop {
            match self.slots[at] {
                0 => return false,
                e if e == key => return true,
                _ => at = (at + 1) & mask,
            }
        }
    }
}

/// The scan of a batch of two or more requests, through a [`PageTable`] on the stack
/// of at least twice as many entries as the batch has requests (a power of two, from
/// `SMALL_TABLE` to `LARGE_TABLE`; load at most one half), so no allocation: O(batch) expected, in one pass over the
/// requests, which checks each `last_loc` as it reads it ([`Requests::page_at`]). The
/// continued pages are inserted as the pass meets them (a repeat is found then) until
/// the table is half full; the rest of the batch (past `LARGE_TABLE / 2` continued
/// pages) is looked up in them in the same pass. Only such a batch goes on in chunks
/// ([`first_repeat_chunked`]), over the requests before the first repeat found so far.
///
/// A repeat ends the pass early, but a bad `last_loc` anywhere in the batch still wins
/// (`first_bad` reads the rest).
#[inline(never)]
fn scan_hashed<A, F, const POW2: bool>(b: &Requests<'_, A, F, POW2>) -> Scan
where
    A: KvAllocator + ?Sized,
    F: Fn(usize) -> (u32, u32),
{
    let batch = b.len();
    let first_bad = |from: usize| (from..batch).find(|&i| b.page_at(i) == BAD_LAST_LOC);
    let mut storage = MaybeUninit::uninit();
    let mut table = PageTable::new(&mut storage, (2 * batch).next_power_of_two().max(SMALL_TABLE));
    let (mut i, mut room) = (0, table.len() / 2);
    while i < batch {
        let page = b.page_at(i);
        i += 1;
        if page < BAD_LAST_LOC {
            if !table.insert(page) {
                return first_bad(i).map_or(Scan::Repeat(i - 1), Scan::BadLastLoc);
            }
            room -= 1;
            if room == 0 {
                break;
            }
        } else if page == BAD_LAST_LOC {
            return Scan::BadLastLoc(i - 1);
        }
    }
    if i == batch {
        return Scan::Clean;
    }
    // The table is half full: look the rest up in it.
    let chunk_end = i;
    let mut end = batch;
    while i < batch {
        let page = b.page_at(i);
        if page < BAD_LAST_LOC {
            if table.contains(page) {
                end = i;
                break;
            }
        } else if page == BAD_LAST_LOC {
            return Scan::BadLastLoc(i);
        }
        i += 1;
    }
    if end < batch {
        if let Some(bad) = first_bad(end + 1) {
            return Scan::BadLastLoc(bad);
        }
    }
    // Every last_loc is good; an earlier repeat can only lie among the later chunks.
    match first_repeat_chunked(&mut table, chunk_end, end, |i| b.page(i)) {
        Some(j) => Scan::Repeat(j),
        None if end < batch => Scan::Repeat(end),
        None => Scan::Clean,
    }
}

/// The first request `j` of `start..end` whose page (`page(j)`, `NO_PAGE` for none)
/// equals `page(i)` for some `i` in `start..j`, through `table` (cleared first): each
/// chunk of half a table of continued pages is inserted (a repeat inside the chunk is
/// found then) and the rest of the range is looked up in them; a repeat found by a
/// lookup limits the later chunks to the requests before it, so the answer is the first
/// repeat whatever the chunking. Cold: only batches with more than `LARGE_TABLE / 2`
/// continued pages come here (the hint keeps the common path's layout; 0.2% fewer
/// instructions per decode batch of 1,024 requests, 0.2% more at 4,096).
#[cold]
#[inline(never)]
fn first_repeat_chunked(
    table: &mut PageTable<'_>,
    mut start: usize,
    mut end: usize,
    page: impl Fn(usize) -> u32,
) -> Option<usize> {
    let mut found = None;
    while start < end {
        table.clear();
        // Insert the chunk's pages.
        let (mut i, mut held) = (start, 0);
        while i < end && held < table.len() / 2 {
            let p = page(i);
            if p != NO_PAGE {
                if !table.insert(p) {
                    return Some(i);
                }
                held += 1;
            }
            i += 1;
        }
        // Look the rest up in them.
        let hit = (i..end).find(|&j| {
            let p = page(j);
            p != NO_PAGE && table.contains(p)
        });
        if let Some(j) = hit {
            (end, found) = (j, Some(j));
        }
        start = i;
    }
    found
}

/// A paged KV slot allocator: SGLang's `PagedTokenToKVPoolAllocator`, lock-free.
///
/// # Examples
///
/// DESIGN.md's worked example:
///
/// ```
/// use kvpool::{KvAllocator, PagedAllocator};
///
/// let alloc = PagedAllocator::new(256, 4)?;
/// let mut first = [0u32; 8];
/// alloc.alloc(&mut first)?;                      // pages 1 and 2
/// assert_eq!(first, [4, 5, 6, 7, 8, 9, 10, 11]);
///
/// let mut out = [0u32; 9];
/// alloc.alloc_extend(&[1, 3], &[6, 7], &[4, 10], &mut out)?;
/// assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]); // pages 3 and 4
///
/// alloc.free(&out)?;                             // frees pages 1, 2, 3 and 4
/// assert_eq!(alloc.available_size(), 256);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PagedAllocator {
    pages: SlotPool,
    page_size: u32,
    /// `log2(page_size)` when it is a power of two: divisions become shifts.
    shift: Option<u32>,
}

impl PagedAllocator {
    /// An allocator of `size` tokens in pages of `page_size` (`size / page_size` pages;
    /// a remainder is unused, as in SGLang).
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] if `page_size` is 0; [`ConfigError::TooLarge`] if
    /// the slot numbers would overflow `u32` (the highest slot,
    /// `(size / page_size + 1) * page_size - 1`, must be at most `u32::MAX`; with page
    /// size 1, if `size > u32::MAX`); [`ConfigError::TooLargeForMemory`] if the page
    /// bitmap cannot be allocated.
    pub fn new(size: usize, page_size: u32) -> Result<Self, ConfigError> {
        Self::build(size, page_size, page_size == 1)
    }

    /// [`new`](Self::new) with a pool that never parks blocks, for callers that claim
    /// one reservation in several parts (each part as a reservation of its own, which
    /// a reservation with parked blocks in it cannot be cut into).
    pub(crate) fn without_parking(size: usize, page_size: u32) -> Result<Self, ConfigError> {
        Self::build(size, page_size, false)
    }

    fn build(size: usize, page_size: u32, parking: bool) -> Result<Self, ConfigError> {
        if page_size == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        let num_pages = size as u64 / page_size as u64;
        // The highest slot is (num_pages + 1) * page_size - 1 (both steps checked: with
        // page size 1 and `size == usize::MAX`, `num_pages + 1` itself overflows).
        let end = num_pages.checked_add(1).and_then(|pages| pages.checked_mul(page_size as u64));
        if end.map_or(true, |end| end > u32::MAX as u64 + 1) {
            return Err(ConfigError::TooLarge { size: size as u64, page_size });
        }
        // The page bitmap: one bit a page.
        crate::arena::probe(crate::arena::bytes_of::<u64>((num_pages as usize).div_ceil(64)), "the page bitmap")?;
        Ok(PagedAllocator {
            // No magazines (yet): the allocator frees through free groups, which bypass
            // magazines, and its page order is part of DESIGN.md's test vectors and
            // the radix tests (lowest free pages first, but for the slot pool's
            // placement of large claims over scattered free pages, and a page-size-1
            // decode's runs that continue: `alloc_decode`). At page size 1,
            // parked blocks (`SlotPool::with_parking`): a request's slots span dozens
            // of 512-slot blocks, freed and taken with one read-modify-write each
            // instead of eight, in the same order (BENCHMARKS, issue 8, thirteenth
            // round). Larger pages gain nothing measurable from them.
            pages: SlotPool::for_pages(num_pages as u32, parking),
            page_size,
            shift: page_size.is_power_of_two().then(|| page_size.trailing_zeros()),
        })
    }

    /// Number of pages (page numbers are `1..=num_pages`).
    pub fn num_pages(&self) -> u32 {
        self.pages.capacity()
    }

    /// Free pages now.
    pub fn available_pages(&self) -> usize {
        self.pages.available()
    }

    /// The page of `slot`.
    #[inline]
    pub fn page_of(&self, slot: u32) -> u32 {
        match self.shift {
            Some(s) => slot >> s,
            None => slot / self.page_size,
        }
    }

    /// The page pool's refusal, in tokens. Uses the count the refusal saw: re-reading
    /// `available` here could report more than was requested, if a free landed since.
    fn oom(&self, refused: OutOfMemory) -> AllocError {
        let ps = self.page_size as usize;
        AllocError::OutOfMemory(OutOfMemory {
            requested: refused.requested * ps,
            available: refused.available * ps,
            evictable: None,
            unit: Unit::Tokens,
        })
    }

    /// Allocate whole pages: `out.len() / page_size` pages, expanded into slots.
    ///
    /// # Errors
    ///
    /// [`AllocError::Invalid`] if `out.len()` is not a multiple of the page size;
    /// [`AllocError::OutOfMemory`] (in tokens) if too few pages are free.
    pub fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        let ps = self.page_size as usize;
        if out.len() % ps != 0 {
            return Err(InvalidInput::NotPageAligned { count: out.len(), page_size: self.page_size }.into());
        }
        let n = out.len() / ps;
        if n == 0 {
            return Ok(());
        }
        let r = self.pages.reserve(n, Unit::Pages).map_err(|e| self.oom(e))?;
        // Each stretch of consecutive pages is one ascending fill of its slots.
        let mut at = 0;
        self.pages.claim_stretches(r, |page, count| {
            crate::iota::fill_ascending(&mut out[at..at + count * ps], page * self.page_size);
            at += count * ps;
        });
        crate::debug_check(self);
        Ok(())
    }

    /// Reserve and claim `pages.len()` fresh pages into `pages`, all or nothing, for a
    /// caller that expands them elsewhere (the GPU allocation kernels, see
    /// `kvpool::cuda::DevicePagedAllocator`). Steps 1 and 2 of a batch allocation
    /// without step 3; free them as slots (`page * page_size`) or through a free group.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] (in tokens) if too few pages are free; nothing
    /// changes then.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::{KvAllocator, PagedAllocator};
    /// let alloc = PagedAllocator::new(64, 16)?;
    /// let mut pages = [0u32; 2];
    /// alloc.reserve_pages(&mut pages)?;
    /// assert_eq!(pages, [1, 2]);
    /// alloc.free(&[pages[0] * 16, pages[1] * 16])?;
    /// assert_eq!(alloc.available_size(), 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reserve_pages(&self, pages: &mut [u32]) -> Result<(), AllocError> {
        let n = pages.len();
        if n == 0 {
            return Ok(());
        }
        let r = self.pages.reserve(n, Unit::Pages).map_err(|e| self.oom(e))?;
        self.pages.claim(r, pages);
        crate::debug_check(self);
        Ok(())
    }

    /// [`reserve_pages`](Self::reserve_pages) for a page-size-1 decode batch: page `i`
    /// (request `i`'s slot) continues the run that ends at slot `after(i)` where it
    /// can, as [`alloc_decode`](Self::alloc_decode) places them (`u32::MAX`, or any
    /// slot that is not followed by a free one: no continuation). At larger page sizes
    /// the same as `reserve_pages`.
    pub(crate) fn reserve_decode_pages(
        &self,
        pages: &mut [u32],
        after: impl Fn(usize) -> u32,
    ) -> Result<(), AllocError> {
        if self.page_size != 1 {
            return self.reserve_pages(pages);
        }
        if pages.is_empty() {
            return Ok(());
        }
        let r = self.pages.reserve(pages.len(), Unit::Pages).map_err(|e| self.oom(e))?;
        self.pages.claim_following(r, pages, after);
        crate::debug_check(self);
        Ok(())
    }

    /// Allocate the new slots of an extend (prefill) batch, all or nothing.
    ///
    /// Request `i` already holds `prefix_lens[i]` tokens, the last at slot
    /// `last_locs[i]`, and grows to `seq_lens[i]`; `out` receives
    /// `sum(seq - prefix)` slots, request after request. The old partial page is filled
    /// first (slots `last_loc + 1, ...`), then fresh pages. `last_locs[i]` is read
    /// only when the prefix ends inside a page; it must then be an allocated slot at
    /// the matching position of its page.
    ///
    /// # Errors
    ///
    /// [`AllocError::Invalid`] for a malformed batch (see [`plan_extend`]), a wrong
    /// `out` length or a bad `last_loc`; [`AllocError::OutOfMemory`] when too few pages
    /// are free (`requested` counts the tokens of the pages needed). `out` and the pool
    /// are unchanged on error.
    pub fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        let plan = plan_extend(self.page_size, prefix_lens, seq_lens)?;
        self.check_batch(plan, seq_lens.len(), last_locs, out, |i| (prefix_lens[i], seq_lens[i]))?;
        let req = |i| (prefix_lens[i], seq_lens[i], last_locs[i]);
        self.claim_and_fill(plan, out, req, seq_lens.len(), |_| {})
    }

    /// [`alloc_extend`](Self::alloc_extend) for one request (`prefix_len..seq_len`,
    /// after the prefix's last slot `last_loc`), also calling `breaks(p)` for every
    /// position `p` of `out`, ascending, where the slots stop being consecutive
    /// (`out[p] != out[p - 1] + 1`). The runs are found while claiming the pages (one
    /// call per run, never a pass over the slots), so a prefix cache can cut the
    /// request into runs without reading its slots back.
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend); nothing changes and nothing is reported
    /// on error.
    ///
    /// # Examples
    ///
    /// ```
    /// let alloc = kvpool::PagedAllocator::new(64, 4)?;
    /// let mut held = [0u32; 4];
    /// alloc.alloc(&mut held)?;            // page 1 (slots 4..8)
    /// let mut gap = [0u32; 4];
    /// alloc.alloc(&mut gap)?;             // page 2
    /// alloc.free(&held)?;                 // page 1 is free again, page 2 is not
    /// let (mut out, mut at) = ([0u32; 10], Vec::new());
    /// alloc.alloc_extend_runs(0, 10, 0, &mut out, &mut |p| at.push(p))?;
    /// assert_eq!(out, [4, 5, 6, 7, 12, 13, 14, 15, 16, 17]); // pages 1, 3, 4
    /// assert_eq!(at, [4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_extend_runs(
        &self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
        out: &mut [u32],
        breaks: &mut dyn FnMut(usize),
    ) -> Result<(), AllocError> {
        let plan = plan_extend(self.page_size, &[prefix_len], &[seq_len])?;
        self.check_batch(plan, 1, &[last_loc], out, |_| (prefix_len, seq_len))?;
        self.claim_and_fill(plan, out, |_| (prefix_len, seq_len, last_loc), 1, breaks)
    }

    /// Allocate one slot per request of a decode batch; `seq_lens[i]` counts the new
    /// token, so request `i` needs a fresh page exactly when its new token starts one.
    ///
    /// At page size 1 every request takes a fresh slot, and which one is the
    /// allocator's choice. It keeps each request's slots consecutive where it can: a
    /// request gets `last_locs[i] + 1` when that slot is free (as a larger page size
    /// continues the request's last page), and a request whose next slot is taken
    /// starts a new run at the start of a long free stretch, away from where prompts
    /// are placed ("Runs that continue" in [`SlotPool`]'s docs). So a decode batch
    /// does not interleave its requests' slots, and a finished request's slots form
    /// a few long runs instead of one run per token: the radix cache's work per
    /// request follows its runs. `last_locs` is only a hint at page size 1 (any
    /// value is accepted); the count, the all-or-nothing refusal and the errors are
    /// the same as at any page size.
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend).
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::{KvAllocator, TokenAllocator};
    ///
    /// let alloc = TokenAllocator::new(1024)?;
    /// let mut prompts = [0u32; 8];
    /// alloc.alloc(&mut prompts)?; // two requests' prompts: 1..=4 and 5..=8
    /// alloc.free(&prompts[4..])?; // the second one finished
    /// let mut step = [0u32; 2];
    /// // The first request continues its run; so does one ending at slot 100.
    /// alloc.alloc_decode(&[5, 7], &[4, 100], &mut step)?;
    /// assert_eq!(step, [5, 101]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        let plan = plan_decode(self.page_size, seq_lens)?;
        self.check_batch(plan, seq_lens.len(), last_locs, out, |i| (seq_lens[i] - 1, seq_lens[i]))?;
        if self.page_size == 1 {
            // Slot = page: each request's slot is chosen (see above).
            return self.reserve_decode_pages(out, |i| last_locs[i]);
        }
        let req = |i| (seq_lens[i] - 1, seq_lens[i], last_locs[i]);
        // One token per request, at most one page: no stretches to fill; the pages go
        // into the front of `out` and are expanded in place (cheaper per request).
        if plan.new_pages > 0 {
            let r = self.pages.reserve(plan.new_pages, Unit::Pages).map_err(|e| self.oom(e))?;
            self.pages.claim(r, &mut out[..plan.new_pages]);
        }
        expand::expand_in_place(self.page_size, seq_lens.len(), req, plan.new_pages, out);
        crate::debug_check(self);
        Ok(())
    }

    /// Shapes, and every `last_loc` that part 1 will read.
    fn check_batch<F>(
        &self,
        plan: expand::BatchPlan,
        batch: usize,
        last_locs: &[u32],
        out: &[u32],
        req: F,
    ) -> Result<(), InvalidInput>
    where
        F: Fn(usize) -> (u32, u32),
    {
        check_batch_shape(self, batch, last_locs, out.len(), plan.new_tokens, req)
    }

    /// Reserve the batch's new pages, claim them and write the batch's slots straight
    /// from the claim ([`expand::Placer`]): each stretch of consecutive pages is one
    /// ascending fill at its place. `breaks(p)` hears every position `p` where a
    /// request's slots stop being consecutive.
    fn claim_and_fill<R>(
        &self,
        plan: expand::BatchPlan,
        out: &mut [u32],
        req: R,
        batch: usize,
        breaks: impl FnMut(usize),
    ) -> Result<(), AllocError>
    where
        R: Fn(usize) -> (u32, u32, u32),
    {
        let r = match plan.new_pages {
            0 => Reservation::words(0),
            n => self.pages.reserve(n, Unit::Pages).map_err(|e| self.oom(e))?,
        };
        self.place_claimed(r, out, req, batch, breaks, |_, _| {});
        crate::debug_check(self);
        Ok(())
    }

    /// Claim the pages `r` reserved and write the batch's slots from them: every
    /// request's old partial page, then each stretch of consecutive pages as one
    /// ascending fill at its place ([`expand::Placer`]), which `stretch(first, count)`
    /// also hears, in claim order.
    pub(super) fn place_claimed<R>(
        &self,
        r: Reservation,
        out: &mut [u32],
        req: R,
        batch: usize,
        mut breaks: impl FnMut(usize),
        mut stretch: impl FnMut(u32, usize),
    ) where
        R: Fn(usize) -> (u32, u32, u32),
    {
        if self.page_size == 1 {
            return self.place_merged(r, out, req, batch, breaks, stretch);
        }
        let mut placer = expand::Placer::new(self.page_size, batch, req, out);
        self.pages.claim_stretches(r, |page, count| {
            placer.place(out, page, count, &mut breaks);
            stretch(page, count);
        });
    }

    /// [`place_claimed`](Self::place_claimed) at page size 1, where a word's stretch is
    /// at most 64 slots: stretches that continue each other (across word boundaries)
    /// are placed as one, so the claim's swaps run back to back and the slots are
    /// written by one long fill. A function of its own, out of line: written into
    /// `place_claimed`'s loop (or with a placement callback), it slowed page size 16 by
    /// 4-8% through code layout alone (BENCHMARKS, issue 8, eleventh round).
    #[inline(never)]
    fn place_merged<R>(
        &self,
        r: Reservation,
        out: &mut [u32],
        req: R,
        batch: usize,
        mut breaks: impl FnMut(usize),
        mut stretch: impl FnMut(u32, usize),
    ) where
        R: Fn(usize) -> (u32, u32, u32),
    {
        let mut placer = expand::Placer::new(self.page_size, batch, req, out);
        let (mut first, mut len) = (0u32, 0usize);
        self.pages.claim_stretches(r, |page, count| {
            if len > 0 && first as usize + len == page as usize {
                len += count;
                return;
            }
            if len > 0 {
                placer.place(out, first, len, &mut breaks);
                stretch(first, len);
            }
            (first, len) = (page, count);
        });
        if len > 0 {
            placer.place(out, first, len, &mut breaks);
            stretch(first, len);
        }
    }

    /// Free token slots: the distinct pages they lie in are freed (slots of one page may
    /// repeat; listing one slot of a page frees the whole page, as in SGLang's
    /// `torch.unique` of the pages). At page size 1 a slot is its page: a slot listed
    /// twice is freed once, like two slots of one page at a larger page size.
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first slot whose page is out of range or not allocated;
    /// nothing is freed then (`rest_freed` is `false`). The one exception is a race
    /// that is a caller bug anyway: another thread freeing the same page at the same
    /// time; the error then says `rest_freed: true`, and the counts stay exact.
    pub fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        let mut group = self.free_group();
        let r = group.free(slots);
        group.end();
        r
    }

    /// Open a free group (SGLang's `free_group_begin`/`free_group_end`).
    pub fn free_group(&self) -> KvFreeGroup<'_> {
        // Merging at every page size: a batch names the distinct pages its slots lie in,
        // so a repeat (two slots of a page, or one slot twice at page size 1) is no
        // double free, and a refused batch has freed nothing.
        KvFreeGroup { window: None, group: FreeGroup::merging(&self.pages), alloc: self }
    }

    /// Whether `slot`'s page is allocated.
    #[inline]
    pub fn is_allocated(&self, slot: u32) -> bool {
        slot >= self.page_size && self.pages.is_allocated(self.page_of(slot))
    }

    /// Map a page-level free error back to the first slot the caller passed in it.
    fn slot_error(&self, slots: &[u32], mut e: FreeError) -> FreeError {
        if let FreeErrorKind::OutOfRange { .. } = e.kind {
            e.kind = FreeErrorKind::OutOfRange {
                first: self.page_size,
                last: ((self.num_pages() as u64 + 1) * self.page_size as u64 - 1) as u32,
            };
        }
        if self.page_size > 1 {
            if let Some(&s) = slots.iter().find(|&&s| self.page_of(s) == e.index) {
                e.index = s;
            }
        }
        e
    }
}

impl KvAllocator for PagedAllocator {
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn size(&self) -> usize {
        self.num_pages() as usize * self.page_size as usize
    }
    fn available_size(&self) -> usize {
        self.pages.available() * self.page_size as usize
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        PagedAllocator::alloc(self, out)
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        PagedAllocator::alloc_extend(self, prefix_lens, seq_lens, last_locs, out)
    }
    fn alloc_extend_runs(
        &self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
        out: &mut [u32],
        breaks: &mut dyn FnMut(usize),
    ) -> Result<bool, AllocError> {
        PagedAllocator::alloc_extend_runs(self, prefix_len, seq_len, last_loc, out, breaks).map(|()| true)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        PagedAllocator::alloc_decode(self, seq_lens, last_locs, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        PagedAllocator::free(self, slots)
    }
    fn free_group(&self) -> KvFreeGroup<'_> {
        PagedAllocator::free_group(self)
    }
    #[inline]
    fn is_allocated(&self, slot: u32) -> bool {
        PagedAllocator::is_allocated(self, slot)
    }
    fn pages_allocated(&self, first_page: u32, pages: u32) -> bool {
        self.pages.all_allocated(first_page, pages)
    }
    fn clear(&mut self) {
        self.pages.clear();
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.pages.check_invariants()
    }
}

impl core::fmt::Debug for PagedAllocator {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PagedAllocator")
            .field("page_size", &self.page_size)
            .field("num_pages", &self.num_pages())
            .field("available_pages", &self.available_pages())
            .finish()
    }
}

/// A free group over a KV allocator: frees of token slots published together when the
/// group ends (or is dropped).
///
/// # Examples
///
/// ```
/// use kvpool::{KvAllocator, TokenAllocator};
/// let alloc = TokenAllocator::new(8)?;
/// let mut a = [0u32; 4];
/// alloc.alloc(&mut a)?;
/// let mut group = alloc.free_group();
/// group.free(&a[..1])?;
/// group.free(&a[1..])?;
/// assert_eq!(alloc.available_size(), 4);
/// drop(group);
/// assert_eq!(alloc.available_size(), 8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a free group publishes its frees when it ends"]
pub struct KvFreeGroup<'a> {
    /// A dual allocator's window pool: freeing a full page releases its window page
    /// (declared first, so it is published first when the group drops).
    window: Option<swa::WindowFrees<'a>>,
    group: FreeGroup<'a>,
    alloc: &'a PagedAllocator,
}

impl KvFreeGroup<'_> {
    /// Free token slots into the group.
    ///
    /// # Errors
    ///
    /// As [`KvAllocator::free`]; nothing is freed on error.
    pub fn free(&mut self, slots: &[u32]) -> Result<(), FreeError> {
        let KvFreeGroup { window, group, alloc: a } = self;
        let a = *a;
        // A dual allocator releases the window pages once the full pool has validated
        // the whole batch (so a refused free changes nothing) and before it sets a
        // full page's bit (so the page's mapping is clear before it can be handed out
        // again).
        let release_window = || {
            if let Some(w) = window {
                w.window.release_slots(slots, &mut w.group);
            }
        };
        let r = if a.page_size == 1 {
            group.free_then(slots, release_window)
        } else {
            group.free_iter_then(slots.iter().map(|&s| if s < a.page_size { 0 } else { a.page_of(s) }), release_window)
        };
        r.map_err(|e| a.slot_error(slots, e))
    }

    /// Free the whole pages `first_page..first_page + pages` into the group (one check
    /// and one read-modify-write per 64 pages).
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first slot of a page that is out of range or not
    /// allocated; nothing is freed then.
    pub fn free_pages(&mut self, first_page: u32, pages: u32) -> Result<(), FreeError> {
        let a = self.alloc;
        if let Some(w) = &mut self.window {
            let in_range = first_page >= 1 && first_page.checked_add(pages).is_some_and(|e| e <= a.num_pages() + 1);
            if in_range && a.pages.all_allocated(first_page, pages) {
                w.window.release_pages(first_page, pages, &mut w.group);
            }
        }
        self.group.free_range(first_page, pages).map_err(|mut e| {
            e.index = e.index.saturating_mul(a.page_size);
            e
        })
    }

    /// Free many runs of whole pages `(first_page, pages)`, as
    /// [`free_pages`](Self::free_pages) of each, but with one read-modify-write per
    /// bitmap word the runs share (see `FreeGroup::free_ranges`). Not all-or-nothing
    /// across runs: for owners of the pages (eviction), where an error is a bug.
    pub(crate) fn free_page_runs(&mut self, runs: impl Iterator<Item = (u32, u32)>) -> Result<(), FreeError> {
        let a = self.alloc;
        if self.window.is_some() {
            // A dual allocator releases window pages run by run.
            for (first, pages) in runs {
                self.free_pages(first, pages)?;
            }
            return Ok(());
        }
        self.group.free_ranges(runs).map_err(|mut e| {
            e.index = e.index.saturating_mul(a.page_size);
            e
        })
    }

    /// Tokens freed into the group so far (not yet available).
    pub fn pending_tokens(&self) -> usize {
        self.group.pending() * self.alloc.page_size as usize
    }

    /// End the group, publishing its frees; returns the (full pool's) tokens made
    /// available.
    pub fn end(self) -> usize {
        if let Some(w) = self.window {
            w.group.end();
        }
        self.group.end() * self.alloc.page_size as usize
    }
}

impl core::fmt::Debug for KvFreeGroup<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KvFreeGroup").field("pending_tokens", &self.pending_tokens()).finish()
    }
}

/// A token allocator (page size 1): SGLang's `TokenToKVPoolAllocator`, lock-free.
///
/// Slots are `1..=size`; `alloc_extend` and `alloc_decode` ignore `last_locs` (no
/// partial pages exist).
///
/// # Examples
///
/// ```
/// use kvpool::{KvAllocator, TokenAllocator};
/// let alloc = TokenAllocator::new(16)?;
/// let mut out = [0u32; 5];
/// alloc.alloc_extend(&[0, 2], &[3, 4], &[0, 0], &mut out)?;
/// assert_eq!(out, [1, 2, 3, 4, 5]);
/// let err = alloc.alloc(&mut [0u32; 12]).unwrap_err();
/// assert!(err.to_string().starts_with("Out of memory. Try to lower your batch size."));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct TokenAllocator(PagedAllocator);

impl TokenAllocator {
    /// An allocator of slots `1..=size`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::TooLarge`] if `size > u32::MAX` (the highest slot is `size`, and
    /// slots are `u32`s); [`ConfigError::TooLargeForMemory`] if the bitmap cannot be
    /// allocated.
    pub fn new(size: usize) -> Result<Self, ConfigError> {
        PagedAllocator::new(size, 1).map(TokenAllocator)
    }
}

impl core::ops::Deref for TokenAllocator {
    type Target = PagedAllocator;
    fn deref(&self) -> &PagedAllocator {
        &self.0
    }
}

impl KvAllocator for TokenAllocator {
    fn page_size(&self) -> u32 {
        1
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn available_size(&self) -> usize {
        self.0.available_size()
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        self.0.alloc(out)
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        self.0.alloc_extend(prefix_lens, seq_lens, last_locs, out)
    }
    fn alloc_extend_runs(
        &self,
        prefix_len: u32,
        seq_len: u32,
        last_loc: u32,
        out: &mut [u32],
        breaks: &mut dyn FnMut(usize),
    ) -> Result<bool, AllocError> {
        self.0.alloc_extend_runs(prefix_len, seq_len, last_loc, out, breaks).map(|()| true)
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.0.alloc_decode(seq_lens, last_locs, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.0.free(slots)
    }
    fn free_group(&self) -> KvFreeGroup<'_> {
        self.0.free_group()
    }
    #[inline]
    fn is_allocated(&self, slot: u32) -> bool {
        self.0.is_allocated(slot)
    }
    fn pages_allocated(&self, first_page: u32, pages: u32) -> bool {
        self.0.pages_allocated(first_page, pages)
    }
    fn clear(&mut self) {
        self.0.pages.clear();
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.0.check_invariants()
    }
}

#[cfg(test)]
pub(crate) use test_geometry::Geometry;

#[cfg(test)]
mod test_geometry {
    use super::*;

    /// A test allocator that reports whatever geometry a test wants (page size, size) over a
    /// real token allocator: for constructor checks of the caches built on `KvAllocator`.
    #[derive(Debug)]
    pub(crate) struct Geometry(pub TokenAllocator, pub u32, pub usize);

    impl super::owned::Sealed for Geometry {}
    impl OwnedAllocator for Geometry {}

    impl KvAllocator for Geometry {
        fn page_size(&self) -> u32 {
            self.1
        }
        fn size(&self) -> usize {
            self.2
        }
        fn available_size(&self) -> usize {
            self.0.available_size()
        }
        fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
            self.0.alloc(out)
        }
        fn alloc_extend(&self, p: &[u32], s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
            self.0.alloc_extend(p, s, l, out)
        }
        fn alloc_decode(&self, s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
            self.0.alloc_decode(s, l, out)
        }
        fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
            self.0.free(slots)
        }
        fn free_group(&self) -> KvFreeGroup<'_> {
            self.0.free_group()
        }
        fn is_allocated(&self, slot: u32) -> bool {
            self.0.is_allocated(slot)
        }
        fn clear(&mut self) {
            self.0.clear()
        }
        fn check_invariants(&self) -> Result<(), InvariantViolation> {
            self.0.check_invariants()
        }
    }
}
