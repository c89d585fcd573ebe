//! [`SwaRadixCache`] against [`ReferenceSwaCache`], operation by operation (feature
//! `models`): the shared driver of `tests/swa_tree_model.rs` and the `swa_ops` fuzz
//! target.
//!
//! kvpool's side runs every request through the engine contract, a
//! [`Request`] handle: admission, prefill chunks, decode batches,
//! window releases (`release_window`), checkpoints, finishes and aborts. The reference
//! side runs SGLang's calls on the simple tree (match and lock, allocate,
//! `release_window`, `cache_finished_req`, `cache_unfinished_req`, free and unlock).
//!
//! The real cache runs over an [`SwaAllocator`]; the reference over its own model of the
//! two pools ([`RefDualPool`]), which hands out the same pages (lowest free first) and
//! maps them the same way. So the two sides must agree on every full slot, and on which
//! window page each full page has, not just on lengths. A request's tokens that continue
//! its last page take the slots after its last one on both sides. At page size 1 a
//! decode step takes the slot after each request's last one when it is free, which the
//! reference pool does not model: there a [`SwaOp::Decode`] extends each request of the
//! batch by one token instead.
//!
//! After every operation the driver compares the op's own result (matched and peeked
//! lengths and slots, locks, rows, new slots, decode slots, finish results, tokens
//! freed by each eviction pass, window tokens released, allocation outcomes) and the
//! sizes: total / evictable / protected tokens, window evictable / protected tokens,
//! tombstone tokens, both pools' free tokens, node count, free request rows, and the
//! accounting (free full tokens + cached + the pages open requests hold = capacity).
//! Every `full_every` steps, after the last step and after the teardown it also
//! compares the canonical leaf paths, the whole full-to-window mapping (which pages are
//! tombstoned, and which window page every live page has), each open request's lock,
//! length and row, runs `check_invariants()` and the model's own check, and checks that
//! every full page is owned exactly once (tree, one open request, free pool).
//!
//! Refusals the contract promises are checked against a snapshot of the cache (sizes,
//! both pools, free rows, node count, leaf paths) and of the request: a finish with one
//! token more or fewer than the request holds, a checkpoint or a window release past
//! what it holds, an extend or decode past the end of a row, an admission without a
//! free row. A checkpoint that reaches no further than the request's lock must change
//! nothing either.
//!
//! Namespace 1 is a salted [`CacheKey`]: its requests must never see namespace 0's KV
//! (the reference keeps them apart as two namespaces).
//!
//! Since both eviction orders depend on every touch, a wrong tick anywhere shows up as
//! a different victim, and then as a different size or mapping.

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};

use crate::alloc::SwaAllocator;
use crate::baseline::swa_ref::{RefDualPool, RefSwaLease, ReferenceSwaCache, SwaSizes};
use crate::radix::{CacheError, CacheKey, EvictionPolicy, RadixConfig, Request, Swa, SwaRadixCache};
use crate::{AllocError, ReqToTokenPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest prompt.
pub const MAX_KEY: usize = 20;
/// Tokens a request row holds.
const ROW: usize = 28;
/// Open requests at most (the cache's request rows).
const MAX_REQS: usize = 4;
/// The salt of namespace 1.
const SALT: u64 = 0x5a17;
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

/// One step of an SWA-cache model run. Indices (`req`) are taken modulo the number of
/// open requests; an op with none to pick from does nothing.
#[derive(Arbitrary, Debug, Clone)]
pub enum SwaOp {
    /// A request arrives: `admit` (a row, the longest usable cached prefix, locked),
    /// then `extend` by the rest of its prompt, or (one time in four) by `prefill / 4`
    /// modulo one more than the rest: a chunk, or nothing yet (a request that only
    /// holds its lock). An allocation that fails aborts it. With every row taken, the
    /// admission must be refused.
    Start {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace 1 (a salted key) or 0.
        ns: bool,
        /// How much of the prompt to allocate now.
        prefill: u8,
    },
    /// An open request allocates its next `n % 8` tokens (`extend`): the rest of its
    /// prompt, then output tokens from `seed`. Past the end of its row it must be
    /// refused.
    Extend {
        /// Which open request.
        req: u8,
        /// How many tokens.
        n: u8,
        /// Output tokens.
        seed: u8,
    },
    /// One decode step (`decode`) for the open requests whose bit (index modulo 8) is
    /// set in `mask`, outputs from `token` (at page size 1, one token's `extend` each:
    /// see the module docs).
    Decode {
        /// Which open requests.
        mask: u8,
        /// Output tokens.
        token: u8,
    },
    /// An open request releases the window KV of its tokens `from % (len + 2)` up to
    /// `upto % (len + 2)` (`release_window`: they fell out of its window); a range
    /// past its tokens must be refused.
    ReleaseWindow {
        /// Which open request.
        req: u8,
        /// From which token.
        from: u8,
        /// Up to which token.
        upto: u8,
    },
    /// An open request caches its first `lock + cut % (len - lock + 2)` tokens and
    /// keeps running (`checkpoint`, chunked prefill); one past its tokens must be
    /// refused.
    Checkpoint {
        /// Which open request.
        req: u8,
        /// How far.
        cut: u8,
    },
    /// An open request finishes (`finish`). `miscount % 3` of 1 or 2 first finishes
    /// with one token fewer or one more than it holds, which must be refused.
    Finish {
        /// Which open request.
        req: u8,
        /// A wrong token count first.
        miscount: u8,
    },
    /// An open request is aborted (`abort`), or dropped when `drop`: its own KV (both
    /// pools) and its row go back, its lock is released.
    Abort {
        /// Which open request.
        req: u8,
        /// Drop the handle instead of calling `abort`.
        drop: bool,
    },
    /// A request admitted, prefilled, the window KV of its first `released % (pages +
    /// 1)` pages released, and finished at once (what a raw insert of pages whose
    /// window KV is gone is to the contract).
    Serve {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
        /// Leading pages without window KV.
        released: u8,
    },
    /// `match_prefix` without a lock.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
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

type SRequest = Request<SwaAllocator, Swa>;

/// An open request: kvpool's handle and the model's view of the same request.
struct Open {
    req: SRequest,
    ns: u64,
    prompt: Vec<u32>,
    /// The tokens whose KV the row holds (`req.len()` of them).
    kv: Vec<u32>,
    ref_kv: Vec<u32>,
    ref_lease: RefSwaLease,
}

/// The sizes (both pools and the node count included), free rows, cached paths.
type Snapshot = (SwaSizes, usize, Vec<(u64, Vec<u32>, Vec<u32>)>);

struct Run {
    cache: Arc<SwaRadixCache>,
    model: ReferenceSwaCache,
    open: Vec<Open>,
    shape: Shape,
    /// kvpool's namespace of namespace 1.
    salted: u64,
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

/// The cache key of namespace `ns`: the default key, or a salted one.
fn cache_key(ns: bool) -> CacheKey {
    CacheKey { salt: if ns { SALT } else { 0 }, ..CacheKey::default() }
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

/// The token at `pos` of a request: its prompt's, then outputs made from `seed`.
fn next_token(prompt: &[u32], pos: usize, seed: u8) -> u32 {
    prompt.get(pos).copied().unwrap_or(((seed as usize + pos) % ALPHABET as usize) as u32)
}

/// The open requests whose bit (index modulo 8) is set in `mask`.
fn batch(open: &mut [Open], mask: u8) -> Vec<&mut SRequest> {
    open.iter_mut().enumerate().filter(|(i, _)| mask >> (i % 8) & 1 == 1).map(|(_, o)| &mut o.req).collect()
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
/// last step and after the teardown (each op's result, the sizes and the accounting
/// are compared after every step).
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run_with(shape: Shape, ops: &[SwaOp], full_every: usize) -> Result<(), String> {
    let full_every = full_every.max(1);
    let ps = shape.page_size;
    let (full, window) = (shape.pages * ps, shape.window_pages * ps);
    let alloc = SwaAllocator::new(full, window, ps as u32).map_err(|e| e.to_string())?;
    let rows = ReqToTokenPool::new(MAX_REQS as u32, ROW).map_err(|e| e.to_string())?;
    let config = RadixConfig { policy: shape.policy, event_capacity: None, ..RadixConfig::default() };
    let cache = SwaRadixCache::with_window(alloc, rows, config, shape.window).map_err(|e| e.to_string())?;
    let model = ReferenceSwaCache::new(RefDualPool::new(full, window, ps), shape.window, shape.policy)
        .map_err(|e| e.to_string())?;
    let salted = cache_key(true).tree_key(&[]).0;
    let mut run = Run { cache: Arc::new(cache), model, open: Vec::new(), shape, salted };
    for (step, op) in ops.iter().enumerate() {
        run.apply(op, step)?;
        if (step + 1) % full_every == 0 || step + 1 == ops.len() {
            run.compare(step)?;
        } else {
            run.compare_sizes(step)?;
        }
    }
    // Give everything back, then evict everything: both pools must be whole again.
    let end = ops.len();
    while !run.open.is_empty() {
        run.abort(run.open.len() - 1, end % 2 == 0);
    }
    check("evict all", end, run.cache.evict(usize::MAX), run.model.evict(usize::MAX))?;
    run.compare(end)?;
    let c = &run.cache;
    check("empty at the end", end, (c.total_size(), c.node_count()), (0, 0))?;
    let pools = (c.allocator().full_available_size(), c.allocator().window_available_size());
    check("free pools at the end", end, pools, (full, window))?;
    check("the cache's holders at the end", end, Arc::strong_count(c), 1)
}

fn sizes(cache: &SwaRadixCache) -> SwaSizes {
    let a = cache.allocator();
    (
        (cache.total_size(), cache.evictable_size(), cache.protected_size()),
        (cache.swa_evictable_size(), cache.swa_protected_size(), cache.tombstone_size()),
        (a.full_available_size(), a.window_available_size(), cache.node_count()),
    )
}

impl Run {
    fn snapshot(&self) -> Snapshot {
        (sizes(&self.cache), self.cache.req_pool().available_size(), self.cache.leaf_paths())
    }

    /// Check that a refusal changed nothing, in the cache or in request `i`.
    fn unchanged(&self, before: &Snapshot, i: Option<usize>, what: &str, step: usize) -> Result<(), String> {
        check(&format!("{what}: refused, nothing changed"), step, &self.snapshot(), before)?;
        if let Some(o) = i.map(|i| &self.open[i]) {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots());
            let want = (o.kv.len(), o.ref_lease.len, &o.ref_kv[..]);
            check(&format!("{what}: refused, the request unchanged"), step, got, want)?;
        }
        Ok(())
    }

    fn apply(&mut self, op: &SwaOp, step: usize) -> Result<(), String> {
        let ps = self.shape.page_size;
        let pick = |which: u8, len: usize| (len > 0).then(|| which as usize % len);
        match op {
            SwaOp::Start { key, ns, prefill } => {
                let Some(i) = self.admit(key, *ns, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                let n = if prefill % 4 == 0 { (prefill / 4) as usize % (rest + 1) } else { rest };
                if !self.extend(i, n, 0, step)? {
                    self.abort(i, step % 2 == 0);
                }
            }
            SwaOp::Extend { req, n, seed } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.extend(i, *n as usize % 8, *seed, step)?;
            }
            SwaOp::Decode { mask, token } => self.decode(*mask, *token, step)?,
            SwaOp::ReleaseWindow { req, from, upto } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                let len = self.open[i].kv.len();
                self.release_window(i, *from as usize % (len + 2)..*upto as usize % (len + 2), step)?;
            }
            SwaOp::Checkpoint { req, cut } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.checkpoint(i, *cut, step)?;
            }
            SwaOp::Finish { req, miscount } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.finish(i, *miscount, step)?;
            }
            SwaOp::Abort { req, drop } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.abort(i, *drop);
            }
            SwaOp::Serve { key, ns, released } => {
                let Some(i) = self.admit(key, *ns, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                if !self.extend(i, rest, 0, step)? {
                    self.abort(i, false);
                    return Ok(());
                }
                let len = self.open[i].kv.len();
                let dead = *released as usize % (len / ps + 1) * ps;
                self.release_window(i, 0..dead, step)?;
                self.finish(i, 0, step)?;
            }
            SwaOp::Match { key, ns } => {
                let t = tokens(key, ps);
                let mut out = vec![0u32; t.len()];
                let m = self.cache.match_prefix(cache_key(*ns).tree_key(&t).0, &t, &mut out);
                let rm = self.model.match_prefix(*ns as u64, &t);
                check("match", step, &out[..m.len()], &rm.slots[..rm.len])?;
            }
            SwaOp::Peek { key, ns } => {
                let t = tokens(key, ps);
                let mut out = vec![0u32; t.len()];
                let n = self.cache.peek_prefix(cache_key(*ns).tree_key(&t).0, &t, &mut out);
                check("peek", step, &out[..n], &self.model.peek(*ns as u64, &t)[..])?;
            }
            SwaOp::Evict { n } => {
                let n = *n as usize % 24;
                check("evict", step, self.cache.evict(n), self.model.evict(n))?;
            }
            SwaOp::EvictSwa { n } => {
                let n = *n as usize % 12;
                check("evict_swa", step, self.cache.evict_swa(n), self.model.evict_swa(n))?;
            }
            SwaOp::EvictBoth { full, window } => {
                let (f, w) = (*full as usize % 8, *window as usize % 12);
                check("evict_both", step, self.cache.evict_both(f, w), self.model.evict_both(f, w))?;
            }
        }
        Ok(())
    }

    /// Admit a request for `seeds` in namespace `ns` on both sides; its index, or
    /// `None` when it was (rightly) refused.
    fn admit(&mut self, seeds: &[u8], ns: bool, step: usize) -> Result<Option<usize>, String> {
        let key = cache_key(ns);
        let prompt = tokens(seeds, self.shape.page_size);
        if self.open.len() == MAX_REQS {
            let before = self.snapshot();
            match self.cache.admit(key, &prompt) {
                Err(AllocError::OutOfMemory(_)) => self.unchanged(&before, None, "admission without a row", step)?,
                other => return Err(format!("step {step}: admission with every row taken gave {other:?}")),
            }
            return Ok(None);
        }
        let req = self.cache.admit(key, &prompt).map_err(err(step, "admit"))?;
        let ns = ns as u64;
        let rm = self.model.match_prefix(ns, &prompt);
        let ref_lease = self.model.lock(rm.node, rm.len);
        let h = rm.len;
        let got = (req.cached_len(), req.len(), req.slots());
        check("admit: lock and row", step, got, (h, h, &rm.slots[..h]))?;
        let kv = prompt[..h].to_vec();
        let ref_kv = rm.slots[..h].to_vec();
        self.open.push(Open { req, ns, prompt, kv, ref_kv, ref_lease });
        Ok(Some(self.open.len() - 1))
    }

    /// `extend(n)` of open request `i` on both sides; whether it allocated.
    fn extend(&mut self, i: usize, n: usize, seed: u8, step: usize) -> Result<bool, String> {
        let ps = self.shape.page_size;
        let from = self.open[i].kv.len();
        let to = from + n;
        if to > ROW {
            let before = self.snapshot();
            match self.open[i].req.extend(n) {
                Err(AllocError::Row(_)) => self.unchanged(&before, Some(i), "extend past the row", step)?,
                other => return Err(format!("step {step}: extend past the row gave {other:?}")),
            }
            return Ok(false);
        }
        let got = self.open[i].req.extend(n);
        let o = &mut self.open[i];
        if n == 0 {
            check("extend by nothing", step, got, Ok(()))?;
            return Ok(true);
        }
        // The model: the tokens that continue the request's last page take the slots
        // after its last one; the rest get fresh pages (evicting the shortfall).
        let cont = from.next_multiple_of(ps).min(to);
        let mut want: Vec<u32> = (from..cont).map(|p| o.ref_kv[from - 1] + (p - from + 1) as u32).collect();
        let fresh = if to > cont { self.model.alloc_extend(cont, to) } else { Some(Vec::new()) };
        check("extend ok", step, got.is_ok(), fresh.is_some())?;
        let Some(fresh) = fresh else { return Ok(false) };
        want.extend(fresh);
        check("extend: new slots", step, &o.req.slots()[from..], &want[..])?;
        o.ref_kv.extend_from_slice(&want);
        for pos in from..to {
            o.kv.push(next_token(&o.prompt, pos, seed));
        }
        Ok(true)
    }

    fn decode(&mut self, mask: u8, token: u8, step: usize) -> Result<(), String> {
        let ps = self.shape.page_size;
        let picked: Vec<usize> = (0..self.open.len()).filter(|i| mask >> (i % 8) & 1 == 1).collect();
        if ps == 1 {
            // See the module docs: one token's extend each.
            for (k, &i) in picked.iter().enumerate() {
                self.extend(i, 1, token.wrapping_add(k as u8), step)?;
            }
            return Ok(());
        }
        let mut out = vec![0u32; picked.len()];
        if picked.iter().any(|&i| self.open[i].kv.len() >= ROW) {
            let before = self.snapshot();
            match self.cache.decode(&mut batch(&mut self.open, mask), &mut out) {
                Err(AllocError::Row(_)) => {}
                other => return Err(format!("step {step}: a decode past a row's end gave {other:?}")),
            }
            for &i in &picked {
                self.unchanged(&before, Some(i), "decode past a row's end", step)?;
            }
            return Ok(());
        }
        let got = self.cache.decode(&mut batch(&mut self.open, mask), &mut out);
        let starts = picked.iter().filter(|&&i| self.open[i].kv.len() % ps == 0).count();
        let pages = self.model.alloc_decode_pages(starts);
        check("decode ok", step, got.is_ok(), pages.is_some())?;
        let Some(pages) = pages else { return Ok(()) };
        let mut fresh = pages.into_iter();
        for (k, &i) in picked.iter().enumerate() {
            let o = &mut self.open[i];
            let pos = o.kv.len();
            let slot = if pos % ps == 0 {
                fresh.next().expect("a page for every request that starts one") * ps as u32
            } else {
                o.ref_kv[pos - 1] + 1
            };
            check("decode slot", step, out[k], slot)?;
            o.kv.push(next_token(&o.prompt, pos, token.wrapping_add(k as u8)));
            o.ref_kv.push(slot);
        }
        Ok(())
    }

    /// `release_window(range)` of open request `i` on both sides.
    fn release_window(&mut self, i: usize, range: std::ops::Range<usize>, step: usize) -> Result<(), String> {
        let len = self.open[i].kv.len();
        if range.end > len {
            let before = self.snapshot();
            let got = self.open[i].req.release_window(range.clone());
            check(
                "release_window past the tokens",
                step,
                got,
                Err(CacheError::TokenCount { tokens: range.end, held: len }),
            )?;
            return self.unchanged(&before, Some(i), "release_window past the tokens", step);
        }
        let o = &mut self.open[i];
        let got = o.req.release_window(range.clone()).map_err(err(step, "release_window"))?;
        let want = self.model.release_window(&o.ref_kv, &o.ref_lease, range).map_err(err(step, "model release"))?;
        check("release_window", step, got, want)
    }

    fn checkpoint(&mut self, i: usize, cut: u8, step: usize) -> Result<(), String> {
        let o = &self.open[i];
        let (len, n) = (o.kv.len(), o.req.cached_len());
        let c = n + cut as usize % (len - n + 2);
        if c > len || c == n {
            // Past what the request holds: refused; no further than its lock: nothing
            // to do. Either way nothing changes.
            let before = self.snapshot();
            let kv: Vec<u32> = o.kv.iter().copied().chain([0]).take(c).collect();
            let got = self.open[i].req.checkpoint(&kv);
            let want = if c > len { Err(CacheError::TokenCount { tokens: c, held: len }) } else { Ok(()) };
            check("checkpoint that caches nothing", step, got, want)?;
            return self.unchanged(&before, Some(i), "checkpoint that caches nothing", step);
        }
        let o = &mut self.open[i];
        o.req.checkpoint(&o.kv[..c]).map_err(err(step, "checkpoint"))?;
        self.model.cache_unfinished_req(o.ns, &o.kv[..c], &mut o.ref_kv, &mut o.ref_lease);
        check("checkpoint: lock and row", step, (o.req.cached_len(), o.req.slots()), (o.ref_lease.len, &o.ref_kv[..]))
    }

    /// Finish open request `i` (after a wrong count first, when `miscount` says so).
    fn finish(&mut self, i: usize, miscount: u8, step: usize) -> Result<(), String> {
        let len = self.open[i].kv.len();
        let wrong = match miscount % 3 {
            1 if len > 0 => Some(self.open[i].kv[..len - 1].to_vec()),
            2 => Some(self.open[i].kv.iter().copied().chain([0]).collect()),
            _ => None,
        };
        if let Some(wrong) = wrong {
            let before = self.snapshot();
            let mut o = self.open.remove(i);
            let Err(refused) = o.req.finish(&wrong) else {
                return Err(format!("step {step}: a finish with {} tokens of {len} was accepted", wrong.len()));
            };
            let want = CacheError::TokenCount { tokens: wrong.len(), held: len };
            check("finish with a wrong count", step, &refused.error, &want)?;
            o.req = refused.request;
            self.open.insert(i, o);
            self.unchanged(&before, Some(i), "finish with a wrong count", step)?;
        }
        let o = self.open.remove(i);
        let got = o.req.finish(&o.kv).map_err(|r| format!("step {step}: finish: {}", r.error))?;
        let want = self.model.cache_finished_req(o.ns, &o.kv, &o.ref_kv, o.ref_lease);
        check("finish: cached", step, got, want)
    }

    /// Abort (or drop) open request `i`: its own slots (past its lock) are freed, its
    /// lock released.
    fn abort(&mut self, i: usize, drop_it: bool) {
        let Open { req, ref_kv, ref_lease, .. } = self.open.remove(i);
        if drop_it {
            drop(req);
        } else {
            req.abort();
        }
        self.model.pool_mut().free(&ref_kv[ref_lease.len..]);
        self.model.unlock(ref_lease);
    }

    /// The O(1)-ish part of [`compare`](Self::compare): sizes, both pools' free tokens,
    /// node count, free rows, the accounting.
    fn compare_sizes(&self, step: usize) -> Result<(), String> {
        let c = &self.cache;
        check(
            "sizes ((total, evictable, protected), (swa evictable, swa protected, tombstones), \
             (free full, free window, nodes))",
            step,
            sizes(c),
            self.model.sizes(),
        )?;
        check("free rows", step, c.req_pool().available_size(), MAX_REQS - self.open.len())?;
        check("the cache's holders", step, Arc::strong_count(c), 1 + self.open.len())?;
        let ps = self.shape.page_size;
        let held: usize = self.open.iter().map(|o| o.kv.len().next_multiple_of(ps) - o.ref_lease.len).sum();
        let total = c.allocator().full_available_size() + c.total_size() + held;
        check("free + cached + held", step, total, self.shape.pages * ps)
    }

    fn compare(&self, step: usize) -> Result<(), String> {
        let (c, model, shape) = (&self.cache, &self.model, self.shape);
        c.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
        model.check().map_err(|e| format!("step {step}: {e}"))?;
        self.compare_sizes(step)?;
        let leaf_paths = c.leaf_paths();
        let mut mapped = Vec::with_capacity(leaf_paths.len());
        for (ns, k, v) in &leaf_paths {
            let ns = match *ns {
                0 => 0,
                n if n == self.salted => 1,
                n => return Err(format!("step {step}: a cached path in namespace {n}, which no request used")),
            };
            mapped.push((ns, k.clone(), v.clone()));
        }
        mapped.sort();
        check("leaf paths", step, &mapped, &model.leaf_paths())?;
        // The whole mapping: which full pages have a window part (the tree's tombstones are
        // the pages without), and which window page each has.
        let ps = shape.page_size;
        let window_of = |p: usize| c.allocator().window_slot((p * ps) as u32).map_or(0, |w| w / ps as u32);
        let got: Vec<u32> = (1..=shape.pages).map(window_of).collect();
        let want: Vec<u32> = (1..=shape.pages).map(|p| model.pool().window_page(p as u32)).collect();
        check("full-to-window mapping (window page per full page)", step, got, want)?;
        for o in &self.open {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots());
            check("request: length, lock, row", step, got, (o.kv.len(), o.ref_lease.len, &o.ref_kv[..]))?;
        }
        // Every full page owned exactly once: tree, one open request, free pool.
        let mut owner = vec![0u8; shape.pages + 1];
        for (_, _, slots) in &leaf_paths {
            for s in slots.chunks(ps) {
                owner[s[0] as usize / ps] = 1; // shared prefixes repeat: mark, do not count
            }
        }
        let tree_pages = owner.iter().filter(|&&o| o == 1).count();
        check("tree pages", step, tree_pages * ps, c.total_size())?;
        for o in &self.open {
            let mut prev = usize::MAX;
            for &s in &o.req.slots()[o.req.cached_len()..] {
                let p = s as usize / ps;
                if p != prev && owner[p] != 0 {
                    return Err(format!("step {step}: page {p} is owned by a request and the tree or another"));
                }
                owner[p] = 2;
                prev = p;
            }
        }
        let owned = owner.iter().filter(|&&o| o != 0).count();
        check("pages owned + free", step, owned + c.allocator().full_available_size() / ps, shape.pages)
    }
}
