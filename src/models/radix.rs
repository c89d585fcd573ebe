//! [`RadixCache`] against [`ReferenceRadixCache`], operation by operation.
//!
//! kvpool's side runs every request through the engine contract, a
//! [`Request`] handle: admission, prefill chunks, decode batches,
//! checkpoints, finishes and aborts. The reference side runs SGLang's calls on the
//! simple tree (match and lock, allocate, `cache_finished_req`,
//! `cache_unfinished_req`, free and unlock).
//!
//! Each side has its own allocator of the same shape; since both allocators hand out
//! the lowest free pages (a page-size-1 decode continues each request's run on both)
//! and the caches free the same pages in the same order, the two sides must agree on
//! every slot number, not just on lengths. After every operation the driver compares
//! the op's own result (hit slots, new slots, decode slots, cached prefix lengths,
//! evicted counts), the sizes, free space, free request rows, the node count and the
//! accounting (free + cached + the pages open requests hold = capacity). Every
//! `full_every` steps, after the last step and after the teardown it also compares the
//! canonical leaf paths, each open request's row, lock and length, runs
//! `check_invariants()` (which checks the same accounting from the inside), and checks
//! that every page is owned exactly once: by the tree, by one open request, or by the
//! free pool.
//!
//! Refusals the contract promises are checked against a snapshot of the cache (sizes,
//! free space and rows, node count, leaf paths) and of the request: a finish with one
//! token more or fewer than the request holds ([`CacheError::TokenCount`]), a bigram
//! request's finish with no token past its lock, a checkpoint past what it holds, an
//! extend or decode past the end of a row, a decode whose output length is not the
//! batch's, an admission without a free row, a reset while a request is open. A
//! checkpoint that reaches no further than the request's lock must change nothing
//! either.
//!
//! Requests are cached under a [`CacheKey`] picked by a `tenant` byte (see
//! [`cache_key`]): an extra key, a cache salt, an EAGLE bigram key. The reference tree
//! models each key as its own namespace (a bigram key's with the prompt's first token,
//! its tree key the tokens after it), so a request that hit KV cached under another
//! salt or extra key would disagree with it; the driver also checks that kvpool gives
//! two keys the same namespace exactly when the reference does.
//!
//! [`RadixOp::Reset`] needs the cache by `&mut`: the driver holds it in an [`Arc`], as
//! every open request does, so [`Arc::get_mut`] succeeds exactly when no request is
//! open. A reset with requests open is refused (nothing changes, on either side);
//! otherwise it must succeed, and both trees are emptied.
//!
//! [`run_with`] lets the fuzz target do the O(tree) part of that comparison (leaf
//! paths, invariants, rows, page owners) only every few steps and after the last one;
//! the O(1) part and each operation's own result are still compared at every step.

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::{RefNodeId, ReferenceRadixCache};
use crate::radix::{CacheError, CacheKey, EvictionPolicy, RadixCache, RadixConfig, Request};
use crate::{AllocError, KvAllocator, PagedAllocator, ReqToTokenPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest prompt.
const MAX_KEY: usize = 24;
/// Open requests at most (the cache's request rows).
const MAX_REQS: usize = 6;
/// Tokens a request row holds.
const ROW: usize = 32;
/// How many ops the `radix_ops` fuzz target reads from one input (short sequences,
/// many executions, see RELIABILITY.md).
pub const MAX_FUZZ_OPS: usize = 8;
/// How often the `radix_ops` fuzz target runs the full O(tree) comparison: every
/// `FUZZ_FULL_CHECK_EVERY` steps, after the last step and after the final teardown.
/// Equal to [`MAX_FUZZ_OPS`]: once at the end of the sequence and once after the
/// teardown (a crash replayed with [`run`] names the first bad step).
pub const FUZZ_FULL_CHECK_EVERY: usize = MAX_FUZZ_OPS;

/// One step of a radix-cache model run. `req` picks an open request (modulo their
/// number; an op with none to pick does nothing); `tenant` picks a [`CacheKey`] (see
/// [`cache_key`]).
#[derive(Arbitrary, Debug, Clone)]
pub enum RadixOp {
    /// A request arrives: `admit` (a row, the longest cached prefix, locked), then
    /// `extend` by the rest of its prompt, or (one time in four) by `prefill / 4`
    /// modulo one more than the rest: a chunk, or nothing yet. An allocation that fails
    /// aborts it. With every row taken, the admission must be refused.
    Start {
        /// Token seeds of the prompt.
        key: Vec<u8>,
        /// The cache key.
        tenant: u8,
        /// How much of the prompt to allocate now.
        prefill: u8,
    },
    /// An open request allocates its next `n % 12` tokens (`extend`): the rest of its
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
    /// set in `mask`, outputs from `token`. With `token`'s top bit set, the call with
    /// one output slot too many comes first and must be refused.
    Decode {
        /// Which open requests.
        mask: u8,
        /// Output tokens.
        token: u8,
    },
    /// An open request caches its first `cut % (len + 2)` tokens and keeps running
    /// (`checkpoint`; `len + 1` is past what it holds and must be refused).
    Checkpoint {
        /// Which open request.
        req: u8,
        /// How far.
        cut: u8,
    },
    /// An open request finishes (`finish`) with priority `prio`. `miscount % 3` of 1
    /// or 2 first finishes with one token fewer or one more than it holds, which must
    /// be refused with [`CacheError::TokenCount`], nothing changed.
    Finish {
        /// Which open request.
        req: u8,
        /// Insert priority.
        prio: i8,
        /// A wrong token count first.
        miscount: u8,
    },
    /// An open request is aborted (`abort`), or dropped when `drop`: its own slots
    /// and its row go back, its lock is released.
    Abort {
        /// Which open request.
        req: u8,
        /// Drop the handle instead of calling `abort`.
        drop: bool,
    },
    /// A request admitted, prefilled and finished at once with priority `prio` (what a
    /// direct insert of fresh slots is to the contract).
    Serve {
        /// Token seeds of the prompt.
        key: Vec<u8>,
        /// The cache key.
        tenant: u8,
        /// Insert priority.
        prio: i8,
    },
    /// SGLang's match (touches, may split), without locking, of a key's tree key.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// The cache key.
        tenant: u8,
    },
    /// The lock-free read-only lookup of a key's tree key.
    Peek {
        /// Token seeds.
        key: Vec<u8>,
        /// The cache key.
        tenant: u8,
    },
    /// Evict at least `n` tokens.
    Evict {
        /// Tokens to free.
        n: u8,
    },
    /// `reset`, through [`Arc::get_mut`]: refused (nothing changes) while a request is
    /// open, since every request holds the cache's `Arc`; otherwise both trees are
    /// emptied.
    Reset,
}

/// The cache keys requests use: the default key, extra key 1, salts 1 and 2, an EAGLE
/// bigram key, and a bigram key with salt 1.
pub const KEYS: [CacheKey; 6] = [
    CacheKey { extra: 0, salt: 0, bigram: false },
    CacheKey { extra: 1, salt: 0, bigram: false },
    CacheKey { extra: 0, salt: 1, bigram: false },
    CacheKey { extra: 0, salt: 2, bigram: false },
    CacheKey { extra: 0, salt: 0, bigram: true },
    CacheKey { extra: 0, salt: 1, bigram: true },
];

/// The cache key a `tenant` byte names: the default key unless its two low bits are
/// both set (one byte in four); then one of the other five [`KEYS`], by the rest of the
/// byte modulo 5.
///
/// # Examples
///
/// ```
/// use kvpool::models::radix::{cache_key, KEYS};
/// use kvpool::radix::CacheKey;
/// assert_eq!(cache_key(0b0110), CacheKey::default());
/// assert_eq!(cache_key(0b0011), KEYS[1]);
/// assert_eq!(cache_key(0b1111), CacheKey { extra: 0, salt: 0, bigram: true });
/// ```
pub fn cache_key(tenant: u8) -> CacheKey {
    if tenant & 3 != 3 {
        return KEYS[0];
    }
    KEYS[1 + (tenant >> 2) as usize % 5]
}

/// The reference tree's namespace for a key: one per extra key, salt and (for a
/// bigram key) first token.
fn ref_namespace(key: CacheKey, tokens: &[u32]) -> u64 {
    let bigram = if key.bigram { tokens.first().map_or(1 << 33, |&t| 1 + u64::from(t)) } else { 0 };
    key.extra + 2 * key.salt + 6 * bigram
}

/// The tokens the tree keys a request's KV by: with a bigram key, the tokens after the
/// first (position `i` is keyed by token `i + 1`).
fn tree(tokens: &[u32], bigram: bool) -> &[u32] {
    if bigram {
        tokens.get(1..).unwrap_or(&[])
    } else {
        tokens
    }
}

/// An open request: kvpool's handle and the reference's view of the same request.
struct Open {
    req: Request<PagedAllocator>,
    bigram: bool,
    ref_ns: u64,
    prompt: Vec<u32>,
    /// The tokens whose KV the row holds (`req.len()` of them).
    kv: Vec<u32>,
    /// The reference's slots for them.
    ref_kv: Vec<u32>,
    ref_node: RefNodeId,
    ref_protected: usize,
    prio: i64,
}

/// Free space, the three sizes, free rows, nodes and the cached paths.
type Snapshot = (usize, usize, usize, usize, usize, usize, Vec<(u64, Vec<u32>, Vec<u32>)>);

struct Run {
    cache: Arc<RadixCache<PagedAllocator>>,
    reference: ReferenceRadixCache<PagedAllocator>,
    open: Vec<Open>,
    /// kvpool's namespace of each reference namespace seen.
    namespaces: Vec<(u64, u64)>,
    ps: usize,
    pages: usize,
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
fn batch(open: &mut [Open], mask: u8) -> Vec<&mut Request<PagedAllocator>> {
    open.iter_mut().enumerate().filter(|(i, _)| mask >> (i % 8) & 1 == 1).map(|(_, o)| &mut o.req).collect()
}

fn check<T: PartialEq + std::fmt::Debug>(what: &str, step: usize, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("step {step}: {what}: kvpool {got:?}, reference {want:?}"))
    }
}

/// Run `ops` on a cache of `pages` pages of `page_size` tokens (both clamped to small
/// ranges) with `policy`, comparing with the reference after every step.
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run(page_size: u8, pages: u8, policy: u8, ops: &[RadixOp]) -> Result<(), String> {
    run_with(page_size, pages, policy, ops, 1)
}

/// The `radix_ops` fuzz target's reading of its input: three header bytes (page size,
/// pages, policy), then at most `max_ops` ops (bytes past them are ignored). Any bytes
/// work.
///
/// # Examples
///
/// ```
/// use kvpool::models::radix::{from_fuzz_input, run};
/// let (ps, pages, policy, ops) = from_fuzz_input(b"any bytes at all: 0123456789abcdef", 8);
/// assert!(ops.len() <= 8);
/// run(ps, pages, policy, &ops)?;
/// # Ok::<(), String>(())
/// ```
pub fn from_fuzz_input(bytes: &[u8], max_ops: usize) -> (u8, u8, u8, Vec<RadixOp>) {
    let mut u = Unstructured::new(bytes);
    let mut byte = || u8::arbitrary(&mut u).unwrap_or(0);
    let (page_size, pages, policy) = (byte(), byte(), byte());
    let mut ops = Vec::new();
    while ops.len() < max_ops && !u.is_empty() {
        match RadixOp::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    (page_size, pages, policy, ops)
}

/// [`run`], with the full O(tree) comparison (leaf paths, `check_invariants()`, rows,
/// page owners) after every `full_every`-th step, after the last step and after the
/// teardown; sizes, free space, rows, node counts and the accounting are compared after
/// every step. `run` is `run_with(.., 1)`.
///
/// # Errors
///
/// The first disagreement or broken invariant, described.
pub fn run_with(page_size: u8, pages: u8, policy: u8, ops: &[RadixOp], full_every: usize) -> Result<(), String> {
    let full_every = full_every.max(1);
    let ps = [1u32, 2, 4][page_size as usize % 3] as usize;
    let pages = 4 + pages as usize % 28;
    let policy = EvictionPolicy::ALL[policy as usize % EvictionPolicy::ALL.len()];
    let make = || PagedAllocator::new(pages * ps, ps as u32).expect("small allocator");
    let config = RadixConfig { policy, event_capacity: None, ..RadixConfig::default() };
    let rows = ReqToTokenPool::new(MAX_REQS as u32, ROW).map_err(|e| e.to_string())?;
    let cache = Arc::new(RadixCache::new(make(), rows, config).map_err(|e| e.to_string())?);
    let reference = ReferenceRadixCache::new(make(), policy).map_err(|e| e.to_string())?;
    let mut run = Run { cache, reference, open: Vec::new(), namespaces: Vec::new(), ps, pages };
    for (step, op) in ops.iter().enumerate() {
        run.apply(op, step)?;
        if (step + 1) % full_every == 0 || step + 1 == ops.len() {
            run.compare(step)?;
        } else {
            run.compare_sizes(step)?;
        }
    }
    // Abort everything, then evict everything: the pool must be whole again.
    let end = ops.len();
    while !run.open.is_empty() {
        run.abort(run.open.len() - 1, end % 2 == 0);
    }
    check("evict all", end, run.cache.evict(usize::MAX), run.reference.evict(usize::MAX))?;
    run.compare(end)?;
    check("free tokens at the end", end, run.cache.allocator().available_size(), pages * ps)?;
    check("the cache's holders at the end", end, Arc::strong_count(&run.cache), 1)
}

impl Run {
    /// kvpool's and the reference's namespace for `key`'s `tokens`, checking that kvpool
    /// gives two keys one namespace exactly when the reference does.
    fn namespace(&mut self, key: CacheKey, tokens: &[u32], step: usize) -> Result<(u64, u64), String> {
        let (ns, _) = key.tree_key(tokens);
        let ref_ns = ref_namespace(key, tokens);
        match self.namespaces.iter().find(|&&(n, r)| n == ns || r == ref_ns) {
            Some(&(n, r)) if (n, r) != (ns, ref_ns) => {
                Err(format!("step {step}: {key:?} has namespace {ns}, which is {n} for reference namespace {r}"))
            }
            Some(_) => Ok((ns, ref_ns)),
            None => {
                self.namespaces.push((ns, ref_ns));
                Ok((ns, ref_ns))
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        let c = &self.cache;
        (
            c.allocator().available_size(),
            c.total_size(),
            c.evictable_size(),
            c.protected_size(),
            c.req_pool().available_size(),
            c.node_count(),
            c.leaf_paths(),
        )
    }

    /// Check that a refusal changed nothing, in the cache or in request `i`.
    fn unchanged(&self, before: &Snapshot, i: Option<usize>, what: &str, step: usize) -> Result<(), String> {
        check(&format!("{what}: refused, nothing changed"), step, &self.snapshot(), before)?;
        if let Some(o) = i.map(|i| &self.open[i]) {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots());
            let want = (o.kv.len(), o.ref_protected, &o.ref_kv[..]);
            check(&format!("{what}: refused, the request unchanged"), step, got, want)?;
        }
        Ok(())
    }

    fn apply(&mut self, op: &RadixOp, step: usize) -> Result<(), String> {
        let ps = self.ps;
        let pick = |req: u8, open: usize| (open > 0).then(|| req as usize % open);
        match op {
            RadixOp::Start { key, tenant, prefill } => {
                let Some(i) = self.admit(key, *tenant, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                let n = if prefill % 4 == 0 { (prefill / 4) as usize % (rest + 1) } else { rest };
                if !self.extend(i, n, 0, step)? {
                    self.abort(i, step % 2 == 0);
                }
            }
            RadixOp::Extend { req, n, seed } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.extend(i, *n as usize % 12, *seed, step)?;
            }
            RadixOp::Decode { mask, token } => self.decode(*mask, *token, step)?,
            RadixOp::Checkpoint { req, cut } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.checkpoint(i, *cut, step)?;
            }
            RadixOp::Finish { req, prio, miscount } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.finish(i, *prio as i64, *miscount, step)?;
            }
            RadixOp::Abort { req, drop } => {
                let Some(i) = pick(*req, self.open.len()) else { return Ok(()) };
                self.abort(i, *drop);
            }
            RadixOp::Serve { key, tenant, prio } => {
                let Some(i) = self.admit(key, *tenant, step)? else { return Ok(()) };
                let rest = self.open[i].prompt.len() - self.open[i].kv.len();
                if self.extend(i, rest, 0, step)? {
                    if let Some(i) = self.finish(i, *prio as i64, 0, step)? {
                        self.abort(i, false);
                    }
                } else {
                    self.abort(i, true);
                }
            }
            RadixOp::Match { key, tenant } => {
                let key_ = cache_key(*tenant);
                let t = tokens(key, ps);
                let (ns, ref_ns) = self.namespace(key_, &t, step)?;
                let t = tree(&t, key_.bigram);
                let mut out = vec![0u32; t.len()];
                let m = self.cache.match_prefix(ns, t, &mut out);
                let (v, _) = self.reference.match_prefix(ref_ns, t);
                check("match", step, &out[..m.len()], &v[..])?;
            }
            RadixOp::Peek { key, tenant } => {
                let key_ = cache_key(*tenant);
                let t = tokens(key, ps);
                let (ns, ref_ns) = self.namespace(key_, &t, step)?;
                let t = tree(&t, key_.bigram);
                let mut out = vec![0u32; t.len()];
                let n = self.cache.peek_prefix(ns, t, &mut out);
                // The reference has no read-only match: compare against its leaf paths.
                let best = self
                    .reference
                    .leaf_paths()
                    .into_iter()
                    .filter(|(pns, _, _)| *pns == ref_ns)
                    .map(|(_, k, v)| {
                        let common = k.iter().zip(t).take_while(|(a, b)| a == b).count() / ps * ps;
                        (common, v)
                    })
                    .max_by_key(|(c, _)| *c);
                let (len, slots) = best.map_or((0, vec![]), |(c, v)| (c, v[..c].to_vec()));
                check("peek", step, (n, &out[..n]), (len, &slots[..]))?;
            }
            RadixOp::Evict { n } => {
                let a = self.cache.evict(*n as usize);
                let b = self.reference.evict(*n as usize);
                check("evict", step, a, b)?;
            }
            RadixOp::Reset => {
                let before = self.snapshot();
                let open = self.open.len();
                match Arc::get_mut(&mut self.cache) {
                    Some(cache) if open == 0 => {
                        cache.reset().map_err(|e| format!("step {step}: reset with no request open: {e}"))?;
                        self.reference.reset();
                    }
                    None if open > 0 => self.unchanged(&before, None, "reset with requests open", step)?,
                    other => {
                        let got = other.is_some();
                        return Err(format!("step {step}: exclusive access {got} with {open} requests open"));
                    }
                }
            }
        }
        Ok(())
    }

    /// Admit a request for `seeds` under `tenant`'s key on both sides; its index, or
    /// `None` when it was (rightly) refused or is not made (an empty bigram prompt).
    fn admit(&mut self, seeds: &[u8], tenant: u8, step: usize) -> Result<Option<usize>, String> {
        let key = cache_key(tenant);
        let prompt = tokens(seeds, self.ps);
        if key.bigram && prompt.is_empty() {
            return Ok(None);
        }
        let (ns, ref_ns) = self.namespace(key, &prompt, step)?;
        if self.open.len() == MAX_REQS {
            let before = self.snapshot();
            match self.cache.admit(key, &prompt) {
                Err(AllocError::OutOfMemory(_)) => self.unchanged(&before, None, "admission without a row", step)?,
                other => return Err(format!("step {step}: admission with every row taken gave {other:?}")),
            }
            return Ok(None);
        }
        let req = self.cache.admit(key, &prompt).map_err(|e| format!("step {step}: admit: {e}"))?;
        let (hit, node) = self.reference.match_prefix(ref_ns, tree(&prompt, key.bigram));
        self.reference.inc_lock_ref(node);
        let h = hit.len();
        let got = (req.cached_len(), req.len(), req.slots(), req.namespace(), req.prompt_len());
        check("admit: hit, row, namespace", step, got, (h, h, &hit[..], ns, prompt.len()))?;
        let kv = prompt[..h].to_vec();
        let bigram = key.bigram;
        let o = Open { req, bigram, ref_ns, prompt, kv, ref_kv: hit, ref_node: node, ref_protected: h, prio: 0 };
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
        // The reference: evict the shortfall (unless it is past what is evictable: the
        // allocation fails then, and nothing is evicted for it), then allocate.
        let (prefix, seq) = ([from as u32], [(from + n) as u32]);
        let last = o.ref_kv.last().copied().unwrap_or(0);
        let r = &mut self.reference;
        let need = r.allocator().extend_need(&prefix, &seq).map_err(|e| e.to_string())?;
        let avail = r.allocator().available_size();
        if avail < need && need - avail <= r.evictable_size() {
            r.evict(need - avail);
        }
        let mut new = vec![0u32; n];
        let want = r.allocator().alloc_extend(&prefix, &seq, &[last], &mut new);
        check("extend ok", step, got.is_ok(), want.is_ok())?;
        if want.is_err() {
            return Ok(false);
        }
        check("extend: new slots", step, &o.req.slots()[from..], &new[..])?;
        o.ref_kv.extend_from_slice(&new);
        for pos in from..from + n {
            o.kv.push(next_token(&o.prompt, pos, seed));
        }
        Ok(true)
    }

    fn decode(&mut self, mask: u8, token: u8, step: usize) -> Result<(), String> {
        let picked: Vec<usize> = (0..self.open.len()).filter(|i| mask >> (i % 8) & 1 == 1).collect();
        if token & 0x80 != 0 && !picked.is_empty() {
            let before = self.snapshot();
            let mut out = vec![0u32; picked.len() + 1];
            match self.cache.decode(&mut batch(&mut self.open, mask), &mut out) {
                Err(AllocError::Invalid(_)) => {}
                other => return Err(format!("step {step}: a decode with a wrong output length gave {other:?}")),
            }
            for &i in &picked {
                self.unchanged(&before, Some(i), "decode with a wrong output length", step)?;
            }
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
        let seq: Vec<u32> = picked.iter().map(|&i| self.open[i].kv.len() as u32 + 1).collect();
        let last: Vec<u32> = picked.iter().map(|&i| self.open[i].ref_kv.last().copied().unwrap_or(0)).collect();
        let r = &mut self.reference;
        let need = r.allocator().decode_need(&seq).map_err(|e| e.to_string())?;
        let avail = r.allocator().available_size();
        if avail < need && need - avail <= r.evictable_size() {
            r.evict(need - avail);
        }
        let mut want = vec![0u32; picked.len()];
        let ok = r.allocator().alloc_decode(&seq, &last, &mut want).is_ok();
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
            check(
                "decode: the request's last slot",
                step,
                (o.req.len(), o.req.slots().last()),
                (pos + 1, Some(&want[k])),
            )?;
        }
        Ok(())
    }

    fn checkpoint(&mut self, i: usize, cut: u8, step: usize) -> Result<(), String> {
        let len = self.open[i].kv.len();
        let c = cut as usize % (len + 2);
        let o = &self.open[i];
        if c > len || tree(&o.kv[..c], o.bigram).len() <= o.req.cached_len() {
            // Past what the request holds: refused; no further than its lock: nothing
            // to do. Either way nothing changes.
            let before = self.snapshot();
            let kv = o.kv[..len].iter().copied().chain([0]).take(c).collect::<Vec<_>>();
            let got = self.open[i].req.checkpoint(&kv);
            let want = if c > len { Err(CacheError::TokenCount { tokens: c, held: len }) } else { Ok(()) };
            check("checkpoint that caches nothing", step, got, want)?;
            return self.unchanged(&before, Some(i), "checkpoint that caches nothing", step);
        }
        let o = &mut self.open[i];
        o.req.checkpoint(&o.kv[..c]).map_err(|e| format!("step {step}: checkpoint: {e}"))?;
        let t = tree(&o.kv[..c], o.bigram);
        let (p, n) =
            self.reference.cache_unfinished_req(o.ref_ns, t, &mut o.ref_kv, o.ref_protected, o.ref_node, o.prio);
        (o.ref_protected, o.ref_node) = (p, n);
        check("checkpoint: lock and row", step, (o.req.cached_len(), o.req.slots()), (p, &o.ref_kv[..]))
    }

    /// Finish open request `i` (after a wrong count first, when `miscount` says so).
    /// `Some(index)` when the contract refused the correct finish too (a bigram request
    /// with no token past its lock), the request open again at that index.
    fn finish(&mut self, i: usize, prio: i64, miscount: u8, step: usize) -> Result<Option<usize>, String> {
        let len = self.open[i].kv.len();
        let wrong = match miscount % 3 {
            1 if len > 0 => Some(self.open[i].kv[..len - 1].to_vec()),
            2 => Some(self.open[i].kv.iter().copied().chain([0]).collect()),
            _ => None,
        };
        self.open[i].req.set_priority(prio);
        self.open[i].prio = prio;
        if let Some(wrong) = wrong {
            let before = self.snapshot();
            let mut o = self.open.remove(i);
            let refused = o.req.finish(&wrong).map(|_| ()).map_err(|r| (r.error, r.request));
            let Err((error, req)) = refused else {
                return Err(format!("step {step}: a finish with {} tokens of {len} was accepted", wrong.len()));
            };
            check("finish with a wrong count", step, error, CacheError::TokenCount { tokens: wrong.len(), held: len })?;
            o.req = req;
            self.open.insert(i, o);
            self.unchanged(&before, Some(i), "finish with a wrong count", step)?;
        }
        let o = &self.open[i];
        if o.bigram && len > 0 && len == o.req.cached_len() {
            // A bigram request caches position `j` with token `j + 1`: one with no token
            // past its lock cannot finish.
            let before = self.snapshot();
            let mut o = self.open.remove(i);
            let refused = o.req.finish(&o.kv).map(|_| ()).map_err(|r| (r.error, r.request));
            let Err((CacheError::Invalid(_), req)) = refused else {
                return Err(format!("step {step}: a bigram finish at its lock gave {:?}", refused.map_err(|r| r.0)));
            };
            o.req = req;
            self.open.insert(i, o);
            self.unchanged(&before, Some(i), "bigram finish at its lock", step)?;
            return Ok(Some(i));
        }
        let o = self.open.remove(i);
        let got = o.req.finish(&o.kv).map_err(|r| format!("step {step}: finish: {}", r.error))?;
        let t = tree(&o.kv, o.bigram);
        let r = &mut self.reference;
        let want = r.cache_finished_req(o.ref_ns, t, &o.ref_kv[..t.len()], o.ref_protected, o.ref_node, prio);
        if o.bigram && len > 0 {
            // The last position is cached with no token: its page, when it starts one,
            // is freed with the request.
            let last = len - 1;
            if last % self.ps == 0 && last >= o.ref_protected {
                r.allocator().free(&o.ref_kv[last..]).map_err(|e| format!("step {step}: {e}"))?;
            }
        }
        check("finish: cached prefix", step, got, want)?;
        Ok(None)
    }

    fn abort(&mut self, i: usize, drop_it: bool) {
        let Open { req, ref_kv, ref_protected, ref_node, .. } = self.open.remove(i);
        if drop_it {
            drop(req);
        } else {
            req.abort();
        }
        self.reference.allocator().free(&ref_kv[ref_protected..]).expect("a reference request owns its slots");
        self.reference.dec_lock_ref(ref_node);
    }

    /// The O(1)-ish part of [`compare`](Self::compare): sizes, free space, free rows,
    /// node count, and the accounting.
    fn compare_sizes(&self, step: usize) -> Result<(), String> {
        let (c, r) = (&self.cache, &self.reference);
        check("total", step, c.total_size(), r.total_size())?;
        check("evictable", step, c.evictable_size(), r.evictable_size())?;
        check("protected", step, c.protected_size(), r.protected_size())?;
        check("available", step, c.allocator().available_size(), r.allocator().available_size())?;
        check("nodes", step, c.node_count(), r.node_count())?;
        check("free rows", step, c.req_pool().available_size(), MAX_REQS - self.open.len())?;
        check("the cache's holders", step, Arc::strong_count(c), 1 + self.open.len())?;
        // Free + cached + what open requests hold (their pages past their locks) is
        // everything.
        let held: usize = self.open.iter().map(|o| o.kv.len().next_multiple_of(self.ps) - o.ref_protected).sum();
        check(
            "free + cached + held",
            step,
            c.allocator().available_size() + c.total_size() + held,
            self.pages * self.ps,
        )
    }

    fn compare(&self, step: usize) -> Result<(), String> {
        let ps = self.ps;
        self.cache.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
        self.compare_sizes(step)?;
        let leaf_paths = self.cache.leaf_paths();
        let mut mapped = Vec::with_capacity(leaf_paths.len());
        for (ns, k, v) in &leaf_paths {
            let Some(&(_, r)) = self.namespaces.iter().find(|&&(n, _)| n == *ns) else {
                return Err(format!("step {step}: a cached path in namespace {ns}, which no request used"));
            };
            mapped.push((r, k.clone(), v.clone()));
        }
        mapped.sort();
        check("leaf paths", step, &mapped, &self.reference.leaf_paths())?;
        for o in &self.open {
            let got = (o.req.len(), o.req.cached_len(), o.req.slots());
            check("request: length, lock, row", step, got, (o.kv.len(), o.ref_protected, &o.ref_kv[..]))?;
        }
        // Every page owned exactly once: tree, one open request, free pool.
        let mut owner = vec![0u8; self.pages + 1];
        for (_, _, slots) in &leaf_paths {
            for s in slots.chunks(ps) {
                owner[s[0] as usize / ps] = 1; // shared prefixes repeat: mark, do not count
            }
        }
        let tree_pages = owner.iter().filter(|&&o| o == 1).count();
        check("tree pages", step, tree_pages * ps, self.cache.total_size())?;
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
        check("pages owned + free", step, owned + self.cache.allocator().available_size() / ps, self.pages)
    }
}
