"""The run settings of `serve.generate`, the server, `serve.calibrate` and `serve.evaluate`: a config file
(`--config`, ml_collections) gives them; a flag given on the command line overrides its field, and a flag the
config lacks fills it in. The flags are rows of spec_jax/flag_table.py; the speculation settings are one
SpecConfig (spec_jax/spec_config.py), cfg["spec"].
"""

from __future__ import annotations

import importlib
import logging
import os

from absl import flags

from spec_jax import flag_table, spec_config

# absl's default verbosity is INFO, which would print jax's backend probing ("Unable to initialize backend 'tpu'")
# at every start of a command on a machine without that chip.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "gemma3_270m.py")


# The target's, sampling's and speculation's rows of spec_jax/flag_table.py that every run command takes.
RUN_FLAGS = ("plugins", "model", "dtype", "attention_impl", "kv_cache_dtype", "max_new_tokens", "temperature", "top_k",
             "top_p", "seed", "quantize", "adaptive", "mesh", "costs_file")
_config = None


def define(*more: str) -> None:
  """--config, the run flags and the speculative config's, and `more` rows of the table. Idempotent: a process may
  import several commands (the tests do)."""
  global _config
  _config = flag_table.define_config(DEFAULT_CONFIG)
  flag_table.define(RUN_FLAGS + flag_table.SPEC_ROWS + tuple(more))


def load_plugins(modules) -> None:
  """Import each module (a proposer registers itself when imported); a module that does not import is an error."""
  for name in modules or ():
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ValueError(f"--plugins: cannot import {name!r}: {e}") from None


def settings(more: tuple = (), defaults: dict | None = None) -> dict:
  """The config file's fields, overridden by the run flags and `more` (a command's own flag names) where given,
  then `defaults` for what is still unset. cfg["spec"] is the SpecConfig: the config file's `speculative_config`,
  or --speculative_config's instead, with the single speculation flags given on the command line over it."""
  values = flags.FLAGS
  load_plugins(values["plugins"].value)
  cfg = _config.value.to_dict()
  spec = cfg.pop("speculative_config", None) or {}
  for name in RUN_FLAGS + tuple(more):
    if values[name].present or (values[name].value is not None and name not in cfg):
      cfg[name] = values[name].value
  for name, default in (defaults or {}).items():
    cfg.setdefault(name, default)
  cfg["spec"] = speculative_config(spec)
  return cfg


def speculative_config(config_file_spec: dict):
  """The SpecConfig of this run (see settings)."""
  values = flags.FLAGS
  text = values["speculative_config"].value
  if text is not None and text.strip():
    obj, what = spec_config.read_json_arg(text, "--speculative_config"), "--speculative_config"
  else:
    obj, what = dict(config_file_spec), "the config's speculative_config"
  for key in spec_config.ENTRY_KEYS:
    name = flag_table.SPEC_FLAG_NAMES.get(key, key)
    if values[name].present:
      obj[key] = values[name].value
      what = "the speculation flags"
  return spec_config.from_dict(obj, what)
