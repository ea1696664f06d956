"""Writes the templated traffic of benchmarks/suffix.py (one instruction format over different inputs: names as a
JSON list, one worked example, raw text for the base model) as a prompt file for the load matrix, so that the
server-side suffix arm (configs/loadtest_suffix.py) runs on the same kind of traffic as the batch-1 benchmark:

  .venv/bin/python -m benchmarks.probes.templated_prompts --n=24 \\
      --output=benchmarks/reports/gemma3_270m_suffix/templated_prompts.jsonl

The sentences come from Spec-Bench's odd-indexed (held-apart) questions, as in benchmarks/suffix.py."""

from __future__ import annotations

import json
import sys

from absl import app, flags

from benchmarks.suffix import TEMPLATE, sentences
from spec_jax.datasets import SPEC_BENCH, read_jsonl

flags.DEFINE_integer("n", 24, "How many prompts.")
flags.DEFINE_string("output", "", "The prompt file to write (jsonl: id, prompt, category).")
FLAGS = flags.FLAGS


def main(_):
  held_apart = [(i, None, rec["turns"][0]) for i, (_, rec) in enumerate(read_jsonl(SPEC_BENCH)) if i % 2 == 1]
  rows = [{"id": f"t{j}", "prompt": TEMPLATE.format(s), "category": "templated"}
          for j, s in enumerate(sentences(held_apart, FLAGS.n))]
  with open(FLAGS.output, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"{len(rows)} prompts -> {FLAGS.output}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
