//! Random operation sequences on private magazines (`SlotCache`) in front of a
//! `SlotPool`, beside its owned batches and bare API, checked step by step against a
//! model of who owns each index, each stock's contents by the documented policy
//! included: fills and empties through caches (some on other threads) and through the
//! pool, flushes, replaced caches, bare allocations and frees, bare frees of owned
//! indices, clears (`kvpool::models::cache`, at most `MAX_FUZZ_OPS` ops).
//!
//! Replay a crash: `cargo +nightly fuzz run slot_cache <crash-file>`, or in a test
//! `run_cache(&cache_ops_from_bytes(&bytes, MAX_FUZZ_OPS))`.
#![no_main]

use kvpool::models::cache::{cache_ops_from_bytes, run_cache, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ops = cache_ops_from_bytes(data, MAX_FUZZ_OPS);
    if let Err(e) = run_cache(&ops) {
        panic!("private magazines disagree with the model: {e}\n{ops:#?}");
    }
});
