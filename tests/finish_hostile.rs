//! Hostile requests through every call of the request handle, on every tree variant:
//! finish and checkpoint token lists one token too long or too short, or differing
//! from the admitted prompt inside and past the locked prefix; chunks longer than the
//! row; decode steps into a full pool; checkpoints of any length; Mamba states saved at
//! positions off the page grid, past the tokens or not at all; window releases over any
//! range (to `usize::MAX`); with cached keys, host keys, evictions and other requests'
//! pages around, at page sizes 1, 2, 4 and 16.
//!
//! Every call returns `Ok` or a typed error, never panics (the test profile checks
//! overflow), and an error changes nothing a caller can observe: the pools' free
//! counts, the cache's sizes and paths, the variant's own sizes, and the request's
//! length, lock and slots. A refused finish hands the request back. Once every request
//! is finished or dropped and everything is evicted, every pool is whole again.
#![cfg(not(loom))]

use std::sync::Arc;

use kvpool::alloc::SwaAllocator;
use kvpool::radix::{
    CacheError, HiRadixCache, HostTier, Mamba, MambaRadixCache, RadixCache, RadixConfig, Request, SwaRadixCache,
    Transfer, Variant,
};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool, SlotPool};
use proptest::prelude::*;

/// A request row's length, in pages.
const ROW_PAGES: usize = 6;
/// The KV pool, in pages.
const POOL_PAGES: usize = 40;
/// Mamba states.
const STATES: u32 = 16;
/// Request rows.
const ROWS: u32 = 6;

/// What the request does after its admission and prefill.
#[derive(Clone, Copy, Debug)]
enum Then {
    Finish,
    Checkpoint,
    CheckpointThenFinish,
}

#[derive(Clone, Debug)]
struct Case {
    ps: usize,
    /// Keys cached first by served requests (page patterns).
    pre: Vec<Vec<u8>>,
    /// The host tier's keys added on host first.
    host: Vec<Vec<u8>>,
    /// Live requests holding a page each.
    others: u8,
    /// Pages evicted after the setup.
    evict: u8,
    /// The request's prompt (page patterns), and its unaligned tail.
    prompt: Vec<u8>,
    tail: u8,
    /// Tokens allocated after the admission: `u8::MAX` for the rest of the prompt.
    extend: Option<u8>,
    /// Decode steps after the prefill.
    decode: u8,
    /// Tokens of the finish's and checkpoint's token list replaced: (position, token);
    /// an even position counts within the locked prefix (when there is one).
    edits: Vec<(u16, u32)>,
    /// The finish's token count off by this much.
    off_by: i8,
    then: Then,
    /// Tokens short of the request's length the checkpoint covers (`u8::MAX`: one
    /// past it).
    back: u8,
    /// Where a Mamba request saves its state: 0 and 1 the tokens it caches next (cut to
    /// whole pages), 2 nowhere, 3 one page past them, else that position.
    state: u8,
    /// A sliding-window request's `release_window` range, tried first.
    window: (usize, usize),
}

fn key_of(pages: &[u8], ps: usize) -> Vec<u32> {
    pages.iter().flat_map(|&p| (0..ps).map(move |k| 1 + p as u32 * 64 + k as u32)).collect()
}

fn prompt_of(case: &Case) -> Vec<u32> {
    let mut t = key_of(&case.prompt, case.ps);
    t.extend((0..case.tail as usize % case.ps).map(|k| 900 + k as u32));
    t.truncate(ROW_PAGES * case.ps);
    t
}

fn bound() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..200, Just(usize::MAX), (usize::MAX - 64)..=usize::MAX]
}

fn case() -> impl Strategy<Value = Case> {
    let keys = || prop::collection::vec(prop::collection::vec(0u8..3, 1..5), 0..4);
    let then = prop_oneof![Just(Then::Finish), Just(Then::Checkpoint), Just(Then::CheckpointThenFinish)];
    let setup = (prop::sample::select(vec![1usize, 2, 4, 16]), keys(), keys(), 0u8..3, 0u8..4);
    let token = prop_oneof![Just(0u32), Just(u32::MAX), 1u32..300];
    let request = (
        prop::collection::vec(0u8..3, 0..ROW_PAGES + 2),
        any::<u8>(),
        prop_oneof![1 => Just(None), 3 => Just(Some(u8::MAX)), 1 => any::<u8>().prop_map(Some)],
        0u8..4,
        prop::collection::vec((any::<u16>(), token), 0..3),
        prop_oneof![3 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)],
        then,
        prop_oneof![4 => 0u8..24, 1 => Just(u8::MAX)],
        any::<u8>(),
        (bound(), bound()),
    );
    (setup, request).prop_map(
        |((ps, pre, host, others, evict), (prompt, tail, extend, decode, edits, off_by, then, back, state, window))| {
            Case {
                ps,
                pre,
                host,
                others,
                evict,
                prompt,
                tail,
                extend,
                decode,
                edits,
                off_by,
                then,
                back,
                state,
                window,
            }
        },
    )
}

/// Everything a caller can observe of a cache and a request.
#[derive(Debug, PartialEq)]
struct Snap {
    kv_free: usize,
    sizes: (usize, usize, usize),
    rows_free: usize,
    paths: Vec<(u64, Vec<u32>, Vec<u32>)>,
    extra: Vec<u64>,
    /// The request's length, lock and slots.
    request: (usize, usize, Vec<u32>),
}

fn snap<S: Subject>(s: &S, r: &Request<S::A, S::V>) -> Snap {
    let c = s.cache();
    c.check_invariants().unwrap_or_else(|e| panic!("{e}\n{}", c.pretty_print()));
    Snap {
        kv_free: c.allocator().available_size(),
        sizes: (c.total_size(), c.evictable_size(), c.protected_size()),
        rows_free: c.req_pool().available_size(),
        paths: c.leaf_paths(),
        extra: s.extra(),
        request: (r.len(), r.cached_len(), r.slots().to_vec()),
    }
}

/// A tree variant and its request's own calls.
trait Subject {
    type A: KvAllocator;
    type V: Variant;

    fn cache(&self) -> &Arc<RadixCache<Self::A, Self::V>>;
    /// A request for `key` served and finished (a Mamba request saves its state at the
    /// end of the key's whole pages first).
    fn seed(&self, key: &[u32]) {
        let Ok(mut r) = self.cache().admit(0, key) else { return };
        if r.extend(key.len() - r.len()).is_ok() {
            self.prepare(&mut r, key.len(), 0);
            let _ = r.finish(key);
        }
    }
    /// The variant's own observables.
    fn extra(&self) -> Vec<u64>;
    /// Variant setup after the seeding (host keys).
    fn setup(&self, _case: &Case) {}
    /// The variant's call before the request caches `up_to` tokens (a Mamba state
    /// saved, by the case's `state`); `Err` for a refused call.
    fn prepare(&self, _r: &mut Request<Self::A, Self::V>, _up_to: usize, _state: u8) -> Option<Result<(), String>> {
        None
    }
    /// A variant's own request call before anything is cached (`release_window`).
    fn side(&self, _r: &mut Request<Self::A, Self::V>, _case: &Case) -> Option<Result<(), String>> {
        None
    }
    /// Evict everything and check that every pool is whole.
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

/// A call that returned `r`: on error, nothing may have changed.
fn check_call<S: Subject, T, E: core::fmt::Debug>(
    s: &S,
    req: &Request<S::A, S::V>,
    before: &Snap,
    what: &str,
    r: &Result<T, E>,
) -> Result<(), TestCaseError> {
    match r {
        Ok(_) => invariants(s.cache()),
        Err(e) => {
            let after = snap(s, req);
            if *before != after {
                return Err(TestCaseError::fail(format!(
                    "{what} refused with {e:?} but changed the cache:\nbefore {before:?}\nafter  {after:?}\n{}",
                    s.cache().pretty_print()
                )));
            }
            Ok(())
        }
    }
}

/// A variant's own call on the request: on error, nothing may have changed.
fn variant_call<S: Subject>(
    s: &S,
    r: &mut Request<S::A, S::V>,
    call: impl FnOnce(&S, &mut Request<S::A, S::V>) -> Option<Result<(), String>>,
) -> Result<(), TestCaseError> {
    let before = snap(s, r);
    match call(s, r) {
        Some(e) => check_call(s, r, &before, "the variant's call", &e),
        None => Ok(()),
    }
}

fn run<S: Subject>(s: &S, case: &Case) -> Result<(), TestCaseError> {
    let c = s.cache();
    let ps = case.ps;
    assert_eq!(c.page_size(), ps);
    for key in &case.pre {
        s.seed(&key_of(key, ps));
    }
    s.setup(case);
    let mut others = Vec::new();
    for _ in 0..case.others {
        if let Ok(mut o) = c.admit(0, &[]) {
            if o.extend(ps).is_ok() {
                others.push(o);
            }
        }
    }
    if case.evict > 0 {
        c.evict(case.evict as usize * ps);
    }
    invariants(c)?;

    let prompt = prompt_of(case);
    let mut r = match c.admit(0, &prompt) {
        Ok(r) => r,
        Err(_) => return Ok(()), // no row or state left: refused, nothing to check
    };
    if let Some(n) = case.extend {
        let n = if n == u8::MAX { prompt.len() - r.len() } else { n as usize };
        let before = snap(s, &r);
        let e = r.extend(n);
        check_call(s, &r, &before, "extend", &e)?;
    }
    for _ in 0..case.decode {
        let before = snap(s, &r);
        let e = c.decode(&mut [&mut r], &mut [0]);
        check_call(s, &r, &before, "decode", &e)?;
    }
    // The tokens whose KV the row holds: the prompt, then outputs, then the edits.
    let mut tokens: Vec<u32> = prompt.iter().copied().chain(5000..).take(r.len()).collect();
    for &(pos, t) in &case.edits {
        let within = if pos % 2 == 0 && r.cached_len() > 0 { r.cached_len() } else { tokens.len() };
        if within > 0 {
            tokens[pos as usize / 2 % within] = t;
        }
    }
    variant_call(s, &mut r, |s, r| s.side(r, case))?;

    let (checkpoint, mut finish) = match case.then {
        Then::Finish => (false, true),
        Then::Checkpoint => (true, false),
        Then::CheckpointThenFinish => (true, true),
    };
    if checkpoint {
        let up_to = if case.back == u8::MAX { r.len() + 1 } else { r.len().saturating_sub(case.back as usize) };
        let at = up_to.min(r.len());
        variant_call(s, &mut r, |s, r| s.prepare(r, at, case.state))?;
        let mut t = tokens.clone();
        t.resize(up_to, 7);
        let before = snap(s, &r);
        let locked = r.cached_len();
        let e = r.checkpoint(&t);
        check_call(s, &r, &before, "checkpoint", &e)?;
        if let Ok(()) = e {
            // The lock moves forward, at most to the checkpoint's end.
            prop_assert!(locked <= r.cached_len() && r.cached_len() <= up_to.max(locked));
        } else {
            finish = false;
        }
    }
    if finish {
        let at = r.len();
        variant_call(s, &mut r, |s, r| s.prepare(r, at, case.state))?;
        let n = (tokens.len() as isize + case.off_by as isize).max(0) as usize;
        let mut t = tokens.clone();
        t.resize(n, 7);
        let before = snap(s, &r);
        match r.finish(&t) {
            Ok(_) => {
                prop_assert_eq!(n, tokens.len(), "a finish with a wrong count went through");
                invariants(c)?;
            }
            Err(refused) => {
                let back = refused.request;
                check_call(s, &back, &before, "finish", &Err::<(), _>(refused.error))?;
                drop(back);
            }
        }
    } else {
        drop(r);
    }
    drop(others);
    invariants(c)?;
    prop_assert_eq!(c.req_pool().available_size(), ROWS as usize);
    s.drain().map_err(|e| TestCaseError::fail(format!("{e}\n{}", c.pretty_print())))?;
    invariants(c)?;
    Ok(())
}

fn rows(ps: usize) -> ReqToTokenPool {
    ReqToTokenPool::new(ROWS, ROW_PAGES * ps).unwrap()
}

fn kv(ps: usize) -> PagedAllocator {
    PagedAllocator::new(POOL_PAGES * ps, ps as u32).unwrap()
}

// ---- the plain cache ----

struct PlainTree(Arc<RadixCache<PagedAllocator>>);

impl Subject for PlainTree {
    type A = PagedAllocator;
    type V = kvpool::radix::Plain;

    fn cache(&self) -> &Arc<RadixCache<PagedAllocator>> {
        &self.0
    }
    fn extra(&self) -> Vec<u64> {
        Vec::new()
    }
}

// ---- the Mamba cache over its own state pool ----

struct MambaTree(Arc<MambaRadixCache<PagedAllocator>>);

impl Subject for MambaTree {
    type A = PagedAllocator;
    type V = Mamba<SlotPool>;

    fn cache(&self) -> &Arc<MambaRadixCache<PagedAllocator>> {
        &self.0
    }
    fn extra(&self) -> Vec<u64> {
        let st = self.0.states();
        vec![st.available() as u64, self.0.mamba_evictable_size() as u64, self.0.mamba_protected_size() as u64]
    }
    fn prepare(
        &self,
        r: &mut Request<PagedAllocator, Mamba<SlotPool>>,
        up_to: usize,
        state: u8,
    ) -> Option<Result<(), String>> {
        let ps = self.0.page_size();
        let at = match state % 8 {
            0 | 1 => up_to / ps * ps,
            2 => return None,
            3 => (up_to / ps + 1) * ps,
            _ => state as usize,
        };
        Some(r.save_state(at).map(drop).map_err(|e| e.to_string()))
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

struct SwaTree(Arc<SwaRadixCache>);

impl Subject for SwaTree {
    type A = SwaAllocator;
    type V = kvpool::radix::Swa;

    fn cache(&self) -> &Arc<SwaRadixCache> {
        &self.0
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
    fn side(&self, r: &mut Request<SwaAllocator, kvpool::radix::Swa>, case: &Case) -> Option<Result<(), String>> {
        Some(r.release_window(case.window.0..case.window.1).map(drop).map_err(|e| e.to_string()))
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

struct HiTree(Arc<HiRadixCache<PagedAllocator>>);

impl HiTree {
    /// Complete every transfer taken or queued.
    fn complete_all(&self) -> Result<(), String> {
        let mut t = [Transfer::default(); 8];
        loop {
            let n = self.0.take_transfers(&mut t);
            if n == 0 {
                return Ok(());
            }
            for &x in &t[..n] {
                self.0.complete(x).map_err(|e| e.to_string())?;
            }
        }
    }
}

impl Subject for HiTree {
    type A = PagedAllocator;
    type V = kvpool::radix::Hi;

    fn cache(&self) -> &Arc<HiRadixCache<PagedAllocator>> {
        &self.0
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
    fn drain(&self) -> Result<(), String> {
        let c = &self.0;
        self.complete_all()?;
        c.evict(usize::MAX);
        // Evicting may back nodes up (write-back) before they leave the device.
        while c.transfers_in_flight() > 0 {
            self.complete_all()?;
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

fn plain(ps: usize) -> PlainTree {
    PlainTree(Arc::new(RadixCache::new(kv(ps), rows(ps), RadixConfig::default()).unwrap()))
}

fn mamba_tree(ps: usize) -> MambaTree {
    let states = SlotPool::without_magazines(STATES);
    MambaTree(Arc::new(MambaRadixCache::with_states(kv(ps), rows(ps), states, RadixConfig::default()).unwrap()))
}

fn swa(ps: usize) -> SwaTree {
    let alloc = SwaAllocator::new(POOL_PAGES * ps, POOL_PAGES / 2 * ps, ps as u32).unwrap();
    SwaTree(Arc::new(SwaRadixCache::with_window(alloc, rows(ps), RadixConfig::default(), 2 * ps).unwrap()))
}

fn hi(ps: usize) -> HiTree {
    let c = HiRadixCache::with_host_tier(kv(ps), rows(ps), RadixConfig::default(), HostTier::new(16));
    HiTree(Arc::new(c.unwrap()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn plain_requests_refuse_hostile_calls(case in case()) {
        run(&plain(case.ps), &case)?;
    }

    #[test]
    fn mamba_requests_refuse_hostile_calls(case in case()) {
        run(&mamba_tree(case.ps), &case)?;
    }

    #[test]
    fn swa_requests_refuse_hostile_calls(case in case()) {
        run(&swa(case.ps), &case)?;
    }

    #[test]
    fn hi_requests_refuse_hostile_calls(case in case()) {
        run(&hi(case.ps), &case)?;
    }
}

/// A request that allocated nothing, finished with its prompt: refused (it holds no
/// token), handed back, and it finishes with no tokens, caching nothing.
#[test]
fn finishing_an_unextended_request_is_refused() {
    fn check<S: Subject>(s: &S) {
        let c = s.cache();
        let tokens = [1, 2, 3, 4];
        let r = c.admit(0, &tokens).unwrap();
        assert_eq!(r.len(), 0);
        let before = snap(s, &r);
        let refused = r.finish(&tokens).unwrap_err();
        assert_eq!(refused.error, CacheError::TokenCount { tokens: 4, held: 0 });
        assert_eq!(snap(s, &refused.request), before);
        refused.request.finish(&[]).unwrap();
        assert_eq!(c.total_size(), 0);
        assert_eq!(c.req_pool().available_size(), ROWS as usize);
        invariants(c).unwrap();
        s.drain().unwrap();
    }
    for ps in [1, 4] {
        check(&plain(ps));
        check(&mamba_tree(ps));
        check(&swa(ps));
        check(&hi(ps));
    }
}

/// A request whose tokens leave its locked path inside a cached node (they differ from
/// the prompt it was admitted with) is refused by the checkpoint and the finish of
/// every variant, with nothing changed; with its own tokens it is cached.
#[test]
fn tokens_that_leave_the_locked_path_are_refused() {
    fn check<S: Subject>(s: &S, ps: usize, checkpoint: bool) {
        let c = s.cache();
        let cached: Vec<u32> = (1..=4 * ps as u32).collect();
        s.seed(&cached);
        // One page more than the cached key, so that a checkpoint has something to cache.
        let tokens: Vec<u32> = (1..=5 * ps as u32).collect();
        let mut other = tokens.clone();
        other[2 * ps] = 999; // the third page differs: inside the one cached node
        {
            let mut r = c.admit(0, &tokens).unwrap();
            assert_eq!(r.cached_len(), cached.len());
            r.extend(ps).unwrap();
            if let Some(e) = s.prepare(&mut r, tokens.len(), 0) {
                e.unwrap();
            }
            let before = snap(s, &r);
            if checkpoint {
                let e = r.checkpoint(&other).unwrap_err();
                assert!(matches!(e, CacheError::RowMismatch { .. }), "{e:?}");
                assert_eq!(snap(s, &r), before);
                r.checkpoint(&tokens).unwrap();
                assert_eq!(r.cached_len(), tokens.len());
                drop(r);
            } else {
                let refused = r.finish(&other).unwrap_err();
                assert!(matches!(refused.error, CacheError::RowMismatch { .. }), "{:?}", refused.error);
                assert_eq!(snap(s, &refused.request), before);
                refused.request.finish(&tokens).unwrap();
            }
            invariants(c).unwrap();
        }
        s.drain().unwrap();
    }
    for ps in [1, 2, 4, 16] {
        for checkpoint in [false, true] {
            check(&plain(ps), ps, checkpoint);
            check(&mamba_tree(ps), ps, checkpoint);
            check(&swa(ps), ps, checkpoint);
            check(&hi(ps), ps, checkpoint);
        }
    }
}

/// A window release whose start rounds up past `usize::MAX`, or lies past the
/// request's end, frees nothing; one whose end is past the request's end is refused.
#[test]
fn release_window_at_the_end_of_the_index_range_frees_nothing() {
    for ps in [1, 2, 4, 16] {
        let s = swa(ps);
        let c = &s.0;
        let mut r = c.admit(0, &[]).unwrap();
        r.extend(4 * ps).unwrap();
        let before = snap(&s, &r);
        let len = r.len();
        for start in [usize::MAX, usize::MAX - 1, usize::MAX - ps, len] {
            assert_eq!(r.release_window(start..len), Ok(0), "{start}");
            let e = r.release_window(start..usize::MAX);
            assert_eq!(e, Err(CacheError::TokenCount { tokens: usize::MAX, held: len }), "{start}");
        }
        assert_eq!(snap(&s, &r), before);
        assert_eq!(r.release_window(0..len), Ok(len));
        drop(r);
        s.drain().unwrap();
    }
}
