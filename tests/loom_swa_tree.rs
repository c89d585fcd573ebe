#![cfg(all(loom, not(shuttle)))]
//! Loom models of the sliding-window radix cache's concurrency claims (small
//! capacities). Run with `scripts/loom.sh loom_swa_tree`.
//!
//! The tree in every model (window 2 tokens, page size 1): `[1,2] -> {[3,4], [5]}`,
//! built by two requests admitted on the empty tree, finishing `[1,2,3,4]` and then
//! `[1,2,5]` (the second finish's split re-times `[3,4]`, so `[1,2]` is the least
//! recently used node of the window order, then `[3,4]`, then `[5]`).
//!
//! As in `tests/loom_radix.rs`, the writer is spawned first and the reader second, the
//! main thread only joins, so loom's first schedule stores before it loads and
//! backtracks from each load to the store it depends on; every model counts its
//! executions (`loom_common::model`) and the outcomes it is about (`Outcomes`).
//!
//! | model | what it proves |
//! |---|---|
//! | `lock_racing_evict_swa` | an admitted request's locked window part is never tombstoned: locked first, the window pass skips `[1,2]` and removes the leaf `[3,4]` instead; evicted first, `[1,2]` is a tombstone and the admission matches nothing; sizes exact after the join in both orders |
//! | `peek_racing_tombstoning` | a lock-free `peek_prefix` of `[1,2,5]` racing the window pass that tombstones `[1,2]` returns 3 (the state before) or 0 (after), never 2 or garbage slots; before it, 3; after it, 0 |
//! | `peek_racing_revival` | a `peek_prefix` of `[1,2,5]` racing the finish of a request for `[1,2,6]` that revives the tombstone `[1,2]` with the request's window KV returns 0 (before) or 3 (after, with the tree's slots) |

mod loom_common;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use kvpool::alloc::SwaAllocator;
use kvpool::radix::{RadixConfig, Request, Swa, SwaRadixCache};
use kvpool::ReqToTokenPool;
use loom_common::Outcomes;

/// A request for `key`, admitted and extended to its end (not finished).
fn prefilled(c: &std::sync::Arc<SwaRadixCache>, key: &[u32]) -> Request<SwaAllocator, Swa> {
    let mut r = c.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    r
}

/// A cache of `size` full and window tokens, window 2, holding `[1,2] -> {[3,4], [5]}`
/// (`size - 5` tokens stay free); returns it and the slots of `[1,2,3,4,5]`.
fn tree(size: usize) -> (std::sync::Arc<SwaRadixCache>, [u32; 5]) {
    let c = std::sync::Arc::new(
        SwaRadixCache::with_window(
            SwaAllocator::new(size, size, 1).unwrap(),
            ReqToTokenPool::new(2, 4).unwrap(),
            RadixConfig::default(),
            2,
        )
        .unwrap(),
    );
    // Both admitted before either finishes: the second finish's insert makes the split
    // (an admission that matched `[1,2]` would touch it after the split instead).
    let (first, second) = (prefilled(&c, &[1, 2, 3, 4]), prefilled(&c, &[1, 2, 5]));
    let (kv, fifth) = (first.slots().to_vec(), second.slots()[2]);
    assert_eq!(first.finish(&[1, 2, 3, 4]).unwrap(), 0);
    assert_eq!(second.finish(&[1, 2, 5]).unwrap(), 2); // its `[1,2]` slots were duplicates
    (c, [kv[0], kv[1], kv[2], kv[3], fifth])
}

/// Two flags around the writer's call, so the reader can tell where it ran.
#[derive(Default)]
struct Span {
    started: AtomicBool,
    done: AtomicBool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Before,
    Inside,
    After,
}

impl Span {
    fn write<R>(&self, f: impl FnOnce() -> R) -> R {
        self.started.store(true, Ordering::SeqCst);
        let r = f();
        self.done.store(true, Ordering::SeqCst);
        r
    }

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

/// An admission of `[1,2]` (match and lock) racing `evict_swa(2)`: the window part of
/// the request's lock is never tombstoned, and the sizes are exact after the join in
/// both orders.
#[test]
fn lock_racing_evict_swa() {
    let seen = Outcomes::new(&["locked_first", "evicted_first"]);
    let s = seen.clone();
    loom_common::model("lock_racing_evict_swa", move || {
        let (c, kv) = tree(7);
        let c2 = c.clone();
        let writer = thread::spawn(move || c2.evict_swa(2));
        let c3 = c.clone();
        let reader = thread::spawn(move || c3.admit(0, &[1, 2]).unwrap());
        let freed = writer.join().unwrap();
        let req = reader.join().unwrap();
        let n = req.cached_len();
        let sizes = (c.total_size(), c.tombstone_size(), c.swa_protected_size(), c.protected_size());
        if n == 2 {
            assert_eq!(req.slots(), [kv[0], kv[1]]);
            // The window pass skipped the locked [1,2] and removed the leaf [3,4].
            assert_eq!(freed, 2);
            assert_eq!(sizes, (3, 0, 2, 2), "(total, tombstones, swa protected, protected)");
            assert!(c.allocator().window_slot(kv[0]).is_some(), "a leased window was freed");
            s.hit("locked_first");
        } else {
            assert_eq!(n, 0);
            assert_eq!(freed, 2);
            assert_eq!(sizes, (5, 2, 0, 0), "(total, tombstones, swa protected, protected)");
            assert_eq!(c.allocator().window_slot(kv[0]), None);
            s.hit("evicted_first");
        }
        drop(req);
        assert_eq!((c.swa_protected_size(), c.protected_size()), (0, 0));
        c.check_invariants().unwrap();
    });
    seen.expect_seen("lock_racing_evict_swa", &["locked_first", "evicted_first"]);
}

/// A lock-free lookup of `[1,2,5]` racing the window pass that makes `[1,2]` a
/// tombstone: the lookup returns what the window rule gives on the tree before (3) or
/// after (0) the tombstoning, with the cached slots, never anything else.
#[test]
fn peek_racing_tombstoning() {
    let seen = Outcomes::new(&["before_3", "inside_3", "inside_0", "after_0"]);
    let s = seen.clone();
    loom_common::model("peek_racing_tombstoning", move || {
        let (c, kv) = tree(7);
        let span = Arc::new(Span::default());
        let (c2, sp) = (c.clone(), span.clone());
        let writer = thread::spawn(move || sp.write(|| c2.evict_swa(1)));
        let (c3, sp) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 3];
            let (n, place) = sp.read(|| c3.peek_prefix(0, &[1, 2, 5], &mut out));
            (n, out, place)
        });
        assert_eq!(writer.join().unwrap(), 2);
        let (n, out, place) = reader.join().unwrap();
        match (n, place) {
            (3, Place::Before) => s.hit("before_3"),
            (3, Place::Inside) => s.hit("inside_3"),
            (0, Place::Inside) => s.hit("inside_0"),
            (0, Place::After) => s.hit("after_0"),
            _ => panic!("a lookup {place:?} the tombstoning returned {n} tokens"),
        }
        if n == 3 {
            assert_eq!(out, [kv[0], kv[1], kv[4]], "a lookup returned slots that are not the cached ones");
        }
        assert_eq!((c.total_size(), c.tombstone_size()), (5, 2));
        c.check_invariants().unwrap();
    });
    seen.expect_seen("peek_racing_tombstoning", &["before_3", "inside_3", "inside_0", "after_0"]);
}

/// A lock-free lookup of `[1,2,5]` racing the finish of a request for `[1,2,6]` (admitted
/// and prefilled before the threads start: the tombstone matched nothing, so its slots
/// for `[1,2]` bring window KV), which revives the tombstone (the tree's pages take the
/// request's window pages): the lookup returns 0 (before) or 3 (after), with the tree's
/// own slots.
#[test]
fn peek_racing_revival() {
    let seen = Outcomes::new(&["before_0", "inside_0", "inside_3", "after_3"]);
    let s = seen.clone();
    let mut builder = loom::model::Builder::new();
    // Every atomic access counts against loom's branch limit (1,000 by default), the
    // single-threaded setup's and the final `check_invariants`' too: the two requests
    // that build the tree and the one that revives it go past it.
    builder.max_branches = 4_000;
    loom_common::model_with("peek_racing_revival", builder, move || {
        let (c, kv) = tree(10);
        assert_eq!(c.evict_swa(1), 2);
        let req = prefilled(&c, &[1, 2, 6]);
        assert_eq!(req.cached_len(), 0);
        let span = Arc::new(Span::default());
        let sp = span.clone();
        let writer = thread::spawn(move || sp.write(|| req.finish(&[1, 2, 6]).unwrap()));
        let (c3, sp) = (c.clone(), span.clone());
        let reader = thread::spawn(move || {
            let mut out = [0u32; 3];
            let (n, place) = sp.read(|| c3.peek_prefix(0, &[1, 2, 5], &mut out));
            (n, out, place)
        });
        assert_eq!(writer.join().unwrap(), 2);
        let (n, out, place) = reader.join().unwrap();
        match (n, place) {
            (0, Place::Before) => s.hit("before_0"),
            (0, Place::Inside) => s.hit("inside_0"),
            (3, Place::Inside) => s.hit("inside_3"),
            (3, Place::After) => s.hit("after_3"),
            _ => panic!("a lookup {place:?} the revival returned {n} tokens"),
        }
        if n == 3 {
            assert_eq!(out, [kv[0], kv[1], kv[4]], "a lookup returned slots that are not the cached ones");
        }
        assert_eq!((c.total_size(), c.tombstone_size()), (6, 0));
        assert!(c.allocator().window_slot(kv[0]).is_some(), "the tree's page did not take the window KV");
        c.check_invariants().unwrap();
    });
    seen.expect_seen("peek_racing_revival", &["before_0", "inside_0", "inside_3", "after_3"]);
}
