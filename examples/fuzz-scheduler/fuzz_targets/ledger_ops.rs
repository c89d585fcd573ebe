//! Fuzz a user's allocator wrapper (`PageLedger`, src/lib.rs) with kvpool's operation
//! sequences: `Scenario::from_fuzz_input` reads a page size, a pool size and up to
//! `MAX_FUZZ_OPS` ops (allocs, extend and decode batches with live or forged
//! `last_loc`s, frees of live, partial, duplicated, stale and forged handles, free groups,
//! clears) from the input; `run_allocator_observed` runs them on the wrapper and on
//! kvpool's sequential model, compares every result, count and touched page after each
//! step, and then calls `check_ledger`, which compares the wrapper's own state (the
//! page tags) with the model.
//!
//! Run: `cargo +nightly fuzz run --fuzz-dir examples/fuzz-scheduler ledger_ops`.
//! Replay a crash: the same command with the crash file appended.
#![no_main]

use fuzz_scheduler::{check_ledger, PageLedger};
use kvpool::models::{run_allocator_observed, Checks, Scenario, MAX_FUZZ_OPS};
use kvpool::PagedAllocator;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let scenario = Scenario::from_fuzz_input(data, MAX_FUZZ_OPS);
    let alloc = PagedAllocator::new(scenario.pool_size(), scenario.page_size()).expect("a small pool");
    let mut tags = vec![None; scenario.num_pages() as usize + 1];
    let checked = run_allocator_observed(PageLedger::new(alloc), &scenario.ops, Checks::Touched, |ledger, model| {
        check_ledger(ledger, model, &mut tags)
    });
    if let Err(e) = checked {
        panic!("PageLedger disagrees with kvpool's model: {e}\n{scenario:#?}");
    }
});
