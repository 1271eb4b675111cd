#!/usr/bin/env bash
# The README's main command: installs dependencies, builds, runs the benchmark matrix of every
# registered strategy on the default models (gpt-cpu and bert-tiny on the CPU; gpt-medium and gpt-871m on a
# GPU), and writes a Markdown report with plots to build/report/ (or OUTDIR).
#
#   ci/compare.sh [OUTDIR] [strata_bench arguments, e.g. --models=gpt-small --steps=10]
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
outdir=build/report
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then outdir=$1; shift; fi
mkdir -p "$outdir"
cmake --preset cpu
cmake --build --preset cpu --target strata_bench
./build/cpu/bench/strata_bench "$@" --benchmark_out="$outdir/bench.json" --benchmark_out_format=json
python=python3
python3 -c 'import matplotlib' 2>/dev/null || python=/usr/bin/python3  # the apt one has matplotlib
"$python" reports/make_report.py --strata "$outdir/bench.json" --out "$outdir" --machine "$(hostname)" \
  --command "bash ci/compare.sh $*"
echo "ci/compare.sh: report at $outdir/report.md"
