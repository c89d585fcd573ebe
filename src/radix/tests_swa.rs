//! The SWA variant: SGLang's `SWARadixCache` semantics on the shared core.

use super::*;
use crate::radix::{CacheError, EvictionPolicy, RadixConfig};
use crate::ReqToTokenPool;

fn cache(full: usize, window_pool: usize, ps: u32, window: usize) -> SwaRadixCache {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() };
    SwaRadixCache::with_window(
        SwaAllocator::new(full, window_pool, ps).unwrap(),
        ReqToTokenPool::new(8, 1024).unwrap(),
        config,
        window,
    )
    .unwrap()
}

fn kv(c: &SwaRadixCache, n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    c.allocator().alloc(&mut v).unwrap();
    v
}

/// Insert `key` as a request would: fresh KV for every token, the duplicates freed.
fn put(c: &SwaRadixCache, key: &[u32]) -> SwaInsert {
    let slots = kv(c, key.len());
    let r = c.insert(0, key, &slots).unwrap();
    c.allocator().free(&slots[..r.cached]).unwrap();
    c.check_invariants().unwrap();
    r
}

fn matched(c: &SwaRadixCache, key: &[u32]) -> usize {
    let mut out = vec![0u32; key.len()];
    let n = c.match_prefix(0, key, &mut out).len();
    assert_eq!(c.peek_prefix(0, key, &mut out), n, "a reader sees what the writer matches");
    n
}

/// The node whose tokens end exactly at the end of `key`.
fn node_at(c: &SwaRadixCache, key: &[u32]) -> u32 {
    c.write(|w| {
        let ps = w.c.ps;
        let (mut pos, mut cur, mut node) = (0usize, 0u32, ROOT);
        while pos < key.len() {
            let Lookup::Found { id, .. } = w.c.find_child_in::<true>(cur, 0, &key[pos..pos + ps]) else {
                panic!("{key:?} is not cached");
            };
            pos += w.len_of(id);
            cur = w.s.meta[id as usize].last_page;
            node = id;
        }
        assert_eq!(pos, key.len(), "{key:?} does not end at a node boundary");
        node
    })
}

fn tomb(c: &SwaRadixCache, key: &[u32]) {
    let id = node_at(c, key);
    c.write(|w| tombstone(w, id));
    c.check_invariants().unwrap();
}

fn is_tomb(c: &SwaRadixCache, key: &[u32]) -> bool {
    let id = node_at(c, key);
    c.write(|w| w.s.meta[id as usize].ext.tomb)
}

fn seq(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

/// Nodes [1,2,3] [4,5] [6,7] [8..=n] on one path, with a side leaf after each cut.
fn path_with_cuts(c: &SwaRadixCache, n: u32) {
    put(c, &seq(n));
    for cut in [3u32, 5, 7] {
        let mut side = seq(cut);
        side.push(100 + cut);
        put(c, &side);
    }
}

#[test]
fn window_counter_restarts_at_every_tombstone() {
    let c = cache(64, 64, 1, 4);
    path_with_cuts(&c, 11);
    tomb(&c, &seq(3));
    tomb(&c, &seq(7));
    // [1,2,3]† [4,5] [6,7]† [8,9,10,11]: the last 4 tokens of [1..=9] include the
    // tombstoned 6 and 7, so no prefix of it but the empty one is usable. (SGLang's
    // older rule kept counting across the second tombstone, because only 2 < 4 tokens
    // were matched since the first, and returned all 9.)
    assert_eq!(matched(&c, &seq(9)), 0);
    assert_eq!(matched(&c, &seq(5)), 0);
    // Four live tokens after the last tombstone: the whole path.
    assert_eq!(matched(&c, &seq(11)), 11);
    // A path without tombstones may end anywhere.
    let c = cache(64, 64, 1, 4);
    path_with_cuts(&c, 11);
    assert_eq!(matched(&c, &seq(2)), 2);
    // A tombstone after enough live tokens: the match ends before it.
    tomb(&c, &seq(7));
    assert_eq!(matched(&c, &seq(9)), 5);
    assert_eq!(matched(&c, &[1, 2, 3, 103]), 4);
}

#[test]
fn the_window_pass_tombstones_internal_nodes_and_removes_leaves() {
    let c = cache(64, 64, 1, 2);
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 5, 6]);
    assert_eq!((c.total_size(), c.swa_evictable_size()), (6, 6));
    // The shared prefix is the least recently used (SGLang re-times the lower half of
    // a split): it becomes a tombstone, keeping its full KV.
    assert_eq!(c.evict_swa(1), 2);
    assert!(is_tomb(&c, &[1, 2]));
    assert_eq!((c.total_size(), c.tombstone_size(), c.swa_evictable_size()), (6, 2, 4));
    assert_eq!(c.allocator().window_available_size(), 64 - 4);
    assert_eq!(c.allocator().full_available_size(), 64 - 6);
    // Next a leaf: removed whole.
    assert_eq!(c.evict_swa(1), 2);
    assert_eq!((c.total_size(), c.tombstone_size()), (4, 2));
    c.check_invariants().unwrap();
    // The full pass removes the last leaf, and the tombstone left childless with it.
    assert_eq!(c.evict(1), 4);
    assert_eq!((c.total_size(), c.node_count()), (0, 0));
    assert_eq!((c.allocator().full_available_size(), c.allocator().window_available_size()), (64, 64));
    c.check_invariants().unwrap();
}

#[test]
fn evict_both_counts_the_window_freed_by_the_full_pass() {
    let c = cache(64, 64, 1, 2);
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 5, 6]);
    put(&c, &[7, 8]);
    // The full pass removes [3,4] (least recently used leaf), freeing 2 window
    // tokens; 1 more is asked of the window pass, which tombstones [1,2].
    assert_eq!(c.evict_both(1, 3), (2, 4));
    assert!(is_tomb(&c, &[1, 2]));
    c.check_invariants().unwrap();
}

#[test]
fn allocating_evicts_each_pools_shortfall() {
    // A small window pool: allocating tombstones instead of dropping the tree.
    let c = cache(64, 8, 1, 2);
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 5, 6]);
    assert_eq!(c.allocator().window_available_size(), 2);
    let mut out = [0u32; 4];
    c.alloc(&mut out).unwrap();
    assert!(is_tomb(&c, &[1, 2]));
    assert_eq!(c.total_size(), 6);
    c.check_invariants().unwrap();
    c.allocator().free(&out).unwrap();
    // Asking for more than both can give: an error naming what is evictable, and the
    // cache emptied in the attempt.
    let mut big = [0u32; 16];
    let e = c.alloc(&mut big).unwrap_err();
    assert!(e.to_string().contains("sliding-window tokens"), "{e}");
    c.check_invariants().unwrap();
}

#[test]
fn an_insert_revives_a_tombstone_with_the_requests_window_kv() {
    let c = cache(64, 64, 1, 2);
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 5, 6]);
    tomb(&c, &[1, 2]);
    let window_before = c.allocator().window_available_size();
    // A request recomputed [1, 2] (the match could not end after the tombstone).
    let slots = kv(&c, 4);
    let given = c.allocator().window_slot(slots[0]);
    let r = c.insert(0, &[1, 2, 7, 8], &slots).unwrap();
    assert_eq!(r, SwaInsert { cached: 2, inserted: 4 });
    assert!(!is_tomb(&c, &[1, 2]));
    // The tree's pages took the request's window pages; the request's duplicate full
    // pages go back without them.
    let tree = node_at(&c, &[1, 2]);
    let first = c.write(|w| w.runs(tree).next().unwrap().0);
    assert_eq!(c.allocator().window_slot(first), given);
    assert_eq!(c.allocator().window_slot(slots[0]), None);
    c.allocator().free(&slots[..2]).unwrap();
    assert_eq!(c.allocator().window_available_size(), window_before - 4);
    assert_eq!(c.tombstone_size(), 0);
    assert_eq!(matched(&c, &[1, 2]), 2);
    c.check_invariants().unwrap();
}

#[test]
fn a_partial_revival_splits_the_tombstone() {
    let c = cache(64, 64, 1, 2);
    put(&c, &[1, 2, 3, 9]);
    put(&c, &[1, 2, 3, 5]);
    tomb(&c, &[1, 2, 3]);
    let slots = kv(&c, 4);
    // The request released the window KV of its first token already.
    c.allocator().free_swa(&slots[..1]).unwrap();
    c.insert(0, &[1, 2, 3, 6], &slots).unwrap();
    c.allocator().free(&slots[..3]).unwrap();
    assert!(is_tomb(&c, &[1]));
    assert!(!is_tomb(&c, &[1, 2, 3]));
    assert_eq!(c.tombstone_size(), 1);
    assert_eq!(matched(&c, &[1, 2, 3, 6]), 4);
    c.check_invariants().unwrap();
    // Pages the tree holds cannot give their window KV (the caller passed the tree's
    // own slots): nothing is revived.
    tomb(&c, &[1, 2, 3]);
    let mut out = [0u32; 4];
    c.match_prefix(0, &[1, 2, 3, 6], &mut out);
    let r = c.insert(0, &[1, 2, 3, 6], &out).unwrap();
    assert_eq!(r.cached, 4);
    assert!(is_tomb(&c, &[1, 2, 3]));
    c.check_invariants().unwrap();
}

#[test]
fn window_locks_cover_the_last_window_tokens() {
    let c = cache(64, 64, 1, 3);
    path_with_cuts(&c, 8);
    // [1,2,3] [4,5] [6,7] [8]: a lease on the whole path locks [8], [6,7] (3 tokens).
    let mut out = [0u32; 8];
    let lease = c.match_and_lock(0, &seq(8), &mut out);
    assert_eq!(lease.len(), 8);
    assert_eq!(c.swa_protected_size(), 3);
    assert_eq!(c.protected_size(), 8);
    // The window pass may tombstone what the window lock leaves out.
    let freed = c.evict_swa(100);
    assert_eq!(freed, 3 + 2 + 3, "[1,2,3], [4,5] and the three one-token side leaves");
    assert!(is_tomb(&c, &seq(3)) && is_tomb(&c, &seq(5)));
    assert!(!is_tomb(&c, &seq(7)));
    // A split inside the locked part (a match ending at 6) keeps the lock exact.
    assert_eq!(matched(&c, &seq(6)), 0);
    drop(lease);
    assert_eq!((c.swa_protected_size(), c.protected_size()), (0, 0));
    c.check_invariants().unwrap();
}

#[test]
fn a_stale_match_cannot_be_locked_once_its_window_is_gone() {
    let c = cache(64, 64, 1, 3);
    path_with_cuts(&c, 8);
    let mut out = [0u32; 8];
    let m = c.match_prefix(0, &seq(8), &mut out);
    assert_eq!(m.len(), 8);
    tomb(&c, &seq(7));
    assert!(matches!(c.lock(&m), Err(CacheError::StaleMatch)));
    c.check_invariants().unwrap();
}

#[test]
fn released_window_kv_becomes_a_tombstone_above_a_live_leaf() {
    for ps in [1u32, 4] {
        let c = cache(64, 64, ps, 2);
        let n = 8 * ps as usize;
        let tokens: Vec<u32> = (1..=n as u32).collect();
        let mut row = c.req_pool().alloc().unwrap();
        let slots = kv(&c, n);
        c.req_pool().write(&mut row, 0, &slots).unwrap();
        let mut out = vec![0u32; n];
        let lease = c.match_and_lock(0, &tokens, &mut out);
        // The request decoded on: its first 5 pages fell out of its window.
        let upto = 5 * ps as usize + (ps as usize - 1);
        assert_eq!(c.release_window(&row, &lease, 0..upto).unwrap(), 5 * ps as usize);
        assert_eq!(c.release_window(&row, &lease, 0..upto).unwrap(), 0, "released already");
        c.cache_finished_req(0, &tokens, row, lease).unwrap();
        assert_eq!((c.total_size(), c.tombstone_size()), (n, 5 * ps as usize));
        assert_eq!(matched(&c, &tokens[..5 * ps as usize]), 0);
        assert_eq!(matched(&c, &tokens), n);
        c.check_invariants().unwrap();
    }
}

#[test]
fn a_request_without_window_kv_at_its_end_is_not_cached() {
    let c = cache(64, 64, 1, 2);
    let tokens = seq(6);
    let mut row = c.req_pool().alloc().unwrap();
    let slots = kv(&c, 6);
    c.req_pool().write(&mut row, 0, &slots).unwrap();
    let lease = c.match_and_lock(0, &tokens, &mut [0u32; 6]);
    c.release_window(&row, &lease, 0..6).unwrap();
    c.cache_finished_req(0, &tokens, row, lease).unwrap();
    assert_eq!(c.total_size(), 0);
    assert_eq!((c.allocator().full_available_size(), c.allocator().window_available_size()), (64, 64));
    c.check_invariants().unwrap();
}

#[test]
fn release_window_refuses_pages_the_tree_holds() {
    let c = cache(64, 64, 1, 2);
    put(&c, &seq(4));
    let mut out = [0u32; 4];
    let lease = c.match_and_lock(0, &seq(4), &mut out);
    let mut row = c.req_pool().alloc().unwrap();
    c.req_pool().write(&mut row, 0, &out).unwrap();
    // Pretend the lease covers less: the tree's slots follow it in the row.
    let empty = c.match_and_lock(0, &[], &mut []);
    let e = c.release_window(&row, &empty, 0..4).unwrap_err();
    assert!(matches!(e, CacheError::RowMismatch { index: 0, .. }), "{e:?}");
    // Within the lease: nothing to do.
    assert_eq!(c.release_window(&row, &lease, 0..4).unwrap(), 0);
    c.check_invariants().unwrap();
    drop((lease, empty));
    c.req_pool().free(row).unwrap();
}

#[test]
fn chunked_prefill_keeps_its_window_locked() {
    let c = cache(64, 64, 1, 3);
    let tokens = seq(10);
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = c.match_and_lock(0, &tokens, &mut [0u32; 10]);
    let first = kv(&c, 6);
    c.req_pool().write(&mut row, 0, &first).unwrap();
    c.cache_unfinished_req(0, &tokens[..6], &mut row, &mut lease).unwrap();
    assert_eq!(lease.len(), 6);
    assert_eq!((c.protected_size(), c.swa_protected_size()), (6, 6));
    let rest = kv(&c, 4);
    c.req_pool().write(&mut row, 6, &rest).unwrap();
    c.release_window(&row, &lease, 0..7).unwrap(); // token 6 fell out of the window
    c.cache_finished_req(0, &tokens, row, lease).unwrap();
    assert_eq!((c.protected_size(), c.swa_protected_size()), (0, 0));
    assert_eq!((c.total_size(), c.tombstone_size()), (10, 1));
    c.check_invariants().unwrap();
}

#[test]
fn construction_errors() {
    let e = SwaRadixCache::with_window(
        SwaAllocator::new(64, 16, 1).unwrap(),
        ReqToTokenPool::new(1, 8).unwrap(),
        RadixConfig::default(),
        0,
    );
    assert!(matches!(e, Err(ConfigError::Zero(_))));
}

/// The pages an insert cuts off (no window KV: not inserted) are checked as the rest:
/// slots out of range, the padding page, free slots, a page the tree holds or a page
/// cut in two are errors, not an insert of nothing.
#[test]
fn cut_pages_are_checked_too() {
    let c = cache(64, 16, 1, 4);
    for bad in [[u32::MAX - 1, u32::MAX], [0, 0], [5, 6]] {
        assert!(c.insert(0, &[1, 2], &bad).is_err(), "{bad:?}");
    }
    // Pages the tree holds, their window KV evicted (a tombstone): cut off, and not
    // the caller's.
    let s = kv(&c, 2);
    c.insert(0, &[7, 8], &s).unwrap();
    put(&c, &[7, 8, 5, 6]);
    assert_eq!(c.evict_swa(2), 2);
    assert!(!c.allocator().window().is_mapped(s[0]));
    let e = c.insert(0, &[9, 9], &s).unwrap_err();
    assert!(matches!(e, CacheError::SlotNotOwned { slot } if slot == s[0]), "{e:?}");
    // The caller's own slots without window KV: cut off, nothing inserted, no error.
    let own = kv(&c, 2);
    c.allocator().free_swa(&own).unwrap();
    assert_eq!(c.insert(0, &[3, 4], &own).unwrap(), SwaInsert { cached: 0, inserted: 0 });
    c.check_invariants().unwrap();
    // At page size 2, a cut page must be a whole page.
    let c = cache(64, 16, 2, 4);
    let s = kv(&c, 4);
    c.allocator().free_swa(&s[2..]).unwrap();
    let e = c.insert(0, &[1, 2, 3, 4], &[s[0], s[1], s[3], s[2]]).unwrap_err();
    assert!(matches!(e, CacheError::Invalid(_)), "{e:?}");
    c.check_invariants().unwrap();
}

/// The cache's allocator refuses to free, or to release the window KV of, a page the
/// tree holds: either would leave the page cached and free (or windowless) at once.
#[test]
fn the_cache_allocator_refuses_the_trees_pages() {
    use crate::error::FreeErrorKind;
    let c = cache(64, 16, 1, 4);
    let s = kv(&c, 2);
    c.insert(0, &[7, 8], &s).unwrap();
    let (full, window) = (c.allocator().full_available_size(), c.allocator().window_available_size());
    let own = kv(&c, 1);
    for e in [c.allocator().free(&[own[0], s[1]]).unwrap_err(), c.allocator().free_swa(&[own[0], s[1]]).unwrap_err()] {
        assert_eq!((e.index, e.kind, e.rest_freed), (s[1], FreeErrorKind::Cached, false));
    }
    assert_eq!((c.allocator().full_available_size(), c.allocator().window_available_size()), (full - 1, window - 1));
    c.allocator().free(&own).unwrap();
    c.check_invariants().unwrap();
}
