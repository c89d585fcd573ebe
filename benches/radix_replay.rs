//! The Mooncake conversation trace (12,031 requests, tokens expanded as `kvpool replay`
//! does) through three prefix caches side by side: kvpool's concurrent `RadixCache`,
//! the simple SGLang-shaped reference tree (`reference`) and the TGI-v3-shaped
//! `VecTrieCache` (`vectrie`, issue 8), each with its own allocator. Two workloads:
//!
//! * `cache_ops`: only the prefix-cache work of each request — admit it (a row, its
//!   prompt's match, locked), allocate its remaining KV tokens (evicting the
//!   shortfall), finish it (insert, free duplicates and the tail, unlock);
//! * `sequential_replay`: the whole sequential replay of `kvpool replay --mode
//!   sequential`, decode steps included (the loop every engine runs).
//!
//! Three configurations: page size 16 with 1 M tokens (`ps16_1M`, eviction-heavy),
//! page size 16 with 150 M tokens (`ps16_150M`, everything fits), page size 1 with
//! 1 M tokens (`ps1_1M`). kvpool and the reference give identical hit counts (asserted
//! here once per configuration); the vec trie trims leaves instead of evicting them
//! whole, so its hits may differ slightly: all three are printed.
//!
//! `cache_ops/kvpool_mamba` is the same work for a hybrid model through kvpool's
//! `MambaRadixCache` (issue 9): match to the deepest cached state, a running state and
//! a checkpoint state from the state pool (evicting the least recently used state when
//! it is empty), the request's tokens cached up to its last checkpoint (prefill: the
//! branching point or the prompt's last 64-token chunk; decode: every 256 tokens) with
//! its checkpoint state. The state pool is `kvpool replay --model hybrid`'s default
//! (300 states at 1 M tokens). Its hits (KV matched, state resumable) are printed too.
//!
//! `cache_ops/kvpool_swa` is the `cache_ops` work through kvpool's `SwaRadixCache`
//! (issue 10) over an `SwaAllocator` whose window pool is as large as the full pool and
//! a 128-token window: the same requests, hits and evictions as `cache_ops/kvpool`, plus
//! the window bookkeeping (the mapping written on allocation and cleared on free, the
//! window order, window locks, the window rule of the match). Its hits are printed.
//!
//! `cache_ops/kvpool_hi` is the `cache_ops` work through kvpool's `HiRadixCache`
//! (issue 11) with a host tier under the same device pool (15 M host tokens at 1 M
//! device tokens, as the 1M+15M replay; 16 M at 150 M), `write_through`: an
//! admission loads its host continuation back, device evictions move
//! backed-up nodes to host, backups evict host leaves, and every transfer the tree
//! starts is taken, its page pairs read and completed at once (the copies themselves
//! are not part of it). Its device and host hits are printed.
//!
//! `cache_ops/expansion` times the part of the `cache_ops` loop that is no cache's work:
//! expanding each request's KV tokens from the trace, which every contestant's loop
//! pays alike (the loop has always included it). Subtracting it from a contestant's
//! time estimates the cache work alone. The estimate is low: in the loop the expansion
//! competes with the cache for L1 and L2.
//!
//! `KVPOOL_BENCH_CLOCK=cpu` times every run by the thread's CPU time instead of wall
//! time (Linux): steadier on a shared machine, where a descheduled run would count the
//! time other processes took.
//!
//! Each benchmark is 10 samples of one run each (flat sampling; a run at page size 1
//! takes seconds). A criterion filter runs a subset, e.g.
//! `cargo bench --bench radix_replay -- --noplot ps16_1M` or `-- cache_ops/vectrie`
//! (the hit counts of every configuration are computed first regardless).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode};
use kvpool::alloc::{plan_extend, SwaAllocator};
use kvpool::radix::{
    EvictionPolicy, HiRadixCache, HostTier, MambaRadixCache, RadixCache, RadixConfig, SwaRadixCache, Transfer,
};
use kvpool::replay::{
    run_sequential, HybridConfig, Mode, ReferenceCache, ReplayConfig, Trace, VecTrieReplayCache, MAX_MAMBA_STATES,
    MIN_MAMBA_STATES,
};
use kvpool::{PagedAllocator, ReqToTokenPool, SlotPool};

/// One pool configuration.
#[derive(Clone, Copy)]
struct Setup {
    label: &'static str,
    page_size: u32,
    capacity: usize,
    /// Criterion's measurement time (with one run per sample it only needs to cover
    /// the 10 samples).
    measure: Duration,
}

const SETUPS: [Setup; 3] = [
    Setup { label: "ps16_1M", page_size: 16, capacity: 1 << 20, measure: Duration::from_secs(6) },
    Setup { label: "ps16_150M", page_size: 16, capacity: 150_000_000, measure: Duration::from_secs(6) },
    Setup { label: "ps1_1M", page_size: 1, capacity: 1 << 20, measure: Duration::from_secs(20) },
];

#[path = "shared/cache_ops.rs"]
mod shared;
use shared::{cache_ops, expansion_only};

/// [`cache_ops`] for a hybrid model through a `MambaRadixCache`, with the same request
/// calls: a request resumes from the deepest cached state (`cached_len()` tokens),
/// allocates KV for the rest, holds a running state and a checkpoint state, and caches
/// its tokens up to its last checkpoint with the checkpoint state (as `kvpool replay
/// --model hybrid`, without the decode steps). Returns the (KV, state) hit tokens.
fn cache_ops_mamba(cache: &Arc<MambaRadixCache<PagedAllocator>>, trace: &Trace, tokens: &mut [u32]) -> (usize, usize) {
    let ps = cache.page_size() as u32;
    let m = cache.checkpoint_config();
    let (mut kv_hits, mut hits) = (0, 0);
    for r in 0..trace.len() {
        let req = trace.request(r);
        let kv = req.kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let prompt = req.input_length as usize;
        let mut req = cache.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        kv_hits += req.kv_hit();
        hits += hit;
        // The last checkpoint: the prefill one, or a later decode one.
        let first = req.branching_len().unwrap_or_else(|| m.prefill_checkpoint(prompt));
        let decode = kv / m.track_interval * m.track_interval;
        let checkpoint = if decode > prompt { decode.max(first) } else { first };
        if checkpoint > hit {
            req.save_state(checkpoint).unwrap();
        }
        let need = plan_extend(ps, &[hit as u32], &[kv as u32]).unwrap().new_pages * ps as usize;
        let avail = cache.allocator().available_size();
        if avail < need {
            cache.evict(need - avail);
        }
        if req.extend(kv - hit).is_err() {
            req.abort();
            continue;
        }
        req.finish(&tokens[..kv]).unwrap();
    }
    (kv_hits, hits)
}

/// [`cache_ops`] through an `SwaRadixCache`, with the same request calls (its `extend`
/// evicts both pools' shortfall). Returns the hit tokens.
fn cache_ops_swa(cache: &Arc<SwaRadixCache>, trace: &Trace, tokens: &mut [u32]) -> usize {
    let mut hits = 0;
    for r in 0..trace.len() {
        let req = trace.request(r);
        let kv = req.kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let prompt = req.input_length as usize;
        let mut req = cache.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        hits += hit;
        if req.extend(kv - hit).is_err() {
            req.abort();
            continue;
        }
        req.finish(&tokens[..kv]).unwrap();
    }
    hits
}

/// Page buffers for [`cache_ops_hi`]'s transfers.
struct Flight {
    held: Vec<Transfer>,
    device: Vec<u32>,
    host: Vec<u32>,
}

impl Flight {
    fn new(max_kv: usize) -> Flight {
        Flight { held: vec![Transfer::default(); 256], device: vec![0; max_kv], host: vec![0; max_kv] }
    }

    /// Take every transfer started, read its pairs, complete it.
    fn settle(&mut self, cache: &HiRadixCache<PagedAllocator>) {
        loop {
            let n = cache.take_transfers(&mut self.held);
            for t in &self.held[..n] {
                cache.transfer_pages(*t, &mut self.device, &mut self.host).unwrap();
                cache.complete(*t).unwrap();
            }
            if n < self.held.len() {
                break;
            }
        }
    }
}

/// [`cache_ops`] through a `HiRadixCache` (see the module docs). Returns the device
/// and the host (loaded back) hit tokens.
fn cache_ops_hi(
    cache: &Arc<HiRadixCache<PagedAllocator>>,
    trace: &Trace,
    tokens: &mut [u32],
    flight: &mut Flight,
) -> (usize, usize) {
    let ps = cache.page_size();
    let (mut device, mut host) = (0, 0);
    for r in 0..trace.len() {
        let req = trace.request(r);
        let kv = req.kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let prompt = req.input_length as usize;
        let mut req = cache.admit(0, &tokens[..prompt]).unwrap();
        flight.settle(cache);
        let (hit, loaded) = (req.cached_len(), req.host_hit().loaded);
        (device, host) = (device + hit - loaded, host + loaded);
        let need = plan_extend(ps as u32, &[hit as u32], &[kv as u32]).unwrap().new_pages * ps;
        let avail = cache.allocator().available_size();
        if avail < need {
            cache.evict(need - avail);
            flight.settle(cache);
        }
        if req.extend(kv - hit).is_err() {
            req.abort();
            continue;
        }
        req.finish(&tokens[..kv]).unwrap();
        flight.settle(cache);
    }
    (device, host)
}

fn hi_cache(s: Setup, max_kv: usize) -> Arc<HiRadixCache<PagedAllocator>> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
    let alloc = PagedAllocator::new(s.capacity, s.page_size).unwrap();
    let host_tokens = if s.capacity <= 1 << 20 { 15 << 20 } else { 16 << 20 };
    let tier = HostTier::new((host_tokens / s.page_size as usize) as u32);
    Arc::new(HiRadixCache::with_host_tier(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), config, tier).unwrap())
}

fn swa_cache(s: Setup, max_kv: usize) -> Arc<SwaRadixCache> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
    let alloc = SwaAllocator::new(s.capacity, s.capacity, s.page_size).unwrap();
    Arc::new(SwaRadixCache::with_window(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), config, 128).unwrap())
}

fn mamba_cache(s: Setup, max_kv: usize) -> Arc<MambaRadixCache<PagedAllocator>> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
    let alloc = PagedAllocator::new(s.capacity, s.page_size).unwrap();
    let states = HybridConfig::default().state_slots(s.capacity).clamp(MIN_MAMBA_STATES, MAX_MAMBA_STATES);
    let pool = SlotPool::without_magazines(states as u32);
    Arc::new(MambaRadixCache::with_states(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), pool, config).unwrap())
}

fn kvpool_cache(s: Setup, max_kv: usize) -> Arc<RadixCache<PagedAllocator>> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
    let alloc = PagedAllocator::new(s.capacity, s.page_size).unwrap();
    Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), config).unwrap())
}

fn reference_cache(s: Setup, max_kv: usize) -> ReferenceCache {
    ReferenceCache::new(s.capacity, s.page_size, EvictionPolicy::Lru, 1, max_kv).unwrap()
}

fn vectrie_cache(s: Setup, max_kv: usize) -> VecTrieReplayCache {
    VecTrieReplayCache::new(s.capacity, s.page_size, 1, max_kv).unwrap()
}

fn replay_config(s: Setup) -> ReplayConfig {
    ReplayConfig {
        capacity_tokens: s.capacity,
        page_size: s.page_size,
        mode: Mode::Sequential,
        ..ReplayConfig::default()
    }
}

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), on 64-bit Linux.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn thread_cpu_time() -> Option<Duration> {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable `struct timespec` (two 64-bit fields on 64-bit
    // Linux), the only memory `clock_gettime` writes.
    let ok = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    ok.then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn thread_cpu_time() -> Option<Duration> {
    None
}

/// Whether runs are timed by thread CPU time (`KVPOOL_BENCH_CLOCK=cpu`, where
/// available) rather than wall time.
fn cpu_clock() -> bool {
    std::env::var("KVPOOL_BENCH_CLOCK").is_ok_and(|v| v == "cpu") && thread_cpu_time().is_some()
}

/// Time `work` on a fresh cache per run; building and dropping the cache is not timed.
fn timed<C, M, W>(group: &mut BenchmarkGroup<'_, WallTime>, id: BenchmarkId, make: M, mut work: W)
where
    M: Fn() -> C,
    W: FnMut(&C),
{
    let cpu = cpu_clock();
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let cache = make();
                if cpu {
                    let t = thread_cpu_time().unwrap_or_default();
                    work(&cache);
                    total += thread_cpu_time().unwrap_or_default().saturating_sub(t);
                } else {
                    let t = Instant::now();
                    work(&cache);
                    total += t.elapsed();
                }
                drop(cache);
            }
            total
        })
    });
}

fn bench(c: &mut Criterion) {
    let trace = Trace::bundled().expect("bundled trace");
    let max_kv = trace.max_kv_len();
    let mut tokens = vec![0u32; max_kv];
    let mut group = c.benchmark_group("mooncake_trace");
    group.sample_size(10).sampling_mode(SamplingMode::Flat).warm_up_time(Duration::from_secs(1));
    for s in SETUPS {
        // Hit tokens of each cache, once per configuration.
        let a = cache_ops(&kvpool_cache(s, max_kv), &trace, &mut tokens);
        let b = cache_ops(&reference_cache(s, max_kv), &trace, &mut tokens);
        let v = cache_ops(&vectrie_cache(s, max_kv), &trace, &mut tokens);
        assert_eq!(a, b, "{}: kvpool and the reference disagree on hits", s.label);
        let (mkv, mstate) = cache_ops_mamba(&mamba_cache(s, max_kv), &trace, &mut tokens);
        assert!(mstate <= mkv, "{}: state hits beyond the KV hits", s.label);
        let config = replay_config(s);
        let seq = |r: Result<kvpool::replay::Report, _>| r.expect("sequential replay").hit_tokens;
        let sa = seq(run_sequential(&kvpool_cache(s, max_kv), &trace, &config, &|_| {}));
        let sb = seq(run_sequential(&reference_cache(s, max_kv), &trace, &config, &|_| {}));
        let sv = seq(run_sequential(&vectrie_cache(s, max_kv), &trace, &config, &|_| {}));
        assert_eq!(sa, sb, "{}: kvpool and the reference disagree on sequential hits", s.label);
        println!(
            "{}: hit tokens cache_ops kvpool = reference = {a}, vectrie {v} ({:+}); \
             sequential_replay kvpool = reference = {sa}, vectrie {sv} ({:+})",
            s.label,
            v as i64 - a as i64,
            sv as i64 - sa as i64
        );
        println!("{}: hit tokens cache_ops kvpool_mamba: KV {mkv}, state (resumable) {mstate}", s.label);
        let w = cache_ops_swa(&swa_cache(s, max_kv), &trace, &mut tokens);
        println!("{}: hit tokens cache_ops kvpool_swa: {w} (kvpool {a})", s.label);
        let mut flight = Flight::new(max_kv);
        let (hd, hh) = cache_ops_hi(&hi_cache(s, max_kv), &trace, &mut tokens, &mut flight);
        println!("{}: hit tokens cache_ops kvpool_hi: device {hd}, host {hh} (kvpool {a})", s.label);
        if cpu_clock() {
            println!("{}: timing by thread CPU time (KVPOOL_BENCH_CLOCK=cpu)", s.label);
        }

        group.measurement_time(s.measure);
        let id = |what: &str, who: &str| BenchmarkId::new(format!("{what}/{who}"), s.label);
        let (trace, tokens) = (&trace, &mut tokens);
        timed(
            &mut group,
            id("cache_ops", "kvpool"),
            || kvpool_cache(s, max_kv),
            |c| {
                cache_ops(c, trace, tokens);
            },
        );
        timed(
            &mut group,
            id("cache_ops", "expansion"),
            || (),
            |_| {
                expansion_only(trace, tokens);
            },
        );
        timed(
            &mut group,
            id("cache_ops", "kvpool_mamba"),
            || mamba_cache(s, max_kv),
            |c| {
                cache_ops_mamba(c, trace, tokens);
            },
        );
        timed(
            &mut group,
            id("cache_ops", "kvpool_swa"),
            || swa_cache(s, max_kv),
            |c| {
                cache_ops_swa(c, trace, tokens);
            },
        );
        let fl = &mut flight;
        timed(
            &mut group,
            id("cache_ops", "kvpool_hi"),
            || hi_cache(s, max_kv),
            |c| {
                cache_ops_hi(c, trace, tokens, fl);
            },
        );
        timed(
            &mut group,
            id("cache_ops", "reference"),
            || reference_cache(s, max_kv),
            |c| {
                cache_ops(c, trace, tokens);
            },
        );
        timed(
            &mut group,
            id("cache_ops", "vectrie"),
            || vectrie_cache(s, max_kv),
            |c| {
                cache_ops(c, trace, tokens);
            },
        );
        let config = &config;
        timed(
            &mut group,
            id("sequential_replay", "kvpool"),
            || kvpool_cache(s, max_kv),
            |c| {
                run_sequential(c, trace, config, &|_| {}).unwrap();
            },
        );
        timed(
            &mut group,
            id("sequential_replay", "reference"),
            || reference_cache(s, max_kv),
            |c| {
                run_sequential(c, trace, config, &|_| {}).unwrap();
            },
        );
        timed(
            &mut group,
            id("sequential_replay", "vectrie"),
            || vectrie_cache(s, max_kv),
            |c| {
                run_sequential(c, trace, config, &|_| {}).unwrap();
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
