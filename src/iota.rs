//! Ascending fills (`out[k] = base + k`): the bulk work of writing slots.
//!
//! Slots are written as runs of consecutive values: an allocator's claim hands out
//! stretches of consecutive pages, a page is `page_size` consecutive slots, a matched
//! run of a radix node is consecutive slots, and the replay's trace blocks are runs
//! of consecutive tokens. At page size 16, a claimed word of 64 pages is one fill of
//! 1,024 slots. There is no `memset` for such fills, so this module is their one
//! implementation.
//!
//! Three loops write the same values:
//!
//! * the portable loop, which compiles to 16-byte stores without a `target-cpu`;
//! * aligned 32-byte AVX2 stores, two per round;
//! * aligned 64-byte AVX-512 stores, two per round, each a whole cache line.
//!
//! Fills of at least `WIDE_MIN` (64) values take the widest loop that measured faster
//! on the CPU, chosen once at run time; shorter fills take the portable loop, whose
//! fixed cost is lower.
//!
//! * **AMD CPUs with AVX2**: AVX2. On the Zen 5 development machine a fill of 1,024
//!   values into L2-resident memory takes 0.033 ns per value against 0.077 for the
//!   portable loop, and `cache_ops` at page 16 went from 41 to 30 ms. (Zen 4 splits a
//!   512-bit store in two; Zen 5 was not measured with them.)
//! * **Intel CPUs with AVX-512, Ice Lake and later**: AVX-512. On the Xeon hosts of the
//!   GPU machines (Emerald Rapids) a fill of 4,096 values into L1-resident memory takes
//!   87 ns against 110 ns with AVX2 and 88 ns for a `memcpy` of the same bytes, and
//!   `cache_ops` ran 3-7% faster than with the portable loop (`BENCHMARKS.md`, "Issue
//!   8, eighteenth round"). Skylake-generation server cores (Skylake-SP, Cascade Lake,
//!   Cooper Lake), Cannon Lake and the Xeon Phis are left out: they lower the core's
//!   clock for 512-bit instructions, which would slow the rest of the caller's thread.
//! * **Other Intel CPUs**: the portable loop for the general fills. AVX2 measured
//!   faster in isolation there but 8-13% slower on the 150M-token `cache_ops` loop and
//!   no faster at 1M tokens ("Issue 8, tenth round").
//!
//! [`fill_ascending_hot`], for a buffer its owner is about to read (an owned batch of
//! a `SlotPool`), takes AVX2 on every CPU that has it where AVX-512 is not chosen.
//!
//! `KVPOOL_WIDE_FILL` overrides the choice (read once, when the first `SlotPool` or
//! `Trace` is built, never on a hot path: [`prepare`]): `0` the portable loop, `1`
//! AVX2, `512` AVX-512; a loop the CPU cannot run falls back to the next narrower one.
//! The AVX-512 loop needs Rust 1.89 to build (the crate's `rust-version` is older;
//! `build.rs` leaves it out of older builds). The tests below compare every loop the
//! CPU can run with the portable one on every length up to 300 and at every alignment.

/// Fills shorter than this use the portable loop.
#[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
const WIDE_MIN: usize = 64;

/// Choose the loops now. The first choice reads `KVPOOL_WIDE_FILL`, which allocates
/// when it is set, so the constructors of everything that fills (`SlotPool`, and through
/// it every allocator and cache; `Trace`) call this, and no hot path makes the choice.
#[inline]
pub(crate) fn prepare() {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    {
        x86::general();
        x86::hot();
    }
}

/// `out[k] = base + k` (wrapping).
#[inline]
pub(crate) fn fill_ascending(out: &mut [u32], base: u32) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    if out.len() >= WIDE_MIN {
        x86::fill(x86::general(), out, base);
        return;
    }
    fill_portable(out, base);
}

/// [`fill_ascending`] for a buffer that is likely in L1 or L2 (an owned batch of a
/// `SlotPool`, filled and soon read by its owner): AVX2 on every CPU that has AVX2 and
/// does not take AVX-512, Intel's included, where it stores twice the bytes per
/// instruction of the portable loop (a batch of 4,096 indices on the Intel hosts:
/// BENCHMARKS.md, "Owned batches").
#[inline]
pub(crate) fn fill_ascending_hot(out: &mut [u32], base: u32) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    if out.len() >= WIDE_MIN {
        x86::fill(x86::hot(), out, base);
        return;
    }
    fill_portable(out, base);
}

/// The portable fill (the compiler vectorises it at the target's baseline width).
#[inline]
fn fill_portable(out: &mut [u32], base: u32) {
    for (k, o) in out.iter_mut().enumerate() {
        *o = base.wrapping_add(k as u32);
    }
}

#[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
mod x86 {
    use std::arch::x86_64::{__m256i, _mm256_add_epi32, _mm256_set1_epi32, _mm256_setr_epi32, _mm256_store_si256};
    use std::sync::atomic::{AtomicU8, Ordering};

    /// Which loop a fill takes. Only `Cpu` makes one above `Portable`, and only where
    /// the CPU runs it.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Level {
        Portable = 1,
        Avx2 = 2,
        Avx512 = 3,
    }

    /// What the CPU can run, and what measured faster on it (see the module docs).
    #[derive(Clone, Copy)]
    struct Cpu {
        avx2: bool,
        avx512: bool,
        amd: bool,
        /// An Intel core with AVX-512 that does not lower its clock for it.
        intel_avx512: bool,
    }

    impl Cpu {
        fn detect() -> Cpu {
            let avx2 = std::arch::is_x86_feature_detected!("avx2");
            #[cfg(kvpool_avx512)]
            let avx512 = std::arch::is_x86_feature_detected!("avx512f");
            #[cfg(not(kvpool_avx512))]
            let avx512 = false;
            // The vendor string (EBX, EDX, ECX of leaf 0) and the family and model
            // (leaf 1's EAX, with the extended fields).
            let id = std::arch::x86_64::__cpuid(0);
            let vendor = (id.ebx, id.edx, id.ecx);
            let amd = vendor == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
            let intel = vendor == (0x756e_6547, 0x4965_6e69, 0x6c65_746e);
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let family = (eax >> 8) & 0xf;
            let model = ((eax >> 4) & 0xf) | ((eax >> 12) & 0xf0);
            // Skylake-SP / Cascade Lake / Cooper Lake, Cannon Lake, Knights Landing and
            // Knights Mill: 512-bit instructions lower the core's clock.
            let throttles = family == 6 && matches!(model, 0x55 | 0x66 | 0x57 | 0x85);
            Cpu { avx2, avx512, amd, intel_avx512: intel && avx512 && !throttles }
        }

        /// The widest of `want` and narrower levels this CPU runs.
        fn cap(self, want: Level) -> Level {
            match want {
                Level::Avx512 if self.avx512 => Level::Avx512,
                Level::Avx512 | Level::Avx2 if self.avx2 => Level::Avx2,
                _ => Level::Portable,
            }
        }

        /// The level `KVPOOL_WIDE_FILL` asks for, if it asks.
        fn forced(self) -> Option<Level> {
            let want = match std::env::var("KVPOOL_WIDE_FILL").as_deref() {
                Ok("0") => Level::Portable,
                Ok("1") => Level::Avx2,
                Ok("512") => Level::Avx512,
                _ => return None,
            };
            Some(self.cap(want))
        }
    }

    /// A level decided once (0: not yet) by `decide`. Relaxed: every thread decides
    /// the same, so a race only decides twice.
    #[inline]
    fn once(cell: &AtomicU8, decide: fn(Cpu) -> Level) -> Level {
        match cell.load(Ordering::Relaxed) {
            3 => Level::Avx512,
            2 => Level::Avx2,
            1 => Level::Portable,
            _ => {
                let level = decide(Cpu::detect());
                cell.store(level as u8, Ordering::Relaxed);
                level
            }
        }
    }

    /// The loop of the general fills: AVX-512 on Intel cores that do not throttle for
    /// it, AVX2 on AMD, the portable loop elsewhere.
    #[inline]
    pub(super) fn general() -> Level {
        static LEVEL: AtomicU8 = AtomicU8::new(0);
        once(&LEVEL, |cpu| cpu.forced().unwrap_or(general_for(cpu)))
    }

    /// The loop of the hot fills: as [`general`], but AVX2 wherever the CPU has it and
    /// AVX-512 is not chosen.
    #[inline]
    pub(super) fn hot() -> Level {
        static LEVEL: AtomicU8 = AtomicU8::new(0);
        once(&LEVEL, |cpu| cpu.forced().unwrap_or(hot_for(cpu)))
    }

    /// [`general`]'s choice for `cpu` when nothing overrides it.
    fn general_for(cpu: Cpu) -> Level {
        if cpu.intel_avx512 {
            Level::Avx512
        } else if cpu.amd {
            cpu.cap(Level::Avx2)
        } else {
            Level::Portable
        }
    }

    /// [`hot`]'s choice for `cpu` when nothing overrides it.
    fn hot_for(cpu: Cpu) -> Level {
        if cpu.intel_avx512 {
            Level::Avx512
        } else {
            cpu.cap(Level::Avx2)
        }
    }

    #[cfg(test)]
    #[test]
    fn the_choice_follows_the_cpu_and_never_exceeds_it() {
        let cpu = |avx2, avx512, amd, intel_avx512| Cpu { avx2, avx512, amd, intel_avx512 };
        // A recent Intel Xeon, an older one that throttles, an Intel CPU without AVX-512.
        let (xeon, skylake_sp, client) =
            (cpu(true, true, false, true), cpu(true, true, false, false), cpu(true, false, false, false));
        // AMD Zen 4 / 5 (AVX-512, not taken) and a CPU without AVX2.
        let (zen, old) = (cpu(true, true, true, false), cpu(false, false, false, false));
        assert_eq!(
            [xeon, skylake_sp, client, zen, old].map(general_for),
            [Level::Avx512, Level::Portable, Level::Portable, Level::Avx2, Level::Portable]
        );
        assert_eq!(
            [xeon, skylake_sp, client, zen, old].map(hot_for),
            [Level::Avx512, Level::Avx2, Level::Avx2, Level::Avx2, Level::Portable]
        );
        // An override never asks for more than the CPU runs.
        assert_eq!([xeon, client, old].map(|c| c.cap(Level::Avx512)), [Level::Avx512, Level::Avx2, Level::Portable]);
        assert_eq!([xeon, old].map(|c| c.cap(Level::Avx2)), [Level::Avx2, Level::Portable]);
    }

    /// Fill `out` with the loop of `level`.
    #[inline(always)]
    pub(super) fn fill(level: Level, out: &mut [u32], base: u32) {
        match level {
            Level::Portable => super::fill_portable(out, base),
            #[cfg(kvpool_avx512)]
            // SAFETY: `Avx512` comes only from `Cpu::cap` and `Cpu::detect`, which make
            // it only where the CPU supports AVX-512F.
            Level::Avx512 => unsafe { fill_avx512(out, base) },
            // SAFETY: `Avx2` likewise only where the CPU supports AVX2 (and `Avx512`,
            // which a build without the AVX-512 loop never makes, would imply it).
            _ => unsafe { fill_avx2(out, base) },
        }
    }

    /// [`fill_ascending`](super::fill_ascending) with aligned 64-byte stores, two per
    /// round, each a whole cache line. The values before the first 64-byte boundary
    /// and the at most 31 after the last whole pair of lines are written by masked
    /// stores (one for the head, at most two for the tail), so a fill costs a few
    /// stores more than its lines, whatever its length and alignment.
    ///
    /// # Safety
    ///
    /// The CPU must support AVX-512F.
    #[cfg(kvpool_avx512)]
    #[clippy::msrv = "1.89"] // built only by 1.89 and later (`cfg(kvpool_avx512)`, build.rs)
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fill_avx512(out: &mut [u32], base: u32) {
        use std::arch::x86_64::{_mm512_add_epi32, _mm512_mask_storeu_epi32, _mm512_set1_epi32, _mm512_setr_epi32};
        /// The mask of the first `k` lanes (`k <= 16`).
        #[inline(always)]
        fn first(k: usize) -> u16 {
            ((1u32 << k) - 1) as u16
        }
        let n = out.len();
        let p = out.as_mut_ptr();
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        // Values up to the first 64-byte boundary (`out` is 4-byte aligned: 0..=15).
        let head = (out.as_ptr().align_offset(64)).min(n);
        if head > 0 {
            let v = _mm512_add_epi32(_mm512_set1_epi32(base as i32), lanes);
            // SAFETY: the mask selects lanes `0..head`, `head <= n`: only `out[..head]`
            // is written (masked-off lanes are neither written nor faulted on).
            unsafe { _mm512_mask_storeu_epi32(p.cast::<i32>(), first(head), v) };
        }
        // Lanes base + i + 0..16 and + 16..32; 32-bit lane adds wrap, as `wrapping_add`.
        let mut lo = _mm512_add_epi32(_mm512_set1_epi32(base.wrapping_add(head as u32) as i32), lanes);
        let mut hi = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
        let step = _mm512_set1_epi32(32);
        let mut i = head;
        if i + 32 <= n {
            // The loop of `fill_avx2` at twice the width, written out for the same
            // reason (its speed must not move with where the linker puts it).
            //
            // SAFETY: the loop stores 32 values at `p + i` while `i + 32 <= n` (checked
            // before the first round and after each), so every store lies inside
            // `out`, which the `&mut` borrow makes ours to write; `p + i` is 64-byte
            // aligned (`head`, then steps of 128 bytes), as `vmovdqa32` needs. It
            // touches no memory but `out` and no stack, and the CPU supports AVX-512F
            // (this function's contract).
            unsafe {
                core::arch::asm!(
                    ".p2align 6",
                    "2:",
                    "vmovdqa32 zmmword ptr [{p} + 4*{i}], {lo}",
                    "vmovdqa32 zmmword ptr [{p} + 4*{i} + 64], {hi}",
                    "vpaddd {lo}, {lo}, {step}",
                    "vpaddd {hi}, {hi}, {step}",
                    "add {i}, 32",
                    "lea {t}, [{i} + 32]",
                    "cmp {t}, {n}",
                    "jbe 2b",
                    p = in(reg) p,
                    i = inout(reg) i,
                    n = in(reg) n,
                    t = out(reg) _,
                    lo = inout(zmm_reg) lo,
                    hi = inout(zmm_reg) hi,
                    step = in(zmm_reg) step,
                    options(nostack),
                );
            }
        }
        // At most 31 values left, from `p + i` (64-byte aligned when `i < n`): `lo` and
        // `hi` hold their values.
        let left = n - i;
        if left > 0 {
            // SAFETY: the masks select lanes `0..left.min(16)` at `p + i` and
            // `0..left - 16` at `p + i + 16`: exactly `out[i..n]`. The second pointer is
            // formed only when `i + 16 < n`, so it lies inside `out`.
            unsafe {
                _mm512_mask_storeu_epi32(p.add(i).cast::<i32>(), first(left.min(16)), lo);
                if left > 16 {
                    _mm512_mask_storeu_epi32(p.add(i + 16).cast::<i32>(), first(left - 16), hi);
                }
            }
        }
    }

    /// [`fill_ascending`](super::fill_ascending) with aligned 32-byte stores, two per
    /// round: the values before the first 32-byte boundary are written one by one, so
    /// that no store straddles two cache lines (a split store costs about two on Intel
    /// cores, where the unaligned version measured slower than the portable loop).
    ///
    /// # Safety
    ///
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fill_avx2(out: &mut [u32], base: u32) {
        let n = out.len();
        // Values up to the first 32-byte boundary (`out` is 4-byte aligned: 0..=7).
        let head = (out.as_ptr().align_offset(32)).min(n);
        for (k, o) in out[..head].iter_mut().enumerate() {
            *o = base.wrapping_add(k as u32);
        }
        let p = out.as_mut_ptr();
        // Lanes base + i + 0..8 and + 8..16; 32-bit lane adds wrap, as `wrapping_add`.
        let first = base.wrapping_add(head as u32) as i32;
        let mut lo = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
        let step = _mm256_set1_epi32(16);
        let mut i = head;
        if i + 16 <= n {
            // The loop of two stores and two adds per 16 values, written out so that
            // it starts on a 64-byte boundary whatever the code around it: compiled,
            // its speed on Zen 5 moved by 10-30% with where the linker happened to put
            // it, which made every change elsewhere in the crate look faster or slower
            // (BENCHMARKS, issue 8, twelfth round). The padding before it runs once
            // per call.
            //
            // SAFETY: the loop stores 16 values at `p + i` while `i + 16 <= n` (checked
            // before the first round and after each), so every store lies inside
            // `out`, which the `&mut` borrow makes ours to write; `p + i` is 32-byte
            // aligned (`head`, then steps of 64 bytes), as `vmovdqa` needs. It touches
            // no memory but `out` and no stack, and the CPU supports AVX2 (this
            // function's contract).
            unsafe {
                core::arch::asm!(
                    ".p2align 6",
                    "2:",
                    "vmovdqa ymmword ptr [{p} + 4*{i}], {lo}",
                    "vmovdqa ymmword ptr [{p} + 4*{i} + 32], {hi}",
                    "vpaddd {lo}, {lo}, {step}",
                    "vpaddd {hi}, {hi}, {step}",
                    "add {i}, 16",
                    "lea {t}, [{i} + 16]",
                    "cmp {t}, {n}",
                    "jbe 2b",
                    p = in(reg) p,
                    i = inout(reg) i,
                    n = in(reg) n,
                    t = out(reg) _,
                    lo = inout(ymm_reg) lo,
                    hi = inout(ymm_reg) hi => _,
                    step = in(ymm_reg) step,
                    options(nostack),
                );
            }
        }
        if i + 8 <= n {
            // SAFETY: `i + 8 <= n`: the store lies inside `out`; aligned as above.
            unsafe { _mm256_store_si256(p.add(i).cast::<__m256i>(), lo) };
            i += 8;
        }
        for (k, o) in out.iter_mut().enumerate().skip(i) {
            *o = base.wrapping_add(k as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fill loop under test, with its name.
    type Loop = (&'static str, fn(&mut [u32], u32));

    /// Every loop this CPU (and build) can run, each through the dispatch's own `fill`.
    fn every_loop() -> Vec<Loop> {
        let mut loops: Vec<Loop> = vec![("portable", fill_portable)];
        #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
        {
            use x86::Level;
            loops.push(("general", fill_ascending));
            loops.push(("hot", fill_ascending_hot));
            if std::arch::is_x86_feature_detected!("avx2") {
                loops.push(("avx2", |o, b| x86::fill(Level::Avx2, o, b)));
            }
            #[cfg(kvpool_avx512)]
            if std::arch::is_x86_feature_detected!("avx512f") {
                loops.push(("avx512", |o, b| x86::fill(Level::Avx512, o, b)));
            }
        }
        loops
    }

    #[test]
    fn every_loop_matches_the_portable_fill_at_every_length_and_alignment() {
        let mut buf = vec![0u32; 340];
        let mut want = vec![0u32; 340];
        for (name, fill) in every_loop() {
            for base in [0u32, 1, 1000, u32::MAX - 100, u32::MAX] {
                // 16 starts: every 4-byte offset from a 64-byte line.
                for start in 0..16 {
                    for len in 0..=300 {
                        buf.fill(7);
                        want.fill(7);
                        fill(&mut buf[start..start + len], base);
                        fill_portable(&mut want[start..start + len], base);
                        assert_eq!(buf, want, "{name}: base {base}, start {start}, len {len}");
                    }
                }
            }
        }
        // The values themselves, once, past the wide threshold and across the wrap.
        fill_ascending(&mut buf[..100], u32::MAX - 1);
        assert_eq!(&buf[..4], &[u32::MAX - 1, u32::MAX, 0, 1]);
        assert_eq!(buf[99], 97);
    }
}
