//! The host-tier transfer kernels (module `host`): move a batch of whole KV pages
//! between the device KV buffers and a host KV pool in pinned, device-mapped host
//! memory (SGLang's HiCache host tier), in one launch.
//!
//! A page of one layer's K (or V, or the MLA) buffer is `page_size` rows, contiguous
//! on both sides: `chunk = page_size * row_bytes` bytes. A transfer of `n` pages over
//! layers `l0..l1` is `n * (l1 - l0) * buffers` such chunks.
//!
//! * `host_backup_v{W}` copies device page `d` to host page `h` (device -> host);
//! * `host_load_v{W}` copies host page `h` to device page `d` (host -> device).
//!
//! Launch: grid `(n_pairs * blocks_per_chunk, lb_count)`, block [`HOST_THREADS`].
//! Block `x` handles pair `x / blocks_per_chunk` and the part `x % blocks_per_chunk`
//! of its chunk; `lb = first_lb + ctaid.y` is the buffer index `layer * buffers +
//! buffer`. Thread `t` of part `s` moves vectors `s * HOST_THREADS + t + k * stride`,
//! `stride = blocks_per_chunk * HOST_THREADS`, [`HOST_UNROLL`] `W`-byte vectors in
//! flight.
//!
//! Addresses, all 64-bit:
//!
//! * device: `dev_bases[lb] + d * chunk` (`dev_bases` is a device table of one u64 per
//!   buffer index: where that layer's K or V buffer starts, so layers may lie anywhere);
//! * host: `host + h * host_page_stride + lb * host_lb_stride` (layer-first pools have
//!   `host_page_stride = chunk`, `host_lb_stride = (host_pages + 1) * chunk`; page-first
//!   pools `host_page_stride = layers * buffers * chunk`, `host_lb_stride = chunk`).
//!
//! `pairs` holds `n_pairs` records of two u32, `(device page, host page)`. A device
//! page `>= dev_pages` or a host page `>= host_pages` (the limits count page 0) sets
//! `*err = 1` and that block moves nothing; the host checks the pages first.
//!
//! Parameters: `dev_bases, host, host_page_stride, host_lb_stride, pairs` (u64),
//! `n_pairs, dev_pages, host_pages, first_lb, blocks_per_chunk, vecs` (u32: `vecs` is
//! vectors per chunk), `err` (u64).

use crate::ptx::{Cmp, Kernel, Module, Special, Target, Width};

/// Threads per block of the host transfer kernels.
pub const HOST_THREADS: u32 = 256;
/// Vectors each thread keeps in flight.
pub const HOST_UNROLL: u32 = 4;
/// Vector widths generated, widest first.
pub const HOST_WIDTHS: [u32; 5] = [16, 8, 4, 2, 1];

/// The entry name of a transfer kernel: `host_backup_v{W}` (device -> host) or
/// `host_load_v{W}` (host -> device).
pub fn host_kernel_name(load: bool, vec_bytes: u32) -> String {
    format!("host_{}_v{vec_bytes}", if load { "load" } else { "backup" })
}

/// A transfer kernel: see the module docs.
///
/// # Panics
///
/// If `vec_bytes` is not 1, 2, 4, 8 or 16.
pub fn host_transfer(load: bool, vec_bytes: u32) -> Kernel {
    let w = Width::from_bytes(vec_bytes).expect("vector width");
    let mut k = Kernel::new(host_kernel_name(load, vec_bytes));
    let db = k.param_u64("dev_bases");
    let hb = k.param_u64("host");
    let hps = k.param_u64("host_page_stride");
    let hls = k.param_u64("host_lb_stride");
    let pr = k.param_u64("pairs");
    let np = k.param_u32("n_pairs");
    let dp = k.param_u32("dev_pages");
    let hp = k.param_u32("host_pages");
    let fl = k.param_u32("first_lb");
    let bp = k.param_u32("blocks_per_chunk");
    let vc = k.param_u32("vecs");
    let er = k.param_u64("err");

    let x = k.special(Special::CtaidX);
    let bpc = k.ld_param_u32(bp);
    let pair = k.div_u32(x, bpc);
    let part = k.rem_u32(x, bpc);
    let n_pairs = k.ld_param_u32(np);
    let past = k.setp_u32(Cmp::Ge, pair, n_pairs);
    k.ret_if(past, true);

    k.comment("the pair: (device page, host page), checked against both pools");
    let pairs = k.ld_param_u64(pr);
    let at = k.mad_wide_u32(pair, 8u32, pairs);
    // Plain loads: the list may sit in mapped host memory.
    let dpage = k.ld_global_u32(at, 0, false);
    let hpage = k.ld_global_u32(at, 4, false);
    let err = k.ld_param_u64(er);
    let dev_pages = k.ld_param_u32(dp);
    let host_pages = k.ld_param_u32(hp);
    let bad_d = k.setp_u32(Cmp::Ge, dpage, dev_pages);
    let bad_h = k.setp_u32(Cmp::Ge, hpage, host_pages);
    let bad = k.or_pred(bad_d, bad_h);
    k.st_global_u32(err, 0, 1u32, Some((bad, true)));
    k.ret_if(bad, true);

    k.comment("chunk bytes = vecs * W; lb = first_lb + ctaid.y");
    let vecs = k.ld_param_u32(vc);
    let chunk = k.mul_wide_u32(vecs, vec_bytes);
    let y = k.special(Special::CtaidY);
    let first = k.ld_param_u32(fl);
    let lb = k.add_u32(first, y);
    k.comment("device chunk: dev_bases[lb] + d * chunk");
    let bases = k.ld_param_u64(db);
    let entry = k.mad_wide_u32(lb, 8u32, bases);
    let dbase = k.ld_global_u64(entry, 0, true);
    let d64 = k.cvt_u64_u32(dpage);
    let doff = k.mul_lo_u64(d64, chunk);
    let dev = k.add_u64(dbase, doff);
    k.comment("host chunk: host + h * host_page_stride + lb * host_lb_stride");
    let host = k.ld_param_u64(hb);
    let page_stride = k.ld_param_u64(hps);
    let lb_stride = k.ld_param_u64(hls);
    let h64 = k.cvt_u64_u32(hpage);
    let hoff = k.mul_lo_u64(h64, page_stride);
    let lb64 = k.cvt_u64_u32(lb);
    let loff = k.mul_lo_u64(lb64, lb_stride);
    let host = k.add_u64(host, hoff);
    let host = k.add_u64(host, loff);
    let (src, dst) = if load { (host, dev) } else { (dev, host) };
    // The device buffers are not written while a backup reads them: the read-only
    // path. Mapped host memory is read with plain loads.
    let src_nc = !load;

    k.comment("vector v = part * ntid + tid, then every stride = blocks_per_chunk * ntid");
    let tid = k.special(Special::TidX);
    let v = k.mad_lo_u32(part, HOST_THREADS, tid);
    let stride = k.mul_lo_u32(bpc, HOST_THREADS);
    let stride_bytes = k.mul_wide_u32(stride, vec_bytes);
    let first_byte = k.mul_wide_u32(v, vec_bytes);
    let sp = k.add_u64(src, first_byte);
    let dp = k.add_u64(dst, first_byte);

    let (main, tail, done) = (k.label(), k.label(), k.label());
    k.place(main);
    let span = k.mul_lo_u32(stride, HOST_UNROLL - 1);
    let last = k.add_u32(v, span);
    let short = k.setp_u32(Cmp::Ge, last, vecs);
    k.bra_if(short, true, tail);
    let mut loaded = Vec::new();
    let mut p = sp;
    for j in 0..HOST_UNROLL {
        if j > 0 {
            p = k.add_u64(p, stride_bytes);
        }
        loaded.push(k.ld_global(w, p, 0, src_nc, None));
    }
    let mut p = dp;
    for (j, regs) in loaded.iter().enumerate() {
        if j > 0 {
            p = k.add_u64(p, stride_bytes);
        }
        k.st_global(w, p, 0, regs, None);
    }
    let adv = k.mul_lo_u32(stride, HOST_UNROLL);
    k.add_u32_to(v, adv);
    let adv_bytes = k.mul_wide_u32(adv, vec_bytes);
    k.add_u64_to(sp, adv_bytes);
    k.add_u64_to(dp, adv_bytes);
    k.bra(main);
    k.place(tail);
    let end = k.setp_u32(Cmp::Ge, v, vecs);
    k.bra_if(end, true, done);
    let regs = k.ld_global(w, sp, 0, src_nc, None);
    k.st_global(w, dp, 0, &regs, None);
    k.add_u32_to(v, stride);
    k.add_u64_to(sp, stride_bytes);
    k.add_u64_to(dp, stride_bytes);
    k.bra(tail);
    k.place(done);
    k.ret();
    k
}

/// The `host` module: `host_backup_v*` then `host_load_v*`, every width in
/// [`HOST_WIDTHS`].
pub fn modules(target: Target) -> Vec<(&'static str, Module)> {
    let mut m = Module::new(target);
    for load in [false, true] {
        for w in HOST_WIDTHS {
            m.push(host_transfer(load, w));
        }
    }
    vec![("host", m)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_kernels_have_the_documented_params() {
        let k = host_transfer(false, 16);
        let names: Vec<&str> = k.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "dev_bases",
                "host",
                "host_page_stride",
                "host_lb_stride",
                "pairs",
                "n_pairs",
                "dev_pages",
                "host_pages",
                "first_lb",
                "blocks_per_chunk",
                "vecs",
                "err"
            ]
        );
        let backup = k.to_ptx();
        assert!(backup.contains(".visible .entry host_backup_v16("), "{backup}");
        // Backup reads the device through the read-only path and writes plain.
        assert!(backup.contains("ld.global.nc.v4.u32"), "{backup}");
        assert!(backup.contains("st.global.v4.u32"), "{backup}");
        // Load reads mapped host memory with plain loads only.
        let load = host_transfer(true, 16).to_ptx();
        assert!(load.contains(".visible .entry host_load_v16("), "{load}");
        assert!(load.contains("ld.global.v4.u32"), "{load}");
        assert!(!load.contains("ld.global.nc.v4.u32"), "{load}");
        // 64-bit offsets: page numbers times 64-bit strides.
        for text in [&backup, &load] {
            assert_eq!(text.matches("mul.lo.u64").count(), 3, "{text}");
            assert_eq!(text.matches("cvt.u64.u32").count(), 3, "{text}");
        }
    }

    #[test]
    fn bad_pages_end_the_block_before_any_address_is_formed() {
        for load in [false, true] {
            let text = host_transfer(load, 4).to_ptx();
            let flag = text.find("st.global.u32 [").expect("the error flag store");
            let ret = text[flag..].find("ret;").map(|i| i + flag).unwrap();
            // The layer base is read only after a bad pair has left.
            let table = text.find("ld.global.nc.u64").expect("the device layer table");
            assert!(flag < ret && ret < table, "{text}");
            assert!(text[..flag].contains("setp.ge.u32") && text[..flag].contains("or.pred"), "{text}");
        }
    }

    #[test]
    fn module_holds_every_width_both_ways_for_both_targets() {
        for t in Target::ALL {
            let m = &modules(t)[0].1;
            assert_eq!(m.kernels().len(), 2 * HOST_WIDTHS.len());
            let text = m.to_ptx();
            assert!(text.contains(&format!(".target {}\n", t.sm())));
            assert!(text.contains("host_load_v1(") && text.contains("host_backup_v1("));
        }
    }
}
