#!/usr/bin/env bash
# Run every cargo-fuzz target for a bounded time (default 60 s each); exit non-zero on
# a crash (libFuzzer leaves the input in fuzz/artifacts/<target>/).
#
#   scripts/fuzz.sh                      # all targets, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh     # longer
#   FUZZ_SANITIZER=address scripts/fuzz.sh   # with AddressSanitizer (slower)
#
# Needs the nightly toolchain; installs cargo-fuzz if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${FUZZ_SECONDS:-60}"
# The fuzzed paths (slots, allocators, the model) contain no unsafe code, so by default
# no sanitizer: several times the executions per second. Overflow checks and debug
# assertions stay on (-a).
sanitizer="${FUZZ_SANITIZER:-none}"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

mkdir -p target/fuzz-logs
status=0
for target in $(cargo +nightly fuzz list); do
    log="target/fuzz-logs/$target.log"
    echo "fuzz: $target for ${secs}s (sanitizer: $sanitizer)"
    if cargo +nightly fuzz run --sanitizer "$sanitizer" --debug-assertions "$target" -- \
        -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
        grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n1 || true
        grep -E 'stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
        echo "fuzz: $target passed"
    else
        status=1
        tail -n 60 "$log"
        echo "fuzz: $target FAILED (log: $log; crash input in fuzz/artifacts/$target/)"
    fi
done
exit "$status"
