//! Hybrid (attention + Mamba / linear-attention) models: the Mamba state pool, request
//! rows that own a Mamba state, and the layer mapping of a hybrid KV pool — SGLang's
//! `MambaPool`, `HybridReqToTokenPool` and `HybridLinearKVPool`.
//!
//! In a hybrid model (Qwen3-Next, Nemotron-H, Falcon-H1, Jamba, Bamba) a few layers are
//! full attention, with paged KV as everywhere else in kvpool, and the rest keep one
//! fixed-size state per request — a conv state and a temporal (SSM) state per layer —
//! that is updated in place and can only be resumed from a checkpoint.
//!
//! * [`MambaPool`] — a fixed arena of state slots (slot 0 is the dummy), allocated
//!   lock-free through a [`SlotPool`](crate::SlotPool). A slot is *held* through a
//!   unique [`MambaSlot`] handle (writable by its holder only) or *cached*, owned by
//!   number by the radix tree (read-only, pinned by readers while they copy it).
//! * [`HybridReqToTokenPool`] — request rows that own a working Mamba slot and the
//!   ping-pong track buffers for decode-time checkpoints, allocated with the row all or
//!   nothing and freed with it unless handed to the tree.
//! * [`HybridLayerMap`] — model layer ids to KV buffer indices (full attention) and
//!   Mamba state indices.
//!
//! # Examples
//!
//! A request on a hybrid model: a prefix hit forks the cached state, decode
//! checkpoints into the track buffers, and the finished request hands its last
//! checkpoint to the tree.
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
//!
//! let cfg = MambaConfig {
//!     layers: 3,
//!     conv: vec![StateShape::new(&[16, 3], StateDtype::Bf16)],
//!     temporal: StateShape::new(&[4, 8, 8], StateDtype::F32),
//! };
//! let mamba = Arc::new(MambaPool::new(16, cfg)?);
//! let rows = HybridReqToTokenPool::new(4, 1024, Arc::clone(&mamba), 2)?;
//!
//! let mut req = rows.alloc()?;                        // row + state + 2 track buffers
//! assert_eq!(mamba.available(), 13);
//! let m = rows.mamba_index(req.index());              // req_index_to_mamba_index
//! assert_eq!(Some(m), req.mamba().map(|s| s.index()));
//! let written = rows.checkpoint(&mut req)?;           // copy state -> track[current]
//! let kept = rows.take_checkpoint(&mut req).unwrap(); // the newest checkpoint
//! assert_eq!(kept.index(), written);
//! let cached = mamba.cache(kept)?;                    // owned by number now
//! rows.free(req)?;                                    // frees the row, state, other track
//! assert_eq!(mamba.available(), 15);
//! mamba.free(&[cached])?;                             // given back by number
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod layers;
mod pool;
mod rows;

pub use layers::{HybridLayerMap, LayerError, LayerKind};
pub(crate) use pool::sealed::Holder;
pub use pool::{HeldState, MambaPool, MambaSlot, SlotRefused};
pub use rows::{HybridAllocError, HybridFreeError, HybridReqToTokenPool, HybridRow};

use core::fmt;

use crate::error::{ConfigError, OutOfMemory, RowError};

/// The element type of a state component.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateDtype {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
}

impl StateDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            StateDtype::F16 | StateDtype::Bf16 => 2,
            StateDtype::F32 => 4,
        }
    }
}

/// The shape of one state component of one layer of one slot (without the layer and
/// slot dimensions), and its element type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateShape {
    /// Dimensions, e.g. `[conv_dim, kernel_size - 1]` or `[heads, head_k, head_v]`.
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: StateDtype,
}

impl StateShape {
    /// A shape of `dims` elements of `dtype`.
    pub fn new(dims: &[usize], dtype: StateDtype) -> Self {
        StateShape { dims: dims.to_vec(), dtype }
    }

    /// Elements (the product of the dimensions), `None` on overflow.
    pub(crate) fn elements(&self) -> Option<usize> {
        self.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }
}

/// What a [`MambaPool`] slot holds per Mamba layer (SGLang's `cache_params`): one or
/// more conv states (SGLang keeps a list) and one temporal (SSM) state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MambaConfig {
    /// Number of Mamba layers.
    pub layers: u32,
    /// Conv state shapes (usually one).
    pub conv: Vec<StateShape>,
    /// Temporal (SSM) state shape.
    pub temporal: StateShape,
}

impl MambaConfig {
    /// The components in buffer order: the conv states, then the temporal state.
    pub fn components(&self) -> impl Iterator<Item = Component> + '_ {
        (0..self.conv.len()).map(Component::Conv).chain([Component::Temporal])
    }

    /// The shape of a component, `None` for a conv index past the list.
    pub fn shape(&self, comp: Component) -> Option<&StateShape> {
        match comp {
            Component::Conv(i) => self.conv.get(i),
            Component::Temporal => Some(&self.temporal),
        }
    }

    /// Bytes of one row: one component of one layer of one slot (0 if unknown,
    /// `usize::MAX` if it does not fit a `usize`, a shape [`MambaPool::new`] refuses).
    pub fn row_bytes(&self, comp: Component) -> usize {
        self.shape(comp).map_or(0, |s| Self::shape_bytes(s).unwrap_or(usize::MAX))
    }

    /// Bytes of one row of shape `s`, `None` on overflow.
    fn shape_bytes(s: &StateShape) -> Option<usize> {
        s.elements()?.checked_mul(s.dtype.bytes())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.layers == 0 {
            return Err(ConfigError::Zero("mamba layers"));
        }
        let too_large = ConfigError::TooLargeForMemory { what: "a Mamba state row", bytes: u64::MAX };
        for comp in self.components() {
            let Some(s) = self.shape(comp) else { continue };
            match s.elements() {
                None => return Err(too_large),
                Some(0) => return Err(ConfigError::Zero("a Mamba state dimension")),
                Some(_) => {}
            }
            // Elements fit a `usize` but their bytes may not.
            if Self::shape_bytes(s).is_none() {
                let bytes = s.elements().and_then(|e| (e as u64).checked_mul(s.dtype.bytes() as u64));
                return Err(ConfigError::TooLargeForMemory {
                    what: "a Mamba state row",
                    bytes: bytes.unwrap_or(u64::MAX),
                });
            }
        }
        Ok(())
    }
}

/// One state component of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// Conv state `i` (of [`MambaConfig::conv`]).
    Conv(usize),
    /// The temporal (SSM) state.
    Temporal,
}

/// A Mamba pool or hybrid row operation was refused. Nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MambaError {
    /// No free slot (or not enough for a batch).
    OutOfMemory(OutOfMemory),
    /// The slot is not a cached state (it is free, held through a handle, being freed,
    /// or out of range), so it cannot be read by number.
    NotCached {
        /// The slot number.
        slot: u32,
    },
    /// A handle from another pool (or from this pool before a `clear`).
    ForeignSlot {
        /// The slot number.
        slot: u32,
    },
    /// `src` and `dst` of a batch copy differ in length.
    LengthMismatch {
        /// Sources.
        src: usize,
        /// Destinations.
        dst: usize,
    },
    /// A layer past the configured Mamba layers.
    BadLayer {
        /// The layer asked for.
        layer: u32,
        /// Mamba layers configured.
        layers: u32,
    },
    /// A conv state index past the configured list.
    BadComponent {
        /// The conv index asked for.
        conv: usize,
        /// Conv states configured.
        conv_states: usize,
    },
    /// The element type asked for does not fit the component's bytes.
    Cast(bytemuck::PodCastError),
    /// A request row operation failed.
    Row(RowError),
    /// The row has no track buffers (the pool was built with none).
    NoTrackBuffers,
    /// The row's working state was taken ([`HybridReqToTokenPool::take_mamba`]), so it
    /// has none to read or write.
    NoWorkingState,
    /// A request of a Mamba cache whose state pool holds slot numbers only (a
    /// [`SlotPool`](crate::SlotPool)): its states live with the engine.
    NoStateBytes,
    /// A request row index past the pool.
    BadRow {
        /// The row asked for.
        row: usize,
        /// Rows in the pool.
        rows: usize,
    },
}

impl fmt::Display for MambaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MambaError::OutOfMemory(e) => e.fmt(f),
            MambaError::NotCached { slot } => {
                write!(f, "mamba slot {slot} is not a cached state (free, held through a handle, or being freed)")
            }
            MambaError::ForeignSlot { slot } => write!(f, "mamba slot handle {slot} belongs to a different MambaPool"),
            MambaError::LengthMismatch { src, dst } => {
                write!(f, "{src} source slots but {dst} destination slots")
            }
            MambaError::BadLayer { layer, layers } => {
                write!(f, "mamba layer {layer} out of range: the pool has layers 0..{layers}")
            }
            MambaError::BadComponent { conv, conv_states } => {
                write!(f, "conv state {conv} out of range: the pool has {conv_states} conv state(s)")
            }
            MambaError::Cast(e) => write!(f, "cannot view the state as that element type: {e}"),
            MambaError::Row(e) => e.fmt(f),
            MambaError::NoTrackBuffers => {
                f.write_str("the row has no track buffer there (none configured, or it was taken)")
            }
            MambaError::NoWorkingState => f.write_str("the row's working Mamba state was taken"),
            MambaError::NoStateBytes => {
                f.write_str("the cache's state pool holds slot numbers only: the request's state lives with the engine")
            }
            MambaError::BadRow { row, rows } => write!(f, "request row {row} out of range: the pool has {rows} rows"),
        }
    }
}

impl std::error::Error for MambaError {}

impl From<OutOfMemory> for MambaError {
    fn from(e: OutOfMemory) -> Self {
        MambaError::OutOfMemory(e)
    }
}

impl From<RowError> for MambaError {
    fn from(e: RowError) -> Self {
        MambaError::Row(e)
    }
}

/// The host reference of the `mamba_state` kernels, on raw buffers in the pool layout
/// (`buffers[c]` is `[layers, num_rows, row_bytes[c]]`): for each `i` in order, copy
/// slot `src[i]` to slot `dst[i]` (or, with `src` `None`, zero slot `dst[i]`) in every
/// layer and component. A pair naming a slot `>= num_rows` is skipped, as the kernel
/// skips it; the result says whether one was.
///
/// # Panics
///
/// If a buffer is shorter than its layout, or `src` and `dst` differ in length.
///
/// # Examples
///
/// ```
/// let mut conv = vec![0u8; 2 * 3 * 4]; // 2 layers, 3 rows of 4 bytes
/// conv[4..8].copy_from_slice(&[1, 2, 3, 4]); // layer 0, slot 1
/// let skipped = kvpool::mamba::reference_copy(&mut [&mut conv], &[4], 2, 3, Some(&[1, 1]), &[2, 7]);
/// assert!(skipped);
/// assert_eq!(&conv[8..12], &[1, 2, 3, 4]);
/// ```
pub fn reference_copy(
    buffers: &mut [&mut [u8]],
    row_bytes: &[usize],
    layers: u32,
    num_rows: u32,
    src: Option<&[u32]>,
    dst: &[u32],
) -> bool {
    if let Some(src) = src {
        assert_eq!(src.len(), dst.len(), "src and dst lengths");
    }
    let mut skipped = false;
    for (i, &d) in dst.iter().enumerate() {
        let s = src.map(|s| s[i]);
        if d >= num_rows || s.is_some_and(|s| s >= num_rows) {
            skipped = true;
            continue;
        }
        for (buf, &r) in buffers.iter_mut().zip(row_bytes) {
            for layer in 0..layers as usize {
                let row = |slot: u32| (layer * num_rows as usize + slot as usize) * r;
                match s {
                    Some(s) => buf.copy_within(row(s)..row(s) + r, row(d)),
                    None => buf[row(d)..row(d) + r].fill(0),
                }
            }
        }
    }
    skipped
}

/// Pool generations tell handles of different pools apart (see `req_to_token`).
fn next_generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[cfg(all(test, not(loom)))]
mod tests;
