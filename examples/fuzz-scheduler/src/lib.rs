//! A user's wrapper of a kvpool allocator, and what its fuzz target checks.
//!
//! [`PageLedger`] remembers, for every page, which allocation call took it, so that a
//! scheduler can say at shutdown (or in a leak report) "page 17 is still held, taken by
//! allocation 4211" — the batch that leaked it. It implements [`KvAllocator`] by
//! delegating to the allocator inside, so it can stand wherever kvpool's allocators do
//! (under a `RadixCache`, in a scheduler).
//!
//! The subtle part is telling the *fresh* pages of an `alloc_extend` / `alloc_decode`
//! apart from the partial page the request already held: the output starts by filling
//! that old page (DESIGN.md's "part 1", slots `last_loc + 1 ..`), and those slots must
//! not retag it. A fresh page is entered at its first slot, an old one never is (its
//! slot 0 holds an earlier token), so the ledger tags the pages of the output slots that
//! sit at offset 0 of their page. `fuzz_targets/ledger_ops.rs` checks exactly that
//! against kvpool's sequential model: tagging the page of *every* output slot instead
//! fails within seconds.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};

use kvpool::{AllocError, FreeError, InvariantViolation, KvAllocator, KvFreeGroup};

/// A [`KvAllocator`] that records which allocation call took each page.
#[derive(Debug)]
pub struct PageLedger<A> {
    inner: A,
    /// Per page (index = page number): the allocation call that last took it, 0 for
    /// never. Meaningful only while the page is allocated.
    taken_by: Box<[AtomicU64]>,
    /// Successful allocation calls that handed out slots, so far.
    calls: AtomicU64,
}

impl<A: KvAllocator> PageLedger<A> {
    /// Wrap `inner`, which must be fresh (nothing allocated).
    pub fn new(inner: A) -> Self {
        let pages = inner.size() / inner.page_size() as usize + 1; // page 0 is reserved
        PageLedger { inner, taken_by: (0..pages).map(|_| AtomicU64::new(0)).collect(), calls: AtomicU64::new(0) }
    }

    /// Which allocation call (1, 2, ...) took `slot`'s page, or `None` when that page is
    /// not allocated.
    pub fn taken_by(&self, slot: u32) -> Option<u64> {
        if !self.inner.is_allocated(slot) {
            return None;
        }
        let page = (slot / self.inner.page_size()) as usize;
        // Relaxed: the tag was stored by the thread that allocated the page, before it
        // handed the page on; whoever can name the page got it from there.
        self.taken_by.get(page).map(|t| t.load(Ordering::Relaxed))
    }

    /// Successful allocation calls that handed out slots, so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Every page still allocated, with the call that took it (a leak report).
    pub fn held(&self) -> Vec<(u32, u64)> {
        let ps = self.inner.page_size();
        (1..self.taken_by.len() as u32).filter_map(|p| self.taken_by(p * ps).map(|call| (p, call))).collect()
    }

    /// The allocator inside.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// Tag the fresh pages of a successful allocation's output with a new call number.
    fn record(&self, out: &[u32]) {
        if out.is_empty() {
            return;
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let ps = self.inner.page_size();
        for &slot in out.iter().filter(|&&s| s % ps == 0) {
            self.taken_by[(slot / ps) as usize].store(call, Ordering::Relaxed);
        }
    }
}

impl<A: KvAllocator> KvAllocator for PageLedger<A> {
    fn page_size(&self) -> u32 {
        self.inner.page_size()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn available_size(&self) -> usize {
        self.inner.available_size()
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        self.inner.alloc(out)?;
        self.record(out);
        Ok(())
    }
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        self.inner.alloc_extend(prefix_lens, seq_lens, last_locs, out)?;
        self.record(out);
        Ok(())
    }
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.inner.alloc_decode(seq_lens, last_locs, out)?;
        self.record(out);
        Ok(())
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        // A freed page's tag goes stale; `taken_by` ignores it until the page is taken again.
        self.inner.free(slots)
    }
    fn free_group(&self) -> KvFreeGroup<'_> {
        self.inner.free_group()
    }
    fn is_allocated(&self, slot: u32) -> bool {
        self.inner.is_allocated(slot)
    }
    fn pages_allocated(&self, first_page: u32, pages: u32) -> bool {
        self.inner.pages_allocated(first_page, pages)
    }
    fn clear(&mut self) {
        self.inner.clear();
    }
    /// The inner allocator's invariants, and: every allocated page was tagged by a call.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner.check_invariants()?;
        match self.held().into_iter().find(|&(_, call)| call == 0 || call > self.calls()) {
            Some((page, call)) => Err(InvariantViolation(format!(
                "page {page} is allocated but the ledger names call {call} of {}",
                self.calls()
            ))),
            None => Ok(()),
        }
    }
}

/// What the fuzz target checks after every step, against kvpool's sequential model:
/// a page the model holds allocated is tagged, a page that stayed allocated kept its
/// tag, and a page allocated by this step carries this step's call. `tags` is the
/// ledger's answer per page after the previous step (index = page), updated here; start
/// it with `vec![None; model.num_pages() + 1]`.
///
/// # Errors
///
/// The first page on which the ledger is wrong, described.
pub fn check_ledger<A: KvAllocator>(
    ledger: &PageLedger<A>,
    model: &kvpool::models::AllocModel,
    tags: &mut [Option<u64>],
) -> Result<(), String> {
    let ps = model.page_size();
    for page in 1..=model.num_pages() {
        let now = ledger.taken_by(page * ps);
        if now.is_some() != model.is_page_allocated(page) {
            return Err(format!("ledger says page {page} is taken by {now:?}; the model disagrees"));
        }
        match (tags[page as usize], now) {
            (Some(before), Some(after)) if before != after => {
                return Err(format!("page {page} stayed allocated but its tag moved from call {before} to {after}"));
            }
            (None, Some(after)) if after != ledger.calls() => {
                return Err(format!("page {page} was just allocated, yet tagged {after}, not {}", ledger.calls()));
            }
            _ => {}
        }
        tags[page as usize] = now;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool::models::{run_allocator_observed, AllocModel, Checks, Scenario, MAX_FUZZ_OPS};
    use kvpool::PagedAllocator;

    /// A request with a 3-token prefix grows to 6 tokens on pages of 4: two slots in its
    /// old page, then one fresh page. Only the fresh page gets the new tag.
    #[test]
    fn extend_tags_only_fresh_pages() {
        let ledger = PageLedger::new(PagedAllocator::new(16, 4).unwrap());
        let mut first = [0u32; 4];
        ledger.alloc(&mut first).unwrap(); // page 1, call 1
        let mut out = [0u32; 3];
        ledger.alloc_extend(&[3], &[6], &[first[2]], &mut out).unwrap();
        assert_eq!(out, [7, 8, 9]); // slot 7 ends page 1; page 2 is fresh
        assert_eq!(ledger.taken_by(4), Some(1));
        assert_eq!(ledger.taken_by(8), Some(2));
        assert_eq!(ledger.held(), [(1, 1), (2, 2)]);
        ledger.free(&out[1..]).unwrap();
        assert_eq!(ledger.held(), [(1, 1)]);
    }

    /// The fuzz target's check, on what a few byte strings read as.
    #[test]
    fn fuzz_check_passes_on_sample_inputs() {
        for bytes in
            [&b"\x03\x20\x00 any bytes become ops: 0123456789abcdef"[..], b"\x05\x40\x01\xff\x10\x22\x33\x44\x55"]
        {
            let scenario = Scenario::from_fuzz_input(bytes, MAX_FUZZ_OPS);
            let ledger = PageLedger::new(PagedAllocator::new(scenario.pool_size(), scenario.page_size()).unwrap());
            let mut tags = vec![None; scenario.num_pages() as usize + 1];
            run_allocator_observed(ledger, &scenario.ops, Checks::EveryPage, |l, m: &AllocModel| {
                check_ledger(l, m, &mut tags)
            })
            .unwrap();
        }
    }
}
