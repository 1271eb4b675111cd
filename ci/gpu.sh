#!/usr/bin/env bash
# The GPU-runner job: build with CUDA, run the whole correctness suite (labels cpu, cuda, multigpu),
# run the benchmark matrix and PyTorch's peers, write the report, and gate the run against the
# committed baseline for this GPU model (reports/baselines/<gpu>.json; thresholds in ci/gate.py and
# bench/METRICS.md). The gate is also shown to pass on the run itself and to fail on a doctored
# copy, so a broken gate cannot pass silently.
#
#   ci/gpu.sh [OUTDIR]        (default build/cuda/results)
#
# Needs a CUDA LibTorch and the test libraries (GoogleTest, rapidcheck, Google Benchmark) on
# CMAKE_PREFIX_PATH; the LibTorch inside python3's torch is added when present.
# Environment: STRATA_BENCH_ARGS (extra strata_bench arguments), STRATA_PEERS_MODEL (default
# gpt-871m), STRATA_OFFLOAD_PY (seed 003's offload.py, default ../shared/seeds/offload.py),
# STRATA_WIDE_CLASSES (with two or more GPUs: the class count of seed 000's model that the
# baseline cannot train on one GPU; default 8,250,000, above the 7,968,750 one H200 trains).
#
# With two or more GPUs the matrix gains cells over cuda:0 and cuda:1 (manual_split of the GPT;
# seed 000's BERT with its classifier on the second GPU, at 6M classes and at a count one GPU
# cannot train; the classifier column-split over both) and the machine's key becomes
# <gpu>-x<count>, so its baseline and report are its own.
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

t0=$(date +%s)
cmake --preset cuda > "$outdir/build.log" 2>&1
cmake --build --preset cuda -j "$(nproc)" >> "$outdir/build.log" 2>&1 || { tail -n 30 "$outdir/build.log"; exit 1; }
echo "ci/gpu.sh: configure + build took $(( $(date +%s) - t0 )) s"

status=0
ctest --preset cuda -j 8 > "$outdir/ctest.log" 2>&1 || status=$?
grep -E "tests passed|Failed|Skipped" "$outdir/ctest.log" | tail -n 12
for label in cpu cuda multigpu; do
  ran=$(grep -cE "Test +#[0-9]+: $label\." "$outdir/ctest.log" || true)
  passed=$(grep -cE "Test +#[0-9]+: $label\..*Passed" "$outdir/ctest.log" || true)
  skipped=$(grep -cE "Test +#[0-9]+: $label\..*Skipped" "$outdir/ctest.log" || true)
  echo "label $label: $passed passed, $skipped skipped, of $ran"
done | tee "$outdir/labels.txt"

echo "ci/gpu.sh: benchmark matrix"
./build/cuda/bench/strata_bench --device=cuda:0 ${STRATA_BENCH_ARGS:-} \
  --benchmark_out="$outdir/bench.json" --benchmark_out_format=json > "$outdir/bench.txt" 2>&1 || status=1
tail -n 20 "$outdir/bench.txt"
bench_command="strata_bench --device=cuda:0 ${STRATA_BENCH_ARGS:-}"
if [ "$gpu_count" -gt 1 ]; then
  echo "ci/gpu.sh: cells over two GPUs"
  wide=${STRATA_WIDE_CLASSES:-8250000}  # bench/NOTES.md: one H200 trains at most 7,968,750
  two=cuda:0,cuda:1
  # The matrix's measured matmul peak, so every cell's MFU has the same denominator.
  peak=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["context"]["peak_tflops"])' "$outdir/bench.json")
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
    read -r -a cell_args <<< "${cell#*|}"
    ./build/cuda/bench/strata_bench --device=cuda:0 --peak-tflops="$peak" ${STRATA_BENCH_ARGS:-} "${cell_args[@]}" \
      --benchmark_out="$outdir/bench-2gpu-$tag.json" --benchmark_out_format=json > "$outdir/bench-2gpu-$tag.txt" 2>&1 || status=1
    grep -E "^(baseline|manual_split)" "$outdir/bench-2gpu-$tag.txt" | cut -c1-160
    cell_files+=("$outdir/bench-2gpu-$tag.json")
    bench_command+="; strata_bench --device=cuda:0 ${STRATA_BENCH_ARGS:-} ${cell#*|}"
  done
  # One file for the gate: the matrix and the two-GPU cells.
  python3 - "$outdir/bench.json" "${cell_files[@]}" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for extra in sys.argv[2:]:
    doc["benchmarks"] += json.load(open(extra))["benchmarks"]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
fi
offload_py=${STRATA_OFFLOAD_PY:-../shared/seeds/offload.py}
echo "ci/gpu.sh: PyTorch peers"
PYTHONUNBUFFERED=1 python3 bench/peers.py --model="${STRATA_PEERS_MODEL:-gpt-871m}" --offload-py="$offload_py" \
  --steps=3 --out="$outdir/peers.json" 2>&1 | tee "$outdir/peers.txt" || true
python3 reports/make_report.py --strata "$outdir/bench.json" --peers "$outdir/peers.json" --out "$outdir/report" \
  --machine "$gpu_name" --command "bash ci/gpu.sh  # $bench_command; bench/peers.py --model=${STRATA_PEERS_MODEL:-gpt-871m} --steps=3" || status=1

# The gate: against the committed baseline for this GPU, when there is one.
baseline="reports/baselines/$gpu_key.json"
if [ -f "$baseline" ]; then
  python3 ci/gate.py "$outdir/bench.json" "$baseline" | tee "$outdir/gate.txt" || status=1
else
  echo "ci/gpu.sh: no $baseline yet; this run's bench.json is a candidate for it" | tee "$outdir/gate.txt"
fi
# Self-test of the gate: it passes on the run itself and fails on a baseline claiming 20% more
# throughput for one cell.
python3 ci/gate.py "$outdir/bench.json" "$outdir/bench.json" > "$outdir/gate_self.txt" || { echo "gate self-test: FAILED on itself"; status=1; }
python3 - "$outdir/bench.json" "$outdir/doctored.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
cell = next(b for b in doc["benchmarks"] if not b.get("error_occurred"))
cell["items_per_second"] *= 1.2
json.dump(doc, open(sys.argv[2], "w"))
print("doctored baseline: +20% throughput for", cell["name"])
PY
if python3 ci/gate.py "$outdir/bench.json" "$outdir/doctored.json" > "$outdir/gate_doctored.txt"; then
  echo "gate self-test: the doctored baseline PASSED — the gate is broken"; status=1
else
  echo "gate self-test: passes on itself, fails on the doctored baseline:"; grep -A3 "gate: FAIL" "$outdir/gate_doctored.txt"
fi
exit $status
