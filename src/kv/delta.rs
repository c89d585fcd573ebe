//! The host half of a delta-staged decode step: [`DeltaPlanner`].
//!
//! A graph decode step ([`stage_decode`](super::staging::stage_decode)) rewrites one
//! record per request every step, though a request's record changes only in a
//! predictable way: its length grows by one. The delta step keeps each request's
//! state on the device instead (row, length, `last_loc`, current page: a
//! [`DeltaSlot`] per batch index, advanced by the kernel itself) and sends only what the
//! device cannot know: requests that joined, left or were extended (their whole new
//! state), and the fresh page of each request whose next token starts a page. At page
//! size 16 that is about one request in 16 per step, plus the batch's changes.
//!
//! The planner knows which requests start a page without looking at the others: a
//! request's length is `base + clock` (`clock` counts the steps staged), so its new
//! token starts a page at the steps `t` with `t ≡ -base (mod page_size)`, its *phase*.
//! Each phase keeps a bitset of the batch indices in it; a step visits one phase's
//! bits, in index order (so the fresh pages go to requests in batch order, exactly as
//! [`PagedAllocator::alloc_decode`] and the eager path hand them out at page sizes
//! above 1). At page size 1 every request takes a fresh page, its slot, every step,
//! and the planner keeps the slot each batch index got last: the step's slots are
//! `alloc_decode`'s with those as the `last_loc`s, so each request's run of slots
//! goes on where the pool allows ([`DeltaPlanner::set_last_slot`] tells it where a
//! prefill ended). The longest
//! request (the one that reaches the end of its row first) sits on top of an indexed
//! max-heap, so the row-end check is one comparison per step.
//!
//! Batch indices are dense: a request joins at index `batch()`, and when the request
//! at index `i` leaves, the last request moves into `i` (`Vec::swap_remove` order); the
//! caller permutes its own per-request arrays the same way. Every call is O(1) or
//! O(log batch) except [`stage`](DeltaPlanner::stage), which is O(changes + fresh pages
//! + batch / 64); nothing allocates after [`new`](DeltaPlanner::new).
//!
//! The block [`stage`](DeltaPlanner::stage) writes for the device (`u32` words, `c` =
//! capacity):
//!
//! | words | what |
//! |---|---|
//! | `0`, `1` | counts: full entries `f`, page entries `p` |
//! | `2` | the step's tag ([`StagedDelta::tag`]) |
//! | `3` | not written by the host: the kernel copies word 2 here once it has read the block |
//! | `4..4 + 4c` | `f` [`DeltaEntry`]s: changed batch indices, whole state |
//! | `4 + 4c..4 + 6c` | `p` [`DeltaPage`]s: fresh pages of unchanged requests |
//!
//! It only writes the block (words 0-2 and the entries), in address order, and never
//! reads it back: the block is
//! pinned memory the device reads across the bus, and the host's own results (the
//! step's fresh pages in batch order, and the batch index of each) go to separate
//! host arrays. At 1,024 requests and page size 16 the device reads the counts and
//! about 64 page entries (512 bytes) a step, in one round trip.
//!
//! [`decode_delta`](super::reference::decode_delta) is the host reference of the
//! kernel that reads it.

use bytemuck::{Pod, Zeroable};

use super::ptx::{DELTA_ENTRY_BYTES, DELTA_HEADER_BYTES, DELTA_PAGE_BYTES, DELTA_STATE_BYTES, PAD_ROW};
use super::staging::{bucket_for, RowLimits};
use super::KvError;
use crate::{KvAllocator, PagedAllocator};

/// A full entry of a delta step, as `decode_delta_*` reads it: batch index `index`
/// holds request row `row` ([`PAD_ROW`]: no request) with `len` tokens before the step,
/// and `page` is the fresh page its next token starts (when `len % page_size == 0`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DeltaEntry {
    /// The batch index (the device state's record) it sets.
    pub index: u32,
    /// The request's row of the table, or [`PAD_ROW`].
    pub row: u32,
    /// Tokens the request has before the step (its new token goes to column `len`).
    pub len: u32,
    /// The fresh page of a request whose new token starts a page, else 0.
    pub page: u32,
}

const _: () = assert!(core::mem::size_of::<DeltaEntry>() == DELTA_ENTRY_BYTES as usize);

/// A page entry of a delta step: the unchanged request at batch index `index` starts
/// fresh page `page` with its next token.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DeltaPage {
    /// The batch index.
    pub index: u32,
    /// The fresh page.
    pub page: u32,
}

const _: () = assert!(core::mem::size_of::<DeltaPage>() == DELTA_PAGE_BYTES as usize);

/// One batch index of the device state `decode_delta_*` keeps between steps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DeltaSlot {
    /// The request's row ([`PAD_ROW`] or any row past the table: padding).
    pub row: u32,
    /// Tokens it has: its next token goes to column `len`.
    pub len: u32,
    /// The slot of its last token (read when the next token continues a page).
    pub last: u32,
    /// Its current page (read when the next token starts one: the page just sent).
    pub page: u32,
}

const _: () = assert!(core::mem::size_of::<DeltaSlot>() == DELTA_STATE_BYTES as usize);

impl DeltaSlot {
    /// An empty batch index: slot 0, no row access.
    pub const PAD: DeltaSlot = DeltaSlot { row: PAD_ROW, len: 0, last: 0, page: 0 };
}

/// Words of a delta block for a planner of `capacity` batch indices.
pub const fn delta_block_words(capacity: usize) -> usize {
    (DELTA_HEADER_BYTES as usize + capacity * (DELTA_ENTRY_BYTES + DELTA_PAGE_BYTES) as usize) / 4
}

const HEAD: usize = DELTA_HEADER_BYTES as usize / 4;
const FULL_WORDS: usize = DELTA_ENTRY_BYTES as usize / 4;
const PAGE_WORDS: usize = DELTA_PAGE_BYTES as usize / 4;

/// What [`DeltaPlanner::stage`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedDelta {
    /// Requests in the step.
    pub batch: usize,
    /// The bucket (captured batch size) it runs in: `bucket_for(batch)`.
    pub bucket: usize,
    /// Full entries written (changed batch indices).
    pub full: usize,
    /// Page entries written (page-starting requests that did not change).
    pub paged: usize,
    /// Fresh pages reserved.
    pub new_pages: usize,
    /// The step's tag, written to word 2 of the block: the low 32 bits of
    /// [`clock`](DeltaPlanner::clock)` + 1` (the kernel copies it to word 3 once it has
    /// read the block, so the host knows when the block may be rewritten).
    pub tag: u32,
}

const NONE: u32 = u32::MAX;

/// The host planner of delta decode steps: which requests sit at which batch index,
/// their lengths (implicitly), and the changes the device has not seen yet.
///
/// # Examples
///
/// ```
/// use kvpool::kv::delta::{delta_block_words, DeltaPlanner, DeltaSlot};
/// use kvpool::kv::reference::decode_delta;
/// use kvpool::kv::staging::RowLimits;
/// use kvpool::PagedAllocator;
///
/// let host = PagedAllocator::new(1024, 4)?;
/// let limits = RowLimits { rows: 8, max_context_len: 64 };
/// let mut plan = DeltaPlanner::new(4, limits, 4)?;
/// let mut block = vec![0u32; delta_block_words(4)];
/// let (mut pages, mut owners) = ([0u32; 4], [0u32; 4]);
/// // The device side, simulated: state per batch index, the table of 8 rows of 64.
/// let mut state = [DeltaSlot::PAD; 4];
/// let mut table = vec![0u32; 8 * 64];
/// table[5 * 64..5 * 64 + 3].copy_from_slice(&[40, 41, 42]); // row 5's prefill: 3 tokens
/// assert_eq!(plan.join(5, 3)?, 0);
/// let mut out = [0u32; 1];
/// for step in 0..3 {
///     let staged = plan.stage(&host, &mut block, &mut pages, &mut owners)?;
///     let (full, paged) = (plan.full_entries(&block, &staged), plan.page_entries(&block, &staged));
///     decode_delta(4, &mut state, full, paged, 1, &mut out, &mut table, 8, 64)?;
///     plan.commit();
///     if step == 0 {
///         assert_eq!(out[0], 43); // token 3 continues the prefill's page
///     } else if step == 1 {
///         assert_eq!(staged.new_pages, 1); // token 4 starts a page
///         assert_eq!(out[0], pages[0] * 4);
///     }
/// }
/// assert_eq!(plan.len(0)?, 6);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct DeltaPlanner {
    page_size: u32,
    limits: RowLimits,
    capacity: usize,
    batch: usize,
    /// Steps committed.
    clock: u64,
    /// Per batch index: the request's row.
    row: Vec<u32>,
    /// Per batch index: `len - clock`.
    base: Vec<i64>,
    /// Per batch index: its phase.
    phase: Vec<u32>,
    /// `page_size` bitsets of `words` words: the batch indices of each phase.
    bits: Vec<u64>,
    words: usize,
    /// Batch indices whose state the device has not seen.
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    /// The fresh page of each page-starting index in the step staged last (read for
    /// the dirty ones' full entries, and at page size 1 by `commit`).
    page_of: Vec<u32>,
    /// Page size 1: per batch index, the slot of its last token as far as the host
    /// knows (`NONE`: not known). `commit` sets it to the staged step's slot.
    last: Vec<u32>,
    /// Max-heap of live batch indices by `base`; `heap_at[i]` is `i`'s position.
    heap: Vec<u32>,
    heap_at: Vec<u32>,
}

impl DeltaPlanner {
    /// A planner for batches of up to `capacity` requests, page size `page_size`, rows
    /// of a table of `limits`' shape.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for a zero `capacity` or page size, or a capacity past `u32`.
    pub fn new(page_size: u32, limits: RowLimits, capacity: usize) -> Result<DeltaPlanner, KvError> {
        if capacity == 0 {
            return Err(KvError::Shape { what: "capacity", got: 0, expected: 1 });
        }
        if page_size == 0 {
            return Err(KvError::Shape { what: "page_size", got: 0, expected: 1 });
        }
        if capacity >= u32::MAX as usize {
            return Err(KvError::Shape { what: "capacity", got: capacity, expected: u32::MAX as usize - 1 });
        }
        let words = capacity.div_ceil(64);
        Ok(DeltaPlanner {
            page_size,
            limits,
            capacity,
            batch: 0,
            clock: 0,
            row: vec![PAD_ROW; capacity],
            base: vec![0; capacity],
            phase: vec![0; capacity],
            bits: vec![0; page_size as usize * words],
            words,
            dirty: Vec::with_capacity(capacity),
            is_dirty: vec![false; capacity],
            page_of: vec![0; capacity],
            last: vec![NONE; if page_size == 1 { capacity } else { 0 }],
            heap: Vec::with_capacity(capacity),
            heap_at: vec![NONE; capacity],
        })
    }

    /// Requests in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The most requests a batch may hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The page size.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Steps committed so far.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// The row of the request at batch index `index`.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for an index past the batch.
    pub fn row(&self, index: u32) -> Result<u32, KvError> {
        self.check_index(index)?;
        Ok(self.row[index as usize])
    }

    /// The tokens the request at batch index `index` has (its next token goes to this
    /// column of its row).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for an index past the batch.
    pub fn len(&self, index: u32) -> Result<u32, KvError> {
        self.check_index(index)?;
        Ok(self.len_of(index as usize))
    }

    fn len_of(&self, i: usize) -> u32 {
        (self.base[i] + self.clock as i64) as u32
    }

    fn check_index(&self, index: u32) -> Result<(), KvError> {
        if index as usize >= self.batch {
            return Err(KvError::Shape { what: "batch index (batch)", got: index as usize, expected: self.batch });
        }
        Ok(())
    }

    fn check_request(&self, row: u32, len: u32) -> Result<(), KvError> {
        if row >= self.limits.rows {
            return Err(KvError::SlotOutOfRange { slot: row, rows: self.limits.rows as usize });
        }
        if len > self.limits.max_context_len {
            return Err(KvError::Shape {
                what: "seq_len (max_context_len)",
                got: len as usize,
                expected: self.limits.max_context_len as usize,
            });
        }
        Ok(())
    }

    /// Add a request: row `row` holds its first `len` tokens (its prefill, queued on
    /// the device before the next step). Returns its batch index, `batch()` before
    /// the call. Its next step writes column `len`.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] when the batch is full or `len > max_context_len`;
    /// [`KvError::SlotOutOfRange`] for a row past the table. Nothing changes then.
    pub fn join(&mut self, row: u32, len: u32) -> Result<u32, KvError> {
        if self.batch == self.capacity {
            return Err(KvError::Shape { what: "batch (capacity)", got: self.batch + 1, expected: self.capacity });
        }
        self.check_request(row, len)?;
        let i = self.batch;
        self.batch += 1;
        self.place(i, row, len);
        self.forget_last(i);
        self.mark(i);
        Ok(i as u32)
    }

    /// At page size 1: the request at batch index `index` has its last token in slot
    /// `slot` (the end of its prefill or of an extend, placed elsewhere), so that its
    /// next step's slot continues that run when the slot after it is free. The planner
    /// remembers the slot each step gives an index by itself (at
    /// [`commit`](Self::commit)); [`join`](Self::join) and [`set_len`](Self::set_len)
    /// forget it. A hint only: a stale or unknown slot
    /// makes the next slot start a new run, nothing else. At other page sizes it does
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for an index past the batch.
    pub fn set_last_slot(&mut self, index: u32, slot: u32) -> Result<(), KvError> {
        self.check_index(index)?;
        if let Some(l) = self.last.get_mut(index as usize) {
            *l = slot;
        }
        Ok(())
    }

    fn forget_last(&mut self, i: usize) {
        if let Some(l) = self.last.get_mut(i) {
            *l = NONE;
        }
    }

    /// Remove the request at batch index `index`. The last request moves into `index`
    /// (as `Vec::swap_remove` does): returns the index it came from, `None` when
    /// `index` was the last. Its pages are the caller's to free.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for an index past the batch.
    pub fn leave(&mut self, index: u32) -> Result<Option<u32>, KvError> {
        self.check_index(index)?;
        let i = index as usize;
        let last = self.batch - 1;
        self.unplace(i);
        let moved = if i != last {
            // The last request takes index `i`: same row, same base, same phase.
            let ph = self.phase[last] as usize;
            self.clear_bit(ph, last);
            self.set_bit(ph, i);
            self.row[i] = self.row[last];
            self.base[i] = self.base[last];
            self.phase[i] = self.phase[last];
            if self.page_size == 1 {
                self.last[i] = self.last[last];
            }
            let at = self.heap_at[last];
            self.heap[at as usize] = i as u32;
            self.heap_at[i] = at;
            self.heap_at[last] = NONE;
            self.mark(i);
            Some(last as u32)
        } else {
            None
        };
        self.row[last] = PAD_ROW;
        self.forget_last(last);
        self.mark(last);
        self.batch -= 1;
        Ok(moved)
    }

    /// The request at batch index `index` now has `len` tokens in its row (an extend,
    /// such as the next chunk of a chunked prefill, queued on the device before the
    /// next step).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for an index past the batch or `len > max_context_len`.
    pub fn set_len(&mut self, index: u32, len: u32) -> Result<(), KvError> {
        self.check_index(index)?;
        let i = index as usize;
        let row = self.row[i];
        self.check_request(row, len)?;
        self.unplace(i);
        self.place(i, row, len);
        self.forget_last(i);
        self.mark(i);
        Ok(())
    }

    /// Plan the next step, reserve its fresh pages from `host` and write its block into
    /// `block` ([`delta_block_words`]`(capacity)` words; the module docs give the
    /// layout). Every request grows by one token. The fresh pages go to
    /// `pages[..new_pages]`, in batch order, and the batch index of each to
    /// `owners[..new_pages]` (both `capacity` long). Nothing is committed:
    /// [`commit`](Self::commit) once the step is launched (otherwise the next `stage`
    /// plans the same step again, and the caller frees the pages).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for a block, `pages` or `owners` of the wrong size or a
    /// request that would pass `max_context_len`; [`KvError::Alloc`] when pages run
    /// out. Nothing is reserved then.
    pub fn stage(
        &mut self,
        host: &PagedAllocator,
        block: &mut [u32],
        pages: &mut [u32],
        owners: &mut [u32],
    ) -> Result<StagedDelta, KvError> {
        let cap = self.capacity;
        if block.len() != delta_block_words(cap) {
            return Err(KvError::Shape { what: "block", got: block.len(), expected: delta_block_words(cap) });
        }
        if pages.len() != cap || owners.len() != cap {
            return Err(KvError::Shape {
                what: "pages / owners (capacity)",
                got: pages.len().min(owners.len()),
                expected: cap,
            });
        }
        if host.page_size() != self.page_size {
            return Err(KvError::Shape {
                what: "page size (the planner's)",
                got: host.page_size() as usize,
                expected: self.page_size as usize,
            });
        }
        if let Some(&top) = self.heap.first() {
            let after = self.base[top as usize] + self.clock as i64 + 1;
            if after > self.limits.max_context_len as i64 {
                return Err(KvError::Shape {
                    what: "seq_len (max_context_len)",
                    got: after as usize,
                    expected: self.limits.max_context_len as usize,
                });
            }
        }
        let ph = (self.clock % self.page_size as u64) as usize;
        let class = &self.bits[ph * self.words..(ph + 1) * self.words];
        let fresh: usize = class.iter().map(|w| w.count_ones() as usize).sum();
        let (header, rest) = block.split_at_mut(HEAD);
        let (full, rest) = rest.split_at_mut(cap * FULL_WORDS);
        let paged = &mut rest[..cap * PAGE_WORDS];
        // The page-starting batch indices, in index order (written even if the
        // reservation below fails: `owners` is output space, read only on success).
        let mut j = 0;
        for (w, &word) in class.iter().enumerate() {
            let mut m = word;
            while m != 0 {
                owners[j] = (w * 64 + m.trailing_zeros() as usize) as u32;
                m &= m - 1;
                j += 1;
            }
        }
        let owners = &owners[..fresh];
        if self.page_size == 1 {
            // Every request takes a page, its slot: continue each one's run.
            let last = &self.last;
            host.reserve_decode_pages(&mut pages[..fresh], |j| last[owners[j] as usize])?;
        } else {
            host.reserve_pages(&mut pages[..fresh])?;
        }
        let full: &mut [DeltaEntry] = bytemuck::cast_slice_mut(full);
        let paged: &mut [DeltaPage] = bytemuck::cast_slice_mut(paged);
        let mut np = 0;
        for (&i, &page) in owners.iter().zip(&pages[..fresh]) {
            let i = i as usize;
            self.page_of[i] = page;
            if !self.is_dirty[i] {
                paged[np] = DeltaPage { index: i as u32, page };
                np += 1;
            }
        }
        let mut nf = 0;
        for &d in &self.dirty {
            let i = d as usize;
            full[nf] = if i < self.batch {
                let len = self.len_of(i);
                let page = if self.phase[i] as usize == ph { self.page_of[i] } else { 0 };
                DeltaEntry { index: d, row: self.row[i], len, page }
            } else {
                DeltaEntry { index: d, row: PAD_ROW, len: 0, page: 0 }
            };
            nf += 1;
        }
        let tag = self.clock.wrapping_add(1) as u32;
        header[..3].copy_from_slice(&[nf as u32, np as u32, tag]);
        Ok(StagedDelta {
            batch: self.batch,
            bucket: bucket_for(self.batch),
            full: nf,
            paged: np,
            new_pages: fresh,
            tag,
        })
    }

    /// The step staged last was launched: the device has seen every change, and every
    /// request is one token longer.
    pub fn commit(&mut self) {
        for &d in &self.dirty {
            self.is_dirty[d as usize] = false;
        }
        self.dirty.clear();
        // Page size 1: every request took a page, its slot, in the staged step.
        let n = self.batch.min(self.last.len());
        self.last[..n].copy_from_slice(&self.page_of[..n]);
        self.clock += 1;
    }

    /// The full entries of a staged block.
    pub fn full_entries<'b>(&self, block: &'b [u32], staged: &StagedDelta) -> &'b [DeltaEntry] {
        bytemuck::cast_slice(&block[HEAD..HEAD + FULL_WORDS * staged.full])
    }

    /// The page entries of a staged block.
    pub fn page_entries<'b>(&self, block: &'b [u32], staged: &StagedDelta) -> &'b [DeltaPage] {
        let at = HEAD + FULL_WORDS * self.capacity;
        bytemuck::cast_slice(&block[at..at + PAGE_WORDS * staged.paged])
    }

    // ---- bookkeeping -----------------------------------------------------------------

    fn mark(&mut self, i: usize) {
        if !self.is_dirty[i] {
            self.is_dirty[i] = true;
            self.dirty.push(i as u32);
        }
    }

    fn set_bit(&mut self, phase: usize, i: usize) {
        self.bits[phase * self.words + i / 64] |= 1 << (i % 64);
    }

    fn clear_bit(&mut self, phase: usize, i: usize) {
        self.bits[phase * self.words + i / 64] &= !(1 << (i % 64));
    }

    /// Put a request at index `i`: its row, base, phase bit and heap entry.
    fn place(&mut self, i: usize, row: u32, len: u32) {
        let base = len as i64 - self.clock as i64;
        let phase = (-base).rem_euclid(self.page_size as i64) as usize;
        self.row[i] = row;
        self.base[i] = base;
        self.phase[i] = phase as u32;
        self.set_bit(phase, i);
        self.heap_at[i] = self.heap.len() as u32;
        self.heap.push(i as u32);
        self.sift_up(self.heap.len() - 1);
    }

    /// Take the request at index `i` out of its phase and the heap.
    fn unplace(&mut self, i: usize) {
        self.clear_bit(self.phase[i] as usize, i);
        let at = self.heap_at[i] as usize;
        let last = self.heap.len() - 1;
        self.heap.swap(at, last);
        self.heap_at[self.heap[at] as usize] = at as u32;
        self.heap.pop();
        self.heap_at[i] = NONE;
        if at < self.heap.len() {
            self.sift_down(at);
            self.sift_up(at);
        }
    }

    fn key(&self, at: usize) -> i64 {
        self.base[self.heap[at] as usize]
    }

    fn swap_nodes(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.heap_at[self.heap[a] as usize] = a as u32;
        self.heap_at[self.heap[b] as usize] = b as u32;
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.key(parent) >= self.key(at) {
                break;
            }
            self.swap_nodes(parent, at);
            at = parent;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        loop {
            let (l, r) = (2 * at + 1, 2 * at + 2);
            let mut top = at;
            if l < self.heap.len() && self.key(l) > self.key(top) {
                top = l;
            }
            if r < self.heap.len() && self.key(r) > self.key(top) {
                top = r;
            }
            if top == at {
                return;
            }
            self.swap_nodes(top, at);
            at = top;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::reference::{decode_delta, decode_with_rows, extend_with_rows, RowTable};
    use crate::kv::staging::{decode_block_bytes, stage_decode_after};

    use crate::kv::staging::tests::Rng;

    /// One side of the comparison: an allocator and a table of rows.
    struct Side {
        host: PagedAllocator,
        cells: Vec<u32>,
    }

    impl Side {
        fn extend(&mut self, ps: u32, stride: usize, row: u32, prefix: u32, seq: u32) {
            let n = crate::alloc::new_pages(ps, prefix, seq) as usize;
            let mut pages = vec![0u32; n];
            self.host.reserve_pages(&mut pages).unwrap();
            let mut out = vec![0u32; (seq - prefix) as usize];
            let rt = RowTable { cells: &mut self.cells, stride, rows: &[row] };
            extend_with_rows(ps, &[prefix], &[seq], None, &pages, &mut out, Some(rt)).unwrap();
        }

        fn finish(&self, stride: usize, row: u32, len: u32) {
            let at = row as usize * stride;
            self.host.free(&self.cells[at..at + len as usize]).unwrap();
        }
    }

    /// The planner plus the host reference kernel against the model (a `Vec` of
    /// requests, `swap_remove` order) decoded with `stage_decode_after` +
    /// `decode_with_rows`, each on its own allocator in the same state: the same slots,
    /// rows and pages after every step. The model's last slots are read from its rows
    /// where the planner knows them (told after a join or an extend half the time, and
    /// after every step); at page size 1 they decide the pages.
    fn walk(ps: u32, steps: usize, seed: u64) {
        let (rows, stride, cap) = (40u32, 300usize, 64usize);
        let limits = RowLimits { rows, max_context_len: stride as u32 };
        let mut rng = Rng(seed);
        let mut plan = DeltaPlanner::new(ps, limits, cap).unwrap();
        let mut block = vec![0u32; delta_block_words(cap)];
        let (mut fresh_pages, mut fresh_owners) = (vec![0u32; cap], vec![0u32; cap]);
        let mut state = vec![DeltaSlot::PAD; cap];
        let mut d = Side { host: PagedAllocator::new(1 << 14, ps).unwrap(), cells: vec![0; rows as usize * stride] };
        let mut m = Side { host: PagedAllocator::new(1 << 14, ps).unwrap(), cells: vec![0; rows as usize * stride] };
        let whole = d.host.available_size();
        let mut live: Vec<(u32, u32)> = Vec::new();
        // Per live request: whether the planner knows its last slot.
        let mut known: Vec<bool> = Vec::new();
        let (mut told, mut continued, mut one_slot) = (0usize, 0usize, 0usize);
        let last_of = |cells: &[u32], (row, len): (u32, u32)| cells[row as usize * stride + len as usize - 1];
        let mut free_rows: Vec<u32> = (0..rows).rev().collect();
        let mut mblock = vec![0u32; decode_block_bytes(cap) / 4];
        let (mut decodes, mut entries, mut fresh) = (0usize, 0usize, 0usize);
        let (mut moves, mut extends, mut widest) = (0usize, 0usize, 0usize);
        while decodes < steps {
            let dice = rng.below(100);
            if dice < 12 && !free_rows.is_empty() {
                let row = free_rows.pop().unwrap();
                let len = rng.below(3 * ps as u64 + 40) as u32;
                d.extend(ps, stride, row, 0, len);
                m.extend(ps, stride, row, 0, len);
                assert_eq!(plan.join(row, len).unwrap() as usize, live.len());
                let tell = len > 0 && rng.below(2) == 0;
                if tell {
                    plan.set_last_slot(live.len() as u32, last_of(&d.cells, (row, len))).unwrap();
                    told += 1;
                }
                live.push((row, len));
                known.push(tell);
            } else if dice < 17 && !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let (row, len) = live[i];
                let to = (len + 1 + rng.below(20) as u32).min(stride as u32);
                d.extend(ps, stride, row, len, to);
                m.extend(ps, stride, row, len, to);
                plan.set_len(i as u32, to).unwrap();
                live[i].1 = to;
                known[i] = rng.below(2) == 0;
                if known[i] {
                    plan.set_last_slot(i as u32, last_of(&d.cells, live[i])).unwrap();
                    told += 1;
                }
                extends += 1;
            } else if dice < 25 && !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let (row, len) = live.swap_remove(i);
                known.swap_remove(i);
                d.finish(stride, row, len);
                m.finish(stride, row, len);
                free_rows.push(row);
                let moved = plan.leave(i as u32).unwrap();
                assert_eq!(moved, (i < live.len()).then_some(live.len() as u32));
                moves += moved.is_some() as usize;
            } else {
                // Requests at the end of their row finish first.
                let mut i = 0;
                while i < live.len() {
                    if live[i].1 as usize >= stride {
                        let (row, len) = live.swap_remove(i);
                        known.swap_remove(i);
                        d.finish(stride, row, len);
                        m.finish(stride, row, len);
                        free_rows.push(row);
                        plan.leave(i as u32).unwrap();
                    } else {
                        i += 1;
                    }
                }
                let batch = live.len();
                let staged = plan.stage(&d.host, &mut block, &mut fresh_pages, &mut fresh_owners).unwrap();
                assert_eq!((staged.batch, staged.bucket), (batch, bucket_for(batch)));
                let mut out = vec![u32::MAX; staged.bucket];
                let full = plan.full_entries(&block, &staged).to_vec();
                let paged = plan.page_entries(&block, &staged).to_vec();
                // Every page-starting request got its page in exactly one entry.
                let with_page = full.iter().filter(|e| e.row != PAD_ROW && e.len % ps == 0).count();
                assert_eq!(with_page + paged.len(), staged.new_pages);
                decode_delta(ps, &mut state, &full, &paged, staged.bucket, &mut out, &mut d.cells, rows, stride)
                    .unwrap();
                let pages = fresh_pages[..staged.new_pages].to_vec();
                let owners = fresh_owners[..staged.new_pages].to_vec();
                plan.commit();
                // The model.
                let seq: Vec<u32> = live.iter().map(|r| r.1 + 1).collect();
                let rws: Vec<u32> = live.iter().map(|r| r.0).collect();
                let b: &mut [u8] = bytemuck::cast_slice_mut(&mut mblock[..decode_block_bytes(staged.bucket) / 4]);
                let lasts: Vec<u32> =
                    live.iter().zip(&known).map(|(&r, &k)| if k { last_of(&m.cells, r) } else { u32::MAX }).collect();
                let s = stage_decode_after(&m.host, &seq, &rws, staged.bucket, limits, b, |i| lasts[i]).unwrap();
                let at = decode_records_bytes_words(staged.bucket);
                let mpages = mblock[at..at + s.new_pages].to_vec();
                assert_eq!(pages, mpages, "pages, step {decodes}");
                let mut want = vec![0u32; batch];
                let rt = RowTable { cells: &mut m.cells, stride, rows: &rws };
                decode_with_rows(ps, &seq, None, &mpages, &mut want, Some(rt)).unwrap();
                assert_eq!(&out[..batch], &want[..], "slots, step {decodes}");
                assert!(out[batch..].iter().all(|&s| s == 0), "padding gets slot 0");
                let starters: Vec<u32> = (0..batch as u32).filter(|&i| live[i as usize].1 % ps == 0).collect();
                assert_eq!(owners, starters);
                assert!(d.cells == m.cells, "rows differ after step {decodes}");
                if ps == 1 {
                    for (&l, &slot) in lasts.iter().zip(&want) {
                        continued += (l != u32::MAX && slot == l + 1) as usize;
                        one_slot += 1;
                    }
                }
                for r in live.iter_mut() {
                    r.1 += 1;
                }
                known.iter_mut().for_each(|k| *k = true);
                for (i, r) in live.iter().enumerate() {
                    assert_eq!(plan.len(i as u32).unwrap(), r.1);
                    assert_eq!(plan.row(i as u32).unwrap(), r.0);
                }
                decodes += 1;
                widest = widest.max(batch);
                entries += staged.full + staged.paged;
                fresh += staged.new_pages;
            }
            assert_eq!(plan.batch(), live.len());
        }
        for (row, len) in live.drain(..) {
            d.finish(stride, row, len);
            m.finish(stride, row, len);
        }
        assert_eq!(d.host.available_size(), whole);
        assert!(fresh > 0 && entries > 0 && moves > 10 && extends > 10 && widest > 10, "{moves} {extends} {widest}");
        assert!(told > 10, "{told}");
        if ps == 1 {
            // Runs go on: most slots follow their request's last one.
            assert!(continued * 2 > one_slot, "{continued} of {one_slot} slots continued a run");
        }
        println!(
            "page size {ps}: {decodes} steps, {entries} entries, {fresh} fresh pages, {moves} moves, {extends} extends, \
             widest batch {widest}, last slots told {told}, {continued} of {one_slot} slots continued a run"
        );
    }

    fn decode_records_bytes_words(bucket: usize) -> usize {
        crate::kv::staging::decode_records_bytes(bucket) / 4
    }

    #[test]
    fn planner_matches_the_full_records_model() {
        walk(16, 1500, 0x9e37_79b9_7f4a_7c15);
        walk(1, 400, 7);
        walk(5, 600, 11);
        walk(64, 400, 13);
    }

    #[test]
    fn refusals_change_nothing() {
        let limits = RowLimits { rows: 4, max_context_len: 10 };
        let host = PagedAllocator::new(16, 4).unwrap();
        let mut plan = DeltaPlanner::new(4, limits, 2).unwrap();
        let mut block = vec![0u32; delta_block_words(2)];
        let (mut p, mut o) = ([0u32; 2], [0u32; 2]);
        assert!(matches!(plan.join(4, 0), Err(KvError::SlotOutOfRange { .. })));
        assert!(matches!(plan.join(0, 11), Err(KvError::Shape { .. })));
        assert_eq!(plan.join(0, 8).unwrap(), 0);
        assert_eq!(plan.join(1, 4).unwrap(), 1);
        assert!(matches!(plan.join(2, 0), Err(KvError::Shape { what: "batch (capacity)", .. })));
        assert!(matches!(plan.leave(2), Err(KvError::Shape { .. })));
        assert!(matches!(plan.set_len(0, 11), Err(KvError::Shape { .. })));
        assert!(matches!(plan.set_last_slot(2, 7), Err(KvError::Shape { .. })));
        assert!(matches!(
            plan.stage(&host, &mut block[1..], &mut p, &mut o),
            Err(KvError::Shape { what: "block", .. })
        ));
        // Pages: 4 in the pool; both requests start one, with one left.
        let mut hold = [0u32; 3];
        host.reserve_pages(&mut hold).unwrap();
        assert!(matches!(plan.stage(&host, &mut block, &mut p, &mut o), Err(KvError::Alloc(_))));
        assert_eq!(host.available_pages(), 1);
        let ps = host.page_size();
        let mut group = host.free_group();
        group.free(&[hold[0] * ps]).unwrap();
        group.free(&[hold[1] * ps]).unwrap();
        group.end();
        let s = plan.stage(&host, &mut block, &mut p, &mut o).unwrap();
        assert_eq!((s.new_pages, s.full, s.paged), (2, 2, 0));
        plan.commit();
        // Request 0 reaches 10 tokens (the row's end) after one more step.
        let s = plan.stage(&host, &mut block, &mut p, &mut o).unwrap();
        assert_eq!((s.new_pages, s.full, s.paged), (0, 0, 0));
        plan.commit();
        let before = host.available_pages();
        assert!(matches!(
            plan.stage(&host, &mut block, &mut p, &mut o),
            Err(KvError::Shape { what: "seq_len (max_context_len)", .. })
        ));
        assert_eq!(host.available_pages(), before);
        assert_eq!(plan.len(0).unwrap(), 10);
        // Once the long request leaves, the other one (now at index 0) goes on.
        assert_eq!(plan.leave(0).unwrap(), Some(1));
        assert_eq!((plan.row(0).unwrap(), plan.len(0).unwrap()), (1, 6));
        let s = plan.stage(&host, &mut block, &mut p, &mut o).unwrap();
        // Index 0 gets request 1's state, index 1 becomes padding.
        assert!(plan.page_entries(&block, &s).is_empty());
        assert_eq!(
            plan.full_entries(&block, &s),
            &[DeltaEntry { index: 0, row: 1, len: 6, page: 0 }, DeltaEntry { index: 1, row: PAD_ROW, len: 0, page: 0 },]
        );
        assert!(DeltaPlanner::new(4, limits, 0).is_err());
        assert!(DeltaPlanner::new(0, limits, 1).is_err());
    }

    #[test]
    fn heap_tracks_the_longest_request() {
        let limits = RowLimits { rows: 64, max_context_len: 1000 };
        let mut plan = DeltaPlanner::new(16, limits, 64).unwrap();
        let mut rng = Rng(3);
        let mut lens: Vec<u32> = Vec::new();
        for _ in 0..2000 {
            match rng.below(3) {
                0 if lens.len() < 64 => {
                    let l = rng.below(1000) as u32;
                    plan.join(lens.len() as u32, l).unwrap();
                    lens.push(l);
                }
                1 if !lens.is_empty() => {
                    let i = rng.below(lens.len() as u64) as usize;
                    lens.swap_remove(i);
                    plan.leave(i as u32).unwrap();
                }
                _ if !lens.is_empty() => {
                    let i = rng.below(lens.len() as u64) as usize;
                    let l = rng.below(1000) as u32;
                    plan.set_len(i as u32, l).unwrap();
                    lens[i] = l;
                }
                _ => {}
            }
            let top = plan.heap.first().map(|&i| plan.len_of(i as usize));
            assert_eq!(top, lens.iter().copied().max());
            for (at, &i) in plan.heap.iter().enumerate() {
                assert_eq!(plan.heap_at[i as usize] as usize, at);
            }
        }
    }
}
