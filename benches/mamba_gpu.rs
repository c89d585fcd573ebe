//! The `mamba_state` copy kernel vs a device-to-device memcpy of the same bytes, and
//! the zero kernel, on the device (issue 9's goal: copy at >= 85% of memcpy).
//!
//! `cargo bench --features cuda --bench mamba_gpu` (prints a markdown table; without a
//! device it says so and exits 0). Times are CUDA-event medians over samples of
//! back-to-back launches on the device's stream. "GB/s" counts bytes read plus bytes
//! written (2x the state bytes for a copy, 1x for a zero).
use cust::event::{Event, EventFlags};
use cust::memory::{AsyncCopyDestination, CopyDestination, DeviceBuffer, DeviceSlice};
use kvpool::cuda::mamba::DeviceMambaState;
use kvpool::cuda::KvDevice;
use kvpool::mamba::{MambaConfig, StateDtype, StateShape};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn median_us(dev: &KvDevice, samples: usize, reps: usize, mut op: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    for i in 0..reps.min(5) {
        op(i)?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(samples);
    let mut k = 0;
    for _ in 0..samples {
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

fn main() -> Result<()> {
    let dev = match KvDevice::count() {
        Ok(n) if n > 0 => KvDevice::new(0)?,
        other => {
            println!("no CUDA device ({other:?}): nothing to measure");
            return Ok(());
        }
    };
    println!("device: {} (PTX sm_{})\n", dev.name()?, dev.ptx_target());
    let s = StateShape::new;
    let models = [
        // Qwen3-Next-80B-A3B, one GPU: 36 linear-attention layers, conv [8192, 3] bf16,
        // temporal [32 heads, 128, 128] f32 (about 74 MiB per slot).
        (
            "qwen3-next",
            MambaConfig {
                layers: 36,
                conv: vec![s(&[8192, 3], StateDtype::Bf16)],
                temporal: s(&[32, 128, 128], StateDtype::F32),
            },
            40u32,
            &[1usize, 4, 16][..],
        ),
        // A small Mamba2 (24 layers, conv [1792, 3] bf16, temporal [24, 64, 128] f32).
        (
            "mamba2-small",
            MambaConfig {
                layers: 24,
                conv: vec![s(&[1792, 3], StateDtype::Bf16)],
                temporal: s(&[24, 64, 128], StateDtype::F32),
            },
            160,
            &[1, 16, 64][..],
        ),
    ];
    println!("| model | slot MiB | pairs | MiB copied | copy us | copy GB/s | memcpy us | memcpy GB/s | copy/memcpy | zero us | zero GB/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, cfg, size, batches) in models {
        let mut states = DeviceMambaState::new(&dev, size, &cfg)?;
        // Real data in the states (never time on zeros).
        for c in 0..cfg.conv.len() + 1 {
            let len = states.buffer(c).unwrap().len();
            let data: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            states.upload(&dev, c, &data)?;
        }
        let slot_bytes = states.slot_bytes();
        for &pairs in batches {
            // Sources in the lower half, destinations in the upper half: never chained.
            let half = size as usize / 2;
            let src: Vec<u32> = (0..pairs).map(|i| 1 + (i % half) as u32).collect();
            let dst: Vec<u32> = (0..pairs).map(|i| 1 + (half + i) as u32).collect();
            let (d_src, d_dst) = (DeviceBuffer::from_slice(&src)?, DeviceBuffer::from_slice(&dst)?);
            let bytes = pairs * slot_bytes;
            let reps = (((4usize << 30) / bytes.max(1)).clamp(1, 50)).max(1);
            let copy_us = median_us(&dev, 15, reps, |_| Ok(states.copy(&dev, &d_src, &d_dst)?))?;
            states.take_error(&dev)?;
            let zero_us = median_us(&dev, 15, reps, |_| Ok(states.zero(&dev, &d_dst)?))?;
            states.take_error(&dev)?;
            let a = DeviceBuffer::<u8>::zeroed(bytes)?;
            let b = DeviceBuffer::<u8>::zeroed(bytes)?;
            let mut a_slice: DeviceSlice<u8> = a.index(..);
            a_slice.copy_from(&vec![0x5au8; bytes][..])?;
            let memcpy_us = median_us(&dev, 15, reps, |_| {
                let mut d: DeviceSlice<u8> = b.index(..);
                // SAFETY: two buffers owned here of the same length; both outlive the
                // copy (the timer synchronizes before they are dropped).
                unsafe { d.async_copy_from(&a.index(..), dev.stream())? };
                Ok(())
            })?;
            let gbps = |moved: usize, us: f64| moved as f64 / us / 1e3;
            println!(
                "| {name} | {:.1} | {pairs} | {:.0} | {copy_us:.1} | {:.0} | {memcpy_us:.1} | {:.0} | {:.1}% | {zero_us:.1} | {:.0} |",
                slot_bytes as f64 / (1 << 20) as f64,
                bytes as f64 / (1 << 20) as f64,
                gbps(2 * bytes, copy_us),
                gbps(2 * bytes, memcpy_us),
                100.0 * memcpy_us / copy_us,
                gbps(bytes, zero_us),
            );
        }
    }
    Ok(())
}
