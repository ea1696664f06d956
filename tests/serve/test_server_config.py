"""The server's settings without a server: --speculative_config (inline, file, per concurrency), the per-occupancy
cost table it implies, and the guardrail state machine driven with explicit times."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve.engine.guardrails import BASELINE, OFF, ON, PROBE, GuardrailConfig, Guardrails
from serve.jobs.setup import FORBIDDEN_COST, cost_table, kv_cache_dtype_warning, load_target
from spec_jax.spec_config import parse


def test_vllm_keys_inline_and_from_a_file(tmp_path):
  sc = parse('{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5}')
  assert (sc.method, sc.k, sc.prompt_lookup_min, sc.prompt_lookup_max) == ("ngram", 6, 2, 5)
  path = tmp_path / "s.json"
  path.write_text(json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": "heads/x"}))
  sc = parse(str(path))
  assert (sc.method, sc.k, sc.model) == ("draft", 3, "heads/x")
  assert parse("{}").method == "none"  # empty means off
  assert parse(json.dumps(sc.to_json())) == sc  # what a run records reads back


@pytest.mark.parametrize("text,match", [
    ('{"method": "lookahead"}', "method"), ('{"num_speculative_tokens": -1}', "num_speculative_tokens"),
    ('{"speculative_tokens": 4}', "unknown keys"), ("/no/such/file.json", "neither inline JSON"),
    ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"per_concurrency": {"1": {"method": "ngram"}, "4": {"method": "eagle"}}}', "one proposer"),
    ('{"per_concurrency": {"zero": {}}}', "concurrency levels"), ("{bad json", "invalid JSON")])
def test_bad_speculative_configs_are_refused(text, match):
  with pytest.raises(ValueError, match=match):
    parse(text)


def test_per_concurrency_bands_and_cost_table():
  sc = parse(json.dumps({"per_concurrency": {
      "1": {"method": "ngram", "num_speculative_tokens": 4}, "4": {"num_speculative_tokens": 2},
      "8": {"num_speculative_tokens": 0}}}))
  assert (sc.method, sc.k) == ("ngram", 4)
  assert [sc.k_at(a) for a in (1, 2, 3, 4, 7, 8, 16)] == [4, 4, 4, 2, 2, 0, 0]
  ks = (0, 2, 4)
  table = cost_table(sc, ks, 8)
  assert table.shape == (8, 3)
  np.testing.assert_allclose(table[0], [1.0, 1.5, 2.0])  # the default cost model where every k is allowed
  assert table[3, 2] == FORBIDDEN_COST and table[3, 1] == 1.5  # occupancy 4: k = 4 is never picked
  assert (table[7, 1:] == FORBIDDEN_COST).all()  # occupancy 8: only k = 0
  base = np.arange(24, dtype=np.float32).reshape(8, 3) + 1  # a calibrated table keeps its allowed entries
  t2 = cost_table(sc, ks, 8, base)
  assert t2[0, 2] == 3 and t2[4, 1] == 14 and t2[4, 2] == FORBIDDEN_COST


def test_guardrail_config_parse():
  assert GuardrailConfig.parse(None) is None and GuardrailConfig.parse("") is None
  assert GuardrailConfig.parse('{"acceptance_floor": 0.2}').acceptance_floor == 0.2
  for bad in ('{"acceptance_flor": 0.2}', '{"acceptance_floor": "high"}', '{"cooldown_s": 5}'):
    with pytest.raises(ValueError):
      GuardrailConfig.parse(bad)


def test_acceptance_guardrail_trips_only_after_the_hold_time_then_probes():
  g = Guardrails(GuardrailConfig(acceptance_floor=0.5, acceptance_window_s=2, acceptance_for_s=3, min_drafted=10,
                                 cooldown_s=5, probe_s=1), now=0.0)
  t = 0.0
  events = []
  while t < 20:
    # Acceptance 0.2 until t = 10, then 0.9.
    acc = 2 if t < 10 else 9
    if g.speculation_on:
      g.observe(t, 10, acc, [])
    e = g.decide(t)
    if e:
      events.append((round(t, 1), e))
    t += 0.5
  assert events[0] == (3.0, (False, "acceptance_floor"))  # below the floor since t = 0, held for 3 s
  assert events[1] == (8.0, (True, "probe"))  # after the 5 s cool-down
  assert events[2] == (9.0, (False, "probe_failed_acceptance"))  # still 0.2 during the probe
  assert events[3] == (14.0, (True, "probe"))
  assert events[4] == (15.0, (True, "probe_passed"))  # 0.9 now
  assert g.mode == ON and len(events) == 5


def test_itl_guardrail_measures_a_baseline_window_first():
  g = Guardrails(GuardrailConfig(itl_p95_ratio=1.2, itl_window_s=2, min_itl_samples=8, baseline_window_s=1,
                                 baseline_every_s=100, cooldown_s=10), now=0.0)
  g.observe(0.0, 0, 0, [0.05] * 8)  # traffic with speculation on, no baseline yet: cannot judge
  assert g.decide(0.1) == (False, "baseline_window") and g.mode == BASELINE
  g.observe(0.5, 0, 0, [0.010] * 20)  # k = 0 steps: 10 ms per token
  assert g.decide(0.6) is None
  assert g.decide(1.2) == (True, "baseline_done") and g.baseline_p95 == pytest.approx(0.010)
  g.observe(1.5, 0, 0, [0.011] * 10)  # 1.1x the baseline: within 1.2x
  assert g.decide(1.6) is None and g.mode == ON
  g.observe(2.0, 0, 0, [0.020] * 30)  # 2x: trip
  assert g.decide(2.1) == (False, "itl_p95") and g.mode == OFF
  assert g.decide(5.0) is None and g.decide(12.2) == (True, "probe") and g.mode == PROBE


@pytest.mark.parametrize("dtype,backend,warned", [
    ("fp8", "cpu", True), ("fp8_e4m3", "cpu", True), ("fp8_e5m2", "cpu", False), ("int8", "cpu", False),
    ("auto", "cpu", False), ("fp8", "tpu", False), ("fp8", "gpu", False)])
def test_an_fp8_e4m3_cache_on_cpu_is_warned_about(dtype, backend, warned):
  text = kv_cache_dtype_warning(dtype, backend)
  assert (text is not None) == warned
  if warned:
    assert "int8" in text and dtype in text


def test_the_run_setup_logs_the_fp8_warning_before_loading_the_model(tmp_path, caplog):
  cfg = dict(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=8, mesh="", attention_impl="xla",
             kv_cache_dtype="fp8", model=str(tmp_path / "missing.gguf"), dtype="float32", quantize="none")
  with caplog.at_level("WARNING", logger="spec_jax.setup"), pytest.raises(FileNotFoundError):
    load_target(cfg)  # the model is missing: the warning comes first
  assert any("converted in software on CPU" in r.getMessage() for r in caplog.records)
