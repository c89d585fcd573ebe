#![cfg(all(loom, shuttle))]
//! Shuttle test of an overlap scheduler on a paged prefix cache: the threads of an
//! inference engine, with randomized schedules.
//!
//! * the **scheduler** admits requests: takes a row, `match_and_lock`s the prompt,
//!   writes the hit into the row, `alloc_extend`s the rest (evicting when short) — for
//!   every third request in two chunks with `cache_unfinished_req` between (chunked
//!   prefill) — then runs a few decode steps (`alloc_decode`) and hands the request over;
//! * the **output** thread finishes requests as they come (`cache_finished_req`: insert,
//!   free duplicates and the tail, unlock, free the row) while the scheduler allocates
//!   for the next ones;
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

use shuttle::sync::atomic::{AtomicBool, Ordering};
use shuttle::sync::Mutex;
use shuttle::thread;

use kvpool::radix::{Lease, RadixCache, RadixConfig};
use kvpool::{AllocError, PagedAllocator, ReqRow, ReqToTokenPool};
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
struct Running<'c> {
    id: u32,
    row: ReqRow,
    lease: Lease<'c, PagedAllocator>,
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
struct Engine<'a, 'c> {
    c: &'c Cache,
    shadow: &'a Shadow,
    prefixes: &'a [Vec<u32>],
    queue: &'a Mutex<VecDeque<Running<'c>>>,
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

fn scheduler(e: &Engine<'_, '_>) {
    let Engine { c, shadow, prefixes, queue, seen, .. } = e;
    for id in 1..=REQUESTS {
        let prompt = prompt(prefixes);
        let p = prompt.len();
        let mut row = loop {
            match c.req_pool().alloc() {
                Ok(row) => break row,
                Err(_) => {
                    seen.hit("row_waits");
                    thread::yield_now();
                }
            }
        };
        let mut hit = vec![0u32; p];
        let mut lease = c.match_and_lock(0, &prompt, &mut hit);
        let h = lease.len();
        hit.truncate(h);
        shadow.check_match("match_and_lock", &prompt, &hit, PS as usize);
        shadow.lock(&hit);
        if h > 0 {
            seen.hit("hits");
        }
        c.req_pool().write(&mut row, 0, &hit).unwrap();

        // Every third request with enough new tokens is prefilled in two chunks.
        let chunk_end = if id % 3 == 0 && p - h > 5 { h + (p - h) / 2 } else { p };
        let mut fresh = vec![0u32; chunk_end - h];
        if c.allocator().available_size() < fresh.len() {
            seen.hit("evicting_admissions");
        }
        let last = hit.last().copied().unwrap_or(0);
        retry("alloc_extend", seen, || c.alloc_extend(&[h as u32], &[chunk_end as u32], &[last], &mut fresh));
        shadow.claim(id, &fresh, &prompt[h..chunk_end]);
        c.req_pool().write(&mut row, h, &fresh).unwrap();
        if chunk_end < p {
            // Chunked prefill: the first chunk's whole pages go to the cache, the row is
            // rewritten with the tree's slots, the lease moves down; the unaligned tail
            // stays with the request and the second chunk continues its page.
            let aligned = chunk_end / PS as usize * PS as usize;
            shadow.unclaim(id, &fresh[..aligned - h]);
            shadow.unlock(&hit);
            c.cache_unfinished_req(0, &prompt[..chunk_end], &mut row, &mut lease, 0).unwrap();
            assert_eq!(lease.len(), aligned);
            hit = c.req_pool().read(&row, 0..aligned).unwrap().to_vec();
            shadow.check_match("cache_unfinished_req", &prompt[..aligned], &hit, PS as usize);
            shadow.lock(&hit);
            fresh.drain(..aligned - h);
            let last = c.req_pool().read(&row, chunk_end - 1..chunk_end).unwrap()[0];
            let mut rest = vec![0u32; p - chunk_end];
            retry("alloc_extend", seen, || c.alloc_extend(&[chunk_end as u32], &[p as u32], &[last], &mut rest));
            shadow.claim(id, &rest, &prompt[chunk_end..]);
            c.req_pool().write(&mut row, chunk_end, &rest).unwrap();
            fresh.extend(rest);
            seen.hit("chunked");
        }

        let mut tokens = prompt;
        let mut last = fresh.last().or(hit.last()).copied().unwrap();
        for _ in 0..random_in(1..5) {
            let mut slot = [0u32; 1];
            let seq = tokens.len() as u32 + 1;
            retry("alloc_decode", seen, || c.alloc_decode(&[seq], &[last], &mut slot));
            let token = random_key(1, ALPHABET)[0];
            shadow.claim(id, &slot, &[token]);
            c.req_pool().write(&mut row, tokens.len(), &slot).unwrap();
            tokens.push(token);
            fresh.push(slot[0]);
            last = slot[0];
        }
        queue.lock().unwrap().push_back(Running { id, row, lease, tokens, hit, fresh });
    }
    e.admitted_all.store(true, Ordering::SeqCst);
}

fn output(e: &Engine<'_, '_>) {
    let Engine { c, shadow, queue, seen, .. } = e;
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
        let found = c.cache_finished_req(0, &req.tokens, req.row, req.lease, 0).unwrap();
        assert!(found >= hit_len, "the insert found {found} cached tokens, less than the {hit_len} locked");
        done += 1;
        seen.hit("requests");
        if !e.admitted_all.load(Ordering::SeqCst) {
            seen.hit("finished_while_admitting");
        }
    }
}

fn router(e: &Engine<'_, '_>) {
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
    let c = RadixCache::new(
        PagedAllocator::new(SIZE, PS).unwrap(),
        ReqToTokenPool::new(ROWS, 32).unwrap(),
        RadixConfig::default(),
    )
    .unwrap();
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
