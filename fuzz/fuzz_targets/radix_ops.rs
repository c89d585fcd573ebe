//! Random operation sequences on the radix cache through the request contract (requests
//! admitted under cache keys with salts, extra keys and bigram keys; prefill chunks,
//! decode batches, checkpoints, finishes with right and wrong token counts, aborts and
//! drops; served requests, matches, lock-free lookups, evictions, resets), checked
//! against the simple reference tree by `kvpool::models::radix::run_with`. The input
//! picks the page size (1, 2, 4), the pool size (4..32 pages), the eviction policy and
//! at most `MAX_FUZZ_OPS` ops. Every step compares the op's result, sizes, free space,
//! free rows and the accounting; the full comparison (leaf paths, rows, invariants,
//! page owners) runs every `FUZZ_FULL_CHECK_EVERY` steps and at the end.
//!
//! Replay a crash: `cargo +nightly fuzz run radix_ops <crash-file>`, or in a test
//! `let (ps, pages, policy, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);` then
//! `run(ps, pages, policy, &ops)` (full comparison after every step).
#![no_main]

use kvpool::models::radix::{from_fuzz_input, run_with, FUZZ_FULL_CHECK_EVERY, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (page_size, pages, policy, ops) = from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = run_with(page_size, pages, policy, &ops, FUZZ_FULL_CHECK_EVERY) {
        panic!("RadixCache disagrees with the reference: {e}\n{ops:#?}");
    }
});
