//! Tree changes, applied by the latch holder. See the parent module for the protocol.

use core::ops::Range;
use std::collections::HashMap;
use std::fmt::Write as _;

use super::heap::{Heap, Leaves};
use super::variant::Variant;
use super::LatchHeld;
use super::{
    link_of, link_to, page_hash, span_of, CacheError, EvictionPolicy, Inner, KvEvent, Lookup, MatchResult, Meta,
    RadixCache, NIL, ROOT,
};
use crate::alloc::KvAllocator;
use crate::error::{InvalidInput, InvariantViolation};
use crate::req_to_token::Expansion;
use crate::slots::{ascending_from, bit_ends, bit_words};
use crate::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::atomic::Ordering::Relaxed;

/// The latch holder's view: all tree changes go through here (and through the
/// variant's hooks, which receive it).
pub struct Writer<'a, A: KvAllocator, V: Variant> {
    pub(super) c: &'a RadixCache<A, V>,
    pub(super) s: &'a mut Inner<V>,
}

impl<A: KvAllocator, V: Variant> core::fmt::Debug for Writer<'_, A, V> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Writer").finish_non_exhaustive()
    }
}

/// The metadata of a free record.
fn empty<N: Default>() -> Meta<N> {
    Meta {
        lock_ref: 0,
        children: 0,
        heap_pos: NIL,
        last_page: 0,
        last_access: 0,
        created: 0,
        hit_count: 0,
        priority: 0,
        alive: false,
        score: 0,
        want: 0,
        depth: 0,
        ext: N::default(),
    }
}

/// Where a new leaf goes and the chain of pages it takes (see [`Writer::attach_leaf`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct NewLeaf {
    pub parent_page: u32,
    pub namespace: u64,
    pub first: u32,
    pub first_run: u32,
    pub pages: u32,
    pub last: u32,
}

/// What [`Writer::prepare_request`] found: the lease's length and the cached length.
pub(super) struct Prepared {
    pub protected: usize,
    pub cached: usize,
}

fn mismatch_from(offset: usize) -> impl Fn(usize, u32) -> CacheError {
    move |i, slot| CacheError::RowMismatch { index: offset + i, slot }
}

/// How many leading elements of `s` are `first, first + 1, ...`: the first few one by
/// one (short runs are common: a decode step hands each running request one slot, and
/// where a request's next slot was taken its run ends; kvpool's allocator continues runs
/// at page size 1, an allocator that hands out the lowest free slots makes every decode
/// slot a run of one), then 64 at a time with one branch-free pass each (it
/// vectorizes), then one by one.
pub(super) fn ascending_len(s: &[u32], first: u32) -> usize {
    const HEAD: usize = 8;
    let mut n = 0;
    let head = s.len().min(HEAD);
    while n < head && s[n] == first.wrapping_add(n as u32) {
        n += 1;
    }
    if n < head {
        return n;
    }
    while n + 64 <= s.len() && ascending_from(&s[n..n + 64], first.wrapping_add(n as u32)) {
        n += 64;
    }
    while n < s.len() && s[n] == first.wrapping_add(n as u32) {
        n += 1;
    }
    n
}

/// Pages in the run of consecutive pages that starts at page `i` of `slots` (whole
/// pages of a checked shape). At page size 1, blocks of 64 slots are compared with one
/// branch-free pass each (it vectorizes) before the page-by-page tail.
pub(super) fn run_at(slots: &[u32], ps: usize, i: usize) -> usize {
    if ps == 1 {
        return ascending_len(&slots[i..], slots[i]);
    }
    let pages = slots.len() / ps;
    let s0 = slots[i * ps];
    let mut len = 1usize;
    while i + len < pages && slots[(i + len) * ps] == s0.wrapping_add((len * ps) as u32) {
        len += 1;
    }
    len
}

/// The page-aligned positions `t0..t1` of `len` that lie wholly inside `expanded`
/// (empty at page size 1, where a page's first slot is all of it).
fn whole_pages_within(expanded: Range<usize>, ps: usize, len: usize) -> Range<usize> {
    if ps == 1 {
        return 0..0;
    }
    let (t0, t1) = (expanded.start.div_ceil(ps) * ps, expanded.end.min(len) / ps * ps);
    if t0 < t1 {
        t0..t1
    } else {
        0..0
    }
}

/// How many slots of `slots` from `i` continue `slots[i]` one by one (as
/// [`ascending_len`]), given that the first `known` of them do, and that the whole
/// pages at positions `trusted` are each in order already: there only the pages' first
/// slots are compared.
pub(super) fn shape_run(slots: &[u32], i: usize, known: usize, ps: usize, trusted: Range<usize>) -> usize {
    let s0 = slots[i];
    let mut n = known;
    loop {
        let at = i + n;
        if at >= slots.len() {
            return n;
        }
        if trusted.contains(&at) {
            debug_assert_eq!((at - trusted.start) % ps, 0, "runs start on page boundaries");
            let mut k = 0;
            while at + k < trusted.end && slots[at + k] == s0.wrapping_add((n + k) as u32) {
                k += ps;
            }
            n += k;
            if at + k < trusted.end {
                return n;
            }
        } else {
            let end = if at < trusted.start { trusted.start } else { slots.len() };
            let k = ascending_len(&slots[at..end], s0.wrapping_add(n as u32));
            n += k;
            if at + k < end || end == slots.len() {
                return n;
            }
        }
    }
}

/// Runs of consecutive pages recorded per row, at most.
const ROW_RUNS: usize = 64;

/// The runs of consecutive pages of the slots the latch holder last checked
/// ([`Writer::check_shape_from`]), so that the passes that follow in the same change
/// (claiming the pages, cutting the new leaf into runs) look a run up instead of
/// comparing its slots again. Keyed by the checked slice's address; cleared whenever
/// the latch is taken (and before a change rewrites the row it checked), so it only
/// ever describes a slice borrowed, unchanged, for the current change. Fixed capacity:
/// runs past the first [`ROW_RUNS`] are computed as before.
pub(super) struct RowRuns {
    /// Address of the checked slice's first slot (0: nothing recorded).
    base: usize,
    /// End of each run, in slots from `base`.
    ends: [u32; ROW_RUNS],
    count: usize,
}

impl Default for RowRuns {
    fn default() -> Self {
        RowRuns { base: 0, ends: [0; ROW_RUNS], count: 0 }
    }
}

impl RowRuns {
    pub(super) fn clear(&mut self) {
        self.start(0);
    }

    /// Start recording the runs of the slice starting at `base` (an address; 0 records
    /// nothing).
    fn start(&mut self, base: usize) {
        self.base = base;
        self.count = 0;
    }

    /// Record a run ending `end` slots from the start.
    fn push(&mut self, end: usize) {
        if self.count < ROW_RUNS && self.base != 0 {
            self.ends[self.count] = end as u32;
            self.count += 1;
        }
    }

    /// Pages of the run that starts at page `i` of `slots` (at most to the slice's
    /// end), if `slots[i * ps]` lies in the recorded runs.
    #[inline]
    fn lookup(&self, slots: &[u32], ps: usize, i: usize) -> Option<usize> {
        let ends = &self.ends[..self.count];
        let covered = *ends.last()? as usize;
        let off = (slots[i * ps..].as_ptr() as usize).checked_sub(self.base)? / 4;
        if off >= covered {
            return None;
        }
        let end = ends[ends.partition_point(|&e| e as usize <= off)] as usize;
        Some(((end - off) / ps).min(slots.len() / ps - i))
    }
}

/// A row's page shape, checked before the latch was taken
/// ([`RadixCache::check_row_shape`]): the result, and the runs it recorded, which
/// [`Writer::prepare_request`] installs for the passes that follow.
pub(super) struct CheckedShape {
    runs: RowRuns,
    result: Result<(), CacheError>,
}

impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    /// [`check_shape`](Self::check_shape) of a request's row, for
    /// [`Writer::prepare_request`].
    ///
    /// It reads only the row and the cache's geometry, so the request helpers run it
    /// before taking the latch: reading a row another thread wrote (the scheduler's
    /// slots, checked on the output thread) is the slow part of caching a request in
    /// overlap mode, and no other writer should wait for it.
    ///
    /// `expanded`: positions of `slots` that an allocator's expansion wrote and nobody
    /// has written over since ([`ReqToTokenPool::fill_extension`], through
    /// [`RadixCache::alloc_extend_row`]). Their whole pages are whole and in order by
    /// construction, so there only each page's first slot is compared (a sixteenth of
    /// the reads at page size 16); everything else is checked slot by slot.
    ///
    /// [`ReqToTokenPool::fill_extension`]: crate::ReqToTokenPool
    ///
    /// Where the allocator also reported the breaks between the expansion's runs of
    /// consecutive slots ([`KvAllocator::alloc_extend_runs`]), a run there is not read
    /// at all: only its first slot, for the range check.
    pub(super) fn check_row_shape(&self, slots: &[u32], from: usize, expanded: &Expansion) -> CheckedShape {
        let mut runs = RowRuns::default();
        let result = self.check_shape(slots, from, expanded, &mut runs);
        CheckedShape { runs, result }
    }

    /// The page shape of `slots` from slot `from` (page-aligned) on: whole pages, each
    /// page's slots that page's slots in order, in range; the runs of consecutive pages
    /// go into `runs` (keyed by the address of `slots[from..]`).
    fn check_shape(
        &self,
        slots: &[u32],
        from: usize,
        expanded: &Expansion,
        runs: &mut RowRuns,
    ) -> Result<(), CacheError> {
        let ps = self.ps;
        let trusted = whole_pages_within(expanded.shaped.clone(), ps, slots.len());
        let (breaks, known) = (expanded.breaks.at(), expanded.breaks.known().min(slots.len()));
        if slots.len() % ps != 0 {
            return Err(InvalidInput::NotPageAligned { count: slots.len(), page_size: ps as u32 }.into());
        }
        let (lo, hi) = (ps as u32, (self.num_pages + 1).saturating_mul(ps as u32).wrapping_sub(1));
        // A run of consecutive slots at a time: one ascending sequence covers every whole
        // page of a run of consecutive pages, so the check is one branch-free pass per 64
        // slots (it vectorizes), with work per run, not per page.
        debug_assert_eq!(from % ps, 0, "a page-aligned start");
        let mut i = from;
        runs.start(if from < slots.len() { slots[from..].as_ptr() as usize } else { 0 });
        while i < slots.len() {
            let s0 = slots[i];
            let whole = if (expanded.shaped.start..known).contains(&i) {
                // Consecutive up to the next reported break, or at least to `known`.
                let b = breaks.partition_point(|&b| b as usize <= i);
                match breaks.get(b) {
                    Some(&end) if (end as usize) < known => end as usize - i,
                    _ => shape_run(slots, i, known - i, ps, trusted.clone()),
                }
            } else {
                shape_run(slots, i, 0, ps, trusted.clone())
            } / ps
                * ps;
            // A run shorter than a page (`whole == 0`) is refused before its last slot is
            // computed: `s0 + whole - 1` would underflow for `s0 == 0`.
            if whole == 0 || self.page_offset(s0) != 0 || s0 < lo || s0 as u64 + (whole as u64 - 1) > hi as u64 {
                runs.clear();
                return Err(InvalidInput::NotAPage { slot: s0 }.into());
            }
            i += whole;
            runs.push(i - from);
        }
        Ok(())
    }
}

impl<'a, A: KvAllocator, V: Variant> Writer<'a, A, V> {
    /// Pages in the run of consecutive pages that starts at page `i` of `slots` (whole
    /// pages of a checked shape): [`run_at`], or the run the shape check recorded.
    #[inline]
    pub(super) fn row_run(&self, slots: &[u32], i: usize) -> usize {
        let ps = self.c.ps;
        match self.s.row_runs.lookup(slots, ps, i) {
            Some(len) => {
                debug_assert_eq!(len, run_at(slots, ps, i), "a stale recorded run");
                len
            }
            None => run_at(slots, ps, i),
        }
    }

    /// The runs of node `id`, as (first page, pages), in order.
    pub(super) fn runs(&self, id: u32) -> Runs<'a> {
        let c: &'a RadixCache<A, V> = self.c;
        let r = &c.records[id as usize];
        let (first, count) = span_of(r.span.load(Ordering::Relaxed));
        Runs { links: &c.links, page: first, in_run: r.first_run.load(Ordering::Relaxed), left: count }
    }

    /// The runs of a chain of `count` pages from `first`, whose run holds `first_run`
    /// pages from there (a node's own, or a variant's second copy of them).
    pub(super) fn chain(&self, first: u32, first_run: u32, count: u32) -> Runs<'a> {
        let c: &'a RadixCache<A, V> = self.c;
        Runs { links: &c.links, page: first, in_run: first_run, left: count }
    }

    /// The pages of node `id`, in order (introspection and checks).
    pub(super) fn pages(&self, id: u32) -> impl Iterator<Item = u32> + 'a {
        self.runs(id).flat_map(|(start, len)| start..start + len)
    }
}

impl<A: KvAllocator, V: Variant> Writer<'_, A, V> {
    pub(super) fn init(&mut self) {
        let n = self.s.meta.len();
        for m in self.s.meta.iter_mut() {
            *m = empty();
        }
        self.s.meta[ROOT as usize] = Meta { alive: true, lock_ref: 1, priority: i64::MIN, ..empty() };
        self.s.free_ids.clear();
        self.s.free_ids.extend((1..n as u32).rev());
        self.s.heap.clear();
        self.c.in_tree.iter().for_each(|w| w.store(0, Relaxed));
        self.s.page_owner.iter_mut().for_each(|o| *o = NIL);
        self.s.page_owner[0] = ROOT;
        self.c.evictable.store(0, Ordering::Release);
        self.c.protected.store(0, Ordering::Release);
        self.c.total.store(0, Ordering::Release);
        self.event(KvEvent::AllBlocksCleared);
    }

    pub(super) fn heap(&mut self) -> Heap<'_, V::Node, Leaves> {
        Heap::new(&mut self.s.heap, &mut self.s.meta, self.c.policy)
    }

    fn event(&self, e: KvEvent) {
        if let Some(q) = &self.c.events {
            q.push(e);
        }
    }

    pub(super) fn tick(&mut self) -> u64 {
        self.s.clock += 1;
        self.s.clock
    }

    pub(super) fn touch(&mut self, id: u32) {
        debug_assert!(id == ROOT || self.s.meta[id as usize].alive, "touch of a retired node {id}");
        let t = self.tick();
        self.s.meta[id as usize].last_access = t;
        super::hints::touched(self, id);
        self.heap().update(id);
        V::touched(self, id);
    }

    pub(super) fn span(&self, id: u32) -> (u32, u32) {
        span_of(self.c.records[id as usize].span.load(Ordering::Relaxed))
    }

    fn page_hash_of(&self, parent_page: u32, namespace: u64, page: u32) -> u64 {
        let ps = self.c.ps;
        let base = page as usize * ps;
        let mut tokens = [0u32; 64];
        if ps <= tokens.len() {
            for (k, t) in tokens[..ps].iter_mut().enumerate() {
                *t = self.c.slot_token.get(base + k);
            }
            self.c.key_hash(parent_page, namespace, &tokens[..ps])
        } else {
            // Pages larger than the stack buffer hash through an iterator.
            self.c.key_hash_iter(parent_page, namespace, (0..ps).map(|k| self.c.slot_token.get(base + k)))
        }
    }

    pub(super) fn node_of(&self, page: u32) -> &Meta<V::Node> {
        &self.s.meta[self.s.page_owner[page as usize] as usize]
    }

    pub(super) fn in_tree(&self, page: u32) -> bool {
        super::alloc_view::page_bit(&self.c.in_tree, page)
    }

    /// Whether every page of `start..start + len` is in the tree, a word at a time.
    pub(super) fn in_tree_all(&self, start: u32, len: u32) -> bool {
        bit_words(start as usize, len as usize).all(|(w, mask)| self.c.in_tree[w].load(Relaxed) & mask == mask)
    }

    /// Whether no page of `start..start + len` is in the tree, a word at a time.
    fn in_tree_clear(&self, start: u32, len: u32) -> bool {
        let Some((w0, m0, w1, m1)) = bit_ends(start as usize, len as usize) else { return true };
        let t = &self.c.in_tree;
        t[w0].load(Relaxed) & m0 == 0
            && t[w1].load(Relaxed) & m1 == 0
            && t[w0 + 1..w1.max(w0 + 1)].iter().all(|x| x.load(Relaxed) == 0)
    }

    /// Set or clear the in-tree bits of pages `start..start + len`: the end words by
    /// mask, the whole words between them as one fill. Only the latch holder writes
    /// the bits, so a load and a store (no read-modify-write) suffice.
    pub(super) fn set_in_tree_range(&mut self, start: u32, len: u32, on: bool) {
        let Some((w0, m0, w1, m1)) = bit_ends(start as usize, len as usize) else { return };
        let t = &self.c.in_tree;
        let set = |w: usize, m: u64| {
            let x = t[w].load(Relaxed);
            t[w].store(if on { x | m } else { x & !m }, Relaxed);
        };
        set(w0, m0);
        set(w1, m1);
        if w1 > w0 + 1 {
            let fill = if on { u64::MAX } else { 0 };
            t[w0 + 1..w1].iter().for_each(|x| x.store(fill, Relaxed));
        }
    }

    /// Whether `page` still ends a node, in the incarnation `epoch`.
    pub(super) fn is_node_end(&self, page: u32, epoch: u32) -> bool {
        page as usize <= self.c.tree_pages as usize
            && self.s.page_owner[page as usize] != NIL
            && self.s.page_epoch[page as usize] == epoch
            && self.in_tree(page)
    }

    // ---- records and buckets ----

    /// Take a free record and fill it (unpublished, its `gen` still odd).
    fn new_record(
        &mut self,
        first: u32,
        first_run: u32,
        pages: u32,
        parent_page: u32,
        namespace: u64,
        key_hash: u64,
    ) -> u32 {
        let id = self.s.free_ids.pop().expect("a tree over N pages never needs more than N + 1 nodes");
        let r = &self.c.records[id as usize];
        debug_assert!(r.gen.load(Ordering::Relaxed) & 1 == 1);
        // Release: a stale reader that sees any field below also sees the odd `gen`
        // this record was retired with (it then discards what it read).
        fence(Ordering::Release);
        r.span.store((first as u64) << 32 | pages as u64, Ordering::Relaxed);
        r.first_run.store(first_run, Ordering::Relaxed);
        r.parent_page.store(parent_page, Ordering::Relaxed);
        r.namespace.store(namespace, Ordering::Relaxed);
        r.key_hash.store(key_hash, Ordering::Relaxed);
        r.mark.store(0, Ordering::Relaxed);
        id
    }

    /// Publish node `id`'s variant mark to lock-free readers (see
    /// [`Variant::peek_step`]); a reader sees it or the old one.
    pub(super) fn set_mark(&mut self, id: u32, mark: u32) {
        self.c.records[id as usize].mark.store(mark, Ordering::Release);
    }

    fn bucket_of(&self, id: u32) -> usize {
        self.c.records[id as usize].key_hash.load(Ordering::Relaxed) as usize & self.c.bucket_mask
    }

    /// Make a filled record live (`gen` even) and link it at the head of its bucket.
    fn publish(&mut self, id: u32) {
        let r = &self.c.records[id as usize];
        let b = self.bucket_of(id);
        let word = self.c.buckets[b].load(Ordering::Relaxed);
        r.hash_next.store(word as u32, Ordering::Relaxed);
        r.gen.latch_add(1);
        // Release: readers that load this head (Acquire) see the record's fields and
        // the tokens and page links written before.
        self.c.buckets[b].store(word & !0xffff_ffff | id as u64, Ordering::Release);
    }

    /// Find the link that points at `id` in its bucket: `None` for the head.
    fn predecessor(&self, id: u32) -> Option<u32> {
        let b = self.bucket_of(id);
        let mut cur = self.c.buckets[b].load(Ordering::Relaxed) as u32;
        let mut prev = None;
        while cur != id {
            debug_assert!(cur != NIL, "record {id} is not in its bucket");
            prev = Some(cur);
            cur = self.c.records[cur as usize].hash_next.load(Ordering::Relaxed);
        }
        prev
    }

    /// Replace `old` by the filled record `new` (same key hash) in one store.
    fn swap_in(&mut self, old: u32, new: u32) {
        let b = self.bucket_of(old);
        let next = self.c.records[old as usize].hash_next.load(Ordering::Relaxed);
        let r = &self.c.records[new as usize];
        r.hash_next.store(next, Ordering::Relaxed);
        r.gen.latch_add(1);
        // The old record leaves the chain as an unlink would, so the bucket's removal
        // version moves too: a lookup that reached `old` before the swap, then finds it
        // retired and walks off the chain, must see the change and retry instead of
        // reporting a miss of content that stayed cached throughout (found by the loom
        // model `peek_racing_split`).
        let word = self.c.buckets[b].load(Ordering::Relaxed);
        let version = (word >> 32).wrapping_add(1) << 32;
        match self.predecessor(old) {
            None => self.c.buckets[b].store(version | new as u64, Ordering::Release),
            Some(p) => {
                self.c.records[p as usize].hash_next.store(new, Ordering::Release);
                self.c.buckets[b].store(version | (word & 0xffff_ffff), Ordering::Release);
            }
        }
    }

    /// Unlink `id` from its bucket and bump the bucket's removal version, so a lookup
    /// that missed in this bucket meanwhile retries.
    pub(super) fn unlink(&mut self, id: u32) {
        let b = self.bucket_of(id);
        let next = self.c.records[id as usize].hash_next.load(Ordering::Relaxed);
        let prev = self.predecessor(id);
        let word = self.c.buckets[b].load(Ordering::Relaxed);
        let version = (word >> 32).wrapping_add(1) << 32;
        match prev {
            None => self.c.buckets[b].store(version | next as u64, Ordering::Release),
            Some(p) => {
                self.c.records[p as usize].hash_next.store(next, Ordering::Release);
                self.c.buckets[b].store(version | (word & 0xffff_ffff), Ordering::Release);
            }
        }
    }

    /// Retire an unlinked record: readers holding it will fail validation. Must come
    /// before its pages are freed.
    pub(super) fn retire(&mut self, id: u32) {
        // SeqCst: a lookup whose final SeqCst check still sees the old gen is ordered
        // before this retirement, hence before the frees that follow it.
        self.c.records[id as usize].gen.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::Release);
        self.s.meta[id as usize] = empty();
        self.s.free_ids.push(id);
    }

    // ---- operations ----

    /// Walk `key`, touching as SGLang does, splitting a partially matched node.
    ///
    /// The match ends at the deepest place on the matched path where the variant allows
    /// it ([`Variant::walk_step`]; every node for the plain cache); `out` holds slots up
    /// to where the KV matched. Returns the result, its node (`ROOT` for none), the
    /// length the KV matched (whole nodes and the part of the last one) and the result
    /// that would end there (the node the KV match ends at, for a caller that holds
    /// that KV itself).
    pub(super) fn match_path(
        &mut self,
        namespace: u64,
        key: &[u32],
        out: &mut [u32],
    ) -> (MatchResult, u32, usize, MatchResult) {
        let none = MatchResult { len: 0, last_page: 0, epoch: 0, cache_id: self.c.id };
        if key.is_empty() {
            return (none, ROOT, 0, none);
        }
        let ps = self.c.ps;
        if V::TOUCH_WHILE_WALKING {
            self.touch(ROOT);
        }
        let mut walk = V::Walk::default();
        let (mut pos, mut cur) = (0usize, 0u32);
        let (mut best, mut best_len, mut best_page) = (ROOT, 0usize, 0u32);
        while pos < key.len() {
            let Lookup::Found { id, .. } = self.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps]) else {
                break;
            };
            // The next look-up's bucket, if this node matches whole: its parent page is
            // this node's last, its key page the one after this node's pages.
            let next = pos + span_of(self.c.records[id as usize].span.load(Ordering::Relaxed)).1 as usize * ps;
            if next + ps <= key.len() {
                self.c.prefetch_child(self.s.meta[id as usize].last_page, namespace, &key[next..next + ps]);
            }
            self.s.meta[id as usize].hit_count += 1;
            if V::TOUCH_WHILE_WALKING {
                self.touch(id);
            } else if self.c.policy == EvictionPolicy::Lfu {
                // The hit count is LFU's key: re-sort the node now, since the touch of the
                // returned path below may not reach it.
                self.heap().update(id);
                V::touched(self, id);
            }
            let (m, last, n) = self.c.match_in_node::<true>(id, &key[pos..], &mut out[pos..]);
            pos += m * ps;
            cur = last;
            let node = if m < n { self.split(id, m) } else { id };
            if self.c.variant.walk_step(&mut walk, &self.s.meta[node as usize].ext, m * ps) {
                (best, best_len, best_page) = (node, pos, last);
            }
            if m < n {
                break;
            }
        }
        if !V::TOUCH_WHILE_WALKING {
            self.touch_path(best);
        }
        let epoch = self.s.page_epoch[best_page as usize];
        let kv_end =
            MatchResult { len: pos, last_page: cur, epoch: self.s.page_epoch[cur as usize], cache_id: self.c.id };
        (MatchResult { len: best_len, last_page: best_page, epoch, cache_id: self.c.id }, best, pos, kv_end)
    }

    /// Refresh the recency of `id` and its ancestors, the root oldest and `id` newest
    /// (as if touched from the root down), with one tick each.
    pub(super) fn touch_path(&mut self, id: u32) {
        debug_assert!(id == ROOT || self.s.meta[id as usize].alive, "touch_path of a retired node {id}");
        let mut depth = 0u64;
        let mut x = id;
        while x != ROOT {
            depth += 1;
            x = self.parent_of(x);
        }
        let newest = self.s.clock + depth + 1;
        self.s.clock = newest;
        let (mut x, mut t) = (id, newest);
        loop {
            self.s.meta[x as usize].last_access = t;
            super::hints::touched(self, x);
            self.heap().update(x);
            V::touched(self, x);
            if x == ROOT {
                break;
            }
            x = self.parent_of(x);
            t -= 1;
        }
    }

    /// Cut node `id` after `m` pages; returns the new upper node.
    pub(super) fn split(&mut self, id: u32, m: usize) -> u32 {
        let (first, n) = self.span(id);
        let r = &self.c.records[id as usize];
        let (parent_page, namespace, key_hash) = (
            r.parent_page.load(Ordering::Relaxed),
            r.namespace.load(Ordering::Relaxed),
            r.key_hash.load(Ordering::Relaxed),
        );
        let first_run = self.c.records[id as usize].first_run.load(Ordering::Relaxed);
        let (cut, lower_first, lower_run) = self.cut_chain(first, first_run, n, m);
        let upper = self.new_record(first, first_run, m as u32, parent_page, namespace, key_hash);
        let lower_hash = self.page_hash_of(cut, namespace, lower_first);
        let lower = self.new_record(lower_first, lower_run, n - m as u32, cut, namespace, lower_hash);
        let mark = self.c.records[id as usize].mark.load(Ordering::Relaxed);
        self.set_mark(upper, mark);
        self.set_mark(lower, mark);
        // The lower part is reachable only through the upper one, which is not yet
        // published: linking it first is invisible.
        self.publish(lower);
        // One store replaces the old node by the upper part for every reader.
        self.swap_in(id, upper);
        let mut old = self.s.meta[id as usize];
        self.heap().replace(id, lower);
        self.retire(id);
        let heap_pos = self.s.meta[lower as usize].heap_pos;
        let upper_ext = V::split_payload(&mut old.ext);
        self.s.meta[lower as usize] = Meta { heap_pos, ..old };
        let t = self.tick();
        // The core counts resident children only (see `Variant::resident`).
        let children = u32::from(V::resident(&old.ext));
        self.s.meta[upper as usize] =
            Meta { children, heap_pos: NIL, last_page: cut, last_access: t, created: t, ext: upper_ext, ..old };
        self.s.page_owner[cut as usize] = upper;
        self.s.page_epoch[cut as usize] = self.s.page_epoch[cut as usize].wrapping_add(1);
        self.s.page_owner[old.last_page as usize] = lower;
        super::hints::split(self, upper, lower);
        V::split(self, id, upper, lower);
        upper
    }

    /// Where a chain (see [`chain`](Self::chain)) is cut after `m` pages (`0 < m <
    /// count`): the cut page (its `m`-th) and the rest's first page and run from there.
    pub(super) fn cut_chain(&self, first: u32, first_run: u32, count: u32, m: usize) -> (u32, u32, u32) {
        // Walk whole runs (`run`: the pages of the run from `start`), not the chain's
        // clamped view of them: the cut keeps the rest of its run.
        let (mut at, mut start, mut run) = (0usize, first, first_run);
        while at < count as usize && run > 0 {
            if at + run as usize >= m {
                let off = (m - 1 - at) as u32;
                let cut = start + off;
                return if off + 1 < run {
                    (cut, cut + 1, run - off - 1)
                } else {
                    let (next, next_run) = link_of(self.c.links[(start + run - 1) as usize].load(Ordering::Relaxed));
                    (cut, next, next_run)
                };
            }
            at += run as usize;
            (start, run) = link_of(self.c.links[(start + run - 1) as usize].load(Ordering::Relaxed));
        }
        debug_assert!(false, "a chain of {count} pages cut after {m}");
        (0, 0, 0)
    }

    /// Link runs `(start, len)` into a chain: a link from each run's last page to the
    /// next run (its first page and length). Returns (first page, its run, last page).
    /// The pages' tokens are the caller's to write.
    pub(super) fn link_runs(&mut self, runs: impl Iterator<Item = (u32, u32)>) -> (u32, u32, u32) {
        let (mut first, mut first_run, mut last) = (0u32, 0u32, 0u32);
        for (start, len) in runs {
            if first == 0 {
                (first, first_run) = (start, len);
            } else {
                self.c.links[last as usize].store(link_to(start, len), Ordering::Relaxed);
            }
            last = start + len - 1;
        }
        if last != 0 {
            self.c.links[last as usize].store(0, Ordering::Relaxed);
        }
        (first, first_run, last)
    }

    /// Give the live node `id` new pages (`count` pages from `first`, a chain whose
    /// tokens are written already) and a new parent page, keeping its id, metadata and
    /// children: readers holding it fail validation (its `gen` moves, with `SeqCst`, as
    /// a retirement's), and it is unlinked and published again under its new key (the
    /// bucket's removal version moves, so a lookup that missed it meanwhile retries),
    /// with the variant mark `mark`.
    /// The caller frees the old pages afterwards and keeps `page_owner` and the
    /// children's parent pages right.
    pub(super) fn republish(&mut self, id: u32, first: u32, first_run: u32, parent_page: u32, mark: u32) {
        let count = self.span(id).1;
        let namespace = self.c.records[id as usize].namespace.load(Ordering::Relaxed);
        self.unlink(id);
        let r = &self.c.records[id as usize];
        r.gen.fetch_add(1, Ordering::SeqCst);
        // Release: a stale reader that sees a field below also sees the odd `gen`.
        fence(Ordering::Release);
        r.span.store((first as u64) << 32 | count as u64, Ordering::Relaxed);
        r.first_run.store(first_run, Ordering::Relaxed);
        r.parent_page.store(parent_page, Ordering::Relaxed);
        // The mark goes with the new view: a reader that validates the new `gen` sees
        // it (set after publishing, a reader could pair the new pages with the old
        // mark: the loom model `peek_racing_republish` found host pages returned as
        // device slots that way).
        r.mark.store(mark, Ordering::Relaxed);
        let h = self.page_hash_of(parent_page, namespace, first);
        self.c.records[id as usize].key_hash.store(h, Ordering::Relaxed);
        self.publish(id);
    }

    /// Read-only walk: how many leading tokens of `key` are cached (resident).
    #[cfg(test)]
    pub(super) fn cached_len(&self, namespace: u64, key: &[u32]) -> usize {
        let ps = self.c.ps;
        let (mut pos, mut cur) = (0usize, 0u32);
        while pos < key.len() {
            let Lookup::Found { id, .. } = self.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps]) else {
                break;
            };
            if !V::resident(&self.s.meta[id as usize].ext) {
                break; // the host tier: not on the device, so not a duplicate
            }
            let (m, last, n) = self.c.count_in_node(id, &key[pos..]);
            pos += m * ps;
            if m < n {
                break;
            }
            cur = last;
        }
        pos
    }

    /// The shape an insert needs: as many slots as tokens, whole pages, each page's slots
    /// that page's slots in order, in range.
    #[cfg(test)]
    pub(super) fn check_insert_shape(&mut self, key: &[u32], slots: &[u32]) -> Result<(), CacheError> {
        self.check_shape_from(key, slots, 0)
    }

    /// [`check_insert_shape`](Self::check_insert_shape) with the page shapes checked
    /// only from slot `from` (page-aligned) on: the caller compares `slots[..from]` with
    /// the tree's own slots, which are whole pages. Records the runs for the passes that
    /// follow ([`RowRuns`]).
    #[cfg(test)]
    pub(super) fn check_shape_from(&mut self, key: &[u32], slots: &[u32], from: usize) -> Result<(), CacheError> {
        if key.len() != slots.len() {
            return Err(InvalidInput::LengthMismatch { what: "slots", got: slots.len(), expected: key.len() }.into());
        }
        self.c.check_shape(slots, from, &Expansion::NONE, &mut self.s.row_runs)
    }

    /// Mark the whole pages of `slots` (checked shape) as held by the tree, after checking
    /// that each is allocated and not held already; on error nothing stays marked and the
    /// error names the first slot of the offending page.
    pub(super) fn claim_pages(
        &mut self,
        slots: &[u32],
        err: impl Fn(usize, u32) -> CacheError,
    ) -> Result<(), CacheError> {
        let ps = self.c.ps;
        let pages = slots.len() / ps;
        let mut i = 0;
        // A run of consecutive pages at a time: one word of the in-tree bitmap and one
        // of the allocator's per 64 pages.
        while i < pages {
            let len = self.row_run(slots, i);
            let start = self.c.page_of(slots[i * ps]);
            if !self.in_tree_clear(start, len as u32) || !self.c.alloc.pages_allocated(start, len as u32) {
                // Name the first offending page of the run.
                let bad = (0..len)
                    .find(|&k| {
                        let page = start + k as u32;
                        self.in_tree(page) || !self.c.alloc.pages_allocated(page, 1)
                    })
                    .unwrap_or(0);
                self.unclaim_pages(&slots[..i * ps]);
                return Err(err((i + bad) * ps, slots[(i + bad) * ps]));
            }
            self.set_in_tree_range(start, len as u32, true);
            i += len;
        }
        Ok(())
    }

    pub(super) fn unclaim_pages(&mut self, slots: &[u32]) {
        let ps = self.c.ps;
        let pages = slots.len() / ps;
        let mut i = 0;
        while i < pages {
            let len = self.row_run(slots, i);
            self.set_in_tree_range(self.c.page_of(slots[i * ps]), len as u32, false);
            i += len;
        }
    }

    #[cfg(test)]
    pub(super) fn insert(
        &mut self,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
    ) -> Result<(usize, u32), CacheError> {
        self.check_insert_shape(key, slots)?;
        let cached = self.cached_len(namespace, key);
        self.claim_pages(&slots[cached..], |_, slot| CacheError::SlotNotOwned { slot })?;
        let end = self.apply_insert(namespace, key, slots, priority, cached);
        Ok((cached, end))
    }

    /// Check a request about to be cached, before anything changes (the request helpers'
    /// half of an insert). `key` is the page-aligned part of its tokens, `kv` its row
    /// (all its tokens, the tail included). Checks, in O(pages):
    ///
    /// * the lease's prefix: the row holds the tree's own slots there, and the lease's
    ///   node ends exactly there on `key`'s path;
    /// * the duplicates (tokens the tree holds beyond the lease): the row's pages there
    ///   are the request's — allocated, not the tree's, each listed once;
    /// * the new pages: allocated, not the tree's (they are marked as the tree's);
    /// * with `tail`, the unaligned tail: allocated, not the tree's, not a page being
    ///   cached or freed as a duplicate.
    ///
    /// On success the new pages are marked as in the tree (as [`insert`](Self::insert)'s
    /// claim does) and [`apply_insert`](Self::apply_insert) must follow.
    ///
    /// `shape`: [`RadixCache::check_row_shape`] of `kv[..key.len()]` from the lease's
    /// end, run by the caller before it took the latch. `vouched`: how many leading
    /// positions of `kv` the cache itself wrote with this lease's path (see
    /// [`RadixCache::match_and_lock_row`]); they are not compared again.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prepare_request(
        &mut self,
        namespace: u64,
        key: &[u32],
        kv: &[u32],
        lease: super::LeaseKey,
        tail: bool,
        shape: CheckedShape,
        vouched: usize,
    ) -> Result<Prepared, CacheError> {
        let ps = self.c.ps;
        let aligned = key.len();
        let protected = lease.len;
        // The lease must still hold its lock (as `release` checks): its node ends where
        // it did, in the same incarnation, and is locked.
        if lease.last_page != 0
            && (!self.is_node_end(lease.last_page, lease.epoch) || self.node_of(lease.last_page).lock_ref == 0)
        {
            return Err(CacheError::StaleMatch);
        }
        // The leased prefix is compared with the tree's slots below (whole pages).
        self.s.row_runs = shape.runs;
        shape.result?;
        let mismatch = |index: usize, slot: u32| CacheError::RowMismatch { index, slot };
        // Walk the cached part of the key, comparing it with the tree token by token, and
        // the leased prefix with the row. The leased nodes are compared with the key too:
        // a lease names the path a match locked, not the tokens the request is finished
        // with, and a key that leaves that path inside a leased node must be refused here
        // (the insert would cut the node where the key leaves it and take the tree's own
        // slots as new pages, or the chunk's new lease would not reach the inserted key).
        let (mut pos, mut cur) = (0usize, 0u32);
        let mut bad = None;
        while pos < aligned {
            let Lookup::Found { id, .. } = self.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps]) else {
                break;
            };
            if !V::resident(&self.s.meta[id as usize].ext) {
                // The host tier: what is cached past here is not on the device, so the
                // request's pages there are not duplicates (the variant's insert hands
                // them to those nodes).
                break;
            }
            let check_row = |at: usize, page: u32, pages: usize| {
                // The row must hold the tree's slots (consecutive in a run) where leased,
                // past what the cache wrote there itself for this lease (`vouched`).
                let start = pos + at * ps;
                let (from, to) = (start.max(vouched), (start + pages * ps).min(protected));
                if bad.is_none() && from < to {
                    let base = page * ps as u32 + (from - start) as u32;
                    if !ascending_from(&kv[from..to], base) {
                        let off = kv[from..to].iter().zip(base..).position(|(&s, t)| s != t);
                        bad = off.map(|k| from + k);
                    }
                }
            };
            let (m, last, n) = self.c.walk_node::<true>(id, &key[pos..], check_row);
            if let Some(index) = bad {
                return Err(mismatch(index, kv[index]));
            }
            pos += m * ps;
            if m < n {
                break;
            }
            cur = last;
        }
        let cached = pos;
        let lease_end = if protected == 0 { 0 } else { kv[protected - 1] / ps as u32 };
        if cached < protected || lease_end != lease.last_page {
            let at = protected.saturating_sub(1);
            return Err(mismatch(at, kv.get(at).copied().unwrap_or(0)));
        }
        // Mark the duplicates and the new pages; a page listed twice, or one the tree
        // holds, fails the mark. Duplicates are unmarked again below.
        self.claim_pages(&kv[protected..cached], mismatch_from(protected))?;
        if let Err(e) = self.claim_pages(&kv[cached..aligned], |_, slot| CacheError::SlotNotOwned { slot }) {
            self.unclaim_pages(&kv[protected..cached]);
            return Err(e);
        }
        let tail_ok = if tail {
            kv[aligned..].iter().enumerate().try_for_each(|(i, &slot)| {
                let page = slot / ps as u32;
                let owned =
                    page != 0 && page <= self.c.num_pages && !self.in_tree(page) && self.c.alloc.is_allocated(slot);
                if owned {
                    Ok(())
                } else {
                    Err(mismatch(aligned + i, slot))
                }
            })
        } else {
            Ok(())
        };
        self.unclaim_pages(&kv[protected..cached]);
        if let Err(e) = tail_ok {
            self.unclaim_pages(&kv[cached..aligned]);
            return Err(e);
        }
        Ok(Prepared { protected, cached })
    }

    /// Insert `key -> slots` whose first `cached` tokens the tree holds and whose other
    /// pages are claimed (checked and marked). Returns the node the key ends at (the
    /// new leaf, or the node the cached part ends at, split there if need be; `ROOT`
    /// for an empty key).
    pub(super) fn apply_insert(
        &mut self,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
        cached: usize,
    ) -> u32 {
        let ps = self.c.ps;
        self.touch(ROOT);
        // The caller has compared the first `cached` tokens with the tree already: this
        // walk only finds the nodes (one hash lookup each), touches them and splits the
        // last one where the cached part ends, without comparing tokens again.
        let (mut pos, mut cur, mut end) = (0usize, 0u32, ROOT);
        while pos < cached {
            let Lookup::Found { id, .. } = self.c.find_child_in::<true>(cur, namespace, &key[pos..pos + ps]) else {
                debug_assert!(false, "the cached prefix of an insert is in the tree");
                break;
            };
            self.touch(id);
            let n = self.span(id).1 as usize;
            let m = n.min((cached - pos) / ps);
            pos += m * ps;
            let node = if m < n { self.split(id, m) } else { id };
            end = node;
            cur = self.s.meta[node as usize].last_page;
            let meta = &mut self.s.meta[node as usize];
            if priority > meta.priority {
                meta.priority = priority;
                self.heap().update(node);
            }
            if m < n {
                break;
            }
        }
        debug_assert_eq!(pos, cached);
        if pos < key.len() {
            end = self.new_leaf(cur, namespace, &key[pos..], &slots[pos..], priority);
        }
        end
    }

    /// Returns the new leaf.
    pub(super) fn new_leaf(
        &mut self,
        parent_page: u32,
        namespace: u64,
        key: &[u32],
        slots: &[u32],
        priority: i64,
    ) -> u32 {
        let ps = self.c.ps;
        let pages = key.len() / ps;
        // The bucket the leaf goes into, asked for now: its line is cold in a large
        // cache, and the copy of the leaf's tokens below hides the miss.
        let h = self.c.key_hash(parent_page, namespace, &key[..ps]);
        self.c.prefetch_bucket(h);
        if self.c.events.is_some() {
            let mut prev_hash = (parent_page != 0).then(|| self.s.digests[parent_page as usize]);
            let seed = if parent_page == 0 { super::events::namespace_seed(namespace) } else { None };
            for (i, (chunk, slot)) in key.chunks_exact(ps).zip(slots.iter().step_by(ps)).enumerate() {
                let page = slot / ps as u32;
                let h = page_hash(prev_hash.as_ref().or(seed.as_ref()), chunk);
                self.s.digests[page as usize] = h;
                self.event(KvEvent::BlockStored { hash: h, parent: prev_hash, page, namespace });
                prev_hash = Some(h);
                debug_assert!(i < pages);
            }
        }
        // Release: a reader that sees any token or link stored below (and then validates
        // with an Acquire fence) is ordered after whatever freed and recycled the pages.
        fence(Ordering::Release);
        // Cut the pages into runs of consecutive pages: tokens are copied a run at a
        // time, and only run starts (length) and run ends (link) get bookkeeping.
        let (mut i, mut prev_end, mut first_run, mut last) = (0usize, 0u32, 0u32, 0u32);
        while i < pages {
            let start = self.c.page_of(slots[i * ps]);
            let len = self.row_run(slots, i);
            let base = start as usize * ps;
            self.c.slot_token.write(base, &key[i * ps..(i + len) * ps]);
            if i == 0 {
                first_run = len as u32;
            } else {
                self.c.links[prev_end as usize].store(link_to(start, len as u32), Ordering::Relaxed);
            }
            prev_end = start + len as u32 - 1;
            last = prev_end;
            i += len;
        }
        self.c.links[last as usize].store(0, Ordering::Relaxed);
        let first = slots[0] / ps as u32;
        let leaf = NewLeaf { parent_page, namespace, first, first_run, pages: pages as u32, last };
        self.attach_hashed(leaf, h, priority, 0, true)
    }

    /// Publish a new leaf whose pages (linked, their tokens written) are `leaf`'s, with
    /// the variant mark `mark` set before any reader can see the record. A resident
    /// leaf counts in the core's sizes and eviction order; a non-resident one (a
    /// variant's: the host tier's host-only nodes) does not. `first_page` is the key's
    /// first page of tokens.
    pub(super) fn attach_leaf(
        &mut self,
        leaf: NewLeaf,
        first_page: &[u32],
        priority: i64,
        mark: u32,
        resident: bool,
    ) -> u32 {
        let h = self.c.key_hash(leaf.parent_page, leaf.namespace, first_page);
        self.attach_hashed(leaf, h, priority, mark, resident)
    }

    /// [`attach_leaf`](Self::attach_leaf) with the key hash of the leaf's first page
    /// (`h`) already computed.
    fn attach_hashed(&mut self, leaf: NewLeaf, h: u64, priority: i64, mark: u32, resident: bool) -> u32 {
        let NewLeaf { parent_page, namespace, first, first_run, pages, last } = leaf;
        let id = self.new_record(first, first_run, pages, parent_page, namespace, h);
        self.c.records[id as usize].mark.store(mark, Ordering::Relaxed);
        self.publish(id);
        let t = self.tick();
        self.s.meta[id as usize] =
            Meta { alive: true, last_page: last, last_access: t, created: t, priority, ..empty() };
        self.s.page_owner[last as usize] = id;
        self.s.page_epoch[last as usize] = self.s.page_epoch[last as usize].wrapping_add(1);
        if resident {
            let parent = self.s.page_owner[parent_page as usize];
            super::hints::attached(self, id, parent);
            self.s.meta[parent as usize].children += 1;
            self.heap().remove(parent);
            super::hints::touched(self, id);
            self.heap().push(id);
            let len = pages as usize * self.c.ps;
            self.c.evictable.latch_add(len);
            self.c.total.latch_add(len);
        }
        id
    }

    pub(super) fn parent_of(&self, id: u32) -> u32 {
        let pp = self.c.records[id as usize].parent_page.load(Ordering::Relaxed);
        self.s.page_owner[pp as usize]
    }

    pub(super) fn len_of(&self, id: u32) -> usize {
        self.span(id).1 as usize * self.c.ps
    }

    /// Lock the path ending at `m`'s node: a lease's key.
    pub(super) fn lease_of(&mut self, m: &MatchResult) -> super::LeaseKey {
        let aux = self.inc_lock(m.last_page);
        self.s.leases += usize::from(m.last_page != 0);
        super::LeaseKey { last_page: m.last_page, epoch: m.epoch, len: m.len, aux, cache_id: self.c.id }
    }

    /// Release the lock of a lease from [`lease_of`](Self::lease_of).
    pub(super) fn unlock_lease(&mut self, key: &super::LeaseKey) {
        debug_assert!(self.s.leases > 0 || key.last_page == 0, "a lease released twice");
        self.s.leases = self.s.leases.saturating_sub(usize::from(key.last_page != 0));
        self.dec_lock(key.last_page, key.aux);
    }

    /// Lock the path ending at the node whose last page is `last_page`; returns the
    /// variant's datum for [`dec_lock`](Self::dec_lock).
    pub(super) fn inc_lock(&mut self, last_page: u32) -> u64 {
        if last_page == 0 {
            return 0;
        }
        let mut id = self.s.page_owner[last_page as usize];
        let aux = V::lock_end(self, id);
        while id != ROOT {
            if self.s.meta[id as usize].lock_ref == 0 {
                let len = self.len_of(id);
                self.c.evictable.latch_sub(len);
                self.c.protected.latch_add(len);
                self.heap().remove(id);
            }
            self.s.meta[id as usize].lock_ref += 1;
            id = self.parent_of(id);
        }
        aux
    }

    pub(super) fn dec_lock(&mut self, last_page: u32, aux: u64) {
        if last_page == 0 {
            return;
        }
        let mut id = self.s.page_owner[last_page as usize];
        V::unlock_end(self, id, aux);
        while id != ROOT {
            let m = &mut self.s.meta[id as usize];
            debug_assert!(m.lock_ref > 0);
            m.lock_ref -= 1;
            if m.lock_ref == 0 {
                let leaf = m.children == 0;
                let len = self.len_of(id);
                self.c.evictable.latch_add(len);
                self.c.protected.latch_sub(len);
                if leaf {
                    self.heap().push(id);
                }
            }
            id = self.parent_of(id);
        }
    }

    pub(super) fn evict(&mut self, num_tokens: usize) -> usize {
        let mut freed = 0usize;
        let mut group = self.c.alloc.free_group();
        super::hints::expire(self);
        while freed < num_tokens {
            let Some(x) = self.heap().pop() else { break };
            if super::hints::deferred(self, x) {
                continue;
            }
            freed += V::evict_leaf(self, x, num_tokens - freed, &mut group);
        }
        group.end();
        freed
    }

    /// Remove the unlocked leaf `x`, which is in the eviction order (see
    /// [`remove_leaf`](Self::remove_leaf)).
    pub(super) fn remove_evictable_leaf(&mut self, x: u32, group: &mut crate::alloc::KvFreeGroup<'_>) -> usize {
        self.heap().remove(x);
        self.remove_leaf(x, group)
    }

    /// Remove the unlocked leaf `x` (out of the eviction order already) with its
    /// payload, freeing its pages into `group`; a parent left childless and unlocked
    /// becomes evictable, or goes too if it is a tombstone (a leaf never is one).
    /// Returns the tokens freed.
    pub(super) fn remove_leaf(&mut self, mut x: u32, group: &mut crate::alloc::KvFreeGroup<'_>) -> usize {
        let ps = self.c.ps;
        let mut freed = 0usize;
        loop {
            debug_assert!(x != ROOT && self.s.meta[x as usize].children == 0 && self.s.meta[x as usize].lock_ref == 0);
            let count = self.span(x).1;
            let parent = self.parent_of(x);
            let last_page = self.s.meta[x as usize].last_page;
            V::removing(self, x);
            // Unpublish and retire before any page is freed (see the module docs).
            self.unlink(x);
            self.retire(x);
            // One pass over the runs: the in-tree bits and events per run, the
            // allocator's bits gathered per word (a fragmented leaf is many short runs).
            let runs = self.runs(x).inspect(|&(start, len)| {
                self.set_in_tree_range(start, len, false);
                if self.c.events.is_some() {
                    for page in start..start + len {
                        self.event(KvEvent::BlockRemoved { hash: self.s.digests[page as usize], page });
                    }
                }
            });
            let r = group.free_page_runs(runs);
            debug_assert!(r.is_ok(), "evicted pages are owned by the tree: {r:?}");
            self.s.page_owner[last_page as usize] = NIL;
            let len = count as usize * ps;
            self.c.evictable.latch_sub(len);
            self.c.total.latch_sub(len);
            freed += len;
            let pm = &mut self.s.meta[parent as usize];
            pm.children -= 1;
            if parent == ROOT || pm.children != 0 || pm.lock_ref != 0 {
                return freed;
            }
            if !V::is_tombstone(&pm.ext) {
                self.heap().push(parent);
                return freed;
            }
            x = parent;
        }
    }

    pub(super) fn reset(&mut self) {
        let ps = self.c.ps;
        let kept = V::kept_at_reset(self);
        let keep = |p: u32| kept.get(p as usize / 64).is_some_and(|w| w >> (p % 64) & 1 != 0);
        let mut group = self.c.alloc.free_group();
        for id in 1..self.s.meta.len() as u32 {
            if !self.s.meta[id as usize].alive {
                continue;
            }
            V::removing(self, id);
            // The variant's own pages (past the allocator's) are its to free, and so
            // are the device pages it keeps.
            for page in self.pages(id).filter(|&p| p <= self.c.num_pages && !keep(p)) {
                let r = group.free(&[page * ps as u32]);
                debug_assert!(r.is_ok());
            }
            self.c.records[id as usize].gen.fetch_add(1, Ordering::SeqCst);
        }
        group.end();
        V::reset(self);
        // A new incarnation of every page: a lease or match from before (detached, or
        // a `MatchResult`) no longer names a node end, even where the same page ends a
        // node again, so it is refused (`StaleMatch`) everywhere.
        self.s.page_epoch.iter_mut().for_each(|e| *e = e.wrapping_add(1));
        for b in self.c.buckets.iter() {
            let w = b.load(Ordering::Relaxed);
            b.store(((w >> 32).wrapping_add(1) << 32) | NIL as u64, Ordering::Release);
        }
        self.init();
    }

    // ---- introspection ----

    fn first_tokens(&self, id: u32, max: usize) -> Vec<u32> {
        let mut out = self.node_tokens(id).0;
        out.truncate(max);
        out
    }

    fn children_map(&self) -> HashMap<u32, Vec<u32>> {
        let mut map: HashMap<u32, Vec<u32>> = HashMap::new();
        for id in 1..self.s.meta.len() as u32 {
            if self.s.meta[id as usize].alive {
                map.entry(self.parent_of(id)).or_default().push(id);
            }
        }
        for v in map.values_mut() {
            v.sort_by_key(|&id| self.first_tokens(id, usize::MAX));
        }
        map
    }

    fn node_tokens(&self, id: u32) -> (Vec<u32>, Vec<u32>) {
        let ps = self.c.ps;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for page in self.pages(id) {
            for slot in page as usize * ps..(page as usize + 1) * ps {
                k.push(self.c.slot_token.get(slot));
                v.push(slot as u32);
            }
        }
        (k, v)
    }

    pub(super) fn leaf_paths(&self) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        for id in 1..self.s.meta.len() as u32 {
            let m = &self.s.meta[id as usize];
            if !m.alive || m.children != 0 {
                continue;
            }
            let ns = self.c.records[id as usize].namespace.load(Ordering::Relaxed);
            let (mut keys, mut vals) = (Vec::new(), Vec::new());
            let mut x = id;
            while x != ROOT {
                let (k, v) = self.node_tokens(x);
                keys.splice(0..0, k);
                vals.splice(0..0, v);
                x = self.parent_of(x);
            }
            out.push((ns, keys, vals));
        }
        out.sort();
        out
    }

    pub(super) fn pretty(&self) -> String {
        let map = self.children_map();
        let mut s = String::new();
        let mut stack = vec![(ROOT, 0usize)];
        while let Some((id, depth)) = stack.pop() {
            if id != ROOT {
                let m = &self.s.meta[id as usize];
                let ns = self.c.records[id as usize].namespace.load(Ordering::Relaxed);
                let _ = write!(
                    s,
                    "{:indent$}{} {:?}{} r={}",
                    "",
                    self.len_of(id),
                    self.first_tokens(id, 10),
                    if self.len_of(id) > 10 { "..." } else { "" },
                    m.lock_ref,
                    indent = 2 * (depth - 1)
                );
                if ns != 0 {
                    let _ = write!(s, " ns={ns}");
                }
                V::describe(&m.ext, &mut s);
                s.push('\n');
            }
            if let Some(children) = map.get(&id) {
                for &c in children.iter().rev() {
                    stack.push((c, depth + 1));
                }
            }
        }
        let _ = writeln!(
            s,
            "#tokens: {} (evictable {}, protected {})",
            self.c.total.load(Ordering::Relaxed),
            self.c.evictable.load(Ordering::Relaxed),
            self.c.protected.load(Ordering::Relaxed)
        );
        s
    }

    pub(super) fn check(&self) -> Result<(), InvariantViolation> {
        self.check_inner().map_err(InvariantViolation)
    }

    fn check_inner(&self) -> Result<(), String> {
        let ps = self.c.ps;
        let mut owner_of_page = vec![NIL; self.c.tree_pages as usize + 1];
        let (mut total, mut evictable, mut protected) = (0usize, 0usize, 0usize);
        let mut children = vec![0u32; self.s.meta.len()];
        let mut live = 0usize;
        for id in 1..self.s.meta.len() as u32 {
            let m = &self.s.meta[id as usize];
            let gen = self.c.records[id as usize].gen.load(Ordering::Relaxed);
            if !m.alive {
                if gen & 1 == 0 {
                    return Err(format!("free record {id} has an even gen"));
                }
                continue;
            }
            live += 1;
            if gen & 1 == 1 {
                return Err(format!("live node {id} has an odd gen"));
            }
            let (first, count) = self.span(id);
            if count == 0 {
                return Err(format!("node {id} is empty"));
            }
            // Walk the runs by hand, bounds-checked: a corrupt link is reported, not a panic.
            let np = self.c.tree_pages;
            let resident = V::resident(&m.ext);
            let (mut start, mut in_run) = (first, self.c.records[id as usize].first_run.load(Ordering::Relaxed));
            let (mut seen, mut page) = (0u32, 0u32);
            while seen < count {
                let len = in_run.min(count - seen);
                if len == 0 || start == 0 || start as u64 + len as u64 - 1 > np as u64 {
                    return Err(format!("node {id} has a bad run ({start}, {len}) after {seen} pages"));
                }
                for p in start..start + len {
                    page = p;
                    if owner_of_page[page as usize] != NIL {
                        return Err(format!("page {page} is in nodes {} and {id}", owner_of_page[page as usize]));
                    }
                    owner_of_page[page as usize] = id;
                    if !self.in_tree(page) {
                        return Err(format!("page {page} of node {id} is not marked in the tree"));
                    }
                    // The variant checks its own pages (past the allocator's).
                    if page <= self.c.num_pages && !self.c.alloc.is_allocated(page * ps as u32) {
                        return Err(format!("page {page} of node {id} is free in the allocator"));
                    }
                }
                seen += len;
                if seen < count {
                    (start, in_run) = link_of(self.c.links[page as usize].load(Ordering::Relaxed));
                    if start == 0 || start > np {
                        return Err(format!("node {id} links to page {start}"));
                    }
                }
            }
            if page != m.last_page || self.s.page_owner[page as usize] != id {
                return Err(format!("node {id} ends on page {page}, recorded {}", m.last_page));
            }
            let parent = self.parent_of(id);
            if parent == NIL || !self.s.meta[parent as usize].alive {
                return Err(format!("node {id} has no live parent"));
            }
            if self.s.meta[parent as usize].lock_ref < m.lock_ref && parent != ROOT {
                return Err(format!("node {id} has more locks than its parent"));
            }
            let len = count as usize * ps;
            // Only resident nodes count (see `Variant::resident`).
            if resident {
                children[parent as usize] += 1;
                total += len;
                if m.lock_ref == 0 {
                    evictable += len;
                } else {
                    protected += len;
                }
            } else if m.lock_ref != 0 || m.children != 0 {
                return Err(format!("node {id} is not resident but has locks or resident children"));
            }
            // In its bucket chain exactly once.
            let b = self.bucket_of(id);
            let mut cur = self.c.buckets[b].load(Ordering::Relaxed) as u32;
            let mut seen = 0;
            let mut steps = 0;
            while cur != NIL && steps <= self.s.meta.len() {
                seen += usize::from(cur == id);
                cur = self.c.records[cur as usize].hash_next.load(Ordering::Relaxed);
                steps += 1;
            }
            if seen != 1 {
                return Err(format!("node {id} appears {seen} times in its bucket"));
            }
            let pp = self.c.records[id as usize].parent_page.load(Ordering::Relaxed);
            let ns = self.c.records[id as usize].namespace.load(Ordering::Relaxed);
            if self.c.records[id as usize].key_hash.load(Ordering::Relaxed) != self.page_hash_of(pp, ns, first) {
                return Err(format!("node {id} has a stale key hash"));
            }
        }
        let chained: usize = self
            .c
            .buckets
            .iter()
            .map(|b| {
                let mut n = 0;
                let mut cur = b.load(Ordering::Relaxed) as u32;
                while cur != NIL && n <= self.s.meta.len() {
                    n += 1;
                    cur = self.c.records[cur as usize].hash_next.load(Ordering::Relaxed);
                }
                n
            })
            .sum();
        if chained != live {
            return Err(format!("{chained} records in buckets, {live} live nodes"));
        }
        for (id, &n) in children.iter().enumerate() {
            if self.s.meta[id].alive && self.s.meta[id].children != n {
                return Err(format!("node {id} counts {} children, has {n}", self.s.meta[id].children));
            }
        }
        for page in 1..=self.c.num_pages {
            if self.in_tree(page) != (owner_of_page[page as usize] != NIL) {
                return Err(format!("page {page}: in-tree mark disagrees with the nodes"));
            }
        }
        let sizes = (
            self.c.total.load(Ordering::Relaxed),
            self.c.evictable.load(Ordering::Relaxed),
            self.c.protected.load(Ordering::Relaxed),
        );
        if sizes != (total, evictable, protected) {
            return Err(format!(
                "sizes (total, evictable, protected) {sizes:?}, nodes add up to {:?}",
                (total, evictable, protected)
            ));
        }
        let mut leaves = 0;
        for id in 1..self.s.meta.len() as u32 {
            let m = &self.s.meta[id as usize];
            let should = m.alive && V::resident(&m.ext) && m.lock_ref == 0 && m.children == 0;
            leaves += usize::from(should);
            if should != (m.heap_pos != NIL) {
                return Err(format!("node {id}: evictable leaf {should} but heap membership differs"));
            }
        }
        if leaves != self.s.heap.len() {
            return Err(format!("heap holds {} nodes, {leaves} evictable leaves", self.s.heap.len()));
        }
        super::heap::check::<_, Leaves>(&self.s.heap, &self.s.meta, self.c.policy)?;
        if self.s.free_ids.len() + live + 1 != self.s.meta.len() {
            return Err(format!(
                "{} free records + {live} live + root != {}",
                self.s.free_ids.len(),
                self.s.meta.len()
            ));
        }
        V::check(self)
    }
}

/// The runs of a node, for the latch holder (see [`Writer::runs`]).
pub(super) struct Runs<'a> {
    links: &'a [AtomicU64],
    page: u32,
    in_run: u32,
    left: u32,
}

impl Iterator for Runs<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        if self.left == 0 {
            return None;
        }
        let (start, len) = (self.page, self.in_run.min(self.left));
        debug_assert!(len > 0, "a node's run is empty");
        self.left -= len;
        if self.left > 0 {
            (self.page, self.in_run) = link_of(self.links[(start + len - 1) as usize].load(Ordering::Relaxed));
        }
        Some((start, len))
    }
}
