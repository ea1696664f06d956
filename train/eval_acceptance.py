"""Mean acceptance length and speedup of trained proposers in the real decode loop, on held-out training prompts.

  python -m train.eval_acceptance --methods=ngram,medusa,eagle,draft --num_prompts=16 --max_new_tokens=64

Held-out prompts are the last HELD_OUT entries of the data pipeline's seeded permutation (train/data.py), which
no training run uses. Greedy, batch 1, fixed k (no adaptive switching), the default dtype; every run is warmed
up, and speedup is output tokens/s over the baseline's on the same prompts. Outputs must equal the baseline's.
"""

from __future__ import annotations

import json
import sys

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


def main(argv):
  del argv
  from serve.prompts import Prompt
  from serve.runner import run_prompts
  from spec_jax.checkpoints.load import load_model
  from spec_jax.proposers.base import NoneProposer
  from spec_jax.proposers.registry import build_proposer
  if FLAGS.heads and len(FLAGS.methods) != 1:
    raise ValueError("--heads names one checkpoint: pass exactly one method")
  config, params, tok = load_model(None, FLAGS.dtype)
  texts = held_out_prompts(FLAGS.num_prompts, FLAGS.seed)
  prompts = [Prompt(id=f"held-out-{i}", text=tok.apply_chat_template([t]), category="held-out", is_chat=True)
             for i, t in enumerate(texts)]
  ids = [tok.encode(p.text) for p in prompts]
  common = dict(batch_size=FLAGS.batch_size, max_new_tokens=FLAGS.max_new_tokens, adaptive_k=False, seed=0,
                sampling_args=dict(temperature=0.0, top_k=0, top_p=1.0), impl="xla", progress=False,
                stop_ids=tok.stop_ids)
  base = run_prompts(params, config, tok, prompts, ids, proposer=NoneProposer(), proposer_params={}, **common)
  base_tps = base.summary["output_tokens_per_s"]
  out = {"baseline": {"output_tokens_per_s": base_tps}}
  print(f"baseline: {base_tps:.1f} tok/s", file=sys.stderr, flush=True)
  for method in FLAGS.methods:
    proposer, pparams = build_proposer(method, target_config=config, target_params=params, k=FLAGS.k,
                                       heads_path=FLAGS.heads)
    run = run_prompts(params, config, tok, prompts, ids, proposer=proposer, proposer_params=pparams, **common)
    s = run.summary
    same = all(a["token_ids"] == b["token_ids"] for a, b in zip(run.records, base.records))
    out[method] = {"mean_acceptance_length": s["mean_acceptance_length"],
                   "per_position_acceptance": s["per_position_acceptance"],
                   "output_tokens_per_s": s["output_tokens_per_s"],
                   "speedup": s["output_tokens_per_s"] / base_tps, "identical_to_baseline": same}
    print(f"{method}: mean acceptance length {s['mean_acceptance_length']:.3f}, "
          f"{s['output_tokens_per_s']:.1f} tok/s ({s['output_tokens_per_s'] / base_tps:.2f}x), identical: {same}",
          file=sys.stderr, flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump({"k": FLAGS.k, "num_prompts": FLAGS.num_prompts, "max_new_tokens": FLAGS.max_new_tokens,
                 "dtype": FLAGS.dtype, "batch_size": FLAGS.batch_size, "results": out}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
