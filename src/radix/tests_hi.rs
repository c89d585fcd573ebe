//! Unit tests of the host-tier variant (the model test `tests/hi_tree_model.rs` checks
//! it op by op against the reference).

use super::*;
use crate::PagedAllocator;

fn cache(device: usize, host_pages: u32, write_policy: WritePolicy) -> HiRadixCache<PagedAllocator> {
    let tier = HostTier { host_pages, write_policy, load_back_threshold: 1 };
    let alloc = PagedAllocator::new(device, 2).unwrap();
    HiRadixCache::with_host_tier(alloc, ReqToTokenPool::new(4, 64).unwrap(), RadixConfig::default(), tier).unwrap()
}

fn slots(c: &HiRadixCache<PagedAllocator>, n: usize) -> Vec<u32> {
    let mut s = vec![0u32; n];
    c.allocator().alloc(&mut s).unwrap();
    s
}

#[test]
fn a_backed_up_node_survives_device_eviction_and_loads_back() {
    let c = cache(16, 8, WritePolicy::WriteThrough);
    let a = slots(&c, 6);
    c.insert(0, &[1, 2, 3, 4, 5, 6], &a).unwrap();
    assert_eq!(c.counters().written, 6);
    assert_eq!(c.evict(6), 6);
    c.check_invariants().unwrap();
    assert_eq!((c.total_size(), c.host_size()), (0, 6));
    // Lock-free lookups see no device prefix.
    let mut out = [0u32; 6];
    assert_eq!(c.peek_prefix(0, &[1, 2, 3, 4, 5, 6], &mut out), 0);
    // A match ending inside the host node splits it (both halves stay host-only).
    let m = c.match_tiers(0, &[1, 2, 3, 4, 9, 9], &mut out);
    assert_eq!((m.device.len(), m.host_len), (0, 4));
    assert_eq!(c.node_count(), 2);
    c.check_invariants().unwrap();
    let (lease, hit) = c.match_and_load(0, &[1, 2, 3, 4, 5, 6], &mut out, None);
    assert_eq!((lease.len(), hit.matched, hit.loaded), (6, 6, 6));
    assert_eq!(c.counters().loaded, 6);
    c.check_invariants().unwrap();
    let mut peek = [0u32; 6];
    assert_eq!(c.peek_prefix(0, &[1, 2, 3, 4, 5, 6], &mut peek), 6);
    assert_eq!(peek, out);
    drop(lease);
    // Evicted again: the host copy is still there, no second backup.
    assert_eq!(c.evict(6), 6);
    assert_eq!(c.counters().written, 6);
    c.check_invariants().unwrap();
}

#[test]
fn a_node_without_a_copy_goes_with_its_host_subtree() {
    // One host page: [1, 2, 3, 4] never fits, its child [5, 6] does.
    let c = cache(16, 1, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    let b = slots(&c, 6);
    assert_eq!(c.insert(0, &[1, 2, 3, 4, 5, 6], &b).unwrap(), 4);
    c.allocator().free(&b[..4]).unwrap();
    let k = c.counters();
    assert_eq!((k.written, k.backup_refused), (2, 2));
    assert_eq!(c.evict(2), 2); // [5, 6] goes to host
    assert_eq!((c.node_count(), c.host_size()), (2, 2));
    c.check_invariants().unwrap();
    assert_eq!(c.evict(4), 4); // [1..4] has no copy: removed with [5, 6]
    assert_eq!((c.node_count(), c.host_size(), c.counters().host_evicted), (0, 0, 2));
    assert_eq!(c.allocator().available_size(), 16);
    c.check_invariants().unwrap();
}

#[test]
fn an_insert_over_host_nodes_takes_the_request_slots() {
    let c = cache(16, 4, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    c.evict(4);
    let r = slots(&c, 6);
    assert_eq!(c.insert(0, &[1, 2, 3, 4, 5, 6], &r).unwrap(), 0);
    let mut out = [0u32; 6];
    let m = c.match_tiers(0, &[1, 2, 3, 4, 5, 6], &mut out);
    assert_eq!((m.device.len(), m.host_len), (6, 0));
    assert_eq!(&out[..], &r[..]);
    assert_eq!(c.counters().written, 6);
    c.check_invariants().unwrap();
    // Everything goes to host, then a full host evicts the LRU leaf for a backup.
    assert_eq!(c.evict(6), 6);
    assert_eq!(c.host_size(), 6);
    let x = slots(&c, 4);
    c.insert(0, &[7, 7, 7, 7], &x).unwrap(); // needs 2 host pages, 1 free
    assert_eq!(c.counters().host_evicted, 2);
    c.check_invariants().unwrap();
}

#[test]
fn write_back_copies_on_eviction_and_a_full_host_refuses() {
    let mut c = cache(16, 2, WritePolicy::WriteBack);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.counters().written, 0);
    let b = slots(&c, 6);
    c.insert(0, &[5, 5, 5, 5, 5, 5], &b).unwrap();
    assert_eq!(c.evict(10), 10);
    let k = c.counters();
    assert_eq!((k.written, k.backup_refused), (4, 1));
    // [5 x 6] needed 3 host pages of 2: the host was emptied for it ([1..4] went),
    // then the backup was refused and the node removed.
    assert_eq!((c.host_size(), c.node_count(), c.counters().host_evicted), (0, 0, 4));
    c.check_invariants().unwrap();
    let again = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &again).unwrap();
    c.evict(4);
    assert_eq!((c.host_size(), c.node_count()), (4, 1));
    c.reset();
    assert_eq!((c.host_size(), c.node_count(), c.allocator().available_size()), (0, 0, 16));
}

#[test]
fn events_are_refused() {
    let config = RadixConfig { event_capacity: Some(4), ..RadixConfig::default() };
    let r = HiRadixCache::with_host_tier(
        PagedAllocator::new(8, 2).unwrap(),
        ReqToTokenPool::new(1, 8).unwrap(),
        config,
        HostTier::new(4),
    );
    assert!(matches!(r, Err(ConfigError::Unsupported { .. })));
}
