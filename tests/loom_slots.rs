#![cfg(all(loom, not(shuttle)))]
//! Loom models of `SlotPool`: every interleaving (within the preemption bound) of a few
//! threads allocating and freeing.
//!
//! Run with `scripts/loom.sh` (`RUSTFLAGS="--cfg loom" cargo test --release --test loom_slots`).
//!
//! Ownership is checked with loom's `UnsafeCell`: whoever holds index `i` writes its tag
//! into cell `i` after claiming it and reads it back before freeing it. Two holders at
//! once — or a hand-off without a happens-before edge from the old owner's free to the
//! new owner's claim — is a data race on that cell, which loom reports as a causality
//! violation; a wrong tag read back fails the assertion.
//!
//! | model                                   | what it proves                                        |
//! |-----------------------------------------|-------------------------------------------------------|
//! | `alloc_and_free_never_double_hand_out`  | concurrent batch alloc/free: one owner per index, count conserved |
//! | `batch_alloc_across_two_words`          | the same when batches span two bitmap words           |
//! | `racing_for_the_last_slots`             | all-or-nothing: exactly one of two `alloc(2)` on 3 free wins |
//! | `racing_for_the_last_slots_with_a_free` | all-or-nothing with a free landing mid-race, two words |
//! | `free_group_publishes_atomically`       | an observer sees none or all of a group; allocs needing it fail until it ends |
//! | `free_group_across_words_with_alloc`    | the same with the group's bits in two words and a concurrent claim |
//! | `double_free_racing_with_alloc`         | a double free is reported, counts stay exact, nothing else is touched |
//! | `magazine_exchange_racing_alloc`        | a full magazine flushed to the bitmap by a free racing its owner's pop and another thread's flush-on-shortage: one owner per index, count conserved |
//! | `double_free_of_a_magazine_index`       | a second free of an index sitting in a magazine is refused, racing the pop that hands it out again and a free into the same (shared) magazine |
//! | `large_claim_swap_racing_free_and_claim` | a claim of 64 that takes a whole word with `swap(0)` while a free and a one-index claim change that word: one owner per index, count conserved |
//! | `block_free_racing_a_word_free_inside_it` | parked blocks: a block free racing a double free of one index inside it: exactly one of the two frees of that index succeeds, counts exact, all three ways the race can go reached |
//! | `claims_racing_for_a_parked_block`      | two claims racing for one parked block (one takes it, its remainder goes back to the words): one owner per index, counts come back |
//! | `a_claim_trading_for_a_block_racing_one_that_reserved_it` | a claim reserved on the words meets a parked block below them and trades for it, racing a claim that reserved the block's count: one owner per index, at most one refused, counts come back |
//! | `claim_racing_a_group_that_parks`       | a claim that needs more than the words hold racing a free group that parks a block: refused until the group ends, then served lowest first from words and block; counts come back |
//! | `owned_batches_racing_a_flush_and_a_bare_free` | owned batches (`Slots`): the main thread's runs magazine holds [1, 2]; a thread sharing it fills a batch from it (or the bitmap) and tries a bare free of what it owns (always refused), while a thread that needs 3 flushes that magazine or is refused; all three outcomes reached, one owner per index, counts come back |
//! | `a_private_magazine_racing_a_claim_for_what_it_holds` | `SlotCache`: a cache of 2 draws its stock (2, or 1 when the pool is short) and hands a batch out of it and back while another thread claims 3 of the 4: the claim is served or refused by what the stock holds, never both handed the same index; the cache's drop returns the stock; all three outcomes reached, counts come back |
//! | `repeat_checks_by_marks_racing_in_shared_words` | two strict frees whose batches come back to words they passed, past the run buffer (2 runs under loom), so both check for repeats with the `freeing` marks in the same words: the distinct batch is freed whole, the one naming an index twice is refused whole; no mark is left, counts exact |
//! | `large_claim_placement_racing_small_claim` | a claim of 64 that passes over a sparse word first (placement) and takes it in its second pass, racing a one-index claim of that word's lowest bit: one owner per index, all 65 free handed out, both orders reached |
//!
//! Under loom a magazine holds 2 indices and there are 2 shards: loom threads 0 and 2
//! share a magazine (thread slot = loom thread number), so its `busy` flag is contended.
//! Every model counts its executions and asserts that loom explored more than one.

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use kvpool::{FreeErrorKind, SlotCache, SlotPool, Slots};
use loom_common::Outcomes;

/// One loom-tracked cell per index (`0..=capacity`): the current owner's tag.
struct Owners(Vec<UnsafeCell<usize>>);

impl Owners {
    fn new(capacity: u32) -> Self {
        Owners((0..=capacity).map(|_| UnsafeCell::new(0)).collect())
    }

    /// Record that `tag` now holds `indices` (call right after a successful alloc).
    fn claim(&self, indices: &[u32], tag: usize) {
        for &i in indices {
            // SAFETY: loom checks this access; a concurrent access by another holder is
            // exactly the bug this model looks for, and loom reports it instead of racing.
            self.0[i as usize].with_mut(|p| unsafe { *p = tag });
        }
    }

    /// Check that `tag` still holds `indices` (call right before freeing them).
    fn check(&self, indices: &[u32], tag: usize) {
        for &i in indices {
            // SAFETY: as in `claim`.
            let held = self.0[i as usize].with(|p| unsafe { *p });
            assert_eq!(held, tag, "index {i} was handed to someone else while held");
        }
    }
}

fn distinct_in_range(indices: &[u32], capacity: u32) {
    for (k, &i) in indices.iter().enumerate() {
        assert!((1..=capacity).contains(&i), "index {i} out of range");
        assert!(!indices[..k].contains(&i), "index {i} handed out twice in one batch: {indices:?}");
    }
}

/// Two threads allocate, use and free batches while the main thread frees what it
/// held: no index has two owners, and every index comes back.
#[test]
fn alloc_and_free_never_double_hand_out() {
    loom_common::model("alloc_and_free_never_double_hand_out", || {
        const CAP: u32 = 4;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut held = [0u32; 2];
        pool.alloc(&mut held).unwrap();
        owners.claim(&held, 9);

        let workers: Vec<_> = [(1usize, 2usize), (2, 1)]
            .into_iter()
            .map(|(tag, n)| {
                let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
                thread::spawn(move || {
                    let mut got = [0u32; 2];
                    let got = &mut got[..n];
                    if pool.alloc(got).is_ok() {
                        distinct_in_range(got, CAP);
                        owners.claim(got, tag);
                        owners.check(got, tag);
                        pool.free(got).unwrap();
                    }
                })
            })
            .collect();
        owners.check(&held, 9);
        pool.free(&held).unwrap();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(pool.available(), CAP as usize);
        pool.check_invariants().unwrap();
    });
}

/// Batches that must take bits from both words of a 66-index pool.
#[test]
fn batch_alloc_across_two_words() {
    loom_common::model("batch_alloc_across_two_words", || {
        const CAP: u32 = 66;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        // free 64 (last bit of word 0) and 65 (first bit of word 1)
        pool.free(&[64, 65]).unwrap();
        owners.claim(&[1, 66], 9);

        let taker = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let mut got = [0u32; 2];
                if pool.alloc(&mut got).is_ok() {
                    distinct_in_range(&got, CAP);
                    owners.claim(&got, 1);
                    owners.check(&got, 1);
                    pool.free(&got).unwrap();
                }
            })
        };
        let freer = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(&[1, 66], 9);
                pool.free(&[1, 66]).unwrap();
            })
        };
        let one = pool.alloc_one();
        if let Ok(i) = one {
            owners.claim(&[i], 3);
            owners.check(&[i], 3);
            pool.free(&[i]).unwrap();
        }
        taker.join().unwrap();
        freer.join().unwrap();
        assert_eq!(pool.available(), 4);
        pool.check_invariants().unwrap();
    });
}

/// Exactly one of two `alloc(2)` on 3 free indices succeeds; the loser sees the count
/// the winner left and its buffer is untouched.
#[test]
fn racing_for_the_last_slots() {
    let seen = Outcomes::new(&["first_won", "second_won"]);
    let s = seen.clone();
    loom_common::model("racing_for_the_last_slots", move || {
        let pool = Arc::new(SlotPool::new(3));
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let mut got = [u32::MAX; 2];
                    match pool.alloc(&mut got) {
                        Ok(()) => {
                            distinct_in_range(&got, 3);
                            Some(got)
                        }
                        Err(e) => {
                            assert_eq!((e.requested, e.available), (2, 1));
                            assert_eq!(got, [u32::MAX; 2], "a refused alloc wrote its buffer");
                            None
                        }
                    }
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let winners: Vec<_> = results.iter().flatten().collect();
        assert_eq!(winners.len(), 1, "{results:?}");
        s.hit(if results[0].is_some() { "first_won" } else { "second_won" });
        assert_eq!(pool.available(), 1);
        let won = winners[0];
        let left = (1..=3).find(|i| !won.contains(i)).unwrap();
        assert!(!pool.is_allocated(left) && pool.is_allocated(won[0]) && pool.is_allocated(won[1]));
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("racing_for_the_last_slots", &["first_won", "second_won"]);
}

/// Two `alloc(2)` race for 3 free indices spread over two words while a third thread
/// frees one more: both may win only if the free was published in time; nobody ever
/// holds a partial batch, and the counts add up.
#[test]
fn racing_for_the_last_slots_with_a_free() {
    let seen = Outcomes::new(&["one_won", "both_won"]);
    let s = seen.clone();
    loom_common::model("racing_for_the_last_slots_with_a_free", move || {
        const CAP: u32 = 66;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        pool.free(&[2, 64, 66]).unwrap();
        owners.claim(&[65], 9);

        let racers: Vec<_> = (1..=2)
            .map(|tag| {
                let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
                thread::spawn(move || {
                    let mut got = [u32::MAX; 2];
                    match pool.alloc(&mut got) {
                        Ok(()) => {
                            distinct_in_range(&got, CAP);
                            owners.claim(&got, tag);
                            true
                        }
                        Err(e) => {
                            assert_eq!(e.requested, 2);
                            assert!(e.available < 2);
                            assert_eq!(got, [u32::MAX; 2]);
                            false
                        }
                    }
                })
            })
            .collect();
        owners.check(&[65], 9);
        pool.free(&[65]).unwrap();
        let wins = racers.into_iter().map(|r| r.join().unwrap() as usize).sum::<usize>();
        assert!(wins >= 1);
        assert_eq!(pool.available(), 4 - 2 * wins);
        s.hit(if wins == 2 { "both_won" } else { "one_won" });
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("racing_for_the_last_slots_with_a_free", &["one_won", "both_won"]);
}

/// A group's two frees become available together at its end: an observer reads
/// `available()` as 0 or 2, never 1, and an alloc that succeeds has seen the end begin.
#[test]
fn free_group_publishes_atomically() {
    let seen = Outcomes::new(&["saw_none", "saw_group", "alloc_from_group", "alloc_refused"]);
    let s = seen.clone();
    loom_common::model("free_group_publishes_atomically", move || {
        let pool = Arc::new(SlotPool::new(3));
        let mut all = [0u32; 3];
        pool.alloc(&mut all).unwrap();
        let ending = Arc::new(AtomicBool::new(false));

        let grouper = {
            let (pool, ending) = (Arc::clone(&pool), Arc::clone(&ending));
            thread::spawn(move || {
                let mut g = pool.free_group();
                g.free(&[1]).unwrap();
                g.free(&[3]).unwrap();
                ending.store(true, Ordering::Release);
                assert_eq!(g.end(), 2);
            })
        };
        // The observer is a thread spawned after the grouper (main only joins), so loom's
        // first schedule runs the group's stores before the observer's loads and
        // backtracks from there (loom does not reorder a load before a later store in
        // another thread: tokio-rs/loom#392).
        let observer = {
            let (pool, ending, s2) = (Arc::clone(&pool), Arc::clone(&ending), s.clone());
            thread::spawn(move || {
                let avail = pool.available();
                assert!(avail == 0 || avail == 2, "saw {avail} of a group of 2");
                s2.hit(if avail == 0 { "saw_none" } else { "saw_group" });
                if let Ok(i) = pool.alloc_one() {
                    assert!(ending.load(Ordering::Acquire), "allocated {i} before the group ended");
                    assert!(i == 1 || i == 3);
                    let later = pool.available();
                    assert!(later <= 1, "the group published twice: {later}");
                    pool.free(&[i]).unwrap();
                    s2.hit("alloc_from_group");
                } else {
                    s2.hit("alloc_refused");
                }
            })
        };
        observer.join().unwrap();
        grouper.join().unwrap();
        assert_eq!(pool.available(), 2);
        assert!(pool.is_allocated(2));
        pool.check_invariants().unwrap();
    });
    seen.expect_seen(
        "free_group_publishes_atomically",
        &["saw_none", "saw_group", "alloc_from_group", "alloc_refused"],
    );
}

/// A group frees one index in each word of a 66-index pool while another thread
/// allocates the one index available: that alloc may claim a group bit (it is free
/// once set) but never more than it reserved, and the group's count arrives whole.
/// The bitmap alone (no magazines): a magazine would hold index 66 and always hand it
/// out first, so the claim could never meet a group bit.
#[test]
fn free_group_across_words_with_alloc() {
    let seen = Outcomes::new(&["took_66", "took_a_group_index"]);
    let s = seen.clone();
    loom_common::model("free_group_across_words_with_alloc", move || {
        const CAP: u32 = 66;
        let pool = Arc::new(SlotPool::without_magazines(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        pool.free(&[66]).unwrap(); // one available from the start
        owners.claim(&[2, 65], 9);

        let grouper = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(&[2, 65], 9);
                let mut g = pool.free_group();
                g.free(&[2, 65]).unwrap();
                g.end()
            })
        };
        let taker = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let i = pool.alloc_one().expect("one index was available throughout");
                owners.claim(&[i], 1);
                i
            })
        };
        assert_eq!(grouper.join().unwrap(), 2);
        let i = taker.join().unwrap();
        assert!([2, 65, 66].contains(&i), "{i}");
        s.hit(if i == 66 { "took_66" } else { "took_a_group_index" });
        assert_eq!(pool.available(), 2);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("free_group_across_words_with_alloc", &["took_66", "took_a_group_index"]);
}

/// Two threads free the same index while a third allocates. At most one free succeeds
/// — unless the allocator was handed the index between them, the API-level ABA the
/// module docs describe — the other is told `NotAllocated`, and no other index and no
/// count is disturbed.
#[test]
fn double_free_racing_with_alloc() {
    let seen = Outcomes::new(&["alloc_between_frees", "alloc_after_free", "alloc_refused"]);
    let s = seen.clone();
    loom_common::model("double_free_racing_with_alloc", move || {
        let pool = Arc::new(SlotPool::new(2));
        let mut all = [0u32; 2];
        pool.alloc(&mut all).unwrap();

        let freers: Vec<_> = (0..2)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || match pool.free(&[1]) {
                    Ok(()) => true,
                    Err(e) => {
                        assert_eq!((e.index, e.kind), (1, FreeErrorKind::NotAllocated));
                        false
                    }
                })
            })
            .collect();
        let got = pool.alloc_one();
        let oks = freers.into_iter().map(|f| f.join().unwrap() as usize).sum::<usize>();
        assert!(oks >= 1, "the first free of an allocated index must succeed");
        match got {
            Ok(i) => {
                assert_eq!(i, 1, "only index 1 was ever free");
                // both frees succeeded only if the alloc took 1 in between
                assert_eq!(pool.available(), oks - 1);
                assert_eq!(pool.is_allocated(1), oks == 1);
                s.hit(if oks == 2 { "alloc_between_frees" } else { "alloc_after_free" });
            }
            Err(_) => {
                assert_eq!(oks, 1, "a double free succeeded with no alloc in between");
                assert_eq!(pool.available(), 1);
                s.hit("alloc_refused");
            }
        }
        assert!(pool.is_allocated(2), "an unrelated index was freed");
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("double_free_racing_with_alloc", &["alloc_between_frees", "alloc_after_free", "alloc_refused"]);
}

/// The main thread's magazine (shard 0) is full with [1, 2]. Thread 2 shares it and
/// frees [3, 4], which do not fit on top: it flushes the magazine to the bitmap (the
/// exchange) and pushes its own. Thread 1 (shard 1, empty magazine) needs 2 and finds
/// the counters empty, so it flushes shard 0's magazine itself. The main thread pops
/// 2 from its magazine meanwhile. Whoever gets indices owns them alone; every index is
/// held or available at the end.
#[test]
fn magazine_exchange_racing_alloc() {
    loom_common::model("magazine_exchange_racing_alloc", || {
        const CAP: u32 = 4;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = [0u32; 4];
        pool.alloc(&mut all).unwrap();
        assert_eq!(all, [1, 2, 3, 4]);
        pool.free(&[1, 2]).unwrap();
        owners.claim(&[3, 4], 9);

        let taker = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let mut got = [u32::MAX; 2];
                match pool.alloc(&mut got) {
                    Ok(()) => {
                        distinct_in_range(&got, CAP);
                        owners.claim(&got, 1);
                        owners.check(&got, 1);
                        2
                    }
                    Err(e) => {
                        // A magazine in use is skipped, so the refusal may undercount.
                        assert!(e.requested == 2 && e.available < 2, "{e:?}");
                        assert_eq!(got, [u32::MAX; 2]);
                        0
                    }
                }
            })
        };
        let freer = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(&[3, 4], 9);
                pool.free(&[3, 4]).unwrap();
            })
        };
        let mut mine = [u32::MAX; 2];
        let held_here = match pool.alloc(&mut mine) {
            Ok(()) => {
                distinct_in_range(&mine, CAP);
                owners.claim(&mine, 3);
                owners.check(&mine, 3);
                2
            }
            Err(_) => 0,
        };
        freer.join().unwrap();
        let held_there = taker.join().unwrap();
        assert_eq!(pool.available(), CAP as usize - held_here - held_there);
        pool.check_invariants().unwrap();
    });
}

/// Index 1 sits in the main thread's magazine. Thread 1 frees it again (a double
/// free) while the main thread allocates one index and thread 2, which shares the
/// main thread's magazine, frees index 2. The double free is refused unless the main
/// thread was handed 1 before it (the API-level ABA of the module docs); whatever
/// happens, the counts add up and every index is held or available exactly once.
#[test]
fn double_free_of_a_magazine_index() {
    loom_common::model("double_free_of_a_magazine_index", || {
        let pool = Arc::new(SlotPool::new(2));
        let mut all = [0u32; 2];
        pool.alloc(&mut all).unwrap();
        pool.free(&[1]).unwrap();

        let double = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || match pool.free(&[1]) {
                Ok(()) => true,
                Err(e) => {
                    assert_eq!((e.index, e.kind, e.rest_freed), (1, FreeErrorKind::NotAllocated, false));
                    false
                }
            })
        };
        let other = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.free(&[2]).unwrap())
        };
        let got = pool.alloc_one();
        let double_ok = double.join().unwrap();
        other.join().unwrap();
        match got {
            Ok(i) => {
                assert!(i == 1 || i == 2, "{i}");
                if double_ok {
                    assert_eq!(i, 1, "a double free of an index in a magazine succeeded");
                }
                assert_eq!(pool.is_allocated(i), !double_ok);
                assert_eq!(pool.available(), 1 + double_ok as usize);
            }
            // Refused only while thread 2 held the shared magazine (a busy magazine is
            // skipped, never waited for): then index 1 stayed in it, never handed out.
            Err(_) => {
                assert!(!double_ok, "a double free of an index in a magazine succeeded");
                assert_eq!(pool.available(), 2);
            }
        }
        pool.check_invariants().unwrap();
    });
}

/// A claim of 64 or more takes whole words with `swap(0)` (the large-claim path):
/// here it races a free of an index in the word it swaps and a one-index claim. Word 0
/// holds 63 free indices (index 1 is held by the main thread, which frees it during
/// the race) and word 1 holds 65 and 66. Thread 1 allocates 64: its `swap` takes 63 or
/// 64 bits of word 0, whichever the free and the other claim left, and the rest from
/// word 1. Whoever gets an index owns it alone, and every index is held or available.
#[test]
fn large_claim_swap_racing_free_and_claim() {
    let seen = Outcomes::new(&["swap_took_all_64", "swap_took_63"]);
    let s = seen.clone();
    loom_common::model("large_claim_swap_racing_free_and_claim", move || {
        const CAP: u32 = 66;
        let pool = Arc::new(SlotPool::without_magazines(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        let back: Vec<u32> = (2..=CAP).collect();
        pool.free(&back).unwrap();
        owners.claim(&[1], 9);

        let big = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let mut got = vec![0u32; 64];
                if pool.alloc(&mut got).is_err() {
                    return None;
                }
                distinct_in_range(&got, CAP);
                owners.claim(&got, 1);
                owners.check(&got, 1);
                let from_word_0 = got.iter().filter(|&&i| i <= 64).count();
                pool.free(&got).unwrap();
                Some(from_word_0)
            })
        };
        let small = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                if let Ok(i) = pool.alloc_one() {
                    owners.claim(&[i], 2);
                    owners.check(&[i], 2);
                    pool.free(&[i]).unwrap();
                }
            })
        };
        owners.check(&[1], 9);
        pool.free(&[1]).unwrap();
        let from_word_0 = big.join().unwrap();
        small.join().unwrap();
        match from_word_0 {
            Some(64) => s.hit("swap_took_all_64"),
            Some(63) => s.hit("swap_took_63"),
            Some(k) => assert!(k < 63, "{k} indices from word 0"),
            None => {}
        }
        assert_eq!(pool.available(), CAP as usize);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("large_claim_swap_racing_free_and_claim", &["swap_took_all_64", "swap_took_63"]);
}

/// Placement: a claim of 64 passes over a sparse word (isolated free bits) in its first
/// pass and takes what it still needs from it in a second. Word 0 holds 7 isolated free
/// indices (3, 12, ..., 57: sparse), word 1 holds 58 (71..=128). Thread 1 allocates 64:
/// all 58 of word 1, then 6 of word 0's; thread 2 allocates 1, lowest first, from word
/// 0. Together they take all 65: whoever gets an index owns it alone.
#[test]
fn large_claim_placement_racing_small_claim() {
    let seen = Outcomes::new(&["small_took_the_lowest", "small_took_another"]);
    let s = seen.clone();
    loom_common::model("large_claim_placement_racing_small_claim", move || {
        const CAP: u32 = 128;
        let pool = Arc::new(SlotPool::without_magazines(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        let sparse: Vec<u32> = (3..=57).step_by(9).collect();
        let dense: Vec<u32> = (71..=128).collect();
        pool.free(&sparse).unwrap();
        pool.free(&dense).unwrap();

        let big = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let mut got = vec![0u32; 64];
                pool.alloc(&mut got).expect("65 are free, 64 + 1 asked");
                distinct_in_range(&got, CAP);
                owners.claim(&got, 1);
                owners.check(&got, 1);
                got
            })
        };
        let small = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                // May find the count in transit in the big claim's sweep of the shards
                // (the module docs: a sweeper holds a count out of `available`).
                let i = pool.alloc_one().ok()?;
                owners.claim(&[i], 2);
                owners.check(&[i], 2);
                Some(i)
            })
        };
        let got = big.join().unwrap();
        let i = small.join().unwrap().map_or_else(|| pool.alloc_one().expect("one is left"), |i| i);
        let mut every: Vec<u32> = got.iter().copied().chain([i]).collect();
        every.sort_unstable();
        let mut want: Vec<u32> = sparse.iter().chain(&dense).copied().collect();
        want.sort_unstable();
        assert_eq!(every, want, "all 65 free indices, each once");
        s.hit(if i == 3 { "small_took_the_lowest" } else { "small_took_another" });
        assert_eq!(pool.available(), 0);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("large_claim_placement_racing_small_claim", &["small_took_the_lowest", "small_took_another"]);
}

/// Parked blocks: a free of a whole block (`free_range` of 128 indices under loom, two
/// words) racing a double free of one index inside it. Exactly one of the two frees of
/// index 5 succeeds, whichever way the race goes: the word free first (the block free
/// is refused, or frees the block's other indices and reports 5), or the block parked
/// first (the word free is refused, or takes its bit back); index 5 ends free once and
/// the counts are exact.
#[test]
fn block_free_racing_a_word_free_inside_it() {
    let seen = Outcomes::new(&["block_won", "word_first", "word_won_racing"]);
    let s = seen.clone();
    loom_common::model("block_free_racing_a_word_free_inside_it", move || {
        let pool = Arc::new(SlotPool::with_parking(256));
        let mut all = vec![0u32; 256];
        pool.alloc(&mut all).unwrap();
        // Both in threads of their own, so that loom runs either first.
        let block = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut group = pool.free_group();
                let ok = group.free_range(1, 128).is_ok();
                (ok, group.end())
            })
        };
        let word = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.free(&[5]).is_ok())
        };
        let (block_ok, freed) = block.join().unwrap();
        let word_ok = word.join().unwrap();
        assert!(block_ok != word_ok, "exactly one of the two frees of index 5 succeeds");
        match (block_ok, freed) {
            (true, 128) => s.hit("block_won"),
            (false, 0) => s.hit("word_first"),
            (false, 127) => s.hit("word_won_racing"),
            other => panic!("block free {other:?}"),
        }
        assert_eq!(pool.available(), if block_ok { 128 } else { freed + 1 });
        assert!(!pool.is_allocated(5));
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("block_free_racing_a_word_free_inside_it", &["block_won", "word_first", "word_won_racing"]);
}

/// A parking pool of `cap` indices, all handed out (`all`), and its owner table.
fn parking_pool_all_taken(cap: u32) -> (Arc<SlotPool>, Arc<Owners>, Vec<u32>) {
    let pool = Arc::new(SlotPool::with_parking(cap));
    let mut all = vec![0u32; cap as usize];
    pool.alloc(&mut all).unwrap();
    (pool, Arc::new(Owners::new(cap)), all)
}

/// Claims of `sizes` indices (tagged 1, 2, ... in the owner table), each on its own
/// thread, all at once: what each got, `None` if refused.
fn racing_claims(pool: &Arc<SlotPool>, owners: &Arc<Owners>, sizes: &[usize]) -> Vec<Option<Vec<u32>>> {
    let cap = pool.capacity();
    let claims: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let (pool, owners) = (Arc::clone(pool), Arc::clone(owners));
            thread::spawn(move || {
                let mut got = vec![0u32; n];
                pool.alloc(&mut got).ok()?;
                distinct_in_range(&got, cap);
                owners.claim(&got, k + 1);
                owners.check(&got, k + 1);
                Some(got)
            })
        })
        .collect();
    claims.into_iter().map(|c| c.join().unwrap()).collect()
}

/// After [`racing_claims`] on a pool with `free` indices free before them: the counts
/// are exact with the claims' indices out, and come back whole when they are freed.
fn counts_come_back(pool: &SlotPool, got: &[Option<Vec<u32>>], free: usize) {
    let taken: usize = got.iter().flatten().map(Vec::len).sum();
    assert_eq!(pool.available(), free - taken);
    pool.check_invariants().unwrap();
    for g in got.iter().flatten() {
        pool.free(g).unwrap();
    }
    assert_eq!(pool.available(), free);
    pool.check_invariants().unwrap();
}

/// Two claims that each need most of a block race for the one parked block: one
/// takes it (its remainder goes back to the words), the other is refused, or served
/// by that remainder if it fits; one owner per index, and every count comes back.
#[test]
fn claims_racing_for_a_parked_block() {
    let seen = Outcomes::new(&["first_served", "second_served"]);
    let s = seen.clone();
    loom_common::model("claims_racing_for_a_parked_block", move || {
        const CAP: u32 = 256;
        let (pool, owners, _) = parking_pool_all_taken(CAP);
        pool.free_group().free_range(1, 128).unwrap();
        let got = racing_claims(&pool, &owners, &[100, 20]);
        // Whoever takes the block first splits it; the other is served from the
        // remainder in the words, or refused while the remainder is in transit.
        match got.iter().position(|g| g.as_ref().is_some_and(|g| g[0] == 1)) {
            Some(0) => s.hit("first_served"),
            Some(_) => s.hit("second_served"),
            None => panic!("the block serves one of them: {got:?}"),
        }
        counts_come_back(&pool, &got, 128);
    });
    seen.expect_seen("claims_racing_for_a_parked_block", &["first_served", "second_served"]);
}

/// A claim that needs more than the words hold races a free group that parks a
/// block: it is refused until the group ends (the block is not counted before), then
/// served lowest first from the words and the block; the counts come back.
#[test]
fn claim_racing_a_group_that_parks() {
    let seen = Outcomes::new(&["before_the_group", "after_the_group"]);
    let s = seen.clone();
    loom_common::model("claim_racing_a_group_that_parks", move || {
        const CAP: u32 = 256;
        let (pool, owners, all) = parking_pool_all_taken(CAP);
        pool.free_group().free_range(1, 100).unwrap(); // words only: no whole block
        owners.claim(&all[128..], 9);
        let claim = {
            let (pool, owners) = (Arc::clone(&pool), Arc::clone(&owners));
            thread::spawn(move || {
                let mut got = vec![0u32; 120];
                pool.alloc(&mut got).ok()?;
                distinct_in_range(&got, CAP);
                owners.claim(&got, 1);
                owners.check(&got, 1);
                Some(got)
            })
        };
        owners.check(&all[128..], 9);
        let mut group = pool.free_group();
        group.free_range(129, 128).unwrap();
        assert_eq!(group.end(), 128);
        let got = claim.join().unwrap();
        s.hit(if got.is_some() { "after_the_group" } else { "before_the_group" });
        let taken = got.as_ref().map_or(0, Vec::len);
        assert_eq!(pool.available(), 228 - taken);
        pool.check_invariants().unwrap();
        if let Some(g) = &got {
            // Lowest first: the 100 free in the words, then 20 of the block.
            assert!(g.iter().copied().eq((1..=100).chain(129..=148)), "{g:?}");
            pool.free(g).unwrap();
        }
        assert_eq!(pool.available(), 228);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen("claim_racing_a_group_that_parks", &["before_the_group", "after_the_group"]);
}

/// A claim reserved on the words meets a parked block below them and trades its
/// reservation for the block, racing a claim that needs the block's count (the words
/// are short): one owner per index; whichever reserves second may be refused while
/// the other holds the counts, never both; every count comes back.
#[test]
fn a_claim_trading_for_a_block_racing_one_that_reserved_it() {
    let seen = Outcomes::new(&["both_served", "trader_refused", "block_claim_refused"]);
    let s = seen.clone();
    loom_common::model("a_claim_trading_for_a_block_racing_one_that_reserved_it", move || {
        const CAP: u32 = 256;
        let (pool, owners, _) = parking_pool_all_taken(CAP);
        // Block 0 (1..=128) parked, four free indices in block 1's words.
        pool.free_group().free_range(1, 128).unwrap();
        pool.free(&[129, 130, 131, 132]).unwrap();
        let got = racing_claims(&pool, &owners, &[4, 128]);
        match (&got[0], &got[1]) {
            (Some(_), Some(_)) => s.hit("both_served"),
            (None, Some(_)) => s.hit("trader_refused"),
            (Some(a), None) => {
                // The trader took the block's count first: lowest first, from the block.
                assert_eq!(a, &[1, 2, 3, 4]);
                s.hit("block_claim_refused");
            }
            (None, None) => panic!("132 free indices refused both claims of 4 and 128"),
        }
        counts_come_back(&pool, &got, 132);
    });
    seen.expect_seen(
        "a_claim_trading_for_a_block_racing_one_that_reserved_it",
        &["both_served", "trader_refused", "block_claim_refused"],
    );
}

/// An owned batch of 3 from `pool` (of 4) as owner `tag`: served (checked, owned, freed)
/// or refused with nothing changed; `outcome` names the two.
fn claim_three(pool: &SlotPool, owners: &Owners, tag: usize, outcomes: &Outcomes, outcome: [&str; 2]) {
    let mut s = Slots::with_capacity(3);
    match pool.alloc_slots(3, &mut s) {
        Ok(()) => {
            distinct_in_range(&s, 4);
            owners.claim(&s, tag);
            owners.check(&s, tag);
            outcomes.hit(outcome[0]);
            assert_eq!(pool.free_slots(&mut s), Ok(3));
        }
        Err(e) => {
            assert!(matches!(e, kvpool::SlotsError::OutOfMemory(o) if o.requested == 3), "{e:?}");
            assert!(s.is_empty());
            outcomes.hit(outcome[1]);
        }
    }
}

/// Owned batches (`Slots`). The main thread's runs magazine (shard 0) holds the run
/// [1, 2]; 3 and 4 are free in the bitmap. Thread 2 shares that magazine: it fills a
/// batch of 1 (from the runs, or from the bitmap when the magazine is busy), tries a
/// bare free of the index it owns (refused: the batch owns it) and empties the batch.
/// Thread 1 (shard 1) fills a batch of 3: the counters hold 2, so it flushes shard 0's
/// runs to the bitmap, or is refused while thread 2 holds them. One owner per index;
/// every index is free again at the end.
#[test]
fn owned_batches_racing_a_flush_and_a_bare_free() {
    let seen = Outcomes::new(&["three_served", "three_refused", "one_from_the_bitmap"]);
    let outcomes = seen.clone();
    loom_common::model("owned_batches_racing_a_flush_and_a_bare_free", move || {
        const CAP: u32 = 4;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let mut first = Slots::with_capacity(2);
        pool.alloc_slots(2, &mut first).unwrap();
        assert_eq!(first.as_slice(), &[1, 2]);
        assert_eq!(pool.free_slots(&mut first), Ok(2));

        let big = {
            let (pool, owners, outcomes) = (Arc::clone(&pool), Arc::clone(&owners), outcomes.clone());
            thread::spawn(move || claim_three(&pool, &owners, 1, &outcomes, ["three_served", "three_refused"]))
        };
        let sharer = {
            let (pool, owners, outcomes) = (Arc::clone(&pool), Arc::clone(&owners), outcomes.clone());
            thread::spawn(move || {
                let mut s = Slots::with_capacity(1);
                if pool.alloc_slots(1, &mut s).is_ok() {
                    let i = s[0];
                    distinct_in_range(&s, CAP);
                    owners.claim(&s, 2);
                    if i > 2 {
                        outcomes.hit("one_from_the_bitmap");
                    }
                    let e = pool.free(&[i]).unwrap_err();
                    assert_eq!((e.index, e.kind, e.rest_freed), (i, FreeErrorKind::NotAllocated, false));
                    owners.check(&s, 2);
                    assert_eq!(pool.free_slots(&mut s), Ok(1));
                }
            })
        };
        // Thread slots follow loom's thread numbers: `sharer` is thread 2, shard 0.
        big.join().unwrap();
        sharer.join().unwrap();
        assert_eq!(pool.available(), CAP as usize);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen(
        "owned_batches_racing_a_flush_and_a_bare_free",
        &["three_served", "three_refused", "one_from_the_bitmap"],
    );
}

/// Private magazines (`SlotCache`). Thread 1's cache (capacity 2) fills a batch of 1:
/// it draws 1 + 1 from the pool into its stock (just 1 when the pool is short), pops
/// one into the batch, frees the batch back onto the stock, fills again (off the
/// stock, no atomic) and drops the cache, which returns the stock. Thread 2 claims 3
/// of the 4 from the pool: served when the stock is not out, refused (nothing changed)
/// while the stock holds 2. One owner per index; every index is free again at the end.
#[test]
fn a_private_magazine_racing_a_claim_for_what_it_holds() {
    let seen = Outcomes::new(&["claim_served", "claim_refused", "draw_cut_short"]);
    let outcomes = seen.clone();
    loom_common::model("a_private_magazine_racing_a_claim_for_what_it_holds", move || {
        const CAP: u32 = 4;
        let pool = Arc::new(SlotPool::new(CAP));
        let owners = Arc::new(Owners::new(CAP));
        let cached = {
            let (pool, owners, outcomes) = (Arc::clone(&pool), Arc::clone(&owners), outcomes.clone());
            thread::spawn(move || {
                let mut cache = SlotCache::new(Arc::clone(&pool), 2).unwrap();
                let mut s = Slots::with_capacity(1);
                if cache.alloc_slots(1, &mut s).is_err() {
                    return;
                }
                if cache.is_empty() {
                    outcomes.hit("draw_cut_short");
                }
                distinct_in_range(&s, CAP);
                owners.claim(&s, 1);
                owners.check(&s, 1);
                assert_eq!(cache.free_slots(&mut s), Ok(1));
                let before = cache.len();
                cache.alloc_slots(1, &mut s).unwrap();
                assert_eq!(cache.len(), before - 1, "the second fill comes off the stock");
                owners.claim(&s, 1);
                owners.check(&s, 1);
                assert_eq!(cache.free_slots(&mut s), Ok(1));
            })
        };
        let claim = {
            let (pool, owners, outcomes) = (Arc::clone(&pool), Arc::clone(&owners), outcomes.clone());
            thread::spawn(move || claim_three(&pool, &owners, 2, &outcomes, ["claim_served", "claim_refused"]))
        };
        cached.join().unwrap();
        claim.join().unwrap();
        assert_eq!(pool.available(), CAP as usize);
        pool.check_invariants().unwrap();
    });
    seen.expect_seen(
        "a_private_magazine_racing_a_claim_for_what_it_holds",
        &["claim_served", "claim_refused", "draw_cut_short"],
    );
}

/// Two strict frees in a pool without magazines, each of a batch that comes back to a
/// word it passed after more runs than the stack buffer holds (two under loom), so
/// both look for repeats with the pool's `freeing` marks, in the same three words.
/// One batch is distinct: it is freed whole, whatever the other's marks do meanwhile.
/// The other names index 3 twice: it is refused whole (`rest_freed: false`), its
/// indices still allocated, whatever the first's marks do. At the end no mark is left
/// (`check_invariants`) and the counts are exact.
#[test]
fn repeat_checks_by_marks_racing_in_shared_words() {
    loom_common::model("repeat_checks_by_marks_racing_in_shared_words", || {
        const CAP: u32 = 192; // three words
        let pool = Arc::new(SlotPool::without_magazines(CAP));
        let mut all = vec![0u32; CAP as usize];
        pool.alloc(&mut all).unwrap();
        // Words 0, 1, 2, then back to 0.
        let distinct = [1u32, 65, 129, 2];
        let repeated = [3u32, 66, 130, 3];
        let a = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.free(&distinct))
        };
        let r = pool.free(&repeated);
        a.join().unwrap().expect("a distinct batch frees whole");
        let e = r.expect_err("a batch naming 3 twice is refused");
        assert_eq!((e.index, e.kind, e.rest_freed), (3, FreeErrorKind::NotAllocated, false));
        assert!([3, 66, 130].iter().all(|&i| pool.is_allocated(i)), "a refused batch freed something");
        assert!(distinct.iter().all(|&i| !pool.is_allocated(i)));
        assert_eq!(pool.available(), distinct.len());
        pool.check_invariants().unwrap();
    });
}
