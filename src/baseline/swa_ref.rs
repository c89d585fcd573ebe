//! [`ReferenceSwaCache`]: a deliberately simple, single-threaded model of
//! [`SwaRadixCache`](crate::radix::SwaRadixCache) (SGLang's `SWARadixCache`), over its
//! own model of the dual pools ([`RefDualPool`]).
//!
//! The shape of SGLang's tree: nodes in a vector, children in a `HashMap`, keys and
//! values (full slots) in `Vec`s, a tombstone flag, a full and a window lock count per
//! node, a logical clock; every eviction picks its victim by scanning all nodes, every
//! size is recounted from the nodes. It allocates freely and takes `&mut self`. It is
//! what `SwaRadixCache` is tested against (`tests/swa_tree_model.rs`, the `swa_ops`
//! fuzz target, both through `kvpool::models::swa` with feature `models`).
//!
//! # The dual pools
//!
//! Two bitmaps of pages (full and window, page 0 reserved in each), lowest free page
//! first, as [`SwaAllocator`](crate::alloc::SwaAllocator)'s two `PagedAllocator`s hand
//! them out; an allocation of `n` pages takes the `n` lowest free pages of each pool
//! (but for the slot pool's placement of large claims over sparse words) or
//! nothing, and maps the `i`-th full page to the `i`-th window page. The mapping is kept
//! per full page (0: no window part). `free` releases both parts of each distinct page,
//! `free_swa` the window part only.
//!
//! # Semantics (those of `kvpool::radix::swa`'s module docs, with SGLang's for what they
//! leave open)
//!
//! * A node is a **tombstone** when its pages have no window part; a live node has it for
//!   every page. A leaf is never a tombstone.
//! * **Match**: walk as far as the KV matches (each node reached gets one hit; a node the
//!   match ends inside is split). A counter of tokens since the last tombstone (infinite
//!   before the first) restarts at 0 on every tombstone and grows by each live node's
//!   matched tokens; the result is the deepest node end (or split point) where it is at
//!   least `window`. Then the result's path is touched, the root first (oldest); a match
//!   of an empty key touches nothing. **Peek** applies the same rule without splitting
//!   or touching.
//! * **Split**: the upper node is new (stamped once), with the lower node's tombstone
//!   flag, window lock, full lock and hits; then the lower node (which keeps its
//!   identity) is touched.
//! * **Lock**: the full lock of every node from the end up to the root; the window lock
//!   of whole nodes from the end up until they cover `window` tokens, stopping at a
//!   tombstone. The lease remembers how many tokens its window lock covers.
//! * **Full pass** (`evict`): unlocked leaves in policy order, each removed with its
//!   full and window KV, then each parent left a childless unlocked tombstone.
//! * **Window pass** (`evict_swa`): the least recently touched live node without a window
//!   lock: an internal one becomes a tombstone (its window KV freed), a leaf is removed
//!   as by the full pass. `evict_both(f, w)` runs the full pass for `f` and then the
//!   window pass for what the full pass left of `w` (counting the window KV of the live
//!   nodes it removed). Allocation runs `evict_both` with each pool's shortfall.
//! * **Insert** (raw or a request's): the key is first cut so that its last page has a
//!   window part (not below the lease). The root and each node walked are touched, the
//!   node the cached part ends inside is split, a new leaf is stamped. Then, along the
//!   cached part beyond the lease, each tombstone is revived with the request's window
//!   pages (the tree's page takes the request's window page), from after the last
//!   page the request cannot give (no window part, or not the caller's): when that is
//!   not the node's last page, the node is split there and the lower part revived;
//!   otherwise it stays a tombstone. Last, the new leaf's pages up to its last page
//!   without a window part become a tombstone above the live rest (a split).
//! * **Requests**: `cache_finished_req` inserts (as above), frees the duplicates beyond
//!   the lease and everything past the inserted length, and unlocks;
//!   `cache_unfinished_req` inserts, frees the duplicates, re-matches the inserted key
//!   (touching as a match does), rewrites the request's slots with the tree's, and
//!   moves its lease to the node where the inserted key ends (the window rule does not
//!   apply: the request holds that KV). `release_window` frees the window part of the
//!   request's own whole pages in a token range past its lease's end.
//! * Every touch and every creation is one tick of the clock, so timestamps are
//!   distinct and both eviction orders are deterministic.

use std::collections::{HashMap, HashSet};

use crate::error::ConfigError;
use crate::radix::{CacheError, EvictionPolicy, SwaInsert};

use super::RefNodeId;

/// A model of [`SwaAllocator`](crate::alloc::SwaAllocator): two bitmaps of pages and
/// the full-to-window mapping, per page (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct RefDualPool {
    ps: usize,
    /// `full[p]`: full page `p` is allocated (index 0 unused).
    full: Vec<bool>,
    /// `window[w]`: window page `w` is allocated (index 0 unused).
    window: Vec<bool>,
    /// `map[p]`: full page `p`'s window page, 0 for none.
    map: Vec<u32>,
}

impl RefDualPool {
    /// Pools of `full_tokens` and `window_tokens` (whole pages of `ps`).
    pub fn new(full_tokens: usize, window_tokens: usize, ps: usize) -> Self {
        let (f, w) = (full_tokens / ps, window_tokens / ps);
        RefDualPool { ps, full: vec![false; f + 1], window: vec![false; w + 1], map: vec![0; f + 1] }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.ps
    }

    /// Pages of the full pool.
    pub fn full_pages(&self) -> usize {
        self.full.len() - 1
    }

    /// Free tokens of the full pool.
    pub fn full_available(&self) -> usize {
        self.full.iter().skip(1).filter(|&&a| !a).count() * self.ps
    }

    /// Free tokens of the window pool.
    pub fn window_available(&self) -> usize {
        self.window.iter().skip(1).filter(|&&a| !a).count() * self.ps
    }

    /// Whether the page of `slot` is allocated in the full pool.
    pub fn is_allocated(&self, slot: u32) -> bool {
        self.full.get(slot as usize / self.ps).is_some_and(|&a| a) && slot as usize >= self.ps
    }

    /// Full page `page`'s window page (0: none).
    pub fn window_page(&self, page: u32) -> u32 {
        self.map.get(page as usize).copied().unwrap_or(0)
    }

    /// Take `n` pages of each pool, lowest first (with the slot pool's placement of
    /// claims of 64 or more, see `kvpool::slots`), the `i`-th full page mapped to the
    /// `i`-th window page; `None` (nothing taken) when either pool has fewer free.
    pub fn alloc_pages(&mut self, n: usize) -> Option<Vec<u32>> {
        let take = |v: &[bool]| {
            let free = (1..v.len()).filter(|&p| !v[p]).map(|p| p as u32);
            (free.clone().count() >= n).then(|| crate::slots::placement(free, n))
        };
        let (f, w) = (take(&self.full)?, take(&self.window)?);
        for (&p, &q) in f.iter().zip(&w) {
            self.full[p as usize] = true;
            self.window[q as usize] = true;
            self.map[p as usize] = q;
        }
        Some(f)
    }

    /// `n` tokens (whole pages): the slots of fresh pages, or `None`.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        assert_eq!(n % self.ps, 0, "a model alloc of a partial page");
        let pages = self.alloc_pages(n / self.ps)?;
        let ps = self.ps as u32;
        Some(pages.iter().flat_map(|&p| (0..ps).map(move |k| p * ps + k)).collect())
    }

    fn pages_of(&self, slots: &[u32]) -> Vec<usize> {
        let mut pages: Vec<usize> = slots.iter().map(|&s| s as usize / self.ps).collect();
        pages.dedup();
        pages
    }

    /// Free both parts of the distinct pages of `slots`.
    ///
    /// # Panics
    ///
    /// If a page is not allocated (the driver frees only what it owns).
    pub fn free(&mut self, slots: &[u32]) {
        for p in self.pages_of(slots) {
            assert!(p != 0 && self.full[p], "model free of page {p}, which is not allocated");
            self.full[p] = false;
            self.release(p);
        }
    }

    /// Free the window part of the distinct pages of `slots`; returns the window tokens
    /// freed.
    pub fn free_swa(&mut self, slots: &[u32]) -> usize {
        self.pages_of(slots).into_iter().map(|p| self.release(p)).sum()
    }

    /// Release full page `p`'s window page, if any; returns the window tokens freed.
    fn release(&mut self, p: usize) -> usize {
        let w = std::mem::take(&mut self.map[p]) as usize;
        if w == 0 {
            return 0;
        }
        assert!(self.window[w], "model window page {w} mapped but free");
        self.window[w] = false;
        self.ps
    }
}

#[derive(Debug)]
struct Node {
    parent: usize,
    children: HashMap<(u64, Vec<u32>), usize>,
    namespace: u64,
    key: Vec<u32>,
    value: Vec<u32>,
    tomb: bool,
    lock_ref: u32,
    swa_lock: u32,
    last_access: u64,
    created: u64,
    hit_count: u64,
    alive: bool,
}

/// A lease of the model: the node it ends at, the tokens it protects, and the tokens
/// its window lock covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefSwaLease {
    /// The node (the root for an empty lease).
    pub node: RefNodeId,
    /// Tokens protected (`Lease::len`).
    pub len: usize,
    /// Tokens whose window KV it locks.
    pub window: usize,
}

/// What [`ReferenceSwaCache::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefSwaMatch {
    /// The usable prefix (the window rule).
    pub len: usize,
    /// Its node (the root when `len` is 0).
    pub node: RefNodeId,
    /// The node where the KV match ends.
    pub kv_node: RefNodeId,
    /// The slots of the whole KV match (at least `len`).
    pub slots: Vec<u32>,
}

/// The sizes of a cache, in one tuple to compare: (total, evictable, protected),
/// (swa evictable, swa protected, tombstone tokens), (free full, free window, nodes).
pub type SwaSizes = ((usize, usize, usize), (usize, usize, usize), (usize, usize, usize));

/// A simple model of [`SwaRadixCache`](crate::radix::SwaRadixCache) (see the module
/// docs).
#[derive(Debug)]
pub struct ReferenceSwaCache {
    pool: RefDualPool,
    ps: usize,
    window: usize,
    policy: EvictionPolicy,
    nodes: Vec<Node>,
    clock: u64,
}

const ROOT: usize = 0;

impl ReferenceSwaCache {
    /// An empty cache over `pool`, for a window of `window` tokens; `policy` orders the
    /// full pass (the window pass is always LRU).
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::swa_ref::{RefDualPool, ReferenceSwaCache};
    /// use kvpool::radix::EvictionPolicy;
    /// let mut c = ReferenceSwaCache::new(RefDualPool::new(16, 8, 1), 2, EvictionPolicy::Lru)?;
    /// let a = c.alloc(4).unwrap();
    /// c.insert(0, &[1, 2, 3, 4], &a);
    /// let b = c.alloc(4).unwrap();
    /// assert_eq!(c.insert(0, &[1, 2, 5, 6], &b).cached, 2);
    /// c.pool_mut().free(&b[..2]); // the duplicates
    /// assert_eq!(c.evict_swa(1), 2); // [1, 2] is the oldest: a tombstone
    /// assert_eq!(c.match_prefix(0, &[1, 2]).len, 0);
    /// assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).len, 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a window of 0 tokens.
    pub fn new(pool: RefDualPool, window: usize, policy: EvictionPolicy) -> Result<Self, ConfigError> {
        if window == 0 {
            return Err(ConfigError::Zero("the sliding window"));
        }
        let root = Node {
            parent: ROOT,
            children: HashMap::new(),
            namespace: 0,
            key: Vec::new(),
            value: Vec::new(),
            tomb: false,
            lock_ref: 1,
            swa_lock: 0,
            last_access: 0,
            created: 0,
            hit_count: 0,
            alive: true,
        };
        let ps = pool.page_size();
        Ok(ReferenceSwaCache { pool, ps, window, policy, nodes: vec![root], clock: 0 })
    }

    /// The dual pools.
    pub fn pool(&self) -> &RefDualPool {
        &self.pool
    }

    /// The dual pools, to allocate or free outside the tree (what the driver owns).
    pub fn pool_mut(&mut self) -> &mut RefDualPool {
        &mut self.pool
    }

    /// The root node.
    pub fn root(&self) -> RefNodeId {
        RefNodeId(ROOT)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn touch(&mut self, n: usize) {
        let t = self.tick();
        self.nodes[n].last_access = t;
    }

    fn child_key(&self, namespace: u64, key: &[u32]) -> (u64, Vec<u32>) {
        (namespace, key[..self.ps.min(key.len())].to_vec())
    }

    fn key_match(&self, a: &[u32], b: &[u32]) -> usize {
        let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        same / self.ps * self.ps
    }

    fn path(&self, mut n: usize) -> Vec<usize> {
        let mut path = vec![n];
        while n != ROOT {
            n = self.nodes[n].parent;
            path.push(n);
        }
        path.reverse();
        path
    }

    fn pages(&self, n: usize) -> Vec<u32> {
        self.nodes[n].value.iter().step_by(self.ps).map(|&s| s / self.ps as u32).collect()
    }

    /// Cut `child` after `at` tokens: a new upper node (stamped now) with its tombstone
    /// flag and locks, then `child` keeps the lower part and is touched.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let t = self.tick();
        let id = self.nodes.len();
        let c = &mut self.nodes[child];
        let upper_key: Vec<u32> = c.key.drain(..at).collect();
        let upper_value: Vec<u32> = c.value.drain(..at).collect();
        let (parent, namespace) = (c.parent, c.namespace);
        let (tomb, lock_ref, swa_lock, hit_count) = (c.tomb, c.lock_ref, c.swa_lock, c.hit_count);
        c.parent = id;
        let lower_ck = (namespace, c.key[..self.ps].to_vec());
        let upper_ck = (namespace, upper_key[..self.ps].to_vec());
        self.nodes.push(Node {
            parent,
            children: HashMap::from([(lower_ck, child)]),
            namespace,
            key: upper_key,
            value: upper_value,
            tomb,
            lock_ref,
            swa_lock,
            last_access: t,
            created: t,
            hit_count,
            alive: true,
        });
        self.nodes[parent].children.insert(upper_ck, id);
        self.touch(child);
        id
    }

    /// The window rule's counter, entering a node with `tokens` matched tokens: whether
    /// the match may end after them.
    fn step(&self, since: &mut usize, tomb: bool, tokens: usize) -> bool {
        if tomb {
            *since = 0;
            return false;
        }
        *since = since.saturating_add(tokens);
        *since >= self.window
    }

    /// SGLang's `match_prefix` with the window rule (see the module docs); `key` is cut
    /// to whole pages.
    pub fn match_prefix(&mut self, namespace: u64, key: &[u32]) -> RefSwaMatch {
        let key = &key[..key.len() / self.ps * self.ps];
        let mut slots = Vec::new();
        if key.is_empty() {
            return RefSwaMatch { len: 0, node: RefNodeId(ROOT), kv_node: RefNodeId(ROOT), slots };
        }
        let (mut best, mut best_len, mut since) = (ROOT, 0, usize::MAX);
        let (mut node, mut rest) = (ROOT, key);
        while !rest.is_empty() {
            let ck = self.child_key(namespace, rest);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.nodes[child].hit_count += 1;
            let n = self.key_match(&self.nodes[child].key, rest);
            let partial = n < self.nodes[child].key.len();
            node = if partial { self.split(child, n) } else { child };
            slots.extend_from_slice(&self.nodes[node].value);
            rest = &rest[n..];
            if self.step(&mut since, self.nodes[node].tomb, n) {
                (best, best_len) = (node, slots.len());
            }
            if partial {
                break;
            }
        }
        for n in self.path(best) {
            self.touch(n);
        }
        RefSwaMatch { len: best_len, node: RefNodeId(best), kv_node: RefNodeId(node), slots }
    }

    /// The lock-free lookup: the usable prefix's slots (the window rule), nothing
    /// changes.
    pub fn peek(&self, namespace: u64, key: &[u32]) -> Vec<u32> {
        let mut rest = &key[..key.len() / self.ps * self.ps];
        let (mut node, mut slots, mut best, mut since) = (ROOT, Vec::new(), 0, usize::MAX);
        while !rest.is_empty() {
            let Some(&child) = self.nodes[node].children.get(&self.child_key(namespace, rest)) else { break };
            let n = self.key_match(&self.nodes[child].key, rest);
            slots.extend_from_slice(&self.nodes[child].value[..n]);
            if self.step(&mut since, self.nodes[child].tomb, n) {
                best = slots.len();
            }
            if n < self.nodes[child].key.len() {
                break;
            }
            rest = &rest[n..];
            node = child;
        }
        slots.truncate(best);
        slots
    }

    /// Lock `node`: the window part first (whole nodes up to `window` tokens, stopping
    /// at a tombstone), then the full path. Returns the lease.
    pub fn lock(&mut self, node: RefNodeId, len: usize) -> RefSwaLease {
        let (mut x, mut acc) = (node.0, 0);
        while x != ROOT && acc < self.window && !self.nodes[x].tomb {
            self.nodes[x].swa_lock += 1;
            acc += self.nodes[x].value.len();
            x = self.nodes[x].parent;
        }
        let mut x = node.0;
        while x != ROOT {
            self.nodes[x].lock_ref += 1;
            x = self.nodes[x].parent;
        }
        RefSwaLease { node, len, window: acc }
    }

    /// Whether a lease may be taken at `node`: alive, and the last `window` tokens of
    /// its path have their window KV.
    fn lockable(&self, node: usize) -> bool {
        if !self.nodes[node].alive {
            return false;
        }
        let (mut x, mut acc) = (node, 0);
        while x != ROOT && acc < self.window {
            if self.nodes[x].tomb {
                return false;
            }
            acc += self.nodes[x].value.len();
            x = self.nodes[x].parent;
        }
        true
    }

    /// Lock the node of an earlier match, if it still can be (see `lockable`).
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] otherwise; nothing changes.
    pub fn lock_match(&mut self, node: RefNodeId, len: usize) -> Result<RefSwaLease, CacheError> {
        if node.0 != ROOT && !self.lockable(node.0) {
            return Err(CacheError::StaleMatch);
        }
        Ok(self.lock(node, len))
    }

    /// Undo a [`lock`](Self::lock).
    ///
    /// # Panics
    ///
    /// If a count is already 0 (this is a test model).
    pub fn unlock(&mut self, lease: RefSwaLease) {
        let (mut x, mut acc) = (lease.node.0, 0);
        while acc < lease.window {
            let n = &mut self.nodes[x];
            assert!(x != ROOT && n.swa_lock > 0 && !n.tomb, "model window lock released twice");
            n.swa_lock -= 1;
            acc += n.value.len();
            x = n.parent;
        }
        assert_eq!(acc, lease.window, "a model window lock ends inside a node");
        let mut x = lease.node.0;
        while x != ROOT {
            assert!(self.nodes[x].lock_ref > 0, "model lock released twice");
            self.nodes[x].lock_ref -= 1;
            x = self.nodes[x].parent;
        }
    }

    fn in_tree(&self, page: u32) -> bool {
        self.nodes.iter().skip(1).filter(|n| n.alive).any(|n| n.value.iter().any(|&s| s / self.ps as u32 == page))
    }

    /// How much of `slots` (whole pages) an insert takes: up to its last page with a
    /// window part, never below `from`.
    fn live_len(&self, slots: &[u32], from: usize) -> usize {
        let mut end = slots.len() / self.ps * self.ps;
        while end > from && self.pool.window_page(slots[end - self.ps] / self.ps as u32) == 0 {
            end -= self.ps;
        }
        end
    }

    /// The tree part of an insert: touch the root and each node walked, split where the
    /// cached part ends, add a leaf for the rest. Returns (cached tokens, the node the
    /// key ends at).
    fn insert_walk(&mut self, namespace: u64, key: &[u32], value: &[u32]) -> (usize, usize) {
        self.touch(ROOT);
        let (mut node, mut pos) = (ROOT, 0);
        while pos < key.len() {
            let ck = self.child_key(namespace, &key[pos..]);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.touch(child);
            let n = self.key_match(&self.nodes[child].key, &key[pos..]);
            pos += n;
            if n < self.nodes[child].key.len() {
                node = self.split(child, n);
                break;
            }
            node = child;
        }
        if pos < key.len() {
            for &s in value[pos..].iter().step_by(self.ps) {
                let p = s / self.ps as u32;
                assert!(self.pool.is_allocated(s) && !self.in_tree(p), "model insert of page {p}, not the caller's");
            }
            let t = self.tick();
            let id = self.nodes.len();
            let ck = self.child_key(namespace, &key[pos..]);
            self.nodes.push(Node {
                parent: node,
                children: HashMap::new(),
                namespace,
                key: key[pos..].to_vec(),
                value: value[pos..].to_vec(),
                tomb: false,
                lock_ref: 0,
                swa_lock: 0,
                last_access: t,
                created: t,
                hit_count: 0,
                alive: true,
            });
            self.nodes[node].children.insert(ck, id);
            node = id;
        }
        (pos, node)
    }

    /// Free node `n`'s window part: it becomes a tombstone. Returns window tokens freed.
    fn tombstone(&mut self, n: usize) -> usize {
        let mut freed = 0;
        for p in self.pages(n) {
            freed += self.pool.release(p as usize);
        }
        self.nodes[n].tomb = true;
        freed
    }

    /// After an insert: revive tombstones beyond the lease with the request's window
    /// pages, then make the new leaf's part without window KV a tombstone.
    fn settle(&mut self, namespace: u64, key: &[u32], kv: &[u32], protected: usize, cached: usize, end: usize) {
        let ps = self.ps;
        let (mut pos, mut node, mut resplit) = (0, ROOT, false);
        while pos < cached {
            let ck = self.child_key(namespace, &key[pos..]);
            let x = self.nodes[node].children[&ck];
            let n = self.nodes[x].value.len();
            if pos >= protected && self.nodes[x].tomb {
                resplit |= self.revive_from(x, &kv[pos..pos + n]);
            }
            pos += n;
            node = x;
        }
        if resplit {
            // SGLang revives during its walk: the path stays ordered root (oldest) down.
            for n in self.path(end) {
                self.touch(n);
            }
        }
        if cached < key.len() {
            let new = &kv[cached..];
            let last_dead = (0..new.len() / ps).rev().find(|&i| self.pool.window_page(new[i * ps] / ps as u32) == 0);
            if let Some(i) = last_dead {
                let upper = self.split(end, (i + 1) * ps);
                self.tombstone(upper);
            }
        }
    }

    /// Revive tombstone `x` with the window pages of the request's duplicates `src`,
    /// from after the last page it cannot give (splitting there). Returns whether it
    /// split `x`.
    fn revive_from(&mut self, x: usize, src: &[u32]) -> bool {
        let ps = self.ps;
        let page = |i: usize| src[i * ps] / ps as u32;
        let pages = src.len() / ps;
        let giver = |c: &Self, p: u32| {
            p != 0 && (p as usize) <= c.pool.full_pages() && c.pool.window_page(p) != 0 && !c.in_tree(p)
        };
        let from = match (0..pages).rev().find(|&i| !giver(self, page(i))) {
            None => 0,
            Some(b) if b + 1 < pages => b + 1,
            Some(_) => return false,
        };
        let tree = self.pages(x);
        for (k, &to) in tree.iter().enumerate().skip(from) {
            let w = std::mem::take(&mut self.pool.map[page(k) as usize]);
            self.pool.map[to as usize] = w;
        }
        if from > 0 {
            self.split(x, from * ps);
        }
        self.nodes[x].tomb = false;
        from > 0
    }

    /// A raw insert of `key -> slots` (whole pages): see the module docs. The caller
    /// frees `slots[..cached]` (duplicates) and `slots[inserted..]` (not taken).
    ///
    /// # Panics
    ///
    /// If the lengths differ or are not whole pages, or a new page is not the caller's.
    pub fn insert(&mut self, namespace: u64, key: &[u32], slots: &[u32]) -> SwaInsert {
        assert_eq!(key.len(), slots.len(), "key and value lengths differ");
        assert_eq!(key.len() % self.ps, 0, "insert of a partial page");
        let len = self.live_len(slots, 0);
        let (key, slots) = (&key[..len], &slots[..len]);
        let (cached, end) = self.insert_walk(namespace, key, slots);
        self.settle(namespace, key, slots, 0, cached, end);
        SwaInsert { cached, inserted: len }
    }

    /// Remove the unlocked leaf `x` with its KV, then each parent left a childless,
    /// unlocked tombstone. Returns (full tokens, window tokens) freed.
    fn remove_leaf(&mut self, mut x: usize) -> (usize, usize) {
        let (mut full, mut window) = (0, 0);
        loop {
            let n = &self.nodes[x];
            assert!(x != ROOT && n.children.is_empty() && n.lock_ref == 0, "model removes a busy node {x}");
            let value = std::mem::take(&mut self.nodes[x].value);
            self.pool.free(&value);
            full += value.len();
            if !self.nodes[x].tomb {
                window += value.len();
            }
            let parent = self.nodes[x].parent;
            let ck = self.child_key(self.nodes[x].namespace, &self.nodes[x].key);
            self.nodes[parent].children.remove(&ck);
            self.nodes[x].alive = false;
            let p = &self.nodes[parent];
            if parent == ROOT || !p.children.is_empty() || p.lock_ref != 0 || !p.tomb {
                return (full, window);
            }
            x = parent;
        }
    }

    fn min_by(&self, eligible: impl Fn(&Node) -> bool, key: impl Fn(&Node) -> (i64, u64)) -> Option<usize> {
        (1..self.nodes.len())
            .filter(|&n| self.nodes[n].alive && eligible(&self.nodes[n]))
            .min_by_key(|&n| key(&self.nodes[n]))
    }

    /// The full pass; returns (full tokens, window tokens of the live nodes) freed.
    fn evict_full(&mut self, num_tokens: usize) -> (usize, usize) {
        let policy = self.policy;
        let (mut full, mut window) = (0, 0);
        while full < num_tokens {
            let leaf = self.min_by(
                |n| n.lock_ref == 0 && n.children.is_empty(),
                |n| policy.key(n.last_access, n.created, n.hit_count, 0),
            );
            let Some(x) = leaf else { break };
            let (f, w) = self.remove_leaf(x);
            full += f;
            window += w;
        }
        (full, window)
    }

    /// Evict unlocked leaves in policy order until `num_tokens` full tokens were freed
    /// (or nothing is left); returns the full tokens freed.
    pub fn evict(&mut self, num_tokens: usize) -> usize {
        self.evict_full(num_tokens).0
    }

    fn evict_window(&mut self, num: usize) -> (usize, usize) {
        let (mut full, mut window) = (0, 0);
        while window < num {
            let Some(x) = self.min_by(|n| !n.tomb && n.swa_lock == 0, |n| (0, n.last_access)) else { break };
            if self.nodes[x].children.is_empty() {
                let (f, w) = self.remove_leaf(x);
                full += f;
                window += w;
            } else {
                window += self.tombstone(x);
            }
        }
        (full, window)
    }

    /// The window pass: free the window KV of at least `num` tokens of live nodes without
    /// a window lock, least recently touched first. Returns the window tokens freed.
    pub fn evict_swa(&mut self, num: usize) -> usize {
        self.evict_window(num).1
    }

    /// The full pass for `full`, then the window pass for what it left of `window`.
    /// Returns (full, window) tokens freed.
    pub fn evict_both(&mut self, full: usize, window: usize) -> (usize, usize) {
        let (mut f, mut w) = (0, 0);
        if full > 0 {
            (f, w) = self.evict_full(full);
        }
        if w < window {
            let (f2, w2) = self.evict_window(window - w);
            f += f2;
            w += w2;
        }
        (f, w)
    }

    /// Evict each pool's shortfall for `need` tokens.
    fn make_room(&mut self, need: usize) {
        let full = need.saturating_sub(self.pool.full_available());
        let window = need.saturating_sub(self.pool.window_available());
        // A shortfall past what is evictable fails either way: evict nothing for it
        // (kvpool's rule; SGLang would empty the cache first).
        let evictable = (self.sum(|n| n.lock_ref == 0), self.sum(|n| !n.tomb && n.swa_lock == 0));
        if (full > 0 || window > 0) && full <= evictable.0 && window <= evictable.1 {
            self.evict_both(full, window);
        }
    }

    /// `n` tokens (whole pages) from both pools, evicting the shortfall first.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        self.make_room(n);
        self.pool.alloc(n)
    }

    /// The slots of the tokens `prefix..seq` of a request whose first `prefix` tokens
    /// (whole pages) it has: fresh pages, evicting the shortfall first.
    pub fn alloc_extend(&mut self, prefix: usize, seq: usize) -> Option<Vec<u32>> {
        assert_eq!(prefix % self.ps, 0, "the model extends page-aligned prefixes");
        let pages = seq.div_ceil(self.ps) - prefix / self.ps;
        self.make_room(pages * self.ps);
        let pages = self.pool.alloc_pages(pages)?;
        Some((0..seq - prefix).map(|k| pages[k / self.ps] * self.ps as u32 + (k % self.ps) as u32).collect())
    }

    /// The fresh pages of one decode step in which `starts` requests of the batch start
    /// a page (the others continue theirs): each pool's shortfall for the whole batch
    /// evicted first, then `starts` pages of each pool, lowest first, the `i`-th for the
    /// `i`-th such request; `None` (nothing taken) when that is not enough. For page
    /// sizes above 1: at page size 1 a decode takes the slot after each request's last
    /// one when it is free, which this pool does not model.
    pub fn alloc_decode_pages(&mut self, starts: usize) -> Option<Vec<u32>> {
        assert!(self.ps > 1, "the model's decode is for page sizes above 1");
        self.make_room(starts * self.ps);
        self.pool.alloc_pages(starts)
    }

    /// Free the window part of a request's whole pages inside `range` (tokens), past its
    /// lease's end; `kv` is its row. Returns the window tokens freed.
    ///
    /// # Errors
    ///
    /// [`CacheError::RowMismatch`] naming a slot that is not the request's own; nothing
    /// changes then.
    pub fn release_window(
        &mut self,
        kv: &[u32],
        lease: &RefSwaLease,
        range: core::ops::Range<usize>,
    ) -> Result<usize, CacheError> {
        let ps = self.ps;
        let (from, to) = (range.start.max(lease.len).div_ceil(ps) * ps, range.end / ps * ps);
        if to <= from {
            return Ok(0);
        }
        for (i, &slot) in kv[from..to].iter().enumerate() {
            if !self.pool.is_allocated(slot) || self.in_tree(slot / self.ps as u32) {
                return Err(CacheError::RowMismatch { index: from + i, slot });
            }
        }
        Ok(self.pool.free_swa(&kv[from..to]))
    }

    /// The insert of a request's tokens: returns (cached, inserted length).
    fn request_insert(&mut self, namespace: u64, token_ids: &[u32], kv: &[u32], lease: &RefSwaLease) -> (usize, usize) {
        let aligned = token_ids.len() / self.ps * self.ps;
        let limit = self.live_len(&kv[..aligned], lease.len.min(aligned));
        let (key, value) = (&token_ids[..limit], &kv[..limit]);
        let (cached, end) = self.insert_walk(namespace, key, value);
        assert!(cached >= lease.len, "a model lease is not on the request's path");
        self.settle(namespace, key, value, lease.len, cached, end);
        (cached, limit)
    }

    /// SGLang's `cache_finished_req` for SWA models: `kv` is the request's row for
    /// `token_ids`. Returns the tokens the tree held already.
    pub fn cache_finished_req(&mut self, namespace: u64, token_ids: &[u32], kv: &[u32], lease: RefSwaLease) -> usize {
        let (cached, limit) = self.request_insert(namespace, token_ids, kv, &lease);
        self.pool.free(&kv[lease.len..cached]);
        self.pool.free(&kv[limit..token_ids.len()]);
        self.unlock(lease);
        cached
    }

    /// SGLang's `cache_unfinished_req` for SWA models: inserts, frees the duplicates,
    /// re-matches, rewrites `kv` with the tree's slots and moves the lease to where the
    /// inserted key ends.
    pub fn cache_unfinished_req(&mut self, namespace: u64, token_ids: &[u32], kv: &mut [u32], lease: &mut RefSwaLease) {
        let (cached, limit) = self.request_insert(namespace, token_ids, kv, lease);
        self.pool.free(&kv[lease.len..cached]);
        let m = self.match_prefix(namespace, &token_ids[..limit]);
        assert_eq!(m.slots.len(), limit, "an inserted key matches whole");
        kv[..limit].copy_from_slice(&m.slots);
        let new = self.lock(m.kv_node, limit);
        self.unlock(*lease);
        *lease = new;
    }

    fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().skip(1).filter(|n| n.alive)
    }

    fn sum(&self, f: impl Fn(&Node) -> bool) -> usize {
        self.live().filter(|n| f(n)).map(|n| n.value.len()).sum()
    }

    /// The sizes to compare (see [`SwaSizes`]).
    pub fn sizes(&self) -> SwaSizes {
        (
            (self.sum(|_| true), self.sum(|n| n.lock_ref == 0), self.sum(|n| n.lock_ref > 0)),
            (self.sum(|n| !n.tomb && n.swa_lock == 0), self.sum(|n| !n.tomb && n.swa_lock > 0), self.sum(|n| n.tomb)),
            (self.pool.full_available(), self.pool.window_available(), self.live().count()),
        )
    }

    /// Tokens cached.
    pub fn total_size(&self) -> usize {
        self.sum(|_| true)
    }

    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.live().count()
    }

    /// Every cached (namespace, key, value) path from the root to each leaf, sorted.
    pub fn leaf_paths(&self) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            if !n.alive || !n.children.is_empty() {
                continue;
            }
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for x in self.path(i).into_iter().skip(1) {
                k.extend_from_slice(&self.nodes[x].key);
                v.extend_from_slice(&self.nodes[x].value);
            }
            out.push((n.namespace, k, v));
        }
        out.sort();
        out
    }

    /// Every tombstone as (namespace, tokens from the root to its end, its length),
    /// sorted.
    pub fn tombstones(&self) -> Vec<(u64, Vec<u32>, usize)> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            if n.alive && n.tomb {
                let k = self.path(i).into_iter().skip(1).flat_map(|x| self.nodes[x].key.iter().copied()).collect();
                out.push((n.namespace, k, n.value.len()));
            }
        }
        out.sort();
        out
    }

    /// The model's own invariants: no tombstone leaf; a live node has a window part for
    /// every page, a tombstone for none; no window lock on a tombstone or beyond the full
    /// lock; every tree page allocated and held once; every mapping distinct and
    /// allocated in both pools.
    ///
    /// # Errors
    ///
    /// The first broken invariant, described.
    pub fn check(&self) -> Result<(), String> {
        let mut held = HashSet::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1).filter(|(_, n)| n.alive) {
            if n.children.is_empty() && n.tomb {
                return Err(format!("model node {i} is a tombstone leaf"));
            }
            if n.swa_lock > n.lock_ref || (n.tomb && n.swa_lock > 0) {
                return Err(format!("model node {i} has a bad window lock"));
            }
            for p in self.pages(i) {
                if !held.insert(p) || !self.pool.full[p as usize] {
                    return Err(format!("model page {p} is held twice or free"));
                }
                if (self.pool.map[p as usize] == 0) != n.tomb {
                    return Err(format!("model node {i}'s page {p} disagrees with its tombstone flag"));
                }
            }
        }
        let mut seen = HashSet::new();
        for (p, &w) in self.pool.map.iter().enumerate() {
            if w != 0 && (!self.pool.full[p] || !self.pool.window[w as usize] || !seen.insert(w)) {
                return Err(format!("model full page {p} maps to window page {w} badly"));
            }
        }
        if seen.len() != self.pool.window.iter().filter(|&&a| a).count() {
            return Err("model window pages allocated without a full page".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(full: usize, window_pool: usize, window: usize) -> ReferenceSwaCache {
        ReferenceSwaCache::new(RefDualPool::new(full, window_pool, 1), window, EvictionPolicy::Lru).unwrap()
    }

    fn put(c: &mut ReferenceSwaCache, key: &[u32]) -> SwaInsert {
        let kv = c.alloc(key.len()).unwrap();
        let r = c.insert(0, key, &kv);
        c.pool_mut().free(&kv[..r.cached]);
        c.check().unwrap();
        r
    }

    #[test]
    fn the_counter_restarts_at_every_tombstone() {
        let mut c = model(64, 64, 4);
        put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        put(&mut c, &[1, 2, 3, 9]);
        put(&mut c, &[1, 2, 3, 4, 5, 9]);
        put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 9]);
        // [1,2,3] [4,5] [6,7] [8,9]; tombstone [1,2,3] and [6,7].
        for end in [3, 7] {
            let m = c.match_prefix(0, &(1..=end).collect::<Vec<_>>());
            c.tombstone(m.node.0);
        }
        c.check().unwrap();
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 8]).len, 0);
        assert_eq!(c.peek(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9]), Vec::<u32>::new());
        assert_eq!(c.tombstones().len(), 2);
    }

    /// The reference pools place a large claim as `SwaAllocator` does: past the sparse
    /// words (isolated free pages) while 64 or more are still needed.
    #[test]
    fn pools_place_large_claims_as_the_allocator_does() {
        use crate::alloc::{KvAllocator, SwaAllocator};
        let (pages, ps) = (256usize, 1usize);
        let real = SwaAllocator::new(pages * ps, pages * ps, ps as u32).unwrap();
        let mut model = RefDualPool::new(pages * ps, pages * ps, ps);
        let mut all = vec![0u32; pages];
        real.alloc(&mut all).unwrap();
        assert_eq!(model.alloc(pages).unwrap(), all);
        // Every 8th page of the first word, and the whole third word.
        let freed: Vec<u32> = (1..=64).step_by(8).chain(129..=192).collect();
        real.free(&freed).unwrap();
        model.free(&freed);
        for n in [64, 3] {
            let mut got = vec![0u32; n];
            real.alloc(&mut got).unwrap();
            assert_eq!(model.alloc(n).unwrap(), got, "a claim of {n}");
            for &p in &got {
                assert_eq!(model.window_page(p), real.window_slot(p).unwrap_or(0), "page {p}'s window page");
            }
        }
        assert_eq!(model.alloc(64).map(|v| v.len()), None);
    }

    #[test]
    fn pools_hand_out_the_lowest_pages_and_map_them_in_order() {
        let mut p = RefDualPool::new(16, 8, 2);
        assert_eq!(p.alloc(4), Some(vec![2, 3, 4, 5]));
        assert_eq!(p.free_swa(&[2, 3]), 2);
        assert_eq!(p.alloc(2), Some(vec![6, 7]));
        assert_eq!((p.window_page(3), p.window_page(1)), (1, 0));
        p.free(&[2, 3, 4, 5, 6, 7]);
        assert_eq!((p.full_available(), p.window_available()), (16, 8));
        assert_eq!(p.alloc(10), None);
    }
}
