"""OpenAI request bodies (pydantic) and the response objects the server sends.

Unknown fields are accepted and ignored (clients send extras), but a known field of the wrong type is a 400.
Fields we cannot honour exactly (n > 1, logprobs, penalties, logit_bias, echo, suffix) are refused with a 400 that
names them rather than ignored. Two extensions ride in `extra_body`: `speculate: false` turns speculation off for
one request, and `return_token_ids: true` adds the prompt and completion token ids to the choice (as vLLM's
`return_token_ids` does).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class APIError(Exception):
  """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

  TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
           429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable", 504: "timeout"}

  def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               headers: Optional[dict] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                      "code": self.code if self.code is not None else self.status}}


def _integral(v):
  """JSON has one number type, and JSON Schema's "integer" includes 5.0: take an integral float as an int (a
  fractional one, a string or a boolean stays an error)."""
  return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


def integer(**bounds):
  """An integer field with its bounds (ge, le): the bounds go before the validator, or pydantic's JSON schema
  writes them as unknown keywords ("ge" for "minimum")."""
  return Annotated[StrictInt, Field(**bounds), BeforeValidator(_integral)]


Int, Count, TopK, TopLogprobs = integer(), integer(ge=1), integer(ge=-1), integer(ge=0, le=20)


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="allow")
  include_usage: Optional[StrictBool] = False


class _Sampling(BaseModel):
  """The sampling fields both routes share, with OpenAI's ranges (temperature >= 0, 0 < top_p <= 1, penalties in
  [-2, 2]); floats must be finite. top_k (-1 or 0: off) and the extensions are vLLM's."""
  model_config = ConfigDict(extra="allow", allow_inf_nan=False)
  model: StrictStr
  max_tokens: Optional[Count] = None
  temperature: Optional[float] = Field(None, ge=0)
  top_p: Optional[float] = Field(None, gt=0, le=1)
  top_k: Optional[TopK] = None
  seed: Optional[Int] = None
  stop: Optional[Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)]]] = None
  n: Optional[Count] = 1
  stream: Optional[StrictBool] = False
  stream_options: Optional[StreamOptions] = None
  logprobs: Optional[Union[StrictBool, StrictInt]] = None
  top_logprobs: Optional[TopLogprobs] = None
  presence_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
  frequency_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
  logit_bias: Optional[dict[str, float]] = None
  user: Optional[StrictStr] = None
  speculate: Optional[StrictBool] = True
  return_token_ids: Optional[StrictBool] = False

  def check_supported(self) -> None:
    """What the models accept but the server cannot honour exactly yet: a 400 that names the field."""
    if self.n not in (None, 1):
      raise APIError(400, f"n must be 1, got {self.n}", "n")
    if self.logprobs not in (None, False, 0):
      raise APIError(400, "logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name) not in (None, 0, 0.0):
        raise APIError(400, f"{name} is not supported (only 0)", name)
    if self.logit_bias:
      raise APIError(400, "logit_bias is not supported", "logit_bias")

  def stop_list(self) -> list:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    return [s for s in stops if s]


class CompletionRequest(_Sampling):
  prompt: Union[StrictStr, list[StrictStr], list[Int], list[list[Int]]]
  echo: Optional[StrictBool] = False
  suffix: Optional[StrictStr] = None
  best_of: Optional[Count] = None

  def check_supported(self) -> None:
    super().check_supported()
    if self.echo:
      raise APIError(400, "echo is not supported", "echo")
    if self.suffix:
      raise APIError(400, "suffix is not supported", "suffix")
    if self.best_of not in (None, 1):
      raise APIError(400, "best_of must be 1", "best_of")


class TextPart(BaseModel):
  model_config = ConfigDict(extra="allow")
  type: Literal["text"]
  text: StrictStr


class ChatMessage(BaseModel):
  """A turn; "model" is Gemma's name for the assistant. Only text content (a string or text parts)."""
  model_config = ConfigDict(extra="allow")
  role: Literal["system", "user", "assistant", "model"]
  content: Union[StrictStr, list[TextPart]]


class ChatRequest(_Sampling):
  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  max_completion_tokens: Optional[Count] = None


class SpeculationSwitch(BaseModel):
  """POST /admin/speculation: turn speculation on or off for every request, at once."""
  enabled: StrictBool


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_dict(u) -> dict:
  """prompt/completion tokens as OpenAI counts them, plus the request's speculation counters; the drafted
  tokens that were not accepted are also reported as OpenAI's `rejected_prediction_tokens`."""
  return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
          "total_tokens": u.prompt_tokens + u.completion_tokens, "drafted_tokens": u.drafted_tokens,
          "accepted_tokens": u.accepted_tokens, "num_drafts": u.drafts,
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
