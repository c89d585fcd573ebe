//! The multi-engine replay with a shared store tier (issue 12):
//! `kvpool replay --engines N [--store redis://HOST:PORT]`.
//!
//! The trace is split across `N` engine instances by a router ([`Router`]): round-robin,
//! or by prefix (the chained page hash of the request's first
//! [`route_tokens`](EnginesConfig::route_tokens) tokens, so a conversation's turns land
//! on one engine). Each engine has its own device pool and host tier (kvpool's
//! [`HiRadixCache`], as in the two-tier replay), and with `--store` all of them share one
//! [`PageStore`] ([`RedisStore`](crate::store::redis::RedisStore), feature `redis`) under
//! a key namespace unique to the run (reruns never see an earlier run's pages).
//!
//! Requests are served one at a time in trace order, each on its engine (the request
//! loop of the sequential replay, [`serve`], one request at a time: the engines do not
//! decode in one batch, so `run_sequential`, which drives one cache over the whole
//! trace, does not fit). For a request on its engine:
//!
//! 1. [`match_tiers`](HiRadixCache::match_tiers): `cached` = device prefix + host
//!    continuation. The chained page hashes of the request's whole KV pages are computed
//!    once (they are the store's keys).
//! 2. Prefetch: when the prompt's rest (whole pages past `cached`) is at least the
//!    load-back threshold, ask the store how many of its pages it holds
//!    ([`exists_prefix`](PageStore::exists_prefix)), `get` them (stopping at the first
//!    absent or damaged page), check each payload against the synthetic payload of its
//!    hash (a mismatch is counted as corrupt and ends the run of pages), and add them
//!    with [`insert_host`](HiRadixCache::insert_host); its prefetch transfer completes
//!    at once (the bytes are in hand).
//! 3. The two-tier replay's request: its admission loads the host continuation back
//!    (prefetched pages included, all or nothing; [`Request::host_hit`]), then
//!    allocation with eviction and the finish; every transfer completes at once.
//! 4. Write-through to the store: the leading pages of the request's KV held on host
//!    ([`host_backed_len`](HiRadixCache::host_backed_len)) that the store lacks
//!    (`exists_prefix`) are `put`, with a payload that is a function of the page hash.
//!
//! Hits: the device prefix is *device* hits; of the tokens loaded back, those this
//! request prefetched are *store* hits, the rest *host* hits. A store error of any kind
//! is counted (by kind) and the request goes on with device and host only: the replay
//! never fails because of the store. At the end every engine's invariants are checked
//! (every device slot free or cached, every host page held by one node, no transfer in
//! flight).
//!
//! Without `--store`, `--engines N` runs the engines alone: the baseline the store is
//! measured against.

use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::hicache::{settle, transfer_seconds, HostReport, HostTierConfig, KvHiReplay};
use super::lifecycle::{serve, Job, Steps};
use super::stats::thousands;
use super::{
    buffer, finish_report, fits_in_pool, Histograms, LatencyHistogram, Percentiles, ReplayCache, ReplayConfig,
    ReplayError, Report, Totals, Trace, TraceRequest, NAMESPACE,
};
use crate::radix::{page_hash, BlockHash, Hi, HiRadixCache, HostTier, RadixConfig, Request};
use crate::store::{BackoffConfig, Miss, PageStore, StoreError};
use crate::PagedAllocator;

/// Default payload bytes per token stored (`--store-bytes-per-token`): small, so that a
/// replay of the whole bundled trace fits in a local Redis (a real engine stores its KV
/// bytes: 128 KiB a token for Llama-3-8B).
pub const DEFAULT_STORE_BYTES_PER_TOKEN: u64 = 8;
/// The most payload bytes per token the replay stores (16 MiB pages at page size 16).
pub const MAX_STORE_BYTES_PER_TOKEN: u64 = 1 << 20;
/// Default deadline of one store operation (`--store-timeout-ms`).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(500);
/// Default tokens the prefix router hashes (`--route-tokens`): two of the trace's
/// 512-token blocks. Every request of the bundled trace starts with the same block, so
/// the first page alone would send all of them to one engine.
pub const DEFAULT_ROUTE_TOKENS: usize = 1024;
/// The most engines a replay runs.
pub const MAX_ENGINES: usize = 64;
/// The store's model id (the second part of every key).
#[cfg(feature = "redis")]
const MODEL_ID: &str = "replay";

/// How requests are spread over the engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Router {
    /// Request `r` to engine `r mod N`.
    #[default]
    RoundRobin,
    /// By the chained page hash of the request's first `route_tokens` tokens (whole
    /// pages; the first page's tokens when the prompt is shorter): a conversation's turns
    /// share it and land on one engine.
    Prefix,
}

impl Router {
    /// `round_robin` or `prefix`.
    pub fn name(self) -> &'static str {
        match self {
            Router::RoundRobin => "round_robin",
            Router::Prefix => "prefix",
        }
    }
}

impl FromStr for Router {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self, ReplayError> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "round_robin" | "rr" => Ok(Router::RoundRobin),
            "prefix" => Ok(Router::Prefix),
            _ => Err(ReplayError::Config(format!("unknown router {s:?}; expected round_robin or prefix"))),
        }
    }
}

/// The shared store of a multi-engine replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreTierConfig {
    /// `redis://host:port` URLs: one for a single node, several (or `cluster`) for a
    /// Redis Cluster's seed nodes.
    pub nodes: Vec<String>,
    /// Whether `nodes` are a Redis Cluster (implied by several nodes).
    pub cluster: bool,
    /// Payload bytes per token of a stored page.
    pub bytes_per_token: u64,
    /// Deadline of one store operation.
    pub timeout: Duration,
    /// The client's wait after failures.
    pub backoff: BackoffConfig,
    /// The key namespace; `None`: one unique to the run (process id and start time).
    pub namespace: Option<String>,
}

impl StoreTierConfig {
    /// A single node at `url` with the defaults (8 payload bytes a token, a 500 ms
    /// timeout, a backoff of 20 ms doubling to 1 s, a namespace unique to the run).
    pub fn new(url: impl Into<String>) -> StoreTierConfig {
        StoreTierConfig {
            nodes: vec![url.into()],
            cluster: false,
            bytes_per_token: DEFAULT_STORE_BYTES_PER_TOKEN,
            timeout: DEFAULT_STORE_TIMEOUT,
            backoff: BackoffConfig { initial: Duration::from_millis(20), max: Duration::from_secs(1) },
            namespace: None,
        }
    }
}

/// Several engines, each with its own device and host tiers, and the store they share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnginesConfig {
    /// Engine instances (default 1).
    pub engines: usize,
    /// How requests are spread over them.
    pub router: Router,
    /// Tokens the prefix router hashes.
    pub route_tokens: usize,
    /// The shared store tier (`None`: each engine alone).
    pub store: Option<StoreTierConfig>,
}

impl Default for EnginesConfig {
    fn default() -> Self {
        EnginesConfig { engines: 1, router: Router::RoundRobin, route_tokens: DEFAULT_ROUTE_TOKENS, store: None }
    }
}

impl EnginesConfig {
    /// Whether the replay runs the multi-engine driver (several engines, or a store).
    pub fn active(&self) -> bool {
        self.engines != 1 || self.store.is_some()
    }

    /// Check the options against the rest of the configuration.
    ///
    /// # Errors
    ///
    /// [`ReplayError::Config`] naming the option.
    pub(crate) fn validate(&self, config: &ReplayConfig) -> Result<(), ReplayError> {
        let bad = |m: String| Err(ReplayError::Config(m));
        if self.engines == 0 || self.engines > MAX_ENGINES {
            return bad(format!("--engines must be between 1 and {MAX_ENGINES}, not {}", self.engines));
        }
        if self.route_tokens == 0 {
            return bad("--route-tokens must be at least 1".into());
        }
        if !self.active() {
            return Ok(());
        }
        let flag = if self.store.is_some() { "--store" } else { "--engines" };
        let other = if config.mode != super::Mode::Sequential {
            Some(format!("--mode {}", config.mode.name()))
        } else if config.model != super::Model::Attention {
            Some(format!("--model {}", config.model.name()))
        } else if config.cache != super::CacheKind::Kvpool {
            Some(format!("--cache {}", config.cache.name()))
        } else if config.optimal {
            Some("--policy optimal".into())
        } else if config.timeline {
            Some("--plot".into())
        } else {
            None
        };
        if let Some(other) = other {
            return bad(format!(
                "{flag} runs engines of the two-tier kvpool tree one request at a time (sequential mode, attention \
                 model, --cache kvpool); not {other}"
            ));
        }
        if config.host.is_none() {
            return bad(format!("{flag} needs a host tier (--host-capacity-tokens or --host-ratio)"));
        }
        if let Some(s) = &self.store {
            if s.nodes.is_empty() || s.nodes.iter().any(|n| n.trim().is_empty()) {
                return bad("--store needs a redis://host:port URL".into());
            }
            if s.bytes_per_token == 0 || s.bytes_per_token > MAX_STORE_BYTES_PER_TOKEN {
                return bad(format!(
                    "--store-bytes-per-token must be between 1 and {MAX_STORE_BYTES_PER_TOKEN}, not {}",
                    s.bytes_per_token
                ));
            }
            if s.timeout.is_zero() {
                return bad("--store-timeout-ms must be at least 1".into());
            }
        }
        Ok(())
    }
}

/// One engine's (or all engines') figures per tier.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TierFigures {
    /// Requests routed here (served plus rejected).
    pub requests: u64,
    /// Requests that could not be served.
    pub rejected: u64,
    /// Prompt tokens of the served requests.
    pub prompt_tokens: u64,
    /// Prompt tokens found on the device.
    pub device_hit_tokens: u64,
    /// Prompt tokens loaded back from host that were there before the request.
    pub host_hit_tokens: u64,
    /// Prompt tokens loaded back that this request prefetched from the store.
    pub store_hit_tokens: u64,
    /// All three.
    pub hit_tokens: u64,
    /// `device_hit_tokens / prompt_tokens`.
    pub device_hit_rate: f64,
    /// `host_hit_tokens / prompt_tokens`.
    pub host_hit_rate: f64,
    /// `store_hit_tokens / prompt_tokens`.
    pub store_hit_rate: f64,
    /// `hit_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Tokens copied device -> host.
    pub written_to_host_tokens: u64,
    /// Tokens copied host -> device (host and store hits).
    pub loaded_tokens: u64,
    /// Tokens brought from the store to host.
    pub prefetched_tokens: u64,
    /// Prefetched tokens not loaded by their request (no device room).
    pub prefetch_unused_tokens: u64,
    /// Pages the store held but the host had no room for.
    pub prefetch_refused_pages: u64,
    /// Device tokens freed by eviction.
    pub device_evicted_tokens: u64,
    /// Host tokens freed by host eviction.
    pub host_evicted_tokens: u64,
    /// Bytes device -> host (at the host tier's bytes per token).
    pub bytes_to_host: u64,
    /// Bytes host -> device.
    pub bytes_from_host: u64,
    /// Pages written to the store.
    pub store_pages_put: u64,
    /// Pages read from the store and accepted.
    pub store_pages_got: u64,
    /// Pages `exists_prefix` reported that a `get` then did not find.
    pub store_pages_missed: u64,
    /// Pages refused: damaged, another format, or a payload not its hash's.
    pub store_pages_corrupt: u64,
    /// Payload bytes written to the store.
    pub store_bytes_written: u64,
    /// Payload bytes read from the store.
    pub store_bytes_read: u64,
    /// Store operations that failed (any kind).
    pub store_errors: u64,
    /// Device tokens cached at the end.
    pub final_cached_tokens: u64,
    /// Host tokens in use at the end.
    pub final_host_used_tokens: u64,
}

impl TierFigures {
    fn add(&mut self, o: &TierFigures) {
        macro_rules! sum {
            ($($f:ident),*) => { $(self.$f = self.$f.saturating_add(o.$f);)* };
        }
        sum!(
            requests,
            rejected,
            prompt_tokens,
            device_hit_tokens,
            host_hit_tokens,
            store_hit_tokens,
            hit_tokens,
            written_to_host_tokens,
            loaded_tokens,
            prefetched_tokens,
            prefetch_unused_tokens,
            prefetch_refused_pages,
            device_evicted_tokens,
            host_evicted_tokens,
            bytes_to_host,
            bytes_from_host,
            store_pages_put,
            store_pages_got,
            store_pages_missed,
            store_pages_corrupt,
            store_bytes_written,
            store_bytes_read,
            store_errors,
            final_cached_tokens,
            final_host_used_tokens
        );
    }

    fn rates(&mut self) {
        let rate = |x: u64| if self.prompt_tokens > 0 { x as f64 / self.prompt_tokens as f64 } else { 0.0 };
        self.device_hit_rate = rate(self.device_hit_tokens);
        self.host_hit_rate = rate(self.host_hit_tokens);
        self.store_hit_rate = rate(self.store_hit_tokens);
        self.hit_rate = rate(self.hit_tokens);
    }
}

/// Store failures by kind ([`StoreError`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreErrorCounts {
    /// Refused at once while the client backed off.
    pub unavailable: u64,
    /// No answer within the timeout.
    pub timeout: u64,
    /// Connection refused or broken.
    pub connection: u64,
    /// Writes refused for lack of memory.
    pub full: u64,
    /// Server errors and unexpected replies.
    pub server: u64,
    /// Anything else (shape, format, configuration: a bug or a bad option).
    pub other: u64,
}

impl StoreErrorCounts {
    fn count(&mut self, e: &StoreError) {
        match e {
            StoreError::Unavailable { .. } => self.unavailable += 1,
            StoreError::Timeout { .. } => self.timeout += 1,
            StoreError::Connection { .. } => self.connection += 1,
            StoreError::Full { .. } => self.full += 1,
            StoreError::Server { .. } => self.server += 1,
            _ => self.other += 1,
        }
    }

    /// All of them.
    pub fn total(&self) -> u64 {
        self.unavailable + self.timeout + self.connection + self.full + self.server + self.other
    }
}

/// One kind of store operation: how many went out and their latency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreOpFigures {
    /// Calls that reached the client's network path (not refused while backing off).
    pub calls: u64,
    /// Pages they named.
    pub pages: u64,
    /// Latency of a call, nanoseconds.
    pub latency_ns: Percentiles,
}

/// The store's side of the run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreOps {
    /// `exists_prefix` calls.
    pub exists: StoreOpFigures,
    /// `get` calls.
    pub get: StoreOpFigures,
    /// `put` calls.
    pub put: StoreOpFigures,
    /// Failures by kind.
    pub errors: StoreErrorCounts,
    /// Connections made after a failure (the client's counter).
    pub reconnects: u64,
    /// Seconds spent in store calls.
    pub store_seconds: f64,
    /// Store calls per second of store time.
    pub ops_per_second: f64,
    /// Pages put and got per second of store time.
    pub pages_per_second: f64,
    /// Value bytes (headers included) written and read per second of store time.
    pub bytes_per_second: f64,
    /// Value bytes written (the client's counter, headers included).
    pub bytes_written: u64,
    /// Value bytes read (the client's counter).
    pub bytes_read: u64,
    /// The client's median latency over its last operations, microseconds.
    pub client_p50_us: f64,
    /// The client's 99th percentile over the same, microseconds.
    pub client_p99_us: f64,
}

/// The figures of a multi-engine replay (`--engines`, `--store`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreReport {
    /// Engine instances.
    pub engines: usize,
    /// `round_robin` or `prefix`.
    pub router: &'static str,
    /// The store's nodes (absent: no store, each engine alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// The run's key namespace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Payload bytes per token of a stored page.
    pub store_bytes_per_token: u64,
    /// Device tokens of each engine.
    pub device_capacity_tokens: usize,
    /// Host tokens of each engine.
    pub host_capacity_tokens: usize,
    /// All engines together.
    pub total: TierFigures,
    /// Each engine.
    pub per_engine: Vec<TierFigures>,
    /// The store's operations (absent without a store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_ops: Option<StoreOps>,
}

impl StoreReport {
    pub(crate) fn header(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "  ({} engines, {} router; each {} device + {} host tokens; {})",
            self.engines,
            self.router,
            thousands(self.device_capacity_tokens as u64),
            thousands(self.host_capacity_tokens as u64),
            match &self.store {
                Some(s) => format!("shared store {s}, {} payload bytes a token", self.store_bytes_per_token),
                None => "no store: each engine alone".into(),
            }
        )
    }

    pub(crate) fn rows(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<22} {v}");
        writeln!(
            f,
            "  {:<10} {:>9} {:>14} {:>8} {:>8} {:>8} {:>8}",
            "hits", "requests", "prompt", "device", "host", "store", "total"
        )?;
        let line = |f: &mut std::fmt::Formatter<'_>, name: &str, t: &TierFigures| {
            writeln!(
                f,
                "  {name:<10} {:>9} {:>14} {:>7.2}% {:>7.2}% {:>7.2}% {:>7.2}%",
                thousands(t.requests),
                thousands(t.prompt_tokens),
                100.0 * t.device_hit_rate,
                100.0 * t.host_hit_rate,
                100.0 * t.store_hit_rate,
                100.0 * t.hit_rate
            )
        };
        for (i, e) in self.per_engine.iter().enumerate() {
            line(f, &format!("engine {i}"), e)?;
        }
        line(f, "total", &self.total)?;
        let t = &self.total;
        let mb = |b: u64| b as f64 / 1e6;
        let Some(ops) = &self.store_ops else { return Ok(()) };
        row(
            f,
            "store pages",
            format!(
                "{} put, {} got, {} missed, {} corrupt",
                thousands(t.store_pages_put),
                thousands(t.store_pages_got),
                thousands(t.store_pages_missed),
                thousands(t.store_pages_corrupt)
            ),
        )?;
        row(
            f,
            "prefetched",
            format!(
                "{} tokens ({} not loaded, {} pages refused for host room)",
                thousands(t.prefetched_tokens),
                thousands(t.prefetch_unused_tokens),
                thousands(t.prefetch_refused_pages)
            ),
        )?;
        row(
            f,
            "store bytes",
            format!("{:.1} MB written, {:.1} MB read (with headers)", mb(ops.bytes_written), mb(ops.bytes_read)),
        )?;
        let e = &ops.errors;
        row(
            f,
            "store errors",
            format!(
                "{} ({} unavailable, {} timeout, {} connection, {} full, {} server, {} other; {} reconnects)",
                e.total(),
                e.unavailable,
                e.timeout,
                e.connection,
                e.full,
                e.server,
                e.other,
                ops.reconnects
            ),
        )?;
        row(
            f,
            "store throughput",
            format!(
                "{} ops/s, {} pages/s, {:.1} MB/s ({:.2} s in store calls)",
                thousands(ops.ops_per_second.round() as u64),
                thousands(ops.pages_per_second.round() as u64),
                ops.bytes_per_second / 1e6,
                ops.store_seconds
            ),
        )?;
        writeln!(f, "  {:<22} {:>10} {:>10} {:>10} {:>12}", "store op", "calls", "p50", "p99", "pages")?;
        for (name, o) in [("exists_prefix", ops.exists), ("get", ops.get), ("put", ops.put)] {
            writeln!(
                f,
                "    {name:<20} {:>10} {:>10} {:>10} {:>12}",
                thousands(o.calls),
                super::stats::duration(o.latency_ns.p50),
                super::stats::duration(o.latency_ns.p99),
                thousands(o.pages)
            )?;
        }
        Ok(())
    }
}

/// The synthetic payload of the page named `hash`: byte `i` is a function of the hash
/// and `i`, so a page read back can be checked against its name.
fn fill_payload(hash: &BlockHash, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = hash[i % 32] ^ (i / 32) as u8;
    }
}

fn payload_ok(hash: &BlockHash, bytes: &[u8]) -> bool {
    bytes.iter().enumerate().all(|(i, &b)| b == hash[i % 32] ^ (i / 32) as u8)
}

/// The store client and what the replay measures of it.
struct Shared<'s> {
    store: &'s dyn PageStore,
    page_bytes: usize,
    exists: (LatencyHistogram, u64, u64),
    get: (LatencyHistogram, u64, u64),
    put: (LatencyHistogram, u64, u64),
    errors: StoreErrorCounts,
    time: Duration,
}

impl Shared<'_> {
    /// Time `op` (naming `pages` pages) into `which`; count an error.
    fn call<T>(
        &mut self,
        which: fn(&mut Self) -> &mut (LatencyHistogram, u64, u64),
        pages: usize,
        fig: &mut TierFigures,
        op: impl FnOnce(&dyn PageStore) -> Result<T, StoreError>,
    ) -> Option<T> {
        let t = Instant::now();
        let r = op(self.store);
        let took = t.elapsed();
        if !matches!(r, Err(StoreError::Unavailable { .. })) {
            self.time += took;
            let (h, calls, p) = which(self);
            h.record(took.as_nanos().min(u64::MAX as u128) as u64);
            *calls += 1;
            *p += pages as u64;
        }
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.errors.count(&e);
                fig.store_errors += 1;
                None
            }
        }
    }
}

/// One engine: its two-tier tree and its counters.
struct Engine {
    cache: KvHiReplay,
    totals: Totals,
    fig: TierFigures,
}

/// Open the store of `cfg` under `namespace`.
#[cfg(feature = "redis")]
fn open_store(cfg: &StoreTierConfig, page_size: u32, namespace: &str) -> Result<Box<dyn PageStore>, ReplayError> {
    use crate::store::redis::{RedisStore, RedisStoreConfig};
    use crate::store::PageFormat;
    let format = PageFormat { page_size, bytes_per_token: cfg.bytes_per_token };
    let mut rc = if cfg.cluster || cfg.nodes.len() > 1 {
        RedisStoreConfig::cluster(cfg.nodes.iter().cloned(), MODEL_ID, format)
    } else {
        RedisStoreConfig::new(cfg.nodes[0].clone(), MODEL_ID, format)
    };
    rc.namespace = namespace.to_string();
    rc.timeout = cfg.timeout;
    rc.connect_timeout = rc.connect_timeout.min(cfg.timeout);
    rc.backoff = cfg.backoff;
    let store =
        RedisStore::new(rc).map_err(|e| ReplayError::Config(format!("--store {}: {e}", cfg.nodes.join(","))))?;
    Ok(Box::new(store))
}

#[cfg(not(feature = "redis"))]
fn open_store(_: &StoreTierConfig, _: u32, _: &str) -> Result<Box<dyn PageStore>, ReplayError> {
    Err(ReplayError::Config(
        "--store needs the Redis client, and kvpool was built without the `redis` feature \
         (cargo build --release --features redis)"
            .into(),
    ))
}

/// A key namespace no earlier run used: the process id and the time.
fn unique_namespace() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("kvpool-replay-{}-{nanos}", std::process::id())
}

/// Replay `trace` on `config.engines.engines` engines sharing `config.engines.store`
/// (see the module docs). `progress` is called after every request.
///
/// # Errors
///
/// [`ReplayError::Config`] for a bad configuration (or `--store` without the `redis`
/// feature), [`ReplayError::Invariant`] when an engine's end state is inconsistent,
/// [`ReplayError::Internal`] when a cache refuses a call. Never for a store fault.
pub(crate) fn replay_engines(
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let ec = &config.engines;
    ec.validate(config)?;
    let host: HostTierConfig = config.host.ok_or_else(|| ReplayError::Config("--store needs a host tier".into()))?;
    let ps = config.page_size as usize;
    let too_large = |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower --capacity-tokens or --engines"));
    crate::arena::probe(
        config.memory_bytes(trace).saturating_mul(ec.engines as u64),
        "the engines (KV allocators, request rows, prefix caches)",
    )
    .map_err(too_large)?;
    let namespace = ec.store.as_ref().map(|s| s.namespace.clone().unwrap_or_else(unique_namespace));
    let store = match (&ec.store, &namespace) {
        (Some(s), Some(ns)) => Some(open_store(s, config.page_size, ns)?),
        _ => None,
    };
    let max_kv = trace.max_kv_len_fitting(config.capacity_tokens).max(1);
    let host_pages = (host.host_capacity_tokens / ps) as u32;
    let mut engines = Vec::with_capacity(ec.engines);
    for _ in 0..ec.engines {
        let alloc = PagedAllocator::new(config.capacity_tokens, config.page_size).map_err(too_large)?;
        let rows = crate::ReqToTokenPool::new(1, max_kv).map_err(too_large)?;
        let tier =
            HostTier { host_pages, write_policy: host.write_policy, load_back_threshold: host.load_back_threshold };
        let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
        let tree = HiRadixCache::with_host_tier(alloc, rows, radix, tier).map_err(too_large)?;
        engines.push(Engine { cache: KvHiReplay::new(tree), totals: Totals::default(), fig: TierFigures::default() });
    }
    let page_bytes = ps * ec.store.as_ref().map_or(0, |s| s.bytes_per_token as usize);
    let mut shared = store.as_deref().map(|store| Shared {
        store,
        page_bytes,
        exists: Default::default(),
        get: Default::default(),
        put: Default::default(),
        errors: StoreErrorCounts::default(),
        time: Duration::ZERO,
    });
    let mut tokens = buffer(max_kv, "the replay's token buffer")?;
    let mut slots = buffer(max_kv, "the replay's slot buffer")?;
    let mut hashes: Vec<BlockHash> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    let mut hist = Histograms::default();
    let need_hashes = store.is_some() || ec.router == Router::Prefix;
    let start = Instant::now();
    for r in 0..trace.len() {
        let q = trace.request(r);
        let (prompt, kv_len) = (q.input_length as usize, q.kv_len());
        let fits = fits_in_pool(&engines[0].cache, kv_len);
        if fits {
            trace.write_kv_tokens(r, &mut tokens);
            hashes.clear();
            if need_hashes {
                for page in tokens[..kv_len / ps * ps].chunks_exact(ps) {
                    let h = page_hash(hashes.last(), page);
                    hashes.push(h);
                }
            }
        }
        let e = match ec.router {
            Router::RoundRobin => r % ec.engines,
            Router::Prefix if !fits => r % ec.engines,
            Router::Prefix => {
                let upto = prompt.min(ec.route_tokens);
                let h = if upto >= ps { hashes[upto / ps - 1] } else { page_hash(None, &tokens[..upto]) };
                (u64::from_le_bytes(h[..8].try_into().unwrap_or_default()) % ec.engines as u64) as usize
            }
        };
        let engine = &mut engines[e];
        engine.fig.requests += 1;
        if !fits {
            engine.totals.rejected += 1;
            progress(r as u64 + 1);
            continue;
        }
        serve_one(engine, shared.as_mut(), &tokens, &hashes, &mut slots, &mut scratch, q, &host, &mut hist)?;
        progress(r as u64 + 1);
    }
    let wall = start.elapsed().as_secs_f64();

    // The end state of every engine, and the figures.
    let mut reports = Vec::with_capacity(engines.len());
    let mut total = TierFigures::default();
    let mut host_total = HostReport::default();
    for engine in &mut engines {
        let tree = &engine.cache.tree;
        if tree.transfers_in_flight() != 0 {
            return Err(crate::error::InvariantViolation(format!(
                "{} transfers in flight at the end",
                tree.transfers_in_flight()
            ))
            .into());
        }
        let report = finish_report(&engine.cache, config, engine.totals, &hist, wall, Vec::new())?;
        let c = tree.counters();
        let f = &mut engine.fig;
        f.rejected = report.rejected;
        f.prompt_tokens = report.prompt_tokens;
        f.hit_tokens = report.hit_tokens;
        f.written_to_host_tokens = c.written;
        f.loaded_tokens = c.loaded;
        f.prefetched_tokens = c.prefetched;
        f.device_evicted_tokens = c.device_evicted;
        f.host_evicted_tokens = c.host_evicted;
        f.bytes_to_host = c.written.saturating_mul(host.bytes_per_token);
        f.bytes_from_host = c.loaded.saturating_mul(host.bytes_per_token);
        f.final_cached_tokens = report.final_cached_tokens;
        f.final_host_used_tokens = tree.host_size() as u64;
        f.rates();
        total.add(f);
        host_total.backups_refused += c.backup_refused;
        host_total.load_back_skipped_tokens += engine.cache.skipped.load(std::sync::atomic::Ordering::Relaxed);
        reports.push(report);
    }
    total.rates();
    let store_ops = shared.map(|s| {
        let stats = s.store.stats();
        let op = |(h, calls, pages): &(LatencyHistogram, u64, u64)| StoreOpFigures {
            calls: *calls,
            pages: *pages,
            latency_ns: h.summary(),
        };
        let secs = s.time.as_secs_f64();
        let per = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
        StoreOps {
            exists: op(&s.exists),
            get: op(&s.get),
            put: op(&s.put),
            errors: s.errors,
            reconnects: stats.reconnects,
            store_seconds: secs,
            ops_per_second: per((s.exists.1 + s.get.1 + s.put.1) as f64),
            pages_per_second: per((total.store_pages_put + total.store_pages_got) as f64),
            bytes_per_second: per((stats.bytes_written + stats.bytes_read) as f64),
            bytes_written: stats.bytes_written,
            bytes_read: stats.bytes_read,
            client_p50_us: stats.p50.as_secs_f64() * 1e6,
            client_p99_us: stats.p99.as_secs_f64() * 1e6,
        }
    });

    // The combined report: sums over the engines, the latencies of all of them.
    let mut report = reports.swap_remove(0);
    for o in &reports {
        report.requests += o.requests;
        report.rejected += o.rejected;
        report.prompt_tokens += o.prompt_tokens;
        report.hit_tokens += o.hit_tokens;
        report.computed_tokens += o.computed_tokens;
        report.output_tokens += o.output_tokens;
        report.evicted_tokens += o.evicted_tokens;
        report.peak_used_tokens = report.peak_used_tokens.max(o.peak_used_tokens);
        report.final_cached_tokens += o.final_cached_tokens;
    }
    report.hit_rate = total.hit_rate;
    let rate = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
    report.requests_per_second = rate(report.requests as f64);
    report.tokens_per_second = rate((report.prompt_tokens + report.output_tokens) as f64);
    report.capacity_tokens = config.capacity_tokens as u64 * ec.engines as u64;
    report.host = Some(HostReport {
        tree: "HiRadixCache",
        host_capacity_tokens: host_pages as usize * ps * ec.engines,
        write_policy: host.write_policy.name(),
        device_hit_tokens: total.device_hit_tokens,
        host_hit_tokens: total.host_hit_tokens,
        host_hit_rate: total.host_hit_rate,
        load_back_skipped_tokens: host_total.load_back_skipped_tokens,
        written_tokens: total.written_to_host_tokens,
        loaded_tokens: total.loaded_tokens,
        bytes_written: total.bytes_to_host,
        bytes_loaded: total.bytes_from_host,
        transfer_seconds: transfer_seconds(total.written_to_host_tokens + total.loaded_tokens, &host),
        link_gbps: host.link_bytes_per_second as f64 / 1e9,
        device_evicted_tokens: total.device_evicted_tokens,
        host_evicted_tokens: total.host_evicted_tokens,
        backups_refused: host_total.backups_refused,
        final_host_used_tokens: total.final_host_used_tokens,
    });
    report.store = Some(StoreReport {
        engines: ec.engines,
        router: ec.router.name(),
        store: ec.store.as_ref().map(|s| s.nodes.join(",")),
        namespace,
        store_bytes_per_token: ec.store.as_ref().map_or(0, |s| s.bytes_per_token),
        device_capacity_tokens: config.capacity_tokens,
        host_capacity_tokens: host_pages as usize * ps,
        total,
        per_engine: engines.into_iter().map(|e| e.fig).collect(),
        store_ops,
    });
    progress(trace.len() as u64);
    Ok(report)
}

/// The two-tier request's steps in the request loop: its hit, and the tokens its
/// admission loaded back from host.
struct TwoTier {
    hit: usize,
    loaded: usize,
}

impl Steps<KvHiReplay> for TwoTier {
    fn admitted(
        &mut self,
        _cache: &KvHiReplay,
        req: Option<&mut Request<PagedAllocator, Hi>>,
        _prompt: &[u32],
        _totals: &mut Totals,
    ) -> Result<bool, ReplayError> {
        (self.hit, self.loaded) = req.map_or((0, 0), |req| (req.cached_len(), req.host_hit().loaded));
        Ok(true)
    }
}

/// Serve one request on its engine: prefetch from the store, the two-tier request, the
/// write-through to the store (see the module docs).
#[allow(clippy::too_many_arguments)]
fn serve_one(
    engine: &mut Engine,
    mut shared: Option<&mut Shared<'_>>,
    tokens: &[u32],
    hashes: &[BlockHash],
    slots: &mut [u32],
    scratch: &mut Vec<u8>,
    q: TraceRequest,
    host: &HostTierConfig,
    hist: &mut Histograms,
) -> Result<(), ReplayError> {
    let (prompt, kv_len) = (q.input_length as usize, q.kv_len());
    let cache = &engine.cache;
    let tree = &cache.tree;
    let ps = cache.page_size() as usize;
    let fig = &mut engine.fig;
    let totals = &mut engine.totals;

    // (1), (2): the store's continuation of what the tree holds, prefetched to host.
    let mut prefetched = 0usize;
    if let Some(s) = shared.as_deref_mut() {
        let m = tree.match_tiers(NAMESPACE, &tokens[..prompt], &mut slots[..prompt]);
        let cached = m.device.len() + m.host_len;
        let prompt_pages = prompt / ps;
        if prompt_pages * ps >= cached + host.load_back_threshold.max(1) {
            let want = &hashes[cached / ps..prompt_pages];
            let n = s.call(|s| &mut s.exists, want.len(), fig, |st| st.exists_prefix(want)).unwrap_or(0);
            if n > 0 && m.host_len + n * ps >= host.load_back_threshold {
                let pb = s.page_bytes;
                scratch.clear();
                scratch.resize(n * pb, 0);
                let mut bufs: Vec<&mut [u8]> = scratch.chunks_exact_mut(pb).collect();
                let got = s.call(|s| &mut s.get, n, fig, |st| st.get(&want[..n], &mut bufs));
                let mut k = 0;
                if let Some(loaded) = got {
                    k = loaded.pages;
                    match loaded.stop {
                        Some(Miss::Absent | Miss::Error) => fig.store_pages_missed += 1,
                        Some(Miss::Invalid(_)) => fig.store_pages_corrupt += 1,
                        None => {}
                    }
                    if let Some(bad) = (0..k).find(|&i| !payload_ok(&want[i], bufs[i])) {
                        fig.store_pages_corrupt += 1;
                        k = bad;
                    }
                    fig.store_pages_got += k as u64;
                    fig.store_bytes_read += (k * pb) as u64;
                }
                if k > 0 && m.host_len + k * ps >= host.load_back_threshold {
                    let end = cached + k * ps;
                    prefetched = tree.insert_host(NAMESPACE, &tokens[..end], &mut slots[..end]);
                    if prefetched == 0 {
                        fig.prefetch_refused_pages += k as u64;
                    }
                    // The pages are in hand: the prefetch transfer completes at once.
                    settle(tree);
                }
            }
        }
    }

    // (3): the two-tier request.
    let job = Job { tokens: &tokens[..kv_len], prompt, output: q.output_length };
    let mut steps = TwoTier { hit: 0, loaded: 0 };
    let served = serve(cache, &mut steps, NAMESPACE, &job, totals, hist)?;
    let (hit, loaded) = (steps.hit, steps.loaded);
    let store_hit = if loaded > 0 { prefetched.min(loaded) } else { 0 };
    if loaded == 0 {
        fig.prefetch_unused_tokens += prefetched as u64;
    }
    if !served {
        totals.rejected += 1;
        return Ok(());
    }
    fig.device_hit_tokens += (hit - loaded) as u64;
    fig.host_hit_tokens += (loaded - store_hit) as u64;
    fig.store_hit_tokens += store_hit as u64;

    // (4): write-through to the store: the host-backed pages it lacks.
    if let Some(s) = shared {
        let h = tree.host_backed_len(NAMESPACE, &tokens[..kv_len]) / ps;
        if h > 0 {
            let have = s.call(|s| &mut s.exists, h, fig, |st| st.exists_prefix(&hashes[..h]));
            if let Some(have) = have.filter(|&have| have < h) {
                let pb = s.page_bytes;
                let todo = &hashes[have..h];
                scratch.clear();
                scratch.resize(todo.len() * pb, 0);
                for (hash, page) in todo.iter().zip(scratch.chunks_exact_mut(pb)) {
                    fill_payload(hash, page);
                }
                let pages: Vec<&[u8]> = scratch.chunks_exact(pb).collect();
                if s.call(|s| &mut s.put, todo.len(), fig, |st| st.put(todo, &pages)).is_some() {
                    fig.store_pages_put += todo.len() as u64;
                    fig.store_bytes_written += (todo.len() * pb) as u64;
                }
            }
        }
    }
    Ok(())
}
