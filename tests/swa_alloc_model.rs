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

    /// Long extends on large, finely fragmented pools (up to hundreds of stretches of
    /// claimed pages, past the 256 the allocator maps with one window claim): the full
    /// slots equal the expansion of the pages a twin full pool hands out, each new full
    /// page maps to the window page a twin window pool hands out in the same order (in
    /// the same claims), and a single request's breaks are exactly those of what it
    /// wrote.
    #[test]
    fn long_extends_map_claimed_pages_in_order(
        page_size in prop::sample::select(vec![1u32, 2, 16]),
        blocks in vec((1u32..12, any::<bool>()), 1..12),
        batches in vec(vec((0u32..100, 1u32..6000), 1..4), 1..6),
    ) {
        use kvpool::alloc::expand_extend;
        let ps = page_size as usize;
        let (full_size, window_size) = (4096 * ps, 5000 * ps);
        let swa = SwaAllocator::new(full_size, window_size, page_size).unwrap();
        let full = kvpool::PagedAllocator::new(full_size, page_size).unwrap();
        // The window pool never parks blocks (a plain one does at page size 1).
        let window = kvpool::models::swa_alloc::window_twin(window_size, page_size).unwrap();
        // Fragment all three alike: fill with blocks (sizes cycle), free those not kept.
        let mut held = Vec::new();
        for &(pages, keep) in blocks.iter().cycle() {
            let n = pages as usize * ps;
            let (mut a, mut f, mut w) = (vec![0u32; n], vec![0u32; n], vec![0u32; n]);
            if swa.alloc(&mut a).is_err() {
                break;
            }
            full.alloc(&mut f).unwrap();
            window.alloc(&mut w).unwrap();
            prop_assert_eq!(&a, &f);
            let mapped: Vec<u32> = a.iter().map(|&s| swa.window_slot(s).unwrap()).collect();
            prop_assert_eq!(&mapped, &w);
            held.push((a, w, keep));
        }
        for (a, w, keep) in &held {
            if !keep {
                swa.free(a).unwrap();
                full.free(a).unwrap();
                window.free(w).unwrap();
            }
        }
        // Window slots mapped to live full pages: those of the held blocks, then each
        // batch's.
        let mut window_used: std::collections::HashSet<u32> =
            held.iter().filter(|h| h.2).flat_map(|h| h.1.iter().copied()).collect();
        for batch in &batches {
            // Prefixes of whole pages only (no held partial page to continue).
            let prefixes: Vec<u32> = batch.iter().map(|&(p, _)| p / page_size * page_size).collect();
            let seqs: Vec<u32> = batch.iter().zip(&prefixes).map(|(&(_, len), &p)| p + len).collect();
            let last_locs = vec![0u32; batch.len()];
            let n: usize = batch.iter().map(|&(_, len)| len as usize).sum();
            let mut got = vec![0u32; n];
            let mut reported = Vec::new();
            let r = if batch.len() == 1 {
                swa.alloc_extend_runs(prefixes[0], seqs[0], 0, &mut got, &mut |p| reported.push(p)).map(drop)
            } else {
                swa.alloc_extend(&prefixes, &seqs, &last_locs, &mut got)
            };
            let plan = kvpool::alloc::plan_extend(page_size, &prefixes, &seqs).unwrap();
            let (mut pages, mut wpages) = (vec![0u32; plan.new_pages], vec![0u32; plan.new_pages]);
            if window.available_size() < plan.new_pages * ps || full.reserve_pages(&mut pages).is_err() {
                prop_assert!(r.is_err());
                break;
            }
            // The window pages come in one claim per 256 stretches of full pages (a
            // stretch: consecutive pages of one bitmap word).
            let starts: Vec<usize> = (0..pages.len())
                .filter(|&i| i == 0 || pages[i] != pages[i - 1] + 1 || (pages[i] - 1) % 64 == 0)
                .collect();
            let mut from = 0;
            for chunk in starts.chunks(256).skip(1).map(|c| c[0]).chain([pages.len()]) {
                window.reserve_pages(&mut wpages[from..chunk]).unwrap();
                from = chunk;
            }
            prop_assert!(r.is_ok(), "{:?}", r);
            let mut want = vec![0u32; n];
            expand_extend(page_size, &prefixes, &seqs, &last_locs, &pages, &mut want).unwrap();
            prop_assert_eq!(&got, &want);
            // The first claim (up to 256 stretches) is one reservation in both: its pages
            // match the twin's one for one. A longer batch claims the rest of its one
            // reservation in further parts, which may start where the last part ended
            // while the twin's fresh reservations restart at the pool's hint: past the
            // first claim the pages need only be fresh and distinct, and as many.
            let first_claim = starts.get(256).copied().unwrap_or(pages.len());
            for (&p, &w) in pages[..first_claim].iter().zip(&wpages) {
                prop_assert_eq!(swa.window_slot(p * page_size), Some(w * page_size), "full page {}", p);
            }
            for &p in &pages {
                let w = swa.window_slot(p * page_size);
                prop_assert!(w.is_some(), "full page {} has no window page", p);
                prop_assert!(window_used.insert(w.unwrap()), "window slot {:?} mapped twice", w);
            }
            prop_assert_eq!(swa.window_available_size(), window.available_size());
            if batch.len() == 1 {
                let breaks: Vec<usize> = (1..got.len()).filter(|&i| got[i] != got[i - 1].wrapping_add(1)).collect();
                prop_assert_eq!(&reported, &breaks);
            }
            prop_assert!(swa.check_invariants().is_ok());
        }
    }

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
        // a slot named twice: merged at every page size
        want.push("free: ok, slot repeated");
        if ps > 1 {
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
        // successes (fresh pages only, or a partial page filled first) dominate for the
        // main allocation path
        let ok = stats.get("alloc_extend: ok") + stats.get("alloc_extend: ok, filled a partial page");
        assert!(ok > stats.get("alloc_extend: malformed batch"), "{stats:?}");
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
    // a slot named twice is freed once in both pools, with no error (repeats merge)
    t.free(&[s[0], s[1], s[0]]).unwrap();
    assert_eq!((t.full_available_size(), t.window_available_size()), (7, 7));
    t.check_invariants().unwrap();
    let ops = [SwaOp::Alloc { pages: 3, misalign: Misalign(0) }, SwaOp::Free(FreeOp::WithDuplicate { handle: 0 })];
    assert_eq!(run_swa(&ops, 8, 8, 1).unwrap().get("free: ok, slot repeated"), 1);
}
