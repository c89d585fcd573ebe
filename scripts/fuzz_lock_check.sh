#!/usr/bin/env bash
# Check that every package a fuzz project's lock (fuzz/Cargo.lock, or the one given as
# the first argument) shares with the main Cargo.lock is locked at a version the main
# lock also has (the fuzz workspace must test the same dependencies the crate ships
# with). Exit 1 listing the mismatches.
set -euo pipefail
cd "$(dirname "$0")/.."
versions() { # "name version" per package
    awk '/^name = /{gsub(/"/, "", $3); n=$3} /^version = /{gsub(/"/, "", $3); print n, $3}' "$1" | sort -u
}
lock="${1:-fuzz/Cargo.lock}"
main=$(versions Cargo.lock)
bad=$(versions "$lock" | while read -r name version; do
    have=$(echo "$main" | awk -v n="$name" '$1 == n {print $2}')
    if [ -n "$have" ] && ! echo "$have" | grep -qx "$version"; then
        echo "  $name: $lock $version, Cargo.lock $(echo $have)"
    fi
done)
if [ -n "$bad" ]; then
    echo "fuzz: $lock differs from Cargo.lock on shared packages:"
    echo "$bad"
    exit 1
fi
echo "fuzz: $lock agrees with Cargo.lock on shared packages"
