"""The load matrix's plots: matplotlib PNGs beside report.md (latency and throughput against concurrency, per arm)."""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import numpy as np


def _pooled_acceptance(res: dict) -> dict:
  drafts, acc = 0.0, defaultdict(float)
  for p in res["points"].values():
    sp = p["metrics"]["speculation"]
    d = sp.get("drafts") or 0
    drafts += d
    for pos, frac in (sp.get("per_position") or {}).items():
      acc[int(pos)] += frac * d
  return {p: v / drafts for p, v in sorted(acc.items())} if drafts else {}


def make_plots(out_dir: str, run: dict, results: dict, summary: dict, records: list) -> list[str]:
  # Its warnings at import (building the font cache, once per fresh HOME; a temporary cache directory where HOME
  # is not writable) are not about the load test.
  logging.getLogger("matplotlib").setLevel(logging.ERROR)
  import matplotlib  # lazy: heavy, only this path (matplotlib)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: heavy, only this path (matplotlib)

  stats, points = summary["stats"], summary["points"]
  arms = list(results)
  files = []
  samplings = sorted({p["sampling"] for p in points.values()}, key=lambda s: [x["name"] for x in
                                                                               run["config"]["samplings"]].index(s))
  # 1. Latency and throughput against concurrency, per arm (closed loop).
  fig, axes = plt.subplots(len(samplings), 4, figsize=(18, 4 * len(samplings)), squeeze=False)
  for si, smp in enumerate(samplings):
    keys = sorted((k for k, p in points.items() if p["mode"] == "closed" and p["sampling"] == smp),
                  key=lambda k: points[k]["level"])
    for ai, (metric, title, scale) in enumerate((("e2e_p50", "p50 end-to-end latency (s)", 1),
                                                 ("itl_p95", "p95 ITL (ms)", 1e3),
                                                 ("output_tok_s", "output tokens/s", 1),
                                                 ("req_s", "completed requests/s", 1))):
      ax = axes[si][ai]
      for arm in arms:
        xs = [points[k]["level"] for k in keys if k in stats.get(arm, {})]
        ys = [(stats[arm][k]["all"].get(metric) or np.nan) * scale for k in keys if k in stats.get(arm, {})]
        ax.plot(xs, ys, marker="o", label=arm, linestyle="--" if arm.startswith("baseline") else "-")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("concurrency")
      ax.set_title(f"{title} [{smp}]")
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  files.append("latency_throughput.png")
  fig.savefig(os.path.join(out_dir, files[-1]), dpi=90)
  plt.close(fig)

  # 2. TTFT and ITL distributions (CDFs) at the peak point of the first sampling setting.
  peak = next((k for k, p in points.items() if p["tag"] == "peak" and p["sampling"] == samplings[0]),
              next(iter(points)))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  for arm in arms:
    recs = [r for r in records if r["arm"] == arm and r["point"] == peak and r["status"] == "ok"]
    for ax, vals in ((axes[0], [r["ttft"] for r in recs if r["ttft"] is not None]),
                     (axes[1], [x for r in recs for x in r.get("itl") or []])):
      if vals:
        v = np.sort(np.asarray(vals)) * 1e3
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=arm, linestyle="--" if arm.startswith("baseline") else "-")
  axes[0].set_title(f"TTFT CDF at {points[peak]['label']} [{points[peak]['sampling']}]")
  axes[1].set_title(f"per-token ITL CDF at {points[peak]['label']} [{points[peak]['sampling']}]")
  for ax in axes:
    ax.set_xlabel("ms")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  files.append("ttft_itl_distributions.png")
  fig.savefig(os.path.join(out_dir, files[-1]), dpi=90)
  plt.close(fig)

  # 3. Acceptance per position, pooled over the run's points (from /metrics deltas).
  spec = [a for a in arms if _pooled_acceptance(results[a])]
  fig, ax = plt.subplots(figsize=(9, 4))
  width = 0.8 / max(len(spec), 1)
  for i, arm in enumerate(spec):
    acc = _pooled_acceptance(results[arm])
    ax.bar(np.array(list(acc)) + i * width, list(acc.values()), width, label=arm)
  ax.set_xlabel("draft position (0 = first drafted token)")
  ax.set_ylabel("accepted / drafts")
  ax.set_title("acceptance per position")
  if spec:
    ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  files.append("acceptance_per_position.png")
  fig.savefig(os.path.join(out_dir, files[-1]), dpi=90)
  plt.close(fig)

  # 4. Speedup per segment: baseline mean TPOT / arm mean TPOT, per load point.
  others = summary["arms"]
  if others:
    keys = list(points)
    segs = sorted({s for a in others for k in keys for s in stats.get(a, {}).get(k, {})},
                  key=lambda s: (s != "all", s))
    fig, axes = plt.subplots(1, len(others), figsize=(max(6, 1.1 * len(keys) + 3) * len(others), 0.35 * len(segs) + 2),
                             squeeze=False)
    for ax, arm in zip(axes[0], others):
      m = np.full((len(segs), len(keys)), np.nan)
      for j, k in enumerate(keys):
        for i, s in enumerate(segs):
          a = stats.get(arm, {}).get(k, {}).get(s, {}).get("tpot_mean")
          bs = [stats[b][k][s]["tpot_mean"] for b in summary["baselines"]
                if s in stats.get(b, {}).get(k, {}) and stats[b][k][s]["tpot_mean"]]
          if a and bs:
            m[i, j] = (sum(bs) / len(bs)) / a
      im = ax.imshow(m, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
      for i in range(len(segs)):
        for j in range(len(keys)):
          if not np.isnan(m[i, j]):
            ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7)
      ax.set_xticks(range(len(keys)), [points[k]["label"] + f"\n{points[k]['sampling']}" for k in keys], fontsize=7)
      ax.set_yticks(range(len(segs)), segs, fontsize=7)
      ax.set_title(f"{arm}: speedup (baseline TPOT / arm TPOT)")
      fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    files.append("speedup_per_segment.png")
    fig.savefig(os.path.join(out_dir, files[-1]), dpi=90)
    plt.close(fig)
  return files
