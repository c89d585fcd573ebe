//! Measurements of a replay: latency histograms, the report, its table and JSON forms.

use std::fmt;
use std::time::Instant;

use serde::Serialize;

/// Sub-buckets per power of two: values are kept to within 1/32 (about 3%).
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Values below `SUB` get a bucket each; then 16 buckets per power of two up to 2^64.
const BUCKETS: usize = SUB + (64 - SUB_BITS as usize) * SUB;

/// A fixed-size log-bucket latency histogram (nanoseconds): recording is a few integer
/// operations and never allocates.
///
/// # Examples
///
/// ```
/// use kvpool::replay::LatencyHistogram;
/// let mut h = LatencyHistogram::new();
/// for ns in 1..=100 {
///     h.record(ns);
/// }
/// assert_eq!(h.count(), 100);
/// let p50 = h.quantile(0.5);
/// assert!((48..=53).contains(&p50), "{p50}");
/// assert!(h.quantile(0.99) >= 96);
/// ```
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: [u64; BUCKETS],
    total: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new()
    }
}

impl fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.total)
            .field("p50", &self.quantile(0.5))
            .field("p99", &self.quantile(0.99))
            .finish()
    }
}

impl LatencyHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        LatencyHistogram { counts: [0; BUCKETS], total: 0 }
    }

    #[inline]
    fn bucket(v: u64) -> usize {
        if v < SUB as u64 {
            return v as usize;
        }
        let e = 63 - v.leading_zeros(); // >= SUB_BITS
        let sub = (v >> (e - SUB_BITS)) as usize & (SUB - 1);
        SUB + (e - SUB_BITS) as usize * SUB + sub
    }

    /// The middle of bucket `b`'s value range.
    fn value(b: usize) -> u64 {
        if b < SUB {
            return b as u64;
        }
        let e = ((b - SUB) / SUB) as u32 + SUB_BITS;
        let sub = ((b - SUB) % SUB) as u64;
        let width = 1u64 << (e - SUB_BITS);
        let low = (1u64 << e) + sub * width;
        low + (width - 1) / 2
    }

    /// Record one value (nanoseconds).
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.counts[Self::bucket(ns)] += 1;
        self.total += 1;
    }

    /// Record the time elapsed since `start`.
    #[inline]
    pub fn record_since(&mut self, start: Instant) {
        self.record(start.elapsed().as_nanos().min(u64::MAX as u128) as u64);
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Add another histogram's counts to this one.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The `q`-quantile (`0.0..=1.0`), within the bucket resolution; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::value(b);
            }
        }
        Self::value(BUCKETS - 1)
    }

    /// p50 and p99.
    pub fn summary(&self) -> Percentiles {
        Percentiles { p50: self.quantile(0.5), p99: self.quantile(0.99) }
    }
}

/// Median and 99th percentile of a latency, nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
}

/// Latency percentiles of each operation the replay times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Latencies {
    /// A request's admission: a row, its prompt's match, locked.
    #[serde(rename = "match")]
    pub match_: Percentiles,
    /// The extend by a prompt's uncached part (eviction not included).
    pub alloc_extend: Percentiles,
    /// A decode step (sequential: one request; overlap: one call for the running batch;
    /// eviction not included).
    pub alloc_decode: Percentiles,
    /// A request's finish.
    pub finish: Percentiles,
    /// A router's read-only `match_prefix` (overlap mode only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<Percentiles>,
}

/// One point of the timeline that `--plot` draws: the state when a request finished
/// (or was rejected).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimelinePoint {
    /// Requests finished or rejected so far.
    pub requests_done: u32,
    /// KV slots in use: cached plus held by running requests (sequential mode: taken
    /// just before the request's finish, so its own slots count).
    pub used_tokens: u64,
    /// Tokens in the prefix cache.
    pub cached_tokens: u64,
    /// Cumulative prompt tokens of the requests served so far.
    pub prompt_tokens: u64,
    /// Cumulative hit tokens of the requests served so far.
    pub hit_tokens: u64,
    /// A two-tier replay: tokens held in host memory (0 without a host tier).
    pub host_tokens: u64,
    /// A two-tier replay: cumulative tokens loaded back from host (in `hit_tokens`).
    pub host_hit_tokens: u64,
}

/// The result of a replay: the numbers the summary table and `--json` print.
///
/// Token counts (`prompt_tokens`, `hit_tokens`, `computed_tokens`, `output_tokens`)
/// are sums over the requests that were served, so `hit_rate = hit_tokens /
/// prompt_tokens` is the share of served prompt tokens found in the cache;
/// `computed_tokens = prompt_tokens - hit_tokens` are the prompt tokens a prefill
/// would compute. `requests` counts every request of the trace, `rejected` those that
/// could not be given memory even with the whole cache evicted.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Requests replayed (served plus rejected).
    pub requests: u64,
    /// Requests that could not be served.
    pub rejected: u64,
    /// Prompt tokens of the served requests.
    pub prompt_tokens: u64,
    /// Prompt tokens found in the cache when the served requests were matched.
    pub hit_tokens: u64,
    /// `hit_tokens / prompt_tokens` (0 when there are none).
    pub hit_rate: f64,
    /// `prompt_tokens - hit_tokens`.
    pub computed_tokens: u64,
    /// Output tokens of the served requests.
    pub output_tokens: u64,
    /// Tokens evicted from the cache.
    pub evicted_tokens: u64,
    /// The most KV slots in use at once.
    pub peak_used_tokens: u64,
    /// Tokens in the cache at the end.
    pub final_cached_tokens: u64,
    /// Wall time of the replay (trace loading excluded).
    pub wall_seconds: f64,
    /// `requests / wall_seconds`.
    pub requests_per_second: f64,
    /// `(prompt_tokens + output_tokens) / wall_seconds`.
    pub tokens_per_second: f64,
    /// Latency percentiles per operation.
    pub latency_ns: Latencies,
    /// `sequential` or `overlap`.
    pub mode: &'static str,
    /// Which prefix cache ran (`kvpool` or `reference`).
    pub cache: &'static str,
    /// The eviction policy.
    pub policy: &'static str,
    /// Tokens per page.
    pub page_size: u32,
    /// Token capacity of the KV pool.
    pub capacity_tokens: u64,
    /// Requests running at once (1 in sequential mode).
    pub max_running: u64,
    /// Router threads (overlap mode).
    pub routers: u64,
    /// Requests retracted to the waiting queue for lack of decode memory and later
    /// re-admitted (overlap mode).
    pub retracted: u64,
    /// Read-only matches done by the routers.
    pub router_matches: u64,
    /// Tokens those matches found.
    pub router_hit_tokens: u64,
    /// Whether `check_invariants()` held at the end and every KV slot and request
    /// row was accounted for (an error is returned otherwise, so this is `true` in
    /// every report).
    pub invariants_ok: bool,
    /// Per-request points for `--plot` (not serialized).
    #[serde(skip)]
    pub timeline: Vec<TimelinePoint>,
    /// `--model hybrid`: the Mamba-state figures (absent for attention models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<super::HybridReport>,
    /// `--model swa`: the window-pool figures (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swa: Option<super::SwaReport>,
    /// `--host-capacity-tokens`: the host tier's figures (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<super::HostReport>,
    /// `--engines` / `--store`: the figures per tier and engine, and the store's
    /// operations (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<super::StoreReport>,
}

impl Report {
    /// The report as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub(crate) fn duration(ns: u64) -> String {
    match ns {
        0..=9_999 => format!("{ns} ns"),
        10_000..=9_999_999 => format!("{:.1} us", ns as f64 / 1e3),
        _ => format!("{:.1} ms", ns as f64 / 1e6),
    }
}

impl fmt::Display for Report {
    /// The summary table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<22} {v}");
        writeln!(
            f,
            "kvpool replay: {} mode, {} cache, {} eviction, page size {}, capacity {} tokens",
            self.mode,
            self.cache,
            self.policy,
            self.page_size,
            thousands(self.capacity_tokens)
        )?;
        if self.mode == "overlap" {
            writeln!(f, "  (max running {}, {} router threads)", self.max_running, self.routers)?;
        }
        if let Some(h) = &self.hybrid {
            h.header(f)?;
        }
        if let Some(s) = &self.swa {
            s.header(f)?;
        }
        if let Some(h) = &self.host {
            h.header(f)?;
        }
        if let Some(s) = &self.store {
            s.header(f)?;
        }
        row(f, "requests", thousands(self.requests))?;
        row(f, "rejected", thousands(self.rejected))?;
        if self.mode == "overlap" {
            row(f, "retracted", thousands(self.retracted))?;
        }
        row(f, "prompt tokens", thousands(self.prompt_tokens))?;
        row(f, "hit tokens", format!("{} ({:.2}%)", thousands(self.hit_tokens), self.hit_rate * 100.0))?;
        row(f, "computed tokens", thousands(self.computed_tokens))?;
        row(f, "output tokens", thousands(self.output_tokens))?;
        row(f, "evicted tokens", thousands(self.evicted_tokens))?;
        row(f, "peak used tokens", thousands(self.peak_used_tokens))?;
        row(f, "final cached tokens", thousands(self.final_cached_tokens))?;
        if let Some(h) = &self.hybrid {
            h.rows(f, self.prompt_tokens)?;
        }
        if let Some(s) = &self.swa {
            s.rows(f, self.prompt_tokens)?;
        }
        if let Some(h) = &self.host {
            h.rows(f, self.prompt_tokens)?;
        }
        if let Some(s) = &self.store {
            s.rows(f)?;
        }
        if self.routers > 0 {
            row(
                f,
                "router matches",
                format!("{} ({} hit tokens)", thousands(self.router_matches), thousands(self.router_hit_tokens)),
            )?;
        }
        row(f, "wall time", format!("{:.3} s", self.wall_seconds))?;
        row(f, "requests/s", thousands(self.requests_per_second.round() as u64))?;
        row(f, "tokens/s", thousands(self.tokens_per_second.round() as u64))?;
        writeln!(f, "  {:<22} {:>10} {:>10}", "latency", "p50", "p99")?;
        let l = &self.latency_ns;
        let mut ops = vec![
            ("match", l.match_),
            ("alloc_extend", l.alloc_extend),
            ("alloc_decode", l.alloc_decode),
            ("finish", l.finish),
        ];
        if let Some(r) = l.route {
            ops.push(("route (peek_prefix)", r));
        }
        for (name, p) in ops {
            writeln!(f, "    {name:<20} {:>10} {:>10}", duration(p.p50), duration(p.p99))?;
        }
        write!(
            f,
            "  invariants: {}",
            if self.invariants_ok && self.hybrid.is_some() {
                "hold; every KV slot and state slot is free or cached, every request row is free"
            } else if self.invariants_ok && self.swa.is_some() {
                "hold; every full and window KV slot is free or cached, every request row is free"
            } else if self.invariants_ok {
                "hold; every KV slot is free or cached, every request row is free"
            } else {
                "NOT checked"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotone_and_tight() {
        let mut last = 0;
        for v in (0..100_000u64).chain([u64::MAX / 3, u64::MAX]) {
            let b = LatencyHistogram::bucket(v);
            assert!(b >= last && b < BUCKETS);
            last = b;
            let mid = LatencyHistogram::value(b);
            let err = mid.abs_diff(v) as f64 / (v.max(1)) as f64;
            assert!(err <= 1.0 / 16.0, "v={v} mid={mid}");
        }
    }

    #[test]
    fn quantiles_and_merge() {
        let mut a = LatencyHistogram::new();
        let mut b = LatencyHistogram::new();
        assert_eq!(a.quantile(0.5), 0);
        for _ in 0..99 {
            a.record(10);
        }
        b.record(1_000_000);
        a.merge(&b);
        assert_eq!(a.count(), 100);
        assert_eq!(a.quantile(0.5), 10);
        assert_eq!(a.quantile(0.99), 10);
        let top = a.quantile(1.0);
        assert!((970_000..=1_030_000).contains(&top), "{top}");
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(144_793_823), "144,793,823");
    }
}
