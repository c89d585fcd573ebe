//! A private magazine: [`SlotCache`], a stock of owned indices in front of a
//! [`SlotPool`] that one owner allocates from and frees into without touching the pool.
//!
//! # Why
//!
//! Bonwick and Adams put a magazine in front of a shared allocator so that most
//! allocations and frees are a plain copy. The pool's own magazines cannot be that:
//! they belong to thread slots, any thread may come and flush them, so each use takes
//! a `busy` flag with a compare-and-swap, and an owned round ([`SlotPool::alloc_slots`]
//! then [`SlotPool::free_slots`]) pays two of them (module docs of
//! [`slots::owned`](super::owned)). A magazine that one owner holds by `&mut` needs
//! none: that is a `SlotCache`. The kernel gets the same from per-CPU magazines with
//! preemption off; here the borrow checker is the proof.
//!
//! # What the pool sees
//!
//! The stock is drawn with [`SlotPool::alloc_slots`]'s machinery and returned with
//! [`SlotPool::free_slots`]'s: to the pool, the indices in a cache's stock are handed
//! out, owned, exactly like the indices of a [`Slots`]. So nothing about the pool
//! changes meaning:
//!
//! * [`SlotPool::available`] does not count a cache's stock, and is exact at
//!   quiescence; an allocation from the pool (bare, owned, or another cache's) fails
//!   only when it is really short. [`SlotCache::available`] is the owner's view: the
//!   pool's plus its own stock.
//! * A bare [`free`](SlotPool::free) of an index in the stock, or in a batch the cache
//!   filled, is refused as a double free (held bit 0), as for any owned index.
//! * [`check_invariants`](SlotPool::check_invariants) counts the stock among the
//!   indices in `Slots`.
//!
//! The price of the private stock is what every per-thread cache pays: free indices
//! another owner cannot reach. The cache bounds it by its capacity, draws from the
//! pool only when short, returns its stock when a free would overflow it, on
//! [`flush`](SlotCache::flush) and on drop.
//!
//! # Policy
//!
//! With capacity `c` and `len` indices in stock:
//!
//! * **Alloc** of `n` (into a `Slots`, all or nothing): if `len >= n`, pop the last `n`
//!   off the stock (the most recently freed, in the order they were freed: a batch
//!   freed as a run comes back as that run). Otherwise draw the shortfall plus up to
//!   `c / 2` more from the pool into the stock (just the shortfall if the pool cannot
//!   give more), then pop. An `n` the stock cannot hold takes the shortfall straight
//!   from the pool, then the whole stock.
//! * **Free** of a batch of `n`: push its runs onto the stock (a run that continues the
//!   top one extends it; no index is read or written). If the stock would overflow,
//!   first return its most recent indices to the pool, down to `c / 2` with the batch;
//!   a batch larger than `c` goes straight to the pool.
//!
//! So a round of alloc and free of a batch that the stock covers touches no atomic:
//! it writes the batch's indices once (the fill) and a few words of runs.
//! BENCHMARKS.md ("Private magazines") has the numbers against a `Mutex<Vec<u32>>`.
//!
//! # Examples
//!
//! ```
//! use kvpool::{SlotCache, SlotPool, Slots};
//!
//! let pool = SlotPool::new(1 << 16);
//! let mut cache = SlotCache::new(&pool, 4096)?;
//! let mut batch = Slots::with_capacity(256);
//! cache.alloc_slots(16, &mut batch)?;        // draws 16 + 2048 from the pool
//! assert_eq!((cache.len(), pool.available()), (2048, (1 << 16) - 2064));
//! assert_eq!(cache.available(), (1 << 16) - 16);
//! cache.free_slots(&mut batch)?;             // back onto the stock, no atomic
//! cache.alloc_slots(16, &mut batch)?;        // the same 16, off the stock
//! cache.free_slots(&mut batch)?;
//! drop(cache);                               // the stock goes back to the pool
//! assert_eq!(pool.available(), 1 << 16);
//! # Ok::<(), kvpool::SlotsError>(())
//! ```

use core::ops::Deref;

use super::owned::{pop_runs, push_runs, take_tail, RunSink};
use super::{SlotPool, Slots};
use crate::error::SlotsError;

/// A private magazine of owned indices in front of a [`SlotPool`]: its owner
/// allocates batches ([`Slots`]) from it and frees them into it with plain copies,
/// and it draws from and returns to the pool in bulk (module docs of
/// [`slots::cache`](crate::slots::cache)).
///
/// `P` is how it reaches the pool: `&SlotPool`, `Arc<SlotPool>`, or any pointer that
/// derefs to one. The stock's storage (`capacity` runs) is allocated once by
/// [`new`](Self::new); nothing else allocates. It is `Send` when `P` is, so it may move
/// to another thread with its stock; every operation takes `&mut self`.
///
/// # Examples
///
/// An overlap scheduler: the scheduler thread allocates through its cache, the output
/// thread frees through its own, and each stock moves to the pool in bulk.
///
/// ```
/// use std::sync::Arc;
/// use kvpool::{SlotCache, SlotPool, Slots};
///
/// let pool = Arc::new(SlotPool::new(1 << 16));
/// let (done, finished) = std::sync::mpsc::channel::<Slots>();
/// let output = {
///     let pool = Arc::clone(&pool);
///     std::thread::spawn(move || {
///         let mut cache = SlotCache::new(pool, 1024)?;
///         for mut batch in finished {
///             cache.free_slots(&mut batch)?;        // onto this thread's stock
///         }
///         Ok::<(), kvpool::SlotsError>(())          // the drop returns the stock
///     })
/// };
/// let mut cache = SlotCache::new(Arc::clone(&pool), 1024)?;
/// for _ in 0..100 {
///     let mut batch = Slots::with_capacity(16);
///     cache.alloc_slots(16, &mut batch)?;
///     done.send(batch).unwrap();
/// }
/// drop((done, cache));
/// output.join().unwrap()?;
/// assert_eq!(pool.available(), 1 << 16);
/// # Ok::<(), kvpool::SlotsError>(())
/// ```
pub struct SlotCache<P: Deref<Target = SlotPool>> {
    pool: P,
    /// The pool's identity when the cache was made: its stock is that pool's. Checked
    /// on every operation, so that a `P` that derefs to another pool, or to the pool
    /// after a [`clear`](SlotPool::clear), is refused instead of handed indices of
    /// the wrong pool or epoch.
    id: u64,
    stock: Stock,
}

/// Owned indices as a stack of runs `(first, count)`, bottom first.
struct Stock {
    runs: Box<[(u32, u32)]>,
    nruns: usize,
    /// Indices in `runs[..nruns]`; at most `runs.len()`, so the runs always fit.
    len: usize,
}

impl RunSink for Stock {
    #[inline]
    fn push_run(&mut self, first: u32, count: u32) {
        self.nruns = push_runs(&mut self.runs, self.nruns, &[(first, count)]);
        self.len += count as usize;
    }
}

impl<P: Deref<Target = SlotPool>> SlotCache<P> {
    /// A cache of up to `capacity` indices (at most the pool's capacity) in front of
    /// `pool`, with an empty stock. Allocates its storage (8 bytes per index of
    /// capacity) here, once.
    ///
    /// # Errors
    ///
    /// [`SlotsError::Unsupported`] for a pool without magazines, which refuses owned
    /// batches (see [`SlotPool::alloc_slots`]).
    pub fn new(pool: P, capacity: usize) -> Result<Self, SlotsError> {
        let p: &SlotPool = &pool;
        if p.mags.is_empty() {
            return Err(SlotsError::Unsupported);
        }
        let (id, capacity) = (p.id, capacity.min(p.capacity() as usize));
        Ok(SlotCache { pool, id, stock: Stock { runs: vec![(0, 0); capacity].into_boxed_slice(), nruns: 0, len: 0 } })
    }

    /// The pool it draws from.
    pub fn pool(&self) -> &SlotPool {
        &self.pool
    }

    /// How many indices the stock can hold.
    pub fn capacity(&self) -> usize {
        self.stock.runs.len()
    }

    /// How many indices are in stock (free for this cache, handed out for the pool).
    pub fn len(&self) -> usize {
        self.stock.len
    }

    /// Whether the stock is empty.
    pub fn is_empty(&self) -> bool {
        self.stock.len == 0
    }

    /// What an [`alloc_slots`](Self::alloc_slots) may get: the pool's
    /// [`available`](SlotPool::available) plus the stock.
    pub fn available(&self) -> usize {
        self.pool.available() + self.stock.len
    }

    /// The stock as ranges of consecutive indices, bottom of the stack first.
    #[cfg(feature = "models")]
    pub(crate) fn runs(&self) -> impl ExactSizeIterator<Item = core::ops::RangeInclusive<u32>> + '_ {
        super::owned::ranges(&self.stock.runs[..self.stock.nruns])
    }

    /// The pool, dereferenced once per operation (so that every step of it sees the
    /// same one), or `Err(OtherPool)` unless it is still the pool (and epoch) of the
    /// stock.
    #[inline]
    fn checked(pool: &P, id: u64) -> Result<&SlotPool, SlotsError> {
        let pool: &SlotPool = pool;
        if pool.id == id {
            Ok(pool)
        } else {
            Err(SlotsError::OtherPool)
        }
    }

    /// Allocate `n` indices into `into`, after what it holds, all or nothing, from the
    /// stock when it holds `n` (no atomic touched), else topping the stock up from the
    /// pool first (module docs, "Policy"). The batch is an ordinary owned batch of the
    /// pool: it may be freed into this cache, another cache of the pool, or the pool.
    ///
    /// # Errors
    ///
    /// Nothing changed on any error.
    /// * [`SlotsError::OutOfMemory`] when the stock and the pool together hold fewer
    ///   than `n` (its `available` counts both);
    /// * [`SlotsError::Full`] when `into` has no room for `n` more;
    /// * [`SlotsError::OtherPool`] when `into` holds indices of another pool (or of
    ///   this one before [`clear`](SlotPool::clear)), or `P` no longer reaches the
    ///   cache's pool.
    pub fn alloc_slots(&mut self, n: usize, into: &mut Slots) -> Result<(), SlotsError> {
        let pool = Self::checked(&self.pool, self.id)?;
        if !into.is_empty() && into.pool_id() != self.id {
            return Err(SlotsError::OtherPool);
        }
        if into.capacity() - into.len() < n {
            return Err(SlotsError::Full { requested: n, len: into.len(), capacity: into.capacity() });
        }
        if n == 0 {
            return Ok(());
        }
        let (cap, stock) = (self.stock.runs.len(), &mut self.stock);
        let len = stock.len;
        if len < n {
            let short = n - len;
            let room = cap - len;
            let cut = |mut e: crate::OutOfMemory| {
                e.requested = n;
                e.available += len;
                SlotsError::OutOfMemory(e)
            };
            if short > room {
                // The stock cannot hold `n`: the shortfall straight from the pool, then
                // the whole stock.
                pool.alloc_owned(short, into).map_err(cut)?;
                stock.pop_into(len, into);
                into.set_pool_id(self.id);
                crate::debug_check(pool);
                return Ok(());
            }
            let draw = (short + cap / 2).min(room);
            if draw == short || pool.alloc_owned(draw, stock).is_err() {
                pool.alloc_owned(short, stock).map_err(cut)?;
            }
        }
        stock.pop_into(n, into);
        into.set_pool_id(self.id);
        crate::debug_check(pool);
        Ok(())
    }

    /// Return every index of `from` to the stock (or, past its capacity, to the pool)
    /// and empty it; returns how many. Never fails for a batch of this cache's pool,
    /// whoever filled it: ownership was proved by `&mut Slots`.
    ///
    /// # Errors
    ///
    /// [`SlotsError::OtherPool`] when `from` holds indices of another pool (or of this
    /// one before [`clear`](SlotPool::clear)), or `P` no longer reaches the cache's
    /// pool; nothing changed.
    pub fn free_slots(&mut self, from: &mut Slots) -> Result<usize, SlotsError> {
        let n = from.len();
        if n == 0 {
            return Ok(0);
        }
        let pool = Self::checked(&self.pool, self.id)?;
        if from.pool_id() != self.id {
            return Err(SlotsError::OtherPool);
        }
        self.stock.put(pool, from.raw_runs(), n);
        from.reset();
        crate::debug_check(pool);
        Ok(n)
    }

    /// Return the last `n` indices of `from` (the ones handed out last), as
    /// [`free_slots`](Self::free_slots) returns them all; the rest stay in `from`, in
    /// order. Returns `n`.
    ///
    /// # Errors
    ///
    /// Nothing changed on any error.
    /// * [`SlotsError::TooMany`] when `from` holds fewer than `n`;
    /// * [`SlotsError::OtherPool`] as for [`free_slots`](Self::free_slots).
    pub fn free_slots_tail(&mut self, from: &mut Slots, n: usize) -> Result<usize, SlotsError> {
        if n > from.len() {
            return Err(SlotsError::TooMany { requested: n, len: from.len() });
        }
        if n == 0 {
            return Ok(0);
        }
        let pool = Self::checked(&self.pool, self.id)?;
        if from.pool_id() != self.id {
            return Err(SlotsError::OtherPool);
        }
        let stock = &mut self.stock;
        from.take_tail(n, |runs| stock.put(pool, runs, n));
        crate::debug_check(pool);
        Ok(n)
    }

    /// Return the whole stock to the pool; returns how many indices. The next
    /// allocation draws afresh. Returns 0 and keeps the stock if `P` no longer reaches
    /// the cache's pool (another pool, or the pool after a [`clear`](SlotPool::clear)):
    /// it is not that pool's to take.
    pub fn flush(&mut self) -> usize {
        let stock = &mut self.stock;
        let n = stock.len;
        match Self::checked(&self.pool, self.id) {
            Ok(pool) if n > 0 => {
                pool.return_runs(&stock.runs[..stock.nruns], n);
                (stock.nruns, stock.len) = (0, 0);
                crate::debug_check(pool);
                n
            }
            _ => 0,
        }
    }
}

impl Stock {
    /// Pop the last `n` indices (`n <= len`) into `into` (which has room).
    #[inline]
    fn pop_into(&mut self, n: usize, into: &mut Slots) {
        if n > 0 {
            self.nruns = pop_runs(&mut self.runs, self.nruns, n, into);
            self.len -= n;
        }
    }

    /// Push `runs` (`n` indices, owned by the caller) on top, making room first by
    /// returning the most recent indices to `pool`; past the capacity, to `pool`.
    #[inline]
    fn put(&mut self, pool: &SlotPool, runs: &[(u32, u32)], n: usize) {
        let cap = self.runs.len();
        if n > cap {
            pool.return_runs(runs, n);
            return;
        }
        if self.len + n > cap {
            let spill = (self.len + n - cap / 2).min(self.len);
            take_tail(&mut self.runs, &mut self.nruns, spill, |spilt| pool.return_runs(spilt, spill));
            self.len -= spill;
        }
        // Room: every run holds an index, so `nruns <= len` and the batch's runs fit.
        self.nruns = push_runs(&mut self.runs, self.nruns, runs);
        self.len += n;
    }
}

impl<P: Deref<Target = SlotPool>> Drop for SlotCache<P> {
    /// Returns the stock to the pool ([`flush`](SlotCache::flush)); a stock whose pool
    /// `P` no longer reaches stays handed out, as a dropped [`Slots`] leaves its
    /// indices.
    fn drop(&mut self) {
        self.flush();
    }
}

impl<P: Deref<Target = SlotPool>> core::fmt::Debug for SlotCache<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotCache").field("len", &self.stock.len).field("capacity", &self.capacity()).finish()
    }
}
