"""An OpenAI-compatible streaming server over the continuous-batching engine (FastAPI + uvicorn).

  python -m serve.server --config=configs/gemma3_270m.py --host=127.0.0.1 --port=8000
  python -m serve.server --speculative_config='{"method": "ngram", "num_speculative_tokens": 4}' --max_num_seqs=8

Routes: /v1/completions, /v1/chat/completions (Gemma's chat template), /v1/models, /health, /metrics (Prometheus)
and POST /admin/speculation {"enabled": bool} (rollback without restart). `--api_key` guards /v1 and /admin.
SIGTERM stops taking requests, lets running ones finish (up to --drain_timeout_s) and exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import sys
import time

from absl import app, flags
from fastapi import Request

from serve import run_flags


def define_flags() -> None:
  """The command line, defined only when this module runs as a script: the module is also imported in-process
  (build_engine, create_app) next to other absl programs that define --config."""
  run_flags.define()  # --config, the model, sampling and speculation flags (serve.generate's)
  # Server settings (a config file may also hold them; explicit flags win).
  flags.DEFINE_string("host", None, "Bind address (default 127.0.0.1: loopback only).")
  flags.DEFINE_integer("port", None, "Port (default 8000).")
  flags.DEFINE_string("speculative_config", None,
                      "vLLM-style JSON, inline or a file: method, num_speculative_tokens, prompt_lookup_min/max, model; "
                      "or {\"per_concurrency\": {\"1\": {...}, ...}}. '{}' = off. Unset: the config's method.")
  flags.DEFINE_integer("max_num_seqs", None, "Decode slots (requests decoded together).")
  flags.DEFINE_integer("max_queue", None, "Requests that may wait beyond the free slots; more get 429.")
  flags.DEFINE_integer("max_model_len", None, "Tokens per slot (prompt + output + k + 1).")
  flags.DEFINE_integer("steps_per_sync", None, "Decode steps per engine iteration (between host syncs).")
  flags.DEFINE_float("timing_probe_s", None, "Every this many seconds while drafting, time one propose() and one "
                    "step on the live batch (the proposer's share of a step in /metrics); 0 = never.")
  flags.DEFINE_string("api_key", None, "When set, /v1 and /admin need 'Authorization: Bearer KEY'.")
  flags.DEFINE_string("served_model_name", None, "The model id clients send (default: the --model file's or "
                      "directory's name without extension; gemma-3-270m for the packaged model).")
  flags.DEFINE_string("guardrails", None, "Automatic rollback, JSON inline or a file (serve/guardrails.py).")
  flags.DEFINE_float("request_timeout_s", None, "A request still unfinished after this long fails with 504.")
  flags.DEFINE_float("drain_timeout_s", None, "SIGTERM: how long running requests may take to finish.")
  flags.DEFINE_list("warmup_prompt_lens", None, "Compile insert for these prompt lengths before serving.")
  flags.DEFINE_string("log_level", None, "debug, info, warning.")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache: a restart loads the compiled "
                      "programs instead of compiling again ('' = off; default ~/.cache/spec_jax/xla).")


FLAGS = flags.FLAGS
SERVER_DEFAULTS = dict(host="127.0.0.1", port=8000, speculative_config=None, max_num_seqs=4, max_queue=64,
                       max_model_len=2048, steps_per_sync=8, timing_probe_s=10.0, api_key=None,
                       served_model_name=None,
                       guardrails=None, costs_file=None, request_timeout_s=600.0, drain_timeout_s=30.0,
                       warmup_prompt_lens=["1"], log_level="info", compilation_cache_dir="~/.cache/spec_jax/xla",
                       mesh="")
log = logging.getLogger("spec_jax.server")


def settings() -> dict:
  """Config file fields, overridden by explicit flags; server fields fall back to SERVER_DEFAULTS."""
  cfg = run_flags.settings(more=tuple(n for n in SERVER_DEFAULTS if n not in run_flags.RUN_FLAGS),
                           defaults=SERVER_DEFAULTS)
  if not cfg["served_model_name"]:
    cfg["served_model_name"] = default_model_name(cfg.get("model") or "")
  return cfg


def default_model_name(model: str) -> str:
  """What clients call the model when --served_model_name is not given: the checkpoint's name, as vLLM does."""
  if not model:
    return "gemma-3-270m"
  name = os.path.basename(os.path.normpath(model))
  return name[:-len(".gguf")] if name.endswith(".gguf") else name


# ------------------------------------------------------------------------------------------------ the engine

def build_engine(cfg: dict):
  """-> (Engine, tokenizer, SpecConfig): loads the model and proposer, compiles nothing yet."""
  import numpy as np

  from serve.engine import Engine
  from serve.guardrails import GuardrailConfig
  from serve.spec_config import cost_table, parse_speculative_config
  from spec_jax import adaptive
  from spec_jax.checkpoints.load import load_model
  from spec_jax.config import validate_sampling
  from spec_jax.decode import LoopSpec
  from spec_jax.kernels import resolve_impl
  from spec_jax.proposers.registry import build_proposer

  validate_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"])
  for name in ("max_num_seqs", "steps_per_sync", "max_model_len", "max_new_tokens"):
    if cfg[name] < 1:
      raise ValueError(f"--{name} must be >= 1, got {cfg[name]}")
  if cfg["timing_probe_s"] < 0:
    raise ValueError(f"--timing_probe_s must be >= 0, got {cfg['timing_probe_s']}")
  sc = parse_speculative_config(cfg["speculative_config"], cfg)
  guard = GuardrailConfig.parse(cfg["guardrails"])
  impl = resolve_impl(cfg["attention_impl"])
  config, params, tokenizer = load_model(cfg["model"] or None, cfg["dtype"], cfg.get("quantize") or "none")
  proposer, proposer_params = build_proposer(
      sc.method, target_config=config, target_params=params, k=sc.k, ngram_min=sc.ngram_min, ngram_max=sc.ngram_max,
      draft_layers=sc.draft_layers, impl=impl, heads_path=sc.model or None, topk=sc.eagle_topk,
      num_draft_tokens=sc.num_draft_tokens, model_path=cfg["model"] or None, dtype=cfg["dtype"],
      draft_quantize=sc.quantization, draft_model=cfg.get("draft_model") or None)
  # k = 0 is always an option, so the global switch (and a request's speculate=false) can turn drafting off.
  ks = {0} | set(adaptive.option_set(sc.k, cfg["adaptive"], proposer.tree)) | {k for _, k in sc.per_concurrency}
  ks = tuple(sorted(k for k in ks if k <= sc.k))
  from spec_jax import backend, sharding
  mesh = sharding.make_mesh(cfg["mesh"])
  # the state's rows (the engine adds one for bf16 x 1 on CPU, and pads to a multiple of the mesh's data axis)
  B = sharding.pad_rows(backend.batch_rows(params, cfg["max_num_seqs"]), mesh)
  base = None
  if cfg["costs_file"] and sc.k:
    from serve.step_costs import load_costs, method_key
    try:
      base = load_costs(cfg["costs_file"], method_key(proposer), cfg["dtype"], ks, B)
    except ValueError as e:  # measured for other draft lengths (a per-concurrency file can add some)
      log.warning("%s: %s; using the default cost model", cfg["costs_file"], e)
  costs = cost_table(sc, ks, B, base)
  if sc.k and not cfg["adaptive"]:
    costs[:, 0] = np.float32(1e9)  # adaptive off: always the full k while speculation is on
  stop_ids = tuple(sorted(set(config.eos_ids) | set(tokenizer.stop_ids)))
  spec = LoopSpec(config=config, proposer=proposer, ks=ks, stop_ids=stop_ids, impl=impl, mesh=mesh)
  capacity = min(cfg["max_model_len"], config.max_seq_len)
  both = sharding.shard_params({"target": params, "proposer": proposer_params}, mesh)
  engine = Engine(both, spec, tokenizer, max_num_seqs=cfg["max_num_seqs"],
                  capacity=capacity, max_queue=cfg["max_queue"], steps_per_sync=cfg["steps_per_sync"], costs=costs,
                  spec_config=sc, guardrails=guard, request_timeout_s=cfg["request_timeout_s"], seed=cfg["seed"],
                  timing_probe_s=cfg["timing_probe_s"])
  return engine, tokenizer, sc


# ---------------------------------------------------------------------------------------------------- HTTP

def create_app(engine, tokenizer, cfg: dict):
  """The FastAPI app over a started engine."""
  from fastapi import FastAPI
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import JSONResponse, Response, StreamingResponse
  from prometheus_client import CONTENT_TYPE_LATEST
  from pydantic import ValidationError
  from starlette.exceptions import HTTPException

  from serve.engine import EngineStopped, QueueFull
  from serve.output_stream import Output
  from serve.protocol import (APIError, ChatRequest, CompletionRequest, chat_body, chat_chunk, completion_body,
                              completion_chunk, new_id, usage_chunk)

  model_name = cfg["served_model_name"]
  api_key = cfg["api_key"]
  metrics = engine.metrics
  api = FastAPI(title="spec_jax", docs_url=None, redoc_url=None, openapi_url=None)

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
    return error_response(APIError(400, f"invalid request: {e.errors()[:3]}"))

  @api.exception_handler(HTTPException)
  async def _http(request, e):
    return error_response(APIError(e.status_code, str(e.detail)))

  @api.exception_handler(Exception)
  async def _unexpected(request, e):
    log.exception("unhandled error")
    metrics.errors.labels(kind="server").inc()
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

  @api.middleware("http")
  async def _auth(request: Request, call_next):
    path = request.url.path
    if api_key and (path.startswith("/v1") or path.startswith("/admin")):
      header = request.headers.get("authorization", "")
      if not hmac.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
        return error_response(APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                       code="invalid_api_key"))
    return await call_next(request)

  async def parse(request: Request, cls):
    raw = await request.body()
    try:
      obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise APIError(400, f"malformed JSON body: {e}")
    if not isinstance(obj, dict):
      raise APIError(400, "the body must be a JSON object")
    try:
      body = cls.model_validate(obj)
    except ValidationError as e:
      err = e.errors()[0]
      field = ".".join(str(x) for x in err["loc"])
      raise APIError(400, f"{field}: {err['msg']} (got {str(err.get('input'))[:80]!r})", param=field)
    if body.model != model_name:
      raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                     param="model", code="model_not_found")
    body.check_supported()
    return body

  def engine_request(body, prompt_ids: list, max_tokens, output: Output):
    if max_tokens is not None and max_tokens < 1:
      raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    room = engine.capacity - len(prompt_ids) - engine.spec.lookahead - 1
    if max_tokens is None:
      max_tokens = min(cfg["max_new_tokens"], room)
      if max_tokens < 1:
        raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the context of "
                       f"{engine.capacity} tokens", "prompt")
    elif max_tokens > room:
      raise APIError(400, f"max_tokens={max_tokens} is over the limit: the prompt has {len(prompt_ids)} tokens, the "
                     f"context {engine.capacity} (speculation needs {engine.spec.lookahead + 1} more), so at most "
                     f"{max(room, 0)}", "max_tokens")
    top_k = body.top_k if body.top_k is not None else cfg["top_k"]
    try:
      return engine.make_request(
          prompt_ids, max_new=max_tokens,
          temperature=body.temperature if body.temperature is not None else cfg["temperature"],
          top_k=0 if top_k == -1 else top_k, top_p=body.top_p if body.top_p is not None else cfg["top_p"],
          speculate=body.speculate is not False,
          seed=body.seed % (1 << 31) if body.seed is not None else secrets.randbits(31),
          stop=body.stop_list(), output=output)
    except ValueError as e:
      raise APIError(400, str(e))

  def submit(req) -> None:
    try:
      engine.submit(req)
    except QueueFull as e:
      raise APIError(429, str(e), headers={"Retry-After": "1"})
    except EngineStopped as e:
      raise APIError(503, str(e))

  def new_output():
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    out = Output(lambda: loop.call_soon_threadsafe(event.set))
    return out, event

  async def next_delta(out, event):
    while True:
      d = out.take()
      if d is not None:
        return d
      await event.wait()
      event.clear()

  async def collect(request: Request, req, out, event):
    """Non-streaming: wait for the end; a client that goes away aborts the request."""
    text, ids = [], []
    while True:
      try:
        d = await asyncio.wait_for(next_delta(out, event), timeout=1.0)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          engine.abort(req)
          raise APIError(499, "client disconnected")
        continue
      text.append(d.text)
      ids.extend(d.token_ids)
      if d.error:
        status, kind, msg = d.error
        raise APIError(status, msg, code=kind)
      if d.finished:
        return "".join(text), ids, d

  def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

  def stream(req, out, event, chunk_fn, first: list, usage_obj: str, include_usage: bool, with_ids: bool):
    rid = new_id("chatcmpl" if usage_obj == "chat.completion.chunk" else "cmpl")

    async def gen():
      try:
        for c in first:
          yield sse(c(rid))
        while True:
          d = await next_delta(out, event)
          if d.text or d.token_ids:
            yield sse(chunk_fn(rid, d.text, None, d.token_ids if with_ids else None, include_usage))
          if d.error:  # headers are sent: the error goes in the stream, as vLLM sends it
            status, kind, msg = d.error
            yield sse(APIError(status, msg, code=kind).body())
            break
          if d.finished:
            yield sse(chunk_fn(rid, "", d.finish_reason, None, include_usage))
            if include_usage and d.usage is not None:
              yield sse(usage_chunk(rid, model_name, usage_obj, d.usage))
            break
        yield "data: [DONE]\n\n"
      finally:
        if not req.finished:
          engine.abort(req)  # the client went away (or the server is stopping): free the slot

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

  @api.post("/v1/completions")
  async def completions(request: Request):
    body = await parse(request, CompletionRequest)
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
      if len(p) != 1:
        raise APIError(400, f"one prompt per request (got {len(p)})", "prompt")
      p = p[0]
    if isinstance(p, str):
      if not p:
        raise APIError(400, "the prompt is empty", "prompt")
      prompt_ids = tokenizer.encode(p)
    else:
      if not p:
        raise APIError(400, "the prompt is empty", "prompt")
      bad = [t for t in p if not 0 <= t < engine.spec.config.vocab_size]
      if bad:
        raise APIError(400, f"prompt token ids outside the vocabulary: {bad[:5]}", "prompt")
      prompt_ids = list(p)
    out, event = new_output()
    req = engine_request(body, prompt_ids, body.max_tokens, out)
    submit(req)
    with_ids = bool(body.return_token_ids)
    if body.stream:
      include = bool(body.stream_options and body.stream_options.include_usage)
      chunk = lambda rid, text, fin, ids, wu: completion_chunk(rid, model_name, text, fin, ids, with_usage_field=wu)
      return stream(req, out, event, chunk, [], "text_completion", include, with_ids)
    text, ids, d = await collect(request, req, out, event)
    return completion_body(new_id("cmpl"), model_name, text, d.finish_reason, d.usage,
                           ids if with_ids else None, prompt_ids if with_ids else None)

  @api.post("/v1/chat/completions")
  async def chat(request: Request):
    body = await parse(request, ChatRequest)
    if not body.messages:
      raise APIError(400, "messages is empty", "messages")
    try:
      prompt_text = tokenizer.apply_chat_template(body.messages)
    except (ValueError, TypeError) as e:
      raise APIError(400, f"messages: {e}", "messages")
    prompt_ids = tokenizer.encode(prompt_text)
    out, event = new_output()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = engine_request(body, prompt_ids, max_tokens, out)
    submit(req)
    with_ids = bool(body.return_token_ids)
    if body.stream:
      include = bool(body.stream_options and body.stream_options.include_usage)
      chunk = lambda rid, text, fin, ids, wu: chat_chunk(rid, model_name, {"content": text} if fin is None else {},
                                                         fin, ids, with_usage_field=wu)
      first = [lambda rid: chat_chunk(rid, model_name, {"role": "assistant", "content": ""}, None,
                                      with_usage_field=include)]
      return stream(req, out, event, chunk, first, "chat.completion.chunk", include, with_ids)
    text, ids, d = await collect(request, req, out, event)
    return chat_body(new_id("chatcmpl"), model_name, text, d.finish_reason, d.usage,
                     ids if with_ids else None, prompt_ids if with_ids else None)

  @api.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "spec_jax", "max_model_len": engine.capacity}]}

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

  @api.get("/admin/speculation")
  async def speculation_status():
    return engine.status()

  @api.post("/admin/speculation")
  async def speculation_switch(request: Request):
    raw = await request.body()
    try:
      obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise APIError(400, f"malformed JSON body: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("enabled"), bool):
      raise APIError(400, 'expected {"enabled": true|false}', "enabled")
    engine.set_speculation(obj["enabled"])
    return engine.status()

  return api


# ---------------------------------------------------------------------------------------------------- main

def serve(cfg: dict) -> None:
  import jax
  import uvicorn

  if cfg["compilation_cache_dir"] and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg["compilation_cache_dir"]))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  engine, tokenizer, sc = build_engine(cfg)
  t0 = time.perf_counter()
  engine.start(warmup_prompt_lens=[int(n) for n in cfg["warmup_prompt_lens"]])
  log.info("engine warm in %.1f s", time.perf_counter() - t0)
  api = create_app(engine, tokenizer, cfg)

  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      log.info("signal %s: draining (up to %g s)", sig, cfg["drain_timeout_s"])
      engine.begin_drain()
      super().handle_exit(sig, frame)
      if sig == signal.SIGTERM and sig in getattr(self, "_captured_signals", []):
        self._captured_signals.remove(sig)  # uvicorn re-raises it after the drain: a drained stop exits 0

  server = Server(uvicorn.Config(api, host=cfg["host"], port=cfg["port"], log_level="warning", access_log=False,
                                 timeout_graceful_shutdown=cfg["drain_timeout_s"], lifespan="off"))

  def announce():
    while not server.started and not server.should_exit:
      time.sleep(0.02)
    if server.started:
      log.info("ready: http://%s:%d/v1 model=%s slots=%d max_model_len=%d speculation=%s", cfg["host"], cfg["port"],
               cfg["served_model_name"], engine.B, engine.capacity, sc.describe())

  import threading
  threading.Thread(target=announce, daemon=True).start()
  server.run()
  engine.shutdown(grace_s=cfg["drain_timeout_s"])
  log.info("stopped")


def main(argv):
  del argv
  cfg = settings()
  logging.basicConfig(level=getattr(logging, str(cfg["log_level"]).upper(), logging.INFO),
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
  try:
    serve(cfg)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  define_flags()
  app.run(main)
