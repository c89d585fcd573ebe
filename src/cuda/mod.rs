//! The GPU half (feature `cuda`): device KV pools, a device `req_to_token` table, a
//! device-aware paged allocator, and the generated kernels launched with `cust`.
//!
//! * [`KvDevice`] — a device's primary context, a stream and the loaded kernels;
//! * [`DeviceKvCache`] — SGLang's `MHATokenToKVPool` / `MLATokenToKVPool`: per-layer
//!   K/V buffers of `size + page_size` rows (slot 0 is the dummy row), with
//!   `set_kv` (scatter, plain or fp8), `set_mla_kv`, `get_kv` (gather) and `move_kv`;
//! * [`DeviceReqToToken`] — the `[rows, max_context_len]` slot table on the device;
//! * [`DevicePagedAllocator`] — the host reserves pages lock-free through a shared
//!   [`PagedAllocator`](crate::PagedAllocator); one kernel launch expands them into
//!   per-token slots and (optionally) writes them into the request rows.
//!
//! * [`KvCacheView`] / [`ReqToTokenView`] — the same over memory the caller owns
//!   (`unsafe` constructors from raw addresses, everything checkable checked);
//!   `DeviceKvCache` and `DeviceReqToToken` own their memory and one such view each;
//! * [`DecodeGraphs`] — the decode step's allocation and row write from captured CUDA
//!   graphs, double-buffered pinned staging, no host synchronization; [`DeltaDecode`]
//!   the same with the requests' state kept on the device and only changes staged.
//! * [`swa`] — sliding-window models (Gemma 2/3, gpt-oss): a full and a window pool
//!   as one model, the mapped scatter of every layer in one launch, the device copy of
//!   the full-to-window slot mapping.
//! * [`host`] — the host KV tier (HiCache): page backups to and layer-wise loads from a
//!   pinned [`HostKvPool`](crate::kv::host::HostKvPool), with per-layer events.
//!
//! Every launcher takes the stream to run on (`on`): `&KvDevice` for the device's own
//! stream, [`KvDevice::on`] for any other stream of its primary context (a `cust`
//! stream, a `cudarc` stream with the feature `cudarc`, or a raw handle through
//! [`StreamRef::from_raw`]). Work is ordered on that stream; methods that read device
//! memory back to the host synchronize it first. See [`guide`] (`docs/GPU.md`). Kernels never write outside their buffers:
//! lengths are checked on the host, and slots (which live on the device) are checked
//! by the kernels, which skip an out-of-range slot and raise a flag that
//! [`DeviceKvCache::take_error`](KvCacheView::take_error) reports.
//!
//! Building needs `libcuda.so` to link (no toolkit): see `docs/GPU.md` and
//! `scripts/cuda_stub.sh`.
//!
//! # Examples
//!
//! ```no_run
//! use kvpool::cuda::{DeviceKvCache, KvDevice, Layers, Rows};
//! use kvpool::kv::{KvConfig, KvDtype, KvLayout};
//! use cust::memory::{CopyDestination, DeviceBuffer};
//!
//! let dev = KvDevice::new(0)?;
//! let cfg = KvConfig {
//!     layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
//!     dtype: KvDtype::Bf16, layer_num: 4, size: 4096, page_size: 16,
//! };
//! let cache = DeviceKvCache::new(cfg)?;
//! let k = DeviceBuffer::<u8>::zeroed(2 * cfg.row_bytes())?;
//! let v = DeviceBuffer::<u8>::zeroed(2 * cfg.row_bytes())?;
//! let slots = DeviceBuffer::from_slice(&[17u32, 18])?;
//! let rows = |b| Rows::new(b, cfg.row_bytes(), 0);
//! cache.set_kv(&dev, Layers::One(0), &slots, rows(&k), rows(&v), None, (1.0, 1.0))?;
//! cache.take_error(&dev)?;                      // syncs; Err if a slot was out of range
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod alloc;
mod cache;
mod delta;
mod graph;
pub mod host;
mod launch;
pub mod mamba;
mod stream;
pub mod swa;
mod table;

pub use alloc::{DevicePagedAllocator, LastLocs, StagedBatch};
pub use cache::{DeviceKvCache, KvCacheView, Layers, Rows, RowsMut};
pub use delta::{DeltaDecode, DeltaStep};
pub use graph::{DecodeGraphs, DecodeStep, FloorGraph, Staging, MAX_BUCKET};
pub use stream::{KvStream, StreamRef};
pub use table::{DeviceReqToToken, ReqToTokenView};

/// `docs/GPU.md`, whose examples compile as doctests.
#[doc = include_str!("../../docs/GPU.md")]
pub mod guide {}

use core::fmt;

use cust::context::Context;
use cust::device::{Device, DeviceAttribute};
use cust::error::CudaError;
use cust::stream::{Stream, StreamFlags};
use cust::CudaFlags;

use crate::error::{AllocError, ConfigError, FreeError};
use crate::kv::KvError;

/// What a GPU operation can fail with.
#[derive(Debug)]
pub enum CudaKvError {
    /// The CUDA driver refused a call (this includes "no CUDA device").
    Cuda(CudaError),
    /// The arguments do not fit the buffers; nothing was launched.
    Kv(KvError),
    /// The allocation was refused (out of memory, or a malformed batch); nothing changed.
    Alloc(AllocError),
    /// A free was refused.
    Free(FreeError),
    /// A constructor's parameters are unusable.
    Config(ConfigError),
    /// The device is older than the oldest generated target (sm_80).
    UnsupportedDevice {
        /// Its compute capability, `major * 10 + minor`.
        compute_capability: u32,
    },
    /// A kernel the wrappers need is not in the embedded modules (a kvpool bug).
    MissingKernel(String),
    /// A wrapper's argument types disagree with its kernel's `.param` list (a kvpool bug).
    KernelSignature {
        /// The kernel.
        kernel: String,
        /// The PTX's parameter types.
        ptx: String,
        /// The wrapper's.
        wrapper: String,
    },
    /// A kernel met a slot past its buffer's rows: that row was skipped, the others
    /// were written.
    DeviceSlotOutOfRange,
    /// A [`StagedBatch`] was expanded after a newer batch replaced its staging (or a
    /// [`DecodeStep`] was read after its staging buffer was reused).
    StaleBatch,
    /// A driver call `cust` has no error name for failed (stream capture, graphs).
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
    },
    /// An address handed to a view is not device memory of the current context.
    NotDeviceMemory {
        /// Which argument.
        what: &'static str,
        /// The address.
        address: u64,
    },
    /// A stream handed to [`KvDevice::on`] belongs to another context than the
    /// device's primary context, where kvpool's kernels are loaded.
    ForeignStream,
}

impl fmt::Display for CudaKvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaKvError::Cuda(e) => write!(f, "CUDA error: {e}"),
            CudaKvError::Kv(e) => e.fmt(f),
            CudaKvError::Alloc(e) => e.fmt(f),
            CudaKvError::Free(e) => e.fmt(f),
            CudaKvError::Config(e) => e.fmt(f),
            CudaKvError::UnsupportedDevice { compute_capability } => write!(
                f,
                "compute capability {}.{} is not supported (kvpool's kernels need 8.0 or newer)",
                compute_capability / 10,
                compute_capability % 10
            ),
            CudaKvError::MissingKernel(name) => write!(f, "kernel {name} is missing from the embedded PTX"),
            CudaKvError::KernelSignature { kernel, ptx, wrapper } => {
                write!(f, "kernel {kernel} takes ({ptx}) but its launcher passes ({wrapper})")
            }
            CudaKvError::DeviceSlotOutOfRange => {
                f.write_str("a kernel met a slot beyond its KV buffer; those rows were skipped")
            }
            CudaKvError::StaleBatch => f.write_str("this staged batch was replaced by a newer one"),
            CudaKvError::Driver { call, code } => write!(f, "{call} failed with CUresult {code}"),
            CudaKvError::NotDeviceMemory { what, address } => {
                write!(f, "{what} at {address:#x} is not device memory of the current context")
            }
            CudaKvError::ForeignStream => {
                f.write_str("the stream belongs to another context than the device's primary context")
            }
        }
    }
}

impl std::error::Error for CudaKvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CudaKvError::Cuda(e) => Some(e),
            CudaKvError::Kv(e) => Some(e),
            CudaKvError::Alloc(e) => Some(e),
            CudaKvError::Free(e) => Some(e),
            CudaKvError::Config(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CudaError> for CudaKvError {
    fn from(e: CudaError) -> Self {
        CudaKvError::Cuda(e)
    }
}
impl From<KvError> for CudaKvError {
    fn from(e: KvError) -> Self {
        CudaKvError::Kv(e)
    }
}
impl From<AllocError> for CudaKvError {
    fn from(e: AllocError) -> Self {
        CudaKvError::Alloc(e)
    }
}
impl From<ConfigError> for CudaKvError {
    fn from(e: ConfigError) -> Self {
        CudaKvError::Config(e)
    }
}
impl From<FreeError> for CudaKvError {
    fn from(e: FreeError) -> Self {
        CudaKvError::Free(e)
    }
}

/// A CUDA device ready for kvpool's kernels: its primary context (made current on the
/// calling thread), a stream that orders all kvpool work, and the loaded modules.
///
/// Use it from the thread that created it (or make its context current elsewhere).
pub struct KvDevice {
    kernels: launch::KvKernels,
    stream: Stream,
    device: Device,
    compute_capability: u32,
    // Last: the modules and the stream are released before the context.
    _context: Context,
}

impl fmt::Debug for KvDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvDevice")
            .field("compute_capability", &self.compute_capability)
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

impl KvDevice {
    /// How many CUDA devices there are (initializing the driver).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] when the driver cannot start — on a machine without a
    /// GPU that is typically `NoDevice` (or an initialization error from the stub
    /// `libcuda`).
    pub fn count() -> Result<u32, CudaKvError> {
        cust::init(CudaFlags::empty())?;
        Ok(Device::num_devices()?)
    }

    /// Open device `ordinal`: retain its primary context, load every kvpool module (the
    /// `sm_90` PTX on Hopper and newer, `sm_80` on Ampere and Ada) and create a stream.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] from the driver (no device, PTX rejected, ...),
    /// [`CudaKvError::UnsupportedDevice`] below compute capability 8.0.
    pub fn new(ordinal: u32) -> Result<KvDevice, CudaKvError> {
        Self::with_target(ordinal, u32::MAX)
    }

    /// As [`new`](Self::new), but load the modules of the newest target not above
    /// `max_target` (e.g. 80: the `sm_80` PTX, which the driver compiles for any newer
    /// GPU). Lets one device run and check the code generated for older GPUs.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_target(ordinal: u32, max_target: u32) -> Result<KvDevice, CudaKvError> {
        cust::init(CudaFlags::empty())?;
        let device = Device::get_device(ordinal)?;
        let major = device.get_attribute(DeviceAttribute::ComputeCapabilityMajor)? as u32;
        let minor = device.get_attribute(DeviceAttribute::ComputeCapabilityMinor)? as u32;
        let compute_capability = major * 10 + minor;
        let context = Context::new(device)?;
        let kernels = launch::KvKernels::load(compute_capability.min(max_target))?;
        let stream = Stream::new(StreamFlags::DEFAULT, None)?;
        Ok(KvDevice { kernels, stream, device, compute_capability, _context: context })
    }

    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] from the driver.
    pub fn name(&self) -> Result<String, CudaKvError> {
        Ok(self.device.name()?)
    }

    /// Compute capability as `major * 10 + minor` (90 for Hopper).
    pub fn compute_capability(&self) -> u32 {
        self.compute_capability
    }

    /// The target whose PTX was loaded (80 or 90).
    pub fn ptx_target(&self) -> u32 {
        self.kernels.target()
    }

    /// The number of kernels loaded (every entry of every module).
    pub fn kernel_count(&self) -> usize {
        self.kernels.len()
    }

    /// The stream all kvpool work is ordered on. Work of your own that reads or
    /// writes kvpool buffers should go on it too (or wait for it).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Pair the device's kernels with another stream of its context: an engine's own
    /// stream (a `cust` [`Stream`], a `cudarc` stream with the feature `cudarc`, or
    /// [`StreamRef::from_raw`]). Every launcher takes the result.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::ForeignStream`] when the stream belongs to another context (the
    /// kernels are loaded in the device's primary context only);
    /// [`CudaKvError::Cuda`] for an invalid handle.
    pub fn on<'a>(&'a self, stream: impl Into<StreamRef<'a>>) -> Result<KvStream<'a>, CudaKvError> {
        let stream = stream.into();
        if stream.context()? != self._context.as_raw() {
            return Err(CudaKvError::ForeignStream);
        }
        Ok(KvStream { kernels: &self.kernels, stream })
    }

    /// Wait until everything queued on the stream has run.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`], including a kernel fault that happened asynchronously.
    pub fn synchronize(&self) -> Result<(), CudaKvError> {
        Ok(self.stream.synchronize()?)
    }

    /// Launch the empty kernel on `on` (the launch floor benchmarks compare against).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] if the launch is refused.
    pub fn launch_noop<'s>(&self, on: impl Into<KvStream<'s>>, blocks: u32, threads: u32) -> Result<(), CudaKvError> {
        let on = on.into();
        on.kernels.noop(on.raw(), blocks, threads)
    }

    pub(crate) fn kernels(&self) -> &launch::KvKernels {
        &self.kernels
    }
}

/// Check, without a GPU, that every typed launcher matches a generated kernel's
/// parameter list and every generated kernel has a launcher.
///
/// # Errors
///
/// [`CudaKvError::MissingKernel`] or [`CudaKvError::KernelSignature`] (kvpool bugs).
pub fn check_kernel_signatures() -> Result<(), CudaKvError> {
    launch::check_signatures()
}
