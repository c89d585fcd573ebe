//! The host-tier transfers (issue 11): `host_backup_v*` / `host_load_v*` moving N
//! scattered pages between the device KV cache and a pinned, device-mapped
//! `HostKvPool`, against `cuMemcpyAsync` of the same bytes as one contiguous pinned
//! copy (the copy engine's bandwidth over the host link: the practical ceiling) and
//! against one `cuMemcpyAsync` per page chunk (what a transfer without kernels does
//! for scattered pages); and a layer-wise load of a 32-layer batch (32 events, one
//! launch per group of layers) against one bulk load of the same pages: the default
//! grouping (`LAYERWISE_MIN_LAUNCH_BYTES`, 4 MiB a launch), an 8 MiB threshold, and
//! the old path, one launch per layer (`set_layerwise_min_launch_bytes(0)`), all in
//! the same run.
//!
//! Goals: kernels at least 80% of the contiguous memcpy's bandwidth with scattered
//! pages; layer-wise load within 10% of the bulk load.
//!
//! `cargo bench --features cuda --bench host_gpu` (prints markdown tables; without a
//! device it says so and exits 0). `KVPOOL_HOST_BENCH=b` runs section (b) only. Times are CUDA-event medians of 15 samples of
//! back-to-back transfers on the device's stream, after a warm-up; device pages and
//! host pages are drawn at random (scattered on both sides), device buffers and the
//! pool hold random bytes, batches are hundreds of MiB (far past L2). "GB/s" counts
//! the bytes moved across the link once (a page's bytes, not read plus written).
//! After timing, the last transfer is checked against the host reference.

use cust::event::{Event, EventFlags};
use cust::memory::{CopyDestination, DeviceBuffer, LockedBuffer};
use cust::sys::{cuMemcpyAsync, cudaError_enum};
use kvpool::cuda::host::{DeviceHostTransfer, LayerEvents, LAYERWISE_MIN_LAUNCH_BYTES};
use kvpool::cuda::{DeviceKvCache, KvDevice};
use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// `n` distinct values of `1..=m`, shuffled.
    fn distinct(&mut self, n: usize, m: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (1..=m as u32).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v.truncate(n);
        v
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let x = self.next().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
    }
}

fn median_us(dev: &KvDevice, reps: usize, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    for _ in 0..3 {
        op()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(15);
    for _ in 0..15 {
        start.record(dev.stream())?;
        for _ in 0..reps {
            op()?;
        }
        stop.record(dev.stream())?;
        stop.synchronize()?;
        times.push(stop.elapsed_time_f32(&start)? as f64 * 1000.0 / reps as f64);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(times[times.len() / 2])
}

fn memcpy(dev: &KvDevice, dst: u64, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: callers pass two live allocations (device memory or pinned host memory,
    // both addressable under unified addressing) of at least `bytes` bytes each, which
    // outlive the stream's work (the timer synchronizes before anything is dropped).
    let r = unsafe { cuMemcpyAsync(dst, src, bytes, dev.stream().as_inner()) };
    if r != cudaError_enum::CUDA_SUCCESS {
        return Err(format!("cuMemcpyAsync: {r:?}").into());
    }
    Ok(())
}

struct Model {
    name: &'static str,
    kv: KvConfig,
}

fn gbps(bytes: usize, us: f64) -> f64 {
    bytes as f64 / us / 1e3
}

/// Kernel backup and load of `n` scattered pages vs the contiguous memcpy and the
/// per-chunk memcpy, for one layout.
#[allow(clippy::too_many_arguments)]
fn scattered(
    dev: &KvDevice,
    model: &Model,
    cache: &DeviceKvCache,
    pool: &HostKvPool,
    n: usize,
    rng: &mut Rng,
    contiguous: (&DeviceBuffer<u8>, &LockedBuffer<u8>),
) -> Result<(f64, f64)> {
    let cfg = *pool.config();
    let (layout, host_pages) = (cfg.layout, cfg.host_pages);
    let dp = rng.distinct(n, cfg.device_pages());
    let hp = rng.distinct(n, host_pages);
    let mut xfer = DeviceHostTransfer::new(dev, cache, &cfg, n)?;
    let bytes = n * cfg.page_bytes();
    let reps = ((1usize << 30) / bytes).clamp(1, 10);
    // SAFETY (both closures): the pool is read on the host only after the timer and
    // `take_error` synchronize the stream; it outlives every queued transfer.
    let backup = median_us(dev, reps, || Ok(unsafe { xfer.backup(dev, cache, pool, &dp, &hp) }?))?;
    let load =
        median_us(dev, reps, || Ok(unsafe { xfer.load_layers(dev, cache, pool, &hp, &dp, 0..model.kv.layer_num) }?))?;
    xfer.take_error(dev)?;
    let (dbuf, hbuf) = contiguous;
    let (d, h) = (dbuf.as_device_ptr().as_raw(), hbuf.as_ptr() as u64);
    let d2h = median_us(dev, reps, || memcpy(dev, h, d, bytes))?;
    let h2d = median_us(dev, reps, || memcpy(dev, d, h, bytes))?;
    // One cuMemcpyAsync per page chunk (layers x buffers per page), scattered like the
    // kernels' pairs: what a transfer without kernels issues. Fewer samples: it is slow.
    let chunk = cfg.chunk_bytes();
    let lbs = model.kv.layer_num * model.kv.layout.buffers() as u32;
    let base = pool.as_bytes().as_ptr() as u64;
    let dev_chunk = |lb: u32, page: u32| -> Result<u64> {
        let (l, b) = (lb / model.kv.layout.buffers() as u32, lb % model.kv.layout.buffers() as u32);
        let layer = if b == 0 { cache.k_layer(l)? } else { cache.v_layer(l)?.expect("MHA") };
        Ok(layer.as_device_ptr().as_raw() + page as u64 * chunk as u64)
    };
    let per_chunk = (n * lbs as usize <= 20_000).then(|| {
        median_us(dev, 1, || {
            for (&dpg, &hpg) in dp.iter().zip(&hp) {
                for lb in 0..lbs {
                    let (l, b) = (lb / model.kv.layout.buffers() as u32, lb % model.kv.layout.buffers() as u32);
                    let off = cfg.offset(hpg, l, b, 0).expect("in range") as u64;
                    memcpy(dev, base + off, dev_chunk(lb, dpg)?, chunk)?;
                }
            }
            Ok(())
        })
    });
    let per_chunk = match per_chunk.transpose()? {
        Some(us) => format!("{us:.0} | {:.1}", gbps(bytes, us)),
        None => "- | -".to_string(),
    };
    let mib = bytes >> 20;
    println!(
        "| {} | {layout:?} | {chunk} | {n} | {mib} | {backup:.0} | {:.1} | {d2h:.0} | {:.1} | **{:.0}%** | {per_chunk} | {load:.0} | {:.1} | {h2d:.0} | {:.1} | **{:.0}%** |",
        model.name,
        gbps(bytes, backup),
        gbps(bytes, d2h),
        100.0 * d2h / backup,
        gbps(bytes, load),
        gbps(bytes, h2d),
        100.0 * h2d / load,
    );
    // The last load left host pages `hp` in device pages `dp`: check a sample.
    for i in [0, n / 2, n - 1] {
        for lb in [0, lbs - 1] {
            let (l, b) = (lb / model.kv.layout.buffers() as u32, lb % model.kv.layout.buffers() as u32);
            let layer = if b == 0 { cache.k_layer(l)? } else { cache.v_layer(l)?.expect("MHA") };
            let mut got = vec![0u8; chunk];
            layer.index(dp[i] as usize * chunk..(dp[i] as usize + 1) * chunk).copy_to(&mut got[..])?;
            assert!(got == pool.page_rows(hp[i], l, b)?, "device page {} layer buffer {lb}", dp[i]);
        }
    }
    Ok((100.0 * d2h / backup, 100.0 * h2d / load))
}

/// Layer-wise load (32 events; one launch per layer, the default groups, 8 MiB groups)
/// vs one bulk load, timed twice (its spread is the noise floor).
fn layerwise_row(
    dev: &KvDevice,
    model: &Model,
    cache: &DeviceKvCache,
    pool: &HostKvPool,
    n: usize,
    rng: &mut Rng,
) -> Result<(String, f64, f64)> {
    let cfg = *pool.config();
    let (layout, host_pages) = (cfg.layout, cfg.host_pages);
    let dp = rng.distinct(n, cfg.device_pages());
    let hp = rng.distinct(n, host_pages);
    let mut xfer = DeviceHostTransfer::new(dev, cache, &cfg, n)?;
    let events = LayerEvents::new(model.kv.layer_num)?;
    let bytes = n * cfg.page_bytes();
    let reps = ((1usize << 30) / bytes).clamp(1, 10);
    let layers = model.kv.layer_num;
    // SAFETY (every closure): the pool is not touched on the host while transfers run.
    let bulk = median_us(dev, reps, || Ok(unsafe { xfer.load_layers(dev, cache, pool, &hp, &dp, 0..layers) }?))?;
    let layerwise = |xfer: &mut DeviceHostTransfer, min_bytes: usize| -> Result<(u32, f64)> {
        xfer.set_layerwise_min_launch_bytes(min_bytes);
        let us = median_us(dev, reps, || Ok(unsafe { xfer.load_layerwise(dev, cache, pool, &hp, &dp, &events) }?))?;
        Ok((xfer.layerwise_group(n), us))
    };
    let (_, per_layer) = layerwise(&mut xfer, 0)?;
    let (g4, grouped) = layerwise(&mut xfer, LAYERWISE_MIN_LAUNCH_BYTES)?;
    let (g8, grouped8) = layerwise(&mut xfer, 8 << 20)?;
    let bulk2 = median_us(dev, reps, || Ok(unsafe { xfer.load_layers(dev, cache, pool, &hp, &dp, 0..layers) }?))?;
    xfer.take_error(dev)?;
    // The last transfer was a bulk load, the one before a layer-wise one of the same
    // pages: check a sample against the pool.
    let chunk = cfg.chunk_bytes();
    for i in [0, n / 2, n - 1] {
        for l in [0, layers / 2, layers - 1] {
            for b in 0..model.kv.layout.buffers() as u32 {
                let layer = if b == 0 { cache.k_layer(l)? } else { cache.v_layer(l)?.expect("MHA") };
                let mut got = vec![0u8; chunk];
                layer.index(dp[i] as usize * chunk..(dp[i] as usize + 1) * chunk).copy_to(&mut got[..])?;
                assert!(got == pool.page_rows(hp[i], l, b)?, "device page {} layer {l} buffer {b}", dp[i]);
            }
        }
    }
    let over = |us: f64| 100.0 * (us / bulk - 1.0);
    let row = format!(
        "| {} | {layout:?} | {n} | {} | {bulk:.0} | {bulk2:.0} | {per_layer:.0} | {:.1}% | {g4} | {grouped:.0} | **{:.1}%** | {g8} | {grouped8:.0} | {:.1}% |",
        model.name,
        bytes >> 20,
        over(per_layer),
        over(grouped),
        over(grouped8),
    );
    Ok((row, per_layer / bulk, grouped / bulk))
}

fn main() -> Result<()> {
    let dev = match KvDevice::count() {
        Ok(n) if n > 0 => KvDevice::new(0)?,
        other => {
            println!("no CUDA device ({other:?}): nothing to measure");
            return Ok(());
        }
    };
    println!("device: {} (PTX sm_{})\n", dev.name()?, dev.ptx_target());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let models = [
        // Llama-3-8B: 32 layers, 8 KV heads x 128, bf16: 2 KiB rows, 128 KiB a token.
        Model {
            name: "llama3-8b ps16",
            kv: KvConfig {
                layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
                dtype: KvDtype::Bf16,
                layer_num: 32,
                size: 2048 * 16,
                page_size: 16,
            },
        },
        // The same model with token pages: 2 KiB chunks, the smallest scattered unit.
        Model {
            name: "llama3-8b ps1",
            kv: KvConfig {
                layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
                dtype: KvDtype::Bf16,
                layer_num: 32,
                size: 16384,
                page_size: 1,
            },
        },
    ];
    // One contiguous pair for the memcpy baseline, as large as the largest batch.
    let max_bytes = 256 * models[0].kv.page_size as usize * models[0].kv.row_bytes() * 64;
    let dbuf = DeviceBuffer::<u8>::zeroed(max_bytes)?;
    let mut hbuf = LockedBuffer::new(&0u8, max_bytes)?;
    rng.fill(hbuf.as_mut_slice());
    let mut d = dbuf.index(..);
    d.copy_from(hbuf.as_slice())?;

    let only_b = std::env::var("KVPOOL_HOST_BENCH").is_ok_and(|v| v == "b");
    if !only_b {
        println!("### (a) Scattered pages: kernels vs one contiguous pinned cuMemcpyAsync (sm_{})\n", dev.ptx_target());
        println!("| model | layout | chunk B | pages | MiB | backup us | backup GB/s | memcpy D2H us | D2H GB/s | backup vs memcpy | per-chunk memcpy D2H us | per-chunk GB/s | load us | load GB/s | memcpy H2D us | H2D GB/s | load vs memcpy |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    }
    let mut worst = f64::INFINITY;
    let mut lw_rows = Vec::new();
    let runs = if only_b {
        &[(0usize, &[][..], 1024)][..]
    } else {
        &[(0, &[64usize, 256][..], 1024), (1, &[4096][..], 16384)]
    };
    for &(mi, batches, host_pages) in runs {
        let m = &models[mi];
        let cache = DeviceKvCache::new(m.kv)?;
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let cfg = HostKvConfig { kv: m.kv, host_pages, layout };
            let mut pool = HostKvPool::new(cfg)?;
            rng.fill(pool.as_bytes_mut());
            pool.alloc_pages(&mut vec![0u32; host_pages])?;
            for &n in batches.iter().filter(|_| !only_b) {
                let (b, l) = scattered(&dev, m, &cache, &pool, n, &mut rng, (&dbuf, &hbuf))?;
                worst = worst.min(b).min(l);
            }
            if mi == 0 {
                for n in [16usize, 64, 256] {
                    lw_rows.push(layerwise_row(&dev, m, &cache, &pool, n, &mut rng)?);
                }
            }
        }
    }
    if !only_b {
        println!("\nworst kernel / memcpy bandwidth ratio: {worst:.0}% (goal >= 80%)\n");
    }

    println!("### (b) Layer-wise load (32 events) vs one bulk load (sm_{})\n", dev.ptx_target());
    println!("| model | layout | pages | MiB | bulk us | bulk again us | 1 layer a launch us | overhead | group (4 MiB) | grouped us | overhead | group (8 MiB) | grouped us | overhead |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut worst_old, mut worst_new): (f64, f64) = (0.0, 0.0);
    for (row, old, new) in &lw_rows {
        println!("{row}");
        worst_old = worst_old.max(*old);
        worst_new = worst_new.max(*new);
    }
    println!("\nworst layer-wise / bulk time (goal <= 1.10x): default groups {worst_new:.3}x, one layer a launch {worst_old:.3}x");
    Ok(())
}
