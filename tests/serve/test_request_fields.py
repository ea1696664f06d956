"""Issue 36, item 1: nothing that changes the output is ever ignored. serve/http/protocol.py's FIELDS has every OpenAI
and vLLM request field: honoured, harmless, or refused with a 400 naming it unless it has a value that changes
nothing. These tests walk that table against a live tiny-model server, and check that it covers the named fields
and every field the request models declare."""

from __future__ import annotations

import json

import httpx
import pytest

from serve.http.protocol import (FIELDS, HARMLESS, HONOURED, ROUTES, ChatRequest, CompletionRequest, Refused,
                            refuse_unsupported)
from tests.serve.test_server import MODEL, tiny_server, tiny_model  # noqa: F401 (a fixture)

# OpenAI's Completions and Chat Completions request fields, and vLLM's extra ones (its SamplingParams and its
# protocol's request models). A field added here must get a row in FIELDS.
OPENAI = ["model", "prompt", "messages", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
          "top_logprobs", "n", "best_of", "echo", "suffix", "response_format", "tools", "tool_choice",
          "parallel_tool_calls", "functions", "function_call", "max_completion_tokens", "prediction", "modalities",
          "audio", "reasoning_effort", "web_search_options", "service_tier", "store", "metadata", "user", "seed",
          "stop", "stream", "stream_options", "temperature", "top_p", "max_tokens", "verbosity", "prompt_cache_key",
          "safety_identifier"]
VLLM = ["top_k", "repetition_penalty", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
        "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
        "structured_outputs", "use_beam_search", "length_penalty", "logits_processors", "add_generation_prompt",
        "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "priority",
        "return_tokens_as_token_ids", "return_token_ids", "add_special_tokens", "prompt_embeds", "request_id",
        "cache_salt", "include_reasoning", "mm_processor_kwargs"]
REFUSED = {name: rule for name, rule in FIELDS.items() if isinstance(rule, Refused)}
BASE = {"completions": {"model": MODEL, "prompt": "the cat", "max_tokens": 1},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 1}}
PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def test_the_table_covers_the_named_fields_and_every_declared_one():
  declared = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
  assert not declared - set(FIELDS), f"declared fields with no row in FIELDS: {sorted(declared - set(FIELDS))}"
  missing = set(OPENAI + VLLM) - (declared | set(FIELDS))
  assert not missing, f"named fields neither declared nor in FIELDS: {sorted(missing)}"
  for name, rule in FIELDS.items():
    assert rule in (HONOURED, HARMLESS) or isinstance(rule, Refused), name
    if isinstance(rule, Refused):
      assert rule.routes and set(rule.routes) <= set(ROUTES), name
      for route in rule.routes:
        assert rule.accepts(None, route) and all(rule.accepts(v, route) for v in rule.noops(route)), name
        assert not rule.accepts(rule.refused_example(route), route), name


def test_no_op_values_are_json_equal_not_python_equal():
  chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}
  refuse_unsupported(ChatRequest(**chat, repetition_penalty=1, min_p=0.0, n=1.0, tool_choice="none"), "chat")
  for name, value in [("include_stop_str_in_output", 0), ("use_beam_search", 0), ("skip_special_tokens", 1),
                      ("best_of", True), ("spaces_between_special_tokens", 1)]:
    with pytest.raises(Exception) as e:
      refuse_unsupported(ChatRequest(**chat, **{name: value}), "chat")
    assert getattr(e.value, "param", None) == name, (name, value)


@pytest.fixture(scope="module")
def http(tiny_model):  # noqa: F811
  s = tiny_server(tiny_model, "--max_queue=64")
  with httpx.Client(base_url=s.url, timeout=60) as h:
    yield h
  assert s.stop() == 0, s.log()[-3000:]


def test_every_refused_field_is_a_400_naming_it_and_its_no_op_values_are_served(http):
  refused = served = 0
  for name, rule in REFUSED.items():
    for route in rule.routes:
      r = http.post(PATH[route], json={**BASE[route], name: rule.refused_example(route)})
      assert r.status_code == 400, (route, name, r.text)
      err = r.json()["error"]
      assert err["param"] == name and err["type"] == "invalid_request_error", (route, name, err)
      assert f"{name} is not supported yet" in err["message"], (route, name, err)
      refused += 1
      for value in (None, *rule.noops(route)):
        r = http.post(PATH[route], json={**BASE[route], name: value})
        assert r.status_code == 200, (route, name, value, r.text)
        assert r.json()["usage"]["completion_tokens"] == 1, (route, name, value)
        served += 1
  assert refused == sum(len(rule.routes) for rule in REFUSED.values()) >= 40 and served >= refused  # all walked


def test_the_issue_s_silently_ignored_fields_are_now_followed_streamed_or_not(http):
  """response_format and tools were accepted and ignored; now the output follows them (more in
  tests/serve/test_server_structured.py), and tools on the completions route are a 400 naming them."""
  schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
  for route in ROUTES:
    for stream in (False, True):
      body = {**BASE[route], "max_tokens": 30, "temperature": 0, "stream": stream,
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
      r = http.post(PATH[route], json=body)
      assert r.status_code == 200, (route, stream, r.text)
      if stream:
        text = "".join(json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or
                       json.loads(line[6:])["choices"][0].get("text") or ""
                       for line in r.text.splitlines() if line.startswith("data: {") and '"choices": [{' in line)
      else:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
      assert isinstance(json.loads(text)["b"], bool), (route, stream, text)
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
  r = http.post(PATH["completions"], json={**BASE["completions"], "tools": tools})
  assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_harmless_and_unknown_fields_are_accepted_and_max_completion_tokens_is_the_budget(http):
  harmless = {name: "x" for name, rule in FIELDS.items() if rule == HARMLESS}
  for route in ROUTES:
    r = http.post(PATH[route], json={**BASE[route], **harmless, "some_client_extra": {"a": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, (route, r.text)
    r = http.post(PATH[route], json={**BASE[route], "max_tokens": 5, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, (route, r.text)
    r = http.post(PATH[route], json={**BASE[route], "max_completion_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", (route, r.text)
