"""Servers at one KV memory budget under closed-loop Spec-Bench traffic (issue 35).

  python benchmarks/kv_budget.py --suite=budget [--rounds=2] [--json_out=PATH]
  python benchmarks/kv_budget.py --suite=pressure [--rounds=2] [--json_out=PATH]

budget: the same pool (4 x 1024 tokens = 256 pages of 16) as fixed slots (--max_num_seqs=4, every request can
always get its pages) and as a shared pool behind 32 rows (--max_num_seqs=32 --num_kv_blocks=257), speculation
off and on (n-gram k 4), at concurrency 1, 8 and 32.
kv8: one budget in bytes (--kv_cache_memory_bytes: what 256 bfloat16 pages of Gemma 3 270M take, 75.5 MB) behind
64 rows, the cache in the activation dtype (auto: float32 on this CPU, 127 pages; bfloat16 on TPU/GPU), int8 and fp8
(issue 46: ~3.96x float32's pages here, ~1.97x bfloat16's), plain and n-gram k 4, at concurrency 32 and 64: the
requests running at once and tokens/s before (auto) and after (8-bit).
pressure: 32 rows on a pool too small for them (96 pages of 16), n-gram k 4, concurrency 32: speculation yields
pages first (fewer steps, then k = 0 for the segment that gains least) against preempting at once
(--nokv_speculation_yields).

Traffic: Spec-Bench's prompts of at most 2,500 characters (the longest pass max_model_len, 1,024 tokens), 6, 16
and 32 requests at concurrency 1, 8 and 32. Each variant's server starts fresh (Gemma 3 270M, bf16, compilation cache shared), in the order A, B, ..., A, B, ...
(--rounds), and gets the same requests (greedy, seeded order, max_tokens 48). Per (variant, level): completed
requests, req/s, output tokens/s, TTFT and ITL p50/p95, mean and peak requests running (sampled from /metrics),
KV usage, preemptions, shrink counts and over-reservation (GET /admin/speculation). The machine must be quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from serve.loadtest.client import stream_request  # noqa: E402
from benchmarks import records  # noqa: E402
from serve.loadtest.launcher import ServerProcess  # noqa: E402
from serve.loadtest.traffic import build_requests, load_prompts  # noqa: E402

BASE = {"config": "configs/gemma3_270m.py", "dtype": "bfloat16", "max_model_len": 1024, "max_queue": 256,
        "warmup_prompt_lens": "1,17,33,65,129,257,513"}  # every prompt bucket compiled before the first point
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
KV8_BUDGET = 256 * 16 * 18_432  # bytes of 256 pages of 16 tokens, Gemma 3 270M's bf16 K/V (18,432 B a token)
SUITES = {
    "budget": ([("slots4_off", {"max_num_seqs": 4}, {}), ("pages32_off", {"max_num_seqs": 32, "num_kv_blocks": 257}, {}),
                ("slots4_ngram", {"max_num_seqs": 4}, NGRAM),
                ("pages32_ngram", {"max_num_seqs": 32, "num_kv_blocks": 257}, NGRAM)], (1, 8, 32)),
    "pressure": ([("yield", {"max_num_seqs": 32, "num_kv_blocks": 97}, NGRAM),
                  ("preempt_at_once", {"max_num_seqs": 32, "num_kv_blocks": 97, "kv_speculation_yields": False},
                   NGRAM)], (32,)),
    "kv8": ([(f"{kv}_{m}", {"max_num_seqs": 64, "kv_cache_memory_bytes": KV8_BUDGET, "kv_cache_dtype": kv}, spec)
             for m, spec in (("off", {}), ("ngram", NGRAM)) for kv in ("auto", "int8", "fp8")], (32, 64)),
}


def pct(xs, q):
  return round(float(np.percentile(xs, q)) * 1e3, 1) if len(xs) else None


async def closed_loop(url: str, reqs: list, level: int) -> tuple:
  """`level` clients, each sending its next request when the last one ends -> (records, seconds, running samples)."""
  sink, queue, running = [], list(reqs), []
  t0 = time.perf_counter()
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=level + 4)) as http:
    async def client():
      while queue:
        await stream_request(http, url, queue.pop(0), model="gemma-3-270m", timeout=600, t0=t0, sink=sink)

    async def sample():
      while True:
        try:
          text = (await http.get(url + "/metrics", timeout=10)).text
          for line in text.splitlines():
            if line.startswith("spec_jax:num_requests_running"):
              running.append(float(line.split()[-1]))
        except httpx.HTTPError:
          pass
        await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(client() for _ in range(level)))
    sampler.cancel()
  return sink, time.perf_counter() - t0, running


def status(url: str) -> dict:
  return httpx.get(url + "/admin/speculation", timeout=30).json()


def point(url: str, prompts: list, level: int, max_tokens: int) -> dict:
  n = {1: 6, 8: 16}.get(level, level)
  reqs = build_requests(prompts, n, {"name": "greedy", "temperature": 0.0, "top_p": 1.0}, (max_tokens,), seed=level)
  s0 = status(url)
  recs, secs, running = asyncio.run(closed_loop(url, reqs, level))
  s1 = status(url)
  ok = [r for r in recs if r["status"] == "ok"]
  itl = [d for r in ok for d in r["itl"]]
  toks = sum(r.get("completion_tokens") or 0 for r in ok)
  delta = lambda k: (s1.get(k) or 0) - (s0.get(k) or 0)
  return {"level": level, "requests": len(recs), "completed": len(ok), "seconds": round(secs, 2),
          "errors": [str(r.get("error"))[:200] for r in recs if r["status"] != "ok"][:3],
          "req_s": round(len(ok) / secs, 3), "out_tok_s": round(toks / secs, 2),
          "ttft_p50_ms": pct([r["ttft"] for r in ok if r.get("ttft") is not None], 50),
          "ttft_p95_ms": pct([r["ttft"] for r in ok if r.get("ttft") is not None], 95),
          "itl_p50_ms": pct(itl, 50), "itl_p95_ms": pct(itl, 95),
          "running_mean": round(float(np.mean(running)), 2) if running else None,
          "running_peak": max(running) if running else None,
          "preemptions": delta("num_preemptions"), "shrunk_steps": delta("kv_shrunk_steps"),
          "shrunk_caps": delta("kv_shrunk_caps"), "kv_over_reserved_pages_mean": s1.get("kv_over_reserved_pages_mean"),
          "kv_over_reserved_frac": s1.get("kv_over_reserved_frac"), "kv_pages": s1.get("kv_pages")}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--suite", choices=sorted(SUITES), default="budget")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--max_tokens", type=int, default=48)
  ap.add_argument("--levels", default="", help="comma-separated concurrencies (default: the suite's)")
  ap.add_argument("--only", default="", help="comma-separated variant names (default: all of the suite's)")
  ap.add_argument("--json_out", default="")
  a = ap.parse_args()
  variants, levels = SUITES[a.suite]
  if a.only:
    variants = [v for v in variants if v[0] in a.only.split(",")]
  if a.levels:
    levels = tuple(int(x) for x in a.levels.split(","))
  # Spec-Bench less its longest prompts (some summarization and RAG ones pass 1,024 tokens, the servers' max_model_len)
  prompts = [p for p in load_prompts("data/specbench/spec_bench_question.jsonl") if len(p.text) <= 2500]
  for r in range(a.rounds):
    for name, flags, spec in variants:
      with ServerProcess({**BASE, **flags}, spec, f"/tmp/spec_jax_kv_budget/{name}.log", startup_timeout=900) as srv:
        point(srv.url, prompts, 4, 8)  # warm-up: compiles the insert and loop shapes the points use
        for level in levels:
          records.emit({"suite": a.suite, "variant": name, "round": r, **point(srv.url, prompts, level, a.max_tokens),
                        "date": records.now_utc()}, a.json_out)


if __name__ == "__main__":
  main()
