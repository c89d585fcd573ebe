//! Random operation sequences on the token and paged allocators (and a bare
//! `SlotPool`), checked step by step against the sequential reference model of
//! `kvpool::testing`. The input picks the page size (1, 2, 3, 4, 5, 16, 64), the pool
//! size (0..=130 pages, plus an unused remainder) and the ops.
//!
//! Replay a crash in the proptest suite: `Scenario::arbitrary_take_rest` on the crash
//! file's bytes, or `cargo +nightly fuzz run allocator_ops <crash-file>`.
#![no_main]

use kvpool::testing::Scenario;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|scenario: Scenario| {
    if let Err(e) = scenario.run() {
        panic!("kvpool disagrees with the model: {e}\n{scenario:#?}");
    }
});
