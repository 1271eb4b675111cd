#!/usr/bin/env bash
# The sharded strategy's measurements (bench/notes/sharded-two-ranks.md), on a machine with two or
# more GPUs:
#  1. sharded (recompute and kept activations) and sharded_offload over the GPUs, gpt-871m, global
#     batch 8, as ranks of strategies/distributed/launch.py (times: the slowest rank; peaks per rank);
#  2. the machinery's own cost: sharded in a world of one beside baseline_checkpoint on one GPU;
#  3. PyTorch's DDP, FSDP2 and FSDP2 + CPUOffloadPolicy under torchrun on the same GPUs, model, batch.
#
#   bench/measure_sharded.sh BUILD_DIR OUTDIR [RANKS=2] [STEPS=3]
set -uo pipefail
build=${1:?BUILD_DIR}
out=$(realpath -m "${2:?OUTDIR}")
ranks=${3:-2}
steps=${4:-3}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
status=0
python3 strategies/distributed/launch.py --nproc="$ranks" --timeout=420 -- "$build/bench/strata_bench" --device=cuda:0 \
  --models=gpt-871m --steps="$steps" --strategies=sharded,sharded_offload \
  --benchmark_out="$out/sharded-x$ranks.json" --benchmark_out_format=json > "$out/sharded-x$ranks.txt" 2>&1 || status=1
python3 strategies/distributed/launch.py --nproc="$ranks" --timeout=300 -- "$build/bench/strata_bench" --device=cuda:0 \
  --models=gpt-871m --steps="$steps" --strategies=sharded --options=activations=keep \
  --benchmark_out="$out/sharded-keep-x$ranks.json" --benchmark_out_format=json > "$out/sharded-keep-x$ranks.txt" 2>&1 || status=1
"$build/bench/strata_bench" --device=cuda:0 --models=gpt-871m --steps="$steps" --strategies=baseline_checkpoint,sharded \
  --benchmark_out="$out/world1.json" --benchmark_out_format=json > "$out/world1.txt" 2>&1 || status=1
torchrun --standalone --nproc-per-node="$ranks" bench/peers.py --model=gpt-871m --steps="$steps" \
  --out="$out/peers-x$ranks.json" > "$out/peers-x$ranks.txt" 2>&1 || status=1
grep -hE "ms/step|failed|error" "$out"/*.txt | grep -v "repetition 1 of 1): warm" | tail -n 30
exit $status
