//! [`ReferenceHiCache`]: a plain sequential radix cache with a host tier (SGLang's
//! `HiRadixCache`), the model the two-tier tree is specified by and tested against.
//!
//! Every node holds its tokens' device slots, their host pages, or both:
//!
//! * **device-resident** (`value` is `Some`): the KV is on the device; it may also be
//!   *backed up* (`host` is `Some`), a copy in host memory;
//! * **evicted** (`value` is `None`): the device KV is gone, the host copy stays. Along
//!   any path from the root the device-resident nodes come first: the device part of a
//!   match is a prefix, the host part its continuation.
//!
//! Rules (SGLang's, with a logical clock, transfers completing at once):
//!
//! * `match_prefix` walks every node on the key's path (splitting a node the key ends
//!   inside, device and host values alike), touching each; it returns the device slots
//!   of the device-resident prefix, its last node, and the length and last node of the
//!   host-only continuation;
//! * `insert` walks the same way. A device-resident node it passes counts one *write
//!   hit*; an evicted node takes the caller's slots as its device value again (the
//!   request recomputed that KV) and does not count as cached; a new leaf is device
//!   resident and counts one write hit unless the policy is `write_back`. Returns the
//!   device-resident prefix length the caller's slots duplicate;
//! * write policies: `write_through` backs a node up when its write hits reach 1,
//!   `write_through_selective` at 2, `write_back` only when the device evicts it. A
//!   backup takes host pages (one per device page), evicting host-only leaves when the
//!   host pool is short; with no room even then, the node stays device-only;
//! * device eviction (`evict`) takes device leaves (device-resident, unlocked, every
//!   child evicted) in policy order: a backed-up node drops its device value and stays
//!   (evicted); under `write_back` a node not yet backed up is backed up first; a node
//!   without a host copy is removed with its host-only descendants, their host pages
//!   freed (SGLang deletes the node and leaves that subtree unreachable, its host pages
//!   lost: the one deliberate difference);
//! * host eviction (`evict_host`) removes evicted leaves in LRU order and frees their
//!   host pages; a parent left an evicted leaf follows;
//! * `load_back` gives the host continuation of a match device slots again, all or
//!   nothing (evicting device leaves for room, the device prefix and the host copies
//!   being loaded locked meanwhile), and
//!   does nothing below `load_back_threshold` tokens (SGLang's 10) or above a quota.
//!
//! Transfers (the copies between the tiers) are the caller's, as in the tree: every
//! backup and load-back starts one ([`take_transfers`](ReferenceHiCache::take_transfers),
//! [`complete`](ReferenceHiCache::complete)). Until it completes, a backup
//! (`write_through`) or load keeps its node's path locked on the device; a write-back
//! (the device evicting under `write_back`) keeps its host pages: not host-evicted, not
//! loaded back, and if their node leaves the tree, freed only when it completes.
//!
//! It takes `&mut self`, allocates freely and favours being obviously right.

use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};

use crate::alloc::KvAllocator;
use crate::error::ConfigError;
use crate::radix::EvictionPolicy;

pub use crate::radix::{TransferKind, WritePolicy, DEFAULT_LOAD_BACK_THRESHOLD};

/// A transfer in flight in a [`ReferenceHiCache`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefTransfer {
    /// Its number, in start order from 0.
    pub id: u64,
    /// Which way and what it holds.
    pub kind: TransferKind,
    /// The node whose path it locks (backups and loads); `None` once a reset dropped
    /// the tree under it.
    node: Option<usize>,
    /// Its host pages.
    pub pages: Vec<u32>,
    /// The device slots the copy reads (a backup) or writes (a load); empty otherwise.
    device: Vec<u32>,
}

/// A host page pool model: pages `1..=pages`, handed out lowest first (with the slot
/// pool's placement of claims of 64 or more over sparse words, see `kvpool::slots`).
#[derive(Clone, Debug)]
pub struct HostPages {
    free: BTreeSet<u32>,
    pages: u32,
}

impl HostPages {
    /// A pool of `pages` host pages.
    pub fn new(pages: u32) -> HostPages {
        HostPages { free: (1..=pages).collect(), pages }
    }

    /// `n` pages, lowest first (as the host tier's slot pool places them), or `None`
    /// (nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let got = crate::slots::placement(self.free.iter().copied(), n);
        for p in &got {
            self.free.remove(p);
        }
        Some(got)
    }

    /// Give `pages` back.
    ///
    /// # Panics
    ///
    /// If a page is out of range or free already (this is a test model).
    pub fn free(&mut self, pages: &[u32]) {
        for &p in pages {
            assert!(p >= 1 && p <= self.pages && self.free.insert(p), "host page {p} freed twice or out of range");
        }
    }

    /// Free pages.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// All pages.
    pub fn capacity(&self) -> usize {
        self.pages as usize
    }
}

/// A node of a [`ReferenceHiCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HiNodeId(pub usize);

#[derive(Debug)]
struct HiNode {
    parent: usize,
    children: HashMap<(u64, Vec<u32>), usize>,
    namespace: u64,
    key: Vec<u32>,
    /// Device slots, one per token; `None` once evicted from the device.
    value: Option<Vec<u32>>,
    /// Host pages, one per page of `key`, once backed up.
    host: Option<Vec<u32>>,
    lock_ref: u32,
    /// Load-backs in progress: the host copy must stay (SGLang's host reference count).
    host_lock: u32,
    last_access: u64,
    created: u64,
    hit_count: u64,
    write_hits: u64,
    alive: bool,
}

/// What a [`ReferenceHiCache::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HiMatch {
    /// Device slots of the device-resident prefix.
    pub device: Vec<u32>,
    /// The last device-resident node of the match (the root for none).
    pub device_node: HiNodeId,
    /// Tokens of the host-only continuation.
    pub host_len: usize,
    /// Its last node (`device_node` when there is none).
    pub host_node: HiNodeId,
}

pub use crate::radix::HiCounters;

/// A plain sequential two-tier radix cache (see the module docs).
#[derive(Debug)]
pub struct ReferenceHiCache<A> {
    alloc: A,
    host: HostPages,
    ps: usize,
    policy: EvictionPolicy,
    write: WritePolicy,
    load_back_threshold: usize,
    nodes: Vec<HiNode>,
    clock: u64,
    evictable: usize,
    protected: usize,
    counters: HiCounters,
    transfers: Vec<RefTransfer>,
    next_transfer: u64,
    queue: VecDeque<u64>,
    in_flight: BTreeSet<u32>,
    /// Host pages in flight whose node left the tree.
    orphans: BTreeSet<u32>,
}

const ROOT: usize = 0;

fn root() -> HiNode {
    HiNode {
        parent: ROOT,
        children: HashMap::new(),
        namespace: 0,
        key: Vec::new(),
        value: Some(Vec::new()),
        host: Some(Vec::new()),
        lock_ref: 1,
        host_lock: 0,
        last_access: 0,
        created: 0,
        hit_count: 0,
        write_hits: 0,
        alive: true,
    }
}

impl<A: KvAllocator> ReferenceHiCache<A> {
    /// An empty cache over the device allocator `alloc` and `host_pages` host pages of
    /// the device's page size.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::hicache_ref::{ReferenceHiCache, WritePolicy};
    /// use kvpool::{radix::EvictionPolicy, PagedAllocator};
    /// let mut c = ReferenceHiCache::new(PagedAllocator::new(8, 4)?, 4, EvictionPolicy::Lru, WritePolicy::WriteThrough, 1)?;
    /// let mut a = [0u32; 8];
    /// kvpool::KvAllocator::alloc(c.allocator(), &mut a)?;
    /// assert_eq!(c.insert(0, &[1, 2, 3, 4, 5, 6, 7, 8], &a), 0); // a backup starts at once
    /// assert_eq!(c.evict(8), 0); // locked while the backup is in flight
    /// for t in c.take_transfers() {
    ///     c.complete(t.id);
    /// }
    /// assert_eq!(c.evict(8), 8); // the device copy goes, the host copy stays
    /// let m = c.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 8]);
    /// assert_eq!((m.device.len(), m.host_len), (0, 8));
    /// let slots = c.load_back(m.host_node, None).expect("room on the device");
    /// assert_eq!(slots.len(), 8);
    /// assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 8]).device, slots);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] when the allocator's page size is 0.
    pub fn new(
        alloc: A,
        host_pages: u32,
        policy: EvictionPolicy,
        write: WritePolicy,
        load_back_threshold: usize,
    ) -> Result<Self, ConfigError> {
        let ps = alloc.page_size() as usize;
        if ps == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        Ok(ReferenceHiCache {
            alloc,
            host: HostPages::new(host_pages),
            ps,
            policy,
            write,
            load_back_threshold,
            nodes: vec![root()],
            clock: 0,
            evictable: 0,
            protected: 0,
            counters: HiCounters::default(),
            transfers: Vec::new(),
            next_transfer: 0,
            queue: VecDeque::new(),
            in_flight: BTreeSet::new(),
            orphans: BTreeSet::new(),
        })
    }

    /// The device allocator.
    pub fn allocator(&self) -> &A {
        &self.alloc
    }

    /// The host page pool.
    pub fn host(&self) -> &HostPages {
        &self.host
    }

    /// What moved between the tiers so far.
    pub fn counters(&self) -> HiCounters {
        self.counters
    }

    /// The root node.
    pub fn root(&self) -> HiNodeId {
        HiNodeId(ROOT)
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

    /// Common prefix of `a` and `b` in whole pages.
    fn key_match(&self, a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count() / self.ps * self.ps
    }

    fn evicted(&self, n: usize) -> bool {
        self.nodes[n].value.is_none()
    }

    /// Cut `child` after `at` tokens: a new upper node (stamped now) with the first part
    /// of its key, device value and host pages, its lock and hit counts; `child` keeps
    /// the rest.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let t = self.tick();
        let ps = self.ps;
        let c = &mut self.nodes[child];
        let upper_key: Vec<u32> = c.key.drain(..at).collect();
        let upper_value = c.value.as_mut().map(|v| v.drain(..at).collect::<Vec<u32>>());
        let upper_host = c.host.as_mut().map(|h| h.drain(..at / ps).collect::<Vec<u32>>());
        let (parent, namespace, lock_ref, host_lock, hit_count, write_hits) =
            (c.parent, c.namespace, c.lock_ref, c.host_lock, c.hit_count, c.write_hits);
        let lower_ck = (namespace, c.key[..ps].to_vec());
        let upper_ck = (namespace, upper_key[..ps].to_vec());
        let id = self.nodes.len();
        self.nodes.push(HiNode {
            parent,
            children: HashMap::from([(lower_ck, child)]),
            namespace,
            key: upper_key,
            value: upper_value,
            host: upper_host,
            lock_ref,
            host_lock,
            last_access: t,
            created: t,
            hit_count,
            write_hits,
            alive: true,
        });
        self.nodes[child].parent = id;
        self.nodes[parent].children.insert(upper_ck, id);
        id
    }

    /// The key's cached path: device slots of its device-resident prefix, and the length
    /// of its host-only continuation (see the module docs).
    pub fn match_prefix(&mut self, namespace: u64, key: &[u32]) -> HiMatch {
        let key = &key[..key.len() / self.ps * self.ps];
        let mut device = Vec::new();
        let mut node = ROOT;
        if !key.is_empty() {
            self.touch(ROOT);
        }
        let mut rest = key;
        while !rest.is_empty() {
            let ck = self.child_key(namespace, rest);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.touch(child);
            self.nodes[child].hit_count += 1;
            let n = self.key_match(&self.nodes[child].key, rest);
            let next = if n < self.nodes[child].key.len() { self.split(child, n) } else { child };
            if let Some(v) = &self.nodes[next].value {
                device.extend_from_slice(v);
            }
            node = next;
            if next != child {
                break;
            }
            rest = &rest[n..];
        }
        let host_node = node;
        let mut host_len = 0;
        while self.evicted(node) {
            host_len += self.nodes[node].key.len();
            node = self.nodes[node].parent;
        }
        debug_assert_eq!(device.len() + host_len, self.depth_tokens(host_node));
        HiMatch { device, device_node: HiNodeId(node), host_len, host_node: HiNodeId(host_node) }
    }

    fn depth_tokens(&self, mut n: usize) -> usize {
        let mut len = 0;
        while n != ROOT {
            len += self.nodes[n].key.len();
            n = self.nodes[n].parent;
        }
        len
    }

    /// One write hit on device-resident node `n`: back it up at the policy's threshold.
    fn write_hit(&mut self, n: usize) {
        let Some(threshold) = self.write.threshold() else { return };
        if self.nodes[n].host.is_some() {
            return;
        }
        self.nodes[n].write_hits += 1;
        if self.nodes[n].write_hits >= threshold {
            self.backup(n, TransferKind::Backup);
        }
    }

    /// Copy node `n` to host pages (evicting host-only leaves for room) with a transfer
    /// of `kind`; whether it is backed up now.
    fn backup(&mut self, n: usize, kind: TransferKind) -> bool {
        if self.nodes[n].host.is_some() {
            return true;
        }
        let pages = self.nodes[n].key.len() / self.ps;
        if self.host.available() < pages {
            self.evict_host((pages - self.host.available()) * self.ps);
        }
        match self.host.alloc(pages) {
            Some(h) => {
                self.nodes[n].host = Some(h.clone());
                self.counters.written += self.nodes[n].key.len() as u64;
                self.start(kind, n, h);
                true
            }
            None => {
                self.counters.backup_refused += 1;
                false
            }
        }
    }

    /// Insert `key -> value` (page-aligned, the caller's device slots); returns the
    /// length of the device-resident prefix the caller's slots duplicate (see the
    /// module docs).
    ///
    /// # Panics
    ///
    /// If the lengths differ or are not whole pages (this is a test model).
    pub fn insert(&mut self, namespace: u64, key: &[u32], value: &[u32]) -> usize {
        assert_eq!(key.len(), value.len(), "key and value lengths differ");
        assert_eq!(key.len() % self.ps, 0, "insert of a partial page");
        let mut node = ROOT;
        self.touch(ROOT);
        let (mut key, mut value) = (key, value);
        let mut total = 0;
        while !key.is_empty() {
            let ck = self.child_key(namespace, key);
            let Some(&child) = self.nodes[node].children.get(&ck) else { break };
            self.touch(child);
            let n = self.key_match(&self.nodes[child].key, key);
            node = if n < self.nodes[child].key.len() { self.split(child, n) } else { child };
            if self.evicted(node) {
                // The request recomputed this KV: its slots become the node's again.
                self.nodes[node].value = Some(value[..n].to_vec());
                if self.nodes[node].lock_ref == 0 {
                    self.evictable += n;
                } else {
                    self.protected += n;
                }
            } else {
                self.write_hit(node);
                total += n;
            }
            key = &key[n..];
            value = &value[n..];
        }
        if !key.is_empty() {
            let id = self.push_leaf(node, namespace, key, Some(value.to_vec()), None);
            self.evictable += key.len();
            self.write_hit(id);
        }
        total
    }

    /// A new leaf under `parent` (stamped now) holding `key` with these values.
    fn push_leaf(
        &mut self,
        parent: usize,
        namespace: u64,
        key: &[u32],
        value: Option<Vec<u32>>,
        host: Option<Vec<u32>>,
    ) -> usize {
        let t = self.tick();
        let id = self.nodes.len();
        let ck = self.child_key(namespace, key);
        self.nodes.push(HiNode {
            parent,
            children: HashMap::new(),
            namespace,
            key: key.to_vec(),
            value,
            host,
            lock_ref: 0,
            host_lock: 0,
            last_access: t,
            created: t,
            hit_count: 0,
            write_hits: 0,
            alive: true,
        });
        self.nodes[parent].children.insert(ck, id);
        id
    }

    /// Lock the device-resident path from `node` to the root against eviction.
    ///
    /// # Panics
    ///
    /// If `node` is evicted (this is a test model).
    pub fn inc_lock_ref(&mut self, node: HiNodeId) {
        assert!(!self.evicted(node.0), "lock of an evicted node");
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
    pub fn dec_lock_ref(&mut self, node: HiNodeId) {
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

    fn is_device_leaf(&self, n: usize) -> bool {
        let x = &self.nodes[n];
        n != ROOT
            && x.alive
            && x.value.is_some()
            && x.lock_ref == 0
            && x.children.values().all(|&c| self.nodes[c].value.is_none())
    }

    fn evict_key(&self, n: usize) -> (i64, u64) {
        let x = &self.nodes[n];
        self.policy.key(x.last_access, x.created, x.hit_count, 0)
    }

    /// Remove node `n` and its subtree (every node below is evicted: host pages only).
    fn remove_subtree(&mut self, n: usize) {
        let mut stack = vec![n];
        while let Some(x) = stack.pop() {
            stack.extend(self.nodes[x].children.values().copied());
            if let Some(h) = self.nodes[x].host.take() {
                self.counters.host_evicted += (h.len() * self.ps) as u64;
                for p in h {
                    if self.in_flight.contains(&p) {
                        self.orphans.insert(p);
                    } else {
                        self.host.free(&[p]);
                    }
                }
            }
            self.nodes[x].children.clear();
            self.nodes[x].alive = false;
        }
        let parent = self.nodes[n].parent;
        let ck = self.child_key(self.nodes[n].namespace, &self.nodes[n].key);
        self.nodes[parent].children.remove(&ck);
    }

    /// Free device tokens: take device leaves in policy order until at least
    /// `num_tokens` were freed or none is left; returns the device tokens freed.
    pub fn evict(&mut self, num_tokens: usize) -> usize {
        let mut heap: BinaryHeap<std::cmp::Reverse<((i64, u64), usize)>> = (0..self.nodes.len())
            .filter(|&n| self.is_device_leaf(n))
            .map(|n| std::cmp::Reverse((self.evict_key(n), n)))
            .collect();
        let mut freed = 0;
        while freed < num_tokens {
            let Some(std::cmp::Reverse((_, x))) = heap.pop() else { break };
            if self.write == WritePolicy::WriteBack {
                self.backup(x, TransferKind::WriteBack);
            }
            let value = self.nodes[x].value.take().expect("device leaves are device-resident");
            self.alloc.free(&value).expect("the cache frees slots it owns");
            freed += value.len();
            self.evictable -= value.len();
            self.counters.device_evicted += value.len() as u64;
            let parent = self.nodes[x].parent;
            if self.nodes[x].host.is_none() {
                self.remove_subtree(x);
            }
            if self.is_device_leaf(parent) {
                heap.push(std::cmp::Reverse((self.evict_key(parent), parent)));
            }
        }
        freed
    }

    fn is_host_leaf(&self, n: usize) -> bool {
        let x = &self.nodes[n];
        n != ROOT
            && x.alive
            && x.value.is_none()
            && x.children.is_empty()
            && x.lock_ref == 0
            && x.host_lock == 0
            && !self.host_in_flight(n)
    }

    fn host_in_flight(&self, n: usize) -> bool {
        !self.in_flight.is_empty()
            && self.nodes[n].host.as_ref().is_some_and(|h| h.iter().any(|p| self.in_flight.contains(p)))
    }

    fn start(&mut self, kind: TransferKind, node: usize, pages: Vec<u32>) {
        for &p in &pages {
            assert!(self.in_flight.insert(p), "host page {p} in two transfers");
        }
        let mut device = Vec::new();
        if matches!(kind, TransferKind::Backup | TransferKind::Load) {
            self.inc_lock_ref(HiNodeId(node));
            device = self.nodes[node].value.clone().expect("a backup or load has device slots");
        }
        let id = self.next_transfer;
        self.next_transfer += 1;
        self.transfers.push(RefTransfer { id, kind, node: Some(node), pages, device });
        self.queue.push_back(id);
    }

    /// The transfers started since the last call, oldest first (each reported once;
    /// those completed meanwhile are left out).
    pub fn take_transfers(&mut self) -> Vec<RefTransfer> {
        let mut out = Vec::new();
        while let Some(id) = self.queue.pop_front() {
            if let Some(t) = self.transfers.iter().find(|t| t.id == id) {
                out.push(t.clone());
            }
        }
        out
    }

    /// Transfer `id` is done: release what it held. Whether it was in flight.
    pub fn complete(&mut self, id: u64) -> bool {
        let Some(i) = self.transfers.iter().position(|t| t.id == id) else { return false };
        let t = self.transfers.remove(i);
        for p in &t.pages {
            self.in_flight.remove(p);
            if self.orphans.remove(p) {
                self.host.free(&[*p]);
            }
        }
        match t.node {
            Some(node) if matches!(t.kind, TransferKind::Backup | TransferKind::Load) => {
                self.dec_lock_ref(HiNodeId(node));
            }
            // Outlived a reset: its device slots were kept for it.
            None => self.alloc.free(&t.device).expect("a reset kept these slots"),
            Some(_) => {}
        }
        true
    }

    /// kvpool's `reset` (SGLang's `reset` under `flush_cache`, which runs only with no
    /// request in flight): the tree is dropped, its device slots and host pages freed.
    /// Transfers not yet taken are dropped with it; those taken outlive it (their copies
    /// may be running): their host pages stay held, a backup's or load's device slots
    /// stay allocated, until they complete. The caller holds no lock on the tree.
    pub fn reset(&mut self) {
        let queued: BTreeSet<u64> = self.queue.drain(..).collect();
        let mut kept = BTreeSet::new();
        let mut i = 0;
        while i < self.transfers.len() {
            if queued.contains(&self.transfers[i].id) {
                let t = self.transfers.remove(i);
                for p in &t.pages {
                    self.in_flight.remove(p);
                    if self.orphans.remove(p) {
                        self.host.free(&[*p]);
                    }
                }
                continue;
            }
            // Only a backup's or load's `device` is not empty.
            let t = &mut self.transfers[i];
            t.node = None;
            kept.extend(t.device.iter().copied());
            i += 1;
        }
        for n in 1..self.nodes.len() {
            if !self.nodes[n].alive {
                continue;
            }
            if let Some(v) = self.nodes[n].value.take() {
                let v: Vec<u32> = v.into_iter().filter(|x| !kept.contains(x)).collect();
                self.alloc.free(&v).expect("the cache frees slots it owns");
            }
            for p in self.nodes[n].host.take().unwrap_or_default() {
                if self.in_flight.contains(&p) {
                    self.orphans.insert(p);
                } else {
                    self.host.free(&[p]);
                }
            }
        }
        self.nodes = vec![root()];
        (self.evictable, self.protected) = (0, 0);
    }

    /// SGLang has no such call (its storage prefetch lives in the cache controller):
    /// the part of `key` (whole pages) the tree does not hold, on the device or host, is
    /// added as an evicted (host-only) node with fresh host pages and a
    /// [`TransferKind::Prefetch`] to fill them; host leaves are evicted for room, never
    /// the key's own path. Walks (touches, splits) as [`match_prefix`](Self::match_prefix).
    /// Returns the tokens added: 0 when all is held or the host has no room.
    pub fn insert_host(&mut self, namespace: u64, key: &[u32]) -> usize {
        let key = &key[..key.len() / self.ps * self.ps];
        let m = self.match_prefix(namespace, key);
        let end = m.host_node.0;
        let held = self.depth_tokens(end);
        let pages = (key.len() - held) / self.ps;
        if pages == 0 {
            return 0;
        }
        let mut chain = Vec::new();
        let mut x = end;
        while x != ROOT && self.evicted(x) {
            chain.push(x);
            self.nodes[x].host_lock += 1;
            x = self.nodes[x].parent;
        }
        if self.host.available() < pages {
            self.evict_host((pages - self.host.available()) * self.ps);
        }
        let got = self.host.alloc(pages);
        for &x in &chain {
            self.nodes[x].host_lock -= 1;
        }
        let Some(h) = got else { return 0 };
        let rest = &key[held..];
        let id = self.push_leaf(end, namespace, rest, None, Some(h.clone()));
        self.start(TransferKind::Prefetch, id, h);
        self.counters.prefetched += rest.len() as u64;
        rest.len()
    }

    /// Leading tokens of `key` (whole pages) held in host pages; read-only.
    pub fn host_backed_len(&self, namespace: u64, key: &[u32]) -> usize {
        let (mut node, mut rest, mut len) = (ROOT, &key[..key.len() / self.ps * self.ps], 0);
        while !rest.is_empty() {
            let Some(&child) = self.nodes[node].children.get(&self.child_key(namespace, rest)) else { break };
            if self.nodes[child].host.is_none() {
                break;
            }
            let n = self.key_match(&self.nodes[child].key, rest);
            len += n;
            if n < self.nodes[child].key.len() {
                break;
            }
            (node, rest) = (child, &rest[n..]);
        }
        len
    }

    /// Transfers in flight.
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Free host tokens: remove evicted leaves, least recently used first, until at
    /// least `num_tokens` were freed or none is left; returns the host tokens freed.
    pub fn evict_host(&mut self, num_tokens: usize) -> usize {
        let mut heap: BinaryHeap<std::cmp::Reverse<(u64, usize)>> = (0..self.nodes.len())
            .filter(|&n| self.is_host_leaf(n))
            .map(|n| std::cmp::Reverse((self.nodes[n].last_access, n)))
            .collect();
        let mut freed = 0;
        while freed < num_tokens {
            let Some(std::cmp::Reverse((_, x))) = heap.pop() else { break };
            let before = self.counters.host_evicted;
            let parent = self.nodes[x].parent;
            self.remove_subtree(x);
            freed += (self.counters.host_evicted - before) as usize;
            if self.is_host_leaf(parent) {
                heap.push(std::cmp::Reverse((self.nodes[parent].last_access, parent)));
            }
        }
        freed
    }

    /// Load the host-only continuation ending at `host_node` back to the device: device
    /// slots for all of it (evicting device leaves for room) or `None` (nothing changed:
    /// a load that cannot get its slots even after evicting everything evictable evicts
    /// nothing) — also when it is shorter than the load-back threshold or longer than
    /// `quota` tokens. Returns the slots, in key order.
    pub fn load_back(&mut self, host_node: HiNodeId, quota: Option<usize>) -> Option<Vec<u32>> {
        let mut chain = Vec::new();
        let mut n = host_node.0;
        while self.evicted(n) {
            chain.push(n);
            n = self.nodes[n].parent;
        }
        chain.reverse();
        let total: usize = chain.iter().map(|&x| self.nodes[x].key.len()).sum();
        if total == 0
            || total < self.load_back_threshold
            || quota.is_some_and(|q| total > q)
            || chain.iter().any(|&x| self.host_in_flight(x))
        {
            return None;
        }
        let ancestor = HiNodeId(n);
        // The device prefix stays while room is made below it, and so do the host copies
        // being loaded (a `write_back` eviction makes host room for its backups).
        self.inc_lock_ref(ancestor);
        for &x in &chain {
            self.nodes[x].host_lock += 1;
        }
        // A load that cannot get its slots even after evicting all that is evictable
        // (the prefix locked) evicts nothing.
        let avail = self.alloc.available_size();
        let room = avail >= total || total - avail <= self.evictable;
        if room && avail < total {
            self.evict(total - avail);
        }
        let mut slots = vec![0u32; total];
        let got = room && self.alloc.alloc(&mut slots).is_ok();
        for &x in &chain {
            self.nodes[x].host_lock -= 1;
        }
        self.dec_lock_ref(ancestor);
        if !got {
            return None;
        }
        let mut at = 0;
        for &x in &chain {
            let len = self.nodes[x].key.len();
            self.nodes[x].value = Some(slots[at..at + len].to_vec());
            at += len;
            if self.nodes[x].lock_ref == 0 {
                self.evictable += len;
            } else {
                self.protected += len;
            }
            let pages = self.nodes[x].host.clone().expect("a loaded node keeps its host copy");
            self.start(TransferKind::Load, x, pages);
        }
        self.counters.loaded += total as u64;
        Some(slots)
    }

    /// SGLang's `cache_finished_req`: inserts the page-aligned part of `token_ids` with
    /// the request's slots `kv`, frees the duplicates past `protected` and the unaligned
    /// tail, unlocks `last_node`. Returns the device prefix the insert found.
    pub fn cache_finished_req(
        &mut self,
        namespace: u64,
        token_ids: &[u32],
        kv: &[u32],
        protected: usize,
        last_node: HiNodeId,
    ) -> usize {
        let aligned = token_ids.len() / self.ps * self.ps;
        let prefix = self.insert(namespace, &token_ids[..aligned], &kv[..aligned]);
        if prefix > protected {
            self.alloc.free(&kv[protected..prefix]).expect("duplicate slots are the request's");
        }
        self.alloc.free(&kv[aligned..token_ids.len()]).expect("tail slots are the request's");
        self.dec_lock_ref(last_node);
        prefix
    }

    /// Device tokens in unlocked nodes.
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Device tokens in locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// Tokens held in host pages.
    pub fn host_size(&self) -> usize {
        (self.host.capacity() - self.host.available()) * self.ps
    }

    /// Nodes, not counting the root.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().skip(1).filter(|n| n.alive).count()
    }

    /// Check the model's invariants: sizes, device residency a prefix of every path,
    /// every host page held once, every device slot allocated.
    ///
    /// # Errors
    ///
    /// The first broken invariant, described.
    pub fn check(&self) -> Result<(), String> {
        let (mut evictable, mut protected, mut host) = (0usize, 0usize, BTreeSet::new());
        for (i, x) in self.nodes.iter().enumerate().skip(1).filter(|(_, x)| x.alive) {
            if x.value.is_some() && self.nodes[x.parent].value.is_none() {
                return Err(format!("node {i} is on the device below an evicted parent"));
            }
            if x.value.is_none() && x.host.is_none() {
                return Err(format!("node {i} has neither device nor host KV"));
            }
            if let Some(v) = &x.value {
                if v.len() != x.key.len() || v.iter().any(|&s| !self.alloc.is_allocated(s)) {
                    return Err(format!("node {i}'s device value is not {} allocated slots", x.key.len()));
                }
                if x.lock_ref == 0 {
                    evictable += v.len();
                } else {
                    protected += v.len();
                }
            }
            if let Some(h) = &x.host {
                if h.len() * self.ps != x.key.len() || !h.iter().all(|&p| host.insert(p)) {
                    return Err(format!("node {i}'s host pages are wrong or shared"));
                }
            }
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "sizes: counted {evictable} / {protected}, kept {} / {}",
                self.evictable, self.protected
            ));
        }
        for t in &self.transfers {
            if t.pages.iter().any(|p| !self.in_flight.contains(p)) {
                return Err(format!("transfer {} has a page not in flight", t.id));
            }
        }
        if self.transfers.iter().map(|t| t.pages.len()).sum::<usize>() != self.in_flight.len() {
            return Err("pages in flight and transfers disagree".into());
        }
        for &p in &self.orphans {
            if !self.in_flight.contains(&p) || !host.insert(p) {
                return Err(format!("orphaned host page {p} not in flight, or held by a node"));
            }
        }
        if host.len() + self.host.available() != self.host.capacity() {
            return Err(format!(
                "{} host pages held, {} free, of {}",
                host.len(),
                self.host.available(),
                self.host.capacity()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PagedAllocator;

    fn cache(device: usize, host: u32, write: WritePolicy) -> ReferenceHiCache<PagedAllocator> {
        ReferenceHiCache::new(PagedAllocator::new(device, 2).unwrap(), host, EvictionPolicy::Lru, write, 1).unwrap()
    }

    /// Complete every transfer in flight (copies that take no time).
    fn settle(c: &mut ReferenceHiCache<PagedAllocator>) {
        for tr in c.take_transfers() {
            assert!(c.complete(tr.id));
        }
    }

    fn slots(c: &ReferenceHiCache<PagedAllocator>, n: usize) -> Vec<u32> {
        let mut s = vec![0u32; n];
        c.allocator().alloc(&mut s).unwrap();
        s
    }

    #[test]
    fn write_through_backs_up_on_insert_and_survives_device_eviction() {
        let mut c = cache(8, 8, WritePolicy::WriteThrough);
        let s = slots(&c, 4);
        assert_eq!(c.insert(0, &[1, 2, 3, 4], &s), 0);
        settle(&mut c);
        assert_eq!(c.counters().written, 4);
        assert_eq!(c.evict(4), 4);
        c.check().unwrap();
        let m = c.match_prefix(0, &[1, 2, 3, 4, 5, 6]);
        assert_eq!((m.device.len(), m.host_len), (0, 4));
        let back = c.load_back(m.host_node, None).unwrap();
        settle(&mut c);
        assert_eq!(c.counters().loaded, 4);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).device, back);
        c.check().unwrap();
    }

    #[test]
    fn selective_backs_up_at_the_second_hit_and_plain_eviction_drops_the_rest() {
        let mut c = cache(8, 8, WritePolicy::WriteThroughSelective);
        let s = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &s);
        settle(&mut c);
        assert_eq!(c.counters().written, 0);
        let dup = slots(&c, 4);
        assert_eq!(c.insert(0, &[1, 2, 3, 4], &dup), 4); // second hit: backed up
        settle(&mut c);
        c.allocator().free(&dup).unwrap();
        assert_eq!(c.counters().written, 4);
        let t = slots(&c, 2);
        c.insert(0, &[9, 9], &t); // one hit: device only
        settle(&mut c);
        assert_eq!(c.evict(8), 6);
        assert_eq!(c.node_count(), 1); // [9, 9] is gone, [1..4] stays on host
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).host_len, 4);
        c.check().unwrap();
    }

    #[test]
    fn write_back_copies_only_on_eviction() {
        let mut c = cache(8, 8, WritePolicy::WriteBack);
        let s = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &s);
        settle(&mut c);
        assert_eq!(c.counters().written, 0);
        c.evict(4);
        assert_eq!(c.counters().written, 4);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).host_len, 4);
        c.check().unwrap();
    }

    #[test]
    fn a_full_host_evicts_its_lru_leaves_and_removing_a_parent_frees_its_subtree() {
        let mut c = cache(16, 3, WritePolicy::WriteThrough);
        let a = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &a); // host pages 1, 2
        settle(&mut c);
        c.evict(4);
        let b = slots(&c, 2);
        c.insert(0, &[7, 7], &b); // host page 3
        settle(&mut c);
        c.evict(2);
        let d = slots(&c, 2);
        c.insert(0, &[8, 8], &d); // host full: [1..4] (LRU) is removed for room
        settle(&mut c);
        assert_eq!(c.counters().host_evicted, 4);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4]).host_len, 0);
        c.check().unwrap();
    }

    #[test]
    fn insert_over_an_evicted_node_takes_the_request_slots() {
        let mut c = cache(8, 8, WritePolicy::WriteThrough);
        let s = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &s);
        settle(&mut c);
        c.evict(4);
        let r = slots(&c, 6);
        // The evicted part is not a duplicate: the request's slots replace it.
        assert_eq!(c.insert(0, &[1, 2, 3, 4, 5, 6], &r), 0);
        settle(&mut c);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5, 6]).device, r);
        assert_eq!(c.counters().written, 6);
        c.check().unwrap();
    }

    #[test]
    fn load_back_below_the_threshold_or_without_room_changes_nothing() {
        let mut c = ReferenceHiCache::new(
            PagedAllocator::new(4, 2).unwrap(),
            8,
            EvictionPolicy::Lru,
            WritePolicy::WriteThrough,
            DEFAULT_LOAD_BACK_THRESHOLD,
        )
        .unwrap();
        let s = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &s);
        settle(&mut c);
        c.evict(4);
        let m = c.match_prefix(0, &[1, 2, 3, 4]);
        assert_eq!(c.load_back(m.host_node, None), None); // 4 < 10
        let mut c = cache(4, 8, WritePolicy::WriteThrough);
        let s = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &s);
        settle(&mut c);
        c.evict(4);
        let held = slots(&c, 4); // the device is full and nothing is evictable
        let m = c.match_prefix(0, &[1, 2, 3, 4]);
        assert_eq!(c.load_back(m.host_node, None), None);
        settle(&mut c);
        assert_eq!(c.load_back(m.host_node, Some(2)), None);
        settle(&mut c);
        c.allocator().free(&held).unwrap();
        assert_eq!(c.load_back(m.host_node, Some(4)).map(|v| v.len()), Some(4));
        settle(&mut c);
        c.check().unwrap();
    }

    #[test]
    fn a_split_cuts_both_values() {
        let mut c = cache(8, 8, WritePolicy::WriteThrough);
        let s = slots(&c, 6);
        c.insert(0, &[1, 2, 3, 4, 5, 6], &s);
        settle(&mut c);
        c.evict(6);
        let m = c.match_prefix(0, &[1, 2, 3, 4, 9, 9]);
        assert_eq!((m.device.len(), m.host_len), (0, 4));
        assert_eq!(c.node_count(), 2);
        c.check().unwrap();
        assert_eq!(WritePolicy::from_name("write_back"), Some(WritePolicy::WriteBack));
        assert_eq!(WritePolicy::default().name(), "write_through");
    }
}
