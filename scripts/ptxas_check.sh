#!/usr/bin/env bash
# Assemble every committed PTX module with ptxas for its own target (sm_80 files for
# sm_80, sm_90 files for sm_90), and the sm_80 modules for sm_90 too (what the driver
# does when it JIT-compiles Ampere PTX on a Hopper GPU). Prints ptxas's resource report
# (registers, spills) per kernel with -v when VERBOSE=1.
#
# Usage: scripts/ptxas_check.sh [KERNELS_DIR]   (default: kernels/ in the repository)
# ptxas: $PTXAS, else .stub/cuda/bin/ptxas (made by scripts/cuda_stub.sh), else PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/kernels}"
PTXAS="${PTXAS:-}"
if [ -z "$PTXAS" ]; then
    if [ -x "$ROOT/.stub/cuda/bin/ptxas" ]; then
        PTXAS="$ROOT/.stub/cuda/bin/ptxas"
    elif command -v ptxas >/dev/null; then
        PTXAS="$(command -v ptxas)"
    else
        bash "$ROOT/scripts/cuda_stub.sh" >/dev/null
        PTXAS="$ROOT/.stub/cuda/bin/ptxas"
    fi
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
VFLAG=()
[ "${VERBOSE:-0}" = 1 ] && VFLAG=(-v)

count=0
fail=0
check() { # check FILE ARCH
    local f="$1" arch="$2"
    if "$PTXAS" "${VFLAG[@]}" --warning-as-error -arch="$arch" -o "$OUT/out.cubin" "$f" >"$OUT/log" 2>&1; then
        count=$((count + 1))
        [ "${VERBOSE:-0}" = 1 ] && cat "$OUT/log"
        echo "ok    $arch  ${f#"$ROOT"/}"
    else
        fail=$((fail + 1))
        echo "FAIL  $arch  ${f#"$ROOT"/}"
        cat "$OUT/log"
    fi
}
shopt -s nullglob
files=("$DIR"/sm_80/*.ptx "$DIR"/sm_90/*.ptx)
[ "${#files[@]}" -gt 0 ] || { echo "ptxas_check: no PTX under $DIR" >&2; exit 1; }
for f in "$DIR"/sm_80/*.ptx; do
    check "$f" sm_80
    check "$f" sm_90
done
for f in "$DIR"/sm_90/*.ptx; do
    check "$f" sm_90
done
echo "ptxas_check: $count assembled, $fail failed ($("$PTXAS" --version | tail -n1))"
[ "$fail" -eq 0 ]
