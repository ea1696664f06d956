#!/bin/bash
# The pair check's table (serve.check_pair) for every shipped head on Gemma 3 270M and for Qwen2.5-Coder 0.5B ->
# 1.5B, on Spec-Bench's first question of each of its 13 categories (prompts.jsonl), greedy and T 0.7, k = 4.
# Usage: bash benchmarks/reports/pair_check/run.sh [MAX_NEW_TOKENS] [LIMIT]   (run from the repository root;
# 2026-12-04: 32 new tokens, the first 6 categories)
set -u
OUT=benchmarks/reports/pair_check
N=${1:-48}
LIMIT=${2:-0}
PY=${PY:-.venv/bin/python}
common=(--prompts=$OUT/prompts.jsonl --limit=$LIMIT --max_new_tokens=$N --cost_reps=3)
run() {  # name, flags...
  local name=$1; shift
  local t0=$(date +%s)
  $PY -m serve.check_pair "${common[@]}" "$@" --json_out=$OUT/$name.json > $OUT/$name.txt 2>$OUT/$name.log
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s"
}
for m in medusa eagle eagle3; do
  run gemma3_$m --speculative_config="{\"method\": \"$m\", \"num_speculative_tokens\": 4}"
done
run qwen25_coder --config=configs/qwen25_coder_1p5b.py --num_speculative_tokens=4
run gemma3_draft --speculative_config='{"method": "draft", "num_speculative_tokens": 4}'
