//! [`HiRadixCache`] against [`ReferenceHiCache`], operation by operation (feature
//! `models`): the shared driver of `tests/hi_tree_model.rs` and the `hi_ops` fuzz
//! target.
//!
//! kvpool's side runs every request through the engine contract, a
//! [`Request`] handle: admission (match, load the host
//! continuation back, lock), the prompt's allocation (evicting the shortfall), decode
//! batches, finishes now or later, aborts. The reference side runs SGLang's calls on
//! the simple two-tier tree (match, load back, lock, allocate, `cache_finished_req`,
//! free and unlock). Both sides also run the same device evictions, host evictions and
//! host prefetches (`insert_host`). After every operation the driver compares the op's
//! results (the lock and its slots, the host continuation and what was loaded back,
//! whether each allocation succeeded and its slots, decode slots, the device prefix a
//! finish found, tokens freed by each eviction) and the state: evictable / protected /
//! host tokens, node count, free device tokens, free request rows, and every counter of
//! what moved between the tiers (tokens written to host, loaded back, evicted from each
//! tier, backups refused). Both eviction orders depend on every touch and both tiers'
//! room on every backup, so a wrong tick or a lost page shows up as a different
//! counter. It also runs both sides' invariant checks after every step (kvpool's
//! includes the accounting of the device pool: free + cached + what requests hold), and
//! at the end returns every request and evicts everything: both pools must be whole.
//!
//! Refusals the contract promises are checked against a snapshot of the cache (the
//! sizes, free device tokens and rows, node count, counters, transfers in flight) and of
//! the request: a finish with one token more or fewer than the request holds, a decode
//! past the end of a row, an admission without a free row.
//!
//! Requests with `salted` set are cached under a salted [`CacheKey`] (so are host
//! prefetches with it): they must never see the other key's KV, on either tier (the
//! reference keeps the two apart as namespaces 0 and 1).
//!
//! Transfers: after every op the driver takes the transfers both sides started and
//! compares them (kind and pages, in start order, and that kvpool's page pairs name
//! host pages it holds). A shape either completes them at once (the tree then behaves
//! as SGLang's with copies that take no time) or leaves them in flight until a
//! [`HiOp::Complete`] picks one, so evictions, loads and host evictions meet nodes
//! whose copies have not landed. A completed transfer completed again must be refused.
//!
//! [`HiOp::Reset`] needs the cache by `&mut`: the driver holds it in an [`Arc`], as
//! every open request does, so [`Arc::get_mut`] succeeds exactly when no request is
//! open. A reset with requests open is refused (nothing changes, on either side);
//! otherwise both sides drop their trees, and the transfers in flight (all taken by
//! then) outlive the reset on both, holding their pages until a later `Complete`.

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::hicache_ref::RefTransfer;
use crate::baseline::hicache_ref::{HiNodeId, ReferenceHiCache};
use crate::radix::{
    CacheError, CacheKey, EvictionPolicy, Hi, HiRadixCache, HostTier, RadixConfig, Request, Transfer, TransferError,
    TransferKind, WritePolicy,
};
use crate::{AllocError, KvAllocator, PagedAllocator, ReqToTokenPool};

/// Longest key, in tokens.
pub const MAX_KEY: usize = 24;
/// Tokens a request row holds.
const ROW: usize = MAX_KEY + 8;
/// Open requests at most (the cache's request rows).
const MAX_REQS: usize = 4;
/// The salt of namespace 1.
const SALT: u64 = 0x5a17;
/// How many ops the `hi_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 32;
/// The device policies a shape picks from.
pub const POLICIES: [EvictionPolicy; 4] =
    [EvictionPolicy::Lru, EvictionPolicy::Lfu, EvictionPolicy::Fifo, EvictionPolicy::Mru];

/// One step of a run. `req` is taken modulo the open requests (an op with none to pick
/// does nothing).
#[derive(Arbitrary, Debug, Clone)]
pub enum HiOp {
    /// A request for `key` (tokens mod the alphabet, cut to [`MAX_KEY`]): `admit`
    /// (match, load back, lock), then `extend` by the rest of its prompt (an allocation
    /// that fails aborts it); finished at once when `finish`. With every row taken, the
    /// admission must be refused.
    Start {
        /// Its tokens.
        key: Vec<u8>,
        /// Whether it finishes at once.
        finish: bool,
        /// Cached under a salted key.
        salted: bool,
    },
    /// One decode step (`decode`) for the open requests whose bit (index modulo 8) is
    /// set in `mask`, outputs from `token`.
    Decode {
        /// Which open requests.
        mask: u8,
        /// Output tokens.
        token: u8,
    },
    /// Finish an open request. `miscount % 3` of 1 or 2 first finishes with one token
    /// fewer or one more than it holds, which must be refused.
    Finish {
        /// Which.
        req: u8,
        /// A wrong token count first.
        miscount: u8,
    },
    /// Abort an open request (`abort`), or drop it when `drop`.
    Abort {
        /// Which.
        req: u8,
        /// Drop the handle instead of calling `abort`.
        drop: bool,
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
        /// Under the salted key.
        salted: bool,
    },
    /// `reset`, through [`Arc::get_mut`]: refused while a request is open; otherwise the
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

type HRequest = Request<PagedAllocator, Hi>;

/// An open request: kvpool's handle and the reference's view of the same request.
struct Open {
    req: HRequest,
    /// The reference's namespace (0, or 1 for the salted key).
    ns: u64,
    /// The tokens whose KV the row holds (`req.len()` of them).
    kv: Vec<u32>,
    ref_kv: Vec<u32>,
    protected: usize,
    node: HiNodeId,
}

/// (Evictable, protected, host, nodes), (free device, free rows, transfers in flight),
/// the counters.
type Snapshot = ((usize, usize, usize, usize), (usize, usize, usize), crate::radix::HiCounters);

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

/// The cache key of namespace 1 (`salted`) or 0.
fn cache_key(salted: bool) -> CacheKey {
    CacheKey { salt: if salted { SALT } else { 0 }, ..CacheKey::default() }
}

/// The open requests whose bit (index modulo 8) is set in `mask`.
fn batch(open: &mut [Open], mask: u8) -> Vec<&mut HRequest> {
    open.iter_mut().enumerate().filter(|(i, _)| mask >> (i % 8) & 1 == 1).map(|(_, o)| &mut o.req).collect()
}

fn snapshot(c: &HiRadixCache<PagedAllocator>) -> Snapshot {
    (
        (c.evictable_size(), c.protected_size(), c.host_size(), c.node_count()),
        (c.allocator().available_size(), c.req_pool().available_size(), c.transfers_in_flight()),
        c.counters(),
    )
}

/// Device tokens the transfers that outlived a reset still hold (a backup's pages its
/// copy reads, a load's it writes), until they complete.
fn kept(flight: &[(Transfer, RefTransfer)], outlived: &[Transfer], ps: usize) -> usize {
    let keeps = |t: &Transfer| outlived.contains(t) && matches!(t.kind(), TransferKind::Backup | TransferKind::Load);
    flight.iter().filter(|(t, _)| keeps(t)).map(|(t, _)| t.pages() * ps).sum()
}

/// Compare the two sides' state and run both invariant checks; `held` is the device
/// tokens open requests hold, `kept` those that transfers outliving a reset hold.
fn compare(
    step: usize,
    c: &HiRadixCache<PagedAllocator>,
    r: &ReferenceHiCache<PagedAllocator>,
    open: usize,
    (held, kept): (usize, usize),
) -> Result<(), String> {
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
    ensure(c.req_pool().available_size() == MAX_REQS - open, || {
        format!("step {step}: {} free rows with {open} requests open", c.req_pool().available_size())
    })?;
    // Free + cached + what requests hold + what transfers outliving a reset hold is
    // the device pool.
    let device = c.allocator().size();
    let accounted = c.allocator().available_size() + c.total_size() + held + kept;
    ensure(accounted == device, || {
        format!("step {step}: {accounted} device tokens free, cached, held or kept, of {device}")
    })?;
    // The cache's own check counts the pages a reset left to transfers in flight too.
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

/// Finish `o` on both sides (after a wrong count first, when `miscount` says so).
fn finish(
    c: &HiRadixCache<PagedAllocator>,
    r: &mut ReferenceHiCache<PagedAllocator>,
    mut o: Open,
    miscount: u8,
) -> Result<(), String> {
    let len = o.kv.len();
    let wrong = match miscount % 3 {
        1 if len > 0 => Some(o.kv[..len - 1].to_vec()),
        2 => Some(o.kv.iter().copied().chain([0]).collect()),
        _ => None,
    };
    if let Some(wrong) = wrong {
        let before = snapshot(c);
        let Err(refused) = o.req.finish(&wrong) else {
            return Err(format!("a finish with {} tokens of {len} was accepted", wrong.len()));
        };
        let want = CacheError::TokenCount { tokens: wrong.len(), held: len };
        ensure(refused.error == want, || format!("a finish with a wrong count gave {}, not {want}", refused.error))?;
        o.req = refused.request;
        ensure(snapshot(c) == before, || format!("a refused finish changed {before:?} to {:?}", snapshot(c)))?;
        let got = (o.req.len(), o.req.cached_len(), o.req.slots());
        ensure(got == (len, o.protected, &o.ref_kv[..]), || format!("a refused finish changed the request: {got:?}"))?;
    }
    let theirs = r.cache_finished_req(o.ns, &o.kv, &o.ref_kv, o.protected, o.node);
    let ours = o.req.finish(&o.kv).map_err(|e| format!("finish: {}", e.error))?;
    ensure(ours == theirs, || format!("finish found {ours} cached, reference {theirs}"))
}

/// Abort `o` on both sides: its own slots and its row go back, its lock is released.
fn abort(r: &mut ReferenceHiCache<PagedAllocator>, o: Open, drop_it: bool) -> Result<(), String> {
    let Open { req, ref_kv, protected, node, .. } = o;
    if drop_it {
        drop(req);
    } else {
        req.abort();
    }
    r.allocator().free(&ref_kv[protected..]).map_err(|e| format!("reference abort: {e}"))?;
    r.dec_lock_ref(node);
    Ok(())
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
    let rows = ReqToTokenPool::new(MAX_REQS as u32, ROW).map_err(|e| e.to_string())?;
    let alloc = PagedAllocator::new(device, shape.page_size).map_err(|e| e.to_string())?;
    let mut c = Arc::new(HiRadixCache::with_host_tier(alloc, rows, config, tier).map_err(|e| e.to_string())?);
    let ref_alloc = PagedAllocator::new(device, shape.page_size).map_err(|e| e.to_string())?;
    let mut r = ReferenceHiCache::new(ref_alloc, shape.host_pages, shape.policy, shape.write_policy, shape.threshold)
        .map_err(|e| e.to_string())?;
    let mut open: Vec<Open> = Vec::new();
    let mut flight: Vec<(Transfer, RefTransfer)> = Vec::new();
    // Transfers in flight at a reset (they outlive it, holding their pages).
    let mut outlived: Vec<Transfer> = Vec::new();
    let held = |open: &[Open]| -> usize { open.iter().map(|o| o.kv.len().next_multiple_of(ps) - o.protected).sum() };
    let tokens =
        |key: &[u8]| -> Vec<u32> { key.iter().take(MAX_KEY).map(|&t| u32::from(t) % shape.alphabet).collect() };
    for (step, op) in ops.iter().enumerate() {
        match op {
            HiOp::Start { key, finish: done, salted } => {
                let key = tokens(key);
                let ckey = cache_key(*salted);
                if open.len() == MAX_REQS {
                    let before = snapshot(&c);
                    match c.admit(ckey, &key) {
                        Err(AllocError::OutOfMemory(_)) => {}
                        other => return Err(format!("step {step}: admission with every row taken gave {other:?}")),
                    }
                    let after = snapshot(&c);
                    ensure(after == before, || {
                        format!("step {step}: a refused admission changed {before:?} to {after:?}")
                    })?;
                    continue;
                }
                let ns = u64::from(*salted);
                // The reference.
                let m = r.match_prefix(ns, &key);
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
                let mut req = c.admit(ckey, &key).map_err(|e| format!("step {step}: admit: {e}"))?;
                let found = req.host_hit();
                ensure(found.matched == m.host_len, || {
                    format!("step {step}: host continuation {}, reference {}", found.matched, m.host_len)
                })?;
                let loaded = hit.len() - m.device.len();
                ensure((req.cached_len(), found.loaded, req.slots()) == (hit.len(), loaded, &hit[..]), || {
                    format!(
                        "step {step}: lock {} loaded {} slots {:?}, reference {} loaded {loaded} slots {hit:?}",
                        req.cached_len(),
                        found.loaded,
                        req.slots(),
                        hit.len()
                    )
                })?;
                // The rest of the prompt, evicting the shortfall on both sides.
                let (h, len) = (hit.len(), key.len());
                let ours = req.extend(len - h);
                let (prefix, seq) = ([h as u32], [len as u32]);
                let need = r.allocator().extend_need(&prefix, &seq).map_err(|e| e.to_string())?;
                let avail = r.allocator().available_size();
                if avail < need && need - avail <= r.evictable_size() {
                    r.evict(need - avail);
                }
                let mut rest = vec![0u32; len - h];
                let last = hit.last().copied().unwrap_or(0);
                let theirs = len == h || r.allocator().alloc_extend(&prefix, &seq, &[last], &mut rest).is_ok();
                ensure(ours.is_ok() == theirs, || format!("step {step}: allocation {ours:?}, reference {theirs}"))?;
                let o = Open { req, ns, kv: key, ref_kv: hit, protected: h, node };
                if !theirs {
                    abort(&mut r, o, step % 2 == 0).map_err(|e| format!("step {step}: {e}"))?;
                } else {
                    let mut o = o;
                    ensure(o.req.slots()[h..] == rest[..], || {
                        format!("step {step}: new slots {:?}, reference {rest:?}", &o.req.slots()[h..])
                    })?;
                    o.ref_kv.extend_from_slice(&rest);
                    if *done {
                        finish(&c, &mut r, o, 0).map_err(|e| format!("step {step}: {e}"))?;
                    } else {
                        open.push(o);
                    }
                }
            }
            HiOp::Decode { mask, token } => {
                let picked: Vec<usize> = (0..open.len()).filter(|i| mask >> (i % 8) & 1 == 1).collect();
                let mut out = vec![0u32; picked.len()];
                if picked.iter().any(|&i| open[i].kv.len() >= ROW) {
                    let before = snapshot(&c);
                    match c.decode(&mut batch(&mut open, *mask), &mut out) {
                        Err(AllocError::Row(_)) => {}
                        other => return Err(format!("step {step}: a decode past a row's end gave {other:?}")),
                    }
                    let after = snapshot(&c);
                    ensure(after == before, || {
                        format!("step {step}: a refused decode changed {before:?} to {after:?}")
                    })?;
                } else {
                    let ours = c.decode(&mut batch(&mut open, *mask), &mut out);
                    let seq: Vec<u32> = picked.iter().map(|&i| open[i].kv.len() as u32 + 1).collect();
                    let last: Vec<u32> = picked.iter().map(|&i| open[i].ref_kv.last().copied().unwrap_or(0)).collect();
                    let need = r.allocator().decode_need(&seq).map_err(|e| e.to_string())?;
                    let avail = r.allocator().available_size();
                    if avail < need && need - avail <= r.evictable_size() {
                        r.evict(need - avail);
                    }
                    let mut want = vec![0u32; picked.len()];
                    let theirs = r.allocator().alloc_decode(&seq, &last, &mut want).is_ok();
                    ensure(ours.is_ok() == theirs, || format!("step {step}: decode {ours:?}, reference {theirs}"))?;
                    if theirs {
                        ensure(out == want, || format!("step {step}: decode slots {out:?}, reference {want:?}"))?;
                        for (k, &i) in picked.iter().enumerate() {
                            let o = &mut open[i];
                            o.kv.push((u32::from(*token) + k as u32) % shape.alphabet);
                            o.ref_kv.push(want[k]);
                        }
                    }
                }
            }
            HiOp::Finish { req, miscount } => {
                if !open.is_empty() {
                    let o = open.remove(*req as usize % open.len());
                    finish(&c, &mut r, o, *miscount).map_err(|e| format!("step {step}: {e}"))?;
                }
            }
            HiOp::Abort { req, drop } => {
                if !open.is_empty() {
                    let o = open.remove(*req as usize % open.len());
                    abort(&mut r, o, *drop).map_err(|e| format!("step {step}: {e}"))?;
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
            HiOp::InsertHost { key, salted } => {
                let key = tokens(key);
                let (ns, ref_ns) = (cache_key(*salted).tree_key(&key).0, u64::from(*salted));
                let theirs = r.insert_host(ref_ns, &key);
                let mut out = vec![0u32; key.len()];
                let ours = c.insert_host(ns, &key, &mut out);
                ensure(ours == theirs, || format!("step {step}: insert_host added {ours}, reference {theirs}"))?;
                let (ours, theirs) = (c.host_backed_len(ns, &key), r.host_backed_len(ref_ns, &key));
                ensure(ours == theirs, || format!("step {step}: host_backed_len {ours}, reference {theirs}"))?;
            }
            HiOp::Reset => {
                let before = snapshot(&c);
                let n = open.len();
                match Arc::get_mut(&mut c) {
                    Some(cache) if n == 0 => {
                        cache.reset().map_err(|e| format!("step {step}: reset with no request open: {e}"))?;
                        r.reset();
                        outlived.extend(flight.iter().map(|(t, _)| *t));
                        ensure(c.transfers_in_flight() == flight.len(), || {
                            format!(
                                "step {step}: {} transfers in flight after a reset, {} taken",
                                c.transfers_in_flight(),
                                flight.len()
                            )
                        })?;
                    }
                    None if n > 0 => {
                        let after = snapshot(&c);
                        ensure(after == before, || {
                            format!("step {step}: a refused reset changed {before:?} to {after:?}")
                        })?;
                    }
                    other => {
                        let got = other.is_some();
                        return Err(format!("step {step}: exclusive access {got} with {n} requests open"));
                    }
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
        outlived.retain(|t| flight.iter().any(|(f, _)| f == t));
        compare(step, &c, &r, open.len(), (held(&open), kept(&flight, &outlived, ps)))?;
        ensure(Arc::strong_count(&c) == 1 + open.len(), || format!("step {step}: the cache's holders"))?;
    }
    complete_all(&c, &mut r, &mut flight)?;
    for o in open.drain(..) {
        finish(&c, &mut r, o, 0)?;
    }
    complete_all(&c, &mut r, &mut flight)?;
    let (ours, theirs) = (c.evict(usize::MAX), r.evict(usize::MAX));
    ensure(ours == theirs, || format!("teardown: evict freed {ours}, reference {theirs}"))?;
    complete_all(&c, &mut r, &mut flight)?;
    let (ours, theirs) = (c.evict_host(usize::MAX), r.evict_host(usize::MAX));
    ensure(ours == theirs, || format!("teardown: evict_host freed {ours}, reference {theirs}"))?;
    compare(ops.len(), &c, &r, 0, (0, 0))?;
    ensure(c.allocator().available_size() == device && c.host_size() == 0 && c.node_count() == 0, || {
        format!(
            "teardown: {} device tokens free of {device}, {} host tokens held",
            c.allocator().available_size(),
            c.host_size()
        )
    })?;
    ensure(Arc::strong_count(&c) == 1, || "teardown: the cache is still shared".to_string())
}
