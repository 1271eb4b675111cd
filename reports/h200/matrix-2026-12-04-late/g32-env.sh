source .deps/activate
if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  export CMAKE_PREFIX_PATH="$torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
export STRATA_BENCH_REPS=5 STRATA_OFFLOAD_PY=out/offload.py STRATA_COMMIT=42b53c32eff15486d9df867c3185f55b0ec1e3dd
D=build/cuda/g32
