"""One entry point for a target: its weights and tokenizer, from a GGUF file, an HF safetensors directory, or the
packaged default.

The tokenizer is built here, above both: `spec_jax.tokenizer` imports nothing from `checkpoints`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from spec_jax.checkpoints.gguf_meta import default_model_path

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
  return DTYPES[name]


def cpu_layout(params: dict) -> dict:
  """bfloat16 on XLA:CPU: keep the 262k-row embedding/head in bfloat16 (half the bytes of the biggest read) but
  the layer stack in float32 (a no-op elsewhere). XLA:CPU converts scanned bfloat16 layer weights to float32 on
  every call (~90 ms a step for Gemma 3 270M, measured with jax.profiler), which costs more than the bytes it
  saves. Quantized params (spec_jax/quant.py) keep their float leaves in float32 on CPU too: qdot computes
  in float32 there."""
  from spec_jax.quant import QTensor, cast_floats
  if jax.default_backend() != "cpu" or params["final_norm"].dtype != jnp.bfloat16:
    return params
  if isinstance(params["embed"], QTensor):
    return cast_floats(params, jnp.float32)
  if params["embed"].dtype != jnp.bfloat16:
    return params
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  return {**params, "layers": f32(params["layers"]), "final_norm": f32(params["final_norm"])}


def load_tokenizer(path: str | None = None, *, use_cache: bool = True):
  """The tokenizer of a checkpoint: an HF directory's `tokenizer.model`, or one built from a GGUF's metadata
  (cached beside the GGUF). `path` None or "" is the packaged Gemma 3 270M."""
  from spec_jax.tokenizer import Tokenizer
  if path and os.path.isdir(path):
    tok_file = os.path.join(path, "tokenizer.model")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"{path} has no tokenizer.model (SentencePiece) next to its weights")
    return Tokenizer.from_model_file(tok_file)
  from spec_jax.checkpoints.gguf_tokenizer import tokenizer_proto
  path = path or default_model_path()
  return Tokenizer(tokenizer_proto(path, use_cache=use_cache), source=path)


def load_model(path: str | None = None, dtype: str = "float32", quantize: str = "none"):
  """-> (ModelConfig, params, tokenizer). `path` None or "" is the packaged Gemma 3 270M. `quantize` int8 or
  int4 quantizes the weight matrices (spec_jax/quant.py; a GGUF's result is cached beside it)."""
  config, params = load_params(path, dtype, quantize)
  return config, params, load_tokenizer(path if path and os.path.isdir(path) else path or default_model_path())


def load_params(path: str | None = None, dtype: str = "float32", quantize: str = "none"):
  """-> (ModelConfig, params): load_model without the tokenizer."""
  from spec_jax import quant
  dt = parse_dtype(dtype)
  if quantize not in quant.MODES:
    raise ValueError(f"quantize must be one of {quant.MODES}, got {quantize!r}")
  if path and os.path.isdir(path):
    from spec_jax.checkpoints.safetensors_loader import load_hf
    config, params = load_hf(path, dtype=dt)
    return config, cpu_layout(quant.quantize_params(params, quantize))
  from spec_jax.checkpoints.gguf_loader import load_gguf
  path = path or default_model_path()
  if quantize == "none":
    config, params = load_gguf(path, dtype=dt)
  else:
    from spec_jax.checkpoints.gguf_loader import load_config
    from spec_jax.checkpoints.quant_cache import load_quantized
    config = load_config(path)
    params = load_quantized(path, quantize, config, lambda: load_gguf(path, dtype=jnp.float32)[1], dt)
  return config, cpu_layout(params)
