use super::*;
use crate::alloc::Geometry;
use crate::baseline::ReferenceRadixCache;
use crate::{PagedAllocator, TokenAllocator};

fn token_cache(size: usize, policy: EvictionPolicy) -> RadixCache<TokenAllocator> {
    let config = RadixConfig { policy, event_capacity: Some(1024), ..RadixConfig::default() };
    RadixCache::new(TokenAllocator::new(size).unwrap(), ReqToTokenPool::new(8, 64).unwrap(), config).unwrap()
}

fn alloc_slots<A: KvAllocator>(c: &RadixCache<A>, n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    c.allocator().alloc(&mut v).unwrap();
    v
}

#[test]
fn design_vectors() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 3);
    assert_eq!(c.insert(0, &[1, 2, 3], &s, 0).unwrap(), 0);
    assert_eq!((c.total_size(), c.evictable_size()), (3, 3));
    let mut out = [0u32; 2];
    assert_eq!(c.match_prefix(0, &[1, 2], &mut out).len(), 2);
    assert_eq!(out, [s[0], s[1]]);
    c.check_invariants().unwrap();

    let c = token_cache(64, EvictionPolicy::Lru);
    let a = alloc_slots(&c, 8);
    c.insert(0, &[1, 2, 3, 4, 5, 6, 7, 8], &a, 0).unwrap();
    let b = alloc_slots(&c, 4);
    assert_eq!(c.insert(0, &[1, 2, 9, 10], &b, 0).unwrap(), 2);
    c.allocator().free(&b[..2]).unwrap(); // the caller frees its duplicates
    assert_eq!(c.total_size(), 10);
    let mut out = [0u32; 6];
    let m = c.match_prefix(0, &[1, 2, 3, 4, 999, 1000], &mut out);
    assert_eq!(m.len(), 4);
    assert_eq!(out[..4], a[..4]);
    c.check_invariants().unwrap();
    assert_eq!(c.node_count(), 4); // [1,2] -> {[3,4] -> [5..8], [9,10]}
}

#[test]
fn locks_move_sizes_only_on_zero_one() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 3);
    c.insert(0, &[1, 2, 3], &s, 0).unwrap();
    let mut out = [0u32; 2];
    let l1 = c.match_and_lock(0, &[1, 2], &mut out);
    assert_eq!((c.evictable_size(), c.protected_size()), (1, 2));
    let l2 = c.match_and_lock(0, &[1, 2], &mut out);
    assert_eq!((c.evictable_size(), c.protected_size()), (1, 2));
    drop(l1);
    assert_eq!((c.evictable_size(), c.protected_size()), (1, 2));
    // locked nodes are not evicted, the unlocked leaf is
    assert_eq!(c.evict(100), 1);
    assert_eq!(c.total_size(), 2);
    drop(l2);
    assert_eq!((c.evictable_size(), c.protected_size()), (2, 0));
    assert_eq!(c.evict(1), 2);
    assert_eq!(c.allocator().available_size(), 64);
    c.check_invariants().unwrap();
}

#[test]
fn detached_leases_and_stale_matches() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &s, 0).unwrap();
    let mut out = [0u32; 4];
    let raw = c.match_and_lock(0, &[1, 2, 3, 4], &mut out).detach();
    assert_eq!(c.protected_size(), 4);
    // A lease of another cache is refused and handed back, nothing changes.
    let other = token_cache(8, EvictionPolicy::Lru);
    let raw = other.attach(raw).unwrap_err();
    assert_eq!(c.protected_size(), 4);
    c.release(raw).unwrap(); // consumed: a second release does not compile
    assert_eq!(c.protected_size(), 0);
    let m = c.match_prefix(0, &[1, 2, 3, 4], &mut out);
    c.evict(4);
    assert!(matches!(c.lock(&m), Err(CacheError::StaleMatch)));
    c.check_invariants().unwrap();
}

#[test]
fn insert_validates_before_changing_anything() {
    let c = RadixCache::new(
        PagedAllocator::new(64, 4).unwrap(),
        ReqToTokenPool::new(1, 8).unwrap(),
        RadixConfig::default(),
    )
    .unwrap();
    let s = alloc_slots(&c, 8);
    assert!(matches!(c.insert(0, &[1, 2, 3], &s[..3], 0), Err(CacheError::Invalid(_))));
    assert!(matches!(c.insert(0, &[1, 2, 3, 4], &s[..3], 0), Err(CacheError::Invalid(_))));
    let bad = [s[1], s[0], s[2], s[3]];
    assert!(matches!(c.insert(0, &[1, 2, 3, 4], &bad, 0), Err(CacheError::Invalid(_))));
    assert!(matches!(c.insert(0, &[1, 2, 3, 4], &[40, 41, 42, 43], 0), Err(CacheError::SlotNotOwned { slot: 40 })));
    c.insert(0, &[1, 2, 3, 4], &s[..4], 0).unwrap();
    // the same page again, under another key: refused, tree unchanged
    assert!(matches!(c.insert(0, &[9, 9, 9, 9], &s[..4], 0), Err(CacheError::SlotNotOwned { .. })));
    // a page twice in one insert
    let dup = [s[4], s[5], s[6], s[7], s[4], s[5], s[6], s[7]];
    assert!(matches!(c.insert(0, &[5, 5, 5, 5, 6, 6, 6, 6], &dup, 0), Err(CacheError::SlotNotOwned { .. })));
    assert_eq!(c.total_size(), 4);
    c.check_invariants().unwrap();
}

#[test]
fn page_sizes_and_partial_pages() {
    for ps in [1u32, 2, 4, 16] {
        let alloc = PagedAllocator::new(256, ps).unwrap();
        let c = RadixCache::new(alloc, ReqToTokenPool::new(1, 8).unwrap(), RadixConfig::default()).unwrap();
        let n = 4 * ps as usize;
        let key: Vec<u32> = (100..100 + n as u32).collect();
        let s = alloc_slots(&c, n);
        c.insert(0, &key, &s, 0).unwrap();
        let mut out = vec![0u32; n + 3];
        // a query one token short of 3 pages matches 2 pages
        let q = &key[..3 * ps as usize - 1];
        assert_eq!(c.peek_prefix(0, q, &mut out), (2 * ps as usize).min(q.len() / ps as usize * ps as usize));
        // mismatch in the last token of page 3 -> 2 pages, and a split
        let mut q = key[..3 * ps as usize].to_vec();
        *q.last_mut().unwrap() = 7;
        let m = c.match_prefix(0, &q, &mut out);
        assert_eq!(m.len(), 2 * ps as usize);
        assert_eq!(out[..m.len()], s[..m.len()]);
        assert_eq!(c.node_count(), 2);
        c.check_invariants().unwrap();
    }
}

#[test]
fn namespaces_never_share_nodes() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let a = alloc_slots(&c, 3);
    let b = alloc_slots(&c, 3);
    assert_eq!(c.insert(1, &[1, 2, 3], &a, 0).unwrap(), 0);
    assert_eq!(c.insert(2, &[1, 2, 3], &b, 0).unwrap(), 0);
    let mut out = [0u32; 3];
    assert_eq!(c.peek_prefix(2, &[1, 2, 3], &mut out), 3);
    assert_eq!(out.to_vec(), b);
    assert_eq!(c.peek_prefix(3, &[1, 2, 3], &mut out), 0);
    assert_eq!(c.node_count(), 2);
}

/// Insert three leaves under a shared root so each policy has a distinct order.
fn eviction_order(policy: EvictionPolicy) -> Vec<u32> {
    let c = token_cache(64, policy);
    for (first, prio) in [(10u32, 5i64), (20, 1), (30, 3)] {
        let s = alloc_slots(&c, 2);
        c.insert(0, &[first, first + 1], &s, prio).unwrap();
    }
    let mut out = [0u32; 2];
    // touch 10 twice and 20 once (recency and hit counts)
    c.match_prefix(0, &[10, 11], &mut out);
    c.match_prefix(0, &[20, 21], &mut out);
    c.match_prefix(0, &[10, 11], &mut out);
    let mut order = vec![];
    while c.total_size() > 0 {
        let before: Vec<u32> =
            [10u32, 20, 30].into_iter().filter(|&k| c.peek_prefix(0, &[k, k + 1], &mut out) == 2).collect();
        c.evict(1);
        for k in before {
            if c.peek_prefix(0, &[k, k + 1], &mut out) == 0 {
                order.push(k);
            }
        }
    }
    order
}

#[test]
fn eviction_order_per_policy() {
    assert_eq!(eviction_order(EvictionPolicy::Lru), [30, 20, 10]);
    assert_eq!(eviction_order(EvictionPolicy::Mru), [10, 20, 30]);
    assert_eq!(eviction_order(EvictionPolicy::Fifo), [10, 20, 30]);
    assert_eq!(eviction_order(EvictionPolicy::Filo), [30, 20, 10]);
    assert_eq!(eviction_order(EvictionPolicy::Lfu), [30, 20, 10]);
    assert_eq!(eviction_order(EvictionPolicy::Priority), [20, 30, 10]);
}

#[test]
fn eviction_promotes_parents() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let a = alloc_slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a, 0).unwrap();
    let b = alloc_slots(&c, 4);
    assert_eq!(c.insert(0, &[1, 2, 5, 6], &b, 0).unwrap(), 2);
    c.allocator().free(&b[..2]).unwrap();
    // leaves [3,4] and [5,6] go first, then the parent [1,2]
    assert_eq!(c.evict(6), 6);
    assert_eq!(c.total_size(), 0);
    assert_eq!(c.allocator().available_size(), 64);
    c.check_invariants().unwrap();
}

#[test]
fn request_lifecycle_frees_duplicates_and_tail() {
    let alloc = PagedAllocator::new(64, 4).unwrap();
    let c = RadixCache::new(alloc, ReqToTokenPool::new(2, 32).unwrap(), RadixConfig::default()).unwrap();
    let prompt: Vec<u32> = (1..=10).collect();
    for round in 0..2 {
        let mut row = c.req_pool().alloc().unwrap();
        let mut hit = [0u32; 10];
        let lease = c.match_and_lock(0, &prompt, &mut hit);
        assert_eq!(lease.len(), if round == 0 { 0 } else { 8 });
        let h = lease.len();
        c.req_pool().write(&mut row, 0, &hit[..h]).unwrap();
        let mut new = vec![0u32; 10 - h];
        let last = if h > 0 { hit[h - 1] } else { 0 };
        c.alloc_extend(&[h as u32], &[10], &[last], &mut new).unwrap();
        c.req_pool().write(&mut row, h, &new).unwrap();
        assert_eq!(c.cache_finished_req(0, &prompt, row, lease, 0).unwrap(), h);
        // 8 aligned tokens cached, the 2-token tail freed
        assert_eq!(c.total_size(), 8);
        assert_eq!(c.allocator().available_size(), 64 - 8);
        c.check_invariants().unwrap();
    }
}

#[test]
fn unfinished_request_rewrites_row_and_moves_lock() {
    let c = token_cache(64, EvictionPolicy::Lru);
    // someone else cached [1,2,3]
    let other = alloc_slots(&c, 3);
    c.insert(0, &[1, 2, 3], &other, 0).unwrap();
    // our request computed [1,2,3,4,5] from scratch (no hit)
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = c.match_and_lock(0, &[], &mut []);
    let mine = alloc_slots(&c, 5);
    c.req_pool().write(&mut row, 0, &mine).unwrap();
    c.cache_unfinished_req(0, &[1, 2, 3, 4, 5], &mut row, &mut lease, 0).unwrap();
    assert_eq!(lease.len(), 5);
    // the row now holds the tree's slots; our duplicates for [1,2,3] were freed
    let r = c.req_pool().read(&row, 0..5).unwrap();
    assert_eq!(r[..3], other[..]);
    assert_eq!(r[3..], mine[3..]);
    assert!(!c.allocator().is_allocated(mine[0]));
    assert_eq!(c.protected_size(), 5);
    let r = c.cache_finished_req(0, &[1, 2, 3, 4, 5], row, lease, 0).unwrap();
    assert_eq!(r, 5);
    assert_eq!(c.protected_size(), 0);
    assert_eq!(c.allocator().available_size(), 64 - 5);
    c.check_invariants().unwrap();
}

#[test]
fn alloc_evicts_the_shortfall_and_reports_evictable() {
    let c = token_cache(8, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 6);
    c.insert(0, &[1, 2, 3, 4, 5, 6], &s, 0).unwrap();
    let mut out = [0u32; 4];
    c.alloc(&mut out).unwrap(); // 2 free + evicts the 6-token leaf
    assert_eq!(c.total_size(), 0);
    let mut big = [0u32; 5];
    let e = c.alloc(&mut big).unwrap_err();
    let oom = e.out_of_memory().unwrap();
    assert_eq!((oom.requested, oom.available, oom.evictable), (5, 4, Some(0)));
    assert!(e.to_string().contains("Evictable tokens: 0"));
}

#[test]
fn events_follow_the_tree() {
    let alloc = PagedAllocator::new(64, 2).unwrap();
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(64), ..RadixConfig::default() };
    let c = RadixCache::new(alloc, ReqToTokenPool::new(1, 8).unwrap(), config).unwrap();
    let q = c.events().unwrap();
    assert_eq!(q.pop(), Some(KvEvent::AllBlocksCleared));
    let s = alloc_slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &s, 0).unwrap();
    let h1 = page_hash(None, &[1, 2]);
    let h2 = page_hash(Some(&h1), &[3, 4]);
    assert_eq!(q.pop(), Some(KvEvent::BlockStored { hash: h1, parent: None, page: s[0] / 2, namespace: 0 }));
    assert_eq!(q.pop(), Some(KvEvent::BlockStored { hash: h2, parent: Some(h1), page: s[2] / 2, namespace: 0 }));
    // a split stores nothing new; a child under the split uses the right parent hash
    let t = alloc_slots(&c, 4);
    assert_eq!(c.insert(0, &[1, 2, 7, 8], &t, 0).unwrap(), 2);
    let h3 = page_hash(Some(&h1), &[7, 8]);
    assert_eq!(q.pop(), Some(KvEvent::BlockStored { hash: h3, parent: Some(h1), page: t[2] / 2, namespace: 0 }));
    assert_eq!(q.pop(), None);
    c.allocator().free(&t[..2]).unwrap();
    c.evict(2);
    assert!(matches!(q.pop(), Some(KvEvent::BlockRemoved { .. })));
}

#[test]
fn reset_returns_everything() {
    let mut c = token_cache(32, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 5);
    c.insert(0, &[1, 2, 3, 4, 5], &s, 0).unwrap();
    c.reset().unwrap();
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, 32));
    let mut out = [0u32; 5];
    assert_eq!(c.peek_prefix(0, &[1, 2, 3, 4, 5], &mut out), 0);
    c.check_invariants().unwrap();
    let s = alloc_slots(&c, 5);
    c.insert(0, &[1, 2, 3, 4, 5], &s, 0).unwrap();
    assert!(c.pretty_print().contains("5 [1, 2, 3, 4, 5] r=0"));
}

#[test]
fn agrees_with_reference_on_a_scripted_run() {
    let c = token_cache(64, EvictionPolicy::Lru);
    let mut r = ReferenceRadixCache::new(TokenAllocator::new(64).unwrap(), EvictionPolicy::Lru).unwrap();
    let keys: [&[u32]; 5] = [&[1, 2, 3, 4], &[1, 2, 5], &[1, 2, 3, 9, 9], &[7, 7], &[1, 2, 5, 6, 6]];
    for k in keys {
        let mut out = vec![0u32; k.len()];
        let m = c.match_prefix(0, k, &mut out);
        let (rv, _) = r.match_prefix(0, k);
        assert_eq!(m.len(), rv.len());
        let s = alloc_slots(&c, k.len());
        let mut rs = vec![0u32; k.len()];
        r.allocator().alloc(&mut rs).unwrap();
        assert_eq!(s, rs);
        let a = c.insert(0, k, &s, 0).unwrap();
        assert_eq!(a, r.insert(0, k, &rs, 0));
        c.allocator().free(&s[..a]).unwrap();
        r.allocator().free(&rs[..a]).unwrap();
    }
    while c.total_size() > 0 {
        assert_eq!(c.evict(1), r.evict(1));
        assert_eq!(c.total_size(), r.total_size());
        c.check_invariants().unwrap();
    }
}

// ---- issue 14: misuse can never corrupt the cache (each test failed before its fix) ----

fn paged_cache(size: usize, ps: u32) -> RadixCache<PagedAllocator> {
    RadixCache::new(PagedAllocator::new(size, ps).unwrap(), ReqToTokenPool::new(4, 64).unwrap(), RadixConfig::default())
        .unwrap()
}

/// Everything a misuse test compares before and after a refused call.
type Snapshot = (usize, usize, usize, usize, Vec<(u64, Vec<u32>, Vec<u32>)>);

fn snapshot<A: KvAllocator>(c: &RadixCache<A>) -> Snapshot {
    c.check_invariants().unwrap();
    (c.total_size(), c.evictable_size(), c.protected_size(), c.allocator().available_size(), c.leaf_paths())
}

#[test]
fn a_second_lease_keeps_its_protection_when_another_is_released() {
    let c = token_cache(16, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &s, 0).unwrap();
    let mut out = [0u32; 4];
    let held = c.match_and_lock(0, &[1, 2, 3, 4], &mut out);
    let raw = c.match_and_lock(0, &[1, 2], &mut out).detach(); // an ancestor, after a split
    c.release(raw).unwrap();
    assert_eq!(c.protected_size(), 4);
    assert_eq!(c.evict(16), 0, "the held lease's path must stay cached");
    let attached = c.attach(c.match_and_lock(0, &[1, 2, 3], &mut out).detach()).unwrap();
    assert_eq!(attached.len(), 3);
    drop(attached);
    drop(held);
    assert_eq!((c.protected_size(), c.evictable_size()), (0, 4));
    c.check_invariants().unwrap();
}

#[test]
fn finishing_refuses_tree_slots_the_lease_does_not_cover() {
    let c = token_cache(16, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &s, 0).unwrap();
    // The request copied the tree's slots without locking them, then grew by two.
    let mut kv = [0u32; 6];
    let _ = c.match_prefix(0, &[1, 2, 3, 4], &mut kv[..4]);
    c.allocator().alloc(&mut kv[4..]).unwrap();
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &kv).unwrap();
    let lease = c.match_and_lock(0, &[], &mut []);
    let before = snapshot(&c);
    let e = c.cache_finished_req(0, &[1, 2, 3, 4, 5, 6], row, lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::RowMismatch { index: 0, slot: s[0] });
    assert_eq!(snapshot(&c), before, "a refused finish must change nothing");
}

#[test]
fn finishing_refuses_a_tail_inside_a_page_being_cached() {
    let c = paged_cache(32, 4);
    let mut kv = [0u32; 5];
    c.allocator().alloc(&mut kv[..4]).unwrap();
    kv[4] = kv[1]; // the tail slot lies in the page the finish caches
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &kv).unwrap();
    let lease = c.match_and_lock(0, &[], &mut []);
    let before = snapshot(&c);
    let mut e = c.cache_finished_req(0, &[1, 2, 3, 4, 5], row, lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::RowMismatch { index: 4, slot: kv[1] });
    assert_eq!(snapshot(&c), before);
    // The same request with its own tail page finishes.
    let mut tail = [0u32; 4];
    c.allocator().alloc(&mut tail).unwrap();
    c.req_pool().write(&mut e.row, 4, &tail[..1]).unwrap();
    assert_eq!(c.cache_finished_req(0, &[1, 2, 3, 4, 5], e.row, e.lease, 0).unwrap(), 0);
    assert_eq!((c.total_size(), c.allocator().available_size()), (4, 28));
    c.check_invariants().unwrap();
}

#[test]
fn finishing_refuses_a_row_that_differs_from_its_lease() {
    let c = token_cache(16, EvictionPolicy::Lru);
    let s = alloc_slots(&c, 2);
    c.insert(0, &[1, 2], &s, 0).unwrap();
    let mut kv = [0u32; 4];
    let lease = c.match_and_lock(0, &[1, 2], &mut kv[..2]);
    c.allocator().alloc(&mut kv).unwrap(); // overwrites the leased prefix with own slots
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &kv).unwrap();
    let before = snapshot(&c);
    let e = c.cache_finished_req(0, &[1, 2, 3, 4], row, lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::RowMismatch { index: 0, slot: kv[0] });
    assert_eq!(snapshot(&c), before);
    // A request that lists one of its pages twice is refused as well.
    let c = token_cache(16, EvictionPolicy::Lru);
    let mut kv = [0u32; 3];
    c.allocator().alloc(&mut kv[..2]).unwrap();
    kv[2] = kv[0];
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &kv).unwrap();
    let lease = c.match_and_lock(0, &[], &mut []);
    let before = snapshot(&c);
    let e = c.cache_unfinished_req(0, &[7, 8, 9], &mut row, &mut { lease }, 0);
    assert!(matches!(e, Err(CacheError::SlotNotOwned { .. })), "{e:?}");
    assert_eq!(snapshot(&c), before);
}

#[test]
fn a_match_of_one_cache_cannot_lock_another() {
    let a = token_cache(16, EvictionPolicy::Lru);
    let b = token_cache(16, EvictionPolicy::Lru);
    for c in [&a, &b] {
        let s = alloc_slots(c, 2);
        c.insert(0, &[1, 2], &s, 0).unwrap();
    }
    let m = a.match_prefix(0, &[1, 2], &mut [0u32; 2]);
    assert_eq!(b.lock(&m).unwrap_err(), CacheError::StaleMatch);
    assert_eq!(b.protected_size(), 0);
    drop(a.lock(&m).unwrap());
}

#[test]
fn allocation_validates_before_evicting() {
    let c = paged_cache(16, 4);
    let s = alloc_slots(&c, 16);
    c.insert(0, &(0..16).collect::<Vec<_>>(), &s, 0).unwrap();
    let before = snapshot(&c);
    assert!(matches!(c.alloc(&mut [0u32; 3]), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_extend(&[0], &[8], &[], &mut [0u32; 8]), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_extend(&[0], &[8], &[0], &mut [0u32; 7]), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_extend(&[2], &[8], &[6], &mut [0u32; 6]), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_decode(&[5], &[3, 4], &mut [0u32; 1]), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_decode(&[5], &[3], &mut [0u32; 2]), Err(AllocError::Invalid(_))));
    assert_eq!(snapshot(&c), before, "a malformed allocation must not evict");
    // A well-formed call evicts what it needs (the whole leaf, as SGLang does).
    let mut out = [0u32; 8];
    c.alloc(&mut out).unwrap();
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, 8));
}

#[test]
fn construction_checks_the_geometry() {
    let rows = || ReqToTokenPool::new(1, 4).unwrap();
    let geometry = |ps, size| Geometry(TokenAllocator::new(4).unwrap(), ps, size);
    let e = RadixCache::new(geometry(0, 64), rows(), RadixConfig::default()).unwrap_err();
    assert_eq!(e, ConfigError::ZeroPageSize);
    let e = RadixCache::new(geometry(1, 1 << 33), rows(), RadixConfig::default()).unwrap_err();
    assert!(matches!(e, ConfigError::TooLarge { .. }), "{e:?}");
    let e = RadixCache::new(geometry(1 << 31, 1 << 32), rows(), RadixConfig::default()).unwrap_err();
    assert!(matches!(e, ConfigError::TooLarge { .. }), "{e:?}");
    let e = RadixCache::new(
        geometry(1, 64),
        rows(),
        RadixConfig { event_capacity: Some(usize::MAX), ..Default::default() },
    )
    .unwrap_err();
    assert!(matches!(e, ConfigError::TooLargeForMemory { bytes: u64::MAX, .. }), "{e:?}");
    // An arena the machine cannot grant is an error that names its bytes.
    let e = crate::arena::try_vec_with(usize::MAX / 8, "test arena", |_| 0u64).unwrap_err();
    assert_eq!(e, ConfigError::TooLargeForMemory { what: "test arena", bytes: u64::MAX - 7 });
    assert!(e.to_string().contains("18446744073709551608 bytes"), "{e}");
}

#[test]
fn first_diff_finds_the_first_difference_at_every_position() {
    // Lengths around the 64-element block, a difference at every position (in the
    // first block, at a block edge, in the tail), and one slice a prefix of the other.
    // The long lengths put the prefetch distance ahead of the slice's end (its hints
    // stop there) and inside it.
    let ahead = super::PREFETCH_AHEAD;
    for n in
        [0usize, 1, 15, 63, 64, 65, 127, 128, 129, 200, ahead + 63, ahead + 64, ahead + 65, ahead + 128, ahead + 150]
    {
        let a: Vec<u32> = (0..n as u32).map(|x| x.wrapping_mul(2_654_435_761)).collect();
        assert_eq!(super::first_diff(&a, &a), n);
        for at in 0..n {
            let mut b = a.clone();
            b[at] ^= 1 << (at % 32);
            assert_eq!(super::first_diff(&a, &b), at, "n {n}, difference at {at}");
            // A second, later difference does not move the answer.
            if at + 70 < n {
                b[at + 70] ^= 1;
                assert_eq!(super::first_diff(&a, &b), at);
            }
        }
        assert_eq!(super::first_diff(&a, &a[..n / 2]), n / 2);
        assert_eq!(super::first_diff(&a[..n / 3], &a), n / 3);
    }
}

#[test]
fn finishing_refuses_a_row_that_is_not_whole_pages() {
    // The row's page shape is checked before the latch is taken; a bad shape is still
    // refused with the slot that starts the bad stretch, and nothing changes.
    use crate::error::InvalidInput;
    let c = paged_cache(64, 4);
    // One page cached and leased, then two new pages: the second's slots out of order.
    let mut s = [0u32; 4];
    c.allocator().alloc(&mut s).unwrap();
    c.insert(0, &[1, 2, 3, 4], &s, 0).unwrap();
    let mut kv = [0u32; 12];
    let lease = c.match_and_lock(0, &[1, 2, 3, 4], &mut kv[..4]);
    c.allocator().alloc(&mut kv[4..]).unwrap();
    kv.swap(9, 10);
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &kv).unwrap();
    let key: Vec<u32> = (1..=12).collect();
    let before = snapshot(&c);
    let mut e = c.cache_finished_req(0, &key, row, lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::Invalid(InvalidInput::NotAPage { slot: kv[8] }));
    assert_eq!(snapshot(&c), before, "a refused finish must change nothing");
    // The same through the chunked-prefill path, with the row mended afterwards.
    let err = c.cache_unfinished_req(0, &key, &mut e.row, &mut e.lease, 0).unwrap_err();
    assert_eq!(err, CacheError::Invalid(InvalidInput::NotAPage { slot: kv[8] }));
    assert_eq!(snapshot(&c), before);
    // A page that starts mid-page is refused too.
    let mut shifted = kv;
    shifted.swap(9, 10);
    shifted[4..8].iter_mut().for_each(|x| *x += 1);
    c.req_pool().write(&mut e.row, 0, &shifted).unwrap();
    let mut e = c.cache_finished_req(0, &key, e.row, e.lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::Invalid(InvalidInput::NotAPage { slot: shifted[4] }));
    assert_eq!(snapshot(&c), before);
    // Mended, it finishes.
    kv.swap(9, 10);
    c.req_pool().write(&mut e.row, 0, &kv).unwrap();
    assert_eq!(c.cache_finished_req(0, &key, e.row, e.lease, 0).unwrap(), 4);
    assert_eq!(c.total_size(), 12);
    c.check_invariants().unwrap();
}

#[test]
fn ascending_len_counts_the_leading_run_at_every_length() {
    // Runs shorter than the scalar head, at the head's edge, around the 64-slot blocks,
    // and the whole slice; a break at every position; a first slot near u32::MAX.
    for base in [5u32, u32::MAX - 70] {
        for n in [0usize, 1, 7, 8, 9, 63, 64, 65, 72, 73, 130, 200] {
            let run: Vec<u32> = (0..n as u32).map(|k| base.wrapping_add(k)).collect();
            assert_eq!(super::writer::ascending_len(&run, base), n);
            for at in 0..n {
                let mut s = run.clone();
                s[at] = s[at].wrapping_add(2);
                assert_eq!(super::writer::ascending_len(&s, base), at, "n {n}, break at {at}");
            }
        }
    }
}

#[test]
fn alloc_extend_row_fills_the_row_as_alloc_extend_and_a_write_do() {
    // Two caches driven alike, one through the batch call and a copy into the row, one
    // straight into the row: same slots, same cache afterwards. The extension comes in
    // two chunks, the second starting mid-page, so its `last_loc` is read from the row.
    for ps in [1u32, 4] {
        let (a, b) = (paged_cache(64, ps), paged_cache(64, ps));
        let key: Vec<u32> = (1..=15).collect();
        for c in [&a, &b] {
            let mut s = vec![0u32; 8];
            c.allocator().alloc(&mut s).unwrap();
            c.insert(0, &key[..8], &s, 0).unwrap();
        }
        let (mut ra, mut rb) = (a.req_pool().alloc().unwrap(), b.req_pool().alloc().unwrap());
        let mut kv = [0u32; 15];
        let la = a.match_and_lock(0, &key, &mut kv);
        let lb = b.match_and_lock(0, &key, &mut [0; 15]);
        assert_eq!(la.len(), 8);
        a.req_pool().write(&mut ra, 0, &kv[..8]).unwrap();
        b.req_pool().write(&mut rb, 0, &kv[..8]).unwrap();
        for (p, q) in [(8usize, 10usize), (10, 15)] {
            a.alloc_extend(&[p as u32], &[q as u32], &[kv[p - 1]], &mut kv[p..q]).unwrap();
            a.req_pool().write(&mut ra, p, &kv[p..q]).unwrap();
            b.alloc_extend_row(&mut rb, p, q).unwrap();
        }
        assert_eq!(a.req_pool().read(&ra, 0..15).unwrap(), b.req_pool().read(&rb, 0..15).unwrap(), "ps {ps}");
        // Both chunks are remembered as one stretch.
        assert_eq!(crate::ReqToTokenPool::shaped(&rb), 8..15);
        assert_eq!(snapshot(&a), snapshot(&b));
        let ca = a.cache_finished_req(0, &key, ra, la, 0).map_err(|e| e.error).unwrap();
        let cb = b.cache_finished_req(0, &key, rb, lb, 0).map_err(|e| e.error).unwrap();
        assert_eq!((ca, snapshot(&a)), (cb, snapshot(&b)), "ps {ps}");
    }
}

#[test]
fn the_row_remembers_where_the_allocators_runs_break() {
    // Fragmented pools (single pages held and freed at random), requests filled in one
    // to three chunks (some ending mid-page). The row's recorded breaks are exactly the
    // positions where its slots stop being consecutive, as far as it knows them: the
    // whole expansion, or up to the first break past `ROW_BREAKS`. The finish then
    // caches what a twin cache caches from the same slots written by hand (and so
    // checked slot by slot).
    use crate::req_to_token::ROW_BREAKS;
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let (mut overflowed, mut extended) = (0, 0);
    for ps in [1u32, 2, 4, 16] {
        let pages = 512usize;
        let make = || {
            let rows = ReqToTokenPool::new(2, pages * ps as usize).unwrap();
            RadixCache::new(PagedAllocator::new(pages * ps as usize, ps).unwrap(), rows, RadixConfig::default())
                .unwrap()
        };
        let (a, b) = (make(), make());
        let mut held: Vec<(u32, u32)> = Vec::new();
        for round in 0..120 {
            // Hold and free single pages at random, in both pools alike.
            for _ in 0..next(40) {
                if next(3) > 0 || held.is_empty() {
                    let (mut x, mut y) = (vec![0u32; ps as usize], vec![0u32; ps as usize]);
                    if a.alloc(&mut x).is_ok() {
                        b.alloc(&mut y).unwrap();
                        assert_eq!(x, y);
                        held.push((x[0], y[0]));
                    }
                } else {
                    let (x, y) = held.swap_remove(next(held.len()));
                    a.allocator().free(&[x]).unwrap();
                    b.allocator().free(&[y]).unwrap();
                }
            }
            let len = 1 + next(40 * ps as usize);
            let key: Vec<u32> = (0..len).map(|_| 1 + next(3) as u32).collect();
            let (mut ra, mut rb) = (a.req_pool().alloc().unwrap(), b.req_pool().alloc().unwrap());
            let la = a.match_and_lock_row(0, &key, &mut ra).unwrap();
            let mut kv = vec![0u32; len];
            let lb = b.match_and_lock(0, &key, &mut kv);
            let hit = la.len();
            assert_eq!(hit, lb.len());
            b.req_pool().write(&mut rb, 0, &kv[..hit]).unwrap();
            let mut cuts = vec![hit, len];
            for _ in 0..next(3) {
                cuts.push(hit + next(len - hit + 1));
            }
            cuts.sort_unstable();
            let mut filled = hit;
            for w in cuts.windows(2) {
                let (p, q) = (w[0], w[1]);
                let last = if p > 0 { kv[p - 1] } else { 0 };
                let got = a.alloc_extend_row(&mut ra, p, q);
                let want = b.alloc_extend(&[p as u32], &[q as u32], &[last], &mut kv[p..q]);
                assert_eq!(got.is_ok(), want.is_ok(), "ps {ps}, round {round}");
                if want.is_err() {
                    break;
                }
                b.req_pool().write(&mut rb, p, &kv[p..q]).unwrap();
                extended += usize::from(p > hit && p < q);
                filled = q;
            }
            if filled < len {
                // Out of memory: give back what was allocated.
                for (c, row, lease) in [(&a, ra, la), (&b, rb, lb)] {
                    c.allocator().free(&kv[hit..filled]).unwrap();
                    drop(lease);
                    c.req_pool().free(row).unwrap();
                }
                continue;
            }
            let row = a.req_pool().read(&ra, 0..len).unwrap();
            assert_eq!(row, &kv[..], "ps {ps}, round {round}");
            let e = a.req_pool().expansion(&ra);
            assert_eq!(e.shaped, if hit < len { hit..len } else { 0..0 });
            let all: Vec<u32> =
                (hit + 1..len).filter(|&p| row[p] != row[p - 1].wrapping_add(1)).map(|p| p as u32).collect();
            if all.len() > ROW_BREAKS {
                overflowed += 1;
                assert_eq!(e.breaks.at(), &all[..ROW_BREAKS], "ps {ps}, round {round}");
                assert_eq!(e.breaks.known(), all[ROW_BREAKS] as usize, "ps {ps}, round {round}");
            } else if hit < len {
                assert_eq!(e.breaks.at(), &all[..], "ps {ps}, round {round}: {row:?}");
                assert_eq!(e.breaks.known(), len, "ps {ps}, round {round}");
            }
            let ca = a.cache_finished_req(0, &key, ra, la, 0).map_err(|e| e.error).unwrap();
            let cb = b.cache_finished_req(0, &key, rb, lb, 0).map_err(|e| e.error).unwrap();
            assert_eq!((ca, snapshot(&a)), (cb, snapshot(&b)), "ps {ps}, round {round}");
        }
    }
    // Both the overflow and the chunk joints were reached.
    assert!(overflowed > 0 && extended > 0, "overflowed {overflowed}, extended {extended}");
}

#[test]
fn alloc_extend_row_errors_change_nothing() {
    let c = paged_cache(64, 4);
    let mut row = c.req_pool().alloc().unwrap();
    let before = snapshot(&c);
    // Past the row's end (64 positions), a prefix longer than the sequence, and a
    // prefix whose last slot (read from the row: 0) is no slot.
    assert!(matches!(c.alloc_extend_row(&mut row, 60, 70), Err(AllocError::Row(RowError::OutOfBounds { .. }))));
    assert!(matches!(c.alloc_extend_row(&mut row, 8, 4), Err(AllocError::Invalid(_))));
    assert!(matches!(c.alloc_extend_row(&mut row, 3, 8), Err(AllocError::Invalid(_))));
    assert_eq!(snapshot(&c), before);
    // More than the pool holds.
    let small = paged_cache(32, 4);
    let mut r = small.req_pool().alloc().unwrap();
    let before_small = snapshot(&small);
    assert!(matches!(small.alloc_extend_row(&mut r, 0, 64), Err(AllocError::OutOfMemory(_))));
    assert_eq!(snapshot(&small), before_small);
    assert_eq!(c.req_pool().read(&row, 0..64).unwrap(), &[0; 64]);
    // A row of another pool.
    let other = ReqToTokenPool::new(1, 64).unwrap();
    let mut foreign = other.alloc().unwrap();
    assert!(matches!(c.alloc_extend_row(&mut foreign, 0, 4), Err(AllocError::Row(RowError::ForeignRow { .. }))));
    assert_eq!(snapshot(&c), before);
}

#[test]
fn a_write_over_the_allocated_part_makes_the_row_checked_again() {
    // What `alloc_extend_row` wrote is checked by page starts only; a slot changed
    // afterwards inside a page (by `write` or through `read_mut`) must be caught, so
    // every such write makes the row forget what the allocator wrote.
    use crate::error::InvalidInput;
    let key: Vec<u32> = (1..=16).collect();
    for via_read_mut in [false, true] {
        let c = paged_cache(64, 4);
        let mut row = c.req_pool().alloc().unwrap();
        let lease = c.match_and_lock(0, &key, &mut [0; 16]);
        let hit = lease.len();
        c.alloc_extend_row(&mut row, hit, 16).unwrap();
        // Swap two slots inside the third page: its first slot stays right.
        let mut kv = [0u32; 16];
        kv.copy_from_slice(c.req_pool().read(&row, 0..16).unwrap());
        kv.swap(9, 10);
        if via_read_mut {
            c.req_pool().read_mut(&mut row, 8..16).unwrap().copy_from_slice(&kv[8..]);
        } else {
            c.req_pool().write(&mut row, 9, &kv[9..11]).unwrap();
        }
        let before = snapshot(&c);
        let e = c.cache_finished_req(0, &key, row, lease, 0).unwrap_err();
        assert_eq!(e.error, CacheError::Invalid(InvalidInput::NotAPage { slot: kv[8] }), "read_mut: {via_read_mut}");
        assert_eq!(snapshot(&c), before);
    }
    // A write past the allocated part (a decode step's slot) keeps it: still cached.
    let c = paged_cache(64, 4);
    let mut row = c.req_pool().alloc().unwrap();
    let lease = c.match_and_lock(0, &key, &mut [0; 16]);
    let hit = lease.len();
    c.alloc_extend_row(&mut row, hit, 15).unwrap();
    let last = c.req_pool().read(&row, 14..15).unwrap()[0];
    let mut one = [0u32];
    c.alloc_decode(&[16], &[last], &mut one).unwrap();
    c.req_pool().write(&mut row, 15, &one).unwrap();
    assert_eq!(crate::ReqToTokenPool::shaped(&row), 0..15);
    assert_eq!(c.cache_finished_req(0, &key, row, lease, 0).map_err(|e| e.error).unwrap(), 0);
    assert_eq!(c.total_size(), 16);
}

#[test]
fn shape_run_agrees_with_a_full_scan_on_page_shaped_rows() {
    // Rows of whole pages in order (what an expansion writes) with runs of every
    // length and breaks between pages; any trusted window of whole pages gives the
    // same run lengths as comparing every slot.
    use super::writer::{ascending_len, shape_run};
    let ps = 4usize;
    let mut rng = 0x9e37_79b9_u64;
    for _ in 0..200 {
        let pages = 1 + (rng % 24) as usize;
        let mut row = Vec::new();
        let mut page = 1u32;
        for _ in 0..pages {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            page += if rng >> 61 == 0 { 2 + (rng >> 40) as u32 % 5 } else { 1 };
            row.extend((0..ps as u32).map(|k| page * ps as u32 + k));
        }
        for t0 in (0..=pages).map(|p| p * ps) {
            for t1 in (t0..=pages).map(|p| p * ps) {
                for i in (0..pages).map(|p| p * ps) {
                    let want = ascending_len(&row[i..], row[i]);
                    assert_eq!(shape_run(&row, i, 0, ps, t0..t1), want, "row {row:?}, trusted {t0}..{t1}, at {i}");
                }
            }
        }
    }
}

#[test]
fn a_match_into_the_row_is_trusted_only_for_its_own_lease_and_until_overwritten() {
    // The row holds the tree's slots where `match_and_lock_row` wrote them; the finish
    // does not compare them again. A slot written over afterwards, or the row used
    // with another lease, is compared as before and refused.
    let key: Vec<u32> = (1..=12).collect();
    let other: Vec<u32> = (101..=112).collect();
    let setup = || {
        let c = paged_cache(64, 4);
        for k in [&key, &other] {
            let mut s = [0u32; 8];
            c.allocator().alloc(&mut s).unwrap();
            c.insert(0, &k[..8], &s, 0).unwrap();
        }
        c
    };
    // Trusted and right: cached as with a copied row.
    let c = setup();
    let mut row = c.req_pool().alloc().unwrap();
    let lease = c.match_and_lock_row(0, &key, &mut row).unwrap();
    assert_eq!(lease.len(), 8);
    let mut want = [0u32; 8];
    assert_eq!(c.match_prefix(0, &key, &mut want).len(), 8);
    assert_eq!(c.req_pool().read(&row, 0..8).unwrap(), &want);
    c.alloc_extend_row(&mut row, 8, 12).unwrap();
    assert_eq!(c.cache_finished_req(0, &key, row, lease, 0).map_err(|e| e.error).unwrap(), 8);
    assert_eq!(c.total_size(), 20);
    // A prefix slot written over (with another page's slot) after the match: refused.
    let c = setup();
    let mut row = c.req_pool().alloc().unwrap();
    let lease = c.match_and_lock_row(0, &key, &mut row).unwrap();
    c.alloc_extend_row(&mut row, 8, 12).unwrap();
    let bad = c.req_pool().read(&row, 8..9).unwrap()[0];
    c.req_pool().write(&mut row, 4, &[bad]).unwrap();
    let before = snapshot(&c);
    let e = c.cache_finished_req(0, &key, row, lease, 0).unwrap_err();
    assert_eq!(e.error, CacheError::RowMismatch { index: 4, slot: bad });
    assert_eq!(snapshot(&c), before);
    // A row matched for one path, finished with the lease of another: refused.
    let c = setup();
    let mut row = c.req_pool().alloc().unwrap();
    let mut row2 = c.req_pool().alloc().unwrap();
    let lease_key = c.match_and_lock_row(0, &key, &mut row).unwrap();
    let lease_other = c.match_and_lock_row(0, &other, &mut row2).unwrap();
    let before = snapshot(&c);
    let e = c.cache_finished_req(0, &other[..8], row, lease_other, 0).unwrap_err();
    assert!(matches!(e.error, CacheError::RowMismatch { index: 0, .. }), "{:?}", e.error);
    assert_eq!(snapshot(&c), before);
    drop((e, lease_key, row2));
    // A key longer than the row is cut to it.
    let c = RadixCache::new(
        PagedAllocator::new(64, 4).unwrap(),
        ReqToTokenPool::new(1, 8).unwrap(),
        RadixConfig::default(),
    )
    .unwrap();
    let mut s = [0u32; 8];
    c.allocator().alloc(&mut s).unwrap();
    c.insert(0, &key[..8], &s, 0).unwrap();
    let mut row = c.req_pool().alloc().unwrap();
    assert_eq!(c.match_and_lock_row(0, &key, &mut row).unwrap().len(), 8);
    // Another pool's row: an error, nothing locked.
    let foreign = ReqToTokenPool::new(1, 64).unwrap();
    let mut f = foreign.alloc().unwrap();
    assert!(matches!(c.match_and_lock_row(0, &key, &mut f), Err(RowError::ForeignRow { .. })));
    assert_eq!(c.protected_size(), 0);
}

// ---- misuse: each of these once handed a slot to two owners or changed state on a
// failed call (found by an audit of the public API) ----

/// A lease detached before `reset` used to outlive it: its request still read the
/// slots its match locked, which the reset gave back to the allocator (here the same
/// slots went to a new insert, so two owners shared them), and its lease named a node
/// of the old tree. The reset is refused while a lease is outstanding now, as SGLang
/// refuses to flush its cache with requests running; nothing changes then.
#[test]
fn a_reset_is_refused_while_a_lease_is_outstanding() {
    let mut c = token_cache(16, EvictionPolicy::Lru);
    let t = [10u32, 11, 12, 13];
    let s = alloc_slots(&c, 4);
    c.insert(0, &t, &s, 0).unwrap();
    let mut row = c.req_pool().alloc().unwrap();
    let raw = c.match_and_lock_row(0, &t, &mut row).unwrap().detach();
    let mut hit = [0u32; 4];
    let second = c.match_and_lock(0, &t[..2], &mut hit).detach();
    let empty = c.match_and_lock(0, &[99], &mut hit).detach(); // locks nothing
    let before = (c.total_size(), c.protected_size(), c.allocator().available_size(), c.node_count());
    assert_eq!(c.reset(), Err(CacheError::Leased { leases: 2 }));
    assert_eq!(before, (c.total_size(), c.protected_size(), c.allocator().available_size(), c.node_count()));
    assert!(s.iter().all(|&x| c.allocator().is_allocated(x)));
    c.check_invariants().unwrap();
    c.release(second).unwrap();
    assert_eq!(c.reset(), Err(CacheError::Leased { leases: 1 }));
    // The request finishes: its lease goes with it.
    c.cache_finished_req(0, &t, row, c.attach(raw).unwrap(), 0).unwrap();
    c.release(empty).unwrap();
    c.reset().unwrap();
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, 16));
    // Leases that moved (an unfinished request's) and dropped ones count right.
    let s = alloc_slots(&c, 4);
    c.insert(0, &t, &s, 0).unwrap();
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = c.match_and_lock_row(0, &t, &mut row).unwrap();
    c.cache_unfinished_req(0, &t, &mut row, &mut lease, 0).unwrap();
    let raw = lease.detach();
    assert_eq!(c.reset(), Err(CacheError::Leased { leases: 1 }));
    drop(c.attach(raw).unwrap());
    let row_slots = c.req_pool().read(&row, 0..4).unwrap().to_vec();
    assert_eq!(row_slots, s);
    c.req_pool().free(row).unwrap();
    c.reset().unwrap();
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, 16));
    c.check_invariants().unwrap();
}

/// A request continues only a page of its own: a prefix ending inside a page the tree
/// holds (here the request re-computes its last matched token) would be handed the
/// page's next slot, the tree's. Refused before anything is evicted or allocated, in
/// `alloc_extend_row`, `alloc_extend` and `alloc_decode`, and by the cache's allocator.
#[test]
fn continuing_a_cached_page_is_refused() {
    let c = RadixCache::new(
        PagedAllocator::new(64, 4).unwrap(),
        ReqToTokenPool::new(4, 64).unwrap(),
        RadixConfig::default(),
    )
    .unwrap();
    let t: Vec<u32> = (100..108).collect();
    let s = alloc_slots(&c, 8);
    c.insert(0, &t, &s, 0).unwrap();
    let avail = c.allocator().available_size();
    let mut row = c.req_pool().alloc().unwrap();
    let lease = c.match_and_lock_row(0, &t, &mut row).unwrap();
    assert_eq!(lease.len(), 8);
    let e = c.alloc_extend_row(&mut row, 7, 8).unwrap_err();
    assert!(
        matches!(e, AllocError::Invalid(InvalidInput::LastLocCached { request: 0, last_loc }) if last_loc == s[6]),
        "{e:?}"
    );
    let e = c.alloc_extend(&[6], &[8], &[s[5]], &mut [0; 2]).unwrap_err();
    assert!(matches!(e, AllocError::Invalid(InvalidInput::LastLocCached { .. })), "{e:?}");
    let e = c.alloc_decode(&[7], &[s[5]], &mut [0; 1]).unwrap_err();
    assert!(matches!(e, AllocError::Invalid(InvalidInput::LastLocCached { .. })), "{e:?}");
    // The cache's allocator (no eviction) refuses it too.
    let e = c.allocator().alloc_extend(&[6], &[8], &[s[5]], &mut [0; 2]).unwrap_err();
    assert!(matches!(e, AllocError::Invalid(InvalidInput::LastLocCached { .. })), "{e:?}");
    let e = c.allocator().alloc_decode(&[7], &[s[5]], &mut [0; 1]).unwrap_err();
    assert!(matches!(e, AllocError::Invalid(InvalidInput::LastLocCached { .. })), "{e:?}");
    assert_eq!((c.allocator().available_size(), c.total_size()), (avail, 8));
    // A page-aligned prefix starts a fresh page, and the request's own partial page
    // may be continued.
    c.alloc_extend_row(&mut row, 8, 10).unwrap();
    c.alloc_extend_row(&mut row, 10, 12).unwrap();
    let own = c.req_pool().read(&row, 8..12).unwrap().to_vec();
    assert_eq!(own[1..], [own[0] + 1, own[0] + 2, own[0] + 3]);
    drop(lease);
    c.allocator().free(&own).unwrap();
    c.req_pool().free(row).unwrap();
    c.check_invariants().unwrap();
}

/// `cache_unfinished_req` keeps the request's unaligned tail: it must be the
/// request's own, as `cache_finished_req` checks: not in a page the call caches, nor
/// in a page it frees as a duplicate. Nothing changes on the error.
#[test]
fn an_unfinished_request_keeps_only_a_tail_of_its_own() {
    let c = RadixCache::new(
        PagedAllocator::new(64, 2).unwrap(),
        ReqToTokenPool::new(4, 64).unwrap(),
        RadixConfig::default(),
    )
    .unwrap();
    let t = [1u32, 2, 3];
    // The tail written into the page the call would cache.
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = c.match_and_lock_row(0, &t, &mut row).unwrap();
    c.alloc_extend_row(&mut row, 0, 2).unwrap();
    let first = c.req_pool().read(&row, 0..1).unwrap()[0];
    c.req_pool().write(&mut row, 2, &[first]).unwrap();
    let e = c.cache_unfinished_req(0, &t, &mut row, &mut lease, 0).unwrap_err();
    assert!(matches!(e, CacheError::RowMismatch { index: 2, .. }), "{e:?}");
    assert_eq!((c.total_size(), c.allocator().is_allocated(first)), (0, true));
    drop(lease);
    c.allocator().free(&[first, first + 1]).unwrap();
    c.req_pool().free(row).unwrap();
    // The tail in a page the call frees as a duplicate.
    let s = alloc_slots(&c, 2);
    c.insert(0, &t[..2], &s, 0).unwrap();
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = c.match_and_lock(0, &[], &mut []);
    c.alloc_extend_row(&mut row, 0, 2).unwrap();
    let first = c.req_pool().read(&row, 0..1).unwrap()[0];
    c.req_pool().write(&mut row, 2, &[first]).unwrap();
    let e = c.cache_unfinished_req(0, &t, &mut row, &mut lease, 0).unwrap_err();
    assert!(matches!(e, CacheError::RowMismatch { index: 2, .. }), "{e:?}");
    assert!(c.allocator().is_allocated(first));
    drop(lease);
    c.allocator().free(&[first, first + 1]).unwrap();
    c.req_pool().free(row).unwrap();
    c.check_invariants().unwrap();
}

/// An allocation larger than what is free and evictable together fails, and evicts
/// nothing for it: a failed call does not empty the cache.
#[test]
fn a_doomed_allocation_evicts_nothing() {
    let c = token_cache(16, EvictionPolicy::Lru);
    let t: Vec<u32> = (0..8).collect();
    let s = alloc_slots(&c, 8);
    c.insert(0, &t, &s, 0).unwrap();
    assert!(c.alloc(&mut [0; 17]).is_err());
    assert_eq!(c.total_size(), 8);
    let held = alloc_slots(&c, 4); // 4 free, 8 evictable
    assert!(c.alloc_extend(&[0], &[13], &[0], &mut [0; 13]).is_err());
    assert_eq!(c.total_size(), 8);
    // A shortfall eviction can cover still evicts it.
    c.alloc_extend(&[0], &[12], &[0], &mut [0; 12]).unwrap();
    assert_eq!(c.total_size(), 0);
    let _ = held;
}

/// The accounting part of `check_invariants`: in a cache driven through requests, a
/// slot that is neither free, cached nor held by a live request is a violation, and so
/// is one counted twice.
#[test]
fn a_slot_missing_from_the_accounting_is_a_violation() {
    let c = std::sync::Arc::new(
        RadixCache::new(
            PagedAllocator::new(64, 4).unwrap(),
            ReqToTokenPool::new(2, 32).unwrap(),
            RadixConfig::default(),
        )
        .unwrap(),
    );
    let mut r = c.admit(0, &[1, 2, 3, 4, 5]).unwrap();
    r.extend(5).unwrap();
    c.check_invariants().unwrap();
    // A page taken from the allocator behind the requests' back (what a finish that
    // forgot a slot would leave): lost.
    let mut lost = [0u32; 4];
    c.alloc.alloc(&mut lost).unwrap();
    let e = c.check_invariants().unwrap_err();
    assert!(e.0.contains("accounting"), "{e}");
    c.alloc.free(&lost).unwrap();
    c.check_invariants().unwrap();
    // A page freed while a request still counts it.
    let own = r.slots()[4];
    c.alloc.free(&[own]).unwrap();
    assert!(c.check_invariants().is_err());
    let mut back = [0u32; 4];
    c.alloc.alloc(&mut back).unwrap();
    assert_eq!(back[0], own);
    c.check_invariants().unwrap();
    r.finish(&[1, 2, 3, 4, 5]).unwrap();
    c.check_invariants().unwrap();
}
