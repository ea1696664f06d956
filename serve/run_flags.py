"""The run settings every command shares, defined once: the model, sampling and speculation flags of
`serve.generate`, the server and `serve.calibrate` (which runs with generate's).

A config file (`--config`, ml_collections) gives the settings; a flag given on the command line overrides its
field, and a flag the config lacks fills it in.
"""

from __future__ import annotations

import importlib
import logging
import os

from absl import flags
from ml_collections import config_flags

from spec_jax.proposers.registry import METHODS

# absl's default verbosity is INFO, which would print jax's backend probing ("Unable to initialize backend 'tpu'")
# at every start of a command on a machine without that chip.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "gemma3_270m.py")


def _define_run_flags() -> None:
  flags.DEFINE_list("plugins", [], "Python modules to import first (e.g. my_pkg.my_proposer): each may register "
                    "proposers with spec_jax.proposers.registry.register, which --method and --speculative_config "
                    "then name.")
  flags.DEFINE_string("model", None, "A .gguf file or HF safetensors directory ('' = packaged Gemma 3 270M).")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weights and activations dtype.")
  flags.DEFINE_enum("attention_impl", None, ["auto", "xla", "pallas_gpu", "pallas_tpu"], "Attention kernel.")
  flags.DEFINE_integer("max_new_tokens", None, "New tokens per prompt (the server: a request's default max_tokens).")
  flags.DEFINE_float("temperature", None, "0 is greedy (the server: a request's default).")
  flags.DEFINE_integer("top_k", None, "0 is off (the server: a request's default).")
  flags.DEFINE_float("top_p", None, "1 is off (the server: a request's default).")
  flags.DEFINE_integer("seed", None, "Sampling seed (the server: its engine's stream; a request's seed picks its "
                       "first token).")
  flags.DEFINE_enum("quantize", None, ["none", "int8", "int4"], "Target weights: int8 per output channel, int4 per "
                    "32 inputs (spec_jax/quant.py); cached beside the checkpoint.")
  flags.DEFINE_string("method", None, f"Draft source, a name of spec_jax/proposers/registry.py ({', '.join(METHODS)}; "
                    "qdraft: the target's own weights quantized to --draft_quantize); the server's when "
                    "--speculative_config is not given.")
  flags.DEFINE_enum("draft_quantize", None, ["int8", "int4"], "method=qdraft: the draft's weights.")
  flags.DEFINE_string("heads", None, "Medusa/EAGLE/draft checkpoint (path stem); '' = the one in heads/.")
  flags.DEFINE_integer("num_speculative_tokens", None, "Tokens drafted per step (the largest k).")
  flags.DEFINE_integer("ngram_min", None, "Shortest suffix n-gram to match.")
  flags.DEFINE_integer("ngram_max", None, "Longest suffix n-gram to match.")
  flags.DEFINE_integer("draft_layers", None, "method=draft: 0 = the distilled draft checkpoint (--heads); N > 0 = "
                       "the early-exit self-draft of the target's first N layers.")
  flags.DEFINE_string("draft_model", None, "method=draft: an independent draft model with the target's vocabulary "
                      "(a .gguf, an HF safetensors directory or a packaged model's name); '' = none.")
  flags.DEFINE_integer("eagle_topk", None, "Token trees: candidates per node (1 = chains; medusa).")
  flags.DEFINE_integer("num_draft_tokens", None, "Token trees: node budget, root included (0 = 1 + depth * topk).")
  flags.DEFINE_bool("adaptive", None, "Adapt the number of drafted tokens per step (default on).")
  flags.DEFINE_string("mesh", None, "Device mesh 'data:N,model:M' (spec_jax/sharding.py): rows split over data, "
                      "heads/MLP/vocabulary over model. Default: one device.")
  flags.DEFINE_string("costs_file", None, "Step costs for the adaptive controller (serve.calibrate or serve.aot "
                      "--cost_table); '' = the default cost model; unset = the config's.")


RUN_FLAGS = ("model", "dtype", "attention_impl", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
             "quantize", "method", "draft_quantize", "heads", "num_speculative_tokens", "ngram_min", "ngram_max",
             "draft_layers", "draft_model", "eagle_topk", "num_draft_tokens", "adaptive", "mesh", "costs_file")
_config = None


def define() -> None:
  """--config and the run flags. Idempotent: a process may import several commands (the tests do)."""
  global _config
  if _config is None:
    _config = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG,
                                              "ml_collections config file: model, proposer and run settings.")
    _define_run_flags()


def load_plugins(modules) -> None:
  """Import each module (a proposer registers itself when imported); a module that does not import is an error."""
  for name in modules or ():
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ValueError(f"--plugins: cannot import {name!r}: {e}") from None


def settings(more: tuple = (), defaults: dict | None = None) -> dict:
  """The config file's fields, overridden by the run flags and `more` (a command's own flag names) where given,
  then `defaults` for what is still unset."""
  values = flags.FLAGS
  load_plugins(values["plugins"].value)
  cfg = dict(_config.value)
  for name in RUN_FLAGS + tuple(more):
    if values[name].present or (values[name].value is not None and name not in cfg):
      cfg[name] = values[name].value
  for name, default in (defaults or {}).items():
    cfg.setdefault(name, default)
  return cfg
