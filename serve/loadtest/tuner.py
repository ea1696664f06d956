"""Turn the matrix into a speculative_config.json the server reads with --speculative_config=PATH.

For each closed-loop concurrency, the best arm is the one that keeps (verdict on all traffic) at every sampling
setting of that concurrency, rolls back at none, and has the highest mean output tokens/s relative to the
baseline. Where no arm keeps, k = 0. One server loads one proposer, so the file holds one method (the one that wins
the most, weighted by its gains) and, per concurrency, that method's best k (0 where it does not keep).

The server keys the table by busy slots, which never exceed the slot count: every concurrency at or above it
(peak and overload) is served by one entry, at the slot count, whose k is the smallest of theirs (speculation
stays on there only if it keeps at all of them).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Optional

# spec_jax/spec_config.py's per-concurrency table: {"per_concurrency": {"<c>": {"num_speculative_tokens": k}}}; with a
# busy slots the server allows the k of the entry with the largest c <= a (the smallest entry below all of them).
K_TABLE_KEY = "per_concurrency"


def arm_method(spec: Optional[dict]) -> tuple[str, int]:
  if not spec or not spec.get("method") or spec.get("method") == "none":
    return "none", 0
  return spec["method"], int(spec.get("num_speculative_tokens", 0))


def choose(stats: dict, verdicts: dict, points: dict, arms: dict, baselines: list, slots: int = 0) -> dict:
  """-> {"levels": {concurrency: {"arm", "method", "k", "gain", "why"}}, "method": ..., "config": {...}}.
  arms: name -> speculative_config dict of the speculative arms; slots: the server's slot count (0: unknown)."""
  by_level = defaultdict(list)
  for key, pt in points.items():
    if pt.mode == "closed":
      by_level[int(pt.level)].append(key)
  levels = {}
  gains = defaultdict(dict)  # arm -> level -> gain
  for c, keys in sorted(by_level.items()):
    for arm in arms:
      vs = [verdicts[arm][k]["all"]["verdict"] for k in keys if "all" in verdicts.get(arm, {}).get(k, {})]
      if not vs or any(v != "keep" for v in vs):
        continue
      ratios = []
      for k in keys:
        a = stats[arm][k]["all"]["output_tok_s"]
        b = [stats[bl][k]["all"]["output_tok_s"] for bl in baselines if k in stats.get(bl, {})]
        if b and sum(b) > 0:
          ratios.append(a / (sum(b) / len(b)))
      if ratios:
        gains[arm][c] = sum(ratios) / len(ratios) - 1.0
    best = max((a for a in arms if c in gains[a]), key=lambda a: gains[a][c], default=None)
    if best is None:
      levels[c] = {"arm": None, "method": "none", "k": 0, "gain": 0.0, "why": "no arm keeps at this load"}
    else:
      m, k = arm_method(arms[best])
      levels[c] = {"arm": best, "method": m, "k": k, "gain": gains[best][c],
                   "why": f"{best} keeps with {gains[best][c]:+.0%} output tok/s"}
  # One proposer per server: the method with the largest summed gain over the levels it wins.
  score = defaultdict(float)
  for c, L in levels.items():
    if L["arm"]:
      score[L["method"]] += max(L["gain"], 0.0) + 1e-9
  method = max(score, key=score.get) if score else "none"
  table = []
  for c in sorted(levels):
    if method == "none":
      k, arm = 0, None
    else:
      cands = [a for a in arms if arm_method(arms[a])[0] == method and c in gains[a]]
      arm = max(cands, key=lambda a: gains[a][c], default=None)
      k = arm_method(arms[arm])[1] if arm else 0
    levels[c]["chosen_arm"], levels[c]["chosen_k"] = arm, k
    table.append([c, k])
  full = [c for c, _ in table if slots and c >= slots]
  if full:  # one entry serves them all (see the module docstring)
    k_full = min(k for c, k in table if c in full)
    table = [[c, k] for c, k in table if c not in full] + [[slots, k_full]]
    for c in full:
      if levels[c]["chosen_k"] != k_full:
        levels[c]["why"] += f"; served with k = {k_full}, the entry for all {slots} busy slots"
      levels[c]["chosen_k"] = k_full
  config: dict = {}
  if method != "none" and any(k for _, k in table):
    src = max((a for a in arms if arm_method(arms[a])[0] == method), key=lambda a: arm_method(arms[a])[1])
    config = dict(arms[src])
    config["num_speculative_tokens"] = max(k for _, k in table)
    config[K_TABLE_KEY] = {str(c): {"num_speculative_tokens": k} for c, k in table}
  return {"levels": levels, "method": method, "config": config}


def write(path: str, tuned: dict) -> None:
  """The file the server reads: {} (speculation off) when nothing wins anywhere."""
  with open(path, "w") as f:
    json.dump(tuned["config"], f, indent=1)
    f.write("\n")
