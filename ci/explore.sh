#!/usr/bin/env bash
# The parity explorer: runs every parity property (every registered strategy, preset kinds and
# chain models) with fresh random seeds and many more cases than CI, round after round, until the
# time is up. A failure is shrunk by rapidcheck and appended, in the committed file's format, to
# the regression file that CI replays (review it, fix the cause, commit it).
#
#   ci/explore.sh [MINUTES] [DEVICE] [BUILD_DIR]     defaults: 20 cpu build/cpu
#
# Environment: STRATA_EXPLORE_CASES (cases per property per round, default 200),
# STRATA_FAILURES_FILE (where failures go, default correctness/regressions.txt),
# STRATA_EXPLORE_FILTER (gtest filter, default every property).
# Exit status: 0 when nothing failed, 1 when failures were recorded, 2 for a usage or build error.
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-20}
device=${2:-cpu}
build=${3:-build/cpu}
cases=${STRATA_EXPLORE_CASES:-200}
export STRATA_FAILURES_FILE=$(realpath -m "${STRATA_FAILURES_FILE:-correctness/regressions.txt}")
filter=${STRATA_EXPLORE_FILTER:-*prop_*}
case "$minutes" in ''|*[!0-9]*) echo "ci/explore.sh: MINUTES='$minutes' is not a whole number" >&2; exit 2;; esac
tests="$build/correctness/strata_tests"
[ -x "$tests" ] || { echo "ci/explore.sh: $tests is not built (cmake --build --preset ${build#build/})" >&2; exit 2; }
# The two-GPU properties run only when asked for (STRATA_EXPLORE_FILTER='MultiGpu.*', two GPUs).
[ -n "${STRATA_EXPLORE_FILTER:-}" ] || filter="$filter:-MultiGpu.*"
before=$(grep -vc '^#' "$STRATA_FAILURES_FILE" 2>/dev/null || echo 0)
end=$(( $(date +%s) + minutes * 60 ))
round=0 failed_rounds=0
echo "ci/explore.sh: $minutes min on $device, $cases cases per property per round; failures go to $STRATA_FAILURES_FILE"
while [ "$(date +%s)" -lt "$end" ]; do
  round=$((round + 1))
  seed=$(( (RANDOM << 30) ^ (RANDOM << 15) ^ RANDOM ))
  log=$(mktemp)
  start=$(date +%s)
  RC_PARAMS="seed=$seed max_success=$cases max_size=100 verbose_progress=0" OMP_NUM_THREADS=2 \
    timeout $(( end - start + 600 )) "$tests" --device="$device" --gtest_filter="$filter" > "$log" 2>&1
  rc=$?
  summary=$(grep -E "^\[  (PASSED|FAILED)  \]" "$log" | head -n 2 | tr '\n' ' ')
  echo "round $round seed=$seed: rc=$rc in $(( $(date +%s) - start )) s; $summary"
  if [ "$rc" -ne 0 ]; then
    failed_rounds=$((failed_rounds + 1))
    grep -E "^\[  FAILED  \]|Falsifiable|^  [a-z]+\(" "$log" | head -n 20
    mkdir -p build && cp "$log" "build/explore-failure-$seed.log"
  fi
  rm -f "$log"
done
after=$(grep -vc '^#' "$STRATA_FAILURES_FILE" 2>/dev/null || echo 0)
echo "ci/explore.sh: $round rounds, $failed_rounds failed; $(( after - before )) new cases in $STRATA_FAILURES_FILE"
[ "$failed_rounds" -eq 0 ]
