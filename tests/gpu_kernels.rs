//! GPU tests: every kernel against its host reference (`kvpool::kv::reference`) on
//! random inputs — random batch shapes, prefix lengths, page sizes 1/16/64 (and a
//! run-time page size), fragmented (non-contiguous) page lists, strided sources, one
//! layer and all layers — with every output buffer poisoned first, so an element the
//! kernel forgot to write (or wrote where it should not) is caught.
//!
//! Without a CUDA device (or without a driver), each test prints "no CUDA device" and
//! returns. Set `KVPOOL_REQUIRE_GPU=1` to make a missing device a failure instead.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use cust::memory::{CopyDestination, DeviceBuffer, DeviceSlice};
use kvpool::cuda::{
    check_kernel_signatures, CudaKvError, DeviceKvCache, DevicePagedAllocator, DeviceReqToToken, KvDevice, LastLocs,
    Layers, Rows, RowsMut,
};
use kvpool::kv::fp8::{dequantize_e4m3, quantize_e4m3};
use kvpool::kv::reference::{
    decode_with_rows, extend_with_rows, gather_rows, move_rows, scatter_mla_rows, scatter_rows, DenseRows, RowTable,
};
use kvpool::kv::{KvConfig, KvDtype, KvLayout, RowStore, SrcFloat};
use kvpool::{KvAllocator, PagedAllocator};

const POISON32: u32 = 0xDEAD_BEEF;
const POISON8: u8 = 0xA5;

mod kernel_common;

use kernel_common::{device, Rng};

fn to_host<T: cust::memory::DeviceCopy + Default + Clone>(d: &DeviceSlice<T>) -> Vec<T> {
    let mut v = vec![T::default(); d.len()];
    d.copy_to(&mut v[..]).unwrap();
    v
}

#[test]
fn launchers_match_the_generated_kernels() {
    // Host-only: runs in CI without a GPU.
    check_kernel_signatures().unwrap();
}

#[test]
fn loads_every_module() {
    let Some(dev) = device() else { return };
    println!(
        "device: {} (compute capability {}, {} PTX loaded)",
        dev.name().unwrap(),
        dev.compute_capability(),
        dev.ptx_target()
    );
    assert_eq!(dev.kernel_count(), kvpool::kv::ptx::KERNELS.len());
    dev.launch_noop(&dev, 1, 32).unwrap();
    dev.launch_noop(&dev, 1024, 256).unwrap();
    dev.synchronize().unwrap();
}

/// A host allocator whose free pages are fragmented, so reserved page lists are not
/// contiguous.
fn fragmented(size: usize, ps: u32, rng: &mut Rng) -> Arc<PagedAllocator> {
    let host = Arc::new(PagedAllocator::new(size, ps).unwrap());
    let n = (host.num_pages() as usize / 2).min(4096);
    let mut pages = vec![0u32; n];
    host.reserve_pages(&mut pages).unwrap();
    for &p in &pages {
        if rng.below(2) == 0 {
            host.free(&[p * ps]).unwrap();
        }
    }
    host
}

/// Existing prefixes: allocated for real on the host, written into the request rows
/// of both the device table and its host mirror. Returns the `last_loc`s.
#[allow(clippy::too_many_arguments)]
fn make_prefixes(
    dev: &KvDevice,
    host: &PagedAllocator,
    table: &DeviceReqToToken,
    mirror: &mut [u32],
    rows: &[u32],
    prefix: &[u32],
) -> Vec<u32> {
    let stride = table.max_context_len() as usize;
    let mut last = Vec::new();
    for (&row, &p) in rows.iter().zip(prefix) {
        let mut slots = vec![0u32; p as usize];
        host.alloc_extend(&[0], &[p], &[0], &mut slots).unwrap();
        table.write(dev, row, 0, &slots).unwrap();
        mirror[row as usize * stride..][..p as usize].copy_from_slice(&slots);
        last.push(slots.last().copied().unwrap_or(0));
    }
    last
}

#[test]
fn alloc_extend_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(1);
    let mut cases = 0;
    for ps in [1u32, 16, 64, 32, 5, 3] {
        for round in 0..12 {
            let host = fragmented(1 << 18, ps, &mut rng);
            let (n_rows, stride) = (64u32, 2048u32);
            let table = DeviceReqToToken::new(n_rows, stride).unwrap();
            let mut mirror = vec![POISON32; (n_rows * stride) as usize];
            table.write(&dev, 0, 0, &[]).unwrap();
            for r in 0..n_rows {
                table.write(&dev, r, 0, &mirror[..stride as usize]).unwrap();
            }
            let batch = 1 + rng.below(if round % 3 == 0 { 64 } else { 8 }) as usize;
            let rows = rng.distinct(batch, n_rows as usize);
            let prefix: Vec<u32> = (0..batch).map(|_| rng.below(300) as u32).collect();
            let seq: Vec<u32> =
                prefix.iter().map(|&p| p + rng.below(if round % 2 == 0 { 40 } else { 700 }) as u32).collect();
            let last = make_prefixes(&dev, &host, &table, &mut mirror, &rows, &prefix);
            let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 64, 1 << 16).unwrap();
            let n_out: usize = seq.iter().zip(&prefix).map(|(s, p)| (s - p) as usize).sum();
            let mut out = DeviceBuffer::<u32>::zeroed(n_out).unwrap();
            out.set_32(POISON32).unwrap();
            let from_rows = round % 2 == 1;
            let with_rows = from_rows || round % 4 == 0;
            let lasts = if from_rows { LastLocs::FromRows } else { LastLocs::Host(&last) };
            let rows_arg = with_rows.then_some((table.view(), &rows[..]));
            let staged = dalloc.alloc_extend(&dev, &prefix, &seq, lasts, rows_arg, &out).unwrap();
            let pages = dalloc.pages(&staged).unwrap().to_vec();
            let mut want = vec![0u32; n_out];
            let rt = RowTable { cells: &mut mirror, stride: stride as usize, rows: &rows };
            let host_last = if from_rows { None } else { Some(&last[..]) };
            extend_with_rows(ps, &prefix, &seq, host_last, &pages, &mut want, with_rows.then_some(rt)).unwrap();
            dev.synchronize().unwrap();
            assert_eq!(to_host(&out), want, "ps {ps} round {round} prefix {prefix:?} seq {seq:?}");
            let mut got = vec![0u32; (n_rows * stride) as usize];
            for r in 0..n_rows {
                let s = stride as usize;
                table.read(&dev, r, 0..s, &mut got[r as usize * s..][..s]).unwrap();
            }
            assert!(got == mirror, "ps {ps} round {round}: request rows differ");
            // Expanding the same staged batch again gives the same result; a newer
            // batch makes it stale.
            out.set_32(POISON32).unwrap();
            dalloc.expand(&dev, &staged, &out, rows_arg.map(|(t, _)| t)).unwrap();
            dev.synchronize().unwrap();
            assert_eq!(to_host(&out), want);
            let empty = DeviceBuffer::<u32>::zeroed(1).unwrap();
            let next = dalloc.alloc_extend(&dev, &[0], &[0], LastLocs::Host(&[0]), None, &empty.index(..0)).unwrap();
            assert_eq!(next.new_tokens(), 0);
            assert!(matches!(dalloc.expand(&dev, &staged, &out, None), Err(CudaKvError::StaleBatch)));
            cases += 1;
        }
    }
    println!("alloc_extend: {cases} random batches agree with the host reference");
}

#[test]
fn alloc_decode_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(2);
    for ps in [1u32, 16, 64, 7] {
        for round in 0..12 {
            let host = fragmented(1 << 19, ps, &mut rng);
            let (n_rows, stride) = (1100u32, 256u32);
            let table = DeviceReqToToken::new(n_rows, stride).unwrap();
            let mut mirror = vec![0u32; (n_rows * stride) as usize];
            let batch = 1 + rng.below(if round < 4 { 1024 } else { 40 }) as usize;
            let rows = rng.distinct(batch, n_rows as usize);
            let prefix: Vec<u32> = (0..batch).map(|_| rng.below(200) as u32).collect();
            let last = make_prefixes(&dev, &host, &table, &mut mirror, &rows, &prefix);
            let seq: Vec<u32> = prefix.iter().map(|p| p + 1).collect();
            let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 1024, 1024).unwrap();
            let mut out = DeviceBuffer::<u32>::zeroed(batch).unwrap();
            out.set_32(POISON32).unwrap();
            let from_rows = round % 2 == 0;
            let lasts = if from_rows { LastLocs::FromRows } else { LastLocs::Host(&last) };
            let with_rows = from_rows || round % 3 == 0;
            let rows_arg = with_rows.then_some((table.view(), &rows[..]));
            let staged = dalloc.alloc_decode(&dev, &seq, lasts, rows_arg, &out).unwrap();
            let pages = dalloc.pages(&staged).unwrap().to_vec();
            let mut want = vec![0u32; batch];
            let rt = RowTable { cells: &mut mirror, stride: stride as usize, rows: &rows };
            let host_last = if from_rows { None } else { Some(&last[..]) };
            decode_with_rows(ps, &seq, host_last, &pages, &mut want, with_rows.then_some(rt)).unwrap();
            dev.synchronize().unwrap();
            assert_eq!(to_host(&out), want, "ps {ps} round {round}");
            for (i, &r) in rows.iter().enumerate() {
                let mut cell = [0u32];
                table.read(&dev, r, seq[i] as usize - 1..seq[i] as usize, &mut cell).unwrap();
                assert_eq!(cell[0], mirror[r as usize * stride as usize + seq[i] as usize - 1]);
            }
            // The host allocator's own answer on the same pages agrees, too.
            assert_eq!(staged.new_pages(), kvpool::alloc::plan_decode(ps, &seq).unwrap().new_pages);
        }
    }
}

/// At page size 1 with the `last_loc`s on the host, the device allocator places a
/// decode batch as the host allocator does: each request's run goes on where its next
/// slot is free.
#[test]
fn page_size_1_decode_with_host_last_locs_continues_runs() {
    let Some(dev) = device() else { return };
    let host = Arc::new(PagedAllocator::new(1024, 1).unwrap());
    let twin = PagedAllocator::new(1024, 1).unwrap();
    for a in [&*host, &twin] {
        let mut prompts = [0u32; 8];
        a.alloc(&mut prompts).unwrap();
        a.free(&prompts[4..]).unwrap();
    }
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 16, 16).unwrap();
    let out = DeviceBuffer::<u32>::zeroed(3).unwrap();
    let (seq, last) = ([5u32, 7, 3], [4u32, 100, 1]);
    dalloc.alloc_decode(&dev, &seq, LastLocs::Host(&last), None, &out).unwrap();
    dev.synchronize().unwrap();
    let mut want = [0u32; 3];
    twin.alloc_decode(&seq, &last, &mut want).unwrap();
    // 5 and 101 continue their runs; 2 is taken, so the third starts a new one.
    assert_eq!(want[..2], [5, 101]);
    assert_eq!(to_host(&out), want);
    assert_eq!(host.available_size(), twin.available_size());
}

/// With `LastLocs::FromRows` the host cannot read the rows: after `remember_rows` the
/// allocator continues the runs it placed itself (prefills and decodes), and writes
/// the rows as always. Without it, the same batch takes the pool's claim order.
#[test]
fn page_size_1_decode_from_rows_continues_remembered_runs() {
    let Some(dev) = device() else { return };
    let table = DeviceReqToToken::new(4, 64).unwrap();
    let mut got = Vec::new();
    for remember in [true, false] {
        let host = Arc::new(PagedAllocator::new(1024, 1).unwrap());
        let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 16, 64).unwrap();
        if remember {
            dalloc = dalloc.remember_rows(table.rows());
        }
        // Rows 1 and 2 prefill 4 and 3 tokens in one batch: slots 1..=4 and 5..=7.
        let out = DeviceBuffer::<u32>::zeroed(7).unwrap();
        dalloc.alloc_extend(&dev, &[0, 0], &[4, 3], LastLocs::FromRows, Some((&table, &[1, 2])), &out).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(to_host(&out), (1..=7).collect::<Vec<u32>>());
        // Three decode steps of both.
        let mut slots = Vec::new();
        for step in 0..3u32 {
            let one = DeviceBuffer::<u32>::zeroed(2).unwrap();
            let staged = dalloc
                .alloc_decode(&dev, &[5 + step, 4 + step], LastLocs::FromRows, Some((&table, &[1, 2])), &one)
                .unwrap();
            dev.synchronize().unwrap();
            assert_eq!(to_host(&one), dalloc.pages(&staged).unwrap());
            slots.push(to_host(&one));
        }
        // The rows hold what was handed out.
        let (mut one, mut two) = ([0u32; 3], [0u32; 3]);
        table.read(&dev, 1, 4..7, &mut one).unwrap();
        table.read(&dev, 2, 3..6, &mut two).unwrap();
        assert_eq!(one, [slots[0][0], slots[1][0], slots[2][0]]);
        assert_eq!(two, [slots[0][1], slots[1][1], slots[2][1]]);
        got.push(slots);
    }
    // Remembered: row 2's run goes on at 8, 9, 10; row 1's cannot (5 is row 2's), so it
    // starts a run elsewhere and then continues it.
    let (r, plain) = (&got[0], &got[1]);
    assert_eq!([r[0][1], r[1][1], r[2][1]], [8, 9, 10]);
    assert_ne!(r[0][0], 5);
    assert_eq!([r[1][0], r[2][0]], [r[0][0] + 1, r[0][0] + 2]);
    // Claim order: each step takes the two lowest free slots.
    assert_eq!(*plain, vec![vec![8, 9], vec![10, 11], vec![12, 13]]);
}

#[test]
fn allocation_errors_reserve_nothing() {
    let Some(dev) = device() else { return };
    let host = Arc::new(PagedAllocator::new(64, 16).unwrap());
    let mut dalloc = DevicePagedAllocator::new(Arc::clone(&host), 4, 8).unwrap();
    let out = DeviceBuffer::<u32>::zeroed(100).unwrap();
    // Out of pages.
    let r = dalloc.alloc_extend(&dev, &[0], &[100], LastLocs::Host(&[0]), None, &out);
    assert!(matches!(r, Err(CudaKvError::Alloc(_))), "{r:?}");
    assert_eq!(host.available_size(), 64);
    // A bad last_loc (its page is not allocated).
    let out5 = out.index(..5);
    let r = dalloc.alloc_extend(&dev, &[3], &[8], LastLocs::Host(&[18]), None, &out5);
    assert!(matches!(r, Err(CudaKvError::Kv(_))), "{r:?}");
    // Wrong output length; a row past the table; FromRows without a table.
    let table = DeviceReqToToken::new(2, 16).unwrap();
    assert!(dalloc.alloc_extend(&dev, &[0], &[4], LastLocs::Host(&[0]), None, &out5).is_err());
    let out4 = out.index(..4);
    assert!(dalloc.alloc_extend(&dev, &[0], &[4], LastLocs::Host(&[0]), Some((&table, &[2])), &out4).is_err());
    assert!(dalloc
        .alloc_extend(&dev, &[0], &[17], LastLocs::Host(&[0]), Some((&table, &[1])), &out.index(..17))
        .is_err());
    assert!(dalloc.alloc_decode(&dev, &[1], LastLocs::FromRows, None, &out.index(..1)).is_err());
    assert_eq!(host.available_size(), 64);
    // And a good one still works afterwards.
    let staged = dalloc.alloc_extend(&dev, &[0], &[4], LastLocs::Host(&[0]), Some((&table, &[1])), &out4).unwrap();
    assert_eq!(host.available_size(), 48);
    dev.synchronize().unwrap();
    let p = dalloc.pages(&staged).unwrap()[0];
    assert_eq!(to_host(&out4), vec![p * 16, p * 16 + 1, p * 16 + 2, p * 16 + 3]);
    let pages = dalloc.pages(&staged).unwrap().to_vec();
    dalloc.free_pages(&pages).unwrap();
    assert_eq!(host.available_size(), 64);
}

/// Poison every layer of the cache's buffers; return the host mirror
/// `[buffer][layer] -> bytes`.
fn poison_cache(cache: &DeviceKvCache, rng: &mut Rng) -> Vec<Vec<Vec<u8>>> {
    let cfg = *cache.config();
    let mut mirror = Vec::new();
    for b in 0..cfg.layout.buffers() {
        let mut layers = Vec::new();
        for l in 0..cfg.layer_num {
            let bytes: Vec<u8> =
                if rng.below(2) == 0 { vec![POISON8; cfg.layer_bytes()] } else { rng.bytes(cfg.layer_bytes()) };
            let mut s = if b == 0 { cache.k_layer(l).unwrap() } else { cache.v_layer(l).unwrap().unwrap() };
            s.copy_from(&bytes[..]).unwrap();
            layers.push(bytes);
        }
        mirror.push(layers);
    }
    mirror
}

fn read_cache(cache: &DeviceKvCache) -> Vec<Vec<Vec<u8>>> {
    let cfg = *cache.config();
    (0..cfg.layout.buffers())
        .map(|b| {
            (0..cfg.layer_num)
                .map(|l| to_host(&if b == 0 { cache.k_layer(l).unwrap() } else { cache.v_layer(l).unwrap().unwrap() }))
                .collect()
        })
        .collect()
}

/// Random source values of type `src` (finite, with occasional huge, tiny, zero,
/// infinite and NaN values) as little-endian bytes.
fn float_bytes(src: SrcFloat, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * src.bytes());
    for _ in 0..n {
        let x: f32 = match rng.below(24) {
            0 => 0.0,
            1 => 1e6,
            2 => -3e-6,
            3 => f32::INFINITY,
            4 => f32::NAN,
            5 => -f32::NAN,
            6 => f32::NEG_INFINITY,
            7 => -0.0,
            8 => -1e5,
            _ => (rng.below(2_000_001) as f32 - 1_000_000.0) / 1000.0 * 2f32.powi(rng.below(12) as i32 - 6),
        };
        match src {
            SrcFloat::F32 => out.extend(x.to_le_bytes()),
            SrcFloat::F16 => out.extend(half::f16::from_f32(x).to_bits().to_le_bytes()),
            SrcFloat::Bf16 => out.extend(half::bf16::from_f32(x).to_bits().to_le_bytes()),
        }
    }
    out
}

fn scatter_case(dev: &KvDevice, rng: &mut Rng, dtype: KvDtype, src: Option<SrcFloat>) {
    let head_dim = [1u32, 2, 3, 8, 64, 128][rng.below(6) as usize];
    let head_num = 1 + rng.below(8) as u32;
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num, head_dim },
        dtype,
        layer_num: 1 + rng.below(3) as u32,
        size: 64 + rng.below(1500) as usize,
        page_size: [1, 16, 64][rng.below(3) as usize],
    };
    let cache = DeviceKvCache::new(cfg).unwrap();
    let mut want = poison_cache(&cache, rng);
    let elems = cfg.layout.row_elems();
    let esz = src.map_or(dtype.bytes(), |f| f.bytes());
    let src_row = elems * esz;
    let stride = src_row + esz * rng.below(3) as usize * 8;
    let n = rng.below(cfg.rows() as u64 + 1).min(3000) as usize;
    let slots = rng.distinct(n, cfg.rows());
    let all = rng.below(2) == 0;
    let (layers, first, count) = if all {
        (Layers::All, 0, cfg.layer_num)
    } else {
        let l = rng.below(cfg.layer_num as u64) as u32;
        (Layers::One(l), l, 1)
    };
    let layer_stride = n * stride + 16 * rng.below(2) as usize;
    let total = count as usize * layer_stride;
    let (k_host, v_host) = match src {
        None => (rng.bytes(total), rng.bytes(total)),
        Some(f) => (float_bytes(f, total / esz, rng), float_bytes(f, total / esz, rng)),
    };
    let scales = (0.5 + rng.below(100) as f32 / 10.0, 0.25 + rng.below(100) as f32 / 7.0);
    let k = DeviceBuffer::from_slice(&k_host).unwrap();
    let v = DeviceBuffer::from_slice(&v_host).unwrap();
    let d_slots = DeviceBuffer::from_slice(&slots).unwrap();
    let rows = |d| Rows::new(d, stride, layer_stride);
    cache.set_kv(dev, layers, &d_slots, rows(&k), rows(&v), src, scales).unwrap();
    cache.take_error(dev).unwrap();
    for (b, (data, scale)) in [(&k_host, scales.0), (&v_host, scales.1)].into_iter().enumerate() {
        let store = match src {
            None => RowStore::Copy,
            Some(f) => RowStore::Fp8E4m3 { src: f, inv_scale: 1.0 / scale },
        };
        for j in 0..count as usize {
            let l = first as usize + j;
            scatter_rows(store, &data[j * layer_stride..], stride, src_row, &slots, &mut want[b][l]).unwrap();
        }
    }
    let got = read_cache(&cache);
    for b in 0..2 {
        for l in 0..cfg.layer_num as usize {
            let what = format!("{cfg:?} src {src:?} buffer {b} layer {l} n {n} stride {stride} {layers:?}");
            assert_bytes_eq(&got[b][l], &want[b][l], &what);
        }
    }
    // fp8: the stored codes decode to within half an e4m3 step of the scaled input.
    if let Some(f) = src {
        let row = cfg.row_bytes();
        for (i, &slot) in slots.iter().enumerate().take(64) {
            for e in 0..elems {
                let x = f.read_le(&k_host[i * stride + e * esz..]);
                let q = got[0][first as usize][slot as usize * row + e];
                let y = x / scales.0;
                let back = dequantize_e4m3(q);
                if y.is_nan() {
                    assert!(back.is_nan());
                } else if y.abs() >= 448.0 {
                    assert_eq!(back.abs(), 448.0);
                } else {
                    let err = (back - y).abs();
                    assert!(err <= y.abs() / 16.0 * 1.0001 + 2f32.powi(-10), "x {x} y {y} back {back}");
                }
            }
        }
    }
}

/// Equal, or a failure naming the first differing byte and how many differ.
fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
        let count = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!("{what}: {count} bytes differ; first at {first}: got {:#04x}, want {:#04x}", got[first], want[first]);
    }
}

trait ReadLe {
    fn read_le(self, b: &[u8]) -> f32;
}
impl ReadLe for SrcFloat {
    fn read_le(self, b: &[u8]) -> f32 {
        match self {
            SrcFloat::F16 => half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            SrcFloat::Bf16 => half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            SrcFloat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

#[test]
fn scatter_copy_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    for dtype in [KvDtype::F16, KvDtype::Bf16, KvDtype::F32] {
        for _ in 0..12 {
            scatter_case(&dev, &mut rng, dtype, None);
        }
    }
}

#[test]
fn scatter_fp8_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4);
    for src in [SrcFloat::F16, SrcFloat::Bf16, SrcFloat::F32] {
        for _ in 0..10 {
            scatter_case(&dev, &mut rng, KvDtype::Fp8E4m3, Some(src));
        }
    }
    // Raw fp8 bytes are copied as they are.
    scatter_case(&dev, &mut rng, KvDtype::Fp8E4m3, None);
}

#[test]
fn sm80_code_agrees_on_this_device() {
    // The sm_80 PTX (integer fp8 rounding, no hardware conversion) runs on any newer
    // GPU too: check it here against the same references.
    let Some(newest) = device() else { return };
    drop(newest);
    let dev = KvDevice::with_target(0, 80).unwrap();
    assert_eq!(dev.ptx_target(), 80);
    let mut rng = Rng::new(8);
    for src in [SrcFloat::F16, SrcFloat::Bf16, SrcFloat::F32] {
        for _ in 0..6 {
            scatter_case(&dev, &mut rng, KvDtype::Fp8E4m3, Some(src));
        }
    }
    for dtype in [KvDtype::Bf16, KvDtype::F32] {
        for _ in 0..4 {
            scatter_case(&dev, &mut rng, dtype, None);
        }
    }
}

#[test]
fn mla_scatter_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(5);
    let shapes = [(512u32, 64u32), (128, 32), (7, 3), (16, 1)];
    for (case, &(lora, rope_dim)) in shapes.iter().cycle().take(16).enumerate() {
        let (dtype, src) = match case % 4 {
            0 => (KvDtype::Bf16, None),
            1 => (KvDtype::Fp8E4m3, Some(SrcFloat::Bf16)),
            2 => (KvDtype::F32, None),
            _ => (KvDtype::Fp8E4m3, Some(SrcFloat::F16)),
        };
        let cfg = KvConfig {
            layout: KvLayout::Mla { kv_lora_rank: lora, qk_rope_head_dim: rope_dim },
            dtype,
            layer_num: 1 + rng.below(3) as u32,
            size: 256 + rng.below(1000) as usize,
            page_size: 64,
        };
        let cache = DeviceKvCache::new(cfg).unwrap();
        let mut want = poison_cache(&cache, &mut rng);
        let esz = src.map_or(dtype.bytes(), |f| f.bytes());
        let (nb, rb) = (lora as usize * esz, rope_dim as usize * esz);
        let (ns, rs) = (nb + esz * 4 * rng.below(2) as usize, rb);
        let n = 1 + rng.below(600) as usize;
        let slots = rng.distinct(n, cfg.rows());
        let all = case % 2 == 0;
        let (layers, first, count) =
            if all { (Layers::All, 0, cfg.layer_num) } else { (Layers::One(cfg.layer_num - 1), cfg.layer_num - 1, 1) };
        let (nls, rls) = (n * ns, n * rs);
        let gen = |rng: &mut Rng, len: usize| match src {
            None => rng.bytes(len),
            Some(f) => float_bytes(f, len / esz, rng),
        };
        let nope_h = gen(&mut rng, count as usize * nls);
        let rope_h = gen(&mut rng, count as usize * rls);
        let scale = 0.75;
        let nope = DeviceBuffer::from_slice(&nope_h).unwrap();
        let rope = DeviceBuffer::from_slice(&rope_h).unwrap();
        let d_slots = DeviceBuffer::from_slice(&slots).unwrap();
        cache
            .set_mla_kv(&dev, layers, &d_slots, Rows::new(&nope, ns, nls), Rows::new(&rope, rs, rls), src, scale)
            .unwrap();
        cache.take_error(&dev).unwrap();
        let store = src.map_or(RowStore::Copy, |f| RowStore::Fp8E4m3 { src: f, inv_scale: 1.0 / scale });
        for j in 0..count as usize {
            let l = (first as usize) + j;
            let nd = DenseRows { data: &nope_h[j * nls..], row_stride: ns, row_bytes: nb };
            let rd = DenseRows { data: &rope_h[j * rls..], row_stride: rs, row_bytes: rb };
            scatter_mla_rows(store, nd, rd, &slots, &mut want[0][l]).unwrap();
        }
        let got = read_cache(&cache);
        for l in 0..cfg.layer_num as usize {
            assert_bytes_eq(&got[0][l], &want[0][l], &format!("case {case} {cfg:?} layer {l}"));
        }
    }
}

#[test]
fn gather_and_move_match_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(6);
    for case in 0..16 {
        let layout = if case % 3 == 0 {
            KvLayout::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }
        } else {
            KvLayout::Mha { head_num: 1 + rng.below(8) as u32, head_dim: [1u32, 3, 64, 128][rng.below(4) as usize] }
        };
        let dtype = [KvDtype::F16, KvDtype::Bf16, KvDtype::F32, KvDtype::Fp8E4m3][case % 4];
        let cfg = KvConfig { layout, dtype, layer_num: 1 + rng.below(3) as u32, size: 512, page_size: 16 };
        let cache = DeviceKvCache::new(cfg).unwrap();
        let mut mirror = poison_cache(&cache, &mut rng);
        for l in 0..cfg.layer_num {
            // Random contents everywhere, so every row is distinguishable.
            for b in 0..cfg.layout.buffers() {
                let bytes = rng.bytes(cfg.layer_bytes());
                let mut s = if b == 0 { cache.k_layer(l).unwrap() } else { cache.v_layer(l).unwrap().unwrap() };
                s.copy_from(&bytes[..]).unwrap();
                mirror[b][l as usize] = bytes;
            }
        }
        let row = cfg.row_bytes();
        // Gather.
        let n = 1 + rng.below(cfg.rows() as u64) as usize;
        let slots: Vec<u32> = (0..n).map(|_| rng.below(cfg.rows() as u64) as u32).collect();
        let d_slots = DeviceBuffer::from_slice(&slots).unwrap();
        let stride = row + 16 * rng.below(2) as usize;
        let all = case % 2 == 0;
        let (layers, first, count) = if all { (Layers::All, 0, cfg.layer_num) } else { (Layers::One(0), 0, 1) };
        let ls = n * stride;
        let mut k_out = DeviceBuffer::<u8>::zeroed(count as usize * ls).unwrap();
        let mut v_out = DeviceBuffer::<u8>::zeroed(count as usize * ls).unwrap();
        k_out.set_8(POISON8).unwrap();
        v_out.set_8(POISON8).unwrap();
        let mha = cfg.layout.buffers() == 2;
        let v_arg = mha.then_some(RowsMut { data: &mut v_out, row_stride: stride, layer_stride: ls });
        cache
            .get_kv(&dev, layers, &d_slots, RowsMut { data: &mut k_out, row_stride: stride, layer_stride: ls }, v_arg)
            .unwrap();
        cache.take_error(&dev).unwrap();
        for (b, out) in [&k_out, &v_out].into_iter().enumerate().take(cfg.layout.buffers()) {
            let mut want = vec![POISON8; count as usize * ls];
            for j in 0..count as usize {
                gather_rows(&mirror[b][first as usize + j], row, &slots, &mut want[j * ls..(j + 1) * ls], stride)
                    .unwrap();
            }
            assert!(to_host(out) == want, "gather case {case} buffer {b}");
        }
        // Move: disjoint sources and destinations.
        let m = rng.below(cfg.rows() as u64 / 2) as usize;
        let both = rng.distinct(2 * m, cfg.rows());
        let (src, dst) = both.split_at(m);
        let (d_src, d_dst) = (DeviceBuffer::from_slice(src).unwrap(), DeviceBuffer::from_slice(dst).unwrap());
        cache.move_kv(&dev, &d_src, &d_dst).unwrap();
        cache.take_error(&dev).unwrap();
        for layers in mirror.iter_mut() {
            for layer in layers.iter_mut() {
                move_rows(layer, row, src, dst).unwrap();
            }
        }
        assert!(read_cache(&cache) == mirror, "move case {case}");
    }
}

#[test]
fn out_of_range_slots_are_skipped_and_reported() {
    let Some(dev) = device() else { return };
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 2, head_dim: 64 },
        dtype: KvDtype::Bf16,
        layer_num: 2,
        size: 64,
        page_size: 16,
    };
    let cache = DeviceKvCache::new(cfg).unwrap();
    let mut rng = Rng::new(7);
    let mut want = poison_cache(&cache, &mut rng);
    let row = cfg.row_bytes();
    let src = rng.bytes(3 * row);
    let k = DeviceBuffer::from_slice(&src).unwrap();
    let slots = [5u32, cfg.rows() as u32, 9];
    let d_slots = DeviceBuffer::from_slice(&slots).unwrap();
    let rows = |d| Rows::new(d, row, 0);
    cache.set_kv(&dev, Layers::One(1), &d_slots, rows(&k), rows(&k), None, (1.0, 1.0)).unwrap();
    assert!(matches!(cache.take_error(&dev), Err(CudaKvError::DeviceSlotOutOfRange)));
    cache.take_error(&dev).unwrap(); // cleared
    for b in 0..2 {
        want[b][1][5 * row..6 * row].copy_from_slice(&src[..row]);
        want[b][1][9 * row..10 * row].copy_from_slice(&src[2 * row..]);
    }
    assert!(read_cache(&cache) == want);
    // Host-side checks refuse short sources and bad layers before launching.
    let short = DeviceBuffer::<u8>::zeroed(row).unwrap();
    assert!(matches!(
        cache.set_kv(&dev, Layers::One(0), &d_slots, rows(&short), rows(&short), None, (1.0, 1.0)),
        Err(CudaKvError::Kv(_))
    ));
    assert!(cache.set_kv(&dev, Layers::One(2), &d_slots, rows(&k), rows(&k), None, (1.0, 1.0)).is_err());
    assert!(cache.set_kv(&dev, Layers::One(0), &d_slots, rows(&k), rows(&k), Some(SrcFloat::F32), (1.0, 1.0)).is_err());
    let fp8 = quantize_e4m3(1.0, 1.0);
    assert_eq!(fp8, 0x38);
}

#[test]
fn large_pools_use_64_bit_offsets() {
    // Three layers of 2^20 + 16 rows of 2 KiB: each buffer is 6 GiB, so row, layer and
    // slot offsets all pass 2^32 bytes. Rows are written at the top slots of every
    // layer in one launch, gathered back in one launch, and moved.
    let Some(dev) = device() else { return };
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
        dtype: KvDtype::Bf16,
        layer_num: 3,
        size: 1 << 20,
        page_size: 16,
    };
    assert!(cfg.layer_bytes() * 3 > 4 << 30);
    let cache = DeviceKvCache::new(cfg).unwrap();
    let mut rng = Rng::new(9);
    let row = cfg.row_bytes();
    let n = 64;
    let top = cfg.rows() as u32;
    let slots: Vec<u32> = (0..n as u32).map(|i| top - 1 - 3 * i).collect();
    let k_host = rng.bytes(3 * n * row);
    let v_host = rng.bytes(3 * n * row);
    let (k, v) = (DeviceBuffer::from_slice(&k_host).unwrap(), DeviceBuffer::from_slice(&v_host).unwrap());
    let d_slots = DeviceBuffer::from_slice(&slots).unwrap();
    let rows = |d| Rows::new(d, row, n * row);
    cache.set_kv(&dev, Layers::All, &d_slots, rows(&k), rows(&v), None, (1.0, 1.0)).unwrap();
    cache.take_error(&dev).unwrap();
    let mut k_out = DeviceBuffer::<u8>::zeroed(3 * n * row).unwrap();
    let mut v_out = DeviceBuffer::<u8>::zeroed(3 * n * row).unwrap();
    k_out.set_8(POISON8).unwrap();
    v_out.set_8(POISON8).unwrap();
    let out = |d| RowsMut { data: d, row_stride: row, layer_stride: n * row };
    cache.get_kv(&dev, Layers::All, &d_slots, out(&mut k_out), Some(out(&mut v_out))).unwrap();
    cache.take_error(&dev).unwrap();
    assert_bytes_eq(&to_host(&k_out), &k_host, "K gathered from the top of a 6 GiB buffer");
    assert_bytes_eq(&to_host(&v_out), &v_host, "V gathered from the top of a 6 GiB buffer");
    // The last layer's last row, read directly: layer 2 starts past 4 GiB.
    let last = cache.k_layer(2).unwrap();
    let direct = to_host(&last.index((top as usize - 1) * row..top as usize * row));
    assert_bytes_eq(&direct, &k_host[2 * n * row..2 * n * row + row], "direct read of layer 2, last row");
    // Move the top rows down to low slots in every layer, and check one of them.
    let low: Vec<u32> = (16..16 + n as u32).collect();
    let d_low = DeviceBuffer::from_slice(&low).unwrap();
    cache.move_kv(&dev, &d_slots, &d_low).unwrap();
    cache.take_error(&dev).unwrap();
    let moved = to_host(&cache.v_layer(1).unwrap().unwrap().index(16 * row..17 * row));
    assert_bytes_eq(&moved, &v_host[n * row..n * row + row], "moved row, layer 1");
}
