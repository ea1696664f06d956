"""The HTTP API over a started engine: OpenAI's /v1/completions and /v1/chat/completions, /v1/models, /health,
/metrics and /admin/speculation (FastAPI).

The request bodies are serve/http/protocol.py's pydantic models, so FastAPI validates them and publishes them at
/openapi.json, as vLLM does. Every error is OpenAI's error object: a body that fails validation is a 400 naming
its field, never FastAPI's 422. The API key (`--api_key`) is a dependency of the /v1 and /admin routes; /health,
/metrics and /openapi.json stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from serve.http import choices as ch
from serve.http import structured, tool_stream, tools
from serve.engine.request_queue import EngineStopped, QueueFull
from serve.http.event_stream import ChoiceEvents, abort_unfinished
from serve.http.logprobs_format import Formatter, ask_of
from serve.engine.output_stream import Output
from serve.http.protocol import (APIError, ChatRequest, CompletionRequest, SpeculationSwitch, chat_body,
                            completion_body, model_card, new_id, prompt_fields_on_top, server_version,
                            validation_error)
from serve.http.request_prompt import chat_echo, chat_prompt, truncated
from serve.http.body_to_spec import ServerDefaults, request_spec

log = logging.getLogger("spec_jax.server")
MAX_CHOICES = 128  # prompts x n in one request: each choice is a request in the engine's queue
ERROR_KINDS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 503: "unavailable"}  # errors' metric


def install_error_handlers(api: FastAPI, metrics) -> None:
  """Every error as OpenAI's error object, counted: a body that fails validation is a 400 naming its field."""

  def error_response(e: APIError) -> JSONResponse:
    if e.status in ERROR_KINDS:
      metrics.errors.labels(kind=ERROR_KINDS[e.status]).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  @api.exception_handler(APIError)
  async def _api_error(request, e: APIError):
    return error_response(e)

  @api.exception_handler(RequestValidationError)
  async def _validation(request, e):
    return error_response(validation_error(e, request.headers.get("content-type")))

  @api.exception_handler(HTTPException)
  async def _http(request, e):
    return error_response(APIError(e.status_code, str(e.detail)))

  @api.exception_handler(Exception)
  async def _unexpected(request, e):
    log.exception("unhandled error")
    metrics.errors.labels(kind="server").inc()
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)


def authorization(api_key: Optional[str]):
  """The /v1 and /admin routes' dependency: the bearer token must be --api_key, when the server has one."""
  bearer = HTTPBearer(auto_error=False, description="--api_key, when the server has one")

  async def authorized(cred: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
    if api_key and (cred is None or not hmac.compare_digest(cred.credentials.encode(), api_key.encode())):
      raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

  return authorized


async def next_delta(out, event):
  while True:
    d = out.take()
    if d is not None:
      return d
    await event.wait()
    event.clear()


async def collect(request: Request, c, event) -> None:
  """Non-streaming: wait for the choice's end; a client that goes away aborts the request."""
  while c.final is None:
    try:
      d = await asyncio.wait_for(next_delta(c.output, event), timeout=1.0)
    except asyncio.TimeoutError:
      if await request.is_disconnected():
        raise APIError(499, "client disconnected")
      continue
    c.add(d)
    if d.error:
      status, kind, msg = d.error
      raise APIError(status, msg, code=kind)


class Completions:
  """The completion routes' one path: a body's prompts -> a spec per (prompt, sample) (serve/engine/request_spec.py) ->
  the engine -> a stream or the whole answer."""

  def __init__(self, engine, tokenizer, cfg: dict):
    self.engine, self.tokenizer = engine, tokenizer
    self.model_name, self.api_key = cfg["served_model_name"], cfg["api_key"]
    self.defaults = ServerDefaults.of(cfg)
    self.grammars = structured.Grammars(tokenizer)

  def checked(self, body):
    if body.model != self.model_name:
      raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                     param="model", code="model_not_found")
    body.check_supported()
    return body

  def tenant_of(self, body) -> str:
    """Whose shared history a request may draft from: the API key's (one key: one identity) and within it the
    request's extra_body `tenant`, so that a client never names itself into another key's history."""
    return ("key/" if self.api_key else "") + (body.tenant or "")

  def completion_prompts(self, body, limits) -> list:
    """A completions body's prompts -> (token ids, text) each, truncated as the body asks."""
    p = body.prompt
    many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    if len(many) * max(body.n or 1, body.best_of or 1) > MAX_CHOICES:
      field = "best_of" if (body.best_of or 1) > (body.n or 1) else "n"
      raise APIError(400, f"{len(many)} prompts x {field}={getattr(body, field)} is over {MAX_CHOICES} choices per "
                     "request", field)
    prompts = []
    for p in many:
      if not p:
        raise APIError(400, "the prompt is empty", "prompt")
      if isinstance(p, str):
        ids = self.tokenizer.encode(p)
      else:
        bad = [t for t in p if not 0 <= t < limits.vocab_size]
        if bad:
          raise APIError(400, f"prompt token ids outside the vocabulary: {bad[:5]}", "prompt")
        ids, p = list(p), None
      kept = truncated(ids, body, limits)
      prompts.append((kept, p if p is not None and kept == ids else self.tokenizer.decode(kept, skip_special=True)))
    return prompts

  def submit(self, choices: list) -> None:
    """Every choice's request into the engine's queue, or none (a 429 when the queue is full, 503 stopping)."""
    try:
      for c in choices:
        self.engine.submit(c.req)
    except (QueueFull, EngineStopped) as e:
      for c in choices:
        if c.req is not None:
          self.engine.abort(c.req)
      raise (APIError(429, str(e), headers={"Retry-After": "1"}) if isinstance(e, QueueFull)
             else APIError(503, str(e)))

  async def choices(self, body, prompts: list, limits, ask, gen: int, plan, event) -> list:
    """A choice per (prompt, sample), each request checked (a 400) before anything runs."""
    loop = asyncio.get_running_loop()
    grammar = await self.grammars.automaton(plan, limits)  # one automaton for every choice
    top = max(ask.top, 0) if gen > (body.n or 1) else ask.top
    out = []
    for p, (ids, text) in enumerate(prompts):
      for i in range(gen):
        c = ch.Choice(index=p * gen + i, prompt_ids=ids, prompt_text=text, first_sample=i == 0,
                      output=Output(lambda: loop.call_soon_threadsafe(event.set)))
        spec = request_spec(body, ids, limits, self.defaults, tenant=self.tenant_of(body), sample=i, top=top,
                            grammar=grammar)
        c.req = self.engine.make_request(spec, c.output)
        out.append(c)
    if ask.prompt_top >= 0:  # one forward of each prompt, beside the engine's loop
      for first in out[::gen]:
        entries = await loop.run_in_executor(None, self.engine.prompt_logprobs, first.prompt_ids, ask.prompt_top)
        for c in out[first.index:first.index + gen]:
          c.prompt_entries = entries
    return out

  async def complete(self, request: Request, body, prompts: list, limits, *, chat: bool, plan=structured.Plan(),
                     echo: str = ""):
    """Both routes: the choices, then a stream or the whole answer. prompts: (token ids, text) per prompt."""
    event = asyncio.Event()
    ask = ask_of(body, chat, limits.max_logprobs)
    fmt = Formatter(self.tokenizer, as_ids=(body.model_extra or {}).get("return_tokens_as_token_ids") is True)
    self.engine.metrics.request_params_n.observe(body.n or 1)
    gen = ch.generated_per_prompt(body, limits.max_logprobs)  # best_of: more samples than choices, by logprob
    choices = await self.choices(body, prompts, limits, ask, gen, plan, event)
    self.submit(choices)
    with_ids = bool(body.return_token_ids)
    if body.stream:
      include = bool(body.stream_options and body.stream_options.include_usage)
      return ChoiceEvents(self.engine, self.model_name, choices, event, ask, fmt, chat=chat, include_usage=include,
                          with_ids=with_ids, plan=plan, echo=echo,
                          continuous=include and bool(body.stream_options.continuous_usage_stats)).response()
    try:
      for c in choices:
        await collect(request, c, event)
    finally:
      abort_unfinished(self.engine, choices)
    return self.answer(ch.best(choices, gen, body.n or 1), ch.total_usage(choices), fmt, ask, chat=chat,
                       with_ids=with_ids, plan=plan, echo=echo)

  def answer(self, choices: list, usage, fmt, ask, *, chat: bool, with_ids: bool, plan, echo: str) -> dict:
    """The non-streamed response: usage counts every generated sample, `choices` the ones returned."""
    make, choice = (chat_body, ch.chat_choice) if chat else (completion_body, ch.completion_choice)
    out = make(new_id("chatcmpl" if chat else "cmpl"), self.model_name, "", "stop", usage)
    out["choices"] = [choice(fmt, c, ask, with_ids) for c in choices]
    if chat:
      prompt_fields_on_top(out)
      for body_choice in out["choices"]:  # chat echo: the continued turn's content first
        if echo and body_choice["message"]["content"] is not None:
          body_choice["message"]["content"] = echo + body_choice["message"]["content"]
    if plan.tools:  # a choice whose whole text is one valid call answers with tool_calls
      for c, body_choice in zip(choices, out["choices"]):
        tool_stream.answer({"choices": [body_choice]}, plan.tools, "".join(c.text), forced=plan.regex is not None)
    return out

  async def completion(self, body: CompletionRequest, request: Request):
    self.checked(body)
    limits = self.engine.limits()
    prompts = self.completion_prompts(body, limits)
    return await self.complete(request, body, prompts, limits, chat=False, plan=structured.plan(body, "completions"))

  async def chat(self, body: ChatRequest, request: Request):
    self.checked(body)
    plan = structured.plan(body, "chat")
    try:
      text = chat_prompt(self.tokenizer, tools.render([m.model_dump() for m in body.messages], plan.tools), body)
    except (ValueError, TypeError, KeyError) as e:
      raise APIError(400, f"messages: {e}", "messages")
    if (body.n or 1) > MAX_CHOICES:
      raise APIError(400, f"n={body.n} is over {MAX_CHOICES} choices per request", "n")
    limits = self.engine.limits()
    ids = truncated(self.tokenizer.encode(text), body, limits)
    return await self.complete(request, body, [(ids, text)], limits, chat=True, plan=plan, echo=chat_echo(body))


def create_app(engine, tokenizer, cfg: dict) -> FastAPI:
  """The app: the completion routes (Completions), /v1/models, /version, /admin/speculation, /health, /metrics."""
  metrics, model_name = engine.metrics, cfg["served_model_name"]
  # A body without a Content-Type is read as JSON, as FastAPI did before `strict_content_type` (default on since).
  lenient = {"strict_content_type": False} if "strict_content_type" in inspect.signature(FastAPI).parameters else {}
  api = FastAPI(title="spec_jax", description="OpenAI-compatible speculative decoding server",
                docs_url=None, redoc_url=None, **lenient)
  install_error_handlers(api, metrics)
  guarded = APIRouter(dependencies=[Depends(authorization(cfg["api_key"]))])
  routes = Completions(engine, tokenizer, cfg)

  @guarded.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request):
    return await routes.completion(body, request)

  @guarded.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: Request):
    return await routes.chat(body, request)

  @guarded.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card(model_name, cfg, engine.capacity)]}

  @api.get("/version")
  async def version():
    return {"version": server_version()}

  @guarded.get("/admin/speculation")
  async def speculation_status():
    return engine.status()

  @guarded.get("/admin/speculation/report")
  async def speculation_report():
    return engine.live_report()

  @guarded.post("/admin/speculation")
  async def speculation_switch(body: SpeculationSwitch):
    engine.set_speculation(body.enabled)
    return engine.status()

  @api.get("/health")
  async def health():
    if not engine.alive:
      return JSONResponse({"status": "engine stopped"}, status_code=503)
    if engine.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    running, waiting = engine.counts()
    return {"status": "ok", "running": running, "waiting": waiting}

  @api.get("/metrics")
  async def prometheus():
    metrics.observe_occupancy(*engine.counts())  # as of the scrape, not the last engine iteration
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

  api.include_router(guarded)
  return api
