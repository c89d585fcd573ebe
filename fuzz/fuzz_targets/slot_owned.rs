//! Random operation sequences on a `SlotPool`'s owned batches (`Slots`) beside its bare
//! API, checked step by step against a model of who owns each index: fills and empties
//! (some on other threads), bare allocations and frees, bare frees of owned indices,
//! batches handed to another pool, clears (`kvpool::models::owned`, at most
//! `MAX_FUZZ_OPS` ops).
//!
//! Replay a crash: `cargo +nightly fuzz run slot_owned <crash-file>`, or in a test
//! `run_owned(&owned_ops_from_bytes(&bytes, MAX_FUZZ_OPS))`.
#![no_main]

use kvpool::models::owned::{owned_ops_from_bytes, run_owned, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ops = owned_ops_from_bytes(data, MAX_FUZZ_OPS);
    if let Err(e) = run_owned(&ops) {
        panic!("owned batches disagree with the model: {e}\n{ops:#?}");
    }
});
