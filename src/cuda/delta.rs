//! [`DeltaDecode`]: the decode step from captured graphs, staging only what changed.
//!
//! [`DecodeGraphs`](super::DecodeGraphs) stages one record per request per step, so
//! at 1,024 requests the host's planning and the records' trip to the device set the
//! pace. `DeltaDecode` keeps each request's state (row, length, `last_loc`, current
//! page: [`DeltaSlot`](crate::kv::delta::DeltaSlot)) in device memory, one record per
//! batch index, and the graph's kernel (`decode_delta_*`) advances it itself. The host
//! ([`DeltaPlanner`]) stages only the changes: requests that joined, left or were
//! extended, and the fresh page of each request whose next token starts a page (at
//! page size 16, one request in 16 per step). The kernel reads that list in place from
//! pinned, device-mapped staging: the counts, up to 128 page entries (8 bytes each)
//! and 8 full entries (16 bytes) in one round trip.
//!
//! # Why a staging buffer is never overwritten while the device may read it
//!
//! Step `n` uses buffer `n % 2`. Once its kernel has read the block (after the
//! block-wide barrier that follows applying the entries) thread 0 copies the step's
//! tag (word 2, [`StagedDelta::tag`]) to word 3 with a system-scope store. Step `n + 2`
//! reads word 3 (an atomic load of pinned memory, no driver call): when it holds step
//! `n`'s tag, nothing will read the buffer again and the host rewrites it. Otherwise
//! (the host is two steps ahead, or the device faulted) it falls back to event `n % 2`,
//! which each graph records itself after its kernel (an external event-record node
//! captured into the graph, so a step costs one driver call, `cuGraphLaunch`), and
//! waits for it: a fault comes back as a typed error there.
//!
//! # Why the device state stays consistent
//!
//! Steps must run in the order they were staged: each one applies its changes to the
//! state the previous one left. On one stream that is stream order; a step queued on
//! another stream than the previous step first waits (on the device, no host
//! synchronization) for the previous step's event. Whatever the state holds, the
//! kernel writes only inside its buffers: table writes are guarded by the table's
//! shape, state writes by its capacity.

use core::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer, DeviceSlice, LockedBuffer};
use cust::stream::{Stream, StreamFlags};
use cust::sys::{cuEventRecordWithFlags, cuStreamWaitEvent, CUevent_record_flags_enum, CUstream};

use super::graph::{capture, free_pages, mapped_address, GraphExec, MAX_BUCKET};
use super::launch::{check, DeltaArgs, KvKernels};
use super::stream::RawEvent;
use super::{CudaKvError, KvDevice, ReqToTokenView, StreamRef};
use crate::kv::delta::{delta_block_words, DeltaPlanner, DeltaSlot, StagedDelta};
use crate::kv::staging::{bucket_for, RowLimits};
use crate::kv::KvError;
use crate::{KvAllocator, PagedAllocator};

/// One step launched by [`DeltaDecode::step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaStep {
    generation: u64,
    half: usize,
    staged: StagedDelta,
}

impl DeltaStep {
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

    /// Entries it staged: changed batch indices (full entries) plus unchanged
    /// page-starting requests (page entries).
    pub fn entries(&self) -> usize {
        self.staged.full + self.staged.paged
    }
}

/// The decode step's allocation and row write from captured CUDA graphs, with the
/// requests' state on the device and only the changes staged.
///
/// The batch lives here: [`join`](Self::join) adds a request (its row already holds
/// its prefill, queued before the next step on the step's stream) at batch index
/// `batch()`; [`leave`](Self::leave) removes one, moving the last request into its
/// index (`Vec::swap_remove` order: the engine permutes its own per-request arrays the
/// same way); [`set_len`](Self::set_len) follows an extend of a live request. Each
/// [`step`](Self::step) then gives every request one token: slot `i` of
/// [`slots`](Self::slots) is batch index `i`'s, padding indices get the dummy slot 0.
/// Host work per step is O(changes + page-starting requests), no heap allocation, no
/// host synchronization (except waiting, via an event, when the host is two steps
/// ahead of the device).
///
/// Results equal [`DecodeGraphs`](super::DecodeGraphs), the eager
/// [`DevicePagedAllocator::alloc_decode`](super::DevicePagedAllocator::alloc_decode) and
/// the host reference for the same batch order: the fresh pages go to page-starting
/// requests in batch order. At page size 1 each request's slot continues its run where
/// it can, as [`PagedAllocator::alloc_decode`] places it with the request's last slot
/// as its `last_loc` (the same pages as `DecodeGraphs` and the eager path given the
/// same last slots): the planner remembers the slot each step gave a request, and
/// [`set_last_slot`](Self::set_last_slot) says where a prefill or an extend ended.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
/// use kvpool::cuda::{DeltaDecode, DeviceReqToToken, KvDevice};
/// use kvpool::PagedAllocator;
///
/// let dev = KvDevice::new(0)?;
/// let host = Arc::new(PagedAllocator::new(1 << 20, 16)?);
/// let table = DeviceReqToToken::new(1024, 8192)?;
/// let mut delta = DeltaDecode::new(&dev, Arc::clone(&host), &table, 1024)?;
/// // Rows 3 and 9 hold 40 and 16 tokens (written by their prefill).
/// assert_eq!(delta.join(3, 40)?, 0);
/// assert_eq!(delta.join(9, 16)?, 1);
/// let step = delta.step(dev.stream())?;
/// let slots = delta.slots(&step); // the forward pass, queued after, reads these
/// assert_eq!(delta.pages(&step)?.len(), 1); // row 9 started a page: keep it to free later
/// assert_eq!(delta.page_owners(&step)?, &[1]);
/// delta.leave(0)?; // row 3 finished: row 9's request moves to index 0
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeltaDecode<'t> {
    // Graphs first: destroyed before the memory they name.
    graphs: Vec<[GraphExec; 2]>,
    done: [RawEvent; 2],
    staging: [LockedBuffer<u32>; 2],
    /// Each step's fresh pages and their batch indices, per staging buffer (host
    /// memory: the pinned staging is written, never read, by the host).
    fresh: [Vec<u32>; 2],
    owners: [Vec<u32>; 2],
    state: DeviceBuffer<u32>,
    out: DeviceBuffer<u32>,
    host: Arc<PagedAllocator>,
    planner: DeltaPlanner,
    max_bucket: usize,
    next: usize,
    generation: u64,
    /// The step each staging buffer holds.
    held: [Option<DeltaStep>; 2],
    /// The raw handle of the stream the last step ran on.
    last_stream: Option<usize>,
    _table: PhantomData<&'t ReqToTokenView>,
}

impl core::fmt::Debug for DeltaDecode<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeltaDecode")
            .field("max_bucket", &self.max_bucket)
            .field("batch", &self.planner.batch())
            .field("generation", &self.generation)
            .finish()
    }
}

impl<'t> DeltaDecode<'t> {
    /// Capture the graphs for batches of up to `max_batch` requests (rounded up to a
    /// power of two, at most [`MAX_BUCKET`]) over `table` (borrowed for as long as the
    /// graphs exist: they read and write it), and set up the device state (every batch
    /// index empty).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for `max_batch` 0, [`CudaKvError::Kv`] above
    /// [`MAX_BUCKET`]; [`CudaKvError::Cuda`] / [`CudaKvError::Driver`] when memory, a
    /// stream or a capture cannot be had.
    pub fn new(
        dev: &KvDevice,
        host: Arc<PagedAllocator>,
        table: &'t ReqToTokenView,
        max_batch: usize,
    ) -> Result<DeltaDecode<'t>, CudaKvError> {
        if max_batch == 0 {
            return Err(crate::error::ConfigError::Zero("max_batch").into());
        }
        if max_batch > MAX_BUCKET {
            return Err(KvError::Shape { what: "max_batch (MAX_BUCKET)", got: max_batch, expected: MAX_BUCKET }.into());
        }
        let max_bucket = bucket_for(max_batch);
        let limits = RowLimits { rows: table.rows(), max_context_len: table.max_context_len() };
        let planner = DeltaPlanner::new(host.page_size(), limits, max_bucket)?;
        let words = delta_block_words(max_bucket);
        let staging = [LockedBuffer::new(&0u32, words)?, LockedBuffer::new(&0u32, words)?];
        let mapped = [mapped_address(&staging[0])?, mapped_address(&staging[1])?];
        let pad: Vec<DeltaSlot> = vec![DeltaSlot::PAD; max_bucket];
        let state = DeviceBuffer::from_slice(bytemuck::cast_slice::<DeltaSlot, u32>(&pad))?;
        let out = DeviceBuffer::<u32>::zeroed(max_bucket)?;
        let capture_stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
        let done = [RawEvent::new()?, RawEvent::new()?];
        let mut graphs = Vec::new();
        let mut bucket = 1;
        while bucket <= max_bucket {
            let one = |half: usize| {
                capture(&capture_stream, |s| {
                    Self::queue_step(
                        dev.kernels(),
                        s,
                        mapped[half],
                        &state,
                        max_bucket,
                        &out,
                        table,
                        host.page_size(),
                        bucket,
                    )?;
                    // SAFETY: a live event of this context and the capturing stream:
                    // captured as an event-record node after the kernel.
                    let flags = CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32;
                    check(unsafe { cuEventRecordWithFlags(done[half].as_raw(), s, flags) }, "cuEventRecordWithFlags")
                })
            };
            graphs.push([one(0)?, one(1)?]);
            bucket *= 2;
        }
        Ok(DeltaDecode {
            graphs,
            done,
            staging,
            fresh: [vec![0; max_bucket], vec![0; max_bucket]],
            owners: [vec![0; max_bucket], vec![0; max_bucket]],
            state,
            out,
            host,
            planner,
            max_bucket,
            next: 0,
            generation: 0,
            held: [None, None],
            last_stream: None,
            _table: PhantomData,
        })
    }

    /// Queue (here: capture) one step of `bucket` batch indices reading its delta
    /// block at device address `deltas`.
    #[allow(clippy::too_many_arguments)]
    fn queue_step(
        kernels: &KvKernels,
        stream: CUstream,
        deltas: u64,
        state: &DeviceBuffer<u32>,
        capacity: usize,
        out: &DeviceBuffer<u32>,
        table: &ReqToTokenView,
        page_size: u32,
        bucket: usize,
    ) -> Result<(), CudaKvError> {
        let a = DeltaArgs {
            deltas: DevicePointer::from_raw(deltas),
            state: state.as_device_ptr(),
            capacity: capacity as u32,
            bucket: bucket as u32,
            out: out.as_device_ptr(),
            table: table.device_ptr(),
            rows: table.rows(),
            table_stride: table.max_context_len(),
            page_size,
        };
        // SAFETY: `deltas` is the device mapping of a pinned staging buffer of
        // `delta_block_words(capacity)` words, written by `DeltaPlanner::stage` before
        // each launch of the graph and not rewritten before that launch's kernel has
        // copied the step's tag to word 3 (it reads the block no more after that) or
        // the event the graph records after the kernel has completed; `state` holds `capacity` records of
        // `DELTA_STATE_BYTES` (4 words each) and `out` `capacity >= bucket` slots; the
        // table view's shape is passed as it is (rows * stride < 2^32, checked by the
        // view). The staging, `state` and `out` are owned by the `DeltaDecode` that
        // owns (and destroys first) the graphs; `table` outlives them (`'t`). Steps
        // touching `state` are ordered (`step` waits on the previous step's event
        // when the stream changes).
        unsafe { kernels.decode_delta(stream, &a) }
    }

    /// Add a request whose row `row` holds its first `len` tokens (its prefill,
    /// queued before the next step on that step's stream). Returns its batch index.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the batch is full, `row` is past the table or `len`
    /// past a row; nothing changes then.
    pub fn join(&mut self, row: u32, len: u32) -> Result<u32, CudaKvError> {
        Ok(self.planner.join(row, len)?)
    }

    /// Remove the request at batch index `index`; the last request moves into
    /// `index`. Returns the index it came from (`None` when `index` was the last).
    /// Freeing the request's pages is the caller's business (as after
    /// [`DecodeGraphs::step`](super::DecodeGraphs::step)).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for an index past the batch.
    pub fn leave(&mut self, index: u32) -> Result<Option<u32>, CudaKvError> {
        Ok(self.planner.leave(index)?)
    }

    /// The request at `index` now has `len` tokens in its row (an extend queued
    /// before the next step on its stream).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for an index past the batch or `len` past a row.
    pub fn set_len(&mut self, index: u32, len: u32) -> Result<(), CudaKvError> {
        Ok(self.planner.set_len(index, len)?)
    }

    /// At page size 1: the request at `index` has its last token in `slot` (the end of
    /// its prefill or extend), so that its next slot continues that run where it can
    /// (see [`DeltaPlanner::set_last_slot`]; a hint only). At other page sizes it does
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for an index past the batch.
    pub fn set_last_slot(&mut self, index: u32, slot: u32) -> Result<(), CudaKvError> {
        Ok(self.planner.set_last_slot(index, slot)?)
    }

    /// Requests in the batch.
    pub fn batch(&self) -> usize {
        self.planner.batch()
    }

    /// The tokens request `index` has, after the steps launched so far.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for an index past the batch.
    pub fn len(&self, index: u32) -> Result<u32, CudaKvError> {
        Ok(self.planner.len(index)?)
    }

    /// The row of request `index`.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for an index past the batch.
    pub fn row(&self, index: u32) -> Result<u32, CudaKvError> {
        Ok(self.planner.row(index)?)
    }

    /// The host planner (read-only: lengths, rows, the clock).
    pub fn planner(&self) -> &DeltaPlanner {
        &self.planner
    }

    /// Stage and launch one decode step on `stream`: every request of the batch gets
    /// one token, written to [`slots`](Self::slots) (by batch index) and to its row.
    ///
    /// Waits only when the staging buffer this step needs is still in use by the step
    /// before the previous one (the host is two steps ahead of the device).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when a request would pass the end of its row, or when pages
    /// run out; nothing is reserved or changed then. [`CudaKvError::Driver`] /
    /// [`CudaKvError::Cuda`] if the launch fails (the pages are given back, and the
    /// next step stages the same changes again).
    pub fn step<'s>(&mut self, stream: impl Into<StreamRef<'s>>) -> Result<DeltaStep, CudaKvError> {
        let stream = stream.into();
        let half = self.next;
        // The graph that last read this buffer (two steps ago) must be past reading it.
        if let Some(prev) = self.held[half] {
            if self.returned_tag(half) != prev.staged.tag {
                self.done[half].synchronize()?;
            }
        }
        let staged =
            self.planner.stage(&self.host, &mut self.staging[half], &mut self.fresh[half], &mut self.owners[half])?;
        let graph = &self.graphs[staged.bucket.trailing_zeros() as usize][half];
        let raw = stream.as_raw() as usize;
        // The graph records `done[half]` itself.
        if let Err(e) = self.order_after_previous(stream, raw).and_then(|()| graph.launch(stream)) {
            let _ = free_pages(&self.host, &self.fresh[half][..staged.new_pages]);
            return Err(e);
        }
        self.planner.commit();
        self.last_stream = Some(raw);
        self.generation += 1;
        self.next ^= 1;
        let step = DeltaStep { generation: self.generation, half, staged };
        self.held[half] = Some(step);
        Ok(step)
    }

    /// On a stream other than the last step's, wait (on the device) for the last
    /// step's graph first: the state is carried from step to step.
    fn order_after_previous(&self, stream: StreamRef<'_>, raw: usize) -> Result<(), CudaKvError> {
        match self.last_stream {
            Some(last) if last != raw => {
                let prev = &self.done[self.next ^ 1];
                // SAFETY: a stream valid for the call and a live event of this
                // context; flags 0.
                check(unsafe { cuStreamWaitEvent(stream.as_raw(), prev.as_raw(), 0) }, "cuStreamWaitEvent")
            }
            _ => Ok(()),
        }
    }

    /// Whether the next [`step`](Self::step) can stage without waiting.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`] / [`CudaKvError::Driver`] for an asynchronous fault.
    pub fn next_staging_free(&self) -> Result<bool, CudaKvError> {
        match self.held[self.next] {
            Some(prev) if self.returned_tag(self.next) == prev.staged.tag => Ok(true),
            _ => self.done[self.next].is_done(),
        }
    }

    /// Word 3 of staging buffer `half`: the tag of the last step whose kernel has read
    /// it (written by the device through the buffer's mapping).
    fn returned_tag(&self, half: usize) -> u32 {
        let word = self.staging[half].as_ptr().wrapping_add(3).cast::<AtomicU32>();
        // SAFETY: the buffer holds `delta_block_words(..) >= 4` words, lives as long as
        // `self`, and is 4-byte aligned; word 3 is written only by the device (never
        // by the host after `new`), so reading it as an atomic races with nothing the
        // Rust side does. `Acquire`: the host's writes to the buffer come after.
        unsafe { (*word).load(Ordering::Acquire) }
    }

    fn check_held(&self, step: &DeltaStep) -> Result<(), CudaKvError> {
        if self.held[step.half] != Some(*step) {
            return Err(CudaKvError::StaleBatch);
        }
        Ok(())
    }

    /// The fresh pages `step` reserved, in batch order (one per request whose new
    /// token started a page): keep them to free when the requests finish.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::StaleBatch`] once `step`'s staging buffer was reused (two steps
    /// later).
    pub fn pages(&self, step: &DeltaStep) -> Result<&[u32], CudaKvError> {
        self.check_held(step)?;
        Ok(&self.fresh[step.half][..step.staged.new_pages])
    }

    /// The batch index of each of [`pages`](Self::pages), as of `step` (a later
    /// [`leave`](Self::leave) may move a request).
    ///
    /// # Errors
    ///
    /// As [`pages`](Self::pages).
    pub fn page_owners(&self, step: &DeltaStep) -> Result<&[u32], CudaKvError> {
        self.check_held(step)?;
        Ok(&self.owners[step.half][..step.staged.new_pages])
    }

    /// The device slots of the latest step, one per bucket entry (padding entries get
    /// 0); they are overwritten by the next step's graph, in stream order.
    pub fn slots(&self, step: &DeltaStep) -> DeviceSlice<u32> {
        self.out.index(..step.staged.bucket)
    }

    /// The device state (one `DeltaSlot` per batch index), copied to the host after a
    /// synchronize of the context: for tests and debugging.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`].
    pub fn read_state(&self) -> Result<Vec<DeltaSlot>, CudaKvError> {
        // SAFETY: no arguments; waits for the current context's work.
        check(unsafe { cust::sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        let mut words = vec![0u32; self.state.len()];
        self.state.copy_to(&mut words[..])?;
        Ok(bytemuck::cast_slice(&words).to_vec())
    }

    /// The largest bucket captured (also the most requests a batch may hold).
    pub fn max_bucket(&self) -> usize {
        self.max_bucket
    }

    /// The shared host allocator.
    pub fn allocator(&self) -> &Arc<PagedAllocator> {
        &self.host
    }
}

impl Drop for DeltaDecode<'_> {
    fn drop(&mut self) {
        // Launched graphs read the staging and write the state and `out`: let them
        // finish before the buffers go (errors cannot be reported from a drop).
        for e in &self.done {
            let _ = e.synchronize();
        }
    }
}
