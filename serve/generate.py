"""Batch generation, optionally speculative, optionally A/B against the baseline in one warmed process.

  python -m serve.generate                                  # default demo prompts, Gemma 3 270M
  python -m serve.generate --compare --method=ngram --prompts=data/specbench/spec_bench_question.jsonl
  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --compare  # Qwen2.5-Coder 1.5B, 0.5B draft
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from absl import app, flags

from serve import run_flags

run_flags.define()  # --config, the model, sampling and speculation flags (shared with the server)
flags.DEFINE_string("prompts", None, "JSONL prompts: 'prompt' or 'turns', optional 'id' and 'category'.")
flags.DEFINE_string("output", None, "JSONL output, one line per prompt.")
flags.DEFINE_string("summary_json", None, "Write aggregate metrics here.")
flags.DEFINE_integer("limit", 0, "Use only the first N prompts (0: all).")
flags.DEFINE_list("categories", [], "Keep only prompts of these categories.")
flags.DEFINE_bool("compare", False, "Run the baseline and the method on the same prompts, interleaved batch by batch.")
flags.DEFINE_integer("repeats", 1, "Run everything this many times (interleaved) and report the spread.")
flags.DEFINE_bool("progress", True, "Progress bar on stderr.")
flags.DEFINE_integer("batch_size", None, "Prompts per batch (overrides the config's).")

FLAGS = flags.FLAGS


def settings() -> dict:
  return run_flags.settings(more=("batch_size",))


def validate(cfg: dict) -> None:
  from spec_jax.config import validate_sampling
  validate_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"])
  if cfg["max_new_tokens"] < 1:
    raise ValueError(f"--max_new_tokens must be >= 1, got {cfg['max_new_tokens']}")
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


@dataclasses.dataclass
class Setup:
  config: object
  params: dict
  tokenizer: object
  impl: str
  prompts: list
  prompt_ids: list
  proposer: object
  proposer_params: dict


def load_setup(cfg: dict) -> Setup:
  """Model, tokenizer, prompts and proposer from the run settings (shared with serve.calibrate)."""
  from serve.prompts import load_prompts
  from spec_jax.checkpoints.load import load_model
  from spec_jax.kernels import resolve_impl

  impl = resolve_impl(cfg["attention_impl"])
  config, params, tokenizer = load_model(cfg["model"] or None, cfg["dtype"], cfg.get("quantize") or "none")
  prompts = load_prompts(FLAGS.prompts, tokenizer)
  if FLAGS.categories:
    prompts = [p for p in prompts if p.category in FLAGS.categories]
  if FLAGS.limit:
    prompts = prompts[:FLAGS.limit]
  if not prompts:
    raise ValueError("no prompts left after --categories/--limit")
  prompt_ids = [tokenizer.encode(p.text) for p in prompts]
  proposer, proposer_params = build_method(cfg, cfg["method"], config, params, impl)
  # A step writes k tokens past the committed ones for a chain, nodes - 1 for a tree.
  lookahead = max(proposer.k, proposer.tree.lookahead if proposer.tree is not None else 0)
  for p, ids in zip(prompts, prompt_ids):
    if len(ids) + cfg["max_new_tokens"] + lookahead + 1 > config.max_seq_len:
      raise ValueError(f"prompt {p.id!r} has {len(ids)} tokens; with {cfg['max_new_tokens']} new tokens and "
                       f"{lookahead + 1} for a step's drafts it exceeds the context of {config.max_seq_len}")
  return Setup(config, params, tokenizer, impl, prompts, prompt_ids, proposer, proposer_params)


def build_method(cfg: dict, method: str, config, params, impl: str):
  """-> (proposer, its params) for `method` under the run settings (serve.generate and serve.evaluate)."""
  from spec_jax.proposers.registry import build_proposer
  return build_proposer(
      method, target_config=config, target_params=params, k=cfg["num_speculative_tokens"],
      ngram_min=cfg["ngram_min"], ngram_max=cfg["ngram_max"], draft_layers=cfg["draft_layers"], impl=impl,
      heads_path=cfg.get("heads") or None, topk=cfg.get("eagle_topk", 1),
      num_draft_tokens=cfg.get("num_draft_tokens", 0), model_path=cfg["model"] or None, dtype=cfg["dtype"],
      draft_quantize=cfg.get("draft_quantize") or "int8", draft_model=cfg.get("draft_model") or None)


def method_costs(cfg: dict, proposer, params):
  """The adaptive controller's step costs for this proposer from --costs_file (None: a single draft length)."""
  from serve.step_costs import load_costs, method_key
  from spec_jax import adaptive, backend
  ks = adaptive.option_set(proposer.k, cfg["adaptive"], proposer.tree)
  if len(ks) == 1:
    return None
  return load_costs(cfg.get("costs_file") or "", method_key(proposer), cfg["dtype"], ks,
                    backend.batch_rows(params, cfg["batch_size"]))


def run(cfg: dict) -> dict:
  from serve.runner import Arm, category_table, format_table, run_arms
  from spec_jax import sharding
  from spec_jax.proposers.base import NoneProposer

  if FLAGS.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {FLAGS.repeats}")
  mesh = sharding.make_mesh(cfg.get("mesh") or "")
  setup = load_setup(cfg)
  proposer, params = setup.proposer, setup.params
  costs = method_costs(cfg, proposer, params)
  arms = [Arm(proposer.name, proposer, setup.proposer_params, costs)]
  if FLAGS.compare and proposer.k:
    arms.insert(0, Arm("baseline", NoneProposer(), {}))
  runs = run_arms(arms, params, setup.config, setup.tokenizer, setup.prompts, setup.prompt_ids,
                  batch_size=cfg["batch_size"], max_new_tokens=cfg["max_new_tokens"],
                  sampling_args=dict(temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"]),
                  adaptive_k=cfg["adaptive"], seed=cfg["seed"], impl=setup.impl, stop_ids=setup.tokenizer.stop_ids,
                  repeats=FLAGS.repeats, progress=FLAGS.progress, mesh=mesh)
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
  run_info = {"method": proposer.name, "dtype": cfg["dtype"], "batch_size": cfg["batch_size"],
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
