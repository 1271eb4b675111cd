#!/bin/sh
# Test helper: runs a command and passes only when its exit status is exactly CODE (or, for CODE
# 'nonzero', any failure status short of a signal), so a crash or another failure does not pass for
# the expected one; each --grep PATTERN must also match a line of its output (grep -E).
#   expect_exit.sh CODE [--grep PATTERN]... command [args...]
want=$1
shift
out=$(mktemp)
patterns=$(mktemp)
while [ "$1" = --grep ]; do
  printf '%s\n' "$2" >> "$patterns"
  shift 2
done
"$@" > "$out" 2>&1
got=$?
cat "$out"
status=0
if [ "$want" = nonzero ]; then
  if [ "$got" -eq 0 ] || [ "$got" -ge 124 ]; then
    echo "expect_exit.sh: expected a failure status (1-123), got $got"
    status=1
  fi
elif [ "$got" -ne "$want" ]; then
  echo "expect_exit.sh: expected exit status $want, got $got"
  status=1
fi
while IFS= read -r pattern; do
  if ! grep -Eq -- "$pattern" "$out"; then
    echo "expect_exit.sh: no line of the output matches '$pattern'"
    status=1
  fi
done < "$patterns"
rm -f "$out" "$patterns"
exit $status
