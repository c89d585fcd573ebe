//! The sliding-window variant of the radix core: [`SwaRadixCache`], SGLang's
//! `SWARadixCache` for models that interleave full-attention and sliding-window layers
//! (Gemma 2/3, gpt-oss, Mistral's SWA variants).
//!
//! Every cached token has KV in the full layers' pool and, through the dual
//! allocator's mapping ([`SwaAllocator`]), in the window layers' pool. The window pool
//! is smaller: a request needs the window KV of its last `window` tokens only. So a
//! node may drop its window KV and keep its full KV: it becomes an **SWA tombstone**.
//!
//! * A match walks as far as the KV matches and returns the longest prefix whose last
//!   `window` tokens all have their window KV: a counter of the tokens matched since the
//!   last tombstone (infinite while none was crossed) grows with each live node and
//!   restarts at 0 on a tombstone; a place is a valid end when the counter is at least
//!   `window`. Only the returned path's recency is refreshed, the root oldest.
//!   [`peek_prefix`](RadixCache::peek_prefix) applies the same rule lock-free (each
//!   node's tombstone state as published when it was read).
//! * A lease locks the full KV of its whole path (as the plain cache) and the window
//!   KV of its last `window` tokens: whole nodes from its end upward until they cover
//!   `window` tokens (the *window lock*; it stops early at a tombstone, which only a
//!   request's own freshly cached tail can put there).
//! * [`evict`](RadixCache::evict) removes unlocked leaves whole (full and window KV)
//!   and then any parent left a childless tombstone (a leaf is never a tombstone);
//!   [`evict_swa`](RadixCache::evict_swa) frees window KV of nodes without a window
//!   lock, least recently used first: an internal node becomes a tombstone, a leaf is
//!   removed whole; [`evict_both`](RadixCache::evict_both) runs the first pass and then
//!   the second for what the first did not free (SGLang's `evict(full, swa)`), and the
//!   allocation helpers run it for the shortfall of each pool.
//! * An insert revives a tombstone it passes over when the request brings window KV
//!   for the node's tokens (the tree's pages take the request's window pages; the
//!   request's duplicate pages are then freed without them), and turns the leading part
//!   of a new leaf whose window KV the request already released
//!   ([`release_window`](super::Request::release_window)) into a tombstone above a live
//!   leaf.
//!
//! One difference from SGLang's older releases: there the counter restarted at a
//! tombstone only when it had reached `window` already, so a short live node between
//! two tombstones could let a match end with tombstoned tokens inside its window (see
//! the test `window_counter_restarts_at_every_tombstone`). kvpool restarts it at every
//! tombstone, as SGLang does since.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use kvpool::alloc::SwaAllocator;
//! use kvpool::radix::{RadixConfig, SwaRadixCache};
//! use kvpool::ReqToTokenPool;
//!
//! // 64 full tokens, 16 window tokens, a window of 4 tokens.
//! let cache = Arc::new(SwaRadixCache::with_window(
//!     SwaAllocator::new(64, 16, 1)?,
//!     ReqToTokenPool::new(4, 64)?,
//!     RadixConfig::default(),
//!     4,
//! )?);
//! for prompt in [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]] {
//!     let mut req = cache.admit(0, &prompt)?;
//!     req.extend(8 - req.len())?;
//!     req.finish(&prompt)?;
//! }
//!
//! // Window pressure, least recently used first: the leaf [5, 6, 7, 8] goes whole, and
//! // the shared prefix [1, 2, 3, 4] keeps its full KV only.
//! assert_eq!(cache.evict_swa(8), 8);
//! assert_eq!(cache.tombstone_size(), 4);
//! // A match may not end right after it (its window would be missing) ...
//! let mut out = [0u32; 8];
//! assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4], &mut out).len(), 0);
//! // ... but may end 4 live tokens further.
//! assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4, 9, 9, 9, 9], &mut out).len(), 8);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt::{self, Write as _};

use super::heap::{self, Heap, Slot};
use super::variant::Variant;
use super::writer::Writer;
use super::LatchHeld;
#[cfg(test)]
use super::Unfinished;
use super::{CacheError, EvictionPolicy, Inserted, Lease, Lookup, Meta, RadixCache, RadixConfig, NIL, ROOT};
use crate::alloc::{KvAllocator, SwaAllocator};
use crate::error::ConfigError;
#[cfg(test)]
use crate::error::InvalidInput;
use crate::req_to_token::{ReqRow, ReqToTokenPool};

#[cfg(test)]
use crate::slots::ascending_from;
use crate::sync::atomic::{AtomicUsize, Ordering};

/// The sliding-window variant (see the [module docs](self)).
#[derive(Debug)]
pub struct Swa {
    window: usize,
    /// Window tokens of live nodes without a window lock.
    evictable: AtomicUsize,
    /// Window tokens of live nodes under a window lock.
    protected: AtomicUsize,
}

/// A radix cache over a dual allocator whose nodes may be SWA tombstones (see the
/// [module docs](self)).
pub type SwaRadixCache = RadixCache<SwaAllocator, Swa>;

/// A node's window state: whether it is a tombstone, its window lock count, and its
/// place in the window order.
#[derive(Clone, Copy, Debug)]
pub struct SwaNode {
    tomb: bool,
    lock: u32,
    pos: u32,
}

impl Default for SwaNode {
    fn default() -> Self {
        SwaNode { tomb: false, lock: 0, pos: NIL }
    }
}

/// A match's counter of tokens since the last tombstone (infinite before the first).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct SwaWalk(u64);

impl Default for SwaWalk {
    fn default() -> Self {
        SwaWalk(u64::MAX)
    }
}

impl SwaWalk {
    /// Enter a node of `tokens` matched tokens; whether the match may end after it.
    #[inline]
    fn step(&mut self, tomb: bool, tokens: usize, window: usize) -> bool {
        if tomb {
            self.0 = 0;
            return false;
        }
        self.0 = self.0.saturating_add(tokens as u64);
        self.0 >= window as u64
    }
}

/// The window order (SGLang's `swa_lru_list`): live nodes without a window lock, least
/// recently used first, internal nodes included.
struct Windows;

impl Slot<SwaNode> for Windows {
    #[inline]
    fn pos(m: &Meta<SwaNode>) -> u32 {
        m.ext.pos
    }
    #[inline]
    fn set_pos(m: &mut Meta<SwaNode>, pos: u32) {
        m.ext.pos = pos;
    }
    #[inline]
    fn key(_: EvictionPolicy, m: &Meta<SwaNode>) -> (i64, u64) {
        (0, m.last_access)
    }
}

/// The variant's writer-only state.
#[derive(Debug)]
pub struct SwaState {
    order: Vec<u32>,
    /// Window tokens of the live nodes removed since it was last cleared (the full
    /// pass's window count).
    removed_window: usize,
}

impl super::variant::sealed::Sealed for Swa {}

fn windows<'w, A: KvAllocator>(w: &'w mut Writer<'_, A, Swa>) -> Heap<'w, SwaNode, Windows> {
    Heap::new(&mut w.s.ext.order, &mut w.s.meta, w.c.policy)
}

fn dual<'a, A: KvAllocator>(w: &Writer<'a, A, Swa>) -> &'a SwaAllocator {
    w.c.alloc.as_swa().expect("an SWA cache is built over an SwaAllocator")
}

/// Turn the live internal node `id` (no window lock) into a tombstone, freeing its
/// window KV. Returns the window tokens freed.
fn tombstone<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, id: u32) -> usize {
    let e = w.s.meta[id as usize].ext;
    debug_assert!(!e.tomb && e.lock == 0, "only an unlocked live node becomes a tombstone");
    if e.pos != NIL {
        windows(w).remove(id);
    }
    let window = dual(w).window();
    let freed = w.runs(id).map(|(start, len)| window.release_now(start, len)).sum();
    let len = w.len_of(id);
    w.s.meta[id as usize].ext = SwaNode { tomb: true, lock: 0, pos: NIL };
    w.set_mark(id, 1);
    w.c.variant.evictable.latch_sub(len);
    freed
}

/// Make the tombstone `id` live again (its pages have their window KV now).
fn revive<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, id: u32) {
    debug_assert!(w.s.meta[id as usize].ext.tomb);
    w.s.meta[id as usize].ext = SwaNode::default();
    w.set_mark(id, 0);
    w.c.variant.evictable.latch_add(w.len_of(id));
    windows(w).push(id);
}

// The hooks take the core's crate-private lease types: the trait is sealed and its hooks hidden.
#[allow(private_interfaces)]
impl Variant for Swa {
    type Node = SwaNode;
    type State = SwaState;
    type Walk = SwaWalk;
    const TOUCH_WHILE_WALKING: bool = false;

    fn new_state(&self, nodes: usize) -> Result<SwaState, ConfigError> {
        Ok(SwaState { order: crate::arena::try_with_capacity(nodes, "swa window order")?, removed_window: 0 })
    }

    type Request = ();
    type Finished = usize;

    fn finish_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        rows: &ReqToTokenPool,
        namespace: u64,
        tokens: &[u32],
        row: &ReqRow,
        lease: &Lease<'_, A, Self>,
        priority: i64,
        _req: &mut (),
    ) -> Result<usize, CacheError> {
        let limit = window_limit(c, tokens, row, lease.len());
        c.finish(rows, namespace, tokens, row, lease, priority, limit, |_| Ok(()), settle).map(|(n, ())| n)
    }

    fn checkpoint_request<A: KvAllocator>(
        c: &RadixCache<A, Self>,
        namespace: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, A, Self>,
        priority: i64,
        _req: &mut (),
    ) -> Result<(), CacheError> {
        let limit = window_limit(c, tokens, row, lease.len());
        c.unfinished_with(&c.req_pool, namespace, tokens, row, lease, priority, limit, |_| Ok(()), settle)
    }

    #[inline]
    fn walk_step(&self, walk: &mut SwaWalk, node: &SwaNode, tokens: usize) -> bool {
        walk.step(node.tomb, tokens, self.window)
    }

    #[inline]
    fn peek_step(&self, walk: &mut SwaWalk, mark: u32, tokens: usize) -> bool {
        walk.step(mark != 0, tokens, self.window)
    }

    #[inline]
    fn match_end(node: &SwaNode) -> bool {
        !node.tomb
    }

    #[inline]
    fn is_tombstone(node: &SwaNode) -> bool {
        node.tomb
    }

    fn lockable<A: KvAllocator>(w: &Writer<'_, A, Self>, id: u32) -> bool {
        // The window part of a lease (its last `window` tokens) must still be live.
        let (mut x, mut acc) = (id, 0usize);
        while x != ROOT && acc < w.c.variant.window {
            if w.s.meta[x as usize].ext.tomb {
                return false;
            }
            acc += w.len_of(x);
            x = w.parent_of(x);
        }
        true
    }

    fn make_room<A: KvAllocator>(c: &RadixCache<A, Self>, need: usize) {
        let a = c.alloc.as_swa().expect("an SWA cache is built over an SwaAllocator");
        let full = need.saturating_sub(a.full_available_size());
        let window = need.saturating_sub(a.window_available_size());
        // As the core: a shortfall past what is evictable fails either way, and
        // evicting for it would only empty the cache.
        if (full > 0 || window > 0)
            && full <= c.evictable_size()
            && window <= c.variant.evictable.load(Ordering::Acquire)
        {
            c.write(|w| evict_both(w, full, window));
            crate::debug_check(c);
        }
    }

    #[inline]
    fn split_payload(lower: &mut SwaNode) -> SwaNode {
        // Both halves keep the tombstone state and the window lock count (the lock's
        // walk covers both: it counts tokens, not nodes).
        SwaNode { tomb: lower.tomb, lock: lower.lock, pos: NIL }
    }

    fn split<A: KvAllocator>(w: &mut Writer<'_, A, Self>, _old: u32, upper: u32, lower: u32) {
        let e = w.s.meta[lower as usize].ext;
        if e.pos != NIL {
            w.s.ext.order[e.pos as usize] = lower;
        }
        if !e.tomb && e.lock == 0 {
            windows(w).push(upper);
        }
        // The lower half is more recent than the new upper half (SGLang re-times the
        // child so that the window pass tombstones nodes nearer the root first).
        w.touch(lower);
    }

    fn removing<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        let e = w.s.meta[id as usize].ext;
        if e.tomb {
            return;
        }
        if e.pos != NIL {
            windows(w).remove(id);
        }
        let len = w.len_of(id);
        let count = if e.lock == 0 { &w.c.variant.evictable } else { &w.c.variant.protected };
        count.latch_sub(len);
        w.s.ext.removed_window += len;
    }

    fn lock_end<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) -> u64 {
        let (mut x, mut acc) = (id, 0usize);
        while x != ROOT && acc < w.c.variant.window {
            let e = w.s.meta[x as usize].ext;
            if e.tomb {
                break;
            }
            let len = w.len_of(x);
            if e.lock == 0 {
                windows(w).remove(x);
                w.c.variant.evictable.latch_sub(len);
                w.c.variant.protected.latch_add(len);
            }
            w.s.meta[x as usize].ext.lock += 1;
            acc += len;
            x = w.parent_of(x);
        }
        acc as u64
    }

    fn unlock_end<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32, aux: u64) {
        let (mut x, mut acc) = (id, 0u64);
        while acc < aux {
            debug_assert!(x != ROOT, "a window lock covers more than its path");
            let len = w.len_of(x);
            let e = &mut w.s.meta[x as usize].ext;
            debug_assert!(e.lock > 0 && !e.tomb, "a window lock released twice");
            e.lock -= 1;
            if e.lock == 0 {
                w.c.variant.evictable.latch_add(len);
                w.c.variant.protected.latch_sub(len);
                windows(w).push(x);
            }
            acc += len as u64;
            x = w.parent_of(x);
        }
        debug_assert_eq!(acc, aux, "a window lock ends at a node boundary");
    }

    #[inline]
    fn touched<A: KvAllocator>(w: &mut Writer<'_, A, Self>, id: u32) {
        windows(w).update(id);
    }

    fn reset<A: KvAllocator>(w: &mut Writer<'_, A, Self>) {
        w.s.ext.order.clear();
        w.s.ext.removed_window = 0;
        w.c.variant.evictable.store(0, Ordering::Release);
        w.c.variant.protected.store(0, Ordering::Release);
    }

    fn check<A: KvAllocator>(w: &Writer<'_, A, Self>) -> Result<(), String> {
        let window = dual(w).window();
        let (mut evictable, mut protected, mut listed) = (0usize, 0usize, 0usize);
        for (id, m) in w.s.meta.iter().enumerate().skip(1) {
            if !m.alive {
                continue;
            }
            let (id, e) = (id as u32, m.ext);
            let mark = w.c.records[id as usize].mark.load(Ordering::Relaxed);
            if mark != e.tomb as u32 {
                return Err(format!("node {id}'s reader mark {mark} disagrees with its tombstone state"));
            }
            let mapped = |all: bool| {
                w.runs(id).all(|(s, l)| if all { window.all_mapped(s, l) } else { window.none_mapped(s, l) })
            };
            if e.tomb {
                if m.children == 0 {
                    return Err(format!("node {id} is a tombstone leaf"));
                }
                if e.lock != 0 || e.pos != NIL {
                    return Err(format!("tombstone {id} has a window lock or an order place"));
                }
                if !mapped(false) {
                    return Err(format!("tombstone {id} still has window KV"));
                }
                continue;
            }
            if !mapped(true) {
                return Err(format!("live node {id} has a page without window KV"));
            }
            if e.lock > m.lock_ref {
                return Err(format!("node {id} has more window locks than KV locks"));
            }
            let len = w.len_of(id);
            if e.lock == 0 {
                evictable += len;
                listed += 1;
                if e.pos == NIL {
                    return Err(format!("live node {id} without a window lock is not in the window order"));
                }
            } else {
                protected += len;
                if e.pos != NIL {
                    return Err(format!("window-locked node {id} is in the window order"));
                }
            }
        }
        if listed != w.s.ext.order.len() {
            return Err(format!("window order holds {}, {listed} unlocked live nodes", w.s.ext.order.len()));
        }
        let v = &w.c.variant;
        let sizes = (v.evictable.load(Ordering::Relaxed), v.protected.load(Ordering::Relaxed));
        if sizes != (evictable, protected) {
            return Err(format!("window sizes {sizes:?}, nodes add up to {:?}", (evictable, protected)));
        }
        heap::check::<_, Windows>(&w.s.ext.order, &w.s.meta, w.c.policy)
    }

    fn describe(node: &SwaNode, out: &mut String) {
        if node.tomb {
            out.push_str(" tombstone");
        } else if node.lock != 0 {
            let _ = write!(out, " window_locks={}", node.lock);
        }
    }
}

/// The full pass for `full` tokens, then the window pass for what it left of
/// `window`. Returns (full tokens, window tokens) freed.
fn evict_both<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, full: usize, window: usize) -> (usize, usize) {
    let (mut f, mut wf) = (0, 0);
    if full > 0 {
        w.s.ext.removed_window = 0;
        f = w.evict(full);
        wf = w.s.ext.removed_window;
    }
    if wf < window {
        let (f2, w2) = evict_window(w, window - wf);
        f += f2;
        wf += w2;
    }
    (f, wf)
}

/// The window pass: free window KV of unlocked live nodes, least recently used first.
/// Returns (full tokens, window tokens) freed.
fn evict_window<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, num: usize) -> (usize, usize) {
    let (mut full, mut window) = (0usize, 0usize);
    let mut group = w.c.alloc.free_group();
    while window < num {
        let Some(x) = windows(w).peek() else { break };
        if w.s.meta[x as usize].children > 0 {
            window += tombstone(w, x);
        } else {
            debug_assert!(w.s.meta[x as usize].lock_ref == 0, "a leaf without a window lock has no lease");
            w.s.ext.removed_window = 0;
            full += w.remove_evictable_leaf(x, &mut group);
            window += w.s.ext.removed_window;
        }
    }
    group.end();
    (full, window)
}

/// How many leading pages of `slots` (whole pages) end with a page that has window KV:
/// the length an insert may take (a leaf is never a tombstone). Never below `from`.
/// How much of a request's page-aligned tokens an insert takes (see [`SwaInsert`]):
/// up to its last page with window KV, never below its lease.
fn window_limit<A: KvAllocator>(c: &RadixCache<A, Swa>, token_ids: &[u32], row: &ReqRow, leased: usize) -> usize {
    let ps = c.ps;
    let aligned = token_ids.len() / ps * ps;
    match (c.alloc.as_swa(), c.req_pool.read(row, 0..aligned)) {
        (Some(a), Ok(kv)) => live_len(a, kv, leased.min(aligned), ps),
        _ => usize::MAX, // no window pool; or the core's read reports it
    }
}

fn live_len(a: &SwaAllocator, slots: &[u32], from: usize, ps: usize) -> usize {
    let mut end = slots.len() / ps * ps;
    while end > from && !a.window().is_mapped(slots[end - ps] / ps as u32) {
        end -= ps;
    }
    end
}

/// The pages of an insert that [`live_len`] cut off: each a whole page of slots
/// allocated in the full pool and not the tree's.
#[cfg(test)]
fn check_cut_pages<A: KvAllocator>(w: &Writer<'_, A, Swa>, cut: &[u32]) -> Result<(), CacheError> {
    let ps = w.c.ps;
    for page in cut.chunks(ps) {
        let first = page[0];
        let p = first / ps as u32;
        let whole = page.len() == ps && first % ps as u32 == 0 && ascending_from(page, first);
        if !whole {
            return Err(InvalidInput::NotAPage { slot: first }.into());
        }
        if p == 0 || p > w.c.num_pages || !w.c.alloc.is_allocated(first) || w.in_tree(p) {
            return Err(CacheError::SlotNotOwned { slot: first });
        }
    }
    Ok(())
}

/// After an insert: revive the tombstones the request brings window KV for, and make
/// the part of the new leaf whose window KV the request released a tombstone.
fn settle<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, ins: &Inserted<'_>) {
    let ps = w.c.ps;
    // 1. The cached part beyond the lease: the request's pages there are duplicates.
    // The end node's last page names it after a split (a split retires the node).
    let end_page = w.s.meta[ins.end as usize].last_page;
    let (mut pos, mut cur, mut resplit) = (0usize, 0u32, false);
    while pos < ins.cached {
        let Lookup::Found { id, .. } = w.c.find_child_in::<true>(cur, ins.namespace, &ins.key[pos..pos + ps]) else {
            debug_assert!(false, "the cached part of an insert is in the tree");
            break;
        };
        let n = w.len_of(id);
        cur = w.s.meta[id as usize].last_page;
        if pos >= ins.protected && w.s.meta[id as usize].ext.tomb {
            resplit |= revive_from(w, id, &ins.kv[pos..pos + n]);
        }
        pos += n;
    }
    if resplit {
        // A revival's split stamped its lower half after the insert's walk: stamp the
        // path again from the root down, so that it stays older than the nodes below it
        // (as when SGLang revives during the walk).
        w.touch_path(w.s.page_owner[end_page as usize]);
    }
    // 2. The new leaf.
    if ins.cached < ins.key.len() {
        let leaf = ins.end;
        let new = &ins.kv[ins.cached..];
        let pages = new.len() / ps;
        let window = dual(w).window();
        // The leaf counts as live first; a cut below makes its upper part a tombstone.
        w.c.variant.evictable.latch_add(new.len());
        windows(w).push(leaf);
        // The leaf holds exactly the new pages: its runs, one bitmap load per 64 pages.
        let (mut at, mut last_dead) = (0usize, None);
        for (start, len) in w.runs(leaf) {
            if !window.all_mapped(start, len) {
                last_dead = (0..len).rev().find(|&k| !window.is_mapped(start + k)).map(|k| at + k as usize);
            }
            at += len as usize;
        }
        if let Some(i) = last_dead {
            debug_assert!(i + 1 < pages, "inserts end with a page that has window KV");
            let upper = w.split(leaf, i + 1);
            tombstone(w, upper);
        }
    }
}

/// Revive tombstone `id` with the window KV of the request's duplicate slots `src` (its
/// tokens): the node's pages take the request's window pages. When some of the
/// request's pages have no window KV (or are not the request's to give), only the part
/// of the node after the last of them is revived (the node is split there). Returns
/// whether it split the node.
fn revive_from<A: KvAllocator>(w: &mut Writer<'_, A, Swa>, id: u32, src: &[u32]) -> bool {
    let ps = w.c.ps;
    let window = dual(w).window();
    let pages = src.len() / ps;
    let page = |i: usize| src[i * ps] / ps as u32;
    let num_pages = w.c.num_pages;
    let giver = |w: &Writer<'_, A, Swa>, p: u32| p != 0 && p <= num_pages && window.is_mapped(p) && !w.in_tree(p);
    let from = match (0..pages).rev().find(|&i| !giver(w, page(i))) {
        None => 0,
        Some(b) if b + 1 < pages => b + 1,
        Some(_) => return false,
    };
    // Move the window pages over, node page by node page. A move finds its giver
    // without window KV only if the caller named a page twice (a raw insert's misuse):
    // then every move is undone and the node stays a tombstone.
    let tree_pages = || w.runs(id).flat_map(|(start, len)| start..start + len).enumerate().skip(from);
    for (moved, (k, tp)) in tree_pages().enumerate() {
        if !window.move_page(page(k), tp) {
            for (k, tp) in tree_pages().take(moved) {
                window.move_page(tp, page(k));
            }
            return false;
        }
    }
    let last = w.s.meta[id as usize].last_page;
    if from > 0 {
        w.split(id, from);
    }
    let lower = w.s.page_owner[last as usize];
    revive(w, lower);
    from > 0
}

/// What an insert into an SWA tree did (the reference tree's answer; an
/// [`SwaRadixCache`] request's finish reports `cached`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwaInsert {
    /// Leading tokens that were cached already (the caller's slots for them are
    /// duplicates it frees, as with the plain insert; a
    /// tombstone there may have taken their window KV, which such a free then skips).
    pub cached: usize,
    /// Tokens now in the tree from the start of the key: the key, less trailing pages
    /// whose window KV the caller released (a leaf is never a tombstone); the caller
    /// keeps those pages.
    pub inserted: usize,
}

impl RadixCache<SwaAllocator, Swa> {
    /// A sliding-window prefix cache over `alloc` (its full pool's pages are cached;
    /// their window pages are found through its mapping) and `req_pool`, for a model
    /// whose window layers attend to the last `window` tokens.
    ///
    /// # Errors
    ///
    /// As [`RadixCache::new`]; [`ConfigError::Zero`] for a window of 0 tokens.
    pub fn with_window(
        alloc: SwaAllocator,
        req_pool: ReqToTokenPool,
        config: RadixConfig,
        window: usize,
    ) -> Result<Self, ConfigError> {
        if window == 0 {
            return Err(ConfigError::Zero("the sliding window"));
        }
        let variant = Swa { window, evictable: AtomicUsize::new(0), protected: AtomicUsize::new(0) };
        Self::with_variant(alloc, req_pool, config, variant)
    }

    /// The sliding window, in tokens.
    pub fn window(&self) -> usize {
        self.variant.window
    }

    /// Window tokens of cached nodes without a window lock (SGLang's
    /// `swa_evictable_size`).
    pub fn swa_evictable_size(&self) -> usize {
        self.variant.evictable.load(Ordering::Acquire)
    }

    /// Window tokens of cached nodes under a lease's window lock
    /// (`swa_protected_size`).
    pub fn swa_protected_size(&self) -> usize {
        self.variant.protected.load(Ordering::Acquire)
    }

    /// Cached tokens whose window KV was freed: the tombstones' tokens (a snapshot under
    /// concurrency).
    pub fn tombstone_size(&self) -> usize {
        self.write(|w| {
            let live = w.c.variant.evictable.load(Ordering::Relaxed) + w.c.variant.protected.load(Ordering::Relaxed);
            w.c.total.load(Ordering::Relaxed) - live
        })
    }

    /// The window pass alone: free the window KV of at least `num_tokens` tokens of
    /// nodes without a window lock, least recently used first (an internal node becomes
    /// a tombstone, a leaf is removed whole, with any parent left a childless
    /// tombstone). Returns the window tokens freed.
    pub fn evict_swa(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            return 0;
        }
        let r = self.write(|w| evict_window(w, num_tokens).1);
        crate::debug_check(self);
        r
    }

    /// SGLang's `evict(full_num_tokens, swa_num_tokens)`: remove unlocked leaves for
    /// `full_tokens` (which frees their window KV too), then run the window pass for
    /// what is still missing of `window_tokens`. Returns (full tokens, window tokens)
    /// freed.
    pub fn evict_both(&self, full_tokens: usize, window_tokens: usize) -> (usize, usize) {
        let r = self.write(|w| evict_both(w, full_tokens, window_tokens));
        crate::debug_check(self);
        r
    }

    /// Insert `key -> slots` (whole pages): the plain [`insert`](RadixCache::insert)
    /// with the window rules (see [`SwaInsert`] and the [module docs](self)).
    ///
    /// # Errors
    ///
    /// As the plain insert; nothing changes on error.
    #[cfg(test)]
    pub(crate) fn insert(&self, namespace: u64, key: &[u32], slots: &[u32]) -> Result<SwaInsert, CacheError> {
        let ps = self.ps;
        // A malformed insert (lengths that differ or are not whole pages) goes to the
        // core whole, whose check reports it; a well-formed one is cut after its last
        // page with window KV.
        let shaped = key.len() == slots.len() && key.len() % ps == 0;
        let len = if shaped { live_len(&self.alloc, slots, 0, ps) } else { key.len() };
        let r = self.write(|w| {
            let (key, slots) = if shaped {
                // The pages cut off (no window KV) are not inserted, but they are input
                // all the same: whole pages of allocated slots the tree does not hold, as
                // the core checks the rest.
                check_cut_pages(w, &slots[len..])?;
                (&key[..len], &slots[..len])
            } else {
                (key, slots)
            };
            let (cached, end) = w.insert(namespace, key, slots, 0)?;
            settle(w, &Inserted { end, namespace, key, kv: slots, protected: 0, cached });
            Ok(SwaInsert { cached, inserted: len })
        });
        crate::debug_check(self);
        r
    }

    /// How much of a request's page-aligned tokens an insert takes (see [`SwaInsert`]).
    #[cfg(test)]
    fn request_limit(&self, token_ids: &[u32], row: &ReqRow, lease: &Lease<'_, SwaAllocator, Swa>) -> usize {
        window_limit(self, token_ids, row, lease.len())
    }

    /// SGLang's `cache_finished_req` for SWA models: as the plain cache's
    /// [`cache_finished_req`](RadixCache::cache_finished_req), with the window rules:
    /// tombstones the request brings window KV for are revived, pages whose window KV
    /// the request released become (or stay) tombstones, and trailing pages without
    /// window KV are freed with the tail. The window lock goes with the lease.
    ///
    /// # Errors
    ///
    /// [`Unfinished`] hands the row and lease back with the reason; nothing changed.
    #[cfg(test)]
    pub(crate) fn cache_finished_req<'c>(
        &'c self,
        namespace: u64,
        token_ids: &[u32],
        row: ReqRow,
        lease: Lease<'c, SwaAllocator, Swa>,
    ) -> Result<usize, Unfinished<'c, SwaAllocator, Swa>> {
        let limit = self.request_limit(token_ids, &row, &lease);
        self.finish_with(namespace, token_ids, row, lease, 0, limit, |_| Ok(()), settle).map(|(n, ())| n)
    }

    /// SGLang's `cache_unfinished_req` for SWA models (chunked prefill): as the plain
    /// cache's [`cache_unfinished_req`](RadixCache::cache_unfinished_req), with the
    /// window rules of [`cache_finished_req`](Self::cache_finished_req). The lease then
    /// ends where the inserted tokens end (the request holds their KV, so the window
    /// rule of a match does not apply to it) and `lease.len()` is the new protected
    /// length; trailing pages without window KV stay the request's.
    ///
    /// # Errors
    ///
    /// [`CacheError`]; nothing changed.
    #[cfg(test)]
    pub(crate) fn cache_unfinished_req(
        &self,
        namespace: u64,
        token_ids: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, SwaAllocator, Swa>,
    ) -> Result<(), CacheError> {
        let limit = self.request_limit(token_ids, row, lease);
        self.unfinished_with(&self.req_pool, namespace, token_ids, row, lease, 0, limit, |_| Ok(()), settle)
    }

    /// Free the window KV of a request's tokens that fell out of its window: the whole
    /// pages of its row within `range` (token positions) past the end of its lease
    /// (SGLang's `free_swa` of `req_to_token[req, swa_evicted_seqlen:new_evicted_seqlen]`;
    /// the lease's end is where `swa_evicted_seqlen` starts). The full KV stays; caching
    /// the request later makes those pages tombstones. Pages freed already are
    /// skipped. Returns the window tokens freed.
    ///
    /// # Errors
    ///
    /// [`CacheError::StaleMatch`] for a lease of another cache,
    /// [`CacheError::Row`] for a range past the row, and [`CacheError::RowMismatch`]
    /// naming a slot that is not the request's own (free, or cached by the tree);
    /// nothing changes then.
    pub(crate) fn release_window(
        &self,
        row: &ReqRow,
        lease: &Lease<'_, SwaAllocator, Swa>,
        range: core::ops::Range<usize>,
    ) -> Result<usize, CacheError> {
        if lease.key.cache_id != self.id || !core::ptr::eq(lease.cache, self) {
            return Err(CacheError::StaleMatch);
        }
        let ps = self.ps;
        // The first whole page at or after the range's start (none past `usize::MAX`:
        // the range then holds no whole page).
        let from = range.start.max(lease.len()).div_ceil(ps).checked_mul(ps);
        let to = range.end / ps * ps;
        let Some(from) = from.filter(|&from| from < to) else {
            return Ok(0);
        };
        let kv = self.req_pool.read(row, from..to)?;
        let r = self.write(|w| {
            for (i, &slot) in kv.iter().enumerate() {
                let page = slot / ps as u32;
                let own = page != 0 && page <= w.c.num_pages && w.c.alloc.is_allocated(slot) && !w.in_tree(page);
                if !own {
                    return Err(CacheError::RowMismatch { index: from + i, slot });
                }
            }
            w.c.alloc.free_swa(kv).map_err(|e| CacheError::RowMismatch { index: from, slot: e.index })
        });
        crate::debug_check(self);
        r
    }
}

impl super::Request<SwaAllocator, Swa> {
    /// Free the window KV of the request's tokens in `range` that fell out of its
    /// window (SGLang's sliding-window release during decode): only whole pages past its
    /// lock, and only positions it holds. Returns the window tokens freed.
    ///
    /// # Errors
    ///
    /// [`CacheError::TokenCount`] when `range` goes past [`len`](Self::len); nothing
    /// changes then.
    pub fn release_window(&mut self, range: core::ops::Range<usize>) -> Result<usize, CacheError> {
        if range.end > self.len() {
            return Err(CacheError::TokenCount { tokens: range.end, held: self.len() });
        }
        let (row, key) = self.row_and_lease();
        let lease = core::mem::ManuallyDrop::new(Lease { cache: &**self.cache(), key });
        self.cache().release_window(row, &lease, range)
    }
}

impl fmt::Display for SwaInsert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cached, {} inserted", self.cached, self.inserted)
    }
}

#[cfg(all(test, not(loom)))]
#[path = "tests_swa.rs"]
mod tests;
