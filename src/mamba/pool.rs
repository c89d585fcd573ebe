//! [`MambaPool`]: the fixed arena of Mamba state slots.

use core::cell::UnsafeCell;

use crate::error::{ConfigError, FreeError, FreeErrorKind, InvariantViolation, OutOfMemory, Unit};
use crate::slots::SlotPool;
use crate::sync::atomic::{AtomicU32, Ordering};

use super::{Component, MambaConfig, MambaError};

/// The per-slot state word (`MambaPool::states`), one `AtomicU32` per slot:
///
/// | value                  | meaning                                                     |
/// |------------------------|-------------------------------------------------------------|
/// | `FREE` (0)             | free in the slot arena (or being handed out by `alloc`)     |
/// | `CACHED + n`           | a cached state owned by number, with `n` readers pinning it |
/// | `TREE \| (CACHED + n)` | the same, held by a radix tree: only the tree frees it     |
/// | `DOOMED \| TREE \| (CACHED + n)` | freed by the tree while pinned: no new pins; the last unpin frees it |
/// | `RETIRING`             | a `free` by number is taking it (for the length of one call)|
/// | `OWNED`                | held through a [`MambaSlot`] handle: writable by that holder|
///
/// `n` is at most `MAX_PINS`, so a cached word (tree-held, doomed or not) stays below
/// `1 << 31` and never meets `RETIRING` or `OWNED`.
const FREE: u32 = 0;
const CACHED: u32 = 1;
const DOOMED: u32 = 1 << 29;
const TREE: u32 = 1 << 30;
const RETIRING: u32 = u32::MAX - 1;
const OWNED: u32 = u32::MAX;
const MAX_PINS: u32 = DOOMED - CACHED - 1;

/// The pins of a cached state word (tree-held, doomed or not), or `None` for any other
/// word.
#[inline]
fn pins(word: u32) -> Option<u32> {
    (CACHED..1 << 31).contains(&word).then(|| (word & !(TREE | DOOMED)) - CACHED)
}

/// Whether `word` is a cached state a caller may still pin or free: cached and not
/// doomed.
#[inline]
fn live(word: u32) -> bool {
    pins(word).is_some() && word & DOOMED == 0
}

/// A Mamba state slot handle: the right to read and write one slot's state.
///
/// Unique by construction (neither `Clone` nor `Copy`), like a [`ReqRow`](crate::ReqRow).
/// Give it back with [`MambaPool::free_slot`], or turn it into a cached state owned by
/// number (for the radix tree) with [`MambaPool::cache`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a Mamba state slot is held until it is freed or cached"]
pub struct MambaSlot {
    slot: u32,
    pool: u64,
}

impl MambaSlot {
    /// The slot number, `1..=size` (SGLang's `mamba_pool_idx`; 0 is the dummy slot).
    pub fn index(&self) -> u32 {
        self.slot
    }
}

/// Why [`MambaPool::free_slot`] or [`MambaPool::cache`] refused a handle: nothing
/// changed, and the handle comes back in `slot` (to be given to the pool it belongs to).
///
/// ```
/// use kvpool::mamba::{MambaConfig, MambaError, MambaPool, StateDtype, StateShape};
///
/// let cfg = || MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// let (a, b) = (MambaPool::new(1, cfg())?, MambaPool::new(1, cfg())?);
/// let slot = a.alloc()?;
/// let refused = b.free_slot(slot).unwrap_err(); // the wrong pool
/// assert!(matches!(refused.error, MambaError::ForeignSlot { .. }));
/// a.free_slot(refused.slot)?;                    // the right one
/// assert_eq!(a.available(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, PartialEq, Eq)]
pub struct SlotRefused {
    /// What went wrong.
    pub error: MambaError,
    /// The handle, given back.
    pub slot: MambaSlot,
}

crate::error::hands_back!(SlotRefused => MambaError);

/// What holds a Mamba state the caller may read and write: a [`MambaSlot`], or a
/// [`HybridRow`](super::HybridRow) (its working state). The pool's state accessors
/// ([`MambaPool::component`], [`component_mut`](MambaPool::component_mut),
/// [`zero_slot`](MambaPool::zero_slot), [`copy_slot`](MambaPool::copy_slot),
/// [`copy_from`](MambaPool::copy_from)) take either.
///
/// A hybrid row never lends its state handle out by `&mut` (a `&mut MambaSlot` could
/// be swapped for another handle behind the row's back, leaving the pool's
/// `mamba_index` table naming a slot the row no longer holds), so writing a row's
/// working state goes through this trait instead. Sealed: only kvpool's handles
/// implement it.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use kvpool::mamba::{Component, HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
///
/// let cfg = MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) };
/// let mamba = Arc::new(MambaPool::new(2, cfg)?);
/// let rows = HybridReqToTokenPool::new(1, 8, Arc::clone(&mamba), 0)?;
/// let mut req = rows.alloc()?;
/// mamba.component_mut::<f32>(&mut req, 0, Component::Temporal)?[0] = 1.0; // the row's state
/// let mut spare = mamba.alloc()?;
/// mamba.copy_slot(&req, &mut spare)?;                                     // row -> handle
/// assert_eq!(mamba.component::<f32>(&spare, 0, Component::Temporal)?[0], 1.0);
/// mamba.free_slot(spare)?;
/// rows.free(req)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait HeldState: sealed::Holder {}

impl HeldState for MambaSlot {}
impl HeldState for super::HybridRow {}

pub(crate) mod sealed {
    use super::{MambaError, MambaSlot};

    /// The private half of [`HeldState`](super::HeldState): the handle inside, which
    /// users cannot reach (the trait cannot be named outside kvpool), so they cannot
    /// get a `&mut MambaSlot` out of a row.
    pub trait Holder {
        /// The state handle held, or why there is none.
        fn held(&self) -> Result<&MambaSlot, MambaError>;
    }

    impl Holder for MambaSlot {
        fn held(&self) -> Result<&MambaSlot, MambaError> {
            Ok(self)
        }
    }
}

/// 16 bytes of state, 16-aligned, so every row of every element type is aligned for
/// its type (row offsets are multiples of the row size, itself a multiple of the
/// element size).
#[repr(C, align(16))]
struct Chunk(UnsafeCell<[u8; 16]>);

/// `size` Mamba state slots (plus the dummy slot 0): per Mamba layer, each slot holds
/// the conv state(s) and the temporal (SSM) state of [`MambaConfig`]. SGLang's
/// `MambaPool`.
///
/// Each component is one buffer `[layers, size + 1, row]` (SGLang's tensor layout), so
/// a layer's states of all slots form one dense tensor indexed by slot number.
///
/// # Ownership
///
/// A slot is in one of three hands:
///
/// * **free**;
/// * **held** through a [`MambaSlot`] handle ([`alloc`](Self::alloc),
///   [`fork_from`](Self::fork_from)): only the holder reads and writes it, through
///   `&` / `&mut` of the handle or of the [`HybridRow`](super::HybridRow) holding it
///   (see [`HeldState`]);
/// * **cached**, owned by number ([`cache`](Self::cache) consumes the handle): the
///   state is frozen. Anyone may read it while *pinning* it ([`fork_from`](Self::fork_from),
///   [`copy_from`](Self::copy_from), [`read_cached`](Self::read_cached)); the owner
///   gives it back with [`free`](Self::free), which refuses a slot that is pinned at
///   that instant ([`FreeErrorKind::InUse`]) or not cached. Once handed to a
///   [`MambaRadixCache`](crate::radix::MambaRadixCache) it is the tree's
///   ([`is_tree_held`](Self::is_tree_held)): the tree frees it when it evicts it (or is
///   dropped), and [`free`](Self::free) refuses it ([`FreeErrorKind::Cached`]) whoever
///   calls it, so no number can be freed behind the tree's back.
///
/// So a state is never written while anyone else reads it, in safe code, whatever the
/// callers do: the worst a confused caller gets is an error.
///
/// # Examples
///
/// ```
/// use kvpool::mamba::{Component, MambaConfig, MambaPool, StateDtype, StateShape};
///
/// let cfg = MambaConfig {
///     layers: 2,
///     conv: vec![StateShape::new(&[8, 3], StateDtype::Bf16)],
///     temporal: StateShape::new(&[2, 4, 4], StateDtype::F32),
/// };
/// let pool = MambaPool::new(4, cfg)?;
/// let mut slot = pool.alloc()?;                          // zeroed
/// pool.component_mut::<f32>(&mut slot, 1, Component::Temporal)?[0] = 1.5;
/// let cached = pool.cache(slot)?;                        // owned by number now
/// let fork = pool.fork_from(cached)?;                    // copy-on-write into a request
/// assert_eq!(pool.component::<f32>(&fork, 1, Component::Temporal)?[0], 1.5);
/// pool.free(&[cached])?;                                 // eviction
/// assert!(pool.free(&[cached]).is_err());                // double free: typed error
/// pool.free_slot(fork)?;
/// assert_eq!(pool.available(), 4);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MambaPool {
    slots: SlotPool,
    /// One state word per slot `0..=size` (see `FREE` .. `OWNED`).
    states: Box<[AtomicU32]>,
    /// One buffer per component (the conv states, then the temporal state).
    buffers: Box<[Box<[Chunk]>]>,
    /// Bytes of one row (one slot, one layer) of each component.
    row_bytes: Box<[usize]>,
    config: MambaConfig,
    generation: u64,
}

// SAFETY: the state bytes are reached only by the holder of a slot's unique handle
// (reads through `&`, writes through `&mut` of the handle or of the `HybridRow` that
// holds it, which never lends the handle out by `&mut`) or, for a cached slot,
// by readers that pinned it, and a cached slot is never written (see "Ownership").
// Every other field is atomic or immutable.
unsafe impl Sync for MambaPool {}
// SAFETY: the pool owns its buffers; nothing in it is tied to a thread.
unsafe impl Send for MambaPool {}

impl MambaPool {
    /// `size` slots of `config`'s states, all zero, slot 0 reserved as the dummy.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero `size`, zero layers or an empty shape;
    /// [`ConfigError::TooLargeForMemory`] (with the bytes) when the buffers cannot be
    /// allocated.
    pub fn new(size: u32, config: MambaConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        if size == 0 {
            return Err(ConfigError::Zero("mamba pool size"));
        }
        // `validate` checked every row's bytes fit a `usize`; the products below are
        // checked too, so no shape can wrap into a smaller layout.
        let too_large = ConfigError::TooLargeForMemory { what: "the Mamba state buffers", bytes: u64::MAX };
        let row_bytes: Box<[usize]> = config.components().map(|c| config.row_bytes(c)).collect();
        let rows = (size as usize).checked_add(1).and_then(|n| n.checked_mul(config.layers as usize));
        let rows = rows.ok_or(too_large.clone())?;
        let total = row_bytes.iter().try_fold(0u64, |acc, &r| acc.checked_add((r as u64).checked_mul(rows as u64)?));
        let total = total.ok_or(too_large.clone())?;
        crate::arena::probe(total, "the Mamba state buffers")?;
        let mut buffers = Vec::with_capacity(row_bytes.len());
        for &r in row_bytes.iter() {
            let chunks = r.checked_mul(rows).ok_or(too_large.clone())?.div_ceil(16);
            let buf = crate::arena::try_vec_with(chunks, "a Mamba state buffer", |_| Chunk(UnsafeCell::new([0; 16])))?;
            buffers.push(buf.into_boxed_slice());
        }
        Ok(MambaPool {
            // Lowest-first, like SGLang's free list: one slot per request, where a
            // magazine saves nothing worth the changed order.
            slots: SlotPool::without_magazines(size),
            states: (0..=size).map(|_| AtomicU32::new(FREE)).collect(),
            buffers: buffers.into_boxed_slice(),
            row_bytes,
            config,
            generation: super::next_generation(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MambaConfig {
        &self.config
    }

    /// Number of slots (`1..=size` are handed out; slot 0 is the dummy).
    pub fn size(&self) -> usize {
        self.slots.capacity() as usize
    }

    /// Free slots now (exact at quiescence).
    pub fn available(&self) -> usize {
        self.slots.available()
    }

    /// Whether `slot` is allocated (held or cached). `false` for 0 and out-of-range.
    pub fn is_allocated(&self, slot: u32) -> bool {
        self.slots.is_allocated(slot)
    }

    /// Whether `slot` is a cached state (owned by number).
    pub fn is_cached(&self, slot: u32) -> bool {
        self.states.get(slot as usize).is_some_and(|s| live(s.load(Ordering::Acquire)))
    }

    /// Whether `slot` is a cached state a [`MambaRadixCache`](crate::radix::MambaRadixCache)
    /// over this pool holds: its tree's, or one of its requests saved for caching. Only
    /// the cache frees it, so [`free`](Self::free) refuses it.
    pub fn is_tree_held(&self, slot: u32) -> bool {
        self.states.get(slot as usize).is_some_and(|s| {
            let w = s.load(Ordering::Acquire);
            live(w) && w & TREE != 0
        })
    }

    /// Bytes of one slot's whole state (every layer, every component).
    pub fn slot_bytes(&self) -> usize {
        self.row_bytes.iter().sum::<usize>() * self.config.layers as usize
    }

    /// Take a free slot, its state zeroed. Lock-free; does not allocate.
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] (in [`Unit::MambaSlots`]) when every slot is taken.
    pub fn alloc(&self) -> Result<MambaSlot, OutOfMemory> {
        let mut one = [0u32];
        self.alloc_raw(&mut one, true)?;
        Ok(self.handle(one[0]))
    }

    /// Allocate `out.len()` slots all or nothing, mark them held and (with `zero`)
    /// zero them. The caller wraps each in a handle.
    pub(crate) fn alloc_raw(&self, out: &mut [u32], zero: bool) -> Result<(), OutOfMemory> {
        self.slots.alloc_as(out, Unit::MambaSlots)?;
        for &s in out.iter() {
            if zero {
                self.zero(s);
            }
            // Relaxed: the slot pool's Acquire on allocation already ordered the last
            // holder's accesses before ours; this word only tells later `pin`s and
            // `free`s that the slot is held, and they refuse it either way.
            self.states[s as usize].store(OWNED, Ordering::Relaxed);
        }
        Ok(())
    }

    pub(crate) fn handle(&self, slot: u32) -> MambaSlot {
        MambaSlot { slot, pool: self.generation }
    }

    /// Give a held slot back.
    ///
    /// # Errors
    ///
    /// [`SlotRefused`] with [`MambaError::ForeignSlot`] for another pool's handle (or
    /// one from before a [`clear`](Self::clear)): nothing is freed, and the handle
    /// comes back in the error.
    pub fn free_slot(&self, slot: MambaSlot) -> Result<(), SlotRefused> {
        if let Err(error) = self.own(&slot) {
            return Err(SlotRefused { error, slot });
        }
        self.states[slot.slot as usize].store(FREE, Ordering::Relaxed);
        // The handle is unique, so its slot is allocated: this cannot fail. The slot
        // pool's Release orders our accesses before the next holder's.
        match self.slots.free(&[slot.slot]) {
            Ok(()) => Ok(()),
            Err(_) => Err(SlotRefused { error: MambaError::ForeignSlot { slot: slot.slot }, slot }),
        }
    }

    /// Turn a held slot into a cached state owned by number (for the radix tree):
    /// from now on it is read-only, readable by anyone who pins it, and freed with
    /// [`free`](Self::free) (or by the tree it is handed to). Returns the slot number.
    ///
    /// # Errors
    ///
    /// [`SlotRefused`] with [`MambaError::ForeignSlot`] for another pool's handle,
    /// which comes back in the error (nothing changed).
    pub fn cache(&self, slot: MambaSlot) -> Result<u32, SlotRefused> {
        self.cache_as(slot, CACHED)
    }

    /// Cache held slot `slot` straight into a cache's hands (a request's saved state,
    /// which its tree takes or frees): [`cache`](Self::cache) and
    /// [`hold_for_tree`](Self::hold_for_tree) in one store.
    pub(crate) fn cache_for_tree(&self, slot: MambaSlot) -> Result<u32, SlotRefused> {
        self.cache_as(slot, TREE | CACHED)
    }

    /// [`cache`](Self::cache) into state word `word` (`CACHED`, or `TREE | CACHED`).
    fn cache_as(&self, slot: MambaSlot, word: u32) -> Result<u32, SlotRefused> {
        if let Err(error) = self.own(&slot) {
            return Err(SlotRefused { error, slot });
        }
        // Release: the holder's writes happen before any reader's pin (Acquire).
        self.states[slot.slot as usize].store(word, Ordering::Release);
        Ok(slot.slot)
    }

    /// A zeroed slot, cached by number at once (a tree's `alloc_state`).
    pub(crate) fn alloc_cached(&self) -> Result<u32, OutOfMemory> {
        let mut one = [0u32];
        self.alloc_raw(&mut one, true)?;
        // Release: the zeroing happens before any reader's pin (Acquire).
        self.states[one[0] as usize].store(CACHED, Ordering::Release);
        Ok(one[0])
    }

    /// Free cached states by number, all or nothing: states the caller cached with
    /// [`cache`](Self::cache) (or took from a tree's `alloc_state`) and did not hand to
    /// a tree.
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first offending slot, with nothing freed: out of range
    /// (0 or above `size`), not allocated (a double free; also a slot named twice in
    /// the batch), [`FreeErrorKind::Cached`]: held by a radix tree (which frees it
    /// itself, when it evicts it), or [`FreeErrorKind::InUse`]: held through a handle,
    /// or pinned by a reader at this instant.
    pub fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.free_from(slots, CACHED)
    }

    /// Free states by number whose words are `from` (no pins): `CACHED` for a caller's,
    /// `TREE | CACHED` for the tree's.
    fn free_from(&self, slots: &[u32], from: u32) -> Result<(), FreeError> {
        let size = self.slots.capacity();
        for &s in slots {
            if s == 0 || s > size {
                return Err(FreeError {
                    index: s,
                    kind: FreeErrorKind::OutOfRange { first: 1, last: size },
                    rest_freed: false,
                });
            }
        }
        // Retire each slot: `from` (no pins) -> RETIRING. A pin racing with this sees
        // RETIRING and fails; a slot pinned first makes this fail.
        for (i, &s) in slots.iter().enumerate() {
            // Acquire: the readers' unpins (Release) happen before we free the memory.
            if let Err(actual) =
                self.states[s as usize].compare_exchange(from, RETIRING, Ordering::Acquire, Ordering::Relaxed)
            {
                for &r in &slots[..i] {
                    self.states[r as usize].store(from, Ordering::Release);
                }
                let kind = match actual {
                    FREE | RETIRING => FreeErrorKind::NotAllocated,
                    w if pins(w).is_some() && w & DOOMED != 0 => FreeErrorKind::NotAllocated,
                    w if pins(w).is_some() && (w & TREE) != (from & TREE) => FreeErrorKind::Cached,
                    _ => FreeErrorKind::InUse,
                };
                return Err(FreeError { index: s, kind, rest_freed: false });
            }
        }
        for &s in slots {
            self.states[s as usize].store(FREE, Ordering::Relaxed);
        }
        // Every slot was cached (so allocated) and retired by us: this cannot fail.
        self.slots.free(slots)
    }

    /// A radix tree takes cached state `slot` from its caller: from now on only the
    /// tree frees it ([`free_tree_held`](Self::free_tree_held)). Readers' pins stay.
    /// `false` (nothing changed) when `slot` is not a cached state free of any tree.
    pub(crate) fn hold_for_tree(&self, slot: u32) -> bool {
        let Some(word) = self.states.get(slot as usize).filter(|_| slot != 0) else { return false };
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            if !live(cur) || cur & TREE != 0 {
                return false;
            }
            match word.compare_exchange_weak(cur, cur | TREE, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Undo [`hold_for_tree`](Self::hold_for_tree): the caller's again (a refused
    /// insert hands it back).
    pub(crate) fn release_from_tree(&self, slot: u32) {
        if let Some(word) = self.states.get(slot as usize) {
            word.fetch_and(!TREE, Ordering::AcqRel);
        }
    }

    /// Free a state a tree holds (its eviction). A state a reader pins at this instant
    /// is *doomed* instead: no new pin is accepted, and the last reader's unpin frees
    /// it. Either way the tree is done with it.
    ///
    /// # Errors
    ///
    /// [`FreeError`] (nothing changed) when `slot` is not a state a tree holds.
    pub(crate) fn free_tree_held(&self, slot: u32) -> Result<(), FreeError> {
        let not_held = |kind| Err(FreeError { index: slot, kind, rest_freed: false });
        let Some(word) = self.states.get(slot as usize).filter(|_| slot != 0) else {
            return not_held(FreeErrorKind::OutOfRange { first: 1, last: self.slots.capacity() });
        };
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            if !live(cur) || cur & TREE == 0 {
                return not_held(FreeErrorKind::NotAllocated);
            }
            if cur == TREE | CACHED {
                // No reader: free it now. A pin taken meanwhile makes that fail: look
                // again (and doom it).
                if self.free_from(&[slot], TREE | CACHED).is_ok() {
                    return Ok(());
                }
                cur = word.load(Ordering::Relaxed);
                continue;
            }
            // Pinned: doom it. Release: the tree's earlier accesses happen before the
            // last reader's unpin frees the slot.
            match word.compare_exchange_weak(cur, cur | DOOMED, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Pin cached slot `slot` for reading.
    fn pin(&self, slot: u32) -> Result<(), MambaError> {
        let word = self.states.get(slot as usize).filter(|_| slot != 0).ok_or(MambaError::NotCached { slot })?;
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            if !live(cur) || !pins(cur).is_some_and(|n| n < MAX_PINS) {
                return Err(MambaError::NotCached { slot });
            }
            // Acquire: the writes of the holder that cached it (Release) are visible.
            match word.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    fn unpin(&self, slot: u32) {
        // Release: our reads happen before a later free (Acquire) hands the slot on.
        // Acquire: for the last reader of a doomed state, every other reader's unpin
        // (Release) happens before it frees the slot below.
        let prev = self.states[slot as usize].fetch_sub(1, Ordering::AcqRel);
        if prev == DOOMED | TREE | (CACHED + 1) {
            // The last pin of a state the tree freed: nobody can pin it again (doomed)
            // and the tree no longer names it, so the slot is ours to free.
            self.states[slot as usize].store(FREE, Ordering::Relaxed);
            let r = self.slots.free(&[slot]);
            debug_assert!(r.is_ok(), "a doomed state failed to free: {r:?}");
        }
    }

    fn pin_all(&self, slots: &[u32]) -> Result<(), MambaError> {
        for (i, &s) in slots.iter().enumerate() {
            if let Err(e) = self.pin(s) {
                slots[..i].iter().for_each(|&p| self.unpin(p));
                return Err(e);
            }
        }
        Ok(())
    }

    /// Copy-on-write: a new held slot with a copy of cached state `src` (SGLang's
    /// `fork_from`). `src` is pinned during the copy.
    ///
    /// # Errors
    ///
    /// [`MambaError::NotCached`] when `src` is not a cached state;
    /// [`MambaError::OutOfMemory`] when no slot is free. Nothing changed on error.
    pub fn fork_from(&self, src: u32) -> Result<MambaSlot, MambaError> {
        self.pin(src)?;
        let mut one = [0u32];
        if let Err(e) = self.alloc_raw(&mut one, false) {
            self.unpin(src);
            return Err(MambaError::OutOfMemory(e));
        }
        self.copy_raw(src, one[0]);
        self.unpin(src);
        Ok(self.handle(one[0]))
    }

    /// Copy cached states `src[i]` into held slots `dst[i]` (a batch of pairs; SGLang's
    /// `copy_from`). Every `src` is pinned during the copy.
    ///
    /// # Errors
    ///
    /// [`MambaError::LengthMismatch`], [`MambaError::ForeignSlot`],
    /// [`MambaError::NotCached`], [`MambaError::NoWorkingState`] (a row whose working
    /// state was taken); nothing is copied on error.
    pub fn copy_from(&self, src: &[u32], dst: &mut [&mut impl HeldState]) -> Result<(), MambaError> {
        if src.len() != dst.len() {
            return Err(MambaError::LengthMismatch { src: src.len(), dst: dst.len() });
        }
        for d in dst.iter() {
            self.own(d.held()?)?;
        }
        self.pin_all(src)?;
        for (&s, d) in src.iter().zip(dst.iter()) {
            // Checked above; `dst` is borrowed mutably, so it still holds that handle.
            if let Ok(d) = d.held() {
                self.copy_raw(s, d.slot);
            }
        }
        src.iter().for_each(|&s| self.unpin(s));
        Ok(())
    }

    /// Copy held slot `src` into held slot `dst` (a decode-time checkpoint into a
    /// track buffer). Either may be a [`HybridRow`](super::HybridRow)'s working state.
    ///
    /// # Errors
    ///
    /// [`MambaError::ForeignSlot`] for another pool's handle,
    /// [`MambaError::NoWorkingState`] for a row whose working state was taken.
    pub fn copy_slot(&self, src: &impl HeldState, dst: &mut impl HeldState) -> Result<(), MambaError> {
        let (src, dst) = (src.held()?, dst.held()?);
        self.own(src)?;
        self.own(dst)?;
        self.copy_raw(src.slot, dst.slot);
        Ok(())
    }

    /// Zero a held slot's state (a handle's, or a [`HybridRow`](super::HybridRow)'s
    /// working state).
    ///
    /// # Errors
    ///
    /// [`MambaError::ForeignSlot`] for another pool's handle,
    /// [`MambaError::NoWorkingState`] for a row whose working state was taken.
    pub fn zero_slot(&self, slot: &mut impl HeldState) -> Result<(), MambaError> {
        let slot = slot.held()?;
        self.own(slot)?;
        self.zero(slot.slot);
        Ok(())
    }

    /// Run `f` on layer `layer`'s component `comp` of cached state `slot`, pinned
    /// meanwhile (the tree's read path).
    ///
    /// # Errors
    ///
    /// [`MambaError::NotCached`], [`MambaError::BadLayer`], [`MambaError::BadComponent`].
    pub fn read_cached<R>(
        &self,
        slot: u32,
        layer: u32,
        comp: Component,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, MambaError> {
        let (at, len) = self.locate(slot, layer, comp)?;
        self.pin(slot)?;
        // SAFETY: the slot is pinned and cached: nobody writes it (only a handle holder
        // writes, and a cached slot has none) and it cannot be freed until we unpin.
        let bytes = unsafe { core::slice::from_raw_parts(self.base(comp).add(at), len) };
        let r = f(bytes);
        self.unpin(slot);
        Ok(r)
    }

    /// Layer `layer`'s component `comp` of a held slot, as elements of `T`.
    ///
    /// # Errors
    ///
    /// [`MambaError::ForeignSlot`], [`MambaError::BadLayer`],
    /// [`MambaError::BadComponent`], [`MambaError::Cast`] when `T` does not match the
    /// component's element size, [`MambaError::NoWorkingState`] for a
    /// [`HybridRow`](super::HybridRow) whose working state was taken.
    pub fn component<'a, T: bytemuck::Pod>(
        &'a self,
        slot: &'a impl HeldState,
        layer: u32,
        comp: Component,
    ) -> Result<&'a [T], MambaError> {
        let slot = slot.held()?;
        self.own(slot)?;
        let (at, len) = self.locate(slot.slot, layer, comp)?;
        // SAFETY: a shared borrow of the unique handle (or of the row holding it):
        // nobody writes this slot while the returned slice (which borrows it) lives.
        let bytes = unsafe { core::slice::from_raw_parts(self.base(comp).add(at), len) };
        bytemuck::try_cast_slice(bytes).map_err(MambaError::Cast)
    }

    /// Layer `layer`'s component `comp` of a held slot, writable.
    ///
    /// # Errors
    ///
    /// As [`component`](Self::component).
    pub fn component_mut<'a, T: bytemuck::Pod>(
        &'a self,
        slot: &'a mut impl HeldState,
        layer: u32,
        comp: Component,
    ) -> Result<&'a mut [T], MambaError> {
        let slot = slot.held()?;
        self.own(slot)?;
        let (at, len) = self.locate(slot.slot, layer, comp)?;
        // SAFETY: the returned slice borrows the unique holder of the handle (the
        // handle, or the row owning it) mutably: nothing else reads or writes this
        // slot's state while it lives ("Ownership").
        let bytes = unsafe { core::slice::from_raw_parts_mut(self.base(comp).add(at), len) };
        bytemuck::try_cast_slice_mut(bytes).map_err(MambaError::Cast)
    }

    /// The whole buffer of component `comp` (`[layers, size + 1, row]` bytes) as a raw
    /// pointer and length, for handing to compute kernels by slot number. Reading or
    /// writing through it follows the ownership rules above.
    pub fn buffer_ptr(&self, comp: Component) -> Result<(*mut u8, usize), MambaError> {
        let c = self.comp_index(comp)?;
        Ok((self.base(comp), self.row_bytes[c] * (self.size() + 1) * self.config.layers as usize))
    }

    fn base(&self, comp: Component) -> *mut u8 {
        let c = self.comp_index(comp).expect("checked by the caller");
        UnsafeCell::raw_get(self.buffers[c].as_ptr() as *const UnsafeCell<[u8; 16]>) as *mut u8
    }

    fn comp_index(&self, comp: Component) -> Result<usize, MambaError> {
        let n_conv = self.config.conv.len();
        match comp {
            Component::Conv(i) if i < n_conv => Ok(i),
            Component::Temporal => Ok(n_conv),
            Component::Conv(i) => Err(MambaError::BadComponent { conv: i, conv_states: n_conv }),
        }
    }

    /// Byte offset and length of `(slot, layer, comp)` in its buffer.
    fn locate(&self, slot: u32, layer: u32, comp: Component) -> Result<(usize, usize), MambaError> {
        let c = self.comp_index(comp)?;
        if layer >= self.config.layers {
            return Err(MambaError::BadLayer { layer, layers: self.config.layers });
        }
        let r = self.row_bytes[c];
        Ok(((layer as usize * (self.size() + 1) + slot as usize) * r, r))
    }

    /// Copy every row of `src` to `dst`. Caller: `src` is pinned or held by the caller,
    /// `dst` is held by the caller, `src != dst`.
    fn copy_raw(&self, src: u32, dst: u32) {
        debug_assert_ne!(src, dst);
        for (c, comp) in self.config.components().enumerate() {
            let r = self.row_bytes[c];
            let base = self.base(comp);
            for layer in 0..self.config.layers as usize {
                let row0 = layer * (self.size() + 1);
                // SAFETY: both rows lie inside the buffer (slots <= size, layer <
                // layers); `dst` is ours alone and `src` is not written meanwhile (held
                // by the caller, or cached and pinned), and they are distinct slots,
                // so the ranges do not overlap.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        base.add((row0 + src as usize) * r),
                        base.add((row0 + dst as usize) * r),
                        r,
                    );
                }
            }
        }
    }

    /// Zero every row of `slot`. Caller: `slot` is ours alone.
    fn zero(&self, slot: u32) {
        for (c, comp) in self.config.components().enumerate() {
            let r = self.row_bytes[c];
            let base = self.base(comp);
            for layer in 0..self.config.layers as usize {
                // SAFETY: the row lies inside the buffer and the slot is ours alone.
                unsafe { core::ptr::write_bytes(base.add((layer * (self.size() + 1) + slot as usize) * r), 0, r) };
            }
        }
    }

    pub(crate) fn own(&self, slot: &MambaSlot) -> Result<(), MambaError> {
        if slot.pool == self.generation {
            Ok(())
        } else {
            Err(MambaError::ForeignSlot { slot: slot.slot })
        }
    }

    /// Free every slot. Outstanding handles become foreign (their use is an error).
    pub fn clear(&mut self) {
        self.slots.clear();
        for s in self.states.iter() {
            s.store(FREE, Ordering::Relaxed);
        }
        self.generation = super::next_generation();
    }

    /// Check the slot arena and the state words agree (O(size)); exact at quiescence.
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] on a kvpool bug.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.slots.check_invariants()?;
        for (s, w) in self.states.iter().enumerate() {
            let v = w.load(Ordering::Acquire);
            let allocated = self.slots.is_allocated(s as u32);
            if s == 0 && v != FREE {
                return Err(InvariantViolation(format!("dummy slot 0 has state {v:#x}")));
            }
            if s > 0 && allocated != (v != FREE) {
                return Err(InvariantViolation(format!("slot {s}: allocated {allocated} but state {v:#x}")));
            }
            if v == RETIRING || pins(v).is_some_and(|n| n > 0) || (pins(v).is_some() && v & DOOMED != 0) {
                return Err(InvariantViolation(format!("slot {s}: state {v:#x} (pinned or retiring) at quiescence")));
            }
        }
        Ok(())
    }
}

impl core::fmt::Debug for MambaPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MambaPool")
            .field("size", &self.size())
            .field("available", &self.available())
            .field("slot_bytes", &self.slot_bytes())
            .finish()
    }
}
