"""One entry point for target weights: a GGUF file, an HF safetensors directory, or the packaged default."""

from __future__ import annotations

import os

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
  return DTYPES[name]


def load_model(path: str | None = None, dtype: str = "float32"):
  """-> (ModelConfig, params, tokenizer). `path` None or "" is the packaged Gemma 3 270M."""
  from spec_jax.tokenizer import Tokenizer
  dt = parse_dtype(dtype)
  if path and os.path.isdir(path):
    from spec_jax.checkpoints.safetensors_loader import load_hf
    config, params = load_hf(path, dtype=dt)
    tok_file = os.path.join(path, "tokenizer.model")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"{path} has no tokenizer.model (SentencePiece) next to its weights")
    return config, params, Tokenizer.from_model_file(tok_file)
  from spec_jax.checkpoints.gguf_loader import default_model_path, load_gguf
  path = path or default_model_path()
  config, params = load_gguf(path, dtype=dt)
  return config, params, Tokenizer.from_gguf(path)
