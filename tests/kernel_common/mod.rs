//! What the kernel tests share: a small deterministic generator, and (feature `cuda`)
//! the device to run on, or `None` with a "no CUDA device" line when there is none
//! (`KVPOOL_REQUIRE_GPU=1` makes that a failure).
#![allow(dead_code)] // each test file uses a part

/// xorshift64: deterministic, no dependencies. Seed it with a nonzero value (or
/// through [`Rng::new`], which makes any seed nonzero).
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A value below `n` (0 for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// `n` distinct values below `m`, shuffled.
    pub fn distinct(&mut self, n: usize, m: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..m as u32).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
        v.truncate(n);
        v
    }
}

/// Device 0 with kvpool's modules for its own target, or `None` without a device.
#[cfg(feature = "cuda")]
pub fn device() -> Option<kvpool::cuda::KvDevice> {
    has_device().then(|| kvpool::cuda::KvDevice::new(0).expect("open CUDA device 0 and load kvpool's modules"))
}

/// Device 0 with the PTX of at most `max_target` (80: the sm_80 code on any device).
#[cfg(feature = "cuda")]
pub fn device_with_target(max_target: u32) -> Option<kvpool::cuda::KvDevice> {
    has_device().then(|| kvpool::cuda::KvDevice::with_target(0, max_target).expect("open CUDA device 0"))
}

#[cfg(feature = "cuda")]
fn has_device() -> bool {
    let required = std::env::var_os("KVPOOL_REQUIRE_GPU").is_some();
    match kvpool::cuda::KvDevice::count() {
        Ok(n) if n > 0 => true,
        other => {
            assert!(!required, "KVPOOL_REQUIRE_GPU is set but there is no CUDA device: {other:?}");
            println!("no CUDA device ({other:?}): skipping");
            false
        }
    }
}
