//! The two-tier replay (`kvpool replay --host-capacity-tokens N`, issue 11): a device
//! KV pool with a host-memory tier under it, SGLang's HiCache.
//!
//! The tree is kvpool's [`HiRadixCache`] (`--cache kvpool`, the default) or
//! [`ReferenceHiCache`], the sequential model of the two-tier radix cache behind a mutex
//! (`--cache reference`); both over a [`PagedAllocator`] for the device and a host page
//! pool, and both give the same figures (`tests/replay_hicache.rs` checks it). Each request matches its prompt; when the match continues
//! into host-only KV it is loaded back (all or nothing, not below SGLang's 10 tokens),
//! and the loaded tokens count as *host hits*; the rest runs as the sequential replay's
//! requests do. Transfers are taken to complete at once; their size in bytes
//! (`bytes_per_token`) and the time they would take on a link of `link_gbps` are
//! reported.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

use super::cache::Rows;
use super::stats::thousands;
use super::{run_sequential, BaselineRequest, CacheKind, ReplayCache, ReplayConfig, ReplayError, Report, Trace};
use crate::baseline::hicache_ref::{HiNodeId, ReferenceHiCache, WritePolicy, DEFAULT_LOAD_BACK_THRESHOLD};
use crate::error::{AllocError, InvariantViolation};
use crate::radix::{Hi, HiRadixCache, HostTier, RadixConfig, Request, Transfer};
use crate::req_to_token::ReqToTokenPool;
use crate::{KvAllocator, PagedAllocator};

/// Llama-3-8B's KV bytes per token across its layers: 32 layers x 2 (K, V) x 8 KV
/// heads x 128 dims x 2 bytes (bf16) = 128 KiB.
pub const DEFAULT_BYTES_PER_TOKEN: u64 = 128 * 1024;
/// The host link's bandwidth, bytes per second: 50 GB/s, about what a PCIe 5.0 x16
/// link moves between pinned host memory and an H100 in one direction.
pub const DEFAULT_LINK_BYTES_PER_SECOND: u64 = 50_000_000_000;
/// SGLang's `--hicache-ratio` default: the host pool is twice the device pool (the
/// host KV pool's own default, re-exported).
pub use crate::kv::host::DEFAULT_HOST_TO_DEVICE_RATIO;

/// The host tier of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTierConfig {
    /// Host pool tokens (whole pages of the device's page size are used).
    pub host_capacity_tokens: usize,
    /// When KV is copied to host.
    pub write_policy: WritePolicy,
    /// KV bytes per token across all layers (for the bytes moved).
    pub bytes_per_token: u64,
    /// Host link bandwidth in bytes per second (for the implied transfer time).
    pub link_bytes_per_second: u64,
    /// Host continuations shorter than this are not loaded back.
    pub load_back_threshold: usize,
}

impl HostTierConfig {
    /// A host tier of `host_capacity_tokens` with the defaults: `write_through`, 128 KiB
    /// per token, a 50 GB/s link, SGLang's load-back threshold of 10 tokens.
    pub fn new(host_capacity_tokens: usize) -> HostTierConfig {
        HostTierConfig {
            host_capacity_tokens,
            write_policy: WritePolicy::default(),
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
            link_bytes_per_second: DEFAULT_LINK_BYTES_PER_SECOND,
            load_back_threshold: DEFAULT_LOAD_BACK_THRESHOLD,
        }
    }

    /// Check the values against the device pool.
    ///
    /// # Errors
    ///
    /// [`ReplayError::Config`] naming the bad option.
    pub fn validate(&self, page_size: u32) -> Result<(), ReplayError> {
        let bad = |m: String| Err(ReplayError::Config(m));
        if page_size == 0 {
            return bad("--page-size must be at least 1".into());
        }
        if self.host_capacity_tokens < page_size as usize {
            return bad(format!(
                "--host-capacity-tokens {} holds no page of {page_size} tokens",
                self.host_capacity_tokens
            ));
        }
        if self.host_capacity_tokens / page_size as usize > u32::MAX as usize {
            return bad(format!("--host-capacity-tokens {} has too many pages", self.host_capacity_tokens));
        }
        if self.bytes_per_token == 0 {
            return bad("--transfer-bytes-per-token must be at least 1".to_string());
        }
        if self.link_bytes_per_second == 0 {
            return bad("--link-gbps must be positive".to_string());
        }
        Ok(())
    }
}

/// Seconds `tokens` of KV take over the host link (in floating point: the bytes may
/// not fit in 64 bits).
pub(crate) fn transfer_seconds(tokens: u64, host: &HostTierConfig) -> f64 {
    tokens as f64 * host.bytes_per_token as f64 / host.link_bytes_per_second as f64
}

/// The host tier's figures of a two-tier replay.
///
/// `Report::hit_tokens` is the total hit (device + host): the prefix each request did
/// not compute.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HostReport {
    /// The two-tier tree: `HiRadixCache` or `ReferenceHiCache`.
    pub tree: &'static str,
    /// Host pool tokens.
    pub host_capacity_tokens: usize,
    /// `write_through`, `write_through_selective` or `write_back`.
    pub write_policy: &'static str,
    /// Prompt tokens found on the device.
    pub device_hit_tokens: u64,
    /// Prompt tokens loaded back from host.
    pub host_hit_tokens: u64,
    /// `host_hit_tokens` over all prompt tokens.
    pub host_hit_rate: f64,
    /// Host continuations found but not loaded (below the threshold, or no device room).
    pub load_back_skipped_tokens: u64,
    /// Tokens copied device -> host.
    pub written_tokens: u64,
    /// Tokens copied host -> device.
    pub loaded_tokens: u64,
    /// Bytes copied device -> host.
    pub bytes_written: u64,
    /// Bytes copied host -> device.
    pub bytes_loaded: u64,
    /// Seconds the transfers take at `link_gbps`, one direction at a time.
    pub transfer_seconds: f64,
    /// The link bandwidth assumed, GB/s.
    pub link_gbps: f64,
    /// Device tokens freed by eviction (backed-up KV stays on host).
    pub device_evicted_tokens: u64,
    /// Host tokens freed by host eviction.
    pub host_evicted_tokens: u64,
    /// Backups refused for lack of host room.
    pub backups_refused: u64,
    /// Host pool tokens in use at the end.
    pub final_host_used_tokens: u64,
}

impl HostReport {
    pub(crate) fn header(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "  (host tier: {} tokens, {}; {})",
            thousands(self.host_capacity_tokens as u64),
            self.write_policy,
            self.tree
        )
    }

    pub(crate) fn rows(&self, f: &mut std::fmt::Formatter<'_>, prompt_tokens: u64) -> std::fmt::Result {
        let pct = |x: u64| if prompt_tokens > 0 { 100.0 * x as f64 / prompt_tokens as f64 } else { 0.0 };
        let row = |f: &mut std::fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<22} {v}");
        let gb = |b: u64| b as f64 / 1e9;
        row(
            f,
            "device hit tokens",
            format!("{} ({:.2}%)", thousands(self.device_hit_tokens), pct(self.device_hit_tokens)),
        )?;
        row(f, "host hit tokens", format!("{} ({:.2}%)", thousands(self.host_hit_tokens), pct(self.host_hit_tokens)))?;
        row(
            f,
            "written to host",
            format!("{} tokens ({:.1} GB)", thousands(self.written_tokens), gb(self.bytes_written)),
        )?;
        row(
            f,
            "loaded from host",
            format!("{} tokens ({:.1} GB)", thousands(self.loaded_tokens), gb(self.bytes_loaded)),
        )?;
        row(f, "transfer time", format!("{:.2} s at {} GB/s", self.transfer_seconds, self.link_gbps))?;
        row(
            f,
            "evicted",
            format!("{} device, {} host", thousands(self.device_evicted_tokens), thousands(self.host_evicted_tokens)),
        )?;
        row(
            f,
            "final host used",
            format!("{} of {}", thousands(self.final_host_used_tokens), thousands(self.host_capacity_tokens as u64)),
        )
    }
}

/// [`ReferenceHiCache`] as a [`ReplayCache`]: an admission loads its host
/// continuation back.
struct HiReplayCache {
    tree: Mutex<ReferenceHiCache<PagedAllocator>>,
    rows: Rows,
    page_size: u32,
    capacity: usize,
    host_hits: AtomicU64,
    skipped: AtomicU64,
    /// Device tokens evicted inside load-backs (to make room for them).
    load_evictions: AtomicU64,
}

#[derive(Debug)]
struct HiLease {
    node: HiNodeId,
    len: usize,
}

impl HiReplayCache {
    fn tree(&self) -> MutexGuard<'_, ReferenceHiCache<PagedAllocator>> {
        self.tree.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The replay moves no bytes: every transfer a step starts completes at once.
fn settle_reference(t: &mut ReferenceHiCache<PagedAllocator>) {
    for tr in t.take_transfers() {
        t.complete(tr.id);
    }
}

/// As [`settle_reference`], for kvpool's tree.
pub(super) fn settle(tree: &HiRadixCache<PagedAllocator>) {
    let mut buf = [Transfer::default(); 64];
    loop {
        let n = tree.take_transfers(&mut buf);
        for t in &buf[..n] {
            let r = tree.complete(*t);
            debug_assert!(r.is_ok(), "a transfer just taken is in flight: {r:?}");
        }
        if n < buf.len() {
            break;
        }
    }
}

impl ReplayCache for HiReplayCache {
    type Request = BaselineRequest<HiLease>;

    fn name(&self) -> &'static str {
        "reference"
    }
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn capacity_tokens(&self) -> usize {
        self.capacity
    }
    fn available_tokens(&self) -> usize {
        self.tree().allocator().available_size()
    }
    fn evictable_tokens(&self) -> usize {
        self.tree().evictable_size()
    }
    fn cached_tokens(&self) -> usize {
        let t = self.tree();
        t.evictable_size() + t.protected_size()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        self.rows.pool()
    }
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError> {
        self.rows.admit(namespace, prompt, |key, out| {
            let mut t = self.tree();
            let mut m = t.match_prefix(namespace, key);
            let mut node = m.device_node;
            if m.host_len > 0 {
                let before = t.counters().device_evicted;
                let loaded = t.load_back(m.host_node, None);
                self.load_evictions.fetch_add(t.counters().device_evicted - before, Ordering::Relaxed);
                match loaded {
                    Some(slots) => {
                        self.host_hits.fetch_add(slots.len() as u64, Ordering::Relaxed);
                        m.device.extend_from_slice(&slots);
                        node = m.host_node;
                    }
                    None => {
                        self.skipped.fetch_add(m.host_len as u64, Ordering::Relaxed);
                    }
                }
            }
            t.inc_lock_ref(node);
            settle_reference(&mut t);
            out[..m.device.len()].copy_from_slice(&m.device);
            (m.device.len(), HiLease { node, len: m.device.len() })
        })
    }
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError> {
        self.rows.extend(req, n, |p, s, l, out| self.tree().allocator().alloc_extend(p, s, l, out))
    }
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        self.rows.decode(batch, out, |s, l, out| self.tree().allocator().alloc_decode(s, l, out))
    }
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        let cache = |namespace, tokens: &[u32], kv: &[u32], lease: HiLease| {
            let mut t = self.tree();
            let prefix = t.cache_finished_req(namespace, tokens, kv, lease.len, lease.node);
            settle_reference(&mut t);
            Ok(prefix)
        };
        self.rows.finish(req, kv_tokens, cache, |req| self.abort(req))
    }
    fn abort(&self, req: Self::Request) {
        let lease = self.rows.release(req, |own| self.tree().allocator().free(own));
        self.tree().dec_lock_ref(lease.node);
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        let m = self.tree().match_prefix(namespace, key);
        out[..m.device.len()].copy_from_slice(&m.device);
        m.device.len()
    }
    fn evict(&self, num_tokens: usize) -> usize {
        let mut t = self.tree();
        let n = t.evict(num_tokens);
        settle_reference(&mut t);
        n
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let t = self.tree();
        t.allocator().check_invariants()?;
        t.check().map_err(|e| InvariantViolation(format!("two-tier reference cache: {e}")))
    }
    fn tier_occupancy(&self) -> (u64, u64) {
        (self.tree().host_size() as u64, self.host_hits.load(Ordering::Relaxed))
    }
    fn tier_flows(&self) -> (u64, u64) {
        (self.tree().counters().loaded, self.load_evictions.load(Ordering::Relaxed))
    }
}

/// [`HiRadixCache`] (the host tier on kvpool's radix core) as a [`ReplayCache`]: an
/// admission loads its host continuation back, in the same step
/// ([`Request::host_hit`]); every transfer a call starts completes at once.
pub(super) struct KvHiReplay {
    pub(super) tree: Arc<HiRadixCache<PagedAllocator>>,
    /// Tokens loaded back so far (whatever brought them to host).
    pub(super) host_hits: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) load_evictions: AtomicU64,
}

impl KvHiReplay {
    pub(super) fn new(tree: HiRadixCache<PagedAllocator>) -> KvHiReplay {
        let tree = Arc::new(tree);
        KvHiReplay { tree, host_hits: AtomicU64::new(0), skipped: AtomicU64::new(0), load_evictions: AtomicU64::new(0) }
    }
}

impl ReplayCache for KvHiReplay {
    type Request = Request<PagedAllocator, Hi>;

    fn name(&self) -> &'static str {
        "kvpool"
    }
    fn page_size(&self) -> u32 {
        self.tree.page_size() as u32
    }
    fn capacity_tokens(&self) -> usize {
        self.tree.allocator().size()
    }
    fn available_tokens(&self) -> usize {
        self.tree.allocator().available_size()
    }
    fn evictable_tokens(&self) -> usize {
        self.tree.evictable_size()
    }
    fn cached_tokens(&self) -> usize {
        self.tree.total_size()
    }
    fn req_pool(&self) -> &ReqToTokenPool {
        self.tree.req_pool()
    }
    fn admit(&self, namespace: u64, prompt: &[u32]) -> Result<Self::Request, AllocError> {
        let before = self.tree.counters().device_evicted;
        let req = self.tree.admit(namespace, prompt);
        settle(&self.tree);
        self.load_evictions.fetch_add(self.tree.counters().device_evicted - before, Ordering::Relaxed);
        if let Ok(req) = &req {
            let hit = req.host_hit();
            self.host_hits.fetch_add(hit.loaded as u64, Ordering::Relaxed);
            self.skipped.fetch_add((hit.matched - hit.loaded) as u64, Ordering::Relaxed);
        }
        req
    }
    fn extend(&self, req: &mut Self::Request, n: usize) -> Result<(), AllocError> {
        req.extend(n)
    }
    fn decode<R: AsMut<Self::Request>>(&self, batch: &mut [R], out: &mut [u32]) -> Result<(), AllocError> {
        self.tree.decode(batch, out)
    }
    fn finish(&self, req: Self::Request, kv_tokens: &[u32]) -> Result<usize, ReplayError> {
        let r = req.finish(kv_tokens).map_err(|refused| ReplayError::internal("finish", refused));
        settle(&self.tree);
        r
    }
    fn abort(&self, req: Self::Request) {
        req.abort();
    }
    fn peek_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        self.tree.peek_prefix(namespace, key, out)
    }
    fn evict(&self, num_tokens: usize) -> usize {
        let n = self.tree.evict(num_tokens);
        settle(&self.tree);
        n
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.tree.allocator().check_invariants()?;
        self.tree.check_invariants()
    }
    fn tier_occupancy(&self) -> (u64, u64) {
        (self.tree.host_size() as u64, self.host_hits.load(Ordering::Relaxed))
    }
    fn tier_flows(&self) -> (u64, u64) {
        (self.tree.counters().loaded, self.load_evictions.load(Ordering::Relaxed))
    }
}

/// Replay `trace` with a host tier under the device pool (see the module docs), on
/// kvpool's [`HiRadixCache`] (`--cache kvpool`) or the sequential model
/// (`--cache reference`).
///
/// # Errors
///
/// As [`run_sequential`], and [`ReplayError::Config`] for a bad host configuration.
pub(crate) fn replay_hicache(
    trace: &Trace,
    config: &ReplayConfig,
    host: &HostTierConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let too_large = |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower --capacity-tokens"));
    let max_context_len = trace.max_kv_len_fitting(config.capacity_tokens).max(1);
    let alloc = PagedAllocator::new(config.capacity_tokens, config.page_size).map_err(too_large)?;
    // The tree's arenas cover the host pages too: name both options that size them.
    let too_large =
        |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower --capacity-tokens or --host-capacity-tokens"));
    let req_pool = ReqToTokenPool::new(config.rows() as u32, max_context_len).map_err(too_large)?;
    let host_pages = (host.host_capacity_tokens / config.page_size as usize) as u32;
    let (mut report, c, host_size, host_hits, skipped) = if config.cache == CacheKind::Kvpool {
        let tier =
            HostTier { host_pages, write_policy: host.write_policy, load_back_threshold: host.load_back_threshold };
        let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
        let tree = HiRadixCache::with_host_tier(alloc, req_pool, radix, tier).map_err(too_large)?;
        let cache = KvHiReplay::new(tree);
        let report = run_sequential(&cache, trace, config, progress)?;
        let (hits, skipped) = (cache.host_hits.load(Ordering::Relaxed), cache.skipped.load(Ordering::Relaxed));
        (report, cache.tree.counters(), cache.tree.host_size(), hits, skipped)
    } else {
        let tree =
            ReferenceHiCache::new(alloc, host_pages, config.policy, host.write_policy, host.load_back_threshold)?;
        let capacity = tree.allocator().size();
        let cache = HiReplayCache {
            tree: Mutex::new(tree),
            rows: Rows::new(req_pool),
            page_size: config.page_size,
            capacity,
            host_hits: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            load_evictions: AtomicU64::new(0),
        };
        let report = run_sequential(&cache, trace, config, progress)?;
        let t = cache.tree();
        let (hits, skipped) = (cache.host_hits.load(Ordering::Relaxed), cache.skipped.load(Ordering::Relaxed));
        (report, t.counters(), t.host_size(), hits, skipped)
    };
    // Saturating: --transfer-bytes-per-token is not bounded, and a product past 64 bits
    // must not wrap to a small figure (the time is computed in floating point).
    let (bytes_written, bytes_loaded) =
        (c.written.saturating_mul(host.bytes_per_token), c.loaded.saturating_mul(host.bytes_per_token));
    let tree = if config.cache == CacheKind::Kvpool { "HiRadixCache" } else { "ReferenceHiCache" };
    report.host = Some(HostReport {
        tree,
        host_capacity_tokens: host_pages as usize * config.page_size as usize,
        write_policy: host.write_policy.name(),
        device_hit_tokens: report.hit_tokens - host_hits,
        host_hit_tokens: host_hits,
        host_hit_rate: if report.prompt_tokens > 0 { host_hits as f64 / report.prompt_tokens as f64 } else { 0.0 },
        load_back_skipped_tokens: skipped,
        written_tokens: c.written,
        loaded_tokens: c.loaded,
        bytes_written,
        bytes_loaded,
        transfer_seconds: transfer_seconds(c.written + c.loaded, host),
        link_gbps: host.link_bytes_per_second as f64 / 1e9,
        device_evicted_tokens: c.device_evicted,
        host_evicted_tokens: c.host_evicted,
        backups_refused: c.backup_refused,
        final_host_used_tokens: host_size as u64,
    });
    Ok(report)
}
