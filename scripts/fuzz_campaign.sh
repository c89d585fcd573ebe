#!/usr/bin/env bash
# A long fuzzing campaign on a many-core machine, from binaries built elsewhere by
# scripts/fuzz_build_campaign.sh: nothing is built or installed here (bash, awk, grep
# and coreutils are all it needs).
#
#   OUT=/path/to/results scripts/fuzz_campaign.sh
#
# Settings (environment):
#   OUT              results folder (required): OUT/campaign.md (the table),
#                    OUT/<target>/{corpus,artifacts,logs}
#   FUZZ_DIR         campaign folder (default .device/fuzz)
#   FUZZ_TARGETS     targets to run (default: every binary in FUZZ_DIR/bin)
#   FUZZ_WORKERS     parallel libFuzzer jobs per target (default: nproc)
#   FUZZ_SECONDS     wall time per target (default 600); each job runs that long
#   FUZZ_RUNS        alternatively, executions per job (-runs=); set FUZZ_SECONDS=0
#   FUZZ_CORPUS_IN   optional folder with <target>/ corpora from an earlier campaign
#
# Each target runs `-workers=N -jobs=N` over OUT/<target>/corpus (seeded from the
# checked-in seeds and FUZZ_CORPUS_IN), with its options file and dictionary. Then one
# pass over the final corpus (-runs=0) measures coverage (cov: edges, ft: features).
# Exit status 1 when any target left a crash, timeout or OOM artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fuzz_common.sh

: "${OUT:?set OUT to a results folder}"
dir="${FUZZ_DIR:-.device/fuzz}"
workers="${FUZZ_WORKERS:-$(nproc)}"
secs="${FUZZ_SECONDS:-600}"
runs="${FUZZ_RUNS:-}"
[ -d "$dir/bin" ] || { echo "campaign: no $dir/bin (run scripts/fuzz_build_campaign.sh first)"; exit 2; }
dir="$(cd "$dir" && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
targets="${FUZZ_TARGETS:-$(ls "$dir/bin")}"

limit=()
[ "$secs" != 0 ] && limit+=(-max_total_time="$secs")
[ -n "$runs" ] && limit+=(-runs="$runs")

table="$OUT/campaign.md"
{
    echo "# Fuzzing campaign"
    echo
    echo "- machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //' || echo unknown))"
    echo "- workers per target: $workers; limit per job: ${limit[*]}"
    echo "- binaries: $(grep -E '^(commit|toolchain|flags):' "$dir/BUILD_INFO" 2>/dev/null | paste -sd ';' - | sed 's/;/; /g')"
    echo "- started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "| target | jobs | wall s | total execs | execs/s (all jobs) | execs/s per job | cov | ft | corpus files | crashes |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
} >"$table"

status=0
for target in $targets; do
    bin="$dir/bin/$target"
    work="$OUT/$target"
    mkdir -p "$work/corpus" "$work/artifacts" "$work/logs"
    [ -d "$dir/seeds/$target" ] && cp -n "$dir/seeds/$target"/* "$work/corpus/" 2>/dev/null || true
    if [ -n "${FUZZ_CORPUS_IN:-}" ] && [ -d "$FUZZ_CORPUS_IN/$target" ]; then
        cp -n "$FUZZ_CORPUS_IN/$target"/* "$work/corpus/" 2>/dev/null || true
    fi
    mapfile -t extra < <(fuzz_args "$dir" "$target")
    echo "campaign: $target, $workers jobs, ${limit[*]} ${extra[*]}"
    start=$(date +%s)
    # The jobs write logs/fuzz-<i>.log in the working directory.
    (cd "$work/logs" && "$bin" -workers="$workers" -jobs="$workers" "${limit[@]}" -print_final_stats=1 \
        -timeout=30 -artifact_prefix="$work/artifacts/" "${extra[@]}" "$work/corpus" >"$work/logs/main.log" 2>&1) || true
    wall=$(( $(date +%s) - start ))
    [ "$wall" -gt 0 ] || wall=1

    execs=0
    per_job=()
    for log in "$work"/logs/fuzz-*.log; do
        [ -f "$log" ] || continue
        n=$(fuzz_stat "$log" number_of_executed_units)
        if [ -z "$n" ]; then # a job that crashed prints no final stats: take its last status line
            n=$(grep -Eo '^#[0-9]+' "$log" | tail -n1 | tr -d '#')
        fi
        execs=$(( execs + ${n:-0} ))
        r=$(fuzz_stat "$log" average_exec_per_sec)
        [ -n "$r" ] && per_job+=("$r")
    done
    # Coverage of the final corpus, in one pass.
    "$bin" -runs=0 "${extra[@]}" "$work/corpus" >"$work/logs/coverage.log" 2>&1 || true
    cov=$(grep -Eo 'cov: [0-9]+' "$work/logs/coverage.log" | tail -n1 | awk '{print $2}')
    ft=$(grep -Eo 'ft: [0-9]+' "$work/logs/coverage.log" | tail -n1 | awk '{print $2}')
    files=$(find "$work/corpus" -type f | wc -l)
    crashes=$(find "$work/artifacts" -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)
    [ "$crashes" -eq 0 ] || status=1
    job_rates=$(printf '%s\n' "${per_job[@]:-}" | awk 'NF {s += $1; n++; if (min == "" || $1 < min) min = $1; if ($1 > max) max = $1}
        END {if (n) printf "%d (min %d, max %d)", s / n, min, max; else printf "n/a"}')
    echo "| $target | $workers | $wall | $execs | $(( execs / wall )) | $job_rates | ${cov:-?} | ${ft:-?} | $files | $crashes |" >>"$table"
    echo "campaign: $target: $execs execs in ${wall}s, cov ${cov:-?} ft ${ft:-?}, $crashes crash artifact(s)"
done
{
    echo
    echo "- finished: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- crash inputs (if any): \`<target>/artifacts/\`; replay one with \`FUZZ_DIR/bin/<target> <file>\`"
} >>"$table"
cat "$table"
exit "$status"
