"""Run the matrix: for each arm (baseline first and last, speculative arms between), start its server (or target
its URL), warm it up, replay every load point, and write the raw records. Analysis (analyze.py) only reads files,
so a report can be rebuilt from a finished run without rerunning it.

Files in the output directory:
  run.json        settings: the shared server flags, each arm's speculative config, traffic, guardrails
  records.jsonl   one line per measured request (arm, point, timings, usage, outcome)
  points.json     per (arm, point): wall time, /metrics deltas, memory and slot samples, usage-vs-metrics check
  server_<arm>.log
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Optional

import httpx

from serve.loadtest import aggregate, loadgen
from serve.loadtest import metrics as M
from serve.loadtest.launcher import ServerProcess, parse_port_range
from serve.loadtest.traffic import build_requests, load_points, load_prompts, split_prompts


def arm_list(cfg: dict) -> list[dict]:
  """Baseline repeats spread over the run (first, last, then between), speculative arms in between."""
  base = {"name": "baseline", "speculative_config": {}, **dict(cfg.get("baseline") or {})}
  arms = [dict(a) for a in cfg.get("arms") or []]
  names = [a["name"] for a in arms]
  if len(set(names)) != len(names) or "baseline" in names or any("#" in n for n in names):
    raise ValueError(f"arm names must be unique, not 'baseline' and without '#': {names}")
  reps = max(1, int(cfg.get("baseline_repeats", 2)))
  bases = [dict(base, name="baseline" if i == 0 else f"baseline#{i + 1}", baseline=True) for i in range(reps)]
  order = [bases[0]] + arms
  if reps > 1:
    mid = bases[2:]
    for i, b in enumerate(mid):  # extra repeats interleave with the arms
      order.insert(min(len(order), 1 + (i + 1) * max(1, len(arms) // (len(mid) + 1))), b)
    order.append(bases[1])
  for a in order:
    a.setdefault("baseline", False)
    a["speculative_config"] = dict(a.get("speculative_config") or {})
    if a.get("kv_cache_dtype"):
      from spec_jax.cache import kv_storage_dtype  # lazy: heavy, only this path (jax: not in the load-test client)
      kv_storage_dtype(a["kv_cache_dtype"])  # an unknown value is an error before any server starts
  return order


@contextlib.contextmanager
def arm_server(arm: dict, cfg: dict, out_dir: str):
  """-> (url, pid, info). An arm with a `url` is targeted as is (its `pid`, if given, is measured)."""
  url = arm.get("url") or cfg.get("url")
  if url:
    yield url.rstrip("/"), arm.get("pid"), {"url": url, "launched": False}
    return
  srv_cfg = dict(cfg["server"])
  flags = arm_flags(arm, cfg)
  spec = arm.get("speculative_config_path") or arm["speculative_config"]
  log = os.path.join(out_dir, f"server_{arm['name'].replace('#', '_')}.log")
  proc = ServerProcess(flags, spec if isinstance(spec, dict) else None, log,
                       startup_timeout=float(srv_cfg.get("startup_timeout", 600)),
                       stop_grace=float(srv_cfg.get("stop_grace", 30)), env=dict(srv_cfg.get("env") or {}),
                       port_range=parse_port_range(cfg.get("port_range") or ""))
  if isinstance(spec, str):  # a path: the server reads the file (the tuned config's own format)
    proc.argv[-1] = f"--speculative_config={spec}"
  with proc:
    info = {"url": proc.url, "launched": True, "argv": proc.argv[1:], "startup_s": proc.startup_s}
    try:
      yield proc.url, proc.pid, info
    finally:
      info["exit_code"] = proc.stop()


def server_reports(url: str, api_key: str = "") -> dict:
  """What the running server says it serves (/v1/models, GET /admin/speculation), so the report shows that each
  arm ran the method and k it was meant to. Missing routes are skipped."""
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  out = {}
  for key, path in (("models", "/v1/models"), ("speculation", "/admin/speculation")):
    try:
      r = httpx.get(url + path, headers=headers, timeout=10)
      if r.status_code == 200:
        out[key] = r.json()
    except (httpx.HTTPError, ValueError):
      pass
  return out


def arm_flags(arm: dict, cfg: dict) -> dict:
  """The server flags of an arm: the shared ones, and its own --kv_cache_dtype if it sets one (tau beside the same
  speculative config under auto, report_kv.dtype_section)."""
  flags = dict((cfg.get("server") or {}).get("flags") or {})
  if arm.get("kv_cache_dtype"):
    flags["kv_cache_dtype"] = arm["kv_cache_dtype"]
  return flags


def arm_kv_dtype(arm: dict, cfg: dict, reported: dict) -> str:
  """The KV cache dtype an arm's server ran: what it reported (GET /admin/speculation), else what it was told."""
  told = arm.get("kv_cache_dtype") or ((cfg.get("server") or {}).get("flags") or {}).get("kv_cache_dtype")
  return (reported.get("speculation") or {}).get("kv_cache_dtype") or told or "auto"


def usage_check(records: list, summary: dict) -> dict:
  """Per point: /metrics counter deltas against the sums of the per-request usage objects."""
  ok = [r for r in records if r["status"] == "ok"]
  sp = summary["speculation"]
  pairs = {"draft_tokens": (sum(r.get("drafted_tokens") or 0 for r in ok), sp.get("draft_tokens")),
           "accepted_tokens": (sum(r.get("accepted_tokens") or 0 for r in ok), sp.get("accepted_tokens")),
           "completion_tokens": (sum(r.get("completion_tokens") or 0 for r in ok), summary.get("generation_tokens"))}
  clean = all(r["status"] in ("ok", "rejected") for r in records)
  out = {"clean": clean}
  for k, (u, m) in pairs.items():
    out[k] = {"usage": u, "metrics": m, "match": (m is not None and abs(u - m) < 0.5) if clean else None}
  return out


def requests_for(point, i: int, prompts, cfg: dict):
  n = int(cfg["requests_per_point"])
  if point.mode == "closed":
    n = max(n, int(cfg.get("requests_per_client", 0)) * int(point.level))
  sampling = next(s for s in cfg["samplings"] if s["name"] == point.sampling)
  return build_requests(prompts, n, sampling, cfg["output_lengths"], seed=int(cfg.get("seed", 0)) + 7919 * i)


def run_arm(arm: dict, cfg: dict, points: list, prompts: list, out_dir: str, rec_file, log=print) -> dict:
  res = {"name": arm["name"], "speculative_config": arm.get("speculative_config_path") or arm["speculative_config"],
         "baseline": arm["baseline"], "points": {}}
  with arm_server(arm, cfg, out_dir) as (url, pid, info):
    res["server"] = info
    model = cfg.get("model_name") or "gemma-3-270m"
    timeout = float(cfg["request_timeout"])
    api_key = cfg.get("api_key", "")
    info["reported"] = server_reports(url, api_key)
    res["kv_cache_dtype"] = arm_kv_dtype(arm, cfg, info["reported"])
    n_warm = int(cfg.get("warmup_requests", 0))
    if n_warm:
      t = time.perf_counter()
      for si, smp in enumerate(cfg["samplings"]):
        warm = build_requests(prompts, n_warm, smp, cfg["output_lengths"], seed=10_000 + si)
        recs = asyncio.run(loadgen.warmup(url, warm, model=model, concurrency=int(cfg["slots"]),
                                          request_timeout=timeout, api_key=api_key))
        bad = [r for r in recs if r["status"] != "ok"]
        if bad and len(bad) == len(recs):
          raise RuntimeError(f"arm {arm['name']}: every warm-up request failed, e.g. {bad[0]['error']}")
      res["warmup_s"] = time.perf_counter() - t
    for i, pt in enumerate(points):
      reqs = requests_for(pt, i, prompts, cfg)
      pr = asyncio.run(loadgen.run_point(
          url, pt, reqs, model=model, max_requests=len(reqs), max_seconds=float(cfg["max_seconds_per_point"]),
          drain_s=float(cfg.get("drain_seconds", 30)), request_timeout=timeout, pid=pid,
          sample_interval=float(cfg.get("sample_interval", 0.5)), api_key=api_key, seed=int(cfg.get("seed", 0)) + i,
          extra={"arm": arm["name"], "point": pt.key, "mode": pt.mode, "level": pt.level}))
      summ = M.summarize_delta(M.delta(pr.before, pr.after))
      for r in pr.records:
        rec_file.write(json.dumps(r) + "\n")
      rec_file.flush()
      st = aggregate.cell_stats(pr.records, pr.wall_s)
      res["points"][pt.key] = {"wall_s": pr.wall_s, "metrics": summ, "samples": aggregate.sampler_stats(pr.samples),
                               "usage_check": usage_check(pr.records, summ), "requests": len(pr.records)}
      acc = summ["speculation"].get("acceptance_rate")
      log(f"  {arm['name']:>14} {pt.key:>14}: {st['completed']}/{st['requests']} ok, "
          f"{st['output_tok_s']:.1f} tok/s, {st['req_s']:.2f} req/s, TTFT p50 {_ms(st['ttft_p50'])}, "
          f"ITL p95 {_ms(st['itl_p95'])}" + (f", acceptance {acc:.2f}" if acc is not None else ""))
  return res


def _ms(v: Optional[float]) -> str:
  return "n/a" if v is None else f"{v * 1e3:.1f} ms"


def run_matrix(cfg: dict, out_dir: str, log=print, arms: Optional[list] = None, append: bool = False) -> dict:
  """Run every arm and write run.json, records.jsonl and points.json; returns the run dict."""
  os.makedirs(out_dir, exist_ok=True)
  prompts = load_prompts(cfg.get("prompts", ""), int(cfg.get("prompt_limit", 0)), tuple(cfg.get("categories") or ()))
  prompts = split_prompts(prompts, cfg.get("prompt_split") or "", len(cfg["output_lengths"]))
  points = load_points(int(cfg["slots"]), cfg["samplings"], tuple(cfg.get("closed_levels") or ()),
                       float(cfg.get("overload_factor", 2.0)), tuple(cfg.get("open_rates") or ()))
  arms = arms if arms is not None else arm_list(cfg)
  run_path, pts_path = os.path.join(out_dir, "run.json"), os.path.join(out_dir, "points.json")
  if append:
    with open(run_path) as f:
      run = json.load(f)
    with open(pts_path) as f:
      run["arms_results"] = json.load(f)
  else:
    run = {"config": cfg, "prompts": {"file": cfg.get("prompts", ""), "count": len(prompts),
                                      "categories": sorted({p.category for p in prompts})},
           "points": [vars(p) | {"key": p.key} for p in points], "arms": [], "arms_results": {},
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
  log(f"load matrix: {len(arms)} arms x {len(points)} points, {len(prompts)} prompts -> {out_dir}")
  with open(os.path.join(out_dir, "records.jsonl"), "a" if append else "w") as rec_file:
    for arm in arms:
      log(f"arm {arm['name']}: {json.dumps(arm.get('speculative_config_path') or arm['speculative_config'])}")
      t = time.perf_counter()
      res = run_arm(arm, cfg, points, prompts, out_dir, rec_file, log)
      res["wall_s"] = time.perf_counter() - t
      run["arms"] = [a for a in run["arms"] if a["name"] != arm["name"]] + [
          {k: v for k, v in arm.items() if k not in ("pid",)}]
      run["arms_results"][arm["name"]] = res
      with open(pts_path, "w") as f:
        json.dump(run["arms_results"], f, indent=1, default=str)
      with open(run_path, "w") as f:
        json.dump({k: v for k, v in run.items() if k != "arms_results"}, f, indent=1, default=str)
  run["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
  with open(run_path, "w") as f:
    json.dump({k: v for k, v in run.items() if k != "arms_results"}, f, indent=1, default=str)
  return run
