#!/usr/bin/env bash
# kvpool's GPU half in CI, on a machine without a GPU or CUDA toolkit:
#
#   1. kernels_build unit tests (the PTX builder and generators);
#   2. the committed PTX is fresh, and the host references are right;
#   3. every module assembles with ptxas for sm_80 and sm_90;
#   4. `cuda` alone compiles (`cargo check`); the library, binaries and tests built with
#      `cudarc` (which includes `cuda`) link against the stub libcuda;
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

# `cuda` alone must compile; everything below builds once with `cudarc` (which turns on
# `cuda`): one build of the library, its unit tests, the binaries and the GPU tests,
# linked against the stub libcuda, instead of one build per feature set.
step "cargo check --features cuda (without cudarc)"
cargo check --features cuda --lib --bins

step "cargo build --features cudarc: library, binaries, unit and GPU tests, linked"
gpu_tests=(--test gpu_kernels --test gpu_decode --test gpu_mamba --test gpu_swa --test gpu_host --test gpu_cudarc)
# One cargo invocation, so that the library and its unit tests compile side by side; the
# integration tests make cargo build the binaries too.
cargo test --features cudarc --no-run --lib "${gpu_tests[@]}"
export LD_LIBRARY_PATH="$ROOT/.stub/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step "device layer host checks (cuda unit tests)"
cargo test --features cudarc --lib cuda::

step "GPU tests (must skip without a device)"
log="$(mktemp)"
cargo test --features cudarc "${gpu_tests[@]}" -- --nocapture --test-threads 1 2>&1 | tee "$log"
if ! grep -q "no CUDA device" "$log" && ! grep -q "^device: " "$log"; then
    echo "kernels_ci: the GPU tests neither found a device nor reported skipping" >&2
    exit 1
fi
rm -f "$log"

step "cuda doctests compile"
cargo test --features cudarc --doc -- cuda

echo
echo "kernels_ci: all steps passed"
