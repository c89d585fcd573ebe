//! Expanding fresh pages into per-token slots: the pure half of paged allocation.
//!
//! These functions are the host reference for the `alloc_extend` / `alloc_decode` GPU
//! kernels: given the page size, the batch and the list of fresh pages, the output is
//! fully determined, and the kernels must agree with it bit for bit.
//!
//! For request `i` with `ps` the page size (DESIGN.md, "Extend and decode on pages"):
//!
//! ```text
//! new_pages(i)  = ceil(seq/ps) - ceil(prefix/ps)
//! page_start(i) = sum of new_pages(j), j < i
//! out_start(i)  = sum of (seq_j - prefix_j), j < i
//! part 1  p1 = min(seq, ceil(prefix/ps)*ps) - prefix        the old partial page
//!         out[out_start + k] = last_loc + 1 + k
//! part 2  p2 = floor(seq/ps)*ps - ceil(prefix/ps)*ps (> 0)  whole new pages
//!         out[out_start + p1 + k] = pages[page_start + k/ps]*ps + k%ps
//! part 3  p3 = seq - floor(seq/ps)*ps  (when the last page is new)
//!         out[out_start + p1 + p2 + k] = pages[page_start + new_pages - 1]*ps + k
//! ```
//!
//! Decode is extend with `prefix = seq - 1`.
//!
//! # In place
//!
//! [`expand_extend`] and [`expand_decode`] copy the fresh pages into the front of the
//! output buffer and expand them in place, so no scratch memory is needed. That works
//! because a batch never needs more new pages than it has new tokens, and a token at
//! output position `q` always reads a page at index `<= q` (`out_start(i) >=
//! page_start(i)`, and each new page of a request comes after at least one token per
//! earlier new page). Walking the output backwards, position `q` is written only after
//! every token that reads page `q` at a position above `q` is done, and a token at `q`
//! reads its page before it overwrites it.
//!
//! # Straight from the claim
//!
//! The allocators' extends (`PagedAllocator`, `TokenAllocator`) write no page numbers
//! at all: their bitmap claim hands out stretches of consecutive pages, and a stretch
//! is consecutive slots, so `Placer` writes each as one ascending fill at its place
//! (part 1 of every request first). Same output as the expansion of the claimed pages
//! (`tests/alloc_model.rs` checks it on large fragmented pools), without the pass that
//! writes the pages and reads them back page by page. A decode batch has at most one
//! page per request and no stretches to fill: its pages are claimed into `out` and
//! expanded in place, which costs less per request.

use crate::error::InvalidInput;
use crate::iota::fill_ascending;

/// Totals of a batch: the fresh pages it needs and the slots it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BatchPlan {
    /// Fresh pages the batch consumes.
    pub new_pages: usize,
    /// Slots the batch writes (`sum(seq - prefix)`).
    pub new_tokens: usize,
}

/// `ceil(x / ps)`, with shifts when `ps` is a power of two (the common case: a 64-bit
/// division per request dominated decode planning).
#[inline]
pub(crate) fn div_ceil_ps(x: u64, ps: u64) -> u64 {
    if ps.is_power_of_two() {
        (x + ps - 1) >> ps.trailing_zeros()
    } else {
        x.div_ceil(ps)
    }
}

/// `floor(x / ps)`, with a shift when `ps` is a power of two.
#[inline]
pub(crate) fn div_floor_ps(x: u64, ps: u64) -> u64 {
    if ps.is_power_of_two() {
        x >> ps.trailing_zeros()
    } else {
        x / ps
    }
}

#[inline]
fn ceil_pages(len: u32, ps: u32) -> u64 {
    div_ceil_ps(len as u64, ps as u64)
}

/// New pages one request needs to grow from `prefix_len` to `seq_len` tokens:
/// `ceil(seq/ps) - ceil(prefix/ps)`.
///
/// Total: 0 when the request does not grow (`prefix_len >= seq_len`, so a prefix
/// longer than its sequence, which [`plan_extend`] refuses, needs nothing) or when
/// `page_size` is 0 (no pages exist; [`plan_extend`] and the allocators refuse it).
///
/// # Examples
///
/// ```
/// use kvpool::alloc::new_pages;
/// assert_eq!(new_pages(4, 3, 9), 2); // pages 1..=3 of the request: page 1 is held
/// assert_eq!(new_pages(4, 9, 3), 0); // no growth
/// assert_eq!(new_pages(0, 0, 1), 0); // no page size
/// ```
#[inline]
pub fn new_pages(page_size: u32, prefix_len: u32, seq_len: u32) -> u32 {
    if page_size == 0 || prefix_len >= seq_len {
        return 0;
    }
    pages_to_add(page_size, prefix_len, seq_len)
}

/// [`new_pages`] for validated input (`page_size >= 1`, `prefix_len <= seq_len`): the
/// planning loops' form, without the checks they have done already.
#[inline]
pub(crate) fn pages_to_add(page_size: u32, prefix_len: u32, seq_len: u32) -> u32 {
    debug_assert!(page_size >= 1 && prefix_len <= seq_len, "unvalidated request");
    (ceil_pages(seq_len, page_size) - ceil_pages(prefix_len, page_size)) as u32
}

/// Count what an extend batch needs: step (a) of paged allocation. Validates the batch.
///
/// # Errors
///
/// [`InvalidInput`] if the slices differ in length, a prefix is longer than its
/// sequence, or `page_size` is 0.
///
/// # Examples
///
/// ```
/// use kvpool::alloc::{plan_extend, BatchPlan};
/// let plan = plan_extend(4, &[1, 3], &[6, 7])?;
/// assert_eq!(plan, BatchPlan { new_pages: 2, new_tokens: 9 });
/// # Ok::<(), kvpool::InvalidInput>(())
/// ```
pub fn plan_extend(page_size: u32, prefix_lens: &[u32], seq_lens: &[u32]) -> Result<BatchPlan, InvalidInput> {
    if page_size == 0 {
        return Err(InvalidInput::NotPageAligned { count: 0, page_size });
    }
    if prefix_lens.len() != seq_lens.len() {
        return Err(InvalidInput::LengthMismatch {
            what: "prefix_lens",
            got: prefix_lens.len(),
            expected: seq_lens.len(),
        });
    }
    let mut plan = BatchPlan::default();
    for (request, (&prefix_len, &seq_len)) in prefix_lens.iter().zip(seq_lens).enumerate() {
        if prefix_len > seq_len {
            return Err(InvalidInput::PrefixLongerThanSeq { request, prefix_len, seq_len });
        }
        plan.new_pages += pages_to_add(page_size, prefix_len, seq_len) as usize;
        plan.new_tokens += (seq_len - prefix_len) as usize;
    }
    Ok(plan)
}

/// Count what a decode batch needs (one token per request). Validates the batch.
///
/// # Errors
///
/// [`InvalidInput`] if a `seq_len` is 0 or `page_size` is 0.
pub fn plan_decode(page_size: u32, seq_lens: &[u32]) -> Result<BatchPlan, InvalidInput> {
    if page_size == 0 {
        return Err(InvalidInput::NotPageAligned { count: 0, page_size });
    }
    let mut plan = BatchPlan { new_pages: 0, new_tokens: seq_lens.len() };
    for (request, &seq_len) in seq_lens.iter().enumerate() {
        if seq_len == 0 {
            return Err(InvalidInput::EmptyDecode { request });
        }
        plan.new_pages += pages_to_add(page_size, seq_len - 1, seq_len) as usize;
    }
    Ok(plan)
}

/// Check the shapes of an expansion call against its plan.
fn check_shapes(
    page_size: u32,
    plan: BatchPlan,
    batch: usize,
    last_locs: &[u32],
    pages: &[u32],
    out: &[u32],
) -> Result<(), InvalidInput> {
    if last_locs.len() != batch {
        return Err(InvalidInput::LengthMismatch { what: "last_locs", got: last_locs.len(), expected: batch });
    }
    if pages.len() != plan.new_pages {
        return Err(InvalidInput::PageCount { got: pages.len(), expected: plan.new_pages });
    }
    if out.len() != plan.new_tokens {
        return Err(InvalidInput::OutputLength { got: out.len(), expected: plan.new_tokens });
    }
    let last_page = (u32::MAX as u64 + 1) / page_size as u64 - 1;
    if let Some(&page) = pages.iter().find(|&&p| p == 0 || p as u64 > last_page) {
        return Err(InvalidInput::BadPage { page });
    }
    Ok(())
}

/// Expand fresh pages into the slots of an extend batch: step (c) of paged allocation,
/// a pure function of its inputs.
///
/// `last_locs[i]` is the slot of request `i`'s last prefix token; it is read only when
/// the request has a partial prefix page to fill (part 1), so any value does when the
/// prefix is empty or page-aligned.
///
/// # Errors
///
/// [`InvalidInput`] if the shapes disagree (see [`plan_extend`]; `pages.len()` must be
/// the plan's `new_pages` and `out.len()` its `new_tokens`) or a page is 0 or so large
/// its slots overflow `u32`. `out` is untouched on error.
///
/// # Examples
///
/// DESIGN.md's worked example: page size 4, pages 3 and 4 fresh.
///
/// ```
/// let mut out = [0u32; 9];
/// kvpool::alloc::expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3, 4], &mut out)?;
/// assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
/// # Ok::<(), kvpool::InvalidInput>(())
/// ```
pub fn expand_extend(
    page_size: u32,
    prefix_lens: &[u32],
    seq_lens: &[u32],
    last_locs: &[u32],
    pages: &[u32],
    out: &mut [u32],
) -> Result<(), InvalidInput> {
    let plan = plan_extend(page_size, prefix_lens, seq_lens)?;
    check_shapes(page_size, plan, seq_lens.len(), last_locs, pages, out)?;
    out[..pages.len()].copy_from_slice(pages);
    expand_in_place(page_size, seq_lens.len(), |i| (prefix_lens[i], seq_lens[i], last_locs[i]), pages.len(), out);
    Ok(())
}

/// Expand fresh pages into the slots of a decode batch (one token per request).
///
/// # Errors
///
/// As [`expand_extend`], with [`plan_decode`]'s validation.
///
/// # Examples
///
/// DESIGN.md's decode example on a fresh pool (pages 1 and 2):
///
/// ```
/// let mut out = [0u32; 3];
/// kvpool::alloc::expand_decode(4, &[5, 4, 9], &[0, 2, 0], &[1, 2], &mut out)?;
/// assert_eq!(out, [4, 3, 8]);
/// # Ok::<(), kvpool::InvalidInput>(())
/// ```
pub fn expand_decode(
    page_size: u32,
    seq_lens: &[u32],
    last_locs: &[u32],
    pages: &[u32],
    out: &mut [u32],
) -> Result<(), InvalidInput> {
    let plan = plan_decode(page_size, seq_lens)?;
    check_shapes(page_size, plan, seq_lens.len(), last_locs, pages, out)?;
    out[..pages.len()].copy_from_slice(pages);
    expand_in_place(page_size, seq_lens.len(), |i| (seq_lens[i] - 1, seq_lens[i], last_locs[i]), pages.len(), out);
    Ok(())
}

/// The old partial page's share of a request's new tokens (part 1).
#[inline]
fn part1(ps: u64, prefix: u64, seq: u64) -> usize {
    (seq.min(div_ceil_ps(prefix, ps) * ps) - prefix) as usize
}

/// Writes a batch's slots as the allocator claims its fresh pages, with no pages
/// written first and read back (what [`expand_in_place`] needs): every request's part
/// 1 up front, then each stretch of consecutive claimed pages, in claim order, as
/// ascending fills at its requests' places (page `j` of the claim belongs to the
/// request whose pages it falls in, as in `expand_in_place`). Inputs are validated.
pub(crate) struct Placer<R> {
    ps: usize,
    req: R,
    batch: usize,
    /// The next request to start, and where its slots start in the output.
    next_req: usize,
    next_start: usize,
    /// The current request: where its next page lands, the end of its slots, the
    /// pages it still needs, and the slot its next page must start at to continue
    /// what it holds (`None`: nothing to continue).
    at: usize,
    end: usize,
    left: usize,
    follows: Option<u64>,
}

impl<R: Fn(usize) -> (u32, u32, u32)> Placer<R> {
    /// Write every request's part 1 and get ready for the first fresh page.
    pub(crate) fn new(ps: u32, batch: usize, req: R, out: &mut [u32]) -> Self {
        let mut start = 0;
        for i in 0..batch {
            let (prefix, seq, last_loc) = req(i);
            let p1 = part1(ps as u64, prefix as u64, seq as u64);
            fill_ascending(&mut out[start..start + p1], last_loc.wrapping_add(1));
            start += (seq - prefix) as usize;
        }
        let mut placer =
            Placer { ps: ps as usize, req, batch, next_req: 0, next_start: 0, at: 0, end: 0, left: 0, follows: None };
        placer.next_request();
        placer
    }

    /// Move on to the next request that needs fresh pages.
    fn next_request(&mut self) {
        while self.next_req < self.batch {
            let (prefix, seq, last_loc) = (self.req)(self.next_req);
            let start = self.next_start;
            self.next_req += 1;
            self.next_start += (seq - prefix) as usize;
            let pages = pages_to_add(self.ps as u32, prefix, seq) as usize;
            if pages > 0 {
                let p1 = part1(self.ps as u64, prefix as u64, seq as u64);
                (self.at, self.end, self.left) = (start + p1, start + (seq - prefix) as usize, pages);
                self.follows = (p1 > 0).then(|| last_loc as u64 + p1 as u64 + 1);
                return;
            }
        }
    }

    /// Place `count` claimed pages from `page` on, calling `breaks(p)` for every output
    /// position `p` where a request's slots stop being consecutive.
    #[inline]
    pub(crate) fn place(&mut self, out: &mut [u32], mut page: u32, mut count: usize, breaks: &mut impl FnMut(usize)) {
        while count > 0 {
            let take = count.min(self.left);
            let first = page as u64 * self.ps as u64;
            if self.follows.is_some_and(|f| f != first) {
                breaks(self.at);
            }
            let to = (self.at + take * self.ps).min(self.end);
            fill_ascending(&mut out[self.at..to], first as u32);
            (self.at, self.left, count) = (self.at + take * self.ps, self.left - take, count - take);
            page += take as u32;
            self.follows = Some(page as u64 * self.ps as u64);
            if self.left == 0 {
                self.next_request();
            }
        }
    }
}

/// The expansion itself. `out[..n_pages]` holds the fresh pages on entry; on return
/// `out` holds the slots. Inputs are already validated.
pub(crate) fn expand_in_place<R>(ps: u32, batch: usize, request: R, n_pages: usize, out: &mut [u32])
where
    R: Fn(usize) -> (u32, u32, u32),
{
    if ps == 1 {
        // Every token is its own page: the pages are the slots, in order.
        return;
    }
    let ps64 = ps as u64;
    let mut page_end = n_pages;
    let mut out_end = out.len();
    for i in (0..batch).rev() {
        let (prefix, seq, last_loc) = request(i);
        let (prefix, seq) = (prefix as u64, seq as u64);
        let prefix_pages = div_ceil_ps(prefix, ps64);
        let np = (div_ceil_ps(seq, ps64) - prefix_pages) as usize;
        let page_start = page_end - np;
        let out_start = out_end - (seq - prefix) as usize;
        let aligned_prefix = prefix_pages * ps64;
        let full_end = div_floor_ps(seq, ps64) * ps64;
        let p1 = (seq.min(aligned_prefix) - prefix) as usize;
        let p2 = full_end.saturating_sub(aligned_prefix) as usize;
        let p3 = if np > 0 { (seq - full_end) as usize } else { 0 };
        // Backwards: part 3, part 2, part 1 (see the module docs for why in place works).
        // Within a page the fill runs forwards (an ascending fill vectorizes): the page
        // numbers not yet read sit below `at` (pages never outnumber new tokens, so
        // `page_start <= out_start`), and the page's own number is read before the fill.
        if p3 > 0 {
            let base = out[page_start + np - 1] * ps;
            let at = out_start + p1 + p2;
            fill_ascending(&mut out[at..at + p3], base);
        }
        for full in (0..p2 / ps as usize).rev() {
            let base = out[page_start + full] * ps;
            let at = out_start + p1 + full * ps as usize;
            fill_ascending(&mut out[at..at + ps as usize], base);
        }
        for k in (0..p1).rev() {
            out[out_start + k] = last_loc.wrapping_add(1 + k as u32);
        }
        page_end = page_start;
        out_end = out_start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `new_pages` is total (audit finding: page size 0 divided by zero and a prefix
    /// longer than its sequence underflowed, panics from a public pure function).
    #[test]
    fn new_pages_is_total() {
        assert_eq!(new_pages(0, 0, 1), 0, "no page size: no pages");
        assert_eq!(new_pages(0, 5, 9), 0);
        assert_eq!(new_pages(4, 9, 1), 0, "prefix longer than seq: no growth");
        assert_eq!(new_pages(4, 9, 9), 0);
        assert_eq!(new_pages(1, 0, u32::MAX), u32::MAX);
        assert_eq!(new_pages(u32::MAX, 0, u32::MAX), 1);
        assert_eq!(new_pages(3, u32::MAX - 1, u32::MAX), 0);
        // in range it is the formula, as the planners use it
        for ps in 1..=5u32 {
            for prefix in 0..12 {
                for seq in prefix..12 {
                    let want = (seq as u64).div_ceil(ps as u64) - (prefix as u64).div_ceil(ps as u64);
                    assert_eq!(new_pages(ps, prefix, seq) as u64, want, "{ps} {prefix} {seq}");
                    assert_eq!(pages_to_add(ps, prefix, seq), new_pages(ps, prefix, seq));
                }
            }
        }
    }

    #[test]
    fn worked_examples() {
        let mut out = [0u32; 9];
        expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3, 4], &mut out).unwrap();
        assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
        let mut out = [0u32; 3];
        expand_decode(4, &[5, 4, 9], &[0, 2, 0], &[1, 2], &mut out).unwrap();
        assert_eq!(out, [4, 3, 8]);
    }

    #[test]
    fn shape_errors_leave_output_untouched() {
        let mut out = [7u32; 9];
        assert_eq!(
            expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3], &mut out),
            Err(InvalidInput::PageCount { got: 1, expected: 2 })
        );
        assert_eq!(
            expand_extend(4, &[1, 8], &[6, 7], &[4, 10], &[3, 4], &mut out),
            Err(InvalidInput::PrefixLongerThanSeq { request: 1, prefix_len: 8, seq_len: 7 })
        );
        assert_eq!(
            expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3, 0], &mut out),
            Err(InvalidInput::BadPage { page: 0 })
        );
        assert!(expand_extend(4, &[1, 3], &[6, 7], &[4], &[3, 4], &mut out).is_err());
        assert!(expand_extend(4, &[1, 3], &[6, 7], &[4, 10], &[3, 4], &mut out[..8]).is_err());
        assert_eq!(out, [7u32; 9]);
        assert_eq!(plan_decode(4, &[3, 0]), Err(InvalidInput::EmptyDecode { request: 1 }));
    }

    /// A forward, out-of-place transcription of the formula, to check the backward
    /// in-place walk against.
    fn forward(ps: u32, prefix: &[u32], seq: &[u32], last: &[u32], pages: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut page_start = 0usize;
        for i in 0..seq.len() {
            let (pre, s) = (prefix[i] as u64, seq[i] as u64);
            let p = ps as u64;
            let np = (s.div_ceil(p) - pre.div_ceil(p)) as usize;
            let p1 = s.min(pre.div_ceil(p) * p) - pre;
            for k in 0..p1 {
                out.push(last[i] + 1 + k as u32);
            }
            let p2 = (s / p * p).saturating_sub(pre.div_ceil(p) * p);
            for k in 0..p2 {
                out.push(pages[page_start + (k / p) as usize] * ps + (k % p) as u32);
            }
            if np > 0 && s % p != 0 {
                for k in 0..s - s / p * p {
                    out.push(pages[page_start + np - 1] * ps + k as u32);
                }
            }
            page_start += np;
        }
        out
    }

    #[test]
    fn in_place_matches_forward_formula() {
        // A small deterministic generator: no external randomness in unit tests.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as u32
        };
        for _ in 0..2000 {
            let ps = [1, 2, 3, 4, 5, 16, 64][next(7) as usize];
            let batch = next(6) as usize;
            let (mut prefix, mut seq, mut last) = (vec![], vec![], vec![]);
            for _ in 0..batch {
                let s = next(300);
                let p = next(s + 1);
                prefix.push(p);
                seq.push(s);
                // a last_loc consistent with the prefix's position in its page
                last.push(if p == 0 { 0 } else { 1000 * ps + (p - 1) % ps });
            }
            let plan = plan_extend(ps, &prefix, &seq).unwrap();
            // Stretches of consecutive page numbers between jumps up and down, as a
            // pool hands them out.
            let mut pages: Vec<u32> = Vec::with_capacity(plan.new_pages);
            let mut page = 500;
            for _ in 0..plan.new_pages {
                page = match next(4) {
                    0 => page + 3 + next(5),
                    1 => page.saturating_sub(1 + next(7)),
                    _ => page + 1,
                };
                pages.push(page);
            }
            let mut out = vec![0u32; plan.new_tokens];
            expand_extend(ps, &prefix, &seq, &last, &pages, &mut out).unwrap();
            assert_eq!(out, forward(ps, &prefix, &seq, &last, &pages), "ps {ps} {prefix:?} {seq:?}");
        }
    }
}
