set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; t0=$(date +%s)
P=/tmp/e29; mkdir -p $P
(cmake --preset cuda && cmake --build --preset cuda -j 16 --target strata_ab) > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
B=./build/cuda/bench
ab() { $B/strata_ab --device=cuda:0 "$@" > $P/ab-$tag.txt 2>&1; echo "ab $tag rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-$tag.txt; }
tag=871m-fp32-8; ab --model=gpt-871m --steps=10 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_chunks=8'
PYTHONUNBUFFERED=1 python3 bench/host_link_contention.py --out=$P/contention-3.json 2>&1 | tee $P/contention-3.txt
tar czf $OUT/e29.tgz -C /tmp e29
echo "total $(( $(date +%s) - t0 )) s"
