#!/usr/bin/env python3
"""Measures cells of a strata_bench run again, each in a strata_bench process of its own, for the
gate's --recheck (ci/gate.py): the cells that failed on time alone, listed by the gate's
--recheck-list. A cell's name says how it was run (strategy[options]/preset[overrides]; the
options include precision=P), so the same cell can be run by itself. A cell run over several ranks
(ranks=N) needs its launcher and is not measured again here; it keeps its failure.

  python3 ci/recheck.py --cells CELLS.txt --out RECHECK.json -- build/cuda/bench/strata_bench \\
      --device=cuda:0 --benchmark_repetitions=5

With --reference-bench, a strata_bench built from the baseline's own commit, each cell is also
run by that binary on the same host, the two alternating over --rounds processes each (reference
then this code, then this code then reference: a host that drifts during the pair weighs on both
alike), and the reference's rows go to --reference-out for the gate's --recheck-reference. The
gate then compares the code with the baseline's code on one host at one time, which no probe of
the host's speed can (bench/notes/gate-recheck.md). Every row is
tagged with its process (counter recheck_process, 1 up, per side): processes of one binary on one
host differ by more than the repetitions within one, so the gate compares processes. With 3 a side
the clearest separation reaches the gate's 5% exactly (1 arrangement in 20); the default 4 gives
room (1 in 70). --reference-commit names the reference's commit in its file, and the gate pairs
only a reference whose commit is the baseline's.

A GPU job has a time limit, and one slow cell measured beside the baseline's code takes minutes
(gpt-871m's offloaded cells ~30 s a process, eight processes). --order-by RUN.json measures the
cells cheapest first, by the time the run spent in each cell's timed iterations (a proxy: setup is
not counted). --budget-s S keeps within S seconds, overrunning by at most one process: after each
process, a cell whose remaining processes (each as long as its longest so far) would end past S is
given up at once, its processes' rows dropped, with every cell after it; a cell is not started
where one process as long as the longest so far would not fit. Those cells keep their failure.
Both files are rewritten after every finished cell, so a job killed partway leaves the cells
measured before it, for ci/gate.py's --recheck (and --recheck-reference) by hand; every process's
reading is printed as it ends.

Everything after -- is the strata_bench command, to which each cell's own arguments and its
--benchmark_out are added (the reference gets the same arguments). Exit 0 when every listed cell
ran (whether it is now fast enough is the gate's to say), 1 when a cell could not be run or more
cells are listed than --max-cells (a slowdown that broad is not re-measured: the first reading
stands) or the budget left cells unmeasured, 2 on bad arguments. The JSON is written whatever the exit status (with no cells where
none ran).
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


READINGS = ("items_per_second", "fwd_bwd_ms")  # what the gate gates on time


def reading(rows):
    """A process's rows as text: the median of each gated counter over its repetitions."""
    parts = []
    for key in READINGS:
        values = sorted(r[key] for r in rows if r.get("run_type", "iteration") == "iteration" and key in r)
        if values:
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
            parts.append(f"{key} {median:.4g}")
    return (", ".join(parts) + f" (median of {len(rows)})") if parts else "no gated counter"


def run_seconds(path):
    """{cell: seconds the run spent in its measured iterations} from a strata_bench JSON (real_time
    times iterations over its repetitions); ValueError names what is wrong with the file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--order-by={path}: {getattr(e, 'strerror', None) or e}")
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    seconds = {}
    for b in doc.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or "real_time" not in b:
            continue
        name = b["name"].split("/iterations")[0]
        seconds[name] = seconds.get(name, 0.0) + (
            b["real_time"] * scale.get(b.get("time_unit", "ns"), 1e-9) * b.get("iterations", 1))
    return seconds


def write_json(path, doc):
    """`doc` to `path` whole or not at all: a job killed while writing keeps the last whole file."""
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def run_cell(command, name, cell_args, out, log, tag):
    """One strata_bench process of the cell: (its iteration rows or None, its context, whether the
    process exited 0 and its rows were found), the reason printed where not."""
    t0 = time.time()
    print(f"recheck.py: {tag} {name}: {' '.join(cell_args)}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(command + cell_args + [f"--benchmark_out={out}", "--benchmark_out_format=json"],
                             stdout=f, stderr=subprocess.STDOUT)
    ran = os.path.exists(out)
    if not ran:
        print(f"recheck.py: {tag} {name}: exit {rc} after {time.time() - t0:.0f} s, no JSON written (log {log})",
              flush=True)
        return None, None, False
    try:
        with open(out) as f:
            doc = json.load(f)
    except ValueError as e:  # a process that died while writing it
        print(f"recheck.py: {tag} {name}: exit {rc} after {time.time() - t0:.0f} s; its JSON is unreadable ({e}); "
              f"it keeps its failure (log {log})", flush=True)
        return None, None, False
    found = [b for b in doc.get("benchmarks", []) if b["name"].split("/iterations")[0] == name]
    print(f"recheck.py: {tag} {name}: exit {rc} after {time.time() - t0:.0f} s"
          f"{': ' + reading(found) if found else ''} (log {log})", flush=True)
    if not found:
        print(f"recheck.py: {tag} {name}: the run named no such cell "
              f"({sorted({b['name'].split('/iterations')[0] for b in doc.get('benchmarks', [])})})")
        return None, None, False
    return found, doc.get("context", {}), rc == 0


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
    ap.add_argument("--reference-bench", metavar="PATH",
                    help="strata_bench built from the baseline's commit, run beside the command on each cell")
    ap.add_argument("--reference-out", metavar="PATH", help="the JSON of the reference's rows (with --reference-bench)")
    ap.add_argument("--reference-label", default="",
                    help="what the reference is (its commit), kept in --reference-out's context")
    ap.add_argument("--reference-commit", default="",
                    help="the commit the reference was built from, kept in --reference-out's context as strata_commit")
    ap.add_argument("--rounds", type=int, default=None,
                    help="processes of each cell per binary (default 4 with --reference-bench, else 1)")
    ap.add_argument("--order-by", metavar="RUN.json",
                    help="the run's strata_bench JSON: cells measured cheapest first, by the time the run spent in each")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="stop within S seconds: a cell that would end past them is given up, with every cell after it")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("recheck.py: no strata_bench command after --", file=sys.stderr)
        return 2
    if bool(args.reference_bench) != bool(args.reference_out):
        print("recheck.py: --reference-bench and --reference-out go together", file=sys.stderr)
        return 2
    if args.reference_out and os.path.abspath(args.reference_out) == os.path.abspath(args.out):
        print(f"recheck.py: --reference-out={args.reference_out} is --out too: the reference's rows would replace "
              f"this code's", file=sys.stderr)
        return 2
    rounds = args.rounds if args.rounds is not None else (4 if args.reference_bench else 1)
    if rounds < 1:
        print(f"recheck.py: --rounds={rounds}: at least 1", file=sys.stderr)
        return 2
    if args.budget_s is not None and not args.budget_s >= 0:
        print(f"recheck.py: --budget-s={args.budget_s}: seconds, 0 or more", file=sys.stderr)
        return 2
    if args.reference_bench and not os.access(args.reference_bench, os.X_OK):
        print(f"recheck.py: --reference-bench={args.reference_bench}: not an executable file", file=sys.stderr)
        return 2
    try:
        with open(args.cells) as f:
            cells = [line.strip() for line in f if line.strip()]
    except OSError as e:
        print(f"recheck.py: --cells={args.cells}: {e.strerror}", file=sys.stderr)
        return 2
    if args.order_by:
        try:
            spent = run_seconds(args.order_by)
        except ValueError as e:
            print(f"recheck.py: {e}", file=sys.stderr)
            return 2
        # Cells the run does not name go last, in their listed order (sorted() is stable).
        cells = sorted(cells, key=lambda c: (c not in spent, spent.get(c, 0.0)))
    outs = [args.out] + ([args.reference_out] if args.reference_out else [])
    for path in outs:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # (command, merged file) for this code and, with --reference-bench, the baseline's code.
    sides = {"this code": [command, None]}
    if args.reference_bench:  # first in a cell's first round
        sides = {"reference": [[args.reference_bench] + command[1:], None], **sides}

    def write():  # every finished cell so far; at the start, none
        for side, path in zip(("this code", "reference"), outs):
            doc = sides[side][1] or {"context": {}, "benchmarks": []}
            if side == "reference":
                doc["context"]["strata_reference"] = args.reference_label or args.reference_bench
                if args.reference_commit:  # else none: the gate pairs no reference of an unnamed commit
                    doc["context"]["strata_commit"] = args.reference_commit
            write_json(path, doc)

    status = 0
    if not cells:
        print("recheck.py: no cells listed; nothing to measure again")
    elif len(cells) > args.max_cells:
        print(f"recheck.py: {len(cells)} cells failed on time, more than --max-cells={args.max_cells}: not measured "
              f"again (a slowdown that broad is not one cell's noise); the run's reading stands")
        cells, status = [], 1
    write()
    start = time.time()
    processes = rounds * len(sides)
    longest = 0.0  # the longest process so far, of any cell

    def fits(count, each):  # whether `count` more processes of `each` seconds end within the budget
        return args.budget_s is None or time.time() - start + count * each <= args.budget_s

    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(cells, 1):
            if args.budget_s is not None and (time.time() - start >= args.budget_s or not fits(1, longest)):
                print(f"recheck.py: --budget-s={args.budget_s:g} spent, or too little of it left for one process "
                      f"(~{longest:.0f} s): not measured again, keeping their failure: " + ", ".join(cells[i - 1:]),
                      flush=True)
                status = 1
                break
            try:
                cell_args = cell_arguments(name)
            except ValueError as e:
                print(f"recheck.py: [{i}/{len(cells)}] {e}; it keeps its failure")
                status = 1
                continue
            kept = {side: [] for side in sides}  # (rows, context) of each process, written once the cell ends
            done, cell_longest, given_up = 0, 0.0, False
            for r in range(rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for side in order:
                    which = "" if side == "this code" else "-reference"
                    suffix = f"-{i}{which}" + (f"-{r + 1}" if rounds > 1 else "")
                    tag = f"[{i}/{len(cells)}]"
                    if len(sides) > 1 or rounds > 1:
                        tag += f" round {r + 1}/{rounds}, {side}:"
                    began = time.time()
                    rows, context, ok = run_cell(sides[side][0], name, cell_args,
                                                 os.path.join(tmp, f"cell{suffix}.json"),
                                                 os.path.splitext(args.out)[0] + f"{suffix}.txt", tag)
                    if not ok:
                        status = 1
                    if rows is not None:
                        for row in rows:
                            row["recheck_process"] = r + 1
                        kept[side].append((rows, context))
                    done += 1
                    cell_longest = max(cell_longest, time.time() - began)
                    longest = max(longest, cell_longest)
                    if done < processes and not fits(processes - done, cell_longest):
                        ends = time.time() - start + (processes - done) * cell_longest
                        print(f"recheck.py: [{i}/{len(cells)}] {name}: its {processes - done} remaining processes "
                              f"(~{cell_longest:.0f} s each) would end at ~{ends:.0f} s, past --budget-s="
                              f"{args.budget_s:g}: given up, keeping its failure, and not measured again either: "
                              f"{', '.join(cells[i:]) or 'no other cell'}", flush=True)
                        given_up = True
                        break
                if given_up:
                    break
            if given_up:
                status = 1
                break
            for side in sides:
                for rows, context in kept[side]:
                    if sides[side][1] is None:
                        sides[side][1] = {"context": context, "benchmarks": []}
                    sides[side][1]["benchmarks"] += rows
            write()
    return status


if __name__ == "__main__":
    sys.exit(main())
