//! Zero heap allocations in a request's lifecycle on every tree: admit, extend, decode
//! batches, checkpoint, finish (and a refused finish), abort and drop, with salted and
//! bigram keys. The counting global allocator of `tests/alloc_common` counts this
//! thread's allocations.
#![cfg(not(loom))]

mod alloc_common;

use std::sync::Arc;

use alloc_common::allocations;
use kvpool::alloc::SwaAllocator;
use kvpool::radix::{CacheKey, MambaRadixCache, RadixCache, RadixConfig, SwaRadixCache, Variant};
use kvpool::{OwnedAllocator, PagedAllocator, ReqToTokenPool, SlotPool};

/// Three rounds of two requests sharing a prefix: admit, a chunk, a checkpoint, the
/// rest, decode steps in a batch, a refused finish, the finish; a third request
/// aborted and a fourth dropped. `save` runs after each admission (the Mamba tree
/// saves its state there).
fn exercise<A: OwnedAllocator, V: Variant>(
    cache: &Arc<RadixCache<A, V>>,
    key: CacheKey,
    save: impl Fn(&mut kvpool::radix::Request<A, V>, usize),
) {
    let ps = cache.page_size();
    let prompt: Vec<u32> = (0..(20 * ps) as u32).collect();
    let mut other = prompt.clone();
    other[10 * ps] = 9999;
    let mut tokens_a = vec![0u32; prompt.len() + 8];
    let mut tokens_b = tokens_a.clone();
    let mut out = [0u32; 2];
    let (n, ()) = allocations(|| {
        for _ in 0..3 {
            let mut a = cache.admit(key, &prompt).unwrap();
            let mut b = cache.admit(key, &other).unwrap();
            for (r, p, t) in [(&mut a, &prompt, &mut tokens_a), (&mut b, &other, &mut tokens_b)] {
                save(r, 8 * ps);
                let chunk = (8 * ps).max(r.len());
                r.extend(chunk - r.len()).unwrap();
                r.checkpoint(&p[..chunk]).unwrap();
                r.extend(p.len() - r.len()).unwrap();
                t[..p.len()].copy_from_slice(p);
            }
            for step in 0..4 {
                cache.decode(&mut [&mut a, &mut b], &mut out).unwrap();
                tokens_a[prompt.len() + step] = 7;
                tokens_b[other.len() + step] = 8;
            }
            let (la, lb) = (a.len(), b.len());
            let refused = a.finish(&tokens_a[..la - 1]).unwrap_err();
            refused.request.finish(&tokens_a[..la]).unwrap();
            b.finish(&tokens_b[..lb]).unwrap();
            let mut c = cache.admit(key, &other).unwrap();
            c.extend(ps).unwrap();
            c.abort();
            let mut d = cache.admit(key, &prompt).unwrap();
            d.extend(ps).unwrap();
            drop(d);
            cache.evict(4 * ps);
        }
    });
    assert_eq!(n, 0, "allocations in a request's lifecycle");
    cache.check_invariants().unwrap();
}

#[test]
fn plain_requests_do_not_allocate() {
    for ps in [1, 16] {
        let alloc = PagedAllocator::new(4096, ps).unwrap();
        let c =
            Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(8, 1024).unwrap(), RadixConfig::default()).unwrap());
        let split = RadixConfig { split_at_prompt: true, ..RadixConfig::default() };
        let s = Arc::new(
            RadixCache::new(PagedAllocator::new(4096, ps).unwrap(), ReqToTokenPool::new(8, 1024).unwrap(), split)
                .unwrap(),
        );
        for key in [
            CacheKey::default(),
            CacheKey { salt: 3, ..CacheKey::default() },
            CacheKey { bigram: true, ..CacheKey::default() },
        ] {
            exercise(&c, key, |_, _| {});
            exercise(&s, key, |_, _| {});
        }
    }
}

#[test]
fn mamba_requests_do_not_allocate() {
    let (kv, rows) = (PagedAllocator::new(4096, 16).unwrap(), ReqToTokenPool::new(8, 1024).unwrap());
    let c = Arc::new(
        MambaRadixCache::with_states(kv, rows, SlotPool::without_magazines(32), RadixConfig::default()).unwrap(),
    );
    exercise(&c, CacheKey::default(), |r, at| {
        r.save_state(at).unwrap();
    });
}

#[test]
fn swa_requests_do_not_allocate() {
    let alloc = SwaAllocator::new(4096, 2048, 16).unwrap();
    let c = Arc::new(
        SwaRadixCache::with_window(alloc, ReqToTokenPool::new(8, 1024).unwrap(), RadixConfig::default(), 64).unwrap(),
    );
    exercise(&c, CacheKey::default(), |_, _| {});
}
