//! Fallible sizing of the arenas that constructors allocate once: sizes are computed
//! with checked arithmetic and memory is reserved with `try_reserve_exact`, so a
//! configuration too large for the machine is a [`ConfigError::TooLargeForMemory`]
//! that says how many bytes it needs, never an abort in the global allocator.

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
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| ConfigError::TooLargeForMemory { what, bytes: bytes_of::<T>(len) })?;
    Ok(v)
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
}
