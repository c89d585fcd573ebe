#![cfg(all(loom, not(shuttle)))]
//! Loom models of the router hints of `EvictionPolicy::Hinted` (issue 13): the hint
//! word's compare-and-swap loop, and its generation check against a record reused
//! under it.
//!
//! Run with `scripts/loom.sh loom_radix_hints`. As in `loom_radix`, writers are
//! spawned before readers (tokio-rs/loom#392) and every model counts its executions and
//! the outcomes it names.
//!
//! | model | what it proves |
//! |---|---|
//! | `racing_hints_keep_the_later_admission` | two routers hinting one prefix at once: the later of their two admissions is the one that protects it, whichever CAS wins first |
//! | `hint_racing_evict_and_reuse` | a hint for a node that is evicted, and whose record is reused for other tokens, under it, never protects the new node |

mod loom_common;

use loom::thread;

use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
use kvpool::{ReqToTokenPool, TokenAllocator};
use loom_common::Outcomes;

type Cache = RadixCache<TokenAllocator>;

/// A hinted cache of `size` KV slots (in a std `Arc`: a request holds one).
fn hinted(size: usize) -> std::sync::Arc<Cache> {
    let config = RadixConfig { policy: EvictionPolicy::Hinted, ..RadixConfig::default() };
    let rows = ReqToTokenPool::new(2, 4).unwrap();
    std::sync::Arc::new(RadixCache::new(TokenAllocator::new(size).unwrap(), rows, config).unwrap())
}

/// Cache `key` through a request; returns the slots that hold it.
fn cache_key(c: &std::sync::Arc<Cache>, key: &[u32]) -> Vec<u32> {
    let mut r = c.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    let slots = r.slots().to_vec();
    r.finish(key).unwrap();
    slots
}

/// One admission of a key nobody caches, aborted at once.
fn admit(c: &std::sync::Arc<Cache>) {
    drop(c.admit(0, &[9, 9]).unwrap());
}

/// Leaves A = [1, 2] (no hits) and B = [3, 4] (one hit): unprotected, A goes first.
/// Two routers hint A at once, wanted at the 1st and at the 3rd admission from now.
/// After two admissions only the second hint still protects A: the eviction of two
/// tokens must take B. Had the CAS loop let the earlier stamp overwrite the later one,
/// A would be unprotected and go.
#[test]
fn racing_hints_keep_the_later_admission() {
    // Which router's CAS lands first is not visible from outside the cache; the model
    // asserts the result in every schedule loom explores (at least two, both routers
    // interleaved: `loom_common::model` fails otherwise).
    loom_common::model("racing_hints_keep_the_later_admission", move || {
        let c = hinted(4);
        let a = cache_key(&c, &[1, 2]);
        cache_key(&c, &[3, 4]);
        drop(c.admit(0, &[3, 4]).unwrap()); // B: one hit (one admission)
        let (c1, c2) = (c.clone(), c.clone());
        let far = thread::spawn(move || {
            let mut out = [0u32; 2];
            c1.hint_prefix(0, &[1, 2], &mut out, 3)
        });
        let near = thread::spawn(move || {
            let mut out = [0u32; 2];
            c2.hint_prefix(0, &[1, 2], &mut out, 1)
        });
        assert_eq!((far.join().unwrap(), near.join().unwrap()), (2, 2));
        admit(&c);
        admit(&c);
        assert_eq!(c.evict(2), 2);
        let mut now = [0u32; 2];
        assert_eq!(c.peek_prefix(0, &[1, 2], &mut now), 2, "A went although the later hint wants it");
        assert_eq!(now[..], a[..]);
        assert_eq!(c.peek_prefix(0, &[3, 4], &mut now), 0);
        c.check_invariants().unwrap();
    });
}

/// A = [1, 2] is cached. A router hints A (wanted at the 5th admission from now) while
/// the writer evicts A and caches [3, 4] (a request admitted before the threads start,
/// which allocates and finishes), which takes A's node record, the free list being
/// last-in first-out. Then [5, 6] is cached (one admission more). The eviction of two
/// tokens must take [3, 4] (older, no hits) however the hint landed: before the
/// eviction (folded away with A, or left in the word with A's generation), or after it
/// (the look-up validated A's old generation, or found nothing and posted nothing).
#[test]
fn hint_racing_evict_and_reuse() {
    let seen = Outcomes::new(&["hint_found_a", "hint_found_nothing"]);
    let s = seen.clone();
    loom_common::model("hint_racing_evict_and_reuse", move || {
        let c = hinted(4);
        cache_key(&c, &[1, 2]);
        let mut req = c.admit(0, &[3, 4]).unwrap();
        let c1 = c.clone();
        let writer = thread::spawn(move || {
            assert_eq!(c1.evict(2), 2);
            req.extend(2).unwrap();
            let reused = req.slots().to_vec();
            req.finish(&[3, 4]).unwrap();
            reused
        });
        let c2 = c.clone();
        let router = thread::spawn(move || {
            let mut out = [0u32; 2];
            c2.hint_prefix(0, &[1, 2], &mut out, 5)
        });
        let reused = writer.join().unwrap();
        let found = router.join().unwrap();
        let fresh = cache_key(&c, &[5, 6]);
        assert_eq!(c.evict(2), 2);
        let mut now = [0u32; 2];
        assert_eq!(c.peek_prefix(0, &[3, 4], &mut now), 0, "a stale hint protected the record's new node");
        assert_eq!(c.peek_prefix(0, &[5, 6], &mut now), 2);
        assert_eq!(now[..], fresh[..]);
        assert!(reused.iter().all(|&x| !c.allocator().is_allocated(x)));
        c.check_invariants().unwrap();
        s.hit(if found == 2 { "hint_found_a" } else { "hint_found_nothing" });
    });
    seen.expect_seen("hint_racing_evict_and_reuse", &["hint_found_a", "hint_found_nothing"]);
}
