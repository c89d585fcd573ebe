#!/usr/bin/env bash
# Build the fuzz targets here and lay out everything scripts/fuzz_campaign.sh needs in
# a git-ignored folder, so that a many-core machine with no Rust toolchain can run a
# long campaign from it:
#
#   DIR/bin/<target>            the libFuzzer binary (debug info stripped, symbols kept)
#   DIR/seeds/<target>/         checked-in seeds (fuzz/seeds)
#   DIR/dicts/<target>.dict     dictionaries (fuzz/dicts)
#   DIR/options/<target>.options  libFuzzer flags (fuzz/options)
#   DIR/BUILD_INFO              commit, toolchain, build flags
#
#   scripts/fuzz_build_campaign.sh                 # DIR = .device/fuzz
#   FUZZ_CAMPAIGN_DIR=/tmp/c scripts/fuzz_build_campaign.sh
#
# Built as CI builds them: `cargo +nightly fuzz build -O --debug-assertions
# --no-trace-compares`, without a sanitizer unless FUZZ_SANITIZER says otherwise (the
# binaries are then linked against the sanitizer runtime, which needs nothing installed
# on the target machine either), with comparison tracing if FUZZ_TRACE_COMPARES=1.
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${FUZZ_CAMPAIGN_DIR:-.device/fuzz}"
sanitizer="${FUZZ_SANITIZER:-none}"
triple="x86_64-unknown-linux-gnu"

flags=(-O --debug-assertions --sanitizer "$sanitizer")
# As scripts/fuzz.sh: no comparison tracing unless FUZZ_TRACE_COMPARES=1.
[ "${FUZZ_TRACE_COMPARES:-0}" = 1 ] || flags+=(--no-trace-compares)

cargo +nightly fetch --locked --quiet --manifest-path fuzz/Cargo.toml
cargo +nightly fuzz build "${flags[@]}"

rm -rf "$dest"
mkdir -p "$dest/bin"
for target in $(cargo +nightly fuzz list); do
    bin="fuzz/target/$triple/release/$target"
    # The debug info is most of the size (the device copy is limited); panics still
    # name functions from the symbol table.
    strip --strip-debug -o "$dest/bin/$target" "$bin" 2>/dev/null || cp "$bin" "$dest/bin/$target"
done
cp -r fuzz/seeds "$dest/seeds"
cp -r fuzz/dicts "$dest/dicts"
cp -r fuzz/options "$dest/options"
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "toolchain: $(rustc +nightly --version)"
    echo "flags: cargo +nightly fuzz build ${flags[*]}"
} >"$dest/BUILD_INFO"
cat "$dest/BUILD_INFO"
du -sh "$dest" "$dest"/bin/*
