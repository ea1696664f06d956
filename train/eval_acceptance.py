"""Mean acceptance length and speedup of trained proposers in the real decode loop, on held-out training prompts.

  python -m train.eval_acceptance --methods=ngram,medusa,eagle,draft --num_prompts=16 --max_new_tokens=64

Held-out prompts are the last HELD_OUT entries of the data pipeline's seeded permutation (train/data.py), which
no training run uses. Greedy, batch 1, fixed k (no adaptive switching), the default dtype; every batch is compiled
before it is timed (this script times itself so that train/ does not depend on serve/), and speedup is output tokens/s over the baseline's on the same prompts. Outputs must equal the baseline's.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from absl import app, flags

flags.DEFINE_list("methods", ["medusa", "eagle", "draft"], "Proposers to measure.")
flags.DEFINE_integer("num_prompts", 16, "Held-out prompts.")
flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
flags.DEFINE_integer("k", 4, "Drafted tokens per step.")
flags.DEFINE_integer("batch_size", 1, "Prompts per batch.")
flags.DEFINE_string("dtype", "bfloat16", "Target dtype (the serving default).")
flags.DEFINE_integer("seed", 0, "The data pipeline's seed (which prompts were used for training).")
flags.DEFINE_string("heads", None, "A checkpoint stem to measure instead of the shipped one (one method only).")
flags.DEFINE_string("output", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def held_out_prompts(n: int, seed: int) -> list:
  from train.data import HELD_OUT, load_prompts, prompt_order
  if n > HELD_OUT:
    raise ValueError(f"at most {HELD_OUT} held-out prompts")
  prompts = load_prompts()
  order = prompt_order(len(prompts), seed)
  return [prompts[i] for i in order[::-1][:n]]


def _timed(params, config, ids, **kw):
  """generate() over the prompts in batches, after one compiling run; -> (token ids, stats, seconds)."""
  from spec_jax.batch import generate
  from spec_jax.stats import Stats
  out, stats, wall = [], [], 0.0
  for i in range(0, len(ids), FLAGS.batch_size):
    batch = ids[i:i + FLAGS.batch_size]
    generate(params, config, batch, max_new_tokens=1, **kw)  # compile at these shapes
    t0 = time.perf_counter()
    res = generate(params, config, batch, max_new_tokens=FLAGS.max_new_tokens, **kw)
    wall += time.perf_counter() - t0
    out += res.token_ids
    stats.append(res.raw_stats)
  return out, jax.tree.map(lambda *xs: np.concatenate(xs), *stats), wall


def main(argv):
  del argv
  from spec_jax.checkpoints.load import load_model
  from spec_jax.proposers.registry import build_proposer
  from spec_jax.stats import summarize
  if FLAGS.heads and len(FLAGS.methods) != 1:
    raise ValueError("--heads names one checkpoint: pass exactly one method")
  config, params, tok = load_model(None, FLAGS.dtype)
  texts = held_out_prompts(FLAGS.num_prompts, FLAGS.seed)
  ids = [tok.encode(tok.apply_chat_template([t])) for t in texts]
  common = dict(adaptive_k=False, stop_ids=tok.stop_ids)
  base, _, base_s = _timed(params, config, ids, **common)
  base_tps = sum(map(len, base)) / base_s
  out = {"baseline": {"output_tokens_per_s": base_tps}}
  print(f"baseline: {base_tps:.1f} tok/s", file=sys.stderr, flush=True)
  for method in FLAGS.methods:
    proposer, pparams = build_proposer(method, target_config=config, target_params=params, k=FLAGS.k,
                                       heads_path=FLAGS.heads)
    toks, stats, wall = _timed(params, config, ids, proposer=proposer, proposer_params=pparams, **common)
    s = summarize(stats)
    tps = sum(map(len, toks)) / wall
    same = toks == base
    out[method] = {"mean_acceptance_length": s["mean_acceptance_length"],
                   "per_position_acceptance": s["per_position_acceptance"],
                   "output_tokens_per_s": tps, "speedup": tps / base_tps, "identical_to_baseline": same}
    print(f"{method}: mean acceptance length {s['mean_acceptance_length']:.3f}, "
          f"{tps:.1f} tok/s ({tps / base_tps:.2f}x), identical: {same}", file=sys.stderr, flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump({"k": FLAGS.k, "num_prompts": FLAGS.num_prompts, "max_new_tokens": FLAGS.max_new_tokens,
                 "dtype": FLAGS.dtype, "batch_size": FLAGS.batch_size, "results": out}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
