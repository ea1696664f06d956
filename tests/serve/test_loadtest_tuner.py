"""The tuner on a recorded matrix (tests/serve/fixtures/loadtest_segments, made by make_loadtest_segments.py): the
per-segment verdicts become exactly the expected segment policy, which the server's parser accepts; a thin cell
falls back to the coarser segment and the report says so; changing one verdict changes the policy; the tuned rerun
is checked per point and segment. No model, no server: files in, files out."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest

from serve.loadtest import analyze as A
from serve.loadtest import report, tuner
from serve.loadtest.traffic import LoadPoint
from spec_jax.spec_config import from_dict
from spec_jax.spec_policy import Features
from tests.serve.fixtures import make_loadtest_segments as F

FIXTURE = F.HERE

EXPECTED = {
    "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4,
    "policy": [
        {"match": {"temperature": "zero", "busy_slots": [1, 2], "max_tokens": [0, 64]}, "num_speculative_tokens": 4},
        {"match": {"temperature": "zero", "busy_slots": [2, None]}, "num_speculative_tokens": 2},
        {"match": {}, "num_speculative_tokens": 0}]}


@pytest.fixture
def run_dir(tmp_path):
  d = tmp_path / "run"
  shutil.copytree(FIXTURE, d)
  return d


def test_fixture_is_what_the_generator_writes(tmp_path):
  F.build(str(tmp_path))
  for name in ("run.json", "points.json", "records.jsonl"):
    assert (tmp_path / name).read_text() == open(os.path.join(FIXTURE, name)).read(), name


def _policy_ks(sc, **kw) -> int:
  f = dict(temperature=0.0, prompt_tokens=20, max_tokens=32, busy_slots=1) | kw
  return sc.policy.pick(Features(**f)).k


def test_recorded_matrix_gives_the_expected_policy(run_dir):
  summary = A.analyze(str(run_dir), plots=False)
  tuned = summary["tuned"]
  assert tuned["config"] == EXPECTED
  assert json.loads((run_dir / "speculative_config.json").read_text()) == EXPECTED
  sc = from_dict(tuned["config"])  # what the server reads
  assert sc.method == "ngram" and sc.k == 4
  assert _policy_ks(sc) == 4 and _policy_ks(sc, max_tokens=64) == 0 and _policy_ks(sc, prompt_tokens=300) == 4
  assert _policy_ks(sc, busy_slots=2, max_tokens=64) == 2 and _policy_ks(sc, busy_slots=3) == 2
  assert _policy_ks(sc, busy_slots=4) == 2 and _policy_ks(sc, temperature=0.7) == 0
  assert _policy_ks(sc, temperature=0.7, busy_slots=3) == 0

  # Evidence per rule: the deciding cells, their verdicts, gains and request counts; the fallback on the thin
  # long-prompt cell of c2, which judges both the band at 1 busy slot (as its guard) and 2-3.
  r1, r2, default = tuned["rules"]
  assert r1["evidence"]["arms"] == ["ngram_k4"] and r2["evidence"]["arms"] == ["ngram_k2"]
  cells = {(c["point"], c["segment"]): c for c in r1["evidence"]["cells"]}
  assert {("greedy/c1", "prompt=<64"), ("greedy/c1", "output=32"), ("greedy/c2", "prompt=<64"),
          ("greedy/c2", "output=32"), ("greedy/c2", "all")} <= set(cells)
  assert not any(p == "greedy/c4" for p, _ in cells)
  assert all(c["verdict"] == "keep" and c["requests"] >= 4 and c["gain"] > 0.2 for c in cells.values())
  assert ("greedy/c4", "prompt=>=64") in {(c["point"], c["segment"]) for c in r2["evidence"]["cells"]}
  for r, band in ((r1, "busy 1"), (r2, "busy 2-3")):
    assert len(r["evidence"]["fallbacks"]) == 1 and f"{band} prompt=>=64" in r["evidence"]["fallbacks"][0]
    assert "greedy/c2 has under 4 requests (2)" in r["evidence"]["fallbacks"][0]
  assert sorted(tuned["fallbacks"]) == sorted(r1["evidence"]["fallbacks"] + r2["evidence"]["fallbacks"])
  assert default["match"] == {} and default["k"] == 0 and default["evidence"]["default"]
  why = {(s["segment"]["busy_slots"], s["segment"]["output"], s["segment"]["prompt"]): s["why"]
         for s in default["evidence"]["segments"] if s["segment"]["temperature"] == "zero"}
  assert "roll back (acceptance_rate)" in why[("1", "64", "<64")]["ngram_k4"]
  assert ("4+", "32", "<64") not in why  # on: ngram k = 2 keeps at c4 (k = 4 does not)
  assert "policy" not in json.dumps(tuned["rules"][0]["match"])  # the evidence stays out of the written config

  # The report shows the policy as a table with the evidence and the fallback.
  report = (run_dir / "report.md").read_text()
  assert "| rule | match | k | evidence" in report
  assert '| 1 `temperature=zero,max_tokens=0-64,busy_slots=1-2` | `{"temperature": "zero", "busy_slots": [1, 2], ' \
         '"max_tokens": [0, 64]}` | 4 | ngram_k4' in report
  assert "fell back to all traffic" in report and "| 3 `default` | `{}` (everything else) | 0 (off) |" in report


def _inputs(run_dir):
  summary = A.analyze(str(run_dir), write=False, plots=False)
  run, _, _ = A.load_run(str(run_dir))
  points = {k: LoadPoint(**{f: p[f] for f in ("mode", "level", "label", "sampling", "tag")})
            for k, p in summary["points"].items()}
  arms = {a["name"]: a["speculative_config"] for a in run["arms"] if not a["baseline"]}
  temps = {s["name"]: s["temperature"] for s in run["config"]["samplings"]}
  return summary, points, arms, temps


def test_one_changed_verdict_changes_the_policy(run_dir):
  summary, points, arms, temps = _inputs(run_dir)
  base = tuner.choose(summary["stats"], summary["verdicts"], points, arms, summary["baselines"], 4,
                      temperatures=temps, min_requests=4)
  assert base["config"] == EXPECTED
  # ngram k = 4 no longer keeps for short outputs at c1: k = 2 serves that segment.
  v = copy.deepcopy(summary["verdicts"])
  v["ngram_k4"]["greedy/c1"]["output=32"]["verdict"] = "neutral"
  t = tuner.choose(summary["stats"], v, points, arms, summary["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"]["policy"][0] == {"match": {"temperature": "zero", "busy_slots": [1, 2], "max_tokens": [0, 64]},
                                      "num_speculative_tokens": 2}
  assert t["config"]["num_speculative_tokens"] == 2
  # Both arms roll back at c2 for short prompts: only the long-prompt bucket (thin, so its all-traffic cell) is on
  # in the bands that c2 judges (1 busy slot, with the next level, and 2-3); at 4+ (c4 alone) k = 2 stays on.
  v = copy.deepcopy(summary["verdicts"])
  for arm in arms:
    v[arm]["greedy/c2"]["prompt=<64"]["verdict"] = "roll back"
  t = tuner.choose(summary["stats"], v, points, arms, summary["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"]["policy"][1:] == [
      {"match": {"temperature": "zero", "busy_slots": [2, 4], "prompt_tokens": [64, None]}, "num_speculative_tokens": 2},
      {"match": {"temperature": "zero", "busy_slots": [4, None]}, "num_speculative_tokens": 2},
      {"match": {}, "num_speculative_tokens": 0}]
  assert t["config"]["policy"][0]["match"]["prompt_tokens"] == [64, None]
  # A lower floor judges the thin cell itself (neutral: the verdict's own floor), so long prompts at c2 go off.
  t = tuner.choose(summary["stats"], summary["verdicts"], points, arms, summary["baselines"], 4,
                   temperatures=temps, min_requests=2)
  assert t["fallbacks"] == []
  assert t["config"]["policy"][1] == {"match": {"temperature": "zero", "busy_slots": [2, 4], "prompt_tokens": [0, 64]},
                                      "num_speculative_tokens": 2}
  # A band is guarded by the next level: k = 2 rolling back at c4 turns off 2-3 busy slots too, though c2 keeps
  # (admitted at 2-3 busy slots, c4's traffic would speculate there).
  v = copy.deepcopy(summary["verdicts"])
  for cell in v["ngram_k2"]["greedy/c4"].values():
    cell["verdict"] = "roll back"
  t = tuner.choose(summary["stats"], v, points, arms, summary["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"]["policy"] == [EXPECTED["policy"][0], {"match": {}, "num_speculative_tokens": 0}]
  # The guard asks only for no roll-back: neutral at c4 leaves 2-3 busy on (and 4+, c4's own band, off).
  for cell in v["ngram_k2"]["greedy/c4"].values():
    cell["verdict"] = "neutral"
  t = tuner.choose(summary["stats"], v, points, arms, summary["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"]["policy"][1:] == [
      {"match": {"temperature": "zero", "busy_slots": [2, 4]}, "num_speculative_tokens": 2},
      {"match": {}, "num_speculative_tokens": 0}]
  # Sampled at temperature 0 would be greedy traffic: the policy stops naming the temperature where both agree.
  t = tuner.choose(summary["stats"], summary["verdicts"], points, arms, summary["baselines"], 4,
                   temperatures={"greedy": 0.0, "sampled": 1.0}, min_requests=4)
  assert t["config"] == EXPECTED
  for c in (tuner.choose(summary["stats"], v, points, arms, summary["baselines"], 4, temperatures=temps,
                         min_requests=m)["config"] for m in (2, 4)):
    from_dict(c)


def test_on_everywhere_needs_no_default_off_and_nothing_on_writes_off(run_dir):
  summary, points, arms, temps = _inputs(run_dir)
  keep = copy.deepcopy(summary["verdicts"])
  for arm in keep:
    for k in keep[arm]:
      for c in keep[arm][k].values():
        c["verdict"] = "keep"
  t = tuner.choose(summary["stats"], keep, points, arms, summary["baselines"], 4, temperatures=temps,
                   min_requests=4)
  assert t["config"]["policy"][-1]["match"] == {} and t["config"]["policy"][-1]["num_speculative_tokens"] > 0
  sc = from_dict(t["config"])
  assert all(_policy_ks(sc, **kw) > 0 for kw in ({}, {"temperature": 0.7, "busy_slots": 8}, {"max_tokens": 64}))
  off = copy.deepcopy(summary["verdicts"])
  for arm in off:
    for k in off[arm]:
      for c in off[arm][k].values():
        c["verdict"] = "roll back"
  t = tuner.choose(summary["stats"], off, points, arms, summary["baselines"], 4, temperatures=temps, min_requests=4)
  assert t["config"] == {} and t["method"] == "none" and t["rules"][0]["match"] == {}
  table = "\n".join(report.policy_table(t, summary["points"]))
  assert "| 1 `default` | `{}` (everything else) | 0 (off) | 24 segments: zero, busy 1, prompt <64, output 32:" in table
  assert report._recommend(dict(summary, tuned=t)).startswith("Speculation off everywhere")


def test_tuned_rerun_is_checked_per_segment(run_dir):
  """A "tuned" arm that replays ngram k = 4's measurements: fine at c1-c2, below the baseline at c4 and sampled."""
  run = json.loads((run_dir / "run.json").read_text())
  pts = json.loads((run_dir / "points.json").read_text())
  pts[A.TUNED] = dict(copy.deepcopy(pts["ngram_k4"]), name=A.TUNED, speculative_config=EXPECTED)
  run["arms"].append({"name": A.TUNED, "speculative_config": {}, "baseline": False,
                      "speculative_config_path": str(run_dir / "speculative_config.json")})
  recs = [json.loads(l) for l in (run_dir / "records.jsonl").read_text().splitlines()]
  recs += [dict(r, arm=A.TUNED) for r in recs if r["arm"] == "ngram_k4"]
  (run_dir / "run.json").write_text(json.dumps(run))
  (run_dir / "points.json").write_text(json.dumps(pts))
  (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  summary = A.analyze(str(run_dir), plots=False)
  tc = summary["tuned_check"]
  assert tc["greedy/c1"]["ok"] and tc["greedy/c2"]["ok"]
  segs = tc["greedy/c2"]["segments"]
  assert segs["all"]["ok"] and segs["prompt=<64"]["ok"] and segs["prompt=>=64"]["ok"] is None  # thin: not judged
  assert not tc["greedy/c4"]["ok"] and not tc["greedy/c4"]["segments"]["output=32"]["ok"]
  assert any(f.startswith("prompt=>=64: p95 ITL") for f in tc["sampled/c1"]["failures"])
  assert "tuned" not in summary["arms"] and summary["tuned"]["config"] == EXPECTED
  report = (run_dir / "report.md").read_text()
  assert ("**Tuned policy rerun** (the same traffic, judged per load point and segment): BELOW the baseline beyond "
          "the noise in 24 of 35 cells with enough requests.") in report
  assert "- c4 (peak) [greedy] output=32: mean TPOT 12.0 ms vs 10.1 ms" in report
  assert "| prompt=>=64 | ok | thin (2) | **BELOW** |" in report


def test_a_held_apart_rerun_recommends_from_its_check():
  """A run whose only speculative arm is `tuned` (a given policy, held apart) has nothing to tune: its
  recommendation is the tuned check's count, not "speculation off everywhere"."""
  seg = lambda ok: {"ok": ok, "failures": [], "requests": 6}
  tc = {"greedy/c1": {"ok": True, "segments": {"all": seg(True), "prompt=<64": seg(None)}},
        "greedy/c2": {"ok": False, "segments": {"all": seg(True), "prompt=<64": seg(False)}}}
  summary = {"tuned": {"config": {}, "method": "none", "rules": [{"match": {}, "k": 0}]}, "arms": [],
             "tuned_check": tc}
  assert report._recommend(summary) == ("This run checks a given policy (arm `tuned`), with no arms to tune from: "
                                        "it is below the baseline beyond the noise in 1 of 3 cells (below).")
  tc["greedy/c2"]["segments"]["prompt=<64"] = seg(True)
  assert report._recommend(summary).endswith("stays within the noise of the baseline in all 3 cells with enough "
                                             "requests.")
  assert report._recommend(dict(summary, tuned_check=None)).startswith("Speculation off everywhere")
