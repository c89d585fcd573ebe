#![cfg(not(loom))]
//! `SwaAllocator` (the dual allocator of sliding-window models) against its sequential
//! model (`kvpool::models::swa_alloc`): random op sequences on page sizes 1, 2, 3, 4
//! and 16, with a window pool smaller than the full pool (the real configuration) and
//! larger (so that the full pool runs out first), small pools of any shape, and the
//! fuzz target's input type. After every op the driver compares the op's result, both
//! pools' counts, every page, the whole mapping table, and runs `check_invariants()`.

use kvpool::alloc::SwaAllocator;
use kvpool::models::swa_alloc::{run_swa, swa_ops_from_bytes, SwaFreeOp, SwaModel, SwaOp, SwaScenario, MAX_FUZZ_OPS};
use kvpool::models::{Control, FreeOp, Misalign, Stats};
use kvpool::{FreeErrorKind, KvAllocator};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };
/// Op bytes per case: a few bytes per op, so several hundred ops.
const MAX_BYTES: usize = 2048;
/// Full pool pages of the fixed-shape tests: more than 64, so the bitmap and the
/// mapping span two words' worth of pages.
const FULL_PAGES: usize = 70;

fn check(r: Result<Stats, String>) -> Result<(), TestCaseError> {
    r.map(drop).map_err(TestCaseError::fail)
}

/// Window pool smaller (the real shape: 20 pages) and larger (90) than the full pool.
fn run_both_shapes(bytes: &[u8], ps: u32) -> Result<(), TestCaseError> {
    let ops = swa_ops_from_bytes(bytes);
    let full = FULL_PAGES * ps as usize + ps as usize / 2; // an unused remainder
    check(run_swa(&ops, full, 20 * ps as usize, ps))?;
    check(run_swa(&ops, full, 90 * ps as usize, ps))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn page_size_1_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_both_shapes(&bytes, 1)?;
    }

    #[test]
    fn page_size_2_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_both_shapes(&bytes, 2)?;
    }

    #[test]
    fn page_size_3_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_both_shapes(&bytes, 3)?;
    }

    #[test]
    fn page_size_4_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_both_shapes(&bytes, 4)?;
    }

    #[test]
    fn page_size_16_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        run_both_shapes(&bytes, 16)?;
    }

    /// Small pools of any shape: either pool full, exact capacity and one over happen
    /// often here.
    #[test]
    fn small_pools_match_model(
        full_pages in 1usize..=130,
        window_pages in 1usize..=130,
        page_size in prop::sample::select(vec![1u32, 2, 3, 4, 16]),
        bytes in vec(any::<u8>(), 0..MAX_BYTES),
    ) {
        let ps = page_size as usize;
        check(run_swa(&swa_ops_from_bytes(&bytes), full_pages * ps, window_pages * ps, page_size))?;
    }

    /// The fuzz target's reading of its input, so a fuzz crash replays here too.
    #[test]
    fn fuzz_scenarios_match_model(bytes in vec(any::<u8>(), 0..512)) {
        check(SwaScenario::from_fuzz_input(&bytes, MAX_FUZZ_OPS).run())?;
    }
}

/// The op mix is not vacuous: over a few hundred random sequences every outcome the
/// model tells apart occurs (both pools' refusals, `free_swa` of mapped and unmapped
/// pages, range frees, translations), for a token allocator and a paged one, with a
/// smaller and a larger window pool.
#[test]
fn op_mix_reaches_every_outcome() {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut bytes = || {
        (0..1500)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect::<Vec<u8>>()
    };
    for ps in [1u32, 4] {
        let mut stats = Stats::default();
        for k in 0..200 {
            let ops = swa_ops_from_bytes(&bytes());
            let window = if k % 2 == 0 { 12 } else { 60 };
            stats.merge(&run_swa(&ops, 40 * ps as usize, window * ps as usize, ps).unwrap());
        }
        let mut want = vec![
            "alloc: ok",
            "alloc: out of memory",
            "alloc: out of window memory",
            "alloc_extend: ok",
            "alloc_extend: out of memory",
            "alloc_extend: out of window memory",
            "alloc_extend: malformed batch",
            "alloc_decode: ok",
            "alloc_decode: out of window memory",
            "alloc_decode: malformed batch",
            "free: ok",
            "free: not allocated",
            "free: out of range",
            "group free: ok",
            "group free: not allocated",
            "group end: published",
            "free_swa: ok",
            "free_swa: ok, nothing mapped",
            "free_swa: not allocated",
            "free_swa: out of range",
            "free_pages: ok",
            "free_pages: not allocated",
            "free_pages: out of range",
            "group free_pages: ok",
            "translate: ok",
            "translate: ok, none mapped",
            "translate: length mismatch",
            "clear: ok",
        ];
        if ps == 1 {
            want.push("free: duplicate in batch");
        } else {
            want.extend([
                "alloc: not page aligned",
                "alloc_extend: ok, filled a partial page",
                "alloc_extend: bad last_loc",
                "alloc_decode: ok, filled a partial page",
            ]);
        }
        if std::env::var_os("KVPOOL_PRINT_STATS").is_some() {
            for (k, v) in stats.iter() {
                eprintln!("ps {ps}: {k:45} {v}");
            }
        }
        for outcome in want {
            assert!(stats.get(outcome) > 0, "page size {ps}: never saw {outcome:?}; saw {stats:?}");
        }
        assert!(stats.get("alloc_extend: ok") > stats.get("alloc_extend: malformed batch"), "{stats:?}");
    }
}

/// Each pool's refusal is told apart (the unit of the error), in both directions, and
/// a refused allocation takes nothing from the other pool.
#[test]
fn refusals_name_their_pool() {
    let ops = [SwaOp::Alloc { pages: 3, misalign: Misalign(0) }, SwaOp::Alloc { pages: 2, misalign: Misalign(0) }];
    let stats = run_swa(&ops, 64, 8, 4).unwrap(); // window: 2 pages
    assert_eq!((stats.get("alloc: out of window memory"), stats.get("alloc: ok")), (1, 1));
    let stats = run_swa(&ops, 8, 64, 4).unwrap(); // full: 2 pages
    assert_eq!((stats.get("alloc: out of memory"), stats.get("alloc: ok")), (1, 1));
    let mut model = SwaModel::new(64, 8, 4);
    assert!(model.alloc(12).is_err());
    assert_eq!((model.full().available(), model.window_available()), (64, 8));
}

/// Groups: window pages released inside a group are free but not available until the
/// group ends, like the full pool's; `free_swa` inside an open group publishes at once;
/// `check_invariants` holds while the group is open (it counts the window pool's
/// allocated pages, not its published count).
#[test]
fn window_frees_in_a_group_wait_for_its_end() {
    let ops = [
        SwaOp::Alloc { pages: 2, misalign: Misalign(0) },
        SwaOp::Alloc { pages: 2, misalign: Misalign(0) },
        SwaOp::Control(Control::GroupBegin),
        SwaOp::FreeLive { handle: 0 },
        SwaOp::FreeSwa(SwaFreeOp::Part { handle: 0, take: 0 }),
        SwaOp::Alloc { pages: 1, misalign: Misalign(0) },
        SwaOp::Control(Control::GroupEnd),
    ];
    for ps in [1, 4] {
        let stats = run_swa(&ops, 32 * ps as usize, 6 * ps as usize, ps).unwrap();
        assert_eq!(stats.get("group free: ok"), 1);
        assert_eq!(stats.get("free_swa: ok"), 1);
        assert_eq!(stats.get("alloc: ok"), 3, "{stats:?}");
    }
    let a = SwaAllocator::new(32, 8, 4).unwrap();
    let mut x = [0u32; 4];
    let mut y = [0u32; 4];
    a.alloc(&mut x).unwrap();
    a.alloc(&mut y).unwrap();
    let mut g = a.free_group();
    g.free(&x).unwrap();
    assert_eq!((a.window_available_size(), a.window_slot(x[0])), (0, None));
    a.check_invariants().unwrap();
    assert_eq!(a.free_swa(&y).unwrap(), 4);
    assert_eq!(a.window_available_size(), 4);
    a.check_invariants().unwrap();
    assert_eq!(g.end(), 4);
    // `y`'s full page stays allocated: only its window part went.
    assert_eq!((a.full_available_size(), a.window_available_size()), (28, 8));
    a.free(&y).unwrap();
    assert_eq!((a.full_available_size(), a.window_available_size()), (32, 8));
    a.check_invariants().unwrap();
}

/// A refused free changes nothing in either pool, including the window part of the
/// batch's valid slots; a page size 1 batch naming a slot twice frees it once and
/// releases its window part once.
#[test]
fn refused_frees_keep_window_parts() {
    let a = SwaAllocator::new(32, 16, 4).unwrap();
    let mut x = [0u32; 8];
    a.alloc(&mut x).unwrap();
    let e = a.free(&[x[0], x[4], 31 * 4]).unwrap_err();
    assert_eq!(e.kind, FreeErrorKind::OutOfRange { first: 4, last: 35 });
    assert_eq!((a.window_slot(x[0]), a.window_slot(x[4])), (Some(x[0]), Some(x[4])));
    assert_eq!(a.window_available_size(), 8);
    let mut g = a.free_group();
    assert!(g.free_pages(1, 3).is_err()); // page 3 is free
    assert_eq!(a.window_slot(x[0]), Some(x[0]));
    g.free_pages(1, 2).unwrap();
    assert_eq!(a.window_slot(x[0]), None);
    g.end();
    a.check_invariants().unwrap();

    let t = SwaAllocator::new(8, 8, 1).unwrap();
    let mut s = [0u32; 3];
    t.alloc(&mut s).unwrap();
    let e = t.free(&[s[0], s[1], s[0]]).unwrap_err();
    assert!(e.rest_freed && e.kind == FreeErrorKind::NotAllocated);
    assert_eq!((t.full_available_size(), t.window_available_size()), (7, 7));
    t.check_invariants().unwrap();
    let ops = [SwaOp::Alloc { pages: 3, misalign: Misalign(0) }, SwaOp::Free(FreeOp::WithDuplicate { handle: 0 })];
    assert_eq!(run_swa(&ops, 8, 8, 1).unwrap().get("free: duplicate in batch"), 1);
}
