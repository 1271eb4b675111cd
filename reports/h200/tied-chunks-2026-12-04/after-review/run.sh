set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; t0=$(date +%s)
P=/tmp/f29; mkdir -p $P
(cmake --preset cuda && cmake --build --preset cuda -j 16) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
ctest --preset cuda -L cuda -j 8 > $P/ctest-cuda.log 2>&1; rc=$?
grep -E "tests passed|Failed|\*\*\*|Total Test" $P/ctest-cuda.log | tail -20
echo "ctest rc=$rc at $(( $(date +%s) - t0 )) s"
grep -E "tied_first_part|later_ranges|failed_backward_waits" $P/ctest-cuda.log
./build/cuda/bench/strata_ab --device=cuda:0 --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8' > $P/ab-medium-fp32-8.txt 2>&1; echo "ab rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-medium-fp32-8.txt
tar czf $OUT/f29.tgz -C /tmp f29
