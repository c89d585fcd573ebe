//! The generated PTX, embedded at build time.
//!
//! `build.rs` runs `kernels_build` and writes one module per kernel family and target
//! into `OUT_DIR`; this module includes them. The same files are committed under
//! `kernels/` (regenerate with `cargo run -p kernels_build --bin gen-kernels`), and
//! `tests/kernels_fresh.rs` fails when the committed copy differs from what the build
//! embeds.
//!
//! Modules: `alloc` (`noop`, `alloc_extend_*`, `alloc_decode_*`, `decode_step_*`), `kv_scatter`
//! (`kv_scatter_*`, `kv_scatter_mla_*`), `kv_copy` (`kv_gather_*`, `kv_move_*`), each
//! for `sm_80` (`.version 7.0`) and `sm_90` (`.version 7.8`).

/// One embedded PTX module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxModule {
    /// Its path under `kernels/`, e.g. `sm_90/alloc.ptx`.
    pub path: &'static str,
    /// The module name (`alloc`, `kv_scatter`, `kv_copy`).
    pub name: &'static str,
    /// The target's compute capability, `major * 10 + minor` (80, 90).
    pub compute_capability: u32,
    /// The PTX text.
    pub ptx: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The module `name` to load on a device of compute capability `cc`
/// (`major * 10 + minor`): the one for the newest target the device runs.
///
/// # Examples
///
/// ```
/// use kvpool::kv::ptx::module_for;
/// assert_eq!(module_for("alloc", 90).unwrap().path, "sm_90/alloc.ptx");
/// assert_eq!(module_for("alloc", 89).unwrap().path, "sm_80/alloc.ptx");
/// assert!(module_for("alloc", 75).is_none());
/// ```
pub fn module_for(name: &str, cc: u32) -> Option<&'static PtxModule> {
    MODULES.iter().filter(|m| m.name == name && m.compute_capability <= cc).max_by_key(|m| m.compute_capability)
}

/// The names of the modules, in load order.
pub const MODULE_NAMES: [&str; 3] = ["alloc", "kv_scatter", "kv_copy"];
