//! `PagedAllocator` batch allocation: `alloc_extend` (prefill) and `alloc_decode`, each
//! followed by the free of what it took, for 1 to 1024 requests at page size 16; and the
//! same batches on `SwaAllocator` (`swa_alloc_extend`, `swa_alloc_decode`: the dual
//! allocator of sliding-window models, a full pool of the same size and a window pool of
//! half of it), whose allocations also take and map a window page per fresh page and
//! whose frees release them.
//!
//! The batches are fixed, pseudo-random and realistic: half the requests continue a
//! prefix that ends inside a page (chunked prefill), whose page is allocated up front and
//! stays allocated, so part 1 of the expansion fills it; the other half start on a page
//! boundary (a prefix-cache hit is page-aligned, or no prefix). Extend lengths are
//! 1..=512 tokens. In a decode batch one request in 16 starts a new page.
//!
//! Each iteration allocates the batch, gathers the slots that landed in fresh pages and
//! frees them with one call (the slots in the held prefix pages are not freed), so the
//! pool returns to the same state. Throughput counts new tokens.
//!
//! `decode_page1` is the host half of a graph decode step at page size 1 (one slot per
//! request per step) in a steady state: `batch` requests decode, each finishes after
//! 64 to 1,023 tokens (its slots freed with one call, in position order) and a new one
//! takes its place. `claim_order` stages with `stage_decode` (the slots in the pool's
//! claim order, as before), `following` with `stage_decode_after` and each request's
//! last slot (its run goes on where the next slot is free). The pool holds exactly
//! the most the requests can hold. Each reports the runs of consecutive slots a
//! finished request held.
//!
//! Run: `cargo bench --bench alloc` (`-- alloc_extend` runs both allocators' extend
//! groups, one after the other in one process).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpool::alloc::{plan_extend, SwaAllocator};
use kvpool::kv::staging::{bucket_for, decode_block_bytes, stage_decode, stage_decode_after, RowLimits};
use kvpool::{KvAllocator, PagedAllocator};

const PAGE: u32 = 16;
/// Tokens in the pool: 64Ki pages of 16.
const POOL_TOKENS: usize = 1 << 20;
/// Tokens in an `SwaAllocator`'s window pool: half the full pool (the 1024-request
/// extend batch takes about 17,400 pages at once, more than a quarter).
const WINDOW_TOKENS: usize = POOL_TOKENS / 2;
const BATCHES: [usize; 6] = [1, 4, 16, 64, 256, 1024];

/// xorshift64*: the same batches every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// A request's `last_loc` for a prefix that ends inside a page: a slot at the right
/// position of a freshly allocated page, which the benchmark keeps.
fn held_last_loc(alloc: &impl KvAllocator, prefix_len: u32) -> u32 {
    let mut page = [0u32; PAGE as usize];
    alloc.alloc(&mut page).expect("pool sized for the held pages");
    page[0] + (prefix_len - 1) % PAGE
}

/// A batch plus where in `out` its fresh-page slots lie.
struct Batch {
    prefix_lens: Vec<u32>,
    seq_lens: Vec<u32>,
    last_locs: Vec<u32>,
    /// `(start, len)` ranges of `out` in fresh pages.
    fresh: Vec<(usize, usize)>,
    new_tokens: usize,
}

impl Batch {
    fn new(alloc: &impl KvAllocator, prefix_lens: Vec<u32>, seq_lens: Vec<u32>) -> Self {
        let mut last_locs = Vec::with_capacity(seq_lens.len());
        let mut fresh = Vec::new();
        let mut at = 0usize;
        for (&prefix, &seq) in prefix_lens.iter().zip(&seq_lens) {
            let aligned = prefix % PAGE == 0;
            last_locs.push(if aligned { 0 } else { held_last_loc(alloc, prefix) });
            // Part 1 fills the held partial page; everything after it is fresh.
            let p1 = (seq.min(prefix.div_ceil(PAGE) * PAGE) - prefix) as usize;
            let n = (seq - prefix) as usize;
            if n > p1 {
                fresh.push((at + p1, n - p1));
            }
            at += n;
        }
        Batch { prefix_lens, seq_lens, last_locs, fresh, new_tokens: at }
    }

    /// The slots of `out` in fresh pages, into `scratch`; returns how many.
    fn gather(&self, out: &[u32], scratch: &mut [u32]) -> usize {
        let mut k = 0;
        for &(start, len) in &self.fresh {
            scratch[k..k + len].copy_from_slice(&out[start..start + len]);
            k += len;
        }
        k
    }
}

fn extend_batch(alloc: &impl KvAllocator, requests: usize, rng: &mut Rng) -> Batch {
    let mut prefix_lens = Vec::with_capacity(requests);
    let mut seq_lens = Vec::with_capacity(requests);
    for _ in 0..requests {
        let prefix = if rng.below(2) == 0 {
            PAGE * rng.below(65) as u32 // aligned: a cache hit of 0..=64 pages
        } else {
            PAGE * rng.below(64) as u32 + 1 + rng.below(PAGE as u64 - 1) as u32 // inside a page
        };
        prefix_lens.push(prefix);
        seq_lens.push(prefix + 1 + rng.below(512) as u32);
    }
    Batch::new(alloc, prefix_lens, seq_lens)
}

fn decode_batch(alloc: &impl KvAllocator, requests: usize, rng: &mut Rng) -> Batch {
    // seq % 16 == 1 (a new page) exactly for every 16th request, request 0 included.
    let seq_lens: Vec<u32> =
        (0..requests as u32).map(|i| PAGE * (1 + rng.below(200) as u32) + 1 + (i * 7) % PAGE).collect();
    let prefix_lens = seq_lens.iter().map(|s| s - 1).collect();
    Batch::new(alloc, prefix_lens, seq_lens)
}

fn bench_batches<A: KvAllocator>(c: &mut Criterion, name: &str, decode: bool, new_alloc: impl Fn() -> A) {
    let mut g = c.benchmark_group(name);
    for requests in BATCHES {
        let alloc = new_alloc();
        let mut rng = Rng(0x5EED_0000 + requests as u64);
        let batch =
            if decode { decode_batch(&alloc, requests, &mut rng) } else { extend_batch(&alloc, requests, &mut rng) };
        let plan = plan_extend(PAGE, &batch.prefix_lens, &batch.seq_lens).unwrap();
        eprintln!(
            "{name}/{requests}: {} new tokens, {} fresh pages, {} free slots per iteration",
            plan.new_tokens,
            plan.new_pages,
            batch.fresh.iter().map(|r| r.1).sum::<usize>()
        );
        let mut out = vec![0u32; batch.new_tokens];
        let mut scratch = vec![0u32; batch.new_tokens];
        g.throughput(Throughput::Elements(batch.new_tokens as u64));
        g.bench_function(BenchmarkId::from_parameter(requests), |b| {
            b.iter(|| {
                if decode {
                    alloc.alloc_decode(black_box(&batch.seq_lens), &batch.last_locs, &mut out).unwrap();
                } else {
                    alloc
                        .alloc_extend(black_box(&batch.prefix_lens), &batch.seq_lens, &batch.last_locs, &mut out)
                        .unwrap();
                }
                let n = batch.gather(black_box(&out), &mut scratch);
                alloc.free(&scratch[..n]).unwrap();
            })
        });
    }
    g.finish();
}

fn paged() -> PagedAllocator {
    PagedAllocator::new(POOL_TOKENS, PAGE).unwrap()
}

fn swa() -> SwaAllocator {
    SwaAllocator::new(POOL_TOKENS, WINDOW_TOKENS, PAGE).unwrap()
}

fn extend(c: &mut Criterion) {
    bench_batches(c, "alloc_extend", false, paged);
    bench_batches(c, "swa_alloc_extend", false, swa);
}

fn decode(c: &mut Criterion) {
    bench_batches(c, "alloc_decode", true, paged);
    bench_batches(c, "swa_alloc_decode", true, swa);
}

/// The steady state of `decode_page1`.
struct PageOneDecode {
    host: PagedAllocator,
    held: Vec<Vec<u32>>,
    life: Vec<u32>,
    seq: Vec<u32>,
    rows: Vec<u32>,
    block: Vec<u32>,
    rng: Rng,
    runs: u64,
    finished: u64,
}

const MAX_LIFE: u32 = 1024;

impl PageOneDecode {
    fn new(batch: usize) -> PageOneDecode {
        let mut rng = Rng(0x5EED_1000 + batch as u64);
        PageOneDecode {
            host: PagedAllocator::new(batch * MAX_LIFE as usize, 1).unwrap(),
            held: (0..batch).map(|_| Vec::with_capacity(MAX_LIFE as usize)).collect(),
            life: (0..batch).map(|_| 64 + rng.below(960) as u32).collect(),
            seq: vec![0; batch],
            rows: (0..batch as u32).collect(),
            block: vec![0; decode_block_bytes(bucket_for(batch)) / 4],
            rng,
            runs: 0,
            finished: 0,
        }
    }

    fn step(&mut self, follow: bool) {
        let bucket = bucket_for(self.rows.len());
        let limits = RowLimits { rows: self.rows.len() as u32, max_context_len: MAX_LIFE };
        for (s, h) in self.seq.iter_mut().zip(&self.held) {
            *s = h.len() as u32 + 1;
        }
        let b: &mut [u8] = bytemuck::cast_slice_mut(&mut self.block);
        let staged = if follow {
            let held = &self.held;
            let last = |i: usize| held[i].last().copied().unwrap_or(u32::MAX);
            stage_decode_after(&self.host, &self.seq, &self.rows, bucket, limits, b, last)
        } else {
            stage_decode(&self.host, &self.seq, &self.rows, bucket, limits, b)
        }
        .unwrap();
        let at = 4 * bucket;
        for (i, &slot) in self.block[at..at + staged.new_pages].iter().enumerate() {
            let h = &mut self.held[i];
            h.push(slot);
            if h.len() as u32 == self.life[i] {
                self.runs += 1 + h.windows(2).filter(|w| w[1] != w[0] + 1).count() as u64;
                self.finished += 1;
                self.host.free(h).unwrap();
                h.clear();
                self.life[i] = 64 + self.rng.below(960) as u32;
            }
        }
    }
}

fn decode_page1(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_page1");
    for batch in [32usize, 256, 1024] {
        g.throughput(Throughput::Elements(batch as u64));
        for (name, follow) in [("claim_order", false), ("following", true)] {
            let mut d = PageOneDecode::new(batch);
            // Past the start, where every request begins at once.
            for _ in 0..2 * MAX_LIFE {
                d.step(follow);
            }
            g.bench_function(BenchmarkId::new(name, batch), |b| b.iter(|| d.step(black_box(follow))));
            eprintln!(
                "decode_page1/{name}/{batch}: {:.1} runs per finished request ({} finished)",
                d.runs as f64 / d.finished.max(1) as f64,
                d.finished
            );
        }
    }
    g.finish();
}

criterion_group!(benches, extend, decode, decode_page1);
criterion_main!(benches);
