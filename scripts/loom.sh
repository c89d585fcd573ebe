#!/usr/bin/env bash
# Run kvpool's loom models (tests/loom_*.rs): every interleaving of small concurrent
# scenarios, up to LOOM_MAX_PREEMPTIONS preemptions per execution.
#
#   scripts/loom.sh                 # all models (kvpool's and examples/loom-scheduler's)
#   scripts/loom.sh loom_slots      # one file
#   scripts/loom.sh loom-scheduler  # the downstream example crate's models only
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
status=0
if [ "$target" != loom-scheduler ]; then
    # Without the default `replay` feature: the models do not use it, and its dependencies
    # (clap, serde, plotters, ...) cost about 30 s of a clean release build.
    cargo test --release --no-default-features --no-fail-fast --target-dir target/loom --test "$target" -- --test-threads="${LOOM_TEST_THREADS:-2}" "$@" || status=$?
fi
# The downstream crate (examples/loom-scheduler): a user's scheduler protocol, model-checked
# with kvpool's types inside, built the way a user builds it (kvpool without default
# features, as a dependency). Also run alone with `scripts/loom.sh loom-scheduler`.
if [ "$target" = 'loom_*' ] || [ "$target" = loom-scheduler ]; then
    cargo test --release --no-fail-fast --target-dir target/loom -p loom-scheduler --tests -- --test-threads="${LOOM_TEST_THREADS:-2}" "$@" || status=$?
fi
[ "$status" = 0 ] || { echo "loom: a model FAILED"; exit "$status"; }
echo "loom: models passed in $(( $(date +%s) - start ))s (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
