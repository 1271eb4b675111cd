#!/bin/sh
# Installs strata from BUILD_DIR into WORK_DIR/prefix, builds this directory's trainer against that
# installation alone (not the source tree), and runs it: training with a registered strategy and
# the parity checker on the trainer's own model. Fails when the package is incomplete (a header,
# a library, a registration or the package config missing).
#   check.sh BUILD_DIR WORK_DIR TORCH_DIR [STRATEGY]
set -eu
build=$1 work=$2 torch_dir=$3 strategy=${4:-hook_offload}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
launcher=
command -v ccache > /dev/null && launcher=-DCMAKE_CXX_COMPILER_LAUNCHER=ccache
cmake -S "$here" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DTorch_DIR="$torch_dir" $launcher > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build"
# A few generated cases, the same on every run (the suite's own properties run with a fixed seed too).
RC_PARAMS=${RC_PARAMS:-"seed=20261201 max_success=15 verbose_progress=0"} "$work/build/trainer" "$strategy" 30
