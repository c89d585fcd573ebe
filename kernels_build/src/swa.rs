//! The sliding-window (SWA) kernels (module `swa`): the mapped KV scatter of a model
//! that interleaves full-attention and sliding-window layers (Gemma 2/3, gpt-oss), and
//! the update of the device copy of the full-to-window slot mapping.
//!
//! Such a model keeps two KV pools: the full layers' buffers have `full_size +
//! page_size` rows, the window layers' `window_size + page_size`. A batch's tokens get
//! *full* slots (`loc`); a window layer addresses its buffer through the mapping table
//! `map` (one `u32` per full slot: the window slot, 0 for none, SGLang's
//! `full_to_swa_index_mapping`).
//!
//! # `swa_scatter_v{W}`
//!
//! One launch writes token `i`'s K and V rows of *every* layer: full layers at row
//! `slots[i]`, window layers at row `map[slots[i]]`, skipped when that is 0 (no window
//! slot: the token's window KV is not kept). Same launch shape as the plain row kernels
//! (`kernels::row_kernel`): grid `(ceil(n / ROWS_PER_BLOCK), layers, 2)`, block
//! `ROW_BLOCK_THREADS`, one warp per (token, layer, K or V) row, [`crate::kernels::ROW_UNROLL`]
//! `W`-byte vectors in flight per lane.
//!
//! `layers` is a device table of one [`SWA_LAYER_RECORD_BYTES`]-byte record per model
//! layer (in layer order): `k_dst` (u64), `v_dst` (u64): where the layer's K and V
//! buffers start; `rows` (u32): the buffer's rows; `window` (u32): nonzero for a
//! sliding-window layer. So the layers may lie anywhere (two pools, or an engine's own
//! tensors), and one launch still covers them all.
//!
//! Checks, on the device: a window layer needs `slot < map_len` (the table's entries)
//! and every layer `row < rows`; a row that fails sets `*err = 1` and that warp writes
//! nothing.
//!
//! Parameters: `k_src, v_src, src_row_stride, src_layer_stride` (u64: the dense
//! sources, token `i` of layer `l` at `l * src_layer_stride + i * src_row_stride`
//! bytes), `layers` (u64), `map` (u64), `map_len` (u32), `slots` (u64), `n_tokens`,
//! `vecs` (u32: vectors per row), `err` (u64).
//!
//! # `swa_map_update`
//!
//! Copies the host table's entries of `n_pages` full pages into the device table in
//! one launch: `staged` holds the page numbers, then their `n_pages * page_size`
//! entries, page after page. Thread `i` writes `map[pages[i / ps] * ps + i % ps] =
//! entries[i]`; a page `>= map_pages` is skipped (the host checks the pages first).
//! Grid `(ceil(n_pages * ps / SWA_MAP_THREADS))`, block [`SWA_MAP_THREADS`].
//!
//! Parameters: `staged` (u64), `n_pages`, `page_size` (u32), `map` (u64),
//! `map_pages` (u32).

use crate::kernels::{copy_loop, lane_pointers, row_prologue, Store};
use crate::ptx::{Cmp, Kernel, Module, Special, Target};

/// Bytes per record of the `layers` table: `k_dst` (u64), `v_dst` (u64), `rows` (u32),
/// `window` (u32).
pub const SWA_LAYER_RECORD_BYTES: u32 = 24;
/// Threads per block of `swa_map_update`.
pub const SWA_MAP_THREADS: u32 = 256;
/// Vector widths of `swa_scatter_v*`, widest first.
pub const SWA_WIDTHS: [u32; 5] = [16, 8, 4, 2, 1];

/// The entry name of a mapped scatter kernel.
pub fn swa_scatter_name(vec_bytes: u32) -> String {
    format!("swa_scatter_v{vec_bytes}")
}

/// The mapped scatter: see the module docs.
///
/// # Panics
///
/// If `vec_bytes` is not 1, 2, 4, 8 or 16.
pub fn swa_scatter(target: Target, vec_bytes: u32) -> Kernel {
    assert!(SWA_WIDTHS.contains(&vec_bytes), "vector width {vec_bytes}");
    let mut k = Kernel::new(swa_scatter_name(vec_bytes));
    let ks = k.param_u64("k_src");
    let vs = k.param_u64("v_src");
    let srs = k.param_u64("src_row_stride");
    let sls = k.param_u64("src_layer_stride");
    let lt = k.param_u64("layers");
    let mp = k.param_u64("map");
    let ml = k.param_u32("map_len");
    let sl = k.param_u64("slots");
    let nt = k.param_u32("n_tokens");
    let vc = k.param_u32("vecs");
    let er = k.param_u64("err");

    let (token, layer, is_v) = row_prologue(&mut k, nt);
    k.comment("this layer's record: K and V bases, rows, window flag");
    let table = k.ld_param_u64(lt);
    let rec_off = k.mul_lo_u64(layer, SWA_LAYER_RECORD_BYTES as u64);
    let rec = k.add_u64(table, rec_off);
    let kd = k.ld_global_u64(rec, 0, true);
    let vd = k.ld_global_u64(rec, 8, true);
    let rows = k.ld_global_u32(rec, 16, true);
    let window = k.ld_global_u32(rec, 20, true);
    let dst = k.selp_b64(vd, kd, is_v);
    let err = k.ld_param_u64(er);
    let slots = k.ld_param_u64(sl);
    let at = k.mad_wide_u32(token, 4u32, slots);
    let slot = k.ld_global_u32(at, 0, true);

    k.comment("a window layer writes row map[slot] (none when 0); a full layer row slot");
    let row = k.mov_u32(slot);
    let check = k.label();
    let is_window = k.setp_u32(Cmp::Ne, window, 0u32);
    k.bra_if(is_window, false, check);
    let map_len = k.ld_param_u32(ml);
    let past_map = k.setp_u32(Cmp::Ge, slot, map_len);
    k.st_global_u32(err, 0, 1u32, Some((past_map, true)));
    k.ret_if(past_map, true);
    let map = k.ld_param_u64(mp);
    let cell = k.mad_wide_u32(slot, 4u32, map);
    let mapped = k.ld_global_u32(cell, 0, true);
    let unmapped = k.setp_u32(Cmp::Eq, mapped, 0u32);
    k.ret_if(unmapped, true);
    k.set_u32(row, mapped);
    k.place(check);
    let bad = k.setp_u32(Cmp::Ge, row, rows);
    k.st_global_u32(err, 0, 1u32, Some((bad, true)));
    k.ret_if(bad, true);

    let vecs = k.ld_param_u32(vc);
    let row_bytes = k.mul_lo_u32(vecs, vec_bytes);
    let off = k.mul_wide_u32(row, row_bytes);
    let dst = k.add_u64(dst, off);
    let ks = k.ld_param_u64(ks);
    let vs = k.ld_param_u64(vs);
    let src = k.selp_b64(vs, ks, is_v);
    let sls = k.ld_param_u64(sls);
    let lo = k.mul_lo_u64(layer, sls);
    let src = k.add_u64(src, lo);
    let srs = k.ld_param_u64(srs);
    let t64 = k.cvt_u64_u32(token);
    let to = k.mul_lo_u64(t64, srs);
    let src = k.add_u64(src, to);
    let (lane, ptrs) = lane_pointers(&mut k, &[(src, vec_bytes), (dst, vec_bytes)]);
    copy_loop(&mut k, target, Store::Copy, vec_bytes, true, lane, vecs, ptrs[0], ptrs[1], None);
    k.ret();
    k
}

/// The mapping-table update: see the module docs.
pub fn swa_map_update() -> Kernel {
    let mut k = Kernel::new("swa_map_update");
    let st = k.param_u64("staged");
    let np = k.param_u32("n_pages");
    let ps = k.param_u32("page_size");
    let mp = k.param_u64("map");
    let mpg = k.param_u32("map_pages");
    let blk = k.special(Special::CtaidX);
    let tid = k.special(Special::TidX);
    let i = k.mad_lo_u32(blk, SWA_MAP_THREADS, tid);
    let n_pages = k.ld_param_u32(np);
    let ps = k.ld_param_u32(ps);
    let total = k.mul_lo_u32(n_pages, ps);
    let past = k.setp_u32(Cmp::Ge, i, total);
    k.ret_if(past, true);
    let staged = k.ld_param_u64(st);
    let p = k.div_u32(i, ps);
    let within = k.rem_u32(i, ps);
    let page_at = k.mad_wide_u32(p, 4u32, staged);
    let page = k.ld_global_u32(page_at, 0, true);
    let map_pages = k.ld_param_u32(mpg);
    let bad = k.setp_u32(Cmp::Ge, page, map_pages);
    k.ret_if(bad, true);
    let e = k.add_u32(n_pages, i);
    let entry_at = k.mad_wide_u32(e, 4u32, staged);
    let entry = k.ld_global_u32(entry_at, 0, true);
    let cell = k.mad_lo_u32(page, ps, within);
    let map = k.ld_param_u64(mp);
    let cell_at = k.mad_wide_u32(cell, 4u32, map);
    k.st_global_u32(cell_at, 0, entry, None);
    k.ret();
    k
}

/// The `swa` module: the mapped scatter for every width in [`SWA_WIDTHS`], then
/// `swa_map_update`.
pub fn modules(target: Target) -> Vec<(&'static str, Module)> {
    let mut m = Module::new(target);
    for w in SWA_WIDTHS {
        m.push(swa_scatter(target, w));
    }
    m.push(swa_map_update());
    vec![("swa", m)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_has_the_documented_params_and_reads_the_map() {
        let k = swa_scatter(Target::Sm90, 16);
        let names: Vec<&str> = k.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "k_src",
                "v_src",
                "src_row_stride",
                "src_layer_stride",
                "layers",
                "map",
                "map_len",
                "slots",
                "n_tokens",
                "vecs",
                "err"
            ]
        );
        let text = k.to_ptx();
        assert!(text.contains(".visible .entry swa_scatter_v16("), "{text}");
        // The layer record: two 64-bit bases, then rows and the window flag.
        assert!(text.contains("ld.global.nc.u64"), "{text}");
        assert!(text.contains("+8];"), "{text}");
        assert!(text.contains("+16];") && text.contains("+20];"), "{text}");
        assert!(text.contains("ld.global.nc.v4.u32"), "{text}");
        assert!(text.contains("st.global.v4.u32"), "{text}");
        // An unmapped entry (0) ends the warp before any store.
        let unmapped = text.find("setp.eq.u32").expect("the unmapped test");
        assert!(unmapped < text.find("st.global.v4.u32").unwrap(), "{text}");
    }

    #[test]
    fn map_update_has_the_documented_params() {
        let k = swa_map_update();
        let names: Vec<&str> = k.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["staged", "n_pages", "page_size", "map", "map_pages"]);
        let text = k.to_ptx();
        assert!(text.contains("st.global.u32"), "{text}");
        assert!(text.contains("rem.u32"), "{text}");
    }

    #[test]
    fn module_holds_every_width_for_both_targets() {
        for t in Target::ALL {
            let m = &modules(t)[0].1;
            assert_eq!(m.kernels().len(), SWA_WIDTHS.len() + 1);
            assert!(m.to_ptx().contains(&format!(".target {}\n", t.sm())));
        }
    }
}
