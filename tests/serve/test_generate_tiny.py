"""serve.generate end to end on the tiny random Gemma 3 (tests/serve/test_server.py's GGUF), as a subprocess: what
the main job tells a new user (stage lines, the table's prompt names and legend, compile time, output equality),
and the suffix proposer's history kept across the batches of one run.

One run serves both checks (about 30-70 s, mostly compiling): `--method=suffix --compare` at batch 1 over one
prompt sent twice, the copies in two categories so the table splits their acceptance.
"""

import json
import os
import subprocess
import sys

import pytest

from serve.generate import differences, equality_line
from tests.serve.test_server import ROOT, write_tiny_model

PROMPT = "the dog ran and the cat sat on a mat"


@pytest.fixture(scope="module")
def suffix_run(tmp_path_factory):
  d = tmp_path_factory.mktemp("generate_tiny")
  model = write_tiny_model(d / "tiny.gguf")
  prompts = d / "p.jsonl"
  prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": PROMPT}) + "\n"
                             for i, c in (("a1", "first"), ("a2", "second"))))
  summ = d / "s.json"
  env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}
  r = subprocess.run([sys.executable, "-m", "serve.generate", f"--model={model}", f"--prompts={prompts}",
                      "--compare", "--method=suffix", "--max_new_tokens=24", "--costs_file=", "--adaptive=false",
                      "--batch_size=1", f"--summary_json={summ}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  return r, json.loads(summ.read_text())


def test_main_job_explains_itself(suffix_run):
  r, summary = suffix_run
  stages = [l for l in r.stderr.splitlines() if l.startswith("[")]
  assert "persistent compilation cache" in stages[0] and "loading" in stages[1]
  assert any("compiles" in l for l in stages)
  assert any("dequantizing" in l or "cached" in l for l in stages)  # the slow step says what it is
  out = r.stdout
  # The table names the prompts each category row holds, and the printed outputs carry the same category.
  assert "1 (a1)" in out and "1 (a2)" in out and "--- a1 [first]" in out
  for words in ("mean acc len:", "acc rate:", "acc by position:", "drafts by position"):
    assert words in out
  assert "s compiling and warming up" in out and "untimed" in out
  assert "outputs: all 2 speculative outputs equal the baseline's token for token" in out
  assert "vary by several percent" in out
  assert summary["outputs_differ"] == [] and summary["speculative"]["warmup_s"] > 0
  row = summary["categories"][0]
  assert len(row["per_position_drafted"]) == len(row["per_position_acceptance"]) and row["ids"] == ["a1"]


def test_suffix_history_carries_across_batches(suffix_run):
  """The second copy runs in its own batch after the first: with the history kept it drafts the first copy's
  answer and accepts far more per step; with a fresh history per batch both copies would read the same."""
  _, summary = suffix_run
  rows = {r["category"]: r for r in summary["categories"]}
  first, second = rows["first"]["mean_acceptance_length"], rows["second"]["mean_acceptance_length"]
  assert second >= first + 0.5, (first, second)


def test_equality_line_names_what_differs():
  recs = [{"id": "x", "token_ids": [1, 2, 3]}, {"id": "y", "token_ids": [1, 2, 3]}, {"id": "z", "token_ids": [4]}]
  base = [{"id": "x", "token_ids": [1, 2, 3]}, {"id": "y", "token_ids": [1, 5, 3]}, {"id": "z", "token_ids": [4, 4]}]
  assert differences(recs, base) == [{"id": "y", "from_token": 1}, {"id": "z", "from_token": 1}]
  line = equality_line(recs, base, {"temperature": 0.0})
  assert line.startswith("outputs: 1 of 3 equal the baseline's; differ: y (from token 1), z (from token 1)")
  assert "all 3" in equality_line(recs, recs, {"temperature": 0.0})
