//! Private magazines ([`SlotCache`]) in front of a [`SlotPool`], beside its owned
//! batches and its bare API, against a model of who owns each index (feature
//! `models`): the shared driver of `tests/slot_cache_model.rs` and the `slot_cache`
//! fuzz target.
//!
//! One pool of [`CAPACITY`] indices with magazines of 2 entries, [`CACHES`] caches of
//! changing capacities, [`SLOTS`] batches, and the bare API beside them. The ops fill
//! and empty batches through a cache (on this thread or another) or through the pool
//! itself, flush caches, replace them (the old one's drop returns its stock), allocate
//! and free bare indices, try bare frees of indices a stock or a batch owns, and clear
//! the pool.
//!
//! The rules it checks (module docs of `kvpool::slots::cache`), exactly:
//!
//! * a fill through a cache succeeds exactly when the batch has room and the stock and
//!   the pool's free indices together hold `n`; it takes the stock's last `n` when the
//!   stock holds them, and otherwise draws the documented amount from the pool
//!   (the shortfall plus up to half the capacity, or the shortfall alone when the pool
//!   cannot give more, or straight into the batch when the stock cannot hold `n`);
//!   on an error nothing changes;
//! * emptying a batch (or its tail) into a cache pushes its indices onto the stock, after
//!   returning the stock's most recent indices to the pool down to half the capacity
//!   when it would overflow, or returns them to the pool when the batch is larger than
//!   the capacity; the stock's contents after every op are checked index by index;
//! * a flush (and a replacement) returns the whole stock;
//! * a bare free of an index in a stock or a batch is refused as not allocated;
//! * after every step: the pool's `available()` equals the model's free count, each
//!   cache's `available()` that plus its stock, `is_allocated` holds exactly for
//!   bare-allocated indices, and `check_invariants()` passes.

use arbitrary::Arbitrary;

use crate::error::{FreeErrorKind, SlotsError};
use crate::{OutOfMemory, SlotCache, SlotPool, Slots, Unit};

/// The pool's capacity: four bitmap words and part of a fifth.
pub const CAPACITY: u32 = 4 * 64 + 37;
/// How many caches the driver keeps.
pub const CACHES: usize = 2;
/// How many batches the driver keeps, with capacities [`SLOT_CAPS`].
pub const SLOTS: usize = 3;
/// The batches' capacities.
pub const SLOT_CAPS: [usize; SLOTS] = [8, 80, CAPACITY as usize];
/// The caches' capacities at the start (a replacement picks another, 0 included).
pub const CACHE_CAPS: [usize; CACHES] = [16, 100];
/// How many ops the `slot_cache` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 64;

/// One step of a [`run_cache`] sequence. Raw numbers are reduced into range as
/// documented per variant; `c` picks cache `c % CACHES`, `k` batch `k % SLOTS`.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum CacheOp {
    /// Fill batch `k` with `n % 130` more indices through cache `c`, on this thread
    /// or (`elsewhere`) on another, whose pool magazine is another one.
    Fill {
        /// Raw cache.
        c: u8,
        /// Raw batch.
        k: u8,
        /// Raw count.
        n: u16,
        /// On another thread.
        elsewhere: bool,
    },
    /// Empty batch `k` into cache `c`.
    Empty {
        /// Raw cache.
        c: u8,
        /// Raw batch.
        k: u8,
    },
    /// Return the last `n % (len + 2)` indices of batch `k` to cache `c` (one more
    /// than it holds included: refused).
    EmptyTail {
        /// Raw cache.
        c: u8,
        /// Raw batch.
        k: u8,
        /// Raw count.
        n: u16,
    },
    /// Fill batch `k` with `n % 130` more indices from the pool itself.
    PoolFill {
        /// Raw batch.
        k: u8,
        /// Raw count.
        n: u16,
    },
    /// Empty batch `k` into the pool itself.
    PoolEmpty {
        /// Raw batch.
        k: u8,
    },
    /// Return cache `c`'s stock to the pool.
    Flush {
        /// Raw cache.
        c: u8,
    },
    /// Replace cache `c` (its drop returns the stock) by one of capacity `cap % 150`.
    Replace {
        /// Raw cache.
        c: u8,
        /// Raw capacity.
        cap: u8,
    },
    /// Bare-allocate `1 + n % 50` indices.
    Alloc {
        /// Raw count.
        n: u8,
    },
    /// Bare-free the `at % held`-th bare-allocated index and the `len % 8` after it.
    Free {
        /// Raw position.
        at: u16,
        /// Raw extra length.
        len: u8,
    },
    /// Bare-free the `j`-th owned index (in a stock or a batch), counted over all of
    /// them (refused).
    FreeOwned {
        /// Raw position.
        j: u16,
    },
    /// Drop the caches, `clear()` the pool, make new caches: every batch that held
    /// indices is refused from then on and replaced by a new, empty one.
    Clear,
}

/// Decode up to `max` ops from fuzzer bytes.
pub fn cache_ops_from_bytes(bytes: &[u8], max: usize) -> Vec<CacheOp> {
    super::decode_ops(bytes, max)
}

/// Who holds an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Free,
    Bare,
    Batch(usize),
    Stock(usize),
}

/// The model's side: who owns each index, and each stock in stack order.
struct Model {
    owner: Vec<Owner>,
    stocks: [Vec<u32>; CACHES],
    bare: Vec<u32>,
}

impl Model {
    fn free_count(&self) -> usize {
        self.owner[1..].iter().filter(|&&o| o == Owner::Free).count()
    }

    /// Hand `indices` to `to`: each must be free, or in `from`'s stock.
    fn take(&mut self, indices: &[u32], from: Option<usize>, to: Owner) -> Result<(), String> {
        for &i in indices {
            let o = self.owner.get(i as usize).copied();
            let ok = i != 0 && (o == Some(Owner::Free) || (from.is_some() && o == from.map(Owner::Stock)));
            if !ok {
                return Err(format!("handed out {i}, which is {o:?}"));
            }
            self.owner[i as usize] = to;
        }
        Ok(())
    }

    /// Set stock `c` to `now` (what the cache reports): indices that left it are free
    /// again unless already handed to a batch ([`take`](Self::take)), and every index
    /// in it must be free by then (it was free or in that stock).
    fn restock(&mut self, c: usize, now: Vec<u32>) -> Result<(), String> {
        for &i in &self.stocks[c] {
            if self.owner[i as usize] == Owner::Stock(c) {
                self.owner[i as usize] = Owner::Free;
            }
        }
        for &i in &now {
            match self.owner.get(i as usize) {
                Some(Owner::Free) if i != 0 => self.owner[i as usize] = Owner::Stock(c),
                o => return Err(format!("the stock took {i}, which is {o:?}")),
            }
        }
        self.stocks[c] = now;
        Ok(())
    }
}

fn stock_of<P: core::ops::Deref<Target = SlotPool>>(cache: &SlotCache<P>) -> Vec<u32> {
    cache.runs().flatten().collect()
}

/// Run `ops` and check every rule; the first broken one is the error.
pub fn run_cache(ops: &[CacheOp]) -> Result<(), String> {
    let mut pool = SlotPool::with_magazines(CAPACITY, 2);
    let mut caps = CACHE_CAPS;
    let mut slots: Vec<Slots> = SLOT_CAPS.iter().map(|&c| Slots::with_capacity(c)).collect();
    let mut m = Model { owner: vec![Owner::Free; CAPACITY as usize + 1], stocks: Default::default(), bare: Vec::new() };
    let mut step = 0;
    while step < ops.len() {
        // The caches borrow the pool until a `Clear` (which needs it `&mut`).
        let mut caches: Vec<SlotCache<&SlotPool>> =
            caps.iter().map(|&cap| SlotCache::new(&pool, cap)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
        while step < ops.len() && ops[step] != CacheOp::Clear {
            let op = &ops[step];
            let fail = |what: String| format!("step {step} ({op:?}): {what}");
            apply(op, &pool, &mut caches, &mut caps, &mut slots, &mut m).map_err(fail)?;
            check(&pool, &caches, &m).map_err(fail)?;
            step += 1;
        }
        if step == ops.len() {
            break;
        }
        let fail = |what: String| format!("step {step} (Clear): {what}");
        drop(caches);
        m.stocks = Default::default();
        pool.clear();
        for (k, batch) in slots.iter_mut().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let len = batch.len();
            let mut cache = SlotCache::new(&pool, 8).map_err(|e| fail(e.to_string()))?;
            let (filled, emptied) = (cache.alloc_slots(1, batch), cache.free_slots(batch));
            if filled != Err(SlotsError::OtherPool) || emptied != Err(SlotsError::OtherPool) || batch.len() != len {
                return Err(fail(format!("batch {k} of {len} after clear: {filled:?}, {emptied:?}")));
            }
            drop(cache);
            *batch = Slots::with_capacity(SLOT_CAPS[k]);
        }
        m.owner.iter_mut().for_each(|o| *o = Owner::Free);
        m.bare.clear();
        step += 1;
    }
    Ok(())
}

/// The exact error of a fill of `n` into `batch` with `free` indices to draw on.
fn fill_error(n: usize, batch: &Slots, free: usize) -> Option<SlotsError> {
    if batch.capacity() - batch.len() < n {
        Some(SlotsError::Full { requested: n, len: batch.len(), capacity: batch.capacity() })
    } else if free < n {
        Some(SlotsError::OutOfMemory(OutOfMemory {
            requested: n,
            available: free,
            evictable: None,
            unit: Unit::Indices,
        }))
    } else {
        None
    }
}

/// Check a fill's result: the batch kept what it had and gained `added` indices, its
/// runs equal to its indices. Returns the new indices.
fn gained(before: &[u32], batch: &Slots, added: usize) -> Result<Vec<u32>, String> {
    let now = batch.as_slice();
    if now.len() != before.len() + added || now[..before.len()] != *before {
        return Err(format!("the batch went from {before:?} to {now:?}"));
    }
    let from_runs: Vec<u32> = batch.runs().flatten().collect();
    if from_runs != now || batch.runs().zip(batch.runs().skip(1)).any(|(a, b)| *a.end() + 1 == *b.start()) {
        return Err(format!("runs {batch:?} do not match the indices {now:?}"));
    }
    Ok(now[before.len()..].to_vec())
}

/// The stock expected after pushing `pushed` onto `stock` in a cache of `cap`.
fn expected_push(stock: &[u32], pushed: &[u32], cap: usize) -> Vec<u32> {
    if pushed.len() > cap {
        return stock.to_vec();
    }
    let mut keep = stock.len();
    if stock.len() + pushed.len() > cap {
        keep -= (stock.len() + pushed.len() - cap / 2).min(stock.len());
    }
    stock[..keep].iter().chain(pushed).copied().collect()
}

fn apply<'p>(
    op: &CacheOp,
    pool: &'p SlotPool,
    caches: &mut [SlotCache<&'p SlotPool>],
    caps: &mut [usize; CACHES],
    slots: &mut [Slots],
    m: &mut Model,
) -> Result<(), String> {
    let free_count = m.free_count();
    match *op {
        CacheOp::Fill { c, k, n, elsewhere } => {
            let (c, k, n) = (c as usize % CACHES, k as usize % SLOTS, n as usize % 130);
            let before = slots[k].as_slice().to_vec();
            let stock = m.stocks[c].clone();
            let expected = fill_error(n, &slots[k], free_count + stock.len());
            let (cache, batch) = (&mut caches[c], &mut slots[k]);
            let got = if elsewhere {
                std::thread::scope(|s| s.spawn(move || cache.alloc_slots(n, batch)).join())
                    .map_err(|_| "the other thread panicked".to_string())?
            } else {
                cache.alloc_slots(n, batch)
            };
            if got.err() != expected {
                return Err(format!("got {got:?}, expected {expected:?}"));
            }
            let new = gained(&before, &slots[k], if got.is_ok() { n } else { 0 })?;
            let now = stock_of(&caches[c]);
            if got.is_err() {
                return if now == stock { Ok(()) } else { Err(format!("the stock went from {stock:?} to {now:?}")) };
            }
            let (len, cap) = (stock.len(), caps[c]);
            // The policy, exactly: off the stock's top; else a draw of the shortfall
            // plus up to half the capacity, or of the shortfall alone; or, when the
            // stock cannot hold `n`, the shortfall straight and the whole stock.
            if len >= n && (new[..] != stock[len - n..] || now[..] != stock[..len - n]) {
                return Err(format!("from a stock of {stock:?}: {new:?}, leaving {now:?}"));
            }
            if len < n {
                let short = n - len;
                let expect_len = if short > cap - len {
                    0
                } else {
                    let draw = (short + cap / 2).min(cap - len);
                    if free_count >= draw {
                        draw - short
                    } else {
                        0
                    }
                };
                // The old stock is the bottom of stock-then-draw, or the end of the batch.
                let order_ok = if short > cap - len {
                    new.ends_with(&stock)
                } else {
                    now.iter().chain(&new).take(len).eq(stock.iter())
                };
                if now.len() != expect_len || !order_ok {
                    return Err(format!("from a stock of {stock:?} and {free_count} free: {new:?}, leaving {now:?}"));
                }
            }
            m.take(&new, Some(c), Owner::Batch(k))?;
            m.restock(c, now)?;
        }
        CacheOp::Empty { c, k } => {
            let (c, k) = (c as usize % CACHES, k as usize % SLOTS);
            let had = slots[k].as_slice().to_vec();
            let got = caches[c].free_slots(&mut slots[k]);
            if got != Ok(had.len()) || !slots[k].is_empty() {
                return Err(format!("got {got:?} for a batch of {}", had.len()));
            }
            pushed(m, c, &had, &caches[c], caps[c])?;
        }
        CacheOp::EmptyTail { c, k, n } => {
            let (c, k) = (c as usize % CACHES, k as usize % SLOTS);
            let had = slots[k].as_slice().to_vec();
            let n = n as usize % (had.len() + 2);
            let got = caches[c].free_slots_tail(&mut slots[k], n);
            let keep = had.len().saturating_sub(n);
            let expected =
                if n > had.len() { Err(SlotsError::TooMany { requested: n, len: had.len() }) } else { Ok(n) };
            let now = slots[k].as_slice();
            let kept = if got.is_ok() { &had[..keep] } else { &had[..] };
            let from_runs: Vec<u32> = slots[k].runs().flatten().collect();
            if got != expected || now != kept || from_runs != now {
                return Err(format!("got {got:?} (expected {expected:?}), the batch went from {had:?} to {now:?}"));
            }
            let tail = if got.is_ok() { &had[keep..] } else { &[][..] };
            pushed(m, c, tail, &caches[c], caps[c])?;
        }
        CacheOp::PoolFill { k, n } => {
            let (k, n) = (k as usize % SLOTS, n as usize % 130);
            let before = slots[k].as_slice().to_vec();
            let expected = fill_error(n, &slots[k], free_count);
            let got = pool.alloc_slots(n, &mut slots[k]);
            if got.err() != expected {
                return Err(format!("got {got:?}, expected {expected:?}"));
            }
            let new = gained(&before, &slots[k], if got.is_ok() { n } else { 0 })?;
            m.take(&new, None, Owner::Batch(k))?;
        }
        CacheOp::PoolEmpty { k } => {
            let k = k as usize % SLOTS;
            let had = slots[k].as_slice().to_vec();
            let got = pool.free_slots(&mut slots[k]);
            if got != Ok(had.len()) || !slots[k].is_empty() {
                return Err(format!("got {got:?} for a batch of {}", had.len()));
            }
            had.iter().for_each(|&i| m.owner[i as usize] = Owner::Free);
        }
        CacheOp::Flush { c } => {
            let c = c as usize % CACHES;
            let got = caches[c].flush();
            if got != m.stocks[c].len() || !caches[c].is_empty() {
                return Err(format!("flushed {got} of a stock of {}", m.stocks[c].len()));
            }
            m.restock(c, Vec::new())?;
        }
        CacheOp::Replace { c, cap } => {
            let (c, cap) = (c as usize % CACHES, cap as usize % 150);
            caches[c] = SlotCache::new(pool, cap).map_err(|e| e.to_string())?;
            caps[c] = cap;
            m.restock(c, Vec::new())?;
        }
        CacheOp::Alloc { n } => {
            let n = 1 + n as usize % 50;
            let mut out = vec![0u32; n];
            match pool.alloc(&mut out) {
                Ok(()) if free_count >= n => {
                    m.take(&out, None, Owner::Bare)?;
                    m.bare.extend(out);
                }
                Err(e) if free_count < n && e.available == free_count => {}
                other => return Err(format!("bare alloc of {n} with {free_count} free: {other:?}")),
            }
        }
        CacheOp::Free { at, len } => {
            if m.bare.is_empty() {
                return Ok(());
            }
            let at = at as usize % m.bare.len();
            let end = (at + 1 + len as usize % 8).min(m.bare.len());
            let batch: Vec<u32> = m.bare.drain(at..end).collect();
            pool.free(&batch).map_err(|e| format!("bare free of {batch:?}: {e}"))?;
            batch.iter().for_each(|&i| m.owner[i as usize] = Owner::Free);
        }
        CacheOp::FreeOwned { j } => {
            let owned: Vec<u32> =
                (1..=CAPACITY).filter(|&i| matches!(m.owner[i as usize], Owner::Batch(_) | Owner::Stock(_))).collect();
            if owned.is_empty() {
                return Ok(());
            }
            let i = owned[j as usize % owned.len()];
            match pool.free(&[i]) {
                Err(e) if e.kind == FreeErrorKind::NotAllocated && e.index == i && !e.rest_freed => {}
                other => return Err(format!("a bare free of owned {i} gave {other:?}")),
            }
        }
        CacheOp::Clear => unreachable!("run_cache handles Clear"),
    }
    Ok(())
}

/// After `gone` left a batch for cache `c`: the stock must be what the policy says.
fn pushed(m: &mut Model, c: usize, gone: &[u32], cache: &SlotCache<&SlotPool>, cap: usize) -> Result<(), String> {
    let expected = expected_push(&m.stocks[c], gone, cap);
    let now = stock_of(cache);
    if now != expected {
        return Err(format!("pushing {gone:?} onto {:?} (capacity {cap}) left {now:?}", m.stocks[c]));
    }
    gone.iter().for_each(|&i| m.owner[i as usize] = Owner::Free);
    m.restock(c, now)
}

/// The checks after every step.
fn check(pool: &SlotPool, caches: &[SlotCache<&SlotPool>], m: &Model) -> Result<(), String> {
    let free_count = m.free_count();
    if pool.available() != free_count {
        return Err(format!("available {} but the model has {free_count} free", pool.available()));
    }
    for (c, cache) in caches.iter().enumerate() {
        if cache.available() != free_count + m.stocks[c].len() || cache.len() != m.stocks[c].len() {
            return Err(format!("cache {c}: available {}, len {}", cache.available(), cache.len()));
        }
        if cache.len() > cache.capacity() {
            return Err(format!("cache {c} holds {} past its capacity {}", cache.len(), cache.capacity()));
        }
    }
    for (i, &o) in m.owner.iter().enumerate().skip(1) {
        if pool.is_allocated(i as u32) != (o == Owner::Bare) {
            return Err(format!("is_allocated({i}) disagrees with the model ({o:?})"));
        }
    }
    pool.check_invariants().map_err(|e| format!("check_invariants: {e}"))
}
