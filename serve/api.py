"""The HTTP API over a started engine: OpenAI's /v1/completions and /v1/chat/completions, /v1/models, /health,
/metrics and /admin/speculation (FastAPI).

The request bodies are serve/protocol.py's pydantic models, so FastAPI validates them and publishes them at
/openapi.json, as vLLM does. Every error is OpenAI's error object: a body that fails validation is a 400 naming
its field, never FastAPI's 422. The API key (`--api_key`) is a dependency of the /v1 and /admin routes; /health,
/metrics and /openapi.json stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import secrets
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from serve import choices as ch
from serve import structured, tool_stream, tools
from serve.engine import EngineStopped, QueueFull
from serve.logprobs_format import Formatter, ask_of, prompt_entries
from serve.output_stream import Output
from serve.tool_stream import ToolCallStream, choice_chunks
from serve.event_stream import EventStream, abort_unfinished
from serve.protocol import (APIError, ChatRequest, CompletionRequest, SpeculationSwitch, chat_body, chat_chunk,
                            completion_body, completion_chunk, model_card, new_id, progress_usage,
                            prompt_fields_on_top, server_version, usage_chunk,
                            validation_error)
from serve.request_prompt import chat_echo, chat_prompt, default_max_tokens, truncated

log = logging.getLogger("spec_jax.server")
MAX_CHOICES = 128  # prompts x n in one request: each choice is a request in the engine's queue


def create_app(engine, tokenizer, cfg: dict) -> FastAPI:
  model_name = cfg["served_model_name"]
  api_key = cfg["api_key"]
  metrics = engine.metrics
  max_logprobs = engine.spec.max_logprobs
  # A body without a Content-Type is read as JSON, as FastAPI did before `strict_content_type` (default on since).
  lenient = {"strict_content_type": False} if "strict_content_type" in inspect.signature(FastAPI).parameters else {}
  api = FastAPI(title="spec_jax", description="OpenAI-compatible speculative decoding server",
                docs_url=None, redoc_url=None, **lenient)

  def error_response(e: APIError) -> JSONResponse:
    kinds = {400: "bad_request", 401: "unauthorized", 404: "not_found", 503: "unavailable"}
    if e.status in kinds:
      metrics.errors.labels(kind=kinds[e.status]).inc()
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

  bearer = HTTPBearer(auto_error=False, description="--api_key, when the server has one")

  async def authorized(cred: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
    if api_key and (cred is None or not hmac.compare_digest(cred.credentials.encode(), api_key.encode())):
      raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

  guarded = APIRouter(dependencies=[Depends(authorized)])

  def checked(body):
    if body.model != model_name:
      raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                     param="model", code="model_not_found")
    body.check_supported()
    return body

  def tenant_of(body) -> str:
    """Whose shared history a request may draft from: the API key's (one key: one identity) and within it the
    request's extra_body `tenant`, so that a client never names itself into another key's history."""
    return ("key/" if api_key else "") + (body.tenant or "")

  def engine_request(body, prompt_ids: list, output: Output, sample: int = 0, top: int = -1, grammar=None):
    max_tokens, budget_field = body.token_budget()
    room = engine.capacity - len(prompt_ids) - engine.spec.lookahead - 1
    if max_tokens is None:
      max_tokens = default_max_tokens(engine, cfg, len(prompt_ids))
      if max_tokens < 1:
        raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the context of "
                       f"{engine.capacity} tokens", "prompt")
    elif max_tokens > room:
      raise APIError(400, f"{budget_field}={max_tokens} is over the limit: the prompt has {len(prompt_ids)} tokens, "
                     f"the context {engine.capacity} (speculation needs {engine.spec.lookahead + 1} more), so at "
                     f"most {max(room, 0)}", budget_field)
    top_k = body.top_k if body.top_k is not None else cfg["top_k"]
    try:
      return engine.make_request(
          prompt_ids, max_new=max_tokens,
          temperature=body.temperature if body.temperature is not None else cfg["temperature"],
          top_k=0 if top_k == -1 else top_k, top_p=body.top_p if body.top_p is not None else cfg["top_p"],
          speculate=body.speculate is not False,
          seed=(body.seed + sample) % (1 << 31) if body.seed is not None else secrets.randbits(31),
          stop=body.stop_list(), output=output, tenant=tenant_of(body),
          tag=body.segment or ("structured" if grammar is not None else ""),  # the policy's "structured" segment
          controls=dict(presence=body.presence_penalty or 0.0, frequency=body.frequency_penalty or 0.0,
                        repetition=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
                        min_p=body.min_p or 0.0, min_tokens=body.min_tokens or 0, ignore_eos=bool(body.ignore_eos),
                        logit_bias=body.logit_bias or None, stop_token_ids=tuple(body.stop_token_ids or ())),
          logprobs=(top, cfg.get("logprobs_mode", "raw_logprobs")), grammar=grammar, cache_salt=body.cache_salt)
    except ValueError as e:
      field = getattr(e, "field", None)
      raise APIError(400, str(e), budget_field if field == "max_tokens" else field)

  def submit(req) -> None:
    try:
      engine.submit(req)
    except QueueFull as e:
      raise APIError(429, str(e), headers={"Retry-After": "1"})
    except EngineStopped as e:
      raise APIError(503, str(e))

  async def next_delta(out, event):
    while True:
      d = out.take()
      if d is not None:
        return d
      await event.wait()
      event.clear()

  async def collect(request: Request, c, event):
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

  def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

  def stream(choices: list, event, ask, fmt, *, chat: bool, include_usage: bool, with_ids: bool, plan,
             continuous: bool = False, echo: str = ""):
    rid = new_id("chatcmpl" if chat else "cmpl")
    by_index = {c.index: c for c in choices}
    # a chat answer that may be a tool call streams as delta.tool_calls (serve/tool_stream.py)
    calls = {c.index: ToolCallStream(plan.tools, plan.regex is not None) for c in choices} if plan.tools else {}
    obj = "chat.completion.chunk" if chat else "text_completion"

    def wrap(choice) -> dict:
      body = (chat_chunk(rid, model_name, {}, None, with_usage_field=include_usage) if chat else
              completion_chunk(rid, model_name, "", None, with_usage_field=include_usage))
      body["choices"] = [choice]
      if continuous:  # vLLM's continuous_usage_stats: the choice's usage so far in every chunk
        body["usage"] = progress_usage(by_index[choice["index"]])
      return body

    def end(c) -> list:
      reason, last = c.final.finish_reason, []
      if c.index in calls:
        deltas, reason = calls[c.index].finish(reason)
        last = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
      done = {"index": c.index, "logprobs": None, "finish_reason": reason}
      done.update({"delta": {}} if chat else {"text": ""})
      if with_ids:
        done["token_ids"] = []
      return last + [done]

    async def gen():
      try:
        if chat:
          for c in choices:
            first = wrap({"index": c.index, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                          "finish_reason": None})
            if with_ids:  # vLLM's: the prompt's ids once, at the top of the first chunk
              first["prompt_token_ids"] = c.prompt_ids
            yield sse(first)
        live = list(choices)
        while live:
          moved = False
          for c in list(live):
            d = c.output.take()
            if d is None:
              continue
            moved = True
            c.add(d)
            piece = (ch.chat_delta if chat else ch.completion_delta)(fmt, c, d, ask, with_ids)
            for p in (choice_chunks(calls[c.index], piece) if c.index in calls else [piece] if piece else []):
              yield sse(wrap(p))
            if d.error:  # headers are sent: the error goes in the stream, as vLLM sends it
              status, kind, msg = d.error
              yield sse(APIError(status, msg, code=kind).body())
              live = []
              break
            if d.finished:
              for p in end(c):
                yield sse(wrap(p))
              live.remove(c)
          if live and not moved:
            await event.wait()
            event.clear()
        if include_usage and all(c.final is not None and not c.final.error for c in choices):
          yield sse(usage_chunk(rid, model_name, obj, ch.total_usage(choices)))
        yield "data: [DONE]\n\n"
      finally:
        abort_unfinished(engine, choices)

    return EventStream(gen(), lambda: abort_unfinished(engine, choices))

  compiler = []  # the grammar compiler (spec_jax/grammar), made on first use: ~1 s for a 262k vocabulary

  async def compile_grammar(plan):
    """The plan's automaton (compiled off the event loop: 0.5-10 s for a schema at 262k tokens, then cached)."""
    if plan.regex is None:
      return None
    from spec_jax.grammar.automaton import Compiler, GrammarError
    if engine.table.grammar_capacity is None:
      raise APIError(400, f"{plan.field}: structured outputs are off on this server (--grammar_capacity)",
                     plan.field)
    if not compiler:
      compiler.append(await once("compiler", lambda: Compiler(tokenizer, engine.spec.stop_ids)))
    try:
      return await once(("regex", plan.regex), lambda: compiler[0].regex(plan.regex))
    except GrammarError as e:
      raise APIError(400, f"{plan.field}: {e}", plan.field)

  compiling: dict = {}  # key -> the task computing it: concurrent requests with one schema wait on one task (no
  # executor thread each); the Compiler itself also compiles a pattern once for concurrent callers

  async def once(key, fn):
    """fn() off the event loop, once for all callers that ask for `key` while it runs (a compiled automaton is
    then in the compiler's cache; a failure reaches every waiter, and the next request tries again)."""
    task = compiling.get(key)
    if task is None:
      task = compiling[key] = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, fn))
      task.add_done_callback(lambda _: compiling.pop(key, None))
    return await asyncio.shield(task)

  async def complete(request: Request, body, prompts: list, *, chat: bool, plan=structured.Plan(), echo: str = ""):
    """The one path of both routes: a choice per (prompt, sample), then a stream or the whole answer. prompts:
    (token ids, text) per prompt."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    ask = ask_of(body, chat, max_logprobs)
    fmt = Formatter(tokenizer, as_ids=(body.model_extra or {}).get("return_tokens_as_token_ids") is True)
    n = body.n or 1
    metrics.request_params_n.observe(n)
    gen = ch.generated_per_prompt(body, max_logprobs)  # best_of: more samples than choices, ranked by logprob
    grammar = await compile_grammar(plan)  # one automaton for every choice
    choices = []
    for p, (ids, text) in enumerate(prompts):
      for i in range(gen):  # each request checked (a 400) before anything runs
        c = ch.Choice(index=p * gen + i, prompt_ids=ids, prompt_text=text, first_sample=i == 0,
                      output=Output(lambda: loop.call_soon_threadsafe(event.set)))
        c.req = engine_request(body, ids, c.output, sample=i, top=max(ask.top, 0) if gen > n else ask.top,
                               grammar=grammar)
        choices.append(c)
    if ask.prompt_top >= 0:  # one forward of each prompt, beside the engine's loop
      for first in choices[::gen]:
        entries = await loop.run_in_executor(None, prompt_entries, engine, first.prompt_ids, ask.prompt_top)
        for c in choices[first.index:first.index + gen]:
          c.prompt_entries = entries
    try:
      for c in choices:
        submit(c.req)
    except APIError:
      for c in choices:
        if c.req is not None:
          engine.abort(c.req)
      raise
    with_ids = bool(body.return_token_ids)
    if body.stream:
      include = bool(body.stream_options and body.stream_options.include_usage)
      continuous = include and bool(body.stream_options.continuous_usage_stats)
      return stream(choices, event, ask, fmt, chat=chat, include_usage=include, with_ids=with_ids, plan=plan,
                    continuous=continuous, echo=echo)
    try:
      for c in choices:
        await collect(request, c, event)
    finally:
      abort_unfinished(engine, choices)
    make, choice = (chat_body, ch.chat_choice) if chat else (completion_body, ch.completion_choice)
    out = make(new_id("chatcmpl" if chat else "cmpl"), model_name, "", "stop", ch.total_usage(choices))
    choices = ch.best(choices, gen, n)  # usage above counts every generated sample
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

  @guarded.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request):
    checked(body)
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
        ids = tokenizer.encode(p)
      else:
        bad = [t for t in p if not 0 <= t < engine.spec.config.vocab_size]
        if bad:
          raise APIError(400, f"prompt token ids outside the vocabulary: {bad[:5]}", "prompt")
        ids, p = list(p), None
      kept = truncated(ids, body, engine)
      prompts.append((kept, p if p is not None and kept == ids else tokenizer.decode(kept, skip_special=True)))
    return await complete(request, body, prompts, chat=False, plan=structured.plan(body, "completions"))

  @guarded.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: Request):
    checked(body)
    plan = structured.plan(body, "chat")
    try:
      prompt_text = chat_prompt(tokenizer, tools.render([m.model_dump() for m in body.messages], plan.tools), body)
    except (ValueError, TypeError, KeyError) as e:
      raise APIError(400, f"messages: {e}", "messages")
    if (body.n or 1) > MAX_CHOICES:
      raise APIError(400, f"n={body.n} is over {MAX_CHOICES} choices per request", "n")
    ids = truncated(tokenizer.encode(prompt_text), body, engine)
    return await complete(request, body, [(ids, prompt_text)], chat=True, plan=plan, echo=chat_echo(body))

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
