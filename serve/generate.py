"""Batch generation, optionally speculative, optionally A/B against the baseline in one warmed process.

  python -m serve.generate                                  # default demo prompts, Gemma 3 270M
  python -m serve.generate --compare --method=ngram --prompts=data/specbench/spec_bench_question.jsonl
  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --compare  # Qwen2.5-Coder 1.5B, 0.5B draft
"""

from __future__ import annotations

import json
import sys

import numpy as np

from absl import app, flags

from serve import run_flags

# --config, the model, sampling and speculation flags (shared with the server), and generate's own rows.
run_flags.define("prompts", "output", "summary_json", "limit", "categories", "compare", "repeats", "progress",
                 "batch_size")

FLAGS = flags.FLAGS


def settings() -> dict:
  return run_flags.settings(more=("batch_size",))


def validate(cfg: dict) -> None:
  if cfg["batch_size"] < 1:
    raise ValueError(f"--batch_size must be >= 1, got {cfg['batch_size']}")


def main(argv):
  del argv
  try:
    cfg = settings()
    validate(cfg)
    run(cfg)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def load_prompts(cfg: dict, setup) -> tuple[list, list]:
  """--prompts (or the demo set) after --categories and --limit, and their token ids; each must fit the context
  with its new tokens and a step's drafts."""
  from serve.prompts import load_prompts as read
  prompts = read(FLAGS.prompts, setup.tokenizer)
  if FLAGS.categories:
    prompts = [p for p in prompts if p.category in FLAGS.categories]
  if FLAGS.limit:
    prompts = prompts[:FLAGS.limit]
  if not prompts:
    raise ValueError("no prompts left after --categories/--limit")
  prompt_ids = [setup.tokenizer.encode(p.text) for p in prompts]
  for p, ids in zip(prompts, prompt_ids):
    if len(ids) + cfg["max_new_tokens"] + setup.lookahead + 1 > setup.config.max_seq_len:
      raise ValueError(f"prompt {p.id!r} has {len(ids)} tokens; with {cfg['max_new_tokens']} new tokens and "
                       f"{setup.lookahead + 1} for a step's drafts it exceeds the context of "
                       f"{setup.config.max_seq_len}")
  return prompts, prompt_ids


def arm(cfg: dict, setup):
  """The runner's Arm of a setup: its proposer and step costs."""
  from serve import setup as setup_lib
  from serve.runner import Arm
  from spec_jax import backend
  ks = setup_lib.draft_lengths(setup, cfg["adaptive"])
  costs = setup_lib.step_costs(cfg, setup, ks, backend.batch_rows(setup.params, cfg["batch_size"]))
  return Arm(setup.proposer.name, setup.proposer, setup.proposer_params, costs)


def run(cfg: dict) -> dict:
  from serve import setup as setup_lib
  from serve.runner import Arm, category_table, format_table, run_arms
  from spec_jax import sharding
  from spec_jax.proposers.base import NoneProposer

  if FLAGS.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {FLAGS.repeats}")
  setup = setup_lib.load(cfg)
  prompts, prompt_ids = load_prompts(cfg, setup)
  proposer, params, mesh = setup.proposer, setup.params, setup.mesh
  main_arm = arm(cfg, setup)
  costs = main_arm.costs
  arms = [main_arm]
  if FLAGS.compare and proposer.k:
    arms.insert(0, Arm("baseline", NoneProposer(), {}))
  runs = run_arms(arms, params, setup.config, setup.tokenizer, prompts, prompt_ids,
                  batch_size=cfg["batch_size"], max_new_tokens=cfg["max_new_tokens"],
                  sampling_args=dict(temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"]),
                  adaptive_k=cfg["adaptive"], seed=cfg["seed"], impl=setup.impl, stop_ids=setup.tokenizer.stop_ids,
                  repeats=FLAGS.repeats, progress=FLAGS.progress, mesh=mesh, kv_cache_dtype=setup.kv_cache_dtype)
  base, main_run = (runs[0], runs[1]) if len(runs) == 2 else (None, runs[0])

  records = main_run.records
  if base is not None:
    for r, b in zip(records, base.records):
      r["baseline_token_ids"] = b["token_ids"]
      r["baseline_time_s"] = b["time_s"]
  if FLAGS.output:
    with open(FLAGS.output, "w", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
  run_info = {"method": proposer.name, "speculative_config": setup.spec_config.to_json(), "dtype": cfg["dtype"],
              "kv_cache_dtype": setup.kv_cache_dtype,
              "batch_size": cfg["batch_size"],
              "num_speculative_tokens": proposer.k, "adaptive": cfg["adaptive"], "attention_impl": setup.impl,
              "costs_file": cfg.get("costs_file") or "", "step_costs": None if costs is None else
              [[round(float(c), 3) for c in row] for row in np.asarray(costs)[:1]], "repeats": FLAGS.repeats,
              "mesh": sharding.describe(mesh)}
  if base is not None:
    ratios = [m / b if b else 0.0 for m, b in zip(main_run.summary["tokens_per_s_by_repeat"],
                                                  base.summary["tokens_per_s_by_repeat"])]
    summary = {"baseline": base.summary, "speculative": main_run.summary, "run": run_info,
               "speedup": main_run.summary["output_tokens_per_s"] / max(base.summary["output_tokens_per_s"], 1e-9),
               "speedup_by_repeat": [round(x, 3) for x in ratios],
               "categories": category_table(base, main_run, cfg["batch_size"])}
    table = format_table(summary["categories"])
  else:
    summary = dict(main_run.summary, run=run_info)
    table = format_table(category_table(main_run, None, cfg["batch_size"]))
  if FLAGS.summary_json:
    with open(FLAGS.summary_json, "w") as f:
      json.dump(summary, f, indent=1)
  if not FLAGS.output:
    for r in records[:8]:
      print(f"--- {r['id']} ({r['finish_reason']}, {len(r['token_ids'])} tokens)\n{r['text']}")
  print()
  print(table)
  s = main_run.summary
  line = f"{proposer.name}: {s['output_tokens']} tokens in {s['wall_s']:.2f} s = {s['output_tokens_per_s']:.1f} tok/s"
  if proposer.k:
    line += f", mean acceptance length {s['mean_acceptance_length']:.2f}, acceptance rate {s['acceptance_rate']:.2f}"
    if proposer.tree is not None:
      line += f", tree of {proposer.tree.nodes} nodes ({s['mean_draft_tokens_per_step']:.1f} drafted per step)"
  if base is not None:
    line += f"; baseline {base.summary['output_tokens_per_s']:.1f} tok/s; speedup {summary['speedup']:.2f}x"
    if FLAGS.repeats > 1:
      line += f" (per repeat {min(summary['speedup_by_repeat']):.2f}-{max(summary['speedup_by_repeat']):.2f}x)"
  print(line)
  return summary


if __name__ == "__main__":
  app.run(main)
