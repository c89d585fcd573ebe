//! Random operation sequences on the token and paged allocators (or a bare
//! `SlotPool`), checked step by step against the sequential reference model of
//! `kvpool::models`. The input (`Scenario::from_fuzz_input`) picks the page size (1,
//! 2, 3, 4, 5, 16, 64), the pool size (up to 130 pages and at most `MAX_FUZZ_SLOTS`
//! slots, plus an unused remainder), which structure runs, and at most `MAX_FUZZ_OPS`
//! ops. After each step the step's result, the counts and the pages the step touched are
//! compared with the model, and every page at the end of each segment
//! (`Scenario::run_fuzz`, `Checks::Touched`).
//!
//! Replay a crash: `cargo +nightly fuzz run allocator_ops <crash-file>`, or in a test
//! `Scenario::from_fuzz_input(&bytes, MAX_FUZZ_OPS).run()` (both structures, every page
//! after every step).
#![no_main]

use kvpool::models::{Scenario, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let scenario = Scenario::from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = scenario.run_fuzz() {
        panic!("kvpool disagrees with the model: {e}\n{scenario:#?}");
    }
});
