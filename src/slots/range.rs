//! Whole ranges of consecutive indices: a membership test and a free that cost one load
//! (and one read-modify-write) per bitmap word instead of work per index. The radix
//! cache holds its pages in runs of consecutive pages and uses these for a run at a time.

use super::park::BLOCK_WORDS;
use super::{Applied, Dup, FreeGroup, SlotPool, BITS};
use crate::error::{FreeError, FreeErrorKind};
use crate::sync::atomic::Ordering;

/// The 64-bit words covering bits `start..start + len` of a bitmap, each with the mask
/// of the range's bits in it. (The slot pool's index `i` is bit `i - 1`; the radix
/// cache's page bitmap uses it too.)
pub(crate) fn bit_words(start: usize, len: usize) -> BitWords {
    BitWords { i: start, end: start + len }
}

/// What [`bit_words`] returns: the words of a bit range, in order.
#[derive(Clone, Debug)]
pub(crate) struct BitWords {
    /// The next bit to cover.
    i: usize,
    /// One past the range's last bit.
    end: usize,
}

impl BitWords {
    /// Skip ahead to word `w`: the next word yielded is `w` (if the range reaches it).
    /// One store, where `nth` would compute the masks of every word passed over (a
    /// free that parks a block passes over seven). `w` must not lie before the next
    /// word, or the range's start.
    #[inline]
    fn skip_to(&mut self, w: usize) {
        debug_assert!(w * BITS >= self.i - self.i % BITS, "skipping back to word {w}");
        self.i = self.i.max(w * BITS);
    }
}

impl Iterator for BitWords {
    type Item = (usize, u64);

    #[inline]
    fn next(&mut self) -> Option<(usize, u64)> {
        if self.i >= self.end {
            return None;
        }
        let (w, bit) = (self.i / BITS, self.i % BITS);
        let n = (BITS - bit).min(self.end - self.i);
        let mask = if n == BITS { u64::MAX } else { ((1u64 << n) - 1) << bit };
        self.i += n;
        Some((w, mask))
    }
}

/// The first and last words of bits `start..start + len` with the range's bits in
/// each: `None` for an empty range; for a range within one word both ends are that
/// word, with the same mask. The words strictly between them are wholly in the range,
/// so a caller can handle them as one tight pass (what [`bit_words`] yields, in three
/// parts).
#[inline]
pub(crate) fn bit_ends(start: usize, len: usize) -> Option<(usize, u64, usize, u64)> {
    if len == 0 {
        return None;
    }
    let end = start + len - 1;
    let (w0, w1) = (start / BITS, end / BITS);
    let (lo, hi) = (u64::MAX << (start % BITS), u64::MAX >> (BITS - 1 - end % BITS));
    Some(if w0 == w1 { (w0, lo & hi, w0, lo & hi) } else { (w0, lo, w1, hi) })
}

/// The words of indices `first..first + count` (`first >= 1`).
fn words_of(first: u32, count: u32) -> BitWords {
    bit_words(first as usize - 1, count as usize)
}

/// Whether word `w` starts a block whose words all lie inside indices
/// `first..first + count`.
#[inline]
fn starts_whole_block(w: usize, first: u32, count: u32) -> bool {
    let (start, end) = (first as usize - 1, first as usize - 1 + count as usize);
    w % BLOCK_WORDS == 0 && w * BITS >= start && (w + BLOCK_WORDS) * BITS <= end
}

impl SlotPool {
    /// Whether every index of `first..first + count` is handed out (`false` if any is
    /// out of range or free). One load per 64 indices; a snapshot under concurrency.
    pub(crate) fn all_allocated(&self, first: u32, count: u32) -> bool {
        if count == 0 {
            return true;
        }
        if first == 0 || first as u64 + count as u64 - 1 > self.capacity as u64 {
            return false;
        }
        // As `is_allocated`: the held bits with magazines, the bitmap without. The end
        // words by mask, the whole words between them in one tight pass.
        let Some((w0, lo, w1, hi)) = bit_ends(first as usize - 1, count as usize) else { return true };
        if self.not_held(w0, lo) != 0 || self.not_held(w1, hi) != 0 {
            return false;
        }
        if w1 <= w0 + 1 {
            return true;
        }
        // Relaxed, as `not_held`: a snapshot.
        if self.held.is_empty() {
            self.words[w0 + 1..w1].iter().fold(0, |a, w| a | w.load(Ordering::Relaxed)) == 0
                && !self.any_parked(w0 + 1, w1)
        } else {
            self.held[w0 + 1..w1].iter().fold(u64::MAX, |a, h| a & h.load(Ordering::Relaxed)) == u64::MAX
        }
    }

    /// Validate then set the bits of `first..first + count` (without publishing), as
    /// [`release_slice`](Self::release_slice) does for a slice: nothing changes unless
    /// every index is in range and allocated. Returns how many bits went 0 -> 1, and on
    /// error also that count.
    ///
    /// Whole blocks of the range are parked ("Parked blocks" in the module docs) and
    /// counted in `parked`, not in the result.
    pub(crate) fn release_range(
        &self,
        first: u32,
        count: u32,
        parked: &mut usize,
    ) -> Result<usize, (usize, FreeError)> {
        if count == 0 {
            return Ok(0);
        }
        let last = first as u64 + count as u64 - 1;
        if first == 0 || last > self.capacity as u64 {
            let index = if first == 0 { 0 } else { (self.capacity as u64 + 1).min(last) as u32 };
            let kind = FreeErrorKind::OutOfRange { first: 1, last: self.capacity };
            return Err((0, FreeError { index, kind, rest_freed: false }));
        }
        for (w, mask) in words_of(first, count) {
            // Not handed out: free in the bitmap, or (with magazines) in a magazine.
            let set = self.not_held(w, mask);
            if set != 0 {
                let index = (w * BITS + set.trailing_zeros() as usize + 1) as u32;
                return Err((0, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: false }));
            }
        }
        let mut acc = Applied::new();
        let mut words = words_of(first, count);
        while let Some((w, mask)) = words.next() {
            if self.parks && starts_whole_block(w, first, count) {
                if let Some(b) = self.block_of(w).filter(|&b| self.try_park(b)) {
                    self.note_parked(b, &mut acc);
                    words.skip_to(w + BLOCK_WORDS); // past the block's other words
                    continue;
                }
            }
            self.set_bits(w, mask, Dup::Strict, &mut acc);
        }
        self.settle(&mut acc);
        *parked += acc.parked;
        match acc.first_dup {
            None => Ok(acc.freed),
            Some(index) => Err((acc.freed, FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true })),
        }
    }
}

impl FreeGroup<'_> {
    /// Free the indices `first..first + count` into the group: one check and one
    /// read-modify-write per 64 indices.
    ///
    /// # Errors
    ///
    /// As [`SlotPool::free`]: an index out of range or not allocated; nothing is freed
    /// then.
    ///
    /// # Examples
    ///
    /// ```
    /// let pool = kvpool::SlotPool::new(100);
    /// let mut a = [0u32; 100];
    /// pool.alloc(&mut a)?;
    /// let mut group = pool.free_group();
    /// group.free_range(10, 80)?;
    /// assert!(group.free_range(50, 1).is_err()); // already freed
    /// assert_eq!(group.end(), 80);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free_range(&mut self, first: u32, count: u32) -> Result<(), FreeError> {
        let mut parked = 0;
        let r = self.pool.release_range(first, count, &mut parked);
        self.account_parked(parked);
        self.account(r)
    }

    /// Free many ranges `(first, count)` into the group, merging the bits of
    /// neighbouring ranges that share a bitmap word: one check and one
    /// read-modify-write per word *change* in the sequence, and one update of the
    /// group's counters for the whole call. This is for many short ranges close to
    /// each other (an evicted leaf of a fragmented pool is hundreds of one-page runs,
    /// a few per word), where [`free_range`](Self::free_range) would pay its locked
    /// instructions per range.
    ///
    /// Unlike `free_range` this is not all-or-nothing across the call: each word is
    /// checked just before it is set, so on an error the words before the offending
    /// one stay freed (the error says so with `rest_freed`) and the ones after it are
    /// not. A range that repeats an index of a range before it in the same word is a
    /// double free too. For callers that own what they free (the radix cache's
    /// eviction), where an error is a bug.
    pub(crate) fn free_ranges(&mut self, ranges: impl IntoIterator<Item = (u32, u32)>) -> Result<(), FreeError> {
        let pool = self.pool;
        let mut acc = Applied::new();
        let mut error = None;
        // The word being gathered (`usize::MAX`: none yet) and its bits.
        let (mut word, mut bits) = (usize::MAX, 0u64);
        let flush = |w: usize, m: u64, acc: &mut Applied, error: &mut Option<FreeError>| {
            let set = pool.not_held(w, m);
            if set != 0 {
                let index = (w * BITS + set.trailing_zeros() as usize + 1) as u32;
                let rest_freed = acc.freed_any();
                *error = Some(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed });
                return false;
            }
            pool.set_bits(w, m, Dup::Strict, acc);
            true
        };
        'ranges: for (first, count) in ranges {
            if count == 0 {
                continue;
            }
            if first == 0 || first as u64 + count as u64 - 1 > pool.capacity as u64 {
                let last = first as u64 + count as u64 - 1;
                let index = if first == 0 { 0 } else { (pool.capacity as u64 + 1).min(last) as u32 };
                let kind = FreeErrorKind::OutOfRange { first: 1, last: pool.capacity };
                // The words before this range stay freed.
                if word != usize::MAX {
                    flush(word, bits, &mut acc, &mut error);
                    word = usize::MAX;
                }
                let rest_freed = acc.freed_any();
                error = error.or(Some(FreeError { index, kind, rest_freed }));
                break;
            }
            let mut words = words_of(first, count);
            while let Some((w, m)) = words.next() {
                // A whole block of this range (not sharing a word with the ranges
                // before it): park it.
                if pool.parks && word != w && starts_whole_block(w, first, count) {
                    if let Some(b) = pool.block_of(w) {
                        if word != usize::MAX && !flush(word, bits, &mut acc, &mut error) {
                            word = usize::MAX;
                            break 'ranges;
                        }
                        word = usize::MAX;
                        if pool.try_park(b) {
                            pool.note_parked(b, &mut acc);
                            words.skip_to(w + BLOCK_WORDS); // past the block's other words
                            continue;
                        }
                    }
                }
                if w == word {
                    if bits & m != 0 {
                        let index = (w * BITS + (bits & m).trailing_zeros() as usize + 1) as u32;
                        let rest_freed = acc.freed_any();
                        error = Some(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed });
                        word = usize::MAX;
                        break 'ranges;
                    }
                    bits |= m;
                    continue;
                }
                if word != usize::MAX && !flush(word, bits, &mut acc, &mut error) {
                    word = usize::MAX;
                    break 'ranges;
                }
                (word, bits) = (w, m);
            }
        }
        if word != usize::MAX {
            flush(word, bits, &mut acc, &mut error);
        }
        pool.settle(&mut acc);
        if let (None, Some(index)) = (&error, acc.first_dup) {
            error = Some(FreeError { index, kind: FreeErrorKind::NotAllocated, rest_freed: true });
        }
        self.account_parked(acc.parked);
        self.account(Ok(acc.freed))?;
        error.map_or(Ok(()), Err)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Ranges agree with index-by-index answers, across word boundaries, with and
    /// without magazines (indices sitting in a magazine are not allocated).
    #[test]
    fn ranges_agree_with_indices() {
        ranges_agree(SlotPool::without_magazines(300));
        ranges_agree(SlotPool::new(300));
        ranges_agree(SlotPool::with_magazines(300, 8));
    }

    /// The end words and masks cover exactly the bits `bit_words` lists.
    #[test]
    fn ends_cover_the_same_bits_as_bit_words() {
        for start in 0..200 {
            for len in 0..200 {
                let mut want = [0u64; 7];
                for (w, m) in bit_words(start, len) {
                    want[w] |= m;
                }
                let mut got = [0u64; 7];
                if let Some((w0, m0, w1, m1)) = bit_ends(start, len) {
                    got[w0] |= m0;
                    got[w1] |= m1;
                    got[w0 + 1..w1.max(w0 + 1)].fill(u64::MAX);
                }
                assert_eq!(got, want, "bits {start}..{}", start + len);
            }
        }
    }

    /// Long ranges over whole words: all allocated, or one free index in a middle word.
    #[test]
    fn long_ranges_agree_with_indices() {
        for pool in [SlotPool::without_magazines(300), SlotPool::with_magazines(300, 8)] {
            let mut all = [0u32; 300];
            pool.alloc(&mut all).unwrap();
            for free in [None, Some(130u32), Some(64), Some(65), Some(200)] {
                if let Some(i) = free {
                    pool.free(&[i]).unwrap();
                }
                for first in (1u32..=300).step_by(7) {
                    for count in (0u32..=300 - first + 1).step_by(5) {
                        let by_index = (first..first + count).all(|i| pool.is_allocated(i));
                        assert_eq!(pool.all_allocated(first, count), by_index, "range {first} + {count}, {free:?}");
                    }
                }
                if let Some(i) = free {
                    let mut back = [0u32; 1];
                    pool.alloc(&mut back).unwrap();
                    assert_eq!(back[0], i);
                }
            }
        }
    }

    /// `free_ranges` frees exactly what `free_range` of each range frees, with the
    /// counts published at the group's end, for short ranges sharing words, ranges
    /// across words, descending ranges and empty ones.
    #[test]
    fn free_ranges_agrees_with_free_range() {
        let ranges: Vec<(u32, u32)> =
            (0..60u32).map(|k| (1 + (k * 37) % 290, 1 + k % 3)).chain([(5, 0), (140, 70), (300, 1)]).collect();
        // Keep them disjoint: drop a range overlapping one before it.
        let mut taken = [false; 302];
        let ranges: Vec<(u32, u32)> = ranges
            .into_iter()
            .filter(|&(f, n)| {
                let free = (f..f + n).all(|i| i <= 300 && !taken[i as usize]);
                if free {
                    (f..f + n).for_each(|i| taken[i as usize] = true);
                }
                free
            })
            .collect();
        assert!(ranges.len() > 30);
        for with_magazines in [false, true] {
            let make =
                || if with_magazines { SlotPool::with_magazines(300, 8) } else { SlotPool::without_magazines(300) };
            let (a, b) = (make(), make());
            let mut all = [0u32; 300];
            a.alloc(&mut all).unwrap();
            b.alloc(&mut all).unwrap();
            let mut group = a.free_group();
            for &(f, n) in &ranges {
                group.free_range(f, n).unwrap();
            }
            let freed_a = group.end();
            let mut group = b.free_group();
            group.free_ranges(ranges.iter().copied()).unwrap();
            assert_eq!(group.pending(), freed_a);
            assert_eq!(b.available(), 0, "nothing is available before the group ends");
            assert_eq!(group.end(), freed_a);
            assert_eq!(a.available(), b.available());
            for i in 1..=300 {
                assert_eq!(a.is_allocated(i), b.is_allocated(i), "index {i}");
            }
            b.check_invariants().unwrap();
        }
    }

    /// A double free inside one call (two ranges sharing an index in one word), of an
    /// index already free, or out of range, is reported; the words before it stay
    /// freed and the pool stays consistent.
    #[test]
    fn free_ranges_reports_double_and_bad_frees() {
        let pool = SlotPool::without_magazines(200);
        let mut all = [0u32; 200];
        pool.alloc(&mut all).unwrap();
        let mut group = pool.free_group();
        let e = group.free_ranges([(1, 3), (70, 2), (71, 1), (100, 1)]).unwrap_err();
        assert_eq!((e.index, e.kind, e.rest_freed), (71, FreeErrorKind::NotAllocated, true));
        assert_eq!(group.end(), 3, "indices 1..=3 were freed, 70.. not");
        assert!(pool.is_allocated(70) && pool.is_allocated(100));
        let mut group = pool.free_group();
        let e = group.free_ranges([(2, 1)]).unwrap_err();
        assert_eq!((e.index, e.rest_freed), (2, false));
        let e = group.free_ranges([(150, 2), (200, 2)]).unwrap_err();
        assert!(matches!(e.kind, FreeErrorKind::OutOfRange { .. }));
        assert_eq!((e.index, e.rest_freed), (201, true), "150 and 151 were freed");
        let e = group.free_ranges([(0, 1)]).unwrap_err();
        assert!(matches!(e.kind, FreeErrorKind::OutOfRange { .. }));
        assert_eq!(group.end(), 2);
        pool.check_invariants().unwrap();
        assert_eq!(pool.available(), 5);
    }

    fn ranges_agree(pool: SlotPool) {
        let mut all = [0u32; 300];
        pool.alloc(&mut all).unwrap();
        // Free a scattered pattern: every index divisible by 7 or in 100..=140.
        let scattered: Vec<u32> = (1..=300).filter(|i| i % 7 == 0 || (100..=140).contains(i)).collect();
        pool.free(&scattered).unwrap();
        for first in [1u32, 2, 63, 64, 65, 99, 127, 128, 141, 250] {
            for count in [0u32, 1, 5, 63, 64, 65, 130] {
                let by_index = (first..first + count).all(|i| pool.is_allocated(i));
                assert_eq!(pool.all_allocated(first, count), by_index, "range {first} + {count}");
            }
        }
        assert!(!pool.all_allocated(0, 1) && !pool.all_allocated(300, 2));

        // A range free refuses a range with a free index, naming it, and frees nothing.
        let before = pool.available();
        let mut group = pool.free_group();
        let e = group.free_range(95, 10).unwrap_err();
        assert_eq!((e.index, e.kind), (98, FreeErrorKind::NotAllocated));
        assert!(group.free_range(299, 3).is_err());
        assert!(group.free_range(0, 1).is_err());
        assert_eq!(group.end(), 0);
        assert_eq!(pool.available(), before);
        // A valid range frees exactly its indices.
        let mut group = pool.free_group();
        group.free_range(142, 5).unwrap(); // 142..=146 (147 = 7 * 21 is free already)
        assert_eq!(group.end(), 5);
        assert!((142..=146).all(|i| !pool.is_allocated(i)));
        assert!(pool.free_range_for_test(143, 1).is_err());
        pool.check_invariants().unwrap();
    }

    impl SlotPool {
        fn free_range_for_test(&self, first: u32, count: u32) -> Result<(), FreeError> {
            let mut group = self.free_group();
            group.free_range(first, count)
        }
    }
}
