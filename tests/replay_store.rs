//! `kvpool replay --engines N --store redis://...` (issue 12): the multi-engine replay
//! with a shared store tier, on a real `redis-server`; figures computed by hand on small
//! traces, the store's faults (down at the start, killed and restarted mid-replay), and
//! the options' errors.
//!
//! `cargo test --features redis --test replay_store`. Needs `redis-server` on PATH
//! (fails without it unless `KVPOOL_SKIP_REDIS=1`).

mod replay_common;
mod store_common;

use std::sync::Mutex;
use std::time::Duration;

use kvpool::replay::{
    replay, EnginesConfig, HostTierConfig, Mode, ReplayConfig, Router, StoreReport, StoreTierConfig, Trace,
};
use kvpool::store::BackoffConfig;
use replay_common::{int, kvpool, replay_json, write_trace};
use serde_json::Value;
use store_common::RedisServer;

/// A conversation: turn 0 is blocks [1, 2] (1,024 tokens), turn 1 adds block 3, turn 2
/// block 4. One output token each, so each request's KV is its prompt.
const TURNS: &[(u64, u64, &[u64])] = &[(1024, 1, &[1, 2]), (1536, 1, &[1, 2, 3]), (2048, 1, &[1, 2, 3, 4])];

/// Device 4,096 and host 8,192 tokens an engine: nothing is evicted on these traces.
fn run(name: &str, extra: &[&str]) -> Value {
    let path = write_trace(name, TURNS);
    let mut args =
        vec!["--trace", path.to_str().unwrap(), "--capacity-tokens", "4096", "--host-capacity-tokens", "8192"];
    args.extend_from_slice(extra);
    replay_json(&args)
}

fn store(v: &Value) -> &Value {
    assert!(v["store"].is_object(), "no store object in {v}");
    &v["store"]
}

/// (device, host, store) hit tokens.
fn tiers(t: &Value) -> (u64, u64, u64) {
    (int(t, "device_hit_tokens"), int(t, "host_hit_tokens"), int(t, "store_hit_tokens"))
}

/// Two engines, round-robin: turns 0 and 2 on engine 0, turn 1 on engine 1.
/// * Turn 0 (engine 0): no hit; its 64 pages are backed up to host at their first write
///   hit (write_through) and put: 64 pages.
/// * Turn 1 (engine 1): its engine holds nothing; the store has the first 64 of its 96
///   pages: prefetched, loaded back, 1,024 store hits. Its block 3 is put: 32 pages.
/// * Turn 2 (engine 0): blocks [1, 2] on the device (1,024 device hits); block 3 from the
///   store (512 store hits); block 4 put: 32 pages.
#[test]
fn a_turn_on_another_engine_hits_the_store() {
    let Some(redis) = RedisServer::start() else { return };
    let v = run("store_rr.jsonl", &["--engines", "2", "--store", &redis.url()]);
    let s = store(&v);
    assert_eq!(v["invariants_ok"], Value::Bool(true));
    assert_eq!((int(s, "engines"), s["router"].as_str()), (2, Some("round_robin")));
    let total = &s["total"];
    assert_eq!(tiers(total), (1024, 0, 1536));
    assert_eq!(int(&v, "hit_tokens"), 2560);
    assert_eq!(int(total, "prompt_tokens"), 4608);
    let e = &s["per_engine"];
    assert_eq!((int(&e[0], "requests"), int(&e[1], "requests")), (2, 1));
    assert_eq!(tiers(&e[0]), (1024, 0, 512));
    assert_eq!(tiers(&e[1]), (0, 0, 1024), "turn 1's hits are turn 0's backed-up pages");
    assert_eq!((int(total, "store_pages_put"), int(total, "store_pages_got")), (128, 96));
    assert_eq!((int(total, "store_pages_missed"), int(total, "store_pages_corrupt")), (0, 0));
    assert_eq!(int(total, "prefetched_tokens"), 1536);
    assert_eq!(int(total, "store_bytes_written"), 128 * 16 * 8, "8 payload bytes a token by default");
    assert_eq!(int(total, "store_errors"), 0);
    let ops = &s["store_ops"];
    // Every turn asks for its continuation (turn 0 finds none) and checks before its put.
    assert_eq!((int(&ops["exists"], "calls"), int(&ops["get"], "calls"), int(&ops["put"], "calls")), (6, 2, 3));
    assert!(int(&ops["put"]["latency_ns"], "p50") > 0);
    // The same run again: a namespace of its own, so the same figures.
    let again = run("store_rr2.jsonl", &["--engines", "2", "--store", &redis.url()]);
    assert_eq!(tiers(&store(&again)["total"]), (1024, 0, 1536));
    assert_ne!(s["namespace"], store(&again)["namespace"]);
}

/// Without the store each engine is alone: only turn 2's device hits.
#[test]
fn without_the_store_each_engine_is_alone() {
    let v = run("store_alone.jsonl", &["--engines", "2"]);
    let s = store(&v);
    assert_eq!(tiers(&s["total"]), (1024, 0, 0));
    assert!(s.get("store_ops").is_none() && s.get("store").is_none(), "{s}");
    assert_eq!(int(&v, "hit_tokens"), 1024);
}

/// The prefix router sends the three turns (same first 1,024 tokens) to one engine: all
/// device hits (1,024 + 1,536), nothing read from the store.
#[test]
fn the_prefix_router_keeps_a_conversation_on_one_engine() {
    let Some(redis) = RedisServer::start() else { return };
    let v = run("store_prefix.jsonl", &["--engines", "2", "--router", "prefix", "--store", &redis.url()]);
    let s = store(&v);
    let e = &s["per_engine"];
    let counts = (int(&e[0], "requests"), int(&e[1], "requests"));
    assert!(counts == (3, 0) || counts == (0, 3), "{counts:?}");
    assert_eq!(tiers(&s["total"]), (2560, 0, 0));
    assert_eq!((int(&s["total"], "store_pages_put"), int(&s["total"], "store_pages_got")), (128, 0));
}

/// A store that is down from the start: every operation fails (and is counted), the
/// replay completes with device and host only, and the invariants hold.
#[test]
fn a_store_down_from_the_start_costs_only_its_hits() {
    let Some(mut redis) = RedisServer::start() else { return };
    let url = redis.url();
    redis.kill();
    let v = run("store_down.jsonl", &["--engines", "2", "--store", &url, "--store-timeout-ms", "200"]);
    let s = store(&v);
    assert_eq!(v["invariants_ok"], Value::Bool(true));
    assert_eq!(tiers(&s["total"]), (1024, 0, 0));
    assert_eq!((int(&s["total"], "store_pages_put"), int(&s["total"], "store_pages_got")), (0, 0));
    let errors = &s["store_ops"]["errors"];
    assert!(int(errors, "connection") >= 1, "{errors}");
    assert_eq!(int(&s["total"], "store_errors"), int(errors, "connection") + int(errors, "unavailable"));
}

/// Killed after turn 1, restarted (empty) after turn 2: turn 2 loses its store hit
/// (device only), and a new conversation after the restart hits the store again.
#[test]
fn a_store_killed_mid_replay_and_restarted_recovers() {
    let Some(redis) = RedisServer::start() else { return };
    // Turns 0-2 as above, then [5, 6] on engine 1 and [5, 6, 7] on engine 0.
    let trace: Vec<(u64, u64, &[u64])> =
        TURNS.iter().copied().chain([(1024, 1, &[5u64, 6][..]), (1536, 1, &[5, 6, 7][..])]).collect();
    let text: String = trace
        .iter()
        .map(|(l, o, h)| format!("{{\"input_length\": {l}, \"output_length\": {o}, \"hash_ids\": {h:?}}}\n"))
        .collect();
    let trace = Trace::from_jsonl_str(&text, "faults").unwrap();
    let mut st = StoreTierConfig::new(redis.url());
    st.timeout = Duration::from_millis(200);
    st.backoff = BackoffConfig { initial: Duration::from_millis(10), max: Duration::from_millis(100) };
    let config = ReplayConfig {
        capacity_tokens: 4096,
        mode: Mode::Sequential,
        host: Some(HostTierConfig::new(8192)),
        engines: EnginesConfig { engines: 2, router: Router::RoundRobin, store: Some(st), ..EnginesConfig::default() },
        ..ReplayConfig::default()
    };
    let redis = Mutex::new(redis);
    let report = replay(&trace, &config, &|done| match done {
        2 => redis.lock().unwrap().kill(),
        3 => {
            redis.lock().unwrap().restart();
            std::thread::sleep(Duration::from_millis(300)); // past the client's backoff
        }
        _ => {}
    })
    .unwrap();
    assert!(report.invariants_ok);
    let s: StoreReport = report.store.unwrap();
    let (t, e) = (&s.total, &s.per_engine);
    // Turn 1: 1,024 store hits; turn 2: 1,024 device hits (its block 3 not fetched);
    // turn 4: 1,024 store hits, from turn 3's pages put after the restart.
    assert_eq!((t.device_hit_tokens, t.host_hit_tokens, t.store_hit_tokens), (1024, 0, 2048));
    assert_eq!((e[0].device_hit_tokens, e[0].store_hit_tokens), (1024, 1024));
    assert_eq!((e[1].device_hit_tokens, e[1].store_hit_tokens), (0, 1024));
    let ops = s.store_ops.unwrap();
    assert!(ops.errors.total() >= 1 && t.store_errors == ops.errors.total(), "{:?}", ops.errors);
    assert!(ops.reconnects >= 1, "{ops:?}");
    // Put: 64 + 32 before the kill, none while down, 64 + 32 after.
    assert_eq!(t.store_pages_put, 192);
}

fn fails(args: &[&str]) -> String {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    let out = kvpool(&all);
    assert!(!out.status.success(), "kvpool {all:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn bad_options_are_typed_errors() {
    let path = write_trace("store_bad.jsonl", TURNS);
    let t = path.to_str().unwrap();
    let cap = ["--trace", t, "--capacity-tokens", "4096"];
    let with = |extra: &[&str]| fails(&[&cap[..], extra].concat());
    assert!(with(&["--engines", "0"]).contains("--engines must be between 1 and 64"));
    assert!(with(&["--store", "http://127.0.0.1:1"]).contains("--store"));
    assert!(with(&["--store", "redis://127.0.0.1:1", "--mode", "overlap"]).contains("not --mode overlap"));
    assert!(
        with(&["--store", "redis://127.0.0.1:1", "--store-bytes-per-token", "0"]).contains("--store-bytes-per-token")
    );
    assert!(with(&["--engines", "2", "--store-timeout-ms", "5"]).contains("is an option of --store"));
    assert!(with(&["--engines", "2", "--router", "nearest"]).contains("unknown router"));
}
