"""An OpenAI-compatible streaming server over the continuous-batching engine (FastAPI + uvicorn).

  python -m serve.server --config=configs/gemma3_270m.py --host=127.0.0.1 --port=8000
  python -m serve.server --speculative_config='{"method": "ngram", "num_speculative_tokens": 4}' --max_num_seqs=8

Routes (serve/api.py): /v1/completions, /v1/chat/completions (the model's chat template), /v1/models, /health,
/metrics (Prometheus), /openapi.json and POST /admin/speculation {"enabled": bool} (rollback without restart);
`--api_key` guards /v1 and /admin.
SIGTERM stops taking requests, lets running ones finish (up to --drain_timeout_s) and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from absl import app, flags

from serve import run_flags


def define_flags() -> None:
  """The command line, defined only when this module runs as a script: the module is also imported in-process
  (build_engine) next to other absl programs that define --config."""
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
  from serve.api import create_app
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
  try:
    cfg = settings()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
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
