#!/usr/bin/env bash
# The README's main command: installs dependencies, builds, and runs the strategy comparison on
# the default model (a tiny GPT on the CPU, a larger one when a GPU is present).
# Extra arguments go to strata_compare (e.g. --model=gpt-small --steps=10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
cmake --preset cpu
cmake --build --preset cpu --target strata_compare
./build/cpu/bench/strata_compare "$@"
