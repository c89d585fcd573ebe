//! Fallible sizing of the arenas that constructors allocate once: sizes are computed
//! with checked arithmetic and memory is reserved with `try_reserve_exact`, so a
//! configuration too large for the machine is a [`ConfigError::TooLargeForMemory`]
//! that says how many bytes it needs, never an abort in the global allocator.
//!
//! On Linux (x86-64 and AArch64), an arena of [`HUGE_MIN_BYTES`] or more is advised as
//! transparent huge pages (`madvise(MADV_HUGEPAGE)`) when it is reserved, before anything
//! is written to it. Most arenas are written whole at construction ([`try_vec_with`]), so
//! they are resident either way and huge pages cost them no memory; one that its owner
//! fills later (a free list, the eviction heap) commits memory 2 MiB at a time instead of
//! 4 KiB, so at most one partly used huge page more than its contents. What huge pages
//! save is the hot paths' TLB misses (a radix cache for 150 M tokens spreads its
//! look-ups over gigabytes: one 2 MiB page covers what 512 small ones do) and most of
//! construction's page faults. Where the system's policy
//! (`/sys/kernel/mm/transparent_hugepage/enabled`) is `never`, or the kernel has no huge
//! pages, the advice is refused and nothing changes; with `always`, the kernel gives
//! huge pages without it.

use crate::error::ConfigError;

/// The bytes of `len` values of `T`, or `u64::MAX` when that overflows.
pub(crate) fn bytes_of<T>(len: usize) -> u64 {
    (len as u64).saturating_mul(core::mem::size_of::<T>() as u64)
}

/// A vector of `len` values, `fill(i)` at index `i`, its memory reserved fallibly
/// first. Every element is written here, so the arena is committed at construction.
///
/// # Errors
///
/// [`ConfigError::TooLargeForMemory`] naming `what` if the memory cannot be reserved.
pub(crate) fn try_vec_with<T>(
    len: usize,
    what: &'static str,
    fill: impl FnMut(usize) -> T,
) -> Result<Vec<T>, ConfigError> {
    let mut v = try_with_capacity(len, what)?;
    v.extend((0..len).map(fill));
    Ok(v)
}

/// An empty vector with room for `len` values, reserved fallibly.
///
/// # Errors
///
/// [`ConfigError::TooLargeForMemory`] naming `what` if the memory cannot be reserved.
pub(crate) fn try_with_capacity<T>(len: usize, what: &'static str) -> Result<Vec<T>, ConfigError> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len).map_err(|_| ConfigError::TooLargeForMemory { what, bytes: bytes_of::<T>(len) })?;
    let bytes = v.capacity().saturating_mul(core::mem::size_of::<T>());
    if bytes >= HUGE_MIN_BYTES {
        advise_huge(v.as_mut_ptr().cast(), bytes);
    }
    Ok(v)
}

/// The smallest arena advised as huge pages: two 2 MiB pages, so that at least one
/// whole, aligned huge page lies inside it wherever the allocator placed it.
const HUGE_MIN_BYTES: usize = 2 * HUGE_PAGE;

/// The huge page size the advice aims at (x86-64 and AArch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Advise the whole huge pages inside `bytes` bytes from `start` as transparent huge
/// pages. Returns whether the kernel took the advice (`false` where there is nothing
/// to advise, on other systems, and under loom or Miri).
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"), not(loom), not(miri)))]
fn advise_huge(start: *mut u8, bytes: usize) -> bool {
    // `MADV_HUGEPAGE` on both architectures (asm-generic/mman-common.h).
    const MADV_HUGEPAGE: i32 = 14;
    extern "C" {
        fn madvise(addr: *mut core::ffi::c_void, len: usize, advice: i32) -> i32;
    }
    let lo = (start as usize).next_multiple_of(HUGE_PAGE);
    let hi = (start as usize).saturating_add(bytes) & !(HUGE_PAGE - 1);
    if hi <= lo {
        return false;
    }
    // The advice covers whole huge pages inside the caller's allocation.
    let at = start.wrapping_add(lo - start as usize).cast();
    // SAFETY: `madvise` with `MADV_HUGEPAGE` only changes how the kernel backs the
    // range (its contents and mapping stay as they are), and the range lies inside
    // memory the caller owns. It is a system call: no Rust invariant is involved.
    unsafe { madvise(at, hi - lo, MADV_HUGEPAGE) == 0 }
}

/// See the Linux version: nothing to do elsewhere.
#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"), not(loom), not(miri))))]
fn advise_huge(_start: *mut u8, _bytes: usize) -> bool {
    false
}

/// Check that `bytes` could be reserved now, for arenas built by code that allocates
/// infallibly: reserve them (untouched) and give them back at once. A check, not a
/// guarantee (memory can run out between the check and the allocation, and a system
/// that overcommits accepts anything), but it turns the common case, a configuration
/// far larger than the machine, into an error instead of an abort.
///
/// # Errors
///
/// [`ConfigError::TooLargeForMemory`] naming `what` if the reservation fails.
pub(crate) fn probe(bytes: u64, what: &'static str) -> Result<(), ConfigError> {
    let err = ConfigError::TooLargeForMemory { what, bytes };
    let n = usize::try_from(bytes).ok().filter(|&n| n <= isize::MAX as usize).ok_or_else(|| err.clone())?;
    Vec::<u8>::new().try_reserve_exact(n).map_err(|_| err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors() {
        assert_eq!(bytes_of::<u32>(usize::MAX), u64::MAX);
        let e = try_vec_with(usize::MAX / 2, "table", |_| 0u32).unwrap_err();
        assert_eq!(e, ConfigError::TooLargeForMemory { what: "table", bytes: u64::MAX });
        assert!(probe(u64::MAX, "x").is_err());
        assert!(probe(1 << 62, "x").unwrap_err().to_string().contains("4611686018427387904 bytes"));
        assert_eq!(try_vec_with(3, "t", |_| 7u8).unwrap(), [7, 7, 7]);
        probe(4096, "x").unwrap();
    }

    /// A large arena is advised as huge pages: where the kernel takes the advice, the
    /// mapping that holds the arena's aligned interior carries the `hg` flag
    /// (`VM_HUGEPAGE`) in `/proc/self/smaps`. The flag is set by the advice itself, so
    /// this does not depend on the kernel finding free huge pages.
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
    #[test]
    fn large_arenas_are_advised_as_huge_pages() {
        let flags_at = |addr: usize| -> Option<String> {
            let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
            let mut inside = false;
            for line in smaps.lines() {
                let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
                let bounds = range
                    .and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?)));
                if let Some((a, b)) = bounds.filter(|_| !line.starts_with("VmFlags")) {
                    inside = (a..b).contains(&addr);
                } else if inside && line.starts_with("VmFlags:") {
                    return Some(line.to_string());
                }
            }
            None
        };
        // Nothing whole to advise in 8 KiB.
        let small = try_vec_with(1024, "small", |_| 0u64).unwrap();
        assert!(!advise_huge(small.as_ptr() as *mut u8, 8 * 1024));
        let v = try_vec_with(3 * HUGE_PAGE / 8, "large", |i| i as u64).unwrap();
        let inner = (v.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let flags = flags_at(inner).expect("the arena's mapping is listed");
        // Ask again on the same range: if the kernel refuses (no THP), so did the arena.
        let bytes = v.len() * 8;
        if advise_huge(v.as_ptr() as *mut u8, bytes) {
            assert!(flags.split_whitespace().any(|f| f == "hg"), "no huge page advice in {flags}");
        }
        assert_eq!(v[12345], 12345, "the advice changes no contents");
    }
}
