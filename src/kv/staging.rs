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
//!
//! At page size 1, [`stage_decode_after`] takes each request's last slot as a hint and
//! places the step's slots as [`PagedAllocator::alloc_decode`] does: each request's run
//! goes on where the slot after it is free, so its decoded tokens end up in long runs
//! rather than one slot per step. `DecodeGraphs` keeps those last slots per row.

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
    stage(host, seq_lens, rows, bucket, limits, block, None::<fn(usize) -> u32>)
}

/// [`stage_decode`] for a host that knows where each request's run of slots ends:
/// at page size 1, request `i`'s slot is `last_slot(i) + 1` when that slot is free,
/// and otherwise starts a new run where there is room after it, the rule of
/// [`PagedAllocator::alloc_decode`] with `last_locs[i] = last_slot(i)` (the same
/// slots from the same state). So a request's decoded tokens lie in long runs of
/// slots rather than one slot per step, wherever the pool allows; a prefix cache
/// that later takes them in works per run.
///
/// `last_slot(i)` is only a hint: `u32::MAX` (not known), a stale slot or an
/// allocated one changes where the slot goes, never whether it is right (it is a
/// free slot, claimed all or nothing like every other). At larger page sizes
/// `last_slot` is not called, and the result is `stage_decode`'s.
///
/// # Errors
///
/// As [`stage_decode`].
///
/// # Examples
///
/// ```
/// use kvpool::kv::staging::{decode_block_bytes, stage_decode_after, RowLimits};
/// use kvpool::{KvAllocator, PagedAllocator};
/// let host = PagedAllocator::new(1024, 1)?;
/// let mut block = vec![0u32; decode_block_bytes(2) / 4];
/// let limits = RowLimits { rows: 8, max_context_len: 64 };
/// let mut prefill = [0u32; 8];
/// host.alloc(&mut prefill)?; // slots 1..=8: rows 2 (1..=4) and 3 (5..=8)
/// let last = [4u32, 8];
/// let staged = stage_decode_after(&host, &[5, 5], &[2, 3], 2, limits, bytemuck::cast_slice_mut(&mut block), |i| last[i])?;
/// let at = 2 * 4; // the fresh pages sit after the two 16-byte records
/// // Row 2's run cannot go on (slot 5 is row 3's): it starts a new run. Row 3's does.
/// assert_eq!(block[at + 1], 9);
/// assert_ne!(block[at], 5);
/// assert_eq!(staged.new_pages, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stage_decode_after(
    host: &PagedAllocator,
    seq_lens: &[u32],
    rows: &[u32],
    bucket: usize,
    limits: RowLimits,
    block: &mut [u8],
    last_slot: impl Fn(usize) -> u32,
) -> Result<StagedDecode, KvError> {
    stage(host, seq_lens, rows, bucket, limits, block, Some(last_slot))
}

fn stage(
    host: &PagedAllocator,
    seq_lens: &[u32],
    rows: &[u32],
    bucket: usize,
    limits: RowLimits,
    block: &mut [u8],
    last_slot: Option<impl Fn(usize) -> u32>,
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
    match last_slot {
        // Page size 1: every request starts a page, so page `i` is request `i`'s slot.
        Some(after) if ps == 1 => host.reserve_decode_pages(&mut pages[..fresh], after)?,
        _ => host.reserve_pages(&mut pages[..fresh])?,
    }
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
pub(super) mod tests {
    use super::*;

    /// xorshift64: the tests' walks, the same every run.
    pub(in crate::kv) struct Rng(pub(in crate::kv) u64);

    impl Rng {
        pub(in crate::kv) fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

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

    /// Page size 1: `stage_decode_after` on one pool and `alloc_decode` on a twin, fed
    /// the same last slots (or `u32::MAX` where the host does not know one), hand out
    /// the same slots at every step of a walk of joins, finishes and decode steps.
    #[test]
    fn following_places_as_alloc_decode() {
        let (n_rows, size) = (24u32, 3000usize);
        let staged_side = PagedAllocator::new(size, 1).unwrap();
        let twin = PagedAllocator::new(size, 1).unwrap();
        let limits = RowLimits { rows: n_rows, max_context_len: 1 << 20 };
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        // Per row: its slots (the same on both sides), and whether its last is known.
        let mut held: Vec<Option<(Vec<u32>, bool)>> = vec![None; n_rows as usize];
        let mut block = vec![0u32; decode_block_bytes(32) / 4];
        let (mut steps, mut continued, mut placed, mut unknown) = (0, 0, 0, 0);
        while steps < 600 {
            let dice = rng.below(100);
            let row = rng.below(n_rows as u64) as usize;
            if dice < 20 && held[row].is_none() {
                let n = 1 + rng.below(120) as usize;
                let (mut a, mut b) = (vec![0u32; n], vec![0u32; n]);
                if staged_side.alloc(&mut a).is_ok() {
                    twin.alloc(&mut b).unwrap();
                    assert_eq!(a, b);
                    held[row] = Some((a, rng.below(3) != 0));
                }
            } else if dice < 30 {
                if let Some((slots, _)) = held[row].take() {
                    staged_side.free(&slots).unwrap();
                    twin.free(&slots).unwrap();
                }
            } else {
                let rows: Vec<u32> = (0..n_rows).filter(|&r| held[r as usize].is_some()).collect();
                if rows.is_empty() {
                    continue;
                }
                let lasts: Vec<u32> = rows
                    .iter()
                    .map(|&r| match &held[r as usize] {
                        Some((s, true)) => *s.last().unwrap(),
                        _ => u32::MAX,
                    })
                    .collect();
                let seqs: Vec<u32> =
                    rows.iter().map(|&r| held[r as usize].as_ref().unwrap().0.len() as u32 + 1).collect();
                let bucket = bucket_for(rows.len());
                let b: &mut [u8] = bytemuck::cast_slice_mut(&mut block[..decode_block_bytes(bucket) / 4]);
                let got = stage_decode_after(&staged_side, &seqs, &rows, bucket, limits, b, |i| lasts[i]);
                let mut want = vec![0u32; rows.len()];
                let twin_got = twin.alloc_decode(&seqs, &lasts, &mut want);
                match (got, twin_got) {
                    (Ok(s), Ok(())) => {
                        assert_eq!(s.new_pages, rows.len());
                        let at = decode_records_bytes(bucket) / 4;
                        assert_eq!(&block[at..at + rows.len()], &want[..], "step {steps}");
                        let records: &[StepRecord] = bytemuck::cast_slice(&block[..at]);
                        for ((r, &slot), &last) in records.iter().zip(&want).zip(&lasts) {
                            assert_eq!(r.page, slot);
                            continued += (last != u32::MAX && slot == last + 1) as usize;
                            unknown += (last == u32::MAX) as usize;
                            placed += 1;
                        }
                        for (&r, &slot) in rows.iter().zip(&want) {
                            let (s, k) = held[r as usize].as_mut().unwrap();
                            s.push(slot);
                            *k = true;
                        }
                        steps += 1;
                    }
                    (Err(KvError::Alloc(_)), Err(_)) => {
                        assert_eq!(staged_side.available_size(), twin.available_size());
                        // Make room: finish the longest request.
                        let r = (0..held.len()).max_by_key(|&r| held[r].as_ref().map_or(0, |h| h.0.len())).unwrap();
                        let (slots, _) = held[r].take().unwrap();
                        staged_side.free(&slots).unwrap();
                        twin.free(&slots).unwrap();
                    }
                    (a, b) => panic!("the sides disagree: {a:?} / {b:?}"),
                }
            }
        }
        assert!(unknown > 10, "{unknown}");
        assert!(continued * 2 > placed, "{continued} of {placed} slots continued a run");
        // Above page size 1 the last slots are not read at all.
        let host = PagedAllocator::new(256, 4).unwrap();
        let mut block = vec![0u32; decode_block_bytes(4) / 4];
        let limits = RowLimits { rows: 4, max_context_len: 32 };
        let s = stage_decode_after(&host, &[5, 3], &[0, 1], 4, limits, bytemuck::cast_slice_mut(&mut block), |_| {
            unreachable!("last slots are read only at page size 1")
        })
        .unwrap();
        assert_eq!(s.new_pages, 1);
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
        // The same through the following path, at page size 1.
        let one = PagedAllocator::new(16, 1).unwrap();
        let b = bytemuck::cast_slice_mut(&mut big);
        let r = stage_decode_after(&one, &[1; 17], &rows, 32, limits, b, |i| i as u32);
        assert!(matches!(r, Err(KvError::Alloc(_))));
        assert_eq!(one.available_size(), 16);
        let r = stage_decode_after(&one, &[1; 17], &rows[..16], 32, limits, b, |i| i as u32);
        assert!(matches!(r, Err(KvError::Shape { what: "rows", .. })));
        assert_eq!(one.available_size(), 16);
        assert_eq!(bucket_for(0), 1);
        assert_eq!(bucket_for(3), 4);
        assert_eq!(bucket_for(1024), 1024);
    }
}
