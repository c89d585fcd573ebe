//! GPU benchmark of kvpool's generated kernels (feature `cuda`).
//!
//! ```text
//! cargo build --release --features cuda --bin gpu_bench
//! gpu_bench [--quick] [--out FILE] [--target 80]
//! ```
//!
//! Prints markdown tables (and writes them to FILE):
//!
//! 1. `kv_scatter` bandwidth — bytes read + written per second — against a
//!    device-to-device `memcpy` of the same bytes in the same run, over batches of
//!    1024..65536 tokens and rows of 1..4 KiB, random and sequential slots, one layer
//!    and all layers in one launch; fp8 quantizing scatter too.
//! 2. `alloc_extend` / `alloc_decode` kernel time for 1..1024 requests against an empty
//!    kernel launch (the launch floor), and the whole call (host plan + reserve + copy +
//!    launch).
//! 3. The decode step end to end: `alloc_decode` with the fused row write, then one
//!    layer of `kv_scatter` at the new slots.
//! 4. The decode step's memory operations without host synchronization (section
//!    `decode`): wall time per step over 10,000 steps for 1..1024 requests, eager
//!    (`DevicePagedAllocator::alloc_decode`), from captured graphs (`DecodeGraphs`) and
//!    from captured graphs fed only the changes (`DeltaDecode`), against the floor
//!    graph (one copy of the full records' bytes and one empty kernel).
//! 5. `kv_scatter` through kvpool's own cache and through a view of separately
//!    allocated layers on another stream (the interop path), same run.
//!
//! `--section decode` (or `scatter`, `alloc`, `step`, `delta`, `view`) runs one section
//! only; `delta` is a diagnostic of the delta decode step (page size 16 against 1024,
//! and how often the host waits for the device).
//!
//! Timing: CUDA events around `reps` back-to-back operations, after a warm-up, median
//! of `samples` such measurements; inputs rotate among buffer sets larger than L2.

use std::sync::Arc;
use std::time::Instant;

use cust::event::{Event, EventFlags};
use cust::memory::{AsyncCopyDestination, CopyDestination, DeviceBuffer, DeviceSlice};
use cust::stream::{Stream, StreamFlags};
use kvpool::cuda::{
    DecodeGraphs, DeltaDecode, DeviceKvCache, DevicePagedAllocator, DeviceReqToToken, FloorGraph, KvCacheView,
    KvDevice, LastLocs, Layers, Rows, Staging,
};
use kvpool::kv::delta::{delta_block_words, DeltaPlanner};
use kvpool::kv::staging::{bucket_for, decode_block_bytes, decode_records_bytes, stage_decode, RowLimits};
use kvpool::kv::{KvConfig, KvDtype, KvLayout, SrcFloat};
use kvpool::{KvAllocator, PagedAllocator};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Timer {
    start: Event,
    stop: Event,
    samples: usize,
}

impl Timer {
    /// Median microseconds per call of `op` (called `reps` times between two events).
    fn per_op(&self, dev: &KvDevice, reps: usize, mut op: impl FnMut(usize) -> Result<()>) -> Result<f64> {
        for i in 0..reps.min(20) {
            op(i)?;
        }
        dev.synchronize()?;
        let mut times = Vec::with_capacity(self.samples);
        let mut k = 0;
        for _ in 0..self.samples {
            self.start.record(dev.stream())?;
            for _ in 0..reps {
                op(k)?;
                k += 1;
            }
            self.stop.record(dev.stream())?;
            self.stop.synchronize()?;
            times.push(self.stop.elapsed_time_f32(&self.start)? as f64 * 1000.0 / reps as f64);
        }
        Ok(median(&mut times))
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn shuffled(n: usize, m: usize, rng: &mut Rng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..m as u32).collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v.truncate(n);
    v
}

fn random_bytes(n: usize, rng: &mut Rng) -> Vec<u8> {
    // bf16 values of moderate size (no NaNs), so fp8 paths see real data.
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let x = (rng.below(2_000_001) as f32 - 1_000_000.0) / 250_000.0;
        let b = (x.to_bits() >> 16) as u16;
        v.extend(b.to_le_bytes());
    }
    v.truncate(n);
    v
}

struct Out {
    text: String,
}
impl Out {
    fn line(&mut self, s: impl AsRef<str>) {
        println!("{}", s.as_ref());
        self.text.push_str(s.as_ref());
        self.text.push('\n');
    }
}

const L2_ROTATE_BYTES: usize = 256 << 20;

#[allow(clippy::too_many_arguments)]
fn scatter_row(
    dev: &KvDevice,
    t: &Timer,
    out: &mut Out,
    rng: &mut Rng,
    tokens: usize,
    row_bytes: usize,
    layers: u32,
    sequential: bool,
    fp8: bool,
    quick: bool,
) -> Result<()> {
    let elems = row_bytes / 2; // bf16 source rows
    let (head_dim, head_num) = (64u32, (elems / 64) as u32);
    let dtype = if fp8 { KvDtype::Fp8E4m3 } else { KvDtype::Bf16 };
    let rows_wanted = (tokens * 4).max(1 << 17);
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num, head_dim },
        dtype,
        layer_num: layers,
        size: rows_wanted,
        page_size: 16,
    };
    let cache = DeviceKvCache::new(cfg)?;
    let src_bytes_per_set = layers as usize * tokens * row_bytes; // per K or V
    let sets = (L2_ROTATE_BYTES / (2 * src_bytes_per_set)).clamp(1, if quick { 4 } else { 16 });
    let host = random_bytes(src_bytes_per_set, rng);
    let mut srcs = Vec::new();
    for _ in 0..sets {
        srcs.push((DeviceBuffer::from_slice(&host)?, DeviceBuffer::from_slice(&host)?));
    }
    let mut slot_sets = Vec::new();
    for s in 0..sets {
        let slots: Vec<u32> = if sequential {
            let base = 16 + (s * tokens) % (cfg.rows() - tokens - 16);
            (base as u32..(base + tokens) as u32).collect()
        } else {
            shuffled(tokens, cfg.rows(), rng)
        };
        slot_sets.push(DeviceBuffer::from_slice(&slots)?);
    }
    let layer_sel = if layers == 1 { Layers::One(0) } else { Layers::All };
    let reps = if quick { 5 } else { 20 };
    let scatter_us = t.per_op(dev, reps, |i| {
        let (k, v) = &srcs[i % sets];
        let rows = |d| Rows::new(d, row_bytes, tokens * row_bytes);
        let src = fp8.then_some(SrcFloat::Bf16);
        cache.set_kv(dev, layer_sel, &slot_sets[i % sets], rows(k), rows(v), src, (1.0, 1.0))?;
        Ok(())
    })?;
    cache.take_error(dev)?;
    // The same bytes through one memcpy: it reads and writes `moved / 2` bytes each,
    // what the scatter reads (K and V sources) and writes (K and V rows) in total.
    let stored = if fp8 { src_bytes_per_set / 2 } else { src_bytes_per_set };
    let moved = 2 * (src_bytes_per_set + stored); // read + written, K and V
    let copy_len = moved / 2;
    let mut pairs = Vec::new();
    for _ in 0..sets {
        // Real data in the source (never time on zeros).
        let src = DeviceBuffer::<u8>::zeroed(copy_len)?;
        let mut at = 0;
        while at < copy_len {
            let n = (copy_len - at).min(host.len());
            src.index(at..at + n).copy_from(&host[..n])?;
            at += n;
        }
        pairs.push((src, DeviceBuffer::<u8>::zeroed(copy_len)?));
    }
    let memcpy_us = t.per_op(dev, reps, |i| {
        let (src, dst) = &pairs[i % sets];
        let mut d: DeviceSlice<u8> = dst.index(..);
        // SAFETY: a device-to-device copy between two buffers owned here, same length;
        // both outlive the copy (they are dropped after the timer synchronized).
        unsafe { d.async_copy_from(&src.index(..), dev.stream())? };
        Ok(())
    })?;
    let gbps = |us: f64| moved as f64 / us / 1e3;
    out.line(format!(
        "| {}{} | {tokens} | {row_bytes} | {layers} | {} | {:.1} | {:.0} | {:.1} | {:.0} | {:.0}% |",
        if fp8 { "fp8 " } else { "" },
        if sequential { "seq" } else { "random" },
        moved >> 20,
        scatter_us,
        gbps(scatter_us),
        memcpy_us,
        gbps(memcpy_us),
        100.0 * memcpy_us / scatter_us
    ));
    Ok(())
}

fn alloc_rows(dev: &KvDevice, t: &Timer, out: &mut Out, rng: &mut Rng, batch: usize, quick: bool) -> Result<()> {
    let ps = 16;
    let host = Arc::new(PagedAllocator::new(1 << 22, ps)?);
    let table = DeviceReqToToken::new(1024, 8192)?;
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
    let rows: Vec<u32> = shuffled(batch, 1024, rng);
    // Extend: a 64-token chunk per request on a random prefix, last_loc from the rows.
    let prefix: Vec<u32> = (0..batch).map(|_| rng.below(4000) as u32).collect();
    let seq: Vec<u32> = prefix.iter().map(|p| p + 64).collect();
    for (&r, &p) in rows.iter().zip(&prefix) {
        let cells: Vec<u32> = (0..p).map(|k| 16 * 1000 + k).collect();
        table.write(dev, r, 0, &cells)?;
    }
    let n_tok: usize = 64 * batch;
    let ext_out = DeviceBuffer::<u32>::zeroed(n_tok)?;
    let reps = if quick { 50 } else { 200 };
    let staged = dalloc.stage_extend(dev, &prefix, &seq, LastLocs::FromRows, Some((&table, &rows)))?;
    let ext_us = t.per_op(dev, reps, |_| Ok(dalloc.expand(dev, &staged, &ext_out, Some(&table))?))?;
    let pages = dalloc.pages(&staged)?.to_vec();
    dalloc.free_pages(&pages)?;
    // Decode: one token per request.
    let dseq: Vec<u32> = prefix.iter().map(|p| p + 1).collect();
    let dec_out = DeviceBuffer::<u32>::zeroed(batch)?;
    let staged = dalloc.stage_decode(dev, &dseq, LastLocs::FromRows, Some((&table, &rows)))?;
    let dec_us = t.per_op(dev, reps, |_| Ok(dalloc.expand(dev, &staged, &dec_out, Some(&table))?))?;
    let pages = dalloc.pages(&staged)?.to_vec();
    dalloc.free_pages(&pages)?;
    let noop_blocks = batch as u32; // the extend grid: one block per request
    let noop_us = t.per_op(dev, reps, |_| Ok(dev.launch_noop(dev, 1, 128)?))?;
    let noop_grid_us = t.per_op(dev, reps, |_| Ok(dev.launch_noop(dev, noop_blocks, 128)?))?;
    // The whole call: plan + reserve + pinned copy + launch (+ free, off the clock).
    let mut call = |decode: bool| -> Result<f64> {
        let mut times = Vec::new();
        for i in 0..reps {
            let t0 = Instant::now();
            let staged = if decode {
                dalloc.alloc_decode(dev, &dseq, LastLocs::FromRows, Some((&table, &rows)), &dec_out)?
            } else {
                dalloc.alloc_extend(dev, &prefix, &seq, LastLocs::FromRows, Some((&table, &rows)), &ext_out)?
            };
            dev.synchronize()?;
            if i >= 10 {
                times.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            let pages = dalloc.pages(&staged)?.to_vec();
            dalloc.free_pages(&pages)?;
        }
        Ok(median(&mut times))
    };
    let ext_call = call(false)?;
    let dec_call = call(true)?;
    out.line(format!(
        "| {batch} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x / {:.2}x | {:.1} | {:.1} |",
        noop_us,
        noop_grid_us,
        ext_us,
        dec_us,
        ext_us / noop_us,
        dec_us / noop_us,
        ext_call,
        dec_call
    ));
    Ok(())
}

fn decode_step(dev: &KvDevice, out: &mut Out, rng: &mut Rng, batch: usize, quick: bool) -> Result<()> {
    let ps = 16;
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
        dtype: KvDtype::Bf16,
        layer_num: 1,
        size: 1 << 20,
        page_size: ps,
    };
    let cache = DeviceKvCache::new(cfg)?;
    let host = Arc::new(PagedAllocator::new(cfg.size, ps)?);
    let table = DeviceReqToToken::new(1024, 8192)?;
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
    let rows: Vec<u32> = shuffled(batch, 1024, rng);
    // Start every request with a real prefix (allocated through the device path).
    let mut seq: Vec<u32> = (0..batch).map(|_| 1 + rng.below(1000) as u32).collect();
    let prefix_out = DeviceBuffer::<u32>::zeroed(seq.iter().map(|&s| s as usize).sum())?;
    let zeros = vec![0u32; batch];
    dalloc.alloc_extend(dev, &zeros, &seq, LastLocs::Host(&zeros), Some((&table, &rows)), &prefix_out)?;
    let row_bytes = cfg.row_bytes();
    let k = DeviceBuffer::from_slice(&random_bytes(batch * row_bytes, rng))?;
    let v = DeviceBuffer::from_slice(&random_bytes(batch * row_bytes, rng))?;
    let slots = DeviceBuffer::<u32>::zeroed(batch)?;
    let steps = if quick { 50 } else { 300 };
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    let mut wall = Vec::new();
    let mut device = Vec::new();
    for step in 0..steps {
        for s in seq.iter_mut() {
            *s += 1;
        }
        let t0 = Instant::now();
        start.record(dev.stream())?;
        dalloc.alloc_decode(dev, &seq, LastLocs::FromRows, Some((&table, &rows)), &slots)?;
        let r = |d| Rows::new(d, row_bytes, 0);
        cache.set_kv(dev, Layers::One(0), &slots, r(&k), r(&v), None, (1.0, 1.0))?;
        stop.record(dev.stream())?;
        stop.synchronize()?;
        if step >= 10 {
            wall.push(t0.elapsed().as_secs_f64() * 1e6);
            device.push(stop.elapsed_time_f32(&start)? as f64 * 1000.0);
        }
    }
    cache.take_error(dev)?;
    out.line(format!(
        "| {batch} | {:.1} | {:.1} | {} |",
        median(&mut device),
        median(&mut wall),
        host.available_pages()
    ));
    Ok(())
}

/// Requests of the decode-step benchmark: rows, lengths and the pages each holds, as
/// their first slots (to free them, in one call per request, when a request reaches
/// `LIMIT` tokens and starts over).
struct Batch {
    rows: Vec<u32>,
    seq: Vec<u32>,
    pages: Vec<Vec<u32>>,
}

/// Free a request's pages (given by their first slots) in one call.
fn free_request(host: &PagedAllocator, page_slots: &mut Vec<u32>) -> Result<()> {
    let mut group = host.free_group();
    group.free(page_slots)?;
    group.end();
    page_slots.clear();
    Ok(())
}

const LIMIT: u32 = 4096;

impl Batch {
    /// `batch` requests in random rows, each with a prefill of 1..1000 tokens.
    fn new(
        dev: &KvDevice,
        dalloc: &mut DevicePagedAllocator,
        table: &DeviceReqToToken,
        rng: &mut Rng,
        batch: usize,
    ) -> Result<Batch> {
        let ps = dalloc.allocator().page_size();
        let rows = shuffled(batch, table.rows() as usize, rng);
        let seq: Vec<u32> = (0..batch).map(|_| 1 + rng.below(1000) as u32).collect();
        let mut pages: Vec<Vec<u32>> = (0..batch).map(|_| Vec::with_capacity((LIMIT / ps + 2) as usize)).collect();
        let out = DeviceBuffer::<u32>::zeroed(1000)?;
        for i in 0..batch {
            let o = out.index(..seq[i] as usize);
            let staged =
                dalloc.alloc_extend(dev, &[0], &[seq[i]], LastLocs::FromRows, Some((table, &rows[i..i + 1])), &o)?;
            pages[i].extend(dalloc.pages(&staged)?.iter().map(|&p| p * ps));
        }
        dev.synchronize()?;
        Ok(Batch { rows, seq, pages })
    }

    /// Advance every request by one token (requests at `LIMIT` free their pages and
    /// start over at one token).
    fn advance(&mut self, host: &PagedAllocator) -> Result<()> {
        for (s, pages) in self.seq.iter_mut().zip(&mut self.pages) {
            if *s >= LIMIT {
                free_request(host, pages)?;
                *s = 0;
            }
            *s += 1;
        }
        Ok(())
    }

    /// Record the fresh pages a step took (in request order, one per request whose new
    /// token starts a page).
    fn took(&mut self, ps: u32, fresh: &[u32]) {
        let mut it = fresh.iter();
        for (s, pages) in self.seq.iter().zip(&mut self.pages) {
            if (s - 1) % ps == 0 {
                pages.push(*it.next().expect("one fresh page per page-starting request") * ps);
            }
        }
    }
}

/// Wall microseconds per step over `steps` steps of `op` with one synchronize at the
/// end (after a warm-up), and the host's issue time per step (before that
/// synchronize): the median of five such runs (by wall time).
fn per_step(dev: &KvDevice, steps: usize, mut op: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..200 {
        op()?;
    }
    dev.synchronize()?;
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..steps {
            op()?;
        }
        let issued = t0.elapsed().as_secs_f64();
        dev.synchronize()?;
        let wall = t0.elapsed().as_secs_f64();
        runs.push((wall * 1e6 / steps as f64, issued * 1e6 / steps as f64));
    }
    runs.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    Ok(runs[2])
}

/// What [`delta_graph_run`] measured.
struct DeltaRun {
    wall: f64,
    issue: f64,
    /// Entries staged per step.
    entries: f64,
    /// Share of steps (over 2,000 more) that found their staging buffer still in use:
    /// the host was two steps ahead of the device.
    busy: f64,
}

/// Delta graphs: the batch lives in `DeltaDecode`, which tracks the lengths, so the
/// bench's own bookkeeping is O(changes) too: record each fresh page with its request,
/// and restart (free, length 0) a request the step before it would pass LIMIT; it took
/// its last page `ps` steps earlier, at a step of the same phase.
fn delta_graph_run(
    dev: &KvDevice,
    rng: &mut Rng,
    table: &DeviceReqToToken,
    batch: usize,
    steps: usize,
    ps: u32,
) -> Result<DeltaRun> {
    let host = Arc::new(PagedAllocator::new(1 << 23, ps)?);
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
    let mut b = Batch::new(dev, &mut dalloc, table, rng, batch)?;
    let mut graphs = DeltaDecode::new(dev, Arc::clone(&host), table, batch)?;
    for (&row, &len) in b.rows.iter().zip(&b.seq) {
        graphs.join(row, len)?;
    }
    let mut due: Vec<Vec<u32>> = (0..ps).map(|_| Vec::with_capacity(batch)).collect();
    let mut entries = 0usize;
    let mut counted = 0usize;
    let mut one = |busy: &mut usize, probe: bool| -> Result<()> {
        let phase = (graphs.planner().clock() % ps as u64) as usize;
        for &i in &due[phase] {
            free_request(&host, &mut b.pages[i as usize])?;
            graphs.set_len(i, 0)?;
        }
        due[phase].clear();
        if probe && !graphs.next_staging_free()? {
            *busy += 1;
        }
        let step = graphs.step(dev.stream())?;
        for (&p, &i) in graphs.pages(&step)?.iter().zip(graphs.page_owners(&step)?) {
            b.pages[i as usize].push(p * ps);
            if graphs.len(i)? - 1 + ps >= LIMIT {
                due[phase].push(i);
            }
        }
        entries += step.entries();
        counted += 1;
        Ok(())
    };
    let mut busy = 0;
    let (wall, issue) = per_step(dev, steps, || one(&mut busy, false))?;
    let probes = 2_000;
    for _ in 0..probes {
        one(&mut busy, true)?;
    }
    dev.synchronize()?;
    Ok(DeltaRun { wall, issue, entries: entries as f64 / counted as f64, busy: busy as f64 / probes as f64 })
}

fn decode_graph_row(dev: &KvDevice, out: &mut Out, rng: &mut Rng, batch: usize, steps: usize) -> Result<()> {
    let ps = 16;
    let table = DeviceReqToToken::new(1024, LIMIT + 1)?;
    // Eager.
    let host = Arc::new(PagedAllocator::new(1 << 23, ps)?);
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
    let mut b = Batch::new(dev, &mut dalloc, &table, rng, batch)?;
    let slots = DeviceBuffer::<u32>::zeroed(batch)?;
    let (eager, eager_issue) = per_step(dev, steps, || {
        b.advance(&host)?;
        let staged = dalloc.alloc_decode(dev, &b.seq, LastLocs::FromRows, Some((&table, &b.rows)), &slots)?;
        b.took(ps, dalloc.pages(&staged)?);
        Ok(())
    })?;
    drop(b);
    // Graphs, both stagings (a fresh allocator and requests each: the same work).
    let mut graph = Vec::new();
    for staging in [Staging::Copy, Staging::Mapped] {
        let host = Arc::new(PagedAllocator::new(1 << 23, ps)?);
        let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
        let mut b = Batch::new(dev, &mut dalloc, &table, rng, batch)?;
        let mut graphs = DecodeGraphs::new(dev, Arc::clone(&host), &table, batch, staging)?;
        graph.push(per_step(dev, steps, || {
            b.advance(&host)?;
            let step = graphs.step(dev.stream(), &b.seq, &b.rows)?;
            b.took(ps, graphs.pages(&step)?);
            Ok(())
        })?);
    }
    // The host's share: the same planning, reservation and staging, no device work.
    let host_only = {
        let host = Arc::new(PagedAllocator::new(1 << 23, ps)?);
        let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
        let mut b = Batch::new(dev, &mut dalloc, &table, rng, batch)?;
        let bucket = bucket_for(batch);
        let mut block = vec![0u32; decode_block_bytes(bucket) / 4];
        let limits = RowLimits { rows: table.rows(), max_context_len: table.max_context_len() };
        per_step(dev, steps, || {
            b.advance(&host)?;
            let staged = stage_decode(&host, &b.seq, &b.rows, bucket, limits, bytemuck::cast_slice_mut(&mut block))?;
            let at = decode_records_bytes(bucket) / 4;
            b.took(ps, &block[at..at + staged.new_pages]);
            Ok(())
        })?
        .0
    };
    // Delta graphs: the batch lives in `DeltaDecode`, which tracks the lengths, so the
    // bench's own bookkeeping is O(changes) too: record each fresh page with its
    // request, and restart (free, length 0) a request the step before it would pass
    // LIMIT; it took its last page `ps` steps earlier, at a step of the same phase.
    let run = delta_graph_run(dev, rng, &table, batch, steps, ps)?;
    let (delta, entries) = ((run.wall, run.issue), run.entries);
    // The delta path's host share: the same planning and bookkeeping, no device.
    let delta_host = {
        let host = Arc::new(PagedAllocator::new(1 << 23, ps)?);
        let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1 << 16)?;
        let b = Batch::new(dev, &mut dalloc, &table, rng, batch)?;
        let limits = RowLimits { rows: table.rows(), max_context_len: table.max_context_len() };
        let cap = bucket_for(batch);
        let mut plan = DeltaPlanner::new(ps, limits, cap)?;
        let mut block = vec![0u32; delta_block_words(cap)];
        let (mut fresh, mut owners) = (vec![0u32; cap], vec![0u32; cap]);
        for (&row, &len) in b.rows.iter().zip(&b.seq) {
            plan.join(row, len)?;
        }
        let mut pages = b.pages;
        let mut due: Vec<Vec<u32>> = (0..ps).map(|_| Vec::with_capacity(batch)).collect();
        per_step(dev, steps, || {
            let phase = (plan.clock() % ps as u64) as usize;
            for &i in &due[phase] {
                free_request(&host, &mut pages[i as usize])?;
                plan.set_len(i, 0)?;
            }
            due[phase].clear();
            let staged = plan.stage(&host, &mut block, &mut fresh, &mut owners)?;
            plan.commit();
            let n = staged.new_pages;
            for (&p, &i) in fresh[..n].iter().zip(&owners[..n]) {
                pages[i as usize].push(p * ps);
                if plan.len(i)? - 1 + ps >= LIMIT {
                    due[phase].push(i);
                }
            }
            Ok(())
        })?
        .0
    };
    // The floor: a graph of one copy of the same bytes and one empty kernel; and a
    // graph of the empty kernel alone.
    let floor_graph = FloorGraph::new(dev, decode_records_bytes(bucket_for(batch)))?;
    let floor = per_step(dev, steps, || Ok(floor_graph.launch(dev.stream())?))?;
    let empty_graph = FloorGraph::new(dev, 0)?;
    let empty = per_step(dev, steps, || Ok(empty_graph.launch(dev.stream())?))?;
    let us = |(wall, issue): (f64, f64)| format!("{wall:.2} ({issue:.2})");
    out.line(format!(
        "| {batch} | {} | {host_only:.2} | {} | {} | {} | {} | {} | {:.2}x | {:.2}x | {delta_host:.2} | {} | {:.2}x | {entries:.1} |",
        bucket_for(batch),
        us((eager, eager_issue)),
        us(graph[0]),
        us(graph[1]),
        us(floor),
        us(empty),
        graph[0].0 / floor.0,
        graph[1].0 / floor.0,
        us(delta),
        delta.0 / floor.0,
    ));
    Ok(())
}

/// `set_kv` through kvpool's cache and through a view of separately allocated layers
/// (not evenly spaced) on a second stream: the same kernels, so the same time.
fn view_row(dev: &KvDevice, out: &mut Out, rng: &mut Rng, tokens: usize) -> Result<()> {
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
        dtype: KvDtype::Bf16,
        layer_num: 4,
        size: 1 << 17,
        page_size: 16,
    };
    let row = cfg.row_bytes();
    let owned = DeviceKvCache::new(cfg)?;
    // The engine's memory: K and V in one allocation each (evenly spaced layers), and
    // K and V in one allocation per layer.
    let (lb, layers) = (cfg.layer_bytes(), cfg.layer_num as usize);
    let one_k = DeviceBuffer::<u8>::zeroed(layers * lb)?;
    let one_v = DeviceBuffer::<u8>::zeroed(layers * lb)?;
    let spaced = |b: &DeviceBuffer<u8>| -> Vec<u64> {
        (0..layers).map(|l| b.as_device_ptr().as_raw() + (l * lb) as u64).collect()
    };
    let k_layers: Vec<DeviceBuffer<u8>> =
        (0..layers).map(|_| DeviceBuffer::zeroed(lb)).collect::<std::result::Result<_, _>>()?;
    let v_layers: Vec<DeviceBuffer<u8>> =
        (0..layers).map(|_| DeviceBuffer::zeroed(lb)).collect::<std::result::Result<_, _>>()?;
    let kp: Vec<u64> = k_layers.iter().map(|b| b.as_device_ptr().as_raw()).collect();
    let vp: Vec<u64> = v_layers.iter().map(|b| b.as_device_ptr().as_raw()).collect();
    // SAFETY: the layers are the buffers above, alive until the end of this function
    // (after every launch was synchronized); only this benchmark uses them.
    let view_one = unsafe { KvCacheView::from_raw(cfg, &spaced(&one_k), Some(&spaced(&one_v)), row) }?;
    // SAFETY: as above.
    let view = unsafe { KvCacheView::from_raw(cfg, &kp, Some(&vp), row) }?;
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    let on = dev.on(&stream)?;
    let src = DeviceBuffer::from_slice(&random_bytes(4 * tokens * row, rng))?;
    let slots = DeviceBuffer::from_slice(&shuffled(tokens, cfg.rows(), rng))?;
    let rows = || Rows::new(&src, row, tokens * row);
    let timed = |f: &dyn Fn() -> Result<()>, sync: &dyn Fn() -> Result<()>| -> Result<f64> {
        sync()?;
        let t0 = Instant::now();
        for _ in 0..200 {
            f()?;
        }
        sync()?;
        Ok(t0.elapsed().as_secs_f64() * 1e6 / 200.0)
    };
    let on_sync = || -> Result<()> { Ok(stream.synchronize()?) };
    let dev_sync = || -> Result<()> { Ok(dev.synchronize()?) };
    let owned_us = timed(&|| Ok(owned.set_kv(dev, Layers::All, &slots, rows(), rows(), None, (1.0, 1.0))?), &dev_sync)?;
    let one_us = timed(&|| Ok(view_one.set_kv(on, Layers::All, &slots, rows(), rows(), None, (1.0, 1.0))?), &on_sync)?;
    let sep_us = timed(&|| Ok(view.set_kv(on, Layers::All, &slots, rows(), rows(), None, (1.0, 1.0))?), &on_sync)?;
    view_one.take_error(on)?;
    owned.take_error(dev)?;
    view.take_error(on)?;
    out.line(format!("| {tokens} | {owned_us:.1} | {one_us:.1} | {sep_us:.1} | {:.2}x |", one_us / owned_us));
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let section = args.iter().position(|a| a == "--section").and_then(|i| args.get(i + 1)).cloned();
    let run = |name: &str| section.as_deref().map_or(true, |s| s == name);
    let out_path = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let target: u32 =
        args.iter().position(|a| a == "--target").and_then(|i| args.get(i + 1)).map_or(Ok(u32::MAX), |t| t.parse())?;
    let dev = match KvDevice::count() {
        Ok(n) if n > 0 => KvDevice::with_target(0, target)?,
        other => {
            println!("no CUDA device ({other:?}): nothing to measure");
            return Ok(());
        }
    };
    let t = Timer {
        start: Event::new(EventFlags::DEFAULT)?,
        stop: Event::new(EventFlags::DEFAULT)?,
        samples: if quick { 5 } else { 21 },
    };
    let mut out = Out { text: String::new() };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    out.line(format!(
        "device: {} (compute capability {}), sm_{} PTX, {} kernels loaded",
        dev.name()?,
        dev.compute_capability(),
        dev.ptx_target(),
        dev.kernel_count()
    ));
    if run("scatter") {
        out.line("");
        out.line(
            "### kv_scatter vs device-to-device memcpy of the same bytes (bf16 rows; fp8 rows: bf16 in, e4m3 out)",
        );
        out.line("");
        out.line("| slots | tokens | row bytes | layers | MiB moved | scatter us | scatter GB/s | memcpy us | memcpy GB/s | scatter/memcpy |");
        out.line("|---|---|---|---|---|---|---|---|---|---|");
        let token_counts: &[usize] = if quick { &[1024, 16384] } else { &[1024, 4096, 16384, 65536] };
        for &row in &[1024usize, 2048, 4096] {
            for &tokens in token_counts {
                scatter_row(&dev, &t, &mut out, &mut rng, tokens, row, 1, false, false, quick)?;
            }
        }
        for &tokens in token_counts {
            scatter_row(&dev, &t, &mut out, &mut rng, tokens, 2048, 1, true, false, quick)?;
        }
        for &tokens in &[1024usize, 8192] {
            scatter_row(&dev, &t, &mut out, &mut rng, tokens, 2048, 8, false, false, quick)?;
        }
        for &tokens in token_counts {
            scatter_row(&dev, &t, &mut out, &mut rng, tokens, 2048, 1, false, true, quick)?;
        }
    }
    if run("alloc") {
        out.line("");
        out.line("### alloc kernels vs an empty launch (page size 16, fused row write, last_loc from rows; extend: 64 new tokens per request)");
        out.line("");
        out.line("| requests | empty 1 block us | empty, extend's grid us | alloc_extend us | alloc_decode us | vs empty (ext / dec) | extend call us | decode call us |");
        out.line("|---|---|---|---|---|---|---|---|");
        for &batch in &[1usize, 8, 64, 256, 1024] {
            alloc_rows(&dev, &t, &mut out, &mut rng, batch, quick)?;
        }
    }
    if run("step") {
        out.line("");
        out.line("### decode step: alloc_decode (fused row write) + one layer kv_scatter (8x128 bf16 K and V), synchronized per step");
        out.line("");
        out.line("| requests | device us | wall us (host + device) | pages left |");
        out.line("|---|---|---|---|");
        for &batch in &[1usize, 64, 256, 1024] {
            decode_step(&dev, &mut out, &mut rng, batch, quick)?;
        }
    }
    if run("decode") {
        let steps = if quick { 2_000 } else { 10_000 };
        out.line("");
        out.line(format!(
            "### decode step without host synchronization: alloc_decode + row write, {steps} steps, one synchronize at the end, median of 5 runs (page size 16, last_loc from rows)"
        ));
        out.line("");
        out.line("wall us per step (host issue us per step in brackets)");
        out.line("");
        out.line("| requests | bucket | host share (plan + stage, no device) | eager | graph, copy | graph, mapped | floor: copy + empty kernel | empty-kernel graph | copy graph / floor | mapped graph / floor | delta host share | graph, delta | delta graph / floor | delta entries per step |");
        out.line("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for &batch in &[1usize, 8, 64, 256, 1024] {
            decode_graph_row(&dev, &mut out, &mut rng, batch, steps)?;
        }
    }
    if run("delta") {
        let steps = if quick { 2_000 } else { 10_000 };
        out.line("");
        out.line(format!(
            "### delta decode step: where the time goes ({steps} steps, median of 5 runs; busy = share of 2,000 further steps whose staging was still in use, i.e. the host was two steps ahead of the device)"
        ));
        out.line("");
        let table = DeviceReqToToken::new(1024, LIMIT + 1)?;
        // Host costs of the driver calls a step makes, and of the planner alone.
        let n = 20_000;
        let ev = Event::new(EventFlags::DISABLE_TIMING)?;
        let t0 = Instant::now();
        for _ in 0..n {
            ev.record(dev.stream())?;
        }
        let record_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        dev.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..n {
            ev.synchronize()?;
        }
        let sync_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        let empty = FloorGraph::new(&dev, 0)?;
        let t0 = Instant::now();
        for _ in 0..n {
            empty.launch(dev.stream())?;
        }
        let launch_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        dev.synchronize()?;
        let plan_us = {
            let host = PagedAllocator::new(1 << 23, 16)?;
            let limits = RowLimits { rows: 1024, max_context_len: 1 << 20 };
            let mut plan = DeltaPlanner::new(16, limits, 1024)?;
            let mut block = vec![0u32; delta_block_words(1024)];
            let (mut fresh, mut owners) = (vec![0u32; 1024], vec![0u32; 1024]);
            for r in 0..1024 {
                plan.join(r, 1 + rng.below(1000) as u32)?;
            }
            let mut slots = Vec::with_capacity(64 * 1024);
            let t0 = Instant::now();
            for k in 0..n {
                let staged = plan.stage(&host, &mut block, &mut fresh, &mut owners)?;
                plan.commit();
                slots.extend(fresh[..staged.new_pages].iter().map(|&p| p * 16));
                if k % 1000 == 999 {
                    let mut group = host.free_group();
                    group.free(&slots)?;
                    group.end();
                    slots.clear();
                }
            }
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        };
        // Host access to pinned memory (the staging) against ordinary memory: 256
        // words written, then read back, per round.
        let pinned_vs_heap = {
            let mut pinned = cust::memory::LockedBuffer::new(&0u32, 4096)?;
            let mut heap = vec![0u32; 4096];
            let time = |buf: &mut [u32]| {
                let rounds = 20_000;
                let t0 = Instant::now();
                for r in 0..rounds {
                    let w = &mut buf[(r % 16) * 256..][..256];
                    for (k, x) in w.iter_mut().enumerate() {
                        *x = (r + k) as u32;
                    }
                }
                let write = t0.elapsed().as_secs_f64() * 1e6 / rounds as f64;
                let t0 = Instant::now();
                let mut sum = 0u64;
                for r in 0..rounds {
                    sum += buf[(r % 16) * 256..][..256].iter().map(|&x| x as u64).sum::<u64>();
                }
                std::hint::black_box(sum);
                (write, t0.elapsed().as_secs_f64() * 1e6 / rounds as f64)
            };
            let (pw, pr) = time(&mut pinned[..]);
            let (hw, hr) = time(&mut heap[..]);
            format!("256 words written / read: pinned {pw:.2} / {pr:.2} us, heap {hw:.2} / {hr:.2} us")
        };
        out.line(pinned_vs_heap);
        out.line("");
        out.line(format!(
            "host us per call: cuEventRecord {record_us:.2}, cuEventSynchronize (done) {sync_us:.2}, cuGraphLaunch (empty graph, issue) {launch_us:.2}; DeltaPlanner stage + commit alone, 1,024 requests, page size 16: {plan_us:.2}"
        ));
        out.line("");
        out.line("| requests | page size | wall us (issue) | entries per step | busy |");
        out.line("|---|---|---|---|---|");
        for &batch in &[1usize, 256, 1024] {
            for ps in [16u32, 1024] {
                let r = delta_graph_run(&dev, &mut rng, &table, batch, steps, ps)?;
                out.line(format!(
                    "| {batch} | {ps} | {:.2} ({:.2}) | {:.1} | {:.0}% |",
                    r.wall,
                    r.issue,
                    r.entries,
                    100.0 * r.busy
                ));
            }
        }
    }
    if run("view") {
        out.line("");
        out.line("### set_kv, all 4 layers (8x128 bf16): kvpool's cache vs a view of separate layer buffers on another stream");
        out.line("");
        out.line("us per call, 200 calls back to back, one synchronize");
        out.line("");
        out.line("| tokens | owned (device stream) | view, one allocation (other stream) | view, one allocation per layer (4 launches) | one-allocation view / owned |");
        out.line("|---|---|---|---|---|");
        for &tokens in &[64usize, 1024, 8192] {
            view_row(&dev, &mut out, &mut rng, tokens)?;
        }
    }
    if let Some(p) = out_path {
        std::fs::write(&p, &out.text)?;
    }
    Ok(())
}
