//! The shared store tier (issue 12): KV pages kept in a distributed store that many
//! engine instances share, below the device pool and the host pool ([`HostKvPool`]).
//!
//! Pages are addressed by the chained SHA-256 page hash the KV events already compute
//! ([`BlockHash`], [`page_hash`](crate::radix::page_hash)): a page's hash covers every
//! token before it, so two engines that computed the same prefix name the same pages,
//! and "the first `n` pages of a request are stored" is the whole question a lookup asks
//! ([`PageStore::exists_prefix`]).
//!
//! A stored page is a [`PageHeader`] (magic, [`FORMAT_VERSION`], page size, bytes per
//! token, payload length, the page hash and store identity it was written for, a seal)
//! followed by the page's bytes in page-first order (every layer buffer's rows of the
//! page, buffer `l * B + b` after buffer `l * B + b - 1`: a
//! [`HostLayout::PageFirst`](crate::kv::host::HostLayout::PageFirst) host page as it lies
//! in memory). A value is bound to its full key ([`PageBinding`]: namespace, model id,
//! salt, page hash, format): every read checks the header against the store's binding
//! and verifies the seal (CRC-32, or HMAC-SHA-256 when the store has a [`MacKey`]); a
//! value that fails, or that was written for another key, is a miss ([`Invalid`]),
//! counted and reported, and never loaded.
//!
//! What the seal protects against: CRC-32 catches damage and values that sit under
//! the wrong key or were written by another configuration (another model, salt,
//! namespace, format or version), but anyone who can write to the store can make a
//! value with a correct CRC for any key. A MAC key also refuses every value made
//! without the key. Neither stops a holder of the key; neither hides pages from whoever
//! can read the store (values are not encrypted); and neither stops a writer from
//! deleting values or putting back a value that was once sound under the same key (a
//! MAC has no notion of time). Such a value is the page as an earlier writer of that
//! model id computed it: the same page while a model id names one set of weights, a
//! stale one if the weights change under the same model id (give a fine-tune or a new
//! checkpoint its own model id, or a new salt).
//!
//! [`PageStore`] is the interface the host tier uses: write pages once they are backed
//! up on host (`put`), and on a miss ask how many leading pages the store has
//! (`exists_prefix`), bring that many to host and load them (`get`). Each operation
//! comes in two forms: on the pages of a [`HostKvPool`] by host page number
//! (`put_host`, `get_host`; either host layout, no staging copy), and on plain byte
//! slices (`put`, `get`).
//!
//! With [`HiRadixCache`](crate::radix::HiRadixCache) the flow is: a request's prompt
//! pages that the host holds ([`host_backed_len`](crate::radix::HiRadixCache::host_backed_len))
//! and the store does not are put — write-through to the store, after the host
//! backup; a match that ends in a device and host miss asks the store for the
//! continuation, and [`insert_host`](crate::radix::HiRadixCache::insert_host) adds the
//! pages it has as a host-only node whose prefetch transfer the caller fills with `get`
//! and completes; the next match loads them back like any host hit. Writing pages to
//! the store only when the host *evicts* them (write-back) is not offered: the host
//! pages would have to stay allocated until a network write completes, so a host
//! eviction could no longer make room at once for the backup that asked for it.
//!
//! The implementation is `redis::RedisStore` (feature `redis`): Redis or Redis
//! Cluster through the `redis` crate, pipelined, with timeouts, exponential backoff and
//! automatic reconnection. The store being down, slow or full never touches device or
//! host data: the operation fails with a typed [`StoreError`] within its timeout (or at
//! once while the client backs off) and the engine carries on with device and host only.
//!
//! # Examples
//!
//! The host tier's load path, written against the trait (so any store fits):
//!
//! ```
//! use kvpool::kv::host::HostKvPool;
//! use kvpool::radix::BlockHash;
//! use kvpool::store::{PageStore, StoreError};
//!
//! /// Load the longest stored prefix of `hashes` into fresh host pages; the pages loaded.
//! fn load_prefix(store: &impl PageStore, pool: &mut HostKvPool, hashes: &[BlockHash])
//!     -> Result<Vec<u32>, StoreError>
//! {
//!     let n = store.exists_prefix(hashes)?;
//!     let mut pages = vec![0u32; n];
//!     if pool.alloc_pages(&mut pages).is_err() {
//!         return Ok(Vec::new());                   // no host room: not an error
//!     }
//!     let loaded = store.get_host(pool, &hashes[..n], &pages);
//!     let keep = loaded.as_ref().map_or(0, |l| l.pages);
//!     pool.free_pages(&pages[keep..]).expect("ours");  // a page gone since `exists_prefix`
//!     pages.truncate(keep);
//!     loaded.map(|_| pages)
//! }
//! ```
//!
//! With Redis (feature `redis`; see the `redis` module for the configuration):
//!
//! ```no_run
//! # #[cfg(feature = "redis")] {
//! use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
//! use kvpool::kv::{KvConfig, KvDtype, KvLayout};
//! use kvpool::radix::page_hash;
//! use kvpool::store::redis::{RedisStore, RedisStoreConfig};
//! use kvpool::store::{PageFormat, PageStore};
//!
//! let kv = KvConfig { layout: KvLayout::Mha { head_num: 8, head_dim: 128 }, dtype: KvDtype::Bf16,
//!                     layer_num: 32, size: 1 << 16, page_size: 16 };
//! let mut pool = HostKvPool::pageable(HostKvConfig::with_ratio(kv, 2.0, HostLayout::PageFirst)?)?;
//! let format = PageFormat::of(pool.config());
//! let store = RedisStore::new(RedisStoreConfig::new("redis://127.0.0.1:6390", "llama-3-8b", format))?;
//!
//! let first = page_hash(None, &[1; 16]);
//! let hashes = [first, page_hash(Some(&first), &[2; 16])];
//! let mut pages = [0u32; 2];
//! pool.alloc_pages(&mut pages)?;
//! store.put_host(&pool, &hashes, &pages)?;             // write-through or write-back
//! assert_eq!(store.exists_prefix(&hashes)?, 2);
//! let loaded = store.get_host(&mut pool, &hashes, &pages)?;
//! assert_eq!(loaded.pages, 2);
//! println!("{:?}", store.stats());
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use core::fmt;
use std::time::Duration;

use crate::kv::host::{HostKvError, HostKvPool};
use crate::radix::BlockHash;

mod health;
mod page;
#[cfg(feature = "redis")]
pub mod redis;

pub use health::{BackoffConfig, StoreStats, LATENCY_SAMPLES};
pub use page::{
    check_page, Invalid, MacKey, PageBinding, PageFormat, PageHeader, Seal, FORMAT_VERSION, HEADER_BYTES, PAGE_MAGIC,
};

/// A shared page store: batch operations on pages named by their chained page hash.
///
/// Methods take `&self` and may be called from any thread; an implementation serializes
/// what it must. None of them panics on bad input or a server fault.
pub trait PageStore {
    /// The format of the pages this store reads and writes.
    fn format(&self) -> PageFormat;

    /// How many leading pages of `hashes` the store holds: `n` such that `hashes[..n]`
    /// are all present and `hashes[n]` is not (it stops at the first missing page, even
    /// when later ones are there). Presence only: [`get`](Self::get) checks the values.
    /// A key the store answers with an error counts as absent.
    ///
    /// # Errors
    ///
    /// [`StoreError`] for a server fault (nothing changed anywhere).
    fn exists_prefix(&self, hashes: &[BlockHash]) -> Result<usize, StoreError>;

    /// Store `pages[i]` (page-first bytes, [`PageFormat::page_bytes`] each) under
    /// `hashes[i]`, replacing what is there. The caller's bytes are only read.
    ///
    /// # Errors
    ///
    /// [`StoreError::Shape`] for unequal lists or a page of the wrong length (nothing
    /// sent); otherwise a server fault, or [`StoreError::Server`] when the store
    /// answered some pages' writes with an error (the others were written), after which
    /// any subset of the pages may be stored, each one whole or not at all.
    fn put(&self, hashes: &[BlockHash], pages: &[&[u8]]) -> Result<(), StoreError>;

    /// Load the longest leading run of `hashes` whose values are present and sound into
    /// `pages`: `pages[i]` is overwritten for `i < loaded.pages` and nothing else is
    /// written; [`Loaded::stop`] says why it stopped early (absent, [`Invalid`], or an
    /// error reply for that page's key).
    ///
    /// # Errors
    ///
    /// [`StoreError::Shape`] for unequal lists or a buffer of the wrong length; a server
    /// fault. No page is written then.
    fn get(&self, hashes: &[BlockHash], pages: &mut [&mut [u8]]) -> Result<Loaded, StoreError>;

    /// [`put`](Self::put) of host pages `host_pages[i]` of `pool` (either layout; the
    /// pool is only read).
    ///
    /// # Errors
    ///
    /// As [`put`](Self::put); [`StoreError::Format`] when the pool's page format is not
    /// the store's, [`StoreError::Host`] for a host page out of range or not allocated
    /// (nothing sent).
    fn put_host(&self, pool: &HostKvPool, hashes: &[BlockHash], host_pages: &[u32]) -> Result<(), StoreError>;

    /// [`get`](Self::get) into host pages `host_pages[i]` of `pool`: host page
    /// `host_pages[i]` is overwritten for `i < loaded.pages`, and no other byte of the
    /// pool is written.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get), [`StoreError::Format`] and [`StoreError::Host`] as in
    /// [`put_host`](Self::put_host). No page is written then.
    fn get_host(&self, pool: &mut HostKvPool, hashes: &[BlockHash], host_pages: &[u32]) -> Result<Loaded, StoreError>;

    /// A snapshot of the client's counters.
    fn stats(&self) -> StoreStats;
}

/// What [`PageStore::get`] loaded: pages `0..pages`, and why it stopped there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Leading pages loaded.
    pub pages: usize,
    /// Why page `pages` was not loaded (`None` when all were).
    pub stop: Option<Miss>,
}

/// Why a page was not loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Miss {
    /// The store does not hold it (never stored, or evicted by the store).
    Absent,
    /// Its value was refused.
    Invalid(Invalid),
    /// The store answered its key with an error (e.g. Redis' `WRONGTYPE`: something
    /// else stored a list under the page's key). The page is a miss; the operation and
    /// the other pages go on.
    Error,
}

/// Why a store operation failed. Device and host data are never changed by a failure.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreError {
    /// The client is backing off after failures: nothing was sent. Try again after
    /// `retry_in` (the next operation after it reconnects if it must).
    Unavailable {
        /// Time left before the next try may go out.
        retry_in: Duration,
        /// Failures in a row so far.
        failures: u32,
    },
    /// The server did not answer within the configured timeout. The connection was
    /// dropped (its replies can no longer be matched) and the client backs off.
    Timeout {
        /// The timeout.
        after: Duration,
    },
    /// No connection could be made, or it broke (refused, reset, closed).
    Connection {
        /// The client's message.
        detail: String,
    },
    /// The store refused a write for lack of memory (Redis' `OOM` under `maxmemory`
    /// with a non-evicting policy). Writes back off; reads go on.
    Full {
        /// The server's message.
        detail: String,
    },
    /// The server answered with an error or an unexpected reply.
    Server {
        /// The server's or the client's message.
        detail: String,
    },
    /// A list or buffer has the wrong length.
    Shape {
        /// Which argument.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length needed.
        expected: usize,
    },
    /// A host pool's page format is not the store's.
    Format {
        /// The store's.
        store: PageFormat,
        /// The pool's.
        pool: PageFormat,
    },
    /// A host page is out of range or not allocated.
    Host(HostKvError),
    /// The configuration is unusable (no nodes, a bad URL, a zero timeout, ...).
    Config {
        /// What is wrong.
        detail: String,
    },
}

impl StoreError {
    /// Whether the error is the store's state (down, slow, full, backing off) rather
    /// than the caller's input or configuration: the engine carries on without the tier.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. }
                | StoreError::Timeout { .. }
                | StoreError::Connection { .. }
                | StoreError::Full { .. }
                | StoreError::Server { .. }
        )
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable { retry_in, failures } => {
                write!(f, "store unavailable after {failures} failures in a row; next try in {retry_in:?}")
            }
            StoreError::Timeout { after } => write!(f, "store did not answer within {after:?}"),
            StoreError::Connection { detail } => write!(f, "store connection failed: {detail}"),
            StoreError::Full { detail } => write!(f, "store is full: {detail}"),
            StoreError::Server { detail } => write!(f, "store error: {detail}"),
            StoreError::Shape { what, got, expected } => write!(f, "`{what}` has length {got}, expected {expected}"),
            StoreError::Format { store, pool } => write!(
                f,
                "host pool pages ({} tokens x {} bytes) are not the store's ({} x {})",
                pool.page_size, pool.bytes_per_token, store.page_size, store.bytes_per_token
            ),
            StoreError::Host(e) => e.fmt(f),
            StoreError::Config { detail } => write!(f, "store configuration: {detail}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Host(e) => Some(e),
            _ => None,
        }
    }
}

impl From<HostKvError> for StoreError {
    fn from(e: HostKvError) -> Self {
        StoreError::Host(e)
    }
}
