#!/usr/bin/env python3
"""Summarise the samples of examples/cache_ops_profile.rs.

    python3 scripts/profile_report.py EXECUTABLE SAMPLES [--top N] [--under NAME] [--callers NAME]

Each line of SAMPLES is one sample: hexadecimal offsets from the executable's load
address, the interrupted instruction first, then return addresses (0 for an address
outside the executable). Offsets are resolved with binutils' `addr2line` (inlined
frames included); a return address is looked up one byte back, at its call.

Prints the share of samples
  * by innermost function (inlined functions count as themselves),
  * by enclosing symbol (what a profiler without inline information shows),
  * inclusive (a function anywhere on the sample's stack, counted once per sample),
  * by source line of the interrupted instruction.
--under NAME restricts the first table to samples with NAME on their stack;
--callers NAME lists the callers of NAME when it is the innermost function or near it.
"""

import argparse
import collections
import re
import subprocess
import sys


def resolve(exe, offsets):
    """{offset: [(function, file:line), ...] innermost first} via addr2line."""
    frames = {}
    offsets = sorted(offsets)
    for i in range(0, len(offsets), 20000):
        chunk = offsets[i:i + 20000]
        out = subprocess.run(
            ["addr2line", "-a", "-f", "-i", "-C", "-e", exe] + [hex(o) for o in chunk],
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        cur, k = None, 0
        while k < len(out):
            if out[k].startswith("0x"):
                cur = int(out[k], 16)
                frames[cur] = []
                k += 1
                continue
            loc = out[k + 1] if k + 1 < len(out) else "??:0"
            frames[cur].append((out[k], loc.split(" ")[0].rsplit("/", 1)[-1]))
            k += 2
    return frames


def short(name):
    """Drop generic arguments and the crate prefix, for readable tables."""
    prev = None
    while prev != name:
        prev, name = name, re.sub(r"<[^<>]*>", "", name)
    return name.replace("kvpool::", "")[:100]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exe")
    ap.add_argument("samples")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--under")
    ap.add_argument("--callers")
    a = ap.parse_args()

    rows = []
    with open(a.samples) as f:
        for line in f:
            addrs = [int(x, 16) for x in line.split()]
            if addrs:
                # Return addresses point after their call: look them up at the call.
                rows.append([x if i == 0 or x == 0 else x - 1 for i, x in enumerate(addrs)])
    if not rows:
        sys.exit("no samples")
    frames = resolve(a.exe, {x for r in rows for x in r if x})
    unknown = [("??", "??:0")]
    n = len(rows)

    inner, symbol, inclusive, lines = (collections.Counter() for _ in range(4))
    callers = collections.Counter()
    for r in rows:
        stack = []  # innermost first, inlined frames expanded
        for x in r:
            stack += frames.get(x, unknown) if x else unknown
        names = [short(fn) for fn, _ in stack]
        if a.under and not any(a.under in s for s in names):
            continue
        leaf = frames.get(r[0], unknown) if r[0] else unknown
        inner[short(leaf[0][0])] += 1
        symbol[short(leaf[-1][0])] += 1
        lines[leaf[0][1]] += 1
        for s in set(names):
            inclusive[s] += 1
        if a.callers:
            hits = [i for i, s in enumerate(names[:4]) if a.callers in s]
            if hits:
                k = max(j for j, s in enumerate(names) if a.callers in s)
                callers[" <- ".join(names[k + 1:k + 4])] += 1

    def table(title, counter, top):
        print(f"== {title} ({n} samples)")
        for name, c in counter.most_common(top):
            print(f"{100 * c / n:6.1f}%  {name}")
        print()

    scope = f", under {a.under}" if a.under else ""
    table("self, innermost function" + scope, inner, a.top)
    table("self, enclosing symbol" + scope, symbol, a.top)
    table("inclusive" + scope, inclusive, 2 * a.top)
    table("source line of the interrupted instruction" + scope, lines, a.top)
    if a.callers:
        table(f"callers of {a.callers}", callers, a.top)


if __name__ == "__main__":
    main()
