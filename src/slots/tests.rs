use super::*;

#[test]
fn fresh_pool_is_ascending() {
    let pool = SlotPool::new(200);
    let mut a = [0u32; 70];
    pool.alloc(&mut a).unwrap();
    assert_eq!(a.to_vec(), (1..=70).collect::<Vec<_>>());
    let mut b = [0u32; 130];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b.to_vec(), (71..=200).collect::<Vec<_>>());
    assert_eq!(pool.available(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn all_or_nothing() {
    let pool = SlotPool::new(10);
    let mut a = [0u32; 7];
    pool.alloc(&mut a).unwrap();
    let mut b = [99u32; 4];
    let e = pool.alloc(&mut b).unwrap_err();
    assert_eq!((e.requested, e.available), (4, 3));
    assert_eq!(b, [99; 4]);
    assert_eq!(pool.available(), 3);
    let mut c = [0u32; 3];
    pool.alloc(&mut c).unwrap(); // exact capacity
    assert_eq!(c, [8, 9, 10]);
    pool.alloc(&mut []).unwrap(); // size 0 at zero availability
}

#[test]
fn lowest_free_first_after_frees() {
    let pool = SlotPool::new(300);
    let mut a = [0u32; 300];
    pool.alloc(&mut a).unwrap();
    pool.free(&[250, 5, 130]).unwrap();
    let mut b = [0u32; 3];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b, [5, 130, 250]);
}

#[test]
fn free_errors_change_nothing() {
    let pool = SlotPool::new(100);
    let mut a = [0u32; 10];
    pool.alloc(&mut a).unwrap();
    let e = pool.free(&[1, 2, 0]).unwrap_err();
    assert_eq!(e.index, 0);
    assert!(!e.rest_freed);
    let e = pool.free(&[1, 101]).unwrap_err();
    assert_eq!(e.kind, FreeErrorKind::OutOfRange { first: 1, last: 100 });
    let e = pool.free(&[1, 50]).unwrap_err();
    assert_eq!((e.index, e.kind), (50, FreeErrorKind::NotAllocated));
    assert_eq!(pool.available(), 90);
    assert!(pool.is_allocated(1));
    pool.check_invariants().unwrap();
    pool.free(&[]).unwrap();
}

#[test]
fn duplicate_in_batch_frees_once_and_reports() {
    let pool = SlotPool::new(200);
    let mut a = [0u32; 200];
    pool.alloc(&mut a).unwrap();
    // adjacent duplicate (same run) and a distant one (another run)
    let e = pool.free(&[3, 3]).unwrap_err();
    assert_eq!((e.index, e.rest_freed), (3, true));
    let e = pool.free(&[7, 150, 7]).unwrap_err();
    assert_eq!((e.index, e.rest_freed), (7, true));
    assert_eq!(pool.available(), 3);
    pool.check_invariants().unwrap();
}

#[test]
fn free_group_publishes_at_end() {
    let pool = SlotPool::new(8);
    let mut a = [0u32; 8];
    pool.alloc(&mut a).unwrap();
    {
        let mut g = pool.free_group();
        g.free(&a[..3]).unwrap();
        assert!(g.free(&a[..1]).is_err()); // already freed in the group
        assert_eq!(pool.available(), 0);
        assert!(pool.alloc(&mut [0u32; 1]).is_err());
        pool.check_invariants().unwrap();
        g.free(&a[3..5]).unwrap();
        assert_eq!(g.pending(), 5);
    }
    assert_eq!(pool.available(), 5);
    pool.check_invariants().unwrap();
}

#[test]
fn clear_restores_everything() {
    let mut pool = SlotPool::new(130);
    let mut a = [0u32; 100];
    pool.alloc(&mut a).unwrap();
    pool.clear();
    assert_eq!(pool.available(), 130);
    let mut b = [0u32; 130];
    pool.alloc(&mut b).unwrap();
    assert_eq!(b[129], 130);
}

#[test]
fn zero_capacity_pool() {
    let pool = SlotPool::new(0);
    assert!(pool.alloc(&mut [0u32; 1]).is_err());
    pool.alloc(&mut []).unwrap();
    assert!(pool.free(&[1]).is_err());
    pool.check_invariants().unwrap();
}

#[test]
fn lowest_bits_picks_lowest() {
    assert_eq!(lowest_bits(0b1011_0110, 3), 0b0001_0110);
    assert_eq!(lowest_bits(u64::MAX, 64), u64::MAX);
}
