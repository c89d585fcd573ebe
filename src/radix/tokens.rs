//! The token of every cached slot, packed two to a 64-bit atomic word.
//!
//! Lock-free lookups read these cells while the latch holder may be writing them (a
//! lookup can hold a record that is being evicted and whose pages are being reused), so
//! every access is atomic: the writer copies a run of tokens with one 64-bit `Relaxed`
//! store per two tokens (half the stores of one per token; the loop is the hot spot of
//! caching a request), and readers load words. Readers validate what they read
//! afterwards (see the module docs of `radix`), so a torn or stale word is harmless.
//!
//! Long runs are stored with one string instruction (`rep movsq`) on x86-64: see
//! `string_copy` for why that is the same as the loop of `Relaxed` stores. In an
//! array of [`STREAM_MIN_BYTES`] or more, runs of a request's tokens are stored with
//! non-temporal stores instead (`stream_copy`): there the cells written are rarely still
//! cached when they are next read, and a store that does not fetch its line first
//! moves half the bytes.
//!
//! Slot `s` is the `u32` at byte offset `4 * s` of the array: the low-addressed half of
//! word `s / 2` when `s` is even. The latch holder, which no write can race, reads the
//! array as plain `u32` memory (one vectorized compare per run).

use crate::sync::atomic::{AtomicU64, Ordering};

pub(super) struct Tokens {
    words: Box<[AtomicU64]>,
    slots: usize,
    /// Store long runs of [`write`](Self::write) with non-temporal stores.
    stream: bool,
}

/// Token arrays of this many bytes or more (16 M slots) store long runs with
/// non-temporal stores. Measured with the `cache_ops` loop (BENCHMARKS.md, "Streaming
/// token stores"): on a 16-core Xeon (2 MiB of L2 per core) streaming was mostly 5-15%
/// faster from 16 M slots up and 20-23% slower at 4 M; the 2-core development VM
/// crosses over between 4 M and 8 M. The threshold sits at the larger crossover: an array this big
/// is far beyond any core's share of the last-level cache.
const STREAM_MIN_BYTES: usize = 64 << 20;

/// Words from which a run is streamed (in an array that streams): 4 KiB, so the fence
/// that ends a streamed run is a small share of it.
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
const STREAM_MIN_WORDS: usize = 512;

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

/// Words from which [`store_words`] and [`copy_words`] use the string copy: below this
/// the loop of stores is as fast (the string instruction has a start-up cost of a few
/// dozen cycles).
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
const STRING_MIN_WORDS: usize = 32;

/// Copy `dst.len()` 8-byte words from `src` into `dst` with one `rep movsq`.
///
/// LLVM cannot merge or vectorize atomic stores, and the loop of 64-bit stores was the
/// hot spot of caching a request; the string instruction moves the same bytes at
/// memory-copy speed (and, for long runs, without reading the destination lines first).
/// Why it is the same as that loop, for readers: each of its element stores is an
/// aligned 8-byte store, which x86-64 performs single-copy atomically, like a `Relaxed`
/// `AtomicU64` store; the element stores of one string instruction may become visible
/// in any order, which `Relaxed` stores to different words allow anyway; and the whole
/// instruction is ordered before later stores in program order (the fence that
/// publishes a record follows it). Readers validate what they read in any case (module
/// docs).
///
/// # Safety
///
/// `src` is valid for reads of `8 * dst.len()` bytes that nothing writes meanwhile, and
/// does not overlap `dst`; the caller is the only writer of `dst` (the latch holder).
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
#[inline]
unsafe fn string_copy(dst: &[AtomicU64], src: *const u8) {
    // SAFETY: `dst` is `dst.len()` initialised, 8-aligned `AtomicU64`s, so every element
    // store is an aligned 8-byte store; `src` is readable for as many bytes and not
    // written meanwhile (the caller's contract). The only accesses that can race the
    // stores are atomic loads (the caller is the only writer), and each element store
    // is an atomic 8-byte store (see above): no data race. `rcx`, `rsi` and `rdi` are
    // declared clobbered, the direction flag is clear on entry (the Rust ABI guarantees
    // it) and `rep movsq` changes no flag.
    unsafe {
        core::arch::asm!(
            "rep movsq",
            inout("rcx") dst.len() => _,
            inout("rsi") src => _,
            inout("rdi") dst.as_ptr() => _,
            options(nostack, preserves_flags)
        );
    }
}

/// Copy `dst.len()` 8-byte words from `src` into `dst` with non-temporal stores
/// (`movnti`), then `sfence`.
///
/// A non-temporal store writes its line without reading it into the cache first (a
/// `rep movsq` of a few kilobytes, or a loop of ordinary stores, reads every line it
/// writes), which halves the memory traffic of storing tokens into an array far larger
/// than the cache. For readers it is the same as [`string_copy`]: each `movnti` is an
/// aligned 8-byte store, performed single-copy atomically like a `Relaxed` `AtomicU64`
/// store. Non-temporal stores are weakly ordered (a later ordinary store may become
/// visible first); the closing `sfence` orders them all before every later store, so the
/// fence that publishes a record afterwards covers them as it covers ordinary stores.
/// The writing thread's own later loads see them in program order, as any store.
///
/// The loop moves four words per iteration (four loads, four stores, one count): a
/// word per iteration spent more instructions on the loop than on the copy, and
/// topped out at about 28 GB/s where four per iteration reach 34 GB/s on the same
/// machine (BENCHMARKS, issue 8, sixteenth round). The words left over go one by one.
///
/// # Safety
///
/// As [`string_copy`]: `src` is valid for reads of `8 * dst.len()` bytes that nothing
/// writes meanwhile and does not overlap `dst`; the caller is the only writer of `dst`;
/// `dst` is not empty.
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
#[inline]
unsafe fn stream_copy(dst: &[AtomicU64], src: *const u8) {
    debug_assert!(!dst.is_empty());
    let (quads, rest) = (dst.len() / 4, dst.len() % 4);
    // SAFETY: `dst` is `dst.len() >= 1` initialised, 8-aligned `AtomicU64`s. The first
    // loop runs `quads` times (skipped when 0), each four aligned 8-byte stores to the
    // next 32 bytes of `dst` from the next 32 of `src`; the second runs `rest` times
    // (skipped when 0), one store each, so `dst.len()` words in all. `src` is readable
    // for as many bytes and not written meanwhile (the caller's contract). Only atomic
    // loads can race the stores (the caller is the only writer), and each store is an
    // atomic 8-byte store: no data race. The registers written are declared; the flags
    // are clobbered (no `preserves_flags`).
    unsafe {
        core::arch::asm!(
            "test {q}, {q}",
            "jz 3f",
            "2:",
            "mov {a}, qword ptr [{s}]",
            "mov {b}, qword ptr [{s} + 8]",
            "mov {c}, qword ptr [{s} + 16]",
            "mov {e}, qword ptr [{s} + 24]",
            "movnti qword ptr [{d}], {a}",
            "movnti qword ptr [{d} + 8], {b}",
            "movnti qword ptr [{d} + 16], {c}",
            "movnti qword ptr [{d} + 24], {e}",
            "add {s}, 32",
            "add {d}, 32",
            "dec {q}",
            "jnz 2b",
            "3:",
            "test {r}, {r}",
            "jz 5f",
            "4:",
            "mov {a}, qword ptr [{s}]",
            "movnti qword ptr [{d}], {a}",
            "add {s}, 8",
            "add {d}, 8",
            "dec {r}",
            "jnz 4b",
            "5:",
            "sfence",
            q = inout(reg) quads => _,
            r = inout(reg) rest => _,
            s = inout(reg) src => _,
            d = inout(reg) dst.as_ptr() => _,
            a = out(reg) _,
            b = out(reg) _,
            c = out(reg) _,
            e = out(reg) _,
            options(nostack)
        );
    }
}

/// Store `src`'s pairs of tokens into `dst` (word `k` gets `src[2k]`, `src[2k + 1]`:
/// what [`pack`] makes of them), with non-temporal stores for a long run if `stream`.
/// The latch holder only: nothing else writes `dst`.
#[inline]
fn store_words(dst: &[AtomicU64], src: &[u32], stream: bool) {
    assert_eq!(src.len(), 2 * dst.len(), "two tokens per word");
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    if stream && dst.len() >= STREAM_MIN_WORDS {
        // SAFETY: as for `string_copy` below; `dst` is not empty (its length is at
        // least `STREAM_MIN_WORDS`).
        unsafe { stream_copy(dst, src.as_ptr().cast()) };
        return;
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
    let _ = stream;
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    if dst.len() >= STRING_MIN_WORDS {
        // SAFETY: `src` is `8 * dst.len()` bytes (asserted) of a shared borrow, so
        // nothing writes it and it cannot overlap the atomics of `dst`; the caller is
        // the latch holder, the only writer of `dst`. In memory, `pack(a, b)` is `a`
        // then `b`, so the byte copy stores exactly the packed words.
        unsafe { string_copy(dst, src.as_ptr().cast()) };
        return;
    }
    for (w, pair) in dst.iter().zip(src.chunks_exact(2)) {
        w.store(pack(pair[0], pair[1]), Ordering::Relaxed);
    }
}

/// Copy words `src` to `dst` (which do not overlap). The latch holder only.
#[inline]
fn copy_words(dst: &[AtomicU64], src: &[AtomicU64]) {
    assert_eq!(src.len(), dst.len(), "equal runs");
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    if dst.len() >= STRING_MIN_WORDS {
        let (s, d) = (src.as_ptr_range(), dst.as_ptr_range());
        assert!(s.end <= d.start || d.end <= s.start, "overlapping token runs");
        // SAFETY: `src` is `dst.len()` initialised words that only the latch holder (the
        // caller) writes, so nothing writes them during the copy (concurrent atomic
        // loads do not conflict with the read); the ranges do not overlap (asserted);
        // the caller is the only writer of `dst`.
        unsafe { string_copy(dst, src.as_ptr().cast()) };
        return;
    }
    for (w, v) in dst.iter().zip(src) {
        w.store(v.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl Tokens {
    /// An array for `slots` slots, all 0; it streams long runs if it takes at least
    /// [`STREAM_MIN_BYTES`].
    pub(super) fn new(slots: usize) -> Result<Self, crate::ConfigError> {
        Self::with_streaming(slots, slots.saturating_mul(4) >= STREAM_MIN_BYTES)
    }

    /// An array for `slots` slots, all 0, that streams long runs if `stream`.
    fn with_streaming(slots: usize, stream: bool) -> Result<Self, crate::ConfigError> {
        let words = super::boxed("radix slot tokens", slots.div_ceil(2), |_| AtomicU64::new(0))?;
        Ok(Tokens { words, slots, stream })
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
        let n = key.len();
        let mut k = 0;
        if n > 0 && slot % 2 == 1 {
            if self.get(slot) != key[0] {
                return 0;
            }
            k = 1;
        }
        // Four words (eight tokens) a step, their differences OR-ed: one branch a step
        // instead of one a word. The step holding a difference is then searched word by
        // word below.
        while k + 8 <= n {
            let (w, t) = (&self.words[(slot + k) / 2..(slot + k) / 2 + 4], &key[k..k + 8]);
            let diff = (w[0].load(Ordering::Relaxed) ^ pack(t[0], t[1]))
                | (w[1].load(Ordering::Relaxed) ^ pack(t[2], t[3]))
                | (w[2].load(Ordering::Relaxed) ^ pack(t[4], t[5]))
                | (w[3].load(Ordering::Relaxed) ^ pack(t[6], t[7]));
            if diff != 0 {
                break;
            }
            k += 8;
        }
        // A word (two tokens) per load and compare.
        while k + 2 <= n {
            let w = self.words[(slot + k) / 2].load(Ordering::Relaxed);
            if w != pack(key[k], key[k + 1]) {
                return if unpack(w).0 != key[k] { k } else { k + 1 };
            }
            k += 2;
        }
        if k < n && self.get(slot + k) != key[k] {
            return k;
        }
        n
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

    /// Copy the tokens of slots `src..src + len` to `dst..dst + len` (the ranges do not
    /// overlap; the latch holder only, as [`write`](Self::write)).
    pub(super) fn copy(&self, src: usize, dst: usize, len: usize) {
        if src % 2 == dst % 2 && len > 2 {
            // Same alignment: whole words move as they are, the odd ends as tokens.
            assert!(src.max(dst) + len <= self.slots, "token range out of bounds");
            let (mut s, mut d, mut left) = (src, dst, len);
            if s % 2 == 1 {
                self.write(d, &[self.get(s)]);
                (s, d, left) = (s + 1, d + 1, left - 1);
            }
            let pairs = left / 2;
            copy_words(&self.words[d / 2..d / 2 + pairs], &self.words[s / 2..s / 2 + pairs]);
            if left % 2 == 1 {
                self.write(d + left - 1, &[self.get(s + left - 1)]);
            }
            return;
        }
        let mut buf = [0u32; 256];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len());
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = self.get(src + done + k);
            }
            self.write(dst + done, &buf[..n]);
            done += n;
        }
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
        store_words(&self.words[s / 2..s / 2 + pairs], &t[..2 * pairs], self.stream);
        if t.len() % 2 == 1 {
            let w = &self.words[(s + t.len()) / 2];
            let (_, odd) = unpack(w.load(Ordering::Relaxed));
            w.store(pack(t[t.len() - 1], odd), Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Writes at odd and even boundaries keep the neighbouring slots, and the atomic
    /// comparison finds the first difference wherever it falls.
    #[test]
    fn copies_at_any_alignment() {
        for src in 0..5 {
            for dst in 12..17 {
                for len in 0..7 {
                    let t = Tokens::new(24).unwrap();
                    let all: Vec<u32> = (100..124).collect();
                    t.write(0, &all);
                    t.copy(src, dst, len);
                    for slot in 0..24 {
                        let want = if (dst..dst + len).contains(&slot) {
                            100 + (src + slot - dst) as u32
                        } else {
                            100 + slot as u32
                        };
                        assert_eq!(t.get(slot), want, "copy {src} -> {dst} x {len}: slot {slot}");
                    }
                }
            }
        }
    }

    /// Runs around and past the string-copy threshold (`STRING_MIN_WORDS` words) land
    /// exactly where the word loop puts them, at both alignments, and keep their
    /// neighbours; so do copies of such runs.
    #[test]
    fn long_runs_write_and_copy_exactly() {
        long_runs_exactly(420, &[60, 63, 64, 65, 66, 67, 130, 131, 200], false);
    }

    /// The same with non-temporal stores, around the streamed length (1,024 tokens).
    #[test]
    fn streamed_runs_write_and_copy_exactly() {
        // Every remainder of the words left after the four-word loop, at both alignments.
        long_runs_exactly(2100, &[1000, 1023, 1024, 1025, 1026, 1027, 1028, 1029, 1030, 1031, 1032, 1034, 1036], true);
        assert!(!Tokens::new(STREAM_MIN_BYTES / 4 - 1).unwrap().stream);
        assert!(Tokens::new(STREAM_MIN_BYTES / 4).unwrap().stream);
    }

    fn long_runs_exactly(n: usize, lens: &[usize], stream: bool) {
        let half = n / 2 - 9;
        for start in 0..3 {
            for &len in lens {
                let t = Tokens::with_streaming(n, stream).unwrap();
                t.write(0, &vec![7; n]);
                let run: Vec<u32> = (0..len as u32).map(|k| k.wrapping_mul(2_654_435_761)).collect();
                t.write(start, &run);
                for slot in 0..n {
                    let want = if (start..start + len).contains(&slot) { run[slot - start] } else { 7 };
                    assert_eq!(t.get(slot), want, "write at {start} x {len}: slot {slot}");
                }
                for dst in [start + half, start + half + 1] {
                    t.copy(start, dst, len);
                    for slot in dst..dst + len {
                        assert_eq!(t.get(slot), run[slot - dst], "copy {start} -> {dst} x {len}: slot {slot}");
                    }
                    assert_eq!(t.get(dst - 1), if dst - 1 < start + len { run[dst - 1 - start] } else { 7 });
                    if dst + len < n {
                        assert_eq!(t.get(dst + len), 7, "after the copy to {dst}");
                    }
                    t.write(dst, &vec![7; len]);
                }
            }
        }
    }

    #[test]
    fn runs_at_any_alignment() {
        let t = Tokens::new(20).unwrap();
        t.write(0, &[9; 20]);
        t.write(3, &[1, 2, 3, 4, 5]); // odd start, odd end
        t.write(10, &[6, 7]); // even start, even end
        let all: Vec<u32> = (0..20).map(|s| t.get(s)).collect();
        assert_eq!(all, [9, 9, 9, 1, 2, 3, 4, 5, 9, 9, 6, 7, 9, 9, 9, 9, 9, 9, 9, 9]);
        // SAFETY: no write is in flight.
        assert_eq!(unsafe { t.plain(3, 5) }, &[1, 2, 3, 4, 5]);
        for start in 0..8 {
            for len in 0..12 {
                let want: Vec<u32> = (start..start + len).map(|s| t.get(s)).collect();
                assert_eq!(t.first_diff_atomic(start, &want), len);
                for bad in 0..len {
                    let mut key = want.clone();
                    key[bad] ^= 0x55;
                    assert_eq!(t.first_diff_atomic(start, &key), bad, "start {start} len {len}");
                }
            }
        }
    }

    #[test]
    fn first_diff_atomic_over_several_steps() {
        // Keys long enough for the compare's eight-token steps, then the word-at-a-time
        // tail, at both parities of the start.
        let t = Tokens::new(96).unwrap();
        let all: Vec<u32> = (0..96).map(|s| s * 7 + 1).collect();
        t.write(0, &all);
        for start in 0..4 {
            for len in [0, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 90] {
                let want = &all[start..start + len];
                assert_eq!(t.first_diff_atomic(start, want), len);
                for bad in 0..len {
                    let mut key = want.to_vec();
                    key[bad] ^= 0x55;
                    assert_eq!(t.first_diff_atomic(start, &key), bad, "start {start} len {len}");
                }
            }
        }
    }
}
