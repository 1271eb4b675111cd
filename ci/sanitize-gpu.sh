#!/usr/bin/env bash
# The cuda label's tests under NVIDIA's compute-sanitizer, on a GPU machine: memcheck over every
# test (property cases cut to a few, since the tool slows each kernel many times over), then
# racecheck and synccheck over the tests that run strategies' kernels with side streams
# (hook_offload, the parity of every strategy on the presets). Exit 1 when a tool reports an error
# or a test fails under it, or when a tool ran past its time box (the tests it did not reach are
# then unchecked: the summary says how many completed).
#
#   ci/sanitize-gpu.sh [OUTDIR] [BUILD_DIR]     defaults: build/cuda/sanitize build/cuda
#
# Environment: STRATA_SANITIZE_TOOLS (default "memcheck racecheck synccheck"),
# STRATA_SANITIZE_TIMEOUT (seconds per tool, default 900), STRATA_SANITIZE_FILTER (a gtest filter
# in place of each tool's own), STRATA_SANITIZE_SHARDS (processes per
# tool, each running every N-th test through GoogleTest's sharding; default 4: the tool's cost is
# mostly on the host, so shards on a many-core host share one GPU well).
set -uo pipefail
cd "$(dirname "$0")/.."
outdir=$(realpath -m "${1:-build/cuda/sanitize}")
build=${2:-build/cuda}
shards=${STRATA_SANITIZE_SHARDS:-4}
case "$shards" in ''|*[!0-9]*|0) echo "ci/sanitize-gpu.sh: STRATA_SANITIZE_SHARDS='$shards' is not a positive whole number" >&2; exit 2;; esac
mkdir -p "$outdir"
tests="$build/correctness/strata_tests"
[ -x "$tests" ] || { echo "ci/sanitize-gpu.sh: $tests is not built (cmake --build --preset cuda)"; exit 2; }
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
[ -n "$sanitizer" ] || { echo "ci/sanitize-gpu.sh: compute-sanitizer not found"; exit 2; }
# Counts what a tool reported in its logs: "<reports> <known>". Known: NCCL, creating a
# communicator, asks for the attributes of kernels it carries for other GPU generations
# (cudaFuncGetAttributes, then cudaGetLastError, answer cudaErrorNoKernelImageForDevice) and goes on;
# memcheck reports each such call. Every other report (a bad access, a race, a failed API call of
# strata or LibTorch, a process that did not end cleanly) counts against the run.
classify='
  function close_record() { if (open) { reports++; if (probe && no_image) known++ } open = 0 }
  /^========= [^ ]/ {
    close_record()
    if ($0 ~ /^========= (COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)/) next
    open = 1; probe = 0; no_image = ($0 ~ /cudaErrorNoKernelImageForDevice/)
    next
  }
  /^=========     / { if (open && $0 ~ /Host Frame: ncclInitKernelsForDevice/) probe = 1; next }
  { close_record() }
  END { close_record(); print reports + 0, known + 0 }'
status=0
for tool in ${STRATA_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  # The launched tests (Distributed*) mean something only as ranks of a launcher; ctest runs them so.
  filter='-MultiGpu.*:Distributed.*:DistributedFault.*:DistributedPipeline.*'
  [ "$tool" = memcheck ] || filter='HookOffload.*:Registered/Parity.tiny_presets_match_baseline/*:Device.*'
  filter=${STRATA_SANITIZE_FILTER:-$filter}
  start=$(date +%s)
  rm -f "$outdir/$tool".*.log
  pids=()
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
    RC_PARAMS="seed=20261130 max_success=3 max_size=100 verbose_progress=0" \
      timeout "${STRATA_SANITIZE_TIMEOUT:-900}" "$sanitizer" --tool "$tool" --error-exitcode 86 \
      "$tests" --device=cuda --gtest_filter="$filter" > "$outdir/$tool.$i.log" 2>&1 &
    pids+=($!)
  done
  rcs=()
  for pid in "${pids[@]}"; do wait "$pid"; rcs+=($?); done
  completed=$(cat "$outdir/$tool".*.log | grep -cE "^\[ +OK \]")
  failed=$(cat "$outdir/$tool".*.log | grep -E "^\[  FAILED  \] [A-Za-z]" | sed 's/ (.*//' | sort -u | wc -l)
  read -r reports known < <(awk "$classify" "$outdir/$tool".*.log)
  timed_out=0
  for rc in "${rcs[@]}"; do [ "$rc" -eq 124 ] && timed_out=$((timed_out + 1)); done
  echo "$tool: shard exit codes ${rcs[*]} in $(( $(date +%s) - start )) s; tests passed $completed, failed $failed;" \
    "reports $reports ($known of them NCCL's kernel-image probe); shards past the time box $timed_out" \
    | tee -a "$outdir/summary.txt"
  # A shard exits 86 when the tool reported anything, the known probe included: judge by the
  # reports themselves, the tests' results and the time box.
  [ $((reports - known)) -eq 0 ] && [ "$failed" -eq 0 ] && [ "$timed_out" -eq 0 ] || status=1
  for rc in "${rcs[@]}"; do [ "$rc" -eq 0 ] || [ "$rc" -eq 86 ] || [ "$rc" -eq 124 ] || status=1; done
done
exit $status
