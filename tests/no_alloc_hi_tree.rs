//! Zero heap allocations in the host-tier radix cache's hot paths, through the request
//! handle: admissions (splits, load-backs that evict for room), extends evicting the
//! shortfall (backed-up nodes moving to host, write-back backups, host eviction for
//! room, nodes removed with their host subtrees), checkpoints and finishes (backups at
//! write hits, host-only nodes taking the request's slots); `peek_prefix`, `evict`,
//! `evict_host`, `insert_host` (prefetches), and the transfers: taking them, reading
//! their page pairs, completing them (some right away, some a request later, so that
//! evictions and loads meet pages in flight). The counting global allocator of
//! `tests/alloc_common` counts this thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use std::sync::Arc;

use alloc_common::allocations;
use kvpool::radix::{EvictionPolicy, HiRadixCache, HostTier, RadixConfig, Transfer, WritePolicy};
use kvpool::{PagedAllocator, ReqToTokenPool};

/// Transfers taken and not yet completed, in fixed buffers.
struct Flight {
    held: [Transfer; 256],
    n: usize,
    dev: [u32; 64],
    host: [u32; 64],
    calls: u32,
}

impl Flight {
    /// Take what was started; read every pair; complete all of it when `now`, else
    /// what the previous call left.
    fn step(&mut self, cache: &HiRadixCache<PagedAllocator>, now: bool) {
        let old = self.n;
        self.n += cache.take_transfers(&mut self.held[old..]);
        for t in &self.held[old..self.n] {
            assert_eq!(cache.transfer_pages(*t, &mut self.dev, &mut self.host), Ok(t.pages()));
        }
        let done = if now { self.n } else { old };
        for t in &self.held[..done] {
            cache.complete(*t).unwrap();
        }
        self.held.copy_within(done..self.n, 0);
        self.n -= done;
    }
}

/// One request's life: admit (matching, loading back and locking), extend by the rest
/// (evicting), checkpoint a chunk, finish.
fn serve(cache: &Arc<HiRadixCache<PagedAllocator>>, key: &[u32], hit: &mut [u32], f: &mut Flight) {
    let ps = cache.page_size();
    if f.calls % 4 == 3 {
        // Another engine's KV for this key, brought to host (a prefetch).
        let _ = cache.insert_host(0, key, hit);
        let _ = cache.host_backed_len(0, key);
    }
    let mut r = cache.admit(0, key).unwrap();
    f.step(cache, false);
    r.extend(key.len() - r.len()).unwrap();
    let _ = cache.peek_prefix(0, key, hit);
    let chunk = (key.len() / 2).max(r.cached_len()) / ps * ps;
    r.checkpoint(&key[..chunk]).unwrap();
    r.finish(key).unwrap();
    f.calls += 1;
    f.step(cache, f.calls % 3 != 0);
}

fn exercise(ps: u32, write_policy: WritePolicy, host_pages: u32) -> (u64, u64, u64) {
    let ps_us = ps as usize;
    let tier = HostTier { host_pages, write_policy, load_back_threshold: ps_us };
    let cache = Arc::new(
        HiRadixCache::with_host_tier(
            PagedAllocator::new(40 * ps_us, ps).unwrap(),
            ReqToTokenPool::new(2, 64 * ps_us).unwrap(),
            RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() },
            tier,
        )
        .unwrap(),
    );
    let base: Vec<u32> = (0..12 * ps).collect();
    let mut keys = Vec::new();
    for k in 0..6u32 {
        let mut key = base.clone();
        // Each key diverges from the base after a different number of pages: splits.
        for t in &mut key[((2 + 2 * k) % 11 * ps) as usize..] {
            *t += 1000 * (k + 1);
        }
        keys.push(key);
    }
    let mut hit = vec![0u32; 12 * ps_us];
    let mut f = Flight { held: [Transfer::default(); 256], n: 0, dev: [0; 64], host: [0; 64], calls: 0 };
    // Warm up (first touches of every arena), then count.
    for key in &keys {
        serve(&cache, key, &mut hit, &mut f);
    }
    let (n, ()) = allocations(|| {
        for round in 0..6 {
            for key in &keys {
                serve(&cache, key, &mut hit, &mut f);
            }
            cache.evict(8 * ps_us);
            f.step(&cache, round % 3 != 2);
            if round % 2 == 1 {
                cache.evict_host(4 * ps_us);
            }
        }
        f.step(&cache, true);
        f.step(&cache, true);
    });
    assert_eq!(n, 0, "allocations on the host tier's hot paths (page size {ps}, {write_policy})");
    assert_eq!(cache.transfers_in_flight(), 0);
    if write_policy != WritePolicy::WriteThroughSelective {
        assert!(cache.counters().prefetched > 0, "no prefetch took place (page size {ps}, {write_policy})");
    }
    cache.check_invariants().unwrap();
    let c = cache.counters();
    (c.written, c.loaded, c.host_evicted)
}

#[test]
fn host_tier_hot_paths_do_not_allocate() {
    for ps in [1, 4, 16] {
        for (policy, host_pages) in
            [(WritePolicy::WriteThrough, 48), (WritePolicy::WriteBack, 20), (WritePolicy::WriteThroughSelective, 8)]
        {
            let (written, loaded, host_evicted) = exercise(ps, policy, host_pages);
            // The paths were taken: backups everywhere; load-backs and host evictions
            // where the host keeps what the device drops.
            assert!(written > 0, "{ps} {policy}: nothing written");
            if policy != WritePolicy::WriteThroughSelective {
                assert!(loaded > 0 && host_evicted > 0, "{ps} {policy}: loaded {loaded}, host evicted {host_evicted}");
            }
        }
    }
}
