//! Parked blocks: whole aligned blocks of [`BLOCK`] indices (a cache line of bitmap
//! words) freed and handed out with one read-modify-write each instead of one per word.
//! The module docs of [`super`] ("Parked blocks") give the protocol and why it is
//! correct; this file is its code.

use super::{Applied, Claimed, SlotPool, BITS};
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{spin_loop, untracked};
use crossbeam_utils::CachePadded;

/// Bitmap words per block: one 64-byte cache line of words.
#[cfg(not(loom))]
pub(super) const BLOCK_WORDS: usize = 8;
/// Two words keep loom's models small while a block still spans several words.
#[cfg(loom)]
pub(super) const BLOCK_WORDS: usize = 2;

/// Indices per block.
pub(crate) const BLOCK: usize = BLOCK_WORDS * BITS;

/// A block's state word: this bit while the block is parked (every index in it free,
/// its bitmap words 0), and a generation in the other bits that every word-level free
/// into the block advances.
const PARKED: u64 = 1 << 63;
const GEN: u64 = 1;

/// The state of a pool's parked blocks.
pub(super) struct Park {
    /// One state per block of [`BLOCK`] indices that can be parked: a parked bit and a
    /// generation. Empty unless the pool parks.
    pub(super) blocks: Box<[AtomicU64]>,
    /// One bit per block: set when the block may be parked. A hint for the search, as
    /// the words' summary is for the words.
    pub(super) summary: Box<[AtomicU64]>,
    /// Parked blocks not yet reserved: the blocks' part of `available`, in blocks.
    pub(super) parked: CachePadded<AtomicUsize>,
    /// Where the search for a parked block starts, a heuristic only: the lowest block
    /// a free parked since the last claim, or past the last block a claim unparked.
    hint: CachePadded<untracked::AtomicUsize>,
}

impl Park {
    pub(super) fn new(nblocks: usize) -> Self {
        Park {
            blocks: (0..nblocks).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..nblocks.div_ceil(BITS)).map(|_| AtomicU64::new(0)).collect(),
            parked: CachePadded::new(AtomicUsize::new(0)),
            hint: CachePadded::new(untracked::AtomicUsize::new(0)),
        }
    }
}

/// What one reservation entitles its claim to: `words` indices from the bitmap words,
/// and `from_blocks` indices from parked blocks, as many blocks as that covers (the
/// last one's remainder goes back to the words). Made by [`SlotPool::reserve`], spent
/// by one claim.
#[must_use = "a reservation holds indices out of `available` until it is claimed or given back"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reservation {
    pub(super) words: usize,
    pub(super) from_blocks: usize,
}

/// The block part of one claim's walk ([`SlotPool::claim_with`]).
pub(super) struct BlockWalk {
    /// The next block to look at (with the summary: the next one marked).
    next: usize,
    /// Parked blocks counted for this claim and not yet unparked.
    held: usize,
    /// The last word handed out from a block.
    pub(super) last_word: usize,
}

impl Reservation {
    /// `n` indices, all from the words.
    pub(crate) fn words(n: usize) -> Self {
        Reservation { words: n, from_blocks: 0 }
    }

    /// How many indices the claim hands out.
    pub(crate) fn len(&self) -> usize {
        self.words + self.from_blocks
    }

    /// Parked blocks the reservation holds.
    fn blocks(&self) -> usize {
        self.from_blocks.div_ceil(BLOCK)
    }
}

impl SlotPool {
    /// The block word `w` lies in, if blocks of this pool can be parked there.
    #[inline]
    pub(super) fn block_of(&self, w: usize) -> Option<usize> {
        if !self.parks {
            return None;
        }
        let b = w / BLOCK_WORDS;
        (b < self.park.blocks.len()).then_some(b)
    }

    /// Whether word `w` lies in a parked block (its indices all free). A snapshot.
    #[inline]
    pub(super) fn parked_at(&self, w: usize) -> bool {
        self.block_of(w).is_some_and(|b| self.park.blocks[b].load(Ordering::Acquire) & PARKED != 0)
    }

    /// Whether any block with a word in `w0..w1` is parked. A snapshot.
    pub(super) fn any_parked(&self, w0: usize, w1: usize) -> bool {
        if !self.parks {
            return false;
        }
        let end = (w1.div_ceil(BLOCK_WORDS)).min(self.park.blocks.len());
        (w0 / BLOCK_WORDS..end).any(|b| self.park.blocks[b].load(Ordering::Acquire) & PARKED != 0)
    }

    /// Park block `b`, whose indices the caller frees (every word of it was handed out
    /// by its claim): one compare-and-swap on the block's state. `false` when the block
    /// is not entirely handed out or a word-level free into it raced with this one
    /// (either is a double free): then nothing changed, and the caller frees the block's
    /// words one by one instead, which reports the double free exactly as without
    /// parking.
    pub(super) fn try_park(&self, b: usize) -> bool {
        let state = &self.park.blocks[b];
        // Acquire: a word-level free that advanced the generation before this load set
        // its bits before that; the loads below see them.
        let s0 = state.load(Ordering::Acquire);
        if s0 & PARKED != 0 {
            return false;
        }
        let w0 = b * BLOCK_WORDS;
        if self.words[w0..w0 + BLOCK_WORDS].iter().any(|w| w.load(Ordering::Relaxed) != 0) {
            return false;
        }
        // Release: our writes to what these indices guard happen-before the claim that
        // unparks the block (Acquire). Fails if a word-level free into the block
        // advanced the generation since `s0`: its bits may be set after our loads.
        // SeqCst: the first half of the summary's ordering (`unmark_parked`).
        if state.compare_exchange(s0, s0 | PARKED, Ordering::SeqCst, Ordering::Relaxed).is_err() {
            return false;
        }
        // The summary bit, read first (the line stays shared while it is set).
        let (sw, bit) = (&self.park.summary[b / BITS], 1u64 << (b % BITS));
        if sw.load(Ordering::SeqCst) & bit == 0 {
            sw.fetch_or(bit, Ordering::Relaxed);
        }
        true
    }

    /// Clear block `b`'s summary bit (it was found, or just made, not parked); then
    /// look at the block again and set the bit back if a park got in between. SeqCst
    /// with the park's compare-and-swap and summary load: of the two, one sees the
    /// other (as for the words' summary, `unmark`).
    fn unmark_parked(&self, b: usize) {
        let (sw, bit) = (&self.park.summary[b / BITS], 1u64 << (b % BITS));
        sw.fetch_and(!bit, Ordering::SeqCst);
        if self.park.blocks[b].load(Ordering::SeqCst) & PARKED != 0 {
            sw.fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// The first block from `from` on whose summary bit is set, or `blocks.len()`.
    fn next_marked_block(&self, from: usize) -> usize {
        let nb = self.park.blocks.len();
        if from >= nb {
            return nb;
        }
        let mut k = from / BITS;
        let mut bits = self.park.summary[k].load(Ordering::Relaxed) & (u64::MAX << (from % BITS));
        loop {
            if bits != 0 {
                return (k * BITS + bits.trailing_zeros() as usize).min(nb);
            }
            k += 1;
            if k == self.park.summary.len() {
                return nb;
            }
            bits = self.park.summary[k].load(Ordering::Relaxed);
        }
    }

    /// A free that set bits in block `acc.blk` is done with that block: advance the
    /// block's generation (so that a block free that loaded the words before our bits
    /// were set cannot park it). If the block was parked meanwhile, a block free of
    /// the same indices won the race: take our bits back out of the words and report
    /// them as freed twice (bits that a claim took in between stay counted: the
    /// block free and this one both succeeded around that claim, the case
    /// `FreeError` documents).
    #[inline]
    pub(super) fn close_block(&self, acc: &mut Applied) {
        if acc.blk == usize::MAX {
            return;
        }
        let b = core::mem::replace(&mut acc.blk, usize::MAX);
        let set = core::mem::take(&mut acc.blk_set);
        if set.iter().all(|&m| m == 0) {
            return;
        }
        // AcqRel: Release orders our bits before the new generation (a block free that
        // sees it sees them); Acquire, the block free's park before our undo.
        let old = self.park.blocks[b].fetch_add(GEN, Ordering::AcqRel);
        if old & PARKED != 0 {
            self.withdraw(b, &set, acc);
        }
    }

    /// Take back the bits this free set in block `b`, which a racing block free parked.
    #[cold]
    fn withdraw(&self, b: usize, set: &[u64; BLOCK_WORDS], acc: &mut Applied) {
        for (k, &m) in set.iter().enumerate() {
            if m == 0 {
                continue;
            }
            let w = b * BLOCK_WORDS + k;
            let removed = self.words[w].fetch_and(!m, Ordering::AcqRel) & m;
            acc.freed -= removed.count_ones() as usize;
            if removed != 0 && acc.first_dup.is_none() {
                acc.first_dup = Some((w * BITS + removed.trailing_zeros() as usize + 1) as u32);
            }
        }
    }

    /// Note in `acc` that the free parked block `b`.
    #[inline]
    pub(super) fn note_parked(&self, b: usize, acc: &mut Applied) {
        acc.parked += 1;
        acc.min_block = acc.min_block.min(b);
    }

    /// After a free that parked blocks from `min_block` up: lower the block hint.
    #[inline]
    pub(super) fn lower_block_hint(&self, min_block: usize) {
        if min_block != usize::MAX && min_block < self.park.hint.load(untracked::Ordering::Relaxed) {
            self.park.hint.store(min_block, untracked::Ordering::Relaxed);
        }
    }

    /// Make `blocks` parked blocks available (after their parking).
    #[inline]
    pub(super) fn publish_parked(&self, blocks: usize) {
        if blocks > 0 {
            // Release: the parks happened before; a reserver that sees the count
            // (Acquire) finds the blocks parked.
            self.park.parked.fetch_add(blocks, Ordering::Release);
        }
    }

    /// The reservation of last resort, after the sweep: what the words' counter holds,
    /// up to `n`, and enough parked blocks for the rest. All or nothing: on failure
    /// what was taken goes back, and the error carries the total seen. The claim takes
    /// both in address order, trading one for the other as it meets them.
    pub(super) fn reserve_mixed(&self, n: usize) -> Result<Reservation, usize> {
        let words = take_up_to(&self.central, n);
        let r = Reservation { words, from_blocks: n - words };
        match super::take(&self.park.parked, r.blocks()) {
            Ok(_) => Ok(r),
            Err(seen) => {
                if words > 0 {
                    self.central.fetch_add(words, Ordering::Release);
                }
                Err(words + seen * BLOCK)
            }
        }
    }

    /// Give back a reservation that will not be claimed.
    pub(crate) fn unreserve(&self, r: Reservation) {
        self.publish(r.words);
        self.publish_parked(r.blocks());
    }

    /// Take one parked block that a reservation entitles us to: scan from the block
    /// hint, wrapping around, guided by the summary (64 blocks per load), and clear the
    /// first parked bit we win. A guided pass that comes up short is followed by
    /// passes over every state (the summary is only a hint).
    fn unpark_one(&self) -> usize {
        let nb = self.park.blocks.len();
        let mut b = self.park.hint.load(untracked::Ordering::Relaxed).min(nb - 1);
        let mut scanned = 0;
        let mut guided = true;
        loop {
            if guided {
                let next = self.next_marked_block(b);
                scanned += next - b;
                b = next;
            }
            if b < nb {
                if self.try_unpark(b, guided) {
                    return b;
                }
                b += 1;
                scanned += 1;
            }
            if b >= nb {
                b = 0;
            }
            if scanned >= nb {
                // A whole pass found none: other threads took and parked blocks
                // meanwhile, or the summary missed one. Ours exist (the reservation
                // counted them): scan every state from now on.
                scanned = 0;
                guided = false;
                spin_loop();
            }
        }
    }

    /// Clear block `b`'s parked bit if it is set: whether we did. A block found not
    /// parked loses its summary bit if `guided` (the summary led us to it).
    #[inline]
    fn try_unpark(&self, b: usize, guided: bool) -> bool {
        let state = &self.park.blocks[b];
        if state.load(Ordering::Relaxed) & PARKED != 0 {
            // Acquire: pairs with the park's Release (the previous owner's writes
            // happen-before ours).
            if state.fetch_and(!PARKED, Ordering::AcqRel) & PARKED != 0 {
                self.unmark_parked(b);
                self.park.hint.store(b + 1, untracked::Ordering::Relaxed);
                return true;
            }
        } else if guided {
            self.unmark_parked(b);
        }
        false
    }

    /// The block part of a claim of `r` whose walk starts at word `start`.
    pub(super) fn block_walk(&self, r: Reservation, start: usize) -> BlockWalk {
        let mut bw = BlockWalk { next: 0, held: r.blocks(), last_word: 0 };
        self.restart_block_walk(&mut bw, start, true);
        bw
    }

    /// Go on with the blocks from the one word `w` lies in.
    #[inline]
    pub(super) fn restart_block_walk(&self, bw: &mut BlockWalk, w: usize, guided: bool) {
        let b = w / BLOCK_WORDS;
        bw.next = if guided { self.next_marked_block(b) } else { b };
    }

    /// Hand out parked blocks below block `limit`, in address order, from where the walk
    /// is, until `need` indices are handed out: `each(word, bits)`, whole words but for
    /// the last block's, whose remainder goes back to the words. Returns how many were
    /// handed out. A block is taken on what the claim's reservation holds of the
    /// parked blocks, or, when that is spent, by taking one off the parked count in
    /// exchange for indices of the words' part (given back by `finish_block_walk`):
    /// so a claim takes the free indices in address order, whichever level holds them.
    /// A block that the count does not cover (other claims reserved it) is passed over.
    #[inline]
    pub(super) fn claim_blocks_below(
        &self,
        bw: &mut BlockWalk,
        limit: usize,
        guided: bool,
        need: usize,
        each: &mut impl Claimed,
    ) -> usize {
        let nb = self.park.blocks.len();
        let mut got = 0;
        while bw.next < limit.min(nb) && got < need {
            let b = bw.next;
            bw.next = if guided { self.next_marked_block(b + 1) } else { b + 1 };
            if self.park.blocks[b].load(Ordering::Relaxed) & PARKED == 0 {
                if guided {
                    self.unmark_parked(b);
                }
                continue;
            }
            if bw.held == 0 {
                bw.held = take_up_to(&self.park.parked, (need - got).div_ceil(BLOCK));
                if bw.held == 0 {
                    continue;
                }
            }
            if self.try_unpark(b, guided) {
                bw.held -= 1;
                let took = self.hand_out_block(b, need - got, each);
                got += took;
                bw.last_word = b * BLOCK_WORDS + (took - 1) / BITS;
            }
        }
        got
    }

    /// The end of a claim's walk: `need` indices still owed, all from blocks this claim
    /// holds (its word part is spent); then give back what the claim holds and did
    /// not use: `words` of its word part (traded for blocks) and block counts.
    pub(super) fn finish_block_walk(&self, bw: &mut BlockWalk, mut need: usize, words: usize, each: &mut impl Claimed) {
        if need > 0 {
            need -= self.claim_blocks_below(bw, usize::MAX, true, need, each);
        }
        while need > 0 {
            debug_assert!(bw.held > 0, "a claim owed {need} indices with no block to take them from");
            let b = self.unpark_one();
            bw.held -= 1;
            need -= self.hand_out_block(b, need, each);
        }
        self.publish(words);
        self.publish_parked(bw.held);
        bw.held = 0;
    }

    /// Block `b`, just unparked: hand out up to `need` of its indices (its words whole,
    /// but the last one's); the remainder is freed back to the words and published.
    /// Returns how many were handed out.
    fn hand_out_block(&self, b: usize, need: usize, each: &mut impl Claimed) -> usize {
        let w0 = b * BLOCK_WORDS;
        let take = need.min(BLOCK);
        let (full, part) = (take / BITS, take % BITS);
        each.whole(w0, full);
        if take == BLOCK {
            return take;
        }
        // The remainder: the rest of a partly taken word, then whole words.
        let mut low = 0;
        if part > 0 {
            low = (1u64 << part) - 1;
            each.word(w0 + full, low);
        }
        let freed = self.block_to_words(b, full, low);
        self.publish(freed);
        take
    }

    /// Free what is left of block `b`, just unparked, back into its words: word `first`
    /// but its bits `taken`, and every word after it (from the block's start). Returns
    /// how many, for the caller to publish.
    fn block_to_words(&self, b: usize, first: usize, taken: u64) -> usize {
        let w0 = b * BLOCK_WORDS;
        let mut acc = Applied::new();
        let mut w = w0 + first;
        if taken != 0 {
            self.set_bits(w, !taken, super::Dup::Strict, &mut acc);
            w += 1;
        }
        for w in w..w0 + BLOCK_WORDS {
            self.set_bits(w, u64::MAX, super::Dup::Strict, &mut acc);
        }
        self.settle(&mut acc);
        // These indices were ours (unparked, never handed out); only a misuse that
        // parks this block again can take some back (`close_block`), and then
        // `freed` counts what stayed in the words.
        acc.freed
    }

    /// Move parked block `b` into its words, every index free and counted there, so
    /// that a claim can take one index of it ([`claim_following`](Self::claim_following)).
    /// Whether it did: `false` when the block is not parked, or every parked block's
    /// count is reserved by claims in flight (they will take it whole).
    pub(super) fn unpark_to_words(&self, b: usize) -> bool {
        if take_up_to(&self.park.parked, 1) == 0 {
            return false;
        }
        if !self.try_unpark(b, false) {
            self.publish_parked(1);
            return false;
        }
        let freed = self.block_to_words(b, 0, 0);
        self.publish(freed);
        true
    }

    /// A reservation with no block part: the blocks `r` holds are moved into their
    /// words (any parked blocks; `r` holds their counts) and what it does not need of
    /// them is published. Claims that take chosen indices out of the words work on it.
    pub(super) fn words_only(&self, r: Reservation) -> Reservation {
        let mut freed = 0;
        for _ in 0..r.blocks() {
            let b = self.unpark_one();
            freed += self.block_to_words(b, 0, 0);
        }
        // What `r` needs of them stays counted as ours; the rest is published.
        debug_assert!(freed >= r.from_blocks, "a reservation's blocks held too few indices");
        self.publish(freed.saturating_sub(r.from_blocks));
        Reservation::words(r.len())
    }

    /// Parked blocks and their count, for `check_invariants`: `(parked states, words
    /// of parked blocks that hold bits, count reservable)`.
    pub(super) fn parked_census(&self) -> (usize, Option<usize>, usize) {
        let mut parked = 0;
        let mut dirty = None;
        for (b, s) in self.park.blocks.iter().enumerate() {
            if s.load(Ordering::Acquire) & PARKED != 0 {
                parked += 1;
                let w0 = b * BLOCK_WORDS;
                if dirty.is_none() && self.words[w0..w0 + BLOCK_WORDS].iter().any(|w| w.load(Ordering::Acquire) != 0) {
                    dirty = Some(b);
                }
            }
        }
        (parked, dirty, self.park.parked.load(Ordering::Acquire))
    }

    /// Reset every block to "not parked" (the pool is being refilled).
    pub(super) fn reset_blocks(&self) {
        for s in self.park.blocks.iter().chain(self.park.summary.iter()) {
            s.store(0, Ordering::Relaxed);
        }
        self.park.parked.store(0, Ordering::Relaxed);
        self.park.hint.store(0, untracked::Ordering::Relaxed);
    }
}

/// Take up to `n` off `counter`; returns how many were taken.
fn take_up_to(counter: &AtomicUsize, n: usize) -> usize {
    let mut cur = counter.load(Ordering::Relaxed);
    loop {
        let t = cur.min(n);
        if t == 0 {
            return 0;
        }
        // Acquire, as in `take`.
        match counter.compare_exchange(cur, cur - t, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return t,
            Err(actual) => cur = actual,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::FreeErrorKind;

    /// A parking pool of `cap` with everything handed out.
    fn full(cap: u32) -> SlotPool {
        let pool = SlotPool::with_parking(cap);
        let mut all = vec![0u32; cap as usize];
        pool.alloc(&mut all).unwrap();
        pool
    }

    fn free_range(pool: &SlotPool, first: u32, count: u32) -> Result<usize, crate::FreeError> {
        let mut group = pool.free_group();
        let r = group.free_range(first, count);
        let n = group.end();
        r.map(|()| n)
    }

    fn parked_blocks(pool: &SlotPool) -> Vec<usize> {
        (0..pool.park.blocks.len()).filter(|&b| pool.park.blocks[b].load(Ordering::Relaxed) & PARKED != 0).collect()
    }

    /// A range covering whole blocks parks them (their words stay 0) and counts them;
    /// an allocation of a block's worth takes it whole, lowest block first.
    #[test]
    fn whole_blocks_park_and_come_back_whole() {
        let pool = full(4096);
        // 1 block and a bit before it, 2 whole blocks, a bit after.
        assert_eq!(free_range(&pool, 500, 1100).unwrap(), 1100);
        assert_eq!(parked_blocks(&pool), [1, 2]);
        assert_eq!(pool.park.parked.load(Ordering::Relaxed), 2);
        assert_eq!(pool.words[8].load(Ordering::Relaxed), 0, "a parked block's words stay 0");
        assert_eq!(pool.available(), 1100);
        assert!((500..1600).all(|i| !pool.is_allocated(i)));
        assert!(pool.is_allocated(499) && pool.is_allocated(1600));
        assert!(!pool.all_allocated(1, 700) && !pool.all_allocated(600, 10) && pool.all_allocated(1600, 100));
        pool.check_invariants().unwrap();

        // 600, lowest first across words and blocks: 500..=512 from the words, block
        // 1 whole, 75 of block 2 (whose other 437 go back to its words), in address
        // order.
        let mut got = vec![0u32; 600];
        pool.alloc(&mut got).unwrap();
        assert!(got.iter().copied().eq(500..1100));
        assert!((1100..1600).all(|i| !pool.is_allocated(i)));
        assert!(parked_blocks(&pool).is_empty());
        assert_eq!(pool.available(), 500);
        pool.check_invariants().unwrap();
    }

    /// A claim that needs part of a block takes it whole and frees the rest back into
    /// its words, where the next claims find it.
    #[test]
    fn a_block_taken_in_part_returns_the_rest_to_its_words() {
        let pool = full(2048);
        free_range(&pool, 1025, 512).unwrap();
        assert_eq!(parked_blocks(&pool), [2]);
        let mut got = [0u32; 100];
        pool.alloc(&mut got).unwrap();
        assert!(got.iter().copied().eq(1025..1125));
        assert!(parked_blocks(&pool).is_empty());
        assert_eq!(pool.available(), 412);
        assert!((1125..1537).all(|i| !pool.is_allocated(i)));
        pool.check_invariants().unwrap();
        let mut rest = [0u32; 412];
        pool.alloc(&mut rest).unwrap();
        assert!(rest.iter().copied().eq(1125..1537));
        assert_eq!(pool.available(), 0);
        assert!(pool.alloc(&mut [0u32; 1]).is_err());
    }

    /// Freeing a parked block again, or any index in it, is a double free, refused with
    /// nothing changed; so is parking a block one of whose indices is free.
    #[test]
    fn double_frees_around_parked_blocks_are_refused() {
        let pool = full(2048);
        free_range(&pool, 513, 512).unwrap();
        for (first, count) in [(513u32, 512u32), (600, 1), (1, 1024), (1000, 30)] {
            let e = free_range(&pool, first, count).unwrap_err();
            assert_eq!(e.kind, FreeErrorKind::NotAllocated, "{first} + {count}");
            assert!((513..=1024).contains(&e.index) && !e.rest_freed, "{e:?}");
        }
        assert_eq!(pool.free(&[700]).unwrap_err().index, 700);
        assert_eq!(pool.available(), 512);
        // A free index inside a block: the block is not parked, and the error is the
        // one a pool without parking reports (the words before it freed).
        pool.free(&[1500]).unwrap();
        let mut group = pool.free_group();
        let e = group.free_ranges([(1025, 512)]).unwrap_err();
        assert_eq!((e.index, e.rest_freed), (1500, true));
        assert_eq!(group.end(), 448, "words 16..=22 (indices 1025..=1472) were freed");
        assert_eq!(parked_blocks(&pool), [1]);
        pool.check_invariants().unwrap();
    }

    /// All-or-nothing: an allocation that the words and the parked blocks together
    /// cannot serve fails with the total, and gives back what it had taken.
    #[test]
    fn a_short_mixed_reservation_changes_nothing() {
        let pool = full(2048);
        free_range(&pool, 1, 512).unwrap();
        pool.free(&[1600, 1700]).unwrap();
        let e = pool.alloc(&mut [0u32; 515]).unwrap_err();
        assert_eq!((e.requested, e.available), (515, 514));
        assert_eq!(pool.available(), 514);
        assert_eq!(pool.park.parked.load(Ordering::Relaxed), 1);
        pool.check_invariants().unwrap();
        let mut got = [0u32; 514];
        pool.alloc(&mut got).unwrap();
        assert_eq!(&got[512..], [1600, 1700]);
    }

    /// A word-level free that raced a block free of the same block and lost (the block
    /// got parked between its bits and its generation step) takes its bits back and
    /// reports them, so the index is free once.
    #[test]
    fn a_word_free_that_finds_its_block_parked_withdraws() {
        let pool = full(1024);
        // Replay the race by hand: the word free sets its bit...
        let mut acc = Applied::new();
        pool.set_bits(0, 1 << 4, crate::slots::Dup::Strict, &mut acc);
        // ...a block free that loaded the words before that bit parks the block...
        pool.park.blocks[0].fetch_or(PARKED, Ordering::SeqCst);
        // ...and the word free's generation step sees it.
        pool.settle(&mut acc);
        assert_eq!((acc.freed, acc.first_dup), (0, Some(5)));
        assert_eq!(pool.words[0].load(Ordering::Relaxed), 0);
    }

    // The model test, against a set model and a twin pool that does not park, is
    // `tests/slot_parking_model.rs` (`kvpool::models::parking`, also the `slot_parking`
    // fuzz target).
}
