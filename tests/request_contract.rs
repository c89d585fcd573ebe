//! The request handle's contract: what a scheduler can get wrong with rows, leases and
//! token counts is a typed error with nothing changed, or impossible; a dropped
//! request gives everything back; a leak is an invariant violation.

use std::sync::Arc;

use kvpool::radix::{CacheError, RadixCache, RadixConfig, Request};
use kvpool::{AllocError, PagedAllocator, ReqToTokenPool, RowError};
use proptest::prelude::*;

type Cache = RadixCache<PagedAllocator>;

fn cache(tokens: usize, ps: u32, rows: u32, row_len: usize) -> Arc<Cache> {
    let alloc = PagedAllocator::new(tokens, ps).unwrap();
    Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(rows, row_len).unwrap(), RadixConfig::default()).unwrap())
}

/// Free KV, the three sizes, free rows, and every cached path.
type Snapshot = (usize, usize, usize, usize, usize, Vec<(u64, Vec<u32>, Vec<u32>)>);

/// Everything observable about the cache's state, for "nothing changed" checks.
fn snapshot(c: &Cache) -> Snapshot {
    let a = c.allocator();
    (
        a.available_size(),
        c.total_size(),
        c.evictable_size(),
        c.protected_size(),
        c.req_pool().available_size(),
        c.leaf_paths(),
    )
}

/// A served request: admitted, prefilled, `outputs` decode steps; returns it with its KV
/// tokens (prompt and outputs but the last).
fn serve(c: &Arc<Cache>, prompt: &[u32], outputs: usize) -> (Request<PagedAllocator>, Vec<u32>) {
    let mut r = c.admit(0, prompt).unwrap();
    r.extend(prompt.len() - r.len()).unwrap();
    let mut kv = prompt.to_vec();
    for i in 0..outputs.saturating_sub(1) {
        c.decode(&mut [&mut r], &mut [0]).unwrap();
        kv.push(9000 + i as u32);
    }
    assert_eq!(r.len(), kv.len());
    (r, kv)
}

/// The long finish: a row whose earlier occupant left cells naming another request's
/// live page, finished with more tokens than were written. Refused, nothing changed,
/// and the live request's pages are never taken.
#[test]
fn a_long_finish_is_refused_and_never_takes_another_requests_pages() {
    let c = cache(256, 4, 8, 64);
    // X fills a row with 16 slots and aborts; Y then gets X's slots.
    let mut x = c.admit(0, &[]).unwrap();
    x.extend(16).unwrap();
    let x_slots = x.slots().to_vec();
    x.abort();
    let mut y = c.admit(0, &[]).unwrap();
    y.extend(16).unwrap();
    assert_eq!(y.slots(), &x_slots[..], "Y reuses X's slots (the trial's setup)");
    let y_slots = y.slots().to_vec();

    // Z takes X's old row (its stale cells name Y's pages) and writes 12 positions.
    let key: Vec<u32> = (500..516).collect();
    let mut z = c.admit(0, &key).unwrap();
    z.extend(12).unwrap();
    let before = snapshot(&c);
    let refused = z.finish(&key).unwrap_err();
    assert_eq!(refused.error, CacheError::TokenCount { tokens: 16, held: 12 });
    assert_eq!(snapshot(&c), before, "a refused finish changes nothing");
    let z = refused.request;
    assert_eq!(z.len(), 12);
    assert_eq!(z.finish(&key[..12]).unwrap(), 0);
    c.check_invariants().unwrap();

    // Everything evictable goes, and all free slots are handed out to requests (a row
    // holds 64): none is Y's.
    c.evict(usize::MAX);
    let mut takers = Vec::new();
    while c.allocator().available_size() > 0 {
        let mut w = c.admit(0, &[]).unwrap();
        w.extend(c.allocator().available_size().min(64)).unwrap();
        assert!(w.slots().iter().all(|s| !y_slots.contains(s)), "a free slot is one of Y's live slots");
        takers.push(w);
    }
    drop(takers);
    drop(y);
    c.check_invariants().unwrap();
    assert_eq!(c.allocator().available_size() + c.total_size(), 256);
}

/// The short finish: the row holds a slot for every token (a decode step too many),
/// the finish names one token fewer. Refused with nothing changed, where the old
/// helpers leaked the slot silently.
#[test]
fn a_short_finish_is_refused_with_nothing_changed() {
    for ps in [1, 4, 16] {
        let c = cache(1024, ps, 4, 128);
        let prompt: Vec<u32> = (1..=20).collect();
        let (mut r, mut kv) = serve(&c, &prompt, 5);
        // One more step: the row now holds the last generated token's slot too.
        c.decode(&mut [&mut r], &mut [0]).unwrap();
        let before = snapshot(&c);
        let refused = r.finish(&kv).unwrap_err();
        assert_eq!(refused.error, CacheError::TokenCount { tokens: kv.len(), held: kv.len() + 1 });
        assert_eq!(snapshot(&c), before);
        kv.push(77);
        refused.request.finish(&kv).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.allocator().available_size() + c.total_size(), 1024, "page size {ps}: nothing leaked");
    }
}

/// A failed finish hands the request back whole; `?` works on it, and dropping the
/// error aborts the request.
#[test]
fn a_failed_finish_returns_the_request_and_question_mark_works() {
    let c = cache(256, 4, 4, 64);
    let prompt: Vec<u32> = (1..=12).collect();
    let (r, kv) = serve(&c, &prompt, 1);
    r.finish(&kv).unwrap();

    // The same prompt again: 12 tokens locked. Finishing with other tokens under the
    // lock is refused (the locked prefix is the tree's, for the admitted tokens).
    let (r, kv) = serve(&c, &prompt, 3);
    assert_eq!(r.cached_len(), 12);
    let mut wrong = kv.clone();
    wrong[0] = 999;
    let before = snapshot(&c);
    let refused = r.finish(&wrong).unwrap_err();
    assert!(matches!(refused.error, CacheError::RowMismatch { .. }), "{:?}", refused.error);
    assert_eq!(snapshot(&c), before);
    let r = refused.request;

    fn finish_with_question_mark(r: Request<PagedAllocator>, t: &[u32]) -> Result<usize, Box<dyn std::error::Error>> {
        Ok(r.finish(t)?)
    }
    let e = finish_with_question_mark(r, &wrong).unwrap_err();
    assert!(e.to_string().contains("not finished"), "{e}");
    assert_eq!(c.protected_size(), 12, "the error holds the request");
    drop(e);
    // The error, and the request in it, are gone: everything was given back.
    assert_eq!(c.protected_size(), 0);
    assert_eq!(c.req_pool().available_size(), 4);
    c.check_invariants().unwrap();
    assert_eq!(c.allocator().available_size() + c.total_size(), 256);
}

/// A request dropped without finish or abort gives its slots, its lock and its row
/// back, and caches nothing.
#[test]
fn a_dropped_request_is_aborted() {
    let c = cache(256, 4, 2, 64);
    let prompt: Vec<u32> = (1..=8).collect();
    let (r, kv) = serve(&c, &prompt, 1);
    r.finish(&kv).unwrap();
    let before = snapshot(&c);
    {
        let (r, _) = serve(&c, &(1..=30).collect::<Vec<_>>(), 6);
        assert_eq!(r.cached_len(), 8);
        assert_eq!(c.protected_size(), 8);
        assert_eq!(c.req_pool().available_size(), 1);
    }
    assert_eq!(snapshot(&c), before);
    c.check_invariants().unwrap();
}

/// Decode continues each request's own last slot; a batch with a request of another
/// cache, a full row, a wrong output length, or too little memory changes nothing.
#[test]
fn decode_batches_continue_each_request_and_refuse_whole() {
    let c = cache(64, 4, 4, 64);
    let other = cache(64, 4, 4, 64);
    let mut a = c.admit(0, &[1, 2, 3]).unwrap();
    a.extend(3).unwrap();
    let mut b = c.admit(0, &[5, 6, 7, 8]).unwrap();
    b.extend(4).unwrap();
    let mut out = [0u32; 2];
    c.decode(&mut [&mut a, &mut b], &mut out).unwrap();
    assert_eq!(out[0], a.slots()[2] + 1, "a continues its page");
    assert_eq!(out[1] % 4, 0, "b starts a page");
    assert_eq!((a.len(), b.len()), (4, 5));

    let mut stranger = other.admit(0, &[1]).unwrap();
    stranger.extend(1).unwrap();
    let before = snapshot(&c);
    let e = c.decode(&mut [&mut a, &mut stranger], &mut out).unwrap_err();
    assert!(matches!(e, AllocError::Row(RowError::ForeignRow { .. })), "{e:?}");
    assert!(c.decode(&mut [&mut a], &mut out).is_err(), "output length");
    assert_eq!(snapshot(&c), before);
    assert_eq!((a.len(), b.len()), (4, 5));

    // Fill the pool, then a batch whose second request needs a page fails whole.
    let mut big = c.admit(0, &[]).unwrap();
    let free = c.allocator().available_size();
    big.extend(free).unwrap();
    assert_eq!(c.allocator().available_size(), 0);
    let before = snapshot(&c);
    let e = c.decode(&mut [&mut b, &mut a], &mut out).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e:?}");
    assert_eq!(snapshot(&c), before);
    assert_eq!((a.len(), b.len()), (4, 5));
    drop(big);
    c.decode(&mut [&mut b, &mut a], &mut out).unwrap();

    drop((a, b));
    c.check_invariants().unwrap();

    // A full row.
    let c = cache(64, 4, 1, 16);
    let mut full = c.admit(0, &[]).unwrap();
    full.extend(16).unwrap();
    let before = snapshot(&c);
    assert!(matches!(c.decode(&mut [&mut full], &mut [0]), Err(AllocError::Row(_))));
    assert!(matches!(full.extend(1), Err(AllocError::Row(_))));
    assert_eq!(snapshot(&c), before);
    c.check_invariants().unwrap();
}

/// A chunked prefill: each checkpoint caches what is computed so far, moves the lock,
/// and a checkpoint past what the row holds is refused.
#[test]
fn checkpoints_cache_as_they_go() {
    let c = cache(256, 4, 4, 64);
    let prompt: Vec<u32> = (1..=22).collect();
    let mut r = c.admit(0, &prompt).unwrap();
    r.extend(10).unwrap();
    let before = snapshot(&c);
    assert_eq!(r.checkpoint(&prompt[..11]), Err(CacheError::TokenCount { tokens: 11, held: 10 }));
    assert_eq!(snapshot(&c), before);
    r.checkpoint(&prompt[..10]).unwrap();
    assert_eq!((r.cached_len(), r.len(), c.total_size(), c.protected_size()), (8, 10, 8, 8));
    c.check_invariants().unwrap();
    r.extend(12).unwrap();
    r.checkpoint(&prompt).unwrap();
    assert_eq!((r.cached_len(), c.total_size()), (20, 20));
    c.check_invariants().unwrap();
    // Another request sharing the first chunk finds it while this one runs.
    let other = c.admit(0, &prompt[..9]).unwrap();
    assert_eq!(other.cached_len(), 8);
    drop(other);
    let mut step = [0u32];
    c.decode(&mut [&mut r], &mut step).unwrap();
    let kv: Vec<u32> = prompt.iter().copied().chain([100]).collect();
    assert_eq!(r.finish(&kv).unwrap(), 20);
    c.check_invariants().unwrap();
    assert_eq!(c.allocator().available_size() + c.total_size(), 256);
}

/// Admission refuses a prompt longer than a row, and runs out of rows cleanly.
#[test]
fn admission_errors_change_nothing() {
    let c = cache(64, 1, 1, 8);
    let before = snapshot(&c);
    assert!(matches!(c.admit(0, &[0; 9]), Err(AllocError::Row(_))));
    let r = c.admit(0, &[1, 2]).unwrap();
    assert!(matches!(c.admit(0, &[1, 2]), Err(AllocError::OutOfMemory(_))));
    drop(r);
    assert_eq!(snapshot(&c), before);
}

/// What each step of a random schedule does to a request.
#[derive(Clone, Debug)]
enum Step {
    Admit { prompt: usize, family: u8 },
    Extend { req: usize, n: usize },
    Decode { mask: u8 },
    Checkpoint { req: usize, back: usize },
    Finish { req: usize, off_by: i8 },
    Abort { req: usize },
    Evict { n: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0usize..40, 0u8..3).prop_map(|(prompt, family)| Step::Admit { prompt, family }),
        (0usize..6, 0usize..24).prop_map(|(req, n)| Step::Extend { req, n }),
        any::<u8>().prop_map(|mask| Step::Decode { mask }),
        (0usize..6, 0usize..6).prop_map(|(req, back)| Step::Checkpoint { req, back }),
        (0usize..6, -1i8..=1).prop_map(|(req, off_by)| Step::Finish { req, off_by }),
        (0usize..6).prop_map(|req| Step::Abort { req }),
        (0usize..64).prop_map(|n| Step::Evict { n }),
    ]
}

/// A request in the random schedule, with the tokens of the KV its row holds.
struct Live {
    req: Request<PagedAllocator>,
    tokens: Vec<u32>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any schedule of admissions, chunks, decode batches, checkpoints, finishes (some
    /// with a wrong count), aborts and evictions keeps the accounting exact after every
    /// step, and gives everything back at the end.
    #[test]
    fn random_lifecycles_keep_the_accounting(ps in prop_oneof![Just(1u32), Just(4)], steps in proptest::collection::vec(step(), 1..60)) {
        let c = cache(160, ps, 6, 64);
        let mut live: Vec<Live> = Vec::new();
        for s in steps {
            match s {
                Step::Admit { prompt, family } => {
                    let tokens: Vec<u32> = (0..prompt as u32).map(|i| u32::from(family) * 1000 + i).collect();
                    if let Ok(req) = c.admit(0, &tokens) {
                        let hit = req.cached_len();
                        prop_assert_eq!(req.len(), hit);
                        live.push(Live { req, tokens: tokens[..hit].to_vec() });
                    }
                }
                Step::Extend { req, n } => {
                    if let Some(l) = live.get_mut(req) {
                        let before = snapshot(&c);
                        match l.req.extend(n) {
                            Ok(()) => {
                                let at = l.tokens.len() as u32;
                                l.tokens.extend((0..n as u32).map(|i| 50_000 + at + i));
                            }
                            Err(_) => prop_assert_eq!(snapshot(&c), before),
                        }
                    }
                }
                Step::Decode { mask } => {
                    let mut batch: Vec<&mut Live> =
                        live.iter_mut().enumerate().filter(|(i, _)| mask >> (i % 8) & 1 == 1).map(|(_, l)| l).collect();
                    let mut reqs: Vec<&mut Request<PagedAllocator>> = batch.iter_mut().map(|l| &mut l.req).collect();
                    let mut out = vec![0u32; reqs.len()];
                    let before = snapshot(&c);
                    if c.decode(&mut reqs, &mut out).is_ok() {
                        for l in batch {
                            let slot = *l.req.slots().last().unwrap();
                            prop_assert!(out.contains(&slot));
                            let n = l.tokens.len() as u32;
                            l.tokens.push(70_000 + n);
                        }
                    } else {
                        prop_assert_eq!(snapshot(&c), before);
                    }
                }
                Step::Checkpoint { req, back } => {
                    if let Some(l) = live.get_mut(req) {
                        let up_to = l.tokens.len().saturating_sub(back).max(l.req.cached_len());
                        l.req.checkpoint(&l.tokens[..up_to]).unwrap();
                        prop_assert!(l.req.cached_len() <= up_to);
                    }
                }
                Step::Finish { req, off_by } => {
                    if req < live.len() {
                        let l = live.swap_remove(req);
                        let n = (l.tokens.len() as isize + off_by as isize).max(0) as usize;
                        let mut t = l.tokens.clone();
                        t.resize(n, 1);
                        let before = snapshot(&c);
                        match l.req.finish(&t) {
                            Ok(_) => prop_assert_eq!(n, l.tokens.len()),
                            Err(refused) => {
                                prop_assert!(n != l.tokens.len());
                                prop_assert_eq!(refused.error.clone(), CacheError::TokenCount { tokens: n, held: l.tokens.len() });
                                prop_assert_eq!(snapshot(&c), before);
                                live.push(Live { req: refused.request, tokens: l.tokens });
                            }
                        }
                    }
                }
                Step::Abort { req } => {
                    if req < live.len() {
                        live.swap_remove(req).req.abort();
                    }
                }
                Step::Evict { n } => {
                    c.evict(n);
                }
            }
            c.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        live.clear();
        prop_assert_eq!(c.protected_size(), 0);
        prop_assert_eq!(c.req_pool().available_size(), 6);
        prop_assert_eq!(c.allocator().available_size() + c.total_size(), 160);
        c.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

/// With `split_at_prompt`, a finished request's prompt and outputs are two nodes, and
/// eviction takes the outputs first; off (the default), one leaf goes whole.
#[test]
fn split_at_prompt_evicts_the_outputs_first() {
    for split in [false, true] {
        let config = RadixConfig { split_at_prompt: split, ..RadixConfig::default() };
        let alloc = PagedAllocator::new(256, 4).unwrap();
        let c = Arc::new(RadixCache::new(alloc, ReqToTokenPool::new(2, 64).unwrap(), config).unwrap());
        let prompt: Vec<u32> = (1..=10).collect();
        let (r, kv) = serve(&c, &prompt, 9); // 18 KV tokens: 8 of the prompt's whole pages, 16 cached
        r.finish(&kv).unwrap();
        assert_eq!(c.total_size(), 16);
        assert_eq!(c.node_count(), if split { 2 } else { 1 });
        assert_eq!(c.evict(1), if split { 8 } else { 16 });
        if split {
            let again = c.admit(0, &kv).unwrap();
            assert_eq!(again.cached_len(), 8, "the prompt stays cached");
        }
        c.check_invariants().unwrap();
    }
}

/// Salted keys never share KV across salts; extra keys neither; a plain `u64` is the
/// extra key alone.
#[test]
fn salts_and_extra_keys_isolate() {
    use kvpool::radix::CacheKey;
    let c = cache(512, 4, 4, 64);
    let tokens: Vec<u32> = (1..=17).collect();
    let keys = [
        CacheKey::default(),
        CacheKey { salt: 1, ..CacheKey::default() },
        CacheKey { salt: 2, ..CacheKey::default() },
        CacheKey { extra: 7, ..CacheKey::default() },
        CacheKey { extra: 7, salt: 1, ..CacheKey::default() },
    ];
    for (i, &k) in keys.iter().enumerate() {
        let mut r = c.admit(k, &tokens).unwrap();
        assert_eq!(r.cached_len(), 0, "key {i} hit another key's KV");
        r.extend(17).unwrap();
        r.finish(&tokens).unwrap();
        assert_eq!(c.admit(k, &tokens).unwrap().cached_len(), 16, "key {i} misses its own KV");
    }
    assert_eq!(c.admit(7, &tokens).unwrap().cached_len(), 16);
    c.check_invariants().unwrap();
}

/// EAGLE bigram keys: a position is reused only when the token after it matches too;
/// the request caches one position fewer than its row holds and leaks nothing.
#[test]
fn bigram_keys_reuse_a_position_only_with_its_next_token() {
    use kvpool::radix::CacheKey;
    let bigram = CacheKey { bigram: true, ..CacheKey::default() };
    for len in 1..=13usize {
        let c = cache(256, 4, 4, 64);
        let tokens: Vec<u32> = (100..100 + len as u32).collect();
        let mut r = c.admit(bigram, &tokens).unwrap();
        r.extend(len).unwrap();
        r.finish(&tokens).unwrap();
        assert_eq!(c.total_size(), (len - 1) / 4 * 4, "{len} tokens");
        c.check_invariants().unwrap();
        assert_eq!(c.allocator().available_size() + c.total_size(), 256, "{len} tokens: leaked");
    }
    let c = cache(256, 4, 4, 64);
    let tokens: Vec<u32> = (100..110).collect();
    let mut r = c.admit(bigram, &tokens).unwrap();
    r.extend(10).unwrap();
    r.finish(&tokens).unwrap();
    assert_eq!(c.total_size(), 8);
    // The same first 9 tokens: positions 0..8 have their next tokens: 8 reused.
    let mut same = tokens[..9].to_vec();
    same.push(555);
    assert_eq!(c.admit(bigram, &same).unwrap().cached_len(), 8);
    // Differing at token 8: position 7 lacks its next token, so only the first page.
    let mut differ = tokens[..8].to_vec();
    differ.extend([555, 556]);
    assert_eq!(c.admit(bigram, &differ).unwrap().cached_len(), 4);
    // The plain key does not see bigram KV, nor does another first token.
    assert_eq!(c.admit(0, &tokens).unwrap().cached_len(), 0);
    let mut other_first = tokens.clone();
    other_first[0] = 1;
    assert_eq!(c.admit(bigram, &other_first).unwrap().cached_len(), 0);
    // A finish whose first token is not the admitted one is refused, nothing changed.
    let mut r = c.admit(bigram, &tokens).unwrap();
    assert_eq!(r.cached_len(), 8);
    r.extend(4).unwrap();
    let mut wrong = tokens.clone();
    wrong.extend([1, 2]);
    wrong[0] = 1;
    let before = snapshot(&c);
    let refused = r.finish(&wrong).unwrap_err();
    assert!(matches!(refused.error, CacheError::RowMismatch { index: 0, .. }), "{:?}", refused.error);
    assert_eq!(snapshot(&c), before);
    wrong[0] = 100;
    refused.request.finish(&wrong).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.allocator().available_size() + c.total_size(), 256);
}

/// Page hashes (the KV events', the shared store's keys) differ under different salts
/// all along the path, and the default key's are the plain chain.
#[test]
fn salted_pages_hash_apart() {
    use kvpool::radix::{namespace_seed, page_hash, CacheKey, KvEvent};
    let config = RadixConfig { event_capacity: Some(64), ..RadixConfig::default() };
    let c = Arc::new(
        RadixCache::new(PagedAllocator::new(256, 4).unwrap(), ReqToTokenPool::new(2, 64).unwrap(), config).unwrap(),
    );
    let tokens: Vec<u32> = (1..=8).collect();
    let mut hashes = Vec::new();
    for salt in [0u64, 1, 2] {
        let key = CacheKey { salt, ..CacheKey::default() };
        let mut r = c.admit(key, &tokens).unwrap();
        r.extend(8).unwrap();
        r.finish(&tokens).unwrap();
        let ns = key.tree_key(&tokens).0;
        let seed = namespace_seed(ns);
        let first = page_hash(seed.as_ref(), &tokens[..4]);
        let second = page_hash(Some(&first), &tokens[4..]);
        let mut stored = Vec::new();
        while let Some(e) = c.events().unwrap().pop() {
            if let KvEvent::BlockStored { hash, namespace, .. } = e {
                assert_eq!(namespace, ns);
                stored.push(hash);
            }
        }
        assert_eq!(stored, [first, second], "salt {salt}");
        hashes.extend(stored);
    }
    assert_eq!(hashes[0], page_hash(None, &tokens[..4]));
    let mut unique = hashes.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), hashes.len());
}
