//! An overlap scheduler on kvpool's public API, in one file: the answer to "how do I use
//! this". Run it with
//!
//! ```sh
//! cargo run --release --example overlap_scheduler
//! ```
//!
//! Three kinds of threads share one `RadixCache` (a prefix cache over a paged KV
//! allocator and a pool of request rows), all through `&self`. Every request is a
//! `kvpool::radix::Request`, which holds its row, its lock on the cached prefix and the
//! KV slots it allocated, and gives them back when it finishes or is dropped:
//!
//! * the **scheduler** (the main thread) admits requests (`cache.admit`: take a row,
//!   match and lock the cached prefix; then `extend` allocates the rest of the prompt,
//!   evicting if short) and allocates one decode slot per running request per step, for
//!   the whole batch in one `cache.decode` call;
//! * the **output thread** receives finished requests through a channel (a `Request` is
//!   `Send` and `'static`) and finishes them (`Request::finish`: whole pages enter the
//!   tree, the rest is freed, the lock and the row go back) *while* the scheduler goes
//!   on with the next step — the "overlap";
//! * **router threads** look up how much of an upcoming prompt is cached
//!   (`peek_prefix`: lock-free, never waits for the others).
//!
//! The workload is generated and deterministic: conversations that share a system
//! prompt and grow turn by turn, so later turns hit the cache. At the end the example
//! checks that every KV slot is free or cached, nothing is locked, every row is free and
//! the cache's invariants hold (`check_invariants`, which also checks that free, cached
//! and held-by-live-requests slots add up to the capacity), and exits non-zero
//! otherwise. (The thread interleaving is not deterministic, so hit counts vary a little
//! from run to run.)

use std::collections::VecDeque;
use std::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;

use kvpool::radix::{CacheError, RadixCache, RadixConfig, Request};
use kvpool::{AllocError, PagedAllocator, ReqToTokenPool};

const PAGE_SIZE: u32 = 16;
/// KV capacity in tokens: small enough that the cache has to evict.
const CAPACITY: usize = 24 * 1024;
const MAX_RUNNING: usize = 24;
const MAX_CONTEXT: usize = 4096;
const REQUESTS: usize = 3000;
const CONVERSATIONS: usize = 40;
const ROUTERS: usize = 2;

type Cache = RadixCache<PagedAllocator>;

/// One request of the workload.
struct Job {
    prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    output_len: usize,
}

/// A deterministic workload: each request continues one of `CONVERSATIONS` chats (its
/// prompt is the chat so far plus a new user turn), so it shares the chat's prefix.
fn workload() -> Vec<Job> {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move |n: u64| {
        // xorshift64*: good enough for a workload, and no dependency.
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        (seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n
    };
    let mut chats: Vec<Vec<u32>> =
        (0..CONVERSATIONS).map(|c| (0..64).map(|t| (c * 1000 + t) as u32).collect()).collect();
    (0..REQUESTS)
        .map(|_| {
            let chat = &mut chats[rand(CONVERSATIONS as u64) as usize];
            if chat.len() > MAX_CONTEXT / 2 {
                chat.truncate(64); // the chat starts over (same system prompt)
            }
            let turn = 8 + rand(120) as usize;
            chat.extend((0..turn).map(|_| 100_000 + rand(30_000) as u32));
            let output_len = 1 + rand(48) as usize;
            let prompt = chat.clone();
            // The answer becomes part of the chat (the next turn's prefix).
            chat.extend((0..output_len).map(|k| output_token(&prompt, k)));
            Job { prompt, output_len }
        })
        .collect()
}

/// The model's "output": a token that depends on the prompt and the position.
fn output_token(prompt: &[u32], k: usize) -> u32 {
    200_000 + (prompt.len() as u32 * 31 + k as u32 * 7) % 50_000
}

/// A request on the GPU: its handle, and the tokens whose KV its row holds (the prompt,
/// then each generated token once a decode step has computed its KV).
struct Running {
    request: Request<PagedAllocator>,
    tokens: Vec<u32>,
    prompt_len: usize,
    output_len: usize,
    /// Generated so far; the last one has no KV yet.
    generated: usize,
}

/// A batch of `Running` requests is a batch for `cache.decode`.
impl AsMut<Request<PagedAllocator>> for Running {
    fn as_mut(&mut self) -> &mut Request<PagedAllocator> {
        &mut self.request
    }
}

/// What the output thread receives: a finished request and the tokens whose KV its row
/// holds (the prompt and the outputs, minus the last one generated).
struct Finished {
    request: Request<PagedAllocator>,
    tokens: Vec<u32>,
}

impl Running {
    fn done(&self) -> bool {
        self.generated == self.output_len
    }

    fn into_finished(self) -> Finished {
        debug_assert_eq!(self.tokens.len(), self.request.len());
        Finished { request: self.request, tokens: self.tokens }
    }
}

/// Tokens that `n` more tokens may need, in whole pages (worst case).
fn pages_for(n: usize) -> usize {
    n.div_ceil(PAGE_SIZE as usize) * PAGE_SIZE as usize + PAGE_SIZE as usize
}

/// Try to admit `job`. `reserved` is what the running requests may still need for decode.
/// `Ok(None)`: no room now (nothing held); the output thread will make some. `Err`: it
/// can never fit.
fn admit(cache: &Arc<Cache>, job: &Job, reserved: usize) -> Result<Option<Running>, Box<dyn Error>> {
    // 1. A row, and the cached prefix matched and locked in one step (no eviction can
    //    come between). No free row: every row is with a running or finishing request.
    let mut request = match cache.admit(0, &job.prompt) {
        Ok(request) => request,
        Err(AllocError::OutOfMemory(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let hit = request.cached_len();
    // 2. Admission control: the prefill and this request's decode tokens must fit in the
    //    free plus evictable slots, after what the running requests may still need. The
    //    output thread only ever adds to that, so the check stays true; decode never
    //    runs out (a real scheduler would retract requests instead).
    let need = pages_for(job.prompt.len() - hit) + pages_for(job.output_len);
    if need > cache.allocator().size() {
        return Err(format!("a request of {} tokens can never fit in the pool", job.prompt.len()).into());
    }
    if cache.allocator().available_size() + cache.evictable_size() < need + reserved {
        return Ok(None); // `request` drops: aborted (the lock and the row go back)
    }
    // 3. The prefill slots (evicting unlocked prefixes if short), into the request's row.
    request.extend(job.prompt.len() - request.len())?;
    // ... the prefill forward pass writes K/V at `request.slots()[hit..]` and produces
    // the first token ...
    Ok(Some(Running {
        request,
        tokens: job.prompt.clone(),
        prompt_len: job.prompt.len(),
        output_len: job.output_len,
        generated: 1,
    }))
}

fn main() -> Result<(), Box<dyn Error>> {
    let jobs = Arc::new(workload());
    let rows = MAX_RUNNING as u32;
    let cache = Arc::new(RadixCache::new(
        PagedAllocator::new(CAPACITY, PAGE_SIZE)?,
        ReqToTokenPool::new(rows, MAX_CONTEXT)?,
        RadixConfig::default(),
    )?);
    println!(
        "overlap_scheduler: {REQUESTS} requests in {CONVERSATIONS} conversations, {CAPACITY} KV tokens in pages of \
         {PAGE_SIZE}, {MAX_RUNNING} running at most, {ROUTERS} router threads"
    );

    // The output thread: finish each request while the scheduler goes on. A refused
    // finish hands the request back with the reason (`Refused`); `?` keeps the reason
    // and drops the request, which aborts it.
    let (to_output, inbox) = mpsc::channel::<Finished>();
    let output = thread::spawn(move || -> Result<(usize, usize), CacheError> {
        let (mut finished, mut already_cached) = (0, 0);
        // Until the scheduler hangs up.
        while let Ok(Finished { request, tokens }) = inbox.recv() {
            already_cached += request.finish(&tokens)?;
            finished += 1;
        }
        Ok((finished, already_cached))
    });

    // Router threads: how much of each prompt is cached right now (lock-free lookups).
    let done = Arc::new(AtomicBool::new(false));
    let routers: Vec<_> = (0..ROUTERS)
        .map(|r| {
            let (cache, jobs, done) = (Arc::clone(&cache), Arc::clone(&jobs), Arc::clone(&done));
            thread::spawn(move || {
                let (mut lookups, mut hit_tokens) = (0usize, 0usize);
                let mut out = vec![0u32; MAX_CONTEXT];
                for job in jobs.iter().skip(r).step_by(ROUTERS).cycle() {
                    if done.load(Ordering::Relaxed) {
                        break;
                    }
                    hit_tokens += cache.peek_prefix(0, &job.prompt, &mut out[..job.prompt.len()]);
                    lookups += 1;
                }
                (lookups, hit_tokens)
            })
        })
        .collect();

    // The scheduler: admit, decode one token for everyone, hand finished requests over.
    // Every request in `running` still has tokens to generate.
    let mut waiting: VecDeque<&Job> = jobs.iter().collect();
    let mut running: Vec<Running> = Vec::new();
    let mut slots = Vec::with_capacity(MAX_RUNNING);
    let (mut steps, mut prompt_tokens, mut hit_tokens, mut decode_tokens) = (0usize, 0usize, 0usize, 0usize);
    while !waiting.is_empty() || !running.is_empty() {
        let mut reserved: usize = running.iter().map(|r| pages_for(r.output_len - r.generated)).sum();
        while running.len() < MAX_RUNNING {
            let Some(job) = waiting.front() else { break };
            let Some(r) = admit(&cache, job, reserved)? else { break }; // no room until some finish
            waiting.pop_front();
            prompt_tokens += r.prompt_len;
            hit_tokens += r.request.cached_len();
            if r.done() {
                to_output.send(r.into_finished())?; // one output token: the prefill made it
            } else {
                reserved += pages_for(r.output_len - r.generated);
                running.push(r);
            }
        }
        if running.is_empty() {
            // Everything is with the output thread; let it free some room.
            thread::yield_now();
            continue;
        }
        steps += 1;

        // Decode: one new slot per request, for its newest token, in one call for the
        // batch (each request continues its own last page).
        slots.resize(running.len(), 0);
        cache.decode(&mut running, &mut slots)?;
        // ... the decode forward pass writes K/V at `slots` and samples the next tokens ...
        for r in &mut running {
            // The token whose KV was just computed: the one generated last step.
            r.tokens.push(output_token(&r.tokens[..r.prompt_len], r.generated - 1));
            r.generated += 1;
        }
        decode_tokens += running.len();

        // Finished requests go to the output thread; the next step starts at once.
        let mut i = 0;
        while i < running.len() {
            if running[i].done() {
                to_output.send(running.swap_remove(i).into_finished())?;
            } else {
                i += 1;
            }
        }
    }
    drop(to_output);
    let (finished, already_cached) = output.join().expect("the output thread panicked")?;
    done.store(true, Ordering::Relaxed);
    let (mut lookups, mut routed_hits) = (0, 0);
    for router in routers {
        let (l, h) = router.join().expect("a router panicked");
        lookups += l;
        routed_hits += h;
    }

    println!("  requests finished      {finished} in {steps} scheduler steps");
    println!("  prompt tokens          {prompt_tokens}");
    println!("  prefix hits            {hit_tokens} tokens ({:.1}%)", 100.0 * hit_tokens as f64 / prompt_tokens as f64);
    println!("  decode slots           {decode_tokens}");
    println!("  found cached on finish {already_cached} tokens");
    println!("  router lookups         {lookups} ({routed_hits} tokens found cached)");
    println!("  cached at the end      {} tokens in {} nodes", cache.total_size(), cache.node_count());

    // Every slot is free or cached, nothing is locked, every row is free.
    let alloc = cache.allocator();
    let mut problems = Vec::new();
    if finished != REQUESTS {
        problems.push(format!("{finished} of {REQUESTS} requests finished"));
    }
    if alloc.available_size() + cache.total_size() != alloc.size() {
        problems.push(format!(
            "slots leaked: {} free + {} cached != {}",
            alloc.available_size(),
            cache.total_size(),
            alloc.size()
        ));
    }
    if cache.protected_size() != 0 {
        problems.push(format!("{} tokens still locked", cache.protected_size()));
    }
    if cache.req_pool().available_size() != rows as usize {
        problems.push(format!("{} of {rows} rows free", cache.req_pool().available_size()));
    }
    // The structure, and the accounting: free + cached + held by live requests (none
    // now) = capacity.
    if let Err(e) = cache.check_invariants() {
        problems.push(e.to_string());
    }
    if !problems.is_empty() {
        return Err(format!("overlap_scheduler: {}", problems.join("; ")).into());
    }
    println!("  checks: every KV slot is free or cached, nothing locked, every row free, invariants hold");
    Ok(())
}
