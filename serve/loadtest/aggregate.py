"""From raw per-request records to per-(arm, load point, segment) statistics.

Percentiles are numpy's default (linear interpolation) over the raw records: TTFT, end-to-end latency, TPOT and
queue time over the segment's completed requests; ITL over all per-token samples of those requests pooled.
Rates divide by the point's wall time (first send to last completion), so a segment's tokens/s is its share of
the point's throughput and compares across arms that ran the same traffic.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np

from serve.loadtest.traffic import prompt_len_bucket

FAILED = ("error", "timeout", "rejected")


def pct(values, q: float) -> Optional[float]:
  v = [x for x in values if x is not None]
  return float(np.percentile(np.asarray(v, dtype=np.float64), q)) if v else None


def mean(values) -> Optional[float]:
  v = [x for x in values if x is not None]
  return float(np.mean(v)) if v else None


def prompt_lengths(records) -> dict:
  """prompt id -> prompt tokens as the server counted them (identical in every arm: same model, same template)."""
  out = {}
  for r in records:
    if r.get("prompt_tokens") is not None:
      out[(r["prompt_id"], r.get("is_chat", False))] = int(r["prompt_tokens"])
  return out


def segments_of(r: dict, plens: dict, edges) -> list[str]:
  """"structured": the requests that asked for structured output (response_format), whatever their category."""
  return ["all", f"category={r['category']}",
          f"prompt={prompt_len_bucket(plens.get((r['prompt_id'], r.get('is_chat', False))), edges)}",
          f"output={r['max_tokens']}"] + (["structured"] if r.get("structured") else [])


def cell_stats(recs: list, wall_s: float) -> dict:
  ok = [r for r in recs if r["status"] == "ok"]
  itl = [x for r in ok for x in r.get("itl") or []]
  out_tokens = sum(int(r.get("completion_tokens") or 0) for r in ok)
  drafted = sum(r.get("drafted_tokens") or 0 for r in ok)
  accepted = sum(r.get("accepted_tokens") or 0 for r in ok)
  wall = max(wall_s, 1e-9)
  return {
      "requests": len(recs), "completed": len(ok),
      "errors": sum(r["status"] == "error" for r in recs), "timeouts": sum(r["status"] == "timeout" for r in recs),
      "rejected": sum(r["status"] == "rejected" for r in recs), "cut": sum(r["status"] == "cut" for r in recs),
      "failed": sum(r["status"] in FAILED for r in recs),
      "oom": sum(1 for r in recs if r["status"] == "error" and _is_oom(r.get("error"))),
      "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p95": pct([r["ttft"] for r in ok], 95),
      "e2e_p50": pct([r["e2e"] for r in ok], 50), "e2e_p95": pct([r["e2e"] for r in ok], 95),
      "e2e_mean": mean([r["e2e"] for r in ok]),
      "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95), "itl_mean": mean(itl), "itl_samples": len(itl),
      "tpot_p50": pct([r["tpot"] for r in ok], 50), "tpot_p95": pct([r["tpot"] for r in ok], 95),
      "tpot_mean": mean([r["tpot"] for r in ok]),
      "queue_p50": pct([r.get("queue_time") for r in ok], 50), "queue_p95": pct([r.get("queue_time") for r in ok], 95),
      "output_tokens": out_tokens, "output_tok_s": out_tokens / wall, "req_s": len(ok) / wall,
      "drafted_tokens": drafted, "accepted_tokens": accepted,
      "acceptance_rate": accepted / drafted if drafted else None,
  }


def _is_oom(msg) -> bool:
  m = str(msg or "").lower()
  return "out of memory" in m or "resource_exhausted" in m or "oom" in m.split()


def aggregate(points: list, edges, min_segment_requests: int = 1) -> dict:
  """points: dicts with arm, key, records, wall_s. -> {arm: {point key: {segment: stats}}}."""
  plens = prompt_lengths([r for p in points for r in p["records"]])
  out: dict = defaultdict(dict)
  for p in points:
    by_seg = defaultdict(list)
    for r in p["records"]:
      for s in segments_of(r, plens, edges):
        by_seg[s].append(r)
    out[p["arm"]][p["key"]] = {s: cell_stats(rs, p["wall_s"]) for s, rs in sorted(by_seg.items())
                               if s == "all" or len(rs) >= min_segment_requests}
  return dict(out)


def sampler_stats(samples: list) -> dict:
  """Mean and max of each gauge the sampler read (RSS, slots in use, running, waiting, device memory, KV usage)."""
  out = {}
  for key in ("rss_bytes", "slots_in_use", "running", "waiting", "device_memory_bytes", "kv_usage"):
    v = [s[key] for s in samples if s.get(key) is not None]
    out[key] = {"mean": float(np.mean(v)), "max": float(np.max(v))} if v else None
  slots = [s["slots"] for s in samples if s.get("slots") is not None]
  out["slots"] = int(slots[0]) if slots else None
  return out
