"""benchmarks/structured.py end to end on Gemma 3 270M, one prompt (slow): the script runs (it broke once when
the loop's random streams changed under it), every arm's output is valid and equals plain constrained decoding's,
and the untimed replay of each step's drafts attributes them right: no forced drafts where the forced table is
blanked, only forced ones for the grammar-only proposer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serve.test_server import ROOT


@pytest.mark.slow
def test_the_structured_benchmark_runs_and_attributes_forced_drafts(tmp_path):
  out = tmp_path / "batch1.json"
  r = subprocess.run([sys.executable, "-m", "benchmarks.structured", "--limit=1", "--repeats=1",
                      f"--json_out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-3000:]
  arms = json.loads(out.read_text())["arms"]
  assert set(arms) == {"plain", "ngram", "ngram+forced", "forced"}
  for name, row in arms.items():
    assert row["valid"] == row["outputs"] == row["same_as_plain"] == 1, name
  assert arms["ngram"]["forced"] == 0 < arms["ngram"]["drafted"]
  assert 0 < arms["ngram+forced"]["forced"] < arms["ngram+forced"]["drafted"]
  assert arms["forced"]["forced"] == arms["forced"]["drafted"] > 0
  assert arms["forced"]["accepted_forced"] == arms["forced"]["accepted"] > 0
