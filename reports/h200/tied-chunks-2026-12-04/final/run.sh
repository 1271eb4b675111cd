set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; nproc; t0=$(date +%s)
P=/tmp/g30a; mkdir -p $P
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
ctest --preset cuda -L cuda -j 8 > $P/ctest-cuda.log 2>&1; rc=$?
grep -E "tests passed|Failed|\*\*\*|Total Test" $P/ctest-cuda.log | tail -20
echo "ctest rc=$rc at $(( $(date +%s) - t0 )) s"
grep -E "spans_taken|tied_first_part|later_ranges" $P/ctest-cuda.log
B=./build/cuda/bench
ab() { $B/strata_ab --device=cuda:0 "$@" > $P/ab-$tag.txt 2>&1; echo "ab $tag rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-$tag.txt; }
tag=medium-bf16-8; ab --model=gpt-medium --precision=bf16 --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tag=medium-fp32-8; ab --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tar czf $OUT/g30a.tgz -C /tmp g30a
tag=871m-fp32-8; ab --model=gpt-871m --steps=10 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tar czf $OUT/g30a.tgz -C /tmp g30a
tag=871m-bf16-8; ab --model=gpt-871m --precision=bf16 --steps=10 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
tar czf $OUT/g30a.tgz -C /tmp g30a
echo "total $(( $(date +%s) - t0 )) s"
