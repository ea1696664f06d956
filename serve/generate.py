"""Batch generation, optionally speculative, optionally A/B against the baseline in one warmed process.

  python -m serve.generate                                  # default demo prompts, Gemma 3 270M
  python -m serve.generate --compare --method=ngram --prompts=data/specbench/spec_bench_question.jsonl
  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --compare  # Qwen2.5-Coder 1.5B, 0.5B draft
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np

from absl import app, flags

from serve.jobs import run_flags, setup as setup_lib
from serve.jobs.prompts import load_prompts as read_prompts
from serve.jobs.runner import Arm, category_table, format_table, run_arms
from spec_jax import backend, sharding
from spec_jax.proposers.base import NoneProposer

# --config, the model, sampling and speculation flags (shared with the server), and generate's own rows.
run_flags.define("prompts", "output", "summary_json", "limit", "categories", "compare", "repeats", "progress",
                 "batch_size", "compilation_cache_dir")

FLAGS = flags.FLAGS
T0 = time.perf_counter()  # the process's start, near enough: the stage lines count from here
SPREAD_NOTE = ("one run: on a shared or busy machine speedups vary by several percent from run to run; "
               "--repeats=N interleaves N repeats and prints their range")


def say(msg: str) -> None:
  """A stage line on stderr (with --progress), prefixed by the seconds since start."""
  if FLAGS.progress:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


class _SayHandler(logging.Handler):
  """The loaders' stage messages (logger spec_jax.load: joining, dequantizing or reading the cache) as stage lines."""

  def emit(self, record):
    say(record.getMessage())


def _show_load_stages() -> None:
  log = logging.getLogger("spec_jax.load")
  if not any(isinstance(h, _SayHandler) for h in log.handlers):
    log.addHandler(_SayHandler())
  log.setLevel(logging.INFO)
  log.propagate = False


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
  prompts = read_prompts(FLAGS.prompts, setup.tokenizer)
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
  ks = setup_lib.draft_lengths(setup, cfg["adaptive"])
  costs = setup_lib.step_costs(cfg, setup, ks, backend.batch_rows(setup.params, cfg["batch_size"]))
  return Arm(setup.proposer.name, setup.proposer, setup.proposer_params, costs)


def run(cfg: dict) -> dict:
  if FLAGS.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {FLAGS.repeats}")
  _show_load_stages()
  say(setup_lib.use_compilation_cache(FLAGS.compilation_cache_dir))  # a second run skips most compiles
  say(f"loading {cfg['model'] or 'Gemma 3 270M (packaged)'} ({cfg['dtype']}"
      f"{', ' + cfg['quantize'] if cfg.get('quantize') not in (None, '', 'none') else ''})")
  setup = setup_lib.load(cfg)
  prompts, prompt_ids = load_prompts(cfg, setup)
  loaded_s = time.perf_counter() - T0
  proposer, params, mesh = setup.proposer, setup.params, setup.mesh
  main_arm = arm(cfg, setup)
  costs = main_arm.costs
  arms = [main_arm]
  if FLAGS.compare and proposer.k:
    arms.insert(0, Arm("baseline", NoneProposer(), {}))
  say(f"loaded; {len(prompts)} prompts, {', '.join(a.label for a in arms)}: each batch compiles on first use "
      f"(untimed), then generates (timed)")
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
               "categories": category_table(base, main_run, cfg["batch_size"]),
               "outputs_differ": differences(main_run.records, base.records), "load_s": round(loaded_s, 2)}
    table = format_table(summary["categories"])
  else:
    summary = dict(main_run.summary, run=run_info)
    table = format_table(category_table(main_run, None, cfg["batch_size"]))
  if FLAGS.summary_json:
    with open(FLAGS.summary_json, "w") as f:
      json.dump(summary, f, indent=1)
  if not FLAGS.output:
    for r in records[:8]:
      print(f"--- {r['id']} [{r['category'] or '-'}] ({r['finish_reason']}, {len(r['token_ids'])} tokens)\n{r['text']}")
  print()
  print(table)
  print()
  for line in summary_lines(proposer, main_run, base, summary, loaded_s, cfg):
    print(line)
  return summary


def summary_lines(proposer, main_run, base, summary, loaded_s: float, cfg: dict) -> list:
  """Tokens and times per arm (timed generation, and the untimed load and compiles beside it), the speedup with
  the spread to expect, and whether every speculative output equals the baseline's."""
  lines = []
  for run, name in ((base, "baseline"), (main_run, proposer.name)):
    if run is None:
      continue
    s = run.summary
    line = (f"{name}: {s['output_tokens']} tokens in {s['wall_s']:.2f} s of timed generation = "
            f"{s['output_tokens_per_s']:.1f} tok/s (compiles and warm-up runs, {s['warmup_s']:.1f} s, untimed)")
    if run is main_run and proposer.k:
      line += f"; mean acceptance length {s['mean_acceptance_length']:.2f}, acceptance rate {s['acceptance_rate']:.2f}"
      if proposer.tree is not None:
        line += f", tree of {proposer.tree.nodes} nodes ({s['mean_draft_tokens_per_step']:.1f} drafted per step)"
    lines.append(line)
  total = time.perf_counter() - T0
  lines.append(f"wall time: {total:.1f} s in all = {loaded_s:.1f} s loading + "
               f"{sum(r.summary['warmup_s'] for r in (base, main_run) if r):.1f} s compiling and warming up + "
               f"{sum(r.summary['timed_s_all_repeats'] for r in (base, main_run) if r):.1f} s timed generation "
               f"(+ the rest: printing, stats)")
  if base is not None:
    line = f"speedup {summary['speedup']:.2f}x (speculative tok/s over baseline tok/s, timed generation only)"
    if FLAGS.repeats > 1:
      line += f"; per repeat {min(summary['speedup_by_repeat']):.2f}-{max(summary['speedup_by_repeat']):.2f}x"
    else:
      line += f"; {SPREAD_NOTE}"
    lines.append(line)
    lines.append(equality_line(main_run.records, base.records, cfg))
  return lines


def differences(records: list, base_records: list) -> list:
  """[{id, from_token}] for each speculative output that is not the baseline's token for token."""
  out = []
  for r, b in zip(records, base_records):
    if r["token_ids"] != b["token_ids"]:
      at = next((i for i, (x, y) in enumerate(zip(r["token_ids"], b["token_ids"])) if x != y),
                min(len(r["token_ids"]), len(b["token_ids"])))
      out.append({"id": r["id"], "from_token": at})
  return out


def equality_line(records: list, base_records: list, cfg: dict) -> str:
  """Whether each speculative output equals the baseline's token for token, naming those that differ (and where)."""
  differ = [f"{d['id']} (from token {d['from_token']})" for d in differences(records, base_records)]
  n = len(records)
  if not differ:
    return f"outputs: all {n} speculative outputs equal the baseline's token for token"
  why = ("sampled (temperature > 0): the same distribution, not the same draws" if cfg["temperature"] > 0 else
         "greedy in float32 they must match; in bfloat16 a verify step over k + 1 positions can round a near tie "
         "differently from one-token decoding")
  return f"outputs: {n - len(differ)} of {n} equal the baseline's; differ: {', '.join(differ)} ({why})"


if __name__ == "__main__":
  app.run(main)
