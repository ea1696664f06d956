"""Mean acceptance length of trained heads in the real decode loop, on held-out training-set prompts.

  python -m train.eval_acceptance --methods=medusa,eagle --num_prompts=8 --max_new_tokens=64 --k=4

Held-out prompts are the tail of the data pipeline's seeded permutation (train/data.py takes its head), so no
prompt used for self-distillation is measured. Greedy decoding, fixed k (no adaptive switching).
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import app, flags

flags.DEFINE_list("methods", ["medusa", "eagle"], "Proposers to measure.")
flags.DEFINE_integer("num_prompts", 8, "Held-out prompts.")
flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
flags.DEFINE_integer("k", 4, "Drafted tokens per step.")
flags.DEFINE_integer("batch_size", 4, "Prompts per batch.")
flags.DEFINE_integer("seed", 0, "The data pipeline's seed (which prompts were used for training).")
flags.DEFINE_string("output", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def held_out_prompts(n: int, seed: int) -> list:
  from train.data import load_prompts
  prompts = load_prompts()
  order = np.random.default_rng(seed).permutation(len(prompts))
  return [prompts[i] for i in order[::-1][:n]]


def main(argv):
  del argv
  from spec_jax.checkpoints.load import load_model
  from spec_jax.decode import generate
  from spec_jax.proposers.registry import build_proposer
  config, params, tok = load_model(None, "float32")
  texts = held_out_prompts(FLAGS.num_prompts, FLAGS.seed)
  ids = [tok.encode(tok.apply_chat_template([t])) for t in texts]
  out = {}
  for method in FLAGS.methods:
    proposer, pparams = build_proposer(method, target_config=config, target_params=params, k=FLAGS.k)
    emitted = steps = 0
    for i in range(0, len(ids), FLAGS.batch_size):
      res = generate(params, config, ids[i:i + FLAGS.batch_size], max_new_tokens=FLAGS.max_new_tokens,
                     proposer=proposer, proposer_params=pparams, adaptive_k=False, warm=False)
      emitted += int(np.sum(res.raw_stats.emitted))
      steps += int(np.sum(res.raw_stats.steps))
    out[method] = {"mean_acceptance_length": emitted / max(steps, 1), "emitted": emitted, "verify_steps": steps}
    print(f"{method}: mean acceptance length {emitted / max(steps, 1):.3f} ({emitted} tokens / {steps} steps)",
          file=sys.stderr, flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump({"k": FLAGS.k, "num_prompts": FLAGS.num_prompts, "max_new_tokens": FLAGS.max_new_tokens,
                 "results": out}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
