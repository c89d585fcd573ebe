//! [`DeviceReqToToken`]: SGLang's `req_to_token` table on the GPU.

use core::ops::Range;

use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer};

use super::{CudaKvError, KvDevice};
use crate::error::ConfigError;
use crate::kv::KvError;

/// A `[rows, max_context_len]` table of `u32` KV slots on the device: row `r` holds
/// the slot of every token of the request that owns row `r` (row ownership is the
/// caller's, e.g. through a host [`ReqToTokenPool`](crate::ReqToTokenPool) whose
/// [`ReqRow::index`](crate::ReqRow::index) names the row).
///
/// The allocation kernels write new slots straight into it
/// ([`DevicePagedAllocator`](super::DevicePagedAllocator)); attention kernels read it.
pub struct DeviceReqToToken {
    table: DeviceBuffer<u32>,
    rows: u32,
    max_context_len: u32,
}

impl core::fmt::Debug for DeviceReqToToken {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceReqToToken")
            .field("rows", &self.rows)
            .field("max_context_len", &self.max_context_len)
            .finish()
    }
}

impl DeviceReqToToken {
    /// A zeroed table (slot 0 is the padding slot).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a zero `max_context_len` or a table past `u32`
    /// cells' addressing; [`CudaKvError::Cuda`] when the device is out of memory.
    pub fn new(rows: u32, max_context_len: u32) -> Result<DeviceReqToToken, CudaKvError> {
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
        Ok(DeviceReqToToken { table: DeviceBuffer::zeroed(cells as usize)?, rows, max_context_len })
    }

    /// Rows.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// Cells per row.
    pub fn max_context_len(&self) -> u32 {
        self.max_context_len
    }

    pub(crate) fn device_ptr(&self) -> DevicePointer<u32> {
        self.table.as_device_ptr()
    }

    fn cells(&self, row: u32, start: usize, len: usize) -> Result<Range<usize>, KvError> {
        let max = self.max_context_len as usize;
        if row >= self.rows {
            return Err(KvError::SlotOutOfRange { slot: row, rows: self.rows as usize });
        }
        match start.checked_add(len) {
            Some(end) if end <= max => {
                let base = row as usize * max;
                Ok(base + start..base + end)
            }
            _ => Err(KvError::Shape { what: "row columns", got: start.saturating_add(len), expected: max }),
        }
    }

    /// Write `slots` into row `row` at columns `start..` (waits for the stream first,
    /// so it lands after every kernel queued before).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a row past the table or columns past `max_context_len`;
    /// [`CudaKvError::Cuda`].
    pub fn write(&self, dev: &KvDevice, row: u32, start: usize, slots: &[u32]) -> Result<(), CudaKvError> {
        let r = self.cells(row, start, slots.len())?;
        dev.synchronize()?;
        let mut dst = self.table.index(r);
        dst.copy_from(slots)?;
        Ok(())
    }

    /// Read columns `range` of row `row` into `out` (waits for the stream first).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write); `out` must have the range's length.
    pub fn read(&self, dev: &KvDevice, row: u32, range: Range<usize>, out: &mut [u32]) -> Result<(), CudaKvError> {
        let len = range.end.saturating_sub(range.start);
        let r = self.cells(row, range.start, len)?;
        if out.len() != len {
            return Err(KvError::Shape { what: "out", got: out.len(), expected: len }.into());
        }
        dev.synchronize()?;
        self.table.index(r).copy_to(out)?;
        Ok(())
    }
}
