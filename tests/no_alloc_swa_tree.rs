//! Zero heap allocations in the sliding-window radix cache's hot paths: `match_and_lock`
//! (with splits), `peek_prefix`, `alloc` / `alloc_extend` evicting each pool's shortfall
//! (the full pass and the window pass), `release_window`, `cache_unfinished_req` and
//! `cache_finished_req` (tombstone segments for released window KV, revivals),
//! `evict_swa`, `evict_both`, and dropping a lease. The counting global allocator of
//! `tests/alloc_common` counts this thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use alloc_common::allocations;
use kvpool::alloc::SwaAllocator;
use kvpool::radix::{EvictionPolicy, RadixConfig, SwaRadixCache};
use kvpool::ReqToTokenPool;

#[test]
fn the_counter_counts() {
    assert_eq!(allocations(|| drop(std::hint::black_box(vec![1u8; 10]))).0, 1);
}

/// One request's life: match and lock, allocate the rest (evicting), release the window
/// KV of its first `released` tokens, cache a chunk, finish. Returns what the window and
/// full passes had to do (for the caller to check that the paths were taken).
fn serve(cache: &SwaRadixCache, key: &[u32], released: usize, hit: &mut [u32], new: &mut [u32]) -> usize {
    let ps = cache.page_size();
    let mut row = cache.req_pool().alloc().unwrap();
    let mut lease = cache.match_and_lock(0, key, hit);
    let h = lease.len();
    cache.req_pool().write(&mut row, 0, &hit[..h]).unwrap();
    let last = if h > 0 { hit[h - 1] } else { 0 };
    let out = &mut new[..key.len() - h];
    cache.alloc_extend(&[h as u32], &[key.len() as u32], &[last], out).unwrap();
    cache.req_pool().write(&mut row, h, out).unwrap();
    let freed = cache.release_window(&row, &lease, 0..released).unwrap();
    let _ = cache.peek_prefix(0, key, hit);
    let chunk = (key.len() / 2) / ps * ps;
    cache.cache_unfinished_req(0, &key[..chunk], &mut row, &mut lease).unwrap();
    cache.cache_finished_req(0, key, row, lease).unwrap();
    freed
}

fn exercise(ps: u32) {
    let ps_us = ps as usize;
    // 48 full pages, 20 window pages, a window of 3 pages: both passes run.
    let cache = SwaRadixCache::with_window(
        SwaAllocator::new(48 * ps_us, 20 * ps_us, ps).unwrap(),
        ReqToTokenPool::new(2, 64 * ps_us).unwrap(),
        RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() },
        3 * ps_us,
    )
    .unwrap();
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
    let mut new = vec![0u32; 12 * ps_us];
    let (n, (released, tombstoned, window_evicted)) = allocations(|| {
        let (mut released, mut tombstoned, mut window_evicted) = (0, false, 0);
        for round in 0..3 {
            for (i, key) in keys.iter().enumerate() {
                released += serve(&cache, key, (4 + i + round) * ps_us, &mut hit, &mut new);
                tombstoned |= cache.tombstone_size() > 0;
            }
            window_evicted += cache.evict_swa(2 * ps_us);
            cache.evict_both(ps_us, 4 * ps_us);
            let lease = cache.match_and_lock(0, &keys[round], &mut hit);
            let _ = cache.peek_prefix(0, &keys[round], &mut hit);
            drop(lease);
        }
        (released, tombstoned, window_evicted)
    });
    assert_eq!(n, 0, "allocations in the SWA cache's hot paths (page size {ps})");
    assert!(released > 0, "release_window freed nothing");
    assert!(tombstoned, "no tombstone was made");
    assert!(window_evicted > 0, "the window pass freed nothing");
    cache.check_invariants().unwrap();

    // Raw allocation under both pools' pressure, and a full eviction.
    let mut big = vec![0u32; 16 * ps_us];
    let (n, ()) = allocations(|| {
        cache.alloc(&mut big).unwrap();
        cache.allocator().free(&big).unwrap();
        cache.evict_both(usize::MAX, usize::MAX);
    });
    assert_eq!(n, 0, "allocations in alloc / evict_both (page size {ps})");
    assert_eq!(cache.total_size(), 0);
    cache.check_invariants().unwrap();
}

#[test]
fn swa_hot_paths_do_not_allocate() {
    for ps in [1, 4] {
        exercise(ps);
    }
}
