#![cfg(all(loom, not(shuttle)))]
//! Loom models of `PagedAllocator`: `alloc_extend` / `alloc_decode` racing with frees
//! and free groups. Run with `scripts/loom.sh`.
//!
//! Pages are owned through loom `UnsafeCell`s as in `loom_slots.rs`: a page with two
//! holders at once, or handed over without a happens-before edge, is a data race that
//! loom reports.
//!
//! | model                                  | what it proves                                          |
//! |----------------------------------------|---------------------------------------------------------|
//! | `extend_and_decode_race_with_free`     | page size 4: the pages of racing extend and decode are distinct, their slots follow the three-part formula (and the extend reports exactly where they stop being consecutive), the freed page is reused safely, counts add up |
//! | `decode_races_alloc_and_group_free`    | page size 3 (not a power of two): a decode batch that fills a partial page and opens a new one, racing a plain alloc and a free group |
//! | `token_decode_follows_runs_racing_free_and_alloc` | page size 1: a decode batch whose requests continue their runs (`last_loc + 1`) or start new ones, racing the free of a slot one of them wants and a plain alloc; slots have one holder, the freed slot is handed over safely, both outcomes occur |

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use kvpool::{AllocError, KvAllocator, PagedAllocator};
use loom_common::Outcomes;

/// One loom-tracked cell per page: the current holder's tag.
struct PageOwners(Vec<UnsafeCell<usize>>);

impl PageOwners {
    fn new(pages: u32) -> Self {
        PageOwners((0..=pages).map(|_| UnsafeCell::new(0)).collect())
    }

    fn claim(&self, page: u32, tag: usize) {
        // SAFETY: loom checks this access; two holders of one page is the bug this
        // model looks for, and loom reports it instead of racing.
        self.0[page as usize].with_mut(|p| unsafe { *p = tag });
    }

    fn check(&self, page: u32, tag: usize) {
        // SAFETY: as in `claim`.
        let held = self.0[page as usize].with(|p| unsafe { *p });
        assert_eq!(held, tag, "page {page} was handed to someone else while held");
    }
}

/// The tokens an out-of-memory error says were available, or panic on anything else.
fn oom_available(e: &AllocError) -> usize {
    e.out_of_memory().unwrap_or_else(|| panic!("expected out of memory, got {e:?}")).available
}

/// Page size 4, pages 1..=3. The main thread holds page 1 (a request with a 2-token
/// prefix, last at slot 5); a freer holds page 2; page 3 is free. An extender grows the
/// request to 7 tokens (2 slots in page 1, then one fresh page), the main thread
/// decodes a new request (one fresh page), the freer frees page 2.
#[test]
fn extend_and_decode_race_with_free() {
    loom_common::model("extend_and_decode_race_with_free", || {
        let alloc = Arc::new(PagedAllocator::new(12, 4).unwrap());
        let owners = Arc::new(PageOwners::new(3));
        let mut prefix_page = [0u32; 4];
        alloc.alloc(&mut prefix_page).unwrap();
        assert_eq!(prefix_page[0], 4);
        let mut other = [0u32; 4];
        alloc.alloc(&mut other).unwrap();
        assert_eq!(other[0], 8);
        owners.claim(1, 9);
        owners.claim(2, 8);

        let extender = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 5];
                // The call that also reports where the slots stop being consecutive.
                let mut breaks = Vec::new();
                match alloc.alloc_extend_runs(2, 7, 5, &mut out, &mut |p| breaks.push(p)) {
                    Ok(()) => {
                        let page = out[2] / 4;
                        assert!(page == 2 || page == 3, "{out:?}");
                        assert_eq!(out, [6, 7, page * 4, page * 4 + 1, page * 4 + 2]);
                        // Page 2 continues slot 7; page 3 does not.
                        assert_eq!(breaks, if page == 2 { vec![] } else { vec![2] }, "{out:?}");
                        owners.claim(page, 1);
                        Some(page)
                    }
                    Err(e) => {
                        assert_eq!(oom_available(&e), 0);
                        assert_eq!(out, [u32::MAX; 5], "a refused alloc wrote its buffer");
                        None
                    }
                }
            })
        };
        let freer = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(2, 8);
                alloc.free(&other[1..2]).unwrap(); // one slot frees its whole page
            })
        };
        let mut out = [u32::MAX; 1];
        let decoded = match alloc.alloc_decode(&[1], &[0], &mut out) {
            Ok(()) => {
                let page = out[0] / 4;
                assert!((page == 2 || page == 3) && out[0] % 4 == 0, "{out:?}");
                owners.claim(page, 2);
                Some(page)
            }
            Err(e) => {
                assert_eq!(oom_available(&e), 0);
                None
            }
        };
        freer.join().unwrap();
        let extended = extender.join().unwrap();
        assert!(extended.is_some() || decoded.is_some(), "page 3 was free throughout");
        if let (Some(a), Some(b)) = (extended, decoded) {
            assert_ne!(a, b);
        }
        let taken = extended.is_some() as usize + decoded.is_some() as usize;
        assert_eq!(alloc.available_size(), 4 * (2 - taken));
        assert!(alloc.is_allocated(5));
        for page in extended.into_iter().chain(decoded) {
            alloc.free(&[page * 4]).unwrap();
        }
        alloc.free(&prefix_page).unwrap();
        assert_eq!(alloc.available_size(), 12);
        alloc.check_invariants().unwrap();
    });
}

/// Page size 3, 10 tokens: pages 1..=3, one token unused. The main thread holds page 1
/// (a request of 1 token at slot 3); a grouper holds page 2 and frees it in a free
/// group; page 3 is free. A decoder steps two requests at once: the old one continues
/// in page 1 (slot 4), a new one needs a fresh page. The main thread allocates one
/// page. The group's page counts only when the group ends.
#[test]
fn decode_races_alloc_and_group_free() {
    loom_common::model("decode_races_alloc_and_group_free", || {
        let alloc = Arc::new(PagedAllocator::new(10, 3).unwrap());
        let owners = Arc::new(PageOwners::new(3));
        let mut first = [0u32; 3];
        alloc.alloc(&mut first).unwrap();
        let mut second = [0u32; 3];
        alloc.alloc(&mut second).unwrap();
        assert_eq!((first[0], second[0]), (3, 6));
        owners.claim(1, 9);
        owners.claim(2, 8);

        let decoder = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                match alloc.alloc_decode(&[2, 1], &[3, 0], &mut out) {
                    Ok(()) => {
                        let page = out[1] / 3;
                        assert!((page == 2 || page == 3) && out[1] % 3 == 0, "{out:?}");
                        assert_eq!(out[0], 4);
                        owners.claim(page, 1);
                        Some(page)
                    }
                    Err(e) => {
                        assert_eq!(oom_available(&e), 0);
                        assert_eq!(out, [u32::MAX; 2]);
                        None
                    }
                }
            })
        };
        let grouper = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(2, 8);
                let mut g = alloc.free_group();
                g.free(&second).unwrap();
                assert_eq!(g.pending_tokens(), 3);
                g.end()
            })
        };
        let mut page_out = [u32::MAX; 3];
        let allocated = match alloc.alloc(&mut page_out) {
            Ok(()) => {
                let page = page_out[0] / 3;
                assert_eq!(page_out, [page * 3, page * 3 + 1, page * 3 + 2]);
                owners.claim(page, 2);
                Some(page)
            }
            Err(e) => {
                assert_eq!(oom_available(&e), 0);
                None
            }
        };
        assert_eq!(grouper.join().unwrap(), 3);
        let decoded = decoder.join().unwrap();
        assert!(decoded.is_some() || allocated.is_some(), "page 3 was free throughout");
        if let (Some(a), Some(b)) = (decoded, allocated) {
            assert_ne!(a, b);
        }
        let taken = decoded.is_some() as usize + allocated.is_some() as usize;
        assert_eq!(alloc.available_size(), 3 * (2 - taken));
        alloc.check_invariants().unwrap();
    });
}

/// Page size 1, slots 1..=8. Request A holds 1 and 2, request B 3 and 4. A decoder
/// steps A and a new request C at once (A's next slot would be 3, C's 5) while a freer
/// frees B and the main thread allocates one slot. A continues its run exactly when
/// B's free came first; otherwise it starts a new one. Every slot has one holder at a
/// time (B's slots are handed over with a happens-before edge), and the counts add up.
#[test]
fn token_decode_follows_runs_racing_free_and_alloc() {
    let outcomes = Outcomes::new(&["continued", "new run"]);
    let seen = outcomes.clone();
    loom_common::model("token_decode_follows_runs_racing_free_and_alloc", move || {
        let alloc = Arc::new(PagedAllocator::new(8, 1).unwrap());
        let owners = Arc::new(PageOwners::new(8));
        let (mut a, mut b) = ([0u32; 2], [0u32; 2]);
        alloc.alloc(&mut a).unwrap();
        alloc.alloc(&mut b).unwrap();
        assert_eq!((a, b), ([1, 2], [3, 4]));
        for (slot, tag) in [(1, 9), (2, 9), (3, 8), (4, 8)] {
            owners.claim(slot, tag);
        }
        let decoder = {
            let (alloc, owners, seen) = (Arc::clone(&alloc), Arc::clone(&owners), seen.clone());
            thread::spawn(move || {
                let mut out = [u32::MAX; 2];
                // At least three slots are free whatever the others do.
                alloc.alloc_decode(&[3, 5], &[2, 4], &mut out).unwrap();
                assert_ne!(out[0], out[1]);
                seen.hit(if out[0] == 3 { "continued" } else { "new run" });
                for &s in &out {
                    owners.claim(s, 1);
                }
                out
            })
        };
        let freer = {
            let (alloc, owners) = (Arc::clone(&alloc), Arc::clone(&owners));
            thread::spawn(move || {
                owners.check(3, 8);
                owners.check(4, 8);
                alloc.free(&b).unwrap();
            })
        };
        let mut one = [u32::MAX; 1];
        alloc.alloc(&mut one).unwrap();
        owners.claim(one[0], 2);
        freer.join().unwrap();
        let out = decoder.join().unwrap();
        for &s in &out {
            owners.check(s, 1);
            assert_ne!(s, one[0]);
        }
        owners.check(one[0], 2);
        assert_eq!(alloc.available_size(), 8 - 2 - 2 - 1);
        alloc.check_invariants().unwrap();
    });
    outcomes.expect_seen("token_decode_follows_runs_racing_free_and_alloc", &["continued", "new run"]);
}
