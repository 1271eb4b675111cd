#!/usr/bin/env bash
# The cuda label's tests under NVIDIA's compute-sanitizer, on a GPU machine: memcheck over every
# test (property cases cut to a few, since the tool slows each kernel many times over), then
# racecheck and synccheck over the tests that run strategies' kernels with side streams
# (hook_offload, the parity of every strategy on the presets). Exit 1 when a tool reports an error
# or a test fails under it.
#
#   ci/sanitize-gpu.sh [OUTDIR] [BUILD_DIR]     defaults: build/cuda/sanitize build/cuda
#
# Environment: STRATA_SANITIZE_TOOLS (default "memcheck racecheck synccheck"),
# STRATA_SANITIZE_TIMEOUT (seconds per tool, default 900).
set -uo pipefail
cd "$(dirname "$0")/.."
outdir=$(realpath -m "${1:-build/cuda/sanitize}")
build=${2:-build/cuda}
mkdir -p "$outdir"
tests="$build/correctness/strata_tests"
[ -x "$tests" ] || { echo "ci/sanitize-gpu.sh: $tests is not built (cmake --build --preset cuda)"; exit 2; }
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
[ -n "$sanitizer" ] || { echo "ci/sanitize-gpu.sh: compute-sanitizer not found"; exit 2; }
status=0
for tool in ${STRATA_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  filter='-MultiGpu.*'
  [ "$tool" = memcheck ] || filter='HookOffload.*:Registered/Parity.tiny_presets_match_baseline/*:Device.*'
  start=$(date +%s)
  RC_PARAMS="seed=20261130 max_success=3 max_size=100 verbose_progress=0" \
    timeout "${STRATA_SANITIZE_TIMEOUT:-900}" "$sanitizer" --tool "$tool" --error-exitcode 86 \
    "$tests" --device=cuda --gtest_filter="$filter" > "$outdir/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED)  \]" "$outdir/$tool.log" | tr '\n' ' ')
  echo "$tool: rc=$rc in $(( $(date +%s) - start )) s; $summary" | tee -a "$outdir/summary.txt"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
