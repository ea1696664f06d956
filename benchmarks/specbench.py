"""Spec-Bench: per category, baseline vs. each method, adaptive speculation on and off (Gemma 3 270M by default).

  python benchmarks/specbench.py --per_category=3 --max_new_tokens=64 --methods=ngram,draft --json_out=PATH
  python benchmarks/specbench.py --methods=medusa,eagle --trees=medusa:4:24,eagle:4:16 --adaptive=off  # chain vs tree
  python benchmarks/specbench.py --methods=qdraft --draft_quantize=int8      # the target's own int8 weights draft
  python benchmarks/specbench.py --methods=eagle,eagle=/tmp/old/eagle_gemma3_270m --adaptive=off  # two checkpoints
  python benchmarks/specbench.py --quantize=int8 --methods=ngram             # an int8 target
  python benchmarks/specbench.py --prompts=held-out --per_category=16 --methods=eagle  # the training held-out split
  python benchmarks/specbench.py --model=qwen2.5-coder-1.5b-instruct --draft_model=qwen2.5-coder-0.5b-instruct \
      --dtype=float32 --costs_file=configs/costs/qwen25_coder_cpu.json --per_category=1   # the Qwen pair

Greedy, batch 1 by default. Every configuration runs the same prompts in this one process, warmed up, interleaved
batch by batch. Speedup per category is output tokens/s of the method over
the baseline's on the same prompts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from serve.step_costs import load_costs, method_key
from serve.prompts import Prompt, load_prompts
from serve.runner import Arm, category_table, format_table, run_arms
from spec_jax import adaptive, backend
from spec_jax.checkpoints.load import load_model
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.registry import build_proposer

from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", default=SPECBENCH,
                  help="a prompts file, or 'held-out': the training pipeline's held-out prompts (--per_category many)")
  ap.add_argument("--model", default="", help="the target: a checkpoint path or packaged name ('' = Gemma 3 270M)")
  ap.add_argument("--draft_model", default="", help="method draft: an independent draft model (same vocabulary)")
  ap.add_argument("--per_category", type=int, default=3)
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--methods", default="ngram,draft", help="method or method=checkpoint stem, comma-separated")
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--draft_layers", type=int, default=0, help="0: the distilled draft; N: early exit after N")
  ap.add_argument("--quantize", default="none", help="the target's weights: none, int8 or int4")
  ap.add_argument("--draft_quantize", default="int8", help="qdraft: the draft's weights (int8 or int4)")
  ap.add_argument("--batch_size", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--adaptive", default="on,off")
  ap.add_argument("--trees", default="", help="tree arms method:topk:nodes,... (depth = --k), beside the chains")
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--top_p", type=float, default=1.0)
  ap.add_argument("--json_out", default=None)
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--costs_file", default=os.path.join(os.path.dirname(__file__), "..", "configs", "costs",
                                                        "gemma3_270m_cpu.json"))
  args = ap.parse_args()

  config, params, tok = load_model(args.model or None, args.dtype, args.quantize)
  if args.prompts == "held-out":  # never trained on (train/data.py HELD_OUT); chat-templated as distillation was
    from train.eval_acceptance import held_out_prompts
    prompts = [Prompt(f"held-out-{i}", tok.apply_chat_template([t]), "held-out", True)
               for i, t in enumerate(held_out_prompts(args.per_category, 0))]
  else:
    prompts = load_prompts(args.prompts, tok)
  seen = collections.Counter()
  chosen = []
  for p in prompts:
    if seen[p.category] < args.per_category:
      seen[p.category] += 1
      chosen.append(p)
  ids = [tok.encode(p.text) for p in chosen]
  t0 = time.time()
  arms = [Arm("baseline", NoneProposer(), {}, adaptive_k=False)]
  variants = [(m, 1, 0) for m in args.methods.split(",") if m]
  variants += [(m, int(t), int(n)) for m, t, n in (x.split(":") for x in args.trees.split(",") if x)]
  for spec, topk, nodes in variants:
    method, _, heads = spec.partition("=")  # method=checkpoint stem: another head checkpoint than heads/'s
    proposer, pparams = build_proposer(method, target_config=config, target_params=params, k=args.k,
                                       draft_layers=args.draft_layers, topk=topk, num_draft_tokens=nodes,
                                       dtype=args.dtype, draft_quantize=args.draft_quantize, heads_path=heads or None,
                                       model_path=args.model or None, draft_model=args.draft_model or None)
    name = method + (f"[{os.path.basename(heads)}]" if heads else "")
    name = name if proposer.tree is None else f"{name}-tree{proposer.tree.nodes}"
    for adapt in args.adaptive.split(","):
      ks = adaptive.option_set(proposer.k, adapt == "on", proposer.tree)
      costs = load_costs(args.costs_file, method_key(proposer), args.dtype, ks,
                         backend.batch_rows(params, args.batch_size))
      arms.append(Arm(f"{name}-adaptive-{adapt}", proposer, pparams, costs, adaptive_k=adapt == "on"))
  # Every arm runs each batch in turn (A, B, C, A, B, C, ...): machine load hits them alike.
  runs = run_arms(arms, params, config, tok, chosen, ids, batch_size=args.batch_size,
                  max_new_tokens=args.max_new_tokens,
                  sampling_args=dict(temperature=args.temperature, top_k=0, top_p=args.top_p),
                  adaptive_k=False, seed=0, impl="xla", stop_ids=tok.stop_ids, repeats=args.repeats,
                  progress=True)
  base = runs[0]
  results = {"baseline": base.summary, "runs": {}}
  for arm, run in zip(arms[1:], runs[1:]):
    lossless = all(a["token_ids"] == b["token_ids"] for a, b in zip(run.records, base.records))
    table = category_table(base, run, args.batch_size)
    results["runs"][arm.label] = {"summary": run.summary, "categories": table, "identical_to_baseline": lossless}
    print(f"\n== {arm.label} (identical to baseline: {lossless})")
    print(format_table(table), flush=True)
  results["wall_s"] = time.time() - t0
  results["settings"] = vars(args)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
