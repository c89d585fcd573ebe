//! Eviction policies.

use core::fmt;
use core::str::FromStr;

/// Which unlocked leaf [`evict`](super::RadixCache::evict) removes first.
///
/// All policies order by a logical clock (one tick per node touch), so the order is
/// deterministic; SGLang uses `time.monotonic()` for the same fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Least recently used first (the default).
    #[default]
    Lru,
    /// Least frequently used first (hit count), then least recently used.
    Lfu,
    /// Oldest created first.
    Fifo,
    /// Most recently used first.
    Mru,
    /// Newest created first.
    Filo,
    /// Lowest priority first, then least recently used.
    Priority,
    /// kvpool's scheduler-aware policy (not in SGLang): leaves that a queued request or
    /// a router look-up marked as wanted soon ([`RadixCache::hint_prefix`]) go last;
    /// the others go by least frequently used with dynamic aging (greedy-dual). See
    /// the `hints` module docs.
    ///
    /// [`RadixCache::hint_prefix`]: super::RadixCache::hint_prefix
    Hinted,
    /// kvpool's reuse-predicting policy (not in SGLang): [`Hinted`](Self::Hinted)'s
    /// hints and greedy-dual aging, with the frequency replaced by an online estimate
    /// of the probability that a leaf's prefix is extended by a later request, learned
    /// per conversation depth (how many earlier requests' prefixes the leaf's path
    /// extends). See the `hints` module docs.
    Reuse,
}

impl EvictionPolicy {
    /// Every policy, for tests and command-line help.
    pub const ALL: [EvictionPolicy; 6] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Fifo,
        EvictionPolicy::Mru,
        EvictionPolicy::Filo,
        EvictionPolicy::Priority,
    ];

    /// Policies kvpool has beyond SGLang's (the simple reference tree does not run them).
    pub const KVPOOL_ONLY: [EvictionPolicy; 2] = [EvictionPolicy::Hinted, EvictionPolicy::Reuse];

    /// Whether the policy takes hints ([`RadixCache::hint_prefix`]) and orders by
    /// greedy-dual scores: [`Hinted`](Self::Hinted) and [`Reuse`](Self::Reuse).
    ///
    /// [`RadixCache::hint_prefix`]: super::RadixCache::hint_prefix
    #[inline]
    pub fn uses_hints(self) -> bool {
        matches!(self, EvictionPolicy::Hinted | EvictionPolicy::Reuse)
    }

    /// The policy's name as SGLang spells it (`lru`, `lfu`, ...).
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::Fifo => "fifo",
            EvictionPolicy::Mru => "mru",
            EvictionPolicy::Filo => "filo",
            EvictionPolicy::Priority => "priority",
            EvictionPolicy::Hinted => "hinted",
            EvictionPolicy::Reuse => "reuse",
        }
    }

    /// The eviction key of a node: smaller keys are evicted first. Timestamps are
    /// distinct ticks of one logical clock, so keys never tie. [`Hinted`](Self::Hinted)
    /// and [`Reuse`](Self::Reuse)
    /// key on per-node state these fields do not carry: here it is LRU (kvpool's tree
    /// computes its real key itself).
    #[inline]
    pub fn key(self, last_access: u64, created: u64, hit_count: u64, priority: i64) -> (i64, u64) {
        match self {
            EvictionPolicy::Lru => (0, last_access),
            EvictionPolicy::Lfu => (hit_count.min(i64::MAX as u64) as i64, last_access),
            EvictionPolicy::Fifo => (0, created),
            EvictionPolicy::Mru => (0, u64::MAX - last_access),
            EvictionPolicy::Filo => (0, u64::MAX - created),
            EvictionPolicy::Priority => (priority, last_access),
            EvictionPolicy::Hinted | EvictionPolicy::Reuse => (0, last_access),
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing an [`EvictionPolicy`] from an unknown name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown eviction policy {:?}; expected one of lru, lfu, fifo, mru, filo, priority, hinted, reuse",
            self.0
        )
    }
}

impl std::error::Error for UnknownPolicy {}

impl FromStr for EvictionPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        EvictionPolicy::ALL
            .into_iter()
            .chain(EvictionPolicy::KVPOOL_ONLY)
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}
