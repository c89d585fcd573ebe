//! Zero heap allocations in the sliding-window radix cache's hot paths, through the
//! request handle: admissions (matching and locking, with splits), extends evicting each
//! pool's shortfall (the full pass and the window pass), `release_window`, checkpoints
//! and finishes (tombstone segments for released window KV, revivals), aborts, and
//! `peek_prefix`, `evict_swa`, `evict_both`. The counting global allocator of
//! `tests/alloc_common` counts this thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use alloc_common::allocations;
use std::sync::Arc;

use kvpool::alloc::SwaAllocator;
use kvpool::radix::{EvictionPolicy, RadixConfig, SwaRadixCache};
use kvpool::ReqToTokenPool;

#[test]
fn the_counter_counts() {
    assert_eq!(allocations(|| drop(std::hint::black_box(vec![1u8; 10]))).0, 1);
}

/// One request's life: admit (matching and locking), extend by the rest (evicting),
/// release the window KV of its first `released` tokens, checkpoint a chunk, finish.
/// Returns the window tokens released (for the caller to check that the path was taken).
fn serve(cache: &Arc<SwaRadixCache>, key: &[u32], released: usize, hit: &mut [u32]) -> usize {
    let ps = cache.page_size();
    let mut r = cache.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    let freed = r.release_window(0..released).unwrap();
    let _ = cache.peek_prefix(0, key, hit);
    let chunk = (key.len() / 2) / ps * ps;
    r.checkpoint(&key[..chunk]).unwrap();
    r.finish(key).unwrap();
    freed
}

fn exercise(ps: u32) {
    let ps_us = ps as usize;
    // 48 full pages, 20 window pages, a window of 3 pages: both passes run.
    let cache = Arc::new(
        SwaRadixCache::with_window(
            SwaAllocator::new(48 * ps_us, 20 * ps_us, ps).unwrap(),
            ReqToTokenPool::new(2, 64 * ps_us).unwrap(),
            RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() },
            3 * ps_us,
        )
        .unwrap(),
    );
    let base: Vec<u32> = (0..12 * ps).collect();
    let mut keys = Vec::new();
    for k in 0..4u32 {
        let mut key = base.clone();
        // Each key diverges from the base after a different number of pages: splits.
        for t in &mut key[((3 + 2 * k) * ps) as usize..] {
            *t += 1000 * (k + 1);
        }
        keys.push(key);
    }
    let mut hit = vec![0u32; 12 * ps_us];
    let (n, (released, tombstoned, window_evicted)) = allocations(|| {
        let (mut released, mut tombstoned, mut window_evicted) = (0, false, 0);
        for round in 0..3 {
            for (i, key) in keys.iter().enumerate() {
                released += serve(&cache, key, (4 + i + round) * ps_us, &mut hit);
                tombstoned |= cache.tombstone_size() > 0;
            }
            window_evicted += cache.evict_swa(2 * ps_us);
            cache.evict_both(ps_us, 4 * ps_us);
            // A request that matches, locks and is dropped (aborted) at once.
            let r = cache.admit(0, &keys[round]).unwrap();
            let _ = cache.peek_prefix(0, &keys[round], &mut hit);
            drop(r);
        }
        (released, tombstoned, window_evicted)
    });
    assert_eq!(n, 0, "allocations in the SWA cache's hot paths (page size {ps})");
    assert!(released > 0, "release_window freed nothing");
    assert!(tombstoned, "no tombstone was made");
    assert!(window_evicted > 0, "the window pass freed nothing");
    cache.check_invariants().unwrap();

    // A request with no cached prefix allocating under both pools' pressure, aborted;
    // then a full eviction.
    let (n, ()) = allocations(|| {
        let mut r = cache.admit(0, &[]).unwrap();
        r.extend(16 * ps_us).unwrap();
        r.abort();
        cache.evict_both(usize::MAX, usize::MAX);
    });
    assert_eq!(n, 0, "allocations in extend / abort / evict_both (page size {ps})");
    assert_eq!(cache.total_size(), 0);
    cache.check_invariants().unwrap();
}

#[test]
fn swa_hot_paths_do_not_allocate() {
    for ps in [1, 4] {
        exercise(ps);
    }
}
