#!/usr/bin/env bash
# The pipeline's measurements, on a machine with two or more GPUs:
#  1. every schedule over the GPUs as processes (the c10d transport; strategies/distributed/launch.py),
#     gpt-871m, global batch 8 in 8 micro-batches, each action timed so the report has the
#     simulator's ideal beside the measured step; 1F1B also at 4 and 16 micro-batches;
#  2. 1F1B over the same GPUs in one process (the in-process transport), for the transports' cost;
#  3. seed 000's BERT with its wide classifier, 1F1B over the GPUs as processes;
#  4. torch.distributed.pipelining's schedules under torchrun on the same GPUs, model and batch.
#
#   bench/measure_pipeline.sh BUILD_DIR OUTDIR [RANKS=2] [STEPS=3] [REPS=3]
set -uo pipefail
build=${1:?BUILD_DIR}
out=$(realpath -m "${2:?OUTDIR}")
ranks=${3:-2}
steps=${4:-3}
reps=${5:-3}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/.."
status=0
bench() {  # bench TAG ARGS...: strata_bench as $ranks processes
  local tag=$1
  shift
  echo "measure_pipeline.sh: $tag" >&2
  python3 strategies/distributed/launch.py --nproc="$ranks" --timeout=500 -- "$build/bench/strata_bench" --device=cuda:0 \
    --steps="$steps" --benchmark_repetitions="$reps" "$@" \
    --benchmark_out="$out/$tag.json" --benchmark_out_format=json > "$out/$tag.txt" 2>&1 || status=1
}
bench gpt-m8 --models=gpt-871m --strategies=pipeline_gpipe,pipeline_1f1b,pipeline_interleaved,pipeline_zero_bubble \
  "--options=micro_batches=8;time_actions=1"
bench gpt-m4 --models=gpt-871m --strategies=pipeline_1f1b "--options=micro_batches=4;time_actions=1"
bench gpt-m16 --models=gpt-871m --strategies=pipeline_1f1b "--options=micro_batches=16;time_actions=1"
bench bert-wide-m8 --models=bert-base-6m --batch=8 --strategies=pipeline_1f1b "--options=micro_batches=8;time_actions=1"
devs=$(seq -s, -f "cuda:%g" 0 $((ranks - 1)))
echo "measure_pipeline.sh: in one process over $devs" >&2
"$build/bench/strata_bench" --device=cuda:0 --steps="$steps" --benchmark_repetitions="$reps" --models=gpt-871m \
  --strategies=pipeline_1f1b "--options=devices=$devs;micro_batches=8;time_actions=1" \
  --benchmark_out="$out/gpt-m8-inprocess.json" --benchmark_out_format=json > "$out/gpt-m8-inprocess.txt" 2>&1 || status=1
echo "measure_pipeline.sh: torch.distributed.pipelining" >&2
PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node="$ranks" bench/peers.py --model=gpt-871m --steps="$steps" \
  --peers=torch_pp_gpipe,torch_pp_1f1b,torch_pp_interleaved,torch_pp_zbv --micro-batches=8 \
  --out="$out/peers-pp-x$ranks.json" > "$out/peers-pp-x$ranks.txt" 2>&1 || status=1
grep -hE "ms/step|failed|error|Error" "$out"/*.txt | grep -v "warm-up\|parity check" | tail -n 40
exit $status
