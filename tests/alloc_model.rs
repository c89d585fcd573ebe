#![cfg(not(loom))]
//! `TokenAllocator` and `PagedAllocator` against the sequential reference model
//! (`kvpool::models`), plus DESIGN.md's worked examples and the edge cases of issue 2.

use kvpool::alloc::{expand_decode, expand_extend};
use kvpool::models::{ops_from_bytes, run, run_allocator, AllocModel, Scenario};
use kvpool::{
    AllocError, ConfigError, FreeError, FreeErrorKind, InvalidInput, KvAllocator, OutOfMemory, PagedAllocator,
    TokenAllocator, Unit,
};
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };
/// Op bytes per case: about 3 bytes per op, so up to ~700 ops.
const MAX_BYTES: usize = 2048;

fn check(r: Result<(), String>) -> Result<(), TestCaseError> {
    r.map_err(TestCaseError::fail)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn token_allocator_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 1))?;
    }

    #[test]
    fn paged_allocator_page_size_1_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run_allocator(PagedAllocator::new(70, 1).unwrap(), &ops_from_bytes(&bytes)).map(drop))?;
    }

    #[test]
    fn paged_allocator_page_size_2_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 2))?;
    }

    #[test]
    fn paged_allocator_page_size_3_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 3))?;
    }

    #[test]
    fn paged_allocator_page_size_4_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 4))?;
    }

    #[test]
    fn paged_allocator_page_size_16_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 16))?;
    }

    #[test]
    fn paged_allocator_page_size_64_matches_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        check(run(&ops_from_bytes(&bytes), 64))?;
    }

    /// Small pools of every size from empty to three bitmap words, any page size: full
    /// pools, exact-capacity and one-over requests happen often here.
    #[test]
    fn small_pools_match_model(
        pages in 0u32..=130,
        page_size in prop::sample::select(vec![1u32, 2, 3, 4, 5, 7, 16, 64]),
        extra in 0u32..64,
        bytes in vec(any::<u8>(), 0..MAX_BYTES),
    ) {
        let size = (pages * page_size + extra % page_size) as usize;
        let ops = ops_from_bytes(&bytes);
        if page_size == 1 {
            check(run_allocator(TokenAllocator::new(size).unwrap(), &ops).map(drop))?;
        } else {
            check(run_allocator(PagedAllocator::new(size, page_size).unwrap(), &ops).map(drop))?;
        }
    }

    /// Long extends on large fragmented pools: stretches of many whole words, runs that
    /// continue across words, prefixes' partial pages, last pages cut short, batches of
    /// one to four requests. The allocator writes the slots straight from its claim;
    /// here they must equal the pure expansion (`expand_extend`) of the pages a twin
    /// pool in the same state hands out (`reserve_pages`), and a single request's
    /// `alloc_extend_runs` must report exactly the breaks of what it wrote.
    #[test]
    fn long_extends_write_the_expansion_of_the_claimed_pages(
        page_size in prop::sample::select(vec![1u32, 2, 3, 16, 64]),
        blocks in vec((prop_oneof![1u32..90, 500u32..1500], any::<bool>()), 1..12),
        batches in vec(vec((0u32..200, 1u32..9000), 1..5), 1..8),
    ) {
        let size = (8192 * page_size) as usize;
        let ps = page_size as usize;
        let (pool, twin) = (PagedAllocator::new(size, page_size).unwrap(), PagedAllocator::new(size, page_size).unwrap());
        // Fragment both alike: fill the pool with blocks of pages (the sizes cycle), then
        // free the blocks not kept (their kept flags cycle too).
        let mut held = Vec::new();
        for &(pages, keep) in blocks.iter().cycle() {
            let (mut a, mut b) = (vec![0u32; pages as usize * ps], vec![0u32; pages as usize * ps]);
            if pool.alloc(&mut a).is_err() {
                break;
            }
            twin.alloc(&mut b).unwrap();
            prop_assert_eq!(&a, &b);
            held.push((a, keep));
        }
        // A block of consecutive slots is freed as one range of pages, which parks the
        // aligned 512-page blocks it covers (the claims below then hand those out whole).
        for (a, keep) in &held {
            if !keep {
                if a.windows(2).all(|w| w[1] == w[0] + 1) {
                    let (first, pages) = (pool.page_of(a[0]), (a.len() / ps) as u32);
                    for p in [&pool, &twin] {
                        let mut group = p.free_group();
                        group.free_pages(first, pages).unwrap();
                        group.end();
                    }
                } else {
                    pool.free(a).unwrap();
                    twin.free(a).unwrap();
                }
            }
        }
        for batch in &batches {
            let (mut prefixes, mut seqs, mut last_locs) = (vec![], vec![], vec![]);
            for &(prefix, len) in batch {
                // A prefix ending inside a page needs that page: take a fresh one.
                let last_loc = if prefix as usize % ps == 0 {
                    0
                } else {
                    let (mut a, mut b) = (vec![0u32; ps], vec![0u32; ps]);
                    if pool.alloc(&mut a).is_err() {
                        break;
                    }
                    twin.alloc(&mut b).unwrap();
                    a[prefix as usize % ps - 1]
                };
                prefixes.push(prefix);
                seqs.push(prefix + len);
                last_locs.push(last_loc);
            }
            let n: usize = batch.iter().take(seqs.len()).map(|&(_, len)| len as usize).sum();
            let mut got = vec![0u32; n];
            let mut reported = Vec::new();
            let r = if seqs.len() == 1 {
                pool.alloc_extend_runs(prefixes[0], seqs[0], last_locs[0], &mut got, &mut |p| reported.push(p))
            } else {
                pool.alloc_extend(&prefixes, &seqs, &last_locs, &mut got)
            };
            let plan = kvpool::alloc::plan_extend(page_size, &prefixes, &seqs).unwrap();
            let mut pages = vec![0u32; plan.new_pages];
            match twin.reserve_pages(&mut pages) {
                Ok(()) => {
                    prop_assert!(r.is_ok(), "{:?}", r);
                    let mut want = vec![0u32; n];
                    expand_extend(page_size, &prefixes, &seqs, &last_locs, &pages, &mut want).unwrap();
                    prop_assert_eq!(&got, &want, "prefixes {:?}, seqs {:?}, last_locs {:?}", prefixes, seqs, last_locs);
                    if seqs.len() == 1 {
                        let breaks: Vec<usize> =
                            (1..got.len()).filter(|&i| got[i] != got[i - 1].wrapping_add(1)).collect();
                        prop_assert_eq!(&reported, &breaks);
                    }
                }
                Err(e) => {
                    prop_assert_eq!(r, Err(e));
                    prop_assert!(got.iter().all(|&s| s == 0) && reported.is_empty());
                }
            }
            prop_assert_eq!(pool.available_size(), twin.available_size());
            prop_assert!(pool.check_invariants().is_ok());
        }
    }

    /// The fuzz target's input type, so a fuzz crash can be replayed here too.
    #[test]
    fn scenarios_match_model(bytes in vec(any::<u8>(), 0..MAX_BYTES)) {
        use arbitrary::{Arbitrary, Unstructured};
        if let Ok(s) = Scenario::arbitrary_take_rest(Unstructured::new(&bytes)) {
            check(s.run())?;
        }
    }

    /// The fuzz target's reading and checks (`Checks::Touched`, one structure per
    /// input) agree with the model too.
    #[test]
    fn fuzz_scenarios_match_model(bytes in vec(any::<u8>(), 0..512)) {
        let s = Scenario::from_fuzz_input(&bytes, kvpool::models::MAX_FUZZ_OPS);
        check(s.run_fuzz())?;
        check(s.run_with(kvpool::models::Checks::Touched))?;
    }
}

// ---------------------------------------------------------------------------------
// DESIGN.md's worked examples.

#[test]
fn design_extend_example() {
    let alloc = PagedAllocator::new(256, 4).unwrap();
    let mut first = [0u32; 8];
    alloc.alloc(&mut first).unwrap();
    assert_eq!(first, [4, 5, 6, 7, 8, 9, 10, 11]); // pages 1 and 2
    let mut out = [0u32; 9];
    alloc.alloc_extend(&[1, 3], &[6, 7], &[4, 10], &mut out).unwrap();
    assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
    // pages 3 and 4 were consumed: the next page is 5
    assert_eq!(alloc.available_size(), 256 - 16);
    let mut next = [0u32; 4];
    alloc.alloc(&mut next).unwrap();
    assert_eq!(next, [20, 21, 22, 23]);
    // the model agrees
    let mut m = AllocModel::paged(256, 4);
    m.alloc(8).unwrap();
    assert_eq!(m.alloc_extend(&[1, 3], &[6, 7], &[4, 10], 9).unwrap().slots, out);
}

#[test]
fn design_decode_example() {
    // The pure expansion, exactly as DESIGN.md states it (fresh pool: pages 1 and 2).
    let mut out = [0u32; 3];
    expand_decode(4, &[5, 4, 9], &[0, 2, 0], &[1, 2], &mut out).unwrap();
    assert_eq!(out, [4, 3, 8]);

    // On an allocator, `last_loc = 2` lies in the reserved page 0, which is never
    // allocated, so the allocator refuses it and changes nothing.
    let alloc = PagedAllocator::new(256, 4).unwrap();
    let mut out = [0u32; 3];
    let err = alloc.alloc_decode(&[5, 4, 9], &[0, 2, 0], &mut out).unwrap_err();
    assert_eq!(err, AllocError::Invalid(InvalidInput::BadLastLoc { request: 1, last_loc: 2 }));
    assert_eq!(alloc.available_size(), 256);

    // The same shape with request 1's partial page allocated first (page 1, slot 6
    // at position 2): request 0 gets page 2, request 2 page 3.
    let mut held = [0u32; 4];
    alloc.alloc(&mut held).unwrap();
    alloc.alloc_decode(&[5, 4, 9], &[0, 6, 0], &mut out).unwrap();
    assert_eq!(out, [8, 7, 12]);
    assert_eq!(alloc.available_size(), 256 - 12);
}

#[test]
fn expansion_matches_model_on_design_example() {
    let mut out = [0u32; 9];
    expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3, 4], &mut out).unwrap();
    assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
}

// ---------------------------------------------------------------------------------
// Edge cases.

fn oom(requested: usize, available: usize) -> AllocError {
    AllocError::OutOfMemory(OutOfMemory { requested, available, evictable: None, unit: Unit::Tokens })
}

#[test]
fn size_zero_requests_change_nothing() {
    for ps in [1, 3, 4] {
        let alloc = PagedAllocator::new(12, ps).unwrap();
        alloc.alloc(&mut []).unwrap();
        alloc.alloc_extend(&[], &[], &[], &mut []).unwrap();
        alloc.alloc_extend(&[0, 5], &[0, 5], &[0, 0], &mut []).unwrap(); // nothing grows
        alloc.alloc_decode(&[], &[], &mut []).unwrap();
        assert_eq!(alloc.available_size(), 12 / ps as usize * ps as usize);
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn exact_capacity_and_one_over() {
    // token allocator: slots 1..=10
    let alloc = TokenAllocator::new(10).unwrap();
    let mut over = [7u32; 11];
    assert_eq!(alloc.alloc(&mut over), Err(oom(11, 10)));
    assert_eq!(over, [7; 11]);
    let mut all = [0u32; 10];
    alloc.alloc(&mut all).unwrap();
    assert_eq!(all.to_vec(), (1..=10).collect::<Vec<u32>>());
    assert_eq!(alloc.alloc(&mut [0u32; 1]), Err(oom(1, 0)));

    // paged, page size 3 (not a power of two), 10 tokens: 3 pages, 1 token unused
    let alloc = PagedAllocator::new(10, 3).unwrap();
    assert_eq!((alloc.size(), alloc.num_pages()), (9, 3));
    let mut over = [0u32; 12];
    assert_eq!(alloc.alloc(&mut over), Err(oom(12, 9)));
    let mut all = [0u32; 9];
    alloc.alloc(&mut all).unwrap();
    assert_eq!(all, [3, 4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(alloc.alloc(&mut [0u32; 3]), Err(oom(3, 0)));

    // extend: exact and one over, counted in whole pages
    let alloc = PagedAllocator::new(16, 4).unwrap();
    let mut out = vec![0u32; 17];
    assert_eq!(alloc.alloc_extend(&[0], &[17], &[0], &mut out), Err(oom(20, 16)));
    let mut out = vec![0u32; 16];
    alloc.alloc_extend(&[0, 0], &[9, 7], &[0, 0], &mut out[..16]).unwrap_err(); // 3 + 2 pages > 4
    alloc.alloc_extend(&[0, 0], &[8, 8], &[0, 0], &mut out).unwrap();
    assert_eq!(out, (4..20).collect::<Vec<u32>>());
    assert_eq!(alloc.available_size(), 0);
}

#[test]
fn oom_message_follows_sglang() {
    let alloc = TokenAllocator::new(4).unwrap();
    let e = alloc.alloc(&mut [0u32; 5]).unwrap_err().to_string();
    assert!(e.starts_with("Out of memory. Try to lower your batch size."), "{e}");
    assert!(e.contains("Try to allocate 5 tokens."), "{e}");
    assert!(e.contains("Available tokens: 4"), "{e}");
}

#[test]
fn non_multiple_alloc_on_pages_is_refused() {
    let alloc = PagedAllocator::new(64, 16).unwrap();
    let mut out = [5u32; 17];
    assert_eq!(
        alloc.alloc(&mut out),
        Err(AllocError::Invalid(InvalidInput::NotPageAligned { count: 17, page_size: 16 }))
    );
    assert_eq!(out, [5; 17]);
    assert_eq!(alloc.available_size(), 64);
}

#[test]
fn freeing_empty_lists() {
    let alloc = PagedAllocator::new(16, 4).unwrap();
    alloc.free(&[]).unwrap();
    let mut g = alloc.free_group();
    g.free(&[]).unwrap();
    assert_eq!(g.end(), 0);
    assert_eq!(alloc.available_size(), 16);
}

#[test]
fn double_free_is_detected_and_changes_nothing() {
    // page size 1
    let alloc = TokenAllocator::new(8).unwrap();
    let mut a = [0u32; 3];
    alloc.alloc(&mut a).unwrap();
    alloc.free(&a[..1]).unwrap();
    let e = alloc.free(&a).unwrap_err();
    assert_eq!(e, FreeError { index: 1, kind: FreeErrorKind::NotAllocated, rest_freed: false });
    assert_eq!(alloc.available_size(), 6);
    assert!(alloc.is_allocated(2) && alloc.is_allocated(3));
    // a slot listed twice in one batch: a page named twice, freed once, no error (as
    // two slots of one page at page size 4 below)
    alloc.free(&[2, 3, 2]).unwrap();
    assert_eq!(alloc.available_size(), 8);
    alloc.check_invariants().unwrap();

    // page size 4: any slot of a freed page is a double free
    let alloc = PagedAllocator::new(16, 4).unwrap();
    let mut a = [0u32; 8];
    alloc.alloc(&mut a).unwrap();
    alloc.free(&[5, 6]).unwrap(); // two slots of page 1: one page
    assert_eq!(alloc.available_size(), 12);
    let e = alloc.free(&[9, 7]).unwrap_err();
    assert_eq!(e, FreeError { index: 7, kind: FreeErrorKind::NotAllocated, rest_freed: false });
    assert!(alloc.is_allocated(9));
    assert_eq!(alloc.available_size(), 12);
}

#[test]
fn out_of_range_free_names_the_slot() {
    let alloc = PagedAllocator::new(16, 4).unwrap(); // slots 4..=19
    let mut a = [0u32; 16];
    alloc.alloc(&mut a).unwrap();
    let range = FreeErrorKind::OutOfRange { first: 4, last: 19 };
    for bad in [0, 3, 20, u32::MAX] {
        let e = alloc.free(&[4, bad]).unwrap_err();
        assert_eq!(e, FreeError { index: bad, kind: range, rest_freed: false });
    }
    assert_eq!(alloc.available_size(), 0);
    let alloc = TokenAllocator::new(5).unwrap();
    let e = alloc.free(&[6]).unwrap_err();
    assert_eq!(e.kind, FreeErrorKind::OutOfRange { first: 1, last: 5 });
    assert!(e.to_string().contains("valid indices are 1..=5"), "{e}");
}

#[test]
fn bad_last_loc_is_refused() {
    let alloc = PagedAllocator::new(64, 4).unwrap();
    let mut held = [0u32; 4];
    alloc.alloc(&mut held).unwrap(); // page 1: slots 4..=7
    let mut out = [9u32; 3];
    let bad = |request, last_loc| Err(AllocError::Invalid(InvalidInput::BadLastLoc { request, last_loc }));
    // prefix 2: last prefix token at position 1 of its page
    assert_eq!(alloc.alloc_extend(&[2], &[5], &[6], &mut out), bad(0, 6)); // wrong position
    assert_eq!(alloc.alloc_extend(&[2], &[5], &[9], &mut out), bad(0, 9)); // free page
    assert_eq!(alloc.alloc_extend(&[2], &[5], &[1], &mut out), bad(0, 1)); // reserved page 0
    assert_eq!(alloc.alloc_extend(&[2], &[5], &[u32::MAX], &mut out), bad(0, u32::MAX));
    assert_eq!(alloc.alloc_decode(&[3], &[4], &mut out[..1]), bad(0, 4));
    assert_eq!(out, [9; 3]);
    assert_eq!(alloc.available_size(), 60);
    // the right one works; an aligned prefix never reads last_loc
    alloc.alloc_extend(&[2], &[5], &[5], &mut out).unwrap();
    assert_eq!(out, [6, 7, 8]);
    alloc.alloc_extend(&[4], &[5], &[u32::MAX], &mut out[..1]).unwrap();
    assert_eq!(out[0], 12);
    // page size 1 never reads last_loc
    let tokens = TokenAllocator::new(8).unwrap();
    tokens.alloc_extend(&[2], &[5], &[u32::MAX], &mut out).unwrap();
    assert_eq!(out, [1, 2, 3]);
}

#[test]
fn malformed_batches_are_refused() {
    let alloc = PagedAllocator::new(64, 4).unwrap();
    let mut out = [0u32; 4];
    let invalid = |e| Err(AllocError::Invalid(e));
    assert_eq!(
        alloc.alloc_extend(&[0], &[2, 2], &[0, 0], &mut out),
        invalid(InvalidInput::LengthMismatch { what: "prefix_lens", got: 1, expected: 2 })
    );
    assert_eq!(
        alloc.alloc_extend(&[0, 3], &[2, 2], &[0, 0], &mut out),
        invalid(InvalidInput::PrefixLongerThanSeq { request: 1, prefix_len: 3, seq_len: 2 })
    );
    assert_eq!(
        alloc.alloc_extend(&[0, 0], &[2, 2], &[0], &mut out),
        invalid(InvalidInput::LengthMismatch { what: "last_locs", got: 1, expected: 2 })
    );
    assert_eq!(
        alloc.alloc_extend(&[0, 0], &[2, 1], &[0, 0], &mut out),
        invalid(InvalidInput::OutputLength { got: 4, expected: 3 })
    );
    assert_eq!(alloc.alloc_decode(&[3, 0], &[0, 0], &mut out[..2]), invalid(InvalidInput::EmptyDecode { request: 1 }));
    assert_eq!(alloc.available_size(), 64);
}

#[test]
fn decode_needs_a_page_exactly_at_page_starts() {
    for ps in [2u32, 3, 4, 16] {
        let alloc = PagedAllocator::new(64 * ps as usize, ps).unwrap();
        let mut out = [0u32; 1];
        // a request growing token by token from empty
        let mut last = 0u32;
        for seq in 1..=3 * ps {
            let before = alloc.available_size();
            alloc.alloc_decode(&[seq], &[last], &mut out).unwrap();
            let took_page = before != alloc.available_size();
            assert_eq!(took_page, seq % ps == 1 || ps == 1, "ps {ps} seq {seq}");
            if !took_page {
                assert_eq!(out[0], last + 1);
            }
            last = out[0];
        }
    }
}

#[test]
fn free_group_holds_back_until_end() {
    let alloc = PagedAllocator::new(12, 3).unwrap();
    let mut a = [0u32; 12 / 3 * 3];
    alloc.alloc(&mut a).unwrap();
    let mut g = alloc.free_group();
    g.free(&a[..3]).unwrap();
    g.free(&[a[4]]).unwrap();
    assert_eq!(g.pending_tokens(), 6);
    assert_eq!(alloc.available_size(), 0);
    assert!(alloc.alloc(&mut [0u32; 3]).is_err());
    assert_eq!(g.free(&[a[5]]).unwrap_err().kind, FreeErrorKind::NotAllocated); // same page again
    assert_eq!(g.end(), 6);
    assert_eq!(alloc.available_size(), 6);
    alloc.check_invariants().unwrap();
}

#[test]
fn clear_restores_a_fresh_allocator() {
    let mut alloc = PagedAllocator::new(40, 4).unwrap();
    let mut a = [0u32; 20];
    alloc.alloc(&mut a).unwrap();
    alloc.free(&a[8..12]).unwrap();
    KvAllocator::clear(&mut alloc);
    assert_eq!(alloc.available_size(), 40);
    let mut b = [0u32; 8];
    alloc.alloc(&mut b).unwrap();
    assert_eq!(b, [4, 5, 6, 7, 8, 9, 10, 11]);
}

#[test]
fn constructor_errors() {
    assert_eq!(PagedAllocator::new(16, 0).unwrap_err(), ConfigError::ZeroPageSize);
    // slots must fit in u32: the highest slot is (pages + 1) * page_size - 1
    assert!(matches!(TokenAllocator::new(1 << 32), Err(ConfigError::TooLarge { .. })));
    assert!(matches!(PagedAllocator::new(1 << 32, 1 << 16), Err(ConfigError::TooLarge { .. })));
    // `size / page_size + 1` must not overflow either (audit finding: it panicked with
    // page size 1 and `size == usize::MAX` instead of refusing)
    let too_large = |size: usize, page_size| ConfigError::TooLarge { size: size as u64, page_size };
    assert_eq!(TokenAllocator::new(usize::MAX).unwrap_err(), too_large(usize::MAX, 1));
    assert_eq!(PagedAllocator::new(usize::MAX, 1).unwrap_err(), too_large(usize::MAX, 1));
    assert_eq!(PagedAllocator::new(usize::MAX, u32::MAX).unwrap_err(), too_large(usize::MAX, u32::MAX));
    // the documented limit: with page size 1 the highest slot is `size`, a u32
    assert_eq!(TokenAllocator::new(u32::MAX as usize + 1).unwrap_err(), too_large(1 << 32, 1));
    let top = PagedAllocator::new((1 << 32) - 1, 1 << 16).unwrap(); // the last slot is u32::MAX
    assert_eq!(top.num_pages(), 65535);
    let e = top.free(&[u32::MAX]).unwrap_err();
    assert_eq!(e.kind, FreeErrorKind::NotAllocated); // in range, just not allocated
                                                     // smaller than one page: no pages at all
    let alloc = PagedAllocator::new(3, 4).unwrap();
    assert_eq!(alloc.available_size(), 0);
    assert!(alloc.alloc(&mut [0u32; 4]).is_err());
    assert_eq!(alloc.free(&[4]).unwrap_err().kind, FreeErrorKind::OutOfRange { first: 4, last: 3 });
}

/// The op mix is not vacuous: over a few hundred random sequences every outcome the
/// model distinguishes occurs, for a token allocator and for a paged one.
#[test]
fn op_mix_reaches_every_outcome() {
    use kvpool::models::Stats;
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
        for _ in 0..200 {
            let ops = ops_from_bytes(&bytes());
            let alloc = PagedAllocator::new(40 * ps as usize, ps).unwrap();
            stats.merge(&run_allocator(alloc, &ops).unwrap());
        }
        let mut want = vec![
            "alloc: ok",
            "alloc: ok, empty",
            "alloc: out of memory",
            "alloc_extend: ok",
            "alloc_extend: out of memory",
            "alloc_extend: malformed batch",
            "alloc_decode: ok",
            "alloc_decode: out of memory",
            "alloc_decode: malformed batch",
            "free: ok",
            "free: not allocated",
            "free: out of range",
            "group free: ok",
            "group free: not allocated",
            "group end: published",
            "clear: ok",
        ];
        // a slot named twice: merged at every page size
        want.push("free: ok, slot repeated");
        if ps == 1 {
            // The decode placement at page size 1 (`AllocModel::alloc_decode`).
            want.extend(["alloc_decode: ok, continued a run", "alloc_decode: ok, started a run"]);
        }
        if ps > 1 {
            want.extend([
                "alloc: not page aligned",
                "alloc_extend: ok, filled a partial page",
                "alloc_extend: bad last_loc",
                "alloc_extend: same partial page",
                "alloc_decode: ok, filled a partial page",
                "alloc_decode: bad last_loc",
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
        // successes dominate for the main allocation path
        assert!(stats.get("alloc_extend: ok") > stats.get("alloc_extend: malformed batch"), "{stats:?}");
    }
}

/// The runner itself must notice a structure that disagrees with the model: an
/// allocator that is not fresh is refused before any op runs.
#[test]
fn runner_detects_divergence() {
    let alloc = TokenAllocator::new(8).unwrap();
    alloc.alloc(&mut [0u32; 1]).unwrap();
    let err = run_allocator(alloc, &[]).unwrap_err();
    assert!(err.contains("fresh allocator has 7 available, expected 8"), "{err}");
}

/// Threads run prefill and decode steps on a shared paged allocator (page size 3, not a
/// power of two) and free their requests, some through free groups. Page ownership is
/// tracked in atomics: a page handed to two requests at once fails the test; every
/// request's slots follow its pages.
#[test]
fn threads_never_share_a_page() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Barrier};
    const THREADS: u32 = 4;
    const ROUNDS: usize = if cfg!(miri) { 20 } else { 5_000 };
    const PS: u32 = 3;
    const PAGES: u32 = 120;
    let alloc = Arc::new(PagedAllocator::new((PAGES * PS) as usize, PS).unwrap());
    let owner: Arc<Vec<AtomicU32>> = Arc::new((0..=PAGES).map(|_| AtomicU32::new(0)).collect());
    let start = Arc::new(Barrier::new(THREADS as usize));
    let workers: Vec<_> = (1..=THREADS)
        .map(|t| {
            let (alloc, owner, start) = (Arc::clone(&alloc), Arc::clone(&owner), Arc::clone(&start));
            std::thread::spawn(move || {
                let mut rng = 0x2545_F491u64 * t as u64 + 7;
                let mut next = move |m: u32| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    (rng % m as u64) as u32
                };
                let take = |page: u32| {
                    let prev = owner[page as usize].swap(t, Ordering::Relaxed);
                    assert_eq!(prev, 0, "page {page} handed to thread {t} while thread {prev} held it");
                };
                let mut done = 0usize;
                let mut slots: Vec<u32> = Vec::with_capacity(64);
                start.wait();
                for _ in 0..ROUNDS {
                    // prefill a request of 1..=40 tokens, then decode a few steps
                    let seq = 1 + next(40);
                    let mut out = vec![0u32; seq as usize];
                    if alloc.alloc_extend(&[0], &[seq], &[0], &mut out).is_err() {
                        continue;
                    }
                    for (k, &s) in out.iter().enumerate() {
                        if k as u32 % PS == 0 {
                            take(s / PS);
                        }
                        assert_eq!(s % PS, k as u32 % PS, "slot {s} at position {k}");
                    }
                    slots.clear();
                    slots.extend_from_slice(&out);
                    for len in seq..seq + next(8) {
                        // decode the token after `len`: a new page exactly when `len` fills one
                        let mut one = [0u32; 1];
                        let last = *slots.last().unwrap();
                        if alloc.alloc_decode(&[len + 1], &[last], &mut one).is_err() {
                            break;
                        }
                        if len % PS == 0 {
                            take(one[0] / PS);
                        } else {
                            assert_eq!(one[0], last + 1);
                        }
                        slots.push(one[0]);
                    }
                    for &s in slots.iter().step_by(PS as usize) {
                        let prev = owner[(s / PS) as usize].swap(0, Ordering::Relaxed);
                        assert_eq!(prev, t, "page {} changed owner while held", s / PS);
                    }
                    if next(2) == 0 {
                        alloc.free(&slots).unwrap();
                    } else {
                        let mut g = alloc.free_group();
                        g.free(&slots).unwrap();
                        g.end();
                    }
                    done += 1;
                }
                done
            })
        })
        .collect();
    let done: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(done > 0);
    assert_eq!(alloc.available_size(), (PAGES * PS) as usize);
    alloc.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------
// Frees are all or nothing, and a repeat is no error at any page size (audit finding:
// at page size 1 `free(&[s, s])` used to free `s` and then report an error, while the
// docs promise "nothing is freed on error" and page size > 1 merges repeats).
// ---------------------------------------------------------------------------------

/// A slot named twice in one batch at page size 1 is a page named twice: freed once,
/// no error, exactly as two slots of one page are at a larger page size.
#[test]
fn token_allocator_free_merges_a_repeated_slot() {
    let alloc = TokenAllocator::new(8).unwrap();
    let mut a = [0u32; 2];
    alloc.alloc(&mut a).unwrap();
    alloc.free(&[a[0], a[0]]).unwrap();
    assert_eq!(alloc.available_size(), 7, "freed once");
    assert!(!alloc.is_allocated(a[0]) && alloc.is_allocated(a[1]));
    alloc.check_invariants().unwrap();
    // the same at page size 4: two slots of one page
    let paged = PagedAllocator::new(16, 4).unwrap();
    let mut p = [0u32; 4];
    paged.alloc(&mut p).unwrap();
    paged.free(&[p[0], p[0], p[1]]).unwrap();
    assert_eq!(paged.available_size(), 16);
}

/// Repeats far apart (in other bitmap words, and after the batch's run buffer) and
/// through a free group: still freed once, and the counts stay exact.
#[test]
fn token_allocator_free_merges_distant_repeats() {
    let alloc = TokenAllocator::new(4096).unwrap();
    let mut a = vec![0u32; 4096];
    alloc.alloc(&mut a).unwrap();
    // 3 .. 200 .. 3: another word between; then 60 runs of one slot, each in a word
    // of its own, and a repeat of each (more runs than the batch's run buffer holds)
    let mut batch = vec![3, 200, 3];
    batch.extend((0..60).map(|k| 10 + 64 * k));
    batch.extend((0..60).map(|k| 10 + 64 * k));
    alloc.free(&batch).unwrap();
    assert_eq!(alloc.available_size(), 62);
    let mut g = alloc.free_group();
    g.free(&[4000, 4001, 4000]).unwrap();
    assert_eq!(g.end(), 2);
    assert_eq!(alloc.available_size(), 64);
    alloc.check_invariants().unwrap();
}

/// A refused batch frees nothing, also when it repeats a slot before the bad one (the
/// audit's failing case with the error it used to swallow).
#[test]
fn token_allocator_refused_free_with_repeat_frees_nothing() {
    let alloc = TokenAllocator::new(8).unwrap();
    let mut a = [0u32; 2];
    alloc.alloc(&mut a).unwrap();
    let before = alloc.available_size();
    let e = alloc.free(&[a[0], a[0], 7]).unwrap_err();
    assert_eq!(e, FreeError { index: 7, kind: FreeErrorKind::NotAllocated, rest_freed: false });
    let e = alloc.free(&[a[1], a[1], 9]).unwrap_err();
    assert_eq!((e.index, e.rest_freed), (9, false));
    assert_eq!(alloc.available_size(), before, "a refused free changed the pool");
    assert!(alloc.is_allocated(a[0]) && alloc.is_allocated(a[1]));
    let mut g = alloc.free_group();
    assert!(g.free(&[a[0], a[0], 7]).is_err());
    assert_eq!(g.end(), 0);
    alloc.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------
// One call must not hand the same slot to two requests (audit finding: two requests
// of one batch whose `last_loc`s continue the same partial page were both accepted and
// both given the page's next slots, e.g. `[5, 5]`).
// ---------------------------------------------------------------------------------

fn same_page(earlier: usize, request: usize, last_loc: u32) -> Result<(), AllocError> {
    Err(AllocError::Invalid(InvalidInput::SamePartialPage { earlier, request, last_loc }))
}

#[test]
fn alloc_extend_refuses_two_requests_continuing_one_page() {
    let alloc = PagedAllocator::new(64, 4).unwrap();
    let mut page = [0u32; 4];
    alloc.alloc(&mut page).unwrap(); // page 1: slots 4..8
    let mut out = [0u32; 2];
    assert_eq!(alloc.alloc_extend(&[1, 1], &[2, 2], &[4, 4], &mut out), same_page(0, 1, 4));
    assert_eq!(out, [0, 0]);
    assert_eq!(alloc.available_size(), 60, "nothing allocated");
    // other positions of one page clash too (prefix 1 at slot 4, prefix 2 at slot 5)
    let mut out = [0u32; 4];
    assert_eq!(alloc.alloc_extend(&[1, 2, 0], &[2, 3, 2], &[4, 5, 0], &mut out), same_page(0, 1, 5));
    // requests that do not continue the page (aligned prefix, or no growth) do not count
    let mut out = [0u32; 1];
    alloc.alloc_extend(&[1, 4, 2], &[2, 4, 2], &[4, 7, 5], &mut out).unwrap();
    assert_eq!(out, [5]);
    alloc.check_invariants().unwrap();
}

#[test]
fn alloc_decode_refuses_two_requests_continuing_one_page() {
    let alloc = PagedAllocator::new(64, 4).unwrap();
    let mut page = [0u32; 4];
    alloc.alloc(&mut page).unwrap();
    let mut out = [0u32; 2];
    assert_eq!(alloc.alloc_decode(&[2, 2], &[4, 4], &mut out), same_page(0, 1, 4));
    assert_eq!(out, [0, 0]);
    assert_eq!(alloc.available_size(), 60, "nothing allocated");
    // a request starting a fresh page does not continue one
    alloc.alloc_decode(&[2, 5], &[4, 4], &mut out).unwrap();
    assert_eq!(out, [5, 8]);
}

/// Large batches take the hashed path (and past 2048 continued pages, its chunks): the
/// error names the first request that repeats an earlier one's page, whichever chunk
/// finds it, and a batch of distinct pages goes through.
#[test]
fn large_batches_refuse_a_repeated_partial_page() {
    const N: usize = 5000;
    let alloc = PagedAllocator::new(2 * (N + 8), 2).unwrap();
    let mut held = vec![0u32; 2 * N];
    alloc.alloc(&mut held).unwrap(); // pages 1..=N
                                     // every request holds one token of its own page and grows by one
    let prefix = vec![1u32; N];
    let seq = vec![2u32; N];
    let distinct: Vec<u32> = (0..N).map(|i| held[2 * i]).collect();
    let mut out = vec![0u32; N];
    for n in [17, 100, 129, 2048, 2049, N] {
        let mut locs = distinct[..n].to_vec();
        locs[n - 1] = locs[n / 2];
        let r = alloc.alloc_extend(&prefix[..n], &seq[..n], &locs, &mut out[..n]);
        assert_eq!(r, same_page(n / 2, n - 1, locs[n / 2]), "batch of {n}");
        let r = alloc.alloc_decode(&seq[..n], &locs, &mut out[..n]);
        assert_eq!(r, same_page(n / 2, n - 1, locs[n / 2]), "decode batch of {n}");
    }
    // two repeats: one found by the first chunk's lookups (4000 repeats 100), an
    // earlier one only inside the second chunk (2200 repeats 2100)
    let mut locs = distinct.clone();
    locs[4000] = locs[100];
    locs[2200] = locs[2100];
    assert_eq!(alloc.alloc_extend(&prefix, &seq, &locs, &mut out), same_page(2100, 2200, locs[2100]));
    assert_eq!(alloc.available_size(), 16, "nothing allocated");
    alloc.alloc_extend(&prefix, &seq, &distinct, &mut out).unwrap();
    assert!(out.iter().zip(&distinct).all(|(&o, &l)| o == l + 1));
    alloc.check_invariants().unwrap();
}
