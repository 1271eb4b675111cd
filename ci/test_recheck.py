#!/usr/bin/env python3
"""Self-test of ci/recheck.py: cell names back to strata_bench arguments (options, precision,
preset overrides; cells over several ranks refused), the cap on how many cells are measured again,
a cell the run does not name, the baseline's code run beside each cell in alternating order, each
process's reading printed, the cells taken cheapest first, a budget that gives up a cell and those
after it, the cells finished before a kill kept, and,
given a strata_bench binary, the real thing: cells of a CPU run measured again, each alone (and
paired with the binary standing in for the baseline's code), under the names the gate looks for,
and the gate's --recheck clearing a doctored slow reading with them. Runs in CI (ctest: cpu.recheck_self_test).

  python3 ci/test_recheck.py [STRATA_BENCH]
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate  # noqa: E402
import recheck  # noqa: E402
from test_gate import run_cases  # noqa: E402

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def quiet(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = fn(*args)
    return status, out.getvalue()


@case
def names_become_the_arguments_that_run_the_cell():
    assert recheck.cell_arguments("baseline/gpt-medium") == ["--models=gpt-medium", "--strategies=baseline"]
    assert recheck.cell_arguments("manual_split[precision=bf16]/gpt-medium") == [
        "--models=gpt-medium", "--strategies=manual_split", "--precision=bf16"]
    got = recheck.cell_arguments("hook_offload_overlap[resident=0,1,2,17;resident_updates=device]/gpt-871m")
    assert got == ["--models=gpt-871m", "--strategies=hook_offload_overlap",
                   "--options=resident=0,1,2,17;resident_updates=device"], got
    got = recheck.cell_arguments("manual_split[classifier_shards=2;devices=cuda:0,cuda:1]/bert-base-6m[batch=8;classes=8250000]")
    assert got == ["--models=bert-base-6m", "--strategies=manual_split",
                   "--options=classifier_shards=2;devices=cuda:0,cuda:1", "--batch=8", "--classes=8250000"], got
    assert recheck.cell_arguments("a[precision=bf16,transfer=fp32]/m")[2] == "--precision=bf16,transfer=fp32"


@case
def refuses_what_it_cannot_run_alone():
    for name, why in (("sharded[ranks=2]/gpt-871m", "needs its launcher"), ("no-model", "not a strata_bench cell name"),
                      ("a[oops]/m", "'oops' is not key=value"), ("a/m[depth=3]", "override 'depth'")):
        try:
            recheck.cell_arguments(name)
        except ValueError as e:
            assert why in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name} was accepted")


STUB = r"""#!/usr/bin/env python3
# A strata_bench stand-in: one iteration row per repetition for the cell its arguments name,
# named as strata_bench names it (or STUB_NAME), and its arguments logged.
import json, os, signal, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
shown = []
if "precision" in args: shown.append("precision=" + args["precision"])
shown += args.get("options", "").split(";") if "options" in args else []
name = args["strategies"] + ("[" + ";".join(sorted(shown)) + "]" if shown else "") + "/" + args["models"]
name = os.environ.get("STUB_NAME", name)
slow = dict(p.split("=") for p in filter(None, os.environ.get("STUB_SLEEP", "").split(",")))
if sys.argv[1] != "REF":  # this code's processes only
    slow.update(p.split("=") for p in filter(None, os.environ.get("STUB_SLEEP_THIS", "").split(",")))
time.sleep(float(slow.get(name, 0)))
if os.environ.get("STUB_KILL_PARENT") == name:  # the job's time limit, striking while this cell runs
    os.kill(os.getppid(), signal.SIGKILL)
    sys.exit(1)
rows = [{"name": name + "/iterations:3/manual_time", "run_type": "iteration", "items_per_second": 1000.0,
         "peak_allocated_bytes": 1.0} for _ in range(int(args.get("benchmark_repetitions", "1")))]
text = json.dumps({"context": {"host_cpu": "stub"}, "benchmarks": rows})
if os.environ.get("STUB_TRUNCATE") == name:
    text = text[: len(text) // 2]
open(args["benchmark_out"], "w").write(text)
"""


def stand_in(d, cells):
    """The stand-in binary and the list of `cells`, written into folder `d`: their paths."""
    stub, listed = os.path.join(d, "strata_bench"), os.path.join(d, "cells.txt")
    with open(stub, "w") as f:
        f.write(STUB)
    os.chmod(stub, 0o755)
    with open(listed, "w") as f:
        f.writelines(c + "\n" for c in cells)
    return stub, listed


def with_stub(cells, extra_env=None, max_cells=None, reference=False, rounds=None, commit="f" * 40, extra=()):
    """recheck.main over `cells` with the stand-in: (status, output, JSON written, stand-in's calls),
    and with `reference` the stand-in again as the baseline's code (its calls marked REF, its JSON
    as the last item)."""
    with tempfile.TemporaryDirectory() as d:
        stub, listed = stand_in(d, cells)
        log, out = os.path.join(d, "log"), os.path.join(d, "out/again.json")
        os.environ["STUB_LOG"] = log
        for k, v in (extra_env or {}).items():
            os.environ[k] = v
        try:
            argv = ["--cells", listed, "--out", out] + (["--max-cells", str(max_cells)] if max_cells is not None else [])
            ref_out = os.path.join(d, "out/reference.json")
            if reference:
                ref = os.path.join(d, "reference")  # the stand-in, its calls marked
                with open(ref, "w") as f:
                    # In place of the command's first word (the stand-in's path) and with REF_NAME as its name.
                    f.write(f'#!/bin/sh\nshift\n[ -n "$REF_NAME" ] && export STUB_NAME="$REF_NAME"\n'
                            f'exec {sys.executable} {stub} REF "$@"\n')
                os.chmod(ref, 0o755)
                argv += ["--reference-bench", ref, "--reference-out", ref_out, "--reference-label", "abc1234"]
                argv += ["--reference-commit", commit] if commit else []
            if rounds is not None:
                argv += ["--rounds", str(rounds)]
            status, text = quiet(recheck.main, argv + list(extra) + ["--", sys.executable, stub,
                                                                     "--benchmark_repetitions=2"])
        finally:
            for k in extra_env or {}:
                del os.environ[k]
        doc = json.load(open(out)) if os.path.exists(out) else None
        calls = open(log).read().splitlines() if os.path.exists(log) else []
        if reference:
            return status, text, doc, calls, (json.load(open(ref_out)) if os.path.exists(ref_out) else None)
        return status, text, doc, calls


@case
def runs_each_cell_in_a_process_of_its_own_and_merges_them():
    cells = ["manual_split[precision=bf16]/gpt-medium", "hook_offload[prefetch=1]/gpt-871m"]
    status, text, doc, calls = with_stub(cells + ["sharded[ranks=2]/gpt-871m"])
    assert status == 1 and "needs its launcher" in text, text  # the launched cell keeps its failure
    assert len(calls) == 2 and "--precision=bf16" in calls[0] and "--options=prefetch=1" in calls[1], calls
    names = [b["name"].split("/iterations")[0] for b in doc["benchmarks"]]
    assert names == [cells[0]] * 2 + [cells[1]] * 2, names
    status, text, doc, calls = with_stub(cells)
    assert status == 0, text


@case
def measures_none_beyond_the_cap_and_flags_a_cell_the_run_did_not_name():
    status, text, doc, calls = with_stub([f"s{i}/m" for i in range(9)])
    assert status == 1 and calls == [] and "more than --max-cells=8" in text, text
    assert doc == {"context": {}, "benchmarks": []}, doc  # written all the same: the gate reads it
    status, text, doc, calls = with_stub(["a/m"], max_cells=0)
    assert status == 1 and calls == [], text
    status, text, doc, calls = with_stub(["a/m"], {"STUB_NAME": "b/m"})
    assert status == 1 and "the run named no such cell" in text and doc["benchmarks"] == [], text
    status, text, doc, calls = with_stub([])
    assert status == 0 and calls == [], text
    # A process that died while writing its JSON: that cell keeps its failure, the next one runs.
    status, text, doc, calls = with_stub(["a/m", "b/m"], {"STUB_TRUNCATE": "a/m"})
    assert status == 1 and "its JSON is unreadable" in text and len(calls) == 2, text
    assert [b["name"].split("/iterations")[0] for b in doc["benchmarks"]] == ["b/m"] * 2, doc
    assert quiet(recheck.main, ["--cells", "/nonexistent", "--out", "/tmp/x.json", "--", "true"])[0] == 2


@case
def runs_the_baselines_code_beside_each_cell_in_alternating_order():
    cells = ["a/m", "b[precision=bf16]/m"]
    status, text, doc, calls, ref = with_stub(cells, reference=True)
    assert status == 0, text
    # Per cell, four rounds: reference, this code, this code, reference, and again; the reference
    # with the same arguments.
    marks = [c.startswith("REF ") for c in calls]
    assert marks == [True, False, False, True] * 4, calls
    same = [" ".join(a for a in c.split() if not a.startswith("--benchmark_out=")) for c in calls[:2]]
    assert same[0] == "REF " + same[1] and "--precision=bf16" in calls[9], calls
    names = [b["name"].split("/iterations")[0] for b in doc["benchmarks"]]
    assert names == ["a/m"] * 8 + ["b[precision=bf16]/m"] * 8, names  # four rounds of two repetitions
    assert [b["name"].split("/iterations")[0] for b in ref["benchmarks"]] == names, ref
    # Each row says which process of its side it came from: the gate compares processes.
    assert [b["recheck_process"] for b in doc["benchmarks"]] == [1, 1, 2, 2, 3, 3, 4, 4] * 2, doc
    assert [b["recheck_process"] for b in ref["benchmarks"]] == [1, 1, 2, 2, 3, 3, 4, 4] * 2, ref
    assert ref["context"]["strata_reference"] == "abc1234", ref["context"]
    assert ref["context"]["strata_commit"] == "f" * 40, ref["context"]
    status, text, doc, calls, ref = with_stub(["a/m"], reference=True, commit="")
    assert "strata_commit" not in ref["context"], ref["context"]  # unnamed: the gate will not pair it
    status, text, doc, calls, ref = with_stub(["a/m"], reference=True, rounds=3)
    assert [c.startswith("REF ") for c in calls] == [True, False, False, True, True, False], calls
    status, text, doc, calls = with_stub(["a/m"])  # alone: one process, as before
    assert len(calls) == 1 and [b["recheck_process"] for b in doc["benchmarks"]] == [1, 1], (calls, doc)
    # A reference that cannot run the cell: its file lacks it, this code's readings stand, exit 1.
    status, text, doc, calls, ref = with_stub(["a/m"], {"REF_NAME": "other/m"}, reference=True)
    assert status == 1 and "the run named no such cell" in text, text
    assert ref["benchmarks"] == [] and len(doc["benchmarks"]) == 8, (ref, doc)
    with tempfile.TemporaryDirectory() as d:
        listed = os.path.join(d, "cells.txt")
        open(listed, "w").write("a/m\n")
        for extra, why in ((["--reference-bench", "/nonexistent", "--reference-out", "x.json"], "not an executable"),
                           (["--reference-bench", sys.executable], "go together"), (["--rounds", "0"], "at least 1"),
                           (["--reference-bench", sys.executable, "--reference-out", os.path.join(d, "o.json")],
                            "is --out too")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                got = recheck.main(["--cells", listed, "--out", os.path.join(d, "o.json")] + extra + ["--", "true"])
            assert got == 2 and why in err.getvalue(), (extra, got, err.getvalue())


def measured(doc):
    """The cells a merged file holds, in order, each once."""
    names = []
    for b in doc["benchmarks"]:
        name = b["name"].split("/iterations")[0]
        if name not in names:
            names.append(name)
    return names


@case
def prints_each_processs_reading_as_it_ends():
    status, text, doc, calls = with_stub(["a/m"])
    assert status == 0 and re.search(r"a/m: exit 0 after \d+ s: items_per_second 1000 \(median of 2\)", text), text


@case
def orders_the_cells_cheapest_first_by_the_runs_time():
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "run.json")
        rows = [("a/m", 30.0, "ms", 5), ("b/m", 2.0, "s", 5), ("c/m", 400.0, "us", 5), ("a/m", 30.0, "ms", 5)]
        json.dump({"benchmarks": [{"name": f"{n}/iterations:{it}/manual_time", "run_type": "iteration", "real_time": t,
                                   "time_unit": u, "iterations": it} for n, t, u, it in rows]
                   + [{"name": "b/m/iterations:5/manual_time_median", "run_type": "aggregate", "real_time": 0.0,
                       "time_unit": "s", "iterations": 5}]}, open(run, "w"))
        status, text, doc, calls = with_stub(["b/m", "x/m", "a/m", "c/m"], extra=["--order-by", run])
        # c: 2 ms in the run, a: 300 ms over two repetitions, b: 10 s; x, not in the run, last.
        assert status == 0 and [c.split("--strategies=")[1].split()[0] for c in calls] == ["c", "a", "b", "x"], calls
        assert measured(doc) == ["c/m", "a/m", "b/m", "x/m"], doc
        status, text, doc, calls = with_stub(["a/m"], extra=["--order-by", os.path.join(d, "none.json")])
        assert status == 2 and calls == [], text


@case
def gives_up_a_cell_that_would_end_past_the_budget_and_those_after_it():
    # The cheap cell's eight processes take well under a second (a loaded machine has room up to
    # 20); the slow one's first process takes 3 s, so its seven others would end past 21 s, beyond
    # the budget of 20: it stops after that one process.
    cells = ["fast/m", "slow/m", "later/m"]
    status, text, doc, calls, ref = with_stub(cells, {"STUB_SLEEP": "slow/m=3"}, reference=True,
                                              extra=["--budget-s", "20"])
    assert status == 1 and "slow/m: its 7 remaining processes (~3 s each) would end at" in text, text
    assert "past --budget-s=20" in text and "not measured again either: later/m" in text, text
    assert [c.split("--strategies=")[1].split()[0] for c in calls] == ["fast"] * 8 + ["slow"], calls
    assert measured(doc) == ["fast/m"] and measured(ref) == ["fast/m"], (doc, ref)  # the lone process dropped
    # Estimated again after every process: the reference's first process is quick, this code's
    # take 3 s, so after the second the six left would end past the budget of 10.
    status, text, doc, calls, ref = with_stub(["a/m"], {"STUB_SLEEP_THIS": "a/m=3"}, reference=True,
                                              extra=["--budget-s", "10"])
    assert status == 1 and "a/m: its 6 remaining processes (~3 s each)" in text and len(calls) == 2, (text, calls)
    assert measured(doc) == [] and measured(ref) == [], (doc, ref)
    # One process a cell (no reference): a cell is not started where a process as long as the
    # longest so far (the slow cell's 3 s) would end past the budget.
    status, text, doc, calls = with_stub(cells, {"STUB_SLEEP": "slow/m=3"}, extra=["--budget-s", "5"])
    assert status == 1 and "too little of it left for one process (~3 s)" in text and "failure: later/m" in text, text
    assert [c.split("--strategies=")[1].split()[0] for c in calls] == ["fast", "slow"], calls
    assert measured(doc) == ["fast/m", "slow/m"], doc
    # A budget already spent measures nothing more; without a budget every cell is measured.
    status, text, doc, calls = with_stub(cells, extra=["--budget-s", "0"])
    assert status == 1 and calls == [] and "failure: fast/m, slow/m, later/m" in text, text
    status, text, doc, calls, ref = with_stub(cells, {"STUB_SLEEP": "slow/m=0.1"}, reference=True, rounds=3)
    assert status == 0 and len(calls) == 18 and measured(doc) == cells, text
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert recheck.main(["--cells", "/dev/null", "--out", "/tmp/x.json", "--budget-s", "-1", "--", "true"]) == 2
    assert "--budget-s=-1" in err.getvalue(), err.getvalue()


@case
def a_job_killed_partway_keeps_the_cells_measured_before_it():
    with tempfile.TemporaryDirectory() as d:
        stub, listed = stand_in(d, ["a/m", "b/m"])
        out, ref_out = os.path.join(d, "again.json"), os.path.join(d, "ref.json")
        env = dict(os.environ, STUB_LOG=os.path.join(d, "log"), STUB_KILL_PARENT="b/m")
        done = subprocess.run([sys.executable, recheck.__file__, "--cells", listed, "--out", out, "--reference-bench",
                               stub, "--reference-out", ref_out, "--rounds", "3", "--", stub, "--benchmark_repetitions=2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert done.returncode == -9, (done.returncode, done.stdout)
        assert measured(json.load(open(out))) == ["a/m"] and measured(json.load(open(ref_out))) == ["a/m"], done.stdout
        assert len(json.load(open(out))["benchmarks"]) == 6 and not os.path.exists(out + ".partial"), done.stdout


def real_binary(strata_bench):
    """A CPU run of two cells; one doctored slow against a baseline that is the run itself; the
    doctored cell measured again by the real binary clears the gate, the other stays as it was."""
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "run.json")
        common = ["--device=cpu", "--steps=2", "--benchmark_repetitions=3"]
        cmd = [strata_bench] + common + ["--models=gpt-tiny", "--strategies=baseline,hook_offload",
                                         "--options=hook_offload:prefetch=1", "--precision=bf16",
                                         f"--benchmark_out={run}", "--benchmark_out_format=json"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert done.returncode == 0, f"strata_bench failed:\n{done.stdout[-3000:]}"
        doc = json.load(open(run))
        slow = "hook_offload[precision=bf16;prefetch=1]/gpt-tiny"
        assert any(b["name"].startswith(slow + "/") for b in doc["benchmarks"]), [b["name"] for b in doc["benchmarks"]]
        for b in doc["benchmarks"]:  # 20 times slower than the baseline: no noise explains it
            if b["name"].startswith(slow + "/") and b.get("run_type") == "iteration":
                b["items_per_second"] /= 20
        doctored = os.path.join(d, "doctored.json")
        json.dump(doc, open(doctored, "w"))
        listed, again = os.path.join(d, "cells.txt"), os.path.join(d, "again.json")
        status, text = quiet(gate.main, [doctored, run, "--no-compare", "--recheck-list", listed])
        assert status == 1 and open(listed).read() == slow + "\n", text
        status, text = quiet(recheck.main, ["--cells", listed, "--out", again, "--", strata_bench] + common)
        assert status == 0, text
        status, text = quiet(gate.main, [doctored, run, "--no-compare", "--recheck", again])
        # The second reading was found under the cell's name and gated: whether it clears a bar of
        # the run's own spread (at least 6%) depends on the CPU's noise between two processes, so
        # either note will do; a name that did not match would leave neither.
        assert (f"{slow}: failed on time in the run" in text
                or f"{slow}: measured again in a process of its own, it failed again" in text), text
        # The same binary standing in for the baseline's code: both sides' rows found under the
        # cell's name and paired (whether the pair passes is the CPU's noise again).
        ref = os.path.join(d, "reference.json")
        commit = "0" * 40  # the baseline's commit, as gpu.sh records it, and the stand-in's
        with open(run) as f:
            base = json.load(f)
        base["context"]["strata_commit"] = commit
        with open(run, "w") as f:
            json.dump(base, f)
        status, text = quiet(recheck.main, ["--cells", listed, "--out", again, "--reference-bench", strata_bench,
                                            "--reference-out", ref, "--reference-commit", commit, "--rounds", "3",
                                            "--", strata_bench] + common)
        assert status == 0, text
        status, text = quiet(gate.main, [doctored, run, "--no-compare", "--recheck", again, "--recheck-reference", ref])
        assert (f"{slow}: failed on time in the run" in text and "the paired reading is gated" in text
                or f"{slow}: measured again beside the baseline's own code ({strata_bench}) on this host, it is slower"
                in text), text


def main():
    cases = list(CASES)
    if len(sys.argv) > 1:
        def real_binary_measures_the_cells_again_under_their_names():
            real_binary(sys.argv[1])
        cases.append(real_binary_measures_the_cells_again_under_their_names)
    return run_cases(cases, "recheck")


if __name__ == "__main__":
    sys.exit(main())
