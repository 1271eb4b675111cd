source out/g30-env.sh; t0=$(date +%s); lscpu | grep "Model name"
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
