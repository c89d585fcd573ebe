//! [`HybridReqToTokenPool`]: request rows that also own a Mamba state.

use std::sync::Arc;

use crate::error::{ConfigError, InvariantViolation, RowError};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::sync::atomic::{AtomicU32, Ordering};

use super::pool::sealed;
use super::{MambaError, MambaPool, MambaSlot};

/// A hybrid request row: a [`ReqRow`] plus the Mamba slots it owns — the working state
/// and up to two ping-pong track buffers for decode-time checkpoints.
///
/// Unique (neither `Clone` nor `Copy`); give it back with
/// [`HybridReqToTokenPool::free`], which frees every slot still in it. A slot taken out
/// ([`take_mamba`](HybridReqToTokenPool::take_mamba),
/// [`take_checkpoint`](HybridReqToTokenPool::take_checkpoint)) is no longer the row's:
/// it cannot be both freed with the row and kept by the tree.
///
/// The row lends out neither its token row nor its state handle by `&mut` (either
/// could be swapped for another handle behind the pool's back, and the pool's
/// `mamba_index` table would then name a state the row no longer holds): write its
/// tokens with [`HybridReqToTokenPool::write`] and its working state through
/// [`HeldState`](super::HeldState) (`MambaPool::component_mut(&mut row, ..)`).
///
/// ```
/// use std::sync::Arc;
/// use kvpool::mamba::{Component, HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
///
/// let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// let mamba = Arc::new(MambaPool::new(2, cfg)?);
/// let rows = HybridReqToTokenPool::new(1, 8, Arc::clone(&mamba), 0)?;
/// let mut req = rows.alloc()?;
/// rows.write(&mut req, 0, &[4, 5])?;                                      // its tokens
/// mamba.component_mut::<f32>(&mut req, 0, Component::Temporal)?[0] = 1.0; // its state
/// rows.free(req)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The state handle cannot be swapped out of the row (nor the token row):
///
/// ```compile_fail,E0599
/// # use std::sync::Arc;
/// # use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
/// # let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// # let mamba = Arc::new(MambaPool::new(2, cfg)?);
/// # let rows = HybridReqToTokenPool::new(1, 8, Arc::clone(&mamba), 0)?;
/// let mut req = rows.alloc()?;
/// let other = mamba.alloc()?;
/// let old = std::mem::replace(req.mamba_mut().unwrap(), other); // no `&mut MambaSlot`
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// ```compile_fail,E0624
/// # use std::sync::Arc;
/// # use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
/// # let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// # let rows = HybridReqToTokenPool::new(1, 8, Arc::new(MambaPool::new(2, cfg)?), 0)?;
/// let mut req = rows.alloc()?;
/// let plain = kvpool::ReqToTokenPool::new(1, 8)?.alloc()?;
/// let old = std::mem::replace(req.req_row_mut(), plain); // no `&mut ReqRow`
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Nor can plain rows be allocated (or freed) in the hybrid pool's own token table,
/// which its Mamba tables would not know:
///
/// ```compile_fail,E0624
/// # use std::sync::Arc;
/// # use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
/// # let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// # let rows = HybridReqToTokenPool::new(1, 8, Arc::new(MambaPool::new(2, cfg)?), 0)?;
/// let plain = rows.tokens().alloc()?; // `tokens` is private
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[must_use = "a request row is held until it is freed"]
pub struct HybridRow {
    row: ReqRow,
    mamba: Option<MambaSlot>,
    track: [Option<MambaSlot>; 2],
    /// The track buffer the next checkpoint goes to (SGLang's `mamba_next_track_idx`).
    next_track: u8,
}

impl HybridRow {
    /// The row number, `0..size` (SGLang's `req_pool_idx`).
    pub fn index(&self) -> usize {
        self.row.index()
    }

    /// The working Mamba state, unless it was taken. To write it, pass the row itself
    /// to [`MambaPool::component_mut`] (see [`HeldState`](super::HeldState)).
    pub fn mamba(&self) -> Option<&MambaSlot> {
        self.mamba.as_ref()
    }

    /// Track buffer `i` (0 or 1), unless absent or taken.
    pub fn track(&self, i: usize) -> Option<&MambaSlot> {
        self.track.get(i).and_then(Option::as_ref)
    }

    /// The track buffer the next checkpoint is written to.
    pub fn next_track(&self) -> usize {
        self.next_track as usize
    }
}

impl sealed::Holder for HybridRow {
    fn held(&self) -> Result<&MambaSlot, MambaError> {
        self.mamba.as_ref().ok_or(MambaError::NoWorkingState)
    }
}

/// Why [`HybridReqToTokenPool::alloc`] failed: nothing was allocated, and a state
/// passed to [`alloc_with`](HybridReqToTokenPool::alloc_with) comes back in `returned`.
#[derive(Debug)]
pub struct HybridAllocError {
    /// What went wrong (out of rows or of Mamba slots, or a foreign state handle).
    pub error: MambaError,
    /// The state handed to `alloc_with`, given back.
    pub returned: Option<MambaSlot>,
}

crate::error::hands_back!(HybridAllocError);

/// Why [`HybridReqToTokenPool::free`] refused a row: nothing was freed, and the row
/// comes back whole (with every state it owns) in `row`.
#[derive(Debug)]
pub struct HybridFreeError {
    /// What went wrong ([`MambaError::Row`] for another pool's row,
    /// [`MambaError::ForeignSlot`] for a state of another Mamba pool).
    pub error: MambaError,
    /// The row handed to `free`, given back.
    pub row: HybridRow,
}

crate::error::hands_back!(HybridFreeError);

/// SGLang's `HybridReqToTokenPool`: a [`ReqToTokenPool`] whose rows also own a Mamba
/// slot (`req_index_to_mamba_index`) and `track_buffers` ping-pong track buffers
/// (2, or 1 with speculative decoding, or 0 without SGLang's extra buffer).
///
/// A row and its slots are allocated together, all or nothing. The tables
/// ([`mamba_index`](Self::mamba_index), [`track_indices`](Self::track_indices)) are
/// atomics any thread may read (to build a batch's index tensor); only the row's
/// holder changes its entries.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
///
/// let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// let mamba = Arc::new(MambaPool::new(3, cfg)?);
/// let rows = HybridReqToTokenPool::new(2, 64, Arc::clone(&mamba), 0)?;
/// let mut a = rows.alloc()?;
/// rows.write(&mut a, 0, &[5, 6, 7])?;
/// assert_eq!(rows.read(&a, 0..3)?, &[5, 6, 7]);
/// let b = rows.alloc()?;
/// let err = rows.alloc().unwrap_err();                 // out of rows
/// assert_eq!(mamba.available(), 1);                     // nothing leaked
/// let state = rows.take_mamba(&mut a).unwrap();         // the tree takes the state
/// rows.free(a)?;
/// assert!(mamba.is_allocated(state.index()));           // not freed with the row
/// mamba.free_slot(state)?;
/// rows.free(b)?;
/// # let _ = err;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct HybridReqToTokenPool {
    tokens: ReqToTokenPool,
    mamba: Arc<MambaPool>,
    /// `req_index_to_mamba_index_mapping`: row -> working slot (0: none).
    mamba_index: Box<[AtomicU32]>,
    /// `req_index_to_mamba_ping_pong_track_buffer_mapping`: row -> 2 slots (0: none).
    track_index: Box<[AtomicU32]>,
    track_buffers: usize,
}

impl HybridReqToTokenPool {
    /// `size` rows of `max_context_len` KV slots, whose states come from `mamba`, with
    /// `track_buffers` (0, 1 or 2) track buffers per row.
    ///
    /// # Errors
    ///
    /// As [`ReqToTokenPool::new`]; [`ConfigError::TooLarge`] for more than 2 track
    /// buffers.
    pub fn new(
        size: u32,
        max_context_len: usize,
        mamba: Arc<MambaPool>,
        track_buffers: usize,
    ) -> Result<Self, ConfigError> {
        if track_buffers > 2 {
            return Err(ConfigError::TooLarge { size: track_buffers as u64, page_size: 1 });
        }
        let tokens = ReqToTokenPool::new(size, max_context_len)?;
        Ok(HybridReqToTokenPool {
            tokens,
            mamba,
            mamba_index: (0..size).map(|_| AtomicU32::new(0)).collect(),
            track_index: (0..2 * size as usize).map(|_| AtomicU32::new(0)).collect(),
            track_buffers,
        })
    }

    /// SGLang's track buffer count: 2 (ping-pong), 1 with speculative decoding.
    #[cfg(test)]
    pub(crate) fn track_buffers_for(speculative: bool) -> usize {
        if speculative {
            1
        } else {
            2
        }
    }

    /// Positions per row (`max_context_len`).
    pub fn max_context_len(&self) -> usize {
        self.tokens.max_context_len()
    }

    /// Write `slots` into the row at positions `start..start + slots.len()`
    /// ([`ReqToTokenPool::write`]). Does not allocate.
    ///
    /// # Errors
    ///
    /// [`RowError::OutOfBounds`] past `max_context_len`, [`RowError::ForeignRow`] for
    /// another pool's row. Nothing is written on error.
    pub fn write(&self, row: &mut HybridRow, start: usize, slots: &[u32]) -> Result<(), RowError> {
        self.tokens.write(&mut row.row, start, slots)
    }

    /// Read positions `range` of the row ([`ReqToTokenPool::read`]); the slice borrows
    /// the row, so it cannot be written meanwhile.
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn read<'a>(&'a self, row: &'a HybridRow, range: core::ops::Range<usize>) -> Result<&'a [u32], RowError> {
        self.tokens.read(&row.row, range)
    }

    /// Positions `range` of the row, writable ([`ReqToTokenPool::read_mut`]).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn read_mut<'a>(
        &'a self,
        row: &'a mut HybridRow,
        range: core::ops::Range<usize>,
    ) -> Result<&'a mut [u32], RowError> {
        self.tokens.read_mut(&mut row.row, range)
    }

    /// Whether `row` is one of this pool's live rows (not another pool's, not one from
    /// before a `clear`).
    fn owns(&self, row: &HybridRow) -> Result<(), RowError> {
        self.tokens.read(&row.row, 0..0).map(|_| ())
    }

    /// Number of rows.
    pub fn size(&self) -> usize {
        self.tokens.size()
    }

    /// Free rows now.
    pub fn available_size(&self) -> usize {
        self.tokens.available_size()
    }

    /// Track buffers per row.
    pub fn track_buffers(&self) -> usize {
        self.track_buffers
    }

    /// The other track buffer: with two, `1` for `0` and `0` for `1`; with one (or
    /// none), `i` itself. Total: an `i` past the buffers is read as `i & 1` with two
    /// (so the result is always 0 or 1), and comes back as is otherwise (the `take_*`
    /// calls then find no buffer there).
    pub fn other_track(&self, i: usize) -> usize {
        if self.track_buffers == 2 {
            (i & 1) ^ 1
        } else {
            i
        }
    }

    /// A row with a fresh (zeroed) working state and its track buffers, all or nothing.
    /// Lock-free; does not allocate.
    ///
    /// # Errors
    ///
    /// [`MambaError::OutOfMemory`] in rows or in Mamba slots; nothing allocated.
    pub fn alloc(&self) -> Result<HybridRow, HybridAllocError> {
        self.alloc_inner(None)
    }

    /// A row whose working state is `state` (e.g. forked from the tree with
    /// [`MambaPool::fork_from`]: SGLang's `req.mamba_pool_idx` already set), plus fresh
    /// track buffers, all or nothing.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc), and [`MambaError::ForeignSlot`]; `state` comes back
    /// in the error.
    pub fn alloc_with(&self, state: MambaSlot) -> Result<HybridRow, HybridAllocError> {
        self.alloc_inner(Some(state))
    }

    fn alloc_inner(&self, state: Option<MambaSlot>) -> Result<HybridRow, HybridAllocError> {
        if let Some(s) = &state {
            if let Err(error) = self.mamba.own(s) {
                return Err(HybridAllocError { error, returned: state });
            }
        }
        let row = match self.tokens.alloc() {
            Ok(r) => r,
            Err(e) => return Err(HybridAllocError { error: e.into(), returned: state }),
        };
        let need = usize::from(state.is_none()) + self.track_buffers;
        let mut got = [0u32; 3];
        if let Err(e) = self.mamba.alloc_raw(&mut got[..need], true) {
            // The row is ours and unique: giving it back cannot fail.
            let _ = self.tokens.free(row);
            return Err(HybridAllocError { error: e.into(), returned: state });
        }
        let mut fresh = got[..need].iter().map(|&s| self.mamba.handle(s));
        let mamba = state.or_else(|| fresh.next());
        let track = [fresh.next(), fresh.next()];
        let r = row.index();
        self.mamba_index[r].store(mamba.as_ref().map_or(0, MambaSlot::index), Ordering::Relaxed);
        for (i, t) in track.iter().enumerate() {
            self.track_index[2 * r + i].store(t.as_ref().map_or(0, MambaSlot::index), Ordering::Relaxed);
        }
        Ok(HybridRow { row, mamba, track, next_track: 0 })
    }

    /// Give the row back with every Mamba slot still in it. Does not allocate.
    ///
    /// # Errors
    ///
    /// [`HybridFreeError`] with [`MambaError::Row`] for another pool's row (also one
    /// of another pool sharing this pool's [`MambaPool`]), or
    /// [`MambaError::ForeignSlot`] for a state of another Mamba pool: nothing is freed,
    /// and the row comes back whole in the error.
    // The row comes back by value on error (boxing it would allocate on a path that
    // must not): the error is as large as the row.
    #[allow(clippy::result_large_err)]
    pub fn free(&self, row: HybridRow) -> Result<(), HybridFreeError> {
        // Check everything first, so that what follows cannot fail half way.
        if let Err(e) = self.owns(&row) {
            return Err(HybridFreeError { error: e.into(), row });
        }
        let held = row.mamba.iter().chain(row.track.iter().flatten());
        if let Some(error) = held.map(|s| self.mamba.own(s)).find_map(Result::err) {
            return Err(HybridFreeError { error, row });
        }
        let HybridRow { row, mamba, track, .. } = row;
        let r = row.index();
        self.mamba_index[r].store(0, Ordering::Relaxed);
        self.track_index[2 * r].store(0, Ordering::Relaxed);
        self.track_index[2 * r + 1].store(0, Ordering::Relaxed);
        for s in mamba.into_iter().chain(track.into_iter().flatten()) {
            // Ours (checked above) and unique, so allocated: this cannot fail.
            let freed = self.mamba.free_slot(s);
            debug_assert!(freed.is_ok(), "a checked Mamba slot failed to free: {freed:?}");
        }
        // Ours (checked above) and unique: this cannot fail.
        let freed = self.tokens.free(row);
        debug_assert!(freed.is_ok(), "a checked request row failed to free: {freed:?}");
        Ok(())
    }

    /// Detach the working state from the row (chunked prefill keeps it for the next
    /// chunk; the tree caches it): the row no longer owns it, so
    /// [`free`](Self::free) will not free it. `None` when it was taken already, or
    /// when the row is another pool's (nothing changes then).
    pub fn take_mamba(&self, row: &mut HybridRow) -> Option<MambaSlot> {
        self.owns(row).ok()?;
        let s = row.mamba.take()?;
        self.mamba_index[row.index()].store(0, Ordering::Relaxed);
        Some(s)
    }

    /// Detach track buffer `i` (SGLang's `mamba_ping_pong_track_buffer_to_keep`).
    /// `None` when there is none at `i` (absent, taken, or `i >= 2`), or when the row
    /// is another pool's (nothing changes then).
    pub fn take_track(&self, row: &mut HybridRow, i: usize) -> Option<MambaSlot> {
        self.owns(row).ok()?;
        let s = row.track.get_mut(i)?.take()?;
        self.track_index[2 * row.index() + i].store(0, Ordering::Relaxed);
        Some(s)
    }

    /// Detach the track buffer holding the newest checkpoint (the one before
    /// [`HybridRow::next_track`]).
    pub fn take_checkpoint(&self, row: &mut HybridRow) -> Option<MambaSlot> {
        let i = self.other_track(row.next_track());
        self.take_track(row, i)
    }

    /// A decode-time checkpoint on the host: copy the working state into track buffer
    /// [`next_track`](HybridRow::next_track), then switch to the other one. Returns the
    /// slot written.
    ///
    /// # Errors
    ///
    /// [`MambaError::NoTrackBuffers`] if that track buffer (or the working state) is
    /// absent or was taken; [`MambaError::Row`] for another pool's row. Nothing
    /// changes on error.
    pub fn checkpoint(&self, row: &mut HybridRow) -> Result<u32, MambaError> {
        self.owns(row)?;
        let i = row.next_track();
        let (Some(src), Some(dst)) = (row.mamba.as_ref(), row.track[i].as_mut()) else {
            return Err(MambaError::NoTrackBuffers);
        };
        self.mamba.copy_slot(src, dst)?;
        let written = dst.index();
        row.next_track = self.other_track(i) as u8;
        Ok(written)
    }

    /// `req_index_to_mamba_index[req_index]`: the row's working slot, 0 when none.
    ///
    /// # Panics
    ///
    /// If `req_index >= size`.
    pub fn mamba_index(&self, req_index: usize) -> u32 {
        self.mamba_index[req_index].load(Ordering::Relaxed)
    }

    /// The row's track buffer slots (0 where none).
    ///
    /// # Panics
    ///
    /// If `req_index >= size`.
    pub fn track_indices(&self, req_index: usize) -> [u32; 2] {
        [
            self.track_index[2 * req_index].load(Ordering::Relaxed),
            self.track_index[2 * req_index + 1].load(Ordering::Relaxed),
        ]
    }

    /// `out[i] = mamba_index(req_indices[i])`: a batch's state indices (SGLang's
    /// `get_mamba_indices`). Does not allocate.
    ///
    /// # Errors
    ///
    /// [`MambaError::LengthMismatch`], or [`MambaError::BadRow`] for a row past
    /// `size`; nothing written.
    pub fn mamba_indices(&self, req_indices: &[usize], out: &mut [u32]) -> Result<(), MambaError> {
        if out.len() != req_indices.len() {
            return Err(MambaError::LengthMismatch { src: req_indices.len(), dst: out.len() });
        }
        if let Some(&row) = req_indices.iter().find(|&&r| r >= self.size()) {
            return Err(MambaError::BadRow { row, rows: self.size() });
        }
        for (o, &r) in out.iter_mut().zip(req_indices) {
            *o = self.mamba_index(r);
        }
        Ok(())
    }

    /// Check both arenas (O(size)); exact at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] on a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.tokens.check_invariants()?;
        self.mamba.check_invariants()
    }
}

impl core::fmt::Debug for HybridReqToTokenPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HybridReqToTokenPool")
            .field("tokens", &self.tokens)
            .field("mamba", &self.mamba)
            .field("track_buffers", &self.track_buffers)
            .finish()
    }
}
