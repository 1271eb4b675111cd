#!/usr/bin/env python3
"""Regression gate: compares a strata_bench JSON run with the stored baseline for the same machine
(reports/baselines/<gpu>[-x<count>].json). Exit 1 on any failure, naming each.

A cell fails when
- its throughput (median items/s over the run's repetitions) dropped by more than its threshold,
  threshold = min(--max-drop, max(--min-drop, --spread-multiple x the baseline's relative spread
  (max - min) / median over its repetitions)), so a noisy cell gets room that its recorded
  measurements justify and a steady one is held tightly; the run under test cannot widen its own
  threshold by being noisy, and no cell is let go by more than --max-drop (a baseline that noisy is
  listed: record it with more repetitions) unless a slower-dispatching host lowers its bar (below,
  at most --max-dispatch-drop). bench/METRICS.md says how the constants were set;
- it keeps its optimizer on the host (counter optimizer_on_host = 1): its device-side time
  (fwd_bwd_ms) is gated by the rule above, and on hosts of the same class (CPU model and cores,
  and measured host triads within 10%) its whole step may drop at most --host-step-drop, since the
  host's memory bandwidth, which moved a host pass of unchanged code by 16% between two cells of
  one run, sets the rest; across host classes the step is not gated. A host-bound cell whose
  forward waits for host updates (counter fetches_behind_host_updates > 0: updates deferred into
  the next step) has no device-side time: on one host class only its step is gated, across host
  classes only its memory (listed);
- (both rules above) where both runs measured the host's dispatch speed (counter host_dispatch_us
  and the context's probe of that name; a run's reading for a cell is the median of its cells'
  probes under that cell's precision policy, else the context's) and how much the cell's span
  slows when every operator takes one probe's time longer on the host (counters dispatch_slowdown,
  dispatch_slowdown_fwd_bwd; D, the smaller of the two runs'), and this run's host dispatches
  slower by more than DISPATCH_TOLERANCE: with s = dispatch now / dispatch then - 1 -
  DISPATCH_TOLERANCE, the bar is lowered by what that explains, the expected ratio being
  1 / (1 + D x s), and the allowed drop is at most --max-dispatch-drop. A step of many small
  kernels (gpt-medium in bf16) runs at the host's speed: with unchanged code on their path such
  cells ran 0.61-0.87 x as fast on two later hosts as on the baseline's, and PyTorch's own bf16
  gpt-medium steps 0.58-0.81 x (bench/notes/gate-dispatch.md); a step bound by its device has D near 0 and keeps
  its bar. A faster host never raises a bar; the run then notes that the baseline's host was the
  slower;
- the peak allocated memory of any of its devices rose more than --memory-rise; a pipeline cell
  in a low-precision policy whose ranks share a device, each on its own host thread (counter
  ranks_share_a_device = 1, cell named [precision=bf16] or fp16), is allowed
  --shared-device-memory-rise: such cells' peaks moved by 10-11% between two hosts on unchanged
  code (up to 15% with the code of the day), probably with how the threads interleave (fp32 twins
  stayed within 1.1%; bench/notes/pipeline-shared-device-peaks.md).
  Its micro-batches in flight (counter peak_in_flight, which the schedule alone decides) may not
  rise at all where both runs report them;
- it ran in the baseline and is missing now, failed parity, errored, or ran out of memory now;
- the baseline cell itself failed (other than out of memory): such a baseline protects nothing,
  and must be re-recorded.
A cell out of memory in both runs passes; a cell new in this run is listed and not gated.

A cell that failed only on time (throughput or device time; not memory, errors or a missing cell)
may be measured again, in a process of its own (ci/recheck.py; --recheck-list names such cells):
with --recheck FILE, such a cell passes when all its time checks pass on FILE's repetitions (the
dispatch allowance the run's; not where FILE's host class
differs from the run's), and the gate prints both readings. With --recheck-reference REF as well
(the same cells run by a strata_bench built from the baseline's own commit, alternating with this
code's processes on the run's host: ci/recheck.py --reference-bench), a cell found in both, in at
least PAIR_MIN_PROCESSES processes a side, is gated on its ratio to the baseline's code instead:
whatever the host's speed, it weighs on both sides of that ratio, so no dispatch allowance applies.
It fails where that ratio is below the bar of the committed baseline's spread and its processes are
slower than the reference's beyond chance (one-sided Mann-Whitney over the processes' medians, p <=
PAIR_ALPHA): processes of one binary on one host differ by more than the repetitions inside one.
That answers "code or host" on a host of any speed, where a probe of the host only predicts it
(bench/notes/gate-recheck.md). --recheck-list names none where a
failure of another kind stands. Work beside a cell only slows it, and on unchanged code two cells of
one gate run read 0.854 and 0.849 x their baseline while the same cells, run again on the same host
minutes later in short invocations of their own, read 1.05 and 1.26 x (bench/notes/gate-recheck.md).
A regression in the code reads slow in both.

With --promote PATH, a run that passes becomes the baseline (written to PATH, whole or not at all),
unless: its context names no clean strata_commit (a later gate could not build its code to pair
with); a cell passed only on a second reading or a pair (its failing first reading would become
its bar); or, for a precision policy in both runs, its host dispatches slower than the baseline's by
more than DISPATCH_TOLERANCE, or did not measure it where the baseline did (its launch-bound cells'
bars would drop to that host's speed for every faster host after it; --promote-slower-host writes
it anyway). It then exits 3 and leaves PATH as it was.

  python3 ci/gate.py CURRENT.json reports/baselines/nvidia-h200.json
  python3 ci/gate.py CURRENT.json BASELINE --recheck-list CELLS.txt   # then ci/recheck.py, then:
  python3 ci/gate.py CURRENT.json BASELINE --recheck RECHECK.json [--recheck-reference REFERENCE.json]
  python3 ci/gate.py CURRENT.json reports/baselines/nvidia-h200.json --promote reports/baselines/nvidia-h200.json
"""
import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys


def cell_name(name):
    return re.sub(r"/iterations:\d+|/manual_time|/real_time|/repeats:\d+|_(mean|median|stddev|cv)$", "", name)


def load(path):
    """{cell: {"reps": [iteration rows], "error": message or None}} and the run's context."""
    with open(path) as f:
        doc = json.load(f)
    cells = {}
    for b in doc.get("benchmarks", []):
        if b.get("run_type") == "aggregate":
            continue
        c = cells.setdefault(cell_name(b["name"]), {"reps": [], "error": None})
        if b.get("error_occurred"):
            c["error"] = b.get("error_message", "error")
        else:
            c["reps"].append(b)
    return cells, doc.get("context", {})


def is_oom(message):
    return message is not None and message.startswith("out of memory")


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def spread(rows, key):
    values = [r[key] for r in rows]
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m else 0.0


def peaks(rows):
    """Largest peak per device over the repetitions (the single-device counter under 'all')."""
    out = {}
    for r in rows:
        for k, v in r.items():
            if k == "peak_allocated_bytes" or k.startswith("peak_allocated_bytes."):
                out[k] = max(out.get(k, 0.0), v)
    return out


def low_precision(cell):
    """A cell run under a bf16 or fp16 policy (its name carries [..precision=P..] unless P is fp32)."""
    m = re.search(r"precision=(\w+)", cell)
    return m is not None and m.group(1) != "fp32"


# Hosts that report the same CPU model and core count were measured at 59.8, 79.8 and 88.8 GB/s of
# host triad on one day (bench/notes/gate-thresholds.md): the model string alone does not decide a host-bound cell.
HOST_TRIAD_TOLERANCE = 0.10


def host_class(context, cells):
    triad = float(context.get("host_triad_GBps", 0) or 0)
    us = {p: dispatch_us(cells, context, p) for p in sorted({precision_of(n) for n in cells})}
    shown = ", ".join(f"{u:.2f} us ({p})" for p, u in us.items() if u > 0)
    return (context.get("host_cpu", "unknown") + (f", triad {triad:.1f} GB/s" if triad > 0 else "")
            + (f", dispatch {shown} an operator" if shown else ""))


def same_host_class(a, b):
    """The same CPU model and core count, and (where both runs measured it) host triads within
    HOST_TRIAD_TOLERANCE of each other."""
    cpu_a, cpu_b = a.get("host_cpu", "unknown"), b.get("host_cpu", "unknown")
    if cpu_a != cpu_b or cpu_a == "unknown":
        return False
    ta, tb = float(a.get("host_triad_GBps", 0) or 0), float(b.get("host_triad_GBps", 0) or 0)
    return not (ta > 0 and tb > 0 and abs(ta - tb) / max(ta, tb) > HOST_TRIAD_TOLERANCE)


# A slower reading counts only beyond this, and a faster one by more than this is noted (the bars
# of cells bound by dispatching were then set on a slower host than this one). Three invocations
# on one H200 host minutes apart read 4.02-4.03 us as their medians (bench/notes/gate-dispatch.md);
# one gate run's half on that host read 5.13, a slow spell that
# no tolerance covers and the second reading of a failing cell does.
DISPATCH_TOLERANCE = 0.10


def precision_of(name):
    """The precision policy a cell ran under, as its name says (fp32 where it says none)."""
    m = re.search(r"[\[;]precision=([^;\]]+)", name)
    return m.group(1) if m else "fp32"


def dispatch_us(cells, context, precision="fp32"):
    """A run's dispatch time per operator for its cells of one precision policy: the median of their
    probes (each measured as its cell starts), else the context's probe (measured before the first
    cell), else 0. By policy, since the halves of a gate run are two invocations that may run apart
    (the baseline's ran on two hosts). The median, since it predicted the ratios of launch-bound
    cells to their baseline better than the fastest reading over the runs kept with probes (three
    H200 hosts; median error 7.5% against 14.9%), mostly through one slow host, whose two fast
    readings made the fastest predict 0.82-0.87 x where its cells ran at 0.63-0.72 x (bench/notes/gate-dispatch.md,
    "The gate's dispatch reading, chosen by what it predicts", with its caveats)."""
    readings = [c["reps"][0].get("host_dispatch_us", 0) for n, c in cells.items()
                if c["reps"] and precision_of(n) == precision]
    readings = [us for us in readings if us > 0]
    if readings:
        return statistics.median(readings)
    return float(context.get("host_dispatch_us", 0) or 0)


def dispatch_allowance(base_rows, now_rows, key, now_us, base_us):
    """(expected ratio, D, s): the speed ratio the host's slower dispatching alone would give the
    gated span (1.0 where it cannot tell or the host is not slower beyond DISPATCH_TOLERANCE), the
    span's measured slowdown under one probe's delay an operator (the smaller of the two runs'), and
    how much slower this host dispatches beyond that tolerance."""
    counter = "dispatch_slowdown_fwd_bwd" if key == "fwd_bwd_ms" else "dispatch_slowdown"
    if now_us <= 0 or base_us <= 0 or not all(counter in r for r in base_rows):
        return 1.0, None, None
    sensitivity = max(0.0, median(base_rows, counter))
    if now_rows and all(counter in r for r in now_rows):  # a run that sped up its dispatching says so too
        sensitivity = min(sensitivity, max(0.0, median(now_rows, counter)))
    slowdown = now_us / base_us - 1.0 - DISPATCH_TOLERANCE
    return (1.0 / (1.0 + sensitivity * slowdown) if slowdown > 0 else 1.0), sensitivity, slowdown


# One time check of a cell: the counter, this run's ratio to the baseline (> 1 is faster), the
# allowed drop, this run's repetitions (as shown), the failure's message, and whether it failed.
Check = collections.namedtuple("Check", "key ratio threshold reps message failed")


def time_checks(name, base_rows, now_rows, checks, now_us, base_us, args, notes, noise_rows=None,
                against="the baseline"):
    """One cell's time checks, as a list of Check: `now_rows` over `base_rows`, the thresholds from
    the spread of `noise_rows` (default `base_rows`: the committed baseline's, so that a run noisy in
    itself cannot widen its own bar)."""
    out = []
    noise_rows = base_rows if noise_rows is None else noise_rows
    for key, fixed in checks:
        b, n = median(base_rows, key), median(now_rows, key)
        ratio = n / b if key == "items_per_second" else b / n  # > 1 is faster either way
        noise = spread(noise_rows, key)
        expected, sensitivity, slowdown = dispatch_allowance(base_rows, now_rows, key, now_us, base_us)
        if fixed is not None:
            threshold = fixed
            why = "a host-bound step: its host pass moves with the host's memory bandwidth"
        else:
            threshold = min(args.max_drop, max(args.min_drop, args.spread_multiple * noise))
            why = f"baseline spread {noise:.1%} over {len(noise_rows)} repetitions"
            if args.spread_multiple * noise > args.max_drop:
                notes.append(f"{name}: its baseline's spread ({noise:.1%} over {len(noise_rows)} repetitions) would "
                             f"allow a {args.spread_multiple * noise:.1%} drop; held at {args.max_drop:.0%} (record it "
                             f"with more repetitions)")
        if expected < 1.0:
            why += (f"; the host dispatches {slowdown:.0%} slower beyond the probe's tolerance and the span "
                    f"slowed {sensitivity:.0%} under one probe's delay an operator, so {expected:.3f} x is "
                    f"expected (at most {args.max_dispatch_drop:.0%} allowed)")
            notes.append(f"{name}: {key} expected at {expected:.3f} x the baseline: this host dispatches "
                         f"{slowdown:.0%} slower beyond the probe's tolerance, and the span slowed "
                         f"{sensitivity:.0%} when each operator took one probe's time longer")
            threshold = min(args.max_dispatch_drop, 1.0 - expected * (1.0 - threshold))
        what = "throughput" if key == "items_per_second" else "device time (fwd+bwd)"
        message = f"{name}: {what} {ratio:.3f} x {against} (allowed drop {threshold:.1%}: {why})"
        out.append(Check(key, ratio, threshold, len(now_rows), message, ratio < 1.0 - threshold))
    return out


def second_reading(name, outcome, again, base_rows, checks, now_us, base_us, args, notes):
    """The time checks of a cell measured again (`again`: its cell in the --recheck file) in place of
    `outcome`, the run's, where the second reading passes them all; `outcome` otherwise. A second
    reading is allowed the run's dispatch reading, no more: its process's own few probes would read
    a host whose state the second reading is there to get away from."""
    if again["error"] is not None or not again["reps"]:
        notes.append(f"{name}: measured again, it did not run ({(again['error'] or 'no repetitions')[:120]})")
        return outcome
    again_notes = []
    second = time_checks(name, base_rows, again["reps"], checks, now_us, base_us, args, again_notes)
    notes += [f"(measured again) {n}" for n in again_notes if "expected at" in n]
    first = ", ".join(f"{c.key} {c.ratio:.3f} x" for c in outcome)
    then = ", ".join(f"{c.key} {c.ratio:.3f} x" for c in second)
    if any(c.failed for c in second):
        notes.append(f"{name}: measured again in a process of its own, it failed again ({then}; in the run {first})")
        return outcome
    notes.append(f"{name}: failed on time in the run ({first}), passed when measured again in a process of its own "
                 f"({then}); the second reading is gated")
    return [c._replace(reps=f"{c.reps} again") for c in second]


# A cell measured beside the baseline's own code fails only where its processes are slower than the
# reference's beyond chance at this level (one-sided Mann-Whitney over the processes' medians):
# processes of one binary on one H200 host read up to 26% apart where repetitions within one read a
# few % (bench/notes/gate-recheck.md), so the repetitions' spread
# does not say what a difference between processes means.
PAIR_ALPHA = 0.05
PAIR_MIN_PROCESSES = 3  # a side: 3 and 3 at best give 1/20 = PAIR_ALPHA, fewer on either side give more


def process_values(rows, key):
    """The median of `key` over each process's rows (counter recheck_process). Rows without it
    count as one process: which rows shared a process is not known, and counting each as its own
    would take the repetitions' small spread for the processes' larger one."""
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r.get("recheck_process", 0)].append(r[key])
    return [statistics.median(v) for v in groups.values()]


def slower_p(code, reference, higher_is_faster):
    """One-sided p of code's values being slower than reference's (Mann-Whitney U, exact where the
    arrangements are few enough to count, else its normal approximation)."""
    def u(a, b):  # pairs in which a value of `a` is the slower, ties half
        return sum(1.0 if (x < y if higher_is_faster else x > y) else 0.5 if x == y else 0.0 for x in a for y in b)
    observed, pooled, n = u(code, reference), code + reference, len(code)
    if math.comb(len(pooled), n) <= 200000:
        count = total = 0
        for chosen in itertools.combinations(range(len(pooled)), n):
            picked = set(chosen)
            a = [pooled[i] for i in chosen]
            b = [pooled[i] for i in range(len(pooled)) if i not in picked]
            count += u(a, b) >= observed - 1e-9
            total += 1
        return count / total
    m = len(reference)
    mean, sd = n * m / 2.0, math.sqrt(n * m * (n + m + 1) / 12.0)
    return 0.5 * math.erfc((observed - 0.5 - mean) / (sd * math.sqrt(2.0)))


def paired_reading(name, outcome, again, reference, base_rows, checks, args, notes, label):
    """The time checks of a cell measured again beside the baseline's own code on the run's host
    (`reference`: that cell in the --recheck-reference file, `again`: in the --recheck file), in
    place of `outcome`, the run's; `outcome` where either did not run. The code is gated on its
    ratio to the baseline's code measured alternately with it: on one host, at one time, the host's
    speed is in both. No dispatch allowance then (both paid the same dispatching), and the bar is
    the committed baseline's spread rule, so that a noisy host cannot widen it."""
    if again["error"] is not None or not again["reps"]:
        return None  # the second reading's own note says so
    if reference["error"] is not None or not reference["reps"]:
        notes.append(f"{name}: the baseline's code measured beside it did not run "
                     f"({(reference['error'] or 'no repetitions')[:120]})")
        return None
    processes = min(len(process_values(cell["reps"], checks[0][0])) for cell in (again, reference))
    if processes < PAIR_MIN_PROCESSES:
        notes.append(f"{name}: measured beside the baseline's own code in {processes} process(es) a side, fewer than "
                     f"the {PAIR_MIN_PROCESSES} that can show a difference between processes: not paired")
        return None
    paired = time_checks(name, reference["reps"], again["reps"], checks, 0.0, 0.0, args, [], noise_rows=base_rows,
                         against=f"the baseline's own code ({label}) measured beside it on this host")
    unresolved = False  # a check below its bar let go on the processes' spread alone
    for i, c in enumerate(paired):
        code, ref = process_values(again["reps"], c.key), process_values(reference["reps"], c.key)
        p = slower_p(code, ref, c.key == "items_per_second")
        shown = f"its {len(code)} processes against that code's {len(ref)}: p = {p:.3f} that they are slower"
        # However spread the processes, a ratio below the largest drop any bar allows fails: one fast
        # process must not clear a large slowdown.
        floor = 1.0 - max(args.max_drop, c.threshold)
        failed = c.failed and (p <= PAIR_ALPHA or c.ratio < floor)
        if c.failed and not failed:
            unresolved = True
            notes.append(f"{name}: {c.key} {c.ratio:.3f} x the baseline's code measured beside it, below its bar "
                         f"({c.threshold:.1%}), but not beyond the processes' own spread ({shown}; the gate's level "
                         f"{PAIR_ALPHA:g}) and above {floor:.2f} x: not counted as slower at this resolution")
        paired[i] = c._replace(failed=failed, message=f"{c.message}; {shown}"
                               + (f"; below {floor:.2f} x, which no spread excuses" if c.ratio < floor else ""))
    first = ", ".join(f"{c.key} {c.ratio:.3f} x" for c in outcome)
    then = ", ".join(f"{c.key} {c.ratio:.3f} x" for c in paired)
    # The baseline's code here against its own record: the same ratios, for the note.
    record = ", ".join(f"{c.key} {c.ratio:.3f} x"
                       for c in time_checks(name, base_rows, reference["reps"], checks, 0.0, 0.0, args, []))
    if any(c.failed for c in paired):
        notes.append(f"{name}: measured again beside the baseline's own code ({label}) on this host, it is slower "
                     f"than that code ({then}; in the run {first} the baseline): the code, not the host")
    else:
        verdict = ("slower than its bar, but within what its processes' spread can resolve" if unresolved
                   else "the host, not the code")
        notes.append(f"{name}: failed on time in the run ({first} the baseline); measured again beside the "
                     f"baseline's own code ({label}) on this host it ran at {then} that code, which itself read "
                     f"{record} its recorded figures here: {verdict}; the paired reading is gated")
    return [c._replace(reps=f"{c.reps} paired") for c in paired]


def compare(now_cells, now_ctx, base_cells, base_ctx, args, recheck_cells=None, recheck_ctx=None,
            reference_cells=None, reference_ctx=None):
    """(failures, notes, table, same host class, cells that failed on time and on nothing else, cells
    whose first reading failed and that were then gated on a second reading or a pair, whatever it
    said)."""
    failures, notes, table = [], [], []
    rescued = set()
    time_failed, other_failed = set(), set()  # cells; other_failed: any failure but on time
    same_host = same_host_class(now_ctx, base_ctx)
    precisions = sorted({precision_of(n) for n in base_cells} & {precision_of(n) for n in now_cells})
    now_dispatch = {p: dispatch_us(now_cells, now_ctx, p) for p in precisions}
    base_dispatch = {p: dispatch_us(base_cells, base_ctx, p) for p in precisions}
    # A second reading is taken on the run's host (ci/gpu.sh measures it in the same job); one from
    # a host of another class than the run's is not used.
    again_same_host = same_host_class(recheck_ctx or {}, now_ctx) if recheck_cells else True
    label = (reference_ctx or {}).get("strata_reference") or "its commit"
    # Why a --recheck-reference file is not paired at all, or "". The pair ran alternately in one
    # job: the CPU model must match, not the triads, which moved from 64.6 to 81.1 GB/s between two
    # processes on one H200 host minutes apart (bench/notes/gate-recheck.md
    # ). And the reference must be the commit the baseline names: any other code (the run's
    # own, say) would make the ratio say nothing about the baseline.
    pair_refused = ""
    if reference_cells is not None:
        ref_cpu, again_cpu = (reference_ctx or {}).get("host_cpu", "unknown"), (recheck_ctx or {}).get("host_cpu", "?")
        ref_commit, base_commit = (reference_ctx or {}).get("strata_commit", ""), base_ctx.get("strata_commit", "")
        if ref_cpu != again_cpu:
            pair_refused = f"the baseline's code ran on another CPU ({ref_cpu} against {again_cpu})"
        elif not base_commit or ref_commit != base_commit:
            pair_refused = (f"the code measured beside it is commit '{ref_commit or 'unnamed'}', the baseline's is "
                            f"'{base_commit or 'unnamed'}'")
    for name, base in sorted(base_cells.items()):
        now = now_cells.get(name)
        if base["error"] is not None and not is_oom(base["error"]):
            failures.append(f"{name}: the baseline cell failed ({base['error'][:120]}); re-record the baseline")
            other_failed.add(name)
            continue
        if now is None:
            failures.append(f"{name}: in the baseline but not in this run")
            other_failed.add(name)
            continue
        if is_oom(base["error"]):
            if now["error"] is None:
                notes.append(f"{name}: out of memory in the baseline, runs now (re-record the baseline to gate it)")
            elif not is_oom(now["error"]):
                failures.append(f"{name}: {now['error'][:200]}")
                other_failed.add(name)
            continue
        if now["error"] is not None:
            failures.append(f"{name}: {now['error'][:200]}")
            other_failed.add(name)
            continue
        rows = base["reps"] + now["reps"]
        host_bound = any(r.get("optimizer_on_host") for r in rows)
        waits_for_host = any(r.get("fetches_behind_host_updates", 0) > 0 for r in rows)
        # (counter, fixed allowed drop or None for the spread rule)
        if not host_bound:
            checks = [("items_per_second", None)]
        else:
            checks = [] if waits_for_host else [("fwd_bwd_ms", None)]
            if same_host:
                checks.append(("items_per_second", args.host_step_drop))
            elif waits_for_host:
                notes.append(f"{name}: its forward waits for host updates (fetches_behind_host_updates > 0) and the host "
                             f"classes differ: no time of it is comparable, only its memory is gated")
        own = []  # failures of the cell's own making: memory, micro-batches in flight
        shared = any(r.get("ranks_share_a_device") for r in rows) and low_precision(name)
        allowed = args.shared_device_memory_rise if shared else args.memory_rise
        in_flight = [max((r["peak_in_flight"] for r in side if "peak_in_flight" in r), default=None)
                     for side in (base["reps"], now["reps"])]
        if shared and None not in in_flight and in_flight[1] > in_flight[0]:
            own.append(f"{name}: micro-batches in flight rose from {in_flight[0]:.0f} to {in_flight[1]:.0f} "
                       f"(the schedule's; none allowed)")
        pb, pn = peaks(base["reps"]), peaks(now["reps"])
        for dev, bytes_base in sorted(pb.items()):
            if dev not in pn:
                own.append(f"{name}: {dev} is missing in this run")
                continue
            rise = pn[dev] / bytes_base if bytes_base else 1.0
            if rise > 1.0 + allowed:
                own.append(f"{name}: {dev} {rise:.3f} x the baseline "
                           f"({pn[dev] / 2**30:.2f} GiB vs {bytes_base / 2**30:.2f}; allowed rise {allowed:.0%}"
                           f"{': ranks share a device' if allowed != args.memory_rise else ''})")
        now_us, base_us = now_dispatch.get(precision_of(name), 0.0), base_dispatch.get(precision_of(name), 0.0)
        outcome = time_checks(name, base["reps"], now["reps"], checks, now_us, base_us, args, notes)
        again = (recheck_cells or {}).get(name)
        if again is not None and any(c.failed for c in outcome):
            reference = (reference_cells or {}).get(name)
            if own:
                notes.append(f"{name}: its second reading is not used: the cell failed on more than time")
            else:
                paired = None
                if reference is not None and pair_refused:
                    notes.append(f"{name}: not paired: {pair_refused}")
                elif reference is not None:
                    paired = paired_reading(name, outcome, again, reference, base["reps"], checks, args, notes, label)
                elif reference_cells is not None:
                    notes.append(f"{name}: the baseline's own code was not measured beside it")
                if paired is not None:
                    outcome = paired
                    rescued.add(name)
                elif not again_same_host:
                    notes.append(f"{name}: its second reading is not used: it ran on a host of another class than "
                                 f"the run's")
                else:
                    outcome = second_reading(name, outcome, again, base["reps"], checks, now_us, base_us, args, notes)
                    rescued.add(name)
        for c in outcome:
            table.append((name, c.key, c.ratio, c.threshold, c.reps, len(base["reps"])))
            if c.failed:
                failures.append(c.message)
                time_failed.add(name)
        failures += own
        if own:
            other_failed.add(name)
    for name in sorted(set(now_cells) - set(base_cells)):
        notes.append(f"{name}: new in this run, not gated")
    for p in precisions:
        now_us, base_us = now_dispatch[p], base_dispatch[p]
        if now_us > 0 and base_us > 0 and now_us < (1.0 - DISPATCH_TOLERANCE) * base_us:
            notes.append(f"this host dispatches operators {1.0 - now_us / base_us:.0%} faster than the baseline's in the "
                         f"{p} cells ({now_us:.2f} against {base_us:.2f} us): the bars of cells bound by dispatching "
                         f"were set on the slower host (re-record the baseline here to hold them tighter)")
    # What a second reading could clear: cells that failed on time alone, and none where any other
    # failure stands (the gate fails then whatever the second readings say).
    clearable = sorted(time_failed - other_failed) if not other_failed else []
    return failures, notes, table, same_host, clearable, sorted(rescued)


def promotion_refusal(now_cells, now_ctx, base_cells, base_ctx, rescued, slower_host_ok):
    """Why a run that passed the gate may not become the baseline (--promote), or None. A baseline's
    readings become every later run's bars, so it must be one run's readings that passed as they
    are, on a host not slower at dispatching than the baseline's, and it must name its code."""
    commit = str(now_ctx.get("strata_commit", "") or "")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return (f"its context's strata_commit is '{commit or 'missing'}', not a clean commit: a baseline names "
                f"the code that measured it, so that a later gate can build that code and measure beside it")
    if rescued:
        shown = ", ".join(rescued[:4]) + (f" and {len(rescued) - 4} more" if len(rescued) > 4 else "")
        return (f"{len(rescued)} cell(s) passed only on a second reading, their first readings failing ({shown}): "
                f"as a baseline those first readings would lower their bars; measure the run again")
    if slower_host_ok:
        return None
    for p in sorted({precision_of(n) for n in now_cells} & {precision_of(n) for n in base_cells}):
        now_us, base_us = dispatch_us(now_cells, now_ctx, p), dispatch_us(base_cells, base_ctx, p)
        if base_us > 0 and now_us <= 0:
            return (f"the baseline measured its host's dispatch speed in the {p} cells ({base_us:.2f} us) and this "
                    f"run did not, so it cannot tell whether this host is slower (--promote-slower-host: write it "
                    f"anyway)")
        if base_us > 0 and now_us > (1.0 + DISPATCH_TOLERANCE) * base_us:
            return (f"this host dispatches {p} operators at {now_us:.2f} us against the baseline's {base_us:.2f} "
                    f"(slower by more than {DISPATCH_TOLERANCE:.0%}): the bars of cells bound by dispatching would "
                    f"drop to this host's speed for every faster host after it (--promote-slower-host: write it "
                    f"anyway)")
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("current")
    ap.add_argument("baseline")
    ap.add_argument("--min-drop", type=float, default=0.06, help="smallest allowed throughput drop (default 6%%)")
    ap.add_argument("--spread-multiple", type=float, default=2.0,
                    help="threshold = this x the baseline's relative spread over its repetitions (default 2)")
    ap.add_argument("--max-drop", type=float, default=0.25,
                    help="largest allowed throughput drop, however noisy the baseline (default 25%%)")
    ap.add_argument("--host-step-drop", type=float, default=0.25,
                    help="allowed throughput drop of a host-bound cell's whole step on the same host class (default "
                         "25%%: unchanged host code moved 16%% between two cells of one run, bench/notes/gate-thresholds.md); its "
                         "device time keeps the spread rule")
    ap.add_argument("--max-dispatch-drop", type=float, default=0.50,
                    help="largest allowed drop of a cell whose bar a slower-dispatching host lowered (default 50%%: "
                         "PyTorch's own bf16 gpt-medium checkpointed step ran 0.58 x as fast on later hosts)")
    ap.add_argument("--memory-rise", type=float, default=0.03, help="allowed rise of any device's peak (default 3%%)")
    ap.add_argument("--shared-device-memory-rise", type=float, default=0.20,
                    help="allowed rise of the allocator's peak for bf16/fp16 pipeline cells whose ranks share a "
                         "device (default 20%%: unchanged code moved 10-11%% between two hosts, bench/notes/pipeline-shared-device-peaks.md)")
    ap.add_argument("--no-compare", action="store_true", help="skip Google Benchmark's compare.py display")
    ap.add_argument("--recheck", metavar="FILE",
                    help="a strata_bench JSON of cells measured again (ci/recheck.py): a cell that failed on time alone "
                         "passes if its time checks pass on this file's repetitions")
    ap.add_argument("--recheck-reference", metavar="FILE",
                    help="with --recheck: the same cells run by a strata_bench built from the baseline's commit, "
                         "alternating with this code on the run's host (ci/recheck.py --reference-bench); a cell "
                         "found in both is gated on its ratio to that code instead")
    ap.add_argument("--recheck-list", metavar="PATH",
                    help="write the cells that failed on time and on nothing else, one a line; empty if none, or if "
                         "any other failure stands (the gate fails then whatever a second reading says)")
    ap.add_argument("--promote", metavar="PATH",
                    help="where the gate passes: write CURRENT to PATH (usually BASELINE itself) as the new baseline, "
                         "unless its strata_commit is not a clean commit's 40 hex digits, a cell passed only through "
                         "a second reading or a pair, or its host dispatches slower than the baseline's beyond the "
                         "tolerance or did not measure it where the baseline did (exit 3 then, nothing written)")
    ap.add_argument("--promote-slower-host", action="store_true",
                    help="with --promote: write it although this host dispatches slower than the baseline's")
    args = ap.parse_args(argv)
    if args.promote_slower_host and not args.promote:
        ap.error("--promote-slower-host goes with --promote")
    now_cells, now_ctx = load(args.current)
    base_cells, base_ctx = load(args.baseline)
    recheck_cells, recheck_ctx = load(args.recheck) if args.recheck else (None, None)
    if args.recheck_reference and not args.recheck:
        ap.error("--recheck-reference goes with --recheck")
    reference_cells, reference_ctx = load(args.recheck_reference) if args.recheck_reference else (None, None)
    failures, notes, table, same_host, time_only, rescued = compare(now_cells, now_ctx, base_cells, base_ctx, args,
                                                           recheck_cells, recheck_ctx, reference_cells, reference_ctx)
    if args.recheck_list:
        with open(args.recheck_list, "w") as f:
            f.writelines(name + "\n" for name in time_only)
    print(f"host CPU now: {host_class(now_ctx, now_cells)}; baseline: {host_class(base_ctx, base_cells)}"
          f"{'' if same_host else ' (differ: host-bound cells gated on device time only)'}")
    print(f"{'cell':70s} {'gated on':>16s} {'ratio':>7s} {'allowed':>8s} {'reps':>15s}")
    for name, key, ratio, threshold, reps_now, reps_base in table:  # "N again": the reading measured again
        print(f"{name:70s} {key:>16s} {ratio:7.3f} {-threshold:8.1%} {reps_now:>10}/{reps_base:<4d}")
    for n in notes:
        print("note: " + n)
    tool = os.environ.get("BENCHMARK_COMPARE")
    if tool and os.path.exists(tool) and not args.no_compare:
        # Google Benchmark's own view of the time columns, with its U-test where both runs repeat.
        subprocess.run([sys.executable, tool, "--no-color", "benchmarks", args.baseline, args.current], check=False)
    if failures:
        print("\ngate: FAIL")
        for f in failures:
            print("  " + f)
        return 1
    print(f"\ngate: PASS ({len({row[0] for row in table})} cells gated; throughput drop allowed min({args.max_drop:.0%}, "
          f"max({args.min_drop:.0%}, {args.spread_multiple:g} x the baseline's spread)), {args.host_step_drop:.0%} for a "
          f"host-bound cell's whole step, at most {args.max_dispatch_drop:.0%} where a host that dispatches slower "
          f"lowered a bar, any device's peak rise <= {args.memory_rise:.0%}, "
          f"{args.shared_device_memory_rise:.0%} for bf16/fp16 pipelines whose ranks share a device)")
    if args.promote:
        why = promotion_refusal(now_cells, now_ctx, base_cells, base_ctx, rescued, args.promote_slower_host)
        if why:
            print(f"promote: refused, {args.promote} left as it was: {why}")
            return 3
        # Whole or not at all: a copy beside the target, then renamed over it; none left on failure.
        partial = args.promote + ".partial"
        try:
            shutil.copyfile(args.current, partial)
            os.replace(partial, args.promote)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(partial)
            print(f"promote: could not write {args.promote}: {e}")
            return 3
        print(f"promote: {args.current} written to {args.promote} (strata_commit {now_ctx['strata_commit'][:12]}; "
              f"host {host_class(now_ctx, now_cells)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
