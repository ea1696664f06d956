"""The pair check before rollout: does this draft fit this target, and does it pay?

  python -m serve.check_pair --config=configs/gemma3_270m.py --speculative_config='{"method": "eagle3"}' --limit=40
  python -m serve.check_pair --model=/models/Llama-3.1-8B-Instruct \\
      --speculative_config='{"method": "eagle3", "model": "/heads/EAGLE3-LLaMA3.1-8B", "num_speculative_tokens": 4}'

1. Static (spec_jax/pair_check.py, also run by every command at start-up): the tokenizer and vocabulary agree,
   the hidden size and aux layer ids fit the target, d2t is in range, the verifier the head names is the loaded
   target by name and architecture. A mismatch that cannot work is an error; a verifier that differs is a warning,
   an error with --strict. With an error the pair is not run (exit 1).
2. The run: the pair on a prompt sample (--prompts, Spec-Bench by default; --limit) at each --check_temperatures
   (greedy and T 0.7), the draft length fixed at k (adaptive off): per-position acceptance, acceptance rate, tau
   (the mean acceptance length: tokens per verify step, the bonus token included). With an 8-bit
   --kv_cache_dtype the pair runs twice per temperature, with that cache and with `auto` (the activation dtype),
   and the table shows both taus and the change: acceptance is measured, not assumed (a reader that mis-scales the
   cache shows here as a tau drop, not as an error). tau_auto is the baseline the KV-dtype guardrail
   (serve/engine/guardrails.py kv_tau_baseline) compares the live tau against.
3. The draft's cost: one propose() and one speculative step timed on a prefilled batch, and one plain decode step
   of the target alone (best of --cost_reps each). The draft's cost per drafted token is propose / k as a fraction
   of the plain step; the estimated speedup is tau * plain step / speculative step (decode only, at this batch).
The verdict table goes to stdout, everything to --json_out.
"""

from __future__ import annotations

import json
import sys
import time

import jax
from absl import app, flags

from serve.engine.timing_probe import time_propose
from serve.jobs import run_flags, setup as setup_lib
from serve.jobs.prompts import load_prompts
from serve.jobs.runner import Arm, run_arms
from spec_jax import backend, pair_check, sharding
from spec_jax.batch import start
from spec_jax.config import SamplingParams
from spec_jax.datasets import SPEC_BENCH, resolve
from spec_jax.decode import decode_loop, make_spec
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.registry import build_proposer

OWN_FLAGS = ("prompts", "limit", "json_out", "strict", "check_temperatures", "cost_reps", "batch_size", "progress")
run_flags.define(*OWN_FLAGS)
FLAGS = flags.FLAGS


def settings() -> dict:
  return run_flags.settings(more=("batch_size", "strict"), defaults={"batch_size": 1, "strict": False})


def static_part(cfg: dict, target, tokenizer) -> list:
  return pair_check.static_check(cfg["spec"], target.config, tokenizer, cfg.get("model") or None)


def sample_prompts(path, tokenizer, limit: int, max_len: int) -> tuple[list, list, int]:
  """The prompts (Spec-Bench by default) that fit the context with their new tokens: (prompts, ids, skipped)."""
  prompts = load_prompts(resolve(path) if path else SPEC_BENCH, tokenizer)
  keep, ids, skipped = [], [], 0
  for p in prompts:
    t = tokenizer.encode(p.text)
    if len(t) > max_len:
      skipped += 1
      continue
    keep.append(p)
    ids.append(t)
    if limit and len(keep) == limit:
      break
  if not keep:
    raise ValueError(f"no prompt of {path or SPEC_BENCH} fits the target's context with the new tokens "
                     f"({max_len} prompt tokens at most)")
  return keep, ids, skipped


def draft_cost(setup, prompt_ids, max_new_tokens: int, seed: int, reps: int) -> dict:
  """Seconds of one propose(), of one speculative step and of one plain (target-only) step, best of `reps`, on a
  batch of the first prompts prefilled (the first decode steps: short contexts)."""
  n = len(prompt_ids)
  slots = sharding.pad_rows(backend.batch_rows(setup.params, n), setup.mesh)
  steps = max(1, min(8, max_new_tokens // (setup.proposer.k + 1)))

  def fresh(spec, pparams):
    both = {"target": setup.params, "proposer": pparams}
    state = start(both, spec, prompt_ids, max_new_tokens=max_new_tokens, sampling=SamplingParams.make(n),
                  seed=seed, num_slots=slots)
    return both, jax.block_until_ready(state)

  def step_time(spec, pparams):
    best = float("inf")
    for _ in range(reps + 1):  # the first compiles
      both, state = fresh(spec, pparams)
      step0 = int(state.step)
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode_loop(both, state, spec, steps))
      ran = int(state.step) - step0
      best = min(best, (time.perf_counter() - t0) / max(ran, 1))
    return best

  kw = dict(stop_ids=setup.stop_ids, impl=setup.impl, mesh=setup.mesh, kv_cache_dtype=setup.kv_cache_dtype)
  spec = make_spec(setup.config, setup.proposer, adaptive_k=False, **kw)
  both, state = fresh(spec, setup.proposer_params)
  propose = min(time_propose(both, state, spec) for _ in range(reps + 1))  # the first compiles
  spec_step = step_time(spec, setup.proposer_params)
  plain_step = step_time(make_spec(setup.config, NoneProposer(), adaptive_k=False, **kw), {})
  k = setup.proposer.k
  return {"batch": n, "propose_s": propose, "spec_step_s": spec_step, "plain_step_s": plain_step,
          "propose_share_of_step": propose / spec_step if spec_step else 0.0,
          "draft_cost_per_token": propose / k / plain_step if plain_step and k else 0.0}


def run_pair(cfg: dict, setup, prompts, prompt_ids, temperatures) -> list[dict]:
  """The pair at each temperature, draft length fixed at k, with the setup's KV cache: acceptance per position,
  rate and tau. An 8-bit cache adds tau_auto / acceptance_rate_auto (the same run with the cache in the activation
  dtype) and tau_change = tau / tau_auto - 1."""
  arm = Arm(setup.proposer.name, setup.proposer, setup.proposer_params)

  def once(t, kv):
    return run_arms([arm], setup.params, setup.config, setup.tokenizer, prompts, prompt_ids,
                    batch_size=cfg["batch_size"], max_new_tokens=cfg["max_new_tokens"],
                    sampling_args=dict(temperature=t, top_k=cfg["top_k"], top_p=cfg["top_p"]), adaptive_k=False,
                    seed=cfg["seed"], impl=setup.impl, stop_ids=setup.stop_ids, progress=cfg.get("progress", False),
                    mesh=setup.mesh, kv_cache_dtype=kv)[0].summary

  rows = []
  for t in temperatures:
    s = once(t, setup.kv_cache_dtype)
    row = {"temperature": t, "prompts": len(prompts), "output_tokens": s["output_tokens"],
           "kv_cache_dtype": setup.kv_cache_dtype,
           "tau": s.get("mean_acceptance_length", 0.0), "acceptance_rate": s.get("acceptance_rate", 0.0),
           "per_position_acceptance": s.get("per_position_acceptance", []),
           "verify_steps": s.get("verify_steps", 0), "drafted_tokens": s.get("drafted_tokens", 0)}
    if setup.kv_cache_dtype != "auto":
      a = once(t, "auto")
      row.update(tau_auto=a.get("mean_acceptance_length", 0.0), acceptance_rate_auto=a.get("acceptance_rate", 0.0))
      row["tau_change"] = row["tau"] / row["tau_auto"] - 1.0 if row["tau_auto"] else 0.0
    rows.append(row)
  return rows


def verdict_table(rows: list[dict], cost: dict | None) -> str:
  kv = bool(rows) and "tau_auto" in rows[0]  # an 8-bit cache: tau beside tau with `auto`
  head = ["T", "prompts", "tau"] + (["tau auto", "tau change"] if kv else []) + [
      "acc rate", "acc by position", "draft cost/token", "est. speedup", "verdict"]
  table = [head]
  for r in rows:
    c = cost.get("draft_cost_per_token") if cost else None
    speed = (r["tau"] * cost["plain_step_s"] / cost["spec_step_s"]) if cost and cost["spec_step_s"] else None
    r["est_speedup"] = speed
    r["verdict"] = ("pays" if speed > 1.0 else "does not pay") if speed is not None else "-"
    table.append([f"{r['temperature']:g}", str(r["prompts"]), f"{r['tau']:.2f}"]
                 + ([f"{r['tau_auto']:.2f}", f"{r['tau_change']:+.1%}"] if kv else []) + [f"{r['acceptance_rate']:.2f}",
                  " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-",
                  f"{c:.3f}" if c is not None else "-", f"{speed:.2f}x" if speed is not None else "-", r["verdict"]])
  widths = [max(len(row[i]) for row in table) for i in range(len(head))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def run(cfg: dict, out=sys.stdout) -> dict:
  """The whole check; -> the JSON report ("verdict" "incompatible" when the static part failed)."""
  spec, strict = cfg["spec"], bool(cfg.get("strict"))
  target, tokenizer, mesh = setup_lib.load_target(cfg)
  findings = static_part(cfg, target, tokenizer)
  verdict = pair_check.verdict(findings, strict)
  report = {"target": cfg.get("model") or target.config.name, "speculative_config": spec.to_json(),
            "kv_cache_dtype": target.kv_cache_dtype,
            "strict": strict, "static": [f.to_json() for f in findings], "static_verdict": verdict}
  print(f"pair check: {report['target']} + {spec.describe()}", file=out)
  print(pair_check.format_findings(findings), file=out)
  print(f"static verdict: {verdict}{' (strict)' if strict else ''}", file=out)
  if pair_check.problems(findings, strict):
    report["verdict"] = "incompatible"
    return report
  if not spec.k:
    report["verdict"] = verdict
    return report
  proposer, proposer_params = build_proposer(spec, target)
  setup = setup_lib.Setup(target, tokenizer, spec, proposer, proposer_params, mesh)
  temps = [float(t) for t in cfg.get("check_temperatures") or (0.0, 0.7)]
  max_len = setup.config.max_seq_len - cfg["max_new_tokens"] - setup.lookahead - 1
  prompts, prompt_ids, skipped = sample_prompts(cfg.get("prompts"), tokenizer, int(cfg.get("limit") or 0), max_len)
  rows = run_pair(cfg, setup, prompts, prompt_ids, temps)
  cost = draft_cost(setup, prompt_ids[:cfg["batch_size"]], cfg["max_new_tokens"], cfg["seed"],
                    int(cfg.get("cost_reps") or 5))
  table = verdict_table(rows, cost)
  report.update(runs=rows, cost=cost, skipped_prompts=skipped, k=proposer.k,
                verdict=verdict if all(r["verdict"] == "pays" for r in rows) else f"{verdict}; drafting does not pay "
                "at every temperature")
  print(f"\n{len(prompts)} prompts ({skipped} longer than the context skipped), k={proposer.k}, "
        f"{cfg['max_new_tokens']} new tokens, batch {cfg['batch_size']}; a propose() is "
        f"{cost['propose_share_of_step']:.0%} of a speculative step", file=out)
  print(table, file=out)
  return report


def main(argv):
  del argv
  try:
    cfg = settings()
    for name in ("prompts", "limit", "json_out", "check_temperatures", "cost_reps", "progress"):
      cfg[name] = FLAGS[name].value
    report = run(cfg)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(report, f, indent=1)
  sys.exit(1 if report["verdict"] == "incompatible" else 0)


if __name__ == "__main__":
  app.run(main)
