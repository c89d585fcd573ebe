//! GPU tests of the graph-captured decode steps ([`DecodeGraphs`], [`DeltaDecode`]):
//!
//! * random decode and extend steps — requests joining, finishing and being evicted —
//!   through the graphs, the delta graphs and the eager [`DevicePagedAllocator`], each
//!   against the host reference on its own host [`PagedAllocator`], comparing every
//!   request row and every slot after every step;
//! * the staging guard: with the stream held by a closed gate, the staging buffer of
//!   the step before last is reported busy, a third step waits for the gate, and all
//!   three steps' results are right (for the delta graphs, with the middle step on
//!   another stream, which must wait for the first on the device);
//! * no heap allocation in a step (a counting global allocator);
//! * the views' constructors refuse what they can check.
//!
//! Without a CUDA device each test prints "no CUDA device" and returns
//! (`KVPOOL_REQUIRE_GPU=1` makes that a failure).
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cust::memory::{CopyDestination, DeviceBuffer, DeviceSlice};
use kvpool::cuda::{
    CudaKvError, DecodeGraphs, DeltaDecode, DevicePagedAllocator, DeviceReqToToken, KvCacheView, KvDevice, LastLocs,
    ReqToTokenView, Staging,
};
use kvpool::kv::reference::{decode_with_rows, extend_with_rows, RowTable};
use kvpool::kv::{KvConfig, KvDtype, KvError, KvLayout};
use kvpool::{KvAllocator, PagedAllocator};

mod alloc_common;

use alloc_common::allocations;

mod kernel_common;

use kernel_common::{device, Rng};

fn to_host(d: &DeviceSlice<u32>) -> Vec<u32> {
    let mut v = vec![0u32; d.len()];
    d.copy_to(&mut v[..]).unwrap();
    v
}

fn read_table(dev: &KvDevice, t: &ReqToTokenView) -> Vec<u32> {
    let s = t.max_context_len() as usize;
    let mut got = vec![0u32; t.rows() as usize * s];
    for r in 0..t.rows() {
        t.read(dev, r, 0..s, &mut got[r as usize * s..][..s]).unwrap();
    }
    got
}

/// One path under test: a host allocator, its device table and host mirror, the
/// eager expander (extends on both paths, decodes on the eager one) and its slots.
struct Path {
    host: Arc<PagedAllocator>,
    table: DeviceReqToToken,
    mirror: Vec<u32>,
    eager: DevicePagedAllocator,
    out: DeviceBuffer<u32>,
}

impl Path {
    fn new(size: usize, ps: u32, rows: u32, stride: u32) -> Path {
        let host = Arc::new(PagedAllocator::new(size, ps).unwrap());
        Path {
            // At page size 1 it remembers where each row's run ends (its extends and
            // decodes write every row), for decodes with `LastLocs::FromRows`.
            eager: DevicePagedAllocator::new(Arc::clone(&host), 64, 4096).unwrap().remember_rows(rows),
            host,
            table: DeviceReqToToken::new(rows, stride).unwrap(),
            mirror: vec![0u32; (rows * stride) as usize],
            out: DeviceBuffer::zeroed(64 * 512).unwrap(),
        }
    }

    /// Extend `row` from `prefix` to `seq` tokens (last_loc from the row), on the
    /// device and in the mirror; returns the new slots.
    fn extend(&mut self, dev: &KvDevice, row: u32, prefix: u32, seq: u32) -> Result<Vec<u32>, CudaKvError> {
        let n = (seq - prefix) as usize;
        let out = self.out.index(..n);
        let staged = self.eager.alloc_extend(
            dev,
            &[prefix],
            &[seq],
            LastLocs::FromRows,
            Some((self.table.view(), &[row])),
            &out,
        )?;
        let pages = self.eager.pages(&staged).unwrap().to_vec();
        let mut want = vec![0u32; n];
        let stride = self.table.max_context_len() as usize;
        let rt = RowTable { cells: &mut self.mirror, stride, rows: &[row] };
        extend_with_rows(self.host.page_size(), &[prefix], &[seq], None, &pages, &mut want, Some(rt)).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(to_host(&out), want, "extend row {row} {prefix}..{seq}");
        Ok(want)
    }

    /// Free a request's slots (its pages are its own: every request starts on a page).
    fn finish(&self, row: u32, seq: u32) {
        let s = self.table.max_context_len() as usize;
        let slots = &self.mirror[row as usize * s..][..seq as usize];
        self.host.free(slots).unwrap();
    }
}

#[derive(Clone, Copy, Debug)]
struct Request {
    row: u32,
    seq: u32,
}

/// The random walk for one page size: `steps` decode or extend steps.
fn random_walk(dev: &KvDevice, ps: u32, steps: usize, seed: u64, staging: Staging) {
    let mut rng = Rng::new(seed);
    let (n_rows, stride, size) = (48u32, 512u32, 1 << 15);
    let mut g = Path::new(size, ps, n_rows, stride);
    let mut e = Path::new(size, ps, n_rows, stride);
    let mut d = Path::new(size, ps, n_rows, stride);
    let whole = g.host.available_size();
    // A second view of the graph paths' tables, so that `g` and `d` stay usable for
    // extends.
    // SAFETY: `g.table` and `d.table` are alive, in this context, until after
    // `graphs` and `delta` (declared later) are dropped; their cells are written only
    // by work on the device's stream.
    let g_table = unsafe { ReqToTokenView::from_raw(g.table.device_address(), n_rows, stride) }.unwrap();
    let d_table = unsafe { ReqToTokenView::from_raw(d.table.device_address(), n_rows, stride) }.unwrap();
    let mut graphs = DecodeGraphs::new(dev, Arc::clone(&g.host), &g_table, 64, staging).unwrap();
    let mut delta = DeltaDecode::new(dev, Arc::clone(&d.host), &d_table, 64).unwrap();
    let (mut d_same, mut d_entries, mut d_moves) = (true, 0usize, 0usize);
    let mut live: Vec<Request> = Vec::new();
    let mut evicted: Vec<Request> = Vec::new();
    let mut free_rows: Vec<u32> = (0..n_rows).rev().collect();
    let (mut decodes, mut extends, mut finished, mut evictions, mut same_pages) = (0, 0, 0, 0, true);
    let mut padded = 0;
    let (mut continued, mut placed) = (0usize, 0usize);
    let mut g_slots = vec![0u32; 64];
    while decodes + extends < steps {
        let dice = rng.below(100);
        if dice < 25 && !free_rows.is_empty() {
            // Join: a new request (or an evicted one again) prefills from scratch.
            let seq = match evicted.pop() {
                Some(r) => r.seq,
                None => 1 + rng.below(200) as u32,
            };
            let row = free_rows.pop().unwrap();
            let a = g.extend(dev, row, 0, seq);
            let b = e.extend(dev, row, 0, seq);
            let c = d.extend(dev, row, 0, seq);
            match (a, b, c) {
                (Ok(a), Ok(b), Ok(c)) => {
                    same_pages &= a == b;
                    d_same &= c == b;
                    let index = delta.join(row, seq).unwrap();
                    assert_eq!(index as usize, live.len());
                    // Where the prefill ended: at page size 1 the next slot goes on from there.
                    graphs.set_last_slot(row, *a.last().unwrap()).unwrap();
                    delta.set_last_slot(index, *c.last().unwrap()).unwrap();
                    live.push(Request { row, seq });
                    extends += 1;
                }
                (a, b, c) => panic!("extend failed: {a:?} {b:?} {c:?}"),
            }
        } else if dice < 35 && !live.is_empty() {
            // Chunked prefill continues: extend a live request from inside its page.
            let i = rng.below(live.len() as u64) as usize;
            let r = live[i];
            let seq = (r.seq + 1 + rng.below(40) as u32).min(stride - 1);
            if seq > r.seq {
                let a = g.extend(dev, r.row, r.seq, seq).unwrap();
                let b = e.extend(dev, r.row, r.seq, seq).unwrap();
                let c = d.extend(dev, r.row, r.seq, seq).unwrap();
                same_pages &= a == b;
                d_same &= c == b;
                delta.set_len(i as u32, seq).unwrap();
                graphs.set_last_slot(r.row, *a.last().unwrap()).unwrap();
                delta.set_last_slot(i as u32, *c.last().unwrap()).unwrap();
                live[i].seq = seq;
                extends += 1;
            }
        } else if dice < 45 && !live.is_empty() {
            // Finish (or, one time in three, evict to rejoin later).
            let i = rng.below(live.len() as u64) as usize;
            let r = live.swap_remove(i);
            g.finish(r.row, r.seq);
            e.finish(r.row, r.seq);
            d.finish(r.row, r.seq);
            free_rows.push(r.row);
            let moved = delta.leave(i as u32).unwrap();
            assert_eq!(moved, (i < live.len()).then_some(live.len() as u32));
            d_moves += moved.is_some() as usize;
            if rng.below(3) == 0 {
                evicted.push(r);
                evictions += 1;
            } else {
                finished += 1;
            }
        } else if !live.is_empty() {
            // Decode: every live request gets one token (requests at the end of
            // their row finish first; `swap_remove` order, as the delta batch's).
            let mut i = 0;
            while i < live.len() {
                let r = live[i];
                if r.seq + 1 >= stride {
                    g.finish(r.row, r.seq);
                    e.finish(r.row, r.seq);
                    d.finish(r.row, r.seq);
                    free_rows.push(r.row);
                    live.swap_remove(i);
                    delta.leave(i as u32).unwrap();
                } else {
                    i += 1;
                }
            }
            if live.is_empty() {
                continue;
            }
            let seq: Vec<u32> = live.iter().map(|r| r.seq + 1).collect();
            let rows: Vec<u32> = live.iter().map(|r| r.row).collect();
            let batch = seq.len();
            // Graph path.
            let step = graphs.step(dev.stream(), &seq, &rows).unwrap();
            let g_pages = graphs.pages(&step).unwrap().to_vec();
            let mut want = vec![0u32; batch];
            let rt = RowTable { cells: &mut g.mirror, stride: stride as usize, rows: &rows };
            decode_with_rows(ps, &seq, None, &g_pages, &mut want, Some(rt)).unwrap();
            dev.synchronize().unwrap();
            let slots = graphs.slots(&step);
            assert_eq!(slots.len(), step.bucket());
            g_slots.resize(step.bucket(), 0);
            slots.copy_to(&mut g_slots[..]).unwrap();
            assert_eq!(&g_slots[..batch], &want[..], "graph slots, step {decodes}");
            assert!(g_slots[batch..].iter().all(|&s| s == 0), "padding entries get the dummy slot 0");
            padded += step.bucket() - batch;
            // Eager path. At page size 1, every other step with the last slots from the
            // host, the others from the rows, where the allocator remembers them (the
            // graphs and the delta path know them too, so all three continue the same
            // runs).
            let out = e.out.index(..batch);
            let lasts: Vec<u32> = live.iter().map(|r| e.mirror[(r.row * stride + r.seq - 1) as usize]).collect();
            let last_locs = if ps == 1 && decodes % 2 == 0 { LastLocs::Host(&lasts) } else { LastLocs::FromRows };
            let staged = e.eager.alloc_decode(dev, &seq, last_locs, Some((e.table.view(), &rows)), &out).unwrap();
            let e_pages = e.eager.pages(&staged).unwrap().to_vec();
            let mut e_want = vec![0u32; batch];
            let rt = RowTable { cells: &mut e.mirror, stride: stride as usize, rows: &rows };
            decode_with_rows(ps, &seq, None, &e_pages, &mut e_want, Some(rt)).unwrap();
            dev.synchronize().unwrap();
            assert_eq!(to_host(&out), e_want, "eager slots, step {decodes}");
            same_pages &= g_pages == e_pages;
            if ps == 1 {
                for (&l, &p) in lasts.iter().zip(&e_pages) {
                    continued += (p == l + 1) as usize;
                }
                placed += batch;
            }
            if same_pages {
                assert_eq!(g_slots[..batch], e_want[..], "graph and eager disagree on the same pages");
            }
            // Delta path: the batch order is `live`'s.
            let step = delta.step(dev.stream()).unwrap();
            assert_eq!((step.batch(), step.bucket()), (batch, g_slots.len()));
            let d_pages = delta.pages(&step).unwrap().to_vec();
            let starters: Vec<u32> = (0..batch as u32).filter(|&i| (seq[i as usize] - 1) % ps == 0).collect();
            assert_eq!(delta.page_owners(&step).unwrap(), &starters[..]);
            let mut d_want = vec![0u32; batch];
            let rt = RowTable { cells: &mut d.mirror, stride: stride as usize, rows: &rows };
            decode_with_rows(ps, &seq, None, &d_pages, &mut d_want, Some(rt)).unwrap();
            dev.synchronize().unwrap();
            let mut d_slots = vec![u32::MAX; step.bucket()];
            delta.slots(&step).copy_to(&mut d_slots[..]).unwrap();
            assert_eq!(&d_slots[..batch], &d_want[..], "delta slots, step {decodes}");
            assert!(d_slots[batch..].iter().all(|&s| s == 0), "delta padding entries get the dummy slot 0");
            d_same &= d_pages == e_pages;
            if d_same {
                assert_eq!(d_slots[..batch], e_want[..], "delta and eager disagree on the same pages");
            }
            d_entries += step.entries();
            for (i, &s) in seq.iter().enumerate() {
                assert_eq!(delta.len(i as u32).unwrap(), s);
            }
            for r in live.iter_mut() {
                r.seq += 1;
            }
            decodes += 1;
        } else {
            continue;
        }
        // After every step: both device tables equal their mirrors, every live slot
        // is allocated in its host allocator.
        assert!(read_table(dev, g.table.view()) == g.mirror, "graph path rows differ after step {}", decodes + extends);
        assert!(read_table(dev, e.table.view()) == e.mirror, "eager path rows differ after step {}", decodes + extends);
        assert!(read_table(dev, d.table.view()) == d.mirror, "delta path rows differ after step {}", decodes + extends);
        assert_eq!(delta.batch(), live.len());
        for r in &live {
            let at = r.row as usize * stride as usize;
            assert!(g.mirror[at..at + r.seq as usize].iter().all(|&s| g.host.is_allocated(s)));
        }
    }
    // Everything freed: both allocators are whole again.
    for r in live.drain(..) {
        g.finish(r.row, r.seq);
        e.finish(r.row, r.seq);
        d.finish(r.row, r.seq);
    }
    assert_eq!(g.host.available_size(), whole);
    assert_eq!(e.host.available_size(), whole);
    assert_eq!(d.host.available_size(), whole);
    assert!(d_moves > 0);
    // The three paths take the same pages from the same pool states, every step: at
    // page size 1 because each knows where every request's run ends.
    assert!(same_pages && d_same, "graph {same_pages}, delta {d_same}");
    assert!(ps != 1 || continued * 2 > placed, "{continued} of {placed} slots continued a run");
    println!(
        "{staging:?} staging, page size {ps}: {decodes} decode and {extends} extend steps, {finished} finished, {evictions} evicted, \
         {padded} padding entries; graph and eager took the same pages: {same_pages}; delta: {d_entries} entries, \
         {d_moves} moves, same pages as eager: {d_same}; {continued} of {placed} page-1 slots continued a run"
    );
}

#[test]
fn graph_decode_matches_eager_and_the_host_reference() {
    let Some(dev) = device() else { return };
    for staging in [Staging::Copy, Staging::Mapped] {
        random_walk(&dev, 16, 1200, 1, staging);
        random_walk(&dev, 1, 300, 2, staging);
        random_walk(&dev, 5, 300, 3, staging);
    }
}

extern "C" fn wait_for_gate(user: *mut core::ffi::c_void) {
    // SAFETY: `user` is the address of the test's `AtomicBool`, which outlives the
    // stream work (the test synchronizes before it returns).
    let gate = unsafe { &*(user as *const AtomicBool) };
    while !gate.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
}

#[test]
fn staging_is_not_overwritten_while_the_device_may_read_it() {
    let Some(dev) = device() else { return };
    staging_guard(&dev, Staging::Copy);
    staging_guard(&dev, Staging::Mapped);
}

fn staging_guard(dev: &KvDevice, staging: Staging) {
    let ps = 4;
    let host = Arc::new(PagedAllocator::new(4096, ps).unwrap());
    let table = DeviceReqToToken::new(8, 64).unwrap();
    let mut eager = DevicePagedAllocator::new(Arc::clone(&host), 8, 64).unwrap();
    let rows = [1u32, 4, 6];
    let mut seq = [3u32, 4, 9];
    let mut mirror = vec![0u32; 8 * 64];
    let out = DeviceBuffer::<u32>::zeroed(16).unwrap();
    for (&r, &s) in rows.iter().zip(&seq) {
        let o = out.index(..s as usize);
        let staged = eager.alloc_extend(dev, &[0], &[s], LastLocs::FromRows, Some((table.view(), &[r])), &o).unwrap();
        let pages = eager.pages(&staged).unwrap().to_vec();
        let mut want = vec![0u32; s as usize];
        let rt = RowTable { cells: &mut mirror, stride: 64, rows: &[r] };
        extend_with_rows(ps, &[0], &[s], None, &pages, &mut want, Some(rt)).unwrap();
    }
    let mut graphs = DecodeGraphs::new(dev, Arc::clone(&host), table.view(), 4, staging).unwrap();
    dev.synchronize().unwrap();
    assert!(graphs.next_staging_free().unwrap());

    // Hold the stream: nothing queued after the gate runs until it opens.
    let gate = Arc::new(AtomicBool::new(false));
    // SAFETY: a host function on the device's stream with the gate's address, which
    // lives until after the final synchronize below.
    let r = unsafe {
        cust::sys::cuLaunchHostFunc(dev.stream().as_inner(), Some(wait_for_gate), Arc::as_ptr(&gate) as *mut _)
    };
    assert_eq!(r, cust::sys::cudaError_enum::CUDA_SUCCESS);
    let mut pages = Vec::new();
    let mut steps = Vec::new();
    for _ in 0..2 {
        seq.iter_mut().for_each(|s| *s += 1);
        let step = graphs.step(dev.stream(), &seq, &rows).unwrap();
        pages.push(graphs.pages(&step).unwrap().to_vec());
        steps.push((step, seq));
    }
    // Step 1's buffer is what step 3 would write: the device has not read it yet.
    assert!(!graphs.next_staging_free().unwrap(), "the staging of a step still queued is reported free");
    let opener = {
        let gate = Arc::clone(&gate);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            gate.store(true, Ordering::Release);
        })
    };
    seq.iter_mut().for_each(|s| *s += 1);
    let step3 = graphs.step(dev.stream(), &seq, &rows).unwrap();
    // Step 3 could only stage after the gate opened (it waits for step 1's graph).
    assert!(gate.load(Ordering::Acquire), "step 3 overwrote the staging before step 1 had run");
    pages.push(graphs.pages(&step3).unwrap().to_vec());
    steps.push((step3, seq));
    opener.join().unwrap();
    dev.synchronize().unwrap();
    assert!(matches!(graphs.pages(&steps[0].0), Err(CudaKvError::StaleBatch)));
    // All three steps wrote what the host reference says, in order.
    for ((_, s), p) in steps.iter().zip(&pages) {
        let mut want = [0u32; 3];
        let rt = RowTable { cells: &mut mirror, stride: 64, rows: &rows };
        decode_with_rows(ps, s, None, p, &mut want, Some(rt)).unwrap();
    }
    assert!(read_table(dev, table.view()) == mirror, "rows differ from the reference");
}

#[test]
fn delta_staging_is_not_overwritten_and_steps_stay_ordered_across_streams() {
    let Some(dev) = device() else { return };
    let ps = 4;
    let host = Arc::new(PagedAllocator::new(4096, ps).unwrap());
    let table = DeviceReqToToken::new(8, 64).unwrap();
    let mut eager = DevicePagedAllocator::new(Arc::clone(&host), 8, 64).unwrap();
    let rows = [1u32, 4, 6];
    let mut seq = [3u32, 4, 9];
    let mut mirror = vec![0u32; 8 * 64];
    let out = DeviceBuffer::<u32>::zeroed(16).unwrap();
    let mut delta = DeltaDecode::new(&dev, Arc::clone(&host), table.view(), 4).unwrap();
    for (&r, &s) in rows.iter().zip(&seq) {
        let o = out.index(..s as usize);
        let staged = eager.alloc_extend(&dev, &[0], &[s], LastLocs::FromRows, Some((table.view(), &[r])), &o).unwrap();
        let pages = eager.pages(&staged).unwrap().to_vec();
        let mut want = vec![0u32; s as usize];
        let rt = RowTable { cells: &mut mirror, stride: 64, rows: &[r] };
        extend_with_rows(ps, &[0], &[s], None, &pages, &mut want, Some(rt)).unwrap();
        delta.join(r, s).unwrap();
    }
    dev.synchronize().unwrap();
    assert!(delta.next_staging_free().unwrap());
    let other = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None).unwrap();

    // Hold the device's stream: nothing queued after the gate runs until it opens.
    let gate = Arc::new(AtomicBool::new(false));
    // SAFETY: a host function on the device's stream with the gate's address, which
    // lives until after the final synchronize below.
    let r = unsafe {
        cust::sys::cuLaunchHostFunc(dev.stream().as_inner(), Some(wait_for_gate), Arc::as_ptr(&gate) as *mut _)
    };
    assert_eq!(r, cust::sys::cudaError_enum::CUDA_SUCCESS);
    let mut pages = Vec::new();
    let mut steps = Vec::new();
    // Step 1 on the held stream; step 2 on another stream, free to run at once: it
    // must wait on the device for step 1 (the state is carried from step to step).
    for s in [dev.stream(), &other] {
        seq.iter_mut().for_each(|s| *s += 1);
        let step = delta.step(s).unwrap();
        pages.push(delta.pages(&step).unwrap().to_vec());
        steps.push((step, seq));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!delta.next_staging_free().unwrap(), "the staging of a step still queued is reported free");
    let opener = {
        let gate = Arc::clone(&gate);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            gate.store(true, Ordering::Release);
        })
    };
    seq.iter_mut().for_each(|s| *s += 1);
    let step3 = delta.step(dev.stream()).unwrap();
    assert!(gate.load(Ordering::Acquire), "step 3 overwrote the staging before step 1 had run");
    pages.push(delta.pages(&step3).unwrap().to_vec());
    steps.push((step3, seq));
    opener.join().unwrap();
    dev.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(matches!(delta.pages(&steps[0].0), Err(CudaKvError::StaleBatch)));
    assert!(matches!(delta.page_owners(&steps[0].0), Err(CudaKvError::StaleBatch)));
    let mut want = [0u32; 3];
    for ((_, s), p) in steps.iter().zip(&pages) {
        let rt = RowTable { cells: &mut mirror, stride: 64, rows: &rows };
        decode_with_rows(ps, s, None, p, &mut want, Some(rt)).unwrap();
    }
    let mut got = [0u32; 4];
    delta.slots(&steps[2].0).copy_to(&mut got[..]).unwrap();
    assert_eq!((&got[..3], got[3]), (&want[..], 0), "step 3's slots");
    assert!(read_table(&dev, table.view()) == mirror, "rows differ from the reference");
    // The device state holds each request's length and last slot.
    let state = delta.read_state().unwrap();
    for (i, (&r, &s)) in rows.iter().zip(&seq).enumerate() {
        assert_eq!((state[i].row, state[i].len, state[i].last), (r, s, want[i]));
    }
    assert_eq!(state[3].row, u32::MAX);
    // Refusals: a full batch, a row past the table, a request past its row.
    delta.join(0, 1).unwrap();
    assert!(matches!(delta.join(2, 1), Err(CudaKvError::Kv(KvError::Shape { .. }))));
    delta.leave(3).unwrap();
    assert!(matches!(delta.join(8, 1), Err(CudaKvError::Kv(KvError::SlotOutOfRange { .. }))));
    assert!(matches!(delta.set_len(0, 65), Err(CudaKvError::Kv(KvError::Shape { .. }))));
    delta.set_len(0, 64).unwrap();
    let before = host.available_pages();
    assert!(matches!(delta.step(dev.stream()), Err(CudaKvError::Kv(KvError::Shape { .. }))));
    assert_eq!(host.available_pages(), before);
}

#[test]
fn a_decode_step_does_not_allocate() {
    let Some(dev) = device() else { return };
    let host = Arc::new(PagedAllocator::new(1 << 20, 16).unwrap());
    let table = DeviceReqToToken::new(1024, 2048).unwrap();
    let mut graphs = DecodeGraphs::new(&dev, Arc::clone(&host), table.view(), 1024, Staging::Mapped).unwrap();
    let mut eager = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1024).unwrap();
    let out = DeviceBuffer::<u32>::zeroed(1024).unwrap();
    let rows: Vec<u32> = (0..1000).collect();
    let mut seq = vec![0u32; 1000];
    let d_host = Arc::new(PagedAllocator::new(1 << 20, 16).unwrap());
    let d_table = DeviceReqToToken::new(1024, 2048).unwrap();
    let mut delta = DeltaDecode::new(&dev, Arc::clone(&d_host), d_table.view(), 1024).unwrap();
    let (n, ()) = allocations(|| {
        // Delta steps: 1,000 requests join, 200 steps with requests leaving, joining
        // and being extended (their rows are not filled: slot values do not matter
        // here), then the batch shrinks to 7 and 1.
        for r in 0..1000 {
            delta.join(r, r % 40).unwrap();
        }
        for k in 0..200u32 {
            if k % 10 == 3 {
                let i = (k * 37) % delta.batch() as u32;
                let row = delta.row(i).unwrap();
                delta.leave(i).unwrap();
                delta.join(row, 5).unwrap();
                delta.set_len(k % 100, delta.len(k % 100).unwrap() + 3).unwrap();
            }
            let step = delta.step(dev.stream()).unwrap();
            std::hint::black_box(delta.pages(&step).unwrap());
        }
        while delta.batch() > 7 {
            delta.leave(0).unwrap();
        }
        delta.step(dev.stream()).unwrap();
        while delta.batch() > 1 {
            delta.leave(0).unwrap();
        }
        delta.step(dev.stream()).unwrap();
        for _ in 0..200 {
            seq.iter_mut().for_each(|s| *s += 1);
            graphs.step(dev.stream(), &seq, &rows).unwrap();
        }
        for b in [1usize, 7, 64, 1000] {
            seq.iter_mut().for_each(|s| *s += 1);
            graphs.step(dev.stream(), &seq[..b], &rows[..b]).unwrap();
            seq[b..].iter_mut().for_each(|s| *s -= 1);
        }
        for _ in 0..20 {
            seq.iter_mut().for_each(|s| *s += 1);
            let o = out.index(..1000);
            eager.alloc_decode(&dev, &seq, LastLocs::FromRows, Some((table.view(), &rows)), &o).unwrap();
        }
    });
    assert_eq!(n, 0, "decode steps made {n} heap allocation(s)");
    dev.synchronize().unwrap();
    // The counter works.
    let (n, v) = allocations(|| Vec::<u32>::with_capacity(4));
    assert_eq!((n, v.capacity() >= 4), (1, true));
}

#[test]
fn views_refuse_what_they_can_check() {
    let Some(dev) = device() else { return };
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 2, head_dim: 64 },
        dtype: KvDtype::F16,
        layer_num: 2,
        size: 64,
        page_size: 16,
    };
    let lb = cfg.layer_bytes();
    let k = DeviceBuffer::<u8>::zeroed(2 * lb).unwrap();
    let v = DeviceBuffer::<u8>::zeroed(2 * lb).unwrap();
    let (kb, vb) = (k.as_device_ptr().as_raw(), v.as_device_ptr().as_raw());
    let ok = [kb, kb + lb as u64];
    let vl = [vb, vb + lb as u64];
    let row = cfg.row_bytes();
    // SAFETY (every call below): the addresses are the two buffers above, alive for
    // the whole test; the calls that succeed describe exactly them.
    unsafe {
        assert!(KvCacheView::from_raw(cfg, &ok, Some(&vl), row).is_ok());
        assert!(matches!(
            KvCacheView::from_raw(cfg, &ok, Some(&vl), row + 2),
            Err(CudaKvError::Kv(KvError::BadRow { .. }))
        ));
        assert!(matches!(
            KvCacheView::from_raw(cfg, &ok[..1], Some(&vl), row),
            Err(CudaKvError::Kv(KvError::Shape { .. }))
        ));
        assert!(matches!(KvCacheView::from_raw(cfg, &ok, None, row), Err(CudaKvError::Kv(KvError::Format { .. }))));
        let odd = [kb + 1, kb + lb as u64];
        assert!(matches!(
            KvCacheView::from_raw(cfg, &odd, Some(&vl), row),
            Err(CudaKvError::Kv(KvError::Format { .. }))
        ));
        // A layer running past the end of an allocation (2 MiB: a size the driver does
        // not round).
        let two_mib = DeviceBuffer::<u8>::zeroed(2 << 20).unwrap();
        let tb = two_mib.as_device_ptr().as_raw();
        let past = [kb, tb + (2 << 20) - lb as u64 / 2];
        assert!(matches!(
            KvCacheView::from_raw(cfg, &past, Some(&vl), row),
            Err(CudaKvError::Kv(KvError::Shape { .. }))
        ));
        let fits = [kb, tb + (2 << 20) - lb as u64];
        assert!(KvCacheView::from_raw(cfg, &fits, Some(&vl), row).is_ok());
        let host_mem = vec![0u8; lb];
        let host_addr = [host_mem.as_ptr() as u64, kb];
        assert!(matches!(
            KvCacheView::from_raw(cfg, &host_addr, Some(&vl), row),
            Err(CudaKvError::NotDeviceMemory { .. })
        ));
        assert!(matches!(ReqToTokenView::from_raw(kb, 0, 8), Err(CudaKvError::Config(_))));
        assert!(matches!(ReqToTokenView::from_raw(kb + 2, 4, 8), Err(CudaKvError::Kv(_))));
        let cells = (2 << 20) / 4;
        assert!(ReqToTokenView::from_raw(tb, 1, cells).is_ok());
        assert!(matches!(ReqToTokenView::from_raw(tb, 1, cells + 1), Err(CudaKvError::Kv(KvError::Shape { .. }))));
    }
    // The device's own stream and a second cust stream of the same context are accepted.
    let other = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None).unwrap();
    assert!(dev.on(&other).is_ok());
    assert!(dev.on(dev.stream()).is_ok());
}
