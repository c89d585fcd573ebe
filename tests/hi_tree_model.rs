//! Model-based test: `HiRadixCache` (the host tier on the one radix core) against the
//! simple `ReferenceHiCache` on random request sequences (see `kvpool::models::hi`):
//! every op's result, the sizes, the tier counters and both sides' invariants agree
//! after every step, and both pools are whole at the end. Half the shapes leave
//! transfers in flight until an op completes them.
#![cfg(all(not(loom), feature = "models"))]

use kvpool::models::hi::{run, HiOp, Shape, MAX_KEY};
use kvpool::radix::{EvictionPolicy, WritePolicy};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = HiOp> {
    prop_oneof![
        5 => (prop::collection::vec(0u8..2, 0..MAX_KEY + 1), any::<bool>())
            .prop_map(|(key, finish)| HiOp::Start { key, finish }),
        3 => any::<u8>().prop_map(|req| HiOp::Finish { req }),
        1 => (0u8..24).prop_map(HiOp::Evict),
        1 => (0u8..24).prop_map(HiOp::EvictHost),
        3 => any::<u8>().prop_map(HiOp::Complete),
        1 => prop::collection::vec(0u8..2, 0..MAX_KEY + 1).prop_map(|key| HiOp::InsertHost { key }),
        1 => Just(HiOp::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(debug_assertions) { 1024 } else { 8192 }, ..ProptestConfig::default() })]

    #[test]
    fn host_tier_tree_agrees_with_the_reference(
        shape in any::<[u8; 6]>(),
        ops in prop::collection::vec(op(), 1..48),
    ) {
        let shape = Shape::from_bytes(shape);
        if let Err(e) = run(shape, &ops) {
            return Err(TestCaseError::fail(format!("{e}\n{shape:?}")));
        }
    }
}

/// Every write policy on a long fixed sequence that fills both tiers.
#[test]
fn every_policy_on_a_busy_sequence() {
    let mut ops = Vec::new();
    for i in 0..200u32 {
        let key: Vec<u8> = (0..(4 + i % 19)).map(|k| ((i * 7 + k * (i % 3 + 1)) % 5 % 2) as u8).collect();
        ops.push(HiOp::Start { key, finish: i % 3 != 0 });
        if i % 4 == 0 {
            ops.push(HiOp::Finish { req: i as u8 });
        }
        if i % 11 == 0 {
            ops.push(HiOp::EvictHost(6));
        }
        if i % 3 == 1 {
            ops.push(HiOp::Complete((i % 5) as u8));
        }
        if i % 29 == 5 {
            ops.push(HiOp::Reset);
        }
        if i % 7 == 2 {
            let key: Vec<u8> = (0..(6 + i % 15)).map(|k| ((i * 3 + k * 5) % 7 % 2) as u8).collect();
            ops.push(HiOp::InsertHost { key });
        }
    }
    for write_policy in WritePolicy::ALL {
        for policy in [EvictionPolicy::Lru, EvictionPolicy::Lfu] {
            for (page_size, complete_at_once) in [1, 2, 4].into_iter().flat_map(|p| [(p, true), (p, false)]) {
                let shape = Shape {
                    page_size,
                    device_pages: 12,
                    host_pages: 16,
                    write_policy,
                    threshold: 2,
                    policy,
                    alphabet: 2,
                    complete_at_once,
                };
                run(shape, &ops).unwrap_or_else(|e| panic!("{e}\n{shape:?}"));
            }
        }
    }
}
