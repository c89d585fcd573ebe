//! Zero heap allocations in the radix cache's hot paths: match, peek, match-and-lock,
//! unlock, insert (with splits), evict, allocation with eviction, and the request
//! helpers. The counting global allocator of `tests/alloc_common` counts this thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use alloc_common::allocations;
use kvpool::radix::{EvictionPolicy, MambaRadixCache, RadixCache, RadixConfig};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool, SlotPool, TokenAllocator};

#[test]
fn the_counter_counts() {
    assert_eq!(allocations(|| drop(std::hint::black_box(vec![1u8; 10]))).0, 1);
}

fn exercise<A: KvAllocator>(cache: &RadixCache<A>) {
    let ps = cache.page_size();
    let prompt: Vec<u32> = (0..(40 * ps) as u32).collect();
    let mut other = prompt.clone();
    other[20 * ps] = 9999; // diverges in the middle: forces a split
    let mut hit = vec![0u32; prompt.len()];
    let mut new = vec![0u32; prompt.len()];
    let mut row = cache.req_pool().alloc().unwrap();
    let mut row2 = cache.req_pool().alloc().unwrap();

    let (n, ()) = allocations(|| {
        for round in 0..3 {
            for key in [&prompt, &other] {
                let row = if round % 2 == 0 { &mut row } else { &mut row2 };
                let mut lease = if round == 1 {
                    cache.match_and_lock_row(0, key, row).unwrap()
                } else {
                    let lease = cache.match_and_lock(0, key, &mut hit);
                    cache.req_pool().write(row, 0, &hit[..lease.len()]).unwrap();
                    lease
                };
                let h = lease.len();
                if round == 1 {
                    // Straight into the row: what the cache wrote there is trusted.
                    cache.alloc_extend_row(row, h, key.len()).unwrap();
                } else {
                    let last = if h > 0 { hit[h - 1] } else { 0 };
                    let out = &mut new[..key.len() - h];
                    cache.alloc_extend(&[h as u32], &[key.len() as u32], &[last], out).unwrap();
                    cache.req_pool().write(row, h, out).unwrap();
                }
                cache.cache_unfinished_req(0, key, row, &mut lease, 0).unwrap();
                drop(lease);
                let _ = cache.peek_prefix(0, key, &mut hit);
                // A router's or the queue's hint (folded by the evictions below).
                let _ = cache.hint_prefix(0, &key[..25 * ps], &mut hit, 2);
                let m = cache.match_prefix(0, &key[..30 * ps], &mut hit);
                assert!(!m.is_empty());
                cache.evict(5 * ps);
            }
        }
    });
    assert_eq!(n, 0, "allocations in the radix cache's hot paths");

    // The finishing helper too (it consumes the row; do it last).
    let lease = cache.match_and_lock_row(0, &prompt, &mut row).unwrap();
    let h = lease.len();
    cache.alloc_extend_row(&mut row, h, prompt.len()).unwrap();
    let (n, ()) = allocations(|| {
        cache.cache_finished_req(0, &prompt, row, lease, 1).unwrap();
        cache.evict(usize::MAX);
    });
    assert_eq!(n, 0, "allocations in cache_finished_req / evict");
    drop(row2);
}

#[test]
fn radix_hot_paths_do_not_allocate() {
    // Every policy, kvpool's hinted one too, with whole and partial-leaf eviction
    // (a partial eviction splits the victim and removes its tail).
    for policy in EvictionPolicy::ALL.into_iter().chain(EvictionPolicy::KVPOOL_ONLY) {
        for partial in [false, true] {
            let config = RadixConfig { policy, event_capacity: Some(4096), ..RadixConfig::default() };
            let tok =
                RadixCache::new(TokenAllocator::new(120).unwrap(), ReqToTokenPool::new(2, 64).unwrap(), config.clone());
            exercise(&tok.unwrap().with_partial_eviction(partial));
            let paged =
                RadixCache::new(PagedAllocator::new(120 * 4, 4).unwrap(), ReqToTokenPool::new(2, 256).unwrap(), config);
            exercise(&paged.unwrap().with_partial_eviction(partial));
        }
    }
}

/// The Mamba variant's paths: inserts that keep or free a state, matches that split
/// and end at a checkpoint, state locks, `alloc_state` (evicting a state when the pool
/// is empty), `evict_mamba` (tombstones and whole leaves), the request helpers.
#[test]
fn mamba_hot_paths_do_not_allocate() {
    let cache = MambaRadixCache::with_states(
        PagedAllocator::new(64 * 4, 4).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        SlotPool::without_magazines(4),
        RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() },
    )
    .unwrap();
    let a: Vec<u32> = (1..=32).collect();
    let mut b = a.clone();
    b[16] = 999;
    let mut kv = vec![0u32; 32];
    let mut hit = vec![0u32; 32];
    let mut row = cache.req_pool().alloc().unwrap();
    let (n, ()) = allocations(|| {
        for _ in 0..4 {
            for key in [&a, &b] {
                cache.alloc(&mut kv).unwrap();
                let state = cache.alloc_state().unwrap();
                let r = cache.insert(0, key, &kv, state).unwrap();
                cache.allocator().free(&kv[..r.cached]).unwrap();
                let lease = cache.match_and_lock(0, &key[..24], &mut hit);
                let _ = cache.lease_state(&lease);
                let _ = cache.peek_prefix(0, key, &mut hit);
                drop(lease);
                cache.evict_mamba(1);
            }
            // Chunked prefill: cache the first 16 tokens of a request with a checkpoint.
            let mut lease = cache.match_and_lock(0, &a[..16], &mut hit);
            let h = lease.len();
            cache.req_pool().write(&mut row, 0, &hit[..h]).unwrap();
            cache.alloc(&mut kv[..16 - h]).unwrap();
            cache.req_pool().write(&mut row, h, &kv[..16 - h]).unwrap();
            let state = cache.alloc_state().unwrap();
            cache.cache_unfinished_req(0, &a[..16], &mut row, &mut lease, state).unwrap();
            drop(lease);
            cache.evict(16);
        }
    });
    assert_eq!(n, 0, "allocations in the Mamba cache's hot paths");
    let lease = cache.match_and_lock(0, &a[..16], &mut hit);
    let h = lease.len();
    cache.req_pool().write(&mut row, 0, &hit[..h]).unwrap();
    cache.alloc(&mut kv[..16 - h]).unwrap();
    cache.req_pool().write(&mut row, h, &kv[..16 - h]).unwrap();
    let state = cache.alloc_state().unwrap();
    let (n, ()) = allocations(|| {
        cache.cache_finished_req(0, &a[..16], row, lease, state).unwrap();
        cache.evict(usize::MAX);
    });
    assert_eq!(n, 0, "allocations in the Mamba cache_finished_req / evict");
    cache.check_invariants().unwrap();
}
