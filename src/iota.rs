//! Ascending fills (`out[k] = base + k`): the bulk work of writing slots.
//!
//! Slots are written as runs of consecutive values: an allocator's claim hands out
//! stretches of consecutive pages, a page is `page_size` consecutive slots, a matched
//! run of a radix node is consecutive slots, and the replay's trace blocks are runs
//! of consecutive tokens. At page size 16, a claimed word of 64 pages is one fill of
//! 1,024 slots. There is no `memset` for such fills, so this module is their one
//! implementation.
//!
//! The portable loop compiles to 16-byte stores without a `target-cpu`. Where it
//! measured faster, fills of at least `WIDE_MIN` (64) values use aligned 32-byte AVX2
//! stores instead: on AMD CPUs with AVX2 (detected at run time, once). On the AMD Zen
//! 5 development machine a fill of 1,024 values into L2-resident memory takes 0.033 ns
//! per value against 0.077 for the portable loop, and `cache_ops` at page 16 went from
//! 41 to 30 ms. On the Intel Xeon hosts of the GPU machines the same path measured
//! faster in isolation but 8-13% slower on the 150M-token `cache_ops` loop and no
//! faster at 1M tokens (`BENCHMARKS.md`, "Issue 8, tenth round"), so Intel CPUs keep
//! the portable loop. `KVPOOL_WIDE_FILL=1` or `=0` overrides the choice (read once).
//! Shorter fills always take the portable loop, whose fixed cost is lower. Both write
//! the same values; the tests below compare them on every length up to 300 and at
//! every alignment.

/// Fills shorter than this use the portable loop.
#[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
const WIDE_MIN: usize = 64;

/// `out[k] = base + k` (wrapping).
#[inline]
pub(crate) fn fill_ascending(out: &mut [u32], base: u32) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    let wide = x86::wide;
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(loom))))]
    let wide = || false;
    fill_with(out, base, wide);
}

/// [`fill_ascending`] for a buffer that is likely in L1 or L2 (an owned batch of a
/// `SlotPool`, filled and soon read by its owner): the AVX2 path on every CPU that has
/// AVX2, Intel's included, where it stores twice the bytes per instruction of the
/// portable loop (a batch of 4,096 indices on the Intel hosts: BENCHMARKS.md, "Owned
/// batches"). `KVPOOL_WIDE_FILL=0` turns it off too.
#[inline]
pub(crate) fn fill_ascending_hot(out: &mut [u32], base: u32) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    let wide = x86::avx2;
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(loom))))]
    let wide = || false;
    fill_with(out, base, wide);
}

/// The AVX2 fill when the slice is long enough and `wide()` says so (`wide` must only
/// say so where the CPU supports AVX2), the portable one otherwise.
#[inline(always)]
fn fill_with(out: &mut [u32], base: u32, wide: impl FnOnce() -> bool) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    if out.len() >= WIDE_MIN && wide() {
        // SAFETY: `wide` holds only where the CPU supports AVX2 (the caller's promise).
        unsafe { x86::fill_avx2(out, base) };
        return;
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(loom))))]
    let _ = wide;
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

    /// Whether fills take the AVX2 path (see the module docs); decided on first use.
    #[inline]
    pub(super) fn wide() -> bool {
        // 0: not decided yet, 1: portable, 2: AVX2. Relaxed: every thread decides
        // the same, so a race only decides twice.
        static WIDE: AtomicU8 = AtomicU8::new(0);
        match WIDE.load(Ordering::Relaxed) {
            0 => {
                let wide = decide();
                WIDE.store(if wide { 2 } else { 1 }, Ordering::Relaxed);
                wide
            }
            w => w == 2,
        }
    }

    /// Whether the hot fills take the AVX2 path: the CPU has AVX2 and
    /// `KVPOOL_WIDE_FILL` is not `0`; decided on first use.
    #[inline]
    pub(super) fn avx2() -> bool {
        // As in `wide`.
        static AVX2: AtomicU8 = AtomicU8::new(0);
        match AVX2.load(Ordering::Relaxed) {
            0 => {
                let yes = std::arch::is_x86_feature_detected!("avx2")
                    && std::env::var("KVPOOL_WIDE_FILL").as_deref() != Ok("0");
                AVX2.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
                yes
            }
            w => w == 2,
        }
    }

    /// AVX2 on an AMD CPU, unless `KVPOOL_WIDE_FILL` says otherwise; never without AVX2.
    #[cold]
    fn decide() -> bool {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return false;
        }
        match std::env::var("KVPOOL_WIDE_FILL").as_deref() {
            Ok("1") => return true,
            Ok("0") => return false,
            _ => {}
        }
        // The vendor string, "AuthenticAMD" (EBX, EDX, ECX of leaf 0).
        let id = std::arch::x86_64::__cpuid(0);
        (id.ebx, id.edx, id.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
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

    /// The AVX2 fill wherever the CPU has AVX2 (whatever [`fill_ascending`] chooses
    /// on it), the portable one elsewhere.
    fn wide_or_not(out: &mut [u32], base: u32) {
        #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { x86::fill_avx2(out, base) };
            return;
        }
        fill_ascending(out, base);
    }

    #[test]
    fn every_length_and_alignment_matches_the_portable_fill() {
        let mut buf = vec![0u32; 320];
        let mut want = vec![0u32; 320];
        for base in [0u32, 1, 1000, u32::MAX - 100, u32::MAX] {
            for start in 0..8 {
                for len in 0..=300 {
                    buf.fill(7);
                    want.fill(7);
                    wide_or_not(&mut buf[start..start + len], base);
                    fill_portable(&mut want[start..start + len], base);
                    assert_eq!(buf, want, "base {base}, start {start}, len {len}");
                    buf.fill(7);
                    fill_ascending_hot(&mut buf[start..start + len], base);
                    assert_eq!(buf, want, "hot: base {base}, start {start}, len {len}");
                }
            }
        }
        // The values themselves, once, past the wide threshold and across the wrap.
        fill_ascending(&mut buf[..100], u32::MAX - 1);
        assert_eq!(&buf[..4], &[u32::MAX - 1, u32::MAX, 0, 1]);
        assert_eq!(buf[99], 97);
    }
}
