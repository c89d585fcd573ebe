//! The SWA mapped scatter (`swa_scatter_v16`: K and V of every layer, window layers
//! through the full-to-window mapping, one launch) against the plain all-layers
//! scatter of the same bytes into one pool (`kv_scatter_copy_v16`, `Layers::All`, one
//! launch) and a device-to-device memcpy of the same bytes; and the cost of keeping
//! the device mapping table in sync (`DeviceSwaMap::upload_pages`). Issue 10's goal:
//! the mapped scatter within 5% of the plain scatter's bandwidth.
//!
//! `cargo bench --features cuda --bench swa_gpu` (prints markdown tables; without a
//! device it says so and exits 0). Times are CUDA-event medians of 15 samples of
//! back-to-back launches on the device's stream, after a warm-up; sources rotate among
//! sets of at least 256 MiB in total (L2 is 50-60 MB) filled with random bytes; a
//! batch's slots are whole pages (a prefill), the pages in random order, every full
//! page mapped to a random window page (so the mapped scatter moves exactly the plain
//! scatter's bytes), except in the rows marked "half unmapped". "GB/s" counts bytes
//! read plus bytes written.
use std::time::Instant;

use cust::event::{Event, EventFlags};
use cust::memory::{AsyncCopyDestination, CopyDestination, DeviceBuffer, DeviceSlice};
use kvpool::cuda::swa::{DeviceSwaKvCache, DeviceSwaMap};
use kvpool::cuda::{DeviceKvCache, KvDevice, Layers, Rows};
use kvpool::kv::swa::{SwaKvConfig, SwaLayout};
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
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// `n` distinct values of `lo..hi`, shuffled.
    fn distinct(&mut self, n: usize, lo: u32, hi: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (lo..hi).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
        v.truncate(n);
        v
    }
}

fn median_us(dev: &KvDevice, reps: usize, mut op: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    for i in 0..reps.clamp(3, 10) {
        op(i)?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(15);
    let mut k = 0;
    for _ in 0..15 {
        start.record(dev.stream())?;
        for _ in 0..reps {
            op(k)?;
            k += 1;
        }
        stop.record(dev.stream())?;
        stop.synchronize()?;
        times.push(stop.elapsed_time_f32(&start)? as f64 * 1000.0 / reps as f64);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(times[times.len() / 2])
}

const ROTATE_BYTES: usize = 256 << 20;

struct Case {
    name: &'static str,
    cfg: SwaKvConfig,
    tokens: &'static [usize],
}

#[allow(clippy::too_many_arguments)]
fn row(
    dev: &KvDevice,
    cache: &DeviceSwaKvCache,
    plain: &DeviceKvCache,
    map: &mut DeviceSwaMap,
    case: &Case,
    tokens: usize,
    half_unmapped: bool,
    rng: &mut Rng,
) -> Result<()> {
    let cfg = &case.cfg;
    let ps = cfg.page_size as usize;
    let (layers, row) = (cfg.layers.num_layers() as usize, cfg.row_bytes());
    let pages = tokens / ps;
    let full_pages = rng.distinct(pages, 1, (cfg.full_size / ps) as u32 + 1);
    let window_pages = rng.distinct(pages, 1, (cfg.window_size / ps) as u32 + 1);
    let mut table = vec![0u32; cfg.map_len()];
    let mut mapped_pages = 0;
    for (i, (&f, &w)) in full_pages.iter().zip(&window_pages).enumerate() {
        if half_unmapped && i % 2 == 1 {
            continue;
        }
        mapped_pages += 1;
        for k in 0..ps {
            table[f as usize * ps + k] = (w as usize * ps + k) as u32;
        }
    }
    map.upload_pages(dev, &table[..], &full_pages)?;
    let loc: Vec<u32> = full_pages.iter().flat_map(|&p| (0..ps as u32).map(move |k| p * ps as u32 + k)).collect();
    let slots = DeviceBuffer::from_slice(&loc)?;
    let per_buffer = layers * tokens * row; // K (or V) source bytes, all layers
    let sets = (ROTATE_BYTES / (2 * per_buffer)).clamp(1, 8);
    let host: Vec<u8> = (0..per_buffer).map(|_| rng.next() as u8).collect();
    let mut srcs = Vec::new();
    for _ in 0..sets {
        srcs.push((DeviceBuffer::from_slice(&host)?, DeviceBuffer::from_slice(&host)?));
    }
    let rows = |b| Rows::new(b, row, tokens * row);
    let plain_moved = 2 * 2 * per_buffer; // K and V, read + written
    let window_layers = cfg.layers.window_layers().len();
    let skipped = window_layers * (pages - mapped_pages) * ps * row * 2 * 2;
    let mapped_moved = plain_moved - skipped;
    let reps = ((1usize << 30) / plain_moved).clamp(3, 50);
    let mapped_us = median_us(dev, reps, |i| {
        let (k, v) = &srcs[i % sets];
        Ok(cache.set_kv(dev, &*map, &slots, rows(k), rows(v))?)
    })?;
    cache.take_error(dev)?;
    let plain_us = median_us(dev, reps, |i| {
        let (k, v) = &srcs[i % sets];
        Ok(plain.set_kv(dev, Layers::All, &slots, rows(k), rows(v), None, (1.0, 1.0))?)
    })?;
    plain.take_error(dev)?;
    // One copy that reads and writes what the plain scatter reads and writes.
    let copy_len = plain_moved / 2;
    let mut pairs = Vec::new();
    for _ in 0..sets {
        let src = DeviceBuffer::<u8>::zeroed(copy_len)?;
        src.index(..per_buffer).copy_from(&host[..])?;
        src.index(per_buffer..).copy_from(&host[..])?;
        pairs.push((src, DeviceBuffer::<u8>::zeroed(copy_len)?));
    }
    let memcpy_us = median_us(dev, reps, |i| {
        let (src, dst) = &pairs[i % sets];
        let mut d: DeviceSlice<u8> = dst.index(..);
        // SAFETY: a device-to-device copy between two buffers owned here, of the same
        // length; both outlive it (the timer synchronizes before they are dropped).
        unsafe { d.async_copy_from(&src.index(..), dev.stream())? };
        Ok(())
    })?;
    let gbps = |moved: usize, us: f64| moved as f64 / us / 1e3;
    println!(
        "| {} | {}/{} | {row} | {tokens} | {} | {} | {mapped_us:.1} | {:.0} | {plain_us:.1} | {:.0} | {memcpy_us:.1} | {:.0} | {:.1}% | {:.1}% |",
        case.name,
        cfg.layers.full_layers().len(),
        window_layers,
        if half_unmapped { "half unmapped" } else { "all mapped" },
        mapped_moved >> 20,
        gbps(mapped_moved, mapped_us),
        gbps(plain_moved, plain_us),
        gbps(plain_moved, memcpy_us),
        100.0 * gbps(mapped_moved, mapped_us) / gbps(plain_moved, plain_us),
        100.0 * gbps(mapped_moved, mapped_us) / gbps(plain_moved, memcpy_us),
    );
    Ok(())
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
    let cases = [
        // gpt-oss-20b: 24 layers alternating, 8 KV heads x 64, bf16 (1 KiB rows).
        Case {
            name: "gpt-oss-20b",
            cfg: SwaKvConfig {
                layers: SwaLayout::alternating(24)?,
                head_num: 8,
                head_dim: 64,
                dtype: KvDtype::Bf16,
                full_size: 1 << 17,
                window_size: 1 << 15,
                page_size: 16,
            },
            tokens: &[1024, 4096, 16384],
        },
        // Gemma 3 12B: 48 layers, 5 local : 1 global, 8 KV heads x 256, bf16 (4 KiB rows).
        Case {
            name: "gemma3-12b",
            cfg: SwaKvConfig {
                layers: SwaLayout::gemma3(48)?,
                head_num: 8,
                head_dim: 256,
                dtype: KvDtype::Bf16,
                full_size: 1 << 15,
                window_size: 1 << 13,
                page_size: 16,
            },
            tokens: &[256, 1024, 4096],
        },
    ];
    println!("### Mapped scatter vs plain all-layers scatter vs memcpy (sm_{} PTX)\n", dev.ptx_target());
    println!("| model | full/window layers | row B | tokens | window rows | MiB moved | mapped us | mapped GB/s | plain us | plain GB/s | memcpy us | memcpy GB/s | mapped/plain | mapped/memcpy |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for case in &cases {
        let cfg = &case.cfg;
        let cache = DeviceSwaKvCache::new(&dev, cfg.clone())?;
        let plain = DeviceKvCache::new(KvConfig {
            layout: KvLayout::Mha { head_num: cfg.head_num, head_dim: cfg.head_dim },
            dtype: cfg.dtype,
            layer_num: cfg.layers.num_layers(),
            size: cfg.full_size,
            page_size: cfg.page_size,
        })?;
        let mut map = DeviceSwaMap::new(&dev, cfg, 4096)?;
        for &tokens in case.tokens {
            row(&dev, &cache, &plain, &mut map, case, tokens, false, &mut rng)?;
        }
        let last = *case.tokens.last().unwrap();
        row(&dev, &cache, &plain, &mut map, case, last, true, &mut rng)?;
    }

    // Keeping the device table in sync: host wall time of one `upload_pages` call (the
    // staging, one pinned copy, one `swa_map_update` launch) and a stream synchronize,
    // against an empty launch and a synchronize.
    println!("\n### DeviceSwaMap::upload_pages (page size 16), host wall time per call + synchronize\n");
    println!("| pages | upload + sync us | empty launch + sync us |");
    println!("|---|---|---|");
    let cfg = &cases[0].cfg;
    let mut map = DeviceSwaMap::new(&dev, cfg, 4096)?;
    let table: Vec<u32> = (0..cfg.map_len() as u32).collect();
    let mut uploaded = std::collections::HashSet::<u32>::new();
    for pages in [1usize, 16, 256, 4096] {
        let list = rng.distinct(pages, 1, (cfg.full_size / 16) as u32 + 1);
        uploaded.extend(&list);
        let wall = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            for _ in 0..10 {
                f()?;
            }
            let mut t: Vec<f64> = (0..101)
                .map(|_| {
                    let s = Instant::now();
                    f().map(|()| s.elapsed().as_secs_f64() * 1e6)
                })
                .collect::<Result<_>>()?;
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            Ok(t[50])
        };
        let upload = wall(&mut || {
            map.upload_pages(&dev, &table[..], &list)?;
            Ok(dev.synchronize()?)
        })?;
        let empty = wall(&mut || {
            dev.launch_noop(&dev, 1, 32)?;
            Ok(dev.synchronize()?)
        })?;
        println!("| {pages} | {upload:.1} | {empty:.1} |");
    }
    // Sanity: exactly the uploaded pages hold the host's entries.
    let mut back = vec![0u32; cfg.map_len()];
    map.download(&dev, &mut back)?;
    for (i, (&got, &want)) in back.iter().zip(&table).enumerate() {
        let uploaded = uploaded.contains(&((i / 16) as u32));
        assert_eq!(got, if uploaded { want } else { 0 }, "device table entry {i}");
    }
    Ok(())
}
