"""Quantized weights, built once per checkpoint and mode, cached beside the source as safetensors.

Quantizing Gemma 3 270M's 262k-row embedding takes seconds, so the result is kept like the dequantized GGUF
cache: `<source>.spec_jax.<mode>.safetensors` plus a JSON record of the source's fingerprint, the format, the
QTensor statics and the file's sha256. A cache is used only when all of these match and every tensor has the
name, shape and dtype that quantizing this config gives; anything else (a replaced source, a truncated or
flipped byte, an older layout) is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

from spec_jax import quant
from spec_jax.checkpoints import safetensors_io
from spec_jax.checkpoints.file_cache import atomic_write_bytes, cache_path, fingerprint
from spec_jax.models.transformer import param_shapes

FORMAT = "3"
log = logging.getLogger("spec_jax.load")


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _expected_dtype(name: str, mode: str):
  if name.endswith(".values"):
    return np.int8 if mode == "int8" else np.uint8
  if name.endswith((".scale", ".offset")):
    return np.float32 if mode == "int8" else np.float16
  return None  # float leaves: the source's dtype


def read_cache(source: str, mode: str, config) -> dict | None:
  """The cached quantized params of `source` (numpy-backed jax arrays), or None when absent or not valid."""
  cpath = cache_path(source, f".spec_jax.{mode}.safetensors")
  meta_path = cpath + ".json"
  if not (os.path.exists(cpath) and os.path.exists(meta_path)):
    return None
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    if (meta.get("format") != FORMAT or meta.get("mode") != mode or meta.get("source") != fingerprint(source)
        or meta.get("sha256") != _sha256(cpath)):
      return None
    arrays = safetensors_io.read(cpath)
    want = quant.expected_shapes(param_shapes(config), mode)
    if set(arrays) != set(want) or any(tuple(arrays[k].shape) != tuple(v) for k, v in want.items()):
      return None
    if any((d := _expected_dtype(k, mode)) is not None and arrays[k].dtype != d for k in arrays):
      return None
    return {"arrays": arrays, "statics": meta["statics"]}
  except (OSError, ValueError, KeyError, TypeError):
    return None  # unreadable: rebuilt


def write_cache(source: str, mode: str, params: dict) -> str:
  cpath = cache_path(source, f".spec_jax.{mode}.safetensors")
  arrays, statics = quant.flatten(params)
  safetensors_io.write(cpath, arrays)
  meta = {"format": FORMAT, "mode": mode, "source": fingerprint(source), "sha256": _sha256(cpath),
          "statics": statics}
  atomic_write_bytes(cpath + ".json", json.dumps(meta).encode())  # its own temporary file: writers may race
  return cpath


def load_quantized(source: str, mode: str, config, load_float, dtype, use_cache: bool = True) -> dict:
  """Quantized params of a checkpoint file: from the cache when valid, else quantized from
  `load_float()` (-> float params) and cached. Float leaves (norms, biases) take `dtype`."""
  cached = read_cache(source, mode, config) if use_cache else None
  if cached is not None:
    log.info("read the %s weights cached beside %s", mode, os.path.basename(source))
    return quant.unflatten(cached["arrays"], cached["statics"], dtype)
  params = load_float()
  log.info("quantizing to %s (once: cached beside %s)", mode, os.path.basename(source))
  params = quant.quantize_params(params, mode)
  if use_cache:
    write_cache(source, mode, params)
  return quant.cast_floats(params, dtype)
