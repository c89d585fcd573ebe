//! Fallible construction of the cache's fixed arenas: sizes are computed with checked
//! arithmetic and reserved with `try_reserve_exact`, so a configuration too large for
//! the machine is a [`ConfigError::TooLargeForMemory`] naming the bytes, never an abort.

use crate::ConfigError;

/// `n` elements made by `f`, in a boxed slice reserved fallibly.
pub(super) fn boxed<T>(what: &'static str, n: usize, f: impl FnMut(usize) -> T) -> Result<Box<[T]>, ConfigError> {
    let bytes = crate::arena::bytes_of::<T>(n);
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| ConfigError::TooLargeForMemory { what, bytes })?;
    v.extend((0..n).map(f));
    Ok(v.into_boxed_slice())
}

/// An empty vector with room for `n` elements, reserved fallibly.
pub(super) fn with_capacity<T>(what: &'static str, n: usize) -> Result<Vec<T>, ConfigError> {
    let bytes = crate::arena::bytes_of::<T>(n);
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| ConfigError::TooLargeForMemory { what, bytes })?;
    Ok(v)
}
