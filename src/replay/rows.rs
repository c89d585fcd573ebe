//! The drivers not yet on [`ReplayCache`](super::ReplayCache)'s requests: the row
//! and lease calls they make, as a crate-private trait, and the loop they share.
#![allow(dead_code)]

use std::time::Instant;

use crate::alloc::new_pages;
use crate::error::{AllocError, FreeError, InvariantViolation, RowError};
use crate::req_to_token::{ReqRow, ReqToTokenPool};

use super::sequential::PROGRESS_EVERY;
use super::{
    buffer, decode_need, Histograms, Latencies, Mode, ReplayConfig, ReplayError, Report, TimelinePoint, Totals, Trace,
    NAMESPACE,
};

/// A prefix cache driven by rows, leases and allocator calls.
pub(crate) trait RowCache: Sync {
    /// A locked match: the prefix stays cached until the lease is given back through
    /// [`unlock`](Self::unlock) or [`cache_finished_req`](Self::cache_finished_req).
    type Lease<'a>: Send
    where
        Self: 'a;

    /// A short name for reports (`kvpool`, `reference`).
    fn name(&self) -> &'static str;
    /// Tokens per page.
    fn page_size(&self) -> u32;
    /// Token capacity of the KV pool.
    fn capacity_tokens(&self) -> usize;
    /// Free KV tokens now.
    fn available_tokens(&self) -> usize;
    /// Cached tokens that eviction could free now.
    fn evictable_tokens(&self) -> usize;
    /// Tokens in the cache.
    fn cached_tokens(&self) -> usize;
    /// The request rows.
    fn req_pool(&self) -> &ReqToTokenPool;
    /// Match `key`'s longest cached page-aligned prefix, write its slots into
    /// `out[..hit]` and lock it; returns `hit` and the lease.
    fn match_and_lock(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> (usize, Self::Lease<'_>);
    /// [`match_and_lock`](Self::match_and_lock) writing the matched slots straight into
    /// positions `0..hit` of `row` (the key cut to the row's length; see
    /// [`RadixCache::match_and_lock_row`]). Every cache gets the copy-free match;
    /// kvpool's also skips comparing those positions with the tree when the request is
    /// cached.
    ///
    /// # Errors
    ///
    /// [`RowError`] for another pool's row; nothing is matched then.
    fn match_and_lock_row(
        &self,
        namespace: u64,
        key: &[u32],
        row: &mut ReqRow,
    ) -> Result<(usize, Self::Lease<'_>), RowError> {
        let n = key.len().min(self.req_pool().max_context_len());
        let out = self.req_pool().read_mut(row, 0..n)?;
        Ok(self.match_and_lock(namespace, &key[..n], out))
    }
    /// Match without locking (a router's look-up); returns the hit length.
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize;
    /// [`peek_prefix`](Self::peek_prefix), telling the cache the prefix is wanted by
    /// the `position`-th admission from now (kvpool's
    /// [`RadixCache::hint_prefix`]); caches without hints just look up.
    fn hint_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32], position: u32) -> usize {
        let _ = position;
        self.peek_prefix(namespace, key, out)
    }
    /// Evict at least `num_tokens` unlocked tokens if there are that many; returns the
    /// tokens freed.
    fn evict(&self, num_tokens: usize) -> usize;
    /// The allocator's `alloc_extend` (see [`KvAllocator::alloc_extend`]).
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing changes on error.
    fn alloc_extend(
        &self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError>;
    /// [`alloc_extend`](Self::alloc_extend) for one request, straight into its row:
    /// positions `prefix_len..seq_len` of `row` get the new slots, and `last_loc` is the
    /// row's slot at `prefix_len - 1` (see [`RadixCache::alloc_extend_row`]). Every
    /// cache gets the same copy-free fill; kvpool's also skips re-reading the
    /// expansion's pages slot by slot when the request is cached.
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing is allocated on error.
    fn alloc_extend_row(&self, row: &mut ReqRow, prefix_len: usize, seq_len: usize) -> Result<(), AllocError> {
        self.req_pool().fill_extension(row, prefix_len, seq_len, |prefix, seq, last_loc, out, _| {
            self.alloc_extend(&[prefix], &[seq], &[last_loc], out).map(|()| false)
        })
    }
    /// The allocator's `alloc_decode` (see [`KvAllocator::alloc_decode`]).
    ///
    /// # Errors
    ///
    /// [`AllocError`]; nothing changes on error.
    fn alloc_decode(&self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError>;
    /// Free KV slots the caller holds.
    ///
    /// # Errors
    ///
    /// [`FreeError`] for a slot that is not allocated.
    fn free(&self, slots: &[u32]) -> Result<(), FreeError>;
    /// Give a lease back without caching anything (a rejected or retracted request).
    fn unlock(&self, lease: Self::Lease<'_>);
    /// Finish a request: `token_ids` are its KV tokens and the row holds their slots.
    /// Caches the page-aligned part, frees duplicates and the unaligned tail, gives
    /// the lease and the row back. Returns how many leading tokens were already cached.
    ///
    /// # Errors
    ///
    /// [`ReplayError::Internal`] when the cache refuses (a bug in the cache or driver).
    fn cache_finished_req<'a>(
        &'a self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Self::Lease<'a>,
    ) -> Result<usize, ReplayError>;
    /// The cache's own consistency check (exact when nothing is in flight).
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] describing the first inconsistency.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;
    /// Tokens that entered and left the cache outside the driver's calls: loaded back
    /// from a lower tier, and evicted by the cache itself to make room for such loads.
    /// `(0, 0)` for a single-tier cache. The end-of-run accounting counts them.
    #[doc(hidden)]
    fn tier_flows(&self) -> (u64, u64) {
        (0, 0)
    }
    /// A lower tier's tokens held and the tokens loaded back from it so far, for the
    /// timeline. `(0, 0)` for a single-tier cache.
    #[doc(hidden)]
    fn tier_occupancy(&self) -> (u64, u64) {
        (0, 0)
    }
}

pub(crate) fn run_sequential_rows<C: RowCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let ps = cache.page_size() as usize;
    let capacity = cache.capacity_tokens();
    // Requests that do not fit are rejected before expansion: size for the others.
    let max_kv = trace.max_kv_len_fitting(capacity);
    if cache.req_pool().max_context_len() < max_kv || cache.req_pool().size() == 0 {
        return Err(ReplayError::Config(format!(
            "the cache's request rows hold {} tokens but the trace needs {max_kv}",
            cache.req_pool().max_context_len()
        )));
    }
    let mut tokens = buffer(max_kv.max(1), "the replay's token buffer")?;
    let mut totals = Totals::default();
    let mut hist = Histograms::default();
    let mut timeline = Vec::new();
    if config.timeline {
        timeline.try_reserve_exact(trace.len()).map_err(|_| crate::ConfigError::TooLargeForMemory {
            what: "the replay's timeline",
            bytes: crate::arena::bytes_of::<TimelinePoint>(trace.len()),
        })?;
    }
    let start = Instant::now();
    for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv_len) = (q.input_length as usize, q.kv_len());
        if !fits_in_pool_rows(cache, kv_len) {
            // Larger than the whole pool: it can never be served. Nothing is evicted.
            totals.rejected += 1;
            if config.timeline {
                let (host_tokens, host_hit_tokens) = cache.tier_occupancy();
                timeline.push(TimelinePoint {
                    requests_done: r as u32 + 1,
                    used_tokens: (capacity - cache.available_tokens()) as u64,
                    cached_tokens: cache.cached_tokens() as u64,
                    prompt_tokens: totals.prompt_tokens,
                    hit_tokens: totals.hit_tokens,
                    host_tokens,
                    host_hit_tokens,
                });
            }
            if (r as u64 + 1) % PROGRESS_EVERY == 0 {
                progress(r as u64 + 1);
            }
            continue;
        }
        trace.write_kv_tokens(r, &mut tokens);

        let mut row = cache.req_pool().alloc().map_err(|e| ReplayError::internal("request row", e))?;
        let t = Instant::now();
        let (hit, lease) = cache
            .match_and_lock_row(NAMESPACE, &tokens[..prompt], &mut row)
            .map_err(|e| ReplayError::internal("match into the row", e))?;
        hist.match_.record_since(t);

        let mut room = |need: usize, totals: &mut Totals| totals.evicted_tokens += make_room_rows(cache, need);
        let outcome =
            serve(cache, &mut row, hit, prompt, kv_len, &mut totals, &mut hist, &mut room, &mut |_, _| Ok(()))?;
        // For the timeline: the slots in use with this request's all allocated.
        let used_before_finish = if config.timeline { capacity - cache.available_tokens() } else { 0 };
        if let Some(held_end) = outcome {
            // Rejected: release what it held (the slots it allocated past the cached
            // prefix, whole pages as the prefix is page-aligned), its lock, its row.
            release(cache, row, hit..held_end)?;
            cache.unlock(lease);
            totals.rejected += 1;
        } else {
            let t = Instant::now();
            let cached = cache.cache_finished_req(NAMESPACE, &tokens[..kv_len], row, lease)?;
            hist.finish.record_since(t);
            totals.served(kv_len, ps, cached, prompt, hit, q.output_length);
        }
        if config.timeline {
            let (host_tokens, host_hit_tokens) = cache.tier_occupancy();
            timeline.push(TimelinePoint {
                requests_done: r as u32 + 1,
                used_tokens: used_before_finish as u64,
                cached_tokens: cache.cached_tokens() as u64,
                prompt_tokens: totals.prompt_tokens,
                hit_tokens: totals.hit_tokens,
                host_tokens,
                host_hit_tokens,
            });
        }
        if (r as u64 + 1) % PROGRESS_EVERY == 0 {
            progress(r as u64 + 1);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    progress(trace.len() as u64);
    finish_report_rows(cache, config, totals, &hist, wall, timeline)
}

/// Allocate the request's prefill and decode slots into its row. Returns `None` when
/// every slot was allocated, or `Some(end)` when an allocation failed even after
/// eviction: the request is rejected, and it holds the slots at row positions
/// `hit..end`. Before each allocation that needs `need` more tokens, `room(need,
/// totals)` evicts the shortfall and counts it ([`make_room`] for the attention
/// replay; the hybrid replay also counts the states that went). After the prefill and
/// after each decode step, `after(row, seq_len)` runs (the SWA replay releases the
/// window KV that fell out of the window there).
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve<C: RowCache>(
    cache: &C,
    row: &mut ReqRow,
    hit: usize,
    prompt: usize,
    kv_len: usize,
    totals: &mut Totals,
    hist: &mut Histograms,
    room: &mut dyn FnMut(usize, &mut Totals),
    after: &mut dyn FnMut(&ReqRow, usize) -> Result<(), ReplayError>,
) -> Result<Option<usize>, ReplayError> {
    let ps = cache.page_size();
    let capacity = cache.capacity_tokens();
    let peak = |cache: &C, totals: &mut Totals| {
        let used = (capacity - cache.available_tokens()) as u64;
        totals.peak_used_tokens = totals.peak_used_tokens.max(used);
    };

    // Prefill: the prompt past the cached prefix, allocated straight into the row (its
    // `last_loc` is the row's slot before, the match's last).
    let need = new_pages(ps, hit as u32, prompt as u32) as usize * ps as usize;
    room(need, totals);
    let t = Instant::now();
    let res = cache.alloc_extend_row(row, hit, prompt);
    hist.alloc_extend.record_since(t);
    if let Err(e) = res {
        out_of_memory(&e, "alloc_extend")?;
        return Ok(Some(hit));
    }
    peak(cache, totals);
    after(row, prompt)?;

    // Decode: one slot per output token after the first, from the prompt's last slot
    // (the extend's last, or with nothing extended the match's).
    let mut last_loc = last_slot(cache, row, prompt)?;
    let mut one = [0u32];
    for seq in prompt + 1..=kv_len {
        let need = decode_need(ps, seq as u32);
        if need > 0 {
            room(need, totals);
        }
        let t = Instant::now();
        let res = cache.alloc_decode(&[seq as u32], &[last_loc], &mut one);
        hist.alloc_decode.record_since(t);
        if let Err(e) = res {
            out_of_memory(&e, "alloc_decode")?;
            return Ok(Some(seq - 1));
        }
        write_row(cache, row, seq - 1, &one)?;
        last_loc = one[0];
        if need > 0 {
            peak(cache, totals);
        }
        after(row, seq)?;
    }
    Ok(None)
}

/// The row's slot at position `len - 1` (0 for `len == 0`): a request's `last_loc`.
pub(crate) fn last_slot<C: RowCache>(cache: &C, row: &ReqRow, len: usize) -> Result<u32, ReplayError> {
    match len.checked_sub(1) {
        Some(p) => Ok(cache.req_pool().read(row, p..len).map_err(|e| ReplayError::internal("read row", e))?[0]),
        None => Ok(0),
    }
}

pub(crate) fn write_row<C: RowCache>(
    cache: &C,
    row: &mut ReqRow,
    start: usize,
    slots: &[u32],
) -> Result<(), ReplayError> {
    cache.req_pool().write(row, start, slots).map_err(|e| ReplayError::internal("write row", e))
}

/// Free the slots at `range` of the row, then the row.
pub(crate) fn release<C: RowCache>(cache: &C, row: ReqRow, range: core::ops::Range<usize>) -> Result<(), ReplayError> {
    if !range.is_empty() {
        let held = cache.req_pool().read(&row, range).map_err(|e| ReplayError::internal("read row", e))?;
        cache.free(held).map_err(|e| ReplayError::internal("free request slots", e))?;
    }
    cache.req_pool().free(row).map_err(|e| ReplayError::internal("free row", e))
}

/// Whether an allocation error is "out of memory" (reject) rather than a bug.
pub(crate) fn out_of_memory(e: &AllocError, what: &str) -> Result<(), ReplayError> {
    match e {
        AllocError::OutOfMemory(_) => Ok(()),
        AllocError::Invalid(e) => Err(ReplayError::internal(what, e)),
        AllocError::Row(e) => Err(ReplayError::internal(what, e)),
    }
}

/// Check the end state and assemble the report. At quiescence every KV slot in use
/// must be cached, every row free, the cache consistent, and the cache's growth
/// (`added`) minus its evictions must equal what it holds.
pub(crate) fn finish_report_rows<C: RowCache>(
    cache: &C,
    config: &ReplayConfig,
    totals: Totals,
    hist: &Histograms,
    wall_seconds: f64,
    timeline: Vec<TimelinePoint>,
) -> Result<Report, ReplayError> {
    cache.check_invariants()?;
    let pool = cache.req_pool();
    if pool.available_size() != pool.size() {
        return Err(InvariantViolation(format!(
            "{} of {} request rows are still held",
            pool.size() - pool.available_size(),
            pool.size()
        ))
        .into());
    }
    let cached = cache.cached_tokens() as u64;
    let used = (cache.capacity_tokens() - cache.available_tokens()) as u64;
    if used != cached {
        return Err(InvariantViolation(format!(
            "{used} KV slots are in use but the cache holds {cached} tokens: {} slots leaked",
            used as i64 - cached as i64
        ))
        .into());
    }
    let (tier_in, tier_out) = cache.tier_flows();
    if totals.added_tokens + tier_in != cached + totals.evicted_tokens + tier_out {
        return Err(InvariantViolation(format!(
            "the cache took in {} tokens (and {tier_in} loaded back) and evicted {} (and {tier_out} for loads), \
             but holds {cached}",
            totals.added_tokens, totals.evicted_tokens
        ))
        .into());
    }
    let requests = totals.served + totals.rejected;
    let rate = |x: f64| if wall_seconds > 0.0 { x / wall_seconds } else { 0.0 };
    let overlap = config.mode == Mode::Overlap;
    Ok(Report {
        requests,
        rejected: totals.rejected,
        prompt_tokens: totals.prompt_tokens,
        hit_tokens: totals.hit_tokens,
        hit_rate: if totals.prompt_tokens > 0 { totals.hit_tokens as f64 / totals.prompt_tokens as f64 } else { 0.0 },
        computed_tokens: totals.prompt_tokens - totals.hit_tokens,
        output_tokens: totals.output_tokens,
        evicted_tokens: totals.evicted_tokens,
        peak_used_tokens: totals.peak_used_tokens,
        final_cached_tokens: cached,
        wall_seconds,
        requests_per_second: rate(requests as f64),
        tokens_per_second: rate((totals.prompt_tokens + totals.output_tokens) as f64),
        latency_ns: Latencies {
            match_: hist.match_.summary(),
            alloc_extend: hist.alloc_extend.summary(),
            alloc_decode: hist.alloc_decode.summary(),
            finish: hist.finish.summary(),
            route: (overlap && config.routers > 0).then(|| hist.route.summary()),
        },
        mode: config.mode.name(),
        cache: cache.name(),
        policy: config.policy_name(),
        page_size: cache.page_size(),
        capacity_tokens: cache.capacity_tokens() as u64,
        max_running: if overlap { config.max_running as u64 } else { 1 },
        routers: if overlap { config.routers as u64 } else { 0 },
        retracted: totals.retracted,
        router_matches: totals.router_matches,
        router_hit_tokens: totals.router_hit_tokens,
        invariants_ok: true,
        timeline,
        hybrid: None,
        swa: None,
        host: None,
        store: None,
    })
}

/// Whether a request of `kv_len` KV tokens can ever be served by `cache`: its KV,
/// rounded up to whole pages, fits in the pool. The drivers reject the others before
/// expanding their tokens or evicting anything.
#[inline]
pub(crate) fn fits_in_pool_rows<C: RowCache>(cache: &C, kv_len: usize) -> bool {
    let ps = cache.page_size().max(1) as usize;
    kv_len.div_ceil(ps).saturating_mul(ps) <= cache.capacity_tokens()
}

/// Evict the shortfall when `need` tokens are more than are free; returns the tokens
/// evicted. Evicts nothing when not even that much is evictable (the allocation will
/// fail anyway, and the cache would be emptied for nothing).
#[inline]
pub(crate) fn make_room_rows<C: RowCache>(cache: &C, need: usize) -> u64 {
    let available = cache.available_tokens();
    if need > available && need - available <= cache.evictable_tokens() {
        cache.evict(need - available) as u64
    } else {
        0
    }
}
