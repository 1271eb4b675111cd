set -uo pipefail
source out/g33-env.sh; lscpu | grep "Model name"; nproc; t0=$(date +%s)
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
timeout 60 build/cuda/correctness/strata_tests --device=cuda --gtest_filter='Device.attaching*' > $OUT/guard.log 2>&1; echo "guard test rc=$?"
grep -E 'oneDNN|OK \]|SKIPPED \]|FAILED' $OUT/guard.log | head -4
timeout 330 ctest --preset cuda -L cuda -j 8 > $OUT/ctest-cuda.log 2>&1; rc=$?
grep -E "tests passed|Failed|\*\*\*|Total Test" $OUT/ctest-cuda.log | tail -20
echo "ctest rc=$rc at $(( $(date +%s) - t0 )) s"
