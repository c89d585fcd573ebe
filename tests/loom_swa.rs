#![cfg(all(loom, not(shuttle)))]
//! Loom models of `SwaAllocator`, the dual allocator of sliding-window models: the two
//! pools' reservations, the full-to-window mapping, `free_swa` and free groups under
//! every interleaving of two threads. Run with `scripts/loom.sh loom_swa`.
//!
//! Window pages are owned through loom `UnsafeCell`s, as in `loom_alloc.rs`: a window
//! page with two holders at once, or handed over without a happens-before edge, is a
//! data race that loom reports. Each model also checks the mapping itself (the new
//! owner's entries are intact, a freed page's are clear), both pools' available counts
//! (exact once the threads are joined) and `check_invariants()`.
//!
//! | model                                   | what it proves                                          |
//! |-----------------------------------------|---------------------------------------------------------|
//! | `window_pool_short_one_wins`            | page size 1, room in the window pool for one of two allocations (an `alloc` and an `alloc_decode`): exactly one succeeds, the other is refused in window tokens and gives its full reservation back |
//! | `full_pool_short_one_wins`              | page size 2, room in the full pool for one: exactly one succeeds, the other is refused in tokens and never touches the window pool; the winner's mapping is whole |
//! | `refused_reservation_is_given_back`     | page size 1, an allocation the window pool can never serve holds the full pool for a moment: a racing allocation may be refused meanwhile (both fail), and afterwards nothing of either pool is missing |
//! | `free_races_alloc_reusing_the_page`     | page size 2: a free races an allocation that can take the freed full page before the free's group ends; the free's mapping clear never clobbers the new owner's mapping |
//! | `group_free_races_extend`               | page size 2: a free group (a slot free and a range free) races an `alloc_extend` that fills a partial page and needs a fresh one: the window pages freed in the group count only when it ends (refused before, in window tokens), the full page may be one the group freed, the partial page's mapping is untouched |
//! | `free_swa_races_alloc_of_its_window_page` | `free_swa` releases a window page that a racing allocation takes: one mapping per window page, the released page's entries clear |
//! | `double_free_frees_each_part_once`      | page size 1, two threads free the same slot (a caller's double free): the window page and the full slot are freed exactly once, exactly one free is refused |
//! | `double_free_of_a_page_frees_each_part_once` | page size 2 (a merging free): the same, except that both frees may return `Ok` (the full pool merges a racing repeat of a page, as it does within a batch); never both refused |
//! | `free_swa_races_free`                   | `free_swa` and `free` of the same page: the window page is freed once, by whichever clears the mapping first; `free_swa` returns the window tokens it freed, 0, or not-allocated |

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use kvpool::alloc::SwaAllocator;
use kvpool::{AllocError, FreeErrorKind, KvAllocator, OutOfMemory, Unit};
use loom_common::Outcomes;

/// One loom-tracked cell per window page: the current holder's tag.
struct PageOwners(Vec<UnsafeCell<usize>>);

impl PageOwners {
    fn new(pages: u32) -> Self {
        PageOwners((0..=pages).map(|_| UnsafeCell::new(0)).collect())
    }

    fn claim(&self, page: u32, tag: usize) {
        // SAFETY: loom checks this access; two holders of one page at once is the bug
        // these models look for, and loom reports it instead of racing.
        self.0[page as usize].with_mut(|p| unsafe { *p = tag });
    }

    fn check(&self, page: u32, tag: usize) {
        // SAFETY: as in `claim`.
        let held = self.0[page as usize].with(|p| unsafe { *p });
        assert_eq!(held, tag, "window page {page} was handed to someone else while held");
    }
}

/// The out-of-memory refusal of `e`, or panic on anything else.
fn oom(e: &AllocError) -> OutOfMemory {
    *e.out_of_memory().unwrap_or_else(|| panic!("expected out of memory, got {e:?}"))
}

/// Window page of full slot `slot`, asserting that every slot of its full page maps to
/// the matching slot of one window page.
fn window_page_of(alloc: &SwaAllocator, slot: u32, ps: u32) -> u32 {
    let first = slot / ps * ps;
    let w = alloc.window_slot(first).unwrap_or_else(|| panic!("full slot {first} lost its window slot"));
    assert_eq!(w % ps, 0, "full slot {first} maps to window slot {w}, not a page start");
    for k in 1..ps {
        assert_eq!(alloc.window_slot(first + k), Some(w + k), "full page of slot {first} maps partly");
    }
    w / ps
}

/// Page size 1, full pool 2 tokens, window pool 1: room in the window pool for one
/// of the two. One thread `alloc`s a token, the other `alloc_decode`s a new request
/// (one fresh page). Both reserve the full pool (it has room for both); the window
/// reservation decides, and whoever holds it has its full reservation already, so
/// exactly one succeeds. The loser gives its full reservation back.
#[test]
fn window_pool_short_one_wins() {
    let outcomes = Outcomes::new(&["alloc won", "decode won"]);
    let seen = outcomes.clone();
    loom_common::model("window_pool_short_one_wins", move || {
        let alloc = Arc::new(SwaAllocator::new(2, 1, 1).unwrap());
        let owners = Arc::new(PageOwners::new(1));
        let t = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 1];
                let r = alloc.alloc(&mut out).map(|()| out[0]);
                if let Ok(slot) = r {
                    owners.claim(window_page_of(&alloc, slot, 1), 1);
                } else {
                    assert_eq!(out, [u32::MAX], "a refused alloc wrote its buffer");
                }
                r
            })
        };
        let mut out = [u32::MAX; 1];
        let decoded = alloc.alloc_decode(&[1], &[0], &mut out).map(|()| out[0]);
        if let Ok(slot) = decoded {
            owners.claim(window_page_of(&alloc, slot, 1), 2);
        }
        let allocated = t.join().unwrap();
        let (winner, loser) = match (&allocated, &decoded) {
            (Ok(w), Err(e)) => {
                outcomes.hit("alloc won");
                (*w, e)
            }
            (Err(e), Ok(w)) => {
                outcomes.hit("decode won");
                (*w, e)
            }
            other => panic!("exactly one allocation fits the window pool: {other:?}"),
        };
        let e = oom(loser);
        assert_eq!((e.requested, e.available, e.unit), (1, 0, Unit::WindowTokens));
        assert_eq!(alloc.window_slot(winner), Some(1));
        // The loser's full reservation came back; the winner holds one of each.
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (1, 0));
        alloc.check_invariants().unwrap();
        alloc.free(&[winner]).unwrap();
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (2, 1));
        assert_eq!(alloc.window_slot(winner), None);
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen("window_pool_short_one_wins", &["alloc won", "decode won"]);
}

/// Page size 2, full pool one page, window pool two: room in the full pool for one of
/// two page allocations. The loser is refused by the full pool, before it reserves
/// anything of the window pool; the winner gets the lowest window page and maps both
/// of its slots.
#[test]
fn full_pool_short_one_wins() {
    let outcomes = Outcomes::new(&["spawned won", "main won"]);
    let seen = outcomes.clone();
    loom_common::model("full_pool_short_one_wins", move || {
        let alloc = Arc::new(SwaAllocator::new(2, 4, 2).unwrap());
        let t = {
            let alloc = Arc::clone(&alloc);
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                alloc.alloc(&mut out).map(|()| out)
            })
        };
        let mut out = [u32::MAX; 2];
        let mine = alloc.alloc(&mut out).map(|()| out);
        let theirs = t.join().unwrap();
        let (winner, loser) = match (&theirs, &mine) {
            (Ok(w), Err(e)) => {
                outcomes.hit("spawned won");
                (*w, e)
            }
            (Err(e), Ok(w)) => {
                outcomes.hit("main won");
                (*w, e)
            }
            other => panic!("exactly one allocation fits the full pool: {other:?}"),
        };
        let e = oom(loser);
        assert_eq!((e.requested, e.available, e.unit), (2, 0, Unit::Tokens));
        assert_eq!(winner, [2, 3]);
        assert_eq!(window_page_of(&alloc, winner[0], 2), 1);
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (0, 2));
        alloc.check_invariants().unwrap();
        alloc.free(&winner).unwrap();
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (2, 4));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen("full_pool_short_one_wins", &["spawned won", "main won"]);
}

/// Page size 1, full pool 2 tokens, window pool 1. The main thread asks for 2 tokens:
/// the full pool grants them, the window pool never can, and the full reservation goes
/// back. Meanwhile another thread asks for 1 token: it succeeds, or is refused by the
/// full pool while the main thread holds all of it (both fail: an allocation racing a
/// reservation may be refused, as the slot pool documents). Either way nothing of
/// either pool is missing afterwards. (The big request runs on the main thread so that
/// loom's first schedule has its reservation before the small one's loads: loom does
/// not move a load before an earlier store of another thread, tokio-rs/loom#392.)
#[test]
fn refused_reservation_is_given_back() {
    let outcomes = Outcomes::new(&["one token allocated", "both refused"]);
    let seen = outcomes.clone();
    loom_common::model("refused_reservation_is_given_back", move || {
        let alloc = Arc::new(SwaAllocator::new(2, 1, 1).unwrap());
        let t = {
            let alloc = Arc::clone(&alloc);
            thread::spawn(move || {
                let mut out = [u32::MAX; 1];
                alloc.alloc(&mut out).map(|()| out)
            })
        };
        let mut out = [u32::MAX; 2];
        let big = oom(&alloc.alloc(&mut out).unwrap_err());
        assert_eq!(out, [u32::MAX; 2]);
        let small = t.join().unwrap();
        // Refused by the full pool only while the small request held a token of it,
        // else by the window pool, whose one page the small request held or did not.
        match big.unit {
            Unit::WindowTokens => assert!(big.available <= 1 && big.requested == 2, "{big:?}"),
            Unit::Tokens => assert!(big.available < 2 && small.is_ok(), "{big:?} {small:?}"),
            other => panic!("{other:?}"),
        }
        match small {
            Ok(one) => {
                outcomes.hit("one token allocated");
                assert_eq!(alloc.window_slot(one[0]), Some(1));
                assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (1, 0));
                alloc.check_invariants().unwrap();
                alloc.free(&one).unwrap();
            }
            Err(e) => {
                outcomes.hit("both refused");
                let e = oom(&e);
                // Only the full pool can refuse it: the big request never held the
                // window page (it reserves the window pool only after the full pool).
                assert_eq!((e.requested, e.available, e.unit), (1, 0, Unit::Tokens));
            }
        }
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (2, 1));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen("refused_reservation_is_given_back", &["one token allocated", "both refused"]);
}

/// Page size 2, both pools two pages. The main thread holds full page 1 (window page 1)
/// and frees it; another thread allocates a page at the same time. The free sets the
/// full page's bit before its group ends (and publishes), so the allocation — whose
/// reservation counts page 2 — may claim page 1 itself, and map it, while the free is
/// still running. The free clears the mapping before it frees the full page, so the
/// new owner's mapping is never clobbered: both of its entries point into one window
/// page it owns.
#[test]
fn free_races_alloc_reusing_the_page() {
    let outcomes = Outcomes::new(&["reused page 1", "took page 2", "reused window page 1"]);
    let seen = outcomes.clone();
    loom_common::model("free_races_alloc_reusing_the_page", move || {
        let alloc = Arc::new(SwaAllocator::new(4, 4, 2).unwrap());
        let owners = Arc::new(PageOwners::new(2));
        let mut held = [0u32; 2];
        alloc.alloc(&mut held).unwrap();
        assert_eq!((held, alloc.window_slot(3)), ([2, 3], Some(3)));
        owners.claim(1, 9);
        let t = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                alloc.alloc(&mut out).unwrap(); // page 2 is free throughout
                assert_eq!(out[1], out[0] + 1);
                let w = window_page_of(&alloc, out[0], 2);
                owners.claim(w, 1);
                (out, w)
            })
        };
        owners.check(1, 9);
        alloc.free(&held).unwrap();
        let (out, w) = t.join().unwrap();
        // Still the new owner's, after the free is long done.
        assert_eq!(window_page_of(&alloc, out[0], 2), w);
        outcomes.hit(if out[0] == 2 { "reused page 1" } else { "took page 2" });
        if w == 1 {
            outcomes.hit("reused window page 1");
        }
        if out[0] != 2 {
            assert_eq!((alloc.window_slot(2), alloc.window_slot(3)), (None, None));
        }
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (2, 2));
        alloc.check_invariants().unwrap();
        alloc.free(&out).unwrap();
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (4, 4));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen("free_races_alloc_reusing_the_page", &["reused page 1", "took page 2", "reused window page 1"]);
}

/// Page size 2, full pool two pages, window pool one. The main thread holds full page
/// 1 with the only window page and releases its window part (`free_swa`: a request's
/// tokens fell out of its window); another thread allocates a page at the same time,
/// which fits only once the window page is back. Page 1 keeps its full slots and loses
/// its mapping; the window page has one owner at a time, and one mapping.
#[test]
fn free_swa_races_alloc_of_its_window_page() {
    let outcomes = Outcomes::new(&["allocated with the released window page", "refused"]);
    let seen = outcomes.clone();
    loom_common::model("free_swa_races_alloc_of_its_window_page", move || {
        let alloc = Arc::new(SwaAllocator::new(4, 2, 2).unwrap());
        let owners = Arc::new(PageOwners::new(1));
        let mut held = [0u32; 2];
        alloc.alloc(&mut held).unwrap();
        owners.claim(1, 9);
        let t = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                match alloc.alloc(&mut out) {
                    Ok(()) => {
                        assert_eq!(out, [4, 5]);
                        assert_eq!(window_page_of(&alloc, 4, 2), 1);
                        owners.claim(1, 1);
                        Some(out)
                    }
                    Err(e) => {
                        let e = oom(&e);
                        assert_eq!((e.requested, e.available, e.unit), (2, 0, Unit::WindowTokens));
                        None
                    }
                }
            })
        };
        owners.check(1, 9);
        assert_eq!(alloc.free_swa(&held).unwrap(), 2);
        let got = t.join().unwrap();
        assert!(alloc.is_allocated(2) && alloc.is_allocated(3));
        assert_eq!((alloc.window_slot(2), alloc.window_slot(3)), (None, None));
        match got {
            Some(out) => {
                outcomes.hit("allocated with the released window page");
                assert_eq!(window_page_of(&alloc, out[0], 2), 1);
                assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (0, 0));
                alloc.check_invariants().unwrap();
                alloc.free(&out).unwrap();
            }
            None => outcomes.hit("refused"),
        }
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (2, 2));
        alloc.check_invariants().unwrap();
        alloc.free(&held).unwrap();
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (4, 2));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen(
        "free_swa_races_alloc_of_its_window_page",
        &["allocated with the released window page", "refused"],
    );
}

/// Page size 2, full pool four pages, window pool three. The main thread holds pages
/// 1, 2 and 3 (window pages 1, 2, 3) and frees pages 1 and 2 through one free group
/// (a slot free and a range free); another thread extends a request whose prefix ends
/// inside page 3 by two tokens: one into page 3 (part 1 reads `last_loc`), one into a
/// fresh page. Its window page can only come from the group, whose frees count only
/// when it ends: refused before (in window tokens), served after. Its full page is page
/// 4 or one the group freed (their bits are set before the group ends). Page 3's
/// mapping is never touched; the new page's is whole.
#[test]
fn group_free_races_extend() {
    let outcomes = Outcomes::new(&["refused while the group was open", "extended", "took a page the group freed"]);
    let seen = outcomes.clone();
    loom_common::model("group_free_races_extend", move || {
        let alloc = Arc::new(SwaAllocator::new(8, 6, 2).unwrap());
        let owners = Arc::new(PageOwners::new(3));
        let mut held = [0u32; 6];
        alloc.alloc(&mut held).unwrap();
        assert_eq!(held, [2, 3, 4, 5, 6, 7]);
        for w in 1..=3 {
            owners.claim(w, 9);
        }
        let t = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                match alloc.alloc_extend(&[1], &[3], &[6], &mut out) {
                    Ok(()) => {
                        assert_eq!(out[0], 7);
                        assert!(out[1] % 2 == 0 && out[1] != 6, "{out:?}");
                        let w = window_page_of(&alloc, out[1], 2);
                        assert!(w == 1 || w == 2, "window page {w}");
                        owners.claim(w, 1);
                        Some((out[1] / 2, w))
                    }
                    Err(e) => {
                        let e = oom(&e);
                        assert_eq!((e.requested, e.available, e.unit), (2, 0, Unit::WindowTokens));
                        assert_eq!(out, [u32::MAX; 2]);
                        None
                    }
                }
            })
        };
        owners.check(1, 9);
        owners.check(2, 9);
        let mut g = alloc.free_group();
        g.free(&held[..1]).unwrap();
        g.free_pages(2, 1).unwrap();
        assert_eq!(g.pending_tokens(), 4);
        assert_eq!(g.end(), 4);
        let got = t.join().unwrap();
        assert_eq!(window_page_of(&alloc, 6, 2), 3);
        match got {
            Some((page, w)) => {
                outcomes.hit("extended");
                if page != 4 {
                    outcomes.hit("took a page the group freed");
                }
                assert_eq!(window_page_of(&alloc, page * 2, 2), w);
                assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (4, 2));
                alloc.check_invariants().unwrap();
                alloc.free(&[page * 2]).unwrap();
            }
            None => outcomes.hit("refused while the group was open"),
        }
        for page in [1, 2] {
            assert_eq!(alloc.window_slot(page * 2), None);
        }
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (6, 4));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen(
        "group_free_races_extend",
        &["refused while the group was open", "extended", "took a page the group freed"],
    );
}

/// The results of two racing frees of one page: exactly one may have been refused
/// (`NotAllocated`); afterwards each pool is whole again.
fn check_double_free(alloc: &SwaAllocator, results: [&Result<(), kvpool::FreeError>; 2], sizes: (usize, usize)) {
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        assert_eq!(e.kind, FreeErrorKind::NotAllocated, "{e:?}");
    }
    assert!(results.iter().any(|r| r.is_ok()), "both frees refused: {results:?}");
    assert_eq!((alloc.full_available_size(), alloc.window_available_size()), sizes);
    alloc.check_invariants().unwrap();
}

/// Page size 1, both pools two tokens. A token and its window slot; two threads free
/// it at once (a caller's double free). The KV allocators merge repeats of a page at
/// every page size (a slot is its own page here), so a free that finds the bit already
/// set by the other is not an error: either one free is refused at validation
/// (`NotAllocated`, the other done), or both validated first and both return `Ok`. The
/// full slot and the window slot are freed once either way.
#[test]
fn double_free_frees_each_part_once() {
    let outcomes = Outcomes::new(&["one refused", "both ok"]);
    let seen = outcomes.clone();
    loom_common::model("double_free_frees_each_part_once", move || {
        let alloc = Arc::new(SwaAllocator::new(2, 2, 1).unwrap());
        let mut slot = [0u32; 1];
        alloc.alloc(&mut slot).unwrap();
        let t = {
            let alloc = Arc::clone(&alloc);
            thread::spawn(move || alloc.free(&slot))
        };
        let mine = alloc.free(&slot);
        let theirs = t.join().unwrap();
        outcomes.hit(if mine.is_ok() && theirs.is_ok() { "both ok" } else { "one refused" });
        check_double_free(&alloc, [&mine, &theirs], (2, 2));
        assert_eq!(alloc.window_slot(slot[0]), None);
    });
    seen.expect_seen("double_free_frees_each_part_once", &["one refused", "both ok"]);
}

/// Page size 2, both pools two pages: the double free of a page. The paged free merges
/// repeats of a page (a batch of token slots names each page many times), so two frees
/// that both validated before either set the page's bit both return `Ok`, and the page
/// is freed once. The window page is freed once whatever the order.
#[test]
fn double_free_of_a_page_frees_each_part_once() {
    let outcomes = Outcomes::new(&["one refused", "both ok"]);
    let seen = outcomes.clone();
    loom_common::model("double_free_of_a_page_frees_each_part_once", move || {
        let alloc = Arc::new(SwaAllocator::new(4, 4, 2).unwrap());
        let mut page = [0u32; 2];
        alloc.alloc(&mut page).unwrap();
        let t = {
            let alloc = Arc::clone(&alloc);
            thread::spawn(move || alloc.free(&page[1..]))
        };
        let mine = alloc.free(&page);
        let theirs = t.join().unwrap();
        outcomes.hit(if mine.is_ok() && theirs.is_ok() { "both ok" } else { "one refused" });
        check_double_free(&alloc, [&mine, &theirs], (4, 4));
        assert_eq!((alloc.window_slot(2), alloc.window_slot(3)), (None, None));
    });
    seen.expect_seen("double_free_of_a_page_frees_each_part_once", &["one refused", "both ok"]);
}

/// Page size 2, both pools two pages. A page; one thread releases its window part
/// (`free_swa`) while another frees it whole. The window page is freed once, by
/// whichever clears the mapping first: `free_swa` returns 2 (it did), 0 (the free did,
/// the full page still allocated when `free_swa` checked), or not-allocated (the free
/// was done before `free_swa` began).
#[test]
fn free_swa_races_free() {
    let outcomes = Outcomes::new(&["free_swa released it", "free released it", "free_swa refused"]);
    let seen = outcomes.clone();
    loom_common::model("free_swa_races_free", move || {
        let alloc = Arc::new(SwaAllocator::new(4, 4, 2).unwrap());
        let mut page = [0u32; 2];
        alloc.alloc(&mut page).unwrap();
        let t = {
            let alloc = Arc::clone(&alloc);
            thread::spawn(move || alloc.free_swa(&page))
        };
        alloc.free(&page).unwrap();
        match t.join().unwrap() {
            Ok(2) => outcomes.hit("free_swa released it"),
            Ok(0) => outcomes.hit("free released it"),
            Err(e) => {
                assert_eq!((e.index, e.kind, e.rest_freed), (2, FreeErrorKind::NotAllocated, false));
                outcomes.hit("free_swa refused");
            }
            other => panic!("free_swa returned {other:?}"),
        }
        assert_eq!((alloc.window_slot(2), alloc.window_slot(3)), (None, None));
        assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (4, 4));
        alloc.check_invariants().unwrap();
    });
    seen.expect_seen("free_swa_races_free", &["free_swa released it", "free released it", "free_swa refused"]);
}
