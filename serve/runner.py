"""Run a prompt set through generate() in batches and collect per-prompt records and aggregate metrics."""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np

from spec_jax.config import SamplingParams
from spec_jax.decode import generate
from spec_jax.stats import Stats, summarize


@dataclasses.dataclass
class RunResult:
  records: list  # per prompt: id, category, prompt_token_ids, token_ids, text, finish_reason, time_s
  summary: dict  # output_tokens, wall_s, output_tokens_per_s, acceptance metrics
  stats: Stats  # numpy counters, one row per prompt (input order)


def run_prompts(params, config, tokenizer, prompts, prompt_ids, *, batch_size, max_new_tokens, sampling_args,
                proposer, proposer_params, adaptive_k, seed, impl, stop_ids=(), progress=True, label=""):
  """prompts: list of serve.prompts.Prompt; prompt_ids: their token ids (BOS included)."""
  order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))  # similar lengths share a batch
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  records = [None] * len(prompts)
  stat_rows = [None] * len(prompts)
  wall = 0.0
  uses, costs, ks = None, None, None
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(prompts), desc=label or proposer.name, file=sys.stderr, unit="prompt")
  for bi, batch in enumerate(batches):
    n = len(batch)
    sampling = SamplingParams.make(n, **sampling_args)
    res = generate(params, config, [prompt_ids[i] for i in batch], max_new_tokens=max_new_tokens,
                   sampling=sampling, proposer=proposer, proposer_params=proposer_params, adaptive_k=adaptive_k,
                   stop_ids=stop_ids, seed=seed + bi, impl=impl)
    wall += res.wall_s
    uses = res.option_uses if uses is None else [a + b for a, b in zip(uses, res.option_uses)]
    costs, ks = res.costs, res.ks
    for j, i in enumerate(batch):
      toks = res.token_ids[j]
      records[i] = {
          "id": prompts[i].id, "category": prompts[i].category, "prompt_token_ids": list(map(int, prompt_ids[i])),
          "token_ids": toks, "text": tokenizer.decode(toks), "finish_reason": res.finish_reasons[j],
          "time_s": round(res.row_time_s[j], 4),
      }
      stat_rows[i] = jax.tree.map(lambda x: x[j:j + 1], res.raw_stats)
    if bar:
      bar.update(n)
      bar.set_postfix(tok_s=f"{sum(len(r['token_ids']) for r in records if r) / max(wall, 1e-9):.1f}")
  if bar:
    bar.close()
  stats = jax.tree.map(lambda *xs: np.concatenate(xs), *stat_rows)
  out_tokens = sum(len(r["token_ids"]) for r in records)
  summary = {"prompts": len(prompts), "output_tokens": out_tokens, "wall_s": round(wall, 4),
             "output_tokens_per_s": out_tokens / wall if wall else 0.0}
  if proposer.k:
    summary.update(_acceptance(summarize(stats)))
    # What the adaptive controller saw and chose: step cost per k (relative to k = 0) and steps per k.
    summary.update(draft_lengths=list(ks), step_costs=[round(c, 3) for c in costs], steps_per_draft_length=uses)
  return RunResult(records, summary, stats)


def _acceptance(s: dict) -> dict:
  return {k: s[k] for k in ("mean_acceptance_length", "acceptance_rate", "per_position_acceptance",
                            "verify_steps", "drafted_tokens", "accepted_tokens")}


def category_table(base: RunResult, spec: RunResult | None) -> list[dict]:
  """Per category (and 'all'): tokens/s for each run, speedup, acceptance metrics."""
  cats = sorted({r["category"] for r in base.records})
  rows = []
  for cat in cats + ["all"]:
    idx = [i for i, r in enumerate(base.records) if cat == "all" or r["category"] == cat]
    row = {"category": cat or "-", "prompts": len(idx)}
    for name, run in (("baseline", base), ("speculative", spec)):
      if run is None:
        continue
      toks = sum(len(run.records[i]["token_ids"]) for i in idx)
      t = sum(run.records[i]["time_s"] for i in idx)
      row[f"{name}_tok_s"] = toks / t if t else 0.0
    if spec is not None:
      row["speedup"] = row["speculative_tok_s"] / row["baseline_tok_s"] if row["baseline_tok_s"] else 0.0
      s = summarize(spec.stats, idx)
      row["mean_acceptance_length"] = s["mean_acceptance_length"]
      row["acceptance_rate"] = s["acceptance_rate"]
      row["per_position_acceptance"] = s["per_position_acceptance"]
    rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  if not rows:
    return ""
  cols = [c for c in ("category", "prompts", "baseline_tok_s", "speculative_tok_s", "speedup",
                      "mean_acceptance_length", "acceptance_rate", "per_position_acceptance") if c in rows[0]]
  short = {"baseline_tok_s": "base tok/s", "speculative_tok_s": "spec tok/s", "mean_acceptance_length": "mean acc len",
           "acceptance_rate": "acc rate", "per_position_acceptance": "acc by position"}

  def fmt(v):
    if isinstance(v, float):
      return f"{v:.2f}"
    if isinstance(v, list):
      return " ".join(f"{x:.2f}" for x in v)
    return str(v)

  table = [[short.get(c, c) for c in cols]] + [[fmt(r[c]) for c in cols] for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)
