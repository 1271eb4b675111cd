source out/g31-env.sh; t0=$(date +%s)
STRATA_GPU_PHASES=matrix bash ci/gpu.sh $D > $OUT/matrix-phase.txt 2>&1; echo "matrix rc=$? at $(( $(date +%s) - t0 )) s"
tail -15 $OUT/matrix-phase.txt; tar czf $OUT/g31b.tgz $D
