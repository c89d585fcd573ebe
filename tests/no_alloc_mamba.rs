#![cfg(not(loom))]
//! The Mamba pool's and the hybrid rows' hot paths never touch the heap (the counting
//! allocator of `tests/no_alloc.rs`): alloc, fork, copy, cache, free by handle and by
//! number (and their error paths), row alloc/checkpoint/take/free, the index tables,
//! and the layer map's lookups.

use std::hint::black_box;
use std::sync::Arc;

mod alloc_common;

use alloc_common::{allocations, assert_no_alloc};
use kvpool::mamba::{Component, HybridLayerMap, HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};

#[test]
fn counter_sees_allocations() {
    let (n, v) = allocations(|| black_box(Vec::<u32>::with_capacity(16)));
    assert_eq!(n, 1);
    drop(v);
}

#[test]
fn mamba_pool_hot_paths() {
    let cfg = MambaConfig {
        layers: 3,
        conv: vec![StateShape::new(&[16, 3], StateDtype::Bf16)],
        temporal: StateShape::new(&[2, 8, 8], StateDtype::F32),
    };
    let pool = MambaPool::new(8, cfg).unwrap();
    let mut a = assert_no_alloc("MambaPool::alloc", || pool.alloc()).unwrap();
    assert_no_alloc("component_mut", || pool.component_mut::<f32>(&mut a, 2, Component::Temporal).unwrap()[3] = 1.0);
    let mut b = assert_no_alloc("alloc", || pool.alloc()).unwrap();
    assert_no_alloc("copy_slot", || pool.copy_slot(&a, &mut b)).unwrap();
    assert_no_alloc("zero_slot", || pool.zero_slot(&mut b)).unwrap();
    let c = assert_no_alloc("cache", || pool.cache(a).unwrap());
    let f = assert_no_alloc("fork_from", || pool.fork_from(c)).unwrap();
    assert_no_alloc("fork_from (not cached)", || pool.fork_from(f.index())).unwrap_err();
    assert_no_alloc("copy_from", || pool.copy_from(&[c], &mut [&mut b])).unwrap();
    assert_no_alloc("read_cached", || pool.read_cached(c, 0, Component::Conv(0), |x| x.len())).unwrap();
    assert_no_alloc("free (in use)", || pool.free(&[c, f.index()])).unwrap_err();
    assert_no_alloc("free (out of range)", || pool.free(&[99])).unwrap_err();
    assert_no_alloc("free", || pool.free(&[c])).unwrap();
    assert_no_alloc("free (double)", || pool.free(&[c])).unwrap_err();
    assert_no_alloc("free_slot", || pool.free_slot(f)).unwrap();
    assert_no_alloc("free_slot", || pool.free_slot(b)).unwrap();
    assert_no_alloc("available / is_allocated", || (pool.available(), pool.is_allocated(1), pool.is_cached(1)));
    let mut all = Vec::new();
    while let Ok(s) = pool.alloc() {
        all.push(s);
    }
    assert_no_alloc("alloc (out of memory)", || pool.alloc()).unwrap_err();
    for s in all {
        pool.free_slot(s).unwrap();
    }
}

#[test]
fn hybrid_rows_and_layer_map_hot_paths() {
    let cfg = MambaConfig { layers: 2, conv: vec![], temporal: StateShape::new(&[8], StateDtype::F32) };
    let pool = Arc::new(MambaPool::new(7, cfg).unwrap());
    let rows = HybridReqToTokenPool::new(2, 32, Arc::clone(&pool), 2).unwrap();
    let mut r = assert_no_alloc("HybridReqToTokenPool::alloc", || rows.alloc()).unwrap();
    assert_no_alloc("write", || rows.write(&mut r, 0, &[1, 2, 3])).unwrap();
    assert_no_alloc("read", || rows.read(&r, 0..3).map(|s| s[2])).unwrap();
    assert_no_alloc("component_mut (row)", || {
        pool.component_mut::<f32>(&mut r, 1, Component::Temporal).unwrap()[0] = 1.0
    });
    assert_no_alloc("checkpoint", || rows.checkpoint(&mut r)).unwrap();
    let mut out = [0u32; 1];
    assert_no_alloc("mamba_indices", || rows.mamba_indices(&[r.index()], &mut out)).unwrap();
    let kept = assert_no_alloc("take_checkpoint", || rows.take_checkpoint(&mut r)).unwrap();
    let forked = assert_no_alloc("fork + cache", || {
        let c = pool.cache(kept).unwrap();
        let f = pool.fork_from(c).unwrap();
        pool.free(&[c]).unwrap();
        f
    });
    let r2 = assert_no_alloc("alloc_with", || rows.alloc_with(forked)).unwrap();
    assert_no_alloc("alloc (out of rows)", || rows.alloc()).unwrap_err();
    let other = HybridReqToTokenPool::new(1, 32, Arc::clone(&pool), 0).unwrap();
    let r = assert_no_alloc("free (another pool's row)", || other.free(r).err().map(|e| e.row)).unwrap();
    assert_no_alloc("free", || rows.free(r).map_err(|e| e.error)).unwrap();
    assert_no_alloc("free", || rows.free(r2).map_err(|e| e.error)).unwrap();
    let map = HybridLayerMap::new(8, &[3, 7], &[0, 1, 2, 4, 5, 6]).unwrap();
    assert_no_alloc("kv_index / mamba_index", || (map.kv_index(7), map.mamba_index(6), map.kind(3))).0.unwrap();
}
