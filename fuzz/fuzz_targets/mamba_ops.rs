//! Random operation sequences on the Mamba radix cache through the request contract
//! (requests admitted with a running state, prefill chunks, decode batches, states
//! saved for caching, checkpoints, finishes up to the saved state, refused finishes and
//! checkpoints, aborts and drops; served requests, matches, lock-free peeks, evictions
//! of KV and of states, state-pool pressure), checked against the simple
//! `ReferenceMambaCache` by `kvpool::models::mamba::run_with`. The input picks the page
//! size (1, 2, 4), the KV pool (3..18 pages), the state pool (1..8 slots), the leaf
//! eviction policy and at most `MAX_FUZZ_OPS` ops. Every step compares the op's result,
//! the sizes and the accounting; the full comparison (leaf paths, state slots, rows,
//! invariants, page owners) runs every `FUZZ_FULL_CHECK_EVERY` steps and at the end.
//!
//! Replay a crash: `cargo +nightly fuzz run mamba_ops <crash-file>`, or in a test
//! `let (shape, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);` then `run(shape, &ops)`
//! (full comparison after every step).
#![no_main]

use kvpool::models::mamba::{from_fuzz_input, run_with, FUZZ_FULL_CHECK_EVERY, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (shape, ops) = from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = run_with(shape, &ops, FUZZ_FULL_CHECK_EVERY) {
        panic!("MambaRadixCache disagrees with the reference: {e}\n{shape:?}\n{ops:#?}");
    }
});
