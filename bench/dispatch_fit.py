#!/usr/bin/env python3
"""How well each way of reading a run's dispatch probes predicts its launch-bound cells: for every
cell of RUN that BASELINE has and whose step slows under a slower host (D = dispatch_slowdown, the
smaller of the two runs', at least --min-d), the measured throughput ratio beside the ratio
1 / (1 + D x s) that the host's dispatching predicts, s = reading now / reading then - 1, under
each estimator of the reading (ci/gate.py uses `median`):
  fastest  the fastest of the run's probes (context and cells)
  median   the median of the probes of the run's cells of the cell's precision policy
  median1  the median of the probes of all the run's cells, whatever their precision
  cell     the cell's own probe (one reading, as the cell starts)
  after    the median of the cell's probes after each repetition (host_dispatch_us_after), where
           both runs have them
Then, per estimator, the median and the worst relative error over all the cells. Errors below 0
(measured below predicted) are the ones that fail a gate on unchanged code. The prediction has
neither the gate's 10% tolerance nor its cap at 1 (a faster host predicts above 1 here; the gate
never raises a bar). Pass whole runs: in a file of a few cells measured again, a median is of few
readings, which the gate never uses that way.

  python3 bench/dispatch_fit.py reports/baselines/nvidia-h200.json RUN.json [RUN.json ...]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ci"))
import gate  # noqa: E402


def reading(cells, context, name, how):
    if how == "fastest":
        return gate_fastest(cells, context)
    if how == "median":
        return gate.dispatch_us(cells, context, gate.precision_of(name))
    if how == "median1":
        probes = [c["reps"][0].get("host_dispatch_us", 0) for c in cells.values() if c["reps"]]
        probes = [us for us in probes if us > 0]
        return statistics.median(probes) if probes else 0.0
    rows = cells[name]["reps"]
    if how == "cell":
        return rows[0].get("host_dispatch_us", 0)
    after = [r["host_dispatch_us_after"] for r in rows if r.get("host_dispatch_us_after", 0) > 0]
    return statistics.median(after) if after else 0.0


def gate_fastest(cells, context):
    readings = [float(context.get("host_dispatch_us", 0) or 0)]
    readings += [c["reps"][0].get("host_dispatch_us", 0) for c in cells.values() if c["reps"]]
    return min((us for us in readings if us > 0), default=0.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baseline")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--min-d", type=float, default=0.3, help="cells whose D is at least this (default 0.3)")
    args = ap.parse_args(argv)
    base, base_ctx = gate.load(args.baseline)
    ways = ("fastest", "median", "median1", "cell", "after")
    errors = {w: [] for w in ways}
    print(f"{'run':28s} {'cell':52s} {'D':>5s} {'measured':>8s} " + " ".join(f"{w:>8s}" for w in ways))
    for path in args.runs:
        cells, ctx = gate.load(path)
        for name, c in sorted(cells.items()):
            if name not in base or not c["reps"] or not base[name]["reps"] or c["error"] or base[name]["error"]:
                continue
            b = base[name]["reps"]
            if not all("dispatch_slowdown" in r for r in b + c["reps"]):
                continue
            d = min(gate.median(b, "dispatch_slowdown"), gate.median(c["reps"], "dispatch_slowdown"))
            if d < args.min_d:
                continue
            measured = gate.median(c["reps"], "items_per_second") / gate.median(b, "items_per_second")
            shown = []
            for w in ways:
                now, then = reading(cells, ctx, name, w), reading(base, base_ctx, name, w)
                if now > 0 and then > 0:
                    predicted = 1.0 / (1.0 + d * (now / then - 1.0))
                    errors[w].append(measured / predicted - 1.0)
                    shown.append(f"{predicted:8.3f}")
                else:
                    shown.append(f"{'-':>8s}")
            print(f"{os.path.basename(path):28.28s} {name:52.52s} "
                  f"{d:5.2f} {measured:8.3f} " + " ".join(shown))
    print()
    for w in ways:
        e = errors[w]
        if e:
            print(f"{w:8s} {len(e):3d} cells: median |error| {statistics.median(abs(x) for x in e):.3f}, "
                  f"worst below {min(e):+.3f}, worst above {max(e):+.3f}")
        else:
            print(f"{w:8s}   0 cells: no readings of this kind in both runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
