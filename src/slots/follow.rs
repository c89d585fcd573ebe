//! Claims that keep runs going: one index per request, the one after the request's
//! last if it is free, else the start of a free stretch that leaves room after it
//! (the module docs of [`super`], "Runs that continue", give the rule and why).

use super::park::Reservation;
use super::{SlotPool, BITS};
use crate::sync::atomic::Ordering;
use crate::sync::untracked;

impl SlotPool {
    /// Claim what `r` reserved, one index per entry of `out` (`r.len() == out.len()`),
    /// written to that entry: index `after(i) + 1` for entry `i` if it is free, else
    /// (for the entries whose index was not free, in order) one index from each word
    /// that has free indices, going down from the follow cursor and wrapping around,
    /// each at the start of its word's longest free stretch; what that pass does not
    /// place comes from a plain claim ([`claim`](Self::claim)'s order).
    ///
    /// `after(i)` may be anything: 0, out of range or allocated just means no
    /// continuation. Single-threaded the result depends only on which indices are free
    /// and on the cursor (where the last such pass stopped), not on how the free
    /// indices are held (words or parked blocks), so the sequential models can follow
    /// it exactly.
    pub(crate) fn claim_following(&self, r: Reservation, out: &mut [u32], after: impl Fn(usize) -> u32) {
        debug_assert_eq!(r.len(), out.len());
        if out.is_empty() {
            return;
        }
        // Chosen indices come out of the words: the reservation's blocks go there first.
        let r = if self.parks { self.words_only(r) } else { r };
        let mut left = r.len();
        for (i, o) in out.iter_mut().enumerate() {
            let want = after(i).wrapping_add(1);
            *o = if self.take_index(want) {
                left -= 1;
                want
            } else {
                0 // index 0 is never handed out: "still to place"
            };
        }
        if left == 0 {
            return;
        }
        // The entries still to place (0) get the rest in order.
        let mut at = 0;
        let mut place = |index: u32| {
            while out[at] != 0 {
                at += 1;
            }
            out[at] = index;
            at += 1;
        };
        left -= self.spread_down(left, &mut place);
        if left > 0 {
            self.claim_stretches(Reservation::words(left), |first, count| {
                for k in 0..count as u32 {
                    place(first + k);
                }
            });
        }
    }

    /// Take index `i` if it is free (in the words, or in a parked block, which is
    /// moved into its words first). Whether we took it. The caller holds a count for
    /// it (a reservation of the words).
    fn take_index(&self, i: u32) -> bool {
        if i == 0 || i > self.capacity {
            return false;
        }
        let w = (i - 1) as usize / BITS;
        let mask = 1u64 << ((i - 1) as usize % BITS);
        let mut cur = self.words[w].load(Ordering::Relaxed);
        if cur == 0 && self.unpark_at(w) {
            cur = self.words[w].load(Ordering::Relaxed);
        }
        while cur & mask != 0 {
            // AcqRel as in `claim_marked`: Acquire pairs with the Release of the free
            // that set the bit.
            match self.words[w].compare_exchange(cur, cur & !mask, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    // The word may be empty now; its summary bit stays until a scan
                    // finds it so (a hint, cleared lazily as after small claims).
                    self.set_held(w, mask);
                    return true;
                }
                Err(actual) => cur = actual,
            }
        }
        false
    }

    /// If word `w` lies in a parked block, move the block into its words. Whether it
    /// did.
    fn unpark_at(&self, w: usize) -> bool {
        match self.block_of(w) {
            Some(b) if self.parked_at(w) => self.unpark_to_words(b),
            _ => false,
        }
    }

    /// Take one index from each word with free indices (parked blocks count as free
    /// words), going down from the follow cursor and wrapping around once, each at the
    /// start of the word's longest free stretch (the lowest such stretch on a tie),
    /// until `n` are placed. Returns how many it placed; the cursor is left at the word
    /// below the last one it took from.
    fn spread_down(&self, n: usize, place: &mut impl FnMut(u32)) -> usize {
        let nwords = self.words.len();
        let start = self.follow_cursor.load(untracked::Ordering::Relaxed).min(nwords - 1);
        let mut placed = 0;
        // Down from the cursor to word 0, then from the top down to the cursor's word.
        for (hi, lo) in [(start, 0), (nwords - 1, start + 1)] {
            if hi < lo || lo >= nwords {
                continue;
            }
            let mut w = hi;
            while let Some(found) = self.prev_candidate(w, lo) {
                w = found;
                if let Some(index) = self.take_longest_start(w) {
                    place(index);
                    placed += 1;
                    let below = if w == 0 { nwords - 1 } else { w - 1 };
                    self.follow_cursor.store(below, untracked::Ordering::Relaxed);
                    if placed == n {
                        return placed;
                    }
                }
                if w == lo {
                    break;
                }
                w -= 1;
            }
        }
        placed
    }

    /// The highest word in `lo..=w` that may hold free indices: marked in the summary,
    /// or in a block marked parked. Single-threaded every word with free bits and every
    /// parked block is marked, so none is passed over.
    fn prev_candidate(&self, w: usize, lo: usize) -> Option<usize> {
        let word = prev_set(&self.summary, w);
        let block = if self.parks {
            let blocks = self.park.blocks.len();
            prev_set(&self.park.summary, (w / super::park::BLOCK_WORDS).min(blocks - 1))
                .map(|b| ((b + 1) * super::park::BLOCK_WORDS - 1).min(w))
        } else {
            None
        };
        let best = match (word, block) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        best.filter(|&c| c >= lo)
    }

    /// Take the start of word `w`'s longest free stretch (a parked block's word counts
    /// as all free: the block is moved into its words first). `None` if it has none.
    fn take_longest_start(&self, w: usize) -> Option<u32> {
        let word = &self.words[w];
        let mut cur = word.load(Ordering::Relaxed);
        if cur == 0 && self.unpark_at(w) {
            cur = word.load(Ordering::Relaxed);
        }
        while cur != 0 {
            let b = longest_stretch_start(cur);
            let mask = 1u64 << b;
            // AcqRel: as in `take_index`.
            match word.compare_exchange(cur, cur & !mask, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.set_held(w, mask);
                    return Some((w * BITS) as u32 + b + 1);
                }
                Err(actual) => cur = actual,
            }
        }
        None
    }
}

/// The highest set bit at or below position `at` of the bitmap `bits` (bit `k` of
/// word `k / 64`), if any.
fn prev_set(bits: &[crate::sync::atomic::AtomicU64], at: usize) -> Option<usize> {
    let mut k = at / BITS;
    let mut v = bits[k].load(Ordering::Relaxed) & (u64::MAX >> (BITS - 1 - at % BITS));
    loop {
        if v != 0 {
            return Some(k * BITS + (BITS - 1 - v.leading_zeros() as usize));
        }
        if k == 0 {
            return None;
        }
        k -= 1;
        v = bits[k].load(Ordering::Relaxed);
    }
}

/// The lowest bit of the longest stretch of consecutive set bits of `v` (not 0); the
/// lowest such stretch on a tie.
pub(crate) fn longest_stretch_start(v: u64) -> u32 {
    debug_assert_ne!(v, 0);
    let (mut best, mut best_len) = (0, 0);
    let mut rest = v;
    while rest != 0 {
        let s = rest.trailing_zeros();
        let len = (rest >> s).trailing_ones();
        if len > best_len {
            (best, best_len) = (s, len);
        }
        if s + len >= 64 {
            break;
        }
        // Clear this stretch: the bits below `s + len`.
        rest &= u64::MAX << (s + len);
    }
    best
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::Unit;

    fn follow(pool: &SlotPool, after: &[u32]) -> Vec<u32> {
        let r = pool.reserve(after.len(), Unit::Indices).unwrap();
        let mut out = vec![0; after.len()];
        pool.claim_following(r, &mut out, |i| after[i]);
        pool.check_invariants().unwrap();
        out
    }

    #[test]
    fn runs_continue_where_free_and_new_ones_start_going_down() {
        let pool = SlotPool::for_pages(256, false);
        let mut a = [0u32; 100];
        pool.alloc(&mut a).unwrap();
        pool.free(&(50..=60).collect::<Vec<_>>()).unwrap();
        // 11 is taken: a new run, at the top word's longest stretch (193..=256);
        // 50 and 101 are free: their runs go on.
        assert_eq!(follow(&pool, &[10, 49, 100]), [193, 50, 101]);
        // The cursor moved below the top word: the next new run starts in word 2.
        assert_eq!(follow(&pool, &[193, 5]), [194, 129]);
        // One per word going down (102..=128 in word 1, 51..=60 in word 0), then
        // wrapping around to the top word, where the longest stretch starts at 195.
        assert_eq!(follow(&pool, &[0, u32::MAX, 300]), [102, 51, 195]);
        assert_eq!(pool.available(), 256 - 100 + 11 - 3 - 2 - 3);
    }

    #[test]
    fn runs_start_at_the_longest_free_stretch_of_a_word() {
        assert_eq!(longest_stretch_start(1), 0);
        assert_eq!(longest_stretch_start(u64::MAX), 0);
        assert_eq!(longest_stretch_start(1 << 63), 63);
        assert_eq!(longest_stretch_start(0b1110_0110), 5);
        assert_eq!(longest_stretch_start(0b0110_0110), 1); // a tie: the lower one
        assert_eq!(longest_stretch_start(u64::MAX << 40 | 0xff), 40);
    }

    #[test]
    fn what_one_pass_does_not_place_comes_lowest_first() {
        // One word: one new run per pass, the rest from a plain claim.
        let pool = SlotPool::for_pages(64, false);
        let mut a = [0u32; 10];
        pool.alloc(&mut a).unwrap();
        pool.free(&[3, 4, 7]).unwrap();
        // A new run at 11 (the longest stretch), then 3, 4 lowest first.
        assert_eq!(follow(&pool, &[1, 1, 1]), [11, 3, 4]);
        // All or nothing: 54 are free, 55 are refused and nothing changes.
        assert_eq!(pool.available(), 54);
        assert!(pool.reserve(55, Unit::Indices).is_err());
        assert_eq!(pool.available(), 54);
    }

    #[test]
    fn a_mixed_reservation_follows_as_the_words_would() {
        // Everything allocated, then block 3 (1537..=2048) parked and 5, 6 freed: a
        // claim of 5 reserves the two words' indices and a block for the rest.
        let (parks, plain) = (SlotPool::for_pages(2048, true), SlotPool::for_pages(2048, false));
        for pool in [&parks, &plain] {
            let mut all = vec![0; 2048];
            pool.alloc(&mut all).unwrap();
            let mut g = pool.free_group();
            g.free_range(1537, 512).unwrap();
            g.end();
            pool.free(&[5, 6]).unwrap();
        }
        assert_eq!(parks.park.parked.load(Ordering::Relaxed), 1);
        let r = parks.reserve(5, Unit::Indices).unwrap();
        assert_eq!((r.words, r.from_blocks), (2, 3));
        let mut out = [0; 5];
        let after = [4, 1536, 0, 100, 2048];
        parks.claim_following(r, &mut out, |i| after[i]);
        parks.check_invariants().unwrap();
        // 5 and 1537 go on; three new runs, one per word down from the top.
        assert_eq!(out, [5, 1537, 1985, 1921, 1857]);
        assert_eq!(follow(&plain, &after), out);
        assert_eq!((parks.available(), plain.available()), (509, 509));
        assert_eq!(parks.park.parked.load(Ordering::Relaxed), 0);
    }

    /// A pool that parks blocks and one that does not, driven alike (plain claims, range
    /// frees that park whole blocks, scattered frees, and claims that follow runs):
    /// they hand out the same indices every time, so the follow rule does not depend on
    /// how free indices are held (the sequential model relies on it). Mixed
    /// reservations (words short, blocks for the rest) and runs into parked blocks
    /// both occur.
    #[test]
    fn parked_blocks_do_not_change_what_follows() {
        const CAP: u32 = 4096;
        let parks = SlotPool::for_pages(CAP, true);
        let plain = SlotPool::for_pages(CAP, false);
        let mut held = vec![false; CAP as usize + 1];
        let mut rng = super::super::tests::Rng(0x5EED_F011);
        let (mut mixed, mut unparked) = (0, 0);
        let allocated_run = |held: &[bool], at: u32, max: u32| {
            let mut end = at;
            while end < CAP && held[end as usize + 1] && end + 1 - at < max {
                end += 1;
            }
            (at, end + 1 - at)
        };
        for step in 0..4000 {
            match rng.below(9) {
                0 | 1 | 8 => {
                    // Now and then all but a few hundred: the top blocks stay parked
                    // and the words run short.
                    let fill = plain.available().saturating_sub(rng.below(1100) as usize);
                    let n = if rng.below(3) == 0 && fill > 0 { fill } else { 1 + rng.below(700) as usize };
                    let (mut x, mut y) = (vec![0; n], vec![0; n]);
                    let (rx, ry) = (parks.alloc(&mut x), plain.alloc(&mut y));
                    assert_eq!(rx.is_ok(), ry.is_ok(), "step {step}");
                    assert_eq!(x, y, "step {step}: a plain claim");
                    if rx.is_ok() {
                        x.iter().for_each(|&i| held[i as usize] = true);
                    }
                }
                2 | 3 => {
                    // A run of allocated indices from a random one, freed as a range.
                    let at = 1 + rng.below(CAP as u64) as u32;
                    if held[at as usize] {
                        let (first, count) = allocated_run(&held, at, 1 + rng.below(1600) as u32);
                        for pool in [&parks, &plain] {
                            let mut g = pool.free_group();
                            g.free_range(first, count).unwrap();
                            g.end();
                        }
                        (first..first + count).for_each(|i| held[i as usize] = false);
                    }
                }
                4 => {
                    let some: Vec<u32> = (1..=CAP).filter(|&i| held[i as usize] && rng.below(9) == 0).collect();
                    parks.free(&some).unwrap();
                    plain.free(&some).unwrap();
                    some.iter().for_each(|&i| held[i as usize] = false);
                }
                _ => {
                    let most = if rng.below(4) == 0 { 1200 } else { 40 };
                    let n = 1 + rng.below(most) as usize;
                    // Ends of allocated runs (often followed by a free index), any
                    // index, and values that name nothing.
                    let after: Vec<u32> = (0..n)
                        .map(|_| match rng.below(4) {
                            0 => rng.below(CAP as u64 + 2) as u32,
                            1 => [0, u32::MAX, CAP][rng.below(3) as usize],
                            _ => {
                                let at = 1 + rng.below(CAP as u64) as u32;
                                let (first, count) = allocated_run(&held, at, CAP);
                                if held[at as usize] {
                                    first + count - 1
                                } else {
                                    at
                                }
                            }
                        })
                        .collect();
                    let (rx, ry) = (parks.reserve(n, Unit::Indices), plain.reserve(n, Unit::Indices));
                    assert_eq!(rx.is_ok(), ry.is_ok(), "step {step}");
                    let (Ok(rx), Ok(ry)) = (rx, ry) else { continue };
                    mixed += usize::from(rx.from_blocks > 0);
                    let before = parks.park.parked.load(Ordering::Relaxed);
                    let (mut x, mut y) = (vec![0; n], vec![0; n]);
                    parks.claim_following(rx, &mut x, |i| after[i]);
                    plain.claim_following(ry, &mut y, |i| after[i]);
                    unparked += usize::from(parks.park.parked.load(Ordering::Relaxed) < before);
                    assert_eq!(x, y, "step {step}: after {after:?}");
                    for &i in &x {
                        assert!(!held[i as usize], "step {step}: {i} handed out twice");
                        held[i as usize] = true;
                    }
                }
            }
            parks.check_invariants().unwrap();
            plain.check_invariants().unwrap();
            assert_eq!(parks.available(), plain.available(), "step {step}");
        }
        assert!(mixed > 0 && unparked > 0, "mixed reservations {mixed}, follows that unparked {unparked}");
    }
}
