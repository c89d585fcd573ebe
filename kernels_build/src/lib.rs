//! # kernels_build
//!
//! The PTX emitter behind `kvpool`'s GPU kernels: a small typed PTX builder
//! ([`ptx`]) and the generators: [`kernels`] (allocation and KV row kernels), [`mamba`]
//! (Mamba state copies), [`swa`] (the sliding-window mapped scatter) and [`host`] (the
//! host-tier page transfers). `kvpool`'s build script calls
//! [`generate_all`] and embeds the text; the same files are committed under
//! `kernels/` for review and kept fresh by a test.
//!
//! No CUDA toolkit is involved: the output is plain text, deterministic for given
//! parameters, and assembled by the driver when a module is loaded (or by `ptxas` in
//! CI, to check it).
//!
//! ```
//! use kernels_build::{kernels, ptx::Target};
//! let files = kernels_build::generate_all();
//! assert!(files.iter().any(|(path, _)| path == "sm_90/alloc.ptx"));
//! let alloc = &files.iter().find(|(p, _)| p == "sm_80/alloc.ptx").unwrap().1;
//! assert!(alloc.contains(".target sm_80"));
//! assert!(alloc.contains(".visible .entry alloc_extend_ps16("));
//! assert_eq!(kernels::modules(Target::Sm90).len(), 3);
//! assert!(files.iter().any(|(path, _)| path == "sm_80/swa.ptx"));
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod host;
pub mod kernels;
pub mod mamba;
pub mod ptx;
pub mod swa;

/// Every generated file: `(relative path, PTX text)`, e.g. `("sm_90/alloc.ptx", ..)`:
/// [`kernels::generate_all`] (alloc, kv_scatter, kv_copy, mamba_state, swa), then the
/// `host` module of each target.
pub fn generate_all() -> Vec<(String, String)> {
    let mut files = kernels::generate_all();
    for target in ptx::Target::ALL {
        for (stem, module) in host::modules(target) {
            files.push((format!("{}/{stem}.ptx", target.sm()), module.to_ptx()));
        }
    }
    files
}

/// Write every generated file under `dir` (creating `dir/sm_80`, `dir/sm_90`), and
/// return the paths written, relative to `dir`.
///
/// # Errors
///
/// Any I/O error from creating the folders or writing the files.
pub fn write_all(dir: &std::path::Path) -> std::io::Result<Vec<String>> {
    let mut written = Vec::new();
    for (rel, text) in generate_all() {
        let path = dir.join(&rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        // Leave an identical file alone, so its timestamp does not trigger rebuilds.
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, &text)?;
        }
        written.push(rel);
    }
    Ok(written)
}
