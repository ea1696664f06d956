"""GGUF (llama.cpp) checkpoints: config from metadata, dequantized params, cached next to the file.

Reading a GGUF parses 262k token strings and dequantizes Q4/Q5/Q6/Q8 blocks (10-15 s here); the result is
cached as a float32 safetensors file beside the GGUF, keyed by the GGUF's fingerprint, so later loads take
seconds and a replaced GGUF is noticed.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints import safetensors_io
from spec_jax.checkpoints.file_cache import cache_path, fingerprint
from spec_jax.checkpoints.gguf_meta import DEFAULT_MODEL_FILE, default_model_path, field, open_reader
from spec_jax.config import ModelConfig

__all__ = ["CACHE_SUFFIX", "DEFAULT_MODEL_FILE", "config_from_reader", "default_model_path", "load_config", "load_gguf"]

CACHE_SUFFIX = ".spec_jax.safetensors"
CACHE_FORMAT = "2"
SUPPORTED_ARCHS = ("gemma3",)

# GGUF tensor name (per block) -> (our layer param, how to reshape the dequantized [out, in] matrix)
_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
    "ffn_norm": "mlp_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "post_ffw_norm": "post_mlp_norm",
}


def config_from_reader(reader, path: str) -> ModelConfig:
  arch = field(reader, "general.architecture", "?")
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(f"{path}: unknown architecture {arch!r}; supported: {SUPPORTED_ARCHS}")
  a = arch
  n_embd = int(field(reader, f"{a}.embedding_length"))
  n_head = int(field(reader, f"{a}.attention.head_count"))
  head_dim = int(field(reader, f"{a}.attention.key_length", n_embd // n_head))
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embd is None:
    raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
  vocab = int(embd.shape[1])
  if tokens is not None and len(tokens.data) != vocab:
    raise ValueError(f"{path}: tokenizer has {len(tokens.data)} tokens but token_embd has {vocab} rows")
  return ModelConfig(
      vocab_size=vocab, d_model=n_embd, num_layers=int(field(reader, f"{a}.block_count")),
      num_heads=n_head, num_kv_heads=int(field(reader, f"{a}.attention.head_count_kv", n_head)),
      head_dim=head_dim, mlp_dim=int(field(reader, f"{a}.feed_forward_length")),
      activation="gelu_tanh", norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
      post_norms=True, qk_norm=True, qkv_bias=False,
      rope_base=float(field(reader, f"{a}.rope.freq_base", 1e6)), rope_base_local=10_000.0,
      sliding_window=int(field(reader, f"{a}.attention.sliding_window", 512)), global_every=6,
      query_pre_attn_scalar=256.0, embed_scale=True, tie_embeddings=True,
      max_seq_len=int(field(reader, f"{a}.context_length", 32768)),
      bos_id=int(field(reader, "tokenizer.ggml.bos_token_id", 2)),
      eos_ids=(int(field(reader, "tokenizer.ggml.eos_token_id", 1)), 106),
      pad_id=int(field(reader, "tokenizer.ggml.padding_token_id", 0)),
      name=str(field(reader, "general.name", "gguf")),
  )


def _dequantize_all(reader, config: ModelConfig, path: str) -> dict:
  import gguf
  from spec_jax.models.transformer import param_shapes
  arrays = {}
  for t in reader.tensors:
    try:
      arrays[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    except Exception as e:
      raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {e}") from e

  def take(name):
    if name not in arrays:
      raise ValueError(f"{path}: tensor {name!r} is missing")
    return arrays[name]

  c = config
  H, K, d, D = c.num_heads, c.num_kv_heads, c.head_dim, c.d_model
  # Dequantized matrices are [out, in] (torch Linear order); ours are [in, ...out].
  reshape = {
      "q": lambda w: w.T.reshape(D, H, d), "k": lambda w: w.T.reshape(D, K, d),
      "v": lambda w: w.T.reshape(D, K, d), "o": lambda w: w.T.reshape(H, d, D),
      "gate": lambda w: w.T, "up": lambda w: w.T, "down": lambda w: w.T,
  }
  shapes = param_shapes(c)
  layers = {}
  for gname, ours in _LAYER_TENSORS.items():
    if ours not in shapes["layers"]:
      continue
    per_layer = []
    for i in range(c.num_layers):
      w = take(f"blk.{i}.{gname}.weight")
      want = shapes["layers"][ours][1:]
      fn = reshape.get(ours, lambda w: w)
      try:
        w = fn(w)
      except ValueError:
        pass
      if w.shape != want:
        raise ValueError(f"{path}: tensor blk.{i}.{gname}.weight has shape {w.shape}, expected {want}")
      per_layer.append(w)
    layers[ours] = np.stack(per_layer)
  params = {"embed": take("token_embd.weight"), "final_norm": take("output_norm.weight"), "layers": layers}
  if params["embed"].shape != shapes["embed"]:
    raise ValueError(f"{path}: token_embd has shape {params['embed'].shape}, expected {shapes['embed']}")
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
  import dataclasses
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
        flat = safetensors_io.read(cpath)
    except Exception:
      flat = None  # a damaged cache is rebuilt, never trusted
  if flat is None:
    reader = open_reader(path)
    config = config_from_reader(reader, path)
    flat = _flatten(_dequantize_all(reader, config, path))
    del reader
    if use_cache:
      safetensors_io.write(cpath, flat)
      with open(meta_path + ".tmp", "w") as f:
        json.dump({"fingerprint": fp, "format": CACHE_FORMAT, "config": _config_to_json(config)}, f)
      os.replace(meta_path + ".tmp", meta_path)
  params = _unflatten({k: jnp.asarray(v, dtype) for k, v in flat.items()})
  return config, params
