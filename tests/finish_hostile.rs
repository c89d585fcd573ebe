//! Hostile requests through every request helper of every tree variant: rows nothing
//! was written to, short rows, rows of garbage or stale cells, token lists longer than
//! the row or empty, slots 0 / `u32::MAX` / unallocated / in the tree's or another
//! request's pages, with and without a lease, at page sizes 1, 2, 4 and 16.
//!
//! Every call returns `Ok` or a typed error, never panics (the test profile checks
//! overflow), and an error changes nothing a caller can observe: the pools' free
//! counts, the cache's sizes and paths, the variant's own sizes, the row's cells and
//! the lease. Once everything is released and evicted, every pool is whole again.
#![cfg(not(loom))]

use std::sync::Arc;

use kvpool::alloc::SwaAllocator;
use kvpool::mamba::{HybridReqToTokenPool, MambaConfig, MambaPool, StateDtype, StateShape};
use kvpool::radix::mamba::HybridUnfinished;
use kvpool::radix::{
    CacheError, CheckpointConfig, HiRadixCache, HostTier, Lease, Mamba, MambaRadixCache, RadixCache, RadixConfig,
    SwaRadixCache, Transfer, Unfinished, Variant,
};
use kvpool::{KvAllocator, PagedAllocator, ReqRow, ReqToTokenPool, SlotPool};
use proptest::prelude::*;

/// A request row's length, in pages.
const ROW_PAGES: usize = 6;
/// The KV pool, in pages.
const POOL_PAGES: usize = 40;
/// Mamba states.
const STATES: u32 = 16;

/// What a page of the row is made to hold.
#[derive(Clone, Copy, Debug)]
enum Page {
    /// What is there already (zeros, the lease's slots, the allocator's expansion).
    Keep,
    /// A fresh page of the request's own.
    Own,
    /// A page the tree holds.
    Tree(u8),
    /// A page another request holds.
    Other(u8),
    /// A page nobody holds (a stale slot).
    Free(u8),
    Zero,
    Max,
    /// The first page past the pool.
    Past,
    /// A fresh page of the request's own, off its page boundary.
    Shift(u8),
    /// A fresh page of the request's own, its slots backwards.
    Reversed,
    /// `x, x + 1, ...`
    Raw(u32),
    /// The page before it again.
    Dup,
    /// The first slots of a fresh page of the request's own, then zeros.
    Partial(u8),
}

/// What one cell of the row is made to hold.
#[derive(Clone, Copy, Debug)]
enum Cell {
    Zero,
    Max,
    Raw(u32),
    Tree(u8),
    Other(u8),
    Free(u8),
    /// The cell's slot moved by this much.
    Near(i8),
}

/// The request's lease.
#[derive(Clone, Copy, Debug)]
enum LeaseOf {
    /// An empty lease (nothing matched).
    Empty,
    /// A match of the request's tokens into its row (the row remembers it).
    Row,
    /// A match of the request's tokens, copied into its row by hand.
    Copied,
    /// A match of a cached key that need not be the request's, copied into its row.
    Pre(u8),
}

/// Which helpers run, in order.
#[derive(Clone, Copy, Debug)]
enum Then {
    Finish,
    Unfinished,
    UnfinishedThenFinish,
}

#[derive(Clone, Debug)]
struct Case {
    ps: usize,
    /// Keys cached first (page patterns).
    pre: Vec<Vec<u8>>,
    /// The host tier's keys added on host first.
    host: Vec<Vec<u8>>,
    /// Pages other requests hold.
    others: u8,
    /// Pages evicted after the setup.
    evict: u8,
    /// The request's tokens (page patterns), and its unaligned tail.
    tokens: Vec<u8>,
    tail: u8,
    lease: LeaseOf,
    /// Tokens allocated into the row after the lease ([`RadixCache::alloc_extend_row`]):
    /// `u8::MAX` for up to the end of the request's tokens.
    extend: Option<u8>,
    pages: Vec<(u8, Page)>,
    cells: Vec<(u16, Cell)>,
    /// The helpers' namespace (the lease's is 0).
    namespace: u64,
    then: Then,
    /// Which Mamba state the request hands over.
    state: u8,
    /// A sliding-window cache's `release_window` range, tried first.
    window: (usize, usize),
}

fn key_of(pages: &[u8], ps: usize) -> Vec<u32> {
    pages.iter().flat_map(|&p| (0..ps).map(move |k| 1 + p as u32 * 64 + k as u32)).collect()
}

fn tokens_of(case: &Case) -> Vec<u32> {
    let mut t = key_of(&case.tokens, case.ps);
    t.extend((0..case.tail as usize % case.ps).map(|k| 900 + k as u32));
    t
}

fn page() -> impl Strategy<Value = Page> {
    prop_oneof![
        3 => Just(Page::Keep),
        4 => Just(Page::Own),
        2 => any::<u8>().prop_map(Page::Tree),
        2 => any::<u8>().prop_map(Page::Other),
        1 => any::<u8>().prop_map(Page::Free),
        1 => Just(Page::Zero),
        1 => Just(Page::Max),
        1 => Just(Page::Past),
        1 => any::<u8>().prop_map(Page::Shift),
        1 => Just(Page::Reversed),
        1 => raw().prop_map(Page::Raw),
        1 => Just(Page::Dup),
        1 => any::<u8>().prop_map(Page::Partial),
    ]
}

fn raw() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..256, (u32::MAX - 64)..=u32::MAX, any::<u32>()]
}

fn cell() -> impl Strategy<Value = Cell> {
    prop_oneof![
        Just(Cell::Zero),
        Just(Cell::Max),
        raw().prop_map(Cell::Raw),
        any::<u8>().prop_map(Cell::Tree),
        any::<u8>().prop_map(Cell::Other),
        any::<u8>().prop_map(Cell::Free),
        any::<i8>().prop_map(Cell::Near),
    ]
}

fn bound() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..200, Just(usize::MAX), (usize::MAX - 64)..=usize::MAX]
}

fn case() -> impl Strategy<Value = Case> {
    let keys = || prop::collection::vec(prop::collection::vec(0u8..3, 1..5), 0..4);
    let lease = prop_oneof![
        1 => Just(LeaseOf::Empty),
        3 => Just(LeaseOf::Row),
        1 => Just(LeaseOf::Copied),
        1 => any::<u8>().prop_map(LeaseOf::Pre),
    ];
    let then = prop_oneof![Just(Then::Finish), Just(Then::Unfinished), Just(Then::UnfinishedThenFinish)];
    let setup = (prop::sample::select(vec![1usize, 2, 4, 16]), keys(), keys(), 0u8..4, 0u8..4);
    let request = (
        prop::collection::vec(0u8..3, 0..ROW_PAGES + 2),
        any::<u8>(),
        lease,
        prop_oneof![1 => Just(None), 3 => Just(Some(u8::MAX)), 1 => any::<u8>().prop_map(Some)],
        prop::collection::vec((any::<u8>(), page()), 0..4),
        prop::collection::vec((any::<u16>(), cell()), 0..3),
        prop_oneof![4 => Just(0u64), 1 => Just(1u64)],
        then,
        any::<u8>(),
        (bound(), bound()),
    );
    (setup, request).prop_map(
        |(
            (ps, pre, host, others, evict),
            (tokens, tail, lease, extend, pages, cells, namespace, then, state, window),
        )| {
            Case {
                ps,
                pre,
                host,
                others,
                evict,
                tokens,
                tail,
                lease,
                extend,
                pages,
                cells,
                namespace,
                then,
                state,
                window,
            }
        },
    )
}

/// Everything a caller can observe of a cache, a row and a lease.
#[derive(Debug, PartialEq)]
struct Snap {
    kv_free: usize,
    sizes: (usize, usize, usize),
    rows_free: usize,
    paths: Vec<(u64, Vec<u32>, Vec<u32>)>,
    extra: Vec<u64>,
    row: Vec<u32>,
    lease: usize,
}

fn snap<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, extra: Vec<u64>, row: Vec<u32>, lease: usize) -> Snap {
    c.check_invariants().unwrap_or_else(|e| panic!("{e}\n{}", c.pretty_print()));
    Snap {
        kv_free: c.allocator().available_size(),
        sizes: (c.total_size(), c.evictable_size(), c.protected_size()),
        rows_free: c.req_pool().available_size(),
        paths: c.leaf_paths(),
        extra,
        row,
        lease,
    }
}

/// The first slots of the tree's pages (device or host), and every slot of them.
fn tree_slots<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>) -> Vec<u32> {
    let mut s: Vec<u32> = c.leaf_paths().into_iter().flat_map(|(_, _, v)| v).collect();
    s.sort_unstable();
    s.dedup();
    s
}

/// Allocate one page for the request; its first slot, recorded in `own`.
fn own_page<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, own: &mut Vec<u32>) -> Option<u32> {
    let mut p = vec![0u32; c.page_size()];
    c.allocator().alloc(&mut p).ok()?;
    own.push(p[0]);
    Some(p[0])
}

/// A free page's first slot, searching from `from`.
fn free_page<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, from: u8) -> Option<u32> {
    let ps = c.page_size() as u32;
    let n = (c.allocator().size() / c.page_size()) as u32;
    (0..n).map(|k| 1 + (from as u32 + k) % n).find(|&p| !c.allocator().is_allocated(p * ps)).map(|p| p * ps)
}

/// The setup shared by the variants: the pages other requests hold.
fn others<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, case: &Case) -> Vec<u32> {
    let mut other = Vec::new();
    for _ in 0..case.others {
        own_page(c, &mut other);
    }
    other
}

/// The row's writes for `case.pages` and `case.cells`, planned on `img` (the row's
/// cells now), which they update; pages taken for the request go to `own`.
fn plan<A: KvAllocator, V: Variant>(
    c: &RadixCache<A, V>,
    case: &Case,
    other: &[u32],
    img: &mut [u32],
    own: &mut Vec<u32>,
) -> Vec<(usize, Vec<u32>)> {
    let ps = case.ps;
    let tree = tree_slots(c);
    let tree_firsts: Vec<u32> = tree.iter().copied().filter(|s| s % ps as u32 == 0).collect();
    let past = (c.allocator().size() / ps + 1) as u32 * ps as u32;
    let pick = |v: &[u32], i: u8| (!v.is_empty()).then(|| v[i as usize % v.len()]);
    let run = |first: u32| (0..ps as u32).map(|k| first.wrapping_add(k)).collect::<Vec<_>>();
    let mut writes = Vec::new();
    for &(at, p) in &case.pages {
        let at = at as usize % ROW_PAGES * ps;
        let slots = match p {
            Page::Keep => None,
            Page::Own => own_page(c, own).map(run),
            Page::Tree(i) => pick(&tree_firsts, i).map(run),
            Page::Other(i) => pick(other, i).map(run),
            Page::Free(i) => free_page(c, i).map(run),
            Page::Zero => Some(vec![0; ps]),
            Page::Max => Some(vec![u32::MAX; ps]),
            Page::Past => Some(run(past)),
            Page::Shift(k) => own_page(c, own).map(|f| run(f + 1 + k as u32 % ps as u32)),
            Page::Reversed => own_page(c, own).map(|f| run(f).into_iter().rev().collect()),
            Page::Raw(x) => Some(run(x)),
            Page::Dup => Some(img[at.saturating_sub(ps)..at.saturating_sub(ps) + ps].to_vec()),
            Page::Partial(k) => own_page(c, own).map(|f| {
                let mut s = run(f);
                s[k as usize % ps..].iter_mut().for_each(|x| *x = 0);
                s
            }),
        };
        if let Some(s) = slots {
            img[at..at + ps].copy_from_slice(&s);
            writes.push((at, s));
        }
    }
    for &(pos, cell) in &case.cells {
        let pos = pos as usize % img.len();
        let v = match cell {
            Cell::Zero => 0,
            Cell::Max => u32::MAX,
            Cell::Raw(x) => x,
            Cell::Tree(i) => pick(&tree, i).unwrap_or(0),
            Cell::Other(i) => pick(other, i).map_or(0, |f| f + i as u32 % ps as u32),
            Cell::Free(i) => free_page(c, i).map_or(past, |f| f + i as u32 % ps as u32),
            Cell::Near(d) => img[pos].wrapping_add_signed(d as i32),
        };
        img[pos] = v;
        writes.push((pos, vec![v]));
    }
    writes
}

/// A tree variant whose requests use the cache's own rows.
trait Subject {
    type A: KvAllocator;
    type V: Variant;
    /// What a helper takes besides the row and lease (a Mamba state).
    type Arg;

    fn cache(&self) -> &RadixCache<Self::A, Self::V>;
    /// Cache `key -> slots` (fresh slots the caller holds); the caller's duplicates
    /// are freed.
    fn seed(&self, key: &[u32], slots: &[u32]);
    /// The variant's own observables.
    fn extra(&self) -> Vec<u64>;
    /// The argument for the next call (taken before the snapshot).
    fn arg(&self, case: &Case) -> Self::Arg;
    /// A refused call's argument, given back.
    fn give_back(&self, arg: Self::Arg);
    #[allow(clippy::type_complexity)]
    fn finish<'c>(
        &'c self,
        ns: u64,
        tokens: &[u32],
        row: ReqRow,
        lease: Lease<'c, Self::A, Self::V>,
        arg: Self::Arg,
    ) -> Result<(), (Unfinished<'c, Self::A, Self::V>, Self::Arg)>;
    fn unfinished(
        &self,
        ns: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, Self::A, Self::V>,
        arg: Self::Arg,
    ) -> Result<(), (CacheError, Self::Arg)>;
    /// A match of `tokens` into `row` (the variant's own where it has one).
    fn match_row<'c>(&'c self, tokens: &[u32], row: &mut ReqRow) -> Lease<'c, Self::A, Self::V> {
        self.cache().match_and_lock_row(0, tokens, row).unwrap()
    }
    /// A variant's own request call before the helpers (`release_window`).
    fn side(
        &self,
        _row: &ReqRow,
        _lease: &Lease<'_, Self::A, Self::V>,
        _case: &Case,
    ) -> Option<Result<(), CacheError>> {
        None
    }
    /// Variant setup after the seeding (host keys).
    fn setup(&self, _case: &Case) {}
    /// Release everything the variant holds apart from the tree, evict everything, and
    /// check that every pool is whole.
    fn drain(&self) -> Result<(), String> {
        let c = self.cache();
        c.evict(usize::MAX);
        let a = c.allocator();
        if c.total_size() != 0 || a.available_size() != a.size() {
            return Err(format!(
                "{} cached, {} of {} free after draining",
                c.total_size(),
                a.available_size(),
                a.size()
            ));
        }
        Ok(())
    }
}

fn invariants<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>) -> Result<(), TestCaseError> {
    c.check_invariants().map_err(|e| TestCaseError::fail(format!("{e}\n{}", c.pretty_print())))
}

fn row_cells<A: KvAllocator, V: Variant>(c: &RadixCache<A, V>, row: &ReqRow) -> Vec<u32> {
    c.req_pool().row(row).unwrap().to_vec()
}

fn check_call<A: KvAllocator, V: Variant>(
    c: &RadixCache<A, V>,
    before: &Snap,
    after: Snap,
    what: &str,
    e: &CacheError,
) -> Result<(), TestCaseError> {
    if *before != after {
        return Err(TestCaseError::fail(format!(
            "{what} refused with {e:?} but changed the cache:\nbefore {before:?}\nafter  {after:?}\n{}",
            c.pretty_print()
        )));
    }
    Ok(())
}

fn run<S: Subject>(s: &S, case: &Case) -> Result<(), TestCaseError> {
    let c = s.cache();
    let ps = case.ps;
    assert_eq!(c.page_size(), ps);
    for key in &case.pre {
        let key = key_of(key, ps);
        let mut slots = vec![0u32; key.len()];
        if c.allocator().alloc(&mut slots).is_ok() {
            s.seed(&key, &slots);
        }
    }
    s.setup(case);
    let other = others(c, case);
    if case.evict > 0 {
        c.evict(case.evict as usize * ps);
    }
    let tokens = tokens_of(case);
    let row_len = c.req_pool().max_context_len();
    let mut own = Vec::new();
    let mut row = c.req_pool().alloc().unwrap();
    let mut lease = match case.lease {
        LeaseOf::Empty => c.match_and_lock(0, &[], &mut []),
        LeaseOf::Row => s.match_row(&tokens, &mut row),
        LeaseOf::Copied | LeaseOf::Pre(_) => {
            let key = match case.lease {
                LeaseOf::Pre(i) if !case.pre.is_empty() => key_of(&case.pre[i as usize % case.pre.len()], ps),
                _ => tokens.clone(),
            };
            let n = key.len().min(row_len);
            let mut out = vec![0u32; n];
            let lease = c.match_and_lock(0, &key[..n], &mut out);
            c.req_pool().write(&mut row, 0, &out[..lease.len()]).unwrap();
            lease
        }
    };
    if let Some(n) = case.extend {
        let from = lease.len();
        let n = match n {
            u8::MAX => tokens.len().saturating_sub(from),
            n => n as usize,
        }
        .min(row_len - from);
        if c.alloc_extend_row(&mut row, from, from + n).is_ok() {
            let mut pages: Vec<u32> =
                c.req_pool().read(&row, from..from + n).unwrap().iter().map(|&s| s / ps as u32 * ps as u32).collect();
            pages.dedup();
            own.extend(pages);
        }
    }
    let mut img = row_cells(c, &row);
    for (at, slots) in plan(c, case, &other, &mut img, &mut own) {
        c.req_pool().write(&mut row, at, &slots).unwrap();
    }
    // A variant's own call first.
    let before = snap(c, s.extra(), row_cells(c, &row), lease.len());
    if let Some(r) = s.side(&row, &lease, case) {
        let after = snap(c, s.extra(), row_cells(c, &row), lease.len());
        if let Err(e) = r {
            check_call(c, &before, after, "the variant's call", &e)?;
        }
    }
    // The helpers.
    let (unfinished, finish) = match case.then {
        Then::Finish => (false, true),
        Then::Unfinished => (true, false),
        Then::UnfinishedThenFinish => (true, true),
    };
    let mut finish = finish;
    if unfinished {
        let arg = s.arg(case);
        let before = snap(c, s.extra(), row_cells(c, &row), lease.len());
        match s.unfinished(case.namespace, &tokens, &mut row, &mut lease, arg) {
            Ok(()) => invariants(c)?,
            Err((e, arg)) => {
                let after = snap(c, s.extra(), row_cells(c, &row), lease.len());
                check_call(c, &before, after, "cache_unfinished_req", &e)?;
                s.give_back(arg);
                finish = false;
            }
        }
    }
    if finish {
        let arg = s.arg(case);
        let before = snap(c, s.extra(), row_cells(c, &row), lease.len());
        match s.finish(case.namespace, &tokens, row, lease, arg) {
            Ok(()) => invariants(c)?,
            Err((u, arg)) => {
                let after = snap(c, s.extra(), row_cells(c, &u.row), u.lease.len());
                check_call(c, &before, after, "cache_finished_req", &u.error)?;
                s.give_back(arg);
                c.req_pool().free(u.row).unwrap();
            }
        }
    } else {
        drop(lease);
        c.req_pool().free(row).unwrap();
    }
    // Everything the test holds goes back (refused where a helper cached or freed it).
    for &p in own.iter().chain(&other) {
        let _ = c.allocator().free(&[p]);
    }
    invariants(c)?;
    s.drain().map_err(|e| TestCaseError::fail(format!("{e}\n{}", c.pretty_print())))?;
    invariants(c)?;
    Ok(())
}

fn rows(ps: usize) -> ReqToTokenPool {
    ReqToTokenPool::new(4, ROW_PAGES * ps).unwrap()
}

fn kv(ps: usize) -> PagedAllocator {
    PagedAllocator::new(POOL_PAGES * ps, ps as u32).unwrap()
}

// ---- the plain cache ----

struct PlainTree(RadixCache<PagedAllocator>);

impl Subject for PlainTree {
    type A = PagedAllocator;
    type V = kvpool::radix::Plain;
    type Arg = ();

    fn cache(&self) -> &RadixCache<PagedAllocator> {
        &self.0
    }
    fn seed(&self, key: &[u32], slots: &[u32]) {
        let cached = self.0.insert(0, key, slots, 0).unwrap();
        self.0.allocator().free(&slots[..cached]).unwrap();
    }
    fn extra(&self) -> Vec<u64> {
        Vec::new()
    }
    fn arg(&self, _: &Case) {}
    fn give_back(&self, _: ()) {}
    fn finish<'c>(
        &'c self,
        ns: u64,
        tokens: &[u32],
        row: ReqRow,
        lease: Lease<'c, PagedAllocator>,
        _: (),
    ) -> Result<(), (Unfinished<'c, PagedAllocator>, ())> {
        self.0.cache_finished_req(ns, tokens, row, lease, 0).map(drop).map_err(|u| (u, ()))
    }
    fn unfinished(
        &self,
        ns: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, PagedAllocator>,
        _: (),
    ) -> Result<(), (CacheError, ())> {
        self.0.cache_unfinished_req(ns, tokens, row, lease, 0).map_err(|e| (e, ()))
    }
}

// ---- the Mamba cache over its own state pool ----

struct MambaTree(MambaRadixCache<PagedAllocator>);

impl Subject for MambaTree {
    type A = PagedAllocator;
    type V = Mamba<SlotPool>;
    /// The state, and whether the request holds it.
    type Arg = (u32, bool);

    fn cache(&self) -> &MambaRadixCache<PagedAllocator> {
        &self.0
    }
    fn seed(&self, key: &[u32], slots: &[u32]) {
        let Ok(state) = self.0.alloc_state() else {
            self.0.allocator().free(slots).unwrap();
            return;
        };
        let ins = self.0.insert(0, key, slots, state).unwrap();
        self.0.allocator().free(&slots[..ins.cached]).unwrap();
    }
    fn extra(&self) -> Vec<u64> {
        let st = self.0.states();
        vec![st.available() as u64, self.0.mamba_evictable_size() as u64, self.0.mamba_protected_size() as u64]
    }
    fn arg(&self, case: &Case) -> (u32, bool) {
        let st = self.0.states();
        let cap = st.capacity();
        let find = |f: &dyn Fn(u32) -> bool| (1..=cap).find(|&s| f(s));
        let own = || self.0.alloc_state().map_or((0, false), |s| (s, true));
        match case.state % 6 {
            0 | 1 => own(),
            2 => (0, false),
            3 => (u32::MAX, false),
            4 => find(&|s| st.is_held(s)).map_or_else(own, |s| (s, false)),
            _ => find(&|s| !st.is_allocated(s)).map_or((cap + 1, false), |s| (s, false)),
        }
    }
    fn match_row<'c>(&'c self, tokens: &[u32], row: &mut ReqRow) -> Lease<'c, PagedAllocator, Mamba<SlotPool>> {
        // Also writes the KV matched past the lease into the row (the tree's slots).
        self.0.match_and_lock_checkpoint_row(0, tokens, row).unwrap().lease
    }
    fn give_back(&self, (state, own): (u32, bool)) {
        if own {
            self.0.states().free(&[state]).unwrap();
        }
    }
    fn finish<'c>(
        &'c self,
        ns: u64,
        tokens: &[u32],
        row: ReqRow,
        lease: Lease<'c, PagedAllocator, Mamba<SlotPool>>,
        arg: (u32, bool),
    ) -> Result<(), (Unfinished<'c, PagedAllocator, Mamba<SlotPool>>, (u32, bool))> {
        self.0.cache_finished_req(ns, tokens, row, lease, arg.0).map(drop).map_err(|u| (u, arg))
    }
    fn unfinished(
        &self,
        ns: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, PagedAllocator, Mamba<SlotPool>>,
        arg: (u32, bool),
    ) -> Result<(), (CacheError, (u32, bool))> {
        self.0.cache_unfinished_req(ns, tokens, row, lease, arg.0).map(drop).map_err(|e| (e, arg))
    }
    fn drain(&self) -> Result<(), String> {
        let c = &self.0;
        c.evict(usize::MAX);
        let a = c.allocator();
        let st = c.states();
        if c.total_size() != 0 || a.available_size() != a.size() || st.available() != st.capacity() as usize {
            return Err(format!(
                "{} cached, {} of {} free, {} of {} states free after draining",
                c.total_size(),
                a.available_size(),
                a.size(),
                st.available(),
                st.capacity()
            ));
        }
        Ok(())
    }
}

// ---- the sliding-window cache ----

struct SwaTree(SwaRadixCache);

impl Subject for SwaTree {
    type A = SwaAllocator;
    type V = kvpool::radix::Swa;
    type Arg = ();

    fn cache(&self) -> &SwaRadixCache {
        &self.0
    }
    fn seed(&self, key: &[u32], slots: &[u32]) {
        let ins = self.0.insert(0, key, slots).unwrap();
        self.0.allocator().free(&slots[..ins.cached]).unwrap();
        self.0.allocator().free(&slots[ins.inserted..]).unwrap();
    }
    fn extra(&self) -> Vec<u64> {
        let a = self.0.allocator();
        [
            a.full_available_size(),
            a.window_available_size(),
            self.0.swa_evictable_size(),
            self.0.swa_protected_size(),
            self.0.tombstone_size(),
        ]
        .map(|x| x as u64)
        .to_vec()
    }
    fn arg(&self, _: &Case) {}
    fn give_back(&self, _: ()) {}
    fn finish<'c>(
        &'c self,
        ns: u64,
        tokens: &[u32],
        row: ReqRow,
        lease: Lease<'c, SwaAllocator, kvpool::radix::Swa>,
        _: (),
    ) -> Result<(), (Unfinished<'c, SwaAllocator, kvpool::radix::Swa>, ())> {
        self.0.cache_finished_req(ns, tokens, row, lease).map(drop).map_err(|u| (u, ()))
    }
    fn unfinished(
        &self,
        ns: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, SwaAllocator, kvpool::radix::Swa>,
        _: (),
    ) -> Result<(), (CacheError, ())> {
        self.0.cache_unfinished_req(ns, tokens, row, lease).map_err(|e| (e, ()))
    }
    fn side(
        &self,
        row: &ReqRow,
        lease: &Lease<'_, SwaAllocator, kvpool::radix::Swa>,
        case: &Case,
    ) -> Option<Result<(), CacheError>> {
        Some(self.0.release_window(row, lease, case.window.0..case.window.1).map(drop))
    }
    fn drain(&self) -> Result<(), String> {
        let c = &self.0;
        c.evict(usize::MAX);
        let a = c.allocator();
        let full = a.full_available_size();
        if c.total_size() != 0 || full != a.size() || a.window_available_size() != a.window_size() {
            return Err(format!(
                "{} cached, {} of {} free, {} of {} window tokens free after draining",
                c.total_size(),
                full,
                a.size(),
                a.window_available_size(),
                a.window_size()
            ));
        }
        Ok(())
    }
}

// ---- the host tier ----

struct HiTree(HiRadixCache<PagedAllocator>);

impl Subject for HiTree {
    type A = PagedAllocator;
    type V = kvpool::radix::Hi;
    type Arg = ();

    fn cache(&self) -> &HiRadixCache<PagedAllocator> {
        &self.0
    }
    fn seed(&self, key: &[u32], slots: &[u32]) {
        let cached = self.0.insert(0, key, slots).unwrap();
        self.0.allocator().free(&slots[..cached]).unwrap();
    }
    fn setup(&self, case: &Case) {
        for key in &case.host {
            let key = key_of(key, case.ps);
            self.0.insert_host(0, &key, &mut vec![0u32; key.len()]);
        }
    }
    fn extra(&self) -> Vec<u64> {
        let k = self.0.counters();
        let (host, flight) = (self.0.host_size() as u64, self.0.transfers_in_flight() as u64);
        vec![host, flight, k.written, k.loaded, k.device_evicted, k.host_evicted, k.backup_refused, k.prefetched]
    }
    fn arg(&self, _: &Case) {}
    fn give_back(&self, _: ()) {}
    fn finish<'c>(
        &'c self,
        ns: u64,
        tokens: &[u32],
        row: ReqRow,
        lease: Lease<'c, PagedAllocator, kvpool::radix::Hi>,
        _: (),
    ) -> Result<(), (Unfinished<'c, PagedAllocator, kvpool::radix::Hi>, ())> {
        self.0.cache_finished_req(ns, tokens, row, lease).map(drop).map_err(|u| (u, ()))
    }
    fn unfinished(
        &self,
        ns: u64,
        tokens: &[u32],
        row: &mut ReqRow,
        lease: &mut Lease<'_, PagedAllocator, kvpool::radix::Hi>,
        _: (),
    ) -> Result<(), (CacheError, ())> {
        self.0.cache_unfinished_req(ns, tokens, row, lease).map_err(|e| (e, ()))
    }
    fn drain(&self) -> Result<(), String> {
        let c = &self.0;
        let mut t = [Transfer::default(); 8];
        loop {
            let n = c.take_transfers(&mut t);
            if n == 0 {
                break;
            }
            for &x in &t[..n] {
                c.complete(x).map_err(|e| e.to_string())?;
            }
        }
        c.evict(usize::MAX);
        // Evicting may back nodes up (write-back) before they leave the device.
        while c.transfers_in_flight() > 0 {
            let n = c.take_transfers(&mut t);
            for &x in &t[..n] {
                c.complete(x).map_err(|e| e.to_string())?;
            }
        }
        c.evict_host(usize::MAX);
        let a = c.allocator();
        if c.total_size() != 0 || a.available_size() != a.size() || c.host_size() != 0 {
            return Err(format!(
                "{} cached, {} of {} free, {} on host after draining",
                c.total_size(),
                a.available_size(),
                a.size(),
                c.host_size()
            ));
        }
        Ok(())
    }
}

// ---- the hybrid rows (a Mamba cache over the rows' state pool) ----

fn mamba_config() -> MambaConfig {
    MambaConfig { layers: 1, conv: vec![], temporal: StateShape::new(&[4], StateDtype::F32) }
}

type HybridCache = MambaRadixCache<PagedAllocator, Arc<MambaPool>>;

fn hybrid_extra(c: &HybridCache, rows: &HybridReqToTokenPool, mamba: &MambaPool) -> Vec<u64> {
    [mamba.available(), c.mamba_evictable_size(), c.mamba_protected_size(), rows.available_size()]
        .map(|x| x as u64)
        .to_vec()
}

fn hybrid_cells(rows: &HybridReqToTokenPool, row: &kvpool::HybridRow) -> Vec<u32> {
    rows.read(row, 0..rows.max_context_len()).unwrap().to_vec()
}

/// The hybrid helpers, with the same requests (the row is written by hand: a hybrid
/// row has no match into it nor an expansion).
fn run_hybrid(case: &Case) -> Result<(), TestCaseError> {
    let ps = case.ps;
    let mamba = Arc::new(MambaPool::new(STATES, mamba_config()).unwrap());
    let foreign = MambaPool::new(2, mamba_config()).unwrap();
    let rows = HybridReqToTokenPool::new(4, ROW_PAGES * ps, Arc::clone(&mamba), 0).unwrap();
    let c: HybridCache =
        MambaRadixCache::for_hybrid_rows(kv(ps), &rows, RadixConfig::default(), CheckpointConfig::default()).unwrap();
    for key in &case.pre {
        let key = key_of(key, ps);
        let mut slots = vec![0u32; key.len()];
        if c.allocator().alloc(&mut slots).is_ok() {
            let state = c.alloc_state().unwrap();
            let ins = c.insert(0, &key, &slots, state).unwrap();
            c.allocator().free(&slots[..ins.cached]).unwrap();
        }
    }
    let other = others(&c, case);
    if case.evict > 0 {
        c.evict(case.evict as usize * ps);
    }
    let tokens = tokens_of(case);
    let row_len = rows.max_context_len();
    let mut own = Vec::new();
    let mut row = rows.alloc().unwrap();
    let mut lease = match case.lease {
        LeaseOf::Empty => c.match_and_lock(0, &[], &mut []),
        _ => {
            let key = match case.lease {
                LeaseOf::Pre(i) if !case.pre.is_empty() => key_of(&case.pre[i as usize % case.pre.len()], ps),
                _ => tokens.clone(),
            };
            let n = key.len().min(row_len);
            let mut out = vec![0u32; n];
            let lease = c.match_and_lock(0, &key[..n], &mut out);
            rows.write(&mut row, 0, &out[..lease.len()]).unwrap();
            lease
        }
    };
    if let Some(n) = case.extend {
        // Fresh pages after the lease, written by hand.
        let from = lease.len();
        let n = match n {
            u8::MAX => tokens.len().saturating_sub(from),
            n => n as usize,
        };
        let pages = n.min(row_len - from).div_ceil(ps);
        for k in 0..pages {
            if let Some(f) = own_page(&c, &mut own) {
                rows.write(&mut row, from + k * ps, &(f..f + ps as u32).collect::<Vec<_>>()).unwrap();
            }
        }
    }
    let mut img = hybrid_cells(&rows, &row);
    for (at, slots) in plan(&c, case, &other, &mut img, &mut own) {
        rows.write(&mut row, at, &slots).unwrap();
    }
    let state = || if case.state % 4 == 0 { foreign.alloc().unwrap() } else { mamba.alloc().unwrap() };
    // A foreign pool's slot is refused here (and dropped with that pool).
    let give_back = |s: kvpool::MambaSlot| drop(mamba.free_slot(s));
    let (unfinished, mut finish) = match case.then {
        Then::Finish => (false, true),
        Then::Unfinished => (true, false),
        Then::UnfinishedThenFinish => (true, true),
    };
    if unfinished {
        let s = state();
        let before = snap(&c, hybrid_extra(&c, &rows, &mamba), hybrid_cells(&rows, &row), lease.len());
        match c.cache_unfinished_hybrid(&rows, case.namespace, &tokens, &mut row, &mut lease, s) {
            Ok(_) => invariants(&c)?,
            Err((e, s)) => {
                let after = snap(&c, hybrid_extra(&c, &rows, &mamba), hybrid_cells(&rows, &row), lease.len());
                check_call(&c, &before, after, "cache_unfinished_hybrid", &e)?;
                give_back(s);
                finish = false;
            }
        }
    }
    if finish {
        let s = state();
        let before = snap(&c, hybrid_extra(&c, &rows, &mamba), hybrid_cells(&rows, &row), lease.len());
        match c.cache_finished_hybrid(&rows, case.namespace, &tokens, row, lease, s) {
            Ok(_) => invariants(&c)?,
            Err(HybridUnfinished { error, row, lease, state }) => {
                let after = snap(&c, hybrid_extra(&c, &rows, &mamba), hybrid_cells(&rows, &row), lease.len());
                check_call(&c, &before, after, "cache_finished_hybrid", &error)?;
                give_back(state);
                drop(lease);
                rows.free(row).unwrap();
            }
        }
    } else {
        drop(lease);
        rows.free(row).unwrap();
    }
    for &p in own.iter().chain(&other) {
        let _ = c.allocator().free(&[p]);
    }
    invariants(&c)?;
    c.evict(usize::MAX);
    invariants(&c)?;
    let a = c.allocator();
    prop_assert_eq!((c.total_size(), a.available_size()), (0, a.size()), "{}", c.pretty_print());
    prop_assert_eq!(mamba.available(), STATES as usize);
    Ok(())
}

fn plain(ps: usize) -> PlainTree {
    PlainTree(RadixCache::new(kv(ps), rows(ps), RadixConfig::default()).unwrap())
}

fn mamba_tree(ps: usize) -> MambaTree {
    let states = SlotPool::without_magazines(STATES);
    MambaTree(MambaRadixCache::with_states(kv(ps), rows(ps), states, RadixConfig::default()).unwrap())
}

fn swa(ps: usize) -> SwaTree {
    let alloc = SwaAllocator::new(POOL_PAGES * ps, POOL_PAGES / 2 * ps, ps as u32).unwrap();
    SwaTree(SwaRadixCache::with_window(alloc, rows(ps), RadixConfig::default(), 2 * ps).unwrap())
}

fn hi(ps: usize) -> HiTree {
    HiTree(HiRadixCache::with_host_tier(kv(ps), rows(ps), RadixConfig::default(), HostTier::new(16)).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn plain_helpers_refuse_hostile_requests(case in case()) {
        run(&plain(case.ps), &case)?;
    }

    #[test]
    fn mamba_helpers_refuse_hostile_requests(case in case()) {
        run(&mamba_tree(case.ps), &case)?;
    }

    #[test]
    fn hybrid_helpers_refuse_hostile_requests(case in case()) {
        run_hybrid(&case)?;
    }

    #[test]
    fn swa_helpers_refuse_hostile_requests(case in case()) {
        run(&swa(case.ps), &case)?;
    }

    #[test]
    fn hi_helpers_refuse_hostile_requests(case in case()) {
        run(&hi(case.ps), &case)?;
    }
}

/// A fresh row nothing was written to, finished with 4 tokens and no lease: a typed
/// error, the row and lease handed back, and no slot leaked.
#[test]
fn finishing_an_unwritten_row_is_refused() {
    for ps in [1u32, 4] {
        let cache = RadixCache::new(
            PagedAllocator::new(64, ps).unwrap(),
            ReqToTokenPool::new(2, 64).unwrap(),
            RadixConfig::default(),
        )
        .unwrap();
        let tokens = [1, 2, 3, 4];
        let row = cache.req_pool().alloc().unwrap();
        let lease = cache.match_and_lock(0, &tokens, &mut [0; 4]);
        assert_eq!(lease.len(), 0);
        let u = cache.cache_finished_req(0, &tokens, row, lease, 0).unwrap_err();
        assert!(matches!(u.error, CacheError::Invalid(_)), "page size {ps}: {:?}", u.error);
        assert_eq!(cache.req_pool().row(&u.row).unwrap(), &[0; 64][..]);
        cache.req_pool().free(u.row).unwrap();
        drop(u.lease);
        assert_eq!(cache.req_pool().available_size(), 2);
        assert_eq!(cache.allocator().available_size() + cache.total_size(), cache.allocator().size());
        assert_eq!(cache.total_size(), 0);
        cache.check_invariants().unwrap();

        // The same through the chunked-prefill helper.
        let mut row = cache.req_pool().alloc().unwrap();
        let mut lease = cache.match_and_lock(0, &tokens, &mut [0; 4]);
        let e = cache.cache_unfinished_req(0, &tokens, &mut row, &mut lease, 0).unwrap_err();
        assert!(matches!(e, CacheError::Invalid(_)), "page size {ps}: {e:?}");
        drop(lease);
        cache.req_pool().free(row).unwrap();
        assert_eq!(cache.allocator().available_size() + cache.total_size(), cache.allocator().size());
        cache.check_invariants().unwrap();
    }
}

/// A request whose tokens leave its lease's path inside a leased node (the lease was
/// matched for other tokens) is refused, by every helper of every variant, with nothing
/// changed; with its own tokens it is cached.
#[test]
fn tokens_that_leave_the_leased_path_are_refused() {
    fn check<S: Subject>(s: &S, ps: usize) {
        let c = s.cache();
        let cached: Vec<u32> = (1..=4 * ps as u32).collect();
        let mut slots = vec![0u32; cached.len()];
        c.allocator().alloc(&mut slots).unwrap();
        s.seed(&cached, &slots);
        let mut other = cached.clone();
        other[2 * ps] = 999; // the third page differs: inside the one cached node
        for unfinished in [false, true] {
            let mut row = c.req_pool().alloc().unwrap();
            let mut lease = s.match_row(&cached, &mut row);
            assert_eq!(lease.len(), cached.len());
            let arg = s.arg(&Case { state: 0, ..sample_case(ps) });
            let before = snap(c, s.extra(), row_cells(c, &row), lease.len());
            if unfinished {
                let (e, arg) = s.unfinished(0, &other, &mut row, &mut lease, arg).unwrap_err();
                assert!(matches!(e, CacheError::RowMismatch { .. }), "{e:?}");
                assert_eq!(before, snap(c, s.extra(), row_cells(c, &row), lease.len()));
                s.give_back(arg);
                // Its own tokens go in.
                let arg = s.arg(&Case { state: 0, ..sample_case(ps) });
                assert!(s.unfinished(0, &cached, &mut row, &mut lease, arg).is_ok());
                drop(lease);
                c.req_pool().free(row).unwrap();
            } else {
                let (u, arg) = s.finish(0, &other, row, lease, arg).unwrap_err();
                assert!(matches!(u.error, CacheError::RowMismatch { .. }), "{:?}", u.error);
                assert_eq!(before, snap(c, s.extra(), row_cells(c, &u.row), u.lease.len()));
                s.give_back(arg);
                let arg = s.arg(&Case { state: 0, ..sample_case(ps) });
                assert!(s.finish(0, &cached, u.row, u.lease, arg).is_ok());
            }
        }
        s.drain().unwrap();
    }
    for ps in [1, 2, 4, 16] {
        check(&plain(ps), ps);
        check(&mamba_tree(ps), ps);
        check(&swa(ps), ps);
        check(&hi(ps), ps);
    }
}

fn sample_case(ps: usize) -> Case {
    Case {
        ps,
        pre: Vec::new(),
        host: Vec::new(),
        others: 0,
        evict: 0,
        tokens: Vec::new(),
        tail: 0,
        lease: LeaseOf::Empty,
        extend: None,
        pages: Vec::new(),
        cells: Vec::new(),
        namespace: 0,
        then: Then::Finish,
        state: 0,
        window: (0, 0),
    }
}

/// `release_window` over a range whose start rounds up past `usize::MAX` frees nothing.
#[test]
fn release_window_at_the_end_of_the_index_range_frees_nothing() {
    for ps in [1, 2, 4, 16] {
        let s = swa(ps);
        let c = &s.0;
        let row = c.req_pool().alloc().unwrap();
        let lease = c.match_and_lock(0, &[], &mut []);
        for start in [usize::MAX, usize::MAX - 1, usize::MAX - ps, 0] {
            let r = c.release_window(&row, &lease, start..usize::MAX);
            // A range holding a whole page is past the row; one holding none frees nothing.
            let whole_page = start.div_ceil(ps).checked_mul(ps).is_some_and(|f| f < usize::MAX / ps * ps);
            if whole_page {
                assert!(matches!(r, Err(CacheError::Row(_))), "{start}: {r:?}");
            } else {
                assert_eq!(r, Ok(0), "{start}");
            }
        }
        drop(lease);
        c.req_pool().free(row).unwrap();
        s.drain().unwrap();
    }
}

/// A sliding-window insert whose slots are fewer (or more) than its tokens is refused.
#[test]
fn swa_insert_of_mismatched_lengths_is_refused() {
    for ps in [1, 2, 4] {
        let s = swa(ps);
        let c = &s.0;
        let key: Vec<u32> = (1..=4 * ps as u32).collect();
        let mut slots = vec![0u32; key.len() + ps];
        c.allocator().alloc(&mut slots).unwrap();
        let unaligned = if ps > 1 { ps + 1 } else { 0 };
        for (k, v) in [(&key[..], &slots[..2 * ps]), (&key[..], &slots[..]), (&key[..unaligned], &slots[..ps])] {
            let e = c.insert(0, k, v).unwrap_err();
            assert!(matches!(e, CacheError::Invalid(_)), "{} tokens, {} slots: {e:?}", k.len(), v.len());
            assert_eq!(c.total_size(), 0);
        }
        c.allocator().free(&slots).unwrap();
        s.drain().unwrap();
    }
}
