//! GPU test of the host-tier transfer kernels (`host_backup_v*`, `host_load_v*`)
//! against the host reference (`HostKvPool::backup` / `HostKvPool::load`): MHA and
//! MLA, f16 / bf16 / f32 / fp8, layer-first and page-first pools, every vector width
//! (16 down to 1 byte), random bytes everywhere (the device buffers and the whole pinned
//! pool), scattered random page pairs; after each transfer the whole pinned pool (and
//! every device layer buffer) is compared byte for byte with the reference, so a write
//! outside the named pages is caught. Layer ranges write only their layers; layer-wise
//! loads complete their events in layer order, and a layer's event alone implies its
//! bytes have landed (grouped layers of small batches and one layer per launch); refused calls (unallocated host pages,
//! pageable pools, other views) queue nothing. A ~5 GiB pinned pool checks pages past
//! 4 GiB in both layouts. The sm_80 and the sm_90 PTX.
//!
//! Without a CUDA device each device test prints "no CUDA device" and returns; set
//! `KVPOOL_REQUIRE_GPU=1` to make that a failure.
#![cfg(feature = "cuda")]

use cust::memory::{AsyncCopyDestination, CopyDestination};
use cust::stream::{Stream, StreamFlags};
use kvpool::cuda::host::{check_host_signatures, DeviceHostTransfer, HostTransferError, LayerEvents};
use kvpool::cuda::{DeviceKvCache, KvDevice, StreamRef};
use kvpool::kv::host::{HostKvConfig, HostKvError, HostKvPool, HostLayout, HostMemory, HostPageFault};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};

mod kernel_common;

use kernel_common::{device_with_target as device, Rng};

fn kv(layout: KvLayout, dtype: KvDtype, layers: u32, device_pages: usize, ps: u32) -> KvConfig {
    KvConfig { layout, dtype, layer_num: layers, size: device_pages * ps as usize, page_size: ps }
}

fn mha(h: u32, d: u32) -> KvLayout {
    KvLayout::Mha { head_num: h, head_dim: d }
}

fn mla(r: u32, p: u32) -> KvLayout {
    KvLayout::Mla { kv_lora_rank: r, qk_rope_head_dim: p }
}

/// Shapes whose page chunks select every vector width: `(config, expected width)`.
fn configs() -> Vec<(KvConfig, u32)> {
    vec![
        // Llama-like bf16, 2 x 64 heads: 256-byte rows, pages of 16 (4 KiB chunks, v16).
        (kv(mha(2, 64), KvDtype::Bf16, 3, 24, 16), 16),
        // DeepSeek MLA in fp8: 576-byte rows, pages of 64 (36 KiB chunks: 2 blocks a chunk).
        (kv(mla(512, 64), KvDtype::Fp8E4m3, 2, 10, 64), 16),
        // MLA bf16, token pages: 1152-byte chunks.
        (kv(mla(512, 64), KvDtype::Bf16, 2, 40, 1), 16),
        // f32, 3 x 1 heads: 12-byte rows, pages of 2 (24-byte chunks, v8).
        (kv(mha(1, 3), KvDtype::F32, 4, 30, 2), 8),
        // f16 rows of 6 bytes, pages of 2 (12-byte chunks, v4).
        (kv(mha(1, 3), KvDtype::F16, 2, 30, 2), 4),
        // fp8 rows of 6 bytes, token pages (v2).
        (kv(mha(2, 3), KvDtype::Fp8E4m3, 3, 50, 1), 2),
        // fp8 rows of 5 bytes, pages of 3 (15-byte chunks, v1), MLA.
        (kv(mla(3, 2), KvDtype::Fp8E4m3, 2, 20, 3), 1),
    ]
}

/// The device buffers as the host reference models them: index `layer * buffers + b`.
fn download(cache: &DeviceKvCache) -> Vec<Vec<u8>> {
    let cfg = *cache.config();
    let mut out = Vec::new();
    for l in 0..cfg.layer_num {
        let mut k = vec![0u8; cfg.layer_bytes()];
        cache.k_layer(l).unwrap().copy_to(&mut k[..]).unwrap();
        out.push(k);
        if let Some(v) = cache.v_layer(l).unwrap() {
            let mut b = vec![0u8; cfg.layer_bytes()];
            v.copy_to(&mut b[..]).unwrap();
            out.push(b);
        }
    }
    out
}

fn upload(cache: &DeviceKvCache, model: &[Vec<u8>]) {
    let cfg = *cache.config();
    let b = cfg.layout.buffers();
    for l in 0..cfg.layer_num {
        cache.k_layer(l).unwrap().copy_from(&model[l as usize * b][..]).unwrap();
        if let Some(mut v) = cache.v_layer(l).unwrap() {
            v.copy_from(&model[l as usize * b + 1][..]).unwrap();
        }
    }
}

fn random_model(cfg: &KvConfig, rng: &mut Rng) -> Vec<Vec<u8>> {
    (0..cfg.layer_num as usize * cfg.layout.buffers()).map(|_| rng.bytes(cfg.layer_bytes())).collect()
}

fn refs(m: &[Vec<u8>]) -> Vec<&[u8]> {
    m.iter().map(|b| &b[..]).collect()
}

fn muts(m: &mut [Vec<u8>]) -> Vec<&mut [u8]> {
    m.iter_mut().map(|b| &mut b[..]).collect()
}

/// `n` random distinct device pages (1..=device_pages) and `n` random distinct host
/// pages (allocated: the whole pool is).
fn pairs(rng: &mut Rng, n: usize, device_pages: usize, host_pages: usize) -> (Vec<u32>, Vec<u32>) {
    let d = rng.distinct(n, device_pages).into_iter().map(|p| p + 1).collect();
    let h = rng.distinct(n, host_pages).into_iter().map(|p| p + 1).collect();
    (d, h)
}

#[test]
fn launchers_match_the_generated_kernels() {
    check_host_signatures().unwrap();
}

fn kernels_match_the_reference_on(dev: &KvDevice, seed: u64) {
    let mut rng = Rng::new(seed);
    for (kvc, want_vec) in configs() {
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let what = format!("{kvc:?} {layout:?} sm_{}", dev.ptx_target());
            let cfg = HostKvConfig::with_ratio(kvc, 1.5, layout).unwrap();
            let cache = DeviceKvCache::new(kvc).unwrap();
            let mut pool = HostKvPool::new(cfg).unwrap();
            assert_eq!(pool.memory(), HostMemory::Pinned);
            let mut reference = HostKvPool::pageable(cfg).unwrap();
            let noise = rng.bytes(cfg.total_bytes());
            pool.as_bytes_mut().copy_from_slice(&noise);
            reference.as_bytes_mut().copy_from_slice(&noise);
            let mut all = vec![0u32; cfg.host_pages];
            pool.alloc_pages(&mut all).unwrap();
            reference.alloc_pages(&mut all).unwrap();
            // Small batches so that some calls split (max_pages 5).
            let mut xfer = DeviceHostTransfer::new(dev, &cache, &cfg, 5).unwrap();
            assert_eq!(xfer.vector_bytes(), want_vec, "{what}");
            let (dp, hp) = (cfg.device_pages(), cfg.host_pages);

            for round in 0..3 {
                // Backup: scattered device pages to scattered host pages.
                let mut model = random_model(&kvc, &mut rng);
                upload(&cache, &model);
                let n = 1 + rng.below(dp.min(12) as u64) as usize;
                let (d, h) = pairs(&mut rng, n, dp, hp);
                // SAFETY: the pool is not touched until the stream is synchronized below.
                unsafe { xfer.backup(dev, &cache, &pool, &d, &h) }.unwrap();
                xfer.take_error(dev).unwrap();
                reference.backup(&refs(&model), &d, &h).unwrap();
                assert!(pool.as_bytes() == reference.as_bytes(), "{what} round {round}: backup differs");

                // Load a random layer range of scattered host pages into scattered device pages.
                let n = 1 + rng.below(dp.min(12) as u64) as usize;
                let (d, h) = pairs(&mut rng, n, dp, hp);
                let a = rng.below(kvc.layer_num as u64 + 1) as u32;
                let b = a + rng.below((kvc.layer_num - a) as u64 + 1) as u32;
                // SAFETY: as above.
                unsafe { xfer.load_layers(dev, &cache, &pool, &h, &d, a..b) }.unwrap();
                xfer.take_error(dev).unwrap();
                reference.load(&mut muts(&mut model), &h, &d, a..b).unwrap();
                assert!(download(&cache) == model, "{what} round {round}: load of layers {a}..{b} differs");

                // Layer by layer, with events.
                let n = 1 + rng.below(dp.min(12) as u64) as usize;
                let (d, h) = pairs(&mut rng, n, dp, hp);
                let events = LayerEvents::new(kvc.layer_num).unwrap();
                // SAFETY: as above.
                unsafe { xfer.load_layerwise(dev, &cache, &pool, &h, &d, &events) }.unwrap();
                xfer.take_error(dev).unwrap();
                for l in 0..kvc.layer_num {
                    assert!(events.is_done(l).unwrap());
                }
                reference.load(&mut muts(&mut model), &h, &d, 0..kvc.layer_num).unwrap();
                assert!(download(&cache) == model, "{what} round {round}: layer-wise load differs");
            }
        }
    }
}

#[test]
fn kernels_match_the_reference_sm90() {
    let Some(dev) = device(90) else { return };
    println!("device: {} (sm_{} PTX)", dev.name().unwrap(), dev.ptx_target());
    kernels_match_the_reference_on(&dev, 1);
}

#[test]
fn kernels_match_the_reference_sm80() {
    let Some(dev) = device(80) else { return };
    kernels_match_the_reference_on(&dev, 2);
}

#[test]
fn refused_calls_queue_nothing() {
    let Some(dev) = device(90) else { return };
    let mut rng = Rng::new(3);
    let kvc = kv(mha(2, 64), KvDtype::Bf16, 2, 16, 4);
    let cfg = HostKvConfig { kv: kvc, host_pages: 8, layout: HostLayout::PageFirst };
    let cache = DeviceKvCache::new(kvc).unwrap();
    let other = DeviceKvCache::new(kvc).unwrap();
    let mut pool = HostKvPool::new(cfg).unwrap();
    let noise = rng.bytes(cfg.total_bytes());
    pool.as_bytes_mut().copy_from_slice(&noise);
    let mut hp = [0u32; 4];
    pool.alloc_pages(&mut hp).unwrap(); // 1..=4; 5..=8 free
    let model = random_model(&kvc, &mut rng);
    upload(&cache, &model);
    let mut xfer = DeviceHostTransfer::new(&dev, &cache, &cfg, 16).unwrap();
    let events = LayerEvents::new(2).unwrap();
    let not_allocated = |p| HostKvError::HostPage { page: p, fault: HostPageFault::NotAllocated };
    // SAFETY (every call below): the pool is read only after the stream synchronizes.
    let e = unsafe { xfer.backup(&dev, &cache, &pool, &[1, 2], &[1, 6]) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(ref h) if *h == not_allocated(6)), "{e}");
    let e = unsafe { xfer.load_layers(&dev, &cache, &pool, &[7], &[3], 0..2) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(ref h) if *h == not_allocated(7)), "{e}");
    let e = unsafe { xfer.load_layers(&dev, &cache, &pool, &[1], &[3], 1..3) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(HostKvError::Layers { .. })), "{e}");
    let e = unsafe { xfer.backup(&dev, &cache, &pool, &[0], &[1]) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(HostKvError::DevicePage { page: 0, pages: 16 })), "{e}");
    let e = unsafe { xfer.backup(&dev, &cache, &pool, &[17], &[1]) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(HostKvError::DevicePage { page: 17, .. })), "{e}");
    let e = unsafe { xfer.backup(&dev, &other, &pool, &[1], &[1]) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Mismatch(_)), "{e}");
    let e = unsafe { xfer.load_layerwise(&dev, &cache, &pool, &[1], &[2], &LayerEvents::new(3).unwrap()) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(HostKvError::Shape { what: "events", .. })), "{e}");
    let pageable = HostKvPool::pageable(cfg).unwrap();
    pageable.alloc_pages(&mut [0u32; 1]).unwrap();
    let e = unsafe { xfer.backup(&dev, &cache, &pageable, &[1], &[1]) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(HostKvError::Memory { needs: HostMemory::Pinned })), "{e}");
    let e = unsafe { xfer.load_layerwise(&dev, &cache, &pool, &[5], &[2], &events) }.unwrap_err();
    assert!(matches!(e, HostTransferError::Host(ref h) if *h == not_allocated(5)), "{e}");
    xfer.take_error(&dev).unwrap();
    assert!(pool.as_bytes() == &noise[..], "a refused call wrote host memory");
    assert!(download(&cache) == model, "a refused call wrote device memory");
}

#[test]
fn layerwise_events_complete_in_layer_order() {
    let Some(dev) = device(90) else { return };
    let mut rng = Rng::new(4);
    // 32 layers, 2 KiB rows, pages of 16: a page is 2 MiB over the layers; 256 pages
    // make a 512 MiB load, long enough to watch the events complete one by one.
    let kvc = kv(mha(8, 128), KvDtype::Bf16, 32, 512, 16);
    let cfg = HostKvConfig { kv: kvc, host_pages: 256, layout: HostLayout::LayerFirst };
    let cache = DeviceKvCache::new(kvc).unwrap();
    let mut pool = HostKvPool::new(cfg).unwrap();
    let noise = rng.bytes(cfg.total_bytes());
    pool.as_bytes_mut().copy_from_slice(&noise);
    let mut hp = vec![0u32; 256];
    pool.alloc_pages(&mut hp).unwrap();
    let dp: Vec<u32> = rng.distinct(256, 512).into_iter().map(|p| p + 1).collect();
    let mut model = random_model(&kvc, &mut rng);
    upload(&cache, &model);
    let mut xfer = DeviceHostTransfer::new(&dev, &cache, &cfg, 256).unwrap();
    let events = LayerEvents::new(32).unwrap();
    let waiter = Stream::new(StreamFlags::NON_BLOCKING, None).unwrap();
    // SAFETY: the pool is not touched until the streams are synchronized.
    unsafe { xfer.load_layerwise(&dev, &cache, &pool, &hp, &dp, &events) }.unwrap();
    // A second stream waits for the last layer; once it has run, every layer has.
    events.wait_on(31, StreamRef::from(&waiter)).unwrap();
    let mut polls = 0;
    let mut partial = 0;
    loop {
        let done: Vec<bool> = (0..32).map(|l| events.is_done(l).unwrap()).collect();
        let first_pending = done.iter().position(|&d| !d).unwrap_or(32);
        assert!(done[first_pending..].iter().all(|&d| !d), "events out of layer order: {done:?}");
        if (1..32).contains(&first_pending) {
            partial += 1;
        }
        polls += 1;
        if first_pending == 32 {
            break;
        }
    }
    waiter.synchronize().unwrap();
    xfer.take_error(&dev).unwrap();
    println!("layer-wise load: {polls} polls, {partial} saw some layers done and others not");
    pool.load(&mut muts(&mut model), &hp, &dp, 0..32).unwrap();
    assert!(download(&cache) == model, "the device differs from the host reference after the layer-wise load");
}

/// Each layer's event, once complete on its own, implies that layer's bytes have
/// landed: after `events.synchronize(l)` alone (later layers may still be loading), a
/// sample of layer `l`'s device pages is read on a non-blocking stream (so the read does
/// not wait for the loading stream) and compared with the pool. Batches where the
/// layers are grouped (24 pages: 1.5 MiB layers, groups of 3, the last one of 2; 16
/// pages split in launches of 8 pairs: groups of 8), one layer per launch forced for a
/// small batch (`set_layerwise_min_launch_bytes(0)`), and a large batch (256 pages, 16
/// MiB layers: one layer per launch). Then the whole device against the host reference.
#[test]
fn layerwise_event_implies_its_layer_landed() {
    let Some(dev) = device(90) else { return };
    let mut rng = Rng::new(7);
    // 32 layers, 8 KV heads x 128 bf16, pages of 16: 32 KiB chunks, 64 KiB a page per layer.
    let kvc = kv(mha(8, 128), KvDtype::Bf16, 32, 300, 16);
    let cache = DeviceKvCache::new(kvc).unwrap();
    let reader = Stream::new(StreamFlags::NON_BLOCKING, None).unwrap();
    let chunk = 16 * kvc.row_bytes();
    let mut got = cust::memory::LockedBuffer::new(&0u8, chunk).unwrap();
    // (pages, max_pages, layout, min launch bytes (None: the default), expected group)
    let cases = [
        (24usize, 24usize, HostLayout::LayerFirst, None, 3u32),
        (16, 8, HostLayout::PageFirst, None, 8),
        (16, 16, HostLayout::PageFirst, Some(0), 1),
        (256, 256, HostLayout::PageFirst, None, 1),
        (256, 256, HostLayout::LayerFirst, None, 1),
    ];
    for (n, max_pages, layout, min_bytes, want_group) in cases {
        let what = format!("{n} pages, {max_pages} a launch, {layout:?}, min {min_bytes:?}");
        let cfg = HostKvConfig { kv: kvc, host_pages: 256, layout };
        let mut pool = HostKvPool::new(cfg).unwrap();
        let noise = rng.bytes(cfg.total_bytes());
        pool.as_bytes_mut().copy_from_slice(&noise);
        let mut all = vec![0u32; 256];
        pool.alloc_pages(&mut all).unwrap();
        let hp: Vec<u32> = rng.distinct(n, 256).into_iter().map(|p| p + 1).collect();
        let dp: Vec<u32> = rng.distinct(n, 300).into_iter().map(|p| p + 1).collect();
        let mut model = random_model(&kvc, &mut rng);
        upload(&cache, &model);
        let mut xfer = DeviceHostTransfer::new(&dev, &cache, &cfg, max_pages).unwrap();
        if let Some(b) = min_bytes {
            xfer.set_layerwise_min_launch_bytes(b);
        }
        assert_eq!(xfer.layerwise_group(n), want_group, "{what}");
        let events = LayerEvents::new(32).unwrap();
        // SAFETY: the GPU only reads the pool, which the host only reads until the
        // stream is synchronized; the device pages `dp` are read below only on the
        // reader stream after their layer's event completed.
        unsafe { xfer.load_layerwise(&dev, &cache, &pool, &hp, &dp, &events) }.unwrap();
        let mut early = 0;
        for l in 0..32u32 {
            events.synchronize(l).unwrap();
            if !events.is_done(31).unwrap() {
                early += 1;
            }
            for k in [0, n - 1, l as usize % n] {
                for b in 0..2u32 {
                    let layer = if b == 0 { cache.k_layer(l).unwrap() } else { cache.v_layer(l).unwrap().unwrap() };
                    let src = layer.index(dp[k] as usize * chunk..(dp[k] as usize + 1) * chunk);
                    // SAFETY: `got` is pinned, `chunk` bytes long like `src`, and not
                    // touched until `reader` is synchronized; the layer outlives it.
                    unsafe { src.async_copy_to(got.as_mut_slice(), &reader) }.unwrap();
                    reader.synchronize().unwrap();
                    assert!(
                        got.as_slice() == pool.page_rows(hp[k], l, b).unwrap(),
                        "{what}: layer {l} buffer {b} of device page {} not landed when its event completed",
                        dp[k]
                    );
                }
            }
        }
        xfer.take_error(&dev).unwrap();
        println!("{what}: group {want_group}, {early} of 32 layers checked before the last event completed");
        pool.load(&mut muts(&mut model), &hp, &dp, 0..32).unwrap();
        assert!(download(&cache) == model, "{what}: the device differs from the host reference");
    }
}

/// A ~5 GiB pinned pool: backups to and loads from pages whose bytes lie past 4 GiB.
#[test]
fn pages_past_4_gib() {
    let Some(dev) = device(90) else { return };
    let mut rng = Rng::new(6);
    // 2 layers, K and V, 2 KiB rows, pages of 16: 32 KiB chunks, 128 KiB a page;
    // 40 000 host pages are 4.9 GiB.
    let kvc = kv(mha(8, 128), KvDtype::Bf16, 2, 64, 16);
    let cache = DeviceKvCache::new(kvc).unwrap();
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let cfg = HostKvConfig { kv: kvc, host_pages: 40_000, layout };
        let pool = HostKvPool::new(cfg).unwrap();
        assert!(cfg.total_bytes() > 4 << 30);
        let mut all = vec![0u32; cfg.host_pages];
        pool.alloc_pages(&mut all).unwrap();
        // High pages (and, layer-first, every layer buffer past the first few) lie past
        // 4 GiB; also a few low ones.
        let hp: Vec<u32> = vec![40_000, 39_999, 35_123, 33_000, 12, 1];
        let dp: Vec<u32> = vec![64, 3, 17, 40, 1, 22];
        let past = hp.iter().filter(|&&h| cfg.offset(h, 1, 1, 0).unwrap() >= 4 << 30).count();
        assert!(past >= 4, "{layout:?}: only {past} pages past 4 GiB");
        let model = random_model(&kvc, &mut rng);
        upload(&cache, &model);
        let mut xfer = DeviceHostTransfer::new(&dev, &cache, &cfg, 64).unwrap();
        // SAFETY: the pool is read only after the stream synchronizes.
        unsafe { xfer.backup(&dev, &cache, &pool, &dp, &hp) }.unwrap();
        xfer.take_error(&dev).unwrap();
        let chunk = cfg.chunk_bytes();
        for (&d, &h) in dp.iter().zip(&hp) {
            for l in 0..2 {
                for b in 0..2 {
                    let lb = (l * 2 + b) as usize;
                    assert!(
                        pool.page_rows(h, l, b).unwrap() == &model[lb][d as usize * chunk..][..chunk],
                        "{layout:?}: host page {h} layer {l} buffer {b}"
                    );
                }
            }
        }
        // Neighbours untouched (the pool starts zeroed).
        for h in [39_998u32, 35_122, 35_124, 2] {
            for (l, b) in [(0, 0), (1, 1)] {
                assert!(pool.page_rows(h, l, b).unwrap().iter().all(|&x| x == 0), "{layout:?}: page {h} written");
            }
        }
        // Back again, into other device pages of a re-randomized cache.
        let mut now = random_model(&kvc, &mut rng);
        upload(&cache, &now);
        let to: Vec<u32> = vec![5, 6, 7, 8, 9, 10];
        // SAFETY: as above.
        unsafe { xfer.load_layers(&dev, &cache, &pool, &hp, &to, 0..2) }.unwrap();
        xfer.take_error(&dev).unwrap();
        pool.load(&mut muts(&mut now), &hp, &to, 0..2).unwrap();
        assert!(download(&cache) == now, "{layout:?}: load from past 4 GiB differs");
        drop(xfer);
    }
}
