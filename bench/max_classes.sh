#!/usr/bin/env bash
# The largest class count of a BERT preset that one strategy trains (a few AdamW steps) without
# running out of memory, found by bisection with strata_compare: LOW must train, HIGH must not;
# both ends are checked first, then the interval is halved until it is at most RESOLUTION wide.
#
#   bench/max_classes.sh BUILD_DIR LOW HIGH RESOLUTION [strata_compare arguments...]
#   e.g. bench/max_classes.sh build/cuda 6000000 9000000 125000 \
#          --device=cuda:0 --model=bert-base-6m --batch=8 --steps=2 --strategies=baseline
#
# One probe per line on stdout; the last line is "largest that trains: N (next probe that did
# not: M)". Exit 1 when an end of the bracket is wrong or a probe fails for another reason.
set -uo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
compare="$1/bench/strata_compare"
low=$2 high=$3 resolution=$4
shift 4
for v in "$low" "$high" "$resolution"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "max_classes.sh: '$v' is not a whole number" >&2; exit 2; }
done
[ "$low" -lt "$high" ] || { echo "max_classes.sh: LOW=$low must be below HIGH=$high" >&2; exit 2; }
[ "$resolution" -ge 1 ] || { echo "max_classes.sh: RESOLUTION=$resolution must be at least 1" >&2; exit 2; }
[ -x "$compare" ] || { echo "max_classes.sh: no strata_compare in $1/bench" >&2; exit 2; }

args=("$@")

# One probe: "trains ...", "oom" or "error ..." on stdout (one line, per-device peaks appended).
probe() {
  local out row
  out=$("$compare" --classes="$1" "${args[@]}" 2>&1)
  row=$(echo "$out" | grep -E "^[a-z_]+(\[[^]]*\])? +ok " | tail -n 1)
  if echo "$row" | grep -q "out of memory"; then
    echo "oom"
  elif echo "$row" | grep -qE " ok +[0-9]"; then
    echo "trains: $(echo "$row" | awk '{print "step " $(NF-5) " ms, peak allocated " $(NF-3) " GiB, reserved " $(NF-2) " GiB"}')" \
      "$(echo "$out" | grep "per device" | sed 's/^ *per device, peak allocated \/ reserved GiB:/; per device/')"
  else
    echo "error: $(echo "$out" | tail -n 3 | tr '\n' ' ')"
  fi
}

step() {  # prints the probe's line, returns 0 trains, 1 oom, 2 error
  local result
  result=$(probe "$1")
  echo "classes=$1: $result"
  case "$result" in trains*) return 0 ;; oom*) return 1 ;; *) return 2 ;; esac
}

echo "max_classes.sh: bisecting classes in [$low, $high] to $resolution with: strata_compare ${args[*]}"
step "$low"; rc=$?
[ $rc -eq 0 ] || { echo "max_classes.sh: LOW=$low does not train; lower it"; exit 1; }
step "$high"; rc=$?
[ $rc -eq 1 ] || { [ $rc -eq 0 ] && echo "max_classes.sh: HIGH=$high trains; raise it"; exit 1; }
while [ $((high - low)) -gt "$resolution" ]; do
  mid=$(( (low + high) / 2 ))
  step "$mid"; rc=$?
  case $rc in 0) low=$mid ;; 1) high=$mid ;; *) exit 1 ;; esac
done
echo "largest that trains: $low (next probe that did not: $high)"
