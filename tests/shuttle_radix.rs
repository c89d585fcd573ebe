#![cfg(all(loom, shuttle))]
//! Shuttle tests of the radix cache's lock-free lookups on trees too large for loom:
//! hundreds of nodes, readers (`peek_prefix`) racing a splitting thread and a thread
//! that inserts and evicts. Randomized schedules (shuttle's random and PCT schedulers),
//! not every interleaving: loom covers the small cases exhaustively.
//!
//! Run with `scripts/shuttle.sh shuttle_radix`.
//!
//! What every lookup is checked against (`Shadow`): each returned slot holds the token
//! it matched (the token written when the slot was allocated for that key), no slot
//! twice, whole slots in range. Lookups of locked ("pinned") keys find the locked slots.
//! A lookup that begins after everything unlocked was evicted finds nothing of a
//! namespace no one inserts into anymore. At the end: the tree's invariants hold, every
//! slot is either cached or free, and evicting everything frees every slot.
//!
//! | test                                  | what it checks                                   |
//! |---------------------------------------|--------------------------------------------------|
//! | `peek_racing_splits_inserts_evictions`| the above, tolerating (and counting) short results for pinned keys |
//! | `peek_never_misses_pinned_content`    | also that a pinned key is always found whole (it failed until a split's swap bumped the bucket's removal version) |
//! | `peek_across_reused_parent_pages`     | generations of a tree of 24 nodes laid over the same slots, every parent's last page reused by a parent of the next generation with children of the same first tokens: a lookup returns a prefix of one generation's path, never a path joined across two |

mod shuttle_common;

use shuttle::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use shuttle::sync::Arc;
use shuttle::thread;

use kvpool::radix::{RadixCache, RadixConfig, Request};
use kvpool::{ReqToTokenPool, TokenAllocator};
use shuttle_common::{random_in, random_key, schedules, Outcomes, Shadow};

/// Token slots: room for the whole initial tree without eviction.
const SIZE: usize = 1536;
/// Keys inserted before the threads start (namespace 0).
const KEYS: usize = 150;
/// Keys of the namespace that is purged and never written again.
const DOOMED_KEYS: usize = 20;
const DOOMED_NS: u64 = 7;
/// Keys locked for the whole run.
const PINNED: usize = 6;
/// Tokens `1..=ALPHABET`: few, so keys share prefixes and matches split nodes.
const ALPHABET: u32 = 3;
/// A token no key contains: a match ending in it stops inside a node and splits it.
const DIVERGE: u32 = 9;

type Cache = RadixCache<TokenAllocator>;

/// Request rows: the pinned requests', the splitter's and the writer's.
const ROWS: u32 = PINNED as u32 + 2;

/// A key locked for the whole run (by a request the main thread holds): the key and its
/// slots.
type Pinned = (Vec<u32>, Vec<u32>);

/// Cache `key` through a request: admit it, allocate the rest (evicting if short), write
/// the tokens into the request's own slots (the shadow holds them as the request's
/// until it finishes), finish (its duplicates are freed).
fn insert(c: &std::sync::Arc<Cache>, shadow: &Shadow, ns: u64, key: &[u32]) {
    let mut r = c.admit(ns, key).unwrap();
    r.extend(key.len() - r.len()).expect("the cache can always evict enough");
    let (hit, id) = (r.cached_len(), r.row_index() as u32 + 1);
    shadow.claim(id, &r.slots()[hit..], &key[hit..]);
    // Handed to the cache: the shadow lets go first (a lookup may find them once cached).
    shadow.unclaim(id, &r.slots()[hit..]);
    r.finish(key).unwrap();
}

fn random_len_key() -> Vec<u32> {
    random_key(random_in(2..9), ALPHABET)
}

const LABELS: &[&str] = &["nodes", "peeks", "found", "pinned_short", "doomed_found", "doomed_after_purge", "splits"];

/// One schedule. `strict`: a short lookup of a pinned key fails the test (else it is
/// counted as `pinned_short`).
fn scenario(strict: bool, seen: &Outcomes) {
    let c = std::sync::Arc::new(
        RadixCache::new(
            TokenAllocator::new(SIZE).unwrap(),
            ReqToTokenPool::new(ROWS, 16).unwrap(),
            RadixConfig::default(),
        )
        .unwrap(),
    );
    let shadow = Arc::new(Shadow::new(SIZE + 1));
    let keys: Arc<Vec<Vec<u32>>> = Arc::new((0..KEYS).map(|_| random_len_key()).collect());
    for k in keys.iter() {
        insert(&c, &shadow, 0, k);
    }
    let doomed: Arc<Vec<Vec<u32>>> = Arc::new((0..DOOMED_KEYS).map(|_| random_len_key()).collect());
    for k in doomed.iter() {
        insert(&c, &shadow, DOOMED_NS, k);
    }
    assert!(c.node_count() >= 100, "a tree of {} nodes is too small for this test", c.node_count());
    for _ in 0..c.node_count() {
        seen.hit("nodes"); // summed over schedules: the mean tree size is nodes / schedules
    }
    // Pin a few keys: requests admitted for them lock their nodes, so they stay cached
    // with the same slots through every split, insert and eviction.
    let (mut pinned, mut pins) = (vec![], vec![]);
    for _ in 0..PINNED {
        let key = keys[random_in(0..KEYS)].clone();
        let req = c.admit(0, &key).unwrap();
        assert_eq!(req.cached_len(), key.len());
        let out = req.slots().to_vec();
        shadow.lock(&out);
        pinned.push((key, out));
        pins.push(req);
    }
    let pinned: Arc<Vec<Pinned>> = Arc::new(pinned);
    let purged = Arc::new(AtomicBool::new(false));

    let mut threads = vec![];
    // The splitter: matches that end inside nodes (each splits one, unless an earlier
    // split already cut there), some of them admissions (match and lock; aborted).
    {
        let (c, keys, pinned, seen) = (c.clone(), keys.clone(), pinned.clone(), seen.clone());
        threads.push(thread::spawn(move || {
            let nodes = c.node_count();
            for round in 0..25 {
                // Every other split cuts a pinned key's path, the one readers look up most.
                let k = if round % 2 == 1 { &pinned[random_in(0..PINNED)].0 } else { &keys[random_in(0..KEYS)] };
                let mut key = k[..random_in(1..k.len())].to_vec();
                key.push(DIVERGE);
                let mut out = vec![0u32; key.len()];
                if round % 4 == 0 {
                    let req: Request<TokenAllocator> = c.admit(0, &key).unwrap();
                    assert!(req.cached_len() < key.len());
                } else {
                    assert!(c.match_prefix(0, &key, &mut out).len() < key.len());
                }
            }
            if c.node_count() > nodes {
                seen.hit("splits");
            }
        }));
    }
    // The writer: inserts new keys, evicts a little, and once purges everything unlocked.
    {
        let (c, shadow, purged) = (c.clone(), shadow.clone(), purged.clone());
        threads.push(thread::spawn(move || {
            for round in 0..20 {
                insert(&c, &shadow, 0, &random_len_key());
                if round % 5 == 4 {
                    c.evict(random_in(1..24));
                }
                if round == 10 {
                    c.evict(usize::MAX);
                    purged.store(true, Ordering::SeqCst);
                }
            }
        }));
    }
    // Two readers.
    for _ in 0..2 {
        let (c, shadow, keys, doomed, pinned, purged, seen) =
            (c.clone(), shadow.clone(), keys.clone(), doomed.clone(), pinned.clone(), purged.clone(), seen.clone());
        threads.push(thread::spawn(move || {
            for round in 0..30 {
                seen.hit("peeks");
                match round % 3 {
                    0 => {
                        let (key, slots) = &pinned[random_in(0..PINNED)];
                        let mut out = vec![0u32; key.len() + 1];
                        let mut query = key.clone();
                        query.push(1);
                        let n = c.peek_prefix(0, &query, &mut out);
                        shadow.check_match("peek of a pinned key", &query, &out[..n], 1);
                        let m = n.min(key.len());
                        assert_eq!(out[..m], slots[..m], "a pinned key's slots changed");
                        if n < key.len() {
                            seen.hit("pinned_short");
                            assert!(!strict, "peek of a locked key {key:?} found {n} of {} tokens", key.len());
                        }
                    }
                    1 => {
                        let key = &keys[random_in(0..KEYS)];
                        let mut out = vec![0u32; key.len()];
                        let n = c.peek_prefix(0, key, &mut out);
                        shadow.check_match("peek", key, &out[..n], 1);
                        if n > 0 {
                            seen.hit("found");
                        }
                    }
                    _ => {
                        let key = &doomed[random_in(0..DOOMED_KEYS)];
                        let was_purged = purged.load(Ordering::SeqCst);
                        let mut out = vec![0u32; key.len()];
                        let n = c.peek_prefix(DOOMED_NS, key, &mut out);
                        shadow.check_match("peek of a doomed key", key, &out[..n], 1);
                        if was_purged {
                            assert_eq!(n, 0, "found {key:?} after its namespace was evicted");
                            seen.hit("doomed_after_purge");
                        } else if n > 0 {
                            seen.hit("doomed_found");
                        }
                    }
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }

    for ((_, slots), req) in pinned.iter().zip(pins) {
        shadow.unlock(slots);
        req.abort();
    }
    c.check_invariants().unwrap();
    assert_eq!(c.protected_size(), 0);
    assert_eq!(c.total_size() + c.allocator().available_size(), SIZE, "a slot was lost or doubly owned");
    c.evict(usize::MAX);
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, SIZE));
    shadow.assert_nothing_held();
}

/// Readers racing splits, inserts and evictions on a tree of a few hundred nodes return
/// only slots that hold what they matched; a pinned key keeps its slots; a purged
/// namespace stays empty; the tree ends consistent with no slot lost.
#[test]
fn peek_racing_splits_inserts_evictions() {
    let seen = Outcomes::new(LABELS);
    let s = seen.clone();
    shuttle_common::check("peek_racing_splits_inserts_evictions", schedules(4000), move || scenario(false, &s));
    seen.expect_seen(
        "peek_racing_splits_inserts_evictions",
        &["found", "doomed_found", "doomed_after_purge", "splits"],
    );
}

/// The strict version: a lookup of a locked key always finds all of it.
#[test]
fn peek_never_misses_pinned_content() {
    let seen = Outcomes::new(LABELS);
    let s = seen.clone();
    shuttle_common::check("peek_never_misses_pinned_content", schedules(4000), move || scenario(true, &s));
    seen.expect_seen("peek_never_misses_pinned_content", &[]);
}

/// Parents per generation, each `[a, b]` with two children `[1, 7]` and `[2, 7]`.
const PARENTS: usize = 8;
/// Slots a parent's subtree takes: 2 for the parent, 2 for each child.
const SUBTREE: usize = 6;
/// Generations the writer lays over the pool, one after the other.
const GENERATIONS: usize = 3;

/// The two tokens of parent `i` of generation `g`: no other generation's parents hold them.
fn parent_key(g: usize, i: usize) -> [u32; 2] {
    let t = 1000 + (g * PARENTS + i) as u32 * 2;
    [t, t + 1]
}

/// Child `j`'s tokens: the same under every parent of every generation.
fn child_key(j: usize) -> [u32; 2] {
    [j as u32 + 1, 7]
}

/// Where parent `i` of generation `g` lies: a position of the pool, a permutation of
/// the positions per generation. A position's slots are `1 + q * SUBTREE ..`: the
/// parent's two, then its children's two each. So each position's parent's last slot
/// is the last slot of a parent of every generation.
fn position(g: usize, i: usize) -> usize {
    // An odd multiplier is a permutation of 0..8.
    (i * (2 * g + 3) + g) % PARENTS
}

/// The slots of parent `i`'s path to child `j` in generation `g` (4 slots).
fn path_slots(g: usize, i: usize, j: usize) -> [u32; 4] {
    let base = 1 + (position(g, i) * SUBTREE) as u32;
    // Children swap places every generation: a parent of one generation joined to a
    // child of the next would name the other child's slots.
    let child = base + 2 + 2 * (j ^ (g & 1)) as u32;
    [base, base + 1, child, child + 1]
}

/// One schedule: a writer lays generation after generation over the same slots (evict
/// everything, then cache the new tree, a request per path, into fixed slots); two
/// readers look up paths of the current, previous and next generations. Each answer
/// must be a prefix of the one path its key names: the parent's tokens belong to one
/// generation only.
fn reused_parent_pages(seen: &Outcomes) {
    let size = PARENTS * SUBTREE;
    let c = std::sync::Arc::new(
        RadixCache::new(TokenAllocator::new(size).unwrap(), ReqToTokenPool::new(1, 8).unwrap(), RadixConfig::default())
            .unwrap(),
    );
    // The allocator hands out its lowest free slots, and everything is free: requests
    // laid in the order of their slots get those slots (asserted).
    let lay = move |c: &std::sync::Arc<Cache>, g: usize| {
        c.evict(usize::MAX);
        assert_eq!(c.allocator().available_size(), size);
        for q in 0..PARENTS {
            let i = (0..PARENTS).find(|&i| position(g, i) == q).expect("a permutation");
            // The child whose slots come first in this generation, then the other.
            for j in [g & 1, 1 - (g & 1)] {
                let mut key = parent_key(g, i).to_vec();
                key.extend(child_key(j));
                let mut r = c.admit(0, &key).unwrap();
                r.extend(key.len() - r.len()).unwrap();
                assert_eq!(r.slots(), path_slots(g, i, j), "generation {g} parent {i} child {j}: the layout");
                r.finish(&key).unwrap();
            }
        }
        assert_eq!(c.allocator().available_size(), 0);
    };
    lay(&c, 0);
    let now = Arc::new(AtomicUsize::new(0));
    let mut threads = vec![];
    {
        let (c, now) = (c.clone(), now.clone());
        threads.push(thread::spawn(move || {
            for g in 1..=GENERATIONS {
                lay(&c, g);
                now.store(g, Ordering::SeqCst);
            }
        }));
    }
    for _ in 0..2 {
        let (c, now, seen) = (c.clone(), now.clone(), seen.clone());
        threads.push(thread::spawn(move || {
            for _ in 0..12 {
                seen.hit("peeks");
                let g = (now.load(Ordering::SeqCst) + random_in(0..3)).saturating_sub(1);
                let (i, j) = (random_in(0..PARENTS), random_in(0..2));
                let mut key = parent_key(g, i).to_vec();
                key.extend(child_key(j));
                let mut out = [0u32; 4];
                let n = c.peek_prefix(0, &key, &mut out);
                let whole = path_slots(g, i, j);
                assert_eq!(
                    out[..n],
                    whole[..n],
                    "generation {g} parent {i} child {j}: {n} slots {out:?}, not a prefix of {whole:?}"
                );
                seen.hit(match n {
                    0 => "miss",
                    4 => "whole",
                    _ => "part",
                });
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    c.check_invariants().unwrap();
    assert_eq!(c.total_size(), size);
}

/// Lookups racing generations of a tree laid over the same slots never return a path
/// joined across two generations (the parent of one, the child of the next).
#[test]
fn peek_across_reused_parent_pages() {
    let seen = Outcomes::new(&["peeks", "miss", "part", "whole"]);
    let s = seen.clone();
    shuttle_common::check("peek_across_reused_parent_pages", schedules(3000), move || reused_parent_pages(&s));
    seen.expect_seen("peek_across_reused_parent_pages", &["miss", "part", "whole"]);
}
