//! Loom models of the scheduler protocol in `src/lib.rs`, with kvpool's types inside.
//!
//! ```sh
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --tests -- --nocapture
//! ```
//!
//! Every model runs through `kvpool::loom::run_model`, which counts the executions loom
//! explored and fails when there was only one, and counts the outcomes it names, failing
//! when an interleaving the model is about was never reached. Pools are tiny (4 slots,
//! a row or two): loom explores every interleaving, and that number grows fast with
//! every atomic operation.
//!
//! | model | what it shows |
//! |---|---|
//! | `a_routed_requests_prefix_is_never_evicted` | a request a router admitted (a lock on its cached prefix) and handed to the scheduler keeps that prefix's slots allocated and out of every other request's hands, however the scheduler's evicting prefill interleaves; once the request finishes they can be reused |
//! | `slots_freed_on_the_output_thread_are_never_handed_out_twice` | the overlap loop: the scheduler allocates batch 2 while the output thread frees batch 1; a slot is never held by both, and batch 2's KV writes happen after batch 1's reads (loom checks the cells) |
//! | `pages_freed_on_the_output_thread_are_never_handed_out_twice` | the same on a paged allocator (pages of 2) |
//! | `a_request_finished_on_the_output_thread_while_its_prefix_is_admitted` | a request moves to the output thread, which finishes it while the scheduler admits, prefills, decodes and finishes one with the same prefix; at the end every slot is free or cached, every lock and row released, and the cache's accounting is exact |
#![cfg(loom)]

use kvpool::loom::cell::UnsafeCell;
use kvpool::loom::model::Builder;
use kvpool::loom::sync::atomic::{AtomicBool, Ordering};
use kvpool::radix::{RadixCache, RadixConfig};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool, TokenAllocator};
use loom_scheduler::sync::{mpsc, thread, Arc};
use loom_scheduler::{decode, free_batches, Running, ToOutput};

use std::sync::atomic::{AtomicUsize, Ordering as StdOrdering};

/// Named outcome counters, shared by a model's executions (std atomics: outside the
/// model, they count across executions).
#[derive(Clone)]
struct Outcomes(std::sync::Arc<Vec<(&'static str, AtomicUsize)>>);

impl Outcomes {
    fn new(labels: &[&'static str]) -> Self {
        Outcomes(std::sync::Arc::new(labels.iter().map(|&l| (l, AtomicUsize::new(0))).collect()))
    }

    fn hit(&self, label: &str) {
        let (_, n) = self.0.iter().find(|(l, _)| *l == label).unwrap_or_else(|| panic!("undeclared {label}"));
        n.fetch_add(1, StdOrdering::Relaxed);
    }

    /// Fail unless every outcome was reached in some execution.
    fn expect_all(&self, model: &str) {
        let counts: Vec<String> = self.0.iter().map(|(l, n)| format!("{l}={}", n.load(StdOrdering::Relaxed))).collect();
        eprintln!("loom model {model}: outcomes {}", counts.join(" "));
        for (l, n) in self.0.iter() {
            assert!(n.load(StdOrdering::Relaxed) > 0, "{model} never reached `{l}` ({})", counts.join(" "));
        }
    }
}

/// A cache of 4 token slots (page size 1) and `rows` request rows of 4 tokens, shared
/// the way requests hold it (`std::sync::Arc`).
fn tiny_cache(rows: u32) -> std::sync::Arc<RadixCache<TokenAllocator>> {
    let (kv, rows) = (TokenAllocator::new(4).unwrap(), ReqToTokenPool::new(rows, 4).unwrap());
    std::sync::Arc::new(RadixCache::new(kv, rows, RadixConfig::default()).unwrap())
}

/// Every slot is free or cached, nothing is locked, every row is free, invariants hold
/// (the accounting included: free + cached + held by live requests = capacity).
fn assert_settled(cache: &RadixCache<TokenAllocator>, rows: usize) {
    cache.check_invariants().unwrap();
    let alloc = cache.allocator();
    assert_eq!(alloc.available_size() + cache.total_size(), alloc.size(), "a slot leaked");
    assert_eq!(cache.protected_size(), 0, "a lock was never released");
    assert_eq!(cache.req_pool().available_size(), rows, "a row was never freed");
}

/// The prefix `[1, 2]` is cached (two of the four slots). A router admits a request for
/// `[1, 2]`, which locks that prefix if it is still there, looks it up again, and hands
/// the request to the scheduler. The scheduler meanwhile admits a 4-token request of its
/// own, whose prefill fits only by evicting `[1, 2]`; it then receives the routed
/// request and finishes it, and retries its own prefill if the first try found no room.
///
/// No slot the scheduler's prefill gets is under the router's live lock, and a locked
/// slot stays allocated and findable until its request finishes. Either the router's
/// lock comes first (the first prefill runs out of memory; the retry, after the routed
/// request finished, evicts its prefix) or the eviction does (the router misses).
#[test]
fn a_routed_requests_prefix_is_never_evicted() {
    let locked_first = "locked: the prefill waited for the routed request";
    let evicted_first = "evicted first: the router missed";
    let outcomes = Outcomes::new(&[locked_first, evicted_first]);
    let seen = outcomes.clone();
    kvpool::loom::run_model("a_routed_requests_prefix_is_never_evicted", Builder::new(), move || {
        let cache = tiny_cache(2);
        let mut first = Running::admit(&cache, 0, &[1, 2]).unwrap();
        first.prefill().unwrap();
        let cached = first.slots().to_vec();
        assert_eq!(first.finish().unwrap(), 0);
        // locked[s]: a live routed request locks slot s (set after its admission, cleared
        // before its finish).
        let locked: Arc<Vec<AtomicBool>> = Arc::new((0..5).map(|_| AtomicBool::new(false)).collect());
        let (to_scheduler, routed) = mpsc::channel::<Running<TokenAllocator>>();

        // The writer first, the reader second (see tokio-rs/loom#392 in kvpool::loom).
        let scheduler = {
            let (cache, locked, cached) = (std::sync::Arc::clone(&cache), Arc::clone(&locked), cached.clone());
            thread::spawn(move || {
                let assert_unlocked = |own: &Running<TokenAllocator>| {
                    for &s in own.slots() {
                        assert!(!locked[s as usize].load(Ordering::SeqCst), "slot {s} handed out under a live lock");
                    }
                };
                let mut own = Running::admit(&cache, 0, &[7, 8, 9, 10]).unwrap();
                // Out of memory only while the routed request locks the prefix.
                let waiting = match own.prefill() {
                    Ok(()) => {
                        assert_unlocked(&own);
                        own.abort(); // done with it: its slots and row go back
                        None
                    }
                    Err(e) => {
                        assert!(e.out_of_memory().is_some(), "{e}");
                        Some(own)
                    }
                };
                let mut r = routed.recv().unwrap();
                let hit = r.cached_len() == 2;
                if hit {
                    assert_eq!(r.slots(), cached);
                    for &s in r.slots() {
                        locked[s as usize].store(false, Ordering::SeqCst);
                    }
                } else {
                    assert_eq!(r.cached_len(), 0, "a partial hit of a 2-token prefix");
                }
                r.prefill().unwrap();
                assert_eq!(r.finish().unwrap(), if hit { 2 } else { 0 });
                let waited = waiting.is_some();
                if let Some(mut own) = waiting {
                    own.prefill().expect("the routed request finished: its prefix is evictable now");
                    assert_unlocked(&own);
                    own.finish().unwrap();
                }
                (hit, waited)
            })
        };
        let router = {
            let (cache, locked) = (std::sync::Arc::clone(&cache), Arc::clone(&locked));
            thread::spawn(move || {
                let r = Running::admit(&cache, 0, &[1, 2]).unwrap();
                if r.cached_len() == 2 {
                    assert_eq!(r.slots(), cached);
                    for &s in r.slots() {
                        locked[s as usize].store(true, Ordering::SeqCst);
                    }
                    // Route the request (here: look again); the scheduler may run meanwhile.
                    thread::yield_now();
                    let mut out = [0u32; 2];
                    assert_eq!(cache.peek_prefix(0, &[1, 2], &mut out), 2, "a locked prefix disappeared");
                    assert_eq!(out[..], cached[..]);
                    for &s in r.slots() {
                        assert!(cache.allocator().is_allocated(s), "locked slot {s} was freed");
                    }
                }
                to_scheduler.send(r).unwrap();
            })
        };
        let (hit, waited) = scheduler.join().unwrap();
        router.join().unwrap();
        seen.hit(match (hit, waited) {
            (true, true) => locked_first,
            (false, false) => evicted_first,
            (true, false) => panic!("the scheduler's prefill took all four slots while the router's lock held two"),
            (false, true) => panic!("the router missed, yet the scheduler's prefill found no room"),
        });
        // The last request to finish is the scheduler's own (4 tokens) or the routed one
        // (2 tokens, which the scheduler's aborted request left room for).
        assert_eq!(cache.total_size(), if waited { 4 } else { 2 });
        assert_settled(&cache, 2);
    });
    outcomes.expect_all("a_routed_requests_prefix_is_never_evicted");
}

/// The GPU's KV buffer, one loom-checked cell per slot: a forward pass writes a slot's
/// cell, the output thread reads it. A slot handed out while another request still
/// reads it would be an unsynchronized write, which loom reports.
struct KvBuffer(Vec<UnsafeCell<u32>>);

impl KvBuffer {
    fn new(slots: usize) -> Self {
        KvBuffer((0..slots).map(|_| UnsafeCell::new(0)).collect())
    }

    fn write(&self, slot: u32, request: u32) {
        // SAFETY: loom tracks this access: a write concurrent with another thread's
        // access to the same slot (a slot with two holders) is reported, not performed.
        self.0[slot as usize].with_mut(|p| unsafe { *p = request });
    }

    fn read(&self, slot: u32) -> u32 {
        // SAFETY: as in `write`.
        self.0[slot as usize].with(|p| unsafe { *p })
    }
}

/// The overlap loop on a 4-slot token allocator: the scheduler allocates batch 1 (3
/// slots), runs its forward pass and hands it to the output thread, then allocates batch
/// 2 (2 slots) — which fits only once the output thread has freed batch 1 — trying
/// twice. Each batch's KV cells must still hold its own request when the output thread
/// reads them.
#[test]
fn slots_freed_on_the_output_thread_are_never_handed_out_twice() {
    overlap_model(
        "slots_freed_on_the_output_thread_are_never_handed_out_twice",
        || TokenAllocator::new(4).unwrap(),
        3,
        2,
    );
}

/// The same on pages of 2 (4 pages, slots 2..=9): batch 1 takes 3 pages, batch 2 needs 2.
#[test]
fn pages_freed_on_the_output_thread_are_never_handed_out_twice() {
    overlap_model(
        "pages_freed_on_the_output_thread_are_never_handed_out_twice",
        || PagedAllocator::new(8, 2).unwrap(),
        6,
        4,
    );
}

/// The overlap loop of the two models above on the allocator `make` builds (fresh, with
/// fewer than `first + second` tokens, so that batch 2 must reuse batch 1's slots).
fn overlap_model<A, F>(name: &'static str, make: F, first: usize, second: usize)
where
    A: KvAllocator + 'static,
    F: Fn() -> A + Send + Sync + 'static,
{
    let outcomes = Outcomes::new(&["batch 2 reused batch 1's slots", "batch 2 found no room"]);
    let seen = outcomes.clone();
    kvpool::loom::run_model(name, Builder::new(), move || {
        let alloc = Arc::new(make());
        let size = KvAllocator::size(&*alloc);
        assert!(first + second > size);
        let kv = Arc::new(KvBuffer::new(size + alloc.page_size() as usize));
        let (to_output, batches) = mpsc::channel::<ToOutput>();

        let scheduler = {
            let (alloc, kv) = (Arc::clone(&alloc), Arc::clone(&kv));
            thread::spawn(move || {
                let mut batch1 = vec![0u32; first];
                alloc.alloc(&mut batch1).unwrap();
                batch1.iter().for_each(|&s| kv.write(s, 1));
                to_output.send(ToOutput::Batch(batch1.clone())).unwrap();
                let mut batch2 = vec![0u32; second];
                for attempt in 0..2 {
                    if alloc.alloc(&mut batch2).is_ok() {
                        batch2.iter().for_each(|&s| kv.write(s, 2));
                        let reused = batch2.iter().any(|s| batch1.contains(s));
                        to_output.send(ToOutput::Batch(batch2)).unwrap();
                        to_output.send(ToOutput::Stop).unwrap();
                        return Some(reused);
                    }
                    if attempt == 0 {
                        thread::yield_now();
                    }
                }
                to_output.send(ToOutput::Stop).unwrap();
                None
            })
        };
        let output = {
            let (alloc, kv) = (Arc::clone(&alloc), Arc::clone(&kv));
            thread::spawn(move || {
                let mut request = 0;
                free_batches(&*alloc, batches, |batch| {
                    request += 1;
                    for &s in batch {
                        assert_eq!(kv.read(s), request, "slot {s} of batch {request} was overwritten");
                    }
                })
            })
        };
        let batch2 = scheduler.join().unwrap();
        let freed = output.join().unwrap();
        seen.hit(match batch2 {
            Some(true) => "batch 2 reused batch 1's slots",
            Some(false) => panic!("batch 2 cannot avoid batch 1's slots in so small a pool"),
            None => "batch 2 found no room",
        });
        assert_eq!(freed, if batch2.is_some() { first + second } else { first });
        assert_eq!(alloc.available_size(), size, "every slot is back");
        alloc.check_invariants().unwrap();
    });
    outcomes.expect_all(name);
}

/// Request A (`[1, 2]`) is done: the scheduler hands it to the output thread, which
/// finishes it (caches it), while the scheduler admits request B (`[1, 2, 3]`), whose
/// prefix is A's. B finds A's prefix cached (and locks it), or finds nothing and
/// allocates (evicting A's cached slots if they are in by then), or runs out of room
/// (A still holds its slots). An admitted B decodes one token and finishes. At the end
/// every slot is free or cached, no lock or row is left, and the accounting is exact.
#[test]
fn a_request_finished_on_the_output_thread_while_its_prefix_is_admitted() {
    let outcomes = Outcomes::new(&["B hit A's prefix", "B missed, allocated", "B out of memory"]);
    let seen = outcomes.clone();
    let name = "a_request_finished_on_the_output_thread_while_its_prefix_is_admitted";
    kvpool::loom::run_model(name, Builder::new(), move || {
        let cache = tiny_cache(2);
        let mut a = Running::admit(&cache, 0, &[1, 2]).unwrap();
        a.prefill().unwrap();
        let (to_output, finished) = mpsc::channel::<Running<TokenAllocator>>();

        let output = thread::spawn(move || {
            let a = finished.recv().unwrap();
            assert_eq!(a.finish().unwrap(), 0, "A's prefix was not cached before");
        });
        to_output.send(a).unwrap();
        let mut b = Running::admit(&cache, 0, &[1, 2, 3]).unwrap();
        let hit = b.cached_len();
        assert!(hit == 0 || hit == 2, "{hit}");
        // Forming the batch: the output thread may run meanwhile.
        thread::yield_now();
        let outcome = match b.prefill() {
            Err(e) => {
                assert!(e.out_of_memory().is_some(), "{e}");
                b.abort();
                "B out of memory"
            }
            Ok(()) => {
                if hit == 2 {
                    // B's prefix slots are the tree's, locked by B: findable until B ends.
                    let mut out = [0u32; 3];
                    assert_eq!(cache.peek_prefix(0, &[1, 2, 3], &mut out), 2);
                    assert_eq!(out[..2], b.slots()[..2]);
                }
                // The fourth slot is free, whatever the output thread has done by now.
                let mut slot = [0u32];
                decode(&cache, std::slice::from_mut(&mut b), &[4], &mut slot).unwrap();
                assert_eq!((b.tokens(), b.slots()[3]), (&[1, 2, 3, 4][..], slot[0]));
                // A may still be finishing: B's finish waits for nothing.
                let before = b.finish().unwrap();
                if hit == 2 {
                    assert_eq!(before, 2);
                    "B hit A's prefix"
                } else {
                    // B's prefill took 3 of the 4 slots: A's were cached, and evicted.
                    assert!(before < 2, "{before} tokens of a missed prefix were cached");
                    "B missed, allocated"
                }
            }
        };
        output.join().unwrap();
        seen.hit(outcome);
        assert_settled(&cache, 2);
    });
    outcomes.expect_all(name);
}
