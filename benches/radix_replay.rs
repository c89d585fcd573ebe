//! The Mooncake conversation trace (12,031 requests, tokens expanded as `kvpool replay`
//! does) through kvpool's `RadixCache` and through the simple reference tree, side by
//! side, at two pool sizes. Two workloads per configuration:
//!
//! * `cache_ops`: only the prefix-cache work of each request — match and lock the
//!   prompt, allocate its remaining KV tokens (evicting the shortfall), finish it
//!   (insert, free duplicates and the tail, unlock);
//! * `sequential_replay`: the whole sequential replay of `kvpool replay --mode
//!   sequential`, decode steps included (the loop every engine runs).
//!
//! Both caches give identical hit counts (asserted here and tested in
//! tests/replay_trace.rs). `cargo bench --bench radix_replay`

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvpool::alloc::plan_extend;
use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
use kvpool::replay::{run_sequential, Mode, ReferenceCache, ReplayCache, ReplayConfig, Trace};
use kvpool::{PagedAllocator, ReqToTokenPool};

const PS: u32 = 16;

/// The cache work of every request of `trace`; returns the hit tokens.
fn cache_ops<C: ReplayCache>(cache: &C, trace: &Trace, tokens: &mut [u32], slots: &mut [u32]) -> usize {
    let mut hits = 0;
    for r in 0..trace.len() {
        let req = trace.request(r);
        let kv = req.kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let prompt = req.input_length as usize;
        let (hit, lease) = cache.match_and_lock(0, &tokens[..prompt], &mut slots[..prompt]);
        hits += hit;
        let last = if hit > 0 { slots[hit - 1] } else { 0 };
        // Evict the shortfall first (as the replay drivers and SGLang do).
        let need = plan_extend(PS, &[hit as u32], &[kv as u32]).unwrap().new_pages * PS as usize;
        let avail = cache.available_tokens();
        if avail < need {
            cache.evict(need - avail);
        }
        if cache.alloc_extend(&[hit as u32], &[kv as u32], &[last], &mut slots[hit..kv]).is_err() {
            cache.unlock(lease);
            continue;
        }
        let mut row = cache.req_pool().alloc().unwrap();
        cache.req_pool().write(&mut row, 0, &slots[..kv]).unwrap();
        cache.cache_finished_req(0, &tokens[..kv], row, lease).unwrap();
    }
    hits
}

fn kvpool_cache(capacity: usize, max_kv: usize) -> RadixCache<PagedAllocator> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None };
    RadixCache::new(PagedAllocator::new(capacity, PS).unwrap(), ReqToTokenPool::new(1, max_kv).unwrap(), config)
        .unwrap()
}

fn reference_cache(capacity: usize, max_kv: usize) -> ReferenceCache {
    ReferenceCache::new(capacity, PS, EvictionPolicy::Lru, 1, max_kv).unwrap()
}

fn bench(c: &mut Criterion) {
    let trace = Trace::bundled().expect("bundled trace");
    let max_kv = trace.max_kv_len();
    let mut tokens = vec![0u32; max_kv];
    let mut slots = vec![0u32; max_kv];
    let mut group = c.benchmark_group("mooncake_trace");
    group.sample_size(10).measurement_time(Duration::from_secs(12)).warm_up_time(Duration::from_secs(1));
    for capacity in [1usize << 20, 1 << 23] {
        // Identical hits, checked once per configuration.
        let a = cache_ops(&kvpool_cache(capacity, max_kv), &trace, &mut tokens, &mut slots);
        let b = cache_ops(&reference_cache(capacity, max_kv), &trace, &mut tokens, &mut slots);
        assert_eq!(a, b, "kvpool and the reference disagree on hits");
        println!("capacity {capacity}: {a} hit tokens in cache_ops (both caches)");

        let id = |name: &str| BenchmarkId::new(name, format!("{}M_tokens", capacity >> 20));
        group.bench_function(id("cache_ops/kvpool"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let cache = kvpool_cache(capacity, max_kv);
                    let t = Instant::now();
                    cache_ops(&cache, &trace, &mut tokens, &mut slots);
                    total += t.elapsed();
                }
                total
            })
        });
        group.bench_function(id("cache_ops/reference"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let cache = reference_cache(capacity, max_kv);
                    let t = Instant::now();
                    cache_ops(&cache, &trace, &mut tokens, &mut slots);
                    total += t.elapsed();
                }
                total
            })
        });
        let config = ReplayConfig {
            capacity_tokens: capacity,
            page_size: PS,
            mode: Mode::Sequential,
            ..ReplayConfig::default()
        };
        group.bench_function(id("sequential_replay/kvpool"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let cache = kvpool_cache(capacity, max_kv);
                    let t = Instant::now();
                    run_sequential(&cache, &trace, &config, &|_| {}).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
        group.bench_function(id("sequential_replay/reference"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let cache = reference_cache(capacity, max_kv);
                    let t = Instant::now();
                    run_sequential(&cache, &trace, &config, &|_| {}).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
