# Shared by scripts/fuzz.sh and scripts/fuzz_campaign.sh (sourced, not run).
#
# fuzz_args DIR TARGET: print the libFuzzer flags for TARGET, one per line, from the
# layout DIR holds (the repository's fuzz/, or a campaign folder made by
# scripts/fuzz_build_campaign.sh): DIR/options/TARGET.options (flags one per line, #
# comments) and -dict=DIR/dicts/TARGET.dict when that file exists.
fuzz_args() {
    local dir="$1" target="$2"
    if [ -f "$dir/options/$target.options" ]; then
        grep -Ev '^[[:space:]]*(#|$)' "$dir/options/$target.options" || true
    fi
    if [ -f "$dir/dicts/$target.dict" ]; then
        echo "-dict=$(cd "$dir/dicts" && pwd)/$target.dict"
    fi
}

# fuzz_stat LOG NAME: the value of libFuzzer's final `stat::NAME:` line in LOG (empty
# when missing).
fuzz_stat() {
    grep -E "^stat::$2:" "$1" 2>/dev/null | tail -n1 | awk '{print $2}'
}
