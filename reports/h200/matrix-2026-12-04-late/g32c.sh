source out/g32-env.sh; t0=$(date +%s)
timeout 560 env STRATA_GPU_PHASES=bench STRATA_RECHECK_CELLS=0 bash ci/gpu.sh $D > $OUT/bench-phase.txt 2>&1; echo "bench rc=$? at $(( $(date +%s) - t0 )) s"
tail -40 $OUT/bench-phase.txt; tar czf $OUT/g32c.tgz --exclude='*.log' $D; cp $D/*.log $OUT/ 2>/dev/null; true
