//! [`ReqToTokenView`]: SGLang's `req_to_token` table on the GPU at any address, and
//! [`DeviceReqToToken`], kvpool's own, which is one owner of such a view.

use core::ops::{Deref, Range};

use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer, DeviceSlice};

use super::{CudaKvError, KvStream};
use crate::error::ConfigError;
use crate::kv::KvError;

/// A `[rows, max_context_len]` table of `u32` KV slots at a device address, whoever
/// allocated it: row `r` holds the slot of every token of the request that owns row
/// `r` (row ownership is the caller's, e.g. through a host
/// [`ReqToTokenPool`](crate::ReqToTokenPool) whose [`ReqRow::index`](crate::ReqRow::index)
/// names the row).
///
/// The allocation kernels write new slots straight into it
/// ([`DevicePagedAllocator`](super::DevicePagedAllocator),
/// [`DecodeGraphs`](super::DecodeGraphs)); attention kernels read it.
///
/// Deliberately neither `Clone` nor `Copy`: borrowing a view (as
/// [`DecodeGraphs`](super::DecodeGraphs) does for as long as its graphs write into the
/// table) then borrows its owner too.
#[derive(Debug, PartialEq, Eq)]
pub struct ReqToTokenView {
    ptr: u64,
    rows: u32,
    max_context_len: u32,
}

impl ReqToTokenView {
    /// Describe a table at a caller address: `rows` rows of `max_context_len` `u32`
    /// cells, row after row.
    ///
    /// Checked: non-zero dimensions, at most `u32::MAX` cells (the kernels index cells
    /// with 32 bits), a 4-byte aligned address, and `rows * max_context_len * 4` bytes
    /// inside one allocation of the current context.
    ///
    /// # Safety
    ///
    /// The memory outlives the view and every launch that uses it, belongs to the
    /// current context (the device's primary context: see `docs/GPU.md`), and nobody
    /// else writes the cells kvpool's kernels write while they may run.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a zero or too large shape, [`CudaKvError::Kv`] for a
    /// misaligned or too small allocation, [`CudaKvError::NotDeviceMemory`] for an
    /// address the driver does not know.
    pub unsafe fn from_raw(ptr: u64, rows: u32, max_context_len: u32) -> Result<ReqToTokenView, CudaKvError> {
        let cells = Self::cells_for(rows, max_context_len)?;
        if ptr % 4 != 0 {
            return Err(KvError::Format { what: "the row table's address is not 4-byte aligned" }.into());
        }
        super::cache::check_allocation("row table", ptr, cells * 4)?;
        Ok(ReqToTokenView { ptr, rows, max_context_len })
    }

    fn cells_for(rows: u32, max_context_len: u32) -> Result<usize, CudaKvError> {
        if max_context_len == 0 {
            return Err(ConfigError::Zero("max_context_len").into());
        }
        if rows == 0 {
            return Err(ConfigError::Zero("rows").into());
        }
        let cells = rows as u64 * max_context_len as u64;
        if cells > u32::MAX as u64 {
            return Err(ConfigError::TooLarge { size: cells, page_size: 1 }.into());
        }
        Ok(cells as usize)
    }

    /// Rows.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// Cells per row.
    pub fn max_context_len(&self) -> u32 {
        self.max_context_len
    }

    /// The device address of cell `(0, 0)`.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn device_ptr(&self) -> DevicePointer<u32> {
        DevicePointer::from_raw(self.ptr)
    }

    fn cells(&self, row: u32, start: usize, len: usize) -> Result<DeviceSlice<u32>, KvError> {
        let max = self.max_context_len as usize;
        if row >= self.rows {
            return Err(KvError::SlotOutOfRange { slot: row, rows: self.rows as usize });
        }
        match start.checked_add(len) {
            Some(end) if end <= max => {
                let at = self.device_ptr().wrapping_add(row as usize * max + start);
                // SAFETY: cells `row * max + start .. + len` lie inside the table (just
                // checked), which the constructor's contract says exists.
                Ok(unsafe { DeviceSlice::from_raw_parts(at, len) })
            }
            _ => Err(KvError::Shape { what: "row columns", got: start.saturating_add(len), expected: max }),
        }
    }

    /// Write `slots` into row `row` at columns `start..` (waits for `on`'s stream first,
    /// so it lands after every kernel queued there before).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a row past the table or columns past `max_context_len`;
    /// [`CudaKvError::Cuda`].
    pub fn write<'s>(
        &self,
        on: impl Into<KvStream<'s>>,
        row: u32,
        start: usize,
        slots: &[u32],
    ) -> Result<(), CudaKvError> {
        let mut dst = self.cells(row, start, slots.len())?;
        on.into().synchronize()?;
        dst.copy_from(slots)?;
        Ok(())
    }

    /// Read columns `range` of row `row` into `out` (waits for the stream first).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write); `out` must have the range's length.
    pub fn read<'s>(
        &self,
        on: impl Into<KvStream<'s>>,
        row: u32,
        range: Range<usize>,
        out: &mut [u32],
    ) -> Result<(), CudaKvError> {
        // A reversed range is an error, not an empty read.
        let Some(len) = range.end.checked_sub(range.start) else {
            return Err(
                KvError::Shape { what: "range end (before its start)", got: range.end, expected: range.start }.into()
            );
        };
        let src = self.cells(row, range.start, len)?;
        if out.len() != len {
            return Err(KvError::Shape { what: "out", got: out.len(), expected: len }.into());
        }
        on.into().synchronize()?;
        src.copy_to(out)?;
        Ok(())
    }
}

/// A `[rows, max_context_len]` slot table in kvpool's own device memory: one owner of
/// a [`ReqToTokenView`] (every operation is the view's, through `Deref`).
pub struct DeviceReqToToken {
    view: ReqToTokenView,
    _table: DeviceBuffer<u32>,
}

impl core::fmt::Debug for DeviceReqToToken {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceReqToToken")
            .field("rows", &self.view.rows)
            .field("max_context_len", &self.view.max_context_len)
            .finish()
    }
}

impl Deref for DeviceReqToToken {
    type Target = ReqToTokenView;
    fn deref(&self) -> &ReqToTokenView {
        &self.view
    }
}

impl DeviceReqToToken {
    /// A zeroed table (slot 0 is the padding slot) in the current context.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a zero `max_context_len` or a table past `u32`
    /// cells' addressing; [`CudaKvError::Cuda`] when the device is out of memory.
    pub fn new(rows: u32, max_context_len: u32) -> Result<DeviceReqToToken, CudaKvError> {
        let cells = ReqToTokenView::cells_for(rows, max_context_len)?;
        let table = DeviceBuffer::<u32>::zeroed(cells)?;
        // SAFETY: the table is this struct's own buffer of `rows * max_context_len`
        // cells, allocated in the current context and freed only with the struct (the
        // view is a plain description; anything launched through it borrows `self`).
        let view = unsafe { ReqToTokenView::from_raw(table.as_device_ptr().as_raw(), rows, max_context_len) }?;
        Ok(DeviceReqToToken { view, _table: table })
    }

    /// The view of the table (also reachable through `Deref`).
    pub fn view(&self) -> &ReqToTokenView {
        &self.view
    }
}
