"""Speculation per traffic segment in the live server: the speculative config's policy decides per request, the
metrics are split by segment and arm, switchback windows alternate at their share, the live report says keep or
roll back per segment, its guardrails switch a losing segment off alone, and a canary takes its share by content."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.serve.test_server import MODEL, metric, reference_greedy, tiny_model, tiny_server  # noqa: F401 (a fixture)

POLICY = {"method": "ngram", "num_speculative_tokens": 4,
          "policy": [{"match": {"temperature": "zero"}, "num_speculative_tokens": 4, "name": "greedy"},
                     {"match": {"segment": "code"}, "num_speculative_tokens": 2, "name": "code"},
                     {"match": {"segment": "structured"}, "num_speculative_tokens": 2, "name": "structured"},
                     {"match": {}, "num_speculative_tokens": 0, "name": "sampled"}]}
PROMPTS = ["the cat sat on the mat", "a a a a a a a a", "dog dog dog ran", "the the the"]


def _seg(m, name, segment, arm="on", **labels):
  return metric(m, name, segment=segment, arm=arm, **labels)


def test_policy_drafts_only_for_its_segments_and_greedy_stays_exact(tiny_model):  # noqa: F811
  s = tiny_server(tiny_model, f"--speculative_config={json.dumps(POLICY)}", "--noadaptive")  # k = the cap each step
  try:
    with s.http() as h:
      status = h.get("/admin/speculation").json()
      assert [r["name"] for r in status["policy"]] == ["greedy", "code", "structured", "sampled"]
      outs = {}
      for p in PROMPTS:
        for kind, extra in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 1.0, "seed": 7}),
                            ("code", {"temperature": 1.0, "segment": "code"})):
          r = h.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 24, "return_token_ids": True,
                                              **extra})
          assert r.status_code == 200, r.text
          body = r.json()
          outs[(kind, p)] = body
          if kind == "greedy":
            assert body["usage"]["completion_tokens"] == 24  # sampled text may sample a stop token
          if kind == "sampled":
            assert body["usage"]["drafted_tokens"] == 0, "the policy's default rule: no drafts for sampled requests"
      for p in PROMPTS:
        assert outs[("greedy", p)]["choices"][0]["token_ids"] == reference_greedy(tiny_model, p, 24)
      assert sum(outs[("greedy", p)]["usage"]["drafted_tokens"] for p in PROMPTS) > 0
      assert sum(outs[("code", p)]["usage"]["drafted_tokens"] for p in PROMPTS) > 0
      # a request with a grammar and no tag is in the "structured" segment; its own tag wins
      for extra in ({}, {"segment": "code"}):
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "the cat", "max_tokens": 8, "temperature": 1.0,
                                            "guided_regex": "[a-z]{2,6}", **extra})
        assert r.status_code == 200, r.text
      # a bad tag type is a 400 naming the field
      r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "segment": 3})
      assert r.status_code == 400 and "segment" in r.text
    m = s.metrics()
    drafted = lambda seg: _seg(m, "spec_jax:segment_spec_decode_num_draft_tokens_total", seg)
    assert drafted("greedy") > 0 and drafted("code") > 0 and drafted("sampled") == 0
    assert _seg(m, "spec_jax:segment_generation_tokens_total", "sampled") == sum(
        outs[("sampled", p)]["usage"]["completion_tokens"] for p in PROMPTS)
    assert _seg(m, "spec_jax:segment_requests_total", "greedy", outcome="finished") == len(PROMPTS)
    assert _seg(m, "spec_jax:segment_requests_total", "structured", outcome="finished") == 1
    assert _seg(m, "spec_jax:segment_requests_total", "code", outcome="finished") == len(PROMPTS) + 1
    assert _seg(m, "spec_jax:segment_requests_total", "sampled", outcome="finished") == len(PROMPTS)
    assert _seg(m, "spec_jax:segment_inter_token_latency_seconds_count", "greedy") > 0
    # the k = 2 rule never drafts a third token: per-position counters of the code rows stop at position 1
    per_step = (_seg(m, "spec_jax:segment_spec_decode_num_draft_tokens_total", "code") /
                _seg(m, "spec_jax:segment_verify_steps_total", "code"))
    assert 0 < per_step <= 2.0
  finally:
    assert s.stop() == 0, s.log()[-3000:]


def test_sampled_requests_the_policy_turns_off_equal_a_server_without_speculation(tiny_model):  # noqa: F811
  """The engine's sampling stream is one per batch (a request's seed draws its first token), so two fresh servers
  given the same sampled requests in the same order produce the same tokens: with the policy's "sampled: off" they
  equal a server that never speculates."""
  outs = []
  for spec in (POLICY, {}):
    s = tiny_server(tiny_model, f"--speculative_config={json.dumps(spec)}", "--noadaptive")
    try:
      with s.http() as h:
        got = []
        for i, p in enumerate(PROMPTS):
          r = h.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 20, "temperature": 1.0,
                                              "seed": 100 + i, "return_token_ids": True}).json()
          assert r["usage"]["drafted_tokens"] == 0
          got.append(r["choices"][0]["token_ids"])
        outs.append(got)
    finally:
      assert s.stop() == 0, s.log()[-3000:]
  assert outs[0] == outs[1]
  assert len({tuple(x) for x in outs[0]}) == len(PROMPTS)  # really sampled: different prompts, different text


def test_an_invalid_policy_is_an_error_at_start_naming_the_rule(tiny_model):  # noqa: F811
  bad = {"method": "ngram", "policy": [{"match": {"temperature": "warm"}, "num_speculative_tokens": 4},
                                       {"match": {}, "num_speculative_tokens": 0}]}
  with pytest.raises(RuntimeError, match=r"exited with 2:\s+error: --speculative_config: policy\[0\]: temperature"):
    tiny_server(tiny_model, f"--speculative_config={json.dumps(bad)}", timeout=120)


def _traffic(s, stop: threading.Event, temperature: float, errors: list):
  c = s.client()
  i = 0
  while not stop.is_set():
    try:
      c.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=32, temperature=temperature,
                           seed=i)
    except Exception as e:  # noqa: BLE001 (reported by the test)
      errors.append(repr(e))
    i += 1


def test_switchback_live_report_and_per_segment_guardrails_with_a_planted_slow_proposer(tiny_model):  # noqa: F811
  """slow_repeat burns compute per draft: greedy rows (runs of one token, drafts accepted) still win, sampled rows
  (drafts rejected) lose. Under steady mixed traffic the windows alternate at their share, the live report rolls
  the sampled segment back, and its guardrails switch it off while greedy keeps speculating."""
  spec = {"method": "slow_repeat", "num_speculative_tokens": 4,
          "policy": [{"match": {"temperature": "zero"}, "num_speculative_tokens": 4, "name": "greedy"},
                     {"match": {}, "num_speculative_tokens": 4, "name": "sampled"}]}
  switchback = {"window_s": 0.4, "off_share": 0.5, "block": 4, "min_windows": 6, "min_tokens": 256}
  s = tiny_server(tiny_model, "--noadaptive", "--plugins=tests.proposers.toy_slow",
                  f"--speculative_config={json.dumps(spec)}", f"--switchback={json.dumps(switchback)}",
                  '--guardrails={"live_ab": true, "cooldown_s": 600}')
  stop, errors = threading.Event(), []
  threads = [threading.Thread(target=_traffic, args=(s, stop, t, errors)) for t in (0.0, 0.0, 1.0, 1.0)]
  for t in threads:
    t.start()
  try:
    end = time.time() + 150
    tripped = False
    while time.time() < end and not tripped:
      time.sleep(1.0)
      m = s.metrics()
      tripped = any(metric(m, "spec_jax:speculation_switches_total", segment="sampled", enabled="false",
                           reason=f"live_ab_{x}") for x in ("itl_p95", "tpot_mean", "failure_rate"))
    with s.http() as h:
      report = h.get("/admin/speculation/report").json()
    time.sleep(2.0)  # the switched-off segment drafts no more
    m1 = s.metrics()
  finally:
    stop.set()
    for t in threads:
      t.join()
    assert s.stop() == 0, s.log()[-3000:]
  assert not errors, errors[:3]
  assert tripped, (json.dumps(report, indent=1)[:4000], s.log()[-3000:])
  assert metric(m1, "spec_jax:segment_speculation_enabled", segment="sampled") == 0
  assert metric(m1, "spec_jax:segment_speculation_enabled", segment="greedy") == 1, (
      json.dumps(report["segments"]["greedy"], indent=1), s.log()[-3000:])
  g = report["segments"]["greedy"]
  assert g["enabled"] and g["verdict"] != "roll back", g
  assert report["segments"]["sampled"]["enabled"] is False
  sw = report["switchback"]
  on, off = sw["windows"]["on"], sw["windows"]["off"]
  assert on + off >= 8 and abs(on - off) <= 2, sw  # blocks of 4 with 2 off each, in a random order
  assert metric(m1, "spec_jax:switchback_windows_total", arm="off") > 0
  both = [_seg(m1, "spec_jax:segment_generation_tokens_total", "greedy", arm=a) for a in ("on", "off")]
  assert min(both) > 0, "greedy tokens came from both arms"
  assert "guardrails[sampled]: speculation off (live_ab_" in s.log()


def test_canary_takes_its_share_by_content_and_the_report_compares_the_arms(tiny_model):  # noqa: F811
  spec = {"method": "ngram", "num_speculative_tokens": 4, "policy": [{"match": {}, "num_speculative_tokens": 0}],
          "canary": {"fraction": 0.5, "policy": [{"match": {}, "num_speculative_tokens": 4, "name": "all"}]}}
  s = tiny_server(tiny_model, f"--speculative_config={json.dumps(spec)}", "--noadaptive")
  try:
    with s.http() as h:
      arms = {}
      for i in range(16):
        prompt = f"the cat {'sat ' * (i % 5)}on the mat {i}"
        runs = [h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                "seed": seed}).json()["usage"]["drafted_tokens"] for seed in (1, 2)]
        assert (runs[0] > 0) == (runs[1] > 0), "a retry lands in the same arm"
        arms[prompt] = runs[0] > 0
      assert 0 < sum(arms.values()) < len(arms)  # both arms got requests
      report = h.get("/admin/speculation/report").json()
    c = report["canary"]
    assert c["fraction"] == 0.5 and set(c["segments"]) == {"all"}
    cell = c["segments"]["all"]["arms"]
    assert cell["canary"]["output_tokens"] == 2 * 16 * sum(arms.values())  # greedy: never a stop token
    assert cell["stable"]["output_tokens"] == 2 * 16 * (len(arms) - sum(arms.values()))
    assert cell["canary"]["drafted_tokens"] > 0 and cell["stable"]["drafted_tokens"] == 0
  finally:
    assert s.stop() == 0, s.log()[-3000:]
