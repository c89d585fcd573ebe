//! [`SlotPool`]: a lock-free, fixed-capacity arena of `u32` indices `1..=capacity`.
//!
//! Every other structure in kvpool hands out its resources through one of these:
//! KV token slots, pages, request rows, tree nodes.
//!
//! # Algorithm
//!
//! Two pieces of shared state:
//!
//! * a **bitmap** of `AtomicU64` words; bit `b` of word `w` stands for index
//!   `64*w + b + 1`, and is **1 when the index is free**. Bits past `capacity` in the
//!   last word are always 0.
//! * a **reservation counter** `available`: how many free indices may still be
//!   claimed.
//!
//! **Alloc(n)** first *reserves*: a compare-and-swap loop takes `n` off `available`,
//! or fails with [`OutOfMemory`] if fewer than `n` are there — nothing has changed
//! yet, so allocation is all-or-nothing. It then *claims* `n` bits: starting at the
//! `hint` word, for each word with free bits it picks the lowest ones it still needs
//! and clears them with one compare-and-swap; the indices of the cleared bits go to
//! the caller's buffer in ascending order.
//!
//! **Free** first *validates*: every index must be in range and its bit must be 0
//! (allocated); otherwise the batch is refused before anything changes. It then
//! *sets* the bits, one `fetch_or` per run of indices that share a word, and finally
//! *publishes*: one `fetch_add` on `available` for the whole batch. A [`FreeGroup`]
//! does the same but delays the publication until the group ends, so its frees
//! become available all at once.
//!
//! # Why it is correct
//!
//! The invariant that carries everything:
//!
//! > (number of 1 bits) >= `available` + (indices reserved but not yet claimed)
//!
//! * a free sets its bits *before* it adds to `available`: the left side grows first;
//! * a reservation moves `n` from `available` to "reserved": the right side is unchanged;
//! * a claim clears one bit and retires one reserved index: both sides drop by one.
//!
//! So a thread that holds a reservation always has, at every instant, enough 1 bits
//! in the bitmap that no other reservation is entitled to; its claim loop keeps
//! scanning (wrapping around) until it has them. No index is handed out twice, because
//! a bit goes 1 -> 0 only through a successful compare-and-swap by exactly one thread,
//! and goes back to 1 only through the free of its owner. At quiescence (no operation
//! in flight, no open free group) the two sides are equal, so `available()` is exact.
//!
//! Memory ordering: freeing sets the bit with `Release` and publishes with `Release`;
//! reserving and claiming use `Acquire`. Whatever the previous owner of an index wrote
//! before freeing it (for example a request row's contents) happens-before everything
//! the next owner does after claiming it.
//!
//! # Why it is lock-free
//!
//! Every loop is a compare-and-swap retry loop whose failure means another thread's
//! compare-and-swap on the same word succeeded — that thread made progress. A claim
//! scan that finds no bit in a full pass can only have missed them because other
//! threads claimed and freed bits meanwhile (each of which completes an operation). A
//! thread stalled anywhere holds nothing the others wait for: a stalled reserver only
//! keeps its `n` indices out of `available`; a stalled freer only keeps its bits
//! uncounted (set but not yet published), which lowers `available` but blocks nobody.
//!
//! # ABA
//!
//! A word-level compare-and-swap cannot suffer ABA: the value *is* the state. If a word
//! reads `0b1010`, then another thread claims bit 1 and a third frees it again, the
//! word is `0b1010` once more and our compare-and-swap to `0b1000` succeeds — which is
//! right, because bit 1 is free *now*; we do not act on a pointer or a successor read
//! from the old state (the classic Treiber-stack ABA). The table:
//!
//! | step | thread A (alloc 1)          | thread B            | word     |
//! |------|-----------------------------|---------------------|----------|
//! | 1    | load `0b10`                 |                     | `0b10`   |
//! | 2    |                             | alloc: CAS -> `0b00`| `0b00`   |
//! | 3    |                             | free: OR `0b10`     | `0b10`   |
//! | 4    | CAS `0b10 -> 0b00` succeeds |                     | `0b00`   |
//!
//! After step 4 A owns index 2, B owns nothing: one owner. The only ABA left is at the
//! API level: a caller that frees an index *after* it was freed and handed to someone
//! else cannot be told apart from the new owner freeing it. Bare `u32` indices carry
//! no generation; callers that need that detection keep generations beside the index
//! (the radix cache does for its nodes).
//!
//! # Order
//!
//! `hint` is a word index below which, in single-threaded use, all words are 0.
//! Frees lower it (`fetch_min`), claims raise it past the words they emptied. So a
//! single thread always gets the lowest free indices, ascending, like SGLang's sorted
//! free list. Under concurrency the hint may be stale; the wrap-around scan keeps it
//! only a hint.

use crate::error::{FreeError, FreeErrorKind, InvariantViolation, OutOfMemory, Unit};
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{spin_loop, Backoff};
use crossbeam_utils::CachePadded;

const BITS: usize = 64;

/// A lock-free, fixed-capacity arena of `u32` indices `1..=capacity` (0 is reserved).
///
/// All operations take `&self`, never block, and never allocate after construction.
/// See the [module docs](self) for the algorithm and its correctness argument.
///
/// # Examples
///
/// ```
/// use kvpool::SlotPool;
///
/// let pool = SlotPool::new(8);
/// let mut got = [0u32; 3];
/// pool.alloc(&mut got)?;
/// assert_eq!(got, [1, 2, 3]);           // a fresh pool hands out the lowest first
/// assert_eq!(pool.available(), 5);
///
/// pool.free(&got[..2])?;
/// assert!(pool.free(&[1]).is_err());    // double free is detected
/// assert_eq!(pool.available(), 7);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SlotPool {
    words: Box<[AtomicU64]>,
    available: CachePadded<AtomicUsize>,
    hint: CachePadded<AtomicUsize>,
    /// Bits set by open free groups but not yet added to `available`.
    unpublished: AtomicUsize,
    capacity: u32,
}

/// How `release` treats an index whose bit it finds already set while applying.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dup {
    /// A double free: report it.
    Strict,
    /// Expected: the same index appears more than once in the batch (pages of token
    /// slots). Validation already showed every index was allocated at the start.
    Merge,
}

impl SlotPool {
    /// A pool of indices `1..=capacity`, all free.
    ///
    /// Allocates `capacity / 64` words once; nothing after this allocates.
    pub fn new(capacity: u32) -> Self {
        let nwords = (capacity as usize).div_ceil(BITS);
        let words: Box<[AtomicU64]> = (0..nwords).map(|_| AtomicU64::new(0)).collect();
        let pool = SlotPool {
            words,
            available: CachePadded::new(AtomicUsize::new(0)),
            hint: CachePadded::new(AtomicUsize::new(0)),
            unpublished: AtomicUsize::new(0),
            capacity,
        };
        pool.fill();
        pool
    }

    /// Set every bit of `1..=capacity` and make them all available.
    fn fill(&self) {
        let cap = self.capacity as usize;
        for (w, word) in self.words.iter().enumerate() {
            let lo = w * BITS;
            let n = (cap - lo).min(BITS);
            let bits = if n == BITS { u64::MAX } else { (1u64 << n) - 1 };
            word.store(bits, Ordering::Relaxed);
        }
        self.available.store(cap, Ordering::Release);
        self.hint.store(0, Ordering::Relaxed);
        self.unpublished.store(0, Ordering::Relaxed);
    }

    /// The number of indices, `capacity`; valid indices are `1..=capacity`.
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// How many indices can be allocated now. Exact when no operation is in flight and
    /// no free group is open; under concurrency a snapshot.
    #[inline]
    pub fn available(&self) -> usize {
        self.available.load(Ordering::Acquire)
    }

    /// Whether `index` is currently handed out (`false` for out-of-range indices and
    /// for indices freed inside a still-open free group). A snapshot under concurrency.
    pub fn is_allocated(&self, index: u32) -> bool {
        if index == 0 || index > self.capacity {
            return false;
        }
        let (w, bit) = Self::locate(index);
        self.words[w].load(Ordering::Acquire) & bit == 0
    }

    #[inline]
    fn locate(index: u32) -> (usize, u64) {
        let i = index as usize - 1;
        (i / BITS, 1u64 << (i % BITS))
    }

    /// Allocate `out.len()` indices into `out`, all or nothing.
    ///
    /// Single-threaded, the indices are the lowest free ones, ascending.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] when fewer than `out.len()` are available; `out` is untouched
    /// and nothing changed.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let mut a = [0u32; 4];
    /// pool.alloc(&mut a)?;
    /// let err = pool.alloc(&mut [0u32; 1]).unwrap_err();
    /// assert_eq!((err.requested, err.available), (1, 0));
    /// # Ok::<(), kvpool::OutOfMemory>(())
    /// ```
    pub fn alloc(&self, out: &mut [u32]) -> Result<(), OutOfMemory> {
        self.alloc_as(out, Unit::Indices)
    }

    pub(crate) fn alloc_as(&self, out: &mut [u32], unit: Unit) -> Result<(), OutOfMemory> {
        if out.is_empty() {
            return Ok(());
        }
        self.reserve(out.len(), unit)?;
        self.claim(out);
        crate::debug_check(self);
        Ok(())
    }

    /// Allocate one index.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] when none is available.
    pub fn alloc_one(&self) -> Result<u32, OutOfMemory> {
        let mut one = [0u32; 1];
        self.alloc(&mut one)?;
        Ok(one[0])
    }

    /// Take `n` off `available`, or fail without changing anything.
    pub(crate) fn reserve(&self, n: usize, unit: Unit) -> Result<(), OutOfMemory> {
        let mut backoff = Backoff::new();
        let mut cur = self.available.load(Ordering::Relaxed);
        loop {
            if cur < n {
                return Err(OutOfMemory { requested: n, available: cur, evictable: None, unit });
            }
            // Acquire: the frees that published these indices set their bits before
            // their Release increment; after this we see those bits.
            match self.available.compare_exchange_weak(cur, cur - n, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(actual) => {
                    cur = actual;
                    backoff.spin();
                }
            }
        }
    }

    /// Claim `out.len()` bits that a reservation entitles us to; writes them ascending
    /// within each word, words in scan order (ascending when single-threaded).
    pub(crate) fn claim(&self, out: &mut [u32]) {
        let nwords = self.words.len();
        let start = self.hint.load(Ordering::Relaxed).min(nwords.saturating_sub(1));
        let mut filled = 0;
        let mut w = start;
        let mut scanned = 0usize;
        let mut last_word = start;
        while filled < out.len() {
            let word = &self.words[w];
            let mut cur = word.load(Ordering::Relaxed);
            while cur != 0 {
                let need = out.len() - filled;
                let take = if (cur.count_ones() as usize) <= need { cur } else { lowest_bits(cur, need) };
                // AcqRel: Acquire pairs with the Release of the free that set these
                // bits (the previous owner's writes happen-before ours); Release keeps
                // our earlier claims ordered before anything that observes this word.
                match word.compare_exchange_weak(cur, cur & !take, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => {
                        filled += write_indices(take, w, &mut out[filled..]);
                        last_word = w;
                        break;
                    }
                    Err(actual) => cur = actual,
                }
            }
            if filled == out.len() {
                break;
            }
            w += 1;
            if w == nwords {
                w = 0;
            }
            scanned += 1;
            if scanned % nwords == 0 {
                // A full pass found too little: other threads are claiming and
                // freeing the bits we are entitled to. Let them run.
                spin_loop();
            }
        }
        // Words start..last_word were emptied (single-threaded); move the hint there,
        // unless a free lowered it meanwhile.
        if last_word != start {
            let _ = self.hint.compare_exchange(start, last_word, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Free a batch of indices.
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first index that is out of range or not allocated; see
    /// that type for what was changed (normally nothing).
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let a = [pool.alloc_one()?, pool.alloc_one()?];
    /// pool.free(&a)?;
    /// pool.free(&[])?;                       // freeing nothing is fine
    /// assert!(pool.free(&[9]).is_err());     // out of range
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free(&self, indices: &[u32]) -> Result<(), FreeError> {
        let r = self.release(indices.iter().copied(), Dup::Strict);
        let (n, err) = match r {
            Ok(n) => (n, None),
            Err((n, e)) => (n, Some(e)),
        };
        self.publish(n);
        crate::debug_check(self);
        err.map_or(Ok(()), Err)
    }

    /// Open a free group: frees through it are published (counted as available) all at
    /// once when the group ends or is dropped. SGLang's `free_group_begin/end`.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(4);
    /// let mut a = [0u32; 4];
    /// pool.alloc(&mut a)?;
    /// let mut group = pool.free_group();
    /// group.free(&a[..2])?;
    /// group.free(&a[2..])?;
    /// assert_eq!(pool.available(), 0);       // not yet
    /// assert_eq!(group.end(), 4);
    /// assert_eq!(pool.available(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free_group(&self) -> FreeGroup<'_> {
        FreeGroup { pool: self, pending: 0, unit: Dup::Strict }
    }

    /// Validate then set the bits of `indices` (without publishing). Returns how many
    /// bits went 0 -> 1, and on error also that count.
    pub(crate) fn release<I>(&self, indices: I, dup: Dup) -> Result<usize, (usize, FreeError)>
    where
        I: Iterator<Item = u32> + Clone,
    {
        // 1. Validate: nothing changes unless every index is in range and allocated.
        for index in indices.clone() {
            if index == 0 || index > self.capacity {
                let kind = FreeErrorKind::OutOfRange { first: 1, last: self.capacity };
                return Err((0, FreeError { index, kind, rest_freed: false }));
            }
            let (w, bit) = Self::locate(index);
            if self.words[w].load(Ordering::Relaxed) & bit != 0 {
                let kind = FreeErrorKind::NotAllocated;
                return Err((0, FreeError { index, kind, rest_freed: false }));
            }
        }
        // 2. Apply, one fetch_or per run of indices in the same word.
        let mut freed = 0usize;
        let mut first_dup: Option<u32> = None;
        let mut min_word = usize::MAX;
        let mut run_word = usize::MAX;
        let mut run_mask = 0u64;
        let flush = |w: usize, mask: u64, freed: &mut usize, first_dup: &mut Option<u32>| {
            if mask == 0 {
                return;
            }
            // Release: our writes to whatever the index guards happen-before the
            // next owner's claim (which loads this word with Acquire).
            let old = self.words[w].fetch_or(mask, Ordering::Release);
            *freed += (mask & !old).count_ones() as usize;
            let again = mask & old;
            if again != 0 && dup == Dup::Strict && first_dup.is_none() {
                *first_dup = Some((w * BITS + again.trailing_zeros() as usize + 1) as u32);
            }
        };
        for index in indices {
            let (w, bit) = Self::locate(index);
            if w != run_word {
                flush(run_word, run_mask, &mut freed, &mut first_dup);
                run_word = w;
                run_mask = 0;
                min_word = min_word.min(w);
            }
            if run_mask & bit != 0 && dup == Dup::Strict && first_dup.is_none() {
                first_dup = Some(index);
            }
            run_mask |= bit;
        }
        flush(run_word, run_mask, &mut freed, &mut first_dup);
        if min_word != usize::MAX {
            self.hint.fetch_min(min_word, Ordering::Relaxed);
        }
        match first_dup {
            None => Ok(freed),
            Some(index) => Err((freed, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true })),
        }
    }

    /// Make `n` freed indices available.
    #[inline]
    pub(crate) fn publish(&self, n: usize) {
        if n > 0 {
            // Release: the bits were set before; a reserver that sees this count
            // (Acquire) sees them.
            self.available.fetch_add(n, Ordering::Release);
        }
    }

    /// Free every index at once: the pool is as new. Takes `&mut self`, so no other
    /// operation can be in flight (SGLang calls this when the cache is flushed).
    pub fn clear(&mut self) {
        self.fill();
    }

    /// Check the pool's invariants in O(capacity). Exact only at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] if the set bits do not match `available` plus unpublished
    /// frees, or bits past the capacity are set. Either is a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let cap = self.capacity as usize;
        let mut ones = 0usize;
        for (w, word) in self.words.iter().enumerate() {
            let v = word.load(Ordering::Acquire);
            let lo = w * BITS;
            let n = (cap - lo).min(BITS);
            if n < BITS && v >> n != 0 {
                return Err(InvariantViolation(format!("word {w} has bits set past capacity {cap}: {v:#x}")));
            }
            ones += v.count_ones() as usize;
        }
        let avail = self.available.load(Ordering::Acquire);
        let unpub = self.unpublished.load(Ordering::Acquire);
        if ones != avail + unpub {
            return Err(InvariantViolation(format!("{ones} free bits but available {avail} + unpublished {unpub}")));
        }
        if avail > cap {
            return Err(InvariantViolation(format!("available {avail} exceeds capacity {cap}")));
        }
        Ok(())
    }
}

impl core::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotPool").field("capacity", &self.capacity).field("available", &self.available()).finish()
    }
}

/// The lowest `n` set bits of `v` (`n < v.count_ones()`).
#[inline]
fn lowest_bits(mut v: u64, n: usize) -> u64 {
    let mut m = 0u64;
    for _ in 0..n {
        let low = v & v.wrapping_neg();
        m |= low;
        v ^= low;
    }
    m
}

/// Write the indices of the bits of `mask` in word `w` to `out`, ascending; returns
/// how many.
#[inline]
fn write_indices(mask: u64, w: usize, out: &mut [u32]) -> usize {
    let base = (w * BITS + 1) as u32;
    if mask == u64::MAX {
        for (k, o) in out[..BITS].iter_mut().enumerate() {
            *o = base + k as u32;
        }
        return BITS;
    }
    let mut m = mask;
    let mut i = 0;
    while m != 0 {
        out[i] = base + m.trailing_zeros();
        m &= m - 1;
        i += 1;
    }
    i
}

/// A batch of frees published together: SGLang's `free_group_begin` ..
/// `free_group_end`. The freed indices do not count as available until the group
/// ends ([`end`](FreeGroup::end) or drop), and then all at once.
///
/// Other threads may still be handed the group's indices before it ends — they are
/// free — but the *count* of allocatable indices only grows at the end, so an
/// allocation that needs the group's frees fails until then.
#[must_use = "a free group publishes its frees when it ends; dropping it at once is a plain free"]
pub struct FreeGroup<'a> {
    pool: &'a SlotPool,
    pending: usize,
    unit: Dup,
}

impl<'a> FreeGroup<'a> {
    /// Free `indices` into the group.
    ///
    /// # Errors
    ///
    /// As [`SlotPool::free`].
    pub fn free(&mut self, indices: &[u32]) -> Result<(), FreeError> {
        self.free_iter(indices.iter().copied())
    }

    pub(crate) fn merging(pool: &'a SlotPool) -> Self {
        FreeGroup { pool, pending: 0, unit: Dup::Merge }
    }

    pub(crate) fn free_iter<I>(&mut self, indices: I) -> Result<(), FreeError>
    where
        I: Iterator<Item = u32> + Clone,
    {
        let (n, err) = match self.pool.release(indices, self.unit) {
            Ok(n) => (n, None),
            Err((n, e)) => (n, Some(e)),
        };
        if n > 0 {
            self.pool.unpublished.fetch_add(n, Ordering::Relaxed);
            self.pending += n;
        }
        err.map_or(Ok(()), Err)
    }

    /// Frees held back so far.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// End the group, publishing its frees at once; returns how many.
    pub fn end(mut self) -> usize {
        self.finish()
    }

    fn finish(&mut self) -> usize {
        let n = core::mem::take(&mut self.pending);
        if n > 0 {
            self.pool.publish(n);
            self.pool.unpublished.fetch_sub(n, Ordering::Relaxed);
        }
        crate::debug_check(self.pool);
        n
    }
}

impl Drop for FreeGroup<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl core::fmt::Debug for FreeGroup<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FreeGroup").field("pending", &self.pending).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
