#!/usr/bin/env python3
"""Checks a strata_bench JSON file: a cell (its repetitions) per strategy x model asked for, each of which
passed its parity check (counter parity_ok = 1), ran without error, measured a throughput and, in
every repetition, the host's dispatch probe after its steps; with --host-probes, that the context
carries the host's triad and optimizer-pass readings (positive), without it that they read 0 (a CPU
run measures them only when asked).
Exit 1, naming every cell that does not, otherwise 0.

  python3 bench/check_bench_json.py bench.json --strategies=a,b,c --models=gpt-tiny
"""
import argparse
import json
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--strategies", required=True, help="comma-separated (strata_bench --list-strategies)")
    ap.add_argument("--models", required=True)
    ap.add_argument("--host-probes", action="store_true", help="the run was given --host-probes")
    args = ap.parse_args()
    with open(args.json) as f:
        doc = json.load(f)
    rows = doc["benchmarks"]
    by_cell = {}
    for r in rows:
        if r.get("run_type") == "aggregate":
            continue  # with repetitions: the iteration rows are the cell's
        by_cell.setdefault(re.sub(r"/iterations:\d+|/manual_time|/repeats:\d+", "", r["name"]), []).append(r)
    problems = []
    expected = {f"{s}/{m}" for s in args.strategies.split(",") if s for m in args.models.split(",") if m}
    for cell in sorted(expected):
        found = by_cell.get(cell, [])
        if not found:
            problems.append(f"{cell}: no row")
            continue
        r = next((x for x in found if x.get("error_occurred")), found[0])
        if r.get("error_occurred"):
            problems.append(f"{cell}: {r.get('error_message', 'error')}")
        elif r.get("parity_ok") != 1:
            problems.append(f"{cell}: parity_ok is {r.get('parity_ok')}, expected 1")
        elif not r.get("items_per_second", 0) > 0:
            problems.append(f"{cell}: no throughput measured")
        elif not all(x.get("host_dispatch_us_after", 0) > 0 for x in found):
            problems.append(f"{cell}: a repetition without its dispatch probe (host_dispatch_us_after)")
    for cell in sorted(set(by_cell) - expected):
        problems.append(f"{cell}: not asked for")
    for key in ("host_triad_GBps", "host_pass_GBps", "host_pass_bf16_GBps"):
        value = float(doc.get("context", {}).get(key, "nan"))
        if args.host_probes and not value > 0:
            problems.append(f"context {key} is {value}: the host probe did not measure")
        elif not args.host_probes and value != 0:
            problems.append(f"context {key} is {value}: measured on a CPU run not given --host-probes")
    for p in problems:
        print("check_bench_json: " + p)
    print(f"check_bench_json: {len(expected)} cells expected, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
