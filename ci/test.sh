#!/usr/bin/env bash
# The README's test command: installs dependencies, builds on the CPU preset, runs every test.
# Tests labelled cuda are reported as skipped (with the reason) on machines without a GPU; built
# against a LibTorch without CUDA, one test labelled cuda stands for them all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
start=$(date +%s)
cmake --preset cpu
cmake --build --preset cpu
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "ci/test.sh: no CUDA device here: tests labelled cuda will be reported as skipped (each prints the reason)"
fi
ctest --preset cpu -j "$(nproc)" "$@"
echo "ci/test.sh: build and tests took $(( $(date +%s) - start )) s"
