//! Host reference implementations of the GPU kernels, one buffer and one layer at a
//! time. They validate everything first and write nothing on error.
//!
//! | kernel | reference |
//! |---|---|
//! | `alloc_extend_*` | [`extend_with_rows`] (= [`expand_extend`] + row write) |
//! | `alloc_decode_*` | [`decode_with_rows`] |
//! | `decode_delta_*` | [`decode_delta`] |
//! | `kv_scatter_*` | [`scatter_rows`] (per K or V buffer and layer) |
//! | `kv_scatter_mla_*` | [`scatter_mla_rows`] |
//! | `kv_gather_*` | [`gather_rows`] |
//! | `kv_move_*` | [`move_rows`] |
//!
//! Buffers are byte slices: a pool buffer of `rows * row_bytes` bytes, dense source or
//! destination rows `row_stride` bytes apart (a stride larger than a row is a view into
//! a wider tensor, e.g. the K part of a fused QKV projection).

use super::delta::{DeltaEntry, DeltaPage, DeltaSlot};
use super::{fp8, KvError, RowStore};
use crate::alloc::{expand_decode, expand_extend, plan_decode, plan_extend};

/// The request rows of a `req_to_token` table that a fused allocation writes.
#[derive(Debug)]
pub struct RowTable<'a> {
    /// The table: `rows * stride` cells, row after row.
    pub cells: &'a mut [u32],
    /// Cells per row (`max_context_len`).
    pub stride: usize,
    /// The row of each request of the batch.
    pub rows: &'a [u32],
}

impl RowTable<'_> {
    fn check(&self, batch: usize, seq_lens: &[u32]) -> Result<(), KvError> {
        if self.rows.len() != batch {
            return Err(KvError::Shape { what: "rows", got: self.rows.len(), expected: batch });
        }
        let n_rows = self.cells.len().checked_div(self.stride).unwrap_or(0);
        for (&row, &seq) in self.rows.iter().zip(seq_lens) {
            if row as usize >= n_rows {
                return Err(KvError::SlotOutOfRange { slot: row, rows: n_rows });
            }
            if seq as usize > self.stride {
                return Err(KvError::Shape {
                    what: "seq_len (max_context_len)",
                    got: seq as usize,
                    expected: self.stride,
                });
            }
        }
        Ok(())
    }
}

/// `last_loc` of each request from its row: column `prefix - 1` (0 when the prefix is
/// empty, where it is never read).
fn last_locs_from_rows(table: &RowTable<'_>, prefix_lens: impl Iterator<Item = u32>) -> Vec<u32> {
    prefix_lens
        .zip(table.rows)
        .map(|(p, &r)| if p == 0 { 0 } else { table.cells[r as usize * table.stride + p as usize - 1] })
        .collect()
}

/// The `alloc_extend` kernel: [`expand_extend`] into `out`, and, with a table, the same
/// slots into columns `prefix_len..seq_len` of each request's row. With `last_locs`
/// `None`, `last_loc` is read from the row (column `prefix_len - 1`).
///
/// # Errors
///
/// As [`expand_extend`]; [`KvError::Shape`] / [`KvError::SlotOutOfRange`] for a table
/// whose rows do not fit the batch; [`KvError::Format`] when `last_locs` is `None`
/// without a table.
///
/// # Examples
///
/// ```
/// use kvpool::kv::reference::{extend_with_rows, RowTable};
/// let mut cells = vec![0u32; 2 * 8];
/// cells[..3].copy_from_slice(&[8, 9, 10]); // row 0 holds a prefix of 3 tokens
/// let mut out = [0u32; 4];
/// let table = RowTable { cells: &mut cells, stride: 8, rows: &[0] };
/// extend_with_rows(4, &[3], &[7], None, &[5], &mut out, Some(table))?;
/// assert_eq!(out, [11, 20, 21, 22]);
/// assert_eq!(&cells[..7], &[8, 9, 10, 11, 20, 21, 22]);
/// # Ok::<(), kvpool::kv::KvError>(())
/// ```
pub fn extend_with_rows(
    page_size: u32,
    prefix_lens: &[u32],
    seq_lens: &[u32],
    last_locs: Option<&[u32]>,
    pages: &[u32],
    out: &mut [u32],
    table: Option<RowTable<'_>>,
) -> Result<(), KvError> {
    plan_extend(page_size, prefix_lens, seq_lens)?;
    if let Some(t) = &table {
        t.check(seq_lens.len(), seq_lens)?;
    }
    let from_rows;
    let last = match (last_locs, &table) {
        (Some(l), _) => l,
        (None, Some(t)) => {
            // Read before anything is written: part 1 needs the prefix's last slot.
            from_rows = last_locs_from_rows(t, prefix_lens.iter().copied());
            &from_rows
        }
        (None, None) => return Err(KvError::Format { what: "last_loc from rows needs a row table" }),
    };
    expand_extend(page_size, prefix_lens, seq_lens, last, pages, out)?;
    if let Some(t) = table {
        let mut at = 0;
        for ((&p, &s), &row) in prefix_lens.iter().zip(seq_lens).zip(t.rows) {
            let n = (s - p) as usize;
            let base = row as usize * t.stride + p as usize;
            t.cells[base..base + n].copy_from_slice(&out[at..at + n]);
            at += n;
        }
    }
    Ok(())
}

/// The `alloc_decode` kernel: [`expand_decode`] into `out`, and, with a table, each
/// slot into column `seq_len - 1` of its request's row (`last_locs` `None`: read from
/// column `seq_len - 2`).
///
/// # Errors
///
/// As [`extend_with_rows`], with [`expand_decode`]'s validation.
pub fn decode_with_rows(
    page_size: u32,
    seq_lens: &[u32],
    last_locs: Option<&[u32]>,
    pages: &[u32],
    out: &mut [u32],
    table: Option<RowTable<'_>>,
) -> Result<(), KvError> {
    plan_decode(page_size, seq_lens)?;
    if let Some(t) = &table {
        t.check(seq_lens.len(), seq_lens)?;
    }
    let from_rows;
    let last = match (last_locs, &table) {
        (Some(l), _) => l,
        (None, Some(t)) => {
            from_rows = last_locs_from_rows(t, seq_lens.iter().map(|&s| s - 1));
            &from_rows
        }
        (None, None) => return Err(KvError::Format { what: "last_loc from rows needs a row table" }),
    };
    expand_decode(page_size, seq_lens, last, pages, out)?;
    if let Some(t) = table {
        for ((&s, &row), &slot) in seq_lens.iter().zip(t.rows).zip(out.iter()) {
            t.cells[row as usize * t.stride + s as usize - 1] = slot;
        }
    }
    Ok(())
}

/// The host reference of `decode_delta_*`: apply a delta step's `full` and `paged`
/// entries to the device `state` (one [`DeltaSlot`] per batch index), then advance
/// batch indices `0..bucket`, writing each one's slot to `out` and to its row of
/// `table` (`rows` rows of `stride` cells).
///
/// Full entry `e` sets `state[e.index] = {e.row, e.len, last, e.page}` with `last` read
/// from column `e.len - 1` of the row when the next token continues a page (`e.len %
/// page_size != 0`, the row inside the table and `e.len <= stride`), else 0; page entry
/// `p` sets `state[p.index].page = p.page`; entries with an index `>= state.len()` are
/// skipped. Then, for `i < bucket` with `{row, len,
/// last, page} = state[i]`: `row >= rows` (padding) gives `out[i] = 0` and nothing
/// else; otherwise the token at column `len` gets `page * page_size` when it starts a
/// page (`len % page_size == 0`), else `last + 1`; it goes to `out[i]`, to the row
/// (only if `len < stride`), and `state[i]` becomes `{row, len + 1, slot, page}`.
///
/// `page * page_size`, `last + 1` and `len + 1` are `u32` arithmetic modulo 2^32, as in
/// the kernel (its PTX computes them with `shl.b32` / `mad.lo.u32`, `add.u32`): a state
/// that overflows them (never one [`DeltaPlanner`](super::delta::DeltaPlanner) builds,
/// whose lengths stay within the row and whose pages within the pool) wraps here exactly
/// as on the device, and is not an error.
///
/// # Errors
///
/// [`KvError::Shape`] for `out.len() != bucket`, `bucket > state.len()`, a table
/// that is not `rows * stride` cells or a zero page size; nothing is written then.
#[allow(clippy::too_many_arguments)]
pub fn decode_delta(
    page_size: u32,
    state: &mut [DeltaSlot],
    full: &[DeltaEntry],
    paged: &[DeltaPage],
    bucket: usize,
    out: &mut [u32],
    table: &mut [u32],
    rows: u32,
    stride: usize,
) -> Result<(), KvError> {
    if out.len() != bucket {
        return Err(KvError::Shape { what: "out", got: out.len(), expected: bucket });
    }
    if bucket > state.len() {
        return Err(KvError::Shape { what: "bucket (state)", got: bucket, expected: state.len() });
    }
    match (rows as usize).checked_mul(stride) {
        Some(cells) if cells == table.len() => {}
        cells => {
            let expected = cells.unwrap_or(usize::MAX);
            return Err(KvError::Shape { what: "table", got: table.len(), expected });
        }
    }
    if page_size == 0 {
        return Err(KvError::Shape { what: "page_size", got: 0, expected: 1 });
    }
    for e in full {
        let Some(s) = state.get_mut(e.index as usize) else { continue };
        let need = e.len % page_size != 0 && e.row < rows && e.len as usize <= stride;
        let last = if need { table[e.row as usize * stride + e.len as usize - 1] } else { 0 };
        *s = DeltaSlot { row: e.row, len: e.len, last, page: e.page };
    }
    for p in paged {
        if let Some(s) = state.get_mut(p.index as usize) {
            s.page = p.page;
        }
    }
    for (s, o) in state[..bucket].iter_mut().zip(out.iter_mut()) {
        if s.row >= rows {
            *o = 0;
            continue;
        }
        // Wrapping, as the kernel's u32 registers (see above).
        let slot = if s.len % page_size == 0 { s.page.wrapping_mul(page_size) } else { s.last.wrapping_add(1) };
        *o = slot;
        if (s.len as usize) < stride {
            table[s.row as usize * stride + s.len as usize] = slot;
        }
        s.len = s.len.wrapping_add(1);
        s.last = slot;
    }
    Ok(())
}

fn check_slots(slots: &[u32], rows: usize) -> Result<(), KvError> {
    match slots.iter().find(|&&s| s as usize >= rows) {
        Some(&slot) => Err(KvError::SlotOutOfRange { slot, rows }),
        None => Ok(()),
    }
}

/// Check a dense row set: `n` rows of `row_bytes`, `stride` apart, in `len` bytes.
fn check_dense(what: &'static str, len: usize, n: usize, row_bytes: usize, stride: usize) -> Result<(), KvError> {
    if stride < row_bytes {
        return Err(KvError::BadRow { what, bytes: stride });
    }
    let need = match n.checked_sub(1) {
        None => 0,
        // An extent past the address space (a huge stride) is a shape error too.
        Some(last) => last.checked_mul(stride).and_then(|at| at.checked_add(row_bytes)).ok_or(KvError::Shape {
            what,
            got: len,
            expected: usize::MAX,
        })?,
    };
    if len < need {
        return Err(KvError::Shape { what, got: len, expected: need });
    }
    Ok(())
}

/// Store one source row into one pool row.
fn store_row(store: RowStore, src: &[u8], dst: &mut [u8]) {
    match store {
        RowStore::Copy => dst.copy_from_slice(src),
        RowStore::Fp8E4m3 { src: ty, inv_scale } => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(ty.bytes())) {
                *d = fp8::quantize_e4m3(ty.read(s), inv_scale);
            }
        }
    }
}

fn pool_rows(pool_len: usize, row_bytes: usize) -> Result<usize, KvError> {
    if row_bytes == 0 || pool_len % row_bytes != 0 {
        return Err(KvError::BadRow { what: "pool row", bytes: row_bytes });
    }
    Ok(pool_len / row_bytes)
}

/// The `kv_scatter` kernel for one buffer: source row `i` (`src_row_bytes` bytes at
/// `i * src_row_stride`) is stored into pool row `slots[i]`. The pool's rows are
/// `store.stored_bytes(src_row_bytes)` bytes.
///
/// # Errors
///
/// [`KvError::SlotOutOfRange`], [`KvError::Shape`] or [`KvError::BadRow`]; nothing is
/// written then.
///
/// # Examples
///
/// ```
/// use kvpool::kv::{reference::scatter_rows, RowStore};
/// let mut pool = vec![0u8; 4 * 2];                  // 4 rows of 2 bytes
/// scatter_rows(RowStore::Copy, &[1, 2, 3, 4], 2, 2, &[3, 1], &mut pool)?;
/// assert_eq!(pool, [0, 0, 3, 4, 0, 0, 1, 2]);
/// # Ok::<(), kvpool::kv::KvError>(())
/// ```
pub fn scatter_rows(
    store: RowStore,
    src: &[u8],
    src_row_stride: usize,
    src_row_bytes: usize,
    slots: &[u32],
    pool: &mut [u8],
) -> Result<(), KvError> {
    if src_row_bytes % store.src_elem_bytes() != 0 {
        return Err(KvError::BadRow { what: "src_row_bytes", bytes: src_row_bytes });
    }
    let row_bytes = store.stored_bytes(src_row_bytes);
    let rows = pool_rows(pool.len(), row_bytes)?;
    check_dense("src", src.len(), slots.len(), src_row_bytes, src_row_stride)?;
    check_slots(slots, rows)?;
    for (i, &slot) in slots.iter().enumerate() {
        let s = &src[i * src_row_stride..i * src_row_stride + src_row_bytes];
        let d = &mut pool[slot as usize * row_bytes..(slot as usize + 1) * row_bytes];
        store_row(store, s, d);
    }
    Ok(())
}

/// One dense source of an MLA scatter: `row_bytes` bytes per token, `row_stride`
/// bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct DenseRows<'a> {
    /// The bytes.
    pub data: &'a [u8],
    /// Bytes from one token's row to the next.
    pub row_stride: usize,
    /// Bytes of one token's row.
    pub row_bytes: usize,
}

/// The `kv_scatter_mla` kernel: pool row `slots[i]` becomes token `i`'s nope row
/// followed by its rope row (each stored with `store`).
///
/// # Errors
///
/// As [`scatter_rows`].
pub fn scatter_mla_rows(
    store: RowStore,
    nope: DenseRows<'_>,
    rope: DenseRows<'_>,
    slots: &[u32],
    pool: &mut [u8],
) -> Result<(), KvError> {
    for (what, part) in [("nope", nope), ("rope", rope)] {
        if part.row_bytes % store.src_elem_bytes() != 0 {
            return Err(KvError::BadRow { what, bytes: part.row_bytes });
        }
        check_dense(what, part.data.len(), slots.len(), part.row_bytes, part.row_stride)?;
    }
    let nope_out = store.stored_bytes(nope.row_bytes);
    let row_bytes = nope_out + store.stored_bytes(rope.row_bytes);
    let rows = pool_rows(pool.len(), row_bytes)?;
    check_slots(slots, rows)?;
    for (i, &slot) in slots.iter().enumerate() {
        let d = &mut pool[slot as usize * row_bytes..(slot as usize + 1) * row_bytes];
        let (dn, dr) = d.split_at_mut(nope_out);
        store_row(store, &nope.data[i * nope.row_stride..][..nope.row_bytes], dn);
        store_row(store, &rope.data[i * rope.row_stride..][..rope.row_bytes], dr);
    }
    Ok(())
}

/// The `kv_gather` kernel for one buffer: pool row `slots[i]` is copied to
/// `dst[i * dst_row_stride..][..row_bytes]`.
///
/// # Errors
///
/// As [`scatter_rows`].
pub fn gather_rows(
    pool: &[u8],
    row_bytes: usize,
    slots: &[u32],
    dst: &mut [u8],
    dst_row_stride: usize,
) -> Result<(), KvError> {
    let rows = pool_rows(pool.len(), row_bytes)?;
    check_dense("dst", dst.len(), slots.len(), row_bytes, dst_row_stride)?;
    check_slots(slots, rows)?;
    for (i, &slot) in slots.iter().enumerate() {
        dst[i * dst_row_stride..][..row_bytes]
            .copy_from_slice(&pool[slot as usize * row_bytes..(slot as usize + 1) * row_bytes]);
    }
    Ok(())
}

/// Check that no slot is both written and read, or written twice, by one move.
pub(crate) fn check_move_disjoint(src_slots: &[u32], dst_slots: &[u32]) -> Result<(), KvError> {
    let mut dst: Vec<u32> = dst_slots.to_vec();
    dst.sort_unstable();
    if let Some(w) = dst.windows(2).find(|w| w[0] == w[1]) {
        return Err(KvError::MoveOverlap { slot: w[0] });
    }
    if let Some(&s) = src_slots.iter().find(|s| dst.binary_search(s).is_ok()) {
        return Err(KvError::MoveOverlap { slot: s });
    }
    Ok(())
}

/// The `kv_move` kernel for one buffer: pool row `src_slots[i]` is copied to pool row
/// `dst_slots[i]`. The destinations must be distinct and must not be sources (so the
/// copies can run in any order, as they do on the GPU).
///
/// # Errors
///
/// [`KvError::MoveOverlap`] when the sets overlap, [`KvError::Shape`] when the lists
/// differ in length, [`KvError::SlotOutOfRange`].
pub fn move_rows(pool: &mut [u8], row_bytes: usize, src_slots: &[u32], dst_slots: &[u32]) -> Result<(), KvError> {
    let rows = pool_rows(pool.len(), row_bytes)?;
    if src_slots.len() != dst_slots.len() {
        return Err(KvError::Shape { what: "dst_slots", got: dst_slots.len(), expected: src_slots.len() });
    }
    check_slots(src_slots, rows)?;
    check_slots(dst_slots, rows)?;
    check_move_disjoint(src_slots, dst_slots)?;
    for (&s, &d) in src_slots.iter().zip(dst_slots) {
        pool.copy_within(s as usize * row_bytes..(s as usize + 1) * row_bytes, d as usize * row_bytes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `decode_delta` on states whose `page * page_size`, `last + 1` or `len + 1`
    /// overflow `u32`: it used to panic (debug) on them; now it wraps, as the kernel's
    /// `shl.b32` / `mad.lo.u32` / `add.u32` do, and writes what the device would.
    #[test]
    fn decode_delta_wraps_u32_like_the_kernel() {
        let step = |ps: u32, slot: DeltaSlot| {
            let (mut state, mut out, mut table) = ([slot], [7u32; 1], [9u32; 4]);
            decode_delta(ps, &mut state, &[], &[], 1, &mut out, &mut table, 1, 4).unwrap();
            (state[0], out[0], table)
        };
        // `last + 1` (the token continues a page).
        let (s, o, t) = step(2, DeltaSlot { row: 0, len: 1, last: u32::MAX, page: 0 });
        assert_eq!((s, o, t), (DeltaSlot { row: 0, len: 2, last: 0, page: 0 }, 0, [9, 0, 9, 9]));
        // `page * page_size` (the token starts a page).
        let (s, o, t) = step(2, DeltaSlot { row: 0, len: 0, last: 0, page: u32::MAX });
        let slot = u32::MAX - 1;
        assert_eq!((s, o, t), (DeltaSlot { row: 0, len: 1, last: slot, page: u32::MAX }, slot, [slot, 9, 9, 9]));
        // `len + 1` (past the row: no table write).
        let (s, o, t) = step(1, DeltaSlot { row: 0, len: u32::MAX, last: 0, page: 5 });
        assert_eq!((s, o, t), (DeltaSlot { row: 0, len: 0, last: 5, page: 5 }, 5, [9; 4]));
    }

    /// A table shape whose `rows * stride` overflows `usize` is a shape error (it used
    /// to panic computing the expected length); nothing is written.
    #[test]
    fn decode_delta_refuses_an_overflowing_table_shape() {
        let slot = DeltaSlot { row: 0, len: 0, last: 0, page: 3 };
        let (mut state, mut out) = ([slot], [7u32; 1]);
        let e = decode_delta(4, &mut state, &[], &[], 1, &mut out, &mut [], 2, usize::MAX).unwrap_err();
        assert_eq!(e, KvError::Shape { what: "table", got: 0, expected: usize::MAX });
        assert_eq!((state, out), ([slot], [7]));
    }

    /// A dense source or destination whose extent `(n - 1) * stride + row_bytes`
    /// overflows `usize` (a huge stride) is `KvError::Shape` in `scatter_rows`,
    /// `scatter_mla_rows` and `gather_rows` (it used to panic); nothing is written. A
    /// stride that is never stepped over (one row) is still fine.
    #[test]
    fn dense_rows_with_an_overflowing_extent_are_refused() {
        let huge = KvError::Shape { what: "src", got: 4, expected: usize::MAX };
        let mut pool = vec![0u8; 8];
        assert_eq!(scatter_rows(RowStore::Copy, &[1, 2, 3, 4], usize::MAX, 2, &[0, 1], &mut pool), Err(huge.clone()));
        assert_eq!(
            scatter_rows(RowStore::Copy, &[1, 2, 3, 4], usize::MAX / 2 + 1, 2, &[0, 1, 2], &mut pool),
            Err(huge)
        );
        assert_eq!(pool, [0; 8]);

        let rows = |data, row_stride| DenseRows { data, row_stride, row_bytes: 1 };
        let e = scatter_mla_rows(RowStore::Copy, rows(&[1, 2], 1), rows(&[3, 4], usize::MAX), &[0, 1], &mut pool);
        assert_eq!(e, Err(KvError::Shape { what: "rope", got: 2, expected: usize::MAX }));
        assert_eq!(pool, [0; 8]);

        let mut dst = [5u8; 4];
        let e = gather_rows(&[1, 2, 3, 4], 2, &[0, 1], &mut dst, usize::MAX);
        assert_eq!(e, Err(KvError::Shape { what: "dst", got: 4, expected: usize::MAX }));
        assert_eq!(dst, [5; 4]);

        // One row: the stride is never used.
        scatter_rows(RowStore::Copy, &[1, 2], usize::MAX, 2, &[3], &mut pool).unwrap();
        assert_eq!(pool, [0, 0, 0, 0, 0, 0, 1, 2]);
        gather_rows(&pool, 2, &[3], &mut dst, usize::MAX).unwrap();
        assert_eq!(dst, [1, 2, 5, 5]);
    }
}
