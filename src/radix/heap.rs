//! An indexed binary min-heap of evictable leaves, keyed by the eviction policy.
//!
//! Each node's position is kept in its metadata (`heap_pos`, `NIL` when absent), so a
//! key change (a touch) or a removal (a lock, a new child) is O(log n) and nothing is
//! ever allocated: the heap's vector has the node arena's capacity from the start.

use super::{EvictionPolicy, Meta, NIL};

pub(super) struct Heap<'a> {
    pub heap: &'a mut Vec<u32>,
    pub meta: &'a mut [Meta],
    pub policy: EvictionPolicy,
}

impl Heap<'_> {
    fn key(&self, id: u32) -> (i64, u64) {
        let m = &self.meta[id as usize];
        self.policy.key(m.last_access, m.created, m.hit_count, m.priority)
    }

    fn set(&mut self, pos: usize, id: u32) {
        self.heap[pos] = id;
        self.meta[id as usize].heap_pos = pos as u32;
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

    pub fn contains(&self, id: u32) -> bool {
        self.meta[id as usize].heap_pos != NIL
    }

    pub fn push(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        // Within the capacity reserved at construction: no reallocation.
        self.heap.push(id);
        let pos = self.heap.len() - 1;
        self.meta[id as usize].heap_pos = pos as u32;
        self.up(pos);
    }

    pub fn remove(&mut self, id: u32) {
        let pos = self.meta[id as usize].heap_pos;
        if pos == NIL {
            return;
        }
        let pos = pos as usize;
        self.meta[id as usize].heap_pos = NIL;
        let last = self.heap.pop().expect("heap holds the node");
        if pos < self.heap.len() {
            self.set(pos, last);
            self.up(pos);
            let p = self.meta[last as usize].heap_pos as usize;
            self.down(p);
        }
    }

    /// Restore order after `id`'s key changed.
    pub fn update(&mut self, id: u32) {
        let pos = self.meta[id as usize].heap_pos;
        if pos != NIL {
            self.up(pos as usize);
            let p = self.meta[id as usize].heap_pos as usize;
            self.down(p);
        }
    }

    /// `new` takes `old`'s place (same key), `old` leaves.
    pub fn replace(&mut self, old: u32, new: u32) {
        let pos = self.meta[old as usize].heap_pos;
        self.meta[old as usize].heap_pos = NIL;
        if pos != NIL {
            self.set(pos as usize, new);
        } else {
            self.meta[new as usize].heap_pos = NIL;
        }
    }

    pub fn pop(&mut self) -> Option<u32> {
        let top = *self.heap.first()?;
        self.remove(top);
        Some(top)
    }
}

/// Check heap order and positions over shared views (no copy of the arenas: the
/// invariant check runs on caches of millions of nodes).
pub(super) fn check(heap: &[u32], meta: &[Meta], policy: EvictionPolicy) -> Result<(), String> {
    let key = |id: u32| {
        let m = &meta[id as usize];
        policy.key(m.last_access, m.created, m.hit_count, m.priority)
    };
    for (pos, &id) in heap.iter().enumerate() {
        if meta[id as usize].heap_pos as usize != pos {
            return Err(format!("heap position of node {id} is stale"));
        }
        if pos > 0 && key(heap[(pos - 1) / 2]) > key(id) {
            return Err(format!("heap order broken at {pos}"));
        }
    }
    Ok(())
}
