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
//! | `a_pinned_prefix_is_never_freed` | a router's pin (a lease) keeps its slots allocated and out of every other request's hands, however the scheduler's evicting allocation interleaves; once released they can be reused |
//! | `slots_freed_on_the_output_thread_are_never_handed_out_twice` | the overlap loop: the scheduler allocates batch 2 while the output thread frees batch 1; a slot is never held by both, and batch 2's KV writes happen after batch 1's reads (loom checks the cells) |
//! | `pages_freed_on_the_output_thread_are_never_handed_out_twice` | the same on a paged allocator (pages of 2) |
//! | `a_request_finished_on_the_output_thread_while_its_prefix_is_admitted` | the lease travels detached to the output thread, which caches the request while the scheduler admits one with the same prefix; at the end every slot is free or cached, every lock and row released |
#![cfg(loom)]

use kvpool::loom::cell::UnsafeCell;
use kvpool::loom::model::Builder;
use kvpool::loom::sync::atomic::{AtomicBool, Ordering};
use kvpool::radix::{RadixCache, RadixConfig};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool, TokenAllocator};
use loom_scheduler::sync::{mpsc, thread, Arc};
use loom_scheduler::{admit, finish, free_batches, AdmitError, Pin, ToOutput};

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

/// A cache of 4 token slots (page size 1) and `rows` request rows of 4 tokens.
fn tiny_cache(rows: u32) -> RadixCache<TokenAllocator> {
    RadixCache::new(TokenAllocator::new(4).unwrap(), ReqToTokenPool::new(rows, 4).unwrap(), RadixConfig::default())
        .unwrap()
}

/// Every slot is free or cached, nothing is locked, every row is free, invariants hold.
fn assert_settled(cache: &RadixCache<TokenAllocator>, rows: usize) {
    cache.check_invariants().unwrap();
    let alloc = cache.allocator();
    assert_eq!(alloc.available_size() + cache.total_size(), alloc.size(), "a slot leaked");
    assert_eq!(cache.protected_size(), 0, "a lock was never released");
    assert_eq!(cache.req_pool().available_size(), rows, "a row was never freed");
}

/// A router pins the cached prefix `[1, 2]` (two of the four slots) while the scheduler
/// admits a 4-token request, which fits only by evicting that prefix. Whatever the
/// order, no slot the scheduler gets is under a live pin, and a pinned slot stays
/// allocated and findable until the pin is released.
#[test]
fn a_pinned_prefix_is_never_freed() {
    let outcomes =
        Outcomes::new(&["pinned: admission out of memory", "evicted first: pin missed", "unpinned, then evicted"]);
    let seen = outcomes.clone();
    kvpool::loom::run_model("a_pinned_prefix_is_never_freed", Builder::new(), move || {
        let cache = Arc::new(tiny_cache(1));
        let mut cached = [0u32; 2];
        cache.allocator().alloc(&mut cached).unwrap();
        assert_eq!(cache.insert(0, &[1, 2], &cached, 0).unwrap(), 0);
        // pinned[s]: a live pin covers slot s (set after pinning, cleared before release).
        let pinned: Arc<Vec<AtomicBool>> = Arc::new((0..5).map(|_| AtomicBool::new(false)).collect());

        // The writer first, the reader second (see tokio-rs/loom#392 in kvpool::loom).
        let scheduler = {
            let (cache, pinned) = (Arc::clone(&cache), Arc::clone(&pinned));
            thread::spawn(move || match admit(&cache, 0, &[7, 8, 9, 10], None) {
                Ok(running) => {
                    for &s in &running.slots {
                        assert!(!pinned[s as usize].load(Ordering::SeqCst), "slot {s} handed out under a live pin");
                    }
                    // Aborted at once: the slots and the row go back.
                    cache.allocator().free(&running.slots).unwrap();
                    cache.req_pool().free(running.row).unwrap();
                    true
                }
                // Only while the pin lives (its eviction found the prefix locked; the
                // pin may be released by the time the allocation fails).
                Err(AdmitError::Alloc(e)) => {
                    assert!(e.out_of_memory().is_some(), "{e}");
                    false
                }
                Err(e) => panic!("{e:?}"),
            })
        };
        let router = {
            let (cache, pinned) = (Arc::clone(&cache), Arc::clone(&pinned));
            thread::spawn(move || {
                let pin = Pin::take(&cache, 0, &[1, 2]);
                let hit = !pin.slots().is_empty();
                if hit {
                    assert_eq!(pin.slots(), cached);
                    for &s in pin.slots() {
                        pinned[s as usize].store(true, Ordering::SeqCst);
                    }
                    // Route the request (here: look again); the scheduler may run meanwhile.
                    thread::yield_now();
                    let mut out = [0u32; 2];
                    assert_eq!(cache.peek_prefix(0, &[1, 2], &mut out), 2, "a pinned prefix disappeared");
                    assert_eq!(out, cached);
                    for &s in pin.slots() {
                        assert!(cache.allocator().is_allocated(s), "pinned slot {s} was freed");
                        pinned[s as usize].store(false, Ordering::SeqCst);
                    }
                }
                pin.release(&cache).unwrap();
                hit
            })
        };
        let admitted = scheduler.join().unwrap();
        let hit = router.join().unwrap();
        seen.hit(match (hit, admitted) {
            (true, false) => "pinned: admission out of memory",
            (false, true) => "evicted first: pin missed",
            (true, true) => "unpinned, then evicted",
            (false, false) => panic!("the pin missed, yet the admission found no room"),
        });
        assert_settled(&cache, 1);
    });
    outcomes.expect_all("a_pinned_prefix_is_never_freed");
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

/// Request A (`[1, 2]`) finished: the scheduler hands it (row and detached lease) to the
/// output thread, which caches it, while the scheduler admits request B (`[1, 2, 3]`),
/// whose prefix is A's. B finds A's prefix cached (and locks it), or finds nothing and
/// allocates (evicting A's cached slots if they are in by then) or runs out of room. At
/// the end every slot is free or cached, and no lock or row is left.
#[test]
fn a_request_finished_on_the_output_thread_while_its_prefix_is_admitted() {
    let outcomes = Outcomes::new(&["B hit A's prefix", "B missed, allocated", "B out of memory"]);
    let seen = outcomes.clone();
    let name = "a_request_finished_on_the_output_thread_while_its_prefix_is_admitted";
    kvpool::loom::run_model(name, Builder::new(), move || {
        let cache = Arc::new(tiny_cache(2));
        let a = admit(&cache, 0, &[1, 2], None).unwrap();
        let a = a.into_finished();
        let (to_output, finished) = mpsc::channel();

        let output = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                let done = finished.recv().unwrap();
                assert_eq!(finish(&cache, 0, done).unwrap(), 0, "A's prefix was not cached before");
            })
        };
        to_output.send(a).unwrap();
        let outcome = match admit(&cache, 0, &[1, 2, 3], None) {
            Ok(b) => {
                let hit = b.lease.len();
                let outcome = if hit == 2 { "B hit A's prefix" } else { "B missed, allocated" };
                assert!(hit == 0 || hit == 2, "{hit}");
                let mut out = [0u32; 3];
                if hit == 2 {
                    // B's prefix slots are the tree's, locked by B: findable until B ends.
                    assert_eq!(cache.peek_prefix(0, &[1, 2, 3], &mut out), 2);
                    assert_eq!(out[..2], b.slots[..2]);
                }
                finish(&cache, 0, b.into_finished()).unwrap();
                outcome
            }
            Err(AdmitError::Alloc(_)) => "B out of memory",
            Err(e) => panic!("{e:?}"),
        };
        output.join().unwrap();
        seen.hit(outcome);
        assert_settled(&cache, 2);
    });
    outcomes.expect_all(name);
}
