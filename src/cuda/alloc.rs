//! [`DevicePagedAllocator`]: pages reserved on the host, expanded on the GPU.

use std::sync::Arc;

use cust::memory::{DeviceBuffer, DevicePointer, DeviceSlice, LockedBuffer};
use cust::sys::cuMemcpyHtoDAsync_v2;

use super::launch::{check, AllocArgs};
use super::stream::RawEvent;
use super::{CudaKvError, KvStream, ReqToTokenView};
use crate::alloc::{plan_decode, plan_extend, BatchPlan};
use crate::error::{ConfigError, FreeError, InvalidInput};
use crate::kv::ptx::{FLAG_LAST_LOC_FROM_ROWS, FLAG_WRITE_ROWS};
use crate::kv::staging::AllocRecord;
use crate::kv::KvError;
use crate::{KvAllocator, PagedAllocator};

/// Where the allocation kernels get each request's `last_loc` (the slot of its last
/// prefix token, read only when the prefix ends inside a page).
#[derive(Clone, Copy, Debug)]
pub enum LastLocs<'a> {
    /// From the host, one per request; checked like
    /// [`PagedAllocator::alloc_extend`] checks them.
    Host(&'a [u32]),
    /// From each request's row of the device table (column `prefix_len - 1`), inside
    /// the kernel: nothing crosses from the device to the host. The row must hold the
    /// request's prefix (the caller's contract: it is not checked).
    FromRows,
}

/// Page size 1: per request row, the slot of its last token as far as the host knows
/// (`u32::MAX`: not known), for the decode paths whose `last_loc`s are read on the
/// device (`remember_rows` here, [`DecodeGraphs`](super::DecodeGraphs)). Empty, and
/// never consulted, at other page sizes.
#[derive(Debug, Default)]
pub(super) struct RowTails(Box<[u32]>);

impl RowTails {
    /// One entry per row at page size 1, none otherwise (allocates, once).
    pub(super) fn new(page_size: u32, rows: u32) -> RowTails {
        RowTails(if page_size == 1 { vec![u32::MAX; rows as usize].into() } else { Box::default() })
    }

    /// Whether it keeps anything (page size 1).
    pub(super) fn is_on(&self) -> bool {
        !self.0.is_empty()
    }

    /// The last slot of the request in `rows[i]` (`u32::MAX` when not known).
    pub(super) fn last(&self, rows: &[u32], i: usize) -> u32 {
        rows.get(i).and_then(|&r| self.0.get(r as usize)).copied().unwrap_or(u32::MAX)
    }

    /// Row `row`'s last token is in `slot` (ignored for a row past the table).
    pub(super) fn set(&mut self, row: u32, slot: u32) {
        if let Some(t) = self.0.get_mut(row as usize) {
            *t = slot;
        }
    }
}

/// A batch whose pages are reserved and whose metadata is on its way to the device;
/// [`DevicePagedAllocator::expand`] turns it into slots (as often as wanted, until
/// the next batch is staged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedBatch {
    generation: u64,
    decode: bool,
    batch: u32,
    plan: BatchPlan,
    page_size: u32,
    flags: u32,
    table: Option<(u64, u32)>,
}

impl StagedBatch {
    /// Fresh pages reserved for the batch.
    pub fn new_pages(&self) -> usize {
        self.plan.new_pages
    }

    /// Slots the expansion writes.
    pub fn new_tokens(&self) -> usize {
        self.plan.new_tokens
    }

    /// Requests in the batch.
    pub fn batch(&self) -> usize {
        self.batch as usize
    }

    /// Whether the expansion also writes the request rows.
    pub fn writes_rows(&self) -> bool {
        self.flags & FLAG_WRITE_ROWS != 0
    }
}

/// A paged allocator whose batch expansion runs on the GPU.
///
/// The pages come from a shared, lock-free [`PagedAllocator`] (so other threads can
/// free finished requests' pages meanwhile); the host plans the batch, reserves its
/// pages all-or-nothing, writes a per-request table (prefix and sequence lengths,
/// `last_loc`, the page and output offsets, the row) into pinned memory and queues
/// one copy and one kernel launch on the stream the caller names: the kernel writes
/// every token's slot into `out` and, with a row table (kvpool's
/// [`DeviceReqToToken`](super::DeviceReqToToken) or any [`ReqToTokenView`]), into the
/// request rows. Nothing on this path allocates.
///
/// This is the eager path: the host waits for the previous batch's metadata copy
/// before it refills the (single) staging buffer. [`DecodeGraphs`](super::DecodeGraphs)
/// runs decode steps from captured graphs with double-buffered staging instead.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
/// use kvpool::cuda::{DevicePagedAllocator, DeviceReqToToken, KvDevice, LastLocs};
/// use kvpool::PagedAllocator;
/// use cust::memory::DeviceBuffer;
///
/// let dev = KvDevice::new(0)?;
/// let host = Arc::new(PagedAllocator::new(1 << 16, 16)?);
/// let mut alloc = DevicePagedAllocator::new(Arc::clone(&host), 256, 4096)?;
/// let table = DeviceReqToToken::new(256, 8192)?;
/// let out = DeviceBuffer::<u32>::zeroed(100)?;
/// // Request in row 3: no prefix, 100 new tokens.
/// let staged = alloc.alloc_extend(&dev, &[0], &[100], LastLocs::FromRows, Some((&table, &[3])), &out)?;
/// assert_eq!(staged.new_pages(), 7);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DevicePagedAllocator {
    host: Arc<PagedAllocator>,
    staging: LockedBuffer<u32>,
    meta: DeviceBuffer<u32>,
    /// Recorded after each host-to-device copy of `staging`: the next batch waits for
    /// it before overwriting the pinned buffer.
    copied: RawEvent,
    max_batch: usize,
    max_pages: usize,
    generation: u64,
    /// `(start, len)` of the latest batch's pages in `staging`.
    pages_at: (usize, usize),
    /// Page size 1, after [`remember_rows`](Self::remember_rows): per row, the last
    /// slot this allocator placed in it (`u32::MAX`: none). Empty otherwise.
    tails: RowTails,
}

impl core::fmt::Debug for DevicePagedAllocator {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DevicePagedAllocator")
            .field("host", &self.host)
            .field("max_batch", &self.max_batch)
            .field("max_pages", &self.max_pages)
            .finish()
    }
}

const META: usize = 6;

impl DevicePagedAllocator {
    /// A device-side expander over `host`, for batches of up to `max_batch` requests
    /// needing up to `max_pages` fresh pages (pinned and device staging are sized
    /// once, here).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a zero capacity, [`CudaKvError::Cuda`] when pinned
    /// or device memory cannot be had.
    pub fn new(host: Arc<PagedAllocator>, max_batch: usize, max_pages: usize) -> Result<Self, CudaKvError> {
        if max_batch == 0 {
            return Err(ConfigError::Zero("max_batch").into());
        }
        let words = max_batch
            .checked_mul(META)
            .and_then(|m| m.checked_add(max_pages))
            .filter(|&w| w <= u32::MAX as usize)
            .ok_or(ConfigError::TooLarge { size: max_pages as u64, page_size: host.page_size() })?;
        Ok(DevicePagedAllocator {
            staging: LockedBuffer::new(&0u32, words)?,
            meta: DeviceBuffer::zeroed(words)?,
            copied: RawEvent::new()?,
            host,
            max_batch,
            max_pages,
            generation: 0,
            pages_at: (0, 0),
            tails: RowTails::default(),
        })
    }

    /// At page size 1, remember the last slot each batch places in each of the first
    /// `rows` rows, so that a decode batch with [`LastLocs::FromRows`] continues each
    /// request's run where it can, as one with [`LastLocs::Host`] does (the host
    /// cannot read the rows, which live on the device). The rows' slots must be
    /// written through this allocator (its extends and decodes with a row table) for
    /// the runs to go on; a row written elsewhere only makes its next slot start a
    /// new run. At other page sizes it does nothing. Allocates `4 * rows` bytes, once.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use kvpool::cuda::{DevicePagedAllocator, DeviceReqToToken, KvDevice, LastLocs};
    /// use kvpool::PagedAllocator;
    /// use cust::memory::DeviceBuffer;
    ///
    /// let dev = KvDevice::new(0)?;
    /// let host = Arc::new(PagedAllocator::new(1 << 16, 1)?);
    /// let table = DeviceReqToToken::new(256, 8192)?;
    /// let mut alloc = DevicePagedAllocator::new(Arc::clone(&host), 256, 4096)?.remember_rows(table.rows());
    /// let out = DeviceBuffer::<u32>::zeroed(100)?;
    /// let staged = alloc.alloc_extend(&dev, &[0], &[100], LastLocs::FromRows, Some((&table, &[3])), &out)?;
    /// let prefill_end = *alloc.pages(&staged)?.last().unwrap();
    /// let one = DeviceBuffer::<u32>::zeroed(1)?;
    /// let staged = alloc.alloc_decode(&dev, &[101], LastLocs::FromRows, Some((&table, &[3])), &one)?;
    /// assert_eq!(alloc.pages(&staged)?, &[prefill_end + 1]); // the run goes on
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remember_rows(mut self, rows: u32) -> Self {
        self.tails = RowTails::new(self.host.page_size(), rows);
        self
    }

    /// The shared host allocator (for frees, counts, a prefix cache).
    pub fn allocator(&self) -> &Arc<PagedAllocator> {
        &self.host
    }

    /// The pages reserved for `batch` (to free them when its requests finish).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::StaleBatch`] once a newer batch was staged.
    pub fn pages(&self, batch: &StagedBatch) -> Result<&[u32], CudaKvError> {
        if batch.generation != self.generation {
            return Err(CudaKvError::StaleBatch);
        }
        Ok(&self.staging[self.pages_at.0..self.pages_at.0 + self.pages_at.1])
    }

    /// Free whole pages (as the host allocator's free of their first slots would).
    ///
    /// # Errors
    ///
    /// [`FreeError`] for a page that is not allocated; see [`PagedAllocator::free`].
    pub fn free_pages(&self, pages: &[u32]) -> Result<(), CudaKvError> {
        let ps = self.host.page_size();
        let mut group = self.host.free_group();
        for &p in pages {
            let slot = p.checked_mul(ps).unwrap_or(0);
            group.free(&[slot]).map_err(|e: FreeError| CudaKvError::Free(e))?;
        }
        group.end();
        Ok(())
    }

    /// Plan, check and reserve an extend batch and queue its metadata (see
    /// [`alloc_extend`](Self::alloc_extend)).
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend).
    pub fn stage_extend<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: LastLocs<'_>,
        rows: Option<(&ReqToTokenView, &[u32])>,
    ) -> Result<StagedBatch, CudaKvError> {
        let plan = plan_extend(self.host.page_size(), prefix_lens, seq_lens).map_err(KvError::from)?;
        self.stage(on.into(), false, plan, seq_lens, |i| prefix_lens[i], last_locs, rows, None)
    }

    /// Plan, check and reserve a decode batch and queue its metadata (see
    /// [`alloc_decode`](Self::alloc_decode)).
    ///
    /// # Errors
    ///
    /// As [`alloc_decode`](Self::alloc_decode).
    pub fn stage_decode<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        seq_lens: &[u32],
        last_locs: LastLocs<'_>,
        rows: Option<(&ReqToTokenView, &[u32])>,
    ) -> Result<StagedBatch, CudaKvError> {
        let plan = plan_decode(self.host.page_size(), seq_lens).map_err(KvError::from)?;
        self.stage(on.into(), true, plan, seq_lens, |i| seq_lens[i] - 1, last_locs, rows, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn stage(
        &mut self,
        on: KvStream<'_>,
        decode: bool,
        plan: BatchPlan,
        seq_lens: &[u32],
        prefix: impl Fn(usize) -> u32,
        last_locs: LastLocs<'_>,
        rows: Option<(&ReqToTokenView, &[u32])>,
        out_len: Option<usize>,
    ) -> Result<StagedBatch, CudaKvError> {
        let batch = seq_lens.len();
        let ps = self.host.page_size();
        if let Some(len) = out_len {
            if len != plan.new_tokens {
                return Err(KvError::Shape { what: "out", got: len, expected: plan.new_tokens }.into());
            }
        }
        if batch > self.max_batch {
            return Err(KvError::Shape { what: "batch (max_batch)", got: batch, expected: self.max_batch }.into());
        }
        if plan.new_pages > self.max_pages {
            return Err(KvError::Shape {
                what: "new pages (max_pages)",
                got: plan.new_pages,
                expected: self.max_pages,
            }
            .into());
        }
        if plan.new_tokens > u32::MAX as usize {
            return Err(KvError::Shape { what: "new tokens", got: plan.new_tokens, expected: u32::MAX as usize }.into());
        }
        let mut flags = 0;
        let mut table = None;
        if let Some((t, r)) = rows {
            if r.len() != batch {
                return Err(InvalidInput::LengthMismatch { what: "rows", got: r.len(), expected: batch }.into_kv());
            }
            for (&row, &seq) in r.iter().zip(seq_lens) {
                if row >= t.rows() {
                    return Err(KvError::SlotOutOfRange { slot: row, rows: t.rows() as usize }.into());
                }
                if seq > t.max_context_len() {
                    return Err(KvError::Shape {
                        what: "seq_len (max_context_len)",
                        got: seq as usize,
                        expected: t.max_context_len() as usize,
                    }
                    .into());
                }
            }
            flags |= FLAG_WRITE_ROWS;
            table = Some((t.device_address(), t.max_context_len()));
        }
        match last_locs {
            LastLocs::Host(l) => {
                if l.len() != batch {
                    return Err(
                        InvalidInput::LengthMismatch { what: "last_locs", got: l.len(), expected: batch }.into_kv()
                    );
                }
                if ps > 1 {
                    for (request, &last_loc) in l.iter().enumerate() {
                        let (p, s) = (prefix(request), seq_lens[request]);
                        if p % ps != 0 && s > p {
                            let ok = last_loc % ps == (p - 1) % ps && self.host.is_allocated(last_loc);
                            if !ok {
                                return Err(InvalidInput::BadLastLoc { request, last_loc }.into_kv());
                            }
                        }
                    }
                }
            }
            LastLocs::FromRows => {
                if rows.is_none() {
                    return Err(KvError::Format { what: "LastLocs::FromRows needs a row table" }.into());
                }
                flags |= FLAG_LAST_LOC_FROM_ROWS;
            }
        }
        // The previous batch's copy must have read the pinned buffer before we refill it.
        self.copied.synchronize()?;
        let words = META * batch + plan.new_pages;
        let (meta, pages) = self.staging[..words].split_at_mut(META * batch);
        let tails = &self.tails;
        match (last_locs, rows) {
            // A page-size-1 decode whose `last_loc`s the host knows: each request's run
            // goes on where it can, as on the host (`PagedAllocator::alloc_decode`).
            (LastLocs::Host(l), _) if decode => self.host.reserve_decode_pages(pages, |i| l[i])?,
            // ... or remembers (`remember_rows`).
            (LastLocs::FromRows, Some((_, r))) if decode && tails.is_on() => {
                self.host.reserve_decode_pages(pages, |i| tails.last(r, i))?
            }
            _ => self.host.reserve_pages(pages)?,
        }
        let records: &mut [AllocRecord] = bytemuck::cast_slice_mut(meta);
        let (mut page_start, mut out_start) = (0u32, 0u32);
        for (i, rec) in records.iter_mut().enumerate() {
            let (p, s) = (prefix(i), seq_lens[i]);
            *rec = AllocRecord {
                prefix_len: p,
                seq_len: s,
                last_loc: match last_locs {
                    LastLocs::Host(l) => l[i],
                    LastLocs::FromRows => 0,
                },
                page_start,
                out_start,
                row: rows.map_or(0, |(_, r)| r[i]),
            };
            page_start += crate::alloc::new_pages(ps, p, s);
            out_start += s - p;
        }
        let dst = self.meta.as_device_ptr().as_raw();
        // SAFETY: `staging` is pinned memory owned by `self` holding `words` u32, `meta`
        // a device buffer of at least `words` u32; the staging is not written again
        // before `copied` (recorded right after this copy on the same stream) has
        // completed — every `stage` waits for it first — and it outlives the copy
        // (dropping `self` frees it with `cuMemFreeHost`, after the event is destroyed;
        // the driver finishes pending copies first).
        let queued = check(
            unsafe { cuMemcpyHtoDAsync_v2(dst, self.staging.as_ptr().cast(), words * 4, on.raw()) },
            "cuMemcpyHtoDAsync",
        )
        .and_then(|()| self.copied.record(on.stream()));
        if let Err(e) = queued {
            let pages = self.staging[META * batch..words].to_vec();
            let _ = self.free_pages(&pages);
            return Err(e);
        }
        if let (true, Some((_, r))) = (self.tails.is_on(), rows) {
            // Page size 1: a request's new tokens are its pages, its last one the run's end.
            let pages = &self.staging[META * batch..words];
            let mut end = 0;
            for (i, &row) in r.iter().enumerate() {
                let n = (seq_lens[i] - prefix(i)) as usize;
                end += n;
                if n == 0 {
                    continue;
                }
                if let Some(&last) = pages.get(end - 1) {
                    self.tails.set(row, last);
                }
            }
        }
        self.generation += 1;
        self.pages_at = (META * batch, plan.new_pages);
        Ok(StagedBatch { generation: self.generation, decode, batch: batch as u32, plan, page_size: ps, flags, table })
    }

    /// Launch the expansion of a staged batch: `out` receives the batch's
    /// `new_tokens()` slots (request after request, as [`PagedAllocator::alloc_extend`]
    /// writes them) and, if the batch was staged with rows, `table` gets them too.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::StaleBatch`] after a newer `stage_*`; [`CudaKvError::Kv`] when
    /// `out` has the wrong length or `table` is not the one the batch was staged with;
    /// [`CudaKvError::Cuda`] if the launch fails.
    pub fn expand<'s>(
        &self,
        on: impl Into<KvStream<'s>>,
        batch: &StagedBatch,
        out: &DeviceSlice<u32>,
        table: Option<&ReqToTokenView>,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        if batch.generation != self.generation {
            return Err(CudaKvError::StaleBatch);
        }
        if out.len() != batch.plan.new_tokens {
            return Err(KvError::Shape { what: "out", got: out.len(), expected: batch.plan.new_tokens }.into());
        }
        let given = table.map(|t| (t.device_address(), t.max_context_len()));
        if given != batch.table {
            return Err(KvError::Format { what: "expand needs the row table the batch was staged with" }.into());
        }
        let b = batch.batch as usize;
        let meta = self.meta.as_device_ptr();
        let a = AllocArgs {
            meta,
            batch: batch.batch,
            pages: meta.wrapping_add(META * b),
            out: out.as_device_ptr(),
            table: table.map_or(DevicePointer::null(), |t| t.device_ptr()),
            table_stride: batch.table.map_or(0, |(_, s)| s),
            page_size: batch.page_size,
            flags: batch.flags,
        };
        // SAFETY: `meta` holds this generation's table, written by `stage` from a
        // validated plan (prefix sums of this very plan, pages reserved for it) and
        // queued on the same stream before this launch; `out` has `new_tokens` slots;
        // with flags set, `table` is the table whose bounds `stage` checked every row
        // and `seq_len` against. The staging buffers belong to `self`, which the
        // borrow keeps alive for the call, and are freed only through `Drop`.
        unsafe { on.kernels.alloc(on.raw(), batch.decode, &a) }
    }

    /// Allocate the new slots of an extend batch on the device: stage + expand.
    ///
    /// Request `i` grows from `prefix_lens[i]` to `seq_lens[i]` tokens; with `rows`
    /// `Some((table, rows))`, its slots are also written to columns
    /// `prefix_len..seq_len` of row `rows[i]`. The result equals
    /// [`PagedAllocator::alloc_extend`] on the same state, bit for bit.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a malformed batch (lengths, rows, bad `last_loc`, a
    /// batch larger than the staging), [`CudaKvError::Alloc`] when pages run out;
    /// nothing is reserved then. [`CudaKvError::Cuda`] from the driver (the pages are
    /// given back).
    pub fn alloc_extend<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: LastLocs<'_>,
        rows: Option<(&ReqToTokenView, &[u32])>,
        out: &DeviceSlice<u32>,
    ) -> Result<StagedBatch, CudaKvError> {
        let on = on.into();
        let plan = plan_extend(self.host.page_size(), prefix_lens, seq_lens).map_err(KvError::from)?;
        let staged = self.stage(on, false, plan, seq_lens, |i| prefix_lens[i], last_locs, rows, Some(out.len()))?;
        self.finish(on, staged, out, rows.map(|(t, _)| t))
    }

    /// Allocate one slot per request of a decode batch on the device (the new token is
    /// counted in `seq_lens`), writing it to column `seq_len - 1` of each row too when
    /// `rows` is given.
    ///
    /// At page size 1 with [`LastLocs::Host`], each request's slot continues its run
    /// where it can, as [`PagedAllocator::alloc_decode`](crate::PagedAllocator::alloc_decode) places it. With
    /// [`LastLocs::FromRows`] the host does not see the rows: it continues the runs it
    /// remembers after [`remember_rows`](Self::remember_rows), and otherwise takes the
    /// pages in claim order.
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend).
    pub fn alloc_decode<'s>(
        &mut self,
        on: impl Into<KvStream<'s>>,
        seq_lens: &[u32],
        last_locs: LastLocs<'_>,
        rows: Option<(&ReqToTokenView, &[u32])>,
        out: &DeviceSlice<u32>,
    ) -> Result<StagedBatch, CudaKvError> {
        let on = on.into();
        let plan = plan_decode(self.host.page_size(), seq_lens).map_err(KvError::from)?;
        let staged = self.stage(on, true, plan, seq_lens, |i| seq_lens[i] - 1, last_locs, rows, Some(out.len()))?;
        self.finish(on, staged, out, rows.map(|(t, _)| t))
    }

    fn finish(
        &mut self,
        on: KvStream<'_>,
        staged: StagedBatch,
        out: &DeviceSlice<u32>,
        table: Option<&ReqToTokenView>,
    ) -> Result<StagedBatch, CudaKvError> {
        if let Err(e) = self.expand(on, &staged, out, table) {
            let (at, n) = self.pages_at;
            for k in 0..n {
                let page = self.staging[at + k];
                let _ = self.free_pages(&[page]);
            }
            self.generation += 1;
            return Err(e);
        }
        Ok(staged)
    }
}

trait IntoKv {
    fn into_kv(self) -> CudaKvError;
}

impl IntoKv for InvalidInput {
    fn into_kv(self) -> CudaKvError {
        CudaKvError::Kv(KvError::from(self))
    }
}
