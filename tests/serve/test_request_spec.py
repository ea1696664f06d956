"""The request path from a body to the engine (serve/engine/request_spec.py): one frozen RequestSpec with named fields,
built and checked once against the engine's limits (a value, not the engine); serve/http/api.py holds routes and
response shaping only, in functions short enough to read."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os

import pytest

from serve.http.protocol import APIError, ChatRequest, CompletionRequest
from serve.engine.request_spec import EngineLimits, RequestSpec
from serve.http.body_to_spec import ServerDefaults, request_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = EngineLimits(vocab_size=100, capacity=64, lookahead=4, max_logprobs=5, stop_ids=(1,), structured=True)
DEFAULTS = ServerDefaults(temperature=0.5, top_k=7, top_p=0.9, default_max_tokens=0)


def test_api_functions_are_short():
  """Every function of serve/http/api.py (nested ones too) is at most 80 lines."""
  with open(os.path.join(ROOT, "serve", "http", "api.py")) as f:
    tree = ast.parse(f.read())
  long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80}
  assert not long, long


def test_the_engine_takes_one_spec():
  from serve.engine.engine import Engine
  params = list(inspect.signature(Engine.make_request).parameters)
  assert params == ["self", "spec", "output"], params


def test_a_body_becomes_named_fields_with_the_server_defaults():
  body = CompletionRequest(model="m", prompt="x", max_completion_tokens=9, seed=41, top_k=-1, presence_penalty=0.5,
                           logit_bias={"3": -1.0}, stop=["a", ""], stop_token_ids=[4], speculate=False,
                           segment="batch", cache_salt="s")
  spec = request_spec(body, [2, 3], LIMITS, DEFAULTS, tenant="t", sample=1, top=2)
  assert spec.prompt_ids == (2, 3) and spec.max_new == 9
  assert (spec.sampling.temperature, spec.sampling.top_k, spec.sampling.top_p, spec.sampling.seed) == (0.5, 0, 0.9,
                                                                                                         42)
  assert spec.controls.presence == 0.5 and spec.controls.repetition == 1.0
  assert spec.controls.logit_bias == (("3", -1.0),) and spec.controls.stop_token_ids == (4,)
  assert spec.stop == ("a",) and (spec.logprobs.top, spec.logprobs.mode) == (2, "raw_logprobs")
  assert (spec.speculate, spec.tenant, spec.tag, spec.cache_salt) == (False, "t", "batch", "s")
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.max_new = 3  # noqa
  # a grammar without a segment tags the request "structured" (the policy's segment); no budget: the room left
  chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_k=3)
  spec = request_spec(chat, [2] * 10, LIMITS, DEFAULTS, tenant="", grammar="an automaton")
  assert spec.tag == "structured" and spec.sampling.top_k == 3 and spec.max_new == 64 - 10 - 4 - 1


@pytest.mark.parametrize("fields, param, says", [
    (dict(max_tokens=60), "max_tokens", "at most 49"),
    (dict(max_completion_tokens=60, max_tokens=2), "max_completion_tokens", "at most 49"),
    (dict(max_tokens=4, logit_bias={"100": 1.0}), "logit_bias", "token ids in [0, 100)"),
    (dict(max_tokens=4, min_tokens=5), None, "min_tokens (5) is over the output budget (4)"),
    (dict(max_tokens=4, top_k=2 ** 40), None, "top_k must be an integer"),
])
def test_each_check_is_a_400_naming_its_field(fields, param, says):
  body = CompletionRequest(model="m", prompt="x", **fields)
  with pytest.raises(APIError) as e:
    request_spec(body, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], LIMITS, DEFAULTS, tenant="")
  assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message


def test_the_pool_check_names_the_budget_field_the_body_used():
  def pool_check(prompt_len, max_new):
    e = ValueError(f"{prompt_len}+{max_new} never fits")
    e.field = "max_tokens"
    raise e
  limits = dataclasses.replace(LIMITS, pool_check=pool_check, pool_room=lambda n: 20 - n)
  body = CompletionRequest(model="m", prompt="x", max_completion_tokens=5)
  with pytest.raises(APIError) as e:
    request_spec(body, [2, 3], limits, DEFAULTS, tenant="")
  assert e.value.param == "max_completion_tokens" and e.value.message == "2+5 never fits"
  assert limits.max_new_for(2) == 18  # the pool's room, under the context's (64 - 2 - 5)
  assert RequestSpec(prompt_ids=(1,), max_new=1).grammar is None
