//! The overlap driver: scheduler, output and router threads sharing one cache (see
//! [`run_overlap`]).

use std::collections::VecDeque;
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use crossbeam_utils::Backoff;

use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::lifecycle::{decode_step, finish_served, prefill, Admission as Prefill, Attention, Job};
use super::sequential::PROGRESS_EVERY;
use super::{
    buffer, finish_report, fits_in_pool, Histograms, LatencyHistogram, ReplayCache, ReplayConfig, ReplayError,
    ReplayRequest, Report, TimelinePoint, Totals, Trace, NAMESPACE,
};

/// State the threads share. Counters only: requests move through the channel.
struct Shared {
    /// The first request not yet admitted (routers match from here on).
    next_admit: AtomicUsize,
    /// Requests sent to the output thread and not yet finished.
    pending: AtomicUsize,
    /// Requests served or rejected (for progress).
    done_requests: AtomicU64,
    /// The scheduler is done: routers stop.
    done: AtomicBool,
    /// The output thread failed: the scheduler stops waiting for it.
    failed: AtomicBool,
}

/// A request the scheduler is running.
struct Running<R> {
    r: usize,
    req: R,
    kv_len: usize,
}

impl<R> AsMut<R> for Running<R> {
    fn as_mut(&mut self) -> &mut R {
        &mut self.req
    }
}

/// A request whose KV is complete, on its way to the output thread.
struct Finished<R> {
    r: usize,
    req: R,
}

/// What the output thread measured.
#[derive(Default)]
struct OutputResult {
    totals: Totals,
    finish: LatencyHistogram,
    timeline: Vec<TimelinePoint>,
}

/// What a router measured.
#[derive(Default)]
struct RouterResult {
    matches: u64,
    hit_tokens: u64,
    route: LatencyHistogram,
    /// Times the router waited for the window to reach its next request (each time
    /// it went back to sleep, or polled).
    waits: u64,
}

/// Replay `trace` through `cache` with an overlap scheduler (issue 5, step 4).
///
/// * The **scheduler** (the calling thread) admits requests in trace order while fewer
///   than `max_running` run ([`ReplayCache::admit`]: a row, the prompt's match, locked;
///   then [`extend`](ReplayCache::extend) by the rest of the prompt). Then one decode
///   step: a single [`decode`](ReplayCache::decode) call gives every running request
///   one slot. Requests whose KV is complete move to the output thread.
/// * The **output thread** finishes those requests ([`finish`](ReplayCache::finish):
///   insert, free duplicates and the tail, unlock, free the row) while the scheduler
///   allocates.
/// * **Routers** (`routers` threads) match upcoming prompts read-only, as a KV-aware
///   router does when a request arrives: router `k` takes requests `k, k + K, ...`, and
///   matches each once it is among the next `max_running` requests to be admitted
///   (one that was admitted before its router got to it is skipped, and so is one
///   too large for the pool). A router waiting for its next request sleeps (parks)
///   until the scheduler's admissions bring that request into the window, and the
///   scheduler wakes exactly that router: idle routers take no CPU time.
///
/// Memory pressure is handled as an engine does: before an allocation that needs more
/// than is free, the scheduler evicts the shortfall (when that much is evictable). If
/// an admission still does not fit, the request waits for the next step. If a decode
/// step does not fit, the scheduler first waits for requests that the output thread
/// is finishing (their tokens become evictable), and otherwise retracts the most
/// recently admitted request: it is aborted (its slots, lock and row go back) and goes
/// back to the front of the waiting queue (SGLang's `retract_decode`). A request whose KV
/// (rounded up to pages) exceeds the whole pool is rejected before it is admitted; so
/// is one that cannot be admitted while nothing else holds memory.
///
/// The driver allocates nothing per request (every buffer is sized from the trace up
/// front, the channel to the output thread is bounded, latencies go to fixed
/// histograms), so with kvpool's cache the whole hot path is allocation-free.
///
/// The hit counts depend on the interleaving (a request can only hit what finished
/// before it was matched), so unlike [`run_sequential`](super::run_sequential) the
/// result is not deterministic; the end-of-run accounting is exact all the same.
///
/// # Examples
///
/// ```
/// use kvpool::replay::{run_overlap, ReferenceCache, ReplayConfig, Trace};
/// use kvpool::radix::EvictionPolicy;
///
/// let text = "{\"input_length\": 1000, \"output_length\": 50, \"hash_ids\": [1, 2]}\n".repeat(20);
/// let trace = Trace::from_jsonl_str(&text, "example")?;
/// let config = ReplayConfig { max_running: 4, routers: 2, ..ReplayConfig::default() };
/// let cache = ReferenceCache::new(1 << 14, 16, EvictionPolicy::Lru, config.rows() as u32, trace.max_kv_len())?;
/// let report = run_overlap(&cache, &trace, &config, &|_| {})?;
/// assert_eq!(report.requests, 20);
/// assert!(report.invariants_ok);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
///
/// [`ReplayError::Config`] if the cache's request pool has fewer rows than
/// [`ReplayConfig::rows`] or rows too short for the trace; [`ReplayError::Invariant`] if
/// the end-of-run accounting fails; [`ReplayError::Internal`] if the cache refuses a
/// call or a thread panics.
pub fn run_overlap<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    run_overlap_counted(cache, trace, config, progress).map(|(report, _)| report)
}

/// [`run_overlap`], also returning how many times the routers waited in all.
pub(crate) fn run_overlap_counted<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(Report, u64), ReplayError> {
    let pool = cache.req_pool();
    // Requests that do not fit in the pool are rejected before expansion: size for the others.
    let max_kv = trace.max_kv_len_fitting(cache.capacity_tokens());
    let max_input = trace.max_input_length_fitting(cache.capacity_tokens()).max(1);
    if pool.size() < config.rows() || pool.max_context_len() < max_kv {
        return Err(ReplayError::Config(format!(
            "overlap mode with --max-running {} needs {} request rows of {} tokens; the cache has {} of {}",
            config.max_running,
            config.rows(),
            max_kv,
            pool.size(),
            pool.max_context_len()
        )));
    }
    if config.max_running == 0 {
        return Err(ReplayError::Config("--max-running must be at least 1".into()));
    }
    let shared = Shared {
        next_admit: AtomicUsize::new(0),
        pending: AtomicUsize::new(0),
        done_requests: AtomicU64::new(0),
        done: AtomicBool::new(false),
        failed: AtomicBool::new(false),
    };
    // Every buffer is reserved (fallibly) before any thread starts.
    let mut buffers = Buffers {
        prompt: buffer(max_input, "the scheduler's prompt buffer")?,
        output_tokens: buffer(max_kv.max(1), "the output thread's token buffer")?,
        routers: Vec::with_capacity(config.routers),
    };
    for _ in 0..config.routers {
        let prompt = buffer(max_input, "a router's prompt buffer")?;
        buffers.routers.push((prompt, buffer(max_input, "a router's slot buffer")?));
    }
    let Buffers { prompt, output_tokens, routers } = buffers;
    let start = Instant::now();
    let (tx, rx) = crossbeam_channel::bounded(config.max_running);
    let (sched, output, routers) = std::thread::scope(|s| {
        let shared = &shared;
        let output = s.spawn(move || output_thread(cache, trace, config, rx, shared, progress, output_tokens));
        let routers: Vec<_> = routers
            .into_iter()
            .enumerate()
            .map(|(k, bufs)| s.spawn(move || router_thread(cache, trace, config, k, shared, bufs)))
            .collect();
        let router_threads: Vec<Thread> = routers.iter().map(|h| h.thread().clone()).collect();
        let done = RoutersDone { shared, routers: router_threads.clone() };
        let sched = scheduler(cache, trace, config, tx, shared, router_threads, prompt);
        drop(done);
        let output = output.join();
        let routers: Vec<_> = routers.into_iter().map(|h| h.join()).collect();
        (sched, output, routers)
    });
    let wall = start.elapsed().as_secs_f64();
    let panicked = |who: &str| ReplayError::Internal(format!("the {who} thread panicked"));
    let output = output.map_err(|_| panicked("output"))?;
    let (mut totals, mut hist) = sched?;
    let output = output?;
    totals.served = output.totals.served;
    totals.prompt_tokens = output.totals.prompt_tokens;
    totals.hit_tokens = output.totals.hit_tokens;
    totals.output_tokens = output.totals.output_tokens;
    totals.added_tokens = output.totals.added_tokens;
    hist.finish = output.finish;
    let mut router_waits = 0;
    for router in routers {
        let router = router.map_err(|_| panicked("router"))?;
        router_waits += router.waits;
        totals.router_matches += router.matches;
        totals.router_hit_tokens += router.hit_tokens;
        hist.route.merge(&router.route);
    }
    progress(totals.served + totals.rejected);
    Ok((finish_report(cache, config, totals, &hist, wall, output.timeline)?, router_waits))
}

/// Tells the routers that the scheduler is done and wakes them all when dropped: after
/// the scheduler returns, and also if it panics, so that joining never waits on a
/// parked router.
struct RoutersDone<'a> {
    shared: &'a Shared,
    routers: Vec<Thread>,
}

impl Drop for RoutersDone<'_> {
    fn drop(&mut self) {
        self.shared.done.store(true, Ordering::Release);
        for router in &self.routers {
            router.unpark();
        }
    }
}

/// Every thread's buffers, reserved before the threads start.
struct Buffers {
    prompt: Vec<u32>,
    output_tokens: Vec<u32>,
    /// Each router's prompt and slot buffers.
    routers: Vec<(Vec<u32>, Vec<u32>)>,
}

/// What admitting one request came to.
enum Admission<R> {
    Admitted(Running<R>),
    /// Not now: memory or rows are held by other requests.
    Wait,
    Rejected,
}

struct Scheduler<'c, C: ReplayCache> {
    cache: &'c C,
    trace: &'c Trace,
    shared: &'c Shared,
    tx: Sender<Finished<C::Request>>,
    /// The router threads, to wake the one whose request enters the window.
    routers: Vec<Thread>,
    /// Requests a router may match ahead: `max_running`.
    window: usize,
    prompt: Vec<u32>,
    /// The request whose prompt is in `prompt`.
    prompt_of: usize,
    totals: Totals,
    hist: Histograms,
}

fn scheduler<'c, C: ReplayCache>(
    cache: &'c C,
    trace: &'c Trace,
    config: &ReplayConfig,
    tx: Sender<Finished<C::Request>>,
    shared: &'c Shared,
    routers: Vec<Thread>,
    prompt: Vec<u32>,
) -> Result<(Totals, Histograms), ReplayError> {
    let max_running = config.max_running;
    let mut s = Scheduler {
        cache,
        trace,
        shared,
        tx,
        routers,
        window: router_window(config),
        prompt,
        prompt_of: usize::MAX,
        totals: Totals::default(),
        hist: Histograms::default(),
    };
    let mut out = vec![0; max_running];
    let mut running: Vec<Running<C::Request>> = Vec::with_capacity(max_running);
    let mut retracted: VecDeque<usize> = VecDeque::with_capacity(max_running);
    let mut next = 0;
    let n = trace.len();
    loop {
        // Admit in order: retracted requests first, then the trace.
        while running.len() < max_running {
            let Some(r) = retracted.front().copied().or((next < n).then_some(next)) else { break };
            let run = match s.admit(r, running.is_empty())? {
                Admission::Wait => break,
                Admission::Admitted(run) => Some(run),
                Admission::Rejected => None,
            };
            // `r` leaves the waiting queue.
            if retracted.front() == Some(&r) {
                retracted.pop_front();
            } else {
                next += 1;
                shared.next_admit.store(next, Ordering::Release);
                s.wake_router(next);
            }
            match run {
                Some(run) if run.req.len() == run.kv_len => s.send(run)?,
                Some(run) => running.push(run),
                None => {
                    s.totals.rejected += 1;
                    shared.done_requests.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if running.is_empty() {
            if retracted.is_empty() && next >= n {
                return Ok((s.totals, s.hist));
            }
            // Requests wait but nothing runs: the memory is with the output thread.
            s.wait_for_output()?;
            continue;
        }
        s.decode_step(&mut running, &mut retracted, &mut out)?;
    }
}

impl<'c, C: ReplayCache> Scheduler<'c, C> {
    /// `next_admit` just became `next`: request `next + window - 1` entered the routers'
    /// window; wake its router (router `k` takes requests `k, k + K, ...`). If that
    /// router is not asleep yet, the unpark token makes its next park return at once.
    fn wake_router(&self, next: usize) {
        if !self.routers.is_empty() {
            self.routers[(next + self.window - 1) % self.routers.len()].unpark();
        }
    }

    fn admit(&mut self, r: usize, alone: bool) -> Result<Admission<C::Request>, ReplayError> {
        let cache = self.cache;
        let q = self.trace.request(r);
        let (prompt, kv_len) = (q.input_length as usize, q.kv_len());
        if !fits_in_pool(cache, kv_len) {
            // Larger than the whole pool: rejected before its tokens are expanded.
            return Ok(Admission::Rejected);
        }
        // Read before the attempt: if no request was with the output thread then, none
        // held memory during it (only this thread admits), so a failure is final. Read
        // after, a finish that freed memory mid-attempt would look like no one's.
        let pending_before = self.shared.pending.load(Ordering::Acquire);
        if self.prompt_of != r {
            // A request that waits is retried every step: expand its prompt once.
            self.trace.write_prompt(r, &mut self.prompt);
            self.prompt_of = r;
        }
        // Only this thread allocates, evicts or locks, so what the prefill evicts stays
        // free until its allocation.
        let (prompt, totals, hist) = (&self.prompt[..prompt], &mut self.totals, &mut self.hist);
        match prefill(cache, &mut Attention, NAMESPACE, prompt, totals, hist)? {
            Prefill::Running(req) => Ok(Admission::Admitted(Running { r, req, kv_len })),
            // No row free: the output thread holds them. (The attention model's steps
            // refuse nothing.)
            Prefill::NoRow | Prefill::Refused => Ok(Admission::Wait),
            Prefill::OutOfMemory(req) => {
                cache.abort(req);
                let nobody_else = alone && pending_before == 0;
                Ok(if nobody_else { Admission::Rejected } else { Admission::Wait })
            }
        }
    }

    /// Hand a complete request to the output thread.
    fn send(&mut self, run: Running<C::Request>) -> Result<(), ReplayError> {
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let finished = Finished { r: run.r, req: run.req };
        self.tx.send(finished).map_err(|_| ReplayError::Internal("the output thread stopped".into()))
    }

    /// Wait until the output thread finishes at least one more request.
    fn wait_for_output(&self) -> Result<(), ReplayError> {
        let seen = self.shared.pending.load(Ordering::Acquire);
        if seen == 0 {
            return Ok(());
        }
        let backoff = Backoff::new();
        while self.shared.pending.load(Ordering::Acquire) >= seen {
            if self.shared.failed.load(Ordering::Acquire) {
                return Err(ReplayError::Internal("the output thread failed".into()));
            }
            if backoff.is_completed() {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                backoff.snooze();
            }
        }
        Ok(())
    }

    /// One decode step: one slot for every running request, in one `decode`.
    fn decode_step(
        &mut self,
        running: &mut Vec<Running<C::Request>>,
        retracted: &mut VecDeque<usize>,
        out: &mut [u32],
    ) -> Result<(), ReplayError> {
        loop {
            // As in `admit`: whether anyone else could hold memory during the attempt.
            let pending_before = self.shared.pending.load(Ordering::Acquire);
            if decode_step(self.cache, &mut Attention, running, out, &mut self.totals, &mut self.hist)? {
                break;
            }
            if pending_before > 0 {
                // Requests being finished will free or unlock their tokens.
                self.wait_for_output()?;
                continue;
            }
            // Retract the most recently admitted request.
            let Some(victim) = running.pop() else { return Ok(()) };
            let r = victim.r;
            self.cache.abort(victim.req);
            if running.is_empty() {
                // It could not decode alone with nothing else holding memory.
                self.totals.rejected += 1;
                self.shared.done_requests.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            retracted.push_front(r);
            self.totals.retracted += 1;
        }
        let mut k = 0;
        while k < running.len() {
            if running[k].req.len() == running[k].kv_len {
                let run = running.remove(k);
                self.send(run)?;
            } else {
                k += 1;
            }
        }
        Ok(())
    }
}

fn output_thread<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    rx: Receiver<Finished<C::Request>>,
    shared: &Shared,
    progress: &(dyn Fn(u64) + Sync),
    tokens: Vec<u32>,
) -> Result<OutputResult, ReplayError> {
    let result = output_loop(cache, trace, config, &rx, shared, progress, tokens);
    if result.is_err() {
        shared.failed.store(true, Ordering::Release);
    }
    result
}

fn output_loop<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    rx: &Receiver<Finished<C::Request>>,
    shared: &Shared,
    progress: &(dyn Fn(u64) + Sync),
    mut tokens: Vec<u32>,
) -> Result<OutputResult, ReplayError> {
    let capacity = cache.capacity_tokens();
    let mut out = OutputResult::default();
    if config.timeline {
        out.timeline.try_reserve_exact(trace.len()).map_err(|_| crate::ConfigError::TooLargeForMemory {
            what: "the replay's timeline",
            bytes: crate::arena::bytes_of::<TimelinePoint>(trace.len()),
        })?;
    }
    for f in rx.iter() {
        let q = trace.request(f.r);
        trace.write_kv_tokens(f.r, &mut tokens);
        let job = Job { tokens: &tokens[..q.kv_len()], prompt: q.input_length as usize, output: q.output_length };
        let t = Instant::now();
        finish_served(cache, f.req, &job, &mut out.totals)?;
        out.finish.record_since(t);
        shared.pending.fetch_sub(1, Ordering::AcqRel);
        let t = &out.totals;
        let done = shared.done_requests.fetch_add(1, Ordering::Relaxed) + 1;
        if config.timeline {
            out.timeline.push(TimelinePoint {
                requests_done: done as u32,
                used_tokens: (capacity - cache.available_tokens()) as u64,
                cached_tokens: cache.cached_tokens() as u64,
                prompt_tokens: t.prompt_tokens,
                hit_tokens: t.hit_tokens,
                ..TimelinePoint::default()
            });
        }
        if done % PROGRESS_EVERY == 0 {
            progress(done);
        }
    }
    Ok(out)
}

/// How far ahead of admission the routers look: `max_running`, or under the hinted
/// policy the lookahead (the requests whose prefixes the cache is told about).
fn router_window(config: &ReplayConfig) -> usize {
    if config.policy.uses_hints() {
        config.lookahead().max(1)
    } else {
        config.max_running
    }
}

fn router_thread<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    k: usize,
    shared: &Shared,
    (mut prompt, mut slots): (Vec<u32>, Vec<u32>),
) -> RouterResult {
    let mut res = RouterResult::default();
    let hinted = config.policy.uses_hints();
    let window = router_window(config);
    let mut r = k;
    while r < trace.len() {
        let next = shared.next_admit.load(Ordering::Acquire);
        // Admitted before this router got to it, or never admitted (too large for the
        // pool; its prompt would not fit the buffers either).
        if r < next || !fits_in_pool(cache, trace.request(r).kv_len()) {
            r += config.routers;
            continue;
        }
        if r >= next + window {
            if shared.done.load(Ordering::Acquire) {
                break;
            }
            // Sleep until the scheduler's admissions bring `r` into the window (it
            // unparks this router then) or the scheduler is done (it unparks every
            // router). An unpark that comes between the check above and this park
            // leaves a token, so the park returns at once: no wake-up is lost, and a
            // spurious return only re-checks.
            res.waits += 1;
            std::thread::park();
            continue;
        }
        let len = trace.request(r).input_length as usize;
        trace.write_prompt(r, &mut prompt);
        let t = Instant::now();
        // Under the hinted policy the look-up also tells the cache the prefix is wanted
        // by the admission `r - next + 1` from now (an estimate: admissions go on
        // meanwhile, and a late hint only protects a little longer).
        let hit = if hinted {
            let position = (r + 1).saturating_sub(next).min(u32::MAX as usize) as u32;
            cache.hint_prefix(NAMESPACE, &prompt[..len], &mut slots[..len], position)
        } else {
            cache.peek_prefix(NAMESPACE, &prompt[..len], &mut slots[..len])
        };
        res.route.record_since(t);
        res.matches += 1;
        res.hit_tokens += hit as u64;
        r += config.routers;
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::radix::EvictionPolicy;
    use crate::replay::ReferenceCache;

    /// Routers that wait for the scheduler must sleep until it admits the request
    /// they are waiting for, not poll: each admission wakes at most one router, so
    /// the waits stay within (twice, for spurious wake-ups) the admissions plus one
    /// final wake-up per router, however long the replay runs.
    #[test]
    fn idle_routers_do_not_poll() {
        let text: String = (0..300)
            .map(|i| format!("{{\"input_length\": 64, \"output_length\": 300, \"hash_ids\": [{}]}}\n", i % 7))
            .collect();
        let trace = Trace::from_jsonl_str(&text, "t").unwrap();
        let config = ReplayConfig { max_running: 1, routers: 8, ..ReplayConfig::default() };
        let cache =
            ReferenceCache::new(1 << 14, 16, EvictionPolicy::Lru, config.rows() as u32, trace.max_kv_len()).unwrap();
        let (report, waits) = run_overlap_counted(&cache, &trace, &config, &|_| {}).unwrap();
        assert_eq!(report.requests, 300);
        let bound = 2 * (trace.len() as u64 + config.routers as u64);
        assert!(waits <= bound, "routers waited {waits} times for {} admissions (bound {bound})", trace.len());
    }
}
