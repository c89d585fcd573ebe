//! Owned batches ([`Slots`], [`SlotPool::alloc_slots`], [`SlotPool::free_slots`])
//! against a model of who owns each index (feature `models`): the shared driver of
//! `tests/slot_owned_model.rs` and the `slot_owned` fuzz target.
//!
//! One pool of [`CAPACITY`] indices with magazines of 2 entries (so runs magazines of
//! `2 * 64` indices, whose flushes small batches reach),
//! [`SLOTS`] batches of different capacities, and the bare API beside them. The ops
//! fill and empty the batches (on this thread, or on another thread with another
//! magazine), allocate and free bare indices, try to free an index a batch owns through
//! the bare API, hand a batch to another pool, and clear the pool.
//!
//! The rules it checks (module docs of `kvpool::slots::owned`):
//!
//! * a fill succeeds exactly when the batch has room and the model holds enough free
//!   indices, hands out only free ones (appended, the batch's runs equal to its
//!   indices), and otherwise fails with the exact error and changes nothing;
//! * emptying a batch frees exactly its indices, and emptying its tail exactly the
//!   last ones (the rest stay, in order); another pool refuses it, as this pool does
//!   after `clear`, changing nothing;
//! * a bare free of an index a batch owns is refused as not allocated, changing nothing;
//! * after every step: `available()` equals the model's free count, `is_allocated`
//!   holds exactly for bare-allocated indices, and `check_invariants()` passes
//!   (held + free + in magazines + in batches = capacity).

use arbitrary::Arbitrary;

use crate::error::{FreeErrorKind, SlotsError};
use crate::{SlotPool, Slots};

/// The pool's capacity: five bitmap words and part of a sixth.
pub const CAPACITY: u32 = 5 * 64 + 21;
/// How many batches the driver keeps, with capacities [`SLOT_CAPS`].
pub const SLOTS: usize = 4;
/// The batches' capacities.
pub const SLOT_CAPS: [usize; SLOTS] = [8, 64, 160, CAPACITY as usize];
/// How many ops the `slot_owned` fuzz target reads from one input.
pub const MAX_FUZZ_OPS: usize = 64;

/// One step of a [`run_owned`] sequence. Raw numbers are reduced into range as
/// documented per variant; `k` picks batch `k % SLOTS`.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq)]
pub enum OwnedOp {
    /// Fill batch `k` with `n % 170` more indices (0 included: a no-op).
    Fill {
        /// Raw batch.
        k: u8,
        /// Raw count.
        n: u16,
    },
    /// Empty batch `k` into the pool, on this thread or (`elsewhere`) on another
    /// thread, whose magazine is another one.
    Empty {
        /// Raw batch.
        k: u8,
        /// On another thread.
        elsewhere: bool,
    },
    /// Return the last `n % (len + 2)` indices of batch `k` (one more than it holds
    /// included: refused).
    EmptyTail {
        /// Raw batch.
        k: u8,
        /// Raw count.
        n: u16,
    },
    /// Bare-allocate `1 + n % 70` indices.
    Alloc {
        /// Raw count.
        n: u8,
    },
    /// Bare-free the `at % held`-th bare-allocated index and the `len % 8` after it.
    Free {
        /// Raw position.
        at: u16,
        /// Raw extra length.
        len: u8,
    },
    /// Bare-free the `j % len`-th index of batch `k` (refused: the batch owns it).
    FreeOwned {
        /// Raw batch.
        k: u8,
        /// Raw position.
        j: u16,
    },
    /// Hand batch `k` to another pool, to fill and to empty (both refused when it
    /// holds indices).
    OtherPool {
        /// Raw batch.
        k: u8,
    },
    /// `clear()` the pool: every batch that held indices is refused from then on and
    /// replaced by a new, empty one.
    Clear,
}

/// Decode up to `max` ops from fuzzer bytes.
pub fn owned_ops_from_bytes(bytes: &[u8], max: usize) -> Vec<OwnedOp> {
    super::decode_ops(bytes, max)
}

/// Who holds an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Free,
    Bare,
    Batch(usize),
}

/// Run `ops` and check every rule; the first broken one is the error.
pub fn run_owned(ops: &[OwnedOp]) -> Result<(), String> {
    let mut pool = SlotPool::with_magazines(CAPACITY, 2);
    let other = SlotPool::with_magazines(CAPACITY, 2);
    let mut slots: Vec<Slots> = SLOT_CAPS.iter().map(|&c| Slots::with_capacity(c)).collect();
    let mut owner = vec![Owner::Free; CAPACITY as usize + 1];
    let mut bare: Vec<u32> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        let fail = |what: String| format!("step {step} ({op:?}): {what}");
        let free_count = owner[1..].iter().filter(|&&o| o == Owner::Free).count();
        match *op {
            OwnedOp::Fill { k, n } => {
                let (k, n) = (k as usize % SLOTS, n as usize % 170);
                let before = slots[k].as_slice().to_vec();
                let room = slots[k].capacity() - before.len();
                let got = pool.alloc_slots(n, &mut slots[k]);
                let expected = if room < n {
                    Err(SlotsError::Full { requested: n, len: before.len(), capacity: slots[k].capacity() })
                } else if free_count < n {
                    Err(SlotsError::OutOfMemory(crate::OutOfMemory {
                        requested: n,
                        available: free_count,
                        evictable: None,
                        unit: crate::Unit::Indices,
                    }))
                } else {
                    Ok(())
                };
                if got != expected {
                    return Err(fail(format!("got {got:?}, expected {expected:?}")));
                }
                let now = slots[k].as_slice();
                if now[..before.len().min(now.len())] != before[..] || now.len() != before.len() + got.map_or(0, |_| n)
                {
                    return Err(fail(format!("the batch went from {before:?} to {now:?}")));
                }
                for &i in &now[before.len()..] {
                    if i == 0 || i > CAPACITY || owner[i as usize] != Owner::Free {
                        return Err(fail(format!("handed out {i}, which is {:?}", owner.get(i as usize))));
                    }
                    owner[i as usize] = Owner::Batch(k);
                }
                let from_runs: Vec<u32> = slots[k].runs().flatten().collect();
                if from_runs != now
                    || slots[k].runs().zip(slots[k].runs().skip(1)).any(|(a, b)| *a.end() + 1 == *b.start())
                {
                    return Err(fail(format!("runs {:?} do not match the indices {now:?}", slots[k])));
                }
            }
            OwnedOp::Empty { k, elsewhere } => {
                let k = k as usize % SLOTS;
                let had = slots[k].as_slice().to_vec();
                let got = if elsewhere {
                    let (pool, batch) = (&pool, &mut slots[k]);
                    std::thread::scope(|s| s.spawn(move || pool.free_slots(batch)).join())
                        .map_err(|_| fail("the other thread panicked".into()))?
                } else {
                    pool.free_slots(&mut slots[k])
                };
                if got != Ok(had.len()) || !slots[k].is_empty() {
                    return Err(fail(format!("got {got:?} for a batch of {}", had.len())));
                }
                for i in had {
                    owner[i as usize] = Owner::Free;
                }
            }
            OwnedOp::EmptyTail { k, n } => {
                let k = k as usize % SLOTS;
                let had = slots[k].as_slice().to_vec();
                let n = n as usize % (had.len() + 2);
                let got = pool.free_slots_tail(&mut slots[k], n);
                let keep = had.len().saturating_sub(n);
                let expected =
                    if n > had.len() { Err(SlotsError::TooMany { requested: n, len: had.len() }) } else { Ok(n) };
                let now = slots[k].as_slice();
                let kept = if got.is_ok() { &had[..keep] } else { &had[..] };
                if got != expected || now != kept {
                    return Err(fail(format!(
                        "got {got:?} (expected {expected:?}), the batch went from {had:?} to {now:?}"
                    )));
                }
                let from_runs: Vec<u32> = slots[k].runs().flatten().collect();
                if from_runs != now {
                    return Err(fail(format!("runs {:?} do not match the indices {now:?}", slots[k])));
                }
                if got.is_ok() {
                    for &i in &had[keep..] {
                        owner[i as usize] = Owner::Free;
                    }
                }
            }
            OwnedOp::Alloc { n } => {
                let n = 1 + n as usize % 70;
                let mut out = vec![0u32; n];
                match pool.alloc(&mut out) {
                    Ok(()) if free_count >= n => {
                        for &i in &out {
                            if i == 0 || i > CAPACITY || owner[i as usize] != Owner::Free {
                                return Err(fail(format!("bare alloc handed out {i}, {:?}", owner.get(i as usize))));
                            }
                            owner[i as usize] = Owner::Bare;
                        }
                        bare.extend(out);
                    }
                    Err(e) if free_count < n && e.available == free_count => {}
                    other => return Err(fail(format!("bare alloc of {n} with {free_count} free: {other:?}"))),
                }
            }
            OwnedOp::Free { at, len } => {
                if bare.is_empty() {
                    continue;
                }
                let at = at as usize % bare.len();
                let end = (at + 1 + len as usize % 8).min(bare.len());
                let batch: Vec<u32> = bare.drain(at..end).collect();
                pool.free(&batch).map_err(|e| fail(format!("bare free of {batch:?}: {e}")))?;
                for i in batch {
                    owner[i as usize] = Owner::Free;
                }
            }
            OwnedOp::FreeOwned { k, j } => {
                let k = k as usize % SLOTS;
                if slots[k].is_empty() {
                    continue;
                }
                let i = slots[k][j as usize % slots[k].len()];
                match pool.free(&[i]) {
                    Err(e) if e.kind == FreeErrorKind::NotAllocated && e.index == i && !e.rest_freed => {}
                    other => return Err(fail(format!("a bare free of owned {i} gave {other:?}"))),
                }
            }
            OwnedOp::OtherPool { k } => {
                let k = k as usize % SLOTS;
                let len = slots[k].len();
                let filled = other.alloc_slots(1, &mut slots[k]);
                let emptied = other.free_slots(&mut slots[k]);
                let expected =
                    if len == 0 { (Ok(()), Ok(1)) } else { (Err(SlotsError::OtherPool), Err(SlotsError::OtherPool)) };
                if (filled, emptied) != expected || slots[k].len() != len {
                    return Err(fail(format!("another pool gave {filled:?}, {emptied:?} for a batch of {len}")));
                }
            }
            OwnedOp::Clear => {
                pool.clear();
                for (k, batch) in slots.iter_mut().enumerate() {
                    if batch.is_empty() {
                        continue;
                    }
                    let len = batch.len();
                    let (filled, emptied) = (pool.alloc_slots(0, batch), pool.free_slots(batch));
                    if filled != Err(SlotsError::OtherPool)
                        || emptied != Err(SlotsError::OtherPool)
                        || batch.len() != len
                    {
                        return Err(fail(format!("batch {k} of {len} after clear: {filled:?}, {emptied:?}")));
                    }
                    *batch = Slots::with_capacity(SLOT_CAPS[k]);
                }
                owner.iter_mut().for_each(|o| *o = Owner::Free);
                bare.clear();
            }
        }
        let free_count = owner[1..].iter().filter(|&&o| o == Owner::Free).count();
        if pool.available() != free_count {
            return Err(fail(format!("available {} but the model has {free_count} free", pool.available())));
        }
        for (i, &o) in owner.iter().enumerate().skip(1) {
            if pool.is_allocated(i as u32) != (o == Owner::Bare) {
                return Err(fail(format!("is_allocated({i}) disagrees with the model ({o:?})")));
            }
        }
        pool.check_invariants().map_err(|e| fail(format!("check_invariants: {e}")))?;
        other.check_invariants().map_err(|e| fail(format!("the other pool: {e}")))?;
    }
    Ok(())
}
