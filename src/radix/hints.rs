//! What a scheduler knows beyond recency, for [`EvictionPolicy::Hinted`]
//! and [`EvictionPolicy::Reuse`].
//!
//! # Hints: "this prefix is wanted soon"
//!
//! A scheduler knows its waiting queue, and a KV-aware router looks a prompt up before
//! the request is admitted. Either can tell the cache that the prefix it found is
//! wanted by an upcoming admission, with [`RadixCache::hint_prefix`]: a read-only
//! look-up (as [`peek_prefix`](RadixCache::peek_prefix): lock-free, no latch, no
//! split, no recency update) that then records on the deepest matched node the
//! admission it is wanted by, `stamp = admissions so far + position`. The cache counts
//! admissions itself: every request [admitted](RadixCache::admit) is one.
//!
//! The record is one atomic word per node record, `gen << 32 | stamp` (both cut to 32
//! bits), written with a compare-and-swap loop that keeps the later stamp for the same
//! incarnation: a router never waits, and a failed CAS means another router (or the
//! writer) changed the word. The word carries no data anyone dereferences — it is
//! advice — so `Relaxed` is enough everywhere. `gen` is the record's generation when
//! the look-up validated it: a hint that lands after the node was evicted and its
//! record reused carries the old `gen` and is ignored (a 32-bit `gen` repeats only
//! after 2^31 reuses of one record between a look-up and the writer's next read of the
//! word). Stamps are compared with the admission clock by wrapping distance (a stamp at
//! most 2^31 admissions ahead is live), so the 32-bit cut never matters.
//!
//! The latch holder *folds* a word into the node's metadata (`want`, a 64-bit
//! admission number) when it touches the node (every node a match or an insert walks,
//! before any split copies the metadata to both halves) and when the node comes out of
//! the eviction heap. A node is **protected** while `want > admissions`: the admission
//! that wanted it has not happened yet. When that admission happens, its match touches
//! the node and the expired `want` is cleared; a `want` that expires on a node nobody
//! touched is cleared when the node next comes out of the heap.
//!
//! **The horizon.** A hint protects only while its admission lies within `H = pool
//! tokens / (2 x mean prompt tokens admitted so far)` admissions (unbounded before the
//! first admission): the prefixes of the next `H` requests fill on average at most half
//! the pool, so whatever the queue or the routers say, the unprotected order keeps at
//! least half of it. A hint further ahead stays in its word, unfolded, and is folded
//! when a touch or a pop finds it within the horizon (a leaf popped before that is
//! evicted as unprotected). A split gives both halves the node's `want`, each with its
//! own expiry entry.
//!
//! # The order: protected last, then least frequently used with dynamic aging
//!
//! Evictable leaves are keyed by (class, then):
//!
//! * unprotected leaves: the greedy-dual score `H = L + 1 + hits` (GDSF with the cost
//!   of a miss proportional to the tokens lost, so cost over size is constant: this is
//!   LFU with dynamic aging, Arlitt et al. 2000), then least recently used. `hits` is
//!   the node's hit count (matches through it); `L` is the cache's *inflation*, the
//!   score of the last leaf evicted, so a node hit long ago ages out: its score was
//!   fixed when it was last touched, and `L` rises past it as the cache turns over.
//!   Nothing is tuned: the only unit is "one hit", and `L` calibrates itself;
//! * protected leaves, after every unprotected one: the one wanted furthest in the
//!   future first (Belady's rule on what the queue tells).
//!
//! # [`EvictionPolicy::Reuse`]: a predicted chance of reuse instead of "one hit"
//!
//! The same hints, protection and aging, with the unprotected leaves' score
//! `H = L + p(depth) * (1 + hits)`: the greedy-dual value of a node is its frequency
//! weighted by the estimated probability that a later request extends its path. The
//! estimate is learned online from what the cache sees, per *conversation depth*:
//!
//! * a new resident leaf whose parent is not the root and has at most one resident
//!   child (no other request branched there: the prefix of one earlier request, whose
//!   own leftover tail may be that child) *extends* its parent's conversation: its depth
//!   is the parent's plus one (at most `DEPTHS - 1`), and the parent's depth counts
//!   one extension; any other new leaf (under the root or a branching node: a shared
//!   system prompt) starts a conversation, depth 0. A split copies the depth to both
//!   halves;
//! * `p(d) = (extended(d) + 1) / (created(d) + 2)`: the fraction of depth-`d` leaves a
//!   later request extended, with Laplace's prior (one success, one failure: 1/2 before
//!   any evidence). No decay and no window: the counts are the cache's whole history.
//!
//! In a chat workload a conversation that has already been continued is more likely to
//! be continued again than a fresh prompt is (the bundled trace: 26% of first turns
//! come back, 35%, 43% and 57% of the second, third and later ones), and this order
//! keeps such conversations longer. Where depth says nothing (a constant chance of
//! another turn) all `p` converge to the same value and the order is `Hinted`'s.
//!
//! A key changes only when the latch holder writes the node's metadata (a touch, a
//! fold, an expiry), and it re-sorts the node then, so the heap stays a heap: O(log n)
//! per touch and per eviction; a leaf that comes out of the heap with a new hint or an
//! expired one is re-keyed and pushed back (once per hint or expiry), never evicted.
//! Nothing here allocates after construction.
//!
//! Without [`EvictionPolicy::Hinted`] or [`EvictionPolicy::Reuse`], hints are ignored ([`hint_prefix`] is then a
//! plain [`peek_prefix`](RadixCache::peek_prefix)) and nothing here costs anything
//! beyond one counter increment per admission.
//!
//! [`hint_prefix`]: RadixCache::hint_prefix

use super::writer::Writer;
use super::{EvictionPolicy, Meta, RadixCache, Variant};
use crate::alloc::KvAllocator;
use crate::error::ConfigError;
use crate::sync::atomic::{AtomicU64, Ordering};

/// The protections in force, soonest expiry first, as (`want`, node): each time a node
/// becomes protected, an entry; eviction first clears every protection that has expired
/// (`want <= admissions`), so an expired protection never outlives its admission even
/// on a node nobody touched. An entry whose node changed since (evicted, reused,
/// protected longer) is harmless: only a `want` that has expired is ever cleared.
/// Capacity: one entry per node record, reserved at construction; when full (more
/// protections in force than nodes, which hints far in the future could cause), a new
/// protection gets no entry and expires when the node is next touched or popped.
pub(super) struct Expiry(std::collections::BinaryHeap<core::cmp::Reverse<(u64, u32)>>);

impl Expiry {
    pub(super) fn new(records: usize) -> Result<Self, ConfigError> {
        let mut v = Vec::new();
        v.try_reserve_exact(records).map_err(|_| ConfigError::TooLargeForMemory {
            what: "radix hint expiry order",
            bytes: crate::arena::bytes_of::<(u64, u32)>(records),
        })?;
        Ok(Expiry(std::collections::BinaryHeap::from(v)))
    }
}

/// The hint words, the admission clock and the eviction options.
pub(super) struct Hints {
    /// Per node record: `gen << 32 | stamp` (both cut to 32 bits), 0 for none.
    words: Box<[AtomicU64]>,
    /// Admissions so far.
    now: AtomicU64,
    /// The prompt tokens of those admissions (latch holder only), for the horizon.
    prompt_tokens: AtomicU64,
    /// The greedy-dual inflation `L`. Only the latch holder reads or writes it (an
    /// atomic only so that it can live beside the shared words).
    inflation: AtomicU64,
    /// Evict only the pages the shortfall needs, from a leaf's tail (see `partial`).
    pub(super) partial: bool,
    /// [`EvictionPolicy::Reuse`]: per depth, the leaves created at that depth and how
    /// many of them a later request extended. Latch holder only.
    created: [AtomicU64; DEPTHS],
    extended: [AtomicU64; DEPTHS],
}

/// [`EvictionPolicy::Reuse`]'s depth classes: 0 (a new conversation) to `DEPTHS - 1`
/// (that many extensions or more).
pub(super) const DEPTHS: usize = 8;

/// The fixed-point unit of a reuse probability in greedy-dual scores.
const REUSE_UNIT: u64 = 1 << 20;

impl Hints {
    pub(super) fn new(records: usize) -> Result<Self, ConfigError> {
        let words = crate::arena::try_vec_with(records, "radix hint words", |_| AtomicU64::new(0))?;
        Ok(Hints {
            words: words.into_boxed_slice(),
            now: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            inflation: AtomicU64::new(0),
            partial: false,
            created: Default::default(),
            extended: Default::default(),
        })
    }

    /// One more admission.
    #[inline]
    pub(super) fn admit(&self) {
        self.now.fetch_add(1, Ordering::Relaxed);
    }

    /// The latch holder admits a prompt of `tokens` tokens (for the horizon).
    #[inline]
    pub(super) fn admitted_tokens(&self, tokens: usize) {
        let t = &self.prompt_tokens;
        t.store(t.load(Ordering::Relaxed).saturating_add(tokens as u64), Ordering::Relaxed);
    }

    fn now(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }
}

/// Whether the 32-bit stamp `s` lies strictly ahead of the clock `now` (by wrapping
/// distance), and if so, the 64-bit admission number it stands for.
#[inline]
fn live_stamp(s: u32, now: u64) -> Option<u64> {
    let d = s.wrapping_sub(now as u32);
    (d != 0 && d < 1 << 31).then(|| now + d as u64)
}

/// The eviction key of a node under `policy` (smaller first).
#[inline]
pub(super) fn node_key<N>(policy: EvictionPolicy, m: &Meta<N>) -> (i64, u64) {
    match policy {
        EvictionPolicy::Hinted | EvictionPolicy::Reuse if m.want != 0 => (i64::MAX, u64::MAX - m.want),
        EvictionPolicy::Hinted | EvictionPolicy::Reuse => (m.score.min(i64::MAX as u64 - 1) as i64, m.last_access),
        _ => policy.key(m.last_access, m.created, m.hit_count, m.priority),
    }
}

impl<A: KvAllocator, V: Variant> Writer<'_, A, V> {
    /// The protection horizon, in admissions: the requests whose prompts, at the mean
    /// prompt length admitted so far, fill half the pool (unbounded before the first
    /// admission). A hint for a later admission is left in its word, unfolded, until
    /// the clock brings it within the horizon (see the module docs).
    fn horizon(&self) -> u64 {
        let h = &self.c.hints;
        let tokens = h.prompt_tokens.load(Ordering::Relaxed);
        if tokens == 0 {
            return u64::MAX;
        }
        let pool = self.c.alloc.size() as u128 * h.now() as u128;
        (pool / (2 * tokens as u128)).min(u64::MAX as u128) as u64
    }

    /// Fold node `id`'s hint word into its `want` (a stamp beyond the horizon stays in
    /// the word) and clear an expired `want`.
    fn fold_hint(&mut self, id: u32) {
        let now = self.c.hints.now();
        let cell = &self.c.hints.words[id as usize];
        let mut word = cell.load(Ordering::Relaxed);
        while word != 0 {
            let gen = self.c.records[id as usize].gen.load(Ordering::Relaxed) as u32;
            let stamp = if (word >> 32) as u32 == gen { live_stamp(word as u32, now) } else { None };
            if let Some(stamp) = stamp {
                if stamp - now > self.horizon() {
                    break;
                }
            }
            // Take the word (a stale or expired one is only cleared). Relaxed: advice.
            match cell.compare_exchange_weak(word, 0, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    if let Some(stamp) = stamp {
                        self.protect(id, stamp);
                    }
                    break;
                }
                Err(seen) => word = seen,
            }
        }
        let m = &mut self.s.meta[id as usize];
        if m.want != 0 && m.want <= now {
            m.want = 0;
        }
    }

    /// Protect node `id` until admission `stamp` (keeping a later `want`), with an
    /// entry in the expiry order.
    fn protect(&mut self, id: u32, stamp: u64) {
        let m = &mut self.s.meta[id as usize];
        if stamp > m.want {
            m.want = stamp;
            let e = &mut self.s.hint_expiry.0;
            // Within the capacity reserved at construction: no reallocation.
            if e.len() < e.capacity() {
                e.push(core::cmp::Reverse((stamp, id)));
            }
        }
    }
}

/// Node `id` was split into `upper` and `lower`, both of which copied its `want`: each
/// gets its own expiry entry (the old one names a retired record), so neither half's
/// protection can outlive its admission. Without this the half the wanting request
/// does not walk (the tail a continuation diverges from) stays keyed as protected,
/// behind every unprotected leaf, until the heap runs out of them.
#[inline]
pub(super) fn split<A: KvAllocator, V: Variant>(w: &mut Writer<'_, A, V>, upper: u32, lower: u32) {
    if !w.c.policy.uses_hints() {
        return;
    }
    let want = w.s.meta[lower as usize].want;
    if want != 0 {
        for id in [upper, lower] {
            w.s.meta[id as usize].want = 0;
            w.protect(id, want);
        }
    }
}

/// Node `id` was touched or created (its core order is re-sorted right after): fold its
/// hint and give it its greedy-dual score.
#[inline]
pub(super) fn touched<A: KvAllocator, V: Variant>(w: &mut Writer<'_, A, V>, id: u32) {
    if !w.c.policy.uses_hints() {
        return;
    }
    w.fold_hint(id);
    let l = w.c.hints.inflation.load(Ordering::Relaxed);
    let m = &w.s.meta[id as usize];
    let value = if w.c.policy == EvictionPolicy::Reuse {
        // The estimated chance that the node's path is extended, in units of
        // `REUSE_UNIT`, times the frequency term (one more than its hits).
        let d = m.depth as usize;
        let h = &w.c.hints;
        let (c, e) = (h.created[d].load(Ordering::Relaxed), h.extended[d].load(Ordering::Relaxed));
        let p = (e.min(c) + 1) * REUSE_UNIT / (c + 2);
        p.saturating_mul(m.hit_count.saturating_add(1))
    } else {
        m.hit_count.saturating_add(1)
    };
    let m = &mut w.s.meta[id as usize];
    m.score = l.saturating_add(value);
}

/// A new resident leaf `id` is about to hang under `parent` (whose child count does
/// not count it yet): give it its depth class and count it. A leaf that extends a
/// prefix no other resident request branched from (its parent is a node with at most
/// one resident child, not the root) continues that prefix's conversation: one deeper,
/// and its parent's depth counts one extension. Otherwise it starts a conversation.
#[inline]
pub(super) fn attached<A: KvAllocator, V: Variant>(w: &mut Writer<'_, A, V>, id: u32, parent: u32) {
    if w.c.policy != EvictionPolicy::Reuse {
        return;
    }
    let pm = &w.s.meta[parent as usize];
    let h = &w.c.hints;
    let depth = if parent != super::ROOT && pm.children <= 1 {
        let pd = pm.depth as usize;
        h.extended[pd].fetch_add(1, Ordering::Relaxed);
        (pd + 1).min(DEPTHS - 1)
    } else {
        0
    };
    h.created[depth].fetch_add(1, Ordering::Relaxed);
    w.s.meta[id as usize].depth = depth as u8;
}

/// Before an eviction: clear every protection that has expired, re-sorting the node.
#[inline]
pub(super) fn expire<A: KvAllocator, V: Variant>(w: &mut Writer<'_, A, V>) {
    if !w.c.policy.uses_hints() {
        return;
    }
    let now = w.c.hints.now();
    while let Some(&core::cmp::Reverse((want, id))) = w.s.hint_expiry.0.peek() {
        if want > now {
            break;
        }
        w.s.hint_expiry.0.pop();
        let m = &mut w.s.meta[id as usize];
        if m.want != 0 && m.want <= now {
            m.want = 0;
            w.heap().update(id);
        }
    }
}

/// Leaf `x` came out of the eviction heap. Returns `true` when it goes back instead
/// (a hint arrived or its protection expired: its key changed, and it is pushed back
/// under the new one); otherwise it is the victim, and the inflation rises to its score.
#[inline]
pub(super) fn deferred<A: KvAllocator, V: Variant>(w: &mut Writer<'_, A, V>, x: u32) -> bool {
    if !w.c.policy.uses_hints() {
        return false;
    }
    let before = node_key(w.c.policy, &w.s.meta[x as usize]);
    w.fold_hint(x);
    let m = &w.s.meta[x as usize];
    if node_key(w.c.policy, m) != before {
        w.heap().push(x);
        return true;
    }
    if m.want == 0 {
        let l = &w.c.hints.inflation;
        l.store(l.load(Ordering::Relaxed).max(m.score), Ordering::Relaxed);
    }
    false
}

impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    /// Admissions so far: how many requests this cache has [admitted](Self::admit) (the clock of [`hint_prefix`](Self::hint_prefix)).
    pub fn admissions(&self) -> u64 {
        self.hints.now()
    }

    /// [`peek_prefix`](Self::peek_prefix), and mark the prefix found as wanted by an
    /// upcoming admission: the `position`-th [admission](Self::admit)
    /// from now (1: the next one; 0 counts as 1). Under
    /// [`EvictionPolicy::Hinted`] the deepest matched node (hence its whole path) is
    /// evicted only after every unprotected leaf until that admission has happened;
    /// under the other policies this is [`peek_prefix`](Self::peek_prefix).
    ///
    /// Lock-free like `peek_prefix`: it never takes the writer latch, and the mark is
    /// one compare-and-swap loop on a word of the node (see the `hints` module docs).
    /// It does not lock anything: the prefix may still be evicted (last), and a
    /// request must still be [admitted](Self::admit) to use it.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
    /// # use kvpool::{ReqToTokenPool, TokenAllocator};
    /// let config = RadixConfig { policy: EvictionPolicy::Hinted, ..RadixConfig::default() };
    /// let cache = Arc::new(RadixCache::new(TokenAllocator::new(8)?, ReqToTokenPool::new(1, 8)?, config)?);
    /// for key in [[1, 2], [3, 4]] {
    ///     let mut req = cache.admit(0, &key)?;
    ///     req.extend(2)?;
    ///     req.finish(&key)?;
    /// }
    /// // [3, 4] is newer and as frequent, but the queue wants [1, 2]: [3, 4] goes.
    /// assert_eq!(cache.hint_prefix(0, &[1, 2], &mut [0; 2], 1), 2);
    /// assert_eq!(cache.evict(1), 2);
    /// assert_eq!(cache.peek_prefix(0, &[1, 2], &mut [0; 2]), 2);
    /// assert_eq!(cache.peek_prefix(0, &[3, 4], &mut [0; 2]), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hint_prefix(&self, namespace: u64, key: &[u32], out: &mut [u32], position: u32) -> usize {
        if !self.policy.uses_hints() {
            return self.peek_prefix(namespace, key, out);
        }
        let peeked = self.peek_walk(namespace, key, out);
        if let Some((id, gen)) = peeked.deepest {
            self.post_hint(id, gen, position.max(1));
        }
        peeked.len
    }

    /// Record that node `id` in incarnation `gen` is wanted by the `position`-th
    /// admission from now, keeping a later stamp already there for the same incarnation.
    fn post_hint(&self, id: u32, gen: u64, position: u32) {
        let now = self.hints.now();
        let stamp = (now as u32).wrapping_add(position);
        let word = (gen as u32 as u64) << 32 | stamp as u64;
        let cell = &self.hints.words[id as usize];
        let mut cur = cell.load(Ordering::Relaxed);
        loop {
            if cur >> 32 == word >> 32 {
                // The same incarnation: keep whichever stamp lies further ahead.
                let ahead = |s: u32| s.wrapping_sub(now as u32) as i32;
                if ahead(cur as u32) >= ahead(stamp) {
                    return;
                }
            }
            // Relaxed: the word is advice, nothing is published through it. A failure
            // means another router or the writer changed it: look again.
            match cell.compare_exchange_weak(cur, word, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }
}
