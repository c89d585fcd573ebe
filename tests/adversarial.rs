//! The public API as a hostile (but honest) downstream user sees it: the host tier's
//! transfers and host pool, the SWA request's window release, owned slot batches and
//! private magazines, request row pools, the replay configuration, trace files and the
//! store's page format.
//!
//! Each test either pins down a behaviour found sound (misuse refused with a typed
//! error, nothing changed) or demonstrates a finding that failed before its fix (the
//! comment above it says what happened then).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use kvpool::kv::host::{HostKvConfig, HostKvError, HostKvPool, HostLayout, HostPageFault};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};
use kvpool::radix::{
    CacheError, HiRadixCache, HostTier, RadixConfig, SwaRadixCache, Transfer, TransferError, TransferKind, WritePolicy,
};
use kvpool::replay::{HostTierConfig, ReplayConfig, ReplayError, Trace};
use kvpool::store::{check_page, Invalid, PageBinding, PageFormat, PageHeader, HEADER_BYTES};
use kvpool::{
    AllocError, ConfigError, FreeErrorKind, PagedAllocator, ReqToTokenPool, RowError, SlotCache, SlotPool, Slots,
    SlotsError,
};

// -------------------------------------------------------------------------------------
// Helpers
// -------------------------------------------------------------------------------------

fn hi(device: usize, ps: u32, host_pages: u32, write_policy: WritePolicy) -> Arc<HiRadixCache<PagedAllocator>> {
    let tier = HostTier { host_pages, write_policy, load_back_threshold: 1 };
    let c = HiRadixCache::with_host_tier(
        PagedAllocator::new(device, ps).unwrap(),
        ReqToTokenPool::new(4, device).unwrap(),
        RadixConfig::default(),
        tier,
    );
    Arc::new(c.unwrap())
}

/// A request for `key` served and finished: `key`'s whole pages are cached.
fn put(c: &Arc<HiRadixCache<PagedAllocator>>, key: &[u32]) {
    let mut r = c.admit(0, key).unwrap();
    r.extend(key.len() - r.len()).unwrap();
    r.finish(key).unwrap();
}

fn take_all(c: &HiRadixCache<PagedAllocator>) -> Vec<Transfer> {
    let mut buf = [Transfer::default(); 64];
    let n = c.take_transfers(&mut buf);
    buf[..n].to_vec()
}

fn kv_config(size: usize, page_size: u32) -> KvConfig {
    KvConfig { layout: KvLayout::Mha { head_num: 1, head_dim: 4 }, dtype: KvDtype::F16, layer_num: 2, size, page_size }
}

fn host_pool(device_size: usize, page_size: u32, host_pages: usize) -> Arc<HostKvPool> {
    let cfg = HostKvConfig { kv: kv_config(device_size, page_size), host_pages, layout: HostLayout::PageFirst };
    Arc::new(HostKvPool::pageable(cfg).unwrap())
}

// -------------------------------------------------------------------------------------
// HiRadixCache transfers: every handle misuse is a typed error that changes nothing.
// -------------------------------------------------------------------------------------

#[test]
fn transfer_handles_completed_twice_foreign_default_or_after_reset_are_refused() {
    let mut a = hi(16, 2, 8, WritePolicy::WriteThrough);
    let b = hi(16, 2, 8, WritePolicy::WriteThrough);
    put(&a, &[1, 2, 3, 4]);
    let t = take_all(&a);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].kind(), TransferKind::Backup);
    // Taken once: a second take reports nothing.
    assert!(take_all(&a).is_empty());

    // Another cache, a placeholder, short buffers: refused, nothing changes.
    assert_eq!(b.complete(t[0]), Err(TransferError::ForeignCache));
    assert_eq!(b.transfer_pages(t[0], &mut [0; 2], &mut [0; 2]), Err(TransferError::ForeignCache));
    assert_eq!(a.complete(Transfer::default()), Err(TransferError::ForeignCache));
    assert_eq!(a.transfer_pages(Transfer::default(), &mut [], &mut []), Err(TransferError::ForeignCache));
    let (mut d, mut h) = ([7u32; 2], [7u32; 1]);
    assert_eq!(a.transfer_pages(t[0], &mut d, &mut h), Err(TransferError::BufferTooShort { need: 2, got: 1 }));
    assert_eq!((d, h), ([7; 2], [7; 1]), "a refused transfer_pages writes nothing");
    assert_eq!(a.transfers_in_flight(), 1);
    assert_eq!(a.evict(4), 0, "the backup still locks its node");
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();

    // Completed once, then refused.
    a.complete(t[0]).unwrap();
    assert_eq!(a.complete(t[0]), Err(TransferError::Unknown));
    assert_eq!(a.transfer_pages(t[0], &mut [0; 2], &mut [0; 2]), Err(TransferError::Unknown));
    assert_eq!(a.transfers_in_flight(), 0);
    a.check_invariants().unwrap();

    // A transfer taken before a reset outlives it (its copy may be running) and
    // completes once; one not taken is dropped. A handle whose slot was reused (a new
    // generation) is refused.
    put(&a, &[9, 9, 9, 9]);
    let t2 = take_all(&a);
    assert_eq!(t2.len(), 1);
    Arc::get_mut(&mut a).expect("no request is live").reset().unwrap();
    assert_eq!(a.transfers_in_flight(), 1);
    a.check_invariants().unwrap();
    a.complete(t2[0]).unwrap();
    assert_eq!(a.complete(t2[0]), Err(TransferError::Unknown));
    assert_eq!(a.transfers_in_flight(), 0);
    put(&a, &[9, 9, 9, 9]);
    Arc::get_mut(&mut a).expect("no request is live").reset().unwrap();
    assert_eq!((a.transfers_in_flight(), take_all(&a).len()), (0, 0), "a transfer not taken is dropped");
    put(&a, &[9, 9, 9, 9]);
    let t3 = take_all(&a);
    assert_eq!(t3.len(), 1);
    assert_eq!(a.complete(t2[0]), Err(TransferError::Unknown), "an old handle does not name the new transfer");
    assert_eq!(a.complete(t[0]), Err(TransferError::Unknown));
    a.complete(t3[0]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.allocator().available_size() + a.total_size(), 16);
}

/// Under `write_back` a device eviction starts a write-back whose host pages are held
/// until it completes: host eviction and host pressure from other backups leave them,
/// and a load of that node waits for it.
#[test]
fn host_pressure_never_takes_pages_of_a_write_back_in_flight() {
    let c = hi(8, 2, 2, WritePolicy::WriteBack);
    put(&c, &[1, 2, 3, 4]);
    assert_eq!(c.evict(4), 4);
    let t = take_all(&c);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].kind(), TransferKind::WriteBack);
    assert_eq!(c.host_available(), 0);
    // Host eviction passes over it.
    assert_eq!(c.evict_host(usize::MAX), 0);
    // Another node's write-back finds no host room: the node is dropped, the pages in
    // flight stay.
    put(&c, &[5, 6, 7, 8]);
    assert_eq!(c.evict(8), 4);
    assert!(take_all(&c).is_empty());
    assert_eq!(c.counters().backup_refused, 1);
    // Not loaded back while in flight.
    let r = c.admit(0, &[1, 2, 3, 4]).unwrap();
    assert_eq!((r.cached_len(), r.host_hit().matched, r.host_hit().loaded), (0, 4, 0));
    drop(r);
    c.check_invariants().unwrap();
    c.complete(t[0]).unwrap();
    let r = c.admit(0, &[1, 2, 3, 4]).unwrap();
    assert_eq!((r.cached_len(), r.host_hit().loaded), (4, 4));
    let t = take_all(&c);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].kind(), TransferKind::Load);
    drop(r);
    assert_eq!(c.evict(4), 0, "the load locks its node until it completes");
    c.complete(t[0]).unwrap();
    assert_eq!(c.evict(4), 4);
    c.check_invariants().unwrap();
}

/// A prefetched host-only node whose transfer is in flight, then removed with its
/// parent (a device eviction of a node without a host copy): its pages stay allocated
/// until the transfer completes, then go back.
#[test]
fn a_prefetch_in_flight_outlives_its_node() {
    let c = hi(8, 2, 4, WritePolicy::WriteBack);
    put(&c, &[1, 2]);
    let mut out = [0u32; 6];
    assert_eq!(c.insert_host(0, &[1, 2, 3, 4, 5, 6], &mut out), 4);
    let t = take_all(&c);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].kind(), TransferKind::Prefetch);
    let (mut d, mut h) = ([9u32; 2], [0u32; 2]);
    c.transfer_pages(t[0], &mut d, &mut h).unwrap();
    assert_eq!(d, [0, 0], "a prefetch has no device pages");
    // Fill the host so the parent's write-back finds no room: it is removed with its
    // host-only child.
    assert_eq!(c.host_available(), 4);
    let mut out2 = [0u32; 4];
    assert_eq!(c.insert_host(0, &[7, 8, 9, 10], &mut out2), 4);
    let t2 = take_all(&c);
    assert_eq!(c.evict(2), 2);
    c.check_invariants().unwrap();
    assert_eq!(c.host_size(), 8, "pages in flight stay allocated");
    c.complete(t[0]).unwrap();
    c.complete(t2[0]).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.evict_host(usize::MAX), 4);
    assert_eq!(c.host_size(), 0);
}

/// Dropping a cache over a caller's host pool with a transfer taken and not complete
/// keeps that transfer's pages (the copy may still touch them) and frees the rest; the
/// caller frees them once its copy is done, and the pool is whole again.
#[test]
fn a_dropped_cache_keeps_only_the_pages_of_transfers_in_the_callers_hands() {
    let pool = host_pool(16, 2, 8);
    let c = HiRadixCache::with_host_pool(
        PagedAllocator::new(16, 2).unwrap(),
        ReqToTokenPool::new(2, 16).unwrap(),
        RadixConfig::default(),
        Arc::clone(&pool),
        WritePolicy::WriteThrough,
        1,
    );
    let c = Arc::new(c.unwrap());
    put(&c, &[1, 2, 3, 4]);
    put(&c, &[5, 6, 7, 8]);
    let mut one = [Transfer::default(); 1];
    assert_eq!(c.take_transfers(&mut one), 1); // the second stays queued, never taken
    let (mut d, mut h) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(one[0], &mut d, &mut h).unwrap();
    assert_eq!(pool.free_pages(&h).unwrap_err().kind, FreeErrorKind::Cached, "the cache owns them");
    drop(c);
    assert!(!pool.is_owned());
    assert_eq!(pool.available_pages(), 6);
    assert!(h.iter().all(|&p| pool.is_allocated(p)));
    pool.free_pages(&h).unwrap();
    assert_eq!(pool.available_pages(), 8);
    assert!(pool.free_pages(&h).is_err(), "freed once");
}

// Finding: `with_host_pool` checked the pool's page size but not its device side. A
// pool made for a smaller device cache than the allocator was accepted, and the tree's
// transfers then named device pages the pool (and its copy engine) refuse: a backup
// that can never be carried out, so never completed, its node locked for good.
#[test]
fn a_host_pool_for_a_smaller_device_cache_is_refused() {
    let pool = host_pool(16, 2, 8); // device pages 1..=8
    let r = HiRadixCache::with_host_pool(
        PagedAllocator::new(64, 2).unwrap(), // device pages 1..=32
        ReqToTokenPool::new(2, 64).unwrap(),
        RadixConfig::default(),
        Arc::clone(&pool),
        WritePolicy::WriteThrough,
        1,
    );
    let Err(e) = r else {
        // What the caller would then meet: a transfer whose pages the pool refuses (a
        // request holding the first 60 slots, the key cached in the last 4).
        let c = Arc::new(r.unwrap());
        let mut low = c.admit(0, &[]).unwrap();
        low.extend(60).unwrap();
        put(&c, &[1, 2, 3, 4]);
        drop(low);
        let t = take_all(&c);
        let (mut d, mut h) = ([0u32; 2], [0u32; 2]);
        c.transfer_pages(t[0], &mut d, &mut h).unwrap();
        panic!("accepted; its transfer's pages {d:?} -> {h:?}: {:?}", pool.check_pairs(&d, &h));
    };
    assert!(matches!(e, ConfigError::HostPool { .. }), "{e:?}");
    assert!(!pool.is_owned(), "a refused construction leaves the pool as it was");
    // A pool for a device cache at least as large is fine.
    let big = host_pool(64, 2, 8);
    let c = HiRadixCache::with_host_pool(
        PagedAllocator::new(64, 2).unwrap(),
        ReqToTokenPool::new(2, 64).unwrap(),
        RadixConfig::default(),
        Arc::clone(&big),
        WritePolicy::WriteThrough,
        1,
    );
    let c = Arc::new(c.unwrap());
    put(&c, &[1, 2, 3, 4]);
    let t = take_all(&c);
    let (mut d, mut h) = ([0u32; 2], [0u32; 2]);
    c.transfer_pages(t[0], &mut d, &mut h).unwrap();
    big.check_pairs(&d, &h).unwrap();
    c.complete(t[0]).unwrap();
}

// -------------------------------------------------------------------------------------
// HostKvPool used directly.
// -------------------------------------------------------------------------------------

#[test]
fn host_pool_calls_refuse_bad_pages_shapes_and_layers() {
    let pool = host_pool(16, 2, 4);
    let mut pool = Arc::try_unwrap(pool).unwrap();
    let page = |p, fault| HostKvError::HostPage { page: p, fault };
    assert_eq!(pool.check_page(0), Err(page(0, HostPageFault::OutOfRange)));
    assert_eq!(pool.check_page(5), Err(page(5, HostPageFault::OutOfRange)));
    assert_eq!(pool.check_page(1), Err(page(1, HostPageFault::NotAllocated)));
    let pb = pool.config().page_bytes();
    assert!(pool.read_page(1, &mut vec![0u8; pb]).is_err());
    assert!(pool.write_page(u32::MAX, &vec![0u8; pb]).is_err());
    assert!(pool.page_rows(1, 0, 0).is_err());
    // Too many pages: nothing allocated.
    let mut five = [0u32; 5];
    assert!(matches!(pool.alloc_pages(&mut five), Err(AllocError::OutOfMemory(_))));
    assert_eq!((five, pool.available_pages()), ([0; 5], 4));
    let mut two = [0u32; 2];
    pool.alloc_pages(&mut two).unwrap();
    // Wrong buffer lengths, layers, buffers: refused, nothing written.
    assert!(matches!(pool.write_page(two[0], &vec![1u8; pb + 1]), Err(HostKvError::Shape { .. })));
    assert!(matches!(pool.page_rows(two[0], 2, 0), Err(HostKvError::Shape { .. })));
    assert!(matches!(pool.page_rows(two[0], 0, 2), Err(HostKvError::Shape { .. })));
    assert!(matches!(pool.page_rows_mut(two[0], 0, u32::MAX), Err(HostKvError::Shape { .. })));
    assert!(pool.as_bytes().iter().all(|&b| b == 0));
    let layer = pool.config().kv.layer_bytes();
    let dev: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8 + 1; layer]).collect();
    let dref: Vec<&[u8]> = dev.iter().map(|v| &v[..]).collect();
    assert!(matches!(pool.backup(&dref, &[1, 2], &[two[0]]), Err(HostKvError::Shape { .. })));
    assert!(matches!(pool.backup(&dref, &[0], &[two[0]]), Err(HostKvError::DevicePage { .. })));
    assert!(matches!(pool.backup(&dref, &[9], &[two[0]]), Err(HostKvError::DevicePage { .. })));
    assert!(matches!(pool.backup(&dref[..3], &[1], &[two[0]]), Err(HostKvError::Shape { .. })));
    assert!(matches!(pool.backup(&dref, &[1, 2], &[two[0], 4]), Err(HostKvError::HostPage { .. })));
    assert!(pool.as_bytes().iter().all(|&b| b == 0));
    pool.backup(&dref, &[8, 1], &[two[0], two[1]]).unwrap();
    let mut back: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; layer]).collect();
    {
        let mut bref: Vec<&mut [u8]> = back.iter_mut().map(|v| &mut v[..]).collect();
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 2..1;
        assert!(matches!(pool.load(&mut bref, &[two[0]], &[8], reversed), Err(HostKvError::Layers { .. })));
        assert!(matches!(pool.load(&mut bref, &[two[0]], &[8], 0..3), Err(HostKvError::Layers { .. })));
        pool.load(&mut bref, &[two[0]], &[8], 0..2).unwrap();
    }
    let chunk = pool.config().chunk_bytes();
    assert!(back[0][8 * chunk..9 * chunk].iter().all(|&b| b == 1));
    // Double and out-of-range frees: refused whole.
    pool.free_pages(&two).unwrap();
    assert_eq!(pool.free_pages(&two[..1]).unwrap_err().kind, FreeErrorKind::NotAllocated);
    assert!(pool.free_pages(&[0]).is_err());
    assert!(pool.free_pages(&[5]).is_err());
    assert_eq!(pool.available_pages(), 4);
}

// -------------------------------------------------------------------------------------
// The SWA request's window release at its edges.
// -------------------------------------------------------------------------------------

fn swa(full: usize, window_pool: usize, ps: u32, window: usize) -> Arc<SwaRadixCache> {
    let c = SwaRadixCache::with_window(
        kvpool::alloc::SwaAllocator::new(full, window_pool, ps).unwrap(),
        ReqToTokenPool::new(4, full).unwrap(),
        RadixConfig::default(),
        window,
    );
    Arc::new(c.unwrap())
}

/// A request's window release frees only whole pages it holds past its lock, once: a
/// range over its locked prefix (the tree's window KV), a reversed, empty or partial
/// range, or pages released already free nothing; a range past what it holds is
/// refused with nothing changed.
#[test]
fn a_window_release_frees_only_the_requests_own_pages_once() {
    let c = swa(32, 32, 2, 4);
    let avail = |c: &SwaRadixCache| (c.allocator().full_available_size(), c.allocator().window_available_size());
    let key: Vec<u32> = (1..=8).collect();
    let mut first = c.admit(0, &key[..4]).unwrap();
    first.extend(4).unwrap();
    first.finish(&key[..4]).unwrap();
    let mut r = c.admit(0, &key).unwrap();
    assert_eq!(r.cached_len(), 4);
    r.extend(4).unwrap();
    let before = (avail(&c), c.leaf_paths());
    assert_eq!(r.release_window(0..4), Ok(0), "the locked prefix is the tree's");
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 6..2;
    assert_eq!(r.release_window(reversed), Ok(0));
    assert_eq!(r.release_window(6..6), Ok(0));
    assert_eq!(r.release_window(3..5), Ok(0), "no whole page of the request's own");
    assert_eq!(r.release_window(0..usize::MAX), Err(CacheError::TokenCount { tokens: usize::MAX, held: 8 }));
    assert_eq!(r.release_window(0..9), Err(CacheError::TokenCount { tokens: 9, held: 8 }));
    assert_eq!((avail(&c), c.leaf_paths()), before);
    assert_eq!(r.release_window(0..6), Ok(2));
    assert_eq!(r.release_window(0..6), Ok(0), "pages freed already are skipped");
    assert_eq!(avail(&c), (before.0 .0, before.0 .1 + 2));
    r.finish(&key).unwrap();
    c.check_invariants().unwrap();
    c.evict(usize::MAX);
    assert_eq!(avail(&c), (32, 32));
}

// -------------------------------------------------------------------------------------
// Owned batches and private magazines.
// -------------------------------------------------------------------------------------

#[test]
fn batches_moved_between_pools_and_caches_are_refused_whole() {
    let p = SlotPool::new(64);
    let q = SlotPool::new(64);
    let mut from_p = Slots::with_capacity(8);
    p.alloc_slots(8, &mut from_p).unwrap();
    // Into another pool, another pool's cache, or topped up from them: refused.
    assert_eq!(q.free_slots(&mut from_p), Err(SlotsError::OtherPool));
    assert_eq!(q.free_slots_tail(&mut from_p, 1), Err(SlotsError::OtherPool));
    let mut qc = SlotCache::new(&q, 16).unwrap();
    assert_eq!(qc.free_slots(&mut from_p), Err(SlotsError::OtherPool));
    assert_eq!(qc.free_slots_tail(&mut from_p, 2), Err(SlotsError::OtherPool));
    let mut big = Slots::with_capacity(16);
    p.alloc_slots(1, &mut big).unwrap();
    assert_eq!(qc.alloc_slots(1, &mut big), Err(SlotsError::OtherPool));
    assert_eq!(q.alloc_slots(1, &mut big), Err(SlotsError::OtherPool));
    assert_eq!((from_p.len(), big.len(), q.available(), qc.len()), (8, 1, 64, 0));
    // A bare free of an owned index is a double free.
    assert!(p.free(&from_p[..1]).is_err());
    // Through p's cache: fine, whoever filled it.
    let mut pc = SlotCache::new(&p, 4).unwrap();
    assert_eq!(pc.free_slots(&mut from_p), Ok(8));
    assert_eq!(pc.free_slots(&mut from_p), Ok(0), "emptied: a second free returns nothing");
    assert_eq!(pc.free_slots_tail(&mut big, 2), Err(SlotsError::TooMany { requested: 2, len: 1 }));
    pc.free_slots_tail(&mut big, 1).unwrap();
    drop(pc);
    assert_eq!(p.available(), 64);
    p.check_invariants().unwrap();
    q.check_invariants().unwrap();
    drop(qc);
}

#[test]
fn slot_cache_capacity_edges() {
    let p = SlotPool::new(16);
    // Capacity 0: every batch goes straight through.
    let mut c0 = SlotCache::new(&p, 0).unwrap();
    let mut b = Slots::with_capacity(16);
    c0.alloc_slots(16, &mut b).unwrap();
    assert!(matches!(c0.alloc_slots(1, &mut Slots::with_capacity(1)), Err(SlotsError::OutOfMemory(_))));
    assert_eq!(c0.free_slots(&mut b), Ok(16));
    assert_eq!((c0.len(), p.available()), (0, 16));
    // A capacity past the pool's is cut to it.
    let mut huge = SlotCache::new(&p, usize::MAX).unwrap();
    assert_eq!(huge.capacity(), 16);
    huge.alloc_slots(3, &mut b).unwrap();
    assert_eq!(huge.available(), 13);
    assert!(matches!(huge.alloc_slots(14, &mut Slots::with_capacity(14)), Err(SlotsError::OutOfMemory(_))));
    assert_eq!(
        huge.alloc_slots(1, &mut Slots::with_capacity(0)),
        Err(SlotsError::Full { requested: 1, len: 0, capacity: 0 })
    );
    huge.alloc_slots(0, &mut Slots::with_capacity(0)).unwrap();
    huge.free_slots(&mut b).unwrap();
    drop(huge);
    assert_eq!(p.available(), 16);
    // A pool without magazines refuses caches and owned batches.
    let bare = SlotPool::without_magazines(4);
    assert!(matches!(SlotCache::new(&bare, 4), Err(SlotsError::Unsupported)));
    assert_eq!(bare.alloc_slots(1, &mut b), Err(SlotsError::Unsupported));
    // A zero-capacity pool: no magazines, so no cache either.
    let empty = SlotPool::new(0);
    assert!(matches!(SlotCache::new(&empty, 8), Err(SlotsError::Unsupported)));
    assert!(matches!(empty.alloc_slots(1, &mut b), Err(SlotsError::Unsupported)));
    p.check_invariants().unwrap();
    // A batch from before a clear is refused by the cleared pool and its caches.
    let mut p = SlotPool::new(8);
    let mut old = Slots::with_capacity(4);
    p.alloc_slots(4, &mut old).unwrap();
    p.clear();
    assert_eq!(p.free_slots(&mut old), Err(SlotsError::OtherPool));
    let mut pc = SlotCache::new(&p, 4).unwrap();
    assert_eq!(pc.free_slots(&mut old), Err(SlotsError::OtherPool));
    drop(pc);
    assert_eq!(p.available(), 8);
}

// -------------------------------------------------------------------------------------
// Request row pools of hostile sizes.
// -------------------------------------------------------------------------------------

#[test]
fn request_row_pools_of_hostile_sizes_are_errors() {
    assert!(matches!(ReqToTokenPool::new(u32::MAX, usize::MAX), Err(ConfigError::TooLarge { .. })));
    assert!(matches!(ReqToTokenPool::new(2, 0), Err(ConfigError::Zero(_))));
    let none = ReqToTokenPool::new(0, 4).unwrap();
    assert!(none.alloc().is_err());
    let p = ReqToTokenPool::new(1, 4).unwrap();
    let mut r = p.alloc().unwrap();
    assert!(matches!(p.write(&mut r, usize::MAX, &[1]), Err(RowError::OutOfBounds { .. })));
    assert!(matches!(p.read(&r, usize::MAX..usize::MAX), Err(RowError::OutOfBounds { .. })));
    p.free(r).unwrap();
}

// -------------------------------------------------------------------------------------
// The replay configuration with hostile values.
// -------------------------------------------------------------------------------------

fn one_request_trace() -> Trace {
    Trace::from_jsonl_str("{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "t").unwrap()
}

// Finding: `HostTierConfig::validate(0)` divided by the page size: a panic
// ("attempt to divide by zero") from a public check.
#[test]
fn host_tier_validation_with_page_size_zero_is_an_error() {
    for tokens in [0, 1, 1024, usize::MAX] {
        let r = catch_unwind(AssertUnwindSafe(|| HostTierConfig::new(tokens).validate(0)));
        let r = r.unwrap_or_else(|_| panic!("validate(0) panicked for {tokens} host tokens"));
        assert!(matches!(r, Err(ReplayError::Config(_))), "{r:?}");
    }
}

#[test]
fn hostile_replay_configurations_are_config_errors() {
    let trace = one_request_trace();
    let bad = |c: ReplayConfig| {
        let r = catch_unwind(AssertUnwindSafe(|| c.validate(&trace)));
        let r = r.unwrap_or_else(|_| panic!("validate panicked for {c:?}"));
        assert!(matches!(r, Err(ReplayError::Config(_))), "{c:?}: {r:?}");
        let bytes = catch_unwind(AssertUnwindSafe(|| c.memory_bytes(&trace)));
        assert!(bytes.is_ok(), "memory_bytes panicked for {c:?}");
    };
    let d = ReplayConfig::default;
    bad(ReplayConfig { capacity_tokens: 0, ..d() });
    bad(ReplayConfig { page_size: 0, ..d() });
    bad(ReplayConfig { page_size: u32::MAX, ..d() });
    bad(ReplayConfig { capacity_tokens: usize::MAX, ..d() });
    bad(ReplayConfig { capacity_tokens: usize::MAX, page_size: u32::MAX, ..d() });
    bad(ReplayConfig { max_running: 0, ..d() });
    bad(ReplayConfig { max_running: usize::MAX, ..d() });
    bad(ReplayConfig { routers: usize::MAX, ..d() });
    bad(ReplayConfig { lookahead: Some(usize::MAX), ..d() });
    let host = |tokens| Some(HostTierConfig::new(tokens));
    let seq = kvpool::replay::Mode::Sequential;
    bad(ReplayConfig { mode: seq, host: host(0), ..d() });
    bad(ReplayConfig { mode: seq, host: host(usize::MAX), ..d() });
    bad(ReplayConfig { mode: seq, page_size: 0, host: host(16), ..d() });
}

// Finding: the replay probes the memory it will reserve before building anything
// (`memory_bytes`), but did not count the host tier: a large --host-capacity-tokens
// reached the reference tree's free-page set (16 GiB for 2^32 pages) and aborted the
// process ("memory allocation of ... bytes failed"). Now it is a config error naming
// the option.
#[test]
fn a_host_tier_too_large_for_memory_is_counted_before_the_replay() {
    let trace = one_request_trace();
    let small = ReplayConfig {
        mode: kvpool::replay::Mode::Sequential,
        page_size: 1,
        capacity_tokens: 1024,
        host: Some(HostTierConfig::new(2048)),
        ..ReplayConfig::default()
    };
    for cache in [kvpool::replay::CacheKind::Kvpool, kvpool::replay::CacheKind::Reference] {
        let huge = ReplayConfig { cache, host: Some(HostTierConfig::new(u32::MAX as usize)), ..small.clone() };
        huge.validate(&trace).unwrap();
        let (s, h) = (ReplayConfig { cache, ..small.clone() }.memory_bytes(&trace), huge.memory_bytes(&trace));
        assert!(h >= s + 16 * (u32::MAX as u64 - 2048), "{cache:?}: {s} -> {h}: the host tier is not counted");
    }
    // The command line, its address space limited to 2 GiB: it aborted ("memory
    // allocation of 8000000000 bytes failed") with the reference tree.
    let trace = std::env::temp_dir().join(format!("kvpool-adversarial-{}.jsonl", std::process::id()));
    std::fs::write(&trace, "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n").unwrap();
    for cache in ["reference", "kvpool"] {
        let out = std::process::Command::new("sh")
            .args(["-c", "ulimit -v 2097152 && exec \"$@\"", "sh", env!("CARGO_BIN_EXE_kvpool"), "replay", "--trace"])
            .arg(&trace)
            .args(["--cache", cache, "--page-size", "1", "--capacity-tokens", "1024"])
            .args(["--host-capacity-tokens", "2000000000"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cache}: {stderr}");
        assert!(stderr.contains("more than this machine can allocate"), "{cache}: {stderr}");
        assert!(stderr.contains("--host-capacity-tokens") && !stderr.contains("panicked"), "{cache}: {stderr}");
    }
    let _ = std::fs::remove_file(&trace);
}

// -------------------------------------------------------------------------------------
// The store's page format.
// -------------------------------------------------------------------------------------

#[test]
fn page_checks_refuse_every_damage_without_panicking() {
    let hash = [7u8; 32];
    let format = PageFormat { page_size: 2, bytes_per_token: 3 };
    let b = PageBinding::new("ns", "model", "", format);
    let payload = [1u8, 2, 3, 4, 5, 6];
    let h = PageHeader::new(&b, &hash, [&payload[..2], &payload[2..]].into_iter());
    let value = [h.as_bytes(), &payload[..]].concat();
    assert_eq!(check_page(&b, &hash, &value), Ok(&payload[..]));
    for n in 0..value.len() {
        assert!(check_page(&b, &hash, &value[..n]).is_err(), "truncated at {n}");
    }
    assert!(check_page(&b, &hash, &[value.as_slice(), &[0]].concat()).is_err());
    assert!(matches!(check_page(&b, &[8u8; 32], &value), Err(Invalid::Foreign { page: true, .. })));
    for i in 0..value.len() {
        let mut v = value.clone();
        v[i] ^= 0x40;
        assert!(check_page(&b, &hash, &v).is_err(), "byte {i} flipped");
    }
    // Formats at the edges: a payload too large for memory, empty pages.
    let huge = PageFormat { page_size: u32::MAX, bytes_per_token: u64::MAX };
    assert_eq!(huge.page_bytes(), usize::MAX);
    assert_eq!(huge.value_bytes(), usize::MAX);
    assert!(check_page(&PageBinding::new("ns", "model", "", huge), &hash, &value).is_err());
    let empty = PageBinding::new("ns", "model", "", PageFormat { page_size: 0, bytes_per_token: 0 });
    let h = PageHeader::new(&empty, &hash, core::iter::empty());
    assert_eq!(check_page(&empty, &hash, h.as_bytes()), Ok(&[][..]));
    assert_eq!(HEADER_BYTES, h.as_bytes().len());
}

#[test]
fn backoff_waits_are_total() {
    use kvpool::store::BackoffConfig;
    use std::time::Duration;
    for cfg in [
        BackoffConfig::default(),
        BackoffConfig { initial: Duration::MAX, max: Duration::MAX },
        BackoffConfig { initial: Duration::ZERO, max: Duration::ZERO },
        BackoffConfig { initial: Duration::from_secs(10), max: Duration::from_secs(1) },
    ] {
        for f in [0, 1, 2, 31, 32, u32::MAX] {
            assert!(cfg.wait(f) <= cfg.max, "{cfg:?} {f}");
        }
    }
}

// -------------------------------------------------------------------------------------
// More of the host tier's surface with malformed input: errors, nothing changed.
// -------------------------------------------------------------------------------------

#[test]
fn host_tier_calls_with_malformed_input_change_nothing() {
    let c = hi(16, 2, 4, WritePolicy::WriteThrough);
    put(&c, &[1, 2, 3, 4]);
    let t = take_all(&c);
    // A buffer longer than the transfer: only its pages are written.
    let (mut d, mut h) = ([u32::MAX; 5], [u32::MAX; 5]);
    assert_eq!(c.transfer_pages(t[0], &mut d, &mut h), Ok(2));
    assert_eq!((&d[2..], &h[2..]), (&[u32::MAX; 3][..], &[u32::MAX; 3][..]));
    c.complete(t[0]).unwrap();
    // Short outputs cut the key; odd lengths are cut to whole pages.
    let mut out = [0u32; 3];
    let m = c.match_tiers(0, &[1, 2, 3, 4], &mut out);
    assert_eq!((m.device.len(), m.host_len), (2, 0));
    let r = c.admit(0, &[1, 2, 3]).unwrap();
    assert_eq!((r.cached_len(), r.host_hit().loaded), (2, 0));
    drop(r);
    assert_eq!(c.insert_host(0, &[1, 2, 3, 4, 5, 6], &mut out), 0);
    assert_eq!(c.host_backed_len(0, &[1, 2, 3]), 2);
    assert_eq!(c.host_backed_len(0, &[]), 0);
    assert_eq!(c.evict_host(0), 0);
    assert_eq!(c.take_transfers(&mut []), 0);
    c.check_invariants().unwrap();
}

#[test]
fn host_tiers_of_hostile_sizes() {
    // No host pages: every backup is refused, nothing in flight, no panic.
    let c = hi(8, 2, 0, WritePolicy::WriteThrough);
    put(&c, &[1, 2, 3, 4]);
    assert_eq!((c.transfers_in_flight(), c.counters().backup_refused), (0, 1));
    let mut out = [0u32; 4];
    assert_eq!(c.insert_host(0, &[9, 9, 9, 9], &mut out), 0);
    assert_eq!(c.evict(4), 4);
    c.check_invariants().unwrap();
    let wb = hi(8, 2, 0, WritePolicy::WriteBack);
    put(&wb, &[1, 2, 3, 4]);
    assert_eq!(wb.evict(4), 4);
    wb.check_invariants().unwrap();
    // Host page numbers past u32: a config error.
    let tier = HostTier { host_pages: u32::MAX, write_policy: WritePolicy::WriteBack, load_back_threshold: 0 };
    let r = HiRadixCache::with_host_tier(
        PagedAllocator::new(16, 1).unwrap(),
        ReqToTokenPool::new(1, 16).unwrap(),
        RadixConfig::default(),
        tier,
    );
    assert!(matches!(r, Err(ConfigError::TooLarge { .. } | ConfigError::TooLargeForMemory { .. })), "{r:?}");
}

// -------------------------------------------------------------------------------------
// The SWA cache's allocator view at the edges of the slot space.
// -------------------------------------------------------------------------------------

#[test]
fn the_swa_allocator_view_is_total() {
    let c = swa(16, 16, 2, 4);
    let v = c.allocator();
    for slot in [0, 1, 16, 17, 18, u32::MAX] {
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut out = [7u32];
            (v.is_allocated(slot), v.window_slot(slot), v.translate(&[slot], &mut out).map(|()| out[0]))
        }));
        let r = r.unwrap_or_else(|_| panic!("slot {slot} panicked"));
        // Padding, unallocated or past the pool: no window slot (0 when translated).
        assert_eq!(r, (false, None, Ok(0)), "slot {slot}");
    }
    assert!(v.translate(&[2, 3], &mut [0]).is_err());
    assert_eq!((v.full_available_size(), v.window_available_size()), (16, 16));
    v.check_invariants().unwrap();
}

// -------------------------------------------------------------------------------------
// Odd trace files: errors naming the line, never a panic.
// -------------------------------------------------------------------------------------

#[test]
fn odd_trace_texts_are_parsed_or_refused_cleanly() {
    const L: &str = "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}";
    let ok = |text: String, n: usize| {
        let t = Trace::from_jsonl_str(&text, "t").unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(t.len(), n, "{text:?}");
    };
    ok(format!("{L}\r\n{L}\r\n"), 2);
    ok(format!("\u{feff}{L}\r\n{L}"), 2);
    ok(format!("{L}\r\n\r\n\r\n"), 1);
    ok(format!("  {L}  \t\r\n"), 1);
    let bad = |bytes: Vec<u8>, line: Option<usize>| {
        let r = catch_unwind(|| Trace::from_reader(&bytes[..], "t"));
        let r = r.unwrap_or_else(|_| panic!("{:?} panicked", String::from_utf8_lossy(&bytes)));
        let e = r.expect_err(&String::from_utf8_lossy(&bytes));
        assert_eq!(e.line, line, "{:?}: {e}", String::from_utf8_lossy(&bytes));
    };
    bad(b"".to_vec(), None);
    bad("\u{feff}".into(), None);
    bad("\u{feff}\r\n".into(), None);
    bad("\r\n\r\n".into(), None);
    bad(format!("{L}\n\u{feff}{L}\n").into(), Some(2));
    bad(format!("\u{feff}\u{feff}{L}").into(), Some(1));
    bad(format!("{L}\n{}", &L[..20]).into(), Some(2));
    bad(format!("{L}\r\n\r\n{L}").into(), Some(2));
    bad([L.as_bytes(), b"\n\xff\xfe{}\n"].concat(), Some(2));
    bad([L.as_bytes(), b"\n\0\n"].concat(), Some(2));
    bad(b"\x1f\x8b".to_vec(), None);
    bad(b"\x1f".to_vec(), Some(1));
    bad(format!("{L}\n[{L}]").into(), Some(2));
}
