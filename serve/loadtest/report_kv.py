"""The load matrix's KV section (issue 35): per arm and load point, the KV pool's usage (sampled gauge), the
preemptions and the prefix-cache hits (/metrics deltas), and a plot of KV usage against concurrency, the baseline
beside each speculative arm: does the proposer crowd the KV cache? Servers without a paged pool show dashes.
With arms on an 8-bit KV cache (an arm's `kv_cache_dtype`, issue 46), tau and the acceptance rate of each such arm
beside the arm with the same speculative config under `auto`, per load point."""

from __future__ import annotations

import json
import logging
import os


def _usage(pr: dict):
  return (pr.get("samples") or {}).get("kv_usage")


def has_kv(results: dict) -> bool:
  return any(_usage(pr) for res in results.values() for pr in res["points"].values())


def section(results: dict, points: dict) -> list[str]:
  """Markdown lines: one table, a row per (load point, arm)."""
  if not has_kv(results):
    return []
  L = ["## KV cache per load point", "",
       "KV usage: the fraction of the pool's pages that requests hold (`kv_cache_usage_perc`, sampled during the "
       "point: mean / max); preemptions and prefix-cache hits / queries (tokens) from `/metrics` deltas.", "",
       "| load | arm | KV usage mean / max | preemptions | prefix hits / queries |", "|---|---|---|---|---|"]
  for k, p in points.items():
    for arm, res in results.items():
      pr = res["points"].get(k)
      if not pr:
        continue
      u, m = _usage(pr), pr["metrics"]
      hits, queries = m.get("prefix_cache_hits"), m.get("prefix_cache_queries")
      L.append(f"| {p['label']} [{p['sampling']}] | {arm} | "
               + (f"{u['mean']:.1%} / {u['max']:.1%}" if u else "–") + " | "
               + ("–" if m.get("preemptions") is None else f"{m['preemptions']:.0f}") + " | "
               + (f"{hits:.0f} / {queries:.0f}" if hits is not None and queries else "–") + " |")
  return L + [""]


def plot(out_dir: str, results: dict, points: dict) -> list[str]:
  """kv_usage.png: mean (solid) and max (dotted) KV usage against closed-loop concurrency, one panel per sampling
  setting; -> the file names written (none without a paged pool)."""
  if not has_kv(results):
    return []
  # Its warnings at import (building the font cache, once per fresh HOME; a temporary cache directory where HOME
  # is not writable) are not about the load test.
  logging.getLogger("matplotlib").setLevel(logging.ERROR)
  import matplotlib  # lazy: heavy, only this path (matplotlib)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: heavy, only this path (matplotlib)
  samplings = sorted({p["sampling"] for p in points.values()})
  fig, axes = plt.subplots(1, len(samplings), figsize=(6 * len(samplings), 4), squeeze=False)
  for ax, smp in zip(axes[0], samplings):
    keys = sorted((k for k, p in points.items() if p["mode"] == "closed" and p["sampling"] == smp),
                  key=lambda k: points[k]["level"])
    for arm, res in results.items():
      xs, mean, peak = [], [], []
      for k in keys:
        u = _usage(res["points"].get(k) or {})
        if u:
          xs.append(points[k]["level"])
          mean.append(100 * u["mean"])
          peak.append(100 * u["max"])
      if xs:
        line, = ax.plot(xs, mean, marker="o", label=arm, linestyle="--" if arm.startswith("baseline") else "-")
        ax.plot(xs, peak, color=line.get_color(), linestyle=":", alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 105)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("KV pool used (%)")
    ax.set_title(f"KV usage: mean (line), max (dotted) [{smp}]")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "kv_usage.png"), dpi=90)
  plt.close(fig)
  return ["kv_usage.png"]


def _spec_key(res: dict) -> str:
  return json.dumps(res.get("speculative_config") or {}, sort_keys=True)


def auto_partner(results: dict, name: str):
  """The arm with `name`'s speculative config and the cache in the activation dtype (None: the matrix has none)."""
  key = _spec_key(results[name])
  return next((n for n, r in results.items() if r.get("kv_cache_dtype", "auto") == "auto"
               and not r.get("baseline") and _spec_key(r) == key), None)


def dtype_section(results: dict, points: dict) -> list[str]:
  """Markdown lines: a row per (8-bit arm, load point): tau and acceptance rate beside its `auto` partner's."""
  eight = [n for n, r in results.items() if r.get("kv_cache_dtype", "auto") != "auto" and not r.get("baseline")]
  if not eight:
    return []
  L = ["## Acceptance with an 8-bit KV cache", "",
       "tau = 1 + accepted / drafts and the acceptance rate (accepted / drafted tokens), `/metrics` deltas, of each "
       "arm on an 8-bit cache beside the arm with the same speculative config on `auto`; change = tau / tau auto "
       "- 1 (issue 46's target: within 2 % for fp8_e4m3 and int8).", "",
       "| load | arm (dtype) | auto arm | tau | tau auto | change | acc rate | acc rate auto |",
       "|---|---|---|---|---|---|---|---|"]
  for k, p in points.items():
    for name in eight:
      partner = auto_partner(results, name)
      sp = ((results[name]["points"].get(k) or {}).get("metrics") or {}).get("speculation") or {}
      ap = (((results[partner]["points"].get(k) or {}).get("metrics") or {}).get("speculation") or {}
            if partner else {})
      t, ta = sp.get("mean_acceptance_length"), ap.get("mean_acceptance_length")
      f = lambda v, fmt=".2f": "–" if v is None else format(v, fmt)
      L.append(f"| {p['label']} [{p['sampling']}] | {name} ({results[name]['kv_cache_dtype']}) | "
               f"{partner or 'none with this config'} | {f(t)} | {f(ta)} | "
               f"{f(t / ta - 1.0, '+.1%') if t is not None and ta else '–'} | {f(sp.get('acceptance_rate'))} | "
               f"{f(ap.get('acceptance_rate'))} |")
  return L + [""]
