//! Model-based test: `HiRadixCache` (the host tier on the one radix core), driven
//! through the request contract, against the simple `ReferenceHiCache` on random
//! request sequences (see `kvpool::models::hi`): every op's result, the sizes, the tier
//! counters and both sides' invariants (the device pool's accounting included) agree
//! after every step, and both pools are whole at the end. Half the shapes leave
//! transfers in flight until an op completes them.
#![cfg(all(not(loom), feature = "models"))]

use kvpool::models::hi::{run, HiOp, Shape, MAX_KEY};
use kvpool::radix::{EvictionPolicy, WritePolicy};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = HiOp> {
    prop_oneof![
        5 => (prop::collection::vec(0u8..2, 0..MAX_KEY + 1), any::<bool>(), prop::bool::weighted(0.25))
            .prop_map(|(key, finish, salted)| HiOp::Start { key, finish, salted }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(mask, token)| HiOp::Decode { mask, token }),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(req, miscount)| HiOp::Finish { req, miscount }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(req, drop)| HiOp::Abort { req, drop }),
        1 => (0u8..24).prop_map(HiOp::Evict),
        1 => (0u8..24).prop_map(HiOp::EvictHost),
        3 => any::<u8>().prop_map(HiOp::Complete),
        1 => (prop::collection::vec(0u8..2, 0..MAX_KEY + 1), prop::bool::weighted(0.25))
            .prop_map(|(key, salted)| HiOp::InsertHost { key, salted }),
        1 => Just(HiOp::Reset),
    ]
}

/// Cases: `debug` in a debug build, `release` optimised; `PROPTEST_CASES` overrides
/// both.
fn cases(debug: u32, release: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(if cfg!(debug_assertions) {
        debug
    } else {
        release
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1024, 8192), ..ProptestConfig::default() })]

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

/// Every write policy on a long fixed sequence that fills both tiers: requests that
/// finish at once or later, decode batches, refused finishes, aborts, resets refused
/// while requests are open, salted prefetches and requests.
#[test]
fn every_policy_on_a_busy_sequence() {
    let mut ops = Vec::new();
    for i in 0..200u32 {
        let key: Vec<u8> = (0..(4 + i % 19)).map(|k| ((i * 7 + k * (i % 3 + 1)) % 5 % 2) as u8).collect();
        ops.push(HiOp::Start { key, finish: i % 3 != 0, salted: i % 13 == 4 });
        if i % 5 == 1 {
            ops.push(HiOp::Decode { mask: (i * 11) as u8, token: i as u8 });
        }
        if i % 4 == 0 {
            ops.push(HiOp::Finish { req: i as u8, miscount: (i / 4) as u8 });
        }
        if i % 17 == 3 {
            ops.push(HiOp::Abort { req: i as u8, drop: i % 2 == 0 });
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
            ops.push(HiOp::InsertHost { key, salted: i % 3 == 0 });
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

/// Resets happen only with no request open: with transfers taken and in flight, the
/// pages their copies touch outlive the reset on both sides until they complete.
#[test]
fn resets_between_requests_keep_the_transfers_in_flight() {
    let ops = vec![
        HiOp::Start { key: vec![0, 1, 0, 1, 1, 0], finish: true, salted: false },
        HiOp::Start { key: vec![1, 1, 0, 1], finish: false, salted: true },
        HiOp::Reset,
        HiOp::Finish { req: 0, miscount: 1 },
        HiOp::Reset,
        HiOp::Start { key: vec![0, 1, 0, 1, 1, 0], finish: false, salted: false },
        HiOp::Decode { mask: 1, token: 1 },
        HiOp::Abort { req: 0, drop: true },
        HiOp::Complete(0),
        HiOp::Reset,
        HiOp::Complete(1),
    ];
    for write_policy in WritePolicy::ALL {
        for page_size in [1, 2, 4] {
            let shape = Shape {
                page_size,
                device_pages: 8,
                host_pages: 8,
                write_policy,
                threshold: 1,
                policy: EvictionPolicy::Lru,
                alphabet: 2,
                complete_at_once: false,
            };
            run(shape, &ops).unwrap_or_else(|e| panic!("{e}\n{shape:?}"));
        }
    }
}
