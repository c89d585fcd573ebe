//! The host KV tier's transfers on the GPU (HiCache): the generated `host_backup_v*`
//! and `host_load_v*` kernels move a batch of whole pages between the device KV
//! buffers (a [`KvCacheView`]: kvpool's or the caller's memory) and a pinned,
//! device-mapped [`HostKvPool`], reading or writing host memory directly through its
//! device mapping (no staging copy of the KV bytes).
//!
//! * [`DeviceHostTransfer::backup`] — device pages to host pages, every layer and
//!   buffer, one launch (per [`max_pages`](DeviceHostTransfer::max_pages) pairs);
//! * [`DeviceHostTransfer::load_layers`] — host pages to device pages for a range of
//!   layers, one launch;
//! * [`DeviceHostTransfer::load_layerwise`] — one launch per group of consecutive
//!   layers, each followed by a record of its layers' events in caller-owned
//!   [`LayerEvents`], so the forward pass can start attention on layer `i` (waiting on
//!   event `i` on its own stream) while later layers still load. A group is one layer
//!   unless a layer of the batch is small: then enough layers that a launch moves at
//!   least [`LAYERWISE_MIN_LAUNCH_BYTES`] (see [`layerwise_group`]), because each
//!   launch costs a fixed few microseconds (the link's read pipeline drains at a
//!   kernel boundary) that would dominate a small layer.
//!
//! Everything the host can check is checked before anything is queued: the view and
//! the pool are the ones the transfer was made for, the pool is pinned, the page
//! lists have equal lengths, device pages are in range, host pages are **allocated**
//! ([`HostPageFault::NotAllocated`](crate::kv::host::HostPageFault) otherwise). The
//! kernels check every page again and skip (and flag, [`take_error`](DeviceHostTransfer::take_error))
//! one out of range, so no input makes them touch memory outside the two pools.
//!
//! The page lists are staged in a pinned, mapped ring (the kernels read them through
//! the mapping); a ring slot is reused once the launches that read it have run (the
//! host waits for that, normally long done).
//!
//! This module loads its own PTX module (`host`, generator
//! `kernels_build/src/host.rs`) and is the only place that launches its kernels; the
//! launchers' parameter lists are checked against the PTX's when the module loads
//! ([`check_host_signatures`], no GPU needed).

use core::ffi::c_void;
use core::fmt;
use core::ops::Range;

use cust::function::Function;
use cust::memory::{CopyDestination, DeviceBuffer, LockedBuffer};
use cust::module::Module;
use cust::sys::{
    cuEventCreate, cuEventDestroy_v2, cuEventQuery, cuEventRecord, cuEventSynchronize, cuMemHostGetDevicePointer_v2,
    cuStreamWaitEvent, cudaError_enum, CUevent, CUevent_flags_enum,
};

use super::cache::KvCacheView;
use super::launch::{check, launch_raw};
use super::mamba::entry_params;
use super::{CudaKvError, KvDevice, KvStream, StreamRef};
use crate::error::ConfigError;
use crate::kv::host::{HostKvConfig, HostKvError, HostKvPool, HostMemory};
use crate::kv::ptx::module_for;

/// Threads per block (`kernels_build::host::HOST_THREADS`).
const THREADS: u32 = 256;
/// Vectors in flight per thread (`HOST_UNROLL`).
const UNROLL: u32 = 4;
/// Generated vector widths, widest first (`HOST_WIDTHS`).
const WIDTHS: [u32; 5] = [16, 8, 4, 2, 1];
/// The `.param` types of every `host_*` kernel, in order.
const PARAMS: [&str; 12] = ["u64", "u64", "u64", "u64", "u64", "u32", "u32", "u32", "u32", "u32", "u32", "u64"];
/// Slots of the pinned page-list ring.
const RING: usize = 4;
/// Grid x is at most this (`2^31 - 1`).
const MAX_GRID_X: u64 = (1 << 31) - 1;
/// Grid y is at most this.
const MAX_GRID_Y: usize = 65_535;

/// The default least bytes one launch of [`DeviceHostTransfer::load_layerwise`] moves,
/// where the batch has them: 4 MiB, about 80 µs over a PCIe gen 5 x16 link, against a
/// fixed cost of about 5 µs per launch (the host reads of one kernel drain before the
/// next kernel's start, plus the launch gap and the event records). Layers of a batch
/// smaller than this are loaded in groups of consecutive layers ([`layerwise_group`]);
/// change it per transfer with
/// [`set_layerwise_min_launch_bytes`](DeviceHostTransfer::set_layerwise_min_launch_bytes)
/// (0: one launch per layer).
pub const LAYERWISE_MIN_LAUNCH_BYTES: usize = 4 << 20;

/// Layers per launch of a layer-wise load whose launches each move `layer_bytes` per
/// layer: the fewest consecutive layers that move at least `min_launch_bytes`, at
/// least 1 and at most `layers` (one launch for the whole batch). Groups start at layer
/// 0; the last one may be shorter.
///
/// The trade-off: a group's events complete together, when its last layer has landed,
/// so attention on the group's first layer starts up to `group - 1` layers' transfer
/// time later than with one launch per layer, in exchange for `group` times fewer fixed
/// per-launch costs. With the default 4 MiB threshold that delay is under 4 MiB of link
/// time (~80 µs on PCIe gen 5).
pub fn layerwise_group(layer_bytes: usize, layers: u32, min_launch_bytes: usize) -> u32 {
    let want = min_launch_bytes.div_ceil(layer_bytes.max(1));
    want.clamp(1, layers.max(1) as usize) as u32
}

fn kernel_name(load: bool, vec: u32) -> String {
    format!("host_{}_v{vec}", if load { "load" } else { "backup" })
}

/// Check, without a GPU, that every `host_*` kernel of every target has exactly the
/// parameter list its launcher passes, and that the module holds nothing else.
///
/// # Errors
///
/// [`CudaKvError::MissingKernel`] or [`CudaKvError::KernelSignature`] (kvpool bugs).
pub fn check_host_signatures() -> Result<(), CudaKvError> {
    for cc in [80, 90] {
        let m = module_for("host", cc).ok_or_else(|| CudaKvError::MissingKernel("host".into()))?;
        for load in [false, true] {
            for w in WIDTHS {
                let name = kernel_name(load, w);
                let got = entry_params(m.ptx, &name).ok_or_else(|| CudaKvError::MissingKernel(name.clone()))?;
                if got != PARAMS {
                    return Err(CudaKvError::KernelSignature {
                        kernel: name,
                        ptx: got.join(","),
                        wrapper: PARAMS.join(","),
                    });
                }
            }
        }
        let entries = m.ptx.matches(".visible .entry ").count();
        if entries != 2 * WIDTHS.len() {
            return Err(CudaKvError::MissingKernel(format!("{entries} entries in {}, launchers for 10", m.path)));
        }
    }
    Ok(())
}

/// Why a host-tier transfer was refused (nothing was queued) or failed.
#[derive(Debug)]
pub enum HostTransferError {
    /// The page lists, the layer range or the pool's memory are wrong; nothing was queued.
    Host(HostKvError),
    /// The driver refused a call, or a device-side check failed.
    Cuda(CudaKvError),
    /// The view or the pool is not the one this transfer was made for.
    Mismatch(&'static str),
}

impl fmt::Display for HostTransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostTransferError::Host(e) => e.fmt(f),
            HostTransferError::Cuda(e) => e.fmt(f),
            HostTransferError::Mismatch(what) => write!(f, "{what} is not the one this transfer was made for"),
        }
    }
}

impl std::error::Error for HostTransferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HostTransferError::Host(e) => Some(e),
            HostTransferError::Cuda(e) => Some(e),
            HostTransferError::Mismatch(_) => None,
        }
    }
}

impl From<HostKvError> for HostTransferError {
    fn from(e: HostKvError) -> Self {
        HostTransferError::Host(e)
    }
}

impl From<CudaKvError> for HostTransferError {
    fn from(e: CudaKvError) -> Self {
        HostTransferError::Cuda(e)
    }
}

impl From<cust::error::CudaError> for HostTransferError {
    fn from(e: cust::error::CudaError) -> Self {
        HostTransferError::Cuda(CudaKvError::Cuda(e))
    }
}

impl From<ConfigError> for HostTransferError {
    fn from(e: ConfigError) -> Self {
        HostTransferError::Host(HostKvError::Config(e))
    }
}

/// A driver event (timing disabled), owned here.
struct Ev(CUevent);

impl Ev {
    fn new() -> Result<Ev, CudaKvError> {
        let mut e: CUevent = core::ptr::null_mut();
        let flags = CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: an out-parameter and valid flags; the event belongs to the current context.
        check(unsafe { cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Ev(e))
    }

    fn record(&self, stream: StreamRef<'_>) -> Result<(), CudaKvError> {
        // SAFETY: a live event and a stream valid for the call.
        check(unsafe { cuEventRecord(self.0, stream.as_raw()) }, "cuEventRecord")
    }

    fn is_done(&self) -> Result<bool, CudaKvError> {
        // SAFETY: a live event.
        match unsafe { cuEventQuery(self.0) } {
            cudaError_enum::CUDA_SUCCESS => Ok(true),
            cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| false),
        }
    }

    fn synchronize(&self) -> Result<(), CudaKvError> {
        // SAFETY: a live event.
        check(unsafe { cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
}

impl Drop for Ev {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once; the driver defers the release until
        // pending records complete.
        unsafe { cuEventDestroy_v2(self.0) };
    }
}

/// One completion event per layer, owned by the caller and recorded by
/// [`DeviceHostTransfer::load_layerwise`] right after the launch that loads that layer
/// (with the other layers of its group, [`layerwise_group`]). Event `l` completes no
/// earlier than layer `l` of the batch is on the device; the events of one load
/// complete in layer order (one stream), those of one group together.
pub struct LayerEvents {
    events: Box<[Ev]>,
}

impl fmt::Debug for LayerEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerEvents").field("layers", &self.events.len()).finish()
    }
}

impl LayerEvents {
    /// `layers` events in the current context (the device's primary context on the
    /// thread that opened the [`KvDevice`]). An event never recorded counts as done.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] / [`CudaKvError::Driver`] from the driver.
    pub fn new(layers: u32) -> Result<LayerEvents, CudaKvError> {
        let events = (0..layers).map(|_| Ev::new()).collect::<Result<Vec<_>, _>>()?;
        Ok(LayerEvents { events: events.into_boxed_slice() })
    }

    /// How many layers.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    fn get(&self, layer: u32) -> Result<&Ev, HostTransferError> {
        self.events.get(layer as usize).ok_or(HostTransferError::Host(HostKvError::Shape {
            what: "layer event",
            got: layer as usize,
            expected: self.events.len(),
        }))
    }

    /// Whether layer `layer`'s load (the last one recorded) has run. Never blocks.
    ///
    /// # Errors
    ///
    /// [`HostTransferError::Host`] for a layer past the events; driver errors.
    pub fn is_done(&self, layer: u32) -> Result<bool, HostTransferError> {
        Ok(self.get(layer)?.is_done()?)
    }

    /// Block the host until layer `layer`'s load has run.
    ///
    /// # Errors
    ///
    /// As [`is_done`](Self::is_done).
    pub fn synchronize(&self, layer: u32) -> Result<(), HostTransferError> {
        Ok(self.get(layer)?.synchronize()?)
    }

    /// Make `stream` wait (on the device, the host does not block) until layer
    /// `layer`'s load has run: queue this before the attention kernels of that layer
    /// on the compute stream.
    ///
    /// # Errors
    ///
    /// As [`is_done`](Self::is_done).
    pub fn wait_on(&self, layer: u32, stream: StreamRef<'_>) -> Result<(), HostTransferError> {
        let e = self.get(layer)?;
        // SAFETY: a live event and a stream valid for the call (StreamRef's contract).
        check(unsafe { cuStreamWaitEvent(stream.as_raw(), e.0, 0) }, "cuStreamWaitEvent")?;
        Ok(())
    }
}

/// The loaded `host` module and its kernels.
struct HostModule {
    // Before `_module`: the handles are dropped before their module is unloaded.
    /// `(load, vec, function)` for every generated kernel.
    functions: Vec<(bool, u32, Function<'static>)>,
    _module: Module,
}

impl HostModule {
    fn load(dev: &KvDevice) -> Result<HostModule, CudaKvError> {
        check_host_signatures()?;
        let target = dev.ptx_target();
        let m = module_for("host", target).ok_or(CudaKvError::UnsupportedDevice { compute_capability: target })?;
        let module = Module::from_ptx(m.ptx, &[])?;
        let mut functions = Vec::new();
        for load in [false, true] {
            for w in WIDTHS {
                let f = module.get_function(kernel_name(load, w))?;
                // SAFETY: `Function` is a `CUfunction` handle plus a lifetime marker; the
                // handle stays valid while its module is loaded. The module lives in this
                // struct, is never replaced, and is dropped after `functions` (field
                // order); the handles are only used borrowed from `&self`.
                let f: Function<'static> = unsafe { core::mem::transmute::<Function<'_>, Function<'static>>(f) };
                functions.push((load, w, f));
            }
        }
        Ok(HostModule { functions, _module: module })
    }

    fn get(&self, load: bool, vec: u32) -> Result<&Function<'static>, CudaKvError> {
        self.functions
            .iter()
            .find(|(l, w, _)| *l == load && *w == vec)
            .map(|(_, _, f)| f)
            .ok_or_else(|| CudaKvError::MissingKernel(kernel_name(load, vec)))
    }
}

/// Moves pages between one device KV cache and host pools of one shape (see the module
/// docs).
///
/// # Examples
///
/// ```no_run
/// use kvpool::cuda::host::{DeviceHostTransfer, LayerEvents};
/// use kvpool::cuda::{DeviceKvCache, KvDevice};
/// use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
/// use kvpool::kv::{KvConfig, KvDtype, KvLayout};
///
/// let dev = KvDevice::new(0)?;
/// let kv = KvConfig { layout: KvLayout::Mha { head_num: 8, head_dim: 128 }, dtype: KvDtype::Bf16,
///                     layer_num: 32, size: 1 << 16, page_size: 16 };
/// let cache = DeviceKvCache::new(kv)?;
/// let host_cfg = HostKvConfig::with_ratio(kv, 2.0, HostLayout::LayerFirst)?;
/// let pool = HostKvPool::new(host_cfg)?;                 // pinned, device-mapped
/// let mut xfer = DeviceHostTransfer::new(&dev, &cache, &host_cfg, 1024)?;
/// let mut hp = [0u32; 2];
/// pool.alloc_pages(&mut hp)?;
/// // SAFETY: nothing touches host pages `hp` or the pool until the stream has run.
/// unsafe { xfer.backup(&dev, &cache, &pool, &[7, 9], &hp) }?;       // device 7, 9 -> host
/// // Later: load them back into device pages 3 and 4 layer by layer.
/// let events = LayerEvents::new(32)?;
/// unsafe { xfer.load_layerwise(&dev, &cache, &pool, &hp, &[3, 4], &events) }?;
/// events.wait_on(0, kvpool::cuda::StreamRef::from(dev.stream()))?; // attention of layer 0 may start
/// xfer.take_error(&dev)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceHostTransfer {
    module: HostModule,
    cfg: HostKvConfig,
    /// Where each layer buffer starts (`layer * buffers + buffer`), on the host (to
    /// recognize the view) and on the device (read by the kernels).
    bases: Box<[u64]>,
    dev_bases: DeviceBuffer<u64>,
    vec: u32,
    /// Pinned, mapped page lists: `RING` slots of `max_pages` `(device, host)` pairs.
    ring: LockedBuffer<u32>,
    ring_mapped: u64,
    /// Recorded after the last launch that read each slot.
    ring_done: Box<[Ev]>,
    next: usize,
    max_pages: usize,
    /// The least bytes one launch of a layer-wise load moves, where it can.
    min_launch_bytes: usize,
    err: DeviceBuffer<u32>,
}

impl fmt::Debug for DeviceHostTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceHostTransfer")
            .field("config", &self.cfg)
            .field("vec", &self.vec)
            .field("max_pages", &self.max_pages)
            .field("min_launch_bytes", &self.min_launch_bytes)
            .finish()
    }
}

/// One launch's work: which kernel, over which pairs and layer buffers.
struct Launch {
    load: bool,
    pairs: u64,
    n: u32,
    first_lb: u32,
    lb_count: u32,
}

impl DeviceHostTransfer {
    /// A transfer between `view`'s buffers and pools of shape `host` (whose `kv` must
    /// be `view.config()`), moving up to `max_pages` pages per launch (larger batches
    /// are split). Loads the `host` module and records the view's layer addresses in a
    /// small device table.
    ///
    /// # Errors
    ///
    /// [`HostTransferError::Host`] for an invalid `host` configuration, a zero
    /// `max_pages` or one whose grid would not fit; [`HostTransferError::Mismatch`]
    /// when `host.kv` is not the view's configuration; driver errors.
    pub fn new(
        dev: &KvDevice,
        view: &KvCacheView,
        host: &HostKvConfig,
        max_pages: usize,
    ) -> Result<DeviceHostTransfer, HostTransferError> {
        host.validate()?;
        if host.kv != *view.config() {
            return Err(HostTransferError::Mismatch("the view's configuration (host.kv)"));
        }
        if max_pages == 0 {
            return Err(ConfigError::Zero("max_pages").into());
        }
        let lbs = host.kv.layer_num as usize * host.buffers();
        if lbs > MAX_GRID_Y {
            return Err(ConfigError::TooLarge { size: lbs as u64, page_size: host.kv.page_size }.into());
        }
        let bases = Self::view_bases(view, host)?;
        let align = bases.iter().fold(host.chunk_bytes() as u64, |a, &b| a | b);
        let vec = WIDTHS.into_iter().find(|&w| align % w as u64 == 0).expect("width 1 divides everything");
        let vecs = (host.chunk_bytes() / vec as usize) as u64;
        let bpc = vecs.div_ceil((THREADS * UNROLL) as u64).max(1);
        if (max_pages as u64).checked_mul(bpc).map_or(true, |x| x > MAX_GRID_X) || max_pages > u32::MAX as usize / 2 {
            return Err(ConfigError::TooLarge { size: max_pages as u64, page_size: host.kv.page_size }.into());
        }
        let ring = LockedBuffer::new(&0u32, RING * 2 * max_pages)?;
        let mut ring_mapped = 0u64;
        // SAFETY: `ring` is a live pinned allocation (cuMemAllocHost); flags must be 0.
        let r = unsafe { cuMemHostGetDevicePointer_v2(&mut ring_mapped, ring.as_ptr() as *mut c_void, 0) };
        check(r, "cuMemHostGetDevicePointer")?;
        let ring_done = (0..RING).map(|_| Ev::new()).collect::<Result<Vec<_>, _>>()?.into_boxed_slice();
        Ok(DeviceHostTransfer {
            module: HostModule::load(dev)?,
            cfg: *host,
            dev_bases: DeviceBuffer::from_slice(&bases)?,
            bases,
            vec,
            ring,
            ring_mapped,
            ring_done,
            next: 0,
            max_pages,
            min_launch_bytes: LAYERWISE_MIN_LAUNCH_BYTES,
            err: DeviceBuffer::zeroed(1)?,
        })
    }

    fn view_bases(view: &KvCacheView, host: &HostKvConfig) -> Result<Box<[u64]>, HostTransferError> {
        let mut bases = Vec::with_capacity(host.kv.layer_num as usize * host.buffers());
        for l in 0..host.kv.layer_num {
            let k = view.k_layer(l).map_err(CudaKvError::Kv)?;
            bases.push(k.as_device_ptr().as_raw());
            if let Some(v) = view.v_layer(l).map_err(CudaKvError::Kv)? {
                bases.push(v.as_device_ptr().as_raw());
            }
        }
        Ok(bases.into_boxed_slice())
    }

    /// The configuration of the pools this transfer serves.
    pub fn config(&self) -> &HostKvConfig {
        &self.cfg
    }

    /// Pages per launch (larger batches are split).
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// The least bytes one launch of [`load_layerwise`](Self::load_layerwise) moves
    /// where the batch has them ([`LAYERWISE_MIN_LAUNCH_BYTES`] unless set).
    pub fn layerwise_min_launch_bytes(&self) -> usize {
        self.min_launch_bytes
    }

    /// Set the least bytes one launch of [`load_layerwise`](Self::load_layerwise)
    /// moves: layers are grouped until a launch reaches it ([`layerwise_group`]). 0 (or
    /// anything up to one layer of the batch) gives one launch per layer: the finest
    /// events, the most fixed costs.
    pub fn set_layerwise_min_launch_bytes(&mut self, bytes: usize) {
        self.min_launch_bytes = bytes;
    }

    /// Layers per launch of [`load_layerwise`](Self::load_layerwise) for a batch of
    /// `pages` pairs: [`layerwise_group`] of the bytes one launch moves per layer
    /// (`min(pages, max_pages)` page chunks of every buffer).
    pub fn layerwise_group(&self, pages: usize) -> u32 {
        let layer_bytes = pages.min(self.max_pages) * self.cfg.chunk_bytes() * self.cfg.buffers();
        layerwise_group(layer_bytes, self.cfg.kv.layer_num, self.min_launch_bytes)
    }

    /// The vector width the kernels use (16 when the page chunk and every layer base
    /// are multiples of 16 bytes).
    pub fn vector_bytes(&self) -> u32 {
        self.vec
    }

    /// Check the view, the pool and the pairs; the pool's mapped address.
    fn check(
        &self,
        view: &KvCacheView,
        pool: &HostKvPool,
        device_pages: &[u32],
        host_pages: &[u32],
    ) -> Result<u64, HostTransferError> {
        if *view.config() != self.cfg.kv {
            return Err(HostTransferError::Mismatch("the view"));
        }
        // Compared without allocating: layer by layer.
        let mut i = 0;
        for l in 0..self.cfg.kv.layer_num {
            let k = view.k_layer(l).map_err(CudaKvError::Kv)?.as_device_ptr().as_raw();
            let v = view.v_layer(l).map_err(CudaKvError::Kv)?.map(|v| v.as_device_ptr().as_raw());
            for addr in core::iter::once(k).chain(v) {
                if self.bases.get(i) != Some(&addr) {
                    return Err(HostTransferError::Mismatch("the view"));
                }
                i += 1;
            }
        }
        if *pool.config() != self.cfg {
            return Err(HostTransferError::Mismatch("the pool's configuration"));
        }
        let mapped = pool.mapped_address().ok_or(HostKvError::Memory { needs: HostMemory::Pinned })?;
        pool.check_pairs(device_pages, host_pages)?;
        Ok(mapped)
    }

    /// Stage `n <= max_pages` pairs into the next ring slot (waiting for its last
    /// reader first); the slot's mapped address and index.
    fn stage(&mut self, device_pages: &[u32], host_pages: &[u32]) -> Result<(u64, usize), CudaKvError> {
        let slot = self.next;
        self.next = (self.next + 1) % RING;
        self.ring_done[slot].synchronize()?;
        let words = 2 * self.max_pages;
        let dst = &mut self.ring.as_mut_slice()[slot * words..(slot + 1) * words];
        for (pair, (&d, &h)) in dst.chunks_exact_mut(2).zip(device_pages.iter().zip(host_pages)) {
            pair[0] = d;
            pair[1] = h;
        }
        Ok((self.ring_mapped + (slot * words * 4) as u64, slot))
    }

    /// Queue one launch.
    ///
    /// # Safety
    ///
    /// `mapped` is the mapped address of a pinned pool of `self.cfg`'s shape that
    /// outlives the launch; `l.pairs` holds `l.n` staged pairs that stay unchanged
    /// until the launch has run; the view the bases came from outlives the launch.
    unsafe fn launch(&self, on: KvStream<'_>, mapped: u64, l: &Launch) -> Result<(), CudaKvError> {
        let f = self.module.get(l.load, self.vec)?;
        let (page_stride, lb_stride) = self.cfg.strides();
        let vecs = (self.cfg.chunk_bytes() / self.vec as usize) as u32;
        let bpc = vecs.div_ceil(THREADS * UNROLL).max(1);
        let dev_bases = self.dev_bases.as_device_ptr().as_raw();
        let (page_stride, lb_stride) = (page_stride as u64, lb_stride as u64);
        let dev_pages = (self.cfg.device_pages() + 1) as u32;
        let host_pages = (self.cfg.host_pages + 1) as u32;
        let err = self.err.as_device_ptr().as_raw();
        let mut args: [*mut c_void; 12] = [
            &dev_bases as *const u64 as *mut c_void,
            &mapped as *const u64 as *mut c_void,
            &page_stride as *const u64 as *mut c_void,
            &lb_stride as *const u64 as *mut c_void,
            &l.pairs as *const u64 as *mut c_void,
            &l.n as *const u32 as *mut c_void,
            &dev_pages as *const u32 as *mut c_void,
            &host_pages as *const u32 as *mut c_void,
            &l.first_lb as *const u32 as *mut c_void,
            &bpc as *const u32 as *mut c_void,
            &vecs as *const u32 as *mut c_void,
            &err as *const u64 as *mut c_void,
        ];
        let grid = (l.n * bpc, l.lb_count, 1);
        // SAFETY: the argument values are, in order and type, the kernel's `.param`
        // list (u64 dev_bases, host, host_page_stride, host_lb_stride, pairs; u32
        // n_pairs, dev_pages, host_pages, first_lb, blocks_per_chunk, vecs; u64 err:
        // checked against the PTX when the module loaded). Block (x, y) handles pair `x
        // / bpc < n` (grid x is `n * bpc`, checked against the limit in `new`) and layer
        // buffer `first_lb + y < layers * buffers` (the callers pass a checked range);
        // it reads the pair from the staged list (`n` pairs, the caller's contract) and
        // touches memory only after checking the device page `< device_pages + 1` and
        // the host page `< host_pages + 1`: the device chunk `base[lb] + d * chunk` lies
        // in the layer buffer of `rows * row_bytes >= (device_pages + 1) * chunk`
        // bytes, and the host chunk `h * page_stride + lb * lb_stride` in the pool's
        // `total_bytes` (the layout's offsets, `HostKvConfig::strides`). Every address
        // and stride is a multiple of `vec` (chosen in `new` from the chunk and the
        // bases; the pool and the strides are chunk-aligned). `args` outlives the call.
        unsafe { launch_raw(f, grid, THREADS, on.raw(), &mut args) }
    }

    /// Back up device page `device_pages[i]` to host page `host_pages[i]` for every
    /// `i`, every layer and buffer: one launch per [`max_pages`](Self::max_pages)
    /// pairs, queued on `on`. Host pages must be allocated; give each pair its own host
    /// page (two pairs writing one leave either's bytes).
    ///
    /// # Safety
    ///
    /// Until `on` has run the backup: the host does not read or write the named host
    /// pages (no [`HostKvPool::page_rows`], no freeing and reallocating them), the pool
    /// is not dropped, and nobody writes the named device pages (the view's contract).
    /// Synchronize `on` (or an event recorded after this call) first.
    ///
    /// # Errors
    ///
    /// [`HostTransferError::Mismatch`] for another view or pool shape;
    /// [`HostTransferError::Host`] for a pageable pool, unequal lists, a device page 0
    /// or past the pool, a host page out of range or not allocated; nothing is queued
    /// then. Driver errors.
    pub unsafe fn backup<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        view: &KvCacheView,
        pool: &HostKvPool,
        device_pages: &[u32],
        host_pages: &[u32],
    ) -> Result<(), HostTransferError> {
        let on = on.into();
        let mapped = self.check(view, pool, device_pages, host_pages)?;
        let lbs = self.cfg.kv.layer_num * self.cfg.buffers() as u32;
        for (d, h) in device_pages.chunks(self.max_pages).zip(host_pages.chunks(self.max_pages)) {
            let (pairs, slot) = self.stage(d, h)?;
            let l = Launch { load: false, pairs, n: d.len() as u32, first_lb: 0, lb_count: lbs };
            // SAFETY: `mapped` is the checked pinned pool of this shape, which the
            // caller keeps alive and untouched until the stream has run (this fn's
            // contract); the slot holds `n` pairs and is not rewritten before
            // `ring_done[slot]` (recorded next) has run.
            unsafe { self.launch(on, mapped, &l) }?;
            self.ring_done[slot].record(on.stream())?;
        }
        Ok(())
    }

    /// Load host page `host_pages[i]` into device page `device_pages[i]` for every
    /// `i`, layers `layers` only (K and V), one launch per
    /// [`max_pages`](Self::max_pages) pairs, queued on `on`. Give each pair its own
    /// device page.
    ///
    /// # Safety
    ///
    /// Until `on` has run the load: the host does not write the named host pages (nor
    /// free them), the pool is not dropped, and nobody reads or writes the named
    /// device pages of those layers except work ordered after the load.
    ///
    /// # Errors
    ///
    /// As [`backup`](Self::backup), and [`HostKvError::Layers`] for a range past the
    /// last layer.
    pub unsafe fn load_layers<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        view: &KvCacheView,
        pool: &HostKvPool,
        host_pages: &[u32],
        device_pages: &[u32],
        layers: Range<u32>,
    ) -> Result<(), HostTransferError> {
        let on = on.into();
        let mapped = self.check(view, pool, device_pages, host_pages)?;
        pool.check_layers(&layers)?;
        if layers.is_empty() {
            return Ok(());
        }
        let b = self.cfg.buffers() as u32;
        for (d, h) in device_pages.chunks(self.max_pages).zip(host_pages.chunks(self.max_pages)) {
            let (pairs, slot) = self.stage(d, h)?;
            let l = Launch {
                load: true,
                pairs,
                n: d.len() as u32,
                first_lb: layers.start * b,
                lb_count: (layers.end - layers.start) * b,
            };
            // SAFETY: as in `backup`; the layer buffers `first_lb..first_lb + lb_count`
            // are inside `layers * buffers` (range checked above).
            unsafe { self.launch(on, mapped, &l) }?;
            self.ring_done[slot].record(on.stream())?;
        }
        Ok(())
    }

    /// Load the pages layer by layer, in groups of
    /// [`layerwise_group(pages)`](Self::layerwise_group) consecutive layers (one layer
    /// unless the batch is small): for each group in layer order, one launch that loads
    /// those layers of every pair (per [`max_pages`](Self::max_pages) pairs), then a
    /// record of `events`'s event of each layer of the group. The forward pass waits on
    /// event `l` ([`LayerEvents::wait_on`]) before attention on layer `l`; later layers
    /// load meanwhile. Event `l` completes once layer `l` has landed (with the rest of
    /// its group: coarser than one event per launch, never early).
    ///
    /// # Safety
    ///
    /// As [`load_layers`](Self::load_layers) over every layer.
    ///
    /// # Errors
    ///
    /// As [`load_layers`](Self::load_layers), and [`HostKvError::Shape`] when
    /// `events` does not have one event per layer; nothing is queued then.
    pub unsafe fn load_layerwise<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        view: &KvCacheView,
        pool: &HostKvPool,
        host_pages: &[u32],
        device_pages: &[u32],
        events: &LayerEvents,
    ) -> Result<(), HostTransferError> {
        let on = on.into();
        let layers = self.cfg.kv.layer_num;
        if events.len() != layers as usize {
            return Err(HostKvError::Shape { what: "events", got: events.len(), expected: layers as usize }.into());
        }
        let mapped = self.check(view, pool, device_pages, host_pages)?;
        let b = self.cfg.buffers() as u32;
        let group = self.layerwise_group(device_pages.len());
        let groups = (0..layers).step_by(group as usize).map(|first| first..(first + group).min(layers));
        if device_pages.len() <= self.max_pages {
            // The common case: one staged list read by every group's launch.
            let (pairs, slot) = self.stage(device_pages, host_pages)?;
            for g in groups {
                let l = Launch {
                    load: true,
                    pairs,
                    n: device_pages.len() as u32,
                    first_lb: g.start * b,
                    lb_count: (g.end - g.start) * b,
                };
                if l.n > 0 {
                    // SAFETY: as in `load_layers`, layers `g` inside `0..layer_num`; the
                    // slot is not rewritten before `ring_done[slot]`, recorded after the
                    // last group's launch.
                    unsafe { self.launch(on, mapped, &l) }?;
                }
                for layer in g {
                    events.events[layer as usize].record(on.stream())?;
                }
            }
            self.ring_done[slot].record(on.stream())?;
            return Ok(());
        }
        for g in groups {
            // SAFETY: this function's contract covers every layer.
            unsafe { self.load_layers(on, view, pool, host_pages, device_pages, g.clone()) }?;
            for layer in g {
                events.events[layer as usize].record(on.stream())?;
            }
        }
        Ok(())
    }

    /// Wait for `on` and report whether a kernel met a page out of range since the
    /// last call (that pair was skipped); clears the flag.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::DeviceSlotOutOfRange`]; driver errors, including an
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

impl Drop for DeviceHostTransfer {
    fn drop(&mut self) {
        // The pinned ring must outlive the launches that read it.
        for e in self.ring_done.iter() {
            let _ = e.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launchers_match_the_generated_kernels() {
        check_host_signatures().unwrap();
        let m = module_for("host", 90).unwrap();
        assert_eq!(entry_params(m.ptx, "host_load_v16").unwrap().len(), PARAMS.len());
        assert_eq!(entry_params(m.ptx, "host_backup_v1").unwrap(), PARAMS);
        assert!(entry_params(m.ptx, "host_load_v32").is_none());
    }

    #[test]
    fn layerwise_group_reaches_the_threshold() {
        const MIB: usize = 1 << 20;
        let t = LAYERWISE_MIN_LAUNCH_BYTES;
        // Llama-3-8B at page 16: a page is 64 KiB per layer (K and V).
        let layer = |pages: usize| pages * 64 * 1024;
        assert_eq!(layerwise_group(layer(16), 32, t), 4); // 1 MiB layers: 8 launches of 4 MiB
        assert_eq!(layerwise_group(layer(64), 32, t), 1); // 4 MiB layers: one per layer
        assert_eq!(layerwise_group(layer(256), 32, t), 1);
        assert_eq!(layerwise_group(layer(24), 32, t), 3); // 1.5 MiB: 3 layers reach 4.5 MiB
        assert_eq!(layerwise_group(layer(1), 32, t), 32); // 64 KiB layers: one launch
        assert_eq!(layerwise_group(MIB + 1, 32, t), 4);
        assert_eq!(layerwise_group(MIB - 1, 32, t), 5);
        // Threshold 0 or below one layer: one launch per layer.
        assert_eq!(layerwise_group(layer(16), 32, 0), 1);
        assert_eq!(layerwise_group(layer(16), 32, MIB), 1);
        // Never more than the layers, never 0, even for empty batches or no layers.
        assert_eq!(layerwise_group(0, 32, t), 32);
        assert_eq!(layerwise_group(1, 3, usize::MAX), 3);
        assert_eq!(layerwise_group(0, 0, t), 1);
        assert_eq!(layerwise_group(usize::MAX, 32, t), 1);
        // Each group reaches the threshold whenever more than one layer is needed.
        for lb in [1usize, 1000, 300_000, MIB, 3 * MIB] {
            let g = layerwise_group(lb, 80, t) as usize;
            assert!(g == 80 || g * lb >= t, "{lb}: {g}");
            assert!(g == 1 || (g - 1) * lb < t, "{lb}: {g} is more than needed");
        }
    }
}
