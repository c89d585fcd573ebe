//! [`MambaRadixCache`] against [`ReferenceMambaCache`], operation by operation (feature
//! `models`): the shared driver of `tests/mamba_tree_model.rs` and the `mamba_ops` fuzz
//! target.
//!
//! kvpool's side runs every request through the engine contract, a
//! [`Request`] handle: admission (the longest prefix ending at a
//! cached state, locked, and a running state), prefill chunks, decode batches, a state
//! saved for caching (`save_state`), checkpoints, finishes and aborts. The reference
//! side runs SGLang's calls on the simple tree (match and lock, `alloc_state`,
//! allocate, `cache_finished_req` and `cache_unfinished_req` with the saved state,
//! free and unlock).
//!
//! Each side has its own KV allocator and its own state pool of the same shape; both
//! hand out the lowest free slots, and the two caches free the same slots, so the two
//! sides must agree on every KV slot and every state number, not just on lengths.
//! After every operation the driver compares the op's own result (matched lengths,
//! slots, resumed states, running and saved states, KV match lengths and slots,
//! branching lengths, finish results, evicted counts, allocation outcomes and slots)
//! and the sizes (total / evictable / protected tokens, evictable / protected states,
//! free KV and free states, node count, free request rows) and the accounting (free +
//! cached + the pages open requests hold = capacity). Every `full_every` steps, after
//! the last step and after the teardown it also compares the canonical leaf paths,
//! which state slots are allocated on each side (the tree's, the open requests' running
//! and saved states, those held by the driver: nothing else), each open request's row,
//! lock and length (and, while it holds the lock it was admitted with, that lock's
//! state), runs `check_invariants()` and the model's own check, and checks that every
//! KV page is owned exactly once (tree, one open request, free pool).
//!
//! Refusals the contract promises are checked against a snapshot of the cache (sizes,
//! free KV, states and rows, node count, leaf paths) and of the request: a finish with
//! one token more or fewer than the request holds, a finish whose saved state lies
//! past its tokens, a checkpoint past what it holds or not where the state was saved,
//! a state saved at a position that is not a whole number of pages, an extend or
//! decode past the end of a row, an admission without a free row.
//!
//! Namespace 1 is a salted [`CacheKey`]: its requests must never see namespace 0's KV
//! (the reference keeps them apart as two namespaces).
//!
//! Since eviction order depends on every touch, a wrong tick anywhere (a touch missed,
//! added or reordered) shows up as a different victim and then as a different size.

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::mamba_ref::ReferenceMambaCache;
use crate::baseline::RefNodeId;
use crate::radix::{CacheError, CacheKey, EvictionPolicy, Mamba, MambaRadixCache, RadixConfig, Request, StateInsert};
use crate::{AllocError, KvAllocator, PagedAllocator, ReqToTokenPool, SlotPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest prompt.
const MAX_KEY: usize = 20;
/// Tokens a request row holds.
const ROW: usize = 28;
/// Open requests at most (the cache's request rows).
const MAX_REQS: usize = 4;
/// States the driver holds outside requests, at most.
/// The salt of namespace 1.
const SALT: u64 = 0x5a17;
/// How many ops the `mamba_ops` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 16;
/// How often the `mamba_ops` fuzz target runs the full O(tree) comparison (see the
/// module docs): once at the end of the sequence and once after the teardown.
pub const FUZZ_FULL_CHECK_EVERY: usize = MAX_FUZZ_OPS;

/// One step of a Mamba-cache model run. Indices (`req`, `which`) are taken modulo the
/// number of things they pick from; an op with nothing to pick from does nothing.
#[derive(Arbitrary, Debug, Clone)]
pub enum MambaOp {
    /// A request arrives: `admit` (a row, the longest prefix ending at a cached state,
    /// locked, and a running state, which may evict one), then `extend` by the rest of
    /// its prompt, or (one time in four) by `prefill / 4` modulo one more than the
    /// rest: a chunk, or nothing yet (a request that only holds its lock). An
    /// allocation that fails aborts it. With every row taken, the admission must be
    /// refused.
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
    /// set in `mask`, outputs from `token`.
    Decode {
        /// Which open requests.
        mask: u8,
        /// Output tokens.
        token: u8,
    },
    /// An open request saves its state after a page boundary (`save_state`): page
    /// `(at & 0x7f) % (pages held + 2)`, one past its tokens possible. With `at`'s top
    /// bit set (page size above 1), a position one token further comes first and must
    /// be refused.
    SaveState {
        /// Which open request.
        req: u8,
        /// Where.
        at: u8,
    },
    /// An open request caches its progress and keeps running (`checkpoint`): with
    /// `at` even, it first saves its state after its whole pages and checkpoints them;
    /// with `at` odd, it checkpoints up to where it saved its state (its whole pages
    /// when it saved none, which is refused).
    Checkpoint {
        /// Which open request.
        req: u8,
        /// Save first (even) or not.
        at: u8,
    },
    /// An open request finishes (`finish`), caching its tokens up to where its state
    /// was saved: `cut` first saves it at a page boundary from its lock to its end, or
    /// keeps what was saved before (nothing saved: nothing new is cached; saved past
    /// its tokens: refused). `miscount % 3` of 1 or 2 first finishes with one token
    /// fewer or one more than it holds, which must be refused.
    Finish {
        /// Which open request.
        req: u8,
        /// Where to save its state first.
        cut: u8,
        /// A wrong token count first.
        miscount: u8,
    },
    /// An open request is aborted (`abort`), or dropped when `drop`: its own KV, its
    /// states and its row go back, its lock is released.
    Abort {
        /// Which open request.
        req: u8,
        /// Drop the handle instead of calling `abort`.
        drop: bool,
    },
    /// A request admitted, prefilled, its state saved after its whole pages and
    /// finished at once (what an insert of fresh KV and a fresh state is to the
    /// contract).
    Serve {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// `match_prefix` without a lock.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
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
}

type Cache = MambaRadixCache<PagedAllocator, SlotPool>;
type Model = ReferenceMambaCache<PagedAllocator, SlotPool>;
type MRequest = Request<PagedAllocator, Mamba<SlotPool>>;

/// An open request: kvpool's handle and the model's view of the same request.
struct Open {
    req: MRequest,
    ns: u64,
    prompt: Vec<u32>,
    /// The tokens whose KV the row holds (`req.len()` of them).
    kv: Vec<u32>,
    ref_kv: Vec<u32>,
    ref_node: RefNodeId,
    ref_protected: usize,
    running: u32,
    /// Where its state was saved, and the slot.
    saved: Option<(usize, u32)>,
    /// Whether it holds the lock it was admitted with (which ends at its resume state).
    admitted: bool,
}

/// Free KV and states, the sizes, free rows, nodes, cached paths.
type Snapshot = ((usize, usize, usize), (usize, usize, usize), (usize, usize, usize), Vec<(u64, Vec<u32>, Vec<u32>)>);

struct Run {
    cache: Arc<Cache>,
    model: Model,
    open: Vec<Open>,
    shape: Shape,
    /// kvpool's namespace of namespace 1.
    salted: u64,
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

/// The cache key of namespace `ns`: the default key, or a salted one.
fn cache_key(ns: bool) -> CacheKey {
    CacheKey { salt: if ns { SALT } else { 0 }, ..CacheKey::default() }
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

/// The token at `pos` of a request: its prompt's, then outputs made from `seed`.
fn next_token(prompt: &[u32], pos: usize, seed: u8) -> u32 {
    prompt.get(pos).copied().unwrap_or(((seed as usize + pos) % ALPHABET as usize) as u32)
}

/// The open requests whose bit (index modulo 8) is set in `mask`.
fn batch(open: &mut [Open], mask: u8) -> Vec<&mut MRequest> {
    open.iter_mut().enumerate().filter(|(i, _)| mask >> (i % 8) & 1 == 1).map(|(_, o)| &mut o.req).collect()
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
/// last step and after the teardown (each op's result, the sizes and the accounting
/// are compared after every step).
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run_with(shape: Shape, ops: &[MambaOp], full_every: usize) -> Result<(), String> {
    let full_every = full_every.max(1);
    let ps = shape.page_size;
    let make = || PagedAllocator::new(shape.pages * ps, ps as u32).expect("a small allocator");
    let config = RadixConfig { policy: shape.policy, event_capacity: None, ..RadixConfig::default() };
    let rows = ReqToTokenPool::new(MAX_REQS as u32, ROW).map_err(|e| e.to_string())?;
    let cache = MambaRadixCache::with_states(make(), rows, SlotPool::without_magazines(shape.states), config)
        .map_err(|e| e.to_string())?;
    let model = ReferenceMambaCache::new(make(), SlotPool::without_magazines(shape.states), shape.policy)
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
    check("free KV at the end", end, c.allocator().available_size(), shape.pages * ps)?;
    check("free states at the end", end, c.states().available(), shape.states as usize)?;
    check("the cache's holders at the end", end, Arc::strong_count(c), 1)
}

impl Run {
    fn snapshot(&self) -> Snapshot {
        let c = &self.cache;
        (
            (c.allocator().available_size(), c.states().available(), c.req_pool().available_size()),
            (c.total_size(), c.evictable_size(), c.protected_size()),
            (c.mamba_evictable_size(), c.mamba_protected_size(), c.node_count()),
            c.leaf_paths(),
        )
    }

    /// Check that a refusal changed nothing, in the cache or in request `i`.
    fn unchanged(&self, before: &Snapshot, i: Option<usize>, what: &str, step: usize) -> Result<(), String> {
        check(&format!("{what}: refused, nothing changed"), step, &self.snapshot(), before)?;
        if let Some(o) = i.map(|i| &self.open[i]) {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots(), o.req.state());
            let want = (o.kv.len(), o.ref_protected, &o.ref_kv[..], o.running);
            check(&format!("{what}: refused, the request unchanged"), step, got, want)?;
        }
        Ok(())
    }

    fn apply(&mut self, op: &MambaOp, step: usize) -> Result<(), String> {
        let ps = self.shape.page_size;
        let pick = |which: u8, len: usize| (len > 0).then(|| which as usize % len);
        match op {
            MambaOp::Start { key, ns, prefill } => {
                let Some(i) = self.admit(key, *ns, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                let n = if prefill % 4 == 0 { (prefill / 4) as usize % (rest + 1) } else { rest };
                if !self.extend(i, n, 0, step)? {
                    self.abort(i, step % 2 == 0);
                }
            }
            MambaOp::Extend { req, n, seed } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.extend(i, *n as usize % 8, *seed, step)?;
            }
            MambaOp::Decode { mask, token } => self.decode(*mask, *token, step)?,
            MambaOp::SaveState { req, at } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                let len = self.open[i].kv.len();
                let pos = (at & 0x7f) as usize % (len / ps + 2) * ps;
                if at & 0x80 != 0 && ps > 1 {
                    let before = self.snapshot();
                    match self.open[i].req.save_state(pos + 1) {
                        Err(AllocError::Invalid(_)) => {
                            self.unchanged(&before, Some(i), "a state saved mid-page", step)?
                        }
                        other => return Err(format!("step {step}: a state saved mid-page gave {other:?}")),
                    }
                }
                self.save_state(i, pos, step)?;
            }
            MambaOp::Checkpoint { req, at } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                let whole = self.open[i].kv.len() / ps * ps;
                let c = if at % 2 == 0 {
                    self.save_state(i, whole, step)?;
                    whole
                } else {
                    self.open[i].saved.map_or(whole, |(at, _)| at)
                };
                self.checkpoint(i, c, step)?;
            }
            MambaOp::Finish { req, cut, miscount } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                let (len, n) = (self.open[i].kv.len(), self.open[i].req.cached_len());
                // A page boundary from the lock to the request's end, or what was saved.
                let boundaries = (len - n) / ps + 1;
                let k = *cut as usize % (boundaries + 1);
                if k < boundaries {
                    self.save_state(i, n + k * ps, step)?;
                }
                self.finish(i, *miscount, step)?;
            }
            MambaOp::Abort { req, drop } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.abort(i, *drop);
            }
            MambaOp::Serve { key, ns } => {
                let Some(i) = self.admit(key, *ns, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                if !self.extend(i, rest, 0, step)? {
                    self.abort(i, false);
                    return Ok(());
                }
                self.save_state(i, self.open[i].kv.len() / ps * ps, step)?;
                if let Some(i) = self.finish(i, 0, step)? {
                    self.abort(i, true);
                }
            }
            MambaOp::Match { key, ns } => {
                let t = tokens(key, ps);
                let mut out = vec![0u32; t.len()];
                let m = self.cache.match_prefix(cache_key(*ns).tree_key(&t).0, &t, &mut out);
                let rm = self.model.match_prefix(*ns as u64, &t);
                check("match", step, &out[..m.len()], &rm.slots[..rm.len])?;
            }
            MambaOp::Peek { key, ns } => {
                let t = tokens(key, ps);
                let mut out = vec![0u32; t.len()];
                let n = self.cache.peek_prefix(cache_key(*ns).tree_key(&t).0, &t, &mut out);
                check("peek", step, &out[..n], &self.model.peek(*ns as u64, &t)[..])?;
            }
            MambaOp::Evict { n } => {
                check("evict", step, self.cache.evict(*n as usize), self.model.evict(*n as usize))?;
            }
            MambaOp::EvictMamba { n } => {
                let n = *n as usize % 4;
                check("evict_mamba", step, self.cache.evict_mamba(n), self.model.evict_mamba(n))?;
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
        let got = self.cache.admit(key, &prompt);
        let ns = ns as u64;
        let rm = self.model.match_and_lock(ns, &prompt);
        let Some(running) = self.model.alloc_state() else {
            self.model.unlock(rm.node);
            return match got {
                Err(AllocError::OutOfMemory(_)) => Ok(None),
                other => Err(format!("step {step}: admission without a free state gave {other:?}")),
            };
        };
        let req = got.map_err(|e| format!("step {step}: admit: {e}"))?;
        let branching = self.cache.checkpoint_config().branching_len(rm.kv_len, rm.len);
        let h = rm.len;
        check(
            "admit: (lock, resume state, KV hit, branching length, row, running state)",
            step,
            (req.cached_len(), req.resume_state(), req.kv_hit(), req.branching_len(), req.slots(), req.state()),
            (h, rm.state, rm.kv_len, branching, &rm.slots[..h], running),
        )?;
        // The KV cached past the lock, read without changing anything (the running
        // state's allocation may have evicted some of what the match found).
        let mut out = vec![0u32; prompt.len()];
        let n = self.cache.peek_prefix(req.namespace(), &prompt, &mut out);
        check("admit: KV cached", step, &out[..n], &self.model.peek(ns, &prompt)[..])?;
        let kv = prompt[..h].to_vec();
        let ref_kv = rm.slots[..h].to_vec();
        let o = Open {
            req,
            ns,
            prompt,
            kv,
            ref_kv,
            ref_node: rm.node,
            ref_protected: h,
            running,
            saved: None,
            admitted: true,
        };
        self.open.push(o);
        Ok(Some(self.open.len() - 1))
    }

    /// `extend(n)` of open request `i` on both sides; whether it allocated.
    fn extend(&mut self, i: usize, n: usize, seed: u8, step: usize) -> Result<bool, String> {
        let from = self.open[i].kv.len();
        if from + n > ROW {
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
        let (prefix, seq) = ([from as u32], [(from + n) as u32]);
        let last = o.ref_kv.last().copied().unwrap_or(0);
        let m = &mut self.model;
        let need = m.allocator().extend_need(&prefix, &seq).map_err(|e| e.to_string())?;
        let avail = m.allocator().available_size();
        if avail < need && need - avail <= m.evictable_size() {
            m.evict(need - avail);
        }
        let mut new = vec![0u32; n];
        let want = m.allocator().alloc_extend(&prefix, &seq, &[last], &mut new);
        check("extend ok", step, got.is_ok(), want.is_ok())?;
        if want.is_err() {
            return Ok(false);
        }
        check("extend: new KV slots", step, &o.req.slots()[from..], &new[..])?;
        o.ref_kv.extend_from_slice(&new);
        for pos in from..from + n {
            o.kv.push(next_token(&o.prompt, pos, seed));
        }
        Ok(true)
    }

    fn decode(&mut self, mask: u8, token: u8, step: usize) -> Result<(), String> {
        let picked: Vec<usize> = (0..self.open.len()).filter(|i| mask >> (i % 8) & 1 == 1).collect();
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
        let seq: Vec<u32> = picked.iter().map(|&i| self.open[i].kv.len() as u32 + 1).collect();
        let last: Vec<u32> = picked.iter().map(|&i| self.open[i].ref_kv.last().copied().unwrap_or(0)).collect();
        let m = &mut self.model;
        let need = m.allocator().decode_need(&seq).map_err(|e| e.to_string())?;
        let avail = m.allocator().available_size();
        if avail < need && need - avail <= m.evictable_size() {
            m.evict(need - avail);
        }
        let mut want = vec![0u32; picked.len()];
        let ok = m.allocator().alloc_decode(&seq, &last, &mut want).is_ok();
        check("decode ok", step, got.is_ok(), ok)?;
        if !ok {
            return Ok(());
        }
        check("decode slots", step, &out, &want)?;
        for (k, &i) in picked.iter().enumerate() {
            let o = &mut self.open[i];
            let pos = o.kv.len();
            o.kv.push(next_token(&o.prompt, pos, token.wrapping_add(k as u8)));
            o.ref_kv.push(want[k]);
        }
        Ok(())
    }

    /// `save_state(at)` of open request `i` (a whole number of pages) on both sides.
    fn save_state(&mut self, i: usize, at: usize, step: usize) -> Result<(), String> {
        let got = self.open[i].req.save_state(at);
        let o = &mut self.open[i];
        let want = match o.saved {
            Some((_, slot)) => Some(slot),
            None => self.model.alloc_state(),
        };
        check("save_state", step, got.as_ref().ok(), want.as_ref())?;
        if let Some(slot) = want {
            o.saved = Some((at, slot));
        }
        Ok(())
    }

    /// `checkpoint` of open request `i`'s first `c` tokens on both sides.
    fn checkpoint(&mut self, i: usize, c: usize, step: usize) -> Result<(), String> {
        let o = &self.open[i];
        let (len, n) = (o.kv.len(), o.req.cached_len());
        let kv: Vec<u32> = o.kv.iter().copied().chain(std::iter::repeat(0)).take(c).collect();
        let refused = if c > len {
            Some(Err(CacheError::TokenCount { tokens: c, held: len }))
        } else if c <= n {
            Some(Ok(())) // nothing past the lock: nothing to do
        } else if o.saved.map(|(at, _)| at) != Some(c) {
            Some(Err(CacheError::SavedState { at: o.saved.map(|(at, _)| at), up_to: c }))
        } else {
            None
        };
        if let Some(want) = refused {
            let before = self.snapshot();
            check("checkpoint that caches nothing", step, self.open[i].req.checkpoint(&kv), want)?;
            return self.unchanged(&before, Some(i), "checkpoint that caches nothing", step);
        }
        let o = &mut self.open[i];
        o.req.checkpoint(&kv).map_err(|e| format!("step {step}: checkpoint: {e}"))?;
        let (_, state) = o.saved.take().expect("checked above");
        let (_, len, node) = self
            .model
            .cache_unfinished_req(o.ns, &kv, &mut o.ref_kv, o.ref_protected, o.ref_node, state)
            .map_err(|e| format!("step {step}: model checkpoint: {e}"))?;
        (o.ref_protected, o.ref_node, o.admitted) = (len, node, false);
        check("checkpoint: lock and row", step, (o.req.cached_len(), o.req.slots()), (len, &o.ref_kv[..]))
    }

    /// Finish open request `i` (after a wrong count first, when `miscount` says so).
    /// `Some(index)` when the contract refused the correct finish too (its state saved
    /// past its tokens), the request open again at that index.
    fn finish(&mut self, i: usize, miscount: u8, step: usize) -> Result<Option<usize>, String> {
        let len = self.open[i].kv.len();
        let wrong = match miscount % 3 {
            1 if len > 0 => Some(self.open[i].kv[..len - 1].to_vec()),
            2 => Some(self.open[i].kv.iter().copied().chain([0]).collect()),
            _ => None,
        };
        let saved_past = self.open[i].saved.filter(|&(at, _)| at > len);
        for (tokens, want) in wrong
            .map(|w| (w.len(), CacheError::TokenCount { tokens: w.len(), held: len }))
            .into_iter()
            .chain(saved_past.map(|(at, _)| (len, CacheError::SavedState { at: Some(at), up_to: len })))
        {
            let before = self.snapshot();
            let mut o = self.open.remove(i);
            let t: Vec<u32> = o.kv.iter().copied().chain([0]).take(tokens).collect();
            let Err(refused) = o.req.finish(&t) else {
                return Err(format!("step {step}: a finish that had to be refused ({want}) was accepted"));
            };
            check("refused finish", step, &refused.error, &want)?;
            o.req = refused.request;
            self.open.insert(i, o);
            self.unchanged(&before, Some(i), "refused finish", step)?;
        }
        if saved_past.is_some() {
            return Ok(Some(i));
        }
        let o = self.open.remove(i);
        let got = o.req.finish(&o.kv).map_err(|r| format!("step {step}: finish: {}", r.error))?;
        let m = &mut self.model;
        let n = o.ref_protected;
        let want = match o.saved {
            None => {
                // Nothing saved: nothing new is cached; its own KV and its lock go back.
                m.allocator().free(&o.ref_kv[n..]).map_err(|e| e.to_string())?;
                m.unlock(o.ref_node);
                StateInsert { cached: n, state_kept: false }
            }
            Some((at, state)) => {
                // Cached up to the saved state (never short of the lock); the KV past it
                // goes back.
                let c = at.max(n);
                m.allocator().free(&o.ref_kv[c..]).map_err(|e| e.to_string())?;
                m.cache_finished_req(o.ns, &o.kv[..c], &o.ref_kv[..c], n, o.ref_node, state)
                    .map_err(|e| format!("step {step}: model finish: {e}"))?
            }
        };
        m.states().free(&[o.running]).map_err(|e| e.to_string())?;
        check("finish", step, got, want)?;
        Ok(None)
    }

    fn abort(&mut self, i: usize, drop_it: bool) {
        let Open { req, ref_kv, ref_protected, ref_node, running, saved, .. } = self.open.remove(i);
        if drop_it {
            drop(req);
        } else {
            req.abort();
        }
        let m = &mut self.model;
        m.allocator().free(&ref_kv[ref_protected..]).expect("a model request owns its KV");
        m.unlock(ref_node);
        m.states().free(&[running]).expect("a model request owns its running state");
        if let Some((_, s)) = saved {
            m.states().free(&[s]).expect("a model request owns its saved state");
        }
    }

    /// The O(1)-ish part of [`compare`](Self::compare): sizes, free space, free rows,
    /// node count, and the accounting.
    fn compare_sizes(&self, step: usize) -> Result<(), String> {
        let (c, m) = (&self.cache, &self.model);
        let got = (
            (c.total_size(), c.evictable_size(), c.protected_size()),
            (c.mamba_evictable_size(), c.mamba_protected_size()),
            (c.allocator().available_size(), c.states().available(), c.node_count()),
        );
        let want = (
            (m.total_size(), m.evictable_size(), m.protected_size()),
            (m.mamba_evictable_size(), m.mamba_protected_size()),
            (m.allocator().available_size(), m.states().available(), m.node_count()),
        );
        check(
            "sizes ((total, evictable, protected), states (evictable, protected), (free KV, free states, nodes))",
            step,
            got,
            want,
        )?;
        check("free rows", step, c.req_pool().available_size(), MAX_REQS - self.open.len())?;
        check("the cache's holders", step, Arc::strong_count(c), 1 + self.open.len())?;
        let ps = self.shape.page_size;
        let held: usize = self.open.iter().map(|o| o.kv.len().next_multiple_of(ps) - o.ref_protected).sum();
        let total = c.allocator().available_size() + c.total_size() + held;
        check("free + cached + held", step, total, self.shape.pages * ps)
    }

    fn compare(&self, step: usize) -> Result<(), String> {
        let (c, m, shape) = (&self.cache, &self.model, self.shape);
        c.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
        m.check().map_err(|e| format!("step {step}: {e}"))?;
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
        check("leaf paths", step, &mapped, &m.leaf_paths())?;
        // Every state slot is the tree's, an open request's (running or saved), or free: on both sides the same.
        let mut expected: Vec<u32> = m.held_states();
        for o in &self.open {
            expected.push(o.running);
            expected.extend(o.saved.map(|(_, s)| s));
        }
        expected.sort_unstable();
        let allocated = |is: &dyn Fn(u32) -> bool| (1..=shape.states).filter(|&s| is(s)).collect::<Vec<_>>();
        check("allocated states", step, allocated(&|s| c.states().is_allocated(s)), expected.clone())?;
        check("model's allocated states", step, allocated(&|s| m.states().is_allocated(s)), expected)?;
        // The tree's own states are exactly those the cache marks as held.
        let mut tree: Vec<u32> = m.held_states();
        tree.sort_unstable();
        check("tree-held states", step, allocated(&|s| c.states().is_held(s)), tree)?;
        for o in &self.open {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots(), o.req.state());
            check(
                "request: length, lock, row, state",
                step,
                got,
                (o.kv.len(), o.ref_protected, &o.ref_kv[..], o.running),
            )?;
            if o.admitted {
                check("request: the state its lock ends at", step, o.req.resume_state(), m.state_of(o.ref_node))?;
            }
        }
        // Every KV page owned exactly once: tree, one open request, free pool.
        let ps = shape.page_size;
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
        check("pages owned + free", step, owned + c.allocator().available_size() / ps, shape.pages)
    }
}
