//! [`SwaRadixCache`] against [`ReferenceSwaCache`], operation by operation (feature
//! `models`): the shared driver of `tests/swa_tree_model.rs` and the `swa_ops` fuzz
//! target.
//!
//! The real cache runs over an [`SwaAllocator`]; the reference over its own model of the
//! two pools ([`RefDualPool`]), which hands out the same pages (lowest free first) and
//! maps them the same way. So the two sides must agree on every full slot, and on which
//! window page each full page has, not just on lengths.
//!
//! After every operation the driver compares the op's own result (matched and peeked
//! lengths and slots, lease lengths, insert results, tokens freed by each eviction pass,
//! window tokens released, allocation outcomes and slots) and the sizes: total /
//! evictable / protected tokens, window evictable / protected tokens, tombstone tokens,
//! both pools' free tokens, node count. Every `full_every` steps, after the last step
//! and after the teardown it also compares the canonical leaf paths, the whole
//! full-to-window mapping (which pages are tombstoned, and which window page every live
//! page has), each open request's lease length and row, runs `check_invariants()` and
//! the model's own check, and checks that every full page is owned exactly once (tree,
//! open request, free pool).
//!
//! Since both eviction orders depend on every touch, a wrong tick anywhere shows up as
//! a different victim, and then as a different size or mapping.

use arbitrary::{Arbitrary, Unstructured};

use crate::alloc::SwaAllocator;
use crate::baseline::swa_ref::{RefDualPool, RefSwaLease, ReferenceSwaCache, SwaSizes};
use crate::radix::{EvictionPolicy, Lease, MatchResult, RadixConfig, Swa, SwaRadixCache};
use crate::{ReqRow, ReqToTokenPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest key.
pub const MAX_KEY: usize = 20;
/// Open requests at most.
const MAX_REQS: usize = 3;
/// Leases the driver keeps outside requests, at most.
const MAX_LEASES: usize = 2;
/// Remembered matches at most.
const MAX_MATCHES: usize = 4;
/// The windows a shape picks from, in tokens: shorter and longer than the keys.
pub const WINDOWS: [usize; 8] = [1, 2, 3, 4, 6, 8, 13, 24];
/// The full pass's policies a shape picks from: every leaf policy the core has.
pub const POLICIES: [EvictionPolicy; 6] = [
    EvictionPolicy::Lru,
    EvictionPolicy::Lfu,
    EvictionPolicy::Fifo,
    EvictionPolicy::Mru,
    EvictionPolicy::Filo,
    EvictionPolicy::Priority,
];
/// How many ops the `swa_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 24;
/// How often the `swa_ops` fuzz target runs the full O(tree) comparison (see the module
/// docs).
pub const FUZZ_FULL_CHECK_EVERY: usize = 8;

/// One step of an SWA-cache model run. Indices (`req`, `which`) are taken modulo the
/// number of things they pick from; an op with nothing to pick from does nothing.
#[derive(Arbitrary, Debug, Clone)]
pub enum SwaOp {
    /// A request arrives: `match_and_lock`, then `alloc_extend` for the rest of its
    /// tokens (evicting each pool's shortfall), then a row.
    Start {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace (0 or 1).
        ns: bool,
    },
    /// An open request releases the window KV of its tokens `from % (len + 1)` up to
    /// `upto % (len + 1)` (`release_window`: they fell out of its window).
    ReleaseWindow {
        /// Which open request.
        req: u8,
        /// From which token.
        from: u8,
        /// Up to which token.
        upto: u8,
    },
    /// An open request finishes (`cache_finished_req` with all its tokens).
    Finish {
        /// Which open request.
        req: u8,
    },
    /// An open request caches its first `lease + cut % (len - lease + 1)` tokens
    /// (`cache_unfinished_req`, chunked prefill).
    Chunk {
        /// Which open request.
        req: u8,
        /// How far.
        cut: u8,
    },
    /// An open request is dropped: its own KV is freed, its lease released.
    Abort {
        /// Which open request.
        req: u8,
    },
    /// A raw insert of fresh KV (evicting the shortfall) whose first
    /// `released % (pages + 1)` pages had their window KV released before; the caller
    /// frees the duplicates and the pages not taken.
    Insert {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
        /// Leading pages without window KV.
        released: u8,
    },
    /// `match_prefix` without a lock; the result is remembered for `LockMatch`.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Lock a remembered match (`lock`: stale once its node was evicted or its window
    /// part tombstoned).
    LockMatch {
        /// Which remembered match.
        which: u8,
    },
    /// `match_and_lock` whose lease the driver keeps.
    Lock {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Drop a kept lease.
    Release {
        /// Which lease.
        which: u8,
    },
    /// The lock-free lookup (`peek_prefix`, with the window rule).
    Peek {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// The full pass: evict at least `n % 24` tokens.
    Evict {
        /// Tokens.
        n: u8,
    },
    /// The window pass: free at least `n % 12` window tokens.
    EvictSwa {
        /// Window tokens.
        n: u8,
    },
    /// Both passes (`evict_both(full % 8, window % 12)`).
    EvictBoth {
        /// Full tokens.
        full: u8,
        /// Window tokens.
        window: u8,
    },
}

type Cache = SwaRadixCache;
type SLease<'c> = Lease<'c, SwaAllocator, Swa>;

struct Req<'c> {
    ns: u64,
    tokens: Vec<u32>,
    row: ReqRow,
    lease: SLease<'c>,
    ref_kv: Vec<u32>,
    ref_lease: RefSwaLease,
}

/// Everything the driver holds besides the two caches.
#[derive(Default)]
struct Held<'c> {
    reqs: Vec<Req<'c>>,
    leases: Vec<(SLease<'c>, RefSwaLease)>,
    matches: Vec<(MatchResult, RefSwaLease)>,
}

/// The shape of a run.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Tokens per page (1, 2 or 4).
    pub page_size: usize,
    /// Full pool pages.
    pub pages: usize,
    /// Window pool pages (at most `pages`).
    pub window_pages: usize,
    /// The sliding window, in tokens.
    pub window: usize,
    /// Eviction policy of the full pass (the window pass is always LRU).
    pub policy: EvictionPolicy,
}

impl Shape {
    /// A shape from five arbitrary bytes, clamped to small pools so that both passes
    /// run often: page size 1, 2 or 4; 6 to 37 full pages; 2 pages up to the full pool's
    /// for the window pool; a window from [`WINDOWS`]; a policy from [`POLICIES`].
    pub fn from_bytes(page_size: u8, pages: u8, window_pages: u8, window: u8, policy: u8) -> Shape {
        let full = 6 + pages as usize % 32;
        Shape {
            page_size: [1, 2, 4][page_size as usize % 3],
            pages: full,
            window_pages: 2 + window_pages as usize % (full - 1),
            window: WINDOWS[window as usize % WINDOWS.len()],
            policy: POLICIES[policy as usize % POLICIES.len()],
        }
    }
}

/// The tokens of a key: when the first seed has bit 6 set, a prefix (as long as the
/// other seeds) of one of four fixed sequences that share their first 2, 4 or 8 tokens,
/// so that keys are often prefixes of each other; otherwise one token of a tiny alphabet
/// per seed.
fn tokens(seeds: &[u8], ps: usize) -> Vec<u32> {
    if let Some(&s) = seeds.first().filter(|&&s| s & 0x40 != 0) {
        let shared = [MAX_KEY, 2, 4, 8][s as usize % 4];
        let len = (seeds.len() - 1).min(MAX_KEY);
        return (0..len).map(|i| if i < shared { i as u32 % 3 } else { 3 + s as u32 % 4 }).collect();
    }
    let mut t: Vec<u32> = seeds.iter().take(MAX_KEY).map(|&s| (s % ALPHABET) as u32).collect();
    if ps > 1 && t.len() > ps && seeds.first().is_some_and(|s| s & 0x80 != 0) {
        t.truncate(t.len() / ps * ps);
    }
    t
}

fn check<T: PartialEq + std::fmt::Debug>(what: &str, step: usize, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("step {step}: {what}: kvpool {got:?}, model {want:?}"))
    }
}

fn err<E: std::fmt::Display>(step: usize, what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("step {step}: {what}: {e}")
}

/// The `swa_ops` fuzz target's reading of its input: five header bytes (see
/// [`Shape::from_bytes`]), then at most `max_ops` ops. Any bytes work.
///
/// # Examples
///
/// ```
/// use kvpool::models::swa::{from_fuzz_input, run};
/// let (shape, ops) = from_fuzz_input(b"any bytes at all: 0123456789abcdef", 16);
/// assert!(ops.len() <= 16);
/// run(shape, &ops)?;
/// # Ok::<(), String>(())
/// ```
pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> (Shape, Vec<SwaOp>) {
    let mut u = Unstructured::new(bytes);
    let mut byte = || u8::arbitrary(&mut u).unwrap_or(0);
    let shape = Shape::from_bytes(byte(), byte(), byte(), byte(), byte());
    let mut ops = Vec::new();
    while ops.len() < max_ops && !u.is_empty() {
        match SwaOp::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    (shape, ops)
}

/// Run `ops` on both caches, with the full comparison after every step.
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run(shape: Shape, ops: &[SwaOp]) -> Result<(), String> {
    run_with(shape, ops, 1)
}

/// [`run`], with the full O(tree) comparison only every `full_every` steps, after the
/// last step and after the teardown (each op's result and the sizes are compared after
/// every step).
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run_with(shape: Shape, ops: &[SwaOp], full_every: usize) -> Result<(), String> {
    let full_every = full_every.max(1);
    let ps = shape.page_size;
    let (full, window) = (shape.pages * ps, shape.window_pages * ps);
    let alloc = SwaAllocator::new(full, window, ps as u32).map_err(|e| e.to_string())?;
    let rows = ReqToTokenPool::new(MAX_REQS as u32, MAX_KEY).map_err(|e| e.to_string())?;
    let config = RadixConfig { policy: shape.policy, event_capacity: None, ..RadixConfig::default() };
    let cache = SwaRadixCache::with_window(alloc, rows, config, shape.window).map_err(|e| e.to_string())?;
    let mut model = ReferenceSwaCache::new(RefDualPool::new(full, window, ps), shape.window, shape.policy)
        .map_err(|e| e.to_string())?;
    let mut held = Held::default();
    for (step, op) in ops.iter().enumerate() {
        apply(&cache, &mut model, &mut held, op, shape, step)?;
        if (step + 1) % full_every == 0 || step + 1 == ops.len() {
            compare(&cache, &model, &held, shape, step)?;
        } else {
            compare_sizes(&cache, &model, step)?;
        }
    }
    // Give everything back, then evict everything: both pools must be whole again.
    let end = ops.len();
    while let Some(r) = held.reqs.pop() {
        abort(&cache, &mut model, r, end)?;
    }
    for (lease, r) in held.leases.drain(..) {
        drop(lease);
        model.unlock(r);
    }
    check("evict all", end, cache.evict(usize::MAX), model.evict(usize::MAX))?;
    compare(&cache, &model, &held, shape, end)?;
    check("empty at the end", end, (cache.total_size(), cache.node_count()), (0, 0))?;
    let pools = (cache.allocator().full_available_size(), cache.allocator().window_available_size());
    check("free pools at the end", end, pools, (full, window))
}

/// A request's own slots (past its lease) are freed, its lease released.
fn abort(cache: &Cache, model: &mut ReferenceSwaCache, r: Req<'_>, step: usize) -> Result<(), String> {
    let n = r.lease.len();
    let own = cache.req_pool().read(&r.row, n..r.tokens.len()).map_err(err(step, "abort: row"))?.to_vec();
    cache.allocator().free(&own).map_err(err(step, "abort: free"))?;
    drop(r.lease);
    cache.req_pool().free(r.row).map_err(err(step, "abort: row free"))?;
    model.pool_mut().free(&r.ref_kv[r.ref_lease.len..]);
    model.unlock(r.ref_lease);
    Ok(())
}

fn apply<'c>(
    cache: &'c Cache,
    model: &mut ReferenceSwaCache,
    held: &mut Held<'c>,
    op: &SwaOp,
    shape: Shape,
    step: usize,
) -> Result<(), String> {
    let ps = shape.page_size;
    let pick = |which: u8, len: usize| (len > 0).then(|| which as usize % len);
    match op {
        SwaOp::Start { key, ns } => {
            let t = tokens(key, ps);
            if held.reqs.len() == MAX_REQS || t.is_empty() {
                return Ok(());
            }
            let ns = *ns as u64;
            let mut out = vec![0u32; t.len()];
            let lease = cache.match_and_lock(ns, &t, &mut out);
            let rm = model.match_prefix(ns, &t);
            let h = lease.len();
            check("start: match", step, (h, &out[..h]), (rm.len, &rm.slots[..rm.len]))?;
            let ref_lease = model.lock(rm.node, rm.len);
            let last = if h > 0 { out[h - 1] } else { 0 };
            let mut new = vec![0u32; t.len() - h];
            let got = cache.alloc_extend(&[h as u32], &[t.len() as u32], &[last], &mut new);
            let want = model.alloc_extend(h, t.len());
            check("start: alloc ok", step, got.is_ok(), want.is_some())?;
            let Some(ref_new) = want else {
                drop(lease);
                model.unlock(ref_lease);
                return Ok(());
            };
            check("start: new slots", step, &new, &ref_new)?;
            let mut row = cache.req_pool().alloc().map_err(err(step, "row"))?;
            cache.req_pool().write(&mut row, 0, &out[..h]).map_err(err(step, "row"))?;
            cache.req_pool().write(&mut row, h, &new).map_err(err(step, "row"))?;
            let mut ref_kv = rm.slots[..h].to_vec();
            ref_kv.extend_from_slice(&ref_new);
            held.reqs.push(Req { ns, tokens: t, row, lease, ref_kv, ref_lease });
        }
        SwaOp::ReleaseWindow { req, from, upto } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            let r = &held.reqs[i];
            let range = *from as usize % (r.tokens.len() + 1)..*upto as usize % (r.tokens.len() + 1);
            let got = cache.release_window(&r.row, &r.lease, range.clone()).map_err(err(step, "release_window"))?;
            let want = model.release_window(&r.ref_kv, &r.ref_lease, range).map_err(err(step, "model release"))?;
            check("release_window", step, got, want)?;
        }
        SwaOp::Finish { req } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            let r = held.reqs.remove(i);
            let got = cache
                .cache_finished_req(r.ns, &r.tokens, r.row, r.lease)
                .map_err(|u| format!("step {step}: finish: {}", u.error))?;
            let want = model.cache_finished_req(r.ns, &r.tokens, &r.ref_kv, r.ref_lease);
            check("finish: cached", step, got, want)?;
        }
        SwaOp::Chunk { req, cut } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            let r = &mut held.reqs[i];
            let n = r.lease.len();
            let c = n + *cut as usize % (r.tokens.len() - n + 1);
            cache.cache_unfinished_req(r.ns, &r.tokens[..c], &mut r.row, &mut r.lease).map_err(err(step, "chunk"))?;
            model.cache_unfinished_req(r.ns, &r.tokens[..c], &mut r.ref_kv, &mut r.ref_lease);
            check("chunk: lease", step, r.lease.len(), r.ref_lease.len)?;
            let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).map_err(err(step, "row"))?;
            check("chunk: row", step, row, &r.ref_kv[..])?;
        }
        SwaOp::Abort { req } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            abort(cache, model, held.reqs.remove(i), step)?;
        }
        SwaOp::Insert { key, ns, released } => {
            let t = tokens(key, ps);
            let t = &t[..t.len() / ps * ps];
            let ns = *ns as u64;
            let mut s = vec![0u32; t.len()];
            let got = cache.alloc(&mut s);
            let want = model.alloc(t.len());
            check("insert: alloc ok", step, got.is_ok(), want.is_some())?;
            let Some(rs) = want else { return Ok(()) };
            check("insert: slots", step, &s, &rs)?;
            let dead = *released as usize % (t.len() / ps + 1) * ps;
            let freed = cache.allocator().free_swa(&s[..dead]).map_err(err(step, "free_swa"))?;
            check("insert: free_swa", step, freed, model.pool_mut().free_swa(&rs[..dead]))?;
            let got = cache.insert(ns, t, &s).map_err(err(step, "insert"))?;
            let want = model.insert(ns, t, &rs);
            check("insert", step, got, want)?;
            cache.allocator().free(&s[..got.cached]).map_err(err(step, "free duplicates"))?;
            cache.allocator().free(&s[got.inserted..]).map_err(err(step, "free the rest"))?;
            model.pool_mut().free(&rs[..want.cached]);
            model.pool_mut().free(&rs[want.inserted..]);
        }
        SwaOp::Match { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let m = cache.match_prefix(*ns as u64, &t, &mut out);
            let rm = model.match_prefix(*ns as u64, &t);
            check("match", step, &out[..m.len()], &rm.slots[..rm.len])?;
            if held.matches.len() == MAX_MATCHES {
                held.matches.remove(0);
            }
            held.matches.push((m, RefSwaLease { node: rm.node, len: rm.len, window: 0 }));
        }
        SwaOp::LockMatch { which } => {
            let Some(i) = pick(*which, held.matches.len()) else { return Ok(()) };
            if held.leases.len() == MAX_LEASES {
                return Ok(());
            }
            let (m, r) = held.matches[i];
            let got = cache.lock(&m);
            let want = model.lock_match(r.node, r.len);
            check("lock a match", step, got.as_ref().err(), want.as_ref().err())?;
            if let (Ok(lease), Ok(r)) = (got, want) {
                check("lock a match: lease", step, lease.len(), r.len)?;
                held.leases.push((lease, r));
            }
        }
        SwaOp::Lock { key, ns } => {
            if held.leases.len() == MAX_LEASES {
                return Ok(());
            }
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let lease = cache.match_and_lock(*ns as u64, &t, &mut out);
            let rm = model.match_prefix(*ns as u64, &t);
            check("lock", step, &out[..lease.len()], &rm.slots[..rm.len])?;
            let r = model.lock(rm.node, rm.len);
            held.leases.push((lease, r));
        }
        SwaOp::Release { which } => {
            let Some(i) = pick(*which, held.leases.len()) else { return Ok(()) };
            let (lease, r) = held.leases.swap_remove(i);
            drop(lease);
            model.unlock(r);
        }
        SwaOp::Peek { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let n = cache.peek_prefix(*ns as u64, &t, &mut out);
            check("peek", step, &out[..n], &model.peek(*ns as u64, &t)[..])?;
        }
        SwaOp::Evict { n } => {
            let n = *n as usize % 24;
            check("evict", step, cache.evict(n), model.evict(n))?;
        }
        SwaOp::EvictSwa { n } => {
            let n = *n as usize % 12;
            check("evict_swa", step, cache.evict_swa(n), model.evict_swa(n))?;
        }
        SwaOp::EvictBoth { full, window } => {
            let (f, w) = (*full as usize % 8, *window as usize % 12);
            check("evict_both", step, cache.evict_both(f, w), model.evict_both(f, w))?;
        }
    }
    Ok(())
}

fn sizes(cache: &Cache) -> SwaSizes {
    let a = cache.allocator();
    (
        (cache.total_size(), cache.evictable_size(), cache.protected_size()),
        (cache.swa_evictable_size(), cache.swa_protected_size(), cache.tombstone_size()),
        (a.full_available_size(), a.window_available_size(), cache.node_count()),
    )
}

/// The O(1) part of [`compare`]: sizes, both pools' free tokens, node count.
fn compare_sizes(cache: &Cache, model: &ReferenceSwaCache, step: usize) -> Result<(), String> {
    check(
        "sizes ((total, evictable, protected), (swa evictable, swa protected, tombstones), \
         (free full, free window, nodes))",
        step,
        sizes(cache),
        model.sizes(),
    )
}

fn compare(cache: &Cache, model: &ReferenceSwaCache, held: &Held<'_>, shape: Shape, step: usize) -> Result<(), String> {
    cache.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
    model.check().map_err(|e| format!("step {step}: {e}"))?;
    compare_sizes(cache, model, step)?;
    let leaf_paths = cache.leaf_paths();
    check("leaf paths", step, &leaf_paths, &model.leaf_paths())?;
    // The whole mapping: which full pages have a window part (the tree's tombstones are
    // the pages without), and which window page each has.
    let ps = shape.page_size;
    let window_of = |p: usize| cache.allocator().window_slot((p * ps) as u32).map_or(0, |w| w / ps as u32);
    let got: Vec<u32> = (1..=shape.pages).map(window_of).collect();
    let want: Vec<u32> = (1..=shape.pages).map(|p| model.pool().window_page(p as u32)).collect();
    check("full-to-window mapping (window page per full page)", step, got, want)?;
    for r in &held.reqs {
        check("request lease", step, r.lease.len(), r.ref_lease.len)?;
        let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).map_err(err(step, "row"))?;
        check("request row", step, row, &r.ref_kv[..])?;
    }
    for (lease, r) in &held.leases {
        check("lease", step, lease.len(), r.len)?;
    }
    // Every full page owned exactly once: tree, open requests, free pool.
    let mut owner = vec![0u8; shape.pages + 1];
    for (_, _, slots) in &leaf_paths {
        for s in slots.chunks(ps) {
            owner[s[0] as usize / ps] = 1; // shared prefixes repeat: mark, do not count
        }
    }
    let tree_pages = owner.iter().filter(|&&o| o == 1).count();
    check("tree pages", step, tree_pages * ps, cache.total_size())?;
    for r in &held.reqs {
        let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).map_err(err(step, "row"))?;
        let mut prev = usize::MAX;
        for &s in &row[r.lease.len()..] {
            let p = s as usize / ps;
            if p != prev && owner[p] != 0 {
                return Err(format!("step {step}: page {p} is owned by a request and the tree or another"));
            }
            owner[p] = 2;
            prev = p;
        }
    }
    let owned = owner.iter().filter(|&&o| o != 0).count();
    check("pages owned + free", step, owned + cache.allocator().full_available_size() / ps, shape.pages)
}
