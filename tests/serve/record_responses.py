"""Record a tiny-model server's responses to a fixed set of seeded requests, to check that a refactor of the
request path changes no byte of them: run it before and after, then compare the two files.

  PYTHONPATH=$PWD XLA_FLAGS=--xla_backend_optimization_level=0 .venv/bin/python tests/serve/record_responses.py OUT

Every request is sent alone, in order, and its raw body (each SSE event of a stream) is written with what varies
from run to run normalised: response and tool-call ids, `created` timestamps, the model file's path. Compare two
recordings with

  .venv/bin/python tests/serve/record_responses.py compare BEFORE AFTER

A non-streamed body must be byte-identical. A stream is compared merged per choice (its text, token ids, tool
calls and logprobs joined, its finish and last usage): how the engine's hand-overs fall into chunks depends on
when the event loop takes them (a stop token's delta and the finish's flushed text are one chunk or two), so the
raw chunking is reported but not required to match. The set covers chat, completion,
streams, n and best_of, logprobs (echo, prompt_logprobs, top_logprobs), structured output, tools, penalties,
logit_bias, stop strings and ids, speculation on and off, truncation, the default budget, and the 400s of the
request checks.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.serve.test_server import MODEL, tiny_server, write_tiny_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "the cat sat on"}]
C, CH = "/v1/completions", "/v1/chat/completions"

# (name, route, body, stream)
REQUESTS = [
    ("chat", CH, dict(messages=USER, max_tokens=10, temperature=0.7, seed=1), False),
    ("chat_greedy_default_budget", CH, dict(messages=USER, temperature=0), False),
    ("completion", C, dict(prompt="the cat sat", max_tokens=10, temperature=0.8, seed=2, return_token_ids=True),
     False),
    ("completion_ids_many", C, dict(prompt=[[290, 291, 300], [295, 296]], max_tokens=6, temperature=0.5, seed=3),
     False),
    ("completion_stream", C, dict(prompt="a dog ran", max_tokens=9, temperature=0.9, seed=4, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True}), True),
    ("chat_stream", CH, dict(messages=USER, max_tokens=9, temperature=0.6, seed=5, stream=True,
                             stream_options={"include_usage": True}, return_token_ids=True), True),
    ("completion_n2", C, dict(prompt="the mat", max_tokens=8, temperature=1.0, seed=6, n=2), False),
    ("completion_best_of", C, dict(prompt="the mat", max_tokens=8, temperature=1.0, seed=7, n=2, best_of=3,
                                   logprobs=1), False),
    ("chat_n2_stream", CH, dict(messages=USER, max_tokens=6, temperature=1.0, seed=8, n=2, stream=True), True),
    ("completion_logprobs_echo", C, dict(prompt="the cat sat", max_tokens=5, temperature=0, logprobs=3, echo=True,
                                         prompt_logprobs=2), False),
    ("chat_logprobs", CH, dict(messages=USER, max_tokens=5, temperature=0.7, seed=9, logprobs=True,
                               top_logprobs=2, return_tokens_as_token_ids=True), False),
    ("chat_json_schema", CH, dict(messages=USER, max_tokens=40, temperature=0.8, seed=10, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}), False),
    ("completion_regex", C, dict(prompt="the", max_tokens=12, temperature=0.8, seed=11, guided_regex="(cat|dog)+"),
     False),
    ("chat_choice_stream", CH, dict(messages=USER, max_tokens=12, temperature=0.8, seed=12,
                                    guided_choice=["yes", "no"], stream=True), True),
    ("chat_tools_required", CH, dict(messages=USER, max_tokens=60, temperature=0, tools=[TOOL],
                                     tool_choice="required"), False),
    ("chat_tools_stream", CH, dict(messages=USER, max_tokens=60, temperature=0, tools=[TOOL],
                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                   stream=True), True),
    ("completion_penalties", C, dict(prompt="the cat sat on the mat", max_tokens=12, temperature=0.9, seed=13,
                                     presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.3,
                                     min_p=0.05, min_tokens=4, top_k=20, top_p=0.9), False),
    ("chat_logit_bias", CH, dict(messages=USER, max_tokens=8, temperature=0.8, seed=14,
                                 logit_bias={"300": 5.0, "301": -100}), False),
    ("completion_stop", C, dict(prompt="the cat", max_tokens=20, temperature=0.9, seed=15, stop=["a", "t "],
                                stop_token_ids=[300], ignore_eos=True), False),
    ("completion_no_speculation", C, dict(prompt="the cat sat", max_tokens=10, temperature=0.8, seed=16,
                                          speculate=False), False),
    ("completion_tenant_salt_segment", C, dict(prompt="the cat sat", max_tokens=10, temperature=0, tenant="t1",
                                               cache_salt="s1", segment="batch"), False),
    ("completion_truncated", C, dict(prompt="the cat sat on the mat and a dog ran", max_tokens=6, temperature=0,
                                     truncate_prompt_tokens=3, truncation_side="right"), False),
    ("chat_continue", CH, dict(messages=USER + [{"role": "assistant", "content": "the mat"}], max_tokens=6,
                               temperature=0, add_generation_prompt=False, continue_final_message=True, echo=True),
     False),
    # the request checks: each a 400 naming its field
    ("bad_temperature", C, dict(prompt="x", max_tokens=4, temperature=-1), False),
    ("bad_budget", C, dict(prompt="x", max_tokens=100000), False),
    ("bad_budget_completion_tokens", CH, dict(messages=USER, max_completion_tokens=100000), False),
    ("bad_logit_bias", C, dict(prompt="x", max_tokens=4, logit_bias={"999999": 1.0}), False),
    ("bad_min_tokens", C, dict(prompt="x", max_tokens=4, min_tokens=8), False),
    ("bad_prompt_ids", C, dict(prompt=[1, 99999], max_tokens=4), False),
    ("bad_top_logprobs", C, dict(prompt="x", max_tokens=4, logprobs=30), False),
    ("bad_chat_logprobs", CH, dict(messages=USER, max_tokens=4, top_logprobs=2), False),
    ("bad_regex", C, dict(prompt="x", max_tokens=4, guided_regex="(("), False),
    ("bad_n", C, dict(prompt=["a", "b"], max_tokens=4, n=100), False),
    ("bad_truncate", C, dict(prompt="x", max_tokens=4, truncate_prompt_tokens=0), False),
    ("bad_model", C, dict(prompt="x", max_tokens=4, model="other"), False),
    ("bad_stream_options", C, dict(prompt="x", max_tokens=4, stream_options={"include_usage": True}), False),
    ("bad_empty_prompt", C, dict(prompt="", max_tokens=4), False),
]

VARYING = [(re.compile(r'"id":\s*"(cmpl|chatcmpl)-[0-9a-f]{24}"'), r'"id":"\1-ID"'),
           (re.compile(r'"id":\s*"call_[0-9A-Za-z]+"'), '"id":"call_ID"'),
           (re.compile(r'"created":\s*\d+'), '"created":0'),
           (re.compile(r'"root":\s*"[^"]*"'), '"root":"MODEL"')]  # the model file's path


def normalised(text: str) -> str:
  for pattern, repl in VARYING:
    text = pattern.sub(repl, text)
  return text


def record(server) -> dict:
  out = {}
  with httpx.Client(base_url=server.url, timeout=300) as h:
    for name, route, body, stream in REQUESTS:
      body = {"model": MODEL, **body}
      r = h.post(route, json=body)
      out[name] = {"status": r.status_code, "body": normalised(r.text)}
  with httpx.Client(base_url=server.url, timeout=60) as h:
    out["models"] = {"status": 200, "body": normalised(h.get("/v1/models").text)}
  return out


def _merge(into: dict, key, value) -> None:
  """A chunk's field into the choice so far: strings joined, lists extended, dicts merged (tool calls by their
  index), anything else the latest."""
  if value is None:
    return
  if key == "tool_calls":
    calls = into.setdefault(key, {})
    for call in value:
      one = calls.setdefault(str(call.get("index", 0)), {})
      for k, v in call.items():
        _merge(one, k, v)
  elif isinstance(value, str):
    into[key] = into.get(key, "") + value
  elif isinstance(value, list):
    into[key] = into.get(key, []) + value
  elif isinstance(value, dict):
    sub = into.setdefault(key, {})
    for k, v in value.items():
      _merge(sub, k, v)
  else:
    into[key] = value


def merged_stream(text: str) -> dict:
  """An SSE body -> per choice index its fields joined over the chunks, plus the chunks without choices (the usage
  chunk, an error) and [DONE]."""
  out = {"choices": {}, "other": [], "header": None}
  for event in text.split("\n\n"):
    if not event.strip():
      continue
    payload = event[len("data: "):]
    if payload == "[DONE]":
      out["other"].append(payload)
      continue
    obj = json.loads(payload)
    choices, usage = obj.pop("choices", None), obj.pop("usage", None)
    if not choices:
      out["other"].append({**obj, "choices": choices, "usage": usage})
      continue
    for c in choices:
      m = out["choices"].setdefault(str(c["index"]), {})
      for k, v in c.items():
        _merge(m, k, v)
      if usage is not None:  # continuous_usage_stats: the choice's usage so far, the last one kept
        m["usage"] = usage
    extra = {k: v for k, v in obj.items() if k not in ("id", "object", "created", "model")}  # prompt_token_ids
    for k, v in extra.items():
      out.setdefault("top", {})[k] = v
    out["header"] = {k: obj[k] for k in ("id", "object", "created", "model")}
  return out


def compare(before: str, after: str) -> list:
  """The names whose responses differ (streams merged); the raw chunking's differences printed."""
  a, b = (json.load(open(p)) for p in (before, after))
  differ = []
  for name in sorted(set(a) | set(b)):
    if name not in a or name not in b:
      differ.append(name)
      continue
    x, y = a[name], b[name]
    bx, by = normalised(x["body"]), normalised(y["body"])
    if x["status"] != y["status"]:
      differ.append(name)
    elif bx.startswith("data: ") or by.startswith("data: "):
      if merged_stream(bx) != merged_stream(by):
        differ.append(name)
      elif bx != by:
        print(f"{name}: the same stream in other chunks")
    elif bx != by:
      differ.append(name)
  print(f"{len(a)} and {len(b)} responses; differ: {differ or 'none'}")
  return differ


def main(path: str) -> None:
  work = os.environ.get("RECORD_DIR") or tempfile.mkdtemp(prefix="record_responses_")  # a shared compile cache
  model = os.path.join(work, "tiny.gguf")
  if not os.path.exists(model):
    write_tiny_model(model)
  server = tiny_server(model, "--max_queue=64", "--max_model_len=1024", "--noadaptive")
  try:
    got = record(server)
  finally:
    server.stop()
  with open(path, "w") as f:
    json.dump(got, f, indent=1, sort_keys=True)
  print(f"{len(got)} responses -> {path}")


if __name__ == "__main__":
  if sys.argv[1] == "compare":
    sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
  main(sys.argv[1])
