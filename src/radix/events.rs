//! KV events for KV-aware routers, and the bounded lock-free queue that carries them.
//!
//! A cache built with events on reports every change of its content, page by page:
//! [`KvEvent::BlockStored`] when a page enters the tree (with its parent page's hash,
//! so a router can rebuild the prefix chains), [`KvEvent::BlockRemoved`] when an
//! eviction frees it, [`KvEvent::AllBlocksCleared`] on construction and reset.
//!
//! Page hashes are SHA-256 over the parent page's 32 digest bytes (nothing for a
//! page at the root) followed by each token as 4 little-endian bytes — the chain
//! SGLang computes for its events.
//!
//! The queue is a bounded multi-producer multi-consumer ring (Dmitry Vyukov's design:
//! each cell carries a sequence number saying whose turn it is). The cache pushes from
//! whichever thread changes the tree; any number of router threads pop. When the ring is
//! full the event is dropped and counted ([`EventQueue::dropped`]): a router that sees the
//! count grow has missed changes and should resynchronize. Nothing allocates.

use sha2::{Digest, Sha256};

use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::UnsafeCell;
use crossbeam_utils::CachePadded;

/// A page hash: SHA-256 of the parent hash and the page's tokens.
pub type BlockHash = [u8; 32];

/// Hash of one page: `SHA-256(parent digest bytes || tokens as u32 little-endian)`.
///
/// # Examples
///
/// DESIGN.md's vectors:
///
/// ```
/// use kvpool::radix::page_hash;
/// let first = page_hash(None, &[1, 2]);
/// assert_eq!(first[..4], [0x34, 0xfb, 0x5c, 0x82]);
/// let second = page_hash(Some(&first), &[3, 4]);
/// assert_eq!(second[..4], [0xc5, 0x7b, 0x44, 0x5f]);
/// ```
pub fn page_hash(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    if let Some(p) = parent {
        h.update(p);
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The digest a namespace's first pages hash from ([`page_hash`]'s `parent` at the
/// root): `None` for namespace 0, so the default key's hashes are the plain chain, and
/// `SHA-256("kvpool namespace" || namespace as u64 little-endian)` for any other. So
/// the same tokens under two namespaces (two salts, two adapters) have different page
/// hashes all along their paths, and a store keyed by page hash never hands one
/// namespace's pages to another.
///
/// # Examples
///
/// ```
/// use kvpool::radix::{namespace_seed, page_hash};
/// assert_eq!(namespace_seed(0), None);
/// let seed = namespace_seed(7);
/// assert_ne!(page_hash(seed.as_ref(), &[1, 2]), page_hash(None, &[1, 2]));
/// ```
pub fn namespace_seed(namespace: u64) -> Option<BlockHash> {
    if namespace == 0 {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"kvpool namespace");
    h.update(namespace.to_le_bytes());
    Some(h.finalize().into())
}

/// A change of the cache's content, for routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvEvent {
    /// Everything was dropped (construction or [`reset`](super::RadixCache::reset)).
    AllBlocksCleared,
    /// A page entered the cache.
    BlockStored {
        /// The page's hash.
        hash: BlockHash,
        /// The hash of the page before it on its path (`None` at the root).
        parent: Option<BlockHash>,
        /// The page number in the KV pool.
        page: u32,
        /// The namespace (`extra_key`) it was inserted under.
        namespace: u64,
    },
    /// A page left the cache (evicted).
    BlockRemoved {
        /// The page's hash.
        hash: BlockHash,
        /// The page number it occupied.
        page: u32,
    },
}

struct Cell {
    seq: AtomicUsize,
    event: UnsafeCell<KvEvent>,
}

/// A bounded lock-free MPMC queue of [`KvEvent`]s.
pub struct EventQueue {
    cells: Box<[Cell]>,
    mask: usize,
    head: CachePadded<AtomicUsize>,
    tail: CachePadded<AtomicUsize>,
    dropped: AtomicU64,
}

// SAFETY: a cell's event is written only by the producer that won the cell (its
// `tail` compare-and-swap) and read only by the consumer that won it (`head`); the
// cell's `seq` hands it over with Release/Acquire. KvEvent is plain data.
unsafe impl Sync for EventQueue {}
// SAFETY: as above; nothing is tied to a thread.
unsafe impl Send for EventQueue {}

impl EventQueue {
    /// A queue holding up to `capacity` events (rounded up to a power of two, at least 2).
    pub fn new(capacity: usize) -> Self {
        match Self::try_new(capacity) {
            Ok(q) => q,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`new`](Self::new), with a [`ConfigError`](crate::ConfigError) instead of an abort
    /// when the capacity cannot be reserved.
    ///
    /// # Errors
    ///
    /// [`ConfigError::TooLargeForMemory`](crate::ConfigError::TooLargeForMemory) naming the bytes.
    pub fn try_new(capacity: usize) -> Result<Self, crate::ConfigError> {
        let too_large = crate::ConfigError::TooLargeForMemory { what: "the KV event queue", bytes: u64::MAX };
        let cap = capacity.max(2).checked_next_power_of_two().ok_or(too_large)?;
        let cells = super::boxed("the KV event queue", cap, |i| Cell {
            seq: AtomicUsize::new(i),
            event: UnsafeCell::new(KvEvent::AllBlocksCleared),
        })?;
        Ok(EventQueue {
            cells,
            mask: cap - 1,
            head: CachePadded::new(AtomicUsize::new(0)),
            tail: CachePadded::new(AtomicUsize::new(0)),
            dropped: AtomicU64::new(0),
        })
    }

    /// Capacity in events.
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Events dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Push an event; if the queue is full, drop it, count it, and return `false`.
    pub fn push(&self, event: KvEvent) -> bool {
        let mut pos = self.tail.load(Ordering::Relaxed);
        loop {
            let cell = &self.cells[pos & self.mask];
            // Acquire: the consumer that emptied this cell finished reading it.
            let seq = cell.seq.load(Ordering::Acquire);
            let diff = seq as isize - pos as isize;
            if diff == 0 {
                // The cell is free for lap `pos`: claim it.
                match self.tail.compare_exchange_weak(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        // SAFETY: winning the CAS on `tail` for `pos` makes us the only
                        // writer of this cell until we publish it through `seq`.
                        cell.event.with_mut(|p| unsafe { p.write(event) });
                        // Release: the consumer that sees pos + 1 sees the event.
                        cell.seq.store(pos + 1, Ordering::Release);
                        return true;
                    }
                    Err(actual) => pos = actual,
                }
            } else if diff < 0 {
                // The cell still holds an event of the previous lap: full.
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            } else {
                pos = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Pop the oldest event, if any.
    pub fn pop(&self) -> Option<KvEvent> {
        let mut pos = self.head.load(Ordering::Relaxed);
        loop {
            let cell = &self.cells[pos & self.mask];
            // Acquire: pairs with the producer's Release of pos + 1.
            let seq = cell.seq.load(Ordering::Acquire);
            let diff = seq as isize - (pos + 1) as isize;
            if diff == 0 {
                match self.head.compare_exchange_weak(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        // SAFETY: winning `head` for `pos` makes us the only reader of the
                        // event the producer published with seq = pos + 1.
                        let event = cell.event.with(|p| unsafe { p.read() });
                        // Release: the producer of the next lap may overwrite the cell.
                        cell.seq.store(pos + self.mask + 1, Ordering::Release);
                        return Some(event);
                    }
                    Err(actual) => pos = actual,
                }
            } else if diff < 0 {
                return None;
            } else {
                pos = self.head.load(Ordering::Relaxed);
            }
        }
    }

    /// Pop up to `out.len()` events into `out`; returns how many.
    pub fn drain_into(&self, out: &mut [KvEvent]) -> usize {
        let mut n = 0;
        while n < out.len() {
            match self.pop() {
                Some(e) => {
                    out[n] = e;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }
}

impl core::fmt::Debug for EventQueue {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EventQueue").field("capacity", &self.capacity()).field("dropped", &self.dropped()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn design_hash_vectors() {
        let hex = |h: &BlockHash| h.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let a = page_hash(None, &[1, 2]);
        assert_eq!(hex(&a), "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f");
        let b = page_hash(Some(&a), &[3, 4]);
        assert_eq!(hex(&b), "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c");
    }

    #[test]
    fn queue_is_fifo_and_bounded() {
        let q = EventQueue::new(3); // rounds to 4
        for page in 0..6 {
            q.push(KvEvent::BlockRemoved { hash: [0; 32], page });
        }
        assert_eq!(q.dropped(), 2);
        let pages: Vec<u32> = std::iter::from_fn(|| q.pop())
            .map(|e| match e {
                KvEvent::BlockRemoved { page, .. } => page,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(pages, [0, 1, 2, 3]);
        assert!(q.pop().is_none());
    }
}
