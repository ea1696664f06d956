"""Structured outputs in the server (issue 36's benchmark): the JSON-extraction workload (benchmarks/structured_workload.py)
as chat requests with response_format json_schema, closed loop at each --concurrencies level, against one server per
arm, all started at once on loopback (as the load matrix starts them: serve/loadtest/launcher.py, always stopped):

  plain         speculation off ({}): plain constrained decoding
  ngram+forced  n-gram, k = --num_speculative_tokens; the grammar's forced tokens are drafts too (always, in the server)
  forced        grammar-forced drafts alone (method "grammar", spec_jax/proposers/grammar_only.py, via --plugins)

Every server runs the same flags (configs/gemma3_270m.py, bfloat16, 4 slots, the plugin loaded, k fixed as in
benchmarks/structured.py: --adaptive=false) but its --speculative_config. (With adaptive k the controller turns
forced drafts alone off: it scores a probe step with nothing forced as 0 of k accepted.) The points run interleaved: for each repeat, for each concurrency,
each arm in turn (plain, ngram+forced, forced, plain, ...); idle servers sleep. Per arm and concurrency: output tok/s
(completion tokens over the point's wall time, first send to last answer), mean request latency, the acceptance rate
(usage's accepted / drafted tokens), the share of outputs valid against the schema (must be 100 %) and of outputs
equal to plain's (greedy: must be 100 %).

  .venv/bin/python -m benchmarks.structured_server --limit=24 --repeats=2 --json_out=benchmarks/reports/structured/server.json
  .venv/bin/python -m benchmarks.structured_server --limit=4 --max_new_tokens=32 --repeats=1   # a dry run
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time

import httpx
import numpy as np
from absl import app, flags

from benchmarks import structured_workload as workload
from serve.loadtest.launcher import ServerProcess
from spec_jax import flag_table

FLAG_NAMES = ("limit", "max_new_tokens", "num_speculative_tokens", "repeats", "json_out", "concurrencies")
flag_table.define(FLAG_NAMES, limit=24, max_new_tokens=96, num_speculative_tokens=4, repeats=2, json_out="",
                  concurrencies=["1", "4"])
FLAGS = flags.FLAGS

SERVER_FLAGS = {"config": "configs/gemma3_270m.py", "dtype": "bfloat16", "max_num_seqs": 4, "max_queue": 64,
                "plugins": "spec_jax.proposers.grammar_only", "adaptive": False}


def arms(k: int) -> dict:
  return {"plain": {}, "ngram+forced": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3},
          "forced": {"method": "grammar", "num_speculative_tokens": k}}


def body(person: dict, max_tokens: int) -> dict:
  return {"model": "gemma-3-270m", "messages": [{"role": "user", "content": workload.prompt_of(person)}],
          "max_tokens": max_tokens, "temperature": 0.0, "response_format": workload.RESPONSE_FORMAT}


async def point(url: str, bodies: list, concurrency: int) -> dict:
  """Closed loop: `concurrency` clients, each sending the next body when its last answer is in."""
  results = [None] * len(bodies)
  queue = list(range(len(bodies)))[::-1]

  async def client(http):
    while queue:
      i = queue.pop()
      t = time.perf_counter()
      r = await http.post(url + "/v1/chat/completions", json=bodies[i])
      if r.status_code != 200:
        raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.text[:500]}")
      j = r.json()
      results[i] = {"text": j["choices"][0]["message"]["content"], "usage": j["usage"],
                    "latency": time.perf_counter() - t}

  async with httpx.AsyncClient(timeout=600.0) as http:
    t0 = time.perf_counter()
    await asyncio.gather(*(client(http) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
  return {"wall_s": wall, "results": results}


def main(argv):
  del argv
  people = workload.people(FLAGS.limit)
  bodies = [body(p, FLAGS.max_new_tokens) for p in people]
  levels = [int(c) for c in FLAGS.concurrencies]
  specs = arms(FLAGS.num_speculative_tokens)
  logs = tempfile.mkdtemp(prefix="structured_server_")
  runs = {name: {c: [] for c in levels} for name in specs}
  with contextlib.ExitStack() as stack:
    servers = {name: ServerProcess(SERVER_FLAGS, sc, os.path.join(logs, f"{name.replace('+', '_')}.log"),
                                   startup_timeout=1200.0) for name, sc in specs.items()}
    t = time.perf_counter()
    for s in servers.values():  # one after another (each waits for /health); all stopped on the way out
      stack.enter_context(s)
    print(f"{len(servers)} servers healthy after {time.perf_counter() - t:.0f} s (logs {logs})", flush=True)
    for name, s in servers.items():  # warm-up: compiles the grammar and the inserts at the levels used
      asyncio.run(point(s.url, bodies[:max(levels)], max(levels)))
    for r in range(FLAGS.repeats):
      for c in levels:
        for name, s in servers.items():
          p = asyncio.run(point(s.url, bodies, c))
          runs[name][c].append(p)
          toks = sum(x["usage"]["completion_tokens"] for x in p["results"])
          print(f"repeat {r} c{c} {name}: {toks / p['wall_s']:.1f} tok/s", flush=True)
  out = {"prompts": len(bodies), "max_tokens": FLAGS.max_new_tokens, "k": FLAGS.num_speculative_tokens,
         "repeats": FLAGS.repeats, "server_flags": SERVER_FLAGS, "arms": specs, "points": {}}
  print("\n| concurrency | arm | tok/s per repeat | speedup (per repeat) | mean latency s | acceptance | valid | "
        "= plain |\n|---|---|---|---|---|---|---|---|")
  failed = []
  for c in levels:
    plain_texts = [x["text"] for x in runs["plain"][c][-1]["results"]]
    base = None
    for name in specs:
      ps = runs[name][c]
      rates = [sum(x["usage"]["completion_tokens"] for x in p["results"]) / p["wall_s"] for p in ps]
      base = rates if name == "plain" else base
      res = ps[-1]["results"]
      drafted = sum(x["usage"].get("drafted_tokens", 0) for p in ps for x in p["results"])
      accepted = sum(x["usage"].get("accepted_tokens", 0) for p in ps for x in p["results"])
      valid = sum(workload.validate(x["text"])[0] for p in ps for x in p["results"])
      same = sum(x["text"] == y for x, y in zip(res, plain_texts))
      n = sum(len(p["results"]) for p in ps)
      row = {"tok_s_by_repeat": [round(x, 2) for x in rates], "speedup_by_repeat": [round(x / b, 3) for x, b in
                                                                                       zip(rates, base)],
             "latency_mean_s": float(np.mean([x["latency"] for p in ps for x in p["results"]])),
             "acceptance_rate": accepted / drafted if drafted else None, "drafted_tokens": drafted,
             "accepted_tokens": accepted, "valid": valid, "outputs": n, "same_as_plain": same,
             "outputs_last_repeat": len(res)}
      out["points"].setdefault(f"c{c}", {})[name] = row
      if valid != n or same != len(res):
        failed.append(f"c{c} {name}")
      acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
      print(f"| {c} | {name} | {' / '.join(f'{x:.1f}' for x in rates)} | "
            f"{' / '.join(f'{x:.2f}x' for x in row['speedup_by_repeat'])} | {row['latency_mean_s']:.2f} | {acc} | "
            f"{valid}/{n} | {same}/{len(res)} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)
  if failed:
    raise SystemExit(f"invalid outputs or outputs unlike plain decoding's at: {failed}")


if __name__ == "__main__":
  app.run(main)
