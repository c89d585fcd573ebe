//! [`DecodeGraphs`]: the decode step's memory operations from captured CUDA graphs,
//! with no host synchronization; [`FloorGraph`], the smallest comparable graph.
//!
//! # How a step runs
//!
//! The host plans the step lock-free (which requests start a page), reserves those
//! pages from the shared [`PagedAllocator`], and writes one
//! [`AllocRecord`](crate::kv::staging::AllocRecord) per request plus the page numbers
//! into one of two pinned staging buffers ([`stage_decode`]). It then launches the graph
//! captured for the step's batch-size bucket and that buffer: a host-to-device copy of
//! the block and `alloc_decode` with the fused row write, `last_loc` read from the rows
//! on the device. Nothing waits for the device: the slots land in
//! [`DecodeGraphs::slots`] and in the request rows, in stream order, for the forward
//! pass queued after it.
//!
//! # Why a staging buffer is never overwritten while the device may read it
//!
//! Step `n` uses buffer `n % 2` and records event `n % 2` right after its graph on
//! the same stream. Step `n + 2`, the next to write that buffer, first waits for that
//! event, which completes only once step `n`'s graph, copy included, has run. So the
//! host writes step `n + 1` while step `n` runs, and blocks only when it is two steps
//! ahead of the device (`tests/gpu_decode.rs` holds the stream with a closed gate and
//! checks both the refusal and the results).

use core::marker::PhantomData;
use std::sync::Arc;

use cust::memory::{DeviceBuffer, DevicePointer, DeviceSlice, LockedBuffer};
use cust::stream::{Stream, StreamFlags};
use cust::sys::{
    cuGraphDestroy, cuGraphExecDestroy, cuGraphInstantiateWithFlags, cuGraphLaunch, cuMemHostGetDevicePointer_v2,
    cuMemcpyHtoDAsync_v2, cuStreamBeginCapture_v2, cuStreamEndCapture, CUgraph, CUgraphExec, CUstream,
    CUstreamCaptureMode,
};

use super::alloc::RowTails;
use super::launch::{check, KvKernels, StepArgs};
use super::stream::RawEvent;
use super::{CudaKvError, KvDevice, ReqToTokenView, StreamRef};
use crate::kv::staging::{
    bucket_for, decode_block_bytes, decode_records_bytes, stage_decode, stage_decode_after, RowLimits, StagedDecode,
};
use crate::kv::KvError;
use crate::{KvAllocator, PagedAllocator};

/// The largest batch-size bucket (buckets are the powers of two up to it).
pub const MAX_BUCKET: usize = 1024;

/// How a captured step's records reach the allocation kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// The graph copies the staging block to device memory (a memcpy node), then the
    /// kernel reads it there.
    Copy,
    /// The kernel reads the pinned staging block directly, through its device mapping
    /// (`cuMemHostGetDevicePointer`): no copy node, a few reads across the host link
    /// instead. Usually faster for blocks above a few hundred bytes, where a copy
    /// node's DMA set-up dominates (see `BENCHMARKS.md`).
    Mapped,
}

/// An instantiated graph.
#[derive(Debug)]
pub(super) struct GraphExec(CUgraphExec);

impl GraphExec {
    pub(super) fn launch(&self, stream: StreamRef<'_>) -> Result<(), CudaKvError> {
        // SAFETY: a live executable graph; the stream is valid for the call. What the
        // graph touches is the owner's business (see each owner's SAFETY notes).
        check(unsafe { cuGraphLaunch(self.0, stream.as_raw()) }, "cuGraphLaunch")
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: instantiated by `capture` and destroyed once; the driver lets
        // launches already queued finish.
        unsafe { cuGraphExecDestroy(self.0) };
    }
}

/// Record what `body` queues on `stream` into a graph and instantiate it. Nothing
/// runs: the queued work becomes the graph's nodes.
pub(super) fn capture(
    stream: &Stream,
    body: impl FnOnce(CUstream) -> Result<(), CudaKvError>,
) -> Result<GraphExec, CudaKvError> {
    let raw = stream.as_inner();
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream of the current context, not capturing yet.
    check(unsafe { cuStreamBeginCapture_v2(raw, mode) }, "cuStreamBeginCapture")?;
    let queued = body(raw);
    let mut graph: CUgraph = core::ptr::null_mut();
    // SAFETY: ends the capture begun above (also after a failed body, so the stream
    // leaves capture mode); `graph` receives the captured graph or stays null.
    let ended = check(unsafe { cuStreamEndCapture(raw, &mut graph) }, "cuStreamEndCapture");
    let result = queued.and(ended).and_then(|()| {
        let mut exec: CUgraphExec = core::ptr::null_mut();
        // SAFETY: a complete captured graph; default instantiation flags.
        check(unsafe { cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate")?;
        Ok(GraphExec(exec))
    });
    if !graph.is_null() {
        // SAFETY: the graph came from the capture; an instantiated graph no longer
        // needs it.
        unsafe { cuGraphDestroy(graph) };
    }
    result
}

/// Copy `bytes` bytes from pinned `src` to device `dst` on `stream`.
///
/// # Safety
///
/// `src` is pinned host memory and `dst` device memory of at least `bytes` bytes, both
/// alive until the copy (or every launch of a graph it was captured into) has run.
unsafe fn copy_htod(dst: u64, src: *const u32, bytes: usize, stream: CUstream) -> Result<(), CudaKvError> {
    // SAFETY: the caller's contract.
    check(unsafe { cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream) }, "cuMemcpyHtoDAsync")
}

/// One step launched by [`DecodeGraphs::step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeStep {
    generation: u64,
    half: usize,
    staged: StagedDecode,
}

impl DecodeStep {
    /// Requests in the step.
    pub fn batch(&self) -> usize {
        self.staged.batch
    }

    /// The bucket (captured batch size) it ran in.
    pub fn bucket(&self) -> usize {
        self.staged.bucket
    }

    /// Fresh pages it reserved.
    pub fn new_pages(&self) -> usize {
        self.staged.new_pages
    }
}

/// The decode step's allocation and row write from captured CUDA graphs.
///
/// Built over a shared [`PagedAllocator`] and a request table ([`ReqToTokenView`]:
/// kvpool's [`DeviceReqToToken`](super::DeviceReqToToken) or an engine's own memory),
/// it captures at construction one graph per batch-size bucket (1, 2, 4, .. up to the
/// bucket of `max_batch`, at most [`MAX_BUCKET`]) and per staging buffer. Each
/// [`step`](Self::step) then costs the host a lock-free plan, a few stores into pinned
/// memory and one `cuGraphLaunch`; it never synchronizes with the device (except to
/// wait, via an event, when the host runs two steps ahead of it) and never allocates.
///
/// Padding requests of a bucket get the dummy slot 0 and touch no row, as SGLang pads
/// its captured batch sizes. The slots written from the same fresh pages equal the
/// eager [`DevicePagedAllocator::alloc_decode`](super::DevicePagedAllocator::alloc_decode)
/// with [`LastLocs::FromRows`](super::LastLocs::FromRows) and the host reference. The
/// pages themselves are the eager path's at page sizes above 1. At page size 1 they
/// are [`PagedAllocator::alloc_decode`]'s with each row's last slot as its
/// `last_loc` (each request's run goes on where it can; see [`step`](Self::step)):
/// the graphs remember the slot they gave each row, and
/// [`set_last_slot`](Self::set_last_slot) tells them where a prefill ended.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
/// use kvpool::cuda::{DecodeGraphs, DeviceReqToToken, KvDevice, Staging};
/// use kvpool::PagedAllocator;
///
/// let dev = KvDevice::new(0)?;
/// let host = Arc::new(PagedAllocator::new(1 << 20, 16)?);
/// let table = DeviceReqToToken::new(1024, 8192)?;
/// let mut graphs = DecodeGraphs::new(&dev, Arc::clone(&host), &table, 1024, Staging::Mapped)?;
/// // Rows 3 and 9 hold 40 and 16 tokens (written by their prefill); each gets one more.
/// let step = graphs.step(dev.stream(), &[41, 17], &[3, 9])?;
/// let slots = graphs.slots(&step); // the forward pass, queued after, reads these
/// let fresh = graphs.pages(&step)?; // row 9 started a page: keep it to free later
/// assert_eq!(fresh.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DecodeGraphs<'t> {
    // Graphs first: destroyed before the memory they name.
    graphs: Vec<[GraphExec; 2]>,
    done: [RawEvent; 2],
    staging: [LockedBuffer<u32>; 2],
    _meta: DeviceBuffer<u32>,
    out: DeviceBuffer<u32>,
    host: Arc<PagedAllocator>,
    limits: RowLimits,
    max_bucket: usize,
    next: usize,
    generation: u64,
    /// The step each staging buffer holds.
    held: [Option<DecodeStep>; 2],
    /// At page size 1: per row, the slot of its last token as far as the host knows
    /// (the slot the last step gave it, or what [`set_last_slot`](Self::set_last_slot)
    /// said; `u32::MAX` when not known). Empty at other page sizes.
    tails: RowTails,
    _table: PhantomData<&'t ReqToTokenView>,
}

impl core::fmt::Debug for DecodeGraphs<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DecodeGraphs")
            .field("max_bucket", &self.max_bucket)
            .field("generation", &self.generation)
            .finish()
    }
}

impl<'t> DecodeGraphs<'t> {
    /// Capture the graphs for batches of up to `max_batch` requests over `table`
    /// (borrowed for as long as the graphs exist: they write into it), with the records
    /// reaching the kernel as `staging` says.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for `max_batch` 0 or above [`MAX_BUCKET`];
    /// [`CudaKvError::Cuda`] / [`CudaKvError::Driver`] when memory, a stream or a
    /// capture cannot be had.
    pub fn new(
        dev: &KvDevice,
        host: Arc<PagedAllocator>,
        table: &'t ReqToTokenView,
        max_batch: usize,
        staging: Staging,
    ) -> Result<DecodeGraphs<'t>, CudaKvError> {
        if max_batch == 0 {
            return Err(crate::error::ConfigError::Zero("max_batch").into());
        }
        if max_batch > MAX_BUCKET {
            return Err(KvError::Shape { what: "max_batch (MAX_BUCKET)", got: max_batch, expected: MAX_BUCKET }.into());
        }
        let max_bucket = bucket_for(max_batch);
        let words = decode_block_bytes(max_bucket) / 4;
        let mode = staging;
        let staging = [LockedBuffer::new(&0u32, words)?, LockedBuffer::new(&0u32, words)?];
        let meta = DeviceBuffer::<u32>::zeroed(words)?;
        let mapped = [mapped_address(&staging[0])?, mapped_address(&staging[1])?];
        let out = DeviceBuffer::<u32>::zeroed(max_bucket)?;
        let tails = RowTails::new(host.page_size(), table.rows());
        let capture_stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
        let mut graphs = Vec::new();
        let mut bucket = 1;
        while bucket <= max_bucket {
            let one = |half: usize| {
                capture(&capture_stream, |s| {
                    let src = match mode {
                        Staging::Copy => Source::Copy(&staging[half], &meta),
                        Staging::Mapped => Source::Mapped(mapped[half]),
                    };
                    Self::queue_step(dev.kernels(), s, src, &out, table, host.page_size(), bucket)
                })
            };
            graphs.push([one(0)?, one(1)?]);
            bucket *= 2;
        }
        Ok(DecodeGraphs {
            graphs,
            done: [RawEvent::new()?, RawEvent::new()?],
            staging,
            _meta: meta,
            out,
            host,
            limits: RowLimits { rows: table.rows(), max_context_len: table.max_context_len() },
            max_bucket,
            next: 0,
            generation: 0,
            held: [None, None],
            tails,
            _table: PhantomData,
        })
    }

    /// At page size 1: row `row`'s last token sits in `slot` (the end of its prefill,
    /// or of an extend), so that its next step's slot continues that run when the slot
    /// after it is free. The graphs remember the slot each step gives a row by
    /// themselves; this tells them what happened to the row elsewhere. A hint only:
    /// without it, or with a stale slot, the row's next slot starts a new run instead
    /// (see [`step`](Self::step)). At other page sizes it does nothing.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a row past the table.
    pub fn set_last_slot(&mut self, row: u32, slot: u32) -> Result<(), CudaKvError> {
        if row >= self.limits.rows {
            return Err(KvError::SlotOutOfRange { slot: row, rows: self.limits.rows as usize }.into());
        }
        self.tails.set(row, slot);
        Ok(())
    }

    /// Queue (here: capture) one step of `bucket` requests whose records come from
    /// `src`.
    fn queue_step(
        kernels: &KvKernels,
        stream: CUstream,
        src: Source<'_>,
        out: &DeviceBuffer<u32>,
        table: &ReqToTokenView,
        page_size: u32,
        bucket: usize,
    ) -> Result<(), CudaKvError> {
        let records = match src {
            Source::Copy(staging, meta) => {
                // SAFETY: `staging` is pinned and `meta` is device memory, both of
                // `decode_block_bytes(max_bucket) >= bytes` bytes and owned by the
                // `DecodeGraphs` that owns (and destroys first) the graphs this is
                // captured into.
                let bytes = decode_records_bytes(bucket);
                unsafe { copy_htod(meta.as_device_ptr().as_raw(), staging.as_ptr(), bytes, stream) }?;
                meta.as_device_ptr().as_raw()
            }
            Source::Mapped(addr) => addr,
        };
        let a = StepArgs {
            records: DevicePointer::from_raw(records),
            batch: bucket as u32,
            out: out.as_device_ptr(),
            table: table.device_ptr(),
            table_stride: table.max_context_len(),
            page_size,
        };
        // SAFETY: every launch of the graph reads `bucket` records that `stage_decode`
        // wrote before the launch (copied to `meta` by the node above, or read in place
        // through the pinned buffer's device mapping): rows below `table.rows()`,
        // `1 <= seq_len <= max_context_len` (checked there), padding records with
        // `PAD_ROW`; each request's row holds its earlier slots (the caller's contract
        // of `step`); `out` has `max_bucket >= bucket` slots; `table` outlives the
        // graphs (`'t`), the other buffers are owned alongside them; the host does not
        // rewrite a staging block before the event recorded after its launch completes.
        unsafe { kernels.decode_step(stream, &a) }
    }

    /// Plan, stage and launch one decode step on `stream`: request `i` (row `rows[i]`)
    /// grows to `seq_lens[i]` tokens; its row must hold its first `seq_lens[i] - 1`
    /// slots (its prefill and earlier steps, queued before on this stream). The step's
    /// slots are written to [`slots`](Self::slots) and to each row's column
    /// `seq_lens[i] - 1`.
    ///
    /// Waits only when the staging buffer this step needs is still in use by the step
    /// before the previous one (the host is two steps ahead of the device).
    ///
    /// At page size 1 each request's slot continues its row's run where it can: the
    /// slot after the one this row got last step (or was given by
    /// [`set_last_slot`](Self::set_last_slot)) when it is free, else a new run
    /// ([`stage_decode_after`]: the rule of
    /// [`PagedAllocator::alloc_decode`](crate::PagedAllocator::alloc_decode)). At other
    /// page sizes the fresh pages go to page-starting requests in batch order.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a malformed batch (see [`stage_decode`]) or one larger
    /// than `max_batch`'s bucket, out of pages included; nothing is reserved then.
    /// [`CudaKvError::Driver`] / [`CudaKvError::Cuda`] if the launch fails (the pages
    /// are given back).
    pub fn step<'s>(
        &mut self,
        stream: impl Into<StreamRef<'s>>,
        seq_lens: &[u32],
        rows: &[u32],
    ) -> Result<DecodeStep, CudaKvError> {
        let stream = stream.into();
        let bucket = bucket_for(seq_lens.len());
        if bucket > self.max_bucket {
            return Err(
                KvError::Shape { what: "batch (max_batch)", got: seq_lens.len(), expected: self.max_bucket }.into()
            );
        }
        let half = self.next;
        // The graph that last read this buffer (two steps ago) must have run.
        self.done[half].synchronize()?;
        let words = decode_block_bytes(bucket) / 4;
        let block = &mut self.staging[half][..words];
        let block: &mut [u8] = bytemuck::cast_slice_mut(block);
        let staged = if self.tails.is_on() {
            let tails = &self.tails;
            stage_decode_after(&self.host, seq_lens, rows, bucket, self.limits, block, |i| tails.last(rows, i))?
        } else {
            stage_decode(&self.host, seq_lens, rows, bucket, self.limits, block)?
        };
        let graph = &self.graphs[bucket.trailing_zeros() as usize][half];
        if let Err(e) = graph.launch(stream).and_then(|()| self.done[half].record(stream)) {
            let fresh = 4 * bucket..4 * bucket + staged.new_pages;
            let _ = free_pages(&self.host, &self.staging[half][fresh]);
            return Err(e);
        }
        if self.tails.is_on() {
            // Page size 1: every request took a page, its slot, in request order.
            let at = 4 * bucket;
            for (&row, &slot) in rows.iter().zip(&self.staging[half][at..at + staged.new_pages]) {
                self.tails.set(row, slot);
            }
        }
        self.generation += 1;
        self.next ^= 1;
        let step = DecodeStep { generation: self.generation, half, staged };
        self.held[half] = Some(step);
        Ok(step)
    }

    /// Whether the next [`step`](Self::step) can stage without waiting: its staging
    /// buffer's last graph has run.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] / [`CudaKvError::Driver`] for an asynchronous fault.
    pub fn next_staging_free(&self) -> Result<bool, CudaKvError> {
        self.done[self.next].is_done()
    }

    /// The fresh pages `step` reserved, in request order (a request takes one when its
    /// new token starts a page): keep them to free when the requests finish.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::StaleBatch`] once `step`'s staging buffer was reused (two steps
    /// later).
    pub fn pages(&self, step: &DecodeStep) -> Result<&[u32], CudaKvError> {
        if self.held[step.half] != Some(*step) {
            return Err(CudaKvError::StaleBatch);
        }
        let at = 4 * step.staged.bucket;
        Ok(&self.staging[step.half][at..at + step.staged.new_pages])
    }

    /// The device slots of the latest step, one per bucket entry (padding entries get
    /// 0); they are overwritten by the next step's graph, in stream order.
    pub fn slots(&self, step: &DecodeStep) -> DeviceSlice<u32> {
        self.out.index(..step.staged.bucket)
    }

    /// The largest bucket captured.
    pub fn max_bucket(&self) -> usize {
        self.max_bucket
    }

    /// The shared host allocator.
    pub fn allocator(&self) -> &Arc<PagedAllocator> {
        &self.host
    }
}

impl Drop for DecodeGraphs<'_> {
    fn drop(&mut self) {
        // Launched graphs read the staging and write `out`: let them finish before the
        // buffers go (errors cannot be reported from a drop).
        for e in &self.done {
            let _ = e.synchronize();
        }
    }
}

/// Where a captured step reads its records.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Copied from this pinned buffer into this device buffer by the graph.
    Copy(&'a LockedBuffer<u32>, &'a DeviceBuffer<u32>),
    /// Read in place at this device address (a pinned buffer's mapping).
    Mapped(u64),
}

/// The device address of pinned host memory (`cuMemAllocHost` memory is mapped into
/// the device's address space).
pub(super) fn mapped_address(buf: &LockedBuffer<u32>) -> Result<u64, CudaKvError> {
    let mut d: u64 = 0;
    // SAFETY: an out-parameter and the start of a live pinned allocation; flags 0.
    let r = unsafe { cuMemHostGetDevicePointer_v2(&mut d, buf.as_ptr() as *mut _, 0) };
    check(r, "cuMemHostGetDevicePointer")?;
    Ok(d)
}

pub(super) fn free_pages(host: &PagedAllocator, pages: &[u32]) -> Result<(), crate::error::FreeError> {
    let ps = host.page_size();
    let mut group = host.free_group();
    for &p in pages {
        group.free(&[p * ps])?;
    }
    group.end();
    Ok(())
}

/// The floor a decode step is measured against: a captured graph holding one
/// host-to-device copy of the same bytes and one empty kernel.
pub struct FloorGraph {
    graph: GraphExec,
    _staging: LockedBuffer<u32>,
    _meta: DeviceBuffer<u32>,
}

impl core::fmt::Debug for FloorGraph {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FloorGraph").finish()
    }
}

impl FloorGraph {
    /// Capture a copy of `bytes` bytes (rounded up to 4; none for 0) and
    /// `noop<<<1, 128>>>`.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] / [`CudaKvError::Driver`].
    pub fn new(dev: &KvDevice, bytes: usize) -> Result<FloorGraph, CudaKvError> {
        let words = bytes.div_ceil(4).max(1);
        let staging = LockedBuffer::new(&0u32, words)?;
        let meta = DeviceBuffer::<u32>::zeroed(words)?;
        let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
        let graph = capture(&stream, |s| {
            if bytes > 0 {
                // SAFETY: pinned and device buffers of `words` u32, owned by the
                // returned `FloorGraph` together with (and dropped after) the graph.
                unsafe { copy_htod(meta.as_device_ptr().as_raw(), staging.as_ptr(), words * 4, s) }?;
            }
            dev.kernels().noop(s, 1, 128)
        })?;
        Ok(FloorGraph { graph, _staging: staging, _meta: meta })
    }

    /// Launch the graph on `stream`.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Driver`] / [`CudaKvError::Cuda`].
    pub fn launch<'s>(&self, stream: impl Into<StreamRef<'s>>) -> Result<(), CudaKvError> {
        self.graph.launch(stream.into())
    }
}

impl Drop for FloorGraph {
    fn drop(&mut self) {
        // Launches may still read the buffers: wait for the context before they go.
        // SAFETY: no arguments; waits for the current context's work.
        let _ = unsafe { cust::sys::cuCtxSynchronize() };
    }
}
