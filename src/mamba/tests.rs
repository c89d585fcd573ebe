use std::sync::Arc;

use super::*;
use crate::error::{FreeErrorKind, Unit};

fn cfg() -> MambaConfig {
    MambaConfig {
        layers: 2,
        conv: vec![StateShape::new(&[3, 3], StateDtype::Bf16), StateShape::new(&[5], StateDtype::F16)],
        temporal: StateShape::new(&[2, 3], StateDtype::F32),
    }
}

/// Fill every component of every layer of `slot` with a pattern from `seed`.
fn fill(pool: &MambaPool, slot: &mut impl HeldState, seed: u8) {
    for layer in 0..pool.config().layers {
        for comp in pool.config().clone().components() {
            for (i, b) in pool.component_mut::<u8>(slot, layer, comp).unwrap().iter_mut().enumerate() {
                *b = seed.wrapping_add(i as u8).wrapping_add(layer as u8 * 31);
            }
        }
    }
}

fn snapshot(pool: &MambaPool, slot: &MambaSlot) -> Vec<u8> {
    let mut v = Vec::new();
    for layer in 0..pool.config().layers {
        for comp in pool.config().clone().components() {
            v.extend_from_slice(pool.component::<u8>(slot, layer, comp).unwrap());
        }
    }
    v
}

fn cached_snapshot(pool: &MambaPool, slot: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for layer in 0..pool.config().layers {
        for comp in pool.config().clone().components() {
            pool.read_cached(slot, layer, comp, |b| v.extend_from_slice(b)).unwrap();
        }
    }
    v
}

#[test]
fn sizes_and_layout() {
    let pool = MambaPool::new(4, cfg()).unwrap();
    assert_eq!(pool.size(), 4);
    assert_eq!(pool.available(), 4);
    // (9 * 2 + 5 * 2 + 6 * 4) bytes per layer, 2 layers
    assert_eq!(pool.slot_bytes(), 2 * (18 + 10 + 24));
    let (_, len) = pool.buffer_ptr(Component::Temporal).unwrap();
    assert_eq!(len, 24 * 5 * 2);
    assert!(pool.buffer_ptr(Component::Conv(2)).is_err());
    assert_eq!(MambaPool::new(0, cfg()).unwrap_err(), ConfigError::Zero("mamba pool size"));
    let mut bad = cfg();
    bad.temporal.dims.push(0);
    assert!(MambaPool::new(1, bad).is_err());
    let mut huge = cfg();
    huge.temporal.dims = vec![usize::MAX, 2];
    assert!(MambaPool::new(1, huge).is_err());
    let mut big = cfg();
    big.temporal.dims = vec![1 << 40];
    assert!(matches!(MambaPool::new(1 << 20, big), Err(ConfigError::TooLargeForMemory { .. })));
}

#[test]
fn alloc_hands_out_zeroed_state_and_slot_zero_is_never_used() {
    let pool = MambaPool::new(2, cfg()).unwrap();
    let mut a = pool.alloc().unwrap();
    assert_eq!(a.index(), 1);
    fill(&pool, &mut a, 7);
    pool.free_slot(a).unwrap();
    let b = pool.alloc().unwrap();
    assert_eq!(b.index(), 1, "lowest first");
    assert!(snapshot(&pool, &b).iter().all(|&x| x == 0), "recycled slot not zeroed");
    let c = pool.alloc().unwrap();
    assert_eq!(c.index(), 2);
    let e = pool.alloc().unwrap_err();
    assert_eq!((e.requested, e.available, e.unit), (1, 0, Unit::MambaSlots));
    assert!(!pool.is_allocated(0));
    pool.free_slot(b).unwrap();
    pool.free_slot(c).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn typed_views_check_size_and_bounds() {
    let pool = MambaPool::new(2, cfg()).unwrap();
    let mut a = pool.alloc().unwrap();
    pool.component_mut::<f32>(&mut a, 1, Component::Temporal).unwrap()[5] = 2.5;
    assert_eq!(pool.component::<f32>(&a, 1, Component::Temporal).unwrap().len(), 6);
    assert_eq!(pool.component::<u16>(&a, 0, Component::Conv(1)).unwrap().len(), 5);
    // 5 f16 = 10 bytes: not a whole number of f32
    assert!(matches!(pool.component::<f32>(&a, 0, Component::Conv(1)), Err(MambaError::Cast(_))));
    assert_eq!(
        pool.component::<u8>(&a, 2, Component::Temporal).unwrap_err(),
        MambaError::BadLayer { layer: 2, layers: 2 }
    );
    assert_eq!(
        pool.component::<u8>(&a, 0, Component::Conv(2)).unwrap_err(),
        MambaError::BadComponent { conv: 2, conv_states: 2 }
    );
    // The other slot and layer are untouched.
    let b = pool.alloc().unwrap();
    assert!(snapshot(&pool, &b).iter().all(|&x| x == 0));
    assert_eq!(pool.component::<f32>(&a, 0, Component::Temporal).unwrap(), &[0.0; 6]);
    pool.free_slot(a).unwrap();
    pool.free_slot(b).unwrap();
}

#[test]
fn fork_copies_exactly_the_cached_state() {
    let pool = MambaPool::new(4, cfg()).unwrap();
    let mut a = pool.alloc().unwrap();
    let mut other = pool.alloc().unwrap();
    fill(&pool, &mut a, 11);
    fill(&pool, &mut other, 99);
    let want = snapshot(&pool, &a);
    let cached = pool.cache(a).unwrap();
    assert!(pool.is_cached(cached));
    let mut f = pool.fork_from(cached).unwrap();
    assert_eq!(snapshot(&pool, &f), want);
    assert_eq!(cached_snapshot(&pool, cached), want);
    // Copy-on-write: writing the fork leaves the cached state alone.
    fill(&pool, &mut f, 200);
    assert_eq!(cached_snapshot(&pool, cached), want);
    // copy_from: a batch of pairs.
    let mut g = pool.alloc().unwrap();
    pool.copy_from(&[cached, cached], &mut [&mut f, &mut g]).unwrap();
    assert_eq!(snapshot(&pool, &f), want);
    assert_eq!(snapshot(&pool, &g), want);
    assert_ne!(snapshot(&pool, &other), want);
    // Out of slots: nothing changes, the pin is released.
    assert_eq!(pool.available(), 0);
    assert!(matches!(pool.fork_from(cached), Err(MambaError::OutOfMemory(_))));
    pool.free(&[cached]).unwrap();
    pool.check_invariants().unwrap();
    for s in [f, g, other] {
        pool.free_slot(s).unwrap();
    }
    assert_eq!(pool.available(), 4);
}

#[test]
fn copy_slot_and_zero_slot() {
    let pool = MambaPool::new(3, cfg()).unwrap();
    let mut a = pool.alloc().unwrap();
    let mut b = pool.alloc().unwrap();
    fill(&pool, &mut a, 3);
    pool.copy_slot(&a, &mut b).unwrap();
    assert_eq!(snapshot(&pool, &a), snapshot(&pool, &b));
    pool.zero_slot(&mut a).unwrap();
    assert!(snapshot(&pool, &a).iter().all(|&x| x == 0));
    assert!(snapshot(&pool, &b).iter().any(|&x| x != 0));
    pool.free_slot(a).unwrap();
    pool.free_slot(b).unwrap();
}

#[test]
fn free_by_number_refuses_everything_but_unpinned_cached_states() {
    let pool = MambaPool::new(4, cfg()).unwrap();
    let held = pool.alloc().unwrap();
    let c1 = pool.cache(pool.alloc().unwrap()).unwrap();
    let c2 = pool.cache(pool.alloc().unwrap()).unwrap();
    let free_slot = 4;
    let check = |slots: &[u32], index, kind| {
        let e = pool.free(slots).unwrap_err();
        assert_eq!((e.index, e.kind, e.rest_freed), (index, kind, false), "{slots:?}");
        assert_eq!(pool.available(), 1, "nothing may change");
        assert!(pool.is_cached(c1) && pool.is_cached(c2));
    };
    check(&[c1, 0], 0, FreeErrorKind::OutOfRange { first: 1, last: 4 });
    check(&[c1, 5], 5, FreeErrorKind::OutOfRange { first: 1, last: 4 });
    check(&[c1, free_slot], free_slot, FreeErrorKind::NotAllocated);
    check(&[c1, c2, c1], c1, FreeErrorKind::NotAllocated);
    check(&[c2, held.index()], held.index(), FreeErrorKind::InUse);
    // A pinned slot is in use while the reader holds it.
    pool.read_cached(c1, 0, Component::Temporal, |_| check(&[c2, c1], c1, FreeErrorKind::InUse)).unwrap();
    // Reading by number needs a cached state.
    assert_eq!(pool.fork_from(held.index()).unwrap_err(), MambaError::NotCached { slot: held.index() });
    assert_eq!(pool.fork_from(free_slot).unwrap_err(), MambaError::NotCached { slot: free_slot });
    assert_eq!(pool.fork_from(0).unwrap_err(), MambaError::NotCached { slot: 0 });
    assert_eq!(pool.fork_from(99).unwrap_err(), MambaError::NotCached { slot: 99 });
    let mut d = pool.alloc().unwrap();
    assert_eq!(
        pool.copy_from(&[c1, free_slot], &mut [&mut d]).unwrap_err(),
        MambaError::LengthMismatch { src: 2, dst: 1 }
    );
    assert!(pool.free_slot(d).is_ok());
    pool.free(&[c2, c1]).unwrap();
    assert!(!pool.is_allocated(c1) && !pool.is_cached(c2));
    assert_eq!(pool.free(&[c1]).unwrap_err().kind, FreeErrorKind::NotAllocated);
    pool.free_slot(held).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.available(), 4);
}

#[test]
fn foreign_and_stale_handles_are_refused() {
    let p1 = MambaPool::new(2, cfg()).unwrap();
    let mut p2 = MambaPool::new(2, cfg()).unwrap();
    let mut a = p1.alloc().unwrap();
    assert_eq!(p2.component::<u8>(&a, 0, Component::Temporal).unwrap_err(), MambaError::ForeignSlot { slot: 1 });
    assert_eq!(p2.zero_slot(&mut a).unwrap_err(), MambaError::ForeignSlot { slot: 1 });
    let stale = p2.alloc().unwrap();
    p2.clear();
    assert_eq!(p2.available(), 2);
    assert!(p2.free_slot(stale).is_err());
    assert_eq!(p2.available(), 2);
    p1.free_slot(a).unwrap();
}

#[test]
fn caching_a_foreign_handle_is_refused() {
    let p1 = MambaPool::new(1, cfg()).unwrap();
    let p2 = MambaPool::new(1, cfg()).unwrap();
    let a = p1.alloc().unwrap();
    let slot = a.index();
    let refused = p2.cache(a).unwrap_err();
    assert_eq!(refused.error, MambaError::ForeignSlot { slot });
    assert!(!p2.is_cached(slot) && p2.available() == 1);
    assert!(p1.is_allocated(slot) && !p1.is_cached(slot));
    // The handle came back: its own pool takes it.
    let refused = p2.free_slot(refused.slot).unwrap_err();
    assert_eq!(refused.error, MambaError::ForeignSlot { slot });
    p1.free_slot(refused.slot).unwrap();
    assert_eq!(p1.available(), 1);
}

fn rows(size: u32, mamba: u32, tracks: usize) -> (Arc<MambaPool>, HybridReqToTokenPool) {
    let m = Arc::new(MambaPool::new(mamba, cfg()).unwrap());
    let r = HybridReqToTokenPool::new(size, 16, Arc::clone(&m), tracks).unwrap();
    (m, r)
}

#[test]
fn rows_allocate_state_and_tracks_all_or_nothing() {
    let (m, pool) = rows(3, 7, 2);
    let a = pool.alloc().unwrap();
    let b = pool.alloc().unwrap();
    assert_eq!(m.available(), 1);
    assert_eq!(pool.mamba_index(a.index()), a.mamba().unwrap().index());
    assert_eq!(pool.track_indices(b.index()), [b.track(0).unwrap().index(), b.track(1).unwrap().index()]);
    // A row is free but only one Mamba slot: the row is given back.
    let e = pool.alloc().unwrap_err();
    assert!(matches!(e.error, MambaError::OutOfMemory(OutOfMemory { requested: 3, available: 1, .. })));
    assert_eq!((pool.available_size(), m.available()), (1, 1));
    let mut out = [0u32; 2];
    pool.mamba_indices(&[b.index(), a.index()], &mut out).unwrap();
    assert_eq!(out, [pool.mamba_index(b.index()), pool.mamba_index(a.index())]);
    assert_eq!(pool.mamba_indices(&[5, 0], &mut out).unwrap_err(), MambaError::BadRow { row: 5, rows: 3 });
    assert!(pool.mamba_indices(&[0], &mut out).is_err());
    pool.free(a).unwrap();
    pool.free(b).unwrap();
    assert_eq!((pool.available_size(), m.available()), (3, 7));
    assert_eq!(pool.mamba_index(0), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn rows_out_of_rows_return_the_given_state() {
    let (m, pool) = rows(1, 4, 1);
    let a = pool.alloc().unwrap();
    let s = m.alloc().unwrap();
    let idx = s.index();
    let e = pool.alloc_with(s).unwrap_err();
    assert_eq!(
        e.error,
        MambaError::OutOfMemory(OutOfMemory { requested: 1, available: 0, evictable: None, unit: Unit::Rows })
    );
    let s = e.returned.unwrap();
    assert_eq!(s.index(), idx);
    pool.free(a).unwrap();
    let foreign = MambaPool::new(1, cfg()).unwrap().alloc().unwrap();
    let e = pool.alloc_with(foreign).unwrap_err();
    assert!(matches!(e.error, MambaError::ForeignSlot { .. }) && e.returned.is_some());
    let row = pool.alloc_with(s).unwrap();
    assert_eq!(pool.mamba_index(row.index()), idx);
    assert!(row.track(0).is_some() && row.track(1).is_none());
    pool.free(row).unwrap();
    assert_eq!(m.available(), 4);
}

#[test]
fn ping_pong_checkpoints_and_handoff_to_the_tree() {
    let (m, pool) = rows(2, 6, 2);
    assert_eq!((pool.other_track(0), pool.other_track(1)), (1, 0));
    let mut r = pool.alloc().unwrap();
    fill(&m, &mut r, 1); // the row's working state
    let first = pool.checkpoint(&mut r).unwrap();
    assert_eq!(first, r.track(0).unwrap().index());
    assert_eq!(r.next_track(), 1);
    fill(&m, &mut r, 2);
    let want = snapshot(&m, r.mamba().unwrap());
    let second = pool.checkpoint(&mut r).unwrap();
    assert_eq!(second, r.track(1).unwrap().index());
    assert_eq!(r.next_track(), 0);
    assert_eq!(snapshot(&m, r.track(1).unwrap()), want);
    assert_ne!(snapshot(&m, r.track(0).unwrap()), want);
    // Finish: the tree keeps the newest checkpoint, the rest goes with the row.
    let kept = pool.take_checkpoint(&mut r).unwrap();
    assert_eq!(kept.index(), second);
    assert_eq!(pool.track_indices(r.index())[1], 0);
    assert!(pool.take_checkpoint(&mut r).is_none());
    let cached = m.cache(kept).unwrap();
    pool.free(r).unwrap();
    assert_eq!(m.available(), 5);
    assert_eq!(cached_snapshot(&m, cached), want);
    // With one track buffer (speculative decoding) the other track is itself.
    let (m1, spec) = rows(1, 2, HybridReqToTokenPool::track_buffers_for(true));
    assert_eq!(spec.other_track(0), 0);
    let mut r = spec.alloc().unwrap();
    spec.checkpoint(&mut r).unwrap();
    assert_eq!(r.next_track(), 0);
    let s = spec.take_mamba(&mut r).unwrap();
    assert_eq!(spec.mamba_index(r.index()), 0);
    assert_eq!(spec.checkpoint(&mut r).unwrap_err(), MambaError::NoTrackBuffers);
    spec.free(r).unwrap();
    assert!(m1.is_allocated(s.index()));
    m1.free_slot(s).unwrap();
    let (_, none) = rows(1, 1, 0);
    let mut r = none.alloc().unwrap();
    assert_eq!(none.checkpoint(&mut r).unwrap_err(), MambaError::NoTrackBuffers);
    none.free(r).unwrap();
    assert!(HybridReqToTokenPool::new(1, 1, m1, 3).is_err());
}

#[test]
fn layer_map() {
    let map = HybridLayerMap::new(6, &[5, 2], &[0, 1, 3]).unwrap();
    assert_eq!(map.kv_index(5).unwrap(), 0);
    assert_eq!(map.kv_index(2).unwrap(), 1);
    assert_eq!(map.mamba_index(3).unwrap(), 2);
    assert_eq!(map.kind(4), None);
    assert_eq!(map.full_attention_layers(), &[2, 5]);
    let e = map.kv_index(4).unwrap_err();
    assert_eq!((e.actual, e.valid.as_slice()), (None, &[2u32, 5][..]));
    let e = map.mamba_index(9).unwrap_err();
    assert_eq!((e.wanted, e.actual, e.valid.as_slice()), (LayerKind::Mamba, None, &[0u32, 1, 3][..]));
    assert_eq!(map.mamba_index(5).unwrap_err().actual, Some(LayerKind::FullAttention));
    assert!(e.to_string().contains("Mamba layers are [0, 1, 3]"), "{e}");
    assert!(HybridLayerMap::new(4, &[1, 1], &[]).is_err());
    assert!(HybridLayerMap::new(4, &[1], &[1]).is_err());
    assert!(HybridLayerMap::new(4, &[4], &[]).is_err());
}

/// A tree's state freed while a reader pins it is doomed, not refused: no new pin is
/// accepted, no caller can free it, and the last reader's unpin gives it back. (Before,
/// the tree's free was refused with `InUse` and the state, which no node named any
/// more, was never freed.)
#[test]
fn a_tree_state_freed_while_read_is_freed_by_its_last_reader() {
    let pool = MambaPool::new(2, cfg()).unwrap();
    let s = pool.cache(pool.alloc().unwrap()).unwrap();
    assert!(pool.hold_for_tree(s) && pool.is_tree_held(s));
    assert!(!pool.hold_for_tree(s), "held once");
    assert_eq!(pool.free(&[s]).unwrap_err().kind, FreeErrorKind::Cached);
    pool.read_cached(s, 0, Component::Temporal, |_| {
        pool.free_tree_held(s).unwrap();
        assert!(pool.is_allocated(s) && !pool.is_cached(s) && !pool.is_tree_held(s));
        assert_eq!(pool.fork_from(s).unwrap_err(), MambaError::NotCached { slot: s });
        assert_eq!(pool.free(&[s]).unwrap_err().kind, FreeErrorKind::NotAllocated);
        assert!(pool.free_tree_held(s).is_err(), "freed by the tree once");
    })
    .unwrap();
    assert!(!pool.is_allocated(s));
    assert_eq!(pool.available(), 2);
    pool.check_invariants().unwrap();
    // Without a reader the tree's free is immediate; a caller's state is not the tree's.
    let t = pool.cache(pool.alloc().unwrap()).unwrap();
    assert!(pool.free_tree_held(t).is_err());
    assert!(pool.hold_for_tree(t));
    pool.release_from_tree(t);
    assert!(!pool.is_tree_held(t) && pool.hold_for_tree(t));
    pool.free_tree_held(t).unwrap();
    assert_eq!(pool.available(), 2);
    pool.check_invariants().unwrap();
}
