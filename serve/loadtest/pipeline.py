"""The whole tool as a function (the CLI and the tests call it): matrix -> analysis -> optional tuned rerun.

Kept apart from __main__ so that importing it defines no absl flags (serve.server defines its own).
"""

from __future__ import annotations

import json
import os
import time

from serve.loadtest.analyze import TUNED, analyze
from serve.loadtest.matrix import run_matrix


def run(cfg: dict, out_dir: str, *, verify_tuned: bool, plots: bool = True, log=print) -> dict:
  """-> the analysis summary. The tuned rerun needs arms the tool starts itself (not URLs)."""
  run_matrix(cfg, out_dir, log=log)
  summary = analyze(out_dir, plots=plots)
  if verify_tuned:
    if cfg.get("url") or any(a.get("url") for a in cfg.get("arms") or []):
      log("tuned rerun skipped: arms targeted by URL (the tool cannot restart them with the tuned config)")
    else:
      path = os.path.abspath(os.path.join(out_dir, "speculative_config.json"))
      log(f"tuned rerun with {path}: {json.dumps(summary['tuned']['config'])}")
      run_matrix(cfg, out_dir, log=log, arms=[{"name": TUNED, "speculative_config": {},
                                               "speculative_config_path": path, "baseline": False}], append=True)
      summary = analyze(out_dir, plots=plots)
  return summary


def output_dir(flag: str, configured: str, name: str = "loadtest") -> str:
  """--output_dir, else the config's output_dir, else a fresh folder under the working directory
  (<name>_<YYYYmmdd_HHMMSS>, suffixed if taken): a run never lands in the committed reports unless asked."""
  if flag or configured:
    return flag or configured
  stem = os.path.join(os.getcwd(), f"{name}_{time.strftime('%Y%m%d_%H%M%S')}")
  path, i = stem, 1
  while os.path.exists(path):
    i += 1
    path = f"{stem}_{i}"
  return path


def inconclusive(summary: dict) -> dict:
  """{arm: {point: reason}} for the arms whose verdict is inconclusive (too few finished requests at a point)."""
  return {a: summary["overall"][a].get("inconclusive") or {} for a in summary["arms"]
          if summary["overall"][a]["overall"] == "inconclusive"}


def print_verdict(summary: dict, out_dir: str) -> None:
  for arm in summary["arms"]:
    o = summary["overall"][arm]
    print(f"{arm}: {o['overall']} (keeps at {', '.join(o['loads_on']) or '-'}; rolls back at "
          f"{', '.join(o['loads_off']) or '-'})")
    for key, why in (o.get("inconclusive") or {}).items() if o["overall"] == "inconclusive" else ():
      print(f"  inconclusive at {key}: {why}")
  print("tuned speculative_config.json:", json.dumps(summary["tuned"]["config"]))
  if summary.get("tuned_check"):
    bad = [k for k, v in summary["tuned_check"].items() if not v["ok"]]
    print("tuned rerun:", "never below the baseline beyond the noise" if not bad else f"below at {bad}")
  print(f"report: {os.path.join(out_dir, 'report.md')}")
