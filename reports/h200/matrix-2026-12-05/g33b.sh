source out/g33-env.sh; t0=$(date +%s)
timeout 560 env STRATA_GPU_PHASES=matrix bash ci/gpu.sh $D > $OUT/matrix-phase.txt 2>&1; echo "matrix rc=$? at $(( $(date +%s) - t0 )) s"
tail -15 $OUT/matrix-phase.txt; tar czf $OUT/g33b.tgz $D
