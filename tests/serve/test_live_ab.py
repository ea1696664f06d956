"""The live A/B's bookkeeping, driven with explicit times and observations: the switchback schedule keeps its
share in a random order, the verdict reads windows as units (keep, roll back, neutral with too few samples), a
reset forgets, and the guardrails switch one segment off on a live roll-back."""

import numpy as np
import pytest

from serve.engine.guardrails import OFF, ON, PROBE, GuardrailConfig, Guardrails
from serve.engine.live_ab import CANARY, STABLE, LiveAB, Schedule, SwitchbackConfig, content_key
from serve.engine.request_spec import RequestSpec, Sampling


def test_schedule_holds_the_share_per_block_in_a_random_order():
  cfg = SwitchbackConfig(window_s=2.0, off_share=0.25, block=8, seed=3)
  s = Schedule(cfg, t0=100.0)
  arms = [s.arm(i) for i in range(80)]
  for b in range(10):
    assert arms[8 * b:8 * b + 8].count("off") == 2
  assert arms[:8] != arms[8:16] or arms[8:16] != arms[16:24]  # shuffled per block, not one fixed pattern
  assert s.window(100.0) == 0 and s.window(103.9) == 1 and s.window(99.0) == 0
  assert s.count("off", 0, 79) == 20 and s.count("on", 0, 7) == 6
  assert [Schedule(cfg, 0.0).arm(i) for i in range(16)] == arms[:16]  # seeded: reproducible


@pytest.mark.parametrize("text, msg", [
    ('{"off_share": 1.0}', "off_share must be in"), ('{"window": 5}', "unknown keys"),
    ('{"off_share": 0.01}', "leaves no off"), ('{"window_s": "5"}', "must be a number"),
])
def test_bad_switchback_configs(text, msg):
  with pytest.raises(ValueError, match=msg):
    SwitchbackConfig.parse(text)
  assert SwitchbackConfig.parse(None) is None
  assert SwitchbackConfig.parse('{"window_s": 1}').window_s == 1.0


def _feed(ab, seg, on_itl, off_itl, windows=12, per=40, seed=0, jitter=0.1):
  """Alternate windows; each window's ITL samples around the arm's mean (a window-level shift as noise)."""
  rng = np.random.default_rng(seed)
  for w in range(windows):
    arm = "on" if w % 2 == 0 else "off"
    mean = on_itl if arm == "on" else off_itl
    shift = 1.0 + jitter * rng.standard_normal()
    itl = list(mean * shift * (1.0 + 0.05 * rng.standard_normal(per)))
    ab.add(seg, arm, w, tokens=per, itl=itl, steps=per // (3 if arm == "on" else 1), finished=1)


def test_verdict_keeps_a_clear_gain_rolls_back_a_clear_loss_and_waits_for_samples():
  cfg = SwitchbackConfig(window_s=1.0, min_windows=4, min_tokens=64, resamples=200)
  ab = LiveAB(cfg)
  _feed(ab, "greedy", on_itl=0.010, off_itl=0.020)
  _feed(ab, "sampled", on_itl=0.030, off_itl=0.020, seed=1)
  _feed(ab, "level", on_itl=0.020, off_itl=0.020, seed=2, jitter=0.3)
  _feed(ab, "thin", on_itl=0.010, off_itl=0.020, windows=4)
  g, s, lv, th = (ab.verdict(x) for x in ("greedy", "sampled", "level", "thin"))
  assert g["verdict"] == "keep" and g["metric"] == "tpot_mean"
  assert g["interval"][1] < 0.97 and g["interval"][0] <= g["ratio"] <= g["interval"][1]
  assert s["verdict"] == "roll back" and s["metric"] in ("itl_p95", "tpot_mean") and s["interval"][0] > 1.03
  assert lv["verdict"] == "neutral"
  assert th["verdict"] == "neutral" and th["metric"] == "samples"  # 2 windows per arm < 4
  assert g["counts"]["on_windows_with_data"] == 6 and g["counts"]["off_output_tokens"] == 240
  cell = ab.cell("greedy", "on")
  assert cell["acceptance_length"] == pytest.approx(3.0, rel=0.05) and cell["finished"] == 6
  ab.reset("greedy", window=11)
  assert ab.verdict("greedy")["metric"] == "samples" and ab.cell("greedy", "on")["output_tokens"] == 0
  ab.add("greedy", "on", 5, tokens=99)  # produced before the reset: ignored
  assert ab.cell("greedy", "on")["output_tokens"] == 0


def test_more_failures_roll_back():
  ab = LiveAB(SwitchbackConfig(window_s=1.0, min_windows=4, min_tokens=64, resamples=50))
  _feed(ab, "s", on_itl=0.010, off_itl=0.020)
  ab.add("s", "on", 0, failed=2)
  v = ab.verdict("s")
  assert v["verdict"] == "roll back" and v["metric"] == "failure_rate"


def test_canary_arms_compare_the_same_way():
  ab = LiveAB(SwitchbackConfig(window_s=1.0, min_windows=4, min_tokens=64, resamples=100), CANARY, STABLE)
  rng = np.random.default_rng(0)
  for w in range(8):
    for arm, mean in ((CANARY, 0.010), (STABLE, 0.020)):
      ab.add("default", arm, w, tokens=30, itl=list(mean * (1 + 0.05 * rng.standard_normal(30))))
  assert ab.verdict("default")["verdict"] == "keep"
  spec = lambda ids, seed=0: RequestSpec(prompt_ids=tuple(ids), max_new=8, sampling=Sampling(seed=seed))
  assert content_key(spec([1, 2])) == content_key(spec([1, 2], seed=5))  # a retry (another seed): the same arm
  assert content_key(spec([1, 2])) != content_key(spec([2, 1]))
  # the key's bytes as they were before the spec had named fields: no request changes its canary arm
  assert content_key(spec([1, 2])) == b"8|0|0|1||" + np.asarray([1, 2], np.int64).tobytes()


def test_guardrails_trip_on_a_live_roll_back_and_probe_later():
  cfg = GuardrailConfig(live_ab=True, cooldown_s=10, probe_s=2)
  g = Guardrails(cfg, now=0.0)
  assert g.decide(1.0, {"verdict": "keep", "metric": "tpot_mean"}) is None
  assert g.decide(2.0, None) is None
  assert g.decide(3.0, {"verdict": "roll back", "metric": "itl_p95"}) == (False, "live_ab_itl_p95")
  assert g.mode == OFF
  assert g.decide(14.0, None) == (True, "probe") and g.mode == PROBE
  assert GuardrailConfig.parse('{"live_ab": true}').live_ab
  with pytest.raises(ValueError, match="live_ab must be"):
    GuardrailConfig.parse('{"live_ab": 1}')
  off = Guardrails(GuardrailConfig(acceptance_floor=0.1), now=0.0)  # without live_ab the live verdict is not read
  assert off.decide(1.0, {"verdict": "roll back", "metric": "itl_p95"}) is None and off.mode == ON
