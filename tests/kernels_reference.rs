//! Host checks of the kernels' reference implementations (`kvpool::kv`): fp8 e4m3
//! rounding against a brute-force nearest-value search, half conversion against the
//! `half` crate, and the scatter / gather / move / fused-allocation references
//! against independent formulations and their error contracts.

use kvpool::kv::fp8::{bf16_to_f32, dequantize_e4m3, f16_to_f32, quantize_e4m3, E4M3_MAX, E4M3_NAN};
use kvpool::kv::reference::{
    decode_with_rows, extend_with_rows, gather_rows, move_rows, scatter_mla_rows, scatter_rows, DenseRows, RowTable,
};
use kvpool::kv::{KvError, RowStore, SrcFloat};
use kvpool::PagedAllocator;

mod kernel_common;

use kernel_common::Rng;

/// The e4m3 code nearest to `y` (ties to the even code), saturating at 448.
fn nearest_e4m3(y: f32) -> u8 {
    if y.is_nan() {
        return E4M3_NAN;
    }
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = y.abs() as f64;
    if a >= 448.0 {
        return E4M3_MAX | sign;
    }
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for c in 0..=E4M3_MAX {
        let d = (dequantize_e4m3(c) as f64 - a).abs();
        if d < best_d || (d == best_d && c % 2 == 0) {
            best = c;
            best_d = d;
        }
    }
    best | sign
}

#[test]
fn e4m3_matches_brute_force_nearest() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut inputs: Vec<f32> = Vec::new();
    // Every representable value, every midpoint between neighbours, and one f32 ulp on
    // either side of each midpoint.
    for c in 0..E4M3_MAX {
        let (lo, hi) = (dequantize_e4m3(c), dequantize_e4m3(c + 1));
        let mid = ((lo as f64 + hi as f64) / 2.0) as f32;
        for v in [lo, hi, mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().max(1) - 1)] {
            inputs.push(v);
            inputs.push(-v);
        }
    }
    inputs.extend([0.0, -0.0, 448.0, 463.99, 464.0, 465.0, 1e30, f32::INFINITY, -f32::INFINITY, f32::MIN_POSITIVE]);
    inputs.extend([2f32.powi(-10), 2f32.powi(-10) * 1.0001, 2f32.powi(-6) * 0.99999, f32::from_bits(1)]);
    // Random magnitudes across the whole e4m3 range and beyond.
    for _ in 0..200_000 {
        let e = rng.below(40) as i32 - 20;
        let m = 1.0 + (rng.below(1 << 23) as f32) / (1u32 << 23) as f32;
        let s = if rng.below(2) == 0 { 1.0 } else { -1.0 };
        inputs.push(s * m * 2f32.powi(e));
    }
    for &x in &inputs {
        assert_eq!(quantize_e4m3(x, 1.0), nearest_e4m3(x), "x = {x:e} ({:#x})", x.to_bits());
    }
    // With a scale: the reference multiplies by inv_scale first, in f32.
    for _ in 0..20_000 {
        let x = (rng.below(2_000_000) as f32 - 1_000_000.0) / 997.0;
        let inv = 1.0 / (0.01 + rng.below(1000) as f32 / 100.0);
        assert_eq!(quantize_e4m3(x, inv), nearest_e4m3(x * inv));
    }
    for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffc0_0000)] {
        let q = quantize_e4m3(nan, 1.0);
        assert_eq!(q, E4M3_NAN);
        assert!(dequantize_e4m3(q).is_nan());
    }
}

#[test]
fn e4m3_codes_round_trip() {
    for c in 0..=255u8 {
        let v = dequantize_e4m3(c);
        if c & 0x7f == E4M3_NAN {
            assert!(v.is_nan());
        } else {
            assert_eq!(quantize_e4m3(v, 1.0), c, "code {c:#x} value {v}");
        }
    }
}

#[test]
fn e4m3_round_trip_error_is_bounded() {
    // |x - deq(q(x))| <= 2^-4 |x| for normal results (3 mantissa bits, half an ulp),
    // <= 2^-10 for subnormal ones (half the step 2^-9); saturated beyond 448.
    let mut rng = Rng(7);
    for _ in 0..100_000 {
        let x = f32::from_bits(rng.next() as u32 & 0x7fff_ffff);
        if !x.is_finite() {
            continue;
        }
        let back = dequantize_e4m3(quantize_e4m3(x, 1.0));
        let err = (x - back).abs();
        if x >= 448.0 {
            assert_eq!(back, 448.0);
        } else {
            assert!(err <= x * 0.0625 || err <= 2f32.powi(-10), "x {x:e} back {back:e}");
        }
    }
}

#[test]
fn half_conversions_are_exact() {
    for h in 0..=u16::MAX {
        let ours = f16_to_f32(h);
        let theirs = half::f16::from_bits(h).to_f32();
        if theirs.is_nan() {
            assert!(ours.is_nan(), "{h:#x}");
        } else {
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#x}");
        }
        let b = bf16_to_f32(h);
        let theirs = half::bf16::from_bits(h).to_f32();
        assert!(b.to_bits() == theirs.to_bits() || (b.is_nan() && theirs.is_nan()), "{h:#x}");
    }
}

#[test]
fn scatter_then_gather_returns_the_rows() {
    let mut rng = Rng(11);
    for _ in 0..200 {
        let row = 2 * (1 + rng.below(40) as usize);
        let stride = row + 2 * rng.below(4) as usize;
        let rows = 1 + rng.below(64) as usize;
        let n = rng.below(rows as u64 + 1) as usize;
        let mut slots: Vec<u32> = (0..rows as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.below(i as u64 + 1) as usize);
        }
        slots.truncate(n);
        let src: Vec<u8> = (0..n * stride).map(|_| rng.next() as u8).collect();
        let mut pool = vec![0xAAu8; rows * row];
        scatter_rows(RowStore::Copy, &src, stride, row, &slots, &mut pool).unwrap();
        let mut back = vec![0u8; n * row];
        gather_rows(&pool, row, &slots, &mut back, row).unwrap();
        for i in 0..n {
            assert_eq!(&back[i * row..(i + 1) * row], &src[i * stride..i * stride + row]);
        }
        // Rows nobody wrote keep their poison.
        for r in 0..rows as u32 {
            if !slots.contains(&r) {
                assert!(pool[r as usize * row..(r as usize + 1) * row].iter().all(|&b| b == 0xAA));
            }
        }
    }
}

#[test]
fn fp8_scatter_quantizes_each_element() {
    let vals = [1.0f32, -2.5, 0.001, 1000.0];
    let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut pool = vec![0u8; 3 * 4];
    let store = RowStore::Fp8E4m3 { src: SrcFloat::F32, inv_scale: 0.5 };
    scatter_rows(store, &src, 16, 16, &[2], &mut pool).unwrap();
    let want: Vec<u8> = vals.iter().map(|&v| quantize_e4m3(v, 0.5)).collect();
    assert_eq!(&pool[8..], &want[..]);
    assert_eq!(&pool[..8], &[0; 8]);
    let bf: Vec<u8> = [0x3f80u16, 0xc020].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut pool = vec![0u8; 2 * 2];
    scatter_rows(RowStore::Fp8E4m3 { src: SrcFloat::Bf16, inv_scale: 1.0 }, &bf, 4, 4, &[1], &mut pool).unwrap();
    assert_eq!(pool, [0, 0, 0x38, quantize_e4m3(-2.5, 1.0)]);
}

#[test]
fn mla_rows_are_nope_then_rope() {
    let nope = [1u8, 2, 3, 4, 9, 9, 5, 6, 7, 8, 9, 9];
    let rope = [10u8, 11, 12, 13];
    let mut pool = vec![0u8; 4 * 6];
    let n = DenseRows { data: &nope, row_stride: 6, row_bytes: 4 };
    let r = DenseRows { data: &rope, row_stride: 2, row_bytes: 2 };
    scatter_mla_rows(RowStore::Copy, n, r, &[3, 0], &mut pool).unwrap();
    assert_eq!(&pool[18..24], &[1, 2, 3, 4, 10, 11]);
    assert_eq!(&pool[0..6], &[5, 6, 7, 8, 12, 13]);
}

#[test]
fn errors_write_nothing() {
    let mut pool = vec![7u8; 4 * 4];
    let before = pool.clone();
    let src = [1u8; 8];
    assert_eq!(
        scatter_rows(RowStore::Copy, &src, 4, 4, &[1, 4], &mut pool),
        Err(KvError::SlotOutOfRange { slot: 4, rows: 4 })
    );
    assert!(matches!(scatter_rows(RowStore::Copy, &src, 4, 4, &[1, 2, 3], &mut pool), Err(KvError::Shape { .. })));
    assert!(matches!(scatter_rows(RowStore::Copy, &src, 2, 4, &[1], &mut pool), Err(KvError::BadRow { .. })));
    let f16 = RowStore::Fp8E4m3 { src: SrcFloat::F16, inv_scale: 1.0 };
    assert!(matches!(scatter_rows(f16, &src, 3, 3, &[1], &mut pool), Err(KvError::BadRow { .. })));
    assert_eq!(move_rows(&mut pool, 4, &[1, 2], &[2, 3]), Err(KvError::MoveOverlap { slot: 2 }));
    assert_eq!(move_rows(&mut pool, 4, &[1, 2], &[3, 3]), Err(KvError::MoveOverlap { slot: 3 }));
    assert!(matches!(move_rows(&mut pool, 4, &[1], &[2, 3]), Err(KvError::Shape { .. })));
    let mut dst = [0u8; 4];
    assert!(gather_rows(&pool, 4, &[9], &mut dst, 4).is_err());
    assert_eq!(pool, before);
    move_rows(&mut pool, 4, &[], &[]).unwrap();
    pool[4..8].copy_from_slice(&[1, 2, 3, 4]);
    move_rows(&mut pool, 4, &[1], &[3]).unwrap();
    assert_eq!(&pool[12..16], &[1, 2, 3, 4]);
}

#[test]
fn fused_allocation_matches_the_allocator_and_reads_last_loc_from_rows() {
    let mut rng = Rng(3);
    for &ps in &[1u32, 4, 16, 64] {
        for _ in 0..50 {
            let alloc = PagedAllocator::new(1 << 14, ps).unwrap();
            let batch = 1 + rng.below(8) as usize;
            let stride = 300usize;
            // Existing prefixes, allocated for real, recorded in rows 2*i.
            let mut table = vec![0u32; 2 * batch * stride];
            let rows: Vec<u32> = (0..batch as u32).map(|i| 2 * i).collect();
            let (mut prefix, mut seq, mut last) = (vec![], vec![], vec![]);
            for &row in &rows {
                let p = rng.below(100) as u32;
                let s = p + rng.below(150) as u32;
                let mut slots = vec![0u32; p as usize];
                alloc.alloc_extend(&[0], &[p], &[0], &mut slots).unwrap();
                table[row as usize * stride..][..p as usize].copy_from_slice(&slots);
                prefix.push(p);
                seq.push(s);
                last.push(slots.last().copied().unwrap_or(0));
            }
            // The host allocator's answer for this state...
            let mut want = vec![0u32; seq.iter().zip(&prefix).map(|(s, p)| (s - p) as usize).sum()];
            let plan = kvpool::alloc::plan_extend(ps, &prefix, &seq).unwrap();
            let pages: Vec<u32> = (0..plan.new_pages as u32).map(|k| 5000 / ps.max(1) + 3 * k).collect();
            kvpool::alloc::expand_extend(ps, &prefix, &seq, &last, &pages, &mut want).unwrap();
            // ...equals the fused reference with last_loc read from the rows.
            let mut out = vec![0u32; want.len()];
            let t = RowTable { cells: &mut table, stride, rows: &rows };
            extend_with_rows(ps, &prefix, &seq, None, &pages, &mut out, Some(t)).unwrap();
            assert_eq!(out, want);
            let mut at = 0;
            for i in 0..batch {
                let n = (seq[i] - prefix[i]) as usize;
                let base = rows[i] as usize * stride + prefix[i] as usize;
                assert_eq!(&table[base..base + n], &want[at..at + n]);
                at += n;
            }
            // A decode step on top, last_loc from the rows again.
            let seq2: Vec<u32> = seq.iter().map(|s| s + 1).collect();
            let dplan = kvpool::alloc::plan_decode(ps, &seq2).unwrap();
            let dpages: Vec<u32> = (0..dplan.new_pages as u32).map(|k| 9000 / ps + k).collect();
            let last2: Vec<u32> = rows
                .iter()
                .zip(&seq)
                .map(|(&r, &s)| if s == 0 { 0 } else { table[r as usize * stride + s as usize - 1] })
                .collect();
            let mut dwant = vec![0u32; batch];
            kvpool::alloc::expand_decode(ps, &seq2, &last2, &dpages, &mut dwant).unwrap();
            let mut dout = vec![0u32; batch];
            let t = RowTable { cells: &mut table, stride, rows: &rows };
            decode_with_rows(ps, &seq2, None, &dpages, &mut dout, Some(t)).unwrap();
            assert_eq!(dout, dwant);
            for i in 0..batch {
                assert_eq!(table[rows[i] as usize * stride + seq[i] as usize], dwant[i]);
            }
        }
    }
    // A row past the table, or a sequence past max_context_len, is refused untouched.
    let mut cells = vec![0u32; 8];
    let mut out = [0u32; 2];
    let t = RowTable { cells: &mut cells, stride: 4, rows: &[2] };
    assert!(extend_with_rows(1, &[0], &[2], Some(&[0]), &[1, 2], &mut out, Some(t)).is_err());
    let t = RowTable { cells: &mut cells, stride: 4, rows: &[1] };
    let mut out5 = [0u32; 5];
    assert!(extend_with_rows(1, &[0], &[5], Some(&[0]), &[1, 2, 3, 4, 5], &mut out5, Some(t)).is_err());
    assert_eq!(cells, [0; 8]);
    assert_eq!(out, [0; 2]);
    assert!(matches!(decode_with_rows(4, &[3], None, &[], &mut [0], None), Err(KvError::Format { .. })));
}
