#![cfg(all(loom, not(shuttle)))]
//! Loom models of the host-tier radix cache (`HiRadixCache`) and its transfers in
//! flight: small trees (page size 1, a handful of device slots and host pages). Run
//! with `scripts/loom.sh loom_hi_tree`.
//!
//! As in `tests/loom_radix.rs`, the writer is spawned first and the other thread
//! second, the main thread only joins, and every model counts its executions
//! (`loom_common::model`) and the outcomes it is about (`Outcomes`).
//!
//! | model | what it proves |
//! |---|---|
//! | `evict_racing_write_through` | an eviction racing a finish whose backup is in flight never takes the node while the copy may still read its device pages: it frees nothing until the caller has started to complete the transfer, and after that it moves the node to host |
//! | `load_racing_host_eviction` | a host eviction racing a load-back (an admission) never frees the host copy being loaded: evicted first, the load finds nothing; loaded first, the node is on the device (locked while in flight) and the host keeps its copy; sizes exact either way |
//! | `host_eviction_racing_write_back` | under `write_back`, a host eviction racing the device eviction that writes a node back (device pages freed at once, host pages in flight) never frees the host pages before the caller began to complete the write-back |
//! | `peek_racing_insert_host` | a lookup racing `insert_host` (a host-only leaf published under a device node) returns the device part only: the leaf's mark is set before it is published |
//! | `peek_racing_republish` | a lock-free `peek_prefix` racing the device eviction of a backed-up node (republished under its host pages with the host mark, its host-only child re-keyed under its new last page) returns 2 tokens with the cached slots or 0, never host pages as slots (the mark was once set after the republish: this model caught it) |

mod loom_common;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use kvpool::radix::{Hi, HiRadixCache, HostTier, RadixConfig, Request, Transfer, TransferKind, WritePolicy};
use kvpool::{PagedAllocator, ReqToTokenPool};
use loom_common::Outcomes;

type Cache = HiRadixCache<PagedAllocator>;

/// A `write_through` cache (in a std `Arc`: a request holds one).
fn cache(device: usize, host_pages: u32) -> std::sync::Arc<Cache> {
    with_policy(device, host_pages, WritePolicy::WriteThrough)
}

fn with_policy(device: usize, host_pages: u32, write_policy: WritePolicy) -> std::sync::Arc<Cache> {
    let tier = HostTier { host_pages, write_policy, load_back_threshold: 1 };
    let rows = ReqToTokenPool::new(2, 4).unwrap();
    std::sync::Arc::new(
        HiRadixCache::with_host_tier(PagedAllocator::new(device, 1).unwrap(), rows, RadixConfig::default(), tier)
            .unwrap(),
    )
}

/// Take the one transfer started; its kind.
fn take_one(c: &HiRadixCache<PagedAllocator>) -> Transfer {
    let mut buf = [Transfer::default(); 2];
    assert_eq!(c.take_transfers(&mut buf), 1);
    buf[0]
}

/// A request for `key`, admitted and extended to its end (not finished).
fn prefilled(c: &std::sync::Arc<Cache>, key: &[u32]) -> Request<PagedAllocator, Hi> {
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

/// Finish a request for `[1,2]` (admitted and prefilled before the threads start): its
/// backup starts, the node locked; then complete the transfer, racing `evict(2)`. The eviction frees nothing while the backup is in flight; once it
/// frees, the transfer's completion had begun.
#[test]
fn evict_racing_write_through() {
    let seen = Outcomes::new(&["before_insert", "in_flight", "after_complete"]);
    let s = seen.clone();
    loom_common::model("evict_racing_write_through", move || {
        let c = cache(4, 4);
        let req = prefilled(&c, &[1, 2]);
        let inserted = Arc::new(AtomicBool::new(false));
        let completing = Arc::new(AtomicBool::new(false));
        let (c2, ins, comp) = (c.clone(), inserted.clone(), completing.clone());
        let writer = thread::spawn(move || {
            let kv = req.slots().to_vec();
            assert_eq!(req.finish(&[1, 2]).unwrap(), 0);
            ins.store(true, Ordering::SeqCst);
            let t = take_one(&c2);
            assert_eq!(t.kind(), TransferKind::Backup);
            let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
            c2.transfer_pages(t, &mut dev, &mut host).unwrap();
            assert_eq!(dev[..], kv[..], "the backup reads the node's device pages");
            comp.store(true, Ordering::SeqCst);
            c2.complete(t).unwrap();
            kv
        });
        let (c3, ins, comp) = (c.clone(), inserted.clone(), completing.clone());
        let evictor = thread::spawn(move || {
            let was_inserted = ins.load(Ordering::SeqCst);
            let freed = c3.evict(2);
            let was_completing = comp.load(Ordering::SeqCst);
            (was_inserted, freed, was_completing)
        });
        let kv = writer.join().unwrap();
        let (was_inserted, freed, was_completing) = evictor.join().unwrap();
        match freed {
            2 => {
                assert!(was_completing, "the device copy was evicted while its backup was in flight");
                assert_eq!((c.total_size(), c.host_size()), (0, 2));
                s.hit("after_complete");
            }
            0 if was_inserted => s.hit("in_flight"),
            0 => s.hit("before_insert"),
            n => panic!("evict freed {n}"),
        }
        if freed == 0 {
            // The node is resident, unlocked now, and goes to host on the next eviction.
            assert_eq!((c.total_size(), c.evictable_size()), (2, 2));
            assert_eq!(c.evict(2), 2);
        }
        let mut out = [0u32; 2];
        assert_eq!(c.peek_prefix(0, &[1, 2], &mut out), 0);
        assert_eq!(c.allocator().available_size(), 4, "device slots {kv:?} not all back");
        assert_eq!(c.transfers_in_flight(), 0);
        c.check_invariants().unwrap();
    });
    seen.expect_seen("evict_racing_write_through", &["in_flight", "after_complete"]);
}

/// `[1,2]` is on host only. A load-back (an admission: match, load, lock; the request
/// dropped; the transfer completed) races `evict_host(2)`: the host copy being loaded
/// is never freed.
#[test]
fn load_racing_host_eviction() {
    let seen = Outcomes::new(&["host_evicted_first", "loaded_first"]);
    let s = seen.clone();
    loom_common::model("load_racing_host_eviction", move || {
        let c = cache(4, 2);
        cache_key(&c, &[1, 2]);
        c.complete(take_one(&c)).unwrap();
        assert_eq!(c.evict(2), 2);
        assert_eq!(c.host_size(), 2);
        let c2 = c.clone();
        let evictor = thread::spawn(move || c2.evict_host(2));
        let c3 = c.clone();
        let loader = thread::spawn(move || {
            let req = c3.admit(0, &[1, 2]).unwrap();
            let (n, hit) = (req.cached_len(), req.host_hit());
            let mut out = [0u32; 2];
            out[..n].copy_from_slice(req.slots());
            drop(req);
            if hit.loaded > 0 {
                let t = take_one(&c3);
                assert_eq!(t.kind(), TransferKind::Load);
                let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
                c3.transfer_pages(t, &mut dev, &mut host).unwrap();
                assert_eq!(dev, out, "the load fills the request's cached slots");
                // In flight: the node is locked on the device, its host copy held.
                assert_eq!(c3.host_size(), 2, "the host copy being loaded is gone");
                c3.complete(t).unwrap();
            }
            (n, hit.loaded)
        });
        let freed = evictor.join().unwrap();
        let (n, loaded) = loader.join().unwrap();
        match (freed, loaded) {
            (2, 0) => {
                assert_eq!(n, 0);
                assert_eq!((c.total_size(), c.host_size(), c.node_count()), (0, 0, 0));
                s.hit("host_evicted_first");
            }
            (0, 2) => {
                assert_eq!(n, 2);
                // Resident again, its host copy kept: a later device eviction needs no copy.
                assert_eq!((c.total_size(), c.host_size()), (2, 2));
                assert_eq!(c.evict(2), 2);
                assert_eq!(c.transfers_in_flight(), 0);
                s.hit("loaded_first");
            }
            other => panic!("host eviction freed {} while a load of {} ran", other.0, other.1),
        }
        assert_eq!(c.allocator().available_size(), 4);
        c.check_invariants().unwrap();
    });
    seen.expect_seen("load_racing_host_eviction", &["host_evicted_first", "loaded_first"]);
}

/// `[1,2] -> [3]`, both backed up, `[3]` on host only. `evict(2)` moves `[1,2]` to host
/// (republished under its host pages, the host-only `[3]` re-keyed under its new last
/// page) while a reader peeks `[1,2,3]`: 2 tokens with the cached slots, or 0.
#[test]
fn peek_racing_republish() {
    let seen = Outcomes::new(&["saw_2", "saw_0"]);
    let s = seen.clone();
    loom_common::model("peek_racing_republish", move || {
        let c = cache(4, 4);
        let kv = cache_key(&c, &[1, 2, 3]);
        c.complete(take_one(&c)).unwrap();
        let mut out = [0u32; 3];
        c.match_tiers(0, &[1, 2, 9], &mut out); // split: [1,2] -> [3]
        assert_eq!(c.evict(1), 1); // [3] to host
        assert_eq!((c.node_count(), c.total_size()), (2, 2));
        let c2 = c.clone();
        let writer = thread::spawn(move || c2.evict(2));
        let c3 = c.clone();
        let reader = thread::spawn(move || {
            let mut out = [0u32; 3];
            let n = c3.peek_prefix(0, &[1, 2, 3], &mut out);
            (n, out)
        });
        assert_eq!(writer.join().unwrap(), 2);
        let (n, out) = reader.join().unwrap();
        match n {
            2 => s.hit("saw_2"),
            0 => s.hit("saw_0"),
            _ => panic!("a lookup racing the republish returned {n} tokens"),
        }
        assert_eq!(out[..n], kv[..n], "a lookup returned slots that are not the cached ones");
        assert_eq!((c.total_size(), c.host_size(), c.node_count()), (0, 3, 2));
        c.check_invariants().unwrap();
    });
    seen.expect_seen("peek_racing_republish", &["saw_2", "saw_0"]);
}

/// Under `write_back`: `evict(2)` moves `[1,2]` to host (its device pages freed, a
/// write-back in flight) and completes the transfer, racing `evict_host(2)`. The host
/// pages being written are never freed before the completion began.
#[test]
fn host_eviction_racing_write_back() {
    let seen = Outcomes::new(&["before_evict", "in_flight", "after_complete"]);
    let s = seen.clone();
    loom_common::model("host_eviction_racing_write_back", move || {
        let c = with_policy(4, 2, WritePolicy::WriteBack);
        cache_key(&c, &[1, 2]);
        assert_eq!(c.transfers_in_flight(), 0);
        let evicted = Arc::new(AtomicBool::new(false));
        let completing = Arc::new(AtomicBool::new(false));
        let (c2, ev, comp) = (c.clone(), evicted.clone(), completing.clone());
        let writer = thread::spawn(move || {
            assert_eq!(c2.evict(2), 2);
            ev.store(true, Ordering::SeqCst);
            let t = take_one(&c2);
            assert_eq!(t.kind(), TransferKind::WriteBack);
            comp.store(true, Ordering::SeqCst);
            c2.complete(t).unwrap();
        });
        let (c3, ev, comp) = (c.clone(), evicted.clone(), completing.clone());
        let host = thread::spawn(move || {
            let was_evicted = ev.load(Ordering::SeqCst);
            let freed = c3.evict_host(2);
            (was_evicted, freed, comp.load(Ordering::SeqCst))
        });
        writer.join().unwrap();
        let (was_evicted, freed, was_completing) = host.join().unwrap();
        match freed {
            2 => {
                assert!(was_completing, "host pages freed while their write-back was in flight");
                assert_eq!((c.host_size(), c.node_count()), (0, 0));
                s.hit("after_complete");
            }
            0 if was_evicted => s.hit("in_flight"),
            0 => s.hit("before_evict"),
            n => panic!("evict_host freed {n}"),
        }
        if freed == 0 {
            assert_eq!(c.evict_host(2), 2);
        }
        assert_eq!((c.allocator().available_size(), c.host_size(), c.transfers_in_flight()), (4, 0, 0));
        c.check_invariants().unwrap();
    });
    seen.expect_seen("host_eviction_racing_write_back", &["in_flight", "after_complete"]);
}

/// `[1,2]` is on the device. `insert_host([1,2,3,4])` adds the host-only `[3,4]` (a
/// prefetch) while a reader peeks `[1,2,3,4]`: always the 2 device tokens, with their
/// slots; the new node's host pages are never returned as slots.
#[test]
fn peek_racing_insert_host() {
    let seen = Outcomes::new(&["saw_2"]);
    let s = seen.clone();
    loom_common::model("peek_racing_insert_host", move || {
        let c = cache(4, 4);
        let kv = cache_key(&c, &[1, 2]);
        c.complete(take_one(&c)).unwrap();
        let c2 = c.clone();
        let writer = thread::spawn(move || {
            let mut out = [0u32; 4];
            c2.insert_host(0, &[1, 2, 3, 4], &mut out)
        });
        let c3 = c.clone();
        let reader = thread::spawn(move || {
            let mut out = [0u32; 4];
            let n = c3.peek_prefix(0, &[1, 2, 3, 4], &mut out);
            (n, out)
        });
        assert_eq!(writer.join().unwrap(), 2);
        let (n, out) = reader.join().unwrap();
        assert_eq!(n, 2, "a lookup returned the prefetched host pages as device slots: {out:?}");
        assert_eq!(out[..2], kv[..]);
        s.hit("saw_2");
        let t = take_one(&c);
        assert_eq!(t.kind(), TransferKind::Prefetch);
        c.complete(t).unwrap();
        c.check_invariants().unwrap();
    });
    seen.expect_seen("peek_racing_insert_host", &["saw_2"]);
}
