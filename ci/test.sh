#!/usr/bin/env bash
# The README's test command: installs dependencies, builds on the CPU preset, runs every test.
# Tests labelled cuda are reported as skipped (with the reason) on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
start=$(date +%s)
cmake --preset cpu
cmake --build --preset cpu
ctest --preset cpu -j "$(nproc)" "$@"
echo "ci/test.sh: build and tests took $(( $(date +%s) - start )) s"
