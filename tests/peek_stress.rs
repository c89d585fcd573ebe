//! Lock-free lookups racing a writer that evicts a two-node path and reuses its parent's
//! last page for another parent with a matching child, on real threads.
//!
//! The writer cycles between two trees over the same four pages, each built by a request
//! (a checkpoint at the parent, then the finish adds the child), steered into its pages
//! by a blocker request that holds the pages it must not get:
//!
//! * `[1, 5] -> [2]` in pages `[2, 1] -> [3]`;
//! * `[9] -> [2]` in pages `[1] -> [4]`: page 1, which ended `[1, 5]`, now ends `[9]`,
//!   and its child starts with the page `[2]` that a lookup of `[1, 5, 2]` asks for
//!   below page 1.
//!
//! Readers look both keys up without pause and check every answer against the one tree
//! it may come from: `[1, 5, 2]` finds pages `[2, 1, 3]`, `[2, 1]` or nothing, `[9, 2]`
//! finds `[1, 4]`, `[1]` or nothing. A lookup that validated `[1, 5]`, then continued
//! under page 1 after the writer's swap, would return `[2, 1, 4]`: slots of page 2, free
//! by then, joined to a child of the other tree. The loom model
//! `peek_across_a_reused_parent_page` (tests/loom_radix.rs) checks every interleaving
//! of one such swap; this runs many swaps with page sizes 1 and 16.
//!
//! Bounded by a count of writer cycles, not by time: `KVPOOL_STRESS_CYCLES` sets it
//! (default 300,000 per page size, several seconds: enough that a lookup which re-checks
//! only the deepest node, not each parent, fails it on a 2-core machine). A longer run:
//! `KVPOOL_STRESS_CYCLES=2000000 cargo test --release --test peek_stress`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use kvpool::radix::{RadixCache, RadixConfig};
use kvpool::{PagedAllocator, ReqToTokenPool};

const READERS: usize = 3;

fn cycles() -> u64 {
    std::env::var("KVPOOL_STRESS_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(300_000)
}

/// The tokens of key page `sym` (a page of `ps` tokens, all its own).
fn key(ps: usize, syms: &[u32]) -> Vec<u32> {
    syms.iter().flat_map(|&s| (0..ps as u32).map(move |t| s * 1000 + t)).collect()
}

/// The slots of `pages`, in order.
fn slots(ps: usize, pages: &[u32]) -> Vec<u32> {
    pages.iter().flat_map(|&p| (0..ps as u32).map(move |t| p * ps as u32 + t)).collect()
}

/// Check one lookup's answer: `n` tokens of `out` must be a page-aligned prefix of `whole`.
fn check(what: &str, ps: usize, n: usize, out: &[u32], whole: &[u32]) {
    assert!(n % ps == 0 && n <= whole.len(), "{what}: {n} tokens at page size {ps}");
    assert_eq!(out[..n], whole[..n], "{what}: a path of slots that were never cached together");
}

fn race(ps: usize) {
    let cache = Arc::new(
        RadixCache::new(
            PagedAllocator::new(4 * ps, ps as u32).unwrap(),
            ReqToTokenPool::new(2, 4 * ps).unwrap(),
            RadixConfig::default(),
        )
        .unwrap(),
    );
    let done = Arc::new(AtomicBool::new(false));
    let found = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (c, done, found) = (cache.clone(), done.clone(), found.clone());
            thread::spawn(move || {
                let (a, a_slots) = (key(ps, &[1, 5, 2]), slots(ps, &[2, 1, 3]));
                let (b, b_slots) = (key(ps, &[9, 2]), slots(ps, &[1, 4]));
                let mut out = vec![0u32; 3 * ps];
                let mut i = r;
                while !done.load(Ordering::Relaxed) {
                    i += 1;
                    let n = if i % 4 == 0 {
                        let n = c.peek_prefix(0, &b, &mut out);
                        check("[9, 2]", ps, n, &out, &b_slots);
                        n
                    } else {
                        let n = c.peek_prefix(0, &a, &mut out);
                        check("[1, 5, 2]", ps, n, &out, &a_slots);
                        n
                    };
                    if n > ps {
                        found.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();

    let (k15, k152) = (key(ps, &[1, 5]), key(ps, &[1, 5, 2]));
    let (k9, k92) = (key(ps, &[9]), key(ps, &[9, 2]));
    let (s152, s92) = (slots(ps, &[2, 1, 3]), slots(ps, &[1, 4]));
    for _ in 0..cycles() {
        // `[1, 5] -> [2]` in pages `[2, 1] -> [3]`: a blocker holds page 1 while the
        // request takes its first page (the allocator hands out its lowest free page).
        let mut blocker = cache.admit(0, &[]).unwrap();
        blocker.extend(ps).unwrap();
        let mut a = cache.admit(0, &k152).unwrap();
        a.extend(ps).unwrap();
        blocker.abort();
        a.extend(2 * ps).unwrap();
        assert_eq!(a.slots(), &s152[..], "the writer's layout");
        a.checkpoint(&k15).unwrap();
        a.finish(&k152).unwrap();
        assert_eq!(cache.evict(usize::MAX), 3 * ps);
        // `[9] -> [2]` in pages `[1] -> [4]`: the blocker holds pages 2 and 3.
        let mut b = cache.admit(0, &k92).unwrap();
        b.extend(ps).unwrap();
        let mut blocker = cache.admit(0, &[]).unwrap();
        blocker.extend(2 * ps).unwrap();
        b.extend(ps).unwrap();
        blocker.abort();
        assert_eq!(b.slots(), &s92[..], "the writer's layout");
        b.checkpoint(&k9).unwrap();
        b.finish(&k92).unwrap();
        assert_eq!(cache.evict(usize::MAX), 2 * ps);
    }
    done.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    cache.check_invariants().unwrap();
    assert_eq!(cache.allocator().available_size(), 4 * ps, "a page was lost");
    assert!(found.load(Ordering::Relaxed) > 0, "no lookup ever found more than one page: the race never ran");
    eprintln!(
        "page size {ps}: {} cycles, {} lookups found more than one page",
        cycles(),
        found.load(Ordering::Relaxed)
    );
}

#[test]
fn peek_never_joins_two_trees_page_size_1() {
    race(1);
}

#[test]
fn peek_never_joins_two_trees_page_size_16() {
    race(16);
}
