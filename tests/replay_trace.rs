//! The bundled trace, replayed whole in sequential mode: the ideal hit rate at
//! infinite capacity, and kvpool's RadixCache against the reference tree at the
//! default capacity. (Each run takes seconds in a debug build.)
#![cfg(all(not(loom), feature = "replay"))]

mod replay_common;

use std::collections::HashMap;

use kvpool::replay::Trace;
use replay_common::{int, replay_json};

/// The ideal hit count, computed from the hash ids alone: request `r`'s hit is the
/// longest common token prefix with any earlier request (everything stays cached and
/// output tokens never match prompts). Two prompts agree up to `min(L_r, L_r', 512 * k)`
/// where `k` is the number of equal leading hash ids: blocks with equal ids hold equal
/// tokens, a partial last block is a prefix of the full one, and the first token of a
/// block with a different id differs. So walking a trie of hash-id prefixes, each node
/// keeping the longest prompt that passed through it, the hit of `r` is the best
/// `min(L_r, 512 * depth, longest prompt at the node)` along its path.
fn ideal_hits(trace: &Trace) -> (u64, u64) {
    let mut trie: HashMap<(u32, u32), (u32, u64)> = HashMap::new(); // (parent, id) -> (node, longest L)
    let mut nodes = 1u32;
    let (mut prompt, mut hit) = (0u64, 0u64);
    for r in 0..trace.len() {
        let l = trace.request(r).input_length as u64;
        prompt += l;
        let mut node = 0u32;
        let mut best = 0u64;
        for (depth, &h) in trace.hash_ids(r).iter().enumerate() {
            match trie.get(&(node, h)) {
                Some(&(child, longest)) => {
                    best = best.max(l.min(512 * (depth as u64 + 1)).min(longest));
                    node = child;
                }
                None => break,
            }
        }
        hit += best;
        let mut node = 0u32;
        for &h in trace.hash_ids(r) {
            let entry = trie.entry((node, h)).or_insert_with(|| {
                nodes += 1;
                (nodes - 1, 0)
            });
            entry.1 = entry.1.max(l);
            node = entry.0;
        }
    }
    (prompt, hit)
}

#[test]
fn infinite_capacity_gives_the_ideal_hit_rate() {
    let trace = Trace::bundled().unwrap();
    let (prompt, ideal) = ideal_hits(&trace);
    assert_eq!(prompt, 144_793_823);
    // Room for every token of every request: nothing is ever evicted.
    let capacity = (trace.total_input_tokens() + trace.total_output_tokens()).to_string();
    let v = replay_json(&[
        "--mode",
        "sequential",
        "--page-size",
        "1",
        "--capacity-tokens",
        &capacity,
        "--cache",
        "reference",
    ]);
    assert_eq!(int(&v, "evicted_tokens"), 0);
    assert_eq!(int(&v, "prompt_tokens"), prompt);
    assert_eq!(int(&v, "hit_tokens"), ideal);
    // 54,098,411 of 144,793,823: 37.36%, the 37.4%.
    assert_eq!(format!("{:.1}", 100.0 * ideal as f64 / prompt as f64), "37.4");
}

#[test]
fn kvpool_and_reference_agree_on_the_full_trace() {
    let run = |cache: &str| replay_json(&["--mode", "sequential", "--cache", cache]);
    let (kvpool, reference) = std::thread::scope(|s| {
        let a = s.spawn(|| run("kvpool"));
        let b = s.spawn(|| run("reference"));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(int(&kvpool, "requests"), 12_031);
    assert_eq!(int(&kvpool, "capacity_tokens"), 1 << 20);
    for key in [
        "requests",
        "rejected",
        "prompt_tokens",
        "hit_tokens",
        "computed_tokens",
        "output_tokens",
        "evicted_tokens",
        "peak_used_tokens",
        "final_cached_tokens",
    ] {
        assert_eq!(int(&kvpool, key), int(&reference, key), "{key}");
    }
    // At 1M tokens the cache is far smaller than the working set: it evicts.
    assert!(int(&kvpool, "evicted_tokens") > 100_000_000);
    assert!(int(&kvpool, "hit_tokens") > 0);
}
