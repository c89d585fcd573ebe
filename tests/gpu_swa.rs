//! GPU test of the sliding-window kernels (`swa_scatter_v*`, `swa_map_update`) against
//! the host reference `kvpool::kv::swa::SwaHostKv::scatter`: random layouts (Gemma 3,
//! alternating, unordered custom lists), every vector width, page sizes 1 to 16, pools
//! filled with random bytes, random full slots (the dummy slot 0 and page 0 included),
//! mapping tables with mapped and unmapped pages changed between rounds and uploaded by
//! page and by range, then every layer of both pools compared byte for byte; slots and
//! mapped slots out of range; layers at arbitrary addresses through views of separate
//! allocations; the sm_80 and the sm_90 PTX.
//!
//! Without a CUDA device each device test prints "no CUDA device" and returns; set
//! `KVPOOL_REQUIRE_GPU=1` to make that a failure.
#![cfg(feature = "cuda")]

use cust::memory::{CopyDestination, DeviceBuffer};
use kvpool::cuda::swa::{check_swa_signatures, DeviceSwaKvCache, DeviceSwaMap, SwaKvCacheView};
use kvpool::cuda::{CudaKvError, KvCacheView, KvDevice, Rows};
use kvpool::kv::swa::{SwaHostKv, SwaKvConfig, SwaLayout, SwaSource};
use kvpool::kv::{KvDtype, KvError};

mod kernel_common;

use kernel_common::{device_with_target as device, Rng};

fn cfg(
    layers: SwaLayout,
    head_num: u32,
    head_dim: u32,
    dtype: KvDtype,
    full_pages: usize,
    window_pages: usize,
    page_size: u32,
) -> SwaKvConfig {
    let ps = page_size as usize;
    SwaKvConfig {
        layers,
        head_num,
        head_dim,
        dtype,
        full_size: full_pages * ps,
        window_size: window_pages * ps,
        page_size,
    }
}

/// Layouts whose rows select vector widths 16, 8, 4, 2 and 1, with long rows (the
/// main loop and its tail) and short ones.
fn configs() -> Vec<SwaKvConfig> {
    vec![
        // gpt-oss shape: alternating, 2 x 64 bf16 = 256-byte rows (v16, 16 vectors).
        cfg(SwaLayout::alternating(4).unwrap(), 2, 64, KvDtype::Bf16, 24, 6, 16),
        // Gemma 3 pattern, 7 layers (full: 5), 2048-byte rows (v16, 128 vectors: the
        // unrolled main loop only).
        cfg(SwaLayout::gemma3(7).unwrap(), 4, 256, KvDtype::Bf16, 12, 5, 16),
        // 432-byte rows (v16, 27 vectors: main loop, then tail).
        cfg(SwaLayout::gemma3(12).unwrap(), 3, 72, KvDtype::Bf16, 10, 4, 8),
        // Unordered lists; 8-byte rows (v8).
        cfg(SwaLayout::new(5, &[4, 0], &[3, 1, 2]).unwrap(), 1, 4, KvDtype::F16, 20, 7, 8),
        // 12-byte rows (v4), page size 4.
        cfg(SwaLayout::every_nth_full(6, 3).unwrap(), 1, 3, KvDtype::F32, 30, 9, 4),
        // fp8 codes, 6-byte rows (v2), page size 1 (a token allocator's table).
        cfg(SwaLayout::alternating(3).unwrap(), 2, 3, KvDtype::Fp8E4m3, 200, 60, 1),
        // 5-byte rows (v1), page size 2.
        cfg(SwaLayout::from_window_flags(&[true, true, false, true]).unwrap(), 1, 5, KvDtype::Fp8E4m3, 50, 20, 2),
    ]
}

/// The host table and the window pages it uses, as a dual allocator would keep them.
struct Mapping {
    table: Vec<u32>,
    ps: usize,
    /// Window page of each full page (0: none).
    of_full: Vec<u32>,
    free_window: Vec<u32>,
}

impl Mapping {
    fn new(cfg: &SwaKvConfig) -> Mapping {
        let ps = cfg.page_size as usize;
        let full_pages = cfg.full_size / ps;
        let window_pages = (cfg.window_size / ps) as u32;
        Mapping {
            table: vec![0; cfg.map_len()],
            ps,
            of_full: vec![0; full_pages + 1],
            free_window: (1..=window_pages).collect(),
        }
    }

    fn set(&mut self, full: u32, window: u32) {
        self.of_full[full as usize] = window;
        for k in 0..self.ps {
            let w = if window == 0 { 0 } else { window as usize * self.ps + k };
            self.table[full as usize * self.ps + k] = w as u32;
        }
    }

    /// Map or unmap some random full pages; return the pages that changed.
    fn churn(&mut self, rng: &mut Rng) -> Vec<u32> {
        let full_pages = self.of_full.len() - 1;
        let mut changed = Vec::new();
        for _ in 0..1 + rng.below(full_pages as u64) {
            let p = 1 + rng.below(full_pages as u64) as u32;
            let w = self.of_full[p as usize];
            if w != 0 && rng.below(3) == 0 {
                self.free_window.push(w);
                self.set(p, 0);
                changed.push(p);
            } else if w == 0 && !self.free_window.is_empty() && rng.below(10) < 7 {
                let i = rng.below(self.free_window.len() as u64) as usize;
                let w = self.free_window.swap_remove(i);
                self.set(p, w);
                changed.push(p);
            }
        }
        changed
    }
}

fn fill_random(dev: &KvDevice, cache: &DeviceSwaKvCache, host: &mut SwaHostKv, rng: &mut Rng) {
    for buf in [&mut host.full_k, &mut host.full_v, &mut host.window_k, &mut host.window_v] {
        buf.iter_mut().for_each(|b| *b = rng.next() as u8);
    }
    for l in 0..host.config().layers.num_layers() {
        for v in [false, true] {
            let mut d = cache.layer(l, v).unwrap();
            d.copy_from(host.layer(l, v).unwrap()).unwrap();
        }
    }
    dev.synchronize().unwrap();
}

fn assert_same(cache: &DeviceSwaKvCache, host: &SwaHostKv, what: &str) {
    for l in 0..host.config().layers.num_layers() {
        for v in [false, true] {
            let d = cache.layer(l, v).unwrap();
            let mut got = vec![0u8; d.len()];
            d.copy_to(&mut got[..]).unwrap();
            let want = host.layer(l, v).unwrap();
            if got != want {
                let row = host.config().row_bytes();
                let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
                panic!(
                    "{what}: layer {l} {} differs first at row {} (byte {}) of {:?}",
                    if v { "V" } else { "K" },
                    first / row,
                    first % row,
                    host.config()
                );
            }
        }
    }
}

/// Dense K and V sources for `n` tokens of every layer, random bytes, with a random
/// padding after each row and each layer.
struct Sources {
    k: DeviceBuffer<u8>,
    v: DeviceBuffer<u8>,
    hk: Vec<u8>,
    hv: Vec<u8>,
    row_stride: usize,
    layer_stride: usize,
}

impl Sources {
    fn new(cfg: &SwaKvConfig, n: usize, rng: &mut Rng) -> Sources {
        let row = cfg.row_bytes();
        let pad = [0, 0, 16, 48, 8, 1][rng.below(6) as usize];
        let row_stride = row + pad;
        let layer_stride = n * row_stride + [0, 16, 4][rng.below(3) as usize];
        let len = cfg.layers.num_layers() as usize * layer_stride;
        let (hk, hv) = (rng.bytes(len), rng.bytes(len));
        Sources {
            k: DeviceBuffer::from_slice(&hk).unwrap(),
            v: DeviceBuffer::from_slice(&hv).unwrap(),
            hk,
            hv,
            row_stride,
            layer_stride,
        }
    }

    fn rows(&self) -> (Rows<'_, u8>, Rows<'_, u8>) {
        (Rows::new(&self.k, self.row_stride, self.layer_stride), Rows::new(&self.v, self.row_stride, self.layer_stride))
    }

    fn host(&self) -> (SwaSource<'_, u8>, SwaSource<'_, u8>) {
        let s = |data| SwaSource { data, row_stride: self.row_stride, layer_stride: self.layer_stride };
        (s(&self.hk), s(&self.hv))
    }
}

fn check_config(dev: &KvDevice, cfg: &SwaKvConfig, rng: &mut Rng) -> Result<(), CudaKvError> {
    let cache = DeviceSwaKvCache::new(dev, cfg.clone())?;
    let mut host = SwaHostKv::new(cfg.clone()).unwrap();
    fill_random(dev, &cache, &mut host, rng);
    // Staging for 3 pages: larger uploads are split.
    let mut map = DeviceSwaMap::new(dev, cfg, 3)?;
    let mut mapping = Mapping::new(cfg);
    let full_rows = cfg.map_len();
    let mut got_table = vec![0u32; full_rows];
    for round in 0..6 {
        let mut changed = mapping.churn(rng);
        if round % 2 == 0 {
            if let Some(&p) = changed.first() {
                changed.push(p); // a page named twice is harmless
            }
            map.upload_pages(dev, &mapping.table[..], &changed)?;
        } else {
            map.upload_range(dev, &mapping.table[..], 0..full_rows)?;
        }
        map.download(dev, &mut got_table)?;
        assert!(got_table == mapping.table, "device table differs after round {round} of {cfg:?}");

        let n = 1 + rng.below(full_rows.min(300) as u64) as usize;
        let loc = rng.distinct(n, full_rows);
        let src = Sources::new(cfg, n, rng);
        let slots = DeviceBuffer::from_slice(&loc)?;
        let (k, v) = src.rows();
        cache.set_kv(dev, &map, &slots, k, v)?;
        cache.take_error(dev)?;
        let (hk, hv) = src.host();
        let w = host.scatter(hk, hv, &loc, &mapping.table[..]).unwrap();
        assert_eq!(w.full, n * cfg.layers.full_layers().len());
        assert_same(&cache, &host, &format!("round {round} ({n} tokens, {} unmapped rows)", w.unmapped));
    }

    // A slot past the full rows (the last token): skipped in every layer and flagged;
    // the other tokens are written.
    let n = 1 + rng.below(full_rows.min(40) as u64) as usize;
    let mut loc = rng.distinct(n, full_rows);
    loc.push(full_rows as u32 + rng.below(5) as u32);
    let src = Sources::new(cfg, n + 1, rng);
    let slots = DeviceBuffer::from_slice(&loc)?;
    let (k, v) = src.rows();
    cache.set_kv(dev, &map, &slots, k, v)?;
    assert!(matches!(cache.take_error(dev), Err(CudaKvError::DeviceSlotOutOfRange)));
    cache.take_error(dev)?; // cleared
    let (hk, hv) = src.host();
    assert!(host.scatter(hk, hv, &loc, &mapping.table[..]).is_err()); // the reference refuses it
    host.scatter(hk, hv, &loc[..n], &mapping.table[..]).unwrap();
    assert_same(&cache, &host, "a slot past the full rows");

    // A mapped slot past the window rows: full layers are written, window layers skip
    // that token and flag it.
    let p = 1 + rng.below((cfg.full_size / cfg.page_size as usize) as u64) as usize;
    let bad_slot = p * cfg.page_size as usize;
    let good = mapping.table[bad_slot];
    let window_rows = cfg.window_size as u32 + cfg.page_size;
    mapping.table[bad_slot] = window_rows + rng.below(3) as u32;
    map.upload_range(dev, &mapping.table[..], bad_slot..bad_slot + 1)?;
    let mut loc: Vec<u32> =
        rng.distinct(8.min(full_rows), full_rows).into_iter().filter(|&s| s as usize != bad_slot).collect();
    loc.insert(loc.len() / 2, bad_slot as u32);
    let src = Sources::new(cfg, loc.len(), rng);
    let slots = DeviceBuffer::from_slice(&loc)?;
    let (k, v) = src.rows();
    cache.set_kv(dev, &map, &slots, k, v)?;
    assert!(matches!(cache.take_error(dev), Err(CudaKvError::DeviceSlotOutOfRange)));
    let (hk, hv) = src.host();
    assert!(matches!(
        host.scatter(hk, hv, &loc, &mapping.table[..]),
        Err(KvError::SlotOutOfRange { rows, .. }) if rows == window_rows as usize
    ));
    mapping.table[bad_slot] = 0;
    host.scatter(hk, hv, &loc, &mapping.table[..]).unwrap();
    assert_same(&cache, &host, "a mapped slot past the window rows");
    mapping.table[bad_slot] = good;
    map.upload_range(dev, &mapping.table[..], bad_slot..bad_slot + 1)?;

    // Refused before any launch: a table of another length, K and V strides that
    // differ, an element type of another size, sources too short. No tokens: nothing.
    let small = SwaKvConfig { full_size: cfg.full_size + cfg.page_size as usize, ..cfg.clone() };
    let other = DeviceSwaMap::new(dev, &small, 1)?;
    let src = Sources::new(cfg, 2, rng);
    let slots = DeviceBuffer::from_slice(&[0u32, 1])?;
    let (k, v) = src.rows();
    assert!(matches!(cache.set_kv(dev, &other, &slots, k, v), Err(CudaKvError::Kv(KvError::Shape { .. }))));
    let v2 = Rows::new(&src.v, src.row_stride, src.layer_stride - 1);
    assert!(matches!(cache.set_kv(dev, &map, &slots, k, v2), Err(CudaKvError::Kv(KvError::Format { .. }))));
    if cfg.dtype.bytes() != 4 && src.row_stride % 4 == 0 && src.layer_stride % 4 == 0 {
        let words = |b| Rows::<u8>::new(b, src.row_stride, src.layer_stride).cast::<u32>().unwrap();
        let r = cache.set_kv(dev, &map, &slots, words(&src.k), words(&src.v));
        assert!(matches!(r, Err(CudaKvError::Kv(KvError::Format { .. }))), "{r:?}");
    }
    let (layers, row) = (cfg.layers.num_layers() as usize, cfg.row_bytes());
    let short = DeviceBuffer::<u8>::zeroed(layers * 2 * row - 1)?;
    let s = Rows::new(&short, row, 2 * row);
    assert!(matches!(cache.set_kv(dev, &map, &slots, s, s), Err(CudaKvError::Kv(KvError::Shape { what: "k", .. }))));
    cache.set_kv(dev, &map, &slots.index(..0), s, s)?;
    cache.take_error(dev)?;
    assert_same(&cache, &host, "after the refused calls");
    // Upload checks: a page past the table, a host table of another length.
    let pages = (cfg.full_size / cfg.page_size as usize + 1) as u32;
    assert!(matches!(map.upload_pages(dev, &mapping.table[..], &[1, pages]), Err(CudaKvError::Kv(_))));
    assert!(matches!(map.upload_pages(dev, &mapping.table[1..], &[1]), Err(CudaKvError::Kv(_))));
    assert!(matches!(map.upload_range(dev, &mapping.table[..], 0..full_rows + 1), Err(CudaKvError::Kv(_))));
    Ok(())
}

#[test]
fn signatures_match_without_a_device() {
    check_swa_signatures().unwrap();
}

#[test]
fn mapped_scatter_matches_the_host_reference() {
    for target in [80, 90] {
        let Some(dev) = device(target) else { return };
        println!("device: {} (PTX sm_{})", dev.name().unwrap(), dev.ptx_target());
        let mut rng = Rng::new(0x5_3a_u64 ^ target as u64);
        for cfg in configs() {
            check_config(&dev, &cfg, &mut rng).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        }
    }
}

/// Layers at arbitrary addresses (one allocation per layer and buffer, at an 8-byte
/// offset, so 8-byte vectors): the view's table still covers every layer in one launch.
#[test]
fn views_of_separate_allocations() {
    let Some(dev) = device(90) else { return };
    let mut rng = Rng::new(77);
    let cfg = cfg(SwaLayout::gemma3(8).unwrap(), 2, 64, KvDtype::Bf16, 16, 4, 16);
    let (fc, wc) = (cfg.full_config(), cfg.window_config());
    let alloc = |c: &kvpool::kv::KvConfig| -> Vec<DeviceBuffer<u8>> {
        (0..2 * c.layer_num).map(|_| DeviceBuffer::<u8>::zeroed(c.layer_bytes() + 8).unwrap()).collect()
    };
    let (full_bufs, window_bufs) = (alloc(&fc), alloc(&wc));
    let addrs = |bufs: &[DeviceBuffer<u8>], v: usize| -> Vec<u64> {
        bufs.iter().skip(v).step_by(2).map(|b| b.as_device_ptr().as_raw() + 8).collect()
    };
    let row = cfg.row_bytes();
    // SAFETY: the buffers live until the end of the test, after the views and every
    // launch (the test synchronizes before reading them back).
    let full = unsafe { KvCacheView::from_raw(fc, &addrs(&full_bufs, 0), Some(&addrs(&full_bufs, 1)), row) }.unwrap();
    // SAFETY: as above.
    let window =
        unsafe { KvCacheView::from_raw(wc, &addrs(&window_bufs, 0), Some(&addrs(&window_bufs, 1)), row) }.unwrap();
    // SAFETY: as above: the memory behind both views outlives this view and its launches.
    let view = unsafe { SwaKvCacheView::from_views(&dev, cfg.clone(), &full, &window) }.unwrap();
    let wrong = SwaKvConfig { window_size: cfg.window_size + 16, ..cfg.clone() };
    // SAFETY: refused before anything is kept.
    assert!(unsafe { SwaKvCacheView::from_views(&dev, wrong, &full, &window) }.is_err());
    let mut map = DeviceSwaMap::new(&dev, &cfg, 64).unwrap();
    let mut mapping = Mapping::new(&cfg);
    for (f, w) in [(1, 2), (3, 1), (4, 4), (9, 3)] {
        mapping.set(f, w);
    }
    map.upload_pages(&dev, &mapping.table[..], &[1, 3, 4, 9]).unwrap();
    let mut host = SwaHostKv::new(cfg.clone()).unwrap();
    let n = 100;
    let loc = rng.distinct(n, cfg.map_len());
    let src = Sources::new(&cfg, n, &mut rng);
    let slots = DeviceBuffer::from_slice(&loc).unwrap();
    let (k, v) = src.rows();
    view.set_kv(&dev, &map, &slots, k, v).unwrap();
    view.take_error(&dev).unwrap();
    let (hk, hv) = src.host();
    let w = host.scatter(hk, hv, &loc, &mapping.table[..]).unwrap();
    assert!(w.window > 0 && w.unmapped > 0, "{w:?}");
    for l in 0..cfg.layers.num_layers() {
        let (kind, j) = cfg.layers.layer(l).unwrap();
        let bufs = if kind == kvpool::kv::swa::LayerKind::Full { &full_bufs } else { &window_bufs };
        for v in [false, true] {
            let b = &bufs[2 * j as usize + v as usize];
            let mut got = vec![0u8; b.len()];
            b.copy_to(&mut got[..]).unwrap();
            assert!(got[..8].iter().all(|&x| x == 0), "layer {l}: bytes before the layer were written");
            assert!(got[8..] == *host.layer(l, v).unwrap(), "layer {l} {} differs", if v { "V" } else { "K" });
        }
    }
}
