//! Model-based test: `MambaRadixCache`, driven through the request contract, against the
//! simple `ReferenceMambaCache` on random operation sequences (see
//! `kvpool::models::mamba`): every op's result, the sizes, the accounting, the leaf
//! paths, the state slots and the invariants agree after every step.
#![cfg(all(not(loom), feature = "models"))]

use kvpool::models::mamba::{from_fuzz_input, run, run_with, MambaOp, Shape, FUZZ_FULL_CHECK_EVERY, MAX_FUZZ_OPS};
use proptest::prelude::*;

/// Mostly prefixes of the driver's four shared sequences (keys that are prefixes of
/// each other make internal states, tombstones and revivals), sometimes any tokens.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => (0u8..4, 0usize..14).prop_map(|(base, len)| {
            let mut seeds = vec![0x40 | base];
            seeds.resize(len + 1, 0);
            seeds
        }),
        1 => prop::collection::vec(any::<u8>(), 0..16),
    ]
}

fn op() -> impl Strategy<Value = MambaOp> {
    prop_oneof![
        3 => (key(), any::<bool>(), any::<u8>()).prop_map(|(key, ns, prefill)| MambaOp::Start { key, ns, prefill }),
        1 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(req, n, seed)| MambaOp::Extend { req, n, seed }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(mask, token)| MambaOp::Decode { mask, token }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(req, at)| MambaOp::SaveState { req, at }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(req, at)| MambaOp::Checkpoint { req, at }),
        2 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(req, cut, miscount)| MambaOp::Finish { req, cut, miscount }),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(req, drop)| MambaOp::Abort { req, drop }),
        4 => (key(), any::<bool>()).prop_map(|(key, ns)| MambaOp::Serve { key, ns }),
        2 => (key(), any::<bool>()).prop_map(|(key, ns)| MambaOp::Match { key, ns }),
        1 => (key(), any::<bool>()).prop_map(|(key, ns)| MambaOp::Peek { key, ns }),
        1 => any::<u8>().prop_map(|n| MambaOp::Evict { n }),
        2 => any::<u8>().prop_map(|n| MambaOp::EvictMamba { n }),
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
    #![proptest_config(ProptestConfig { cases: cases(384, 4096), ..ProptestConfig::default() })]

    /// LRU (SGLang's only policy for this tree), page sizes 1, 2, 4.
    #[test]
    fn mamba_cache_matches_model_lru(
        page_size in 0u8..3,
        pages in any::<u8>(),
        states in any::<u8>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        if let Err(e) = run(Shape::from_bytes(page_size, pages, states, 0), &ops) {
            return Err(TestCaseError::fail(e));
        }
    }

    /// Every leaf policy the core offers (the state order stays LRU).
    #[test]
    fn mamba_cache_matches_model_any_policy(
        page_size in 0u8..3,
        pages in any::<u8>(),
        states in any::<u8>(),
        policy in 0u8..6,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        if let Err(e) = run(Shape::from_bytes(page_size, pages, states, policy), &ops) {
            return Err(TestCaseError::fail(e));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(128, 16384), ..ProptestConfig::default() })]

    /// The fuzz target's reading of its input and its check schedule.
    #[test]
    fn fuzz_inputs_match_model(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let (shape, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);
        if let Err(e) = run_with(shape, &ops, FUZZ_FULL_CHECK_EVERY) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// A fixed sequence through every operation, at every page size and policy: a
/// tombstone made by a split and revived by a request that checkpoints there, a
/// chunked prefill, two requests decoding in one batch, a finish past its checkpoint,
/// refused finishes (a wrong count, a state saved past its tokens).
#[test]
fn scripted_sequence_agrees() {
    let k = |v: &[u8]| v.to_vec();
    let ops = vec![
        MambaOp::Serve { key: k(&[1, 2, 0, 1, 2, 2, 1, 0]), ns: false },
        MambaOp::Match { key: k(&[1, 2, 0, 1, 0, 0]), ns: false },
        MambaOp::Start { key: k(&[1, 2, 0, 1, 1, 1, 1, 1]), ns: false, prefill: 4 },
        MambaOp::Checkpoint { req: 0, at: 0 },
        MambaOp::Extend { req: 0, n: 7, seed: 1 },
        MambaOp::Start { key: k(&[1, 2, 0, 1, 2, 2]), ns: true, prefill: 1 },
        MambaOp::Decode { mask: 3, token: 2 },
        MambaOp::Serve { key: k(&[1, 2, 0, 1]), ns: false },
        MambaOp::EvictMamba { n: 1 },
        MambaOp::Finish { req: 0, cut: 3, miscount: 1 },
        MambaOp::SaveState { req: 0, at: 0x87 },
        MambaOp::Finish { req: 0, cut: 255, miscount: 2 },
        MambaOp::Checkpoint { req: 0, at: 1 },
        MambaOp::Peek { key: k(&[1, 2, 0, 1, 2]), ns: false },
        MambaOp::Abort { req: 0, drop: false },
        MambaOp::Evict { n: 3 },
    ];
    for ps in 0..3 {
        for policy in 0..6 {
            for states in [0, 1, 5] {
                run(Shape::from_bytes(ps, 9, states, policy), &ops).unwrap();
            }
        }
    }
}

/// A match refreshes its whole path, the root oldest: after serving `[0 1]`,
/// `[0 1 2 0]` and `[1]` and matching `[0 1 2 0]`, the least recently used state is the
/// one of `[1]` (a leaf: it goes whole), not the one of `[0 1]` (which a match
/// refreshing only its end node would leave older, and which would become a
/// tombstone). Random sequences rarely line this up, so it is spelled out.
#[test]
fn a_match_refreshes_its_whole_path() {
    let shared = |len: usize| {
        let mut seeds = vec![0x40u8];
        seeds.resize(len + 1, 0);
        seeds
    };
    for ps in 0..2 {
        let ops = vec![
            MambaOp::Serve { key: shared(2), ns: false },
            MambaOp::Serve { key: shared(4), ns: false },
            MambaOp::Serve { key: vec![1, 1], ns: false },
            MambaOp::Match { key: shared(4), ns: false },
            MambaOp::EvictMamba { n: 1 },
        ];
        run(Shape::from_bytes(ps, 20, 5, 0), &ops).unwrap();
    }
}

/// The fuzz target's checked-in seeds (a starting corpus), with the full comparison
/// after every step.
#[test]
fn fuzz_seeds_agree() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/mamba_ops");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let (shape, ops) = from_fuzz_input(&bytes, MAX_FUZZ_OPS);
        run(shape, &ops).unwrap();
        seen += 1;
    }
    assert!(seen > 0, "no seeds in {}", dir.display());
}
