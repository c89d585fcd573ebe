//! Helpers shared by the `replay_*` integration tests: run the `kvpool` binary, write
//! small traces.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// Run `kvpool` with `args`.
pub fn kvpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvpool")).args(args).output().expect("the kvpool binary runs")
}

/// Write a trace of `(input_length, output_length, hash_ids)` lines to a fresh file.
pub fn write_trace(name: &str, requests: &[(u64, u64, &[u64])]) -> PathBuf {
    let text: String = requests
        .iter()
        .enumerate()
        .map(|(i, (l, o, h))| {
            format!("{{\"timestamp\": {i}, \"input_length\": {l}, \"output_length\": {o}, \"hash_ids\": {h:?}}}\n")
        })
        .collect();
    write_text(name, &text)
}

/// Write `text` to a fresh file in the temp directory.
pub fn write_text(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpool-replay-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Run `kvpool replay --json` with `args`; assert success and exactly one JSON object
/// on stdout, and return it.
pub fn replay_json(args: &[&str]) -> Value {
    let mut all = vec!["replay", "--json"];
    all.extend_from_slice(args);
    let out = kvpool(&all);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "kvpool {all:?} failed: {stderr}");
    assert_eq!(stdout.lines().count(), 1, "--json prints one line: {stdout}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// `v[key]` as an integer.
pub fn int(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} is not an integer in {v}"))
}

/// A small deterministic generator (xorshift64*), so stress traces are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random conversation-like trace: requests extend one of a few earlier prefixes of
/// hash blocks (so prefixes are shared and grow), with short outputs.
pub fn random_trace(seed: u64, requests: usize, max_blocks: usize) -> Vec<(u64, u64, Vec<u64>)> {
    let mut rng = Rng::new(seed);
    let mut next_id = 0u64;
    let mut out: Vec<(u64, u64, Vec<u64>)> = Vec::with_capacity(requests);
    for _ in 0..requests {
        let mut hash_ids = if !out.is_empty() && rng.below(4) != 0 {
            let base = &out[rng.below(out.len() as u64) as usize].2;
            base[..1 + rng.below(base.len() as u64) as usize].to_vec()
        } else {
            Vec::new()
        };
        let extra = 1 + rng.below(3) as usize;
        for _ in 0..extra {
            if hash_ids.len() < max_blocks {
                hash_ids.push(next_id);
                next_id += 1;
            }
        }
        let full = hash_ids.len() as u64 * 512;
        let input = full - rng.below(512);
        let output = 1 + rng.below(300);
        out.push((input, output, hash_ids));
    }
    out
}
