//! [`VecTrieCache`]: a second baseline prefix cache, in the shape of the `RadixAllocator`
//! of text-generation-inference (TGI) v3, written from its public description.
//!
//! TGI keeps its prefix cache and its block (page) allocator together:
//!
//! * a trie whose nodes own a contiguous `Vec<u32>` of tokens and a `Vec<u32>` of the
//!   pages that hold their KV; a node's children are keyed by a 64-bit hash of the first
//!   page of their tokens (at page size 1: the first token itself, so no collisions);
//! * the unlocked childless nodes in a `BTreeSet` ordered by (last access, node id) on a
//!   logical clock that ticks once per lookup or insert: the LRU order of eviction;
//! * the free pages in a plain `Vec<u32>` used as a stack;
//! * a request's tokens are inserted when it is freed (finished); the pages the trie
//!   already held for them are duplicates and go back to the free list;
//! * eviction *trims*: it takes only as many pages as it still needs from the tail of the
//!   least recently used leaf, and removes the leaf only when it needs all its pages.
//!
//! Differences from SGLang's tree (and [`ReferenceRadixCache`](super::ReferenceRadixCache))
//! that change which tokens stay cached, so hit counts may differ slightly:
//!
//! * eviction frees exactly the pages asked for (trimming) instead of whole leaves;
//! * a lookup never splits a node: a match that ends inside a node returns that node,
//!   and locking it protects the whole node (insert splits, keeping the lower half's id
//!   so that a lock handle stays valid);
//! * all nodes touched by one lookup or insert get the same timestamp (ties are broken
//!   by node id), where SGLang stamps each node with its own tick.
//!
//! Beyond TGI's shape, and needed for a cache that takes untrusted arguments, the cache
//! keeps a state per page (free, held by a caller, cached) so that bad pages, double
//! frees and stale lock handles are refused with a typed error, and it keeps a root per
//! namespace (`extra_key`: a LoRA id or cache salt), so namespaces never share nodes.
//!
//! Like the reference, it takes `&mut self` and allocates freely; share it behind a
//! mutex (the replay's `VecTrieReplayCache` does).

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::hash::{BuildHasher, RandomState};

use crate::alloc::{expand_decode, expand_extend, plan_decode, plan_extend};
use crate::error::{
    AllocError, ConfigError, FreeError, FreeErrorKind, InvalidInput, InvariantViolation, OutOfMemory, Unit,
};

/// A lock handle: the node a [`VecTrieCache::match_prefix`] ended in.
///
/// It carries the node's generation, so a handle whose node was evicted (and whose
/// arena slot may have been reused) is refused instead of locking another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VecTrieNode {
    index: u32,
    generation: u32,
}

impl VecTrieNode {
    /// The handle of an empty match: locking or unlocking it does nothing.
    pub const EMPTY: VecTrieNode = VecTrieNode { index: NONE, generation: 0 };

    /// Whether this is the handle of an empty match.
    pub fn is_empty(self) -> bool {
        self.index == NONE
    }
}

/// The result of [`VecTrieCache::match_prefix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens matched (a whole number of pages).
    pub len: usize,
    /// The node the match ended in; lock it to keep the match cached.
    pub node: VecTrieNode,
}

/// The result of [`VecTrieCache::insert`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// Leading tokens that were already cached: the caller's pages for them (beyond what
    /// it got from the cache) are duplicates, and stay the caller's to free.
    pub present: usize,
    /// The cache now holds the key up to here: it took the caller's pages for
    /// `present..stored`. Always the key's length, except after a 64-bit hash collision
    /// between two different first pages under one node (with a random hasher, about
    /// 2^-64 per pair of sibling pages), when the rest is not stored and its pages stay
    /// the caller's.
    pub stored: usize,
}

/// Why a [`VecTrieCache`] call was refused. Nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VecTrieError {
    /// A key to insert is not a whole number of pages.
    NotPageAligned {
        /// Its length in tokens.
        len: usize,
        /// The page size.
        page_size: u32,
    },
    /// A key and its pages disagree in length.
    LengthMismatch {
        /// Tokens in the key.
        tokens: usize,
        /// Pages given.
        pages: usize,
        /// The page size.
        page_size: u32,
    },
    /// A page is 0 or beyond the pool.
    BadPage {
        /// The page.
        page: u32,
    },
    /// A page the cache would take is not held by the caller (it is free, or the cache
    /// already owns it).
    PageNotHeld {
        /// The page.
        page: u32,
    },
    /// A page the cache would take is named twice.
    DuplicatePage {
        /// The page.
        page: u32,
    },
    /// A lock handle whose node no longer exists.
    StaleNode,
    /// An unlock of a node that is not locked.
    NotLocked,
    /// A cached prefix length longer than the key, or not a whole number of pages.
    BadPrefixLen {
        /// The prefix length given.
        prefix_len: usize,
        /// The key's length.
        len: usize,
    },
}

impl fmt::Display for VecTrieError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            VecTrieError::NotPageAligned { len, page_size } => {
                write!(f, "a key of {len} tokens is not a whole number of pages of {page_size}")
            }
            VecTrieError::LengthMismatch { tokens, pages, page_size } => {
                let need = tokens / page_size.max(1) as usize;
                write!(f, "{tokens} tokens need {need} pages of {page_size}, but {pages} were given")
            }
            VecTrieError::BadPage { page } => write!(f, "page {page} is 0 or beyond the pool"),
            VecTrieError::PageNotHeld { page } => {
                write!(f, "page {page} is not held by the caller (it is free, or already cached)")
            }
            VecTrieError::DuplicatePage { page } => write!(f, "page {page} is named twice"),
            VecTrieError::StaleNode => f.write_str("the lock handle's node no longer exists"),
            VecTrieError::NotLocked => f.write_str("unlock of a node that is not locked"),
            VecTrieError::BadPrefixLen { prefix_len, len } => {
                write!(f, "cached prefix length {prefix_len} is not a whole number of pages within the key's {len}")
            }
        }
    }
}

impl std::error::Error for VecTrieError {}

/// "No node": the parent of a namespace root, the index of [`VecTrieNode::EMPTY`].
const NONE: u32 = u32::MAX;

/// Who owns a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageState {
    /// On the free list.
    Free,
    /// Handed out to a caller.
    Held,
    /// Owned by a trie node.
    Cached,
    /// Held, and seen once by the duplicate check in progress.
    Seen,
}

#[derive(Debug)]
struct Node {
    /// `NONE` for a namespace root.
    parent: u32,
    /// First-page hash -> child.
    children: HashMap<u64, u32>,
    /// Tokens, a whole number of pages (empty for a root).
    key: Vec<u32>,
    /// The pages holding `key`'s KV, one per page of tokens.
    pages: Vec<u32>,
    last_access: u64,
    lock_ref: u32,
    /// Bumped when the node is removed, so stale handles are refused.
    generation: u32,
    alive: bool,
}

/// A TGI-style prefix cache and page allocator (see the module docs).
///
/// Pages are numbered from 1 (page 0 is the reserved padding page); page `p` holds slots
/// `p * page_size .. (p + 1) * page_size`, as with [`PagedAllocator`](crate::PagedAllocator).
/// The trie works in pages; [`alloc_extend`](Self::alloc_extend),
/// [`alloc_decode`](Self::alloc_decode) and [`free_slots`](Self::free_slots) speak slots.
///
/// # Examples
///
/// A request caches its prompt when it finishes; the next request with the same first
/// page hits it:
///
/// ```
/// use kvpool::baseline::VecTrieCache;
///
/// let mut cache = VecTrieCache::new(64, 4)?; // 16 pages of 4 tokens
/// let prompt: Vec<u32> = (100..110).collect();
///
/// // First request: nothing cached; allocate its 10 tokens (3 pages).
/// let mut pages = Vec::new();
/// let m = cache.match_prefix(0, &prompt, &mut pages);
/// assert_eq!(m.len, 0);
/// cache.lock(m.node)?;
/// let mut slots = vec![0u32; 10];
/// cache.alloc_extend(&[0], &[10], &[0], &mut slots)?;
/// assert_eq!(slots, [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]); // pages 1, 2, 3
///
/// // It finishes: its two whole pages are cached, the 2-token tail page is freed.
/// let whole: Vec<u32> = slots[..8].chunks(4).map(|p| p[0] / 4).collect();
/// cache.finish(0, &prompt[..8], &whole, m.len, m.node)?;
/// cache.free_slots(&slots[8..])?;
/// assert_eq!((cache.cached_tokens(), cache.available_pages()), (8, 14));
///
/// // Second request: the two pages hit.
/// pages.clear();
/// let m = cache.match_prefix(0, &prompt, &mut pages);
/// assert_eq!((m.len, pages.as_slice()), (8, &[1, 2][..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct VecTrieCache<S = RandomState> {
    page_size: u32,
    num_pages: u32,
    /// Free pages, a stack: pages are taken from the end.
    free_pages: Vec<u32>,
    /// One state per page number (index 0, the padding page, is never used).
    page_state: Vec<PageState>,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Namespace -> its root node.
    roots: HashMap<u64, u32>,
    /// Unlocked childless non-root nodes, by (last access, id): the LRU order.
    leaves: BTreeSet<(u64, u32)>,
    clock: u64,
    hasher: S,
    evictable: usize,
    protected: usize,
    /// Scratch for insert's walk (the nodes to touch).
    path: Vec<u32>,
}

impl VecTrieCache<RandomState> {
    /// A cache of `capacity_tokens / page_size` pages (a remainder is unused), hashing
    /// first pages with a randomly keyed SipHash.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPageSize`] if `page_size` is 0, [`ConfigError::Zero`] if there
    /// is not one whole page, [`ConfigError::TooLarge`] if the slot numbers would
    /// overflow `u32`.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::VecTrieCache;
    /// use kvpool::ConfigError;
    /// assert_eq!(VecTrieCache::new(1024, 16)?.num_pages(), 64);
    /// assert_eq!(VecTrieCache::new(1024, 0).unwrap_err(), ConfigError::ZeroPageSize);
    /// # Ok::<(), ConfigError>(())
    /// ```
    pub fn new(capacity_tokens: usize, page_size: u32) -> Result<Self, ConfigError> {
        Self::with_hasher(capacity_tokens, page_size, RandomState::new())
    }
}

impl<S: BuildHasher> VecTrieCache<S> {
    /// As [`new`](VecTrieCache::new), hashing first pages (when `page_size > 1`) with
    /// `hasher`.
    ///
    /// # Errors
    ///
    /// As [`new`](VecTrieCache::new).
    pub fn with_hasher(capacity_tokens: usize, page_size: u32, hasher: S) -> Result<Self, ConfigError> {
        if page_size == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        let num_pages = capacity_tokens as u64 / page_size as u64;
        if num_pages == 0 {
            return Err(ConfigError::Zero("capacity in whole pages"));
        }
        // The highest slot is (num_pages + 1) * page_size - 1.
        if (num_pages + 1) * page_size as u64 > u32::MAX as u64 + 1 {
            return Err(ConfigError::TooLarge { size: capacity_tokens as u64, page_size });
        }
        let num_pages = num_pages as u32;
        Ok(VecTrieCache {
            page_size,
            num_pages,
            // Reversed, so that a fresh pool hands out pages 1, 2, 3, ...
            free_pages: (1..=num_pages).rev().collect(),
            page_state: vec![PageState::Free; num_pages as usize + 1],
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            leaves: BTreeSet::new(),
            clock: 0,
            hasher,
            evictable: 0,
            protected: 0,
            path: Vec::new(),
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Pages in the pool (numbered `1..=num_pages`).
    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Free pages now.
    pub fn available_pages(&self) -> usize {
        self.free_pages.len()
    }

    /// Tokens cached in the trie.
    pub fn cached_tokens(&self) -> usize {
        self.evictable + self.protected
    }

    /// Cached tokens in unlocked nodes (what eviction can free).
    pub fn evictable_tokens(&self) -> usize {
        self.evictable
    }

    /// Cached tokens in locked nodes.
    pub fn protected_tokens(&self) -> usize {
        self.protected
    }

    /// Nodes holding tokens (namespace roots not counted).
    pub fn node_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.alive && n.parent != NONE).count()
    }

    #[inline]
    fn ps(&self) -> usize {
        self.page_size as usize
    }

    /// The page of `slot` (a shift for power-of-two page sizes: this runs per slot).
    #[inline]
    pub fn page_of(&self, slot: u32) -> u32 {
        if self.page_size.is_power_of_two() {
            slot >> self.page_size.trailing_zeros()
        } else {
            slot / self.page_size
        }
    }

    /// The child-map key of a page of tokens: the token itself at page size 1 (exact),
    /// otherwise the page's hash.
    #[inline]
    fn child_key(&self, page: &[u32]) -> u64 {
        if self.page_size == 1 {
            page[0] as u64
        } else {
            self.hasher.hash_one(page)
        }
    }

    /// Leading tokens `a` and `b` share, in whole pages (both are whole pages long, or
    /// the shorter one's tail is ignored).
    #[inline]
    fn shared_prefix(&self, a: &[u32], b: &[u32]) -> usize {
        let ps = self.ps();
        if ps == 1 {
            // Compare 32 tokens at a time (memcmp), then token by token.
            let n = a.len().min(b.len());
            let mut i = 0;
            while i + 32 <= n && a[i..i + 32] == b[i..i + 32] {
                i += 32;
            }
            while i < n && a[i] == b[i] {
                i += 1;
            }
            i
        } else {
            a.chunks_exact(ps).zip(b.chunks_exact(ps)).take_while(|(x, y)| x == y).count() * ps
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    #[inline]
    fn is_leaf(&self, n: u32) -> bool {
        let x = &self.nodes[n as usize];
        x.parent != NONE && x.lock_ref == 0 && x.children.is_empty()
    }

    /// Stamp `n` with `now`, moving it in the LRU order if it is a leaf.
    fn touch(&mut self, n: u32, now: u64) {
        let old = self.nodes[n as usize].last_access;
        if old == now {
            return;
        }
        if self.is_leaf(n) {
            self.leaves.remove(&(old, n));
            self.leaves.insert((now, n));
        }
        self.nodes[n as usize].last_access = now;
    }

    fn new_node(&mut self, parent: u32, key: &[u32], pages: &[u32], now: u64) -> u32 {
        match self.free_nodes.pop() {
            Some(id) => {
                let n = &mut self.nodes[id as usize];
                n.parent = parent;
                n.key.extend_from_slice(key);
                n.pages.extend_from_slice(pages);
                n.last_access = now;
                n.lock_ref = 0;
                n.alive = true;
                id
            }
            None => {
                let id = self.nodes.len() as u32;
                self.nodes.push(Node {
                    parent,
                    children: HashMap::new(),
                    key: key.to_vec(),
                    pages: pages.to_vec(),
                    last_access: now,
                    lock_ref: 0,
                    generation: 0,
                    alive: true,
                });
                id
            }
        }
    }

    fn handle(&self, n: u32) -> VecTrieNode {
        VecTrieNode { index: n, generation: self.nodes[n as usize].generation }
    }

    /// The node of a handle, if it is still alive (`None` for the empty handle).
    fn resolve(&self, node: VecTrieNode) -> Result<Option<u32>, VecTrieError> {
        if node.is_empty() {
            return Ok(None);
        }
        match self.nodes.get(node.index as usize) {
            Some(n) if n.alive && n.generation == node.generation => Ok(Some(node.index)),
            _ => Err(VecTrieError::StaleNode),
        }
    }

    /// Longest cached page-aligned prefix of `key` in `namespace`: appends its pages to
    /// `pages` and returns its length and the node it ended in. Refreshes the recency of
    /// every node it touches (one clock tick for the whole lookup). Never splits.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::VecTrieCache;
    /// let mut cache = VecTrieCache::new(64, 2)?;
    /// let mut pages = [0u32; 2];
    /// cache.alloc_pages(&mut pages)?;
    /// cache.insert(7, &[1, 2, 3, 4], &pages)?;
    /// let mut hit = Vec::new();
    /// // 5 tokens are cut to 2 pages; the second page differs.
    /// assert_eq!(cache.match_prefix(7, &[1, 2, 3, 9, 5], &mut hit).len, 2);
    /// assert_eq!(hit, [pages[0]]);
    /// // Another namespace shares nothing.
    /// assert_eq!(cache.match_prefix(8, &[1, 2, 3, 4], &mut hit).len, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn match_prefix(&mut self, namespace: u64, key: &[u32], pages: &mut Vec<u32>) -> PrefixMatch {
        let ps = self.ps();
        let key = &key[..key.len() / ps * ps];
        let empty = PrefixMatch { len: 0, node: VecTrieNode::EMPTY };
        let Some(&root) = self.roots.get(&namespace) else { return empty };
        if key.is_empty() {
            return empty;
        }
        let now = self.tick();
        let (mut cur, mut at, mut last) = (root, 0, NONE);
        while at < key.len() {
            let h = self.child_key(&key[at..at + ps]);
            let Some(&child) = self.nodes[cur as usize].children.get(&h) else { break };
            let c = &self.nodes[child as usize];
            let shared = self.shared_prefix(&c.key, &key[at..]);
            if shared == 0 {
                break; // a hash collision: a different first page
            }
            pages.extend_from_slice(&c.pages[..shared / ps]);
            let whole = shared == c.key.len();
            self.touch(child, now);
            at += shared;
            last = child;
            if !whole {
                break;
            }
            cur = child;
        }
        if last == NONE {
            return empty;
        }
        PrefixMatch { len: at, node: self.handle(last) }
    }

    /// As [`match_prefix`](Self::match_prefix) without changing anything (no recency
    /// refresh): a router's look-up. Appends the pages and returns the length.
    pub fn peek_prefix(&self, namespace: u64, key: &[u32], pages: &mut Vec<u32>) -> usize {
        let ps = self.ps();
        let key = &key[..key.len() / ps * ps];
        let Some(&root) = self.roots.get(&namespace) else { return 0 };
        let (mut cur, mut at) = (root, 0);
        while at < key.len() {
            let Some(&child) = self.nodes[cur as usize].children.get(&self.child_key(&key[at..at + ps])) else {
                break;
            };
            let c = &self.nodes[child as usize];
            let shared = self.shared_prefix(&c.key, &key[at..]);
            pages.extend_from_slice(&c.pages[..shared / ps]);
            at += shared;
            if shared < c.key.len() {
                break;
            }
            cur = child;
        }
        at
    }

    /// Lock the path from `node` up to its namespace root against eviction. The empty
    /// handle is accepted and locks nothing.
    ///
    /// # Errors
    ///
    /// [`VecTrieError::StaleNode`] if the node was evicted.
    pub fn lock(&mut self, node: VecTrieNode) -> Result<(), VecTrieError> {
        let Some(mut n) = self.resolve(node)? else { return Ok(()) };
        while self.nodes[n as usize].parent != NONE {
            if self.nodes[n as usize].lock_ref == 0 {
                let x = &self.nodes[n as usize];
                let len = x.key.len();
                if x.children.is_empty() {
                    self.leaves.remove(&(x.last_access, n));
                }
                self.evictable -= len;
                self.protected += len;
            }
            let x = &mut self.nodes[n as usize];
            x.lock_ref += 1;
            n = x.parent;
        }
        Ok(())
    }

    /// Undo one [`lock`](Self::lock) of `node`.
    ///
    /// # Errors
    ///
    /// [`VecTrieError::StaleNode`] if the node no longer exists,
    /// [`VecTrieError::NotLocked`] if it is not locked.
    pub fn unlock(&mut self, node: VecTrieNode) -> Result<(), VecTrieError> {
        let Some(n) = self.resolve(node)? else { return Ok(()) };
        if self.nodes[n as usize].lock_ref == 0 {
            return Err(VecTrieError::NotLocked);
        }
        self.unlock_path(n);
        Ok(())
    }

    /// A lock count along a path never increases towards the leaves, so a locked node's
    /// ancestors are all locked and this cannot underflow.
    fn unlock_path(&mut self, mut n: u32) {
        while self.nodes[n as usize].parent != NONE {
            let x = &mut self.nodes[n as usize];
            x.lock_ref -= 1;
            let parent = x.parent;
            if x.lock_ref == 0 {
                let len = x.key.len();
                if x.children.is_empty() {
                    let t = x.last_access;
                    self.leaves.insert((t, n));
                }
                self.evictable += len;
                self.protected -= len;
            }
            n = parent;
        }
    }

    /// Whether pages are in range and held by the caller, each named once.
    fn check_held(&mut self, pages: &[u32]) -> Result<(), VecTrieError> {
        check_held(&mut self.page_state, pages)
    }

    /// Insert `key -> pages` (one page per `page_size` tokens) into `namespace`. Returns
    /// how many leading tokens were already cached and how far the key is now stored
    /// (see [`Inserted`]): the cache takes the caller's pages for `present..stored`;
    /// the caller keeps (and frees) the rest. Splits a node where the key leaves it.
    ///
    /// # Errors
    ///
    /// [`VecTrieError::NotPageAligned`], [`VecTrieError::LengthMismatch`] for a bad
    /// shape; [`VecTrieError::BadPage`], [`VecTrieError::PageNotHeld`],
    /// [`VecTrieError::DuplicatePage`] if a page the cache would take is out of range,
    /// not held by the caller, or named twice. Nothing changes on error.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::baseline::VecTrieCache;
    /// let mut cache = VecTrieCache::new(16, 1)?;
    /// let mut a = [0u32; 3];
    /// cache.alloc_pages(&mut a)?;
    /// assert_eq!(cache.insert(0, &[1, 2, 3], &a)?.present, 0);
    /// let mut b = [0u32; 4];
    /// cache.alloc_pages(&mut b)?;
    /// let r = cache.insert(0, &[1, 2, 7, 8], &b)?;
    /// assert_eq!((r.present, r.stored), (2, 4));
    /// cache.free_slots(&b[..2])?; // the duplicates are the caller's to free
    /// assert_eq!(cache.cached_tokens(), 5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn insert(&mut self, namespace: u64, key: &[u32], pages: &[u32]) -> Result<Inserted, VecTrieError> {
        self.insert_inner(namespace, key, pages, usize::MAX)
    }

    /// [`insert`](Self::insert), where the caller already checked that the pages of
    /// `key[checked_from..]` are held and distinct (`usize::MAX`: nothing checked).
    fn insert_inner(
        &mut self,
        namespace: u64,
        key: &[u32],
        pages: &[u32],
        checked_from: usize,
    ) -> Result<Inserted, VecTrieError> {
        let ps = self.ps();
        if key.len() % ps != 0 {
            return Err(VecTrieError::NotPageAligned { len: key.len(), page_size: self.page_size });
        }
        if key.len() / ps != pages.len() {
            return Err(VecTrieError::LengthMismatch {
                tokens: key.len(),
                pages: pages.len(),
                page_size: self.page_size,
            });
        }
        // Walk without changing anything: the path, where the key leaves the trie, and
        // whether the rest can be stored.
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        let root = self.roots.get(&namespace).copied();
        let (mut cur, mut at) = (root.unwrap_or(NONE), 0);
        let mut split = None;
        let mut blocked = false;
        while cur != NONE && at < key.len() {
            let Some(&child) = self.nodes[cur as usize].children.get(&self.child_key(&key[at..at + ps])) else {
                break;
            };
            let c = &self.nodes[child as usize];
            let shared = self.shared_prefix(&c.key, &key[at..]);
            if shared == 0 {
                blocked = true; // a hash collision: this node's slot for the page is taken
                break;
            }
            path.push(child);
            at += shared;
            if shared < c.key.len() {
                if at < key.len() {
                    // The new leaf goes under the upper half of a split; its first page
                    // must not collide with the lower half's.
                    if self.child_key(&c.key[shared..shared + ps]) == self.child_key(&key[at..at + ps]) {
                        blocked = true;
                    } else {
                        split = Some((child, shared));
                    }
                }
                break;
            }
            cur = child;
        }
        let present = at;
        let stored = if blocked { present } else { key.len() };
        if present < checked_from {
            if let Err(e) = self.check_held(&pages[present / ps..stored / ps]) {
                self.path = path;
                return Err(e);
            }
        }

        // Commit: one tick for the whole insert.
        let now = self.tick();
        for &n in &path {
            self.touch(n, now);
        }
        self.path = path;
        if stored > present {
            // The new leaf hangs under the split's upper half, or the last node the key
            // went through whole, or (nothing matched) the namespace root.
            let parent = match (split, self.path.last(), root) {
                (Some((child, shared)), _, _) => self.split(child, shared, now),
                (None, Some(&n), _) => n,
                (None, None, Some(r)) => r,
                (None, None, None) => {
                    let r = self.new_node(NONE, &[], &[], now);
                    self.roots.insert(namespace, r);
                    r
                }
            };
            if self.is_leaf(parent) {
                let t = self.nodes[parent as usize].last_access;
                self.leaves.remove(&(t, parent));
            }
            let leaf = self.new_node(parent, &key[present..], &pages[present / ps..], now);
            let h = self.child_key(&key[present..present + ps]);
            self.nodes[parent as usize].children.insert(h, leaf);
            self.leaves.insert((now, leaf));
            self.evictable += stored - present;
            set_states(&mut self.page_state, &pages[present / ps..], PageState::Cached);
        }
        Ok(Inserted { present, stored })
    }

    /// Split `n` after `at` tokens: a new upper node takes the first `at` tokens and
    /// `n` keeps the rest (and its id, so lock handles on it stay valid). The upper
    /// node inherits the lock count; returns it.
    fn split(&mut self, n: u32, at: usize, now: u64) -> u32 {
        let ps = self.ps();
        let x = &mut self.nodes[n as usize];
        let lower_key = x.key.split_off(at);
        let lower_pages = x.pages.split_off(at / ps);
        let upper_key = std::mem::replace(&mut x.key, lower_key);
        let upper_pages = std::mem::replace(&mut x.pages, lower_pages);
        let (parent, lock_ref) = (x.parent, x.lock_ref);
        let upper = self.new_node(parent, &[], &[], now);
        let lower_h = self.child_key(&self.nodes[n as usize].key[..ps]);
        let upper_h = self.child_key(&upper_key[..ps]);
        let u = &mut self.nodes[upper as usize];
        u.key = upper_key;
        u.pages = upper_pages;
        u.lock_ref = lock_ref;
        u.children.insert(lower_h, n);
        self.nodes[n as usize].parent = upper;
        self.nodes[parent as usize].children.insert(upper_h, upper);
        upper
    }

    /// TGI's free of a finished request: insert `key -> pages` (whole pages), give the
    /// caller's duplicate pages (`prefix_len..present`) and any pages the cache could not
    /// store back to the free list, and unlock `node`. `prefix_len` is how much of the
    /// key the request got from the cache (its [`PrefixMatch::len`]); the pages beyond
    /// it must be the request's own. Returns how many leading tokens were already cached.
    /// The unaligned tail of the request is not part of `key`: free it with
    /// [`free_slots`](Self::free_slots).
    ///
    /// # Errors
    ///
    /// As [`insert`](Self::insert) (every page past `prefix_len` must be held by the
    /// caller), [`VecTrieError::BadPrefixLen`], and as [`unlock`](Self::unlock).
    /// Nothing changes on error.
    pub fn finish(
        &mut self,
        namespace: u64,
        key: &[u32],
        pages: &[u32],
        prefix_len: usize,
        node: VecTrieNode,
    ) -> Result<usize, VecTrieError> {
        let ps = self.ps();
        if prefix_len > key.len() || prefix_len % ps != 0 {
            return Err(VecTrieError::BadPrefixLen { prefix_len, len: key.len() });
        }
        let locked = self.resolve(node)?;
        if let Some(n) = locked {
            if self.nodes[n as usize].lock_ref == 0 {
                return Err(VecTrieError::NotLocked);
            }
        }
        let checked_from = if key.len() % ps == 0 && key.len() / ps == pages.len() {
            self.check_held(&pages[prefix_len / ps..])?;
            prefix_len
        } else {
            usize::MAX
        };
        let r = self.insert_inner(namespace, key, pages, checked_from)?;
        // The locked prefix stays cached, so `present >= prefix_len`.
        let dup = prefix_len.min(r.present) / ps..r.present / ps;
        self.release_pages(&pages[dup]);
        self.release_pages(&pages[r.stored / ps..]);
        if let Some(n) = locked {
            self.unlock_path(n);
        }
        Ok(r.present)
    }

    /// Held pages back to the free list (already validated).
    fn release_pages(&mut self, pages: &[u32]) {
        self.free_pages.extend_from_slice(pages);
        set_states(&mut self.page_state, pages, PageState::Free);
    }

    /// Evict at least `num_pages` pages if that many are evictable: least recently used
    /// leaf first, taking only the pages still needed from a leaf's tail (trimming it)
    /// and removing a leaf only when all its pages go; a parent left unlocked and
    /// childless becomes a leaf. Returns the pages freed (exactly `num_pages` unless
    /// fewer were evictable).
    pub fn evict(&mut self, num_pages: usize) -> usize {
        let ps = self.ps();
        let mut freed = 0;
        while freed < num_pages {
            let Some((t, n)) = self.leaves.pop_first() else { break };
            let need = num_pages - freed;
            let have = self.nodes[n as usize].pages.len();
            if need < have {
                let keep = have - need;
                let x = &mut self.nodes[n as usize];
                x.key.truncate(keep * ps);
                self.free_pages.extend_from_slice(&x.pages[keep..]);
                set_states(&mut self.page_state, &x.pages[keep..], PageState::Free);
                x.pages.truncate(keep);
                self.evictable -= need * ps;
                self.leaves.insert((t, n));
                freed += need;
                break;
            }
            self.remove_leaf(n);
            freed += have;
        }
        freed
    }

    /// Remove a leaf (already out of `leaves`): its pages go free, its parent may become
    /// a leaf.
    fn remove_leaf(&mut self, n: u32) {
        let ps = self.ps();
        let h = self.child_key(&self.nodes[n as usize].key[..ps]);
        let x = &mut self.nodes[n as usize];
        let pages = std::mem::take(&mut x.pages);
        let len = x.key.len();
        x.key.clear();
        x.alive = false;
        x.generation = x.generation.wrapping_add(1);
        let parent = x.parent;
        self.release_pages(&pages);
        // Keep the page vector's capacity for the next node in this slot.
        let mut pages = pages;
        pages.clear();
        self.nodes[n as usize].pages = pages;
        self.evictable -= len;
        self.nodes[parent as usize].children.remove(&h);
        self.free_nodes.push(n);
        if self.is_leaf(parent) {
            let t = self.nodes[parent as usize].last_access;
            self.leaves.insert((t, parent));
        }
    }

    /// Allocate `pages.len()` fresh pages into `pages`, all or nothing, without evicting.
    /// Pages come off the end of the free list, so a fresh pool hands out 1, 2, 3, ...
    ///
    /// # Errors
    ///
    /// [`OutOfMemory`] (in pages, with the evictable pages) if too few are free.
    pub fn alloc_pages(&mut self, pages: &mut [u32]) -> Result<(), OutOfMemory> {
        let n = pages.len();
        if n > self.free_pages.len() {
            return Err(OutOfMemory {
                requested: n,
                available: self.free_pages.len(),
                evictable: Some(self.evictable / self.ps()),
                unit: Unit::Pages,
            });
        }
        let start = self.free_pages.len() - n;
        for (out, &p) in pages.iter_mut().zip(self.free_pages[start..].iter().rev()) {
            *out = p;
        }
        set_states(&mut self.page_state, pages, PageState::Held);
        self.free_pages.truncate(start);
        Ok(())
    }

    /// Whether `last_loc` is a held slot at the position of token `prefix - 1` in its page.
    fn check_last_loc(&self, request: usize, prefix: u32, last_loc: u32) -> Result<(), InvalidInput> {
        let ps = self.page_size;
        let page = last_loc / ps;
        let ok = last_loc % ps == (prefix - 1) % ps
            && page >= 1
            && page <= self.num_pages
            && self.page_state[page as usize] == PageState::Held;
        if ok {
            Ok(())
        } else {
            Err(InvalidInput::BadLastLoc { request, last_loc })
        }
    }

    fn out_of_memory(&self, pages: usize) -> AllocError {
        let ps = self.ps();
        AllocError::OutOfMemory(OutOfMemory {
            requested: pages * ps,
            available: self.free_pages.len() * ps,
            evictable: None,
            unit: Unit::Tokens,
        })
    }

    /// Take `n` pages off the free list as an ordered slice for an expansion, and
    /// expand; commits only if the expansion succeeds.
    fn take_and_expand<F>(&mut self, n: usize, expand: F) -> Result<(), AllocError>
    where
        F: FnOnce(&[u32]) -> Result<(), InvalidInput>,
    {
        let start = self.free_pages.len() - n;
        // Popping order: the last free page first.
        self.free_pages[start..].reverse();
        if let Err(e) = expand(&self.free_pages[start..]) {
            self.free_pages[start..].reverse();
            return Err(e.into());
        }
        set_states(&mut self.page_state, &self.free_pages[start..], PageState::Held);
        self.free_pages.truncate(start);
        Ok(())
    }

    /// Allocate the new slots of an extend (prefill) batch, all or nothing, with
    /// SGLang's page semantics (DESIGN.md, "Extend and decode on pages"), through
    /// [`expand_extend`]. Does not evict.
    ///
    /// # Errors
    ///
    /// [`AllocError::Invalid`] for a malformed batch (see
    /// [`plan_extend`]), a wrong `out` length, or a
    /// `last_loc` that part 1 reads and that is not a held slot at the right position
    /// of its page; [`AllocError::OutOfMemory`] (in tokens) when too few pages are free.
    /// Nothing changes on error.
    ///
    /// # Examples
    ///
    /// DESIGN.md's worked example:
    ///
    /// ```
    /// use kvpool::baseline::VecTrieCache;
    /// let mut cache = VecTrieCache::new(256, 4)?;
    /// let mut first = [0u32; 2];
    /// cache.alloc_pages(&mut first)?; // pages 1 and 2
    /// let mut out = [0u32; 9];
    /// cache.alloc_extend(&[1, 3], &[6, 7], &[4, 10], &mut out)?;
    /// assert_eq!(out, [5, 6, 7, 12, 13, 11, 16, 17, 18]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_extend(
        &mut self,
        prefix_lens: &[u32],
        seq_lens: &[u32],
        last_locs: &[u32],
        out: &mut [u32],
    ) -> Result<(), AllocError> {
        let ps = self.page_size;
        let plan = plan_extend(ps, prefix_lens, seq_lens)?;
        if last_locs.len() != seq_lens.len() {
            let e = InvalidInput::LengthMismatch { what: "last_locs", got: last_locs.len(), expected: seq_lens.len() };
            return Err(e.into());
        }
        if out.len() != plan.new_tokens {
            return Err(InvalidInput::OutputLength { got: out.len(), expected: plan.new_tokens }.into());
        }
        for (i, (&prefix, &seq)) in prefix_lens.iter().zip(seq_lens).enumerate() {
            if prefix % ps != 0 && seq > prefix {
                self.check_last_loc(i, prefix, last_locs[i])?;
            }
        }
        if plan.new_pages > self.free_pages.len() {
            return Err(self.out_of_memory(plan.new_pages));
        }
        self.take_and_expand(plan.new_pages, |pages| expand_extend(ps, prefix_lens, seq_lens, last_locs, pages, out))
    }

    /// Allocate one slot per request of a decode batch (`seq_lens[i]` counts the new
    /// token), through [`expand_decode`]. Does not evict.
    ///
    /// # Errors
    ///
    /// As [`alloc_extend`](Self::alloc_extend), with
    /// [`plan_decode`]'s validation.
    pub fn alloc_decode(&mut self, seq_lens: &[u32], last_locs: &[u32], out: &mut [u32]) -> Result<(), AllocError> {
        let ps = self.page_size;
        let plan = plan_decode(ps, seq_lens)?;
        if last_locs.len() != seq_lens.len() {
            let e = InvalidInput::LengthMismatch { what: "last_locs", got: last_locs.len(), expected: seq_lens.len() };
            return Err(e.into());
        }
        if out.len() != plan.new_tokens {
            return Err(InvalidInput::OutputLength { got: out.len(), expected: plan.new_tokens }.into());
        }
        for (i, &seq) in seq_lens.iter().enumerate() {
            let prefix = seq - 1;
            if prefix % ps != 0 {
                self.check_last_loc(i, prefix, last_locs[i])?;
            }
        }
        if plan.new_pages > self.free_pages.len() {
            return Err(self.out_of_memory(plan.new_pages));
        }
        self.take_and_expand(plan.new_pages, |pages| expand_decode(ps, seq_lens, last_locs, pages, out))
    }

    /// Free slots the caller holds: the distinct pages they lie in go back to the free
    /// list (listing one slot of a page frees the whole page).
    ///
    /// # Errors
    ///
    /// [`FreeError`] naming the first slot whose page is out of range
    /// ([`FreeErrorKind::OutOfRange`]) or not held by the caller
    /// ([`FreeErrorKind::NotAllocated`]: free, or owned by the cache); nothing is freed
    /// then.
    pub fn free_slots(&mut self, slots: &[u32]) -> Result<(), FreeError> {
        let ps = self.page_size;
        for &s in slots {
            let page = self.page_of(s);
            let kind = if page == 0 || page > self.num_pages {
                let last = ((self.num_pages as u64 + 1) * ps as u64 - 1) as u32;
                FreeErrorKind::OutOfRange { first: ps, last }
            } else if self.page_state[page as usize] != PageState::Held {
                FreeErrorKind::NotAllocated
            } else {
                continue;
            };
            return Err(FreeError { index: s, kind, rest_freed: false });
        }
        for &s in slots {
            let page = self.page_of(s);
            if self.page_state[page as usize] == PageState::Held {
                self.page_state[page as usize] = PageState::Free;
                self.free_pages.push(page);
            }
        }
        Ok(())
    }

    /// Every cached (namespace, tokens, pages) path from a root to each leaf, sorted: a
    /// view for tests that does not depend on the node layout.
    pub fn leaf_paths(&self) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        for (&ns, &root) in &self.roots {
            let mut stack = vec![(root, Vec::new(), Vec::new())];
            while let Some((n, k, v)) = stack.pop() {
                let x = &self.nodes[n as usize];
                if x.children.is_empty() && x.parent != NONE {
                    out.push((ns, k.clone(), v.clone()));
                }
                for &c in x.children.values() {
                    let (mut k2, mut v2) = (k.clone(), v.clone());
                    k2.extend_from_slice(&self.nodes[c as usize].key);
                    v2.extend_from_slice(&self.nodes[c as usize].pages);
                    stack.push((c, k2, v2));
                }
            }
        }
        out.sort();
        out
    }

    /// Check the whole structure: page states against the free list and the nodes,
    /// child maps against parents and first pages, lock counts along paths, the leaf
    /// set, and the evictable and protected counts. O(pages + nodes).
    ///
    /// # Errors
    ///
    /// [`InvariantViolation`] describing the first inconsistency.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let bad = |m: String| Err(InvariantViolation(format!("vec trie: {m}")));
        let ps = self.ps();
        let mut state = vec![None::<PageState>; self.num_pages as usize + 1];
        for &p in &self.free_pages {
            if p == 0 || p > self.num_pages || state[p as usize].is_some() {
                return bad(format!("free list holds page {p} twice or out of range"));
            }
            state[p as usize] = Some(PageState::Free);
        }
        let (mut evictable, mut protected, mut leaves) = (0, 0, 0);
        for (i, x) in self.nodes.iter().enumerate() {
            let i = i as u32;
            if !x.alive {
                continue;
            }
            if x.parent == NONE {
                if !x.key.is_empty() || !x.pages.is_empty() {
                    return bad(format!("root {i} holds tokens"));
                }
            } else {
                if x.key.is_empty() || x.key.len() != x.pages.len() * ps {
                    return bad(format!("node {i}: {} tokens, {} pages", x.key.len(), x.pages.len()));
                }
                let p = &self.nodes[x.parent as usize];
                if !p.alive || p.children.get(&self.child_key(&x.key[..ps])) != Some(&i) {
                    return bad(format!("node {i} is not its parent's child under its first page"));
                }
                if p.parent != NONE && p.lock_ref < x.lock_ref {
                    return bad(format!("node {i} is locked more than its parent"));
                }
                if x.lock_ref == 0 {
                    evictable += x.key.len();
                } else {
                    protected += x.key.len();
                }
                let in_leaves = self.leaves.contains(&(x.last_access, i));
                if in_leaves != self.is_leaf(i) {
                    return bad(format!("node {i}: in the leaf set {in_leaves}, is an unlocked leaf {}", !in_leaves));
                }
                leaves += in_leaves as usize;
            }
            for &c in x.children.values() {
                let c = &self.nodes[c as usize];
                if !c.alive || c.parent != i {
                    return bad(format!("node {i} has a dead or foreign child"));
                }
            }
            for &p in &x.pages {
                if p == 0 || p > self.num_pages || state[p as usize].is_some() {
                    return bad(format!("page {p} is cached twice, also free, or out of range"));
                }
                if self.page_state[p as usize] != PageState::Cached {
                    return bad(format!("page {p} is in a node but not marked cached"));
                }
                state[p as usize] = Some(PageState::Cached);
            }
        }
        for (p, s) in state.iter().enumerate().skip(1) {
            let want = s.unwrap_or(PageState::Held);
            if self.page_state[p] != want {
                return bad(format!("page {p} is marked {:?} but is {want:?}", self.page_state[p]));
            }
        }
        if leaves != self.leaves.len() {
            return bad(format!("the leaf set has {} entries, {leaves} are leaves", self.leaves.len()));
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return bad(format!(
                "counted evictable {} / protected {}, nodes hold {evictable} / {protected}",
                self.evictable, self.protected
            ));
        }
        Ok(())
    }
}

/// Set the state of each page. A free function over plain slices, so the compiler
/// knows the stores cannot touch the vectors' headers and keeps them in registers (as
/// a method writing `self.page_state[p]` in a loop it reloaded them every page).
fn set_states(states: &mut [PageState], pages: &[u32], to: PageState) {
    for &p in pages {
        states[p as usize] = to;
    }
}

/// Whether `pages` are in range and held by the caller, each named once: marks each
/// `Seen` on the way (a second sighting is a duplicate), then undoes the marks.
fn check_held(states: &mut [PageState], pages: &[u32]) -> Result<(), VecTrieError> {
    let mut bad = None;
    for &p in pages {
        // Index 0 (the padding page) is never held, so it fails as `BadPage` here.
        match states.get(p as usize) {
            _ if p == 0 => {}
            Some(PageState::Held) => {
                states[p as usize] = PageState::Seen;
                continue;
            }
            Some(PageState::Seen) => {
                bad = Some(VecTrieError::DuplicatePage { page: p });
                break;
            }
            Some(PageState::Free | PageState::Cached) => {
                bad = Some(VecTrieError::PageNotHeld { page: p });
                break;
            }
            None => {}
        }
        bad = Some(VecTrieError::BadPage { page: p });
        break;
    }
    // Undo the marks (only pages marked Seen were Held before).
    for &p in pages {
        if let Some(s) = states.get_mut(p as usize) {
            if *s == PageState::Seen {
                *s = PageState::Held;
            }
        }
    }
    bad.map_or(Ok(()), Err)
}

impl<S> fmt::Debug for VecTrieCache<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VecTrieCache")
            .field("page_size", &self.page_size)
            .field("num_pages", &self.num_pages)
            .field("free_pages", &self.free_pages.len())
            .field("nodes", &(self.nodes.len() - self.free_nodes.len()))
            .field("evictable", &self.evictable)
            .field("protected", &self.protected)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache at page size 1 (pages are slots) with `n` pages.
    fn cache(n: usize) -> VecTrieCache {
        VecTrieCache::new(n, 1).unwrap()
    }

    /// Allocate pages and insert `key` with them; returns the pages.
    fn put<S: BuildHasher>(c: &mut VecTrieCache<S>, ns: u64, key: &[u32]) -> Vec<u32> {
        let ps = c.page_size() as usize;
        let mut pages = vec![0u32; key.len() / ps];
        c.alloc_pages(&mut pages).unwrap();
        let r = c.insert(ns, key, &pages).unwrap();
        assert_eq!(r.stored, key.len());
        // The caller frees its duplicates.
        let dup: Vec<u32> = pages[..r.present / ps].iter().map(|&p| p * ps as u32).collect();
        c.free_slots(&dup).unwrap();
        c.check_invariants().unwrap();
        pages
    }

    fn hit(c: &mut VecTrieCache, ns: u64, key: &[u32]) -> (usize, Vec<u32>) {
        let mut pages = Vec::new();
        let m = c.match_prefix(ns, key, &mut pages);
        assert_eq!(m.len, pages.len() * c.page_size() as usize);
        (m.len, pages)
    }

    #[test]
    fn bad_config_is_refused() {
        assert_eq!(VecTrieCache::new(64, 0).unwrap_err(), ConfigError::ZeroPageSize);
        assert!(matches!(VecTrieCache::new(3, 4), Err(ConfigError::Zero(_))));
        assert!(matches!(VecTrieCache::new(1 << 33, 4), Err(ConfigError::TooLarge { .. })));
        assert_eq!(VecTrieCache::new(10, 4).unwrap().num_pages(), 2);
    }

    #[test]
    fn hits_and_splits() {
        let mut c = cache(64);
        let a = put(&mut c, 0, &[1, 2, 3, 4]);
        assert_eq!(hit(&mut c, 0, &[1, 2, 3, 4, 5]), (4, a.clone()));
        assert_eq!(hit(&mut c, 0, &[1, 2, 9]), (2, a[..2].to_vec()));
        assert_eq!(hit(&mut c, 0, &[9]), (0, vec![]));
        // A lookup never splits; an insert that leaves a node does.
        assert_eq!(c.node_count(), 1);
        let b = put(&mut c, 0, &[1, 2, 7]);
        assert_eq!(c.node_count(), 3);
        assert_eq!(hit(&mut c, 0, &[1, 2, 7]), (3, vec![a[0], a[1], b[2]]));
        assert_eq!(c.cached_tokens(), 5);
        assert_eq!(c.available_pages(), 64 - 5);
        assert_eq!(c.leaf_paths(), vec![(0, vec![1, 2, 3, 4], a.clone()), (0, vec![1, 2, 7], vec![a[0], a[1], b[2]])]);
    }

    #[test]
    fn paged_match_is_page_aligned() {
        let mut c = VecTrieCache::new(64, 4).unwrap();
        let k: Vec<u32> = (1..=8).collect();
        let pages = put(&mut c, 0, &k);
        let mut got = Vec::new();
        assert_eq!(c.match_prefix(0, &k[..7], &mut got).len, 4);
        got.clear();
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 99], &mut got).len, 4);
        got.clear();
        assert_eq!(c.match_prefix(0, &k, &mut got).len, 8);
        assert_eq!(got, pages);
    }

    #[test]
    fn namespaces_do_not_share() {
        let mut c = cache(64);
        let a = put(&mut c, 1, &[1, 2, 3]);
        let mut b = vec![0u32; 3];
        c.alloc_pages(&mut b).unwrap();
        assert_eq!(c.insert(2, &[1, 2, 3], &b).unwrap().present, 0);
        assert_eq!(hit(&mut c, 1, &[1, 2, 3]).1, a);
        assert_eq!(hit(&mut c, 2, &[1, 2, 3]).1, b);
        assert_eq!(hit(&mut c, 3, &[1, 2, 3]).0, 0);
        assert_eq!(c.cached_tokens(), 6);
        c.check_invariants().unwrap();
    }

    #[test]
    fn eviction_is_lru_and_trims_the_leaf_tail() {
        let mut c = cache(64);
        let a = put(&mut c, 0, &[1, 2, 3, 4]);
        let b = put(&mut c, 0, &[5, 6, 7]);
        hit(&mut c, 0, &[1]); // a is now more recent than b
        let free = c.available_pages();
        // Two pages: taken from b's tail; b stays with one token.
        assert_eq!(c.evict(2), 2);
        assert_eq!(c.available_pages(), free + 2);
        assert_eq!(hit(&mut c, 0, &[1, 2, 3, 4]), (4, a));
        assert_eq!(hit(&mut c, 0, &[5, 6, 7]), (1, vec![b[0]]));
        // b was refreshed after a: a goes first now, whole (4 pages), b stays.
        let empty = c.match_prefix(0, &[], &mut Vec::new()).node;
        assert!(empty.is_empty());
        c.lock(empty).unwrap(); // locks nothing
        assert_eq!(c.evictable_tokens(), 5);
        assert_eq!(c.evict(4), 4);
        assert_eq!(hit(&mut c, 0, &[1]).0, 0);
        assert_eq!(hit(&mut c, 0, &[5]).0, 1);
        assert_eq!(c.evict(10), 1);
        assert_eq!((c.cached_tokens(), c.available_pages(), c.node_count()), (0, 64, 0));
        c.check_invariants().unwrap();
    }

    #[test]
    fn parent_becomes_a_leaf_after_its_children_go() {
        let mut c = cache(64);
        put(&mut c, 0, &[1, 2, 3]);
        put(&mut c, 0, &[1, 2, 4]);
        // [1,2] <- [3], [4]; evicting both children and one more page trims [1,2].
        assert_eq!(c.evict(3), 3);
        assert_eq!(hit(&mut c, 0, &[1, 2, 3]).0, 1);
        c.check_invariants().unwrap();
    }

    #[test]
    fn locks_protect_and_survive_splits() {
        let mut c = cache(64);
        put(&mut c, 0, &[1, 2, 3, 4]);
        let m = c.match_prefix(0, &[1, 2, 3, 4], &mut Vec::new());
        c.lock(m.node).unwrap();
        assert_eq!((c.evictable_tokens(), c.protected_tokens()), (0, 4));
        assert_eq!(c.evict(1), 0);
        // An insert splits the locked node; the upper half inherits the lock.
        put(&mut c, 0, &[1, 2, 9]);
        assert_eq!((c.evictable_tokens(), c.protected_tokens()), (1, 4));
        assert_eq!(c.evict(5), 1);
        c.unlock(m.node).unwrap();
        assert_eq!((c.evictable_tokens(), c.protected_tokens()), (4, 0));
        assert_eq!(c.unlock(m.node), Err(VecTrieError::NotLocked));
        c.check_invariants().unwrap();
        // Once evicted, the handle is stale, even if its arena slot is reused.
        assert_eq!(c.evict(4), 4);
        put(&mut c, 0, &[5, 6]);
        put(&mut c, 0, &[7, 8]);
        assert_eq!(c.lock(m.node), Err(VecTrieError::StaleNode));
        assert_eq!(c.unlock(m.node), Err(VecTrieError::StaleNode));
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_partial_match_locks_its_whole_node() {
        let mut c = cache(64);
        put(&mut c, 0, &[1, 2, 3, 4]);
        let m = c.match_prefix(0, &[1, 2, 9], &mut Vec::new());
        assert_eq!(m.len, 2);
        c.lock(m.node).unwrap();
        assert_eq!(c.protected_tokens(), 4);
        assert_eq!(c.evict(4), 0);
        c.unlock(m.node).unwrap();
        assert_eq!(c.evict(4), 4);
    }

    #[test]
    fn finish_frees_duplicates_and_unlocks() {
        let mut c = VecTrieCache::new(64, 2).unwrap();
        let key = [1, 2, 3, 4, 5, 6];
        let first = put(&mut c, 0, &key[..4]);
        // A request matches 2 pages, locks them, then allocates 2 more pages for the
        // whole key although page 2 of it was cached meanwhile by another request.
        let mut pages = Vec::new();
        let m = c.match_prefix(0, &key[..2], &mut pages);
        c.lock(m.node).unwrap();
        assert_eq!(m.len, 2);
        let mut own = [0u32; 2];
        c.alloc_pages(&mut own).unwrap();
        pages.extend_from_slice(&own);
        let free = c.available_pages();
        assert_eq!(c.finish(0, &key, &pages, m.len, m.node), Ok(4));
        // own[0] duplicated first[1]: freed. own[1] is cached.
        assert_eq!(c.available_pages(), free + 1);
        assert_eq!(hit(&mut c, 0, &key).1, vec![first[0], first[1], own[1]]);
        assert_eq!(c.protected_tokens(), 0);
        c.check_invariants().unwrap();
    }

    #[test]
    fn errors_change_nothing() {
        let mut c = VecTrieCache::new(64, 2).unwrap();
        let a = put(&mut c, 0, &[1, 2, 3, 4]);
        let mut held = [0u32; 2];
        c.alloc_pages(&mut held).unwrap();
        let before = (c.leaf_paths(), c.available_pages(), c.cached_tokens(), c.node_count());
        assert_eq!(c.insert(0, &[1, 2, 3], &held), Err(VecTrieError::NotPageAligned { len: 3, page_size: 2 }));
        assert!(matches!(c.insert(0, &[1, 2, 3, 4], &held[..1]), Err(VecTrieError::LengthMismatch { .. })));
        assert_eq!(c.insert(0, &[5, 6, 7, 8], &[held[0], held[0]]), Err(VecTrieError::DuplicatePage { page: held[0] }));
        assert_eq!(c.insert(0, &[5, 6], &[99]), Err(VecTrieError::BadPage { page: 99 }));
        assert_eq!(c.insert(0, &[5, 6], &[0]), Err(VecTrieError::BadPage { page: 0 }));
        // The tree's own page, or a free one, cannot be stored again.
        assert_eq!(c.insert(0, &[5, 6], &a[..1]), Err(VecTrieError::PageNotHeld { page: a[0] }));
        assert_eq!(c.insert(0, &[5, 6], &[30]), Err(VecTrieError::PageNotHeld { page: 30 }));
        // The split this insert needs is not done when its pages are refused.
        assert_eq!(c.insert(0, &[1, 2, 5, 6], &[held[0], 30]), Err(VecTrieError::PageNotHeld { page: 30 }));
        assert_eq!(
            c.finish(0, &[1, 2], &[held[0]], 4, VecTrieNode::EMPTY),
            Err(VecTrieError::BadPrefixLen { prefix_len: 4, len: 2 })
        );
        assert_eq!(
            c.finish(0, &[5, 6], &[held[0]], 0, VecTrieNode { index: 0, generation: 0 }),
            Err(VecTrieError::NotLocked)
        );
        assert_eq!(
            c.finish(0, &[5, 6], &[held[0]], 0, VecTrieNode { index: 77, generation: 0 }),
            Err(VecTrieError::StaleNode)
        );
        assert_eq!(
            c.finish(0, &[5, 6, 7, 8], &[held[0], held[0]], 0, VecTrieNode::EMPTY),
            Err(VecTrieError::DuplicatePage { page: held[0] })
        );
        // Frees: out of range, free, cached pages are refused, nothing freed.
        let e = c.free_slots(&[held[0] * 2, 1]).unwrap_err();
        assert_eq!((e.index, e.kind), (1, FreeErrorKind::OutOfRange { first: 2, last: 65 }));
        assert_eq!(c.free_slots(&[held[0] * 2, 60]).unwrap_err().kind, FreeErrorKind::NotAllocated);
        assert_eq!(c.free_slots(&[a[0] * 2]).unwrap_err().kind, FreeErrorKind::NotAllocated);
        assert_eq!(c.free_slots(&[66]).unwrap_err().index, 66);
        assert_eq!(before, (c.leaf_paths(), c.available_pages(), c.cached_tokens(), c.node_count()));
        c.check_invariants().unwrap();
        // Both slots of a page, or a page twice: one page freed.
        c.free_slots(&[held[0] * 2, held[0] * 2 + 1, held[1] * 2, held[1] * 2]).unwrap();
        assert_eq!(c.available_pages(), 30);
        assert_eq!(c.free_slots(&[held[0] * 2]).unwrap_err().kind, FreeErrorKind::NotAllocated);
    }

    #[test]
    fn alloc_errors_change_nothing() {
        let mut c = VecTrieCache::new(16, 4).unwrap();
        let mut out = [0u32; 20];
        let e = c.alloc_extend(&[0], &[20], &[0], &mut out).unwrap_err();
        assert_eq!(e.out_of_memory().map(|o| (o.requested, o.available)), Some((20, 16)));
        assert_eq!(
            c.alloc_extend(&[0], &[5], &[0], &mut out),
            Err(InvalidInput::OutputLength { got: 20, expected: 5 }.into())
        );
        assert!(matches!(c.alloc_extend(&[6], &[5], &[0], &mut out[..0]), Err(AllocError::Invalid(_))));
        assert!(matches!(c.alloc_extend(&[0], &[5], &[], &mut out[..5]), Err(AllocError::Invalid(_))));
        // last_loc 9 is not held (a fresh pool holds nothing).
        assert_eq!(
            c.alloc_extend(&[2], &[5], &[9], &mut out[..3]),
            Err(InvalidInput::BadLastLoc { request: 0, last_loc: 9 }.into())
        );
        assert_eq!(c.alloc_decode(&[0], &[0], &mut out[..1]), Err(InvalidInput::EmptyDecode { request: 0 }.into()));
        assert_eq!(c.available_pages(), 4);
        assert_eq!(out, [0u32; 20]);
        // Decode: seq 5 starts page 2; seq 6 continues it.
        let mut first = [0u32; 4];
        c.alloc_extend(&[0], &[4], &[0], &mut first).unwrap();
        let mut one = [0u32; 1];
        c.alloc_decode(&[5], &[first[3]], &mut one).unwrap();
        assert_eq!(one, [8]);
        c.alloc_decode(&[6], &[8], &mut one).unwrap();
        assert_eq!(one, [9]);
        assert_eq!(c.available_pages(), 2);
        c.check_invariants().unwrap();
    }

    /// A hasher that sends every page to the same bucket: collisions at page size > 1.
    #[derive(Clone, Default)]
    struct Collide;
    impl BuildHasher for Collide {
        type Hasher = ConstHasher;
        fn build_hasher(&self) -> ConstHasher {
            ConstHasher
        }
    }
    struct ConstHasher;
    impl std::hash::Hasher for ConstHasher {
        fn finish(&self) -> u64 {
            42
        }
        fn write(&mut self, _: &[u8]) {}
    }

    #[test]
    fn hash_collisions_are_misses_not_wrong_hits() {
        let mut c = VecTrieCache::with_hasher(64, 2, Collide).unwrap();
        let a = put(&mut c, 0, &[1, 2, 3, 4]);
        let mut got = Vec::new();
        assert_eq!(c.match_prefix(0, &[5, 6], &mut got).len, 0);
        assert_eq!(c.peek_prefix(0, &[5, 6], &mut got), 0);
        // A colliding first page cannot be stored: its pages stay the caller's.
        let mut b = [0u32; 1];
        c.alloc_pages(&mut b).unwrap();
        assert_eq!(c.insert(0, &[5, 6], &b), Ok(Inserted { present: 0, stored: 0 }));
        // Nor a colliding page under a split: [1,2] | [3,4] vs [1,2] | [7,8].
        let mut d = [0u32; 2];
        c.alloc_pages(&mut d).unwrap();
        assert_eq!(c.insert(0, &[1, 2, 7, 8], &d), Ok(Inserted { present: 2, stored: 2 }));
        assert_eq!(c.leaf_paths(), vec![(0, vec![1, 2, 3, 4], a)]);
        c.free_slots(&[b[0] * 2, d[0] * 2, d[1] * 2]).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.available_pages(), 30);
    }

    #[test]
    fn peek_changes_no_recency() {
        let mut c = cache(64);
        put(&mut c, 0, &[1, 2]);
        put(&mut c, 0, &[3, 4]);
        let mut got = Vec::new();
        assert_eq!(c.peek_prefix(0, &[1, 2, 5], &mut got), 2);
        // [1,2] is still the least recent: it goes first.
        assert_eq!(c.evict(2), 2);
        assert_eq!(hit(&mut c, 0, &[1, 2]).0, 0);
        assert_eq!(hit(&mut c, 0, &[3, 4]).0, 2);
    }
}
