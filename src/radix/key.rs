//! [`CacheKey`]: what a request's tokens are cached under besides the tokens.

use sha2::{Digest, Sha256};

/// What a request's tokens are cached and looked up under besides the tokens
/// themselves (SGLang's `RadixKey`: its `extra_key`, its `cache_salt` and its bigram
/// mode). Two requests share cached KV only when their keys are equal.
///
/// * `extra` separates what must never share KV although the tokens agree: a LoRA
///   adapter, a model revision (SGLang's `extra_key`).
/// * `salt` isolates tenants (SGLang's `cache_salt`): a request never hits KV cached
///   under another salt, so one tenant cannot learn from its hit rate what another
///   sent. The shared store binds its pages to a salt the same way.
/// * `bigram` is for speculative decoding with an EAGLE draft model, whose KV at a
///   position depends on the token after it: position `i` is reusable only when tokens
///   `i` and `i + 1` both match (SGLang's bigram keys). A bigram request caches and
///   matches one position fewer than its tokens.
///
/// A plain `u64` is a key with that `extra` and nothing else (`0`: the default key).
///
/// The tree compares one 64-bit namespace per node: a key of only `extra` is that
/// namespace, and any other key is a SHA-256 digest of all its parts (for a bigram key,
/// with the first token), cut to 64 bits. Two different keys then share a namespace
/// with a probability of 2^-64, and finding a salt that collides with another tenant's
/// takes about 2^64 digests.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use kvpool::radix::{CacheKey, RadixCache, RadixConfig};
/// use kvpool::{PagedAllocator, ReqToTokenPool};
///
/// let cache = Arc::new(RadixCache::new(PagedAllocator::new(256, 4)?, ReqToTokenPool::new(4, 64)?, RadixConfig::default())?);
/// let tokens: Vec<u32> = (1..=9).collect();
/// let alice = CacheKey { salt: 0xA11CE, ..CacheKey::default() };
/// let mut r = cache.admit(alice, &tokens)?;
/// r.extend(9)?;
/// r.finish(&tokens)?;
///
/// assert_eq!(cache.admit(alice, &tokens)?.cached_len(), 8);
/// assert_eq!(cache.admit(CacheKey { salt: 0xB0B, ..alice }, &tokens)?.cached_len(), 0);
/// assert_eq!(cache.admit(0, &tokens)?.cached_len(), 0);
/// // A router looks up what a key's request would hit:
/// let (namespace, key) = alice.tree_key(&tokens);
/// assert_eq!(cache.peek_prefix(namespace, key, &mut [0; 9]), 8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// What must not share KV although the tokens agree (a LoRA adapter).
    pub extra: u64,
    /// The tenant (0: none).
    pub salt: u64,
    /// EAGLE bigram keys: a position matches only with the token after it.
    pub bigram: bool,
}

impl From<u64> for CacheKey {
    fn from(extra: u64) -> Self {
        CacheKey { extra, ..CacheKey::default() }
    }
}

impl CacheKey {
    /// The namespace and the key the tree caches `tokens` under: for a bigram key, the
    /// tokens after the first (position `i` keyed by token `i + 1`), the first going
    /// into the namespace. The tree's match length of that key is the number of
    /// reusable KV positions.
    pub fn tree_key<'t>(&self, tokens: &'t [u32]) -> (u64, &'t [u32]) {
        if !self.bigram {
            return (self.namespace_with(None), tokens);
        }
        match tokens.split_first() {
            Some((&first, rest)) => (self.namespace_with(Some(first)), rest),
            None => (self.namespace_with(None), tokens),
        }
    }

    fn namespace_with(&self, first: Option<u32>) -> u64 {
        if self.salt == 0 && !self.bigram {
            return self.extra;
        }
        let mut h = Sha256::new();
        h.update(b"kvpool cache key v1");
        h.update(self.extra.to_le_bytes());
        h.update(self.salt.to_le_bytes());
        h.update([u8::from(self.bigram), u8::from(first.is_some())]);
        h.update(first.unwrap_or(0).to_le_bytes());
        let d = h.finalize();
        u64::from_le_bytes(d[..8].try_into().expect("a SHA-256 digest has 8 bytes"))
    }
}
