"""The one setup of every run command: the target, its tokenizer, the proposer of the speculative config, the loop
that jit compiles and the adaptive controller's step costs.

`serve.generate`, the server, `serve.calibrate` and `serve.evaluate` build a Setup from their run settings
(serve/jobs/run_flags.py); the SpecConfig (spec_jax/spec_config.py) is the only thing that names the method. The
loop's LoopSpec is what the speculative config compiles to: the proposer, the draft lengths the controller may
pick, the stop ids, the kernel and the mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from serve.jobs.step_costs import load_costs, method_key
from spec_jax import adaptive as adaptive_lib, decode, pair_check, sharding
from spec_jax.cache import kv_storage_dtype
from spec_jax.checkpoints.load import load_model
from spec_jax.config import validate_sampling
from spec_jax.kernels import resolve_impl
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig

log = logging.getLogger("spec_jax.setup")
FORBIDDEN_COST = 1e9  # a step cost the adaptive controller never picks


@dataclasses.dataclass(frozen=True)
class Setup:
  target: Any  # registry.Target: the model's config and params, the attention kernel, its checkpoint and dtype
  tokenizer: Any
  spec_config: SpecConfig
  proposer: Any
  proposer_params: Any
  mesh: Any = None

  @property
  def config(self):
    return self.target.config

  @property
  def params(self):
    return self.target.params

  @property
  def impl(self) -> str:
    return self.target.impl

  @property
  def kv_cache_dtype(self) -> str:
    return self.target.kv_cache_dtype

  @property
  def stop_ids(self) -> tuple:
    return tuple(sorted(set(self.config.eos_ids) | set(self.tokenizer.stop_ids)))

  @property
  def lookahead(self) -> int:
    """Cache entries a step writes past the committed tokens, before a loop exists (decode.lookahead)."""
    return decode.lookahead(self.proposer.k, self.proposer.tree)

  def with_spec(self, spec: SpecConfig) -> "Setup":
    """The same target with another speculative config's proposer (serve.evaluate's arms)."""
    proposer, proposer_params = build_proposer(spec, self.target)
    return dataclasses.replace(self, spec_config=spec, proposer=proposer, proposer_params=proposer_params)


DEFAULT_COMPILATION_CACHE = "~/.cache/spec_jax/xla"


def use_compilation_cache(path: Optional[str]) -> str:
  """Turn on JAX's persistent compilation cache at `path` (None: the default; "": off) unless
  JAX_COMPILATION_CACHE_DIR already names one; -> a line saying where it is and how to turn it off. A compiled
  program is keyed by everything that shapes it (code, shapes, flags, jaxlib), so a stale one is never loaded."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return f"persistent compilation cache: {os.environ['JAX_COMPILATION_CACHE_DIR']} (from JAX_COMPILATION_CACHE_DIR)"
  if path == "":
    return "persistent compilation cache: off (--compilation_cache_dir is empty)"
  where = os.path.expanduser(path or DEFAULT_COMPILATION_CACHE)
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return (f"persistent compilation cache: {where} (a rerun loads the compiled programs; --compilation_cache_dir= "
          "turns it off)")


def kv_cache_dtype_warning(kv_cache_dtype: str, backend: str) -> Optional[str]:
  """What to tell a user whose 8-bit cache is slow on this backend, or None: XLA:CPU has no float8_e4m3 arithmetic
  and converts it element by element (a decode step ~5x `auto`'s here); TPUs and GPUs convert it in hardware."""
  if backend == "cpu" and kv_storage_dtype(kv_cache_dtype) == jnp.float8_e4m3fn:
    return (f"--kv_cache_dtype={kv_cache_dtype} (float8_e4m3) is converted in software on CPU: a decode step costs "
            "~5x auto's here (BENCHMARKS.md, 'Cost per decode step on this CPU'); int8 takes the same bytes at 0-5 % "
            "above auto's step cost on CPU. fp8 is for chips that convert it in hardware (TPU, H100/H200).")
  return None


def load_target(cfg: dict):
  """-> (Target, tokenizer, mesh): cfg's model, dtype, quantize, attention_impl, kv_cache_dtype and mesh, without a
  proposer."""
  validate_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"])  # the flags; a request's: serve/engine/request_spec.py
  if cfg["max_new_tokens"] < 1:
    raise ValueError(f"--max_new_tokens must be >= 1, got {cfg['max_new_tokens']}")
  mesh = sharding.make_mesh(cfg.get("mesh") or "")
  impl = resolve_impl(cfg["attention_impl"])
  kv_cache_dtype = cfg.get("kv_cache_dtype") or "auto"
  decode.check_kv_cache_dtype(kv_cache_dtype, impl)  # before the model loads
  if warning := kv_cache_dtype_warning(kv_cache_dtype, jax.default_backend()):
    log.warning(warning)
  config, params, tokenizer = load_model(cfg["model"] or None, cfg["dtype"], cfg.get("quantize") or "none")
  return Target(config, params, impl=impl, model_path=cfg["model"] or None, dtype=cfg["dtype"],
                kv_cache_dtype=kv_cache_dtype), tokenizer, mesh


def load(cfg: dict, spec: Optional[SpecConfig] = None) -> Setup:
  """The target (load_target) and `spec`'s proposer (default cfg["spec"]), after the static pair check
  (check_pair)."""
  spec = cfg["spec"] if spec is None else spec
  target, tokenizer, mesh = load_target(cfg)
  check_pair(cfg, spec, target, tokenizer)
  proposer, proposer_params = build_proposer(spec, target)
  return Setup(target, tokenizer, spec, proposer, proposer_params, mesh)


def check_pair(cfg: dict, spec: SpecConfig, target, tokenizer) -> list:
  """The static pair check (spec_jax/pair_check.py) before the head loads: a head that cannot fit the target is
  refused with a message naming the mismatch; a verifier that differs is a warning (an error with cfg["strict"])."""
  findings = pair_check.static_check(spec, target.config, tokenizer, cfg.get("model") or None)
  pair_check.enforce(findings, strict=bool(cfg.get("strict")), what=f"the {spec.method} head")
  return findings


def draft_lengths(setup: Setup, adaptive: bool, switchable: bool = False) -> tuple:
  """The k the adaptive controller may pick; `switchable` adds 0 (a server can turn drafting off per row and by
  its switch) and the speculative config's per-concurrency k."""
  spec, proposer = setup.spec_config, setup.proposer
  ks = set(adaptive_lib.option_set(proposer.k, adaptive, proposer.tree))
  if switchable:
    ks |= {0} | {k for _, k in spec.per_concurrency}
  return tuple(sorted(k for k in ks if k <= max(proposer.k, 0)))


def loop_spec(setup: Setup, ks: tuple, max_logprobs: int = -1):
  return decode.make_spec(setup.config, setup.proposer, ks=ks, stop_ids=setup.stop_ids, impl=setup.impl,
                          mesh=setup.mesh, max_logprobs=max_logprobs, kv_cache_dtype=setup.kv_cache_dtype)


def step_costs(cfg: dict, setup: Setup, ks: tuple, rows: int):
  """float32[rows, len(ks)] for the adaptive controller, or None with one option: --costs_file's measured table
  (the default cost model where it has no entry for these draft lengths), every k above the one the speculative
  config allows at each occupancy made prohibitive, and with adaptive off only the full k."""
  if len(ks) < 2:
    return None
  base = None
  if cfg.get("costs_file") and setup.proposer.k:
    try:
      base = load_costs(cfg["costs_file"], method_key(setup.proposer), cfg["dtype"], ks, rows)
    except ValueError as e:  # measured for other draft lengths (a per-concurrency file can add some)
      log.warning("%s: %s; using the default cost model", cfg["costs_file"], e)
  table = cost_table(setup.spec_config, ks, rows, base)
  if setup.proposer.k and not cfg["adaptive"] and ks[0] == 0:
    table[:, 0] = FORBIDDEN_COST  # adaptive off: always the full k while speculation is on
  return table


def cost_table(spec: SpecConfig, ks: tuple, rows: int, base=None) -> np.ndarray:
  """float32[rows, len(ks)]: `base` (a measured table, or the default cost model) with every k above the one `spec`
  allows at each occupancy made prohibitive."""
  table = np.broadcast_to(np.asarray(adaptive_lib.default_costs(ks) if base is None else base, np.float32),
                          (rows, len(ks))).copy()
  for a in range(1, rows + 1):
    allowed = spec.k_at(a)
    table[a - 1, [j for j, k in enumerate(ks) if k > allowed]] = FORBIDDEN_COST
  return table
