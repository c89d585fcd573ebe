//! The host KV tier (SGLang's HiCache `HostKVCache`): a fixed-capacity pool of KV
//! pages in host memory — pinned and device-mapped under the feature `cuda`, ordinary
//! memory without — with the device pool's row layout, lock-free page allocation, and
//! the host reference of the two transfers the GPU kernels do (`host_backup_*`:
//! device pages to host pages; `host_load_*`: host pages back to device pages, a range
//! of layers at a time).
//!
//! # Layout
//!
//! With `L` layers, `B` buffers per layer (2 for MHA: K then V; 1 for MLA), page size
//! `ps`, row bytes `R`, host page `p` in `1..=host_pages` (page 0 is a dummy page,
//! like the device's page 0, never handed out) and token `k` in `0..ps`, row `k` of
//! page `p`, layer `l`, buffer `b` starts at byte:
//!
//! * [`HostLayout::LayerFirst`]: `((l*B + b) * (host_pages+1)*ps + p*ps + k) * R` (each
//!   layer buffer is a device-shaped buffer of `(host_pages + 1) * ps` rows);
//! * [`HostLayout::PageFirst`]: `(((p*L + l)*B + b)*ps + k) * R` (all layers of a page
//!   contiguous, [`HostKvConfig::page_bytes`] bytes: one piece for bulk transfers to
//!   disk or a remote store).
//!
//! The pool is `(host_pages + 1) * ps * L * B * R` bytes ([`HostKvConfig::total_bytes`]).
//! Either way one page of one layer buffer is `ps * R` contiguous bytes
//! ([`HostKvConfig::chunk_bytes`]), as on the device.
//!
//! # Ownership and threads
//!
//! Page allocation ([`HostKvPool::alloc_pages`], [`HostKvPool::free_pages`]) works
//! through `&self` on the crate's lock-free [`SlotPool`] (the primitive under the
//! device's `PagedAllocator`): any number of threads may allocate and free at once, and
//! nothing allocates after construction. **The bytes of a page belong to whoever
//! allocated it** until they free it: the transfers name their pages, and a page that
//! is not allocated is refused with [`HostPageFault::NotAllocated`] before anything is
//! written.
//!
//! A pool handed to a host tier
//! ([`HiRadixCache::with_host_pool`](crate::radix::HiRadixCache::with_host_pool)) is
//! **owned** by that cache while it lives ([`HostKvPool::is_owned`]): the tree
//! allocates and frees every page, so `alloc_pages` is refused
//! ([`InvalidInput::HostPoolOwned`]) and so is `free_pages` (a page the tree holds:
//! [`FreeErrorKind::Cached`]) — no page can have two
//! owners. A second cache over the same pool is refused. Reading and writing the bytes
//! of pages (what a copy engine does with the tree's transfers) work as before. When
//! the cache is dropped it returns its pages and the pool is the caller's again. The host reference writes host bytes through `&mut self`
//! ([`HostKvPool::backup`]) and reads them through `&self`; the GPU transfers
//! (`kvpool::cuda::host`, feature `cuda`) write them asynchronously and are `unsafe`:
//! their caller promises not to touch the named pages until the stream has run them.
//!
//! # Examples
//!
//! ```
//! use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout, DEFAULT_HOST_TO_DEVICE_RATIO};
//! use kvpool::kv::{KvConfig, KvDtype, KvLayout};
//!
//! // A small MHA cache: 2 layers, rows of 8 bytes, 4 device pages of 2 tokens.
//! let kv = KvConfig { layout: KvLayout::Mha { head_num: 1, head_dim: 4 }, dtype: KvDtype::F16,
//!                     layer_num: 2, size: 8, page_size: 2 };
//! let cfg = HostKvConfig::with_ratio(kv, DEFAULT_HOST_TO_DEVICE_RATIO, HostLayout::PageFirst)?;
//! assert_eq!(cfg.host_pages, 8);
//! let mut pool = HostKvPool::pageable(cfg)?;          // `new`: pinned under `cuda`
//! let mut hp = [0u32; 2];
//! pool.alloc_pages(&mut hp)?;
//!
//! // The device's buffers, modelled on the host: K0, V0, K1, V1, `rows * row_bytes` each.
//! let mut device: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; kv.rows() * kv.row_bytes()]).collect();
//! let view: Vec<&[u8]> = device.iter().map(|b| &b[..]).collect();
//! pool.backup(&view, &[3, 1], &hp)?;                  // device pages 3, 1 -> host pages
//! assert_eq!(pool.page_rows(hp[0], 1, 1)?, &[3u8; 16][..]);   // layer 1, V: buffer 3
//!
//! // Load host page hp[0] into device page 2, layer 0 only.
//! let mut bufs: Vec<&mut [u8]> = device.iter_mut().map(|b| &mut b[..]).collect();
//! pool.load(&mut bufs, &hp[..1], &[2], 0..1)?;
//! assert_eq!(&device[1][2 * 16..3 * 16], &[1u8; 16][..]);     // V0, page 2: V0's bytes
//! assert_eq!(&device[3][2 * 16..3 * 16], &[3u8; 16][..]);     // layer 1 untouched
//! pool.free_pages(&hp)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt;
use core::ops::Range;
use core::ptr::NonNull;
// Plain `std` atomics, also under loom: who may allocate by number is setup
// bookkeeping (a cache taking or giving back the pool), not a modelled protocol.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::KvConfig;
use crate::error::{AllocError, ConfigError, FreeError, FreeErrorKind, InvalidInput, Unit};
use crate::slots::SlotPool;

/// SGLang's default `host_to_device_ratio`: the host pool holds twice the device pool.
pub const DEFAULT_HOST_TO_DEVICE_RATIO: f64 = 2.0;

/// How a host pool orders its bytes (see the module docs for the offsets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostLayout {
    /// Each layer buffer (K or V of a layer) is one device-shaped buffer of
    /// `(host_pages + 1) * page_size` rows (SGLang's `layer_first`).
    LayerFirst,
    /// All layers and buffers of a page are contiguous (SGLang's `page_first`).
    PageFirst,
}

/// The shape of a host KV pool: the device cache's shape ([`KvConfig`]: layout, dtype,
/// layers, page size; its `size` is the device pool's), the host pages and the byte
/// order.
///
/// # Examples
///
/// Llama-3-8B (32 layers, 8 KV heads of 128, bf16), 16-token pages, 1 M device tokens,
/// twice that on the host:
///
/// ```
/// use kvpool::kv::host::{HostKvConfig, HostLayout};
/// use kvpool::kv::{KvConfig, KvDtype, KvLayout};
/// let kv = KvConfig { layout: KvLayout::Mha { head_num: 8, head_dim: 128 }, dtype: KvDtype::Bf16,
///                     layer_num: 32, size: 1 << 20, page_size: 16 };
/// let cfg = HostKvConfig::with_ratio(kv, 2.0, HostLayout::PageFirst)?;
/// assert_eq!(cfg.host_pages, 2 * (1 << 20) / 16);
/// assert_eq!(cfg.chunk_bytes(), 16 * 2048);                 // one page of one K or V layer
/// assert_eq!(cfg.page_bytes(), 32 * 2 * 16 * 2048);         // 2 MiB: 128 KiB a token
/// assert_eq!(cfg.total_bytes(), (cfg.host_pages + 1) * cfg.page_bytes());
/// assert_eq!(cfg.offset(1, 0, 1, 0), Some(cfg.page_bytes() + cfg.chunk_bytes()));
/// # Ok::<(), kvpool::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostKvConfig {
    /// The device cache's shape (its `size` is the device pool's token capacity).
    pub kv: KvConfig,
    /// Host pages (page numbers `1..=host_pages`).
    pub host_pages: usize,
    /// The byte order.
    pub layout: HostLayout,
}

impl HostKvConfig {
    /// `floor(device_pages * ratio)` host pages for the device cache `kv`
    /// (`device_pages = kv.size / kv.page_size`; SGLang's `host_to_device_ratio`,
    /// [`DEFAULT_HOST_TO_DEVICE_RATIO`] by default), validated.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] naming `host_to_device_ratio` for a ratio that is not a
    /// positive number, or `host_pages` when the product rounds down to 0;
    /// [`ConfigError::TooLarge`] for more pages than `u32` page numbers hold; anything
    /// [`validate`](Self::validate) returns.
    pub fn with_ratio(kv: KvConfig, ratio: f64, layout: HostLayout) -> Result<HostKvConfig, ConfigError> {
        kv.validate()?;
        if !ratio.is_finite() || ratio <= 0.0 {
            return Err(ConfigError::Zero("host_to_device_ratio"));
        }
        let device_pages = kv.size / kv.page_size as usize;
        let pages = (device_pages as f64 * ratio).floor();
        if pages >= u32::MAX as f64 {
            return Err(ConfigError::TooLarge { size: u64::MAX, page_size: kv.page_size });
        }
        let cfg = HostKvConfig { kv, host_pages: pages as usize, layout };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check that the configuration is usable.
    ///
    /// # Errors
    ///
    /// What [`KvConfig::validate`] returns; [`ConfigError::Zero`] for no host pages;
    /// [`ConfigError::TooLarge`] when page numbers `1..=host_pages` do not fit in a
    /// `u32` or one page of one layer buffer is `2^31` vectors or more;
    /// [`ConfigError::TooLargeForMemory`] when the pool's bytes overflow `isize`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.kv.validate()?;
        if self.host_pages == 0 {
            return Err(ConfigError::Zero("host_pages"));
        }
        if self.host_pages >= u32::MAX as usize {
            return Err(ConfigError::TooLarge { size: self.host_pages as u64, page_size: self.kv.page_size });
        }
        let chunk = (self.kv.page_size as u64).checked_mul(self.kv.row_bytes() as u64);
        // The kernels count a chunk's bytes in u32 one-byte vectors plus a stride.
        if chunk.map_or(true, |c| c >= 1 << 31) {
            return Err(ConfigError::TooLarge { size: chunk.unwrap_or(u64::MAX), page_size: self.kv.page_size });
        }
        let total = chunk
            .and_then(|c| c.checked_mul(self.kv.layer_num as u64 * self.kv.layout.buffers() as u64))
            .and_then(|p| p.checked_mul(self.host_pages as u64 + 1))
            .filter(|&t| t <= isize::MAX as u64);
        if total.is_none() {
            return Err(ConfigError::TooLargeForMemory { what: "the host KV pool", bytes: u64::MAX });
        }
        Ok(())
    }

    /// Buffers per layer: 2 (K, V) for MHA, 1 for MLA.
    pub fn buffers(&self) -> usize {
        self.kv.layout.buffers()
    }

    /// Pages of the device pool (`kv.size / page_size`; device pages are `1..=` that).
    pub fn device_pages(&self) -> usize {
        self.kv.size / self.kv.page_size as usize
    }

    /// `(chunk, page, page stride, layer-buffer stride, total)` bytes, or `None` when
    /// any overflows `usize` (a configuration [`validate`](Self::validate) refuses).
    fn checked_sizes(&self) -> Option<(usize, usize, usize, usize, usize)> {
        let row = self.kv.layout.row_elems().checked_mul(self.kv.dtype.bytes())?;
        let chunk = (self.kv.page_size as usize).checked_mul(row)?;
        let lbs = (self.kv.layer_num as usize).checked_mul(self.buffers())?;
        let page = chunk.checked_mul(lbs)?;
        let total = self.host_pages.checked_add(1)?.checked_mul(page)?;
        let (page_stride, lb_stride) = match self.layout {
            // (host_pages + 1) * chunk <= total: no overflow once `total` has none.
            HostLayout::LayerFirst => (chunk, (self.host_pages + 1) * chunk),
            HostLayout::PageFirst => (page, chunk),
        };
        Some((chunk, page, page_stride, lb_stride, total))
    }

    /// Bytes of one page of one layer buffer: `page_size * row_bytes`, contiguous on
    /// the host and on the device. `usize::MAX` when that overflows (a configuration
    /// [`validate`](Self::validate) refuses).
    pub fn chunk_bytes(&self) -> usize {
        self.kv
            .layout
            .row_elems()
            .checked_mul(self.kv.dtype.bytes())
            .and_then(|row| (self.kv.page_size as usize).checked_mul(row))
            .unwrap_or(usize::MAX)
    }

    /// Bytes of one page across every layer and buffer. `usize::MAX` when that
    /// overflows (a configuration [`validate`](Self::validate) refuses).
    pub fn page_bytes(&self) -> usize {
        self.chunk_bytes().saturating_mul(self.kv.layer_num as usize).saturating_mul(self.buffers())
    }

    /// Bytes of the whole pool, the dummy page 0 included. `usize::MAX` when that
    /// overflows (a configuration [`validate`](Self::validate) refuses).
    pub fn total_bytes(&self) -> usize {
        self.checked_sizes().map_or(usize::MAX, |(.., total)| total)
    }

    /// `(page stride, layer-buffer stride)` in bytes: page `p`'s chunk of layer buffer
    /// `lb = l * B + b` starts at `p * page_stride + lb * lb_stride`. Each saturates at
    /// `usize::MAX` when the pool's size overflows (a configuration
    /// [`validate`](Self::validate) refuses).
    pub(crate) fn strides(&self) -> (usize, usize) {
        match self.checked_sizes() {
            Some((_, _, page_stride, lb_stride, _)) => (page_stride, lb_stride),
            None => (usize::MAX, usize::MAX),
        }
    }

    /// Where row `token` of page `page`, layer `layer`, buffer `buffer` (0 = K, 1 = V;
    /// 0 for MLA) starts, in bytes from the pool's start; `None` when any index is out
    /// of range (`page > host_pages`, `token >= page_size`, ...) or the pool's size
    /// overflows `usize` (a configuration [`validate`](Self::validate) refuses). Page 0
    /// (the dummy page) has an offset like any other.
    pub fn offset(&self, page: u32, layer: u32, buffer: u32, token: u32) -> Option<usize> {
        if page as usize > self.host_pages
            || layer >= self.kv.layer_num
            || buffer as usize >= self.buffers()
            || token >= self.kv.page_size
        {
            return None;
        }
        // Every row of the pool starts below `total`, so with `total` in range nothing
        // below overflows.
        let (chunk, _, ps, lbs, _) = self.checked_sizes()?;
        let row = chunk / self.kv.page_size as usize;
        let lb = layer as usize * self.buffers() + buffer as usize;
        Some(page as usize * ps + lb * lbs + token as usize * row)
    }
}

/// What is wrong with a host page a call named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostPageFault {
    /// It is 0 (the dummy page) or past `host_pages`.
    OutOfRange,
    /// It is not allocated (never handed out, or freed): its bytes are nobody's to use.
    NotAllocated,
}

/// Why a host pool operation was refused. Nothing was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostKvError {
    /// The configuration is unusable, or the memory cannot be had.
    Config(ConfigError),
    /// A list or buffer has the wrong length.
    Shape {
        /// Which argument.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length needed.
        expected: usize,
    },
    /// A device page is 0 (the dummy page) or past the device pool's pages.
    DevicePage {
        /// The page.
        page: u32,
        /// The device pool's pages (valid pages are `1..=pages`).
        pages: usize,
    },
    /// A host page is out of range or not allocated.
    HostPage {
        /// The page.
        page: u32,
        /// What is wrong with it.
        fault: HostPageFault,
    },
    /// A layer range is empty-reversed or past the last layer.
    Layers {
        /// Its start.
        start: u32,
        /// Its end.
        end: u32,
        /// The model's layers.
        layer_num: u32,
    },
    /// The pool's memory is not what the call needs (pageable memory handed to a GPU
    /// transfer, which needs pinned, device-mapped memory).
    Memory {
        /// What the call needs.
        needs: HostMemory,
    },
    /// A CUDA driver call failed (pinning the pool's memory).
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
    },
}

impl fmt::Display for HostKvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostKvError::Config(e) => e.fmt(f),
            HostKvError::Shape { what, got, expected } => write!(f, "`{what}` has length {got}, expected {expected}"),
            HostKvError::DevicePage { page, pages } => {
                write!(f, "device page {page} is out of range (valid pages are 1..={pages})")
            }
            HostKvError::HostPage { page, fault: HostPageFault::OutOfRange } => {
                write!(f, "host page {page} is out of range (page 0 is the dummy page)")
            }
            HostKvError::HostPage { page, fault: HostPageFault::NotAllocated } => {
                write!(f, "host page {page} is not allocated")
            }
            HostKvError::Layers { start, end, layer_num } => {
                write!(f, "layers {start}..{end} are not a range of 0..{layer_num}")
            }
            HostKvError::Memory { needs } => write!(f, "the host pool's memory is not {needs:?}"),
            HostKvError::Driver { call, code } => write!(f, "{call} failed with CUresult {code}"),
        }
    }
}

impl std::error::Error for HostKvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HostKvError::Config(e) => Some(e),
            _ => None,
        }
    }
}

impl From<ConfigError> for HostKvError {
    fn from(e: ConfigError) -> Self {
        HostKvError::Config(e)
    }
}

/// What memory a [`HostKvPool`] lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostMemory {
    /// Page-locked host memory mapped into the device's address space
    /// (`cuMemHostAlloc` with `PORTABLE | DEVICEMAP`): kernels read and write it
    /// directly, and copy engines move it at full link speed.
    Pinned,
    /// Ordinary heap memory.
    Pageable,
}

/// The pool's bytes: `len` bytes at `ptr`, zeroed at construction, freed on drop.
struct Arena {
    ptr: NonNull<u8>,
    len: usize,
    memory: HostMemory,
    /// The device address of a pinned arena (equal to the host address under unified
    /// addressing).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    mapped: u64,
}

impl Arena {
    fn pageable(len: usize) -> Result<Arena, ConfigError> {
        let mut v = crate::arena::try_with_capacity::<u8>(len, "the host KV pool")?;
        v.resize(len, 0);
        let boxed: Box<[u8]> = v.into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("a box is never null");
        Ok(Arena { ptr, len, memory: HostMemory::Pageable, mapped: 0 })
    }

    #[cfg(feature = "cuda")]
    fn pinned(len: usize) -> Result<Arena, HostKvError> {
        use cust::sys::{
            cuMemFreeHost, cuMemHostAlloc, cuMemHostGetDevicePointer_v2, cudaError_enum, CU_MEMHOSTALLOC_DEVICEMAP,
            CU_MEMHOSTALLOC_PORTABLE,
        };
        let mut p: *mut core::ffi::c_void = core::ptr::null_mut();
        // SAFETY: an out-parameter, a size and valid flags; the driver allocates in the
        // current context (or reports that there is none).
        let r = unsafe { cuMemHostAlloc(&mut p, len, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) };
        if r != cudaError_enum::CUDA_SUCCESS {
            return Err(HostKvError::Driver { call: "cuMemHostAlloc", code: r as u32 });
        }
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            return Err(HostKvError::Driver { call: "cuMemHostAlloc", code: 0 });
        };
        let mut mapped = 0u64;
        // SAFETY: `p` is a live mapped pinned allocation; flags must be 0.
        let r = unsafe { cuMemHostGetDevicePointer_v2(&mut mapped, p, 0) };
        if r != cudaError_enum::CUDA_SUCCESS {
            // SAFETY: `p` came from cuMemHostAlloc above and is freed once, here.
            unsafe { cuMemFreeHost(p) };
            return Err(HostKvError::Driver { call: "cuMemHostGetDevicePointer", code: r as u32 });
        }
        // SAFETY: `len` bytes at `ptr` are ours (just allocated); zeroing them is the
        // arena's starting state.
        unsafe { ptr.as_ptr().write_bytes(0, len) };
        Ok(Arena { ptr, len, memory: HostMemory::Pinned, mapped })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        match self.memory {
            HostMemory::Pageable => {
                let slice = core::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
                // SAFETY: `slice` is exactly the box `Arena::pageable` leaked, dropped once.
                drop(unsafe { Box::from_raw(slice) });
            }
            HostMemory::Pinned => {
                #[cfg(feature = "cuda")]
                // SAFETY: the pointer came from cuMemHostAlloc and is freed once. The
                // GPU transfers' contract says no queued work uses it past the pool.
                unsafe {
                    cust::sys::cuMemFreeHost(self.ptr.as_ptr().cast());
                }
            }
        }
    }
}

/// A fixed-capacity pool of KV pages in host memory (see the module docs): the bytes
/// ([`HostKvConfig::total_bytes`], reserved once at construction) and the lock-free
/// allocation of pages `1..=host_pages`.
pub struct HostKvPool {
    cfg: HostKvConfig,
    pages: SlotPool,
    arena: Arena,
    /// Who may allocate and free pages by number: [`OWNED`] while a host tier owns the
    /// pool ([`HostPoolClaim`]), plus the count of public `alloc_pages` / `free_pages`
    /// calls in progress (a claim waits for them to end).
    users: AtomicU64,
}

/// The bit of [`HostKvPool::users`] set while a host tier owns the pool.
const OWNED: u64 = 1 << 63;
/// The bit of [`HostKvPool::users`] set while a host tier is claiming the pool: public
/// calls wait for the claim to end (it succeeds only if none of them holds a page, so a
/// call must not be refused on its account).
const CLAIMING: u64 = 1 << 62;

// SAFETY: the arena is a plain byte buffer owned by the pool. Through safe code its
// bytes are written only through `&mut self` (the host reference's `backup`,
// `page_rows_mut`, `as_bytes_mut`) and read through `&self`, so Rust's aliasing rules
// order every access; the page allocator is made of atomics. The GPU transfers write
// through the pool's mapped address under their own `unsafe` contract (no host access
// to the pages they name until the stream has run them).
unsafe impl Send for HostKvPool {}
// SAFETY: as for `Send`: shared references only read the bytes and use atomics.
unsafe impl Sync for HostKvPool {}

impl fmt::Debug for HostKvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostKvPool")
            .field("config", &self.cfg)
            .field("memory", &self.arena.memory)
            .field("available_pages", &self.available_pages())
            .field("owned", &self.is_owned())
            .finish()
    }
}

impl HostKvPool {
    /// A pool for `cfg`, all pages free, bytes zeroed. Under the feature `cuda` the
    /// memory is pinned and device-mapped (`cuMemHostAlloc`), which needs a current
    /// CUDA context (open a `KvDevice` first); without it, ordinary memory (as
    /// [`pageable`](Self::pageable)).
    ///
    /// # Errors
    ///
    /// [`HostKvError::Config`] for an invalid `cfg` or memory the machine cannot give;
    /// [`HostKvError::Driver`] when pinning fails (no context, out of pinned memory).
    pub fn new(cfg: HostKvConfig) -> Result<HostKvPool, HostKvError> {
        #[cfg(feature = "cuda")]
        {
            Self::build(cfg, true)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Self::build(cfg, false)
        }
    }

    /// A pool in ordinary (pageable) memory, with or without the feature `cuda`: for
    /// host-only use and tests. The GPU transfers refuse it ([`HostKvError::Memory`]).
    ///
    /// # Errors
    ///
    /// [`HostKvError::Config`] for an invalid `cfg` or memory the machine cannot give.
    pub fn pageable(cfg: HostKvConfig) -> Result<HostKvPool, HostKvError> {
        Self::build(cfg, false)
    }

    fn build(cfg: HostKvConfig, pinned: bool) -> Result<HostKvPool, HostKvError> {
        cfg.validate()?;
        crate::arena::probe(crate::arena::bytes_of::<u64>(cfg.host_pages.div_ceil(64)), "the host page bitmap")?;
        let arena = if pinned {
            #[cfg(feature = "cuda")]
            {
                Arena::pinned(cfg.total_bytes())?
            }
            #[cfg(not(feature = "cuda"))]
            {
                unreachable!("pinned memory needs the feature `cuda`")
            }
        } else {
            Arena::pageable(cfg.total_bytes())?
        };
        Ok(HostKvPool {
            pages: SlotPool::without_magazines(cfg.host_pages as u32),
            cfg,
            arena,
            users: AtomicU64::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &HostKvConfig {
        &self.cfg
    }

    /// What memory the pool lives in.
    pub fn memory(&self) -> HostMemory {
        self.arena.memory
    }

    /// The device address of the pool's first byte (pinned pools only).
    #[cfg(feature = "cuda")]
    pub(crate) fn mapped_address(&self) -> Option<u64> {
        (self.arena.memory == HostMemory::Pinned).then_some(self.arena.mapped)
    }

    /// Pages in the pool (`host_pages`).
    pub(crate) fn capacity_pages(&self) -> usize {
        self.cfg.host_pages
    }

    /// Pages free now (exact when no operation is in flight; a snapshot otherwise).
    pub fn available_pages(&self) -> usize {
        self.pages.available()
    }

    /// Whether `page` is allocated now (a snapshot under concurrency).
    pub fn is_allocated(&self, page: u32) -> bool {
        self.pages.is_allocated(page)
    }

    /// The page allocator itself, for the host tier that owns the pool (it allocates
    /// and frees through it, past the ownership check of the public calls).
    pub(crate) fn page_allocator(&self) -> &SlotPool {
        &self.pages
    }

    /// Whether a host tier owns the pool now (a live
    /// [`HiRadixCache::with_host_pool`](crate::radix::HiRadixCache::with_host_pool)
    /// cache): its pages are allocated and freed by that cache alone, and
    /// [`alloc_pages`](Self::alloc_pages) / [`free_pages`](Self::free_pages) are refused.
    pub fn is_owned(&self) -> bool {
        self.users.load(Ordering::Acquire) & OWNED != 0
    }

    /// Enter a public allocation call: `None` while a host tier owns the pool. While a
    /// tier is claiming it (a cache being built over it: one pass over its pages), the
    /// call waits for the outcome: refused if the claim succeeds, let in if it fails.
    fn public_call(&self) -> Option<PublicCall<'_>> {
        let mut s = self.users.load(Ordering::Acquire);
        let mut spins = 0u32;
        loop {
            if s & OWNED != 0 {
                return None;
            }
            if s & CLAIMING != 0 {
                backoff(&mut spins);
                s = self.users.load(Ordering::Acquire);
                continue;
            }
            match self.users.compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Some(PublicCall(&self.users)),
                Err(now) => s = now,
            }
        }
    }

    /// Make `pool` the host tier's: every page free, no other tier owning it. Public
    /// allocation calls are refused from here on (those in progress are waited for),
    /// until the claim is dropped.
    ///
    /// # Errors
    ///
    /// [`ConfigError::HostPool`] when another live cache owns the pool or some of its
    /// pages are allocated; nothing changed then.
    pub(crate) fn claim(pool: &Arc<HostKvPool>) -> Result<HostPoolClaim, ConfigError> {
        let mut s = pool.users.load(Ordering::Acquire);
        let mut spins = 0u32;
        loop {
            if s & OWNED != 0 {
                return Err(ConfigError::HostPool { why: "another live cache owns it" });
            }
            if s & CLAIMING != 0 {
                // Another cache is claiming it: its outcome decides this one's.
                backoff(&mut spins);
                s = pool.users.load(Ordering::Acquire);
                continue;
            }
            match pool.users.compare_exchange_weak(s, s | CLAIMING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        // Public calls that entered before the flag was set end soon (lock-free, no
        // blocking): wait for them, so the check below sees their pages. New ones wait
        // for the outcome.
        while pool.users.load(Ordering::Acquire) & !CLAIMING != 0 {
            backoff(&mut spins);
        }
        if pool.available_pages() != pool.capacity_pages() {
            // Release: nothing changed; the waiting calls go on.
            pool.users.fetch_and(!CLAIMING, Ordering::Release);
            return Err(ConfigError::HostPool { why: "some of its pages are allocated already" });
        }
        // No public call is in progress or can enter: the word is exactly CLAIMING.
        pool.users.store(OWNED, Ordering::Release);
        Ok(HostPoolClaim { pool: Arc::clone(pool) })
    }

    /// Allocate `out.len()` pages into `out`, all or nothing; lock-free (but while a
    /// host tier is being built over the pool, it waits for that claim's outcome), no heap
    /// allocation. Single-threaded, a fresh pool hands out the lowest free pages,
    /// ascending.
    ///
    /// # Errors
    ///
    /// [`AllocError::OutOfMemory`] (in [`Unit::Pages`]) when fewer pages are free;
    /// [`InvalidInput::HostPoolOwned`] while a host tier owns the pool
    /// ([`is_owned`](Self::is_owned)): its cache allocates the pages. `out` is
    /// untouched and nothing changed.
    pub fn alloc_pages(&self, out: &mut [u32]) -> Result<(), AllocError> {
        let Some(_call) = self.public_call() else {
            return Err(AllocError::Invalid(InvalidInput::HostPoolOwned));
        };
        self.pages.alloc_as(out, Unit::Pages).map_err(AllocError::from)
    }

    /// Free `pages`; lock-free (waiting, as [`alloc_pages`](Self::alloc_pages) does,
    /// while a host tier is being built over the pool), no heap allocation.
    ///
    /// # Errors
    ///
    /// [`FreeError`] for a page that is out of range or not allocated (a double free):
    /// the whole batch is refused and nothing changes; so is a batch that names a page
    /// twice, as [`SlotPool::free`] does.
    /// While a host tier owns the pool ([`is_owned`](Self::is_owned)) every allocated
    /// page is its cache's, so a non-empty batch is refused whole: its first page is
    /// reported ([`FreeErrorKind::Cached`] when it is allocated).
    pub fn free_pages(&self, pages: &[u32]) -> Result<(), FreeError> {
        let Some(_call) = self.public_call() else {
            let Some(&page) = pages.first() else { return Ok(()) };
            let kind = if page == 0 || page as usize > self.cfg.host_pages {
                FreeErrorKind::OutOfRange { first: 1, last: self.cfg.host_pages as u32 }
            } else if self.pages.is_allocated(page) {
                FreeErrorKind::Cached
            } else {
                FreeErrorKind::NotAllocated
            };
            return Err(FreeError { index: page, kind, rest_freed: false });
        };
        self.pages.free(pages)
    }

    /// Check host page `page`: in range and allocated.
    ///
    /// # Errors
    ///
    /// [`HostKvError::HostPage`].
    pub fn check_page(&self, page: u32) -> Result<(), HostKvError> {
        if page == 0 || page as usize > self.cfg.host_pages {
            return Err(HostKvError::HostPage { page, fault: HostPageFault::OutOfRange });
        }
        if !self.pages.is_allocated(page) {
            return Err(HostKvError::HostPage { page, fault: HostPageFault::NotAllocated });
        }
        Ok(())
    }

    /// Check a transfer's page lists: equal lengths, device pages in
    /// `1..=device_pages`, host pages allocated. Allocates nothing.
    ///
    /// # Errors
    ///
    /// [`HostKvError::Shape`], [`HostKvError::DevicePage`], [`HostKvError::HostPage`].
    pub fn check_pairs(&self, device_pages: &[u32], host_pages: &[u32]) -> Result<(), HostKvError> {
        if device_pages.len() != host_pages.len() {
            return Err(HostKvError::Shape { what: "host_pages", got: host_pages.len(), expected: device_pages.len() });
        }
        let max = self.cfg.device_pages();
        if let Some(&page) = device_pages.iter().find(|&&d| d == 0 || d as usize > max) {
            return Err(HostKvError::DevicePage { page, pages: max });
        }
        host_pages.iter().try_for_each(|&h| self.check_page(h))
    }

    /// Check a layer range against the model's layers.
    ///
    /// # Errors
    ///
    /// [`HostKvError::Layers`].
    pub fn check_layers(&self, layers: &Range<u32>) -> Result<(), HostKvError> {
        let layer_num = self.cfg.kv.layer_num;
        if layers.start > layers.end || layers.end > layer_num {
            return Err(HostKvError::Layers { start: layers.start, end: layers.end, layer_num });
        }
        Ok(())
    }

    /// The whole pool's bytes ([`HostKvConfig::total_bytes`], laid out as the module
    /// docs say).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes owned by the arena for the pool's life;
        // writers need `&mut self` (or the GPU transfers' `unsafe` contract).
        unsafe { core::slice::from_raw_parts(self.arena.ptr.as_ptr(), self.arena.len) }
    }

    /// The whole pool's bytes, writable (e.g. to restore a pool from disk).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `as_bytes`, and `&mut self` makes this the only access.
        unsafe { core::slice::from_raw_parts_mut(self.arena.ptr.as_ptr(), self.arena.len) }
    }

    /// The `page_size` rows of allocated page `page`, layer `layer`, buffer `buffer`
    /// (0 = K, 1 = V; 0 for MLA): [`HostKvConfig::chunk_bytes`] bytes.
    ///
    /// # Errors
    ///
    /// [`HostKvError::HostPage`] for a page out of range or not allocated;
    /// [`HostKvError::Shape`] for a layer or buffer out of range.
    pub fn page_rows(&self, page: u32, layer: u32, buffer: u32) -> Result<&[u8], HostKvError> {
        let at = self.chunk_at(page, layer, buffer)?;
        Ok(&self.as_bytes()[at..at + self.cfg.chunk_bytes()])
    }

    /// As [`page_rows`](Self::page_rows), writable.
    ///
    /// # Errors
    ///
    /// As [`page_rows`](Self::page_rows).
    pub fn page_rows_mut(&mut self, page: u32, layer: u32, buffer: u32) -> Result<&mut [u8], HostKvError> {
        let at = self.chunk_at(page, layer, buffer)?;
        let n = self.cfg.chunk_bytes();
        Ok(&mut self.as_bytes_mut()[at..at + n])
    }

    /// The bytes of allocated page `page` in page-first order (every layer buffer's
    /// [`chunk_bytes`](HostKvConfig::chunk_bytes), buffer `l * B + b` at
    /// `(l * B + b) * chunk_bytes`; [`HostKvConfig::page_bytes`] in all), as the slices
    /// of the pool that hold them, in that order: one slice (the whole page) in
    /// [`HostLayout::PageFirst`], `layer_num * buffers` slices in
    /// [`HostLayout::LayerFirst`]. Writing them one after another serializes the page
    /// without a staging copy (the shared store tier does this).
    ///
    /// # Errors
    ///
    /// [`HostKvError::HostPage`] for a page out of range or not allocated.
    pub fn page_chunks(&self, page: u32) -> Result<PageChunks<'_>, HostKvError> {
        self.check_page(page)?;
        let (start, stride, len, count) = self.page_geometry(page);
        Ok(PageChunks { bytes: self.as_bytes(), next: start, stride, len, left: count })
    }

    /// Copy allocated page `page` into `out` in page-first order (see
    /// [`page_chunks`](Self::page_chunks)): a gather in [`HostLayout::LayerFirst`], one
    /// copy in [`HostLayout::PageFirst`].
    ///
    /// # Errors
    ///
    /// [`HostKvError::HostPage`]; [`HostKvError::Shape`] when `out` is not
    /// [`HostKvConfig::page_bytes`] long. `out` is untouched then.
    pub fn read_page(&self, page: u32, out: &mut [u8]) -> Result<(), HostKvError> {
        self.check_page_buffer(out.len())?;
        let mut at = 0;
        for chunk in self.page_chunks(page)? {
            out[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
        }
        Ok(())
    }

    /// Overwrite allocated page `page` with `src`, given in page-first order (see
    /// [`page_chunks`](Self::page_chunks)): a scatter in [`HostLayout::LayerFirst`],
    /// one copy in [`HostLayout::PageFirst`]. Only that page's bytes change.
    ///
    /// # Errors
    ///
    /// [`HostKvError::HostPage`]; [`HostKvError::Shape`] when `src` is not
    /// [`HostKvConfig::page_bytes`] long. Nothing is written then.
    pub fn write_page(&mut self, page: u32, src: &[u8]) -> Result<(), HostKvError> {
        self.check_page_buffer(src.len())?;
        self.check_page(page)?;
        let (mut at, stride, len, count) = self.page_geometry(page);
        let bytes = self.as_bytes_mut();
        for piece in src.chunks_exact(len).take(count) {
            bytes[at..at + len].copy_from_slice(piece);
            at += stride;
        }
        Ok(())
    }

    fn check_page_buffer(&self, len: usize) -> Result<(), HostKvError> {
        let expected = self.cfg.page_bytes();
        if len != expected {
            return Err(HostKvError::Shape { what: "page buffer", got: len, expected });
        }
        Ok(())
    }

    /// `(first byte, stride, length, count)` of the contiguous pieces of page `page`
    /// in page-first order.
    fn page_geometry(&self, page: u32) -> (usize, usize, usize, usize) {
        let (page_stride, lb_stride) = self.cfg.strides();
        match self.cfg.layout {
            HostLayout::PageFirst => (page as usize * page_stride, 0, self.cfg.page_bytes(), 1),
            HostLayout::LayerFirst => (
                page as usize * page_stride,
                lb_stride,
                self.cfg.chunk_bytes(),
                self.cfg.kv.layer_num as usize * self.cfg.buffers(),
            ),
        }
    }

    fn chunk_at(&self, page: u32, layer: u32, buffer: u32) -> Result<usize, HostKvError> {
        self.check_page(page)?;
        if layer >= self.cfg.kv.layer_num {
            return Err(HostKvError::Shape {
                what: "layer",
                got: layer as usize,
                expected: self.cfg.kv.layer_num as usize,
            });
        }
        self.cfg.offset(page, layer, buffer, 0).ok_or(HostKvError::Shape {
            what: "buffer",
            got: buffer as usize,
            expected: self.cfg.buffers(),
        })
    }

    /// Check a host model of the device buffers: `layer_num * buffers` buffers (index
    /// `layer * buffers + buffer`), each `rows * row_bytes` bytes.
    fn check_device<T: AsRef<[u8]>>(&self, device: &[T]) -> Result<(), HostKvError> {
        let kv = &self.cfg.kv;
        let n = kv.layer_num as usize * self.cfg.buffers();
        if device.len() != n {
            return Err(HostKvError::Shape { what: "device buffers", got: device.len(), expected: n });
        }
        if let Some(b) = device.iter().find(|b| b.as_ref().len() != kv.layer_bytes()) {
            return Err(HostKvError::Shape {
                what: "device buffer",
                got: b.as_ref().len(),
                expected: kv.layer_bytes(),
            });
        }
        Ok(())
    }

    /// The host reference of `host_backup_*`: for every `i`, device page
    /// `device_pages[i]` of every layer and buffer is copied to host page
    /// `host_pages[i]`.
    ///
    /// `device` models the device's KV buffers as in
    /// [`reference`](super::reference): one byte slice per layer buffer, index `layer *
    /// buffers + buffer` (K0, V0, K1, V1, ... for MHA), each `rows() * row_bytes()`
    /// bytes. Two pairs naming one host page leave the later pair's bytes here and
    /// either's on the GPU: give each its own.
    ///
    /// # Errors
    ///
    /// [`HostKvError::Shape`] for the buffers or unequal lists,
    /// [`HostKvError::DevicePage`] for a device page 0 or past the pool,
    /// [`HostKvError::HostPage`] for a host page out of range or not allocated;
    /// nothing is written then.
    pub fn backup(&mut self, device: &[&[u8]], device_pages: &[u32], host_pages: &[u32]) -> Result<(), HostKvError> {
        self.check_device(device)?;
        self.check_pairs(device_pages, host_pages)?;
        let chunk = self.cfg.chunk_bytes();
        let (page_stride, lb_stride) = self.cfg.strides();
        let bytes = self.as_bytes_mut();
        for (&d, &h) in device_pages.iter().zip(host_pages) {
            for (lb, buf) in device.iter().enumerate() {
                let src = &buf[d as usize * chunk..][..chunk];
                bytes[h as usize * page_stride + lb * lb_stride..][..chunk].copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// The host reference of `host_load_*`: for every `i` and every layer in `layers`
    /// (both buffers), host page `host_pages[i]` is copied to device page
    /// `device_pages[i]`. Other layers are not touched. `device` is as in
    /// [`backup`](Self::backup).
    ///
    /// # Errors
    ///
    /// As [`backup`](Self::backup), and [`HostKvError::Layers`] for a range past the
    /// last layer; nothing is written then.
    pub fn load(
        &self,
        device: &mut [&mut [u8]],
        host_pages: &[u32],
        device_pages: &[u32],
        layers: Range<u32>,
    ) -> Result<(), HostKvError> {
        self.check_device(device)?;
        self.check_pairs(device_pages, host_pages)?;
        self.check_layers(&layers)?;
        let chunk = self.cfg.chunk_bytes();
        let (page_stride, lb_stride) = self.cfg.strides();
        let b = self.cfg.buffers();
        let bytes = self.as_bytes();
        let lbs = layers.start as usize * b..layers.end as usize * b;
        for (&h, &d) in host_pages.iter().zip(device_pages) {
            for lb in lbs.clone() {
                let src = &bytes[h as usize * page_stride + lb * lb_stride..][..chunk];
                device[lb][d as usize * chunk..][..chunk].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// A public allocation call in progress ([`HostKvPool::public_call`]); ends on drop.
struct PublicCall<'a>(&'a AtomicU64);

impl Drop for PublicCall<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Spin, yielding the thread every 64 rounds (a wait of a cache construction's length).
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins % 64 == 0 {
        std::thread::yield_now();
    } else {
        core::hint::spin_loop();
    }
}

/// A host tier's ownership of its [`HostKvPool`] ([`HostKvPool::claim`]): while it
/// lives the public `alloc_pages` / `free_pages` are refused, and no other tier can
/// claim the pool. Dropping it gives the pool back (the tier returns its pages first).
#[derive(Debug)]
pub(crate) struct HostPoolClaim {
    pool: Arc<HostKvPool>,
}

impl HostPoolClaim {
    /// Free every allocated page of the pool except those whose bit is set in `keep`
    /// (bit `h - 1` for page `h`; missing words keep nothing). Every allocated page is
    /// the owner's. Returns the pages freed. Not a request path: one pass over the
    /// pool's pages.
    pub(crate) fn free_all_except(&self, keep: &[u64]) -> usize {
        let pages = &self.pool.pages;
        let kept = |h: u32| {
            let i = h as usize - 1;
            keep.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 != 0)
        };
        let mut group = pages.free_group();
        for h in 1..=self.pool.cfg.host_pages as u32 {
            if pages.is_allocated(h) && !kept(h) {
                let r = group.free_range(h, 1);
                debug_assert!(r.is_ok(), "the owner frees its own pages: {r:?}");
            }
        }
        group.end()
    }
}

impl Drop for HostPoolClaim {
    fn drop(&mut self) {
        // Release: the owner's last frees happen before a later claim or public call
        // (Acquire) sees the pool unowned.
        self.pool.users.fetch_and(!OWNED, Ordering::Release);
    }
}

/// The pieces of one host page in page-first order ([`HostKvPool::page_chunks`]).
#[derive(Clone, Debug)]
pub struct PageChunks<'a> {
    bytes: &'a [u8],
    next: usize,
    stride: usize,
    len: usize,
    left: usize,
}

impl<'a> Iterator for PageChunks<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let at = self.next;
        self.next += self.stride;
        Some(&self.bytes[at..at + self.len])
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for PageChunks<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvLayout};

    fn mha(layers: u32, size: usize, ps: u32) -> KvConfig {
        KvConfig {
            layout: KvLayout::Mha { head_num: 1, head_dim: 4 },
            dtype: KvDtype::F16,
            layer_num: layers,
            size,
            page_size: ps,
        }
    }

    fn mla(layers: u32, size: usize, ps: u32) -> KvConfig {
        KvConfig {
            layout: KvLayout::Mla { kv_lora_rank: 3, qk_rope_head_dim: 2 },
            dtype: KvDtype::Fp8E4m3,
            layer_num: layers,
            size,
            page_size: ps,
        }
    }

    /// Every offset by the brief's formulas, written out once more as plain arithmetic.
    #[test]
    fn offsets_follow_the_fixed_formulas() {
        for kv in [mha(3, 12, 4), mla(2, 9, 3)] {
            for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                let cfg = HostKvConfig { kv, host_pages: 5, layout };
                cfg.validate().unwrap();
                let (l_n, b_n, ps, r, h) =
                    (kv.layer_num as usize, kv.layout.buffers(), kv.page_size as usize, kv.row_bytes(), 5usize);
                assert_eq!(cfg.total_bytes(), (h + 1) * ps * l_n * b_n * r);
                let mut seen = vec![false; cfg.total_bytes() / r];
                for p in 0..=h {
                    for l in 0..l_n {
                        for b in 0..b_n {
                            for k in 0..ps {
                                let want = match layout {
                                    HostLayout::LayerFirst => ((l * b_n + b) * (h + 1) * ps + p * ps + k) * r,
                                    HostLayout::PageFirst => (((p * l_n + l) * b_n + b) * ps + k) * r,
                                };
                                let got = cfg.offset(p as u32, l as u32, b as u32, k as u32).unwrap();
                                assert_eq!(got, want, "{layout:?} p{p} l{l} b{b} k{k}");
                                assert!(!seen[got / r], "two rows at one offset");
                                seen[got / r] = true;
                            }
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s), "every row of the pool is some (page, layer, buffer, token)");
                assert_eq!(cfg.offset(h as u32 + 1, 0, 0, 0), None);
                assert_eq!(cfg.offset(1, l_n as u32, 0, 0), None);
                assert_eq!(cfg.offset(1, 0, b_n as u32, 0), None);
                assert_eq!(cfg.offset(1, 0, 0, ps as u32), None);
            }
        }
        // Page-first pages are contiguous: page p spans [p * page_bytes, (p+1) * page_bytes).
        let cfg = HostKvConfig { kv: mha(3, 12, 4), host_pages: 5, layout: HostLayout::PageFirst };
        assert_eq!(cfg.offset(2, 0, 0, 0), Some(2 * cfg.page_bytes()));
        assert_eq!(cfg.offset(2, 2, 1, 3).unwrap() + cfg.kv.row_bytes(), 3 * cfg.page_bytes());
    }

    #[test]
    fn validation_errors_are_typed() {
        let kv = mha(2, 64, 4);
        let ok = HostKvConfig { kv, host_pages: 10, layout: HostLayout::LayerFirst };
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(HostKvConfig { host_pages: 0, ..ok }.validate(), Err(ConfigError::Zero("host_pages")));
        assert!(matches!(
            HostKvConfig { host_pages: u32::MAX as usize, ..ok }.validate(),
            Err(ConfigError::TooLarge { .. })
        ));
        assert_eq!(
            HostKvConfig { kv: KvConfig { page_size: 0, ..kv }, ..ok }.validate(),
            Err(ConfigError::ZeroPageSize)
        );
        // Rows of 2^20 bytes in pages of 4096 tokens: a 4 GiB chunk.
        let wide =
            KvConfig { layout: KvLayout::Mha { head_num: 1 << 19, head_dim: 1 }, page_size: 4096, size: 4096, ..kv };
        assert!(matches!(HostKvConfig { kv: wide, ..ok }.validate(), Err(ConfigError::TooLarge { .. })));
        // Fine per chunk, but the pool overflows isize.
        let big = HostKvConfig { kv: KvConfig { layer_num: u32::MAX, ..kv }, host_pages: u32::MAX as usize - 1, ..ok };
        assert!(matches!(big.validate(), Err(ConfigError::TooLargeForMemory { .. })));
    }

    /// `offset` is documented to give `None` for what it cannot answer, but on a
    /// configuration `validate` refuses (`host_pages: usize::MAX`, public fields) it
    /// panicked with an overflow in `strides()`; `total_bytes` / `page_bytes` overflowed
    /// the same way. Now: `None` from `offset`, `usize::MAX` (never a real size) from
    /// the byte counts.
    #[test]
    fn sizes_of_an_unvalidated_config_do_not_overflow() {
        let huge = HostKvConfig { kv: mha(2, 16, 2), host_pages: usize::MAX, layout: HostLayout::LayerFirst };
        assert!(huge.validate().is_err());
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let cfg = HostKvConfig { layout, ..huge };
            assert_eq!(cfg.offset(0, 0, 0, 0), None);
            assert_eq!(cfg.offset(1, 1, 1, 1), None);
            assert_eq!(cfg.total_bytes(), usize::MAX);
            assert_eq!(cfg.chunk_bytes(), 2 * 8); // fine on its own
        }
        assert_eq!(huge.strides(), (usize::MAX, usize::MAX));
        let wide = KvConfig { layout: KvLayout::Mha { head_num: u32::MAX, head_dim: u32::MAX }, ..mha(2, 16, 2) };
        let cfg = HostKvConfig { kv: KvConfig { layer_num: u32::MAX, page_size: u32::MAX, ..wide }, ..huge };
        assert_eq!((cfg.chunk_bytes(), cfg.page_bytes(), cfg.total_bytes()), (usize::MAX, usize::MAX, usize::MAX));
        assert_eq!(cfg.offset(0, 0, 0, 0), None);
        // A validated configuration is unchanged: the largest offset plus a row is the
        // pool's size.
        let ok = HostKvConfig { host_pages: 5, ..huge };
        let last = ok.offset(5, 1, 1, 1).unwrap() + ok.kv.row_bytes();
        assert_eq!(last, ok.total_bytes());
    }

    /// While a host tier owns the pool, the public page calls are refused and nothing
    /// changes; a second claim is refused; dropping the claim gives the pool back.
    #[test]
    fn an_owned_pool_refuses_allocation_by_number() {
        let cfg = HostKvConfig { kv: mha(1, 16, 4), host_pages: 5, layout: HostLayout::PageFirst };
        let pool = Arc::new(HostKvPool::pageable(cfg).unwrap());
        pool.alloc_pages(&mut [0u32; 1]).unwrap();
        assert!(matches!(HostKvPool::claim(&pool), Err(ConfigError::HostPool { .. })), "a page is allocated");
        assert!(!pool.is_owned(), "a refused claim leaves the pool unowned");
        pool.free_pages(&[1]).unwrap();
        let claim = HostKvPool::claim(&pool).unwrap();
        assert!(pool.is_owned());
        assert!(matches!(HostKvPool::claim(&pool), Err(ConfigError::HostPool { .. })), "one owner");
        assert_eq!(pool.alloc_pages(&mut [0u32; 1]), Err(AllocError::Invalid(InvalidInput::HostPoolOwned)));
        let mut got = [0u32; 2];
        pool.page_allocator().alloc_as(&mut got, Unit::Pages).unwrap(); // the owner's own path
        assert_eq!(pool.free_pages(&got).unwrap_err().kind, FreeErrorKind::Cached);
        assert_eq!(pool.available_pages(), 3);
        // The owner returns its pages but those it keeps (page 2 here), then lets go.
        assert_eq!(claim.free_all_except(&[0b10]), 1);
        drop(claim);
        assert!(!pool.is_owned());
        assert!(pool.is_allocated(2) && !pool.is_allocated(1));
        pool.free_pages(&[2]).unwrap();
        assert_eq!(pool.available_pages(), 5);
    }

    #[test]
    fn ratio_constructor() {
        let kv = mha(2, 100, 8); // 12 device pages
        let c = HostKvConfig::with_ratio(kv, DEFAULT_HOST_TO_DEVICE_RATIO, HostLayout::PageFirst).unwrap();
        assert_eq!((c.device_pages(), c.host_pages), (12, 24));
        assert_eq!(HostKvConfig::with_ratio(kv, 0.5, HostLayout::LayerFirst).unwrap().host_pages, 6);
        assert_eq!(HostKvConfig::with_ratio(kv, 0.26, HostLayout::LayerFirst).unwrap().host_pages, 3);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                HostKvConfig::with_ratio(kv, bad, HostLayout::LayerFirst),
                Err(ConfigError::Zero("host_to_device_ratio")),
                "{bad}"
            );
        }
        assert_eq!(HostKvConfig::with_ratio(kv, 0.01, HostLayout::LayerFirst), Err(ConfigError::Zero("host_pages")));
        assert!(matches!(
            HostKvConfig::with_ratio(kv, 1e12, HostLayout::LayerFirst),
            Err(ConfigError::TooLarge { .. })
        ));
        assert_eq!(
            HostKvConfig::with_ratio(KvConfig { layer_num: 0, ..kv }, 2.0, HostLayout::LayerFirst),
            Err(ConfigError::Zero("layer_num"))
        );
    }

    #[test]
    fn allocation_is_all_or_nothing_and_frees_are_checked() {
        let cfg = HostKvConfig { kv: mha(1, 16, 4), host_pages: 5, layout: HostLayout::LayerFirst };
        let pool = HostKvPool::pageable(cfg).unwrap();
        assert_eq!((pool.capacity_pages(), pool.available_pages()), (5, 5));
        assert_eq!(pool.memory(), HostMemory::Pageable);
        let mut a = [0u32; 3];
        pool.alloc_pages(&mut a).unwrap();
        assert_eq!(a, [1, 2, 3]);
        let mut b = [7u32; 3];
        let e = pool.alloc_pages(&mut b).unwrap_err();
        let oom = e.out_of_memory().unwrap();
        assert_eq!((oom.requested, oom.available, oom.unit), (3, 2, Unit::Pages));
        assert_eq!(b, [7; 3], "out untouched");
        assert_eq!(pool.available_pages(), 2);
        pool.alloc_pages(&mut b[..2]).unwrap();
        assert_eq!(pool.available_pages(), 0);
        pool.free_pages(&[2]).unwrap();
        let e = pool.free_pages(&[1, 2]).unwrap_err();
        assert_eq!((e.index, e.kind, e.rest_freed), (2, FreeErrorKind::NotAllocated, false));
        assert!(pool.is_allocated(1), "nothing changed on error");
        let e = pool.free_pages(&[6]).unwrap_err();
        assert!(matches!(e.kind, FreeErrorKind::OutOfRange { first: 1, last: 5 }));
        let e = pool.free_pages(&[0]).unwrap_err();
        assert!(matches!(e.kind, FreeErrorKind::OutOfRange { .. }));
        assert_eq!(pool.available_pages(), 1);
        pool.free_pages(&[1, 3, 4, 5]).unwrap();
        assert_eq!(pool.available_pages(), 5);
    }

    /// A host model of the device buffers, every byte distinct-ish and nonzero.
    fn device_model(kv: &KvConfig, seed: u8) -> Vec<Vec<u8>> {
        let n = kv.layer_num as usize * kv.layout.buffers();
        (0..n)
            .map(|lb| (0..kv.layer_bytes()).map(|i| (i as u8).wrapping_mul(31) ^ (lb as u8 * 17) ^ seed | 1).collect())
            .collect()
    }

    fn refs(d: &[Vec<u8>]) -> Vec<&[u8]> {
        d.iter().map(|b| &b[..]).collect()
    }

    fn muts(d: &mut [Vec<u8>]) -> Vec<&mut [u8]> {
        d.iter_mut().map(|b| &mut b[..]).collect()
    }

    #[test]
    fn backup_then_load_round_trips_every_layer() {
        for kv in [mha(3, 40, 4), mla(2, 27, 3)] {
            for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                let cfg = HostKvConfig { kv, host_pages: 6, layout };
                let mut pool = HostKvPool::pageable(cfg).unwrap();
                let mut hp = [0u32; 3];
                pool.alloc_pages(&mut hp).unwrap();
                let src = device_model(&kv, 3);
                let dev_pages = [5u32, 1, 8];
                pool.backup(&refs(&src), &dev_pages, &hp).unwrap();
                // Each host chunk holds its device page's rows.
                let chunk = cfg.chunk_bytes();
                for (&d, &h) in dev_pages.iter().zip(&hp) {
                    for l in 0..kv.layer_num {
                        for b in 0..cfg.buffers() as u32 {
                            let lb = (l as usize) * cfg.buffers() + b as usize;
                            assert_eq!(pool.page_rows(h, l, b).unwrap(), &src[lb][d as usize * chunk..][..chunk]);
                        }
                    }
                }
                // Load into other device pages of a fresh model: exactly those pages change.
                let mut dst = device_model(&kv, 200);
                let before = dst.clone();
                let to = [2u32, 9, 4];
                pool.load(&mut muts(&mut dst), &hp, &to, 0..kv.layer_num).unwrap();
                for lb in 0..dst.len() {
                    for page in 0..kv.rows() / kv.page_size as usize {
                        let got = &dst[lb][page * chunk..][..chunk];
                        match to.iter().position(|&t| t as usize == page) {
                            Some(i) => assert_eq!(got, &src[lb][dev_pages[i] as usize * chunk..][..chunk]),
                            None => assert_eq!(got, &before[lb][page * chunk..][..chunk]),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn load_of_some_layers_writes_only_those() {
        let kv = mha(4, 32, 4);
        let cfg = HostKvConfig { kv, host_pages: 4, layout: HostLayout::LayerFirst };
        let mut pool = HostKvPool::pageable(cfg).unwrap();
        let mut hp = [0u32; 2];
        pool.alloc_pages(&mut hp).unwrap();
        let src = device_model(&kv, 9);
        pool.backup(&refs(&src), &[1, 2], &hp).unwrap();
        let mut dst = device_model(&kv, 77);
        let before = dst.clone();
        pool.load(&mut muts(&mut dst), &hp, &[3, 4], 1..3).unwrap();
        let chunk = cfg.chunk_bytes();
        for (lb, (got, old)) in dst.iter().zip(&before).enumerate() {
            let layer = lb / 2;
            if (1..3).contains(&layer) {
                assert_eq!(&got[3 * chunk..4 * chunk], &src[lb][chunk..2 * chunk]);
                assert_eq!(&got[4 * chunk..5 * chunk], &src[lb][2 * chunk..3 * chunk]);
                assert_eq!(&got[..3 * chunk], &old[..3 * chunk]);
            } else {
                assert_eq!(got, old, "layer {layer} was written");
            }
        }
        // An empty range writes nothing and is fine.
        pool.load(&mut muts(&mut dst), &hp, &[3, 4], 2..2).unwrap();
    }

    #[test]
    fn bad_transfers_are_refused_before_anything_is_written() {
        let kv = mha(2, 16, 4); // device pages 1..=4
        let cfg = HostKvConfig { kv, host_pages: 3, layout: HostLayout::PageFirst };
        let mut pool = HostKvPool::pageable(cfg).unwrap();
        let mut hp = [0u32; 2];
        pool.alloc_pages(&mut hp).unwrap(); // 1, 2; page 3 free
        let src = device_model(&kv, 1);
        let snapshot = pool.as_bytes().to_vec();
        let cases: Vec<(&[u32], &[u32], HostKvError)> = vec![
            (&[1, 2], &[1], HostKvError::Shape { what: "host_pages", got: 1, expected: 2 }),
            (&[1, 0], &[1, 2], HostKvError::DevicePage { page: 0, pages: 4 }),
            (&[1, 5], &[1, 2], HostKvError::DevicePage { page: 5, pages: 4 }),
            (&[1, 2], &[1, 3], HostKvError::HostPage { page: 3, fault: HostPageFault::NotAllocated }),
            (&[1, 2], &[1, 4], HostKvError::HostPage { page: 4, fault: HostPageFault::OutOfRange }),
            (&[1, 2], &[0, 1], HostKvError::HostPage { page: 0, fault: HostPageFault::OutOfRange }),
        ];
        for (d, h, want) in &cases {
            assert_eq!(pool.backup(&refs(&src), d, h).unwrap_err(), *want);
        }
        assert_eq!(
            pool.backup(&refs(&src)[..3], &[1], &[1]).unwrap_err(),
            HostKvError::Shape { what: "device buffers", got: 3, expected: 4 }
        );
        let short: Vec<&[u8]> = src.iter().map(|b| &b[1..]).collect();
        assert!(matches!(pool.backup(&short, &[1], &[1]), Err(HostKvError::Shape { what: "device buffer", .. })));
        assert_eq!(pool.as_bytes(), &snapshot[..], "a refused backup wrote host bytes");

        let mut dst = device_model(&kv, 5);
        let before = dst.clone();
        for (d, h, want) in &cases {
            assert_eq!(pool.load(&mut muts(&mut dst), h, d, 0..2).unwrap_err(), *want);
        }
        for bad in [0..3, Range { start: 2, end: 1 }] {
            let (start, end) = (bad.start, bad.end);
            assert_eq!(
                pool.load(&mut muts(&mut dst), &hp, &[1, 2], bad).unwrap_err(),
                HostKvError::Layers { start, end, layer_num: 2 }
            );
        }
        assert_eq!(dst, before, "a refused load wrote device bytes");
        // A freed page is no longer anyone's: refused.
        pool.free_pages(&hp[1..]).unwrap();
        assert_eq!(
            pool.page_rows(hp[1], 0, 0).unwrap_err(),
            HostKvError::HostPage { page: hp[1], fault: HostPageFault::NotAllocated }
        );
        assert!(matches!(pool.page_rows(hp[0], 2, 0), Err(HostKvError::Shape { what: "layer", .. })));
        assert!(matches!(pool.page_rows(hp[0], 0, 2), Err(HostKvError::Shape { what: "buffer", .. })));
        assert!(!HostKvError::DevicePage { page: 9, pages: 4 }.to_string().is_empty());
    }

    #[test]
    fn page_rows_mut_writes_where_offset_says() {
        let kv = mla(3, 12, 2);
        let cfg = HostKvConfig { kv, host_pages: 4, layout: HostLayout::LayerFirst };
        let mut pool = HostKvPool::pageable(cfg).unwrap();
        let mut hp = [0u32; 4];
        pool.alloc_pages(&mut hp).unwrap();
        pool.page_rows_mut(3, 2, 0).unwrap().fill(0xab);
        let at = cfg.offset(3, 2, 0, 0).unwrap();
        let bytes = pool.as_bytes();
        assert!(bytes[at..at + cfg.chunk_bytes()].iter().all(|&b| b == 0xab));
        assert_eq!(bytes.iter().filter(|&&b| b != 0).count(), cfg.chunk_bytes());
    }

    /// `page_chunks`, `read_page` and `write_page` agree with `page_rows` (the offsets)
    /// in both layouts: page-first order is layer buffer `l * B + b` at
    /// `(l * B + b) * chunk_bytes`, and writing touches only the named page.
    #[test]
    fn whole_pages_move_in_page_first_order() {
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            for kv in [mha(3, 8, 2), mla(2, 12, 4)] {
                let cfg = HostKvConfig { kv, host_pages: 3, layout };
                let mut pool = HostKvPool::pageable(cfg).unwrap();
                let mut hp = [0u32; 2];
                pool.alloc_pages(&mut hp).unwrap();
                let src: Vec<u8> = (0..cfg.page_bytes()).map(|i| (i % 251) as u8 + 1).collect();
                pool.write_page(hp[1], &src).unwrap();
                let lbs = kv.layer_num * cfg.buffers() as u32;
                for lb in 0..lbs {
                    let (l, b) = (lb / cfg.buffers() as u32, lb % cfg.buffers() as u32);
                    let want = &src[lb as usize * cfg.chunk_bytes()..][..cfg.chunk_bytes()];
                    assert_eq!(pool.page_rows(hp[1], l, b).unwrap(), want, "{layout:?} layer {l} buffer {b}");
                    assert!(pool.page_rows(hp[0], l, b).unwrap().iter().all(|&x| x == 0));
                }
                let mut out = vec![0u8; cfg.page_bytes()];
                pool.read_page(hp[1], &mut out).unwrap();
                assert_eq!(out, src);
                assert_eq!(pool.page_chunks(hp[1]).unwrap().collect::<Vec<_>>().concat(), src);
                let pieces = if layout == HostLayout::PageFirst { 1 } else { lbs as usize };
                assert_eq!(pool.page_chunks(hp[1]).unwrap().len(), pieces);
                assert_eq!(pool.as_bytes().iter().filter(|&&x| x != 0).count(), cfg.page_bytes());
                // Refusals write nothing.
                assert!(matches!(pool.write_page(hp[0], &src[1..]), Err(HostKvError::Shape { .. })));
                let free = (1..=3).find(|p| !hp.contains(p)).unwrap();
                assert!(matches!(pool.write_page(free, &src), Err(HostKvError::HostPage { .. })));
                assert!(matches!(pool.read_page(0, &mut out), Err(HostKvError::HostPage { .. })));
                assert!(pool.page_chunks(free).is_err());
                assert_eq!(pool.as_bytes().iter().filter(|&&x| x != 0).count(), cfg.page_bytes());
            }
        }
    }
}
