#!/usr/bin/env python3
"""How well do online-observable signals predict that a conversation returns? (issue 13,
fifth attempt; analysis only, it reads the whole trace).

    scripts/return_signals.py [TRACE] [--window W]

A request's *continuation* is the first later request whose prompt extends it: the
latest earlier request whose full-block hash chain is a prefix (of at least two blocks)
of a request's hash ids is its parent. For each signal a server knows when it caches a
request's leaf (conversation depth, the gap in requests since the previous turn,
prompt and output length), the table gives the share of requests continued at all and
within W requests (default 1,024); then, for cross-classifications of the signals, the
AUC of the empirical per-cell probability of a continuation within W (fitted on the
whole trace: an optimistic, overfitted bound on what the signals can tell).
"""
import bisect
import collections
import gzip
import json
import math
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    args = sys.argv[1:]
    window = 1024
    if "--window" in args:
        i = args.index("--window")
        window = int(args[i + 1])
        del args[i : i + 2]
    reqs = load(args[0] if args else "data/mooncake_conversation_trace.jsonl.gz")
    n = len(reqs)
    by_chain = {}
    parent, depth, child = [-1] * n, [0] * n, [-1] * n
    for i, r in enumerate(reqs):
        h = tuple(r["hash_ids"])
        for k in range(len(h), 1, -1):
            j = by_chain.get(h[:k])
            if j is not None:
                parent[i], depth[i] = j, depth[j] + 1
                if child[j] < 0:
                    child[j] = i
                break
        by_chain[tuple(r["hash_ids"][: r["input_length"] // 512])] = i
    soon = [child[i] >= 0 and child[i] - i <= window for i in range(n)]
    log2 = lambda x: -1 if x is None else int(math.log2(x + 1))
    signals = {
        "d": ("depth", lambda i: min(depth[i], 6)),
        "g": ("gap since the previous turn (log2 requests; -1: first turn)",
              lambda i: log2(i - parent[i]) if parent[i] >= 0 else -1),
        "i": ("prompt tokens (log2)", lambda i: log2(reqs[i]["input_length"])),
        "o": ("output tokens (log2)", lambda i: log2(reqs[i]["output_length"])),
    }
    # Requests too close to the end to see a continuation within the window are left out.
    body = range(max(0, n - window))
    for key, (name, f) in signals.items():
        cells = collections.defaultdict(lambda: [0, 0, 0])
        for i in body:
            c = cells[f(i)]
            c[0] += 1
            c[1] += child[i] >= 0
            c[2] += soon[i]
        print(f"{name}: value, requests, continued, within {window}")
        for k in sorted(cells):
            t = cells[k]
            print(f"  {k:>3} {t[0]:>6} {t[1] / t[0]:.2f} {t[2] / t[0]:.2f}")
    for keys in ["d", "dg", "dgio"]:
        cell = lambda i: tuple(signals[k][1](i) for k in keys)
        counts = collections.defaultdict(lambda: [0, 0])
        for i in body:
            counts[cell(i)][0] += 1
            counts[cell(i)][1] += soon[i]
        p = {k: v[1] / v[0] for k, v in counts.items()}
        pos = [p[cell(i)] for i in body if soon[i]]
        neg = sorted(p[cell(i)] for i in body if not soon[i])
        auc = sum(bisect.bisect_left(neg, x) + 0.5 * (bisect.bisect_right(neg, x) - bisect.bisect_left(neg, x))
                  for x in pos) / len(pos) / len(neg)
        print(f"signals {keys}: {len(counts)} cells, AUC {auc:.3f}")


if __name__ == "__main__":
    main()
