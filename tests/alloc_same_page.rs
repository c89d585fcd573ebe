//! The same-partial-page check of a batch allocation (`InvalidInput::SamePartialPage`):
//! no two requests of one extend or decode batch may continue the same partial page.
//!
//! A proptest compares the allocators' answer with a plain reference (a `HashMap` of
//! the pages continued so far) on random batches with repeats, of 0 to 5,000 requests at
//! page sizes 2, 3, 16 and 64: the same `Ok` / `Err`, and on a repeat the same first
//! repeating `request` and its first `earlier` request.
//!
//! `decode_batches_for_callgrind` (ignored) is the instruction-count harness for the
//! check's cost: `alloc_decode` batches of 16, 256, 1,024 and 4,096 requests at page
//! size 16 (and 1, where the check is skipped), shaped like `benches/alloc.rs`'s decode
//! batches. Run one configuration per process under callgrind, counting only inside
//! `alloc_decode`:
//!
//! ```text
//! cargo test --release --test alloc_same_page --no-run
//! KVPOOL_CG_BATCH=1024 KVPOOL_CG_PAGE=16 valgrind --tool=callgrind \
//!     --toggle-collect='*PagedAllocator*alloc_decode*' target/release/deps/alloc_same_page-* \
//!     --ignored --exact decode_batches_for_callgrind --test-threads 1
//! ```

use std::collections::HashMap;
use std::hint::black_box;

mod alloc_common;

use kvpool::{AllocError, InvalidInput, KvAllocator, PagedAllocator};
use proptest::prelude::*;

/// The reference: first a bad `last_loc` (one that part 1 reads, not an allocated slot at
/// the position the prefix ends at) anywhere in the batch, else the first request
/// continuing a page an earlier request continues, with the first such earlier request.
/// A request continues a page when its prefix ends inside a page and it grows.
fn reference(
    alloc: &PagedAllocator,
    prefix_lens: &[u32],
    seq_lens: &[u32],
    last_locs: &[u32],
) -> Result<(), AllocError> {
    let ps = alloc.page_size();
    let continues = |i: usize| prefix_lens[i] % ps != 0 && seq_lens[i] > prefix_lens[i];
    for (request, &last_loc) in last_locs.iter().enumerate() {
        if continues(request) {
            let good = last_loc % ps == (prefix_lens[request] - 1) % ps && alloc.is_allocated(last_loc);
            if !good {
                return Err(AllocError::Invalid(InvalidInput::BadLastLoc { request, last_loc }));
            }
        }
    }
    let mut first: HashMap<u32, usize> = HashMap::new();
    for (request, &last_loc) in last_locs.iter().enumerate() {
        if !continues(request) {
            continue;
        }
        if let Some(&earlier) = first.get(&(last_loc / ps)) {
            return Err(AllocError::Invalid(InvalidInput::SamePartialPage { earlier, request, last_loc }));
        }
        first.insert(last_loc / ps, request);
    }
    Ok(())
}

/// A random batch over the `HELD` pages the test holds: each request either starts on a
/// page boundary (continues nothing) or continues a held page at the position its prefix
/// ends at, so every `last_loc` passes the `BadLastLoc` check. The pages are drawn from
/// `distinct` of them (few: many repeats, found early; many: rare ones), or, when
/// `distinct` is 0, are all different (`7 * k` modulo `HELD` for the `k`-th request)
/// so that large batches get through whole; then `forced` repeats are planted.
#[derive(Debug, Clone)]
struct Case {
    ps: u32,
    /// Per request: `(continues, page index, prefix pages, growth)`.
    reqs: Vec<(bool, usize, u32, u32)>,
    distinct: usize,
    /// Request `.1` continues request `.0`'s page (indices modulo the batch).
    forced: Vec<(usize, usize)>,
    /// Request `.0`'s `last_loc` (indices modulo the batch) is bad: at the wrong
    /// position of its page (`.1`) or in a page nobody holds.
    bad: Vec<(usize, bool)>,
}

fn case() -> impl Strategy<Value = Case> {
    let ps = prop::sample::select(vec![2u32, 3, 16, 64]);
    let size = prop_oneof![0usize..20, 0usize..300, 0usize..5000, 2000usize..5000];
    let distinct = prop_oneof![Just(0usize), 1usize..6000];
    let forced = prop::collection::vec((any::<usize>(), any::<usize>()), 0..3);
    let bad = prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec((any::<usize>(), any::<bool>()), 1..3)];
    (ps, size, distinct, forced, bad, 1u64..4, any::<u64>()).prop_map(
        |(ps, n, distinct, forced, bad, aligned, seed)| {
            let mut x = seed | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let reqs = (0..n)
                .map(|k| {
                    let r = next();
                    // one request in 4, 2 or 1 (never) starts on a page boundary
                    let continues = aligned == 3 || (r & 3) >= aligned;
                    let page = if distinct == 0 { 7 * k } else { (r >> 8) as usize % distinct };
                    (continues, page, ((r >> 40) % 4) as u32, 1 + ((r >> 50) % 3) as u32)
                })
                .collect();
            Case { ps, reqs, distinct, forced, bad }
        },
    )
}

/// Pages `1..=HELD` of every page size's allocator are held by the test.
const HELD: usize = 6000;

/// Pages from here on are never allocated (a batch takes at most 10,000 fresh pages).
const NOT_HELD: usize = HELD + 20_000;

fn allocators() -> Vec<(u32, PagedAllocator, Vec<u32>)> {
    [2u32, 3, 16, 64]
        .into_iter()
        .map(|ps| {
            let alloc = PagedAllocator::new((HELD + 6 * 5000) * ps as usize, ps).unwrap();
            let mut held = vec![0u32; HELD * ps as usize];
            alloc.alloc(&mut held).unwrap();
            let pages: Vec<u32> = held.iter().step_by(ps as usize).map(|&s| s / ps).collect();
            (ps, alloc, pages)
        })
        .collect()
}

fn run_case(c: &Case, alloc: &PagedAllocator, pages: &[u32]) -> Result<(), TestCaseError> {
    let ps = c.ps;
    let n = c.reqs.len();
    let mut page_of: Vec<Option<usize>> = c.reqs.iter().map(|&(cont, p, _, _)| cont.then_some(p)).collect();
    for &(a, b) in &c.forced {
        let (a, b) = (a % n.max(1), b % n.max(1));
        if a != b {
            let p = page_of[a].unwrap_or(c.distinct + 1);
            page_of[a] = Some(p);
            page_of[b] = Some(p);
        }
    }
    let (mut prefix_lens, mut seq_lens, mut last_locs) = (vec![], vec![], vec![]);
    for (i, &(_, _, prefix_pages, grow)) in c.reqs.iter().enumerate() {
        let (prefix, last_loc) = match page_of[i] {
            // ends inside the page: position 1 + i % (ps - 1) of ps
            Some(p) => {
                let pos = 1 + (i as u32) % (ps - 1);
                (prefix_pages * ps + pos, pages[p % HELD] * ps + pos - 1)
            }
            None => (prefix_pages * ps, (i as u32).wrapping_mul(2_654_435_761)),
        };
        prefix_lens.push(prefix);
        seq_lens.push(prefix + grow);
        last_locs.push(last_loc);
    }
    for &(i, wrong_position) in &c.bad {
        if n > 0 {
            let loc = &mut last_locs[i % n];
            // x ^ 1 is another position of x's page, or of the next one (page size 3)
            *loc = if wrong_position { *loc ^ 1 } else { (NOT_HELD as u32 + (i % 1000) as u32) * ps };
        }
    }
    let expected = reference(alloc, &prefix_lens, &seq_lens, &last_locs);
    let before = alloc.available_size();
    let new_tokens: usize = seq_lens.iter().zip(&prefix_lens).map(|(s, p)| (s - p) as usize).sum();
    let mut out = vec![0u32; new_tokens];
    let r = alloc.alloc_extend(&prefix_lens, &seq_lens, &last_locs, &mut out);
    prop_assert_eq!(&r, &expected, "extend, page size {}, batch {}", ps, n);
    if r.is_ok() {
        free_fresh(alloc, &out, ps, pages);
    } else {
        prop_assert!(out.iter().all(|&s| s == 0), "a refused extend wrote its output");
    }
    prop_assert_eq!(alloc.available_size(), before);

    // Decode: prefix = seq - 1 for every request.
    let dseq: Vec<u32> = prefix_lens.iter().map(|&p| p + 1).collect();
    let expected = reference(alloc, &prefix_lens, &dseq, &last_locs);
    let mut out = vec![0u32; n];
    let r = alloc.alloc_decode(&dseq, &last_locs, &mut out);
    prop_assert_eq!(&r, &expected, "decode, page size {}, batch {}", ps, n);
    if r.is_ok() {
        free_fresh(alloc, &out, ps, pages);
    } else {
        prop_assert!(out.iter().all(|&s| s == 0), "a refused decode wrote its output");
    }
    prop_assert_eq!(alloc.available_size(), before);
    Ok(())
}

/// Free the slots of `out` that lie outside the held pages.
fn free_fresh(alloc: &PagedAllocator, out: &[u32], ps: u32, held: &[u32]) {
    let last_held = *held.last().unwrap();
    let fresh: Vec<u32> = out.iter().copied().filter(|&s| s / ps > last_held).collect();
    alloc.free(&fresh).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn same_partial_page_matches_reference(c in case()) {
        thread_local! {
            static ALLOCS: Vec<(u32, PagedAllocator, Vec<u32>)> = allocators();
        }
        ALLOCS.with(|all| {
            let (_, alloc, pages) = all.iter().find(|a| a.0 == c.ps).unwrap();
            run_case(&c, alloc, pages)
        })?;
    }
}

/// Requests `.1` continuing request `.0`'s page, and a request with a bad `last_loc`.
type Shape = (Vec<(usize, usize)>, Option<usize>);

/// Repeats at the edges of the check's strategies: the first and last request, batch
/// sizes around every table size and past the largest table's half (4,096 entries:
/// chunks), several repeats (the first repeating request wins, and names the first
/// earlier request of its page), and a bad `last_loc` before, between or after them
/// (which wins over any repeat).
#[test]
fn same_partial_page_edges() {
    let all = allocators();
    for (ps, alloc, pages) in &all {
        let ps = *ps;
        let sizes = [2usize, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 2047, 2048];
        for n in sizes.into_iter().chain([2049, 2100, 3000, 4096, 4097, 5000]) {
            let prefix = vec![1u32; n];
            let seq = vec![2u32; n];
            let distinct: Vec<u32> = (0..n).map(|i| pages[i] * ps).collect();
            let shapes: Vec<Shape> = vec![
                (vec![], None),
                (vec![], Some(n - 1)),
                (vec![(0, n - 1)], None),
                (vec![(0, 1)], None),
                (vec![(n - 2, n - 1)], None),
                (vec![(n / 2, n - 1), (0, n / 2 + 1)], None),
                (vec![(0, n - 1), (1, n - 1), (n / 3, n / 3 + 1)], None),
                // a repeat found by looking up the first chunk, one inside a later one
                (vec![(10, n - 2), (2060, 2070)], None),
                (vec![(10, n - 2), (2060, 2070)], Some(n - 1)),
                (vec![(0, 2100)], Some(2200)),
                (vec![(0, 1)], Some(n - 1)),
                (vec![(0, n - 1)], Some(n / 2)),
            ];
            for (repeats, bad) in shapes {
                let mut locs = distinct.clone();
                for &(a, b) in &repeats {
                    if a < b && b < n {
                        locs[b] = locs[a];
                    }
                }
                if let Some(i) = bad.filter(|&i| i < n) {
                    locs[i] ^= 1; // the wrong position of its page
                }
                let expected = reference(alloc, &prefix, &seq, &locs);
                let mut out = vec![0u32; n];
                let before = alloc.available_size();
                let r = alloc.alloc_decode(&seq, &locs, &mut out);
                assert_eq!(r, expected, "decode, page size {ps}, batch {n}, repeats {repeats:?}, bad {bad:?}");
                if r.is_ok() {
                    free_fresh(alloc, &out, ps, pages);
                }
                let r = alloc.alloc_extend(&prefix, &seq, &locs, &mut out);
                assert_eq!(r, expected, "extend, page size {ps}, batch {n}, repeats {repeats:?}, bad {bad:?}");
                if r.is_ok() {
                    free_fresh(alloc, &out, ps, pages);
                }
                assert_eq!(alloc.available_size(), before);
            }
        }
    }
}

/// The check takes no heap memory at any batch size (its tables are on the stack),
/// through the chunks of the largest batches and on every error.
#[test]
fn check_does_not_allocate() {
    let all = allocators();
    for (ps, alloc, pages) in &all {
        let ps = *ps;
        for n in [2usize, 16, 100, 1000, 2048, 5000] {
            let prefix = vec![1u32; n];
            let seq = vec![2u32; n];
            let mut locs: Vec<u32> = (0..n).map(|i| pages[i] * ps).collect();
            let mut out = vec![0u32; n];
            let mut fresh = Vec::with_capacity(n);
            alloc_common::assert_no_alloc("decode", || alloc.alloc_decode(&seq, &locs, &mut out)).unwrap();
            let last_held = *pages.last().unwrap();
            fresh.extend(out.iter().copied().filter(|&s| s / ps > last_held));
            alloc.free(&fresh).unwrap();
            locs[n - 1] = locs[n / 3];
            let r = alloc_common::assert_no_alloc("decode (repeat)", || alloc.alloc_decode(&seq, &locs, &mut out));
            assert!(matches!(r, Err(AllocError::Invalid(InvalidInput::SamePartialPage { .. }))));
            let r =
                alloc_common::assert_no_alloc("extend (repeat)", || alloc.alloc_extend(&prefix, &seq, &locs, &mut out));
            assert!(matches!(r, Err(AllocError::Invalid(InvalidInput::SamePartialPage { .. }))));
            locs[n - 1] ^= 1;
            let r =
                alloc_common::assert_no_alloc("decode (bad last_loc)", || alloc.alloc_decode(&seq, &locs, &mut out));
            assert!(matches!(r, Err(AllocError::Invalid(InvalidInput::BadLastLoc { .. }))));
        }
    }
}

/// xorshift64*: the same batches every run (as `benches/alloc.rs`).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// The callgrind harness (see the module docs): `KVPOOL_CG_BATCH` requests (default
/// 1024) at page size `KVPOOL_CG_PAGE` (default 16), `KVPOOL_CG_ITERS` decode batches
/// (default 100), each followed by the free of its fresh pages. As in
/// `benches/alloc.rs`, a request starts a new page when `seq % ps == 1` (every 16th at
/// page size 16); the others continue a held page of their own. With `KVPOOL_CG_EXTEND`
/// set, the same batches go through `alloc_extend` (prefix `seq - 1`; count inside
/// `*PagedAllocator*alloc_extend*` then).
#[test]
#[ignore = "a harness for callgrind: run by hand"]
fn decode_batches_for_callgrind() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let requests = env("KVPOOL_CG_BATCH", 1024);
    let ps = env("KVPOOL_CG_PAGE", 16) as u32;
    let iters = env("KVPOOL_CG_ITERS", 100);
    let alloc = PagedAllocator::new(1 << 20, ps).unwrap();
    let mut rng = Rng(0x5EED_0000 + requests as u64);
    let seq_lens: Vec<u32> =
        (0..requests as u32).map(|i| 16 * (1 + rng.below(200) as u32) + 1 + (i * 7) % 16).collect();
    let mut last_locs = Vec::with_capacity(requests);
    for &seq in &seq_lens {
        let prefix = seq - 1;
        if prefix % ps == 0 {
            last_locs.push(0);
        } else {
            let mut page = vec![0u32; ps as usize];
            alloc.alloc(&mut page).unwrap();
            last_locs.push(page[0] + (prefix - 1) % ps);
        }
    }
    let fresh: Vec<usize> = (0..requests).filter(|&i| (seq_lens[i] - 1) % ps == 0).collect();
    let mut out = vec![0u32; requests];
    let mut scratch = vec![0u32; requests];
    let extend = std::env::var_os("KVPOOL_CG_EXTEND").is_some();
    let prefix_lens: Vec<u32> = seq_lens.iter().map(|&s| s - 1).collect();
    let mut step = |out: &mut [u32]| {
        if extend {
            alloc.alloc_extend(black_box(&prefix_lens), black_box(&seq_lens), black_box(&last_locs), out).unwrap();
        } else {
            alloc.alloc_decode(black_box(&seq_lens), black_box(&last_locs), out).unwrap();
        }
        for (k, &i) in fresh.iter().enumerate() {
            scratch[k] = out[i];
        }
        alloc.free(&scratch[..fresh.len()]).unwrap();
    };
    if std::env::var_os("KVPOOL_CG_TIME").is_none() {
        for _ in 0..iters {
            step(&mut out);
        }
        black_box(&out);
        return;
    }
    // Timing mode (not for callgrind): 31 rounds of `iters` batches, each batch
    // allocated and freed; the median round's time per batch, allocation and free.
    let mut rounds: Vec<f64> = (0..31)
        .map(|_| {
            let t = std::time::Instant::now();
            for _ in 0..iters {
                step(&mut out);
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    println!(
        "decode batch {requests} page {ps}: {:.0} ns per batch (median of 31 rounds; min {:.0})",
        rounds[15], rounds[0]
    );
}
