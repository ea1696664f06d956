"""Issue 36, items 3 and 4 through the API: logprobs, top_logprobs and echo (completions and chat, streamed or
not), n > 1 and prompt lists. A server with n-gram speculation and one without answer the same greedy requests
with the same tokens and logprobs (within float32 noise); the echoed prompt's logprobs are the model's own."""

from __future__ import annotations

import json

import numpy as np

from tests.serve.test_server import MODEL, _loaded, tiny_model, tiny_server  # noqa: F401 (a fixture)

PROMPTS = ["the cat sat on the mat", "a a a a a a a a dog"]
LONG = "the cat sat on the mat " * 4  # 93 tokens of the tiny vocabulary


def _sse(h, path, body):
  """-> the chunks of a streamed answer."""
  chunks = []
  with h.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        chunks.append(json.loads(line[6:]))
  return chunks


def _queries(s):
  """The same requests against one server -> their answers (plain JSON)."""
  out = {}
  with s.http() as h:
    post = lambda path, body: h.post(path, json={"model": MODEL, "temperature": 0, **body})
    r = post("/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 8, "logprobs": 3, "echo": True,
                                 "return_token_ids": True, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    out["completions"] = r.json()
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
                                      "logprobs": True, "top_logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    out["chat"] = r.json()
    out["chat_stream"] = _sse(h, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "n": 2,
                                                          "messages": [{"role": "user", "content": PROMPTS[0]}],
                                                          "max_tokens": 8, "logprobs": True, "top_logprobs": 2})
    out["completions_stream"] = _sse(h, "/v1/completions", {"model": MODEL, "temperature": 0, "prompt": PROMPTS[1],
                                                            "max_tokens": 8, "logprobs": 1, "echo": True})
    # sampled, seeded: the n samples are independent draws
    body = {"prompt": PROMPTS[0], "n": 4, "max_tokens": 12, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    a, b = post("/v1/completions", body).json(), post("/v1/completions", body).json()
    out["sampled"] = (a, b)
    # best_of: the n = 2 of best_of = 4 samples with the highest cumulative logprob; the same seed's n = 4 with
    # logprobs are those samples (sample i is stream seed + i)
    best = post("/v1/completions", {**body, "n": 2, "best_of": 4, "return_token_ids": True})
    assert best.status_code == 200, best.text
    out["best_of"] = (best.json(), post("/v1/completions", {**body, "logprobs": 0}).json())
    # n = 4 of one long prompt: choices 1-3 reuse choice 0's full prompt pages (the prefix cache), prefilling
    # only the rest; same greedy choices
    before = h.get("/admin/speculation").json()
    r = post("/v1/completions", {"prompt": LONG, "n": 4, "max_tokens": 4, "return_token_ids": True})
    after = h.get("/admin/speculation").json()
    out["shared"] = (r.json(), after["prefix_cache_hits"] - before["prefix_cache_hits"], after["kv_block_size"])
    # bad input: a 400 naming the field
    for bad, field, path in (({"logprobs": -1}, "logprobs", "/v1/completions"),
                             ({"logprobs": 21}, "logprobs", "/v1/completions"),
                             ({"logprobs": True}, "logprobs", "/v1/completions"),
                             ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
                             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "/v1/chat/completions"),
                             ({"echo": 1}, "echo", "/v1/chat/completions"),  # chat echo: vLLM's, honoured
                             ({"n": 0}, "n", "/v1/completions"), ({"n": 3, "best_of": 2}, "best_of", "/v1/completions"),
                             ({"best_of": 3, "stream": True}, "best_of", "/v1/completions"),
                             ({"prompt_logprobs": -2}, "prompt_logprobs", "/v1/completions")):
      base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
      r = post(path, {**base, "max_tokens": 2, **bad})
      assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
  return out


def _lp_close(a, b, path=""):
  """Equal JSON, numbers within 1e-4."""
  if isinstance(a, float) or isinstance(b, float):
    assert abs(a - b) < 1e-4, (path, a, b)
  elif isinstance(a, dict):
    assert set(a) == set(b), (path, a, b)
    for k in a:
      _lp_close(a[k], b[k], f"{path}.{k}")
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b), (path, a, b)
    for i, (x, y) in enumerate(zip(a, b)):
      _lp_close(x, y, f"{path}[{i}]")
  else:
    assert a == b, (path, a, b)


def _stream_choices(chunks):
  """Streamed chunks -> {index: [text, logprobs joined over the chunks]}, and the usage chunk's token counts (how
  tokens split into chunks differs with speculation: several tokens a step)."""
  got, usage = {}, None
  for c in chunks:
    if not c["choices"]:
      usage = {k: c["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    for ch in c["choices"]:
      entry = got.setdefault(ch["index"], ["", None])
      entry[0] += ch.get("text", ch.get("delta", {}).get("content") or "")
      lp = ch["logprobs"]
      if lp:
        entry[1] = lp if entry[1] is None else {k: entry[1][k] + lp[k] for k in lp}
  return got, usage


def test_logprobs_echo_and_n_with_and_without_speculation(tiny_model):  # noqa: F811
  results = {}
  for name, spec in (("spec", {"method": "ngram", "num_speculative_tokens": 4}), ("plain", {})):
    s = tiny_server(tiny_model, f"--speculative_config={json.dumps(spec)}", "--noadaptive")
    try:
      results[name] = _queries(s)
    finally:
      assert s.stop() == 0, s.log()[-3000:]
  spec, plain = results["spec"], results["plain"]
  assert spec["completions"]["usage"]["drafted_tokens"] > 0
  for key in ("completions", "chat"):
    _lp_close([c for c in spec[key]["choices"]], [c for c in plain[key]["choices"]], key)
  _lp_close(_stream_choices(spec["chat_stream"]), _stream_choices(plain["chat_stream"]), "chat_stream")
  _lp_close(_stream_choices(spec["completions_stream"]), _stream_choices(plain["completions_stream"]), "stream")

  config, params, tok = _loaded(tiny_model)
  body = spec["completions"]
  ch = body["choices"]
  assert [c["index"] for c in ch] == [0, 1, 2, 3]
  assert ch[0]["text"] == ch[1]["text"] and ch[2]["text"] == ch[3]["text"]  # greedy n = 2: identical choices
  prompt_lens = [len(tok.encode(p)) for p in PROMPTS]
  assert body["usage"]["prompt_tokens"] == sum(prompt_lens)  # each prompt once
  assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in ch) == 4 * 8
  for c, p, n in zip(ch[::2], PROMPTS, prompt_lens):
    lp = c["logprobs"]
    assert c["text"].startswith(p)  # echo
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 8
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the model's own log-softmax at each prompt position and each generated one
    ids = c["prompt_token_ids"] + c["token_ids"]
    ref = _reference(config, params, ids)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
    for i in range(n, n + 8):  # greedy: the chosen token is the best of its top logprobs
      assert abs(lp["token_logprobs"][i] - max(lp["top_logprobs"][i].values())) < 1e-6
      assert len(lp["top_logprobs"][i]) <= 4 and lp["text_offset"][i] >= len(p)
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == n
    first = c["prompt_logprobs"][1][str(ids[1])]
    assert abs(first["logprob"] - want[0]) < 1e-4 and first["rank"] >= 1
  chat = spec["chat"]["choices"][0]["logprobs"]["content"]
  assert len(chat) == len(spec["chat"]["choices"][0]["token_ids"])
  assert all(len(e["top_logprobs"]) == 2 and e["logprob"] == e["top_logprobs"][0]["logprob"] for e in chat)
  streamed, usage = _stream_choices(spec["chat_stream"])
  assert set(streamed) == {0, 1} and streamed[0][0] == streamed[1][0] == spec["chat"]["choices"][0]["message"][
      "content"]
  _lp_close(streamed[0][1], spec["chat"]["choices"][0]["logprobs"], "streamed = whole")
  assert usage["completion_tokens"] == 16
  (text, lp), = _stream_choices(spec["completions_stream"])[0].values()
  assert text.startswith(PROMPTS[1]) and lp["token_logprobs"][0] is None  # the echo comes first
  assert len(lp["tokens"]) == len(tok.encode(PROMPTS[1])) + 8
  a, b = spec["sampled"]
  ids = [c["token_ids"] for c in a["choices"]]
  # each choice is its own stream (seed + i): the same tokens on every run, and with or without speculation
  # (n-gram drafts are deterministic, so the committed tokens are the target's own draws); the choices differ
  assert ids == [c["token_ids"] for c in b["choices"]] == [c["token_ids"] for c in plain["sampled"][0]["choices"]]
  assert len({tuple(x) for x in ids}) > 1
  best, all4 = spec["best_of"]
  score = [sum(c["logprobs"]["token_logprobs"]) for c in all4["choices"]]
  order = sorted(range(4), key=lambda i: (-score[i], i))[:2]
  assert [c["index"] for c in best["choices"]] == [0, 1]
  assert all(c["logprobs"] is None for c in best["choices"])  # ranked by logprobs, which were not asked for
  assert [c["token_ids"] for c in best["choices"]] == [all4["choices"][i]["token_ids"] for i in order]
  assert best["usage"]["completion_tokens"] == all4["usage"]["completion_tokens"]  # every sample counts
  for res in (spec, plain):
    body, hits, block = res["shared"]
    n = len(body["choices"][0]["prompt_token_ids"])
    assert hits >= 3 * ((n - 1) // block * block) > 0, (hits, n, block)
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 1 and body["usage"]["prompt_tokens"] == n


def _reference(config, params, ids):
  import jax
  import jax.numpy as jnp
  from spec_jax.models.transformer import forward
  logits = forward(params, jnp.asarray([ids], jnp.int32), None, None, config=config)[0][0]
  return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
