//! Random joins, extends, leaves, hints (any slot), squeezed pools and decode steps
//! through the graph decode paths' host halves: the delta planner with its kernel's
//! host reference against full records staged with `stage_decode_after`, on twin
//! pools, compared after every op (`kvpool::models::decode`, at most `MAX_FUZZ_OPS`
//! ops). The first byte picks the page size (1, 2, 5 or 16).
//!
//! Replay a crash: `cargo +nightly fuzz run decode_staging <crash-file>`, or in a test
//! `run_decode(bytes[0], &decode_ops_from_bytes(&bytes[1..], MAX_FUZZ_OPS))`.
#![no_main]

use kvpool::models::decode::{decode_ops_from_bytes, run_decode, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&page, rest)) = data.split_first() else { return };
    let ops = decode_ops_from_bytes(rest, MAX_FUZZ_OPS);
    if let Err(e) = run_decode(page, &ops) {
        panic!("the decode paths disagree: {e}\n{ops:#?}");
    }
});
