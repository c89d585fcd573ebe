//! The replay's hot path does not allocate: with kvpool's cache, replaying twice as
//! many requests makes no more heap allocations (every buffer is sized up front).
//! Counted with a global allocator wrapper.
//!
//! It runs without libtest's harness (`harness = false`): the harness's main thread
//! blocks on a channel while a test runs, and that wait allocates at moments that
//! depend on timing, which made the count flaky on a loaded machine. Here the only
//! threads are this one and the replay's own.
#![cfg_attr(loom, allow(dead_code, unused_imports))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvpool::radix::{MambaRadixCache, RadixCache, RadixConfig};
use kvpool::replay::{run_hybrid, run_overlap, run_sequential, Mode, ReplayConfig, Trace};
use kvpool::{PagedAllocator, ReqToTokenPool, SlotPool};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A trace of `n` requests over a few shared prefixes, long enough to evict.
fn trace(n: usize) -> Trace {
    let text: String = (0..n)
        .map(|r| {
            let blocks = 1 + r % 5;
            let ids: Vec<String> = (0..blocks).map(|b| ((r % 7) * 10 + b).to_string()).collect();
            let input = blocks * 512 - (r * 37) % 300;
            format!(
                "{{\"input_length\": {input}, \"output_length\": {}, \"hash_ids\": [{}]}}\n",
                1 + r % 90,
                ids.join(",")
            )
        })
        .collect();
    Trace::from_jsonl_str(&text, "alloc-test").unwrap()
}

fn cache(config: &ReplayConfig, trace: &Trace) -> Arc<RadixCache<PagedAllocator>> {
    let alloc = PagedAllocator::new(config.capacity_tokens, config.page_size).unwrap();
    let rows = ReqToTokenPool::new(config.rows() as u32, trace.max_kv_len()).unwrap();
    Arc::new(RadixCache::new(alloc, rows, RadixConfig { policy: config.policy, ..RadixConfig::default() }).unwrap())
}

/// Allocations made while replaying `trace` (cache and trace built beforehand).
fn allocations(config: &ReplayConfig, trace: &Trace) -> (u64, u64) {
    let cache = cache(config, trace);
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let report = match config.mode {
        Mode::Sequential => run_sequential(&cache, trace, config, &|_| {}),
        Mode::Overlap => run_overlap(&cache, trace, config, &|_| {}),
    };
    COUNTING.store(false, Ordering::SeqCst);
    let report = report.unwrap();
    (ALLOCATIONS.load(Ordering::SeqCst), report.evicted_tokens)
}

/// Allocations made while replaying `trace` as a hybrid model (`--model hybrid`) with
/// `states` state slots; also the tokens and states evicted.
fn hybrid_allocations(config: &ReplayConfig, trace: &Trace, states: u32) -> (u64, u64, u64) {
    let alloc = PagedAllocator::new(config.capacity_tokens, config.page_size).unwrap();
    let rows = ReqToTokenPool::new(1, trace.max_kv_len()).unwrap();
    let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
    let cache =
        Arc::new(MambaRadixCache::with_states(alloc, rows, SlotPool::without_magazines(states), radix).unwrap());
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let report = run_hybrid(&cache, trace, config, &|_| {});
    COUNTING.store(false, Ordering::SeqCst);
    let report = report.unwrap();
    let h = report.hybrid.unwrap();
    (ALLOCATIONS.load(Ordering::SeqCst), report.evicted_tokens, h.states_evicted_for_states + h.states_evicted_with_kv)
}

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    replay_allocations_do_not_grow_with_the_trace();
    hybrid_replay_allocations_do_not_grow_with_the_trace();
    println!("replay_alloc: the replay's allocations do not grow with the trace (both modes, and --model hybrid)");
}

fn replay_allocations_do_not_grow_with_the_trace() {
    let (short, long) = (trace(200), trace(800));

    let seq = ReplayConfig { mode: Mode::Sequential, capacity_tokens: 8192, page_size: 16, ..ReplayConfig::default() };
    let (a, evicted) = allocations(&seq, &short);
    let (b, _) = allocations(&seq, &long);
    assert!(evicted > 0, "the capacity is meant to force eviction");
    assert_eq!(a, b, "sequential: {a} allocations for 200 requests, {b} for 800");

    // Overlap: thread start-up and the channel allocate; requests must not.
    let ovl = ReplayConfig {
        mode: Mode::Overlap,
        capacity_tokens: 8192,
        page_size: 16,
        max_running: 4,
        routers: 2,
        ..ReplayConfig::default()
    };
    let (a, _) = allocations(&ovl, &short);
    let (b, _) = allocations(&ovl, &long);
    assert!(b <= a + 16, "overlap: {a} allocations for 200 requests, {b} for 800");
}

fn hybrid_replay_allocations_do_not_grow_with_the_trace() {
    let (short, long) = (trace(200), trace(800));
    let seq = ReplayConfig { mode: Mode::Sequential, capacity_tokens: 8192, page_size: 16, ..ReplayConfig::default() };
    let (a, evicted, _) = hybrid_allocations(&seq, &short, 64);
    let (b, _, _) = hybrid_allocations(&seq, &long, 64);
    assert!(evicted > 0, "the capacity is meant to force eviction");
    assert_eq!(a, b, "hybrid: {a} allocations for 200 requests, {b} for 800");
    // A state pool small enough that states are evicted for states.
    let (a, _, states) = hybrid_allocations(&seq, &short, 4);
    let (b, _, _) = hybrid_allocations(&seq, &long, 4);
    assert!(states > 0, "4 state slots are meant to force state eviction");
    assert_eq!(a, b, "hybrid, 4 states: {a} allocations for 200 requests, {b} for 800");
}
