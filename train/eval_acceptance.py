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

from spec_jax import flag_table
from spec_jax.batch import generate
from spec_jax.checkpoints.load import load_model
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from spec_jax.stats import summarize
from train.data import HELD_OUT, prompt_order
from train.examples import load_prompts

flag_table.define(("methods", "num_prompts", "max_new_tokens", "num_speculative_tokens", "batch_size", "dtype",
                   "seed", "speculative_model", "output"), methods=["medusa", "eagle", "draft"], max_new_tokens=64,
                  num_speculative_tokens=4, batch_size=1, dtype="bfloat16", seed=0)
FLAGS = flags.FLAGS


def held_out_prompts(n: int, seed: int) -> list:
  if n > HELD_OUT:
    raise ValueError(f"at most {HELD_OUT} held-out prompts")
  prompts = load_prompts()
  order = prompt_order(len(prompts), seed)
  return [prompts[i] for i in order[::-1][:n]]


def _timed(params, config, ids, **kw):
  """generate() over the prompts in batches, after one compiling run; -> (token ids, stats, seconds)."""
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
  if FLAGS.speculative_model and len(FLAGS.methods) != 1:
    raise ValueError("--speculative_model names one checkpoint: pass exactly one method")
  config, params, tok = load_model(None, FLAGS.dtype)
  texts = held_out_prompts(FLAGS.num_prompts, FLAGS.seed)
  ids = [tok.encode(tok.apply_chat_template([t])) for t in texts]
  common = dict(adaptive_k=False, stop_ids=tok.stop_ids)
  base, _, base_s = _timed(params, config, ids, **common)
  base_tps = sum(map(len, base)) / base_s
  out = {"baseline": {"output_tokens_per_s": base_tps}}
  print(f"baseline: {base_tps:.1f} tok/s", file=sys.stderr, flush=True)
  for method in FLAGS.methods:
    spec = SpecConfig(method, FLAGS.num_speculative_tokens, model=FLAGS.speculative_model or "")
    proposer, pparams = build_proposer(spec, Target(config, params))
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
      json.dump({"k": FLAGS.num_speculative_tokens, "num_prompts": FLAGS.num_prompts, "max_new_tokens": FLAGS.max_new_tokens,
                 "dtype": FLAGS.dtype, "batch_size": FLAGS.batch_size, "results": out}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
