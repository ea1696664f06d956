"""python -m serve.loadtest as a user runs it, against a tiny in-process server: a deliberately starved run (points
cut after 50 ms) has too few finished requests to judge, says "inconclusive" with the reason and exits non-zero;
its output goes to a fresh folder under the working directory; no matplotlib log line on stderr. Plus the
--port_range parsing. About 30 s (the server's compiles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serve.loadtest.launcher import free_port, parse_port_range
from tests.serve.test_loadtest_matrix import InProcessServer
from tests.serve.test_server import MODEL, ROOT, write_tiny_model

CONFIG = """
from configs import loadtest


def get_config():
  c = loadtest.get_config()
  c.model_name = {model!r}
  c.slots = 2
  c.baseline = {{"name": "baseline", "speculative_config": {{}}, "url": {url!r}}}
  c.arms = ({{"name": "identical", "speculative_config": {{}}, "url": {url!r}}},)
  c.prompts = {prompts!r}
  c.samplings = ({{"name": "greedy", "temperature": 0.0, "top_p": 1.0}},)
  c.closed_levels = (2,)
  c.open_rates = ()
  c.output_lengths = (16, 32)
  c.prompt_len_edges = (8,)
  c.requests_per_point = 4
  c.requests_per_client = 2
  c.max_seconds_per_point = 0.05  # starved: nearly nothing finishes
  c.drain_seconds = 0.05
  c.warmup_requests = 0
  c.request_timeout = 10.0
  c.verify_tuned = False
  return c
"""


def test_a_starved_run_is_inconclusive_and_exits_nonzero(tmp_path):
  model = write_tiny_model(tmp_path / "tiny.gguf")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "prompt": "the cat sat on the mat " * (i + 1)})
                             + "\n" for i in range(4)))
  server = InProcessServer(model, {})
  try:
    cfg = tmp_path / "starved.py"
    cfg.write_text(CONFIG.format(model=MODEL, url=server.url, prompts=str(prompts)))
    work = tmp_path / "work"
    work.mkdir()
    # MPLCONFIGDIR naming a file: matplotlib warns at import that it made a temporary cache directory (the kind of
    # library line a user should not see) unless the tool quiets it.
    env = {**os.environ, "PYTHONPATH": ROOT, "MPLCONFIGDIR": str(prompts)}
    r = subprocess.run([sys.executable, "-m", "serve.loadtest", f"--config={cfg}"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
  finally:
    server.stop()
  assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  assert "identical: inconclusive" in r.stdout
  assert "too few finished requests to judge" in r.stdout and "need 4" in r.stdout
  assert "inconclusive: identical" in r.stderr
  assert "Matplotlib" not in r.stderr and "matplotlib" not in r.stderr and "mkdir -p failed" not in r.stderr
  outs = [p for p in work.iterdir() if p.name.startswith("loadtest_")]
  assert len(outs) == 1 and (outs[0] / "report.md").exists()
  assert "**inconclusive**" in (outs[0] / "report.md").read_text()


def test_port_range():
  assert parse_port_range("") is None
  assert parse_port_range("20000-20010") == (20000, 20010)
  for bad in ("20000", "20010-20000", "80-90", "a-b", "20000-70000"):
    with pytest.raises(ValueError, match="port_range"):
      parse_port_range(bad)
  lo = free_port()  # any free port; then one in a range of one
  assert free_port((lo, lo)) == lo
