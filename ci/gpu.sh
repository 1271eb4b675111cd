#!/usr/bin/env bash
# The GPU-runner job: build with CUDA, run the whole correctness suite, run the benchmark matrix
# (fp32 and bf16) and PyTorch's peers, write the reports under OUTDIR, and gate the run against the
# committed baseline for this GPU model (reports/baselines/<gpu>.json). The exit status is non-zero
# when anything fails, the gate included.
#
#   ci/gpu.sh [OUTDIR]        (default build/cuda/results)
#
# What it needs, what it writes, the STRATA_* settings and what changes with two or more GPUs:
# ci/README.md, the one place they are documented.
set -euo pipefail
cd "$(dirname "$0")/.."
outdir=$(realpath -m "${1:-build/cuda/results}")
mkdir -p "$outdir"
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
gpu_count=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
gpu_key=$(echo "$gpu_name" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/-$//')
if [ "$gpu_count" -gt 1 ]; then
  gpu_key="$gpu_key-x$gpu_count"
  gpu_name="$gpu_count x $gpu_name"
fi
echo "ci/gpu.sh: $gpu_name ($gpu_key)"

phases=${STRATA_GPU_PHASES:-suite,bench}
for phase in ${phases//,/ }; do
  case $phase in
    suite|matrix|bench|gate) ;;
    *) echo "ci/gpu.sh: STRATA_GPU_PHASES='$phases': no phase '$phase' (suite, matrix, bench, gate)"; exit 2 ;;
  esac
done
[[ ",$phases," != *,gate,* || "$phases" == gate ]] \
  || { echo "ci/gpu.sh: STRATA_GPU_PHASES='$phases': gate runs alone, on a run an earlier bench phase left"; exit 2; }
# Counts used in shell arithmetic: anything but whole numbers is refused here, before any work (a
# fraction in STRATA_RECHECK_BUDGET_S once ended the gate's block early and let a failing run pass).
for setting in STRATA_RECHECK_CELLS STRATA_RECHECK_BUDGET_S; do
  value=${!setting:-0}
  [[ $value =~ ^[0-9]+$ ]] || { echo "ci/gpu.sh: $setting='$value': not a whole number"; exit 2; }
done

[[ ${STRATA_PROMOTE:-0} =~ ^[01]$ ]] || { echo "ci/gpu.sh: STRATA_PROMOTE='$STRATA_PROMOTE': 0 or 1"; exit 2; }

t0=$(date +%s)
cmake --preset cuda > "$outdir/build.log" 2>&1
cmake --build --preset cuda -j "$(nproc)" >> "$outdir/build.log" 2>&1 || { tail -n 30 "$outdir/build.log"; exit 1; }
echo "ci/gpu.sh: configure + build took $(( $(date +%s) - t0 )) s"

status=0
# merge_into TARGET EXTRA...: the EXTRA files' benchmarks appended to TARGET's.
merge_into() {
  python3 - "$@" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for extra in sys.argv[2:]:
    doc["benchmarks"] += json.load(open(extra))["benchmarks"]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
}
# more_peers_into TARGET [PEERS.PY ARGS...]: PyTorch's plain and checkpointed steps for each of
# STRATA_MORE_PEER_MODELS, merged into TARGET (their files beside it, TARGET's name and the model's).
more_peers_into() {
  local target=$1 model out; shift
  for model in ${STRATA_MORE_PEER_MODELS-gpt-medium}; do
    out=${target%.json}-$model.json
    rm -f "$out"
    PYTHONUNBUFFERED=1 python3 bench/peers.py "$@" --model="$model" --steps=5 --peers=torch_baseline,torch_checkpoint \
      --out="$out" 2>&1 | tee "${out%.json}.txt" || { echo "ci/gpu.sh: a $model peer failed ($*)"; status=1; }
    merge_into "$target" "$out" || status=1
  done
}
# pipeline_peers_into TARGET [PEERS.PY ARGS...]: torch.distributed.pipelining's schedules that put
# two stages on a rank (LoopedBFS: GPipe's order), on one rank (one GPU, as the matrix's pipeline
# cells share cuda:0, in as many micro-batches as those cells: 2 per rank of 2), merged into TARGET.
pipeline_peers_into() {
  local target=$1 out=${1%.json}-pp.json; shift
  rm -f "$out"  # an earlier run's file must not be merged if this one writes none
  NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node=1 bench/peers.py "$@" \
    --model="${STRATA_PEERS_MODEL:-gpt-871m}" --peers=torch_pp_interleaved,torch_pp_zbv,torch_pp_looped_bfs --micro-batches=4 --steps=3 \
    --out="$out" 2>&1 | tee "${out%.json}.txt" || { echo "ci/gpu.sh: a pipeline peer failed ($*)"; status=1; }
  merge_into "$target" "$out" || status=1
}
if [[ ",$phases," == *,suite,* ]]; then
ctest --preset cuda -j 8 > "$outdir/ctest.log" 2>&1 || status=$?
grep -E "tests passed|Failed|Skipped" "$outdir/ctest.log" | tail -n 12
# Every label must have run, and passed, where this machine can run it: a label whose tests were
# all skipped would otherwise pass as green.
for label in cpu cuda multigpu; do
  ran=$(grep -cE "Test +#[0-9]+: $label\." "$outdir/ctest.log" || true)
  passed=$(grep -cE "Test +#[0-9]+: $label\..*Passed" "$outdir/ctest.log" || true)
  skipped=$(grep -cE "Test +#[0-9]+: $label\..*Skipped" "$outdir/ctest.log" || true)
  echo "label $label: $passed passed, $skipped skipped, of $ran"
  if [ "$label" = multigpu ] && [ "$gpu_count" -lt 2 ]; then
    [ "$skipped" -eq "$ran" ] || { echo "label multigpu: with one GPU every test should skip"; status=1; }
  elif [ "$ran" -eq 0 ] || [ "$passed" -ne "$ran" ]; then
    echo "label $label: not every test ran and passed on this machine"; status=1
  fi
done 2>&1 | tee "$outdir/labels.txt"
grep -q "not every test\|should skip" "$outdir/labels.txt" && status=1
# The peers' parity check must be able to fail: it is shown a peer with doubled gradients, then right ones.
PYTHONUNBUFFERED=1 python3 bench/peers.py --self-test --offload-py="${STRATA_OFFLOAD_PY:-../shared/seeds/offload.py}" 2>&1 \
  | tee "$outdir/peers-self-test.txt" || { echo "ci/gpu.sh: the peers' parity self-test failed"; status=1; }
fi
[[ ",$phases," == *,bench,* || ",$phases," == *,matrix,* || "$phases" == gate ]] || exit $status

reps=${STRATA_BENCH_REPS:-5}
offload_py=${STRATA_OFFLOAD_PY:-../shared/seeds/offload.py}
# The settings and a fingerprint of the code that shape the benchmarks (matrix.done, bench.done).
code=$({ find CMakeLists.txt CMakePresets.json strategies models bench correctness -type f \
           \( -name '*.cpp' -o -name '*.h' -o -name '*.py' -o -name '*.txt' -o -name '*.json' \) 2>/dev/null || true; } \
       | LC_ALL=C sort | xargs -r cat | sha256sum | cut -c1-16)
settings="reps=$reps args=${STRATA_BENCH_ARGS:-} peers=${STRATA_PEERS_MODEL:-gpt-871m} more=${STRATA_MORE_PEER_MODELS-gpt-medium} offload=$offload_py gpus=$gpu_count code=$code"
# `gate` alone: the gate again on the run a bench phase left in OUTDIR (bench.done: its settings and
# code, which must be this run's, since the cells measured again run on this build), with its cells
# measured again (and beside the baseline's code) where they fail on time; nothing else is measured
# or reported. For a run whose bench phase had STRATA_RECHECK_CELLS=0, or to measure again later.
gate_only=0
if [ "$phases" = gate ]; then
  gate_only=1
  if [ ! -f "$outdir/bench.done" ] || [ "$(head -n 1 "$outdir/bench.done")" != "$settings" ]; then
    echo "ci/gpu.sh: $outdir holds no finished bench phase of these settings and this code (bench.done): nothing to gate again"
    exit 1
  fi
  echo "ci/gpu.sh: the gate again on $outdir/bench-gated.json"
fi
if [ "$gate_only" = 0 ]; then
rm -f "$outdir/bench.done" "$outdir/bench-gated.json"  # what an earlier bench phase left no longer describes OUTDIR
more_peers="" more_peers_bf16=""  # the report headers' commands for the peers beyond peers.py's defaults
for model in ${STRATA_MORE_PEER_MODELS-gpt-medium}; do
  more_peers+="; bench/peers.py --model=$model --steps=5 --peers=torch_baseline,torch_checkpoint"
  more_peers_bf16+="; bench/peers.py --precision=bf16 --model=$model --steps=5 --peers=torch_baseline,torch_checkpoint"
done
pp_peers="torchrun --nproc-per-node=1 bench/peers.py --model=${STRATA_PEERS_MODEL:-gpt-871m} --peers=torch_pp_interleaved,torch_pp_zbv,torch_pp_looped_bfs --micro-batches=4 --steps=3"
more_peers+="; $pp_peers"
more_peers_bf16+="; $pp_peers --precision=bf16"
# fp32: the matrix (and the cells over two GPUs) and PyTorch's peers. A `matrix` phase that passed
# leaves them in OUTDIR with matrix.done (the settings and a fingerprint of the code that shaped
# them, then the command); a later run whose phases are `bench` alone takes them from there, once,
# if its settings and code are the same and the benchmark binary is older than matrix.done (a
# rebuild measures again). STRATA_REUSE_MATRIX=1 takes them after a rebuild too: the same code
# built again, e.g. on another machine (OUTDIR carried over); the reports then say that the two
# halves ran on two machines. Any other run measures afresh.
reuse=0 matrix_note="" bf16_note=""
if [ "$phases" = bench ] && [ -f "$outdir/matrix.done" ]; then
  if [ "$(head -n 1 "$outdir/matrix.done")" != "$settings" ]; then
    echo "ci/gpu.sh: $outdir/matrix.done is from other settings or other code: measuring again"
  elif [ "$outdir/matrix.done" -nt build/cuda/bench/strata_bench ]; then
    reuse=1
  elif [ "${STRATA_REUSE_MATRIX:-0}" = 1 ]; then
    reuse=1
    matrix_note="The fp32 matrix and its peers ran in an earlier matrix phase, before this build (STRATA_REUSE_MATRIX=1: the same code on another machine, or rebuilt); the bf16 cells and their peers ran after it, on the machine of the bf16 report."
    bf16_note="The bf16 cells and their peers ran after a rebuild, on another machine than the fp32 matrix's, or rebuilt since (STRATA_REUSE_MATRIX=1); the gate compares the two halves together."
    echo "ci/gpu.sh: STRATA_REUSE_MATRIX=1: the fp32 matrix from before this build"
  else
    echo "ci/gpu.sh: $outdir/matrix.done is older than the benchmarks: measuring again (STRATA_REUSE_MATRIX=1 takes it, for the same code built again)"
  fi
fi
if [ "$reuse" = 1 ]; then
  echo "ci/gpu.sh: the fp32 matrix and peers from an earlier matrix phase ($outdir/matrix.done)"
  bench_command=$(sed -n 2p "$outdir/matrix.done")
  rm -f "$outdir/matrix.done"  # used once
else
rm -f "$outdir/matrix.done"  # whatever an earlier run left no longer describes OUTDIR
echo "ci/gpu.sh: benchmark matrix"
./build/cuda/bench/strata_bench --device=cuda:0 --benchmark_repetitions="$reps" ${STRATA_BENCH_ARGS:-} \
  --benchmark_out="$outdir/bench.json" --benchmark_out_format=json > "$outdir/bench.txt" 2>&1 || status=1
tail -n 20 "$outdir/bench.txt"
bench_command="strata_bench --device=cuda:0 --benchmark_repetitions=$reps ${STRATA_BENCH_ARGS:-}"
# One GPU, options beyond the defaults: hook_offload with the tied embedding and blocks 1 and 2 of
# gpt-871m trained on the device, and its overlapped twin (the report's host table takes the
# twin's device time for the overlapped cell's floor; bench/notes/resident-updates.md). New cells
# are listed, not gated, until a baseline has them.
# The matrix's measured matmul peak, so every cell's MFU has the same denominator.
peak=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["context"]["peak_tflops"])' "$outdir/bench.json")
# extra_cells JSON ARGS SHOWN: one strata_bench invocation beyond the matrix (ARGS: its own
# arguments), its JSON in JSON and its log beside it, the log's rows matching SHOWN printed, its
# command added to the report's.
extra_cells() {
  local json=$1 args=$2 shown=$3 cell_args
  read -r -a cell_args <<< "$args"
  ./build/cuda/bench/strata_bench --device=cuda:0 --peak-tflops="$peak" --benchmark_repetitions="$reps" ${STRATA_BENCH_ARGS:-} "${cell_args[@]}" \
    --benchmark_out="$json" --benchmark_out_format=json > "${json%.json}.txt" 2>&1 || status=1
  grep -E "$shown" "${json%.json}.txt" | cut -c1-160 || true
  bench_command+="; strata_bench --device=cuda:0 --benchmark_repetitions=$reps ${STRATA_BENCH_ARGS:-} $args"
}
extra_cells "$outdir/bench-resident.json" \
  "--models=gpt-871m --strategies=hook_offload,hook_offload_overlap --options=resident=0,1,2,17;resident_updates=device" \
  "^hook_offload.*median"
merge_into "$outdir/bench.json" "$outdir/bench-resident.json" || status=1
if [ "$gpu_count" -gt 1 ]; then
  echo "ci/gpu.sh: cells over two GPUs"
  wide=${STRATA_WIDE_CLASSES:-8250000}  # bench/notes/bert-wide-classifier.md: one H200 trains at most 7,968,750
  two=cuda:0,cuda:1
  cells=(
    "gpt|--models=gpt-871m --strategies=manual_split --options=devices=$two"
    "seed|--models=bert-base-6m --batch=8 --strategies=baseline,manual_split --options=manual_split:devices=$two"
    "wide|--models=bert-base-6m --classes=$wide --batch=8 --strategies=baseline,manual_split --options=manual_split:devices=$two"
    "wide-cols|--models=bert-base-6m --classes=$wide --batch=8 --strategies=manual_split --options=devices=$two;classifier_shards=2"
    "12m-cols|--models=bert-base-12m --batch=8 --strategies=manual_split --options=devices=$two;classifier_shards=2"
  )
  cell_files=()
  for cell in "${cells[@]}"; do
    tag=${cell%%|*}
    extra_cells "$outdir/bench-2gpu-$tag.json" "${cell#*|}" "^(baseline|manual_split)"
    cell_files+=("$outdir/bench-2gpu-$tag.json")
  done
  # The sharded strategy over every GPU, one rank each (time: the slowest rank; peak: per rank).
  echo "ci/gpu.sh: sharded over $gpu_count GPUs"
  for cell in "sharded|--strategies=sharded,sharded_offload" "sharded-keep|--strategies=sharded --options=activations=keep"; do
    tag=${cell%%|*}
    read -r -a cell_args <<< "${cell#*|}"
    NCCL_NVLS_ENABLE=0 python3 strategies/distributed/launch.py --nproc="$gpu_count" --timeout=1200 -- \
      ./build/cuda/bench/strata_bench --device=cuda:0 --peak-tflops="$peak" --benchmark_repetitions="$reps" ${STRATA_BENCH_ARGS:-} \
      --models=gpt-871m "${cell_args[@]}" --benchmark_out="$outdir/bench-x$gpu_count-$tag.json" --benchmark_out_format=json \
      > "$outdir/bench-x$gpu_count-$tag.txt" 2>&1 || status=1
    grep -E "^\[rank 0\] sharded" "$outdir/bench-x$gpu_count-$tag.txt" | cut -c1-160
    cell_files+=("$outdir/bench-x$gpu_count-$tag.json")
    bench_command+="; launch.py --nproc=$gpu_count -- strata_bench --device=cuda:0 --benchmark_repetitions=$reps --models=gpt-871m ${cell#*|}"
  done
  # One file for the gate: the matrix and the two-GPU cells.
  merge_into "$outdir/bench.json" "${cell_files[@]}" || status=1
fi
echo "ci/gpu.sh: PyTorch peers"
# A peer that fails (other than out of memory) or fails its parity check fails the job.
PYTHONUNBUFFERED=1 python3 bench/peers.py --model="${STRATA_PEERS_MODEL:-gpt-871m}" --offload-py="$offload_py" \
  --steps=3 --out="$outdir/peers.json" 2>&1 | tee "$outdir/peers.txt" || { echo "ci/gpu.sh: a peer failed"; status=1; }
if [ "$gpu_count" -gt 1 ]; then
  # PyTorch's data-parallel peers (DDP, FSDP2, FSDP2 + CPUOffloadPolicy) over the same GPUs.
  NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node="$gpu_count" bench/peers.py \
    --model="${STRATA_PEERS_MODEL:-gpt-871m}" --steps=3 --out="$outdir/peers-x$gpu_count.json" 2>&1 \
    | tee "$outdir/peers-x$gpu_count.txt" || { echo "ci/gpu.sh: a data-parallel peer failed"; status=1; }
  merge_into "$outdir/peers.json" "$outdir/peers-x$gpu_count.json" || status=1
fi
# The matrix's other GPT beside PyTorch's plain and checkpointed steps, so its report table has
# their columns too.
more_peers_into "$outdir/peers.json"
pipeline_peers_into "$outdir/peers.json"
if [[ ",$phases," == *,matrix,* && ",$phases," != *,bench,* ]]; then
  [ "$status" -eq 0 ] && printf '%s\n%s\n' "$settings" "$bench_command" > "$outdir/matrix.done"
  exit $status
fi
fi
# bf16 compute over fp32 masters, for every strategy that trains in it
# (Precision.the_strategies_that_train_in_bf16_are_these lists them), on the same presets; the
# cells are named [precision=bf16] and gated beside the fp32 ones.
echo "ci/gpu.sh: bf16 cells"
bf16=${STRATA_BF16_STRATEGIES:-baseline,baseline_checkpoint,hook_offload,hook_offload_overlap,hook_offload_sync,manual_split,pipeline_1f1b,pipeline_gpipe,pipeline_interleaved,pipeline_zero_bubble,sharded,sharded_offload}
./build/cuda/bench/strata_bench --device=cuda:0 --precision=bf16 --strategies="$bf16" --benchmark_repetitions="$reps" \
  ${STRATA_BENCH_ARGS:-} --benchmark_out="$outdir/bench-bf16.json" --benchmark_out_format=json > "$outdir/bench-bf16.txt" 2>&1 || status=1
tail -n 3 "$outdir/bench-bf16.txt"
bench_command+="; strata_bench --device=cuda:0 --precision=bf16 --strategies=$bf16 --benchmark_repetitions=$reps ${STRATA_BENCH_ARGS:-}"
# What the gate reads: the fp32 cells and the bf16 ones (the reports keep them apart, each beside
# its own peers).
{ cp "$outdir/bench.json" "$outdir/bench-gated.json" && merge_into "$outdir/bench-gated.json" "$outdir/bench-bf16.json"; } || status=1
# The commit of the code measured, so that bench-gated.json, once committed as a baseline, names
# the code a later run can build and measure beside its own (ci/recheck.py --reference-bench).
# Only this checkout's own repository counts (not one it sits inside), and any change to it, tracked
# or not, marks the commit -dirty.
commit=${STRATA_COMMIT:-}
if [ -z "$commit" ] && [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ] && commit=$(git rev-parse HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain 2>/dev/null)" ] || commit+="-dirty"
fi
python3 - "$outdir/bench-gated.json" "${commit:-unknown}" <<'PY' || status=1
import json, sys
doc = json.load(open(sys.argv[1]))
doc.setdefault("context", {})["strata_commit"] = sys.argv[2]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
printf '%s\n' "$settings" > "$outdir/bench.done"  # what shaped bench-gated.json, for a later gate phase
PYTHONUNBUFFERED=1 python3 bench/peers.py --precision=bf16 --model="${STRATA_PEERS_MODEL:-gpt-871m}" --steps=3 \
  --out="$outdir/peers-bf16.json" 2>&1 | tee "$outdir/peers-bf16.txt" || { echo "ci/gpu.sh: a bf16 peer failed"; status=1; }
more_peers_into "$outdir/peers-bf16.json" --precision=bf16
pipeline_peers_into "$outdir/peers-bf16.json" --precision=bf16
python3 reports/make_report.py --strata "$outdir/bench-bf16.json" --peers "$outdir/peers-bf16.json" --out "$outdir/report-bf16" \
  --machine "$gpu_name" --note "$bf16_note" --command "strata_bench --device=cuda:0 --precision=bf16 --strategies=$bf16; bench/peers.py --precision=bf16$more_peers_bf16" || status=1
fi  # gate_only


# The gate on this very run: it passes against itself and fails on each doctored copy — a
# baseline claiming 20% more throughput for one cell, or 20% less memory on one device of one
# cell; a run missing one cell, or with one cell errored. A branch that passes is a broken gate.
# Before the gate itself, so that a broken gate fails the job before it can promote a run.
python3 ci/gate.py "$outdir/bench.json" "$outdir/bench.json" --no-compare > "$outdir/gate_self.txt" \
  || { echo "gate self-test: FAILED on itself"; status=1; }
python3 - "$outdir" <<'PY'
import copy, json, sys
out = sys.argv[1]
doc = json.load(open(f"{out}/bench.json"))
ok = [b for b in doc["benchmarks"] if not b.get("error_occurred") and b.get("run_type", "iteration") == "iteration"]
cell = ok[0]["name"]
def write(name, d):
    json.dump(d, open(f"{out}/{name}.json", "w"))
d = copy.deepcopy(doc)
for b in d["benchmarks"]:
    if b["name"] == cell:
        b["items_per_second"] *= 1.2
write("doctored-throughput", d)
d = copy.deepcopy(doc)
devices = [k for k in ok[-1] if k.startswith("peak_allocated_bytes")]
for b in d["benchmarks"]:
    if b["name"] == ok[-1]["name"]:
        b[devices[-1]] *= 0.8
write("doctored-memory", d)
d = copy.deepcopy(doc)
d["benchmarks"] = [b for b in d["benchmarks"] if b["name"] != cell]
write("doctored-missing", d)
d = copy.deepcopy(doc)
for b in d["benchmarks"]:
    if b["name"] == cell:
        b.update(error_occurred=True, error_message="error: doctored")
write("doctored-errored", d)
print(f"doctored from {cell} and {ok[-1]['name']} ({devices[-1]})")
PY
: > "$outdir/gate_doctored.txt"
for branch in throughput memory missing errored; do
  case $branch in
    throughput|memory) args=("$outdir/bench.json" "$outdir/doctored-$branch.json") ;;  # doctored baseline
    *) args=("$outdir/doctored-$branch.json" "$outdir/bench.json") ;;                  # doctored run
  esac
  if python3 ci/gate.py "${args[@]}" --no-compare >> "$outdir/gate_doctored.txt"; then
    echo "gate self-test: the doctored $branch branch PASSED — the gate is broken"; status=1
  else
    echo "gate self-test: the doctored $branch branch fails, as it must"
  fi
done
rm -f "$outdir"/doctored-*.json

# The gate: against the committed baseline for this machine. A machine without one fails the job
# unless STRATA_ALLOW_NO_BASELINE=1, and then the report says the run was not gated.
baseline="reports/baselines/$gpu_key.json"
# reference_bench: sets ref_bin to a strata_bench built from the baseline's own commit (ref_commit,
# and ref_label to say where from), or leaves them empty and says why. The commit is the one the
# baseline's context names (strata_commit, 40 hex digits). Its sources: STRATA_REFERENCE_SRC (a git
# checkout of that commit, or a folder whose .strata-commit file names it, e.g. made by `git archive
# COMMIT | tar -x -C DIR && echo COMMIT > DIR/.strata-commit`), else that commit from git (fetched
# into a shallow clone), unpacked under build/reference/. Only strata_bench is built, into the
# sources' own build/cuda, its log in OUTDIR/reference-build.log.
ref_bin="" ref_label="" ref_commit=""
no_reference() { echo "ci/gpu.sh: $*: the baseline's code is not measured beside them"; }
reference_bench() {
  local src=${STRATA_REFERENCE_SRC:-} commit held t0
  if [ "${STRATA_REFERENCE:-1}" = 0 ]; then
    no_reference "STRATA_REFERENCE=0"; return 0
  fi
  commit=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["context"].get("strata_commit", ""))' \
    "$baseline" 2>/dev/null || true)
  if ! [[ $commit =~ ^[0-9a-f]{40}$ ]]; then
    no_reference "$baseline names no clean commit (context strata_commit '${commit}')"
    return 0
  fi
  if [ -n "$src" ]; then
    if [ "$(realpath "$src" 2>/dev/null)" = "$(pwd -P)" ]; then
      no_reference "STRATA_REFERENCE_SRC=$src is this checkout"
      return 0
    elif [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$(realpath "$src")" ]; then
      held=$(git -C "$src" rev-parse HEAD 2>/dev/null || true)
      if [ -n "$(git -C "$src" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        no_reference "STRATA_REFERENCE_SRC=$src has changes to its tracked files"
        return 0
      fi
    else
      held=$(cat "$src/.strata-commit" 2>/dev/null || true)
    fi
    if [ "$held" != "$commit" ]; then
      no_reference "STRATA_REFERENCE_SRC=$src holds commit '${held:-unnamed}' (a git checkout's HEAD, or its .strata-commit), not the baseline's $commit"
      return 0
    fi
    ref_label="${commit:0:12}, sources from $src"
  else
    if ! git rev-parse -q --verify "$commit^{commit}" > /dev/null 2>&1; then
      if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then  # a shallow clone: fetch that commit
        GIT_TERMINAL_PROMPT=0 timeout 300 git fetch -q --depth=1 origin "$commit" > /dev/null 2>&1 || true
      fi
      if ! git rev-parse -q --verify "$commit^{commit}" > /dev/null 2>&1; then
        no_reference "the baseline's commit $commit is not in a git history here (STRATA_REFERENCE_SRC gives its sources)"
        return 0
      fi
    fi
    src=build/reference/$commit ref_label=${commit:0:12}
    if [ ! -f "$src/.strata-commit" ]; then  # unpacked whole or not at all
      rm -rf "$src" "$src.partial" && mkdir -p "$src.partial" && git archive "$commit" | tar -x -C "$src.partial" \
        && echo "$commit" > "$src.partial/.strata-commit" && mv "$src.partial" "$src" \
        || { echo "ci/gpu.sh: could not unpack $commit into $src"; return 0; }
    fi
  fi
  [ -f "$src/CMakeLists.txt" ] || { echo "ci/gpu.sh: $src holds no CMakeLists.txt: not the baseline's sources"; return 0; }
  src=$(realpath "$src")
  echo "ci/gpu.sh: building the baseline's strata_bench ($ref_label)"
  t0=$(date +%s)
  if ! (cd "$src" && cmake --preset cuda && cmake --build --preset cuda -j "$(nproc)" --target strata_bench) \
      > "$outdir/reference-build.log" 2>&1; then
    tail -n 20 "$outdir/reference-build.log"
    no_reference "the baseline's code did not build (reference-build.log)"; return 0
  fi
  [ -x "$src/build/cuda/bench/strata_bench" ] \
    || { echo "ci/gpu.sh: no $src/build/cuda/bench/strata_bench after its build"; return 0; }
  echo "ci/gpu.sh: built in $(( $(date +%s) - t0 )) s"
  ref_bin=$src/build/cuda/bench/strata_bench ref_commit=$commit
}
note=""
# STRATA_PROMOTE=1: a run that passes becomes the baseline, written over it, where ci/gate.py
# --promote allows (its code named, no cell passed only on a second reading, a host not slower at
# dispatching than the baseline's); where it does not, the job fails and gate.txt says why.
promote=()
if [ "${STRATA_PROMOTE:-0}" = 1 ]; then
  if [ ! -f "$baseline" ]; then
    echo "ci/gpu.sh: STRATA_PROMOTE=1: no $baseline to gate against; a first baseline is committed by hand"; status=1
  elif [ "$status" != 0 ]; then
    echo "ci/gpu.sh: STRATA_PROMOTE=1: the job has already failed; the baseline is not refreshed from it"
  else
    promote=(--promote "$baseline")
  fi
fi
if [ -f "$baseline" ]; then
  rm -f "$outdir"/gate-first.txt "$outdir"/recheck*
  if ! python3 ci/gate.py "$outdir/bench-gated.json" "$baseline" --recheck-list "$outdir/recheck-cells.txt" \
      ${promote[@]+"${promote[@]}"} | tee "$outdir/gate.txt"; then
    # Cells that failed on time alone are measured again, each in a strata_bench process of its
    # own, and the gate takes the second reading of those (ci/gate.py says why); the first gate's
    # output stays beside it. At most STRATA_RECHECK_CELLS (default 8; 0: none) are measured again.
    if [ -s "$outdir/recheck-cells.txt" ] && [ "${STRATA_RECHECK_CELLS:-8}" -gt 0 ]; then
      echo "ci/gpu.sh: the cells that failed on time alone, measured again one by one"
      mv "$outdir/gate.txt" "$outdir/gate-first.txt"
      # Beside the baseline's own code where it can be built here: the two alternate on each cell,
      # and the gate takes the code's ratio to it (ci/gate.py --recheck-reference).
      recheck_t0=$(date +%s)
      [ "$(wc -l < "$outdir/recheck-cells.txt")" -le "${STRATA_RECHECK_CELLS:-8}" ] && reference_bench || true
      ref_args=() gate_ref=() budget_args=()
      # Within STRATA_RECHECK_BUDGET_S, the reference's build included: the rest is recheck.py's.
      if [ -n "${STRATA_RECHECK_BUDGET_S:-}" ]; then
        left=$(( STRATA_RECHECK_BUDGET_S - ($(date +%s) - recheck_t0) ))
        budget_args=(--budget-s "$(( left > 0 ? left : 0 ))")
      fi
      if [ -n "$ref_bin" ]; then
        ref_args=(--reference-bench "$ref_bin" --reference-out "$outdir/recheck-reference.json" --reference-label "$ref_label"
                  --reference-commit "$ref_commit" --rounds "${STRATA_RECHECK_ROUNDS:-4}")
        gate_ref=(--recheck-reference "$outdir/recheck-reference.json")
      fi
      python3 ci/recheck.py --cells "$outdir/recheck-cells.txt" --out "$outdir/recheck.json" \
        --max-cells "${STRATA_RECHECK_CELLS:-8}" --order-by "$outdir/bench-gated.json" ${budget_args[@]+"${budget_args[@]}"} \
        ${ref_args[@]+"${ref_args[@]}"} -- ./build/cuda/bench/strata_bench --device=cuda:0 \
        --benchmark_repetitions="$reps" ${STRATA_BENCH_ARGS:-} | tee "$outdir/recheck-log.txt" \
        || true  # a cell not measured again keeps its failure
      if [ -f "$outdir/recheck.json" ]; then
        { echo "The gate's first output is in gate-first.txt; cells marked 'again' below were gated on a second reading, 'paired' on their ratio to the baseline's own code measured beside them."
          grep -h "budget-s=" "$outdir/recheck-log.txt" | sed 's/^recheck.py: /note: /' || true
          python3 ci/gate.py "$outdir/bench-gated.json" "$baseline" --recheck "$outdir/recheck.json" ${gate_ref[@]+"${gate_ref[@]}"} \
            ${promote[@]+"${promote[@]}"}; } \
          | tee "$outdir/gate.txt" || status=1
      else
        cp "$outdir/gate-first.txt" "$outdir/gate.txt"
        status=1
      fi
    else
      status=1
    fi
  fi
elif [ "${STRATA_ALLOW_NO_BASELINE:-0}" = 1 ]; then
  note="Not gated: no reports/baselines/$gpu_key.json for this machine (STRATA_ALLOW_NO_BASELINE=1); this run's bench-gated.json is a candidate for it."
  echo "ci/gpu.sh: $note" | tee "$outdir/gate.txt"
else
  echo "ci/gpu.sh: no $baseline: commit a baseline for this machine or set STRATA_ALLOW_NO_BASELINE=1" | tee "$outdir/gate.txt"
  status=1
fi
# Capacity on an emulated 8 GiB card: the deepest gpt at gpt-871m's width each strategy trains
# (batch 2), measured beside the memory model's prediction (bench/capacity_main.cpp); its section
# joins the report.
capacity=()
if [ "$gate_only" != 1 ] && [ -x build/cuda/bench/strata_capacity ]; then
  echo "ci/gpu.sh: capacity on an emulated 8 GiB card"
  ./build/cuda/bench/strata_capacity --device=cuda:0 --model=gpt-871m --scale=depth --batch=2 --device-memory=8 \
    --max=32 --timeout=300 --json="$outdir/capacity-8g.json" > "$outdir/capacity-8g.txt" 2>&1 || status=1
  capacity=(--capacity "$outdir/capacity-8g.json")
fi
# Checkpoints of gpt-871m's whole training state on this machine's disk (in a folder of its own
# under $STRATA_CKPT_DIR, by default the output folder): save, load and the asynchronous save's wait per strategy
# (bench/checkpoint_bench.cpp), beside DCP from FSDP2 and torch.save (bench/peers.py
# --checkpoint-dir); their section joins the report.
checkpoints=()
if [ "$gate_only" != 1 ] && [ -x build/cuda/bench/strata_checkpoint ]; then
  echo "ci/gpu.sh: checkpoints of gpt-871m"
  mkdir -p "${STRATA_CKPT_DIR:-$outdir}"
  ckpt_dir=$(mktemp -d "${STRATA_CKPT_DIR:-$outdir}/strata-ckpt.XXXXXX")  # removed after; nothing else under it
  ./build/cuda/bench/strata_checkpoint bench --device=cuda:0 --model="${STRATA_PEERS_MODEL:-gpt-871m}" \
    --strategies=baseline,hook_offload,hook_offload_overlap,sharded,sharded_offload --repetitions=2 --dir="$ckpt_dir" \
    --json="$outdir/checkpoints.json" 2>&1 | tee "$outdir/checkpoints.txt" || status=1
  PYTHONUNBUFFERED=1 python3 bench/peers.py --model="${STRATA_PEERS_MODEL:-gpt-871m}" --checkpoint-dir="$ckpt_dir" \
    --repetitions=2 --out="$outdir/checkpoint-peers.json" 2>&1 | tee -a "$outdir/checkpoints.txt" || status=1
  rm -rf "$ckpt_dir"
  checkpoints=(--checkpoints "$outdir/checkpoints.json" --checkpoints "$outdir/checkpoint-peers.json")
fi
[ "$gate_only" = 1 ] || python3 reports/make_report.py --strata "$outdir/bench.json" --peers "$outdir/peers.json" --out "$outdir/report" \
  ${capacity[@]+"${capacity[@]}"} ${checkpoints[@]+"${checkpoints[@]}"} --machine "$gpu_name" --note "$matrix_note${matrix_note:+${note:+ }}$note" \
  --command "bash ci/gpu.sh  # $bench_command; bench/peers.py --model=${STRATA_PEERS_MODEL:-gpt-871m} --steps=3$more_peers" || status=1

exit $status
