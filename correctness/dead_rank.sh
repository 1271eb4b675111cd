#!/bin/sh
# A run that survives a dead rank: strata_train (sharded, 2 ranks under torchrun --max_restarts=1)
# killed once before step 5, and once in the save after step 6 (its file written, the manifest not),
# and once in that save written in the background (--async-save=1), each restarted by torchrun's
# agent from the newest complete checkpoint, ends with parameters equal, byte for byte, to a run
# that was never interrupted.
#   correctness/dead_rank.sh STRATA_TRAIN WORK_DIR
set -u
train=$1
work=$2
if command -v torchrun > /dev/null 2>&1; then
  run="torchrun"
elif python3 -c "import torch.distributed.run" > /dev/null 2>&1; then
  run="python3 -m torch.distributed.run"
else
  echo "SKIPPED: no torchrun here (Debian: python3-torch; ci/setup.sh installs it)"
  exit 77
fi
# Underscored flags and a per-rank tee map: what torch 1.13 (Debian's, under Python 3.11, whose
# flag enums drop 0 and 3) and torch 2.x both read.
launch="$run --standalone --nproc_per_node=2 --no_python --tee=0:1,1:1 --redirects=0:1,1:1"
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
export OMP_NUM_THREADS=1 STRATA_DIST_TIMEOUT_S=30
args="--strategy=sharded --model=gpt-tiny --steps=8 --every=2"
status=0
timeout -k 10 240 $launch --max_restarts=0 "$train" $args --out=plain > plain.log 2>&1 || { echo "uninterrupted run failed:"; tail -20 plain.log; exit 1; }
for fault in "--die-at=5" "--die-in-save=6" "--die-in-save=6 --async-save=1"; do
  name=$(echo "$fault" | tr -dc 'a-z0-9')
  timeout -k 10 240 $launch --max_restarts=1 "$train" $args --checkpoint-dir="ckpt-$name" $fault --out="$name" > "$name.log" 2>&1 \
    || { echo "$fault: the run did not end well:"; tail -20 "$name.log"; status=1; continue; }
  grep -q "killed" "$name.log" || { echo "$fault: no rank was killed"; status=1; }
  grep -q "resumed from ckpt-$name/step-000000004 " "$name.log" || { echo "$fault: did not resume from step 4:"; grep "strata_train" "$name.log" | tail -5; status=1; }
  if cmp -s plain/step-000000008/parameters.pt "$name/step-000000008/parameters.pt"; then
    echo "$fault: killed, restarted, resumed from step 4; final parameters identical to the uninterrupted run's"
  else
    echo "$fault: final parameters differ from the uninterrupted run's"
    status=1
  fi
done
exit $status
