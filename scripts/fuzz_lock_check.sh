#!/usr/bin/env bash
# Check that every package fuzz/Cargo.lock shares with the main Cargo.lock is locked
# at a version the main lock also has (the fuzz workspace must test the same
# dependencies the crate ships with). Exit 1 listing the mismatches.
set -euo pipefail
cd "$(dirname "$0")/.."
versions() { # "name version" per package
    awk '/^name = /{gsub(/"/, "", $3); n=$3} /^version = /{gsub(/"/, "", $3); print n, $3}' "$1" | sort -u
}
main=$(versions Cargo.lock)
bad=$(versions fuzz/Cargo.lock | while read -r name version; do
    have=$(echo "$main" | awk -v n="$name" '$1 == n {print $2}')
    if [ -n "$have" ] && ! echo "$have" | grep -qx "$version"; then
        echo "  $name: fuzz/Cargo.lock $version, Cargo.lock $(echo $have)"
    fi
done)
if [ -n "$bad" ]; then
    echo "fuzz: fuzz/Cargo.lock differs from Cargo.lock on shared packages:"
    echo "$bad"
    exit 1
fi
echo "fuzz: fuzz/Cargo.lock agrees with Cargo.lock on shared packages"
