//! Loom models of the radix cache's concurrency claims (small capacities).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test loom_radix`
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use kvpool::radix::{EventQueue, KvEvent, RadixCache, RadixConfig};
use kvpool::{KvAllocator, ReqToTokenPool, TokenAllocator};

fn cache(size: usize) -> RadixCache<TokenAllocator> {
    RadixCache::new(TokenAllocator::new(size).unwrap(), ReqToTokenPool::new(1, 4).unwrap(), RadixConfig::default())
        .unwrap()
}

fn insert_fresh(c: &RadixCache<TokenAllocator>, key: &[u32]) -> Vec<u32> {
    let mut s = vec![0u32; key.len()];
    c.allocator().alloc(&mut s).unwrap();
    let dup = c.insert(0, key, &s, 0).unwrap();
    c.allocator().free(&s[..dup]).unwrap();
    s
}

/// A lookup that starts after an eviction finished never finds the evicted node, and a
/// lookup racing the eviction returns the whole cached prefix or nothing — never a
/// partial or garbled one — and never panics on a half-evicted node.
#[test]
fn peek_racing_evict() {
    loom::model(|| {
        let c = Arc::new(cache(4));
        let slots = insert_fresh(&c, &[1, 2]);
        let evicted = Arc::new(AtomicBool::new(false));
        let (c2, e2) = (c.clone(), evicted.clone());
        let t = thread::spawn(move || {
            assert_eq!(c2.evict(2), 2);
            e2.store(true, Ordering::SeqCst);
        });
        let after = evicted.load(Ordering::SeqCst);
        let mut out = [0u32; 2];
        let n = c.peek_prefix(0, &[1, 2], &mut out);
        if after {
            assert_eq!(n, 0, "found a node evicted before the lookup began");
        }
        assert!(n == 0 || (n == 2 && out[..] == slots[..]), "partial or wrong match {n} {out:?}");
        t.join().unwrap();
        c.check_invariants().unwrap();
    });
}

/// A concurrent split never makes a lookup miss content that is cached throughout.
#[test]
fn peek_racing_split() {
    loom::model(|| {
        let c = Arc::new(cache(6));
        let slots = insert_fresh(&c, &[1, 2, 3]);
        let c2 = c.clone();
        let t = thread::spawn(move || {
            let mut out = [0u32; 3];
            // ends inside [1,2,3]: splits it into [1,2] -> [3]
            assert_eq!(c2.match_prefix(0, &[1, 2, 9], &mut out).len(), 2);
        });
        let mut out = [0u32; 3];
        assert_eq!(c.peek_prefix(0, &[1, 2, 3], &mut out), 3, "a half-made split was visible");
        assert_eq!(out[..], slots[..]);
        t.join().unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.node_count(), 2);
    });
}

/// Match-and-lock racing eviction: a locked node is never evicted; the lease's slots
/// stay cached and allocated until it is released.
#[test]
fn lock_racing_evict() {
    loom::model(|| {
        let c = Arc::new(cache(4));
        let slots = insert_fresh(&c, &[1, 2]);
        let c2 = c.clone();
        let t = thread::spawn(move || c2.evict(2));
        let mut out = [0u32; 2];
        let lease = c.match_and_lock(0, &[1, 2], &mut out);
        let freed = t.join().unwrap();
        if lease.len() == 2 {
            assert_eq!(out[..], slots[..]);
            assert_eq!(freed, 0, "evicted a locked node");
            assert_eq!(c.total_size(), 2);
            assert!(slots.iter().all(|&s| c.allocator().is_allocated(s)));
        } else {
            assert_eq!((lease.len(), freed), (0, 2));
        }
        drop(lease);
        c.check_invariants().unwrap();
    });
}

/// Two threads insert overlapping keys at once; each frees its duplicates. The tree
/// ends valid with exact sizes and no slot lost or doubly owned.
#[test]
fn concurrent_overlapping_inserts() {
    loom::model(|| {
        let c = Arc::new(cache(8));
        let c2 = c.clone();
        let t = thread::spawn(move || {
            insert_fresh(&c2, &[1, 2, 3]);
        });
        insert_fresh(&c, &[1, 2, 4]);
        t.join().unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.total_size(), 4);
        assert_eq!(c.evictable_size(), 4);
        assert_eq!(c.allocator().available_size(), 8 - 4);
    });
}

/// The event queue hands every event from a producer to a consumer once, in order.
#[test]
fn event_queue_producer_consumer() {
    loom::model(|| {
        let q = Arc::new(EventQueue::new(2));
        let q2 = q.clone();
        let producer = thread::spawn(move || {
            let mut pushed = 0;
            for page in 0..3 {
                if q2.push(KvEvent::BlockRemoved { hash: [0; 32], page }) {
                    pushed += 1;
                }
            }
            pushed
        });
        let mut got = vec![];
        for _ in 0..3 {
            if let Some(KvEvent::BlockRemoved { page, .. }) = q.pop() {
                got.push(page);
            }
        }
        let pushed = producer.join().unwrap();
        while let Some(KvEvent::BlockRemoved { page, .. }) = q.pop() {
            got.push(page);
        }
        assert_eq!(got.len(), pushed);
        assert_eq!(got.len() as u64 + q.dropped(), 3);
        assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order: {got:?}");
    });
}
