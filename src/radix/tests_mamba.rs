//! The Mamba variant: SGLang's `MambaRadixCache` semantics on the shared core.

use proptest::prelude::*;

use super::*;
use crate::{ConfigError, PagedAllocator, SlotPool, TokenAllocator};

type Cache = MambaRadixCache<TokenAllocator>;

fn cache(tokens: usize, states: u32) -> Cache {
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: Some(4096), ..RadixConfig::default() };
    MambaRadixCache::with_states(
        TokenAllocator::new(tokens).unwrap(),
        ReqToTokenPool::new(8, 4096).unwrap(),
        SlotPool::without_magazines(states),
        config,
    )
    .unwrap()
}

fn kv<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    c.allocator().alloc(&mut v).unwrap();
    v
}

fn toks(parts: &[(u32, usize)]) -> Vec<u32> {
    parts.iter().flat_map(|&(t, n)| std::iter::repeat(t).take(n)).collect()
}

/// Insert `key` as a request would: fresh KV for every token, the duplicates freed.
fn put(c: &Cache, key: &[u32]) -> StateInsert {
    let slots = kv(c, key.len());
    let state = c.alloc_state().unwrap();
    let r = c.insert(0, key, &slots, state).unwrap();
    c.allocator().free(&slots[..r.cached]).unwrap();
    c.check_invariants().unwrap();
    r
}

fn matched(c: &Cache, key: &[u32]) -> usize {
    let mut out = vec![0u32; key.len()];
    c.match_prefix(0, key, &mut out).len()
}

#[test]
fn a_match_ends_at_the_deepest_state() {
    let c = cache(64, 8);
    let a = [1, 2, 3, 4, 5, 6, 7, 8];
    assert!(put(&c, &a).state_kept);
    // A match that ends inside the node splits it; the upper half has no state.
    assert_eq!(matched(&c, &[1, 2, 3, 4, 9]), 0);
    assert_eq!(c.node_count(), 2);
    assert!(c.pretty_print().contains("tombstone"));
    assert_eq!(matched(&c, &a), 8);
    // Inserting exactly the tombstone's tokens gives it a state.
    assert!(put(&c, &[1, 2, 3, 4]).state_kept);
    assert_eq!(matched(&c, &[1, 2, 3, 4, 9]), 4);
    // The same key again: a state is there already, the new one goes back to the pool.
    let before = c.states().available();
    let r = put(&c, &[1, 2, 3, 4]);
    assert_eq!((r.cached, r.state_kept), (4, false));
    assert_eq!(c.states().available(), before);
    assert_eq!((c.mamba_evictable_size(), c.mamba_protected_size()), (2, 0));
    c.check_invariants().unwrap();
}

/// Seed 003's hybrid-model scenarios R1-R8 (256-token segments, checkpoints at
/// multiples of 64), at page sizes 1, 16 and 64, with the hit lengths the seed states.
/// The seed's rule for what a request caches: if its match branched (the KV matched
/// further than the deepest state), it checkpoints at the branching point aligned down
/// to 64 and caches its prompt up to there; otherwise it checkpoints at the last
/// 64-aligned point of its prompt.
#[test]
fn seed_scenarios_r1_to_r8() {
    for ps in [1u32, 16, 64] {
        let c = MambaRadixCache::with_states(
            PagedAllocator::new(8192, ps).unwrap(),
            ReqToTokenPool::new(2, 1024).unwrap(),
            SlotPool::without_magazines(16),
            RadixConfig::default(),
        )
        .unwrap();
        let seg = |ids: &[u32]| toks(&ids.iter().map(|&t| (t, 256)).collect::<Vec<_>>());
        let request = |ids: &[u32]| -> (usize, Option<usize>) {
            let prompt = seg(ids);
            let mut out = vec![0u32; prompt.len()];
            let m = c.match_and_lock_checkpoint(0, &prompt, &mut out);
            let prefix = m.lease.len();
            assert_eq!(m.state.is_some(), prefix > 0);
            let checkpoint = m.branching_len.unwrap_or(c.checkpoint_config().prefill_checkpoint(prompt.len()));
            let mut row = c.req_pool().alloc().unwrap();
            let mut slots = out[..prefix].to_vec();
            let mut fresh = vec![0u32; prompt.len() - prefix];
            c.alloc(&mut fresh).unwrap();
            slots.extend(&fresh);
            c.req_pool().write(&mut row, 0, &slots[..checkpoint]).unwrap();
            let state = c.alloc_state().unwrap();
            let r = c.cache_finished_req(0, &prompt[..checkpoint], row, m.lease, state).unwrap();
            assert_eq!(r.state_kept, checkpoint > prefix, "{ids:?}: a new checkpoint is kept, a known one freed");
            c.allocator().free(&slots[checkpoint..]).unwrap();
            c.check_invariants().unwrap();
            (prefix, m.branching_len)
        };
        assert_eq!(request(&[1, 2]), (0, None), "R1, page size {ps}");
        assert_eq!(request(&[1, 3]), (0, Some(256)), "R2: splits [1,2]; [1] has no state yet");
        assert_eq!(request(&[1, 4]), (256, None), "R3: R2 checkpointed [1]");
        assert_eq!(request(&[1, 2, 5]), (512, None), "R4");
        assert_eq!(request(&[1, 4, 5]), (512, None), "R5");
        assert_eq!(request(&[1, 3, 5]), (256, None), "R6: R2 cached no [3]");
        assert_eq!(request(&[1, 3]), (256, Some(512)), "R7: splits [3,5]; [3] has no state");
        assert_eq!(request(&[1, 3]), (512, None), "R8: R7 revived the tombstone [3]");
        assert_eq!((c.protected_size(), c.mamba_protected_size()), (0, 0));
    }
}

#[test]
fn checkpoints_must_be_whole_pages() {
    let make = |ps: u32, mamba: CheckpointConfig| {
        MambaRadixCache::with_checkpoints(
            PagedAllocator::new(256, ps).unwrap(),
            ReqToTokenPool::new(1, 8).unwrap(),
            SlotPool::without_magazines(2),
            RadixConfig::default(),
            mamba,
        )
        .map(|_| ())
    };
    assert!(make(64, CheckpointConfig::default()).is_ok());
    assert!(matches!(
        make(128, CheckpointConfig::default()),
        Err(ConfigError::NotAMultiple { value: 64, unit: 128, .. })
    ));
    let odd = CheckpointConfig { chunk_size: 64, track_interval: 100 };
    assert!(matches!(make(16, odd), Err(ConfigError::NotAMultiple { value: 100, unit: 64, .. })));
    assert_eq!(
        make(16, CheckpointConfig { chunk_size: 0, track_interval: 256 }),
        Err(ConfigError::Zero("the Mamba chunk size"))
    );
    let cfg = CheckpointConfig::default();
    assert_eq!(
        (cfg.branching_len(300, 0), cfg.branching_len(300, 300), cfg.branching_len(40, 0)),
        (Some(256), None, None)
    );
    assert!(cfg.is_decode_checkpoint(512) && !cfg.is_decode_checkpoint(500) && !cfg.is_decode_checkpoint(0));
}

#[test]
fn locks_protect_the_path_and_the_end_state() {
    let c = cache(64, 8);
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[1, 2, 3, 4, 5, 6]);
    let mut out = [0u32; 6];
    let lease = c.match_and_lock(0, &[1, 2, 3, 4, 5, 6], &mut out);
    assert_eq!(lease.len(), 6);
    assert_eq!((c.protected_size(), c.mamba_protected_size(), c.mamba_evictable_size()), (6, 1, 1));
    // The unlocked state of the internal node [1..4] may go: it becomes a tombstone.
    assert_eq!(c.evict_mamba(8), 1);
    assert_eq!(c.node_count(), 2);
    assert_eq!(c.evict(100), 0, "everything left is locked");
    c.check_invariants().unwrap();
    let state = c.lease_state(&lease).unwrap();
    assert!(c.states().is_allocated(state));
    drop(lease);
    assert_eq!((c.mamba_protected_size(), c.mamba_evictable_size()), (0, 1));
    // Evicting the leaf leaves [1..4] a childless tombstone: it goes too.
    assert_eq!(c.evict(1), 6);
    assert_eq!((c.total_size(), c.node_count(), c.mamba_evictable_size()), (0, 0, 0));
    assert_eq!(c.states().available(), 8);
    assert_eq!(c.allocator().available_size(), 64);
    c.check_invariants().unwrap();
}

#[test]
fn evict_mamba_removes_leaves_whole() {
    let c = cache(64, 4);
    put(&c, &[1, 2]);
    put(&c, &[3, 4]);
    assert_eq!(c.evict_mamba(1), 1);
    assert_eq!((c.total_size(), c.node_count()), (2, 1));
    // A state is needed while the pool is empty: the LRU state is freed for it.
    let held: Vec<u32> = (0..3).map(|_| c.alloc_state().unwrap()).collect();
    assert_eq!(c.states().available(), 0);
    let s = c.alloc_state().unwrap();
    assert_eq!(c.total_size(), 0, "the last cached state was evicted for it");
    c.states().free(&held).unwrap();
    c.states().free(&[s]).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn states_that_are_not_the_callers_are_refused() {
    let c = cache(64, 4);
    let slots = kv(&c, 2);
    let state = c.alloc_state().unwrap();
    assert!(c.insert(0, &[1, 2], &slots, state).unwrap().state_kept);
    let more = kv(&c, 2);
    let before = c.pretty_print();
    // The tree's own state, a free one, one out of range.
    for bad in [state, 3, 0, 99] {
        assert_eq!(c.insert(0, &[5, 6], &more, bad), Err(CacheError::StateNotOwned { state: bad }));
    }
    assert_eq!(c.pretty_print(), before);
    c.check_invariants().unwrap();
}

#[test]
fn a_match_whose_state_was_evicted_cannot_be_locked() {
    let c = cache(64, 4);
    put(&c, &[1, 2]);
    put(&c, &[1, 2, 3, 4]);
    let mut out = [0u32; 2];
    let m = c.match_prefix(0, &[1, 2], &mut out);
    assert_eq!(m.len(), 2);
    // Refresh the whole path: [1,2] is now older than its child, so its state is the
    // least recently used, and evicting it makes [1,2] a tombstone.
    assert_eq!(matched(&c, &[1, 2, 3, 4]), 4);
    assert_eq!(c.evict_mamba(1), 1);
    assert_eq!(c.node_count(), 2);
    assert_eq!(c.lock(&m).err(), Some(CacheError::StaleMatch));
    c.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_moves_the_lease_to_the_new_checkpoint() {
    let c = cache(64, 8);
    let prompt = [1, 2, 3, 4, 5, 6];
    let mut out = [0u32; 6];
    let mut lease = c.match_and_lock(0, &prompt, &mut out);
    let mut row = c.req_pool().alloc().unwrap();
    let slots = kv(&c, 4);
    c.req_pool().write(&mut row, 0, &slots).unwrap();
    let state = c.alloc_state().unwrap();
    assert!(c.cache_unfinished_req(0, &prompt[..4], &mut row, &mut lease, state).unwrap());
    assert_eq!((lease.len(), c.lease_state(&lease)), (4, Some(state)));
    assert_eq!(c.mamba_protected_size(), 1);
    c.check_invariants().unwrap();
    // A finish whose state is refused hands everything back unchanged.
    let more = kv(&c, 2);
    c.req_pool().write(&mut row, 4, &more).unwrap();
    let u = c.cache_finished_req(0, &prompt, row, lease, state).unwrap_err();
    assert_eq!(u.error, CacheError::StateNotOwned { state });
    let s2 = c.alloc_state().unwrap();
    let r = c.cache_finished_req(0, &prompt, u.row, u.lease, s2).unwrap();
    assert_eq!((r.cached, r.state_kept), (4, true));
    assert_eq!((c.protected_size(), c.mamba_evictable_size(), c.total_size()), (0, 2, 6));
    c.check_invariants().unwrap();
}

#[test]
fn reset_frees_every_state() {
    let mut c = cache(64, 4);
    put(&c, &[1, 2, 3]);
    put(&c, &[1, 2, 4]);
    c.reset().unwrap();
    assert_eq!((c.states().available(), c.allocator().available_size(), c.mamba_evictable_size()), (4, 64, 0));
    c.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Insert { key: Vec<u32> },
    Lock { key: Vec<u32> },
    Unlock { which: usize },
    Evict { n: usize },
    EvictMamba { n: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let key = proptest::collection::vec(1u32..4, 1..12);
    prop_oneof![
        3 => key.clone().prop_map(|key| Op::Insert { key }),
        2 => key.prop_map(|key| Op::Lock { key }),
        1 => (0usize..4).prop_map(|which| Op::Unlock { which }),
        1 => (1usize..12).prop_map(|n| Op::Evict { n }),
        1 => (1usize..4).prop_map(|n| Op::EvictMamba { n }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random operations keep every invariant (the core's and the variant's: no
    /// tombstone leaf, states owned once, locks and orders exact), and every KV slot
    /// and state slot is the tree's, a lease's or free.
    #[test]
    fn random_operations_keep_the_invariants(ops in proptest::collection::vec(op(), 1..60), ps in prop_oneof![Just(1u32), Just(2)]) {
        let c = MambaRadixCache::with_states(
            PagedAllocator::new(64, ps).unwrap(),
            ReqToTokenPool::new(2, 64).unwrap(),
            SlotPool::without_magazines(6),
            RadixConfig::default(),
        )
        .unwrap();
        let mut leases = Vec::new();
        for op in ops {
            match op {
                Op::Insert { key } => {
                    let n = key.len() / ps as usize * ps as usize;
                    let mut slots = vec![0u32; n];
                    if c.alloc(&mut slots).is_err() {
                        continue;
                    }
                    let Ok(state) = c.alloc_state() else {
                        c.allocator().free(&slots).unwrap();
                        continue;
                    };
                    let r = c.insert(0, &key[..n], &slots, state).unwrap();
                    c.allocator().free(&slots[..r.cached]).unwrap();
                }
                Op::Lock { key } => {
                    let mut out = vec![0u32; key.len()];
                    let lease = c.match_and_lock(0, &key, &mut out);
                    if let Some(s) = c.lease_state(&lease) {
                        prop_assert!(c.states().is_allocated(s));
                    } else {
                        prop_assert!(lease.is_empty());
                    }
                    leases.push(lease.detach());
                }
                Op::Unlock { which } => {
                    if which < leases.len() {
                        c.release(leases.swap_remove(which)).unwrap();
                    }
                }
                Op::Evict { n } => {
                    c.evict(n);
                }
                Op::EvictMamba { n } => {
                    c.evict_mamba(n);
                }
            }
            c.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(c.allocator().available_size() + c.total_size(), 64 / ps as usize * ps as usize);
            prop_assert_eq!(
                c.states().available() + c.mamba_evictable_size() + c.mamba_protected_size(),
                6
            );
        }
        for l in leases {
            c.release(l).unwrap();
        }
        prop_assert_eq!((c.protected_size(), c.mamba_protected_size()), (0, 0));
        c.evict(usize::MAX);
        prop_assert_eq!((c.total_size(), c.states().available()), (0, 6));
        c.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

/// The tree over kvpool's `MambaPool`: a request hands its checkpoint over by number
/// (`MambaPool::cache`), a later request forks the cached state copy-on-write into its
/// own slot (exactly the node's bytes), and the lease keeps the cached state from being
/// freed while the fork reads it.
#[test]
fn over_a_mamba_pool_fork_copies_the_nodes_state() {
    use crate::mamba::{Component, MambaConfig, MambaPool, StateDtype, StateShape};
    use std::sync::Arc;

    let cfg = MambaConfig {
        layers: 2,
        conv: vec![StateShape::new(&[4, 3], StateDtype::F32)],
        temporal: StateShape::new(&[2, 4], StateDtype::F32),
    };
    let pool = Arc::new(MambaPool::new(4, cfg).unwrap());
    let c = MambaRadixCache::with_states(
        TokenAllocator::new(64).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        Arc::clone(&pool),
        RadixConfig::default(),
    )
    .unwrap();
    // Request 1 computes 8 tokens; its state after them is its checkpoint.
    let mut mine = pool.alloc().unwrap();
    for (i, x) in pool.component_mut::<f32>(&mut mine, 1, Component::Temporal).unwrap().iter_mut().enumerate() {
        *x = i as f32 + 0.5;
    }
    let checkpoint = pool.cache(mine).unwrap();
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let kv_slots = kv(&c, 8);
    assert!(c.insert(0, &tokens, &kv_slots, checkpoint).unwrap().state_kept);
    // Request 2 shares the prefix: it resumes from a copy of that state.
    let mut out = [0u32; 8];
    let m = c.match_and_lock_checkpoint(0, &tokens, &mut out);
    assert_eq!((m.lease.len(), m.state), (8, Some(checkpoint)));
    let fork = pool.fork_from(m.state.unwrap()).unwrap();
    let expect: Vec<f32> = (0..8).map(|i| i as f32 + 0.5).collect();
    assert_eq!(pool.component::<f32>(&fork, 1, Component::Temporal).unwrap(), &expect[..]);
    assert!(pool.component::<f32>(&fork, 0, Component::Temporal).unwrap().iter().all(|&x| x == 0.0));
    // Locked: the state cannot be evicted while the request holds the lease.
    assert_eq!(c.evict_mamba(1), 0);
    drop(m.lease);
    assert_eq!(c.evict_mamba(1), 1);
    assert!(!pool.is_allocated(checkpoint));
    pool.free_slot(fork).unwrap();
    assert_eq!(pool.available(), 4);
    c.check_invariants().unwrap();
}

/// The checkpoint match into a row answers as the match into a buffer on a twin cache
/// (lease, state, KV length, branching point, slots), marks the leased slots as the
/// cache's own so the finish takes them unchecked, and refuses a foreign row with
/// nothing locked.
#[test]
fn the_checkpoint_match_into_a_row_answers_as_into_a_buffer() {
    let (a, b) = (cache(4096, 8), cache(4096, 8));
    let shared = toks(&[(7, 64), (8, 64)]);
    for c in [&a, &b] {
        // 128 tokens cached, with states at 64 and 128: a request of 200 tokens
        // resumes at 128.
        let slots = kv(c, 64);
        let s = c.alloc_state().unwrap();
        c.insert(0, &shared[..64], &slots, s).unwrap();
        let longer = kv(c, 128);
        let s2 = c.alloc_state().unwrap();
        let r = c.insert(0, &shared, &longer, s2).unwrap();
        assert_eq!((r.cached, r.state_kept), (64, true));
        c.allocator().free(&longer[..64]).unwrap(); // duplicates of the first insert's
    }
    let request = toks(&[(7, 64), (8, 64), (9, 72)]);
    let mut out = vec![0u32; request.len()];
    let want = a.match_and_lock_checkpoint(0, &request, &mut out);
    let mut row = b.req_pool().alloc().unwrap();
    let got = b.match_and_lock_checkpoint_row(0, &request, &mut row).unwrap();
    assert_eq!(
        (got.lease.len(), got.state.is_some(), got.kv_len, got.branching_len),
        (want.lease.len(), want.state.is_some(), want.kv_len, want.branching_len)
    );
    assert_eq!(got.lease.len(), 128);
    // The row knows its leased slots are the cache's own (the finish skips them).
    let k = &got.lease.key;
    assert_eq!(ReqToTokenPool::matched(&row), (128, k.last_page, k.epoch));
    assert_eq!(b.req_pool().read(&row, 0..want.kv_len).unwrap(), &out[..want.kv_len]);
    // Resume from the state: allocate the rest into the row and cache it all.
    b.alloc_extend_row(&mut row, got.lease.len(), request.len()).unwrap();
    let state = b.alloc_state().unwrap();
    let cached = b.cache_finished_req(0, &request, row, got.lease, state).map_err(|e| e.error).unwrap();
    assert_eq!((cached.cached, cached.state_kept), (128, true));
    b.check_invariants().unwrap();
    drop(want);
    // A row of another pool: refused, nothing locked.
    let mut foreign = a.req_pool().alloc().unwrap();
    let before = b.protected_size();
    assert!(matches!(
        b.match_and_lock_checkpoint_row(0, &request, &mut foreign),
        Err(crate::error::RowError::ForeignRow { .. })
    ));
    assert_eq!(b.protected_size(), before);
    a.req_pool().free(foreign).unwrap();
}
