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

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use kvpool::mamba::{Component, MambaConfig, MambaError, MambaPool, StateDtype, StateShape};
use kvpool::FreeErrorKind;
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
        let c = pool.cache(a);

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
