"""Read a finished run's files and derive everything else: per-cell statistics, noise, verdicts, the tuned config
(a segment policy, tuner.py), the tuned-config check per point and segment, and the report. Pure file-in,
file-out, so it reruns without a server.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from serve.loadtest import aggregate, report, tuner
from serve.loadtest import verdict as V
from serve.loadtest.traffic import LoadPoint

TUNED = "tuned"
NOISE_METRICS = ("itl_p95", "tpot_mean", "e2e_p50", "ttft_p95", "output_tok_s", "req_s")


def load_run(out_dir: str):
  with open(os.path.join(out_dir, "run.json")) as f:
    run = json.load(f)
  with open(os.path.join(out_dir, "points.json")) as f:
    results = json.load(f)
  with open(os.path.join(out_dir, "records.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return run, results, records


def fixed_settings(run: dict, results: dict) -> dict:
  """The arms' server command lines must differ only in --port, --speculative_config and an arm's own
  --kv_cache_dtype (listed apart: kv_cache_dtypes)."""
  lines = {}
  for name, res in results.items():
    argv = (res.get("server") or {}).get("argv")
    if argv:
      lines[name] = [a for a in argv if not a.startswith(("--port=", "--speculative_config=", "--kv_cache_dtype="))]
  targeted = sorted(n for n, r in results.items() if not (r.get("server") or {}).get("launched"))
  ref = next(iter(lines.values()), None)
  diffs = sorted({a for v in lines.values() for a in set(v) ^ set(ref or [])})
  return {"flags": ref, "identical": not diffs, "differences": diffs, "targeted_arms": targeted,
          "kv_cache_dtypes": {n: r.get("kv_cache_dtype", "auto") for n, r in results.items()},
          "traffic": {k: run["config"].get(k) for k in ("prompts", "prompt_limit", "output_lengths", "samplings",
                                                         "requests_per_point", "requests_per_client",
                                                         "max_seconds_per_point", "slots", "seed")}}


def check_tuned(stats: dict, points: dict, baselines: list, g: dict, min_requests: int) -> dict:
  """The tuned rerun (the policy replaying the same traffic) against the baseline, per point and per segment cell:
  no metric worse beyond the noise (verdict.not_below). Cells with fewer than min_requests completed requests (in
  the rerun or a baseline repeat) are listed as thin, not judged. -> {point: {"ok", "failures", "segments":
  {segment: {"ok" (None: thin), "failures", "requests"}}}}; a point is ok when every judged cell is."""
  out = {}
  for k in points:
    cells = stats.get(TUNED, {}).get(k, {})
    if "all" not in cells:
      out[k] = {"ok": False, "failures": ["all: no measurements"], "segments": {}}
      continue
    segs = {}
    for seg in sorted(cells, key=lambda s: (s != "all", s)):
      reps = [stats[b][k][seg] for b in baselines if seg in stats.get(b, {}).get(k, {})]
      n = min([cells[seg]["completed"]] + [r["completed"] for r in reps])
      if not reps or n < min_requests:
        segs[seg] = {"ok": None, "failures": [], "requests": n}
        continue
      ok, fails = V.not_below(cells[seg], reps, g)
      segs[seg] = {"ok": ok, "failures": fails, "requests": n}
    fails = [f"{s}: {f}" for s, c in segs.items() for f in c["failures"]]
    out[k] = {"ok": not fails, "failures": fails, "segments": segs}
  return out


def analyze(out_dir: str, write: bool = True, plots: bool = True) -> dict:
  run, results, records = load_run(out_dir)
  cfg = run["config"]
  fields = ("mode", "level", "label", "sampling", "tag")
  points = {p["key"]: LoadPoint(**{k: p[k] for k in fields}) for p in run["points"]}
  grouped = defaultdict(list)
  for r in records:
    grouped[(r["arm"], r["point"])].append(r)
  pts = [{"arm": arm, "key": key, "records": grouped.get((arm, key), []), "wall_s": pres["wall_s"]}
         for arm, res in results.items() for key, pres in res["points"].items()]
  stats = aggregate.aggregate(pts, cfg.get("prompt_len_edges") or (64, 256),
                              int(cfg.get("min_segment_requests", 1)))
  arms = {a["name"]: a for a in run["arms"] if a["name"] in results}
  baselines = [n for n, a in arms.items() if a.get("baseline")]
  others = [n for n, a in arms.items() if not a.get("baseline") and n != TUNED]
  spec = {n for n in others if tuner.arm_method(arms[n].get("speculative_config"))[1] > 0}
  g = V.guard_config(cfg.get("guardrails"))
  oom = {(a, k): (p["metrics"].get("oom_events") or 0) for a, res in results.items() for k, p in res["points"].items()}
  verdicts = V.decide(stats, baselines, others, points, g, spec, oom)
  overall = V.overall(verdicts)
  noise = {k: {m: V.noise([stats[b][k]["all"] for b in baselines if k in stats.get(b, {})], m)
               for m in NOISE_METRICS} for k in points}
  spec_cfgs = {n: arms[n]["speculative_config"] for n in spec if isinstance(arms[n].get("speculative_config"), dict)}
  min_req = int(cfg.get("tuner_min_requests") or g["min_requests"])
  tuned = tuner.choose(stats, verdicts, points, spec_cfgs, baselines, int(cfg.get("slots") or 0),
                       temperatures={s["name"]: float(s.get("temperature", 0.0)) for s in cfg.get("samplings") or []},
                       min_requests=min_req)
  tuned_check = check_tuned(stats, points, baselines, g, min_req) if TUNED in results else None
  summary = {"stats": stats, "verdicts": verdicts, "overall": overall, "noise": noise, "tuned": tuned,
             "tuned_check": tuned_check, "guardrails": g, "baselines": baselines, "arms": others,
             "speculative_arms": sorted(spec), "fixed_settings": fixed_settings(run, results),
             "usage_checks": {a: {k: p["usage_check"] for k, p in res["points"].items()} for a, res in results.items()},
             "points": {k: vars(p) for k, p in points.items()}}
  if write:
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1, default=str)
    if TUNED not in results or not os.path.exists(os.path.join(out_dir, "speculative_config.json")):
      tuner.write(os.path.join(out_dir, "speculative_config.json"), tuned)
    report.write(out_dir, run, results, summary, records, plots=plots)
  return summary
