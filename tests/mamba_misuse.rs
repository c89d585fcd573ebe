//! Misuse of the Mamba pools' public API: each call here was once accepted (or
//! panicked) and let two live owners share one state, leaked states, or crashed. Now
//! each is impossible by construction (checked by the `compile_fail` examples on
//! `HybridRow`) or a typed error that changes nothing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use kvpool::mamba::{
    Component, HybridReqToTokenPool, MambaConfig, MambaError, MambaPool, MambaSlot, StateDtype, StateShape,
};
use kvpool::radix::{CacheError, MambaRadixCache, RadixConfig, StatePool};
use kvpool::{ConfigError, FreeErrorKind, ReqToTokenPool, RowError, SlotPool, TokenAllocator};

fn cfg() -> MambaConfig {
    MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) }
}

/// Every live row's table entries name exactly the slots it holds, and no slot is
/// named twice.
fn assert_tables_match(rows: &HybridReqToTokenPool, live: &[&kvpool::mamba::HybridRow]) {
    let mut seen = Vec::new();
    for r in live {
        let m = r.mamba().map_or(0, MambaSlot::index);
        assert_eq!(rows.mamba_index(r.index()), m, "row {}", r.index());
        let t = [0, 1].map(|i| r.track(i).map_or(0, MambaSlot::index));
        assert_eq!(rows.track_indices(r.index()), t, "row {}", r.index());
        for s in [m, t[0], t[1]].into_iter().filter(|&s| s != 0) {
            assert!(!seen.contains(&s), "slot {s} named by two rows");
            seen.push(s);
        }
    }
}

// -------------------------------------------------------------------------------------
// A row's state and token row cannot be swapped out. `HybridRow::mamba_mut` used to
// hand out `&mut MambaSlot` (and `req_row_mut` `&mut ReqRow`), so `mem::replace` could
// put another handle in the row behind the pool's back: `mamba_index` then named a slot
// the caller had freed, the next `alloc` got it too, and two live rows shared one state.
// Both are gone (see the `compile_fail` examples on `HybridRow`); the row's state is
// written by passing the row itself, its tokens through the pool.
// -------------------------------------------------------------------------------------

#[test]
fn a_rows_state_is_written_through_the_row_and_the_tables_stay_right() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let rows = HybridReqToTokenPool::new(4, 16, Arc::clone(&mamba), 0).unwrap();
    let mut a = rows.alloc().unwrap();
    let mut other = mamba.alloc().unwrap();
    // The row's working state, through the row: no handle leaves it.
    mamba.component_mut::<f32>(&mut a, 0, Component::Temporal).unwrap()[0] = 3.0;
    mamba.copy_slot(&a, &mut other).unwrap();
    mamba.component_mut::<f32>(&mut other, 0, Component::Temporal).unwrap()[1] = 4.0;
    mamba.copy_slot(&other, &mut a).unwrap();
    assert_eq!(mamba.component::<f32>(&a, 0, Component::Temporal).unwrap(), &[3.0, 4.0, 0.0, 0.0]);
    mamba.zero_slot(&mut a).unwrap();
    assert_eq!(mamba.component::<f32>(&a, 0, Component::Temporal).unwrap(), &[0.0; 4]);
    let cached = mamba.cache(other).unwrap();
    mamba.copy_from(&[cached], &mut [&mut a]).unwrap();
    assert_eq!(mamba.component::<f32>(&a, 0, Component::Temporal).unwrap()[1], 4.0);
    // The audit's sequence, as far as it can still go: free a spare handle and allocate
    // again; the tables still give each live row its own state.
    let spare = mamba.alloc().unwrap();
    mamba.free_slot(spare).unwrap();
    let b = rows.alloc().unwrap();
    assert_tables_match(&rows, &[&a, &b]);
    assert_ne!(rows.mamba_index(a.index()), rows.mamba_index(b.index()));
    // The row's tokens, through the pool.
    rows.write(&mut a, 0, &[7, 8]).unwrap();
    assert_eq!(rows.read(&a, 0..2).unwrap(), &[7, 8]);
    rows.read_mut(&mut a, 0..1).unwrap()[0] = 9;
    assert_eq!(rows.read(&a, 0..2).unwrap(), &[9, 8]);
    assert!(matches!(rows.write(&mut a, 15, &[1, 2]), Err(RowError::OutOfBounds { .. })));
    rows.free(a).unwrap();
    rows.free(b).unwrap();
    mamba.free(&[cached]).unwrap();
    assert_eq!(mamba.available(), 4);
    rows.check_invariants().unwrap();
}

#[test]
fn a_row_whose_state_was_taken_has_none_to_write() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let rows = HybridReqToTokenPool::new(1, 16, Arc::clone(&mamba), 0).unwrap();
    let mut a = rows.alloc().unwrap();
    let s = rows.take_mamba(&mut a).unwrap();
    let e = mamba.component_mut::<f32>(&mut a, 0, Component::Temporal).unwrap_err();
    assert_eq!(e, MambaError::NoWorkingState);
    assert_eq!(mamba.zero_slot(&mut a).unwrap_err(), MambaError::NoWorkingState);
    let mut t = mamba.alloc().unwrap();
    assert_eq!(mamba.copy_slot(&a, &mut t).unwrap_err(), MambaError::NoWorkingState);
    assert_eq!(mamba.copy_slot(&s, &mut a).unwrap_err(), MambaError::NoWorkingState);
    rows.free(a).unwrap();
    mamba.free_slot(s).unwrap();
    mamba.free_slot(t).unwrap();
    assert_eq!(mamba.available(), 4);
}

// -------------------------------------------------------------------------------------
// `HybridReqToTokenPool::free` into another hybrid pool sharing the same `MambaPool`
// returned `Err(Row(ForeignRow))` but dropped the row's Mamba slots unfreed: the shared
// pool lost them for good. Now it checks first and hands the row back whole.
// -------------------------------------------------------------------------------------

#[test]
fn a_refused_hybrid_free_hands_the_row_back_and_frees_nothing() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let rows_a = HybridReqToTokenPool::new(2, 16, Arc::clone(&mamba), 2).unwrap();
    let rows_b = HybridReqToTokenPool::new(2, 16, Arc::clone(&mamba), 2).unwrap();
    let mut h = rows_a.alloc().unwrap(); // 3 Mamba slots
    rows_a.write(&mut h, 0, &[1, 2, 3]).unwrap();
    assert_eq!(mamba.available(), 1);
    let idx = (h.index(), h.mamba().unwrap().index(), rows_a.track_indices(h.index()));
    let e = rows_b.free(h).unwrap_err();
    assert!(matches!(e.error, MambaError::Row(RowError::ForeignRow { .. })), "{:?}", e.error);
    let h = e.row;
    // Nothing changed: the row, its slots and both pools' tables are as they were.
    assert_eq!((h.index(), h.mamba().unwrap().index(), rows_a.track_indices(h.index())), idx);
    assert_eq!(rows_a.mamba_index(h.index()), idx.1);
    assert_eq!(mamba.available(), 1);
    assert_eq!(rows_a.read(&h, 0..3).unwrap(), &[1, 2, 3]);
    assert_eq!((rows_a.available_size(), rows_b.available_size()), (1, 2));
    // Into its own pool it goes, with every slot.
    rows_a.free(h).unwrap();
    assert_eq!(mamba.available(), 4, "no Mamba slot leaked");
    rows_a.check_invariants().unwrap();
}

/// The other calls that take a row refuse another pool's row too, changing nothing
/// (`take_mamba` of a row numbered past this pool's size used to panic, and one within
/// it cleared another live row's table entry).
#[test]
fn another_pools_row_is_refused_by_take_and_checkpoint() {
    let mamba = Arc::new(MambaPool::new(9, cfg()).unwrap());
    let small = HybridReqToTokenPool::new(1, 16, Arc::clone(&mamba), 2).unwrap();
    let big = HybridReqToTokenPool::new(3, 16, Arc::clone(&mamba), 2).unwrap();
    let mine = small.alloc().unwrap();
    let r0 = big.alloc().unwrap();
    let mut far = big.alloc().unwrap(); // row 1: past `small`'s size
    let r = catch_unwind(AssertUnwindSafe(|| {
        (
            small.take_mamba(&mut far).is_none(),
            small.take_track(&mut far, 0).is_none(),
            small.take_checkpoint(&mut far).is_none(),
        )
    }));
    assert_eq!(r.ok(), Some((true, true, true)), "another pool's row must be refused without a panic");
    assert!(matches!(small.checkpoint(&mut far), Err(MambaError::Row(RowError::ForeignRow { .. }))));
    assert_eq!(far.next_track(), 0);
    assert!(far.mamba().is_some() && far.track(0).is_some() && far.track(1).is_some());
    assert_tables_match(&small, &[&mine]);
    assert_tables_match(&big, &[&far]);
    assert!(matches!(small.write(&mut far, 0, &[1]), Err(RowError::ForeignRow { .. })));
    assert!(small.read(&far, 0..1).is_err());
    big.free(far).unwrap();
    big.free(r0).unwrap();
    small.free(mine).unwrap();
    assert_eq!(mamba.available(), 9);
}

// -------------------------------------------------------------------------------------
// `HybridReqToTokenPool::other_track(i)` was `1 - i`: it panicked (debug) or wrapped
// (release) for `i >= 2`. Now it is total.
// -------------------------------------------------------------------------------------

#[test]
fn other_track_is_total() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let two = HybridReqToTokenPool::new(2, 16, Arc::clone(&mamba), 2).unwrap();
    let one = HybridReqToTokenPool::new(2, 16, Arc::clone(&mamba), 1).unwrap();
    let none = HybridReqToTokenPool::new(2, 16, mamba, 0).unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| {
        [0, 1, 2, 3, usize::MAX].map(|i| (two.other_track(i), one.other_track(i), none.other_track(i)))
    }));
    let got = r.expect("other_track panicked");
    assert_eq!(got[0], (1, 0, 0));
    assert_eq!(got[1], (0, 1, 1));
    assert_eq!(got[2], (1, 2, 2));
    assert_eq!(got[3], (0, 3, 3));
    assert_eq!(got[4].0, 0);
}

// -------------------------------------------------------------------------------------
// `MambaConfig::row_bytes` multiplied `elements * dtype.bytes()` unchecked: a shape
// whose element count fits a `usize` but whose bytes do not made `MambaPool::new` panic
// (debug) or build a pool with a wrapped, tiny row (release).
// -------------------------------------------------------------------------------------

#[test]
fn a_state_row_too_large_for_usize_is_a_config_error() {
    for (dims, dtype) in [
        (vec![usize::MAX / 2 + 1], StateDtype::F32),
        (vec![usize::MAX / 2 + 1], StateDtype::Bf16),
        (vec![1 << 32, 1 << 31], StateDtype::F16),
    ] {
        let shape = StateShape::new(&dims, dtype);
        for cfg in [
            MambaConfig { layers: 1, conv: vec![], temporal: shape.clone() },
            MambaConfig { layers: 1, conv: vec![shape.clone()], temporal: StateShape::new(&[4], StateDtype::F32) },
        ] {
            assert_eq!(
                cfg.row_bytes(kvpool::mamba::Component::Temporal).max(cfg.row_bytes(Component::Conv(0))),
                usize::MAX
            );
            let r = catch_unwind(AssertUnwindSafe(|| MambaPool::new(1, cfg.clone()).map(|_| ())));
            let r = r.unwrap_or_else(|_| panic!("MambaPool::new panicked on {dims:?} x {dtype:?}"));
            assert!(matches!(r, Err(ConfigError::TooLargeForMemory { .. })), "{dims:?} x {dtype:?}: {r:?}");
        }
    }
    // Just fitting: the row's bytes are fine, the buffers are too large for memory.
    let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[usize::MAX / 4], StateDtype::F32) };
    assert_eq!(cfg.row_bytes(Component::Temporal), usize::MAX / 4 * 4);
    assert!(matches!(MambaPool::new(1, cfg), Err(ConfigError::TooLargeForMemory { .. })));
}

// -------------------------------------------------------------------------------------
// Two `MambaRadixCache`s over one state pool shared through an `Arc`: each records only
// its own nodes' states, so a state cache A held was adopted by cache B as well (one
// slot, two owners). A shared pool now serves one live cache at a time.
// -------------------------------------------------------------------------------------

/// A request for `tokens` served and finished with its state saved after them; returns
/// the saved state's slot and whether the tree kept it.
fn serve<P: StatePool>(c: &Arc<MambaRadixCache<TokenAllocator, P>>, tokens: &[u32]) -> (u32, bool) {
    let mut r = c.admit(0, tokens).unwrap();
    r.extend(tokens.len() - r.len()).unwrap();
    let state = r.save_state(tokens.len()).unwrap();
    (state, r.finish(tokens).unwrap().state_kept)
}

/// Cache B can no longer be built while A holds the pool, so A's state cannot be
/// handed to it.
#[test]
fn mamba_state_held_by_one_cache_is_adopted_by_another_sharing_the_pool() {
    let pool = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let mk = || {
        MambaRadixCache::with_states(
            TokenAllocator::new(64).unwrap(),
            ReqToTokenPool::new(2, 64).unwrap(),
            Arc::clone(&pool),
            RadixConfig::default(),
        )
        .map(Arc::new)
    };
    let a = mk().unwrap();
    let (state, kept) = serve(&a, &[1, 2, 3, 4]);
    assert!(kept && a.states().is_held(state) && pool.is_tree_held(state));
    // A second cache over the same pool.
    assert!(matches!(mk(), Err(ConfigError::Unsupported { .. })));
    a.check_invariants().unwrap();
    // Once A is gone, the pool may serve another cache; A's states went back with it.
    drop(a);
    assert_eq!(pool.available(), 4);
    let b = mk().unwrap();
    b.check_invariants().unwrap();
    // Pools that are not shared need no claim: two caches over two pools are fine.
    let other = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let c = MambaRadixCache::with_states(
        TokenAllocator::new(64).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        other,
        RadixConfig::default(),
    );
    assert!(c.is_ok());
    drop(b);
}

// -------------------------------------------------------------------------------------
// A state the tree holds could be freed by number behind its back: an `Arc` of the
// pool reached `MambaPool::free` directly. The slot went back to the free list while a
// node still named it; the next request got it, and eviction later freed the request's
// state (or a second node adopted it). Now a `MambaPool` marks the tree's states in its
// state words (so every path to its `free` refuses them), and an `Arc<SlotPool>`, which
// keeps no marks, is no longer a state pool.
// -------------------------------------------------------------------------------------

/// Every live request's state is its own: never one the tree holds, never another
/// request's. The tree's state goes to a request only once evicted for it, and never
/// while a request resumes from it.
#[test]
fn a_tree_held_state_is_never_a_live_requests() {
    let c = Arc::new(
        MambaRadixCache::with_states(
            TokenAllocator::new(64).unwrap(),
            ReqToTokenPool::new(4, 64).unwrap(),
            SlotPool::without_magazines(4),
            RadixConfig::default(),
        )
        .unwrap(),
    );
    let (state, kept) = serve(&c, &[1, 2, 3, 4]);
    assert!(kept && c.states().is_held(state));
    // A request resuming from it, and two more: the last free states.
    let resuming = c.admit(0, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!((resuming.cached_len(), resuming.resume_state()), (4, Some(state)));
    let others: Vec<_> = (0..2).map(|i| c.admit(0, &[100 + i]).unwrap()).collect();
    let mut running: Vec<u32> = others.iter().chain([&resuming]).map(|r| r.state()).collect();
    assert!(running.iter().all(|&s| s != state && !c.states().is_held(s) && c.states().is_allocated(s)));
    running.sort_unstable();
    running.dedup();
    assert_eq!(running.len(), 3, "two live requests share a state");
    assert_eq!(c.states().available(), 0);
    // No state is free and the tree's is locked by the request resuming from it: an
    // admission is refused, nothing changed.
    assert!(c.admit(0, &[7]).is_err());
    assert!(c.states().is_held(state));
    c.check_invariants().unwrap();
    // The resuming request ends: its running state is free again and goes to the next
    // admission; the tree's, unlocked now, is evicted for the one after, which gets it.
    drop(resuming);
    let next = c.admit(0, &[8]).unwrap();
    assert!(next.state() != state && c.states().is_held(state));
    let last = c.admit(0, &[9]).unwrap();
    assert_eq!(last.state(), state);
    assert!(!c.states().is_held(state) && c.states().is_allocated(state));
    assert!(c.admit(0, &[1, 2, 3, 4]).is_err(), "no state left for a request");
    c.check_invariants().unwrap();
    drop((next, last, others));
    assert_eq!(c.states().available(), 4);
    c.check_invariants().unwrap();
}

#[test]
fn a_tree_held_state_cannot_be_freed_through_the_mamba_pool() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let c = MambaRadixCache::with_states(
        TokenAllocator::new(64).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        Arc::clone(&mamba),
        RadixConfig::default(),
    );
    let c = Arc::new(c.unwrap());
    let (state, kept) = serve(&c, &[1, 2, 3, 4]);
    assert!(kept && mamba.is_tree_held(state));
    let r = c.admit(0, &[9]).unwrap();
    assert!(!mamba.is_tree_held(r.state()) && mamba.is_allocated(r.state()));
    // The pool's own `free` through the caller's `Arc`, and through the cache's view and
    // the trait.
    for e in [mamba.free(&[state]).unwrap_err(), StatePool::free(c.states().pool(), &[state]).unwrap_err()] {
        assert_eq!((e.index, e.kind), (state, FreeErrorKind::Cached));
    }
    assert!(mamba.is_cached(state) && c.states().is_held(state));
    // A reader may still fork from it (copy-on-write), as before.
    let fork = mamba.fork_from(state).unwrap();
    mamba.free_slot(fork).unwrap();
    drop(r);
    c.check_invariants().unwrap();
    mamba.check_invariants().unwrap();
    // Dropping the cache gives the tree's states back to the shared pool.
    drop(c);
    assert!(!mamba.is_tree_held(state) && !mamba.is_allocated(state));
    assert_eq!(mamba.available(), 4);
    mamba.check_invariants().unwrap();
}

/// A finish refused after the request saved its state (here: tokens that disagree with
/// its locked prefix) leaves the state the request's: not the tree's, and it goes back
/// with the request; the request handed back finishes and the tree keeps it then.
#[test]
fn a_refused_finish_leaves_the_state_the_requests() {
    let mamba = Arc::new(MambaPool::new(4, cfg()).unwrap());
    let c = MambaRadixCache::with_states(
        TokenAllocator::new(64).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        Arc::clone(&mamba),
        RadixConfig::default(),
    );
    let c = Arc::new(c.unwrap());
    let (state, _) = serve(&c, &[1, 2, 3, 4]);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let mut r = c.admit(0, &tokens).unwrap();
    assert_eq!(r.cached_len(), 4);
    r.extend(4).unwrap();
    let saved = r.save_state(8).unwrap();
    let before = (mamba.available(), c.total_size(), c.leaf_paths());
    let mut wrong = tokens;
    wrong[0] = 99;
    let refused = r.finish(&wrong).unwrap_err();
    assert!(matches!(refused.error, CacheError::RowMismatch { .. }), "{:?}", refused.error);
    // The pool counts the saved copy as the cache's (no free by number reaches it), the
    // tree does not hold it.
    assert!(mamba.is_allocated(saved) && mamba.is_tree_held(saved) && !c.states().is_held(saved));
    assert_eq!((mamba.available(), c.total_size(), c.leaf_paths()), before);
    assert!(mamba.is_tree_held(state));
    c.check_invariants().unwrap();
    // Finished properly, the tree keeps it.
    assert!(refused.request.finish(&tokens).unwrap().state_kept);
    assert!(mamba.is_tree_held(saved));
    c.check_invariants().unwrap();
    // A refused request dropped gives its states back.
    let mut r = c.admit(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).unwrap();
    r.extend(4).unwrap();
    let saved = r.save_state(12).unwrap();
    let refused = r.finish(&[0; 11]).unwrap_err();
    assert!(matches!(refused.error, CacheError::TokenCount { .. }), "{:?}", refused.error);
    drop(refused);
    assert!(!mamba.is_allocated(saved));
    assert_eq!(mamba.available(), 2);
    c.check_invariants().unwrap();
    mamba.check_invariants().unwrap();
}
