//! Interop with `cudarc` (feature `cudarc`): an engine that owns its KV cache, its
//! request table and its stream through cudarc uses kvpool's allocator and kernels on
//! them, without copying.
//!
//! cudarc allocates every layer's K and V rows (separately: the layers are not evenly
//! spaced, so all-layer scatters run one launch per layer), the row table and the
//! slot buffer, all on a stream cudarc created; kvpool's views describe that memory,
//! kvpool's extend expansion, graph-captured decode steps and `f16` scatter run on
//! cudarc's stream, and the results are read back with cudarc and compared with the
//! host reference. Both crates use the device's primary context (cudarc's
//! `CudaContext::new` and kvpool's `KvDevice::new` both retain it), which
//! `KvDevice::on` checks for the stream.
//!
//! Without a CUDA device the test prints "no CUDA device" and returns.
#![cfg(feature = "cudarc")]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use cust::memory::{DevicePointer, DeviceSlice};
use half::f16;
use kvpool::cuda::{
    DecodeGraphs, DevicePagedAllocator, KvCacheView, KvDevice, LastLocs, Layers, ReqToTokenView, Rows, Staging,
};
use kvpool::kv::reference::{decode_with_rows, extend_with_rows, scatter_rows, RowTable};
use kvpool::kv::{KvConfig, KvDtype, KvLayout, RowStore};
use kvpool::PagedAllocator;

fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

#[test]
fn kvpool_runs_on_cudarc_memory_and_streams() {
    let required = std::env::var_os("KVPOOL_REQUIRE_GPU").is_some();
    let ctx = match CudaContext::device_count() {
        Ok(n) if n > 0 => CudaContext::new(0).expect("cudarc opens device 0"),
        other => {
            assert!(!required, "KVPOOL_REQUIRE_GPU is set but there is no CUDA device: {other:?}");
            println!("no CUDA device ({other:?}): skipping");
            return;
        }
    };
    let stream = ctx.new_stream().unwrap();
    let dev = KvDevice::new(0).unwrap();
    // The same primary context: kvpool accepts cudarc's stream.
    let on = dev.on(&*stream).expect("cudarc's stream is in the device's primary context");

    let ps = 16u32;
    let cfg = KvConfig {
        layout: KvLayout::Mha { head_num: 4, head_dim: 64 },
        dtype: KvDtype::F16,
        layer_num: 3,
        size: 4096,
        page_size: ps,
    };
    let elems = cfg.layout.row_elems();
    let layer_elems = cfg.rows() * elems;
    // The engine's memory, allocated by cudarc.
    let k_layers: Vec<CudaSlice<f16>> = (0..3).map(|_| stream.alloc_zeros::<f16>(layer_elems).unwrap()).collect();
    let v_layers: Vec<CudaSlice<f16>> = (0..3).map(|_| stream.alloc_zeros::<f16>(layer_elems).unwrap()).collect();
    let (n_rows, stride) = (8u32, 256u32);
    let table_mem: CudaSlice<u32> = stream.alloc_zeros::<u32>((n_rows * stride) as usize).unwrap();
    let slot_mem: CudaSlice<u32> = stream.alloc_zeros::<u32>(1024).unwrap();
    stream.synchronize().unwrap();
    let kp: Vec<u64> = k_layers.iter().map(|s| ptr(s, &stream)).collect();
    let vp: Vec<u64> = v_layers.iter().map(|s| ptr(s, &stream)).collect();
    // SAFETY: the layers, the table and the slot buffer are cudarc allocations of the
    // sizes described, in the primary context, alive until the end of the test (they
    // are dropped after the views and the graphs, which are declared later), and only
    // work on `stream` touches them.
    let view = unsafe { KvCacheView::from_raw(cfg, &kp, Some(&vp), cfg.row_bytes()) }.unwrap();
    // SAFETY: as above.
    let table = unsafe { ReqToTokenView::from_raw(ptr(&table_mem, &stream), n_rows, stride) }.unwrap();
    // SAFETY: as above; 1024 `u32` slots.
    let slots_all =
        unsafe { DeviceSlice::from_raw_parts(DevicePointer::<u32>::from_raw(ptr(&slot_mem, &stream)), 1024) };

    // Prefill three requests with kvpool's expansion, on cudarc's stream.
    let host = Arc::new(PagedAllocator::new(cfg.size, ps).unwrap());
    let mut eager = DevicePagedAllocator::new(Arc::clone(&host), 8, 256).unwrap();
    let rows = [2u32, 5, 7];
    let prefix = [0u32, 0, 0];
    let seq = [37u32, 16, 70];
    let n: usize = seq.iter().sum::<u32>() as usize;
    let out = slots_all.index(..n);
    let staged = eager.alloc_extend(on, &prefix, &seq, LastLocs::FromRows, Some((&table, &rows)), &out).unwrap();
    let pages = eager.pages(&staged).unwrap().to_vec();
    let mut mirror = vec![0u32; (n_rows * stride) as usize];
    let mut want = vec![0u32; n];
    let rt = RowTable { cells: &mut mirror, stride: stride as usize, rows: &rows };
    extend_with_rows(ps, &prefix, &seq, None, &pages, &mut want, Some(rt)).unwrap();

    // Their K and V (f16 rows) into every layer at those slots, one scatter call.
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut value = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        f16::from_f32((rng % 2001) as f32 / 100.0 - 10.0)
    };
    let k_src: Vec<f16> = (0..3 * n * elems).map(|_| value()).collect();
    let v_src: Vec<f16> = (0..3 * n * elems).map(|_| value()).collect();
    let k_dev = stream.clone_htod(&k_src).unwrap();
    let v_dev = stream.clone_htod(&v_src).unwrap();
    // SAFETY: cudarc buffers of `3 * n * elems` f16 each, alive and untouched by
    // anything but `stream` until the end of the test.
    let (kr, vr) = unsafe {
        (
            Rows::<f16>::from_raw(ptr(&k_dev, &stream), 3 * n * elems, elems, n * elems),
            Rows::<f16>::from_raw(ptr(&v_dev, &stream), 3 * n * elems, elems, n * elems),
        )
    };
    view.set_kv(on, Layers::All, &out, kr, vr, None, (1.0, 1.0)).unwrap();

    // Two decode steps from the captured graphs, launched on cudarc's stream.
    let mut graphs = DecodeGraphs::new(&dev, Arc::clone(&host), &table, 8, Staging::Mapped).unwrap();
    let mut seq_now = seq;
    for _ in 0..2 {
        seq_now.iter_mut().for_each(|s| *s += 1);
        let step = graphs.step(&*stream, &seq_now, &rows).unwrap();
        let p = graphs.pages(&step).unwrap().to_vec();
        let mut d = [0u32; 3];
        let rt = RowTable { cells: &mut mirror, stride: stride as usize, rows: &rows };
        decode_with_rows(ps, &seq_now, None, &p, &mut d, Some(rt)).unwrap();
    }
    view.take_error(on).unwrap();

    // Read everything back with cudarc and compare with the host reference.
    stream.synchronize().unwrap();
    assert_eq!(stream.clone_dtoh(&slot_mem).unwrap()[..n], want[..], "prefill slots");
    assert!(stream.clone_dtoh(&table_mem).unwrap() == mirror, "request rows");
    let row_bytes = cfg.row_bytes();
    for l in 0..3 {
        for (src, layer) in [(&k_src, &k_layers[l]), (&v_src, &v_layers[l])] {
            let mut pool = vec![0u8; cfg.layer_bytes()];
            let bytes: &[u8] = bytemuck::cast_slice(&src[l * n * elems..(l + 1) * n * elems]);
            scatter_rows(RowStore::Copy, bytes, row_bytes, row_bytes, &want, &mut pool).unwrap();
            let got = stream.clone_dtoh(layer).unwrap();
            assert!(bytemuck::cast_slice::<f16, u8>(&got) == &pool[..], "layer {l} differs");
        }
    }
    println!("cudarc interop: {n} prefill slots, 2 graph decode steps, 3 layers of f16 K and V agree");
}
