#!/usr/bin/env bash
# A fixed set of GPU measurements, in one go: hook offload and the manual split on
# the seed-003 GPT, streaming inference, and seed 000's BERT + wide classifier.
#
#   bench/measure.sh BUILD_DIR OUTFILE        (e.g. bench/measure.sh build/cuda results.txt)
set -uo pipefail
compare="$1/bench/strata_compare"
out="$2"
: > "$out"
run() {
  echo "\$ strata_compare $*" | tee -a "$out"
  "$compare" --device=cuda:0 "$@" 2>&1 | tee -a "$out"
}
run --model=gpt-871m --steps=6 --strategies=baseline,baseline_checkpoint,hook_offload,hook_offload_overlap,manual_split
run --model=gpt-871m --steps=5 --inference --strategies=baseline,hook_offload
run --model=gpt-871m --batch=1 --steps=5 --inference --strategies=baseline,hook_offload
# Seed 000: backbone and classifier as two stages (automatic balance puts the classifier alone).
run --model=bert-base-6m --batch=8 --steps=4 --strategies=baseline,manual_split
run --model=bert-base-6m --batch=8 --steps=4 --strategies=manual_split --options='classifier_shards=2'
# The largest class count the baseline trains with AdamW on one GPU (bisection;
# bench/notes/bert-wide-classifier.md), then the baseline and the column split at that count.
bash "$(dirname "$0")/max_classes.sh" "$1" 6000000 9000000 125000 --device=cuda:0 --model=bert-base-6m --batch=8 \
  --steps=2 --strategies=baseline 2>&1 | tee -a "$out"
largest=$(grep -oE "largest that trains: [0-9]+" "$out" | tail -n 1 | grep -oE "[0-9]+$")
if [ -n "$largest" ]; then
  run --model=bert-base-6m --classes="$largest" --batch=8 --steps=3 --strategies=baseline,manual_split \
    --options='manual_split:classifier_shards=2'
fi
# With two GPUs: the largest counts with the classifier alone on cuda:1 and column-split over both.
if [ "$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)" -ge 2 ]; then
  bash "$(dirname "$0")/max_classes.sh" "$1" 8000000 12000000 187500 --device=cuda:0 --model=bert-base-6m \
    --batch=8 --steps=2 --strategies=manual_split --options='devices=cuda:0,cuda:1' 2>&1 | tee -a "$out"
  bash "$(dirname "$0")/max_classes.sh" "$1" 12000000 20000000 500000 --device=cuda:0 --model=bert-base-6m \
    --batch=8 --steps=2 --strategies=manual_split --options='devices=cuda:0,cuda:1;classifier_shards=2' 2>&1 | tee -a "$out"
fi
