//! `kvpool replay --model hybrid`: the trace through kvpool's `MambaRadixCache`. A
//! small trace whose every hybrid figure is worked out by hand (with and without
//! pressure on the state pool), the start of the bundled trace (accounting, relations
//! between the figures, determinism), and the command line's flags and errors.
#![cfg(all(not(loom), feature = "replay"))]

mod replay_common;

use kvpool::replay::{replay, HybridConfig, Mode, Model, ReplayConfig, Report, Trace};
use replay_common::{int, kvpool, replay_json, write_trace};
use serde_json::Value;
use std::process::{Command, Output};

/// Page size 16, chunk 64, track interval 256 (the defaults); blocks of 512 tokens.
///
/// * r0 `L=600 O=1 [1,2]`: no hit. Checkpoint at 576 (the prompt's last chunk
///   boundary): caches 576 tokens with a state.
/// * r1 `L=700 O=1 [1,3]`: the KV matches block 1 (512) inside r0's node, which splits:
///   the upper half has no state, so nothing is resumable (state hit 0). Branched: it
///   checkpoints at 512, reviving the tombstone.
/// * r2 `L=700 O=1 [1,3]`: KV 512, state 512 (r1's checkpoint); checkpoint at 640, a new
///   leaf of 128.
/// * r3 `L=512 O=300 [1]`: KV 512, state 512; the decode reaches 768 (a multiple of
///   256) before its 811 KV tokens: caches 768, a leaf of 256 output tokens.
/// * r4 `L=40 O=1 [9]`: shorter than a chunk, no decode checkpoint: nothing cached.
///
/// KV hits 3 x 512, state hits 2 x 512, 4 states cached, 960 tokens cached.
const SCENARIO: &[(u64, u64, &[u64])] =
    &[(600, 1, &[1, 2]), (700, 1, &[1, 3]), (700, 1, &[1, 3]), (512, 300, &[1]), (40, 1, &[9])];

fn hybrid(v: &Value) -> &Value {
    let h = &v["hybrid"];
    assert!(h.is_object(), "no hybrid object in {v}");
    h
}

fn check_hybrid(v: &Value, expected: &[(&str, u64)]) {
    let h = hybrid(v);
    for &(key, want) in expected {
        assert_eq!(int(h, key), want, "{key} in {h}");
    }
    assert_eq!(int(h, "state_hit_tokens"), int(v, "hit_tokens"), "{v}");
    assert_eq!(v["invariants_ok"], Value::Bool(true));
    assert_eq!(v["mode"], "sequential");
}

#[test]
fn scenario_every_hybrid_figure() {
    let path = write_trace("hybrid.jsonl", SCENARIO);
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--model", "hybrid", "--mamba-states", "16"]);
    assert_eq!((int(&v, "prompt_tokens"), int(&v, "hit_tokens"), int(&v, "final_cached_tokens")), (2552, 1024, 960));
    assert_eq!(int(&v, "evicted_tokens"), 0);
    check_hybrid(
        &v,
        &[
            ("mamba_states", 16),
            ("chunk_size", 64),
            ("track_interval", 256),
            ("kv_hit_tokens", 1536),
            ("state_hit_tokens", 1024),
            ("state_hit_requests", 2),
            ("branched_requests", 1),
            ("states_cached", 4),
            ("states_duplicate", 0),
            ("states_evicted_for_states", 0),
            ("states_evicted_with_kv", 0),
            // r3: the 3 cached states (one locked), its own, its checkpoint.
            ("peak_states_in_use", 5),
            ("final_states_held", 4),
            ("final_tombstones", 0),
        ],
    );
}

/// The same trace with the smallest state pool (3): a request resuming from the
/// shared 512-token state holds it locked, its own state and its checkpoint, so the
/// least recently used cached state goes for its checkpoint.
///
/// * r0, r1 as before: 2 states held (r1 used the last free ones).
/// * r2: resumes from 512 (locked); its own state takes the last free slot; its
///   checkpoint slot evicts the LRU unlocked state, r0's leaf `[512, 576)` (64 tokens,
///   with its KV). Caches 640: 2 held.
/// * r3: likewise evicts r2's leaf `[512, 640)` (128 tokens). Caches 768: 2 held.
/// * r4: one state of its own, no checkpoint.
///
/// The hits are those of the large pool (evictions come after each match).
#[test]
fn smallest_state_pool_evicts_states_for_states() {
    let path = write_trace("hybrid3.jsonl", SCENARIO);
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--model", "hybrid", "--mamba-states", "3"]);
    assert_eq!((int(&v, "hit_tokens"), int(&v, "evicted_tokens"), int(&v, "final_cached_tokens")), (1024, 192, 768));
    check_hybrid(
        &v,
        &[
            ("mamba_states", 3),
            ("kv_hit_tokens", 1536),
            ("state_hit_requests", 2),
            ("branched_requests", 1),
            ("states_cached", 4),
            ("states_evicted_for_states", 2),
            ("states_evicted_with_kv", 0),
            ("peak_states_in_use", 3),
            ("final_states_held", 2),
            ("final_tombstones", 0),
        ],
    );
}

/// A KV pool of 1,024 tokens: r3 (811 KV tokens, 816 in pages) must evict everything
/// unlocked but the state path it resumes from. Every figure still adds up (the
/// replay checks its accounting; here the relations).
#[test]
fn kv_eviction_takes_states_with_leaves() {
    let path = write_trace("hybrid_kv.jsonl", SCENARIO);
    let v = replay_json(&[
        "--trace",
        path.to_str().unwrap(),
        "--model",
        "hybrid",
        "--capacity-tokens",
        "1024",
        "--mamba-states",
        "16",
    ]);
    let h = hybrid(&v);
    assert!(int(h, "states_evicted_with_kv") > 0, "{h}");
    assert_eq!(
        int(h, "states_cached"),
        int(h, "final_states_held") + int(h, "states_evicted_for_states") + int(h, "states_evicted_with_kv")
    );
    assert!(int(&v, "evicted_tokens") > 0 && int(&v, "final_cached_tokens") <= 1024, "{v}");
}

fn bundled(n: usize) -> Trace {
    let mut t = Trace::bundled().unwrap();
    t.truncate(n);
    t
}

fn hybrid_config(capacity: usize) -> ReplayConfig {
    ReplayConfig { mode: Mode::Sequential, model: Model::Hybrid, capacity_tokens: capacity, ..ReplayConfig::default() }
}

/// Everything but the timings.
fn figures(r: &Report) -> String {
    let mut v: Value = serde_json::from_str(&r.to_json()).unwrap();
    let o = v.as_object_mut().unwrap();
    for k in ["wall_seconds", "requests_per_second", "tokens_per_second", "latency_ns"] {
        o.remove(k);
    }
    v.to_string()
}

/// The first 300 requests of the bundled trace at the default capacity and at one
/// small enough to evict KV and states: the accounting holds (the replay checks it),
/// the figures relate as they must, and two runs agree exactly.
#[test]
fn bundled_trace_start_accounts_for_every_state() {
    let trace = bundled(300);
    for (capacity, states) in [(1 << 20, None), (1 << 17, Some(8))] {
        let config = ReplayConfig {
            hybrid: HybridConfig { states, ..HybridConfig::default() },
            timeline: true,
            ..hybrid_config(capacity)
        };
        let r = replay(&trace, &config, &|_| {}).unwrap();
        let h = r.hybrid.as_ref().unwrap();
        let served = r.requests - r.rejected;
        assert_eq!((r.requests, r.rejected), (300, 0));
        assert!(r.invariants_ok);
        assert_eq!(h.mamba_states, states.unwrap_or(capacity as u64 * 24_576 * 9 / 10 / 77_266_944));
        // Resumable <= KV matched <= prompt; both page-aligned, states chunk-aligned.
        assert!(h.state_hit_tokens <= h.kv_hit_tokens && h.kv_hit_tokens <= r.prompt_tokens, "{h:?}");
        assert_eq!(h.state_hit_tokens, r.hit_tokens);
        assert_eq!((h.kv_hit_tokens % 16, h.state_hit_tokens % 64), (0, 0));
        assert!(h.state_hit_requests <= served && h.branched_requests <= served);
        assert!(h.state_hit_tokens > 0, "the trace's conversations resume: {h:?}");
        assert!(h.states_cached + h.states_duplicate <= served);
        assert_eq!(
            h.states_cached,
            h.final_states_held + h.states_evicted_for_states + h.states_evicted_with_kv,
            "{h:?}"
        );
        assert!(h.final_states_held <= h.mamba_states && h.peak_states_in_use <= h.mamba_states);
        assert!(h.peak_states_in_use >= h.final_states_held.max(2));
        assert_eq!((h.timeline.len(), r.timeline.len()), (300, 300));
        let last = h.timeline.last().unwrap();
        assert_eq!((last.kv_hit_tokens, last.states_cached), (h.kv_hit_tokens, h.final_states_held));
        if states.is_some() {
            assert!(h.states_evicted_for_states > 0 && r.evicted_tokens > 0, "{h:?}");
        }
        let again = replay(&trace, &config, &|_| {}).unwrap();
        assert_eq!(figures(&r), figures(&again), "two runs differ");
    }
}

/// The attention replay is unchanged by the hybrid plumbing: no hybrid object, and
/// `--model attention` is the default.
#[test]
fn attention_is_the_default_and_has_no_hybrid_figures() {
    let path = write_trace("attn.jsonl", SCENARIO);
    let p = path.to_str().unwrap();
    let a = replay_json(&["--trace", p, "--mode", "sequential"]);
    let b = replay_json(&["--trace", p, "--mode", "sequential", "--model", "attention"]);
    assert!(a.get("hybrid").is_none(), "{a}");
    for k in ["hit_tokens", "final_cached_tokens", "evicted_tokens"] {
        assert_eq!(int(&a, k), int(&b, k));
    }
    // Without --mode: overlap for attention, sequential for hybrid.
    assert_eq!(replay_json(&["--trace", p])["mode"], "overlap");
    assert_eq!(replay_json(&["--trace", p, "--model", "hybrid"])["mode"], "sequential");
}

#[test]
fn table_and_plot_show_the_states() {
    let path = write_trace("table.jsonl", SCENARIO);
    let p = path.to_str().unwrap();
    let out = kvpool(&["replay", "--trace", p, "--model", "hybrid"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for label in [
        "hybrid model: 300 Mamba state slots of 73.7 MiB",
        "KV hit tokens          1,536",
        "state hit tokens       1,024",
        "branched requests      1",
        "states evicted",
        "peak states in use     5 of 300",
        "final tombstones       0",
        "every KV slot and state slot is free or cached",
    ] {
        assert!(text.contains(label), "missing {label:?} in\n{text}");
    }
    let svg = path.with_extension("svg");
    let _ = std::fs::remove_file(&svg);
    let out = kvpool(&["replay", "--trace", p, "--model", "hybrid", "--plot", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(&svg).unwrap();
    for label in ["Mamba state slots", "states in use", "states cached", "KV hit rate", "state hit rate"] {
        assert!(svg.contains(label), "missing {label:?} in the plot");
    }
}

/// Stderr of a run that must fail cleanly: exit status 1, no panic, no stdout.
fn clean_failure(out: Output, what: &str) -> String {
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation"), "{what}: {stderr}");
    assert!(out.stdout.is_empty(), "{what} printed {}", String::from_utf8_lossy(&out.stdout));
    stderr
}

/// Stderr of a run that must fail (exit status 1, or clap's 2 for what it parses).
fn fails(args: &[&str]) -> String {
    let out = kvpool(args);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {:?} {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?} printed {}", String::from_utf8_lossy(&out.stdout));
    stderr
}

/// A hybrid replay too large for the machine is a configuration error, as an attention
/// one is (run under a 2 GiB address-space limit).
#[test]
fn hybrid_too_large_for_memory_is_a_config_error() {
    let path = write_trace("huge-hybrid.jsonl", SCENARIO);
    let limited = |args: &[&str]| {
        Command::new("sh")
            .args(["-c", "ulimit -v \"$1\" && shift && exec \"$@\"", "sh", &(2u64 << 20).to_string()])
            .arg(env!("CARGO_BIN_EXE_kvpool"))
            .args(args)
            .output()
            .expect("sh runs")
    };
    let p = path.to_str().unwrap();
    let e = clean_failure(
        limited(&["replay", "--trace", p, "--model", "hybrid", "--capacity-tokens", "4294967280"]),
        "4 G tokens",
    );
    assert!(e.contains("bytes") && e.contains("more than this machine can allocate"), "{e}");
    // The same limit is ample for the largest state pool over an ordinary KV pool.
    let out = limited(&["replay", "--trace", p, "--model", "hybrid", "--mamba-states", "16777216"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn hybrid_flags_and_their_errors() {
    let path = write_trace("flags.jsonl", SCENARIO);
    let p = path.to_str().unwrap();
    let hy = |extra: &[&str]| {
        let mut args = vec!["replay", "--trace", p, "--model", "hybrid"];
        args.extend_from_slice(extra);
        fails(&args)
    };
    // Flags take effect: a 128-token chunk moves r0's checkpoint to 512, and the
    // derived pool follows the state size and ratio.
    let v = replay_json(&["--trace", p, "--model", "hybrid", "--mamba-chunk", "128", "--mamba-track-interval", "512"]);
    assert_eq!((int(hybrid(&v), "chunk_size"), int(hybrid(&v), "track_interval")), (128, 512));
    let v = replay_json(&[
        "--trace",
        p,
        "--model",
        "hybrid",
        "--mamba-state-bytes",
        "24576",
        "--kv-bytes-per-token",
        "24576",
    ]);
    assert_eq!(int(hybrid(&v), "mamba_states"), (1 << 20) * 9 / 10);
    let v = replay_json(&["--trace", p, "--model", "hybrid", "--mamba-memory-ratio", "0.45"]);
    assert_eq!(int(hybrid(&v), "mamba_states"), 150);

    let e = hy(&["--mode", "overlap"]);
    assert!(e.contains("--model hybrid runs in sequential mode only") && e.contains("--mode sequential"), "{e}");
    let e = hy(&["--cache", "reference"]);
    assert!(e.contains("--model hybrid needs --cache kvpool"), "{e}");
    let e = hy(&["--mamba-states", "2"]);
    assert!(e.contains("--mamba-states 2 is too few: a request needs 3 state slots"), "{e}");
    let e = hy(&["--mamba-states", "99999999999"]);
    assert!(e.contains("--mamba-states 99999999999 is too many"), "{e}");
    // A pool derived from the sizes names them, not --mamba-states (not given).
    let e = hy(&["--kv-bytes-per-token", "18446744073709551615"]);
    assert!(!e.contains("--mamba-states 225303744411719714"), "{e}");
    assert!(e.contains("--kv-bytes-per-token 18446744073709551615") && e.contains("too many"), "{e}");
    let e = hy(&["--mamba-memory-ratio", "0.001"]);
    assert!(e.contains("holds 0 state slots") && e.contains("set --mamba-states 3 or more"), "{e}");
    for bad in ["0", "-1", "nan", "inf"] {
        let e = hy(&[&format!("--mamba-memory-ratio={bad}")]);
        assert!(e.contains("--mamba-memory-ratio"), "{bad}: {e}");
    }
    let e = hy(&["--mamba-state-bytes", "0"]);
    assert!(e.contains("--mamba-state-bytes must be at least 1"), "{e}");
    let e = hy(&["--kv-bytes-per-token", "0"]);
    assert!(e.contains("--kv-bytes-per-token must be at least 1"), "{e}");
    let e = hy(&["--mamba-chunk", "0"]);
    assert!(e.contains("--mamba-chunk must be at least 1"), "{e}");
    let e = hy(&["--mamba-chunk", "40"]);
    assert!(e.contains("--mamba-chunk 40 must be a whole number of pages (a multiple of --page-size 16)"), "{e}");
    let e = hy(&["--mamba-track-interval", "100"]);
    assert!(e.contains("--mamba-track-interval 100 must be a positive whole number of chunks"), "{e}");
    let e = hy(&["--mamba-track-interval", "0"]);
    assert!(e.contains("--mamba-track-interval 0"), "{e}");
    let e = hy(&["--mamba-states", "8", "--mamba-state-bytes", "100"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = fails(&["replay", "--trace", p, "--model", "mamba"]);
    assert!(e.contains("unknown model \"mamba\"; expected attention, hybrid or swa"), "{e}");
    // Hybrid options without --model hybrid would be ignored: refused.
    for flag in [
        "--mamba-states",
        "--mamba-state-bytes",
        "--kv-bytes-per-token",
        "--mamba-memory-ratio",
        "--mamba-chunk",
        "--mamba-track-interval",
    ] {
        let e = fails(&["replay", "--trace", p, flag, "64"]);
        assert!(e.contains(&format!("{flag} is an option of --model hybrid")), "{flag}: {e}");
    }
}
