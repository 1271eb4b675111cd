#!/usr/bin/env python3
"""Checks checkpoint benchmark JSON (strata_checkpoint bench, bench/peers.py --checkpoint-dir): each
file has the rows of the given number of strategies or peers — checkpoint_save, checkpoint_load and
checkpoint_async_blocked for each, none an error, every time and byte count above zero.

  python3 bench/check_checkpoint_json.py STRATA.json N [PEERS.json M]
"""
import json
import sys


def check(path, expected):
    rows = json.load(open(path))["benchmarks"]
    bad = [f"{r['name']}: {r.get('error_message')}" for r in rows if r.get("error_occurred")]
    assert not bad, f"{path}: errors: {bad}"
    by_kind = {}
    for r in rows:
        kind, who, _ = r["name"].split("/", 2)
        by_kind.setdefault(kind, set()).add(who)
        assert r["real_time"] > 0 and r["bytes"] > 0, f"{path}: {r['name']}: time {r['real_time']}, bytes {r['bytes']}"
    for kind in ("checkpoint_save", "checkpoint_load", "checkpoint_async_blocked"):
        got = by_kind.get(kind, set())
        assert len(got) == expected, f"{path}: {kind} rows for {sorted(got)}, expected {expected}"
    print(f"{path}: {expected} x save, load and async rows")


if __name__ == "__main__":
    args = sys.argv[1:]
    for i in range(0, len(args), 2):
        check(args[i], int(args[i + 1]))
