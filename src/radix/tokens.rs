//! The token of every cached slot, packed two to a 64-bit atomic word.
//!
//! Lock-free lookups read these cells while the latch holder may be writing them (a
//! lookup can hold a record that is being evicted and whose pages are being reused), so
//! every access is atomic: the writer copies a run of tokens with one 64-bit `Relaxed`
//! store per two tokens (half the stores of one per token; the loop is the hot spot of
//! caching a request), and readers load words. Readers validate what they read
//! afterwards (see the module docs of `radix`), so a torn or stale word is harmless.
//!
//! Slot `s` is the `u32` at byte offset `4 * s` of the array: the low-addressed half of
//! word `s / 2` when `s` is even. The latch holder, which no write can race, reads the
//! array as plain `u32` memory (one `memcmp` per run).

use crate::sync::atomic::{AtomicU64, Ordering};

pub(super) struct Tokens {
    words: Box<[AtomicU64]>,
    slots: usize,
}

/// The word holding slots `2k` (first in memory) and `2k + 1`.
#[inline]
fn pack(even: u32, odd: u32) -> u64 {
    let mut bytes = [0u8; 8];
    bytes[..4].copy_from_slice(&even.to_ne_bytes());
    bytes[4..].copy_from_slice(&odd.to_ne_bytes());
    u64::from_ne_bytes(bytes)
}

#[inline]
fn unpack(word: u64) -> (u32, u32) {
    let b = word.to_ne_bytes();
    (u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), u32::from_ne_bytes([b[4], b[5], b[6], b[7]]))
}

impl Tokens {
    pub(super) fn new(slots: usize) -> Result<Self, crate::ConfigError> {
        let words = super::arena::boxed("radix slot tokens", slots.div_ceil(2), |_| AtomicU64::new(0))?;
        Ok(Tokens { words, slots })
    }

    /// The token of `slot` (an atomic load).
    #[inline]
    pub(super) fn get(&self, slot: usize) -> u32 {
        let (even, odd) = unpack(self.words[slot / 2].load(Ordering::Relaxed));
        if slot % 2 == 0 {
            even
        } else {
            odd
        }
    }

    /// The index of the first of `key.len()` tokens from `slot` that differs from
    /// `key` (`key.len()` when all match), with atomic loads: for lock-free readers.
    pub(super) fn first_diff_atomic(&self, slot: usize, key: &[u32]) -> usize {
        (0..key.len()).find(|&k| self.get(slot + k) != key[k]).unwrap_or(key.len())
    }

    /// The tokens of `slot..slot + len` as plain memory.
    ///
    /// # Safety
    ///
    /// No write to these cells may happen while the slice lives: the caller holds the
    /// radix latch (only its holder writes tokens). Concurrent atomic loads are fine.
    #[cfg(not(loom))]
    pub(super) unsafe fn plain(&self, slot: usize, len: usize) -> &[u32] {
        assert!(slot + len <= self.slots, "token range out of bounds");
        // SAFETY: `AtomicU64` has the size and alignment of `u64`, so the array is
        // `2 * words.len()` initialised, 4-aligned `u32`s, and slot `s` is the `s`-th of
        // them (see the module docs); the range is in bounds (asserted); no write races
        // the read (the caller's contract).
        unsafe { core::slice::from_raw_parts(self.words.as_ptr().cast::<u32>().add(slot), len) }
    }

    /// Store `tokens` into slots `slot..slot + tokens.len()`. Only the latch holder
    /// writes, so a word shared with a neighbouring slot is read, merged and stored back
    /// without a race on the other half.
    pub(super) fn write(&self, slot: usize, tokens: &[u32]) {
        if tokens.is_empty() {
            return;
        }
        assert!(slot + tokens.len() <= self.slots, "token range out of bounds");
        let mut s = slot;
        let mut t = tokens;
        if s % 2 == 1 {
            let w = &self.words[s / 2];
            let (even, _) = unpack(w.load(Ordering::Relaxed));
            w.store(pack(even, t[0]), Ordering::Relaxed);
            s += 1;
            t = &t[1..];
        }
        let pairs = t.len() / 2;
        for (w, pair) in self.words[s / 2..s / 2 + pairs].iter().zip(t.chunks_exact(2)) {
            w.store(pack(pair[0], pair[1]), Ordering::Relaxed);
        }
        if t.len() % 2 == 1 {
            let w = &self.words[(s + t.len()) / 2];
            let (_, odd) = unpack(w.load(Ordering::Relaxed));
            w.store(pack(t[t.len() - 1], odd), Ordering::Relaxed);
        }
    }
}
