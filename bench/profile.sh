#!/usr/bin/env bash
# Kernel-level comparison of strata's one-GPU steps with PyTorch's (bench/notes/reference-speed.md):
# strata_compare times baseline, baseline_checkpoint and hook_offload and records one
# forward+backward of each with LibTorch's profiler; bench/peers.py does the same for PyTorch's
# plain and checkpointed model with torch.profiler; bench/kernel_table.py puts each strata trace
# beside its PyTorch counterpart (GPU busy time, kernels by class, top kernels).
#
#   bench/profile.sh BUILD_DIR OUTDIR [MODEL=gpt-871m] [STEPS=5]
#
# Outputs: OUTDIR/strata.txt and OUTDIR/peers.json (timings of this run), OUTDIR/traces/*.json,
# OUTDIR/kernels-<pair>.md. Needs a CUDA build and python3 with torch.
set -uo pipefail
build=${1:?BUILD_DIR}
out=$(realpath -m "${2:?OUTDIR}")
model=${3:-gpt-871m}
steps=${4:-5}
cd "$(dirname "$0")/.."
mkdir -p "$out/traces"
status=0
"$build/bench/strata_compare" --device=cuda:0 --model="$model" --steps="$steps" \
  --strategies=baseline,baseline_checkpoint,hook_offload --profile="$out/traces" > "$out/strata.txt" 2>&1 || status=1
cat "$out/strata.txt"
python3 bench/peers.py --model="$model" --steps="$steps" --peers=torch_baseline,torch_checkpoint \
  --profile="$out/traces" --out="$out/peers.json" 2>&1 | tee "$out/peers.txt" | grep -v "^$" || status=1
t="$out/traces"
for pair in "baseline torch_baseline" "baseline_checkpoint torch_checkpoint" "hook_offload torch_checkpoint"; do
  set -- $pair
  if [ -f "$t/$1.trace.json" ] && [ -f "$t/$2.trace.json" ]; then
    python3 bench/kernel_table.py "$t/$1.trace.json" "$t/$2.trace.json" --labels "strata $1,PyTorch $2" \
      --markdown "$out/kernels-$1.md" > /dev/null || status=1
    echo "== $1 vs $2"; head -n 30 "$out/kernels-$1.md"
  else
    echo "bench/profile.sh: no trace pair for $1 / $2" >&2; status=1
  fi
done
exit $status
