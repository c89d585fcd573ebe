//! Trace-driven scheduler simulation: the engine behind `kvpool replay`.
//!
//! A [`Trace`] of requests (the bundled Mooncake conversation trace, or any file in its
//! format) is replayed through a prefix cache, its KV allocator and its request rows,
//! the way an inference engine's scheduler drives them, and the result is a [`Report`]
//! of hit rate, memory use, throughput and latency. No GPU work is simulated: the
//! replay measures the memory system alone.
//!
//! * [`run_sequential`] — one thread, one request at a time, deterministic: admit the
//!   request (a row, its prompt's cached prefix, locked), extend it by the rest of the
//!   prompt, one decode step per output token after the first, evicting the shortfall
//!   when short, then finish it. A request whose KV exceeds the whole pool is rejected
//!   up front, nothing expanded or evicted.
//! * [`run_overlap`] — an overlap scheduler: a scheduler thread admits requests in
//!   order (up to `max_running`) and allocates one decode slot per running request per
//!   step, an output thread finishes completed requests concurrently, and router
//!   threads match upcoming prompts read-only, as a KV-aware router would.
//! * [`run_hybrid`] — a hybrid model ([`Model::Hybrid`]: KV plus one Mamba state per
//!   request) through kvpool's `MambaRadixCache`, one request at a time: requests
//!   resume from the deepest cached state, checkpoint at chunk and track-interval
//!   boundaries, and cache their tokens up to their last checkpoint; the report adds a
//!   [`HybridReport`] (KV hits against state hits, branching, state evictions,
//!   tombstones, state-pool occupancy).
//!
//! * the multi-engine replay (`--engines N`, `--store redis://...`, issue 12): the trace
//!   split across engines of the two-tier tree, one request at a time, sharing a store
//!   tier; the report adds a [`StoreReport`] (hits per tier and engine, the store's
//!   operations). See the `store` module's docs.
//!
//! Both are written once over the [`ReplayCache`] trait, a request's life through a
//! prefix cache (admit, extend, decode, finish, abort), implemented by kvpool's
//! concurrent radix cache (its [`Request`](crate::radix::Request) handles) and by the
//! baselines, [`ReferenceCache`] (the simple reference tree behind a mutex) and
//! [`VecTrieReplayCache`], so the same loop runs every one and their hit counts can be
//! compared.
//!
//! # Examples
//!
//! ```
//! use kvpool::replay::{replay, Mode, ReplayConfig, Trace};
//!
//! // Two requests sharing their first 512-token block.
//! let text = "{\"input_length\": 600, \"output_length\": 10, \"hash_ids\": [1, 2]}\n\
//!             {\"input_length\": 700, \"output_length\": 10, \"hash_ids\": [1, 3]}\n";
//! let trace = Trace::from_jsonl_str(text, "example")?;
//! let config = ReplayConfig { mode: Mode::Sequential, ..ReplayConfig::default() };
//! let report = replay(&trace, &config, &|_| {})?;
//! assert_eq!((report.requests, report.prompt_tokens, report.hit_tokens), (2, 1300, 512));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cache;
mod hicache;
mod hybrid;
mod lifecycle;
mod lookahead;
mod optimal;
mod overlap;
mod plot;
mod sequential;
mod stats;
mod store;
mod swa;
mod trace;
mod vec_trie_cache;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

pub use cache::{BaselineRequest, RefLease, ReferenceCache, ReplayCache, ReplayRequest};
pub use hicache::{
    HostReport, HostTierConfig, DEFAULT_BYTES_PER_TOKEN, DEFAULT_HOST_TO_DEVICE_RATIO, DEFAULT_LINK_BYTES_PER_SECOND,
};
pub use hybrid::{
    run_hybrid, HybridConfig, HybridPoint, HybridReport, Model, DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_MAMBA_MEMORY_RATIO_PERMILLE, DEFAULT_MAMBA_STATE_BYTES, MAX_MAMBA_STATES, MIN_MAMBA_STATES,
};
pub use optimal::{run_optimal, Ceiling, MAX_RETURN_WINDOW};
pub use overlap::run_overlap;
pub use plot::write_plot;
pub use sequential::run_sequential;
pub use stats::{Latencies, LatencyHistogram, Percentiles, Report, TimelinePoint};
pub use store::{
    EnginesConfig, Router, StoreErrorCounts, StoreOpFigures, StoreOps, StoreReport, StoreTierConfig, TierFigures,
    DEFAULT_ROUTE_TOKENS, DEFAULT_STORE_BYTES_PER_TOKEN, DEFAULT_STORE_TIMEOUT, MAX_ENGINES, MAX_STORE_BYTES_PER_TOKEN,
};
pub use swa::{run_swa, SwaConfig, SwaReport, DEFAULT_SWA_RATIO_PERMILLE, DEFAULT_SWA_WINDOW};
pub use trace::{
    output_token, prompt_token, Trace, TraceError, TraceErrorKind, TraceRequest, BLOCK_TOKENS, BUNDLED_TRACE_NAME,
    MAX_HASH_ID, MAX_INPUT_LEN, MAX_LINE_BYTES, MAX_OUTPUT_LEN, MAX_REQUESTS, OUTPUT_TOKEN_BASE,
};
pub use vec_trie_cache::{VecTrieLease, VecTrieReplayCache};

use crate::error::InvariantViolation;
use crate::radix::{EvictionPolicy, RadixCache, RadixConfig};

/// The namespace (`extra_key`) every replayed request uses.
pub const NAMESPACE: u64 = 0;

/// Default token capacity of the KV pool: 1,048,576.
pub const DEFAULT_CAPACITY_TOKENS: usize = 1 << 20;
/// Default page size.
pub const DEFAULT_PAGE_SIZE: u32 = 16;
/// Default number of requests running at once in overlap mode.
pub const DEFAULT_MAX_RUNNING: usize = 32;
/// Default number of router threads in overlap mode.
pub const DEFAULT_ROUTERS: usize = 2;
/// The most requests that may run at once.
pub const MAX_RUNNING_LIMIT: usize = 4096;
/// The most router threads.
pub const MAX_ROUTERS: usize = 64;
/// The longest lookahead (`--lookahead`).
pub const MAX_LOOKAHEAD: usize = 4096;
/// The largest request-row table the replay builds (`rows * max_context_len` slots,
/// 4 bytes each): 4 GiB.
pub const MAX_ROW_TABLE_SLOTS: usize = 1 << 30;
/// What kvpool's [`RadixCache`] allocates per page, besides 4 bytes per slot (its
/// constructor's estimate; it allocates infallibly, so the replay checks first).
const RADIX_BYTES_PER_PAGE: u128 = 190;
/// A host page's share of `HiRadixCache`'s transfer tables (an entry, its free-list
/// and queue places, its device pair and bits), rounded up.
const HOST_TRANSFER_BYTES_PER_PAGE: u128 = 48;
/// A host page of the reference two-tier tree: its place in the free-page set, and in
/// the vector that set is collected from, rounded up.
const REFERENCE_HOST_BYTES_PER_PAGE: u128 = 16;

/// How requests are scheduled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One request at a time, one thread, deterministic.
    Sequential,
    /// Scheduler, output and router threads at once.
    #[default]
    Overlap,
}

impl Mode {
    /// `sequential` or `overlap`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sequential => "sequential",
            Mode::Overlap => "overlap",
        }
    }
}

impl FromStr for Mode {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self, ReplayError> {
        match s.to_ascii_lowercase().as_str() {
            "sequential" => Ok(Mode::Sequential),
            "overlap" => Ok(Mode::Overlap),
            _ => Err(ReplayError::Config(format!("unknown mode {s:?}; expected sequential or overlap"))),
        }
    }
}

/// Which prefix cache the replay drives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// kvpool's concurrent [`RadixCache`].
    #[default]
    Kvpool,
    /// [`ReferenceRadixCache`](crate::baseline::ReferenceRadixCache) behind a mutex.
    Reference,
    /// The TGI-style [`VecTrieCache`](crate::baseline::VecTrieCache) behind a mutex.
    VecTrie,
}

impl CacheKind {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::Kvpool => "kvpool",
            CacheKind::Reference => "reference",
            CacheKind::VecTrie => "vectrie",
        }
    }
}

impl FromStr for CacheKind {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self, ReplayError> {
        match s.to_ascii_lowercase().as_str() {
            "kvpool" => Ok(CacheKind::Kvpool),
            "reference" => Ok(CacheKind::Reference),
            "vectrie" => Ok(CacheKind::VecTrie),
            _ => Err(ReplayError::Config(format!("unknown cache {s:?}; expected kvpool, reference or vectrie"))),
        }
    }
}

/// What to replay with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayConfig {
    /// Token capacity of the KV pool (default 1,048,576).
    pub capacity_tokens: usize,
    /// Tokens per page (default 16).
    pub page_size: u32,
    /// Eviction policy (default LRU).
    pub policy: EvictionPolicy,
    /// Scheduling mode (default overlap).
    pub mode: Mode,
    /// Which prefix cache to drive.
    pub cache: CacheKind,
    /// Requests running at once in overlap mode (default 32).
    pub max_running: usize,
    /// Router threads in overlap mode (default 2).
    pub routers: usize,
    /// Record a per-request [`TimelinePoint`] (for `--plot`).
    pub timeline: bool,
    /// Which model's memory to simulate (default attention: KV only).
    pub model: Model,
    /// The state pool and checkpoints of [`Model::Hybrid`] (ignored otherwise).
    pub hybrid: HybridConfig,
    /// The window and window pool of [`Model::Swa`] (ignored otherwise).
    pub swa: SwaConfig,
    /// Upcoming requests the scheduler tells the cache about
    /// ([`RadixCache::hint_prefix`], for [`EvictionPolicy::Hinted`]): in sequential
    /// mode the next `lookahead` requests of the trace (the waiting queue), in overlap
    /// mode the routers' window. `None`: `max_running`.
    pub lookahead: Option<usize>,
    /// Evict only the pages the shortfall needs, from a leaf's tail
    /// ([`RadixCache::with_partial_eviction`]; kvpool's cache and the optimum only).
    pub partial_evict: bool,
    /// Replay the offline optimum instead of a policy ([`run_optimal`]; sequential).
    pub optimal: bool,
    /// Which offline model [`optimal`](Self::optimal) runs: the optimum (the default)
    /// or an informed ceiling (ignored without `optimal`).
    pub ceiling: Ceiling,
    /// A host-memory tier under the device pool (kvpool's `HiRadixCache` or the
    /// two-tier reference tree; sequential mode, attention models).
    pub host: Option<HostTierConfig>,
    /// Several engines, each with its own device and host tiers, sharing a store
    /// (`--engines`, `--store`; needs `host`; sequential mode, `--cache kvpool`).
    pub engines: EnginesConfig,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            capacity_tokens: DEFAULT_CAPACITY_TOKENS,
            page_size: DEFAULT_PAGE_SIZE,
            policy: EvictionPolicy::Lru,
            mode: Mode::Overlap,
            cache: CacheKind::default(),
            max_running: DEFAULT_MAX_RUNNING,
            routers: DEFAULT_ROUTERS,
            timeline: false,
            model: Model::Attention,
            hybrid: HybridConfig::default(),
            swa: SwaConfig::default(),
            lookahead: None,
            partial_evict: false,
            optimal: false,
            ceiling: Ceiling::Optimal,
            host: None,
            engines: EnginesConfig::default(),
        }
    }
}

impl ReplayConfig {
    /// The lookahead in effect: [`lookahead`](Self::lookahead), or `max_running`.
    pub fn lookahead(&self) -> usize {
        self.lookahead.unwrap_or(self.max_running)
    }

    /// The policy's name in reports: the policy (or the offline model: `optimal`,
    /// `oracle-return[-W]`), and `partial leaves` with partial eviction.
    pub fn policy_name(&self) -> &'static str {
        use EvictionPolicy as P;
        match (self.optimal, self.policy, self.partial_evict) {
            (true, _, partial) => self.ceiling.label(partial).unwrap_or("oracle-return (invalid window)"),
            (false, p, false) => p.name(),
            (false, P::Lru, true) => "lru, partial leaves",
            (false, P::Lfu, true) => "lfu, partial leaves",
            (false, P::Fifo, true) => "fifo, partial leaves",
            (false, P::Mru, true) => "mru, partial leaves",
            (false, P::Filo, true) => "filo, partial leaves",
            (false, P::Priority, true) => "priority, partial leaves",
            (false, P::Hinted, true) => "hinted, partial leaves",
            (false, P::Reuse, true) => "reuse, partial leaves",
        }
    }

    /// Request rows the replay needs: one in sequential mode; in overlap mode the
    /// running requests plus as many waiting for the output thread.
    pub fn rows(&self) -> usize {
        match self.mode {
            Mode::Sequential => 1,
            // Saturating: `validate` bounds `max_running`, but this is public and
            // `memory_bytes` reads it for any configuration.
            Mode::Overlap => self.max_running.saturating_mul(2).saturating_add(2),
        }
    }

    /// The options that size this replay's memory ([`memory_bytes`](Self::memory_bytes)),
    /// for an error that asks to lower them: the pool always; the request rows in
    /// overlap mode (`--max-running`); the waiting queue's prompts in sequential mode
    /// under a policy that reads it (`--lookahead`); the host tier (`--host-capacity-tokens`).
    fn size_options(&self) -> &'static str {
        if self.host.is_some() {
            // The host tier runs in sequential mode under a leaf policy (`validate`).
            return "--capacity-tokens or --host-capacity-tokens";
        }
        match self.mode {
            Mode::Overlap => "--capacity-tokens or --max-running",
            Mode::Sequential if self.policy.uses_hints() && self.lookahead() > 0 => "--capacity-tokens or --lookahead",
            Mode::Sequential => "--capacity-tokens",
        }
    }

    /// Check the configuration against a trace.
    ///
    /// `capacity_tokens` must be a whole number of pages (a remainder would be silently
    /// unusable), and at least one request of the trace must fit in the pool: requests
    /// whose KV (rounded up to pages) exceeds it are rejected without being replayed,
    /// and a replay that could serve nothing is an error, not an empty report.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::{ReplayConfig, Trace};
    /// let trace = Trace::from_jsonl_str("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}", "t")?;
    /// let bad = ReplayConfig { page_size: 0, ..ReplayConfig::default() };
    /// assert_eq!(bad.validate(&trace).unwrap_err().to_string(), "--page-size must be at least 1");
    /// # Ok::<(), kvpool::replay::TraceError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ReplayError::Config`] naming the offending option.
    pub fn validate(&self, trace: &Trace) -> Result<(), ReplayError> {
        let bad = |m: String| Err(ReplayError::Config(m));
        if self.capacity_tokens == 0 {
            return bad("--capacity-tokens must be at least 1".into());
        }
        if self.page_size == 0 {
            return bad("--page-size must be at least 1".into());
        }
        let (capacity, ps) = (self.capacity_tokens, self.page_size as usize);
        if capacity < ps {
            return bad(format!("--capacity-tokens {capacity} is less than one page of {ps} tokens"));
        }
        // Slot numbers are u32 and page 0 is reserved: (pages + 1) * page_size <= 2^32.
        let max_capacity = ((1u64 << 32) - ps as u64) / ps as u64 * ps as u64;
        if capacity as u64 > max_capacity {
            return bad(format!(
                "--capacity-tokens {capacity} is too large: with pages of {ps} tokens, KV slot numbers must fit \
                 in u32 (at most {max_capacity} tokens)"
            ));
        }
        if capacity % ps != 0 {
            let below = capacity / ps * ps;
            let above = below + ps;
            let suggestion =
                if above as u64 <= max_capacity { format!("use {below} or {above}") } else { format!("use {below}") };
            return bad(format!(
                "--capacity-tokens {capacity} is not a multiple of --page-size {ps} (the pool holds whole pages); \
                 {suggestion}"
            ));
        }
        if self.max_running == 0 || self.max_running > MAX_RUNNING_LIMIT {
            return bad(format!("--max-running must be between 1 and {MAX_RUNNING_LIMIT}, not {}", self.max_running));
        }
        if self.routers > MAX_ROUTERS {
            return bad(format!("--routers must be at most {MAX_ROUTERS}, not {}", self.routers));
        }
        if let Some(n) = self.lookahead {
            if n > MAX_LOOKAHEAD {
                return bad(format!("--lookahead must be at most {MAX_LOOKAHEAD}, not {n}"));
            }
        }
        if self.cache != CacheKind::Kvpool && (self.partial_evict || self.policy.uses_hints()) && !self.optimal {
            return bad(format!(
                "--policy hinted, --policy reuse and --partial-evict need --cache kvpool (the baselines have SGLang's policies and \
                 whole-leaf eviction only), not --cache {}",
                self.cache.name()
            ));
        }
        if self.optimal {
            if self.mode != Mode::Sequential {
                return bad(format!(
                    "--policy optimal is an offline model of the sequential replay: use --mode sequential, not \
                     --mode {}",
                    self.mode.name()
                ));
            }
            if self.model != Model::Attention {
                return bad(format!(
                    "--policy optimal models the attention replay only (not --model {})",
                    self.model.name()
                ));
            }
            if BLOCK_TOKENS as usize % ps != 0 {
                return bad(format!(
                    "--policy optimal needs a --page-size that divides the trace's {BLOCK_TOKENS}-token blocks \
                     (1, 2, 4, ... 512), not {ps}"
                ));
            }
        }
        if self.model != Model::Attention && (self.partial_evict || self.policy.uses_hints()) {
            return bad(format!(
                "--policy hinted, --policy reuse and --partial-evict are not built for --model {}",
                self.model.name()
            ));
        }
        if self.model == Model::Hybrid {
            if self.mode != Mode::Sequential {
                return bad(format!(
                    "--model hybrid runs in sequential mode only (the hybrid overlap scheduler is not built yet); \
                     use --mode sequential, not --mode {}",
                    self.mode.name()
                ));
            }
            if self.cache != CacheKind::Kvpool {
                return bad(format!(
                    "--model hybrid needs --cache kvpool (only kvpool has a Mamba-aware cache), not --cache {}",
                    self.cache.name()
                ));
            }
            self.hybrid.validate(capacity, self.page_size)?;
        }
        if let Some(host) = &self.host {
            let other = if self.model != Model::Attention {
                Some(format!("--model {}", self.model.name()))
            } else if self.mode != Mode::Sequential {
                Some(format!("--mode {}", self.mode.name()))
            } else if self.cache == CacheKind::VecTrie {
                Some(format!("--cache {}", self.cache.name()))
            } else if self.optimal || self.partial_evict {
                Some(if self.optimal { "--policy optimal" } else { "--partial-evict" }.to_string())
            } else if self.policy.uses_hints() {
                Some(format!("--policy {}", self.policy.name()))
            } else {
                None
            };
            if let Some(other) = other {
                return bad(format!(
                    "the host tier runs on the two-tier trees: attention model, sequential mode, \
                     --cache kvpool or reference, a leaf policy; not {other}"
                ));
            }
            host.validate(self.page_size)?;
        }
        if self.model == Model::Swa {
            if self.mode != Mode::Sequential {
                return bad(format!(
                    "--model swa runs in sequential mode only; use --mode sequential, not --mode {}",
                    self.mode.name()
                ));
            }
            if self.cache != CacheKind::Kvpool {
                return bad(format!(
                    "--model swa needs --cache kvpool (only kvpool has a sliding-window cache), not --cache {}",
                    self.cache.name()
                ));
            }
            self.swa.validate(capacity, self.page_size)?;
        }
        self.engines.validate(self)?;
        let max_kv = trace.max_kv_len_fitting(capacity);
        // Not `max_kv == 0`: a request without KV (an empty prompt, at most one output
        // token) fits in any pool.
        if !trace.is_empty() && !trace.requests().iter().any(|q| q.kv_len() <= capacity) {
            let shortest = trace.requests().iter().map(|q| q.kv_len().div_ceil(ps).saturating_mul(ps)).min();
            return bad(format!(
                "no request of the trace fits in --capacity-tokens {capacity}: the smallest needs {} KV tokens \
                 (in whole pages of {ps}); nothing could be replayed",
                shortest.unwrap_or(0)
            ));
        }
        if (self.rows() as u64) * (max_kv.max(1) as u64) > MAX_ROW_TABLE_SLOTS as u64 {
            return bad(format!(
                "{} request rows of {} tokens (the longest request that fits) exceed the {} slot row table limit; \
                 lower --max-running",
                self.rows(),
                max_kv,
                MAX_ROW_TABLE_SLOTS
            ));
        }
        Ok(())
    }

    /// The bytes a replay of `trace` allocates up front (the allocator's page bitmap,
    /// the request rows, the prefix cache's arenas, the drivers' buffers), computed
    /// without overflow (`u64::MAX` if it would overflow). The reference cache grows
    /// as it caches and is not counted.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::{ReplayConfig, Trace};
    /// let trace = Trace::from_jsonl_str("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}", "t")?;
    /// let small = ReplayConfig::default().memory_bytes(&trace);
    /// let huge = ReplayConfig { capacity_tokens: 1 << 32, ..ReplayConfig::default() }.memory_bytes(&trace);
    /// assert!(small < 1 << 30 && huge > 1 << 35);
    /// # Ok::<(), kvpool::replay::TraceError>(())
    /// ```
    pub fn memory_bytes(&self, trace: &Trace) -> u64 {
        let ps = self.page_size.max(1) as u128;
        let pages = self.capacity_tokens as u128 / ps;
        let max_kv = trace.max_kv_len_fitting(self.capacity_tokens).max(1) as u128;
        let max_input = trace.max_input_length_fitting(self.capacity_tokens).max(1) as u128;
        let slot = 4u128;
        let bitmap = pages.div_ceil(64) * 8;
        let rows = self.rows() as u128 * max_kv * slot;
        let cache = match self.cache {
            CacheKind::Kvpool => RADIX_BYTES_PER_PAGE * (pages + 3) + slot * (pages + 1) * ps,
            // The baselines grow with what they cache.
            CacheKind::Reference | CacheKind::VecTrie => 0,
        };
        let buffers = match self.mode {
            // The lookahead's prompts (only under the hinted policy; no more than the
            // trace's requests).
            Mode::Sequential if self.policy.uses_hints() => {
                2 * max_kv * slot + (self.lookahead().min(trace.len()) as u128 + 1) * max_input * slot
            }
            Mode::Sequential => 2 * max_kv * slot,
            // Scheduler and routers: a prompt and its slots each; the output thread: KV tokens.
            Mode::Overlap => (2 + 2 * self.routers as u128) * max_input * slot + max_kv * slot,
        };
        let timeline =
            if self.timeline { trace.len() as u128 * core::mem::size_of::<TimelinePoint>() as u128 } else { 0 };
        let hybrid = match self.model {
            Model::Attention => 0,
            // The window order (4 bytes a node) and the full-to-window mapping (4 a slot),
            // the window pool's bitmap.
            Model::Swa => 4 * (pages + 3) + slot * (pages + 1) * ps + pages.div_ceil(64) * 8,
            // The state order (4 bytes a node), the state pool and owners, the timeline.
            Model::Hybrid => {
                4 * (pages + 3)
                    + self.hybrid.memory_bytes(self.capacity_tokens)
                    + if self.timeline { trace.len() as u128 * core::mem::size_of::<HybridPoint>() as u128 } else { 0 }
            }
        };
        // The host tier: kvpool's tree covers its pages in its arenas (records, token
        // cells, a transfer slot each); the reference tree keeps a set of its free pages.
        let host = self.host.as_ref().map_or(0, |h| {
            let host_pages = h.host_capacity_tokens as u128 / ps;
            match self.cache {
                CacheKind::Kvpool => (RADIX_BYTES_PER_PAGE + HOST_TRANSFER_BYTES_PER_PAGE + slot * ps) * host_pages,
                CacheKind::Reference | CacheKind::VecTrie => REFERENCE_HOST_BYTES_PER_PAGE * host_pages,
            }
        });
        u64::try_from(bitmap + rows + cache + buffers + timeline + hybrid + host).unwrap_or(u64::MAX)
    }
}

/// Why a replay failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReplayError {
    /// An option is out of range (the message names it).
    Config(String),
    /// The trace could not be loaded.
    Trace(TraceError),
    /// An invariant did not hold at the end: a slot or row was leaked, or the cache
    /// is inconsistent.
    Invariant(InvariantViolation),
    /// A call the driver makes correctly was refused: a bug in the cache or driver.
    Internal(String),
    /// The plot could not be written.
    Plot(String),
}

impl ReplayError {
    pub(crate) fn internal(what: &str, e: impl fmt::Display) -> Self {
        ReplayError::Internal(format!("{what}: {e}"))
    }
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayError::Config(m) => f.write_str(m),
            ReplayError::Trace(e) => write!(f, "cannot load trace {e}"),
            ReplayError::Invariant(e) => write!(f, "invariant violated at the end of the replay: {e}"),
            ReplayError::Internal(m) => write!(f, "internal error (a kvpool bug): {m}"),
            ReplayError::Plot(m) => write!(f, "cannot write the plot: {m}"),
        }
    }
}

impl std::error::Error for ReplayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReplayError::Trace(e) => Some(e),
            ReplayError::Invariant(e) => Some(e),
            _ => None,
        }
    }
}

impl From<TraceError> for ReplayError {
    fn from(e: TraceError) -> Self {
        ReplayError::Trace(e)
    }
}

impl From<InvariantViolation> for ReplayError {
    fn from(e: InvariantViolation) -> Self {
        ReplayError::Invariant(e)
    }
}

impl From<crate::ConfigError> for ReplayError {
    fn from(e: crate::ConfigError) -> Self {
        ReplayError::Config(e.to_string())
    }
}

/// Replay `trace` as `config` says: build the cache, run the driver of the mode.
/// `progress` is called now and then with the number of requests done.
///
/// # Examples
///
/// See the [module docs](self).
///
/// # Errors
///
/// [`ReplayError::Config`] for a bad configuration, [`ReplayError::Invariant`] if the
/// final accounting fails, [`ReplayError::Internal`] on a refused call.
pub fn replay(trace: &Trace, config: &ReplayConfig, progress: &(dyn Fn(u64) + Sync)) -> Result<Report, ReplayError> {
    config.validate(trace)?;
    let too_large = |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower {}", config.size_options()));
    // kvpool's cache sizes its arenas infallibly (an abort when the machine cannot
    // hold them): check that the whole replay can be reserved before building it.
    crate::arena::probe(
        config.memory_bytes(trace),
        "the replay (KV allocator, request rows, prefix cache and buffers)",
    )
    .map_err(too_large)?;
    if config.model == Model::Hybrid {
        return hybrid::replay_hybrid(trace, config, progress);
    }
    if config.model == Model::Swa {
        return swa::replay_swa(trace, config, progress);
    }
    if config.engines.active() {
        return store::replay_engines(trace, config, progress);
    }
    if let Some(host) = &config.host {
        return hicache::replay_hicache(trace, config, host, progress);
    }
    if config.optimal {
        let report = run_optimal(trace, config)?;
        progress(trace.len() as u64);
        return Ok(report);
    }
    let rows = config.rows() as u32;
    let max_context_len = trace.max_kv_len_fitting(config.capacity_tokens).max(1);
    match config.cache {
        CacheKind::Kvpool => {
            let alloc = crate::PagedAllocator::new(config.capacity_tokens, config.page_size).map_err(too_large)?;
            let req_pool = crate::ReqToTokenPool::new(rows, max_context_len).map_err(too_large)?;
            let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
            let cache = RadixCache::new(alloc, req_pool, radix)?.with_partial_eviction(config.partial_evict);
            run(&Arc::new(cache), trace, config, progress)
        }
        CacheKind::Reference => {
            let cache =
                ReferenceCache::new(config.capacity_tokens, config.page_size, config.policy, rows, max_context_len)
                    .map_err(too_large)?;
            run(&cache, trace, config, progress)
        }
        CacheKind::VecTrie => {
            let cache = VecTrieReplayCache::new(config.capacity_tokens, config.page_size, rows, max_context_len)?;
            run(&cache, trace, config, progress)
        }
    }
}

/// Run the driver of `config.mode` over an existing cache.
fn run<C: ReplayCache>(
    cache: &C,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    match config.mode {
        Mode::Sequential => run_sequential(cache, trace, config, progress),
        Mode::Overlap => run_overlap(cache, trace, config, progress),
    }
}

/// Counters every driver keeps; summed into the [`Report`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Totals {
    pub served: u64,
    pub rejected: u64,
    pub retracted: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    pub output_tokens: u64,
    /// Tokens the cache newly took in (page-aligned KV minus what it already held).
    pub added_tokens: u64,
    /// Tokens the driver's explicit `evict` calls freed.
    pub evicted_tokens: u64,
    pub peak_used_tokens: u64,
    pub router_matches: u64,
    pub router_hit_tokens: u64,
}

impl Totals {
    /// Count a request served: `cached` of its `kv_len` tokens (page size `ps`) were in
    /// the cache already, `hit` of its `prompt` tokens matched, `output` tokens decoded.
    pub(crate) fn served(&mut self, kv_len: usize, ps: usize, cached: usize, prompt: usize, hit: usize, output: u32) {
        let aligned = kv_len / ps * ps;
        self.added_tokens += (aligned - cached.min(aligned)) as u64;
        self.served += 1;
        self.prompt_tokens += prompt as u64;
        self.hit_tokens += hit as u64;
        self.output_tokens += u64::from(output);
    }
}

/// The latency histograms of a run.
#[derive(Clone, Debug, Default)]
pub(crate) struct Histograms {
    pub match_: LatencyHistogram,
    pub alloc_extend: LatencyHistogram,
    pub alloc_decode: LatencyHistogram,
    pub finish: LatencyHistogram,
    pub route: LatencyHistogram,
}

/// Check the end state and assemble the report. At quiescence every KV slot in use
/// must be cached, every row free, the cache consistent, and the cache's growth
/// (`added`) minus its evictions must equal what it holds.
pub(crate) fn finish_report<C: ReplayCache>(
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

/// New tokens (whole pages) a decode step at `seq_len` needs: a page when the new
/// token starts one.
#[inline]
pub(crate) fn decode_need(page_size: u32, seq_len: u32) -> usize {
    if (seq_len - 1) % page_size == 0 {
        page_size as usize
    } else {
        0
    }
}

/// Whether a request of `kv_len` KV tokens can ever be served by `cache`: its KV,
/// rounded up to whole pages, fits in the pool. The drivers reject the others before
/// expanding their tokens or evicting anything.
#[inline]
pub(crate) fn fits_in_pool<C: ReplayCache>(cache: &C, kv_len: usize) -> bool {
    let ps = cache.page_size().max(1) as usize;
    kv_len.div_ceil(ps).saturating_mul(ps) <= cache.capacity_tokens()
}

/// A driver buffer of `len` slots or tokens, reserved fallibly.
pub(crate) fn buffer(len: usize, what: &'static str) -> Result<Vec<u32>, ReplayError> {
    crate::arena::try_vec_with(len, what, |_| 0).map_err(ReplayError::from)
}
