//! What distinguishes the tree variants: the one radix core (matching, splitting,
//! publication to lock-free readers, leases, the writer latch, the arenas, events and
//! the eviction of whole leaves) calls these hooks at fixed points, and a variant
//! supplies its node payload, its lock rules, its extra orders and its extra passes.
//!
//! | variant | node payload | locks | passes | orders |
//! |---|---|---|---|---|
//! | [`Plain`] (`RadixCache`) | KV slots (in the core) | one | `evict` | evictable leaves |
//! | [`Mamba`](super::Mamba) (`MambaRadixCache`) | + an optional state slot | + a state lock on the lease's end node | `evict`, then `evict_mamba` (tombstones internal nodes) | + unlocked state holders |
//!
//! The trait is sealed: the hooks see the core's internals, and the core's invariants
//! (a leaf is never a tombstone, every page has one owner) depend on them.

use core::fmt;

use super::writer::Writer;
use crate::alloc::KvAllocator;
use crate::error::ConfigError;

pub(crate) mod sealed {
    /// Only kvpool's variants implement [`Variant`](super::Variant).
    pub trait Sealed {}
}

/// A kind of radix tree: what a node carries besides its KV pages (see the
/// [module docs](self)). Sealed: its hooks see the core's internals, and the core's
/// invariants depend on them.
pub trait Variant: sealed::Sealed + Sized + Send + Sync + 'static {
    /// What a node carries besides its pages (writer-only).
    #[doc(hidden)]
    type Node: Copy + Default + fmt::Debug + Send + Sync;
    /// The variant's writer-only state (its extra orders).
    #[doc(hidden)]
    type State: Send;
    /// Whether the core updates recency node by node as a match walks down (SGLang's
    /// `RadixCache`), or the variant refreshes only the returned path afterwards
    /// ([`touch_path`](Writer::touch_path), SGLang's `MambaRadixCache`).
    #[doc(hidden)]
    const TOUCH_WHILE_WALKING: bool = true;

    /// The variant's state for a tree of `nodes` node records.
    #[doc(hidden)]
    fn new_state(&self, nodes: usize) -> Result<Self::State, ConfigError>;

    /// Whether a match may end at a node carrying `node` (the prefix up to there is
    /// usable). The match returns the deepest such node on the matched path.
    #[inline(always)]
    #[doc(hidden)]
    fn match_end(_node: &Self::Node) -> bool {
        true
    }

    /// Whether a node carrying `node` must not be a leaf: when eviction leaves it
    /// childless and unlocked, the core removes it too.
    #[inline(always)]
    #[doc(hidden)]
    fn is_tombstone(_node: &Self::Node) -> bool {
        false
    }

    /// The payload of the upper half when a node carrying `lower` is split (the lower
    /// half keeps `lower`, which the hook may change).
    #[inline(always)]
    #[doc(hidden)]
    fn split_payload(lower: &mut Self::Node) -> Self::Node {
        *lower
    }

    /// Node `old` was replaced by `upper -> lower`; the metadata of both is set (the
    /// lower half carries `old`'s, with its payload), `old`'s is not cleared yet.
    #[inline(always)]
    #[doc(hidden)]
    fn split<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _old: u32, _upper: u32, _lower: u32) {}

    /// Node `id` leaves the tree (evicted or reset): release its payload. Its pages
    /// are freed by the core afterwards.
    #[inline(always)]
    #[doc(hidden)]
    fn removing<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32) {}

    /// A lease ending at node `id` was taken (`inc`) or released, after or before the
    /// core's lock counts along the path changed.
    #[inline(always)]
    #[doc(hidden)]
    fn lock_end<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32, _inc: bool) {}

    /// Node `id`'s recency or frequency changed (its core order is updated already).
    #[inline(always)]
    #[doc(hidden)]
    fn touched<A: KvAllocator>(_w: &mut Writer<'_, A, Self>, _id: u32) {}

    /// The tree was cleared (every node's payload went through [`removing`](Self::removing)).
    #[inline(always)]
    #[doc(hidden)]
    fn reset<A: KvAllocator>(_w: &mut Writer<'_, A, Self>) {}

    /// Check the variant's invariants (the core's hold already).
    #[doc(hidden)]
    fn check<A: KvAllocator>(_w: &Writer<'_, A, Self>) -> Result<(), String> {
        Ok(())
    }

    /// A short description of a node's payload for `pretty_print` (empty: nothing).
    #[doc(hidden)]
    fn describe(_node: &Self::Node, _out: &mut String) {}
}

/// The plain prefix cache: nodes carry KV slots only ([`RadixCache`](super::RadixCache)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plain;

impl sealed::Sealed for Plain {}

impl Variant for Plain {
    type Node = ();
    type State = ();

    fn new_state(&self, _nodes: usize) -> Result<(), ConfigError> {
        Ok(())
    }
}
