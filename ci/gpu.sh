#!/usr/bin/env bash
# The GPU-runner job: build with CUDA, run the whole correctness suite (cpu and cuda labels), then
# the comparison on the GPU. Logs and results go to OUTDIR (default build/cuda/results).
#
#   ci/gpu.sh [OUTDIR]
#
# Needs a CUDA LibTorch and the test libraries (GoogleTest, rapidcheck, Google Benchmark) on
# CMAKE_PREFIX_PATH; the LibTorch inside python3's torch is added when present.
set -euo pipefail
cd "$(dirname "$0")/.."
outdir=$(realpath -m "${1:-build/cuda/results}")
mkdir -p "$outdir"
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$outdir/gpu.txt" || true

t0=$(date +%s)
cmake --preset cuda 2>&1 | tee "$outdir/build.log" | tail -n 3
cmake --build --preset cuda -j "$(nproc)" 2>&1 | tee -a "$outdir/build.log" | grep -E "error|warning: |FAILED" || true
[ -x build/cuda/correctness/strata_tests ] || { echo "ci/gpu.sh: build failed, see $outdir/build.log"; exit 1; }
t1=$(date +%s)
echo "ci/gpu.sh: configure + build took $((t1 - t0)) s"

status=0
ctest --preset cuda -j 8 > "$outdir/ctest.log" 2>&1 || status=$?
tail -n 25 "$outdir/ctest.log"
for label in cpu cuda multigpu; do
  ran=$(grep -c "Test *#[0-9]*: $label\." "$outdir/ctest.log" || true)
  passed=$(grep -E "Test *#[0-9]*: $label\..*Passed" -c "$outdir/ctest.log" || true)
  echo "label $label: $passed passed of $ran"
done | tee "$outdir/labels.txt"
t2=$(date +%s)
echo "ci/gpu.sh: tests took $((t2 - t1)) s"

./build/cuda/bench/strata_compare --device=cuda:0 2>&1 | tee "$outdir/compare.txt" || status=1
exit $status
