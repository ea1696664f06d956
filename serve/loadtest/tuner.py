"""Turn the matrix's per-segment verdicts into a speculative_config.json with a segment policy
(spec_jax/spec_policy.py), which the server reads with --speculative_config=PATH and applies per request at admission:

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
   "policy": [{"match": {"temperature": "zero", "busy_slots": [1, 2], "max_tokens": [0, 64]},
               "num_speculative_tokens": 4},
              {"match": {"temperature": "zero", "busy_slots": [2, 4]}, "num_speculative_tokens": 2},
              {"match": {}, "num_speculative_tokens": 0}]}

Segments: a grid over the features the server knows at admission, from the closed-loop points of the matrix
(open-loop points have no busy-slot count and are not used):
- temperature: a point's sampling setting, "zero" (temperature 0) or "nonzero";
- busy_slots: a band per measured concurrency c, [c, next c), the first from 1 and the top one open; every
  concurrency at or above the slot count (peak, overload) falls in one band [slots, open), since busy slots never
  exceed the slots. An arm is on in a band where it keeps at the band's own points and does not roll back at the
  next band's first level (its guard): busy slots are counted at admission, when a closed loop's other clients may
  be between requests (their slots freed, their next request not yet sent), so traffic at concurrency 4 is mostly
  admitted at 2-3 busy slots. Measured in issue 29's held-apart checks: a band [2, 4) judged on c2 alone gave
  sampled c4 traffic k = 4 and +107 % p95 ITL; requiring a keep at the guard too turned off greedy segments whose
  c2 cells were merely neutral (12 requests a cell) and lost their gain;
- prompt_tokens: the prompt-length buckets of the matrix ("<64" -> [0, 64), "64-255" -> [64, 256), ">=256" ->
  [256, open));
- max_tokens: the output budgets b1 < b2 < ...: [0, b2), [b2, b3), ..., [bn, open).
A (temperature, band) group holds the points of that temperature whose concurrency is in the band. The matrix
measures each dimension on its own (cells "prompt=..." and "output=..."), so a grid segment (group, prompt
bucket, output budget) speculates with an arm only where that arm keeps at every one of its cells: the prompt
bucket's cell and the output budget's cell at every point of the group.

A cell counts only with at least `min_requests` completed requests, in the arm and in every baseline repeat.
Where one of a dimension's cells is thinner, that dimension falls back to the coarser segment: the group's "all"
cells, then the temperature alone (the "all" cells of every point of that temperature that have enough requests);
each fallback is recorded and the report lists it.

One server loads one proposer: the method with the largest summed gain over the segments it wins (gain: output
tok/s over the baseline's on the deciding cells, minus 1). Each segment gets the k of that method's arm that is on
there with the largest gain; 0 where none is on. The grid is then written as a short policy: adjacent values of a
dimension whose sub-grids are identical merge into one bucket, a dimension whose values all merge over its whole
range is left out of the match, rules equal to the default are dropped (the rules are disjoint boxes, so their
order does not matter), and the last rule is {"match": {}, "num_speculative_tokens": 0}, unless every segment is on,
when the default takes the most common k. Nothing on anywhere: {} (speculation off).

Requests with a response_format (the "structured" segment) get rules of their own, ahead of the grid's: per
temperature, the k of the method's arm that keeps at the structured cell of every point (0 where none does).

choose() returns the config and, per rule, its evidence (cells with verdict, deciding metric, gain and request
counts; fallbacks), which goes into summary.json and the report but never into the written config.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from typing import Optional

from spec_jax.spec_policy import MAX_RULES, parse_policy

DIMS = ("temperature", "busy_slots", "prompt_tokens", "max_tokens")


def arm_method(spec: Optional[dict]) -> tuple[str, int]:
  if not spec or not spec.get("method") or spec.get("method") == "none":
    return "none", 0
  return spec["method"], int(spec.get("num_speculative_tokens", 0))


def prompt_range(label: str) -> Optional[tuple]:
  """A prompt-length bucket label of traffic.prompt_len_bucket -> [lo, hi) (hi None: open); None for '?'."""
  if m := re.fullmatch(r"<(\d+)", label):
    return (0, int(m[1]))
  if m := re.fullmatch(r"(\d+)-(\d+)", label):
    return (int(m[1]), int(m[2]) + 1)
  if m := re.fullmatch(r">=(\d+)", label):
    return (int(m[1]), None)
  if label == "all":
    return (0, None)
  return None


def busy_bands(levels, slots: int = 0) -> list[tuple]:
  """Measured concurrencies -> [(lo, hi | None, (own levels), (guard level,) | ())], the first band from 1, the top
  one open; the guard is the next band's lowest level."""
  levels = sorted({int(c) for c in levels})
  low = [c for c in levels if not slots or c < slots]
  high = [c for c in levels if slots and c >= slots]
  starts = low + ([slots] if high else [])
  own = [tuple(high) if high and lo == slots else (lo,) for lo in starts]
  bands = []
  for i, lo in enumerate(starts):
    hi = starts[i + 1] if i + 1 < len(starts) else None
    guard = own[i + 1][:1] if i + 1 < len(starts) else ()  # the next level's first: see the module docstring
    bands.append((1 if i == 0 else lo, hi, own[i], guard))
  return bands


def _temperature_class(t: float) -> str:
  return "zero" if float(t) == 0.0 else "nonzero"


class _Evidence:
  """Per-arm decisions on sets of cells, with the request-count floor and the fallback chain."""

  def __init__(self, stats, verdicts, baselines, min_requests, temp_points):
    self.stats, self.verdicts, self.baselines = stats, verdicts, baselines
    self.n, self.temp_points = int(min_requests), temp_points

  def cell(self, arm: str, key: str, seg: str) -> dict:
    a = self.stats.get(arm, {}).get(key, {}).get(seg) or {}
    bs = [self.stats.get(b, {}).get(key, {}).get(seg) for b in self.baselines]
    n_base = min([(b or {}).get("completed", 0) for b in bs] or [0])
    v = self.verdicts.get(arm, {}).get(key, {}).get(seg) or {"verdict": "neutral", "metric": "completed",
                                                                "detail": "no cell"}
    ref = [b["output_tok_s"] for b in bs if b and b.get("output_tok_s")]
    gain = a["output_tok_s"] / (sum(ref) / len(ref)) - 1.0 if ref and a.get("output_tok_s") is not None else None
    return {"arm": arm, "point": key, "segment": seg, "verdict": v["verdict"], "metric": v.get("metric"),
            "detail": v.get("detail"), "gain": gain, "requests": a.get("completed", 0), "baseline_requests": n_base}

  def backed(self, c: dict) -> bool:
    return c["requests"] >= self.n and c["baseline_requests"] >= self.n

  def decide(self, arm: str, temp: str, keys: tuple, seg: str, what: str, guard: bool = False) -> dict:
    """Whether `arm` keeps at segment `seg` of every point in keys (guard: does not roll back at any); thin cells
    fall back to the points' "all" cells, then to the temperature's. -> {"on", "cells", "fallback": note | None}."""
    note = None
    cells = [self.cell(arm, k, seg) for k in keys]
    if seg != "all" and not all(self.backed(c) for c in cells):
      thin = [c for c in cells if not self.backed(c)]
      note = (f"{what} {seg}: {', '.join(c['point'] for c in thin)} "
              f"{'has' if len(thin) == 1 else 'have'} under {self.n} requests "
              f"({min(min(c['requests'], c['baseline_requests']) for c in thin)}); fell back to all traffic")
      seg, cells = "all", [self.cell(arm, k, "all") for k in keys]
    if not all(self.backed(c) for c in cells):
      thin = [c for c in cells if not self.backed(c)]
      what_all = f"{what} all" if note is None else note
      cells = [c for c in (self.cell(arm, k, "all") for k in self.temp_points[temp]) if self.backed(c)]
      note = (f"{what_all}: {', '.join(c['point'] for c in thin)} under {self.n} requests; fell back to "
              f"temperature {temp} alone ({len(cells)} points with enough requests)")
    ok = (lambda c: c["verdict"] != "roll back") if guard else (lambda c: c["verdict"] == "keep")
    on = bool(cells) and all(ok(c) for c in cells)
    return {"on": on, "cells": cells, "fallback": note}


def choose(stats: dict, verdicts: dict, points: dict, arms: dict, baselines: list, slots: int = 0, *,
           temperatures: Optional[dict] = None, min_requests: int = 4) -> dict:
  """-> {"config": the speculative config, "method", "rules": [{"match", "k", "name", "evidence": {...}}],
  "segments": per grid segment, "fallbacks": [notes], "notes": [...]}.
  arms: name -> speculative_config dict of the speculative arms; slots: the server's slot count (0: unknown);
  temperatures: sampling name -> temperature (from the run config's samplings; a name missing there counts as
  greedy when it is "greedy", else nonzero); min_requests: completed requests a cell needs to count."""
  temperatures = dict(temperatures or {})
  temp_of = {}
  closed = {}
  for key, pt in points.items():
    if pt.mode != "closed":
      continue
    t = temperatures.get(pt.sampling, 0.0 if pt.sampling == "greedy" else 1.0)
    temp_of[key] = _temperature_class(t)
    closed[key] = pt
  temps = [t for t in ("zero", "nonzero") if t in temp_of.values()]
  temp_points = {t: tuple(k for k in closed if temp_of[k] == t) for t in temps}
  bands = busy_bands([pt.level for pt in closed.values()], slots)
  seg_names = {s for a in list(arms) + list(baselines) for k in closed for s in stats.get(a, {}).get(k, {})}
  prompts = sorted(((s.split("=", 1)[1], prompt_range(s.split("=", 1)[1])) for s in seg_names
                    if s.startswith("prompt=") and prompt_range(s.split("=", 1)[1]) is not None),
                   key=lambda x: x[1][0])
  budgets = sorted(int(s.split("=", 1)[1]) for s in seg_names
                   if s.startswith("output=") and s.split("=", 1)[1].isdigit())
  outputs = [(str(b), (0 if i == 0 else b, budgets[i + 1] if i + 1 < len(budgets) else None))
             for i, b in enumerate(budgets)]
  ev = _Evidence(stats, verdicts, baselines, min_requests, temp_points)
  notes = []

  def grid(use_prompt: bool, use_output: bool) -> dict:
    """(temp, band index, prompt label | None, output label | None) -> {arm: decision with gain}."""
    out = {}
    p_vals = [p for p, _ in prompts] if use_prompt and len(prompts) > 1 else [None]
    o_vals = [o for o, _ in outputs] if use_output and len(outputs) > 1 else [None]
    for t in temps:
      for bi, (_, _, own, guard) in enumerate(bands):
        keys = tuple(k for k in temp_points[t] if int(closed[k].level) in own)
        guard_keys = tuple(k for k in temp_points[t] if int(closed[k].level) in guard)
        for p in p_vals:
          for o in o_vals:
            per_arm = {}
            for arm in arms:
              if not keys:
                per_arm[arm] = {"on": False, "cells": [], "fallbacks": [], "gain": None}
                continue
              where = f"temperature {t}, busy {_band_label(bands[bi])}"
              segs = ([f"prompt={p}"] if p is not None else []) + ([f"output={o}"] if o is not None else [])
              ds = [ev.decide(arm, t, ks, seg, where, guard=ks is guard_keys)
                    for ks in ((keys, guard_keys) if guard_keys else (keys,)) for seg in segs or ["all"]]
              cells = list({(c["point"], c["segment"]): c for d in ds for c in d["cells"]}.values())
              gains = [c["gain"] for c in cells if c["gain"] is not None]
              per_arm[arm] = {"on": all(d["on"] for d in ds), "cells": cells,
                              "fallbacks": sorted({d["fallback"] for d in ds if d["fallback"]}),
                              "gain": sum(gains) / len(gains) if gains else 0.0}
            out[(t, bi, p, o)] = per_arm
    return out

  def policy_of(g: dict) -> tuple:
    # One proposer per server: the method with the largest summed gain over the segments it wins.
    score = defaultdict(float)
    for per_arm in g.values():
      best = defaultdict(lambda: None)
      for arm, d in per_arm.items():
        m = arm_method(arms[arm])[0]
        if d["on"] and m != "none":
          best[m] = max(best[m] if best[m] is not None else -1e9, d["gain"])
      for m, v in best.items():
        score[m] += max(v, 0.0) + 1e-9
    method = max(sorted(score), key=score.get) if score else "none"
    leaves = {}
    for seg, per_arm in g.items():
      cands = [a for a, d in per_arm.items() if d["on"] and arm_method(arms[a])[0] == method]
      arm = max(cands, key=lambda a: (per_arm[a]["gain"], -arm_method(arms[a])[1]), default=None)
      leaves[seg] = {"k": arm_method(arms[arm])[1] if arm else 0, "arm": arm,
                     "decision": per_arm[arm] if arm else None, "per_arm": per_arm}
    return method, leaves

  method, leaves, rules = "none", {}, []
  for use_prompt, use_output in ((True, True), (True, False), (False, False)):
    method, leaves = policy_of(grid(use_prompt, use_output))
    rules = _compress(leaves, temps, bands, prompts if use_prompt else [], outputs if use_output else [])
    if "structured" in seg_names and method != "none":
      rules = _structured_rules(ev, arms, method, temps, temp_points) + rules
    if len(rules) <= MAX_RULES:
      break
    notes.append(f"{len(rules)} rules with the {'output budget' if use_output else 'prompt length'} dimension; "
                 f"more than the {MAX_RULES} a policy may hold, so the tuner dropped that dimension")
  if method == "none" or not any(L["k"] for L in leaves.values()):
    default_rule = _default_rule(leaves, 0, bands)
    return {"config": {}, "method": "none", "rules": [default_rule], "segments": _segments(leaves, bands),
            "fallbacks": _all_fallbacks(leaves), "notes": notes, "min_requests": int(min_requests)}
  src = max((a for a in arms if arm_method(arms[a])[0] == method), key=lambda a: arm_method(arms[a])[1])
  config = dict(arms[src])
  config["num_speculative_tokens"] = max(r["k"] for r in rules)
  config["policy"] = [{"match": r["match"], "num_speculative_tokens": r["k"]} for r in rules]
  names = parse_policy(config["policy"], "tuned policy", config["num_speculative_tokens"]).names
  for r, n in zip(rules, names):
    r["name"] = n
  return {"config": config, "method": method, "rules": rules, "segments": _segments(leaves, bands),
          "fallbacks": _all_fallbacks(leaves), "notes": notes, "min_requests": int(min_requests)}


def _structured_rules(ev: _Evidence, arms: dict, method: str, temps: list, temp_points: dict) -> list:
  """The "structured" segment (requests with a response_format; the server tags them segment "structured" when
  they carry no tag of their own): per temperature, the k of the method's arm that keeps at the structured cell of
  every closed point of that temperature (the largest gain; 0 where none keeps), as rules ahead of the grid's, so
  structured requests get their own k whatever their prompt length or budget. One rule when both agree."""
  out = []
  for t in temps:
    best = None
    for arm, sc in arms.items():
      if arm_method(sc)[0] != method:
        continue
      d = ev.decide(arm, t, temp_points[t], "structured", f"temperature {t}")
      gains = [c["gain"] for c in d["cells"] if c["gain"] is not None]
      gain = sum(gains) / len(gains) if gains else 0.0
      leaf = {"arm": arm, "decision": {"cells": d["cells"], "fallbacks": [d["fallback"]] if d["fallback"] else []}}
      if best is None or (d["on"] and (not best[0] or gain > best[1])):
        best = (d["on"], gain, leaf)
    if best is None:
      continue
    on, _, leaf = best
    ev_ = _evidence([leaf])
    if not on:
      ev_["arms"] = []
    out.append({"match": {"segment": "structured", "temperature": t}, "k": arm_method(arms[leaf["arm"]])[1] if on else 0,
                "evidence": ev_})
  if len(out) == 2 and out[0]["k"] == out[1]["k"]:
    out = [{"match": {"segment": "structured"}, "k": out[0]["k"],
            "evidence": {**out[0]["evidence"], "cells": out[0]["evidence"]["cells"] + out[1]["evidence"]["cells"]}}]
  return out


def _band_label(band: tuple) -> str:
  lo, hi = band[:2]
  return f"{lo}+" if hi is None else (f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}")


def _segments(leaves: dict, bands: list) -> list:
  out = []
  for (t, bi, p, o), L in leaves.items():
    out.append({"temperature": t, "busy_slots": _band_label(bands[bi]), "prompt": p, "output": o, "k": L["k"],
                "arm": L["arm"], "on_arms": sorted(a for a, d in L["per_arm"].items() if d["on"])})
  return out


def _all_fallbacks(leaves: dict) -> list:
  return sorted({f for L in leaves.values() for d in L["per_arm"].values() for f in d["fallbacks"]})


def _evidence(ls: list) -> dict:
  cells = {}
  for L in ls:
    for c in L["decision"]["cells"]:
      cells[(c["point"], c["segment"])] = c
  gains = [c["gain"] for c in cells.values() if c["gain"] is not None]
  return {"arms": sorted({L["arm"] for L in ls}), "cells": list(cells.values()),
          "gain": sum(gains) / len(gains) if gains else None,
          "min_requests": min((min(c["requests"], c["baseline_requests"]) for c in cells.values()), default=0),
          "fallbacks": sorted({f for L in ls for f in L["decision"]["fallbacks"]})}


def _default_rule(leaves: dict, k: int, bands: list) -> dict:
  """The closing rule; its evidence: why each segment it serves is off (per arm, the first cell that is not keep)."""
  off = []
  for (t, bi, p, o), L in leaves.items():
    if L["k"] != k or not L["per_arm"]:  # no speculative arm: nothing to say
      continue
    why = {}
    for arm, d in L["per_arm"].items():
      bad = next((c for c in d["cells"] if c["verdict"] != "keep"), None)
      why[arm] = (f"{bad['point']} {bad['segment']}: {bad['verdict']} ({bad['metric']})" if bad else
                  ("on" if d["on"] else "no cell"))
    off.append({"segment": {"temperature": t, "busy_slots": _band_label(bands[bi]), "prompt": p, "output": o},
                "why": why,
                "fallbacks": sorted({f for d in L["per_arm"].values() for f in d["fallbacks"]})})
  return {"match": {}, "k": k, "name": "default", "evidence": {"default": True, "segments": off}}


def _compress(leaves: dict, temps: list, bands: list, prompts: list, outputs: list) -> list:
  """The grid of k -> disjoint rules (see the module docstring), the default last."""
  dims = [("temperature", [(t, t) for t in temps], {"zero", "nonzero"}),
          ("busy_slots", [(bi, (lo, hi)) for bi, (lo, hi, *_) in enumerate(bands)], None),
          ("prompt_tokens", [(p, r) for p, r in prompts] if len(prompts) > 1 else [(None, None)], None),
          ("max_tokens", [(o, r) for o, r in outputs] if len(outputs) > 1 else [(None, None)], None)]
  ks = [L["k"] for L in leaves.values()]
  default = 0
  if ks and all(ks):
    default = min(Counter(ks).most_common(), key=lambda kv: (-kv[1], kv[0]))[0]

  def sub(fixed: tuple, d: int):
    """The sub-grid under a prefix of dimension values, as a hashable nested tuple of k."""
    if d == len(dims):
      return leaves[fixed]["k"]
    return tuple(sub(fixed + (v,), d + 1) for v, _ in dims[d][1])

  def full(d: int, merged) -> bool:
    name, vals, whole = dims[d]
    if name == "temperature":
      return set(merged) == whole
    lo, hi = merged
    return hi is None and lo <= (1 if name == "busy_slots" else 0)

  rules = []

  def walk(prefixes: list, match: dict, d: int):
    """prefixes: the full-grid prefixes this box covers (one per combination of merged values so far)."""
    if d == len(dims):
      k = leaves[prefixes[0]]["k"]
      if k != default:
        rules.append({"match": dict(match), "k": k, "evidence": _evidence([leaves[p] for p in prefixes])})
      return
    name, vals, _ = dims[d]
    groups = []  # runs of adjacent values with identical sub-grids
    for v, r in vals:
      s = tuple(sub(p + (v,), d + 1) for p in prefixes)
      contiguous = groups and (name == "temperature" or r is None or groups[-1]["range"][1] == r[0])
      if groups and groups[-1]["sub"] == s and contiguous:
        groups[-1]["values"].append(v)
        groups[-1]["range"] = (groups[-1]["range"][0], r[1]) if name != "temperature" and r else groups[-1]["range"]
      else:
        groups.append({"values": [v], "sub": s, "range": r})
    for gr in groups:
      if all(x == default for x in _flat(gr["sub"])):
        continue
      m = dict(match)
      if gr["range"] is not None:
        merged = gr["values"] if name == "temperature" else gr["range"]
        if not full(d, merged):
          m[name] = gr["values"][0] if name == "temperature" else [merged[0], merged[1]]
      walk([p + (v,) for p in prefixes for v in gr["values"]], m, d + 1)

  walk([()], {}, 0)
  rules.append(_default_rule(leaves, default, bands))
  return rules


def _flat(x):
  if isinstance(x, tuple):
    for y in x:
      yield from _flat(y)
  else:
    yield x


def write(path: str, tuned: dict) -> None:
  """The file the server reads: {} (speculation off) when nothing is on anywhere."""
  with open(path, "w") as f:
    json.dump(tuned["config"], f, indent=1)
    f.write("\n")
