//! The sequential driver: one request at a time, on one thread, deterministic.

use std::time::Instant;

use super::lifecycle::{serve, Job, Steps};
use super::lookahead::Lookahead;
use super::{
    buffer, finish_report, fits_in_pool, Histograms, ReplayCache, ReplayConfig, ReplayError, Report, TimelinePoint,
    Totals, Trace, NAMESPACE,
};

/// How often (in requests) the progress callback is called.
pub(crate) const PROGRESS_EVERY: u64 = 64;

/// Replay `trace` through `cache` one request at a time (issue 5, step 3).
///
/// For each request in file order: a request whose KV (rounded up to whole pages)
/// exceeds the pool is rejected at once, nothing expanded or evicted; otherwise it is
/// admitted ([`ReplayCache::admit`]: a row, its prompt's page-aligned match, locked),
/// the rest of its prompt is allocated ([`extend`](ReplayCache::extend)), then one
/// slot per output token after the first ([`decode`](ReplayCache::decode): the last
/// generated token's KV is never written); before each allocation that needs more than
/// is free, the shortfall is evicted. A request whose allocation still fails
/// (everything evictable is gone) is rejected: it is aborted, giving back its slots,
/// lock and row, and counted. Otherwise [`finish`](ReplayCache::finish) caches its
/// page-aligned tokens and frees the rest.
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
/// kvpool's cache is driven through its request handles, which hold the cache in an
/// [`Arc`](std::sync::Arc):
///
/// ```
/// use std::sync::Arc;
/// use kvpool::radix::{RadixCache, RadixConfig};
/// use kvpool::replay::{run_sequential, ReplayConfig, Trace};
/// use kvpool::{PagedAllocator, ReqToTokenPool};
///
/// let trace = Trace::from_jsonl_str("{\"input_length\": 40, \"output_length\": 3, \"hash_ids\": [1]}\n".repeat(2).as_str(), "t")?;
/// let rows = ReqToTokenPool::new(1, trace.max_kv_len())?;
/// let cache = Arc::new(RadixCache::new(PagedAllocator::new(1024, 16)?, rows, RadixConfig::default())?);
/// let report = run_sequential(&cache, &trace, &ReplayConfig::default(), &|_| {})?;
/// assert_eq!((report.hit_tokens, report.final_cached_tokens), (32, 32));
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
    let queue = Lookahead::new(queue, trace.max_input_length_fitting(capacity))?;
    let mut steps = Sequential { queue, trace, r: 0, timeline: config.timeline, used: 0 };
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
        let kv_len = q.kv_len();
        if fits_in_pool(cache, kv_len) {
            trace.write_kv_tokens(r, &mut tokens);
            steps.r = r;
            let job = Job { tokens: &tokens[..kv_len], prompt: q.input_length as usize, output: q.output_length };
            if !serve(cache, &mut steps, NAMESPACE, &job, &mut totals, &mut hist)? {
                totals.rejected += 1;
            }
        } else {
            // Larger than the whole pool: it can never be served. Nothing is evicted.
            totals.rejected += 1;
            steps.used = capacity - cache.available_tokens();
        }
        if config.timeline {
            let (host_tokens, host_hit_tokens) = cache.tier_occupancy();
            timeline.push(TimelinePoint {
                requests_done: r as u32 + 1,
                used_tokens: steps.used as u64,
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

/// The sequential driver's steps: the waiting queue hinted at each admission, the
/// slots in use with each request's all allocated (for the timeline).
struct Sequential<'t> {
    queue: Lookahead,
    trace: &'t Trace,
    /// The request being served.
    r: usize,
    timeline: bool,
    used: usize,
}

impl<C: ReplayCache> Steps<C> for Sequential<'_> {
    fn admitted(
        &mut self,
        cache: &C,
        _req: Option<&mut C::Request>,
        _prompt: &[u32],
        _totals: &mut Totals,
    ) -> Result<bool, ReplayError> {
        self.queue.hint(cache, self.trace, self.r);
        Ok(true)
    }

    fn allocated(&mut self, cache: &C) {
        if self.timeline {
            self.used = cache.capacity_tokens() - cache.available_tokens();
        }
    }
}
