"""OpenAI request bodies (pydantic) and the response objects the server sends.

Unknown fields are accepted and ignored (clients send extras), but a known field of the wrong type is a 400.
Every OpenAI and vLLM request field is in one table, `FIELDS`: honoured, harmless (it does not change the tokens)
or refused with a 400 that names it unless it has a value that changes nothing (`n: 1`, `repetition_penalty: 1.0`,
`response_format: {"type": "text"}`, ...): nothing that changes the output is ignored. Four extensions ride in
`extra_body`: `speculate: false` turns speculation off for one request, `return_token_ids: true` adds the
prompt and completion token ids to the choice (as vLLM's `return_token_ids` does), and `tenant` names whose shared
history the suffix method may draft from (within the API key's, where --api_key is set), and `segment` tags the
request for the speculative config's policy (a rule's `segment` match key; spec_jax/spec_policy.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from importlib import metadata
from typing import Annotated, Any, Literal, Optional, Union

from fastapi.exceptions import RequestValidationError
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      model_validator)


class APIError(Exception):
  """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status. `code` is a string
  (OpenAI's: "model_not_found", "invalid_api_key", ...; the engine's kind: "timeout", "shutdown", ...) or null,
  never the status number."""

  TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
           405: "invalid_request_error",
           429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable", 504: "timeout"}

  def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               headers: Optional[dict] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                      "code": None if self.code is None else str(self.code)}}


def _integral(v):
  """JSON has one number type, and JSON Schema's "integer" includes 5.0: take an integral float as an int (a
  fractional one, a string or a boolean stays an error)."""
  return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


def integer(**bounds):
  """An integer field with its bounds (ge, le): the bounds go before the validator, or pydantic's JSON schema
  writes them as unknown keywords ("ge" for "minimum")."""
  return Annotated[StrictInt, Field(**bounds), BeforeValidator(_integral)]


Int, Count, TopK, TopLogprobs = integer(), integer(ge=1), integer(ge=-1), integer(ge=0, le=20)
Seed = integer(ge=-2**63, le=2**63 - 1)  # vLLM's: a 64-bit signed integer


# ---------------------------------------------------------------------------------------- the request fields

HONOURED, HARMLESS = "honoured", "harmless"
ROUTES = ("completions", "chat")


def _same(value, noop) -> bool:
  """JSON equality: 1 and 1.0 are the same number, but true is not 1 and "1" is not 1."""
  if type(value) in (int, float) and type(noop) in (int, float):
    return value == noop
  return type(value) is type(noop) and value == noop


@dataclasses.dataclass(frozen=True)
class Refused:
  """A field that changes the output and that the server does not do yet: a 400 naming it, unless it is left out,
  null, or one of `noop` (values that change nothing). `example` is a value that is refused (the tests send it);
  `chat_noop` and `chat_example` replace them on the chat route where its defaults differ. `routes`: where the
  field means something."""
  noop: tuple = ()
  example: Any = True
  routes: tuple = ROUTES
  chat_noop: Optional[tuple] = None
  chat_example: Any = None
  why: str = ""  # why not, where that helps the client (the message says it)

  def noops(self, route: str) -> tuple:
    return self.chat_noop if route == "chat" and self.chat_noop is not None else self.noop

  def refused_example(self, route: str):
    return self.chat_example if route == "chat" and self.chat_noop is not None else self.example

  def accepts(self, value, route: str) -> bool:
    return value is None or any(_same(value, n) for n in self.noops(route))

  def message(self, name: str, route: str) -> str:
    ok = ", ".join(["left out", "null", *(json.dumps(n) for n in self.noops(route))])
    return f"{name} is not supported yet (accepted: {ok})" + (f": {self.why}" if self.why else "")


OFF = Refused(noop=(False,))  # a switch that is off by default
# vLLM's guided_grammar and structured_outputs.grammar: EBNF or Lark grammars, which spec_jax/grammar cannot compile
GRAMMAR_WHY = ("a grammar (EBNF, Lark) describes a context-free language, and this server's grammar engine "
               "(outlines-core) compiles regular languages only; send a regular language as a regex (guided_regex, "
               "structured_outputs.regex) or JSON as a schema (guided_json, response_format)")
ABSENT = Refused(example={"x": 1})
ALLOWED_WHY = ("the sampler's per-request token constraints are logit_bias's (at most 300 ids); a mask over the "
               "whole vocabulary is not there yet: send logit_bias, or a regex (guided_regex)")  # every value changes the output: only null or left out pass

# Every OpenAI (Completions, Chat Completions) and vLLM request field, and what the server does with it.
# Honoured: the server does it (api.py's routes and engine_request). Harmless: it does not change the tokens.
# Refused: a 400 naming it unless null, left out or a no-op value. A field in neither model nor table is ignored.
FIELDS: dict[str, Union[str, Refused]] = {
    # the request itself
    "model": HONOURED, "prompt": HONOURED, "messages": HONOURED,
    "max_tokens": HONOURED, "max_completion_tokens": HONOURED,  # the latter wins when both are sent
    "temperature": HONOURED, "top_p": HONOURED, "top_k": HONOURED, "seed": HONOURED, "stop": HONOURED,
    "stream": HONOURED, "stream_options": HONOURED,  # include_usage
    "speculate": HONOURED, "return_token_ids": HONOURED,  # our extension; vLLM's
    "tenant": HONOURED,  # ours: whose shared history the suffix method drafts from
    "cache_salt": HONOURED,  # vLLM's: with the tenant, the prefix cache's salt (serve/engine/block_manager.py)
    "segment": HONOURED,  # ours: the traffic tag a speculative policy rule may match
    # what does not change the tokens
    "user": HARMLESS, "metadata": HARMLESS, "store": HARMLESS, "service_tier": HARMLESS,
    "prompt_cache_key": HARMLESS, "safety_identifier": HARMLESS, "request_id": HARMLESS,
    "priority": HARMLESS,  # scheduling order only
    "prediction": HARMLESS,  # OpenAI's predicted outputs: a latency hint, the tokens are the same
    "parallel_tool_calls": HARMLESS,  # one call per answer either way (serve/http/tools.py)
    "guided_decoding_backend": HARMLESS,  # there is one: spec_jax/grammar
    "length_penalty": HARMLESS,  # only scores beams; use_beam_search is refused
    "return_tokens_as_token_ids": HONOURED,  # the logprobs' token strings as "token_id:<id>"
    "include_reasoning": HARMLESS,  # no reasoning parser: nothing is split out of the text
    "mm_processor_kwargs": HARMLESS,  # content is text only
    # more than one choice, scores, echoes
    "n": HONOURED,  # a choice per sample (serve/http/choices.py)
    "best_of": Refused(noop=(1,), example=2, routes=("chat",)),  # honoured on completions (serve/http/choices.py)
    "logprobs": HONOURED, "top_logprobs": HONOURED, "prompt_logprobs": HONOURED,  # serve/http/logprobs_format.py
    "echo": HONOURED,  # completions: the prompt and its logprobs; chat: a final assistant turn's content (vLLM's)
    "suffix": Refused(noop=("",), example="x"),
    # penalties and token constraints: exact at every verified position (spec_jax/controls.py)
    "presence_penalty": HONOURED, "frequency_penalty": HONOURED, "repetition_penalty": HONOURED, "min_p": HONOURED,
    "min_tokens": HONOURED, "ignore_eos": HONOURED, "logit_bias": HONOURED, "stop_token_ids": HONOURED,
    "bad_words": Refused(noop=([],), example=["cat"]),
    "allowed_token_ids": Refused(example=[5, 6], why=ALLOWED_WHY),
    "logits_processors": Refused(noop=([],), example=["m.f"]),
    "use_beam_search": Refused(noop=(False,), why="beam search is not implemented (sampling and greedy are)"),
    "truncate_prompt_tokens": HONOURED, "truncation_side": HONOURED,  # vLLM's: keep the last (or first) N tokens
    "prompt_embeds": Refused(example="AAAA"),
    # the text and the prompt's tokens: special tokens skipped, stop strings dropped, BOS as vLLM adds it by default
    "include_stop_str_in_output": OFF, "skip_special_tokens": Refused(noop=(True,), example=False),
    "spaces_between_special_tokens": Refused(noop=(True,), example=False),
    "add_special_tokens": Refused(noop=(True,), example=False, chat_noop=(False,), chat_example=True),
    # structured output, tools, other modalities and models
    # (structured outputs: serve/http/structured.py and serve/http/tools.py, a grammar automaton stepped in the loop)
    "response_format": HONOURED, "guided_json": HONOURED, "guided_regex": HONOURED, "guided_choice": HONOURED,
    "structured_outputs": HONOURED, "tools": HONOURED, "tool_choice": HONOURED,
    "guided_grammar": Refused(example='root ::= "a"', why=GRAMMAR_WHY),
    "guided_whitespace_pattern": Refused(example="[ ]*"),  # JSON's whitespace is at most one space
    "functions": Refused(noop=([],), example=[{"name": "f"}]),
    "function_call": Refused(noop=("none", "auto"), example={"name": "f"}),
    "modalities": Refused(noop=(["text"],), example=["text", "audio"]), "audio": ABSENT,
    "reasoning_effort": Refused(example="low"), "verbosity": Refused(example="low"),
    "web_search_options": Refused(example={}),
    # the chat template
    "add_generation_prompt": HONOURED, "continue_final_message": HONOURED,  # chat: vLLM's prompt rendering
    "chat_template": Refused(example="{{ messages }}", routes=("chat",)),
    "chat_template_kwargs": Refused(noop=({},), example={"enable_thinking": True}, routes=("chat",)),
    "documents": Refused(noop=([],), example=[{"text": "a"}], routes=("chat",)),
}


def refuse_unsupported(body: BaseModel, route: str) -> None:
  """A 400 naming the first field of FIELDS that this route refuses and the body sets to a value that changes
  the output. Declared fields are read as validated, the others from the body's extras."""
  extra = body.model_extra or {}
  for name, rule in FIELDS.items():
    if isinstance(rule, Refused) and route in rule.routes:
      value = getattr(body, name) if name in type(body).model_fields else extra.get(name)
      if not rule.accepts(value, route):
        raise APIError(400, rule.message(name, route), name)


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="allow")
  include_usage: Optional[StrictBool] = False
  continuous_usage_stats: Optional[StrictBool] = False  # vLLM's: every chunk carries the usage so far


class _Sampling(BaseModel):
  """The sampling fields both routes share, with OpenAI's ranges (temperature >= 0, 0 < top_p <= 1, penalties in
  [-2, 2]); floats must be finite. top_k (-1 or 0: off) and the extensions are vLLM's."""
  model_config = ConfigDict(extra="allow", allow_inf_nan=False)
  model: StrictStr
  max_tokens: Optional[Count] = None
  temperature: Optional[float] = Field(None, ge=0)
  top_p: Optional[float] = Field(None, gt=0, le=1)
  top_k: Optional[TopK] = None
  seed: Optional[Seed] = None
  stop: Optional[Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)]]] = None
  n: Optional[Count] = 1
  stream: Optional[StrictBool] = False
  stream_options: Optional[StreamOptions] = None
  logprobs: Optional[Union[StrictBool, StrictInt]] = None
  top_logprobs: Optional[TopLogprobs] = None
  presence_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
  frequency_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
  logit_bias: Optional[dict[str, float]] = None
  repetition_penalty: Optional[float] = Field(None, gt=0)
  min_p: Optional[float] = Field(None, ge=0, le=1)
  min_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None
  ignore_eos: Optional[StrictBool] = None
  stop_token_ids: Optional[Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=16)]] = None
  user: Optional[StrictStr] = None
  max_completion_tokens: Optional[Count] = None
  speculate: Optional[StrictBool] = True
  return_token_ids: Optional[StrictBool] = False
  tenant: Optional[Annotated[StrictStr, Field(max_length=256)]] = None
  segment: Optional[Annotated[StrictStr, Field(max_length=256)]] = None
  cache_salt: Optional[Annotated[StrictStr, Field(min_length=1, max_length=256)]] = None  # vLLM: not empty
  truncate_prompt_tokens: Optional[integer(ge=-1)] = None  # vLLM's: N keeps N prompt tokens, -1 the context's
  truncation_side: Optional[Literal["left", "right"]] = None  # left (default): keep the last N

  def check_supported(self) -> None:
    """What the models accept but the server cannot honour exactly yet: a 400 that names the field (FIELDS)."""
    refuse_unsupported(self, "chat" if isinstance(self, ChatRequest) else "completions")
    if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's 400
      raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")

  def token_budget(self) -> tuple[Optional[int], str]:
    """The output budget and the field it came from: max_completion_tokens wins over max_tokens, as on vLLM."""
    if self.max_completion_tokens is not None:
      return self.max_completion_tokens, "max_completion_tokens"
    return self.max_tokens, "max_tokens"

  def stop_list(self) -> list:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    return [s for s in stops if s]


class CompletionRequest(_Sampling):
  prompt: Union[StrictStr, list[StrictStr], list[Int], list[list[Int]]]
  echo: Optional[StrictBool] = False
  suffix: Optional[StrictStr] = None
  best_of: Optional[Count] = None


class TextPart(BaseModel):
  model_config = ConfigDict(extra="allow")
  type: Literal["text"]
  text: StrictStr


class ChatMessage(BaseModel):
  """A turn; "model" is Gemma's name for the assistant. Only text content (a string or text parts); an assistant
  turn may instead carry tool_calls and a tool turn answers one (serve/http/tools.py renders both)."""
  model_config = ConfigDict(extra="allow")
  role: Literal["system", "user", "assistant", "model", "tool"]
  content: Optional[Union[StrictStr, list[TextPart]]] = None

  @model_validator(mode="after")
  def _has_content(self):
    if self.content is None and not (self.role == "assistant" and self.model_extra.get("tool_calls")):
      raise ValueError("content is required (null only in an assistant turn with tool_calls)")
    return self


class ChatRequest(_Sampling):
  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  add_generation_prompt: Optional[StrictBool] = True  # vLLM's: false renders no opening of a new model turn
  continue_final_message: Optional[StrictBool] = False  # vLLM's: the last (assistant) turn is left open
  echo: Optional[StrictBool] = False  # vLLM's: the answer begins with that last assistant turn's content


class SpeculationSwitch(BaseModel):
  """POST /admin/speculation: turn speculation on or off for every request, at once."""
  enabled: StrictBool


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_dict(u) -> dict:
  """prompt/completion tokens as OpenAI counts them (with the prompt tokens the prefix cache held as
  prompt_tokens_details.cached_tokens), plus the request's speculation counters; the drafted
  tokens that were not accepted are also reported as OpenAI's `rejected_prediction_tokens`."""
  return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
          "total_tokens": u.prompt_tokens + u.completion_tokens, "drafted_tokens": u.drafted_tokens,
          "accepted_tokens": u.accepted_tokens, "num_drafts": u.drafts,
          "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
          "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_tokens,
                                        "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens}}


def completion_body(rid: str, model: str, text: str, finish: str, usage, token_ids=None, prompt_ids=None) -> dict:
  choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
  if token_ids is not None:
    choice.update(token_ids=token_ids, prompt_token_ids=prompt_ids)
  return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice],
          "usage": usage_dict(usage)}


def completion_chunk(rid: str, model: str, text: str, finish: Optional[str], token_ids=None, usage=None,
                     with_usage_field: bool = False) -> dict:
  choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
  if token_ids is not None:
    choice["token_ids"] = token_ids
  body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
  if with_usage_field:
    body["usage"] = None
  return body


def chat_body(rid: str, model: str, text: str, finish: str, usage, token_ids=None, prompt_ids=None) -> dict:
  choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
  if token_ids is not None:
    choice.update(token_ids=token_ids, prompt_token_ids=prompt_ids)
  return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": [choice],
          "usage": usage_dict(usage)}


def chat_chunk(rid: str, model: str, delta: dict, finish: Optional[str], token_ids=None,
               with_usage_field: bool = False) -> dict:
  choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
  if token_ids is not None:
    choice["token_ids"] = token_ids
  body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
          "choices": [choice]}
  if with_usage_field:
    body["usage"] = None
  return body


def usage_chunk(rid: str, model: str, obj: str, usage) -> dict:
  return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
          "usage": usage_dict(usage)}


def prompt_fields_on_top(body: dict) -> None:
  """A chat answer has one prompt: its prompt_token_ids and prompt_logprobs sit at the response's top level, where
  vLLM puts them (a completion's stay in each choice, one per prompt, as there)."""
  for key in ("prompt_token_ids", "prompt_logprobs"):
    values = [c.pop(key) for c in body["choices"] if key in c]
    if values:
      body[key] = values[0]


def progress_usage(c) -> dict:
  """A streamed choice's usage so far (vLLM's continuous_usage_stats)."""
  return {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.ids),
          "total_tokens": len(c.prompt_ids) + len(c.ids)}


def model_card(name: str, cfg: dict, capacity: int) -> dict:
  """A /v1/models entry with vLLM's extra fields: root (the checkpoint served), parent (null: not a LoRA adapter)
  and max_model_len."""
  return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "spec_jax",
          "root": cfg.get("model") or name, "parent": None, "max_model_len": capacity}


def server_version() -> str:
  """GET /version (vLLM's route): the installed spec_jax's version."""
  try:
    return metadata.version("spec_jax")
  except metadata.PackageNotFoundError:  # run from a checkout that is not installed
    return "0+unknown"


def validation_error(e: RequestValidationError, content_type: Optional[str] = None) -> APIError:
  """FastAPI's first validation error as a 400 that names the field (`param`), as OpenAI's API does; a body sent
  with a Content-Type that is not JSON (curl's -d without -H sends a form) is a 400 that says so."""
  err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
  if tuple(err.get("loc", ())) == ("body",) and content_type and not is_json(content_type):
    return APIError(400, f"the body must be JSON, sent with the header 'Content-Type: application/json' (this "
                    f"request's Content-Type is {content_type!r})")
  if err.get("type") == "json_invalid":
    return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
  field = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
  got = f" (got {str(err['input'])[:80]!r})" if "input" in err and field else ""
  return APIError(400, f"{field or 'body'}: {err['msg']}{got}", param=field or None)


def is_json(content_type: str) -> bool:
  kind = content_type.split(";")[0].strip().lower()
  return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
