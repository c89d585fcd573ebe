//! The model against kvpool's replay, and the optimum against brute force.

use super::*;
use crate::radix::{RadixCache, RadixConfig};
use crate::replay::{run_sequential, Mode};

/// A trace of requests `(blocks, extra prompt tokens, output tokens)`.
fn trace_of(reqs: &[(&[u32], u32, u32)]) -> Trace {
    let mut text = String::new();
    for (blocks, extra, out) in reqs {
        let input = blocks.len() as u32 * BLOCK_TOKENS - if *extra > 0 { BLOCK_TOKENS - extra } else { 0 };
        text += &format!("{{\"input_length\": {input}, \"output_length\": {out}, \"hash_ids\": {blocks:?}}}\n");
    }
    Trace::from_jsonl_str(&text, "test").unwrap()
}

fn config(capacity: usize, ps: u32, partial: bool) -> ReplayConfig {
    ReplayConfig {
        capacity_tokens: capacity,
        page_size: ps,
        mode: Mode::Sequential,
        partial_evict: partial,
        ..ReplayConfig::default()
    }
}

/// kvpool's sequential replay of `trace`.
fn kvpool(trace: &Trace, c: &ReplayConfig, policy: EvictionPolicy) -> SimTotals {
    let alloc = crate::PagedAllocator::new(c.capacity_tokens, c.page_size).unwrap();
    let rows = crate::ReqToTokenPool::new(1, trace.max_kv_len_fitting(c.capacity_tokens).max(1)).unwrap();
    let cache = RadixCache::new(alloc, rows, RadixConfig { policy, ..RadixConfig::default() })
        .unwrap()
        .with_partial_eviction(c.partial_evict);
    let c = ReplayConfig { policy, ..c.clone() };
    let r = run_sequential(&std::sync::Arc::new(cache), trace, &c, &|_| {}).unwrap();
    SimTotals {
        served: r.requests - r.rejected,
        rejected: r.rejected,
        prompt_tokens: r.prompt_tokens,
        hit_tokens: r.hit_tokens,
        output_tokens: r.output_tokens,
        evicted_tokens: r.evicted_tokens,
        peak_used_tokens: r.peak_used_tokens,
        final_cached_tokens: r.final_cached_tokens,
    }
}

/// The model is the replay: with kvpool's policies it gives kvpool's exact counts, on
/// the head of the bundled trace, whole and partial leaves, at two page sizes.
#[test]
fn model_reproduces_kvpool_replay() {
    let mut trace = Trace::bundled().unwrap();
    trace.truncate(if cfg!(debug_assertions) { 300 } else { 3000 });
    for (capacity, ps) in [(1 << 18, 16u32), (1 << 17, 64)] {
        for partial in [false, true] {
            for policy in [EvictionPolicy::Lru, EvictionPolicy::Lfu] {
                let c = config(capacity, ps, partial);
                let model = simulate(&trace, &c, sim_policy(policy).unwrap(), &mut None).unwrap();
                let real = kvpool(&trace, &c, policy);
                assert_eq!(model, real, "{policy:?} capacity {capacity} page {ps} partial {partial}");
                assert!(real.evicted_tokens > 0, "the check must evict");
            }
        }
    }
}

/// The best hit count over every sequence of eviction choices (each choice: one of the
/// evictable leaves; with `partial`, one page off a leaf's tail).
fn brute_force(trace: &Trace, c: &ReplayConfig) -> u64 {
    let mut best = 0;
    let mut stack: Vec<Vec<usize>> = vec![Vec::new()];
    let mut runs = 0;
    while let Some(prefix) = stack.pop() {
        runs += 1;
        assert!(runs < 2_000_000, "the brute force is too large for a test");
        let mut k = 0;
        let mut seen: Vec<usize> = Vec::new();
        let mut chooser = |n: usize| {
            let pick = if k < prefix.len() { prefix[k] } else { 0 };
            seen.push(n);
            k += 1;
            pick
        };
        let mut choose: Option<Chooser<'_>> = Some(&mut chooser);
        let t = simulate(trace, c, SimPolicy::Lru, &mut choose).unwrap();
        best = best.max(t.hit_tokens);
        for (i, &n) in seen.iter().enumerate().skip(prefix.len()) {
            for alt in 1..n {
                let mut p: Vec<usize> = prefix.clone();
                p.resize(i, 0);
                p.push(alt);
                stack.push(p);
            }
        }
    }
    best
}

fn optimal(trace: &Trace, c: &ReplayConfig) -> u64 {
    simulate(trace, c, SimPolicy::Optimal, &mut None).unwrap().hit_tokens
}

/// A tiny deterministic generator (xorshift), so the cases are reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Random small traces: a few requests over a few blocks, pages of a whole block, so
/// each request is a handful of pages and the brute force stays small.
fn random_trace(rng: &mut Rng) -> Trace {
    let n = 3 + rng.next(3) as usize;
    let mut reqs: Vec<(Vec<u32>, u32, u32)> = Vec::new();
    for _ in 0..n {
        // Extend an earlier prompt (a conversation) or start from a shared root.
        let mut blocks: Vec<u32> = match rng.next(3) {
            0 if !reqs.is_empty() => reqs[rng.next(reqs.len() as u64) as usize].0.clone(),
            _ => vec![1 + rng.next(2) as u32],
        };
        for _ in 0..rng.next(3) {
            blocks.push(10 + rng.next(6) as u32);
        }
        blocks.truncate(4);
        let out = [1, 2, 513][rng.next(3) as usize];
        reqs.push((blocks, 0, out));
    }
    let refs: Vec<(&[u32], u32, u32)> = reqs.iter().map(|(b, e, o)| (b.as_slice(), *e, *o)).collect();
    trace_of(&refs)
}

/// Page-granular Belady is the optimum: equal to the brute force on random small
/// traces, and at least every whole-leaf schedule's best.
#[test]
fn partial_optimum_equals_brute_force() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let cases = if cfg!(debug_assertions) { 60 } else { 300 };
    let mut evicting = 0;
    for case in 0..cases {
        let trace = random_trace(&mut rng);
        let pages = 4 + rng.next(3) as usize;
        let (whole, partial) = (config(pages * 512, 512, false), config(pages * 512, 512, true));
        let best = brute_force(&trace, &partial);
        assert_eq!(optimal(&trace, &partial), best, "case {case}: {trace:?} at {pages} pages");
        assert!(brute_force(&trace, &whole) <= best, "case {case}");
        evicting += usize::from(simulate(&trace, &partial, SimPolicy::Lru, &mut None).unwrap().evicted_tokens > 0);
    }
    assert!(evicting > cases / 3, "too few cases evict: {evicting} of {cases}");
}

/// Whole-leaf Belady is a heuristic (leaves differ in size and go whole), but it is
/// never below LRU or LFU on these traces, and on most it is the whole-leaf optimum.
#[test]
fn whole_leaf_optimum_against_brute_force() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let cases = if cfg!(debug_assertions) { 60 } else { 300 };
    let mut exact = 0;
    for case in 0..cases {
        let trace = random_trace(&mut rng);
        let pages = 4 + rng.next(3) as usize;
        let c = config(pages * 512, 512, false);
        let (opt, best) = (optimal(&trace, &c), brute_force(&trace, &c));
        assert!(opt <= best, "case {case}: the model's optimum beats every schedule?");
        for p in [SimPolicy::Lru, SimPolicy::Lfu] {
            let h = simulate(&trace, &c, p, &mut None).unwrap().hit_tokens;
            assert!(h <= best, "case {case}: {p:?} beats the brute force");
        }
        exact += usize::from(opt == best);
    }
    assert!(exact * 10 >= cases * 9, "whole-leaf Belady is the optimum on only {exact} of {cases} cases");
}

/// Hand-made: room for two prompts. LRU evicts the older one, which comes back; the
/// optimum evicts the one never used again, so the last request hits its first prompt.
#[test]
fn optimum_keeps_what_comes_back() {
    // Pages of one block, a pool of 4 pages; every request caches its prompt's pages.
    let trace = trace_of(&[(&[1, 2], 0, 1), (&[7, 8], 0, 1), (&[9, 10], 0, 1), (&[1, 2, 3], 0, 1)]);
    let c = config(4 * 512, 512, false);
    let lru = simulate(&trace, &c, SimPolicy::Lru, &mut None).unwrap().hit_tokens;
    assert_eq!(lru, 0);
    assert_eq!(optimal(&trace, &c), 2 * 512);
    assert_eq!(brute_force(&trace, &c), 2 * 512);
    // The replay's report says the same.
    let report = run_optimal(&trace, &c).unwrap();
    assert_eq!((report.hit_tokens, report.policy), (1024, "optimal"));
}

/// A page used by no later request goes first, even when it is the most recent.
#[test]
fn unused_pages_go_first() {
    // Request 0 caches [1, 2, 3] (3 pages); request 1 caches [4] + private; request 2
    // wants [1, 2, 3] again. A pool of 5 pages: request 1 needs 2 pages with 2 free
    // (3 cached); nothing must go. Request 2 (4 pages kv) needs 1 more with [4, p] cached.
    let trace = trace_of(&[(&[1, 2, 3], 0, 1), (&[4], 0, 513), (&[1, 2, 3, 5], 0, 1)]);
    let c = config(5 * 512, 512, true);
    assert_eq!(optimal(&trace, &c), 3 * 512);
    assert_eq!(brute_force(&trace, &c), 3 * 512);
}

/// A request too large for the pool is rejected before it matches anything: it is no
/// later use of the pages its prompt names. Room for two pages: request 2 must evict
/// [1] or [2]; [1]'s only later "use" is request 3, which cannot fit (3 pages), while
/// [2] comes back at request 4. The optimum keeps [2], as it does without request 3.
#[test]
fn requests_too_large_for_the_pool_are_no_later_use() {
    let c = config(2 * 512, 512, true);
    let with = trace_of(&[(&[1], 0, 1), (&[2], 0, 1), (&[3], 0, 1), (&[1, 9, 8], 0, 1), (&[2], 0, 1)]);
    let without = trace_of(&[(&[1], 0, 1), (&[2], 0, 1), (&[3], 0, 1), (&[2], 0, 1)]);
    assert_eq!(brute_force(&with, &c), 512);
    assert_eq!(optimal(&without, &c), 512);
    assert_eq!(optimal(&with, &c), 512);
    assert_eq!(optimal(&with, &config(2 * 512, 512, false)), 512);
}

#[test]
fn page_size_must_divide_blocks() {
    let trace = trace_of(&[(&[1], 0, 1)]);
    let c = config(48 * 10, 48, false);
    assert!(matches!(run_optimal(&trace, &c), Err(ReplayError::Config(_))));
}

fn hits(trace: &Trace, c: &ReplayConfig, p: SimPolicy) -> u64 {
    simulate(trace, c, p, &mut None).unwrap().hit_tokens
}

/// Hand-made, pages of one block, a pool of 3 pages: a request of one block and two
/// output tokens holds 2 pages while it runs and caches its block, so a miss with two
/// blocks cached evicts one of them: paging with room for two. Requests A B C A B C.
///
/// * LRU: C evicts A, A evicts B, B evicts C: no hit.
/// * oracle-return: at C, A and B both return: LRU evicts A. At A (request 3), B and
///   C both return: LRU evicts B. At B, A does not return: it goes; C hits. 1 hit.
/// * optimal: at C, B returns later (4) than A (3): B goes; A hits; at B, A does not
///   return: it goes; C hits. 2 hits, the brute force's too.
/// * oracle-return-1: at C, A returns within 1 request, B (4) not: B goes, as the
///   optimum. 2 hits. oracle-return-2: A and B both within 2: as oracle-return, 1 hit.
#[test]
fn return_oracles_by_hand() {
    let (a, b, c) = (&[1u32][..], &[2u32][..], &[3u32][..]);
    let trace = trace_of(&[(a, 0, 2), (b, 0, 2), (c, 0, 2), (a, 0, 2), (b, 0, 2), (c, 0, 2)]);
    for partial in [false, true] {
        let cfg = config(3 * 512, 512, partial);
        assert_eq!(hits(&trace, &cfg, SimPolicy::Lru), 0, "partial {partial}");
        assert_eq!(hits(&trace, &cfg, SimPolicy::Return), 512, "partial {partial}");
        assert_eq!(hits(&trace, &cfg, SimPolicy::ReturnWithin(1)), 2 * 512, "partial {partial}");
        assert_eq!(hits(&trace, &cfg, SimPolicy::ReturnWithin(2)), 512, "partial {partial}");
        assert_eq!(hits(&trace, &cfg, SimPolicy::Optimal), 2 * 512, "partial {partial}");
        assert_eq!(brute_force(&trace, &cfg), 2 * 512, "partial {partial}");
    }
    // The replay's report, through the configuration's ceiling.
    let run = |ceiling| run_optimal(&trace, &ReplayConfig { ceiling, optimal: true, ..config(3 * 512, 512, false) });
    let r = run(Ceiling::Return).unwrap();
    assert_eq!((r.hit_tokens, r.policy), (512, "oracle-return"));
    let r = run(Ceiling::ReturnWithin(1)).unwrap();
    assert_eq!((r.hit_tokens, r.policy), (1024, "oracle-return-1"));
    assert!(matches!(run(Ceiling::ReturnWithin(3)), Err(ReplayError::Config(_))));
}

/// Hand-made: a leaf never used again goes before an older leaf that returns, even
/// within a window (A B C A: LRU evicts A at C; oracle-return evicts B, and A hits).
#[test]
fn return_oracle_evicts_what_never_returns() {
    let (a, b, c) = (&[1u32][..], &[2u32][..], &[3u32][..]);
    let trace = trace_of(&[(a, 0, 2), (b, 0, 2), (c, 0, 2), (a, 0, 2)]);
    let cfg = config(3 * 512, 512, false);
    assert_eq!(hits(&trace, &cfg, SimPolicy::Lru), 0);
    for p in [SimPolicy::Return, SimPolicy::ReturnWithin(1), SimPolicy::Optimal] {
        assert_eq!(hits(&trace, &cfg, p), 512, "{p:?}");
    }
}

/// On random small traces the informed ceilings lie between LRU and the optimum: never
/// above the brute force (whole leaves) or page-granular MIN (partial), and never below
/// LRU.
#[test]
fn return_oracles_between_lru_and_the_optimum() {
    let mut rng = Rng(0x1357_9bdf_2468_ace0);
    let cases = if cfg!(debug_assertions) { 60 } else { 300 };
    let (mut above_lru, mut below_opt) = (0, 0);
    for case in 0..cases {
        let trace = random_trace(&mut rng);
        let pages = 4 + rng.next(3) as usize;
        for partial in [false, true] {
            let cfg = config(pages * 512, 512, partial);
            let lru = hits(&trace, &cfg, SimPolicy::Lru);
            let best = if partial { optimal(&trace, &cfg) } else { brute_force(&trace, &cfg) };
            for p in [SimPolicy::Return, SimPolicy::ReturnWithin(1), SimPolicy::ReturnWithin(2)] {
                let h = hits(&trace, &cfg, p);
                assert!(lru <= h && h <= best, "case {case} partial {partial} {p:?}: lru {lru} <= {h} <= {best}?");
                above_lru += usize::from(h > lru);
                below_opt += usize::from(h < best);
            }
        }
    }
    // The checks are not vacuous: the ceilings often differ from both ends.
    assert!(above_lru > cases / 10 && below_opt > 0, "above LRU {above_lru}, below the optimum {below_opt}");
}

/// The model of `policy` with every leaf re-keyed at every request (`rekey`) or with
/// the promotion queue.
fn run_sim(trace: &Trace, c: &ReplayConfig, policy: SimPolicy, rekey: bool) -> SimTotals {
    let uses = Uses::new(trace, c.page_size as usize, c.capacity_tokens / c.page_size as usize);
    let mut sim = Sim::new(&uses, c.capacity_tokens, policy, c.partial_evict);
    sim.rekey_all = rekey;
    sim.run(trace, &mut None)
}

/// The window's extremes: `W = 0` is LRU and `W` past the trace's end is
/// oracle-return, to the token; in between, the promotion queue gives what re-keying
/// every leaf at every request gives. The head of the bundled trace, page 16.
#[test]
fn return_window_is_exact() {
    let mut trace = Trace::bundled().unwrap();
    trace.truncate(if cfg!(debug_assertions) { 400 } else { 3000 });
    let n = trace.len() as u64;
    for partial in [false, true] {
        let c = config(1 << 18, 16, partial);
        let lru = run_sim(&trace, &c, SimPolicy::Lru, false);
        assert!(lru.evicted_tokens > 0 && lru.rejected == 0);
        assert_eq!(run_sim(&trace, &c, SimPolicy::ReturnWithin(0), false), lru, "partial {partial}");
        let ret = run_sim(&trace, &c, SimPolicy::Return, false);
        assert_eq!(run_sim(&trace, &c, SimPolicy::ReturnWithin(n), false), ret, "partial {partial}");
        for w in [64, 128, 256] {
            let queued = run_sim(&trace, &c, SimPolicy::ReturnWithin(w), false);
            assert_eq!(queued, run_sim(&trace, &c, SimPolicy::ReturnWithin(w), true), "W {w} partial {partial}");
            let h = queued.hit_tokens;
            assert!(h != lru.hit_tokens && h != ret.hit_tokens, "W {w} partial {partial}: a vacuous check");
        }
    }
}

#[test]
fn ceiling_names() {
    assert_eq!(Ceiling::from_name("optimal"), Ok(Some(Ceiling::Optimal)));
    assert_eq!(Ceiling::from_name("Oracle-Return"), Ok(Some(Ceiling::Return)));
    assert_eq!(Ceiling::from_name("oracle-return-1024"), Ok(Some(Ceiling::ReturnWithin(1024))));
    assert_eq!(Ceiling::ReturnWithin(1024).label(true), Some("oracle-return-1024, partial leaves"));
    assert_eq!(Ceiling::from_name("lru"), Ok(None));
    for bad in ["oracle-return-0", "oracle-return-100", "oracle-return-131072", "oracle-return-x"] {
        assert!(Ceiling::from_name(bad).is_err(), "{bad}");
    }
}

/// The modelled LHD with the waiting queue: A B C A with room for two. Before any
/// density is learned (the first recomputation comes at request `PERIOD`) every leaf
/// has density 0 and the tie goes to LRU, which evicts A at C; the queue (A is wanted
/// within `QUEUE` requests) keeps A and evicts B instead, so A hits.
#[test]
fn lhd_queue_keeps_what_the_queue_wants() {
    let (a, b, c) = (&[1u32][..], &[2u32][..], &[3u32][..]);
    let trace = trace_of(&[(a, 0, 2), (b, 0, 2), (c, 0, 2), (a, 0, 2)]);
    let cfg = config(3 * 512, 512, false);
    assert_eq!(hits(&trace, &cfg, SimPolicy::Lhd(LhdVariant::Age)), 0);
    assert_eq!(hits(&trace, &cfg, SimPolicy::Lhd(LhdVariant::Classes)), 0);
    assert_eq!(hits(&trace, &cfg, SimPolicy::Lhd(LhdVariant::Queue)), 512);
}

/// The density by hand: a class hit only late (age 15) and evicted young (age 0) is
/// denser at age 8 than at age 0 (LRU would keep the younger leaf); past its last
/// ending it is 0, and another class, never seen, is 0 everywhere.
#[test]
fn lhd_density_by_hand() {
    use super::lhd::{age_bucket, Lhd};
    let mut l = Lhd::new(LhdVariant::Classes);
    l.hit(0, 15);
    l.evicted(0, 0);
    l.recompute();
    let (b0, b8, b15) = (age_bucket(0), age_bucket(8), age_bucket(15));
    assert_eq!((b0, b8, b15), (0, 12, 16));
    let mid = |b: usize| 2f64.powf((b as f64 + 0.5) / 4.0) - 1.0;
    let low = |b: usize| 2f64.powf(b as f64 / 4.0) - 1.0;
    // Age 0: one hit ahead; lifetimes: the eviction in its own bucket (at least half a
    // request) and the hit at age 15.
    let at0 = 1.0 / (0.5 + (mid(b15) - low(b0)));
    assert!((l.density(0, 0) - at0).abs() < 1e-12, "{} vs {at0}", l.density(0, 0));
    let at8 = 1.0 / (mid(b15) - low(b8));
    assert!((l.density(0, 8) - at8).abs() < 1e-12, "{} vs {at8}", l.density(0, 8));
    assert!(l.density(0, 8) > l.density(0, 0));
    assert_eq!(l.density(0, 40), 0.0);
    assert_eq!(l.density(1, 0), 0.0);
}

/// The classes are learned from what the cache sees: on the head of the bundled trace
/// the tails that splits leave (a turn's output and partial last block, which the next
/// turn does not share) are evicted and almost never hit, so their class is the least
/// dense; and a run is deterministic (the draws come from a fixed seed).
#[test]
fn lhd_learns_that_remainders_do_not_return() {
    let mut trace = Trace::bundled().unwrap();
    trace.truncate(if cfg!(debug_assertions) { 1500 } else { 3000 });
    // A pool that keeps conversations until their next turn (2 M tokens).
    let c = config(1 << 21, 16, false);
    let uses = Uses::new(&trace, 16, c.capacity_tokens / 16);
    let mut sim = Sim::new(&uses, c.capacity_tokens, SimPolicy::Lhd(LhdVariant::Classes), false);
    for r in 0..trace.len() {
        if (r + 1) % super::lhd::PERIOD == 0 {
            sim.lhd.as_mut().unwrap().recompute();
        }
        sim.request(&trace, r, &mut None);
    }
    let l = sim.lhd.as_ref().unwrap();
    let (rem_hits, rem_evicted) = l.totals(4..8);
    let (hits, evicted) = l.totals(0..4);
    assert!(rem_evicted > 50.0 && hits > 10.0 && evicted > 10.0, "{rem_evicted} {hits} {evicted}");
    assert!(rem_hits * 20.0 < rem_evicted, "remainders hit {rem_hits} times, evicted {rem_evicted}");
    assert!(l.density(4, 0) < l.density(0, 0), "{} {}", l.density(4, 0), l.density(0, 0));
    // Continued conversations get their own classes (depth 1 to 3).
    let (deep_hits, deep_evicted) = l.totals(1..4);
    assert!(deep_hits > 10.0 && deep_evicted > 10.0, "{deep_hits} {deep_evicted}");
    let once = simulate(&trace, &c, SimPolicy::Lhd(LhdVariant::Classes), &mut None).unwrap();
    assert_eq!(once, simulate(&trace, &c, SimPolicy::Lhd(LhdVariant::Classes), &mut None).unwrap());
    assert_eq!(once.hit_tokens, sim.totals.hit_tokens);
}

#[test]
fn lhd_names() {
    for (name, v) in [
        ("model-lhd", LhdVariant::Queue),
        ("model-lhd-classes", LhdVariant::Classes),
        ("model-lhd-age", LhdVariant::Age),
    ] {
        assert_eq!(Ceiling::from_name(name), Ok(Some(Ceiling::Lhd(v))));
        assert_eq!(Ceiling::Lhd(v).label(false), Some(name));
    }
    let trace = trace_of(&[(&[1], 0, 1)]);
    let c = ReplayConfig { ceiling: Ceiling::Lhd(LhdVariant::Queue), optimal: true, ..config(4 * 512, 512, true) };
    assert!(matches!(run_optimal(&trace, &c), Err(ReplayError::Config(_))));
}
