//! Sliding-window (SWA) KV on the device: the mapped scatter of a model that
//! interleaves full-attention and sliding-window layers (Gemma 2/3, gpt-oss) in one
//! launch, and the device copy of the full-to-window slot mapping.
//!
//! * [`SwaKvCacheView`] — the two pools (full and window, each a [`KvCacheView`] of
//!   kvpool's or the caller's memory) seen as one model: a device table with one record
//!   per model layer (where its K and V buffers start, their rows, whether it is a
//!   window layer), so [`set_kv`](SwaKvCacheView::set_kv) writes the K and V rows of
//!   *every* layer with one launch of the generated `swa_scatter_v*` kernel;
//! * [`DeviceSwaKvCache`] — both pools in kvpool's own memory, plus such a view;
//! * [`DeviceSwaMap`] — the device copy of the mapping table (one `u32` per full slot,
//!   0 = no window slot; see [`kv::swa`](crate::kv::swa)), kept in sync with the host's
//!   table by explicit, stream-ordered uploads: the entries of given pages
//!   ([`upload_pages`](DeviceSwaMap::upload_pages): one pinned host-to-device copy and
//!   one `swa_map_update` launch per call) or a range of entries
//!   ([`upload_range`](DeviceSwaMap::upload_range): one copy).
//!
//! **The host table** is read through [`MappingTable`], implemented for the dual
//! allocator's table ([`SwaAllocator::window`](crate::alloc::SwaAllocator::window)),
//! `[AtomicU32]` and `[u32]` (atomic entries are read with `Acquire`). The device copy changes only when the host uploads: after the allocator
//! maps or unmaps pages, upload those pages on the stream the scatter runs on, before
//! the scatter. A scatter reads the table as it stands when it runs.
//!
//! This module loads its own PTX module (`swa`, generator
//! `kernels_build/src/swa.rs`) and is the only place that launches its kernels; the
//! launchers' parameter lists are checked against the PTX's when the module loads
//! ([`check_swa_signatures`], no GPU needed). The kernels check every row they write
//! against its buffer (an out-of-range slot or mapped slot is skipped and flagged:
//! [`take_error`](SwaKvCacheView::take_error)).

use core::ffi::c_void;
use core::mem::size_of;
use core::ops::{Deref, Range};

use bytemuck::{Pod, Zeroable};
use cust::function::Function;
use cust::memory::{CopyDestination, DeviceBuffer, DeviceSlice, LockedBuffer};
use cust::module::Module;
use cust::sys::cuMemcpyHtoDAsync_v2;

use super::cache::{extent, DeviceKvCache, KvCacheView, Rows};
use super::launch::{check, launch_raw};
use super::mamba::entry_params;
use super::stream::RawEvent;
use super::{CudaKvError, KvDevice, KvStream};
use crate::error::ConfigError;
use crate::kv::ptx::{module_for, ROWS_PER_BLOCK, ROW_BLOCK_THREADS};
use crate::kv::swa::{LayerKind, MappingTable, SwaKvConfig};
use crate::kv::KvError;

/// Vector widths of `swa_scatter_v*`, widest first (`kernels_build::swa::SWA_WIDTHS`).
const WIDTHS: [u32; 5] = [16, 8, 4, 2, 1];
/// Threads per block of `swa_map_update` (`SWA_MAP_THREADS`).
const MAP_THREADS: u32 = 256;
/// The `.param` types of `swa_scatter_v*`, in order.
const SCATTER_PARAMS: [&str; 11] = ["u64", "u64", "u64", "u64", "u64", "u64", "u32", "u64", "u32", "u32", "u64"];
/// The `.param` types of `swa_map_update`, in order.
const UPDATE_PARAMS: [&str; 5] = ["u64", "u32", "u32", "u64", "u32"];

/// One record of the kernel's layer table (`kernels_build::swa::SWA_LAYER_RECORD_BYTES`
/// = 24 bytes, no padding): where model layer `l`'s K and V buffers start, their rows,
/// and whether it is a window layer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct LayerRecord {
    k_dst: u64,
    v_dst: u64,
    rows: u32,
    window: u32,
}

const _: () = assert!(size_of::<LayerRecord>() == 24);

fn scatter_name(vec: u32) -> String {
    format!("swa_scatter_v{vec}")
}

/// Check, without a GPU, that every `swa` kernel of every target has exactly the
/// parameter list its launcher passes, and that the module holds nothing else.
///
/// # Errors
///
/// [`CudaKvError::MissingKernel`] or [`CudaKvError::KernelSignature`] (kvpool bugs).
pub fn check_swa_signatures() -> Result<(), CudaKvError> {
    for cc in [80, 90] {
        let m = module_for("swa", cc).ok_or_else(|| CudaKvError::MissingKernel("swa".into()))?;
        let kernels = WIDTHS.iter().map(|&w| (scatter_name(w), &SCATTER_PARAMS[..]));
        for (name, want) in kernels.chain([("swa_map_update".to_string(), &UPDATE_PARAMS[..])]) {
            let got = entry_params(m.ptx, &name).ok_or_else(|| CudaKvError::MissingKernel(name.clone()))?;
            if got != want {
                return Err(CudaKvError::KernelSignature { kernel: name, ptx: got.join(","), wrapper: want.join(",") });
            }
        }
        let entries = m.ptx.matches(".visible .entry ").count();
        if entries != WIDTHS.len() + 1 {
            return Err(CudaKvError::MissingKernel(format!("{entries} entries in {}, launchers for 6", m.path)));
        }
    }
    Ok(())
}

/// The loaded `swa` module of one device and its kernels.
struct SwaModule {
    // Before `_module`: the handles are dropped before their module is unloaded.
    scatter: Vec<(u32, Function<'static>)>,
    update: Function<'static>,
    _module: Module,
}

impl SwaModule {
    /// Load the `swa` module for the target `dev` loaded (into the current context, the
    /// device's primary context on the thread that opened it).
    fn load(dev: &KvDevice) -> Result<SwaModule, CudaKvError> {
        check_swa_signatures()?;
        let target = dev.ptx_target();
        let m = module_for("swa", target).ok_or(CudaKvError::UnsupportedDevice { compute_capability: target })?;
        let module = Module::from_ptx(m.ptx, &[])?;
        let get = |name: &str| -> Result<Function<'static>, CudaKvError> {
            let f = module.get_function(name)?;
            // SAFETY: `Function` is a `CUfunction` handle plus a lifetime marker; the
            // handle stays valid while its module is loaded. The module lives in the
            // returned struct, is never replaced, and is dropped after the handles
            // (field order); the handles are only used borrowed from `&self`.
            Ok(unsafe { core::mem::transmute::<Function<'_>, Function<'static>>(f) })
        };
        let scatter =
            WIDTHS.iter().map(|&w| Ok((w, get(&scatter_name(w))?))).collect::<Result<Vec<_>, CudaKvError>>()?;
        let update = get("swa_map_update")?;
        Ok(SwaModule { scatter, update, _module: module })
    }

    fn scatter(&self, vec: u32) -> Result<&Function<'static>, CudaKvError> {
        self.scatter
            .iter()
            .find(|(w, _)| *w == vec)
            .map(|(_, f)| f)
            .ok_or_else(|| CudaKvError::MissingKernel(scatter_name(vec)))
    }
}

/// An SWA model's KV buffers described for the mapped scatter: the full pool and the
/// window pool ([`KvCacheView`]s, in kvpool's memory or the caller's) and which model
/// layer lives where ([`SwaKvConfig`]).
///
/// It keeps, on the device, one record per model layer (its K and V addresses, its
/// rows, its kind), so one launch covers every layer wherever the layers lie; and one
/// flag word the kernel raises when it meets a row past a buffer.
pub struct SwaKvCacheView {
    cfg: SwaKvConfig,
    module: SwaModule,
    layers: DeviceBuffer<u8>,
    /// Every layer base or-ed together: its low bits bound the vector width.
    align: u64,
    err: DeviceBuffer<u32>,
}

impl core::fmt::Debug for SwaKvCacheView {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SwaKvCacheView").field("config", &self.cfg).finish()
    }
}

impl SwaKvCacheView {
    /// Describe an SWA model over two existing views: `full` must be the full pool
    /// (`cfg.full_config()`: one layer per full layer, in `cfg.layers.full_layers()`
    /// order) and `window` the window pool (`cfg.window_config()`). Only the views'
    /// layer addresses are kept; the views themselves may be dropped.
    ///
    /// # Safety
    ///
    /// The memory the two views describe outlives this view and every launch queued
    /// through it (the views' own contract, extended to this one), and nobody else
    /// writes the rows the scatter writes while it may run.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for an invalid `cfg`; [`CudaKvError::Kv`] when a view's
    /// configuration is not the pool `cfg` describes; [`CudaKvError::Cuda`] from the
    /// driver (loading the module, allocating the table).
    pub unsafe fn from_views(
        dev: &KvDevice,
        cfg: SwaKvConfig,
        full: &KvCacheView,
        window: &KvCacheView,
    ) -> Result<SwaKvCacheView, CudaKvError> {
        cfg.validate()?;
        if *full.config() != cfg.full_config() {
            return Err(KvError::Format { what: "the full view's configuration is not cfg.full_config()" }.into());
        }
        if *window.config() != cfg.window_config() {
            return Err(KvError::Format { what: "the window view's configuration is not cfg.window_config()" }.into());
        }
        let mut records = Vec::with_capacity(cfg.layers.num_layers() as usize);
        let mut align = 0u64;
        for layer in 0..cfg.layers.num_layers() {
            let (kind, j) = cfg.layers.layer(layer).expect("layer < num_layers");
            let view = if kind == LayerKind::Full { full } else { window };
            let k = view.k_layer(j)?.as_device_ptr().as_raw();
            let v = view.v_layer(j)?.ok_or(KvError::Format { what: "an SWA pool needs V buffers (MHA)" })?;
            let v = v.as_device_ptr().as_raw();
            align |= k | v;
            let rows = u32::try_from(view.rows()).map_err(|_| KvError::Shape {
                what: "rows",
                got: view.rows(),
                expected: u32::MAX as usize,
            })?;
            records.push(LayerRecord { k_dst: k, v_dst: v, rows, window: (kind == LayerKind::Window) as u32 });
        }
        let module = SwaModule::load(dev)?;
        let layers = DeviceBuffer::from_slice(bytemuck::cast_slice::<LayerRecord, u8>(&records))?;
        Ok(SwaKvCacheView { cfg, module, layers, align, err: DeviceBuffer::zeroed(1)? })
    }

    /// The configuration.
    pub fn config(&self) -> &SwaKvConfig {
        &self.cfg
    }

    /// SGLang's `SWAKVPool.set_kv_buffer` for every layer at once: token `i`'s K and V
    /// rows of model layer `l` (source element `l * layer_stride + i * row_stride` of `k`
    /// and `v`) go to row `slots[i]` of a full layer, and to row `map[slots[i]]` of a
    /// window layer, skipped when that entry is 0 (the token has no window slot). One
    /// launch on `on`; rows move with 16-byte accesses when the row size, the strides
    /// and every address allow, else the widest that fits.
    ///
    /// `slots` are full slots (distinct, except that padding tokens may share the
    /// dummy slot 0 if their rows are alike: two tokens writing one row leave either's
    /// bytes). `map` must be the device table of this model ([`DeviceSwaMap`] with
    /// `config().map_len()` entries), current for every slot of the batch.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the sources are too short or their strides differ, the
    /// element type is neither one byte nor the dtype's size, or the table's length is
    /// not `map_len()`; nothing is launched then. A slot past the full rows, or a mapped
    /// slot past the window rows, is skipped on the device and reported by
    /// [`take_error`](Self::take_error). [`CudaKvError::Cuda`] if the launch is refused.
    pub fn set_kv<'s, T: Pod>(
        &self,
        on: impl Into<KvStream<'s>>,
        map: &DeviceSwaMap,
        slots: &DeviceSlice<u32>,
        k: Rows<'_, T>,
        v: Rows<'_, T>,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        let t = size_of::<T>();
        if t != 1 && t != self.cfg.dtype.bytes() {
            return Err(KvError::Format { what: "the rows' element type does not match the cache dtype" }.into());
        }
        if map.len() != self.cfg.map_len() {
            return Err(KvError::Shape { what: "mapping table", got: map.len(), expected: self.cfg.map_len() }.into());
        }
        let n = u32::try_from(slots.len()).map_err(|_| KvError::Shape {
            what: "slots",
            got: slots.len(),
            expected: u32::MAX as usize,
        })?;
        let layers = self.cfg.layers.num_layers();
        let row = self.cfg.row_bytes();
        let (k, v) = (k.bytes()?, v.bytes()?);
        extent("k", k, slots.len(), layers as usize, row)?;
        extent("v", v, slots.len(), layers as usize, row)?;
        if k.2 != v.2 || k.3 != v.3 {
            return Err(KvError::Format { what: "K and V sources must share their strides" }.into());
        }
        if n == 0 {
            return Ok(());
        }
        let addrs = [k.0, v.0, k.2 as u64, k.3 as u64, self.align];
        let vec = WIDTHS
            .into_iter()
            .find(|&w| row % w as usize == 0 && addrs.iter().all(|&a| a % w as u64 == 0))
            .expect("width 1 divides everything");
        let f = self.module.scatter(vec)?;
        let (k_src, v_src, row_stride, layer_stride) = (k.0, v.0, k.2 as u64, k.3 as u64);
        let table = self.layers.as_device_ptr().as_raw();
        let (map_ptr, map_len) = (map.table.as_device_ptr().as_raw(), map.len() as u32);
        let slots_ptr = slots.as_device_ptr().as_raw();
        let vecs = (row / vec as usize) as u32;
        let err = self.err.as_device_ptr().as_raw();
        let mut args: [*mut c_void; 11] = [
            &k_src as *const u64 as *mut c_void,
            &v_src as *const u64 as *mut c_void,
            &row_stride as *const u64 as *mut c_void,
            &layer_stride as *const u64 as *mut c_void,
            &table as *const u64 as *mut c_void,
            &map_ptr as *const u64 as *mut c_void,
            &map_len as *const u32 as *mut c_void,
            &slots_ptr as *const u64 as *mut c_void,
            &n as *const u32 as *mut c_void,
            &vecs as *const u32 as *mut c_void,
            &err as *const u64 as *mut c_void,
        ];
        let grid = (n.div_ceil(ROWS_PER_BLOCK), layers, 2);
        // SAFETY: the argument values are, in order and type, the kernel's `.param`
        // list (u64 k_src, v_src, src_row_stride, src_layer_stride, layers, map; u32
        // map_len; u64 slots; u32 n_tokens, vecs; u64 err: checked against the PTX when
        // the module loaded). Block (x, y, z) has warps for tokens `< n` (the others
        // return), layer `y < num_layers` (the table holds `num_layers` records built
        // from the views, whose memory outlives this view by the constructor's
        // contract) and buffer `z < 2`. A warp reads source row `y * layer_stride + i *
        // row_stride` of `vecs * vec = row_bytes` bytes, inside the extents checked
        // above; it reads `slots[i]` (`n` entries), and for a window layer `map[slot]`
        // only after checking `slot < map_len` (the table's length, checked above); it
        // writes row `r` of its layer only after checking `r < rows` of that layer, so
        // every write lies in that layer's buffer. Every address and stride is a
        // multiple of `vec` (chosen above). `args` outlives the call. The host touches
        // none of these buffers before it synchronizes the stream.
        unsafe { launch_raw(f, grid, ROW_BLOCK_THREADS, on.raw(), &mut args) }
    }

    /// Wait for the stream and report whether any scatter since the last call met a
    /// slot past the full rows or a mapped slot past the window rows (those rows were
    /// skipped); clears the flag.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::DeviceSlotOutOfRange`], or [`CudaKvError::Cuda`] for an
    /// asynchronous fault.
    pub fn take_error<'s>(&self, on: impl Into<KvStream<'s>>) -> Result<(), CudaKvError> {
        on.into().synchronize()?;
        let mut word = [0u32];
        self.err.copy_to(&mut word[..])?;
        if word[0] == 0 {
            return Ok(());
        }
        let mut err = self.err.index(..);
        err.copy_from(&[0u32][..])?;
        Err(CudaKvError::DeviceSlotOutOfRange)
    }
}

/// An SWA model's KV cache in kvpool's own memory: a full pool and a window pool
/// ([`DeviceKvCache`]s, zeroed) and the [`SwaKvCacheView`] of both (every operation is
/// the view's, through `Deref`).
///
/// # Examples
///
/// ```no_run
/// use cust::memory::DeviceBuffer;
/// use kvpool::cuda::swa::{DeviceSwaKvCache, DeviceSwaMap};
/// use kvpool::cuda::{KvDevice, Rows};
/// use kvpool::kv::swa::{SwaKvConfig, SwaLayout};
/// use kvpool::kv::KvDtype;
///
/// let dev = KvDevice::new(0)?;
/// // gpt-oss-20b: 24 layers alternating, 8 KV heads of 64, bf16.
/// let cfg = SwaKvConfig { layers: SwaLayout::alternating(24)?, head_num: 8, head_dim: 64,
///     dtype: KvDtype::Bf16, full_size: 1 << 18, window_size: 1 << 15, page_size: 16 };
/// let cache = DeviceSwaKvCache::new(&dev, cfg.clone())?;
/// let mut map = DeviceSwaMap::new(&dev, &cfg, 1024)?;
/// // The allocator mapped full page 7 to window page 3: upload that page's entries.
/// let mut host = vec![0u32; cfg.map_len()];
/// for k in 0..16 { host[7 * 16 + k] = 3 * 16 + k as u32; }
/// map.upload_pages(&dev, &host[..], &[7])?;
/// // Prefill of 16 tokens at full slots 112..128: K and V of all 24 layers, one launch.
/// let slots = DeviceBuffer::from_slice(&(112..128).collect::<Vec<u32>>())?;
/// let row = cfg.row_bytes() / 2;                        // bf16 elements per row
/// let k = DeviceBuffer::<u16>::zeroed(24 * 16 * row)?;
/// let v = DeviceBuffer::<u16>::zeroed(24 * 16 * row)?;
/// cache.set_kv(&dev, &map, &slots, Rows::new(&k, row, 16 * row), Rows::new(&v, row, 16 * row))?;
/// cache.take_error(&dev)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceSwaKvCache {
    // First: the view goes before the memory it describes.
    view: SwaKvCacheView,
    full: DeviceKvCache,
    window: DeviceKvCache,
}

impl core::fmt::Debug for DeviceSwaKvCache {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceSwaKvCache").field("config", &self.view.cfg).finish()
    }
}

impl Deref for DeviceSwaKvCache {
    type Target = SwaKvCacheView;
    fn deref(&self) -> &SwaKvCacheView {
        &self.view
    }
}

impl DeviceSwaKvCache {
    /// Allocate both pools (zeroed) for `cfg` on `dev`'s context.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for an invalid configuration, [`CudaKvError::Cuda`] when
    /// the device is out of memory.
    pub fn new(dev: &KvDevice, cfg: SwaKvConfig) -> Result<DeviceSwaKvCache, CudaKvError> {
        cfg.validate()?;
        let full = DeviceKvCache::new(cfg.full_config())?;
        let window = DeviceKvCache::new(cfg.window_config())?;
        // SAFETY: the pools are this struct's own buffers, allocated just above; they
        // are dropped after the view (field order), and `cuMemFree` waits for the
        // device to finish with them.
        let view = unsafe { SwaKvCacheView::from_views(dev, cfg, &full, &window) }?;
        Ok(DeviceSwaKvCache { view, full, window })
    }

    /// The full pool (`config().full_config()`).
    pub fn full(&self) -> &DeviceKvCache {
        &self.full
    }

    /// The window pool (`config().window_config()`).
    pub fn window(&self) -> &DeviceKvCache {
        &self.window
    }

    /// Model layer `layer`'s K (`v == false`) or V buffer, in whichever pool it lives.
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for a layer past the last.
    pub fn layer(&self, layer: u32, v: bool) -> Result<DeviceSlice<u8>, KvError> {
        let layers = self.view.cfg.layers.num_layers() as usize;
        let (kind, j) = self.view.cfg.layers.layer(layer).ok_or(KvError::Shape {
            what: "layer",
            got: layer as usize,
            expected: layers,
        })?;
        let pool = if kind == LayerKind::Full { &self.full } else { &self.window };
        if v {
            Ok(pool.v_layer(j)?.expect("SWA pools are MHA"))
        } else {
            pool.k_layer(j)
        }
    }
}

/// The device copy of the full-to-window mapping table: `map_len()` entries (one per
/// full slot, 0 = no window slot), zeroed at first, updated from the host's table only
/// when the host says so.
///
/// Uploads are stream-ordered: each stages the host entries in pinned memory and
/// queues a copy (and, for pages, one `swa_map_update` launch) on `on`; a scatter
/// queued after them on the same stream sees them. The staging buffers are reused once
/// the previous upload has run (the host waits for it, normally long done).
pub struct DeviceSwaMap {
    module: SwaModule,
    table: DeviceBuffer<u32>,
    page_size: u32,
    /// Pinned host staging: page numbers, then their entries (or a run of entries).
    staging: LockedBuffer<u32>,
    /// Its device copy, read by `swa_map_update`.
    device_staging: DeviceBuffer<u32>,
    max_pages: usize,
    /// Recorded after the last upload's copy or kernel: the staging is free once it
    /// has run.
    done: RawEvent,
}

impl core::fmt::Debug for DeviceSwaMap {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceSwaMap")
            .field("entries", &self.table.len())
            .field("page_size", &self.page_size)
            .field("max_pages", &self.max_pages)
            .finish()
    }
}

impl DeviceSwaMap {
    /// A zeroed table of `cfg.map_len()` entries on `dev`, with staging for
    /// `max_pages` pages per upload (larger uploads are split).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for an invalid `cfg`, a zero `max_pages` or staging past
    /// `u32::MAX` entries; [`CudaKvError::Cuda`] from the driver.
    pub fn new(dev: &KvDevice, cfg: &SwaKvConfig, max_pages: usize) -> Result<DeviceSwaMap, CudaKvError> {
        cfg.validate()?;
        if max_pages == 0 {
            return Err(ConfigError::Zero("max_pages").into());
        }
        let ps = cfg.page_size as usize;
        let words = max_pages
            .checked_mul(ps + 1)
            .filter(|&w| w <= u32::MAX as usize)
            .ok_or(ConfigError::TooLarge { size: max_pages as u64, page_size: cfg.page_size })?;
        Ok(DeviceSwaMap {
            module: SwaModule::load(dev)?,
            table: DeviceBuffer::zeroed(cfg.map_len())?,
            page_size: cfg.page_size,
            staging: LockedBuffer::new(&0u32, words)?,
            device_staging: DeviceBuffer::zeroed(words)?,
            max_pages,
            done: RawEvent::new()?,
        })
    }

    /// Entries in the table (`map_len()` of its configuration).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the table has no entries (never: a valid configuration has a page).
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// The device table, for the engine's own kernels (attention reads window layers
    /// through it too). Read it on the stream the uploads go to.
    pub fn as_slice(&self) -> &DeviceSlice<u32> {
        &self.table
    }

    fn check_host<M: MappingTable + ?Sized>(&self, host: &M) -> Result<(), KvError> {
        if host.entries() != self.len() {
            return Err(KvError::Shape { what: "host mapping table", got: host.entries(), expected: self.len() });
        }
        Ok(())
    }

    /// Copy the host table's entries of full pages `pages` (`p * ps .. (p + 1) * ps`
    /// each, read now) into the device table, queued on `on`: one pinned copy of the
    /// page list and the entries, and one `swa_map_update` launch (per `max_pages`
    /// pages). Call it after the allocator maps or unmaps pages, before the scatter
    /// that uses them.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the host table's length differs or a page is past the
    /// table (nothing is queued then); [`CudaKvError::Cuda`] from the driver.
    pub fn upload_pages<'s, M: MappingTable + ?Sized>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        host: &M,
        pages: &[u32],
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        self.check_host(host)?;
        let ps = self.page_size as usize;
        let map_pages = self.len() / ps;
        if let Some(&p) = pages.iter().find(|&&p| p as usize >= map_pages) {
            return Err(KvError::SlotOutOfRange { slot: p, rows: map_pages }.into());
        }
        for chunk in pages.chunks(self.max_pages) {
            self.done.synchronize()?;
            let n = chunk.len();
            let words = n * (1 + ps);
            let staged = &mut self.staging.as_mut_slice()[..words];
            let (list, entries) = staged.split_at_mut(n);
            list.copy_from_slice(chunk);
            for (dst, &p) in entries.chunks_exact_mut(ps).zip(chunk) {
                for (k, e) in dst.iter_mut().enumerate() {
                    *e = host.entry(p as usize * ps + k);
                }
            }
            // SAFETY: `words` u32 from the pinned staging (holding `max_pages * (1 +
            // ps)` words, `n <= max_pages`) into the device staging of the same
            // capacity. The pinned buffer is not written again before `done` (recorded
            // below, after the kernel that reads the copy) has run, and both buffers
            // live in `self`, whose drop waits for `done`.
            check(
                unsafe {
                    cuMemcpyHtoDAsync_v2(
                        self.device_staging.as_device_ptr().as_raw(),
                        self.staging.as_ptr().cast(),
                        words * 4,
                        on.raw(),
                    )
                },
                "cuMemcpyHtoDAsync",
            )?;
            let staged_ptr = self.device_staging.as_device_ptr().as_raw();
            let (n_pages, page_size, map_pages) = (n as u32, self.page_size, map_pages as u32);
            let table = self.table.as_device_ptr().as_raw();
            let mut args: [*mut c_void; 5] = [
                &staged_ptr as *const u64 as *mut c_void,
                &n_pages as *const u32 as *mut c_void,
                &page_size as *const u32 as *mut c_void,
                &table as *const u64 as *mut c_void,
                &map_pages as *const u32 as *mut c_void,
            ];
            let grid = ((n * ps).div_ceil(MAP_THREADS as usize) as u32, 1, 1);
            // SAFETY: the arguments are, in order and type, `swa_map_update`'s `.param`
            // list (u64 staged, u32 n_pages, page_size, u64 map, u32 map_pages; checked
            // when the module loaded). Thread `i < n * ps` (the others return; `n * ps
            // <= words <= u32::MAX`) reads staged word `i / ps` and `n + i` (both `<
            // words`, copied above on the same stream) and writes table cell `page * ps
            // + i % ps` only for `page < map_pages`, inside the table's `map_pages * ps`
            // entries. `args` outlives the call.
            unsafe { launch_raw(&self.module.update, grid, MAP_THREADS, on.raw(), &mut args) }?;
            self.done.record(on.stream())?;
        }
        Ok(())
    }

    /// Copy the host table's entries `entries` (read now) into the same entries of the
    /// device table, queued on `on` (one pinned copy per `max_pages * (page_size + 1)`
    /// entries). `0..len()` uploads the whole table.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the host table's length differs or the range is past
    /// the table; [`CudaKvError::Cuda`] from the driver.
    pub fn upload_range<'s, M: MappingTable + ?Sized>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        host: &M,
        entries: Range<usize>,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        self.check_host(host)?;
        if entries.start > entries.end || entries.end > self.len() {
            return Err(KvError::Shape { what: "entry range end", got: entries.end, expected: self.len() }.into());
        }
        let cap = self.staging.len();
        let mut at = entries.start;
        while at < entries.end {
            let n = (entries.end - at).min(cap);
            self.done.synchronize()?;
            for (i, e) in self.staging.as_mut_slice()[..n].iter_mut().enumerate() {
                *e = host.entry(at + i);
            }
            // SAFETY: `n <= cap` u32 from the pinned staging into table entries `at..at
            // + n`, inside the table (`entries.end <= len`). The staging is not written
            // again before `done` (recorded next) has run; `self` owns both buffers and
            // its drop waits for `done`.
            check(
                unsafe {
                    cuMemcpyHtoDAsync_v2(
                        self.table.as_device_ptr().as_raw() + at as u64 * 4,
                        self.staging.as_ptr().cast(),
                        n * 4,
                        on.raw(),
                    )
                },
                "cuMemcpyHtoDAsync",
            )?;
            self.done.record(on.stream())?;
            at += n;
        }
        Ok(())
    }

    /// Read the whole device table back (synchronizes `on` first).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a wrong length; [`CudaKvError::Cuda`].
    pub fn download<'s>(&self, on: impl Into<KvStream<'s>>, out: &mut [u32]) -> Result<(), CudaKvError> {
        on.into().synchronize()?;
        if out.len() != self.len() {
            return Err(KvError::Shape { what: "out", got: out.len(), expected: self.len() }.into());
        }
        self.table.copy_to(out)?;
        Ok(())
    }
}

impl Drop for DeviceSwaMap {
    fn drop(&mut self) {
        // The pinned staging must outlive the last queued copy from it.
        let _ = self.done.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launchers_match_the_generated_kernels() {
        check_swa_signatures().unwrap();
        let m = module_for("swa", 80).unwrap();
        assert_eq!(entry_params(m.ptx, "swa_scatter_v1").unwrap().len(), SCATTER_PARAMS.len());
        assert!(entry_params(m.ptx, "swa_scatter_v32").is_none());
    }

    #[test]
    fn layer_records_are_24_bytes_in_order() {
        let r = LayerRecord { k_dst: 0x0102, v_dst: 0x0304, rows: 5, window: 1 };
        let b: &[u8] = bytemuck::bytes_of(&r);
        assert_eq!(b.len(), 24);
        assert_eq!(&b[..2], &[2, 1]);
        assert_eq!(&b[8..10], &[4, 3]);
        assert_eq!((b[16], b[20]), (5, 1));
    }
}
