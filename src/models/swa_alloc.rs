//! [`SwaAllocator`] against a plain sequential model, operation by operation (feature
//! `models`): the shared driver of `tests/swa_alloc_model.rs` and the `swa_alloc_ops`
//! fuzz target.
//!
//! [`SwaModel`] is the parent module's [`AllocModel`] for the full pool (the full pool
//! *is* a `PagedAllocator`), plus a plain model of the window pool (a `Vec<bool>` of
//! free pages, lowest first, and a count of pages freed inside the open free group)
//! and the mapping kept a page at a time (`map[full page] = window page`, 0 for none).
//! It never calls kvpool's own mapping code: the real mapping table is compared, entry
//! by entry, with the one the model's pages imply.
//!
//! The rules it encodes (the module docs of `kvpool::alloc::swa`):
//!
//! * an allocation validates as `PagedAllocator`'s does, then needs its fresh pages
//!   from the full pool (else out of memory in [`Unit::Tokens`]) and as many from the
//!   window pool (else out of memory in [`Unit::WindowTokens`], `available` counting
//!   the window pool's published free pages); a refused call changes nothing. The
//!   `k`-th fresh full page maps to the `k`-th window page the window pool hands out
//!   (both in the order of the pools' placement, see `kvpool::slots`);
//! * `free` (plain or through a group) releases the window page of every full page it
//!   names that has one, but only when every slot of the batch is allocated (the full
//!   pool's validation passed); then the full pool frees as `PagedAllocator` does
//!   (repeats merge at every page size: with page size 1, a slot named twice is freed
//!   once, with no error); a refused batch changes neither pool;
//!   inside a group both pools' frees count as available only when it ends;
//! * `free_swa` validates every slot (the full pool's error, nothing changes on
//!   error), then releases the window page of each named page that has one, published
//!   at once even while a group is open; it returns the window tokens freed;
//! * a group's `free_pages(first, count)` releases the window part of a range that is
//!   in range and wholly allocated, then frees the range into the full pool (errors in
//!   pages: `OutOfRange { first: 1, last: pages }`, the index times the page size);
//! * `translate` writes each slot's window slot, 0 for a slot without one.
//!
//! After every step the driver compares the step's own result (outputs, error kinds
//! and values, window tokens freed, translations), then `available_size` and both
//! pools' free counts, the open group's pending count, `is_allocated` of every full
//! page, the whole mapping table (`SwaWindow::copy_mapping`), and runs
//! `check_invariants()`.

use arbitrary::{Arbitrary, Unstructured};

use super::{
    alloc_outcome, free_batch_outcome, free_op, free_outcome, last_loc, AllocModel, Allocated, Batch, Control,
    DecodeReq, ExpectedFreeError, ExtendReq, FreeOp, Misalign, RawSlot, Runner, ShapeFault, Stats, MAX_BATCH,
    MAX_FORGED, SENTINEL,
};
use crate::alloc::{KvAllocator, KvFreeGroup, SwaAllocator};
use crate::error::{AllocError, FreeErrorKind, InvalidInput, OutOfMemory, Unit};

/// How many ops the `swa_alloc_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 16;
/// The most slots either pool of [`SwaScenario::from_fuzz_input`] has.
pub const MAX_FUZZ_SLOTS: u32 = 512;
/// The page sizes a [`SwaScenario`] picks from (1 and 4 twice: the token allocator and
/// a small power of two matter most; 3 is not a power of two).
pub const SWA_SCENARIO_PAGE_SIZES: [u32; 8] = [1, 2, 3, 4, 16, 1, 4, 64];

/// Which slots a [`SwaOp::FreeSwa`] releases the window part of.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum SwaFreeOp {
    /// The first `1 + take % len` slots of a live handle: the tokens that fell out of
    /// its request's window. The handle stays live (its full pages stay allocated).
    Part {
        /// Which live handle.
        handle: u8,
        /// How many slots.
        take: u8,
    },
    /// The last `1 + take % len` slots of a live handle.
    Tail {
        /// Which live handle.
        handle: u8,
        /// How many slots.
        take: u8,
    },
    /// A live handle with a forged slot inserted (refused unless the forged slot is
    /// allocated).
    WithForged {
        /// Which live handle.
        handle: u8,
        /// The forged slot.
        forged: RawSlot,
        /// Where in the batch it goes.
        at: u8,
    },
    /// An already-freed handle (refused, unless its pages were handed out again).
    Stale {
        /// Which remembered handle.
        which: u8,
    },
    /// Forged slots.
    Forged {
        /// The slots (at most [`MAX_FORGED`] are used).
        slots: Vec<RawSlot>,
    },
}

/// Which pages a [`SwaOp::FreePages`] frees through a free group.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum FreePagesOp {
    /// The leading run of consecutive pages of a live handle, plus `more % 2` pages
    /// past it (which may be free or someone else's).
    Live {
        /// Which live handle.
        handle: u8,
        /// Extra pages past the run.
        more: u8,
    },
    /// A forged range: first page `first % (pages + 2)`, `count % 6` pages.
    Forged {
        /// Raw first page.
        first: u8,
        /// Raw page count.
        count: u8,
    },
}

/// A [`SwaOp::Translate`]: the window slots of a live handle's slots, with forged ones.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub struct TranslateOp {
    /// Which live handle (none: only the forged slots).
    pub handle: u8,
    /// Forged slots appended (at most [`MAX_FORGED`]).
    pub forged: Vec<RawSlot>,
    /// `short_out % 8 == 7`: an output buffer one slot short, refused with a length
    /// mismatch (1 in 8).
    pub short_out: u8,
}

/// One step of a [`SwaAllocator`] operation sequence.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum SwaOp {
    /// `alloc` of whole pages (see [`Op::Alloc`](super::Op::Alloc)).
    Alloc {
        /// Raw page count.
        pages: u8,
        /// Extra tokens, making the count a non-multiple of the page size.
        misalign: Misalign,
    },
    /// `alloc_extend` of a batch.
    AllocExtend {
        /// The requests (at most [`MAX_BATCH`] are used).
        reqs: Batch<ExtendReq>,
        /// A deliberate shape defect.
        fault: ShapeFault,
    },
    /// `alloc_decode` of a batch.
    AllocDecode {
        /// The requests (at most [`MAX_BATCH`] are used).
        reqs: Batch<DecodeReq>,
        /// A deliberate shape defect.
        fault: ShapeFault,
    },
    /// Free live handle `handle` (an empty list when there is none), through the
    /// open group if there is one.
    FreeLive {
        /// Which live handle.
        handle: u8,
    },
    /// The other kinds of free (partial, duplicated, forged, stale).
    Free(FreeOp),
    /// `free_swa`: release window parts only.
    FreeSwa(SwaFreeOp),
    /// `KvFreeGroup::free_pages`, through the open group or a group of its own.
    FreePages(FreePagesOp),
    /// `translate`.
    Translate(TranslateOp),
    /// Free-group and lifecycle steps.
    Control(Control),
}

/// Parse as many [`SwaOp`]s from `bytes` as they hold (any bytes work).
///
/// # Examples
///
/// ```
/// let ops = kvpool::models::swa_alloc::swa_ops_from_bytes(&[3, 1, 4, 1, 5, 9, 2, 6]);
/// assert!(!ops.is_empty());
/// ```
pub fn swa_ops_from_bytes(bytes: &[u8]) -> Vec<SwaOp> {
    let mut u = Unstructured::new(bytes);
    let mut ops = Vec::new();
    while !u.is_empty() {
        match SwaOp::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    ops
}

/// The sequential model of an [`SwaAllocator`] (see the [module docs](self)).
///
/// # Examples
///
/// The allocator's doc example, on the model:
///
/// ```
/// use kvpool::models::swa_alloc::SwaModel;
/// let mut m = SwaModel::new(64, 16, 4);
/// let a = m.alloc(8).unwrap();
/// assert_eq!(a.slots, [4, 5, 6, 7, 8, 9, 10, 11]);
/// assert_eq!(m.window_slot(9), Some(9));
/// assert_eq!(m.available(), 8);
/// assert_eq!(m.free_swa(&a.slots[..4]).unwrap(), 4);
/// assert_eq!((m.window_slot(4), m.window_available()), (None, 12));
/// m.free(&a.slots).unwrap();
/// assert_eq!((m.full().available(), m.window_available()), (64, 16));
/// ```
#[derive(Debug, Clone)]
pub struct SwaModel {
    full: AllocModel,
    /// `window_free[w]`: window page `w` is free (index 0, the reserved page, never).
    window_free: Vec<bool>,
    /// Window pages freed inside the open group: free, not yet available.
    window_pending: usize,
    group_open: bool,
    /// For each full page (index 0 included): its window page, 0 for none.
    map: Vec<u32>,
}

impl SwaModel {
    /// The model of `SwaAllocator::new(full_size, window_size, page_size)`; both pools
    /// must have a whole page and `page_size` must be at least 1.
    pub fn new(full_size: usize, window_size: usize, page_size: u32) -> Self {
        let full = AllocModel::paged(full_size, page_size);
        let window_pages = window_size / page_size as usize;
        let mut window_free = vec![true; window_pages + 1];
        window_free[0] = false;
        let map = vec![0; full.num_pages() as usize + 1];
        SwaModel { full, window_free, window_pending: 0, group_open: false, map }
    }

    /// The full pool's model.
    pub fn full(&self) -> &AllocModel {
        &self.full
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.full.page_size()
    }

    /// Pages of the window pool.
    pub fn window_pages(&self) -> u32 {
        (self.window_free.len() - 1) as u32
    }

    fn window_free_pages(&self) -> usize {
        self.window_free.iter().filter(|&&f| f).count() - self.window_pending
    }

    /// What `window_available_size()` must say.
    pub fn window_available(&self) -> usize {
        self.window_free_pages() * self.page_size() as usize
    }

    /// What `available_size()` must say: the smaller of the two pools'.
    pub fn available(&self) -> usize {
        self.full.available().min(self.window_available())
    }

    /// The window page of full page `page`, 0 for none (or out of range).
    pub fn window_page(&self, page: u32) -> u32 {
        self.map.get(page as usize).copied().unwrap_or(0)
    }

    /// What `window_slot(slot)` must say.
    pub fn window_slot(&self, slot: u32) -> Option<u32> {
        let ps = self.page_size();
        let w = self.window_page(slot / ps);
        (w != 0).then(|| w * ps + slot % ps)
    }

    /// What `translate` must write for `slots`.
    pub fn translate(&self, slots: &[u32]) -> Vec<u32> {
        slots.iter().map(|&s| self.window_slot(s).unwrap_or(0)).collect()
    }

    /// The whole mapping table, as `SwaWindow::copy_mapping(0, ..)` must copy it.
    pub fn mapping(&self) -> Vec<u32> {
        let ps = self.page_size();
        (0..self.map.len() as u32 * ps).map(|s| self.window_slot(s).unwrap_or(0)).collect()
    }

    /// Free window page `w` (into the open group if there is one and `grouped`).
    fn release_window(&mut self, page: u32, grouped: bool) -> bool {
        let w = core::mem::take(&mut self.map[page as usize]);
        if w == 0 {
            return false;
        }
        debug_assert!(!self.window_free[w as usize], "the model freed window page {w} twice");
        self.window_free[w as usize] = true;
        if grouped && self.group_open {
            self.window_pending += 1;
        }
        true
    }

    /// Run `alloc` on a copy of the full pool's model; if it succeeds and the window
    /// pool has as many free pages, commit it and map the fresh pages.
    fn alloc_both(
        &mut self,
        f: impl FnOnce(&mut AllocModel) -> Result<Allocated, AllocError>,
    ) -> Result<Allocated, AllocError> {
        let mut full = self.full.clone();
        let a = f(&mut full)?;
        let n = a.pages.len();
        if n > self.window_free_pages() {
            let ps = self.page_size() as usize;
            return Err(AllocError::OutOfMemory(OutOfMemory {
                requested: n * ps,
                available: self.window_available(),
                evictable: None,
                unit: Unit::WindowTokens,
            }));
        }
        self.full = full;
        // The k-th fresh full page (in the order the full pool hands them out) gets
        // the k-th window page the window pool's claim hands out (the same placement).
        let free = (1..self.window_free.len()).filter(|&w| self.window_free[w]).map(|w| w as u32);
        for (&p, w) in a.pages.iter().zip(crate::slots::placement(free, n)) {
            self.window_free[w as usize] = false;
            debug_assert_eq!(self.map[p as usize], 0, "a fresh full page {p} had a window page");
            self.map[p as usize] = w;
        }
        Ok(a)
    }

    /// `alloc` of `n` tokens.
    ///
    /// # Errors
    ///
    /// Not page aligned, then out of memory in the full pool, then in the window pool.
    pub fn alloc(&mut self, n: usize) -> Result<Allocated, AllocError> {
        self.alloc_both(|full| full.alloc(n))
    }

    /// `alloc_extend` with an output buffer of `out_len` slots.
    ///
    /// # Errors
    ///
    /// As [`AllocModel::alloc_extend`], then out of memory in the window pool.
    pub fn alloc_extend(
        &mut self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
    ) -> Result<Allocated, AllocError> {
        self.alloc_both(|full| full.alloc_extend(prefix_lens, seq_lens, last_locs, out_len))
    }

    /// `alloc_decode` with an output buffer of `out_len` slots.
    ///
    /// # Errors
    ///
    /// As [`AllocModel::alloc_decode`], then out of memory in the window pool.
    pub fn alloc_decode(
        &mut self,
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
    ) -> Result<Allocated, AllocError> {
        self.alloc_both(|full| full.alloc_decode(seq_lens, last_locs, out_len))
    }

    /// `free` (or a group's `free` while a group is open).
    ///
    /// # Errors
    ///
    /// What the real free must report (the full pool's error).
    pub fn free(&mut self, slots: &[u32]) -> Result<(), ExpectedFreeError> {
        let ps = self.page_size();
        if slots.iter().all(|&s| self.full.is_allocated(s)) {
            for &s in slots {
                self.release_window(s / ps, true);
            }
        }
        self.full.free(slots)
    }

    /// The error `free_swa` (and `free`) must give for the first slot of `slots` that is
    /// not allocated, if any.
    fn first_unallocated(&self, slots: &[u32]) -> Option<ExpectedFreeError> {
        let ps = self.page_size();
        let bad = slots.iter().copied().find(|&s| !self.full.is_allocated(s))?;
        let kind = if bad < ps || bad / ps > self.full.num_pages() {
            FreeErrorKind::OutOfRange { first: ps, last: self.full.last_slot() }
        } else {
            FreeErrorKind::NotAllocated
        };
        Some(ExpectedFreeError { kind, rest_freed: false, index_any_of: vec![bad] })
    }

    /// `free_swa`: the window tokens freed.
    ///
    /// # Errors
    ///
    /// The first slot whose full page is out of range or not allocated; nothing changes.
    pub fn free_swa(&mut self, slots: &[u32]) -> Result<usize, ExpectedFreeError> {
        if let Some(e) = self.first_unallocated(slots) {
            return Err(e);
        }
        let ps = self.page_size();
        let mut freed = 0;
        for &s in slots {
            // Published at once: `free_swa` ends a window group of its own.
            freed += self.release_window(s / ps, false) as usize;
        }
        Ok(freed * ps as usize)
    }

    /// A group's `free_pages(first, count)` (a group must be open).
    ///
    /// # Errors
    ///
    /// What the real call must report; nothing changes on error.
    pub fn free_pages(&mut self, first: u32, count: u32) -> Result<(), ExpectedFreeError> {
        assert!(self.group_open, "free_pages outside a group");
        let ps = self.page_size();
        let np = self.full.num_pages();
        if count == 0 {
            return Ok(());
        }
        let last = first as u64 + count as u64 - 1;
        if first == 0 || last > np as u64 {
            let page = if first == 0 { 0 } else { (np as u64 + 1).min(last) as u32 };
            let kind = FreeErrorKind::OutOfRange { first: 1, last: np };
            return Err(ExpectedFreeError { kind, rest_freed: false, index_any_of: vec![page.saturating_mul(ps)] });
        }
        if let Some(p) = (first..first + count).find(|&p| !self.full.is_page_allocated(p)) {
            let kind = FreeErrorKind::NotAllocated;
            return Err(ExpectedFreeError { kind, rest_freed: false, index_any_of: vec![p.saturating_mul(ps)] });
        }
        for p in first..first + count {
            self.release_window(p, true);
        }
        let slots: Vec<u32> = (first..first + count).map(|p| p * ps).collect();
        self.full.free(&slots)
    }

    /// Open a free group.
    pub fn begin_group(&mut self) {
        self.full.begin_group();
        self.group_open = true;
    }

    /// End the open group; returns the full pool's tokens it makes available.
    pub fn end_group(&mut self) -> usize {
        self.window_pending = 0;
        self.group_open = false;
        self.full.end_group()
    }

    /// Everything free, no mapping (any open group must have ended).
    pub fn clear(&mut self) {
        self.full.clear();
        self.window_free.iter_mut().for_each(|f| *f = true);
        self.window_free[0] = false;
        self.window_pending = 0;
        self.group_open = false;
        self.map.iter_mut().for_each(|w| *w = 0);
    }

    /// The model's own consistency: a full page has a window page only while it is
    /// allocated, no window page is mapped twice, and the window pages in use are
    /// exactly the mapped ones.
    ///
    /// # Errors
    ///
    /// A message naming the first inconsistency (a bug in the model).
    pub fn check(&self) -> Result<(), String> {
        let mut used = vec![false; self.window_free.len()];
        for (p, &w) in self.map.iter().enumerate() {
            if w == 0 {
                continue;
            }
            if !self.full.is_page_allocated(p as u32) {
                return Err(format!("model: free full page {p} maps to window page {w}"));
            }
            if core::mem::replace(&mut used[w as usize], true) || self.window_free[w as usize] {
                return Err(format!("model: window page {w} is mapped twice or free"));
            }
        }
        let in_use = self.window_free.iter().skip(1).filter(|&&f| !f).count();
        let mapped = used.iter().filter(|&&u| u).count();
        if in_use != mapped {
            return Err(format!("model: {in_use} window pages in use, {mapped} mapped"));
        }
        Ok(())
    }
}

/// A whole fuzz input: the page size, both pools' sizes, and the op sequence.
#[derive(Arbitrary, Debug, Clone)]
pub struct SwaScenario {
    /// Index into [`SWA_SCENARIO_PAGE_SIZES`] (mod 8).
    pub page_size: u8,
    /// Full pool pages: `1 + full_pages % max` (see [`from_fuzz_input`](Self::from_fuzz_input)).
    pub full_pages: u8,
    /// Window pool pages: `1 + window_pages % max`.
    pub window_pages: u8,
    /// The operations.
    pub ops: Vec<SwaOp>,
}

impl SwaScenario {
    /// The page size this scenario uses.
    pub fn page_size(&self) -> u32 {
        SWA_SCENARIO_PAGE_SIZES[self.page_size as usize % SWA_SCENARIO_PAGE_SIZES.len()]
    }

    /// The most pages a pool of this page size has (at most [`MAX_FUZZ_SLOTS`] slots,
    /// at most 130 pages: three bitmap words).
    fn max_pages(&self) -> u32 {
        (MAX_FUZZ_SLOTS / self.page_size()).clamp(1, 130)
    }

    /// Token size of the full pool.
    pub fn full_size(&self) -> usize {
        (1 + self.full_pages as u32 % self.max_pages()) as usize * self.page_size() as usize
    }

    /// Token size of the window pool.
    pub fn window_size(&self) -> usize {
        (1 + self.window_pages as u32 % self.max_pages()) as usize * self.page_size() as usize
    }

    /// The fuzz target's reading of its input: three header bytes (page size, full
    /// pages, window pages), then at most `max_ops` ops. Any bytes work.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::models::swa_alloc::SwaScenario;
    /// let s = SwaScenario::from_fuzz_input(&[3, 40, 7, 7, 7, 7, 1, 0, 0, 0, 3, 3, 3], 4);
    /// assert!(s.ops.len() <= 4);
    /// s.run()?;
    /// # Ok::<(), String>(())
    /// ```
    pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> SwaScenario {
        let mut u = Unstructured::new(bytes);
        let mut byte = || u8::arbitrary(&mut u).unwrap_or(0);
        let (page_size, full_pages, window_pages) = (byte(), byte(), byte());
        let mut ops = Vec::new();
        while ops.len() < max_ops && !u.is_empty() {
            match SwaOp::arbitrary(&mut u) {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        SwaScenario { page_size, full_pages, window_pages, ops }
    }

    /// Run the ops on the allocator this scenario describes, against the model.
    ///
    /// # Errors
    ///
    /// The first disagreement, as a message naming the step and the op.
    pub fn run(&self) -> Result<Stats, String> {
        let (full, window, ps) = (self.full_size(), self.window_size(), self.page_size());
        run_swa(&self.ops, full, window, ps).map_err(|e| format!("page size {ps}, full {full}, window {window}: {e}"))
    }
}

/// Drive `ops` on a fresh `SwaAllocator::new(full_size, window_size, page_size)`
/// against [`SwaModel`], comparing after every step (see the [module docs](self)).
///
/// # Errors
///
/// The allocator's constructor error, or the first disagreement with the model, as a
/// message naming the step and the op.
///
/// # Examples
///
/// ```
/// use kvpool::models::swa_alloc::{run_swa, SwaFreeOp, SwaOp};
/// use kvpool::models::Misalign;
/// let ops = [
///     SwaOp::Alloc { pages: 3, misalign: Misalign(0) },  // 16 full pages, 5 window pages
///     SwaOp::Alloc { pages: 3, misalign: Misalign(0) },  // 2 window pages left: refused
///     SwaOp::FreeSwa(SwaFreeOp::Part { handle: 0, take: 3 }), // the first 4 tokens' page
///     SwaOp::FreeLive { handle: 0 },
/// ];
/// let stats = run_swa(&ops, 64, 20, 4)?;
/// assert_eq!(stats.get("free_swa: ok"), 1);
/// assert_eq!(stats.get("alloc: out of window memory"), 1);
/// # Ok::<(), String>(())
/// ```
pub fn run_swa(ops: &[SwaOp], full_size: usize, window_size: usize, page_size: u32) -> Result<Stats, String> {
    let alloc = SwaAllocator::new(full_size, window_size, page_size).map_err(|e| e.to_string())?;
    let model = SwaModel::new(full_size, window_size, page_size);
    check_state(&alloc, None, &model).map_err(|e| format!("a fresh allocator: {e}"))?;
    drive(alloc, model, ops)
}

fn drive(mut alloc: SwaAllocator, mut model: SwaModel, ops: &[SwaOp]) -> Result<Stats, String> {
    let mut runner = Runner::default();
    let mut i = 0;
    loop {
        {
            // A group borrows the allocator; `clear` needs it exclusively: the ops run in
            // segments separated by clears, each with its own (optional) group.
            let a = &alloc;
            let mut group: Option<KvFreeGroup<'_>> = None;
            while i < ops.len() && ops[i] != SwaOp::Control(Control::Clear) {
                step(a, &mut group, &mut model, &mut runner, &ops[i])
                    .and_then(|()| check_state(a, group.as_ref(), &model))
                    .map_err(|e| format!("step {i} ({:?}): {e}", ops[i]))?;
                i += 1;
            }
            if let Some(g) = group.take() {
                end_group(g, &mut model, &mut runner.stats)
                    .map_err(|e| format!("ending the group before step {i}: {e}"))?;
            }
            check_state(a, None, &model).map_err(|e| format!("end of the segment before step {i}: {e}"))?;
        }
        if i == ops.len() {
            break;
        }
        alloc.clear();
        model.clear();
        for h in core::mem::take(&mut runner.live) {
            runner.retire(h);
        }
        runner.stats.record("clear", "ok");
        check_state(&alloc, None, &model).map_err(|e| format!("step {i} (clear): {e}"))?;
        i += 1;
    }
    Ok(runner.stats)
}

fn end_group(group: KvFreeGroup<'_>, model: &mut SwaModel, stats: &mut Stats) -> Result<(), String> {
    let got = group.end();
    let want = model.end_group();
    stats.record("group end", if want > 0 { "published" } else { "empty" });
    if got != want {
        return Err(format!("group end published {got}, expected {want}"));
    }
    Ok(())
}

/// The outcome name of an allocation, telling the two pools' refusals apart.
fn swa_alloc_outcome(r: &Result<Allocated, AllocError>) -> &'static str {
    match r {
        Err(AllocError::OutOfMemory(OutOfMemory { unit: Unit::WindowTokens, .. })) => "out of window memory",
        r => alloc_outcome(r),
    }
}

fn step<'s>(
    a: &'s SwaAllocator,
    group: &mut Option<KvFreeGroup<'s>>,
    model: &mut SwaModel,
    runner: &mut Runner,
    op: &SwaOp,
) -> Result<(), String> {
    let ps = model.page_size();
    let num_pages = model.full().num_pages();
    // Free through the open group if there is one; `Ok(true)` when the batch was
    // refused (nothing freed).
    let mut free = |slots: &[u32], model: &mut SwaModel, runner: &mut Runner| -> Result<bool, String> {
        let got = match group.as_mut() {
            Some(g) => g.free(slots),
            None => a.free(slots),
        };
        let want = model.free(slots);
        runner.stats.record(
            if group.is_some() { "group free" } else { "free" },
            free_batch_outcome(slots, &want, model.full()),
        );
        let refused = matches!(want, Err(ExpectedFreeError { rest_freed: false, .. }));
        match (&got, &want) {
            (Ok(()), Ok(())) => Ok(refused),
            (Err(g), Err(w)) if w.matches(g) => Ok(refused),
            _ => Err(format!("free of {slots:?}: got {got:?}, expected {want:?}")),
        }
    };
    match op {
        SwaOp::Alloc { pages, misalign } => {
            let n = (*pages as usize % (num_pages as usize + 2)) * ps as usize + misalign.0 as usize % ps as usize;
            let mut out = vec![SENTINEL; n];
            let got = a.alloc(&mut out);
            let want = model.alloc(n);
            compare_alloc(runner, "alloc", got, want, &out, ps)?;
        }
        SwaOp::AllocExtend { reqs, fault } => {
            let reqs = &reqs.0[..reqs.0.len().min(MAX_BATCH)];
            let mut prefix = Vec::with_capacity(reqs.len());
            let mut seq = Vec::with_capacity(reqs.len());
            let mut last = Vec::with_capacity(reqs.len());
            for r in reqs {
                let p = r.prefix as u32 % (3 * ps + 1);
                prefix.push(p);
                seq.push(p + r.extend as u32 % (4 * ps + 1));
                last.push(last_loc(r.last_loc, p, runner, model.full(), &last));
            }
            let mut out_len: usize = prefix.iter().zip(&seq).map(|(p, s)| (s - p) as usize).sum();
            match *fault {
                ShapeFault::None => {}
                ShapeFault::ShortPrefixLens => {
                    prefix.pop();
                }
                ShapeFault::ShortLastLocs => {
                    last.pop();
                }
                ShapeFault::OutTooLong => out_len += 1,
                ShapeFault::OutTooShort => out_len = out_len.saturating_sub(1),
                ShapeFault::BadRequest(k) => {
                    if !seq.is_empty() {
                        let k = k as usize % seq.len();
                        prefix[k] = seq[k] + 1;
                    }
                }
            }
            let mut out = vec![SENTINEL; out_len];
            let got = match (&prefix[..], &seq[..], &last[..]) {
                // One request: through the call that also reports where the runs break,
                // which must be exactly where the slots it wrote stop being consecutive.
                ([p], [s], [l]) => {
                    let mut reported = Vec::new();
                    let got = a.alloc_extend_runs(*p, *s, *l, &mut out, &mut |at| reported.push(at)).map(drop);
                    if got.is_ok() {
                        let breaks: Vec<usize> =
                            (1..out.len()).filter(|&i| out[i] != out[i - 1].wrapping_add(1)).collect();
                        if reported != breaks {
                            return Err(format!(
                                "alloc_extend_runs({p}, {s}, {l}) reported {reported:?}, wrote {out:?}"
                            ));
                        }
                    }
                    got
                }
                _ => a.alloc_extend(&prefix, &seq, &last, &mut out),
            };
            let want = model.alloc_extend(&prefix, &seq, &last, out_len);
            compare_alloc(runner, "alloc_extend", got, want, &out, ps)?;
        }
        SwaOp::AllocDecode { reqs, fault } => {
            let reqs = &reqs.0[..reqs.0.len().min(MAX_BATCH)];
            let mut seq = Vec::with_capacity(reqs.len());
            let mut last = Vec::with_capacity(reqs.len());
            for r in reqs {
                let sl = 1 + r.seq as u32 % (3 * ps);
                seq.push(sl);
                last.push(last_loc(r.last_loc, sl - 1, runner, model.full(), &last));
            }
            let mut out_len = seq.len();
            match *fault {
                ShapeFault::None | ShapeFault::ShortPrefixLens => {}
                ShapeFault::ShortLastLocs => {
                    last.pop();
                }
                ShapeFault::OutTooLong => out_len += 1,
                ShapeFault::OutTooShort => out_len = out_len.saturating_sub(1),
                ShapeFault::BadRequest(k) => {
                    if !seq.is_empty() {
                        let k = k as usize % seq.len();
                        seq[k] = 0;
                    }
                }
            }
            let mut out = vec![SENTINEL; out_len];
            let got = a.alloc_decode(&seq, &last, &mut out);
            let want = model.alloc_decode(&seq, &last, out_len);
            compare_alloc(runner, "alloc_decode", got, want, &out, ps)?;
        }
        SwaOp::FreeLive { handle } => {
            let h = match runner.pick(*handle) {
                Some(k) => runner.live.swap_remove(k),
                None => Vec::new(),
            };
            free(&h, model, runner)?;
            runner.retire(h);
        }
        SwaOp::Free(op) => free_op(op, ps, num_pages, runner, model, |m, slot| m.full().is_allocated(slot), &mut free)?,
        SwaOp::FreeSwa(f) => {
            let slots: Vec<u32> = match f {
                SwaFreeOp::Part { handle, take } | SwaFreeOp::Tail { handle, take } => match runner.pick(*handle) {
                    Some(k) => {
                        let h = &runner.live[k];
                        let t = 1 + *take as usize % h.len();
                        if matches!(f, SwaFreeOp::Part { .. }) {
                            h[..t].to_vec()
                        } else {
                            h[h.len() - t..].to_vec()
                        }
                    }
                    None => Vec::new(),
                },
                SwaFreeOp::WithForged { handle, forged, at } => {
                    let mut batch = runner.pick(*handle).map_or_else(Vec::new, |k| runner.live[k].clone());
                    let at = *at as usize % (batch.len() + 1);
                    batch.insert(at, forged.resolve(ps, num_pages));
                    batch
                }
                SwaFreeOp::Stale { which } => {
                    if runner.stale.is_empty() {
                        Vec::new()
                    } else {
                        runner.stale[*which as usize % runner.stale.len()].clone()
                    }
                }
                SwaFreeOp::Forged { slots } => {
                    slots.iter().take(MAX_FORGED).map(|r| r.resolve(ps, num_pages)).collect()
                }
            };
            let got = a.free_swa(&slots);
            let want = model.free_swa(&slots);
            runner.stats.record(
                "free_swa",
                match &want {
                    Ok(0) => "ok, nothing mapped",
                    Ok(_) => "ok",
                    Err(e) => free_outcome(&Err(e.clone())),
                },
            );
            match (&got, &want) {
                (Ok(g), Ok(w)) if g == w => {}
                (Err(g), Err(w)) if w.matches(g) => {}
                _ => return Err(format!("free_swa of {slots:?}: got {got:?}, expected {want:?}")),
            }
        }
        SwaOp::FreePages(f) => {
            let (first, count) = match f {
                FreePagesOp::Live { handle, more } => match runner.pick(*handle) {
                    Some(k) => {
                        let h = &runner.live[k];
                        let first = h[0] / ps;
                        // The handle's leading run of consecutive pages.
                        let mut count = 1;
                        for &s in h {
                            let p = s / ps;
                            if p == first + count {
                                count += 1;
                            } else if p != first + count - 1 {
                                break;
                            }
                        }
                        (first, count + *more as u32 % 2)
                    }
                    None => (1, 0),
                },
                FreePagesOp::Forged { first, count } => (*first as u32 % (num_pages + 2), *count as u32 % 6),
            };
            let own_group = group.is_none();
            if own_group {
                model.begin_group();
            }
            let g = group.get_or_insert_with(|| a.free_group());
            let got = g.free_pages(first, count);
            let want = model.free_pages(first, count);
            runner.stats.record(if own_group { "free_pages" } else { "group free_pages" }, free_outcome(&want));
            let ok = match (&got, &want) {
                (Ok(()), Ok(())) => true,
                (Err(g), Err(w)) if w.matches(g) => true,
                _ => false,
            };
            if own_group {
                if let Some(g) = group.take() {
                    end_group(g, model, &mut runner.stats)?;
                }
            }
            if !ok {
                return Err(format!("free_pages({first}, {count}): got {got:?}, expected {want:?}"));
            }
            prune_live(runner, model);
        }
        SwaOp::Translate(t) => {
            let mut slots = runner.pick(t.handle).map_or_else(Vec::new, |k| runner.live[k].clone());
            slots.extend(t.forged.iter().take(MAX_FORGED).map(|r| r.resolve(ps, num_pages)));
            let want = model.translate(&slots);
            let short = t.short_out % 8 == 7 && !slots.is_empty();
            let mut out = vec![SENTINEL; slots.len() - short as usize];
            let got = a.translate(&slots, &mut out);
            if short {
                runner.stats.record("translate", "length mismatch");
                let expected = InvalidInput::LengthMismatch { what: "out", got: out.len(), expected: slots.len() };
                if got != Err(expected) || out.iter().any(|&s| s != SENTINEL) {
                    return Err(format!("translate with a short output: got {got:?}, wrote {out:?}"));
                }
            } else {
                let mapped = want.iter().filter(|&&w| w != 0).count();
                runner.stats.record("translate", if mapped == 0 { "ok, none mapped" } else { "ok" });
                if got.is_err() || out != want {
                    return Err(format!("translate of {slots:?}: got {got:?} {out:?}, expected {want:?}"));
                }
                for (&s, &w) in slots.iter().zip(&want) {
                    if a.window_slot(s) != (w != 0).then_some(w) {
                        return Err(format!("window_slot({s}) is {:?}, expected {w}", a.window_slot(s)));
                    }
                }
            }
        }
        SwaOp::Control(Control::GroupBegin) => {
            if group.is_none() {
                *group = Some(a.free_group());
                model.begin_group();
            }
        }
        SwaOp::Control(Control::GroupEnd) => {
            if let Some(g) = group.take() {
                end_group(g, model, &mut runner.stats)?;
            }
        }
        SwaOp::Control(Control::Clear) => unreachable!("clears are handled by drive()"),
    }
    Ok(())
}

/// Drop slots whose page is no longer allocated from the live handles (after a range
/// free took pages of a handle, or past it).
fn prune_live(runner: &mut Runner, model: &SwaModel) {
    for h in &mut runner.live {
        h.retain(|&slot| model.full().is_allocated(slot));
    }
    runner.live.retain(|h| !h.is_empty());
}

/// [`Runner::compare_alloc`] with the window pool's refusal named apart.
fn compare_alloc(
    runner: &mut Runner,
    op: &str,
    got: Result<(), AllocError>,
    want: Result<Allocated, AllocError>,
    out: &[u32],
    page_size: u32,
) -> Result<(), String> {
    if let Err(AllocError::OutOfMemory(OutOfMemory { unit: Unit::WindowTokens, .. })) = &want {
        runner.stats.record(op, swa_alloc_outcome(&want));
        if got != want.as_ref().map(drop).map_err(Clone::clone) {
            return Err(format!("got {got:?}, expected {want:?}"));
        }
        if let Some(k) = out.iter().position(|&s| s != SENTINEL) {
            return Err(format!("refused for the window pool but wrote the output at {k}: {out:?}"));
        }
        return Ok(());
    }
    runner.compare_alloc(op, got, want, out, page_size)
}

/// Compare the allocator with the model: invariants (both the allocator's and the
/// model's), the three available counts, the group's pending count, every full page's
/// allocation, the whole mapping table, and slots outside the pool.
fn check_state(a: &SwaAllocator, group: Option<&KvFreeGroup<'_>>, model: &SwaModel) -> Result<(), String> {
    model.check()?;
    a.check_invariants().map_err(|e| e.to_string())?;
    let counts = (a.available_size(), a.full_available_size(), a.window_available_size());
    let want = (model.available(), model.full().available(), model.window_available());
    if counts != want {
        return Err(format!("available (min, full, window) {counts:?} but the model has {want:?}"));
    }
    let pending = group.map_or(0, KvFreeGroup::pending_tokens);
    if pending != model.full().pending() {
        return Err(format!("group pending {pending} but the model has {}", model.full().pending()));
    }
    let ps = model.page_size();
    for page in 1..=model.full().num_pages() {
        let want = model.full().is_page_allocated(page);
        for slot in [page * ps, page * ps + ps - 1] {
            if a.is_allocated(slot) != want {
                return Err(format!("is_allocated({slot}) is {} but page {page} is allocated: {want}", !want));
            }
        }
    }
    let want = model.mapping();
    let w = a.window();
    if w.mapping_len() != want.len() {
        return Err(format!("mapping of {} entries, expected {}", w.mapping_len(), want.len()));
    }
    let mut got = vec![SENTINEL; want.len()];
    w.copy_mapping(0, &mut got).map_err(|e| e.to_string())?;
    if let Some(k) = (0..want.len()).find(|&k| got[k] != want[k]) {
        return Err(format!("mapping entry {k} is {}, expected {} (page {})", got[k], want[k], k as u32 / ps));
    }
    for page in 0..=model.full().num_pages() {
        if w.is_mapped(page) != (model.window_page(page) != 0) {
            return Err(format!("is_mapped({page}) is {}", w.is_mapped(page)));
        }
    }
    for slot in [0, ps - 1, model.full().last_slot().saturating_add(1), u32::MAX] {
        if a.is_allocated(slot) {
            return Err(format!("is_allocated({slot}) is true for a slot outside the pool"));
        }
        if slot >= ps && a.window_slot(slot).is_some() {
            return Err(format!("window_slot({slot}) is {:?} for a slot outside the pool", a.window_slot(slot)));
        }
    }
    Ok(())
}

/// A [`PagedAllocator`](crate::PagedAllocator) built as [`SwaAllocator`]'s window pool
/// is: one that never parks blocks (at page size 1 a plain `PagedAllocator` parks free
/// 512-slot blocks, which changes where its claims land). For tests that replay the
/// window pool's claims on a twin.
///
/// # Errors
///
/// As [`PagedAllocator::new`](crate::PagedAllocator::new).
pub fn window_twin(size: usize, page_size: u32) -> Result<crate::PagedAllocator, crate::ConfigError> {
    crate::PagedAllocator::without_parking(size, page_size)
}
