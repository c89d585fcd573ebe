//! [`SlotPool::with_parking`] against a set model and against a twin pool that does
//! not park (feature `models`): the shared driver of `tests/slot_parking_model.rs` and
//! the `slot_parking` fuzz target.
//!
//! The pool has [`CAPACITY`] indices: three whole blocks of [`BLOCK`] (the unit a
//! parking pool frees and hands out with one read-modify-write) and part of a fourth,
//! which never parks. The ops allocate, free runs of allocated indices through free
//! groups (whole blocks among them park), free slices with repeats, freed and
//! out-of-range indices, and free ranges and whole blocks whatever they hold (double
//! frees of parked blocks among them).
//!
//! The rules it checks (module docs of `kvpool::slots`, "Parked blocks"):
//!
//! * an allocation succeeds exactly when the model holds enough free indices, hands
//!   out only free ones, and hands out **the same indices in the same order** as
//!   [`SlotPool::without_magazines`] given the same steps; a refused one reports the
//!   exact count;
//! * a range free of allocated indices succeeds and frees them all; one that names a
//!   free or out-of-range index fails, freeing nothing (`free_range`) or, through
//!   `free_ranges`, the whole words below the first bad index;
//! * a slice free with a bad index or a repeat fails, freeing nothing;
//! * after every step: `available()` of both pools equals the model's free count,
//!   `is_allocated` agrees for every index (0 and one past the end included), and
//!   `check_invariants()` passes.

use std::collections::HashSet;

use arbitrary::Arbitrary;

use crate::SlotPool;

/// Indices per parked block.
pub const BLOCK: u32 = 512;
/// The pool's capacity: three whole blocks and 100 indices of a fourth.
pub const CAPACITY: u32 = 3 * BLOCK + 100;
/// How many ops the `slot_parking` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 48;

/// One step of a [`run_parking`] sequence. Raw numbers are reduced into range as
/// documented per variant.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum ParkOp {
    /// Allocate `1 + n % 1400` indices.
    Alloc {
        /// Raw count.
        n: u16,
    },
    /// Free, through a free group, the allocated run that starts at the first allocated
    /// index from `1 + at % CAPACITY` on (wrapping around), at most `1 + len % 1400`
    /// long; as two ranges (`free_ranges`, cut at a third) if `split`.
    FreeRun {
        /// Raw start.
        at: u16,
        /// Raw length.
        len: u16,
        /// Two ranges instead of one.
        split: bool,
    },
    /// Free a slice of the first 6 raw indices, each `i % (CAPACITY + 3)`: 0, past the
    /// end, free and repeated indices all occur.
    FreeSlice {
        /// Raw indices.
        indices: Vec<u16>,
    },
    /// Free the range `first % (CAPACITY + 1)`, `1 + count % 700` long, whatever it
    /// holds: through `free_ranges` if `many`, else `free_range`.
    FreeAny {
        /// Raw first index.
        first: u16,
        /// Raw length.
        count: u16,
        /// Through `free_ranges`.
        many: bool,
    },
    /// Free whole block `block % 3`, whatever it holds, as [`ParkOp::FreeAny`] does.
    FreeBlock {
        /// Raw block.
        block: u8,
        /// Through `free_ranges`.
        many: bool,
    },
}

/// Parse as many [`ParkOp`]s from `bytes` as they hold, at most `max_ops` (any bytes
/// work).
///
/// # Examples
///
/// ```
/// let ops = kvpool::models::parking::park_ops_from_bytes(&[3, 1, 4, 1, 5, 9, 2, 6], 48);
/// assert!(!ops.is_empty());
/// ```
pub fn park_ops_from_bytes(bytes: &[u8], max_ops: usize) -> Vec<ParkOp> {
    super::decode_ops(bytes, max_ops)
}

/// Fail with a message naming the step unless `$cond`.
macro_rules! ensure {
    ($step:expr, $cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!("step {}: {}", $step, format!($($msg)+)));
        }
    };
}

/// Drive `ops` on a fresh `SlotPool::with_parking(CAPACITY)` (and a twin
/// `SlotPool::without_magazines(CAPACITY)`) against the set model, checking the rules
/// of the [module docs](self) after every step.
///
/// # Errors
///
/// The first disagreement, as a message naming the step.
///
/// # Examples
///
/// ```
/// use kvpool::models::parking::{run_parking, ParkOp};
/// // 1,400 out, block 513..=1024 back (it parks), then 600 out again: the block and
/// // 1401..=1488, in the order a pool that does not park gives them.
/// let ops = [
///     ParkOp::Alloc { n: 1399 },
///     ParkOp::FreeRun { at: 512, len: 511, split: false },
///     ParkOp::Alloc { n: 599 },
/// ];
/// run_parking(&ops)?;
/// # Ok::<(), String>(())
/// ```
pub fn run_parking(ops: &[ParkOp]) -> Result<(), String> {
    const CAP: u32 = CAPACITY;
    let pool = SlotPool::with_parking(CAP);
    let twin = SlotPool::without_magazines(CAP);
    // free[i]: index i is free.
    let mut free = vec![true; CAP as usize + 1];
    free[0] = false;
    for (step, op) in ops.iter().enumerate() {
        let have = free.iter().filter(|&&f| f).count();
        match op {
            &ParkOp::Alloc { n } => {
                let n = 1 + n as usize % 1400;
                let (mut out, mut twin_out) = (vec![0u32; n], vec![0u32; n]);
                let twin_ok = twin.alloc(&mut twin_out).is_ok();
                match pool.alloc(&mut out) {
                    Ok(()) => {
                        ensure!(step, n <= have, "{n} allocated with {have} free");
                        ensure!(step, twin_ok && out == twin_out, "placement differs from a pool that does not park");
                        for &i in &out {
                            ensure!(step, free[i as usize], "index {i} handed out while not free");
                            free[i as usize] = false;
                        }
                    }
                    Err(e) => {
                        ensure!(step, n > have && e.available == have, "{e:?} with {have} free");
                        ensure!(step, !twin_ok, "refused where a pool that does not park serves");
                    }
                }
            }
            &ParkOp::FreeRun { at, len, split } => {
                let at = 1 + u32::from(at) % CAP;
                let Some(first) = (at..=CAP).chain(1..at).find(|&i| !free[i as usize]) else { continue };
                let len = 1 + len as usize % 1400;
                let count = (first..=CAP).take(len).take_while(|&i| !free[i as usize]).count() as u32;
                for p in [&pool, &twin] {
                    let mut group = p.free_group();
                    let r = if split {
                        let cut = count / 3;
                        group.free_ranges([(first, cut), (first + cut, count - cut)])
                    } else {
                        group.free_range(first, count)
                    };
                    ensure!(step, r.is_ok(), "freeing allocated {first}..+{count}: {r:?}");
                    ensure!(step, group.end() == count as usize, "group counted other than {count}");
                }
                (first..first + count).for_each(|i| free[i as usize] = true);
            }
            ParkOp::FreeSlice { indices } => {
                let indices: Vec<u32> = indices.iter().take(6).map(|&i| u32::from(i) % (CAP + 3)).collect();
                let mut seen = HashSet::new();
                let bad = indices.iter().any(|&i| i == 0 || i > CAP || free[i as usize] || !seen.insert(i));
                let twin_r = twin.free(&indices);
                let r = pool.free(&indices);
                ensure!(step, r == twin_r, "{r:?} where a pool that does not park gives {twin_r:?}");
                match r {
                    Ok(()) => {
                        ensure!(step, !bad, "freeing {indices:?} succeeded");
                        indices.iter().for_each(|&i| free[i as usize] = true);
                    }
                    // A bad index or a repeat: nothing freed.
                    Err(e) => {
                        ensure!(step, bad && !e.rest_freed, "freeing {indices:?}: {e:?}");
                    }
                }
            }
            &ParkOp::FreeAny { first, count, many } => {
                let (first, count) = (u32::from(first) % (CAP + 1), 1 + u32::from(count) % 700);
                free_any(step, &pool, &twin, &mut free, first, count, many)?;
            }
            &ParkOp::FreeBlock { block, many } => {
                let first = u32::from(block % 3) * BLOCK + 1;
                free_any(step, &pool, &twin, &mut free, first, BLOCK, many)?;
            }
        }
        let have = free.iter().filter(|&&f| f).count();
        ensure!(step, pool.available() == have, "available {} with {have} free", pool.available());
        ensure!(step, twin.available() == have, "the twin's available {} with {have} free", twin.available());
        for i in 0..=CAP + 1 {
            let want = (1..=CAP).contains(&i) && !free[i as usize];
            ensure!(step, pool.is_allocated(i) == want, "is_allocated({i}) is not {want}");
        }
        pool.check_invariants().map_err(|e| format!("step {step}: {}", e.0))?;
    }
    Ok(())
}

/// Free `first..first + count` on both pools, whatever it holds, and on the model
/// what the rules say was freed.
fn free_any(
    step: usize,
    pool: &SlotPool,
    twin: &SlotPool,
    free: &mut [bool],
    first: u32,
    count: u32,
    many: bool,
) -> Result<(), String> {
    let cap = pool.capacity();
    let last = u64::from(first) + u64::from(count) - 1;
    let outside = first == 0 || last > u64::from(cap);
    let lowest_free = if outside { None } else { (first..=last as u32).find(|&i| free[i as usize]) };
    let bad = outside || lowest_free.is_some();
    // What is freed: all of a good range; of a bad one, nothing as a range, and through
    // `free_ranges` the whole words before the bad index.
    let upto = match lowest_free {
        None if !outside => first + count,
        Some(i) if many => ((i - 1) / 64 * 64 + 1).max(first),
        _ => first,
    };
    for p in [pool, twin] {
        let mut group = p.free_group();
        let r = if many { group.free_ranges([(first, count)]) } else { group.free_range(first, count) };
        ensure!(step, r.is_err() == bad, "freeing {first}..+{count}: {r:?}");
        let want = if many {
            upto - first
        } else {
            if bad {
                0
            } else {
                count
            }
        };
        ensure!(step, group.end() == want as usize, "freeing {first}..+{count} counted other than {want}");
    }
    (first..upto).for_each(|i| free[i as usize] = true);
    Ok(())
}
