#!/usr/bin/env bash
# Installs what strata builds and runs with on Debian 12 / Ubuntu 24.04. Idempotent: installs only
# what is missing, and touches apt's lists only then.
# libopenblas0-openmp: Debian's LibTorch multiplies matrices through the system's libblas.so.3, and
# without an optimized one installed that is the reference BLAS, about 50 times slower (a 2-core CI
# machine measured 2.4 GFLOP/s against OpenBLAS's 134; a one-cell strata_bench run, 29.5 s against
# 1.6 s). Its OpenMP build shares LibTorch's OpenMP threads instead of adding a pool of its own.
# python3-yaml: ci/check_workflows.py parses .github/workflows/ (a CPU test).
# python3-torch: PyTorch reads strata's checkpoint files (StateFiles.pytorch_loads_the_files), and
# brings torchrun.
set -euo pipefail
packages=(build-essential cmake ninja-build ccache
          libtorch-dev libgloo-dev libgtest-dev libgmock-dev libbenchmark-dev libbenchmark-tools librapidcheck-dev
          libopenblas0-openmp python3 python3-matplotlib python3-yaml python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "ci/setup.sh: all ${#packages[@]} packages present"
  exit 0
fi
echo "ci/setup.sh: installing ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
