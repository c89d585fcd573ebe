#!/usr/bin/env bash
# Executions per CPU-second of each fuzz target at steady state, as RELIABILITY.md
# reports them: grow a corpus from the seeds for GROW runs, then time RUNS more
# executions over it (user + system CPU time, so a busy machine does not skew it),
# inputs at full -max_len from the start (-len_control=0): the slow steady state.
#
#   scripts/fuzz_speed.sh                   # binaries from .device/fuzz (fuzz_build_campaign.sh)
#   FUZZ_DIR=... GROW=100000 RUNS=300000 scripts/fuzz_speed.sh [target...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fuzz_common.sh

dir="${FUZZ_DIR:-.device/fuzz}"
grow="${GROW:-100000}"
runs="${RUNS:-300000}"
[ -d "$dir/bin" ] || { echo "speed: no $dir/bin (run scripts/fuzz_build_campaign.sh first)"; exit 2; }
targets="${*:-$(ls "$dir/bin")}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '%-14s %12s %8s %14s %6s %6s\n' target execs cpu_s execs/cpu-s cov ft
for target in $targets; do
    mapfile -t extra < <(fuzz_args "$dir" "$target")
    mkdir -p "$work/$target"
    [ -d "$dir/seeds/$target" ] && cp "$dir/seeds/$target"/* "$work/$target/"
    "$dir/bin/$target" "$work/$target" -seed=1 -runs="$grow" -len_control=0 "${extra[@]}" >"$work/$target.grow.log" 2>&1
    TIMEFORMAT='%U %S' # bash's own `time`: user and system seconds
    { time "$dir/bin/$target" "$work/$target" -seed=2 -runs="$runs" -len_control=0 -print_final_stats=1 "${extra[@]}" \
        >"$work/$target.log" 2>&1; } 2>"$work/$target.time"
    read -r user sys <"$work/$target.time"
    execs=$(fuzz_stat "$work/$target.log" number_of_executed_units)
    cov=$(grep -Eo 'cov: [0-9]+' "$work/$target.log" | tail -n1 | awk '{print $2}')
    ft=$(grep -Eo 'ft: [0-9]+' "$work/$target.log" | tail -n1 | awk '{print $2}')
    awk -v t="$target" -v e="$execs" -v u="$user" -v s="$sys" -v c="$cov" -v f="$ft" \
        'BEGIN {printf "%-14s %12d %8.2f %14d %6s %6s\n", t, e, u + s, e / (u + s), c, f}'
done
