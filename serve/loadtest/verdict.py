"""Keep, roll back, neutral or inconclusive for each (load point, segment) cell of a speculative arm against the
baseline.

The guardrails are fixed in config before the run. A cell rolls back when any guardrail fails, keeps when none
fails and a latency/throughput metric improves by more than the noise, and is neutral otherwise. The noise is
measured, not assumed: the baseline runs more than once (first and last, so drift counts as noise), and a metric's
noise in a cell is the spread of its repeats, (max - min) / mean. A difference counts only beyond
max(noise_floor, noise_multiplier x noise).

A cell with fewer than min_requests completed requests (in the arm or any baseline repeat) is inconclusive: too thin
to judge, not evidence of "no difference". An arm with an inconclusive load point on all traffic (and no roll back)
is inconclusive overall, and the CLI exits non-zero.
"""

from __future__ import annotations

from typing import Optional

LOWER_BETTER = {"itl_p50", "itl_p95", "itl_mean", "tpot_mean", "tpot_p50", "tpot_p95", "e2e_p50", "e2e_p95",
                "e2e_mean", "ttft_p50", "ttft_p95", "queue_p50", "queue_p95"}
HIGHER_BETTER = {"req_s", "output_tok_s"}
NAMES = {"itl_p50": "p50 ITL", "itl_p95": "p95 ITL", "tpot_mean": "mean TPOT", "tpot_p50": "p50 TPOT",
         "e2e_p50": "p50 e2e latency", "e2e_p95": "p95 e2e latency", "ttft_p95": "p95 TTFT", "ttft_p50": "p50 TTFT",
         "req_s": "completed req/s", "output_tok_s": "output tok/s", "failure_rate": "failed requests",
         "oom": "out-of-memory events", "acceptance_rate": "acceptance rate", "completed": "completed requests"}

DEFAULTS = dict(itl_p95_max_ratio=1.0, peak_req_s_min_ratio=0.97, max_extra_failure_rate=0.0, acceptance_floor=0.1,
                noise_floor=0.03, noise_multiplier=2.0, min_requests=4,
                improve_metrics=("tpot_mean", "e2e_p50", "output_tok_s"), throughput_tags=("peak", "overload"))


def guard_config(cfg) -> dict:
  g = dict(DEFAULTS)
  g.update({k: v for k, v in dict(cfg or {}).items()})
  g["improve_metrics"] = tuple(g["improve_metrics"])
  g["throughput_tags"] = tuple(g["throughput_tags"])
  return g


def _vals(reps: list, metric: str) -> list:
  return [r[metric] for r in reps if r is not None and r.get(metric) is not None]


def noise(reps: list, metric: str) -> Optional[float]:
  """(max - min) / mean over the baseline repeats; None with fewer than two repeats."""
  v = _vals(reps, metric)
  if len(v) < 2:
    return None
  m = sum(v) / len(v)
  return (max(v) - min(v)) / abs(m) if m else 0.0


def reference(reps: list, metric: str) -> Optional[float]:
  v = _vals(reps, metric)
  return sum(v) / len(v) if v else None


def threshold(reps: list, metric: str, g: dict) -> float:
  n = noise(reps, metric)
  return max(g["noise_floor"], g["noise_multiplier"] * (n or 0.0))


def _fmt(metric: str, v: Optional[float]) -> str:
  if v is None:
    return "n/a"
  if metric.startswith(("itl", "tpot", "e2e", "ttft", "queue")):
    return f"{v * 1e3:.1f} ms"
  if metric in ("failure_rate", "acceptance_rate"):
    return f"{v:.1%}"
  return f"{v:.3g}"


def decide_cell(arm: dict, base_reps: list, g: dict, *, tag: str, segment: str, speculative: bool,
                oom_events: float = 0) -> dict:
  """arm, base_reps: cell stats (aggregate.cell_stats) of the arm and of each baseline repeat."""
  def out(verdict, metric, detail, **kw):
    return {"verdict": verdict, "metric": metric, "detail": detail, **kw}

  base_reps = [b for b in base_reps if b is not None]
  if not base_reps or arm is None:
    return out("inconclusive", "completed", "no baseline cell" if arm is not None else "no cell for this arm")
  n_base = min(b["completed"] for b in base_reps)
  if arm["completed"] < g["min_requests"] or n_base < g["min_requests"]:
    worst = min(base_reps, key=lambda b: b["completed"])
    return out("inconclusive", "completed",
               f"too few finished requests to judge: {arm['completed']}/{arm['requests']} completed in the arm, "
               f"{n_base}/{worst['requests']} in the thinnest baseline repeat; need {g['min_requests']} (the rest "
               f"failed or were cut at max_seconds_per_point + drain_seconds)")
  # Guardrails, in order: memory, failures, p95 ITL, throughput at peak, acceptance.
  ooms = arm.get("oom", 0) + (oom_events or 0)
  if ooms > 0:
    return out("roll back", "oom", f"{ooms:g} out-of-memory events")
  rates = [b["failed"] / max(b["requests"], 1) for b in base_reps]
  arm_rate = arm["failed"] / max(arm["requests"], 1)
  allowed = max(rates) + (max(rates) - min(rates)) + g["max_extra_failure_rate"]
  if arm_rate > allowed + 1e-12:
    return out("roll back", "failure_rate", f"failed requests {arm_rate:.1%} vs baseline {max(rates):.1%} "
               f"(allowed {allowed:.1%})", value=arm_rate, base=max(rates))
  b, a = reference(base_reps, "itl_p95"), arm.get("itl_p95")
  if a is not None and b:
    thr = threshold(base_reps, "itl_p95", g)
    limit = b * max(g["itl_p95_max_ratio"], 1.0 + thr)
    if a > limit:
      return out("roll back", "itl_p95", f"p95 ITL {_fmt('itl_p95', a)} vs baseline {_fmt('itl_p95', b)} "
                 f"({a / b - 1:+.0%}; allowed up to {_fmt('itl_p95', limit)})", value=a, base=b, threshold=thr)
  if segment == "all" and tag in g["throughput_tags"]:
    b, a = reference(base_reps, "req_s"), arm.get("req_s")
    if a is not None and b:
      thr = threshold(base_reps, "req_s", g)
      limit = b * min(g["peak_req_s_min_ratio"], 1.0 - thr)
      if a < limit:
        return out("roll back", "req_s", f"completed req/s {a:.3g} vs baseline {b:.3g} ({a / b - 1:+.0%}; "
                   f"floor {limit:.3g})", value=a, base=b, threshold=thr)
  if speculative and arm.get("acceptance_rate") is not None and arm["acceptance_rate"] < g["acceptance_floor"]:
    return out("roll back", "acceptance_rate", f"acceptance rate {arm['acceptance_rate']:.1%} below the floor "
               f"{g['acceptance_floor']:.0%}", value=arm["acceptance_rate"], base=g["acceptance_floor"])
  # No guardrail failed: keep if something improved beyond the noise.
  best = None
  for m in g["improve_metrics"]:
    b, a = reference(base_reps, m), arm.get(m)
    if a is None or not b:
      continue
    gain = (b - a) / b if m in LOWER_BETTER else (a - b) / b
    thr = threshold(base_reps, m, g)
    if gain > thr and (best is None or gain - thr > best[1] - best[2]):
      best = (m, gain, thr, a, b)
  if best:
    m, gain, thr, a, b = best
    return out("keep", m, f"{NAMES.get(m, m)} {_fmt(m, a)} vs baseline {_fmt(m, b)} ({gain:+.0%} better; noise "
               f"threshold {thr:.0%})", value=a, base=b, threshold=thr)
  m = g["improve_metrics"][0]
  b, a = reference(base_reps, m), arm.get(m)
  thr = threshold(base_reps, m, g)
  rel = f" ({a / b - 1:+.0%})" if a is not None and b else ""
  return out("neutral", m, f"within noise: {NAMES.get(m, m)} {_fmt(m, a)} vs {_fmt(m, b)}{rel}, threshold "
             f"{thr:.0%}", value=a, base=b, threshold=thr)


def decide(stats: dict, baselines: list, arms: list, points: dict, g: dict, spec_arms: set,
           oom_by_point: Optional[dict] = None) -> dict:
  """stats[arm][point][segment] -> verdicts[arm][point][segment]. points: key -> LoadPoint-like with .tag."""
  oom_by_point = oom_by_point or {}
  out = {}
  for arm in arms:
    out[arm] = {}
    for key, pt in points.items():
      cells = stats.get(arm, {}).get(key, {})
      segs = sorted(set(cells) | {s for b in baselines for s in stats.get(b, {}).get(key, {})},
                    key=lambda s: (s != "all", s))
      out[arm][key] = {}
      for seg in segs:
        reps = [stats.get(b, {}).get(key, {}).get(seg) for b in baselines]
        out[arm][key][seg] = decide_cell(cells.get(seg), reps, g, tag=pt.tag, segment=seg,
                                         speculative=arm in spec_arms,
                                         oom_events=oom_by_point.get((arm, key), 0) if seg == "all" else 0)
  return out


def overall(verdicts: dict) -> dict:
  """Per arm: roll back if any load point rolls back on all traffic; else inconclusive if any is too thin to judge
  on all traffic; keep if some keep; else neutral. Plus the cells where speculation should be on (keep) and off
  (roll back), and the thin points with the reason."""
  res = {}
  for arm, by_point in verdicts.items():
    all_v = {k: v["all"]["verdict"] for k, v in by_point.items() if "all" in v}
    thin = {k: v["all"]["detail"] for k, v in by_point.items() if "all" in v and v["all"]["verdict"] == "inconclusive"}
    if any(v == "roll back" for v in all_v.values()):
      o = "roll back"
    elif thin:
      o = "inconclusive"
    elif any(v == "keep" for v in all_v.values()):
      o = "keep"
    else:
      o = "neutral"
    on = [(k, s) for k, v in by_point.items() for s, c in v.items() if c["verdict"] == "keep"]
    off = [(k, s) for k, v in by_point.items() for s, c in v.items() if c["verdict"] == "roll back"]
    res[arm] = {"overall": o, "on": on, "off": off,
                "loads_on": [k for k, v in all_v.items() if v == "keep"],
                "loads_off": [k for k, v in all_v.items() if v == "roll back"], "inconclusive": thin}
  return res


def not_below(arm_stats: dict, base_reps: list, g: dict,
              metrics=("tpot_mean", "e2e_p50", "itl_p95", "req_s")) -> tuple[bool, list]:
  """The tuned-config check: no metric worse than the baseline beyond the measured noise. -> (ok, failures)."""
  fails = []
  for m in metrics:
    b, a = reference(base_reps, m), arm_stats.get(m)
    if a is None or not b:
      continue
    thr = threshold(base_reps, m, g)
    worse = (a - b) / b if m in LOWER_BETTER else (b - a) / b
    if worse > thr:
      fails.append(f"{NAMES.get(m, m)} {_fmt(m, a)} vs {_fmt(m, b)} ({worse:+.0%} worse; noise {thr:.0%})")
  return not fails, fails
