"""An OpenAI-compatible streaming server over the continuous-batching engine (FastAPI + uvicorn).

  python -m serve.server --config=configs/gemma3_270m.py --host=127.0.0.1 --port=8000
  python -m serve.server --speculative_config='{"method": "ngram", "num_speculative_tokens": 4}' --max_num_seqs=8

Routes (serve/http/api.py): /v1/completions, /v1/chat/completions (the model's chat template), /v1/models, /health,
/metrics (Prometheus), /openapi.json and POST /admin/speculation {"enabled": bool} (rollback without restart);
`--api_key` guards /v1 and /admin.
SIGTERM stops taking requests (a 503), lets running and queued ones finish for up to --drain_timeout_s, then ends
those left with a 503 (a stream: an OpenAI error event and [DONE]) and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import uvicorn
from absl import app, flags

from serve.engine import timing_probe
from serve.engine.engine import Engine
from serve.engine.guardrails import GuardrailConfig
from serve.engine.live_ab import SwitchbackConfig
from serve.http import model_card, warmup
from serve.http.api import create_app
from serve.jobs import run_flags, setup as setup_lib
from serve.jobs.setup import use_compilation_cache
from serve.many_hosts import multihost
from spec_jax import backend, sharding


SERVER_FLAGS = ("host", "port", "max_num_seqs", "max_queue", "max_model_len", "steps_per_sync", "timing_probe_s",
                "api_key", "served_model_name", "guardrails", "switchback", "request_timeout_s", "drain_timeout_s",
                "warmup_prompt_lens", "log_level", "compilation_cache_dir", "strict", "max_logprobs", "logprobs_mode",
                "grammar_capacity", "block_size", "num_kv_blocks", "kv_cache_memory_bytes", "enable_prefix_caching",
                "poison_freed_pages", "kv_speculation_yields", "extended_warmup",
                "default_max_tokens",
                # many hosts (serve/many_hosts/multihost.py): serve.evaluate's jax.distributed start-up flags
                "coordinator_address", "num_processes", "process_id", "initialization_timeout", "heartbeat_timeout")


def define_flags() -> None:
  """The command line, defined only when this module runs as a script: the module is also imported in-process
  (build_engine) next to other absl programs that define --config. Server settings may also sit in a config file;
  explicit flags win."""
  run_flags.define(*SERVER_FLAGS)


FLAGS = flags.FLAGS
SERVER_DEFAULTS = dict(host="127.0.0.1", port=8000, max_num_seqs=4, max_queue=64,
                       max_model_len=2048, steps_per_sync=8, timing_probe_s=10.0, api_key=None,
                       served_model_name=None,
                       guardrails=None, switchback=None, costs_file=None, request_timeout_s=600.0, drain_timeout_s=30.0,
                       warmup_prompt_lens=["1", "17", "33"], log_level="info",
                       compilation_cache_dir="~/.cache/spec_jax/xla",
                       mesh="", strict=False, max_logprobs=20, logprobs_mode="raw_logprobs",
                       grammar_capacity=["2048", "512"], block_size=16, num_kv_blocks=0,
                       kv_cache_memory_bytes=0, enable_prefix_caching=True, poison_freed_pages=False,
                       kv_speculation_yields=True, extended_warmup=True, default_max_tokens=0)
log = logging.getLogger("spec_jax.server")
SHUTDOWN_MARGIN_S = 5.0  # after the drain's deadline, for the cut requests' error events to reach their clients


def settings() -> dict:
  """Config file fields, overridden by explicit flags; server fields fall back to SERVER_DEFAULTS."""
  cfg = run_flags.settings(more=SERVER_FLAGS, defaults=SERVER_DEFAULTS)
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

def build_engine(cfg: dict, table_class=None):
  """-> (Engine, tokenizer, SpecConfig): loads the model and proposer (serve/jobs/setup.py), compiles nothing yet.
  table_class: the engine's slot table class (serve/many_hosts/multihost.py's on many hosts)."""
  for name in ("max_num_seqs", "steps_per_sync", "max_model_len", "max_new_tokens"):
    if cfg[name] < 1:
      raise ValueError(f"--{name} must be >= 1, got {cfg[name]}")
  if cfg["timing_probe_s"] < 0:
    raise ValueError(f"--timing_probe_s must be >= 0, got {cfg['timing_probe_s']}")
  guard = GuardrailConfig.parse(cfg["guardrails"])
  switchback = SwitchbackConfig.parse(cfg.get("switchback"))
  setup = setup_lib.load(cfg)
  sc = setup.spec_config
  if switchback is not None and sc.k == 0:
    raise ValueError("--switchback compares speculation on and off: set a speculative method with "
                     "num_speculative_tokens > 0")
  # k = 0 is always an option, so the global switch (and a request's speculate=false) can turn drafting off.
  ks = setup_lib.draft_lengths(setup, cfg["adaptive"], switchable=True)
  # the state's rows (the engine adds one for bf16 x 1 on CPU, and pads to a multiple of the mesh's data axis)
  rows = sharding.pad_rows(backend.batch_rows(setup.params, cfg["max_num_seqs"]), setup.mesh)
  costs = setup_lib.step_costs(cfg, setup, ks, rows)
  if cfg.get("max_logprobs", 20) < -1:
    raise ValueError(f"--max_logprobs must be >= -1 (-1: off), got {cfg['max_logprobs']}")
  spec = setup_lib.loop_spec(setup, ks, max_logprobs=cfg.get("max_logprobs", 20))
  capacity = min(cfg["max_model_len"], setup.config.max_seq_len)
  both = sharding.shard_params({"target": setup.params, "proposer": setup.proposer_params}, setup.mesh)
  engine = Engine(both, spec, setup.tokenizer, max_num_seqs=cfg["max_num_seqs"],
                  capacity=capacity, max_queue=cfg["max_queue"], steps_per_sync=cfg["steps_per_sync"], costs=costs,
                  spec_config=sc, guardrails=guard, request_timeout_s=cfg["request_timeout_s"], seed=cfg["seed"],
                  timing_probe_s=cfg["timing_probe_s"], switchback=switchback,
                  grammar_capacity=grammar_capacity(cfg["grammar_capacity"]),
                  kv_pool={k: cfg[k] for k in ("block_size", "num_kv_blocks", "kv_cache_memory_bytes",
                                               "enable_prefix_caching", "poison_freed_pages",
                                               "kv_speculation_yields")},
                  table_class=table_class)
  return engine, setup.tokenizer, sc


def grammar_capacity(value):
  """--grammar_capacity=STATES,CLASSES -> (states, classes); empty -> None (no structured outputs)."""
  if not value or value == [""]:
    return None
  try:
    states, classes = (int(v) for v in value)
  except ValueError:
    raise ValueError(f"--grammar_capacity takes STATES,CLASSES (two integers), got {','.join(value)}") from None
  if states < 1 or classes < 2:
    raise ValueError(f"--grammar_capacity: at least 1 state and 2 token classes, got {states},{classes}")
  return states, classes


# ---------------------------------------------------------------------------------------------------- main

def serve(cfg: dict) -> None:
  # Many hosts (serve/many_hosts/multihost.py): every process builds the same engine; process 0 serves, the others mirror it.
  cluster = multihost.join(cfg)  # None: one process
  log.info("%s", use_compilation_cache(cfg["compilation_cache_dir"]))
  engine, tokenizer, sc = build_engine(cfg, table_class=multihost.table_class(cluster))
  if cluster is not None and cluster.role == "follower":
    multihost.follow(engine, cluster, timing_probe.untimed_loop)
    multihost.exit_now(0)
  if cluster is not None:
    multihost.lead(engine.table, cluster)
  log_model_card(cfg, tokenizer)
  t0 = time.perf_counter()
  lens = [int(n) for n in cfg["warmup_prompt_lens"]]
  # With the extended warm-up the engine thread compiles every length's bucket as traffic runs it (serve/http/warmup.py);
  # Engine.start's own inserts (on a state placed differently) then need only one, for the loop.
  engine.start(warmup_prompt_lens=lens[:1] if cfg["extended_warmup"] else lens)
  log.info("engine warm in %.1f s (the loop, insert for prompt length %s)", time.perf_counter() - t0,
           lens[0] if cfg["extended_warmup"] else ",".join(map(str, lens)))
  api = create_app(engine, tokenizer, cfg)
  if cfg["extended_warmup"]:
    extended_warmup(api, engine, cfg)

  drain = cfg["drain_timeout_s"]

  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      if not engine.draining:
        log.info("signal %s: draining (up to %g s)", sig, drain)
        engine.begin_drain()
        # at the deadline the engine ends what is left with a 503 (an error event and [DONE] in a stream), and
        # uvicorn, which waits a little longer, sees every response end rather than cutting them
        cut = threading.Timer(drain, engine.cut_all, [f"the server is shutting down: its drain of {drain:g} s "
                                                      "(--drain_timeout_s) ended before this request did"])
        cut.daemon = True  # a drain that ends early does not wait for it
        cut.start()
      super().handle_exit(sig, frame)
      if sig == signal.SIGTERM and sig in getattr(self, "_captured_signals", []):
        self._captured_signals.remove(sig)  # uvicorn re-raises it after the drain: a drained stop exits 0

  server = Server(uvicorn.Config(api, host=cfg["host"], port=cfg["port"], log_level="warning", access_log=False,
                                 timeout_graceful_shutdown=drain + SHUTDOWN_MARGIN_S, lifespan="off"))

  def announce():
    while not server.started and not server.should_exit:
      time.sleep(0.02)
    if server.started:
      log.info("ready: http://%s:%d/v1 model=%s slots=%d max_model_len=%d speculation=%s", cfg["host"], cfg["port"],
               cfg["served_model_name"], engine.B, engine.capacity, sc.describe())

  threading.Thread(target=announce, daemon=True).start()
  server.run()
  engine.shutdown(grace_s=1.0)  # what is left was cut at the drain's deadline
  if cluster is not None:
    cluster.stop()  # the followers end after the calls sent so far
  log.info("stopped")
  if cluster is not None:
    multihost.exit_now(0)  # not jax.distributed's exit barrier: the followers are gone already


def extended_warmup(api, engine, cfg: dict) -> None:
  """The requests clients send first, through the app before the port opens (serve/http/warmup.py), timed in the log."""
  t0 = time.perf_counter()
  done = warmup.run(api, cfg, engine.spec.max_logprobs, engine.table.grammar_capacity is not None,
                    engine.spec.config.vocab_size)
  log.info("extended warm-up in %.1f s: %s (--extended_warmup=false skips it; its requests count in /metrics)",
           time.perf_counter() - t0, ", ".join(f"{n} {s:.1f} s" + ("" if c == 200 else f" (HTTP {c})")
                                               for n, s, c in done))


def log_model_card(cfg: dict, tokenizer) -> None:
  """Say what a base model (no chat template of its own: Gemma 3 270M from the packaged GGUF) means for chat and
  tools, so a chat answer that continues the prompt does not look like a server bug."""
  note = model_card.base_model_note(cfg.get("model") or "", tokenizer)
  if note:
    log.warning("%s", note)


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
    print(f"error: {e}", file=sys.stderr, flush=True)
    if multihost.joined():
      multihost.exit_now(2)  # no exit barrier of jax.distributed: the other processes may be gone
    sys.exit(2)


if __name__ == "__main__":
  define_flags()
  app.run(main)
