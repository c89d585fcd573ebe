#!/usr/bin/env bash
# Run kvpool's loom models (tests/loom_*.rs): every interleaving of small concurrent
# scenarios, up to LOOM_MAX_PREEMPTIONS preemptions per execution.
#
#   scripts/loom.sh                 # all models
#   scripts/loom.sh loom_slots      # one file
#   scripts/loom.sh loom_slots racing   # one file, models whose name contains "racing"
#
# Every model prints how many executions loom explored and fails if it was only one
# (tests/loom_common: loom never reorders a load before a later store in another
# thread, tokio-rs/loom#392, so a badly ordered model can pass without interleaving);
# pass --nocapture to see the counts and the outcomes each model asserts it reached.
#
# A separate target dir keeps the `--cfg loom` build from invalidating the normal one.
set -euo pipefail
cd "$(dirname "$0")/.."

export RUSTFLAGS="${RUSTFLAGS:-} --cfg loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
target="${1:-loom_*}"
shift || true

start=$(date +%s)
cargo test --release --no-fail-fast --target-dir target/loom --test "$target" -- --test-threads="${LOOM_TEST_THREADS:-2}" "$@"
echo "loom: models passed in $(( $(date +%s) - start ))s (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
