#![cfg(not(loom))]
//! `SlotPool::with_parking` against a set model and a twin pool that does not park
//! (`kvpool::models::parking`): random op sequences of allocations, run frees through
//! free groups (whole blocks among them park), slice frees with bad indices, and range
//! and whole-block frees of whatever is there (double frees of parked blocks among
//! them). After every op: the same indices in the same order as the twin, exact
//! counts, `is_allocated` of every index, `check_invariants()`.

use kvpool::models::parking::{park_ops_from_bytes, run_parking, ParkOp, BLOCK, MAX_FUZZ_OPS};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Sequences as long as the fuzz target's, and four times longer.
    #[test]
    fn parking_agrees_with_the_model_and_the_twin(bytes in vec(any::<u8>(), 0..1024), long in any::<bool>()) {
        let ops = park_ops_from_bytes(&bytes, if long { 4 * MAX_FUZZ_OPS } else { MAX_FUZZ_OPS });
        run_parking(&ops).map_err(TestCaseError::fail)?;
    }
}

/// Every block parked, then taken in parts by claims that also need the words
/// between, then double-freed whole while in use.
#[test]
fn blocks_parked_taken_in_parts_and_double_freed() {
    let third = (BLOCK / 3) as u16;
    let mut ops = vec![ParkOp::Alloc { n: 1399 }, ParkOp::Alloc { n: 235 }];
    for b in 0..3u16 {
        ops.push(ParkOp::FreeRun { at: b * BLOCK as u16, len: BLOCK as u16 - 1, split: b == 1 });
    }
    ops.extend([
        ParkOp::FreeSlice { indices: vec![1600, 1601, 1602] },
        ParkOp::Alloc { n: third },
        ParkOp::FreeBlock { block: 0, many: false },
        ParkOp::FreeBlock { block: 1, many: true },
        ParkOp::Alloc { n: 1000 },
        ParkOp::FreeAny { first: 1, count: 1535, many: true },
        ParkOp::Alloc { n: 1399 },
    ]);
    run_parking(&ops).unwrap();
}
