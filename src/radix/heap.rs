//! Indexed binary min-heaps of tree nodes (the eviction orders), keyed by a policy.
//!
//! Each node's position in a heap is kept in its metadata (the core order's in
//! `heap_pos`; a variant's extra orders in fields of its payload), so a key change (a
//! touch) or a removal (a lock, a new child) is O(log n) and nothing is ever
//! allocated: every heap's vector has the node arena's capacity from the start.

use super::{EvictionPolicy, Meta, NIL};

/// Which field of a node holds its position in a heap, and the node's key there.
pub(crate) trait Slot<N> {
    fn pos(m: &Meta<N>) -> u32;
    fn set_pos(m: &mut Meta<N>, pos: u32);
    fn key(policy: EvictionPolicy, m: &Meta<N>) -> (i64, u64) {
        super::hints::node_key(policy, m)
    }
}

/// The core order: evictable leaves, by the cache's policy.
pub(crate) struct Leaves;

impl<N> Slot<N> for Leaves {
    #[inline]
    fn pos(m: &Meta<N>) -> u32 {
        m.heap_pos
    }
    #[inline]
    fn set_pos(m: &mut Meta<N>, pos: u32) {
        m.heap_pos = pos;
    }
}

pub(crate) struct Heap<'a, N, S: Slot<N>> {
    pub heap: &'a mut Vec<u32>,
    pub meta: &'a mut [Meta<N>],
    pub policy: EvictionPolicy,
    pub slot: core::marker::PhantomData<S>,
}

impl<'a, N, S: Slot<N>> Heap<'a, N, S> {
    pub(crate) fn new(heap: &'a mut Vec<u32>, meta: &'a mut [Meta<N>], policy: EvictionPolicy) -> Self {
        Heap { heap, meta, policy, slot: core::marker::PhantomData }
    }

    #[inline]
    fn key(&self, id: u32) -> (i64, u64) {
        S::key(self.policy, &self.meta[id as usize])
    }

    #[inline]
    fn pos_of(&self, id: u32) -> u32 {
        S::pos(&self.meta[id as usize])
    }

    #[inline]
    fn set(&mut self, pos: usize, id: u32) {
        self.heap[pos] = id;
        S::set_pos(&mut self.meta[id as usize], pos as u32);
    }

    fn up(&mut self, mut pos: usize) {
        let id = self.heap[pos];
        let k = self.key(id);
        while pos > 0 {
            let parent = (pos - 1) / 2;
            if self.key(self.heap[parent]) <= k {
                break;
            }
            let p = self.heap[parent];
            self.set(pos, p);
            pos = parent;
        }
        self.set(pos, id);
    }

    fn down(&mut self, mut pos: usize) {
        let id = self.heap[pos];
        let k = self.key(id);
        let n = self.heap.len();
        loop {
            let l = 2 * pos + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            let c = if r < n && self.key(self.heap[r]) < self.key(self.heap[l]) { r } else { l };
            if self.key(self.heap[c]) >= k {
                break;
            }
            let cid = self.heap[c];
            self.set(pos, cid);
            pos = c;
        }
        self.set(pos, id);
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.pos_of(id) != NIL
    }

    pub(crate) fn push(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        // Within the capacity reserved at construction: no reallocation.
        self.heap.push(id);
        let pos = self.heap.len() - 1;
        S::set_pos(&mut self.meta[id as usize], pos as u32);
        self.up(pos);
    }

    pub(crate) fn remove(&mut self, id: u32) {
        let pos = self.pos_of(id);
        if pos == NIL {
            return;
        }
        let pos = pos as usize;
        S::set_pos(&mut self.meta[id as usize], NIL);
        let last = self.heap.pop().expect("heap holds the node");
        if pos < self.heap.len() {
            self.set(pos, last);
            self.up(pos);
            let p = self.pos_of(last) as usize;
            self.down(p);
        }
    }

    /// Restore order after `id`'s key changed.
    pub(crate) fn update(&mut self, id: u32) {
        let pos = self.pos_of(id);
        if pos != NIL {
            self.up(pos as usize);
            let p = self.pos_of(id) as usize;
            self.down(p);
        }
    }

    /// `new` takes `old`'s place (same key), `old` leaves.
    pub(crate) fn replace(&mut self, old: u32, new: u32) {
        let pos = self.pos_of(old);
        S::set_pos(&mut self.meta[old as usize], NIL);
        if pos != NIL {
            self.set(pos as usize, new);
        } else {
            S::set_pos(&mut self.meta[new as usize], NIL);
        }
    }

    pub(crate) fn peek(&self) -> Option<u32> {
        self.heap.first().copied()
    }

    pub(crate) fn pop(&mut self) -> Option<u32> {
        let top = self.peek()?;
        self.remove(top);
        Some(top)
    }
}

/// Check heap order and positions over shared views (no copy of the arenas: the
/// invariant check runs on caches of millions of nodes).
pub(crate) fn check<N, S: Slot<N>>(heap: &[u32], meta: &[Meta<N>], policy: EvictionPolicy) -> Result<(), String> {
    let key = |id: u32| S::key(policy, &meta[id as usize]);
    for (pos, &id) in heap.iter().enumerate() {
        if S::pos(&meta[id as usize]) as usize != pos {
            return Err(format!("heap position of node {id} is stale"));
        }
        if pos > 0 && key(heap[(pos - 1) / 2]) > key(id) {
            return Err(format!("heap order broken at {pos}"));
        }
    }
    Ok(())
}
