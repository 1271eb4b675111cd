set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; nproc; git log --oneline -1; t0=$(date +%s)
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
P=/tmp/t29; mkdir -p $P
ctest --preset cuda -L cuda -j 8 > $P/ctest-cuda.log 2>&1; rc=$?
grep -E "tests passed|Failed|\*\*\*|Total Test" $P/ctest-cuda.log | tail -20
echo "ctest rc=$rc at $(( $(date +%s) - t0 )) s"
./build/cuda/correctness/strata_tests --gtest_filter='HookOffload.*tied_early*:HookOffload.an_early_tied*' > $P/tied-cuda.txt 2>&1; echo "tied tests rc=$?"; grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) " $P/tied-cuda.txt | head -20
B=./build/cuda/bench
ab() { $B/strata_ab --device=cuda:0 "$@" > $P/ab-$tag.txt 2>&1; echo "ab $tag rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-$tag.txt; }
tag=medium-fp32; ab --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_early=1'
tag=871m-fp32; ab --model=gpt-871m --steps=10 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_early=1'
tag=medium-bf16; ab --model=gpt-medium --precision=bf16 --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_early=1'
for o in 0 1; do
  $B/strata_bench --device=cuda:0 --models=gpt-medium,gpt-871m --strategies=hook_offload_overlap --options="tied_early=$o" \
    --benchmark_out=$P/peak-tied$o.json --benchmark_out_format=json > $P/peak-tied$o.txt 2>&1
  echo "bench tied_early=$o rc=$? at $(( $(date +%s) - t0 )) s"
  python3 -c "
import json; d=json.load(open('$P/peak-tied$o.json'))
for b in d['benchmarks']: print(b['name'], {k: round(v,2) for k,v in b.items() if isinstance(v,(int,float)) and ('peak' in k or k in ('step_ms','fwd_bwd_ms'))})"
done
tar czf $OUT/t29.tgz -C /tmp t29
echo "total $(( $(date +%s) - t0 )) s"
