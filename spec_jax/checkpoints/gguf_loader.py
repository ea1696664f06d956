"""GGUF (llama.cpp) checkpoints: config from metadata, dequantized params, cached next to the file.

Reading a GGUF parses 262k token strings and dequantizes Q4/Q5/Q6/Q8 blocks (10-15 s here); the result is
cached as a float32 safetensors file beside the GGUF, keyed by the GGUF's fingerprint, so later loads take
seconds and a replaced GGUF is noticed. Tensor names and the layout conversion are spec_jax/models/schema.py's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints import safetensors_io
from spec_jax.checkpoints.file_cache import atomic_write_bytes, cache_path, fingerprint
from spec_jax.checkpoints.gguf_meta import DEFAULT_MODEL_FILE, default_model_path, field, open_reader
from spec_jax.config import FAMILIES, ModelConfig, family_config
from spec_jax.models import schema

__all__ = ["CACHE_SUFFIX", "DEFAULT_MODEL_FILE", "config_from_reader", "default_model_path", "load_config", "load_gguf"]

CACHE_SUFFIX = ".spec_jax.safetensors"
CACHE_FORMAT = "2"
SUPPORTED_ARCHS = ("gemma3", "qwen2")
log = logging.getLogger("spec_jax.load")  # progress of the slow steps (serve.generate prints it)

def config_from_reader(reader, path: str) -> ModelConfig:
  arch = field(reader, "general.architecture", "?")
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(f"{path}: unknown architecture {arch!r}; supported: {SUPPORTED_ARCHS}")
  a = arch
  n_embd = int(field(reader, f"{a}.embedding_length"))
  n_head = int(field(reader, f"{a}.attention.head_count"))
  head_dim = int(field(reader, f"{a}.attention.key_length", n_embd // n_head))
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  names = {t.name: t for t in reader.tensors}
  embd = names.get("token_embd.weight")
  if embd is None:
    raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
  vocab = int(embd.shape[1])
  if tokens is not None and len(tokens.data) != vocab:
    raise ValueError(f"{path}: tokenizer has {len(tokens.data)} tokens but token_embd has {vocab} rows")
  common = dict(
      vocab_size=vocab, d_model=n_embd, num_layers=int(field(reader, f"{a}.block_count")),
      num_heads=n_head, num_kv_heads=int(field(reader, f"{a}.attention.head_count_kv", n_head)),
      head_dim=head_dim, mlp_dim=int(field(reader, f"{a}.feed_forward_length")),
      norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
      max_seq_len=int(field(reader, f"{a}.context_length", 32768)),
      name=str(field(reader, "general.name", "gguf")),
  )
  if arch == "qwen2":
    # Full attention in every layer (the GGUF has no sliding-window schedule), SwiGLU, QKV biases, plain RoPE.
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    base = float(field(reader, f"{a}.rope.freq_base", 1e6))
    return family_config(
        "qwen2", **common, rope_base=base, rope_base_local=base, tie_embeddings="output.weight" not in names,
        bos_id=int(field(reader, "tokenizer.ggml.bos_token_id", eos)), eos_ids=(eos,),
        pad_id=int(field(reader, "tokenizer.ggml.padding_token_id", eos)),
    )
  g = FAMILIES["gemma3"]  # what the file leaves out
  eos = int(field(reader, "tokenizer.ggml.eos_token_id", g["eos_ids"][0]))
  # A chat turn ends with <end_of_turn>, which Gemma's tokenizer metadata does not mark as an end token.
  turn_end = _token_id(tokens, "<end_of_turn>")
  return family_config(
      "gemma3", **common, rope_base=float(field(reader, f"{a}.rope.freq_base", g["rope_base"])),
      sliding_window=int(field(reader, f"{a}.attention.sliding_window", g["sliding_window"])),
      global_every=_global_every(reader, a, common["num_layers"], path),
      # The GGUF has no query_pre_attn_scalar; as llama.cpp does: d_model / heads for the 62-layer 27B, else head_dim.
      query_pre_attn_scalar=float(n_embd // n_head if common["num_layers"] == 62 else head_dim),
      bos_id=int(field(reader, "tokenizer.ggml.bos_token_id", g["bos_id"])),
      eos_ids=(eos,) if turn_end in (None, eos) else (eos, turn_end),
      pad_id=int(field(reader, "tokenizer.ggml.padding_token_id", g["pad_id"])),
  )


def _token_id(tokens, text: str):
  """The id of the token spelled `text` in the GGUF vocabulary, or None."""
  if tokens is None:
    return None
  for i, idx in enumerate(tokens.data):
    if bytes(tokens.parts[idx]) == text.encode():
      return i
  return None


def _global_every(reader, arch: str, num_layers: int, path: str) -> int:
  """Every how many layers one attends globally. A GGUF may hold the per-layer pattern
  (`<arch>.attention.sliding_window_pattern`, true where the layer is local); Gemma 3's conversions carry none,
  and llama.cpp fixes it at every sixth layer for the architecture, as its config.json does."""
  pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
  if pattern is None:
    return FAMILIES["gemma3"]["global_every"]
  value = pattern.contents()
  if isinstance(value, int):
    return value
  local = [bool(v) for v in value]
  period = local.index(False) + 1 if False in local else 0
  if not period or local != [(i + 1) % period != 0 for i in range(num_layers)]:
    raise ValueError(f"{path}: sliding_window_pattern {local} is not one global layer every N")
  return period


def _dequantize_all(reader, config: ModelConfig, path: str) -> dict:
  """Every tensor dequantized to float32 straight into its place in the stacked params, one at a time, so the
  peak is about one float copy of the model (a 1.5B model is 7 GB in float32)."""
  import gguf  # lazy: heavy, only this path (gguf)

  c = config
  rows = {r.gguf: r for r in schema.top_rows(c)}
  blocks = {r.gguf.removeprefix("blk.{i}."): r for r in schema.layer_rows(c)}  # by the name after "blk.N."
  layers = {r.name: np.empty((c.num_layers,) + r.shape(c), np.float32) for r in schema.layer_rows(c)}
  seen = set()
  params = {"layers": layers}
  for t in reader.tensors:
    if t.name.startswith("blk."):
      _, i, rest = t.name.split(".", 2)
      row = blocks.get(rest)
      if row is None:
        continue  # a tensor this architecture does not use (e.g. precomputed rope factors)
      if not i.isdigit() or int(i) >= c.num_layers:
        raise ValueError(f"{path}: tensor {t.name!r} names block {i}, but the file has {c.num_layers} blocks")
      where = (row.name, int(i))
    elif t.name in rows:
      row = rows[t.name]
      where = (row.name, None)
    else:
      continue
    try:
      w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    except Exception as e:
      raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {e}") from e
    want = row.shape(c)
    # Dequantized matrices are in torch order ([out, in]), as HF's.
    out = schema.from_torch(row, w, want)
    if out is None:
      raise ValueError(f"{path}: tensor {t.name} has shape {w.shape}, expected {schema.torch_shape(row, want)}")
    if where[1] is None:
      params[row.name] = np.ascontiguousarray(out)
    else:
      layers[row.name][where[1]] = out
    seen.add(where)
  missing = [f"{r.gguf} ({r.name})" for r in schema.top_rows(c) if (r.name, None) not in seen]
  missing += [f"{r.gguf.format(i=i)} ({r.name}[{i}])" for r in schema.layer_rows(c) for i in range(c.num_layers)
              if (r.name, i) not in seen]
  if missing:
    raise ValueError(f"{path}: tensor {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''} is missing")
  return params


def _flatten(params: dict) -> dict:
  flat = {k: v for k, v in params.items() if k != "layers"}
  flat.update({f"layers.{k}": v for k, v in params["layers"].items()})
  return flat


def _unflatten(flat: dict) -> dict:
  params = {"layers": {}}
  for k, v in flat.items():
    if k.startswith("layers."):
      params["layers"][k[len("layers."):]] = v
    else:
      params[k] = v
  return params


def _config_to_json(c: ModelConfig) -> str:
  return json.dumps(dataclasses.asdict(c))


def _config_from_json(s: str) -> ModelConfig:
  d = json.loads(s)
  d["eos_ids"] = tuple(d["eos_ids"])
  return ModelConfig(**d)


def load_config(path: str | None = None) -> ModelConfig:
  """The ModelConfig of a GGUF: from its float cache's record when that matches the file, else its metadata."""
  path = path or default_model_path()
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  meta_path = cache_path(path, CACHE_SUFFIX) + ".json"
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get("fingerprint") == fingerprint(path) and meta.get("format") == CACHE_FORMAT:
      return _config_from_json(meta["config"])
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return config_from_reader(open_reader(path), path)


def load_gguf(path: str | None = None, dtype=jnp.float32, use_cache: bool = True):
  """-> (ModelConfig, params as numpy-backed jnp arrays of `dtype`). Builds the cache on first use."""
  path = path or default_model_path()
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  fp = fingerprint(path)
  cpath = cache_path(path, CACHE_SUFFIX)
  meta_path = cpath + ".json"
  flat = None
  if use_cache and os.path.exists(cpath) and os.path.exists(meta_path):
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      if meta.get("fingerprint") == fp and meta.get("format") == CACHE_FORMAT:
        config = _config_from_json(meta["config"])
        log.info("reading the dequantized weights cached at %s", cpath)
        flat = safetensors_io.read(cpath)
    except Exception:
      flat = None  # a damaged cache is rebuilt, never trusted
  if flat is None:
    log.info("dequantizing %s (once: the result is cached%s)", os.path.basename(path),
             f" at {cpath}" if use_cache else " only when use_cache")
    reader = open_reader(path)
    config = config_from_reader(reader, path)
    flat = _flatten(_dequantize_all(reader, config, path))
    del reader
    if use_cache:
      # Two processes loading a new file at once both build it: each writes its own temporary files and renames
      # them over the cache (identical bytes), so neither fails and a reader never finds half a file.
      safetensors_io.write(cpath, flat)
      meta = {"fingerprint": fp, "format": CACHE_FORMAT, "config": _config_to_json(config)}
      atomic_write_bytes(meta_path, json.dumps(meta).encode())
  converted = {}
  for k in list(flat):  # one leaf at a time, dropping the float32 source as we go (peak: model + one leaf)
    converted[k] = jnp.asarray(flat.pop(k), dtype)
  return config, _unflatten(converted)
