//! The shared store tier on a real `redis-server` (and a real 3-node Redis Cluster):
//! round trips, corruption and format checks, prefix lookups, and faults (kill, stop,
//! restart, full). Each test starts its own server on a free loopback port.
//!
//! `cargo test --features redis --test store_redis`. Needs `redis-server` and
//! `redis-cli` on PATH; fails without them unless `KVPOOL_SKIP_REDIS=1`.

mod store_common;

use std::time::{Duration, Instant};

use kvpool::kv::host::{HostKvConfig, HostKvPool, HostLayout};
use kvpool::kv::{KvConfig, KvDtype, KvLayout};
use kvpool::radix::{page_hash, BlockHash};
use kvpool::store::redis::{RedisStore, RedisStoreConfig};
use kvpool::store::{
    BackoffConfig, Invalid, Loaded, MacKey, Miss, PageFormat, PageHeader, PageStore, Seal, StoreError, FORMAT_VERSION,
    HEADER_BYTES,
};
use store_common::{RedisCluster, RedisServer};

fn kv(layout: KvLayout, layers: u32, page_size: u32) -> KvConfig {
    KvConfig { layout, dtype: KvDtype::Bf16, layer_num: layers, size: 64 * page_size as usize, page_size }
}

fn pool(kv: KvConfig, layout: HostLayout) -> HostKvPool {
    HostKvPool::pageable(HostKvConfig { kv, host_pages: 32, layout }).unwrap()
}

/// `n` chained page hashes of a request whose tokens start at `seed`.
fn hashes(n: usize, page_size: u32, seed: u32) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::new();
    for i in 0..n {
        let tokens: Vec<u32> = (0..page_size).map(|t| seed + i as u32 * page_size + t).collect();
        let h = page_hash(out.last(), &tokens);
        out.push(h);
    }
    out
}

/// Allocate `n` host pages and fill each with bytes derived from `seed` and its index.
fn filled(pool: &mut HostKvPool, n: usize, seed: u8) -> Vec<u32> {
    let mut pages = vec![0u32; n];
    pool.alloc_pages(&mut pages).unwrap();
    let len = pool.config().page_bytes();
    for (i, &p) in pages.iter().enumerate() {
        let bytes: Vec<u8> = (0..len)
            .map(|k| (k as u32).wrapping_mul(2654435761).wrapping_add(i as u32 * 97 + seed as u32) as u8)
            .collect();
        pool.write_page(p, &bytes).unwrap();
    }
    pages
}

fn page(pool: &HostKvPool, p: u32) -> Vec<u8> {
    let mut out = vec![0u8; pool.config().page_bytes()];
    pool.read_page(p, &mut out).unwrap();
    out
}

fn store(url: String, format: PageFormat) -> RedisStore {
    let mut cfg = RedisStoreConfig::new(url, "test-model", format);
    cfg.timeout = Duration::from_millis(500);
    cfg.connect_timeout = Duration::from_millis(300);
    cfg.backoff = BackoffConfig { initial: Duration::from_millis(50), max: Duration::from_millis(400) };
    RedisStore::new(cfg).unwrap()
}

fn sentinel(pool: &mut HostKvPool, pages: &[u32]) {
    let fill = vec![0xee; pool.config().page_bytes()];
    for &p in pages {
        pool.write_page(p, &fill).unwrap();
    }
}

fn is_sentinel(pool: &HostKvPool, p: u32) -> bool {
    page(pool, p).iter().all(|&b| b == 0xee)
}

#[test]
fn round_trip_of_several_sizes_and_both_layouts() {
    let Some(server) = RedisServer::start() else { return };
    let shapes = [
        kv(KvLayout::Mha { head_num: 2, head_dim: 8 }, 3, 1),
        kv(KvLayout::Mha { head_num: 1, head_dim: 64 }, 4, 4),
        kv(KvLayout::Mla { kv_lora_rank: 16, qk_rope_head_dim: 8 }, 5, 16),
        kv(KvLayout::Mha { head_num: 8, head_dim: 128 }, 2, 16), // 128 KiB pages
    ];
    for (s, &shape) in shapes.iter().enumerate() {
        for (from, to) in [
            (HostLayout::PageFirst, HostLayout::PageFirst),
            (HostLayout::LayerFirst, HostLayout::LayerFirst),
            (HostLayout::LayerFirst, HostLayout::PageFirst),
            (HostLayout::PageFirst, HostLayout::LayerFirst),
        ] {
            let mut src = pool(shape, from);
            let mut dst = pool(shape, to);
            let format = PageFormat::of(src.config());
            let store = store(server.url(), format);
            let n = 5;
            let hs = hashes(n, shape.page_size, 1000 * s as u32 + if from == to { 0 } else { 500 });
            let src_pages = filled(&mut src, n, s as u8);
            store.put_host(&src, &hs, &src_pages).unwrap();
            assert_eq!(store.exists_prefix(&hs).unwrap(), n);
            let mut dst_pages = vec![0u32; n];
            dst.alloc_pages(&mut dst_pages).unwrap();
            let loaded = store.get_host(&mut dst, &hs, &dst_pages).unwrap();
            assert_eq!(loaded, Loaded { pages: n, stop: None });
            for (&a, &b) in src_pages.iter().zip(&dst_pages) {
                assert_eq!(page(&src, a), page(&dst, b), "{shape:?} {from:?} -> {to:?}");
                // The layer rows land where the destination's layout says.
                assert_eq!(src.page_rows(a, 1, 0).unwrap(), dst.page_rows(b, 1, 0).unwrap());
            }
            // The byte-slice API reads the same values.
            let mut bufs = vec![vec![0u8; format.page_bytes()]; n];
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            assert_eq!(store.get(&hs, &mut refs).unwrap().pages, n);
            assert_eq!(bufs[2], page(&src, src_pages[2]));
            let st = store.stats();
            assert_eq!((st.pages_put, st.pages_loaded, st.corrupt, st.failures), (n as u64, 2 * n as u64, 0, 0));
            assert_eq!(st.bytes_written, (n * format.value_bytes()) as u64);
        }
    }
    // Byte slices in, byte slices out, and the value on the server is header + payload.
    let format = PageFormat { page_size: 2, bytes_per_token: 3 };
    let store = store(server.url(), format);
    let pages: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 6]).collect();
    let hs = hashes(3, 2, 77);
    store.put(&hs, &pages.iter().map(|p| &p[..]).collect::<Vec<_>>()).unwrap();
    let raw: Vec<u8> = redis::cmd("GET").arg(store.key(&hs[1])).query(&mut server.raw()).unwrap();
    assert_eq!(raw.len(), HEADER_BYTES + 6);
    assert_eq!(&raw[..4], b"KVPG");
    assert_eq!(&raw[HEADER_BYTES..], &pages[1][..]);
    let key = String::from_utf8(store.key(&hs[0])).unwrap();
    assert!(key.starts_with("kvpool:test-model:") && key.len() == "kvpool:test-model:".len() + 64, "{key}");
}

#[test]
fn a_flipped_byte_is_refused_and_the_host_page_is_not_written() {
    let Some(server) = RedisServer::start() else { return };
    let shape = kv(KvLayout::Mha { head_num: 1, head_dim: 16 }, 2, 4);
    for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
        let mut host = pool(shape, layout);
        let format = PageFormat::of(host.config());
        let store = store(server.url(), format);
        let hs = hashes(3, 4, if layout == HostLayout::PageFirst { 1 } else { 2 });
        let src = filled(&mut host, 3, 9);
        store.put_host(&host, &hs, &src).unwrap();
        // Flip one payload byte of the middle page on the server.
        let mut raw = server.raw();
        let at = HEADER_BYTES + format.page_bytes() / 2;
        let key = store.key(&hs[1]);
        let old: Vec<u8> = redis::cmd("GETRANGE").arg(&key).arg(at).arg(at).query(&mut raw).unwrap();
        let _: i64 = redis::cmd("SETRANGE").arg(&key).arg(at).arg(&[old[0] ^ 0x40][..]).query(&mut raw).unwrap();

        let mut dst = vec![0u32; 3];
        host.alloc_pages(&mut dst).unwrap();
        sentinel(&mut host, &dst);
        let loaded = store.get_host(&mut host, &hs, &dst).unwrap();
        assert_eq!(loaded.pages, 1);
        assert!(matches!(loaded.stop, Some(Miss::Invalid(Invalid::Checksum { .. }))), "{loaded:?}");
        assert_eq!(page(&host, dst[0]), page(&host, src[0]));
        assert!(is_sentinel(&host, dst[1]) && is_sentinel(&host, dst[2]), "pages from the corrupt one on untouched");
        assert_eq!(store.stats().corrupt, 1);
        assert_eq!(store.stats().pages_loaded, 1);
        // Presence is not soundness: exists_prefix still counts it.
        assert_eq!(store.exists_prefix(&hs).unwrap(), 3);

        // A flipped header byte (payload length) is refused too.
        let key0 = store.key(&hs[0]);
        let _: i64 = redis::cmd("SETRANGE").arg(&key0).arg(24).arg(&[0x7f][..]).query(&mut raw).unwrap();
        let loaded = store.get_host(&mut host, &hs[..1], &dst[..1]).unwrap();
        assert_eq!(loaded.pages, 0);
        assert_eq!(loaded.stop, Some(Miss::Invalid(Invalid::Length { found: format.page_bytes() })));
        assert_eq!(store.stats().corrupt, 2);
        // A value that is not a page at all.
        let _: () = redis::cmd("SET").arg(&key0).arg("hello").query(&mut raw).unwrap();
        let loaded = store.get_host(&mut host, &hs[..1], &dst[..1]).unwrap();
        assert_eq!(loaded.stop, Some(Miss::Invalid(Invalid::Truncated { len: 5 })));
        assert!(is_sentinel(&host, dst[1]));
    }
}

#[test]
fn a_page_of_another_format_or_version_is_a_miss() {
    let Some(server) = RedisServer::start() else { return };
    let pages: Vec<Vec<u8>> = (0..2u8).map(|i| vec![i; 64]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
    let hs = hashes(2, 4, 5);
    let a = PageFormat { page_size: 4, bytes_per_token: 16 };
    store(server.url(), a).put(&hs, &refs).unwrap();
    // Same bytes per page, another page size; same page size, other bytes per token.
    for b in [PageFormat { page_size: 8, bytes_per_token: 8 }, PageFormat { page_size: 4, bytes_per_token: 32 }] {
        let other = store(server.url(), b);
        let mut buf = vec![vec![0xeeu8; b.page_bytes()]; 2];
        let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
        let loaded = other.get(&hs, &mut bufs).unwrap();
        assert_eq!(loaded, Loaded { pages: 0, stop: Some(Miss::Invalid(Invalid::Format { found: a })) });
        assert!(buf.iter().flatten().all(|&x| x == 0xee));
        assert_eq!((other.stats().mismatched, other.stats().corrupt), (2, 0));
    }
    // Another format version (the version field is checked before the checksum).
    let s = store(server.url(), a);
    let _: i64 = redis::cmd("SETRANGE")
        .arg(s.key(&hs[0]))
        .arg(4)
        .arg(&(FORMAT_VERSION + 1).to_le_bytes()[..])
        .query(&mut server.raw())
        .unwrap();
    let mut buf = vec![vec![0u8; 64]; 2];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    let loaded = s.get(&hs, &mut bufs).unwrap();
    assert_eq!(loaded.stop, Some(Miss::Invalid(Invalid::Version { found: FORMAT_VERSION + 1 })));
    assert_eq!(s.stats().mismatched, 1);
    // A host pool of another shape is refused before anything is sent.
    let host = pool(kv(KvLayout::Mha { head_num: 1, head_dim: 8 }, 1, 4), HostLayout::PageFirst);
    let ops = s.stats().ops;
    let err = s.put_host(&host, &hs[..1], &[1]).unwrap_err();
    assert!(matches!(err, StoreError::Format { .. }), "{err}");
    assert_eq!(s.stats().ops, ops);
}

#[test]
fn exists_prefix_stops_at_the_first_missing_page() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 4, bytes_per_token: 8 };
    let s = store(server.url(), format);
    let hs = hashes(6, 4, 11);
    let pages: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 32]).collect();
    // Everything but page 2.
    for i in [0, 1, 3, 4, 5] {
        s.put(&hs[i..i + 1], &[&pages[i]]).unwrap();
    }
    assert_eq!(s.exists_prefix(&hs).unwrap(), 2);
    assert_eq!(s.exists_prefix(&hs[3..]).unwrap(), 3);
    assert_eq!(s.exists_prefix(&hs[2..]).unwrap(), 0);
    assert_eq!(s.exists_prefix(&[]).unwrap(), 0);
    let mut buf = vec![vec![0xeeu8; 32]; 6];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    let loaded = s.get(&hs, &mut bufs).unwrap();
    assert_eq!(loaded, Loaded { pages: 2, stop: Some(Miss::Absent) });
    assert_eq!((buf[0][0], buf[1][0]), (0, 1));
    assert!(buf[2..].iter().flatten().all(|&x| x == 0xee), "nothing after the gap is written");
    assert_eq!(s.stats().absent, 1);
    // Another namespace or model does not see these pages.
    let mut cfg = s.config().clone();
    cfg.model_id = "other-model".into();
    assert_eq!(RedisStore::new(cfg).unwrap().exists_prefix(&hs).unwrap(), 0);
}

/// Two tenants whose namespace and model id joined to the same text (namespace `a:b`
/// with model `c` and namespace `a` with model `b:c`; an empty namespace with model `x:`
/// and namespace `:x` with an empty model) shared their keys, so each read and overwrote
/// the other's pages. Each pair now has keys of its own on one server: neither sees the
/// other's pages, and a write by one leaves the other's pages as they were.
#[test]
fn tenants_whose_namespace_and_model_join_alike_do_not_share_pages() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 4, bytes_per_token: 8 };
    let base = store(server.url(), format).config().clone();
    let tenant = |namespace: &str, model_id: &str| {
        let mut cfg = base.clone();
        cfg.namespace = namespace.into();
        cfg.model_id = model_id.into();
        RedisStore::new(cfg).unwrap()
    };
    let hs = hashes(3, 4, 300);
    let mut keys = 0;
    for (i, ((ns_a, model_a), (ns_b, model_b))) in
        [(("a:b", "c"), ("a", "b:c")), (("", "x:"), (":x", ""))].into_iter().enumerate()
    {
        let (a, b) = (tenant(ns_a, model_a), tenant(ns_b, model_b));
        let pages_a: Vec<Vec<u8>> = (0..3u8).map(|p| vec![0x10 * (i as u8 + 1) + p; 32]).collect();
        a.put(&hs, &pages_a.iter().map(|p| &p[..]).collect::<Vec<_>>()).unwrap();
        assert_eq!(a.exists_prefix(&hs).unwrap(), 3);
        assert_eq!(b.exists_prefix(&hs).unwrap(), 0, "{ns_b:?} + {model_b:?} sees {ns_a:?} + {model_a:?}'s pages");
        let mut buf = vec![vec![0xeeu8; 32]; 3];
        let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
        assert_eq!(b.get(&hs, &mut bufs).unwrap(), Loaded { pages: 0, stop: Some(Miss::Absent) });
        assert!(buf.iter().flatten().all(|&x| x == 0xee));
        // The other tenant's pages of the same hashes do not replace these.
        let pages_b: Vec<Vec<u8>> = (0..3u8).map(|p| vec![0xb0 + p; 32]).collect();
        b.put(&hs, &pages_b.iter().map(|p| &p[..]).collect::<Vec<_>>()).unwrap();
        for (s, want) in [(&a, &pages_a), (&b, &pages_b)] {
            let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
            assert_eq!(s.get(&hs, &mut bufs).unwrap(), Loaded { pages: 3, stop: None });
            assert_eq!(&buf, want);
        }
        keys += 6;
        let dbsize: usize = redis::cmd("DBSIZE").query(&mut server.raw()).unwrap();
        assert_eq!(dbsize, keys);
    }
}

/// One pipeline whose replies are sound, nil, corrupt, sound and too long (a page of a
/// larger format): the reply reader stays in step with every reply, each miss is
/// counted, the leading run is loaded and nothing from the nil on is written. Pages are
/// larger than the client's read buffer (the bulk path past it), and the connection
/// stays in use after misses and after an error reply in the middle.
#[test]
fn a_nil_then_a_corrupt_page_in_one_pipeline_stop_the_load_at_the_nil() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 16, bytes_per_token: 4100 }; // 64 KiB + 1 KiB pages
    let s = store(server.url(), format);
    let hs = hashes(6, 16, 40);
    let pages: Vec<Vec<u8>> =
        (0..6u8).map(|i| (0..format.page_bytes()).map(|k| (k as u8).wrapping_mul(i + 3)).collect()).collect();
    for i in [0, 1, 3, 4] {
        s.put(&hs[i..i + 1], &[&pages[i]]).unwrap();
    }
    // Page 2 absent; page 3 has a flipped payload byte; page 5 is a page of a larger
    // format (a longer value) under this store's key.
    let mut raw = server.raw();
    let at = HEADER_BYTES + 65_000;
    let _: i64 =
        redis::cmd("SETRANGE").arg(s.key(&hs[3])).arg(at).arg(&[pages[3][65_000] ^ 1][..]).query(&mut raw).unwrap();
    let big = PageFormat { page_size: 16, bytes_per_token: 8192 };
    let mut cfg = s.config().clone();
    cfg.format = big;
    let other = RedisStore::new(cfg).unwrap();
    other.put(&hs[5..6], &[&vec![7u8; big.page_bytes()]]).unwrap();

    let check = |bufs: &[Vec<u8>], loaded: usize| {
        for (i, b) in bufs.iter().enumerate() {
            if i < loaded {
                assert_eq!(b, &pages[i], "page {i} loaded");
            } else {
                assert!(b.iter().all(|&x| x == 0xee), "page {i} after the stop is untouched");
            }
        }
    };
    let mut bufs = vec![vec![0xeeu8; format.page_bytes()]; 6];
    let loaded = s.get(&hs, &mut bufs.iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()).unwrap();
    assert_eq!(loaded, Loaded { pages: 2, stop: Some(Miss::Absent) });
    check(&bufs, 2);
    let st = s.stats();
    assert_eq!((st.absent, st.corrupt, st.mismatched, st.pages_loaded), (1, 1, 1, 2));
    assert_eq!(st.bytes_read, (4 * format.value_bytes() + big.value_bytes()) as u64);

    // From the corrupt page on: it is the stop; the sound page after it is not loaded.
    let mut bufs = vec![vec![0xeeu8; format.page_bytes()]; 3];
    let loaded = s.get(&hs[3..], &mut bufs.iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()).unwrap();
    assert_eq!(loaded.pages, 0);
    assert!(matches!(loaded.stop, Some(Miss::Invalid(Invalid::Checksum { .. }))), "{loaded:?}");
    assert!(bufs.iter().flatten().all(|&x| x == 0xee));
    // The longer value alone: the format its header names.
    let loaded = s.get(&hs[5..], &mut bufs[..1].iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()).unwrap();
    assert_eq!(loaded, Loaded { pages: 0, stop: Some(Miss::Invalid(Invalid::Format { found: big })) });

    // An error reply in the middle (a list under page 2's key): a miss for that page,
    // the pages before it load, and the connection is still in step.
    let _: i64 = redis::cmd("RPUSH").arg(s.key(&hs[2])).arg("x").query(&mut raw).unwrap();
    let mut bufs = vec![vec![0xeeu8; format.page_bytes()]; 5];
    let loaded = s.get(&hs[..5], &mut bufs.iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()).unwrap();
    assert_eq!(loaded, Loaded { pages: 2, stop: Some(Miss::Error) });
    check(&bufs, 2);
    assert_eq!((s.stats().key_errors, s.stats().failures), (1, 0));
    // A write replaces the list.
    bufs.iter_mut().for_each(|b| b.fill(0xee));
    s.put(&hs[2..3], &[&pages[2]]).unwrap();
    let loaded = s.get(&hs[..5], &mut bufs.iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()).unwrap();
    assert_eq!(loaded.pages, 3);
    check(&bufs, 3);
    assert_eq!(s.stats().connects, 1, "one connection served every read");
}

/// A value is bound to the namespace, model id and salt of the store that wrote it and
/// to its page hash. Model `a`'s pages copied under the keys of model `b` (another
/// tensor-parallel rank, a fine-tune), of another namespace or of another salt (a
/// tenant's cache salt), by `DUMP`/`RESTORE` or `GET`/`SET`, are present but refused as
/// foreign, counted, and no host page is written; a page copied under another page's
/// key of the same store is refused too, and the pages it came from still load.
#[test]
fn a_value_copied_under_another_key_is_refused_as_foreign() {
    let Some(server) = RedisServer::start() else { return };
    let shape = kv(KvLayout::Mha { head_num: 1, head_dim: 16 }, 2, 4);
    let mut host = pool(shape, HostLayout::PageFirst);
    let format = PageFormat::of(host.config());
    let base = store(server.url(), format).config().clone();
    let tenant = |namespace: &str, model_id: &str, salt: &str| {
        let mut cfg = base.clone();
        cfg.namespace = namespace.into();
        cfg.model_id = model_id.into();
        cfg.salt = salt.into();
        RedisStore::new(cfg).unwrap()
    };
    let a = tenant("kvpool", "a", "");
    let hs = hashes(3, 4, 500);
    let src = filled(&mut host, 3, 7);
    a.put_host(&host, &hs, &src).unwrap();
    let mut raw = server.raw();
    let mut dst = vec![0u32; 3];
    host.alloc_pages(&mut dst).unwrap();
    let others = [tenant("kvpool", "b", ""), tenant("other", "a", ""), tenant("kvpool", "a", "tenant-2")];
    let salted = format!("{:?} {:?}", others[2], String::from_utf8_lossy(&others[2].key(&hs[0])));
    assert!(!salted.contains("tenant-2"), "the salt is shown: {salted}");
    for (i, b) in others.iter().enumerate() {
        assert_ne!(b.key(&hs[0]), a.key(&hs[0]));
        for (k, h) in hs.iter().enumerate() {
            if (i + k) % 2 == 0 {
                let dump: Vec<u8> = redis::cmd("DUMP").arg(a.key(h)).query(&mut raw).unwrap();
                let _: () =
                    redis::cmd("RESTORE").arg(b.key(h)).arg(0).arg(dump).arg("REPLACE").query(&mut raw).unwrap();
            } else {
                let value: Vec<u8> = redis::cmd("GET").arg(a.key(h)).query(&mut raw).unwrap();
                let _: () = redis::cmd("SET").arg(b.key(h)).arg(value).query(&mut raw).unwrap();
            }
        }
        assert_eq!(b.exists_prefix(&hs).unwrap(), 3, "the copies are present");
        sentinel(&mut host, &dst);
        let loaded = b.get_host(&mut host, &hs, &dst).unwrap();
        let foreign = Miss::Invalid(Invalid::Foreign { page: false, store: true });
        assert_eq!(loaded, Loaded { pages: 0, stop: Some(foreign) });
        assert!(dst.iter().all(|&p| is_sentinel(&host, p)), "no host page written");
        let st = b.stats();
        assert_eq!((st.foreign, st.corrupt, st.mismatched, st.forged, st.pages_loaded), (3, 0, 0, 0, 0));
        let mut buf = vec![vec![0xeeu8; format.page_bytes()]; 1];
        let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
        assert_eq!(b.get(&hs[2..], &mut bufs).unwrap().stop, Some(foreign));
        assert!(buf[0].iter().all(|&x| x == 0xee));
    }
    // Page 0's value under page 1's key of the same store.
    let value: Vec<u8> = redis::cmd("GET").arg(a.key(&hs[0])).query(&mut raw).unwrap();
    let _: () = redis::cmd("SET").arg(a.key(&hs[1])).arg(value).query(&mut raw).unwrap();
    sentinel(&mut host, &dst);
    let loaded = a.get_host(&mut host, &hs, &dst).unwrap();
    assert_eq!(loaded, Loaded { pages: 1, stop: Some(Miss::Invalid(Invalid::Foreign { page: true, store: false })) });
    assert_eq!(page(&host, dst[0]), page(&host, src[0]));
    assert!(is_sentinel(&host, dst[1]) && is_sentinel(&host, dst[2]));
    assert_eq!((a.stats().foreign, a.stats().corrupt), (1, 0));
    // The copies did not touch `a`'s other pages.
    assert_eq!(a.get_host(&mut host, &hs[2..], &dst[2..]).unwrap().pages, 1);
    assert_eq!(page(&host, dst[2]), page(&host, src[2]));
}

/// With a MAC key, only values sealed with that key load: a value written by a store
/// without the key (a correct CRC-32), one crafted with a correct CRC and labelled as
/// sealed, and one sealed with another key are refused and counted as forged, and
/// nothing is written. A store without a key refuses the keyed values.
#[test]
fn a_store_with_a_mac_key_refuses_values_written_without_it() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 4, bytes_per_token: 16 };
    let with_key = |key: Option<&[u8]>| {
        let mut cfg = store(server.url(), format).config().clone();
        cfg.mac_key = key.map(|k| MacKey::new(k).unwrap());
        RedisStore::new(cfg).unwrap()
    };
    let keyed = with_key(Some(b"0123456789abcdef0123456789abcdef"));
    let unkeyed = with_key(None);
    let other = with_key(Some(b"another key of thirty-two bytes."));
    assert_eq!(keyed.key(&[1; 32]), unkeyed.key(&[1; 32]), "the key does not depend on the MAC key");
    assert!(!format!("{keyed:?}").contains("0123456789abcdef"), "Debug shows no secret");
    let hs = hashes(4, 4, 900);
    let pages: Vec<Vec<u8>> = (0..4u8).map(|i| vec![0x30 + i; format.page_bytes()]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
    keyed.put(&hs, &refs).unwrap();
    let mut buf = vec![vec![0xeeu8; format.page_bytes()]; 4];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(keyed.get(&hs, &mut bufs).unwrap(), Loaded { pages: 4, stop: None });
    assert_eq!(buf, pages);

    // A store without the key reads none of them.
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(unkeyed.get(&hs, &mut bufs).unwrap(), Loaded { pages: 0, stop: Some(Miss::Invalid(Invalid::Keyed)) });
    assert_eq!((unkeyed.stats().mismatched, unkeyed.stats().forged), (4, 0));

    // Page 1: written by the store without a key (a sound CRC-32 value).
    unkeyed.put(&hs[1..2], &[&pages[1]]).unwrap();
    // Page 2: crafted by someone without the key, with a correct CRC, labelled sealed.
    let mut header = PageHeader::new(unkeyed.binding(), &hs[2], core::iter::once(&pages[2][..]));
    header.seal = (Seal::HmacSha256 as u32).to_le();
    let crafted = [header.as_bytes(), &pages[2][..]].concat();
    let _: () = redis::cmd("SET").arg(keyed.key(&hs[2])).arg(crafted).query(&mut server.raw()).unwrap();
    // Page 3: sealed with another key.
    other.put(&hs[3..4], &[&pages[3]]).unwrap();

    for (i, want) in [(1, Invalid::NoMac), (2, Invalid::Mac), (3, Invalid::Mac)] {
        let mut buf = vec![vec![0xeeu8; format.page_bytes()]; 4 - i];
        let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
        let loaded = keyed.get(&hs[i..], &mut bufs).unwrap();
        assert_eq!(loaded, Loaded { pages: 0, stop: Some(Miss::Invalid(want)) }, "page {i}");
        assert!(buf.iter().flatten().all(|&x| x == 0xee), "page {i}: nothing written");
    }
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(keyed.get(&hs, &mut bufs).unwrap(), Loaded { pages: 1, stop: Some(Miss::Invalid(Invalid::NoMac)) });
    let st = keyed.stats();
    // Every value read is counted: 3, 2 and 1 in the loop, 3 in the last batch.
    assert_eq!((st.forged, st.corrupt, st.foreign, st.mismatched), (3 + 2 + 1 + 3, 0, 0, 0));
    // The store without a key loads the page it wrote itself and refuses the others.
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    let loaded = unkeyed.get(&hs[1..], &mut bufs[..3]).unwrap();
    assert_eq!(loaded, Loaded { pages: 1, stop: Some(Miss::Invalid(Invalid::Keyed)) });
    assert_eq!(buf[0], pages[1]);
}

/// A key that holds something other than a page (someone `RPUSH`ed a list under it) is
/// answered with `WRONGTYPE`: a miss for that page only. The pages before it load, the
/// error is counted, the operation does not fail, and the next operation goes out at
/// once (no backoff). `EXISTS` sees the list (presence only); a `put` replaces it.
#[test]
fn a_poisoned_key_is_a_miss_for_its_page_only() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 4, bytes_per_token: 8 };
    let s = store(server.url(), format);
    let hs = hashes(5, 4, 70);
    let pages: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i + 1; format.page_bytes()]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
    s.put(&hs, &refs).unwrap();
    let mut raw = server.raw();
    let _: i64 = redis::cmd("DEL").arg(s.key(&hs[2])).query(&mut raw).unwrap();
    let _: i64 = redis::cmd("RPUSH").arg(s.key(&hs[2])).arg("x").query(&mut raw).unwrap();

    for round in 1..=100u64 {
        let mut buf = vec![vec![0xeeu8; format.page_bytes()]; 5];
        let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
        let loaded = s.get(&hs, &mut bufs).unwrap();
        assert_eq!(loaded, Loaded { pages: 2, stop: Some(Miss::Error) });
        assert!(bufs[2..].iter().all(|b| b.iter().all(|&x| x == 0xee)));
        // The next operation is not refused: the pages after the poisoned one load.
        let loaded = s.get(&hs[3..], &mut bufs[3..]).unwrap();
        assert_eq!(loaded, Loaded { pages: 2, stop: None });
        assert!(bufs[2].iter().all(|&x| x == 0xee));
        assert_eq!((&buf[..2], &buf[3..]), (&pages[..2], &pages[3..]));
        let st = s.stats();
        assert_eq!((st.key_errors, st.failures, st.unavailable, st.failures_in_row), (round, 0, 0, 0));
    }
    assert_eq!(s.exists_prefix(&hs).unwrap(), 5, "presence only: the list is there");
    s.put(&hs[2..3], &[&pages[2]]).unwrap();
    let mut buf = vec![vec![0u8; format.page_bytes()]; 5];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(s.get(&hs, &mut bufs).unwrap(), Loaded { pages: 5, stop: None });
    assert_eq!(buf, pages);
    assert_eq!(s.stats().connects, 1);
}

/// Error replies to `EXISTS` and `SET` for one key (an ACL that denies the client one
/// page's key: `NOPERM`): `exists_prefix` takes the page as absent, `put` writes the
/// other pages and fails with `Server`, `get` misses the page; each is counted and none
/// starts a backoff.
#[test]
fn an_error_reply_for_one_key_concerns_that_key_only() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 4, bytes_per_token: 8 };
    let admin = store(server.url(), format);
    // Hashes whose page 2 is the only one whose hex starts with its two digits.
    let (hs, deny) = (0..)
        .map(|seed| hashes(5, 4, 40 + seed))
        .map(|hs| {
            let prefix = |h: &BlockHash| hex2(h);
            let deny = prefix(&hs[2]);
            (hs.iter().filter(|h| prefix(h) == deny).count() == 1).then_some((hs, deny))
        })
        .find_map(|x| x)
        .unwrap();
    let prefix = String::from_utf8(admin.key(&[0; 32])).unwrap().trim_end_matches('0').to_string();
    let (d0, d1) = (deny.as_bytes()[0] as char, deny.as_bytes()[1] as char);
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("limited")
        .arg("on")
        .arg(">secret")
        .arg(format!("~{prefix}[^{d0}]*"))
        .arg(format!("~{prefix}{d0}[^{d1}]*"))
        .arg("+@all")
        .query(&mut server.raw())
        .unwrap();
    let url = format!("redis://limited:secret@127.0.0.1:{}", server.port);
    let s = store(url, format);
    let pages: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i + 1; format.page_bytes()]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();

    let err = s.put(&hs, &refs).unwrap_err();
    assert!(matches!(&err, StoreError::Server { detail } if detail.contains("NOPERM")), "{err}");
    assert_eq!(admin.exists_prefix(&hs).unwrap(), 2, "the other pages were written");
    assert_eq!(admin.exists_prefix(&hs[3..]).unwrap(), 2);
    let st = s.stats();
    assert_eq!((st.key_errors, st.pages_put, st.failures, st.failures_in_row), (1, 4, 1, 0));
    admin.put(&hs[2..3], &[&pages[2]]).unwrap();

    // Not refused by a backoff: the next operations go out at once.
    assert_eq!(s.exists_prefix(&hs).unwrap(), 2, "the denied key is absent to this client");
    assert_eq!(s.exists_prefix(&hs[3..]).unwrap(), 2);
    let mut buf = vec![vec![0xeeu8; format.page_bytes()]; 5];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(s.get(&hs, &mut bufs).unwrap(), Loaded { pages: 2, stop: Some(Miss::Error) });
    assert_eq!(buf[..2], pages[..2]);
    assert!(buf[2..].iter().flatten().all(|&x| x == 0xee));
    let st = s.stats();
    assert_eq!((st.key_errors, st.failures, st.unavailable, st.failures_in_row), (3, 1, 0, 0));
    // The admin, whom no ACL limits, loads them all.
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(admin.get(&hs, &mut bufs).unwrap(), Loaded { pages: 5, stop: None });
}

/// The first two hex digits of a page hash.
fn hex2(h: &BlockHash) -> String {
    format!("{:02x}", h[0])
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let Some(server) = RedisServer::start() else { return };
    let shape = kv(KvLayout::Mha { head_num: 1, head_dim: 8 }, 2, 2);
    let mut host = pool(shape, HostLayout::LayerFirst);
    let format = PageFormat::of(host.config());
    let s = store(server.url(), format);
    let hs = hashes(2, 2, 3);
    let page = vec![0u8; format.page_bytes()];
    let short = vec![0u8; format.page_bytes() - 1];
    assert!(matches!(s.put(&hs, &[&page]), Err(StoreError::Shape { what: "pages", got: 1, expected: 2 })));
    assert!(matches!(s.put(&hs, &[&page, &short]), Err(StoreError::Shape { what: "page", .. })));
    let err = s.put_host(&host, &hs, &[1, 2]).unwrap_err(); // not allocated
    assert!(matches!(err, StoreError::Host(_)), "{err}");
    assert!(!err.is_transient());
    let mut p = [0u32; 1];
    host.alloc_pages(&mut p).unwrap();
    assert!(matches!(s.get_host(&mut host, &hs, &[p[0], 0]), Err(StoreError::Host(_))));
    assert_eq!(s.stats().ops, 0);
    for bad in [
        RedisStoreConfig { nodes: vec![], ..s.config().clone() },
        RedisStoreConfig { nodes: vec!["http://x".into()], ..s.config().clone() },
        RedisStoreConfig { timeout: Duration::ZERO, ..s.config().clone() },
        RedisStoreConfig { format: PageFormat { page_size: 0, bytes_per_token: 8 }, ..s.config().clone() },
    ] {
        assert!(matches!(RedisStore::new(bad), Err(StoreError::Config { .. })));
    }
}

/// Kill the server mid-sequence: operations fail with typed errors within the timeout,
/// back off without touching the network, leave host pages alone, and work again after
/// a restart on the same port without a new client.
#[test]
fn kill_and_restart_recovers_without_a_new_client() {
    let Some(mut server) = RedisServer::start() else { return };
    let shape = kv(KvLayout::Mha { head_num: 2, head_dim: 32 }, 2, 4);
    let mut host = pool(shape, HostLayout::PageFirst);
    let format = PageFormat::of(host.config());
    let s = store(server.url(), format);
    let timeout = s.config().timeout;
    let hs = hashes(4, 4, 21);
    let src = filled(&mut host, 4, 1);
    s.put_host(&host, &hs[..2], &src[..2]).unwrap();
    let mut dst = vec![0u32; 4];
    host.alloc_pages(&mut dst).unwrap();
    sentinel(&mut host, &dst);

    server.kill();
    let t = Instant::now();
    let err = s.put_host(&host, &hs[2..], &src[2..]).unwrap_err();
    assert!(t.elapsed() < timeout + Duration::from_millis(500), "took {:?}", t.elapsed());
    assert!(err.is_transient() && matches!(err, StoreError::Connection { .. }), "{err}");
    // Backing off: refused at once, nothing sent.
    let ops = s.stats().ops;
    let t = Instant::now();
    match s.get_host(&mut host, &hs, &dst) {
        Err(StoreError::Unavailable { failures: 1, .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(20));
    assert_eq!(s.stats().ops, ops);
    // After the wait the client tries again: connection refused, a longer wait.
    std::thread::sleep(Duration::from_millis(60));
    let t = Instant::now();
    assert!(matches!(s.exists_prefix(&hs), Err(StoreError::Connection { .. })));
    assert!(t.elapsed() < s.config().connect_timeout + Duration::from_millis(200));
    assert_eq!(s.stats().failures_in_row, 2);
    assert!(dst.iter().all(|&p| is_sentinel(&host, p)), "a failed get writes no host page");

    server.restart(); // same port, empty (no persistence)
    let deadline = Instant::now() + Duration::from_secs(5);
    let n = loop {
        match s.exists_prefix(&hs) {
            Ok(n) => break n,
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                assert!(Instant::now() < deadline, "no recovery after restart: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert_eq!(n, 0, "the restarted server is empty");
    let st = s.stats();
    assert!(st.reconnects >= 1 && st.failures_in_row == 0, "{st:?}");
    s.put_host(&host, &hs, &src).unwrap();
    assert_eq!(s.get_host(&mut host, &hs, &dst).unwrap().pages, 4);
    assert_eq!(page(&host, dst[3]), page(&host, src[3]));
}

/// A server that stops answering (SIGSTOP): the operation times out within the
/// configured deadline (not once per command of the pipeline), and the client recovers
/// when it answers again.
#[test]
fn a_hung_server_times_out_within_the_deadline() {
    let Some(server) = RedisServer::start() else { return };
    let format = PageFormat { page_size: 16, bytes_per_token: 4096 }; // 64 KiB pages
    let s = store(server.url(), format);
    let timeout = s.config().timeout;
    let hs = hashes(32, 16, 4);
    let pages: Vec<Vec<u8>> = (0..32u8).map(|i| vec![i; format.page_bytes()]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
    s.put(&hs, &refs).unwrap();

    server.signal("STOP");
    let t = Instant::now();
    let mut bufs = vec![vec![0u8; format.page_bytes()]; 32];
    let mut muts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let err = s.get(&hs, &mut muts).unwrap_err();
    let took = t.elapsed();
    server.signal("CONT");
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    assert!(took >= timeout && took < timeout + timeout / 4, "took {took:?} for a {timeout:?} deadline");
    assert!(bufs.iter().flatten().all(|&b| b == 0));
    assert_eq!(s.stats().timeouts, 1);

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match s.get(&hs, &mut bufs.iter_mut().map(|b| &mut b[..]).collect::<Vec<_>>()) {
            Ok(l) => {
                assert_eq!(l.pages, 32);
                break;
            }
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                assert!(Instant::now() < deadline, "no recovery: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    assert_eq!(bufs[31], pages[31]);
    assert!(s.stats().reconnects >= 1);
}

/// A full server (maxmemory, noeviction) refuses writes: typed `Full`, writes back off,
/// reads go on.
#[test]
fn a_full_store_backs_off_writes_and_keeps_serving_reads() {
    let Some(server) = RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]) else {
        return;
    };
    let format = PageFormat { page_size: 16, bytes_per_token: 4096 };
    let s = store(server.url(), format);
    let hs = hashes(200, 16, 8);
    let page = vec![3u8; format.page_bytes()];
    s.put(&hs[..1], &[&page]).unwrap();
    let mut full = None;
    for i in 1..hs.len() {
        if let Err(e) = s.put(&hs[i..i + 1], &[&page]) {
            full = Some(e);
            break;
        }
    }
    assert!(matches!(full, Some(StoreError::Full { .. })), "{full:?}");
    assert!(matches!(s.put(&hs[199..], &[&page]), Err(StoreError::Unavailable { .. })));
    assert!(s.exists_prefix(&hs).unwrap() >= 1, "reads go on while writes back off");
    let st = s.stats();
    assert_eq!((st.full, st.failures_in_row), (1, 0));
}

#[test]
fn cluster_round_trip_spreads_pages_over_the_nodes() {
    let Some(cluster) = RedisCluster::start() else { return };
    let shape = kv(KvLayout::Mha { head_num: 1, head_dim: 32 }, 2, 8);
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut host = pool(shape, layout);
        let format = PageFormat::of(host.config());
        let mut cfg = RedisStoreConfig::cluster(cluster.urls(), "test-model", format);
        cfg.timeout = Duration::from_secs(2);
        let s = RedisStore::new(cfg).unwrap();
        let hs = hashes(12, 8, if layout == HostLayout::PageFirst { 0 } else { 1 << 20 });
        let src = filled(&mut host, 12, 4);
        s.put_host(&host, &hs, &src).unwrap();
        assert_eq!(s.exists_prefix(&hs).unwrap(), 12);
        let mut dst = vec![0u32; 12];
        host.alloc_pages(&mut dst).unwrap();
        assert_eq!(s.get_host(&mut host, &hs, &dst).unwrap(), Loaded { pages: 12, stop: None });
        for (&a, &b) in src.iter().zip(&dst) {
            assert_eq!(page(&host, a), page(&host, b));
        }
        host.free_pages(&src).unwrap();
        host.free_pages(&dst).unwrap();
    }
    // The keys landed on every node.
    for n in &cluster.nodes {
        let keys: i64 = redis::cmd("DBSIZE").query(&mut n.raw()).unwrap();
        assert!(keys > 0, "node {} holds no page", n.port);
    }
    // A corrupt page on whichever node holds it is refused there too.
    let format = PageFormat { page_size: 2, bytes_per_token: 4 };
    let s = RedisStore::new(RedisStoreConfig::cluster(cluster.urls(), "m", format)).unwrap();
    let hs = hashes(3, 2, 99);
    s.put(&hs, &[&[1u8; 8][..], &[2; 8], &[3; 8]]).unwrap();
    let key = s.key(&hs[1]);
    for n in &cluster.nodes {
        let mut raw = n.raw();
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&key).query(&mut raw).unwrap();
        let here: i64 = redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot).query(&mut raw).unwrap();
        let has: Option<Vec<u8>> = if here > 0 { redis::cmd("GET").arg(&key).query(&mut raw).ok() } else { None };
        if has.is_some() {
            let _: i64 = redis::cmd("SETRANGE").arg(&key).arg(HEADER_BYTES).arg(&[9u8][..]).query(&mut raw).unwrap();
        }
    }
    let mut buf = vec![vec![0u8; 8]; 3];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    let loaded = s.get(&hs, &mut bufs).unwrap();
    assert_eq!(loaded.pages, 1);
    assert!(matches!(loaded.stop, Some(Miss::Invalid(Invalid::Checksum { .. }))));

    // A list under one page's key (on whichever node holds it): a miss for that page
    // only, counted, no failure; a put replaces it.
    let hs = hashes(4, 2, 123);
    let pages: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 8]).collect();
    s.put(&hs, &pages.iter().map(|p| &p[..]).collect::<Vec<_>>()).unwrap();
    let key = s.key(&hs[2]);
    s.with_connection(|c| {
        redis::cmd("DEL").arg(&key).exec(c)?;
        redis::cmd("RPUSH").arg(&key).arg("x").exec(c)
    })
    .unwrap();
    let failures = s.stats().failures;
    let mut buf = vec![vec![0xeeu8; 8]; 4];
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(s.get(&hs, &mut bufs).unwrap(), Loaded { pages: 2, stop: Some(Miss::Error) });
    assert_eq!(buf[..2], pages[..2]);
    assert!(buf[2..].iter().flatten().all(|&x| x == 0xee));
    assert_eq!(s.exists_prefix(&hs).unwrap(), 4);
    let st = s.stats();
    assert_eq!((st.key_errors, st.failures, st.unavailable), (1, failures, 0));
    s.put(&hs[2..3], &[&pages[2]]).unwrap();
    let mut bufs: Vec<&mut [u8]> = buf.iter_mut().map(|v| &mut v[..]).collect();
    assert_eq!(s.get(&hs, &mut bufs).unwrap(), Loaded { pages: 4, stop: None });
    assert_eq!(buf, pages);
}
