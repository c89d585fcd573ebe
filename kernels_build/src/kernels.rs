//! One generator per kernel, and the module lists that `kvpool` embeds.
//!
//! # The kernels and their launch shapes
//!
//! | kernel | grid | block | one thread does |
//! |---|---|---|---|
//! | `noop` | any | any | nothing (the launch floor) |
//! | `alloc_extend_*` | `(batch)` | [`ALLOC_EXTEND_THREADS`] | tokens `tid, tid+ntid, ...` of request `ctaid.x` |
//! | `alloc_decode_*` | `(ceil(batch/ALLOC_DECODE_THREADS))` | [`ALLOC_DECODE_THREADS`] | request `ctaid.x*ntid.x+tid` |
//! | `decode_step_*` | `(ceil(batch/ALLOC_DECODE_THREADS))` | [`ALLOC_DECODE_THREADS`] | request `ctaid.x*ntid.x+tid` (compact records) |
//! | `decode_delta_*` | `(1)` | `min(max(bucket, DELTA_SPEC), DELTA_MAX_THREADS)` | delta entries `tid, tid+ntid, ..`, then requests `tid, tid+ntid, ..` |
//! | `kv_*` row kernels | `(ceil(n/ROWS_PER_BLOCK), layers, buffers)` | [`ROW_BLOCK_THREADS`] | vectors `lane, lane+32, ...` of row `ctaid.x*8 + warp` |
//!
//! The paged-allocation kernels read one record per request from `meta` (an array of
//! structs: [`RECORD_BYTES`] bytes each, six `u32` fields in the order of
//! [`META_COLUMNS`]): `prefix_len`, `seq_len`, `last_loc`, `page_start`, `out_start`,
//! `row`. `page_start` and `out_start` are the exclusive prefix sums of new pages and
//! new tokens, computed by the host while it plans the batch. The host side is
//! `kvpool::kv::staging::AllocRecord`, a `#[repr(C)]` `Pod` struct of the same fields.
//! A decode record whose `row` is [`PAD_ROW`] is padding (a captured batch-size
//! bucket larger than the batch): its slot is 0, the dummy slot, and no row is read or
//! written.

use crate::ptx::{Cmp, Kernel, Module, ParamRef, Pred, Special, Target, Width, F32, R32, R64};

/// Threads per block of `alloc_extend_*`.
pub const ALLOC_EXTEND_THREADS: u32 = 128;
/// Threads per block of `alloc_decode_*`.
pub const ALLOC_DECODE_THREADS: u32 = 128;
/// Threads per block of the row kernels (`kv_*`): one warp per row.
pub const ROW_BLOCK_THREADS: u32 = 256;
/// Rows (tokens or slot pairs) per block of the row kernels.
pub const ROWS_PER_BLOCK: u32 = ROW_BLOCK_THREADS / 32;
/// Vectors each lane keeps in flight in the row kernels' main loop.
pub const ROW_UNROLL: u32 = 4;
/// The fields of an allocation record (`meta`), in order.
pub const META_COLUMNS: [&str; 6] = ["prefix_len", "seq_len", "last_loc", "page_start", "out_start", "row"];
/// Bytes per allocation record: six `u32` fields.
pub const RECORD_BYTES: u32 = 4 * META_COLUMNS.len() as u32;
/// The `row` of a padding record of `alloc_decode_*` and `decode_step_*`: slot 0, no
/// row access.
pub const PAD_ROW: u32 = u32::MAX;
/// Bytes per record of `decode_step_*`: `seq_len`, `row`, `page`, one unused word (16
/// bytes, so one vector load reads a record).
pub const STEP_RECORD_BYTES: u32 = 16;
/// Bytes per full entry of a delta-staged decode step (`decode_delta_*`): `index`,
/// `row`, `len`, `page` (one vector load): a batch index whose request joined, left or
/// was extended.
pub const DELTA_ENTRY_BYTES: u32 = 16;
/// Bytes per page entry of a delta step: `index`, `page` (the fresh page of a request
/// whose next token starts one).
pub const DELTA_PAGE_BYTES: u32 = 8;
/// Bytes before the first entry of a delta block: the full and page entry counts, then
/// two unused words (so entries stay 16-byte aligned).
pub const DELTA_HEADER_BYTES: u32 = 16;
/// Bytes per request of the device state `decode_delta_*` keeps between steps: `row`,
/// `len`, `last`, `page`.
pub const DELTA_STATE_BYTES: u32 = 16;
/// Threads of `decode_delta_*` that read their first page entry together with the
/// counts (one round trip to mapped host memory for up to this many).
pub const DELTA_SPEC: u32 = 128;
/// Threads of `decode_delta_*` that read their first full entry together with the
/// counts.
pub const DELTA_FULL_SPEC: u32 = 8;
/// The most threads (one block) `decode_delta_*` runs with.
pub const DELTA_MAX_THREADS: u32 = 1024;
/// `flags` bit of the allocation kernels: also write each slot into the request's row
/// of the `req_to_token` table (columns `prefix_len..seq_len`).
pub const FLAG_WRITE_ROWS: u32 = 1;
/// `flags` bit: read `last_loc` from the request's row (column `prefix_len - 1`)
/// instead of the `meta` column.
pub const FLAG_LAST_LOC_FROM_ROWS: u32 = 2;
/// Page sizes that get their own specialized (shift-and-mask) allocation kernels; the
/// `_psn` kernels take any page size at run time.
pub const CONST_PAGE_SIZES: [u32; 4] = [1, 16, 32, 64];
/// The e4m3 code of the largest finite magnitude, 448.
pub const E4M3_MAX_CODE: u32 = 0x7e;
/// The e4m3 NaN code every NaN input becomes (positive, whatever the input's sign).
pub const E4M3_NAN_CODE: u32 = 0x7f;

/// How an allocation kernel knows the page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageSize {
    /// A power of two fixed at generation time: divisions become shifts and masks.
    Const(u32),
    /// Read from the `page_size` parameter at run time (any value >= 1).
    Runtime,
}

impl PageSize {
    fn suffix(self) -> String {
        match self {
            PageSize::Const(ps) => format!("ps{ps}"),
            PageSize::Runtime => "psn".to_string(),
        }
    }
}

/// The floating-point type of the K/V values handed to an fp8 scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SrcFloat {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
}

impl SrcFloat {
    /// Every source type.
    pub const ALL: [SrcFloat; 3] = [SrcFloat::F16, SrcFloat::Bf16, SrcFloat::F32];

    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            SrcFloat::F32 => 4,
            _ => 2,
        }
    }

    /// The name used in kernel names.
    pub fn name(self) -> &'static str {
        match self {
            SrcFloat::F16 => "f16",
            SrcFloat::Bf16 => "bf16",
            SrcFloat::F32 => "f32",
        }
    }
}

/// What a scatter stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Store {
    /// The bytes as they are (16- or 32-bit elements, or anything else).
    Copy,
    /// fp8 e4m3: each element is multiplied by `inv_scale`, rounded to nearest-even
    /// and saturated to ±448 (any NaN becomes 0x7f), and stored as one byte.
    Fp8(SrcFloat),
}

impl Store {
    /// Bytes stored per `src_bytes` bytes read.
    pub fn dst_bytes(self, src_bytes: u32) -> u32 {
        match self {
            Store::Copy => src_bytes,
            Store::Fp8(f) => src_bytes / f.bytes(),
        }
    }

    fn name(self) -> String {
        match self {
            Store::Copy => "copy".to_string(),
            Store::Fp8(f) => format!("fp8_{}", f.name()),
        }
    }
}

/// The row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowOp {
    /// SGLang's `set_kv_buffer`: dense K/V rows of a batch -> pool rows at `slots`.
    Scatter,
    /// SGLang's `set_mla_kv_buffer`: dense `nope` and `rope` rows -> one pool row.
    ScatterMla,
    /// Pool rows at `slots` -> dense rows.
    Gather,
    /// Pool row `src_slots[i]` -> pool row `dst_slots[i]`.
    Move,
}

impl RowOp {
    fn name(self) -> &'static str {
        match self {
            RowOp::Scatter => "kv_scatter",
            RowOp::ScatterMla => "kv_scatter_mla",
            RowOp::Gather => "kv_gather",
            RowOp::Move => "kv_move",
        }
    }
}

/// The entry name of a row kernel.
pub fn row_kernel_name(op: RowOp, store: Store, vec_bytes: u32) -> String {
    match op {
        RowOp::Scatter | RowOp::ScatterMla => format!("{}_{}_v{vec_bytes}", op.name(), store.name()),
        RowOp::Gather | RowOp::Move => format!("{}_v{vec_bytes}", op.name()),
    }
}

/// The entry name of an allocation kernel (`decode` false: extend).
pub fn alloc_kernel_name(decode: bool, page: PageSize) -> String {
    let kind = if decode { "alloc_decode" } else { "alloc_extend" };
    format!("{kind}_{}", page.suffix())
}

/// The empty kernel: the launch floor the benchmarks compare against.
pub fn noop() -> Kernel {
    let mut k = Kernel::new("noop");
    k.ret();
    k
}

/// The allocation kernels' common parameters, in `.param` order.
struct AllocParams {
    meta: R64,
    batch: R32,
    pages: R64,
    out: R64,
    table: R64,
    table_stride: R32,
    page_size: R32,
    flags: R32,
}

fn alloc_params(k: &mut Kernel) -> AllocParams {
    let meta = k.param_u64("meta");
    let batch = k.param_u32("batch");
    let pages = k.param_u64("pages");
    let out = k.param_u64("out");
    let table = k.param_u64("table");
    let table_stride = k.param_u32("table_stride");
    let page_size = k.param_u32("page_size");
    let flags = k.param_u32("flags");
    AllocParams {
        meta: k.ld_param_u64(meta),
        batch: k.ld_param_u32(batch),
        pages: k.ld_param_u64(pages),
        out: k.ld_param_u64(out),
        table: k.ld_param_u64(table),
        table_stride: k.ld_param_u32(table_stride),
        page_size: k.ld_param_u32(page_size),
        flags: k.ld_param_u32(flags),
    }
}

/// Field `column` of record `i` of `meta`.
fn meta_field(k: &mut Kernel, rec: R64, column: u32) -> R32 {
    k.ld_global_u32(rec, 4 * column, true)
}

/// `(q, r) = (x / ps, x % ps)`.
fn div_rem_page(k: &mut Kernel, page: PageSize, ps: R32, x: R32) -> (R32, R32) {
    match page {
        PageSize::Const(1) => (x, k.mov_u32(0u32)),
        PageSize::Const(c) => (k.shr_u32(x, c.trailing_zeros()), k.and_b32(x, c - 1)),
        PageSize::Runtime => (k.div_u32(x, ps), k.rem_u32(x, ps)),
    }
}

/// `page * ps + r`
fn page_slot(k: &mut Kernel, page: PageSize, ps: R32, pg: R32, r: R32) -> R32 {
    match page {
        PageSize::Const(1) => pg,
        PageSize::Const(c) => {
            let base = k.shl_b32(pg, c.trailing_zeros());
            k.or_b32(base, r)
        }
        PageSize::Runtime => k.mad_lo_u32(pg, ps, r),
    }
}

/// Read `last_loc` from the table row when `FLAG_LAST_LOC_FROM_ROWS` is set and the
/// request has a partial prefix page (`need`); otherwise keep `meta_last`.
fn last_loc(k: &mut Kernel, p: &AllocParams, row: R32, prefix: R32, meta_last: R32, need: Pred) -> R32 {
    let f = k.and_b32(p.flags, FLAG_LAST_LOC_FROM_ROWS);
    let from_rows = k.setp_u32(Cmp::Ne, f, 0u32);
    let skip = k.label();
    let result = k.mov_u32(meta_last);
    k.bra_if(from_rows, false, skip);
    k.bra_if(need, false, skip);
    let col = k.sub_u32(prefix, 1u32);
    let cell = k.mad_lo_u32(row, p.table_stride, col);
    let at = k.mad_wide_u32(cell, 4u32, p.table);
    let v = k.ld_global_u32(at, 0, false);
    k.set_u32(result, v);
    k.place(skip);
    result
}

/// `alloc_extend`: expand the fresh pages of an extend batch into per-token slots,
/// exactly `kvpool::alloc::expand_extend`, optionally writing them into the rows of
/// the `req_to_token` table too.
///
/// Parameters: `meta` (u64, see the module docs), `batch` (u32), `pages` (u64, the
/// batch's fresh pages in order), `out` (u64, `sum(seq - prefix)` slots), `table`
/// (u64, `rows * table_stride` u32 cells), `table_stride` (u32), `page_size` (u32,
/// read only by the `_psn` kernel), `flags` (u32, [`FLAG_WRITE_ROWS`],
/// [`FLAG_LAST_LOC_FROM_ROWS`]).
///
/// Token `k` of request `i` sits at position `pos = prefix + k`. With
/// `aligned = ceil(prefix/ps)*ps`, positions below `aligned` fill the old partial page
/// (`last_loc + 1 + k`); the others lie in the request's fresh pages:
/// `pages[page_start + (pos-aligned)/ps]*ps + pos%ps`. That is the three-part formula
/// of DESIGN.md written per token, so every token is independent.
pub fn alloc_extend(page: PageSize) -> Kernel {
    if let PageSize::Const(c) = page {
        assert!(c.is_power_of_two(), "constant page sizes must be powers of two");
    }
    let mut k = Kernel::new(alloc_kernel_name(false, page));
    let p = alloc_params(&mut k);
    let i = k.special(Special::CtaidX);
    let past = k.setp_u32(Cmp::Ge, i, p.batch);
    k.ret_if(past, true);
    k.comment("this block's request");
    let rec = k.mad_wide_u32(i, RECORD_BYTES, p.meta);
    let prefix = meta_field(&mut k, rec, 0);
    let seq = meta_field(&mut k, rec, 1);
    let meta_last = meta_field(&mut k, rec, 2);
    let page_start = meta_field(&mut k, rec, 3);
    let out_start = meta_field(&mut k, rec, 4);
    let row = meta_field(&mut k, rec, 5);
    let n = k.sub_u32(seq, prefix);
    let tid = k.special(Special::TidX);
    let none = k.setp_u32(Cmp::Ge, tid, n);
    k.ret_if(none, true);
    let ps = p.page_size;
    // aligned = ceil(prefix / ps) * ps
    let aligned = match page {
        PageSize::Const(1) => prefix,
        PageSize::Const(c) => {
            let up = k.add_u32(prefix, c - 1);
            k.and_b32(up, !(c - 1))
        }
        PageSize::Runtime => {
            let up = k.add_u32(prefix, ps);
            let up = k.sub_u32(up, 1u32);
            let q = k.div_u32(up, ps);
            k.mul_lo_u32(q, ps)
        }
    };
    let partial = k.setp_u32(Cmp::Ne, aligned, prefix);
    let last = last_loc(&mut k, &p, row, prefix, meta_last, partial);
    let last1 = k.add_u32(last, 1u32);
    let req_pages = k.mad_wide_u32(page_start, 4u32, p.pages);
    let req_out = k.mad_wide_u32(out_start, 4u32, p.out);
    let cell0 = k.mad_lo_u32(row, p.table_stride, prefix);
    let req_row = k.mad_wide_u32(cell0, 4u32, p.table);
    let wf = k.and_b32(p.flags, FLAG_WRITE_ROWS);
    let write_rows = k.setp_u32(Cmp::Ne, wf, 0u32);
    let step = k.special(Special::NtidX);
    let tok = k.mov_u32(tid);
    let top = k.label();
    k.place(top);
    k.comment("one token per iteration");
    let pos = k.add_u32(prefix, tok);
    let in_old = k.setp_u32(Cmp::Lt, pos, aligned);
    let d = k.sub_u32(pos, aligned);
    let (q, r) = div_rem_page(&mut k, page, ps, d);
    let pg_at = k.mad_wide_u32(q, 4u32, req_pages);
    let pg = k.ld_global(Width::B4, pg_at, 0, true, Some((in_old, false)))[0];
    let fresh = page_slot(&mut k, page, ps, pg, r);
    let old = k.add_u32(last1, tok);
    let slot = k.selp_b32(old, fresh, in_old);
    let o = k.mad_wide_u32(tok, 4u32, req_out);
    k.st_global_u32(o, 0, slot, None);
    let t = k.mad_wide_u32(tok, 4u32, req_row);
    k.st_global_u32(t, 0, slot, Some((write_rows, true)));
    k.add_u32_to(tok, step);
    let more = k.setp_u32(Cmp::Lt, tok, n);
    k.bra_if(more, true, top);
    k.ret();
    k
}

/// `alloc_decode`: one slot per request, exactly `kvpool::alloc::expand_decode`,
/// optionally written into column `seq_len - 1` of the request's row.
///
/// Same parameters and `meta` records as [`alloc_extend`] (`prefix_len` and
/// `out_start` are not read: a decode request's prefix is `seq_len - 1` and its output
/// position is its index). A record whose `row` is [`PAD_ROW`] writes slot 0 to its
/// output and nothing else. A request whose new token starts a page (`(seq-1) % ps == 0`) takes
/// `pages[page_start]*ps`; the others take `last_loc + 1`.
pub fn alloc_decode(page: PageSize) -> Kernel {
    if let PageSize::Const(c) = page {
        assert!(c.is_power_of_two(), "constant page sizes must be powers of two");
    }
    let mut k = Kernel::new(alloc_kernel_name(true, page));
    let p = alloc_params(&mut k);
    let blk = k.special(Special::CtaidX);
    let nt = k.special(Special::NtidX);
    let tid = k.special(Special::TidX);
    let i = k.mad_lo_u32(blk, nt, tid);
    let past = k.setp_u32(Cmp::Ge, i, p.batch);
    k.ret_if(past, true);
    let rec = k.mad_wide_u32(i, RECORD_BYTES, p.meta);
    let o = k.mad_wide_u32(i, 4u32, p.out);
    let row = meta_field(&mut k, rec, 5);
    k.comment("a padding record: the dummy slot 0, no row access");
    let pad = k.setp_u32(Cmp::Eq, row, PAD_ROW);
    k.st_global_u32(o, 0, 0u32, Some((pad, true)));
    k.ret_if(pad, true);
    let seq = meta_field(&mut k, rec, 1);
    let meta_last = meta_field(&mut k, rec, 2);
    let page_start = meta_field(&mut k, rec, 3);
    let pos = k.sub_u32(seq, 1u32);
    let (_, r) = div_rem_page(&mut k, page, p.page_size, pos);
    let new_page = k.setp_u32(Cmp::Eq, r, 0u32);
    let partial = k.setp_u32(Cmp::Ne, r, 0u32);
    let last = last_loc(&mut k, &p, row, pos, meta_last, partial);
    let pg_at = k.mad_wide_u32(page_start, 4u32, p.pages);
    let pg = k.ld_global(Width::B4, pg_at, 0, true, Some((new_page, true)))[0];
    let zero = k.mov_u32(0u32);
    let fresh = page_slot(&mut k, page, p.page_size, pg, zero);
    let old = k.add_u32(last, 1u32);
    let slot = k.selp_b32(fresh, old, new_page);
    k.st_global_u32(o, 0, slot, None);
    let wf = k.and_b32(p.flags, FLAG_WRITE_ROWS);
    let write_rows = k.setp_u32(Cmp::Ne, wf, 0u32);
    let cell = k.mad_lo_u32(row, p.table_stride, pos);
    let t = k.mad_wide_u32(cell, 4u32, p.table);
    k.st_global_u32(t, 0, slot, Some((write_rows, true)));
    k.ret();
    k
}

/// The name of a decode-step kernel.
pub fn decode_step_name(page: PageSize) -> String {
    format!("decode_step_{}", page.suffix())
}

/// `decode_step`: the decode step of a captured graph, from compact records.
///
/// Parameters: `records` (u64: `batch` records of [`STEP_RECORD_BYTES`]: `seq_len`,
/// `row`, `page`, unused), `batch` (u32), `out` (u64, `batch` slots), `table` (u64),
/// `table_stride` (u32), `page_size` (u32, read only by `_psn`). One thread per
/// request (block [`ALLOC_DECODE_THREADS`]): one 16-byte load of its record (the
/// records may sit in mapped host memory: one round trip), then, when the new token
/// (position `seq_len - 1`) starts a page, the slot `page * ps`; otherwise `last_loc +
/// 1` with `last_loc` read from the row (column `seq_len - 2`). The slot goes to
/// `out[i]` and to column `seq_len - 1` of the row. A [`PAD_ROW`] record writes slot 0
/// to `out[i]` and nothing else. Same results as [`alloc_decode`] with both flags set,
/// whose `page_start` indirection the host resolves here.
pub fn decode_step(page: PageSize) -> Kernel {
    if let PageSize::Const(c) = page {
        assert!(c.is_power_of_two(), "constant page sizes must be powers of two");
    }
    let mut k = Kernel::new(decode_step_name(page));
    let records = k.param_u64("records");
    let batch = k.param_u32("batch");
    let out = k.param_u64("out");
    let table = k.param_u64("table");
    let table_stride = k.param_u32("table_stride");
    let page_size = k.param_u32("page_size");
    let records = k.ld_param_u64(records);
    let batch = k.ld_param_u32(batch);
    let blk = k.special(Special::CtaidX);
    let nt = k.special(Special::NtidX);
    let tid = k.special(Special::TidX);
    let i = k.mad_lo_u32(blk, nt, tid);
    let past = k.setp_u32(Cmp::Ge, i, batch);
    k.ret_if(past, true);
    let out = k.ld_param_u64(out);
    let o = k.mad_wide_u32(i, 4u32, out);
    let rec = k.mad_wide_u32(i, STEP_RECORD_BYTES, records);
    let words = k.ld_global(Width::B16, rec, 0, true, None);
    let (seq, row, pg) = (words[0], words[1], words[2]);
    k.comment("a padding record: the dummy slot 0, no row access");
    let pad = k.setp_u32(Cmp::Eq, row, PAD_ROW);
    k.st_global_u32(o, 0, 0u32, Some((pad, true)));
    k.ret_if(pad, true);
    let table = k.ld_param_u64(table);
    let stride = k.ld_param_u32(table_stride);
    let ps = k.ld_param_u32(page_size);
    let pos = k.sub_u32(seq, 1u32);
    let (_, r) = div_rem_page(&mut k, page, ps, pos);
    let new_page = k.setp_u32(Cmp::Eq, r, 0u32);
    let cell = k.mad_lo_u32(row, stride, pos);
    let at = k.mad_wide_u32(cell, 4u32, table);
    k.comment("last_loc: the previous column of the row, unless the token starts a page");
    let prev_cell = k.sub_u32(cell, 1u32);
    let prev_at = k.mad_wide_u32(prev_cell, 4u32, table);
    let prev = k.ld_global(Width::B4, prev_at, 0, false, Some((new_page, false)))[0];
    let old = k.add_u32(prev, 1u32);
    let zero = k.mov_u32(0u32);
    let fresh = page_slot(&mut k, page, ps, pg, zero);
    let slot = k.selp_b32(fresh, old, new_page);
    k.st_global_u32(o, 0, slot, None);
    k.st_global_u32(at, 0, slot, None);
    k.ret();
    k
}

/// The name of a delta decode-step kernel.
pub fn decode_delta_name(page: PageSize) -> String {
    format!("decode_delta_{}", page.suffix())
}

/// `decode_delta`: the decode step of a captured graph from a delta list, with each
/// request's state kept on the device between steps.
///
/// Parameters: `deltas` (u64, usually mapped host memory: the block `kvpool`'s
/// `DeltaPlanner` writes for `capacity` batch indices: at byte 0 the counts `n_full`
/// and `n_page`, at byte 8 the step's tag, at byte 12 the tag of the last step that
/// read the block (written by this kernel); from byte [`DELTA_HEADER_BYTES`] `capacity` full entries of
/// [`DELTA_ENTRY_BYTES`] (`index`, `row`, `len`, `page`); after them `capacity` page
/// entries of [`DELTA_PAGE_BYTES`] (`index`, `page`)), `state` (u64: `capacity`
/// records of [`DELTA_STATE_BYTES`]: `row`, `len`, `last`, `page`), `capacity` (u32),
/// `bucket` (u32), `out` (u64, `bucket` slots), `table` (u64, `rows * table_stride`
/// u32), `rows` (u32), `table_stride` (u32), `page_size` (u32, read only by `_psn`).
///
/// One block (up to [`DELTA_MAX_THREADS`] threads). Thread 0 reads the counts while
/// the threads below [`DELTA_SPEC`] and [`DELTA_FULL_SPEC`] read their first page and
/// full entry (one round trip to host memory in all); the counts reach the block
/// through shared memory. Phase 1 (entries `< min(count, capacity)`, entry `e` by
/// thread `e % ntid`, indices `>= capacity` skipped): a full entry sets `state[index]
/// = {row, len, last, page}` with `last` read from column `len - 1` of the row when the
/// request's next token continues a page (`len % ps != 0`, `row < rows`, `len <=
/// table_stride`), else 0; a page entry sets `state[index].page`. (The host never sends
/// both kinds for one index in a step.) `bar.sync`; thread 0 then copies the block's
/// word 2 (the step's tag, read with the counts) to its word 3 with a system-scope
/// store: the host sees that the block is no longer read and may rewrite it. Phase 2: for `i < bucket` (thread
/// `i % ntid`), with `{row, len, last, page} = state[i]`: a request whose `row >= rows`
/// (padding: `PAD_ROW`) gets slot 0 in `out[i]` and nothing else; otherwise the new
/// token at position `len` gets `page * ps` when it starts a page (`len % ps == 0`),
/// else `last + 1`; the slot goes to `out[i]`, to column `len` of the row (only if `len
/// < table_stride`), and `state[i]` becomes `{row, len + 1, slot, page}`.
pub fn decode_delta(page: PageSize) -> Kernel {
    if let PageSize::Const(c) = page {
        assert!(c.is_power_of_two(), "constant page sizes must be powers of two");
    }
    let mut k = Kernel::new(decode_delta_name(page));
    let deltas = k.param_u64("deltas");
    let state = k.param_u64("state");
    let capacity = k.param_u32("capacity");
    let bucket = k.param_u32("bucket");
    let out = k.param_u64("out");
    let table = k.param_u64("table");
    let rows = k.param_u32("rows");
    let table_stride = k.param_u32("table_stride");
    let page_size = k.param_u32("page_size");
    let counts = k.shared_words("counts", 2, 8);
    let deltas = k.ld_param_u64(deltas);
    let state = k.ld_param_u64(state);
    let capacity = k.ld_param_u32(capacity);
    let table = k.ld_param_u64(table);
    let rows = k.ld_param_u32(rows);
    let stride = k.ld_param_u32(table_stride);
    let ps = k.ld_param_u32(page_size);
    let tid = k.special(Special::TidX);
    let nt = k.special(Special::NtidX);
    let full_base = k.add_u64(deltas, DELTA_HEADER_BYTES as u64);
    let full_bytes = k.mul_wide_u32(capacity, DELTA_ENTRY_BYTES);
    let page_base = k.add_u64(full_base, full_bytes);
    let below_cap = k.setp_u32(Cmp::Lt, tid, capacity);
    k.comment("one round trip: the counts (thread 0) and each thread's first entries");
    let is0 = k.setp_u32(Cmp::Eq, tid, 0u32);
    let c = k.ld_global(Width::B8, deltas, 0, true, Some((is0, true)));
    let tag = k.ld_global(Width::B4, deltas, 8, true, Some((is0, true)))[0];
    let below = k.setp_u32(Cmp::Lt, tid, DELTA_SPEC);
    let page_spec = k.and_pred(below, below_cap);
    let pe_at = k.mad_wide_u32(tid, DELTA_PAGE_BYTES, page_base);
    let pe_spec = k.ld_global(Width::B8, pe_at, 0, true, Some((page_spec, true)));
    let below = k.setp_u32(Cmp::Lt, tid, DELTA_FULL_SPEC);
    let full_spec = k.and_pred(below, below_cap);
    let fe_at = k.mad_wide_u32(tid, DELTA_ENTRY_BYTES, full_base);
    let fe_spec = k.ld_global(Width::B16, fe_at, 0, true, Some((full_spec, true)));
    k.st_shared(Width::B8, &counts, 0, &c, Some((is0, true)));
    k.bar_sync();
    let n = k.ld_shared(Width::B8, &counts, 0);
    let n_full = k.min_u32(n[0], capacity);
    let n_page = k.min_u32(n[1], capacity);

    k.comment("full entries: a request's whole state");
    let e = k.mov_u32(tid);
    let (top, next, done) = (k.label(), k.label(), k.label());
    k.place(top);
    let past = k.setp_u32(Cmp::Ge, e, n_full);
    k.bra_if(past, true, done);
    let first = k.setp_u32(Cmp::Eq, e, tid);
    let use_spec = k.and_pred(first, full_spec);
    let at = k.mad_wide_u32(e, DELTA_ENTRY_BYTES, full_base);
    let fresh = k.ld_global(Width::B16, at, 0, true, Some((use_spec, false)));
    let w: Vec<R32> = (0..4).map(|j| k.selp_b32(fe_spec[j], fresh[j], use_spec)).collect();
    let (index, row, len, pg) = (w[0], w[1], w[2], w[3]);
    let bad = k.setp_u32(Cmp::Ge, index, capacity);
    k.bra_if(bad, true, next);
    k.comment("last_loc from the row when the next token continues a page");
    let (_, r) = div_rem_page(&mut k, page, ps, len);
    let cont = k.setp_u32(Cmp::Ne, r, 0u32);
    let row_ok = k.setp_u32(Cmp::Lt, row, rows);
    let len_ok = k.setp_u32(Cmp::Le, len, stride);
    let need = k.and_pred(cont, row_ok);
    let need = k.and_pred(need, len_ok);
    let cell = k.mad_lo_u32(row, stride, len);
    let prev_cell = k.sub_u32(cell, 1u32);
    let prev_at = k.mad_wide_u32(prev_cell, 4u32, table);
    let prev = k.ld_global(Width::B4, prev_at, 0, false, Some((need, true)))[0];
    let last = k.selp_b32(prev, 0u32, need);
    let s_at = k.mad_wide_u32(index, DELTA_STATE_BYTES, state);
    k.st_global(Width::B16, s_at, 0, &[row, len, last, pg], None);
    k.place(next);
    k.add_u32_to(e, nt);
    k.bra(top);
    k.place(done);

    k.comment("page entries: the fresh page of a request whose next token starts one");
    let e = k.mov_u32(tid);
    let (top, next, done) = (k.label(), k.label(), k.label());
    k.place(top);
    let past = k.setp_u32(Cmp::Ge, e, n_page);
    k.bra_if(past, true, done);
    let first = k.setp_u32(Cmp::Eq, e, tid);
    let use_spec = k.and_pred(first, page_spec);
    let at = k.mad_wide_u32(e, DELTA_PAGE_BYTES, page_base);
    let fresh = k.ld_global(Width::B8, at, 0, true, Some((use_spec, false)));
    let index = k.selp_b32(pe_spec[0], fresh[0], use_spec);
    let pg = k.selp_b32(pe_spec[1], fresh[1], use_spec);
    let bad = k.setp_u32(Cmp::Ge, index, capacity);
    k.bra_if(bad, true, next);
    let s_at = k.mad_wide_u32(index, DELTA_STATE_BYTES, state);
    k.st_global_u32(s_at, 12, pg, None);
    k.place(next);
    k.add_u32_to(e, nt);
    k.bra(top);
    k.place(done);
    k.comment("every entry is in the state before any request advances");
    k.bar_sync();
    k.comment("the block is read: hand it back to the host (its tag to word 3)");
    k.st_global_sys_u32(deltas, 12, tag, Some((is0, true)));

    let bucket = k.ld_param_u32(bucket);
    let out = k.ld_param_u64(out);
    let i = k.mov_u32(tid);
    let advance = k.label();
    let done = k.label();
    k.place(advance);
    let past = k.setp_u32(Cmp::Ge, i, bucket);
    k.bra_if(past, true, done);
    let s_at = k.mad_wide_u32(i, DELTA_STATE_BYTES, state);
    let s = k.ld_global(Width::B16, s_at, 0, false, None);
    let (row, len, last, pg) = (s[0], s[1], s[2], s[3]);
    let live = k.setp_u32(Cmp::Lt, row, rows);
    let (_, r) = div_rem_page(&mut k, page, ps, len);
    let new_page = k.setp_u32(Cmp::Eq, r, 0u32);
    let zero = k.mov_u32(0u32);
    let fresh = page_slot(&mut k, page, ps, pg, zero);
    let old = k.add_u32(last, 1u32);
    let slot = k.selp_b32(fresh, old, new_page);
    let shown = k.selp_b32(slot, 0u32, live);
    let o = k.mad_wide_u32(i, 4u32, out);
    k.st_global_u32(o, 0, shown, None);
    let fits = k.setp_u32(Cmp::Lt, len, stride);
    let write = k.and_pred(live, fits);
    let cell = k.mad_lo_u32(row, stride, len);
    let t = k.mad_wide_u32(cell, 4u32, table);
    k.st_global_u32(t, 0, slot, Some((write, true)));
    let len1 = k.add_u32(len, 1u32);
    k.st_global(Width::B16, s_at, 0, &[row, len1, slot, pg], Some((live, true)));
    k.add_u32_to(i, nt);
    k.bra(advance);
    k.place(done);
    k.ret();
    k
}

/// Quantize one f32 (already in `x`) to an e4m3 byte in the low bits of the result:
/// `x * inv_scale`, round to nearest even, saturate finite values to ±448, NaN -> 0x7f.
///
/// Integer form, shared with the host reference `kvpool::kv::fp8::quantize_e4m3`:
/// with `a = |bits|`, normal results (`a >= 2^-6`) round the f32 mantissa to 3 bits by
/// adding `0x7ffff + lsb` and re-bias the exponent (`(a' >> 20) - (120 << 3)`);
/// subnormal results are `round_even(|y| * 2^9)`, which is exact in f32.
fn quantize_e4m3(k: &mut Kernel, x: F32, inv_scale: F32) -> R32 {
    let y = k.mul_rn_f32(x, inv_scale);
    let bits = k.f32_to_bits(y);
    let sign = k.and_b32(bits, 0x8000_0000u32);
    let sign = k.shr_u32(sign, 24u32);
    let a = k.and_b32(bits, 0x7fff_ffffu32);
    let lsb = k.shr_u32(a, 20u32);
    let lsb = k.and_b32(lsb, 1u32);
    let r = k.add_u32(a, 0x7ffffu32);
    let r = k.add_u32(r, lsb);
    let r = k.shr_u32(r, 20u32);
    let normal = k.sub_u32(r, 960u32);
    let normal = k.min_u32(normal, E4M3_MAX_CODE);
    let fa = k.bits_to_f32(a);
    let fs = k.mul_rn_f32_imm(fa, 512.0);
    let sub = k.cvt_rni_u32_f32(fs);
    let is_sub = k.setp_u32(Cmp::Lt, a, 0x3c80_0000u32);
    let m = k.selp_b32(sub, normal, is_sub);
    let signed = k.or_b32(m, sign);
    // NaN of either sign becomes the positive NaN code, as the hardware conversion does
    // (and `cvt.f32.f16` does not keep a half NaN's sign anyway).
    let is_nan = k.setp_u32(Cmp::Gt, a, 0x7f80_0000u32);
    k.selp_b32(E4M3_NAN_CODE, signed, is_nan)
}

/// The elements of a loaded vector as f32 values, in memory order.
fn unpack_floats(k: &mut Kernel, src: SrcFloat, words: &[R32], vec_bytes: u32) -> Vec<F32> {
    let mut out = Vec::new();
    for &w in words {
        match src {
            SrcFloat::F32 => out.push(k.bits_to_f32(w)),
            SrcFloat::F16 => {
                let (lo, hi) = k.unpack_b16x2(w);
                out.push(k.cvt_f32_f16(lo));
                if vec_bytes >= 4 {
                    out.push(k.cvt_f32_f16(hi));
                }
            }
            SrcFloat::Bf16 => {
                let lo = k.shl_b32(w, 16u32);
                out.push(k.bits_to_f32(lo));
                if vec_bytes >= 4 {
                    let hi = k.and_b32(w, 0xffff_0000u32);
                    out.push(k.bits_to_f32(hi));
                }
            }
        }
    }
    out
}

/// Convert one loaded source vector into the registers to store.
fn convert(
    k: &mut Kernel,
    target: Target,
    store: Store,
    words: Vec<R32>,
    vec_bytes: u32,
    inv_scale: Option<F32>,
) -> Vec<R32> {
    let Store::Fp8(src) = store else { return words };
    let inv_scale = inv_scale.expect("fp8 kernels load inv_scale");
    let floats = unpack_floats(k, src, &words, vec_bytes);
    if target.has_fp8_cvt() {
        // Hardware conversion, two elements per instruction; same rounding and
        // saturation as `quantize_e4m3` (the GPU tests hold the two to the host reference).
        let scaled: Vec<F32> = floats.into_iter().map(|f| k.mul_rn_f32(f, inv_scale)).collect();
        let halves: Vec<_> = scaled
            .chunks(2)
            .map(|pair| {
                let hi = if pair.len() == 2 { pair[1] } else { pair[0] };
                k.cvt_e4m3x2(hi, pair[0])
            })
            .collect();
        return match halves.len() {
            1 if scaled.len() == 1 => {
                let w = k.cvt_u32_u16(halves[0]);
                vec![k.and_b32(w, 0xffu32)]
            }
            1 => vec![k.cvt_u32_u16(halves[0])],
            _ => halves.chunks(2).map(|p| k.pack_b16x2(p[0], p[1])).collect(),
        };
    }
    let bytes: Vec<R32> = floats.into_iter().map(|f| quantize_e4m3(k, f, inv_scale)).collect();
    bytes
        .chunks(4)
        .map(|chunk| {
            let mut w = chunk[0];
            for (j, &b) in chunk.iter().enumerate().skip(1) {
                let s = k.shl_b32(b, 8 * j as u32);
                w = k.or_b32(w, s);
            }
            w
        })
        .collect()
}

/// Copy `count` vectors from `src` to `dst` (per-lane pointers already at vector
/// `lane`), `ROW_UNROLL` vectors in flight per lane, then a tail.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_loop(
    k: &mut Kernel,
    target: Target,
    store: Store,
    vec_bytes: u32,
    nc: bool,
    lane: R32,
    count: R32,
    src: R64,
    dst: R64,
    inv_scale: Option<F32>,
) {
    let sw = Width::from_bytes(vec_bytes).expect("vector width");
    let dst_bytes = store.dst_bytes(vec_bytes);
    let dw = Width::from_bytes(dst_bytes).expect("stored width");
    let v = k.mov_u32(lane);
    let sp = k.add_u64(src, 0u64);
    let dp = k.add_u64(dst, 0u64);
    let (main, tail, done) = (k.label(), k.label(), k.label());
    let unroll = unroll(store);
    k.place(main);
    let last = k.add_u32(v, 32 * (unroll - 1));
    let short = k.setp_u32(Cmp::Ge, last, count);
    k.bra_if(short, true, tail);
    let loaded: Vec<Vec<R32>> = (0..unroll).map(|j| k.ld_global(sw, sp, j * 32 * vec_bytes, nc, None)).collect();
    for (j, words) in loaded.into_iter().enumerate() {
        let out = convert(k, target, store, words, vec_bytes, inv_scale);
        k.st_global(dw, dp, j as u32 * 32 * dst_bytes, &out, None);
    }
    k.add_u32_to(v, 32 * unroll);
    k.add_u64_to(sp, (32 * unroll * vec_bytes) as u64);
    k.add_u64_to(dp, (32 * unroll * dst_bytes) as u64);
    k.bra(main);
    k.place(tail);
    let end = k.setp_u32(Cmp::Ge, v, count);
    k.bra_if(end, true, done);
    let words = k.ld_global(sw, sp, 0, nc, None);
    let out = convert(k, target, store, words, vec_bytes, inv_scale);
    k.st_global(dw, dp, 0, &out, None);
    k.add_u32_to(v, 32u32);
    k.add_u64_to(sp, (32 * vec_bytes) as u64);
    k.add_u64_to(dp, (32 * dst_bytes) as u64);
    k.bra(tail);
    k.place(done);
}

/// Load `slots[token]` and check it against `num_rows`: an out-of-range slot sets the
/// error word to 1 and ends the warp without writing anything.
pub(crate) fn checked_slot(k: &mut Kernel, slots: R64, token: R32, num_rows: R32, err: R64) -> R32 {
    let at = k.mad_wide_u32(token, 4u32, slots);
    let slot = k.ld_global_u32(at, 0, true);
    let bad = k.setp_u32(Cmp::Ge, slot, num_rows);
    k.st_global_u32(err, 0, 1u32, Some((bad, true)));
    k.ret_if(bad, true);
    slot
}

/// A row kernel: see [`RowOp`] for what each does, [`Store`] for the element handling.
/// fp8 stores use the hardware conversion on targets that have it (sm_90) and the
/// integer sequence of `quantize_e4m3` elsewhere (sm_80); both give the same bytes.
///
/// Launch: grid `(ceil(n / ROWS_PER_BLOCK), layers, buffers)`, block
/// `ROW_BLOCK_THREADS`. `ctaid.y` is the layer (its offset is `layer * *_layer_stride`
/// bytes), `ctaid.z` picks the K (0) or V (1) buffer pair (MLA has one buffer: z = 1).
/// Warp `w` of block `b` handles row `b * ROWS_PER_BLOCK + w`; lanes move
/// `vec_bytes`-wide vectors of it. Pool row `slot` starts at `slot * row_bytes`, with
/// `row_bytes = vecs * stored vector bytes`; every slot is checked against `num_rows`.
///
/// Parameters (all byte strides and pointers `u64`, counts `u32`):
///
/// * `Scatter`: `k_src, v_src, src_row_stride, src_layer_stride, k_dst, v_dst,
///   dst_layer_stride, slots, n_tokens, vecs, num_rows, k_inv_scale (f32),
///   v_inv_scale (f32), err`
/// * `ScatterMla`: `nope_src, nope_row_stride, nope_layer_stride, rope_src,
///   rope_row_stride, rope_layer_stride, dst, dst_layer_stride, slots, n_tokens,
///   nope_vecs, rope_vecs, num_rows, inv_scale (f32), err`
/// * `Gather`: `k_src, v_src, src_layer_stride, k_dst, v_dst, dst_row_stride,
///   dst_layer_stride, slots, n_tokens, vecs, num_rows, err`
/// * `Move`: `k, v, layer_stride, src_slots, dst_slots, n_pairs, vecs, num_rows, err`
///
/// # Panics
///
/// If `vec_bytes` is not 1, 2, 4, 8 or 16, if an fp8 store is asked of a gather or a
/// move, or if `vec_bytes` is not a whole number of source elements.
pub fn row_kernel(target: Target, op: RowOp, store: Store, vec_bytes: u32) -> Kernel {
    assert!(Width::from_bytes(vec_bytes).is_some(), "vector width {vec_bytes}");
    if let Store::Fp8(f) = store {
        assert!(matches!(op, RowOp::Scatter | RowOp::ScatterMla), "fp8 conversion is a scatter feature");
        assert!(vec_bytes >= f.bytes(), "a vector holds at least one element");
    }
    let mut k = Kernel::new(row_kernel_name(op, store, vec_bytes));
    let dst_vec = store.dst_bytes(vec_bytes);
    match op {
        RowOp::Scatter => {
            let ks = k.param_u64("k_src");
            let vs = k.param_u64("v_src");
            let srs = k.param_u64("src_row_stride");
            let sls = k.param_u64("src_layer_stride");
            let kd = k.param_u64("k_dst");
            let vd = k.param_u64("v_dst");
            let dls = k.param_u64("dst_layer_stride");
            let sl = k.param_u64("slots");
            let nt = k.param_u32("n_tokens");
            let vc = k.param_u32("vecs");
            let nr = k.param_u32("num_rows");
            let kisc = k.param_f32("k_inv_scale");
            let visc = k.param_f32("v_inv_scale");
            let er = k.param_u64("err");
            let (token, layer, is_v) = row_prologue(&mut k, nt);
            let ks = k.ld_param_u64(ks);
            let vs = k.ld_param_u64(vs);
            let src = k.selp_b64(vs, ks, is_v);
            let sls = k.ld_param_u64(sls);
            let lo = k.mul_lo_u64(layer, sls);
            let src = k.add_u64(src, lo);
            let srs = k.ld_param_u64(srs);
            let t64 = k.cvt_u64_u32(token);
            let to = k.mul_lo_u64(t64, srs);
            let src = k.add_u64(src, to);
            let kd = k.ld_param_u64(kd);
            let vd = k.ld_param_u64(vd);
            let dst = k.selp_b64(vd, kd, is_v);
            let dls = k.ld_param_u64(dls);
            let lo = k.mul_lo_u64(layer, dls);
            let dst = k.add_u64(dst, lo);
            let sl = k.ld_param_u64(sl);
            let nr = k.ld_param_u32(nr);
            let er = k.ld_param_u64(er);
            let slot = checked_slot(&mut k, sl, token, nr, er);
            let vecs = k.ld_param_u32(vc);
            let row_bytes = k.mul_lo_u32(vecs, dst_vec);
            let dst = {
                let off = k.mul_wide_u32(slot, row_bytes);
                k.add_u64(dst, off)
            };
            let inv = if matches!(store, Store::Fp8(_)) {
                let ki = k.ld_param_f32(kisc);
                let vi = k.ld_param_f32(visc);
                Some(k.selp_f32(vi, ki, is_v))
            } else {
                None
            };
            let lane = lane_pointers(&mut k, &[(src, vec_bytes), (dst, dst_vec)]);
            copy_loop(&mut k, target, store, vec_bytes, true, lane.0, vecs, lane.1[0], lane.1[1], inv);
        }
        RowOp::ScatterMla => {
            let ns = k.param_u64("nope_src");
            let nrs = k.param_u64("nope_row_stride");
            let nls = k.param_u64("nope_layer_stride");
            let rs = k.param_u64("rope_src");
            let rrs = k.param_u64("rope_row_stride");
            let rls = k.param_u64("rope_layer_stride");
            let d = k.param_u64("dst");
            let dls = k.param_u64("dst_layer_stride");
            let sl = k.param_u64("slots");
            let nt = k.param_u32("n_tokens");
            let nv = k.param_u32("nope_vecs");
            let rv = k.param_u32("rope_vecs");
            let nr = k.param_u32("num_rows");
            let isc = k.param_f32("inv_scale");
            let er = k.param_u64("err");
            let (token, layer, _) = row_prologue(&mut k, nt);
            let t64 = k.cvt_u64_u32(token);
            let dense =
                |k: &mut Kernel, base: ParamRef<R64>, row_stride: ParamRef<R64>, layer_stride: ParamRef<R64>| {
                    let base = k.ld_param_u64(base);
                    let ls = k.ld_param_u64(layer_stride);
                    let lo = k.mul_lo_u64(layer, ls);
                    let base = k.add_u64(base, lo);
                    let rs = k.ld_param_u64(row_stride);
                    let to = k.mul_lo_u64(t64, rs);
                    k.add_u64(base, to)
                };
            let nope = dense(&mut k, ns, nrs, nls);
            let rope = dense(&mut k, rs, rrs, rls);
            let dst = k.ld_param_u64(d);
            let dls = k.ld_param_u64(dls);
            let lo = k.mul_lo_u64(layer, dls);
            let dst = k.add_u64(dst, lo);
            let sl = k.ld_param_u64(sl);
            let nr = k.ld_param_u32(nr);
            let er = k.ld_param_u64(er);
            let slot = checked_slot(&mut k, sl, token, nr, er);
            let nope_vecs = k.ld_param_u32(nv);
            let rope_vecs = k.ld_param_u32(rv);
            let vecs = k.add_u32(nope_vecs, rope_vecs);
            let row_bytes = k.mul_lo_u32(vecs, dst_vec);
            let dst = {
                let off = k.mul_wide_u32(slot, row_bytes);
                k.add_u64(dst, off)
            };
            let rope_dst = {
                let off = k.mul_wide_u32(nope_vecs, dst_vec);
                k.add_u64(dst, off)
            };
            let inv = if matches!(store, Store::Fp8(_)) { Some(k.ld_param_f32(isc)) } else { None };
            k.comment("the nope part, then the rope part of the row");
            let (lane, ptrs) = lane_pointers(&mut k, &[(nope, vec_bytes), (dst, dst_vec)]);
            copy_loop(&mut k, target, store, vec_bytes, true, lane, nope_vecs, ptrs[0], ptrs[1], inv);
            let (lane, ptrs) = lane_pointers(&mut k, &[(rope, vec_bytes), (rope_dst, dst_vec)]);
            copy_loop(&mut k, target, store, vec_bytes, true, lane, rope_vecs, ptrs[0], ptrs[1], inv);
        }
        RowOp::Gather => {
            let ks = k.param_u64("k_src");
            let vs = k.param_u64("v_src");
            let sls = k.param_u64("src_layer_stride");
            let kd = k.param_u64("k_dst");
            let vd = k.param_u64("v_dst");
            let drs = k.param_u64("dst_row_stride");
            let dls = k.param_u64("dst_layer_stride");
            let sl = k.param_u64("slots");
            let nt = k.param_u32("n_tokens");
            let vc = k.param_u32("vecs");
            let nr = k.param_u32("num_rows");
            let er = k.param_u64("err");
            let (token, layer, is_v) = row_prologue(&mut k, nt);
            let ks = k.ld_param_u64(ks);
            let vs = k.ld_param_u64(vs);
            let src = k.selp_b64(vs, ks, is_v);
            let sls = k.ld_param_u64(sls);
            let lo = k.mul_lo_u64(layer, sls);
            let src = k.add_u64(src, lo);
            let sl = k.ld_param_u64(sl);
            let nr = k.ld_param_u32(nr);
            let er = k.ld_param_u64(er);
            let slot = checked_slot(&mut k, sl, token, nr, er);
            let vecs = k.ld_param_u32(vc);
            let row_bytes = k.mul_lo_u32(vecs, vec_bytes);
            let src = {
                let off = k.mul_wide_u32(slot, row_bytes);
                k.add_u64(src, off)
            };
            let kd = k.ld_param_u64(kd);
            let vd = k.ld_param_u64(vd);
            let dst = k.selp_b64(vd, kd, is_v);
            let dls = k.ld_param_u64(dls);
            let lo = k.mul_lo_u64(layer, dls);
            let dst = k.add_u64(dst, lo);
            let drs = k.ld_param_u64(drs);
            let t64 = k.cvt_u64_u32(token);
            let to = k.mul_lo_u64(t64, drs);
            let dst = k.add_u64(dst, to);
            let (lane, ptrs) = lane_pointers(&mut k, &[(src, vec_bytes), (dst, vec_bytes)]);
            copy_loop(&mut k, target, store, vec_bytes, true, lane, vecs, ptrs[0], ptrs[1], None);
        }
        RowOp::Move => {
            let kb = k.param_u64("k");
            let vb = k.param_u64("v");
            let ls = k.param_u64("layer_stride");
            let ss = k.param_u64("src_slots");
            let ds = k.param_u64("dst_slots");
            let np = k.param_u32("n_pairs");
            let vc = k.param_u32("vecs");
            let nr = k.param_u32("num_rows");
            let er = k.param_u64("err");
            let (pair, layer, is_v) = row_prologue(&mut k, np);
            let kb = k.ld_param_u64(kb);
            let vb = k.ld_param_u64(vb);
            let base = k.selp_b64(vb, kb, is_v);
            let ls = k.ld_param_u64(ls);
            let lo = k.mul_lo_u64(layer, ls);
            let base = k.add_u64(base, lo);
            let ss = k.ld_param_u64(ss);
            let ds = k.ld_param_u64(ds);
            let nr = k.ld_param_u32(nr);
            let er = k.ld_param_u64(er);
            let s = checked_slot(&mut k, ss, pair, nr, er);
            let d = checked_slot(&mut k, ds, pair, nr, er);
            let vecs = k.ld_param_u32(vc);
            let row_bytes = k.mul_lo_u32(vecs, vec_bytes);
            let so = k.mul_wide_u32(s, row_bytes);
            let src = k.add_u64(base, so);
            let dof = k.mul_wide_u32(d, row_bytes);
            let dst = k.add_u64(base, dof);
            let (lane, ptrs) = lane_pointers(&mut k, &[(src, vec_bytes), (dst, vec_bytes)]);
            // Plain loads: the source rows live in the buffer this kernel writes.
            copy_loop(&mut k, target, store, vec_bytes, false, lane, vecs, ptrs[0], ptrs[1], None);
        }
    }
    k.ret();
    k
}

/// Row index, layer (as u64) and "is the V buffer" of this warp; warps past `n` return.
pub(crate) fn row_prologue(k: &mut Kernel, n_param: ParamRef<R32>) -> (R32, R64, Pred) {
    let tid = k.special(Special::TidX);
    let warp = k.shr_u32(tid, 5u32);
    let blk = k.special(Special::CtaidX);
    let row = k.mad_lo_u32(blk, ROWS_PER_BLOCK, warp);
    let n = k.ld_param_u32(n_param);
    let past = k.setp_u32(Cmp::Ge, row, n);
    k.ret_if(past, true);
    let ly = k.special(Special::CtaidY);
    let layer = k.cvt_u64_u32(ly);
    let z = k.special(Special::CtaidZ);
    let is_v = k.setp_u32(Cmp::Ne, z, 0u32);
    (row, layer, is_v)
}

/// This lane's index and each `(row pointer, bytes per vector)` advanced to it.
pub(crate) fn lane_pointers(k: &mut Kernel, rows: &[(R64, u32)]) -> (R32, Vec<R64>) {
    let tid = k.special(Special::TidX);
    let lane = k.and_b32(tid, 31u32);
    let ptrs = rows
        .iter()
        .map(|&(p, bytes)| {
            let off = k.mul_wide_u32(lane, bytes);
            k.add_u64(p, off)
        })
        .collect();
    (lane, ptrs)
}

/// Vector widths generated for a row kernel with this store.
///
/// Plain copies get every width from 16 bytes down to 1, so any row size and alignment
/// has a kernel. fp8 scatters get 16 bytes (the fast path) and one element (any row).
pub fn vector_widths(op: RowOp, store: Store) -> Vec<u32> {
    let _ = op;
    match store {
        Store::Copy => vec![16, 8, 4, 2, 1],
        Store::Fp8(f) => vec![16, f.bytes()],
    }
}

/// Vectors each lane keeps in flight in the main loop of a row kernel with `store`:
/// [`ROW_UNROLL`] for copies, 2 for fp8 (whose conversion arithmetic already overlaps
/// the memory latency, and whose code would otherwise grow large).
pub fn unroll(store: Store) -> u32 {
    match store {
        Store::Copy => ROW_UNROLL,
        Store::Fp8(_) => 2,
    }
}

/// The PTX modules, in a fixed order: `(file stem, module)`.
///
/// * `alloc`: `noop`, `alloc_extend_*`, `alloc_decode_*`, `decode_step_*`,
///   `decode_delta_*`;
/// * `kv_scatter`: `kv_scatter_*` and `kv_scatter_mla_*`, copy and fp8 stores;
/// * `kv_copy`: `kv_gather_*` and `kv_move_*`.
pub fn modules(target: Target) -> Vec<(&'static str, Module)> {
    let mut alloc = Module::new(target);
    alloc.push(noop());
    for decode in [false, true] {
        for page in CONST_PAGE_SIZES.iter().map(|&c| PageSize::Const(c)).chain([PageSize::Runtime]) {
            alloc.push(if decode { alloc_decode(page) } else { alloc_extend(page) });
        }
    }
    for page in CONST_PAGE_SIZES.iter().map(|&c| PageSize::Const(c)).chain([PageSize::Runtime]) {
        alloc.push(decode_step(page));
    }
    for page in CONST_PAGE_SIZES.iter().map(|&c| PageSize::Const(c)).chain([PageSize::Runtime]) {
        alloc.push(decode_delta(page));
    }
    let mut scatter = Module::new(target);
    for op in [RowOp::Scatter, RowOp::ScatterMla] {
        for store in [Store::Copy].into_iter().chain(SrcFloat::ALL.map(Store::Fp8)) {
            for w in vector_widths(op, store) {
                scatter.push(row_kernel(target, op, store, w));
            }
        }
    }
    let mut copy = Module::new(target);
    for op in [RowOp::Gather, RowOp::Move] {
        for w in vector_widths(op, Store::Copy) {
            copy.push(row_kernel(target, op, Store::Copy, w));
        }
    }
    vec![("alloc", alloc), ("kv_scatter", scatter), ("kv_copy", copy)]
}

/// Every generated file: `(relative path, PTX text)`, e.g. `("sm_90/alloc.ptx", ..)`.
pub fn generate_all() -> Vec<(String, String)> {
    let mut files = Vec::new();
    for target in Target::ALL {
        for (stem, module) in
            modules(target).into_iter().chain(crate::mamba::modules(target)).chain(crate::swa::modules(target))
        {
            files.push((format!("{}/{stem}.ptx", target.sm()), module.to_ptx()));
        }
    }
    files
}
