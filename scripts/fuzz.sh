#!/usr/bin/env bash
# Run every cargo-fuzz target for a bounded time (default 60 s each); exit non-zero on
# a crash (libFuzzer leaves the input in fuzz/artifacts/<target>/).
#
#   scripts/fuzz.sh                      # all targets, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh     # longer
#   FUZZ_TARGETS="trace_parse" scripts/fuzz.sh   # some targets only
#   FUZZ_DIRS=examples/fuzz-scheduler scripts/fuzz.sh   # the downstream example only
#   FUZZ_SANITIZER=address scripts/fuzz.sh   # with AddressSanitizer (slower)
#   FUZZ_TRACE_COMPARES=1 scripts/fuzz.sh    # with -trace-compares instrumentation
#   FUZZ_JOBS=1 scripts/fuzz.sh          # one target at a time (default: one per core)
#
# Two fuzz projects (FUZZ_DIRS): kvpool's own, fuzz/, and the downstream example
# examples/fuzz-scheduler/ (a user's wrapper fuzzed with kvpool's op models). In each
# DIR, a target starts from its checked-in seeds (DIR/seeds/<target>/, read only) and
# the git-ignored working corpus DIR/corpus/<target>/ (new inputs go there), with the
# flags in DIR/options/<target>.options and the dictionary DIR/dicts/<target>.dict
# when there is one. One libFuzzer process per target (-jobs=1), and up to FUZZ_JOBS
# targets at once (default: one per core).
#
# The committed DIR/Cargo.lock must be current: `cargo fuzz` has no --locked, so the
# script checks with `cargo fetch --locked` first and fails on drift. Refresh it from
# the main lock, so that shared packages keep the main lock's versions (checked by
# scripts/fuzz_lock_check.sh):
#   cp Cargo.lock DIR/Cargo.lock && (cd DIR && cargo +nightly metadata --format-version 1 >/dev/null)
#
# Needs the nightly toolchain; installs cargo-fuzz if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fuzz_common.sh

secs="${FUZZ_SECONDS:-60}"
# Targets run side by side, one libFuzzer process each: FUZZ_JOBS at once (default: the
# number of cores).
jobs="${FUZZ_JOBS:-$(nproc)}"
# The fuzzed paths (slots, allocators, the model, the trace reader) contain no unsafe
# code, so by default no sanitizer: several times the executions per second. Overflow
# checks and debug assertions stay on (-a).
sanitizer="${FUZZ_SANITIZER:-none}"
flags=(-O --debug-assertions --sanitizer "$sanitizer")
# Comparison tracing (libFuzzer's CMP mutations) costs about 30% of the executions per
# second of the model targets, whose inputs are reduced modulo the pool before any
# comparison; the trace reader's literals come from its dictionary instead. Set
# FUZZ_TRACE_COMPARES=1 to turn it back on.
[ "${FUZZ_TRACE_COMPARES:-0}" = 1 ] || flags+=(--no-trace-compares)

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

# fuzz_one DIR TARGET: run TARGET for $secs seconds from its corpora, its output in
# target/fuzz-logs/TARGET.log and its exit status in target/fuzz-logs/TARGET.status.
fuzz_one() {
    local dir="$1" target="$2" rc=0
    local log="target/fuzz-logs/$target.log"
    mkdir -p "$dir/corpus/$target"
    local corpora=("$dir/corpus/$target")
    [ -d "$dir/seeds/$target" ] && corpora+=("$dir/seeds/$target")
    local extra
    mapfile -t extra < <(fuzz_args "$dir" "$target")
    echo "fuzz: $target ($dir) for ${secs}s (sanitizer: $sanitizer; ${extra[*]})"
    cargo +nightly fuzz run --fuzz-dir "$dir" "${flags[@]}" "$target" "${corpora[@]}" -- \
        -max_total_time="$secs" -print_final_stats=1 "${extra[@]}" >"$log" 2>&1 || rc=$?
    echo "$rc" >"target/fuzz-logs/$target.status"
}

# The fuzz projects: kvpool's own targets (fuzz/) and the downstream example
# (examples/fuzz-scheduler/: a user's allocator wrapper fuzzed with kvpool's op models).
dirs="${FUZZ_DIRS:-fuzz examples/fuzz-scheduler}"
status=0
runs=()
mkdir -p target/fuzz-logs
# Check and build every project first, then run the targets.
for dir in $dirs; do
    echo "fuzz: checking $dir/Cargo.lock"
    if ! cargo +nightly fetch --locked --quiet --manifest-path "$dir/Cargo.toml"; then
        echo "fuzz: $dir/Cargo.lock is stale (see the comment at the top of scripts/fuzz.sh)"
        exit 1
    fi
    bash scripts/fuzz_lock_check.sh "$dir/Cargo.lock"

    all=$(cargo +nightly fuzz list --fuzz-dir "$dir")
    targets=$all
    if [ -n "${FUZZ_TARGETS:-}" ]; then
        targets=$(for t in $FUZZ_TARGETS; do echo "$all" | grep -qx "$t" && echo "$t"; done || true)
    fi
    [ -n "$targets" ] || continue
    lock_before=$(cksum <"$dir/Cargo.lock")
    cargo +nightly fuzz build --fuzz-dir "$dir" "${flags[@]}"
    # Belt and braces: the build must not have rewritten the lock either.
    if [ "$(cksum <"$dir/Cargo.lock")" != "$lock_before" ]; then
        echo "fuzz: the build changed $dir/Cargo.lock (commit a refreshed lock)"
        exit 1
    fi

    for target in $targets; do runs+=("$dir $target"); done
done

# Every target of every project in one pool, up to $jobs at once (each a single libFuzzer
# process on its own core); the summaries are printed in order once the last one ends.
for run in "${runs[@]}"; do
    read -r dir target <<<"$run"
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    rm -f "target/fuzz-logs/$target.status"
    fuzz_one "$dir" "$target" &
done
wait || true
for run in "${runs[@]}"; do
    read -r dir target <<<"$run"
    log="target/fuzz-logs/$target.log"
    if [ "$(cat "target/fuzz-logs/$target.status" 2>/dev/null)" = 0 ]; then
        grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n1 || true
        grep -E 'stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
        echo "fuzz: $target ($dir) passed"
    else
        status=1
        tail -n 60 "$log"
        echo "fuzz: $target ($dir) FAILED (log: $log; crash input in $dir/artifacts/$target/)"
    fi
done
exit "$status"
