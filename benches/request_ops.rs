//! What the request handle costs: the `cache_ops` work of every request of the bundled
//! Mooncake trace (match and lock the prompt, evict the shortfall, allocate the rest of
//! its KV, finish it) written twice against the same `RadixCache` configuration, in one
//! process, on the same tokens:
//!
//! * `calls`: the cache's lower-level calls (`match_and_lock_row`, `alloc_extend_row`,
//!   `cache_finished_req` with a row and a lease the caller keeps);
//! * `request`: the engine contract (`admit`, `Request::extend`, `Request::finish`).
//!
//! The same two again with the prompt allocated at admission and every later token by
//! a decode step of its own (`decode steps`: the sequential replay's shape). Both must
//! find the same hits (asserted). Rounds alternate between the two, and the
//! medians and their ratio are printed per configuration (page size 16 and 1 at 1 M
//! tokens, page size 16 at 150 M).
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
use kvpool::replay::Trace;
use kvpool::{PagedAllocator, ReqToTokenPool};

type Cache = RadixCache<PagedAllocator>;

fn cache(page_size: u32, capacity: usize, max_kv: usize) -> Arc<Cache> {
    let config = RadixConfig { policy: EvictionPolicy::Lru, ..RadixConfig::default() };
    let alloc = PagedAllocator::new(capacity, page_size).unwrap();
    Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(1, max_kv).unwrap(), config).unwrap())
}

/// Evict what request `hit..kv` lacks (as the replay and SGLang do before allocating).
fn make_room(c: &Cache, hit: usize, kv: usize) {
    let ps = c.page_size() as u32;
    let need = plan_extend(ps, &[hit as u32], &[kv as u32]).unwrap().new_pages * ps as usize;
    let avail = c.allocator().available_size();
    if avail < need {
        c.evict(need - avail);
    }
}

fn with_calls(c: &Arc<Cache>, trace: &Trace, tokens: &mut [u32]) -> usize {
    let mut hits = 0;
    for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut row = c.req_pool().alloc().unwrap();
        let lease = c.match_and_lock_row(0, &tokens[..prompt], &mut row).unwrap();
        let hit = lease.len();
        hits += hit;
        make_room(c, hit, kv);
        if c.alloc_extend_row(&mut row, hit, kv).is_err() {
            drop(lease);
            c.req_pool().free(row).unwrap();
            continue;
        }
        c.cache_finished_req(0, &tokens[..kv], row, lease, 0).unwrap();
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

/// [`with_calls`], the prompt allocated at admission and every later token by one
/// decode step (`alloc_decode` with the last slot the caller tracks, then a row write).
fn decode_with_calls(c: &Arc<Cache>, trace: &Trace, tokens: &mut [u32]) -> usize {
    let ps = c.page_size() as u32;
    let mut hits = 0;
    'requests: for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv) = (q.input_length as usize, q.kv_len());
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let mut row = c.req_pool().alloc().unwrap();
        let lease = c.match_and_lock_row(0, &tokens[..prompt], &mut row).unwrap();
        let hit = lease.len();
        hits += hit;
        make_room(c, hit, prompt);
        if c.alloc_extend_row(&mut row, hit, prompt).is_err() {
            drop(lease);
            c.req_pool().free(row).unwrap();
            continue;
        }
        let mut last = c.req_pool().read(&row, prompt - 1..prompt).unwrap()[0];
        let mut one = [0u32];
        for seq in prompt + 1..=kv {
            if (seq as u32 - 1) % ps == 0 {
                make_room(c, seq - 1, seq);
            }
            if c.alloc_decode(&[seq as u32], &[last], &mut one).is_err() {
                let held = c.req_pool().read(&row, hit..seq - 1).unwrap().to_vec();
                c.allocator().free(&held).unwrap();
                drop(lease);
                c.req_pool().free(row).unwrap();
                continue 'requests;
            }
            c.req_pool().write(&mut row, seq - 1, &one).unwrap();
            last = one[0];
        }
        c.cache_finished_req(0, &tokens[..kv], row, lease, 0).unwrap();
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
    println!("| configuration | calls ms (median) | request ms (median) | request / calls |");
    println!("|---|---|---|---|");
    for (label, ps, capacity) in [("ps16_1M", 16, 1 << 20), ("ps1_1M", 1, 1 << 20), ("ps16_150M", 16, 150_000_000)] {
        if !filter.is_empty() && !filter.iter().any(|f| label.contains(f.as_str())) {
            continue;
        }
        type Loop = fn(&Arc<Cache>, &Trace, &mut [u32]) -> usize;
        let loops: [(&str, Loop, Loop); 2] =
            [("", with_calls, with_requests), (" decode steps", decode_with_calls, decode_with_requests)];
        for (what, calls_loop, request_loop) in loops {
            let a = calls_loop(&cache(ps, capacity, max_kv), &trace, &mut tokens);
            let b = request_loop(&cache(ps, capacity, max_kv), &trace, &mut tokens);
            assert_eq!(a, b, "{label}{what}: the two loops disagree on hits");
            let (mut calls, mut requests) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                let c = cache(ps, capacity, max_kv);
                calls.push(time(cpu, || {
                    std::hint::black_box(calls_loop(&c, &trace, &mut tokens));
                }));
                drop(c);
                let c = cache(ps, capacity, max_kv);
                requests.push(time(cpu, || {
                    std::hint::black_box(request_loop(&c, &trace, &mut tokens));
                }));
            }
            let (mc, mr) = (median(&mut calls), median(&mut requests));
            println!(
                "| {label}{what} (hits {a}) | {:.1} | {:.1} | {:.3} |",
                mc.as_secs_f64() * 1e3,
                mr.as_secs_f64() * 1e3,
                mr.as_secs_f64() / mc.as_secs_f64()
            );
        }
    }
}
