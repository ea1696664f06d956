"""serve.loadtest pieces on hand-made inputs: ITL/TPOT definitions, percentiles, the verdict rules, /metrics parsing
of the server's own registry, and a tuned policy the server's parser accepts."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from serve.loadtest import aggregate, client, tuner
from serve.loadtest import metrics as M
from serve.loadtest import verdict as V
from serve.loadtest.traffic import LoadPoint, build_requests, load_points, load_prompts, prompt_len_bucket


def _raw(times, ntoks, total=None, texts=None, status="ok", e2e=None):
  rec = {"status": status, "completion_tokens": total, "e2e": e2e if e2e is not None else times[-1] + 0.01,
         "_times": list(times), "_ntoks": list(ntoks), "_text_lens": texts or [3] * len(times)}
  return client.finish_record(rec)


def test_itl_is_per_token_and_tpot_is_vllms():
  r = _raw([0.10, 0.20, 0.50], [1, 1, 3], total=5, e2e=0.52)
  assert r["ttft"] == pytest.approx(0.10)
  # second event: 1 token after 0.1 s; third: 3 tokens after 0.3 s -> three samples of 0.1 s
  assert r["itl"] == pytest.approx([0.1, 0.1, 0.1, 0.1])
  assert sum(r["itl"]) == pytest.approx(0.50 - 0.10)  # the samples sum to first -> last event
  assert r["event_gaps"] == pytest.approx([0.1, 0.3])
  assert r["tpot"] == pytest.approx((0.52 - 0.10) / 4)
  assert r["tokens_per_event"] == [1, 1, 3]


def test_first_event_tokens_count_in_ttft_only():
  r = _raw([0.2, 0.3], [3, 2], total=5)
  assert r["ttft"] == pytest.approx(0.2)
  assert r["itl"] == pytest.approx([0.05, 0.05])


def test_without_per_event_counts_the_usage_total_is_spread_by_text():
  r = _raw([0.1, 0.2, 0.4], [None, None, None], total=8, texts=[2, 2, 4])
  assert sum(r["tokens_per_event"]) == 8 and r["tokens_per_event"] == [2, 2, 4]
  assert len(r["itl"]) == 6


def _rec(seq, ttft, itl, tokens, status="ok", cat="code", max_tokens=16, pid=None, plen=10, drafted=0, accepted=0):
  e2e = ttft + sum(itl) + 0.001
  return {"seq": seq, "prompt_id": pid or str(seq), "category": cat, "is_chat": False, "max_tokens": max_tokens,
          "status": status, "ttft": ttft, "itl": itl, "e2e": e2e, "completion_tokens": tokens,
          "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None, "prompt_tokens": plen,
          "drafted_tokens": drafted, "accepted_tokens": accepted, "queue_time": None, "t_send": 0.0}


def test_cell_percentiles_match_numpy_and_exclude_failures():
  rng = np.random.default_rng(0)
  recs = [_rec(i, float(rng.uniform(0.01, 0.2)), list(rng.uniform(0.001, 0.05, size=int(rng.integers(2, 9)))),
               tokens=9) for i in range(20)]
  recs.append(_rec(99, 5.0, [9.0], 2, status="error"))
  st = aggregate.cell_stats(recs, wall_s=2.0)
  ok = [r for r in recs if r["status"] == "ok"]
  assert st["ttft_p95"] == pytest.approx(np.percentile([r["ttft"] for r in ok], 95))
  assert st["itl_p50"] == pytest.approx(np.percentile(np.concatenate([r["itl"] for r in ok]), 50))
  assert st["itl_p95"] == pytest.approx(np.percentile(np.concatenate([r["itl"] for r in ok]), 95))
  assert st["e2e_p50"] == pytest.approx(np.percentile([r["e2e"] for r in ok], 50))
  assert st["completed"] == 20 and st["failed"] == 1 and st["requests"] == 21
  assert st["req_s"] == pytest.approx(10.0) and st["output_tok_s"] == pytest.approx(90.0)


def test_segments_are_category_prompt_length_and_budget():
  recs = [_rec(0, 0.1, [0.01], 2, cat="qa", plen=30, max_tokens=32),
          _rec(1, 0.1, [0.01], 2, cat="rag", plen=300, max_tokens=128)]
  st = aggregate.aggregate([{"arm": "a", "key": "greedy/c1", "records": recs, "wall_s": 1.0}], (64, 256))
  cells = st["a"]["greedy/c1"]
  assert set(cells) == {"all", "category=qa", "category=rag", "prompt=<64", "prompt=>=256", "output=32",
                        "output=128"}
  assert cells["all"]["completed"] == 2 and cells["category=rag"]["completed"] == 1
  assert prompt_len_bucket(64, (64, 256)) == "64-255" and prompt_len_bucket(None, (64,)) == "?"


def _cell(**kw):
  base = dict(requests=20, completed=20, failed=0, oom=0, itl_p95=0.010, itl_p50=0.008, tpot_mean=0.009,
              e2e_p50=1.0, req_s=5.0, output_tok_s=100.0, acceptance_rate=None)
  base.update(kw)
  return base


G = V.guard_config({"noise_floor": 0.05, "noise_multiplier": 2.0, "acceptance_floor": 0.2})


def test_verdict_rules():
  reps = [_cell(), _cell(itl_p95=0.0102, tpot_mean=0.0091, e2e_p50=1.01)]
  d = V.decide_cell(_cell(itl_p95=0.02), reps, G, tag="low", segment="all", speculative=True)
  assert d["verdict"] == "roll back" and d["metric"] == "itl_p95"
  d = V.decide_cell(_cell(itl_p95=0.0103, tpot_mean=0.0092), reps, G, tag="low", segment="all", speculative=True)
  assert d["verdict"] == "neutral"
  d = V.decide_cell(_cell(itl_p95=0.009, tpot_mean=0.006, e2e_p50=0.7), reps, G, tag="low", segment="all",
                    speculative=True)
  assert d["verdict"] == "keep" and d["metric"] in ("tpot_mean", "e2e_p50")
  # throughput guardrail only at peak/overload, on all traffic
  slow = _cell(req_s=4.0)
  assert V.decide_cell(slow, reps, G, tag="peak", segment="all", speculative=True)["metric"] == "req_s"
  assert V.decide_cell(slow, reps, G, tag="low", segment="all", speculative=True)["verdict"] == "neutral"
  assert V.decide_cell(slow, reps, G, tag="peak", segment="category=qa", speculative=True)["verdict"] == "neutral"
  d = V.decide_cell(_cell(failed=2), reps, G, tag="low", segment="all", speculative=True)
  assert d["verdict"] == "roll back" and d["metric"] == "failure_rate"
  d = V.decide_cell(_cell(acceptance_rate=0.1), reps, G, tag="low", segment="all", speculative=True)
  assert d["verdict"] == "roll back" and d["metric"] == "acceptance_rate"
  assert V.decide_cell(_cell(acceptance_rate=0.1), reps, G, tag="low", segment="all",
                       speculative=False)["verdict"] == "neutral"
  assert V.decide_cell(_cell(oom=1), reps, G, tag="low", segment="all", speculative=True)["metric"] == "oom"
  thin = V.decide_cell(_cell(completed=2), reps, G, tag="low", segment="all", speculative=True)
  assert thin["verdict"] == "inconclusive" and "too few finished requests to judge" in thin["detail"]


def test_overall_inconclusive_unless_a_point_rolls_back():
  cell = lambda v: {"all": {"verdict": v, "detail": f"why {v}"}}
  o = V.overall({"a": {"c1": cell("keep"), "c4": cell("inconclusive")},
                 "b": {"c1": cell("roll back"), "c4": cell("inconclusive")},
                 "c": {"c1": cell("keep"), "c4": cell("neutral")}})
  assert o["a"]["overall"] == "inconclusive" and o["a"]["inconclusive"] == {"c4": "why inconclusive"}
  assert o["b"]["overall"] == "roll back" and o["c"]["overall"] == "keep"


def test_noise_widens_the_neutral_band():
  quiet = [_cell(tpot_mean=0.0090), _cell(tpot_mean=0.0091)]
  noisy = [_cell(tpot_mean=0.0070), _cell(tpot_mean=0.0110)]
  arm = _cell(tpot_mean=0.0075)
  assert V.decide_cell(arm, quiet, G, tag="low", segment="all", speculative=True)["verdict"] == "keep"
  assert V.decide_cell(arm, noisy, G, tag="low", segment="all", speculative=True)["verdict"] == "neutral"
  assert V.noise(noisy, "tpot_mean") == pytest.approx(0.004 / 0.009)


def test_metrics_from_the_servers_registry():
  from serve.engine.metrics import Metrics
  m = Metrics(k_max=3)
  before = M.Scrape(m.render().decode())
  m.num_drafts.inc(10)
  m.num_draft_tokens.inc(30)
  m.num_accepted_tokens.inc(12)
  for pos, n in ((0, 7), (1, 4), (2, 1)):
    m.accepted_per_pos.labels(position=str(pos)).inc(n)
  m.generation_tokens.inc(22)
  for v in (0.01, 0.03, 0.03, 0.07):
    m.ttft.observe(v)
  m.slots_in_use.set(3)
  after = M.Scrape(m.render().decode())
  d = M.delta(before, after)
  s = M.summarize_delta(d)
  sp = s["speculation"]
  assert (sp["drafts"], sp["draft_tokens"], sp["accepted_tokens"]) == (10, 30, 12)
  assert sp["acceptance_rate"] == pytest.approx(0.4) and sp["mean_acceptance_length"] == pytest.approx(2.2)
  assert sp["per_position"] == pytest.approx({0: 0.7, 1: 0.4, 2: 0.1})
  assert s["generation_tokens"] == 22
  assert s["server_ttft"]["count"] == 4 and s["server_ttft"]["mean"] == pytest.approx(0.035)
  assert 0.02 <= s["server_ttft"]["p50"] <= 0.04
  assert M.gauges(after)["slots_in_use"] == 3


def test_crosscheck_reads_the_servers_own_view_of_a_run():
  """The cross-check's server-side columns: engine ITL and TTFT means and the server's CPU seconds, as deltas of
  /metrics over one tool's run (process_* from prometheus_client's process collector in the server's registry)."""
  from benchmarks.probes.crosscheck_loadgen import server_view
  from serve.engine.metrics import Metrics
  m = Metrics(k_max=2)
  before = M.Scrape(m.render().decode())
  for v in (0.02, 0.04, 0.06):
    m.itl.observe(v)
  m.ttft.observe(0.5)
  t = time.process_time()
  while time.process_time() - t < 0.3:  # burn CPU that the process collector must see
    pass
  after = M.Scrape(m.render().decode())
  v = server_view(before, after, client_cpu_s=1.25)
  assert v["server_itl_mean"] == pytest.approx(0.04) and v["server_ttft_mean"] == pytest.approx(0.5)
  assert 0.2 <= v["server_cpu_s"] <= 5.0
  assert v["client_cpu_s"] == 1.25


def test_tuned_config_is_read_by_the_server():
  """Verdicts on all traffic only: one busy-slot band per concurrency, each with its best arm's k, as a policy the
  server's parser accepts (tests/serve/test_loadtest_tuner.py has the per-segment cases on a recorded matrix)."""
  from spec_jax.spec_config import from_dict, parse
  from spec_jax.spec_policy import Features
  pts = {"greedy/c1": LoadPoint("closed", 1, "c1", "greedy", "low"),
         "greedy/c4": LoadPoint("closed", 4, "c4 (peak)", "greedy", "peak"),
         "greedy/c8": LoadPoint("closed", 8, "c8 (overload)", "greedy", "overload")}
  arms = {"ng2": {"method": "ngram", "num_speculative_tokens": 2},
          "ng4": {"method": "ngram", "num_speculative_tokens": 4}}
  tok = {("ng2", "greedy/c1"): 130, ("ng4", "greedy/c1"): 150, ("ng2", "greedy/c4"): 220, ("ng4", "greedy/c4"): 205}
  cell = lambda v: {"output_tok_s": v, "completed": 20}
  stats = {a: {k: {"all": cell(tok.get((a, k), 90.0))} for k in pts} for a in arms}
  stats["baseline"] = {k: {"all": cell(100.0 if k == "greedy/c1" else 200.0)} for k in pts}
  # c8: ng2 neutral, ng4 rolls back (the guard of the band [4, 8): traffic at 8 clients is admitted at 4-7 busy).
  verd = {a: {k: {"all": {"verdict": "keep" if (a, k) in tok else
                          "neutral" if (a, k) == ("ng2", "greedy/c8") else "roll back", "metric": "tpot_mean"}}
              for k in pts} for a in arms}
  t = tuner.choose(stats, verd, pts, arms, ["baseline"], temperatures={"greedy": 0.0})
  assert t["config"]["policy"] == [
      {"match": {"temperature": "zero", "busy_slots": [1, 4]}, "num_speculative_tokens": 4},
      {"match": {"temperature": "zero", "busy_slots": [4, 8]}, "num_speculative_tokens": 2},
      {"match": {}, "num_speculative_tokens": 0}]
  assert [r["evidence"]["arms"] for r in t["rules"][:2]] == [["ng4"], ["ng2"]]
  sc = parse(json.dumps(t["config"]))
  assert sc.method == "ngram" and sc.k == 4
  pick = lambda busy, temp=0.0: sc.policy.pick(Features(temp, 10, 16, busy)).k
  assert [pick(a) for a in (1, 3, 4, 7, 8, 16)] == [4, 4, 2, 2, 0, 0] and pick(1, 0.7) == 0
  verd["ng2"]["greedy/c8"]["all"]["verdict"] = "roll back"  # now the guard turns [4, 8) off, though c4 keeps
  assert tuner.choose(stats, verd, pts, arms, ["baseline"], temperatures={"greedy": 0.0})["config"]["policy"] == [
      {"match": {"temperature": "zero", "busy_slots": [1, 4]}, "num_speculative_tokens": 4},
      {"match": {}, "num_speculative_tokens": 0}]
  verd["ng2"]["greedy/c8"]["all"]["verdict"] = "neutral"
  # With 4 slots, concurrency 8 runs at 4 busy slots too: one band [4, open) serves both, on only if an arm keeps
  # at both.
  t4 = tuner.choose(stats, verd, pts, arms, ["baseline"], slots=4, temperatures={"greedy": 0.0})
  assert t4["config"]["policy"] == [{"match": {"temperature": "zero", "busy_slots": [1, 4]},
                                     "num_speculative_tokens": 4}, {"match": {}, "num_speculative_tokens": 0}]
  assert from_dict(t4["config"]).policy.pick(Features(0.0, 10, 16, 4)).k == 0
  # Fewer requests than the floor: the cell does not count (the temperature alone has no backed cell either).
  thin = tuner.choose(stats, verd, pts, arms, ["baseline"], temperatures={"greedy": 0.0}, min_requests=21)
  assert thin["config"] == {} and thin["fallbacks"]
  none = tuner.choose(stats, {a: {k: {"all": {"verdict": "neutral"}} for k in pts} for a in arms}, pts, arms,
                      ["baseline"])
  assert none["config"] == {} and parse("{}").k == 0


def test_traffic_is_deterministic_and_balanced(tmp_path):
  # The built-in set is plain text; a file mixes plain prompts and Spec-Bench-style chat turns.
  assert not any(p.is_chat for p in load_prompts(""))
  f = tmp_path / "mixed.jsonl"
  f.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"text {i}"} if i % 2 else
                                  {"question_id": i, "category": "qa", "turns": [f"question {i}?"]}) + "\n"
                       for i in range(6)))
  prompts = load_prompts(str(f))
  assert [p.is_chat for p in prompts] == [True, False] * 3 and prompts[0].id == "0" and prompts[1].id == "p1"
  a = build_requests(prompts, 10, {"name": "greedy", "temperature": 0.0}, (16, 64), seed=3)
  b = build_requests(prompts, 10, {"name": "greedy", "temperature": 0.0}, (16, 64), seed=3)
  assert [(r.prompt.id, r.max_tokens, r.seed) for r in a] == [(r.prompt.id, r.max_tokens, r.seed) for r in b]
  assert {r.max_tokens for r in a} == {16, 64}
  assert any(r.prompt.is_chat for r in a) and a[0].body("m")["stream"] is True
  pts = load_points(8, [{"name": "greedy"}], open_rates=(2.0,))
  assert [(p.mode, p.level, p.tag) for p in pts] == [("closed", 1, "low"), ("closed", 4, "medium"),
                                                     ("closed", 8, "peak"), ("closed", 16, "overload"),
                                                     ("open", 2.0, "")]


def test_retry_traffic_sends_each_prompt_repeats_times_in_a_row_with_its_own_seeds():
  from serve.loadtest.traffic import PromptRec
  prompts = [PromptRec(str(i), "c", f"p{i}", False, i) for i in range(5)]
  plain = build_requests(prompts, 9, {"name": "g", "temperature": 0.0}, (16,), seed=1)
  retries = build_requests(prompts, 9, {"name": "r", "temperature": 0.7, "repeats": 3}, (16,), seed=1)
  ids = [r.prompt.id for r in retries]
  assert ids == [plain[0].prompt.id] * 3 + [plain[1].prompt.id] * 3 + [plain[2].prompt.id] * 3
  assert len({r.seed for r in retries}) == 9
  with pytest.raises(ValueError, match="repeats"):
    build_requests(prompts, 3, {"name": "r", "temperature": 0.0, "repeats": 0}, (16,), seed=1)


def test_prompt_splits_are_disjoint_halves_that_each_see_every_output_budget():
  from serve.loadtest.traffic import PromptRec, split_prompts
  prompts = [PromptRec(str(i), "c", f"p{i}", False, i) for i in range(10)]
  even, odd = split_prompts(prompts, "even", 2), split_prompts(prompts, "odd", 2)
  assert [p.index for p in even] == [0, 1, 4, 5, 8, 9] and [p.index for p in odd] == [2, 3, 6, 7]
  assert {p.index % 2 for p in even} == {p.index % 2 for p in odd} == {0, 1}  # both budgets (index % 2) in each
  assert split_prompts(prompts, "", 2) == prompts
  with pytest.raises(ValueError, match="prompt_split"):
    split_prompts(prompts, "third", 2)
