//! `kvpool replay --host-capacity-tokens`: the two-tier replay's figures computed by
//! hand on a three-request trace, per write policy, and the host options' errors.

mod replay_common;

use replay_common::{int, kvpool, replay_json, write_trace};
use serde_json::Value;

/// Request 0: blocks [1, 2] (1,024 tokens); request 1: blocks [3, 4]; request 2: blocks
/// [1, 2, 5]. One output token each, so each request's KV is its prompt.
const TRACE: &[(u64, u64, &[u64])] = &[(1024, 1, &[1, 2]), (1024, 1, &[3, 4]), (1536, 1, &[1, 2, 5])];

fn host(v: &Value) -> &Value {
    assert!(v["host"].is_object(), "no host object in {v}");
    &v["host"]
}

fn run_on(policy: &str, cache: &str) -> Value {
    let path = write_trace(&format!("hicache_{policy}_{cache}.jsonl"), TRACE);
    replay_json(&[
        "--trace",
        path.to_str().unwrap(),
        "--capacity-tokens",
        "1536",
        "--host-capacity-tokens",
        "4096",
        "--write-policy",
        policy,
        "--cache",
        cache,
    ])
}

/// The replay on kvpool's `HiRadixCache` (the default), checked against the same
/// replay on `ReferenceHiCache`: every figure but the tree's name agrees.
fn run(policy: &str) -> Value {
    let ours = run_on(policy, "kvpool");
    let theirs = run_on(policy, "reference");
    assert_eq!((ours["cache"].as_str(), theirs["cache"].as_str()), (Some("kvpool"), Some("reference")));
    assert_eq!(
        (ours["host"]["tree"].as_str(), theirs["host"]["tree"].as_str()),
        (Some("HiRadixCache"), Some("ReferenceHiCache"))
    );
    for key in ["hit_tokens", "evicted_tokens", "final_cached_tokens", "invariants_ok"] {
        assert_eq!(ours[key], theirs[key], "{key}");
    }
    let strip = |v: &Value| {
        let mut h = v["host"].clone();
        h.as_object_mut().unwrap().remove("tree");
        h
    };
    assert_eq!(strip(&ours), strip(&theirs));
    ours
}

/// Device pool 1,536 tokens. Request 1 needs 1,024 with 512 free: request 0's leaf is
/// evicted from the device (kept on host). Request 2 matches [1, 2] on host only: its
/// load-back needs 1,024 with 512 free, so request 1's leaf goes to host too; then its
/// own 512 new tokens fill the device.
#[test]
fn write_through_keeps_evicted_prefixes_on_host_and_loads_them_back() {
    let v = run("write_through");
    let h = host(&v);
    assert_eq!(v["mode"], "sequential");
    assert_eq!(v["invariants_ok"], Value::Bool(true));
    assert_eq!(int(&v, "hit_tokens"), 1024);
    assert_eq!((int(h, "device_hit_tokens"), int(h, "host_hit_tokens")), (0, 1024));
    // Every new node is backed up at its first write hit: 1,024 + 1,024 + 512.
    assert_eq!((int(h, "written_tokens"), int(h, "loaded_tokens")), (2560, 1024));
    assert_eq!(int(h, "bytes_written"), 2560 * 131_072);
    assert_eq!((int(h, "device_evicted_tokens"), int(h, "host_evicted_tokens")), (2048, 0));
    assert_eq!(int(h, "final_host_used_tokens"), 2560);
    assert_eq!(int(&v, "final_cached_tokens"), 1536);
    // The driver saw request 1's eviction; the load-back's own is counted by the cache.
    assert_eq!(int(&v, "evicted_tokens"), 1024);
}

#[test]
fn write_back_copies_only_what_the_device_evicts() {
    let v = run("write_back");
    let h = host(&v);
    assert_eq!((int(h, "device_hit_tokens"), int(h, "host_hit_tokens")), (0, 1024));
    assert_eq!((int(h, "written_tokens"), int(h, "final_host_used_tokens")), (2048, 2048));
}

/// Selective backs a node up at its second write hit: nothing here is hit twice before
/// it is evicted, so nothing reaches the host and request 2 recomputes everything.
#[test]
fn write_through_selective_backs_up_only_what_is_hit_twice() {
    let v = run("write_through_selective");
    let h = host(&v);
    assert_eq!(int(&v, "hit_tokens"), 0);
    assert_eq!((int(h, "written_tokens"), int(h, "host_hit_tokens")), (0, 0));
}

#[test]
fn host_flags_and_their_errors() {
    let path = write_trace("hicache_flags.jsonl", TRACE);
    let p = path.to_str().unwrap();
    let fails = |args: &[&str]| {
        let out = kvpool(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = fails(&["replay", "--trace", p, "--host-capacity-tokens", "8"]);
    assert!(e.contains("--host-capacity-tokens 8 holds no page of 16 tokens"), "{e}");
    // A ratio too small for a page names --host-ratio, which the command line has.
    let e = fails(&["replay", "--trace", p, "--capacity-tokens", "1536", "--host-ratio", "0.001"]);
    assert!(e.contains("--host-ratio 0.001 makes a host tier of 1 tokens") && e.contains("one page of 16"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio=-1"]);
    assert!(e.contains("--host-ratio must be a positive number"), "{e}");
    let e = fails(&["replay", "--trace", p, "--write-policy", "sometimes"]);
    assert!(e.contains("expected write_through, write_through_selective or write_back"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--link-gbps", "0"]);
    assert!(e.contains("--link-gbps must be a positive number"), "{e}");
    // Positive but too large: said so, not that it must be positive.
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--link-gbps", "1e300"]);
    assert!(e.contains("--link-gbps 1e300 is too large") && !e.contains("positive"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio", "1e300"]);
    assert!(e.contains("--host-ratio 1e300 is too large") && !e.contains("positive"), "{e}");
    // The error names the option the command line has.
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--transfer-bytes-per-token", "0"]);
    assert!(e.contains("--transfer-bytes-per-token must be at least 1"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--cache", "vectrie"]);
    assert!(e.contains("the host tier runs on the two-tier trees") && e.contains("not --cache vectrie"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--mode", "overlap"]);
    assert!(e.contains("not --mode overlap"), "{e}");
    let e = fails(&["replay", "--trace", p, "--host-ratio", "2", "--model", "swa"]);
    assert!(e.contains("not --model swa"), "{e}");
    // --host-ratio sizes the host pool from --capacity-tokens; the table names the tier.
    let out = kvpool(&["replay", "--trace", p, "--capacity-tokens", "1536", "--host-ratio", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("host tier: 3,072 tokens, write_through"), "{table}");
    assert!(table.contains("host hit tokens"), "{table}");
}

/// `--plot` draws the host panel: the host pool's occupancy, and the loaded-back rate
/// (1,024 of 3,584 prompt tokens).
#[test]
fn the_plot_shows_both_tiers() {
    let path = write_trace("hicache_plot.jsonl", TRACE);
    let svg = path.with_extension("svg");
    let out = kvpool(&[
        "replay",
        "--trace",
        path.to_str().unwrap(),
        "--capacity-tokens",
        "1536",
        "--host-capacity-tokens",
        "4096",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in ["tokens held in host memory", "host pool (write_through)", "loaded back from host (final 28.57%)"] {
        assert!(text.contains(label), "{label} missing from the plot");
    }
}

/// The bytes moved are `tokens * --transfer-bytes-per-token`: a product past 64 bits is
/// reported as `u64::MAX` bytes (not wrapped to a small number, nor a panic), and the
/// transfer time is still the product over the link. One engine and two (whose
/// figures are summed).
#[test]
fn transfer_bytes_past_64_bits_saturate() {
    let path = write_trace("hicache_huge_bytes.jsonl", TRACE);
    let p = path.to_str().unwrap();
    let max = u64::MAX.to_string();
    for engines in [None, Some("2")] {
        let mut args = vec!["--trace", p, "--capacity-tokens", "1536", "--host-capacity-tokens", "4096"];
        args.extend_from_slice(&["--transfer-bytes-per-token", &max, "--link-gbps", "1"]);
        if let Some(n) = engines {
            args.extend_from_slice(&["--engines", n]);
        }
        let v = replay_json(&args);
        let h = host(&v);
        let (written, loaded) = (int(h, "written_tokens"), int(h, "loaded_tokens"));
        assert!(written > 1, "{engines:?}: {h}");
        assert_eq!(int(h, "bytes_written"), u64::MAX, "{engines:?}: {h}");
        let seconds = (written + loaded) as f64 * u64::MAX as f64 / 1e9;
        let got = h["transfer_seconds"].as_f64().unwrap();
        assert!((got - seconds).abs() <= seconds * 1e-9, "{engines:?}: {got} s, not {seconds}");
    }
}
