//! [`ReferenceRadixCache`]: a deliberately simple, single-threaded radix prefix cache.
//!
//! This is the shape of SGLang's `RadixCache` (and TGI's): nodes in a vector, children in
//! a `HashMap`, keys and values in `Vec`s, eviction through a heap built per call. It
//! is the model that [`RadixCache`](crate::radix::RadixCache) is tested against and the
//! baseline it is benchmarked against. It favours being obviously right over being fast;
//! it allocates freely and takes `&mut self`.
//!
//! Semantics (SGLang's, with a logical clock instead of `time.monotonic()`):
//!
//! * with page size `ps > 1`, queries are cut to whole pages and compared a page at a
//!   time; children are keyed by (namespace, first page);
//! * `match_prefix` touches the root and then each node on its path; a match ending
//!   inside a node splits it (the new upper node is stamped when created and inherits
//!   the lock count, hit count and priority);
//! * `insert` touches the root and each node it walks; a new leaf is stamped when
//!   created; it returns how many leading tokens were already present;
//! * every touch and every creation is one tick of the clock, so timestamps are
//!   distinct and eviction order is deterministic;
//! * each node on a match's path (not the root) gets one hit, for LFU; a split's upper
//!   node inherits the hits of the node it was cut from.
//!
//! [`VecTrieCache`] (module [`vec_trie`]) is a second baseline in the shape of TGI v3's
//! `RadixAllocator`: per-node token and page vectors, a `BTreeSet` LRU of leaves that
//! eviction trims, and a `Vec` free list of pages.

pub mod hicache_ref;
pub mod mamba_ref;
pub mod swa_ref;
pub mod vec_trie;
pub use mamba_ref::ReferenceMambaCache;
pub use vec_trie::VecTrieCache;

use std::collections::{BinaryHeap, HashMap};

use crate::alloc::KvAllocator;
use crate::error::ConfigError;
use crate::radix::EvictionPolicy;

/// A node of a [`ReferenceRadixCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RefNodeId(pub usize);

#[derive(Debug)]
struct RefNode {
    parent: usize,
    children: HashMap<(u64, Vec<u32>), usize>,
    namespace: u64,
    key: Vec<u32>,
    value: Vec<u32>,
    lock_ref: u32,
    last_access: u64,
    created: u64,
    hit_count: u64,
    priority: i64,
    alive: bool,
}

/// A simple radix prefix cache over a KV allocator (see the module docs).
#[derive(Debug)]
pub struct ReferenceRadixCache<A> {
    alloc: A,
    page_size: usize,
    policy: EvictionPolicy,
    nodes: Vec<RefNode>,
    clock: u64,
    evictable: usize,
    protected: usize,
}

const ROOT: usize = 0;

impl<A: KvAllocator> ReferenceRadixCache<A> {
    /// An empty cache that frees evicted slots into `alloc`.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::ReferenceRadixCache;
    /// use kvpool::{radix::EvictionPolicy, PagedAllocator};
    /// let cache = ReferenceRadixCache::new(PagedAllocator::new(64, 4)?, EvictionPolicy::Lru)?;
    /// assert_eq!(cache.total_size(), 0);
    /// # Ok::<(), kvpool::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] if `alloc.page_size()` is 0 (possible with a
    /// custom [`KvAllocator`]): queries are cut to whole pages.
    pub fn new(alloc: A, policy: EvictionPolicy) -> Result<Self, ConfigError> {
        let page_size = alloc.page_size() as usize;
        if page_size == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        let mut c =
            ReferenceRadixCache { alloc, page_size, policy, nodes: Vec::new(), clock: 0, evictable: 0, protected: 0 };
        c.reset_tree();
        Ok(c)
    }

    fn reset_tree(&mut self) {
        self.nodes.clear();
        self.nodes.push(RefNode {
            parent: ROOT,
            children: HashMap::new(),
            namespace: 0,
            key: Vec::new(),
            value: Vec::new(),
            lock_ref: 1,
            last_access: 0,
            created: 0,
            hit_count: 0,
            priority: i64::MIN,
            alive: true,
        });
        self.evictable = 0;
        self.protected = 0;
    }

    /// The allocator.
    pub fn allocator(&self) -> &A {
        &self.alloc
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

    /// Common prefix length of `a` and `b`, compared a page at a time.
    fn key_match(&self, a: &[u32], b: &[u32]) -> usize {
        let n = a.len().min(b.len());
        if self.page_size == 1 {
            return a.iter().zip(b).take_while(|(x, y)| x == y).count();
        }
        let mut i = 0;
        while i < n {
            let (ea, eb) = ((i + self.page_size).min(a.len()), (i + self.page_size).min(b.len()));
            if a[i..ea] != b[i..eb] {
                break;
            }
            i += self.page_size;
        }
        i.min(n)
    }

    fn split(&mut self, child: usize, at: usize) -> usize {
        let t = self.tick();
        let c = &mut self.nodes[child];
        let upper_key = c.key[..at].to_vec();
        let upper_value = c.value[..at].to_vec();
        c.key.drain(..at);
        c.value.drain(..at);
        let (parent, namespace, lock_ref, hit_count, priority) =
            (c.parent, c.namespace, c.lock_ref, c.hit_count, c.priority);
        let lower_ck = (namespace, c.key[..self.page_size.min(c.key.len())].to_vec());
        let upper_ck = (namespace, upper_key[..self.page_size.min(upper_key.len())].to_vec());
        let id = self.nodes.len();
        let mut children = HashMap::new();
        children.insert(lower_ck, child);
        self.nodes.push(RefNode {
            parent,
            children,
            namespace,
            key: upper_key,
            value: upper_value,
            lock_ref,
            last_access: t,
            created: t,
            hit_count,
            priority,
            alive: true,
        });
        self.nodes[child].parent = id;
        self.nodes[parent].children.insert(upper_ck, id);
        id
    }

    /// Longest cached prefix of `key` in `namespace`: its slots and its last node.
    pub fn match_prefix(&mut self, namespace: u64, key: &[u32]) -> (Vec<u32>, RefNodeId) {
        let key = &key[..key.len() / self.page_size * self.page_size];
        let mut value = Vec::new();
        if key.is_empty() {
            return (value, RefNodeId(ROOT));
        }
        let mut node = ROOT;
        self.touch(ROOT);
        let mut rest = key;
        while !rest.is_empty() {
            let ck = self.child_key(namespace, rest);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.touch(child);
            self.nodes[child].hit_count += 1;
            let n = self.key_match(&self.nodes[child].key, rest);
            if n < self.nodes[child].key.len() {
                let upper = self.split(child, n);
                value.extend_from_slice(&self.nodes[upper].value);
                node = upper;
                break;
            }
            value.extend_from_slice(&self.nodes[child].value);
            node = child;
            rest = &rest[n..];
        }
        (value, RefNodeId(node))
    }

    /// Insert `key -> value` (page-aligned lengths); returns how many leading tokens
    /// were already cached. `priority` raises the priority of every node on the path.
    ///
    /// # Panics
    ///
    /// If the lengths differ or are not whole pages (this is a test model).
    pub fn insert(&mut self, namespace: u64, key: &[u32], value: &[u32], priority: i64) -> usize {
        assert_eq!(key.len(), value.len(), "key and value lengths differ");
        assert_eq!(key.len() % self.page_size, 0, "insert of a partial page");
        let mut node = ROOT;
        self.touch(ROOT);
        let (mut key, mut value) = (key, value);
        let mut total = 0;
        while !key.is_empty() {
            let ck = self.child_key(namespace, key);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            node = child;
            self.touch(node);
            let n = self.key_match(&self.nodes[node].key, key);
            total += n;
            key = &key[n..];
            value = &value[n..];
            if n < self.nodes[node].key.len() {
                node = self.split(node, n);
            }
            self.nodes[node].priority = self.nodes[node].priority.max(priority);
        }
        if !key.is_empty() {
            let t = self.tick();
            let id = self.nodes.len();
            let ck = self.child_key(namespace, key);
            self.nodes.push(RefNode {
                parent: node,
                children: HashMap::new(),
                namespace,
                key: key.to_vec(),
                value: value.to_vec(),
                lock_ref: 0,
                last_access: t,
                created: t,
                hit_count: 0,
                priority,
                alive: true,
            });
            self.nodes[node].children.insert(ck, id);
            self.evictable += key.len();
        }
        total
    }

    /// Lock the path from `node` to the root against eviction.
    pub fn inc_lock_ref(&mut self, node: RefNodeId) {
        let mut n = node.0;
        while n != ROOT {
            let len = self.nodes[n].key.len();
            if self.nodes[n].lock_ref == 0 {
                self.evictable -= len;
                self.protected += len;
            }
            self.nodes[n].lock_ref += 1;
            n = self.nodes[n].parent;
        }
    }

    /// Undo one [`inc_lock_ref`](Self::inc_lock_ref).
    pub fn dec_lock_ref(&mut self, node: RefNodeId) {
        let mut n = node.0;
        while n != ROOT {
            let len = self.nodes[n].key.len();
            if self.nodes[n].lock_ref == 1 {
                self.evictable += len;
                self.protected -= len;
            }
            self.nodes[n].lock_ref -= 1;
            n = self.nodes[n].parent;
        }
    }

    fn evict_key(&self, n: usize) -> (i64, u64) {
        let x = &self.nodes[n];
        self.policy.key(x.last_access, x.created, x.hit_count, x.priority)
    }

    fn is_evictable_leaf(&self, n: usize) -> bool {
        let x = &self.nodes[n];
        n != ROOT && x.alive && x.lock_ref == 0 && x.children.is_empty()
    }

    /// Evict unlocked leaves in policy order until at least `num_tokens` tokens were
    /// freed (or nothing evictable is left); returns the tokens freed.
    pub fn evict(&mut self, num_tokens: usize) -> usize {
        let mut heap: BinaryHeap<std::cmp::Reverse<((i64, u64), usize)>> = (0..self.nodes.len())
            .filter(|&n| self.is_evictable_leaf(n))
            .map(|n| std::cmp::Reverse((self.evict_key(n), n)))
            .collect();
        let mut freed = 0;
        while freed < num_tokens {
            let Some(std::cmp::Reverse((_, x))) = heap.pop() else { break };
            let value = std::mem::take(&mut self.nodes[x].value);
            self.alloc.free(&value).expect("reference cache frees slots it owns");
            freed += value.len();
            let parent = self.nodes[x].parent;
            let ck = self.child_key(self.nodes[x].namespace, &self.nodes[x].key);
            self.nodes[parent].children.remove(&ck);
            self.evictable -= self.nodes[x].key.len();
            self.nodes[x].alive = false;
            self.nodes[x].key.clear();
            if self.is_evictable_leaf(parent) {
                heap.push(std::cmp::Reverse((self.evict_key(parent), parent)));
            }
        }
        freed
    }

    /// Tokens in unlocked nodes.
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Tokens in locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().skip(1).filter(|n| n.alive).count()
    }

    /// Tokens cached.
    pub fn total_size(&self) -> usize {
        self.nodes.iter().skip(1).filter(|n| n.alive).map(|n| n.value.len()).sum()
    }

    /// SGLang's `cache_finished_req`: `token_ids` are the request's tokens with KV (prompt
    /// plus outputs minus the last), `kv_indices` their slots, `cache_protected_len` the
    /// length the request got from (and locked in) the cache, `last_node` the node it
    /// locked. Inserts the page-aligned part, frees duplicates and the unaligned tail,
    /// unlocks. Returns the prefix length the insert found.
    pub fn cache_finished_req(
        &mut self,
        namespace: u64,
        token_ids: &[u32],
        kv_indices: &[u32],
        cache_protected_len: usize,
        last_node: RefNodeId,
        priority: i64,
    ) -> usize {
        let aligned = token_ids.len() / self.page_size * self.page_size;
        let new_prefix = self.insert(namespace, &token_ids[..aligned], &kv_indices[..aligned], priority);
        if new_prefix > cache_protected_len {
            self.alloc.free(&kv_indices[cache_protected_len..new_prefix]).expect("duplicate slots are owned");
        }
        self.alloc.free(&kv_indices[aligned..]).expect("tail slots are owned");
        self.dec_lock_ref(last_node);
        new_prefix
    }

    /// SGLang's `cache_unfinished_req` (chunked prefill): inserts the page-aligned part,
    /// frees duplicates, re-matches, rewrites `kv_indices[..aligned]` with the tree's
    /// slots, moves the lock to the new last node. Returns the new protected length and
    /// last node; the unaligned tail stays with the request.
    pub fn cache_unfinished_req(
        &mut self,
        namespace: u64,
        token_ids: &[u32],
        kv_indices: &mut [u32],
        cache_protected_len: usize,
        last_node: RefNodeId,
        priority: i64,
    ) -> (usize, RefNodeId) {
        let aligned = token_ids.len() / self.page_size * self.page_size;
        let new_prefix = self.insert(namespace, &token_ids[..aligned], &kv_indices[..aligned], priority);
        if new_prefix > cache_protected_len {
            self.alloc.free(&kv_indices[cache_protected_len..new_prefix]).expect("duplicate slots are owned");
        }
        let (slots, node) = self.match_prefix(namespace, &token_ids[..aligned]);
        assert_eq!(slots.len(), aligned);
        kv_indices[cache_protected_len..aligned].copy_from_slice(&slots[cache_protected_len..]);
        self.dec_lock_ref(last_node);
        self.inc_lock_ref(node);
        (aligned, node)
    }

    /// Every cached (namespace, key, value) path from the root to each leaf, sorted: a
    /// canonical view for comparing two trees whatever their node layout.
    pub fn leaf_paths(&self) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            if !n.alive || !n.children.is_empty() {
                continue;
            }
            let (mut k, mut v) = (Vec::new(), Vec::new());
            let mut x = i;
            while x != ROOT {
                k.splice(0..0, self.nodes[x].key.iter().copied());
                v.splice(0..0, self.nodes[x].value.iter().copied());
                x = self.nodes[x].parent;
            }
            out.push((n.namespace, k, v));
        }
        out.sort();
        out
    }

    /// Drop every cached node (their slots go back to the allocator) and unlock all.
    pub fn reset(&mut self) {
        for i in 1..self.nodes.len() {
            if self.nodes[i].alive {
                let value = std::mem::take(&mut self.nodes[i].value);
                self.alloc.free(&value).expect("cached slots are owned");
            }
        }
        self.reset_tree();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenAllocator;

    fn cache(size: usize) -> ReferenceRadixCache<TokenAllocator> {
        ReferenceRadixCache::new(TokenAllocator::new(size).unwrap(), EvictionPolicy::Lru).unwrap()
    }

    #[test]
    fn design_vectors() {
        let mut c = cache(64);
        assert_eq!(c.insert(0, &[1, 2, 3], &[11, 12, 13], 0), 0);
        assert_eq!((c.total_size(), c.evictable_size()), (3, 3));
        assert_eq!(c.match_prefix(0, &[1, 2]).0, vec![11, 12]);

        let mut c = cache(64);
        let k: Vec<u32> = (1..=8).collect();
        let v: Vec<u32> = (101..=108).collect();
        c.insert(0, &k, &v, 0);
        assert_eq!(c.insert(0, &[1, 2, 9, 10], &[201, 202, 203, 204], 0), 2);
        assert_eq!(c.total_size(), 10);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 999, 1000]).0, vec![101, 102, 103, 104]);
    }

    #[test]
    fn locks_move_sizes_on_zero_one() {
        let mut c = cache(64);
        c.insert(0, &[1, 2, 3], &[1, 2, 3], 0);
        let (_, n) = c.match_prefix(0, &[1, 2]); // splits [1,2] | [3]
        c.inc_lock_ref(n);
        assert_eq!((c.evictable_size(), c.protected_size()), (1, 2));
        c.inc_lock_ref(n);
        assert_eq!((c.evictable_size(), c.protected_size()), (1, 2));
        c.dec_lock_ref(n);
        c.dec_lock_ref(n);
        assert_eq!((c.evictable_size(), c.protected_size()), (3, 0));
    }

    #[test]
    fn namespaces_do_not_share() {
        let mut c = cache(64);
        c.insert(1, &[1, 2, 3], &[1, 2, 3], 0);
        assert_eq!(c.insert(2, &[1, 2, 3], &[4, 5, 6], 0), 0);
        assert_eq!(c.match_prefix(2, &[1, 2, 3]).0, vec![4, 5, 6]);
        assert_eq!(c.total_size(), 6);
    }

    #[test]
    fn paged_match_is_page_aligned() {
        let alloc = crate::PagedAllocator::new(64, 4).unwrap();
        let mut c = ReferenceRadixCache::new(alloc, EvictionPolicy::Lru).unwrap();
        let k: Vec<u32> = (1..=8).collect();
        c.insert(0, &k, &(4..12).collect::<Vec<_>>(), 0);
        // 7 tokens -> one page only; a mismatch inside the second page -> one page
        assert_eq!(c.match_prefix(0, &k[..7]).0.len(), 4);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 99]).0.len(), 4);
        assert_eq!(c.match_prefix(0, &k).0.len(), 8);
    }
}
