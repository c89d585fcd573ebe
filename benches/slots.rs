//! `SlotPool` against the free lists other engines use, side by side in one run.
//!
//! * `slotpool` — kvpool's lock-free bitmap arena with per-thread magazines (validates
//!   every free: range and double-free checks, all-or-nothing).
//! * `slotpool_owned` — the same pool's owned batches (`SlotPool::alloc_slots` into a
//!   `Slots`, `SlotPool::free_slots`): misuse ruled out by the type instead of checked
//!   per word, runs magazines (the default `SlotPool::new` pool: its runs magazines
//!   take batches of up to 65,536 indices).
//! * `slotpool_cache` — owned batches through a private magazine
//!   (`SlotCache`, capacity [`CACHE`]) per thread in front of the same pool: a round
//!   the stock covers touches no atomic; the stock is drawn from and returned to the
//!   pool in bulk.
//! * `slotpool_bitmap` — the same without magazines (`SlotPool::without_magazines`):
//!   every batch claims from and frees to the bitmap, lowest-first.
//! * `mutex_vec` — a `Mutex<Vec<u32>>` free list, the way TGI and mistral.rs keep
//!   theirs, written the strong way: alloc copies the tail slice into the caller's
//!   buffer and truncates, free extends from the slice (two memcpys and one lock each;
//!   no checks).
//! * `array_queue` — a crossbeam `ArrayQueue<u32>` of free indices, one pop per index
//!   on alloc (pushed back if the queue runs dry) and one push per index on free.
//! * `lease_floor_2f`, `lease_floor_1f` (`single` only) — not allocators: the cost
//!   floor of a region-lease design with SlotPool's guarantees, one thread owning the
//!   bitmap with plain stores and only the unavoidable work left (two full fences per
//!   round, or one with an asymmetric barrier on the steal side). See `LeaseFloor`.
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
use crossbeam_utils::CachePadded;
use kvpool::{SlotCache, SlotPool, Slots};
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Not an allocator: the *floor* of a region-lease design (BENCHMARKS.md, "Region
/// leases (issue 8)"), measured beside the others so that the ratios come from one run.
///
/// One thread owns the whole bitmap (1 = free) and updates it with plain loads and
/// stores. Each round pays only what a lease design with SlotPool's guarantees cannot
/// drop: writing the indices out; on free a range check, a run check and an
/// allocated-bit check per word plus a load of the word's remote-free bits; and full
/// fences. `FENCES = 2`: one per operation (the allocation's against a thread stealing
/// an idle owner's region, the free's against a remote free racing for the same index:
/// Dekker's pattern, both sides fenced); `FENCES = 1`: the free's only, what remains if
/// the steal side used a process-wide asymmetric barrier (Linux `membarrier`) instead.
/// The fence is a `lock`-prefixed add on the owner's own cache line, the cheaper of the
/// two x86 full barriers (crossbeam-epoch's choice too). Fill and checks use AVX2 where
/// the CPU has it. No remote path, no steal, no counters, no thread lookup:
/// single-thread only, so it is not in `contended`.
struct LeaseFloor<const FENCES: u32> {
    words: Box<[AtomicU64]>,
    remote: Box<[AtomicU64]>,
    capacity: u32,
    barrier: CachePadded<AtomicU64>,
    avx2: bool,
}

impl<const FENCES: u32> LeaseFloor<FENCES> {
    #[inline]
    fn full_fence(&self) {
        self.barrier.fetch_add(1, Ordering::SeqCst);
    }
}

impl<const FENCES: u32> FreeList for LeaseFloor<FENCES> {
    const NAME: &'static str = if FENCES == 2 { "lease_floor_2f" } else { "lease_floor_1f" };
    fn new(capacity: u32) -> Self {
        let n = (capacity as usize).div_ceil(64);
        let last = capacity as usize - (n - 1) * 64;
        LeaseFloor {
            words: (0..n)
                .map(|w| AtomicU64::new(if w + 1 < n || last == 64 { u64::MAX } else { (1 << last) - 1 }))
                .collect(),
            remote: (0..n).map(|_| AtomicU64::new(0)).collect(),
            capacity,
            barrier: CachePadded::new(AtomicU64::new(0)),
            avx2: simd::has_avx2(),
        }
    }
    #[inline]
    fn alloc(&self, out: &mut [u32]) -> bool {
        if FENCES == 2 {
            self.full_fence();
        }
        let mut filled = 0;
        for (w, word) in self.words.iter().enumerate() {
            let cur = word.load(Ordering::Relaxed);
            if cur == 0 {
                continue;
            }
            // The lowest stretch of free bits (the bench frees what it took).
            let tz = cur.trailing_zeros();
            let run = ((cur >> tz).trailing_ones() as usize).min(out.len() - filled);
            let take = (u64::MAX >> (64 - run)) << tz;
            word.store(cur & !take, Ordering::Relaxed);
            simd::fill(self.avx2, &mut out[filled..filled + run], (w * 64) as u32 + tz + 1);
            filled += run;
            if filled == out.len() {
                return true;
            }
        }
        false
    }
    #[inline]
    fn free(&self, indices: &[u32]) {
        let mut pos = 0;
        let mut first_word = usize::MAX;
        while pos < indices.len() {
            let first = indices[pos];
            let i = first.wrapping_sub(1);
            assert!(i < self.capacity, "out of range");
            let (w, bit) = (i as usize / 64, i as usize % 64);
            let room = (64 - bit).min(indices.len() - pos);
            assert!(simd::ascending(self.avx2, &indices[pos..pos + room], first), "the floor frees runs only");
            let mask = if room == 64 { u64::MAX } else { ((1u64 << room) - 1) << bit };
            let cur = self.words[w].load(Ordering::Relaxed);
            assert!(cur & mask == 0 && self.remote[w].load(Ordering::Relaxed) & mask == 0, "not allocated");
            self.words[w].store(cur | mask, Ordering::Relaxed);
            first_word = first_word.min(w);
            pos += room;
        }
        // Dekker: our stores before the fence, the remote-free bits after it.
        self.full_fence();
        assert!(self.remote[first_word].load(Ordering::Relaxed) == 0, "a remote free raced us");
    }
}

/// Filling and checking ascending runs, with AVX2 where the CPU has it.
mod simd {
    pub fn has_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `out[k] = first + k`.
    #[inline]
    pub fn fill(avx2: bool, out: &mut [u32], first: u32) {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `avx2` comes from `has_avx2()`: the CPU has AVX2.
            return unsafe { x86::fill(out, first) };
        }
        let _ = avx2;
        for (k, o) in out.iter_mut().enumerate() {
            *o = first.wrapping_add(k as u32);
        }
    }

    /// Whether `s[k] == first + k` for every `k`.
    #[inline]
    pub fn ascending(avx2: bool, s: &[u32], first: u32) -> bool {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: as in `fill`.
            return unsafe { x86::ascending(s, first) };
        }
        let _ = avx2;
        s.iter().enumerate().fold(0, |d, (k, &x)| d | (x ^ first.wrapping_add(k as u32))) == 0
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// # Safety
        ///
        /// The CPU must have AVX2.
        #[target_feature(enable = "avx2")]
        pub unsafe fn fill(out: &mut [u32], first: u32) {
            let mut v = _mm256_add_epi32(_mm256_set1_epi32(first as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let mut chunks = out.chunks_exact_mut(8);
            for c in &mut chunks {
                // SAFETY: `c` is 8 writable u32s (32 bytes); unaligned stores are allowed.
                unsafe { _mm256_storeu_si256(c.as_mut_ptr().cast(), v) };
                v = _mm256_add_epi32(v, _mm256_set1_epi32(8));
            }
            let done = out.len() / 8 * 8;
            for (k, o) in out[done..].iter_mut().enumerate() {
                *o = first.wrapping_add((done + k) as u32);
            }
        }

        /// # Safety
        ///
        /// The CPU must have AVX2.
        #[target_feature(enable = "avx2")]
        pub unsafe fn ascending(s: &[u32], first: u32) -> bool {
            let mut v = _mm256_add_epi32(_mm256_set1_epi32(first as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let mut acc = _mm256_setzero_si256();
            let chunks = s.chunks_exact(8);
            let done = s.len() / 8 * 8;
            for c in chunks {
                // SAFETY: `c` is 8 readable u32s (32 bytes); unaligned loads are allowed.
                let x = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
                acc = _mm256_or_si256(acc, _mm256_xor_si256(x, v));
                v = _mm256_add_epi32(v, _mm256_set1_epi32(8));
            }
            let tail =
                s[done..].iter().enumerate().fold(0, |d, (k, &x)| d | (x ^ first.wrapping_add((done + k) as u32)));
            _mm256_testz_si256(acc, acc) == 1 && tail == 0
        }
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

/// Owned batches: a round is `alloc_slots` of the batch into a `Slots` and
/// `free_slots` of it (the `FreeList` interface copies nothing out: the indices stay in
/// the `Slots`, where the caller reads them).
struct Owned(SlotPool);

impl Owned {
    const NAME: &'static str = "slotpool_owned";
    fn new(capacity: u32) -> Self {
        Owned(SlotPool::new(capacity))
    }
    #[inline]
    fn round(&self, batch: usize, slots: &mut Slots) {
        self.0.alloc_slots(batch, slots).expect("the pool is sized for the batch");
        black_box(slots.as_slice());
        self.0.free_slots(slots).expect("a batch of this pool");
    }
}

fn single_owned(c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, batch: usize) {
    let pool = Owned::new(CAPACITY);
    let mut slots = Slots::with_capacity(batch);
    c.bench_function(BenchmarkId::from_parameter(Owned::NAME), |b| b.iter(|| pool.round(black_box(batch), &mut slots)));
}

fn contended_owned(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    threads: usize,
    batch: usize,
) {
    let pool = Owned::new(CAPACITY);
    c.bench_function(BenchmarkId::from_parameter(Owned::NAME), |b| {
        b.iter_custom(|iters| {
            run_threads(threads, iters, || Slots::with_capacity(batch), |slots| pool.round(black_box(batch), slots))
        })
    });
}

/// A `SlotCache`'s capacity in the `slotpool_cache` contestant: twice the largest batch.
const CACHE: usize = 8192;

/// A round through a private magazine: `alloc_slots` of the batch from the cache into
/// a `Slots`, `free_slots` of it back into the cache.
#[inline]
fn cache_round(cache: &mut SlotCache<&SlotPool>, batch: usize, slots: &mut Slots) {
    cache.alloc_slots(batch, slots).expect("the pool is sized for the batch");
    black_box(slots.as_slice());
    cache.free_slots(slots).expect("a batch of this pool");
}

fn single_cache(c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, batch: usize) {
    let pool = SlotPool::new(CAPACITY);
    let mut cache = SlotCache::new(&pool, CACHE).expect("a pool with magazines");
    let mut slots = Slots::with_capacity(batch);
    c.bench_function(BenchmarkId::from_parameter("slotpool_cache"), |b| {
        b.iter(|| cache_round(&mut cache, black_box(batch), &mut slots))
    });
}

fn contended_cache(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    threads: usize,
    batch: usize,
) {
    let pool = SlotPool::new(CAPACITY);
    c.bench_function(BenchmarkId::from_parameter("slotpool_cache"), |b| {
        b.iter_custom(|iters| {
            run_threads(
                threads,
                iters,
                || (SlotCache::new(&pool, CACHE).expect("a pool with magazines"), Slots::with_capacity(batch)),
                |(cache, slots)| cache_round(cache, black_box(batch), slots),
            )
        })
    });
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
        single_owned(&mut g, batch);
        single_cache(&mut g, batch);
        single_one::<Bitmap>(&mut g, batch);
        single_one::<MutexVec>(&mut g, batch);
        single_one::<Queue>(&mut g, batch);
        single_one::<LeaseFloor<2>>(&mut g, batch);
        single_one::<LeaseFloor<1>>(&mut g, batch);
        g.finish();
    }
}

/// `threads` threads each run `iters` alloc+free rounds of `batch`; the time from the
/// barrier that releases them to the barrier they all reach when done.
fn run_contended<P: FreeList>(pool: &P, threads: usize, batch: usize, iters: u64) -> Duration {
    run_threads(
        threads,
        iters,
        || vec![0u32; batch],
        |buf| {
            assert!(pool.alloc(black_box(buf)));
            pool.free(black_box(buf));
        },
    )
}

/// `threads` threads, each with its own `state()` made before the start, run `round`
/// `iters` times; the time from the barrier that releases them to the barrier they
/// all reach when done.
fn run_threads<S>(threads: usize, iters: u64, state: impl Fn() -> S + Sync, round: impl Fn(&mut S) + Sync) -> Duration {
    let start = Barrier::new(threads + 1);
    let done = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut st = state();
                start.wait();
                for _ in 0..iters {
                    round(&mut st);
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
            contended_owned(&mut g, threads, batch);
            contended_cache(&mut g, threads, batch);
            contended_one::<Bitmap>(&mut g, threads, batch);
            contended_one::<MutexVec>(&mut g, threads, batch);
            contended_one::<Queue>(&mut g, threads, batch);
            g.finish();
        }
    }
}

criterion_group!(benches, single, contended);
criterion_main!(benches);
