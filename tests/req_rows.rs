#![cfg(not(loom))]
//! `ReqToTokenPool`: writes and reads, bounds, foreign and stale handles, and threads
//! each writing their own rows at once.

use std::sync::{Arc, Barrier};

use kvpool::{ConfigError, OutOfMemory, ReqToTokenPool, RowError, Unit};

#[test]
fn rows_are_handed_out_lowest_first_and_exhaust() {
    let pool = ReqToTokenPool::new(3, 8).unwrap();
    let rows: Vec<_> = (0..3).map(|_| pool.alloc().unwrap()).collect();
    assert_eq!(rows.iter().map(|r| r.index()).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(pool.alloc(), Err(OutOfMemory { requested: 1, available: 0, evictable: None, unit: Unit::Rows }));
    let msg = pool.alloc().unwrap_err().to_string();
    assert!(msg.contains("request rows"), "{msg}");
    for r in rows {
        pool.free(r).unwrap();
    }
    assert_eq!(pool.available_size(), 3);
    pool.check_invariants().unwrap();
}

#[test]
fn writes_land_in_their_row_only() {
    let pool = ReqToTokenPool::new(3, 6).unwrap();
    let mut a = pool.alloc().unwrap();
    let mut b = pool.alloc().unwrap();
    let c = pool.alloc().unwrap();
    pool.write(&mut a, 0, &[1, 2, 3, 4, 5, 6]).unwrap();
    pool.write(&mut b, 2, &[30, 31]).unwrap();
    pool.write(&mut b, 5, &[50]).unwrap();
    pool.write(&mut a, 1, &[20]).unwrap(); // overwrite in the middle
    assert_eq!(pool.row(&a).unwrap(), &[1, 20, 3, 4, 5, 6]);
    assert_eq!(pool.row(&b).unwrap(), &[0, 0, 30, 31, 0, 50]);
    assert_eq!(pool.row(&c).unwrap(), &[0; 6]);
    assert_eq!(pool.read(&b, 2..4).unwrap(), &[30, 31]);
    assert_eq!(pool.read(&b, 3..3).unwrap(), &[] as &[u32]);
    assert_eq!(pool.max_context_len(), 6);
    assert_eq!(pool.size(), 3);
}

#[test]
fn out_of_bounds_is_an_error_and_writes_nothing() {
    let pool = ReqToTokenPool::new(2, 4).unwrap();
    let mut a = pool.alloc().unwrap();
    let b = pool.alloc().unwrap();
    pool.write(&mut a, 0, &[9, 9, 9, 9]).unwrap();
    let row = a.index() as u32;
    let oob = |start, len| Err(RowError::OutOfBounds { row, start, len, max_context_len: 4 });
    assert_eq!(pool.write(&mut a, 3, &[1, 2]), oob(3, 2));
    assert_eq!(pool.write(&mut a, 0, &[1, 2, 3, 4, 5]), oob(0, 5));
    assert_eq!(pool.write(&mut a, 5, &[]), oob(5, 0));
    assert!(matches!(pool.write(&mut a, usize::MAX, &[1]), Err(RowError::OutOfBounds { .. })));
    assert!(matches!(pool.read(&a, 2..5), Err(RowError::OutOfBounds { .. })));
    assert!(matches!(pool.read(&a, usize::MAX - 1..usize::MAX), Err(RowError::OutOfBounds { .. })));
    // nothing spilled into the neighbouring row, nothing partially written
    assert_eq!(pool.row(&a).unwrap(), &[9, 9, 9, 9]);
    assert_eq!(pool.row(&b).unwrap(), &[0, 0, 0, 0]);
    pool.write(&mut a, 4, &[]).unwrap(); // an empty write at the end is in bounds
    let msg = pool.write(&mut a, 3, &[1, 2]).unwrap_err().to_string();
    assert!(msg.contains("beyond max_context_len 4"), "{msg}");
}

/// A reversed range (`start > end`) is refused with `OutOfBounds` by `read` and
/// `read_mut`, not read as an empty slice (its length used to be `end.saturating_sub(start)`,
/// so `3..1` gave `Ok(&[])`). The reported `len` wraps, so `start.wrapping_add(len)` is
/// the range's end.
#[test]
#[allow(clippy::reversed_empty_ranges)] // reversed on purpose
fn reversed_ranges_are_refused() {
    let pool = ReqToTokenPool::new(2, 8).unwrap();
    let mut r = pool.alloc().unwrap();
    pool.write(&mut r, 0, &[1, 2, 3, 4]).unwrap();
    let row = r.index() as u32;
    let reversed = |start: usize, end: usize| RowError::OutOfBounds {
        row,
        start,
        len: end.wrapping_sub(start),
        max_context_len: 8,
    };
    assert_eq!(pool.read(&r, 3..1), Err(reversed(3, 1)));
    assert_eq!(pool.read(&r, 8..0), Err(reversed(8, 0)));
    assert_eq!(pool.read(&r, usize::MAX..0), Err(reversed(usize::MAX, 0)));
    assert_eq!(pool.read_mut(&mut r, 5..2).map(|s| s.len()), Err(reversed(5, 2)));
    // An empty range is still fine anywhere up to the row's end.
    assert_eq!(pool.read(&r, 8..8).unwrap(), &[] as &[u32]);
    assert_eq!(pool.read_mut(&mut r, 0..0).unwrap(), &mut [] as &mut [u32]);
    assert_eq!(pool.row(&r).unwrap(), &[1, 2, 3, 4, 0, 0, 0, 0]);
}

#[test]
fn foreign_handles_are_refused() {
    let p1 = ReqToTokenPool::new(2, 4).unwrap();
    let p2 = ReqToTokenPool::new(2, 4).unwrap();
    let mut a = p1.alloc().unwrap();
    let _b = p2.alloc().unwrap(); // same row number in p2, allocated
    assert_eq!(p2.write(&mut a, 0, &[1]), Err(RowError::ForeignRow { row: 0 }));
    assert_eq!(p2.read(&a, 0..1), Err(RowError::ForeignRow { row: 0 }));
    let refused = p2.free(a).unwrap_err();
    assert_eq!(refused.error, RowError::ForeignRow { row: 0 });
    assert_eq!(p2.available_size(), 1); // p2's row 0 is still held by _b
    assert_eq!(p2.row(&_b).unwrap(), &[0; 4]);
    // The handle came back (it used to be consumed, and its row lost to p1 for good).
    assert_eq!(p1.available_size(), 1);
    p1.free(refused.row).unwrap();
    assert_eq!(p1.available_size(), 2);
    p1.check_invariants().unwrap();
    p2.check_invariants().unwrap();
}

#[test]
fn handles_from_before_clear_are_stale() {
    let mut pool = ReqToTokenPool::new(2, 3).unwrap();
    let mut old = pool.alloc().unwrap();
    pool.write(&mut old, 0, &[7, 7, 7]).unwrap();
    pool.clear();
    assert_eq!(pool.available_size(), 2);
    let mut new = pool.alloc().unwrap();
    assert_eq!(new.index(), old.index()); // same row number...
    assert!(matches!(pool.write(&mut old, 0, &[1]), Err(RowError::ForeignRow { .. }))); // ...old handle refused
    assert!(pool.row(&old).is_err());
    pool.write(&mut new, 0, &[4]).unwrap();
    assert!(pool.free(old).is_err());
    assert_eq!(pool.available_size(), 1); // the stale free freed nothing
    pool.free(new).unwrap();
    assert_eq!(pool.available_size(), 2);
}

#[test]
fn constructor_errors() {
    assert_eq!(ReqToTokenPool::new(4, 0).unwrap_err(), ConfigError::Zero("max_context_len"));
    assert!(matches!(ReqToTokenPool::new(u32::MAX, usize::MAX / 2), Err(ConfigError::TooLarge { .. })));
    let empty = ReqToTokenPool::new(0, 8).unwrap();
    assert!(empty.alloc().is_err());
}

/// Threads each take rows, fill them with their own pattern, check them, free them,
/// over and over; rows circulate between threads. A row seen with anyone else's data
/// while held would mean two holders at once or a write that leaked across rows.
#[test]
fn threads_write_their_own_rows() {
    const THREADS: usize = 4;
    const ROUNDS: usize = if cfg!(miri) { 20 } else { 2_000 };
    const LEN: usize = 32;
    let pool = Arc::new(ReqToTokenPool::new(6, LEN).unwrap());
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = Arc::clone(&pool);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                let mut done = 0usize;
                let mut pattern = [0u32; LEN];
                for round in 0..ROUNDS {
                    let Ok(mut row) = pool.alloc() else {
                        std::thread::yield_now();
                        continue;
                    };
                    let tag = ((t as u32) << 24) | round as u32;
                    for (k, p) in pattern.iter_mut().enumerate() {
                        *p = tag ^ (k as u32) << 16;
                    }
                    // write in two pieces, as prefix then extend
                    pool.write(&mut row, 0, &pattern[..LEN / 3]).unwrap();
                    pool.write(&mut row, LEN / 3, &pattern[LEN / 3..]).unwrap();
                    std::thread::yield_now();
                    assert_eq!(pool.row(&row).unwrap(), &pattern, "thread {t} round {round}: row changed under us");
                    pool.free(row).unwrap();
                    done += 1;
                }
                done
            })
        })
        .collect();
    let done: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(done > 0);
    assert_eq!(pool.available_size(), 6);
    pool.check_invariants().unwrap();
}
