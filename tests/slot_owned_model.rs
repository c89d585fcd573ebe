#![cfg(not(loom))]
//! `SlotPool`'s owned batches (`Slots`, `alloc_slots`, `free_slots`) beside its bare
//! API, against a model of who owns each index (`kvpool::models::owned`): random
//! fills and empties (some on other threads, whose magazines differ), bare allocations
//! and frees, bare frees of owned indices (refused), batches handed to another pool and
//! pools cleared under them. After every op: exact results and errors, `available()`,
//! `is_allocated` of every index, `check_invariants()`.

use kvpool::models::owned::{owned_ops_from_bytes, run_owned, OwnedOp, MAX_FUZZ_OPS};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Sequences as long as the fuzz target's, and four times longer.
    #[test]
    fn owned_batches_agree_with_the_model(bytes in vec(any::<u8>(), 0..1024), long in any::<bool>()) {
        let ops = owned_ops_from_bytes(&bytes, if long { 4 * MAX_FUZZ_OPS } else { MAX_FUZZ_OPS });
        run_owned(&ops).map_err(TestCaseError::fail)?;
    }
}

/// Batches filled past a runs magazine's limits (more runs than it holds, more indices
/// than it takes), emptied on this thread and another, refilled from the magazines,
/// with bare frees of owned indices and a clear in between.
#[test]
fn runs_magazines_fill_up_flush_and_refill() {
    use OwnedOp::*;
    // On a fresh pool: a batch of three runs (the free stretches 3..=5, 9..=11, 15..=17),
    // emptied onto the runs stack (four entries), then one of three more (1..=2, 6,
    // 41..=46) that does not fit on top: the stack is flushed first.
    let mut ops = vec![Alloc { n: 39 }, Free { at: 2, len: 2 }, Free { at: 5, len: 2 }, Free { at: 8, len: 2 }];
    ops.extend([Fill { k: 0, n: 8 }, Empty { k: 0, elsewhere: false }, Free { at: 0, len: 2 }]);
    ops.extend([Fill { k: 1, n: 9 }, Empty { k: 1, elsewhere: false }]);
    // Two batches that fit a runs magazine (128 indices) one at a time but not together.
    ops.extend([Fill { k: 1, n: 60 }, Fill { k: 2, n: 100 }, Empty { k: 1, elsewhere: false }]);
    ops.extend([Empty { k: 2, elsewhere: false }, Fill { k: 2, n: 90 }, Empty { k: 2, elsewhere: false }]);
    ops.extend([Alloc { n: 69 }, Fill { k: 1, n: 40 }, Alloc { n: 9 }, Fill { k: 1, n: 20 }]);
    // Scatter batch 1's runs: bare frees between its indices make the next fill fragmented.
    ops.extend((0..6).map(|at| Free { at: at * 7, len: 0 }));
    ops.extend([
        Fill { k: 2, n: 120 },
        FreeOwned { k: 2, j: 17 },
        Empty { k: 2, elsewhere: false },
        Fill { k: 0, n: 8 },
        Empty { k: 1, elsewhere: true },
        Fill { k: 2, n: 150 },
        Fill { k: 3, n: 5 },
        Empty { k: 0, elsewhere: false },
        Empty { k: 3, elsewhere: false },
        Fill { k: 1, n: 13 },
        EmptyTail { k: 2, n: 30 },
        EmptyTail { k: 2, n: 500 },
        Fill { k: 2, n: 7 },
        OtherPool { k: 1 },
        OtherPool { k: 0 },
        Empty { k: 2, elsewhere: true },
        Fill { k: 3, n: 169 },
        Clear,
        Fill { k: 3, n: 121 },
        Empty { k: 3, elsewhere: false },
        Fill { k: 2, n: 160 },
    ]);
    run_owned(&ops).unwrap();
}
