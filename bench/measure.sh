#!/usr/bin/env bash
# The GPU measurements recorded in bench/NOTES.md, in one go: hook offload and the manual split on
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
# The largest class count the baseline trains with AdamW (predicted ~9.5M: 16 B/parameter of state
# plus the optimizer's temporary), then the column split at that count.
run --model=bert-base-6m --classes=9000000 --batch=8 --steps=3 --strategies=baseline
run --model=bert-base-6m --classes=10000000 --batch=8 --steps=3 --strategies=baseline
run --model=bert-base-6m --classes=9000000 --batch=8 --steps=3 --strategies=manual_split --options='classifier_shards=2'
