//! The shared store tier against raw Redis, on a `redis-server` this bench starts on a
//! loopback port: `put` and `get` of 2 MiB pages at batch 1, 4, 16, 64 (byte slices and
//! host pool pages), beside raw pipelined `SET`/`GET` of the same bytes through the same
//! client connection (`RedisStore::with_connection`). Goal (issue 12): at least 80% of
//! raw. Also the checksum's cost: CRC-32 (`crc32fast`) and SHA-256 over one page.
//!
//! `cargo bench --features redis --bench store`. After criterion's groups, an interleaved
//! summary (store and raw alternating, median of `KVPOOL_STORE_ROUNDS` rounds, default
//! 15) prints GB/s, pages/s and the ratio to raw from the same run (for `get` also to raw
//! `GET` plus the copy into the caller's buffers, `raw_get_copy`); set
//! `KVPOOL_STORE_SUMMARY=0` to skip it.

#[path = "../tests/store_common/mod.rs"]
mod store_common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};
use kvpool::radix::{page_hash, BlockHash};
use kvpool::store::redis::{RedisStore, RedisStoreConfig};
use kvpool::store::{PageFormat, PageStore};
use redis::Value;
use sha2::Digest;

const BATCHES: [usize; 4] = [1, 4, 16, 64];

/// Llama-3-8B-shaped pages: 32 layers, 8 KV heads of 128, bf16 (128 KiB a token), 16 tokens: 2 MiB.
fn kv() -> KvConfig {
    KvConfig {
        layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
        dtype: KvDtype::Bf16,
        layer_num: 32,
        size: 64 * 16,
        page_size: 16,
    }
}

struct Setup {
    store: RedisStore,
    hashes: Vec<BlockHash>,
    pages: Vec<Vec<u8>>,
    bufs: Vec<Vec<u8>>,
    raw_keys: Vec<Vec<u8>>,
    pool: HostKvPool,
    host_pages: Vec<u32>,
    host_dst: Vec<u32>,
}

impl Setup {
    fn new(url: String) -> Setup {
        let cfg = HostKvConfig { kv: kv(), host_pages: 130, layout: HostLayout::PageFirst };
        let format = PageFormat::of(&cfg);
        assert_eq!(format.page_bytes(), 2 << 20);
        let mut scfg = RedisStoreConfig::new(url, "bench", format);
        scfg.timeout = Duration::from_secs(30);
        let store = RedisStore::new(scfg).unwrap();
        let mut hashes: Vec<BlockHash> = Vec::new();
        for i in 0..64u32 {
            let h = page_hash(hashes.last(), &[i; 16]);
            hashes.push(h);
        }
        let pages: Vec<Vec<u8>> =
            (0..64).map(|i| (0..format.page_bytes()).map(|k| (k * 31 + i * 7) as u8).collect()).collect();
        let bufs = vec![vec![0u8; format.page_bytes()]; 64];
        let raw_keys = (0..64).map(|i| format!("raw:{i}").into_bytes()).collect();
        let mut pool = HostKvPool::pageable(cfg).unwrap();
        let mut host_pages = vec![0u32; 64];
        pool.alloc_pages(&mut host_pages).unwrap();
        for (&p, bytes) in host_pages.iter().zip(&pages) {
            pool.write_page(p, bytes).unwrap();
        }
        let mut host_dst = vec![0u32; 64];
        pool.alloc_pages(&mut host_dst).unwrap();
        let s = Setup { store, hashes, pages, bufs, raw_keys, pool, host_pages, host_dst };
        // Everything the gets read is there.
        s.put(64);
        s.raw_set(64);
        s
    }

    fn put(&self, n: usize) {
        let refs: Vec<&[u8]> = self.pages[..n].iter().map(|p| &p[..]).collect();
        self.store.put(&self.hashes[..n], &refs).unwrap();
    }

    fn get(&mut self, n: usize) {
        let mut refs: Vec<&mut [u8]> = self.bufs[..n].iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(self.store.get(&self.hashes[..n], &mut refs).unwrap().pages, n);
    }

    fn put_host(&self, n: usize) {
        self.store.put_host(&self.pool, &self.hashes[..n], &self.host_pages[..n]).unwrap();
    }

    fn get_host(&mut self, n: usize) {
        let loaded = self.store.get_host(&mut self.pool, &self.hashes[..n], &self.host_dst[..n]).unwrap();
        assert_eq!(loaded.pages, n);
    }

    fn raw_set(&self, n: usize) {
        self.store
            .with_connection(|c| {
                let mut p = redis::pipe();
                for (k, v) in self.raw_keys[..n].iter().zip(&self.pages) {
                    p.cmd("SET").arg(&k[..]).arg(&v[..]).ignore();
                }
                p.query::<()>(c)
            })
            .unwrap();
    }

    /// Raw `GET`s and a copy of each value into the caller's buffers (what a caller of
    /// raw `GET` must do too; the store's `get` does it after the checks).
    fn raw_get_copy(&mut self, n: usize) {
        let values = self.raw_values(n);
        for (v, buf) in values.iter().zip(&mut self.bufs) {
            let Value::BulkString(b) = v else { panic!("missing raw value") };
            buf.copy_from_slice(b);
        }
    }

    /// One pipeline of raw `GET`s of the first `n` keys.
    fn raw_values(&self, n: usize) -> Vec<Value> {
        self.store
            .with_connection(|c| {
                let mut p = redis::pipe();
                for k in &self.raw_keys[..n] {
                    p.cmd("GET").arg(&k[..]);
                }
                p.query::<Vec<Value>>(c)
            })
            .unwrap()
    }

    fn raw_get(&self, n: usize) {
        let values = self.raw_values(n);
        assert!(matches!(&values[n - 1], Value::BulkString(b) if b.len() == 2 << 20));
        black_box(values);
    }
}

const OPS: [&str; 6] = ["put", "raw_set", "put_host", "get", "raw_get", "get_host"];

fn run(s: &mut Setup, op: &str, n: usize) {
    match op {
        "put" => s.put(n),
        "raw_set" => s.raw_set(n),
        "put_host" => s.put_host(n),
        "get" => s.get(n),
        "raw_get" => s.raw_get(n),
        "get_host" => s.get_host(n),
        "raw_get_copy" => s.raw_get_copy(n),
        _ => unreachable!(),
    }
}

fn bench_store(c: &mut Criterion, s: &mut Setup) {
    for op in OPS {
        let mut g = c.benchmark_group(format!("store/{op}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
        for n in BATCHES {
            g.throughput(Throughput::Bytes((n * (2 << 20)) as u64));
            g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| b.iter(|| run(s, op, n)));
        }
        g.finish();
    }
}

fn bench_checksum(c: &mut Criterion) {
    let page: Vec<u8> = (0..2 << 20).map(|k: usize| (k * 13) as u8).collect();
    let mut g = c.benchmark_group("store/checksum_2MiB");
    g.throughput(Throughput::Bytes(page.len() as u64));
    g.bench_function("crc32fast", |b| b.iter(|| crc32fast::hash(black_box(&page))));
    g.bench_function("sha256", |b| b.iter(|| sha2::Sha256::digest(black_box(&page))));
    g.finish();
}

/// Store and raw alternating, so both see the same load: median seconds per batch.
fn summary(s: &mut Setup) {
    let rounds: usize = std::env::var("KVPOOL_STORE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    println!("\nsummary: median of {rounds} interleaved rounds, 2 MiB pages (GB = 1e9 bytes)");
    println!(
        "{:>5} {:>9} {:>9} {:>10} {:>13} {:>9} {:>7}",
        "batch", "op", "GB/s", "pages/s", "baseline", "GB/s", "ratio"
    );
    for n in BATCHES {
        for (op, raw) in [
            ("put", "raw_set"),
            ("put_host", "raw_set"),
            ("get", "raw_get"),
            ("get_host", "raw_get"),
            ("get", "raw_get_copy"),
        ] {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                let t = Instant::now();
                run(s, op, n);
                a.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                run(s, raw, n);
                b.push(t.elapsed().as_secs_f64());
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (ta, tb) = (med(&mut a), med(&mut b));
            let bytes = (n * (2 << 20)) as f64;
            println!(
                "{n:>5} {op:>9} {:>9.2} {:>10.0} {raw:>13} {:>9.2} {:>6.0}%",
                bytes / ta / 1e9,
                n as f64 / ta,
                bytes / tb / 1e9,
                100.0 * tb / ta
            );
        }
    }
}

fn benches() {
    let Some(server) = store_common::RedisServer::start() else { return };
    let mut s = Setup::new(server.url());
    let mut c = Criterion::default().configure_from_args();
    bench_checksum(&mut c);
    bench_store(&mut c, &mut s);
    if std::env::var("KVPOOL_STORE_SUMMARY").map_or(true, |v| v != "0") {
        summary(&mut s);
    }
    drop(server);
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
