//! `kvpool replay` end to end: small traces whose every reported number is worked out
//! by hand (sequential mode), the output formats, and bad input.
#![cfg(all(not(loom), feature = "replay"))]

mod replay_common;

use std::process::{Command, Output, Stdio};

use replay_common::{int, kvpool, random_trace, replay_json, write_text, write_trace, Rng};

/// Scenario A, page size 4, capacity 1024 (no eviction). Per request:
///
/// * r0 `L=10 O=3 [1]`: no hit; extend 10 -> 3 pages; decodes at seq 11, 12 stay in
///   page 3; KV 12 = 3 whole pages cached. Used 12.
/// * r1 `L=9 O=1 [1]`: the page-aligned key is 8 tokens, all cached (splits r0's node):
///   hit 8; extend 1 token -> 1 new page (used 16, peak 16); finish inserts 8 (all
///   present), frees the 1-token tail page. Used 12.
/// * r2 `L=5 O=2 [2]`: no hit; extend 5 -> 2 pages (used 20); decode seq 6 stays in page;
///   KV 6: 4 cached, tail page freed. Used/cached 16.
/// * r3 `L=7 O=3 [3]`: no hit; extend 7 -> 2 pages (24); decode seq 8 in page, seq 9
///   starts a page (28, the peak); KV 9: 8 cached, tail page freed. Cached 24.
const SCENARIO_A: &[(u64, u64, &[u64])] = &[(10, 3, &[1]), (9, 1, &[1]), (5, 2, &[2]), (7, 3, &[3])];

/// Scenario B, page size 4, capacity 16 tokens (4 pages): eviction and a rejection.
///
/// * r0 `L=8 O=1 [1]`: caches A (8). Used 8.
/// * r1 `L=4 O=1 [2]`: caches B (4). Used 12.
/// * r2 `L=8 O=1 [1]`: hit 8 (the whole prompt), nothing to allocate; A is touched.
/// * r3 `L=8 O=1 [3]`: needs 2 pages, 1 free: evict 4. LRU: B (older than A) goes (4).
///   FIFO: A (created first) goes (8). Caches C (8). Peak 16.
/// * r4 `L=4 O=1 [2]`: LRU: B is gone, miss; needs 1 page, none free: evict A (8).
///   FIFO: B is cached: hit 4.
/// * r5 `L=8 O=1 [1]`: A is gone in both; needs 2 pages. LRU: 1 free, evict C (8).
///   FIFO: 1 free, evict B (4).
/// * r6 `L=20 O=1 [4,..]`: 5 pages > 4: it can never fit, and is rejected up front,
///   nothing evicted. LRU holds B and A (12), FIFO C and A (16).
/// * r7 `L=6 O=3 [5]`: needs 2 pages. LRU: 1 free, evict B (4). FIFO: none free, evict
///   C (8). Extend 2 pages, decodes at seq 7, 8 stay in page; caches 8: A and r7 (16).
///
/// LRU: hits 8, evicted 4+8+8+4 = 24. FIFO: hits 8+4, evicted 8+4+8 = 20.
const SCENARIO_B: &[(u64, u64, &[u64])] =
    &[(8, 1, &[1]), (4, 1, &[2]), (8, 1, &[1]), (8, 1, &[3]), (4, 1, &[2]), (8, 1, &[1]), (20, 1, &[4]), (6, 3, &[5])];

fn check(v: &serde_json::Value, expected: &[(&str, u64)]) {
    for &(key, want) in expected {
        assert_eq!(int(v, key), want, "{key} in {v}");
    }
    let prompt = int(v, "prompt_tokens");
    let hit = int(v, "hit_tokens");
    assert_eq!(int(v, "computed_tokens"), prompt - hit);
    let rate = v["hit_rate"].as_f64().unwrap();
    assert!((rate - hit as f64 / prompt as f64).abs() < 1e-12, "hit_rate {rate}");
    assert_eq!(v["invariants_ok"], serde_json::Value::Bool(true));
    assert_eq!(v["mode"], "sequential");
}

#[test]
fn scenario_a_every_number() {
    let path = write_trace("a.jsonl", SCENARIO_A);
    for cache in ["kvpool", "reference"] {
        let v = replay_json(&[
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            "sequential",
            "--page-size",
            "4",
            "--capacity-tokens",
            "1024",
            "--cache",
            cache,
        ]);
        assert_eq!(v["cache"], cache);
        check(
            &v,
            &[
                ("requests", 4),
                ("rejected", 0),
                ("prompt_tokens", 31),
                ("hit_tokens", 8),
                ("computed_tokens", 23),
                ("output_tokens", 9),
                ("evicted_tokens", 0),
                ("peak_used_tokens", 28),
                ("final_cached_tokens", 24),
                ("page_size", 4),
                ("capacity_tokens", 1024),
            ],
        );
        // Every operation was timed: the latency object has all four, with p50 <= p99.
        for op in ["match", "alloc_extend", "alloc_decode", "finish"] {
            let l = &v["latency_ns"][op];
            assert!(l["p50"].as_u64().unwrap() <= l["p99"].as_u64().unwrap(), "{op}: {l}");
        }
    }
}

#[test]
fn scenario_b_eviction_order_and_rejection() {
    let path = write_trace("b.jsonl", SCENARIO_B);
    let run = |cache: &str, policy: &str| {
        replay_json(&[
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            "sequential",
            "--page-size",
            "4",
            "--capacity-tokens",
            "16",
            "--policy",
            policy,
            "--cache",
            cache,
        ])
    };
    for cache in ["kvpool", "reference"] {
        let common = [
            ("requests", 8),
            ("rejected", 1),
            ("prompt_tokens", 46),
            ("output_tokens", 9),
            ("peak_used_tokens", 16),
            ("final_cached_tokens", 16),
        ];
        let lru = run(cache, "lru");
        check(&lru, &common);
        check(&lru, &[("hit_tokens", 8), ("evicted_tokens", 24)]);
        let fifo = run(cache, "fifo");
        check(&fifo, &common);
        check(&fifo, &[("hit_tokens", 12), ("evicted_tokens", 20)]);
        assert_eq!(fifo["policy"], "fifo");
    }
}

#[test]
fn page_size_one_counts_every_token() {
    // Page size 1: matches are not cut to pages. r1 shares 700 tokens with r0 (block 1
    // whole, 188 of block 2); r0's KV is 1000 + 4 = 1004 tokens, all cached.
    let path = write_trace("p1.jsonl", &[(1000, 5, &[1, 2]), (700, 2, &[1, 2]), (3, 1, &[9])]);
    let v = replay_json(&[
        "--trace",
        path.to_str().unwrap(),
        "--mode",
        "sequential",
        "--page-size",
        "1",
        "--capacity-tokens",
        "5000",
    ]);
    check(
        &v,
        &[
            ("requests", 3),
            ("prompt_tokens", 1703),
            ("hit_tokens", 700),
            ("output_tokens", 8),
            ("evicted_tokens", 0),
            // r1's KV is 701 tokens: 700 cached already, 1 new (its decode slot); r2
            // adds 3. Nothing is ever freed, so the peak is the end state.
            ("peak_used_tokens", 1004 + 1 + 3),
            ("final_cached_tokens", 1004 + 1 + 3),
        ],
    );
}

#[test]
fn table_output_names_every_figure() {
    let path = write_trace("table.jsonl", SCENARIO_A);
    let out = kvpool(&["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential", "--page-size", "4"]);
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    for label in [
        "requests",
        "rejected",
        "prompt tokens",
        "hit tokens",
        "computed tokens",
        "output tokens",
        "evicted tokens",
        "peak used tokens",
        "final cached tokens",
        "wall time",
        "requests/s",
        "tokens/s",
        "alloc_extend",
        "alloc_decode",
        "finish",
        "invariants: hold",
    ] {
        assert!(table.contains(label), "missing {label:?} in:\n{table}");
    }
    assert!(table.contains("hit tokens             8 (25.81%)"), "{table}");
    // No progress bar on a pipe.
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn json_has_the_issue_keys() {
    let path = write_trace("keys.jsonl", SCENARIO_A);
    for mode in ["sequential", "overlap"] {
        let v = replay_json(&["--trace", path.to_str().unwrap(), "--mode", mode, "--routers", "1"]);
        for key in [
            "requests",
            "rejected",
            "prompt_tokens",
            "hit_tokens",
            "hit_rate",
            "computed_tokens",
            "output_tokens",
            "evicted_tokens",
            "peak_used_tokens",
            "final_cached_tokens",
            "wall_seconds",
            "latency_ns",
        ] {
            assert!(v.get(key).is_some(), "{mode}: missing {key} in {v}");
        }
        for op in ["match", "alloc_extend", "alloc_decode", "finish"] {
            assert!(v["latency_ns"][op]["p50"].is_u64() && v["latency_ns"][op]["p99"].is_u64(), "{v}");
        }
        assert_eq!(v["mode"], mode);
    }
}

#[test]
fn limit_takes_the_first_requests() {
    let path = write_trace("limit.jsonl", SCENARIO_A);
    let v =
        replay_json(&["--trace", path.to_str().unwrap(), "--mode", "sequential", "--page-size", "4", "--limit", "2"]);
    // r0 and r1 of scenario A.
    check(&v, &[("requests", 2), ("prompt_tokens", 19), ("hit_tokens", 8), ("final_cached_tokens", 12)]);
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--mode", "sequential", "--limit", "100"]);
    assert_eq!(int(&v, "requests"), 4);
}

#[test]
fn plot_writes_an_svg() {
    let path = write_trace("plot.jsonl", SCENARIO_B);
    let svg = path.with_extension("svg");
    for mode in ["sequential", "overlap"] {
        let _ = std::fs::remove_file(&svg);
        let out = kvpool(&[
            "replay",
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            mode,
            "--page-size",
            "4",
            "--capacity-tokens",
            "16",
            "--plot",
            svg.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
        for label in ["tokens cached", "KV slots in use", "hit rate", "requests done"] {
            assert!(text.contains(label), "{mode}: missing {label:?}");
        }
    }
}

/// Run with args that must fail; return stderr.
fn fails(args: &[&str]) -> String {
    let out = kvpool(args);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    stderr
}

#[test]
fn bad_input_is_a_clear_error() {
    let good = write_trace("good.jsonl", SCENARIO_A);
    let good = good.to_str().unwrap();

    let e = fails(&["replay", "--trace", "/nonexistent/trace.jsonl"]);
    assert!(e.contains("/nonexistent/trace.jsonl") && e.contains("No such file"), "{e}");

    let bad = write_text(
        "malformed.jsonl",
        "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"input_length\": 10, \"output_length\": 1 \"hash_ids\": [1]}\n",
    );
    let e = fails(&["replay", "--trace", bad.to_str().unwrap()]);
    assert!(e.contains("line 3"), "{e}");

    let missing = write_text("missing-field.jsonl", "{\"input_length\": 10, \"hash_ids\": [1]}\n");
    let e = fails(&["replay", "--trace", missing.to_str().unwrap()]);
    assert!(e.contains("line 1") && e.contains("output_length"), "{e}");

    let long = write_text(
        "too-long.jsonl",
        "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
    );
    let e = fails(&["replay", "--trace", long.to_str().unwrap()]);
    assert!(e.contains("line 2") && e.contains("input_length 1025 exceeds 512 * len(hash_ids) = 1024"), "{e}");

    let blank = write_text(
        "blank.jsonl",
        "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\n\
         {\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n",
    );
    let e = fails(&["replay", "--trace", blank.to_str().unwrap()]);
    assert!(e.contains("line 2") && e.contains("blank line"), "{e}");

    let empty = write_text("empty.jsonl", "");
    assert!(fails(&["replay", "--trace", empty.to_str().unwrap()]).contains("no request"));

    let e = fails(&["replay", "--trace", good, "--capacity-tokens", "0"]);
    assert!(e.contains("--capacity-tokens must be at least 1"), "{e}");
    let e = fails(&["replay", "--trace", good, "--page-size", "0"]);
    assert!(e.contains("--page-size must be at least 1"), "{e}");
    let e = fails(&["replay", "--trace", good, "--page-size", "64", "--capacity-tokens", "32"]);
    assert!(e.contains("less than one page"), "{e}");
    let e = fails(&["replay", "--trace", good, "--max-running", "0"]);
    assert!(e.contains("--max-running"), "{e}");
    let e = fails(&["replay", "--trace", good, "--limit", "0"]);
    assert!(e.contains("--limit must be at least 1"), "{e}");
    let e = fails(&["replay", "--trace", good, "--policy", "random"]);
    assert!(e.contains("unknown eviction policy"), "{e}");
    let e = fails(&["replay", "--trace", good, "--mode", "parallel"]);
    assert!(e.contains("unknown mode"), "{e}");
    let e = fails(&["replay", "--trace", good, "--capacity-tokens=-5"]);
    assert!(e.contains("--capacity-tokens"), "{e}");
    let e = fails(&["replay", "--trace", good, "--capacity-tokens", "99999999999999"]);
    assert!(e.contains("too large") || e.contains("overflow") || e.contains("u32"), "{e}");
    let e = fails(&["replay", "--trace", good, "--plot", "/nonexistent/dir/plot.svg", "--mode", "sequential"]);
    assert!(e.contains("cannot write the plot"), "{e}");
}

/// Run `kvpool` with its address space limited to `kib` KiB (`ulimit -v`), so that a
/// configuration too large for the machine fails the same way on every machine (and
/// cannot take a shared machine's memory).
fn kvpool_limited(kib: u64, args: &[&str]) -> Output {
    Command::new("sh")
        .args(["-c", "ulimit -v \"$1\" && shift && exec \"$@\"", "sh", &kib.to_string(), env!("CARGO_BIN_EXE_kvpool")])
        .args(args)
        .output()
        .expect("sh runs")
}

/// 2 GiB: ample for the small replays below, far too little for the huge ones.
const LIMIT_KIB: u64 = 2 << 20;

/// Stderr of a run that must fail cleanly: exit status 1 (not an abort), no panic, no
/// stdout.
fn clean_failure(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation"), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    stderr
}

// Issue 14, finding 5: sizes too large for the machine are configuration errors.
#[test]
fn arenas_too_large_for_memory_are_a_config_error() {
    let path = write_trace("huge-capacity.jsonl", SCENARIO_A);
    let trace = path.to_str().unwrap();
    for extra in [
        &["--capacity-tokens", "4294967280", "--mode", "sequential"][..],
        &["--capacity-tokens", "4294967280", "--mode", "overlap"][..],
        &["--page-size", "2147483648", "--capacity-tokens", "2147483648", "--mode", "sequential"][..],
    ] {
        let mut args = vec!["replay", "--trace", trace];
        args.extend_from_slice(extra);
        let e = clean_failure(&kvpool_limited(LIMIT_KIB, &args));
        assert!(e.contains("bytes") && e.contains("more than this machine can allocate"), "{extra:?}: {e}");
    }
    // The same limit is ample for an ordinary replay.
    let out = kvpool_limited(LIMIT_KIB, &["replay", "--trace", trace, "--mode", "sequential"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A trace of two identical requests whose prompt is `blocks` whole 512-token blocks,
/// with 2 output tokens each.
fn twice_one_long_prompt(name: &str, blocks: usize) -> std::path::PathBuf {
    let ids: Vec<String> = (0..blocks).map(|b| b.to_string()).collect();
    let line =
        format!("{{\"input_length\": {}, \"output_length\": 2, \"hash_ids\": [{}]}}\n", blocks * 512, ids.join(","));
    write_text(name, &line.repeat(2))
}

// The error names the options that size the replay: in overlap mode the request rows
// (--max-running x the longest request) can be what does not fit, not the pool.
#[test]
fn too_large_names_the_options_that_size_the_replay() {
    let path = twice_one_long_prompt("rows-too-large.jsonl", 256);
    let trace = path.to_str().unwrap();
    let base = ["replay", "--trace", trace, "--capacity-tokens", "262144"];
    let overlap = [&base[..], &["--mode", "overlap", "--max-running", "4000"]].concat();
    let e = clean_failure(&kvpool_limited(LIMIT_KIB, &overlap));
    assert!(e.contains("more than this machine can allocate") && e.contains("--max-running"), "{e}");
    // The same pool with few rows fits.
    let out = kvpool_limited(LIMIT_KIB, &[&base[..], &["--mode", "overlap", "--max-running", "4"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

// The sequential driver's waiting queue holds at most the trace's requests: a long
// --lookahead on a short trace of long prompts reserves a prompt buffer per request
// of the trace, not per place in the lookahead (4097 buffers of 4 MiB here).
#[test]
fn lookahead_longer_than_the_trace_reserves_only_the_trace() {
    let path = twice_one_long_prompt("long-prompts.jsonl", 2048);
    for policy in ["hinted", "reuse"] {
        let args = [
            "replay",
            "--json",
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            "sequential",
            "--capacity-tokens",
            "2097152",
            "--policy",
            policy,
            "--lookahead",
            "4096",
        ];
        let out = kvpool_limited(LIMIT_KIB, &args);
        assert!(out.status.success(), "{policy}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!((int(&v, "requests"), int(&v, "hit_tokens")), (2, 1 << 20), "{policy}: {v}");
    }
}

// Issue 14, finding 6: an input_length past 32 bits is an error naming its line, not
// a prompt wrapped to a small one.
#[test]
fn input_length_beyond_32_bits_is_rejected() {
    // 2^32 tokens need 2^23 blocks: a 16 MiB line.
    let blocks = 1usize << 23;
    let mut text = String::from("{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n");
    text.push_str("{\"input_length\": 4294967296, \"output_length\": 1, \"hash_ids\": [");
    text.push_str(&"0,".repeat(blocks - 1));
    text.push_str("0]}\n");
    let path = write_text("input-2-32.jsonl", &text);
    let out = kvpool_limited(LIMIT_KIB, &["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential"]);
    let e = clean_failure(&out);
    assert!(e.contains("line 2") && e.contains("input_length 4294967296"), "{e}");
}

// Issue 14, finding 6: a request larger than the whole pool is rejected before its
// tokens are expanded or anything is allocated for it, and nothing is evicted for it.
#[test]
fn request_larger_than_the_pool_is_rejected_up_front() {
    // r1 needs 2^30 tokens (a 4 MiB line): expanding it takes 4 GiB per buffer.
    let blocks = 1usize << 21;
    let mut text = String::from("{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n");
    text.push_str(&format!("{{\"input_length\": {}, \"output_length\": 1, \"hash_ids\": [", blocks * 512));
    text.push_str(&"0,".repeat(blocks - 1));
    text.push_str("0]}\n{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n");
    let path = write_text("huge-request.jsonl", &text);
    for mode in ["sequential", "overlap"] {
        for cache in ["kvpool", "reference"] {
            let args = ["replay", "--json", "--trace", path.to_str().unwrap(), "--mode", mode, "--cache", cache];
            let out = kvpool_limited(LIMIT_KIB, &args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{mode} {cache}: {stderr}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!((int(&v, "requests"), int(&v, "rejected")), (3, 1), "{v}");
        }
    }

    // Nothing is evicted for a request that can never fit: r2 still hits r0's page.
    let path = write_trace("larger-than-pool.jsonl", &[(8, 1, &[1]), (100, 1, &[2]), (8, 1, &[1])]);
    for cache in ["kvpool", "reference"] {
        let v = replay_json(&[
            "--trace",
            path.to_str().unwrap(),
            "--mode",
            "sequential",
            "--page-size",
            "4",
            "--capacity-tokens",
            "64",
            "--cache",
            cache,
        ]);
        check(&v, &[("rejected", 1), ("hit_tokens", 8), ("evicted_tokens", 0), ("final_cached_tokens", 8)]);
    }
}

// Issue 14, finding 7: a closed stdout ends the command quietly with the status a
// shell reports for SIGPIPE, not a panic.
#[test]
fn broken_pipe_exits_quietly() {
    let path = write_trace("pipe.jsonl", SCENARIO_A);
    for json in [false, true] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpool"));
        cmd.args(["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential"]);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // Close the reading end before the replay prints anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "json {json}: {stderr}");
        assert!(stderr.is_empty(), "json {json}: {stderr}");
    }
}

// Issue 14, finding 7: a UTF-8 byte order mark at the start of a trace is accepted.
#[test]
fn byte_order_mark_is_accepted() {
    let plain = std::fs::read_to_string(write_trace("no-bom.jsonl", SCENARIO_A)).unwrap();
    let path = write_text("bom.jsonl", &format!("\u{feff}{plain}"));
    let v = replay_json(&["--trace", path.to_str().unwrap(), "--mode", "sequential", "--page-size", "4"]);
    check(&v, &[("requests", 4), ("prompt_tokens", 31), ("hit_tokens", 8)]);
}

// Issue 14, finding 7: a line that is JSON but not an object is described in the
// trace's terms, not in the loader's Rust types.
#[test]
fn non_object_line_says_what_was_expected() {
    for (name, line, found) in [
        ("array.jsonl", "[10, 1, [1]]", "a JSON array"),
        ("number.jsonl", "42", "a JSON number"),
        ("null.jsonl", "null", "JSON null"),
    ] {
        let path =
            write_text(name, &format!("{{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}}\n{line}\n"));
        let e = fails(&["replay", "--trace", path.to_str().unwrap()]);
        assert!(e.contains("line 2") && e.contains("expected a JSON object") && e.contains(found), "{e}");
        assert!(!e.contains("RawRequest") && !e.contains("struct"), "{e}");
    }
}

// Issue 14, finding 7: a corrupt or truncated gzip file is reported as a gzip error.
#[test]
fn corrupt_gzip_is_a_gzip_error() {
    let bundled =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/data/mooncake_conversation_trace.jsonl.gz")).unwrap();
    let truncated = write_bytes("truncated.jsonl.gz", &bundled[..bundled.len() / 2]);
    let mut garbage = bundled[..10].to_vec();
    garbage.extend(std::iter::repeat(0xa5u8).take(4096));
    let garbage = write_bytes("garbage.jsonl.gz", &garbage);
    for path in [truncated, garbage] {
        let e = fails(&["replay", "--trace", path.to_str().unwrap()]);
        assert!(e.contains("gzip"), "{e}");
    }
}

fn write_bytes(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = write_text(name, "");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Write `parts` to a fresh file, each `(bytes, times)` repeated `times` times, holding
/// no more than one copy in memory.
fn write_repeated(name: &str, parts: &[(&[u8], usize)]) -> std::path::PathBuf {
    let path = write_text(name, "");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    for &(bytes, times) in parts {
        for _ in 0..times {
            std::io::Write::write_all(&mut file, bytes).unwrap();
        }
    }
    std::io::Write::flush(&mut file).unwrap();
    path
}

/// One gzip member holding `data`.
fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut encoder, data).unwrap();
    encoder.finish().unwrap()
}

// A line longer than kvpool::replay::MAX_LINE_BYTES (256 MiB) is an error naming it,
// read no further than the limit: here a 1 MB gzip file whose second line is 1 GiB of
// hash ids, replayed in 2 GiB of address space.
#[test]
fn over_long_line_is_an_error_naming_it() {
    let head = gzip(b"{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [");
    let ids = gzip(&b"0,".repeat(1 << 19));
    let tail = gzip(b"0]}\n");
    let path = write_repeated("over-long-line.jsonl.gz", &[(&head, 1), (&ids, 1024), (&tail, 1)]);
    assert!(std::fs::metadata(&path).unwrap().len() < 4 << 20);
    let out = kvpool_limited(LIMIT_KIB, &["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential"]);
    let _ = std::fs::remove_file(&path);
    let e = clean_failure(&out);
    assert!(e.contains("line 2: line longer than 268435456 bytes, the most a trace line may hold"), "{e}");
}

// A request keeps only the hash ids its prompt reaches, whichever field comes first in
// its line: a 64 MiB line of ids for a 1000-token prompt, and an 8 MiB one with the ids
// before input_length, replay in 256 MiB of address space (holding their ids would take
// 300 MiB).
#[test]
fn unused_hash_ids_are_not_kept() {
    let ids = b"7,".repeat(1 << 16);
    let path = write_repeated(
        "unused-ids.jsonl",
        &[
            (b"{\"input_length\": 1000, \"output_length\": 2, \"hash_ids\": [", 1),
            (&ids, 1 << 9),
            (b"8]}\n{\"timestamp\": 1, \"hash_ids\": [", 1),
            (&ids, 1 << 6),
            (b"9], \"output_length\": 2, \"input_length\": 1500}\n", 1),
        ],
    );
    let trace = path.to_str().unwrap();
    let args =
        ["replay", "--json", "--trace", trace, "--mode", "sequential", "--capacity-tokens", "4096", "--page-size", "8"];
    let out = kvpool_limited(256 << 10, &args);
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Both prompts are blocks of id 7: the second hits the first's 1000 tokens.
    let counts = ["requests", "prompt_tokens", "hit_tokens"].map(|key| int(&v, key));
    assert_eq!(counts, [2, 2500, 1000], "{v}");
}

// Issue 14, finding 7: a capacity that is not whole pages is refused rather than
// rounded down, and a replay that could serve no request fails.
#[test]
fn capacity_must_be_whole_pages_and_hold_a_request() {
    let path = write_trace("pages.jsonl", SCENARIO_A);
    let trace = path.to_str().unwrap();
    let e = fails(&["replay", "--trace", trace, "--capacity-tokens", "17"]);
    assert!(e.contains("--capacity-tokens 17 is not a multiple of --page-size 16") && e.contains("16 or 32"), "{e}");
    // Scenario A's requests need 12, 12, 8 and 12 KV tokens in pages of 4.
    let e = fails(&["replay", "--trace", trace, "--capacity-tokens", "4", "--page-size", "4", "--mode", "sequential"]);
    assert!(e.contains("no request of the trace fits in --capacity-tokens 4: the smallest needs 8"), "{e}");
    // One request fitting is enough: the others are rejected and counted.
    let v = replay_json(&["--trace", trace, "--capacity-tokens", "8", "--page-size", "4", "--mode", "sequential"]);
    check(&v, &[("requests", 4), ("rejected", 3), ("prompt_tokens", 5)]);
}

// A request with no KV at all (an empty prompt and at most one output token) fits in
// any pool: a trace of only such requests, or of such requests and others too large
// for the pool, is served, not refused as one of which no request fits.
#[test]
fn requests_without_kv_fit_in_any_pool() {
    let empty = write_trace("no-kv.jsonl", &[(0, 0, &[]), (0, 1, &[])]);
    let mixed = write_trace("no-kv-and-huge.jsonl", &[(0, 1, &[]), (1000, 1, &[1, 2])]);
    for (path, rejected) in [(&empty, 0), (&mixed, 1)] {
        let trace = path.to_str().unwrap();
        for mode in [
            &["--mode", "sequential"][..],
            &["--mode", "overlap"],
            &["--mode", "sequential", "--cache", "reference"],
            &["--model", "hybrid", "--mamba-states", "3"],
            &["--model", "swa"],
            &["--host-capacity-tokens", "64"],
            &["--policy", "optimal"],
        ] {
            let mut args = vec!["--trace", trace, "--capacity-tokens", "64", "--page-size", "16"];
            args.extend_from_slice(mode);
            let v = replay_json(&args);
            assert_eq!((int(&v, "requests"), int(&v, "rejected")), (2, rejected), "{mode:?}: {v}");
            assert_eq!((int(&v, "prompt_tokens"), int(&v, "hit_tokens")), (0, 0), "{mode:?}: {v}");
            assert_eq!(v["invariants_ok"], serde_json::Value::Bool(true));
        }
    }
}

// Issue 14, finding 7: --plot does not touch an existing file until the replay is
// done, and leaves nothing behind when it fails.
#[test]
fn plot_replaces_the_file_only_at_the_end() {
    let path = write_trace("plot-keep.jsonl", SCENARIO_A);
    let dir = std::env::temp_dir().join(format!("kvpool-plot-keep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("keep.svg");
    std::fs::write(&svg, "ORIGINAL").unwrap();
    let args = ["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential", "--plot", svg.to_str().unwrap()];
    let mut failing = args.to_vec();
    failing.extend_from_slice(&["--capacity-tokens", "4294967280"]);
    clean_failure(&kvpool_limited(LIMIT_KIB, &failing));
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "ORIGINAL");
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["keep.svg"], "a temporary file was left behind");

    let out = kvpool(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["keep.svg"]);
}

// A --plot target that is a directory cannot be replaced by the plot: a clear error
// before the replay, with nothing on stdout (not the report followed by a failure)
// and nothing left beside it.
#[test]
fn plot_onto_a_directory_fails_before_the_replay() {
    let path = write_trace("plot-dir.jsonl", SCENARIO_A);
    let dir = std::env::temp_dir().join(format!("kvpool-plot-dir-{}", std::process::id()));
    let target = dir.join("a-directory");
    std::fs::create_dir_all(&target).unwrap();
    for json in [true, false] {
        let mut args = vec!["replay", "--trace", path.to_str().unwrap(), "--mode", "sequential"];
        args.extend_from_slice(&["--plot", target.to_str().unwrap()]);
        if json {
            args.push("--json");
        }
        let e = fails(&args);
        assert!(e.contains("cannot write the plot") && e.contains("a-directory"), "{e}");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["a-directory"], "a temporary file was left behind");
        assert!(target.is_dir());
    }
}

// The engine router's options without the engines (or, for --route-tokens, without the
// prefix router) would be silently ignored: refused, as the other tiers' options are.
#[test]
fn router_options_without_their_router_are_refused() {
    let path = write_trace("router-options.jsonl", SCENARIO_A);
    let t = path.to_str().unwrap();
    let e = fails(&["replay", "--trace", t, "--router", "prefix"]);
    assert!(e.contains("--router is an option of --engines"), "{e}");
    let e = fails(&["replay", "--trace", t, "--route-tokens", "16"]);
    assert!(e.contains("--route-tokens is an option of --engines"), "{e}");
    let e = fails(&["replay", "--trace", t, "--engines", "2", "--route-tokens", "16"]);
    assert!(e.contains("--route-tokens is an option of --router prefix"), "{e}");
    let v = replay_json(&["--trace", t, "--engines", "2", "--router", "prefix", "--route-tokens", "16"]);
    assert_eq!(int(&v, "requests"), 4);
    let v = replay_json(&["--trace", t, "--engines", "2", "--router", "round_robin"]);
    assert_eq!(int(&v, "requests"), 4);
}

/// `--store` needs the Redis client: without the `redis` feature it is a typed error (the
/// engines alone still run).
#[cfg(not(feature = "redis"))]
#[test]
fn store_without_the_redis_feature_is_a_config_error() {
    let path = write_trace("no_redis.jsonl", &[(1024, 1, &[1, 2]), (1536, 1, &[1, 2, 3])]);
    let t = path.to_str().unwrap();
    let err = fails(&["replay", "--trace", t, "--capacity-tokens", "4096", "--store", "redis://127.0.0.1:1"]);
    assert!(err.contains("without the `redis` feature"), "{err}");
    let v = replay_json(&["--trace", t, "--capacity-tokens", "4096", "--engines", "2"]);
    assert_eq!(int(&v["store"]["total"], "requests"), 2);
}

/// `v` without what depends on timing (wall time, rates, latencies).
fn counts(mut v: serde_json::Value) -> serde_json::Value {
    let map = v.as_object_mut().unwrap();
    for key in ["wall_seconds", "requests_per_second", "tokens_per_second", "latency_ns"] {
        map.remove(key);
    }
    v
}

// Traces from elsewhere: outputs longer than 2048 tokens (reasoning models) expand by
// the same formula, and hash ids of any size (64-bit content hashes) are renumbered.
// Neither changes a replay: the same trace with its ids mapped one to one onto large
// values replays to exactly the same numbers in every model, cache and policy, and
// kvpool's cache still agrees with the reference on it.
#[test]
fn large_hash_ids_and_long_outputs_replay_the_same() {
    let mut rng = Rng::new(7);
    let mut trace = random_trace(11, 300, 8);
    for (i, (_, output, ids)) in trace.iter_mut().enumerate() {
        if i % 4 == 0 {
            *output = 2049 + rng.below(6000);
        }
        // Not in order of first appearance, so that the renumbering changes the ids.
        for h in ids.iter_mut() {
            *h ^= 0x2a5;
        }
    }
    let big: Vec<(u64, u64, Vec<u64>)> = trace
        .iter()
        .map(|(l, o, ids)| (*l, *o, ids.iter().map(|h| h.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (1 << 63)).collect()))
        .collect();
    let write = |name: &str, t: &[(u64, u64, Vec<u64>)]| {
        let lines: Vec<(u64, u64, &[u64])> = t.iter().map(|(l, o, h)| (*l, *o, &h[..])).collect();
        write_trace(name, &lines)
    };
    let (small, large) = (write("ids-small.jsonl", &trace), write("ids-large.jsonl", &big));
    let (small, large) = (small.to_str().unwrap(), large.to_str().unwrap());
    let base = ["--mode", "sequential", "--capacity-tokens", "65536"];
    let configs: &[&[&str]] = &[
        &[],
        &["--cache", "reference"],
        &["--page-size", "1"],
        &["--policy", "lfu"],
        &["--policy", "optimal"],
        &["--model", "hybrid"],
        &["--model", "swa"],
        &["--host-ratio", "2"],
    ];
    for extra in configs {
        let run = |t: &str| {
            let mut args = vec!["--trace", t];
            args.extend_from_slice(&base);
            args.extend_from_slice(extra);
            counts(replay_json(&args))
        };
        let (a, b) = (run(small), run(large));
        assert_eq!(a, b, "{extra:?}");
        assert!(int(&a, "evicted_tokens") > 0 && int(&a, "hit_tokens") > 0, "{extra:?}: {a}");
        assert_eq!(int(&a, "output_tokens"), trace.iter().map(|r| r.1).sum::<u64>(), "{extra:?}");
    }
    let hits = |t: &str, cache: &str| {
        int(
            &replay_json(&["--trace", t, "--mode", "sequential", "--capacity-tokens", "65536", "--cache", cache]),
            "hit_tokens",
        )
    };
    assert_eq!(hits(large, "kvpool"), hits(large, "reference"));
}
