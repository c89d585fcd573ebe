//! Zero heap allocations in the radix cache's hot paths, through the request handle:
//! admissions that match (and split) a cached prefix, extends that evict for room,
//! checkpoints (inserts with splits), decode steps, finishes, aborts; the lock-free
//! `peek_prefix`, the queue's `hint_prefix`, `match_prefix`, `evict` (whole and partial
//! leaves), under every policy. The counting global allocator of `tests/alloc_common`
//! counts this thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use std::sync::Arc;

use alloc_common::allocations;
use kvpool::radix::{EvictionPolicy, MambaRadixCache, RadixCache, RadixConfig};
use kvpool::{OwnedAllocator, PagedAllocator, ReqToTokenPool, SlotPool, TokenAllocator};

#[test]
fn the_counter_counts() {
    assert_eq!(allocations(|| drop(std::hint::black_box(vec![1u8; 10]))).0, 1);
}

/// Three rounds over two prompts that diverge in the middle (the second admission
/// splits the first's node): admit, prefill a chunk, checkpoint it, prefill the rest,
/// decode, then finish (rounds 0 and 2) or abort (round 1); the readers and an
/// eviction after each. The cache holds 3 prompts' worth of KV, so the extends evict.
fn exercise<A: OwnedAllocator>(cache: &Arc<RadixCache<A>>) {
    let ps = cache.page_size();
    let prompt: Vec<u32> = (0..(40 * ps) as u32).collect();
    let mut other = prompt.clone();
    other[20 * ps] = 9999; // diverges in the middle: forces a split
    let mut hit = vec![0u32; prompt.len()];
    let mut kv = vec![0u32; prompt.len() + 2];
    let mut out = [0u32; 1];
    let (mut hits, mut evicted) = (0, 0);

    let (n, ()) = allocations(|| {
        for round in 0..3 {
            for key in [&prompt, &other] {
                let mut r = cache.admit(0, key).unwrap();
                hits += r.cached_len();
                let chunk = (25 * ps).max(r.len());
                r.extend(chunk - r.len()).unwrap();
                r.checkpoint(&key[..chunk]).unwrap();
                r.extend(key.len() - r.len()).unwrap();
                kv[..key.len()].copy_from_slice(key);
                for step in 0..2 {
                    cache.decode(&mut [&mut r], &mut out).unwrap();
                    kv[key.len() + step] = 7;
                }
                let _ = cache.peek_prefix(0, key, &mut hit);
                // A router's or the queue's hint (folded by the evictions below).
                let _ = cache.hint_prefix(0, &key[..25 * ps], &mut hit, 2);
                if round == 1 {
                    r.abort();
                } else {
                    let len = r.len();
                    r.finish(&kv[..len]).unwrap();
                }
                let m = cache.match_prefix(0, &key[..30 * ps], &mut hit);
                assert!(!m.is_empty());
                evicted += cache.evict(5 * ps);
            }
        }
        evicted += cache.evict(usize::MAX);
    });
    assert_eq!(n, 0, "allocations in the radix cache's hot paths");
    assert!(hits > 0 && evicted > 0, "the paths were not taken: {hits} hit, {evicted} evicted");
    assert_eq!(cache.total_size(), 0);
    cache.check_invariants().unwrap();
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
            exercise(&Arc::new(tok.unwrap().with_partial_eviction(partial)));
            let paged =
                RadixCache::new(PagedAllocator::new(120 * 4, 4).unwrap(), ReqToTokenPool::new(2, 256).unwrap(), config);
            exercise(&Arc::new(paged.unwrap().with_partial_eviction(partial)));
        }
    }
}

/// The Mamba variant's paths: admissions that match past a state (the KV hit beyond the
/// resumable prefix) and split, a running state per request and a saved state taken
/// from an empty pool (evicting the least recently used unlocked state), finishes that
/// keep the saved state or free it (a state was there already), a checkpoint with its
/// state, `evict_mamba` (tombstones and whole leaves), `evict`, and the readers.
#[test]
fn mamba_hot_paths_do_not_allocate() {
    let cache = Arc::new(
        MambaRadixCache::with_states(
            PagedAllocator::new(64 * 4, 4).unwrap(),
            ReqToTokenPool::new(2, 64).unwrap(),
            SlotPool::without_magazines(4),
            RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() },
        )
        .unwrap(),
    );
    let a: Vec<u32> = (1..=32).collect();
    let mut b = a.clone();
    b[16] = 999;
    let mut hit = vec![0u32; 32];
    let (mut resumed, mut kept, mut dropped_states) = (0, 0, 0);
    let (n, ()) = allocations(|| {
        for _ in 0..4 {
            for key in [&a, &b] {
                let mut r = cache.admit(0, key).unwrap();
                resumed += usize::from(r.resume_state().is_some());
                r.save_state(32).unwrap();
                r.extend(32 - r.len()).unwrap();
                let done = r.finish(key).unwrap();
                if done.state_kept {
                    kept += 1;
                } else {
                    dropped_states += 1;
                }
                let _ = cache.peek_prefix(0, key, &mut hit);
                let _ = cache.match_prefix(0, &key[..24], &mut hit);
            }
            // `b` again: resumed at its end, so the state it saves is freed.
            let mut r = cache.admit(0, &b).unwrap();
            resumed += usize::from(r.resume_state().is_some());
            r.save_state(32).unwrap();
            dropped_states += usize::from(!r.finish(&b).unwrap().state_kept);
            // The older of the two states goes (its leaf with it); the other resumes.
            cache.evict_mamba(1);
            // Chunked prefill: cache the first 16 tokens with a checkpoint, then abort.
            let mut r = cache.admit(0, &a[..16]).unwrap();
            r.extend(16 - r.len()).unwrap();
            r.save_state(16).unwrap();
            r.checkpoint(&a[..16]).unwrap();
            r.abort();
            cache.evict(16);
        }
        cache.evict(usize::MAX);
    });
    assert_eq!(n, 0, "allocations in the Mamba cache's hot paths");
    assert!(resumed > 0 && kept > 0 && dropped_states > 0, "{resumed} resumed, {kept} kept, {dropped_states} not");
    assert_eq!(cache.total_size(), 0);
    cache.check_invariants().unwrap();
}
