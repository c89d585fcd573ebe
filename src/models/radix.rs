//! [`RadixCache`] against [`ReferenceRadixCache`], operation by operation.
//!
//! Each side has its own allocator of the same shape; since both allocators hand out
//! the lowest free pages and the caches free the same pages in the same order, the two
//! sides must agree on every slot number, not just on lengths. After every operation the
//! driver compares sizes, free space, the canonical leaf paths and node counts, runs
//! `check_invariants()`, and checks that every page is owned exactly once: by the tree,
//! by an open request, or by the free pool.
//!
//! Open requests keep their leases detached between operations, so that
//! [`RadixOp::Reset`] can take the cache by `&mut`: it must be refused with exactly as
//! many leases as open requests hold a matched prefix (nothing changing), and otherwise
//! empty both trees.
//!
//! [`run_with`] lets the fuzz target do the O(tree) part of that comparison (leaf
//! paths, invariants, page owners) only every few steps and after the last one; the
//! O(1) part (sizes, free space, node count) and each operation's own result are still
//! compared at every step.

use arbitrary::{Arbitrary, Unstructured};

use crate::baseline::{RefNodeId, ReferenceRadixCache};
use crate::radix::{CacheError, EvictionPolicy, RadixCache, RadixConfig, RawLease};
use crate::{KvAllocator, PagedAllocator, ReqRow, ReqToTokenPool};

/// Tokens come from a tiny alphabet so keys share prefixes often.
const ALPHABET: u8 = 3;
/// Longest key.
const MAX_KEY: usize = 24;
/// Open requests at most.
const MAX_REQS: usize = 6;
/// How many ops the `radix_ops` fuzz target reads from one input (short sequences,
/// many executions: about 50,000 a second on one core, see RELIABILITY.md).
pub const MAX_FUZZ_OPS: usize = 8;
/// How often the `radix_ops` fuzz target runs the full O(tree) comparison: every
/// `FUZZ_FULL_CHECK_EVERY` steps, after the last step and after the final teardown.
/// Equal to [`MAX_FUZZ_OPS`]: once at the end of the sequence and once after the
/// teardown (a crash replayed with [`run`] names the first bad step).
pub const FUZZ_FULL_CHECK_EVERY: usize = MAX_FUZZ_OPS;

/// One step of a radix-cache model run.
#[derive(Arbitrary, Debug, Clone)]
pub enum RadixOp {
    /// A request arrives: match and lock its tokens, take a row, allocate the rest.
    Start {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace (0..=1).
        ns: bool,
    },
    /// An open request finishes (`cache_finished_req`).
    Finish {
        /// Which open request (modulo their number).
        req: u8,
        /// Insert priority.
        prio: i8,
    },
    /// An open request caches its progress (`cache_unfinished_req`).
    Chunk {
        /// Which open request.
        req: u8,
    },
    /// An open request is dropped: its own slots are freed, its lease released.
    Abort {
        /// Which open request.
        req: u8,
    },
    /// A direct insert of freshly allocated slots (duplicates are freed).
    Insert {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
        /// Priority.
        prio: i8,
    },
    /// SGLang's match (touches, may split), without locking.
    Match {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// The lock-free read-only lookup.
    Peek {
        /// Token seeds.
        key: Vec<u8>,
        /// Namespace.
        ns: bool,
    },
    /// Evict at least `n` tokens.
    Evict {
        /// Tokens to free.
        n: u8,
    },
    /// `reset`: refused while an open request's lease locks a node (nothing changes);
    /// otherwise both trees are dropped (the open requests, whose matches were empty,
    /// keep their own slots).
    Reset,
}

struct Req {
    ns: u64,
    tokens: Vec<u32>,
    row: ReqRow,
    /// Detached between ops, so that a reset can take the cache by `&mut`.
    lease: RawLease,
    ref_kv: Vec<u32>,
    ref_node: RefNodeId,
    ref_protected: usize,
}

fn tokens(seeds: &[u8], ps: usize) -> Vec<u32> {
    let mut t: Vec<u32> = seeds.iter().take(MAX_KEY).map(|&s| (s % ALPHABET) as u32).collect();
    if ps > 1 && t.len() > ps && seeds.first().is_some_and(|s| s & 0x80 != 0) {
        // sometimes cut to whole pages, so inserts of full keys happen too
        t.truncate(t.len() / ps * ps);
    }
    t
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

/// [`run`], with the full O(tree) comparison (leaf paths, `check_invariants()`, page
/// owners) after every `full_every`-th step, after the last step and after the
/// teardown; sizes, free space and node counts are compared after every step. `run` is
/// `run_with(.., 1)`.
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
    let mut cache = RadixCache::new(make(), ReqToTokenPool::new(MAX_REQS as u32, 32).unwrap(), config)
        .map_err(|e| e.to_string())?;
    let mut reference = ReferenceRadixCache::new(make(), policy).map_err(|e| e.to_string())?;
    let mut reqs: Vec<Req> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        if let RadixOp::Reset = op {
            let leases = reqs.iter().filter(|r| !r.lease.is_empty()).count();
            match cache.reset() {
                Err(CacheError::Leased { leases: n }) if leases > 0 => {
                    check("reset refused for leases", step, n, leases)?;
                }
                Ok(()) if leases == 0 => reference.reset(),
                other => return Err(format!("step {step}: reset with {leases} leases open gave {other:?}")),
            }
        } else {
            apply(&cache, &mut reference, &mut reqs, op, ps, step)?;
        }
        if (step + 1) % full_every == 0 || step + 1 == ops.len() {
            compare(&cache, &reference, &reqs, ps, pages, step)?;
        } else {
            compare_sizes(&cache, &reference, step)?;
        }
    }
    // Finish everything, then evict everything: the pool must be whole again.
    while let Some(r) = reqs.pop() {
        abort(&cache, &mut reference, r, ps);
    }
    cache.evict(usize::MAX);
    reference.evict(usize::MAX);
    compare(&cache, &reference, &reqs, ps, pages, ops.len())?;
    check("free tokens at the end", ops.len(), cache.allocator().available_size(), pages * ps)
}

fn abort(cache: &RadixCache<PagedAllocator>, reference: &mut ReferenceRadixCache<PagedAllocator>, r: Req, ps: usize) {
    let own = cache.req_pool().read(&r.row, 0..r.tokens.len()).unwrap()[r.lease.len()..].to_vec();
    let _ = ps;
    cache.allocator().free(&own).expect("a request owns its slots");
    cache.release(r.lease).expect("a request's lease is live");
    cache.req_pool().free(r.row).unwrap();
    reference.allocator().free(&r.ref_kv[r.ref_protected..]).expect("reference request owns its slots");
    reference.dec_lock_ref(r.ref_node);
}

fn apply(
    cache: &RadixCache<PagedAllocator>,
    reference: &mut ReferenceRadixCache<PagedAllocator>,
    reqs: &mut Vec<Req>,
    op: &RadixOp,
    ps: usize,
    step: usize,
) -> Result<(), String> {
    match op {
        RadixOp::Start { key, ns } => {
            let t = tokens(key, ps);
            if reqs.len() == MAX_REQS || t.is_empty() {
                return Ok(());
            }
            let ns = *ns as u64;
            let mut hit = vec![0u32; t.len()];
            // Every other start matches and allocates straight into its row (the finish
            // then trusts what the cache wrote there), the others through buffers.
            let into_row = step % 2 == 1;
            let mut row = cache.req_pool().alloc().map_err(|e| e.to_string())?;
            let lease = if into_row {
                let lease = cache.match_and_lock_row(ns, &t, &mut row).map_err(|e| e.to_string())?;
                hit[..lease.len()].copy_from_slice(cache.req_pool().read(&row, 0..lease.len()).unwrap());
                lease
            } else {
                cache.match_and_lock(ns, &t, &mut hit)
            };
            let (ref_hit, ref_node) = reference.match_prefix(ns, &t);
            reference.inc_lock_ref(ref_node);
            let h = lease.len();
            check("start: hit", step, &hit[..h], &ref_hit[..])?;
            let last = if h > 0 { hit[h - 1] } else { 0 };
            let mut new = vec![0u32; t.len() - h];
            if !into_row {
                cache.req_pool().write(&mut row, 0, &hit[..h]).unwrap();
            }
            let got = if into_row {
                let got = cache.alloc_extend_row(&mut row, h, t.len());
                new.copy_from_slice(cache.req_pool().read(&row, h..t.len()).unwrap());
                got
            } else {
                cache.alloc_extend(&[h as u32], &[t.len() as u32], &[last], &mut new)
            };
            // reference: evict the shortfall (unless it is past what is evictable: the
            // allocation fails then, and nothing is evicted for it), then allocate
            let need = reference.allocator().extend_need(&[h as u32], &[t.len() as u32]).unwrap();
            let avail = reference.allocator().available_size();
            if avail < need && need - avail <= reference.evictable_size() {
                reference.evict(need - avail);
            }
            let mut ref_new = vec![0u32; t.len() - h];
            let want = reference.allocator().alloc_extend(&[h as u32], &[t.len() as u32], &[last], &mut ref_new);
            check("start: alloc ok", step, got.is_ok(), want.is_ok())?;
            if got.is_err() {
                drop(lease);
                cache.req_pool().free(row).unwrap();
                reference.dec_lock_ref(ref_node);
                return Ok(());
            }
            check("start: new slots", step, &new, &ref_new)?;
            if !into_row {
                cache.req_pool().write(&mut row, h, &new).unwrap();
            }
            let mut ref_kv = ref_hit;
            ref_kv.extend_from_slice(&ref_new);
            reqs.push(Req { ns, tokens: t, row, lease: lease.detach(), ref_kv, ref_node, ref_protected: h });
        }
        RadixOp::Finish { req, prio } => {
            if reqs.is_empty() {
                return Ok(());
            }
            let r = reqs.remove(*req as usize % reqs.len());
            let lease =
                cache.attach(r.lease).map_err(|_| format!("step {step}: a request's lease of another cache"))?;
            let got =
                cache.cache_finished_req(r.ns, &r.tokens, r.row, lease, *prio as i64).map_err(|e| e.to_string())?;
            let want =
                reference.cache_finished_req(r.ns, &r.tokens, &r.ref_kv, r.ref_protected, r.ref_node, *prio as i64);
            check("finish: cached prefix", step, got, want)?;
        }
        RadixOp::Chunk { req } => {
            if reqs.is_empty() {
                return Ok(());
            }
            let i = *req as usize % reqs.len();
            let Req { ns, tokens, mut row, lease, mut ref_kv, ref_node, ref_protected } = reqs.remove(i);
            let mut lease =
                cache.attach(lease).map_err(|_| format!("step {step}: a request's lease of another cache"))?;
            cache.cache_unfinished_req(ns, &tokens, &mut row, &mut lease, 0).map_err(|e| e.to_string())?;
            let (p, n) = reference.cache_unfinished_req(ns, &tokens, &mut ref_kv, ref_protected, ref_node, 0);
            check("chunk: protected", step, lease.len(), p)?;
            check("chunk: row", step, cache.req_pool().read(&row, 0..tokens.len()).unwrap(), &ref_kv[..])?;
            let lease = lease.detach();
            reqs.insert(i, Req { ns, tokens, row, lease, ref_kv, ref_node: n, ref_protected: p });
        }
        RadixOp::Abort { req } => {
            if reqs.is_empty() {
                return Ok(());
            }
            let r = reqs.remove(*req as usize % reqs.len());
            abort(cache, reference, r, ps);
        }
        // `run_with` resets: it holds the cache by `&mut`.
        RadixOp::Reset => return Err(format!("step {step}: a reset reached apply")),
        RadixOp::Insert { key, ns, prio } => {
            let t = tokens(key, ps);
            let t = &t[..t.len() / ps * ps];
            let ns = *ns as u64;
            let mut s = vec![0u32; t.len()];
            let mut rs = vec![0u32; t.len()];
            let got = cache.allocator().alloc(&mut s);
            let want = reference.allocator().alloc(&mut rs);
            check("insert: alloc ok", step, got.is_ok(), want.is_ok())?;
            if got.is_err() {
                return Ok(());
            }
            check("insert: slots", step, &s, &rs)?;
            let a = cache.insert(ns, t, &s, *prio as i64).map_err(|e| format!("step {step}: insert: {e}"))?;
            let b = reference.insert(ns, t, &rs, *prio as i64);
            check("insert: prefix", step, a, b)?;
            cache.allocator().free(&s[..a]).map_err(|e| e.to_string())?;
            reference.allocator().free(&rs[..b]).map_err(|e| e.to_string())?;
        }
        RadixOp::Match { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let m = cache.match_prefix(*ns as u64, &t, &mut out);
            let (v, _) = reference.match_prefix(*ns as u64, &t);
            check("match", step, &out[..m.len()], &v[..])?;
        }
        RadixOp::Peek { key, ns } => {
            let t = tokens(key, ps);
            let mut out = vec![0u32; t.len()];
            let n = cache.peek_prefix(*ns as u64, &t, &mut out);
            // The reference has no read-only match: compare against its leaf paths.
            let best = reference
                .leaf_paths()
                .into_iter()
                .filter(|(pns, _, _)| *pns == *ns as u64)
                .map(|(_, k, v)| {
                    let common = k.iter().zip(&t).take_while(|(a, b)| a == b).count() / ps * ps;
                    (common, v)
                })
                .max_by_key(|(c, _)| *c);
            let (len, slots) = best.map_or((0, vec![]), |(c, v)| (c, v[..c].to_vec()));
            check("peek", step, (n, &out[..n]), (len, &slots[..]))?;
        }
        RadixOp::Evict { n } => {
            let a = cache.evict(*n as usize);
            let b = reference.evict(*n as usize);
            check("evict", step, a, b)?;
        }
    }
    Ok(())
}

/// The O(1) part of [`compare`]: sizes, free space, node count.
fn compare_sizes(
    cache: &RadixCache<PagedAllocator>,
    reference: &ReferenceRadixCache<PagedAllocator>,
    step: usize,
) -> Result<(), String> {
    check("total", step, cache.total_size(), reference.total_size())?;
    check("evictable", step, cache.evictable_size(), reference.evictable_size())?;
    check("protected", step, cache.protected_size(), reference.protected_size())?;
    check("available", step, cache.allocator().available_size(), reference.allocator().available_size())?;
    check("nodes", step, cache.node_count(), reference.node_count())
}

fn compare(
    cache: &RadixCache<PagedAllocator>,
    reference: &ReferenceRadixCache<PagedAllocator>,
    reqs: &[Req],
    ps: usize,
    pages: usize,
    step: usize,
) -> Result<(), String> {
    cache.check_invariants().map_err(|e| format!("step {step}: {e}"))?;
    compare_sizes(cache, reference, step)?;
    let leaf_paths = cache.leaf_paths();
    check("leaf paths", step, &leaf_paths, &reference.leaf_paths())?;
    // Every page owned exactly once: tree, open requests, free pool.
    let mut owner = vec![0u8; pages + 1];
    for (_, _, slots) in &leaf_paths {
        for s in slots.chunks(ps) {
            owner[s[0] as usize / ps] = 1; // shared prefixes repeat: mark, do not count
        }
    }
    let tree_pages = owner.iter().filter(|&&o| o == 1).count();
    check("tree pages", step, tree_pages * ps, cache.total_size())?;
    for r in reqs {
        let row = cache.req_pool().read(&r.row, 0..r.tokens.len()).unwrap();
        for &s in &row[r.lease.len()..] {
            let p = s as usize / ps;
            if owner[p] == 1 {
                return Err(format!("step {step}: page {p} is in the tree and owned by a request"));
            }
            owner[p] = 2;
        }
    }
    let owned = owner.iter().filter(|&&o| o != 0).count();
    check("pages owned + free", step, owned + cache.allocator().available_size() / ps, pages)
}
