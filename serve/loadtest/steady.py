"""After rollout: steady mixed traffic against one server with the tuned policy and switchback windows on, then the
server's live verdict per segment beside the offline load matrix's.

  python -m serve.loadtest.steady --config=configs/loadtest.py --output_dir=benchmarks/reports/gemma3_270m \\
      --steady_seconds=600 --steady_clients=4 --switchback='{"window_s": 5, "off_share": 0.25}'

The server runs the run config's server flags with the output directory's tuned `speculative_config.json` (or
--speculative_config). The traffic is the run config's prompts (its `prompt_split`: the held-apart one), greedy and sampled requests alternating (the config's `samplings`), closed loop with
`--steady_clients` clients for `--steady_seconds`. At the end it reads GET /admin/speculation/report and writes
`live_report.json` and `live_ab.md` (the live verdict per segment, next to the offline evidence behind each rule
of the policy, from `summary.json`) into the output directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

import httpx
from absl import app, flags

from serve.loadtest import loadgen
from serve.loadtest.launcher import ServerProcess
from serve.loadtest.pipeline import output_dir
from serve.loadtest.traffic import LoadPoint, build_requests, load_prompts, split_prompts
from spec_jax import flag_table

_CONFIG = flag_table.define_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "loadtest.py"))
flag_table.define(("output_dir", "speculative_config", "switchback", "steady_seconds", "steady_clients"))
FLAGS = flags.FLAGS


def mixed_requests(prompts, cfg: dict, n: int) -> list:
  """n requests alternating over the config's samplings (greedy, sampled, greedy, ...), each with its seed."""
  per = [build_requests(prompts, n, s, cfg["output_lengths"], seed=int(cfg.get("seed", 0)) + 31 * i)
         for i, s in enumerate(cfg["samplings"])]
  out = []
  for j in range(n):
    r = per[j % len(per)][j // len(per)]
    out.append(r.__class__(**{**vars(r), "seq": j}))
  return out


def _fmt_ratio(v: dict) -> str:
  if v.get("ratio") is None:
    return "n/a"
  iv = v.get("interval") or [None, None]
  return f"{v['ratio']:.2f}x" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv[0] is not None else "")


def offline_evidence(summary: dict) -> dict:
  """rule name -> a short line of the offline evidence behind it (the tuner's, where summary.json has it)."""
  out = {}
  for rule in (summary.get("tuned") or {}).get("rules") or []:
    if not isinstance(rule, dict) or not rule.get("name"):
      continue
    ev = rule.get("evidence")
    if isinstance(ev, str):
      out[rule["name"]] = ev
    elif isinstance(ev, dict) and ev.get("default"):
      out[rule["name"]] = f"off: {len(ev.get('segments') or [])} grid segments where no arm keeps"
    elif isinstance(ev, dict):
      cells = ev.get("cells") or []
      keep = sum(1 for c in cells if c.get("verdict") == "keep")
      gain = ev.get("gain")
      out[rule["name"]] = (f"{', '.join(ev.get('arms') or [])}: {keep}/{len(cells)} cells keep"
                           + (f", output tok/s {gain:+.0%}" if gain is not None else "")
                           + f", >= {ev.get('min_requests', 0)} requests a cell"
                           + (f", {len(ev['fallbacks'])} fallbacks" if ev.get("fallbacks") else ""))
  return out


def write_markdown(path: str, report: dict, meta: dict, evidence: dict) -> None:
  L = ["# The live A/B after rollout", "",
       f"`{meta['command']}` — {meta['started']} to {meta['ended']} UTC; {meta['requests']} requests "
       f"({meta['failed']} failed), {meta['clients']} clients, greedy and sampled alternating.", "",
       f"Policy: `{json.dumps(meta['speculative_config'].get('policy'))}`", "",
       f"Switchback: `{json.dumps({k: report['switchback'][k] for k in ('window_s', 'off_share')})}`, windows "
       f"{report['switchback']['windows']}.", "",
       "| segment | k | live verdict | deciding metric | on/off ratio (interval) | tokens on / off | windows on / off "
       "| TPOT on / off (ms) | p95 ITL on / off (ms) | acceptance length on | offline evidence |",
       "|---|---|---|---|---|---|---|---|---|---|---|"]
  for seg, r in report["segments"].items():
    on, off = (r.get("arms") or {}).get("on") or {}, (r.get("arms") or {}).get("off") or {}
    ms = lambda c, k: f"{c[k] * 1e3:.1f}" if c.get(k) is not None else "n/a"
    L.append(f"| {seg} | {r.get('num_speculative_tokens')} | {r.get('verdict', 'n/a')} | {r.get('metric', '')} | "
             f"{_fmt_ratio(r)} | {on.get('output_tokens', 0)} / {off.get('output_tokens', 0)} | "
             f"{on.get('windows_with_data', 0)} / {off.get('windows_with_data', 0)} | {ms(on, 'tpot_mean')} / "
             f"{ms(off, 'tpot_mean')} | {ms(on, 'itl_p95')} / {ms(off, 'itl_p95')} | "
             f"{on.get('acceptance_length') or 0:.2f} | {evidence.get(seg, '')} |")
  with open(path, "w") as f:
    f.write("\n".join(L) + "\n")


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)
  from serve.engine.live_ab import SwitchbackConfig  # lazy: heavy, only this path (jax: not in the load-test client)
  from spec_jax.spec_config import (  # lazy: heavy, only this path (jax: not in the load-test client)
      from_dict, read_json_arg)

  cfg = _CONFIG.value.to_dict()
  out_dir = output_dir(FLAGS.output_dir, cfg.get("output_dir") or "", "steady")
  try:
    spec_path = FLAGS.speculative_config or os.path.join(out_dir, "speculative_config.json")
    spec = read_json_arg(spec_path, "--speculative_config")
    from_dict(spec)  # a bad file fails here, before a server starts
    switchback = FLAGS.switchback or '{"window_s": 5, "off_share": 0.25}'
    SwitchbackConfig.parse(switchback)
    prompts = split_prompts(load_prompts(cfg["prompts"], int(cfg.get("prompt_limit", 0)),
                                         tuple(cfg.get("categories", ()))), cfg.get("prompt_split") or "",
                                 len(cfg["output_lengths"]))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  flags_ = dict(cfg["server"]["flags"], switchback=switchback)
  clients, seconds = int(FLAGS.steady_clients), float(FLAGS.steady_seconds)
  reqs = mixed_requests(prompts, cfg, min(200_000, max(64, int(seconds * clients * 50))))  # more than time allows
  model = cfg.get("model_name") or "gemma-3-270m"
  os.makedirs(out_dir, exist_ok=True)
  started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
  with ServerProcess(flags_, spec, os.path.join(out_dir, "steady_server.log"),
                     startup_timeout=float(cfg["server"].get("startup_timeout", 900))) as srv:
    warm = mixed_requests(prompts, cfg, 2 * clients)
    asyncio.run(loadgen.warmup(srv.url, warm, model=model, concurrency=clients,
                               request_timeout=float(cfg["request_timeout"])))
    pt = LoadPoint("closed", float(clients), f"steady c{clients}", "mixed", "")
    res = asyncio.run(loadgen.run_point(srv.url, pt, reqs, model=model, max_requests=len(reqs), max_seconds=seconds,
                                        drain_s=float(cfg.get("drain_seconds", 30)),
                                        request_timeout=float(cfg["request_timeout"]), pid=srv.pid))
    report = httpx.get(srv.url + "/admin/speculation/report", timeout=60).json()
  summary_path = os.path.join(out_dir, "summary.json")
  summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
  meta = {"command": " ".join(["python -m serve.loadtest.steady"] + sys.argv[1:]), "started": started,
          "ended": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "clients": clients,
          "requests": len(res.records), "failed": sum(r["status"] != "ok" for r in res.records),
          "speculative_config": spec, "wall_s": res.wall_s}
  with open(os.path.join(out_dir, "steady_records.jsonl"), "w") as f:
    for r in res.records:
      f.write(json.dumps(r) + "\n")
  with open(os.path.join(out_dir, "live_report.json"), "w") as f:
    json.dump({"meta": meta, "report": report}, f, indent=1)
  write_markdown(os.path.join(out_dir, "live_ab.md"), report, meta, offline_evidence(summary))
  print(open(os.path.join(out_dir, "live_ab.md")).read())


if __name__ == "__main__":
  app.run(main)
