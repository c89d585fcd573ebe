//! The `cache_ops` loop, shared by `benches/radix_replay.rs` and
//! `examples/cache_ops_profile.rs` (included by path, so both time the same code).

use kvpool::alloc::plan_extend;
use kvpool::replay::{ReplayCache, ReplayRequest, Trace};

/// The cache work of every request of `trace` (admit it: a row, its prompt's match,
/// locked; evict the shortfall; allocate the rest of its KV into the row; finish it);
/// returns the hit tokens. `tokens` holds the longest request's KV tokens.
pub fn cache_ops<C: ReplayCache>(cache: &C, trace: &Trace, tokens: &mut [u32]) -> usize {
    let ps = cache.page_size();
    let mut hits = 0;
    for r in 0..trace.len() {
        let req = trace.request(r);
        let kv = req.kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        let prompt = req.input_length as usize;
        // The row gets the match, then the rest straight from the allocator.
        let mut req = cache.admit(0, &tokens[..prompt]).expect("one row, freed by every request");
        let hit = req.cached_len();
        hits += hit;
        // Evict the shortfall first (as the replay drivers and SGLang do).
        let need = plan_extend(ps, &[hit as u32], &[kv as u32]).expect("plan").new_pages * ps as usize;
        let avail = cache.available_tokens();
        if avail < need {
            cache.evict(need - avail);
        }
        if cache.extend(&mut req, kv - hit).is_err() {
            cache.abort(req);
            continue;
        }
        cache.finish(req, &tokens[..kv]).expect("finish");
    }
    hits
}

/// The part of [`cache_ops`] that is not cache work: the expansion of every request's
/// KV tokens from the trace into `tokens`, which every cache's loop pays alike. Timed on
/// its own so that a run can say how much of each cache's time it is; returns a
/// checksum so that the writes are kept.
pub fn expansion_only(trace: &Trace, tokens: &mut [u32]) -> u64 {
    let mut sum = 0u64;
    for r in 0..trace.len() {
        let kv = trace.request(r).kv_len();
        trace.write_kv_tokens(r, &mut tokens[..kv]);
        sum = sum.wrapping_add(u64::from(tokens[kv.saturating_sub(1)]));
    }
    std::hint::black_box(sum)
}
