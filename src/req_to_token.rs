//! [`ReqToTokenPool`]: request rows mapping token positions to KV slots.
//!
//! SGLang's `req_to_token` is a `[size, max_context_len]` table: row `r` holds the KV
//! slot of every token of the request that owns row `r`. Rows are handed out by a
//! [`SlotPool`]; the holder of a [`ReqRow`] handle is the only one who can write its
//! row in safe code, because the handle is unique (neither `Clone` nor `Copy`) and
//! writing needs `&mut ReqRow`.
//!
//! # Why the shared table is sound
//!
//! The table lives in `UnsafeCell`s and is shared by every thread through `&self`. A
//! cell of row `r` is touched only through a handle for row `r`:
//!
//! * the [`SlotPool`] never hands one index to two owners, so at most one live handle
//!   names row `r` (handles from before a [`clear`](ReqToTokenPool::clear) carry an
//!   older pool generation and are refused);
//! * writes need `&mut ReqRow` and reads borrow `&ReqRow`, so Rust's borrow rules
//!   keep reads and writes of one row apart;
//! * freeing a row consumes its handle; the pool's `Release` on free and `Acquire` on
//!   allocation order the old owner's accesses before the new owner's.
//!
//! The row cells are plain memory, not atomics; loom models cover the row-handle arena
//! (the [`SlotPool`]), which is where the hand-off between threads happens.

use core::cell::UnsafeCell;

use crate::error::{ConfigError, InvalidInput, InvariantViolation, OutOfMemory, RowError, Unit};
use crate::slots::SlotPool;

/// A request row handle: the right to read and write one row of a [`ReqToTokenPool`].
///
/// Unique by construction; give it back with [`ReqToTokenPool::free`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a request row is held until it is freed"]
pub struct ReqRow {
    /// 1-based index in the row pool.
    slot: u32,
    pool: u64,
    /// Positions `shaped.0..shaped.1` hold what an allocator's page expansion wrote
    /// there ([`ReqToTokenPool::fill_extension`]) and nothing has written over since:
    /// whole pages in order. Any write that starts below `shaped.1` forgets it.
    shaped: (u32, u32),
    /// `(len, last_page, epoch)`: positions `0..len` hold the slots of the prefix
    /// cache's path that ends at the node `(last_page, epoch)`, written there by the
    /// cache itself (a match into the row, or a chunk's rewrite) and unchanged since.
    /// Any write that starts below `len` forgets it.
    matched: (u32, u32, u32),
}

/// Why [`ReqToTokenPool::free`] refused a row: nothing was freed, and the row handle
/// comes back in `row`.
#[derive(Debug, PartialEq, Eq)]
pub struct RowFreeError {
    /// What went wrong.
    pub error: RowError,
    /// The row handed to `free`, given back.
    pub row: ReqRow,
}

crate::error::hands_back!(RowFreeError => RowError);

impl ReqRow {
    /// The row number, `0..size` (SGLang's `req_pool_idx`).
    pub fn index(&self) -> usize {
        self.slot as usize - 1
    }

    /// A write from position `start` on: the expansion's positions from there on can
    /// no longer be vouched for, nor those after them (they continue the slot before).
    fn overwritten_from(&mut self, start: usize) {
        if start < self.shaped.1 as usize {
            self.shaped = (0, 0);
        }
        if start < self.matched.0 as usize {
            self.matched = (0, 0, 0);
        }
    }
}

/// Most run breaks a row remembers (see [`Breaks`]).
pub(crate) const ROW_BREAKS: usize = 16;

/// Where the slots of a row's expansion stop being consecutive, as the allocator
/// reported them while claiming ([`KvAllocator::alloc_extend_runs`]): every position `p`
/// in `shaped.0 + 1..known` with `slot[p] != slot[p - 1] + 1` is in `at[..n]`
/// (ascending), and no other. From `known` on nothing is recorded: more breaks than
/// fit, or an allocator that does not report them.
///
/// [`KvAllocator::alloc_extend_runs`]: crate::KvAllocator::alloc_extend_runs
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Breaks {
    known: u32,
    n: u32,
    at: [u32; ROW_BREAKS],
}

impl Breaks {
    /// Nothing known from position `known` on.
    const fn none(known: u32) -> Self {
        Breaks { known, n: 0, at: [0; ROW_BREAKS] }
    }

    /// Positions up to here (exclusive) have their breaks recorded.
    pub(crate) fn known(&self) -> usize {
        self.known as usize
    }

    /// The recorded breaks, ascending.
    pub(crate) fn at(&self) -> &[u32] {
        &self.at[..self.n as usize]
    }

    /// Record the breaks `new` (ascending, at or above `known`), then know up to `end`:
    /// or only up to the first break that does not fit.
    fn extend(&mut self, new: impl IntoIterator<Item = u32>, end: u32) {
        for p in new {
            if self.n as usize == ROW_BREAKS {
                self.known = p;
                return;
            }
            self.at[self.n as usize] = p;
            self.n += 1;
        }
        self.known = end;
    }
}

/// What the allocator wrote into a row and nobody has written over since: the
/// positions (`shaped`) and where their runs of consecutive slots break.
#[derive(Clone, Debug)]
pub(crate) struct Expansion {
    pub(crate) shaped: core::ops::Range<usize>,
    pub(crate) breaks: Breaks,
}

impl Expansion {
    /// Nothing vouched for (every position is checked slot by slot).
    pub(crate) const NONE: Expansion = Expansion { shaped: 0..0, breaks: Breaks::none(0) };
}

/// `size` request rows of `max_context_len` KV slots each.
///
/// # Examples
///
/// ```
/// use kvpool::ReqToTokenPool;
///
/// let pool = ReqToTokenPool::new(4, 16)?;
/// let mut row = pool.alloc()?;
/// pool.write(&mut row, 0, &[7, 8, 9])?;
/// pool.write(&mut row, 3, &[10])?;
/// assert_eq!(pool.read(&row, 0..4)?, &[7, 8, 9, 10]);
/// assert!(pool.write(&mut row, 15, &[1, 2]).is_err()); // past max_context_len
/// pool.free(row)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ReqToTokenPool {
    rows: SlotPool,
    table: Box<[UnsafeCell<u32>]>,
    /// Per row: where the runs of its expansion (`ReqRow::shaped`) break, meaningful
    /// only while that interval is not empty (every fill that sets it writes this).
    breaks: Box<[UnsafeCell<Breaks>]>,
    max_context_len: usize,
    generation: u64,
}

// SAFETY: the table's cells and a row's run breaks are only reached through a unique
// `ReqRow` for their row (see the module docs); every other field is atomic or
// immutable.
unsafe impl Sync for ReqToTokenPool {}
// SAFETY: the pool owns its table; nothing in it is tied to a thread.
unsafe impl Send for ReqToTokenPool {}

impl ReqToTokenPool {
    /// `size` rows of `max_context_len` slots, zero-filled (slot 0 is the padding slot).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] if `max_context_len` is 0; [`ConfigError::TooLarge`] if
    /// the table would not fit in memory addressing; [`ConfigError::TooLargeForMemory`]
    /// (with the bytes it needs) if it cannot be allocated.
    pub fn new(size: u32, max_context_len: usize) -> Result<Self, ConfigError> {
        if max_context_len == 0 {
            return Err(ConfigError::Zero("max_context_len"));
        }
        let cells = (size as usize).checked_mul(max_context_len).filter(|&c| c <= isize::MAX as usize / 4).ok_or(
            ConfigError::TooLarge { size: (size as u64).saturating_mul(max_context_len as u64), page_size: 1 },
        )?;
        let table =
            crate::arena::try_vec_with(cells, "the request-row table", |_| UnsafeCell::new(0))?.into_boxed_slice();
        let breaks = crate::arena::try_vec_with(size as usize, "the request rows' run breaks", |_| {
            UnsafeCell::new(Breaks::none(0))
        })?
        .into_boxed_slice();
        // Rows stay lowest-first (no magazines): a row is one index per request, where a
        // magazine saves nothing worth the changed order.
        Ok(ReqToTokenPool {
            rows: SlotPool::without_magazines(size),
            table,
            breaks,
            max_context_len,
            generation: next_generation(),
        })
    }

    /// Number of rows.
    pub fn size(&self) -> usize {
        self.rows.capacity() as usize
    }

    /// Slots per row.
    pub fn max_context_len(&self) -> usize {
        self.max_context_len
    }

    /// Free rows now.
    pub fn available_size(&self) -> usize {
        self.rows.available()
    }

    /// Take a free row. Lock-free; does not allocate.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] (in rows) when every row is taken.
    pub fn alloc(&self) -> Result<ReqRow, OutOfMemory> {
        let mut one = [0u32];
        self.rows.alloc_as(&mut one, Unit::Rows)?;
        Ok(ReqRow { slot: one[0], pool: self.generation, shaped: (0, 0), matched: (0, 0, 0) })
    }

    /// Give a row back.
    ///
    /// # Errors
    ///
    /// [`RowFreeError`] with [`RowError::ForeignRow`] if the handle belongs to another
    /// pool (or to this pool before a [`clear`](Self::clear)): nothing is freed, and the
    /// handle comes back in the error, so that it can still be given to the pool it
    /// belongs to.
    ///
    /// ```
    /// use kvpool::ReqToTokenPool;
    ///
    /// let (a, b) = (ReqToTokenPool::new(1, 8)?, ReqToTokenPool::new(1, 8)?);
    /// let row = a.alloc()?;
    /// let refused = b.free(row).unwrap_err(); // the wrong pool
    /// a.free(refused.row)?;                    // the right one
    /// assert_eq!(a.available_size(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free(&self, row: ReqRow) -> Result<(), RowFreeError> {
        if let Err(error) = self.own(&row) {
            return Err(RowFreeError { error, row });
        }
        // The handle is unique, so its row is allocated: this cannot fail.
        match self.rows.free(&[row.slot]) {
            Ok(()) => Ok(()),
            Err(_) => Err(RowFreeError { error: RowError::ForeignRow { row: row.slot - 1 }, row }),
        }
    }

    fn own(&self, row: &ReqRow) -> Result<(), RowError> {
        if row.pool == self.generation {
            Ok(())
        } else {
            Err(RowError::ForeignRow { row: row.slot - 1 })
        }
    }

    fn bounds(&self, row: &ReqRow, start: usize, len: usize) -> Result<usize, RowError> {
        self.own(row)?;
        match start.checked_add(len) {
            Some(end) if end <= self.max_context_len => Ok(row.index() * self.max_context_len + start),
            _ => Err(RowError::OutOfBounds { row: row.slot - 1, start, len, max_context_len: self.max_context_len }),
        }
    }

    /// Write `slots` into the row at positions `start..start + slots.len()`.
    ///
    /// # Errors
    ///
    /// [`RowError::OutOfBounds`] past `max_context_len`, [`RowError::ForeignRow`] for
    /// another pool's handle. Nothing is written on error.
    pub fn write(&self, row: &mut ReqRow, start: usize, slots: &[u32]) -> Result<(), RowError> {
        let at = self.bounds(row, start, slots.len())?;
        row.overwritten_from(start);
        let cells = &self.table[at..at + slots.len()];
        // SAFETY: `&mut ReqRow` is the unique right to this row (module docs), so no
        // other reference to these cells exists while we write.
        let dst = unsafe { core::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), cells.len()) };
        dst.copy_from_slice(slots);
        Ok(())
    }

    /// Read positions `range` of the row. The slice borrows the handle, so the row
    /// cannot be written while it lives:
    ///
    /// ```compile_fail
    /// let pool = kvpool::ReqToTokenPool::new(1, 4)?;
    /// let mut row = pool.alloc()?;
    /// let view = pool.read(&row, 0..2)?;
    /// pool.write(&mut row, 0, &[1])?; // error: `row` is borrowed by `view`
    /// println!("{view:?}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write); a reversed range (`start > end`) is
    /// [`RowError::OutOfBounds`] too, its `len` being `end.wrapping_sub(start)`.
    pub fn read<'a>(&'a self, row: &'a ReqRow, range: core::ops::Range<usize>) -> Result<&'a [u32], RowError> {
        // Wrapping: a reversed range gets a length that overflows `start + len`, so the
        // bounds check refuses it with the rest (no separate comparison).
        let len = range.end.wrapping_sub(range.start);
        let at = self.bounds(row, range.start, len)?;
        let cells = &self.table[at..at + len];
        // SAFETY: a shared borrow of the unique handle: nobody can write this row while
        // the returned slice (which borrows `row`) lives. UnsafeCell<u32> has u32's layout.
        Ok(unsafe { core::slice::from_raw_parts(UnsafeCell::raw_get(cells.as_ptr()) as *const u32, len) })
    }

    /// Positions `range` of the row, writable.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read); the row's recorded state is kept then.
    pub fn read_mut<'a>(
        &'a self,
        row: &'a mut ReqRow,
        range: core::ops::Range<usize>,
    ) -> Result<&'a mut [u32], RowError> {
        // As in `read`: a reversed range fails the bounds check, before the row's
        // recorded state is touched.
        let len = range.end.wrapping_sub(range.start);
        let at = self.bounds(row, range.start, len)?;
        row.overwritten_from(range.start);
        let cells = &self.table[at..at + len];
        // SAFETY: the returned slice borrows the unique handle mutably, so nothing else
        // reads or writes this row while it lives (module docs).
        Ok(unsafe { core::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), len) })
    }

    /// Fill positions `prefix..seq` of the row with `fill(last_loc, out)`, where
    /// `last_loc` is the row's slot at `prefix - 1` (0 for an empty prefix): an
    /// allocator's `alloc_extend` for one request, writing straight into the row. On
    /// success the row remembers that these positions hold the expansion's whole pages
    /// (see [`shaped`](Self::shaped)); on error what `fill` wrote stays, unmarked.
    ///
    /// `fill` gets `(prefix, seq, last_loc, out, breaks)`, the lengths as `u32` (a row
    /// longer than `u32` positions is refused with [`InvalidInput::OutOfBounds`]), and
    /// returns whether it called `breaks(p)` for every position `p` of `out` where the
    /// slots stop being consecutive ([`KvAllocator::alloc_extend_runs`]); the row then
    /// remembers them too ([`expansion`](Self::expansion)).
    ///
    /// [`KvAllocator::alloc_extend_runs`]: crate::KvAllocator::alloc_extend_runs
    pub(crate) fn fill_extension<E: From<RowError> + From<InvalidInput>>(
        &self,
        row: &mut ReqRow,
        prefix: usize,
        seq: usize,
        fill: impl FnOnce(u32, u32, u32, &mut [u32], &mut dyn FnMut(usize)) -> Result<bool, E>,
    ) -> Result<(), E> {
        let (Ok(prefix32), Ok(seq32)) = (u32::try_from(prefix), u32::try_from(seq)) else {
            let (what, len) = ("token positions (u32)", u32::MAX as usize);
            return Err(InvalidInput::OutOfBounds { what, end: seq, len }.into());
        };
        let last_loc = match prefix.checked_sub(1) {
            Some(p) => self.read(row, p..prefix)?[0],
            None => 0,
        };
        let before = row.shaped;
        let before_breaks = self.expansion(row).breaks;
        let out = self.read_mut(row, prefix..seq.max(prefix))?;
        // The reported breaks, in row positions; past `ROW_BREAKS`, only the first
        // that does not fit matters (nothing is known from there on).
        let (mut new, mut n, mut past) = ([0u32; ROW_BREAKS], 0, None);
        let reported = fill(prefix32, seq32, last_loc, out, &mut |p| {
            let p = prefix32 + p as u32;
            if n < ROW_BREAKS {
                new[n] = p;
                n += 1;
            } else if past.is_none() {
                past = Some(p);
            }
        })?;
        let first = out.first().copied();
        // Extending the expansion the row ended with keeps one interval (`read_mut`
        // from its end left it in place), and its breaks, with one more where the new
        // slots do not continue the row's last.
        let extend = before.0 < before.1 && before.1 as usize == prefix;
        let mut breaks = if extend { before_breaks } else { Breaks::none(prefix32) };
        if reported && breaks.known == prefix32 {
            let joint = extend && first.is_some_and(|f| f != last_loc.wrapping_add(1));
            let new = joint.then_some(prefix32).into_iter().chain(new[..n].iter().copied()).chain(past);
            breaks.extend(new, seq32);
        }
        row.shaped = if extend { (before.0, seq32) } else { (prefix32, seq32) };
        // SAFETY: `&mut ReqRow` of this pool (`read_mut` checked) is the unique right to
        // its row's cells, this one included (module docs).
        unsafe { *self.breaks[row.index()].get() = breaks };
        Ok(())
    }

    /// What the allocator wrote into `row` and nobody has written over since
    /// ([`fill_extension`](Self::fill_extension)): [`shaped`](Self::shaped), and the
    /// breaks between its runs as far as they were reported.
    /// Nothing is vouched for in another pool's row.
    pub(crate) fn expansion(&self, row: &ReqRow) -> Expansion {
        let shaped = Self::shaped(row);
        if shaped.is_empty() || self.own(row).is_err() {
            return Expansion::NONE;
        }
        // SAFETY: a shared borrow of this pool's unique handle for the row: nobody
        // writes the row's cells meanwhile (module docs).
        Expansion { shaped, breaks: unsafe { *self.breaks[row.index()].get() } }
    }

    /// The positions of `row` that hold an allocator's expansion, unchanged since
    /// ([`fill_extension`](Self::fill_extension)): there every page is whole and in
    /// order, so a shape check need only look at the pages' first slots.
    pub(crate) fn shaped(row: &ReqRow) -> core::ops::Range<usize> {
        row.shaped.0 as usize..row.shaped.1 as usize
    }

    /// Note that positions `0..len` of `row` now hold the prefix cache's slots for the
    /// path ending at node `(last_page, epoch)` (see [`matched`](Self::matched)).
    pub(crate) fn set_matched(row: &mut ReqRow, len: usize, last_page: u32, epoch: u32) {
        row.matched = match u32::try_from(len) {
            Ok(len) if len > 0 => (len, last_page, epoch),
            _ => (0, 0, 0),
        };
    }

    /// `(len, last_page, epoch)` if positions `0..len` of `row` hold the prefix cache's
    /// own slots for the path ending at that node, written by the cache and unchanged
    /// since; `len` is 0 otherwise.
    pub(crate) fn matched(row: &ReqRow) -> (usize, u32, u32) {
        (row.matched.0 as usize, row.matched.1, row.matched.2)
    }

    /// The whole row (`max_context_len` slots).
    ///
    /// # Errors
    ///
    /// [`RowError::ForeignRow`] for another pool's handle.
    pub fn row<'a>(&'a self, row: &'a ReqRow) -> Result<&'a [u32], RowError> {
        self.read(row, 0..self.max_context_len)
    }

    /// Free every row. Outstanding handles become foreign (their use is an error).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.generation = next_generation();
    }

    /// Check the row arena's invariants (O(size)); exact at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] on a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.rows.check_invariants()
    }
}

impl core::fmt::Debug for ReqToTokenPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReqToTokenPool")
            .field("size", &self.size())
            .field("max_context_len", &self.max_context_len)
            .field("available", &self.available_size())
            .finish()
    }
}

/// Pool generations tell handles of different pools (and of one pool before and after
/// `clear`) apart. Not part of any concurrent algorithm, so it is a plain std atomic
/// even under loom.
fn next_generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn rows_are_unique_and_bounded() {
        let pool = ReqToTokenPool::new(2, 4).unwrap();
        let mut a = pool.alloc().unwrap();
        let mut b = pool.alloc().unwrap();
        assert_ne!(a.index(), b.index());
        assert_eq!(pool.alloc().unwrap_err().unit, Unit::Rows);
        pool.write(&mut a, 0, &[1, 2, 3, 4]).unwrap();
        pool.write(&mut b, 2, &[9, 9]).unwrap();
        assert_eq!(pool.row(&a).unwrap(), &[1, 2, 3, 4]);
        assert_eq!(pool.row(&b).unwrap(), &[0, 0, 9, 9]);
        assert!(matches!(pool.write(&mut a, 4, &[1]), Err(RowError::OutOfBounds { .. })));
        assert!(matches!(pool.write(&mut a, usize::MAX, &[1]), Err(RowError::OutOfBounds { .. })));
        assert_eq!(pool.row(&a).unwrap(), &[1, 2, 3, 4]);
        pool.write(&mut a, 4, &[]).unwrap();
        pool.free(a).unwrap();
        assert_eq!(pool.available_size(), 1);
        pool.check_invariants().unwrap();
    }

    /// A refused `read_mut` (here a reversed range, once read as empty) changes
    /// nothing: the row keeps its recorded expansion and prefix match. A valid one from
    /// below them forgets both.
    #[test]
    #[allow(clippy::reversed_empty_ranges)] // reversed on purpose
    fn refused_read_mut_keeps_the_row_state() {
        let pool = ReqToTokenPool::new(1, 8).unwrap();
        let mut r = pool.alloc().unwrap();
        pool.write(&mut r, 0, &[1, 2, 3, 4]).unwrap();
        r.shaped = (2, 4);
        ReqToTokenPool::set_matched(&mut r, 4, 1, 7);
        assert!(matches!(pool.read_mut(&mut r, 5..2), Err(RowError::OutOfBounds { start: 5, .. })));
        assert!(matches!(pool.read_mut(&mut r, 1..0), Err(RowError::OutOfBounds { start: 1, .. })));
        assert!(matches!(pool.read_mut(&mut r, 0..9), Err(RowError::OutOfBounds { .. })));
        assert_eq!(ReqToTokenPool::shaped(&r), 2..4);
        assert_eq!(ReqToTokenPool::matched(&r), (4, 1, 7));
        pool.read_mut(&mut r, 1..1).unwrap();
        assert_eq!(ReqToTokenPool::shaped(&r), 0..0);
        assert_eq!(ReqToTokenPool::matched(&r), (0, 0, 0));
    }

    #[test]
    fn foreign_and_stale_handles_are_refused() {
        let p1 = ReqToTokenPool::new(2, 4).unwrap();
        let mut p2 = ReqToTokenPool::new(2, 4).unwrap();
        let mut a = p1.alloc().unwrap();
        assert_eq!(p2.write(&mut a, 0, &[1]), Err(RowError::ForeignRow { row: 0 }));
        let stale = p2.alloc().unwrap();
        p2.clear();
        assert_eq!(p2.available_size(), 2);
        assert!(p2.row(&stale).is_err());
        assert!(p2.free(stale).is_err());
        assert_eq!(p2.available_size(), 2);
        assert!(ReqToTokenPool::new(1, 0).is_err());
    }
}
