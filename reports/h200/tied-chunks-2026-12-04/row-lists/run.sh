set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; nproc; t0=$(date +%s)
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
P=/tmp/c29; mkdir -p $P
ctest --preset cuda -L cuda -j 8 > $P/ctest-cuda.log 2>&1; rc=$?
grep -E "tests passed|Failed|\*\*\*|Total Test" $P/ctest-cuda.log | tail -20
echo "ctest rc=$rc at $(( $(date +%s) - t0 )) s"
./build/cuda/correctness/strata_tests --gtest_filter='HookOffload.a_tied_first_part*' > $P/ranges-cuda.txt 2>&1; echo "ranges test rc=$?"; grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) " $P/ranges-cuda.txt
B=./build/cuda/bench
ab() { $B/strata_ab --device=cuda:0 "$@" > $P/ab-$tag.txt 2>&1; echo "ab $tag rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-$tag.txt; }
tag=medium-fp32-8; ab --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tag=medium-fp32-4; ab --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=4'
tag=871m-fp32-8; ab --model=gpt-871m --steps=10 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tag=medium-bf16-8; ab --model=gpt-medium --precision=bf16 --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tag=medium-fp32-8-again; ab --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
$B/strata_bench --device=cuda:0 --models=gpt-medium,gpt-871m --strategies=hook_offload_overlap --options="tied_chunks=8" \
  --benchmark_out=$P/peak-chunks8.json --benchmark_out_format=json > $P/peak-chunks8.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^hook_offload_overlap" $P/peak-chunks8.txt | sed -E 's/ +[0-9.]+ ms +[0-9.]+ ms +[0-9]+ / /' | tr ' ' '\n' | grep -E "^hook|peak_alloc|peak_res|fwd_bwd_ms|host_update_ms"
$B/strata_compare --device=cuda:0 --model=gpt-medium --steps=3 --strategies=hook_offload_overlap --options="tied_chunks=8" --profile=$P/ch8 --profile-steps=2 > $P/ch8.txt 2>&1; echo "profile rc=$?"
T=$(ls $P/ch8/*.json | head -1)
python3 bench/step_trace.py $T --idle-us 200 --min-mb 20 > $P/step_trace-ch8.txt 2>&1; echo "trace rc=$?"
gzip $T
tar czf $OUT/c29.tgz -C /tmp c29
echo "total $(( $(date +%s) - t0 )) s"
sed -n '/host updates/,/copies of/p' $P/step_trace-ch8.txt | tail -13
