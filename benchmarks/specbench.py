"""Spec-Bench: per category, baseline vs. each method, adaptive speculation on and off (Gemma 3 270M by default).

  python benchmarks/specbench.py --per_category=3 --max_new_tokens=64 --methods=ngram,draft --json_out=PATH
  python benchmarks/specbench.py --methods=medusa,eagle --trees=medusa:4:24,eagle:4:16 --adaptive_arms=off  # chain vs tree
  python benchmarks/specbench.py --methods=qdraft --speculative_quantization=int8      # the target's own int8 weights draft
  python benchmarks/specbench.py --methods=eagle,eagle=/tmp/old/eagle_gemma3_270m --adaptive_arms=off  # two checkpoints
  python benchmarks/specbench.py --quantize=int8 --methods=ngram             # an int8 target
  python benchmarks/specbench.py --prompts=held-out --per_category=16 --methods=eagle  # the training held-out split
  python benchmarks/specbench.py --model=qwen2.5-coder-1.5b-instruct --speculative_model=qwen2.5-coder-0.5b-instruct \\
      --dtype=float32 --costs_file=configs/costs/qwen25_coder_cpu.json --per_category=1   # the Qwen pair

Greedy, batch 1 by default. Every configuration runs the same prompts in this one process, warmed up, interleaved
batch by batch. Speedup per category is output tokens/s of the method over
the baseline's on the same prompts.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

from absl import app, flags

from spec_jax import flag_table

from serve.jobs.step_costs import load_costs, method_key
from serve.jobs.prompts import Prompt, load_prompts
from serve.jobs.runner import Arm, category_table, format_table, run_arms
from spec_jax import adaptive, backend
from spec_jax.checkpoints.load import load_model
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig

from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402


# absl's INFO would print jax's backend probing ("Unable to initialize backend 'tpu'") at every start.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

FLAG_NAMES = ("prompts", "model", "speculative_model", "per_category", "max_new_tokens", "methods",
              "num_speculative_tokens", "draft_layers", "quantize", "speculative_quantization", "batch_size", "dtype",
              "adaptive_arms", "trees", "temperature", "top_p", "json_out", "repeats", "costs_file")
flag_table.define(FLAG_NAMES,
                  prompts=SPECBENCH, model="", speculative_model="", per_category=3, max_new_tokens=64,
                  methods=["ngram", "draft"], num_speculative_tokens=4, draft_layers=0, quantize="none",
                  speculative_quantization="int8", batch_size=1, dtype="bfloat16", trees="", temperature=0.0,
                  top_p=1.0, repeats=1,
                  costs_file=os.path.join(os.path.dirname(__file__), "..", "configs", "costs", "gemma3_270m_cpu.json"))
FLAGS = flags.FLAGS


def held_out_prompts(n: int, seed: int) -> list:
  """train.eval_acceptance.held_out_prompts, which cannot be imported here: that module defines absl flags of the
  same names as these. The last HELD_OUT prompts of the data pipeline's seeded permutation (train/data.py)."""
  from train.data import HELD_OUT, prompt_order  # lazy: heavy, only this path (train/)
  from train.examples import load_prompts  # lazy: heavy, only this path (train/)
  if n > HELD_OUT:
    raise ValueError(f"at most {HELD_OUT} held-out prompts")
  prompts = load_prompts()
  order = prompt_order(len(prompts), seed)
  return [prompts[i] for i in order[::-1][:n]]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")

  config, params, tok = load_model(FLAGS.model or None, FLAGS.dtype, FLAGS.quantize)
  if FLAGS.prompts == "held-out":  # never trained on (train/data.py HELD_OUT); chat-templated as distillation was
    prompts = [Prompt(f"held-out-{i}", tok.apply_chat_template([t]), "held-out", True)
               for i, t in enumerate(held_out_prompts(FLAGS.per_category, 0))]
  else:
    prompts = load_prompts(FLAGS.prompts, tok)
  seen = collections.Counter()
  chosen = []
  for p in prompts:
    if seen[p.category] < FLAGS.per_category:
      seen[p.category] += 1
      chosen.append(p)
  ids = [tok.encode(p.text) for p in chosen]
  t0 = time.time()
  arms = [Arm("baseline", NoneProposer(), {}, adaptive_k=False)]
  variants = [(m, 1, 0) for m in FLAGS.methods if m]
  variants += [(m, int(t), int(n)) for m, t, n in (x.split(":") for x in FLAGS.trees.split(",") if x)]
  for spec, topk, nodes in variants:
    method, _, heads = spec.partition("=")  # method=checkpoint stem: another head checkpoint than heads/'s
    spec_config = SpecConfig(method, FLAGS.num_speculative_tokens, model=heads or FLAGS.speculative_model,
                             draft_layers=FLAGS.draft_layers, eagle_topk=topk, num_draft_tokens=nodes,
                             quantization=FLAGS.speculative_quantization)
    proposer, pparams = build_proposer(spec_config, Target(config, params, model_path=FLAGS.model or None,
                                                           dtype=FLAGS.dtype))
    name = method + (f"[{os.path.basename(heads)}]" if heads else "")
    name = name if proposer.tree is None else f"{name}-tree{proposer.tree.nodes}"
    for adapt in FLAGS.adaptive_arms:
      ks = adaptive.option_set(proposer.k, adapt == "on", proposer.tree)
      costs = load_costs(FLAGS.costs_file, method_key(proposer), FLAGS.dtype, ks,
                         backend.batch_rows(params, FLAGS.batch_size))
      arms.append(Arm(f"{name}-adaptive-{adapt}", proposer, pparams, costs, adaptive_k=adapt == "on"))
  # Every arm runs each batch in turn (A, B, C, A, B, C, ...): machine load hits them alike.
  runs = run_arms(arms, params, config, tok, chosen, ids, batch_size=FLAGS.batch_size,
                  max_new_tokens=FLAGS.max_new_tokens,
                  sampling_args=dict(temperature=FLAGS.temperature, top_k=0, top_p=FLAGS.top_p),
                  adaptive_k=False, seed=0, impl="xla", stop_ids=tok.stop_ids, repeats=FLAGS.repeats,
                  progress=True)
  base = runs[0]
  results = {"baseline": base.summary, "runs": {}}
  for arm, run in zip(arms[1:], runs[1:]):
    lossless = all(a["token_ids"] == b["token_ids"] for a, b in zip(run.records, base.records))
    table = category_table(base, run, FLAGS.batch_size)
    results["runs"][arm.label] = {"summary": run.summary, "categories": table, "identical_to_baseline": lossless}
    print(f"\n== {arm.label} (identical to baseline: {lossless})")
    print(format_table(table), flush=True)
  results["wall_s"] = time.time() - t0
  results["settings"] = {name: FLAGS[name].value for name in FLAG_NAMES}
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
