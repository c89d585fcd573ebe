//! The request loop every driver runs: a request admitted, its prompt allocated, its
//! decode steps, its finish (or its abort), through a [`ReplayCache`], with the
//! shortfall of each allocation evicted and counted first.
//!
//! [`serve`] runs one request whole (the sequential drivers); the overlap driver runs
//! the same [`prefill`] and [`decode_step`] for its batch on the scheduler thread and
//! [`finish_served`] on the output thread. A model's own steps are [`Steps`] hooks of
//! the loop: what the Mamba tree saves at admission, the window KV an SWA request
//! releases after each step, the host tier's hits.

use std::time::Instant;

use crate::alloc::new_pages;
use crate::error::AllocError;

use super::{decode_need, Histograms, ReplayCache, ReplayError, ReplayRequest, Totals};

/// One request of the trace, as [`serve`] runs it.
pub(crate) struct Job<'t> {
    /// Its KV tokens: the prompt, then the outputs but the last.
    pub tokens: &'t [u32],
    /// Its prompt tokens (the first of `tokens`).
    pub prompt: usize,
    /// Its output tokens.
    pub output: u32,
}

/// A model's own steps in the request loop. The defaults are the attention model's.
pub(crate) trait Steps<C: ReplayCache> {
    /// Before the admission.
    fn before_admit(&mut self, _cache: &C) {}

    /// After the admission of `prompt`: `req` is the admitted request, `None` when no
    /// row (or state) was free. Returns whether the request goes on; one that does not
    /// is aborted and rejected.
    fn admitted(
        &mut self,
        _cache: &C,
        _req: Option<&mut C::Request>,
        _prompt: &[u32],
        _totals: &mut Totals,
    ) -> Result<bool, ReplayError> {
        Ok(true)
    }

    /// Make `need` more tokens free, evicting the shortfall and counting it in
    /// `totals`; whether they are free now (see [`evict_shortfall`]).
    fn room(&mut self, cache: &C, need: usize, totals: &mut Totals) -> bool {
        evict_shortfall(cache, need, totals)
    }

    /// After the prefill and after each decode step of `req`.
    fn step(&mut self, _cache: &C, _req: &mut C::Request) -> Result<(), ReplayError> {
        Ok(())
    }

    /// The request's allocations are over, all made or one refused: before its finish
    /// or its abort.
    fn allocated(&mut self, _cache: &C) {}

    /// Finish a request whose KV is complete, and count it served.
    fn finish(&mut self, cache: &C, req: C::Request, job: &Job<'_>, totals: &mut Totals) -> Result<(), ReplayError> {
        finish_served(cache, req, job, totals)
    }
}

/// The attention model: no steps of its own.
pub(crate) struct Attention;

impl<C: ReplayCache> Steps<C> for Attention {}

/// Evict the shortfall when `need` tokens are more than are free, counting what went
/// in `totals`; whether `need` tokens are free then. Evicts nothing, and returns
/// `false`, when not even that much is evictable: the allocation is not tried then (it
/// would fail, and evicting for it would only empty the cache).
pub(crate) fn evict_shortfall<C: ReplayCache>(cache: &C, need: usize, totals: &mut Totals) -> bool {
    let available = cache.available_tokens();
    if need <= available {
        return true;
    }
    if need - available > cache.evictable_tokens() {
        return false;
    }
    totals.evicted_tokens += cache.evict(need - available) as u64;
    true
}

/// Record the KV tokens in use if they are the most so far.
fn note_peak<C: ReplayCache>(cache: &C, totals: &mut Totals) {
    let used = (cache.capacity_tokens() - cache.available_tokens()) as u64;
    totals.peak_used_tokens = totals.peak_used_tokens.max(used);
}

/// Whether an allocation error is "out of memory" (no room) rather than a bug.
fn out_of_memory(e: AllocError, what: &str) -> Result<(), ReplayError> {
    match e {
        AllocError::OutOfMemory(_) => Ok(()),
        AllocError::Invalid(e) => Err(ReplayError::internal(what, e)),
        AllocError::Row(e) => Err(ReplayError::internal(what, e)),
    }
}

/// What an admission came to.
pub(crate) enum Admission<R> {
    /// Admitted, the prompt's KV allocated.
    Running(R),
    /// Not admitted: no row (or state) is free.
    NoRow,
    /// Admitted, then refused by the model's steps: aborted.
    Refused,
    /// Admitted, but the prompt's KV does not fit even after eviction: the caller
    /// aborts it.
    OutOfMemory(R),
}

/// Admit a request of `prompt` and allocate its prompt's KV past the cached prefix,
/// evicting the shortfall first.
pub(crate) fn prefill<C: ReplayCache, S: Steps<C>>(
    cache: &C,
    steps: &mut S,
    namespace: u64,
    prompt: &[u32],
    totals: &mut Totals,
    hist: &mut Histograms,
) -> Result<Admission<C::Request>, ReplayError> {
    steps.before_admit(cache);
    let t = Instant::now();
    let admitted = cache.admit(namespace, prompt);
    hist.match_.record_since(t);
    let mut req = match admitted {
        Ok(req) => req,
        Err(e) => {
            out_of_memory(e, "admit")?;
            steps.admitted(cache, None, prompt, totals)?;
            return Ok(Admission::NoRow);
        }
    };
    if !steps.admitted(cache, Some(&mut req), prompt, totals)? {
        cache.abort(req);
        return Ok(Admission::Refused);
    }
    let (ps, hit) = (cache.page_size(), req.len());
    let need = new_pages(ps, hit as u32, prompt.len() as u32) as usize * ps as usize;
    if !steps.room(cache, need, totals) {
        return Ok(Admission::OutOfMemory(req));
    }
    let t = Instant::now();
    let res = cache.extend(&mut req, prompt.len() - hit);
    hist.alloc_extend.record_since(t);
    if let Err(e) = res {
        out_of_memory(e, "extend")?;
        return Ok(Admission::OutOfMemory(req));
    }
    note_peak(cache, totals);
    steps.step(cache, &mut req)?;
    Ok(Admission::Running(req))
}

/// One decode step: one KV slot for every request of `batch` (in `out`), the
/// shortfall evicted first. Returns `false` when there is no room even after eviction:
/// nothing was allocated then.
pub(crate) fn decode_step<C: ReplayCache, S: Steps<C>, R: AsMut<C::Request>>(
    cache: &C,
    steps: &mut S,
    batch: &mut [R],
    out: &mut [u32],
    totals: &mut Totals,
    hist: &mut Histograms,
) -> Result<bool, ReplayError> {
    let ps = cache.page_size();
    let need: usize = batch.iter_mut().map(|r| decode_need(ps, r.as_mut().len() as u32 + 1)).sum();
    if need > 0 && !steps.room(cache, need, totals) {
        return Ok(false);
    }
    let t = Instant::now();
    let res = cache.decode(batch, &mut out[..batch.len()]);
    hist.alloc_decode.record_since(t);
    if let Err(e) = res {
        out_of_memory(e, "decode")?;
        return Ok(false);
    }
    if need > 0 {
        note_peak(cache, totals);
    }
    for r in batch.iter_mut() {
        steps.step(cache, r.as_mut())?;
    }
    Ok(true)
}

/// Finish a request whose KV is complete and count it served (the attention model's
/// finish).
pub(crate) fn finish_served<C: ReplayCache>(
    cache: &C,
    req: C::Request,
    job: &Job<'_>,
    totals: &mut Totals,
) -> Result<(), ReplayError> {
    let hit = req.cached_len();
    let cached = cache.finish(req, job.tokens)?;
    totals.served(job.tokens.len(), cache.page_size() as usize, cached, job.prompt, hit, job.output);
    Ok(())
}

/// Serve one request whole: admit it and allocate its prompt, one decode step per
/// output token after the first (the last generated token's KV is never written),
/// finish it. Returns whether it was served; a request refused at admission, or whose
/// allocation fails even after eviction, is aborted (everything it held goes back)
/// and the caller counts it rejected.
pub(crate) fn serve<C: ReplayCache, S: Steps<C>>(
    cache: &C,
    steps: &mut S,
    namespace: u64,
    job: &Job<'_>,
    totals: &mut Totals,
    hist: &mut Histograms,
) -> Result<bool, ReplayError> {
    let mut req = match prefill(cache, steps, namespace, &job.tokens[..job.prompt], totals, hist)? {
        Admission::Running(req) => req,
        Admission::NoRow | Admission::Refused => return Ok(false),
        Admission::OutOfMemory(req) => {
            steps.allocated(cache);
            cache.abort(req);
            return Ok(false);
        }
    };
    let mut slot = [0u32];
    while req.len() < job.tokens.len() {
        if !decode_step(cache, steps, &mut [&mut req], &mut slot, totals, hist)? {
            steps.allocated(cache);
            cache.abort(req);
            return Ok(false);
        }
    }
    steps.allocated(cache);
    let t = Instant::now();
    steps.finish(cache, req, job, totals)?;
    hist.finish.record_since(t);
    Ok(true)
}
