//! Unit tests of the host-tier variant (the model test `tests/hi_tree_model.rs` checks
//! it op by op against the reference).

use super::*;
use crate::PagedAllocator;

fn cache(device: usize, host_pages: u32, write_policy: WritePolicy) -> HiRadixCache<PagedAllocator> {
    let tier = HostTier { host_pages, write_policy, load_back_threshold: 1 };
    let alloc = PagedAllocator::new(device, 2).unwrap();
    HiRadixCache::with_host_tier(alloc, ReqToTokenPool::new(4, 64).unwrap(), RadixConfig::default(), tier).unwrap()
}

/// Complete every transfer in flight (copies that take no time); how many.
fn settle(c: &HiRadixCache<PagedAllocator>) -> usize {
    let mut buf = [Transfer::default(); 16];
    let n = c.take_transfers(&mut buf);
    for t in &buf[..n] {
        c.complete(*t).unwrap();
    }
    n
}

fn take_one(c: &HiRadixCache<PagedAllocator>) -> Transfer {
    let mut buf = [Transfer::default(); 2];
    assert_eq!(c.take_transfers(&mut buf), 1);
    buf[0]
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
    assert_eq!(settle(&c), 1);
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
    assert_eq!(settle(&c), 2); // one load per node: the match split it
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
    settle(&c);
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
    settle(&c);
    c.evict(4);
    let r = slots(&c, 6);
    assert_eq!(c.insert(0, &[1, 2, 3, 4, 5, 6], &r).unwrap(), 0);
    settle(&c);
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
    settle(&c);
}

#[test]
fn write_back_copies_on_eviction_and_a_full_host_refuses() {
    let mut c = cache(16, 2, WritePolicy::WriteBack);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.counters().written, 0);
    let b = slots(&c, 6);
    c.insert(0, &[5, 5, 5, 5, 5, 5], &b).unwrap();
    assert_eq!(settle(&c), 0);
    assert_eq!(c.evict(10), 10);
    let k = c.counters();
    assert_eq!((k.written, k.backup_refused), (4, 1));
    // [5 x 6] needed 3 host pages of 2; [1..4]'s write-back is in flight, so the host
    // could not evict it: the backup was refused and the node removed.
    assert_eq!((c.host_size(), c.node_count(), c.counters().host_evicted), (4, 1, 0));
    c.check_invariants().unwrap();
    let t = take_one(&c);
    assert_eq!((t.kind(), t.pages()), (TransferKind::WriteBack, 2));
    c.complete(t).unwrap();
    assert_eq!(c.evict_host(4), 4);
    let again = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &again).unwrap();
    c.evict(4);
    assert_eq!((c.host_size(), c.node_count()), (4, 1));
    c.reset().unwrap();
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

#[test]
fn a_backup_in_flight_locks_its_node_until_complete() {
    let c = cache(16, 8, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!((c.transfers_in_flight(), c.protected_size(), c.evictable_size()), (1, 4, 0));
    assert_eq!(c.evict(4), 0, "the device copy is being read");
    let t = take_one(&c);
    assert_eq!((t.kind(), t.pages(), t.kind().to_host()), (TransferKind::Backup, 2, true));
    let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
    assert_eq!(c.transfer_pages(t, &mut dev[..1], &mut host), Err(TransferError::BufferTooShort { need: 2, got: 1 }));
    assert_eq!(c.transfer_pages(t, &mut dev, &mut host), Ok(2));
    assert_eq!(dev, [a[0] / 2, a[2] / 2]);
    assert!(host.iter().all(|&h| (1..=8).contains(&h)) && host[0] != host[1]);
    // A split while in flight keeps the pairs and the lock.
    let mut out = [0u32; 4];
    c.match_tiers(0, &[1, 2, 9, 9], &mut out);
    assert_eq!(c.node_count(), 2);
    let (mut dev2, mut host2) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut dev2, &mut host2).unwrap();
    assert_eq!((dev2, host2), (dev, host));
    c.check_invariants().unwrap();
    assert_eq!(c.evict(4), 0);
    // Another cache's transfer, a placeholder, a second completion: refused.
    let other = cache(16, 8, WritePolicy::WriteThrough);
    let b = slots(&other, 2);
    other.insert(0, &[1, 2], &b).unwrap();
    let foreign = take_one(&other);
    assert_eq!(c.complete(foreign), Err(TransferError::ForeignCache));
    assert_eq!(c.complete(Transfer::default()), Err(TransferError::ForeignCache));
    c.complete(t).unwrap();
    assert_eq!(c.complete(t), Err(TransferError::Unknown));
    assert_eq!(c.transfer_pages(t, &mut dev, &mut host), Err(TransferError::Unknown));
    assert_eq!((c.transfers_in_flight(), c.protected_size(), c.evictable_size()), (0, 0, 4));
    assert_eq!(c.evict(4), 4);
    assert_eq!(c.host_size(), 4);
    c.check_invariants().unwrap();
}

#[test]
fn a_write_back_in_flight_holds_its_host_pages() {
    let c = cache(16, 8, WritePolicy::WriteBack);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.transfers_in_flight(), 0);
    // The device pages are free at once; the copy is the caller's to order first.
    assert_eq!(c.evict(4), 4);
    assert_eq!(c.allocator().available_size(), 16);
    let t = take_one(&c);
    assert_eq!(t.kind(), TransferKind::WriteBack);
    let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut dev, &mut host).unwrap();
    assert_eq!(dev, [a[0] / 2, a[2] / 2]);
    // Not host-evicted, not loaded back while the copy is on its way.
    assert_eq!(c.evict_host(4), 0);
    let mut out = [0u32; 4];
    let (lease, hit) = c.match_and_load(0, &[1, 2, 3, 4], &mut out, None);
    assert_eq!((lease.len(), hit.matched, hit.loaded), (0, 4, 0));
    drop(lease);
    c.check_invariants().unwrap();
    c.complete(t).unwrap();
    let (lease, hit) = c.match_and_load(0, &[1, 2, 3, 4], &mut out, None);
    assert_eq!((lease.len(), hit.loaded), (4, 4));
    let load = take_one(&c);
    assert_eq!((load.kind(), load.kind().to_host()), (TransferKind::Load, false));
    let (mut dev, mut host2) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(load, &mut dev, &mut host2).unwrap();
    assert_eq!((dev, host2), ([out[0] / 2, out[2] / 2], host));
    // The lease goes; the load still holds the node on the device.
    drop(lease);
    assert_eq!(c.evict(4), 0);
    assert_eq!(c.evict_host(4), 0);
    c.complete(load).unwrap();
    assert_eq!(c.evict(4), 4);
    assert_eq!(c.transfers_in_flight(), 0, "the host copy was kept: no second write-back");
    c.check_invariants().unwrap();
}

#[test]
fn host_pages_in_flight_outlive_their_node() {
    // [1..4] above [5, 6]; two host pages.
    let c = cache(16, 2, WritePolicy::WriteBack);
    let a = slots(&c, 6);
    c.insert(0, &[1, 2, 3, 4, 5, 6], &a).unwrap();
    let mut out = [0u32; 6];
    c.match_tiers(0, &[1, 2, 3, 4, 9, 9], &mut out);
    assert_eq!(c.node_count(), 2);
    assert_eq!(c.evict(2), 2); // [5, 6] written back: one host page in flight
    let t = take_one(&c);
    assert_eq!((c.node_count(), c.host_size()), (2, 2));
    // [1..4] needs two host pages: one is free, the other in flight and not evictable,
    // so its backup is refused and it goes with its host subtree. The page in flight
    // leaves the tree but stays allocated until its copy completes.
    assert_eq!(c.evict(4), 4);
    assert_eq!(c.counters().backup_refused, 1);
    assert_eq!((c.node_count(), c.host_size(), c.host_available()), (0, 2, 2));
    c.check_invariants().unwrap();
    c.complete(t).unwrap();
    assert_eq!((c.host_size(), c.host_available()), (0, 4));
    c.check_invariants().unwrap();
}

#[test]
fn reset_drops_transfers_not_taken() {
    let mut c = cache(16, 8, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.transfers_in_flight(), 1);
    c.reset().unwrap();
    assert_eq!(c.take_transfers(&mut [Transfer::default(); 2]), 0, "a dropped transfer is not reported");
    assert_eq!((c.transfers_in_flight(), c.host_size(), c.host_available()), (0, 0, 16));
    assert_eq!(c.allocator().available_size(), 16);
    c.check_invariants().unwrap();
}

/// Every device page the allocator can give, allocated and returned: none of them may
/// be one of `held`.
fn assert_not_handed_out(c: &HiRadixCache<PagedAllocator>, held: &[u32]) {
    let n = c.allocator().available_size();
    let got = slots(c, n);
    for s in &got {
        assert!(!held.contains(s), "slot {s} of a copy in flight was handed out again");
    }
    c.allocator().free(&got).unwrap();
}

#[test]
fn a_backup_taken_before_a_reset_keeps_its_pages_until_it_completes() {
    let mut c = cache(16, 8, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    let t = take_one(&c);
    assert_eq!((t.kind(), t.pages()), (TransferKind::Backup, 2));
    let (mut device, mut host) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut device, &mut host).unwrap();
    // The copy is running when the tree is reset: the device pages it reads and the
    // host pages it writes stay allocated, out of the tree.
    c.reset().unwrap();
    assert_eq!((c.total_size(), c.node_count(), c.transfers_in_flight()), (0, 0, 1));
    // Host sizes are in tokens: the transfer holds 2 of the 8 host pages.
    assert_eq!((c.host_size(), c.host_available()), (4, 12));
    assert_eq!(c.allocator().available_size(), 12);
    c.check_invariants().unwrap();
    assert_not_handed_out(&c, &a);
    // The caller can still ask for its pages.
    let (mut d2, mut h2) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut d2, &mut h2).unwrap();
    assert_eq!((d2, h2), (device, host));
    // The tree goes on working beside it.
    let b = slots(&c, 4);
    c.insert(0, &[5, 6, 7, 8], &b).unwrap();
    let u = take_one(&c);
    let (mut d3, mut h3) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(u, &mut d3, &mut h3).unwrap();
    assert!(h3.iter().all(|h| !host.contains(h)), "a host page in flight was given to a new backup");
    c.complete(u).unwrap();
    c.check_invariants().unwrap();
    // Complete: everything comes back, once.
    c.complete(t).unwrap();
    assert_eq!(c.complete(t), Err(TransferError::Unknown));
    assert_eq!(c.transfers_in_flight(), 0);
    assert_eq!((c.host_size(), c.host_available()), (4, 12)); // the second backup's copy
    assert_eq!(c.allocator().available_size() + c.total_size(), 16);
    c.check_invariants().unwrap();
    c.reset().unwrap();
    assert_eq!((c.host_available(), c.allocator().available_size()), (16, 16));
}

#[test]
fn a_load_taken_before_a_reset_keeps_the_device_pages_it_writes() {
    let mut c = cache(16, 8, WritePolicy::WriteThrough);
    let a = slots(&c, 6);
    c.insert(0, &[1, 2, 3, 4, 5, 6], &a).unwrap();
    settle(&c);
    assert_eq!(c.evict(6), 6);
    let mut out = [0u32; 6];
    let (lease, hit) = c.match_and_load(0, &[1, 2, 3, 4, 5, 6], &mut out, None);
    assert_eq!(hit.loaded, 6);
    drop(lease);
    let t = take_one(&c);
    assert_eq!((t.kind(), t.pages()), (TransferKind::Load, 3));
    let (mut device, mut host) = ([0u32; 3], [0u32; 3]);
    c.transfer_pages(t, &mut device, &mut host).unwrap();
    assert_eq!(device.iter().map(|&p| p * 2).collect::<Vec<_>>(), out.iter().step_by(2).copied().collect::<Vec<_>>());
    c.reset().unwrap();
    // The load's copy may still be writing the loaded slots: they are not handed out.
    assert_eq!((c.transfers_in_flight(), c.allocator().available_size()), (1, 10));
    assert_eq!(c.host_available(), 10);
    c.check_invariants().unwrap();
    assert_not_handed_out(&c, &out);
    c.complete(t).unwrap();
    assert_eq!((c.transfers_in_flight(), c.allocator().available_size(), c.host_available()), (0, 16, 16));
    c.check_invariants().unwrap();
}

#[test]
fn a_write_back_and_a_prefetch_taken_before_a_reset_keep_their_host_pages() {
    let mut c = cache(16, 8, WritePolicy::WriteBack);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.evict(4), 4);
    let mut out = [0u32; 4];
    assert_eq!(c.insert_host(0, &[9, 9, 9, 9], &mut out), 4);
    let mut t = [Transfer::default(); 4];
    assert_eq!(c.take_transfers(&mut t), 2);
    assert_eq!((t[0].kind(), t[1].kind()), (TransferKind::WriteBack, TransferKind::Prefetch));
    c.reset().unwrap();
    // The write-back's device pages were free before the reset (see `TransferKind`);
    // the host pages of both stay held.
    assert_eq!((c.transfers_in_flight(), c.host_available(), c.allocator().available_size()), (2, 8, 16));
    c.check_invariants().unwrap();
    c.complete(t[1]).unwrap();
    c.complete(t[0]).unwrap();
    assert_eq!((c.transfers_in_flight(), c.host_available(), c.allocator().available_size()), (0, 16, 16));
    c.check_invariants().unwrap();
}

#[test]
fn a_host_kv_pool_is_the_host_tier() {
    use crate::kv::host::{HostKvConfig, HostKvPool, HostLayout};
    use crate::kv::{KvConfig, KvDtype, KvLayout};
    let kv = |page_size| KvConfig {
        layout: KvLayout::Mha { head_num: 1, head_dim: 4 },
        dtype: KvDtype::F16,
        layer_num: 2,
        size: 16,
        page_size,
    };
    let pool = |page_size| {
        let cfg = HostKvConfig::with_ratio(kv(page_size), 1.0, HostLayout::PageFirst).unwrap();
        std::sync::Arc::new(HostKvPool::pageable(cfg).unwrap())
    };
    let make = |p| {
        HiRadixCache::with_host_pool(
            PagedAllocator::new(16, 2).unwrap(),
            ReqToTokenPool::new(2, 16).unwrap(),
            RadixConfig::default(),
            p,
            WritePolicy::WriteThrough,
            1,
        )
    };
    assert!(matches!(make(pool(4)), Err(ConfigError::HostPool { .. })));
    let used = pool(2);
    used.alloc_pages(&mut [0u32; 1]).unwrap();
    assert!(matches!(make(used), Err(ConfigError::HostPool { .. })));

    let p = pool(2);
    let c = make(p.clone()).unwrap();
    assert_eq!((c.host_tier().host_pages, c.host_available()), (8, 16));
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    let t = take_one(&c);
    let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut dev, &mut host).unwrap();
    // The tree's host pages are the pool's: a transfer copies into them.
    assert!(host.iter().all(|&h| p.is_allocated(h)));
    assert_eq!(p.available_pages(), 6);
    c.complete(t).unwrap();
    assert_eq!(c.evict(4), 4);
    assert_eq!(c.evict_host(4), 4);
    assert_eq!(p.available_pages(), 8);
    assert!(std::sync::Arc::ptr_eq(c.host_pool().unwrap(), &p));
    c.check_invariants().unwrap();
}

#[test]
fn insert_host_adds_a_host_continuation_loaded_once_filled() {
    let c = cache(32, 8, WritePolicy::WriteBack); // write_back: no backups on insert
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    let key = [1, 2, 3, 4, 5, 6, 7, 8];
    let mut out = [0u32; 8];
    assert_eq!(c.host_backed_len(0, &key), 0);
    assert_eq!(c.insert_host(0, &key, &mut out), 4);
    assert_eq!(c.insert_host(0, &key, &mut out), 0, "the tree holds all of it now");
    assert_eq!((c.node_count(), c.host_size(), c.counters().prefetched), (2, 4, 4));
    let m = c.match_tiers(0, &key, &mut out);
    assert_eq!((m.device.len(), m.host_len), (4, 4));
    // Lock-free lookups see only the device part.
    assert_eq!(c.peek_prefix(0, &key, &mut out), 4);
    c.check_invariants().unwrap();
    let t = take_one(&c);
    assert_eq!((t.kind(), t.pages(), t.kind().to_host()), (TransferKind::Prefetch, 2, true));
    let (mut dev, mut host) = ([9u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut dev, &mut host).unwrap();
    assert_eq!(dev, [0, 0], "a prefetch has no device side");
    // Not loaded back, not evicted from host, while its pages are being filled.
    let (lease, hit) = c.match_and_load(0, &key, &mut out, None);
    assert_eq!((lease.len(), hit.matched, hit.loaded), (4, 4, 0));
    drop(lease);
    assert_eq!(c.evict_host(4), 0);
    c.complete(t).unwrap();
    assert_eq!(c.host_backed_len(0, &key), 0, "the device part has no host copy");
    let (lease, hit) = c.match_and_load(0, &key, &mut out, None);
    assert_eq!((lease.len(), hit.loaded), (8, 4));
    assert_eq!(&out[..4], &a[..]);
    drop(lease);
    assert_eq!(settle(&c), 1); // the load
    c.check_invariants().unwrap();
}

#[test]
fn insert_host_makes_room_but_never_from_its_own_path() {
    // Two host pages. [1, 2] is host-only; a prefetch of [1, 2, 3, 4] needs one page.
    let c = cache(16, 2, WritePolicy::WriteThrough);
    let a = slots(&c, 2);
    c.insert(0, &[1, 2], &a).unwrap();
    settle(&c);
    assert_eq!(c.evict(2), 2);
    let b = slots(&c, 2);
    c.insert(0, &[7, 7], &b).unwrap();
    settle(&c);
    assert_eq!(c.evict(2), 2); // [7, 7] host-only too: the host is full
    let mut out = [0u32; 6];
    // [1, 2] is older than [7, 7], but it is the path: [7, 7] goes.
    assert_eq!(c.insert_host(0, &[1, 2, 3, 4], &mut out), 2);
    assert_eq!(c.counters().host_evicted, 2);
    let m = c.match_tiers(0, &[1, 2, 3, 4], &mut out);
    assert_eq!((m.device.len(), m.host_len), (0, 4));
    // No room for two more pages (both held): nothing added.
    assert_eq!(c.insert_host(0, &[1, 2, 3, 4, 5, 6], &mut out), 0);
    c.check_invariants().unwrap();
    assert_eq!(settle(&c), 1);
    assert_eq!(c.host_backed_len(0, &[1, 2, 3, 4, 5, 6]), 4);
    c.check_invariants().unwrap();
}

#[test]
fn a_prefetch_outlives_its_node() {
    // [1..4] on the device without a copy (no host room for it), a prefetched child.
    let c = cache(16, 1, WritePolicy::WriteThrough);
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    assert_eq!(c.counters().backup_refused, 1);
    let mut out = [0u32; 6];
    assert_eq!(c.insert_host(0, &[1, 2, 3, 4, 5, 6], &mut out), 2);
    let t = take_one(&c);
    // Evicting [1..4] removes it with its host subtree; the page being filled stays.
    assert_eq!(c.evict(4), 4);
    assert_eq!((c.node_count(), c.host_size()), (0, 2));
    c.check_invariants().unwrap();
    c.complete(t).unwrap();
    assert_eq!((c.host_size(), c.host_available()), (0, 2));
    c.check_invariants().unwrap();
}

/// An 8-page host pool of page size 2 (the device allocator's of `on_pool`).
fn host_pool() -> std::sync::Arc<crate::kv::host::HostKvPool> {
    use crate::kv::host::{HostKvConfig, HostKvPool, HostLayout};
    use crate::kv::{KvConfig, KvDtype, KvLayout};
    let kv = KvConfig {
        layout: KvLayout::Mha { head_num: 1, head_dim: 4 },
        dtype: KvDtype::F16,
        layer_num: 2,
        size: 16,
        page_size: 2,
    };
    let cfg = HostKvConfig::with_ratio(kv, 1.0, HostLayout::PageFirst).unwrap();
    std::sync::Arc::new(HostKvPool::pageable(cfg).unwrap())
}

fn on_pool(p: &std::sync::Arc<crate::kv::host::HostKvPool>) -> Result<HiRadixCache<PagedAllocator>, ConfigError> {
    HiRadixCache::with_host_pool(
        PagedAllocator::new(16, 2).unwrap(),
        ReqToTokenPool::new(2, 16).unwrap(),
        RadixConfig::default(),
        p.clone(),
        WritePolicy::WriteThrough,
        1,
    )
}

/// The pool's public `alloc_pages` / `free_pages` shared its allocator with the tree:
/// the caller could free host pages the tree held (a backup's in flight, then the
/// node's host copy) and get them back from `alloc_pages` — two owners of one page.
/// While a cache owns the pool both are refused, typed, and nothing changes; reading
/// and writing page bytes (the copy engine's part) still works.
#[test]
fn a_host_pool_refuses_page_calls_while_a_cache_owns_it() {
    use crate::error::{AllocError, FreeErrorKind, InvalidInput};
    let p = host_pool();
    let c = on_pool(&p).unwrap();
    assert!(p.is_owned());
    let a = slots(&c, 4);
    c.insert(0, &[1, 2, 3, 4], &a).unwrap();
    let t = take_one(&c);
    let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t, &mut dev, &mut host).unwrap();
    let refused = |c: &HiRadixCache<PagedAllocator>| {
        let e = p.free_pages(&host).unwrap_err();
        assert_eq!((e.index, e.kind, e.rest_freed), (host[0], FreeErrorKind::Cached, false));
        let free = (1..=8).find(|h| !p.is_allocated(*h)).unwrap();
        assert_eq!(p.free_pages(&[free]).unwrap_err().kind, FreeErrorKind::NotAllocated);
        assert!(matches!(p.free_pages(&[0]).unwrap_err().kind, FreeErrorKind::OutOfRange { first: 1, last: 8 }));
        assert_eq!(p.free_pages(&[]), Ok(()));
        let mut out = [7u32; 2];
        assert_eq!(p.alloc_pages(&mut out), Err(AllocError::Invalid(InvalidInput::HostPoolOwned)));
        assert_eq!(out, [7; 2], "out untouched");
        assert_eq!(p.available_pages(), 6);
        assert!(host.iter().all(|&h| p.is_allocated(h)));
        c.check_invariants().unwrap();
    };
    refused(&c); // in flight
    assert!(p.page_rows(host[0], 1, 1).is_ok(), "the copy engine reads the tree's pages");
    c.complete(t).unwrap();
    refused(&c); // the node's host copy
    assert_eq!(c.host_size(), 4);
}

/// `with_host_pool` only checked that every page was free: two caches over one pool
/// were both accepted, each counting the other's pages as its own (host_size wrong,
/// check_invariants failing). The second is refused now, until the first is dropped.
#[test]
fn a_second_cache_over_one_host_pool_is_refused() {
    let p = host_pool();
    let c1 = on_pool(&p).unwrap();
    assert!(matches!(on_pool(&p), Err(ConfigError::HostPool { .. })));
    assert!(p.is_owned(), "a refused cache leaves the first one's claim");
    let a = slots(&c1, 4);
    c1.insert(0, &[1, 2, 3, 4], &a).unwrap();
    settle(&c1);
    assert_eq!(c1.host_size(), 4);
    c1.check_invariants().unwrap();
    drop(c1);
    let c2 = on_pool(&p).unwrap();
    assert_eq!((c2.host_size(), c2.host_available()), (0, 16));
    c2.check_invariants().unwrap();
}

/// A cache built `with_host_pool` left the host pages its tree held allocated in the
/// pool when dropped: `available_pages` was wrong forever and a new cache over the
/// pool was refused. Dropping it returns them and releases the pool; pages of a
/// transfer taken and not completed stay allocated (the caller's copy may still touch
/// them) until the caller frees them, and a transfer never taken is freed with the rest.
#[test]
fn dropping_the_cache_gives_the_host_pool_back() {
    let p = host_pool();
    {
        let c = on_pool(&p).unwrap();
        let a = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &a).unwrap();
        settle(&c);
        assert_eq!(p.available_pages(), 6);
    }
    assert!(!p.is_owned());
    assert_eq!(p.available_pages(), 8, "the dropped cache's host pages are the pool's again");

    // Transfers in flight at drop: one handed out (its copy may be running), one not.
    let taken = {
        let c = on_pool(&p).unwrap();
        let a = slots(&c, 4);
        c.insert(0, &[1, 2, 3, 4], &a).unwrap();
        let t = take_one(&c);
        let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
        c.transfer_pages(t, &mut dev, &mut host).unwrap();
        let b = slots(&c, 6);
        c.insert(0, &[9, 9, 8, 8, 7, 7], &b).unwrap(); // a second backup, never taken
        assert_eq!((c.transfers_in_flight(), p.available_pages()), (2, 3));
        host
    };
    assert!(!p.is_owned());
    assert_eq!(p.available_pages(), 6, "only the taken transfer's pages stay");
    assert!(taken.iter().all(|&h| p.is_allocated(h)));
    assert!(matches!(on_pool(&p), Err(ConfigError::HostPool { .. })), "pages are allocated");
    // The copy is done: the caller frees them and the pool is whole.
    p.free_pages(&taken).unwrap();
    assert_eq!(p.available_pages(), 8);
    on_pool(&p).unwrap().check_invariants().unwrap();

    // A transfer taken before a reset is still in flight after it: completed, its pages
    // come back; dropped with the cache before that, they stay for the caller.
    for complete in [true, false] {
        let host = {
            let mut c = on_pool(&p).unwrap();
            let a = slots(&c, 4);
            c.insert(0, &[1, 2, 3, 4], &a).unwrap();
            let t = take_one(&c);
            let (mut dev, mut host) = ([0u32; 2], [0u32; 2]);
            c.transfer_pages(t, &mut dev, &mut host).unwrap();
            c.reset().unwrap();
            assert_eq!((c.transfers_in_flight(), p.available_pages()), (1, 6));
            c.check_invariants().unwrap();
            if complete {
                c.complete(t).unwrap();
                assert_eq!(p.available_pages(), 8);
            }
            host
        };
        assert!(!p.is_owned());
        if !complete {
            assert_eq!(p.available_pages(), 6);
            p.free_pages(&host).unwrap();
        }
        assert_eq!(p.available_pages(), 8);
    }
}

/// `match_and_load` evicted device nodes for a load-back before knowing whether its
/// allocation could succeed: with 8 evictable tokens and a 10-token host continuation
/// it evicted the 8 (dropping their device copies), then failed and loaded nothing. A
/// doomed load-back evicts nothing now (as a doomed allocation does).
#[test]
fn a_doomed_load_back_evicts_nothing() {
    let c = cache(16, 16, WritePolicy::WriteThrough);
    // K1: 10 tokens, backed up, then evicted to host.
    let k1: Vec<u32> = (1..=10).collect();
    let a = slots(&c, 10);
    c.insert(0, &k1, &a).unwrap();
    settle(&c);
    assert_eq!(c.evict(10), 10);
    // K2: 8 tokens, locked by a lease. K3: 8 tokens, evictable.
    let (k2, k3): (Vec<u32>, Vec<u32>) = ((50..58).collect(), (60..68).collect());
    let b = slots(&c, 8);
    c.insert(0, &k2, &b).unwrap();
    let b = slots(&c, 8);
    c.insert(0, &k3, &b).unwrap();
    settle(&c);
    let mut out = [0u32; 16];
    let (lease2, _) = c.match_and_load(0, &k2, &mut out, None);
    assert_eq!(lease2.len(), 8);
    assert_eq!((c.allocator().available_size(), c.evictable_size()), (0, 8));
    let before = (c.node_count(), c.host_size(), c.counters());
    // Loading K1 needs 10 device tokens: 8 at most can be made free.
    let (lease1, hit) = c.match_and_load(0, &k1, &mut out, None);
    assert_eq!((lease1.len(), hit.matched, hit.loaded), (0, 10, 0));
    assert_eq!(c.evictable_size(), 8, "a load-back that could not succeed evicted device KV");
    assert_eq!((c.node_count(), c.host_size(), c.counters()), before);
    assert_eq!(c.transfers_in_flight(), 0);
    c.check_invariants().unwrap();
    drop(lease1);
    // With room for it (K2's lease gone: 16 evictable), the same load succeeds.
    drop(lease2);
    let (lease1, hit) = c.match_and_load(0, &k1, &mut out, None);
    assert_eq!((lease1.len(), hit.loaded), (10, 10));
    c.check_invariants().unwrap();
}
