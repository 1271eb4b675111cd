source out/g31-env.sh; t0=$(date +%s)
[ -d build/reference-src ] || cp -r out/ref-src build/reference-src
STRATA_GPU_PHASES=gate STRATA_REFERENCE_SRC=build/reference-src bash ci/gpu.sh $D > $OUT/gate-phase.txt 2>&1; echo "gate rc=$? at $(( $(date +%s) - t0 )) s"
tail -40 $OUT/gate-phase.txt; tar czf $OUT/g31d.tgz --exclude='*.log' $D; true
