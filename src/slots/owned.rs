//! Owned batches: [`Slots`], [`SlotPool::alloc_slots`] and [`SlotPool::free_slots`].
//!
//! # Why a second API
//!
//! [`SlotPool::free`] takes bare `u32`s, so it must be ready for any of them to be
//! freed twice, by two threads at once: exactly one of the two may succeed. That is
//! consensus, which costs a read-modify-write per bitmap word on every free
//! (the `held` bits of the magazines, the words themselves without them), and the
//! matching one on every allocation (module docs of `slots`, "Magazines" and "Why not
//! region leases").
//!
//! A [`Slots`] is a batch of indices that only the pool can fill and only the pool can
//! empty: its fields are private, it is not `Clone`, and it gives its indices out
//! read-only. Safe code can therefore not return an index twice through it, and the
//! type system settles the race that the bare API pays for at run time: whoever holds
//! the `Slots` (by `&mut`) is its one owner. So an owned batch skips the held bits.
//!
//! # Keeping the bare API exact beside it
//!
//! An index in a `Slots` is neither held nor free in the bitmap: to the bare API it
//! looks exactly like an index sitting in a magazine (held bit 0, bitmap bit 0). A
//! bare [`free`](SlotPool::free) of an index copied out of a `Slots` is therefore
//! refused as a double free, nothing changed, as for any index that is not handed
//! out. (Pools without magazines have no held bits, so they cannot tell; they refuse
//! owned batches with [`SlotsError::Unsupported`].) A `Slots` remembers the pool,
//! and the pool's epoch (new at every [`clear`](SlotPool::clear)), that filled it,
//! and another pool refuses it ([`SlotsError::OtherPool`]).
//!
//! # The runs magazine
//!
//! A `Slots` keeps its indices as runs of consecutive indices besides the indices
//! themselves, and each per-thread magazine has a second stack of runs `(first,
//! count)` next to its stack of indices, under the same `busy` flag:
//!
//! * **Free** of a batch of at most `RUN_ENTRIES` (64) runs and `run_cap` indices (64
//!   times a magazine's, 65,536 by default; smaller magazines have fewer): take the
//!   magazine, flush its runs to the bitmap first if the batch does not fit, push the
//!   batch's runs (a run that continues the top one extends it). No index is read or
//!   written: the cost is one compare-and-swap on `busy` and a few stores.
//! * **Alloc** of `n <= run_cap` when the runs hold `n`: pop runs from the top (the
//!   last one reached gives its upper part, the rest stays), in push order, and fill
//!   the `Slots` with them (a vectorised ascending fill per run). One compare-and-swap.
//! * Otherwise the bitmap: a reservation and a claim that leaves the held bits alone;
//!   a free sets the runs' bits word by word and publishes the count, as a flush does.
//!
//! A round of alloc and free of a batch through the magazine thus costs two
//! compare-and-swaps, a few stores and writing the batch's indices once, where a
//! `Mutex<Vec<u32>>` free list pays two lock/unlock pairs and copies the indices in and
//! out (BENCHMARKS.md, "Owned batches"). A [`SlotCache`](super::SlotCache) removes the
//! two compare-and-swaps as well, for an owner that keeps a stock of its own (module
//! [`cache`](super::cache)).
//!
//! **Counting.** Runs in a magazine are free: `available()` adds each magazine's
//! `run_total`, stored 0 by a flush before it publishes (as `len`). Indices in a
//! `Slots` are handed out; `check_invariants` accounts for them through per-magazine
//! counts kept by the holders and one counter for the bitmap path: held + free in the
//! bitmap + in magazines + in `Slots` = capacity.
//!
//! **No index handed out twice.** Runs enter a magazine only from a `Slots` (the
//! holder's `&mut`) and leave it only by a pop into a `Slots` or a flush into the
//! bitmap, both under `busy`; a `Slots` is filled only from a magazine's runs or by a
//! claim's compare-and-swap or swap on the words. So each index is in one place at a
//! time. Ordering: the previous owner's writes reach the next through `busy`
//! (Release store, Acquire compare-and-swap) or through the words, as for the bare
//! API.

use super::{Magazine, MagazineGuard, SlotPool};
use crate::error::{SlotsError, Unit};
use crate::sync::atomic::Ordering;

/// Runs a magazine's runs stack holds at most (two per entry of its index stack, for
/// small magazines).
#[cfg(not(loom))]
pub(super) const RUN_ENTRIES: usize = 64;
/// Two runs let loom see the runs stack fill up and be flushed.
#[cfg(loom)]
pub(super) const RUN_ENTRIES: usize = 2;

/// Runs a runs stack holds in a pool whose magazines hold `mag_cap` indices.
pub(super) fn run_entries(mag_cap: usize) -> usize {
    (2 * mag_cap).min(RUN_ENTRIES)
}

/// A runs magazine holds at most this many times a magazine's indices (capped by the
/// capacity): 65,536 indices with the default magazines. Runs cost no memory per index,
/// so the bound only limits how much a thread keeps out of the bitmap between flushes.
pub(super) const RUN_SCALE: usize = 64;

/// Whether a run starting at `first` continues `run` (in 64 bits: a run may end at
/// `u32::MAX`).
#[inline]
fn continues(run: (u32, u32), first: u32) -> bool {
    u64::from(run.0) + u64::from(run.1) == u64::from(first)
}

/// Where the last `n` indices of `runs` (which hold at least `n`) begin: the lowest
/// run they reach, `p`, and how many of its first indices are not among them (`keep`,
/// less than its count).
#[inline]
fn tail_start(runs: &[(u32, u32)], n: usize) -> (usize, u32) {
    let (mut p, mut sum) = (runs.len(), 0usize);
    while sum < n {
        p -= 1;
        sum += runs[p].1 as usize;
    }
    (p, (sum - n) as u32)
}

/// Where runs handed out go: a [`Slots`] (which writes the indices as well) or a
/// [`SlotCache`](super::cache::SlotCache)'s stock (runs only).
pub(super) trait RunSink {
    /// Append `first..first + count` (the caller checked the room).
    fn push_run(&mut self, first: u32, count: u32);
}

/// Push `runs` onto the stack `stack[..top]`, a run that continues the top one
/// extending it; returns the new top. The caller checked the room (`top + runs.len()`
/// entries at most).
#[inline]
pub(super) fn push_runs(stack: &mut [(u32, u32)], mut top: usize, runs: &[(u32, u32)]) -> usize {
    for &(first, count) in runs {
        match top.checked_sub(1).map(|k| &mut stack[k]) {
            Some(last) if continues(*last, first) => last.1 += count,
            _ => {
                stack[top] = (first, count);
                top += 1;
            }
        }
    }
    top
}

/// Pop the last `n` indices of the stack `stack[..top]` (which holds at least `n`)
/// into `sink`, in push order: the lowest run reached gives its upper part and keeps
/// the rest. Returns the new top.
#[inline(always)]
pub(super) fn pop_runs(stack: &mut [(u32, u32)], top: usize, n: usize, sink: &mut impl RunSink) -> usize {
    debug_assert!(n > 0, "a pop of no index");
    // The common case first: the top run holds them all (a batch freed as one run comes
    // back as it), so no walk.
    if let Some((first, count)) = top.checked_sub(1).map(|t| stack[t]) {
        if let Some(keep) = (count as usize).checked_sub(n) {
            sink.push_run(first + keep as u32, n as u32);
            if keep == 0 {
                return top - 1;
            }
            stack[top - 1].1 = keep as u32;
            return top;
        }
    }
    let (p, keep) = tail_start(&stack[..top], n);
    let (first, count) = stack[p];
    sink.push_run(first + keep, count - keep);
    for &(f, c) in &stack[p + 1..top] {
        sink.push_run(f, c);
    }
    if keep > 0 {
        stack[p].1 = keep;
        p + 1
    } else {
        p
    }
}

/// Run `f` on the last `n` indices of `runs[..*nruns]` (which holds at least `n`) as
/// runs, then drop them from the list (`*nruns` lowered, the lowest run reached cut to
/// the part that stays).
#[inline]
pub(super) fn take_tail<R>(
    runs: &mut [(u32, u32)],
    nruns: &mut usize,
    n: usize,
    f: impl FnOnce(&[(u32, u32)]) -> R,
) -> R {
    let (p, keep) = tail_start(&runs[..*nruns], n);
    let (first, count) = runs[p];
    // The tail as runs, in place: the lowest one cut to its part in the tail.
    runs[p] = (first + keep, count - keep);
    let r = f(&runs[p..*nruns]);
    if keep > 0 {
        runs[p] = (first, keep);
        *nruns = p + 1;
    } else {
        *nruns = p;
    }
    r
}

/// Runs `(first, count)` as inclusive ranges (so that a range may end at `u32::MAX`).
pub(super) fn ranges(runs: &[(u32, u32)]) -> impl ExactSizeIterator<Item = core::ops::RangeInclusive<u32>> + '_ {
    runs.iter().map(|&(first, count)| first..=first + (count - 1))
}

/// A fresh pool identity (see `SlotPool::id`). Process-wide, never reused.
pub(super) fn next_pool_id() -> u64 {
    // Not a loom atomic: an identity counter, not part of any protocol loom checks.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A batch of indices owned by the caller, filled by [`SlotPool::alloc_slots`] and
/// returned by [`SlotPool::free_slots`] (or its last indices by
/// [`SlotPool::free_slots_tail`]).
///
/// Only the pool writes a `Slots`; the caller reads its indices ([`as_slice`](Self::as_slice),
/// or through `Deref<Target = [u32]>`) and its runs of consecutive indices
/// ([`runs`](Self::runs)). It is not `Clone`, so an index cannot be returned twice
/// through it, and a bare [`SlotPool::free`] of an index copied out of it is refused
/// as a double free: misuse is ruled out by construction where the bare API detects it
/// at run time, which lets a round of alloc and free skip the per-word read-modify-writes
/// (module docs of [`slots::owned`](crate::slots::owned)).
///
/// The storage (`capacity` indices and as many run entries) is allocated once, by
/// [`with_capacity`](Self::with_capacity); filling and emptying never allocate.
/// Dropping a `Slots` that still holds indices leaks them (they stay handed out, as
/// `mem::forget` of any owner would); return them with [`SlotPool::free_slots`] first.
///
/// A `Slots` cannot be copied, so its indices cannot be returned twice:
///
/// ```compile_fail
/// let pool = kvpool::SlotPool::new(8);
/// let mut batch = kvpool::Slots::with_capacity(2);
/// pool.alloc_slots(2, &mut batch).unwrap();
/// let mut twin = batch.clone(); // no `Clone`
/// pool.free_slots(&mut batch).unwrap();
/// pool.free_slots(&mut twin).unwrap();
/// ```
///
/// # Examples
///
/// ```
/// use kvpool::{SlotPool, Slots, SlotsError};
///
/// let pool = SlotPool::new(64);
/// let mut batch = Slots::with_capacity(16);
/// pool.alloc_slots(3, &mut batch)?;
/// assert_eq!(batch.as_slice(), &[1, 2, 3]);
/// pool.alloc_slots(2, &mut batch)?;                        // appends
/// assert_eq!(batch.runs().collect::<Vec<_>>(), vec![1..=5]);
/// assert!(pool.free(&[2]).is_err());                       // the batch owns 2
/// assert!(matches!(pool.alloc_slots(12, &mut batch), Err(SlotsError::Full { .. })));
/// assert_eq!(pool.free_slots(&mut batch)?, 5);
/// assert!(batch.is_empty() && pool.available() == 64);
/// # Ok::<(), SlotsError>(())
/// ```
pub struct Slots {
    /// The indices, `idx[..len]`.
    idx: Box<[u32]>,
    len: usize,
    /// The same indices as runs `(first, count)`, `runs[..nruns]`, in order.
    runs: Box<[(u32, u32)]>,
    nruns: usize,
    /// The identity of the pool (and epoch) that filled it; 0 while empty.
    pool: u64,
}

impl Slots {
    /// An empty batch that can hold up to `capacity` indices. Allocates its storage
    /// (12 bytes per index) here, once.
    pub fn with_capacity(capacity: usize) -> Self {
        Slots {
            idx: vec![0; capacity].into_boxed_slice(),
            len: 0,
            runs: vec![(0, 0); capacity].into_boxed_slice(),
            nruns: 0,
            pool: 0,
        }
    }

    /// How many indices it can hold.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.idx.len()
    }

    /// How many indices it holds.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no index.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The indices, in the order they were handed out.
    #[inline]
    pub fn as_slice(&self) -> &[u32] {
        &self.idx[..self.len]
    }

    /// The indices as ranges of consecutive indices, in order (a range that continues
    /// the one before it is merged into it). Inclusive, so that a range may end at
    /// `u32::MAX`.
    pub fn runs(&self) -> impl ExactSizeIterator<Item = core::ops::RangeInclusive<u32>> + '_ {
        ranges(&self.runs[..self.nruns])
    }

    /// Forget the contents (they went back to the pool).
    #[inline]
    pub(super) fn reset(&mut self) {
        self.len = 0;
        self.nruns = 0;
        self.pool = 0;
    }

    /// The runs, as stored.
    #[inline]
    pub(super) fn raw_runs(&self) -> &[(u32, u32)] {
        &self.runs[..self.nruns]
    }

    /// Run `f` on the last `n` indices (at most `len`) as runs, then drop them.
    #[inline]
    pub(super) fn take_tail<R>(&mut self, n: usize, f: impl FnOnce(&[(u32, u32)]) -> R) -> R {
        let r = take_tail(&mut self.runs, &mut self.nruns, n, f);
        self.len -= n;
        if self.len == 0 {
            self.pool = 0;
        }
        r
    }

    /// The identity of the pool that filled it (0 while empty).
    #[inline]
    pub(super) fn pool_id(&self) -> u64 {
        self.pool
    }

    /// Mark it filled by the pool `id`.
    #[inline]
    pub(super) fn set_pool_id(&mut self, id: u64) {
        self.pool = id;
    }
}

impl RunSink for Slots {
    #[inline]
    fn push_run(&mut self, first: u32, count: u32) {
        let at = self.len;
        crate::iota::fill_ascending_hot(&mut self.idx[at..at + count as usize], first);
        self.len += count as usize;
        self.nruns = push_runs(&mut self.runs, self.nruns, &[(first, count)]);
    }
}

impl core::ops::Deref for Slots {
    type Target = [u32];
    #[inline]
    fn deref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl AsRef<[u32]> for Slots {
    fn as_ref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl core::fmt::Debug for Slots {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Slots")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("runs", &self.runs().collect::<Vec<_>>())
            .finish()
    }
}

impl SlotPool {
    /// Allocate `n` indices into `into`, after what it holds, all or nothing: an owned
    /// batch (module docs of [`slots::owned`](crate::slots::owned)). From the calling thread's runs magazine
    /// when it holds `n` (the most recently returned runs, in the order they were
    /// returned), else from the bitmap as [`alloc`](Self::alloc) would (lowest-first).
    ///
    /// # Errors
    ///
    /// Nothing changed on any error.
    /// * [`SlotsError::OutOfMemory`] when fewer than `n` are available;
    /// * [`SlotsError::Full`] when `into` has no room for `n` more;
    /// * [`SlotsError::OtherPool`] when `into` holds indices of another pool (or of
    ///   this one before [`clear`](Self::clear));
    /// * [`SlotsError::Unsupported`] for a pool without magazines.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::{SlotPool, Slots};
    ///
    /// let pool = SlotPool::new(1024);
    /// let mut a = Slots::with_capacity(256);
    /// pool.alloc_slots(256, &mut a)?;
    /// pool.free_slots(&mut a)?;                 // onto this thread's runs magazine
    /// pool.alloc_slots(100, &mut a)?;           // the upper part of that run
    /// assert_eq!(a.runs().collect::<Vec<_>>(), vec![157..=256]);
    /// # Ok::<(), kvpool::SlotsError>(())
    /// ```
    pub fn alloc_slots(&self, n: usize, into: &mut Slots) -> Result<(), SlotsError> {
        if self.mags.is_empty() {
            return Err(SlotsError::Unsupported);
        }
        if !into.is_empty() && into.pool != self.id {
            return Err(SlotsError::OtherPool);
        }
        if into.capacity() - into.len < n {
            return Err(SlotsError::Full { requested: n, len: into.len, capacity: into.capacity() });
        }
        if n == 0 {
            return Ok(());
        }
        self.alloc_owned(n, into)?;
        into.pool = self.id;
        crate::debug_check(self);
        Ok(())
    }

    /// Hand out `n > 0` indices as owned runs into `sink`, all or nothing: from the
    /// calling thread's runs magazine if it holds `n`, else from the bitmap.
    #[inline]
    pub(super) fn alloc_owned(&self, n: usize, sink: &mut impl RunSink) -> Result<(), crate::OutOfMemory> {
        if n > self.run_cap || !self.alloc_slots_from_magazine(n, sink) {
            let r = self.reserve(n, Unit::Indices)?;
            self.claim_stretches_marked::<false>(r, |first, count| sink.push_run(first, count as u32));
            // Relaxed: a count for `check_invariants` at quiescence only.
            self.owned_bitmap.fetch_add(n, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Pop `n` indices' worth of runs off the calling thread's runs magazine into
    /// `sink`, if it holds that many and no other thread is using it; `false` (nothing
    /// changed) otherwise.
    #[inline]
    fn alloc_slots_from_magazine(&self, n: usize, sink: &mut impl RunSink) -> bool {
        let Some(mag) = self.my_magazine() else { return false };
        // A look before the compare-and-swap: a magazine short of `n` is not worth taking
        // (a stale value only sends this allocation to the bitmap, or costs the swap).
        if mag.run_total.load(Ordering::Relaxed) < n {
            return false;
        }
        let Some(guard) = mag.try_take() else { return false };
        // Relaxed: only holders write these, and we hold the magazine.
        let total = mag.run_total.load(Ordering::Relaxed);
        if total < n {
            return false;
        }
        let top = mag.nruns.load(Ordering::Relaxed);
        let left = guard.with_runs(|runs| pop_runs(runs, top, n, sink));
        mag.nruns.store(left, Ordering::Relaxed);
        // Release for `available()`, as `len`.
        mag.run_total.store(total - n, Ordering::Release);
        mag.owned.store(mag.owned.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        true
    }

    /// Return every index of `from` to the pool and empty it; returns how many. Onto
    /// the calling thread's runs magazine when the batch fits (flushing the magazine's
    /// runs to the bitmap first if need be), else to the bitmap. Never fails for a
    /// batch this pool filled: ownership was proved by `&mut Slots`, so no index is
    /// checked.
    ///
    /// # Errors
    ///
    /// [`SlotsError::OtherPool`] when `from` holds indices of another pool (or of this
    /// one before [`clear`](Self::clear)); nothing changed.
    pub fn free_slots(&self, from: &mut Slots) -> Result<usize, SlotsError> {
        let n = from.len;
        if n == 0 {
            return Ok(0);
        }
        if from.pool != self.id {
            return Err(SlotsError::OtherPool);
        }
        self.return_runs(&from.runs[..from.nruns], n);
        from.reset();
        crate::debug_check(self);
        Ok(n)
    }

    /// Return the last `n` indices of `from` to the pool (the ones handed out last), as
    /// [`free_slots`](Self::free_slots) returns them all; the rest stay in `from`, in
    /// order. Returns `n`.
    ///
    /// # Errors
    ///
    /// Nothing changed on any error.
    /// * [`SlotsError::TooMany`] when `from` holds fewer than `n`;
    /// * [`SlotsError::OtherPool`] as for [`free_slots`](Self::free_slots).
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::{SlotPool, Slots};
    ///
    /// let pool = SlotPool::new(64);
    /// let mut batch = Slots::with_capacity(8);
    /// pool.alloc_slots(6, &mut batch)?;
    /// assert_eq!(pool.free_slots_tail(&mut batch, 4)?, 4);  // e.g. rejected draft tokens
    /// assert_eq!((batch.as_slice(), pool.available()), (&[1, 2][..], 62));
    /// assert!(pool.free_slots_tail(&mut batch, 3).is_err());
    /// # Ok::<(), kvpool::SlotsError>(())
    /// ```
    pub fn free_slots_tail(&self, from: &mut Slots, n: usize) -> Result<usize, SlotsError> {
        if n > from.len {
            return Err(SlotsError::TooMany { requested: n, len: from.len });
        }
        if n == 0 {
            return Ok(0);
        }
        if from.pool != self.id {
            return Err(SlotsError::OtherPool);
        }
        if n == from.len {
            return self.free_slots(from);
        }
        from.take_tail(n, |runs| self.return_runs(runs, n));
        crate::debug_check(self);
        Ok(n)
    }

    /// Return `runs` (`n` indices, out of a `Slots`): onto the calling thread's runs
    /// magazine if they fit, else to the bitmap.
    pub(super) fn return_runs(&self, runs: &[(u32, u32)], n: usize) {
        if n > self.run_cap || runs.len() > run_entries(self.mag_cap) || !self.free_slots_to_magazine(runs, n) {
            self.release_runs(runs);
            // Relaxed: see `alloc_slots`. Wrapping: the batch may have come from a magazine.
            self.owned_bitmap.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// Push `runs` (`n` indices) onto the calling thread's runs magazine; `false`
    /// (nothing changed) if another thread is using it.
    #[inline]
    fn free_slots_to_magazine(&self, runs: &[(u32, u32)], n: usize) -> bool {
        let Some(mag) = self.my_magazine() else { return false };
        let Some(guard) = mag.try_take() else { return false };
        let (mut top, mut total) = (mag.nruns.load(Ordering::Relaxed), mag.run_total.load(Ordering::Relaxed));
        if top + runs.len() > run_entries(self.mag_cap) || total + n > self.run_cap {
            self.flush_runs(&guard);
            (top, total) = (0, 0);
        }
        let top = guard.with_runs(|stack| push_runs(stack, top, runs));
        mag.nruns.store(top, Ordering::Relaxed);
        mag.run_total.store(total + n, Ordering::Release);
        mag.owned.store(mag.owned.load(Ordering::Relaxed).wrapping_sub(n), Ordering::Relaxed);
        true
    }

    /// Return a magazine's runs to the bitmap (as `flush` does its stack). Returns how
    /// many indices.
    pub(super) fn flush_runs(&self, guard: &MagazineGuard<'_>) -> usize {
        let mag: &Magazine = guard.mag;
        let total = mag.run_total.load(Ordering::Relaxed);
        if total == 0 {
            return 0;
        }
        let top = mag.nruns.load(Ordering::Relaxed);
        // 0 first: `available()` may count the runs late, never twice.
        mag.run_total.store(0, Ordering::Release);
        mag.nruns.store(0, Ordering::Relaxed);
        guard.with_runs(|runs| self.release_runs(&runs[..top]));
        total
    }

    /// Set the bits of `runs` in the bitmap and publish their count (the order a free
    /// uses). The indices are neither held nor free: a magazine's or a `Slots`'s.
    fn release_runs(&self, runs: &[(u32, u32)]) {
        let mut min_word = usize::MAX;
        let mut total = 0usize;
        for &(first, count) in runs {
            total += count as usize;
            for (w, mask) in super::bit_words(first as usize - 1, count as usize) {
                self.return_bits(w, mask, &mut min_word);
            }
        }
        self.lower_hint(min_word);
        self.publish(total);
    }

    /// `check_invariants` for magazine `m`'s runs (held by `guard`): every run in range
    /// and neither held nor free in the bitmap, the counts consistent. Returns the
    /// indices in the runs.
    pub(super) fn check_runs_magazine(
        &self,
        m: usize,
        guard: &MagazineGuard<'_>,
    ) -> Result<usize, crate::error::InvariantViolation> {
        use crate::error::InvariantViolation;
        let mag: &Magazine = guard.mag;
        let (top, total) = (mag.nruns.load(Ordering::Relaxed), mag.run_total.load(Ordering::Relaxed));
        let entries = run_entries(self.mag_cap);
        if top > entries || total > self.run_cap {
            return Err(InvariantViolation(format!(
                "magazine {m} holds {top} runs of {total} indices (at most {entries} runs, {})",
                self.run_cap
            )));
        }
        let mut sum = 0usize;
        let bad = guard.with_runs(|runs| {
            runs[..top].iter().copied().find(|&(first, count)| {
                sum += count as usize;
                count == 0
                    || first == 0
                    || first as u64 + count as u64 - 1 > self.capacity as u64
                    || super::bit_words(first as usize - 1, count as usize).any(|(w, mask)| {
                        (self.words[w].load(Ordering::Acquire) | self.held[w].load(Ordering::Acquire)) & mask != 0
                    })
            })
        });
        if let Some((first, count)) = bad {
            return Err(InvariantViolation(format!(
                "magazine {m} holds the run {first}+{count}: empty, out of range, held or free in the bitmap"
            )));
        }
        if sum != total {
            return Err(InvariantViolation(format!("magazine {m}'s runs hold {sum} indices, counted {total}")));
        }
        Ok(total)
    }
}
