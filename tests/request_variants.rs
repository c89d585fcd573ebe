//! The request handle on the Mamba, SWA and host-tier trees: the same lifecycle, with
//! each tree's own holdings (states, window KV, loaded pages) given back on every path.

use std::sync::Arc;

use kvpool::alloc::SwaAllocator;
use kvpool::radix::{
    CacheError, HiRadixCache, HostHit, HostTier, MambaRadixCache, RadixConfig, StateInsert, SwaRadixCache, Transfer,
    TransferKind, WritePolicy,
};
use kvpool::{PagedAllocator, ReqToTokenPool, SlotPool};

fn mamba(tokens: usize, states: u32) -> Arc<MambaRadixCache<PagedAllocator>> {
    let (kv, rows) = (PagedAllocator::new(tokens, 4).unwrap(), ReqToTokenPool::new(4, 128).unwrap());
    Arc::new(
        MambaRadixCache::with_states(kv, rows, SlotPool::without_magazines(states), RadixConfig::default()).unwrap(),
    )
}

/// A Mamba request takes a running state at admission and a state to cache with; the
/// finish caches up to that state's position and frees the rest; the next request
/// resumes from it. Every state goes back on finish, abort and drop.
#[test]
fn mamba_requests_hold_and_give_back_their_states() {
    let c = mamba(256, 6);
    let free_states = |c: &MambaRadixCache<PagedAllocator>| c.states().available();
    assert_eq!(free_states(&c), 6);
    let tokens: Vec<u32> = (1..=22).collect();
    let mut r = c.admit(0, &tokens).unwrap();
    assert_eq!((r.cached_len(), r.resume_state(), free_states(&c)), (0, None, 5));
    let saved = r.save_state(16).unwrap();
    assert_ne!(saved, r.state());
    assert_eq!(free_states(&c), 4);
    assert!(r.save_state(17).is_err(), "not a whole page");
    r.extend(22).unwrap();
    // A checkpoint must be exactly where the state was saved.
    assert_eq!(r.checkpoint(&tokens[..20]), Err(CacheError::SavedState { at: Some(16), up_to: 20 }));
    let done = r.finish(&tokens).unwrap();
    assert_eq!(done, StateInsert { cached: 0, state_kept: true });
    // Cached: 16 tokens with the state; the running state and the tail are free.
    assert_eq!((c.total_size(), free_states(&c), c.mamba_evictable_size()), (16, 5, 1));
    c.check_invariants().unwrap();

    let again = c.admit(0, &tokens).unwrap();
    assert_eq!((again.cached_len(), again.resume_state()), (16, Some(saved)));
    assert_eq!(c.mamba_protected_size(), 1);
    drop(again); // aborted: its running state, its lock
    assert_eq!((free_states(&c), c.mamba_protected_size()), (5, 0));

    // Nothing saved: the finish caches nothing new and frees everything it took.
    let mut r = c.admit(0, &tokens).unwrap();
    r.extend(6).unwrap();
    let kv: Vec<u32> = tokens.clone();
    assert_eq!(r.finish(&kv).unwrap(), StateInsert { cached: 16, state_kept: false });
    assert_eq!((c.total_size(), free_states(&c)), (16, 5));

    // A saved state past the end: refused, nothing changed; abort frees both states.
    let mut r = c.admit(0, &tokens).unwrap();
    r.save_state(24).unwrap();
    r.extend(6).unwrap();
    let refused = r.finish(&tokens).unwrap_err();
    assert_eq!(refused.error, CacheError::SavedState { at: Some(24), up_to: 22 });
    assert_eq!(free_states(&c), 3);
    refused.request.abort();
    assert_eq!(free_states(&c), 5);
    c.check_invariants().unwrap();
    assert_eq!(c.allocator().available_size() + c.total_size(), 256);
}

/// A chunked prefill on the Mamba tree: a checkpoint with the state saved at its end
/// caches the chunk and keeps running; the next state slot is taken afresh.
#[test]
fn mamba_checkpoints_cache_chunks_with_their_state() {
    let c = mamba(256, 6);
    let tokens: Vec<u32> = (1..=24).collect();
    let mut r = c.admit(0, &tokens).unwrap();
    r.extend(8).unwrap();
    r.save_state(8).unwrap();
    r.checkpoint(&tokens[..8]).unwrap();
    assert_eq!((r.cached_len(), c.total_size(), c.mamba_protected_size()), (8, 8, 1));
    assert_eq!(r.checkpoint(&tokens[..8]), Ok(()), "nothing past the lock: nothing to do");
    r.extend(16).unwrap();
    assert_eq!(r.checkpoint(&tokens[..16]), Err(CacheError::SavedState { at: None, up_to: 16 }));
    r.save_state(24).unwrap();
    assert!(r.finish(&tokens).unwrap().state_kept);
    assert_eq!((c.total_size(), c.mamba_evictable_size(), c.states().available()), (24, 2, 4));
    c.check_invariants().unwrap();
}

/// A Mamba admission with every state locked fails cleanly: no row, no lock kept.
#[test]
fn mamba_admission_without_a_state_changes_nothing() {
    let c = mamba(64, 2);
    let a = c.admit(0, &[1, 2, 3, 4]).unwrap();
    let b = c.admit(0, &[5, 6, 7, 8]).unwrap();
    let rows = c.req_pool().available_size();
    assert!(matches!(c.admit(0, &[1]), Err(kvpool::AllocError::OutOfMemory(_))));
    assert_eq!(c.req_pool().available_size(), rows);
    drop((a, b));
    assert_eq!(c.states().available(), 2);
}

fn swa(full: usize, window_pool: usize, window: usize) -> Arc<SwaRadixCache> {
    let alloc = SwaAllocator::new(full, window_pool, 4).unwrap();
    Arc::new(
        SwaRadixCache::with_window(alloc, ReqToTokenPool::new(4, 128).unwrap(), RadixConfig::default(), window)
            .unwrap(),
    )
}

/// An SWA request releases the window KV that left its window, only over positions it
/// holds; the finish caches it (pages without window KV as tombstones) and everything
/// else goes back, in both pools.
#[test]
fn swa_requests_release_their_window_only_over_what_they_hold() {
    let c = swa(256, 128, 8);
    let window_free = |c: &SwaRadixCache| c.allocator().window_available_size();
    let tokens: Vec<u32> = (1..=30).collect();
    let mut r = c.admit(0, &tokens).unwrap();
    r.extend(30).unwrap();
    let before = (window_free(&c), c.allocator().full_available_size());
    assert_eq!(r.release_window(0..31), Err(CacheError::TokenCount { tokens: 31, held: 30 }));
    assert_eq!((window_free(&c), c.allocator().full_available_size()), before);
    assert_eq!(r.release_window(0..16).unwrap(), 16);
    assert_eq!(window_free(&c), before.0 + 16);
    let kv: Vec<u32> = tokens[..30].to_vec();
    r.finish(&kv).unwrap();
    assert_eq!(c.total_size(), 28);
    c.check_invariants().unwrap();

    // A dropped SWA request gives back both pools.
    let before = (window_free(&c), c.allocator().full_available_size());
    {
        let mut r = c.admit(0, &(100..140).collect::<Vec<_>>()).unwrap();
        r.extend(40).unwrap();
        r.release_window(0..12).unwrap();
    }
    assert_eq!((window_free(&c), c.allocator().full_available_size()), before);
    c.check_invariants().unwrap();
}

/// A host-tier admission loads the host copy back under the request's lock; the
/// request finishes as on the plain tree.
#[test]
fn host_tier_requests_load_back_at_admission() {
    let tier = HostTier { host_pages: 8, write_policy: WritePolicy::WriteThrough, load_back_threshold: 1 };
    let c = Arc::new(
        HiRadixCache::with_host_tier(
            PagedAllocator::new(16, 2).unwrap(),
            ReqToTokenPool::new(2, 16).unwrap(),
            RadixConfig::default(),
            tier,
        )
        .unwrap(),
    );
    let mut started = [Transfer::default(); 8];
    let mut complete_all = |c: &HiRadixCache<PagedAllocator>| {
        let n = c.take_transfers(&mut started);
        for t in &started[..n] {
            c.complete(*t).unwrap();
        }
        started[..n].iter().map(|t| t.kind()).collect::<Vec<_>>()
    };
    let tokens = [1, 2, 3, 4, 5, 6];
    let mut r = c.admit(0, &tokens).unwrap();
    assert_eq!(r.host_hit(), HostHit::default());
    r.extend(6).unwrap();
    r.finish(&tokens).unwrap();
    assert_eq!(complete_all(&c), [TransferKind::Backup]);
    assert_eq!(c.evict(6), 6); // the device copy goes, the host copy stays

    let r = c.admit(0, &tokens).unwrap();
    assert_eq!((r.cached_len(), r.len()), (6, 6));
    assert_eq!(r.host_hit(), HostHit { matched: 6, loaded: 6 });
    assert_eq!(complete_all(&c), [TransferKind::Load]);
    assert_eq!(c.protected_size(), 6);
    r.finish(&tokens).unwrap();
    assert_eq!(c.protected_size(), 0);
    c.check_invariants().unwrap();
}

/// A reset while a taken backup still copies leaves its device pages to it: the
/// accounting counts them until the transfer completes.
#[test]
fn host_tier_accounting_counts_the_pages_a_reset_leaves_to_transfers() {
    let tier = HostTier { host_pages: 8, write_policy: WritePolicy::WriteThrough, load_back_threshold: 1 };
    let mut c = Arc::new(
        HiRadixCache::with_host_tier(
            PagedAllocator::new(16, 2).unwrap(),
            ReqToTokenPool::new(2, 16).unwrap(),
            RadixConfig::default(),
            tier,
        )
        .unwrap(),
    );
    let tokens = [1, 2, 3, 4, 5, 6];
    let mut r = c.admit(0, &tokens).unwrap();
    r.extend(6).unwrap();
    r.finish(&tokens).unwrap();
    let mut started = [Transfer::default(); 8];
    assert_eq!(c.take_transfers(&mut started), 1);
    Arc::get_mut(&mut c).expect("no request holds the cache").reset().unwrap();
    assert_eq!((c.total_size(), c.allocator().available_size()), (0, 10));
    c.check_invariants().unwrap();
    c.complete(started[0]).unwrap();
    assert_eq!(c.allocator().available_size(), 16);
    c.check_invariants().unwrap();
}

/// Over a `MambaPool` a request owns its running state's bytes: it writes them through
/// the pool as their only holder, nobody can read or free them by number meanwhile, a
/// save copies them into a frozen state, and the next request on the prefix starts
/// from a fork of that copy. Everything goes back on finish, abort, drop.
#[test]
fn mamba_pool_requests_own_their_state_bytes() {
    use kvpool::mamba::{Component, MambaConfig, MambaError, MambaPool, StateDtype, StateShape};
    use kvpool::FreeErrorKind;

    let cfg = || MambaConfig { layers: 2, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
    let pool = Arc::new(MambaPool::new(6, cfg()).unwrap());
    let (kv, rows) = (PagedAllocator::new(256, 4).unwrap(), ReqToTokenPool::new(4, 128).unwrap());
    let c = Arc::new(MambaRadixCache::with_states(kv, rows, Arc::clone(&pool), RadixConfig::default()).unwrap());
    let first = |p: &MambaPool, slot: u32| {
        p.read_cached(slot, 1, Component::Temporal, |b| f32::from_le_bytes(b[..4].try_into().unwrap()))
    };
    let tokens: Vec<u32> = (1..=16).collect();

    let mut r = c.admit(0, &tokens).unwrap();
    assert_eq!((r.resume_state(), pool.available()), (None, 5));
    pool.component_mut::<f32>(&mut r, 1, Component::Temporal).unwrap()[0] = 1.5;
    // Held by the request alone: not readable nor freeable by number.
    assert_eq!(first(&pool, r.state()), Err(MambaError::NotCached { slot: r.state() }));
    assert_eq!(pool.free(&[r.state()]).unwrap_err().kind, FreeErrorKind::InUse);
    let saved = r.save_state(16).unwrap();
    assert_eq!(first(&pool, saved), Ok(1.5));
    // The saved copy is the cache's: nobody frees it by number behind the request.
    assert_eq!(pool.free(&[saved]).unwrap_err().kind, FreeErrorKind::Cached);
    // The saved copy is frozen: the running state goes on.
    pool.component_mut::<f32>(&mut r, 1, Component::Temporal).unwrap()[0] = 2.5;
    assert_eq!(first(&pool, saved), Ok(1.5));
    // Saving again copies anew and frees the previous copy.
    let again = r.save_state(16).unwrap();
    assert_eq!((first(&pool, again), pool.is_allocated(saved) && saved != again), (Ok(2.5), false));
    assert_eq!(pool.available(), 4);
    r.extend(16).unwrap();
    assert_eq!(r.finish(&tokens).unwrap(), StateInsert { cached: 0, state_kept: true });
    assert_eq!(pool.available(), 5, "the running state went back; the tree holds the saved one");
    assert_eq!(pool.free(&[again]).unwrap_err().kind, FreeErrorKind::Cached);

    // The next request on the prefix starts from a fork of the cached state.
    let mut next = c.admit(0, &tokens).unwrap();
    assert_eq!((next.cached_len(), next.resume_state()), (16, Some(again)));
    assert_eq!(pool.component::<f32>(&next, 1, Component::Temporal).unwrap()[0], 2.5);
    pool.component_mut::<f32>(&mut next, 1, Component::Temporal).unwrap()[0] = 9.0;
    assert_eq!(first(&pool, again), Ok(2.5), "the cached state is never written");
    // Another pool does not take this request's state for its own.
    let other = MambaPool::new(2, cfg()).unwrap();
    assert!(matches!(other.component::<f32>(&next, 1, Component::Temporal), Err(MambaError::ForeignSlot { .. })));
    // A refused finish keeps the saved state the request's; the abort frees it.
    let saved_next = next.save_state(16).unwrap();
    next.extend(4).unwrap();
    let refused = next.finish(&tokens).unwrap_err();
    assert_eq!(refused.error, CacheError::TokenCount { tokens: 16, held: 20 });
    assert_eq!(pool.free(&[saved_next]).unwrap_err().kind, FreeErrorKind::Cached);
    assert_eq!(pool.available(), 3);
    drop(refused);
    assert_eq!(pool.available(), 5);
    c.check_invariants().unwrap();

    // Over a `SlotPool` the states live with the engine: no bytes to reach.
    let numbers = mamba(64, 2);
    let r = numbers.admit(0, &[1, 2, 3, 4]).unwrap();
    assert_eq!(pool.component::<f32>(&r, 0, Component::Temporal), Err(MambaError::NoStateBytes));
    drop(r);
    drop(c);
    assert_eq!(pool.available(), 6, "the cache gave its states back when dropped");
}
