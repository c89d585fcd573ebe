//! Random operation sequences on the radix cache (requests that start, chunk, finish
//! and abort; inserts, matches, lock-free lookups, evictions), checked step by step
//! against the simple reference tree by `kvpool::testing::radix::run`. The input picks
//! the page size (1, 2, 4), the pool size (4..32 pages) and the eviction policy.
#![no_main]

use kvpool::testing::radix::{run, RadixOp};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, u8, u8, Vec<RadixOp>)| {
    let (page_size, pages, policy, ops) = input;
    let ops = &ops[..ops.len().min(200)];
    if let Err(e) = run(page_size, pages, policy, ops) {
        panic!("RadixCache disagrees with the reference: {e}\n{ops:#?}");
    }
});
