//! GPU test of the `mamba_state` kernels against their host reference
//! (`kvpool::mamba::reference_copy`): random states, random batches of (src, dst)
//! pairs, zeroing, an out-of-range slot, every vector width the layouts select, the
//! sm_80 and the sm_90 PTX. Every buffer is compared whole, so a byte written where it
//! should not be is caught.
//!
//! Without a CUDA device each test prints "no CUDA device" and returns; set
//! `KVPOOL_REQUIRE_GPU=1` to make that a failure.
#![cfg(feature = "cuda")]

use cust::memory::DeviceBuffer;
use kvpool::cuda::mamba::{check_mamba_signatures, DeviceMambaState};
use kvpool::cuda::{CudaKvError, KvDevice};
use kvpool::mamba::{reference_copy, MambaConfig, StateDtype, StateShape};

mod kernel_common;

use kernel_common::{device_with_target as device, Rng};

/// Layouts whose rows select vector widths 16, 8, 4 and 2.
fn configs() -> Vec<(MambaConfig, u32)> {
    let s = StateShape::new;
    vec![
        (
            MambaConfig {
                layers: 3,
                conv: vec![s(&[64, 3], StateDtype::Bf16)],
                temporal: s(&[4, 16, 16], StateDtype::F32),
            },
            16,
        ),
        (MambaConfig { layers: 2, conv: vec![s(&[4, 3], StateDtype::F16)], temporal: s(&[2, 8], StateDtype::F32) }, 8),
        (
            MambaConfig {
                layers: 2,
                conv: vec![s(&[6], StateDtype::Bf16), s(&[10], StateDtype::F16)],
                temporal: s(&[3, 3], StateDtype::F32),
            },
            4,
        ),
        (
            MambaConfig {
                layers: 4,
                conv: vec![s(&[5, 3], StateDtype::Bf16), s(&[7], StateDtype::F16), s(&[1], StateDtype::Bf16)],
                temporal: s(&[3, 3, 3], StateDtype::F32),
            },
            2,
        ),
        // Rows of many blocks (the grid-stride loop and its tail): 24576 and 529416
        // bytes, so width 8 and 66177 vectors in the temporal row.
        (
            MambaConfig {
                layers: 1,
                conv: vec![s(&[4096, 3], StateDtype::Bf16)],
                temporal: s(&[2, 513, 129], StateDtype::F32),
            },
            8,
        ),
        // Width 16 with large rows (the bench's row shapes).
        (
            MambaConfig {
                layers: 2,
                conv: vec![s(&[8192, 3], StateDtype::Bf16)],
                temporal: s(&[4, 128, 128], StateDtype::F32),
            },
            16,
        ),
    ]
}

fn check_layout(dev: &KvDevice, cfg: &MambaConfig, want_vec: u32, rng: &mut Rng) -> Result<(), CudaKvError> {
    let size = 37u32;
    let num_rows = size + 1;
    let mut states = DeviceMambaState::new(dev, size, cfg)?;
    assert_eq!(states.vector_bytes(), want_vec, "{cfg:?}");
    let rows: Vec<usize> = states.row_bytes().to_vec();
    let mut host: Vec<Vec<u8>> = rows
        .iter()
        .map(|&r| (0..r * num_rows as usize * cfg.layers as usize).map(|_| rng.next() as u8).collect())
        .collect();
    for (c, h) in host.iter().enumerate() {
        states.upload(dev, c, h)?;
    }
    for round in 0..6 {
        // Distinct destinations; sources never among them (the kernel's contract).
        let mut perm: Vec<u32> = (0..num_rows).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let n = 1 + rng.below(size as u64 / 2) as usize;
        let dst: Vec<u32> = perm[..n].to_vec();
        let src: Vec<u32> = (0..n).map(|_| perm[n + rng.below((num_rows as usize - n) as u64) as usize]).collect();
        let zero = round % 3 == 2;
        let (d_src, d_dst) = (DeviceBuffer::from_slice(&src)?, DeviceBuffer::from_slice(&dst)?);
        if zero {
            states.zero(dev, &d_dst)?;
        } else {
            states.copy(dev, &d_src, &d_dst)?;
        }
        states.take_error(dev)?;
        let mut views: Vec<&mut [u8]> = host.iter_mut().map(|h| h.as_mut_slice()).collect();
        assert!(!reference_copy(&mut views, &rows, cfg.layers, num_rows, (!zero).then_some(&src[..]), &dst));
        for (c, h) in host.iter().enumerate() {
            let mut got = vec![0u8; h.len()];
            states.download(dev, c, &mut got)?;
            assert!(got == *h, "component {c} differs after round {round} (zero {zero}) of {cfg:?}");
        }
    }
    // An out-of-range slot is skipped and flagged; the other pairs are done.
    let (src, dst) = ([1u32, 2], [3u32, num_rows]);
    let (d_src, d_dst) = (DeviceBuffer::from_slice(&src)?, DeviceBuffer::from_slice(&dst)?);
    states.copy(dev, &d_src, &d_dst)?;
    assert!(matches!(states.take_error(dev), Err(CudaKvError::DeviceSlotOutOfRange)));
    states.take_error(dev)?; // cleared
    let mut views: Vec<&mut [u8]> = host.iter_mut().map(|h| h.as_mut_slice()).collect();
    assert!(reference_copy(&mut views, &rows, cfg.layers, num_rows, Some(&src), &dst));
    for (c, h) in host.iter().enumerate() {
        let mut got = vec![0u8; h.len()];
        states.download(dev, c, &mut got)?;
        assert!(got == *h, "component {c} differs after the out-of-range batch");
    }
    Ok(())
}

#[test]
fn signatures_match_without_a_device() {
    check_mamba_signatures().unwrap();
}

#[test]
fn copy_and_zero_match_the_host_reference() {
    for target in [80, 90] {
        let Some(dev) = device(target) else { return };
        println!("device: {} (PTX sm_{})", dev.name().unwrap(), dev.ptx_target());
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ target as u64);
        for (cfg, vec) in configs() {
            check_layout(&dev, &cfg, vec, &mut rng).unwrap();
        }
    }
}

#[test]
fn too_many_components_are_refused() {
    let Some(dev) = device(90) else { return };
    let s = StateShape::new(&[8], StateDtype::F32);
    let cfg = MambaConfig { layers: 1, conv: vec![s.clone(), s.clone(), s.clone(), s.clone()], temporal: s };
    assert!(matches!(DeviceMambaState::new(&dev, 4, &cfg), Err(CudaKvError::Config(_))));
}
