#!/bin/bash
# Two checkouts, interleaved: A B A B ... for each (batch, method); CASES="1:none 8:ngram" picks them.
#   benchmarks/probes/paged_step.sh /path/to/before /path/to/after OUT.jsonl [rounds]
set -e
A=$1; B=$2; OUT=$3; ROUNDS=${4:-2}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
CASES=${CASES:-"1:none 8:none 1:ngram 8:ngram"}
for case in $CASES; do
  set -- ${case/:/ }
  for r in $(seq "$ROUNDS"); do
    for side in "$A" "$B"; do
      (cd "$side" && PYTHONPATH="$side" $PY "$HERE/paged_step.py" --batch="$1" --method="$2" | sed "s#^{#{\"checkout\": \"$side\", #") >> "$OUT"
    done
  done
done
