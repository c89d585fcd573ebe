#![cfg(all(loom, not(shuttle)))]
//! Loom models of the radix cache's concurrency claims (small capacities).
//! (The router hints of issue 13 have theirs in `loom_radix_hints`.)
//!
//! Run with `scripts/loom.sh loom_radix`.
//!
//! # Getting loom to explore the race at all
//!
//! Loom does not reorder a load in one thread with a later store in another
//! (tokio-rs/loom#392): if the reader's loads all come before the writer's stores in
//! loom's first schedule, loom explores that one schedule and the lock-free reader is
//! never model-checked. Loom's first schedule keeps running the main thread and, when it
//! blocks in `join`, runs the spawned threads in spawn order. So every model here spawns
//! the **writer first and the reader second** and has the main thread only join: the
//! first schedule stores before it loads, and from each load loom backtracks to the
//! store it depends on, which puts the reader before, inside and after the writer.
//! Every model counts its executions and fails when loom explored only one
//! (`loom_common::model`), and counts the outcomes it is about (`Outcomes`), failing
//! when an interleaving it names was never reached.
//!
//! Where the reader ran relative to the writer is recorded with two flags around the
//! writer's call (`Span`): the reader reads `done` before its lookup and `started` after
//! it. Done before: the reader ran after. Not started after: it ran before. Otherwise the
//! two calls overlapped — the reader ran *inside* the split or eviction.
//!
//! | model                           | what it proves                                              |
//! |---------------------------------|-------------------------------------------------------------|
//! | `peek_racing_evict`             | a lookup before, inside or after an eviction returns the whole prefix or nothing; after it, nothing; a lookup that read the node and then saw it retired retries (observed) |
//! | `peek_racing_split`             | a lookup before, inside or after a split finds the whole cached prefix (it failed until a split's swap bumped the bucket's removal version) |
//! | `peek_racing_split_returns_a_valid_prefix` | a lookup racing a split returns a prefix of the right slots; before or after it, all of them |
//! | `peek_racing_insert`            | a lookup racing a finish that inserts a new leaf finds the old prefix or the new one, both seen inside the finish |
//! | `peek_racing_evict_and_reuse`   | ABA: a lookup racing the eviction of its node and the reuse of its slots (and record) for other tokens by a request returns the old slots only before the eviction, else nothing |
//! | `peek_across_a_reused_parent_page` | a two-level path whose parent is evicted and whose last page ends another parent with a matching child: a lookup returns the old path whole, its parent, or nothing, never old slots joined to the new child |
//! | `lock_racing_evict`             | an admission's locked node is never evicted; both orders are reached |
//! | `lock_racing_evict_mamba`       | Mamba variant: a state an admitted request resumes from is never freed by `evict_mamba`; an admission after it finds no state and locks nothing; both orders reached |
//! | `peek_racing_mamba_eviction`    | Mamba variant: a lookup racing `evict_mamba` (a tombstoning, then a leaf's removal cascading through its tombstone parent) returns a prefix of the cached slots: all of them before, none after |
//! | `concurrent_overlapping_inserts`| two finishes of overlapping keys: exact sizes, no slot lost; both orders reached |
//! | `request_moves_between_threads` | a request handle admitted and extended on a scheduler thread, finished on an output thread it moves to, while a router looks up: the router sees the cached prefix or the finished request's whole pages, never its uncached slots; the accounting is exact after |
//! | `event_queue_producer_consumer` | events are handed over once and in order, across a lap of the ring; a full queue drops and counts |

mod loom_common;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use kvpool::radix::{EventQueue, KvEvent, MambaRadixCache, RadixCache, RadixConfig, Request};
use kvpool::{ReqToTokenPool, SlotPool, TokenAllocator};
use loom_common::Outcomes;

type Cache = RadixCache<TokenAllocator>;

/// A cache of `size` KV slots and 2 request rows (the cache in a std `Arc`: a request
/// holds one).
fn cache(size: usize) -> std::sync::Arc<Cache> {
    let rows = ReqToTokenPool::new(2, 4).unwrap();
    std::sync::Arc::new(RadixCache::new(TokenAllocator::new(size).unwrap(), rows, RadixConfig::default()).unwrap())
}

/// A Mamba cache of 4 KV slots and `states` state slots.
fn mamba_cache(states: u32) -> std::sync::Arc<MambaRadixCache<TokenAllocator>> {
    let (kv, rows) = (TokenAllocator::new(4).unwrap(), ReqToTokenPool::new(2, 4).unwrap());
    let states = SlotPool::without_magazines(states);
    std::sync::Arc::new(MambaRadixCache::with_states(kv, rows, states, RadixConfig::default()).unwrap())
}

/// A request for `key`, admitted and extended to its end (not finished): the slots it
/// will cache are `slots()`.
fn prefilled(c: &std::sync::Arc<Cache>, key: &[u32]) -> Request<TokenAllocator> {
    let mut r = c.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    r
}

/// Cache `key` through a request; returns the slots that hold it.
fn cache_key(c: &std::sync::Arc<Cache>, key: &[u32]) -> Vec<u32> {
    let r = prefilled(c, key);
    let slots = r.slots().to_vec();
    r.finish(key).unwrap();
    slots
}

/// Two flags around the writer's call, so the reader can tell where it ran.
#[derive(Default)]
struct Span {
    started: AtomicBool,
    done: AtomicBool,
}

/// Where the reader's call ran relative to the writer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Before,
    Inside,
    After,
}

impl Span {
    fn new() -> Arc<Span> {
        Arc::new(Span::default())
    }

    /// The writer: run `f` between the two flags.
    fn write<R>(&self, f: impl FnOnce() -> R) -> R {
        self.started.store(true, Ordering::SeqCst);
        let r = f();
        self.done.store(true, Ordering::SeqCst);
        r
    }

    /// The reader: run `f` and say where it ran.
    fn read<R>(&self, f: impl FnOnce() -> R) -> (R, Place) {
        let after = self.done.load(Ordering::SeqCst);
        let r = f();
        let before = !self.started.load(Ordering::SeqCst);
        let place = match (after, before) {
            (true, _) => Place::After,
            (false, true) => Place::Before,
            (false, false) => Place::Inside,
        };
        (r, place)
    }
}

impl Place {
    fn label(self) -> &'static str {
        match self {
            Place::Before => "before",
            Place::Inside => "inside",
            Place::After => "after",
        }
    }
}

/// A lookup that starts after an eviction finished never finds the evicted node, and a
/// lookup racing the eviction returns the whole cached prefix or nothing — never a
/// partial or garbled one — and never panics on a half-evicted node.
///
/// A lookup writes a node's slots to `out` before it validates the node, so `n == 0`
/// with slots in `out` means the lookup read the node, then found it retired or
/// unlinked, and retried: the model asserts that this retry path was taken.
#[test]
fn peek_racing_evict() {
    let seen = Outcomes::new(&["before_hit", "inside_hit", "inside_miss", "after_miss", "retried"]);
    let s = seen.clone();
    loom_common::model("peek_racing_evict", move || {
        let c = cache(4);
        let slots = cache_key(&c, &[1, 2]);
        let span = Span::new();
        let (c1, span1) = (c.clone(), span.clone());
        let writer = thread::spawn(move || assert_eq!(span1.write(|| c1.evict(2)), 2));
        let (c2, span2) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 2];
            let (n, place) = span2.read(|| c2.peek_prefix(0, &[1, 2], &mut out));
            (n, out, place)
        });
        writer.join().unwrap();
        let (n, out, place) = reader.join().unwrap();
        assert!(n == 0 || (n == 2 && out[..] == slots[..]), "partial or wrong match {n} {out:?}");
        match (place, n) {
            (Place::Before, 2) => s.hit("before_hit"),
            (Place::Before, _) => panic!("missed a node cached throughout the lookup"),
            (Place::Inside, 2) => s.hit("inside_hit"),
            (Place::Inside, _) => s.hit("inside_miss"),
            (Place::After, 0) => s.hit("after_miss"),
            (Place::After, _) => panic!("found a node evicted before the lookup began"),
        }
        if n == 0 && out != [0, 0] {
            s.hit("retried");
        }
        c.check_invariants().unwrap();
        assert_eq!(c.allocator().available_size(), 4);
    });
    seen.expect_seen("peek_racing_evict", &["before_hit", "inside_hit", "inside_miss", "after_miss", "retried"]);
}

/// A concurrent split never makes a lookup miss content that is cached throughout:
/// before, inside and after the split, the lookup finds all of `[1, 2, 3]`.
///
/// Fails: loom finds a lookup inside the split that returns 0. The interleaving (ps 1,
/// `C = [1, 2, 3]` alone in its root bucket, writer `match_prefix([1, 2, 9])` splits
/// `C` into `U = [1, 2] -> C' = [3]`):
///
/// 1. reader `find_child(root, [1])`: loads the bucket head: `C`;
/// 2. writer `split`: `publish(C')` (another bucket), `swap_in(C, U)` (one store puts
///    `U` at the head; before the fix it did not bump the bucket's removal version), `retire(C)`
///    (`C.gen` becomes odd);
/// 3. reader: loads `C.gen`: odd, so it skips `C` as dead, follows `C.hash_next`
///    (`NIL`): `Lookup::Miss`;
/// 4. reader `peek_prefix`: re-reads the bucket's removal version; before the fix it
///    found it unchanged and accepted the miss, returning 0 although `[1, 2, 3]` was
///    cached throughout. Now the version has moved and the lookup retries.
///
/// Not a safety problem (no freed slot is returned) but a false miss that the module
/// docs rule out ("a miss caused by a concurrent unlink is retried": a split's
/// `swap_in` is an unlink too). Fixed: `swap_in` bumps the version as `unlink` does.
#[test]
fn peek_racing_split() {
    let seen = Outcomes::new(&["before", "inside", "after"]);
    let s = seen.clone();
    loom_common::model("peek_racing_split", move || {
        let (n, out, slots, place) = race_peek_with_split();
        assert_eq!(n, 3, "a lookup {place:?} the split missed cached content: {out:?}");
        assert_eq!(out[..], slots[..]);
        s.hit(place.label());
    });
    seen.expect_seen("peek_racing_split", &["before", "inside", "after"]);
}

/// The safety half of `peek_racing_split`, which holds today: a lookup before, inside
/// or after a split returns a prefix of the cached slots (never a garbled or partial
/// page, never a slot of another node). Counts the false misses it tolerates.
#[test]
fn peek_racing_split_returns_a_valid_prefix() {
    let seen = Outcomes::new(&["before", "inside", "after", "short"]);
    let s = seen.clone();
    loom_common::model("peek_racing_split_returns_a_valid_prefix", move || {
        let (n, out, slots, place) = race_peek_with_split();
        assert!(
            n <= 3 && out[..n] == slots[..n],
            "a lookup {place:?} the split returned {n} {out:?}, cached {slots:?}"
        );
        if place != Place::Inside {
            assert_eq!(n, 3, "a lookup {place:?} the split missed cached content: {out:?}");
        }
        s.hit(place.label());
        if n < 3 {
            s.hit("short");
        }
    });
    seen.expect_seen("peek_racing_split_returns_a_valid_prefix", &["before", "inside", "after"]);
}

/// One execution of a lookup of `[1, 2, 3]` racing a split of the node `[1, 2, 3]`:
/// returns (matched, out, the cached slots, where the lookup ran).
fn race_peek_with_split() -> (usize, [u32; 3], Vec<u32>, Place) {
    let c = cache(6);
    let slots = cache_key(&c, &[1, 2, 3]);
    let span = Span::new();
    let (c1, span1) = (c.clone(), span.clone());
    let writer = thread::spawn(move || {
        let mut out = [0u32; 3];
        // Ends inside [1,2,3]: splits it into [1,2] -> [3].
        assert_eq!(span1.write(|| c1.match_prefix(0, &[1, 2, 9], &mut out)).len(), 2);
    });
    let (c2, span2) = (c.clone(), span.clone());
    let reader = thread::spawn(move || {
        let mut out = [0u32; 3];
        let (n, place) = span2.read(|| c2.peek_prefix(0, &[1, 2, 3], &mut out));
        (n, out, place)
    });
    writer.join().unwrap();
    let (n, out, place) = reader.join().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.node_count(), 2);
    (n, out, slots, place)
}

/// A lookup racing a finish that hangs a new leaf `[3, 4]` under the cached `[1, 2]`
/// finds `[1, 2]` and, once the leaf is published, all of `[1, 2, 3, 4]` with the
/// request's slots; never a half-published leaf. Both results are seen inside the
/// finish. (The request is admitted and prefilled before the threads start: the writer's
/// whole part is the finish, the insert and the lock's release.)
#[test]
fn peek_racing_insert() {
    let seen = Outcomes::new(&["before", "inside_old", "inside_new", "after"]);
    let s = seen.clone();
    loom_common::model("peek_racing_insert", move || {
        let c = cache(6);
        let prefix = cache_key(&c, &[1, 2]);
        let req = prefilled(&c, &[1, 2, 3, 4]);
        let inserted = req.slots().to_vec();
        let span = Span::new();
        let span1 = span.clone();
        let writer = thread::spawn(move || span1.write(|| assert_eq!(req.finish(&[1, 2, 3, 4]).unwrap(), 2)));
        let (c2, span2) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 4];
            let (n, place) = span2.read(|| c2.peek_prefix(0, &[1, 2, 3, 4], &mut out));
            (n, out, place)
        });
        writer.join().unwrap();
        let (n, out, place) = reader.join().unwrap();
        assert_eq!(out[..2], prefix[..], "wrong slots for the cached prefix: {out:?}");
        match (place, n) {
            (Place::Before, 2) => s.hit("before"),
            (Place::Inside, 2) => s.hit("inside_old"),
            (Place::Inside, 4) => s.hit("inside_new"),
            (Place::After, 4) => s.hit("after"),
            _ => panic!("a lookup {place:?} the insert found {n} tokens: {out:?}"),
        }
        if n == 4 {
            assert_eq!(out[2..], inserted[2..], "wrong slots for the inserted leaf: {out:?}");
        }
        c.check_invariants().unwrap();
        assert_eq!((c.total_size(), c.allocator().available_size()), (4, 2));
    });
    seen.expect_seen("peek_racing_insert", &["before", "inside_old", "inside_new", "after"]);
}

/// ABA: the writer evicts `[1, 2]` and at once caches `[3, 4]` in the same two slots
/// (the only ones) and, most likely, the same node record: a request for `[3, 4]`,
/// admitted before the threads start (nothing matched, no slot yet), allocates them and
/// finishes. A lookup of `[1, 2]` returns
/// those slots only if it validated before the eviction (never after it finished), and
/// returns nothing otherwise — never slots that now hold `[3, 4]`.
#[test]
fn peek_racing_evict_and_reuse() {
    let seen = Outcomes::new(&["before_hit", "inside_hit", "inside_miss", "after_miss", "retried"]);
    let s = seen.clone();
    loom_common::model("peek_racing_evict_and_reuse", move || {
        let c = cache(2);
        let slots = cache_key(&c, &[1, 2]);
        let mut req = c.admit(0, &[3, 4]).unwrap();
        let span = Span::new();
        let (c1, span1) = (c.clone(), span.clone());
        let writer = thread::spawn(move || {
            span1.write(|| {
                assert_eq!(c1.evict(2), 2);
                req.extend(2).unwrap();
                let reused = req.slots().to_vec();
                req.finish(&[3, 4]).unwrap();
                reused
            })
        });
        let (c2, span2) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 2];
            let (n, place) = span2.read(|| c2.peek_prefix(0, &[1, 2], &mut out));
            (n, out, place)
        });
        let reused = writer.join().unwrap();
        let (n, out, place) = reader.join().unwrap();
        let mut sorted = reused.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [1, 2], "the writer did not reuse the evicted slots");
        assert!(n == 0 || (n == 2 && out[..] == slots[..]), "partial or wrong match {n} {out:?}");
        match (place, n) {
            (Place::Before, 2) => s.hit("before_hit"),
            (Place::Before, _) => panic!("missed a node cached throughout the lookup"),
            (Place::Inside, 2) => s.hit("inside_hit"),
            (Place::Inside, _) => s.hit("inside_miss"),
            (Place::After, 0) => s.hit("after_miss"),
            (Place::After, _) => panic!("found [1, 2] in slots that hold [3, 4] since before the lookup"),
        }
        if n == 0 && out != [0, 0] {
            s.hit("retried");
        }
        c.check_invariants().unwrap();
        let mut now = [0u32; 2];
        assert_eq!(c.peek_prefix(0, &[3, 4], &mut now), 2);
        assert_eq!(now[..], reused[..]);
    });
    seen.expect_seen(
        "peek_racing_evict_and_reuse",
        &["before_hit", "inside_hit", "inside_miss", "after_miss", "retried"],
    );
}

/// A two-node path whose parent's last page is reused for another parent: a lookup
/// never continues below a parent that was evicted while it read, so it never returns
/// the old parent's (freed) slots joined to a child of the new one.
///
/// Before: `A = [1, 5]` in slots `[2, 1]`, its child `B = [2]` in slot `4` (a request
/// steered into those slots by blocker requests, checkpointed at `[1, 5]` and finished).
/// The writer evicts both, then a request for `[9, 2]` (admitted before the threads
/// start, nothing matched) allocates slots `[1, 2]`, checkpoints `A' = [9]` in slot `1`
/// (A's last page) and finishes with the child `B' = [2]` in slot `2`: `B'` is keyed by
/// `(page 1, [2])`, exactly what a lookup of `[1, 5, 2]` asks for below `A`. A lookup
/// that validated `A`, then found `B'` under page 1, would return `[2, 1, 2]` (A's
/// slots joined to the other tree's child), if it validated each node only when it read
/// it and the deepest one at the end (this model failed so with raw inserts in the
/// writer). The parent's generation is re-checked after its child is found, so the
/// lookup returns `[2, 1, 4]`, `[2, 1]` (the leaf went first) or nothing.
#[test]
fn peek_across_a_reused_parent_page() {
    let seen = Outcomes::new(&["before_whole", "inside_whole", "inside_parent", "inside_miss", "after_miss"]);
    let s = seen.clone();
    let mut builder = loom::model::Builder::new();
    // One preemption puts the reader between its two levels; two let loom also move the
    // writer's publication against the reader's checks.
    builder.preemption_bound = Some(builder.preemption_bound.map_or(2, |b| b.min(2)));
    loom_common::model_with("peek_across_a_reused_parent_page", builder, move || {
        let c = cache(4);
        // A in slots [2, 1] -> [4]: blockers hold the slots it must not get (the
        // allocator hands out its lowest free slot).
        let mut a = c.admit(0, &[1, 5, 2]).unwrap();
        let mut blocker = c.admit(0, &[]).unwrap();
        blocker.extend(1).unwrap();
        a.extend(1).unwrap();
        blocker.abort();
        a.extend(1).unwrap();
        let mut blocker = c.admit(0, &[]).unwrap();
        blocker.extend(1).unwrap();
        a.extend(1).unwrap();
        blocker.abort();
        assert_eq!(a.slots(), [2, 1, 4], "the model's layout");
        a.checkpoint(&[1, 5]).unwrap();
        a.finish(&[1, 5, 2]).unwrap();
        let mut b = c.admit(0, &[9, 2]).unwrap();
        let span = Span::new();
        let (c1, span1) = (c.clone(), span.clone());
        let writer = thread::spawn(move || {
            span1.write(|| {
                assert_eq!(c1.evict(100), 3);
                b.extend(2).unwrap();
                assert_eq!(b.slots(), [1, 2], "the model's layout");
                b.checkpoint(&[9]).unwrap();
                assert_eq!(b.finish(&[9, 2]).unwrap(), 1);
            })
        });
        let (c2, span2) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 3];
            let (n, place) = span2.read(|| c2.peek_prefix(0, &[1, 5, 2], &mut out));
            (n, out, place)
        });
        writer.join().unwrap();
        let (n, out, place) = reader.join().unwrap();
        match n {
            0 => {}
            2 => assert_eq!(out[..2], [2, 1], "a wrong parent"),
            3 => assert_eq!(out, [2, 1, 4], "a path joined across two trees"),
            _ => panic!("a partial page count {n}"),
        }
        match (place, n) {
            (Place::Before, 3) => s.hit("before_whole"),
            (Place::Before, _) => panic!("missed a path cached throughout the lookup"),
            (Place::Inside, 3) => s.hit("inside_whole"),
            (Place::Inside, 2) => s.hit("inside_parent"),
            (Place::Inside, _) => s.hit("inside_miss"),
            (Place::After, 0) => s.hit("after_miss"),
            (Place::After, _) => panic!("found [1, 5, ..] after it was evicted: {out:?}"),
        }
        c.check_invariants().unwrap();
        let mut now = [0u32; 2];
        assert_eq!(c.peek_prefix(0, &[9, 2], &mut now), 2);
        assert_eq!(now, [1, 2]);
    });
    seen.expect_seen(
        "peek_across_a_reused_parent_page",
        &["before_whole", "inside_whole", "inside_parent", "inside_miss", "after_miss"],
    );
}

/// An admission (match and lock) racing eviction: a locked node is never evicted; the
/// request's cached slots stay cached and allocated until it ends. Both orders are
/// reached.
#[test]
fn lock_racing_evict() {
    let seen = Outcomes::new(&["locked_first", "evicted_first"]);
    let s = seen.clone();
    loom_common::model("lock_racing_evict", move || {
        let c = cache(4);
        let slots = cache_key(&c, &[1, 2]);
        let c2 = c.clone();
        let t = thread::spawn(move || c2.evict(2));
        let req = c.admit(0, &[1, 2]).unwrap();
        let freed = t.join().unwrap();
        if req.cached_len() == 2 {
            assert_eq!(req.slots(), &slots[..]);
            assert_eq!(freed, 0, "evicted a locked node");
            assert_eq!(c.total_size(), 2);
            assert!(slots.iter().all(|&s| c.allocator().is_allocated(s)));
            s.hit("locked_first");
        } else {
            assert_eq!((req.cached_len(), freed), (0, 2));
            s.hit("evicted_first");
        }
        drop(req);
        c.check_invariants().unwrap();
    });
    seen.expect_seen("lock_racing_evict", &["locked_first", "evicted_first"]);
}

/// Mamba variant: an admission racing `evict_mamba`. A request resuming from a state
/// keeps the state allocated and unfreeable until it ends; once the state is gone the
/// admission finds no state to resume from and locks nothing (the leaf went whole: a
/// leaf is never a tombstone). Both orders are reached.
#[test]
fn lock_racing_evict_mamba() {
    let seen = Outcomes::new(&["locked_first", "evicted_first"]);
    let s = seen.clone();
    loom_common::model("lock_racing_evict_mamba", move || {
        let c = mamba_cache(2);
        // [1, 2] cached with a state (the request's running state goes back).
        let mut r = c.admit(0, &[1, 2]).unwrap();
        let state = r.save_state(2).unwrap();
        r.extend(2).unwrap();
        assert!(r.finish(&[1, 2]).unwrap().state_kept);
        let c2 = c.clone();
        let t = thread::spawn(move || c2.evict_mamba(1));
        let req = c.admit(0, &[1, 2]).unwrap();
        let freed = t.join().unwrap();
        if req.cached_len() == 2 {
            assert_eq!(freed, 0, "freed a locked state");
            assert_eq!(req.resume_state(), Some(state));
            assert!(c.states().is_allocated(state));
            s.hit("locked_first");
        } else {
            assert_eq!((req.cached_len(), req.resume_state(), freed, c.total_size()), (0, None, 1, 0));
            assert!(!c.states().is_allocated(state));
            s.hit("evicted_first");
        }
        drop(req);
        c.check_invariants().unwrap();
    });
    seen.expect_seen("lock_racing_evict_mamba", &["locked_first", "evicted_first"]);
}

/// Mamba variant: a lock-free lookup racing `evict_mamba(2)`, which first makes the
/// internal node `[1, 2]` a tombstone (its KV stays) and then removes the leaf
/// `[3, 4]` and, with it, the tombstone left childless. The lookup returns a prefix of
/// the cached slots, whole before the eviction and nothing after it.
#[test]
fn peek_racing_mamba_eviction() {
    let seen = Outcomes::new(&["whole", "none", "upper_only"]);
    let s = seen.clone();
    loom_common::model("peek_racing_mamba_eviction", move || {
        // [1, 2] with a state, and [3, 4] under it with another: one request that
        // checkpoints at 2 and finishes at 4 (a running state and two saved ones).
        let c = mamba_cache(3);
        let mut r = c.admit(0, &[1, 2, 3, 4]).unwrap();
        r.extend(4).unwrap();
        let kv = r.slots().to_vec();
        r.save_state(2).unwrap();
        r.checkpoint(&[1, 2]).unwrap();
        r.save_state(4).unwrap();
        assert!(r.finish(&[1, 2, 3, 4]).unwrap().state_kept);
        let span = Span::new();
        let (c2, sp) = (c.clone(), span.clone());
        let t = thread::spawn(move || sp.write(|| c2.evict_mamba(2)));
        let mut out = [0u32; 4];
        let (n, place) = span.read(|| c.peek_prefix(0, &[1, 2, 3, 4], &mut out));
        assert_eq!(t.join().unwrap(), 2);
        assert_eq!(out[..n], kv[..n], "a lookup returned slots that are not the cached ones");
        match (n, place) {
            (4, Place::After) | (0, Place::Before) => panic!("{n} tokens found {}", place.label()),
            (4, _) => s.hit("whole"),
            (0, _) => s.hit("none"),
            (2, _) => s.hit("upper_only"),
            _ => panic!("a lookup returned {n} tokens"),
        }
        assert_eq!((c.total_size(), c.states().available()), (0, 3));
        c.check_invariants().unwrap();
    });
    seen.expect_seen("peek_racing_mamba_eviction", &["whole", "none"]);
}

/// Two threads finish requests with overlapping keys at once (both admitted and
/// prefilled before, when nothing was cached); the later finish frees its duplicates.
/// The tree ends valid with exact sizes and no slot lost or doubly owned, whichever
/// finish went first (both orders are reached).
#[test]
fn concurrent_overlapping_inserts() {
    let seen = Outcomes::new(&["thread_first", "main_first"]);
    let s = seen.clone();
    loom_common::model("concurrent_overlapping_inserts", move || {
        let c = cache(8);
        let (theirs_req, mine_req) = (prefilled(&c, &[1, 2, 3]), prefilled(&c, &[1, 2, 4]));
        let (theirs, mine) = (theirs_req.slots().to_vec(), mine_req.slots().to_vec());
        let t = thread::spawn(move || theirs_req.finish(&[1, 2, 3]).unwrap());
        let mine_found = mine_req.finish(&[1, 2, 4]).unwrap();
        let theirs_found = t.join().unwrap();
        assert_eq!(mine_found + theirs_found, 2, "exactly one finish found [1, 2] cached");
        assert_eq!(c.req_pool().available_size(), 2);
        c.check_invariants().unwrap();
        assert_eq!(c.total_size(), 4);
        assert_eq!(c.evictable_size(), 4);
        assert_eq!(c.allocator().available_size(), 8 - 4);
        // The shared prefix [1, 2] holds the slots of whichever insert came first.
        let mut out = [0u32; 3];
        assert_eq!(c.peek_prefix(0, &[1, 2, 3], &mut out), 3);
        if out[..2] == theirs[..2] {
            assert_eq!(out[..], theirs[..]);
            s.hit("thread_first");
        } else {
            assert_eq!(out[..2], mine[..2]);
            s.hit("main_first");
        }
    });
    seen.expect_seen("concurrent_overlapping_inserts", &["thread_first", "main_first"]);
}

/// The event queue hands every event from a producer to a consumer once, in order. With
/// capacity 2 and 3 events, the third push succeeds only when the consumer emptied the
/// first cell in time (a hand-off across a lap of the ring), else it is dropped and
/// counted: both happen, and so does a pop that meets an empty queue.
#[test]
fn event_queue_producer_consumer() {
    let seen = Outcomes::new(&["lap_reused", "dropped", "popped_concurrently", "popped_empty"]);
    let s = seen.clone();
    loom_common::model("event_queue_producer_consumer", move || {
        let q = Arc::new(EventQueue::new(2));
        let q1 = q.clone();
        let producer = thread::spawn(move || {
            let mut pushed = 0;
            for page in 0..3 {
                if q1.push(KvEvent::BlockRemoved { hash: [0; 32], page }) {
                    pushed += 1;
                }
            }
            pushed
        });
        let q2 = q.clone();
        let consumer = thread::spawn(move || {
            let (mut got, mut empty) = (vec![], false);
            for _ in 0..3 {
                match q2.pop() {
                    Some(KvEvent::BlockRemoved { page, .. }) => got.push(page),
                    Some(other) => panic!("unexpected event {other:?}"),
                    None => empty = true,
                }
            }
            (got, empty)
        });
        let pushed = producer.join().unwrap();
        let (mut got, empty) = consumer.join().unwrap();
        let concurrently = got.len();
        while let Some(KvEvent::BlockRemoved { page, .. }) = q.pop() {
            got.push(page);
        }
        assert_eq!(got.len(), pushed);
        assert_eq!(got.len() as u64 + q.dropped(), 3);
        assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order: {got:?}");
        if pushed == 3 {
            s.hit("lap_reused");
        } else {
            s.hit("dropped");
        }
        if concurrently > 0 {
            s.hit("popped_concurrently");
        }
        if empty {
            s.hit("popped_empty");
        }
    });
    seen.expect_seen(
        "event_queue_producer_consumer",
        &["lap_reused", "dropped", "popped_concurrently", "popped_empty"],
    );
}

/// The engine contract across threads: a scheduler admits a request (its prefix
/// `[1, 2]` is cached) and allocates its next token, then hands the request to an
/// output thread, which finishes it (caching `[1, 2, 3]`); a router looks `[1, 2, 3]`
/// up meanwhile. The router finds the cached prefix, or the whole finished path,
/// never a slot the request held but had not cached; afterwards everything is
/// accounted for (free + cached = capacity, no lock, no row held).
#[test]
fn request_moves_between_threads() {
    let seen = Outcomes::new(&["prefix", "whole"]);
    let s = seen.clone();
    loom_common::model("request_moves_between_threads", move || {
        let c = cache(4);
        let mut first = c.admit(0, &[1, 2]).unwrap();
        first.extend(2).unwrap();
        let cached = first.slots().to_vec();
        first.finish(&[1, 2]).unwrap();

        let c1 = std::sync::Arc::clone(&c);
        let scheduler = thread::spawn(move || {
            let mut req = c1.admit(0, &[1, 2, 3]).unwrap();
            assert_eq!(req.cached_len(), 2);
            req.extend(1).unwrap();
            let own = req.slots()[2];
            let output = thread::spawn(move || assert_eq!(req.finish(&[1, 2, 3]).unwrap(), 2));
            output.join().unwrap();
            own
        });
        let c2 = std::sync::Arc::clone(&c);
        let router = thread::spawn(move || {
            let mut out = [0u32; 3];
            let n = c2.peek_prefix(0, &[1, 2, 3], &mut out);
            (n, out)
        });
        let own = scheduler.join().unwrap();
        let (n, out) = router.join().unwrap();
        match n {
            2 => {
                assert_eq!(out[..2], cached[..]);
                s.hit("prefix");
            }
            3 => {
                assert_eq!((&out[..2], out[2]), (&cached[..], own));
                s.hit("whole");
            }
            _ => panic!("the router found {n} tokens: {out:?}"),
        }
        c.check_invariants().unwrap();
        assert_eq!((c.total_size(), c.protected_size(), c.allocator().available_size()), (3, 0, 1));
        assert_eq!(c.req_pool().available_size(), 2);
    });
    seen.expect_seen("request_moves_between_threads", &["prefix", "whole"]);
}
