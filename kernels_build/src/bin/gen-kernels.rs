//! Regenerate the committed PTX: `cargo run -p kernels_build --bin gen-kernels [DIR]`.
//!
//! `DIR` defaults to `kernels/` at the workspace root (this crate's parent folder).

use std::path::PathBuf;

fn main() {
    let dir = std::env::args_os().nth(1).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("kernels_build sits in the workspace").join("kernels")
    });
    match kernels_build::write_all(&dir) {
        Ok(files) => {
            for f in files {
                println!("{}", dir.join(f).display());
            }
        }
        Err(e) => {
            eprintln!("gen-kernels: cannot write under {}: {e}", dir.display());
            std::process::exit(1);
        }
    }
}
