//! Host-only timing of the delta decode step's host work (planner, page reservation,
//! frees, the bench's bookkeeping) at 1,024 requests, page size 16: no GPU.
//!
//! `cargo run --release --example delta_host [requests]`
use std::hint::black_box;
use std::time::Instant;

use kvpool::kv::delta::{delta_block_words, DeltaPlanner};
use kvpool::kv::staging::{bucket_for, RowLimits};
use kvpool::PagedAllocator;

const LIMIT: u32 = 4096;

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn main() {
    let batch: usize = std::env::args().nth(1).map_or(1024, |s| s.parse().unwrap());
    let ps = 16u32;
    let steps = 20_000;
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let host = PagedAllocator::new(1 << 23, ps).unwrap();
    let limits = RowLimits { rows: 1024, max_context_len: LIMIT + 1 };
    let cap = bucket_for(batch);
    let mut plan = DeltaPlanner::new(ps, limits, cap).unwrap();
    let mut block = vec![0u32; delta_block_words(cap)];
    let (mut fresh, mut owners) = (vec![0u32; cap], vec![0u32; cap]);
    let mut pages: Vec<Vec<u32>> = (0..batch).map(|_| Vec::with_capacity((LIMIT / ps + 2) as usize)).collect();
    for (i, p) in pages.iter_mut().enumerate() {
        let len = 1 + rng.below(1000) as u32;
        let n = len.div_ceil(ps) as usize;
        let mut got = vec![0u32; n];
        host.reserve_pages(&mut got).unwrap();
        p.extend(got.iter().map(|&g| g * ps));
        plan.join(i as u32, len).unwrap();
    }
    let mut due: Vec<Vec<u32>> = (0..ps).map(|_| Vec::with_capacity(batch)).collect();
    let (mut t_free, mut t_stage, mut t_book) = (0u64, 0u64, 0u64);
    let mut freed = 0usize;
    let mut runs = Vec::new();
    for run in 0..6 {
        let t0 = Instant::now();
        for _ in 0..steps {
            let a = Instant::now();
            let phase = (plan.clock() % ps as u64) as usize;
            for &i in &due[phase] {
                let p = &mut pages[i as usize];
                freed += p.len();
                let mut g = host.free_group();
                g.free(p).unwrap();
                g.end();
                p.clear();
                plan.set_len(i, 0).unwrap();
            }
            due[phase].clear();
            let b = Instant::now();
            let staged = plan.stage(&host, &mut block, &mut fresh, &mut owners).unwrap();
            plan.commit();
            black_box(&block);
            let c = Instant::now();
            let n = staged.new_pages;
            for (&p, &i) in fresh[..n].iter().zip(&owners[..n]) {
                pages[i as usize].push(p * ps);
                if plan.len(i).unwrap() - 1 + ps >= LIMIT {
                    due[phase].push(i);
                }
            }
            let d = Instant::now();
            if run > 0 {
                t_free += (b - a).as_nanos() as u64;
                t_stage += (c - b).as_nanos() as u64;
                t_book += (d - c).as_nanos() as u64;
            }
        }
        runs.push(t0.elapsed().as_secs_f64() * 1e6 / steps as f64);
    }
    let n = (5 * steps) as f64;
    println!("requests {batch}: us/step per run (with timers) {runs:.2?}");
    println!(
        "free+set_len {:.3} us, stage+commit (incl. reserve) {:.3} us, bookkeeping {:.3} us; pages freed/step {:.1}",
        t_free as f64 / n / 1e3,
        t_stage as f64 / n / 1e3,
        t_book as f64 / n / 1e3,
        freed as f64 / (6 * steps) as f64
    );
    // Reserve alone: 64 pages then free them (group), same allocator state.
    let mut buf = vec![0u32; 64];
    let mut slots = vec![0u32; 64];
    let t = Instant::now();
    for _ in 0..100_000 {
        host.reserve_pages(&mut buf).unwrap();
        for (s, &p) in slots.iter_mut().zip(&buf) {
            *s = p * ps;
        }
        let mut g = host.free_group();
        g.free(&slots).unwrap();
        g.end();
    }
    println!("reserve 64 + free 64 (same pages, warm): {:.3} us", t.elapsed().as_secs_f64() * 1e6 / 1e5);
}
