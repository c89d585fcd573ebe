#![cfg(not(loom))]
//! The host KV pool's hot paths never touch the heap: a counting global allocator sees
//! zero allocations in `HostKvPool`'s `alloc_pages`, `free_pages`, their refusals (out
//! of pages, double and out-of-range frees), the page checks, the byte accessors and the
//! host reference transfers (`backup`, `load`, and their refusals), after construction.
//!
//! The counting allocator is `tests/alloc_common` (this thread's allocations only).

use std::hint::black_box;

mod alloc_common;

use alloc_common::{allocations, assert_no_alloc};
use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};

fn config(layout: HostLayout) -> HostKvConfig {
    let kv = KvConfig {
        layout: KvLayout::Mha { head_num: 2, head_dim: 8 },
        dtype: KvDtype::Bf16,
        layer_num: 3,
        size: 40 * 4,
        page_size: 4,
    };
    HostKvConfig::with_ratio(kv, 2.0, layout).unwrap()
}

/// The counter works here too: if it did not, every other test would pass vacuously.
#[test]
fn counter_sees_allocations() {
    let (n, v) = allocations(|| black_box(Vec::<u32>::with_capacity(16)));
    assert_eq!(n, 1);
    drop(v);
    // Building a pool allocates (its arena and bitmap): counted.
    let (n, _) = allocations(|| black_box(HostKvPool::pageable(config(HostLayout::PageFirst)).unwrap()));
    assert!(n >= 1);
}

fn hot_paths(layout: HostLayout) {
    let cfg = config(layout);
    let mut pool = HostKvPool::pageable(cfg).unwrap();
    assert_eq!(cfg.host_pages, 80);
    // 70 pages: more than one 64-bit bitmap word.
    let mut pages = vec![0u32; 70];
    let mut more = vec![0u32; 20];
    assert_no_alloc("alloc_pages", || pool.alloc_pages(&mut pages)).unwrap();
    assert_no_alloc("alloc_pages (out of pages)", || pool.alloc_pages(&mut more)).unwrap_err();
    assert_no_alloc("alloc_pages (rest)", || pool.alloc_pages(&mut more[..10])).unwrap();
    assert_no_alloc("available_pages", || black_box(pool.available_pages()));
    assert_no_alloc("free_pages (out of range)", || pool.free_pages(&[81])).unwrap_err();
    assert_no_alloc("free_pages", || pool.free_pages(&more[..10])).unwrap();
    assert_no_alloc("free_pages (double free)", || pool.free_pages(&more[..1])).unwrap_err();
    assert_no_alloc("check_page", || pool.check_page(pages[3])).unwrap();
    assert_no_alloc("check_page (not allocated)", || pool.check_page(more[0])).unwrap_err();

    let n = cfg.kv.layer_num as usize * cfg.buffers();
    let src: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8 + 1; cfg.kv.layer_bytes()]).collect();
    let src_refs: Vec<&[u8]> = src.iter().map(|b| &b[..]).collect();
    let mut dst: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; cfg.kv.layer_bytes()]).collect();
    // Every device page, each to its own host page.
    let device_pages: Vec<u32> = (1..=40).collect();
    let host_pages = &pages[..40];
    assert_no_alloc("check_pairs", || pool.check_pairs(&device_pages, host_pages)).unwrap();
    assert_no_alloc("backup", || pool.backup(&src_refs, &device_pages, host_pages)).unwrap();
    assert_no_alloc("backup (not allocated)", || pool.backup(&src_refs, &[1], &[more[0]])).unwrap_err();
    assert_no_alloc("backup (device page)", || pool.backup(&src_refs, &[41], &[pages[0]])).unwrap_err();
    assert_no_alloc("page_rows", || black_box(pool.page_rows(pages[5], 2, 1).unwrap().len()));
    {
        let mut dst_refs: Vec<&mut [u8]> = dst.iter_mut().map(|b| &mut b[..]).collect();
        assert_no_alloc("load (all layers)", || pool.load(&mut dst_refs, host_pages, &device_pages, 0..3)).unwrap();
        assert_no_alloc("load (one layer)", || pool.load(&mut dst_refs, host_pages, &device_pages, 1..2)).unwrap();
        assert_no_alloc("load (bad layers)", || pool.load(&mut dst_refs, host_pages, &device_pages, 2..4)).unwrap_err();
        assert_no_alloc("load (unequal lists)", || pool.load(&mut dst_refs, &host_pages[1..], &device_pages, 0..3))
            .unwrap_err();
    }
    // The work was done: device page k of every buffer came back.
    let chunk = cfg.chunk_bytes();
    assert!(dst.iter().enumerate().all(|(lb, b)| b[chunk..41 * chunk].iter().all(|&x| x == lb as u8 + 1)));
    assert_no_alloc("free_pages (all)", || pool.free_pages(&pages)).unwrap();
    assert_eq!(pool.available_pages(), 80);
}

#[test]
fn layer_first_hot_paths() {
    hot_paths(HostLayout::LayerFirst);
}

#[test]
fn page_first_hot_paths() {
    hot_paths(HostLayout::PageFirst);
}
