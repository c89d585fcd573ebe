#!/usr/bin/env bash
# Prepare a CUDA "stub" folder so that kvpool's `cuda` feature builds and links on a
# machine without a CUDA toolkit or GPU, and so that CI can assemble the PTX:
#
#   $STUB/include/cuda.h     from PyPI nvidia-cuda-runtime-cu12   (pip download + unzip)
#   $STUB/lib64/libcuda.so   from Debian non-free libcuda1        (apt-get download + dpkg -x)
#   $STUB/bin/ptxas          from PyPI nvidia-cuda-nvcc-cu12       (pip download + unzip)
#
# Usage:  scripts/cuda_stub.sh [STUB_DIR]        (default: .stub/cuda in the repository)
# Then:   export CUDA_LIBRARY_PATH=$STUB CUDA_PATH=$STUB
#         cargo build --features cuda
# Running a binary without a GPU: LD_LIBRARY_PATH=$STUB/lib64 (it reports no device).
#
# Idempotent: pieces already present are kept. Touches no system apt state: the
# package lists for the non-free component go to a private folder.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STUB="${1:-$ROOT/.stub/cuda}"
mkdir -p "$STUB/include" "$STUB/lib64" "$STUB/bin"
STUB="$(cd "$STUB" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

CUDA_RUNTIME_PKG="${CUDA_RUNTIME_PKG:-nvidia-cuda-runtime-cu12==12.9.79}"
CUDA_NVCC_PKG="${CUDA_NVCC_PKG:-nvidia-cuda-nvcc-cu12==12.9.86}"

pip_fetch() { # pip_fetch SPEC DEST_DIR
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
        --python-version 3.11 -d "$2" "$1"
}

if [ ! -f "$STUB/include/cuda.h" ]; then
    echo "cuda_stub: fetching cuda.h ($CUDA_RUNTIME_PKG)"
    pip_fetch "$CUDA_RUNTIME_PKG" "$WORK/rt"
    unzip -q -o "$WORK"/rt/*.whl 'nvidia/cuda_runtime/include/*' -d "$WORK/rt/x"
    cp -r "$WORK"/rt/x/nvidia/cuda_runtime/include/. "$STUB/include/"
fi

if [ ! -x "$STUB/bin/ptxas" ]; then
    echo "cuda_stub: fetching ptxas ($CUDA_NVCC_PKG)"
    pip_fetch "$CUDA_NVCC_PKG" "$WORK/nvcc"
    unzip -q -o "$WORK"/nvcc/*.whl 'nvidia/cuda_nvcc/bin/ptxas' -d "$WORK/nvcc/x"
    install -m 755 "$WORK/nvcc/x/nvidia/cuda_nvcc/bin/ptxas" "$STUB/bin/ptxas"
fi

if [ ! -e "$STUB/lib64/libcuda.so" ]; then
    echo "cuda_stub: fetching libcuda.so (Debian non-free libcuda1)"
    . /etc/os-release
    SUITE="${VERSION_CODENAME:-bookworm}"
    APTDIR="$WORK/apt"
    mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial"
    printf 'deb http://deb.debian.org/debian %s main contrib non-free\n' "$SUITE" >"$APTDIR/sources.list"
    APTOPT=(-o "Dir::Etc::SourceList=$APTDIR/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$APTDIR/lists" -o "Dir::Cache=$APTDIR/cache" -o APT::Sandbox::User=root)
    apt-get "${APTOPT[@]}" -qq update
    (cd "$WORK" && apt-get "${APTOPT[@]}" -qq download libcuda1)
    dpkg -x "$WORK"/libcuda1_*.deb "$WORK/deb"
    real="$(find "$WORK/deb" -name 'libcuda.so.*.*' -type f | head -n1)"
    [ -n "$real" ] || { echo "cuda_stub: libcuda1 holds no libcuda.so" >&2; exit 1; }
    cp "$real" "$STUB/lib64/"
    base="$(basename "$real")"
    ln -sf "$base" "$STUB/lib64/libcuda.so.1"
    ln -sf "libcuda.so.1" "$STUB/lib64/libcuda.so"
fi

echo "cuda_stub: ready in $STUB"
echo "  export CUDA_LIBRARY_PATH=$STUB CUDA_PATH=$STUB"
