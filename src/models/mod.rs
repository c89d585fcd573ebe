//! Operation sequences and sequential reference models for kvpool's allocators
//! (feature `models`; the older name `testing` still works, as does `kvpool::testing`).
//!
//! This is a supported API for users: kvpool's own proptest suites and cargo-fuzz
//! targets use it, and so can yours. A scheduler that wraps a kvpool allocator (to meter
//! it, tag pages, add quotas, log) can implement [`KvAllocator`] on the wrapper and run
//! kvpool's [`Arbitrary`] op sequences through it with [`run_allocator_observed`]: every
//! step is compared with the sequential model, and your own closure checks the wrapper's
//! state against the model after every step. `examples/fuzz-scheduler/` in the
//! repository is such a cargo-fuzz target, ready to copy. The models cost memory and
//! time (they are plain sequential code with `Vec`s and a `BTreeMap` of counters): use
//! them in tests and fuzz targets, not on a serving path.
//!
//! The proptest model tests and the cargo-fuzz targets use the same pieces:
//!
//! * [`Op`] — one step of a random operation sequence (`#[derive(Arbitrary)]`), written
//!   in *symbolic* terms ("free live handle `k`", "a forged slot past the end") so that
//!   any sequence means something on any pool size and page size;
//! * [`AllocModel`] — a plain sequential model: a bitmap of free pages (or slots),
//!   lowest first (a `SlotPool`'s magazine in front of it; a page-size-1 decode
//!   continues each request's run, as the allocator does), all-or-nothing, with the
//!   slot and page numbering of `DESIGN.md` and
//!   the validation order and error values the real allocators document;
//! * [`run`], [`run_allocator`], [`run_slot_pool`] — drive a real structure and the
//!   model side by side and compare, after every step, the result (outputs, error kind
//!   and counts), `available_size`, the set of allocated pages, the open free group's
//!   pending count, and `check_invariants()`;
//! * [`Scenario`] — a whole fuzz input: page size, pool size and an op sequence;
//! * [`radix`], [`mamba`], [`swa`], [`hi`] — the same for the prefix-cache trees (plain,
//!   Mamba, sliding-window, host tier), every request driven through the engine contract
//!   ([`Request`](crate::radix::Request)), against the sequential reference trees of
//!   [`baseline`](crate::baseline) ([`ReferenceRadixCache`](crate::baseline::ReferenceRadixCache)
//!   and the others).
//! * [`owned`] — a `SlotPool`'s owned batches ([`Slots`](crate::Slots)) beside its
//!   bare API, against a model of who owns each index.
//! * [`cache`] — private magazines ([`SlotCache`](crate::SlotCache)) in front of a
//!   `SlotPool`, beside its owned batches and bare API, against the same kind of model.
//! * [`decode`] — the graph decode paths' host halves against each other: the delta
//!   planner and full records staged with `stage_decode_after`, on twin pools.
//!
//! The model never calls kvpool's planning or expansion code: it recounts pages with
//! its own arithmetic and expands them with a forward transcription of DESIGN.md's
//! three-part formula, so a bug in the in-place expansion shows up as a mismatch.
//!
//! # How an [`Op`] becomes a call
//!
//! Raw numbers are scaled to the pool so that sequences stay interesting:
//!
//! * `Alloc { pages, misalign }` asks for `pages % (num_pages + 2)` pages' worth of
//!   tokens (so exact capacity and one over capacity both occur), plus
//!   `misalign % page_size` tokens (a non-multiple of the page size);
//! * `AllocExtend` request: `prefix_len = prefix % (3*ps + 1)`, `seq_len = prefix_len +
//!   extend % (4*ps + 1)`; `AllocDecode` request: `seq_len = 1 + seq % (3*ps)`; at most
//!   [`MAX_BATCH`] requests;
//! * a [`LastLoc::Live`] `last_loc` is the correct one for the prefix: in the first page
//!   of a live allocation, at the prefix's position within its page;
//! * live handles are the slots of successful allocations (for `alloc_extend` /
//!   `alloc_decode`, only the slots in the fresh pages); freed handles are remembered
//!   (the last [`STALE_MEMORY`]) for stale frees.
//!
//! On a [`SlotPool`], extend batches become one `alloc` of their new tokens and decode
//! batches one `alloc_one`.
//!
//! # Examples
//!
//! ```
//! use kvpool::models::{run, ops_from_bytes};
//!
//! // Any bytes make a valid op sequence; every page size must agree with the model.
//! let ops = ops_from_bytes(b"any bytes at all become an op sequence: 0123456789abcdef");
//! for page_size in [1, 2, 3, 4, 16, 64] {
//!     run(&ops, page_size)?;
//! }
//! # Ok::<(), String>(())
//! ```

pub mod cache;
pub mod decode;
pub mod hi;
pub mod mamba;
pub mod owned;
pub mod parking;
pub mod radix;
pub mod swa;
pub mod swa_alloc;

/// The `arbitrary` crate kvpool's ops implement [`Arbitrary`] with, re-exported so a
/// fuzz target uses the same version (`kvpool::models::arbitrary::Unstructured`).
pub use arbitrary;

use std::collections::{BTreeMap, VecDeque};

use arbitrary::{Arbitrary, Unstructured};

use crate::alloc::{KvAllocator, KvFreeGroup, PagedAllocator, TokenAllocator};
use crate::error::{AllocError, FreeError, FreeErrorKind, InvalidInput, InvariantViolation, OutOfMemory, Unit};
use crate::slots::{FreeGroup, SlotPool};

/// The most requests an extend or decode batch of an [`Op`] has (longer lists are cut).
pub const MAX_BATCH: usize = 8;
/// The most slots one [`FreeOp::Forged`] names (longer lists are cut).
pub const MAX_FORGED: usize = 8;
/// How many ops the `allocator_ops` fuzz target reads from one input (see
/// [`Scenario::from_fuzz_input`]): short sequences, many executions.
pub const MAX_FUZZ_OPS: usize = 16;
/// The most slots a pool of [`Scenario::from_fuzz_input`] has (page sizes up to 4: up to
/// 128 or 130 pages, three bitmap words; page size 16: 32 pages; page size 64: 8).
pub const MAX_FUZZ_SLOTS: u32 = 512;
/// How many freed handles are remembered for [`FreeOp::Stale`].
pub const STALE_MEMORY: usize = 16;
/// Pages of the pool that [`run`] builds: more than 64, so the bitmap spans two words.
pub const DEFAULT_PAGES: u32 = 70;
/// The page sizes a [`Scenario`] picks from (1 twice: the token allocator matters most).
pub const SCENARIO_PAGE_SIZES: [u32; 8] = [1, 2, 3, 4, 5, 16, 64, 1];
/// Output buffers are filled with this before a call, so that a failed call that wrote
/// anything is caught.
pub const SENTINEL: u32 = 0xA5A5_A5A5;

/// How much of the allocation state a run compares with the model after each step.
///
/// Every step compares the step's result (outputs, error kind and counts),
/// `available`, the open group's pending count and `check_invariants()`; the two levels
/// differ in which pages' allocation bits are compared:
///
/// * [`EveryPage`](Checks::EveryPage): every page after every step, O(capacity) per
///   step (the proptest model tests);
/// * [`Touched`](Checks::Touched): after a step, the pages it took or named in a free
///   (O(touched) per step); every page at the end of each segment (before a `clear`,
///   and at the end). This does the same job for less: a page no step named may not
///   change, and if a bug changes one anyway, either the available count differs at
///   once, or a page the step did name is wrong at once, or (two untouched pages
///   swapped) the next full check reports it. The fuzz targets use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checks {
    /// Every page after every step.
    #[default]
    EveryPage,
    /// The step's own pages after every step; every page at the end of each segment.
    Touched,
}

/// A slot number chosen symbolically, resolved against the pool it is used on.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawSlot {
    /// Slot 0, the reserved padding slot.
    Zero,
    /// A slot of the reserved page 0: `v % page_size`.
    ReservedPage(u8),
    /// The highest valid slot, `(num_pages + 1) * page_size - 1`.
    Last,
    /// One past the highest valid slot.
    PastEnd,
    /// `u32::MAX`.
    Max,
    /// Any small number: in range or not, allocated or not.
    Small(u16),
}

impl RawSlot {
    /// The concrete slot on a pool of `num_pages` pages of `page_size`.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::models::RawSlot;
    /// assert_eq!(RawSlot::Last.resolve(4, 10), 43);
    /// assert_eq!(RawSlot::PastEnd.resolve(4, 10), 44);
    /// assert_eq!(RawSlot::ReservedPage(6).resolve(4, 10), 2);
    /// ```
    pub fn resolve(self, page_size: u32, num_pages: u32) -> u32 {
        let end = (num_pages as u64 + 1) * page_size as u64; // first slot past the pool
        match self {
            RawSlot::Zero => 0,
            RawSlot::ReservedPage(v) => v as u32 % page_size,
            RawSlot::Last => end.saturating_sub(1).min(u32::MAX as u64) as u32,
            RawSlot::PastEnd => end.min(u32::MAX as u64) as u32,
            RawSlot::Max => u32::MAX,
            RawSlot::Small(v) => v as u32,
        }
    }
}

/// Where a request's `last_loc` comes from. Mostly [`Live`](LastLoc::Live) (a correct
/// one), sometimes wrong on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LastLoc {
    /// The correct `last_loc` for the prefix, in the first page of live handle `k`
    /// (counting only handles whose first page is still allocated, mod their number;
    /// failing that, in any allocated page; slot 0 when no page is allocated).
    Live(u8),
    /// Live handle `k`'s page, but one position past the correct one.
    WrongPosition(u8),
    /// A forged slot.
    Forged(RawSlot),
}

impl<'a> Arbitrary<'a> for LastLoc {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // 30 in 32 correct (a batch has several requests); exhausted input (which
        // reads 0) is correct too.
        Ok(match u.int_in_range(0u8..=31)? {
            30 => LastLoc::WrongPosition(u.arbitrary()?),
            31 => LastLoc::Forged(u.arbitrary()?),
            _ => LastLoc::Live(u.arbitrary()?),
        })
    }
}

/// A deliberate defect in the shape of a batch (rare: 6 in 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeFault {
    /// A well-formed batch.
    None,
    /// `prefix_lens` one shorter than `seq_lens` (extend only).
    ShortPrefixLens,
    /// `last_locs` one shorter than the batch.
    ShortLastLocs,
    /// The output buffer one slot too long.
    OutTooLong,
    /// The output buffer one slot too short.
    OutTooShort,
    /// Request `k` is malformed: extend: `prefix_len = seq_len + 1`; decode: `seq_len = 0`.
    BadRequest(u8),
}

impl<'a> Arbitrary<'a> for ShapeFault {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match u.int_in_range(0u8..=31)? {
            27 => ShapeFault::ShortPrefixLens,
            28 => ShapeFault::ShortLastLocs,
            29 => ShapeFault::OutTooLong,
            30 => ShapeFault::OutTooShort,
            31 => ShapeFault::BadRequest(u.arbitrary()?),
            _ => ShapeFault::None,
        })
    }
}

/// Extra tokens added to an [`Op::Alloc`] (mod the page size): 0 in 7 of 8 cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Misalign(pub u8);

impl<'a> Arbitrary<'a> for Misalign {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(if u.int_in_range(0u8..=7)? == 7 { Misalign(u.arbitrary()?) } else { Misalign(0) })
    }
}

/// One request of an [`Op::AllocExtend`] (scaled as the [module docs](self) say).
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtendReq {
    /// Raw prefix length.
    pub prefix: u8,
    /// Raw number of new tokens.
    pub extend: u8,
    /// Where `last_loc` comes from.
    pub last_loc: LastLoc,
}

/// One request of an [`Op::AllocDecode`].
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeReq {
    /// Raw sequence length (the new token included).
    pub seq: u8,
    /// Where `last_loc` comes from.
    pub last_loc: LastLoc,
}

/// The requests of a batch: 0 to [`MAX_BATCH`] of them, each length equally likely (a
/// plain `Vec` would be empty half the time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T>(pub Vec<T>);

impl<'a, T: Arbitrary<'a>> Arbitrary<'a> for Batch<T> {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let len = u.int_in_range(0..=MAX_BATCH)?;
        (0..len).map(|_| T::arbitrary(u)).collect::<arbitrary::Result<Vec<T>>>().map(Batch)
    }
}

/// A free other than a plain free of a live handle.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum FreeOp {
    /// Free the first `1 + take % len` slots of a live handle; the rest stays live,
    /// except slots whose page was freed with them.
    Part {
        /// Which live handle.
        handle: u8,
        /// How many slots.
        take: u8,
    },
    /// Free a live handle with its first slot listed twice.
    WithDuplicate {
        /// Which live handle.
        handle: u8,
    },
    /// Free a live handle with a forged slot inserted; the handle stays live if the
    /// batch is refused.
    WithForged {
        /// Which live handle.
        handle: u8,
        /// The forged slot.
        forged: RawSlot,
        /// Where in the batch it goes.
        at: u8,
    },
    /// Free an already-freed handle again (a stale free).
    Stale {
        /// Which remembered handle.
        which: u8,
    },
    /// Free forged slots.
    Forged {
        /// The slots (at most [`MAX_FORGED`] are used).
        slots: Vec<RawSlot>,
    },
}

/// Free-group and lifecycle steps, weighted so that `clear` is rare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Open a free group (no-op when one is open).
    GroupBegin,
    /// End the open free group (no-op when none is).
    GroupEnd,
    /// End any open group, then `clear()` the pool.
    Clear,
}

impl<'a> Arbitrary<'a> for Control {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match u.int_in_range(0u8..=9)? {
            0..=4 => Control::GroupBegin,
            5..=8 => Control::GroupEnd,
            _ => Control::Clear,
        })
    }
}

/// One step of an allocator operation sequence.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `alloc` of whole pages (plus a possible misaligned remainder).
    Alloc {
        /// Raw page count.
        pages: u8,
        /// Extra tokens, making the count a non-multiple of the page size.
        misalign: Misalign,
    },
    /// `alloc_extend` of a batch.
    AllocExtend {
        /// The requests (at most [`MAX_BATCH`] are used).
        reqs: Batch<ExtendReq>,
        /// A deliberate shape defect.
        fault: ShapeFault,
    },
    /// `alloc_decode` of a batch.
    AllocDecode {
        /// The requests (at most [`MAX_BATCH`] are used).
        reqs: Batch<DecodeReq>,
        /// A deliberate shape defect.
        fault: ShapeFault,
    },
    /// Free live handle `handle` (freeing an empty list when there is none).
    FreeLive {
        /// Which live handle.
        handle: u8,
    },
    /// The other kinds of free (partial, duplicated, forged, stale), together as
    /// likely as a plain free of a live handle.
    Free(FreeOp),
    /// Free-group and lifecycle steps.
    Control(Control),
}

/// Parse as many [`Op`]s from `bytes` as they hold (any bytes work).
///
/// # Examples
///
/// ```
/// let ops = kvpool::models::ops_from_bytes(&[3, 1, 4, 1, 5, 9, 2, 6]);
/// assert!(!ops.is_empty());
/// assert!(kvpool::models::ops_from_bytes(&[]).is_empty());
/// ```
pub fn ops_from_bytes(bytes: &[u8]) -> Vec<Op> {
    decode_ops(bytes, usize::MAX)
}

/// Decode up to `max` values of `T` from fuzzer bytes, until the bytes run out or stop
/// decoding: the op decoder of every model here.
pub(crate) fn decode_ops<'a, T: Arbitrary<'a>>(bytes: &'a [u8], max: usize) -> Vec<T> {
    let mut u = Unstructured::new(bytes);
    let mut ops = Vec::new();
    while ops.len() < max && !u.is_empty() {
        match T::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    ops
}

/// A whole fuzz input: which allocator, its size, and the op sequence.
#[derive(Arbitrary, Debug, Clone)]
pub struct Scenario {
    /// Index into [`SCENARIO_PAGE_SIZES`] (mod 8).
    pub page_size: u8,
    /// Pages: `pages % 131` (0 included: an empty pool).
    pub pages: u8,
    /// Unused tokens past the last page: `extra % page_size`. Its top bit picks a
    /// `PagedAllocator` with page size 1 instead of a `TokenAllocator`.
    pub extra: u8,
    /// The operations.
    pub ops: Vec<Op>,
}

impl Scenario {
    /// The page size this scenario uses.
    pub fn page_size(&self) -> u32 {
        SCENARIO_PAGE_SIZES[self.page_size as usize % SCENARIO_PAGE_SIZES.len()]
    }

    /// Pages of the pool this scenario describes (`pages % 131`).
    pub fn num_pages(&self) -> u32 {
        self.pages as u32 % 131
    }

    /// Token size of the allocator this scenario describes: [`num_pages`](Self::num_pages)
    /// whole pages plus `extra % page_size` unused tokens (what
    /// `PagedAllocator::new(size, page_size)` is given).
    pub fn pool_size(&self) -> usize {
        let ps = self.page_size() as usize;
        self.num_pages() as usize * ps + self.extra as usize % ps
    }

    /// Run the ops on the allocator this scenario describes, then on a [`SlotPool`]
    /// with one index per page; both against the model.
    ///
    /// # Errors
    ///
    /// The first disagreement with the model, as a message naming the step.
    ///
    /// # Examples
    ///
    /// ```
    /// use arbitrary::{Arbitrary, Unstructured};
    /// let bytes = [2u8, 40, 0, 7, 7, 7, 1, 0, 0, 0, 3, 3, 3];
    /// let scenario = kvpool::models::Scenario::arbitrary(&mut Unstructured::new(&bytes)).unwrap();
    /// scenario.run()?;
    /// # Ok::<(), String>(())
    /// ```
    pub fn run(&self) -> Result<(), String> {
        self.run_with(Checks::EveryPage)
    }

    /// [`run`](Self::run) with a choice of [`Checks`] (the fuzz target uses
    /// [`Checks::Touched`]).
    ///
    /// # Errors
    ///
    /// The first disagreement with the model, as a message naming the step.
    pub fn run_with(&self, checks: Checks) -> Result<(), String> {
        self.run_allocator(checks)?;
        self.run_slot_pool(checks)
    }

    /// What the `allocator_ops` fuzz target runs: only one of the two structures of
    /// [`run`](Self::run) per input, the `SlotPool` when bit 6 of `extra` is set (that
    /// bit is otherwise unused), with [`Checks::Touched`].
    ///
    /// # Errors
    ///
    /// The first disagreement with the model, as a message naming the step.
    pub fn run_fuzz(&self) -> Result<(), String> {
        if self.extra & 0x40 != 0 {
            self.run_slot_pool(Checks::Touched)
        } else {
            self.run_allocator(Checks::Touched)
        }
    }

    fn run_slot_pool(&self, checks: Checks) -> Result<(), String> {
        let pages = self.pages as u32 % 131;
        run_slot_pool_with(&self.ops, pages, checks).map(drop).map_err(|e| format!("SlotPool capacity {pages}: {e}"))
    }

    fn run_allocator(&self, checks: Checks) -> Result<(), String> {
        let ps = self.page_size();
        let size = self.pool_size();
        let r = if ps == 1 && self.extra & 0x80 == 0 {
            run_allocator_with(TokenAllocator::new(size).map_err(|e| e.to_string())?, &self.ops, checks)
        } else {
            run_allocator_with(PagedAllocator::new(size, ps).map_err(|e| e.to_string())?, &self.ops, checks)
        };
        r.map(drop).map_err(|e| format!("page size {ps}, size {size}: {e}"))
    }

    /// The `allocator_ops` fuzz target's reading of its input: the three header bytes
    /// as [`Arbitrary`] reads them (the page count reduced so that the pool has at most
    /// [`MAX_FUZZ_SLOTS`] slots), then at most `max_ops` ops as [`ops_from_bytes`]
    /// reads them (bytes past the last op are ignored). Any bytes work.
    ///
    /// Replay a fuzz crash file in a test with
    /// `Scenario::from_fuzz_input(&bytes, MAX_FUZZ_OPS).run()` (both structures, every
    /// page after every step).
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::models::{Checks, Scenario};
    /// let s = Scenario::from_fuzz_input(&[2, 40, 0, 7, 7, 7, 1, 0, 0, 0, 3, 3, 3], 4);
    /// assert!(s.ops.len() <= 4);
    /// s.run_with(Checks::Touched)?;
    /// # Ok::<(), String>(())
    /// ```
    pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> Scenario {
        let mut u = Unstructured::new(bytes);
        let mut byte = || u8::arbitrary(&mut u).unwrap_or(0);
        let (page_size, pages, extra) = (byte(), byte(), byte());
        // At most MAX_FUZZ_SLOTS slots, so that one op costs little (page count
        // `pages % 131` still spans three bitmap words for page sizes up to 4).
        let ps = SCENARIO_PAGE_SIZES[page_size as usize % SCENARIO_PAGE_SIZES.len()];
        let max_pages = (MAX_FUZZ_SLOTS / ps).min(130);
        let pages = (pages as u32 % 131 % (max_pages + 1)) as u8;
        let mut ops = Vec::new();
        while ops.len() < max_ops && !u.is_empty() {
            match Op::arbitrary(&mut u) {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        Scenario { page_size, pages, extra, ops }
    }
}

/// What a free is expected to fail with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedFreeError {
    /// The error kind.
    pub kind: FreeErrorKind,
    /// Whether the rest of the batch was freed.
    pub rest_freed: bool,
    /// The error must name one of these slots (one, except for a duplicate inside a
    /// batch, where any duplicated slot may be named).
    pub index_any_of: Vec<u32>,
}

impl ExpectedFreeError {
    /// Whether `e` is this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::models::ExpectedFreeError;
    /// use kvpool::{FreeError, FreeErrorKind};
    /// let want = ExpectedFreeError { kind: FreeErrorKind::NotAllocated, rest_freed: true, index_any_of: vec![3, 5] };
    /// assert!(want.matches(&FreeError { index: 5, kind: FreeErrorKind::NotAllocated, rest_freed: true }));
    /// assert!(!want.matches(&FreeError { index: 4, kind: FreeErrorKind::NotAllocated, rest_freed: true }));
    /// ```
    pub fn matches(&self, e: &FreeError) -> bool {
        e.kind == self.kind && e.rest_freed == self.rest_freed && self.index_any_of.contains(&e.index)
    }
}

/// A successful allocation in the model: the slots written, and the fresh pages taken.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allocated {
    /// The output, as the real call must write it.
    pub slots: Vec<u32>,
    /// The pages taken from the free set, in the order the allocator claims them:
    /// ascending but for the placement's passes over sparse words, and a page-size-1
    /// decode's in request order.
    pub pages: Vec<u32>,
}

/// The sequential reference model of a [`SlotPool`], [`TokenAllocator`] or
/// [`PagedAllocator`]: the set of free pages (a slot pool's indices and a token
/// allocator's slots are pages of one), lowest first (but for a page-size-1 decode,
/// see [`alloc_decode`](Self::alloc_decode)).
///
/// # Examples
///
/// DESIGN.md's worked example, on the model:
///
/// ```
/// use kvpool::models::AllocModel;
/// let mut m = AllocModel::paged(256, 4);
/// assert_eq!(m.alloc(8).unwrap().slots, [4, 5, 6, 7, 8, 9, 10, 11]);
/// let got = m.alloc_extend(&[1, 3], &[6, 7], &[4, 10], 9).unwrap();
/// assert_eq!(got.slots, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
/// assert_eq!(got.pages, [3, 4]);
/// assert_eq!(m.available(), 256 - 16);
/// ```
#[derive(Debug, Clone)]
pub struct AllocModel {
    page_size: u32,
    num_pages: u32,
    unit: Unit,
    /// Bit `p` is set when page `p` (1-based) is free: a plain bitmap rather than a
    /// `BTreeSet`, so that the fuzz targets' per-step lookups cost O(1).
    free: Vec<u64>,
    /// Number of set bits in `free`.
    free_count: usize,
    /// Scratch for [`free`](Self::free): the pages of the batch being validated (all
    /// clear between calls).
    seen: Vec<u64>,
    /// Pages freed inside the open group: in `free`, but not yet available.
    pending: usize,
    group_open: bool,
    /// Whether the last [`free`](Self::free) was refused for an index named twice.
    refused_repeat: bool,
    /// A `SlotPool`'s magazine (single-threaded: one), entries bottom first; they are
    /// in `free` too. `mag_cap` is 0 without magazines.
    mag: Vec<u32>,
    mag_cap: usize,
    /// Where a page-size-1 decode's new runs are looked for next (a word of the
    /// pool's bitmap, going down; `usize::MAX`: the top word). See
    /// [`alloc_decode`](Self::alloc_decode).
    follow_cursor: usize,
}

impl AllocModel {
    /// The model of a `PagedAllocator::new(size, page_size)` (or a `TokenAllocator`
    /// when `page_size` is 1). `page_size` must be at least 1.
    pub fn paged(size: usize, page_size: u32) -> Self {
        let num_pages = (size / page_size as usize) as u32;
        Self::new(page_size, num_pages, Unit::Tokens, 0)
    }

    /// The model of a `SlotPool::new(capacity)`, used from one thread: its magazine
    /// of `min(MAGAZINE, capacity)` entries in front of the lowest-first bitmap.
    ///
    /// * `alloc(n)`, `n` at most the magazine's size: the top `n` entries, in the
    ///   order they were pushed, if the magazine holds `n`. Otherwise the lowest free
    ///   indices outside the magazine; when those are fewer than `n`, the magazine is
    ///   emptied into them first (even if the allocation then fails).
    /// * `free` of a valid batch of at most the magazine's size, outside a group:
    ///   onto the magazine, each index once, in batch order; when it does not fit on
    ///   top, the magazine is emptied into the bitmap first. Larger batches and group
    ///   frees go to the bitmap.
    pub fn slot_pool(capacity: u32) -> Self {
        Self::slot_pool_with_magazines(capacity, crate::slots::MAGAZINE)
    }

    /// The model of a `SlotPool::with_magazines(capacity, entries)` (see
    /// [`slot_pool`](Self::slot_pool)).
    pub fn slot_pool_with_magazines(capacity: u32, entries: usize) -> Self {
        Self::new(1, capacity, Unit::Indices, entries.min(capacity as usize))
    }

    /// The model of a `SlotPool::without_magazines(capacity)`: lowest free first.
    pub fn slot_pool_without_magazines(capacity: u32) -> Self {
        Self::new(1, capacity, Unit::Indices, 0)
    }

    fn new(page_size: u32, num_pages: u32, unit: Unit, mag_cap: usize) -> Self {
        let words = (num_pages as usize + 1).div_ceil(64);
        let mut m = AllocModel {
            page_size,
            num_pages,
            unit,
            free: vec![0; words],
            free_count: 0,
            seen: vec![0; words],
            pending: 0,
            group_open: false,
            refused_repeat: false,
            mag: Vec::new(),
            mag_cap,
            follow_cursor: usize::MAX,
        };
        m.fill();
        m
    }

    /// Every page `1..=num_pages` free.
    fn fill(&mut self) {
        for (w, word) in self.free.iter_mut().enumerate() {
            // pages w*64 .. w*64+64, clipped to 1..=num_pages
            let lo = (w * 64) as u64;
            let hi = (lo + 64).min(self.num_pages as u64 + 1);
            let n = hi.saturating_sub(lo);
            *word = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            if w == 0 {
                *word &= !1; // page 0 is reserved
            }
        }
        self.free_count = self.num_pages as usize;
    }

    fn is_free(&self, page: u32) -> bool {
        self.free[page as usize / 64] & (1 << (page % 64)) != 0
    }

    /// Tokens (or indices) per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Number of pages.
    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// What `available_size()` (or `available()`) must say: free pages not held back
    /// by an open group, in tokens.
    pub fn available(&self) -> usize {
        (self.free_count - self.pending) * self.page_size as usize
    }

    /// Tokens freed into the open group, not yet available.
    pub fn pending(&self) -> usize {
        self.pending * self.page_size as usize
    }

    /// Whether `page` (1-based) is allocated.
    pub fn is_page_allocated(&self, page: u32) -> bool {
        page >= 1 && page <= self.num_pages && !self.is_free(page)
    }

    /// Whether `slot`'s page is allocated (`false` out of range).
    pub fn is_allocated(&self, slot: u32) -> bool {
        self.is_page_allocated(slot / self.page_size)
    }

    /// The highest valid slot (`page_size - 1` when there are no pages).
    pub fn last_slot(&self) -> u32 {
        ((self.num_pages as u64 + 1) * self.page_size as u64 - 1) as u32
    }

    fn oom(&self, pages: usize) -> AllocError {
        let ps = self.page_size as usize;
        AllocError::OutOfMemory(OutOfMemory {
            requested: pages * ps,
            available: self.available(),
            evictable: None,
            unit: self.unit,
        })
    }

    fn take_pages(&mut self, n: usize) -> Result<Vec<u32>, AllocError> {
        if n > 0 && n <= self.mag_cap && self.mag.len() >= n {
            // The magazine's top `n`, in the order they were pushed.
            let pages = self.mag.split_off(self.mag.len() - n);
            for &p in &pages {
                self.free[p as usize / 64] &= !(1u64 << (p % 64));
            }
            self.free_count -= n;
            return Ok(pages);
        }
        if n > self.free_count - self.mag.len() - self.pending {
            self.mag.clear(); // flushed into the bitmap
        }
        if n > self.free_count - self.pending {
            return Err(self.oom(n));
        }
        // The free pages outside the magazine, as the pool's placement takes them
        // (lowest first, but for large claims over sparse words).
        let mut outside = self.free.clone();
        for &m in &self.mag {
            outside[m as usize / 64] &= !(1u64 << (m % 64));
        }
        let free = (1..=self.num_pages).filter(|&p| outside[p as usize / 64] >> (p % 64) & 1 == 1);
        let pages = crate::slots::placement(free, n);
        for &page in &pages {
            self.free[page as usize / 64] &= !(1u64 << (page % 64));
        }
        self.free_count -= n;
        Ok(pages)
    }

    /// A page-size-1 decode's slots, one per request (see
    /// [`alloc_decode`](Self::alloc_decode)), in request order.
    fn take_following(&mut self, last_locs: &[u32]) -> Result<Vec<u32>, AllocError> {
        let n = last_locs.len();
        if n > self.free_count - self.pending {
            return Err(self.oom(n));
        }
        let mut out = vec![0u32; n];
        let take = |m: &mut Self, page: u32| {
            m.free[page as usize / 64] &= !(1u64 << (page % 64));
            m.free_count -= 1;
        };
        for (o, &last) in out.iter_mut().zip(last_locs) {
            let want = last.wrapping_add(1);
            if want >= 1 && want <= self.num_pages && self.is_free(want) {
                take(self, want);
                *o = want;
            }
        }
        let mut missing: Vec<usize> = (0..n).filter(|&i| out[i] == 0).collect();
        missing.reverse(); // popped in request order
        let nwords = (self.num_pages as usize).div_ceil(64);
        if nwords > 0 {
            let start = self.follow_cursor.min(nwords - 1);
            let order = (0..=start).rev().chain((start + 1..nwords).rev());
            for w in order {
                if missing.is_empty() {
                    break;
                }
                // The free slots w*64+1 ..= w*64+64 as the pool's word: bit b is slot w*64+b+1.
                let pages = (1..=64u32).map(|b| w as u32 * 64 + b).filter(|&p| p <= self.num_pages);
                let mut run: Option<(u32, u32)> = None; // (first, len) of the longest
                let mut cur: Option<(u32, u32)> = None;
                for p in pages {
                    if self.is_free(p) {
                        let c = cur.map_or((p, 1), |(f, l)| (f, l + 1));
                        cur = Some(c);
                        if run.map_or(true, |(_, l)| c.1 > l) {
                            run = Some(c);
                        }
                    } else {
                        cur = None;
                    }
                }
                if let Some((first, _)) = run {
                    take(self, first);
                    out[missing.pop().expect("checked non-empty")] = first;
                    self.follow_cursor = if w == 0 { nwords - 1 } else { w - 1 };
                }
            }
        }
        if !missing.is_empty() {
            let free = (1..=self.num_pages).filter(|&p| self.is_free(p)).collect::<Vec<_>>();
            let rest = crate::slots::placement(free, missing.len());
            for page in rest {
                take(self, page);
                out[missing.pop().expect("as many as missing")] = page;
            }
        }
        Ok(out)
    }

    /// `alloc` of `n` tokens: the lowest free pages, ascending, expanded into slots.
    ///
    /// # Errors
    ///
    /// `NotPageAligned` if `n` is not a multiple of the page size, else out of memory.
    pub fn alloc(&mut self, n: usize) -> Result<Allocated, AllocError> {
        let ps = self.page_size as usize;
        if n % ps != 0 {
            return Err(InvalidInput::NotPageAligned { count: n, page_size: self.page_size }.into());
        }
        let pages = self.take_pages(n / ps)?;
        let page_size = self.page_size;
        let slots = pages.iter().flat_map(|&p| (0..page_size).map(move |k| p * page_size + k)).collect();
        Ok(Allocated { slots, pages })
    }

    /// `alloc_extend` with an output buffer of `out_len` slots.
    ///
    /// # Errors
    ///
    /// In this order: `prefix_lens` length, the first request with a prefix longer than
    /// its sequence, `last_locs` length, output length, the first bad `last_loc` (a
    /// prefix ending inside a page, growing, whose `last_loc` is not an allocated slot
    /// at the prefix's position in its page; never checked with page size 1), the first
    /// request that continues the same partial page as an earlier one
    /// (`SamePartialPage`; never with page size 1), then out of memory.
    pub fn alloc_extend(
        &mut self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
    ) -> Result<Allocated, AllocError> {
        if prefix_lens.len() != seq_lens.len() {
            return Err(InvalidInput::LengthMismatch {
                what: "prefix_lens",
                got: prefix_lens.len(),
                expected: seq_lens.len(),
            }
            .into());
        }
        for (request, (&prefix_len, &seq_len)) in prefix_lens.iter().zip(seq_lens).enumerate() {
            if prefix_len > seq_len {
                return Err(InvalidInput::PrefixLongerThanSeq { request, prefix_len, seq_len }.into());
            }
        }
        self.grow(prefix_lens, seq_lens, last_locs, out_len, false)
    }

    /// `alloc_decode` with an output buffer of `out_len` slots.
    ///
    /// At page size 1 (a KV allocator's model) the slots are placed as the allocator
    /// documents: first, in request order, each request whose `last_loc + 1` is a free
    /// slot gets it; then the others, in request order, one slot from each bitmap word
    /// (slots `64w + 1 ..= 64w + 64`) that has free slots, going down from the word
    /// below the last one this placement took from (the top word at first) and wrapping
    /// around once, each the lowest slot of its word's longest stretch of free slots
    /// (the lowest such stretch on a tie); any still without a slot then get the
    /// lowest-first placement of a plain allocation.
    ///
    /// # Errors
    ///
    /// The first request with `seq_len == 0`, then as [`alloc_extend`](Self::alloc_extend)
    /// with `prefix_len = seq_len - 1`.
    pub fn alloc_decode(
        &mut self,
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
    ) -> Result<Allocated, AllocError> {
        if let Some(request) = seq_lens.iter().position(|&s| s == 0) {
            return Err(InvalidInput::EmptyDecode { request }.into());
        }
        let prefix_lens: Vec<u32> = seq_lens.iter().map(|&s| s - 1).collect();
        self.grow(&prefix_lens, seq_lens, last_locs, out_len, true)
    }

    fn grow(
        &mut self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out_len: usize,
        decode: bool,
    ) -> Result<Allocated, AllocError> {
        let batch = seq_lens.len();
        if last_locs.len() != batch {
            return Err(
                InvalidInput::LengthMismatch { what: "last_locs", got: last_locs.len(), expected: batch }.into()
            );
        }
        let new_tokens: usize = prefix_lens.iter().zip(seq_lens).map(|(&p, &s)| (s - p) as usize).sum();
        if out_len != new_tokens {
            return Err(InvalidInput::OutputLength { got: out_len, expected: new_tokens }.into());
        }
        let ps = self.page_size;
        if ps > 1 {
            for request in 0..batch {
                let (prefix, seq, last_loc) = (prefix_lens[request], seq_lens[request], last_locs[request]);
                let reads_last_loc = prefix % ps != 0 && seq > prefix;
                if reads_last_loc && !(last_loc % ps == (prefix - 1) % ps && self.is_allocated(last_loc)) {
                    return Err(InvalidInput::BadLastLoc { request, last_loc }.into());
                }
            }
            // Then: no two requests continue the same partial page (both would be handed
            // its next slots); the first request that repeats an earlier one's page.
            let continued = |i: usize| {
                let reads_last_loc = prefix_lens[i] % ps != 0 && seq_lens[i] > prefix_lens[i];
                reads_last_loc.then(|| last_locs[i] / ps)
            };
            for (request, &last_loc) in last_locs.iter().enumerate() {
                let Some(page) = continued(request) else { continue };
                if let Some(earlier) = (0..request).find(|&i| continued(i) == Some(page)) {
                    return Err(InvalidInput::SamePartialPage { earlier, request, last_loc }.into());
                }
            }
        }
        let pages_of = |len: u32| (len as u64).div_ceil(ps as u64);
        let need: u64 = prefix_lens.iter().zip(seq_lens).map(|(&p, &s)| pages_of(s) - pages_of(p)).sum();
        let pages = if decode && ps == 1 && self.unit != Unit::Indices {
            self.take_following(last_locs)?
        } else {
            self.take_pages(need as usize)?
        };
        let slots = expand_forward(ps, prefix_lens, seq_lens, last_locs, &pages);
        Ok(Allocated { slots, pages })
    }

    /// Free `slots`: validate all (in order: range, then allocated), then free the
    /// distinct pages. A KV allocator's model merges repeats at every page size (at
    /// page size 1 a slot named twice is freed once, with no error), so a batch is
    /// freed all or nothing. A `SlotPool`'s model is strict about an index named twice
    /// in the batch: once every index is in range and allocated, a repeat refuses the
    /// batch whole, naming a repeated index.
    ///
    /// # Errors
    ///
    /// What the real free must report.
    pub fn free(&mut self, slots: &[u32]) -> Result<(), ExpectedFreeError> {
        self.refused_repeat = false;
        let ps = self.page_size;
        // The batch's distinct pages are marked in `seen` (cleared again before
        // returning); `pages` lists them.
        let mut pages = Vec::new();
        let mut repeated = Vec::new();
        let mut refused = None;
        for &slot in slots {
            let page = slot / ps;
            if page == 0 || page > self.num_pages {
                let kind = FreeErrorKind::OutOfRange { first: ps, last: self.last_slot() };
                refused = Some(ExpectedFreeError { kind, rest_freed: false, index_any_of: vec![slot] });
                break;
            }
            if self.is_free(page) {
                let kind = FreeErrorKind::NotAllocated;
                refused = Some(ExpectedFreeError { kind, rest_freed: false, index_any_of: vec![slot] });
                break;
            }
            let (w, bit) = (page as usize / 64, 1u64 << (page % 64));
            if self.seen[w] & bit != 0 {
                repeated.push(slot);
            } else {
                self.seen[w] |= bit;
                pages.push(page);
            }
        }
        for &page in &pages {
            self.seen[page as usize / 64] &= !(1u64 << (page % 64));
        }
        if let Some(e) = refused {
            return Err(e);
        }
        self.refused_repeat = self.unit == Unit::Indices && !repeated.is_empty();
        if self.refused_repeat {
            repeated.sort_unstable();
            repeated.dedup();
            let kind = FreeErrorKind::NotAllocated;
            return Err(ExpectedFreeError { kind, rest_freed: false, index_any_of: repeated });
        }
        if self.group_open {
            self.pending += pages.len();
        } else if !slots.is_empty() && slots.len() <= self.mag_cap {
            if self.mag.len() + slots.len() > self.mag_cap {
                self.mag.clear(); // flushed into the bitmap
            }
            for &slot in slots {
                if !self.mag.contains(&slot) && !self.is_free(slot) {
                    self.mag.push(slot);
                }
            }
        }
        for &page in &pages {
            self.free[page as usize / 64] |= 1 << (page % 64);
        }
        self.free_count += pages.len();
        Ok(())
    }

    /// Open a free group.
    pub fn begin_group(&mut self) {
        self.group_open = true;
    }

    /// End the open group; returns the tokens it makes available.
    pub fn end_group(&mut self) -> usize {
        let n = self.pending();
        self.pending = 0;
        self.group_open = false;
        n
    }

    /// Everything free again (any open group must have ended).
    pub fn clear(&mut self) {
        self.fill();
        self.pending = 0;
        self.group_open = false;
        self.mag.clear();
        self.follow_cursor = usize::MAX;
    }
}

/// DESIGN.md's three-part expansion, forwards and out of place (independent of the
/// crate's in-place walk).
fn expand_forward(ps: u32, prefix_lens: &[u32], seq_lens: &[u32], last_locs: &[u32], pages: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next_page = 0usize;
    let p = ps as u64;
    for i in 0..seq_lens.len() {
        let (prefix, seq) = (prefix_lens[i] as u64, seq_lens[i] as u64);
        let aligned_prefix = prefix.div_ceil(p) * p;
        let full_end = seq / p * p;
        let new = (seq.div_ceil(p) - prefix.div_ceil(p)) as usize;
        let mine = &pages[next_page..next_page + new];
        for k in 0..seq.min(aligned_prefix) - prefix {
            out.push(last_locs[i].wrapping_add(1 + k as u32));
        }
        for k in 0..full_end.saturating_sub(aligned_prefix) {
            out.push(mine[(k / p) as usize] * ps + (k % p) as u32);
        }
        if new > 0 && seq % p != 0 {
            for k in 0..seq - full_end {
                out.push(mine[new - 1] * ps + k as u32);
            }
        }
        next_page += new;
    }
    out
}

// ---------------------------------------------------------------------------------
// The structures under test, behind one interface.

trait Subject {
    type Group<'a>
    where
        Self: 'a;
    /// Whether `alloc_extend` / `alloc_decode` exist (not on a bare `SlotPool`).
    const BATCHES: bool;
    fn available(&self) -> usize;
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError>;
    fn alloc_one(&self) -> Result<u32, AllocError>;
    fn alloc_extend(&self, prefix: &[u32], seq: &[u32], last: &[u32], out: &mut [u32]) -> Result<(), AllocError>;
    fn alloc_decode(&self, seq: &[u32], last: &[u32], out: &mut [u32]) -> Result<(), AllocError>;
    fn free(&self, slots: &[u32]) -> Result<(), FreeError>;
    fn begin(&self) -> Self::Group<'_>;
    fn group_free(group: &mut Self::Group<'_>, slots: &[u32]) -> Result<(), FreeError>;
    fn group_pending(group: &Self::Group<'_>) -> usize;
    fn end(group: Self::Group<'_>) -> usize;
    fn is_allocated(&self, slot: u32) -> bool;
    fn clear(&mut self);
    fn check_invariants(&self) -> Result<(), InvariantViolation>;
}

struct Kv<A>(A);

impl<A: KvAllocator> Subject for Kv<A> {
    type Group<'a>
        = KvFreeGroup<'a>
    where
        A: 'a;
    const BATCHES: bool = true;
    fn available(&self) -> usize {
        self.0.available_size()
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        self.0.alloc(out)
    }
    fn alloc_one(&self) -> Result<u32, AllocError> {
        let mut one = vec![0u32; self.0.page_size() as usize];
        self.0.alloc(&mut one)?;
        Ok(one[0])
    }
    fn alloc_extend(&self, prefix: &[u32], seq: &[u32], last: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        let ([p], [s], [l]) = (prefix, seq, last) else {
            return self.0.alloc_extend(prefix, seq, last, out);
        };
        // One request: through the call that also reports where the runs break, which
        // must be exactly where the slots it wrote stop being consecutive.
        let mut reported = Vec::new();
        if self.0.alloc_extend_runs(*p, *s, *l, out, &mut |at| reported.push(at))? {
            let breaks: Vec<usize> = (1..out.len()).filter(|&i| out[i] != out[i - 1].wrapping_add(1)).collect();
            assert_eq!(reported, breaks, "alloc_extend_runs({p}, {s}, {l}) reported other breaks than {out:?} has");
        }
        Ok(())
    }
    fn alloc_decode(&self, seq: &[u32], last: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        self.0.alloc_decode(seq, last, out)
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.0.free(slots)
    }
    fn begin(&self) -> KvFreeGroup<'_> {
        self.0.free_group()
    }
    fn group_free(group: &mut KvFreeGroup<'_>, slots: &[u32]) -> Result<(), FreeError> {
        group.free(slots)
    }
    fn group_pending(group: &KvFreeGroup<'_>) -> usize {
        group.pending_tokens()
    }
    fn end(group: KvFreeGroup<'_>) -> usize {
        group.end()
    }
    fn is_allocated(&self, slot: u32) -> bool {
        self.0.is_allocated(slot)
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.0.check_invariants()
    }
}

struct Slots(SlotPool);

impl Subject for Slots {
    type Group<'a> = FreeGroup<'a>;
    const BATCHES: bool = false;
    fn available(&self) -> usize {
        self.0.available()
    }
    fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
        Ok(self.0.alloc(out)?)
    }
    fn alloc_one(&self) -> Result<u32, AllocError> {
        Ok(self.0.alloc_one()?)
    }
    fn alloc_extend(&self, _: &[u32], _: &[u32], _: &[u32], _: &mut [u32]) -> Result<(), AllocError> {
        unreachable!("a SlotPool has no alloc_extend (BATCHES is false)")
    }
    fn alloc_decode(&self, _: &[u32], _: &[u32], _: &mut [u32]) -> Result<(), AllocError> {
        unreachable!("a SlotPool has no alloc_decode (BATCHES is false)")
    }
    fn free(&self, slots: &[u32]) -> Result<(), FreeError> {
        self.0.free(slots)
    }
    fn begin(&self) -> FreeGroup<'_> {
        self.0.free_group()
    }
    fn group_free(group: &mut FreeGroup<'_>, slots: &[u32]) -> Result<(), FreeError> {
        group.free(slots)
    }
    fn group_pending(group: &FreeGroup<'_>) -> usize {
        group.pending()
    }
    fn end(group: FreeGroup<'_>) -> usize {
        group.end()
    }
    fn is_allocated(&self, slot: u32) -> bool {
        self.0.is_allocated(slot)
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.0.check_invariants()
    }
}

/// How often each outcome occurred in a run: `"alloc_extend: ok"`, `"free: not
/// allocated"`, ... Lets a test check that its op sequences reach every branch rather
/// than, say, failing validation every time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    counts: BTreeMap<String, usize>,
}

impl Stats {
    /// How many times `outcome` occurred.
    pub fn get(&self, outcome: &str) -> usize {
        self.counts.get(outcome).copied().unwrap_or(0)
    }

    /// Every outcome with its count.
    pub fn iter(&self) -> impl Iterator<Item = (&str, usize)> {
        self.counts.iter().map(|(k, &v)| (k.as_str(), v))
    }

    /// Add another run's counts.
    pub fn merge(&mut self, other: &Stats) {
        for (k, v) in other.iter() {
            *self.counts.entry(k.to_owned()).or_default() += v;
        }
    }

    fn record(&mut self, op: &str, outcome: &str) {
        // "op: outcome", built on the stack: no allocation once the key exists.
        let mut buf = [0u8; 96];
        let mut n = 0;
        for part in [op, ": ", outcome] {
            let end = (n + part.len()).min(buf.len());
            buf[n..end].copy_from_slice(&part.as_bytes()[..end - n]);
            n = end;
        }
        match core::str::from_utf8(&buf[..n]) {
            Ok(key) => match self.counts.get_mut(key) {
                Some(count) => *count += 1,
                None => {
                    self.counts.insert(key.to_owned(), 1);
                }
            },
            // Only if a cut fell inside a character.
            Err(_) => *self.counts.entry(format!("{op}: {outcome}")).or_default() += 1,
        }
    }
}

fn alloc_outcome(r: &Result<Allocated, AllocError>) -> &'static str {
    match r {
        Ok(a) if a.slots.is_empty() => "ok, empty",
        Ok(_) => "ok",
        Err(AllocError::OutOfMemory(_)) => "out of memory",
        Err(AllocError::Invalid(InvalidInput::BadLastLoc { .. })) => "bad last_loc",
        Err(AllocError::Invalid(InvalidInput::SamePartialPage { .. })) => "same partial page",
        Err(AllocError::Invalid(InvalidInput::NotPageAligned { .. })) => "not page aligned",
        Err(AllocError::Invalid(_)) => "malformed batch",
        Err(AllocError::Row(_)) => "bad request row",
    }
}

/// The outcome of a free of `slots` for the stats: [`free_outcome`], but a batch that
/// names one slot twice and is freed is "ok, slot repeated" (repeats merge).
pub(crate) fn free_batch_outcome(slots: &[u32], r: &Result<(), ExpectedFreeError>, model: &AllocModel) -> &'static str {
    if r.is_ok() && slots.iter().enumerate().any(|(i, s)| slots[..i].contains(s)) {
        return "ok, slot repeated";
    }
    if model.refused_repeat {
        return "duplicate in batch";
    }
    free_outcome(r)
}

fn free_outcome(r: &Result<(), ExpectedFreeError>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(e) if matches!(e.kind, FreeErrorKind::OutOfRange { .. }) => "out of range",
        Err(_) => "not allocated",
    }
}

/// Drive `ops` on a [`TokenAllocator`] (page size 1) or a [`PagedAllocator`] of
/// [`DEFAULT_PAGES`] pages plus half a page of unused remainder, against the model.
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
///
/// # Panics
///
/// If `page_size` is 0.
///
/// # Examples
///
/// ```
/// use kvpool::models::{run, Misalign, Op};
/// let ops = [Op::Alloc { pages: 3, misalign: Misalign(0) }, Op::FreeLive { handle: 0 }];
/// run(&ops, 16)?;
/// # Ok::<(), String>(())
/// ```
pub fn run(ops: &[Op], page_size: u32) -> Result<(), String> {
    assert!(page_size >= 1, "page size 0");
    let size = DEFAULT_PAGES as usize * page_size as usize + page_size as usize / 2;
    let r = if page_size == 1 {
        run_allocator(TokenAllocator::new(size).map_err(|e| e.to_string())?, ops)
    } else {
        run_allocator(PagedAllocator::new(size, page_size).map_err(|e| e.to_string())?, ops)
    };
    r.map(drop)
}

/// Drive `ops` on `alloc` (fresh: nothing allocated) against the model.
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
///
/// # Examples
///
/// ```
/// use kvpool::models::{run_allocator, Misalign, Op};
/// let ops = [Op::Alloc { pages: 7, misalign: Misalign(0) }, Op::Alloc { pages: 1, misalign: Misalign(0) }];
/// let stats = run_allocator(kvpool::PagedAllocator::new(20, 3).unwrap(), &ops)?;
/// assert_eq!(stats.get("alloc: out of memory"), 1); // 7 pages of 6
/// assert_eq!(stats.get("alloc: ok"), 1);
/// # Ok::<(), String>(())
/// ```
pub fn run_allocator<A: KvAllocator>(alloc: A, ops: &[Op]) -> Result<Stats, String> {
    run_allocator_with(alloc, ops, Checks::EveryPage)
}

/// [`run_allocator`] with a choice of [`Checks`].
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
///
/// # Examples
///
/// ```
/// use kvpool::models::{run_allocator_with, Checks, Misalign, Op};
/// let ops = [Op::Alloc { pages: 2, misalign: Misalign(0) }, Op::FreeLive { handle: 0 }];
/// let stats = run_allocator_with(kvpool::PagedAllocator::new(20, 3).unwrap(), &ops, Checks::Touched)?;
/// assert_eq!(stats.get("free: ok"), 1);
/// # Ok::<(), String>(())
/// ```
pub fn run_allocator_with<A: KvAllocator>(alloc: A, ops: &[Op], checks: Checks) -> Result<Stats, String> {
    let model = AllocModel::paged(alloc.size(), alloc.page_size());
    if alloc.available_size() != model.available() {
        return Err(format!(
            "a fresh allocator has {} available, expected {}",
            alloc.available_size(),
            model.available()
        ));
    }
    drive(Kv(alloc), model, ops, checks, &mut |_, _| Ok(()))
}

/// [`run_allocator_with`] for *your* allocator: after every step (and every free-group
/// end and `clear`), once kvpool's own comparison with the model passed, `observe` gets
/// the allocator and the model and may compare anything of its own with the model; an
/// `Err` stops the run with the step named.
///
/// This is how a wrapper around a kvpool allocator is fuzzed: implement
/// [`KvAllocator`] on the wrapper (delegating to the allocator inside, adding whatever
/// the wrapper does), and check the wrapper's own state in `observe`. The model's
/// allocated pages are [`AllocModel::is_page_allocated`]; `available`, `pending` and the
/// page geometry are there too. `examples/fuzz-scheduler/` is a complete cargo-fuzz
/// target built this way.
///
/// # Errors
///
/// The first disagreement with the model, or the first `Err` of `observe`, as a message
/// naming the step and the op.
///
/// # Examples
///
/// A wrapper that counts the calls that handed out slots, checked against the model's
/// count of allocated pages (every successful allocation of fresh pages takes at least one):
///
/// ```
/// use kvpool::models::{run_allocator_observed, Checks, Misalign, Op};
/// use kvpool::{AllocError, FreeError, InvariantViolation, KvAllocator, KvFreeGroup, PagedAllocator};
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// struct Counting(PagedAllocator, AtomicUsize);
///
/// impl KvAllocator for Counting {
///     fn page_size(&self) -> u32 { self.0.page_size() }
///     fn size(&self) -> usize { KvAllocator::size(&self.0) }
///     fn available_size(&self) -> usize { self.0.available_size() }
///     fn alloc(&self, out: &mut [u32]) -> Result<(), AllocError> {
///         self.0.alloc(out)?;
///         if !out.is_empty() { self.1.fetch_add(1, Ordering::Relaxed); }
///         Ok(())
///     }
///     fn alloc_extend(&self, p: &[u32], s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
///         self.0.alloc_extend(p, s, l, out)
///     }
///     fn alloc_decode(&self, s: &[u32], l: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
///         self.0.alloc_decode(s, l, out)
///     }
///     fn free(&self, slots: &[u32]) -> Result<(), FreeError> { self.0.free(slots) }
///     fn free_group(&self) -> KvFreeGroup<'_> { self.0.free_group() }
///     fn is_allocated(&self, slot: u32) -> bool { self.0.is_allocated(slot) }
///     fn clear(&mut self) { self.0.clear() }
///     fn check_invariants(&self) -> Result<(), InvariantViolation> { self.0.check_invariants() }
/// }
///
/// let ops = [Op::Alloc { pages: 2, misalign: Misalign(0) }, Op::Alloc { pages: 1, misalign: Misalign(0) }];
/// let wrapper = Counting(PagedAllocator::new(64, 4).unwrap(), AtomicUsize::new(0));
/// run_allocator_observed(wrapper, &ops, Checks::EveryPage, |w, model| {
///     let pages = (1..=model.num_pages()).filter(|&p| model.is_page_allocated(p)).count();
///     let calls = w.1.load(Ordering::Relaxed);
///     if calls > pages { Err(format!("{calls} allocations but {pages} pages allocated")) } else { Ok(()) }
/// })?;
/// # Ok::<(), String>(())
/// ```
pub fn run_allocator_observed<A, F>(alloc: A, ops: &[Op], checks: Checks, mut observe: F) -> Result<Stats, String>
where
    A: KvAllocator,
    F: FnMut(&A, &AllocModel) -> Result<(), String>,
{
    let model = AllocModel::paged(alloc.size(), alloc.page_size());
    if alloc.available_size() != model.available() {
        return Err(format!(
            "a fresh allocator has {} available, expected {}",
            alloc.available_size(),
            model.available()
        ));
    }
    drive(Kv(alloc), model, ops, checks, &mut |kv: &Kv<A>, m: &AllocModel| observe(&kv.0, m))
}

/// Drive `ops` on a fresh `SlotPool::new(capacity)` against the model.
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
///
/// # Examples
///
/// ```
/// use kvpool::models::{run_slot_pool, Control, FreeOp, Op, RawSlot};
/// let ops = [Op::Control(Control::GroupBegin), Op::Free(FreeOp::Forged { slots: vec![RawSlot::PastEnd] })];
/// let stats = run_slot_pool(&ops, 66)?;
/// assert_eq!(stats.get("group free: out of range"), 1);
/// # Ok::<(), String>(())
/// ```
pub fn run_slot_pool(ops: &[Op], capacity: u32) -> Result<Stats, String> {
    run_slot_pool_with(ops, capacity, Checks::EveryPage)
}

/// [`run_slot_pool`] with a choice of [`Checks`].
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
pub fn run_slot_pool_with(ops: &[Op], capacity: u32, checks: Checks) -> Result<Stats, String> {
    drive(Slots(SlotPool::new(capacity)), AllocModel::slot_pool(capacity), ops, checks, &mut |_, _| Ok(()))
}

/// Drive `ops` on a fresh `SlotPool::with_magazines(capacity, entries)` against the
/// model.
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
pub fn run_slot_pool_with_magazines(ops: &[Op], capacity: u32, entries: usize) -> Result<Stats, String> {
    let model = AllocModel::slot_pool_with_magazines(capacity, entries);
    drive(Slots(SlotPool::with_magazines(capacity, entries)), model, ops, Checks::EveryPage, &mut |_, _| Ok(()))
}

/// Drive `ops` on a fresh `SlotPool::without_magazines(capacity)` against the model
/// (lowest free first).
///
/// # Errors
///
/// The first disagreement, as a message naming the step and the op.
pub fn run_slot_pool_without_magazines(ops: &[Op], capacity: u32) -> Result<Stats, String> {
    drive(
        Slots(SlotPool::without_magazines(capacity)),
        AllocModel::slot_pool_without_magazines(capacity),
        ops,
        Checks::EveryPage,
        &mut |_, _| Ok(()),
    )
}

/// A [`FreeOp`] applied to a subject and its model through `free` (which frees on both,
/// compares and returns whether the free succeeded); `allocated` asks the model whether
/// it holds a slot. Shared by the allocator drivers.
fn free_op<M>(
    op: &FreeOp,
    ps: u32,
    num_pages: u32,
    runner: &mut Runner,
    model: &mut M,
    allocated: impl Fn(&M, u32) -> bool,
    free: &mut impl FnMut(&[u32], &mut M, &mut Runner) -> Result<bool, String>,
) -> Result<(), String> {
    match op {
        FreeOp::Part { handle, take } => {
            if let Some(k) = runner.pick(*handle) {
                let h = &mut runner.live[k];
                let t = 1 + *take as usize % h.len();
                let part: Vec<u32> = h.drain(..t).collect();
                free(&part, model, runner)?;
                // An owner that freed a slot has given up its whole page.
                let h = &mut runner.live[k];
                h.retain(|&slot| allocated(model, slot));
                if h.is_empty() {
                    runner.live.swap_remove(k);
                }
                runner.retire(part);
            }
        }
        FreeOp::WithDuplicate { handle } => {
            if let Some(k) = runner.pick(*handle) {
                let mut h = runner.live.swap_remove(k);
                h.push(h[0]);
                free(&h, model, runner)?;
                h.pop();
                runner.retire(h);
            }
        }
        FreeOp::WithForged { handle, forged, at } => {
            if let Some(k) = runner.pick(*handle) {
                let mut batch = runner.live[k].clone();
                let at = *at as usize % (batch.len() + 1);
                batch.insert(at, forged.resolve(ps, num_pages));
                if !free(&batch, model, runner)? {
                    let h = runner.live.swap_remove(k);
                    runner.retire(h);
                }
            }
        }
        FreeOp::Stale { which } => {
            if !runner.stale.is_empty() {
                let h = runner.stale[*which as usize % runner.stale.len()].clone();
                free(&h, model, runner)?;
            }
        }
        FreeOp::Forged { slots } => {
            let slots: Vec<u32> = slots.iter().take(MAX_FORGED).map(|r| r.resolve(ps, num_pages)).collect();
            free(&slots, model, runner)?;
        }
    }
    Ok(())
}

/// The runner's memory: live and freed handles, and outcome counts.
#[derive(Default)]
struct Runner {
    live: Vec<Vec<u32>>,
    stale: VecDeque<Vec<u32>>,
    stats: Stats,
    /// Pages the current step took or named in a free (in range), for
    /// [`Checks::Touched`].
    touched: Vec<u32>,
}

impl Runner {
    fn retire(&mut self, h: Vec<u32>) {
        if h.is_empty() {
            return;
        }
        if self.stale.len() == STALE_MEMORY {
            self.stale.pop_front();
        }
        self.stale.push_back(h);
    }

    fn pick(&self, k: u8) -> Option<usize> {
        (!self.live.is_empty()).then(|| k as usize % self.live.len())
    }

    /// Compare one allocation's result; `out` was filled with [`SENTINEL`] before.
    /// On success the slots in fresh pages become a live handle (part-1 slots lie in
    /// a page some older handle holds).
    fn compare_alloc(
        &mut self,
        op: &str,
        got: Result<(), AllocError>,
        want: Result<Allocated, AllocError>,
        out: &[u32],
        page_size: u32,
    ) -> Result<(), String> {
        self.stats.record(op, alloc_outcome(&want));
        match (got, want) {
            (Ok(()), Ok(a)) => {
                if out != a.slots {
                    return Err(format!("output {out:?}, expected {:?}", a.slots));
                }
                self.touched.extend_from_slice(&a.pages);
                let handle = if a.slots.len() == a.pages.len() * page_size as usize {
                    a.slots // every slot lies in a fresh page
                } else {
                    let mut fresh_pages = a.pages.clone();
                    fresh_pages.sort_unstable();
                    let fresh = |slot: &u32| fresh_pages.binary_search(&(slot / page_size)).is_ok();
                    a.slots.iter().copied().filter(fresh).collect()
                };
                if handle.len() < out.len() {
                    self.stats.record(op, "ok, filled a partial page");
                }
                if !handle.is_empty() {
                    self.live.push(handle);
                }
                Ok(())
            }
            (Err(g), Err(w)) if g == w => {
                if let Some(k) = out.iter().position(|&s| s != SENTINEL) {
                    return Err(format!("failed with {g:?} but wrote the output at {k}: {out:?}"));
                }
                Ok(())
            }
            (g, w) => Err(format!("got {g:?}, expected {:?}", w.map(|a| a.slots))),
        }
    }
}

/// What [`drive`] calls after every step: the subject and the model, both settled.
type Observer<'o, S> = &'o mut dyn FnMut(&S, &AllocModel) -> Result<(), String>;

fn drive<S: Subject>(
    mut subject: S,
    mut model: AllocModel,
    ops: &[Op],
    checks: Checks,
    observe: Observer<'_, S>,
) -> Result<Stats, String> {
    let mut runner = Runner::default();
    let mut i = 0;
    loop {
        {
            // A group borrows the subject; `clear` needs it exclusively. So the ops run
            // in segments separated by clears, each with its own (optional) group.
            let s = &subject;
            let mut group: Option<S::Group<'_>> = None;
            while i < ops.len() && ops[i] != Op::Control(Control::Clear) {
                step(s, &mut group, &mut model, &mut runner, &ops[i])
                    .and_then(|()| {
                        let pages = match checks {
                            Checks::EveryPage => None,
                            Checks::Touched => Some(&runner.touched[..]),
                        };
                        check_state(s, &group, &model, pages)?;
                        observe(s, &model)
                    })
                    .map_err(|e| format!("step {i} ({:?}): {e}", ops[i]))?;
                runner.touched.clear();
                i += 1;
            }
            if let Some(g) = group.take() {
                end_group::<S>(g, &mut model, &mut runner.stats)
                    .map_err(|e| format!("ending the group before step {i}: {e}"))?;
            }
            // Every page at the end of each segment: with `Checks::Touched` this is where
            // a change to a page no step named shows up (before `clear` erases it).
            check_state(s, &None, &model, None)
                .and_then(|()| observe(s, &model))
                .map_err(|e| format!("end of the segment before step {i}: {e}"))?;
        }
        if i == ops.len() {
            break;
        }
        subject.clear();
        model.clear();
        for h in core::mem::take(&mut runner.live) {
            runner.retire(h);
        }
        runner.stats.record("clear", "ok");
        check_state(&subject, &None, &model, None)
            .and_then(|()| observe(&subject, &model))
            .map_err(|e| format!("step {i} (clear): {e}"))?;
        i += 1;
    }
    Ok(runner.stats)
}

fn end_group<S: Subject>(group: S::Group<'_>, model: &mut AllocModel, stats: &mut Stats) -> Result<(), String> {
    let got = S::end(group);
    let want = model.end_group();
    stats.record("group end", if want > 0 { "published" } else { "empty" });
    if got != want {
        return Err(format!("group end published {got}, expected {want}"));
    }
    Ok(())
}

fn step<'s, S: Subject>(
    s: &'s S,
    group: &mut Option<S::Group<'s>>,
    model: &mut AllocModel,
    runner: &mut Runner,
    op: &Op,
) -> Result<(), String> {
    let ps = model.page_size();
    let num_pages = model.num_pages();
    // Free through the open group if there is one; `Ok(true)` when the batch was
    // refused (nothing freed).
    let mut free = |slots: &[u32], model: &mut AllocModel, runner: &mut Runner| -> Result<bool, String> {
        let got = match group.as_mut() {
            Some(g) => S::group_free(g, slots),
            None => s.free(slots),
        };
        let want = model.free(slots);
        // Every page the batch names may have changed (a refused batch must change none).
        // (A handle's slots come a page at a time: skip repeats of the previous page.)
        let mut prev = u32::MAX;
        for &slot in slots {
            let page = slot / ps;
            if page != prev && page >= 1 && page <= num_pages {
                runner.touched.push(page);
            }
            prev = page;
        }
        let stats = &mut runner.stats;
        stats.record(if group.is_some() { "group free" } else { "free" }, free_batch_outcome(slots, &want, model));
        let refused = matches!(want, Err(ExpectedFreeError { rest_freed: false, .. }));
        match (&got, &want) {
            (Ok(()), Ok(())) => Ok(refused),
            (Err(g), Err(w)) if w.matches(g) => Ok(refused),
            _ => Err(format!("free of {slots:?}: got {got:?}, expected {want:?}")),
        }
    };
    match op {
        Op::Alloc { pages, misalign } => {
            let n = (*pages as usize % (num_pages as usize + 2)) * ps as usize + misalign.0 as usize % ps as usize;
            let mut out = vec![SENTINEL; n];
            let got = s.alloc(&mut out);
            runner.compare_alloc("alloc", got, model.alloc(n), &out, ps)?;
        }
        Op::AllocExtend { reqs, fault } => {
            let reqs = &reqs.0[..reqs.0.len().min(MAX_BATCH)];
            let mut prefix = Vec::with_capacity(reqs.len());
            let mut seq = Vec::with_capacity(reqs.len());
            let mut last = Vec::with_capacity(reqs.len());
            for r in reqs {
                let p = r.prefix as u32 % (3 * ps + 1);
                prefix.push(p);
                seq.push(p + r.extend as u32 % (4 * ps + 1));
                last.push(last_loc(r.last_loc, p, runner, model, &last));
            }
            let mut out_len: usize = prefix.iter().zip(&seq).map(|(p, s)| (s - p) as usize).sum();
            if !S::BATCHES {
                // A SlotPool: one alloc of (about) the batch's new tokens.
                let n = out_len % (num_pages as usize + 2);
                let mut out = vec![SENTINEL; n];
                let got = s.alloc(&mut out);
                return runner.compare_alloc("alloc", got, model.alloc(n), &out, ps);
            }
            match *fault {
                ShapeFault::None => {}
                ShapeFault::ShortPrefixLens => {
                    prefix.pop();
                }
                ShapeFault::ShortLastLocs => {
                    last.pop();
                }
                ShapeFault::OutTooLong => out_len += 1,
                ShapeFault::OutTooShort => out_len = out_len.saturating_sub(1),
                ShapeFault::BadRequest(k) => {
                    if !seq.is_empty() {
                        let k = k as usize % seq.len();
                        prefix[k] = seq[k] + 1;
                    }
                }
            }
            let mut out = vec![SENTINEL; out_len];
            let got = s.alloc_extend(&prefix, &seq, &last, &mut out);
            let want = model.alloc_extend(&prefix, &seq, &last, out_len);
            runner.compare_alloc("alloc_extend", got, want, &out, ps)?;
        }
        Op::AllocDecode { reqs, fault } => {
            let reqs = &reqs.0[..reqs.0.len().min(MAX_BATCH)];
            if !S::BATCHES {
                let got = s.alloc_one();
                let want = model.alloc(1);
                runner.stats.record("alloc_one", alloc_outcome(&want));
                return match (got, want) {
                    (Ok(x), Ok(a)) if a.slots == [x] => {
                        runner.live.push(vec![x]);
                        Ok(())
                    }
                    (Err(g), Err(w)) if g == w => Ok(()),
                    (g, w) => Err(format!("alloc_one: got {g:?}, expected {w:?}")),
                };
            }
            let mut seq = Vec::with_capacity(reqs.len());
            let mut last = Vec::with_capacity(reqs.len());
            for r in reqs {
                let sl = 1 + r.seq as u32 % (3 * ps);
                seq.push(sl);
                last.push(last_loc(r.last_loc, sl - 1, runner, model, &last));
            }
            let mut out_len = seq.len();
            match *fault {
                ShapeFault::None | ShapeFault::ShortPrefixLens => {}
                ShapeFault::ShortLastLocs => {
                    last.pop();
                }
                ShapeFault::OutTooLong => out_len += 1,
                ShapeFault::OutTooShort => out_len = out_len.saturating_sub(1),
                ShapeFault::BadRequest(k) => {
                    if !seq.is_empty() {
                        let k = k as usize % seq.len();
                        seq[k] = 0;
                    }
                }
            }
            let mut out = vec![SENTINEL; out_len];
            let got = s.alloc_decode(&seq, &last, &mut out);
            let want = model.alloc_decode(&seq, &last, out_len);
            let ok = want.is_ok();
            runner.compare_alloc("alloc_decode", got, want, &out, ps)?;
            if ok && ps == 1 {
                // Which requests went on after their `last_loc` (see `AllocModel::alloc_decode`).
                let continued = out.iter().zip(&last).filter(|&(&o, &l)| o == l.wrapping_add(1)).count();
                if continued > 0 {
                    runner.stats.record("alloc_decode", "ok, continued a run");
                }
                if continued < out.len() {
                    runner.stats.record("alloc_decode", "ok, started a run");
                }
            }
        }
        Op::FreeLive { handle } => {
            let h = match runner.pick(*handle) {
                Some(k) => runner.live.swap_remove(k),
                None => Vec::new(), // freeing an empty list
            };
            free(&h, model, runner)?;
            runner.retire(h);
        }
        Op::Free(op) => free_op(op, ps, num_pages, runner, model, |m, slot| m.is_allocated(slot), &mut free)?,
        Op::Control(Control::GroupBegin) => {
            if group.is_none() {
                *group = Some(s.begin());
                model.begin_group();
            }
        }
        Op::Control(Control::GroupEnd) => {
            if let Some(g) = group.take() {
                end_group::<S>(g, model, &mut runner.stats)?;
            }
        }
        Op::Control(Control::Clear) => unreachable!("clears are handled by drive()"),
    }
    Ok(())
}

/// The concrete `last_loc` for a request whose prefix has `prefix_len` tokens, in a
/// batch whose earlier requests chose `taken`. Two requests continuing one partial page
/// are refused (`SamePartialPage`), so a live choice prefers a page no earlier request
/// took; one in sixteen (`k % 16 == 15`) takes the previous request's page on purpose.
fn last_loc(choice: LastLoc, prefix_len: u32, runner: &Runner, model: &AllocModel, taken: &[u32]) -> u32 {
    let ps = model.page_size();
    // Position of the last prefix token in its page.
    let pos = prefix_len.wrapping_sub(1) % ps;
    // The previous request's page (if allocated) for a deliberate repeat; else among
    // live handles whose first page is still allocated (a stale free may have taken
    // another's page), then among all allocated pages, one no earlier request took;
    // failing that, any such page; slot 0 when no page is allocated.
    let live_page = |k: u8| {
        let repeat = taken.last().map(|&t| t / ps).filter(|&p| p >= 1 && model.is_page_allocated(p));
        if k % 16 == 15 && repeat.is_some() {
            return repeat;
        }
        let untaken = |p: &u32| !taken.iter().any(|&t| t / ps == *p);
        // At page size 1 any allocated slot is a correct `last_loc`: a handle's last,
        // as a request's last token is (the slot after it may be free, and the
        // allocator continues there).
        let held = || {
            runner
                .live
                .iter()
                .map(|h| if ps == 1 { h[h.len() - 1] } else { h[0] / ps })
                .filter(|&p| model.is_page_allocated(p))
        };
        let any = || (1..=model.num_pages()).filter(|&p| model.is_page_allocated(p));
        pick(k, || held().filter(untaken))
            .or_else(|| pick(k, || any().filter(untaken)))
            .or_else(|| pick(k, held))
            .or_else(|| pick(k, any))
    };
    match choice {
        LastLoc::Live(k) => live_page(k).map_or(0, |p| p * ps + pos),
        LastLoc::WrongPosition(k) => live_page(k).map_or(0, |p| p * ps + (pos + 1) % ps),
        LastLoc::Forged(raw) => raw.resolve(ps, model.num_pages()),
    }
}

/// Item `k` (mod their number) of the items `items()` yields, `None` when it yields none.
fn pick<I: Iterator<Item = u32>>(k: u8, items: impl Fn() -> I) -> Option<u32> {
    let n = items().count();
    (n > 0).then(|| items().nth(k as usize % n)).flatten()
}

/// Compare `s` with the model: invariants, available and pending counts, and whether
/// `pages` (every page when `None`) and the slots just outside the pool are allocated.
fn check_state<S: Subject>(
    s: &S,
    group: &Option<S::Group<'_>>,
    model: &AllocModel,
    pages: Option<&[u32]>,
) -> Result<(), String> {
    s.check_invariants().map_err(|e| e.to_string())?;
    if s.available() != model.available() {
        return Err(format!("available {} but the model has {}", s.available(), model.available()));
    }
    let pending = group.as_ref().map_or(0, |g| S::group_pending(g));
    if pending != model.pending() {
        return Err(format!("group pending {pending} but the model has {}", model.pending()));
    }
    let ps = model.page_size();
    let check_page = |page: u32| {
        let want = model.is_page_allocated(page);
        let (first, last) = (page * ps, page * ps + ps - 1);
        for slot in [first, last].into_iter().take(if ps == 1 { 1 } else { 2 }) {
            if s.is_allocated(slot) != want {
                return Err(format!("is_allocated({slot}) is {} but page {page} is allocated: {want}", !want));
            }
        }
        Ok(())
    };
    match pages {
        Some(pages) => pages.iter().try_for_each(|&page| check_page(page))?,
        None => (1..=model.num_pages()).try_for_each(check_page)?,
    }
    for slot in [0, ps - 1, model.last_slot().saturating_add(1), u32::MAX] {
        if s.is_allocated(slot) {
            return Err(format!("is_allocated({slot}) is true for a slot outside the pool"));
        }
    }
    Ok(())
}
