//! Model-based test: the concurrent RadixCache, driven through the request contract,
//! against the simple reference tree on random operation sequences (see
//! `kvpool::models::radix`).
#![cfg(all(not(loom), feature = "models"))]

use kvpool::models::radix::{run, RadixOp};
use proptest::prelude::*;

/// Any tokens, or a prefix of one of the driver's four shared sequences (keys that are
/// prefixes of each other).
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..20),
        1 => (0u8..4, 0usize..25).prop_map(|(base, len)| {
            let mut seeds = vec![0x40 | base];
            seeds.resize(len + 1, 0);
            seeds
        }),
    ]
}

/// Mostly the default cache key (see `kvpool::models::radix::cache_key`).
fn tenant() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(0u8), 1 => (0u8..5).prop_map(|k| k << 2 | 3)]
}

fn op() -> impl Strategy<Value = RadixOp> {
    prop_oneof![
        3 => (key(), tenant(), any::<u8>()).prop_map(|(key, tenant, prefill)| RadixOp::Start { key, tenant, prefill }),
        2 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(req, n, seed)| RadixOp::Extend { req, n, seed }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(mask, token)| RadixOp::Decode { mask, token }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(req, cut)| RadixOp::Checkpoint { req, cut }),
        2 => (any::<u8>(), any::<i8>(), any::<u8>())
            .prop_map(|(req, prio, miscount)| RadixOp::Finish { req, prio, miscount }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(req, drop)| RadixOp::Abort { req, drop }),
        2 => (key(), tenant(), any::<i8>()).prop_map(|(key, tenant, prio)| RadixOp::Serve { key, tenant, prio }),
        2 => (key(), tenant()).prop_map(|(key, tenant)| RadixOp::Match { key, tenant }),
        2 => (key(), tenant()).prop_map(|(key, tenant)| RadixOp::Peek { key, tenant }),
        1 => any::<u8>().prop_map(|n| RadixOp::Evict { n }),
        1 => Just(RadixOp::Reset),
    ]
}

/// Cases: 256 in a debug build, 2048 optimised; `PROPTEST_CASES` overrides both.
fn cases(debug: u32, release: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(if cfg!(debug_assertions) {
        debug
    } else {
        release
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256, 2048), ..ProptestConfig::default() })]

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
    #![proptest_config(ProptestConfig { cases: cases(256, 256), ..ProptestConfig::default() })]

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

/// A fixed sequence through every operation, for every page size and policy: two
/// requests decoding in one batch, a checkpoint, refused finishes, a salted request
/// that must not see the unsalted one's KV, a bigram request, a refused reset. (That
/// the model can fail was checked by planting bugs in the eviction heap: it reports
/// them within a few steps.)
#[test]
fn scripted_sequence_agrees() {
    let prompt = vec![1, 2, 0, 1, 2, 0, 0, 1, 1];
    let ops = vec![
        RadixOp::Serve { key: vec![1, 2, 0, 1], tenant: 0, prio: 0 },
        RadixOp::Start { key: prompt.clone(), tenant: 0, prefill: 1 },
        RadixOp::Start { key: prompt.clone(), tenant: 0b0000_0111, prefill: 1 },
        RadixOp::Decode { mask: 0b11, token: 0x81 },
        RadixOp::Reset,
        RadixOp::Match { key: vec![1, 2, 0], tenant: 0 },
        RadixOp::Checkpoint { req: 0, cut: 7 },
        RadixOp::Extend { req: 1, n: 3, seed: 2 },
        RadixOp::Finish { req: 0, prio: 3, miscount: 1 },
        RadixOp::Peek { key: prompt.clone(), tenant: 0b0000_0111 },
        RadixOp::Finish { req: 0, prio: 0, miscount: 2 },
        RadixOp::Start { key: prompt.clone(), tenant: 0b0000_1111, prefill: 2 },
        RadixOp::Decode { mask: 1, token: 0 },
        RadixOp::Finish { req: 0, prio: 0, miscount: 0 },
        RadixOp::Serve { key: prompt, tenant: 0b0000_1111, prio: 1 },
        RadixOp::Start { key: vec![2, 2, 2, 2, 2], tenant: 0b0000_0011, prefill: 4 },
        RadixOp::Abort { req: 0, drop: true },
        RadixOp::Evict { n: 1 },
        RadixOp::Reset,
    ];
    for ps in 0..3 {
        for policy in 0..6 {
            run(ps, 10, policy, &ops).unwrap();
        }
    }
}

/// A bigram request caches position `i` with token `i + 1`: one that holds nothing past
/// its lock cannot finish (refused, nothing changed) until it computes one token more.
#[test]
fn a_bigram_request_finishes_only_past_its_lock() {
    let prompt = vec![1, 2, 0, 1, 2, 0, 0, 1, 1];
    let bigram = 0b1111;
    let ops = vec![
        RadixOp::Serve { key: prompt.clone(), tenant: bigram, prio: 0 },
        RadixOp::Start { key: prompt.clone(), tenant: bigram, prefill: 0 },
        RadixOp::Finish { req: 0, prio: 0, miscount: 1 },
        RadixOp::Peek { key: prompt.clone(), tenant: bigram },
        RadixOp::Extend { req: 0, n: 1, seed: 0 },
        RadixOp::Finish { req: 0, prio: 0, miscount: 2 },
        RadixOp::Match { key: prompt, tenant: 0 },
    ];
    for ps in 0..3 {
        for policy in 0..6 {
            run(ps, 10, policy, &ops).unwrap();
        }
    }
}

/// With every row taken, an admission is refused with nothing changed, and so is a
/// reset; once the requests are gone, the reset empties the tree.
#[test]
fn admissions_and_resets_wait_for_free_rows_and_no_requests() {
    let mut ops: Vec<RadixOp> =
        (0..7u8).map(|i| RadixOp::Start { key: vec![i % 3, 1, 2, 0, 1], tenant: 0, prefill: 1 }).collect();
    ops.extend([
        RadixOp::Reset,
        RadixOp::Decode { mask: 0b11_1111, token: 0 },
        RadixOp::Finish { req: 2, prio: 0, miscount: 0 },
        RadixOp::Serve { key: vec![2, 1, 2, 0, 1], tenant: 0, prio: 0 },
    ]);
    ops.extend((0..6).map(|_| RadixOp::Abort { req: 0, drop: false }));
    ops.push(RadixOp::Reset);
    for ps in 0..3 {
        run(ps, 27, 0, &ops).unwrap();
    }
}
