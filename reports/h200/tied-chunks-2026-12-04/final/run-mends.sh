source out/g30-env.sh; t0=$(date +%s)
(cmake --preset cuda && cmake --build --preset cuda -j 16 --target strata_tests) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
ctest --preset cuda -L cuda -R "HookOffload|Optimizers|Generators" -j 8 > $OUT/ctest-cuda-mends.log 2>&1; echo "ctest rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "tests passed|Failed|\*\*\*|Total Test" $OUT/ctest-cuda-mends.log | tail -8
