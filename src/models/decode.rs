//! The host halves of the graph decode paths against each other (feature `models`):
//! the shared driver of `tests/decode_staging_model.rs` and the `decode_staging` fuzz
//! target.
//!
//! Two sides, each with its own [`PagedAllocator`] and table of request rows, see the
//! same requests join (a prefill), grow (an extend), leave (their slots freed) and
//! decode:
//!
//! * the delta side: a [`DeltaPlanner`] stages each step, and the host reference of its
//!   kernel, [`decode_delta`], writes the slots and the rows;
//! * the full-records side: [`stage_decode_after`] stages each step, with each
//!   request's last slot where the planner knows it (`u32::MAX` where it does not),
//!   and [`decode_with_rows`] writes the slots and the rows.
//!
//! The planner is told a request's last slot after a join or an extend when the op
//! says so, and any value at all by [`DecodeOp::Hint`] (stale, allocated, out of range:
//! a hint only). Both pools are squeezed by holding pages, so steps run out of pages,
//! and requests reach the end of their row, so steps are refused for that.
//!
//! The rules it checks, after every op:
//!
//! * a step succeeds on one side exactly when it succeeds on the other, with the same
//!   error, and a refused step reserves nothing;
//! * a step takes the same fresh pages on both sides, gives every request the same
//!   slot, writes the same rows, hands its pages to exactly the page-starting
//!   requests, and gives padding entries slot 0;
//! * at page size 1 every request takes a slot, and the last slots are read; at other
//!   page sizes they are never read;
//! * both pools have the same free count, and every slot a live request's row holds is
//!   allocated; the planner's batch, rows and lengths are the requests'.
//!
//! At the end every request leaves and both pools are whole again.

use arbitrary::Arbitrary;

use crate::kv::delta::{delta_block_words, DeltaPlanner, DeltaSlot};
use crate::kv::ptx::PAD_ROW;
use crate::kv::reference::{decode_delta, decode_with_rows, extend_with_rows, RowTable};
use crate::kv::staging::{bucket_for, decode_block_bytes, decode_records_bytes, stage_decode_after, RowLimits};
use crate::kv::KvError;
use crate::{KvAllocator, PagedAllocator};

/// Rows of each side's table.
pub const ROWS: u32 = 12;
/// Cells per row: a request can grow to this many tokens.
pub const STRIDE: u32 = 96;
/// The planner's capacity (the most requests in a batch).
pub const CAPACITY: usize = 10;
/// Tokens in each pool: less than the rows can hold, so steps run out of pages.
pub const POOL_TOKENS: usize = 640;
/// The page sizes an input picks from.
pub const PAGE_SIZES: [u32; 4] = [1, 2, 5, 16];
/// How many ops the `decode_staging` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 96;

/// One step of a [`run_decode`] sequence. Raw numbers are reduced into range as
/// documented per variant; `at` picks live request `at % batch`.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum DecodeOp {
    /// A request joins in the lowest free row with a prefill of `len % 48` tokens;
    /// with `tell`, and a prefill of at least one token, the planner learns where it
    /// ended. A no-op when no row is free or the batch is full.
    Join {
        /// Raw prefill length.
        len: u8,
        /// Tell the planner the prefill's last slot.
        tell: bool,
    },
    /// Request `at` grows by `1 + add % 24` tokens (an extend, such as the next chunk of
    /// a chunked prefill; cut at the row's end); `tell` as for `Join`.
    Extend {
        /// Raw request.
        at: u8,
        /// Raw growth.
        add: u8,
        /// Tell the planner the extend's last slot.
        tell: bool,
    },
    /// Request `at` finishes: it leaves the batch and its slots are freed.
    Leave {
        /// Raw request.
        at: u8,
    },
    /// Tell the planner that request `at`'s last slot is `slot` (any value).
    Hint {
        /// Raw request.
        at: u8,
        /// The slot claimed.
        slot: u16,
    },
    /// Hold `n % 24` more pages of each pool; `n % 24 == 0` gives every held page back.
    Squeeze {
        /// Raw count.
        n: u8,
    },
    /// One decode step: every request gets one token.
    Step,
}

/// Decode up to `max` ops from fuzzer bytes.
pub fn decode_ops_from_bytes(bytes: &[u8], max: usize) -> Vec<DecodeOp> {
    super::decode_ops(bytes, max)
}

/// What a run did (the tests assert that random runs reach every outcome).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Steps that ran.
    pub steps: usize,
    /// Steps refused for want of pages.
    pub out_of_pages: usize,
    /// Steps refused because a request would pass the end of its row.
    pub row_end: usize,
    /// Page-size-1 slots that continued their request's run.
    pub continued: usize,
    /// Page-size-1 slots that started a run.
    pub started: usize,
    /// Hints given (`Hint` ops and told joins and extends).
    pub hints: usize,
    /// Requests that left while another moved into their batch index.
    pub moves: usize,
}

impl core::ops::AddAssign for DecodeStats {
    fn add_assign(&mut self, o: DecodeStats) {
        self.steps += o.steps;
        self.out_of_pages += o.out_of_pages;
        self.row_end += o.row_end;
        self.continued += o.continued;
        self.started += o.started;
        self.hints += o.hints;
        self.moves += o.moves;
    }
}

/// One side: a pool and a table of rows.
struct Side {
    host: PagedAllocator,
    cells: Vec<u32>,
    held: Vec<u32>,
}

impl Side {
    fn new(ps: u32) -> Side {
        Side {
            host: PagedAllocator::new(POOL_TOKENS, ps).expect("a valid pool"),
            cells: vec![0; (ROWS * STRIDE) as usize],
            held: Vec::new(),
        }
    }

    /// Grow `row` from `from` to `to` tokens: fresh pages, the row written. The new
    /// slots, or `None` (nothing changed) when pages run out.
    fn extend(&mut self, row: u32, from: u32, to: u32) -> Option<Vec<u32>> {
        let ps = self.host.page_size();
        let mut pages = vec![0u32; crate::alloc::new_pages(ps, from, to) as usize];
        self.host.reserve_pages(&mut pages).ok()?;
        let mut out = vec![0u32; (to - from) as usize];
        let rt = RowTable { cells: &mut self.cells, stride: STRIDE as usize, rows: &[row] };
        extend_with_rows(ps, &[from], &[to], None, &pages, &mut out, Some(rt)).expect("a valid extend");
        Some(out)
    }

    fn slots(&self, row: u32, len: u32) -> &[u32] {
        &self.cells[(row * STRIDE) as usize..][..len as usize]
    }

    fn finish(&self, row: u32, len: u32) -> Result<(), String> {
        self.host.free(self.slots(row, len)).map_err(|e| format!("freeing row {row}: {e}"))
    }

    /// Free every held page.
    fn give_back(&mut self) -> Result<(), String> {
        let ps = self.host.page_size();
        let slots: Vec<u32> = self.held.drain(..).map(|p| p * ps).collect();
        self.host.free(&slots).map_err(|e| format!("giving back held pages: {e}"))
    }
}

/// Grow `row` from `from` to `to` tokens on both sides: the new slots (the same on
/// both), `None` when both ran out of pages, an error when they disagree.
fn extend_both(d: &mut Side, m: &mut Side, row: u32, from: u32, to: u32) -> Result<Option<Vec<u32>>, String> {
    match (d.extend(row, from, to), m.extend(row, from, to)) {
        (Some(a), Some(b)) if a == b => Ok(Some(a)),
        (None, None) => Ok(None),
        (a, b) => Err(format!("the extends of row {row} ({from}..{to}) differ: {a:?} / {b:?}")),
    }
}

/// A live request, in batch order.
#[derive(Clone, Copy, Debug)]
struct Request {
    row: u32,
    len: u32,
    /// The last slot the planner was told or gave it (`u32::MAX`: none).
    hint: u32,
}

/// Run `ops` at page size `PAGE_SIZES[page % 4]` and check every rule; the first broken
/// one is the error.
pub fn run_decode(page: u8, ops: &[DecodeOp]) -> Result<DecodeStats, String> {
    let ps = PAGE_SIZES[page as usize % PAGE_SIZES.len()];
    let limits = RowLimits { rows: ROWS, max_context_len: STRIDE };
    let mut plan = DeltaPlanner::new(ps, limits, CAPACITY).map_err(|e| e.to_string())?;
    let (mut d, mut m) = (Side::new(ps), Side::new(ps));
    let whole = d.host.available_size();
    let mut block = vec![0u32; delta_block_words(CAPACITY)];
    let (mut fresh, mut owners) = (vec![0u32; CAPACITY], vec![0u32; CAPACITY]);
    let mut state = vec![DeltaSlot::PAD; bucket_for(CAPACITY)];
    let mut mblock = vec![0u32; decode_block_bytes(bucket_for(CAPACITY)) / 4];
    let mut live: Vec<Request> = Vec::new();
    let mut stats = DecodeStats::default();
    for (step, op) in ops.iter().enumerate() {
        let fail = |what: String| format!("page size {ps}, step {step} ({op:?}): {what}");
        match *op {
            DecodeOp::Join { len, tell } => {
                let free_row = (0..ROWS).find(|r| live.iter().all(|q| q.row != *r));
                let Some(row) = free_row.filter(|_| live.len() < CAPACITY) else { continue };
                let len = len as u32 % 48;
                let Some(a) = extend_both(&mut d, &mut m, row, 0, len).map_err(&fail)? else { continue };
                let index = plan.join(row, len).map_err(|e| fail(format!("join refused: {e}")))?;
                if index as usize != live.len() {
                    return Err(fail(format!("joined at index {index}, not {}", live.len())));
                }
                let mut hint = u32::MAX;
                if let (true, Some(&last)) = (tell, a.last()) {
                    plan.set_last_slot(index, last).map_err(|e| fail(e.to_string()))?;
                    (hint, stats.hints) = (last, stats.hints + 1);
                }
                live.push(Request { row, len, hint });
            }
            DecodeOp::Extend { at, add, tell } => {
                if live.is_empty() {
                    continue;
                }
                let i = at as usize % live.len();
                let r = live[i];
                let to = (r.len + 1 + add as u32 % 24).min(STRIDE);
                if to == r.len {
                    continue;
                }
                let Some(a) = extend_both(&mut d, &mut m, r.row, r.len, to).map_err(&fail)? else { continue };
                plan.set_len(i as u32, to).map_err(|e| fail(format!("set_len refused: {e}")))?;
                live[i].len = to;
                live[i].hint = u32::MAX;
                if tell {
                    let last = *a.last().expect("an extend adds a token");
                    plan.set_last_slot(i as u32, last).map_err(|e| fail(e.to_string()))?;
                    (live[i].hint, stats.hints) = (last, stats.hints + 1);
                }
            }
            DecodeOp::Leave { at } => {
                if live.is_empty() {
                    continue;
                }
                let i = at as usize % live.len();
                let r = live.swap_remove(i);
                d.finish(r.row, r.len).map_err(&fail)?;
                m.finish(r.row, r.len).map_err(&fail)?;
                let moved = plan.leave(i as u32).map_err(|e| fail(format!("leave refused: {e}")))?;
                if moved != (i < live.len()).then_some(live.len() as u32) {
                    return Err(fail(format!("leave moved {moved:?}")));
                }
                stats.moves += moved.is_some() as usize;
            }
            DecodeOp::Hint { at, slot } => {
                if live.is_empty() {
                    if plan.set_last_slot(0, slot as u32).is_ok() {
                        return Err(fail("a hint for an empty batch was taken".into()));
                    }
                    continue;
                }
                let i = at as usize % live.len();
                plan.set_last_slot(i as u32, slot as u32).map_err(|e| fail(e.to_string()))?;
                if ps == 1 {
                    live[i].hint = slot as u32;
                }
                stats.hints += 1;
            }
            DecodeOp::Squeeze { n } => {
                let n = n as usize % 24;
                for side in [&mut d, &mut m] {
                    if n == 0 {
                        side.give_back().map_err(&fail)?;
                    } else {
                        let mut pages = vec![0u32; n.min(side.host.available_pages())];
                        side.host.reserve_pages(&mut pages).map_err(|e| fail(e.to_string()))?;
                        side.held.extend(pages);
                    }
                }
                if d.held != m.held {
                    return Err(fail(format!("held pages differ: {:?} / {:?}", d.held, m.held)));
                }
            }
            DecodeOp::Step => step_both(
                ps,
                limits,
                &mut plan,
                (&mut d, &mut m),
                &mut live,
                &mut stats,
                Scratch {
                    block: &mut block,
                    fresh: &mut fresh,
                    owners: &mut owners,
                    state: &mut state,
                    mblock: &mut mblock,
                },
            )
            .map_err(&fail)?,
        }
        check(&plan, &d, &m, &live).map_err(&fail)?;
    }
    for r in live.drain(..).rev() {
        d.finish(r.row, r.len)?;
        m.finish(r.row, r.len)?;
        plan.leave(plan.batch() as u32 - 1).map_err(|e| e.to_string())?;
    }
    for side in [&mut d, &mut m] {
        side.give_back()?;
        if side.host.available_size() != whole {
            return Err(format!("page size {ps}: the pool is not whole at the end"));
        }
    }
    Ok(stats)
}

struct Scratch<'a> {
    block: &'a mut [u32],
    fresh: &'a mut [u32],
    owners: &'a mut [u32],
    state: &'a mut [DeltaSlot],
    mblock: &'a mut [u32],
}

fn same_error(a: &KvError, b: &KvError) -> bool {
    match (a, b) {
        (KvError::Alloc(_), KvError::Alloc(_)) => true,
        (KvError::Shape { what: x, .. }, KvError::Shape { what: y, .. }) => x == y,
        _ => false,
    }
}

/// One decode step on both sides, compared.
fn step_both(
    ps: u32,
    limits: RowLimits,
    plan: &mut DeltaPlanner,
    (d, m): (&mut Side, &mut Side),
    live: &mut [Request],
    stats: &mut DecodeStats,
    s: Scratch<'_>,
) -> Result<(), String> {
    let batch = live.len();
    let seq: Vec<u32> = live.iter().map(|r| r.len + 1).collect();
    let rows: Vec<u32> = live.iter().map(|r| r.row).collect();
    let (before_d, before_m) = (d.host.available_size(), m.host.available_size());
    let staged = plan.stage(&d.host, s.block, s.fresh, s.owners);
    let bucket = bucket_for(batch);
    let words = decode_block_bytes(bucket) / 4;
    let read = core::cell::Cell::new(0usize);
    let hint = |i: usize| {
        read.set(read.get() + 1);
        live[i].hint
    };
    let mstaged = stage_decode_after(
        &m.host,
        &seq,
        &rows,
        bucket,
        limits,
        bytemuck::cast_slice_mut(&mut s.mblock[..words]),
        hint,
    );
    let (staged, mstaged) = match (staged, mstaged) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(a), Err(b)) if same_error(&a, &b) => {
            if (d.host.available_size(), m.host.available_size()) != (before_d, before_m) {
                return Err(format!("a refused step reserved pages ({a})"));
            }
            match a {
                KvError::Alloc(_) => stats.out_of_pages += 1,
                _ => stats.row_end += 1,
            }
            return Ok(());
        }
        (a, b) => return Err(format!("the sides disagree: delta {a:?}, full records {b:?}")),
    };
    let reads = read.get();
    if reads != if ps == 1 { batch } else { 0 } {
        return Err(format!("{reads} last slots read for {batch} requests"));
    }
    if (staged.batch, staged.bucket, staged.new_pages) != (batch, bucket, mstaged.new_pages) {
        return Err(format!("staged {staged:?} / {mstaged:?}"));
    }
    let n = staged.new_pages;
    let at = decode_records_bytes(bucket) / 4;
    let (pages, mpages) = (s.fresh[..n].to_vec(), s.mblock[at..at + n].to_vec());
    if pages != mpages {
        return Err(format!("fresh pages differ: delta {pages:?}, full records {mpages:?}"));
    }
    let starters: Vec<u32> = (0..batch as u32).filter(|&i| live[i as usize].len % ps == 0).collect();
    if s.owners[..n] != starters[..] {
        return Err(format!("pages went to {:?}, not the page-starting {starters:?}", &s.owners[..n]));
    }
    let mut out = vec![u32::MAX; bucket];
    let full = plan.full_entries(s.block, &staged).to_vec();
    let paged = plan.page_entries(s.block, &staged).to_vec();
    if full.iter().any(|e| e.row == PAD_ROW && e.index < batch as u32) {
        return Err("a live index staged as padding".into());
    }
    decode_delta(ps, s.state, &full, &paged, bucket, &mut out, &mut d.cells, ROWS, STRIDE as usize)
        .map_err(|e| format!("the delta kernel's reference refused the step: {e}"))?;
    plan.commit();
    let mut want = vec![0u32; batch];
    let rt = RowTable { cells: &mut m.cells, stride: STRIDE as usize, rows: &rows };
    decode_with_rows(ps, &seq, None, &mpages, &mut want, Some(rt)).map_err(|e| format!("full records refused: {e}"))?;
    if out[..batch] != want[..] {
        return Err(format!("slots differ: delta {:?}, full records {want:?}", &out[..batch]));
    }
    if out[batch..].iter().any(|&x| x != 0) {
        return Err(format!("padding entries got {:?}, not slot 0", &out[batch..]));
    }
    if d.cells != m.cells {
        return Err("the rows differ".into());
    }
    for (r, &slot) in live.iter_mut().zip(&want) {
        if ps == 1 {
            if r.hint != u32::MAX && slot == r.hint.wrapping_add(1) {
                stats.continued += 1;
            } else {
                stats.started += 1;
            }
            r.hint = slot;
        }
        r.len += 1;
    }
    stats.steps += 1;
    Ok(())
}

/// The state both sides must agree on after every op.
fn check(plan: &DeltaPlanner, d: &Side, m: &Side, live: &[Request]) -> Result<(), String> {
    if d.host.available_size() != m.host.available_size() {
        return Err(format!("free counts differ: {} / {}", d.host.available_size(), m.host.available_size()));
    }
    if plan.batch() != live.len() {
        return Err(format!("the planner holds {} requests, not {}", plan.batch(), live.len()));
    }
    for (i, r) in live.iter().enumerate() {
        let got = (plan.row(i as u32).map_err(|e| e.to_string())?, plan.len(i as u32).map_err(|e| e.to_string())?);
        if got != (r.row, r.len) {
            return Err(format!("index {i}: the planner has (row, len) {got:?}, not {:?}", (r.row, r.len)));
        }
        if let Some(&s) = d.slots(r.row, r.len).iter().find(|&&s| !d.host.is_allocated(s)) {
            return Err(format!("row {} holds slot {s}, which is free", r.row));
        }
    }
    Ok(())
}
