#!/usr/bin/env bash
# Prepare a CUDA "stub" folder so that kvpool's `cuda` feature builds and links on a
# machine without a CUDA toolkit or GPU, and so that CI can assemble the PTX:
#
#   $STUB/include/cuda.h     from PyPI nvidia-cuda-runtime-cu12   (pip download + unzip)
#   $STUB/lib64/libcuda.so   from Debian non-free libcuda1        (apt-get download + dpkg -x)
#   $STUB/bin/ptxas          from PyPI nvidia-cuda-nvcc-cu12       (pip download + unzip)
#
# Usage:  scripts/cuda_stub.sh [STUB_DIR]        (default: .stub/cuda in the repository)
#         scripts/cuda_stub.sh --print-sources   (show the apt sources it would use; no download)
# Then:   export CUDA_LIBRARY_PATH=$STUB CUDA_PATH=$STUB
#         cargo build --features cuda
# Running a binary without a GPU: LD_LIBRARY_PATH=$STUB/lib64 (it reports no device).
#
# Idempotent: pieces already present are kept. Touches no system apt state: the
# package lists for the non-free component go to a private folder.
#
# libcuda1 comes from this machine's own Debian mirror: the script reads its apt sources
# ($CUDA_STUB_APT_ETC, default /etc/apt: sources.list and sources.list.d/*.list in the
# one-line format, sources.list.d/*.sources in the deb822 format), keeps the enabled
# `deb` entries for this release's suites (VERSION_CODENAME and CODENAME-*, e.g.
# bookworm, bookworm-updates, bookworm-security), and adds the contrib and non-free
# components to them, in a private copy. Mirror, options and Signed-By are kept as the
# machine has them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APT_ETC="${CUDA_STUB_APT_ETC:-/etc/apt}"
if [ -r /etc/os-release ]; then . /etc/os-release; fi
SUITE="${VERSION_CODENAME:-bookworm}"

# add_components COMPONENT... : the list with contrib and non-free added (once).
add_components() {
    local out=" $* " c
    for c in contrib non-free; do
        case "$out" in *" $c "*) ;; *) out="$out$c " ;; esac
    done
    echo $out
}

# suite_ok SUITE : whether it is this release's suite or one of its -updates,
# -security, ... suites (other repositories' suites are left out).
suite_ok() { case "$1" in "$SUITE" | "$SUITE"-*) return 0 ;; esac; return 1; }

# oneline_sources FILE : its `deb` lines for this release, with contrib and non-free.
oneline_sources() {
    local line re='^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+)[[:space:]]+([^[:space:]]+)[[:space:]]*(.*)$'
    while IFS= read -r line || [ -n "$line" ]; do
        line="${line%%#*}"
        [[ $line =~ $re ]] || continue
        suite_ok "${BASH_REMATCH[3]}" || continue
        # shellcheck disable=SC2086 # the components are words
        echo "deb ${BASH_REMATCH[1]}${BASH_REMATCH[2]} ${BASH_REMATCH[3]} $(add_components ${BASH_REMATCH[4]})"
    done <"$1"
}

# deb822_stanza LINE... : one deb822 stanza, rewritten (Types: deb, this release's
# suites, contrib and non-free added) if it is an enabled `deb` source for this release.
deb822_stanza() {
    [ $# -gt 0 ] || return 0
    local types="" suites="" comps="" enabled=yes l key keep="" s skip=0
    for l in "$@"; do
        case "$l" in [[:space:]]*) continue ;; esac # a continuation line
        key="${l%%:*}"
        case "${key,,}" in
        types) types="${l#*:}" ;;
        suites) suites="${l#*:}" ;;
        components) comps="${l#*:}" ;;
        enabled) enabled="$(echo ${l#*:})" ;;
        esac
    done
    [[ " $(echo $types) " == *" deb "* ]] && [ "${enabled,,}" != no ] || return 0
    for s in $suites; do suite_ok "$s" && keep="$keep $s"; done
    [ -n "$keep" ] || return 0
    for l in "$@"; do
        case "$l" in [[:space:]]*)
            [ "$skip" = 1 ] || printf '%s\n' "$l"
            continue
            ;;
        esac
        key="${l%%:*}"
        skip=1
        case "${key,,}" in
        types) echo "Types: deb" ;;
        suites) echo "Suites:$keep" ;;
        # shellcheck disable=SC2086 # the components are words
        components) echo "Components: $(add_components $comps)" ;;
        *)
            skip=0
            printf '%s\n' "$l"
            ;;
        esac
    done
    echo
}

# deb822_sources FILE : its stanzas for this release, rewritten.
deb822_sources() {
    local stanza=() line
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in "#"*) continue ;; esac
        if [ -z "${line//[[:space:]]/}" ]; then
            deb822_stanza ${stanza[@]+"${stanza[@]}"}
            stanza=()
        else
            stanza+=("$line")
        fi
    done <"$1"
    deb822_stanza ${stanza[@]+"${stanza[@]}"}
}

# write_sources DIR : this machine's sources with contrib and non-free, as
# DIR/sources.list (one-line entries) and DIR/sources.list.d/local.sources (deb822).
write_sources() {
    local f
    mkdir -p "$1/sources.list.d"
    : >"$1/sources.list"
    : >"$1/sources.list.d/local.sources"
    for f in "$APT_ETC/sources.list" "$APT_ETC"/sources.list.d/*.list; do
        [ -f "$f" ] && oneline_sources "$f" >>"$1/sources.list"
    done
    for f in "$APT_ETC"/sources.list.d/*.sources; do
        [ -f "$f" ] && deb822_sources "$f" >>"$1/sources.list.d/local.sources"
    done
    if [ ! -s "$1/sources.list" ] && [ ! -s "$1/sources.list.d/local.sources" ]; then
        echo "cuda_stub: no enabled deb source for suite '$SUITE' in $APT_ETC/sources.list or" \
            "$APT_ETC/sources.list.d/ to add contrib and non-free to" >&2
        return 1
    fi
}

if [ "${1:-}" = "--print-sources" ]; then
    PRINT="$(mktemp -d)"
    trap 'rm -rf "$PRINT"' EXIT
    write_sources "$PRINT"
    cat "$PRINT/sources.list" "$PRINT/sources.list.d/local.sources"
    exit 0
fi

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
    echo "cuda_stub: fetching libcuda.so (Debian non-free libcuda1, from this machine's apt sources)"
    APTDIR="$WORK/apt"
    mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial"
    write_sources "$APTDIR"
    APTOPT=(-o "Dir::Etc::SourceList=$APTDIR/sources.list" -o "Dir::Etc::SourceParts=$APTDIR/sources.list.d"
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
