//! [`MambaRadixCache`] against [`ReferenceMambaCache`], operation by operation (feature
//! `models`): the shared driver of `tests/mamba_tree_model.rs` and the `mamba_ops` fuzz
//! target.
//!
//! Each side has its own KV allocator and its own state pool of the same shape; both
//! hand out the lowest free slots, and the two caches free the same slots, so the two
//! sides must agree on every KV slot and every state number, not just on lengths.
//! After every operation the driver compares the op's own result (matched lengths,
//! slots, states, KV lengths, branching lengths, insert results, evicted counts,
//! allocation outcomes) and the sizes (total / evictable / protected tokens,
//! evictable / protected states, free KV and free states, node count). Every
//! `full_every` steps, after the last step and after the teardown it also compares the
//! canonical leaf paths, which state slots are allocated on each side (the tree's, the
//! open requests', those held by the driver: nothing else), each open lease's state,
//! runs `check_invariants()` and the model's own check, and checks that every KV page
//! is owned exactly once (tree, open request, free pool).
//!
//! Since eviction order depends on every touch, a wrong tick anywhere (a touch missed,
//! added or reordered) shows up as a different victim and then as a different size.

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::mamba_ref::{RefMambaMatch, ReferenceMambaCache};
use crate::baseline::RefNodeId;
use crate::radix::{EvictionPolicy, Lease, Mamba, MambaRadixCache, MatchResult, RadixConfig};
use crate::{KvAllocator, PagedAllocator, ReqRow, ReqToTokenPool, SlotPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest key.
const MAX_KEY: usize = 20;
/// Open requests at most.
const MAX_REQS: usize = 3;
/// Leases (outside requests) and states the driver holds, at most each.
const MAX_HELD: usize = 2;
/// Remembered matches at most.
const MAX_MATCHES: usize = 4;
/// How many ops the `mamba_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 16;
/// How often the `mamba_ops` fuzz target runs the full O(tree) comparison (see the
/// module docs): once at the end of the sequence and once after the teardown.
pub const FUZZ_FULL_CHECK_EVERY: usize = MAX_FUZZ_OPS;

/// One step of a Mamba-cache model run. Indices (`req`, `which`) are taken modulo the
/// number of things they pick from; an op with nothing to pick from does nothing.
#[derive(Arbitrary, Debug, Clone)]
pub enum MambaOp {
    /// A request arrives: `match_and_lock_checkpoint`, a state for it (`alloc_state`,
    /// which may evict one), KV for the rest of its tokens (evicting the shortfall), a
    /// row.
    Start {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace (0 or 1).
        ns: bool,
    },
    /// An open request finishes (`cache_finished_req` with its state), caching its
    /// tokens up to a checkpoint: a page boundary at or past the lease's length, or all
    /// its tokens, picked by `cut` (the driver frees the KV beyond it).
    Finish {
        /// Which open request.
        req: u8,
        /// Where it checkpointed.
        cut: u8,
    },
    /// An open request caches its progress (`cache_unfinished_req` with a fresh state
    /// from `alloc_state`).
    Chunk {
        /// Which open request.
        req: u8,
    },
    /// An open request is dropped: its own KV and state are freed, its lease released.
    Abort {
        /// Which open request.
        req: u8,
    },
    /// A direct insert of fresh KV (evicting the shortfall) and a fresh state.
    Insert {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// An insert with a state the caller does not hold (0, out of range, free, or the
    /// tree's own): refused on both sides, nothing changes.
    InsertForeign {
        /// Token seeds.
        key: Vec<u8>,
        /// Which kind of foreign state.
        which: u8,
    },
    /// `match_prefix` without a lock; the result is remembered for `LockMatch`.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Lock a remembered match (`lock`: stale once its node was evicted or tombstoned).
    LockMatch {
        /// Which remembered match.
        which: u8,
    },
    /// `match_and_lock_checkpoint` whose lease the driver keeps.
    Lock {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Release a kept lease.
    Release {
        /// Which lease.
        which: u8,
    },
    /// The lock-free KV lookup (`peek_prefix`): states play no part.
    Peek {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Evict at least `n` tokens.
    Evict {
        /// Tokens.
        n: u8,
    },
    /// Evict at least `n % 4` states.
    EvictMamba {
        /// States.
        n: u8,
    },
    /// `alloc_state` for the driver to hold (pressure on the state pool).
    HoldState,
    /// Free a held state.
    DropState {
        /// Which held state.
        which: u8,
    },
    /// Try to free one of the tree's own states by number through the cache's
    /// `states()`: refused (`FreeErrorKind::Cached`), nothing changes.
    FreeTreeState {
        /// Which of the tree's states.
        which: u8,
    },
}

type Cache = MambaRadixCache<PagedAllocator, SlotPool>;
type Model = ReferenceMambaCache<PagedAllocator, SlotPool>;
type MLease<'c> = Lease<'c, PagedAllocator, Mamba<SlotPool>>;
/// The same slots, allocated on each side.
type BothSlots = (Vec<u32>, Vec<u32>);

struct Req<'c> {
    ns: u64,
    tokens: Vec<u32>,
    row: ReqRow,
    lease: MLease<'c>,
    state: u32,
    ref_kv: Vec<u32>,
    ref_node: RefNodeId,
    ref_protected: usize,
}

/// Everything the driver holds besides the two caches.
#[derive(Default)]
struct Held<'c> {
    reqs: Vec<Req<'c>>,
    leases: Vec<(MLease<'c>, RefNodeId)>,
    matches: Vec<(MatchResult, RefNodeId)>,
    states: Vec<u32>,
}

/// The shape of a run: page size, pool size, state pool size, policy.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Tokens per page (1, 2 or 4).
    pub page_size: usize,
    /// KV pages.
    pub pages: usize,
    /// State slots.
    pub states: u32,
    /// Eviction policy of the leaf order (the state order is always LRU).
    pub policy: EvictionPolicy,
}

impl Shape {
    /// A shape from four arbitrary bytes, clamped to small pools so that eviction is
    /// frequent: page size 1, 2 or 4; 3 to 18 pages; 1 to 8 states; any policy.
    pub fn from_bytes(page_size: u8, pages: u8, states: u8, policy: u8) -> Shape {
        Shape {
            page_size: [1, 2, 4][page_size as usize % 3],
            pages: 3 + pages as usize % 16,
            states: 1 + states as u32 % 8,
            policy: EvictionPolicy::ALL[policy as usize % EvictionPolicy::ALL.len()],
        }
    }
}

/// The tokens of a key: when the first seed has bit 6 set, a prefix (as long as the
/// other seeds) of one of four fixed sequences that share their first 2, 4 or 8 tokens,
/// so that keys are often prefixes of each other (internal states, tombstones and
/// their revival need that); otherwise one token of a tiny alphabet per seed.
fn tokens(seeds: &[u8], ps: usize) -> Vec<u32> {
    if let Some(&s) = seeds.first().filter(|&&s| s & 0x40 != 0) {
        let shared = [MAX_KEY, 2, 4, 8][s as usize % 4];
        let len = (seeds.len() - 1).min(MAX_KEY);
        return (0..len).map(|i| if i < shared { i as u32 % 3 } else { 3 + s as u32 % 4 }).collect();
    }
    let mut t: Vec<u32> = seeds.iter().take(MAX_KEY).map(|&s| (s % ALPHABET) as u32).collect();
    if ps > 1 && t.len() > ps && seeds.first().is_some_and(|s| s & 0x80 != 0) {
        // sometimes cut to whole pages, so keys that end on a page boundary happen too
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

/// The `mamba_ops` fuzz target's reading of its input: four header bytes (see
/// [`Shape::from_bytes`]), then at most `max_ops` ops. Any bytes work.
///
/// # Examples
///
/// ```
/// use kvpool::models::mamba::{from_fuzz_input, run};
/// let (shape, ops) = from_fuzz_input(b"any bytes at all: 0123456789abcdef", 16);
/// assert!(ops.len() <= 16);
/// run(shape, &ops)?;
/// # Ok::<(), String>(())
/// ```
pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> (Shape, Vec<MambaOp>) {
    let mut u = Unstructured::new(bytes);
    let mut byte = || u8::arbitrary(&mut u).unwrap_or(0);
    let shape = Shape::from_bytes(byte(), byte(), byte(), byte());
    let mut ops = Vec::new();
    while ops.len() < max_ops && !u.is_empty() {
        match MambaOp::arbitrary(&mut u) {
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
pub fn run(shape: Shape, ops: &[MambaOp]) -> Result<(), String> {
    run_with(shape, ops, 1)
}

/// [`run`], with the full O(tree) comparison only every `full_every` steps, after the
/// last step and after the teardown (each op's result and the sizes are compared after
/// every step).
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run_with(shape: Shape, ops: &[MambaOp], full_every: usize) -> Result<(), String> {
    let full_every = full_every.max(1);
    let ps = shape.page_size;
    let make = || PagedAllocator::new(shape.pages * ps, ps as u32).expect("a small allocator");
    let config = RadixConfig { policy: shape.policy, event_capacity: None, ..RadixConfig::default() };
    let rows = ReqToTokenPool::new(MAX_REQS as u32, MAX_KEY).map_err(|e| e.to_string())?;
    let cache = MambaRadixCache::with_states(make(), rows, SlotPool::without_magazines(shape.states), config)
        .map_err(|e| e.to_string())?;
    let mut model = ReferenceMambaCache::new(make(), SlotPool::without_magazines(shape.states), shape.policy)
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
        abort(&cache, &mut model, r);
    }
    for (lease, node) in held.leases.drain(..) {
        drop(lease);
        model.unlock(node);
    }
    for s in held.states.drain(..) {
        cache.states().free(&[s]).map_err(|e| e.to_string())?;
        model.states().free(&[s]).map_err(|e| e.to_string())?;
    }
    check("evict all", end, cache.evict(usize::MAX), model.evict(usize::MAX))?;
    compare(&cache, &model, &held, shape, end)?;
    check("empty at the end", end, (cache.total_size(), cache.node_count()), (0, 0))?;
    check("free KV at the end", end, cache.allocator().available_size(), shape.pages * ps)?;
    check("free states at the end", end, cache.states().available(), shape.states as usize)
}

fn abort(cache: &Cache, model: &mut Model, r: Req<'_>) {
    let n = r.lease.len();
    let own = cache.req_pool().read(&r.row, 0..r.tokens.len()).expect("the request's row")[n..].to_vec();
    cache.allocator().free(&own).expect("a request owns its KV");
    cache.states().free(&[r.state]).expect("a request owns its state");
    drop(r.lease);
    cache.req_pool().free(r.row).expect("the request's row");
    model.allocator().free(&r.ref_kv[r.ref_protected..]).expect("a model request owns its KV");
    model.states().free(&[r.state]).expect("a model request owns its state");
    model.unlock(r.ref_node);
}

/// Allocate `n` KV slots (whole pages) on both sides, each evicting its shortfall
/// first; `None` when both fail.
fn alloc_kv(cache: &Cache, model: &mut Model, n: usize, step: usize) -> Result<Option<BothSlots>, String> {
    let mut s = vec![0u32; n];
    let got = cache.alloc(&mut s);
    let avail = model.allocator().available_size();
    if avail < n && n - avail <= model.evictable_size() {
        model.evict(n - avail);
    }
    let mut rs = vec![0u32; n];
    let want = model.allocator().alloc(&mut rs);
    check("KV alloc ok", step, got.is_ok(), want.is_ok())?;
    if got.is_err() {
        return Ok(None);
    }
    check("KV slots", step, &s, &rs)?;
    Ok(Some((s, rs)))
}

/// `alloc_state` on both sides.
fn alloc_state(cache: &Cache, model: &mut Model, step: usize) -> Result<Option<u32>, String> {
    let got = cache.alloc_state().ok();
    check("alloc_state", step, got, model.alloc_state())?;
    Ok(got)
}

/// Compare a lock's result: length, state, KV match, slots, branching length.
fn check_match(
    cache: &Cache,
    step: usize,
    what: &str,
    got: (usize, Option<u32>, usize, Option<usize>, &[u32]),
    want: &RefMambaMatch,
) -> Result<(), String> {
    let branching = cache.checkpoint_config().branching_len(want.kv_len, want.len);
    let want = (want.len, want.state, want.kv_len, branching, &want.slots[..]);
    check(what, step, got, want)
}

fn apply<'c>(
    cache: &'c Cache,
    model: &mut Model,
    held: &mut Held<'c>,
    op: &MambaOp,
    shape: Shape,
    step: usize,
) -> Result<(), String> {
    let ps = shape.page_size;
    let pick = |which: u8, len: usize| (len > 0).then(|| which as usize % len);
    match op {
        MambaOp::Start { key, ns } => {
            let t = tokens(key, ps);
            if held.reqs.len() == MAX_REQS || t.is_empty() {
                return Ok(());
            }
            let ns = *ns as u64;
            let mut out = vec![0u32; t.len()];
            let m = cache.match_and_lock_checkpoint(ns, &t, &mut out);
            let rm = model.match_and_lock(ns, &t);
            let got = (m.lease.len(), m.state, m.kv_len, m.branching_len, &out[..m.kv_len]);
            check_match(cache, step, "start: match", got, &rm)?;
            check("start: lease state", step, cache.lease_state(&m.lease), rm.state)?;
            let (lease, h) = (m.lease, rm.len);
            let Some(state) = alloc_state(cache, model, step)? else {
                drop(lease);
                model.unlock(rm.node);
                return Ok(());
            };
            let last = if h > 0 { out[h - 1] } else { 0 };
            let (prefix, seq) = ([h as u32], [t.len() as u32]);
            let mut new = vec![0u32; t.len() - h];
            let got = cache.alloc_extend(&prefix, &seq, &[last], &mut new);
            let need = model.allocator().extend_need(&prefix, &seq).map_err(|e| e.to_string())?;
            let avail = model.allocator().available_size();
            if avail < need && need - avail <= model.evictable_size() {
                model.evict(need - avail);
            }
            let mut ref_new = vec![0u32; t.len() - h];
            let want = model.allocator().alloc_extend(&prefix, &seq, &[last], &mut ref_new);
            check("start: KV alloc ok", step, got.is_ok(), want.is_ok())?;
            if got.is_err() {
                drop(lease);
                model.unlock(rm.node);
                cache.states().free(&[state]).map_err(|e| e.to_string())?;
                model.states().free(&[state]).map_err(|e| e.to_string())?;
                return Ok(());
            }
            check("start: new KV slots", step, &new, &ref_new)?;
            let mut row = cache.req_pool().alloc().map_err(|e| e.to_string())?;
            cache.req_pool().write(&mut row, 0, &out[..h]).map_err(|e| e.to_string())?;
            cache.req_pool().write(&mut row, h, &new).map_err(|e| e.to_string())?;
            let mut ref_kv = rm.slots[..h].to_vec();
            ref_kv.extend_from_slice(&ref_new);
            held.reqs.push(Req { ns, tokens: t, row, lease, state, ref_kv, ref_node: rm.node, ref_protected: h });
        }
        MambaOp::Finish { req, cut } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            let r = held.reqs.remove(i);
            let n = r.lease.len();
            // A checkpoint on a page boundary past the lease, or the request's end.
            let len = r.tokens.len();
            let boundaries = (len - n) / ps + 1;
            let k = *cut as usize % (boundaries + 1);
            let c = if k == boundaries { len } else { n + k * ps };
            // The KV past the checkpoint (whole pages of the request's) is its to free.
            let beyond = cache.req_pool().read(&r.row, c..r.tokens.len()).map_err(|e| e.to_string())?.to_vec();
            cache.allocator().free(&beyond).map_err(|e| e.to_string())?;
            model.allocator().free(&r.ref_kv[c..]).map_err(|e| e.to_string())?;
            let got = cache
                .cache_finished_req(r.ns, &r.tokens[..c], r.row, r.lease, r.state)
                .map_err(|u| format!("step {step}: finish: {}", u.error))?;
            let want = model
                .cache_finished_req(r.ns, &r.tokens[..c], &r.ref_kv[..c], r.ref_protected, r.ref_node, r.state)
                .map_err(|e| format!("step {step}: model finish: {e}"))?;
            check("finish", step, got, want)?;
        }
        MambaOp::Chunk { req } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            let Some(state) = alloc_state(cache, model, step)? else { return Ok(()) };
            let r = &mut held.reqs[i];
            let got = cache
                .cache_unfinished_req(r.ns, &r.tokens, &mut r.row, &mut r.lease, state)
                .map_err(|e| format!("step {step}: chunk: {e}"))?;
            let (kept, len, node) = model
                .cache_unfinished_req(r.ns, &r.tokens, &mut r.ref_kv, r.ref_protected, r.ref_node, state)
                .map_err(|e| format!("step {step}: model chunk: {e}"))?;
            (r.ref_protected, r.ref_node) = (len, node);
            check("chunk: state kept", step, got, kept)?;
            check("chunk: lease", step, (r.lease.len(), cache.lease_state(&r.lease)), (len, model.state_of(node)))?;
            let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).map_err(|e| e.to_string())?;
            check("chunk: row", step, row, &r.ref_kv[..])?;
        }
        MambaOp::Abort { req } => {
            let Some(i) = pick(*req, held.reqs.len()) else { return Ok(()) };
            abort(cache, model, held.reqs.remove(i));
        }
        MambaOp::Insert { key, ns } => {
            let t = tokens(key, ps);
            let t = &t[..t.len() / ps * ps];
            let ns = *ns as u64;
            let Some((s, rs)) = alloc_kv(cache, model, t.len(), step)? else { return Ok(()) };
            let Some(state) = alloc_state(cache, model, step)? else {
                cache.allocator().free(&s).map_err(|e| e.to_string())?;
                model.allocator().free(&rs).map_err(|e| e.to_string())?;
                return Ok(());
            };
            let got = cache.insert(ns, t, &s, state).map_err(|e| format!("step {step}: insert: {e}"))?;
            let want = model.insert(ns, t, &rs, state).map_err(|e| format!("step {step}: model insert: {e}"))?;
            check("insert", step, got, want)?;
            cache.allocator().free(&s[..got.cached]).map_err(|e| e.to_string())?;
            model.allocator().free(&rs[..want.cached]).map_err(|e| e.to_string())?;
        }
        MambaOp::InsertForeign { key, which } => {
            let t = tokens(key, ps);
            let t = &t[..t.len() / ps * ps];
            let Some((s, rs)) = alloc_kv(cache, model, t.len(), step)? else { return Ok(()) };
            let tree = model.held_states();
            let free = (1..=shape.states).find(|&s| !model.states().is_allocated(s));
            let state = match which % 4 {
                0 => 0,
                1 => shape.states + 1 + *which as u32,
                2 => free.unwrap_or(0),
                _ => pick(*which / 4, tree.len()).map_or(0, |i| tree[i]),
            };
            let got = cache.insert(0, t, &s, state);
            let want = model.insert(0, t, &rs, state);
            check("foreign insert", step, got, want)?;
            cache.allocator().free(&s).map_err(|e| e.to_string())?;
            model.allocator().free(&rs).map_err(|e| e.to_string())?;
        }
        MambaOp::Match { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let m = cache.match_prefix(*ns as u64, &t, &mut out);
            let rm = model.match_prefix(*ns as u64, &t);
            check("match", step, &out[..m.len()], &rm.slots[..rm.len])?;
            if held.matches.len() == MAX_MATCHES {
                held.matches.remove(0);
            }
            held.matches.push((m, rm.node));
        }
        MambaOp::LockMatch { which } => {
            let Some(i) = pick(*which, held.matches.len()) else { return Ok(()) };
            if held.leases.len() == MAX_HELD {
                return Ok(());
            }
            let (m, node) = held.matches[i];
            let got = cache.lock(&m);
            let want = model.lock_match(node);
            check("lock a match", step, got.as_ref().err(), want.as_ref().err())?;
            if let Ok(lease) = got {
                check(
                    "lock a match: lease",
                    step,
                    (lease.len(), cache.lease_state(&lease)),
                    (m.len(), model.state_of(node)),
                )?;
                held.leases.push((lease, node));
            }
        }
        MambaOp::Lock { key, ns } => {
            if held.leases.len() == MAX_HELD {
                return Ok(());
            }
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let m = cache.match_and_lock_checkpoint(*ns as u64, &t, &mut out);
            let rm = model.match_and_lock(*ns as u64, &t);
            let got = (m.lease.len(), m.state, m.kv_len, m.branching_len, &out[..m.kv_len]);
            check_match(cache, step, "lock", got, &rm)?;
            held.leases.push((m.lease, rm.node));
        }
        MambaOp::Release { which } => {
            let Some(i) = pick(*which, held.leases.len()) else { return Ok(()) };
            let (lease, node) = held.leases.swap_remove(i);
            drop(lease);
            model.unlock(node);
        }
        MambaOp::Peek { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let n = cache.peek_prefix(*ns as u64, &t, &mut out);
            check("peek", step, &out[..n], &model.peek(*ns as u64, &t)[..])?;
        }
        MambaOp::Evict { n } => {
            check("evict", step, cache.evict(*n as usize), model.evict(*n as usize))?;
        }
        MambaOp::EvictMamba { n } => {
            let n = *n as usize % 4;
            check("evict_mamba", step, cache.evict_mamba(n), model.evict_mamba(n))?;
        }
        MambaOp::HoldState => {
            if held.states.len() < MAX_HELD {
                if let Some(s) = alloc_state(cache, model, step)? {
                    held.states.push(s);
                }
            }
        }
        MambaOp::DropState { which } => {
            let Some(i) = pick(*which, held.states.len()) else { return Ok(()) };
            let s = held.states.swap_remove(i);
            cache.states().free(&[s]).map_err(|e| e.to_string())?;
            model.states().free(&[s]).map_err(|e| e.to_string())?;
        }
        MambaOp::FreeTreeState { which } => {
            let tree = model.held_states();
            let Some(i) = pick(*which, tree.len()) else { return Ok(()) };
            let got = cache.states().free(&[tree[i]]).map_err(|e| (e.index, e.kind));
            check("free of a tree's state", step, got, Err((tree[i], crate::error::FreeErrorKind::Cached)))?;
        }
    }
    Ok(())
}

/// The O(1) part of [`compare`]: sizes, free space, node count.
fn compare_sizes(cache: &Cache, model: &Model, step: usize) -> Result<(), String> {
    let got = (
        (cache.total_size(), cache.evictable_size(), cache.protected_size()),
        (cache.mamba_evictable_size(), cache.mamba_protected_size()),
        (cache.allocator().available_size(), cache.states().available(), cache.node_count()),
    );
    let want = (
        (model.total_size(), model.evictable_size(), model.protected_size()),
        (model.mamba_evictable_size(), model.mamba_protected_size()),
        (model.allocator().available_size(), model.states().available(), model.node_count()),
    );
    check(
        "sizes ((total, evictable, protected), states (evictable, protected), (free KV, free states, nodes))",
        step,
        got,
        want,
    )
}

fn compare(cache: &Cache, model: &Model, held: &Held<'_>, shape: Shape, step: usize) -> Result<(), String> {
    cache.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
    model.check().map_err(|e| format!("step {step}: {e}"))?;
    compare_sizes(cache, model, step)?;
    let leaf_paths = cache.leaf_paths();
    check("leaf paths", step, &leaf_paths, &model.leaf_paths())?;
    // Every state slot is the tree's, an open request's, the driver's, or free: on both
    // sides the same.
    let mut expected: Vec<u32> = model.held_states();
    expected.extend(held.reqs.iter().map(|r| r.state));
    expected.extend(&held.states);
    expected.sort_unstable();
    let allocated = |is: &dyn Fn(u32) -> bool| (1..=shape.states).filter(|&s| is(s)).collect::<Vec<_>>();
    check("allocated states", step, allocated(&|s| cache.states().is_allocated(s)), expected.clone())?;
    check("model's allocated states", step, allocated(&|s| model.states().is_allocated(s)), expected)?;
    // The tree's own states are exactly those the cache marks as held.
    let mut tree: Vec<u32> = model.held_states();
    tree.sort_unstable();
    check("tree-held states", step, allocated(&|s| cache.states().is_held(s)), tree)?;
    for r in &held.reqs {
        check(
            "request lease",
            step,
            (r.lease.len(), cache.lease_state(&r.lease)),
            (r.ref_protected, model.state_of(r.ref_node)),
        )?;
    }
    for (lease, node) in &held.leases {
        check("lease state", step, cache.lease_state(lease), model.state_of(*node))?;
    }
    // Every KV page owned exactly once: tree, open requests, free pool.
    let ps = shape.page_size;
    let mut owner = vec![0u8; shape.pages + 1];
    for (_, _, slots) in &leaf_paths {
        for s in slots.chunks(ps) {
            owner[s[0] as usize / ps] = 1; // shared prefixes repeat: mark, do not count
        }
    }
    let tree_pages = owner.iter().filter(|&&o| o == 1).count();
    check("tree pages", step, tree_pages * ps, cache.total_size())?;
    for r in &held.reqs {
        let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).map_err(|e| e.to_string())?;
        for &s in &row[r.lease.len()..] {
            let p = s as usize / ps;
            if owner[p] == 1 {
                return Err(format!("step {step}: page {p} is in the tree and owned by a request"));
            }
            owner[p] = 2;
        }
    }
    let owned = owner.iter().filter(|&&o| o != 0).count();
    check("pages owned + free", step, owned + cache.allocator().available_size() / ps, shape.pages)
}
