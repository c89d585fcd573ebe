//! `kvpool replay --model swa`: the trace through kvpool's `SwaRadixCache`, figures
//! computed by hand on a two-request trace, and the SWA options' errors.

mod replay_common;

use replay_common::{int, kvpool, replay_json, write_trace};
use serde_json::Value;

/// Request 0: blocks [1, 2] (1,024 tokens), 300 outputs; request 1: blocks [1, 2, 3].
const TRACE: &[(u64, u64, &[u64])] = &[(1024, 300, &[1, 2]), (1536, 1, &[1, 2, 3])];

fn swa(v: &Value) -> &Value {
    assert!(v["swa"].is_object(), "no swa object in {v}");
    &v["swa"]
}

#[test]
fn released_window_kv_leaves_tombstones_the_next_turn_cannot_end_on() {
    let path = write_trace("swa.jsonl", TRACE);
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--model", "swa"]);
    let s = swa(&v);
    assert_eq!(v["mode"], "sequential");
    assert_eq!(v["invariants_ok"], Value::Bool(true));
    // Request 0 (1,323 KV tokens) released the window KV of its first 1,168 tokens
    // (up to seq - 128 - 16, whole pages) and cached 1,312: request 1 finds the KV of
    // its first 1,024 tokens, all tombstoned, so nothing is reusable.
    assert_eq!((int(s, "full_hit_tokens"), int(&v, "hit_tokens")), (1024, 0));
    assert_eq!(int(s, "window_hit_tokens"), 0);
    assert_eq!((int(s, "window"), int(s, "window_pool_tokens")), (128, 838_848));
    // Cached: 1,312 + 512; live: the last 144 tokens of each request.
    assert_eq!(int(s, "final_cached_tokens"), 1824);
    assert_eq!(int(s, "final_tombstone_tokens"), 1824 - 288);
    assert_eq!(int(s, "final_window_used_tokens"), 288);
    assert_eq!(int(s, "window_released_tokens"), 1168 + 1392);
}

#[test]
fn kept_window_kv_is_reused() {
    let path = write_trace("swa_keep.jsonl", TRACE);
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--swa-keep-window"]);
    let s = swa(&v);
    assert_eq!((int(s, "full_hit_tokens"), int(&v, "hit_tokens")), (1024, 1024));
    assert_eq!((int(s, "final_tombstone_tokens"), int(s, "window_released_tokens")), (0, 0));
    assert_eq!(int(s, "final_window_used_tokens"), int(s, "final_cached_tokens"));
}

#[test]
fn swa_flags_and_their_errors() {
    let path = write_trace("swa_flags.jsonl", TRACE);
    let p = path.to_str().unwrap();
    let fails = |args: &[&str]| {
        let out = kvpool(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = fails(&["replay", "--trace", p, "--swa-window", "0"]);
    assert!(e.contains("--swa-window must be at least 1"), "{e}");
    let e = fails(&["replay", "--trace", p, "--swa-ratio", "1.5"]);
    assert!(e.contains("--swa-ratio must be between 0.001 and 1"), "{e}");
    let e = fails(&["replay", "--trace", p, "--model", "hybrid", "--swa-window", "64"]);
    assert!(e.contains("--swa-window is an option of --model swa"), "{e}");
    let e = fails(&["replay", "--trace", p, "--model", "swa", "--mode", "overlap"]);
    assert!(e.contains("--model swa runs in sequential mode only"), "{e}");
    let e = fails(&["replay", "--trace", p, "--model", "swa", "--cache", "reference"]);
    assert!(e.contains("--model swa needs --cache kvpool"), "{e}");
    // The table names the model.
    let out = kvpool(&["replay", "--trace", p, "--swa-window", "64", "--swa-ratio", "0.5"]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("sliding-window model: window 64 tokens"), "{table}");
    assert!(table.contains("50% of the window layers' KV memory saved"), "{table}");
}
