"""python -m serve.loadtest --config=configs/loadtest.py: run the load matrix, then write the verdict, the tuned
speculative_config.json and report.md into the output directory.

  python -m serve.loadtest --config=configs/loadtest_smoke.py              # ~5 min on a quiet machine, Gemma 3 270M
  python -m serve.loadtest --config=configs/loadtest.py --output_dir=benchmarks/reports/gemma3_270m

Output: --output_dir, else the config's output_dir, else a fresh loadtest_<date>_<time>/ under the working
directory. Exit status: 0 with a verdict, 2 on an error, 3 when an arm is inconclusive (a load point finished too
few requests to judge; the reason is printed). Servers it starts listen on 127.0.0.1, at a free port in
--port_range=LO-HI when given.
  python -m serve.loadtest --analyze_only=benchmarks/reports/gemma3_270m   # rebuild the report from the files
  python -m serve.loadtest --url=http://127.0.0.1:8000 --config.slots=4 --verify_tuned=false  # measure one server
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import httpx
from absl import app, flags

from serve.loadtest.analyze import analyze
from serve.loadtest.launcher import parse_port_range
from serve.loadtest.pipeline import inconclusive, output_dir, print_verdict, run
from spec_jax import flag_table

_CONFIG = flag_table.define_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "loadtest.py"))
flag_table.define(("output_dir", "url", "analyze_only", "only_arms", "verify_tuned", "plots", "port_range"))
INCONCLUSIVE_EXIT = 3
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # absl logs at INFO: one line per request otherwise

  def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the server of the running arm is stopped
    raise KeyboardInterrupt(f"signal {signum}")
  signal.signal(signal.SIGTERM, _interrupt)
  if FLAGS.analyze_only:
    summary = analyze(FLAGS.analyze_only, plots=FLAGS.plots)
    print_verdict(summary, FLAGS.analyze_only)
    _exit_if_inconclusive(summary)
    return
  cfg = _CONFIG.value.to_dict()
  if FLAGS.url:  # one running server: only the baseline repeats (and arms with their own url) make sense
    cfg["url"] = FLAGS.url
    cfg["arms"] = [a for a in cfg["arms"] if a.get("url")]
  if FLAGS.only_arms:
    cfg["arms"] = [a for a in cfg["arms"] if a["name"] in FLAGS.only_arms]
  out_dir = output_dir(FLAGS.output_dir, cfg.get("output_dir") or "")
  verify = cfg.get("verify_tuned", False) if FLAGS.verify_tuned is None else FLAGS.verify_tuned
  try:
    if FLAGS.port_range:
      parse_port_range(FLAGS.port_range)  # a bad range fails before any server starts
      cfg["port_range"] = FLAGS.port_range
    summary = run(cfg, out_dir, verify_tuned=verify, plots=FLAGS.plots)
  except (ValueError, FileNotFoundError, RuntimeError, httpx.HTTPError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print_verdict(summary, out_dir)
  _exit_if_inconclusive(summary)


def _exit_if_inconclusive(summary: dict) -> None:
  thin = inconclusive(summary)
  if thin:
    print(f"inconclusive: {', '.join(thin)} (too few finished requests at some load points to judge; see above)",
          file=sys.stderr)
    sys.exit(INCONCLUSIVE_EXIT)


if __name__ == "__main__":
  app.run(main)
