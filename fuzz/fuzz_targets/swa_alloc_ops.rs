//! Random operation sequences on `SwaAllocator`, the dual allocator of sliding-window
//! models (allocations that need both pools, frees, `free_swa` of window tails, free
//! groups and range frees, translations, clears), checked step by step against the
//! sequential model of `kvpool::models::swa_alloc`. The input
//! (`SwaScenario::from_fuzz_input`) picks the page size (1, 2, 3, 4, 16, 64), both
//! pools' sizes (1 to 130 pages, at most `MAX_FUZZ_SLOTS` slots each: the window pool
//! as often larger as smaller) and at most `MAX_FUZZ_OPS` ops. After every step the
//! op's result, both pools' counts, every page, the whole mapping table and
//! `check_invariants()` are compared.
//!
//! Replay a crash: `cargo +nightly fuzz run swa_alloc_ops <crash-file>`, or in a test
//! `SwaScenario::from_fuzz_input(&bytes, MAX_FUZZ_OPS).run()`.
#![no_main]

use kvpool::models::swa_alloc::{SwaScenario, MAX_FUZZ_OPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let scenario = SwaScenario::from_fuzz_input(data, MAX_FUZZ_OPS);
    if let Err(e) = scenario.run() {
        panic!("SwaAllocator disagrees with the model: {e}\n{scenario:#?}");
    }
});
