#!/usr/bin/env bash
# Run kvpool's shuttle tests (tests/shuttle_*.rs): randomized schedules of concurrent
# scenarios too large for loom (trees of hundreds of nodes, a scheduler/output/router
# mix). Shuttle explores a random sample of interleavings, not all of them: it finds
# what loom's exhaustive search cannot reach in time, and proves nothing.
#
#   scripts/shuttle.sh                       # all tests, default schedule counts
#   SHUTTLE_SCHEDULES=200 scripts/shuttle.sh # a short pass (CI's)
#   scripts/shuttle.sh shuttle_radix peek    # one file, tests whose name contains "peek"
#
# `--cfg loom` marks a model-checked build and `--cfg shuttle` picks shuttle as the
# checker (src/sync.rs explains why shuttle needs both). A separate target dir keeps
# this build from invalidating the normal and the loom ones.
# SHUTTLE_SCHEDULES scales every test's schedule count (each test names its default);
# SHUTTLE_SEED fixes the first schedule's seed (a failure prints the one to replay).
set -euo pipefail
cd "$(dirname "$0")/.."

export RUSTFLAGS="${RUSTFLAGS:-} --cfg loom --cfg shuttle"
target="${1:-shuttle_*}"
shift || true

start=$(date +%s)
# Without the default `replay` feature: the models do not use it, and its dependencies
# (clap, serde, plotters, ...) cost about 30 s of a clean release build.
cargo test --release --no-default-features --no-fail-fast --target-dir target/shuttle --test "$target" -- --test-threads="${SHUTTLE_TEST_THREADS:-2}" --nocapture "$@"
echo "shuttle: tests passed in $(( $(date +%s) - start ))s"
