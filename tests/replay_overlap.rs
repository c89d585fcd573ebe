//! Overlap mode under stress: random conversation-like traces, small capacities and
//! heavy eviction, 4 router threads, every policy and several page sizes. Each run
//! must finish with the invariants holding (the tool checks them and fails otherwise)
//! and with totals that do not depend on the interleaving.
#![cfg(all(not(loom), feature = "replay"))]

mod replay_common;

use kvpool::radix::EvictionPolicy;
use replay_common::{int, random_trace, replay_json, write_trace};

/// Runs per cache kind; each is a separate process over a fresh trace.
const SEEDS: u64 = 16;

fn stress(cache: &str, seeds: u64) {
    for seed in 0..seeds {
        let requests = random_trace(seed, 120, 8);
        let refs: Vec<(u64, u64, &[u64])> = requests.iter().map(|(l, o, h)| (*l, *o, h.as_slice())).collect();
        let path = write_trace(&format!("stress-{cache}-{seed}.jsonl"), &refs);
        let page_size = [1u64, 4, 16][seed as usize % 3];
        // Between about 1 and 2.5 of the largest requests: some do not fit at all,
        // and the rest evict and retract constantly.
        // (Whole pages: `--capacity-tokens` must be a multiple of the page size.)
        let capacity = (3000 + 1000 * (seed % 4)) / page_size * page_size;
        let max_running = 2 + seed % 7;
        let policy = EvictionPolicy::ALL[seed as usize % EvictionPolicy::ALL.len()];
        let v = replay_json(&[
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            "overlap",
            "--cache",
            cache,
            "--routers",
            "4",
            "--page-size",
            &page_size.to_string(),
            "--capacity-tokens",
            &capacity.to_string(),
            "--max-running",
            &max_running.to_string(),
            "--policy",
            policy.name(),
        ]);
        let ctx = format!("seed {seed} ({cache}, page {page_size}, capacity {capacity}, max running {max_running})");
        assert_eq!(v["invariants_ok"], true, "{ctx}");
        // Requests whose KV (in whole pages) exceeds the pool are rejected; all others
        // are served, whatever the interleaving.
        let kv_pages = |l: u64, o: u64| (l + o.max(1) - 1).div_ceil(page_size) * page_size;
        let fits: Vec<_> = requests.iter().filter(|(l, o, _)| kv_pages(*l, *o) <= capacity).collect();
        assert_eq!(int(&v, "requests"), requests.len() as u64, "{ctx}");
        assert_eq!(int(&v, "rejected"), (requests.len() - fits.len()) as u64, "{ctx}");
        assert_eq!(int(&v, "prompt_tokens"), fits.iter().map(|r| r.0).sum::<u64>(), "{ctx}");
        assert_eq!(int(&v, "output_tokens"), fits.iter().map(|r| r.1).sum::<u64>(), "{ctx}");
        assert!(int(&v, "hit_tokens") <= int(&v, "prompt_tokens"), "{ctx}");
        assert!(int(&v, "peak_used_tokens") <= capacity, "{ctx}");
        assert!(int(&v, "final_cached_tokens") <= capacity, "{ctx}");
        assert!(int(&v, "evicted_tokens") > 0, "{ctx}: the capacity is meant to force eviction");
        assert_eq!(int(&v, "routers"), 4, "{ctx}");
    }
}

#[test]
fn overlap_stress_kvpool() {
    stress("kvpool", SEEDS);
}

#[test]
fn overlap_stress_reference() {
    stress("reference", SEEDS / 4);
}

#[test]
fn decode_pressure_retracts_and_still_serves_everyone() {
    // 8 requests of 2 prompt pages fill all 16 pages at admission; the first decode
    // step needs a page each, nothing is evictable and nothing is finishing, so the
    // scheduler must retract. Every request is served in the end.
    let requests: Vec<(u64, u64, Vec<u64>)> = (0..8).map(|i| (8, 40, vec![i])).collect();
    let refs: Vec<(u64, u64, &[u64])> = requests.iter().map(|(l, o, h)| (*l, *o, h.as_slice())).collect();
    let path = write_trace("retract.jsonl", &refs);
    for cache in ["kvpool", "reference"] {
        let v = replay_json(&[
            "--trace",
            path.to_str().unwrap(),
            "--cache",
            cache,
            "--page-size",
            "4",
            "--capacity-tokens",
            "64",
            "--max-running",
            "8",
            "--routers",
            "4",
        ]);
        assert!(int(&v, "retracted") > 0, "{v}");
        assert_eq!(int(&v, "rejected"), 0, "{v}");
        assert_eq!(int(&v, "prompt_tokens"), 64);
        assert_eq!(int(&v, "output_tokens"), 320);
        assert_eq!(int(&v, "peak_used_tokens"), 64);
    }
}
