//! `kvpool replay --model swa`: the trace through an [`SwaRadixCache`], as a scheduler
//! serving a model with sliding-window layers drives it: each request's window KV of
//! the tokens that fell out of its window is released as it decodes (SGLang's
//! `maybe_evict_swa`), so caching it later leaves tombstones, and each allocation
//! evicts the shortfall of each pool (SGLang's `evict(full, swa)`).
//!
//! See [`run_swa`] for the request protocol and the accounting.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::alloc::SwaAllocator;
use crate::error::{AllocError, InvariantViolation};
use crate::radix::{RadixConfig, Request, Swa, SwaRadixCache};
use crate::req_to_token::ReqToTokenPool;

use super::lifecycle::{finish_served, serve, Job, Steps};
use super::sequential::PROGRESS_EVERY;
use super::{
    buffer, finish_report, fits_in_pool, Histograms, ReplayCache, ReplayConfig, ReplayError, Report, TimelinePoint,
    Totals, Trace, NAMESPACE,
};

/// Default sliding window: gpt-oss-20b/120b's `sliding_window` (128 tokens; their
/// layers alternate sliding-window and full attention).
pub const DEFAULT_SWA_WINDOW: usize = 128;
/// Default window pool size per full pool size, in thousandths: 0.8 (SGLang's
/// `--swa-full-tokens-ratio` default).
pub const DEFAULT_SWA_RATIO_PERMILLE: u32 = 800;

/// The sliding-window model's window and window pool (used with `Model::Swa`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwaConfig {
    /// Tokens a window layer attends to (default [`DEFAULT_SWA_WINDOW`]).
    pub window: usize,
    /// Window pool tokens per full pool token, in thousandths (default 800).
    pub ratio_permille: u32,
    /// Whether requests release the window KV of tokens that fell out of their window
    /// as they decode (default `true`, SGLang's `maybe_evict_swa`); without it,
    /// tombstones come from window-pool pressure only.
    pub release: bool,
}

impl Default for SwaConfig {
    fn default() -> Self {
        SwaConfig { window: DEFAULT_SWA_WINDOW, ratio_permille: DEFAULT_SWA_RATIO_PERMILLE, release: true }
    }
}

impl SwaConfig {
    /// The window pool's tokens for a full pool of `capacity_tokens`, whole pages.
    ///
    /// ```
    /// use kvpool::replay::SwaConfig;
    /// assert_eq!(SwaConfig::default().window_pool_tokens(1 << 20, 16), 838_848);
    /// ```
    pub fn window_pool_tokens(&self, capacity_tokens: usize, page_size: u32) -> usize {
        let t = capacity_tokens as u128 * self.ratio_permille as u128 / 1000;
        let ps = page_size.max(1) as u128;
        (t / ps * ps).min(usize::MAX as u128) as usize
    }

    /// Check the options against the pools, naming the offending flag.
    pub(crate) fn validate(&self, capacity_tokens: usize, page_size: u32) -> Result<(), ReplayError> {
        let bad = |m: String| Err(ReplayError::Config(m));
        if self.window == 0 {
            return bad("--swa-window must be at least 1".into());
        }
        if self.ratio_permille == 0 || self.ratio_permille > 1000 {
            return bad(format!(
                "--swa-ratio must be between 0.001 and 1 (the window pool is at most the full pool), not {}",
                self.ratio_permille as f64 / 1000.0
            ));
        }
        let pool = self.window_pool_tokens(capacity_tokens, page_size);
        // A request holds the window KV of its last window tokens plus a page of
        // slack while it decodes, and of its whole prompt while it prefills.
        if pool < page_size as usize {
            return bad(format!(
                "--swa-ratio {} leaves the window pool {pool} tokens, less than one page of {page_size}",
                self.ratio_permille as f64 / 1000.0
            ));
        }
        Ok(())
    }
}

/// What the SWA replay adds to the [`Report`] (its `swa` object in `--json`).
///
/// `Report::hit_tokens` is the window hit: the prefix a request can reuse (full KV, and
/// window KV of its last `window` tokens); `full_hit_tokens` is how far the full KV
/// alone matched.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SwaReport {
    /// The sliding window, tokens.
    pub window: usize,
    /// The window pool's tokens.
    pub window_pool_tokens: usize,
    /// Window layers' KV memory saved against a full-size pool: `1 - window pool /
    /// full pool`.
    pub window_memory_saved: f64,
    /// Prompt tokens whose full KV was cached (served requests).
    pub full_hit_tokens: u64,
    /// `full_hit_tokens / prompt_tokens`.
    pub full_hit_rate: f64,
    /// Prompt tokens a request could reuse (= the report's `hit_tokens`).
    pub window_hit_tokens: u64,
    /// `window_hit_tokens / prompt_tokens`.
    pub window_hit_rate: f64,
    /// Window tokens requests released as their tokens fell out of the window.
    pub window_released_tokens: u64,
    /// Window tokens the window pass freed (tombstoning or removing nodes).
    pub window_evicted_tokens: u64,
    /// Full tokens evicted (whole leaves, by either pass).
    pub full_evicted_tokens: u64,
    /// The most full-pool tokens in use at once.
    pub peak_full_used_tokens: u64,
    /// The most window-pool tokens in use at once.
    pub peak_window_used_tokens: u64,
    /// Cached tokens at the end.
    pub final_cached_tokens: u64,
    /// Cached tokens whose window KV is gone at the end (tombstones).
    pub final_tombstone_tokens: u64,
    /// Window-pool tokens in use at the end (the live cached tokens).
    pub final_window_used_tokens: u64,
}

impl SwaReport {
    /// The SWA line under the table's heading.
    pub(crate) fn header(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = super::stats::thousands;
        writeln!(
            f,
            "  (sliding-window model: window {} tokens, window pool {} tokens, {:.0}% of the window layers' KV memory saved)",
            n(self.window as u64),
            n(self.window_pool_tokens as u64),
            100.0 * self.window_memory_saved
        )
    }

    /// The SWA rows of the summary table.
    pub(crate) fn rows(&self, f: &mut fmt::Formatter<'_>, prompt_tokens: u64) -> fmt::Result {
        let pct = |x: u64| if prompt_tokens > 0 { 100.0 * x as f64 / prompt_tokens as f64 } else { 0.0 };
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<22} {v}");
        let n = super::stats::thousands;
        row(f, "full hit tokens", format!("{} ({:.2}%)", n(self.full_hit_tokens), pct(self.full_hit_tokens)))?;
        row(
            f,
            "window hit tokens",
            format!("{} ({:.2}%; reusable: = hit tokens)", n(self.window_hit_tokens), pct(self.window_hit_tokens)),
        )?;
        row(f, "window released", n(self.window_released_tokens))?;
        row(f, "evicted", format!("{} full, {} window", n(self.full_evicted_tokens), n(self.window_evicted_tokens)))?;
        row(
            f,
            "peak used",
            format!(
                "{} full, {} of {} window",
                n(self.peak_full_used_tokens),
                n(self.peak_window_used_tokens),
                n(self.window_pool_tokens as u64)
            ),
        )?;
        row(f, "final tombstones", format!("{} tokens", n(self.final_tombstone_tokens)))
    }
}

/// Build the two pools for `config` and replay `trace` through them (sequential).
pub(crate) fn replay_swa(
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let too_large = |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower --capacity-tokens"));
    let max_context_len = trace.max_kv_len_fitting(config.capacity_tokens).max(1);
    let window_pool = config.swa.window_pool_tokens(config.capacity_tokens, config.page_size);
    let alloc = SwaAllocator::new(config.capacity_tokens, window_pool, config.page_size).map_err(too_large)?;
    let req_pool = ReqToTokenPool::new(config.rows() as u32, max_context_len).map_err(too_large)?;
    let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
    let cache = SwaRadixCache::with_window(alloc, req_pool, radix, config.swa.window)?;
    run_swa(&Arc::new(cache), trace, config, progress)
}

/// The SWA cache as a [`ReplayCache`] over its full pool: the request loop admits,
/// extends, decodes and finishes through it, and the end-of-run accounting (full slots
/// in use = cached tokens) reads it. The loop's room step ([`Window`]'s) has evicted
/// both pools' shortfall before each allocation.
struct Full<'c>(&'c Arc<SwaRadixCache>);

impl ReplayCache for Full<'_> {
    type Request = Request<SwaAllocator, Swa>;

    fn name(&self) -> &'static str {
        "kvpool"
    }
    fn page_size(&self) -> u32 {
        self.0.page_size() as u32
    }
    fn capacity_tokens(&self) -> usize {
        self.0.allocator().size()
    }
    fn available_tokens(&self) -> usize {
        self.0.allocator().full_available_size()
    }
    fn evictable_tokens(&self) -> usize {
        self.0.evictable_size()
    }
    fn cached_tokens(&self) -> usize {
        self.0.total_size()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        self.0.req_pool()
    }
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError> {
        self.0.admit(namespace, prompt)
    }
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError> {
        req.extend(n)
    }
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        self.0.decode(batch, out)
    }
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        req.finish(kv_tokens).map_err(|refused| ReplayError::internal("finish", refused))
    }
    fn abort(&self, req: Self::Request) {
        req.abort();
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        self.0.peek_prefix(namespace, key, out)
    }
    fn evict(&self, num_tokens: usize) -> usize {
        self.0.evict(num_tokens)
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.0.check_invariants()
    }
}

/// Counters of the SWA replay beside the attention [`Totals`].
#[derive(Default)]
struct SwaTotals {
    full_hit_tokens: u64,
    released: u64,
    window_evicted: u64,
    peak_window: u64,
}

/// The sliding-window model's steps in the request loop: the full-KV hit at admission,
/// each pool's shortfall evicted before an allocation (SGLang's `evict(full, swa)`),
/// the window KV released after each step.
struct Window {
    st: SwaTotals,
    window: usize,
    ps: usize,
    /// Whether requests release the window KV that left their window.
    release: bool,
    /// A scratch row for the full-KV look-up.
    slots: Vec<u32>,
    /// The request being served: its full-KV hit, and how far its window KV is
    /// released (SGLang's `swa_evicted_seqlen`).
    kv_hit: usize,
    released: usize,
}

impl Steps<Full<'_>> for Window {
    fn admitted(
        &mut self,
        full: &Full<'_>,
        req: Option<&mut Request<SwaAllocator, Swa>>,
        prompt: &[u32],
        _totals: &mut Totals,
    ) -> Result<bool, ReplayError> {
        let Some(req) = req else { return Ok(false) };
        // The window rule decides the hit; the full KV may match further (the same
        // walk as the admission's, read-only, over the tree the admission left).
        self.kv_hit = full.0.peek_walk(NAMESPACE, prompt, &mut self.slots[..prompt.len()]).len;
        self.released = req.cached_len();
        Ok(true)
    }

    fn room(&mut self, full: &Full<'_>, need: usize, totals: &mut Totals) -> bool {
        let (cache, a) = (full.0, full.0.allocator());
        let full_short = need.saturating_sub(a.full_available_size());
        let window_short = need.saturating_sub(a.window_available_size());
        if full_short > cache.evictable_size() || window_short > cache.swa_evictable_size() {
            // Not even evicting everything would make the room: nothing is evicted.
            return false;
        }
        if full_short > 0 || window_short > 0 {
            let (f, w) = cache.evict_both(full_short, window_short);
            totals.evicted_tokens += f as u64;
            self.st.window_evicted += w as u64;
        }
        true
    }

    fn step(&mut self, full: &Full<'_>, req: &mut Request<SwaAllocator, Swa>) -> Result<(), ReplayError> {
        let a = full.0.allocator();
        self.st.peak_window = self.st.peak_window.max((a.window_size() - a.window_available_size()) as u64);
        // The window KV of the whole pages that fell out of the window, a page of
        // slack kept (SGLang's `maybe_evict_swa`).
        let to = req.len().saturating_sub(self.window.saturating_add(self.ps)) / self.ps * self.ps;
        if self.release && to > self.released {
            let n = req.release_window(self.released..to).map_err(|e| ReplayError::internal("release_window", e))?;
            self.st.released += n as u64;
            self.released = to;
        }
        Ok(())
    }

    fn finish(
        &mut self,
        full: &Full<'_>,
        req: Request<SwaAllocator, Swa>,
        job: &Job<'_>,
        totals: &mut Totals,
    ) -> Result<(), ReplayError> {
        finish_served(full, req, job, totals)?;
        self.st.full_hit_tokens += self.kv_hit as u64;
        Ok(())
    }
}

/// Replay `trace` through `cache` one request at a time.
///
/// For each request in file order (a request whose KV exceeds the full pool is
/// rejected at once), the request loop of [`run_sequential`](super::run_sequential)
/// with the window's steps: the request is admitted (the window rule decides the hit;
/// the full-KV match is counted beside it); it extends by the rest of the prompt and
/// decodes one slot per output token after the first, each after evicting both pools'
/// shortfall; after the prefill and each decode step it releases the window KV of the
/// whole pages that fell out of the window, keeping a page of slack
/// ([`release_window`](crate::radix::Request::release_window), SGLang's
/// `maybe_evict_swa`: up to `seq_len - window - page_size`; not with
/// `config.swa.release` off); then it finishes. A request whose allocation still fails
/// is rejected (aborted: its slots, lock and row go back).
///
/// # Errors
///
/// As [`run_sequential`](super::run_sequential); [`ReplayError::Invariant`] also when
/// the window pool's use does not match the live cached tokens at the end.
pub fn run_swa(
    cache: &Arc<SwaRadixCache>,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let full = Full(cache);
    let ps = cache.page_size();
    let window = cache.window();
    let capacity = full.capacity_tokens();
    let max_kv = trace.max_kv_len_fitting(capacity);
    if cache.req_pool().max_context_len() < max_kv || cache.req_pool().size() == 0 {
        return Err(ReplayError::Config(format!(
            "the cache's request rows hold {} tokens but the trace needs {max_kv}",
            cache.req_pool().max_context_len()
        )));
    }
    let mut tokens = buffer(max_kv.max(1), "the replay's token buffer")?;
    let slots = buffer(max_kv.max(1), "the replay's slot buffer")?;
    let mut steps =
        Window { st: SwaTotals::default(), window, ps, release: config.swa.release, slots, kv_hit: 0, released: 0 };
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
        if fits_in_pool(&full, kv_len) {
            trace.write_kv_tokens(r, &mut tokens);
            let job = Job { tokens: &tokens[..kv_len], prompt: q.input_length as usize, output: q.output_length };
            if !serve(&full, &mut steps, NAMESPACE, &job, &mut totals, &mut hist)? {
                totals.rejected += 1;
            }
        } else {
            totals.rejected += 1;
        }
        if config.timeline {
            timeline.push(TimelinePoint {
                requests_done: r as u32 + 1,
                used_tokens: (capacity - full.available_tokens()) as u64,
                cached_tokens: full.cached_tokens() as u64,
                prompt_tokens: totals.prompt_tokens,
                hit_tokens: totals.hit_tokens,
                ..TimelinePoint::default()
            });
        }
        if (r as u64 + 1) % PROGRESS_EVERY == 0 {
            progress(r as u64 + 1);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    progress(trace.len() as u64);
    let st = steps.st;
    let mut report = finish_report(&full, config, totals, &hist, wall, timeline)?;
    let a = cache.allocator();
    let window_used = (a.window_size() - a.window_available_size()) as u64;
    let live = (cache.swa_evictable_size() + cache.swa_protected_size()) as u64;
    if window_used != live {
        return Err(InvariantViolation(format!(
            "{window_used} window slots are in use but the cache holds {live} live tokens: {} leaked",
            window_used as i64 - live as i64
        ))
        .into());
    }
    let pct = |x: u64| if totals.prompt_tokens > 0 { x as f64 / totals.prompt_tokens as f64 } else { 0.0 };
    report.swa = Some(SwaReport {
        window,
        window_pool_tokens: a.window_size(),
        window_memory_saved: 1.0 - a.window_size() as f64 / a.size().max(1) as f64,
        full_hit_tokens: st.full_hit_tokens,
        full_hit_rate: pct(st.full_hit_tokens),
        window_hit_tokens: totals.hit_tokens,
        window_hit_rate: pct(totals.hit_tokens),
        window_released_tokens: st.released,
        window_evicted_tokens: st.window_evicted,
        full_evicted_tokens: totals.evicted_tokens,
        peak_full_used_tokens: totals.peak_used_tokens,
        peak_window_used_tokens: st.peak_window,
        final_cached_tokens: cache.total_size() as u64,
        final_tombstone_tokens: cache.tombstone_size() as u64,
        final_window_used_tokens: window_used,
    });
    Ok(report)
}
