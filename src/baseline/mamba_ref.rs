//! [`ReferenceMambaCache`]: a deliberately simple, single-threaded model of
//! [`MambaRadixCache`](crate::radix::MambaRadixCache) (SGLang's `MambaRadixCache`).
//!
//! The same shape as [`ReferenceRadixCache`](super::ReferenceRadixCache): nodes in a
//! vector, children in a `HashMap`, keys and values in `Vec`s, a logical clock, every
//! eviction choosing its victim by scanning all nodes. Sizes are recounted from the
//! nodes on every call instead of being kept up to date. It favours being obviously
//! right over being fast: it allocates freely and takes `&mut self`. It is what
//! `MambaRadixCache` is tested against (`tests/mamba_model.rs`, the `mamba_ops` fuzz
//! target, both through `kvpool::models::mamba` with feature `models`).
//!
//! Semantics (SGLang's, with a logical clock for its two LRU lists):
//!
//! * each node holds KV slots and optionally a **state** slot (the Mamba state after its
//!   last token); a node without one is a **tombstone**, which is never a leaf;
//! * with page size `ps > 1`, queries are cut to whole pages and compared a page at a
//!   time; children are keyed by (namespace, first page);
//! * a match walks as far as the KV matches (each node reached gets one hit), splitting
//!   the node it ends inside; it returns the prefix up to the **deepest node holding a
//!   state** (or nothing), and then touches that node's path from the root down (the
//!   root oldest, the returned node newest). Nodes the KV match passed beyond it are not
//!   touched. An empty key touches nothing;
//! * a split makes a new upper node without state, stamped (one tick) when created,
//!   inheriting the lock count and hits; then the lower node (which keeps the state, its
//!   state lock and its identity) is touched: it is newer than the upper one;
//! * an insert touches the root and each node it walks (a partially matched node is
//!   touched, then split); a new leaf is stamped when created. The state goes to the
//!   node the key ends at if that node has none (a new leaf, or a tombstone, which is
//!   then touched again); otherwise it is freed into the state pool. A state the caller
//!   does not hold (free, out of range, held by the tree) is refused before anything
//!   changes;
//! * a lock increments the lock count of every node from the locked node up to (not
//!   including) the root, and the **state lock** of the locked node only, if it holds a
//!   state;
//! * [`evict`](ReferenceMambaCache::evict) removes unlocked leaves in policy order
//!   (LRU: least recently touched first), with their state, and then each parent left a
//!   childless, unlocked tombstone (its tokens count as freed);
//!   [`evict_mamba`](ReferenceMambaCache::evict_mamba) frees the least recently touched
//!   state without a state lock, internal nodes included: an internal node becomes a
//!   tombstone (its KV stays), a leaf is removed whole as by `evict`;
//! * every touch and every creation is one tick of the clock, so timestamps are
//!   distinct and both eviction orders are deterministic.

use std::collections::HashMap;

use crate::alloc::KvAllocator;
use crate::error::ConfigError;
use crate::radix::{CacheError, EvictionPolicy, StateInsert, StatePool};

use super::RefNodeId;

#[derive(Debug)]
struct Node {
    parent: usize,
    children: HashMap<(u64, Vec<u32>), usize>,
    namespace: u64,
    key: Vec<u32>,
    value: Vec<u32>,
    state: Option<u32>,
    lock_ref: u32,
    state_lock: u32,
    last_access: u64,
    created: u64,
    hit_count: u64,
    alive: bool,
}

/// What [`ReferenceMambaCache::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefMambaMatch {
    /// Tokens up to the deepest node holding a state (the usable prefix).
    pub len: usize,
    /// That node (the root when `len` is 0).
    pub node: RefNodeId,
    /// Its state.
    pub state: Option<u32>,
    /// How far the KV matched (`>= len`).
    pub kv_len: usize,
    /// The KV slots of the first `kv_len` tokens.
    pub slots: Vec<u32>,
}

/// A simple model of [`MambaRadixCache`](crate::radix::MambaRadixCache) over a KV
/// allocator `A` and a state pool `P` (see the module docs).
#[derive(Debug)]
pub struct ReferenceMambaCache<A, P> {
    alloc: A,
    states: P,
    page_size: usize,
    policy: EvictionPolicy,
    nodes: Vec<Node>,
    clock: u64,
}

const ROOT: usize = 0;

impl<A: KvAllocator, P: StatePool> ReferenceMambaCache<A, P> {
    /// An empty cache that frees evicted KV slots into `alloc` and states into `states`.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::ReferenceMambaCache;
    /// use kvpool::{radix::EvictionPolicy, KvAllocator, SlotPool, TokenAllocator};
    /// let mut c = ReferenceMambaCache::new(TokenAllocator::new(8)?, SlotPool::without_magazines(2), EvictionPolicy::Lru)?;
    /// let mut kv = [0u32; 4];
    /// c.allocator().alloc(&mut kv)?;
    /// let state = c.alloc_state().unwrap();
    /// assert!(c.insert(0, &[1, 2, 3, 4], &kv, state)?.state_kept);
    /// // The KV of [1, 2] matches, but no state lies there: nothing is usable.
    /// assert_eq!(c.match_prefix(0, &[1, 2, 9]).len, 0);
    /// assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).state, Some(state));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] if `alloc.page_size()` is 0.
    pub fn new(alloc: A, states: P, policy: EvictionPolicy) -> Result<Self, ConfigError> {
        let page_size = alloc.page_size() as usize;
        if page_size == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        let root = Node {
            parent: ROOT,
            children: HashMap::new(),
            namespace: 0,
            key: Vec::new(),
            value: Vec::new(),
            state: None,
            lock_ref: 1,
            state_lock: 0,
            last_access: 0,
            created: 0,
            hit_count: 0,
            alive: true,
        };
        Ok(ReferenceMambaCache { alloc, states, page_size, policy, nodes: vec![root], clock: 0 })
    }

    /// The KV allocator.
    pub fn allocator(&self) -> &A {
        &self.alloc
    }

    /// The state pool.
    pub fn states(&self) -> &P {
        &self.states
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
        (namespace, key[..self.page_size.min(key.len())].to_vec())
    }

    /// Common prefix length of `a` and `b` in whole pages.
    fn key_match(&self, a: &[u32], b: &[u32]) -> usize {
        let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        same / self.page_size * self.page_size
    }

    /// `n` and its ancestors, the root first.
    fn path(&self, mut n: usize) -> Vec<usize> {
        let mut path = vec![n];
        while n != ROOT {
            n = self.nodes[n].parent;
            path.push(n);
        }
        path.reverse();
        path
    }

    /// Cut `child` after `at` tokens: a new upper node without state (stamped now), then
    /// `child` keeps the lower part (and its identity, state and state lock) and is
    /// touched. Returns the upper node.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let t = self.tick();
        let id = self.nodes.len();
        let c = &mut self.nodes[child];
        let upper_key: Vec<u32> = c.key.drain(..at).collect();
        let upper_value: Vec<u32> = c.value.drain(..at).collect();
        let (parent, namespace, lock_ref, hit_count) = (c.parent, c.namespace, c.lock_ref, c.hit_count);
        c.parent = id;
        let lower_ck = (namespace, c.key[..self.page_size].to_vec());
        let upper_ck = (namespace, upper_key[..self.page_size].to_vec());
        self.nodes.push(Node {
            parent,
            children: HashMap::from([(lower_ck, child)]),
            namespace,
            key: upper_key,
            value: upper_value,
            state: None,
            lock_ref,
            state_lock: 0,
            last_access: t,
            created: t,
            hit_count,
            alive: true,
        });
        self.nodes[parent].children.insert(upper_ck, id);
        self.touch(child);
        id
    }

    /// SGLang's `match_prefix` for hybrid models (see the module docs): `key` is cut to
    /// whole pages.
    pub fn match_prefix(&mut self, namespace: u64, key: &[u32]) -> RefMambaMatch {
        let key = &key[..key.len() / self.page_size * self.page_size];
        let mut slots = Vec::new();
        let (mut best, mut best_len) = (ROOT, 0);
        if key.is_empty() {
            return RefMambaMatch { len: 0, node: RefNodeId(ROOT), state: None, kv_len: 0, slots };
        }
        let mut node = ROOT;
        let mut rest = key;
        while !rest.is_empty() {
            let ck = self.child_key(namespace, rest);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.nodes[child].hit_count += 1;
            let n = self.key_match(&self.nodes[child].key, rest);
            let partial = n < self.nodes[child].key.len();
            node = if partial { self.split(child, n) } else { child };
            slots.extend_from_slice(&self.nodes[node].value);
            rest = &rest[n..];
            if self.nodes[node].state.is_some() {
                (best, best_len) = (node, slots.len());
            }
            if partial {
                break;
            }
        }
        for n in self.path(best) {
            self.touch(n);
        }
        let state = self.nodes[best].state;
        RefMambaMatch { len: best_len, node: RefNodeId(best), state, kv_len: slots.len(), slots }
    }

    /// [`match_prefix`](Self::match_prefix), then [`lock`](Self::lock) the node found.
    pub fn match_and_lock(&mut self, namespace: u64, key: &[u32]) -> RefMambaMatch {
        let m = self.match_prefix(namespace, key);
        self.lock(m.node);
        m
    }

    /// Lock `node`'s path to the root (KV) and `node`'s state, if it holds one.
    pub fn lock(&mut self, node: RefNodeId) {
        let mut n = node.0;
        if self.nodes[n].state.is_some() {
            self.nodes[n].state_lock += 1;
        }
        while n != ROOT {
            self.nodes[n].lock_ref += 1;
            n = self.nodes[n].parent;
        }
    }

    /// Lock the node of an earlier match if it can still be locked: it is the root (an
    /// empty match), or it is still in the tree and holds a state.
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] otherwise; nothing changes.
    pub fn lock_match(&mut self, node: RefNodeId) -> Result<(), CacheError> {
        let x = &self.nodes[node.0];
        if node.0 != ROOT && (!x.alive || x.state.is_none()) {
            return Err(CacheError::StaleMatch);
        }
        self.lock(node);
        Ok(())
    }

    /// Undo one [`lock`](Self::lock).
    ///
    /// # Panics
    ///
    /// If `node` is not locked (this is a test model).
    pub fn unlock(&mut self, node: RefNodeId) {
        let mut n = node.0;
        if self.nodes[n].state.is_some() {
            assert!(self.nodes[n].state_lock > 0, "state lock released twice");
            self.nodes[n].state_lock -= 1;
        }
        while n != ROOT {
            assert!(self.nodes[n].lock_ref > 0, "lock released twice");
            self.nodes[n].lock_ref -= 1;
            n = self.nodes[n].parent;
        }
    }

    /// The state `node` holds.
    pub fn state_of(&self, node: RefNodeId) -> Option<u32> {
        let x = &self.nodes[node.0];
        if x.alive {
            x.state
        } else {
            None
        }
    }

    /// Whether `state` can be handed to the tree: in range, allocated, not the tree's.
    fn state_is_callers(&self, state: u32) -> bool {
        state != 0
            && state <= self.states.capacity()
            && self.states.is_allocated(state)
            && !self.nodes.iter().any(|n| n.alive && n.state == Some(state))
    }

    /// Insert `key -> value` (page-aligned lengths) with the state after the key's last
    /// token, which the tree takes: it keeps it if the node the key ends at has none,
    /// and frees it otherwise.
    ///
    /// # Errors
    ///
    /// [`CacheError::StateNotOwned`] if the caller does not hold `state`; nothing
    /// changes.
    ///
    /// # Panics
    ///
    /// If the lengths differ or are not whole pages (this is a test model).
    pub fn insert(
        &mut self,
        namespace: u64,
        key: &[u32],
        value: &[u32],
        state: u32,
    ) -> Result<StateInsert, CacheError> {
        assert_eq!(key.len(), value.len(), "key and value lengths differ");
        assert_eq!(key.len() % self.page_size, 0, "insert of a partial page");
        if !self.state_is_callers(state) {
            return Err(CacheError::StateNotOwned { state });
        }
        self.touch(ROOT);
        let (mut node, mut key, mut value) = (ROOT, key, value);
        let mut cached = 0;
        while !key.is_empty() {
            let ck = self.child_key(namespace, key);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.touch(child);
            let n = self.key_match(&self.nodes[child].key, key);
            cached += n;
            key = &key[n..];
            value = &value[n..];
            if n < self.nodes[child].key.len() {
                node = self.split(child, n);
                break;
            }
            node = child;
        }
        if !key.is_empty() {
            let t = self.tick();
            let id = self.nodes.len();
            let ck = self.child_key(namespace, key);
            self.nodes.push(Node {
                parent: node,
                children: HashMap::new(),
                namespace,
                key: key.to_vec(),
                value: value.to_vec(),
                state: None,
                lock_ref: 0,
                state_lock: 0,
                last_access: t,
                created: t,
                hit_count: 0,
                alive: true,
            });
            self.nodes[node].children.insert(ck, id);
            node = id;
        }
        let state_kept = node != ROOT && self.nodes[node].state.is_none();
        if state_kept {
            self.nodes[node].state = Some(state);
            self.touch(node);
        } else {
            self.states.free(&[state]).expect("the caller's state frees");
        }
        Ok(StateInsert { cached, state_kept })
    }

    /// Remove the leaf `x` (unlocked) with its state, then every parent left a
    /// childless, unlocked tombstone. Returns the tokens freed.
    fn remove_leaf(&mut self, mut x: usize) -> usize {
        let mut freed = 0;
        loop {
            assert!(x != ROOT && self.nodes[x].children.is_empty() && self.nodes[x].lock_ref == 0);
            let value = std::mem::take(&mut self.nodes[x].value);
            self.alloc.free(&value).expect("the tree's KV slots free");
            freed += value.len();
            if let Some(s) = self.nodes[x].state.take() {
                self.states.free(&[s]).expect("the tree's states free");
            }
            let parent = self.nodes[x].parent;
            let ck = self.child_key(self.nodes[x].namespace, &self.nodes[x].key);
            self.nodes[parent].children.remove(&ck);
            self.nodes[x].alive = false;
            let p = &self.nodes[parent];
            if parent == ROOT || !p.children.is_empty() || p.lock_ref != 0 || p.state.is_some() {
                return freed;
            }
            x = parent;
        }
    }

    /// The live node, other than the root, that `eligible` accepts with the smallest
    /// `key`.
    fn min_by(&self, eligible: impl Fn(&Node) -> bool, key: impl Fn(&Node) -> (i64, u64)) -> Option<usize> {
        (1..self.nodes.len())
            .filter(|&n| self.nodes[n].alive && eligible(&self.nodes[n]))
            .min_by_key(|&n| key(&self.nodes[n]))
    }

    /// Evict unlocked leaves in policy order until at least `num_tokens` tokens were
    /// freed (or nothing evictable is left); returns the tokens freed.
    pub fn evict(&mut self, num_tokens: usize) -> usize {
        let policy = self.policy;
        let mut freed = 0;
        while freed < num_tokens {
            let leaf = self.min_by(
                |n| n.lock_ref == 0 && n.children.is_empty(),
                |n| policy.key(n.last_access, n.created, n.hit_count, 0),
            );
            let Some(x) = leaf else { break };
            freed += self.remove_leaf(x);
        }
        freed
    }

    /// Free at least `num` states of nodes without a state lock, least recently touched
    /// first: an internal node becomes a tombstone, a leaf is removed whole. Returns the
    /// states freed.
    pub fn evict_mamba(&mut self, num: usize) -> usize {
        let mut freed = 0;
        while freed < num {
            let Some(x) = self.min_by(|n| n.state.is_some() && n.state_lock == 0, |n| (0, n.last_access)) else {
                break;
            };
            if self.nodes[x].children.is_empty() {
                self.remove_leaf(x);
            } else {
                let s = self.nodes[x].state.take().expect("chosen for its state");
                self.states.free(&[s]).expect("the tree's states free");
            }
            freed += 1;
        }
        freed
    }

    /// A state slot from the pool; when none is free, the least recently touched
    /// unlocked state is evicted first. `None` when that was not enough.
    pub fn alloc_state(&mut self) -> Option<u32> {
        if let Ok(s) = self.states.alloc_one() {
            return Some(s);
        }
        self.evict_mamba(1);
        self.states.alloc_one().ok()
    }

    /// SGLang's `cache_finished_req` for hybrid models: `token_ids` are the request's
    /// tokens with KV, `kv_indices` their slots, `protected_len` the length it locked at
    /// `last_node`, `state` its state after the page-aligned part. Inserts the aligned
    /// part with the state, frees the duplicates beyond the lock and the unaligned
    /// tail, unlocks.
    ///
    /// # Errors
    ///
    /// [`CacheError::StateNotOwned`] as [`insert`](Self::insert); nothing changes.
    pub fn cache_finished_req(
        &mut self,
        namespace: u64,
        token_ids: &[u32],
        kv_indices: &[u32],
        protected_len: usize,
        last_node: RefNodeId,
        state: u32,
    ) -> Result<StateInsert, CacheError> {
        let aligned = token_ids.len() / self.page_size * self.page_size;
        let r = self.insert(namespace, &token_ids[..aligned], &kv_indices[..aligned], state)?;
        if r.cached > protected_len {
            self.alloc.free(&kv_indices[protected_len..r.cached]).expect("duplicate slots are the request's");
        }
        self.alloc.free(&kv_indices[aligned..]).expect("tail slots are the request's");
        self.unlock(last_node);
        Ok(r)
    }

    /// SGLang's `cache_unfinished_req` for hybrid models (chunked prefill): inserts the
    /// page-aligned part with `state` (a copy of the request's), frees the duplicates,
    /// re-matches (which touches), rewrites `kv_indices` with the tree's slots there and
    /// moves the lock to the node found. Returns whether the state was kept, and the new
    /// protected length and locked node.
    ///
    /// # Errors
    ///
    /// [`CacheError::StateNotOwned`] as [`insert`](Self::insert); nothing changes.
    pub fn cache_unfinished_req(
        &mut self,
        namespace: u64,
        token_ids: &[u32],
        kv_indices: &mut [u32],
        protected_len: usize,
        last_node: RefNodeId,
        state: u32,
    ) -> Result<(bool, usize, RefNodeId), CacheError> {
        let aligned = token_ids.len() / self.page_size * self.page_size;
        let r = self.insert(namespace, &token_ids[..aligned], &kv_indices[..aligned], state)?;
        if r.cached > protected_len {
            self.alloc.free(&kv_indices[protected_len..r.cached]).expect("duplicate slots are the request's");
        }
        let m = self.match_prefix(namespace, &token_ids[..aligned]);
        assert_eq!(m.kv_len, aligned, "an inserted key matches whole");
        kv_indices[..aligned].copy_from_slice(&m.slots);
        self.lock(m.node);
        self.unlock(last_node);
        Ok((r.state_kept, m.len, m.node))
    }

    /// How many leading whole pages of `key` are cached as KV, and their slots
    /// (`peek_prefix`: states do not matter, nothing changes).
    pub fn peek(&self, namespace: u64, key: &[u32]) -> Vec<u32> {
        let mut rest = &key[..key.len() / self.page_size * self.page_size];
        let (mut node, mut slots) = (ROOT, Vec::new());
        while !rest.is_empty() {
            let Some(&child) = self.nodes[node].children.get(&self.child_key(namespace, rest)) else { break };
            let n = self.key_match(&self.nodes[child].key, rest);
            slots.extend_from_slice(&self.nodes[child].value[..n]);
            if n < self.nodes[child].key.len() {
                break;
            }
            rest = &rest[n..];
            node = child;
        }
        slots
    }

    fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().skip(1).filter(|n| n.alive)
    }

    /// Tokens cached.
    pub fn total_size(&self) -> usize {
        self.live().map(|n| n.value.len()).sum()
    }

    /// Tokens in nodes without a lock.
    pub fn evictable_size(&self) -> usize {
        self.live().filter(|n| n.lock_ref == 0).map(|n| n.value.len()).sum()
    }

    /// Tokens in locked nodes.
    pub fn protected_size(&self) -> usize {
        self.live().filter(|n| n.lock_ref > 0).map(|n| n.value.len()).sum()
    }

    /// States held without a state lock.
    pub fn mamba_evictable_size(&self) -> usize {
        self.live().filter(|n| n.state.is_some() && n.state_lock == 0).count()
    }

    /// States held with a state lock.
    pub fn mamba_protected_size(&self) -> usize {
        self.live().filter(|n| n.state.is_some() && n.state_lock > 0).count()
    }

    /// The states the tree holds, ascending.
    pub fn held_states(&self) -> Vec<u32> {
        let mut s: Vec<u32> = self.live().filter_map(|n| n.state).collect();
        s.sort_unstable();
        s
    }

    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.live().count()
    }

    /// Every cached (namespace, key, value) path from the root to each leaf, sorted (as
    /// [`RadixCache::leaf_paths`](crate::radix::RadixCache::leaf_paths)).
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

    /// Every node holding a state as (namespace, tokens from the root, state), sorted.
    pub fn state_paths(&self) -> Vec<(u64, Vec<u32>, u32)> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            let Some(s) = n.state.filter(|_| n.alive) else { continue };
            let k = self.path(i).into_iter().skip(1).flat_map(|x| self.nodes[x].key.iter().copied()).collect();
            out.push((n.namespace, k, s));
        }
        out.sort();
        out
    }

    /// Check the model's own invariants: no tombstone leaf, no state held twice, every
    /// held state allocated in the pool, state locks only where the KV is locked.
    ///
    /// # Errors
    ///
    /// The first broken invariant, described.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1).filter(|(_, n)| n.alive) {
            if n.children.is_empty() && n.state.is_none() {
                return Err(format!("model node {i} is a tombstone leaf"));
            }
            if n.state_lock > n.lock_ref || (n.state.is_none() && n.state_lock > 0) {
                return Err(format!("model node {i} has a bad state lock"));
            }
            if let Some(s) = n.state {
                if !seen.insert(s) || !self.states.is_allocated(s) {
                    return Err(format!("model state {s} is held twice or free"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SlotPool, TokenAllocator};

    type Model = ReferenceMambaCache<TokenAllocator, SlotPool>;

    fn model(tokens: usize, states: u32) -> Model {
        ReferenceMambaCache::new(
            TokenAllocator::new(tokens).unwrap(),
            SlotPool::without_magazines(states),
            EvictionPolicy::Lru,
        )
        .unwrap()
    }

    fn put(c: &mut Model, key: &[u32]) -> StateInsert {
        let mut kv = vec![0u32; key.len()];
        c.allocator().alloc(&mut kv).unwrap();
        let s = c.alloc_state().unwrap();
        let r = c.insert(0, key, &kv, s).unwrap();
        c.allocator().free(&kv[..r.cached]).unwrap();
        c.check().unwrap();
        r
    }

    #[test]
    fn tombstones_split_revive_and_cascade() {
        let mut c = model(64, 4);
        put(&mut c, &[1, 2, 3, 4]);
        let m = c.match_prefix(0, &[1, 2, 9]);
        assert_eq!((m.len, m.kv_len, c.node_count()), (0, 2, 2));
        assert!(put(&mut c, &[1, 2]).state_kept, "the tombstone takes the state");
        assert!(!put(&mut c, &[1, 2]).state_kept, "a state is there already");
        assert_eq!(c.match_prefix(0, &[1, 2, 9]).len, 2);
        // The leaf [3, 4] was touched last (by the full match), so [1, 2]'s state goes.
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).len, 4);
        assert_eq!(c.evict_mamba(1), 1);
        assert_eq!((c.node_count(), c.held_states().len()), (2, 1));
        // Evicting the leaf takes the tombstone parent with it.
        assert_eq!(c.evict(1), 4);
        assert_eq!((c.total_size(), c.states().available(), c.allocator().available_size()), (0, 4, 64));
    }

    #[test]
    fn locks_cover_the_path_and_the_end_state() {
        let mut c = model(64, 4);
        put(&mut c, &[1, 2]);
        put(&mut c, &[1, 2, 3, 4]);
        let m = c.match_and_lock(0, &[1, 2, 3, 4]);
        assert_eq!((c.protected_size(), c.mamba_protected_size(), c.mamba_evictable_size()), (4, 1, 1));
        assert_eq!(c.evict(10), 0);
        assert_eq!(c.evict_mamba(10), 1, "only the internal state is unlocked");
        assert_eq!(c.lock_match(c.root()), Ok(()), "an empty match always locks");
        c.unlock(c.root());
        c.unlock(m.node);
        assert_eq!((c.evictable_size(), c.mamba_evictable_size()), (4, 1));
        c.check().unwrap();
    }

    #[test]
    fn foreign_states_are_refused() {
        let mut c = model(64, 4);
        put(&mut c, &[1, 2]);
        let held = c.held_states()[0];
        for bad in [0, held, 3, 99] {
            assert_eq!(c.insert(0, &[], &[], bad), Err(CacheError::StateNotOwned { state: bad }));
        }
    }
}
