//! The records the allocation kernels read, and the host side of a decode step.
//!
//! An allocation batch reaches the device as bytes: one [`AllocRecord`] per request
//! (a `#[repr(C)]` [`Pod`] struct, the layout the generated kernels read), followed by
//! the batch's fresh page numbers. A decode step of a captured graph uses a compact
//! record instead, [`StepRecord`] (16 bytes: one vector load, with the fresh page
//! itself rather than its index): [`stage_decode`] plans the step, reserves its pages
//! from the shared [`PagedAllocator`] (lock-free), writes one record per request,
//! pads the bucket with [`StepRecord::PAD`] records (slot 0, no row access) and keeps
//! the fresh pages, in request order, after the records for the host. It never
//! allocates and never touches the device: the CUDA layer
//! (`DecodeGraphs` in the `cuda` module, feature `cuda`) uploads the block and launches the captured graph.

use bytemuck::{Pod, Zeroable};

use super::ptx::{PAD_ROW, RECORD_BYTES, STEP_RECORD_BYTES};
use super::KvError;
use crate::error::InvalidInput;
use crate::{KvAllocator, PagedAllocator};

/// One request of an allocation batch, as the allocation kernels read it.
///
/// `page_start` and `out_start` are the exclusive prefix sums of the batch's fresh
/// pages and new tokens; `row` is the request's row of the `req_to_token` table
/// ([`PAD_ROW`] for a padding record).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AllocRecord {
    /// Tokens the request already has.
    pub prefix_len: u32,
    /// Tokens it has after the batch.
    pub seq_len: u32,
    /// The slot of its last prefix token (read only when the prefix ends inside a page
    /// and `last_loc` does not come from the rows).
    pub last_loc: u32,
    /// Its first fresh page's index in the batch's page list.
    pub page_start: u32,
    /// Its first new token's index in the batch's output.
    pub out_start: u32,
    /// Its row of the request table.
    pub row: u32,
}

// The kernels read records of exactly this size (kernels_build's RECORD_BYTES).
const _: () = assert!(core::mem::size_of::<AllocRecord>() == RECORD_BYTES as usize);

impl AllocRecord {
    /// A padding record of a decode bucket: its output is the dummy slot 0, and no row
    /// is read or written.
    pub const PAD: AllocRecord =
        AllocRecord { prefix_len: 0, seq_len: 1, last_loc: 0, page_start: 0, out_start: 0, row: PAD_ROW };
}

/// One request of a graph decode step, as `decode_step_*` reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct StepRecord {
    /// Tokens the request has after the step (its new token is at `seq_len - 1`).
    pub seq_len: u32,
    /// Its row of the request table ([`PAD_ROW`] for padding).
    pub row: u32,
    /// The fresh page its new token starts (read only when `(seq_len - 1) % page_size
    /// == 0`).
    pub page: u32,
    /// Unused (keeps records 16 bytes, one vector load).
    pub unused: u32,
}

const _: () = assert!(core::mem::size_of::<StepRecord>() == STEP_RECORD_BYTES as usize);

impl StepRecord {
    /// A padding record: its output is the dummy slot 0, and no row is touched.
    pub const PAD: StepRecord = StepRecord { seq_len: 1, row: PAD_ROW, page: 0, unused: 0 };
}

/// Bytes of the records of a decode block for a bucket of `bucket` requests (what the
/// device reads).
pub const fn decode_records_bytes(bucket: usize) -> usize {
    bucket * STEP_RECORD_BYTES as usize
}

/// Bytes of a decode block for a bucket of `bucket` requests: the records, then room
/// for `bucket` page numbers (a decode request takes at most one fresh page; the host
/// keeps them there to hand back, the device does not read them).
pub const fn decode_block_bytes(bucket: usize) -> usize {
    decode_records_bytes(bucket) + bucket * 4
}

/// What [`stage_decode`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedDecode {
    /// Requests in the step.
    pub batch: usize,
    /// The bucket it was padded to.
    pub bucket: usize,
    /// Fresh pages reserved (they sit after the records, in request order).
    pub new_pages: usize,
}

/// The limits a decode step is checked against: the request table's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLimits {
    /// Rows of the table.
    pub rows: u32,
    /// Cells per row.
    pub max_context_len: u32,
}

/// Plan a decode step, reserve its pages and write its block into `block`
/// (`decode_block_bytes(bucket)` bytes, 4-byte aligned): request `i` grows to
/// `seq_lens[i]` tokens in row `rows[i]`; its `last_loc` is read from the row on the
/// device, so the host needs nothing from the device. Requests `batch..bucket` are
/// padding.
///
/// Nothing allocates; on error nothing is reserved.
///
/// # Errors
///
/// [`KvError::Shape`] for mismatched lengths, a batch larger than `bucket`, a block of
/// the wrong size or a `seq_len` past the row; [`KvError::SlotOutOfRange`] for a row
/// past the table; [`KvError::Alloc`] for a zero `seq_len` or when pages run out.
///
/// # Examples
///
/// ```
/// use kvpool::kv::staging::{decode_block_bytes, stage_decode, RowLimits, StepRecord};
/// use kvpool::PagedAllocator;
/// let host = PagedAllocator::new(1024, 16)?;
/// let mut block = vec![0u32; decode_block_bytes(4) / 4];
/// let limits = RowLimits { rows: 8, max_context_len: 64 };
/// // Request in row 5 writes its 17th token: it starts a page.
/// let staged = stage_decode(&host, &[17, 3], &[5, 6], 4, limits, bytemuck::cast_slice_mut(&mut block))?;
/// assert_eq!((staged.batch, staged.bucket, staged.new_pages), (2, 4, 1));
/// let records: &[StepRecord] = bytemuck::cast_slice(&block[..4 * 4]);
/// assert_eq!((records[0].seq_len, records[0].row), (17, 5));
/// assert_eq!(records[0].page, block[16]); // the fresh page, kept after the records too
/// assert_eq!(records[3], StepRecord::PAD);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stage_decode(
    host: &PagedAllocator,
    seq_lens: &[u32],
    rows: &[u32],
    bucket: usize,
    limits: RowLimits,
    block: &mut [u8],
) -> Result<StagedDecode, KvError> {
    let batch = seq_lens.len();
    if rows.len() != batch {
        return Err(KvError::Shape { what: "rows", got: rows.len(), expected: batch });
    }
    if batch > bucket {
        return Err(KvError::Shape { what: "batch (bucket)", got: batch, expected: bucket });
    }
    if block.len() != decode_block_bytes(bucket) {
        return Err(KvError::Shape { what: "block", got: block.len(), expected: decode_block_bytes(bucket) });
    }
    let ps = host.page_size();
    // Whether a request's new token (position `seq - 1`) starts a page: a mask for the
    // usual power-of-two page sizes (this loop runs once per request per step).
    let mask = if ps.is_power_of_two() { ps - 1 } else { 0 };
    let starts = |seq: u32| if mask != 0 || ps == 1 { (seq - 1) & mask == 0 } else { (seq - 1) % ps == 0 };
    let mut fresh = 0usize;
    for (request, (&seq, &row)) in seq_lens.iter().zip(rows).enumerate() {
        if seq == 0 {
            return Err(InvalidInput::EmptyDecode { request }.into());
        }
        if row >= limits.rows {
            return Err(KvError::SlotOutOfRange { slot: row, rows: limits.rows as usize });
        }
        if seq > limits.max_context_len {
            return Err(KvError::Shape {
                what: "seq_len (max_context_len)",
                got: seq as usize,
                expected: limits.max_context_len as usize,
            });
        }
        fresh += starts(seq) as usize;
    }
    let (head, tail) = block.split_at_mut(decode_records_bytes(bucket));
    let records: &mut [StepRecord] = bytemuck::try_cast_slice_mut(head)
        .map_err(|_| KvError::Format { what: "the staging block is not 4-byte aligned" })?;
    let pages: &mut [u32] = bytemuck::try_cast_slice_mut(tail)
        .map_err(|_| KvError::Format { what: "the staging block is not 4-byte aligned" })?;
    host.reserve_pages(&mut pages[..fresh])?;
    let mut next = 0;
    for (i, rec) in records.iter_mut().enumerate() {
        *rec = match (seq_lens.get(i), rows.get(i)) {
            (Some(&seq_len), Some(&row)) => {
                let start = starts(seq_len);
                let page = if start { pages[next] } else { 0 };
                next += start as usize;
                StepRecord { seq_len, row, page, unused: 0 }
            }
            _ => StepRecord::PAD,
        };
    }
    Ok(StagedDecode { batch, bucket, new_pages: fresh })
}

/// The smallest power of two at least `batch` (at least 1): the captured bucket a
/// decode step of `batch` requests runs in.
pub fn bucket_for(batch: usize) -> usize {
    batch.max(1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_padding() {
        let host = PagedAllocator::new(256, 4).unwrap();
        let mut block = vec![0u32; decode_block_bytes(4) / 4];
        let limits = RowLimits { rows: 4, max_context_len: 32 };
        let b: &mut [u8] = bytemuck::cast_slice_mut(&mut block);
        // seq 5 and 9 start pages (positions 4 and 8), seq 3 does not.
        let s = stage_decode(&host, &[5, 3, 9], &[0, 1, 2], 4, limits, b).unwrap();
        assert_eq!(s, StagedDecode { batch: 3, bucket: 4, new_pages: 2 });
        let records: &[StepRecord] = bytemuck::cast_slice(&block[..16]);
        let pages = &block[16..18];
        assert_eq!(records[0], StepRecord { seq_len: 5, row: 0, page: pages[0], unused: 0 });
        assert_eq!(records[1], StepRecord { seq_len: 3, row: 1, page: 0, unused: 0 });
        assert_eq!(records[2], StepRecord { seq_len: 9, row: 2, page: pages[1], unused: 0 });
        assert_eq!(records[3], StepRecord::PAD);
        assert!(pages.iter().all(|&p| host.is_allocated(p * 4)));
        assert_eq!(host.available_pages(), 64 - 2);
    }

    #[test]
    fn page_starts_agree_with_the_allocator_plan() {
        for ps in [1u32, 2, 3, 5, 16, 64, 100] {
            let host = PagedAllocator::new(1 << 14, ps).unwrap();
            let seqs: Vec<u32> = (1..=300).collect();
            let rows = vec![0u32; 300];
            let mut block = vec![0u32; decode_block_bytes(512) / 4];
            let limits = RowLimits { rows: 1, max_context_len: 300 };
            let s = stage_decode(&host, &seqs, &rows, 512, limits, bytemuck::cast_slice_mut(&mut block)).unwrap();
            assert_eq!(s.new_pages, crate::alloc::plan_decode(ps, &seqs).unwrap().new_pages, "page size {ps}");
            let records: &[StepRecord] = bytemuck::cast_slice(&block[..4 * 512]);
            for (r, &seq) in records.iter().zip(&seqs) {
                assert_eq!(r.page != 0, crate::alloc::new_pages(ps, seq - 1, seq) == 1, "page size {ps} seq {seq}");
            }
        }
    }

    #[test]
    fn refusals_reserve_nothing() {
        let host = PagedAllocator::new(64, 4).unwrap();
        let mut block = vec![0u32; decode_block_bytes(2) / 4];
        let limits = RowLimits { rows: 4, max_context_len: 32 };
        let b: &mut [u8] = bytemuck::cast_slice_mut(&mut block);
        assert!(matches!(stage_decode(&host, &[1, 1, 1], &[0, 1, 2], 2, limits, b), Err(KvError::Shape { .. })));
        assert!(matches!(stage_decode(&host, &[1], &[4], 2, limits, b), Err(KvError::SlotOutOfRange { .. })));
        assert!(matches!(stage_decode(&host, &[33], &[0], 2, limits, b), Err(KvError::Shape { .. })));
        assert!(matches!(stage_decode(&host, &[0], &[0], 2, limits, b), Err(KvError::Alloc(_))));
        assert!(matches!(stage_decode(&host, &[1], &[0], 1, limits, b), Err(KvError::Shape { what: "block", .. })));
        assert_eq!(host.available_pages(), 16);
        // Out of pages: 17 requests each starting a page, 16 pages.
        let mut big = vec![0u32; decode_block_bytes(32) / 4];
        let limits = RowLimits { rows: 32, max_context_len: 32 };
        let rows: Vec<u32> = (0..17).collect();
        let r = stage_decode(&host, &[1; 17], &rows, 32, limits, bytemuck::cast_slice_mut(&mut big));
        assert!(matches!(r, Err(KvError::Alloc(_))));
        assert_eq!(host.available_pages(), 16);
        assert_eq!(bucket_for(0), 1);
        assert_eq!(bucket_for(3), 4);
        assert_eq!(bucket_for(1024), 1024);
    }
}
