#!/usr/bin/env python3
"""Deterministic traces in the Mooncake format for checking eviction policies (issue 13)
on workloads other than the bundled one.

    scripts/synth_trace.py KIND [--seed N] [--requests N] > trace.jsonl

KIND:
  exp        multi-turn conversations, a constant continuation probability (0.6 after
             every turn: the depth of a conversation says nothing about its future),
             exponential turn gaps (mean 300 s);
  lognormal  the chance of another turn rises with depth (0.3 after the first turn, then
             0.5, 0.7, 0.8), heavy-tailed lognormal turn gaps (median 90 s, sigma 1.5);
  short      constant continuation probability 0.5, short exponential gaps (mean 30 s):
             most reuse lies within a few dozen requests;
  subsample  the bundled Mooncake trace with every other conversation removed (a
             conversation: a first request and the requests extending it; needs
             data/mooncake_conversation_trace.jsonl.gz).

Every conversation starts with the shared system-prompt block 0; a prompt is its
conversation's full 512-token blocks so far, the new turn's blocks and a partial last
block with a fresh id (as in the Mooncake trace, the next turn does not share it).
Sessions arrive as a Poisson process (3.4 per second: the bundled trace's request rate
is about 3.4 per second) until `--requests` requests are made.
"""
import argparse
import gzip
import heapq
import json
import os
import random
import sys


def synth(kind, seed, n):
    rng = random.Random(seed)
    next_id = [1]

    def fresh():
        next_id[0] += 1
        return next_id[0] - 1

    if kind == "exp":
        cont = lambda depth: 0.6
        gap = lambda: rng.expovariate(1 / 300.0)
    elif kind == "lognormal":
        cont = lambda depth: [0.3, 0.5, 0.7][depth] if depth < 3 else 0.8
        gap = lambda: rng.lognormvariate(4.5, 1.5)
    elif kind == "short":
        cont = lambda depth: 0.5
        gap = lambda: rng.expovariate(1 / 30.0)
    else:
        raise SystemExit(f"unknown kind {kind}")
    rate = 3.4 / 2.0  # sessions per second: about two requests per session
    events = []  # (time, seq, session state)
    seq = 0
    t = 0.0
    out = []
    while len(out) < n:
        t_new = t + rng.expovariate(rate)
        if events and events[0][0] < t_new:
            t, _, s = heapq.heappop(events)
        else:
            t = t_new
            s = {"blocks": [0] + [fresh() for _ in range(rng.randint(2, 24))], "depth": 0}
        if s["depth"] > 0:
            s["blocks"] = s["blocks"] + [fresh() for _ in range(rng.randint(1, 8))]
        partial = rng.randint(1, 511)
        hash_ids = s["blocks"] + [fresh()]
        out.append(
            {
                "timestamp": int(t * 1000),
                "input_length": len(s["blocks"]) * 512 + partial,
                "output_length": rng.randint(50, 800),
                "hash_ids": hash_ids,
            }
        )
        if rng.random() < cont(s["depth"]):
            s["depth"] += 1
            seq += 1
            heapq.heappush(events, (t + gap(), seq, s))
    return out


def subsample():
    path = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_conversation_trace.jsonl.gz")
    reqs = [json.loads(line) for line in gzip.open(path)]
    seen = {}  # block-prefix -> conversation of the request that last held it
    conv = []
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        c, shared = i, 0
        for j in range(len(h)):
            key = tuple(h[: j + 1])
            if key not in seen:
                break
            c, shared = seen[key], j + 1
        if shared <= 1:  # only the system prompt in common: a new conversation
            c = i
        conv.append(c)
        for j in range(len(h)):
            seen[tuple(h[: j + 1])] = c
    roots = sorted(set(conv))
    keep = set(roots[::2])
    return [r for r, c in zip(reqs, conv) if c in keep]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--requests", type=int, default=12000)
    a = ap.parse_args()
    reqs = subsample() if a.kind == "subsample" else synth(a.kind, a.seed, a.requests)
    for r in reqs:
        sys.stdout.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
