"""The measurement harness around the library's generate: warm-up, wall-clock timing, row padding, batching,
interleaved A/B arms with repeats, and per-category tables.

Timing lives here, not in spec_jax/: the library's `generate` reads no clock, so a seeded run is reproducible.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from spec_jax import backend, sharding
from spec_jax.config import SamplingParams
from spec_jax.decode import decode_loop, make_spec
from spec_jax.batch import result, start
from spec_jax.stats import Stats, summarize


@dataclasses.dataclass
class Arm:
  """One side of a comparison: a proposer (NoneProposer for the baseline) and its settings."""

  label: str
  proposer: object
  proposer_params: dict
  costs: object = None  # a [batch, len(ks)] cost table, [len(ks)] list, or None (default model)
  adaptive_k: object = None  # None: run_arms' setting


@dataclasses.dataclass
class TimedBatch:
  token_ids: list
  finish_reasons: list
  raw_stats: Stats
  row_time_s: list  # prefill + decode time until the row finished (an estimate from its finishing step)
  wall_s: float  # prefill + decode, excluding compile
  prefill_s: float
  decode_s: float
  option_uses: list
  ks: tuple
  warm_s: float = 0.0  # the untimed warm-up run (it compiles the batch's programs on first use)
  history: object = None  # the proposer's state at the end, for a proposer that keeps a history (keep_history)


def timed_generate(params, config, prompt_ids, *, max_new_tokens, sampling, proposer, proposer_params, adaptive_k,
                   costs, seed, impl, stop_ids=(), warm=True, mesh=None, history=None, phase=None,
                   kv_cache_dtype="auto") -> TimedBatch:
  """Prefill + loop for one batch, timed. Compiles first (a run with one new token per row) when `warm`.
  With a mesh, params come placed (sharding.shard_params, once per run in run_arms); rows pad to a multiple of
  `data`. `history`: an earlier batch's TimedBatch.history, kept by a proposer with keep_history (suffix), as a
  server's slots keep theirs. `phase(str)`: told "compiling" and "generating" (a progress display)."""
  n = len(prompt_ids)
  spec = make_spec(config, proposer, adaptive_k=adaptive_k, stop_ids=stop_ids, impl=impl, mesh=mesh,
                   kv_cache_dtype=kv_cache_dtype)
  both = {"target": params, "proposer": proposer_params}
  slots = sharding.pad_rows(backend.batch_rows(params, n), mesh)
  keeps = hasattr(proposer, "keep_history")

  def run(max_new):
    t0 = time.perf_counter()
    state = start(both, spec, prompt_ids, max_new_tokens=max_new, sampling=sampling, costs=costs, seed=seed,
                  num_slots=slots)
    if keeps and history is not None:
      state = state.replace(pstate=proposer.keep_history(history, state.pstate))
    jax.block_until_ready(state.tokens)
    t1 = time.perf_counter()
    state = decode_loop(both, state, spec)
    jax.block_until_ready(state.tokens)
    return state, t1 - t0, time.perf_counter() - t1

  warm_s = 0.0
  if warm:
    if phase:
      phase("compiling")
    t = time.perf_counter()
    run(1)
    warm_s = time.perf_counter() - t
  if phase:
    phase("generating")
  state, prefill_s, decode_s = run(max_new_tokens)
  res = result(state, n, spec)
  steps = max(res.steps, 1)
  return TimedBatch(res.token_ids, res.finish_reasons, res.raw_stats,
                    [prefill_s + decode_s * d / steps for d in res.done_step], prefill_s + decode_s, prefill_s,
                    decode_s, res.option_uses, res.ks, warm_s, state.pstate if keeps else None)


@dataclasses.dataclass
class RunResult:
  records: list  # per prompt: id, category, prompt_token_ids, token_ids, text, finish_reason, time_s
  summary: dict  # output_tokens, wall_s, output_tokens_per_s, acceptance metrics, repeat spread
  stats: Stats  # numpy counters, one row per prompt (input order)


def run_arms(arms, params, config, tokenizer, prompts, prompt_ids, *, batch_size, max_new_tokens, sampling_args,
             adaptive_k, seed, impl, stop_ids=(), repeats=1, progress=True, mesh=None,
             kv_cache_dtype="auto") -> list:
  """Every arm over the same batches, interleaved batch by batch (A, B, A, B, ...), `repeats` times, so that a
  change in machine load hits every arm alike. Records and counters come from the last repeat (the outputs of a
  seeded run are the same every repeat); tokens/s is reported per repeat and as min/median/max.

  A proposer with a history (suffix) keeps it from batch to batch within a repeat, as a server's slots do, so a
  prompt set with repeats drafts from what the run already wrote; each repeat starts it afresh (a repeat
  re-measures the run, it does not draft from the previous repeat's answers). Batches run in order of prompt
  length (similar lengths share a batch), so that is the order the history sees them in."""
  order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))  # similar lengths share a batch
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  state = [dict(records=[None] * len(prompts), stat_rows=[None] * len(prompts), walls=[0.0] * repeats, uses=None,
                ks=None, warm_s=0.0) for _ in arms]
  bar = None
  if progress and jax.process_index() == 0:
    bar = tqdm(total=len(batches) * repeats, desc="/".join(a.label for a in arms), file=sys.stderr, unit="batch")
  for r in range(repeats):
    for st in state:
      st["history"] = None
    for bi, batch in enumerate(batches):
      sampling = SamplingParams.make(len(batch), **sampling_args)
      for arm, st in zip(arms, state):
        phase = (lambda what, label=arm.label: bar.set_postfix_str(f"{label}: {what}")) if bar else None
        res = timed_generate(params, config, [prompt_ids[i] for i in batch], max_new_tokens=max_new_tokens,
                             sampling=sampling, proposer=arm.proposer, proposer_params=arm.proposer_params,
                             adaptive_k=adaptive_k if arm.adaptive_k is None else arm.adaptive_k,
                             costs=_costs_for(arm.costs, len(batch), params, mesh), seed=seed + bi, impl=impl,
                             stop_ids=stop_ids, mesh=mesh, history=st["history"], phase=phase,
                             kv_cache_dtype=kv_cache_dtype)
        st["history"] = res.history
        st["walls"][r] += res.wall_s
        st["warm_s"] += res.warm_s
        if r == repeats - 1:
          st["uses"] = res.option_uses if st["uses"] is None else [a + b for a, b in zip(st["uses"], res.option_uses)]
          st["ks"] = res.ks
          for j, i in enumerate(batch):
            toks = res.token_ids[j]
            st["records"][i] = {
                "id": prompts[i].id, "category": prompts[i].category,
                "prompt_token_ids": list(map(int, prompt_ids[i])), "token_ids": toks, "text": tokenizer.decode(toks),
                "finish_reason": res.finish_reasons[j], "time_s": round(res.row_time_s[j], 4),
            }
            st["stat_rows"][i] = jax.tree.map(lambda x: x[j:j + 1], res.raw_stats)
      if bar:
        bar.update(1)
  if bar:
    bar.close()
  if jax.process_count() > 1:  # a run's time is its slowest host's (a collective: every host holds the max)
    walls = np.asarray(multihost_utils.process_allgather(np.array([st["walls"] for st in state], np.float64)))
    for st, w in zip(state, walls.reshape(-1, len(state), repeats).max(0)):
      st["walls"] = w.tolist()
  out = []
  for arm, st in zip(arms, state):
    records = st["records"]
    stats = jax.tree.map(lambda *xs: np.concatenate(xs), *st["stat_rows"])
    out_tokens = sum(len(r["token_ids"]) for r in records)
    rates = [out_tokens / w if w else 0.0 for w in st["walls"]]
    summary = {"prompts": len(prompts), "output_tokens": out_tokens, "wall_s": round(float(np.median(st["walls"])), 4),
               "output_tokens_per_s": float(np.median(rates)), "repeats": repeats,
               "tokens_per_s_by_repeat": [round(x, 2) for x in rates],
               "timed_s_all_repeats": round(float(sum(st["walls"])), 2),
               "warmup_s": round(st["warm_s"], 2)}  # untimed: compiles and the one-token warm-up runs
    if arm.proposer.k:
      summary.update(_acceptance(summarize(stats)))
      summary.update(draft_lengths=list(st["ks"]), steps_per_draft_length=st["uses"])
    out.append(RunResult(records, summary, stats))
  return out


def _costs_for(costs, n, params, mesh=None):
  """A [batch, n_options] table is cut (or its last row repeated) to this batch's row count."""
  if costs is None:
    return None
  c = np.asarray(costs, np.float32)
  if c.ndim == 1:
    return c
  rows = sharding.pad_rows(backend.batch_rows(params, n), mesh)
  return c[np.minimum(np.arange(rows), c.shape[0] - 1)]


def _acceptance(s: dict) -> dict:
  return {k: s[k] for k in ("mean_acceptance_length", "acceptance_rate", "per_position_acceptance",
                            "per_position_drafted", "verify_steps", "drafted_tokens", "accepted_tokens", "mean_draft_tokens_per_step")}


def category_table(base: RunResult, spec: RunResult | None, batch_size: int = 1) -> list[dict]:
  """Per category (and 'all'): tokens/s for each run, speedup, acceptance metrics.

  At batch 1 a row's time is measured. At batch > 1 rows of several categories share a step, so a category's
  time is an estimate (each row's share up to the step at which it finished): those columns are marked '~'.
  """
  cats = sorted({r["category"] for r in base.records})
  rows = []
  for cat in cats + ["all"]:
    idx = [i for i, r in enumerate(base.records) if cat == "all" or r["category"] == cat]
    row = {"category": cat or "-", "prompts": len(idx), "estimated": batch_size > 1 and cat != "all"}
    if cat != "all":
      row["ids"] = [base.records[i]["id"] for i in idx]
    for name, run in (("baseline", base), ("speculative", spec)):
      if run is None:
        continue
      toks = sum(len(run.records[i]["token_ids"]) for i in idx)
      if cat == "all":  # measured: all tokens over the arm's wall time
        row[f"{name}_tok_s"] = run.summary["output_tokens_per_s"]
      else:
        t = sum(run.records[i]["time_s"] for i in idx)
        row[f"{name}_tok_s"] = toks / t if t else 0.0
    if spec is not None:
      row["speedup"] = row["speculative_tok_s"] / row["baseline_tok_s"] if row["baseline_tok_s"] else 0.0
      s = summarize(spec.stats, idx)
      row["mean_acceptance_length"] = s["mean_acceptance_length"]
      row["acceptance_rate"] = s["acceptance_rate"]
      row["per_position_acceptance"] = s["per_position_acceptance"]
      row["per_position_drafted"] = s["per_position_drafted"]
    rows.append(row)
  return rows


SHOWN_IDS = 6  # a category row names its prompts up to this many


def format_table(rows: list[dict]) -> str:
  """The category table, a legend for its acceptance columns, and the '~' note at batch > 1."""
  if not rows:
    return ""
  cols = [c for c in ("category", "prompts", "baseline_tok_s", "speculative_tok_s", "speedup",
                      "mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "per_position_drafted")
          if c in rows[0]]
  short = {"baseline_tok_s": "base tok/s", "speculative_tok_s": "spec tok/s", "mean_acceptance_length": "mean acc len",
           "acceptance_rate": "acc rate", "per_position_acceptance": "acc by position",
           "per_position_drafted": "drafts by position"}
  timed = {"baseline_tok_s", "speculative_tok_s", "speedup"}

  def fmt(r, c):
    v = r[c]
    if c == "prompts" and r.get("ids") and len(r["ids"]) <= SHOWN_IDS:
      return f"{v} ({', '.join(map(str, r['ids']))})"
    if isinstance(v, float):
      return ("~" if r.get("estimated") and c in timed else "") + f"{v:.2f}"
    if isinstance(v, list):
      return " ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
    return str(v)

  table = [[short.get(c, c) for c in cols]] + [[fmt(r, c) for c in cols] for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  if "mean_acceptance_length" in cols:
    lines += ["",
              "mean acc len: tokens committed per verify step, the target's own token included (tau; 1.00 = no draft "
              "accepted)",
              "acc rate: accepted drafts / drafted tokens",
              "acc by position: of the drafts at position 1, 2, ... of a step, the share accepted",
              "drafts by position: how many drafts each share is over (the adaptive loop drafts far positions only",
              "  when it expects them to hold, so a later position over few drafts can read higher)"]
  if any(r.get("estimated") for r in rows):
    lines.append("~ estimated: at batch > 1 rows share steps; per-category time is each row's share until it finished")
  return "\n".join(lines)
