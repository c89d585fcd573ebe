//! The sequential driver's waiting queue (issue 13): under
//! [`EvictionPolicy::Hinted`](crate::radix::EvictionPolicy::Hinted), the next
//! `lookahead` requests of the trace are what a scheduler's waiting queue would hold,
//! and their prefixes are hinted to the cache ([`ReplayCache::hint_prefix`]) each time
//! a request is admitted.
//!
//! Each queued request is looked up again at every admission, as a scheduler that
//! orders its queue by cached prefix (SGLang's `lpm`) does: what an earlier request
//! cached since may have lengthened its prefix. Its prompt is expanded once, when it
//! enters the queue, into a ring of buffers reserved up front (no allocation per
//! request). Deterministic: the hints depend only on the trace and the cache.

use super::{buffer, fits_in_pool, ReplayCache, ReplayError, Trace, NAMESPACE};

/// The queue: a ring of prompt buffers, one per queued request.
pub(crate) struct Lookahead {
    prompts: Vec<Vec<u32>>,
    /// Requests below this index have been expanded.
    loaded: usize,
    out: Vec<u32>,
}

impl Lookahead {
    /// A queue of `n` requests of at most `max_input` prompt tokens.
    pub(crate) fn new(n: usize, max_input: usize) -> Result<Self, ReplayError> {
        let prompts =
            (0..n).map(|_| buffer(max_input.max(1), "the lookahead's prompt buffers")).collect::<Result<_, _>>()?;
        Ok(Lookahead { prompts, loaded: 0, out: buffer(max_input.max(1), "the lookahead's slot buffer")? })
    }

    /// Request `r` was just admitted: hint the prefixes of the requests behind it,
    /// each with the admission it will be (requests too large for the pool are never
    /// admitted and do not count).
    pub(crate) fn hint<C: ReplayCache>(&mut self, cache: &C, trace: &Trace, r: usize) {
        let n = self.prompts.len();
        if n == 0 {
            return;
        }
        let end = (r + 1 + n).min(trace.len());
        let mut position = 0u32;
        for j in r + 1..end {
            let q = trace.request(j);
            if !fits_in_pool(cache, q.kv_len()) {
                continue;
            }
            let buf = &mut self.prompts[j % n];
            if j >= self.loaded {
                trace.write_prompt(j, buf);
                self.loaded = j + 1;
            }
            position += 1;
            let len = q.input_length as usize;
            cache.hint_prefix(NAMESPACE, &buf[..len], &mut self.out[..len], position);
        }
    }
}
