//! Error types, one per failure family.
//!
//! * [`OutOfMemory`] — an allocation asked for more than is free. Nothing changed.
//!   Its message follows SGLang's ("Out of memory. Try to lower your batch size. ...").
//! * [`FreeError`] — a free named an index that is out of range or not allocated.
//! * [`InvalidInput`] — arguments that can never succeed (mismatched batch lengths,
//!   a prefix longer than its sequence, an output buffer of the wrong size, ...).
//! * [`AllocError`] — what the batch allocation entry points return: either of the
//!   first and the last.
//! * [`ConfigError`] — a constructor's parameters are unusable.
//! * [`RowError`] — a request-row operation was out of bounds.
//! * [`SlotsError`] — an owned batch ([`Slots`](crate::slots::Slots)) could not be
//!   filled or returned. Nothing changed.

use core::fmt;

/// What a count in an [`OutOfMemory`] error is measured in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// KV token slots.
    Tokens,
    /// Whole pages of `page_size` tokens.
    Pages,
    /// Request rows of a [`ReqToTokenPool`](crate::ReqToTokenPool).
    Rows,
    /// Bare indices of a [`SlotPool`](crate::SlotPool).
    Indices,
    /// Mamba state slots of a [`MambaPool`](crate::mamba::MambaPool).
    MambaSlots,
    /// Token slots of the sliding-window layers' pool of a
    /// [`SwaAllocator`](crate::alloc::SwaAllocator).
    WindowTokens,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Tokens => "tokens",
            Unit::Pages => "pages",
            Unit::Rows => "request rows",
            Unit::Indices => "indices",
            Unit::MambaSlots => "mamba state slots",
            Unit::WindowTokens => "sliding-window tokens",
        }
    }
}

/// Not enough free capacity for an all-or-nothing allocation. Nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OutOfMemory {
    /// How many units were asked for.
    pub requested: usize,
    /// How many were free when the request was refused.
    pub available: usize,
    /// How many more a prefix cache could have freed by eviction, when one is involved.
    pub evictable: Option<usize>,
    /// What the counts are measured in.
    pub unit: Unit,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let u = self.unit.name();
        write!(
            f,
            "Out of memory. Try to lower your batch size.\nTry to allocate {} {u}.\nAvailable {u}: {}",
            self.requested, self.available
        )?;
        if let Some(e) = self.evictable {
            write!(f, "\nEvictable {u}: {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for OutOfMemory {}

/// Why a free was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FreeErrorKind {
    /// The index is 0 (reserved) or above the pool's capacity.
    OutOfRange {
        /// The lowest valid index.
        first: u32,
        /// The highest valid index.
        last: u32,
    },
    /// The index is already free: a double free, or an index that was never handed out.
    NotAllocated,
    /// The index is allocated but may not be freed by number now: a Mamba state slot
    /// held through a handle, or one that a reader has pinned (see
    /// [`MambaPool::free`](crate::mamba::MambaPool::free)).
    InUse,
    /// The index lies in a page a prefix cache holds: the cache frees it when it evicts
    /// it (see [`CacheAllocator`](crate::radix::CacheAllocator)).
    Cached,
}

/// A free named an index that it may not free.
///
/// Out-of-range and already-free indices, and (by a bare [`SlotPool`](crate::SlotPool)
/// and its [`FreeGroup`](crate::slots::FreeGroup)) an index named twice in one batch,
/// are found before anything changes: the whole batch is refused (`rest_freed:
/// false`; a repeat is reported as [`FreeErrorKind::NotAllocated`], naming the
/// repeated index). The one case found later is an index freed by two threads at
/// once: the index is freed once, the error names it, and the rest of the batch is
/// freed (`rest_freed: true`). The KV allocators
/// ([`KvAllocator::free`](crate::KvAllocator::free)) free the distinct pages a batch of
/// slots lies in, so a repeat there is no error at any page size, and they refuse a
/// batch all or nothing. In every case the pool's counts stay exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FreeError {
    /// The offending index (a slot, page or row number, as the caller passed it).
    pub index: u32,
    /// What is wrong with it.
    pub kind: FreeErrorKind,
    /// Whether the rest of the batch was freed anyway (see the type's docs).
    pub rest_freed: bool,
}

impl fmt::Display for FreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            FreeErrorKind::OutOfRange { first, last } => write!(
                f,
                "cannot free index {}: out of range (valid indices are {first}..={last}; below that is the reserved padding slot or page)",
                self.index
            )?,
            FreeErrorKind::NotAllocated => write!(
                f,
                "cannot free index {}: it is not allocated (double free, or never handed out)",
                self.index
            )?,
            FreeErrorKind::InUse => write!(
                f,
                "cannot free index {}: it is in use (held through a handle, or pinned by a reader)",
                self.index
            )?,
            FreeErrorKind::Cached => write!(
                f,
                "cannot free slot {}: its page is cached in the prefix tree, which frees it when it evicts it",
                self.index
            )?,
        }
        if self.rest_freed {
            f.write_str("; the other indices of the batch were freed")
        } else {
            f.write_str("; nothing was freed")
        }
    }
}

impl std::error::Error for FreeError {}

/// Arguments that can never succeed. Nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum InvalidInput {
    /// Two per-request input slices have different lengths.
    LengthMismatch {
        /// Which argument.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The batch size it should match.
        expected: usize,
    },
    /// A caller's output buffer has the wrong length.
    OutputLength {
        /// Its length.
        got: usize,
        /// The length the call writes.
        expected: usize,
    },
    /// Request `request` has `prefix_len > seq_len`.
    PrefixLongerThanSeq {
        /// The request's position in the batch.
        request: usize,
        /// Its prefix length.
        prefix_len: u32,
        /// Its sequence length.
        seq_len: u32,
    },
    /// Request `request` has a prefix but its `last_loc` is not a valid slot.
    BadLastLoc {
        /// The request's position in the batch.
        request: usize,
        /// The slot given.
        last_loc: u32,
    },
    /// Request `request`'s `last_loc` lies in a page the prefix cache holds, and the
    /// request would continue that page (its prefix ends inside it and grows): the
    /// page's next slots are the tree's. A request continues only a page of its own.
    LastLocCached {
        /// The request's position in the batch.
        request: usize,
        /// The slot given.
        last_loc: u32,
    },
    /// Requests `earlier` and `request` of one batch both continue the partial page of
    /// `last_loc` (their prefixes end inside it and grow): one call would hand the
    /// page's next slots to both. A partial page belongs to one request (prefix-cache
    /// hits are page-aligned), so this is always a caller bug.
    SamePartialPage {
        /// The first request that continues the page.
        earlier: usize,
        /// The later request that continues it too.
        request: usize,
        /// The later request's `last_loc`.
        last_loc: u32,
    },
    /// A count that must be a whole number of pages is not.
    NotPageAligned {
        /// The count.
        count: usize,
        /// The page size.
        page_size: u32,
    },
    /// A page number handed to the expansion is 0 or out of range.
    BadPage {
        /// The page number.
        page: u32,
    },
    /// The page list passed to an expansion does not have the length the batch needs.
    PageCount {
        /// Pages given.
        got: usize,
        /// Pages the batch needs.
        expected: usize,
    },
    /// Slots meant to fill one page are not that page's slots in order.
    NotAPage {
        /// The first slot of the offending page-sized chunk.
        slot: u32,
    },
    /// A decode step for a request with `seq_len == 0`.
    EmptyDecode {
        /// The request's position in the batch.
        request: usize,
    },
    /// A host KV pool's pages were allocated by number while a host tier owns the pool
    /// (a live [`HiRadixCache::with_host_pool`](crate::radix::HiRadixCache::with_host_pool)
    /// cache): that cache allocates and frees them.
    HostPoolOwned,
    /// A range passes the end of what it indexes.
    OutOfBounds {
        /// What is indexed.
        what: &'static str,
        /// Where the range ends (saturated at `usize::MAX`).
        end: usize,
        /// Its length.
        len: usize,
    },
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidInput::LengthMismatch { what, got, expected } => {
                write!(f, "`{what}` has {got} entries but the batch has {expected} requests")
            }
            InvalidInput::OutputLength { got, expected } => {
                write!(f, "output buffer holds {got} slots but the call writes {expected}")
            }
            InvalidInput::PrefixLongerThanSeq { request, prefix_len, seq_len } => {
                write!(f, "request {request}: prefix_len {prefix_len} is longer than seq_len {seq_len}")
            }
            InvalidInput::BadLastLoc { request, last_loc } => {
                write!(f, "request {request}: last_loc {last_loc} is not an allocated slot of this pool")
            }
            InvalidInput::LastLocCached { request, last_loc } => write!(
                f,
                "request {request}: last_loc {last_loc} lies in a page the prefix cache holds; a request continues only a page of its own"
            ),
            InvalidInput::SamePartialPage { earlier, request, last_loc } => write!(
                f,
                "request {request}: last_loc {last_loc} continues the same partial page as request {earlier}; a partial page belongs to one request"
            ),
            InvalidInput::NotPageAligned { count, page_size } => {
                write!(f, "{count} is not a multiple of the page size {page_size}")
            }
            InvalidInput::BadPage { page } => write!(f, "page {page} is 0 or beyond the pool"),
            InvalidInput::PageCount { got, expected } => {
                write!(f, "{got} pages given but the batch needs {expected}")
            }
            InvalidInput::NotAPage { slot } => {
                write!(f, "slots from {slot} are not one whole page in order (page-aligned, consecutive)")
            }
            InvalidInput::EmptyDecode { request } => {
                write!(f, "request {request}: decode needs seq_len >= 1 (the new token is counted)")
            }
            InvalidInput::HostPoolOwned => {
                f.write_str("the host KV pool is owned by a host tier, which allocates and frees its pages")
            }
            InvalidInput::OutOfBounds { what, end, len } => {
                write!(f, "range of {what} ends at {end}, past its length {len}")
            }
        }
    }
}

impl std::error::Error for InvalidInput {}

/// What the batch allocation entry points return on failure.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AllocError {
    /// Not enough free capacity; nothing changed.
    OutOfMemory(OutOfMemory),
    /// The arguments can never succeed; nothing changed.
    Invalid(InvalidInput),
    /// The request row to fill is not the caller's to write there (out of bounds, or
    /// another pool's); nothing changed.
    Row(RowError),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(e) => e.fmt(f),
            AllocError::Invalid(e) => write!(f, "invalid allocation request: {e}"),
            AllocError::Row(e) => write!(f, "cannot allocate into the request row: {e}"),
        }
    }
}

impl std::error::Error for AllocError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AllocError::OutOfMemory(e) => Some(e),
            AllocError::Invalid(e) => Some(e),
            AllocError::Row(e) => Some(e),
        }
    }
}

impl From<RowError> for AllocError {
    fn from(e: RowError) -> Self {
        AllocError::Row(e)
    }
}

impl From<OutOfMemory> for AllocError {
    fn from(e: OutOfMemory) -> Self {
        AllocError::OutOfMemory(e)
    }
}

impl From<InvalidInput> for AllocError {
    fn from(e: InvalidInput) -> Self {
        AllocError::Invalid(e)
    }
}

impl AllocError {
    /// The out-of-memory details, if that is what this is.
    pub fn out_of_memory(&self) -> Option<&OutOfMemory> {
        match self {
            AllocError::OutOfMemory(e) => Some(e),
            AllocError::Invalid(_) | AllocError::Row(_) => None,
        }
    }
}

/// A constructor's parameters are unusable.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ConfigError {
    /// `page_size` must be at least 1.
    ZeroPageSize,
    /// The slot numbers would not fit in a `u32`.
    TooLarge {
        /// The requested token capacity.
        size: u64,
        /// The page size.
        page_size: u32,
    },
    /// A dimension that must be positive is zero.
    Zero(&'static str),
    /// The arenas would take more memory than this machine can allocate (or more
    /// than can be addressed). Nothing was allocated.
    TooLargeForMemory {
        /// What needed the memory (an arena, or the whole configuration).
        what: &'static str,
        /// Bytes it needs (`u64::MAX` when the size overflows 64 bits).
        bytes: u64,
    },
    /// A host KV pool a host tier cannot take (its page size differs from the device
    /// allocator's, or pages of it are in use already).
    HostPool {
        /// Why.
        why: &'static str,
    },
    /// Two options that cannot be combined (the first is refused with the second).
    Unsupported {
        /// What was asked for.
        what: &'static str,
        /// What it cannot be combined with.
        with: &'static str,
    },
    /// A length must be a whole multiple of another (a Mamba checkpoint chunk of the
    /// page size, a decode track interval of the chunk).
    NotAMultiple {
        /// What is being configured.
        what: &'static str,
        /// Its value.
        value: usize,
        /// What it must be a multiple of.
        of: &'static str,
        /// That length.
        unit: usize,
    },
    /// The full-attention and sliding-window layer ids of a hybrid SWA model
    /// ([`SwaLayout`](crate::kv::swa::SwaLayout)) do not partition `0..num_layers`:
    /// every layer must be listed exactly once, in one of the two lists.
    LayerPartition {
        /// The layer id at fault.
        layer: u32,
        /// The model's layer count.
        num_layers: u32,
        /// What is wrong with it.
        fault: LayerFault,
    },
}

/// What is wrong with a layer id in a [`ConfigError::LayerPartition`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerFault {
    /// It is `num_layers` or more.
    OutOfRange,
    /// It is listed twice (in one list, or in both).
    Repeated,
    /// It is in neither list.
    Missing,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroPageSize => f.write_str("page size must be at least 1"),
            ConfigError::TooLarge { size, page_size } => {
                write!(f, "size {size} with page size {page_size} needs slot numbers beyond u32::MAX")
            }
            ConfigError::Zero(what) => write!(f, "{what} must be at least 1"),
            ConfigError::Unsupported { what, with } => write!(f, "{what} is not supported with {with}"),
            ConfigError::HostPool { why } => write!(f, "the host KV pool cannot be the host tier: {why}"),
            ConfigError::NotAMultiple { what, value, of, unit } => {
                write!(f, "{what} ({value}) must be a whole multiple of {of} ({unit})")
            }
            ConfigError::LayerPartition { layer, num_layers, fault } => {
                let why = match fault {
                    LayerFault::OutOfRange => "is out of range",
                    LayerFault::Repeated => "is listed twice",
                    LayerFault::Missing => "is in neither list",
                };
                write!(f, "layer {layer} {why}: the full and sliding-window layers must partition 0..{num_layers}")
            }
            ConfigError::TooLargeForMemory { what, bytes: u64::MAX } => {
                write!(f, "{what} needs more than {} bytes, more than can be addressed", u64::MAX)
            }
            ConfigError::TooLargeForMemory { what, bytes } => write!(
                f,
                "{what} needs {bytes} bytes ({:.1} GiB), more than this machine can allocate",
                *bytes as f64 / (1u64 << 30) as f64
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A request-row operation was refused. Nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RowError {
    /// A write or read past `max_context_len`.
    OutOfBounds {
        /// The row.
        row: u32,
        /// First column of the range.
        start: usize,
        /// Length of the range.
        len: usize,
        /// The row length.
        max_context_len: usize,
    },
    /// A row handle from another pool.
    ForeignRow {
        /// The row number.
        row: u32,
    },
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RowError::OutOfBounds { row, start, len, max_context_len } => write!(
                f,
                "row {row}: range {start}..{} is beyond max_context_len {max_context_len}",
                start.saturating_add(*len)
            ),
            RowError::ForeignRow { row } => {
                write!(f, "row handle {row} belongs to a different ReqToTokenPool")
            }
        }
    }
}

impl std::error::Error for RowError {}

/// A `check_invariants()` found the structure inconsistent. This is a kvpool bug (or
/// memory corruption); the message says which invariant broke.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InvariantViolation(pub String);

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant violated: {}", self.0)
    }
}

impl std::error::Error for InvariantViolation {}

/// Why [`SlotPool::alloc_slots`](crate::SlotPool::alloc_slots),
/// [`SlotPool::free_slots`](crate::SlotPool::free_slots) or
/// [`SlotPool::free_slots_tail`](crate::SlotPool::free_slots_tail) refused. Nothing was changed:
/// the pool and the [`Slots`](crate::slots::Slots) are as before the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotsError {
    /// Fewer than the requested indices are available.
    OutOfMemory(OutOfMemory),
    /// The `Slots` has no room for the batch: it holds `len` of `capacity` indices.
    Full {
        /// Indices asked for.
        requested: usize,
        /// Indices the `Slots` holds already.
        len: usize,
        /// Indices it can hold.
        capacity: usize,
    },
    /// A partial free asked for more indices than the `Slots` holds.
    TooMany {
        /// Indices asked for.
        requested: usize,
        /// Indices the `Slots` holds.
        len: usize,
    },
    /// The `Slots` holds indices of another pool (or of this pool before
    /// [`clear`](crate::SlotPool::clear)).
    OtherPool,
    /// The pool has no magazines ([`SlotPool::without_magazines`](crate::SlotPool::without_magazines),
    /// [`SlotPool::with_parking`](crate::SlotPool::with_parking)): without its
    /// per-index `held` bits it could not refuse a bare [`free`](crate::SlotPool::free)
    /// of an index that a `Slots` owns.
    Unsupported,
}

impl fmt::Display for SlotsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotsError::OutOfMemory(e) => e.fmt(f),
            SlotsError::Full { requested, len, capacity } => write!(
                f,
                "cannot add {requested} indices to a Slots that holds {len} of {capacity}; nothing was changed"
            ),
            SlotsError::TooMany { requested, len } => write!(
                f,
                "cannot free the last {requested} indices of a Slots that holds {len}; nothing was changed"
            ),
            SlotsError::OtherPool => {
                f.write_str("the Slots holds indices of another pool (or of this one before it was cleared); nothing was changed")
            }
            SlotsError::Unsupported => f.write_str(
                "this pool has no magazines (built without_magazines or with_parking): owned batches need the held bits of a pool built with new or with_magazines",
            ),
        }
    }
}

impl std::error::Error for SlotsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SlotsError::OutOfMemory(e) => Some(e),
            _ => None,
        }
    }
}

impl From<OutOfMemory> for SlotsError {
    fn from(e: OutOfMemory) -> Self {
        SlotsError::OutOfMemory(e)
    }
}

/// The `Display` and `Error` impls of an error that hands a handle back (a field
/// `error` with the reason, beside the handle): it reads as its reason. With `=>
/// Reason`, also `From<Type> for Reason`, which keeps the reason and drops the handle.
macro_rules! hands_back {
    ($ty:ty) => {
        impl core::fmt::Display for $ty {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                self.error.fmt(f)
            }
        }

        impl std::error::Error for $ty {}
    };
    ($ty:ty => $reason:ty) => {
        $crate::error::hands_back!($ty);

        /// The reason alone (the handle is dropped: take it from the error first if it
        /// is to be freed elsewhere).
        impl From<$ty> for $reason {
            fn from(e: $ty) -> Self {
                e.error
            }
        }
    };
}
pub(crate) use hands_back;
