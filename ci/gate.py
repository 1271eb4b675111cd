#!/usr/bin/env python3
"""Regression gate: compares a strata_bench JSON run with the stored baseline for the same GPU.
A cell fails when its throughput (items_per_second) is more than --throughput-drop below the
baseline's, its peak allocated memory more than --memory-rise above, or when it ran in the
baseline and is missing now, failed parity or ran out of memory. Exit 1 on any failure.

  python3 ci/gate.py CURRENT.json reports/baselines/nvidia-h200.json
"""
import argparse
import json
import os
import re
import subprocess
import sys


def cells(path):
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for b in doc.get("benchmarks", []):
        out[re.sub(r"/iterations:\d+|/manual_time", "", b["name"])] = b
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("current")
    ap.add_argument("baseline")
    ap.add_argument("--throughput-drop", type=float, default=0.07)
    ap.add_argument("--memory-rise", type=float, default=0.03)
    args = ap.parse_args()
    now, base = cells(args.current), cells(args.baseline)
    failures = []
    print(f"{'cell':45s} {'items/s now':>12s} {'baseline':>12s} {'ratio':>7s} {'peak GiB now':>13s} {'baseline':>9s} {'ratio':>7s}")
    for name, b in sorted(base.items()):
        if b.get("error_occurred"):
            continue  # nothing to hold the new run to
        c = now.get(name)
        if c is None:
            failures.append(f"{name}: in the baseline but not in this run")
            continue
        if c.get("error_occurred"):
            failures.append(f"{name}: {c.get('error_message', 'error')}")
            continue
        t_ratio = c["items_per_second"] / b["items_per_second"]
        m_ratio = c["peak_allocated_bytes"] / max(b["peak_allocated_bytes"], 1.0) if b["peak_allocated_bytes"] else 1.0
        print(f"{name:45s} {c['items_per_second']:12.0f} {b['items_per_second']:12.0f} {t_ratio:7.3f} "
              f"{c['peak_allocated_bytes'] / 2**30:13.2f} {b['peak_allocated_bytes'] / 2**30:9.2f} {m_ratio:7.3f}")
        if t_ratio < 1.0 - args.throughput_drop:
            failures.append(f"{name}: throughput {t_ratio:.3f} x the baseline (allowed drop {args.throughput_drop:.0%})")
        if m_ratio > 1.0 + args.memory_rise:
            failures.append(f"{name}: peak memory {m_ratio:.3f} x the baseline (allowed rise {args.memory_rise:.0%})")
    # Google Benchmark's own comparison, for the time columns, where it is installed.
    tool = os.environ.get("BENCHMARK_COMPARE")
    if tool and os.path.exists(tool):
        subprocess.run([sys.executable, tool, "--no-color", "benchmarks", args.baseline, args.current], check=False)
    if failures:
        print("\ngate: FAIL")
        for f in failures:
            print("  " + f)
        return 1
    print(f"\ngate: PASS ({len(base)} cells; throughput drop <= {args.throughput_drop:.0%}, "
          f"memory rise <= {args.memory_rise:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
