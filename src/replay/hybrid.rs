//! `kvpool replay --model hybrid`: the trace through a [`MambaRadixCache`], as a
//! scheduler serving a hybrid model (a few full-attention layers with paged KV, the
//! rest linear-attention / SSM layers with one fixed-size state per request) drives it.
//!
//! See [`run_hybrid`] for the request protocol and the accounting.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::error::{AllocError, InvariantViolation};
use crate::radix::{CheckpointConfig, Mamba, MambaRadixCache, RadixConfig, Request};
use crate::req_to_token::ReqToTokenPool;
use crate::{KvAllocator, PagedAllocator, SlotPool};

use super::lifecycle::{evict_shortfall, serve, Job, Steps};
use super::sequential::PROGRESS_EVERY;
use super::{
    buffer, finish_report, fits_in_pool, Histograms, ReplayCache, ReplayConfig, ReplayError, Report, TimelinePoint,
    Totals, Trace, NAMESPACE,
};

/// Default size of one request's Mamba state: Qwen3-Next-80B-A3B at tensor parallelism
/// 1, 36 Gated-DeltaNet layers of a temporal state (32 value heads x 128 x 128, fp32:
/// 2,097,152 bytes) and a conv state (8,192 channels x 3, bf16: 49,152 bytes):
/// 77,266,944 bytes (73.7 MiB).
pub const DEFAULT_MAMBA_STATE_BYTES: u64 = 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2);
/// Default KV bytes per token: the same model's 12 full-attention layers, K and V, 2 KV
/// heads of 256, bf16: 24,576 bytes.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 12 * 2 * 2 * 256 * 2;
/// Default state memory per KV memory, in thousandths: 0.9 (SGLang's
/// `--mamba-full-memory-ratio` default).
pub const DEFAULT_MAMBA_MEMORY_RATIO_PERMILLE: u32 = 900;
/// The fewest state slots a replay needs: a running request holds its own state and a
/// checkpoint, and locks the cached state it resumed from.
pub const MIN_MAMBA_STATES: u64 = 3;
/// The most state slots (more than any KV pool the replay builds could use: each state
/// is at least one chunk of tokens).
pub const MAX_MAMBA_STATES: u64 = 1 << 24;

/// Which model's memory the replay simulates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Model {
    /// Every layer is attention: KV only, kvpool's `RadixCache` (or a baseline).
    #[default]
    Attention,
    /// A hybrid (Qwen3-Next, Nemotron-H, Jamba...): KV plus one Mamba state per
    /// request, kvpool's `MambaRadixCache`, sequential mode.
    Hybrid,
    /// Sliding-window and full-attention layers (gpt-oss, Gemma 2/3): a full KV pool
    /// and a smaller window pool, kvpool's `SwaRadixCache`, sequential mode.
    Swa,
}

impl Model {
    /// `attention` or `hybrid`.
    pub fn name(self) -> &'static str {
        match self {
            Model::Attention => "attention",
            Model::Hybrid => "hybrid",
            Model::Swa => "swa",
        }
    }
}

impl FromStr for Model {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self, ReplayError> {
        match s.to_ascii_lowercase().as_str() {
            "attention" => Ok(Model::Attention),
            "hybrid" => Ok(Model::Hybrid),
            "swa" => Ok(Model::Swa),
            _ => Err(ReplayError::Config(format!("unknown model {s:?}; expected attention, hybrid or swa"))),
        }
    }
}

/// The hybrid model's state pool and checkpoint positions (used with
/// [`Model::Hybrid`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridConfig {
    /// State slots in the pool; `None` (the default): derived from the KV capacity, see
    /// [`state_slots`](Self::state_slots).
    pub states: Option<u64>,
    /// Bytes of one request's state (default [`DEFAULT_MAMBA_STATE_BYTES`]).
    pub state_bytes: u64,
    /// KV bytes per token (default [`DEFAULT_KV_BYTES_PER_TOKEN`]).
    pub kv_bytes_per_token: u64,
    /// State memory per KV memory, in thousandths (default 900).
    pub memory_ratio_permille: u32,
    /// Prefill checkpoints at multiples of this (default 64; a whole number of pages).
    pub chunk_size: usize,
    /// Decode checkpoints every this many tokens (default 256; a whole number of chunks).
    pub track_interval: usize,
}

impl Default for HybridConfig {
    fn default() -> Self {
        let m = CheckpointConfig::default();
        HybridConfig {
            states: None,
            state_bytes: DEFAULT_MAMBA_STATE_BYTES,
            kv_bytes_per_token: DEFAULT_KV_BYTES_PER_TOKEN,
            memory_ratio_permille: DEFAULT_MAMBA_MEMORY_RATIO_PERMILLE,
            chunk_size: m.chunk_size,
            track_interval: m.track_interval,
        }
    }
}

impl HybridConfig {
    /// State slots for a KV pool of `capacity_tokens`: `states` when set, otherwise as
    /// SGLang sizes its `MambaPool`: the state memory is `ratio` times the KV memory,
    /// `floor(ratio * capacity_tokens * kv_bytes_per_token / state_bytes)`. With the
    /// defaults (Qwen3-Next-80B-A3B, ratio 0.9) one state weighs as much KV as 3,144
    /// tokens: 300 states at 1,048,576 tokens, 4,802 at 16,777,216.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::HybridConfig;
    /// let c = HybridConfig::default();
    /// assert_eq!((c.state_slots(1 << 20), c.state_slots(1 << 24)), (300, 4802));
    /// assert_eq!(HybridConfig { states: Some(7), ..c }.state_slots(1 << 20), 7);
    /// ```
    pub fn state_slots(&self, capacity_tokens: usize) -> u64 {
        if let Some(n) = self.states {
            return n;
        }
        let kv = capacity_tokens as u128 * self.kv_bytes_per_token as u128 * self.memory_ratio_permille as u128;
        let n = kv / (self.state_bytes.max(1) as u128 * 1000);
        u64::try_from(n).unwrap_or(u64::MAX)
    }

    /// The checkpoint positions.
    pub fn checkpoint_config(&self) -> CheckpointConfig {
        CheckpointConfig { chunk_size: self.chunk_size, track_interval: self.track_interval }
    }

    /// Check the options against the KV pool, naming the offending flag.
    pub(crate) fn validate(&self, capacity_tokens: usize, page_size: u32) -> Result<(), ReplayError> {
        let bad = |m: String| Err(ReplayError::Config(m));
        let (chunk, track, ps) = (self.chunk_size, self.track_interval, page_size as usize);
        if chunk == 0 {
            return bad("--mamba-chunk must be at least 1".into());
        }
        if ps > 0 && chunk % ps != 0 {
            return bad(format!(
                "--mamba-chunk {chunk} must be a whole number of pages (a multiple of --page-size {ps})"
            ));
        }
        if track == 0 || track % chunk != 0 {
            return bad(format!(
                "--mamba-track-interval {track} must be a positive whole number of chunks (a multiple of \
                 --mamba-chunk {chunk})"
            ));
        }
        if self.states.is_none() {
            if self.state_bytes == 0 {
                return bad("--mamba-state-bytes must be at least 1".into());
            }
            if self.kv_bytes_per_token == 0 {
                return bad("--kv-bytes-per-token must be at least 1".into());
            }
            if self.memory_ratio_permille == 0 {
                return bad("--mamba-memory-ratio must be at least 0.001".into());
            }
        }
        let n = self.state_slots(capacity_tokens);
        if n < MIN_MAMBA_STATES {
            let why = format!(
                "a request needs {MIN_MAMBA_STATES} state slots (its own state, a checkpoint, and the cached state it \
                 resumes from)"
            );
            return bad(match self.states {
                Some(_) => format!("--mamba-states {n} is too few: {why}"),
                None => format!(
                    "the state pool derived from --capacity-tokens {capacity_tokens}, --mamba-memory-ratio {}, \
                     --kv-bytes-per-token {} and --mamba-state-bytes {} holds {n} state slots, but {why}; raise \
                     --mamba-memory-ratio or --capacity-tokens, or set --mamba-states {MIN_MAMBA_STATES} or more",
                    self.memory_ratio_permille as f64 / 1000.0,
                    self.kv_bytes_per_token,
                    self.state_bytes
                ),
            });
        }
        if n > MAX_MAMBA_STATES {
            return bad(match self.states {
                Some(_) => format!("--mamba-states {n} is too many: at most {MAX_MAMBA_STATES}"),
                None => format!(
                    "the state pool derived from --capacity-tokens {capacity_tokens}, --mamba-memory-ratio {}, \
                     --kv-bytes-per-token {} and --mamba-state-bytes {} holds {n} state slots, too many: at most \
                     {MAX_MAMBA_STATES}; lower --mamba-memory-ratio or raise --mamba-state-bytes, or set \
                     --mamba-states",
                    self.memory_ratio_permille as f64 / 1000.0,
                    self.kv_bytes_per_token,
                    self.state_bytes
                ),
            });
        }
        Ok(())
    }

    /// Bytes the state pool and the tree's state bookkeeping take (bitmap, owner table).
    pub(crate) fn memory_bytes(&self, capacity_tokens: usize) -> u128 {
        let n = self.state_slots(capacity_tokens).min(MAX_MAMBA_STATES) as u128;
        n.div_ceil(64) * 8 + (n + 1) * 4
    }
}

/// What the hybrid replay adds to the [`Report`] (its `hybrid` object in `--json`).
///
/// `Report::hit_tokens` is the state hit: the prefix a request can resume from (KV and
/// state); `kv_hit_tokens` is how far the KV alone matched, so `state_hit_tokens <=
/// kv_hit_tokens`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HybridReport {
    /// State slots in the pool.
    pub mamba_states: u64,
    /// Bytes of one state (0 when `--mamba-states` set the count directly).
    pub mamba_state_bytes: u64,
    /// Prefill checkpoint chunk.
    pub chunk_size: usize,
    /// Decode checkpoint interval.
    pub track_interval: usize,
    /// Prompt tokens whose KV was found cached (served requests).
    pub kv_hit_tokens: u64,
    /// `kv_hit_tokens / prompt_tokens`.
    pub kv_hit_rate: f64,
    /// Prompt tokens a request could resume from: the prefix up to the deepest cached
    /// state (equal to the report's `hit_tokens`).
    pub state_hit_tokens: u64,
    /// `state_hit_tokens / prompt_tokens`.
    pub state_hit_rate: f64,
    /// Served requests that resumed from a cached state.
    pub state_hit_requests: u64,
    /// Served requests whose KV matched further than the deepest state (they
    /// checkpointed at the branching point).
    pub branched_requests: u64,
    /// Checkpoint states the tree kept at a finish.
    pub states_cached: u64,
    /// Checkpoint states the tree already had (freed at the finish).
    pub states_duplicate: u64,
    /// Cached states freed by the state pass (the pool was empty).
    pub states_evicted_for_states: u64,
    /// Cached states freed with their KV leaf by KV eviction.
    pub states_evicted_with_kv: u64,
    /// The most state slots in use at once (cached plus held by the running request).
    pub peak_states_in_use: u64,
    /// States the tree holds at the end.
    pub final_states_held: u64,
    /// Tree nodes without a state at the end (their KV stays usable).
    pub final_tombstones: u64,
    /// Per-request points for `--plot`, beside [`Report::timeline`] (not serialized).
    #[serde(skip)]
    pub timeline: Vec<HybridPoint>,
}

/// One point of the hybrid timeline, at the same request as the `Report::timeline`
/// point of the same index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridPoint {
    /// Cumulative KV hit tokens of the requests served so far.
    pub kv_hit_tokens: u64,
    /// State slots in use (cached plus the request's own; taken before its finish).
    pub states_in_use: u64,
    /// States the tree holds (after the finish).
    pub states_cached: u64,
}

impl HybridReport {
    /// The hybrid line under the table's heading.
    pub(crate) fn header(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = super::stats::thousands;
        write!(f, "  (hybrid model: {} Mamba state slots", n(self.mamba_states))?;
        if self.mamba_state_bytes > 0 {
            write!(f, " of {:.1} MiB", self.mamba_state_bytes as f64 / (1 << 20) as f64)?;
        }
        writeln!(f, ", checkpoints every {} tokens of prefill, {} of decode)", self.chunk_size, self.track_interval)
    }

    /// The hybrid rows of the summary table.
    pub(crate) fn rows(&self, f: &mut fmt::Formatter<'_>, prompt_tokens: u64) -> fmt::Result {
        let pct = |x: u64| if prompt_tokens > 0 { 100.0 * x as f64 / prompt_tokens as f64 } else { 0.0 };
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<22} {v}");
        let n = super::stats::thousands;
        row(f, "KV hit tokens", format!("{} ({:.2}%)", n(self.kv_hit_tokens), pct(self.kv_hit_tokens)))?;
        row(
            f,
            "state hit tokens",
            format!("{} ({:.2}%; resumable: = hit tokens)", n(self.state_hit_tokens), pct(self.state_hit_tokens)),
        )?;
        row(f, "resumed requests", n(self.state_hit_requests))?;
        row(f, "branched requests", n(self.branched_requests))?;
        row(f, "states cached", format!("{} ({} already cached)", n(self.states_cached), n(self.states_duplicate)))?;
        row(
            f,
            "states evicted",
            format!(
                "{} ({} for states, {} with KV)",
                n(self.states_evicted_for_states + self.states_evicted_with_kv),
                n(self.states_evicted_for_states),
                n(self.states_evicted_with_kv)
            ),
        )?;
        row(f, "peak states in use", format!("{} of {}", n(self.peak_states_in_use), n(self.mamba_states)))?;
        row(f, "final states held", n(self.final_states_held))?;
        row(f, "final tombstones", n(self.final_tombstones))
    }
}

type Cache = MambaRadixCache<PagedAllocator, SlotPool>;

/// Build the hybrid pools for `config` and replay `trace` through them (sequential).
pub(crate) fn replay_hybrid(
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let too_large = |e: crate::ConfigError| ReplayError::Config(format!("{e}; lower --capacity-tokens"));
    let max_context_len = trace.max_kv_len_fitting(config.capacity_tokens).max(1);
    let alloc = PagedAllocator::new(config.capacity_tokens, config.page_size).map_err(too_large)?;
    let req_pool = ReqToTokenPool::new(config.rows() as u32, max_context_len).map_err(too_large)?;
    let slots = config.hybrid.state_slots(config.capacity_tokens);
    let states = u32::try_from(slots)
        .map_err(|_| ReplayError::Config(format!("--mamba-states {slots} is too many: at most {MAX_MAMBA_STATES}")))?;
    let radix = RadixConfig { policy: config.policy, ..RadixConfig::default() };
    let cache: Cache = MambaRadixCache::with_checkpoints(
        alloc,
        req_pool,
        SlotPool::without_magazines(states),
        radix,
        config.hybrid.checkpoint_config(),
    )?;
    run_hybrid(&Arc::new(cache), trace, config, progress)
}

/// The Mamba cache as a [`ReplayCache`]: the request loop admits, extends and decodes
/// through it, and the end-of-run accounting reads its KV. The hybrid replay's finish
/// is its own ([`Hybrid`]'s): it reads what became of the request's saved state.
struct Kv<'c, A: KvAllocator>(&'c Arc<MambaRadixCache<A, SlotPool>>);

impl<A: KvAllocator> ReplayCache for Kv<'_, A> {
    type Request = Request<A, Mamba<SlotPool>>;

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
        self.0.allocator().available_size()
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
        req.finish(kv_tokens).map(|done| done.cached).map_err(|refused| ReplayError::internal("finish", refused))
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

/// Counters of the hybrid replay beside the attention [`Totals`].
#[derive(Default)]
struct StateTotals {
    kv_hit_tokens: u64,
    state_hit_requests: u64,
    branched: u64,
    cached: u64,
    duplicate: u64,
    evicted_for_states: u64,
    evicted_with_kv: u64,
    peak_in_use: u64,
}

/// States in use: cached plus held by requests.
fn states_in_use<A: KvAllocator>(cache: &MambaRadixCache<A, SlotPool>) -> u64 {
    (cache.states().capacity() as usize - cache.states().available()) as u64
}

/// States the tree holds.
fn states_cached<A: KvAllocator>(cache: &MambaRadixCache<A, SlotPool>) -> usize {
    cache.mamba_evictable_size() + cache.mamba_protected_size()
}

/// The hybrid model's steps in the request loop: the states a request takes (its
/// running state at admission, its checkpoint's with
/// [`save_state`](Request::save_state)), counting the cached states evicted for them;
/// the KV eviction, counting the states that go with it; and the finish, counting what
/// became of the saved state.
struct Hybrid {
    mamba: CheckpointConfig,
    st: StateTotals,
    /// The request being served: its index and KV tokens.
    r: usize,
    kv_len: usize,
    /// States the tree held and tokens it cached before the admission.
    before: (usize, usize),
    /// The request's resumed prefix, its KV hit, whether it branched, its last
    /// checkpoint and whether it saves a state there.
    prefix: usize,
    kv_hit: usize,
    branched: bool,
    checkpoint: usize,
    saves: bool,
    /// States in use with the request's all allocated (0 before).
    in_use: u64,
}

impl Hybrid {
    /// Count the cached states (and their tokens) evicted since `before` to free a
    /// state slot.
    fn count_state_evictions<A: KvAllocator>(&mut self, cache: &MambaRadixCache<A, SlotPool>, totals: &mut Totals) {
        let (states, tokens) = self.before;
        self.st.evicted_for_states += states.saturating_sub(states_cached(cache)) as u64;
        totals.evicted_tokens += tokens.saturating_sub(cache.total_size()) as u64;
    }
}

impl<A: KvAllocator> Steps<Kv<'_, A>> for Hybrid {
    fn before_admit(&mut self, kv: &Kv<'_, A>) {
        self.before = (states_cached(kv.0), kv.0.total_size());
        self.in_use = 0;
    }

    fn admitted(
        &mut self,
        kv: &Kv<'_, A>,
        req: Option<&mut Request<A, Mamba<SlotPool>>>,
        prompt: &[u32],
        totals: &mut Totals,
    ) -> Result<bool, ReplayError> {
        let cache = &**kv.0;
        // The admission took the request's running state, evicting the least recently
        // used unlocked cached state (and its leaf's KV) when none was free.
        self.count_state_evictions(cache, totals);
        // None: every state is locked. Cannot happen with one request at a time and at
        // least MIN_MAMBA_STATES slots; the request is rejected.
        let Some(req) = req else { return Ok(false) };
        self.st.peak_in_use = self.st.peak_in_use.max(states_in_use(cache));
        let (m, prompt) = (self.mamba, prompt.len());
        (self.prefix, self.kv_hit, self.branched) = (req.cached_len(), req.kv_hit(), req.branching_len().is_some());
        let first = req.branching_len().unwrap_or_else(|| m.prefill_checkpoint(prompt));
        let checkpoint = last_checkpoint(m, first, prompt, self.kv_len);
        self.checkpoint = checkpoint;
        if checkpoint < self.prefix {
            return Err(ReplayError::Internal(format!(
                "request {}: checkpoint {checkpoint} lies before the resumed prefix {}",
                self.r, self.prefix
            )));
        }
        // A checkpoint at the resumed prefix is cached already: nothing to save.
        self.saves = checkpoint > self.prefix;
        if self.saves {
            self.before = (states_cached(cache), cache.total_size());
            let saved = req.save_state(checkpoint);
            self.count_state_evictions(cache, totals);
            match saved {
                Ok(_) => self.st.peak_in_use = self.st.peak_in_use.max(states_in_use(cache)),
                Err(AllocError::OutOfMemory(_)) => return Ok(false),
                Err(e) => return Err(ReplayError::internal("save_state", e)),
            }
        }
        Ok(true)
    }

    fn room(&mut self, kv: &Kv<'_, A>, need: usize, totals: &mut Totals) -> bool {
        // The KV shortfall, as the attention replay; the states that went with the
        // evicted leaves are counted too.
        let before = kv.0.mamba_evictable_size();
        let fits = evict_shortfall(kv, need, totals);
        self.st.evicted_with_kv += before.saturating_sub(kv.0.mamba_evictable_size()) as u64;
        fits
    }

    fn allocated(&mut self, kv: &Kv<'_, A>) {
        self.in_use = states_in_use(kv.0);
    }

    fn finish(
        &mut self,
        _kv: &Kv<'_, A>,
        req: Request<A, Mamba<SlotPool>>,
        job: &Job<'_>,
        totals: &mut Totals,
    ) -> Result<(), ReplayError> {
        // Caches the tokens up to the saved state with it (or, with no state saved
        // past the resumed prefix, nothing), frees the KV past it and the running
        // state.
        let done = req.finish(job.tokens).map_err(|refused| ReplayError::internal("finish", refused))?;
        if self.saves {
            totals.added_tokens += (self.checkpoint - done.cached.min(self.checkpoint)) as u64;
            if done.state_kept {
                self.st.cached += 1;
            } else {
                self.st.duplicate += 1;
            }
        }
        totals.served += 1;
        totals.prompt_tokens += job.prompt as u64;
        totals.hit_tokens += self.prefix as u64;
        totals.output_tokens += u64::from(job.output);
        self.st.kv_hit_tokens += self.kv_hit as u64;
        self.st.state_hit_requests += u64::from(self.prefix > 0);
        self.st.branched += u64::from(self.branched);
        Ok(())
    }
}

/// The last checkpoint of a request: its prefill checkpoint (`first`), or the last
/// decode checkpoint in `prompt + 1 ..= kv_len`, whichever is later.
fn last_checkpoint(m: CheckpointConfig, first: usize, prompt: usize, kv_len: usize) -> usize {
    let decode = kv_len / m.track_interval * m.track_interval;
    if decode > prompt && m.is_decode_checkpoint(decode) {
        decode.max(first)
    } else {
        first
    }
}

/// Replay `trace` through a Mamba cache one request at a time ([`Model::Hybrid`]). The
/// cache's request pool must have a row of at least [`Trace::max_kv_len_fitting`] the
/// pool's capacity; its state pool at least [`MIN_MAMBA_STATES`] slots.
///
/// Each request, in trace order:
///
/// 1. it is admitted ([`admit`](crate::radix::RadixCache::admit)): its prompt's KV may
///    match [`kv_hit`](Request::kv_hit) tokens, but it can resume only from the deepest
///    cached *state*, [`cached_len`](Request::cached_len) tokens in (its **state hit**,
///    the effective reusable prefix: KV and state); everything past it is recomputed.
///    It takes its own running state slot (a fork of the matched state: slot
///    accounting only, no data is simulated) with its row;
/// 2. when it will save a checkpoint past the prefix it resumed from, it takes a
///    checkpoint slot there ([`save_state`](Request::save_state), SGLang's ping-pong
///    track buffer); when the pool is empty, the least recently used unlocked cached
///    state is evicted for either slot
///    ([`evict_mamba`](crate::radix::RadixCache::evict_mamba)), and counted;
/// 3. KV for the rest of the prompt ([`extend`](Request::extend)) and one decode slot
///    per output token after the first ([`decode`](crate::radix::RadixCache::decode)),
///    evicting the KV shortfall first, exactly as the attention replay
///    ([`run_sequential`](super::run_sequential));
/// 4. checkpoints: during prefill at the branching point
///    ([`branching_len`](Request::branching_len)) when the KV matched further than
///    the state, else at the last chunk boundary of the prompt; during decode whenever
///    the sequence reaches a multiple of the track interval: the last of them is the
///    one it saves;
/// 5. its [`finish`](Request::finish) caches its tokens up to that checkpoint with the
///    saved state (the tree keeps the state, or frees it when that checkpoint was
///    cached already), frees its KV past the checkpoint and its running state.
///
/// `--policy` orders the KV eviction (whole leaves, their states with them, then any
/// parent left a childless tombstone); states are evicted for states least recently
/// used first whatever the policy (SGLang's Mamba LRU list).
///
/// At the end the accounting is checked as for the attention replay (every KV slot free
/// or cached, every row free, `check_invariants`), and for states: every state slot is
/// free or held by the tree, and the checkpoints the tree kept equal the states it
/// still holds plus those evicted.
///
/// # Examples
///
/// ```
/// use kvpool::replay::{replay, Mode, Model, ReplayConfig, Trace};
///
/// // Two requests sharing their first 512-token block, the second twice.
/// let text = "{\"input_length\": 600, \"output_length\": 10, \"hash_ids\": [1, 2]}\n\
///             {\"input_length\": 700, \"output_length\": 10, \"hash_ids\": [1, 3]}\n\
///             {\"input_length\": 700, \"output_length\": 10, \"hash_ids\": [1, 3]}\n";
/// let trace = Trace::from_jsonl_str(text, "example")?;
/// let config = ReplayConfig { mode: Mode::Sequential, model: Model::Hybrid, ..ReplayConfig::default() };
/// let report = replay(&trace, &config, &|_| {})?;
/// let h = report.hybrid.as_ref().unwrap();
/// // r0 checkpoints at 576 (the last chunk boundary of its prompt). r1's KV matches
/// // the shared 512 tokens, but no state lies there: it recomputes its whole prompt and
/// // checkpoints at the branching point, 512 (the tombstone r1's split left there gets
/// // a state). r2 resumes from there, and checkpoints at 640.
/// assert_eq!((h.kv_hit_tokens, h.state_hit_tokens, h.branched_requests), (512 + 512, 512, 1));
/// assert_eq!((h.states_cached, h.final_states_held, h.final_tombstones), (3, 3, 0));
/// assert_eq!(report.hit_tokens, h.state_hit_tokens);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
///
/// As [`run_sequential`](super::run_sequential); [`ReplayError::Invariant`] also when
/// a state slot is leaked or the state counts do not add up.
pub fn run_hybrid<A: KvAllocator>(
    cache: &Arc<MambaRadixCache<A, SlotPool>>,
    trace: &Trace,
    config: &ReplayConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report, ReplayError> {
    let kv = Kv(cache);
    let capacity = kv.capacity_tokens();
    let max_kv = trace.max_kv_len_fitting(capacity);
    if cache.req_pool().max_context_len() < max_kv || cache.req_pool().size() == 0 {
        return Err(ReplayError::Config(format!(
            "the cache's request rows hold {} tokens but the trace needs {max_kv}",
            cache.req_pool().max_context_len()
        )));
    }
    if (cache.states().capacity() as u64) < MIN_MAMBA_STATES {
        return Err(ReplayError::Config(format!(
            "the state pool holds {} slots; a request needs {MIN_MAMBA_STATES}",
            cache.states().capacity()
        )));
    }
    let mut tokens = buffer(max_kv.max(1), "the replay's token buffer")?;
    let mut totals = Totals::default();
    let mut steps = Hybrid {
        mamba: cache.checkpoint_config(),
        st: StateTotals::default(),
        r: 0,
        kv_len: 0,
        before: (0, 0),
        prefix: 0,
        kv_hit: 0,
        branched: false,
        checkpoint: 0,
        saves: false,
        in_use: 0,
    };
    let mut hist = Histograms::default();
    let mut timeline = Vec::new();
    let mut points = Vec::new();
    if config.timeline {
        let fail = |what, bytes| crate::ConfigError::TooLargeForMemory { what, bytes };
        timeline
            .try_reserve_exact(trace.len())
            .map_err(|_| fail("the replay's timeline", crate::arena::bytes_of::<TimelinePoint>(trace.len())))?;
        points
            .try_reserve_exact(trace.len())
            .map_err(|_| fail("the replay's state timeline", crate::arena::bytes_of::<HybridPoint>(trace.len())))?;
    }
    let start = Instant::now();
    for r in 0..trace.len() {
        let q = trace.request(r);
        let kv_len = q.kv_len();
        steps.in_use = 0;
        if fits_in_pool(&kv, kv_len) {
            trace.write_kv_tokens(r, &mut tokens);
            (steps.r, steps.kv_len) = (r, kv_len);
            let job = Job { tokens: &tokens[..kv_len], prompt: q.input_length as usize, output: q.output_length };
            if !serve(&kv, &mut steps, NAMESPACE, &job, &mut totals, &mut hist)? {
                totals.rejected += 1;
            }
        } else {
            // Larger than the whole pool: it can never be served. Nothing is evicted.
            totals.rejected += 1;
        }
        if config.timeline {
            timeline.push(TimelinePoint {
                requests_done: r as u32 + 1,
                used_tokens: (capacity - kv.available_tokens()) as u64,
                cached_tokens: kv.cached_tokens() as u64,
                prompt_tokens: totals.prompt_tokens,
                hit_tokens: totals.hit_tokens,
                ..TimelinePoint::default()
            });
            let cached_states = states_cached(cache) as u64;
            points.push(HybridPoint {
                kv_hit_tokens: steps.st.kv_hit_tokens,
                states_in_use: steps.in_use.max(cached_states),
                states_cached: cached_states,
            });
        }
        if (r as u64 + 1) % PROGRESS_EVERY == 0 {
            progress(r as u64 + 1);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    progress(trace.len() as u64);
    let mut report = finish_report(&kv, config, totals, &hist, wall, timeline)?;
    report.hybrid = Some(check_states(cache, config, &totals, steps.st, points)?);
    Ok(report)
}

/// The state half of the end-of-run accounting, and the hybrid report.
fn check_states<A: KvAllocator>(
    cache: &MambaRadixCache<A, SlotPool>,
    config: &ReplayConfig,
    totals: &Totals,
    st: StateTotals,
    timeline: Vec<HybridPoint>,
) -> Result<HybridReport, ReplayError> {
    let pool = cache.states();
    let held = cache.mamba_evictable_size() as u64;
    if cache.mamba_protected_size() != 0 {
        return Err(
            InvariantViolation(format!("{} cached states are still locked", cache.mamba_protected_size())).into()
        );
    }
    let free = pool.available() as u64;
    if free + held != pool.capacity() as u64 {
        return Err(InvariantViolation(format!(
            "{} state slots are in use but the cache holds {held} states: {} leaked",
            pool.capacity() as u64 - free,
            pool.capacity() as u64 - free - held
        ))
        .into());
    }
    if st.cached != held + st.evicted_for_states + st.evicted_with_kv {
        return Err(InvariantViolation(format!(
            "the cache kept {} states and evicted {} + {}, but holds {held}",
            st.cached, st.evicted_for_states, st.evicted_with_kv
        ))
        .into());
    }
    pool.check_invariants()?;
    let nodes = cache.node_count() as u64;
    let rate = |x: u64| if totals.prompt_tokens > 0 { x as f64 / totals.prompt_tokens as f64 } else { 0.0 };
    Ok(HybridReport {
        mamba_states: pool.capacity() as u64,
        mamba_state_bytes: if config.hybrid.states.is_some() { 0 } else { config.hybrid.state_bytes },
        chunk_size: cache.checkpoint_config().chunk_size,
        track_interval: cache.checkpoint_config().track_interval,
        kv_hit_tokens: st.kv_hit_tokens,
        kv_hit_rate: rate(st.kv_hit_tokens),
        state_hit_tokens: totals.hit_tokens,
        state_hit_rate: rate(totals.hit_tokens),
        state_hit_requests: st.state_hit_requests,
        branched_requests: st.branched,
        states_cached: st.cached,
        states_duplicate: st.duplicate,
        states_evicted_for_states: st.evicted_for_states,
        states_evicted_with_kv: st.evicted_with_kv,
        peak_states_in_use: st.peak_in_use,
        final_states_held: held,
        final_tombstones: nodes - held,
        timeline,
    })
}
