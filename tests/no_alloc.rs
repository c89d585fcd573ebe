#![cfg(not(loom))]
//! Hot paths never touch the heap: a counting global allocator sees zero allocations
//! in `SlotPool`, `TokenAllocator`, `PagedAllocator` and `ReqToTokenPool` operations
//! after construction.
//!
//! The counting allocator is `tests/alloc_common` (this thread's allocations only).

use std::hint::black_box;

mod alloc_common;

use alloc_common::{allocations, assert_no_alloc};
use kvpool::{KvAllocator, PagedAllocator, ReqToTokenPool, SlotCache, SlotPool, Slots, TokenAllocator};

/// The counter works: if it did not, every other test here would pass vacuously.
#[test]
fn counter_sees_allocations() {
    let (n, v) = allocations(|| black_box(Vec::<u32>::with_capacity(16)));
    assert_eq!(n, 1);
    drop(v);
    let (n, _) = allocations(|| {
        let mut v = black_box(Vec::<u32>::new());
        v.extend(0..100u32);
        black_box(v)
    });
    assert!(n >= 1, "growing a Vec was not counted");
    // and an error path that allocates is counted (formatting a message)
    let e = SlotPool::new(1).alloc(&mut [0u32; 2]).unwrap_err();
    let (n, _) = allocations(|| black_box(e.to_string()));
    assert!(n >= 1);
}

#[test]
fn slot_pool_hot_paths() {
    let pool = SlotPool::new(200); // spans four words
    let mut a = [0u32; 70];
    let mut b = [0u32; 3];
    assert_no_alloc("SlotPool::alloc", || pool.alloc(&mut a)).unwrap();
    assert_no_alloc("SlotPool::alloc_one", || pool.alloc_one()).unwrap();
    assert_no_alloc("SlotPool::alloc (error)", || pool.alloc(&mut [0u32; 500])).unwrap_err();
    assert_no_alloc("SlotPool::free", || pool.free(&a[..35])).unwrap();
    assert_no_alloc("SlotPool::free (double free error)", || pool.free(&a[..1])).unwrap_err();
    assert_no_alloc("SlotPool::free (out of range error)", || pool.free(&[999])).unwrap_err();
    assert_no_alloc("SlotPool::free (duplicate error)", || pool.free(&[a[40], a[40]])).unwrap_err();
    assert_no_alloc("SlotPool free group", || {
        let mut g = pool.free_group();
        g.free(&a[41..50]).unwrap();
        g.free(&a[50..]).unwrap();
        g.end()
    });
    assert_no_alloc("SlotPool::alloc after frees", || pool.alloc(&mut b)).unwrap();
    assert_no_alloc("SlotPool::check_invariants", || pool.check_invariants()).unwrap();
    assert_no_alloc("SlotPool::available", || pool.available());
}

/// Owned batches (`Slots`): fills from the bitmap and from the runs magazine, empties
/// onto it, one that flushes it, one too large for it, the error paths, and a bare
/// allocation that flushes another thread's runs magazine.
#[test]
fn slot_pool_owned_batch_paths() {
    let pool = SlotPool::with_magazines(5000, 16);
    let (mut a, mut b, mut big) = (Slots::with_capacity(600), Slots::with_capacity(600), Slots::with_capacity(5000));
    assert_no_alloc("SlotPool::alloc_slots from the bitmap", || pool.alloc_slots(500, &mut a)).unwrap();
    assert_no_alloc("SlotPool::alloc_slots appending", || pool.alloc_slots(100, &mut a)).unwrap();
    assert_no_alloc("SlotPool::free_slots_tail", || pool.free_slots_tail(&mut a, 150)).unwrap();
    assert_no_alloc("SlotPool::free_slots_tail (too many)", || pool.free_slots_tail(&mut a, 451)).unwrap_err();
    assert_no_alloc("SlotPool::free_slots onto the runs magazine", || pool.free_slots(&mut a)).unwrap();
    assert_no_alloc("SlotPool::alloc_slots from the runs magazine", || pool.alloc_slots(250, &mut b)).unwrap();
    assert_no_alloc("SlotPool::alloc_slots (full)", || pool.alloc_slots(400, &mut b)).unwrap_err();
    assert_no_alloc("SlotPool::free (an owned index)", || pool.free(&b[..1])).unwrap_err();
    assert_no_alloc("SlotPool::alloc_slots past the runs magazine", || pool.alloc_slots(1100, &mut big)).unwrap();
    assert_no_alloc("SlotPool::free_slots past the runs magazine", || pool.free_slots(&mut big)).unwrap();
    assert_no_alloc("SlotPool::alloc_slots (out of memory)", || pool.alloc_slots(5000, &mut big)).unwrap_err();
    // 400 onto the (flushed) runs magazine, then 700 more: over its 1,024, so it is
    // flushed first.
    pool.alloc_slots(400, &mut a).unwrap();
    pool.free_slots(&mut a).unwrap();
    pool.alloc_slots(700, &mut big).unwrap();
    assert_no_alloc("SlotPool::free_slots that flushes the runs magazine", || pool.free_slots(&mut big)).unwrap();
    let other = SlotPool::new(8);
    assert_no_alloc("SlotPool::free_slots of another pool's batch", || other.free_slots(&mut b)).unwrap_err();
    std::thread::scope(|s| {
        s.spawn(|| pool.free_slots(&mut b).unwrap());
    });
    let all = pool.available();
    assert_no_alloc("SlotPool::alloc_slots that flushes another thread's runs", || pool.alloc_slots(all, &mut big))
        .unwrap();
    assert_no_alloc("SlotPool::check_invariants with owned batches", || pool.check_invariants()).unwrap();
}

/// A private magazine's paths (`SlotCache`): a draw, pops off the stock, frees onto it,
/// a free that overflows it (its top goes back to the pool), batches larger than it
/// both ways, a draw cut to the shortfall, every error, a flush and the drop.
#[test]
fn slot_cache_paths() {
    let pool = SlotPool::with_magazines(5000, 16);
    let mut cache = SlotCache::new(&pool, 256).unwrap();
    let (mut a, mut b, mut big) = (Slots::with_capacity(600), Slots::with_capacity(600), Slots::with_capacity(5000));
    assert_no_alloc("SlotCache::alloc_slots drawing from the pool", || cache.alloc_slots(10, &mut a)).unwrap();
    assert_eq!(cache.len(), 128);
    assert_no_alloc("SlotCache::alloc_slots off the stock", || cache.alloc_slots(100, &mut a)).unwrap();
    assert_no_alloc("SlotCache::free_slots_tail", || cache.free_slots_tail(&mut a, 30)).unwrap();
    assert_no_alloc("SlotCache::free_slots_tail (too many)", || cache.free_slots_tail(&mut a, 81)).unwrap_err();
    assert_no_alloc("SlotCache::free_slots onto the stock", || cache.free_slots(&mut a)).unwrap();
    assert_eq!(cache.len(), 138);
    pool.alloc_slots(200, &mut b).unwrap();
    assert_no_alloc("SlotCache::free_slots that spills the stock", || cache.free_slots(&mut b)).unwrap();
    assert_eq!(cache.len(), 200);
    assert_no_alloc("SlotCache::alloc_slots larger than the stock", || cache.alloc_slots(300, &mut b)).unwrap();
    assert_no_alloc("SlotCache::alloc_slots (full)", || cache.alloc_slots(301, &mut b)).unwrap_err();
    assert_no_alloc("SlotCache::free_slots larger than the stock", || cache.free_slots(&mut b)).unwrap();
    let rest = pool.available() - 5;
    pool.alloc_slots(rest, &mut big).unwrap();
    assert_no_alloc("SlotCache::alloc_slots with the draw cut short", || cache.alloc_slots(5, &mut a)).unwrap();
    assert_no_alloc("SlotCache::alloc_slots (out of memory)", || cache.alloc_slots(1, &mut a)).unwrap_err();
    let other = SlotPool::new(8);
    let mut foreign = Slots::with_capacity(1);
    other.alloc_slots(1, &mut foreign).unwrap();
    assert_no_alloc("SlotCache::free_slots of another pool's batch", || cache.free_slots(&mut foreign)).unwrap_err();
    pool.free_slots(&mut big).unwrap();
    cache.alloc_slots(40, &mut b).unwrap();
    assert_no_alloc("SlotCache::flush", || cache.flush());
    cache.alloc_slots(40, &mut a).unwrap();
    assert_no_alloc("SlotCache's drop", || drop(cache));
    assert_eq!(pool.available(), 5000 - 85);
}

/// The magazine paths: a free onto the magazine, a pop, a double free of an index
/// sitting in the magazine, a free that does not fit (the magazine goes back to the
/// bitmap), a batch larger than a magazine, and an allocation that runs short and
/// flushes every magazine (one of them another thread's).
#[test]
fn slot_pool_magazine_paths() {
    let pool = SlotPool::new(5000);
    let cap = pool.magazine_capacity();
    assert!(cap > 256 && cap < 1500, "the test assumes a magazine of 256..1500, not {cap}");
    let mut all = vec![0u32; 5000];
    pool.alloc(&mut all).unwrap();
    let mut got = vec![0u32; 256];
    assert_no_alloc("SlotPool::free onto the magazine", || pool.free(&all[..256])).unwrap();
    assert_no_alloc("SlotPool::alloc from the magazine", || pool.alloc(&mut got)).unwrap();
    assert_eq!(got, all[..256]);
    assert_no_alloc("SlotPool::free onto the magazine, scattered", || pool.free(&[5, 900, 77])).unwrap();
    assert_no_alloc("SlotPool::free (double free of a magazine index)", || pool.free(&[900])).unwrap_err();
    assert_no_alloc("SlotPool::free (duplicate into the magazine)", || pool.free(&[1000, 1000])).unwrap_err();
    assert_no_alloc("SlotPool::alloc_one from the magazine", || pool.alloc_one()).unwrap();
    assert_no_alloc("SlotPool::free that flushes the magazine", || pool.free(&all[1200..1200 + cap])).unwrap();
    assert_no_alloc("SlotPool::free larger than a magazine", || pool.free(&all[2800..2800 + cap + 1])).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| pool.free(&all[4800..4900]).unwrap());
    });
    let available = pool.available();
    let mut rest = vec![0u32; available];
    assert_no_alloc("SlotPool::alloc that flushes magazines", || pool.alloc(&mut rest)).unwrap();
    assert_no_alloc("SlotPool::alloc (error after flushing)", || pool.alloc(&mut got)).unwrap_err();
    assert_no_alloc("SlotPool::check_invariants with magazines", || pool.check_invariants()).unwrap();
    assert_no_alloc("SlotPool::free after flushing", || pool.free(&rest[..1])).unwrap();
    assert_no_alloc("SlotPool::available with magazines", || pool.available());
}

/// Parked blocks (`SlotPool::with_parking`): parking a range's whole blocks, the
/// refusals around them, a claim that takes a block, part of another and words, and
/// one that fails after taking some (and gives it back).
#[test]
fn slot_pool_parking_paths() {
    let pool = SlotPool::with_parking(4096);
    let mut all = vec![0u32; 4096];
    pool.alloc(&mut all).unwrap();
    assert_no_alloc("free_range that parks blocks", || {
        let mut g = pool.free_group();
        g.free_range(500, 1100).unwrap();
        g.end()
    });
    assert_no_alloc("free_range (double free of a parked block)", || {
        let mut g = pool.free_group();
        g.free_range(513, 512).unwrap_err()
    });
    assert_no_alloc("free (an index of a parked block)", || pool.free(&[700])).unwrap_err();
    assert_no_alloc("SlotPool::available with parked blocks", || pool.available());
    let mut got = vec![0u32; 600];
    assert_no_alloc("alloc from parked blocks and words", || pool.alloc(&mut got)).unwrap();
    assert_no_alloc("alloc (error after a mixed reservation)", || pool.alloc(&mut all[..1000])).unwrap_err();
    assert_no_alloc("free of words in a block", || pool.free(&got[..100])).unwrap();
    assert_no_alloc("SlotPool::check_invariants with parked blocks", || pool.check_invariants()).unwrap();
}

fn allocator_hot_paths<A: KvAllocator>(alloc: &A) {
    let ps = alloc.page_size();
    let mut whole = vec![0u32; 4 * ps as usize];
    let mut extend = vec![0u32; 3 * ps as usize + 1];
    let mut decode = [0u32; 2];
    assert_no_alloc("alloc", || alloc.alloc(&mut whole)).unwrap();
    // request 0 continues the partial page of a prefix of 1 token at slot whole[0]
    let prefix = [1, 0];
    let seq = [1 + ps + 1, 2 * ps];
    assert_eq!(extend.len() as u32, seq[0] - prefix[0] + seq[1] - prefix[1]);
    assert_no_alloc("alloc_extend", || alloc.alloc_extend(&prefix, &seq, &[whole[0], 0], &mut extend)).unwrap();
    // decode: request 0 (now ps + 2 tokens, the last at extend[ps]) grows by one; request 1 is new
    let last = extend[ps as usize];
    assert_no_alloc("alloc_decode", || alloc.alloc_decode(&[ps + 3, 1], &[last, 0], &mut decode)).unwrap();
    assert_no_alloc("alloc_extend (error)", || alloc.alloc_extend(&[0], &[1 << 20], &[0], &mut extend)).unwrap_err();
    assert_no_alloc("alloc_decode (error)", || alloc.alloc_decode(&[0], &[0], &mut decode[..1])).unwrap_err();
    // extend and decode share pages with `whole`: one batch frees each page once
    let all: Vec<u32> = whole.iter().chain(&extend).chain(&decode).copied().collect();
    assert_no_alloc("free", || alloc.free(&all)).unwrap();
    assert_no_alloc("free (error)", || alloc.free(&whole[..1])).unwrap_err();
    let mut other = vec![0u32; 2 * ps as usize];
    alloc.alloc(&mut whole).unwrap();
    alloc.alloc(&mut other).unwrap();
    assert_no_alloc("free group", || {
        let mut g = alloc.free_group();
        g.free(&whole).unwrap();
        g.free(&other).unwrap();
        g.free(&other[..1]).unwrap_err();
        g.end()
    });
    assert_no_alloc("available_size", || alloc.available_size());
    assert_eq!(alloc.available_size(), alloc.size());
}

/// A `TokenAllocator` is a `PagedAllocator` at page size 1: this also covers page size
/// 1's own placement path (stretches merged across bitmap words).
#[test]
fn token_allocator_hot_paths() {
    allocator_hot_paths(&TokenAllocator::new(300).unwrap());
}

#[test]
fn paged_allocator_hot_paths() {
    for ps in [2, 3, 4, 16, 64] {
        allocator_hot_paths(&PagedAllocator::new(100 * ps as usize, ps).unwrap());
    }
}

#[test]
fn req_to_token_pool_hot_paths() {
    let pool = ReqToTokenPool::new(8, 64).unwrap();
    let slots: Vec<u32> = (100..164).collect();
    let mut row = assert_no_alloc("ReqToTokenPool::alloc", || pool.alloc()).unwrap();
    assert_no_alloc("ReqToTokenPool::write", || pool.write(&mut row, 0, &slots[..40])).unwrap();
    assert_no_alloc("ReqToTokenPool::write (error)", || pool.write(&mut row, 60, &slots[..40])).unwrap_err();
    let sum = assert_no_alloc("ReqToTokenPool::read", || pool.read(&row, 0..40).unwrap().iter().sum::<u32>());
    assert_eq!(sum, (100..140).sum::<u32>());
    assert_no_alloc("ReqToTokenPool::row", || pool.row(&row).map(|r| r.len())).unwrap();
    assert_no_alloc("ReqToTokenPool::free", || pool.free(row)).unwrap();
    assert_eq!(pool.available_size(), 8);
}

/// The host half of a graph decode step (`kvpool::kv::staging::stage_decode`: plan,
/// reserve pages, write the records into the pinned block) touches no heap, full
/// bucket or padded, and neither does a refused step; nor does `stage_decode_after`,
/// the page-size-1 step that continues each request's run.
#[test]
fn decode_step_staging() {
    use kvpool::kv::staging::{bucket_for, decode_block_bytes, stage_decode, stage_decode_after, RowLimits};
    let mut block = vec![0u32; decode_block_bytes(1024) / 4];
    let limits = RowLimits { rows: 1024, max_context_len: 4096 };
    let rows: Vec<u32> = (0..1024).collect();
    // Page size 16 through `stage_decode`; page size 1 through `stage_decode_after`,
    // each request's last slot the one its previous step took.
    for (name, ps) in [("stage_decode", 16), ("stage_decode_after", 1)] {
        let host = PagedAllocator::new(1 << 20, ps).unwrap();
        let mut seq = vec![0u32; 1024];
        let mut last = vec![u32::MAX; 1024];
        let stage = |seq: &[u32], rows: &[u32], bucket: usize, b: &mut [u8], last: &[u32]| {
            if ps == 1 {
                stage_decode_after(&host, seq, rows, bucket, limits, b, |i| last[i])
            } else {
                stage_decode(&host, seq, rows, bucket, limits, b)
            }
        };
        assert_no_alloc(name, || {
            for step in 0..300 {
                let batch = [1024usize, 1000, 7, 1][step % 4];
                seq[..batch].iter_mut().for_each(|s| *s += 1);
                let bucket = bucket_for(batch);
                let words = decode_block_bytes(bucket) / 4;
                let b: &mut [u8] = bytemuck::cast_slice_mut(&mut block[..words]);
                let s = black_box(stage(&seq[..batch], &rows[..batch], bucket, b, &last).unwrap());
                if ps == 1 {
                    let at = 4 * bucket;
                    last[..batch].copy_from_slice(&block[at..at + s.new_pages]);
                }
            }
            let b: &mut [u8] = bytemuck::cast_slice_mut(&mut block[..decode_block_bytes(2) / 4]);
            assert!(stage(&[1, 2, 3], &rows[..3], 2, b, &last).is_err());
        });
    }
}

/// The host half of a delta decode step (`kvpool::kv::delta::DeltaPlanner`: joins,
/// leaves, extends, staging the changes and the page-starting requests, committing)
/// touches no heap, and neither does a refused step.
#[test]
fn delta_step_staging() {
    // Page size 16, and 1 (every request takes a slot every step, continuing its run).
    for ps in [16, 1] {
        delta_steps(ps);
    }
}

fn delta_steps(ps: u32) {
    use kvpool::kv::delta::{delta_block_words, DeltaPlanner};
    use kvpool::kv::staging::RowLimits;
    let host = PagedAllocator::new(1 << 22, ps).unwrap();
    let limits = RowLimits { rows: 1024, max_context_len: 4096 };
    let mut plan = DeltaPlanner::new(ps, limits, 1024).unwrap();
    let mut block = vec![0u32; delta_block_words(1024)];
    let (mut fresh, mut owners) = (vec![0u32; 1024], vec![0u32; 1024]);
    assert_no_alloc("DeltaPlanner", || {
        for r in 0..1024 {
            plan.join(r, r % 100).unwrap();
        }
        for step in 0..300u32 {
            if step % 7 == 0 {
                let i = (step * 31) % plan.batch() as u32;
                let row = plan.row(i).unwrap();
                plan.leave(i).unwrap();
                plan.join(row, 3).unwrap();
                plan.set_len(step % 50, 2000).unwrap();
                plan.set_last_slot(step % 40, 7 * step).unwrap();
            }
            black_box(plan.stage(&host, &mut block, &mut fresh, &mut owners).unwrap());
            plan.commit();
        }
        assert!(plan.stage(&host, &mut block[1..], &mut fresh, &mut owners).is_err());
        plan.set_len(0, 4096).unwrap();
        assert!(plan.stage(&host, &mut block, &mut fresh, &mut owners).is_err());
    });
}

/// The fill loop is chosen when a pool is built, not on the first fill: that choice
/// reads `KVPOOL_WIDE_FILL`, which allocates when it is set. Every test above runs
/// again in a child process for each value of it.
#[test]
fn hot_paths_stay_allocation_free_when_the_fill_loop_is_forced() {
    let exe = std::env::current_exe().expect("this test binary");
    for value in ["0", "1", "512"] {
        let out = std::process::Command::new(&exe)
            .env("KVPOOL_WIDE_FILL", value)
            .args(["--skip", "hot_paths_stay_allocation_free_when_the_fill_loop_is_forced", "--test-threads", "1"])
            .output()
            .expect("run this test binary again");
        assert!(
            out.status.success(),
            "KVPOOL_WIDE_FILL={value}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
