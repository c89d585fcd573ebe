#![cfg(not(loom))]
#![allow(clippy::needless_range_loop)] // the model indexes by (layer, buffer) on purpose
//! `HostKvPool` against a plain sequential model: random sequences of page
//! allocations, frees (live, double, forged and out-of-range pages), backups and
//! per-layer loads, for both layouts. The model is a set of free pages (a fresh pool
//! hands out the lowest free pages, ascending) and a byte image of the pool kept with
//! the layout's offset formula written out here once more; after every step the pool's
//! counts, every page's allocation state and every byte of the pool must match. Plus a
//! threaded stress test: no page is ever handed to two owners at once.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use kvpool::kv::host::{HostKvConfig, HostKvError, HostKvPool, HostLayout, HostPageFault};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};
use kvpool::FreeErrorKind;
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 128 };

#[derive(Clone, Debug)]
enum Op {
    /// Allocate this many pages.
    Alloc(usize),
    /// Free the live pages at these positions of the live list (a batch).
    Free(Vec<usize>),
    /// Free a page number as given (stale, forged, 0 or past the end).
    FreeRaw(u32),
    /// Back up `n` device pages (starting at a seed) into the live pages at these positions.
    Backup(u8, Vec<usize>),
    /// Load the live pages at these positions into device pages, layers `a..b`.
    Load(u8, Vec<usize>, u32, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..40).prop_map(Op::Alloc),
        3 => vec(any::<usize>(), 0..8).prop_map(Op::Free),
        1 => (0u32..80).prop_map(Op::FreeRaw),
        2 => (any::<u8>(), vec(any::<usize>(), 0..6)).prop_map(|(s, p)| Op::Backup(s, p)),
        2 => (any::<u8>(), vec(any::<usize>(), 0..6), 0u32..5, 0u32..5).prop_map(|(s, p, a, b)| Op::Load(s, p, a, b)),
    ]
}

/// The byte offset of row `k` of page `p`, layer `l`, buffer `b` (the layouts' formulas, written out again).
fn offset(cfg: &HostKvConfig, p: usize, l: usize, b: usize, k: usize) -> usize {
    let (ln, bn, ps, r, h) =
        (cfg.kv.layer_num as usize, cfg.buffers(), cfg.kv.page_size as usize, cfg.kv.row_bytes(), cfg.host_pages);
    match cfg.layout {
        HostLayout::LayerFirst => ((l * bn + b) * (h + 1) * ps + p * ps + k) * r,
        HostLayout::PageFirst => (((p * ln + l) * bn + b) * ps + k) * r,
    }
}

struct Model {
    cfg: HostKvConfig,
    free: BTreeSet<u32>,
    /// Live pages in allocation order.
    live: Vec<u32>,
    bytes: Vec<u8>,
}

impl Model {
    fn check(&self, pool: &HostKvPool) -> Result<(), TestCaseError> {
        prop_assert_eq!(pool.available_pages(), self.free.len());
        for p in 0..=self.cfg.host_pages as u32 + 1 {
            let live = p >= 1 && p as usize <= self.cfg.host_pages && !self.free.contains(&p);
            prop_assert_eq!(pool.is_allocated(p), live, "page {}", p);
        }
        prop_assert!(pool.as_bytes() == &self.bytes[..], "pool bytes differ from the model");
        Ok(())
    }

    fn pick(&self, at: &[usize]) -> Vec<u32> {
        // Distinct live pages (a transfer names each page once).
        let mut out = Vec::new();
        for &i in at {
            if self.live.is_empty() {
                break;
            }
            let p = self.live[i % self.live.len()];
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }
}

fn device(cfg: &HostKvConfig, seed: u8) -> Vec<Vec<u8>> {
    let n = cfg.kv.layer_num as usize * cfg.buffers();
    (0..n)
        .map(|lb| {
            (0..cfg.kv.layer_bytes()).map(|i| (i as u8) ^ seed.wrapping_mul(29) ^ (lb as u8).wrapping_mul(71)).collect()
        })
        .collect()
}

fn run(cfg: HostKvConfig, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pool = HostKvPool::pageable(cfg).unwrap();
    let mut m =
        Model { cfg, free: (1..=cfg.host_pages as u32).collect(), live: Vec::new(), bytes: vec![0; cfg.total_bytes()] };
    let (ps, r, lbs) = (cfg.kv.page_size as usize, cfg.kv.row_bytes(), cfg.kv.layer_num as usize * cfg.buffers());
    let dev_pages = cfg.device_pages();
    for op in ops {
        match op {
            Op::Alloc(n) => {
                let mut out = vec![0u32; *n];
                match pool.alloc_pages(&mut out) {
                    Ok(()) => {
                        prop_assert!(*n <= m.free.len());
                        let want: Vec<u32> = m.free.iter().take(*n).copied().collect();
                        prop_assert_eq!(&out, &want, "lowest free pages, ascending");
                        for p in &out {
                            m.free.remove(p);
                        }
                        m.live.extend(&out);
                    }
                    Err(e) => {
                        let oom = e.out_of_memory().expect("only out of memory");
                        prop_assert!(*n > m.free.len());
                        prop_assert_eq!((oom.requested, oom.available), (*n, m.free.len()));
                        prop_assert!(out.iter().all(|&x| x == 0), "out written on error");
                    }
                }
            }
            Op::Free(at) => {
                let batch = m.pick(at);
                pool.free_pages(&batch).map_err(|e| TestCaseError::fail(e.to_string()))?;
                for p in &batch {
                    m.free.insert(*p);
                }
                m.live.retain(|p| !batch.contains(p));
            }
            Op::FreeRaw(p) => {
                let r = pool.free_pages(&[*p]);
                if *p == 0 || *p as usize > cfg.host_pages {
                    let e = r.unwrap_err();
                    let out_of_range = matches!(e.kind, FreeErrorKind::OutOfRange { .. });
                    prop_assert!(out_of_range, "{:?}", e);
                } else if m.free.contains(p) {
                    let e = r.unwrap_err();
                    prop_assert_eq!(e.kind, FreeErrorKind::NotAllocated);
                    prop_assert!(!e.rest_freed);
                } else {
                    r.map_err(|e| TestCaseError::fail(e.to_string()))?;
                    m.free.insert(*p);
                    m.live.retain(|x| x != p);
                }
            }
            Op::Backup(seed, at) => {
                let hp = m.pick(at);
                let dp: Vec<u32> = (0..hp.len()).map(|i| 1 + ((*seed as usize + 7 * i) % dev_pages) as u32).collect();
                let dev = device(&cfg, *seed);
                let refs: Vec<&[u8]> = dev.iter().map(|b| &b[..]).collect();
                // A forged host page first: refused, nothing written.
                if let Some(&f) = m.free.iter().next() {
                    let mut bad = hp.clone();
                    bad.push(f);
                    let mut bad_d = dp.clone();
                    bad_d.push(1);
                    let e = pool.backup(&refs, &bad_d, &bad).unwrap_err();
                    prop_assert_eq!(e, HostKvError::HostPage { page: f, fault: HostPageFault::NotAllocated });
                    m.check(&pool)?;
                }
                pool.backup(&refs, &dp, &hp).map_err(|e| TestCaseError::fail(e.to_string()))?;
                for (&d, &h) in dp.iter().zip(&hp) {
                    for lb in 0..lbs {
                        let (l, b) = (lb / cfg.buffers(), lb % cfg.buffers());
                        for k in 0..ps {
                            let at = offset(&cfg, h as usize, l, b, k);
                            let src = (d as usize * ps + k) * r;
                            m.bytes[at..at + r].copy_from_slice(&dev[lb][src..src + r]);
                        }
                    }
                }
            }
            Op::Load(seed, at, a, b) => {
                let hp = m.pick(at);
                // Distinct device pages.
                let dp: Vec<u32> = (0..hp.len()).map(|i| 1 + ((*seed as usize + i) % dev_pages) as u32).collect();
                let mut dev = device(&cfg, seed.wrapping_add(1));
                let mut want = dev.clone();
                let mut refs: Vec<&mut [u8]> = dev.iter_mut().map(|b| &mut b[..]).collect();
                let r_ = pool.load(&mut refs, &hp, &dp, *a..*b);
                if a > b || *b > cfg.kv.layer_num {
                    let refused = matches!(r_, Err(HostKvError::Layers { .. }));
                    prop_assert!(refused, "{:?}", r_);
                    prop_assert!(dev == want, "a refused load wrote");
                } else {
                    r_.map_err(|e| TestCaseError::fail(e.to_string()))?;
                    for (&h, &d) in hp.iter().zip(&dp) {
                        for lb in *a as usize * cfg.buffers()..*b as usize * cfg.buffers() {
                            let (l, bb) = (lb / cfg.buffers(), lb % cfg.buffers());
                            for k in 0..ps {
                                let at = offset(&cfg, h as usize, l, bb, k);
                                let dst = (d as usize * ps + k) * r;
                                want[lb][dst..dst + r].copy_from_slice(&m.bytes[at..at + r]);
                            }
                        }
                    }
                    prop_assert!(dev == want, "load differs from the model");
                }
            }
        }
        m.check(&pool)?;
    }
    Ok(())
}

fn configs() -> Vec<KvConfig> {
    vec![
        KvConfig {
            layout: KvLayout::Mha { head_num: 1, head_dim: 3 },
            dtype: KvDtype::F16,
            layer_num: 4,
            size: 24,
            page_size: 2,
        },
        KvConfig {
            layout: KvLayout::Mla { kv_lora_rank: 2, qk_rope_head_dim: 1 },
            dtype: KvDtype::Fp8E4m3,
            layer_num: 3,
            size: 30,
            page_size: 3,
        },
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn host_pool_matches_model(
        which in 0usize..2,
        page_first in any::<bool>(),
        // Around the 64-page bitmap word.
        host_pages in prop::sample::select(vec![1usize, 2, 5, 63, 64, 65, 70]),
        ops in vec(op(), 0..60),
    ) {
        let layout = if page_first { HostLayout::PageFirst } else { HostLayout::LayerFirst };
        let cfg = HostKvConfig { kv: configs()[which], host_pages, layout };
        run(cfg, &ops)?;
    }
}

/// Threads allocate and free at once; an owner table catches a page handed out twice.
#[test]
fn concurrent_allocation_never_shares_a_page() {
    const ROUNDS: usize = if cfg!(miri) { 20 } else { 5_000 };
    let cfg = HostKvConfig { kv: configs()[0], host_pages: 200, layout: HostLayout::PageFirst };
    let pool = Arc::new(HostKvPool::pageable(cfg).unwrap());
    let owner: Arc<Vec<AtomicU8>> = Arc::new((0..=200).map(|_| AtomicU8::new(0)).collect());
    let threads: Vec<_> = (1..=4u8)
        .map(|t| {
            let (pool, owner) = (Arc::clone(&pool), Arc::clone(&owner));
            std::thread::spawn(move || {
                let mut held = [0u32; 16];
                for round in 0..ROUNDS {
                    let n = 1 + (round * 7 + t as usize) % 16;
                    if pool.alloc_pages(&mut held[..n]).is_err() {
                        continue;
                    }
                    for &p in &held[..n] {
                        assert_eq!(owner[p as usize].swap(t, Ordering::AcqRel), 0, "page {p} had an owner");
                    }
                    for &p in &held[..n] {
                        assert!(pool.check_page(p).is_ok());
                        owner[p as usize].store(0, Ordering::Release);
                    }
                    pool.free_pages(&held[..n]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(pool.available_pages(), 200);
}

/// A host tier claims the pool while threads allocate and free pages by number: a
/// claim waits for the calls in progress and succeeds only when every page is free, and
/// once it holds no public call gets through. So a thread never finds the pages it
/// allocated refused on free (they would be the tree's then), and the tree's counts
/// stay exact (`check_invariants`) whenever a cache is built.
#[test]
fn a_cache_claims_a_pool_only_between_callers_pages() {
    use kvpool::radix::{HiRadixCache, RadixConfig, WritePolicy};
    use kvpool::{PagedAllocator, ReqToTokenPool};
    const ROUNDS: usize = if cfg!(miri) { 10 } else { 2_000 };
    let kv = KvConfig { size: 64, page_size: 2, ..configs()[0] };
    let pool =
        Arc::new(HostKvPool::pageable(HostKvConfig { kv, host_pages: 32, layout: HostLayout::PageFirst }).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (1..=2usize)
        .map(|t| {
            let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut held = [0u32; 4];
                let mut round = 0usize;
                while !stop.load(Ordering::Acquire) {
                    round += 1;
                    let n = 1 + (round + t) % 4;
                    if pool.alloc_pages(&mut held[..n]).is_ok() {
                        // Allocated by number: ours until we free them, owner or not.
                        pool.free_pages(&held[..n]).unwrap();
                    }
                    std::thread::yield_now();
                }
            })
        })
        .collect();
    let mut built = 0;
    for round in 0..ROUNDS {
        let c = HiRadixCache::with_host_pool(
            PagedAllocator::new(64, 2).unwrap(),
            ReqToTokenPool::new(2, 64).unwrap(),
            RadixConfig::default(),
            Arc::clone(&pool),
            WritePolicy::WriteThrough,
            1,
        );
        let Ok(c) = c else { continue }; // a caller's pages were allocated then
        let c = Arc::new(c);
        built += 1;
        let key = [round as u32, 1, 2, 3];
        let mut r = c.admit(0, &key).unwrap();
        r.extend(4).unwrap();
        r.finish(&key).unwrap();
        assert_eq!(c.host_size(), 4);
        c.check_invariants().unwrap();
    }
    stop.store(true, Ordering::Release);
    for t in threads {
        t.join().unwrap();
    }
    assert!(!pool.is_owned());
    assert_eq!(pool.available_pages(), 32);
    eprintln!("{built} of {ROUNDS} caches claimed the pool");
}
