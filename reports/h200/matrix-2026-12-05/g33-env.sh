source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
export STRATA_BENCH_REPS=5 STRATA_OFFLOAD_PY=out/offload.py STRATA_COMMIT=adfa04d8a123942722f46402266a1260ce55cf05
D=build/cuda/g33
