"""Sampling controls through the API with speculation on: greedy output with penalties, logit_bias, min_p,
min_tokens and stop_token_ids equals a server without speculation, and bad values are a 400 naming the field."""

from __future__ import annotations

import json

from tests.serve.test_server import MODEL, tiny_model, tiny_server  # noqa: F401 (a fixture)

PROMPTS = ["the cat sat on the mat", "a a a a a a a a", "dog dog dog ran"]
CONTROLS = [{"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
            {"logit_bias": {"300": 5.0, "301": 4.0}, "min_p": 0.1},
            {"min_tokens": 6, "stop_token_ids": [44, 165, 162], "ignore_eos": True}]


def _run(s, extra):
  out = []
  with s.http() as h:
    for p in PROMPTS:
      r = h.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0,
                                          "return_token_ids": True, **extra})
      assert r.status_code == 200, r.text
      body = r.json()
      out.append((body["choices"][0]["token_ids"], body["choices"][0]["finish_reason"],
                  body["usage"]["drafted_tokens"]))
  return out


def test_controls_with_and_without_speculation_agree(tiny_model):  # noqa: F811
  results = {}
  for name, spec in (("spec", {"method": "ngram", "num_speculative_tokens": 4}), ("plain", {})):
    s = tiny_server(tiny_model, f"--speculative_config={json.dumps(spec)}", "--noadaptive")
    try:
      results[name] = [_run(s, {})] + [_run(s, c) for c in CONTROLS]
      if name == "spec":
        with s.http() as h:
          for bad, field in (({"presence_penalty": 3}, "presence_penalty"), ({"min_p": 2}, "min_p"),
                             ({"logit_bias": {"999999": 1}}, "logit_bias"),
                             ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"min_tokens": 99}, "min_tokens")):
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **bad})
            assert r.status_code == 400 and field in r.text, (bad, r.text)
    finally:
      assert s.stop() == 0, s.log()[-3000:]
  for i, (spec_run, plain_run) in enumerate(zip(results["spec"], results["plain"])):
    assert [x[:2] for x in spec_run] == [x[:2] for x in plain_run], f"controls {i}"
    if i:
      assert [x[0] for x in spec_run] != [x[0] for x in results["spec"][0]], f"controls {i} change the output"
  assert sum(x[2] for run in results["spec"] for x in run) > 0
