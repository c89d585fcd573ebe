//! [`HiRadixCache`] against [`ReferenceHiCache`], operation by operation (feature
//! `models`): the shared driver of `tests/hi_tree_model.rs` and the `hi_ops` fuzz
//! target.
//!
//! Both sides run the same requests (match, load back, lock, allocate the rest with
//! eviction, finish now or later), device evictions and host evictions. After every
//! operation the driver compares the op's results (lease and loaded lengths, whether
//! the allocation succeeded, the device prefix an insert found, tokens freed by each
//! eviction) and the state: evictable / protected / host tokens, node count, and every
//! counter of what moved between the tiers (tokens written to host, loaded back,
//! evicted from each tier, backups refused). Both eviction orders depend on every touch
//! and both tiers' room on every backup, so a wrong tick or a lost page shows up as a
//! different counter. It also runs both sides' invariant checks after every step, and
//! at the end returns every request and evicts everything: both pools must be whole.
//!
//! Transfers: after every op the driver takes the transfers both sides started and
//! compares them (kind and pages, in start order, and that kvpool's page pairs name
//! host pages it holds). A shape either completes them at once (the tree then behaves
//! as SGLang's with copies that take no time) or leaves them in flight until a
//! [`HiOp::Complete`] picks one, so evictions, loads and host evictions meet nodes
//! whose copies have not landed. A completed transfer completed again must be refused.
//!
//! [`HiOp::Reset`] must be refused (nothing changed) exactly while an open request holds
//! a lease on the tree (a match of at least a page); otherwise both sides drop their
//! trees, and the transfers in flight (all taken by then) outlive the reset on both,
//! holding their pages until a later `Complete`.

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::hicache_ref::RefTransfer;
use crate::baseline::hicache_ref::{HiNodeId, ReferenceHiCache};
use crate::radix::{
    CacheError, EvictionPolicy, HiRadixCache, HostTier, RadixConfig, RawLease, Transfer, TransferError, WritePolicy,
};
use crate::{KvAllocator, PagedAllocator, ReqRow, ReqToTokenPool};

/// Longest key, in tokens.
pub const MAX_KEY: usize = 24;
/// Open requests at most.
const MAX_REQS: usize = 4;
/// How many ops the `hi_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 32;
/// The device policies a shape picks from.
pub const POLICIES: [EvictionPolicy; 4] =
    [EvictionPolicy::Lru, EvictionPolicy::Lfu, EvictionPolicy::Fifo, EvictionPolicy::Mru];

/// One step of a run. `req` is taken modulo the open requests.
#[derive(Arbitrary, Debug, Clone)]
pub enum HiOp {
    /// A request for `key` (tokens mod the alphabet, cut to [`MAX_KEY`]): match, load
    /// back, lock, allocate the rest; finished at once when `finish`.
    Start {
        /// Its tokens.
        key: Vec<u8>,
        /// Whether it finishes at once.
        finish: bool,
    },
    /// Finish an open request.
    Finish {
        /// Which.
        req: u8,
    },
    /// Device eviction of this many tokens.
    Evict(u8),
    /// Host eviction of this many tokens.
    EvictHost(u8),
    /// Complete one transfer in flight (taken modulo those in flight).
    Complete(u8),
    /// Bring `key`'s uncached part to host (`insert_host`, a prefetch from a store).
    InsertHost {
        /// Its tokens.
        key: Vec<u8>,
    },
    /// `reset`: refused while an open request holds a lease on the tree; otherwise the
    /// tree goes and the transfers in flight (all taken) outlive it.
    Reset,
}

/// A run's shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Tokens per page.
    pub page_size: u32,
    /// Device pages.
    pub device_pages: u32,
    /// Host pages.
    pub host_pages: u32,
    /// The write policy.
    pub write_policy: WritePolicy,
    /// The load-back threshold, in tokens.
    pub threshold: usize,
    /// The device eviction policy.
    pub policy: EvictionPolicy,
    /// Token alphabet size (small: keys share prefixes).
    pub alphabet: u32,
    /// Complete every transfer right after the op that started it.
    pub complete_at_once: bool,
}

impl Shape {
    /// A shape from raw bytes (every value valid).
    pub fn from_bytes(b: [u8; 6]) -> Shape {
        let complete_at_once = b[0] / 3 % 2 == 0;
        Shape {
            page_size: [1, 2, 4][b[0] as usize % 3],
            device_pages: 4 + u32::from(b[1] % 16),
            host_pages: 1 + u32::from(b[2] % 24),
            write_policy: WritePolicy::ALL[b[3] as usize % 3],
            threshold: 1 + b[4] as usize % 6,
            policy: POLICIES[b[5] as usize % POLICIES.len()],
            alphabet: 2,
            complete_at_once,
        }
    }
}

/// A shape and at most `max_ops` ops from fuzz input bytes.
pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> (Shape, Vec<HiOp>) {
    let mut u = Unstructured::new(bytes);
    let head: [u8; 6] = u.arbitrary().unwrap_or_default();
    let mut ops = Vec::new();
    while ops.len() < max_ops {
        match u.arbitrary::<HiOp>() {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    (Shape::from_bytes(head), ops)
}

struct Open {
    key: Vec<u32>,
    // The reference's side.
    kv: Vec<u32>,
    protected: usize,
    node: HiNodeId,
    // kvpool's side.
    row: ReqRow,
    lease: RawLease,
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

fn compare(step: usize, c: &HiRadixCache<PagedAllocator>, r: &ReferenceHiCache<PagedAllocator>) -> Result<(), String> {
    let ours = (c.evictable_size(), c.protected_size(), c.host_size(), c.node_count());
    let theirs = (r.evictable_size(), r.protected_size(), r.host_size(), r.node_count());
    ensure(ours == theirs, || {
        format!("step {step}: (evictable, protected, host, nodes) {ours:?}, reference {theirs:?}\n{}", c.pretty_print())
    })?;
    ensure(c.counters() == r.counters(), || {
        format!("step {step}: counters {:?}, reference {:?}", c.counters(), r.counters())
    })?;
    ensure(c.allocator().available_size() == r.allocator().available_size(), || {
        format!(
            "step {step}: device free {}, reference {}",
            c.allocator().available_size(),
            r.allocator().available_size()
        )
    })?;
    c.check_invariants().map_err(|e| format!("step {step}: {e}\n{}", c.pretty_print()))?;
    r.check().map_err(|e| format!("step {step}: reference: {e}"))
}

/// Take the transfers both sides started and check they agree.
fn take(
    c: &HiRadixCache<PagedAllocator>,
    r: &mut ReferenceHiCache<PagedAllocator>,
    flight: &mut Vec<(Transfer, RefTransfer)>,
) -> Result<(), String> {
    let theirs = r.take_transfers();
    let mut ours = vec![Transfer::default(); theirs.len() + 1];
    let n = c.take_transfers(&mut ours);
    ensure(n == theirs.len(), || format!("{n} transfers started, reference {}", theirs.len()))?;
    for (t, rt) in ours.into_iter().zip(theirs) {
        ensure(t.kind() == rt.kind && t.pages() == rt.pages.len(), || {
            format!("transfer {:?} of {} pages, reference {:?} of {}", t.kind(), t.pages(), rt.kind, rt.pages.len())
        })?;
        let (mut dev, mut host) = (vec![0u32; t.pages()], vec![0u32; t.pages()]);
        let got = c.transfer_pages(t, &mut dev, &mut host).map_err(|e| format!("transfer_pages: {e}"))?;
        ensure(got == t.pages(), || format!("transfer_pages gave {got} of {}", t.pages()))?;
        ensure(host.iter().all(|&h| h >= 1 && h <= c.host_tier().host_pages), || format!("host pages {host:?}"))?;
        flight.push((t, rt));
    }
    Ok(())
}

/// Complete the `i`-th transfer in flight on both sides.
fn complete(
    c: &HiRadixCache<PagedAllocator>,
    r: &mut ReferenceHiCache<PagedAllocator>,
    flight: &mut Vec<(Transfer, RefTransfer)>,
    i: usize,
) -> Result<(), String> {
    let (t, rt) = flight.remove(i);
    c.complete(t).map_err(|e| format!("complete: {e}"))?;
    ensure(r.complete(rt.id), || "reference: transfer not in flight".to_string())?;
    ensure(c.complete(t) == Err(TransferError::Unknown), || "a transfer completed twice".to_string())
}

fn complete_all(
    c: &HiRadixCache<PagedAllocator>,
    r: &mut ReferenceHiCache<PagedAllocator>,
    flight: &mut Vec<(Transfer, RefTransfer)>,
) -> Result<(), String> {
    take(c, r, flight)?;
    while !flight.is_empty() {
        complete(c, r, flight, 0)?;
    }
    ensure(c.transfers_in_flight() == 0 && r.transfers_in_flight() == 0, || "transfers left in flight".into())
}

fn finish(c: &HiRadixCache<PagedAllocator>, r: &mut ReferenceHiCache<PagedAllocator>, o: Open) -> Result<(), String> {
    let theirs = r.cache_finished_req(0, &o.key, &o.kv, o.protected, o.node);
    let lease = c.attach(o.lease).map_err(|_| "a request's lease no longer attaches".to_string())?;
    let ours = c.cache_finished_req(0, &o.key, o.row, lease).map_err(|e| format!("cache_finished_req: {e}"))?;
    ensure(ours == theirs, || format!("cache_finished_req found {ours} cached, reference {theirs}"))
}

/// Run `ops` on both sides (see the module docs).
///
/// # Errors
///
/// The first disagreement, described.
pub fn run(shape: Shape, ops: &[HiOp]) -> Result<(), String> {
    let ps = shape.page_size as usize;
    let device = shape.device_pages as usize * ps;
    let tier = HostTier {
        host_pages: shape.host_pages,
        write_policy: shape.write_policy,
        load_back_threshold: shape.threshold,
    };
    let config = RadixConfig { policy: shape.policy, ..RadixConfig::default() };
    let rows = ReqToTokenPool::new(MAX_REQS as u32 + 1, MAX_KEY + ps).map_err(|e| e.to_string())?;
    let alloc = PagedAllocator::new(device, shape.page_size).map_err(|e| e.to_string())?;
    let mut c = HiRadixCache::with_host_tier(alloc, rows, config, tier).map_err(|e| e.to_string())?;
    let ref_alloc = PagedAllocator::new(device, shape.page_size).map_err(|e| e.to_string())?;
    let mut r = ReferenceHiCache::new(ref_alloc, shape.host_pages, shape.policy, shape.write_policy, shape.threshold)
        .map_err(|e| e.to_string())?;
    let mut open: Vec<Open> = Vec::new();
    let mut flight: Vec<(Transfer, RefTransfer)> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            HiOp::Start { key, finish: done } => {
                if open.len() >= MAX_REQS {
                    continue;
                }
                let key: Vec<u32> = key.iter().take(MAX_KEY).map(|&t| u32::from(t) % shape.alphabet).collect();
                // The reference.
                let m = r.match_prefix(0, &key);
                let mut hit = m.device.clone();
                let mut node = m.device_node;
                if m.host_len > 0 {
                    if let Some(s) = r.load_back(m.host_node, None) {
                        hit.extend_from_slice(&s);
                        node = m.host_node;
                    }
                }
                r.inc_lock_ref(node);
                // kvpool.
                let mut out = vec![0u32; key.len()];
                let (lease, found) = c.match_and_load(0, &key, &mut out, None);
                let loaded = found.loaded;
                ensure(found.matched == m.host_len, || {
                    format!("step {step}: host continuation {}, reference {}", found.matched, m.host_len)
                })?;
                ensure(lease.len() == hit.len() && loaded == hit.len() - m.device.len(), || {
                    format!(
                        "step {step}: lease {} loaded {loaded}, reference {} loaded {}",
                        lease.len(),
                        hit.len(),
                        hit.len() - m.device.len()
                    )
                })?;
                let need = key.len() - hit.len();
                if r.allocator().available_size() < need {
                    r.evict(need - r.allocator().available_size());
                }
                let mut rest = vec![0u32; need];
                let theirs = r.allocator().alloc(&mut rest).is_ok();
                let mut kv = out[..lease.len()].to_vec();
                let mut ours_rest = vec![0u32; need];
                // As the reference: evict the shortfall, then allocate (the tail may be a
                // partial page).
                if c.allocator().available_size() < need {
                    c.evict(need - c.allocator().available_size());
                }
                let ours = c.allocator().alloc(&mut ours_rest).is_ok();
                ensure(ours == theirs, || format!("step {step}: allocation {ours}, reference {theirs}"))?;
                if !theirs {
                    r.dec_lock_ref(node);
                    drop(lease);
                } else {
                    let protected = hit.len();
                    hit.extend_from_slice(&rest);
                    kv.extend_from_slice(&ours_rest);
                    let mut row = c.req_pool().alloc().map_err(|e| format!("step {step}: row: {e}"))?;
                    c.req_pool().write(&mut row, 0, &kv).map_err(|e| format!("step {step}: row: {e}"))?;
                    let o = Open { key, kv: hit, protected, node, row, lease: lease.detach() };
                    if *done {
                        finish(&c, &mut r, o).map_err(|e| format!("step {step}: {e}"))?;
                    } else {
                        open.push(o);
                    }
                }
            }
            HiOp::Finish { req } => {
                if !open.is_empty() {
                    let o = open.remove(*req as usize % open.len());
                    finish(&c, &mut r, o).map_err(|e| format!("step {step}: {e}"))?;
                }
            }
            HiOp::Evict(n) => {
                let (ours, theirs) = (c.evict(*n as usize), r.evict(*n as usize));
                ensure(ours == theirs, || format!("step {step}: evict freed {ours}, reference {theirs}"))?;
            }
            HiOp::EvictHost(n) => {
                let (ours, theirs) = (c.evict_host(*n as usize), r.evict_host(*n as usize));
                ensure(ours == theirs, || format!("step {step}: evict_host freed {ours}, reference {theirs}"))?;
            }
            HiOp::InsertHost { key } => {
                let key: Vec<u32> = key.iter().take(MAX_KEY).map(|&t| u32::from(t) % shape.alphabet).collect();
                let theirs = r.insert_host(0, &key);
                let mut out = vec![0u32; key.len()];
                let ours = c.insert_host(0, &key, &mut out);
                ensure(ours == theirs, || format!("step {step}: insert_host added {ours}, reference {theirs}"))?;
                let (ours, theirs) = (c.host_backed_len(0, &key), r.host_backed_len(0, &key));
                ensure(ours == theirs, || format!("step {step}: host_backed_len {ours}, reference {theirs}"))?;
            }
            HiOp::Reset => {
                let leases = open.iter().filter(|o| o.protected > 0).count();
                let before = (c.total_size(), c.host_size(), c.node_count(), c.allocator().available_size());
                match c.reset() {
                    Err(CacheError::Leased { leases: n }) if leases > 0 => {
                        ensure(n == leases, || format!("step {step}: reset refused for {n} leases, {leases} open"))?;
                        let after = (c.total_size(), c.host_size(), c.node_count(), c.allocator().available_size());
                        ensure(after == before, || {
                            format!("step {step}: a refused reset changed {before:?} to {after:?}")
                        })?;
                    }
                    Ok(()) if leases == 0 => {
                        r.reset();
                        ensure(c.transfers_in_flight() == flight.len(), || {
                            format!(
                                "step {step}: {} transfers in flight after a reset, {} taken",
                                c.transfers_in_flight(),
                                flight.len()
                            )
                        })?;
                    }
                    other => return Err(format!("step {step}: reset with {leases} leases open gave {other:?}")),
                }
            }
            HiOp::Complete(i) => {
                take(&c, &mut r, &mut flight).map_err(|e| format!("step {step}: {e}"))?;
                if !flight.is_empty() {
                    let i = *i as usize % flight.len();
                    complete(&c, &mut r, &mut flight, i).map_err(|e| format!("step {step}: {e}"))?;
                }
            }
        }
        take(&c, &mut r, &mut flight).map_err(|e| format!("step {step}: {e}"))?;
        if shape.complete_at_once {
            complete_all(&c, &mut r, &mut flight).map_err(|e| format!("step {step}: {e}"))?;
        }
        compare(step, &c, &r)?;
    }
    complete_all(&c, &mut r, &mut flight)?;
    for o in open.drain(..) {
        finish(&c, &mut r, o)?;
    }
    complete_all(&c, &mut r, &mut flight)?;
    let (ours, theirs) = (c.evict(usize::MAX), r.evict(usize::MAX));
    ensure(ours == theirs, || format!("teardown: evict freed {ours}, reference {theirs}"))?;
    complete_all(&c, &mut r, &mut flight)?;
    let (ours, theirs) = (c.evict_host(usize::MAX), r.evict_host(usize::MAX));
    ensure(ours == theirs, || format!("teardown: evict_host freed {ours}, reference {theirs}"))?;
    compare(ops.len(), &c, &r)?;
    ensure(c.allocator().available_size() == device && c.host_size() == 0 && c.node_count() == 0, || {
        format!(
            "teardown: {} device tokens free of {device}, {} host tokens held",
            c.allocator().available_size(),
            c.host_size()
        )
    })
}
