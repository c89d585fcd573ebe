//! An overlap scheduler on kvpool's public API, in one file: the answer to "how do I use
//! this". Run it with
//!
//! ```sh
//! cargo run --release --example overlap_scheduler
//! ```
//!
//! Three kinds of threads share one `RadixCache` (a prefix cache over a paged KV
//! allocator and a pool of request rows), all through `&self`:
//!
//! * the **scheduler** (the main thread) admits requests — match and lock the cached
//!   prefix, take a row, allocate prefill slots for the rest — and allocates one decode
//!   slot per running request per step;
//! * the **output thread** receives finished requests and caches them
//!   (`cache_finished_req`: whole pages enter the tree, the rest is freed, the lock and
//!   the row are released) *while* the scheduler goes on with the next step — the
//!   "overlap";
//! * **router threads** look up how much of an upcoming prompt is cached
//!   (`peek_prefix`: lock-free, never waits for the others).
//!
//! The workload is generated and deterministic: conversations that share a system
//! prompt and grow turn by turn, so later turns hit the cache. At the end the example
//! checks that every KV slot is free or cached, nothing is locked, every row is free and
//! the cache's invariants hold, and exits non-zero otherwise. (The thread interleaving
//! is not deterministic, so hit counts vary a little from run to run.)

use std::collections::VecDeque;
use std::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;

use kvpool::radix::{Lease, RadixCache, RadixConfig, RawLease};
use kvpool::{PagedAllocator, ReqRow, ReqToTokenPool};

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
struct Request {
    prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    output_len: usize,
}

/// A deterministic workload: each request continues one of `CONVERSATIONS` chats (its
/// prompt is the chat so far plus a new user turn), so it shares the chat's prefix.
fn workload() -> Vec<Request> {
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
            Request { prompt, output_len }
        })
        .collect()
}

/// The model's "output": a token that depends on the prompt and the position.
fn output_token(prompt: &[u32], k: usize) -> u32 {
    200_000 + (prompt.len() as u32 * 31 + k as u32 * 7) % 50_000
}

/// A request on the GPU: its row, its lease on the cached prefix, the tokens whose KV
/// is in the row, and the slot of the last one.
struct Running<'c> {
    tokens: Vec<u32>,
    prompt_len: usize,
    output_len: usize,
    /// Generated so far; the last one has no KV yet.
    generated: usize,
    row: ReqRow,
    lease: Lease<'c, PagedAllocator>,
    last_slot: u32,
}

/// What the output thread receives: a finished request (the lease detached, so that it
/// can cross threads), or the end.
enum ToOutput {
    Finished { tokens: Vec<u32>, row: ReqRow, lease: RawLease },
    Stop,
}

/// Tokens that `n` more tokens may need, in whole pages (worst case).
fn pages_for(n: usize) -> usize {
    n.div_ceil(PAGE_SIZE as usize) * PAGE_SIZE as usize + PAGE_SIZE as usize
}

/// Try to admit `req`. `reserved` is what the running requests may still need for decode.
/// `Ok(None)`: no room now (nothing held); the output thread will make some. `Err`: it
/// can never fit.
fn admit<'c>(cache: &'c Cache, req: &Request, reserved: usize) -> Result<Option<Running<'c>>, Box<dyn Error>> {
    // 1. Match and lock the cached prefix in one step (no eviction can come between).
    let mut slots = vec![0u32; req.prompt.len()];
    let lease = cache.match_and_lock(0, &req.prompt, &mut slots);
    let hit = lease.len();
    // 2. Admission control: the prefill and this request's decode tokens must fit in the
    //    free plus evictable slots, after what the running requests may still need. The
    //    output thread only ever adds to that, so the check stays true; decode never
    //    runs out (a real scheduler would retract requests instead).
    let need = pages_for(req.prompt.len() - hit) + pages_for(req.output_len);
    if need > cache.allocator().size() {
        return Err(format!("a request of {} tokens can never fit in the pool", req.prompt.len()).into());
    }
    if cache.allocator().available_size() + cache.evictable_size() < need + reserved {
        return Ok(None); // `lease` drops: unlocked
    }
    // 3. A row, then the prefill slots (evicting unlocked prefixes if short), in the row.
    let Ok(mut row) = cache.req_pool().alloc() else { return Ok(None) };
    let last = if hit > 0 { slots[hit - 1] } else { 0 };
    cache.alloc_extend(&[hit as u32], &[req.prompt.len() as u32], &[last], &mut slots[hit..])?;
    cache.req_pool().write(&mut row, 0, &slots)?;
    // ... the prefill forward pass writes K/V at `slots` and produces the first token ...
    let last_slot = *slots.last().expect("prompts are never empty");
    let tokens = req.prompt.clone();
    Ok(Some(Running {
        tokens,
        prompt_len: req.prompt.len(),
        output_len: req.output_len,
        generated: 1,
        row,
        lease,
        last_slot,
    }))
}

fn main() -> Result<(), Box<dyn Error>> {
    let requests = Arc::new(workload());
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

    // The output thread: cache each finished request while the scheduler goes on.
    let (to_output, inbox) = mpsc::channel::<ToOutput>();
    let output = {
        let cache = Arc::clone(&cache);
        thread::spawn(move || -> Result<(usize, usize), String> {
            let (mut finished, mut already_cached) = (0, 0);
            while let Ok(ToOutput::Finished { tokens, row, lease }) = inbox.recv() {
                let lease = cache.attach(lease).map_err(|_| "a lease of another cache")?;
                already_cached += cache.cache_finished_req(0, &tokens, row, lease, 0).map_err(|u| u.to_string())?;
                finished += 1;
            }
            Ok((finished, already_cached))
        })
    };

    // Router threads: how much of each prompt is cached right now (lock-free lookups).
    let done = Arc::new(AtomicBool::new(false));
    let routers: Vec<_> = (0..ROUTERS)
        .map(|r| {
            let (cache, requests, done) = (Arc::clone(&cache), Arc::clone(&requests), Arc::clone(&done));
            thread::spawn(move || {
                let (mut lookups, mut hit_tokens) = (0usize, 0usize);
                let mut out = vec![0u32; MAX_CONTEXT];
                for req in requests.iter().skip(r).step_by(ROUTERS).cycle() {
                    if done.load(Ordering::Relaxed) {
                        break;
                    }
                    hit_tokens += cache.peek_prefix(0, &req.prompt, &mut out[..req.prompt.len()]);
                    lookups += 1;
                }
                (lookups, hit_tokens)
            })
        })
        .collect();

    // The scheduler: admit, decode one token for everyone, hand finished requests over.
    let mut waiting: VecDeque<&Request> = requests.iter().collect();
    let mut running: Vec<Running<'_>> = Vec::new();
    let (mut steps, mut prompt_tokens, mut hit_tokens, mut decode_tokens) = (0usize, 0usize, 0usize, 0usize);
    while !waiting.is_empty() || !running.is_empty() {
        let mut reserved: usize = running.iter().map(|r| pages_for(r.output_len - r.generated)).sum();
        while running.len() < MAX_RUNNING {
            let Some(req) = waiting.front() else { break };
            match admit(&cache, req, reserved)? {
                Some(r) => {
                    prompt_tokens += r.prompt_len;
                    hit_tokens += r.lease.len();
                    reserved += pages_for(r.output_len);
                    running.push(r);
                    waiting.pop_front();
                }
                None => break, // no room until some requests finish
            }
        }
        if running.is_empty() {
            // Everything is with the output thread; let it free some room.
            thread::yield_now();
            continue;
        }
        steps += 1;

        // Decode: one new slot per request that still generates (for its newest token).
        let decoding: Vec<usize> =
            (0..running.len()).filter(|&i| running[i].generated < running[i].output_len).collect();
        let seq_lens: Vec<u32> = decoding.iter().map(|&i| running[i].tokens.len() as u32 + 1).collect();
        let last_locs: Vec<u32> = decoding.iter().map(|&i| running[i].last_slot).collect();
        let mut slots = vec![0u32; decoding.len()];
        cache.alloc_decode(&seq_lens, &last_locs, &mut slots)?;
        for (k, &i) in decoding.iter().enumerate() {
            let r = &mut running[i];
            let pos = r.tokens.len();
            cache.req_pool().write(&mut r.row, pos, &slots[k..k + 1])?;
            r.tokens.push(output_token(&r.tokens[..r.prompt_len], r.generated - 1));
            r.last_slot = slots[k];
            r.generated += 1;
        }
        decode_tokens += decoding.len();
        // ... the decode forward pass writes K/V at `slots` ...

        // Finished requests go to the output thread; the next step starts at once.
        let mut i = 0;
        while i < running.len() {
            if running[i].generated == running[i].output_len {
                let r = running.swap_remove(i);
                // The tokens with KV: prompt plus outputs, minus the last one generated.
                to_output.send(ToOutput::Finished { tokens: r.tokens, row: r.row, lease: r.lease.detach() })?;
            } else {
                i += 1;
            }
        }
    }
    to_output.send(ToOutput::Stop)?;
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
    if let Err(e) = cache.check_invariants() {
        problems.push(e.to_string());
    }
    if !problems.is_empty() {
        return Err(format!("overlap_scheduler: {}", problems.join("; ")).into());
    }
    println!("  checks: every KV slot is free or cached, nothing locked, every row free, invariants hold");
    Ok(())
}
