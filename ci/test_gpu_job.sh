#!/usr/bin/env bash
# ci/gpu.sh's benchmark phases on a machine without a GPU: nvidia-smi, cmake, ctest, the benchmark
# binary and bench/peers.py are stand-ins that print a made-up GPU and copy the committed H200 runs
# (reports/h200, reports/h200-bf16) where the real ones would write theirs. Checks the control flow
# the GPU runner depends on and no CPU test otherwise reaches: a `matrix` phase leaves the fp32
# matrix and its peers; a `bench` phase into the same folder uses them once and runs only the rest;
# a rebuilt binary, or a second run, measures the matrix again; the reports, the merged files and
# the gate's self-test come out. Needs python3 with matplotlib (ci/compare.sh's choice).
#
#   ci/test_gpu_job.sh [PYTHON]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=$(command -v "${1:-python3}") || { echo "test_gpu_job: no ${1:-python3}"; exit 1; }  # before PATH gains the stand-ins
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "test_gpu_job: FAILED: $*"; exit 1; }

# A copy of the scripts the job runs, with a stand-in build folder.
mkdir -p "$work/repo/ci" "$work/repo/bench" "$work/repo/reports" "$work/repo/build/cuda/bench" "$work/bin"
cp "$root/ci/gpu.sh" "$root/ci/gate.py" "$root/ci/recheck.py" "$work/repo/ci/"
cp "$root/reports/make_report.py" "$work/repo/reports/"
cp -r "$root/reports/h200" "$root/reports/h200-bf16" "$work/"
cat > "$work/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo "Stub GPU"
EOF
# cmake (and ctest): nothing to do; with STUB_REF_BUILD_FAIL, a build in a folder named ref fails.
printf '#!/bin/sh\n[ -n "${STUB_REF_BUILD_FAIL:-}" ] && [ "${PWD##*/}" = ref ] && exit 1\nexit 0\n' > "$work/bin/cmake"
# torchrun: its own options dropped, the script and its arguments to the python3 stand-in.
cat > "$work/bin/torchrun" <<'EOF'
#!/bin/sh
while [ $# -gt 0 ] && [ "$1" != bench/peers.py ]; do shift; done
exec python3 "$@"
EOF
cp "$work/bin/cmake" "$work/bin/ctest"
cat > "$work/bin/python3" <<EOF
#!/bin/sh
# bench/peers.py copies the committed peers of its precision (gpt-medium: the 871M model's, renamed).
if [ "\$1" = bench/peers.py ]; then
  out=""; prec=fp32; model=gpt-871m
  for a in "\$@"; do
    case \$a in --out=*) out=\${a#--out=};; --precision=*) prec=\${a#--precision=};; --model=*) model=\${a#--model=};;
      --self-test) exit 0;; esac
  done
  pp=""; case "\$*" in *--peers=torch_pp_*) pp=" pp";; esac
  echo "peers \$prec \$model\$pp" >> "$work/calls"
  [ -n "\${STUB_PEERS_FAIL:-}" ] && exit 1
  if [ -n "\$pp" ]; then  # the pipeline peers on one rank: made-up rows
    tag=""; [ \$prec = bf16 ] && tag=";precision=bf16"
    printf '{"context": {}, "benchmarks": [%s, %s, %s]}' \
      "{\"name\": \"torch_pp_interleaved[m=4;ranks=1\$tag]/\$model\", \"real_time\": 270, \"fwd_bwd_ms\": 250, \"optimizer_ms\": 20, \"peak_allocated_bytes\": 2e10, \"parity_ok\": 1}" \
      "{\"name\": \"torch_pp_zbv[m=4;ranks=1\$tag]/\$model\", \"real_time\": 275, \"fwd_bwd_ms\": 255, \"optimizer_ms\": 20, \"peak_allocated_bytes\": 2e10, \"parity_ok\": 1}" \
      "{\"name\": \"torch_pp_looped_bfs[m=4;ranks=1\$tag]/\$model\", \"real_time\": 290, \"fwd_bwd_ms\": 270, \"optimizer_ms\": 20, \"peak_allocated_bytes\": 2e10, \"parity_ok\": 1}" > "\$out"
    exit 0
  fi
  src=$work/h200/peers.json; [ \$prec = bf16 ] && src=$work/h200-bf16/peers.json
  sed "s#/gpt-871m#/\$model#g" "\$src" > "\$out"
  exit 0
fi
exec $python "\$@"
EOF
# cell_rows.py OUT STRATEGY MODEL PRECISION FACTOR: the committed run's rows of one cell, its
# throughput times FACTOR, as a cell measured again writes them.
cat > "$work/cell_rows.py" <<EOF
import json, sys
out, strategy, model, prec, factor = sys.argv[1:]
src = "$work/h200/bench.json" if prec == "fp32" else "$work/h200-bf16/bench.json"
name = strategy + ("" if prec == "fp32" else f"[precision={prec}]") + "/" + model
doc = json.load(open(src))
doc["benchmarks"] = [b for b in doc["benchmarks"] if b["name"].split("/iterations")[0] == name]
for b in doc["benchmarks"]:
    b["items_per_second"] *= float(factor)
json.dump(doc, open(out, "w"))
EOF
cat > "$work/repo/build/cuda/bench/strata_bench" <<EOF
#!/bin/sh
out=""; prec=fp32; opts=""; models=""; strategies=""
for a in "\$@"; do case \$a in --benchmark_out=*) out=\${a#--benchmark_out=};; --precision=*) prec=\${a#--precision=};;
  --options=*) opts=\${a#--options=};; --models=*) models=\${a#--models=};; --strategies=*) strategies=\${a#--strategies=};; esac; done
if [ -n "\$models" ] && [ -z "\$opts" ] && [ "\${strategies#*,}" = "\$strategies" ]; then
  # One cell measured again (ci/recheck.py): the committed run's rows of it, 1.3 x as fast (as
  # slow as before with STUB_SLOW_AGAIN).
  echo "strata_bench \$prec recheck \$strategies/\$models" >> "$work/calls"
  factor=1.3; [ -n "\${STUB_SLOW_AGAIN:-}" ] && factor=1
  exec $python "$work/cell_rows.py" "\$out" "\$strategies" "\$models" "\$prec" "\$factor"
fi
if [ -n "\$opts" ]; then  # a cell with options beyond the defaults: one made-up row
  echo "strata_bench \$prec options" >> "$work/calls"
  printf '{"context": {}, "benchmarks": [%s]}' \
    "{\"name\": \"hook_offload_overlap[\$opts]/gpt-871m/iterations:5/manual_time\", \"run_type\": \"iteration\", \"real_time\": 290, \"fwd_bwd_ms\": 280, \"optimizer_ms\": 10, \"items_per_second\": 28, \"peak_allocated_bytes\": 9e9, \"parity_ok\": 1}" > "\$out"
  exit 0
fi
echo "strata_bench \$prec" >> "$work/calls"
src=$work/h200/bench.json; [ \$prec = bf16 ] && src=$work/h200-bf16/bench.json
cp "\$src" "\$out"
EOF
chmod +x "$work"/bin/* "$work/repo/build/cuda/bench/strata_bench"
touch -d '1 hour ago' "$work/repo/build/cuda/bench/strata_bench"
export PATH="$work/bin:$PATH" STRATA_ALLOW_NO_BASELINE=1
out=$work/out
job() { : > "$work/calls"; STRATA_GPU_PHASES=$1 bash "$work/repo/ci/gpu.sh" "$out" > "$work/log" 2>&1; }

job matrix || { cat "$work/log"; fail "the matrix phase exited non-zero"; }
[ -f "$out/matrix.done" ] || fail "the matrix phase left no matrix.done"
[ "$(cat "$work/calls")" = "$(printf 'strata_bench fp32\nstrata_bench fp32 options\npeers fp32 gpt-871m\npeers fp32 gpt-medium\npeers fp32 gpt-871m pp')" ] \
  || fail "the matrix phase ran: $(tr '\n' ',' < "$work/calls")"
[ ! -e "$out/bench-bf16.json" ] || fail "the matrix phase ran the bf16 cells"

STRATA_COMMIT=abc1234 job bench || { cat "$work/log"; fail "the bench phase exited non-zero"; }
grep -q "from an earlier matrix phase" "$work/log" || fail "the bench phase did not say it reused the matrix"
[ "$(cat "$work/calls")" = "$(printf 'strata_bench bf16\npeers bf16 gpt-871m\npeers bf16 gpt-medium\npeers bf16 gpt-871m pp')" ] \
  || fail "the bench phase after a matrix phase ran: $(tr '\n' ',' < "$work/calls")"
[ ! -e "$out/matrix.done" ] || fail "matrix.done was left for a second use"
for f in report/report.md report-bf16/report.md gate.txt; do [ -s "$out/$f" ] || fail "no $f"; done
# Each GPT's table has its checkpointed peer (gpt-medium's from STRATA_MORE_PEER_MODELS).
[ "$(grep -c "^| torch_checkpoint (peer) |" "$out/report/report.md")" = 2 ] || fail "the fp32 report lacks a GPT's peers"
[ "$(grep -cF "| torch_checkpoint[precision=bf16] (peer) |" "$out/report-bf16/report.md")" = 2 ] \
  || fail "the bf16 report lacks a GPT's peers"
# The pipelines beside torch pipelining's peers on one rank, in both reports.
grep -qF "| pipeline_zero_bubble | torch_pp_zbv[m=4;ranks=1] |" "$out/report/report.md" \
  || fail "the fp32 report lacks the pipeline peers"
grep -qF "| pipeline_interleaved | torch_pp_interleaved[m=4;ranks=1] |" "$out/report-bf16/report.md" \
  || fail "the bf16 report lacks the pipeline peers"
grep -qF "| pipeline_gpipe | torch_pp_looped_bfs[m=4;ranks=1] |" "$out/report-bf16/report.md" \
  || fail "the bf16 report lacks GPipe's one-rank peer"
# The cell with units trained on the device, merged into the fp32 matrix and its report.
grep -qF "| hook_offload_overlap[resident=0,1,2,17;resident_updates=device] |" "$out/report/report.md" \
  || fail "the fp32 report lacks the cell with units trained on the device"
[ "$(grep -c "fails, as it must" "$work/log")" = 4 ] || fail "the gate's self-test did not fail its four doctored copies"
$python - "$out" <<'PY' || fail "the merged files are wrong"
import json, sys
out = sys.argv[1]
gated = [b["name"] for b in json.load(open(f"{out}/bench-gated.json"))["benchmarks"]]
assert any("precision=bf16" in n for n in gated) and any("precision" not in n for n in gated), "bench-gated.json"
commit = json.load(open(f"{out}/bench-gated.json"))["context"].get("strata_commit")
assert commit == "abc1234", f"bench-gated.json names the commit {commit}"
for f in ("peers.json", "peers-bf16.json"):
    names = [b["name"] for b in json.load(open(f"{out}/{f}"))["benchmarks"]]
    assert any(n.endswith("/gpt-medium") for n in names) and any(n.endswith("/gpt-871m") for n in names), f
PY

job bench || fail "a second bench phase exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "a second bench phase reused the matrix again"
job matrix || fail "the matrix phase exited non-zero"
touch "$work/repo/build/cuda/bench/strata_bench"
job bench || fail "the bench phase after a rebuild exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "the bench phase reused a matrix older than the binary"
# The same code built again (e.g. on another machine, OUTDIR carried over): taken on request,
# and both reports say the halves ran apart.
job matrix || fail "the matrix phase exited non-zero"
touch "$work/repo/build/cuda/bench/strata_bench"
STRATA_REUSE_MATRIX=1 job bench || { cat "$work/log"; fail "the bench phase with STRATA_REUSE_MATRIX=1 exited non-zero"; }
[ "$(cat "$work/calls")" = "$(printf 'strata_bench bf16\npeers bf16 gpt-871m\npeers bf16 gpt-medium\npeers bf16 gpt-871m pp')" ] \
  || fail "STRATA_REUSE_MATRIX=1 after a rebuild ran: $(tr '\n' ',' < "$work/calls")"
grep -q "ran in an earlier matrix phase, before this build" "$out/report/report.md" \
  || fail "the fp32 report does not say its matrix ran before this build"
grep -q "ran after a rebuild" "$out/report-bf16/report.md" || fail "the bf16 report does not say it ran after a rebuild"
grep -q "Not gated" "$out/report/report.md" || fail "the fp32 report lost the note that the run was not gated"
# ... but not for other code.
job matrix || fail "the matrix phase exited non-zero"
echo "# changed" > "$work/repo/bench/changed.py"
STRATA_REUSE_MATRIX=1 job bench || fail "the bench phase after a code change exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "STRATA_REUSE_MATRIX=1 reused a matrix of other code"
rm "$work/repo/bench/changed.py"
# A matrix phase that failed leaves nothing to reuse, even where one that passed did before.
job matrix || fail "the matrix phase exited non-zero"
STUB_PEERS_FAIL=1 job matrix && fail "a matrix phase whose peers failed exited 0"
[ ! -e "$out/matrix.done" ] || fail "a failed matrix phase left matrix.done"
job bench || fail "the bench phase after a failed matrix phase exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "the bench phase reused a failed matrix phase's files"
# Other settings, or phases other than bench alone, measure again.
job matrix || fail "the matrix phase exited non-zero"
STRATA_BENCH_REPS=2 job bench || fail "the bench phase with other settings exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "the bench phase reused a matrix of other settings"
job matrix || fail "the matrix phase exited non-zero"
job matrix,bench || fail "a matrix,bench run exited non-zero"
grep -q "^strata_bench fp32$" "$work/calls" || fail "a matrix,bench run reused the matrix"
[ ! -e "$out/matrix.done" ] || fail "a matrix,bench run left matrix.done"
# With a baseline for the machine: a cell that failed on time alone is measured again by itself,
# and the gate takes that reading; one that is slow again, or a failure that is not on time, fails.
mkdir -p "$work/repo/reports/baselines"
doctor() {  # the last run's gated cells as the baseline, a counter of some cells scaled (default: baseline/gpt-medium)
  $python - "$out/bench-gated.json" "$work/repo/reports/baselines/stub-gpu.json" "$1" "$2" "${3:-baseline/gpt-medium}" <<'PY'
import json, sys
src, dst, key, factor, cells = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5].split(",")
doc = json.load(open(src))
for b in doc["benchmarks"]:
    if b["name"].split("/iterations")[0] in cells and b.get("run_type") == "iteration":
        b[key] *= factor
json.dump(doc, open(dst, "w"))
PY
}
doctor items_per_second 1.3
job bench || { cat "$work/log"; fail "a run whose slow cell was fast when measured again exited non-zero"; }
grep -q "^strata_bench fp32 recheck baseline/gpt-medium$" "$work/calls" || fail "the slow cell was not measured again: $(tr '\n' ',' < "$work/calls")"
[ "$(grep -c recheck "$work/calls")" = 1 ] || fail "cells other than the slow one were measured again"
grep -q "gate: FAIL" "$out/gate-first.txt" || fail "the first gate's output was not kept"
grep -q "baseline/gpt-medium: failed on time in the run" "$out/gate.txt" && grep -q "gate: PASS" "$out/gate.txt" \
  || fail "the gate did not take the second reading"
STUB_SLOW_AGAIN=1 job bench && fail "a run whose slow cell was slow again exited 0"
grep -q "it failed again" "$out/gate.txt" || fail "the gate did not say the cell failed again"
grep -q "names no clean commit" "$work/log" || fail "a baseline naming no commit did not say why nothing ran beside the cell"
# Beside the baseline's own code (STRATA_REFERENCE_SRC: a stand-in built there, whose readings are
# the committed run's times STUB_REF_FACTOR): a cell slow again, but as slow as the baseline's code
# on this host, passes; one slower than the baseline's code fails, however it was read alone.
mkdir -p "$work/ref/build/cuda/bench"
touch "$work/ref/CMakeLists.txt"
cat > "$work/ref/build/cuda/bench/strata_bench" <<EOF
#!/bin/sh
out=""; prec=fp32; models=""; strategies=""
for a in "\$@"; do case \$a in --benchmark_out=*) out=\${a#--benchmark_out=};; --precision=*) prec=\${a#--precision=};;
  --models=*) models=\${a#--models=};; --strategies=*) strategies=\${a#--strategies=};; esac; done
echo "reference recheck \$strategies/\$models" >> "$work/calls"
exec $python "$work/cell_rows.py" "\$out" "\$strategies" "\$models" "\$prec" "\${STUB_REF_FACTOR:-1}"
EOF
chmod +x "$work/ref/build/cuda/bench/strata_bench"
name_commit() {  # the baseline's context names commit $1
  $python - "$work/repo/reports/baselines/stub-gpu.json" "$1" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["context"]["strata_commit"] = sys.argv[2]
json.dump(doc, open(sys.argv[1], "w"))
PY
}
ref_src_commit=0123456789abcdef0123456789abcdef01234567
name_commit $ref_src_commit
echo $ref_src_commit > "$work/ref/.strata-commit"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job bench \
  || { cat "$work/log"; fail "a cell as slow as the baseline's own code beside it failed"; }
[ "$(grep -c "^reference recheck baseline/gpt-medium$" "$work/calls")" = 4 ] \
  && [ "$(grep -c "^strata_bench fp32 recheck baseline/gpt-medium$" "$work/calls")" = 4 ] \
  || fail "the cell and the baseline's code did not run four times each: $(tr '\n' ',' < "$work/calls")"
[ -f "$out/reference-build.log" ] || fail "no reference-build.log"
grep -q "the host, not the code" "$out/gate.txt" && grep -q "gate: PASS" "$out/gate.txt" \
  || fail "the gate did not take the ratio to the baseline's code"
STUB_SLOW_AGAIN=1 STUB_REF_FACTOR=1.3 STRATA_REFERENCE_SRC=$work/ref job bench \
  && fail "a cell slower than the baseline's own code beside it passed"
grep -q "the code, not the host" "$out/gate.txt" || fail "the gate did not say the code is slower than the baseline's"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE=0 STRATA_REFERENCE_SRC=$work/ref job bench && fail "STRATA_REFERENCE=0 let a slow cell pass"
! grep -q "^reference" "$work/calls" || fail "STRATA_REFERENCE=0 ran the baseline's code"
# Sources of another commit than the baseline's, or a reference that does not build: not paired.
echo ffffffffffffffffffffffffffffffffffffffff > "$work/ref/.strata-commit"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job bench && fail "a cell passed beside another commit's code"
grep -q "holds commit 'ffff" "$work/log" && ! grep -q "^reference" "$work/calls" \
  || fail "sources of another commit were built or run beside the cell"
echo $ref_src_commit > "$work/ref/.strata-commit"
STUB_SLOW_AGAIN=1 STUB_REF_BUILD_FAIL=1 STRATA_REFERENCE_SRC=$work/ref job bench && fail "a cell passed when the reference did not build"
grep -q "the baseline's code did not build" "$work/log" && ! grep -q "^reference" "$work/calls" \
  || fail "a reference that did not build was run"
# The gate phase alone, on the run a bench phase left with nothing measured again: the failing cell
# measured beside the baseline's code, and nothing else measured.
STRATA_RECHECK_CELLS=0 job bench && fail "a slow cell passed with nothing measured again"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job gate || { cat "$work/log"; fail "the gate phase failed a cell as slow as the baseline's code"; }
[ "$(grep -c "^reference recheck baseline/gpt-medium$" "$work/calls")" = 4 ] && [ "$(grep -vc recheck "$work/calls")" = 0 ] \
  || fail "the gate phase ran more than the failing cell and the baseline's code: $(tr '\n' ',' < "$work/calls")"
grep -q "the host, not the code" "$out/gate.txt" || fail "the gate phase did not gate the pair"
# A budget the reference's build has already spent: nothing measured, the cell keeps its failure.
STRATA_RECHECK_BUDGET_S=0 STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job gate && fail "a slow cell passed with no budget left"
grep -q "budget-s=0 spent" "$work/log" && ! grep -q recheck "$work/calls" \
  || fail "STRATA_RECHECK_BUDGET_S=0 did not stop the cells measured again: $(tr '\n' ',' < "$work/calls")"
grep -q "^note: --budget-s=0 spent" "$out/gate.txt" && grep -q "gate: FAIL" "$out/gate.txt" \
  || fail "gate.txt does not say the budget left the cell unmeasured"
# A budget that is not whole seconds is refused before anything runs.
STRATA_RECHECK_BUDGET_S=90.5 STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job gate; [ $? = 2 ] \
  || fail "STRATA_RECHECK_BUDGET_S=90.5 was not refused"
grep -q "STRATA_RECHECK_BUDGET_S='90.5': not a whole number" "$work/log" && [ ! -s "$work/calls" ] \
  || fail "STRATA_RECHECK_BUDGET_S=90.5 ran something, or did not say why it stopped"
STRATA_GPU_PHASES=gate bash "$work/repo/ci/gpu.sh" "$work/empty" > "$work/log" 2>&1 && fail "the gate phase passed on an empty folder"
grep -q "no finished bench phase" "$work/log" || fail "the gate phase did not say what it lacked"
# ... nor on a run of other code (its cells would be measured again by this build), or one a later
# matrix phase has begun to replace.
echo "# changed" > "$work/repo/bench/changed.py"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job gate && fail "the gate phase gated a run of other code"
grep -q "no finished bench phase of these settings and this code" "$work/log" && ! grep -q recheck "$work/calls" \
  || fail "the gate phase measured a run of other code again"
rm "$work/repo/bench/changed.py"
job matrix || fail "the matrix phase exited non-zero"
STUB_SLOW_AGAIN=1 STRATA_REFERENCE_SRC=$work/ref job gate && fail "the gate phase gated a run a matrix phase had begun to replace"
# Phases it does not know, and gate beside another phase, are refused before anything runs.
for phases in suite,gate gate,bench gates; do
  job "$phases"; [ $? = 2 ] || fail "STRATA_GPU_PHASES=$phases was not refused"
  [ ! -s "$work/calls" ] || fail "STRATA_GPU_PHASES=$phases ran something"
done
# From git: the baseline names a commit of the repository (one whose tree holds the reference
# stand-in where its build would put strata_bench); gpu.sh unpacks it under build/reference/.
cp "$work/repo/build/cuda/bench/strata_bench" "$work/this-bench"
( cd "$work/repo" && git init -q && touch CMakeLists.txt && cp "$work/ref/build/cuda/bench/strata_bench" build/cuda/bench/ \
  && git add -f CMakeLists.txt build/cuda/bench/strata_bench && git -c user.name=t -c user.email=t@t commit -qm ref ) \
  || fail "could not make a git history for the reference"
ref_commit=$(git -C "$work/repo" rev-parse HEAD)
cp -p "$work/this-bench" "$work/repo/build/cuda/bench/strata_bench"
name_commit "$ref_commit"
STUB_SLOW_AGAIN=1 job bench || { cat "$work/log"; fail "a cell as slow as the baseline's code from git failed"; }
[ -x "$work/repo/build/reference/$ref_commit/build/cuda/bench/strata_bench" ] \
  && [ "$(cat "$work/repo/build/reference/$ref_commit/.strata-commit")" = "$ref_commit" ] || fail "the baseline's commit was not unpacked"
[ "$(grep -c "^reference recheck baseline/gpt-medium$" "$work/calls")" = 4 ] && grep -q "(${ref_commit:0:12})" "$out/gate.txt" \
  || fail "the baseline's code from git did not run beside the cell: $(tr '\n' ',' < "$work/calls")"
$python -c 'import json, sys; c = json.load(open(sys.argv[1]))["context"]["strata_commit"]; sys.exit(c != sys.argv[2] + "-dirty")' \
  "$out/bench-gated.json" "$ref_commit" || fail "bench-gated.json does not name the checkout's commit, dirty"
rm -rf "$work/repo/.git" "$work/repo/build/reference" "$work/repo/CMakeLists.txt"
STRATA_RECHECK_CELLS=0 job bench && fail "a slow cell passed with nothing measured again"
! grep -q recheck "$work/calls" || fail "STRATA_RECHECK_CELLS=0 measured a cell again"
doctor items_per_second 1.3 baseline/gpt-medium,baseline/gpt-871m
STRATA_RECHECK_CELLS=1 job bench && fail "two slow cells passed with one allowed to be measured again"
! grep -q recheck "$work/calls" || fail "a cell was measured again beyond STRATA_RECHECK_CELLS"
grep -q "baseline/gpt-medium: throughput" "$out/gate.txt" && grep -q "baseline/gpt-871m: throughput" "$out/gate.txt" \
  || fail "the gate's output lost the failures when nothing was measured again"
doctor peak_allocated_bytes 0.5
job bench && fail "a run whose cell's memory rose exited 0"
! grep -q recheck "$work/calls" || fail "a memory rise was measured again"
# STRATA_PROMOTE=1: a run that passes is written over the baseline; one that passed only on a
# second reading is not, and the job fails saying why.
clean=fedcba9876543210fedcba9876543210fedcba98
baseline_file=$work/repo/reports/baselines/stub-gpu.json
doctor items_per_second 1.0
STRATA_PROMOTE=1 STRATA_COMMIT=$clean job bench || { cat "$work/log"; fail "a passing run with STRATA_PROMOTE=1 exited non-zero"; }
cmp -s "$out/bench-gated.json" "$baseline_file" && grep -q "^promote: .* written to reports/baselines/stub-gpu.json" "$out/gate.txt" \
  || { tail -n 4 "$out/gate.txt"; fail "STRATA_PROMOTE=1 did not write the passing run over the baseline"; }
cp "$baseline_file" "$work/held.json"
# Refused at the first gate (no clean commit named: the stand-in repository has no git history), in
# a job that failed before the gate (a peer failed), and a value that is not 0 or 1 before anything runs.
STRATA_PROMOTE=1 job bench && fail "a run naming no clean commit was promoted"
cmp -s "$baseline_file" "$work/held.json" && grep -q "^promote: refused.*not a clean commit" "$out/gate.txt" \
  || fail "a run naming no clean commit changed the baseline, or gate.txt does not say why"
STUB_PEERS_FAIL=1 STRATA_PROMOTE=1 STRATA_COMMIT=$clean job bench && fail "a job whose peer failed passed"
cmp -s "$baseline_file" "$work/held.json" && grep -q "the job has already failed; the baseline is not refreshed" "$work/log" \
  || fail "a job that had already failed refreshed the baseline, or did not say why not"
STRATA_PROMOTE=yes job bench; [ $? = 2 ] && [ ! -s "$work/calls" ] || fail "STRATA_PROMOTE=yes was not refused before any work"
doctor items_per_second 1.3
cp "$baseline_file" "$work/held.json"
STRATA_PROMOTE=1 STRATA_COMMIT=$clean job bench && fail "a run that passed only on a second reading was promoted"
cmp -s "$baseline_file" "$work/held.json" && grep -q "^promote: refused" "$out/gate.txt" && grep -q "gate: PASS" "$out/gate.txt" \
  || fail "a refused promotion changed the baseline or did not say why"
rm "$work/repo/reports/baselines/stub-gpu.json"
echo "test_gpu_job: ok (matrix, bench reusing it once, failed runs, rebuilds, other code and other settings measuring again, a rebuild's reuse on request, a slow cell measured again, alone and beside the baseline's code, the gate phase alone, its budget, STRATA_PROMOTE)"
