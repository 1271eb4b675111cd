set -uo pipefail
source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
lscpu | grep "Model name"; t0=$(date +%s)
(cmake --preset cuda && cmake --build --preset cuda -j 16 --target strata_compare strata_ab) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
P=/tmp/prof29; mkdir -p $P
for o in 0 1; do
  ./build/cuda/bench/strata_compare --device=cuda:0 --model=gpt-medium --steps=3 --strategies=hook_offload_overlap --options="tied_early=$o" --profile=$P/te$o --profile-steps=2 > $P/te$o.txt 2>&1; echo "profile te$o rc=$?"
  T=$(ls $P/te$o/*.json | head -1)
  python3 bench/step_trace.py $T --idle-us 200 --min-mb 20 > $P/step_trace-te$o.txt 2>&1; echo "trace rc=$?"
  python3 bench/kernel_table.py $T --gaps 12 --markdown $P/kernels-te$o.md > $P/kernels-te$o.txt 2>&1
  gzip $T
done
./build/cuda/bench/strata_ab --device=cuda:0 --model=gpt-medium --steps=20 --run=5 --a=hook_offload_overlap --b='hook_offload_overlap:tied_early=1' > $P/ab-medium-again.txt 2>&1
grep -E "^[AB] |B - A (fwd|step|host)" $P/ab-medium-again.txt
tar czf $OUT/prof29.tgz -C /tmp prof29
echo "at $(( $(date +%s) - t0 )) s"
