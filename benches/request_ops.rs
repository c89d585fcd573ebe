//! What a request costs through kvpool's engine contract: the `cache_ops` work of every
//! request of the bundled Mooncake trace (match and lock the prompt, evict the
//! shortfall, allocate the rest of its KV, finish it) on two caches of the same
//! configuration, in one process, on the same tokens:
//!
//! * `reference`: the SGLang-shaped reference tree (`kvpool::replay::ReferenceCache`:
//!   `kvpool::baseline::ReferenceRadixCache` behind a mutex, its own allocator and
//!   request rows), through the replay's request contract;
//! * `request`: `RadixCache` through its request handle (`admit`, `Request::extend`,
//!   `RadixCache::decode`, `Request::finish`).
//!
//! The same two again with the prompt allocated at admission and every later token by
//! a decode step of its own (`decode steps`: the sequential replay's shape). Both must
//! find the same hits (asserted: the handle caches what SGLang's calls cache). Rounds
//! alternate between the two, and the medians and their ratio are printed per
//! configuration (page size 16 and 1 at 1 M tokens, page size 16 at 150 M).
//!
//! ```sh
//! cargo bench --bench request_ops                  # 7 rounds each
//! KVPOOL_ROUNDS=11 KVPOOL_BENCH_CLOCK=cpu cargo bench --bench request_ops
//! ```
//!
//! `KVPOOL_BENCH_CLOCK=cpu` times by the thread's CPU time (Linux) instead of wall time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::alloc::plan_extend;
use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
use kvpool::replay::{ReferenceCache, Trace};
use kvpool::{PagedAllocator, ReqToTokenPool};

type Cache = RadixCache<PagedAllocator>;

fn cache(page_size: u32, capacity: usize, max_kv: usize) -> Arc<Cache> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, ..RadixConfig::default() };
    let alloc = PagedAllocator::new(capacity, page_size).unwrap();
    Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), config).unwrap())
}

/// The tokens to evict before request `hit..kv` allocates (as the replay and SGLang
/// do before allocating), with `available` tokens free.
fn shortfall(ps: u32, available: usize, hit: usize, kv: usize) -> usize {
    let need = plan_extend(ps, &[hit as u32], &[kv as u32]).unwrap().new_pages * ps as usize;
    need.saturating_sub(available)
}

/// Evict what request `hit..kv` lacks.
fn make_room(c: &Cache, hit: usize, kv: usize) {
    let short = shortfall(c.page_size() as u32, c.allocator().available_size(), hit, kv);
    if short > 0 {
        c.evict(short);
    }
}

/// [`make_room`] on the reference tree.
fn make_room_reference(c: &ReferenceCache, hit: usize, kv: usize) {
    use kvpool::replay::ReplayCache;
    let short = shortfall(c.page_size(), c.available_tokens(), hit, kv);
    if short > 0 {
        c.evict(short);
    }
}

fn reference(page_size: u32, capacity: usize, max_kv: usize) -> ReferenceCache {
    ReferenceCache::new(capacity, page_size, EvictionPolicy::Lru, 1, max_kv).unwrap()
}

/// The `cache_ops` loop over the reference tree, through the replay's contract (its
/// requests hold a row and a lock on the tree's node; the tree is behind a mutex).
fn with_reference(c: &ReferenceCache, trace: &Trace, tokens: &mut [u32]) -> usize {
    use kvpool::replay::{ReplayCache, ReplayRequest};
    let mut hits = 0;
    for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut req = c.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        hits += hit;
        make_room_reference(c, hit, kv);
        if c.extend(&mut req, kv - hit).is_err() {
            c.abort(req);
            continue;
        }
        c.finish(req, &tokens[..kv]).unwrap();
    }
    hits
}

fn with_requests(c: &Arc<Cache>, trace: &Trace, tokens: &mut [u32]) -> usize {
    let mut hits = 0;
    for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut req = c.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        hits += hit;
        make_room(c, hit, kv);
        if req.extend(kv - hit).is_err() {
            continue; // dropped: aborted
        }
        req.finish(&tokens[..kv]).unwrap();
    }
    hits
}

/// [`with_reference`], the prompt allocated at admission and every later token by one
/// decode step (a batch of one).
fn decode_with_reference(c: &ReferenceCache, trace: &Trace, tokens: &mut [u32]) -> usize {
    use kvpool::replay::{ReplayCache, ReplayRequest};
    let ps = c.page_size() as usize;
    let mut hits = 0;
    'requests: for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut req = c.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        hits += hit;
        make_room_reference(c, hit, prompt);
        if c.extend(&mut req, prompt - hit).is_err() {
            c.abort(req);
            continue;
        }
        let mut one = [0u32];
        while req.len() < kv {
            if req.len() % ps == 0 {
                make_room_reference(c, req.len(), req.len() + 1);
            }
            if c.decode(&mut [&mut req], &mut one).is_err() {
                c.abort(req);
                continue 'requests;
            }
        }
        c.finish(req, &tokens[..kv]).unwrap();
    }
    hits
}

/// [`with_requests`], the prompt allocated at admission and every later token by one
/// decode step (`RadixCache::decode` of a batch of one).
fn decode_with_requests(c: &Arc<Cache>, trace: &Trace, tokens: &mut [u32]) -> usize {
    let ps = c.page_size();
    let mut hits = 0;
    'requests: for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut req = c.admit(0, &tokens[..prompt]).unwrap();
        let hit = req.cached_len();
        hits += hit;
        make_room(c, hit, prompt);
        if req.extend(prompt - hit).is_err() {
            continue;
        }
        let mut one = [0u32];
        while req.len() < kv {
            if req.len() % ps == 0 {
                make_room(c, req.len(), req.len() + 1);
            }
            if c.decode(&mut [&mut req], &mut one).is_err() {
                continue 'requests;
            }
        }
        req.finish(&tokens[..kv]).unwrap();
    }
    hits
}

#[cfg(target_os = "linux")]
fn thread_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable `timespec`, the only memory `clock_gettime`
    // writes.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    ok.then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_time() -> Option<Duration> {
    None
}

fn time(cpu: bool, f: impl FnOnce()) -> Duration {
    if cpu {
        let t = thread_cpu_time().unwrap_or_default();
        f();
        thread_cpu_time().unwrap_or_default().saturating_sub(t)
    } else {
        let t = Instant::now();
        f();
        t.elapsed()
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument picks configurations.
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let rounds: usize = std::env::var("KVPOOL_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    let cpu = std::env::var("KVPOOL_BENCH_CLOCK").is_ok_and(|v| v == "cpu") && thread_cpu_time().is_some();
    let trace = Trace::bundled().expect("bundled trace");
    let max_kv = trace.max_kv_len();
    let mut tokens = vec![0u32; max_kv];
    println!("request_ops: {rounds} alternating rounds, {} clock", if cpu { "thread CPU" } else { "wall" });
    println!("| configuration | reference ms (median) | request ms (median) | request / reference |");
    println!("|---|---|---|---|");
    for (label, ps, capacity) in [("ps16_1M", 16, 1 << 20), ("ps1_1M", 1, 1 << 20), ("ps16_150M", 16, 150_000_000)] {
        if !filter.is_empty() && !filter.iter().any(|f| label.contains(f.as_str())) {
            continue;
        }
        type RefLoop = fn(&ReferenceCache, &Trace, &mut [u32]) -> usize;
        type Loop = fn(&Arc<Cache>, &Trace, &mut [u32]) -> usize;
        let loops: [(&str, RefLoop, Loop); 2] =
            [("", with_reference, with_requests), (" decode steps", decode_with_reference, decode_with_requests)];
        for (what, reference_loop, request_loop) in loops {
            let a = reference_loop(&reference(ps, capacity, max_kv), &trace, &mut tokens);
            let b = request_loop(&cache(ps, capacity, max_kv), &trace, &mut tokens);
            assert_eq!(a, b, "{label}{what}: the two loops disagree on hits");
            let (mut refs, mut requests) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                let c = reference(ps, capacity, max_kv);
                refs.push(time(cpu, || {
                    std::hint::black_box(reference_loop(&c, &trace, &mut tokens));
                }));
                drop(c);
                let c = cache(ps, capacity, max_kv);
                requests.push(time(cpu, || {
                    std::hint::black_box(request_loop(&c, &trace, &mut tokens));
                }));
            }
            let (mc, mr) = (median(&mut refs), median(&mut requests));
            println!(
                "| {label}{what} (hits {a}) | {:.1} | {:.1} | {:.3} |",
                mc.as_secs_f64() * 1e3,
                mr.as_secs_f64() * 1e3,
                mr.as_secs_f64() / mc.as_secs_f64()
            );
        }
    }
}
