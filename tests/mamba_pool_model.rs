#![cfg(not(loom))]
//! `MambaPool` and `HybridReqToTokenPool` against a plain sequential model: which
//! slots are free, held or cached (slot numbers predicted exactly: lowest free first),
//! what each slot's state holds (one byte pattern per slot), and which operations must
//! fail with which error and change nothing. The operation mix names live handles,
//! cached slots, and random (stale, forged, out-of-range) slot numbers.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvpool::mamba::{
    Component, HeldState, HybridReqToTokenPool, HybridRow, MambaConfig, MambaError, MambaPool, MambaSlot, StateDtype,
    StateShape,
};
use kvpool::FreeErrorKind;
use proptest::collection::vec;
use proptest::prelude::*;

const CASES: u32 = if cfg!(miri) { 8 } else { 256 };

#[derive(Clone, Debug)]
enum Op {
    Alloc,
    Write(usize, u8),
    Cache(usize),
    Fork(usize),
    ForkNumber(u32),
    CopyFrom(usize, usize),
    FreeHeld(usize),
    FreeCached(Vec<usize>),
    FreeNumbers(Vec<u32>),
    RowAlloc,
    RowFork(usize),
    RowCheckpoint(usize, u8),
    RowFinish(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Alloc),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Op::Write(i, b)),
        2 => any::<usize>().prop_map(Op::Cache),
        2 => any::<usize>().prop_map(Op::Fork),
        1 => (0u32..12).prop_map(Op::ForkNumber),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::CopyFrom(a, b)),
        2 => any::<usize>().prop_map(Op::FreeHeld),
        2 => vec(any::<usize>(), 0..3).prop_map(Op::FreeCached),
        1 => vec(0u32..12, 0..3).prop_map(Op::FreeNumbers),
        2 => Just(Op::RowAlloc),
        1 => any::<usize>().prop_map(Op::RowFork),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Op::RowCheckpoint(i, b)),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(i, k)| Op::RowFinish(i, k)),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Hand {
    Held,
    Cached,
}

/// The model: slot -> (hand, pattern byte). Absent = free.
struct Model {
    size: u32,
    slots: BTreeMap<u32, (Hand, u8)>,
}

impl Model {
    fn lowest_free(&self, n: usize) -> Option<Vec<u32>> {
        let v: Vec<u32> = (1..=self.size).filter(|s| !self.slots.contains_key(s)).take(n).collect();
        (v.len() == n).then_some(v)
    }
}

fn cfg() -> MambaConfig {
    MambaConfig {
        layers: 2,
        conv: vec![StateShape::new(&[3], StateDtype::Bf16)],
        temporal: StateShape::new(&[2], StateDtype::F32),
    }
}

/// The slot's whole state, as read through its handle.
fn contents(pool: &MambaPool, slot: &MambaSlot) -> Vec<u8> {
    let mut v = Vec::new();
    for l in 0..2 {
        for c in [Component::Conv(0), Component::Temporal] {
            v.extend_from_slice(pool.component::<u8>(slot, l, c).unwrap());
        }
    }
    v
}

fn set(pool: &MambaPool, slot: &mut impl HeldState, b: u8) {
    for l in 0..2 {
        for c in [Component::Conv(0), Component::Temporal] {
            pool.component_mut::<u8>(slot, l, c).unwrap().fill(b);
        }
    }
}

fn cached_contents(pool: &MambaPool, slot: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for l in 0..2 {
        for c in [Component::Conv(0), Component::Temporal] {
            pool.read_cached(slot, l, c, |b| v.extend_from_slice(b)).unwrap();
        }
    }
    v
}

const SLOT_BYTES: usize = 2 * (6 + 8);

fn run(ops: &[Op], size: u32, rows: u32) -> Result<(), TestCaseError> {
    let pool = Arc::new(MambaPool::new(size, cfg()).unwrap());
    let hybrid = HybridReqToTokenPool::new(rows, 8, Arc::clone(&pool), 2).unwrap();
    let mut m = Model { size, slots: BTreeMap::new() };
    let mut held: Vec<MambaSlot> = Vec::new();
    let mut cached: Vec<u32> = Vec::new();
    let mut live_rows: Vec<HybridRow> = Vec::new();
    let pick = |i: usize, n: usize| if n == 0 { None } else { Some(i % n) };
    for op in ops {
        match op.clone() {
            Op::Alloc => match (pool.alloc(), m.lowest_free(1)) {
                (Ok(s), Some(want)) => {
                    prop_assert_eq!(s.index(), want[0]);
                    prop_assert!(contents(&pool, &s).iter().all(|&b| b == 0));
                    m.slots.insert(s.index(), (Hand::Held, 0));
                    held.push(s);
                }
                (Err(e), None) => prop_assert_eq!(e.available, 0),
                (got, want) => prop_assert!(false, "alloc: {:?} vs model {:?}", got, want),
            },
            Op::Write(i, b) => {
                if let Some(i) = pick(i, held.len()) {
                    set(&pool, &mut held[i], b);
                    m.slots.get_mut(&held[i].index()).unwrap().1 = b;
                }
            }
            Op::Cache(i) => {
                if let Some(i) = pick(i, held.len()) {
                    let s = pool.cache(held.swap_remove(i)).unwrap();
                    m.slots.get_mut(&s).unwrap().0 = Hand::Cached;
                    cached.push(s);
                }
            }
            Op::Fork(i) => {
                if let Some(i) = pick(i, cached.len()) {
                    let src = cached[i];
                    match (pool.fork_from(src), m.lowest_free(1)) {
                        (Ok(s), Some(want)) => {
                            prop_assert_eq!(s.index(), want[0]);
                            let b = m.slots[&src].1;
                            prop_assert_eq!(contents(&pool, &s), vec![b; SLOT_BYTES]);
                            m.slots.insert(s.index(), (Hand::Held, b));
                            held.push(s);
                        }
                        (Err(MambaError::OutOfMemory(_)), None) => {}
                        (got, want) => prop_assert!(false, "fork: {:?} vs model {:?}", got, want),
                    }
                }
            }
            Op::ForkNumber(n) => {
                let is_cached = matches!(m.slots.get(&n), Some((Hand::Cached, _)));
                match pool.fork_from(n) {
                    Ok(s) => {
                        prop_assert!(is_cached);
                        let b = m.slots[&n].1;
                        m.slots.insert(s.index(), (Hand::Held, b));
                        held.push(s);
                    }
                    Err(MambaError::NotCached { slot }) => prop_assert!(!is_cached && slot == n),
                    Err(MambaError::OutOfMemory(_)) => prop_assert!(is_cached && m.lowest_free(1).is_none()),
                    Err(e) => prop_assert!(false, "fork_from({}): {:?}", n, e),
                }
            }
            Op::CopyFrom(i, j) => {
                if let (Some(i), Some(j)) = (pick(i, cached.len()), pick(j, held.len())) {
                    let src = cached[i];
                    pool.copy_from(&[src], &mut [&mut held[j]]).unwrap();
                    let b = m.slots[&src].1;
                    m.slots.get_mut(&held[j].index()).unwrap().1 = b;
                }
            }
            Op::FreeHeld(i) => {
                if let Some(i) = pick(i, held.len()) {
                    let s = held.swap_remove(i);
                    m.slots.remove(&s.index());
                    pool.free_slot(s).unwrap();
                }
            }
            Op::FreeCached(is) => {
                let batch: Vec<u32> = is.iter().filter_map(|&i| pick(i, cached.len()).map(|i| cached[i])).collect();
                let mut seen = std::collections::BTreeSet::new();
                let dup = batch.iter().find(|s| !seen.insert(**s)).copied();
                match (pool.free(&batch), dup) {
                    (Ok(()), None) => {
                        for s in &batch {
                            m.slots.remove(s);
                            cached.retain(|c| c != s);
                        }
                    }
                    (Err(e), Some(d)) => {
                        prop_assert_eq!((e.index, e.kind, e.rest_freed), (d, FreeErrorKind::NotAllocated, false))
                    }
                    (got, dup) => prop_assert!(false, "free {:?}: {:?} (duplicate {:?})", batch, got, dup),
                }
            }
            Op::FreeNumbers(batch) => {
                // The model's verdict on the first offending slot, in batch order.
                let mut seen = std::collections::BTreeSet::new();
                let mut want = None;
                for &s in &batch {
                    let kind = if s == 0 || s > size {
                        Some(FreeErrorKind::OutOfRange { first: 1, last: size })
                    } else {
                        match m.slots.get(&s) {
                            None => Some(FreeErrorKind::NotAllocated),
                            Some((Hand::Held, _)) => Some(FreeErrorKind::InUse),
                            Some((Hand::Cached, _)) if !seen.insert(s) => Some(FreeErrorKind::NotAllocated),
                            Some(_) => None,
                        }
                    };
                    if let Some(k) = kind {
                        want = Some((s, k));
                        break;
                    }
                }
                // Range errors are found before the others.
                if let Some(&s) = batch.iter().find(|&&s| s == 0 || s > size) {
                    want = Some((s, FreeErrorKind::OutOfRange { first: 1, last: size }));
                }
                match (pool.free(&batch), want) {
                    (Ok(()), None) => {
                        for s in &batch {
                            m.slots.remove(s);
                            cached.retain(|c| c != s);
                        }
                    }
                    (Err(e), Some((s, k))) => prop_assert_eq!((e.index, e.kind, e.rest_freed), (s, k, false)),
                    (got, want) => prop_assert!(false, "free {:?}: {:?} vs model {:?}", batch, got, want),
                }
            }
            Op::RowAlloc | Op::RowFork(_) => {
                let src = match op {
                    Op::RowFork(i) => match pick(*i, cached.len()) {
                        Some(i) => Some(cached[i]),
                        None => continue,
                    },
                    _ => None,
                };
                let state = match src.map(|s| pool.fork_from(s)) {
                    Some(Ok(s)) => {
                        m.slots.insert(s.index(), (Hand::Held, m.slots[&src.unwrap()].1));
                        Some(s)
                    }
                    Some(Err(_)) => continue,
                    None => None,
                };
                let need = if state.is_some() { 2 } else { 3 };
                let want = m.lowest_free(need).filter(|_| hybrid.available_size() > 0);
                let r = match state {
                    Some(s) => hybrid.alloc_with(s),
                    None => hybrid.alloc(),
                };
                match (r, want) {
                    (Ok(row), Some(want)) => {
                        let mut got: Vec<u32> = row
                            .mamba()
                            .into_iter()
                            .chain([row.track(0).unwrap(), row.track(1).unwrap()])
                            .map(|s| s.index())
                            .collect();
                        if src.is_some() {
                            got.remove(0);
                        }
                        prop_assert_eq!(&got, &want);
                        for s in want {
                            m.slots.insert(s, (Hand::Held, 0));
                        }
                        prop_assert_eq!(hybrid.mamba_index(row.index()), row.mamba().unwrap().index());
                        live_rows.push(row);
                    }
                    (Err(e), None) => {
                        if let Some(s) = e.returned {
                            m.slots.remove(&s.index());
                            pool.free_slot(s).unwrap();
                        }
                    }
                    (got, want) => prop_assert!(false, "row alloc: {:?} vs model {:?}", got.map(|r| r.index()), want),
                }
            }
            Op::RowCheckpoint(i, b) => {
                if let Some(i) = pick(i, live_rows.len()) {
                    let row = &mut live_rows[i];
                    let Some(w) = row.mamba().map(MambaSlot::index) else { continue };
                    set(&pool, &mut *row, b); // the row's working state

                    m.slots.get_mut(&w).unwrap().1 = b;
                    let next = row.next_track();
                    match hybrid.checkpoint(row) {
                        Ok(written) => {
                            prop_assert_eq!(written, row.track(next).unwrap().index());
                            m.slots.get_mut(&written).unwrap().1 = b;
                            prop_assert_eq!(row.next_track(), 1 - next);
                        }
                        Err(e) => prop_assert!(e == MambaError::NoTrackBuffers && row.track(next).is_none()),
                    }
                }
            }
            Op::RowFinish(i, keep) => {
                if let Some(i) = pick(i, live_rows.len()) {
                    let mut row = live_rows.swap_remove(i);
                    if keep {
                        if let Some(s) = hybrid.take_checkpoint(&mut row) {
                            let s = pool.cache(s).unwrap();
                            m.slots.get_mut(&s).unwrap().0 = Hand::Cached;
                            cached.push(s);
                        }
                    }
                    let gone: Vec<u32> =
                        row.mamba().into_iter().chain(row.track(0)).chain(row.track(1)).map(|s| s.index()).collect();
                    let r = row.index();
                    hybrid.free(row).unwrap();
                    for s in gone {
                        m.slots.remove(&s);
                    }
                    prop_assert_eq!(hybrid.mamba_index(r), 0);
                }
            }
        }
        // After every step: counts, hands and contents agree with the model.
        prop_assert_eq!(pool.available(), size as usize - m.slots.len());
        for s in 0..=size + 1 {
            let want = m.slots.get(&s);
            prop_assert_eq!(pool.is_allocated(s), want.is_some(), "slot {}", s);
            prop_assert_eq!(pool.is_cached(s), matches!(want, Some((Hand::Cached, _))), "slot {}", s);
        }
        for h in &held {
            prop_assert_eq!(contents(&pool, h), vec![m.slots[&h.index()].1; SLOT_BYTES]);
        }
        for &c in &cached {
            prop_assert_eq!(cached_contents(&pool, c), vec![m.slots[&c].1; SLOT_BYTES]);
        }
    }
    pool.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
    for h in held {
        pool.free_slot(h).unwrap();
    }
    for r in live_rows {
        hybrid.free(r).unwrap();
    }
    pool.free(&cached).unwrap();
    prop_assert_eq!(pool.available(), size as usize);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn mamba_pool_and_rows_match_the_model(size in 1u32..10, rows in 1u32..4, ops in vec(op(), 0..120)) {
        run(&ops, size, rows)?;
    }
}
