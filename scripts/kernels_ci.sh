#!/usr/bin/env bash
# kvpool's GPU half in CI, on a machine without a GPU or CUDA toolkit:
#
#   1. kernels_build unit tests (the PTX builder and generators);
#   2. the committed PTX is fresh, and the host references are right;
#   3. every module assembles with ptxas for sm_80 and sm_90;
#   4. `cargo build --features cuda` links against the stub libcuda;
#   5. the GPU test binaries build and run: their host checks pass and every device test
#      prints "no CUDA device" and skips (gpu_kernels, gpu_decode, gpu_mamba, gpu_swa,
#      gpu_host, and gpu_cudarc with the `cudarc` feature).
#
# Installs what it needs (unzip, via apt-get when missing; ptxas, cuda.h and libcuda.so
# into .stub/cuda via scripts/cuda_stub.sh). Usage: bash scripts/kernels_ci.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { echo; echo "== kernels_ci: $*"; }

if ! command -v unzip >/dev/null; then
    step "installing unzip"
    apt-get update -qq && apt-get install -y -qq unzip >/dev/null
fi

step "CUDA stub folder"
bash scripts/cuda_stub.sh
export CUDA_LIBRARY_PATH="$ROOT/.stub/cuda" CUDA_PATH="$ROOT/.stub/cuda"

step "kernels_build tests"
cargo test -p kernels_build

step "freshness of kernels/ and host references"
cargo test --test kernels_fresh --test kernels_reference

step "ptxas sm_80 / sm_90"
bash scripts/ptxas_check.sh

step "cargo build --features cuda"
cargo build --features cuda --lib --bins

step "device layer host checks (cuda unit tests)"
LD_LIBRARY_PATH="$ROOT/.stub/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --features cuda --lib cuda::

step "GPU tests (must skip without a device)"
log="$(mktemp)"
LD_LIBRARY_PATH="$ROOT/.stub/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --features cuda --test gpu_kernels --test gpu_decode --test gpu_mamba --test gpu_swa --test gpu_host -- --nocapture --test-threads 1 2>&1 | tee "$log"
LD_LIBRARY_PATH="$ROOT/.stub/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --features cudarc --test gpu_cudarc -- --nocapture 2>&1 | tee -a "$log"
if ! grep -q "no CUDA device" "$log" && ! grep -q "^device: " "$log"; then
    echo "kernels_ci: the GPU tests neither found a device nor reported skipping" >&2
    exit 1
fi
rm -f "$log"

step "cuda doctests compile"
cargo test --features cuda --doc -- cuda

echo
echo "kernels_ci: all steps passed"
