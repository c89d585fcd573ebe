#![cfg(not(loom))]
//! The graph decode paths' host halves against each other (`kvpool::models::decode`):
//! the delta planner with its kernel's host reference, and full records staged with
//! `stage_decode_after`, on twin pools, through random joins, extends, leaves, hints
//! (any slot), squeezed pools and decode steps at page sizes 1, 2, 5 and 16. After
//! every op: the same pages, slots, rows and errors, nothing reserved by a refused step.

use kvpool::models::decode::{decode_ops_from_bytes, run_decode, DecodeOp, DecodeStats, MAX_FUZZ_OPS};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Sequences as long as the fuzz target's, and four times longer.
    #[test]
    fn delta_and_full_records_agree(page in any::<u8>(), bytes in vec(any::<u8>(), 0..2048), long in any::<bool>()) {
        let ops = decode_ops_from_bytes(&bytes, if long { 4 * MAX_FUZZ_OPS } else { MAX_FUZZ_OPS });
        run_decode(page, &ops).map_err(TestCaseError::fail)?;
    }
}

/// Random runs reach every outcome: steps that run, steps refused for want of pages
/// and at a row's end, page-size-1 slots that continue a run and that start one,
/// hints, and leaves that move a request.
#[test]
fn random_runs_reach_every_outcome() {
    let mut total = [DecodeStats::default(); 4];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for case in 0..400 {
        let bytes: Vec<u8> = (0..1500)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let page = (case % 4) as u8;
        total[page as usize] += run_decode(page, &decode_ops_from_bytes(&bytes, 4 * MAX_FUZZ_OPS)).unwrap();
    }
    println!("{total:#?}");
    for t in &total {
        assert!(t.steps > 100 && t.out_of_pages > 0 && t.row_end > 0 && t.hints > 0 && t.moves > 0, "{t:?}");
    }
    assert!(total[0].continued > 0 && total[0].started > 0, "{:?}", total[0]);
    assert!(total[1..].iter().all(|t| t.continued + t.started == 0));
}

/// By hand, page size 1: a prefill told to the planner is continued; a bogus hint
/// (an allocated slot's neighbour, or past the pool) starts a new run instead.
#[test]
fn hints_steer_page_one_steps() {
    use DecodeOp::*;
    // Request 0's prefill takes slots 1..=3 (not told), request 1's 4..=8 (told).
    let ops = vec![
        Join { len: 3, tell: false },
        Join { len: 5, tell: true },
        Step,
        Step,
        Hint { at: 0, slot: 0 },
        Hint { at: 1, slot: 60_000 },
        Step,
        Leave { at: 0 },
        Step,
    ];
    let s = run_decode(0, &ops).unwrap();
    assert_eq!(s.steps, 4);
    // Step 1: request 1 continues its prefill at 9, request 0 (not told) starts a
    // run. Step 2: both continue. Step 3: slot 1 is allocated and 60,001 is past the
    // pool: both start runs. Step 4: the one request left continues.
    assert_eq!((s.continued, s.started), (4, 3), "{s:?}");
}
