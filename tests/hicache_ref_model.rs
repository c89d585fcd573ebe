//! The two-tier reference tree (`ReferenceHiCache`) on random request sequences: its
//! own invariants after every step (device residency a prefix of every path, sizes,
//! every host page held once), and every device slot and host page accounted for:
//! free, cached, or held by an open request.
#![cfg(not(loom))]

use kvpool::baseline::hicache_ref::{HiNodeId, ReferenceHiCache, WritePolicy};
use kvpool::radix::EvictionPolicy;
use kvpool::{KvAllocator, PagedAllocator};
use proptest::prelude::*;

const PS: usize = 2;
const DEVICE: usize = 24;

#[derive(Clone, Debug)]
enum Op {
    /// A request: match, load back, lock, allocate the rest, maybe finish at once.
    Start {
        key: Vec<u32>,
        finish: bool,
    },
    /// Finish the oldest open request.
    Finish,
    Evict(usize),
    EvictHost(usize),
    /// Complete the oldest transfer in flight.
    Complete,
}

fn op() -> impl Strategy<Value = Op> {
    // Keys from a two-letter alphabet, whole pages, so prefixes are shared.
    let key = (1usize..6).prop_flat_map(|pages| prop::collection::vec(0u32..2, pages * PS));
    prop_oneof![
        4 => (key, any::<bool>()).prop_map(|(key, finish)| Op::Start { key, finish }),
        2 => Just(Op::Finish),
        1 => (0usize..16).prop_map(Op::Evict),
        1 => (0usize..16).prop_map(Op::EvictHost),
        2 => Just(Op::Complete),
    ]
}

struct Open {
    key: Vec<u32>,
    kv: Vec<u32>,
    protected: usize,
    node: HiNodeId,
}

/// Complete every transfer in flight.
fn settle(c: &mut ReferenceHiCache<PagedAllocator>, flight: &mut Vec<u64>) {
    flight.extend(c.take_transfers().into_iter().map(|t| t.id));
    for id in flight.drain(..) {
        assert!(c.complete(id), "transfer {id} not in flight");
    }
}

fn finish(c: &mut ReferenceHiCache<PagedAllocator>, r: Open) {
    c.cache_finished_req(0, &r.key, &r.kv, r.protected, r.node);
}

fn run(write: WritePolicy, host_pages: u32, threshold: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut c = ReferenceHiCache::new(
        PagedAllocator::new(DEVICE, PS as u32).unwrap(),
        host_pages,
        EvictionPolicy::Lru,
        write,
        threshold,
    )
    .unwrap();
    let mut open: Vec<Open> = Vec::new();
    let mut flight: Vec<u64> = Vec::new();
    let mut loaded_before = 0;
    for op in ops {
        match op {
            Op::Start { key, finish: done } => {
                let m = c.match_prefix(0, key);
                prop_assert!(m.device.len() + m.host_len <= key.len());
                let mut hit = m.device.clone();
                let mut node = m.device_node;
                if m.host_len > 0 {
                    if let Some(s) = c.load_back(m.host_node, None) {
                        prop_assert_eq!(s.len(), m.host_len);
                        hit.extend_from_slice(&s);
                        node = m.host_node;
                    }
                }
                prop_assert_eq!(c.counters().loaded - loaded_before, (hit.len() - m.device.len()) as u64);
                loaded_before = c.counters().loaded;
                c.inc_lock_ref(node);
                let need = key.len() - hit.len();
                if c.allocator().available_size() < need {
                    c.evict(need - c.allocator().available_size());
                }
                let mut rest = vec![0u32; need];
                if c.allocator().alloc(&mut rest).is_err() {
                    c.dec_lock_ref(node);
                    continue;
                }
                let protected = hit.len();
                hit.extend_from_slice(&rest);
                let r = Open { key: key.clone(), kv: hit, protected, node };
                if *done {
                    finish(&mut c, r);
                } else {
                    open.push(r);
                }
            }
            Op::Finish => {
                if !open.is_empty() {
                    finish(&mut c, open.remove(0));
                }
            }
            Op::Evict(n) => {
                c.evict(*n);
            }
            Op::EvictHost(n) => {
                c.evict_host(*n);
            }
            Op::Complete => {
                flight.extend(c.take_transfers().into_iter().map(|t| t.id));
                if !flight.is_empty() {
                    let id = flight.remove(0);
                    prop_assert!(c.complete(id));
                    prop_assert!(!c.complete(id), "completed twice");
                }
            }
        }
        if let Err(e) = c.check() {
            return Err(TestCaseError::fail(e));
        }
        let held: usize = open.iter().map(|r| r.kv.len() - r.protected).sum();
        let cached = c.evictable_size() + c.protected_size();
        prop_assert_eq!(c.allocator().available_size() + cached + held, DEVICE);
    }
    // Everything back: both pools whole again.
    settle(&mut c, &mut flight);
    for r in open.drain(..) {
        finish(&mut c, r);
    }
    settle(&mut c, &mut flight);
    c.evict(usize::MAX);
    settle(&mut c, &mut flight);
    c.evict_host(usize::MAX);
    prop_assert_eq!(c.allocator().available_size(), DEVICE);
    prop_assert_eq!(c.host().available(), host_pages as usize);
    prop_assert_eq!(c.node_count(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(debug_assertions) { 256 } else { 2048 }, ..ProptestConfig::default() })]

    #[test]
    fn two_tier_reference_keeps_its_invariants(
        policy in 0usize..3,
        host_pages in 1u32..20,
        threshold in 1usize..5,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(WritePolicy::ALL[policy], host_pages, threshold, &ops)?;
    }
}

/// Found by the property above: under `write_back`, the eviction a load-back makes room
/// with backs up its victims and so evicts host leaves, which took the very host copy
/// being loaded (a node removed while locked). Load-backs hold their host copies now.
#[test]
fn load_back_keeps_its_host_copies_while_it_makes_room() {
    let k = |v: &[u32]| v.to_vec();
    let ops = vec![
        Op::Start { key: k(&[0, 0]), finish: false },
        Op::Start { key: k(&[1, 0, 0, 0, 0, 0]), finish: true },
        Op::Finish,
        Op::Start { key: k(&[0, 1, 0, 0, 0, 0, 0, 0, 0, 0]), finish: false },
        Op::Start { key: k(&[1, 0, 1, 0, 0, 0, 0, 0, 0, 0]), finish: false },
        Op::Finish,
        Op::Start { key: k(&[0, 0, 1, 0, 1, 0, 0, 0]), finish: false },
        Op::Start { key: k(&[1, 0, 1, 0]), finish: false },
        Op::Start { key: k(&[1, 1, 1, 1]), finish: false },
        Op::Finish,
        Op::Start { key: k(&[0, 1, 0, 0, 0, 0, 1, 0]), finish: false },
    ];
    run(WritePolicy::WriteBack, 1, 1, &ops).unwrap();
}
