//! The GPU boundary: loading the generated modules and the typed launch wrappers.
//!
//! This is the only module that launches kernels (`cuLaunchKernel`, on a raw stream
//! handle, so that any stream of the context will do: kvpool's, a `cust` stream, or one
//! an engine created with another crate). Each wrapper's arguments
//! mirror its kernel's `.param` list field for field (the load step compares the
//! wrappers' declared parameter types with the PTX's and refuses a mismatch), derives
//! the grid from the same constants the generator used, and states in its `# Safety`
//! section what the caller must have checked about buffer lengths.

use std::collections::HashMap;

use core::ffi::c_void;

use cust::error::CudaError;
use cust::function::Function;
use cust::memory::DevicePointer;
use cust::module::Module;
use cust::sys::{cuLaunchKernel, cudaError_enum, CUstream};

use super::CudaKvError;
use crate::kv::ptx::{
    module_for, ALLOC_DECODE_THREADS, ALLOC_EXTEND_THREADS, CONST_PAGE_SIZES, DELTA_MAX_THREADS, DELTA_SPEC, KERNELS,
    MODULE_NAMES, ROWS_PER_BLOCK, ROW_BLOCK_THREADS,
};
use crate::kv::SrcFloat;

/// Convert the status of a raw driver call into a `Result`: the codes `cust` names
/// become [`CudaKvError::Cuda`], the others [`CudaKvError::Driver`].
pub(crate) fn check(r: cudaError_enum, call: &'static str) -> Result<(), CudaKvError> {
    use cudaError_enum as E;
    let e = match r {
        E::CUDA_SUCCESS => return Ok(()),
        E::CUDA_ERROR_INVALID_VALUE => CudaError::InvalidValue,
        E::CUDA_ERROR_OUT_OF_MEMORY => CudaError::OutOfMemory,
        E::CUDA_ERROR_NOT_INITIALIZED => CudaError::NotInitialized,
        E::CUDA_ERROR_NO_DEVICE => CudaError::NoDevice,
        E::CUDA_ERROR_INVALID_CONTEXT => CudaError::InvalidContext,
        E::CUDA_ERROR_INVALID_HANDLE => CudaError::InvalidHandle,
        E::CUDA_ERROR_NOT_READY => CudaError::NotReady,
        E::CUDA_ERROR_ILLEGAL_ADDRESS => CudaError::IllegalAddress,
        E::CUDA_ERROR_LAUNCH_FAILED => CudaError::LaunchFailed,
        E::CUDA_ERROR_NOT_FOUND => CudaError::NotFound,
        other => return Err(CudaKvError::Driver { call, code: other as u32 }),
    };
    Err(CudaKvError::Cuda(e))
}

/// Launch `f` on `stream` with the given kernel arguments (each one's address).
///
/// # Safety
///
/// `args` are the addresses of values whose types are, in order, the kernel's
/// `.param` list; every memory the kernel touches through them stays allocated until
/// the stream has run it.
pub(crate) unsafe fn launch_raw(
    f: &Function<'_>,
    grid: (u32, u32, u32),
    block: u32,
    stream: CUstream,
    args: &mut [*mut c_void],
) -> Result<(), CudaKvError> {
    // SAFETY: `f` is a loaded function of the current context; the argument array
    // matches its parameters (the caller's contract) and outlives the call (the driver
    // copies the values before returning); no extra launch options.
    let r = unsafe {
        cuLaunchKernel(
            f.to_raw(),
            grid.0,
            grid.1,
            grid.2,
            block,
            1,
            1,
            0,
            stream,
            args.as_mut_ptr(),
            core::ptr::null_mut(),
        )
    };
    check(r, "cuLaunchKernel")
}

/// `launch_on!(f, grid, block, stream; a, b, ...)`: [`launch_raw`] with the addresses
/// of the (already correctly typed) argument expressions.
macro_rules! launch_on {
    ($f:expr, $grid:expr, $block:expr, $stream:expr; $($arg:expr),* $(,)?) => {{
        let mut args: [*mut c_void; 0 $(+ launch_on!(@one $arg))*] =
            [$(&$arg as *const _ as *mut c_void),*];
        launch_raw($f, $grid, $block, $stream, &mut args)
    }};
    (@one $arg:expr) => { 1 };
}

/// What a row kernel stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum StoreKind {
    /// Bytes unchanged.
    Copy,
    /// Quantize from this source type to fp8 e4m3.
    Fp8(SrcFloat),
}

impl StoreKind {
    /// Vector widths (source bytes per lane access) that exist for this store, widest first.
    pub(crate) fn widths(self) -> &'static [u32] {
        match self {
            StoreKind::Copy => &[16, 8, 4, 2, 1],
            StoreKind::Fp8(SrcFloat::F32) => &[16, 4],
            StoreKind::Fp8(_) => &[16, 2],
        }
    }

    /// Bytes stored per `w` source bytes.
    pub(crate) fn stored(self, w: u32) -> u32 {
        match self {
            StoreKind::Copy => w,
            StoreKind::Fp8(f) => w / f.bytes() as u32,
        }
    }

    fn name(self) -> &'static str {
        match self {
            StoreKind::Copy => "copy",
            StoreKind::Fp8(SrcFloat::F16) => "fp8_f16",
            StoreKind::Fp8(SrcFloat::Bf16) => "fp8_bf16",
            StoreKind::Fp8(SrcFloat::F32) => "fp8_f32",
        }
    }
}

/// Every kernel the modules hold, by what it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum KernelId {
    Noop,
    /// `page_size` 0: the run-time page size kernel (`_psn`).
    Alloc {
        decode: bool,
        page_size: u32,
    },
    /// `page_size` 0: the run-time page size kernel.
    DecodeStep {
        page_size: u32,
    },
    /// `page_size` 0: the run-time page size kernel.
    DecodeDelta {
        page_size: u32,
    },
    Scatter {
        store: StoreKind,
        vec: u32,
    },
    ScatterMla {
        store: StoreKind,
        vec: u32,
    },
    Gather {
        vec: u32,
    },
    Move {
        vec: u32,
    },
}

impl KernelId {
    /// The entry name, as `kernels_build` writes it.
    pub(crate) fn name(self) -> String {
        match self {
            KernelId::Noop => "noop".to_string(),
            KernelId::Alloc { decode, page_size } => {
                let kind = if decode { "alloc_decode" } else { "alloc_extend" };
                match page_size {
                    0 => format!("{kind}_psn"),
                    ps => format!("{kind}_ps{ps}"),
                }
            }
            KernelId::DecodeStep { page_size: 0 } => "decode_step_psn".to_string(),
            KernelId::DecodeStep { page_size } => format!("decode_step_ps{page_size}"),
            KernelId::DecodeDelta { page_size: 0 } => "decode_delta_psn".to_string(),
            KernelId::DecodeDelta { page_size } => format!("decode_delta_ps{page_size}"),
            KernelId::Scatter { store, vec } => format!("kv_scatter_{}_v{vec}", store.name()),
            KernelId::ScatterMla { store, vec } => format!("kv_scatter_mla_{}_v{vec}", store.name()),
            KernelId::Gather { vec } => format!("kv_gather_v{vec}"),
            KernelId::Move { vec } => format!("kv_move_v{vec}"),
        }
    }

    /// The allocation kernel for `page_size`: a specialized one when it exists.
    pub(crate) fn alloc(decode: bool, page_size: u32) -> KernelId {
        let ps = if CONST_PAGE_SIZES.contains(&page_size) { page_size } else { 0 };
        KernelId::Alloc { decode, page_size: ps }
    }

    /// Every kernel the typed wrappers can launch.
    pub(crate) fn all() -> Vec<KernelId> {
        let mut ids = vec![KernelId::Noop];
        for decode in [false, true] {
            for ps in CONST_PAGE_SIZES.iter().copied().chain([0]) {
                ids.push(KernelId::Alloc { decode, page_size: ps });
            }
        }
        for ps in CONST_PAGE_SIZES.iter().copied().chain([0]) {
            ids.push(KernelId::DecodeStep { page_size: ps });
        }
        for ps in CONST_PAGE_SIZES.iter().copied().chain([0]) {
            ids.push(KernelId::DecodeDelta { page_size: ps });
        }
        let stores = [
            StoreKind::Copy,
            StoreKind::Fp8(SrcFloat::F16),
            StoreKind::Fp8(SrcFloat::Bf16),
            StoreKind::Fp8(SrcFloat::F32),
        ];
        for store in stores {
            for &vec in store.widths() {
                ids.push(KernelId::Scatter { store, vec });
                ids.push(KernelId::ScatterMla { store, vec });
            }
        }
        for &vec in StoreKind::Copy.widths() {
            ids.push(KernelId::Gather { vec });
            ids.push(KernelId::Move { vec });
        }
        ids
    }

    /// The `.param` types its wrapper passes, in order.
    pub(crate) fn params(self) -> &'static [&'static str] {
        const ALLOC: &[&str] = &["U64", "U32", "U64", "U64", "U64", "U32", "U32", "U32"];
        const STEP: &[&str] = &["U64", "U32", "U64", "U64", "U32", "U32"];
        const DELTA: &[&str] = &["U64", "U64", "U32", "U32", "U64", "U64", "U32", "U32", "U32"];
        const SCATTER: &[&str] =
            &["U64", "U64", "U64", "U64", "U64", "U64", "U64", "U64", "U32", "U32", "U32", "F32", "F32", "U64"];
        const MLA: &[&str] =
            &["U64", "U64", "U64", "U64", "U64", "U64", "U64", "U64", "U64", "U32", "U32", "U32", "U32", "F32", "U64"];
        const GATHER: &[&str] = &["U64", "U64", "U64", "U64", "U64", "U64", "U64", "U64", "U32", "U32", "U32", "U64"];
        const MOVE: &[&str] = &["U64", "U64", "U64", "U64", "U64", "U32", "U32", "U32", "U64"];
        match self {
            KernelId::Noop => &[],
            KernelId::Alloc { .. } => ALLOC,
            KernelId::DecodeStep { .. } => STEP,
            KernelId::DecodeDelta { .. } => DELTA,
            KernelId::Scatter { .. } => SCATTER,
            KernelId::ScatterMla { .. } => MLA,
            KernelId::Gather { .. } => GATHER,
            KernelId::Move { .. } => MOVE,
        }
    }
}

/// Check, without a GPU, that every wrapper names a generated kernel with the same
/// parameter types, and that every generated kernel has a wrapper.
pub(crate) fn check_signatures() -> Result<(), CudaKvError> {
    let ids = KernelId::all();
    for id in &ids {
        let name = id.name();
        let Some((_, _, tys)) = KERNELS.iter().find(|(_, n, _)| *n == name) else {
            return Err(CudaKvError::MissingKernel(name));
        };
        if *tys != id.params() {
            return Err(CudaKvError::KernelSignature {
                kernel: name,
                ptx: tys.join(","),
                wrapper: id.params().join(","),
            });
        }
    }
    if ids.len() != KERNELS.len() {
        let wrapped: Vec<String> = ids.iter().map(|id| id.name()).collect();
        let orphan = KERNELS.iter().find(|(_, n, _)| !wrapped.iter().any(|w| w == n)).map(|(_, n, _)| *n);
        return Err(CudaKvError::MissingKernel(format!("no wrapper for {}", orphan.unwrap_or("?"))));
    }
    Ok(())
}

/// The loaded modules and a handle to every kernel.
pub(crate) struct KvKernels {
    // Declared before `modules`, so the handles are dropped before their modules are
    // unloaded. They never leave this struct with a lifetime longer than `&self`.
    functions: HashMap<KernelId, Function<'static>>,
    modules: Vec<Module>,
    target: u32,
}

impl std::fmt::Debug for KvKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvKernels")
            .field("modules", &self.modules.len())
            .field("kernels", &self.functions.len())
            .finish()
    }
}

impl KvKernels {
    /// Load every module for compute capability `cc` into the current context and look
    /// up every kernel once (launches then neither search nor allocate).
    pub(crate) fn load(cc: u32) -> Result<KvKernels, CudaKvError> {
        check_signatures()?;
        let mut modules = Vec::with_capacity(MODULE_NAMES.len());
        let mut owner = HashMap::new();
        let mut target = 0;
        for name in MODULE_NAMES {
            let m = module_for(name, cc).ok_or(CudaKvError::UnsupportedDevice { compute_capability: cc })?;
            target = m.compute_capability;
            modules.push(Module::from_ptx(m.ptx, &[])?);
            owner.insert(name, modules.len() - 1);
        }
        let mut functions = HashMap::new();
        for id in KernelId::all() {
            let name = id.name();
            let (module_name, _, _) = KERNELS.iter().find(|(_, n, _)| *n == name).expect("checked by check_signatures");
            let module = &modules[owner[module_name]];
            let f = module.get_function(&name)?;
            // SAFETY: `Function` is a `CUfunction` handle plus a lifetime marker; the
            // handle stays valid while its module is loaded. The modules live in this
            // struct, are never removed, and are dropped after `functions` (field
            // order); `func` hands the handle out only borrowed from `&self`.
            let f: Function<'static> = unsafe { std::mem::transmute::<Function<'_>, Function<'static>>(f) };
            functions.insert(id, f);
        }
        Ok(KvKernels { functions, modules, target })
    }

    /// The target (compute capability) of the loaded PTX.
    pub(crate) fn target(&self) -> u32 {
        self.target
    }

    /// How many kernels were loaded.
    pub(crate) fn len(&self) -> usize {
        self.functions.len()
    }

    fn func(&self, id: KernelId) -> Result<&Function<'_>, CudaKvError> {
        self.functions.get(&id).ok_or_else(|| CudaKvError::MissingKernel(id.name()))
    }

    /// Launch the empty kernel on `blocks` blocks of `threads` threads.
    pub(crate) fn noop(&self, stream: CUstream, blocks: u32, threads: u32) -> Result<(), CudaKvError> {
        let f = self.func(KernelId::Noop)?;
        // SAFETY: `noop` has no parameters and touches no memory; any grid is valid.
        unsafe { launch_on!(f, (blocks, 1, 1), threads, stream;) }
    }

    /// Launch `alloc_extend_*` / `alloc_decode_*`.
    ///
    /// # Safety
    ///
    /// `a.meta` holds `a.batch` allocation records (`RECORD_BYTES` each, the layout of
    /// `kvpool::kv::staging::AllocRecord`) consistent with a validated plan (a decode
    /// record may be padding, `row == PAD_ROW`): `page_start` / `out_start` are the exclusive prefix sums of new
    /// pages / new tokens, `a.pages` holds the plan's `new_pages` page numbers, `a.out`
    /// the plan's `new_tokens` slots; with `FLAG_WRITE_ROWS` or
    /// `FLAG_LAST_LOC_FROM_ROWS`, `a.table` holds `rows * table_stride` u32, every
    /// `row < rows` and every `seq_len <= table_stride`. All buffers stay allocated
    /// until the stream has run the kernel.
    pub(crate) unsafe fn alloc(&self, stream: CUstream, decode: bool, a: &AllocArgs) -> Result<(), CudaKvError> {
        if a.batch == 0 {
            return Ok(());
        }
        let f = self.func(KernelId::alloc(decode, a.page_size))?;
        let (grid, block) = if decode {
            ((a.batch.div_ceil(ALLOC_DECODE_THREADS), 1, 1), ALLOC_DECODE_THREADS)
        } else {
            ((a.batch, 1, 1), ALLOC_EXTEND_THREADS)
        };
        // SAFETY: the arguments are, in order and type, the kernel's `.param` list
        // (meta u64, batch u32, pages u64, out u64, table u64, table_stride u32,
        // page_size u32, flags u32; checked against the PTX at load). Extend runs one
        // block per request and each thread writes only `out[out_start + k]` and row
        // cells `prefix + k` for `k < seq - prefix`; decode runs one thread per request
        // (threads past `batch` return) writing `out[i]` and cell `seq - 1`: all in
        // bounds by the caller's contract. The host reads none of these buffers until
        // it synchronizes the stream.
        unsafe {
            launch_on!(f, grid, block, stream;
                a.meta, a.batch, a.pages, a.out, a.table, a.table_stride, a.page_size, a.flags
            )
        }
    }

    /// Launch `decode_step_*`.
    ///
    /// # Safety
    ///
    /// `a.records` holds `a.batch` records of `STEP_RECORD_BYTES` (the layout of
    /// `kvpool::kv::staging::StepRecord`) written by `stage_decode`: each non-padding
    /// record has `1 <= seq_len <= table_stride`, `row < rows` of the table, and its
    /// row holds the request's first `seq_len - 1` slots; `a.out` holds `a.batch`
    /// slots; `a.table` holds `rows * table_stride` u32. All of it stays allocated
    /// (and the records unchanged) until the stream has run the kernel.
    pub(crate) unsafe fn decode_step(&self, stream: CUstream, a: &StepArgs) -> Result<(), CudaKvError> {
        if a.batch == 0 {
            return Ok(());
        }
        let ps = if CONST_PAGE_SIZES.contains(&a.page_size) { a.page_size } else { 0 };
        let f = self.func(KernelId::DecodeStep { page_size: ps })?;
        let grid = (a.batch.div_ceil(ALLOC_DECODE_THREADS), 1, 1);
        // SAFETY: the arguments are, in order and type, the kernel's `.param` list
        // (records u64, batch u32, out u64, table u64, table_stride u32, page_size u32;
        // checked against the PTX at load). One thread per request, threads past
        // `batch` return; thread `i` reads record `i`, writes `out[i]` and (unless
        // padding) reads cell `seq - 2` and writes cell `seq - 1` of its row: all in
        // bounds by the caller's contract.
        unsafe {
            launch_on!(f, grid, ALLOC_DECODE_THREADS, stream;
                a.records, a.batch, a.out, a.table, a.table_stride, a.page_size
            )
        }
    }

    /// Launch `decode_delta_*`: one block of `min(max(bucket, DELTA_SPEC),
    /// DELTA_MAX_THREADS)` threads.
    ///
    /// # Safety
    ///
    /// `a.deltas` holds a delta block as `kvpool::kv::delta::DeltaPlanner::stage`
    /// writes it for `a.capacity` batch indices (the two counts, then `a.capacity` full
    /// entries of `DELTA_ENTRY_BYTES` and `a.capacity` page entries of
    /// `DELTA_PAGE_BYTES`; the kernel reads at most `a.capacity` of each whatever the
    /// counts say), 16-byte aligned; `a.state` holds `a.capacity` records of `DELTA_STATE_BYTES`;
    /// `a.bucket <= a.capacity`; `a.out` holds `a.bucket` slots; `a.table` holds
    /// `a.rows * a.table_stride` u32 (a product below 2^32). All of it stays allocated
    /// (and the block unchanged) until the stream has run the kernel, and no other
    /// launch touching `a.state` runs concurrently with it.
    pub(crate) unsafe fn decode_delta(&self, stream: CUstream, a: &DeltaArgs) -> Result<(), CudaKvError> {
        let ps = if CONST_PAGE_SIZES.contains(&a.page_size) { a.page_size } else { 0 };
        let f = self.func(KernelId::DecodeDelta { page_size: ps })?;
        let block = a.bucket.clamp(DELTA_SPEC, DELTA_MAX_THREADS);
        // SAFETY: the arguments are, in order and type, the kernel's `.param` list
        // (deltas u64, state u64, capacity u32, bucket u32, out u64, table u64, rows
        // u32, table_stride u32, page_size u32; checked against the PTX at load). One
        // block; it reads the counts and entries `< min(count, capacity)` of each kind
        // of `deltas` (the speculative first reads only below `capacity` too), writes
        // `state[index]` only for `index < capacity`, reads and writes
        // `state[i]` and `out[i]` for `i < bucket <= capacity`, reads table cells only
        // for `row < rows` and `len <= table_stride` (column `len - 1`) and writes them
        // only for `row < rows` and `len < table_stride`: all in bounds by the
        // caller's contract.
        unsafe {
            launch_on!(f, (1, 1, 1), block, stream;
                a.deltas, a.state, a.capacity, a.bucket, a.out, a.table, a.rows, a.table_stride, a.page_size
            )
        }
    }

    /// Launch `kv_scatter_*` over `layers` layers and `buffers` buffers (1: K only).
    ///
    /// # Safety
    ///
    /// For `l < layers`, `i < n_tokens`: source rows `k_src/v_src + l*src_layer_stride +
    /// i*src_row_stride` of `vecs * vec` bytes are readable; `k_dst`/`v_dst` hold
    /// `layers` layers of `num_rows` rows of `vecs * stored(vec)` bytes at
    /// `dst_layer_stride`; `slots` holds `n_tokens` u32; `err` one u32; pointers and
    /// strides are multiples of `vec` (and of the stored width); with `buffers == 1`
    /// only the K pointers are used.
    pub(crate) unsafe fn scatter(
        &self,
        stream: CUstream,
        store: StoreKind,
        vec: u32,
        layers: u32,
        buffers: u32,
        a: &ScatterArgs,
    ) -> Result<(), CudaKvError> {
        if a.n_tokens == 0 || layers == 0 {
            return Ok(());
        }
        let f = self.func(KernelId::Scatter { store, vec })?;
        let grid = (a.n_tokens.div_ceil(ROWS_PER_BLOCK), layers, buffers);
        // SAFETY: arguments mirror the `.param` list (checked at load). Warp `w` of
        // block `b` handles token `b*ROWS_PER_BLOCK + w` only if it is `< n_tokens`,
        // layer `ctaid.y < layers`, buffer `ctaid.z < buffers`; it skips (and flags in
        // `err`) a slot `>= num_rows`, so every write is inside the destination layer;
        // reads stay inside the caller-checked source extent. The host does not touch
        // the buffers before synchronizing the stream.
        unsafe {
            launch_on!(f, grid, ROW_BLOCK_THREADS, stream;
                a.k_src, a.v_src, a.src_row_stride, a.src_layer_stride, a.k_dst, a.v_dst, a.dst_layer_stride,
                a.slots, a.n_tokens, a.vecs, a.num_rows, a.k_inv_scale, a.v_inv_scale, a.err
            )
        }
    }

    /// Launch `kv_scatter_mla_*` over `layers` layers.
    ///
    /// # Safety
    ///
    /// As [`scatter`](Self::scatter) with one buffer, for the nope rows (`nope_vecs *
    /// vec` bytes) and the rope rows (`rope_vecs * vec` bytes), each with its own
    /// strides; pool rows are `(nope_vecs + rope_vecs) * stored(vec)` bytes.
    pub(crate) unsafe fn scatter_mla(
        &self,
        stream: CUstream,
        store: StoreKind,
        vec: u32,
        layers: u32,
        a: &MlaArgs,
    ) -> Result<(), CudaKvError> {
        if a.n_tokens == 0 || layers == 0 {
            return Ok(());
        }
        let f = self.func(KernelId::ScatterMla { store, vec })?;
        let grid = (a.n_tokens.div_ceil(ROWS_PER_BLOCK), layers, 1);
        // SAFETY: as in `scatter`: arguments mirror the `.param` list, warps past
        // `n_tokens` return, out-of-range slots are skipped and flagged, reads are
        // inside the caller-checked extents, and the host waits for the stream.
        unsafe {
            launch_on!(f, grid, ROW_BLOCK_THREADS, stream;
                a.nope_src, a.nope_row_stride, a.nope_layer_stride, a.rope_src, a.rope_row_stride,
                a.rope_layer_stride, a.dst, a.dst_layer_stride, a.slots, a.n_tokens, a.nope_vecs, a.rope_vecs,
                a.num_rows, a.inv_scale, a.err
            )
        }
    }

    /// Launch `kv_gather_*`.
    ///
    /// # Safety
    ///
    /// The mirror of [`scatter`](Self::scatter): pool rows are read, `n_tokens` dense
    /// rows of `vecs * vec` bytes are written at `k_dst/v_dst + l*dst_layer_stride +
    /// i*dst_row_stride`, which must be writable.
    pub(crate) unsafe fn gather(
        &self,
        stream: CUstream,
        vec: u32,
        layers: u32,
        buffers: u32,
        a: &GatherArgs,
    ) -> Result<(), CudaKvError> {
        if a.n_tokens == 0 || layers == 0 {
            return Ok(());
        }
        let f = self.func(KernelId::Gather { vec })?;
        let grid = (a.n_tokens.div_ceil(ROWS_PER_BLOCK), layers, buffers);
        // SAFETY: arguments mirror the `.param` list; slots are checked against
        // `num_rows` before any read of the pool; dense writes stay inside the
        // caller-checked extent; the host waits for the stream.
        unsafe {
            launch_on!(f, grid, ROW_BLOCK_THREADS, stream;
                a.k_src, a.v_src, a.src_layer_stride, a.k_dst, a.v_dst, a.dst_row_stride, a.dst_layer_stride,
                a.slots, a.n_tokens, a.vecs, a.num_rows, a.err
            )
        }
    }

    /// Launch `kv_move_*`.
    ///
    /// # Safety
    ///
    /// `k`/`v` hold `layers` layers of `num_rows` rows of `vecs * vec` bytes at
    /// `layer_stride`; `src_slots` and `dst_slots` hold `n_pairs` u32 each. (Overlapping
    /// source and destination sets only make the copied contents unspecified.)
    pub(crate) unsafe fn move_rows(
        &self,
        stream: CUstream,
        vec: u32,
        layers: u32,
        buffers: u32,
        a: &MoveArgs,
    ) -> Result<(), CudaKvError> {
        if a.n_pairs == 0 || layers == 0 {
            return Ok(());
        }
        let f = self.func(KernelId::Move { vec })?;
        let grid = (a.n_pairs.div_ceil(ROWS_PER_BLOCK), layers, buffers);
        // SAFETY: arguments mirror the `.param` list; both slots of a pair are checked
        // against `num_rows` before any access, so reads and writes stay in the layer;
        // the host waits for the stream.
        unsafe {
            launch_on!(f, grid, ROW_BLOCK_THREADS, stream;
                a.k, a.v, a.layer_stride, a.src_slots, a.dst_slots, a.n_pairs, a.vecs, a.num_rows, a.err
            )
        }
    }
}

/// Arguments of the allocation kernels, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AllocArgs {
    pub meta: DevicePointer<u32>,
    pub batch: u32,
    pub pages: DevicePointer<u32>,
    pub out: DevicePointer<u32>,
    pub table: DevicePointer<u32>,
    pub table_stride: u32,
    pub page_size: u32,
    pub flags: u32,
}

/// Arguments of `decode_step_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepArgs {
    pub records: DevicePointer<u32>,
    pub batch: u32,
    pub out: DevicePointer<u32>,
    pub table: DevicePointer<u32>,
    pub table_stride: u32,
    pub page_size: u32,
}

/// Arguments of `decode_delta_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeltaArgs {
    pub deltas: DevicePointer<u32>,
    pub state: DevicePointer<u32>,
    pub capacity: u32,
    pub bucket: u32,
    pub out: DevicePointer<u32>,
    pub table: DevicePointer<u32>,
    pub rows: u32,
    pub table_stride: u32,
    pub page_size: u32,
}

/// Arguments of `kv_scatter_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScatterArgs {
    pub k_src: DevicePointer<u8>,
    pub v_src: DevicePointer<u8>,
    pub src_row_stride: u64,
    pub src_layer_stride: u64,
    pub k_dst: DevicePointer<u8>,
    pub v_dst: DevicePointer<u8>,
    pub dst_layer_stride: u64,
    pub slots: DevicePointer<u32>,
    pub n_tokens: u32,
    pub vecs: u32,
    pub num_rows: u32,
    pub k_inv_scale: f32,
    pub v_inv_scale: f32,
    pub err: DevicePointer<u32>,
}

/// Arguments of `kv_scatter_mla_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlaArgs {
    pub nope_src: DevicePointer<u8>,
    pub nope_row_stride: u64,
    pub nope_layer_stride: u64,
    pub rope_src: DevicePointer<u8>,
    pub rope_row_stride: u64,
    pub rope_layer_stride: u64,
    pub dst: DevicePointer<u8>,
    pub dst_layer_stride: u64,
    pub slots: DevicePointer<u32>,
    pub n_tokens: u32,
    pub nope_vecs: u32,
    pub rope_vecs: u32,
    pub num_rows: u32,
    pub inv_scale: f32,
    pub err: DevicePointer<u32>,
}

/// Arguments of `kv_gather_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GatherArgs {
    pub k_src: DevicePointer<u8>,
    pub v_src: DevicePointer<u8>,
    pub src_layer_stride: u64,
    pub k_dst: DevicePointer<u8>,
    pub v_dst: DevicePointer<u8>,
    pub dst_row_stride: u64,
    pub dst_layer_stride: u64,
    pub slots: DevicePointer<u32>,
    pub n_tokens: u32,
    pub vecs: u32,
    pub num_rows: u32,
    pub err: DevicePointer<u32>,
}

/// Arguments of `kv_move_*`, in `.param` order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MoveArgs {
    pub k: DevicePointer<u8>,
    pub v: DevicePointer<u8>,
    pub layer_stride: u64,
    pub src_slots: DevicePointer<u32>,
    pub dst_slots: DevicePointer<u32>,
    pub n_pairs: u32,
    pub vecs: u32,
    pub num_rows: u32,
    pub err: DevicePointer<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_a_matching_launcher() {
        check_signatures().unwrap();
        assert_eq!(KernelId::all().len(), KERNELS.len());
        assert_eq!(KernelId::alloc(false, 16), KernelId::Alloc { decode: false, page_size: 16 });
        assert_eq!(KernelId::alloc(true, 12), KernelId::Alloc { decode: true, page_size: 0 });
        assert_eq!(KernelId::alloc(true, 12).name(), "alloc_decode_psn");
        assert_eq!(
            KernelId::ScatterMla { store: StoreKind::Fp8(SrcFloat::F16), vec: 2 }.name(),
            "kv_scatter_mla_fp8_f16_v2"
        );
    }
}
