//! The Mamba state kernels (module `mamba_state`): copy or zero whole state slots of a
//! Mamba pool for a batch of slots in one launch.
//!
//! A Mamba pool keeps each state component (the conv states, the temporal state) in one
//! buffer `[layers, num_rows, row]`, `row = vecs * W` bytes, so a slot's state is
//! `layers * components` rows. The kernels treat every `(pair, layer, component)` as one
//! row and spread it over the blocks of `ctaid.x`:
//!
//! * grid `(bx, n_pairs, layers * n_comps)`, block [`MAMBA_THREADS`];
//! * `ctaid.z = layer * n_comps + comp`; component `comp` is `base{comp}` / `vecs{comp}`
//!   (at most [`MAMBA_MAX_COMPONENTS`]);
//! * thread `t` of block `b` moves vectors `b * MAMBA_THREADS + t + k * stride` of the
//!   row, `stride = nctaid.x * MAMBA_THREADS`, [`MAMBA_UNROLL`] vectors in flight;
//! * `mamba_state_copy_v{W}` copies row `src_slots[pair]` to row `dst_slots[pair]`;
//!   `mamba_state_zero_v{W}` zeroes row `dst_slots[pair]` (it never reads `src_slots`);
//! * a slot `>= num_rows` sets `*err = 1` and that block writes nothing.
//!
//! Parameters: `base0, base1, base2, base3` (u64), `vecs0, vecs1, vecs2, vecs3`,
//! `n_comps`, `num_rows` (u32), `src_slots, dst_slots` (u64), `n_pairs` (u32),
//! `err` (u64).

use crate::ptx::{Cmp, Kernel, Module, Special, Target, Width, R32, R64};

/// Threads per block of the Mamba state kernels.
pub const MAMBA_THREADS: u32 = 256;
/// Vectors each thread keeps in flight.
pub const MAMBA_UNROLL: u32 = 4;
/// Components (conv states + the temporal state) one launch handles.
pub const MAMBA_MAX_COMPONENTS: u32 = 4;
/// Vector widths generated, widest first.
pub const MAMBA_WIDTHS: [u32; 4] = [16, 8, 4, 2];

/// The entry name of a Mamba state kernel.
pub fn mamba_kernel_name(zero: bool, vec_bytes: u32) -> String {
    format!("mamba_state_{}_v{vec_bytes}", if zero { "zero" } else { "copy" })
}

/// Copy (or, with `zero`, zero) state rows; see the module docs.
///
/// # Panics
///
/// If `vec_bytes` is not 1, 2, 4, 8 or 16.
pub fn mamba_state_kernel(zero: bool, vec_bytes: u32) -> Kernel {
    let w = Width::from_bytes(vec_bytes).expect("vector width");
    let mut k = Kernel::new(mamba_kernel_name(zero, vec_bytes));
    let bases: Vec<_> = (0..MAMBA_MAX_COMPONENTS).map(|i| k.param_u64(&format!("base{i}"))).collect();
    let vecs: Vec<_> = (0..MAMBA_MAX_COMPONENTS).map(|i| k.param_u32(&format!("vecs{i}"))).collect();
    let nc = k.param_u32("n_comps");
    let nr = k.param_u32("num_rows");
    let ss = k.param_u64("src_slots");
    let ds = k.param_u64("dst_slots");
    let np = k.param_u32("n_pairs");
    let er = k.param_u64("err");

    let pair = k.special(Special::CtaidY);
    let n_pairs = k.ld_param_u32(np);
    let past = k.setp_u32(Cmp::Ge, pair, n_pairs);
    k.ret_if(past, true);
    let z = k.special(Special::CtaidZ);
    let n_comps = k.ld_param_u32(nc);
    let layer = k.div_u32(z, n_comps);
    let comp = k.rem_u32(z, n_comps);
    k.comment("this block's component: base and row length in vectors");
    let mut base = k.ld_param_u64(bases[0]);
    let mut row_vecs = k.ld_param_u32(vecs[0]);
    for i in 1..MAMBA_MAX_COMPONENTS as usize {
        let is = k.setp_u32(Cmp::Eq, comp, i as u32);
        let b = k.ld_param_u64(bases[i]);
        base = k.selp_b64(b, base, is);
        let v = k.ld_param_u32(vecs[i]);
        row_vecs = k.selp_b32(v, row_vecs, is);
    }
    let num_rows = k.ld_param_u32(nr);
    let err = k.ld_param_u64(er);
    let row_of = |k: &mut Kernel, slots: R64| -> R64 {
        let at = k.mad_wide_u32(pair, 4u32, slots);
        let slot = k.ld_global_u32(at, 0, true);
        let bad = k.setp_u32(Cmp::Ge, slot, num_rows);
        k.st_global_u32(err, 0, 1u32, Some((bad, true)));
        k.ret_if(bad, true);
        // Row index `layer * num_rows + slot`, then its byte offset.
        let lr = k.mul_wide_u32(layer, num_rows);
        let s64 = k.cvt_u64_u32(slot);
        let row = k.add_u64(lr, s64);
        let rb = k.mul_lo_u32(row_vecs, vec_bytes);
        let rb64 = k.cvt_u64_u32(rb);
        let off = k.mul_lo_u64(row, rb64);
        k.add_u64(base, off)
    };
    let ds = k.ld_param_u64(ds);
    let dst = row_of(&mut k, ds);
    let src = if zero {
        None
    } else {
        let ss = k.ld_param_u64(ss);
        Some(row_of(&mut k, ss))
    };

    k.comment("vector v = ctaid.x * ntid + tid, then every stride = nctaid.x * ntid");
    let tid = k.special(Special::TidX);
    let bx = k.special(Special::CtaidX);
    let nbx = k.special(Special::NctaidX);
    let v = k.mad_lo_u32(bx, MAMBA_THREADS, tid);
    let stride = k.mul_lo_u32(nbx, MAMBA_THREADS);
    let stride_bytes = k.mul_wide_u32(stride, vec_bytes);
    let first = k.mul_wide_u32(v, vec_bytes);
    let dp = k.add_u64(dst, first);
    let sp = src.map(|s| k.add_u64(s, first));
    let zeros: Vec<R32> = (0..w.words()).map(|_| k.mov_u32(0u32)).collect();

    let (main, tail, done) = (k.label(), k.label(), k.label());
    k.place(main);
    let span = k.mul_lo_u32(stride, MAMBA_UNROLL - 1);
    let last = k.add_u32(v, span);
    let short = k.setp_u32(Cmp::Ge, last, row_vecs);
    k.bra_if(short, true, tail);
    let mut loaded = Vec::new();
    if let Some(sp) = sp {
        let mut p = sp;
        for j in 0..MAMBA_UNROLL {
            if j > 0 {
                p = k.add_u64(p, stride_bytes);
            }
            loaded.push(k.ld_global(w, p, 0, false, None));
        }
    }
    let mut p = dp;
    for j in 0..MAMBA_UNROLL as usize {
        if j > 0 {
            p = k.add_u64(p, stride_bytes);
        }
        let regs = loaded.get(j).map_or(zeros.as_slice(), Vec::as_slice);
        k.st_global(w, p, 0, regs, None);
    }
    let adv = k.mul_lo_u32(stride, MAMBA_UNROLL);
    k.add_u32_to(v, adv);
    let adv_bytes = k.mul_wide_u32(adv, vec_bytes);
    k.add_u64_to(dp, adv_bytes);
    if let Some(sp) = sp {
        k.add_u64_to(sp, adv_bytes);
    }
    k.bra(main);
    k.place(tail);
    let end = k.setp_u32(Cmp::Ge, v, row_vecs);
    k.bra_if(end, true, done);
    let regs = match sp {
        Some(sp) => k.ld_global(w, sp, 0, false, None),
        None => zeros.clone(),
    };
    k.st_global(w, dp, 0, &regs, None);
    k.add_u32_to(v, stride);
    k.add_u64_to(dp, stride_bytes);
    if let Some(sp) = sp {
        k.add_u64_to(sp, stride_bytes);
    }
    k.bra(tail);
    k.place(done);
    k.ret();
    k
}

/// The `mamba_state` module: copy and zero kernels for every width in [`MAMBA_WIDTHS`].
pub fn modules(target: Target) -> Vec<(&'static str, Module)> {
    let mut m = Module::new(target);
    for zero in [false, true] {
        for w in MAMBA_WIDTHS {
            m.push(mamba_state_kernel(zero, w));
        }
    }
    vec![("mamba_state", m)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_and_zero_kernels_have_the_documented_params() {
        let k = mamba_state_kernel(false, 16);
        let names: Vec<&str> = k.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "base0",
                "base1",
                "base2",
                "base3",
                "vecs0",
                "vecs1",
                "vecs2",
                "vecs3",
                "n_comps",
                "num_rows",
                "src_slots",
                "dst_slots",
                "n_pairs",
                "err"
            ]
        );
        let text = k.to_ptx();
        assert!(text.contains(".visible .entry mamba_state_copy_v16("), "{text}");
        assert!(text.contains("ld.global.v4.u32"), "{text}");
        assert!(text.contains("st.global.v4.u32"), "{text}");
        // The zero kernel never reads the pool (only the slot list).
        let z = mamba_state_kernel(true, 8).to_ptx();
        assert!(!z.contains("ld.global.v2.u32"), "{z}");
        assert!(z.contains("st.global.v2.u32"), "{z}");
        assert!(!z.contains("src_slots]"), "the zero kernel loads src_slots: {z}");
    }

    #[test]
    fn module_holds_every_width_for_both_targets() {
        for t in Target::ALL {
            let m = &modules(t)[0].1;
            assert_eq!(m.kernels().len(), 2 * MAMBA_WIDTHS.len());
            assert!(m.to_ptx().contains(&format!(".target {}\n", t.sm())));
        }
    }
}
