//! Random request sequences on the host-tier radix cache through the request contract
//! (requests, some salted, that are admitted (match, load back, lock), allocate with
//! eviction, decode in batches, finish now or later with right and wrong token counts,
//! abort and drop; device and host evictions, host prefetches, transfers completed now
//! or later, resets), checked against the simple `ReferenceHiCache` by
//! `kvpool::models::hi::run`. The input picks the page size (1, 2, 4), the device pool
//! (4..19 pages), the host pool (1..24 pages), the write policy, the load-back
//! threshold (1..6 tokens), the device policy and at most `MAX_FUZZ_OPS` ops. Every
//! step compares the op's results, the sizes, the tier counters and both sides'
//! invariants; the end returns everything and checks both pools are whole.
//!
//! Replay a crash: `cargo +nightly fuzz run hi_ops <crash-file>`, or in a test
//! `let (shape, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);` then `run(shape, &ops)`.
#![no_main]

use kvpool::models::hi::{from_fuzz_input, run, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (shape, ops) = from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = run(shape, &ops) {
        panic!("HiRadixCache disagrees with the reference: {e}\n{shape:?}\n{ops:#?}");
    }
});
