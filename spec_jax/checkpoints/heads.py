"""Checkpoints of trained draft heads: `<stem>.safetensors` (bfloat16 weights, int32 d2t) + `<stem>.json`.

`save_heads(..., storage="int8")` stores every weight matrix (not the norms) as int8 with a float32 scale per row of its last axis
(`<name>:scale`), half the bytes of bfloat16, for checkpoints too large for git otherwise (the distilled draft);
loading dequantizes them, so the proposer runs exactly as on the stored values.

The JSON names the kind (medusa / eagle / draft), the target model and a fingerprint of the target's
architecture, the shapes the head was built with, and the reduced draft vocabulary size. Loading checks all of
it against the target at hand, so a head trained for another model fails loudly instead of drafting garbage
(which would still be lossless, only slow).
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from spec_jax import quant
from spec_jax.checkpoints import safetensors_io
from spec_jax.config import ModelConfig

FORMAT_VERSION = 1
_ARCH_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "activation", "post_norms", "qk_norm", "qkv_bias", "rope_base", "rope_base_local",
                "sliding_window", "global_every", "query_pre_attn_scalar", "embed_scale", "tie_embeddings")


def target_fingerprint(config: ModelConfig) -> str:
  """A short hash of the target's architecture (not its name or context length)."""
  arch = {f: getattr(config, f) for f in _ARCH_FIELDS}
  return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _paths(path: str) -> tuple[str, str]:
  stem = path[:-len(".safetensors")] if path.endswith(".safetensors") else path
  stem = stem[:-len(".json")] if stem.endswith(".json") else stem
  return stem + ".safetensors", stem + ".json"


def flatten(tree: dict, prefix: str = "") -> dict:
  """A nested dict of arrays -> {"a/b/c": leaf}, the tensor names a head checkpoint stores."""
  out = {}
  for k, v in tree.items():
    name = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, name + "/"))
    else:
      out[name] = v
  return out


def unflatten(flat: dict) -> dict:
  """The inverse of `flatten`."""
  out: dict = {}
  for name, v in flat.items():
    *parents, leaf = name.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


STORAGES = ("bfloat16", "int8")
_SCALE = ":scale"


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric int8 with one float32 scale per row of the last axis, w ~= q * scale: quant.quantize_matrix's
  int8 rows, out of its tiled layout."""
  w = np.asarray(w, np.float32)
  rows = w.reshape(-1, w.shape[-1])
  q, scale, _ = quant.quantize_matrix(rows, 8)
  n = len(rows)
  return q.reshape(-1, w.shape[-1])[:n].reshape(w.shape), scale.reshape(-1)[:n].reshape(w.shape[:-1] + (1,))


def save_heads(path: str, kind: str, params: dict, target_config: ModelConfig, meta: dict | None = None,
               d2t=None, storage: str = "bfloat16") -> str:
  """Weights in bfloat16, or matrices in int8 (`storage`; d2t stays int32). Returns the .safetensors path."""
  if storage not in STORAGES:
    raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
  st_path, json_path = _paths(path)
  os.makedirs(os.path.dirname(os.path.abspath(st_path)), exist_ok=True)
  flat = {}
  for k, v in flatten(jax.device_get(params)).items():
    v = np.asarray(jnp.asarray(v, jnp.float32))
    if storage == "int8" and v.ndim >= 2 and "norm" not in k.rsplit("/", 1)[-1]:  # norm weights stay float
      flat[k], flat[k + _SCALE] = quantize_int8(v)
    else:
      flat[k] = v.astype(ml_dtypes.bfloat16)
  if d2t is not None:
    flat["d2t"] = np.asarray(d2t, np.int32)
  safetensors_io.write(st_path, flat)
  info = {
      "format_version": FORMAT_VERSION, "kind": kind, "target_name": target_config.name,
      "target_fingerprint": target_fingerprint(target_config), "hidden_size": target_config.d_model,
      "vocab_size": target_config.vocab_size, "draft_vocab_size": int(len(d2t)) if d2t is not None else None,
      "storage": storage, **(meta or {}),
  }
  with open(json_path, "w") as f:
    json.dump(info, f, indent=1, sort_keys=True)
  return st_path


def load_heads(path: str, target_config: ModelConfig, kind: str, dtype=jnp.float32):
  """-> (meta, params, d2t | None), checked against the target. Raises ValueError naming what does not fit."""
  st_path, json_path = _paths(path)
  for p in (st_path, json_path):
    if not os.path.exists(p):
      raise FileNotFoundError(f"head checkpoint file {p} does not exist")
  with open(json_path) as f:
    meta = json.load(f)
  if meta.get("kind") != kind:
    raise ValueError(f"{json_path}: a {meta.get('kind')!r} head checkpoint, but a {kind!r} head was asked for")
  fp = target_fingerprint(target_config)
  if meta.get("target_fingerprint") != fp:
    raise ValueError(f"{json_path}: trained for target {meta.get('target_name')!r} (fingerprint "
                     f"{meta.get('target_fingerprint')}), but the target is {target_config.name!r} (fingerprint {fp})")
  for field, want in (("hidden_size", target_config.d_model), ("vocab_size", target_config.vocab_size)):
    if meta.get(field) != want:
      raise ValueError(f"{json_path}: {field} is {meta.get(field)}, the target's is {want}")
  flat = safetensors_io.read(st_path)
  d2t = flat.pop("d2t", None)
  if d2t is not None:
    check_d2t(d2t, target_config.vocab_size, where=st_path)
    if meta.get("draft_vocab_size") != len(d2t):
      raise ValueError(f"{st_path}: d2t has {len(d2t)} entries, the metadata says {meta.get('draft_vocab_size')}")
  for name in [n for n in flat if n.endswith(_SCALE)]:
    scale, q = flat.pop(name), flat.get(name[:-len(_SCALE)])
    if q is None or q.dtype != np.int8 or scale.shape != q.shape[:-1] + (1,):
      raise ValueError(f"{st_path}: {name} does not scale an int8 tensor {name[:-len(_SCALE)]!r}")
    flat[name[:-len(_SCALE)]] = q.astype(np.float32) * scale
  if any(a.dtype == np.int8 for a in flat.values()):
    raise ValueError(f"{st_path}: an int8 tensor has no {_SCALE} tensor")
  params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32), dtype), unflatten(flat))
  return meta, params, (jnp.asarray(d2t, jnp.int32) if d2t is not None else None)


def check_shapes(params: dict, want: dict, where: str) -> None:
  """want: the same tree of shape tuples. Names the first missing, extra or mis-shaped tensor."""
  got = {k: tuple(np.shape(v)) for k, v in flatten(params).items()}
  need = flatten(want)
  for k in sorted(set(need) | set(got)):
    if k not in got:
      raise ValueError(f"{where}: tensor {k!r} is missing (expected shape {need[k]})")
    if k not in need:
      raise ValueError(f"{where}: unexpected tensor {k!r} of shape {got[k]}")
    if got[k] != tuple(need[k]):
      raise ValueError(f"{where}: tensor {k!r} has shape {got[k]}, expected {tuple(need[k])}")


def check_d2t(d2t, vocab_size: int, where: str = "d2t") -> None:
  d2t = np.asarray(d2t)
  if d2t.ndim != 1 or d2t.size == 0:
    raise ValueError(f"{where}: d2t must be a non-empty 1-D array, got shape {d2t.shape}")
  if d2t.min() < 0 or d2t.max() >= vocab_size:
    raise ValueError(f"{where}: d2t ids must lie in [0, {vocab_size}), got [{d2t.min()}, {d2t.max()}]")
  if len(np.unique(d2t)) != len(d2t):
    raise ValueError(f"{where}: d2t holds duplicate target ids")


def make_d2t(token_counts, n: int) -> np.ndarray:
  """The n most frequent target ids (ties to the lower id), sorted by id: draft id -> target id."""
  counts = np.asarray(token_counts, np.int64)
  n = min(n, len(counts))
  order = np.lexsort((np.arange(len(counts)), -counts))[:n]
  return np.sort(order).astype(np.int32)


def t2d(d2t, vocab_size: int) -> jax.Array:
  """Target id -> draft id, -1 for ids outside the draft vocabulary (traceable: serve.aot builds it from shapes)."""
  d2t = jnp.asarray(d2t, jnp.int32)
  return jnp.full((vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))
