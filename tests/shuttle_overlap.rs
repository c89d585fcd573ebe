#![cfg(all(loom, shuttle))]
//! Shuttle test of an overlap scheduler on a paged prefix cache: the threads of an
//! inference engine, with randomized schedules.
//!
//! * the **scheduler** admits requests (`admit`: a row, the prompt's cached prefix
//!   matched into it and locked), `extend`s the rest (evicting when short) — for every
//!   third request in two chunks with a `checkpoint` between (chunked prefill) — then
//!   runs a few decode steps (`decode`) and hands the request over;
//! * the **output** thread finishes requests as they come (`finish`: insert, free
//!   duplicates and the tail, unlock, free the row) while the scheduler allocates for
//!   the next ones;
//! * two **routers** `peek_prefix` prompts all along.
//!
//! Checked (`Shadow`): no slot is handed out while a request holds it or a lease
//! protects it; every hit and every lookup returns whole pages whose slots hold the
//! tokens they matched, none held fresh by a request. At the end: the tree's
//! invariants hold, nothing is locked, every row is back, every slot is cached or free.
//!
//! Run with `scripts/shuttle.sh shuttle_overlap`.

mod shuttle_common;

use std::collections::VecDeque;
use std::sync::Arc;

use shuttle::sync::atomic::{AtomicBool, Ordering};
use shuttle::sync::Mutex;
use shuttle::thread;

use kvpool::radix::{RadixCache, RadixConfig, Request};
use kvpool::{AllocError, PagedAllocator, ReqToTokenPool};
use shuttle_common::{random_in, random_key, schedules, Outcomes, Shadow};

const PS: u32 = 4;
/// 24 pages: less than the requests in flight can hold at once (6 rows of up to 7
/// pages), so admission evicts the tree and at times waits for the output thread.
const SIZE: usize = 96;
/// Request rows: at most this many requests in flight (the scheduler waits for one).
const ROWS: u32 = 6;
const REQUESTS: u32 = 14;
/// Tokens `1..=ALPHABET`.
const ALPHABET: u32 = 4;

type Cache = RadixCache<PagedAllocator>;

/// A request between scheduler and output thread.
struct Running {
    id: u32,
    req: Request<PagedAllocator>,
    /// Tokens with KV (prompt and decoded), in row order.
    tokens: Vec<u32>,
    /// The slots the hit gave it (locked in the tree).
    hit: Vec<u32>,
    /// The slots it allocated.
    fresh: Vec<u32>,
}

/// Retry an allocation until the output thread has freed enough.
fn retry(what: &str, seen: &Outcomes, mut f: impl FnMut() -> Result<(), AllocError>) {
    for _ in 0..100_000 {
        match f() {
            Ok(()) => return,
            Err(AllocError::OutOfMemory(_)) => {
                seen.hit("oom_waits");
                thread::yield_now();
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    panic!("{what}: still out of memory after 100000 tries");
}

fn prompt(prefixes: &[Vec<u32>]) -> Vec<u32> {
    let mut p = prefixes[random_in(0..prefixes.len())].clone();
    p.extend(random_key(random_in(1..7), ALPHABET));
    p
}

/// Shared by the threads of one schedule.
struct Engine<'a> {
    c: &'a Arc<Cache>,
    shadow: &'a Shadow,
    prefixes: &'a [Vec<u32>],
    queue: &'a Mutex<VecDeque<Running>>,
    /// Set when the scheduler has handed over its last request.
    admitted_all: &'a AtomicBool,
    seen: &'a Outcomes,
}

const LABELS: &[&str] = &[
    "requests",
    "hits",
    "chunked",
    "row_waits",
    "evicting_admissions",
    "oom_waits",
    "finished_while_admitting",
    "router_peeks",
    "router_hits",
];

fn scheduler(e: &Engine<'_>) {
    let Engine { c, shadow, prefixes, queue, seen, .. } = e;
    for id in 1..=REQUESTS {
        let prompt = prompt(prefixes);
        let p = prompt.len();
        let mut req = loop {
            match c.admit(0, &prompt) {
                Ok(req) => break req,
                Err(AllocError::OutOfMemory(_)) => {
                    seen.hit("row_waits");
                    thread::yield_now();
                }
                Err(e) => panic!("admit: {e}"),
            }
        };
        let h = req.cached_len();
        let mut hit = req.slots().to_vec();
        shadow.check_match("admit", &prompt, &hit, PS as usize);
        shadow.lock(&hit);
        if h > 0 {
            seen.hit("hits");
        }

        // Every third request with enough new tokens is prefilled in two chunks.
        let chunk_end = if id % 3 == 0 && p - h > 5 { h + (p - h) / 2 } else { p };
        if c.allocator().available_size() < chunk_end - h {
            seen.hit("evicting_admissions");
        }
        retry("extend", seen, || req.extend(chunk_end - h));
        let mut fresh = req.slots()[h..].to_vec();
        shadow.claim(id, &fresh, &prompt[h..chunk_end]);
        if chunk_end < p {
            // Chunked prefill: the first chunk's whole pages go to the cache, the row is
            // rewritten with the tree's slots, the lock moves down; the unaligned tail
            // stays with the request and the second chunk continues its page.
            let aligned = chunk_end / PS as usize * PS as usize;
            shadow.unclaim(id, &fresh[..aligned - h]);
            shadow.unlock(&hit);
            req.checkpoint(&prompt[..chunk_end]).unwrap();
            assert_eq!(req.cached_len(), aligned);
            hit = req.slots()[..aligned].to_vec();
            shadow.check_match("checkpoint", &prompt[..aligned], &hit, PS as usize);
            shadow.lock(&hit);
            fresh.drain(..aligned - h);
            retry("extend", seen, || req.extend(p - chunk_end));
            let rest = req.slots()[chunk_end..].to_vec();
            shadow.claim(id, &rest, &prompt[chunk_end..]);
            fresh.extend(rest);
            seen.hit("chunked");
        }

        let mut tokens = prompt;
        for _ in 0..random_in(1..5) {
            let mut slot = [0u32; 1];
            retry("decode", seen, || c.decode(&mut [&mut req], &mut slot));
            let token = random_key(1, ALPHABET)[0];
            shadow.claim(id, &slot, &[token]);
            tokens.push(token);
            fresh.push(slot[0]);
        }
        assert_eq!(req.slots()[tokens.len() - fresh.len()..], fresh[..], "the row holds what was handed out");
        queue.lock().unwrap().push_back(Running { id, req, tokens, hit, fresh });
    }
    e.admitted_all.store(true, Ordering::SeqCst);
}

fn output(e: &Engine<'_>) {
    let Engine { shadow, queue, seen, .. } = e;
    let mut done = 0;
    while done < REQUESTS {
        let Some(req) = queue.lock().unwrap().pop_front() else {
            thread::yield_now();
            continue;
        };
        // The slots pass to the cache (or are freed) inside `cache_finished_req`: from
        // here on neither the request nor its lease holds them.
        shadow.unclaim(req.id, &req.fresh);
        shadow.unlock(&req.hit);
        let hit_len = req.hit.len();
        let found = req.req.finish(&req.tokens).unwrap();
        assert!(found >= hit_len, "the insert found {found} cached tokens, less than the {hit_len} locked");
        done += 1;
        seen.hit("requests");
        if !e.admitted_all.load(Ordering::SeqCst) {
            seen.hit("finished_while_admitting");
        }
    }
}

fn router(e: &Engine<'_>) {
    let Engine { c, shadow, prefixes, seen, .. } = e;
    for _ in 0..20 {
        seen.hit("router_peeks");
        let query = prompt(prefixes);
        let mut out = vec![0u32; query.len()];
        let n = c.peek_prefix(0, &query, &mut out);
        shadow.check_match("router peek", &query, &out[..n], PS as usize);
        if n > 0 {
            seen.hit("router_hits");
        }
    }
}

fn scenario(seen: &Outcomes) {
    let c = Arc::new(
        RadixCache::new(
            PagedAllocator::new(SIZE, PS).unwrap(),
            ReqToTokenPool::new(ROWS, 32).unwrap(),
            RadixConfig::default(),
        )
        .unwrap(),
    );
    let shadow = Shadow::new(SIZE + PS as usize);
    // Three "system prompts" of 2, 3 and 4 pages that requests share.
    let prefixes: Vec<Vec<u32>> = (0..3).map(|i| random_key(8 + 4 * i, ALPHABET)).collect();
    let queue = Mutex::new(VecDeque::new());
    let admitted_all = AtomicBool::new(false);
    let engine =
        Engine { c: &c, shadow: &shadow, prefixes: &prefixes, queue: &queue, admitted_all: &admitted_all, seen };
    thread::scope(|s| {
        s.spawn(|| scheduler(&engine));
        s.spawn(|| output(&engine));
        for _ in 0..2 {
            s.spawn(|| router(&engine));
        }
    });
    c.check_invariants().unwrap();
    assert_eq!(c.protected_size(), 0);
    assert_eq!(c.req_pool().available_size(), ROWS as usize);
    assert_eq!(c.total_size() + c.allocator().available_size(), SIZE, "a slot was lost or doubly owned");
    shadow.assert_nothing_held();
}

/// The overlap scheduler's threads: no slot handed out twice while held, every match
/// consistent, everything returned at the end.
#[test]
fn overlap_scheduler() {
    let seen = Outcomes::new(LABELS);
    let s = seen.clone();
    shuttle_common::check("overlap_scheduler", schedules(10_000), move || scenario(&s));
    seen.expect_seen(
        "overlap_scheduler",
        &[
            "hits",
            "chunked",
            "row_waits",
            "evicting_admissions",
            "oom_waits",
            "finished_while_admitting",
            "router_hits",
        ],
    );
}
