use super::*;
use crate::SlotsError;

#[test]
fn fresh_pool_is_ascending() {
    let pool = SlotPool::new(200);
    let mut a = [0u32; 70];
    pool.alloc(&mut a).unwrap();
    assert_eq!(a.to_vec(), (1..=70).collect::<Vec<_>>());
    let mut b = [0u32; 130];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b.to_vec(), (71..=200).collect::<Vec<_>>());
    assert_eq!(pool.available(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn all_or_nothing() {
    let pool = SlotPool::new(10);
    let mut a = [0u32; 7];
    pool.alloc(&mut a).unwrap();
    let mut b = [99u32; 4];
    let e = pool.alloc(&mut b).unwrap_err();
    assert_eq!((e.requested, e.available), (4, 3));
    assert_eq!(b, [99; 4]);
    assert_eq!(pool.available(), 3);
    let mut c = [0u32; 3];
    pool.alloc(&mut c).unwrap(); // exact capacity
    assert_eq!(c, [8, 9, 10]);
    pool.alloc(&mut []).unwrap(); // size 0 at zero availability
}

/// Without magazines, the lowest free indices come first. (With magazines this order
/// legitimately changes: see `magazine_hands_back_the_last_batch_in_push_order`.)
#[test]
fn lowest_free_first_after_frees() {
    let pool = SlotPool::without_magazines(300);
    let mut a = [0u32; 300];
    pool.alloc(&mut a).unwrap();
    pool.free(&[250, 5, 130]).unwrap();
    let mut b = [0u32; 3];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b, [5, 130, 250]);
}

#[test]
fn magazine_hands_back_the_last_batch_in_push_order() {
    let pool = SlotPool::new(300);
    assert_eq!(pool.magazine_capacity(), 300);
    let mut a = [0u32; 300];
    pool.alloc(&mut a).unwrap();
    pool.free(&[250, 5, 130]).unwrap();
    pool.free(&a[9..109]).unwrap(); // 10..=109, consecutive
    assert_eq!(pool.available(), 103);
    pool.check_invariants().unwrap();
    let mut b = [0u32; 100];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b.to_vec(), (10..=109).collect::<Vec<u32>>(), "a freed run comes back as the same run");
    let mut c = [0u32; 2];
    pool.alloc(&mut c).unwrap();
    assert_eq!(c, [5, 130]);
    assert_eq!(pool.alloc_one().unwrap(), 250);
    pool.check_invariants().unwrap();
}

#[test]
fn magazine_indices_are_not_allocated() {
    let pool = SlotPool::new(200);
    let mut a = [0u32; 200];
    pool.alloc(&mut a).unwrap();
    pool.free(&[7, 8, 9, 150]).unwrap();
    assert!(!pool.is_allocated(8) && !pool.is_allocated(150) && pool.is_allocated(10));
    // double frees of indices sitting in the magazine, alone and inside a valid batch
    let e = pool.free(&[8]).unwrap_err();
    assert_eq!((e.index, e.kind, e.rest_freed), (8, FreeErrorKind::NotAllocated, false));
    let e = pool.free(&[10, 11, 150, 12]).unwrap_err();
    assert_eq!((e.index, e.kind, e.rest_freed), (150, FreeErrorKind::NotAllocated, false));
    assert!(pool.is_allocated(10) && pool.is_allocated(11));
    // through a group too (group frees go to the bitmap)
    let mut g = pool.free_group();
    assert_eq!(g.free(&[9]).unwrap_err().index, 9);
    g.free(&[10]).unwrap();
    assert_eq!(g.end(), 1);
    assert_eq!(pool.available(), 5);
    pool.check_invariants().unwrap();
}

#[test]
fn full_magazine_goes_back_to_the_bitmap() {
    let pool = SlotPool::new(3000);
    let cap = pool.magazine_capacity();
    let mut a = vec![0u32; 3000];
    pool.alloc(&mut a).unwrap();
    pool.free(&a[..cap - 10]).unwrap(); // 1..=cap-10 in the magazine
    pool.free(&a[2000..2020]).unwrap(); // does not fit: the magazine is flushed first
    assert_eq!(pool.available(), cap + 10);
    pool.check_invariants().unwrap();
    let mut b = [0u32; 20];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b.to_vec(), (2001..=2020).collect::<Vec<u32>>());
    // the flushed ones come from the bitmap, lowest first
    let mut c = [0u32; 5];
    pool.alloc(&mut c).unwrap();
    assert_eq!(c, [1, 2, 3, 4, 5]);
    // a batch larger than a magazine goes to the bitmap and comes back lowest-first
    pool.free(&a[1900..1900 + cap + 1]).unwrap();
    let mut d = vec![0u32; cap + 1];
    pool.alloc(&mut d).unwrap();
    assert_eq!(d[..3], [6, 7, 8]);
    pool.check_invariants().unwrap();
}

#[test]
fn allocation_flushes_magazines_when_short() {
    let pool = SlotPool::new(100);
    let mut a = [0u32; 100];
    pool.alloc(&mut a).unwrap();
    pool.free(&a[10..40]).unwrap(); // 30 in this thread's magazine
    std::thread::scope(|s| {
        s.spawn(|| pool.free(&a[60..70]).unwrap()); // 10 in another thread's magazine
    });
    assert_eq!(pool.available(), 40);
    let mut b = [0u32; 41];
    let e = pool.alloc(&mut b).unwrap_err();
    assert_eq!((e.requested, e.available), (41, 40));
    // the failed allocation emptied the magazines into the bitmap: lowest first now
    let mut c = [0u32; 35];
    pool.alloc(&mut c).unwrap();
    assert_eq!(c.to_vec(), (11..=40).chain(61..=65).collect::<Vec<u32>>());
    pool.check_invariants().unwrap();
}

#[test]
fn free_errors_change_nothing() {
    let pool = SlotPool::new(100);
    let mut a = [0u32; 10];
    pool.alloc(&mut a).unwrap();
    let e = pool.free(&[1, 2, 0]).unwrap_err();
    assert_eq!(e.index, 0);
    assert!(!e.rest_freed);
    let e = pool.free(&[1, 101]).unwrap_err();
    assert_eq!(e.kind, FreeErrorKind::OutOfRange { first: 1, last: 100 });
    let e = pool.free(&[1, 50]).unwrap_err();
    assert_eq!((e.index, e.kind), (50, FreeErrorKind::NotAllocated));
    assert_eq!(pool.available(), 90);
    assert!(pool.is_allocated(1));
    pool.check_invariants().unwrap();
    pool.free(&[]).unwrap();
}

/// A batch that names an index twice is refused whole, whichever way the repeat lies:
/// inside one run, in a later run after another word (checked against the runs on
/// the stack), or past the stack's 64 runs in a batch in no order (checked with the
/// repeat marks); through a magazine, the bitmap (a batch larger than a magazine), a
/// pool without magazines and a free group.
#[test]
fn a_repeat_in_a_batch_refuses_it_whole() {
    // 100 runs alternating between words 0 and 1, then `extra`.
    let alternating = |extra: &[u32]| -> Vec<u32> {
        let mut b: Vec<u32> = (1..=50u32).flat_map(|k| [k, 64 + k]).collect();
        b.extend_from_slice(extra);
        b
    };
    let cases: Vec<(Vec<u32>, u32)> = vec![
        (vec![3, 3], 3),
        (vec![5, 6, 5], 5),
        (vec![7, 150, 7], 7),
        (vec![150, 7, 150], 150),
        (alternating(&[3]), 3),
        (alternating(&[200, 64 + 50]), 114),
        ((1..=300u32).rev().chain([17]).collect(), 17),
        ((1..=1200u32).chain([600]).collect(), 600),
    ];
    for (name, make) in [
        ("magazines", SlotPool::new as fn(u32) -> SlotPool),
        ("small magazines", |c| SlotPool::with_magazines(c, 8)),
        ("no magazines", SlotPool::without_magazines),
    ] {
        for (batch, repeated) in &cases {
            for grouped in [false, true] {
                let pool = make(2000);
                let mut all = vec![0u32; 2000];
                pool.alloc(&mut all).unwrap();
                let e = if grouped {
                    let mut g = pool.free_group();
                    let e = g.free(batch).unwrap_err();
                    assert_eq!(g.end(), 0, "{name}: {batch:?}");
                    e
                } else {
                    pool.free(batch).unwrap_err()
                };
                let what = format!("{name}, grouped {grouped}: {e:?} for {batch:?}");
                assert_eq!((e.index, e.kind, e.rest_freed), (*repeated, FreeErrorKind::NotAllocated, false), "{what}");
                assert_eq!(pool.available(), 0, "{what}");
                assert!(batch.iter().all(|&i| pool.is_allocated(i)), "{what}");
                pool.check_invariants().unwrap();
                // The same batch without its repeats frees.
                let mut distinct = Vec::new();
                for &i in batch {
                    if !distinct.contains(&i) {
                        distinct.push(i);
                    }
                }
                pool.free(&distinct).unwrap();
                assert_eq!(pool.available(), distinct.len(), "{what}");
                pool.check_invariants().unwrap();
            }
        }
    }
}

/// Threads free batches in no order (past the stack's 64 runs, so the repeat marks do
/// the check) into words the other threads' batches share, some with a repeat. Each
/// refused batch must leave every one of its indices allocated (another thread's marks
/// in the same words must neither refuse it nor be cleared by it); each accepted one
/// frees exactly its indices; at the end every index is free and no mark is left.
#[test]
fn concurrent_frees_in_no_order_keep_the_repeat_check_exact() {
    const THREADS: usize = 4;
    const BATCH: usize = 160;
    for pool in [SlotPool::new(4096), SlotPool::without_magazines(4096)] {
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let pool = &pool;
                s.spawn(move || {
                    let mut rng = Rng(0x5EED_0000 + t as u64);
                    let mut batch = vec![0u32; BATCH];
                    for round in 0..300 {
                        pool.alloc(&mut batch).unwrap();
                        for i in (1..BATCH).rev() {
                            batch.swap(i, rng.below(i as u64 + 1) as usize);
                        }
                        if round % 3 == 0 {
                            let mut repeated = batch.clone();
                            let at = rng.below(BATCH as u64) as usize;
                            repeated.push(batch[at]);
                            let e = pool.free(&repeated).unwrap_err();
                            assert_eq!((e.index, e.rest_freed), (batch[at], false), "thread {t} round {round}");
                            assert!(batch.iter().all(|&i| pool.is_allocated(i)), "thread {t} round {round}");
                        }
                        pool.free(&batch).unwrap();
                    }
                });
            }
        });
        assert_eq!(pool.available(), 4096);
        pool.check_invariants().unwrap();
    }
}

#[test]
fn free_group_publishes_at_end() {
    let pool = SlotPool::new(8);
    let mut a = [0u32; 8];
    pool.alloc(&mut a).unwrap();
    {
        let mut g = pool.free_group();
        g.free(&a[..3]).unwrap();
        assert!(g.free(&a[..1]).is_err()); // already freed in the group
        assert_eq!(pool.available(), 0);
        assert!(pool.alloc(&mut [0u32; 1]).is_err());
        pool.check_invariants().unwrap();
        g.free(&a[3..5]).unwrap();
        assert_eq!(g.pending(), 5);
    }
    assert_eq!(pool.available(), 5);
    pool.check_invariants().unwrap();
}

#[test]
fn clear_restores_everything() {
    let mut pool = SlotPool::new(130);
    let mut a = [0u32; 100];
    pool.alloc(&mut a).unwrap();
    pool.clear();
    assert_eq!(pool.available(), 130);
    let mut b = [0u32; 130];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b[129], 130);
}

#[test]
fn zero_capacity_pool() {
    let pool = SlotPool::new(0);
    assert!(pool.alloc(&mut [0u32; 1]).is_err());
    pool.alloc(&mut []).unwrap();
    assert!(pool.free(&[1]).is_err());
    pool.check_invariants().unwrap();
}

#[test]
fn lowest_bits_picks_lowest() {
    assert_eq!(lowest_bits(0b1011_0110, 3), 0b0001_0110);
    assert_eq!(lowest_bits(u64::MAX, 64), u64::MAX);
}

/// A small deterministic generator (xorshift64*), so the randomized tests below need no
/// dependency and fail the same way every run.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random allocs and frees — runs of consecutive indices, scattered ones, duplicates,
/// freed and out-of-range ones, batches with more runs than the stack buffer holds —
/// against a sorted-set model: lowest-first order but for the placement of large
/// claims (`placement`), the error and its index, and that a refused free
/// changes nothing.
#[test]
fn free_paths_match_a_sequential_model() {
    use std::collections::BTreeSet;
    for (seed, cap) in [(1u64, 200u32), (2, 64 * 80 + 7), (3, 1000), (4, 63)] {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // The bitmap's free paths, lowest-first: no magazines (the magazine paths have
        // their own model in tests/slot_model.rs).
        let pool = SlotPool::without_magazines(cap);
        let mut free: BTreeSet<u32> = (1..=cap).collect();
        let mut held: Vec<u32> = Vec::new();
        for step in 0..3000 {
            if rng.below(2) == 0 {
                let n = match rng.below(4) {
                    0 => rng.below(3) as usize,
                    1 => rng.below(70) as usize,
                    _ => rng.below(cap as u64 / 3 + 1) as usize,
                };
                let mut out = vec![0u32; n];
                match pool.alloc(&mut out) {
                    Ok(()) => {
                        let want = placement(free.iter().copied(), n);
                        assert_eq!(out, want, "seed {seed} step {step}: not the lowest free, ascending");
                        for i in &out {
                            free.remove(i);
                        }
                        held.extend_from_slice(&out);
                    }
                    Err(e) => {
                        assert!(n > free.len(), "seed {seed} step {step}: refused with {} free", free.len());
                        assert_eq!((e.requested, e.available), (n, free.len()));
                    }
                }
            } else {
                // A batch: a sorted run of held indices (what lowest-first hands out), or a
                // shuffled pick, sometimes with a bad index or a duplicate mixed in.
                let mut batch: Vec<u32> = Vec::new();
                if !held.is_empty() {
                    let k = rng.below(held.len() as u64 + 1) as usize;
                    if rng.below(2) == 0 {
                        held.sort_unstable();
                        let at = rng.below((held.len() - k) as u64 + 1) as usize;
                        batch.extend_from_slice(&held[at..at + k]);
                    } else {
                        for _ in 0..k.min(300) {
                            batch.push(held[rng.below(held.len() as u64) as usize]);
                        }
                        batch.sort_unstable();
                        batch.dedup();
                        if rng.below(2) == 0 {
                            // In no order: runs come back to earlier words (past the
                            // stack buffer's 64 runs too).
                            for i in (1..batch.len()).rev() {
                                batch.swap(i, rng.below(i as u64 + 1) as usize);
                            }
                        }
                    }
                }
                let bad = match rng.below(8) {
                    0 => Some(0),
                    1 => Some(cap + 1 + rng.below(3) as u32),
                    2 => free.iter().next().copied(),
                    3 if !batch.is_empty() => Some(batch[rng.below(batch.len() as u64) as usize]),
                    _ => None,
                };
                if let Some(b) = bad {
                    let at = rng.below(batch.len() as u64 + 1) as usize;
                    batch.insert(at, b);
                }
                let first_bad = batch.iter().copied().find(|i| *i == 0 || *i > cap || free.contains(i));
                let before = pool.available();
                match (pool.free(&batch), first_bad) {
                    (Ok(()), None) => {
                        for i in &batch {
                            assert!(free.insert(*i));
                        }
                        held.retain(|i| !free.contains(i));
                    }
                    (Err(e), Some(i)) => {
                        assert_eq!(e.index, i, "seed {seed} step {step}: {batch:?}");
                        let kind = if i == 0 || i > cap {
                            FreeErrorKind::OutOfRange { first: 1, last: cap }
                        } else {
                            FreeErrorKind::NotAllocated
                        };
                        assert_eq!((e.kind, e.rest_freed), (kind, false));
                        assert_eq!(pool.available(), before, "a refused free changed the count");
                    }
                    (Err(e), None) => {
                        // Every index valid, one repeated: refused whole, the repeat named.
                        assert_eq!((e.kind, e.rest_freed), (FreeErrorKind::NotAllocated, false), "{batch:?}");
                        assert!(batch.iter().filter(|&&i| i == e.index).count() > 1, "{e:?} {batch:?}");
                        assert_eq!(pool.available(), before, "a refused free changed the count");
                    }
                    (Ok(()), Some(i)) => panic!("seed {seed} step {step}: freed {batch:?} despite {i}"),
                }
            }
            assert_eq!(pool.available(), free.len());
            for i in [1, cap / 2, cap] {
                if i >= 1 {
                    assert_eq!(pool.is_allocated(i), !free.contains(&i));
                }
            }
        }
        pool.check_invariants().unwrap();
    }
}

/// Threads allocate and free random batches for a while; an owner table with one atomic
/// per index catches an index handed to two threads at once. Then every index is back,
/// the counts are exact, and a batch freed by one thread can be allocated by another
/// (the shards' counts are swept to where they are needed).
#[test]
#[cfg_attr(
    feature = "debug-invariants",
    ignore = "debug-invariants checks after every operation, which is exact only single-threaded"
)]
fn threads_never_share_an_index_and_counts_come_back() {
    use std::sync::atomic::{AtomicU32 as StdU32, Ordering as O};
    const CAP: u32 = 4096 + 33;
    const THREADS: u32 = 4;
    let rounds = if cfg!(miri) { 20 } else { 3000 };
    let pool = SlotPool::new(CAP);
    let owner: Vec<StdU32> = (0..=CAP).map(|_| StdU32::new(0)).collect();
    std::thread::scope(|s| {
        for t in 1..=THREADS {
            let (pool, owner) = (&pool, &owner);
            s.spawn(move || {
                let mut rng = Rng(0xA5A5_0000 + t as u64);
                let mut buf = vec![0u32; 700];
                for _ in 0..rounds {
                    let n = [1, 7, 64, 300, 700][rng.below(5) as usize];
                    let got = &mut buf[..n];
                    if pool.alloc(got).is_err() {
                        continue;
                    }
                    for &i in got.iter() {
                        assert_eq!(owner[i as usize].swap(t, O::Relaxed), 0, "index {i} had an owner");
                    }
                    for &i in got.iter() {
                        assert_eq!(owner[i as usize].swap(0, O::Relaxed), t, "index {i} was taken over");
                    }
                    pool.free(got).unwrap();
                }
            });
        }
    });
    assert_eq!(pool.available(), CAP as usize);
    pool.check_invariants().unwrap();
    // This thread holds everything, another thread frees it all (into its own shard),
    // and this thread can allocate it all again.
    let mut all = vec![0u32; CAP as usize];
    pool.alloc(&mut all).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| pool.free(&all).unwrap());
    });
    pool.alloc(&mut all).unwrap();
    assert_eq!(pool.available(), 0);
    // Small batches freed by other threads sit in their magazines; this thread still
    // gets all of them (the allocation flushes the magazines).
    std::thread::scope(|s| {
        let pool = &pool;
        for part in all.chunks(700).take(4) {
            s.spawn(move || pool.free(part).unwrap());
        }
    });
    pool.free(&all[2800..]).unwrap();
    assert_eq!(pool.available(), CAP as usize);
    pool.alloc(&mut all).unwrap();
    pool.free(&all).unwrap();
    pool.check_invariants().unwrap();
}

/// A magazine free with more runs than the stack buffer holds (indices alternating
/// between two words: every index is a run), with and without a repeat.
#[test]
fn magazine_free_with_many_runs() {
    let pool = SlotPool::new(2000);
    let mut all = vec![0u32; 2000];
    pool.alloc(&mut all).unwrap();
    let batch: Vec<u32> = (1..=50u32).flat_map(|k| [k, 64 + k]).collect(); // 100 runs
    pool.free(&batch).unwrap();
    let mut got = vec![0u32; 100];
    pool.alloc(&mut got).unwrap();
    assert_eq!(got, batch, "pushed and popped in batch order");
    let mut with_repeat = batch.clone();
    with_repeat.push(3);
    let e = pool.free(&with_repeat).unwrap_err();
    assert_eq!((e.index, e.kind, e.rest_freed), (3, FreeErrorKind::NotAllocated, false));
    assert_eq!(pool.available(), 0, "refused whole");
    pool.free(&batch).unwrap();
    pool.alloc(&mut got).unwrap();
    assert_eq!(got, batch, "each index pushed once");
    pool.check_invariants().unwrap();
}

/// The summary of non-empty words: exact after single-threaded frees and claims (checked
/// by `check_invariants`), and only a hint for the scan: a claim still finds free bits
/// in a word whose summary bit is (wrongly) clear, by its fallback pass over every word.
#[test]
fn summary_is_exact_and_only_a_hint() {
    let pool = SlotPool::without_magazines(64 * 300);
    let mut all = vec![0u32; 64 * 300];
    pool.alloc(&mut all).unwrap();
    pool.check_invariants().unwrap();
    // Scattered frees: one index in every third word.
    let scattered: Vec<u32> = (0..300).step_by(3).map(|w| w * 64 + 5).collect();
    pool.free(&scattered).unwrap();
    pool.check_invariants().unwrap();
    let mut got = vec![0u32; scattered.len() - 10];
    pool.alloc(&mut got).unwrap();
    assert_eq!(got, scattered[..got.len()], "lowest first");
    pool.check_invariants().unwrap();
    // Hide the remaining free words from the summary: the invariant check sees it, and
    // a claim still finds them all.
    for sw in pool.summary.iter() {
        sw.store(0, Ordering::Relaxed);
    }
    let e = pool.check_invariants().unwrap_err();
    assert!(e.0.contains("no summary bit"), "{e}");
    let mut rest = vec![0u32; 10];
    pool.alloc(&mut rest).unwrap();
    assert_eq!(rest, scattered[scattered.len() - 10..]);
    assert_eq!(pool.available(), 0);
}

/// A large claim takes whole words with `swap(0)`: full words, a partly free last
/// word, and (in its second pass, see "Placement") a sparse word it passed over at
/// first, it needs only part of, all counted exactly.
#[test]
fn large_claims_take_whole_words_lowest_first() {
    let pool = SlotPool::without_magazines(400);
    let mut all = vec![0u32; 400];
    pool.alloc(&mut all).unwrap();
    // Word 0: every third index; words 1-3 entirely; word 4: 257..=300.
    let mut freed: Vec<u32> = (1..=64).filter(|i| i % 3 == 0).collect();
    freed.extend(65..=300);
    pool.free(&freed).unwrap();
    let mut got = vec![0u32; freed.len() - 10];
    pool.alloc(&mut got).unwrap();
    // Words 1-4 first, then word 0's lowest (it is sparse: isolated bits).
    let (sparse_word, dense) = freed.split_at(21);
    assert_eq!(got[..dense.len()], dense[..]);
    assert_eq!(got[dense.len()..], sparse_word[..11]);
    assert_eq!(pool.available(), 10);
    let mut rest = [0u32; 10];
    pool.alloc(&mut rest).unwrap();
    assert_eq!(rest[..], sparse_word[11..]);
    assert!(pool.alloc(&mut [0u32; 1]).is_err());
    pool.check_invariants().unwrap();
}

/// Placement: a claim that needs a whole word or more passes over words whose free
/// bits are isolated (what interleaved one-slot frees leave) and takes whole free
/// words instead; smaller claims then take those bits, lowest first.
#[test]
fn large_claims_leave_scattered_free_bits_to_small_ones() {
    let pool = SlotPool::without_magazines(256);
    let mut all = [0u32; 256];
    pool.alloc(&mut all).unwrap();
    // Word 0: every 8th index free (isolated bits); word 2 (129..=192) wholly free.
    let scattered: Vec<u32> = (1..=64).step_by(8).collect();
    pool.free(&scattered).unwrap();
    pool.free(&(129..=192).collect::<Vec<u32>>()).unwrap();
    let mut big = [0u32; 64];
    pool.alloc(&mut big).unwrap();
    assert_eq!(big.to_vec(), (129..=192).collect::<Vec<u32>>(), "one run, not the scattered bits");
    let mut small = [0u32; 3];
    pool.alloc(&mut small).unwrap();
    assert_eq!(small, [1, 9, 17], "the scattered bits go to small claims, lowest first");
    pool.check_invariants().unwrap();
}

/// Placement never costs an allocation: when only scattered bits are free, a large
/// claim takes them; a run that starts at a word's top bits or ends at its bottom
/// bits is not scattered.
#[test]
fn large_claims_take_scattered_bits_when_nothing_else_is_free() {
    let pool = SlotPool::without_magazines(256);
    let mut all = [0u32; 256];
    pool.alloc(&mut all).unwrap();
    let scattered: Vec<u32> = (1..=256).step_by(4).collect();
    pool.free(&scattered).unwrap();
    let mut big = [0u32; 64];
    pool.alloc(&mut big).unwrap();
    assert_eq!(big.to_vec(), scattered);
    assert_eq!(pool.available(), 0);

    // Free the top 4 bits of word 0 and all of word 1: one run of 68, which a claim
    // of 68 takes whole (the edge stretch is not judged scattered).
    pool.free(&(61..=128).collect::<Vec<u32>>()).unwrap();
    let mut run = [0u32; 68];
    pool.alloc(&mut run).unwrap();
    assert_eq!(run.to_vec(), (61..=128).collect::<Vec<u32>>());
    pool.check_invariants().unwrap();
}

#[test]
fn sparse_words_are_those_of_short_inner_stretches() {
    assert!(!sparse(u64::MAX));
    assert!(!sparse(0xF << 60), "a top stretch may go on in the next word");
    assert!(!sparse(0x7), "a bottom stretch may go on from the word before");
    assert!(!sparse(0xFFFF << 20), "an inner stretch of 16");
    assert!(!sparse(0xFF << 20), "an inner stretch of 8");
    assert!(sparse(0x7F << 20), "an inner stretch of 7");
    assert!(sparse(0x0101_0101_0101_0100), "isolated bits");
    assert!(sparse(0x7 | 0x1 << 30 | 0xF << 60), "edges are not judged, the inner bit is");
}

#[test]
fn owned_batches_need_magazines_and_their_own_pool() {
    let mut s = Slots::with_capacity(4);
    for pool in [SlotPool::without_magazines(10), SlotPool::with_parking(1024)] {
        assert_eq!(pool.alloc_slots(1, &mut s), Err(SlotsError::Unsupported));
        assert!(s.is_empty() && pool.available() == pool.capacity() as usize);
    }
    let (a, b) = (SlotPool::new(10), SlotPool::new(10));
    a.alloc_slots(2, &mut s).unwrap();
    assert_eq!(b.alloc_slots(1, &mut s), Err(SlotsError::OtherPool));
    assert_eq!(b.free_slots(&mut s), Err(SlotsError::OtherPool));
    assert_eq!((s.as_slice(), a.available(), b.available()), (&[1, 2][..], 8, 10));
    // A batch bigger than the runs magazine takes: from the bitmap and back to it.
    let big = SlotPool::with_magazines(300, 1);
    let mut t = Slots::with_capacity(300);
    big.alloc_slots(100, &mut t).unwrap();
    assert_eq!(t.runs().collect::<Vec<_>>(), vec![1..=100]);
    assert_eq!(big.free_slots(&mut t), Ok(100));
    big.check_invariants().unwrap();
    big.alloc_slots(300, &mut t).unwrap();
    assert!(t.iter().copied().eq(1..=300));
    assert!(
        matches!(big.alloc_slots(1, &mut Slots::with_capacity(1)), Err(SlotsError::OutOfMemory(e)) if e.available == 0)
    );
    assert_eq!(big.free_slots(&mut t), Ok(300));
    assert_eq!(big.available(), 300);
    big.check_invariants().unwrap();
}

#[test]
fn an_allocation_short_of_indices_takes_them_from_the_runs_magazines() {
    let pool = SlotPool::new(100);
    let mut s = Slots::with_capacity(100);
    pool.alloc_slots(60, &mut s).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| pool.free_slots(&mut s).unwrap());
    });
    // The 60 sit in the other thread's runs magazine; this thread needs 100.
    let mut all = [0u32; 100];
    pool.alloc(&mut all).unwrap();
    assert_eq!(pool.available(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn a_cache_over_an_arc_moves_to_another_thread_with_its_stock() {
    use std::sync::Arc;
    let pool = Arc::new(SlotPool::new(1000));
    let mut cache = SlotCache::new(Arc::clone(&pool), 64).unwrap();
    let mut s = Slots::with_capacity(100);
    cache.alloc_slots(10, &mut s).unwrap();
    assert_eq!((cache.len(), pool.available()), (32, 958));
    let mut s = std::thread::spawn(move || {
        // The stock came along: these 20 come off it, nothing from the pool.
        cache.alloc_slots(20, &mut s).unwrap();
        assert_eq!(cache.len(), 12);
        cache.free_slots_tail(&mut s, 5).unwrap();
        assert_eq!(cache.len(), 17);
        s
    })
    .join()
    .unwrap();
    // The cache was dropped on the other thread: its stock is back.
    assert_eq!((s.len(), pool.available()), (25, 975));
    assert_eq!(pool.free_slots(&mut s), Ok(25));
    assert_eq!(pool.available(), 1000);
    pool.check_invariants().unwrap();
}

#[test]
fn a_cache_whose_pointer_goes_astray_refuses_everything_and_keeps_its_stock() {
    /// A pointer that derefs to whichever of two pools `at` says.
    struct Astray<'a>(&'a [SlotPool; 2], &'a core::cell::Cell<usize>);
    impl core::ops::Deref for Astray<'_> {
        type Target = SlotPool;
        fn deref(&self) -> &SlotPool {
            &self.0[self.1.get()]
        }
    }
    let pools = [SlotPool::new(100), SlotPool::new(100)];
    let at = core::cell::Cell::new(0);
    let mut cache = SlotCache::new(Astray(&pools, &at), 16).unwrap();
    let mut s = Slots::with_capacity(50);
    cache.alloc_slots(4, &mut s).unwrap();
    assert_eq!((cache.len(), pools[0].available()), (8, 88));
    at.set(1);
    let mut fresh = Slots::with_capacity(8);
    assert_eq!(cache.alloc_slots(1, &mut fresh), Err(SlotsError::OtherPool));
    assert_eq!(cache.free_slots(&mut s), Err(SlotsError::OtherPool));
    assert_eq!(cache.free_slots_tail(&mut s, 1), Err(SlotsError::OtherPool));
    assert_eq!(cache.flush(), 0);
    assert_eq!((s.len(), cache.len(), fresh.len()), (4, 8, 0));
    assert_eq!((pools[0].available(), pools[1].available()), (88, 100));
    at.set(0);
    assert_eq!(cache.free_slots(&mut s), Ok(4));
    drop(cache);
    assert_eq!(pools[0].available(), 100);
    pools[0].check_invariants().unwrap();
    pools[1].check_invariants().unwrap();
}

#[test]
fn a_cache_of_capacity_zero_passes_everything_through() {
    let pool = SlotPool::new(64);
    let mut cache = SlotCache::new(&pool, 0).unwrap();
    let mut s = Slots::with_capacity(64);
    cache.alloc_slots(10, &mut s).unwrap();
    assert_eq!((cache.len(), pool.available(), s.as_slice()), (0, 54, &(1..=10).collect::<Vec<_>>()[..]));
    assert!(pool.free(&[3]).is_err());
    assert_eq!(cache.free_slots(&mut s), Ok(10));
    assert_eq!((cache.len(), pool.available()), (0, 64));
    assert!(matches!(cache.alloc_slots(65, &mut Slots::with_capacity(65)),
        Err(SlotsError::OutOfMemory(e)) if e.requested == 65 && e.available == 64));
    drop(cache);
    pool.check_invariants().unwrap();
}

#[test]
fn a_cache_is_no_larger_than_its_pool() {
    let pool = SlotPool::new(64);
    let mut cache = SlotCache::new(&pool, usize::MAX).unwrap();
    assert_eq!(cache.capacity(), 64);
    let mut s = Slots::with_capacity(64);
    cache.alloc_slots(64, &mut s).unwrap();
    assert_eq!(cache.free_slots(&mut s), Ok(64));
    assert_eq!((cache.len(), pool.available(), cache.available()), (64, 0, 64));
}

#[test]
fn a_cache_needs_a_pool_with_magazines() {
    let pool = SlotPool::without_magazines(64);
    assert_eq!(SlotCache::new(&pool, 8).map(|_| ()), Err(SlotsError::Unsupported));
}
