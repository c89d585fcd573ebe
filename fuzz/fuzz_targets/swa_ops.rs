//! Random operation sequences on the sliding-window radix cache through the request
//! contract (requests that are admitted, allocate prefill chunks, decode in batches,
//! release the window KV of tokens that fell out of their window, checkpoint, finish
//! with right and wrong token counts, abort and drop; served requests with released
//! leading pages; matches, lock-free peeks; the full pass, the window pass and both),
//! checked against the simple `ReferenceSwaCache` by `kvpool::models::swa::run_with`.
//! The input picks the page size (1, 2, 4), the full pool (6..37 pages), the window
//! pool (2 pages up to the full pool's), the window (1 to 24 tokens), the full pass's
//! policy and at most `MAX_FUZZ_OPS` ops. Every step compares the op's result, the
//! sizes and the accounting; the full comparison (leaf paths, the full-to-window
//! mapping, rows, invariants, page owners) runs every `FUZZ_FULL_CHECK_EVERY` steps and
//! at the end.
//!
//! Replay a crash: `cargo +nightly fuzz run swa_ops <crash-file>`, or in a test
//! `let (shape, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);` then `run(shape, &ops)`
//! (full comparison after every step).
#![no_main]

use kvpool::models::swa::{from_fuzz_input, run_with, FUZZ_FULL_CHECK_EVERY, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (shape, ops) = from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = run_with(shape, &ops, FUZZ_FULL_CHECK_EVERY) {
        panic!("SwaRadixCache disagrees with the reference: {e}\n{shape:?}\n{ops:#?}");
    }
});
