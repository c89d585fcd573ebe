//! Model-based test: the concurrent RadixCache against the simple reference tree on
//! random operation sequences (see `kvpool::models::radix`).
#![cfg(all(not(loom), feature = "models"))]

use kvpool::models::radix::{run, RadixOp};
use proptest::prelude::*;

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..20)
}

fn op() -> impl Strategy<Value = RadixOp> {
    prop_oneof![
        3 => (key(), any::<bool>()).prop_map(|(key, ns)| RadixOp::Start { key, ns }),
        2 => (any::<u8>(), any::<i8>()).prop_map(|(req, prio)| RadixOp::Finish { req, prio }),
        1 => any::<u8>().prop_map(|req| RadixOp::Chunk { req }),
        1 => any::<u8>().prop_map(|req| RadixOp::Abort { req }),
        2 => (key(), any::<bool>(), any::<i8>()).prop_map(|(key, ns, prio)| RadixOp::Insert { key, ns, prio }),
        2 => (key(), any::<bool>()).prop_map(|(key, ns)| RadixOp::Match { key, ns }),
        2 => (key(), any::<bool>()).prop_map(|(key, ns)| RadixOp::Peek { key, ns }),
        1 => any::<u8>().prop_map(|n| RadixOp::Evict { n }),
        1 => Just(RadixOp::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(debug_assertions) { 256 } else { 2048 }, ..ProptestConfig::default() })]

    #[test]
    fn radix_cache_matches_reference(
        page_size in 0u8..3,
        pages in any::<u8>(),
        policy in 0u8..6,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        if let Err(e) = run(page_size, pages, policy, &ops) {
            return Err(TestCaseError::fail(e));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The fuzz target's reading of its input and its check schedule.
    #[test]
    fn fuzz_inputs_match_reference(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        use kvpool::models::radix::{from_fuzz_input, run_with, FUZZ_FULL_CHECK_EVERY, MAX_FUZZ_OPS};
        let (ps, pages, policy, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);
        if let Err(e) = run_with(ps, pages, policy, &ops, FUZZ_FULL_CHECK_EVERY) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// A fixed sequence through every operation, for every page size and policy. (That the
/// model can fail was checked by planting bugs in the eviction heap: it reports them
/// within a few steps.)
#[test]
fn scripted_sequence_agrees() {
    let ops = vec![
        RadixOp::Insert { key: vec![1, 2, 0, 1], ns: false, prio: 0 },
        RadixOp::Start { key: vec![1, 2, 0, 0], ns: false },
        RadixOp::Match { key: vec![1, 2, 0], ns: false },
        RadixOp::Chunk { req: 0 },
        RadixOp::Finish { req: 0, prio: 3 },
        RadixOp::Evict { n: 1 },
    ];
    for ps in 0..3 {
        for policy in 0..6 {
            run(ps, 10, policy, &ops).unwrap();
        }
    }
}
