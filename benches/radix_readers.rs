//! Lookup throughput with 1, 2, 4, 8 reader threads while one writer thread caches
//! prompts and evicts, for kvpool's `RadixCache::peek_prefix` (lock-free) and for the
//! reference tree behind a `Mutex` (how engines share SGLang's/TGI's tree between
//! scheduler and router threads). The writer caches one 2048-token prompt (kvpool: a
//! request admitted, prefilled and finished; the reference: an insert; both evicting as
//! needed), then pauses 200 µs.
//! Each criterion iteration is one lookup per reader thread; the reported throughput
//! counts lookups of all readers together.
//!
//! `lookup_depth/{wide,deep}`: one thread's `peek_prefix` alone (no writer) on paths of
//! 2 nodes (the prompts above) and of up to 32 nodes (64 conversations of 32 turns of
//! 64 tokens, every turn its own node), so the cost of a lookup per level of the tree
//! can be read apart from the contention with a writer.
//!
//! `cargo bench --bench radix_readers`

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpool::baseline::ReferenceRadixCache;
use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool};

const PS: u32 = 16;
const CAPACITY: usize = 1 << 20;
const PROMPT: usize = 2048;
const SYSTEM: usize = 512;
/// The writer's pace: 5,000 inserts per second.
const WRITE_EVERY: Duration = Duration::from_micros(200);

/// Prompts: 64 "system prompts" of 512 tokens, each followed by a distinct body.
fn prompt(i: u64) -> Vec<u32> {
    let sys = (i % 64) as u32;
    let mut v: Vec<u32> = (0..SYSTEM as u32).map(|t| sys * 100_000 + t).collect();
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    v.extend((SYSTEM..PROMPT).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 50_000) as u32
    }));
    v
}

trait Shared: Send + Sync + 'static {
    fn lookup(&self, key: &[u32], out: &mut [u32]) -> usize;
    fn write_one(self: &Arc<Self>, key: &[u32]);
}

/// One request through kvpool's cache: admitted (matching and locking its cached
/// prefix), prefilled (evicting the shortfall), finished (cached). Dropped, that is
/// aborted, when there is no room.
fn serve(cache: &Arc<RadixCache<PagedAllocator>>, key: &[u32]) {
    let Ok(mut r) = cache.admit(0, key) else { return };
    if r.extend(key.len() - r.len()).is_ok() {
        r.finish(key).unwrap();
    }
}

impl Shared for RadixCache<PagedAllocator> {
    fn lookup(&self, key: &[u32], out: &mut [u32]) -> usize {
        self.peek_prefix(0, key, out)
    }
    fn write_one(self: &Arc<Self>, key: &[u32]) {
        serve(self, key);
    }
}

impl Shared for Mutex<ReferenceRadixCache<PagedAllocator>> {
    fn lookup(&self, key: &[u32], out: &mut [u32]) -> usize {
        let (v, _) = self.lock().unwrap().match_prefix(0, key);
        out[..v.len()].copy_from_slice(&v);
        v.len()
    }
    fn write_one(self: &Arc<Self>, key: &[u32]) {
        let mut c = self.lock().unwrap();
        let mut slots = vec![0u32; key.len()];
        let avail = c.allocator().available_size();
        if avail < key.len() {
            c.evict(key.len() - avail);
        }
        if c.allocator().alloc(&mut slots).is_ok() {
            let dup = c.insert(0, key, &slots, 0);
            c.allocator().free(&slots[..dup]).unwrap();
        }
    }
}

fn run<S: Shared>(c: &mut Criterion, name: &str, shared: Arc<S>) {
    let prompts: Arc<Vec<Vec<u32>>> = Arc::new((0..4096).map(prompt).collect());
    for p in prompts.iter().take(400) {
        shared.write_one(p);
    }
    let mut group = c.benchmark_group(format!("readers_with_writer/{name}"));
    group.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    for readers in [1usize, 2, 4, 8] {
        group.throughput(Throughput::Elements(readers as u64));
        group.bench_with_input(BenchmarkId::from_parameter(readers), &readers, |b, &readers| {
            b.iter_custom(|iters| {
                let stop = Arc::new(AtomicBool::new(false));
                let writer = {
                    let (shared, prompts, stop) = (shared.clone(), prompts.clone(), stop.clone());
                    thread::spawn(move || {
                        let mut i = 400usize;
                        let mut next = Instant::now();
                        while !stop.load(Ordering::Relaxed) {
                            // A steady write load (one 2048-token insert, with eviction,
                            // then a WRITE_EVERY pause): a scheduler finishing requests.
                            // An unpaced writer would hold the baseline's mutex almost
                            // always and starve its readers outright.
                            if Instant::now() >= next {
                                shared.write_one(&prompts[i % prompts.len()]);
                                i += 7;
                                // Never catch up in a burst: a slow write delays the next.
                                next = Instant::now() + WRITE_EVERY;
                            } else {
                                std::hint::spin_loop();
                            }
                        }
                    })
                };
                let start = Arc::new(Barrier::new(readers + 1));
                let handles: Vec<_> = (0..readers)
                    .map(|r| {
                        let (shared, prompts, start) = (shared.clone(), prompts.clone(), start.clone());
                        thread::spawn(move || {
                            let mut out = vec![0u32; PROMPT];
                            start.wait();
                            let t = Instant::now();
                            for i in 0..iters as usize {
                                let p = &prompts[(i * 13 + r * 101) % prompts.len()];
                                black_box(shared.lookup(p, &mut out));
                            }
                            t.elapsed()
                        })
                    })
                    .collect();
                start.wait();
                let times: Vec<Duration> = handles.into_iter().map(|h| h.join().unwrap()).collect();
                stop.store(true, Ordering::Relaxed);
                writer.join().unwrap();
                times.into_iter().max().unwrap()
            })
        });
    }
    group.finish();
}

fn readers(c: &mut Criterion) {
    let make = || PagedAllocator::new(CAPACITY, PS).unwrap();
    let config = RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
    let kv = Arc::new(RadixCache::new(make(), ReqToTokenPool::new(16, PROMPT).unwrap(), config).unwrap());
    run(c, "kvpool_peek", kv);
    let reference = Arc::new(Mutex::new(ReferenceRadixCache::new(make(), EvictionPolicy::Lru).unwrap()));
    run(c, "mutex_reference", reference);
}

/// Keys for [`lookup_depth`]: `wide`, the first 400 prompts (paths of 2 nodes); `deep`,
/// 64 conversations of 32 turns of 64 tokens, each turn a key (paths of 1 to 32 nodes).
fn depth_keys(shape: &str) -> Vec<Vec<u32>> {
    if shape == "wide" {
        return (0..400).map(prompt).collect();
    }
    let mut keys = vec![];
    for conv in 0..64u32 {
        let mut k = vec![];
        for turn in 0..32u32 {
            k.extend((0..64u32).map(|t| conv * 1_000_000 + turn * 1000 + t));
            keys.push(k.clone());
        }
    }
    keys
}

fn lookup_depth(c: &mut Criterion) {
    let mut group = c.benchmark_group("lookup_depth");
    group.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    for shape in ["wide", "deep"] {
        let cache = Arc::new(
            RadixCache::new(
                PagedAllocator::new(CAPACITY, PS).unwrap(),
                ReqToTokenPool::new(1, PROMPT).unwrap(),
                RadixConfig::default(),
            )
            .unwrap(),
        );
        let keys = depth_keys(shape);
        for k in &keys {
            serve(&cache, k);
        }
        let mut out = vec![0u32; PROMPT];
        assert!(keys.iter().all(|k| cache.peek_prefix(0, k, &mut out) == k.len()), "{shape}: a key is not cached");
        let mut i = 0usize;
        group.throughput(Throughput::Elements(1));
        group.bench_function(shape, |b| {
            b.iter(|| {
                i = i.wrapping_add(7919);
                black_box(cache.peek_prefix(0, black_box(&keys[i % keys.len()]), &mut out))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, readers, lookup_depth);
criterion_main!(benches);
