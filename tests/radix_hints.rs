//! The hinted policy's protection rules and order, the reuse policy, and partial-leaf
//! eviction, through the public API.
#![cfg(not(loom))]

use kvpool::radix::{EvictionPolicy, KvEvent, RadixCache, RadixConfig};
use kvpool::{ReqToTokenPool, TokenAllocator};

use std::sync::Arc;

type Cache = RadixCache<TokenAllocator>;

fn cache(policy: EvictionPolicy, size: usize) -> Cache {
    let config = RadixConfig { policy, event_capacity: Some(1024), ..RadixConfig::default() };
    RadixCache::new(TokenAllocator::new(size).unwrap(), ReqToTokenPool::new(2, 64).unwrap(), config).unwrap()
}

/// A request for `key` served and finished: `key` is cached. Its admission is one tick
/// of the admission clock, and a hit on whatever prefix of `key` was cached.
fn put(c: &Arc<Cache>, key: &[u32]) {
    let mut r = c.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    r.finish(key).unwrap();
}

fn cached(c: &Cache, key: &[u32]) -> usize {
    c.peek_prefix(0, key, &mut vec![0; key.len()])
}

/// A request admitted before any of `key` was cached (its match found nothing), so
/// finished after the requests before it: `key` is cached with no hit on its cached
/// prefix (the finish frees the request's duplicates of it).
fn put_unmatched(c: &Arc<Cache>, key: &[u32]) {
    let mut r = c.admit(0, &[]).unwrap();
    r.extend(key.len()).unwrap();
    r.finish(key).unwrap();
}

/// Admit `key` and abort: one tick of the admission clock.
fn admit(c: &Arc<Cache>, key: &[u32]) {
    c.admit(0, key).unwrap().abort();
}

#[test]
fn a_hinted_prefix_goes_after_every_other_leaf() {
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    put(&c, &[5, 6]);
    // [1, 2] is the oldest and as frequent as the others: it would go first.
    assert_eq!(c.hint_prefix(0, &[1, 2, 9], &mut [0; 3], 3), 2);
    assert_eq!(c.evict(2), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[3, 4]), cached(&c, &[5, 6])), (2, 0, 2));
    assert_eq!(c.evict(2), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[5, 6])), (2, 0));
    // Only the protected leaf is left: protection is not a lock, it goes last.
    assert_eq!(c.evict(2), 2);
    assert_eq!(c.total_size(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn protection_ends_with_the_admission_it_was_for() {
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    put(&c, &[7, 8]);
    let clock = c.admissions();
    // Wanted by the second admission from now.
    c.hint_prefix(0, &[1, 2], &mut [0; 2], 2);
    admit(&c, &[7, 8]); // the first: [1, 2] still wanted
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[3, 4])), (2, 0));
    admit(&c, &[9]); // the second: the protection is over
    assert_eq!(c.admissions(), clock + 2);
    // [1, 2] is older and less frequent than [7, 8] (hit once): it goes now.
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[7, 8])), (0, 2));
    c.check_invariants().unwrap();
}

#[test]
fn among_protected_leaves_the_one_wanted_last_goes_first() {
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    c.hint_prefix(0, &[1, 2], &mut [0; 2], 5);
    c.hint_prefix(0, &[3, 4], &mut [0; 2], 2);
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[3, 4])), (0, 2));
    // A later hint of the same node keeps the later stamp.
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    c.hint_prefix(0, &[1, 2], &mut [0; 2], 6);
    c.hint_prefix(0, &[1, 2], &mut [0; 2], 1);
    c.hint_prefix(0, &[3, 4], &mut [0; 2], 3);
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[3, 4])), (0, 2));
}

#[test]
fn frequency_with_aging_orders_unprotected_leaves() {
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    admit(&c, &[1, 2]); // [1, 2]: one hit
    put(&c, &[5, 6]);
    // [3, 4] (no hit, older than [5, 6]) goes first, then [5, 6], then [1, 2].
    assert_eq!(c.evict(1), 2);
    assert_eq!(cached(&c, &[3, 4]), 0);
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[5, 6]), cached(&c, &[1, 2])), (0, 2));
    // Aging: evictions raised the inflation to [5, 6]'s score, so a new leaf scores
    // above [1, 2]'s old score: [1, 2], hit once long ago, now goes before it.
    put(&c, &[7, 8]);
    assert_eq!(c.evict(1), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[7, 8])), (0, 2));
    c.check_invariants().unwrap();
}

#[test]
fn hints_are_ignored_by_the_other_policies() {
    let c = Arc::new(cache(EvictionPolicy::Lru, 64));
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    assert_eq!(c.hint_prefix(0, &[1, 2], &mut [0; 2], 3), 2);
    assert_eq!(c.evict(1), 2);
    assert_eq!(cached(&c, &[1, 2]), 0);
}

#[test]
fn partial_eviction_cuts_the_tail_and_keeps_the_order() {
    let c = Arc::new(cache(EvictionPolicy::Lru, 64).with_partial_eviction(true));
    assert!(c.partial_eviction());
    put(&c, &[1, 2, 3, 4, 5, 6]);
    put(&c, &[7, 8, 9, 10]);
    while c.events().unwrap().pop().is_some() {}
    assert_eq!(c.evict(2), 2);
    assert_eq!((cached(&c, &[1, 2, 3, 4, 5, 6]), cached(&c, &[7, 8, 9, 10])), (4, 4));
    // The removed pages are announced (page size 1: slots are pages).
    let mut removed = 0;
    while let Some(e) = c.events().unwrap().pop() {
        removed += usize::from(matches!(e, KvEvent::BlockRemoved { .. }));
    }
    assert_eq!(removed, 2);
    // The head keeps the leaf's place: it is still the least recently used.
    assert_eq!(c.evict(3), 3);
    assert_eq!((cached(&c, &[1, 2, 3, 4, 5, 6]), cached(&c, &[7, 8, 9, 10])), (1, 4));
    // A whole leaf and the next one's tail.
    assert_eq!(c.evict(2), 2);
    assert_eq!((cached(&c, &[1]), cached(&c, &[7, 8, 9, 10])), (0, 3));
    assert_eq!(c.evictable_size() + c.protected_size(), c.total_size());
    c.check_invariants().unwrap();
    // Whole leaves by default.
    let w = Arc::new(cache(EvictionPolicy::Lru, 64));
    put(&w, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(w.evict(2), 6);
}

#[test]
fn partial_eviction_never_cuts_a_locked_path() {
    let c = Arc::new(cache(EvictionPolicy::Lru, 64).with_partial_eviction(true));
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 7, 8]);
    let lease = c.admit(0, &[1, 2, 3, 4]).unwrap();
    // Only [7, 8] is evictable; asking for more than it frees all of it and stops.
    assert_eq!(c.evict(3), 2);
    assert_eq!(cached(&c, &[1, 2, 3, 4]), 4);
    drop(lease);
    assert_eq!(c.evict(1), 1);
    assert_eq!(cached(&c, &[1, 2, 3, 4]), 3);
    c.check_invariants().unwrap();
}

/// `EvictionPolicy::Reuse`: a conversation that was continued outlives newer one-shot
/// prompts, because continued depths have been extended more often than fresh prompts.
/// (The turns are cached without hits, so the scores below are the depth estimates
/// alone.)
/// Hinted (LRU among equals) evicts the conversation's leaf instead; without the depth
/// rule every leaf is a fresh prompt whose estimate only falls, and the newest go first.
#[test]
fn reuse_keeps_the_conversation_that_was_continued() {
    let c = Arc::new(cache(EvictionPolicy::Reuse, 64));
    // Conversation A: three turns (depths 0, 1, 2); B: two turns (depths 0, 1).
    put_unmatched(&c, &[1, 2]);
    put_unmatched(&c, &[1, 2, 3]);
    put_unmatched(&c, &[1, 2, 3, 4]);
    put_unmatched(&c, &[5]);
    put_unmatched(&c, &[5, 6]);
    // One-shot prompts (depth 0): depth 0 has now been extended 2 times in 6.
    for k in [7, 8, 9, 10] {
        put_unmatched(&c, &[k]);
    }
    // Scores (p when last touched): [4] 1/3 (depth 2, never extended yet), its parent
    // [3] 1/3 (depth 1 before it was extended), [1, 2] 2/3, [6] 2/4 (depth 1, extended
    // once in one), [7] 3/5, [8] 3/6, [9] 3/7, [10] 3/8.
    assert_eq!(c.evict(3), 3);
    assert_eq!(cached(&c, &[1, 2, 3, 4]), 2, "A's unproven depths go first");
    assert_eq!(cached(&c, &[10]), 0, "then the newest one-shot, the lowest estimate");
    assert_eq!(cached(&c, &[5, 6]), 2, "the continued conversation stays");
    assert_eq!(cached(&c, &[9]), 1);
    c.check_invariants().unwrap();

    // Under Hinted: least recently used among equals, all of A goes.
    let h = Arc::new(cache(EvictionPolicy::Hinted, 64));
    for key in [&[1, 2][..], &[1, 2, 3], &[1, 2, 3, 4], &[5], &[5, 6], &[7], &[8], &[9], &[10]] {
        put_unmatched(&h, key);
    }
    assert_eq!(h.evict(3), 4); // [4], [3], then [1, 2] whole
    assert_eq!((cached(&h, &[1, 2, 3, 4]), cached(&h, &[5, 6]), cached(&h, &[10])), (0, 2, 1));
}

/// A leaf under a node other requests already branched from (a shared system prompt)
/// starts a conversation: it does not count as an extension of that node.
#[test]
fn reuse_branching_node_starts_a_conversation() {
    let c = Arc::new(cache(EvictionPolicy::Reuse, 64));
    put_unmatched(&c, &[1, 2]);
    put_unmatched(&c, &[1, 3]); // splits [1, 2]: [1] has one child, [2]: an extension (depth 1)
    put_unmatched(&c, &[1, 4]); // [1] has two children: a new conversation (depth 0)
    put_unmatched(&c, &[1, 3, 5]); // extends [3] (no children): depth 2

    // Scores at creation: [2] 1/3 (d0, 1 in 1 extended... before: 0 in 1), [3] 1/3,
    // [4] (1+1)/(2+2) = 1/2, [5] 1/3. Ties go least recently used: [2], then [5].
    assert_eq!(c.evict(2), 2);
    assert_eq!((cached(&c, &[1, 2]), cached(&c, &[1, 3, 5]), cached(&c, &[1, 4])), (1, 2, 2));
    c.check_invariants().unwrap();
}

/// A split hands a live protection to both halves, and each half's protection ends
/// with its admission: the tail the wanting request does not walk (the rest of a turn
/// its continuation diverged from) goes again by the unprotected order afterwards.
/// Without an expiry entry for the halves that tail stays keyed as protected, behind
/// every unprotected leaf, long after the admission.
#[test]
fn a_split_protection_expires_on_both_halves() {
    for policy in EvictionPolicy::KVPOOL_ONLY {
        let c = Arc::new(cache(policy, 64));
        put(&c, &[1, 2, 3, 4]);
        // Wanted by the second admission from now: the first is that of a request
        // which matched nothing and whose finish caches [1, 2, 7], splitting
        // [1, 2, 3, 4] into [1, 2] and [3, 4], both wanted (and neither hit).
        c.hint_prefix(0, &[1, 2, 3, 4], &mut [0; 4], 2);
        put_unmatched(&c, &[1, 2, 7]);
        admit(&c, &[1, 2, 7]); // the admission the hint was for
        put(&c, &[5, 6]);
        // [3, 4] is older than [5, 6] and as frequent: it goes first now.
        assert_eq!(c.evict(2), 2, "{policy}");
        assert_eq!((cached(&c, &[1, 2, 3, 4]), cached(&c, &[5, 6])), (2, 2), "{policy}");
        c.check_invariants().unwrap();
    }
}

/// A hint protects only within the horizon: the admissions whose prompts, at the mean
/// prompt length so far, fill half the pool. Here 64 slots and 8-token prompts (the
/// cached ones too): 4 admissions. A hint further ahead waits in its word and protects
/// once the clock brings it within the horizon.
#[test]
fn a_hint_beyond_the_horizon_protects_only_once_within_it() {
    let prompt = |k: u32| (100 * k..100 * k + 8).collect::<Vec<u32>>();
    let (a, b) = (prompt(1), prompt(2));
    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &a);
    put(&c, &b);
    admit(&c, &prompt(3)); // mean prompt 8: horizon 64 / (2 * 8) = 4 admissions
    assert_eq!(c.admissions(), 3);
    c.hint_prefix(0, &a, &mut [0; 8], 6); // wanted 6 admissions ahead: not yet
    assert_eq!(c.evict(1), 8);
    assert_eq!((cached(&c, &a), cached(&c, &b)), (0, 8), "a was beyond the horizon");

    let c = Arc::new(cache(EvictionPolicy::Hinted, 64));
    put(&c, &a);
    put(&c, &b);
    admit(&c, &prompt(3));
    c.hint_prefix(0, &a, &mut [0; 8], 6); // the admission 9
    admit(&c, &prompt(4));
    admit(&c, &prompt(5)); // now 5: 4 ahead, within the horizon
    assert_eq!(c.evict(1), 8);
    assert_eq!((cached(&c, &a), cached(&c, &b)), (8, 0), "a is protected now");
    c.check_invariants().unwrap();
}
