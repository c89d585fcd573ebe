//! Checks on the generated PTX text: structure, register declarations, parameters,
//! labels, and golden substrings of the instructions each variant must use.

use std::collections::{BTreeMap, BTreeSet};

use kernels_build::kernels::{self, PageSize, RowOp, SrcFloat, Store};
use kernels_build::ptx::Target;

/// The entries of a module: name -> (param lines, body).
fn entries(ptx: &str) -> BTreeMap<String, (Vec<String>, String)> {
    let mut out = BTreeMap::new();
    for chunk in ptx.split(".visible .entry ").skip(1) {
        let name = chunk[..chunk.find('(').unwrap()].to_string();
        let params_end = chunk.find(")\n{").unwrap();
        let params = chunk[name.len() + 1..params_end]
            .lines()
            .map(|l| l.trim().trim_end_matches(',').to_string())
            .filter(|l| !l.is_empty())
            .collect();
        let body_start = params_end + 3;
        let body_end = chunk.rfind("}\n").unwrap();
        out.insert(name, (params, chunk[body_start..body_end].to_string()));
    }
    out
}

fn kernel_text(target: Target, stem: &str, name: &str) -> String {
    let modules = kernels::modules(target);
    let m = &modules.iter().find(|(s, _)| *s == stem).unwrap().1;
    let all = entries(&m.to_ptx());
    let (params, body) = all.get(name).unwrap_or_else(|| panic!("{name} not in {stem}"));
    format!("{}\n{}", params.join("\n"), body)
}

#[test]
fn generation_is_deterministic() {
    assert_eq!(kernels_build::generate_all(), kernels_build::generate_all());
}

#[test]
fn every_file_has_its_targets_header() {
    let files = kernels_build::generate_all();
    assert_eq!(files.len(), 12); // alloc, kv_scatter, kv_copy, mamba_state, swa, host; two targets
    for (path, text) in &files {
        let t = if path.starts_with("sm_80/") { Target::Sm80 } else { Target::Sm90 };
        let header = format!(".version {}\n.target {}\n.address_size 64\n", t.ptx_version(), t.sm());
        assert!(text.contains(&header), "{path}");
        assert_eq!(text.matches(".target ").count(), 1, "{path}");
    }
}

#[test]
fn register_declarations_cover_every_use() {
    let prefixes = [("pred", "%p"), ("b16", "%rs"), ("b32", "%r"), ("b64", "%rd"), ("f32", "%f")];
    for (path, text) in kernels_build::generate_all() {
        for (name, (_, body)) in entries(&text) {
            let mut declared = BTreeMap::new();
            for (ty, prefix) in prefixes {
                let decl = format!(".reg .{ty} {prefix}<");
                if let Some(at) = body.find(&decl) {
                    let rest = &body[at + decl.len()..];
                    let n: u32 = rest[..rest.find('>').unwrap()].parse().unwrap();
                    declared.insert(prefix, n);
                }
            }
            let mut used: BTreeMap<&str, u32> = BTreeMap::new();
            for line in body.lines().filter(|l| !l.trim_start().starts_with(".reg")) {
                let bytes = line.as_bytes();
                let mut i = 0;
                while i < bytes.len() {
                    if bytes[i] == b'%' {
                        let word: String =
                            line[i + 1..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '.').collect();
                        let letters: String = word.chars().take_while(|c| c.is_ascii_alphabetic()).collect();
                        let digits: String = word[letters.len()..].chars().take_while(|c| c.is_ascii_digit()).collect();
                        if !digits.is_empty() && word.len() == letters.len() + digits.len() {
                            let prefix = match letters.as_str() {
                                "p" => "%p",
                                "rs" => "%rs",
                                "r" => "%r",
                                "rd" => "%rd",
                                "f" => "%f",
                                other => panic!("{path} {name}: unknown register class %{other}"),
                            };
                            let idx: u32 = digits.parse().unwrap();
                            let e = used.entry(prefix).or_insert(0);
                            *e = (*e).max(idx + 1);
                        }
                        i += word.len().max(1);
                    } else {
                        i += 1;
                    }
                }
            }
            for (prefix, n) in &used {
                let d = declared.get(prefix).copied().unwrap_or(0);
                assert!(*n <= d, "{path} {name}: {prefix} used up to {} but declared <{d}>", n - 1);
            }
            for (prefix, d) in &declared {
                assert_eq!(used.get(prefix), Some(d), "{path} {name}: {prefix}<{d}> declared but not all used");
            }
        }
    }
}

#[test]
fn params_are_declared_once_and_loaded_with_their_type() {
    for (path, text) in kernels_build::generate_all() {
        for (name, (params, body)) in entries(&text) {
            let mut seen = BTreeSet::new();
            let mut types = BTreeMap::new();
            for p in &params {
                let parts: Vec<&str> = p.split_whitespace().collect();
                assert_eq!(parts.len(), 3, "{p}");
                assert_eq!(parts[0], ".param");
                assert!(parts[2].starts_with(&format!("{name}_param_")), "{path} {name}: {p}");
                assert!(seen.insert(parts[2].to_string()), "{path} {name}: duplicate {p}");
                types.insert(parts[2].to_string(), parts[1].trim_start_matches('.').to_string());
            }
            for line in body.lines().map(str::trim).filter(|l| l.starts_with("ld.param.")) {
                let ty = &line["ld.param.".len()..line.find(' ').unwrap()];
                let sym = &line[line.find('[').unwrap() + 1..line.find(']').unwrap()];
                assert_eq!(types.get(sym).map(String::as_str), Some(ty), "{path} {name}: {line}");
            }
        }
    }
}

#[test]
fn labels_are_defined_once_and_every_branch_lands() {
    for (path, text) in kernels_build::generate_all() {
        for (name, (_, body)) in entries(&text) {
            let defined: Vec<&str> =
                body.lines().filter(|l| l.starts_with("$L__")).map(|l| l.trim_end_matches(':')).collect();
            let set: BTreeSet<&str> = defined.iter().copied().collect();
            assert_eq!(set.len(), defined.len(), "{path} {name}: a label placed twice");
            for l in body.lines().filter(|l| l.contains("bra")) {
                let target = l.split_whitespace().last().unwrap().trim_end_matches(';');
                assert!(set.contains(target), "{path} {name}: branch to missing {target}");
            }
            assert!(body.trim_end().ends_with("ret;"), "{path} {name}: falls off the end");
        }
    }
}

#[test]
fn modules_hold_every_variant() {
    let modules = kernels::modules(Target::Sm90);
    let names = |stem: &str| -> BTreeSet<String> {
        entries(&modules.iter().find(|(s, _)| *s == stem).unwrap().1.to_ptx()).into_keys().collect()
    };
    let alloc = names("alloc");
    assert!(alloc.contains("noop"));
    for ps in ["ps1", "ps16", "ps32", "ps64", "psn"] {
        assert!(alloc.contains(&format!("alloc_extend_{ps}")));
        assert!(alloc.contains(&format!("alloc_decode_{ps}")));
        assert!(alloc.contains(&format!("decode_step_{ps}")));
        assert!(alloc.contains(&format!("decode_delta_{ps}")));
    }
    let scatter = names("kv_scatter");
    for w in [16, 8, 4, 2, 1] {
        assert!(scatter.contains(&format!("kv_scatter_copy_v{w}")));
        assert!(scatter.contains(&format!("kv_scatter_mla_copy_v{w}")));
    }
    for (f, min) in [("f16", 2), ("bf16", 2), ("f32", 4)] {
        for w in [16, min] {
            assert!(scatter.contains(&format!("kv_scatter_fp8_{f}_v{w}")));
            assert!(scatter.contains(&format!("kv_scatter_mla_fp8_{f}_v{w}")));
        }
    }
    let copy = names("kv_copy");
    assert_eq!(copy.len(), 10);
}

#[test]
fn page_size_variants_use_shifts_or_division() {
    let ps16 = kernel_text(Target::Sm90, "alloc", "alloc_extend_ps16");
    assert!(ps16.contains(", 4;") && ps16.contains("shr.u32") && ps16.contains(", 15;"), "{ps16}");
    assert!(!ps16.contains("div.u32") && !ps16.contains("rem.u32"));
    let psn = kernel_text(Target::Sm90, "alloc", "alloc_extend_psn");
    assert!(psn.contains("div.u32") && psn.contains("rem.u32"));
    let dec = kernel_text(Target::Sm90, "alloc", "alloc_decode_ps64");
    assert!(dec.contains("and.b32") && dec.contains(", 63;"));
    // The fused row write is predicated on the flags bit.
    assert!(ps16.contains("@%p") && ps16.contains("st.global.u32"));
}

#[test]
fn row_kernels_use_the_requested_vector_width() {
    let t = Target::Sm90;
    let copy16 = kernel_text(t, "kv_scatter", "kv_scatter_copy_v16");
    assert_eq!(copy16.matches("ld.global.nc.v4.u32").count(), kernels::ROW_UNROLL as usize + 1);
    assert_eq!(copy16.matches("st.global.v4.u32").count(), kernels::ROW_UNROLL as usize + 1);
    let copy2 = kernel_text(t, "kv_scatter", "kv_scatter_copy_v2");
    assert!(copy2.contains("ld.global.nc.u16") && copy2.contains("st.global.u16"));
    // fp8: the integer rounding sequence on sm_80, the hardware conversion on sm_90.
    let fp8 = kernel_text(Target::Sm80, "kv_scatter", "kv_scatter_fp8_bf16_v16");
    assert!(fp8.contains("ld.global.nc.v4.u32") && fp8.contains("st.global.v2.u32"));
    assert!(fp8.contains("cvt.rni.u32.f32") && fp8.contains("mul.rn.f32") && fp8.contains("min.u32"));
    assert!(!fp8.contains("e4m3x2"));
    let hw = kernel_text(Target::Sm90, "kv_scatter", "kv_scatter_fp8_bf16_v16");
    assert!(hw.contains("st.global.v2.u32") && hw.contains("mul.rn.f32"));
    assert_eq!(
        hw.matches("cvt.rn.satfinite.e4m3x2.f32").count(),
        4 * (kernels::unroll(Store::Fp8(SrcFloat::Bf16)) as usize + 1)
    );
    assert!(!hw.contains("cvt.rni.u32.f32"));
    let f16 = kernel_text(Target::Sm80, "kv_scatter", "kv_scatter_fp8_f16_v2");
    assert!(f16.contains("cvt.f32.f16") && f16.contains("st.global.u8"));
    let f16 = kernel_text(Target::Sm90, "kv_scatter", "kv_scatter_fp8_f16_v2");
    assert!(f16.contains("cvt.f32.f16") && f16.contains("e4m3x2") && f16.contains("st.global.u8"));
    let f32v4 = kernel_text(Target::Sm80, "kv_scatter", "kv_scatter_fp8_f32_v4");
    assert!(f32v4.contains("ld.global.nc.u32") && f32v4.contains("st.global.u8"));
    // The move kernel reads the buffer it writes: no read-only path.
    let mv = kernel_text(t, "kv_copy", "kv_move_v16");
    assert!(!mv.contains("ld.global.nc.v4") && mv.contains("ld.global.v4.u32"));
    let ga = kernel_text(t, "kv_copy", "kv_gather_v8");
    assert!(ga.contains("ld.global.nc.v2.u32") && ga.contains("st.global.v2.u32"));
    // Every row kernel checks its slots against num_rows and reports through err.
    for (stem, name) in [("kv_scatter", "kv_scatter_copy_v16"), ("kv_copy", "kv_gather_v4"), ("kv_copy", "kv_move_v1")]
    {
        let text = kernel_text(t, stem, name);
        assert!(text.contains("_param_num_rows") && text.contains("st.global.u32 [%rd"), "{name}");
    }
    let mla = kernel_text(t, "kv_scatter", "kv_scatter_mla_copy_v16");
    assert!(mla.contains("_param_nope_vecs") && mla.contains("_param_rope_vecs"));
}

#[test]
fn names_follow_parameters() {
    assert_eq!(kernels::alloc_kernel_name(false, PageSize::Const(16)), "alloc_extend_ps16");
    assert_eq!(kernels::alloc_kernel_name(true, PageSize::Runtime), "alloc_decode_psn");
    assert_eq!(kernels::row_kernel_name(RowOp::Scatter, Store::Fp8(SrcFloat::Bf16), 16), "kv_scatter_fp8_bf16_v16");
    assert_eq!(kernels::row_kernel_name(RowOp::Move, Store::Copy, 4), "kv_move_v4");
    assert_eq!(Store::Fp8(SrcFloat::F32).dst_bytes(16), 4);
}

#[test]
#[should_panic(expected = "fp8 conversion is a scatter feature")]
fn fp8_gather_is_refused() {
    kernels::row_kernel(Target::Sm80, RowOp::Gather, Store::Fp8(SrcFloat::F16), 16);
}

#[test]
#[should_panic(expected = "powers of two")]
fn non_power_of_two_constant_page_is_refused() {
    kernels::alloc_extend(PageSize::Const(12));
}

#[test]
fn delta_step_reads_its_list_once_and_syncs_the_block_twice() {
    for t in Target::ALL {
        let text = kernel_text(t, "alloc", "decode_delta_ps16");
        // Two barriers (counts in shared memory; entries applied) and no return before
        // the last one (every thread of the block must reach both).
        assert_eq!(text.matches("bar.sync 0;").count(), 2, "{text}");
        let (before, after) = text.rsplit_once("bar.sync 0;").unwrap();
        assert!(!before.contains("ret;"), "a thread returns before a barrier:\n{text}");
        // The list (mapped host memory) through the read-only path: thread 0's counts,
        // the speculative first page and full entries, the loops' later entries.
        let (head, _) = before.split_once("bar.sync 0;").unwrap();
        assert_eq!(head.matches("ld.global.nc.v2.u32").count(), 2, "{head}");
        assert_eq!(head.matches("ld.global.nc.v4.u32").count(), 1, "{head}");
        assert!(head.contains(".shared .align 8 .b32 decode_delta_ps16_counts[2];"));
        assert!(head.contains("st.shared.v2.u32 [decode_delta_ps16_counts]"));
        // The state is read back after the last barrier through the coherent path
        // (this block wrote it), and the row write is predicated.
        assert!(after.contains("ld.global.v4.u32") && !after.contains("ld.global.nc"));
        assert!(after.contains("@%p") && after.contains("st.global.u32"));
        let psn = kernel_text(t, "alloc", "decode_delta_psn");
        assert!(psn.contains("rem.u32") && !text.contains("rem.u32"));
    }
}
