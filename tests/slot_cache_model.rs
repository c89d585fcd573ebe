#![cfg(not(loom))]
//! `SlotCache` (private magazines in front of a `SlotPool`) beside the pool's owned
//! batches and bare API, against a model of who owns each index
//! (`kvpool::models::cache`): fills and empties through caches (some on other
//! threads) and through the pool, flushes, replaced caches, bare allocations and frees,
//! bare frees of owned indices (refused), clears. After every op: exact results and
//! errors, each stock's contents by the documented policy, `available()` of the pool
//! and of every cache, `is_allocated` of every index, `check_invariants()`.

use kvpool::models::cache::{cache_ops_from_bytes, run_cache, CacheOp, MAX_FUZZ_OPS};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Sequences as long as the fuzz target's, and four times longer.
    #[test]
    fn caches_agree_with_the_model(bytes in vec(any::<u8>(), 0..1024), long in any::<bool>()) {
        let ops = cache_ops_from_bytes(&bytes, if long { 4 * MAX_FUZZ_OPS } else { MAX_FUZZ_OPS });
        run_cache(&ops).map_err(TestCaseError::fail)?;
    }
}

/// Every branch of the policy in order: a draw of the shortfall plus half the
/// capacity, pops off the stock, a free that overflows the stock (spilling its top),
/// a batch larger than the capacity (straight to the pool both ways), a draw cut to
/// the shortfall when the pool runs low, out of memory with the stock counted, a
/// flush, a replacement, bare frees of stocked and batched indices, a clear.
#[test]
fn every_branch_of_the_policy() {
    use CacheOp::*;
    let ops = vec![
        // Cache 0 has capacity 16: a fill of 5 draws 5 + 8, leaving 8 in stock; 3 more
        // come off the stock (5 left); the 8 come back (13).
        Fill { c: 0, k: 0, n: 5, elsewhere: false },
        Fill { c: 0, k: 0, n: 3, elsewhere: false },
        Empty { c: 0, k: 0 },
        // 14 on another thread: a draw of the shortfall (1) plus what fits (2 more).
        Fill { c: 0, k: 1, n: 14, elsewhere: true },
        Empty { c: 0, k: 1 },
        // Full (16); 6 off it (10); a batch of 7 from the pool does not fit on top:
        // the stock's top 9 go back to the pool first (1 + 7 = 8, half the capacity).
        Fill { c: 0, k: 0, n: 6, elsewhere: false },
        PoolFill { k: 2, n: 7 },
        Empty { c: 0, k: 2 },
        // 40, more than the capacity: the shortfall straight from the pool, then the
        // whole stock.
        Fill { c: 0, k: 1, n: 40, elsewhere: false },
        FreeOwned { j: 3 },
        Empty { c: 0, k: 1 },
        // Cache 1 (capacity 100) takes most of the pool, the bare API the rest.
        Fill { c: 1, k: 2, n: 120, elsewhere: false },
        Alloc { n: 49 },
        Alloc { n: 49 },
        Fill { c: 1, k: 1, n: 60, elsewhere: false },
        FreeOwned { j: 200 },
        PoolFill { k: 1, n: 10 },
        // Out of memory with both stocks counted, then a draw cut to the shortfall.
        Fill { c: 0, k: 0, n: 8, elsewhere: false },
        Free { at: 0, len: 7 },
        Fill { c: 0, k: 0, n: 8, elsewhere: false },
        EmptyTail { c: 1, k: 2, n: 25 },
        EmptyTail { c: 1, k: 2, n: 500 },
        PoolEmpty { k: 2 },
        Flush { c: 1 },
        Replace { c: 0, cap: 3 },
        Fill { c: 0, k: 0, n: 0, elsewhere: false },
        Empty { c: 1, k: 0 },
        Clear,
        // Cache 1 (100) fills 129 straight from the pool; cache 0 (now 3) sends them back.
        Fill { c: 1, k: 2, n: 129, elsewhere: false },
        Empty { c: 0, k: 2 },
        // Cache 0 keeps 1 in stock; the bare API leaves 45 in the pool. 47 is out of
        // memory with the stock counted (46 available); 46 is an exact fit.
        Fill { c: 0, k: 0, n: 2, elsewhere: false },
        Alloc { n: 49 },
        Alloc { n: 49 },
        Alloc { n: 49 },
        Alloc { n: 49 },
        Alloc { n: 49 },
        Fill { c: 0, k: 2, n: 47, elsewhere: false },
        Fill { c: 0, k: 2, n: 46, elsewhere: false },
        Fill { c: 1, k: 1, n: 1, elsewhere: false },
    ];
    run_cache(&ops).unwrap();
}
