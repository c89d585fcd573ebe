//! Ascending fills (`out[k] = base + k`): the bulk work of writing slots.
//!
//! Slots are written as runs of consecutive values: an allocator's claim hands out
//! stretches of consecutive pages, a page is `page_size` consecutive slots, a matched
//! run of a radix node is consecutive slots, and the replay's trace blocks are runs
//! of consecutive tokens. At page size 16, a claimed word of 64 pages is one fill of
//! 1,024 slots. There is no `memset` for such fills, so this module is their one
//! implementation.
//!
//! The portable loop compiles to 16-byte stores without a `target-cpu`. On x86-64
//! CPUs with AVX2 (detected at run time, once, by the standard library), fills of at
//! least [`WIDE_MIN`] values use 32-byte stores instead: on an AMD Zen 5 core a fill
//! of 1,024 values into L2-resident memory takes 0.029 ns per value against 0.077 for
//! the portable loop (`BENCHMARKS.md`, "Issue 8, tenth round"). Shorter fills stay on
//! the portable loop, whose fixed cost is lower. Both write the same values; the
//! tests below compare them on every length up to 300 and at every alignment.

/// Fills shorter than this use the portable loop.
const WIDE_MIN: usize = 64;

/// `out[k] = base + k` (wrapping).
#[inline]
pub(crate) fn fill_ascending(out: &mut [u32], base: u32) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    if out.len() >= WIDE_MIN && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { x86::fill_avx2(out, base) };
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
    use std::arch::x86_64::{__m256i, _mm256_add_epi32, _mm256_set1_epi32, _mm256_setr_epi32, _mm256_storeu_si256};

    /// [`fill_ascending`](super::fill_ascending) with 32-byte stores, two per round.
    ///
    /// # Safety
    ///
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fill_avx2(out: &mut [u32], base: u32) {
        let n = out.len();
        let p = out.as_mut_ptr();
        // Lanes base + 0..8 and base + 8..16; 32-bit lane adds wrap, as `wrapping_add`.
        let mut lo = _mm256_add_epi32(_mm256_set1_epi32(base as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let mut hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
        let step = _mm256_set1_epi32(16);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`, so both 8-value stores lie inside `out`, which the
            // `&mut` borrow makes ours to write; `storeu` needs no alignment.
            unsafe {
                _mm256_storeu_si256(p.add(i).cast::<__m256i>(), lo);
                _mm256_storeu_si256(p.add(i + 8).cast::<__m256i>(), hi);
            }
            lo = _mm256_add_epi32(lo, step);
            hi = _mm256_add_epi32(hi, step);
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: `i + 8 <= n`: the store lies inside `out`.
            unsafe { _mm256_storeu_si256(p.add(i).cast::<__m256i>(), lo) };
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

    #[test]
    fn every_length_and_alignment_matches_the_portable_fill() {
        let mut buf = vec![0u32; 320];
        let mut want = vec![0u32; 320];
        for base in [0u32, 1, 1000, u32::MAX - 100, u32::MAX] {
            for start in 0..8 {
                for len in 0..=300 {
                    buf.fill(7);
                    want.fill(7);
                    fill_ascending(&mut buf[start..start + len], base);
                    fill_portable(&mut want[start..start + len], base);
                    assert_eq!(buf, want, "base {base}, start {start}, len {len}");
                }
            }
        }
        // The values themselves, once, past the wide threshold and across the wrap.
        fill_ascending(&mut buf[..100], u32::MAX - 1);
        assert_eq!(&buf[..4], &[u32::MAX - 1, u32::MAX, 0, 1]);
        assert_eq!(buf[99], 97);
    }
}
