#![cfg(all(loom, not(shuttle)))]
//! Loom model of the one piece of concurrency `MambaPool` adds to `SlotPool`: a reader
//! pinning a cached state (`read_cached`, `fork_from`) racing with the tree freeing
//! that state by number and the slot being handed to a new holder who writes it. Run
//! with `scripts/loom.sh loom_mamba`.
//!
//! The state bytes are plain memory (not loom-tracked), so beside each slot the model
//! keeps a loom `UnsafeCell` shadow, read inside the pin and written by the new holder.
//! If the pin did not keep the free out, or the unpin / free / alloc chain did not
//! order the reader's reads before the new holder's writes, loom would report a data
//! race on the shadow (or the reader would see the new holder's bytes).
//!
//! | model               | what it proves                                                      |
//! |---------------------|---------------------------------------------------------------------|
//! | `pin_races_free`    | a reader sees the cached bytes whole, or is refused; a free of a pinned slot is refused (`InUse`); no write overlaps a read |
//! | `tree_eviction_races_a_reader` | a tree's state evicted while a reader forks from it is freed exactly once: at the eviction, or by the reader's unpin if it pinned first; the reader's copy is whole |

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use kvpool::mamba::{Component, MambaConfig, MambaError, MambaPool, StateDtype, StateShape};
use kvpool::radix::{MambaRadixCache, RadixConfig};
use kvpool::{FreeErrorKind, ReqToTokenPool, TokenAllocator};
// Outcome counters live across executions, outside loom's model: std atomics.
use std::sync::atomic::{AtomicUsize, Ordering};

struct Shadow(Vec<UnsafeCell<u8>>);

impl Shadow {
    fn write(&self, slot: u32, v: u8) {
        // SAFETY: loom checks the access; a concurrent access is a bug loom reports.
        self.0[slot as usize].with_mut(|p| unsafe { *p = v });
    }
    fn read(&self, slot: u32) -> u8 {
        // SAFETY: as in `write`.
        self.0[slot as usize].with(|p| unsafe { *p })
    }
}

#[test]
fn pin_races_free() {
    let outcomes = std::sync::Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let seen = std::sync::Arc::clone(&outcomes);
    loom_common::model("pin_races_free", move || {
        let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[2], StateDtype::F32) };
        let pool = Arc::new(MambaPool::new(1, cfg).unwrap());
        let shadow = Arc::new(Shadow((0..2).map(|_| UnsafeCell::new(0)).collect()));
        let mut a = pool.alloc().unwrap();
        pool.component_mut::<u8>(&mut a, 0, Component::Temporal).unwrap().fill(7);
        shadow.write(1, 7);
        let c = pool.cache(a).unwrap();

        let reader = {
            let (pool, shadow) = (Arc::clone(&pool), Arc::clone(&shadow));
            thread::spawn(move || {
                match pool.read_cached(c, 0, Component::Temporal, |b| (b.iter().all(|&x| x == 7), shadow.read(c))) {
                    Ok((whole, s)) => {
                        assert!(whole, "a pinned cached state changed under its reader");
                        assert_eq!(s, 7);
                        true
                    }
                    Err(e) => {
                        assert_eq!(e, MambaError::NotCached { slot: c });
                        false
                    }
                }
            })
        };
        let evictor = {
            let (pool, shadow) = (Arc::clone(&pool), Arc::clone(&shadow));
            thread::spawn(move || match pool.free(&[c]) {
                Ok(()) => {
                    // The slot goes to a new holder, who writes it.
                    let mut s = pool.alloc().expect("the only slot was just freed");
                    pool.component_mut::<u8>(&mut s, 0, Component::Temporal).unwrap().fill(9);
                    shadow.write(s.index(), 9);
                    pool.free_slot(s).unwrap();
                    true
                }
                Err(e) => {
                    assert_eq!(e.kind, FreeErrorKind::InUse, "only a pin can refuse this free");
                    false
                }
            })
        };
        let read = reader.join().unwrap();
        let freed = evictor.join().unwrap();
        assert!(read || freed, "the reader was refused although the slot was never freed");
        seen[usize::from(freed)].fetch_add(1, Ordering::Relaxed);
        if !freed {
            pool.free(&[c]).unwrap();
        }
        assert_eq!(pool.available(), 1);
        pool.check_invariants().unwrap();
    });
    // Both outcomes were reached: the free refused while pinned, and the free first.
    let (refused, freed) = (outcomes[0].load(Ordering::Relaxed), outcomes[1].load(Ordering::Relaxed));
    println!("pin_races_free: free refused in {refused} executions, done in {freed}");
    assert!(refused > 0 && freed > 0);
}

type Cache = MambaRadixCache<TokenAllocator, std::sync::Arc<MambaPool>>;

/// The pool is shared through a `std` `Arc` (the cache's state pool type), and so is
/// the cache (a request holds one); their atomics are loom's, which is what the model
/// checks.
fn two_state_cache() -> (std::sync::Arc<MambaPool>, std::sync::Arc<Cache>) {
    let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[2], StateDtype::F32) };
    let pool = std::sync::Arc::new(MambaPool::new(2, cfg).unwrap());
    let cache = MambaRadixCache::with_states(
        TokenAllocator::new(4).unwrap(),
        ReqToTokenPool::new(1, 4).unwrap(),
        std::sync::Arc::clone(&pool),
        RadixConfig::default(),
    )
    .unwrap();
    (pool, std::sync::Arc::new(cache))
}

/// Fill layer 0's temporal state of `slot` with `v`, by number through the pool's
/// buffer, as a compute kernel writes the state a request saves.
///
/// The caller must hold `slot` (a request's saved state before it is cached): nothing
/// else reads or writes it meanwhile.
fn fill_state(pool: &MambaPool, slot: u32, v: u8) {
    let (base, len) = pool.buffer_ptr(Component::Temporal).unwrap();
    // One layer: the buffer is `size + 1` rows, row `slot` at `slot * row`.
    let row = len / (pool.size() + 1);
    assert!((slot as usize + 1) * row <= len);
    // SAFETY: the range is inside the buffer (asserted), and the caller holds the slot,
    // so no one else accesses these bytes while they are written.
    unsafe { core::ptr::write_bytes(base.add(slot as usize * row), v, row) };
}

#[test]
fn tree_eviction_races_a_reader() {
    let outcomes = std::sync::Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let seen = std::sync::Arc::clone(&outcomes);
    loom_common::model("tree_eviction_races_a_reader", move || {
        let (pool, cache) = two_state_cache();
        // A request caches [1, 2] with the state it saved (filled with 7s); its running
        // state goes back.
        let mut req = cache.admit(0, &[1, 2]).unwrap();
        let state = req.save_state(2).unwrap();
        fill_state(&pool, state, 7);
        req.extend(2).unwrap();
        assert!(req.finish(&[1, 2]).unwrap().state_kept);
        assert!(pool.is_tree_held(state));

        let reader = {
            let pool = std::sync::Arc::clone(&pool);
            thread::spawn(move || match pool.fork_from(state) {
                Ok(fork) => {
                    let whole = pool.component::<u8>(&fork, 0, Component::Temporal).unwrap().iter().all(|&x| x == 7);
                    assert!(whole, "the fork copied a state freed under it");
                    pool.free_slot(fork).unwrap();
                    true
                }
                Err(e) => {
                    assert_eq!(e, MambaError::NotCached { slot: state });
                    false
                }
            })
        };
        let evictor = {
            let cache = std::sync::Arc::clone(&cache);
            thread::spawn(move || assert_eq!(cache.evict_mamba(1), 1))
        };
        let forked = reader.join().unwrap();
        evictor.join().unwrap();
        seen[usize::from(forked)].fetch_add(1, Ordering::Relaxed);
        // Freed exactly once, whoever did it: every slot is free again.
        assert_eq!(pool.available(), 2);
        assert!(!pool.is_allocated(state));
        pool.check_invariants().unwrap();
        cache.check_invariants().unwrap();
    });
    let (refused, forked) = (outcomes[0].load(Ordering::Relaxed), outcomes[1].load(Ordering::Relaxed));
    println!("tree_eviction_races_a_reader: fork refused in {refused} executions, done in {forked}");
    assert!(refused > 0 && forked > 0);
}
