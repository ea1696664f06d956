"""The server's published API (/openapi.json, from serve/http/protocol.py's pydantic models) and a schema-driven fuzz
of it: schemathesis generates bodies from that schema, valid and invalid, against a live tiny-model server. No
answer may be a 5xx, every 4xx must be an OpenAI error object, and every 2xx completion must be OpenAI-shaped."""

from __future__ import annotations

import json

import httpx
import pytest

from serve.http.protocol import FIELDS, Refused
from tests.serve.test_server import MODEL, tiny_server, tiny_model  # noqa: F401 (a fixture)

KEY = "fuzz-key"
# the fields the server refuses unless at a no-op value (serve/http/protocol.py FIELDS), left out of the valid bodies
UNSUPPORTED = tuple(name for name, rule in FIELDS.items() if isinstance(rule, Refused))
# Honoured, but a fuzzed schema, regex or tool list is nearly always a 400 and compiling one takes seconds at any
# vocabulary: the generating half leaves them out (tests/serve/test_server_structured.py has their cases).
GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "tools", "tool_choice")


@pytest.fixture(scope="module")
def server(tiny_model):  # noqa: F811
  s = tiny_server(tiny_model, "--max_queue=64", api_key=KEY)
  yield s
  assert s.stop() == 0, s.log()[-3000:]


def _schema(server) -> dict:
  r = httpx.get(f"{server.url}/openapi.json", timeout=30)  # no key needed, as /health
  assert r.status_code == 200
  return r.json()


def test_the_schema_carries_the_constraints(server):
  doc = _schema(server)
  assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/speculation"} <= set(doc["paths"])
  models = doc["components"]["schemas"]
  comp = models["CompletionRequest"]["properties"]
  assert {"model", "prompt"} <= set(models["CompletionRequest"]["required"])

  def bounds(prop):  # Optional[...] fields are anyOf [constrained, null]
    for alt in prop.get("anyOf", [prop]):
      if alt.get("type") in ("number", "integer"):
        return {k: v for k, v in alt.items() if k in ("minimum", "maximum", "exclusiveMinimum")}
    return {}

  assert bounds(comp["top_p"]) == {"exclusiveMinimum": 0, "maximum": 1}
  assert bounds(comp["temperature"]) == {"minimum": 0}
  assert bounds(comp["max_tokens"]) == {"minimum": 1}
  assert bounds(comp["top_k"]) == {"minimum": -1}
  roles = models["ChatMessage"]["properties"]["role"]
  assert sorted(roles["enum"]) == ["assistant", "model", "system", "tool", "user"]
  assert "HTTPBearer" in doc["components"]["securitySchemes"]
  # the validation error FastAPI would describe (422) is never what the server answers
  with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": "a", "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
    r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = h.post("/v1/completions", content=b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "temperature": NaN}',
               headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = h.post("/admin/speculation", json={"enabled": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "enabled", r.text
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2}).encode()
    r = h.post("/v1/completions", content=body, headers={"content-type": ""})  # no type: read as JSON
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = h.post("/v1/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def _check_answer(case, resp) -> None:
  where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:300]}"
  assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:500]}"
  if resp.status_code >= 400:
    err = resp.json().get("error")
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], (where, resp.text)
    assert isinstance(err.get("type"), str) and "code" in err and "param" in err, (where, resp.text)
    return
  if case.path.endswith("completions"):
    ct = resp.headers.get("content-type") or [""]  # schemathesis keeps each header's values as a list
    if (ct[0] if isinstance(ct, list) else ct).startswith("text/event-stream"):
      events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
      assert events and events[-1] == "[DONE]", (where, resp.text[-300:])
      chunks = [json.loads(e) for e in events[:-1]]
      assert all("choices" in c or "error" in c for c in chunks), where
    else:
      body = resp.json()
      assert body["object"] in ("text_completion", "chat.completion") and len(body["choices"]) >= 1, where
      assert body["usage"]["completion_tokens"] >= 1, where


@pytest.mark.slow
def test_schema_driven_fuzzing_finds_no_5xx_and_only_openai_errors(server):
  schemathesis = pytest.importorskip("schemathesis")
  from hypothesis import HealthCheck, Phase, given, settings
  from schemathesis.generation import GenerationMode

  schema = schemathesis.openapi.from_dict(_schema(server))
  # schemathesis (4.x) stops reading an event stream after 20 events; n = 2 of 16 tokens streams 35: read it all
  if hasattr(schema.config, "max_stream_events"):
    schema.config.max_stream_events = 10_000
  ops = [r.ok() for r in schema.get_all_operations()]
  assert {(o.method.upper(), o.path) for o in ops} >= {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
  auth = {"Authorization": f"Bearer {KEY}"}
  seen = {}

  def served_model(case):  # a random model name is a 404 before anything else is read: name the one served
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
      case.body["model"] = MODEL
    return case

  def supported(case):  # valid bodies within what the server honours (issue 36's fields are refused): generation
    case = served_model(case)
    if isinstance(case.body, dict):
      for name in UNSUPPORTED + GRAMMAR_FIELDS:
        case.body.pop(name, None)
      if isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 16)
      if isinstance(case.body.get("n"), int):  # choices: a few
        case.body["n"] = min(case.body["n"], 2)
      case.body.pop("max_completion_tokens", None)
      p = case.body.get("prompt")
      if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # one prompt per request
        p = p[:1]
      if isinstance(p, list) and p and isinstance(p[0], list):  # token ids inside the tiny vocabulary
        p = [[t % 300 for t in x] or [5] for x in p]
      elif isinstance(p, list) and p and isinstance(p[0], int):
        p = [t % 300 for t in p]
      if p is not None:
        case.body["prompt"] = p or "a"
      msgs = case.body.get("messages")
      if isinstance(msgs, list):  # roles alternate, user first (Gemma's template); the contents are the fuzz's
        for i, m in enumerate(msgs):
          m["role"] = "user" if i % 2 == 0 else "assistant"
          for key in ("tool_calls", "tool_call_id", "name"):  # tool turns: the structured tests' cases
            m.pop(key, None)
          if m.get("content") is None:  # optional in the schema only for an assistant turn with tool_calls
            m["content"] = "a"
    return case
  for op in ops:
    kinds = [(GenerationMode.POSITIVE, served_model)]
    if len(op.body):
      kinds += [(GenerationMode.POSITIVE, supported), (GenerationMode.NEGATIVE, served_model)]
    for mode, adjust in kinds:
      @settings(max_examples=25, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))
      @given(case=op.as_strategy(generation_mode=mode).map(adjust))
      def run(case):
        resp = case.call(base_url=server.url, headers=auth, timeout=120)
        _check_answer(case, resp)
        seen.setdefault((op.path, resp.status_code // 100), 0)
        seen[(op.path, resp.status_code // 100)] += 1

      run()
  # Both generations and refusals happened on the completion routes (an operation without a body has no invalid
  # input to generate; its key is test_server's to check).
  for path in ("/v1/completions", "/v1/chat/completions"):
    assert seen.get((path, 2), 0) >= 10 and seen.get((path, 4), 0) >= 10, seen
  r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "still alive", "max_tokens": 3},
                 headers=auth, timeout=60)
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
