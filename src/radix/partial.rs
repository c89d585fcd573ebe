//! Partial-leaf eviction (issue 13): evict only the pages of a leaf that the shortfall
//! needs, from its tail, instead of SGLang's whole leaf.
//!
//! SGLang's `evict(n)` removes whole leaves until `n` tokens are freed, so a request
//! that needs one decode page may free a leaf of thousands of tokens. With partial
//! eviction on ([`RadixCache::with_partial_eviction`]), the last leaf `evict` takes is
//! cut where the shortfall ends: its tail pages are freed, its head stays cached (a
//! prefix of a cached path is still a cached path) and keeps its place in the eviction
//! order — its recency, creation time, hit count and score are the leaf's.
//!
//! The cut is a split followed by the removal of the lower half, so it follows the
//! protocol of both (see the parent module): lock-free readers see either the old leaf
//! or the shortened one, never freed pages, and the freed pages go out as
//! `BlockRemoved` events. A variant node whose upper half may not be a leaf (a Mamba
//! tombstone) goes whole, as before. Off by default: the default is SGLang's exact
//! whole-leaf semantics.

use super::writer::Writer;
use super::{RadixCache, Variant};
use crate::alloc::{KvAllocator, KvFreeGroup};

impl<A: KvAllocator, V: Variant> RadixCache<A, V> {
    /// Turn partial-leaf eviction on or off (off by default: whole leaves, as SGLang).
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use kvpool::radix::{RadixCache, RadixConfig};
    /// # use kvpool::{ReqToTokenPool, TokenAllocator};
    /// let cache = RadixCache::new(TokenAllocator::new(8)?, ReqToTokenPool::new(1, 8)?, RadixConfig::default())?
    ///     .with_partial_eviction(true);
    /// let cache = Arc::new(cache);
    /// let mut req = cache.admit(0, &[1, 2, 3, 4])?;
    /// req.extend(4)?;
    /// req.finish(&[1, 2, 3, 4])?;
    /// assert_eq!(cache.evict(1), 1); // only the last token goes
    /// assert_eq!(cache.peek_prefix(0, &[1, 2, 3, 4], &mut [0; 4]), 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_partial_eviction(mut self, on: bool) -> Self {
        self.hints.partial = on;
        self
    }

    /// Whether eviction cuts leaves to the shortfall (see
    /// [`with_partial_eviction`](Self::with_partial_eviction)).
    pub fn partial_eviction(&self) -> bool {
        self.hints.partial
    }
}

impl<A: KvAllocator, V: Variant> Writer<'_, A, V> {
    /// Evict the unlocked leaf `x`, out of the eviction order already, when `need` more
    /// tokens must be freed: all of it, or with partial eviction on only its last
    /// `ceil(need / page_size)` pages when it has more. Returns the tokens freed.
    pub(super) fn evict_leaf(&mut self, x: u32, need: usize, group: &mut KvFreeGroup<'_>) -> usize {
        let pages = self.span(x).1 as usize;
        let need_pages = need.div_ceil(self.c.ps);
        if !self.c.hints.partial || need_pages == 0 || need_pages >= pages {
            return self.remove_leaf(x, group);
        }
        let old = self.s.meta[x as usize];
        let upper = self.split(x, pages - need_pages);
        if V::is_tombstone(&self.s.meta[upper as usize].ext) {
            // The head may not be a leaf: the whole node goes, as without the option.
            let lower = self.s.page_owner[old.last_page as usize];
            return self.remove_leaf(lower, group);
        }
        // The head keeps the leaf's place in the order (the split gave it a new tick).
        let head = &mut self.s.meta[upper as usize];
        head.last_access = old.last_access;
        head.created = old.created;
        let lower = self.s.page_owner[old.last_page as usize];
        self.remove_leaf(lower, group)
    }
}
