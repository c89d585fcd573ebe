#![cfg(all(loom, not(shuttle)))]
//! Loom model of a `ReqToTokenPool` row handed from one thread to another. Run with
//! `scripts/loom.sh`.
//!
//! The row table is plain memory (not loom-tracked), so beside each row the model keeps
//! a loom `UnsafeCell` shadow that is written and read at the same points as the row.
//! If freeing a row and allocating it again did not order the old holder's writes
//! before the new holder's reads, loom would report a data race on the shadow.
//!
//! | model                      | what it proves                                              |
//! |----------------------------|-------------------------------------------------------------|
//! | `row_hand_off`             | B sees A's complete row or a fresh row, never a torn one; the hand-off is ordered |

mod loom_common;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use kvpool::ReqToTokenPool;

/// A loom-tracked shadow of each row's contents.
struct Shadow(Vec<UnsafeCell<[u32; 2]>>);

impl Shadow {
    fn write(&self, row: usize, v: [u32; 2]) {
        // SAFETY: loom checks the access; a concurrent access means two holders of one
        // row (or an unordered hand-off), which loom reports.
        self.0[row].with_mut(|p| unsafe { *p = v });
    }

    fn read(&self, row: usize) -> [u32; 2] {
        // SAFETY: as in `write`.
        self.0[row].with(|p| unsafe { *p })
    }
}

/// Two rows of two slots. A holds row 0, writes it in two steps and frees it; B
/// allocates a row (row 0 if A's free is visible — even before A's free is counted —
/// else the fresh row 1) and reads it.
#[test]
fn row_hand_off() {
    loom_common::model("row_hand_off", || {
        let pool = Arc::new(ReqToTokenPool::new(2, 2).unwrap());
        let shadow = Arc::new(Shadow((0..2).map(|_| UnsafeCell::new([0, 0])).collect()));
        let mut row = pool.alloc().unwrap();
        assert_eq!(row.index(), 0);

        let a = {
            let (pool, shadow) = (Arc::clone(&pool), Arc::clone(&shadow));
            thread::spawn(move || {
                pool.write(&mut row, 0, &[7]).unwrap();
                pool.write(&mut row, 1, &[8]).unwrap();
                shadow.write(0, [7, 8]);
                pool.free(row).unwrap();
            })
        };
        let b = {
            let (pool, shadow) = (Arc::clone(&pool), Arc::clone(&shadow));
            thread::spawn(move || {
                let mut row = pool.alloc().expect("row 1 was free throughout");
                let r = row.index();
                let seen = [pool.row(&row).unwrap()[0], pool.row(&row).unwrap()[1]];
                assert_eq!(seen, shadow.read(r), "row {r} differs from its shadow");
                match r {
                    0 => assert_eq!(seen, [7, 8], "a torn or stale row 0"),
                    1 => assert_eq!(seen, [0, 0], "row 1 was never written"),
                    _ => unreachable!(),
                }
                pool.write(&mut row, 0, &[r as u32 + 100, 0]).unwrap();
                shadow.write(r, [r as u32 + 100, 0]);
                pool.free(row).unwrap();
            })
        };
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(pool.available_size(), 2);
        pool.check_invariants().unwrap();
    });
}
