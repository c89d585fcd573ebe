//! Random operation sequences on a `SlotPool` that parks whole blocks, checked step by
//! step against a set model and a twin pool that does not park (the same indices in
//! the same order from every allocation): allocations, run frees through free groups,
//! slice frees with bad indices, range and whole-block frees of whatever is there
//! (`kvpool::models::parking`, at most `MAX_FUZZ_OPS` ops).
//!
//! Replay a crash: `cargo +nightly fuzz run slot_parking <crash-file>`, or in a test
//! `run_parking(&park_ops_from_bytes(&bytes, MAX_FUZZ_OPS))`.
#![no_main]

use kvpool::models::parking::{park_ops_from_bytes, run_parking, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ops = park_ops_from_bytes(data, MAX_FUZZ_OPS);
    if let Err(e) = run_parking(&ops) {
        panic!("the parking pool disagrees with the model: {e}\n{ops:#?}");
    }
});
