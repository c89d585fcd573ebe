#![cfg(not(loom))]
//! The dual allocator's hot paths never touch the heap: a counting global allocator
//! sees zero allocations in `SwaAllocator`'s `alloc`, `alloc_extend`, `alloc_decode`,
//! `free`, `free_swa`, free groups (`free`, `free_pages`, `end`), translations and
//! their refusals (either pool short, bad frees), after construction. Batches larger
//! than the 64-page stack buffers of the window pool are included.
//!
//! The counting allocator is `tests/alloc_common` (this thread's allocations only).

use std::hint::black_box;

mod alloc_common;

use alloc_common::{allocations, assert_no_alloc};
use kvpool::alloc::SwaAllocator;
use kvpool::{AllocError, KvAllocator, OutOfMemory, Unit};

/// The counter works here too: if it did not, every other test would pass vacuously.
#[test]
fn counter_sees_allocations() {
    let (n, v) = allocations(|| black_box(Vec::<u32>::with_capacity(16)));
    assert_eq!(n, 1);
    drop(v);
    let a = SwaAllocator::new(64, 16, 4).unwrap();
    // Building an allocator allocates (its bitmaps and mapping): counted.
    let (n, _) = allocations(|| black_box(SwaAllocator::new(64, 16, 4).unwrap()));
    assert!(n >= 1);
    let e = a.alloc(&mut [0u32; 32]).unwrap_err();
    let (n, _) = allocations(|| black_box(e.to_string()));
    assert!(n >= 1);
}

fn window_oom(e: &AllocError) -> bool {
    matches!(e, AllocError::OutOfMemory(OutOfMemory { unit: Unit::WindowTokens, .. }))
}

/// Every hot path of an allocator of page size `ps` whose window pool is about a quarter of
/// the full pool (300 and 80 pages).
fn hot_paths(ps: u32) {
    let psz = ps as usize;
    let alloc = SwaAllocator::new(300 * psz, 80 * psz, ps).unwrap();
    // 70 pages: more than one 64-page chunk of the window pool's stack buffer.
    let mut whole = vec![0u32; 70 * psz];
    let mut extend = vec![0u32; 3 * psz + 1];
    let mut decode = [0u32; 2];
    let mut window = vec![0u32; whole.len()];
    assert_no_alloc("alloc", || alloc.alloc(&mut whole)).unwrap();
    // request 0 continues the partial page of a 1-token prefix at whole[0]; request 1 is new
    let prefix = [1, 0];
    let seq = [1 + ps + 1, 2 * ps];
    assert_eq!(extend.len() as u32, seq[0] - prefix[0] + seq[1] - prefix[1]);
    assert_no_alloc("alloc_extend", || alloc.alloc_extend(&prefix, &seq, &[whole[0], 0], &mut extend)).unwrap();
    let last = extend[psz];
    assert_no_alloc("alloc_decode", || alloc.alloc_decode(&[ps + 3, 1], &[last, 0], &mut decode)).unwrap();
    assert_no_alloc("translate", || alloc.translate(&whole, &mut window)).unwrap();
    assert!(window.iter().all(|&w| w != 0));
    assert_no_alloc("translate (error)", || alloc.translate(&whole, &mut window[1..])).unwrap_err();
    assert_no_alloc("window_slot", || alloc.window_slot(whole[5])).unwrap();
    assert_no_alloc("available_size", || alloc.available_size());
    assert_no_alloc("window_available_size", || alloc.window_available_size());
    let mut table = [0u32; 64];
    assert_no_alloc("copy_mapping", || alloc.window().copy_mapping(0, &mut table)).unwrap();

    // Refusals: the window pool short (the full pool has room), then the full pool.
    let mut big = vec![0u32; 10 * psz];
    let e = assert_no_alloc("alloc (window pool short)", || alloc.alloc(&mut big)).unwrap_err();
    assert!(window_oom(&e), "{e:?}");
    let e =
        assert_no_alloc("alloc_extend (window pool short)", || alloc.alloc_extend(&[0], &[10 * ps], &[0], &mut big))
            .unwrap_err();
    assert!(window_oom(&e), "{e:?}");
    let mut huge = vec![0u32; 301 * psz];
    let e = assert_no_alloc("alloc (full pool short)", || alloc.alloc(&mut huge)).unwrap_err();
    assert!(!window_oom(&e), "{e:?}");
    assert_no_alloc("alloc_decode (malformed)", || alloc.alloc_decode(&[0], &[0], &mut decode[..1])).unwrap_err();

    // The window part of 66 pages (more than a chunk) fell out of the window.
    assert_no_alloc("free_swa", || alloc.free_swa(&whole[..66 * psz])).unwrap();
    assert_no_alloc("free_swa (nothing left to release)", || alloc.free_swa(&whole[..psz])).unwrap();
    assert_no_alloc("free_swa (error)", || alloc.free_swa(&[whole[0], u32::MAX])).unwrap_err();
    // extend and decode share pages with `whole`: one batch frees each page once
    let all: Vec<u32> = whole.iter().chain(&extend).chain(&decode).copied().collect();
    assert_no_alloc("free (error)", || alloc.free(&[all[0], u32::MAX])).unwrap_err();
    assert_no_alloc("free", || alloc.free(&all)).unwrap();
    assert_no_alloc("free (double free error)", || alloc.free(&whole[..1])).unwrap_err();
    assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (300 * psz, 80 * psz));

    // Free groups: slots, a page range, a refused free inside the group, the end.
    let mut other = vec![0u32; 2 * psz];
    alloc.alloc(&mut whole).unwrap();
    alloc.alloc(&mut other).unwrap();
    let first_page = whole[0] / ps;
    assert_no_alloc("free group", || {
        let mut g = alloc.free_group();
        g.free(&whole[..psz]).unwrap();
        g.free_pages(first_page + 1, 69).unwrap();
        g.free(&other).unwrap();
        g.free(&other[..1]).unwrap_err();
        g.free_pages(first_page, 1).unwrap_err();
        black_box(g.pending_tokens());
        g.end()
    });
    assert_eq!((alloc.full_available_size(), alloc.window_available_size()), (300 * psz, 80 * psz));
    alloc.check_invariants().unwrap();
}

#[test]
fn token_pools_hot_paths() {
    hot_paths(1);
}

#[test]
fn paged_pools_hot_paths() {
    for ps in [2, 3, 4, 16, 64] {
        hot_paths(ps);
    }
}
