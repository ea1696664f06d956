"""The load matrix's `structured` segment (issue 36): prompts that carry a response_format send it, their records
say so, they form the "structured" cell of every per-segment table, and the tuner gives them rules of their own
(which the server matches: it tags a request with a grammar "structured"). No model, no server: files in, files out."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from serve.loadtest import aggregate
from serve.loadtest.traffic import build_requests, load_prompts
from spec_jax.spec_config import from_dict
from spec_jax.spec_policy import Features
from tests.serve.fixtures import make_loadtest_segments as F
from tests.serve.test_loadtest_tuner import EXPECTED, _inputs

RF = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}}}
STRUCTURED = {0, 1, 2, 3}  # prompt indices of the fixture whose requests asked for JSON


def test_prompts_with_a_response_format_send_it_and_files_mix(tmp_path):
  plain, structured = tmp_path / "plain.jsonl", tmp_path / "structured.jsonl"
  plain.write_text(json.dumps({"id": "q", "turns": ["hello"]}) + "\n")
  structured.write_text(json.dumps({"id": "s", "turns": ["give a"], "category": "structured",
                                    "response_format": RF}) + "\n")
  prompts = load_prompts(f"{plain},{structured}")
  assert [(p.id, p.index, bool(p.response_format)) for p in prompts] == [("q", 0, False), ("s", 1, True)]
  assert load_prompts([str(plain), str(structured)]) == prompts
  reqs = build_requests(prompts, 4, {"name": "greedy", "temperature": 0.0}, (16,), seed=0)
  bodies = {r.prompt.id: r.body("m") for r in reqs}
  assert bodies["s"]["response_format"] == RF and "response_format" not in bodies["q"]
  assert bodies["s"]["messages"] == [{"role": "user", "content": "give a"}]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"prompt": "x", "response_format": "json"}) + "\n")
  with pytest.raises(ValueError, match="response_format"):
    load_prompts(str(bad))


def test_the_structured_cell_holds_exactly_the_structured_records():
  recs = [{"category": "qa", "prompt_id": str(i), "max_tokens": 32, "status": "ok", "ttft": 0.1, "itl": [0.01],
           "e2e": 0.2, "tpot": 0.01, "completion_tokens": 10 + i, "structured": i % 2 == 0} for i in range(6)]
  stats = aggregate.aggregate([{"arm": "a", "key": "greedy/c1", "records": recs, "wall_s": 1.0}], (64,))
  cells = stats["a"]["greedy/c1"]
  assert cells["structured"]["requests"] == 3 and cells["structured"]["output_tokens"] == 10 + 12 + 14
  assert cells["all"]["requests"] == 6
  assert "structured" not in aggregate.aggregate(
      [{"arm": "a", "key": "k", "records": [dict(r, structured=False) for r in recs], "wall_s": 1.0}], (64,))["a"]["k"]


@pytest.fixture
def structured_run(tmp_path):
  """The tuner's recorded matrix (make_loadtest_segments.py) with prompts 0-3 asking for JSON: 4 requests a point."""
  d = tmp_path / "run"
  shutil.copytree(F.HERE, d)
  lines = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()]
  for r in lines:
    r["structured"] = int(r["prompt_id"][1:]) in STRUCTURED
  (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  return d


def _ks(sc, **kw) -> int:
  f = dict(temperature=0.0, prompt_tokens=20, max_tokens=32, busy_slots=1) | kw
  return sc.policy.pick(Features(**f)).k


def test_the_tuner_gives_structured_requests_their_own_rules(structured_run):
  from serve.loadtest import analyze as A
  from serve.loadtest import tuner
  summary = A.analyze(str(structured_run), plots=False)
  v = summary["verdicts"]
  # ngram k = 2 keeps at every greedy point's structured cell, k = 4 rolls back at c4; sampled points roll back
  assert all(v["ngram_k2"][f"greedy/c{c}"]["structured"]["verdict"] == "keep" for c in (1, 2, 4))
  assert v["ngram_k4"]["greedy/c4"]["structured"]["verdict"] == "roll back"
  cfg = summary["tuned"]["config"]
  assert cfg["policy"] == [{"match": {"segment": "structured", "temperature": "zero"}, "num_speculative_tokens": 2},
                           {"match": {"segment": "structured", "temperature": "nonzero"},
                            "num_speculative_tokens": 0}] + EXPECTED["policy"]
  assert {k: v for k, v in cfg.items() if k != "policy"} == {k: v for k, v in EXPECTED.items() if k != "policy"}
  sc = from_dict(cfg)  # what the server reads: structured greedy requests get k = 2 where the grid says 4 or 0
  assert _ks(sc, segment="structured") == 2 and _ks(sc) == 4
  assert _ks(sc, segment="structured", max_tokens=64) == 2 and _ks(sc, max_tokens=64) == 0
  assert _ks(sc, segment="structured", temperature=0.7) == 0
  rule = summary["tuned"]["rules"][0]
  assert rule["evidence"]["arms"] == ["ngram_k2"]
  assert {(c["point"], c["segment"]) for c in rule["evidence"]["cells"]} == {
      (f"greedy/c{c}", "structured") for c in (1, 2, 4)}
  report = (structured_run / "report.md").read_text()
  assert "`{\"segment\": \"structured\", \"temperature\": \"zero\"}` | 2 | ngram_k2" in report
  assert "greedy/c1 structured: keep" in report

  # Where no arm keeps for structured greedy traffic, one rule turns it off at both temperatures; a thin
  # structured cell falls back to the point's all-traffic cell, and the evidence says so.
  summary2, points, arms, temps = _inputs(structured_run)
  off = copy.deepcopy(summary2["verdicts"])
  for arm in arms:
    off[arm]["greedy/c2"]["structured"]["verdict"] = "roll back"
  t = tuner.choose(summary2["stats"], off, points, arms, summary2["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"]["policy"][0] == {"match": {"segment": "structured"}, "num_speculative_tokens": 0}
  assert t["config"]["policy"][1:] == EXPECTED["policy"]
  t = tuner.choose(summary2["stats"], summary2["verdicts"], points, arms, summary2["baselines"], 4,
                   temperatures=temps, min_requests=5)
  assert any("structured" in f and "fell back to all traffic" in f for f in t["rules"][0]["evidence"]["fallbacks"])
