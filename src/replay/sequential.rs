//! The sequential driver: one request at a time, on one thread, deterministic.

use std::time::Instant;

use crate::alloc::new_pages;
use crate::error::AllocError;
use crate::req_to_token::ReqRow;

use super::{
    buffer, decode_need, finish_report, fits_in_pool, make_room, Histograms, ReplayCache, ReplayConfig, ReplayError,
    Report, TimelinePoint, Totals, Trace, NAMESPACE,
};

/// How often (in requests) the progress callback is called.
pub(crate) const PROGRESS_EVERY: u64 = 64;

/// Replay `trace` through `cache` one request at a time (issue 5, step 3).
///
/// For each request in file order: a request whose KV (rounded up to whole pages)
/// exceeds the pool is rejected at once, nothing expanded or evicted; otherwise match
/// the prompt (page-aligned) and lock the match; take a row; `alloc_extend` the rest of the prompt; one `alloc_decode` per
/// output token after the first (the last generated token's KV is never written);
/// before each allocation that needs more than is free, evict the shortfall. A
/// request whose allocation still fails (everything evictable is gone) is rejected:
/// its slots, lock and row are released and it is counted. Otherwise
/// `cache_finished_req` caches its page-aligned tokens and frees the rest.
///
/// `config.mode`, `max_running` and `routers` are ignored; the cache's request pool
/// must have a row of at least [`Trace::max_kv_len_fitting`] the pool's capacity.
///
/// # Examples
///
/// ```
/// use kvpool::replay::{run_sequential, ReferenceCache, ReplayConfig, Trace};
/// use kvpool::radix::EvictionPolicy;
///
/// let text = "{\"input_length\": 32, \"output_length\": 5, \"hash_ids\": [1]}\n\
///             {\"input_length\": 50, \"output_length\": 1, \"hash_ids\": [1]}\n";
/// let trace = Trace::from_jsonl_str(text, "example")?;
/// let cache = ReferenceCache::new(1024, 16, EvictionPolicy::Lru, 1, trace.max_kv_len())?;
/// let report = run_sequential(&cache, &trace, &ReplayConfig::default(), &|_| {})?;
/// // Request 0 has 36 KV tokens and caches 2 whole pages; request 1 hits those 32,
/// // and its 50 KV tokens add one more page (the 2-token tail is freed).
/// assert_eq!(report.hit_tokens, 32);
/// assert_eq!(report.final_cached_tokens, 48);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
///
/// [`ReplayError::Config`] if the rows are too short; [`ReplayError::Invariant`] if the
/// end-of-run accounting fails; [`ReplayError::Internal`] if the cache refuses a call.
pub fn run_sequential<C: ReplayCache>(
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
    // The waiting queue, told to the cache under the hinted policy: at most the
    // trace's requests wait behind the one admitted.
    let queue = if config.policy.uses_hints() { config.lookahead().min(trace.len()) } else { 0 };
    let mut queue = super::lookahead::Lookahead::new(queue, trace.max_input_length_fitting(capacity))?;
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
        if !fits_in_pool(cache, kv_len) {
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
        queue.hint(cache, trace, r);

        let mut room = |need: usize, totals: &mut Totals| totals.evicted_tokens += make_room(cache, need);
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
    finish_report(cache, config, totals, &hist, wall, timeline)
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
pub(crate) fn serve<C: ReplayCache>(
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
pub(crate) fn last_slot<C: ReplayCache>(cache: &C, row: &ReqRow, len: usize) -> Result<u32, ReplayError> {
    match len.checked_sub(1) {
        Some(p) => Ok(cache.req_pool().read(row, p..len).map_err(|e| ReplayError::internal("read row", e))?[0]),
        None => Ok(0),
    }
}

pub(crate) fn write_row<C: ReplayCache>(
    cache: &C,
    row: &mut ReqRow,
    start: usize,
    slots: &[u32],
) -> Result<(), ReplayError> {
    cache.req_pool().write(row, start, slots).map_err(|e| ReplayError::internal("write row", e))
}

/// Free the slots at `range` of the row, then the row.
pub(crate) fn release<C: ReplayCache>(
    cache: &C,
    row: ReqRow,
    range: core::ops::Range<usize>,
) -> Result<(), ReplayError> {
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
