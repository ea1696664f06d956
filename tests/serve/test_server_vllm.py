"""Issue 50: what vLLM's users send and read, against one live tiny-model server, speculation on and off per
request (`speculate`): tool schemas with `$ref` into `$defs` (the openai client's pydantic_function_tool on a
nested model), a forced call cut by max_tokens, and the rest of the issue's items.

The tiny model never stops on its own (tests/serve/test_server.py), so each request gives max_tokens."""

from __future__ import annotations

import json
import re
import time
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from tests.serve.test_server import MODEL, metric, tiny_model, tiny_server  # noqa: F401 (a fixture)


class Place(BaseModel):
  city: Literal["Paris", "Rome"]


class Weather(BaseModel):
  """A nested model: pydantic writes `Place` into `$defs` and points at it with `$ref`."""
  place: Place
  unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def server(tiny_model):  # noqa: F811
  s = tiny_server(tiny_model, "--max_queue=64", "--max_model_len=1024",
                  "--drain_timeout_s=2", "--default_max_tokens=0")  # the tools' system turn: ~600 tokens
  yield s
  assert s.stop() == 0, s.log()[-3000:]


def _weather_tool():
  import openai
  tool = openai.pydantic_function_tool(Weather, name="get_weather")
  assert "$defs" in tool["function"]["parameters"]  # the case of the issue: a reference into $defs
  return tool


def _streamed_call(chunks):
  """(finish_reason, content, name, arguments) assembled from chat chunks."""
  name, args, content, finish = None, "", "", None
  for ch in chunks:
    if not ch.choices:
      continue
    d = ch.choices[0].delta
    content += d.content or ""
    for tc in d.tool_calls or ():
      name = tc.function.name or name
      args += tc.function.arguments or ""
    finish = ch.choices[0].finish_reason or finish
  return finish, content, name, args


def test_pydantic_function_tool_with_defs_auto_required_named_streamed_and_not(server):
  c = server.client()
  tool = _weather_tool()
  msgs = [{"role": "user", "content": "weather in Paris?"}]
  named = {"type": "function", "function": {"name": "get_weather"}}
  for choice in ("required", named):
    got = []
    for speculate in (True, False):
      kw = dict(model=MODEL, messages=msgs, tools=[tool], tool_choice=choice, max_tokens=150, temperature=0,
                extra_body={"speculate": speculate})
      r = c.chat.completions.create(**kw)
      assert r.choices[0].finish_reason == "tool_calls", r
      (call,) = r.choices[0].message.tool_calls
      assert call.function.name == "get_weather"
      args = Weather.model_validate_json(call.function.arguments)  # valid against the nested model
      finish, content, name, streamed = _streamed_call(c.chat.completions.create(**kw, stream=True))
      assert (finish, content, name) == ("tool_calls", "", "get_weather")
      assert Weather.model_validate_json(streamed) == args
      got.append(args)
    assert got[0] == got[1]
  for speculate in (True, False):  # auto: the tiny model answers in text, the same streamed or not
    kw = dict(model=MODEL, messages=msgs, tools=[tool], tool_choice="auto", max_tokens=12, temperature=0,
              extra_body={"speculate": speculate})
    r = c.chat.completions.create(**kw)
    finish, content, _, _ = _streamed_call(c.chat.completions.create(**kw, stream=True))
    assert r.choices[0].message.tool_calls is None and (finish, content) == ("length", r.choices[0].message.content)


def test_a_forced_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(server):
  """vLLM's answer: what was generated, as a tool call, finish_reason "length" (streamed and not: the same)."""
  c = server.client()
  tool = _weather_tool()
  msgs = [{"role": "user", "content": "weather in Rome?"}]
  for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    kw = dict(model=MODEL, messages=msgs, tools=[tool], tool_choice=choice, temperature=0)
    _, _, _, whole = _streamed_call(c.chat.completions.create(**kw, max_tokens=150, stream=True))
    for speculate in (True, False):
      r = c.chat.completions.create(**kw, max_tokens=60, extra_body={"speculate": speculate})
      choice0 = r.choices[0]
      assert choice0.finish_reason == "length" and choice0.message.content is None, choice0
      (call,) = choice0.message.tool_calls
      assert call.function.name == "get_weather" and call.id.startswith("call_")
      assert call.function.arguments and whole.startswith(call.function.arguments), (call, whole)
      assert _streamed_call(c.chat.completions.create(**kw, max_tokens=60, stream=True,
                                                      extra_body={"speculate": speculate})) == \
          ("length", "", "get_weather", call.function.arguments)


def _running_and_kv(server) -> tuple:
  m = server.metrics()
  return metric(m, "spec_jax:num_requests_running"), metric(m, "spec_jax:kv_cache_usage_perc")


def test_a_walked_away_stream_frees_its_slot_and_pages_within_an_iteration(server):
  """vLLM's own test allows one second; an iteration of the tiny model is a few ms, so 1.5 s bounds it here."""
  before = _running_and_kv(server)
  assert before == (0, 0)
  with server.http() as h, h.stream("POST", "/v1/completions", json={
      "model": MODEL, "prompt": "the dog ran", "max_tokens": 1000, "stream": True,
      "speculate": False}) as resp:  # ~7 s of tokens: still running when the client leaves
    lines = resp.iter_lines()  # held: a generator dropped mid-way closes the connection at once
    chunks = 0
    while chunks < 3:
      chunks += next(lines).startswith("data: {")
    running = _running_and_kv(server)
    assert running[0] == 1 and running[1] > 0, running
  gone = time.monotonic()  # the connection is closed here
  while time.monotonic() - gone < 1.5 and _running_and_kv(server) != before:
    time.sleep(0.02)
  assert _running_and_kv(server) == before, time.monotonic() - gone


def test_without_max_tokens_the_answer_runs_to_the_end_of_the_context(server):
  """OpenAI's and vLLM's default (item 6): the context's room after the prompt and the lookahead (k + 1 = 5). A
  long prompt keeps the room (118 tokens, over the old default of 64), and the test, short."""
  c = server.client()
  got = []
  for speculate in (True, False):
    r = c.completions.create(model=MODEL, prompt=[2] + [297, 298, 299] * 300, temperature=0,
                             extra_body={"speculate": speculate})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 1024 - r.usage.prompt_tokens - 5, r.usage
    got.append(r.choices[0].text)
  assert got[0] == got[1]


VLLM_DASHBOARD = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                  "vllm:spec_decode_num_drafts_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"]
VLLM_HISTOGRAMS = ["request_prompt_tokens", "request_generation_tokens", "request_params_n",
                   "request_params_max_tokens", "request_inference_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "iteration_tokens_total", "time_to_first_token_seconds",
                   "e2e_request_latency_seconds"]


def test_metrics_under_vllm_names_and_vllm_routes(server):
  """What a vLLM Grafana dashboard queries finds its series (issue 45), with the same values as the spec_jax:
  ones; vLLM's request histograms count this test's requests (issue 50 item 8); /version and /v1/models."""
  c = server.client()
  m0 = server.metrics()
  c.completions.create(model=MODEL, prompt="the cat sat on the mat. the cat sat", max_tokens=5, n=2, temperature=0)
  c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3)
  m1 = server.metrics()
  for name in VLLM_DASHBOARD:
    assert (name, frozenset()) in m1, name
    assert m1[(name, frozenset())] == m1[(name.replace("vllm:", "spec_jax:"), frozenset())], name
  delta = lambda name: metric(m1, "vllm:" + name) - metric(m0, "vllm:" + name)
  for name in VLLM_HISTOGRAMS:
    assert delta(name + "_count") >= (1 if name == "iteration_tokens_total" else 2), name
  assert delta("request_params_n_count") == 2 and delta("request_params_n_sum") == 3
  assert delta("request_generation_tokens_count") == 3 and delta("request_generation_tokens_sum") == 13
  assert delta("request_params_max_tokens_sum") == 13
  info = [labels for (name, labels), v in m1.items() if name == "vllm:cache_config_info" and v == 1]
  assert len(info) == 1 and dict(info[0])["block_size"] == "16", info
  with server.http() as h:
    assert isinstance(h.get("/version").json()["version"], str)
    (card,) = h.get("/v1/models").json()["data"]
  assert card["id"] == MODEL and card["max_model_len"] == 1024 and card["parent"] is None and card["root"]


def _error(r, status: int) -> dict:
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and (err["code"] is None or isinstance(err["code"], str))
  return err


def test_every_error_has_openai_s_shape_and_a_form_body_says_which_header(server):
  with server.http() as h:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    assert _error(h.post("/v1/chat/completions", json={**chat, "model": "nope"}), 404)["code"] == "model_not_found"
    err = _error(h.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400)
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error" and err["code"] is None
    _error(h.get("/v1/nothing"), 404)
    _error(h.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}), 400)
    # curl -d without -H: a form; BUILD.md's rollback command once sent it so
    r = h.post("/admin/speculation", content=b'{"enabled": false}',
               headers={"Content-Type": "application/x-www-form-urlencoded"})
    err = _error(r, 400)
    assert "Content-Type: application/json" in err["message"] and "x-www-form-urlencoded" in err["message"], err
    assert h.post("/admin/speculation", content=b'{"enabled": true}').status_code == 200  # no header: read as JSON


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "the cat", "max_tokens": 3}


def test_validation_openai_and_vllm_do(server):
  """Item 3: each a 400 naming its field."""
  with server.http() as h:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
      for extra, param, words in [
          ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
          ({"cache_salt": ""}, "cache_salt", ""),
          ({"seed": 2**63}, "seed", ""), ({"seed": -2**63 - 1}, "seed", ""),
          ({"logit_bias": {"x": 1, "5": 1, "99999": 2}}, "logit_bias", "'x', '99999'"),
          ({"stop_token_ids": [5, 99999]}, "stop_token_ids", "in [0, 302); these are not: 99999")]:
        err = _error(h.post(path, json={**body, **extra}), 400)
        assert err["param"] == param and words in err["message"], (path, extra, err)
    err = _error(h.post("/v1/chat/completions", json={**CHAT, "tool_choice": "auto"}), 400)
    assert err["param"] == "tool_choice" and "needs tools" in err["message"]
    got = []  # the 64-bit range's ends are served, and a seeded sample is the same with speculation on and off
    for speculate in (True, False):
      for seed in (2**63 - 1, -2**63):
        r = h.post("/v1/completions", json={**COMPLETION, "max_tokens": 12, "temperature": 1.0, "seed": seed,
                                             "speculate": speculate, "return_token_ids": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    assert got[:2] == got[2:]


def test_usage_cached_tokens_and_continuous_usage_stats(server):
  """Item 4: prompt_tokens_details.cached_tokens is what the prefix cache held (0 the first time, the prompt's
  whole pages the second), and a stream with continuous_usage_stats carries the usage so far in every chunk."""
  prompt = "the mat is on the dog and the cat ran " * 6
  got = []
  for speculate in (True, False):
    salt = f"usage-{speculate}"  # a fresh cache each time
    cached = []
    for _ in range(2):
      r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                             extra_body={"speculate": speculate, "cache_salt": salt})
      cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] == (r.usage.prompt_tokens - 1) // 16 * 16 > 0, (cached, r.usage)
    got.append((cached, r.choices[0].text))
  assert got[0] == got[1]
  for speculate in (True, False):
    chunks = list(server.client().completions.create(
        model=MODEL, prompt="the cat", max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"speculate": speculate}))
    assert all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert done == sorted(done) and done[-1] == 9 and chunks[-1].usage.completion_tokens == 9
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)


def test_token_ids_and_prompt_logprobs_where_vllm_puts_them(server):
  """Item 5: chat's prompt_token_ids and prompt_logprobs at the top level; a streamed completion's first chunk
  has the prompt's ids and its last chunk token_ids; the same with speculation on and off."""
  got = []
  with server.http() as h:
    for speculate in (True, False):
      r = h.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                               "prompt_logprobs": 1, "speculate": speculate}).json()
      choice = r["choices"][0]
      assert "prompt_token_ids" not in choice and "prompt_logprobs" not in choice and len(choice["token_ids"]) == 6
      assert len(r["prompt_logprobs"]) == len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
      text = h.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 0, "stream": True,
                                                  "return_token_ids": True, "speculate": speculate}).text
      chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
      assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
      assert all("prompt_token_ids" not in c for c in chunks[1:])
      assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]
      whole = h.post("/v1/completions", json={**COMPLETION, "max_tokens": 6, "temperature": 0,
                                              "return_token_ids": True, "speculate": speculate}).json()["choices"][0]
      text = h.post("/v1/completions", json={**COMPLETION, "max_tokens": 6, "temperature": 0, "stream": True,
                                             "return_token_ids": True, "speculate": speculate}).text
      chunks = [json.loads(line[6:])["choices"][0] for line in text.splitlines() if line.startswith("data: {")]
      assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
      assert all("prompt_token_ids" not in c for c in chunks[1:])
      assert all("token_ids" in c for c in chunks) and chunks[-1]["finish_reason"] == "length"
      assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
      # a special token's logprob entry shows its text (<bos>), as vLLM's does, not ""
      echo = h.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "temperature": 0, "echo": True,
                                             "logprobs": 1, "speculate": speculate}).json()["choices"][0]
      assert echo["logprobs"]["tokens"][0] == "<bos>" and all(echo["logprobs"]["tokens"]), echo["logprobs"]
      got.append((r["prompt_token_ids"], choice["token_ids"], whole["token_ids"], echo["logprobs"]["tokens"]))
  assert got[0] == got[1]


def test_vllm_extensions_honoured_with_speculation_on_and_off(server):
  """Item 7: truncate_prompt_tokens / truncation_side, add_generation_prompt false, continue_final_message and
  chat echo, each the same with speculation on and off."""
  got = []
  user = [{"role": "user", "content": "the cat"}]
  turn = user + [{"role": "assistant", "content": "the dog"}]
  with server.http() as h:
    post = lambda path, **kw: h.post(path, json={"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                  "return_token_ids": True, **kw})
    for speculate in (True, False):
      out = []
      full = post("/v1/completions", prompt="the cat sat on the mat", speculate=speculate).json()["choices"][0]
      ids = full["prompt_token_ids"]
      for side, kept in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        r = post("/v1/completions", prompt="the cat sat on the mat", truncate_prompt_tokens=3, truncation_side=side,
                 speculate=speculate).json()
        same = post("/v1/completions", prompt=kept, speculate=speculate).json()["choices"][0]
        assert r["choices"][0]["prompt_token_ids"] == kept and r["usage"]["prompt_tokens"] == 3
        assert r["choices"][0]["token_ids"] == same["token_ids"]
        out.append(same["token_ids"])
      chat = lambda **kw: post("/v1/chat/completions", speculate=speculate, **kw).json()
      opened, closed = chat(messages=user), chat(messages=user, add_generation_prompt=False)
      assert opened["prompt_token_ids"][:len(closed["prompt_token_ids"])] == closed["prompt_token_ids"]
      assert len(closed["prompt_token_ids"]) < len(opened["prompt_token_ids"])
      ended = chat(messages=turn, add_generation_prompt=False)["prompt_token_ids"]
      cont = chat(messages=turn, add_generation_prompt=False, continue_final_message=True)
      n = len(cont["prompt_token_ids"])
      assert ended[:n] == cont["prompt_token_ids"] and ended[n] == 6  # the turn's <end_of_turn> is left off
      echoed = chat(messages=turn, add_generation_prompt=False, continue_final_message=True, echo=True)
      text = cont["choices"][0]["message"]["content"]
      assert echoed["choices"][0]["message"]["content"] == "the dog" + text
      streamed = h.post("/v1/chat/completions", json={
          "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": turn, "add_generation_prompt": False,
          "continue_final_message": True, "echo": True, "stream": True, "speculate": speculate}).text
      deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines()
                if line.startswith("data: {")]
      assert "".join(d.get("content") or "" for d in deltas) == "the dog" + text
      got.append((out, closed["choices"][0]["token_ids"], text))
  assert got[0] == got[1]


def test_vllm_extensions_not_done_are_400s_naming_them(server):
  with server.http() as h:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
      for extra, param, words in [
          ({"allowed_token_ids": [5, 6]}, "allowed_token_ids", "logit_bias"),
          ({"use_beam_search": True}, "use_beam_search", "beam search"),
          ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "context-free"),
          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1")]:
        err = _error(h.post(path, json={**body, **extra}), 400)
        assert err["param"] == param and words in err["message"], (path, extra, err)
    turn = CHAT["messages"] + [{"role": "assistant", "content": "x"}]
    for extra, param in [({"messages": [{"role": "developer", "content": "a"}]}, "messages.0.role"),
                         ({"messages": turn, "continue_final_message": True}, "continue_final_message"),
                         ({"continue_final_message": True, "add_generation_prompt": False},
                          "continue_final_message")]:
      assert _error(h.post("/v1/chat/completions", json={**CHAT, **extra}), 400)["param"] == param, extra


# ------------------------------------------------------------------------- keep last: it stops the module's server

def test_sigterm_with_streams_open_ends_each_with_an_error_event_and_done(server):
  """Four streams that need longer than the drain (--drain_timeout_s=2) and one queued request: at the deadline
  each stream gets an OpenAI error event and [DONE], the queued request a 503; the process exits 0 within the
  drain plus a few seconds, and its log says how many requests were cut."""
  import signal
  import threading

  body = {"model": MODEL, "prompt": "the dog ran", "max_tokens": 1000, "speculate": False}
  ends = []

  def stream():
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
      events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
      ends.append(events[-2:])

  def queued():
    ends.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))

  httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 8}, timeout=60)  # compiled before
  threads = [threading.Thread(target=stream) for _ in range(4)] + [threading.Thread(target=queued)]
  for t in threads:
    t.start()
    time.sleep(0.2)
  end = time.monotonic() + 30
  while metric(server.metrics(), "spec_jax:num_requests_waiting") < 1 and time.monotonic() < end:
    time.sleep(0.05)
  sigterm = time.monotonic()
  server.proc.send_signal(signal.SIGTERM)
  for t in threads:
    t.join(30)
  assert server.proc.wait(30) == 0
  assert time.monotonic() - sigterm < 2 + 5, server.log()[-1500:]
  streams = [e for e in ends if isinstance(e, list)]
  (late,) = [e for e in ends if not isinstance(e, list)]
  assert late.status_code == 503 and late.json()["error"]["code"] == "shutdown", late.text
  assert len(streams) == 4
  for error, done in streams:
    assert done == "[DONE]"
    err = json.loads(error)["error"]
    assert err["type"] == "service_unavailable" and "drain" in err["message"], err
  cut = re.search(r"cut (\d+) running and (\d+) waiting request", server.log())
  assert cut and int(cut[1]) >= 1 and int(cut[1]) + int(cut[2]) == 5, server.log()[-2000:]
