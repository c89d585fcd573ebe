//! The offline optimum (issue 13): Belady's MIN adapted to a prefix tree, as a ceiling
//! for the eviction policies (`kvpool replay --policy optimal`, sequential mode), and
//! informed ceilings that know less of the future (`--policy oracle-return[-W]`).
//!
//! # What it computes
//!
//! The sequential replay with every eviction decided by the future: when the pool is
//! short, the evictable leaf whose next use lies furthest ahead goes first, and a leaf
//! no later request uses goes before any other. The next use of a cached page is the
//! first later request whose prompt's whole pages include it (as a prefix: its tokens
//! and all tokens before it equal; a request too large for the pool is rejected
//! before it matches, and uses nothing); it is precomputed from the whole trace, per
//! prompt block chain (the hash ids up to a block), the list of requests using it.
//!
//! * **Whole leaves** (SGLang's semantics, the default): a leaf's next use is its first
//!   page's (any use of a leaf uses its first page). Belady's rule is a heuristic here:
//!   leaves differ in size and go whole, and no polynomial rule is known to be exact.
//! * **Partial** (`--partial-evict`): pages go one at a time from a leaf's tail, keyed
//!   by the tail page's next use. Every prefix of a cached path is a cached path, a
//!   page's next use is never later than its descendants', and eviction is lazy
//!   (exactly the shortfall): this is classic paging with forced loads, where MIN is
//!   optimal — and it bounds every policy of either granularity from above, since any
//!   whole-leaf schedule is also a page schedule. The tests check both against brute
//!   force over every eviction choice on small traces.
//!
//! # Informed ceilings: knowing *whether*, not *when*
//!
//! [`Ceiling::Return`] knows whether a later request uses a leaf (its victim page, as
//! above) but not when: leaves no later request uses go first (Belady's first rule),
//! then LRU among the rest. [`Ceiling::ReturnWithin`]`(W)` knows only whether the use
//! comes within the next `W` requests: leaves used within them go last, LRU within each
//! class. A leaf's class is recomputed whenever its key is (a use re-keys it), and a
//! leaf whose next use comes within `W` while it waits is promoted when the clock
//! reaches that request (a queue of such promotions, ordered by request). `W = 0` is
//! LRU exactly; `W` at least the trace's length is [`Ceiling::Return`]. They bound from
//! above what LRU gains from a perfect predictor of returns (within `W` requests), not
//! every online policy: one could order the returning leaves better than by recency.
//!
//! # An online policy in the model: `model-lhd`
//!
//! Not a ceiling: [`Ceiling::Lhd`] runs an online policy (least hit density, learned
//! from what the cache has seen; see the `lhd` module) in this model, to measure
//! cheaply whether it predicts returns before building it into the tree. It uses no
//! future but the waiting queue's next 32 requests (`model-lhd`; `model-lhd-classes`
//! and `model-lhd-age` use none).
//!
//! # How
//!
//! kvpool's tree is built for an online policy; this is a separate page-level model of
//! the same replay (match with splits, locks along the path, the prompt's extend then
//! one decode page at a time, evicting the shortfall first, the finish), with the
//! same logical clock. Run with LRU or LFU it reproduces kvpool's sequential replay
//! exactly — hit tokens, evicted tokens, peak and final occupancy (tested) — so the
//! optimum differs from them only by its eviction choices. It needs a page size that
//! divides the trace's 512-token blocks (pages then never straddle two blocks, and a
//! page is named by its block chain and its place in the block).

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use super::{Histograms, ReplayConfig, ReplayError, Report, Trace, BLOCK_TOKENS};
#[cfg(test)]
use crate::radix::EvictionPolicy;
pub use lhd::LhdVariant;
use lhd::{Lhd, QUEUE};

/// Which offline model `kvpool replay --policy optimal | oracle-return[-W]` runs
/// ([`ReplayConfig::optimal`](super::ReplayConfig::optimal)): ceilings, not policies a
/// server can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ceiling {
    /// Belady: the leaf whose next use lies furthest ahead goes first.
    #[default]
    Optimal,
    /// Knows whether a later request uses a leaf, not when: unused leaves first, then
    /// LRU.
    Return,
    /// Knows whether a leaf is used within the next `W` requests: the others first
    /// (LRU), then those (LRU). `W` is a power of two, 1 to [`MAX_RETURN_WINDOW`].
    ReturnWithin(u32),
    /// Not a ceiling: an online policy (LHD) modelled here to measure it cheaply
    /// (`model-lhd`, `model-lhd-classes`, `model-lhd-age`; see the module docs of `src/replay/optimal/lhd.rs`).
    Lhd(LhdVariant),
}

/// The longest window of [`Ceiling::ReturnWithin`].
pub const MAX_RETURN_WINDOW: u32 = 1 << 16;

/// `oracle-return-W` for the powers of two `W` up to [`MAX_RETURN_WINDOW`].
macro_rules! within_label {
    ($w:expr, $partial:expr; $($n:literal)*) => {
        match ($w, $partial) {
            $(
                ($n, false) => Some(concat!("oracle-return-", $n)),
                ($n, true) => Some(concat!("oracle-return-", $n, ", partial leaves")),
            )*
            _ => None,
        }
    };
}

impl Ceiling {
    /// The name `--policy` takes: `optimal`, `oracle-return`, `oracle-return-W`.
    ///
    /// # Errors
    ///
    /// A message for another name, or a window that is not a power of two up to
    /// [`MAX_RETURN_WINDOW`].
    pub fn from_name(s: &str) -> Result<Option<Self>, String> {
        let s = s.to_ascii_lowercase();
        if s == "optimal" {
            return Ok(Some(Ceiling::Optimal));
        }
        if s == "oracle-return" {
            return Ok(Some(Ceiling::Return));
        }
        for v in [LhdVariant::Age, LhdVariant::Classes, LhdVariant::Queue] {
            if Some(s.as_str()) == Ceiling::Lhd(v).label(false) {
                return Ok(Some(Ceiling::Lhd(v)));
            }
        }
        let Some(w) = s.strip_prefix("oracle-return-") else { return Ok(None) };
        let c = w.parse().ok().map(Ceiling::ReturnWithin).filter(|c| c.label(false).is_some());
        c.map(Some).ok_or_else(|| {
            format!("oracle-return-W needs a window W that is a power of two from 1 to {MAX_RETURN_WINDOW}, not {w:?}")
        })
    }

    /// The report's policy label (`None`: a window [`from_name`](Self::from_name) rejects).
    pub fn label(self, partial: bool) -> Option<&'static str> {
        match (self, partial) {
            (Ceiling::Optimal, false) => Some("optimal"),
            (Ceiling::Optimal, true) => Some("optimal, partial leaves"),
            (Ceiling::Return, false) => Some("oracle-return"),
            (Ceiling::Return, true) => Some("oracle-return, partial leaves"),
            (Ceiling::Lhd(_), true) => None,
            (Ceiling::Lhd(LhdVariant::Age), false) => Some("model-lhd-age"),
            (Ceiling::Lhd(LhdVariant::Classes), false) => Some("model-lhd-classes"),
            (Ceiling::Lhd(LhdVariant::Queue), false) => Some("model-lhd"),
            (Ceiling::ReturnWithin(w), p) => within_label!(w, p;
                1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192 16384 32768 65536),
        }
    }

    fn sim(self) -> SimPolicy {
        match self {
            Ceiling::Optimal => SimPolicy::Optimal,
            Ceiling::Return => SimPolicy::Return,
            Ceiling::ReturnWithin(w) => SimPolicy::ReturnWithin(w.into()),
            Ceiling::Lhd(v) => SimPolicy::Lhd(v),
        }
    }
}

/// Which leaf the model evicts first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))] // LRU and LFU: the tests' checks against kvpool
pub(crate) enum SimPolicy {
    /// kvpool's LRU (to check the model against the real replay).
    Lru,
    /// kvpool's LFU.
    Lfu,
    /// Belady: furthest next use first.
    Optimal,
    /// Leaves no later request uses first, then LRU.
    Return,
    /// Leaves not used within the next `W` requests first, then LRU.
    ReturnWithin(u64),
    /// Least hit density, learned online (not a ceiling; see [`lhd`]).
    Lhd(LhdVariant),
}

const NEVER: u64 = u64::MAX;
const ROOT: u32 = 0;
/// Page ids with this bit are private to one request (they hold output tokens).
const PRIVATE: u64 = 1 << 63;

/// For each prompt block chain, the requests whose prompt reaches it (of those that fit
/// in the pool), in order, with how many whole pages of the block each one's prompt
/// covers.
struct Uses {
    ps: usize,
    pages_per_block: usize,
    /// `chain_of[r]`: the block chain ids of request `r`'s prompt blocks.
    chain_start: Vec<usize>,
    chains: Vec<u32>,
    /// Per chain: (request, whole pages of the block in its prompt).
    uses: Vec<Vec<(u32, u16)>>,
}

impl Uses {
    /// The uses in `trace` with pages of `ps` tokens in a pool of `capacity_pages`.
    fn new(trace: &Trace, ps: usize, capacity_pages: usize) -> Self {
        let pages_per_block = BLOCK_TOKENS as usize / ps;
        let mut intern: HashMap<(u32, u32), u32> = HashMap::new();
        let (mut chain_start, mut chains, mut uses) = (Vec::with_capacity(trace.len() + 1), Vec::new(), Vec::new());
        for r in 0..trace.len() {
            chain_start.push(chains.len());
            // A request too large for the pool is rejected before it matches: it uses
            // no page (its prompt's pages are never looked up).
            if trace.request(r).kv_len().div_ceil(ps) > capacity_pages {
                continue;
            }
            let len = trace.request(r).input_length as usize;
            let mut parent = u32::MAX;
            for (b, &h) in trace.hash_ids(r).iter().enumerate() {
                let next = intern.len() as u32;
                let id = *intern.entry((parent, h)).or_insert(next);
                if id as usize == uses.len() {
                    uses.push(Vec::new());
                }
                let covered = (len - b * BLOCK_TOKENS as usize).min(BLOCK_TOKENS as usize) / ps;
                uses[id as usize].push((r as u32, covered as u16));
                chains.push(id);
                parent = id;
            }
        }
        chain_start.push(chains.len());
        Uses { ps, pages_per_block, chain_start, chains, uses }
    }

    /// The id of whole prompt page `i` of request `r`.
    fn page(&self, r: usize, i: usize) -> u64 {
        let chain = self.chains[self.chain_start[r] + i / self.pages_per_block];
        (chain as u64) * self.pages_per_block as u64 + (i % self.pages_per_block) as u64
    }

    /// The first request after `r` whose prompt's whole pages include `page`.
    fn next_use(&self, page: u64, r: usize) -> u64 {
        if page & PRIVATE != 0 {
            return NEVER;
        }
        let (chain, k) = ((page / self.pages_per_block as u64) as usize, (page % self.pages_per_block as u64) as u16);
        let list = &self.uses[chain];
        let from = list.partition_point(|&(s, _)| s as usize <= r);
        list[from..].iter().find(|&&(_, covered)| covered > k).map_or(NEVER, |&(s, _)| s as u64)
    }
}

#[derive(Clone, Debug, Default)]
struct Node {
    parent: u32,
    pages: Vec<u64>,
    children: u32,
    lock: u32,
    last_access: u64,
    hit_count: u64,
    /// The key it is in the eviction set under, when it is there.
    key: Option<(u64, u64)>,
    /// The request at which its next use comes within the window
    /// ([`SimPolicy::ReturnWithin`]), while it waits in the eviction set for that.
    due: Option<u64>,
    /// [`SimPolicy::Lhd`]: the request of its last match, its conversation depth,
    /// whether it is the tail left by a split, its index in the leaves to draw from.
    last_request: u64,
    depth: u8,
    remainder: bool,
    drawn_at: Option<u32>,
}

/// Counters of a model run, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SimTotals {
    pub served: u64,
    pub rejected: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    pub output_tokens: u64,
    pub evicted_tokens: u64,
    pub peak_used_tokens: u64,
    pub final_cached_tokens: u64,
}

/// The page-level model of the sequential replay.
#[derive(Clone)]
pub(crate) struct Sim<'u> {
    uses: &'u Uses,
    policy: SimPolicy,
    partial: bool,
    capacity_pages: usize,
    free_pages: usize,
    evictable_pages: usize,
    cached_pages: usize,
    nodes: Vec<Node>,
    free_ids: Vec<u32>,
    children: HashMap<(u32, u64), u32>,
    order: BTreeSet<(u64, u64, u32)>,
    /// (due request, leaf): the promotions of [`SimPolicy::ReturnWithin`].
    pending: BTreeSet<(u64, u32)>,
    /// Test only: re-key every leaf at every request (the promotions' reference).
    #[cfg(test)]
    rekey_all: bool,
    clock: u64,
    now: usize,
    private_next: u64,
    totals: SimTotals,
    /// [`SimPolicy::Lhd`]'s learned state.
    lhd: Option<Box<Lhd>>,
}

/// Picks the victim among the `n` evictable leaves (in the policy's order); `None`
/// means the policy's first.
pub(crate) type Chooser<'a> = &'a mut dyn FnMut(usize) -> usize;

impl<'u> Sim<'u> {
    fn new(uses: &'u Uses, capacity_tokens: usize, policy: SimPolicy, partial: bool) -> Self {
        let root = Node { lock: 1, ..Node::default() };
        let capacity_pages = capacity_tokens / uses.ps;
        Sim {
            uses,
            policy,
            partial,
            capacity_pages,
            free_pages: capacity_pages,
            evictable_pages: 0,
            cached_pages: 0,
            nodes: vec![root],
            free_ids: Vec::new(),
            children: HashMap::new(),
            order: BTreeSet::new(),
            pending: BTreeSet::new(),
            #[cfg(test)]
            rekey_all: false,
            clock: 0,
            now: 0,
            private_next: 0,
            totals: SimTotals::default(),
            lhd: match policy {
                SimPolicy::Lhd(v) => Some(Box::new(Lhd::new(v))),
                _ => None,
            },
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The leaf's key in the eviction order (smallest first), and for
    /// [`SimPolicy::ReturnWithin`] the request at which it is to be re-keyed.
    fn key(&self, id: u32) -> ((u64, u64), Option<u64>) {
        let n = &self.nodes[id as usize];
        // Partial: pages go from the tail, so the tail page's next use counts; whole:
        // any use of a leaf uses its first page.
        let next = || {
            let page = if self.partial { *n.pages.last().unwrap_or(&PRIVATE) } else { n.pages[0] };
            self.uses.next_use(page, self.now)
        };
        match self.policy {
            SimPolicy::Lru => ((0, n.last_access), None),
            SimPolicy::Lfu => ((n.hit_count, n.last_access), None),
            // The set only holds the leaves; the victim is drawn (`lhd_victim`).
            SimPolicy::Lhd(_) => ((0, n.last_access), None),
            SimPolicy::Optimal => ((NEVER - next(), n.last_access), None),
            SimPolicy::Return => ((u64::from(next() != NEVER), n.last_access), None),
            SimPolicy::ReturnWithin(w) => {
                let next = next();
                let soon = next <= (self.now as u64).saturating_add(w);
                let due = (!soon && next != NEVER).then(|| next - w);
                ((u64::from(soon), n.last_access), due)
            }
        }
    }

    fn push(&mut self, id: u32) {
        let (k, due) = self.key(id);
        let n = &mut self.nodes[id as usize];
        n.key = Some(k);
        n.due = due;
        self.order.insert((k.0, k.1, id));
        if let Some(d) = due {
            self.pending.insert((d, id));
        }
        if let Some(lhd) = &mut self.lhd {
            self.nodes[id as usize].drawn_at = Some(lhd.leaves.len() as u32);
            lhd.leaves.push(id);
        }
    }

    fn remove(&mut self, id: u32) {
        let n = &mut self.nodes[id as usize];
        if let Some(k) = n.key.take() {
            self.order.remove(&(k.0, k.1, id));
        }
        if let Some(d) = n.due.take() {
            self.pending.remove(&(d, id));
        }
        if let (Some(i), Some(lhd)) = (n.drawn_at.take(), &mut self.lhd) {
            lhd.leaves.swap_remove(i as usize);
            if let Some(&moved) = lhd.leaves.get(i as usize) {
                self.nodes[moved as usize].drawn_at = Some(i);
            }
        }
    }

    /// [`SimPolicy::Lhd`]: the leaf's class and age.
    fn lhd_class_age(lhd: &Lhd, n: &Node, now: usize) -> (usize, u64) {
        (lhd.class(n.depth, n.remainder), now as u64 - n.last_request)
    }

    /// [`SimPolicy::Lhd`]'s victim: the least dense of `SAMPLES` drawn leaves (all of
    /// them when fewer), with the queue's leaves last, the least recently used on a tie.
    fn lhd_victim(&mut self) -> u32 {
        let lhd = self.lhd.as_mut().expect("an LHD run");
        let n = lhd.leaves.len();
        let mut best = (f64::INFINITY, u64::MAX, u32::MAX);
        for k in 0..n.min(lhd::SAMPLES) {
            let i = if n <= lhd::SAMPLES { k } else { lhd.draw() };
            let node = &self.nodes[lhd.leaves[i] as usize];
            let (class, age) = Self::lhd_class_age(lhd, node, self.now);
            let queued = lhd.variant == LhdVariant::Queue
                && self.uses.next_use(node.pages[0], self.now) <= self.now as u64 + QUEUE;
            let density = if queued { f64::MAX } else { lhd.density(class, age) };
            if (density, node.last_access) < (best.0, best.1) {
                best = (density, node.last_access, lhd.leaves[i]);
            }
        }
        best.2
    }

    /// Re-key the leaves whose next use has come within the window by request `now`.
    fn promote(&mut self) {
        #[cfg(test)]
        if self.rekey_all {
            let ids: Vec<u32> = self.order.iter().map(|&(.., id)| id).collect();
            for id in ids {
                self.remove(id);
                self.push(id);
            }
            return;
        }
        while let Some(&(due, id)) = self.pending.first() {
            if due > self.now as u64 {
                break;
            }
            self.remove(id);
            self.push(id);
            // Its use is now within the window: it cannot come due again (no endless loop).
            assert!(
                !matches!(self.nodes[id as usize].due, Some(d) if d <= self.now as u64),
                "a promotion that does not promote"
            );
        }
    }

    /// Re-sort `id` after its recency changed (only leaves are in the order).
    fn touch(&mut self, id: u32) {
        let t = self.tick();
        self.nodes[id as usize].last_access = t;
        if self.nodes[id as usize].key.is_some() {
            self.remove(id);
            self.push(id);
        }
    }

    fn new_node(&mut self, node: Node) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() as u32 - 1
            }
        }
    }

    /// Cut `id` after `m` pages; returns the new upper node (`id` stays the lower).
    fn split(&mut self, id: u32, m: usize) -> u32 {
        let t = self.tick();
        let old = &self.nodes[id as usize];
        let upper = Node {
            parent: old.parent,
            pages: old.pages[..m].to_vec(),
            children: 1,
            lock: old.lock,
            last_access: t,
            hit_count: old.hit_count,
            key: None,
            due: None,
            last_request: old.last_request,
            depth: old.depth,
            remainder: old.remainder,
            drawn_at: None,
        };
        let (parent, first) = (old.parent, old.pages[0]);
        let u = self.new_node(upper);
        let lower = &mut self.nodes[id as usize];
        lower.pages.drain(..m);
        // A leaf a later request matched only part of: its tail is a remainder.
        lower.remainder |= lower.children == 0;
        lower.parent = u;
        let lower_first = lower.pages[0];
        self.children.insert((parent, first), u);
        self.children.insert((u, lower_first), id);
        if self.nodes[id as usize].key.is_some() {
            // A leaf's key may depend on its pages.
            self.remove(id);
            self.push(id);
        }
        u
    }

    /// Match request `r`'s whole prompt pages, splitting at the end, as kvpool's
    /// `match_path`; returns (pages matched, last node).
    fn match_prompt(&mut self, r: usize, pages: usize) -> (usize, u32) {
        if pages == 0 {
            return (0, ROOT);
        }
        self.touch(ROOT);
        let (mut pos, mut cur) = (0usize, ROOT);
        while pos < pages {
            let Some(&id) = self.children.get(&(cur, self.uses.page(r, pos))) else { break };
            if let Some(lhd) = &mut self.lhd {
                let node = &mut self.nodes[id as usize];
                if node.drawn_at.is_some() {
                    // A hit on an evictable leaf ends its time as one: learn from it.
                    let (class, age) = Self::lhd_class_age(lhd, node, self.now);
                    lhd.hit(class, age);
                }
                node.last_request = self.now as u64;
            }
            self.nodes[id as usize].hit_count += 1;
            self.touch(id);
            let n = self.nodes[id as usize].pages.len();
            let mut m = 1;
            while m < n && pos + m < pages && self.nodes[id as usize].pages[m] == self.uses.page(r, pos + m) {
                m += 1;
            }
            pos += m;
            if m < n {
                cur = self.split(id, m);
                break;
            }
            cur = id;
        }
        (pos, cur)
    }

    fn lock(&mut self, mut id: u32, inc: bool) {
        while id != ROOT {
            let len = self.nodes[id as usize].pages.len();
            let n = &mut self.nodes[id as usize];
            if inc {
                if n.lock == 0 {
                    self.evictable_pages -= len;
                    self.remove(id);
                }
                self.nodes[id as usize].lock += 1;
            } else {
                n.lock -= 1;
                if n.lock == 0 {
                    self.evictable_pages += len;
                    if n.children == 0 {
                        self.push(id);
                    }
                }
            }
            id = self.nodes[id as usize].parent;
        }
    }

    /// Free at least `need` pages (exactly `need` when partial) from unlocked leaves.
    fn evict(&mut self, need: usize, choose: &mut Option<Chooser<'_>>) -> usize {
        let mut freed = 0;
        while freed < need && !self.order.is_empty() {
            let pick = match choose {
                Some(f) => f(self.order.len()),
                None => 0,
            };
            let x = match (&self.lhd, &choose) {
                (Some(_), None) => self.lhd_victim(),
                _ => *self.order.iter().nth(pick).map(|(.., x)| x).expect("the chooser picks an evictable leaf"),
            };
            if let Some(lhd) = &mut self.lhd {
                let (class, age) = Self::lhd_class_age(lhd, &self.nodes[x as usize], self.now);
                lhd.evicted(class, age);
            }
            self.remove(x);
            let len = self.nodes[x as usize].pages.len();
            // Partial: the optimum and the oracles take one page at a time (and re-sort
            // the leaf by its new tail); LRU and LFU cut the whole shortfall at once, as
            // kvpool.
            let cut = if !self.partial {
                len
            } else if !matches!(self.policy, SimPolicy::Lru | SimPolicy::Lfu) || choose.is_some() {
                1
            } else {
                (need - freed).min(len)
            };
            freed += cut;
            self.free_pages += cut;
            self.evictable_pages -= cut;
            self.cached_pages -= cut;
            if cut < len {
                let n = &mut self.nodes[x as usize];
                n.pages.truncate(len - cut);
                // The shortened leaf keeps its order fields (kvpool's split ticks once).
                self.tick();
                self.push(x);
                continue;
            }
            let n = std::mem::take(&mut self.nodes[x as usize]);
            self.children.remove(&(n.parent, n.pages[0]));
            self.free_ids.push(x);
            let p = n.parent;
            self.nodes[p as usize].children -= 1;
            let pn = &self.nodes[p as usize];
            if p != ROOT && pn.children == 0 && pn.lock == 0 {
                self.push(p);
            }
        }
        self.totals.evicted_tokens += (freed * self.uses.ps) as u64;
        freed
    }

    fn make_room(&mut self, need: usize, choose: &mut Option<Chooser<'_>>) {
        if need > self.free_pages && need - self.free_pages <= self.evictable_pages {
            self.evict(need - self.free_pages, choose);
        }
    }

    fn alloc(&mut self, pages: usize) -> bool {
        if pages > self.free_pages {
            return false;
        }
        self.free_pages -= pages;
        let used = (self.capacity_pages - self.free_pages) * self.uses.ps;
        self.totals.peak_used_tokens = self.totals.peak_used_tokens.max(used as u64);
        true
    }

    /// Serve request `r` as the sequential driver does.
    fn request(&mut self, trace: &Trace, r: usize, choose: &mut Option<Chooser<'_>>) {
        let ps = self.uses.ps;
        let q = trace.request(r);
        let (prompt, kv_len) = (q.input_length as usize, q.kv_len());
        self.now = r;
        self.promote();
        if kv_len.div_ceil(ps) > self.capacity_pages {
            self.totals.rejected += 1;
            return;
        }
        let (hit, end) = self.match_prompt(r, prompt / ps);
        self.lock(end, true);
        let mut held = 0;
        let mut ok = true;
        let need = prompt.div_ceil(ps) - hit;
        self.make_room(need, choose);
        if self.alloc(need) {
            held += need;
            for seq in prompt + 1..=kv_len {
                if (seq - 1) % ps == 0 {
                    self.make_room(1, choose);
                    if !self.alloc(1) {
                        ok = false;
                        break;
                    }
                    held += 1;
                }
            }
        } else {
            ok = false;
        }
        if !ok {
            self.free_pages += held;
            self.lock(end, false);
            self.totals.rejected += 1;
            return;
        }
        // cache_finished_req: touch the cached path, add the new leaf, free the tail.
        let aligned = kv_len / ps;
        self.touch(ROOT);
        let mut path = Vec::new();
        let mut x = end;
        while x != ROOT {
            path.push(x);
            x = self.nodes[x as usize].parent;
        }
        for &id in path.iter().rev() {
            self.touch(id);
        }
        if aligned > hit {
            let whole_prompt = prompt / ps;
            let pages: Vec<u64> = (hit..aligned)
                .map(|i| {
                    if i < whole_prompt {
                        self.uses.page(r, i)
                    } else {
                        self.private_next += 1;
                        PRIVATE | self.private_next
                    }
                })
                .collect();
            let t = self.tick();
            let first = pages[0];
            // As `EvictionPolicy::Reuse`: under a node with at most one resident child
            // (this request's own leftover tail) the leaf extends that conversation.
            let pe = &self.nodes[end as usize];
            let depth = if end != ROOT && pe.children <= 1 { pe.depth.saturating_add(1).min(7) } else { 0 };
            let id = self.new_node(Node {
                parent: end,
                pages,
                children: 0,
                lock: 0,
                last_access: t,
                hit_count: 0,
                key: None,
                due: None,
                last_request: r as u64,
                depth,
                remainder: false,
                drawn_at: None,
            });
            self.children.insert((end, first), id);
            self.nodes[end as usize].children += 1;
            self.remove(end);
            self.evictable_pages += aligned - hit;
            self.cached_pages += aligned - hit;
            // The new leaf's next use is after this request.
            self.push(id);
        }
        self.free_pages += held - (aligned - hit);
        self.lock(end, false);
        self.totals.served += 1;
        self.totals.prompt_tokens += prompt as u64;
        self.totals.hit_tokens += (hit * ps) as u64;
        self.totals.output_tokens += q.output_length as u64;
    }

    fn run(mut self, trace: &Trace, choose: &mut Option<Chooser<'_>>) -> SimTotals {
        for r in 0..trace.len() {
            if let Some(lhd) = &mut self.lhd {
                if (r + 1) % lhd::PERIOD == 0 {
                    lhd.recompute();
                }
            }
            self.request(trace, r, choose);
        }
        self.totals.final_cached_tokens = (self.cached_pages * self.uses.ps) as u64;
        self.totals
    }
}

/// Check that the model can run `config` on `trace`: a page size dividing the blocks.
fn check(config: &ReplayConfig) -> Result<usize, ReplayError> {
    let ps = config.page_size as usize;
    if ps == 0 || BLOCK_TOKENS as usize % ps != 0 {
        return Err(ReplayError::Config(format!(
            "--policy optimal needs a --page-size that divides the trace's {BLOCK_TOKENS}-token blocks \
             (1, 2, 4, ... 512), not {ps}"
        )));
    }
    if config.ceiling.label(config.partial_evict).is_none() && matches!(config.ceiling, Ceiling::Lhd(_)) {
        return Err(ReplayError::Config(format!(
            "--policy {} models whole-leaf eviction only (no --partial-evict)",
            config.ceiling.label(false).unwrap_or("model-lhd")
        )));
    }
    if config.ceiling.label(false).is_none() {
        return Err(ReplayError::Config(format!(
            "{:?}: the window must be a power of two from 1 to {MAX_RETURN_WINDOW}",
            config.ceiling
        )));
    }
    Ok(ps)
}

/// Run the page-level model of the sequential replay under `policy`.
pub(crate) fn simulate(
    trace: &Trace,
    config: &ReplayConfig,
    policy: SimPolicy,
    choose: &mut Option<Chooser<'_>>,
) -> Result<SimTotals, ReplayError> {
    let ps = check(config)?;
    let uses = Uses::new(trace, ps, config.capacity_tokens / ps);
    Ok(Sim::new(&uses, config.capacity_tokens, policy, config.partial_evict).run(trace, choose))
}

/// `kvpool replay --policy optimal` (or `oracle-return[-W]`: the model
/// [`ReplayConfig::ceiling`](super::ReplayConfig::ceiling) names): the offline optimum
/// of the sequential replay or an informed ceiling (see the module docs), as a
/// [`Report`] (no latencies: nothing is timed but the whole).
///
/// # Errors
///
/// [`ReplayError::Config`] for a page size that does not divide 512, or a window
/// [`Ceiling::from_name`] rejects.
pub fn run_optimal(trace: &Trace, config: &ReplayConfig) -> Result<Report, ReplayError> {
    config.validate(trace)?;
    let start = Instant::now();
    let t = simulate(trace, config, config.ceiling.sim(), &mut None)?;
    let wall = start.elapsed().as_secs_f64();
    let hist = Histograms::default();
    let requests = t.served + t.rejected;
    let rate = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
    Ok(Report {
        requests,
        rejected: t.rejected,
        prompt_tokens: t.prompt_tokens,
        hit_tokens: t.hit_tokens,
        hit_rate: if t.prompt_tokens > 0 { t.hit_tokens as f64 / t.prompt_tokens as f64 } else { 0.0 },
        computed_tokens: t.prompt_tokens - t.hit_tokens,
        output_tokens: t.output_tokens,
        evicted_tokens: t.evicted_tokens,
        peak_used_tokens: t.peak_used_tokens,
        final_cached_tokens: t.final_cached_tokens,
        wall_seconds: wall,
        requests_per_second: rate(requests as f64),
        tokens_per_second: rate((t.prompt_tokens + t.output_tokens) as f64),
        latency_ns: super::Latencies {
            match_: hist.match_.summary(),
            alloc_extend: hist.alloc_extend.summary(),
            alloc_decode: hist.alloc_decode.summary(),
            finish: hist.finish.summary(),
            route: None,
        },
        mode: "sequential",
        cache: "optimal (offline model)",
        policy: config.ceiling.label(config.partial_evict).expect("checked by simulate"),
        page_size: config.page_size,
        capacity_tokens: config.capacity_tokens as u64,
        max_running: 1,
        routers: 0,
        retracted: 0,
        router_matches: 0,
        router_hit_tokens: 0,
        invariants_ok: true,
        timeline: Vec::new(),
        hybrid: None,
        swa: None,
        host: None,
        store: None,
    })
}

/// The model's counterpart of a kvpool policy, for the checks against the real replay.
#[cfg(test)]
pub(crate) fn sim_policy(p: EvictionPolicy) -> Option<SimPolicy> {
    match p {
        EvictionPolicy::Lru => Some(SimPolicy::Lru),
        EvictionPolicy::Lfu => Some(SimPolicy::Lfu),
        _ => None,
    }
}

mod lhd;
#[cfg(test)]
mod tests;
