#!/usr/bin/env python3
"""Measures cells of a strata_bench run again, each in a strata_bench process of its own, for the
gate's --recheck (ci/gate.py): the cells that failed on time alone, listed by the gate's
--recheck-list. A cell's name says how it was run (strategy[options]/preset[overrides]; the
options include precision=P), so the same cell can be run by itself. A cell run over several ranks
(ranks=N) needs its launcher and is not measured again here; it keeps its failure.

  python3 ci/recheck.py --cells CELLS.txt --out RECHECK.json -- build/cuda/bench/strata_bench \\
      --device=cuda:0 --benchmark_repetitions=5

Everything after -- is the strata_bench command, to which each cell's own arguments and its
--benchmark_out are added. Exit 0 when every listed cell ran (whether it is now fast enough is the
gate's to say), 1 when a cell could not be run or more cells are listed than --max-cells (a
slowdown that broad is not re-measured: the first reading stands), 2 on bad arguments. The
JSON is written whatever the exit status (with no cells where none ran).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

CELL = re.compile(r"^([^\[\]/]+)(?:\[([^\]]*)\])?/([^\[\]/]+)(?:\[([^\]]*)\])?$")
PRESET_OVERRIDES = ("classes", "batch")  # what strata_bench shows in a preset's name


def pairs(text):
    """'k=v;k=v' as [(k, v)], in order; a part without '=' is an error naming it."""
    out = []
    for part in filter(None, (text or "").split(";")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"'{part}' is not key=value")
        out.append((key, value))
    return out


def cell_arguments(name):
    """strata_bench's arguments that run the cell `name` alone; ValueError names what cannot be."""
    m = CELL.match(name)
    if not m:
        raise ValueError(f"'{name}' is not a strata_bench cell name (strategy[options]/preset[overrides])")
    strategy, options, preset, overrides = m.groups()
    args = [f"--models={preset}", f"--strategies={strategy}"]
    rest = []
    for key, value in pairs(options):
        if key == "ranks":
            raise ValueError(f"'{name}' ran over {value} ranks: it needs its launcher to run again")
        if key == "precision":
            args.append(f"--precision={value}")
        else:
            rest.append(f"{key}={value}")
    if rest:
        args.append("--options=" + ";".join(rest))
    for key, value in pairs(overrides):
        if key not in PRESET_OVERRIDES:
            raise ValueError(f"'{name}': the preset override '{key}' has no strata_bench argument")
        args.append(f"--{key}={value}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("recheck.py: the strata_bench command goes after -- (recheck.py --help)", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", required=True, help="the cells to measure again, one a line (gate.py --recheck-list)")
    ap.add_argument("--out", required=True, help="the JSON to write: every cell that ran, as one strata_bench file")
    ap.add_argument("--max-cells", type=int, default=8,
                    help="measure none when more cells are listed (default 8; 0: never measure again)")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("recheck.py: no strata_bench command after --", file=sys.stderr)
        return 2
    try:
        with open(args.cells) as f:
            cells = [line.strip() for line in f if line.strip()]
    except OSError as e:
        print(f"recheck.py: --cells={args.cells}: {e.strerror}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    merged, status = None, 0
    if not cells:
        print("recheck.py: no cells listed; nothing to measure again")
    elif len(cells) > args.max_cells:
        print(f"recheck.py: {len(cells)} cells failed on time, more than --max-cells={args.max_cells}: not measured "
              f"again (a slowdown that broad is not one cell's noise); the run's reading stands")
        cells, status = [], 1
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(cells, 1):
            try:
                cell_args = cell_arguments(name)
            except ValueError as e:
                print(f"recheck.py: [{i}/{len(cells)}] {e}; it keeps its failure")
                status = 1
                continue
            out = os.path.join(tmp, f"cell-{i}.json")
            log = os.path.splitext(args.out)[0] + f"-{i}.txt"
            t0 = time.time()
            print(f"recheck.py: [{i}/{len(cells)}] {name}: {' '.join(cell_args)}", flush=True)
            with open(log, "w") as f:
                rc = subprocess.call(command + cell_args + [f"--benchmark_out={out}", "--benchmark_out_format=json"],
                                     stdout=f, stderr=subprocess.STDOUT)
            ran = os.path.exists(out)
            print(f"recheck.py: [{i}/{len(cells)}] {name}: exit {rc} after {time.time() - t0:.0f} s"
                  f"{'' if ran else ', no JSON written'} (log {log})", flush=True)
            if rc != 0 or not ran:
                status = 1
            if not ran:
                continue
            try:
                with open(out) as f:
                    doc = json.load(f)
            except ValueError as e:  # a process that died while writing it
                print(f"recheck.py: [{i}/{len(cells)}] {name}: its JSON is unreadable ({e}); it keeps its failure")
                status = 1
                continue
            found = [b for b in doc.get("benchmarks", []) if b["name"].split("/iterations")[0] == name]
            if not found:
                print(f"recheck.py: [{i}/{len(cells)}] {name}: the run named no such cell "
                      f"({sorted({b['name'].split('/iterations')[0] for b in doc.get('benchmarks', [])})})")
                status = 1
                continue
            if merged is None:
                merged = {"context": doc.get("context", {}), "benchmarks": []}
            merged["benchmarks"] += found
    with open(args.out, "w") as f:
        json.dump(merged or {"context": {}, "benchmarks": []}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
