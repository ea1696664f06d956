"""Acceptance is watched across a change of KV cache dtype (issue 46): the guardrail that rolls speculation back when
the 8-bit cache's tau falls more than kv_tau_margin below the tau recorded under `auto`, and the load matrix's table
of tau beside `auto`. Pure bookkeeping: no model, well under a second."""

from __future__ import annotations

import pytest

from serve.engine.guardrails import OFF, ON, PROBE, GuardrailConfig, Guardrails, SpeculationSwitch
from serve.loadtest import report_kv
from serve.loadtest.analyze import fixed_settings
from serve.loadtest.matrix import arm_flags, arm_kv_dtype, arm_list
from serve.engine.metrics import Metrics


def _feed(g, t, tau, k=4, drafts=4):
  """`drafts` verify steps of k drafted tokens each at tau = 1 + accepted / drafts."""
  g.observe(t, k * drafts, round((tau - 1.0) * drafts), [], drafts)


def test_the_kv_tau_trip_uses_a_relative_margin_on_tau_and_holds_then_probes():
  cfg = GuardrailConfig(kv_tau_baseline=3.0, kv_tau_margin=0.1, acceptance_window_s=2, acceptance_for_s=3,
                        min_drafted=8, cooldown_s=5, probe_s=1)
  g = Guardrails(cfg, now=0.0, tau_baseline=3.0)
  t, events = 0.0, []
  while t < 30:
    # tau 2.75 (inside 10 % of 3.0; an absolute margin of 0.1 or a margin on the acceptance rate would trip)
    # until t = 6, then 2.5 (below 2.7) until t = 20, then 3.0.
    tau = 2.75 if t < 6 else 2.5 if t < 20 else 3.0
    if g.speculation_on:
      _feed(g, t, tau)
    e = g.decide(t)
    if e:
      events.append((t, e))
    t += 0.5
  # The 2 s window's tau is 2.7 at t = 6 (not below), 2.65 at 6.5: held 3 s -> off at 9.5.
  assert events[0] == (9.5, (False, "kv_dtype_tau")), events
  assert events[1] == (14.5, (True, "probe"))
  assert events[2] == (15.5, (False, "probe_failed_kv_dtype_tau"))
  assert events[3] == (20.5, (True, "probe"))
  assert events[4] == (21.5, (True, "probe_passed"))
  assert g.mode == ON and len(events) == 5


def test_tau_is_one_plus_accepted_per_drafting_step():
  g = Guardrails(GuardrailConfig(kv_tau_baseline=2.0, min_drafted=4), now=0.0, tau_baseline=2.0)
  assert g.tau(0.0) is None  # nothing drafted: unknown, never a trip
  g.observe(0.0, 12, 6, [], 3)  # 3 steps of k = 4, 6 accepted: tau 3.0 (not 1 + 6 / 12)
  assert g.tau(0.1) == pytest.approx(3.0)


def _switch(kv, base, segments=("default",)):
  cfg = GuardrailConfig.parse(f'{{"kv_tau_baseline": {base}, "kv_tau_margin": 0.05, "acceptance_for_s": 0, '
                              f'"min_drafted": 4, "acceptance_window_s": 5}}')
  return SpeculationSwitch(cfg, None, 4, Metrics(k_max=4), segments, 0.0, kv_cache_dtype=kv)


def test_only_an_8bit_cache_arms_the_trip_and_status_shows_the_live_tau():
  for kv, trips in (("auto", False), ("int8", True), ("fp8", True)):
    sw = _switch(kv, 3.0)
    sw.observe("default", 1.0, 16, 4, [], 4)  # tau 2.0, far below 3.0
    events = sw.tick(1.0)
    assert (events == [("default", False, "kv_dtype_tau")]) == trips, (kv, events)
    st = sw.status(0, now=1.0)
    assert st["kv_cache_dtype"] == kv and st["guardrails"]["default"]["tau"] == pytest.approx(2.0)
    assert st["guardrails"]["default"]["kv_tau_baseline"] == (3.0 if trips else None)
  sw = _switch("int8", '{"short": 3.0}', segments=("short", "long"))  # a segment without a baseline: no trip
  sw.observe("long", 1.0, 16, 4, [], 4)
  sw.observe("short", 1.0, 16, 4, [], 4)
  assert sw.tick(1.0) == [("short", False, "kv_dtype_tau")] and sw.guards["long"].mode == ON
  assert sw.guards["short"].mode == OFF and sw.guards["short"].decide(100.0) == (True, "probe")
  assert sw.guards["short"].mode == PROBE


@pytest.mark.parametrize("bad,msg", [('{"kv_tau_baseline": 0.5}', "tau >= 1"),
                                     ('{"kv_tau_baseline": {"a": "x"}}', r"kv_tau_baseline\['a'\]"),
                                     ('{"kv_tau_baseline": 2, "kv_tau_margin": 1}', r"kv_tau_margin must be in \[0, 1\)"),
                                     ('{"kv_tau_margin": 0.1}', "set acceptance_floor")])
def test_bad_kv_guardrail_settings_are_refused(bad, msg):
  with pytest.raises(ValueError, match=msg):
    GuardrailConfig.parse(bad)


def test_a_baseline_for_a_segment_the_policy_lacks_is_refused():
  with pytest.raises(ValueError, match=r"names segments \['other'\]"):
    _switch("int8", '{"other": 2.0}', segments=("default",))


def _res(spec, kv, tau, rate, baseline=False):
  sp = {"mean_acceptance_length": tau, "acceptance_rate": rate}
  return {"speculative_config": spec, "kv_cache_dtype": kv, "baseline": baseline,
          "points": {"c1": {"metrics": {"speculation": sp}}}}


def test_the_matrix_reports_each_8bit_arm_beside_the_auto_arm_of_the_same_config():
  ng, ea = {"method": "ngram", "num_speculative_tokens": 4}, {"method": "eagle", "num_speculative_tokens": 2}
  results = {"baseline": _res({}, "auto", None, None, baseline=True),
             "ngram": _res(ng, "auto", 2.0, 0.25), "eagle": _res(ea, "auto", 2.5, 0.75),
             "eagle-int8": _res(ea, "int8", 2.4, 0.70), "ngram-fp8": _res(ng, "fp8", 2.1, 0.275),
             "medusa-int8": _res({"method": "medusa"}, "int8", 1.5, 0.1)}
  points = {"c1": {"label": "c=1", "sampling": "greedy"}}
  assert report_kv.auto_partner(results, "eagle-int8") == "eagle"
  assert report_kv.auto_partner(results, "ngram-fp8") == "ngram"
  text = "\n".join(report_kv.dtype_section(results, points))
  assert "| c=1 [greedy] | eagle-int8 (int8) | eagle | 2.40 | 2.50 | -4.0% | 0.70 | 0.75 |" in text
  assert "| c=1 [greedy] | ngram-fp8 (fp8) | ngram | 2.10 | 2.00 | +5.0% | 0.28 | 0.25 |" in text
  assert "| medusa-int8 (int8) | none with this config | 1.50 | – | – |" in text
  assert report_kv.dtype_section({k: results[k] for k in ("baseline", "ngram")}, points) == []


def test_an_arm_runs_its_own_kv_dtype_and_the_fixed_settings_check_allows_only_that():
  cfg = {"server": {"flags": {"model": "m", "max_num_seqs": 4}}, "arms": [
      {"name": "e", "speculative_config": {"method": "eagle"}},
      {"name": "e8", "speculative_config": {"method": "eagle"}, "kv_cache_dtype": "int8"}]}
  arms = {a["name"]: a for a in arm_list(cfg)}
  assert "kv_cache_dtype" not in arm_flags(arms["e"], cfg)
  assert arm_flags(arms["e8"], cfg) == {"model": "m", "max_num_seqs": 4, "kv_cache_dtype": "int8"}
  assert arm_kv_dtype(arms["e8"], cfg, {}) == "int8" and arm_kv_dtype(arms["e"], cfg, {}) == "auto"
  assert arm_kv_dtype(arms["e"], cfg, {"speculation": {"kv_cache_dtype": "fp8"}}) == "fp8"  # what the server says
  with pytest.raises(ValueError, match="unknown --kv_cache_dtype 'fp4'"):
    arm_list(dict(cfg, arms=[{"name": "x", "kv_cache_dtype": "fp4"}]))
  argv = lambda extra: {"server": {"argv": ["-m", "serve.server", "--model=m", "--port=1"] + extra,
                                   "launched": True}}
  run = {"config": {}}
  same = fixed_settings(run, {"e": argv([]), "e8": argv(["--kv_cache_dtype=int8"])})
  assert same["identical"]
  other = fixed_settings(run, {"e": argv([]), "e8": argv(["--kv_cache_dtype=int8", "--max_num_seqs=8"])})
  assert other["differences"] == ["--max_num_seqs=8"]
