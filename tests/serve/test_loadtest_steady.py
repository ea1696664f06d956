"""serve.loadtest.steady end to end on the tiny model: it starts `python -m serve.server` with a policy and
switchback windows, drives mixed greedy and sampled traffic, and writes the live report beside the offline one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.serve.test_server import MODEL, ROOT, tiny_model  # noqa: F401 (a fixture)

CONFIG = '''
import os
from configs import loadtest

def get_config():
  c = loadtest.get_config()
  c.server.flags = {"model": os.environ["STEADY_TEST_MODEL"], "dtype": "float32", "max_num_seqs": 4,
                    "max_model_len": 1024, "adaptive": False, "served_model_name": "%s", "costs_file": ""}
  c.model_name = "%s"
  c.prompts = ""
  c.output_lengths = (16,)
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},
                 {"name": "sampled", "temperature": 1.0, "top_p": 1.0})
  return c
''' % (MODEL, MODEL)


def test_steady_traffic_writes_the_live_report(tiny_model, tmp_path):  # noqa: F811
  (tmp_path / "steady_cfg.py").write_text(CONFIG)
  spec = {"method": "ngram", "num_speculative_tokens": 4,
          "policy": [{"match": {"temperature": "zero"}, "num_speculative_tokens": 4, "name": "greedy"},
                     {"match": {}, "num_speculative_tokens": 0, "name": "sampled"}]}
  (tmp_path / "speculative_config.json").write_text(json.dumps(spec))
  (tmp_path / "summary.json").write_text(json.dumps(
      {"tuned": {"rules": [{"name": "greedy", "evidence": "greedy/c1 keep (+30 % tok/s)"}]}}))
  r = subprocess.run([sys.executable, "-m", "serve.loadtest.steady", f"--config={tmp_path / 'steady_cfg.py'}",
                      f"--output_dir={tmp_path}", "--steady_seconds=8", "--steady_clients=2",
                      '--switchback={"window_s": 0.5, "off_share": 0.5, "block": 4}'],
                     cwd=ROOT, capture_output=True, text=True, timeout=600,
                     env={**os.environ, "STEADY_TEST_MODEL": tiny_model, "PYTHONPATH": str(tmp_path)})
  assert r.returncode == 0, r.stderr[-3000:]
  live = json.loads((tmp_path / "live_report.json").read_text())
  rep, meta = live["report"], live["meta"]
  assert meta["requests"] > 10 and meta["failed"] == 0
  assert set(rep["segments"]) == {"greedy", "sampled"}
  g, s = rep["segments"]["greedy"], rep["segments"]["sampled"]
  assert g["arms"]["on"]["drafted_tokens"] > 0 and g["arms"]["off"]["drafted_tokens"] == 0
  assert s["arms"]["on"]["drafted_tokens"] == 0 and s["num_speculative_tokens"] == 0
  assert g["arms"]["on"]["output_tokens"] > 0 and g["arms"]["off"]["output_tokens"] > 0
  md = (tmp_path / "live_ab.md").read_text()
  assert "| greedy | 4 |" in md and "greedy/c1 keep" in md and "| sampled | 0 |" in md
