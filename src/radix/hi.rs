//! The host-tier variant of the radix core: [`HiRadixCache`], SGLang's `HiRadixCache`.
//!
//! A node's KV may be on the device (its pages are the allocator's: it is
//! *resident*), in host memory (*host-only*: the device copy was evicted), or both (a
//! resident node *backed up*). Along every path the resident nodes come first, so a
//! match is a device prefix followed by a host continuation.
//!
//! # One page space
//!
//! The core keys everything by pages (see the [parent module](super)): a node's tokens
//! live in its pages' token cells, its children are found under its last page. The host
//! pool's pages are numbered after the allocator's, in the same space: host page `h`
//! is tree page `num_pages + h`, with token cells, run records and an owner like any
//! device page. So a node is always *some* chain of pages:
//!
//! * a resident node's own pages are device pages; its host copy, if any, is a second
//!   chain of host pages kept in its payload (cut in step when the node is split);
//! * a host-only node's own pages are its host pages.
//!
//! Moving a node between the tiers swaps the two chains: the record is republished with
//! the other chain (readers holding it fail validation, as after a split), the node's
//! last page changes, and its children, which the core finds under their parent's last
//! page, are republished under the new one (each node keeps a list of its children for
//! this). Lock-free lookups ([`peek_prefix`](RadixCache::peek_prefix)) see a host-only
//! node's mark and end the device prefix before it.
//!
//! # Rules (SGLang's, checked against [`ReferenceHiCache`](crate::baseline::hicache_ref::ReferenceHiCache))
//!
//! * a match walks and touches the whole path, device and host nodes alike
//!   ([`match_tiers`](RadixCache::match_tiers)); it returns the device prefix and the
//!   length of the host continuation;
//! * an insert counts one *write hit* on each resident node it passes and on its new
//!   leaf; [`WritePolicy::WriteThrough`] backs a node up at its first,
//!   [`WritePolicy::WriteThroughSelective`] at its second, [`WritePolicy::WriteBack`]
//!   only on eviction. A host-only node the insert passes takes the request's slots
//!   (it recomputed that KV) and is resident again, its host copy kept;
//! * a backup takes host pages, evicting host leaves when short; with no room even
//!   then the node stays device-only;
//! * device eviction ([`evict`](RadixCache::evict)) takes resident leaves (every child
//!   host-only) in policy order: a backed-up node drops its device pages and stays as a
//!   host-only node; under `write_back` it is backed up first; a node without a host
//!   copy is removed with its host-only subtree;
//! * host eviction ([`evict_host`](RadixCache::evict_host)) removes host-only leaves,
//!   least recently used first;
//! * a request's [admission](RadixCache::admit) loads a host continuation back: device
//!   slots for all of it or nothing, skipped below the load-back threshold (SGLang's 10
//!   tokens) or above a quota; the device prefix and the host copies being loaded are
//!   locked while room is made, and a load that cannot get its slots even then evicts
//!   nothing.
//!
//! # Transfers
//!
//! The copies are the caller's (with [`DeviceHostTransfer`](crate::kv::host) under the
//! feature `cuda`, or any engine's own copy kernels); the tree decides them and holds
//! what they touch until the caller reports them done. Every backup and load-back
//! starts a [`Transfer`] of one node; [`take_transfers`](RadixCache::take_transfers)
//! hands them out once each, [`transfer_pages`](RadixCache::transfer_pages) gives its
//! (device page, host page) pairs, [`complete`](RadixCache::complete) ends it. Meanwhile
//! ([`TransferKind`]):
//!
//! * a **backup** (`write_through`, `write_through_selective`) keeps its node's path
//!   locked on the device, as SGLang's `write_backup` does: the pages being read are
//!   not evicted;
//! * a **load** keeps the loaded node's path locked on the device and its host copy;
//! * a **write-back** (the device evicting under `write_back`) frees the device pages
//!   at once (SGLang waits for its write-backs inside `evict`; here the copy must be
//!   ordered before any work that may write those pages) and holds its host pages: the
//!   host does not evict them and no load reads them. If their node leaves the tree
//!   meanwhile, the pages stay allocated until the transfer completes.
//!
//! * a **prefetch** fills the host pages of a host-only node the caller added with
//!   [`insert_host`](RadixCache::insert_host) — KV another engine put in a shared store
//!   tier ([`crate::store`]) — and holds them like a write-back's until it completes.
//!
//! A transfer names pages, not nodes, so splits while it is in flight change nothing;
//! there is a transfer slot per host page, so starting one never fails.
//! [`reset`](RadixCache::reset) drops the transfers not yet taken (no copy of theirs
//! can have started; their handles are refused afterwards). A transfer already taken
//! outlives the reset, since its copy may still be running: its host pages, and the
//! device pages a backup reads or a load writes, stay allocated, out of the tree, until
//! it [`complete`](RadixCache::complete)s, so no page a copy touches is handed out
//! again meanwhile. The tree records what moved in [`HiCounters`] when a copy starts.
//!
//! A cache built over a caller's [`HostKvPool`]
//! ([`with_host_pool`](RadixCache::with_host_pool)) owns it while it lives and gives
//! it back when dropped; the pages of transfers taken and not completed then stay
//! allocated for the caller to free once its copies are done (see there).
//!
//! Not combined with KV events or partial-leaf eviction (the constructor refuses the
//! first; the second is ignored).
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::radix::{HiRadixCache, HostTier, RadixConfig, Transfer, TransferKind, WritePolicy};
//! use kvpool::{PagedAllocator, ReqToTokenPool};
//!
//! // 8 device tokens, 8 host tokens, page size 2, back up at the first write hit.
//! let tier = HostTier { host_pages: 4, write_policy: WritePolicy::WriteThrough, load_back_threshold: 1 };
//! let cache = Arc::new(HiRadixCache::with_host_tier(PagedAllocator::new(8, 2)?, ReqToTokenPool::new(2, 8)?, RadixConfig::default(), tier)?);
//! let mut req = cache.admit(0, &[1, 2, 3, 4])?;
//! req.extend(4)?;
//! let a = req.slots().to_vec();
//! assert_eq!(req.finish(&[1, 2, 3, 4])?, 0); // a backup starts at once
//! let mut started = [Transfer::default(); 8];
//! assert_eq!(cache.take_transfers(&mut started), 1);
//! let backup = started[0];
//! let (mut device, mut host) = ([0u32; 2], [0u32; 2]);
//! cache.transfer_pages(backup, &mut device, &mut host)?;
//! assert_eq!((backup.kind(), device), (TransferKind::Backup, [a[0] / 2, a[2] / 2]));
//! assert_eq!(cache.evict(4), 0); // locked while the copy reads the device pages
//! // ... copy device pages `device` to host pages `host`, wait for it ...
//! cache.complete(backup)?;
//! assert_eq!(cache.evict(4), 4); // the device copy goes, the host copy stays
//! let mut out = [0u32; 4];
//! let m = cache.match_tiers(0, &[1, 2, 3, 4], &mut out);
//! assert_eq!((m.device.len(), m.host_len), (0, 4));
//! // A request for it loads it back (device slots again) and locks it; the load is a
//! // transfer too, which the request waits for before reading those slots.
//! let req = cache.admit(0, &[1, 2, 3, 4])?;
//! assert_eq!((req.cached_len(), req.host_hit().loaded), (4, 4));
//! assert_eq!(cache.take_transfers(&mut started), 1);
//! assert_eq!(started[0].kind(), TransferKind::Load);
//! cache.complete(started[0])?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt;
use core::sync::atomic::AtomicU64;

use super::heap::{self, Heap, Slot};
use super::variant::Variant;
use super::writer::{run_at, NewLeaf, Runs, Writer};
use super::LatchHeld;
use super::{CacheError, EvictionPolicy, Lease, MatchResult, Meta, RadixCache, RadixConfig, NIL, ROOT};
use crate::alloc::{KvAllocator, KvFreeGroup};
use crate::error::{ConfigError, Unit};
use crate::kv::host::{HostKvPool, HostPoolClaim};
use crate::req_to_token::{ReqRow, ReqToTokenPool};
use crate::slots::{bit_words, SlotPool};
use crate::sync::atomic::{fence, Ordering};
use std::sync::Arc;

/// When a node's KV is copied to host memory (SGLang's `--hicache-write-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WritePolicy {
    /// Back a node up at its first write hit (SGLang's default).
    #[default]
    WriteThrough,
    /// Back a node up at its second write hit.
    WriteThroughSelective,
    /// Back a node up only when the device evicts it.
    WriteBack,
}

impl WritePolicy {
    /// Every policy, in CLI order.
    pub const ALL: [WritePolicy; 3] =
        [WritePolicy::WriteThrough, WritePolicy::WriteThroughSelective, WritePolicy::WriteBack];

    /// The write hits that trigger a backup; `None` for `write_back`.
    pub fn threshold(self) -> Option<u64> {
        match self {
            WritePolicy::WriteThrough => Some(1),
            WritePolicy::WriteThroughSelective => Some(2),
            WritePolicy::WriteBack => None,
        }
    }

    /// SGLang's name: `write_through`, `write_through_selective`, `write_back`.
    pub fn name(self) -> &'static str {
        match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective => "write_through_selective",
            WritePolicy::WriteBack => "write_back",
        }
    }

    /// The policy named `name` (see [`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<WritePolicy> {
        WritePolicy::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// SGLang's `load_back_threshold`: host continuations shorter than this stay on host.
pub const DEFAULT_LOAD_BACK_THRESHOLD: usize = 10;

/// Token counts of what moved between the tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HiCounters {
    /// Tokens copied device -> host (backups).
    pub written: u64,
    /// Tokens copied host -> device (load-backs).
    pub loaded: u64,
    /// Device tokens freed by device eviction.
    pub device_evicted: u64,
    /// Host tokens freed by host eviction (and with removed subtrees).
    pub host_evicted: u64,
    /// Backups refused for lack of host room.
    pub backup_refused: u64,
    /// Tokens added on host from elsewhere ([`insert_host`](HiRadixCache::insert_host)).
    pub prefetched: u64,
}

/// What a [`Transfer`] copies, and what the tree holds until it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferKind {
    /// Device pages to host pages: a backup under `write_through` or
    /// `write_through_selective`. The node's path stays locked on the device (not
    /// evictable, its device pages unchanged) until the transfer completes.
    Backup,
    /// Device pages to host pages of a node the device evicted under `write_back`. The
    /// device pages are free already (as SGLang frees them once its write-back
    /// returns): enqueue this copy before any work that may write them — on the stream
    /// that runs the next forward pass, or one it waits on. The host pages are held
    /// (not evicted from host, not loaded back) until the transfer completes.
    WriteBack,
    /// Host pages to device pages: a load-back. The loaded node's path stays locked on
    /// the device and its host copy held until the transfer completes.
    Load,
    /// Into host pages from elsewhere (a shared store tier): a host-only node the caller
    /// added with [`insert_host`](HiRadixCache::insert_host). Its pages are held (not
    /// evicted from host, not loaded back) until the transfer completes; it has no
    /// device pages ([`transfer_pages`](HiRadixCache::transfer_pages) gives 0 for them).
    Prefetch,
}

impl TransferKind {
    /// Whether the copy writes host pages (a backup, write-back or prefetch); a load
    /// reads them.
    pub fn to_host(self) -> bool {
        !matches!(self, TransferKind::Load)
    }
}

/// A copy between the tiers that the tree started and the caller carries out (see
/// [`HiRadixCache::take_transfers`]): its pages come from
/// [`transfer_pages`](HiRadixCache::transfer_pages), and the caller reports its end
/// with [`complete`](HiRadixCache::complete), once. A transfer covers one node as it
/// was when the copy started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    cache_id: u64,
    slot: u32,
    gen: u32,
    kind: TransferKind,
    pages: u32,
}

/// A placeholder for the buffers [`take_transfers`](HiRadixCache::take_transfers)
/// fills: it names no transfer (every cache refuses it).
impl Default for Transfer {
    fn default() -> Self {
        Transfer { cache_id: 0, slot: u32::MAX, gen: 0, kind: TransferKind::Backup, pages: 0 }
    }
}

impl Transfer {
    /// Which way it copies and what the tree holds meanwhile.
    pub fn kind(&self) -> TransferKind {
        self.kind
    }

    /// Pages to copy.
    pub fn pages(&self) -> usize {
        self.pages as usize
    }
}

/// A [`Transfer`] the cache refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// Not in flight: completed already, dropped by a reset before it was taken, or
    /// never this cache's.
    Unknown,
    /// Started by another cache.
    ForeignCache,
    /// The page buffers hold fewer than the transfer's pages.
    BufferTooShort {
        /// Pages the transfer has.
        need: usize,
        /// The shorter buffer's length.
        got: usize,
    },
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferError::Unknown => {
                f.write_str("the transfer is not in flight (completed already, or dropped by a reset)")
            }
            TransferError::ForeignCache => f.write_str("the transfer belongs to another cache"),
            TransferError::BufferTooShort { need, got } => {
                write!(f, "the transfer has {need} pages, a page buffer holds {got}")
            }
        }
    }
}

impl std::error::Error for TransferError {}

/// The host tier's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTier {
    /// Host pages (of the device's page size).
    pub host_pages: u32,
    /// When nodes are backed up.
    pub write_policy: WritePolicy,
    /// Host continuations shorter than this many tokens are not loaded back.
    pub load_back_threshold: usize,
}

impl HostTier {
    /// `host_pages` pages, `write_through`, SGLang's load-back threshold.
    pub fn new(host_pages: u32) -> HostTier {
        HostTier { host_pages, write_policy: WritePolicy::default(), load_back_threshold: DEFAULT_LOAD_BACK_THRESHOLD }
    }
}

/// The host-tier variant (see the [module docs](self)).
pub struct Hi {
    tier: HostTier,
    /// Host pages `1..=host_pages` (tree pages `num_pages + 1..`): the tree's own, or
    /// the allocator of the [`HostKvPool`] it was given.
    host: SlotPool,
    pool: Option<Arc<HostKvPool>>,
    written: AtomicU64,
    loaded: AtomicU64,
    device_evicted: AtomicU64,
    host_evicted: AtomicU64,
    backup_refused: AtomicU64,
    prefetched: AtomicU64,
}

impl Hi {
    /// The host page allocator.
    #[inline]
    fn host(&self) -> &SlotPool {
        match &self.pool {
            Some(p) => p.page_allocator(),
            None => &self.host,
        }
    }

    fn new(tier: HostTier, pool: Option<Arc<HostKvPool>>) -> Hi {
        Hi {
            tier,
            host: SlotPool::without_magazines(if pool.is_some() { 0 } else { tier.host_pages }),
            pool,
            written: AtomicU64::new(0),
            loaded: AtomicU64::new(0),
            device_evicted: AtomicU64::new(0),
            host_evicted: AtomicU64::new(0),
            backup_refused: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
        }
    }
}

impl fmt::Debug for Hi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hi").field("tier", &self.tier).field("host_free", &self.host().available()).finish()
    }
}

/// A radix cache whose nodes may live on the device, in host memory or both (see the
/// [module docs](self)).
pub type HiRadixCache<A> = RadixCache<A, Hi>;

/// A node's host-tier state.
#[derive(Clone, Copy, Debug)]
pub struct HiNode {
    /// Its own pages are host pages (the device copy was evicted).
    host_only: bool,
    /// A resident node's host copy: its first page (0: none) and that page's run.
    copy: u32,
    copy_run: u32,
    /// Load-backs in progress: the host copy must stay.
    host_lock: u32,
    write_hits: u32,
    /// Place in the host order (host-only leaves).
    pos: u32,
    /// Children, as a list through the children's `next` / `prev`.
    first_child: u32,
    next: u32,
    prev: u32,
}

impl Default for HiNode {
    fn default() -> Self {
        HiNode {
            host_only: false,
            copy: 0,
            copy_run: 0,
            host_lock: 0,
            write_hits: 0,
            pos: NIL,
            first_child: NIL,
            next: NIL,
            prev: NIL,
        }
    }
}

/// The host order: host-only leaves, least recently used first (SGLang's host
/// eviction is LRU whatever the device policy).
struct HostLeaves;

impl Slot<HiNode> for HostLeaves {
    #[inline]
    fn pos(m: &Meta<HiNode>) -> u32 {
        m.ext.pos
    }
    #[inline]
    fn set_pos(m: &mut Meta<HiNode>, pos: u32) {
        m.ext.pos = pos;
    }
    #[inline]
    fn key(_: EvictionPolicy, m: &Meta<HiNode>) -> (i64, u64) {
        (0, m.last_access)
    }
}

/// The variant's writer-only state.
#[derive(Debug)]
pub struct HiState {
    order: Vec<u32>,
    /// Host page runs of a backup being made, as (first, pages).
    runs: Vec<(u32, u32)>,
    /// The nodes of a load-back, top down.
    chain: Vec<u32>,
    /// Host leaves a host eviction passed over (pages in flight), put back after it.
    skipped: Vec<u32>,
    /// Transfers in flight, by slot (see [`Transfer`]).
    entries: Vec<Entry>,
    /// Free slots of `entries`.
    free_entries: Vec<u32>,
    /// Started transfers not yet taken by the caller: a ring of slots.
    queue: Vec<u32>,
    queue_head: usize,
    queue_len: usize,
    /// For each host page in flight, the device page it pairs with.
    dev_of_host: Vec<u32>,
    /// A bit per host page in flight (index `h - 1`).
    in_flight: Vec<u64>,
    /// Host pages in flight.
    in_flight_pages: usize,
    /// With a caller's pool: the tree's ownership of it (see
    /// [`with_host_pool`](RadixCache::with_host_pool)), released on drop after the
    /// tree's pages went back.
    claim: Option<HostPoolClaim>,
    /// With a caller's pool: a bit per host page of a transfer handed to the caller
    /// ([`take_transfers`](RadixCache::take_transfers)) and not complete (index
    /// `h - 1`): its copy may still touch the page, so dropping the cache keeps it.
    handed_out: Vec<u64>,
}

/// Dropping a cache over a caller's pool gives the pool back: every host page the tree
/// holds is freed, but those of transfers handed out and not completed (the caller's
/// copy may still be writing or reading them) stay allocated, for the caller to free
/// with [`HostKvPool::free_pages`] once its copies are done. Then the claim goes.
impl Drop for HiState {
    fn drop(&mut self) {
        if let Some(claim) = &self.claim {
            claim.free_all_except(&self.handed_out);
        }
    }
}

/// A transfer in flight.
#[derive(Clone, Copy, Debug)]
struct Entry {
    gen: u32,
    live: bool,
    kind: TransferKind,
    /// The host chain (tree pages), as a node's: first page, its run, pages.
    host_first: u32,
    host_run: u32,
    count: u32,
    /// The locked node's last page (device), 0 for none.
    lock_page: u32,
    /// Handed to the caller ([`take_transfers`](RadixCache::take_transfers)): its copy
    /// may have started.
    taken: bool,
}

impl Entry {
    /// Outlived a reset with device pages its copy touches: a backup or load locks its
    /// node (`lock_page`, never 0 for them) until a reset drops the tree, which keeps
    /// the device pages of those taken (the others it drops). Those pages (paired with
    /// its host pages) are then out of the tree, the transfer's to free when it
    /// completes.
    fn keeps_device(&self) -> bool {
        self.live && self.taken && self.lock_page == 0 && matches!(self.kind, TransferKind::Backup | TransferKind::Load)
    }
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            gen: 0,
            live: false,
            kind: TransferKind::Backup,
            host_first: 0,
            host_run: 0,
            count: 0,
            lock_page: 0,
            taken: false,
        }
    }
}

impl super::variant::sealed::Sealed for Hi {}

fn order<'w, A: KvAllocator>(w: &'w mut Writer<'_, A, Hi>) -> Heap<'w, HiNode, HostLeaves> {
    Heap::new(&mut w.s.ext.order, &mut w.s.meta, w.c.policy)
}

fn ext<A: KvAllocator>(w: &Writer<'_, A, Hi>, id: u32) -> HiNode {
    w.s.meta[id as usize].ext
}

fn ext_mut<'w, A: KvAllocator>(w: &'w mut Writer<'_, A, Hi>, id: u32) -> &'w mut HiNode {
    &mut w.s.meta[id as usize].ext
}

fn is_host_leaf(e: &HiNode) -> bool {
    e.host_only && e.first_child == NIL && e.host_lock == 0
}

/// Runs of the whole pages of `slots` (a checked shape), as (first page, pages).
fn slot_runs(slots: &[u32], ps: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
    let (mut i, pages) = (0, slots.len() / ps);
    core::iter::from_fn(move || {
        if i >= pages {
            return None;
        }
        let len = run_at(slots, ps, i);
        let start = slots[i * ps] / ps as u32;
        i += len;
        Some((start, len as u32))
    })
}

// ---- child lists ----

fn link_child<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, parent: u32, c: u32) {
    let head = ext(w, parent).first_child;
    let e = ext_mut(w, c);
    (e.next, e.prev) = (head, NIL);
    if head != NIL {
        ext_mut(w, head).prev = c;
    }
    ext_mut(w, parent).first_child = c;
}

fn unlink_child<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, parent: u32, c: u32) {
    let HiNode { next, prev, .. } = ext(w, c);
    if prev != NIL {
        ext_mut(w, prev).next = next;
    } else {
        debug_assert_eq!(ext(w, parent).first_child, c, "a child list lost node {c}");
        ext_mut(w, parent).first_child = next;
    }
    if next != NIL {
        ext_mut(w, next).prev = prev;
    }
    let e = ext_mut(w, c);
    (e.next, e.prev) = (NIL, NIL);
}

/// Republish every child of `id` under its new last page `last`.
fn rekey_children<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32, last: u32) {
    let mut c = ext(w, id).first_child;
    while c != NIL {
        let (first, _) = w.span(c);
        let first_run = w.c.records[c as usize].first_run.load(Ordering::Relaxed);
        let mark = w.c.records[c as usize].mark.load(Ordering::Relaxed);
        w.republish(c, first, first_run, last, mark);
        c = ext(w, c).next;
    }
}

// ---- pages ----

/// Copy the tokens of chain `src` into chain `dst` (as many pages).
fn copy_tokens<A: KvAllocator>(w: &Writer<'_, A, Hi>, mut src: Runs<'_>, mut dst: Runs<'_>) {
    let ps = w.c.ps;
    let (Some((mut s, mut sl)), Some((mut d, mut dl))) = (src.next(), dst.next()) else { return };
    loop {
        let k = sl.min(dl);
        w.c.slot_token.copy(s as usize * ps, d as usize * ps, k as usize * ps);
        (s, sl, d, dl) = (s + k, sl - k, d + k, dl - k);
        if sl == 0 {
            let Some(next) = src.next() else { break };
            (s, sl) = next;
        }
        if dl == 0 {
            let Some(next) = dst.next() else { break };
            (d, dl) = next;
        }
    }
}

/// Free a chain of host pages (out of the tree: unmarked, back to the host pool). A
/// page in flight stays allocated, out of the tree: its transfer frees it when it
/// completes.
fn free_host_chain<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, first: u32, first_run: u32, count: u32) {
    let base = w.c.num_pages;
    let mut group = w.c.variant.host().free_group();
    for (start, len) in w.chain(first, first_run, count) {
        w.set_in_tree_range(start, len, false);
        if w.s.ext.in_flight_pages == 0 || !run_in_flight(&w.s.ext.in_flight, start - base, len) {
            let r = group.free_range(start - base, len);
            debug_assert!(r.is_ok(), "the tree frees host pages it holds: {r:?}");
            continue;
        }
        for h in start - base..start - base + len {
            if !bit(&w.s.ext.in_flight, h) {
                let r = group.free_range(h, 1);
                debug_assert!(r.is_ok(), "the tree frees host pages it holds: {r:?}");
            }
        }
    }
    group.end();
}

// ---- transfers in flight ----

#[inline]
fn bit(words: &[u64], h: u32) -> bool {
    let i = h as usize - 1;
    words[i / 64] >> (i % 64) & 1 != 0
}

#[inline]
fn set_bit(words: &mut [u64], h: u32, on: bool) {
    let i = h as usize - 1;
    if on {
        words[i / 64] |= 1 << (i % 64);
    } else {
        words[i / 64] &= !(1 << (i % 64));
    }
}

/// Whether any of host pages `h..h + len` is in flight, a word at a time.
fn run_in_flight(words: &[u64], h: u32, len: u32) -> bool {
    bit_words(h as usize - 1, len as usize).any(|(i, mask)| words[i] & mask != 0)
}

/// Mark host pages `h..h + len` in flight or not, a word at a time.
fn mark_run(words: &mut [u64], h: u32, len: u32, on: bool) {
    for (i, mask) in bit_words(h as usize - 1, len as usize) {
        if on {
            words[i] |= mask;
        } else {
            words[i] &= !mask;
        }
    }
}

/// Whether any page of the chain (tree pages, host) is in flight.
fn chain_in_flight<A: KvAllocator>(w: &Writer<'_, A, Hi>, first: u32, first_run: u32, count: u32) -> bool {
    if w.s.ext.in_flight_pages == 0 {
        return false;
    }
    let base = w.c.num_pages;
    w.chain(first, first_run, count).any(|(start, len)| run_in_flight(&w.s.ext.in_flight, start - base, len))
}

/// Whether the host-only node `id`'s pages are in flight (a write-back not complete).
fn node_in_flight<A: KvAllocator>(w: &Writer<'_, A, Hi>, id: u32) -> bool {
    if w.s.ext.in_flight_pages == 0 {
        return false;
    }
    let (first, count) = w.span(id);
    chain_in_flight(w, first, w.c.records[id as usize].first_run.load(Ordering::Relaxed), count)
}

/// Start a transfer between the device chain `device` and the host chain from
/// `host_first` (tree pages; as many pages), locking the path of the node whose last
/// page is `lock_page` (0: none) until it completes. Queued for the caller.
fn start<A: KvAllocator>(
    w: &mut Writer<'_, A, Hi>,
    kind: TransferKind,
    device: Option<Runs<'_>>,
    host_first: u32,
    host_run: u32,
    count: u32,
    lock_page: u32,
) {
    let base = w.c.num_pages;
    let mut device = device.into_iter().flatten();
    let (mut d, mut dl) = (0u32, 0u32);
    for (h, hl) in w.chain(host_first, host_run, count) {
        let (mut h, mut hl) = (h - base, hl);
        debug_assert!(!run_in_flight(&w.s.ext.in_flight, h, hl), "host pages {h}.. in two transfers");
        mark_run(&mut w.s.ext.in_flight, h, hl, true);
        while hl > 0 {
            if dl == 0 {
                // No device side (a prefetch): pair with page 0.
                (d, dl) = device.next().unwrap_or((0, u32::MAX));
            }
            let k = dl.min(hl);
            let pairs = w.s.ext.dev_of_host[h as usize..(h + k) as usize].iter_mut();
            if d == 0 {
                pairs.for_each(|slot| *slot = 0);
            } else {
                pairs.zip(d..).for_each(|(slot, page)| *slot = page);
                d += k;
            }
            (dl, h, hl) = (dl - k, h + k, hl - k);
        }
    }
    w.s.ext.in_flight_pages += count as usize;
    // Every transfer holds at least one host page of its own: the table has a slot
    // per host page.
    let slot = w.s.ext.free_entries.pop().expect("a transfer slot per host page");
    let e = &mut w.s.ext.entries[slot as usize];
    debug_assert!(lock_page != 0 || !matches!(kind, TransferKind::Backup | TransferKind::Load));
    *e = Entry { gen: e.gen, live: true, kind, host_first, host_run, count, lock_page, taken: false };
    let st = &mut w.s.ext;
    let at = (st.queue_head + st.queue_len) % st.queue.len();
    st.queue[at] = slot;
    st.queue_len += 1;
    if lock_page != 0 {
        let aux = w.inc_lock(lock_page);
        debug_assert_eq!(aux, 0);
    }
}

fn ticket<A: KvAllocator>(w: &Writer<'_, A, Hi>, slot: u32) -> Transfer {
    let e = &w.s.ext.entries[slot as usize];
    Transfer { cache_id: w.c.id, slot, gen: e.gen, kind: e.kind, pages: e.count }
}

/// The live entry `t` names.
fn entry_of<A: KvAllocator>(w: &Writer<'_, A, Hi>, t: &Transfer) -> Result<Entry, TransferError> {
    if t.cache_id != w.c.id {
        return Err(TransferError::ForeignCache);
    }
    match w.s.ext.entries.get(t.slot as usize) {
        Some(e) if e.live && e.gen == t.gen => Ok(*e),
        _ => Err(TransferError::Unknown),
    }
}

/// End the transfer in `slot`: its host pages are no longer in flight (those whose
/// node left the tree meanwhile go back to the host pool), its lock goes.
fn finish_transfer<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, slot: u32) {
    let e = w.s.ext.entries[slot as usize];
    let base = w.c.num_pages;
    let mut group = w.c.variant.host().free_group();
    for (start, len) in w.chain(e.host_first, e.host_run, e.count) {
        mark_run(&mut w.s.ext.in_flight, start - base, len, false);
        if !w.s.ext.handed_out.is_empty() {
            mark_run(&mut w.s.ext.handed_out, start - base, len, false);
        }
        if w.in_tree_all(start, len) {
            continue;
        }
        for p in start..start + len {
            if !w.in_tree(p) {
                let r = group.free_range(p - base, 1);
                debug_assert!(r.is_ok(), "an orphaned page in flight is held: {r:?}");
            }
        }
    }
    group.end();
    w.s.ext.in_flight_pages -= e.count as usize;
    if e.lock_page != 0 {
        w.dec_lock(e.lock_page, 0);
    }
    if e.keeps_device() {
        let ps = w.c.ps as u32;
        let mut group = w.c.alloc.free_group();
        for (start, len) in w.chain(e.host_first, e.host_run, e.count) {
            for h in start - base..start - base + len {
                let r = group.free(&[w.s.ext.dev_of_host[h as usize] * ps]);
                debug_assert!(r.is_ok(), "a device page a reset left to its transfer is held: {r:?}");
            }
        }
        group.end();
    }
    let x = &mut w.s.ext.entries[slot as usize];
    (x.live, x.gen) = (false, x.gen.wrapping_add(1));
    w.s.ext.free_entries.push(slot);
}

fn last_of(runs: Runs<'_>) -> u32 {
    runs.last().map_or(0, |(start, len)| start + len - 1)
}

/// `n` host pages for the tree, linked as a chain and marked in the tree; their tokens
/// are the caller's to write. Returns the chain's (first page, its run, last page) in
/// tree pages, or `None` (nothing taken) when fewer are free.
fn take_host_pages<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, n: usize) -> Option<(u32, u32, u32)> {
    let r = w.c.variant.host().reserve(n, Unit::Pages).ok()?;
    let base = w.c.num_pages;
    // The claimed pages, a run of consecutive ones at a time (at most one run per page:
    // within the capacity reserved at construction).
    let mut runs = core::mem::take(&mut w.s.ext.runs);
    runs.clear();
    w.c.variant.host().claim_with(r, |word, mut bits| {
        while bits != 0 {
            let low = bits.trailing_zeros();
            let len = (!(bits >> low)).trailing_zeros().min(64 - low);
            let start = (word * 64) as u32 + low + 1 + base;
            match runs.last_mut() {
                Some((s, l)) if *s + *l == start => *l += len,
                _ => runs.push((start, len)),
            }
            bits &= !((((1u128 << len) - 1) as u64) << low);
        }
    });
    // Release: a stale reader that sees a token or link written below (recycled host
    // pages) and validates with an Acquire fence is ordered after their last owner's
    // retirement.
    fence(Ordering::Release);
    let chain = w.link_runs(runs.iter().copied());
    for &(start, len) in &runs {
        w.set_in_tree_range(start, len, true);
    }
    w.s.ext.runs = runs;
    Some(chain)
}

/// Back node `id` (resident) up: host pages for it, evicting host leaves when short,
/// and a transfer of `kind` to fill them. Whether it has a host copy now.
fn backup<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32, kind: TransferKind) -> bool {
    let e = ext(w, id);
    if e.copy != 0 {
        return true;
    }
    debug_assert!(!e.host_only, "backup of a host-only node");
    let v = &w.c.variant;
    let n = w.span(id).1 as usize;
    let ps = w.c.ps;
    let avail = v.host().available();
    if avail < n {
        evict_host(w, (n - avail) * ps);
    }
    let Some((first, first_run, _)) = take_host_pages(w, n) else {
        w.c.variant.backup_refused.fetch_add(1, Ordering::Relaxed);
        return false;
    };
    let (own, count) = w.span(id);
    let own_run = w.c.records[id as usize].first_run.load(Ordering::Relaxed);
    copy_tokens(w, w.chain(own, own_run, count), w.chain(first, first_run, count));
    let e = ext_mut(w, id);
    (e.copy, e.copy_run) = (first, first_run);
    w.c.variant.written.fetch_add((n * ps) as u64, Ordering::Relaxed);
    let lock = if kind == TransferKind::Backup { w.s.meta[id as usize].last_page } else { 0 };
    start(w, kind, Some(w.chain(own, own_run, count)), first, first_run, count, lock);
    true
}

/// One write hit on the resident node `id`: back it up at the policy's threshold.
fn write_hit<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32) {
    let Some(threshold) = w.c.variant.tier.write_policy.threshold() else { return };
    let e = ext_mut(w, id);
    if e.copy != 0 {
        return;
    }
    e.write_hits = e.write_hits.saturating_add(1);
    if u64::from(e.write_hits) >= threshold {
        backup(w, id, TransferKind::Backup);
    }
}

/// Swap node `id`'s own pages for the chain from `first` (its run `first_run`, last
/// page `last`): republish it with the reader mark of its new tier (1: host-only),
/// move its ownership and its children's keys.
fn swap_pages<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32, first: u32, first_run: u32, last: u32, mark: u32) {
    let parent_page = w.c.records[id as usize].parent_page.load(Ordering::Relaxed);
    let old_last = w.s.meta[id as usize].last_page;
    w.republish(id, first, first_run, parent_page, mark);
    w.s.page_owner[old_last as usize] = NIL;
    w.s.page_owner[last as usize] = id;
    w.s.page_epoch[last as usize] = w.s.page_epoch[last as usize].wrapping_add(1);
    w.s.meta[id as usize].last_page = last;
    rekey_children(w, id, last);
}

/// The resident, unlocked, backed-up node `id`, whose children are all host-only and
/// which is out of the core's order: drop its device pages into `group`; it stays as
/// a host-only node. Returns the device tokens freed.
fn to_host<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32, group: &mut KvFreeGroup<'_>) -> usize {
    let e = ext(w, id);
    let (own, count) = w.span(id);
    let own_run = w.c.records[id as usize].first_run.load(Ordering::Relaxed);
    let last = last_of(w.chain(e.copy, e.copy_run, count));
    swap_pages(w, id, e.copy, e.copy_run, last, 1);
    let x = ext_mut(w, id);
    (x.host_only, x.copy, x.copy_run) = (true, 0, 0);
    // After the republish (a SeqCst retirement of the old view): free the device pages.
    for (start, len) in w.chain(own, own_run, count) {
        w.set_in_tree_range(start, len, false);
        let r = group.free_pages(start, len);
        debug_assert!(r.is_ok(), "evicted pages are owned by the tree: {r:?}");
    }
    let len = count as usize * w.c.ps;
    w.c.evictable.latch_sub(len);
    w.c.total.latch_sub(len);
    let parent = w.parent_of(id);
    let pm = &mut w.s.meta[parent as usize];
    pm.children -= 1;
    if parent != ROOT && pm.children == 0 && pm.lock_ref == 0 {
        w.heap().push(parent);
    }
    if is_host_leaf(&ext(w, id)) {
        order(w).push(id);
    }
    len
}

/// The host-only node `id` takes the device slots `slots` (whole pages, claimed) and
/// is resident again, its host pages kept as its copy; its parent is resident.
fn to_device<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32, slots: &[u32]) {
    let ps = w.c.ps;
    let (own, count) = w.span(id);
    debug_assert_eq!(slots.len(), count as usize * ps);
    let own_run = w.c.records[id as usize].first_run.load(Ordering::Relaxed);
    // Release: see `backup`.
    fence(Ordering::Release);
    let (first, first_run, last) = w.link_runs(slot_runs(slots, ps));
    copy_tokens(w, w.chain(own, own_run, count), w.chain(first, first_run, count));
    swap_pages(w, id, first, first_run, last, 0);
    if ext(w, id).pos != NIL {
        order(w).remove(id);
    }
    let x = ext_mut(w, id);
    (x.host_only, x.copy, x.copy_run) = (false, own, own_run);
    let len = count as usize * ps;
    w.c.evictable.latch_add(len);
    w.c.total.latch_add(len);
    let parent = w.parent_of(id);
    w.s.meta[parent as usize].children += 1;
    w.heap().remove(parent);
    debug_assert!(w.s.meta[id as usize].lock_ref == 0 && w.s.meta[id as usize].children == 0);
    w.heap().push(id);
}

/// Remove the host-only node `id`, which has no children. Returns its parent and the
/// host tokens freed.
fn remove_host_node<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32) -> (u32, usize) {
    let e = ext(w, id);
    debug_assert!(e.host_only && e.first_child == NIL && e.host_lock == 0);
    let parent = w.parent_of(id);
    unlink_child(w, parent, id);
    if e.pos != NIL {
        order(w).remove(id);
    }
    let (first, count) = w.span(id);
    let first_run = w.c.records[id as usize].first_run.load(Ordering::Relaxed);
    let last = w.s.meta[id as usize].last_page;
    w.unlink(id);
    w.retire(id);
    free_host_chain(w, first, first_run, count);
    w.s.page_owner[last as usize] = NIL;
    let len = count as usize * w.c.ps;
    w.c.variant.host_evicted.fetch_add(len as u64, Ordering::Relaxed);
    (parent, len)
}

/// Remove every node below the resident node `id` (all host-only).
fn remove_host_subtree<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, id: u32) {
    let mut y = ext(w, id).first_child;
    while y != NIL {
        let down = ext(w, y).first_child;
        if down != NIL {
            y = down;
            continue;
        }
        let (parent, _) = remove_host_node(w, y);
        y = if parent == id { ext(w, id).first_child } else { parent };
    }
}

/// Host eviction: remove host-only leaves, least recently used first, until `num`
/// host tokens are freed or none is left. Returns the host tokens freed.
fn evict_host<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, num: usize) -> usize {
    let mut freed = 0;
    let mut skipped = core::mem::take(&mut w.s.ext.skipped);
    skipped.clear();
    while freed < num {
        let Some(x) = order(w).pop() else { break };
        if node_in_flight(w, x) {
            // Its write-back has not landed: not evictable yet.
            skipped.push(x); // within the capacity reserved at construction
            continue;
        }
        let (parent, len) = remove_host_node(w, x);
        freed += len;
        if is_host_leaf(&ext(w, parent)) {
            order(w).push(parent);
        }
    }
    for &x in &skipped {
        order(w).push(x);
    }
    w.s.ext.skipped = skipped;
    freed
}

// The hooks take the core's crate-private lease types: the trait is sealed and its hooks hidden.
#[allow(private_interfaces)]
impl Variant for Hi {
    type Node = HiNode;
    type State = HiState;
    type Walk = ();
    const SPLITS_AT_PROMPT: bool = true;
    /// What the admission found on host and loaded back.
    type Request = HostHit;
    type Finished = usize;

    /// A match that loads the host continuation back (see
    /// [`match_and_load`](RadixCache::match_and_load); no quota).
    fn admit_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        prompt: &[u32],
        row: &mut ReqRow,
    ) -> Result<(super::RawLease, HostHit), crate::AllocError> {
        let (lease, hit) = c
            .match_into_row(prompt, row, |key, out| c.match_and_load(namespace, key, out, None), |(l, _)| l.key)
            .map_err(crate::AllocError::Row)?;
        Ok((lease.detach(), hit))
    }

    fn finish_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, Self>,
        priority: i64,
        _req: &mut HostHit,
    ) -> Result<usize, CacheError> {
        c.finish_kv(rows, namespace, tokens, row, lease, priority)
    }

    fn checkpoint_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Self>,
        priority: i64,
        _req: &mut HostHit,
    ) -> Result<(), CacheError> {
        c.checkpoint_kv(namespace, tokens, row, lease, priority)
    }

    fn extra_pages(&self) -> usize {
        self.tier.host_pages as usize
    }

    fn new_state(&self, nodes: usize) -> Result<HiState, ConfigError> {
        let hp = self.tier.host_pages as usize;
        let mut free_entries: Vec<u32> = crate::arena::try_with_capacity(hp, "host transfer slots")?;
        free_entries.extend((0..hp as u32).rev());
        let mut entries = crate::arena::try_with_capacity(hp, "host transfers")?;
        entries.resize(hp, Entry::default());
        let mut queue = crate::arena::try_with_capacity(hp, "host transfer queue")?;
        queue.resize(hp.max(1), 0u32);
        let mut dev_of_host = crate::arena::try_with_capacity(hp + 1, "host transfer pairs")?;
        dev_of_host.resize(hp + 1, 0u32);
        let mut in_flight = crate::arena::try_with_capacity(hp.div_ceil(64), "host pages in flight")?;
        in_flight.resize(hp.div_ceil(64), 0u64);
        let (claim, handed_out) = match &self.pool {
            Some(pool) => {
                let mut handed_out = crate::arena::try_with_capacity(hp.div_ceil(64), "host pages handed out")?;
                handed_out.resize(hp.div_ceil(64), 0u64);
                // Last: nothing after it can fail, so a refused construction leaves the
                // pool as it was (the claim is released with the state otherwise).
                (Some(HostKvPool::claim(pool)?), handed_out)
            }
            None => (None, Vec::new()),
        };
        Ok(HiState {
            order: crate::arena::try_with_capacity(nodes, "host order")?,
            runs: crate::arena::try_with_capacity(hp, "host backup runs")?,
            chain: crate::arena::try_with_capacity(nodes, "host load-back chain")?,
            skipped: crate::arena::try_with_capacity(nodes, "host eviction scratch")?,
            entries,
            free_entries,
            queue,
            queue_head: 0,
            queue_len: 0,
            dev_of_host,
            in_flight,
            in_flight_pages: 0,
            claim,
            handed_out,
        })
    }

    #[inline]
    fn match_end(node: &HiNode) -> bool {
        !node.host_only
    }

    #[inline]
    fn peek_step(&self, _walk: &mut (), mark: u32, _tokens: usize) -> bool {
        mark == 0
    }

    #[inline]
    fn resident(node: &HiNode) -> bool {
        !node.host_only
    }

    fn evict_leaf<A: KvAllocator>(
        w: &mut Writer<'_, A, Self>,
        x: u32,
        _need: usize,
        group: &mut KvFreeGroup<'_>,
    ) -> usize {
        if w.c.variant.tier.write_policy == WritePolicy::WriteBack {
            backup(w, x, TransferKind::WriteBack);
        }
        let len = w.len_of(x);
        w.c.variant.device_evicted.fetch_add(len as u64, Ordering::Relaxed);
        if ext(w, x).copy != 0 {
            to_host(w, x, group)
        } else {
            remove_host_subtree(w, x);
            w.remove_leaf(x, group)
        }
    }

    fn apply_insert<A: KvAllocator>(
        w: &mut Writer<'_, A, Self>,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
        cached: usize,
    ) -> u32 {
        apply_insert(w, namespace, key, slots, priority, cached)
    }

    #[inline]
    fn split_payload(lower: &mut HiNode) -> HiNode {
        // The upper half takes the lower's place among its siblings; the lower half
        // becomes its one child (the hook links them).
        let upper = HiNode { pos: NIL, first_child: NIL, ..*lower };
        (lower.next, lower.prev) = (NIL, NIL);
        upper
    }

    fn split<A: KvAllocator>(w: &mut Writer<'_, A, Self>, _old: u32, upper: u32, lower: u32) {
        let HiNode { next, prev, copy, copy_run, pos, .. } = ext(w, upper);
        if prev != NIL {
            ext_mut(w, prev).next = upper;
        } else {
            let parent = w.parent_of(upper);
            ext_mut(w, parent).first_child = upper;
        }
        if next != NIL {
            ext_mut(w, next).prev = upper;
        }
        debug_assert_eq!(pos, NIL);
        ext_mut(w, upper).first_child = lower;
        let lp = ext(w, lower).pos;
        if lp != NIL {
            w.s.ext.order[lp as usize] = lower;
        }
        if copy != 0 {
            // Cut the host copy where the node was cut.
            let m = w.span(upper).1;
            let count = m + w.span(lower).1;
            let (_, rest, rest_run) = w.cut_chain(copy, copy_run, count, m as usize);
            let e = ext_mut(w, lower);
            (e.copy, e.copy_run) = (rest, rest_run);
        }
    }

    fn removing<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        let e = ext(w, id);
        let parent = w.parent_of(id);
        if w.s.meta[parent as usize].alive {
            unlink_child(w, parent, id);
        }
        if e.pos != NIL {
            order(w).remove(id);
        }
        let count = w.span(id).1;
        if e.host_only {
            let first_run = w.c.records[id as usize].first_run.load(Ordering::Relaxed);
            free_host_chain(w, w.span(id).0, first_run, count);
        } else if e.copy != 0 {
            free_host_chain(w, e.copy, e.copy_run, count);
        }
    }

    #[inline]
    fn touched<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        order(w).update(id);
    }

    fn held_apart<A: KvAllocator>(w: &Writer<'_, A, Self>) -> usize {
        let pages: usize = w.s.ext.entries.iter().filter(|e| e.keeps_device()).map(|e| e.count as usize).sum();
        pages * w.c.ps
    }

    fn kept_at_reset<A: KvAllocator>(w: &Writer<'_, A, Self>) -> Vec<u64> {
        // A transfer the caller took may be copying: the device pages its copy reads
        // (a backup) or writes (a load) stay allocated until it completes. A
        // write-back's are free already; a prefetch has none.
        let base = w.c.num_pages;
        let mut kept = Vec::new();
        for e in &w.s.ext.entries {
            if !e.live || !e.taken || !matches!(e.kind, TransferKind::Backup | TransferKind::Load) {
                continue;
            }
            if kept.is_empty() {
                kept = vec![0u64; (w.c.num_pages as usize + 1).div_ceil(64)];
            }
            for (start, len) in w.chain(e.host_first, e.host_run, e.count) {
                for h in start - base..start - base + len {
                    let d = w.s.ext.dev_of_host[h as usize] as usize;
                    debug_assert!(kept[d / 64] >> (d % 64) & 1 == 0, "device page {d} in two transfers");
                    kept[d / 64] |= 1 << (d % 64);
                }
            }
        }
        kept
    }

    fn reset<A: KvAllocator>(w: &mut Writer<'_, A, Self>) {
        w.s.ext.order.clear();
        // Transfers in flight lose their locks with the tree. Those not taken yet are
        // dropped (no copy can have started): their pages, out of the tree now, go
        // back to the host pool. Those taken stay in flight, their host pages held
        // and their device pages kept (`kept_at_reset`; `Entry::keeps_device` from
        // now on), until they complete.
        for slot in 0..w.s.ext.entries.len() as u32 {
            let e = &mut w.s.ext.entries[slot as usize];
            if e.live {
                e.lock_page = 0;
                if !e.taken {
                    finish_transfer(w, slot);
                }
            }
        }
        (w.s.ext.queue_head, w.s.ext.queue_len) = (0, 0);
    }

    fn check<A: KvAllocator>(w: &Writer<'_, A, Self>) -> Result<(), String> {
        let base = w.c.num_pages;
        let v = &w.c.variant;
        let mut held = 0usize;
        let mut children = std::collections::HashMap::<u32, u32>::new();
        let mut leaves = 0usize;
        for (id, m) in w.s.meta.iter().enumerate().skip(1) {
            if !m.alive {
                continue;
            }
            let (id, e) = (id as u32, m.ext);
            *children.entry(w.parent_of(id)).or_default() += 1;
            let mark = w.c.records[id as usize].mark.load(Ordering::Relaxed);
            if mark != u32::from(e.host_only) {
                return Err(format!("node {id}'s reader mark {mark} disagrees with its tier"));
            }
            let parent = w.parent_of(id);
            if !e.host_only && ext(w, parent).host_only {
                return Err(format!("resident node {id} below the host-only node {parent}"));
            }
            let count = w.span(id).1;
            let host_pages = |first: u32, run: u32| -> Result<(), String> {
                for (start, len) in w.chain(first, run, count) {
                    for p in start..start + len {
                        if p <= base || !w.in_tree(p) || !v.host().is_allocated(p - base) {
                            return Err(format!("node {id}'s host page {p} is not a held host page"));
                        }
                    }
                }
                Ok(())
            };
            if e.host_only {
                host_pages(w.span(id).0, w.c.records[id as usize].first_run.load(Ordering::Relaxed))?;
                if e.copy != 0 {
                    return Err(format!("host-only node {id} has a second copy"));
                }
                held += count as usize;
                if is_host_leaf(&e) != (e.pos != NIL) {
                    return Err(format!("host node {id}: host leaf {} but order membership differs", is_host_leaf(&e)));
                }
                leaves += usize::from(e.pos != NIL);
            } else {
                if w.pages(id).any(|p| p > base) {
                    return Err(format!("resident node {id} has a host page of its own"));
                }
                if e.copy != 0 {
                    host_pages(e.copy, e.copy_run)?;
                    held += count as usize;
                }
                if e.pos != NIL {
                    return Err(format!("resident node {id} is in the host order"));
                }
            }
        }
        for (id, m) in w.s.meta.iter().enumerate() {
            if !m.alive {
                continue;
            }
            let mut n = 0u32;
            let mut c = m.ext.first_child;
            while c != NIL && n <= w.s.meta.len() as u32 {
                if w.parent_of(c) != id as u32 {
                    return Err(format!("node {c} is in the child list of {id}, not its parent"));
                }
                n += 1;
                c = ext(w, c).next;
            }
            if n != children.get(&(id as u32)).copied().unwrap_or(0) {
                return Err(format!("node {id}'s child list holds {n} nodes"));
            }
        }
        // Transfers in flight: their pages are marked, once each; pages of nodes that
        // left the tree meanwhile are held by the transfer alone.
        let mut marked = 0usize;
        let mut live = 0usize;
        let mut seen = vec![0u64; w.s.ext.in_flight.len()];
        for (slot, e) in w.s.ext.entries.iter().enumerate() {
            if !e.live {
                continue;
            }
            live += 1;
            for (start, len) in w.chain(e.host_first, e.host_run, e.count) {
                for p in start..start + len {
                    let h = p.checked_sub(base).filter(|&h| h >= 1 && h <= v.tier.host_pages);
                    let Some(h) = h else {
                        return Err(format!("transfer {slot} names page {p}, not a host page"));
                    };
                    if !bit(&w.s.ext.in_flight, h) || bit(&seen, h) || !v.host().is_allocated(h) {
                        return Err(format!("transfer {slot}'s host page {h} is unmarked, shared or free"));
                    }
                    set_bit(&mut seen, h, true);
                    marked += 1;
                    if !w.in_tree(p) {
                        held += 1;
                    }
                    if e.keeps_device() {
                        // Outlived a reset: its device page is out of the tree, held.
                        let d = w.s.ext.dev_of_host[h as usize];
                        if d == 0 || w.in_tree(d) || !w.c.alloc.is_allocated(d * w.c.ps as u32) {
                            return Err(format!("transfer {slot} kept device page {d} across a reset, not held apart"));
                        }
                    }
                }
            }
            if e.lock_page != 0 && w.s.meta[w.s.page_owner[e.lock_page as usize] as usize].lock_ref == 0 {
                return Err(format!("transfer {slot}'s node is not locked"));
            }
        }
        if marked != w.s.ext.in_flight_pages || seen != w.s.ext.in_flight {
            return Err(format!("{marked} host pages in transfers, {} marked in flight", w.s.ext.in_flight_pages));
        }
        if live + w.s.ext.free_entries.len() != w.s.ext.entries.len() {
            return Err(format!("{live} transfers live, {} slots free", w.s.ext.free_entries.len()));
        }
        let used = v.host().capacity() as usize - v.host().available();
        if held != used {
            return Err(format!("nodes and transfers hold {held} host pages, the host pool has {used} allocated"));
        }
        if leaves != w.s.ext.order.len() {
            return Err(format!("host order holds {}, {leaves} host leaves", w.s.ext.order.len()));
        }
        heap::check::<_, HostLeaves>(&w.s.ext.order, &w.s.meta, w.c.policy)
    }

    fn describe(node: &HiNode, out: &mut String) {
        if node.host_only {
            out.push_str(" host");
        } else if node.copy != 0 {
            out.push_str(" backed-up");
        }
    }
}

/// Insert `key -> slots` whose first `cached` tokens are resident in the tree and whose
/// other pages are claimed: touch and count a write hit on each resident node passed,
/// give host-only nodes passed the request's slots, add the rest as a new leaf (one
/// write hit). Returns the node the key ends at.
fn apply_insert<A: KvAllocator>(
    w: &mut Writer<'_, A, Hi>,
    namespace: u64,
    key: &[u32],
    slots: &[u32],
    priority: i64,
    cached: usize,
) -> u32 {
    let ps = w.c.ps;
    w.touch(ROOT);
    let (mut pos, mut cur, mut end) = (0usize, 0u32, ROOT);
    while pos < key.len() {
        let super::Lookup::Found { id, .. } = w.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps]) else {
            break;
        };
        let resident = !ext(w, id).host_only;
        let (m, _, n) = w.c.count_in_node(id, &key[pos..]);
        debug_assert!(!resident || pos + m * ps <= cached, "the resident part was checked");
        w.touch(id);
        let node = if m < n { w.split(id, m) } else { id };
        end = node;
        let meta = &mut w.s.meta[node as usize];
        if priority > meta.priority {
            meta.priority = priority;
            w.heap().update(node);
        }
        if resident {
            write_hit(w, node);
        } else {
            to_device(w, node, &slots[pos..pos + m * ps]);
        }
        pos += m * ps;
        cur = w.s.meta[node as usize].last_page;
        if m < n {
            break;
        }
    }
    if pos < key.len() {
        let parent = w.s.page_owner[cur as usize];
        end = w.new_leaf(cur, namespace, &key[pos..], &slots[pos..], priority);
        link_child(w, parent, end);
        write_hit(w, end);
    }
    end
}

/// Hold (`on`) or release the host-only nodes on the path up from `from` (to its first
/// resident ancestor) against host eviction: out of the host order while held.
fn hold_host_path<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, from: u32, on: bool) {
    let mut x = from;
    while x != ROOT && ext(w, x).host_only {
        if on {
            if ext(w, x).pos != NIL {
                order(w).remove(x);
            }
            ext_mut(w, x).host_lock += 1;
        } else {
            ext_mut(w, x).host_lock -= 1;
            if is_host_leaf(&ext(w, x)) {
                order(w).push(x);
            }
        }
        x = w.parent_of(x);
    }
}

/// Add `key[kv_len..]` (whole pages) on host under the path `key[..kv_len]` ends at
/// (the node `end`, `ROOT` for none) as a host-only leaf with fresh host pages (evicting
/// host leaves for room, not the path's own) and a [`TransferKind::Prefetch`] to fill
/// them. Returns the tokens added (0: no room).
fn insert_host<A: KvAllocator>(
    w: &mut Writer<'_, A, Hi>,
    namespace: u64,
    key: &[u32],
    kv_len: usize,
    end: u32,
) -> usize {
    let ps = w.c.ps;
    let n = (key.len() - kv_len) / ps;
    if n == 0 {
        return 0;
    }
    // The host-only part of the path stays while host room is made.
    hold_host_path(w, end, true);
    let avail = w.c.variant.host().available();
    if avail < n {
        evict_host(w, (n - avail) * ps);
    }
    let taken = take_host_pages(w, n);
    hold_host_path(w, end, false);
    let Some((first, first_run, last)) = taken else { return 0 };
    let mut at = kv_len;
    for (start, len) in w.chain(first, first_run, n as u32) {
        let tokens = len as usize * ps;
        w.c.slot_token.write(start as usize * ps, &key[at..at + tokens]);
        at += tokens;
    }
    let parent_page = if end == ROOT { 0 } else { w.s.meta[end as usize].last_page };
    let leaf = NewLeaf { parent_page, namespace, first, first_run, pages: n as u32, last };
    let id = w.attach_leaf(leaf, &key[kv_len..kv_len + ps], 0, 1, false);
    ext_mut(w, id).host_only = true;
    link_child(w, end, id);
    if ext(w, end).pos != NIL {
        order(w).remove(end);
    }
    order(w).push(id);
    start(w, TransferKind::Prefetch, None, first, first_run, n as u32, 0);
    w.c.variant.prefetched.fetch_add((n * ps) as u64, Ordering::Relaxed);
    n * ps
}

/// What [`match_tiers`](RadixCache::match_tiers) found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HiMatch {
    /// The device prefix.
    pub device: MatchResult,
    /// Tokens of the host-only continuation after it.
    pub host_len: usize,
}

/// What a request's admission found on host ([`Request::host_hit`](super::Request::host_hit)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostHit {
    /// Tokens of the host-only continuation the key matched.
    pub matched: usize,
    /// Tokens loaded back (`matched`, or 0 when the load was skipped or failed).
    pub loaded: usize,
}

/// The host-tier walk: the device prefix, the host continuation's length and last node.
fn match_tiers<A: KvAllocator>(
    w: &mut Writer<'_, A, Hi>,
    namespace: u64,
    key: &[u32],
    out: &mut [u32],
) -> (MatchResult, usize, u32) {
    let (m, best, kv_len, kv_end) = w.match_path(namespace, key, out);
    let host_len = kv_len - m.len;
    let host_end = if host_len > 0 { w.s.page_owner[kv_end.last_page as usize] } else { best };
    (m, host_len, host_end)
}

/// Load the host continuation ending at `host_end` into device slots written to
/// `out` (its length at least the continuation's): all of it or nothing. Returns the
/// tokens loaded.
fn load_back<A: KvAllocator>(w: &mut Writer<'_, A, Hi>, host_end: u32, out: &mut [u32], quota: Option<usize>) -> usize {
    let mut chain = core::mem::take(&mut w.s.ext.chain);
    chain.clear();
    let (mut x, mut total) = (host_end, 0usize);
    while x != ROOT && ext(w, x).host_only {
        chain.push(x); // within the capacity reserved at construction
        total += w.len_of(x);
        x = w.parent_of(x);
    }
    let v = &w.c.variant;
    if total == 0
        || total < v.tier.load_back_threshold
        || quota.is_some_and(|q| total > q)
        || out.len() < total
        || chain.iter().any(|&y| node_in_flight(w, y))
    {
        w.s.ext.chain = chain;
        return 0;
    }
    chain.reverse();
    // The device prefix stays while room is made below it, and so do the host copies
    // being loaded (a `write_back` eviction makes host room for its backups).
    let anchor = w.s.meta[x as usize].last_page;
    let aux = w.inc_lock(anchor);
    hold_host_path(w, host_end, true);
    let avail = w.c.alloc.available_size();
    // A load that cannot get its slots even after evicting all that is evictable (the
    // prefix locked) evicts nothing: it fails with the tree as it was.
    let got = if avail >= total {
        w.c.alloc.alloc(&mut out[..total]).is_ok()
    } else if total - avail <= w.c.evictable.load(Ordering::Relaxed) {
        w.evict(total - avail);
        w.c.alloc.alloc(&mut out[..total]).is_ok()
    } else {
        false
    };
    hold_host_path(w, host_end, false);
    w.dec_lock(anchor, aux);
    if got {
        let claimed = w.claim_pages(&out[..total], |_, slot| CacheError::SlotNotOwned { slot });
        debug_assert!(claimed.is_ok(), "fresh pages are the caller's: {claimed:?}");
        let mut at = 0;
        for &y in &chain {
            let len = w.len_of(y);
            to_device(w, y, &out[at..at + len]);
            at += len;
            let HiNode { copy, copy_run, .. } = ext(w, y);
            let last = w.s.meta[y as usize].last_page;
            let count = w.span(y).1;
            start(w, TransferKind::Load, Some(w.runs(y)), copy, copy_run, count, last);
        }
        w.c.variant.loaded.fetch_add(total as u64, Ordering::Relaxed);
    }
    w.s.ext.chain = chain;
    if got {
        total
    } else {
        0
    }
}

impl<A: KvAllocator> RadixCache<A, Hi> {
    /// A prefix cache over `alloc` (the device pool) with a host tier of
    /// `tier.host_pages` pages of the device's page size (see the [module docs](self)).
    ///
    /// # Errors
    ///
    /// As [`RadixCache::new`] (the arenas cover the host pages too);
    /// [`ConfigError::Unsupported`] with KV events on.
    pub fn with_host_tier(
        alloc: A,
        req_pool: ReqToTokenPool,
        config: RadixConfig,
        tier: HostTier,
    ) -> Result<Self, ConfigError>
    where
        A: crate::alloc::OwnedAllocator,
    {
        if config.event_capacity.is_some() {
            return Err(ConfigError::Unsupported { what: "the host tier", with: "KV events" });
        }
        Self::with_variant(alloc, req_pool, config, Hi::new(tier, None))
    }

    /// A prefix cache over `alloc` whose host tier is `pool`'s pages: the host page
    /// numbers of [`transfer_pages`](Self::transfer_pages) are `pool`'s, for
    /// [`DeviceHostTransfer`](crate::kv::host) and the store tier to copy. `write_policy`
    /// and `load_back_threshold` as in [`HostTier`].
    ///
    /// The cache **owns** the pool while it lives ([`HostKvPool::is_owned`]): the tree
    /// allocates and frees every page, so the pool's public
    /// [`alloc_pages`](HostKvPool::alloc_pages) and [`free_pages`](HostKvPool::free_pages)
    /// are refused meanwhile (no page can have two owners), and so is a second cache
    /// over it. Reading and writing page bytes works as before.
    ///
    /// Dropping the cache gives the pool back: the tree's host pages are freed, except
    /// those of transfers [taken](Self::take_transfers) and not
    /// [completed](Self::complete) — the caller's copy may still touch them — which stay
    /// allocated for the caller to free with [`HostKvPool::free_pages`] once its copies
    /// are done (a transfer never taken was never copied: its pages are freed). Until
    /// then a new cache over the pool is refused (some pages are allocated).
    ///
    /// # Errors
    ///
    /// As [`with_host_tier`](Self::with_host_tier); [`ConfigError::HostPool`] when the
    /// pool's page size is not the allocator's, its device cache
    /// ([`HostKvConfig::kv`](crate::kv::host::HostKvConfig::kv)) has fewer pages than the
    /// allocator, another live cache owns it, or some of its pages are allocated.
    /// Nothing changed then.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
    /// use kvpool::kv::{KvConfig, KvDtype, KvLayout};
    /// use kvpool::radix::{HiRadixCache, RadixConfig, WritePolicy};
    /// use kvpool::{ConfigError, PagedAllocator, ReqToTokenPool};
    ///
    /// let kv = KvConfig { layout: KvLayout::Mha { head_num: 1, head_dim: 4 }, dtype: KvDtype::F16,
    ///                     layer_num: 2, size: 16, page_size: 2 };
    /// let pool = Arc::new(HostKvPool::pageable(HostKvConfig::with_ratio(kv, 1.0, HostLayout::PageFirst)?)?);
    /// let make = |p: &Arc<HostKvPool>| HiRadixCache::with_host_pool(
    ///     PagedAllocator::new(16, 2).unwrap(), ReqToTokenPool::new(2, 16).unwrap(), RadixConfig::default(),
    ///     Arc::clone(p), WritePolicy::WriteThrough, 1);
    /// let cache = make(&pool)?;
    /// assert!(pool.is_owned());
    /// assert!(pool.alloc_pages(&mut [0u32; 1]).is_err());        // the tree's pages
    /// assert!(matches!(make(&pool), Err(ConfigError::HostPool { .. }))); // one owner
    /// drop(cache);
    /// assert!(!pool.is_owned());
    /// pool.alloc_pages(&mut [0u32; 1])?;                          // the caller's again
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_host_pool(
        alloc: A,
        req_pool: ReqToTokenPool,
        config: RadixConfig,
        pool: Arc<HostKvPool>,
        write_policy: WritePolicy,
        load_back_threshold: usize,
    ) -> Result<Self, ConfigError>
    where
        A: crate::alloc::OwnedAllocator,
    {
        if config.event_capacity.is_some() {
            return Err(ConfigError::Unsupported { what: "the host tier", with: "KV events" });
        }
        let ps = pool.config().kv.page_size;
        if ps != alloc.page_size() {
            return Err(ConfigError::HostPool { why: "its page size is not the device allocator's" });
        }
        // The transfers name the allocator's device pages: the pool (and the copies
        // made with it) must cover them all, or a transfer could never be carried out.
        if alloc.size() / ps as usize > pool.config().device_pages() {
            return Err(ConfigError::HostPool { why: "its device cache is smaller than the device allocator's pool" });
        }
        // The cache's state claims the pool (owned by one cache, every page free), and
        // gives it back when dropped (`HiState`'s drop).
        let host_pages = u32::try_from(pool.capacity_pages())
            .map_err(|_| ConfigError::HostPool { why: "it has more than 2^32 - 1 pages" })?;
        let tier = HostTier { host_pages, write_policy, load_back_threshold };
        Self::with_variant(alloc, req_pool, config, Hi::new(tier, Some(pool)))
    }

    /// The host KV pool whose pages the tree holds, if it was given one
    /// ([`with_host_pool`](Self::with_host_pool)).
    pub fn host_pool(&self) -> Option<&Arc<HostKvPool>> {
        self.variant.pool.as_ref()
    }

    /// The host tier's configuration.
    pub fn host_tier(&self) -> HostTier {
        self.variant.tier
    }

    /// What moved between the tiers so far.
    pub fn counters(&self) -> HiCounters {
        let v = &self.variant;
        HiCounters {
            written: v.written.load(Ordering::Relaxed),
            loaded: v.loaded.load(Ordering::Relaxed),
            device_evicted: v.device_evicted.load(Ordering::Relaxed),
            host_evicted: v.host_evicted.load(Ordering::Relaxed),
            backup_refused: v.backup_refused.load(Ordering::Relaxed),
            prefetched: v.prefetched.load(Ordering::Relaxed),
        }
    }

    /// Tokens held in host pages (backups and host-only nodes).
    pub fn host_size(&self) -> usize {
        let h = self.variant.host();
        (h.capacity() as usize - h.available()) * self.ps
    }

    /// Host tokens free.
    pub fn host_available(&self) -> usize {
        self.variant.host().available() * self.ps
    }

    /// Insert `key -> slots` (whole pages of the caller's device slots): the rules of
    /// the [module docs](self). Returns the length of the device prefix the caller's
    /// slots duplicate (the caller frees those slots); host-only nodes on the way take
    /// the caller's slots.
    ///
    /// # Errors
    ///
    /// As [`RadixCache::insert`]; nothing changes then.
    #[cfg(test)]
    pub(crate) fn insert(&self, namespace: u64, key: &[u32], slots: &[u32]) -> Result<usize, CacheError> {
        let r = self.write(|w| {
            w.check_insert_shape(key, slots)?;
            let cached = w.cached_len(namespace, key);
            w.claim_pages(&slots[cached..], |_, slot| CacheError::SlotNotOwned { slot })?;
            apply_insert(w, namespace, key, slots, 0, cached);
            Ok(cached)
        });
        crate::debug_check(self);
        r
    }

    /// SGLang's `match_prefix` with a host tier: the device prefix of `key` (its slots
    /// in `out`) and the length of the host continuation after it. Touches the whole
    /// path; splits where the key ends inside a node. `out` past the device prefix is
    /// scratch.
    pub fn match_tiers(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> HiMatch {
        let key = self.aligned(key, out.len());
        let r = self.write(|w| {
            let (device, host_len, _) = match_tiers(w, namespace, key, out);
            HiMatch { device, host_len }
        });
        crate::debug_check(self);
        r
    }

    /// Match, load the host continuation back and lock, in one step: `out` gets the
    /// device prefix's slots and then the loaded part's (device slots the caller's
    /// transfer fills from the host copy). Returns the lease (its length is both) and
    /// what was found on host ([`HostHit`]): nothing is loaded when the continuation
    /// is shorter than the load-back threshold or longer than `quota`, or the device
    /// has no room even after evicting all it can (then nothing is evicted and only the
    /// device prefix is locked).
    pub(crate) fn match_and_load(
        &self,
        namespace: u64,
        key: &[u32],
        out: &mut [u32],
        quota: Option<usize>,
    ) -> (Lease<'_, A, Hi>, HostHit) {
        self.hints.admit();
        let key = self.aligned(key, out.len());
        let (key, loaded) = self.write(|w| {
            let (m, host_len, host_end) = match_tiers(w, namespace, key, out);
            let loaded = if host_len > 0 { load_back(w, host_end, &mut out[m.len..], quota) } else { 0 };
            let m = if loaded > 0 {
                let last_page = w.s.meta[host_end as usize].last_page;
                let epoch = w.s.page_epoch[last_page as usize];
                MatchResult { len: m.len + loaded, last_page, epoch, cache_id: self.id }
            } else {
                m
            };
            (w.lease_of(&m), HostHit { matched: host_len, loaded })
        });
        crate::debug_check(self);
        (Lease { cache: self, key }, loaded)
    }

    /// Move the transfers started since the last call (oldest first) into `out`, as
    /// many as fit; returns how many. Each transfer is reported once: the caller
    /// copies its pages ([`transfer_pages`](Self::transfer_pages)) and then
    /// [`complete`](Self::complete)s it. Transfers completed before they are taken are
    /// not reported.
    pub fn take_transfers(&self, out: &mut [Transfer]) -> usize {
        if out.is_empty() {
            return 0;
        }
        self.write(|w| {
            let mut n = 0;
            while n < out.len() && w.s.ext.queue_len > 0 {
                let st = &mut w.s.ext;
                let slot = st.queue[st.queue_head];
                st.queue_head = (st.queue_head + 1) % st.queue.len();
                st.queue_len -= 1;
                let e = w.s.ext.entries[slot as usize];
                if e.live {
                    w.s.ext.entries[slot as usize].taken = true;
                    out[n] = ticket(w, slot);
                    n += 1;
                    if !w.s.ext.handed_out.is_empty() {
                        // The caller's copy may touch these pages from now on.
                        let base = w.c.num_pages;
                        for (start, len) in w.chain(e.host_first, e.host_run, e.count) {
                            mark_run(&mut w.s.ext.handed_out, start - base, len, true);
                        }
                    }
                }
            }
            n
        })
    }

    /// The pages transfer `t` copies, in key order: device pages (the allocator's page
    /// numbers) into `device`, host pages (`1..=host_pages`, a
    /// [`HostKvPool`]'s numbering) into `host`, pair by
    /// pair. Returns the number of pairs ([`Transfer::pages`]).
    ///
    /// # Errors
    ///
    /// [`TransferError`] when `t` is not in flight here or a buffer is too short;
    /// nothing is written then.
    pub fn transfer_pages(&self, t: Transfer, device: &mut [u32], host: &mut [u32]) -> Result<usize, TransferError> {
        let need = t.pages();
        if device.len().min(host.len()) < need {
            return Err(TransferError::BufferTooShort { need, got: device.len().min(host.len()) });
        }
        self.write(|w| {
            let e = entry_of(w, &t)?;
            let base = w.c.num_pages;
            let pages = w.chain(e.host_first, e.host_run, e.count).flat_map(|(s, l)| s..s + l);
            for (i, p) in pages.enumerate() {
                host[i] = p - base;
                device[i] = w.s.ext.dev_of_host[(p - base) as usize];
            }
            Ok(need)
        })
    }

    /// Report transfer `t` done (its copy has finished on the device): what the tree
    /// held for it is released (see [`TransferKind`]). For a transfer that outlived a
    /// [`reset`](Self::reset), that is its pages: host pages back to the host pool, a
    /// backup's or a load's device pages back to the allocator.
    ///
    /// # Errors
    ///
    /// [`TransferError::Unknown`] when it is not in flight (completed twice, or
    /// dropped by a reset before it was taken), [`TransferError::ForeignCache`];
    /// nothing changes then.
    pub fn complete(&self, t: Transfer) -> Result<(), TransferError> {
        let r = self.write(|w| {
            entry_of(w, &t)?;
            finish_transfer(w, t.slot);
            Ok(())
        });
        crate::debug_check(self);
        r
    }

    /// Add the part of `key` the tree does not hold (on the device or host) as a
    /// host-only node: fresh host pages (host leaves are evicted for room, never the
    /// key's own path) and a [`TransferKind::Prefetch`] transfer the caller fills them
    /// with — from a shared store tier, say — and completes. Until then the node is
    /// matched ([`match_tiers`](Self::match_tiers) counts it in the host continuation)
    /// but not loaded back, and not evicted from host. Touches and may split the path
    /// like a match; `out` (at least the key's length) is scratch. Returns the tokens
    /// added: 0 when the tree holds all of `key` (cut to whole pages) or the host has no
    /// room for the rest.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvpool::radix::{HiRadixCache, HostTier, RadixConfig, Transfer, TransferKind};
    /// use kvpool::{PagedAllocator, ReqToTokenPool};
    ///
    /// let cache = Arc::new(HiRadixCache::with_host_tier(
    ///     PagedAllocator::new(64, 4)?, ReqToTokenPool::new(2, 64)?, RadixConfig::default(), HostTier::new(16))?);
    /// let key: Vec<u32> = (1..=16).collect();
    /// let mut out = [0u32; 16];
    /// // Another engine stored these 16 tokens' KV: bring them to host.
    /// assert_eq!(cache.insert_host(0, &key, &mut out), 16);
    /// let mut t = [Transfer::default(); 1];
    /// assert_eq!(cache.take_transfers(&mut t), 1);
    /// assert_eq!(t[0].kind(), TransferKind::Prefetch);
    /// let (mut device, mut host) = ([0u32; 4], [0u32; 4]);
    /// cache.transfer_pages(t[0], &mut device, &mut host)?;
    /// // ... fill host pages `host` from the store, then:
    /// cache.complete(t[0])?;
    /// let req = cache.admit(0, &key)?; // loaded back to the device
    /// assert_eq!((req.cached_len(), req.host_hit().loaded), (16, 16));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn insert_host(&self, namespace: u64, key: &[u32], out: &mut [u32]) -> usize {
        let key = self.aligned(key, out.len());
        let r = self.write(|w| {
            let (_, _, kv_len, kv_end) = w.match_path(namespace, key, out);
            let end = if kv_len == 0 { ROOT } else { w.s.page_owner[kv_end.last_page as usize] };
            insert_host(w, namespace, key, kv_len, end)
        });
        crate::debug_check(self);
        r
    }

    /// How many leading tokens of `key` the tree holds in host pages (a resident node's
    /// host copy or a host-only node), whole pages; read-only (no touch, no split).
    pub fn host_backed_len(&self, namespace: u64, key: &[u32]) -> usize {
        let ps = self.ps;
        let key = &key[..key.len() / ps * ps];
        self.write(|w| {
            let (mut pos, mut cur) = (0usize, 0u32);
            while pos < key.len() {
                let super::Lookup::Found { id, .. } = w.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps])
                else {
                    break;
                };
                let e = ext(w, id);
                if !e.host_only && e.copy == 0 {
                    break;
                }
                let (m, _, n) = w.c.count_in_node(id, &key[pos..]);
                pos += m * ps;
                if m < n {
                    break;
                }
                cur = w.s.meta[id as usize].last_page;
            }
            pos
        })
    }

    /// Transfers in flight (started and not completed).
    pub fn transfers_in_flight(&self) -> usize {
        self.write(|w| w.s.ext.entries.len() - w.s.ext.free_entries.len())
    }

    /// Host eviction: remove host-only leaves, least recently used first, until at
    /// least `num_tokens` host tokens are freed or none is left. Returns the host
    /// tokens freed. Leaves whose write-back is in flight stay.
    pub fn evict_host(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            return 0;
        }
        let r = self.write(|w| evict_host(w, num_tokens));
        crate::debug_check(self);
        r
    }
}

#[cfg(all(test, not(loom)))]
#[path = "tests_hi.rs"]
mod tests;
