#![cfg(not(loom))]
//! `SlotPool` against the sequential reference model (`kvpool::models`), plus its
//! edge cases: word boundaries, double and out-of-range frees, duplicates inside a
//! batch, free groups, `clear`.

use kvpool::models::{
    ops_from_bytes, run_slot_pool, run_slot_pool_with_magazines, run_slot_pool_without_magazines, AllocModel, Stats,
};
use kvpool::{FreeError, FreeErrorKind, OutOfMemory, SlotPool, Unit};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };
const MAX_BYTES: usize = 2048;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Capacities around the 64-bit word boundaries, where the bitmap logic changes.
    #[test]
    fn slot_pool_matches_model_at_word_boundaries(
        capacity in prop::sample::select(vec![0u32, 1, 2, 3, 63, 64, 65, 66, 127, 128, 129, 200]),
        bytes in vec(any::<u8>(), 0..MAX_BYTES),
    ) {
        run_slot_pool(&ops_from_bytes(&bytes), capacity).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn slot_pool_matches_model_any_capacity(capacity in 0u32..300, bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_slot_pool(&ops_from_bytes(&bytes), capacity).map_err(TestCaseError::fail)?;
    }

    /// Small magazines: batches larger than the magazine (to the bitmap), frees that
    /// do not fit on top (the magazine is flushed first), pops that find too few, and
    /// double, duplicate and forged frees of indices sitting in the magazine.
    #[test]
    fn slot_pool_with_small_magazines_matches_model(
        capacity in 0u32..300,
        entries in 1usize..40,
        bytes in vec(any::<u8>(), 0..MAX_BYTES),
    ) {
        run_slot_pool_with_magazines(&ops_from_bytes(&bytes), capacity, entries).map_err(TestCaseError::fail)?;
    }

    /// No magazines: lowest free first, always.
    #[test]
    fn slot_pool_without_magazines_matches_model(capacity in 0u32..300, bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_slot_pool_without_magazines(&ops_from_bytes(&bytes), capacity).map_err(TestCaseError::fail)?;
    }
}

/// The op mix reaches every outcome on a bare pool too.
#[test]
fn op_mix_reaches_every_outcome() {
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut stats = Stats::default();
    for _ in 0..200 {
        let bytes: Vec<u8> = (0..1500)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect();
        stats.merge(&run_slot_pool(&ops_from_bytes(&bytes), 66).unwrap());
        stats.merge(&run_slot_pool_with_magazines(&ops_from_bytes(&bytes), 66, 5).unwrap());
    }
    for outcome in [
        "alloc: ok",
        "alloc: ok, empty",
        "alloc: out of memory",
        "alloc_one: ok",
        "alloc_one: out of memory",
        "free: ok",
        "free: not allocated",
        "free: out of range",
        "free: duplicate in batch",
        "group free: ok",
        "group free: duplicate in batch",
        "group end: published",
        "clear: ok",
    ] {
        assert!(stats.get(outcome) > 0, "never saw {outcome:?}: {stats:?}");
    }
}

fn oom(requested: usize, available: usize) -> OutOfMemory {
    OutOfMemory { requested, available, evictable: None, unit: Unit::Indices }
}

#[test]
fn ascending_across_words() {
    let pool = SlotPool::new(130);
    let mut a = [0u32; 63];
    pool.alloc(&mut a).unwrap();
    let mut b = [0u32; 3]; // spans words 0 and 1
    pool.alloc(&mut b).unwrap();
    assert_eq!(b, [64, 65, 66]);
    let mut rest = [0u32; 64];
    pool.alloc(&mut rest).unwrap();
    assert_eq!(rest.to_vec(), (67..=130).collect::<Vec<u32>>());
    assert_eq!(pool.alloc(&mut [0u32; 1]), Err(oom(1, 0)));
    pool.check_invariants().unwrap();
}

#[test]
fn lowest_first_after_scattered_frees() {
    let pool = SlotPool::new(200);
    let mut all = [0u32; 200];
    pool.alloc(&mut all).unwrap();
    pool.free(&[190, 3, 64, 65, 129]).unwrap();
    let mut got = [0u32; 4];
    pool.alloc(&mut got).unwrap();
    assert_eq!(got, [3, 64, 65, 129]);
    assert_eq!(pool.alloc_one().unwrap(), 190);
}

#[test]
fn exact_capacity_and_one_over() {
    for capacity in [1u32, 64, 65] {
        let pool = SlotPool::new(capacity);
        let mut over = vec![0u32; capacity as usize + 1];
        assert_eq!(pool.alloc(&mut over), Err(oom(capacity as usize + 1, capacity as usize)));
        assert!(over.iter().all(|&x| x == 0), "a refused alloc wrote its buffer");
        let mut all = vec![0u32; capacity as usize];
        pool.alloc(&mut all).unwrap();
        assert_eq!(all, (1..=capacity).collect::<Vec<u32>>());
        pool.alloc(&mut []).unwrap(); // size 0 on a full pool
        assert_eq!(pool.alloc_one(), Err(oom(1, 0)));
    }
}

#[test]
fn free_validation_is_all_or_nothing() {
    let pool = SlotPool::new(70);
    let mut a = [0u32; 70];
    pool.alloc(&mut a).unwrap();
    pool.free(&[10]).unwrap();
    let range = FreeErrorKind::OutOfRange { first: 1, last: 70 };
    // the bad index is last: nothing before it may be freed
    assert_eq!(pool.free(&[1, 2, 0]), Err(FreeError { index: 0, kind: range, rest_freed: false }));
    assert_eq!(pool.free(&[1, 2, 71]), Err(FreeError { index: 71, kind: range, rest_freed: false }));
    assert_eq!(pool.free(&[1, 2, u32::MAX]), Err(FreeError { index: u32::MAX, kind: range, rest_freed: false }));
    let not = FreeErrorKind::NotAllocated;
    assert_eq!(pool.free(&[1, 66, 10]), Err(FreeError { index: 10, kind: not, rest_freed: false }));
    assert_eq!(pool.available(), 1);
    assert!(pool.is_allocated(1) && pool.is_allocated(2) && pool.is_allocated(66));
    pool.free(&[]).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn duplicate_in_batch_is_refused_whole() {
    let pool = SlotPool::new(130);
    let mut a = [0u32; 130];
    pool.alloc(&mut a).unwrap();
    for batch in [&[5u32, 5][..], &[6, 100, 6], &[7, 129, 129, 8]] {
        let e = pool.free(batch).unwrap_err();
        assert_eq!(e.kind, FreeErrorKind::NotAllocated);
        assert!(!e.rest_freed);
        assert!(batch.iter().filter(|&&x| x == e.index).count() == 2, "{e:?} names no duplicate of {batch:?}");
        assert_eq!(pool.available(), 0, "{batch:?} freed something");
        assert!(batch.iter().all(|&i| pool.is_allocated(i)));
        pool.check_invariants().unwrap();
    }
    // and the model agrees
    let mut m = AllocModel::slot_pool(130);
    m.alloc(130).unwrap();
    for batch in [&[5u32, 5][..], &[6, 100, 6], &[7, 129, 129, 8]] {
        let e = m.free(batch).unwrap_err();
        assert!(!e.rest_freed && e.kind == FreeErrorKind::NotAllocated);
    }
    assert_eq!(m.available(), pool.available());
}

#[test]
fn free_group_counts_only_at_end() {
    let pool = SlotPool::new(66);
    let mut a = [0u32; 66];
    pool.alloc(&mut a).unwrap();
    let mut g = pool.free_group();
    g.free(&[1, 65]).unwrap(); // both words
    g.free(&[66]).unwrap();
    assert_eq!(g.pending(), 3);
    assert_eq!(pool.available(), 0);
    assert_eq!(pool.alloc_one(), Err(oom(1, 0)));
    assert!(!pool.is_allocated(65)); // the bits are free, just not counted
    pool.check_invariants().unwrap();
    let e = g.free(&[65]).unwrap_err();
    assert_eq!((e.index, e.kind, e.rest_freed), (65, FreeErrorKind::NotAllocated, false));
    assert_eq!(g.end(), 3);
    assert_eq!(pool.available(), 3);
    let mut b = [0u32; 3];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b, [1, 65, 66]);
}

#[test]
fn dropping_a_group_publishes_it() {
    let pool = SlotPool::new(4);
    let mut a = [0u32; 4];
    pool.alloc(&mut a).unwrap();
    {
        let mut g = pool.free_group();
        g.free(&a).unwrap();
    }
    assert_eq!(pool.available(), 4);
    pool.check_invariants().unwrap();
}

#[test]
fn clear_makes_the_pool_fresh() {
    let mut pool = SlotPool::new(100);
    let mut a = [0u32; 77];
    pool.alloc(&mut a).unwrap();
    pool.free(&a[..10]).unwrap();
    pool.clear();
    assert_eq!(pool.available(), 100);
    let mut b = [0u32; 100];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b.to_vec(), (1..=100).collect::<Vec<u32>>());
}

#[test]
fn empty_pool() {
    let pool = SlotPool::new(0);
    assert_eq!(pool.capacity(), 0);
    pool.alloc(&mut []).unwrap();
    assert_eq!(pool.alloc_one(), Err(oom(1, 0)));
    assert_eq!(pool.free(&[1]).unwrap_err().kind, FreeErrorKind::OutOfRange { first: 1, last: 0 });
    assert!(!pool.is_allocated(0) && !pool.is_allocated(1));
    pool.check_invariants().unwrap();
}

/// Threads allocate, hold, and free random batches (some through free groups) at
/// full speed. Every index's owner is tracked in an atomic: claiming an index someone
/// else holds, or freeing one we do not hold, fails the test. Complements the loom
/// models with many threads and large batches.
#[test]
fn threads_never_share_an_index() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Barrier};
    const THREADS: u32 = 4;
    const ROUNDS: usize = if cfg!(miri) { 50 } else { 20_000 };
    const CAP: u32 = 300;
    let pool = Arc::new(SlotPool::new(CAP));
    let owner: Arc<Vec<AtomicU32>> = Arc::new((0..=CAP).map(|_| AtomicU32::new(0)).collect());
    let start = Arc::new(Barrier::new(THREADS as usize));
    let workers: Vec<_> = (1..=THREADS)
        .map(|t| {
            let (pool, owner, start) = (Arc::clone(&pool), Arc::clone(&owner), Arc::clone(&start));
            std::thread::spawn(move || {
                let mut rng = 0x9E37_79B9u64 * t as u64 + 1;
                let mut next = move |m: u64| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng % m
                };
                let mut buf = [0u32; 100];
                let mut oks = 0usize;
                start.wait();
                for _ in 0..ROUNDS {
                    let n = 1 + next(100) as usize;
                    let got = &mut buf[..n];
                    if pool.alloc(got).is_err() {
                        continue;
                    }
                    oks += 1;
                    for &i in got.iter() {
                        let prev = owner[i as usize].swap(t, Ordering::Relaxed);
                        assert_eq!(prev, 0, "index {i} handed to thread {t} while thread {prev} held it");
                    }
                    for &i in got.iter() {
                        let prev = owner[i as usize].swap(0, Ordering::Relaxed);
                        assert_eq!(prev, t, "index {i} changed owner while held");
                    }
                    if next(2) == 0 {
                        pool.free(got).unwrap();
                    } else {
                        let mut g = pool.free_group();
                        let half = n / 2;
                        g.free(&got[..half]).unwrap();
                        g.free(&got[half..]).unwrap();
                        assert_eq!(g.end(), n);
                    }
                }
                oks
            })
        })
        .collect();
    let oks: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(oks > 0);
    assert_eq!(pool.available(), CAP as usize);
    pool.check_invariants().unwrap();
}

/// The radix cache stores tokens by slot and wants runs: a batch freed as a run of
/// consecutive indices comes back from the magazine as the same run, ascending, and
/// two runs freed one after the other come back last first, each whole.
#[test]
fn a_freed_run_comes_back_as_a_run() {
    let pool = SlotPool::new(4096);
    let mut a = vec![0u32; 1000];
    pool.alloc(&mut a).unwrap();
    assert_eq!(a, (1..=1000).collect::<Vec<u32>>());
    for (lo, n) in [(100usize, 16usize), (300, 256), (10, 1), (0, 1000)] {
        pool.free(&a[lo..lo + n]).unwrap();
        let mut b = vec![0u32; n];
        pool.alloc(&mut b).unwrap();
        assert_eq!(b, a[lo..lo + n], "run of {n} from {}", a[lo]);
    }
    pool.free(&a[500..564]).unwrap();
    pool.free(&a[700..716]).unwrap();
    let mut b = vec![0u32; 16];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b, a[700..716]);
    let mut c = vec![0u32; 64];
    pool.alloc(&mut c).unwrap();
    assert_eq!(c, a[500..564]);
    // a batch larger than the magazine still comes from the bitmap, lowest first
    let mut big = vec![0u32; pool.magazine_capacity() + 1];
    pool.alloc(&mut big).unwrap();
    assert_eq!(big[0], 1001);
    assert!(big.windows(2).all(|w| w[1] == w[0] + 1));
    pool.check_invariants().unwrap();
}
