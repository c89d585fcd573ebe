//! The PTX committed under `kernels/` must be exactly what the build embeds.
//!
//! Regenerate with `cargo run -p kernels_build --bin gen-kernels`, or run this test
//! with `KVPOOL_BLESS=1` to rewrite the stale files.

use std::path::Path;

use kvpool::kv::ptx::{module_for, MODULES, MODULE_NAMES};

#[test]
fn committed_ptx_is_fresh() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let bless = std::env::var_os("KVPOOL_BLESS").is_some();
    let mut stale = Vec::new();
    for m in MODULES {
        let path = dir.join(m.path);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != m.ptx {
            if bless {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, m.ptx).unwrap();
            } else {
                stale.push(m.path);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "kernels/ is stale for {stale:?}: run `cargo run -p kernels_build --bin gen-kernels` \
         (or this test with KVPOOL_BLESS=1) and commit the result"
    );
    // No leftover files from kernels that no longer exist.
    for sm in ["sm_80", "sm_90"] {
        for entry in std::fs::read_dir(dir.join(sm)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            let rel = format!("{sm}/{name}");
            assert!(MODULES.iter().any(|m| m.path == rel), "kernels/{rel} is not generated any more");
        }
    }
}

#[test]
fn every_module_exists_for_both_targets() {
    assert_eq!(MODULES.len(), 12); // MODULE_NAMES, mamba_state, swa and host, two targets each
    for name in MODULE_NAMES {
        for (cc, sm) in [(80, "sm_80"), (90, "sm_90")] {
            let m = module_for(name, cc).unwrap();
            assert_eq!(m.path, format!("{sm}/{name}.ptx"));
            assert!(m.ptx.contains(&format!(".target {sm}\n")));
        }
    }
}
