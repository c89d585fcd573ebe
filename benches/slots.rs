//! `SlotPool` against the free lists other engines use, side by side in one run.
//!
//! * `slotpool` — kvpool's lock-free bitmap arena with per-thread magazines (validates
//!   every free: range and double-free checks, all-or-nothing).
//! * `slotpool_bitmap` — the same without magazines (`SlotPool::without_magazines`):
//!   every batch claims from and frees to the bitmap, lowest-first.
//! * `mutex_vec` — a `Mutex<Vec<u32>>` free list, the way TGI and mistral.rs keep
//!   theirs, written the strong way: alloc copies the tail slice into the caller's
//!   buffer and truncates, free extends from the slice (two memcpys and one lock each;
//!   no checks).
//! * `array_queue` — a crossbeam `ArrayQueue<u32>` of free indices, one pop per index
//!   on alloc (pushed back if the queue runs dry) and one push per index on free.
//!
//! Groups:
//!
//! * `single/<batch>` — one thread allocates `batch` indices and frees them again.
//!   Throughput is in slots (elements) per second; ns per slot = 1e9 / throughput.
//! * `contended/<threads>t_b<batch>` — `threads` std threads released together by a
//!   barrier; each repeatedly allocates `batch` indices and frees them. One criterion
//!   iteration is one alloc+free round on every thread, so the throughput is the
//!   aggregate slots per second over all threads.
//!
//! Run: `cargo bench --bench slots` (filter with e.g. `-- contended`).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use kvpool::SlotPool;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

/// Slots in every pool: a KV pool of 64Ki tokens (or pages).
const CAPACITY: u32 = 1 << 16;

/// The operations the benchmarks drive. `alloc` is all-or-nothing and says whether it
/// succeeded; the pools are sized so that it always does.
trait FreeList: Sync {
    const NAME: &'static str;
    fn new(capacity: u32) -> Self;
    fn alloc(&self, out: &mut [u32]) -> bool;
    fn free(&self, indices: &[u32]);
}

impl FreeList for SlotPool {
    const NAME: &'static str = "slotpool";
    fn new(capacity: u32) -> Self {
        SlotPool::new(capacity)
    }
    #[inline]
    fn alloc(&self, out: &mut [u32]) -> bool {
        SlotPool::alloc(self, out).is_ok()
    }
    #[inline]
    fn free(&self, indices: &[u32]) {
        SlotPool::free(self, indices).expect("benchmark frees only what it allocated");
    }
}

/// `SlotPool` without magazines: the bitmap path alone (lowest-first).
struct Bitmap(SlotPool);

impl FreeList for Bitmap {
    const NAME: &'static str = "slotpool_bitmap";
    fn new(capacity: u32) -> Self {
        Bitmap(SlotPool::without_magazines(capacity))
    }
    #[inline]
    fn alloc(&self, out: &mut [u32]) -> bool {
        self.0.alloc(out).is_ok()
    }
    #[inline]
    fn free(&self, indices: &[u32]) {
        self.0.free(indices).expect("benchmark frees only what it allocated");
    }
}

/// The `Mutex<Vec<u32>>` free list. Its capacity is reserved up front, so `free`
/// never reallocates.
struct MutexVec(Mutex<Vec<u32>>);

impl FreeList for MutexVec {
    const NAME: &'static str = "mutex_vec";
    fn new(capacity: u32) -> Self {
        // Descending, so the tail (what alloc takes) holds the lowest indices.
        MutexVec(Mutex::new((1..=capacity).rev().collect()))
    }
    #[inline]
    fn alloc(&self, out: &mut [u32]) -> bool {
        let mut free = self.0.lock().unwrap();
        let Some(rest) = free.len().checked_sub(out.len()) else {
            return false;
        };
        out.copy_from_slice(&free[rest..]);
        free.truncate(rest);
        true
    }
    #[inline]
    fn free(&self, indices: &[u32]) {
        self.0.lock().unwrap().extend_from_slice(indices);
    }
}

/// A crossbeam `ArrayQueue` of free indices.
struct Queue(ArrayQueue<u32>);

impl FreeList for Queue {
    const NAME: &'static str = "array_queue";
    fn new(capacity: u32) -> Self {
        let q = ArrayQueue::new(capacity as usize);
        for i in 1..=capacity {
            q.push(i).unwrap();
        }
        Queue(q)
    }
    #[inline]
    fn alloc(&self, out: &mut [u32]) -> bool {
        for k in 0..out.len() {
            match self.0.pop() {
                Some(i) => out[k] = i,
                None => {
                    // All or nothing: give back what was taken.
                    for &i in &out[..k] {
                        let _ = self.0.push(i);
                    }
                    return false;
                }
            }
        }
        true
    }
    #[inline]
    fn free(&self, indices: &[u32]) {
        for &i in indices {
            self.0.push(i).expect("queue holds every index");
        }
    }
}

fn single_one<P: FreeList>(c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, batch: usize) {
    let pool = P::new(CAPACITY);
    let mut buf = vec![0u32; batch];
    c.bench_function(BenchmarkId::from_parameter(P::NAME), |b| {
        b.iter(|| {
            assert!(pool.alloc(black_box(&mut buf)));
            pool.free(black_box(&buf));
        })
    });
}

fn single(c: &mut Criterion) {
    for batch in [1usize, 16, 256, 4096] {
        let mut g = c.benchmark_group(format!("single/{batch}"));
        g.throughput(Throughput::Elements(batch as u64));
        single_one::<SlotPool>(&mut g, batch);
        single_one::<Bitmap>(&mut g, batch);
        single_one::<MutexVec>(&mut g, batch);
        single_one::<Queue>(&mut g, batch);
        g.finish();
    }
}

/// `threads` threads each run `iters` alloc+free rounds of `batch`; the time from the
/// barrier that releases them to the barrier they all reach when done.
fn run_contended<P: FreeList>(pool: &P, threads: usize, batch: usize, iters: u64) -> Duration {
    let start = Barrier::new(threads + 1);
    let done = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = vec![0u32; batch];
                start.wait();
                for _ in 0..iters {
                    assert!(pool.alloc(black_box(&mut buf)));
                    pool.free(black_box(&buf));
                }
                done.wait();
            });
        }
        start.wait();
        let t0 = Instant::now();
        done.wait();
        t0.elapsed()
    })
}

fn contended_one<P: FreeList>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    threads: usize,
    batch: usize,
) {
    let pool = P::new(CAPACITY);
    c.bench_function(BenchmarkId::from_parameter(P::NAME), |b| {
        b.iter_custom(|iters| run_contended(&pool, threads, batch, iters))
    });
}

fn contended(c: &mut Criterion) {
    for threads in [2usize, 4, 8] {
        for batch in [16usize, 256] {
            let mut g = c.benchmark_group(format!("contended/{threads}t_b{batch}"));
            g.throughput(Throughput::Elements((threads * batch) as u64));
            contended_one::<SlotPool>(&mut g, threads, batch);
            contended_one::<Bitmap>(&mut g, threads, batch);
            contended_one::<MutexVec>(&mut g, threads, batch);
            contended_one::<Queue>(&mut g, threads, batch);
            g.finish();
        }
    }
}

criterion_group!(benches, single, contended);
criterion_main!(benches);
