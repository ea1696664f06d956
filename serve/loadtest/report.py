"""report.md for an inference engineer: the verdict and the recommended config first, then the evidence (noise,
per-load tables, plots), then how it was measured. Plots are matplotlib PNGs next to the report.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from serve.loadtest import report_kv
from serve.loadtest.plots import make_plots

SHORT = {"keep": "**keep**", "roll back": "**roll back**", "neutral": "neutral", "inconclusive": "**inconclusive**"}


def _ms(v: Optional[float]) -> str:
  return "–" if v is None else f"{v * 1e3:.1f}"


def _f(v: Optional[float], fmt: str = ".2f") -> str:
  return "–" if v is None else format(v, fmt)


def _mib(v: Optional[float]) -> str:
  return "–" if v is None else f"{v / 2**20:.0f}"


def _spec(s) -> str:
  if isinstance(s, str):
    return f"`{s}`"
  if not s:
    return "off (k = 0)"
  return "`" + json.dumps(s, sort_keys=True) + "`"


def _table(header: list, rows: list) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return out


def write(out_dir: str, run: dict, results: dict, summary: dict, records: list, plots: bool = True) -> str:
  files = make_plots(out_dir, run, results, summary, records) if plots else []
  files += report_kv.plot(out_dir, results, summary["points"]) if plots else []
  stats, points, verdicts = summary["stats"], summary["points"], summary["verdicts"]
  arms_cfg = {a["name"]: a for a in run["arms"]}
  cfg = run["config"]
  L = ["# Speculative decoding under load: keep or roll back", ""]
  L.append(f"Run {run.get('started', '')} – {run.get('finished', 'unfinished')}; {len(results)} server runs; "
           f"{len(records)} measured requests; prompts `{cfg.get('prompts') or 'built-in'}` "
           f"({run['prompts']['count']} prompts).")
  L += ["", "## Verdict", ""]
  rows = []
  for arm in summary["arms"]:
    o = summary["overall"][arm]
    why = []
    for k in o["loads_off"]:
      why.append(f"{points[k]['label']} [{points[k]['sampling']}]: {verdicts[arm][k]['all']['detail']}")
    if not why:
      for k, detail in (o.get("inconclusive") or {}).items():
        why.append(f"{points[k]['label']} [{points[k]['sampling']}]: {detail}")
    if not why:
      for k in o["loads_on"][:2]:
        why.append(f"{points[k]['label']} [{points[k]['sampling']}]: {verdicts[arm][k]['all']['detail']}")
    rows.append([arm, _spec(arms_cfg[arm].get("speculative_config_path") or arms_cfg[arm].get("speculative_config")),
                 SHORT[o["overall"]], ", ".join(points[k]["label"] + f" [{points[k]['sampling']}]"
                                                for k in o["loads_on"]) or "–",
                 ", ".join(points[k]["label"] + f" [{points[k]['sampling']}]" for k in o["loads_off"]) or "–",
                 "; ".join(why[:2]) or "all within noise"])
  L += _table(["arm", "speculative config", "overall", "keeps at (all traffic)", "rolls back at", "deciding metric"],
              rows)
  tuned = summary["tuned"]
  L += ["", "**Recommendation.** " + _recommend(summary), ""]
  L += ["Tuned `speculative_config.json` (read by `python -m serve.server --speculative_config=PATH`):", "",
        "```json", json.dumps(tuned["config"], indent=1), "```", ""]
  L += policy_table(tuned, points)
  if summary.get("tuned_check") is not None:
    L += tuned_check_lines(summary["tuned_check"], points)
  # Per-arm cell matrix.
  L += ["", "## Verdict per load and segment", "",
        "Each cell: verdict (deciding metric). Segments: all traffic, Spec-Bench category, prompt-length bucket "
        "(prompt tokens), output budget (max_tokens), structured (requests with a response_format).", ""]
  keys = list(points)
  for arm in summary["arms"]:
    segs = sorted({s for k in keys for s in verdicts[arm].get(k, {})}, key=lambda s: (s != "all", s))
    L += [f"### {arm}", ""]
    L += _table(["segment"] + [f"{points[k]['label']} [{points[k]['sampling']}]" for k in keys],
                [[s] + [(f"{SHORT[c['verdict']]} ({c['metric']})" if (c := verdicts[arm].get(k, {}).get(s)) else "–")
                        for k in keys] for s in segs])
    L.append("")
  # Noise.
  L += ["## Repeat-to-repeat noise", "",
        f"The baseline ran {len(summary['baselines'])} times ({', '.join(summary['baselines'])}; first and last, so "
        "drift counts as noise). Noise = (max - min) / mean over the repeats, on all traffic. A difference counts "
        f"only beyond max({summary['guardrails']['noise_floor']:.0%}, {summary['guardrails']['noise_multiplier']:g} "
        "x noise), per metric and cell.", ""]
  nm = ["itl_p95", "tpot_mean", "e2e_p50", "ttft_p95", "output_tok_s", "req_s"]
  L += _table(["load"] + nm, [[f"{points[k]['label']} [{points[k]['sampling']}]"] +
                              [("–" if v.get(m) is None else f"{v[m]:.1%}") for m in nm]
                              for k, v in summary["noise"].items()])
  # Per-point tables.
  L += ["", "## Measurements per load point (all traffic)", "",
        "Times in ms. ITL per token; TPOT = (e2e - TTFT) / (tokens - 1); acceptance from `/metrics` deltas; RSS of "
        "the server process; slots from the `num_slots_in_use` gauge sampled during the point.", ""]
  hdr = ["arm", "ok/failed", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "TPOT", "e2e p50", "e2e p95", "tok/s",
         "req/s", "queue p50", "accept rate", "mean acc len", "proposer share", "RSS MiB", "slots mean/max"]
  for k, p in points.items():
    L += [f"### {p['label']} [{p['sampling']}] ({p['mode']} loop)", ""]
    rows = []
    for arm, res in results.items():
      s = stats.get(arm, {}).get(k, {}).get("all")
      pr = res["points"].get(k)
      if not s or not pr:
        continue
      sp, smp = pr["metrics"]["speculation"], pr["samples"]
      q = s["queue_p50"] if s["queue_p50"] is not None else (pr["metrics"].get("server_queue") or {}).get("p50")
      slots = smp.get("slots_in_use")
      rows.append([arm, f"{s['completed']}/{s['failed']}" + (f" ({s['cut']} cut)" if s["cut"] else ""),
                   _ms(s["ttft_p50"]), _ms(s["ttft_p95"]), _ms(s["itl_p50"]), _ms(s["itl_p95"]), _ms(s["tpot_mean"]),
                   _ms(s["e2e_p50"]), _ms(s["e2e_p95"]), _f(s["output_tok_s"], ".1f"), _f(s["req_s"], ".2f"), _ms(q),
                   _f(sp.get("acceptance_rate")), _f(sp.get("mean_acceptance_length")),
                   _f(pr["metrics"].get("proposer_share")), _mib((smp.get("rss_bytes") or {}).get("max")),
                   f"{slots['mean']:.1f}/{slots['max']:.0f}" if slots else "–"])
    L += _table(hdr, rows) + [""]
  L += report_kv.section(results, points)
  L += report_kv.dtype_section(results, points)
  if files:
    L += ["## Plots", ""] + [f"![{f[:-4]}]({f})" for f in files] + [""]
  # How it was measured.
  fs = summary["fixed_settings"]
  if fs["flags"] is None:
    check = "Not checked: the tool started no server (every arm was targeted by URL)"
  else:
    check = "Checked: " + ("**identical**" if fs["identical"] else "**DIFFERENT**: " + ", ".join(fs["differences"]))
  L += ["## Fixed settings", "",
        "Every launched arm ran the same server command line; only `--speculative_config` (and the port) differ, "
        "and `--kv_cache_dtype` where an arm sets its own. "
        f"{check}.", ""]
  kvs = fs.get("kv_cache_dtypes") or {}
  if any(v != "auto" for v in kvs.values()):
    L += ["KV cache dtype per arm: " + ", ".join(f"{a} `{v}`" for a, v in kvs.items()) + ".", ""]
  if fs["flags"]:
    L += ["```", " ".join(fs["flags"]), "```", ""]
  rows = []
  for arm, res in results.items():
    rep = (res.get("server") or {}).get("reported") or {}
    sp = rep.get("speculation") or {}
    mdl = ((rep.get("models") or {}).get("data") or [{}])[0]
    rows.append([arm, _spec(res.get("speculative_config")), sp.get("method", "–"), sp.get("k_max", "–"),
                 sp.get("ks", "–"), sp.get("enabled", "–"), mdl.get("id", "–"), mdl.get("max_model_len", "–")])
  L += ["What each server reported at start (`GET /admin/speculation`, `/v1/models`):", ""]
  L += _table(["arm", "requested", "method", "k max", "k options", "enabled", "model", "max_model_len"], rows) + [""]
  if fs["targeted_arms"]:
    L += [f"Arms targeted by URL (settings not checked by the tool): {', '.join(fs['targeted_arms'])}.", ""]
  L += ["Traffic:", ""] + [f"- `{k}`: `{json.dumps(v)}`" for k, v in fs["traffic"].items()]
  L += ["", "Guardrails (set before the run):", ""]
  L += [f"- `{k}`: `{json.dumps(v)}`" for k, v in summary["guardrails"].items()] + [""]
  uc = summary["usage_checks"]
  bad = [(a, k, n) for a, by in uc.items() for k, c in by.items() for n, v in c.items()
         if isinstance(v, dict) and v.get("match") is False]
  L += ["## Checks", "",
        "- `/metrics` deltas against per-request `usage` sums (drafted, accepted, completion tokens): "
        + ("all agree." if not bad else "MISMATCH at " + ", ".join(f"{a} {k} {n}" for a, k, n in bad)),
        "- Percentiles are numpy's (linear) over `records.jsonl`; ITL pools every per-token sample of the cell.",
        "- ITL: an SSE event carrying n tokens `gap` after the previous event adds n samples of gap / n; tokens in "
        "the first event count in TTFT only. `event_gaps` in the records keeps the raw per-event gaps.", ""]
  path = os.path.join(out_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(L))
  return path


def _match_text(m: dict) -> str:
  if not m:
    return "everything else"
  parts = []
  for key, v in m.items():
    if key in ("temperature", "segment"):
      parts.append(f"{key} {v}")
    else:
      parts.append(f"{key} [{v[0]}, {'∞' if v[1] is None else v[1]})")
  return ", ".join(parts)


def _cell_text(c: dict) -> str:
  gain = "" if c.get("gain") is None else f", {c['gain']:+.0%} tok/s"
  return (f"{c['point']} {c['segment']}: {c['verdict']} ({c['metric']}{gain}; n {c['requests']}/"
          f"{c['baseline_requests']})")


def policy_table(tuned: dict, points: dict, max_off: int = 6) -> list[str]:
  """The tuned policy as a table: rule, match, k, the evidence behind it and the fallbacks it took."""
  rules = tuned.get("rules") or []
  method = tuned["method"] if tuned["method"] != "none" else "no method wins"
  L = [f"The policy ({method}; first matching rule wins; a cell counts with at least "
       f"{tuned.get('min_requests', '?')} completed requests, thinner cells fall back to the coarser segment):", ""]
  rows = []
  for i, r in enumerate(rules):
    ev = r["evidence"]
    if ev.get("default"):
      off = ev["segments"]
      items = []
      for s in off[:max_off]:
        seg = s["segment"]
        what = ", ".join(f"{x}" for x in (seg["temperature"], f"busy {seg['busy_slots']}", seg["prompt"] and
                                            f"prompt {seg['prompt']}", seg["output"] and f"output {seg['output']}")
                         if x)
        items.append(f"{what}: " + "; ".join(f"{a} {w}" for a, w in s["why"].items()))
      more = f"; … {len(off) - max_off} more (summary.json)" if len(off) > max_off else ""
      evidence = (f"{len(off)} segment{'s' if len(off) != 1 else ''}: " + " · ".join(items) + more) if off else "–"
      fb = sorted({f for s in off for f in s["fallbacks"]})
    else:
      gain = "" if ev.get("gain") is None else f" (mean {ev['gain']:+.0%} output tok/s)"
      evidence = f"{', '.join(ev['arms'])}{gain}: " + " · ".join(_cell_text(c) for c in ev["cells"])
      fb = ev["fallbacks"]
    rows.append([f"{i + 1} `{r.get('name', '')}`", f"`{json.dumps(r['match'])}`" + ("" if r["match"] else
                                                                                      " (everything else)"),
                 r["k"] if r["k"] else "0 (off)", evidence, "; ".join(fb) or "–"])
  L += _table(["rule", "match", "k", "evidence (cell: verdict (deciding metric, gain; requests arm/baseline))",
               "fallbacks"], rows)
  for n in tuned.get("notes") or []:
    L += ["", f"Note: {n}"]
  return L


def tuned_check_lines(tc: dict, points: dict, max_listed: int = 12) -> list[str]:
  """The tuned rerun per load point and segment cell: ok, BELOW the baseline beyond the noise, or thin."""
  judged = [(k, s, c) for k, v in tc.items() for s, c in v.get("segments", {}).items() if c["ok"] is not None]
  bad = [(k, s, c) for k, s, c in judged if not c["ok"]]
  missing = [k for k, v in tc.items() if not v.get("segments")]
  if not judged:
    what = "no cell with enough requests to judge"
  elif not bad:
    what = f"never below the baseline beyond the noise in the {len(judged)} cells with enough requests"
  else:
    what = f"BELOW the baseline beyond the noise in {len(bad)} of {len(judged)} cells with enough requests"
  L = ["", f"**Tuned policy rerun** (the same traffic, judged per load point and segment): {what}"
       + (f"; no measurements at {', '.join(missing)}" if missing else "") + "."]
  for k, s, c in bad[:max_listed]:
    L.append(f"- {points[k]['label']} [{points[k]['sampling']}] {s}: " + "; ".join(c["failures"]))
  if len(bad) > max_listed:
    L.append(f"- … {len(bad) - max_listed} more (summary.json, `tuned_check`)")
  keys = [k for k in tc if tc[k].get("segments")]
  segs = sorted({s for k in keys for s in tc[k]["segments"]}, key=lambda s: (s != "all", s))
  if keys:
    def mark(c):
      if c is None:
        return "–"
      return f"thin ({c['requests']})" if c["ok"] is None else ("ok" if c["ok"] else "**BELOW**")
    L += [""] + _table(["segment"] + [f"{points[k]['label']} [{points[k]['sampling']}]" for k in keys],
                       [[s] + [mark(tc[k]["segments"].get(s)) for k in keys] for s in segs])
  return L


def _recommend(summary: dict) -> str:
  tuned = summary["tuned"]
  tc = summary.get("tuned_check")
  if not summary["arms"] and tc is not None:  # a rerun of a given policy (held apart): its check is the verdict
    cells = [s for v in tc.values() for s in v["segments"].values() if s["ok"] is not None]
    bad = sum(not s["ok"] for s in cells)
    return ("This run checks a given policy (arm `tuned`), with no arms to tune from: it "
            + (f"stays within the noise of the baseline in all {len(cells)} cells with enough requests."
               if not bad else f"is below the baseline beyond the noise in {bad} of {len(cells)} cells (below)."))
  on = [r for r in tuned.get("rules") or [] if r["k"]]
  if not on:
    parts = ["Speculation off everywhere: no segment keeps with enough requests."]
  else:
    parts = [f"Speculation ({tuned['method']}) on for " + "; ".join(
        f"{_match_text(r['match']) if r['match'] else 'all other traffic'} (k = {r['k']})" for r in on)
        + ("" if on[-1]["match"] == {} else "; off for all other traffic") + "."]
  thin = [a for a in summary["arms"] if summary["overall"][a]["overall"] == "inconclusive"]
  if thin:
    parts.insert(0, f"Inconclusive for {', '.join(thin)}: some load points finished too few requests to judge "
                 "(listed above); rerun with a larger max_seconds_per_point / drain_seconds or on a quieter machine "
                 "before acting on this.")
  if tuned.get("fallbacks"):
    n = len(tuned["fallbacks"])
    parts.append(f"{n} segment{' was' if n == 1 else 's were'} too thinly measured and fell back to a coarser "
                 "segment (listed in the policy table).")
  for a in summary["arms"]:  # arms worth keeping somewhere: where they still hurt a segment
    o = summary["overall"][a]
    if o["overall"] != "keep":
      continue
    segs = sorted({s for k, s in o["off"] if s != "all" and k in o["loads_on"]})
    if segs:
      parts.append(f"{a} keeps on all traffic but rolls back for " + ", ".join(segs[:8]) +
                   ("…" if len(segs) > 8 else "") + " at those loads.")
  return " ".join(parts)
